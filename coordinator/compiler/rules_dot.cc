// The sharding rule of dot_general: batch dimensions keep their axes, free dimensions keep
// their operand's, and contracting dimensions split the same way on both sides leave a partial
// sum over those axes (GSPMD).
#include "absl/status/status.h"
#include "coordinator/compiler/rules.h"

namespace tessera::internal {
namespace {

absl::Status dot(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const DotDims& dd = n.attrs<DotAttrs>().dims;
  const Shape& ls = c.graph().node(n.operands[0]).shape;
  const Shape& rs = c.graph().node(n.operands[1]).shape;
  const ValueSharding l = c.of_or_replicated(n.operands[0]);
  const ValueSharding r = c.of_or_replicated(n.operands[1]);
  Dims ql(ls.size()), qr(rs.size());
  std::set<std::string> taken;
  std::vector<std::string> partial;
  // Contracting first: they decide the partial axes.
  for (size_t i = 0; i < dd.lhs_contracting.size(); ++i) {
    const int64_t a = dd.lhs_contracting[i], b = dd.rhs_contracting[i];
    Axes axes = c.usable(!l.dims[a].empty() ? l.dims[a] : r.dims[b], ls[a], &taken);
    ql[a] = qr[b] = axes;
    partial.insert(partial.end(), axes.begin(), axes.end());
  }
  for (size_t i = 0; i < dd.lhs_batch.size(); ++i) {
    const int64_t a = dd.lhs_batch[i], b = dd.rhs_batch[i];
    ql[a] = qr[b] = c.usable(!l.dims[a].empty() ? l.dims[a] : r.dims[b], ls[a], &taken);
  }
  Dims result;
  for (int64_t a : dd.lhs_batch) result.push_back(ql[a]);
  for (int64_t d : dot_free_dims(static_cast<int64_t>(ls.size()), dd.lhs_batch, dd.lhs_contracting)) {
    result.push_back(ql[d] = c.usable(l.dims[d], ls[d], &taken));
  }
  for (int64_t d : dot_free_dims(static_cast<int64_t>(rs.size()), dd.rhs_batch, dd.rhs_contracting)) {
    result.push_back(qr[d] = c.usable(r.dims[d], rs[d], &taken));
  }
  c.needs(id) = {ValueSharding{ql, {}, ReduceOp::kSum}, ValueSharding{qr, {}, ReduceOp::kSum}};
  c.set(id, result, partial);
  return absl::OkStatus();
}

// Batch and free dimensions follow the result's; contracting ones follow nothing.
DimMap dot_map(const Graph& g, const Node& n) {
  const DotDims& dd = n.attrs<DotAttrs>().dims;
  DimMap m{{std::vector<int>(g.node(n.operands[0]).shape.size(), -1),
            std::vector<int>(g.node(n.operands[1]).shape.size(), -1)},
           std::vector<bool>(n.shape.size(), true)};
  int r = 0;
  for (size_t i = 0; i < dd.lhs_batch.size(); ++i, ++r) m.follow[0][dd.lhs_batch[i]] = m.follow[1][dd.rhs_batch[i]] = r;
  for (int64_t d : dot_free_dims(static_cast<int64_t>(m.follow[0].size()), dd.lhs_batch, dd.lhs_contracting)) {
    m.follow[0][d] = r++;
  }
  for (int64_t d : dot_free_dims(static_cast<int64_t>(m.follow[1].size()), dd.rhs_batch, dd.rhs_contracting)) {
    m.follow[1][d] = r++;
  }
  return m;
}

}  // namespace

absl::Span<const ShardingRuleEntry> dot_rules() {
  static constexpr ShardingRuleEntry kRules[] = {{Op::kDotGeneral, {dot, dot_map}}};
  return kRules;
}

}  // namespace tessera::internal

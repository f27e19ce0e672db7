// The sharding rule of dot_general: batch dimensions keep their axes, free dimensions keep
// their operand's, and contracting dimensions split the same way on both sides leave a partial
// sum over those axes (GSPMD). When the operands' splits conflict (an axis wanted by a free or
// batch dimension of one operand and by a contracting dimension of the other, as in FSDP's
// `x P('data', None) @ w P('data', None)`), the rule costs each way of settling it — the bytes
// the operands' reshards move plus the reduction a partial result will need — and takes the
// cheapest, as XLA's dot handler chooses among its strategies: gathering a weight instead of
// moving the activations and reducing a full-batch partial product.
#include <array>

#include "absl/status/status.h"
#include "coordinator/compiler/rules.h"

namespace tessera::internal {
namespace {

struct DotChoice {
  Dims lhs, rhs, result;
  std::vector<std::string> partial;
};

// The dimension groups of a contraction, in the order they claim mesh axes (an axis is used
// once per value: the first group that wants it gets it).
enum class Group { kContracting, kBatch, kLhsFree, kRhsFree };

// The layouts when the groups claim axes in `order`; a contracting or batch pair takes the lhs
// operand's split, or the rhs's when it has none (the other way round with `rhs_first`).
DotChoice assign(ShardingContext& c, const Node& n, const ValueSharding& l, const ValueSharding& r,
                 const std::array<Group, 4>& order, bool rhs_first) {
  const DotDims& dd = n.attrs<DotAttrs>().dims;
  const Shape& ls = c.graph().node(n.operands[0]).shape;
  const Shape& rs = c.graph().node(n.operands[1]).shape;
  const std::vector<int64_t> lfree = dot_free_dims(static_cast<int64_t>(ls.size()), dd.lhs_batch, dd.lhs_contracting);
  const std::vector<int64_t> rfree = dot_free_dims(static_cast<int64_t>(rs.size()), dd.rhs_batch, dd.rhs_contracting);
  DotChoice out{Dims(ls.size()), Dims(rs.size()), {}, {}};
  std::set<std::string> taken;
  auto pair = [&](int64_t a, int64_t b) {
    const Axes& first = rhs_first ? r.dims[b] : l.dims[a];
    const Axes& second = rhs_first ? l.dims[a] : r.dims[b];
    return c.usable(!first.empty() ? first : second, ls[a], &taken);
  };
  for (Group group : order) {
    switch (group) {
      case Group::kContracting:
        for (size_t i = 0; i < dd.lhs_contracting.size(); ++i) {
          const int64_t a = dd.lhs_contracting[i], b = dd.rhs_contracting[i];
          out.lhs[a] = out.rhs[b] = pair(a, b);
          out.partial.insert(out.partial.end(), out.lhs[a].begin(), out.lhs[a].end());
        }
        break;
      case Group::kBatch:
        for (size_t i = 0; i < dd.lhs_batch.size(); ++i) {
          const int64_t a = dd.lhs_batch[i], b = dd.rhs_batch[i];
          out.lhs[a] = out.rhs[b] = pair(a, b);
        }
        break;
      case Group::kLhsFree:
        for (int64_t d : lfree) out.lhs[d] = c.usable(l.dims[d], ls[d], &taken);
        break;
      case Group::kRhsFree:
        for (int64_t d : rfree) out.rhs[d] = c.usable(r.dims[d], rs[d], &taken);
        break;
    }
  }
  for (int64_t a : dd.lhs_batch) out.result.push_back(out.lhs[a]);
  for (int64_t d : lfree) out.result.push_back(out.lhs[d]);
  for (int64_t d : rfree) out.result.push_back(out.rhs[d]);
  return out;
}

absl::Status dot(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ValueSharding l = c.of_or_replicated(n.operands[0]);
  const ValueSharding r = c.of_or_replicated(n.operands[1]);
  // Contracting dimensions first (GSPMD's default: a split contraction stays a partial sum),
  // then each variant; among equal costs the earliest wins.
  using G = Group;
  static constexpr std::array<std::array<Group, 4>, 4> kOrders = {{
      {G::kContracting, G::kBatch, G::kLhsFree, G::kRhsFree},
      {G::kContracting, G::kBatch, G::kRhsFree, G::kLhsFree},
      {G::kBatch, G::kLhsFree, G::kRhsFree, G::kContracting},
      {G::kBatch, G::kRhsFree, G::kLhsFree, G::kContracting},
  }};
  std::optional<DotChoice> best;
  double best_cost = 0;
  for (bool rhs_first : {false, true}) {
    for (const std::array<Group, 4>& order : kOrders) {
      DotChoice choice = assign(c, n, l, r, order, rhs_first);
      const ValueSharding ql{choice.lhs, {}, ReduceOp::kSum}, qr{choice.rhs, {}, ReduceOp::kSum};
      const double cost = c.move_cost(n.operands[0], l, ql) + c.move_cost(n.operands[1], r, qr) +
                          c.reduce_cost(id, ValueSharding{choice.result, choice.partial, ReduceOp::kSum});
      if (!best || cost < best_cost) {
        best = std::move(choice);
        best_cost = cost;
      }
    }
  }
  c.needs(id) = {ValueSharding{best->lhs, {}, ReduceOp::kSum}, ValueSharding{best->rhs, {}, ReduceOp::kSum}};
  c.set(id, best->result, best->partial);
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

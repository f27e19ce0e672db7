// Sharding rules of the reductions: reducing a split dimension leaves a pending reduction
// over its axes (a partial value), which the partitioner resolves where a consumer needs it.
#include <algorithm>

#include "absl/status/status.h"
#include "coordinator/compiler/rules.h"

namespace tessera::internal {
namespace {

ReduceOp reduce_op_of(Op op) {
  switch (op) {
    case Op::kReduceSum:
      return ReduceOp::kSum;
    case Op::kReduceMax:
      return ReduceOp::kMax;
    case Op::kReduceMin:
      return ReduceOp::kMin;
    default:
      return ReduceOp::kProd;
  }
}

absl::Status reduce(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  const ReduceOp op = reduce_op_of(n.op);
  if (q.is_partial() && !(op == ReduceOp::kSum && q.partial_op == ReduceOp::kSum)) q.partial.clear();
  Dims d;
  std::vector<std::string> partial = q.partial;
  for (size_t i = 0; i < q.dims.size(); ++i) {
    if (std::binary_search(n.attrs<ReduceAttrs>().axes.begin(), n.attrs<ReduceAttrs>().axes.end(),
                           static_cast<int64_t>(i))) {
      partial.insert(partial.end(), q.dims[i].begin(), q.dims[i].end());
    } else {
      d.push_back(q.dims[i]);
    }
  }
  c.needs(id) = {q};
  c.set(id, d, partial, op);
  return absl::OkStatus();
}

// argmax needs its axis whole: the index of a maximum is not a sum of per-device terms.
absl::Status argmax(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  q.partial.clear();
  q.dims[n.attrs<ArgmaxAttrs>().axis].clear();
  Dims d = q.dims;
  d.erase(d.begin() + n.attrs<ArgmaxAttrs>().axis);
  c.needs(id) = {q};
  c.set(id, d);
  return absl::OkStatus();
}

// argsort needs its axis whole too (gathered: a lane's order depends on all of it); the other
// dimensions keep their splits.
absl::Status argsort(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  q.partial.clear();
  q.dims[n.attrs<ArgmaxAttrs>().axis].clear();
  c.needs(id) = {q};
  c.set(id, q.dims);
  return absl::OkStatus();
}

// Every dimension but the sorted one follows the result.
DimMap argsort_map(const Graph&, const Node& n) {
  const int64_t axis = n.attrs<ArgmaxAttrs>().axis;
  DimMap m{std::vector<std::vector<int>>(1), std::vector<bool>(n.shape.size(), true)};
  for (size_t d = 0; d < n.shape.size(); ++d)
    m.follow[0].push_back(static_cast<int64_t>(d) == axis ? -1 : static_cast<int>(d));
  m.free[axis] = false;
  return m;
}

// Kept dimensions follow the result in order; reduced ones follow nothing.
DimMap reduce_map(const Graph& g, const Node& n) {
  DimMap m{std::vector<std::vector<int>>(1), std::vector<bool>(n.shape.size(), true)};
  const std::vector<int64_t> axes =
      n.op == Op::kArgmax ? std::vector<int64_t>{n.attrs<ArgmaxAttrs>().axis} : n.attrs<ReduceAttrs>().axes;
  int r = 0;
  for (size_t d = 0; d < g.node(n.operands[0]).shape.size(); ++d) {
    const bool reduced = std::binary_search(axes.begin(), axes.end(), static_cast<int64_t>(d));
    m.follow[0].push_back(reduced ? -1 : r++);
  }
  return m;
}

}  // namespace

absl::Span<const ShardingRuleEntry> reduction_rules() {
  static constexpr ShardingRuleEntry kRules[] = {
      {Op::kReduceSum, {reduce, reduce_map}},
      {Op::kReduceMax, {reduce, reduce_map}},
      {Op::kReduceMin, {reduce, reduce_map}},
      {Op::kReduceProd, {reduce, reduce_map}},
      {Op::kArgmax, {argmax, reduce_map}},
      {Op::kArgsort, {argsort, argsort_map}},
      {Op::kArgsortDescending, {argsort, argsort_map}},
  };
  return kRules;
}

}  // namespace tessera::internal

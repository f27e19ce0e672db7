// Batching the reductions and the ops along one axis (argmax, argsort): the axes one further
// on, the batch dimension kept first.
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> reduce_rule(const BatchArgs& a) {
  Node n = a.node;
  n.attrs<ReduceAttrs>().axes = shifted(n.attrs<ReduceAttrs>().axes);
  return a.add(std::move(n), {a.x[0]}, {});
}

absl::StatusOr<Value> along_axis_rule(const BatchArgs& a) {
  Node n = a.node;
  n.attrs<ArgmaxAttrs>().axis += 1;
  return a.add(std::move(n), {a.x[0]}, {});
}

constexpr BatchEntry kRules[] = {
    {Op::kReduceSum, reduce_rule},
    {Op::kReduceMax, reduce_rule},
    {Op::kReduceMin, reduce_rule},
    {Op::kReduceProd, reduce_rule},
    {Op::kArgmax, along_axis_rule},
    {Op::kArgsort, along_axis_rule},
    {Op::kArgsortDescending, along_axis_rule},
};

}  // namespace

absl::Span<const BatchEntry> reduction_batching() { return kRules; }

}  // namespace tessera::internal

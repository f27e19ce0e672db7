// Batching gather and scatter whose indices are the same for every example: the indexed
// dimension one further on. (Batched indices have no rule yet: vmap reports the op.)
#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> indexing_rule(const BatchArgs& a) {
  if (a.batched[1]) {
    return absl::InvalidArgumentError(absl::StrCat(op_name(a.node.op),
                                                   " with indices that differ per example has no batching rule "
                                                   "(only the indexed array and the updates may be batched)"));
  }
  Node n = a.node;
  n.attrs<GatherAttrs>().axis += 1;
  std::vector<Value> operands = {a.batched_operand(0), a.x[1]};
  if (a.x.size() > 2) operands.push_back(a.batched_operand(2));
  return a.add(std::move(n), operands, {});
}

constexpr BatchEntry kRules[] = {
    {Op::kGather, indexing_rule}, {Op::kScatter, indexing_rule}, {Op::kScatterAdd, indexing_rule}};

}  // namespace

absl::Span<const BatchEntry> indexing_batching() { return kRules; }

}  // namespace tessera::internal

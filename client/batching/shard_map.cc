// Batching the collectives of a shard_map body: each device's batched block takes part as a
// whole, so the collective runs once on it with its dimensions one further on.
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> collective_rule(const BatchArgs& a) {
  Node n = a.node;
  CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  if (a.node.op == Op::kAllGather || a.node.op == Op::kReduceScatter) c.dimension += 1;
  if (a.node.op == Op::kAllToAll) {
    c.split_dimension += 1;
    c.concat_dimension += 1;
  }
  return a.add(std::move(n), {a.x[0]}, {});
}

constexpr BatchEntry kRules[] = {
    {Op::kAllReduce, collective_rule}, {Op::kAllGather, collective_rule},         {Op::kReduceScatter, collective_rule},
    {Op::kAllToAll, collective_rule},  {Op::kCollectivePermute, collective_rule}, {Op::kPvary, collective_rule},
};

}  // namespace

absl::Span<const BatchEntry> shard_map_batching() { return kRules; }

}  // namespace tessera::internal

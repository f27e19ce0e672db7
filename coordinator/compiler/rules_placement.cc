// Sharding rules of the ops that place values rather than compute them: parameters (their
// layout is the caller's), sharding_constraint and sharding_as (a layout asked for), and
// shard_map's boundaries, collectives and axis_index (per-device code, whose values are each
// device's own block).
#include "absl/status/status.h"
#include "coordinator/compiler/rules.h"

namespace tessera::internal {
namespace {

// Parameters are laid out by the input specs before the pass starts.
absl::Status parameter(ShardingContext&, int) { return absl::OkStatus(); }

absl::Status sharding_constraint(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  Dims d = c.padded(n.sharding->spec(), n.shape.size());
  c.needs(id) = {ValueSharding{d, {}, ReduceOp::kSum}};
  c.set(id, d);
  return absl::OkStatus();
}

// The reference's layout, whole; the reference is not moved.
absl::Status sharding_as(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ValueSharding like = c.of_or_replicated(n.operands[1]);
  c.needs(id) = {ValueSharding{like.dims, {}, ReduceOp::kSum}, like};
  c.set(id, like.dims);
  return absl::OkStatus();
}

// The operand in the in_spec's layout, whole: each device's block.
absl::Status shard_map_in(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  c.needs(id) = {
      ValueSharding{c.padded(n.sharding->spec(), c.graph().node(n.operands[0]).shape.size()), {}, ReduceOp::kSum}};
  c.set(id, Dims(n.shape.size()));
  return absl::OkStatus();
}

// The blocks are the global value's shards.
absl::Status shard_map_out(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  c.needs(id) = {ValueSharding::replicated(c.graph().node(n.operands[0]).shape.size())};
  c.set(id, c.padded(n.sharding->spec(), n.shape.size()));
  return absl::OkStatus();
}

}  // namespace

// A value inside a shard_map body: to propagation, a replicated value of the block's shape,
// never moved (each device holds its own).
absl::Status body_value(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  std::vector<ValueSharding>& req = c.needs(id);
  req.clear();
  for (int o : n.operands) req.push_back(ValueSharding::replicated(c.graph().node(o).shape.size()));
  c.set(id, Dims(n.shape.size()));
  return absl::OkStatus();
}

absl::Span<const ShardingRuleEntry> placement_rules() {
  static constexpr ShardingRuleEntry kRules[] = {
      {Op::kParameter, {parameter, identity_map}},
      {Op::kShardingConstraint, {sharding_constraint, identity_map}},
      {Op::kShardingAs, {sharding_as, identity_map, /*in_body=*/true}},
      {Op::kShardMapIn, {shard_map_in, identity_map, /*in_body=*/true}},
      {Op::kShardMapOut, {shard_map_out, identity_map, /*in_body=*/true}},
      {Op::kAllReduce, {body_value, identity_map}},
      {Op::kAllGather, {body_value, identity_map}},
      {Op::kReduceScatter, {body_value, identity_map}},
      {Op::kAllToAll, {body_value, identity_map}},
      {Op::kCollectivePermute, {body_value, identity_map}},
      {Op::kAxisIndex, {body_value, identity_map}},
  };
  return kRules;
}

}  // namespace tessera::internal

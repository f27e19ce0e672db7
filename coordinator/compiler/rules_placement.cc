// Sharding rules and partition handlers of the ops that place values rather than compute them: parameters (their
// layout is the caller's), sharding_constraint and sharding_as (a layout asked for), and
// shard_map's boundaries, collectives, axis_index and pvary (per-device code, whose values are
// each device's own block).
#include <set>

#include "absl/algorithm/container.h"
#include "absl/status/status.h"
#include "coordinator/compiler/rules.h"
#include "core/status.h"

namespace tessera::internal {
namespace {

// Parameters are laid out by the input specs before the pass starts.
absl::Status parameter(ShardingContext&, int) { return absl::OkStatus(); }

// The spec's layout; unreduced axes (P(..., unreduced={'X'})) are a pending sum over them,
// kept as it is: the operand must be partial over exactly those axes, which explicit mode's
// types ensure (client/explicit/unreduced.cc). Without unreduced axes a partial operand is
// summed (all_reduce, or reduce_scatter onto a dimension the spec splits).
absl::Status sharding_constraint(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const PartitionSpec& spec = n.attrs<ShardingAttrs>().sharding.spec();
  Dims d = c.padded(spec, n.shape.size());
  c.needs(id) = {ValueSharding{d, spec.unreduced(), ReduceOp::kSum}};
  c.set(id, d, spec.unreduced());
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

// The operand in the in_spec's layout, whole: each device's block. In a body manual over some
// axes only, each dimension also keeps the automatic axes the operand splits it over (those
// that divide the block, after the manual ones): the block stays split over them.
absl::Status shard_map_in(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ShardingAttrs& a = n.attrs<ShardingAttrs>();
  Dims need = c.padded(a.sharding.spec(), c.graph().node(n.operands[0]).shape.size());
  Dims block(n.shape.size());
  if (!a.manual_axes.empty()) {
    const ValueSharding have = c.of_or_replicated(n.operands[0]);
    std::set<std::string> taken(a.manual_axes.begin(), a.manual_axes.end());
    for (size_t d = 0; d < block.size(); ++d) {
      Axes automatic;
      for (const std::string& axis : have.dims[d]) {
        if (!absl::c_linear_search(a.manual_axes, axis)) automatic.push_back(axis);
      }
      block[d] = c.usable(automatic, n.shape[d], &taken);
      need[d].insert(need[d].end(), block[d].begin(), block[d].end());
    }
  }
  // An in_spec's unreduced axes keep the operand's pending sum over them (its type says it is
  // unreduced alike): each device's block is its term.
  c.needs(id) = {ValueSharding{need, a.sharding.spec().unreduced(), ReduceOp::kSum}};
  c.set(id, std::move(block));
  return absl::OkStatus();
}

// The blocks are the global value's shards. In a body manual over some axes only, the block's
// split over the automatic axes carries on inside each manual block.
absl::Status shard_map_out(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ShardingAttrs& a = n.attrs<ShardingAttrs>();
  Dims block(n.shape.size());
  if (!a.manual_axes.empty()) block = c.of_or_replicated(n.operands[0]).dims;
  Dims result = c.padded(a.sharding.spec(), n.shape.size());
  for (size_t d = 0; d < result.size(); ++d) result[d].insert(result[d].end(), block[d].begin(), block[d].end());
  c.needs(id) = {ValueSharding{std::move(block), {}, ReduceOp::kSum}};
  // An out_spec's unreduced axes: the blocks are the terms of a sum pending over them, typed so.
  c.set(id, std::move(result), a.sharding.spec().unreduced());
  c.mark_typed_unreduced(id);
  return absl::OkStatus();
}

// all_reduce and ppermute act on each element alone, so in a body automatic over some axes
// (axis_names) they run on each device's piece of the block as it is split over those axes
// (whole: a pending sum is resolved first, as a max of partial sums would be wrong); the groups
// over manual axes hold the same piece index along the automatic ones. Elsewhere body_value.
absl::Status elementwise_collective(ShardingContext& c, int id) {
  if (c.automatic_axes(id).empty()) return body_value(c, id);
  const Dims dims = c.of_or_replicated(c.graph().node(id).operands[0]).dims;
  c.needs(id) = {ValueSharding{dims, {}, ReduceOp::kSum}};
  c.set(id, dims);
  return absl::OkStatus();
}

// all_gather, reduce_scatter, all_to_all and ragged_all_to_all move blocks along some
// dimensions only (the gathered or scattered one, all_to_all's split and concat, the ragged
// rows): in a body automatic over some axes they run on each device's piece as it is split
// over those axes along the other dimensions, which keep that split (whole along the moving
// ones, a pending sum resolved first); the groups over manual axes hold the same piece index
// along the automatic ones, so each piece meets its peers. ragged_all_to_all's output takes
// its operand's layout and its index arrays are whole. Elsewhere, body_value.
absl::Status moving_collective(ShardingContext& c, int id) {
  if (c.automatic_axes(id).empty()) return body_value(c, id);
  const Node& n = c.graph().node(id);
  const CollectiveAttrs& a = n.attrs<CollectiveAttrs>();
  Dims dims = c.of_or_replicated(n.operands[0]).dims;
  std::vector<int64_t> moving = {0};  // ragged_all_to_all's rows
  if (n.op == Op::kAllGather || n.op == Op::kReduceScatter) moving = {a.dimension};
  if (n.op == Op::kAllToAll) moving = {a.split_dimension, a.concat_dimension};
  for (int64_t d : moving) dims[d].clear();
  std::vector<ValueSharding>& needs = c.needs(id);
  needs = {ValueSharding{dims, {}, ReduceOp::kSum}};
  if (n.op == Op::kRaggedAllToAll) {
    needs.push_back(needs[0]);
    for (size_t k = 2; k < n.operands.size(); ++k) needs.push_back(ValueSharding::replicated(1));
  }
  c.set(id, std::move(dims));
  return absl::OkStatus();
}

// Partition handlers.

absl::Status partition_parameter(PartitionContext& c, int id) {
  c.add_input(id);
  return absl::OkStatus();
}

// Operand 0 moved to the layout; operand 1 only named it.
absl::Status partition_sharding_as(PartitionContext& c, int id) {
  const int x = c.graph().node(id).operands[0];
  TESSERA_ASSIGN_OR_RETURN(int slot,
                           c.reshard(x, c.propagation().result[x], c.propagation().operands[id][0], c.cause(id)));
  c.bind(id, slot);
  return absl::OkStatus();
}

// The reshard of the operand is the whole op (for shard_map_out: none).
absl::Status partition_as_operand(PartitionContext& c, int id) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  c.bind(id, in[0]);
  return absl::OkStatus();
}

// A shard_map collective runs as written; its groups (and a permute's pairs) come from its
// axes (and positions) when each device resolves the program.
absl::Status partition_collective(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  const CollectiveAttrs& attrs = n.attrs<CollectiveAttrs>();
  c.bind(id, emit_collective(c, id, collective_of(n), std::move(in), attrs.axes,
                             n.op == Op::kCollectivePermute ? attrs.positions : std::vector<int64_t>{}, n.dtype,
                             NamedSharding(c.mesh(), c.propagation().result[id].spec()).shard_shape(n.shape)));
  return absl::OkStatus();
}

// axis_index: each device's position, resolved by the device.
absl::Status partition_axis_index(PartitionContext& c, int id) {
  Instruction inst;
  inst.kind = Instruction::Kind::kKernel;
  inst.cause = c.cause(id);
  inst.node.op = Op::kAxisIndex;
  inst.node.dtype = DType::kI32;
  inst.node.attributes = AxisIndexAttrs{};  // the plan's mesh; the axes are the instruction's
  inst.axes = c.graph().node(id).attrs<AxisIndexAttrs>().axes;
  c.bind(id, c.emit(std::move(inst)));
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
      {Op::kParameter, {parameter, identity_map, false, partition_parameter}},
      {Op::kShardingConstraint, {sharding_constraint, identity_map, false, partition_as_operand}},
      {Op::kShardingAs, {sharding_as, identity_map, /*in_body=*/true, partition_sharding_as}},
      {Op::kShardMapIn, {shard_map_in, identity_map, /*in_body=*/true, partition_as_operand}},
      {Op::kShardMapOut, {shard_map_out, identity_map, /*in_body=*/true, partition_as_operand}},
      {Op::kAllReduce, {elementwise_collective, identity_map, false, partition_collective}},
      {Op::kAllGather, {moving_collective, identity_map, false, partition_collective}},
      {Op::kReduceScatter, {moving_collective, identity_map, false, partition_collective}},
      {Op::kAllToAll, {moving_collective, identity_map, false, partition_collective}},
      {Op::kRaggedAllToAll, {moving_collective, identity_map, false, partition_collective}},
      {Op::kCollectivePermute, {elementwise_collective, identity_map, false, partition_collective}},
      {Op::kAxisIndex, {body_value, identity_map, false, partition_axis_index}},
      // pvary changes a type only: its value is its operand's slot, with no instruction.
      {Op::kPvary, {elementwise_collective, identity_map, false, partition_as_operand}},
  };
  return kRules;
}

}  // namespace tessera::internal

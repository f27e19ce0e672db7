// Batching the layout ops and sharding constraints: the batch dimension stays first, the
// attributes (and a constraint's spec) name the example's dimensions one further on.
#include <algorithm>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

Shape with_batch(int64_t size, const Shape& shape) {
  Shape out = {size};
  out.insert(out.end(), shape.begin(), shape.end());
  return out;
}

absl::StatusOr<Value> broadcast_rule(const BatchArgs& a) {
  std::vector<int64_t> dims = {0};
  for (int64_t d : shifted(a.node.attrs<BroadcastAttrs>().result_dims)) dims.push_back(d);
  return broadcast_in_dim(a.x[0], with_batch(a.size, a.node.shape), std::move(dims));
}

absl::StatusOr<Value> reshape_rule(const BatchArgs& a) { return reshape(a.x[0], with_batch(a.size, a.node.shape)); }

absl::StatusOr<Value> transpose_rule(const BatchArgs& a) {
  std::vector<int64_t> permutation = {0};
  for (int64_t d : shifted(a.node.attrs<TransposeAttrs>().permutation)) permutation.push_back(d);
  return transpose(a.x[0], std::move(permutation));
}

absl::StatusOr<Value> slice_rule(const BatchArgs& a) {
  const SliceAttrs& s = a.node.attrs<SliceAttrs>();
  std::vector<int64_t> start = {0}, limit = {a.size};
  start.insert(start.end(), s.start.begin(), s.start.end());
  limit.insert(limit.end(), s.limit.begin(), s.limit.end());
  std::vector<int64_t> strides;  // slicing.py's _slice_batching_rule: stride 1 on the batch dimension
  if (!s.strides.empty()) strides = {1};
  strides.insert(strides.end(), s.strides.begin(), s.strides.end());
  return slice(a.x[0], std::move(start), std::move(limit), std::move(strides));
}

// lax.py's _rev_batch_rule: the example's dimensions one further on (the batch dimension first).
absl::StatusOr<Value> rev_rule(const BatchArgs& a) { return rev(a.x[0], shifted(a.node.attrs<ReduceAttrs>().axes)); }

absl::StatusOr<Value> concatenate_rule(const BatchArgs& a) {
  std::vector<Value> xs;
  for (size_t k = 0; k < a.x.size(); ++k) xs.push_back(a.batched_operand(k));
  return concatenate(xs, a.node.attrs<ConcatAttrs>().axis + 1);
}

// with_sharding_constraint (and reshard): the example's spec one dimension further on, the
// batch dimension as JAX's _reshard_batcher and _sharding_constraint_batcher insert it
// (jax/_src/pjit.py): split as the mapped arguments' in explicit mode
// (batching.get_sharding_for_vmap's explicit_mesh_axis), else over vmap's spmd_axis_name
// (_pjit_batcher_for_sharding), which the spec must not name, else whole (JAX leaves it
// unconstrained, which Tessera's specs cannot say).
absl::StatusOr<Value> sharding_constraint_rule(const BatchArgs& a) {
  Node n = a.node;
  ShardingAttrs& s = std::get<ShardingAttrs>(n.attributes);
  const PartitionSpec& spec = s.sharding.spec();
  Axes batch = a.layout.explicit_axes;
  if (batch.empty() && !a.layout.spmd_axes.empty()) {
    for (const std::string& axis : a.layout.spmd_axes) {
      const std::vector<std::string> used = spec.used_axes();
      if (std::find(used.begin(), used.end(), axis) != used.end()) {
        return absl::InvalidArgumentError(absl::StrCat("vmap spmd_axis_name ", axes_to_string(a.layout.spmd_axes),
                                                       " cannot appear in with_sharding_constraint spec, but got spec ",
                                                       spec.to_string()));
      }
      if (s.sharding.mesh().axis_index(axis) < 0) {
        return absl::InvalidArgumentError(absl::StrCat("vmap spmd_axis_name '", axis, "' is not an axis of ",
                                                       s.sharding.mesh().to_string(),
                                                       ", the mesh of with_sharding_constraint to ", spec.to_string()));
      }
    }
    batch = a.layout.spmd_axes;
  }
  std::vector<Axes> dims = {std::move(batch)};
  dims.insert(dims.end(), spec.dims().begin(), spec.dims().end());
  s.sharding = NamedSharding(s.sharding.mesh(), PartitionSpec(std::move(dims)));
  return a.add(std::move(n), {a.x[0]}, {});
}

// grad's layout of a gradient as its argument (sharding_as): each example's gradient laid out as
// its argument, the batch dimension as the batched argument's (an unbatched one broadcast).
absl::StatusOr<Value> sharding_as_rule(const BatchArgs& a) {
  return a.add(a.node, {a.batched_operand(0), a.batched_operand(1)}, {});
}

constexpr BatchEntry kRules[] = {
    {Op::kBroadcastInDim, broadcast_rule}, {Op::kReshape, reshape_rule},
    {Op::kTranspose, transpose_rule},      {Op::kSlice, slice_rule},
    {Op::kConcatenate, concatenate_rule},  {Op::kShardingConstraint, sharding_constraint_rule},
    {Op::kShardingAs, sharding_as_rule},   {Op::kRev, rev_rule},
};

}  // namespace

absl::Span<const BatchEntry> layout_batching() { return kRules; }

}  // namespace tessera::internal

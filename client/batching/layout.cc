// Batching the layout ops and sharding constraints: the batch dimension stays first, the
// attributes (and a constraint's spec) name the example's dimensions one further on.
#include <utility>
#include <variant>
#include <vector>

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
  return slice(a.x[0], std::move(start), std::move(limit));
}

absl::StatusOr<Value> concatenate_rule(const BatchArgs& a) {
  std::vector<Value> xs;
  for (size_t k = 0; k < a.x.size(); ++k) xs.push_back(a.batched_operand(k));
  return concatenate(xs, a.node.attrs<ConcatAttrs>().axis + 1);
}

// with_sharding_constraint (and reshard): the example's spec one dimension further on, the
// batch dimension unsplit, as JAX's _sharding_constraint_batcher and _reshard_batcher insert
// the batch dimension (jax/_src/pjit.py; JAX marks it unconstrained in the constraint, which
// Tessera's specs do not have: here it stays whole).
absl::StatusOr<Value> sharding_constraint_rule(const BatchArgs& a) {
  Node n = a.node;
  ShardingAttrs& s = std::get<ShardingAttrs>(n.attributes);
  std::vector<Axes> dims = {Axes{}};
  dims.insert(dims.end(), s.sharding.spec().dims().begin(), s.sharding.spec().dims().end());
  s.sharding = NamedSharding(s.sharding.mesh(), PartitionSpec(std::move(dims)));
  return a.add(std::move(n), {a.x[0]}, {});
}

constexpr BatchEntry kRules[] = {
    {Op::kBroadcastInDim, broadcast_rule}, {Op::kReshape, reshape_rule},
    {Op::kTranspose, transpose_rule},      {Op::kSlice, slice_rule},
    {Op::kConcatenate, concatenate_rule},  {Op::kShardingConstraint, sharding_constraint_rule},
};

}  // namespace

absl::Span<const BatchEntry> layout_batching() { return kRules; }

}  // namespace tessera::internal

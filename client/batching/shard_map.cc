// Batching the collectives of a shard_map body: each device's batched block takes part as a
// whole, so the collective runs once on it with its dimensions one further on
// (ragged_all_to_all: once on the examples' rows stacked).
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

// As JAX's _ragged_all_to_all_batched_collective (jax/_src/lax/parallel.py): the examples'
// operands and outputs are stacked into one of B * N and one of B * M rows, example b's slices
// moved by b * N and b * M rows, and the index arrays interleaved (K, B) row-major so that the
// slices each device sends to one peer stay together: one ragged_all_to_all for the batch.
absl::StatusOr<Value> ragged_all_to_all_rule(const BatchArgs& a) {
  const Value operand = a.batched_operand(0), output = a.batched_operand(1);
  const int64_t b = a.size, n = operand.shape()[1], m = output.shape()[1];
  const auto rows_of = [](const Value& x, int64_t rows) {
    const Shape shape = x.shape();
    Shape merged = {rows};
    merged.insert(merged.end(), shape.begin() + 2, shape.end());
    return reshape(x, merged);
  };
  // Index array k as (K, B): example b's entries in column b, moved by `stride` rows each.
  const auto interleaved = [&](size_t k, int64_t stride) {
    const Value x = transpose(a.batched_operand(k), {1, 0});
    const Value moved =
        stride == 0 ? x : x + iota(x.dtype(), x.shape(), 1) * full(x.shape(), static_cast<double>(stride), x.dtype());
    return reshape(moved, {x.shape()[0] * b});
  };
  const Value r = a.add(a.node,
                        {rows_of(operand, b * n), rows_of(output, b * m), interleaved(2, n), interleaved(3, 0),
                         interleaved(4, m), interleaved(5, 0)},
                        {});
  return reshape(r, output.shape());
}

constexpr BatchEntry kRules[] = {
    {Op::kAllReduce, collective_rule},
    {Op::kAllGather, collective_rule},
    {Op::kReduceScatter, collective_rule},
    {Op::kAllToAll, collective_rule},
    {Op::kCollectivePermute, collective_rule},
    {Op::kPvary, collective_rule},
    {Op::kRaggedAllToAll, ragged_all_to_all_rule},
};

}  // namespace

absl::Span<const BatchEntry> shard_map_batching() { return kRules; }

}  // namespace tessera::internal

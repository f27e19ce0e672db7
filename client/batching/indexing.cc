// Batching the indexing ops. gather and scatter whose indices are the same for every example:
// the indexed dimension one further on; with indices per example, the one-axis op with the
// batch as one more of its batch dimensions (GatherAttrs.batch_dims; JAX's
// _gather_batching_rule does the same, with operand_batching_dims), or, for a gather from an x
// shared by every example, as one more query dimension of the indices. dynamic_slice and dynamic_update_slice as JAX
// batches them (jax/_src/lax/slicing.py, _dynamic_slice_batching_rule, _dynamic_update_slice_batching_rule): with the
// same starts for every example, the op again with a start of 0 along the batch dimension; with starts that differ per
// example, lax's gather (scatter) of each example's window with the batch as a batching dimension of operand and
// starts, so the Explicit rules resolve their splits of the batch as JAX's _gather_sharding_rule /
// _scatter_sharding_rule do.
#include <numeric>

#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

// Indices per example (batch first), or an op with batch dimensions of its own: the one-axis
// op again with vmap's batch as one more batch dimension (GatherAttrs.batch_dims) of x, the
// indices and the updates, so each example indexes its own x, O(1) per element as the example's
// op, and a split of the batch stays (tf.gather's batch_dims; JAX's _gather_batching_rule
// reaches the same through operand_batching_dims).
//
// A gather from an x shared by every example (x unbatched) needs no copy of x per example: as
// JAX's _gather_batching_rule does with an unbatched operand and batched indices, vmap's batch
// becomes one more query dimension of the indices, right after their n batch dimensions
// (B1..Bn, V, ...), all examples gather at once, and V, which lands at `axis` in the result
// (X[:axis] + I[n:] + X[axis+1:]), moves to the front. On a batch split over Explicit axes with
// batch dimensions, x is broadcast instead, a deliberate difference: JAX raises there (its
// _gather_sharding_rule refuses the indices' split non-batching dimension), and session 38's
// broadcast resolves the split as a batch dimension. (With batch_dims 0 the query-dimension
// form is taken and the Explicit rule refuses the split, as JAX.) A scatter into an unbatched x does write B copies of
// it (each example its own), so x is broadcast there.
absl::StatusOr<Value> batched_indices_rule(const BatchArgs& a) {
  GatherAttrs attrs = a.node.attrs<GatherAttrs>();
  const bool explicit_with_batch_dims = attrs.batch_dims > 0 && !a.layout.explicit_axes.empty();
  if (a.node.op == Op::kGather && !a.batched[0] && !explicit_with_batch_dims) {
    const Value indices = move_dim(a.x[1], 0, attrs.batch_dims);
    return move_dim(gather(a.x[0], indices, attrs), attrs.axis, 0);
  }
  attrs.axis += 1;
  attrs.batch_dims += 1;
  const Value x = a.batched_operand(0), indices = a.batched_operand(1);
  if (a.node.op == Op::kGather) return gather(x, indices, attrs);
  const Value updates = a.batched_operand(2);
  return a.node.op == Op::kScatterAdd ? scatter_add(x, indices, updates, attrs) : scatter(x, indices, updates, attrs);
}

absl::StatusOr<Value> indexing_rule(const BatchArgs& a) {
  if (a.batched[1] || a.node.attrs<GatherAttrs>().batch_dims > 0) return batched_indices_rule(a);
  Node n = a.node;
  n.attrs<GatherAttrs>().axis += 1;
  std::vector<Value> operands = {a.batched_operand(0), a.x[1]};
  if (a.x.size() > 2) operands.push_back(a.batched_operand(2));
  return a.add(std::move(n), operands, {});
}

// The starts operand with a 0 for the batch dimension first.
Value starts_with_batch(const Value& starts) { return concatenate({full({1}, 0, starts.dtype()), starts}, 0); }

// The dimensions first, first + 1, ..., first + n - 1.
std::vector<int64_t> dims_from(int64_t first, int64_t n) {
  std::vector<int64_t> dims(n);
  std::iota(dims.begin(), dims.end(), first);
  return dims;
}

// (x, starts) with sizes: the window of each example at its starts.
absl::StatusOr<Value> dynamic_slice_rule(const BatchArgs& a) {
  Node n = a.node;
  std::vector<int64_t>& sizes = n.attrs<DynamicSliceAttrs>().sizes;
  if (!a.batched[1]) {
    sizes.insert(sizes.begin(), a.size);
    return a.add(std::move(n), {a.x[0], starts_with_batch(a.x[1])}, {});
  }
  // Starts per example (int[size, rank], a row per example): a gather of each example's window,
  // its starts clamped as lax clamps them (kClip). With the operand batched too, the batch is a
  // batching dimension of both, so on Explicit axes the operand's and the starts' splits of it
  // resolve into the result's (lax_gather.cc, gather_by_batch_blocks), as JAX's.
  const int64_t rank = static_cast<int64_t>(sizes.size());
  if (!a.batched[0]) {
    return gather(a.x[0], a.x[1], GatherDimensionNumbers{dims_from(1, rank), {}, dims_from(0, rank)}, sizes,
                  GatherScatterMode::kClip);
  }
  sizes.insert(sizes.begin(), 1);
  return gather(a.x[0], a.x[1], GatherDimensionNumbers{dims_from(1, rank), {}, dims_from(1, rank), {0}, {0}}, sizes,
                GatherScatterMode::kClip);
}

// (x, update, starts): each example's x with its update written at its starts.
absl::StatusOr<Value> dynamic_update_slice_rule(const BatchArgs& a) {
  const Value x = a.batched_operand(0), update = a.batched_operand(1);
  if (!a.batched[2]) return a.add(a.node, {x, update, starts_with_batch(a.x[2])}, {});
  // Starts per example: a scatter of each example's update into its x, the batch a batching
  // dimension of x, the starts and the update (x and the update broadcast along it when
  // unmapped, laid out as the batch), its starts clamped as lax clamps them. A window lies
  // inside its example, so the scatter writes each element once.
  const int64_t rank = x.rank() - 1;
  return scatter(x, a.x[2], update, ScatterDimensionNumbers{dims_from(1, rank), {}, dims_from(1, rank), {0}, {0}},
                 GatherScatterMode::kClip);
}

constexpr BatchEntry kRules[] = {
    {Op::kGather, indexing_rule},
    {Op::kScatter, indexing_rule},
    {Op::kScatterAdd, indexing_rule},
    {Op::kDynamicSlice, dynamic_slice_rule},
    {Op::kDynamicUpdateSlice, dynamic_update_slice_rule},
};

}  // namespace

absl::Span<const BatchEntry> indexing_batching() { return kRules; }

}  // namespace tessera::internal

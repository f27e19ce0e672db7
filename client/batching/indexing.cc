// Batching the indexing ops. gather and scatter whose indices are the same for every example:
// the indexed dimension one further on; with indices per example, lax's gather / scatter with
// the batch dimension as a batching dimension of operand and indices (JAX's
// _gather_batching_rule does the same, with operand_batching_dims). dynamic_slice and dynamic_update_slice as JAX
// batches them (jax/_src/lax/slicing.py, _dynamic_slice_batching_rule, _dynamic_update_slice_batching_rule): with the
// same starts for every example, the op again with a start of 0 along the batch dimension; with starts that differ per
// example, a gather (a scatter) of each example's window, addressed as elements of the flattened operand.
#include <limits>

#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

// Indices per example (batch first): each example's x[..., indices, ...] (or its scatter) as one
// lax.gather / scatter whose operand and indices share the batch dimension as a batching
// dimension; the index vector is the indices with a trailing 1. The result keeps the one-axis
// op's layout: batch, x's dimensions before the axis, the indices', x's after it.
absl::StatusOr<Value> batched_indices_rule(const BatchArgs& a) {
  const GatherAttrs& attrs = a.node.attrs<GatherAttrs>();
  const Value x = a.batched_operand(0);
  const int64_t axis = attrs.axis + 1, ni = a.x[1].rank(), rank = x.rank();
  Shape vec = a.x[1].shape();
  vec.push_back(1);
  const Value starts = reshape(a.x[1], vec);
  std::vector<int64_t> window;  // where x's other dimensions land in the result
  for (int64_t d = 1; d < rank; ++d) {
    if (d != axis) window.push_back(d < axis ? d : d + ni - 2);
  }
  if (a.node.op == Op::kGather) {
    std::vector<int64_t> sizes = x.shape();
    sizes[0] = sizes[axis] = 1;
    return gather(x, starts, GatherDimensionNumbers{window, {axis}, {axis}, {0}, {0}}, sizes, attrs.mode,
                  attrs.fill_value);
  }
  const ScatterDimensionNumbers dn{window, {axis}, {axis}, {0}, {0}};
  const Value updates = a.batched_operand(2);
  return a.node.op == Op::kScatterAdd ? scatter_add(x, starts, updates, dn, attrs.mode)
                                      : scatter(x, starts, updates, dn, attrs.mode);
}

absl::StatusOr<Value> indexing_rule(const BatchArgs& a) {
  if (a.batched[1]) return batched_indices_rule(a);
  Node n = a.node;
  n.attrs<GatherAttrs>().axis += 1;
  std::vector<Value> operands = {a.batched_operand(0), a.x[1]};
  if (a.x.size() > 2) operands.push_back(a.batched_operand(2));
  return a.add(std::move(n), operands, {});
}

// The starts operand with a 0 for the batch dimension first.
Value starts_with_batch(const Value& starts) { return concatenate({full({1}, 0, starts.dtype()), starts}, 0); }

// The flat indices into the batched operand (shape [size] + `shape`, flattened; its example
// part alone when `per_example_operand` is false) of each element of the windows of `window`
// at `starts` (int[size, rank], a row per example), each start clamped to [0, dim - window]
// as lax clamps them: int32, or int64 when the operand has more elements than int32 holds.
Value window_indices(const Value& starts, const Shape& shape, const Shape& window, int64_t size,
                     bool per_example_operand) {
  int64_t elements = 1;
  for (int64_t n : shape) elements *= n;
  const DType index = (per_example_operand ? elements * size : elements) > std::numeric_limits<int32_t>::max()
                          ? DType::kI64
                          : DType::kI32;
  Shape out = {size};
  out.insert(out.end(), window.begin(), window.end());
  const int64_t rank = static_cast<int64_t>(shape.size());
  Value flat =
      per_example_operand ? iota(index, out, 0) * full(out, static_cast<double>(elements), index) : full(out, 0, index);
  int64_t stride = elements;
  for (int64_t d = 0; d < rank; ++d) {
    stride /= shape[d] == 0 ? 1 : shape[d];
    const Value column = reshape(convert(slice(starts, {0, d}, {size, d + 1}), index), {size});
    const Value start = clamp(full({}, 0, index), column, full({}, static_cast<double>(shape[d] - window[d]), index));
    const Value at = broadcast_in_dim(start, out, {0}) + iota(index, out, d + 1);
    flat = flat + at * full(out, static_cast<double>(stride), index);
  }
  return flat;
}

Shape flat_shape(const Value& x) {
  int64_t n = 1;
  for (int64_t d : x.shape()) n *= d;
  return {n};
}

// (x, starts) with sizes: the window of each example at its starts.
absl::StatusOr<Value> dynamic_slice_rule(const BatchArgs& a) {
  Node n = a.node;
  std::vector<int64_t>& sizes = n.attrs<DynamicSliceAttrs>().sizes;
  if (!a.batched[1]) {
    sizes.insert(sizes.begin(), a.size);
    return a.add(std::move(n), {a.x[0], starts_with_batch(a.x[1])}, {});
  }
  // Starts per example: a gather from the flattened operand (each example's own when it is
  // batched, else the one operand every example reads).
  Shape example = a.x[0].shape();
  if (a.batched[0]) example.erase(example.begin());
  const Value indices = window_indices(a.x[1], example, sizes, a.size, a.batched[0]);
  return gather(reshape(a.x[0], flat_shape(a.x[0])), indices, 0, IndexMode::kClip);
}

// (x, update, starts): each example's x with its update written at its starts.
absl::StatusOr<Value> dynamic_update_slice_rule(const BatchArgs& a) {
  const Value x = a.batched_operand(0), update = a.batched_operand(1);
  if (!a.batched[2]) return a.add(a.node, {x, update, starts_with_batch(a.x[2])}, {});
  Shape example = x.shape(), window = update.shape();
  example.erase(example.begin());
  window.erase(window.begin());
  const Value indices = window_indices(a.x[2], example, window, a.size, true);
  // The windows' elements are distinct (a clamped window lies inside its example), so the
  // scatter writes each once.
  return reshape(scatter(reshape(x, flat_shape(x)), indices, update, 0, IndexMode::kClip), x.shape());
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

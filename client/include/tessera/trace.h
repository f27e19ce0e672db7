// Tracing: running an ordinary array function on symbolic Values to record its Graph — the
// first step of jit, as JAX traces a Python function.
//
// Ops on Values never fail on the spot: the first error (a shape or dtype mismatch) is
// recorded, later ops are skipped, and trace() returns that error naming the op and shapes
// (as XLA's builder does). Every op below returns an invalid Value (ok() false) when an
// operand is invalid or the op fails; outside a trace nothing is recorded anywhere. Ops that
// take an axis accept a negative one counting from the end, as numpy, except iota,
// broadcast_in_dim, transpose and slice.
//
//   absl::StatusOr<Graph> g = trace(
//       [](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; },
//       {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
//   g->to_text();
#ifndef TESSERA_TRACE_H_
#define TESSERA_TRACE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/graph.h"
#include "core/sharding.h"

namespace tessera {

class Array;  // tessera/array.h

// Implementation details of the SDK, not for applications.
namespace internal {
struct TraceState;
}  // namespace internal

// A symbolic array inside a traced function: its dtype and shape, and the node computing it.
class Value {
 public:
  // An invalid Value.
  Value() = default;
  // Surprising: an invalid Value reports float32 and shape () rather than failing.
  DType dtype() const;
  // By value: the graph's storage moves as ops are added, so a reference would dangle.
  Shape shape() const;
  int rank() const { return static_cast<int>(shape().size()); }
  // False for a Value of a failed op (or default-constructed); ops on it record nothing.
  bool ok() const { return trace_ != nullptr && id_ >= 0; }
  // The id of the node computing it in the traced Graph; -1 when invalid.
  int node() const { return id_; }

 private:
  friend struct internal::TraceState;
  Value(std::shared_ptr<internal::TraceState> trace, int id) : trace_(std::move(trace)), id_(id) {}
  std::shared_ptr<internal::TraceState> trace_;
  int id_ = -1;
};

// The dtype and shape of one input of a traced function: ArrayType (core/op.h).
using TracedFunction = std::function<std::vector<Value>(const std::vector<Value>&)>;

// Runs `f` once on Values of the given types; the Graph has one parameter per input and
// the function's results as outputs. INVALID_ARGUMENT with the first op that failed, for an
// input shape with a negative dimension or too many bytes, or for a result that is not a
// valid Value of this trace.
absl::StatusOr<Graph> trace(const TracedFunction& f, const std::vector<ArrayType>& inputs);
// The same with the inputs' shardings (one per input, all on one mesh; empty: none). On a mesh
// with an Explicit axis the trace is in explicit mode (see type_of below): every Value's type
// carries its sharding over the Explicit axes, each op's rule (client/explicit/) decides its
// result's or fails the trace, and each result is pinned to its type's layout.
absl::StatusOr<Graph> trace(const TracedFunction& f, const std::vector<ArrayType>& inputs,
                            const std::vector<NamedSharding>& input_shardings);

// Fails the trace in progress on this thread from the traced function itself, the C++
// counterpart of raising while JAX traces a Python function (a missing pytree entry, an option
// the arguments do not support): records `status` unless the trace already has an error (the
// first is kept, as for ops), so jit's call returns it; later ops record nothing. Does nothing
// for an OK status or outside a trace.
//
//   if (in.size() < 4) {
//     fail_trace(absl::InvalidArgumentError("train_step: dropout 0.1 needs a fourth tree"));
//     return {};
//   }
void fail_trace(const absl::Status& status);

// jax.typeof: a Value's dtype, shape and, in explicit mode, its sharding over the Explicit mesh
// axes (one spec entry per dimension; Auto axes are not part of a type, as in JAX); to_string()
// prints it as JAX does: "f32[16@data,8]", "f32[8@(X,Y),4]", "f32[16,8]" when not split. Inside
// a shard_map body with check_vma, also the manual axes the value varies along (JAX's
// `manual_axis_type.varying`, in mesh order; tessera/shard_map.h): "f32[2,2]{V:i}",
// "f32[2,2]{V:(i,j)}". Unreduced and reduced axes print after them, each set in the mesh's axis
// order as JAX's core.py `_vma_ur_str` (order_wrt_mesh) prints them: "f32[4]{U:(y,x), R:z}" on
// a mesh ('y', 'x', 'z'), where `spec` keeps the sets sorted.
struct ShapedType {
  DType dtype = DType::kF32;
  Shape shape;
  PartitionSpec spec;
  std::vector<std::string> varying;
  // The axis names of the value's mesh, in order (JAX's aval.sharding.mesh); empty outside
  // explicit mode. Only the printing order of the unreduced and reduced axes depends on it.
  std::vector<std::string> mesh_axes = {};
  std::string to_string() const;
};
ShapedType type_of(const Value& v);

// Elementwise unary ops, keeping dtype and shape. neg, abs and sign need a numeric dtype
// (not bool); floor and ceil need float32 or float64. exp, log, tanh, logistic, sqrt, rsqrt,
// sin, cos and erf compute an integer or bool operand in float32, as jnp does (jnp.sin of an
// int32 array is float32).
// Surprising: logical_not on an integer is a bitwise not (~x), not jnp's bool result.
Value neg(const Value& x);
Value abs(const Value& x);
Value exp(const Value& x);
Value log(const Value& x);
Value tanh(const Value& x);
Value logistic(const Value& x);
Value sqrt(const Value& x);
Value rsqrt(const Value& x);
Value sin(const Value& x);
Value cos(const Value& x);
Value erf(const Value& x);
Value erf_inv(const Value& x);  // lax.erf_inv: the inverse of erf on (-1, 1)
Value floor(const Value& x);
Value ceil(const Value& x);
Value sign(const Value& x);
Value logical_not(const Value& x);
// lax.stop_gradient: x's value (any dtype), through which grad passes no cotangent; its
// layout is x's.
Value stop_gradient(const Value& x);

// Elementwise binary ops with numpy broadcasting; mixed dtypes meet at promote_types.
// add, sub, mul, div and pow need numeric operands (not bool); logical_and and logical_or
// need bool or integers, and on integers are bitwise (& and |, not jnp's bool result).
// where(pred, ...) needs a bool pred.
Value add(const Value& x, const Value& y);
Value sub(const Value& x, const Value& y);
Value mul(const Value& x, const Value& y);
Value div(const Value& x, const Value& y);
Value pow(const Value& x, const Value& y);
Value maximum(const Value& x, const Value& y);
Value minimum(const Value& x, const Value& y);
Value logical_and(const Value& x, const Value& y);
Value logical_or(const Value& x, const Value& y);
Value where(const Value& pred, const Value& on_true, const Value& on_false);
// lax.rem: x - y * trunc(x / y), the dividend's sign (C's fmod; integer x % 0 is x, as XLA).
// remainder is jnp.remainder (Python's %, the divisor's sign), also operator% below.
Value rem(const Value& x, const Value& y);
Value remainder(const Value& x, const Value& y);
// lax.clamp(lo, x, hi): min(max(x, lo), hi), broadcasting as the binary ops; jnp.clip(x, lo, hi).
Value clamp(const Value& lo, const Value& x, const Value& hi);
// lax.shift_right_logical on integers: zeros shift in (also for signed x); a shift by the bit
// width or more (or a negative one) gives 0, as XLA's.
Value shift_right_logical(const Value& x, const Value& y);
Value clip(const Value& x, const Value& lo, const Value& hi);

Value operator-(const Value& x);
Value operator+(const Value& x, const Value& y);
Value operator-(const Value& x, const Value& y);
Value operator*(const Value& x, const Value& y);
// True division, as Python's `/` on jnp arrays: two integer (or bool) operands divide in
// float32. div() is lax.div, which truncates integers.
Value operator/(const Value& x, const Value& y);
// Scalars are weakly typed, as Python numbers meeting a jnp array: a double keeps a float
// x's dtype (float64 x * 0.5 is float64) and makes an integer or bool x float32 (int32 x * 0.5
// is float32, as in JAX); an integer (the templates below) keeps an integer x's dtype, makes
// a bool x int32 and is cast to a float x's dtype — except with `/`, true division, where an
// integer x gives float32. Integer scalars are exact (an int64 beyond 2^53 included).
Value operator+(const Value& x, double y);
Value operator-(const Value& x, double y);
Value operator*(const Value& x, double y);
Value operator/(const Value& x, double y);
Value operator+(double x, const Value& y);
Value operator-(double x, const Value& y);
Value operator*(double x, const Value& y);
Value operator/(double x, const Value& y);

namespace internal {
// `x op y` (or `y op x` when scalar_first) with y a weakly typed integer, or float; Op::kRem
// stands for remainder (Python's %).
Value with_weak_int(Op op, const Value& x, int64_t y, bool scalar_first);
Value with_weak_float(Op op, const Value& x, double y, bool scalar_first);
template <typename I>
using IfInteger = std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int>;
}  // namespace internal

template <typename I, internal::IfInteger<I> = 0>
Value operator+(const Value& x, I y) {
  return internal::with_weak_int(Op::kAdd, x, static_cast<int64_t>(y), false);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator-(const Value& x, I y) {
  return internal::with_weak_int(Op::kSub, x, static_cast<int64_t>(y), false);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator*(const Value& x, I y) {
  return internal::with_weak_int(Op::kMul, x, static_cast<int64_t>(y), false);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator/(const Value& x, I y) {
  return internal::with_weak_int(Op::kDiv, x, static_cast<int64_t>(y), false);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator+(I x, const Value& y) {
  return internal::with_weak_int(Op::kAdd, y, static_cast<int64_t>(x), true);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator-(I x, const Value& y) {
  return internal::with_weak_int(Op::kSub, y, static_cast<int64_t>(x), true);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator*(I x, const Value& y) {
  return internal::with_weak_int(Op::kMul, y, static_cast<int64_t>(x), true);
}
template <typename I, internal::IfInteger<I> = 0>
Value operator/(I x, const Value& y) {
  return internal::with_weak_int(Op::kDiv, y, static_cast<int64_t>(x), true);
}
// Comparisons give bool Values (as jnp's do). A scalar on either side is weakly typed as in
// the arithmetic above: `x > 0.0` compares an integer x in float32, `0 < x` in x's dtype.
Value operator==(const Value& x, const Value& y);
Value operator!=(const Value& x, const Value& y);
Value operator<(const Value& x, const Value& y);
Value operator<=(const Value& x, const Value& y);
Value operator>(const Value& x, const Value& y);
Value operator>=(const Value& x, const Value& y);
Value operator%(const Value& x, const Value& y);  // remainder
#define TESSERA_SCALAR_OPERATOR(OP, OPCODE)                                                                     \
  inline Value operator OP(const Value& x, double y) { return internal::with_weak_float(OPCODE, x, y, false); } \
  inline Value operator OP(double x, const Value& y) { return internal::with_weak_float(OPCODE, y, x, true); }  \
  template <typename I, internal::IfInteger<I> = 0>                                                             \
  Value operator OP(const Value& x, I y) {                                                                      \
    return internal::with_weak_int(OPCODE, x, static_cast<int64_t>(y), false);                                  \
  }                                                                                                             \
  template <typename I, internal::IfInteger<I> = 0>                                                             \
  Value operator OP(I x, const Value& y) {                                                                      \
    return internal::with_weak_int(OPCODE, y, static_cast<int64_t>(x), true);                                   \
  }
TESSERA_SCALAR_OPERATOR(==, Op::kEq)
TESSERA_SCALAR_OPERATOR(!=, Op::kNe)
TESSERA_SCALAR_OPERATOR(<, Op::kLt)
TESSERA_SCALAR_OPERATOR(<=, Op::kLe)
TESSERA_SCALAR_OPERATOR(>, Op::kGt)
TESSERA_SCALAR_OPERATOR(>=, Op::kGe)
TESSERA_SCALAR_OPERATOR(%, Op::kRem)  // remainder with a scalar (Op::kRem marks it)
#undef TESSERA_SCALAR_OPERATOR

// Shapes and types. convert casts to any dtype (float to int saturates, NaN gives 0);
// broadcast_in_dim maps operand dimension i to result dimension dims[i] (increasing);
// squeeze with no axes drops every dimension of size 1.
Value convert(const Value& x, DType dtype);
Value broadcast_in_dim(const Value& x, Shape shape, std::vector<int64_t> dims);
Value broadcast_to(const Value& x, Shape shape);  // numpy rules
// With out_sharding (lax.broadcast_in_dim's and jnp.broadcast_to's): the result is laid out by
// it (on the explicit mesh in explicit mode, else on the ambient mesh), as JAX's
// _broadcast_in_dim_sharding_rule returns it; grad lays the operand's cotangent out as the
// operand (JAX's _broadcast_in_dim_transpose_rule sums with out_sharding=operand's sharding).
Value broadcast_in_dim(const Value& x, Shape shape, std::vector<int64_t> dims, const PartitionSpec& out_sharding);
Value broadcast_to(const Value& x, Shape shape, const PartitionSpec& out_sharding);
Value reshape(const Value& x, Shape shape);
// With out_sharding: the result's layout, which explicit mode needs when a reshape splits or
// merges a split dimension.
Value reshape(const Value& x, Shape shape, const PartitionSpec& out_sharding);
Value transpose(const Value& x, std::vector<int64_t> permutation);
Value expand_dims(const Value& x, int64_t axis);
Value squeeze(const Value& x, std::vector<int64_t> axes);

// Reductions over `axes` (all axes when empty), optionally keeping them as size 1. mean needs
// a float operand (unlike jnp.mean, integers are an error). argmax gives an int32 or int64
// index along `axis`, which must not be empty.
Value sum(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value max(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value min(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value prod(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value mean(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value argmax(const Value& x, int64_t axis, DType index_dtype = DType::kI32);

// Contractions, on operands of one non-bool dtype (no promotion): dot_general as lax;
// matmul as jnp, with numpy's broadcasting of the batch dimensions ((B, S, D) @ (D, F) is
// (B, S, F); (2, 1, M, K) @ (3, K, N) is (2, 3, M, N)).
// Surprising: dot is matmul, which differs from jnp.dot for rank > 2.
Value dot_general(const Value& lhs, const Value& rhs, DotDims dims);
Value matmul(const Value& lhs, const Value& rhs);
Value dot(const Value& lhs, const Value& rhs);
// The same with out_sharding (jax.lax.dot_general's and jnp.matmul's): the result is laid out
// by it (on the explicit mesh in explicit mode, else on the ambient mesh), which is how explicit
// mode resolves a contraction over a dimension split on both operands: P('X', 'Y') on the
// result reduce-scatters the sum, P('X', None) all-reduces it. matmul's out_sharding, as
// jnp.matmul's, lays out its dot_general's product (batch, lhs free, rhs free dimensions,
// without the size-1 ones squeezed from both), before the transpose into numpy's order.
Value dot_general(const Value& lhs, const Value& rhs, DotDims dims, const PartitionSpec& out_sharding);
Value matmul(const Value& lhs, const Value& rhs, const PartitionSpec& out_sharding);

// lax.slice: x[start:limit:strides], one start and limit per dimension (no negative indices,
// 0 <= start <= limit <= the dimension) and optionally one stride per dimension (each >= 1;
// empty means 1), dimension d of the result ceil((limit - start) / stride) long; otherwise
// INVALID_ARGUMENT naming the rule (slicing.py's _slice_shape_rule). In explicit mode the
// result keeps x's sharding, and a split dimension whose length changes must still divide by
// its mesh axes (_slice_sharding_rule). xs joined along `axis`, agreeing in dtype and in every
// other dimension.
Value slice(const Value& x, std::vector<int64_t> start, std::vector<int64_t> limit, std::vector<int64_t> strides = {});
// lax.rev: x with each of `dimensions` reversed (element i of a dimension of size n is x's
// n-1-i there); distinct dimensions in [0, rank), else INVALID_ARGUMENT (_rev_shape_rule). The
// result keeps x's sharding (_rev_sharding_rule); grad reverses the cotangent.
Value rev(const Value& x, std::vector<int64_t> dimensions);
Value concatenate(const std::vector<Value>& xs, int64_t axis);

// Indexing with an integer (int32 or int64) index array along one dimension, as JAX. The result
// of a gather (and the updates of a scatter) has shape x[:axis] + indices + x[axis+1:].
// Out-of-range indices behave as JAX documents each form (jax.Array.at; jnp.take; lax.gather and
// lax.scatter's GatherScatterMode in jax/_src/lax/slicing.py):
//   take(x, i, axis)          jnp.take: negative indices count from the end; in the default fill
//                             mode an index outside [-n, n) gives `fill_value` (NaN for floats,
//                             the lowest integer, true for bool); IndexMode::kClip clamps
//                             instead, without wrapping negatives (jnp.take(mode='clip')).
//   at(x, i, axis).get()      x[i] / x.at[i].get(): negatives wrap, out of range clamps.
//   at(x, i, axis).set(u)     x.at[i].set(u) / .add(u): negatives wrap, out-of-range updates are
//   at(x, i, axis).add(u)     dropped; u broadcasts to the updates' shape and takes x's dtype. With
//                             repeated indices add applies every update, set one of them.
//   gather / scatter / scatter_add: lax's forms, no wrapping of negative indices (out of range).
//   Value rows = take(embedding, token_ids, 0);                  // (vocab, d) -> (batch, seq, d)
//   Value grad_table = at(zeros, token_ids).add(g);               // its transpose
// grad differentiates x and the updates (a scatter's with unique indices only, as JAX's set).
Value gather(const Value& x, const Value& indices, int64_t axis, IndexMode mode = IndexMode::kFillOrDrop,
             std::optional<Scalar> fill_value = std::nullopt);
Value scatter(const Value& x, const Value& indices, const Value& updates, int64_t axis,
              IndexMode mode = IndexMode::kFillOrDrop);
Value scatter_add(const Value& x, const Value& indices, const Value& updates, int64_t axis,
                  IndexMode mode = IndexMode::kFillOrDrop);
// The one-axis ops with every attribute (core/op_attrs.h's GatherAttrs), batch_dims included:
// the first batch_dims dimensions of x and the indices are matched elementwise, each example
// indexing its own x, as tf.gather(batch_dims=): a per-example KV-cache read of x[B,H,T,D] at
// positions t[B] is gather(x, t, GatherAttrs{2, mode, fill, 1}) -> (B, H, D).
Value gather(const Value& x, const Value& indices, const GatherAttrs& attrs);
Value scatter(const Value& x, const Value& indices, const Value& updates, const GatherAttrs& attrs);
Value scatter_add(const Value& x, const Value& indices, const Value& updates, const GatherAttrs& attrs);
Value take(const Value& x, const Value& indices, int64_t axis, IndexMode mode = IndexMode::kFillOrDrop,
           std::optional<Scalar> fill_value = std::nullopt);
// With out_sharding, as jax.Array.at[...].get(out_sharding=) (jax/_src/numpy/indexing.py,
// rewriting_take): the gather runs with the mesh's Explicit axes treated as Auto (auto_axes),
// so a split indexed dimension is no error, and its result is laid out by out_sharding. grad
// scatters the cotangent back the same way, laid out as x (JAX's test_auto_gather_out_sharding).
Value take(const Value& x, const Value& indices, int64_t axis, const PartitionSpec& out_sharding,
           IndexMode mode = IndexMode::kFillOrDrop, std::optional<Scalar> fill_value = std::nullopt);
// x.at[(slice(None),) * axis + (indices,)], for get, set and add.
class IndexRef {
 public:
  IndexRef(Value x, Value indices, int64_t axis) : x_(std::move(x)), indices_(std::move(indices)), axis_(axis) {}
  Value get() const;
  Value get(const PartitionSpec& out_sharding) const;  // as take's out_sharding
  Value set(const Value& updates) const;
  Value add(const Value& updates) const;
  // With out_sharding, as jax.Array.at[...].set / add(out_sharding=) (jax/_src/ops/scatter.py,
  // _scatter_update): the scatter runs with the mesh's Explicit axes treated as Auto
  // (auto_axes), so split indices or updates the explicit-mode rule refuses are no error, and
  // its result is laid out by out_sharding.
  Value set(const Value& updates, const PartitionSpec& out_sharding) const;
  Value add(const Value& updates, const PartitionSpec& out_sharding) const;

 private:
  Value x_, indices_;
  int64_t axis_;
};
inline IndexRef at(const Value& x, const Value& indices, int64_t axis = 0) { return IndexRef(x, indices, axis); }

// lax.gather / lax.scatter_add / lax.scatter with dimension numbers (jax/_src/lax/slicing.py;
// XLA's operation semantics), the form behind x[i, j], x[idx1, idx2] and take_along_axis. The
// index vector is the last dimension of the indices (JAX's implicit index_vector_dim); the
// other dimensions of the indices are the batch dimensions. A gather's result has rank
// len(offset_dims) + rank(indices) - 1: offset_dims are its dimensions of the slice (the
// operand's dimensions that are neither collapsed nor batching, in increasing order, each of
// its slice_sizes), the others the indices' batch dimensions in order. Operand dimension
// start_index_map[k] starts at index component k, operand_batching_dims[k] at the position
// along the indices' start_indices_batching_dims[k], the others at 0. For scatters,
// update_window_dims / inserted_window_dims / scatter_dims_to_operand_dims mirror offset_dims /
// collapsed_slice_dims / start_index_map, and the windows' sizes are the updates' sizes along
// update_window_dims (1 for inserted and batching dimensions).
// Modes as lax.GatherScatterMode (an IndexMode converts to its namesake): kClip clamps each
// start to [0, dim - slice size] so the slice fits; kFillOrDrop gives a gather's whole slice
// `fill_value` (unset: NaN, the lowest integer, true for bool) when any part of it is outside
// the operand, and drops a scatter's whole window then; kPromiseInBounds, lax.gather's default as
// JAX's (jax/_src/lax/slicing.py gather: "if mode is None: mode = PROMISE_IN_BOUNDS"; the
// scatters' default is kFillOrDrop, GatherScatterMode.from_any(None)), checks nothing: a gather
// clamps as kClip and a scatter drops as kFillOrDrop, what XLA does with it ("out-of-bounds
// gathers will be clamped but out-of-bounds scatters will be discarded"; JAX calls those results
// implementation-defined, gradients too); kOneHot is jnp.take_along_axis's (below): a gather refuses it (JAX's
// _gather_lower accepts only the other three) and a scatter drops out-of-bounds windows with it (JAX hands it to XLA's
// scatter unclamped). Negative indices are out of range (no wrapping, as lax). Dimension numbers that break JAX's rules
// (_gather_shape_rule, _scatter_shape_rule) fail the trace with INVALID_ARGUMENT naming the field, the values and the
// rule. Composites (client/lax_gather.cc): the slice's dimensions are folded into one linear index and the one-axis
// gather / scatter above runs on the flattened operand, so kernels, sharding rules, VJPs (a gather's is a scatter_add)
// and vmap are those ops'; an operand split on a dimension taken whole keeps its split.
//   // x[i, j] on a (5, 4) x with i, j of shape (3): indices stack(i, j) of shape (3, 2)
//   // (offset_dims, collapsed_slice_dims, start_index_map):
//   Value y = gather(x, ij, GatherDimensionNumbers{{}, {0, 1}, {0, 1}}, {1, 1});  // shape (3)
class GatherScatterMode {
 public:
  enum Kind : uint8_t { kClip, kFillOrDrop, kPromiseInBounds, kOneHot };
  constexpr GatherScatterMode(Kind kind) : kind_(kind) {}  // NOLINT(runtime/explicit): as JAX's enum
  constexpr GatherScatterMode(IndexMode mode)              // NOLINT(runtime/explicit)
      : kind_(mode == IndexMode::kClip ? kClip : kFillOrDrop) {}
  constexpr operator Kind() const { return kind_; }  // NOLINT(runtime/explicit)

 private:
  Kind kind_;
};
struct GatherDimensionNumbers {
  std::vector<int64_t> offset_dims;
  std::vector<int64_t> collapsed_slice_dims;
  std::vector<int64_t> start_index_map;
  std::vector<int64_t> operand_batching_dims = {};
  std::vector<int64_t> start_indices_batching_dims = {};
};
struct ScatterDimensionNumbers {
  std::vector<int64_t> update_window_dims;
  std::vector<int64_t> inserted_window_dims;
  std::vector<int64_t> scatter_dims_to_operand_dims;
  std::vector<int64_t> operand_batching_dims = {};
  std::vector<int64_t> scatter_indices_batching_dims = {};
};
Value gather(const Value& operand, const Value& start_indices, const GatherDimensionNumbers& dimension_numbers,
             std::vector<int64_t> slice_sizes, GatherScatterMode mode = GatherScatterMode::kPromiseInBounds,
             std::optional<Scalar> fill_value = std::nullopt);
// With repeated windows scatter_add adds every update and scatter writes one of them;
// scatter_mul / scatter_min / scatter_max (lax's) combine the operand's element with every
// update aimed at it by *, min or max (in an unspecified order, as XLA); min / max on bool are
// and / or (as JAX's lax.min / max); scatter_add / sub / mul refuse bool, as JAX's. Gradients:
// scatter_mul's as JAX's (for the updates JAX needs unique indices; here repeated ones get the
// product rule), scatter_min / max's as JAX's _scatter_extremal_jvp (the elements equal to the
// result share its cotangent equally, the operand's included).
Value scatter_add(const Value& operand, const Value& scatter_indices, const Value& updates,
                  const ScatterDimensionNumbers& dimension_numbers,
                  GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
Value scatter(const Value& operand, const Value& scatter_indices, const Value& updates,
              const ScatterDimensionNumbers& dimension_numbers,
              GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
Value scatter_mul(const Value& operand, const Value& scatter_indices, const Value& updates,
                  const ScatterDimensionNumbers& dimension_numbers,
                  GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
Value scatter_min(const Value& operand, const Value& scatter_indices, const Value& updates,
                  const ScatterDimensionNumbers& dimension_numbers,
                  GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
Value scatter_max(const Value& operand, const Value& scatter_indices, const Value& updates,
                  const ScatterDimensionNumbers& dimension_numbers,
                  GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
// lax.scatter_sub: the operand minus every update aimed at each element (repeated windows each
// subtract; out-of-range ones as the mode says); not for bool. Its gradient is JAX's
// (_scatter_addsub_transpose_rule): the operand's the cotangent, the updates' the negated gather
// of it (0 for dropped windows).
Value scatter_sub(const Value& operand, const Value& scatter_indices, const Value& updates,
                  const ScatterDimensionNumbers& dimension_numbers,
                  GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
// lax.scatter_apply: the operand with `func` applied to the elements the windows cover (windows of
// update_shape, placed as a scatter's updates of that shape would be), once per window: an
// element covered by n windows (repeated indices) becomes func applied n times, as XLA's scatter
// with func as its combiner; out-of-range windows as the mode says. func must be elementwise and
// keep the dtype (JAX traces it on a scalar); it is traced on the whole operand, then once more
// in each of log2(number of windows) loops of 2^j steps, each under a cond: the r = (largest
// count - 1) further steps run as r's binary digits, so exactly r steps run. Errors: the scatter's dimension-number
// errors (update_shape in the updates' place), INVALID_ARGUMENT when func changes the shape or dtype. grad goes through
// func's applications (JAX has no JVP for scatter_apply: "scatter_apply JVP not implemented"); where an element is not
// covered its cotangent passes unchanged, plus 0 times func's derivative there (NaN if that is not finite, as with
// where).
Value scatter_apply(const Value& operand, const Value& scatter_indices, const std::function<Value(const Value&)>& func,
                    const ScatterDimensionNumbers& dimension_numbers, Shape update_shape = {},
                    GatherScatterMode mode = GatherScatterMode::kFillOrDrop);
// jnp.take_along_axis(x, indices, axis): indices of x's rank, broadcasting with x in the other
// dimensions (numpy rules, size-1 dimensions stretch); negative indices wrap (JAX's default,
// not with kPromiseInBounds); then out-of-range ones give `fill_value` in the default fill mode,
// or clamp with kClip. One gather with batching dimensions (as JAX lowers it); with kOneHot,
// JAX's one-hot contraction instead (jax/_src/numpy/indexing.py: einsum of one_hot(indices)
// with x, so an out-of-range index gives 0 and a non-finite element of x along `axis` reaches
// every result of its row, as 0 * inf does).
Value take_along_axis(const Value& x, const Value& indices, int64_t axis,
                      GatherScatterMode mode = GatherScatterMode::kFillOrDrop,
                      std::optional<Scalar> fill_value = std::nullopt);

// lax.dynamic_slice / dynamic_update_slice: the window of `sizes` of x at `starts` (integer
// scalars, traced: one per dimension), and x with `update` written there. Each start is clamped
// to [0, dim - size] so the window fits, as lax does.
Value dynamic_slice(const Value& x, const std::vector<Value>& starts, std::vector<int64_t> sizes);
Value dynamic_update_slice(const Value& x, const Value& update, const std::vector<Value>& starts);

// Arrays made inside the traced function: iota counts along `dimension` (not bool); full
// holds `value` converted to dtype. Called outside a trace they return an invalid Value.
Value iota(DType dtype, Shape shape, int64_t dimension);
Value full(Shape shape, double value, DType dtype = DType::kF32);
// With out_sharding (lax.broadcasted_iota's, jnp.full / zeros / ones'): made laid out by it, on
// the explicit mesh in explicit mode, else on the ambient mesh; its type is out_sharding.
Value iota(DType dtype, Shape shape, int64_t dimension, const PartitionSpec& out_sharding);
Value full(Shape shape, double value, DType dtype, const PartitionSpec& out_sharding);

// Composites (client/lax.cc), traced from the ops above: their kernels, sharding rules and
// VJPs are those ops'.
// lax.pad: per dimension, `low` and `high` fills at the edges (negative ones crop) and
// `interior` fills between elements; padding_value is a scalar of x's dtype. jnp.pad's
// constant mode: (before, after) per dimension (one pair for all), non-negative.
struct PadDim {
  int64_t low = 0, high = 0, interior = 0;
};
Value pad(const Value& x, const Value& padding_value, const std::vector<PadDim>& config);
Value pad(const Value& x, std::vector<std::pair<int64_t, int64_t>> pad_width, double constant_value = 0.0);
// lax.cumsum / cumprod / cummax / cummin along `axis` (inclusive; `reverse` scans from the
// end). jnp's bool counts as int32 in cumsum and cumprod. A log2(n)-step prefix scan of slices
// and concatenates, so grad goes through the scan's combines, as JAX differentiates these
// through associative_scan (jax/_src/lax/control_flow/loops.py, _cumulative_jvp_rule): for
// cummax the cotangent goes to the element that attained the running maximum (halved at ties).
Value cumsum(const Value& x, int64_t axis, bool reverse = false);
Value cumprod(const Value& x, int64_t axis, bool reverse = false);
Value cummax(const Value& x, int64_t axis, bool reverse = false);
Value cummin(const Value& x, int64_t axis, bool reverse = false);
// jnp.argmin: the first index of the minimum along `axis`; the first NaN if there is one.
Value argmin(const Value& x, int64_t axis, DType index_dtype = DType::kI32);
// jnp.tril / triu over the last two dimensions: zeros above (below) diagonal k.
Value tril(const Value& x, int64_t k = 0);
Value triu(const Value& x, int64_t k = 0);
// jnp.einsum of two operands with an explicit output, "bij,bjk->bik": labels in both operands
// and the output are batch dimensions, in both and not the output contracted, in one and the
// output free; a label in one operand only and not the output is summed first. Repeated
// labels within an operand (traces, diagonals) and ellipses are refused. One dot_general and a
// transpose to the output's order.
Value einsum(const std::string& subscripts, const Value& a, const Value& b);
Value einsum(const std::string& subscripts, const Value& a, const Value& b, const PartitionSpec& out_sharding);

// jnp.argsort(x, axis, descending): int32 indices sorting x stably along `axis` (the ops
// argsort / argsort_descending): ascending puts NaNs last and keeps -0 and 0 in index order,
// descending puts NaNs first, then larger values, equal ones still in index order. A split
// `axis` is gathered; other dimensions keep their splits.
Value argsort(const Value& x, int64_t axis = -1, bool descending = false);
// jnp.sort along the last axis (its values through the argsort permutation: one gather, so
// grad scatters the cotangent back through the permutation). lax.top_k(x, k) along the last
// axis: the k largest values and their int32 indices, ties to the lower index, NaNs first
// (as argsort descending); grad flows to the values.
Value sort(const Value& x);
std::pair<Value, Value> top_k(const Value& x, int64_t k);

// jax.lax.with_sharding_constraint: pins the sharding of an intermediate. Fails the trace
// when `sharding` does not fit x's shape (NamedSharding::validate).
Value with_sharding_constraint(const Value& x, const NamedSharding& sharding);
// The same with a bare spec, on the ambient mesh (tessera/mesh_context.h's set_mesh); with
// none the trace fails with INVALID_ARGUMENT saying how to give one.
Value with_sharding_constraint(const Value& x, const PartitionSpec& spec);

// jax.sharding.reshard(x, spec) inside a trace: x laid out by `spec` (a move the program makes
// on purpose), on the explicit mesh in explicit mode, else on the ambient mesh (set_mesh); its
// type is `spec`. Outside a trace, reshard(Array, spec) in tessera/jit.h.
Value reshard(const Value& x, const PartitionSpec& spec);

// What auto_axes and explicit_axes return: f with some mesh axes switched to another type,
// called inside a trace on Values or, as JAX runs them outside jit, on arrays. C++ has no
// op-by-op dispatch, so the call on arrays runs f as a program of its own (compiled once per
// signature, as Jitted): the arguments' axes switch inside it exactly as in a trace, and the
// results come back laid out as the out_shardings say (auto_axes) or as f left them
// (explicit_axes). Converts to a TracedFunction.
class AxesSwitched {
 public:
  // Inside a trace: records f with the axes switched; errors fail the trace (below).
  std::vector<Value> operator()(const std::vector<Value>& args) const { return traced_(args); }
  // On arrays, outside a trace: the results, or the trace's error (INVALID_ARGUMENT) and
  // Jitted::operator()'s errors. Defined in client/jit.cc.
  absl::StatusOr<std::vector<Array>> operator()(const std::vector<Array>& args) const;

 private:
  friend AxesSwitched auto_axes(TracedFunction, std::vector<std::string>, std::vector<PartitionSpec>);
  friend AxesSwitched explicit_axes(TracedFunction, std::vector<std::string>, std::vector<PartitionSpec>);
  explicit AxesSwitched(TracedFunction traced);
  TracedFunction traced_;
  struct Eager;  // the compiled program for calls on arrays (jit.cc)
  std::shared_ptr<Eager> eager_;
};

// jax.sharding.auto_axes(f, axes, out_sharding): f traced with the Explicit mesh axes `axes`
// (all of the mesh's when empty) treated as Auto: its values' types leave them out and its
// ops' rules ignore them (the compiler decides there; get_abstract_mesh() shows them Auto),
// and each result is then resharded to its out_shardings entry (its type outside). The way
// around an op whose explicit rule refuses its operands. As JAX's, f runs as it is when no
// axis of `axes` is Explicit (outside explicit mode too). INVALID_ARGUMENT (failing the trace)
// for an axis not in the mesh or Manual, or for out_shardings not one per result. Callable on
// arrays outside a trace (AxesSwitched).
AxesSwitched auto_axes(TracedFunction f, std::vector<std::string> axes, std::vector<PartitionSpec> out_shardings);

// jax.sharding.explicit_axes(f, axes, in_sharding): f traced with the mesh axes `axes` (all
// when empty) Explicit: its arguments are first resharded to in_shardings (one per argument),
// which become their types, and every op inside has its explicit rule; the results' types
// then leave those axes out again. The mesh: the trace's explicit mesh, else the ambient one
// (set_mesh); none is INVALID_ARGUMENT with JAX's "Context mesh cannot be empty". Callable on
// arrays outside a trace (AxesSwitched).
AxesSwitched explicit_axes(TracedFunction f, std::vector<std::string> axes, std::vector<PartitionSpec> in_shardings);

namespace internal {
// auto_axes with out_shardings computed from f's results once they are known (the Python
// binding: a pytree prefix of the outputs).
TracedFunction auto_axes(TracedFunction f, std::vector<std::string> axes,
                         std::function<std::vector<PartitionSpec>()> out_shardings);
// reshard(x, spec) for the op `api` (named in errors): fails the trace when spec names an
// axis that is not Explicit there (check_explicit_axes, tessera/mesh_context.h).
Value reshard_for(absl::string_view api, const Value& x, const PartitionSpec& spec);
// `op()` (an op `api` on `operand`'s trace) in an out_sharding scope: its rules may leave an
// ambiguous result to out_sharding, which then lays the result out (reshard_for; the spec is
// checked before op is traced).
Value with_out_sharding(absl::string_view api, const Value& operand, const PartitionSpec& out_sharding,
                        const std::function<Value()>& op);
// In explicit mode, `op()` with out_sharding the type of a cotangent of `like`: like's with
// unreduced and reduced swapped (JAX's to_ct_spec; a cotangent takes its primal's sharding, as
// JAX's transpose rules give it); otherwise just `op()`.
Value typed_as(const Value& like, const std::function<Value()>& op);
// `op()` (an op on `operand`'s trace) in explicit mode with the mesh's Explicit axes treated
// as Auto (auto_axes), its result then laid out by out_sharding; otherwise with_out_sharding.
Value auto_out_sharding(absl::string_view api, const Value& operand, const PartitionSpec& out_sharding,
                        const std::function<Value()>& op);
// auto_out_sharding with out_sharding typed_as's (the type of a cotangent of `like`) in
// explicit mode; otherwise `op()` (the cotangent of an op that ran so, such as take's with
// out_sharding).
Value auto_typed_as(const Value& like, const std::function<Value()>& op);
}  // namespace internal

// ---- Control flow (client/control.cc) ------------------------------------------------------
//
// jax.lax.scan(f, init, xs, length, reverse): f(carry, x) -> (carry, y), with the carry and
// the xs / ys as lists of Values (JAX's pytrees, flattened as jit and grad take them). f is
// traced once, into a body sub-graph; the loop runs on the devices as a loop (never unrolled):
//   carry = init
//   for i in (reverse ? length-1 .. 0 : 0 .. length-1): carry, y[i] = f(carry, [x[i] for x in xs])
//   return carry, ys (each y stacked along a new leading dimension of `length`)
// length is the xs' common leading dimension; it must be given when there are no xs (and must
// agree with them when there are). Every carry must come back from f with its dtype and shape.
// The body may read Values traced outside it (a closure): each becomes a loop invariant
// of the loop (JAX's closed-over consts), and grad sums its cotangent over the iterations.
// Errors fail the trace (INVALID_ARGUMENT naming scan and the rule).
//
//   ScanResult r = scan([](const std::vector<Value>& c, const std::vector<Value>& x) {
//     Value next = c[0] + x[0];
//     return ScanStep{{next}, {next * 2.0}};
//   }, {zeros}, {xs});           // r.carry[0]: the sum of the rows; r.ys[0]: twice the cumsum
struct ScanStep {
  std::vector<Value> carry;
  std::vector<Value> ys;
};
using ScanFunction = std::function<ScanStep(const std::vector<Value>& carry, const std::vector<Value>& x)>;
struct ScanResult {
  std::vector<Value> carry;  // the final carries (invalid Values when the trace failed)
  // Each y stacked: (length, ...); invalid Values when the trace failed (none when it failed
  // before the body was traced: invalid operands, xs without a common leading dimension).
  std::vector<Value> ys;
};
ScanResult scan(const ScanFunction& f, const std::vector<Value>& init, const std::vector<Value>& xs,
                std::optional<int64_t> length = std::nullopt, bool reverse = false);

// jax.lax.fori_loop(lower, upper, body, init) with static bounds, lowered as JAX lowers it
// then: a scan of max(0, upper - lower) iterations with no xs, whose carry is (i, carry...),
// i an int32 scalar from lower. body(i, carry) returns the next carries (same types). Returns
// the final carries; differentiable (through scan's VJP), as JAX's fori_loop with static
// bounds is.
using ForiBody = std::function<std::vector<Value>(const Value& i, const std::vector<Value>& carry)>;
std::vector<Value> fori_loop(int64_t lower, int64_t upper, const ForiBody& body, const std::vector<Value>& init);

// jax.lax.while_loop(cond_fun, body_fun, init_val): `carry = init; while cond(carry): carry =
// body(carry); return carry`, run by the devices as a loop. cond returns a bool scalar, body
// the carries with their types. Forward only, as in JAX: grad through it fails naming the
// rule. The predicate is computed replicated (a pending reduction over split carries is
// all-reduced, bitwise alike on every device), so every device leaves at the same iteration.
// No bound on iterations without collectives in cond or body (the run's timeout or a cancel
// ends a loop that does not); with collectives, at most 65536 (their op ids are reserved per
// run; OUT_OF_RANGE past that). Both functions may read outer Values (closures).
using WhileCond = std::function<Value(const std::vector<Value>& carry)>;
using WhileBody = std::function<std::vector<Value>(const std::vector<Value>& carry)>;
std::vector<Value> while_loop(const WhileCond& cond, const WhileBody& body, const std::vector<Value>& init);

// jax.lax.switch(index, branches, *operands): branches[clamp(index, 0, n-1)](operands), an
// integer scalar index (clamped as lax.switch documents). Every branch must return the same
// dtypes and shapes (an error names the two that differ). Each branch is traced into a
// sub-graph and only the taken one runs; grad goes through the taken branch. Results are laid
// out as the branches agree (a dimension split the same way in every branch stays split;
// otherwise whole). Branches may read outer Values.
using Branch = std::function<std::vector<Value>(const std::vector<Value>& operands)>;
std::vector<Value> switch_(const Value& index, const std::vector<Branch>& branches, const std::vector<Value>& operands);

// jax.lax.cond(pred, true_fun, false_fun, *operands): switch_(pred, {false_fun, true_fun}),
// pred a bool (or number: nonzero is true) scalar.
std::vector<Value> cond(const Value& pred, const Branch& on_true, const Branch& on_false,
                        const std::vector<Value>& operands);

// What a checkpoint's policy is asked about each value f computes (jax.checkpoint_policies'
// `policy(prim, *args, **params)`): the op that computes it, by the name it prints with
// (JAX's primitive name for the ops JAX has: "dot_general", "tanh", "all_gather"), and for a
// dot_general its dimension numbers.
struct SaveableOp {
  std::string primitive;
  std::vector<int64_t> lhs_contracting, rhs_contracting, lhs_batch, rhs_batch;
};
// True keeps the value for grad's backward pass; false computes it again there.
using CheckpointPolicy = std::function<bool(const SaveableOp&)>;

// jax.checkpoint_policies (jax/_src/ad_checkpoint.py), by the same names.
namespace checkpoint_policies {
bool everything_saveable(const SaveableOp&);  // as if there were no checkpoint
bool nothing_saveable(const SaveableOp&);     // checkpoint's default: keep only f's arguments
bool dots_saveable(const SaveableOp&);        // keep dot_general results (checkpoint_dots)
// Keep the results of dot_generals without batch dimensions (a transformer's projections,
// not its attention scores); checkpoint_dots_with_no_batch_dims.
bool dots_with_no_batch_dims_saveable(const SaveableOp&);
}  // namespace checkpoint_policies

// jax.checkpoint / jax.remat(f, policy=): the same values, but grad recomputes f's forward in
// the backward pass instead of keeping its intermediates (f becomes a sub-graph called once,
// whose VJP runs f again beside its own backward). Saves memory between the forward and
// backward passes at the cost of computing f twice. A policy (null: nothing_saveable) keeps
// the values it names: f's sub-graph also returns them, and the backward pass reads them
// instead of computing them again (what only they need is not recomputed either).
TracedFunction checkpoint(TracedFunction f, CheckpointPolicy policy = nullptr);
inline TracedFunction remat(TracedFunction f, CheckpointPolicy policy = nullptr) {
  return checkpoint(std::move(f), std::move(policy));
}

}  // namespace tessera

#endif  // TESSERA_TRACE_H_

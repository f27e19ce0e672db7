// Tracing: running an ordinary array function on symbolic Values to record its Graph — the
// first step of jit, as JAX traces a Python function.
//
// Ops on Values never fail on the spot: the first error (a shape or dtype mismatch) is
// recorded, later ops are skipped, and trace() returns that error naming the op and shapes
// (as XLA's builder does).
//
//   absl::StatusOr<Graph> g = trace(
//       [](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; },
//       {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
//   g->to_text();
#ifndef TESSERA_TRACE_H_
#define TESSERA_TRACE_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/graph.h"
#include "core/sharding.h"

namespace tessera {

namespace internal {
struct TraceState;
}  // namespace internal

// A symbolic array inside a traced function: its dtype and shape, and the node computing it.
class Value {
 public:
  Value() = default;
  DType dtype() const;
  // By value: the graph's storage moves as ops are added, so a reference would dangle.
  Shape shape() const;
  int rank() const { return static_cast<int>(shape().size()); }
  // False once tracing has failed; ops on it record nothing.
  bool ok() const { return trace_ != nullptr && id_ >= 0; }
  int node() const { return id_; }

 private:
  friend struct internal::TraceState;
  Value(std::shared_ptr<internal::TraceState> trace, int id) : trace_(std::move(trace)), id_(id) {}
  std::shared_ptr<internal::TraceState> trace_;
  int id_ = -1;
};

// The dtype and shape of one input of a traced function.
struct ArrayType {
  DType dtype = DType::kF32;
  Shape shape;
};

using TracedFunction = std::function<std::vector<Value>(const std::vector<Value>&)>;

// Runs `f` once on Values of the given types; the Graph has one parameter per input and
// the function's results as outputs. INVALID_ARGUMENT with the first op that failed.
absl::StatusOr<Graph> trace(const TracedFunction& f, const std::vector<ArrayType>& inputs);

// Elementwise unary ops.
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
Value floor(const Value& x);
Value ceil(const Value& x);
Value sign(const Value& x);
Value logical_not(const Value& x);

// Elementwise binary ops with numpy broadcasting; a double takes the other operand's dtype.
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

Value operator-(const Value& x);
Value operator+(const Value& x, const Value& y);
Value operator-(const Value& x, const Value& y);
Value operator*(const Value& x, const Value& y);
Value operator/(const Value& x, const Value& y);
Value operator+(const Value& x, double y);
Value operator-(const Value& x, double y);
Value operator*(const Value& x, double y);
Value operator/(const Value& x, double y);
Value operator+(double x, const Value& y);
Value operator-(double x, const Value& y);
Value operator*(double x, const Value& y);
Value operator/(double x, const Value& y);
// Comparisons give bool Values (as jnp's do).
Value operator==(const Value& x, const Value& y);
Value operator!=(const Value& x, const Value& y);
Value operator<(const Value& x, const Value& y);
Value operator<=(const Value& x, const Value& y);
Value operator>(const Value& x, const Value& y);
Value operator>=(const Value& x, const Value& y);

// Shapes and types.
Value convert(const Value& x, DType dtype);
Value broadcast_in_dim(const Value& x, Shape shape, std::vector<int64_t> dims);
Value broadcast_to(const Value& x, Shape shape);  // numpy rules
Value reshape(const Value& x, Shape shape);
Value transpose(const Value& x, std::vector<int64_t> permutation);
Value expand_dims(const Value& x, int64_t axis);
Value squeeze(const Value& x, std::vector<int64_t> axes);

// Reductions over `axes` (all axes when empty), optionally keeping them as size 1.
Value sum(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value max(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value min(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value prod(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value mean(const Value& x, std::vector<int64_t> axes = {}, bool keepdims = false);
Value argmax(const Value& x, int64_t axis, DType index_dtype = DType::kI32);

// Contractions: dot_general as lax; matmul/dot as jnp for rank 1 and 2 operands.
Value dot_general(const Value& lhs, const Value& rhs, DotDims dims);
Value matmul(const Value& lhs, const Value& rhs);
Value dot(const Value& lhs, const Value& rhs);

Value slice(const Value& x, std::vector<int64_t> start, std::vector<int64_t> limit);
Value concatenate(const std::vector<Value>& xs, int64_t axis);

// Arrays made inside the traced function (REQUIRES: called while tracing).
Value iota(DType dtype, Shape shape, int64_t dimension);
Value full(Shape shape, double value, DType dtype = DType::kF32);

// jax.lax.with_sharding_constraint: pins the sharding of an intermediate.
Value with_sharding_constraint(const Value& x, const NamedSharding& sharding);

}  // namespace tessera

#endif  // TESSERA_TRACE_H_

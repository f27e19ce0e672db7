// Graph: the traced program jit compiles — typed nodes of a small op set, each with its
// dtype and shape inferred when it is added.
//
// Nodes are numbered in the order they are added, so operands always come first (the graph
// is in topological order by construction). Every add_* checks its operands and attributes
// and returns INVALID_ARGUMENT naming the op and the shapes involved.
//
//   Graph g;
//   int x = g.add_parameter(DType::kF32, {16, 8});
//   int w = g.add_parameter(DType::kF32, {8, 4});
//   absl::StatusOr<int> y = g.add_dot_general(x, w, DotDims{{}, {}, {1}, {0}});   // (16, 4)
//   absl::StatusOr<int> t = g.add_unary(Op::kTanh, *y);
//   g.set_outputs({*t});
//   g.to_text();   // "%0 = parameter(0) f32[16,8]\n..."
#ifndef TESSERA_CORE_GRAPH_H_
#define TESSERA_CORE_GRAPH_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/shape.h"
#include "core/sharding.h"

namespace tessera {

enum class Op : uint8_t {
  kParameter,
  kConstant,  // a full array of one value
  kIota,
  // Unary, elementwise.
  kNeg,
  kAbs,
  kExp,
  kLog,
  kTanh,
  kLogistic,
  kSqrt,
  kRsqrt,
  kSin,
  kCos,
  kFloor,
  kCeil,
  kSign,
  kNot,
  // Binary, elementwise, on operands of one shape (tracing broadcasts first).
  kAdd,
  kSub,
  kMul,
  kDiv,
  kPow,
  kMax,
  kMin,
  kAnd,
  kOr,
  // Comparisons: bool results.
  kEq,
  kNe,
  kLt,
  kLe,
  kGt,
  kGe,
  kSelect,
  kConvert,
  kBroadcastInDim,
  kReshape,
  kTranspose,
  kReduceSum,
  kReduceMax,
  kReduceMin,
  kReduceProd,
  kArgmax,
  kDotGeneral,
  kSlice,
  kConcatenate,
  kShardingConstraint,
};

// The op's name as it prints: "tanh", "dot_general", ...
std::string op_name(Op op);

bool is_unary(Op op);
bool is_binary(Op op);
bool is_comparison(Op op);
bool is_reduction(Op op);

// dot_general's dimension numbers, as lax.dot_general: batch dimensions pair up, contracting
// dimensions are summed over. The result is batch, then lhs free, then rhs free dimensions.
struct DotDims {
  std::vector<int64_t> lhs_batch, rhs_batch, lhs_contracting, rhs_contracting;
  bool operator==(const DotDims& o) const {
    return lhs_batch == o.lhs_batch && rhs_batch == o.rhs_batch && lhs_contracting == o.lhs_contracting &&
           rhs_contracting == o.rhs_contracting;
  }
};

struct Node {
  Op op = Op::kParameter;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<int> operands;
  // Attributes, by op:
  //   parameter: index; constant: value; iota: dims = {dimension};
  //   broadcast_in_dim: dims[i] = result dimension of operand dimension i;
  //   transpose: dims = permutation; reductions: dims = axes; argmax: dims = {axis};
  //   slice: dims = start, limits = limit; concatenate: dims = {axis}.
  int64_t index = 0;
  double value = 0;
  std::vector<int64_t> dims;
  std::vector<int64_t> limits;
  DotDims dot;
  std::optional<NamedSharding> sharding;  // sharding_constraint
};

class Graph {
 public:
  // Parameters are numbered in the order they are added.
  int add_parameter(DType dtype, Shape shape);
  absl::StatusOr<int> add_constant(DType dtype, Shape shape, double value);
  absl::StatusOr<int> add_iota(DType dtype, Shape shape, int64_t dimension);
  // Unary ops keep dtype and shape; kNot needs bool, the float functions need a float dtype.
  absl::StatusOr<int> add_unary(Op op, int x);
  // Operands of equal shape and dtype; comparisons give bool; kAnd/kOr need bool or integers.
  absl::StatusOr<int> add_binary(Op op, int x, int y);
  absl::StatusOr<int> add_select(int pred, int on_true, int on_false);
  absl::StatusOr<int> add_convert(int x, DType dtype);
  absl::StatusOr<int> add_broadcast_in_dim(int x, Shape shape, std::vector<int64_t> dims);
  absl::StatusOr<int> add_reshape(int x, Shape shape);
  absl::StatusOr<int> add_transpose(int x, std::vector<int64_t> permutation);
  // Reduces over `axes` (distinct, in range), dropping them.
  absl::StatusOr<int> add_reduce(Op op, int x, std::vector<int64_t> axes);
  absl::StatusOr<int> add_argmax(int x, int64_t axis, DType index_dtype);
  absl::StatusOr<int> add_dot_general(int lhs, int rhs, DotDims dims);
  absl::StatusOr<int> add_slice(int x, std::vector<int64_t> start, std::vector<int64_t> limit);
  absl::StatusOr<int> add_concatenate(const std::vector<int>& xs, int64_t axis);
  absl::StatusOr<int> add_sharding_constraint(int x, NamedSharding sharding);

  // INVALID_ARGUMENT for an id that is not a node.
  absl::Status set_outputs(std::vector<int> outputs);

  int size() const { return static_cast<int>(nodes_.size()); }
  const Node& node(int id) const { return nodes_[id]; }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<int>& parameters() const { return parameters_; }
  const std::vector<int>& outputs() const { return outputs_; }

  // One line per node, then the outputs:
  //   %2 = dot_general(%0, %1) f32[16,4] lhs_contracting={1} rhs_contracting={0}
  //   ROOT (%3)
  std::string to_text() const;

  // A stable hash of to_text() (FNV-1a): equal graphs have equal fingerprints, in any process.
  uint64_t fingerprint() const;

 private:
  absl::Status check_operand(int id, const char* op) const;
  int add(Node node);

  std::vector<Node> nodes_;
  std::vector<int> parameters_;
  std::vector<int> outputs_;
};

// "f32[16,8]", as node types print.
std::string type_to_string(DType dtype, const Shape& shape);

}  // namespace tessera

#endif  // TESSERA_CORE_GRAPH_H_

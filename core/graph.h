// Graph: the traced program jit compiles — typed nodes of the ops of core/op.h, each with its
// dtype and shape inferred by its op's type rule when it is added.
//
// Nodes are numbered in the order they are added, so operands always come first (the graph
// is in topological order by construction). Every add_* returns the new node's id, or
// INVALID_ARGUMENT naming the op and the shapes involved when an operand id is not a node or
// an operand or attribute breaks the op's rules; a failed add_* leaves the graph unchanged.
//
//   Graph g;
//   int x = g.add_parameter(DType::kF32, {16, 8});
//   int w = g.add_parameter(DType::kF32, {8, 4});
//   absl::StatusOr<int> y = g.add_dot_general(x, w, DotDims{{}, {}, {1}, {0}});   // (16, 4)
//   absl::StatusOr<int> t = g.add_unary(Op::kTanh, *y);
//   g.set_outputs({*t});
//   g.to_text();   // "%0 = parameter() f32[16,8] index=0\n..."
#ifndef TESSERA_CORE_GRAPH_H_
#define TESSERA_CORE_GRAPH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collective.h"
#include "core/dtype.h"
#include "core/op.h"
#include "core/op_attrs.h"
#include "core/scalar.h"
#include "core/shape.h"
#include "core/sharding.h"

namespace tessera {

// An operand's free dimensions (neither batch nor contracting), ascending: dot_general's
// result has the lhs's, then the rhs's, after the batch dimensions.
std::vector<int64_t> dot_free_dims(int64_t rank, const std::vector<int64_t>& batch,
                                   const std::vector<int64_t>& contracting);

// One node of a Graph: its op, result type, operand ids and attributes.
struct Node {
  Op op = Op::kParameter;
  DType dtype = DType::kF32;
  Shape shape;
  std::vector<int> operands;
  Attrs attributes;  // its op's alternative (OpDef::attrs), checked by Graph::add_node

  // The attributes as its op's alternative. REQUIRES: the node carries T (a node of a Graph
  // or from a wire decoder carries its op's); otherwise std::bad_variant_access.
  template <class T>
  const T& attrs() const {
    return std::get<T>(attributes);
  }
  template <class T>
  T& attrs() {
    return std::get<T>(attributes);
  }
};

// The mesh the node's attributes name (a sharding's, a collective's or axis_index's), or null.
const Mesh* mesh_of(const Node& n);

// The node's attributes as Graph::to_text prints them after its type (" start={0,0}
// limit={4,8}"), "" for none.
std::string attrs_to_text(const Node& n);

// A shard_map collective node's kind, reduce op and dimensions (no groups: they come from its
// axes, and a permute's pairs from its positions, when each device resolves the program).
// REQUIRES: has_trait(n.op, kCollective). An implementation detail of the compiler.
CollectiveSpec collective_of(const Node& n);

class Graph {
 public:
  // Parameters are numbered in the order they are added. Never fails.
  // REQUIRES: validate_shape(shape, dtype_size(dtype), ...) is OK.
  int add_parameter(DType dtype, Shape shape);
  // Any node: the op's type rule (core/op.h) gives its dtype and shape (those the op reads
  // as attributes, kAttrShape/kAttrDType, it keeps); a parameter gets the next index and a
  // reduction's axes are sorted. The errors of infer_type, and for an operand id that is not
  // a node. Every add_* below builds a node and adds it here, as graph_from_proto does.
  absl::StatusOr<int> add_node(Node node);
  // A full array of `value` (converted to dtype when run, as convert does); iota counts
  // along `dimension` (in range; not bool).
  absl::StatusOr<int> add_constant(DType dtype, Shape shape, Scalar value);
  absl::StatusOr<int> add_iota(DType dtype, Shape shape, int64_t dimension);
  // Unary ops keep dtype and shape; kNot needs bool or an integer (bitwise on integers),
  // kNeg/kAbs/kSign a numeric dtype (not bool), the others float32 or float64.
  absl::StatusOr<int> add_unary(Op op, int x);
  // Operands of equal shape and dtype (no broadcasting); comparisons give bool; kAnd/kOr
  // need bool or integers; the arithmetic ops but kMax/kMin reject bool.
  absl::StatusOr<int> add_binary(Op op, int x, int y);
  // `pred` bool, the branches of its shape and of one dtype.
  absl::StatusOr<int> add_select(int pred, int on_true, int on_false);
  // Any dtype to any dtype.
  absl::StatusOr<int> add_convert(int x, DType dtype);
  // dims: increasing, one per operand dimension; each operand dimension 1 or equal to its
  // result dimension. reshape keeps the element count; transpose takes a permutation.
  absl::StatusOr<int> add_broadcast_in_dim(int x, Shape shape, std::vector<int64_t> dims);
  absl::StatusOr<int> add_reshape(int x, Shape shape);
  absl::StatusOr<int> add_transpose(int x, std::vector<int64_t> permutation);
  // Reduces over `axes` (distinct, in range), dropping them.
  absl::StatusOr<int> add_reduce(Op op, int x, std::vector<int64_t> axes);
  // index_dtype int32 or int64; the axis in range and not empty.
  absl::StatusOr<int> add_argmax(int x, int64_t axis, DType index_dtype);
  // Operands of one non-bool dtype; dimension lists distinct and in range, paired ones of
  // equal size.
  absl::StatusOr<int> add_dot_general(int lhs, int rhs, DotDims dims);
  // 0 <= start <= limit <= the dimension, for every dimension; strides empty (all 1) or one
  // per dimension, each >= 1. Strides of all 1 are stored empty.
  absl::StatusOr<int> add_slice(int x, std::vector<int64_t> start, std::vector<int64_t> limit,
                                std::vector<int64_t> strides = {});
  // lax.rev: `dimensions` distinct and in range (stored sorted).
  absl::StatusOr<int> add_rev(int x, std::vector<int64_t> dimensions);
  // At least one operand; all agree in dtype, rank and every dimension but `axis`.
  absl::StatusOr<int> add_concatenate(const std::vector<int>& xs, int64_t axis);
  // `sharding` must fit x's shape (NamedSharding::validate).
  absl::StatusOr<int> add_sharding_constraint(int x, NamedSharding sharding);
  // shard_map: `x` enters a body as this device's block of `sharding` (which must fit it), a
  // body value leaves as one block of a global value laid out by `sharding`. `manual_axes`:
  // the body is manual over these axes only (ShardingAttrs; empty: all); the spec may name no
  // other.
  absl::StatusOr<int> add_shard_map_in(int x, NamedSharding sharding, std::vector<std::string> manual_axes = {});
  absl::StatusOr<int> add_shard_map_out(int x, NamedSharding sharding, std::vector<std::string> manual_axes = {});
  // A collective of a shard_map body over mesh `axes` (distinct, in `mesh`); `dims` and
  // `reduce_op` as the node attributes above. INVALID_ARGUMENT naming the rule broken: a
  // dimension out of range or not divisible by the axes' size, a permutation that repeats a
  // source or a target or names a position outside the axes.
  absl::StatusOr<int> add_collective(Op op, int x, const Mesh& mesh, std::vector<std::string> axes,
                                     std::vector<int64_t> dims, ReduceOp reduce_op = ReduceOp::kSum);
  // This device's position along `axes` (distinct, in `mesh`): an i32 scalar.
  absl::StatusOr<int> add_axis_index(const Mesh& mesh, std::vector<std::string> axes);
  // pvary(x) over mesh `axes` of `mesh` (core/op.h): x's value, typed as varying along them.
  absl::StatusOr<int> add_pvary(int x, const Mesh& mesh, std::vector<std::string> axes);
  // ragged_all_to_all over mesh `axes` of `mesh` (core/op.h) on `operands`: operand, output,
  // input_offsets, send_sizes, output_offsets, recv_sizes. INVALID_ARGUMENT as its type rule.
  absl::StatusOr<int> add_ragged_all_to_all(std::vector<int> operands, const Mesh& mesh, std::vector<std::string> axes);
  // x's slices at `indices` (int32/int64) along attrs.axis: X[:a] + I + X[a+1:] (GatherAttrs).
  absl::StatusOr<int> add_gather(int x, int indices, GatherAttrs attrs);
  // kScatter or kScatterAdd: x with `updates` (of the shape add_gather would give) set or added
  // at `indices` along attrs.axis.
  absl::StatusOr<int> add_scatter(Op op, int x, int indices, int updates, GatherAttrs attrs);
  // The window of `sizes` of x at `starts` (an int32/int64 vector, one per dimension), and x with
  // `update` written there; starts are clamped so the window fits, as lax.dynamic_slice.
  absl::StatusOr<int> add_dynamic_slice(int x, int starts, std::vector<int64_t> sizes);
  absl::StatusOr<int> add_dynamic_update_slice(int x, int update, int starts);
  // Threefry-2x32 random bits of `key` (uint32[2]) counting from `counter` (an int64 scalar)
  // over an array of `shape`: uint32[shape], or uint32[shape + (2,)] with both words. With a
  // batch of keys (uint32[batch..., 2]) and counters (int64[batch...]), each key's bits:
  // uint32[batch + shape (+ (2,))].
  absl::StatusOr<int> add_random_bits(int key, int counter, Shape shape, bool words);
  // `x` pinned to the layout `like` gets (same shape), as grad pins gradients. An
  // implementation detail of grad.
  absl::StatusOr<int> add_sharding_as(int x, int like);

  // INVALID_ARGUMENT for an id that is not a node.
  absl::Status set_outputs(std::vector<int> outputs);

  // Every use of node `from` (by a node, or as an output) reads `to` instead: a value known
  // to equal it, recorded before it (same dtype and shape; INVALID_ARGUMENT otherwise).
  // `from` itself stays, read by nothing (dead-code elimination drops it). How checkpoint's
  // VJP reads a value its forward pass kept instead of computing it again.
  absl::Status replace_uses(int from, int to);

  // The nodes, by id. node(id) REQUIRES: 0 <= id < size(); the reference dangles once a
  // node is added.
  int size() const { return static_cast<int>(nodes_.size()); }
  const Node& node(int id) const { return nodes_[id]; }
  const std::vector<Node>& nodes() const { return nodes_; }
  const std::vector<int>& parameters() const { return parameters_; }
  const std::vector<int>& outputs() const { return outputs_; }

  // One line per node, then the outputs:
  //   %2 = dot_general(%0, %1) f32[16,4] lhs_batch={} rhs_batch={} lhs_contracting={1} rhs_contracting={0}
  //   ROOT (%3)
  std::string to_text() const;

 private:
  absl::Status check_operand(int id, const std::string& op) const;

  std::vector<Node> nodes_;
  std::vector<int> parameters_;
  std::vector<int> outputs_;
};

// Whether `big` is `small` with more after it: small's nodes are its first nodes and small's
// outputs its first outputs. A scan's VJP extends the forward body with the values its
// backward pass reads (client/vjp/control.cc); the compiler runs both scans as one loop.
bool graph_extends(const Graph& big, const Graph& small);

// "f32[16,8]", as node types print.
std::string type_to_string(DType dtype, const Shape& shape);

}  // namespace tessera

#endif  // TESSERA_CORE_GRAPH_H_

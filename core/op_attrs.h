// Op attributes: what each op reads beyond its operands, as one named struct per kind, held
// by a Node in the Attrs variant. Each op's OpDef (core/op.h) names the one alternative it
// takes; Graph::add_node, the wire decoders and the op table test check that a node carries
// it, so a kernel or a rule reads its fields directly:
//
//   Node n = g.node(id);                               // a slice
//   const SliceAttrs& s = n.attrs<SliceAttrs>();       // s.start, s.limit
//   n.attributes = TransposeAttrs{{1, 0}};             // another op's node
//
// Adding an op's attributes is one struct here (with its kName), one alternative of Attrs, one
// message in proto/tessera.proto's KernelNode oneof with its encoder and decoder in
// core/wire.cc, and its text in attrs_to_text (core/graph.cc).
#ifndef TESSERA_CORE_OP_ATTRS_H_
#define TESSERA_CORE_OP_ATTRS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/collective.h"
#include "core/mesh.h"
#include "core/scalar.h"
#include "core/sharding.h"

namespace tessera {

class Graph;

// dot_general's dimension numbers, as lax.dot_general: batch dimensions pair up, contracting
// dimensions are summed over. The result is batch, then lhs free, then rhs free dimensions.
struct DotDims {
  std::vector<int64_t> lhs_batch, rhs_batch, lhs_contracting, rhs_contracting;
  bool operator==(const DotDims& o) const {
    return lhs_batch == o.lhs_batch && rhs_batch == o.rhs_batch && lhs_contracting == o.lhs_contracting &&
           rhs_contracting == o.rhs_contracting;
  }
};

// Ops that read nothing but their operands (elementwise ops, reshape, sharding_as, ...).
struct NoAttrs {
  static constexpr const char* kName = "none";
};
// parameter: its position among the graph's parameters (Graph numbers them).
struct ParameterAttrs {
  static constexpr const char* kName = "parameter";
  int64_t index = 0;
};
// constant: the value of every element, exact (integers as int64, floats bit for bit).
struct ConstantAttrs {
  static constexpr const char* kName = "constant";
  Scalar value;
};
// iota: the dimension it counts along.
struct IotaAttrs {
  static constexpr const char* kName = "iota";
  int64_t dimension = 0;
};
// broadcast_in_dim: result_dims[i] is the result dimension of operand dimension i.
struct BroadcastAttrs {
  static constexpr const char* kName = "broadcast";
  std::vector<int64_t> result_dims;
};
// transpose: result dimension i is operand dimension permutation[i].
struct TransposeAttrs {
  static constexpr const char* kName = "transpose";
  std::vector<int64_t> permutation;
};
// reduce_*: the operand dimensions folded away; rev: the dimensions reversed (Graph sorts them).
struct ReduceAttrs {
  static constexpr const char* kName = "reduce";
  std::vector<int64_t> axes;
};
// argmax: the dimension searched (and dropped).
struct ArgmaxAttrs {
  static constexpr const char* kName = "argmax";
  int64_t axis = 0;
};
// slice: per dimension, the first index kept, one past the last, and the step between kept
// indices (lax.slice's strides; empty means every stride is 1).
struct SliceAttrs {
  static constexpr const char* kName = "slice";
  std::vector<int64_t> start, limit, strides;
  int64_t stride(size_t d) const { return strides.empty() ? 1 : strides[d]; }
  // Whether the slice keeps the same position `start` of every run of `stride` elements
  // through the whole of dimension d, of size `dim` (start < stride and kept * stride == dim,
  // `kept` the result's dimension): x[::2], x[1::2], and every unit-stride slice of the whole
  // dimension. A split of d into blocks of whole runs then keeps its split, each device
  // slicing its own block alike.
  bool aligned(size_t d, int64_t dim, int64_t kept) const { return start[d] < stride(d) && kept * stride(d) == dim; }
};
// concatenate: the dimension the operands are joined along.
struct ConcatAttrs {
  static constexpr const char* kName = "concat";
  int64_t axis = 0;
};
// dot_general: its dimension numbers.
struct DotAttrs {
  static constexpr const char* kName = "dot";
  DotDims dims;
};
// sharding_constraint, shard_map_in/out: the layout (never a plan's kernel: placement is the
// partitioner's business).
struct ShardingAttrs {
  static constexpr const char* kName = "sharding";
  NamedSharding sharding;
  // shard_map_in/out of a body manual over these axes only (shard_map's axis_names), in mesh
  // order; empty: every axis (and for a constraint). The compiler splits the body's work over
  // the others, the automatic axes.
  std::vector<std::string> manual_axes = {};
};
// A shard_map collective: it runs over the replica groups of mesh `axes` of `mesh`.
//   all_reduce: reduce_op; reduce_scatter: reduce_op, dimension; all_gather: dimension;
//   all_to_all: split_dimension, concat_dimension;
//   collective_permute: positions = {source0, target0, source1, ...} along the axes.
struct CollectiveAttrs {
  static constexpr const char* kName = "collective";
  Mesh mesh;
  std::vector<std::string> axes;
  ReduceOp reduce_op = ReduceOp::kSum;
  int64_t dimension = 0;
  int64_t split_dimension = 0, concat_dimension = 0;
  std::vector<int64_t> positions;
};
// axis_index: this device's position along mesh `axes` of `mesh`. Set in a graph; a plan's
// axis_index names its axes in the instruction and runs on the plan's mesh (both unset here).
struct AxisIndexAttrs {
  static constexpr const char* kName = "axis_index";
  std::optional<Mesh> mesh;
  std::vector<std::string> axes;
};

// What an index outside [0, n) of the indexed dimension does, as lax.GatherScatterMode:
// kClip clamps it to [0, n - 1]; kFillOrDrop makes a gather return `fill_value` for it and a
// scatter drop its update. Negative indices are out of range here (jnp's functions wrap them
// before, see trace.h).
enum class IndexMode : uint8_t { kClip, kFillOrDrop };

// gather, scatter, scatter_add: JAX's common indexing forms, one integer index array along one
// operand dimension. With x of shape X, indices of shape I and axis a, the gathered value (and
// a scatter's updates) has shape X[:a] + I + X[a+1:]: element (p, j, q) is x[p, indices[j], q].
// That is jnp.take(x, i, axis=a), x[:, ..., i] and x.at[:, ..., i].get / set / add. fill_value
// (a gather in kFillOrDrop mode only) is what an out-of-range index gives; unset, JAX's
// default: NaN for floats, the lowest value for signed integers, true for bool
// (default_fill_value).
//
// batch_dims = n (tf.gather's batch_dims, jnp.take_along_axis's matched dimensions): the first
// n dimensions of x and of the indices are batch dimensions, of equal sizes, matched
// elementwise: each example b reads (writes) only its own x[b] at its own indices[b]. Then
// n <= axis and the shape is X[:a] + I[n:] + X[a+1:]: element (b, p, j, q) is
// x[b, p, indices[b, j], q]. n = 0 is the form above. A per-example KV-cache read x[B,H,T,D]
// at t[B] is gather(x, t, axis 2, batch_dims 1) -> (B, H, D): O(1) work per example, and a
// split of the batch stays a split, each device reading its own examples.
struct GatherAttrs {
  static constexpr const char* kName = "gather";
  int64_t axis = 0;
  IndexMode mode = IndexMode::kFillOrDrop;
  std::optional<Scalar> fill_value;
  int64_t batch_dims = 0;
};
// dynamic_slice: the window's size along each dimension.
struct DynamicSliceAttrs {
  static constexpr const char* kName = "dynamic_slice";
  std::vector<int64_t> sizes;
};

// scan (lax.scan): `body` takes the carries then one slice of each xs (its leading dimension
// dropped) and returns the new carries then the ys. The scan's operands are the initial
// carries (`num_carry` of them) then the xs, each with `length` rows; the body runs for rows
// 0 .. length-1 (length-1 .. 0 when `reverse`). The scan's results are one node each:
// `output` < num_carry is the final carry `output`, else the ys of body output `output`
// stacked along a new leading dimension of `length` (row i from the run on row i of the xs).
// The nodes of one scan share their operands and every field but `output` (the compiler runs
// them as one loop). Equality is by value: the wire form holds the whole body.
struct ScanAttrs {
  static constexpr const char* kName = "scan";
  std::shared_ptr<const Graph> body;
  int64_t length = 0;
  bool reverse = false;
  int64_t num_carry = 0;
  int64_t output = 0;
};

// random_bits: `shape` is the array whose elements are counted (row-major flat index i gets
// counter `counter + i`); the node's shape is that shape's leading block (a device's, which
// its counter operand starts at), with a last dimension of 2 when `words` keeps both words of
// the hash instead of their xor (keys: split, fold_in). With a batch of keys the node's shape
// has the keys' batch dimensions first; `shape` is still one key's.
struct RandomBitsAttrs {
  static constexpr const char* kName = "random_bits";
  std::vector<int64_t> shape;
  bool words = false;
};

// while / switch: sub-graphs (while: the predicate, then the body; switch: the branches) and
// which of the op's results the node is. `saved`: a checkpoint with a saving policy (a
// one-branch switch) returns the values its policy keeps after f's results, as its last
// `saved` outputs, which its VJP reads instead of computing them again
// (client/vjp/control.cc). It is the client's bookkeeping for grad and is not sent: the
// program is the same switch with more results.
struct BranchesAttrs {
  static constexpr const char* kName = "branches";
  std::vector<std::shared_ptr<const Graph>> graphs;
  int64_t output = 0;
  int64_t saved = 0;
};

// Every kind of attributes. NoAttrs first: a default Node carries none.
using Attrs = std::variant<NoAttrs, ParameterAttrs, ConstantAttrs, IotaAttrs, BroadcastAttrs, TransposeAttrs,
                           ReduceAttrs, ArgmaxAttrs, SliceAttrs, ConcatAttrs, DotAttrs, ShardingAttrs, CollectiveAttrs,
                           AxisIndexAttrs, GatherAttrs, DynamicSliceAttrs, ScanAttrs, RandomBitsAttrs, BranchesAttrs>;

namespace internal {
template <class T, class... Ts>
constexpr int alternative_index(const std::variant<Ts...>*) {
  int i = 0, found = -1;
  ((std::is_same_v<T, Ts> ? (found = i, ++i) : ++i), ...);
  return found;
}
template <class... Ts>
constexpr const char* alternative_name(int i, const std::variant<Ts...>*) {
  constexpr const char* kNames[] = {Ts::kName...};
  return i >= 0 && i < static_cast<int>(sizeof...(Ts)) ? kNames[i] : "unknown";
}
}  // namespace internal

// The position of T among Attrs' alternatives: what OpDef::attrs records.
template <class T>
inline constexpr int kAttrsIndex = internal::alternative_index<T>(static_cast<const Attrs*>(nullptr));
// The kName of alternative `index` ("slice"), "unknown" outside them.
inline constexpr const char* attrs_name(int index) {
  return internal::alternative_name(index, static_cast<const Attrs*>(nullptr));
}

}  // namespace tessera

#endif  // TESSERA_CORE_OP_ATTRS_H_

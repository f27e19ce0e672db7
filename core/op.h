// Op and OpDef: every operation a Graph can hold, each defined once, in one table (op.cc).
//
// An op's definition is its name, its number on the wire (pb::OpCode in proto/tessera.proto,
// written out there: never the C++ enum's order), how many operands it takes, its traits
// (what the compiler, the kernels and grad may assume of it), which attributes struct its
// nodes carry (core/op_attrs.h), and its one shape/dtype inference, which Graph::add_*, the wire decoders (graph and
// plan) and the worker's kernel check all call. The layers register the rest per op family, each in the family's file:
// kernels (worker/kernels/*.cc), VJPs (client/vjp/*.cc); tests/core/ op_table_test.cc fails when an op lacks one that
// the table does not say it goes without.
//
//   const OpDef& d = op_def(Op::kTanh);       // d.name == "tanh", d.arity == 1
//   has_trait(Op::kTanh, kElementwise);       // true
//   absl::StatusOr<ArrayType> t = infer_type(node, {{DType::kF32, {4}}});   // f32[4]
#ifndef TESSERA_CORE_OP_H_
#define TESSERA_CORE_OP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/dtype.h"
#include "core/scalar.h"
#include "core/shape.h"

namespace tessera {

struct Node;

// The C++ names of the ops. Their order means nothing: the wire number, the family and
// every property live in the op's OpDef.
enum class Op : uint8_t {
  kParameter,
  kConstant,  // a full array of one value
  kIota,
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
  kAdd,
  kSub,
  kMul,
  kDiv,
  kPow,
  kMax,
  kMin,
  kAnd,
  kOr,
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
  // shard_map (explicit per-device code). A body runs on every device on its own block:
  // shard_map_in takes a global value to this device's block of `sharding` (the in_spec);
  // shard_map_out makes body values (one block per device) a global value laid out by
  // `sharding` (the out_spec). Between them values have block shapes, and the collectives
  // run over the replica groups of mesh `axes` (core/collective.h).
  kShardMapIn,
  kShardMapOut,
  kAllReduce,          // psum, pmax, pmin: index = ReduceOp
  kAllGather,          // dims = {dimension}, tiled
  kReduceScatter,      // dims = {dimension}, tiled; index = ReduceOp
  kAllToAll,           // dims = {split, concat}, tiled
  kCollectivePermute,  // dims = {source0, target0, source1, ...}: positions along `axes`
  kAxisIndex,          // i32 scalar: this device's position along `axes`
  // Operand 0 laid out as operand 1 is (whole): gradients take their parameter's sharding.
  kShardingAs,
  kErf,  // the error function, as lax.erf
  // Indexing (GatherAttrs: the operand dimension indexed and the out-of-range mode):
  // gather(x, indices) takes x's slices at `indices` along `axis` (jnp.take);
  // scatter(x, indices, updates) sets them, scatter_add adds to them (x.at[i].set / add).
  kGather,
  kScatter,
  kScatterAdd,
  kDynamicSlice,        // (x, starts): a window of `sizes` at traced starts, clamped as lax
  kDynamicUpdateSlice,  // (x, update, starts): x with `update` written at traced starts
  kRem,                 // lax.rem: the remainder of truncating division (the dividend's sign)
  // lax.stop_gradient: the operand's value; grad passes no cotangent through it (kNoGradient).
  kStopGradient,
  // jnp.argsort (ArgmaxAttrs: the axis): int32 indices that sort the operand along `axis`,
  // stably, by JAX's comparator (NaNs last, -0 equal to 0); the descending one is
  // jnp.argsort(descending=True): NaNs first, equal elements still in index order.
  kArgsort,
  kArgsortDescending,
  // Control flow (ScanAttrs: a body sub-graph). scan(carry..., xs...) runs the body `length`
  // times; each node is one of its results (`output`): a final carry or a stacked y.
  kScan,
  // Randomness (RandomBitsAttrs): random_bits(key, counter) is Threefry-2x32 of `key` (uint32[2])
  // at the 64-bit counters `counter` (an int64 scalar's bits) + the flat index of each element
  // of an array of the attributes' shape, the two words xor-ed into one uint32 (or both, in
  // a last dimension of 2): JAX's partitionable random bits, split and fold_in. A batch of
  // keys, uint32[batch..., 2] with counters int64[batch...], gives each key's bits, batch
  // dimensions first (vmap's form).
  kRandomBits,
  kShiftRightLogical,  // lax.shift_right_logical on integers: zeros in; by >= the width gives 0
  kErfInv,             // lax.erf_inv: the inverse error function on (-1, 1); +-1 give +-inf
  // Control flow with sub-graphs (BranchesAttrs; each node is one of the results, `output`):
  // while(carry...) runs graphs[1] (the body) while graphs[0] (the predicate, a bool scalar)
  // holds; switch(index, operands...) runs graphs[clamp(index, 0, n-1)] on the operands.
  kWhile,
  kSwitch,
  // lax.pvary / lax.pcast(to='varying') (CollectiveAttrs: mesh, axes): inside a shard_map body,
  // the operand's value, typed as varying along `axes` (JAX's varying manual axes). No
  // instruction runs it: the partitioner aliases it to its operand, as JAX lowers it to its
  // operand. Its VJP passes the cotangent through (client/vjp/shard_map.cc says why).
  kPvary,
  // lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  // (CollectiveAttrs: mesh, axes): inside a shard_map body, each device sends rows
  // operand[input_offsets[i] : +send_sizes[i]] to the device at position i / (K / n) along
  // `axes` (K offsets, n devices), which writes them at rows output_offsets[i] (the sender's
  // value) of its own `output`; rows nothing is written to keep output's values. Runs as a
  // collective (CollectiveKind::kRaggedAllToAll) on the six operands' slots.
  kRaggedAllToAll,
  // lax.rev (ReduceAttrs: the dimensions reversed, distinct): element i of a reversed dimension
  // of size n is the operand's n-1-i; the shape is the operand's.
  kRev,
};
// How many ops there are (op.cc checks that the table defines each exactly once).
inline constexpr int kNumOps = static_cast<int>(Op::kRev) + 1;

// A value's type: what inference computes.
struct ArrayType {
  DType dtype = DType::kF32;
  Shape shape;
  bool operator==(const ArrayType& o) const { return dtype == o.dtype && shape == o.shape; }
  bool operator!=(const ArrayType& o) const { return !(*this == o); }
};

// Traits: what the layers may assume of an op, as bits of OpDef::traits.
enum OpTrait : uint32_t {
  kUnary = 1u << 0,              // elementwise on one operand, keeping its dtype and shape
  kBinary = 1u << 1,             // elementwise on two operands of one type
  kComparison = 1u << 2,         // a binary op with a bool result
  kElementwise = 1u << 3,        // result element i is a function of the operands' elements i
  kInPlace = 1u << 4,            // the kernel may write its result over an operand of the result's type
  kLinear = 1u << 5,             // linear in its one operand: a pending sum passes through it unreduced
  kLayout = 1u << 6,             // moves elements without computing on them
  kReduction = 1u << 7,          // folds the dimensions `dims` away
  kContraction = 1u << 8,        // sums products over paired dimensions (dot_general)
  kCollective = 1u << 9,         // a shard_map collective: runs as a collective, never as a kernel
  kBlockResult = 1u << 10,       // its result is each device's own block (shard_map_in, collectives, axis_index)
  kPlacement = 1u << 11,         // says where a value lives, or how it is typed (pvary): its value is its operand's
  kHasKernel = 1u << 12,         // a worker kernel computes it (worker/kernels/)
  kNoGradient = 1u << 13,        // grad passes no cotangent through it: it has no VJP rule, on purpose
  kLeavesBody = 1u << 14,        // makes blocks of a shard_map body one global value (shard_map_out)
  kPinned = 1u << 15,            // its layout is the user's: propagation never moves it
  kResolvedByDevice = 1u << 16,  // in a program, each device resolves it to a constant (axis_index)
};

// What of its result type an op is given rather than inferring (OpDef::given).
enum OpGiven : uint32_t {
  kGivenShape = 1u << 0,  // the result shape is the node's (parameter, constant, reshape, ...)
  kGivenDType = 1u << 1,  // the result dtype is the node's (parameter, constant, convert, argmax, ...)
};

// An op's type rule. `operands` has the op's arity and the node carries the op's attributes
// (infer_type checks both). INVALID_ARGUMENT naming the op, the types and the rule.
using InferFn = absl::StatusOr<ArrayType> (*)(const Node& node, absl::Span<const ArrayType> operands);

inline constexpr int kVariadic = -1;  // arity of an op taking one or more operands

struct OpDef {
  Op op;
  const char* name;  // as it prints: "tanh", "dot_general"
  int wire;          // its pb::OpCode number; never reused for another op
  int arity;         // operands, or kVariadic
  uint32_t traits;   // OpTrait bits
  uint32_t given;    // OpGiven bits
  int attrs;         // the Attrs alternative its nodes carry (core/op_attrs.h): kAttrsIndex<T>
  InferFn infer;
};

// Every op's definition, in wire order.
absl::Span<const OpDef> op_table();
// The definition of `op`. REQUIRES: op is one of the enum's values (is_op).
const OpDef& op_def(Op op);
// Whether `op` is one of the enum's values (a node from the wire or memory may hold anything).
bool is_op(Op op);
// The op with wire number `wire`, or INVALID_ARGUMENT "unknown op <wire>".
absl::StatusOr<Op> op_from_wire(int wire);
// The op's name as it prints; "unknown" for a value outside the enum.
std::string op_name(Op op);
inline bool has_trait(Op op, uint32_t trait) { return is_op(op) && (op_def(op).traits & trait) != 0; }

// The result type of `node` given its operands' types: the op's own rule, after checking that
// the op is known, the operand count is its arity ("add: takes 2 operands, got 1") and the
// node carries the op's attributes ("slice: the node carries iota attributes, not slice").
absl::StatusOr<ArrayType> infer_type(const Node& node, absl::Span<const ArrayType> operands);
// OK when `node` carries its op's attributes; otherwise INVALID_ARGUMENT naming the op and
// both kinds. REQUIRES: is_op(node.op).
absl::Status check_attrs(const Node& node);

// What a gather in IndexMode::kFillOrDrop gives for an out-of-range index when its node names
// no fill_value, as jnp.take documents: NaN for float dtypes, the highest value of uint32 (lax's gather fill), the
// lowest value of a signed integer dtype, true for bool.
Scalar default_fill_value(DType dtype);

// A digest of what the wire depends on in the table: each op's name, wire number, arity, what
// it is given and its attributes' kind. proto/rpc.h records the value next to kProtocolVersion; op_table_test fails
// when they differ, so a change to the table ships with a protocol version bump.
uint64_t op_table_digest();

}  // namespace tessera

#endif  // TESSERA_CORE_OP_H_

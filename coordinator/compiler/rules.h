// Sharding rules: how each op's layouts follow one another during propagation
// (propagate.cc), registered per op family, each family in its own file (rules_*.cc):
//   rules_elementwise.cc  constant, iota, unary, binary, comparisons, select, convert
//   rules_layout.cc       broadcast_in_dim, reshape, transpose, slice, concatenate, rev
//   rules_reduction.cc    reduce_{sum,max,min,prod}, argmax
//   rules_dot.cc          dot_general
//   rules_placement.cc    parameter, sharding_constraint, sharding_as, shard_map and its collectives
//   rules_indexing.cc     gather, scatter, scatter_add, dynamic_slice, dynamic_update_slice
//   rules_control.cc      scan (its body compiled as a program of its own)
//
// A rule's forward half decides a node's result layout from its operands' (the layouts seen
// so far) and what it needs of each operand; its backward half says how the operands'
// dimensions follow the result's, so the backward pass can move a layout across the op; its
// partition handler emits the node into the program (partition.cc), by default the
// op's kernel on local shapes after resharding each operand to what the op needs.
//
//   {Op::kNeg, {elementwise_forward, identity_map}}
#ifndef TESSERA_COORDINATOR_COMPILER_RULES_H_
#define TESSERA_COORDINATOR_COMPILER_RULES_H_

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "coordinator/compiler/propagate.h"
#include "core/graph.h"
#include "core/plan.h"

namespace tessera::internal {

using Dims = std::vector<Axes>;

// What a forward rule sees of the propagation in progress.
class ShardingContext {
 public:
  virtual ~ShardingContext() = default;
  virtual const Graph& graph() const = 0;
  virtual const Mesh& mesh() const = 0;
  // The layout of value `id` so far: nullopt for one not decided yet (a constant, an iota).
  virtual std::optional<ValueSharding> of(int id) const = 0;
  // Value `id`'s result layout (and pending reduction).
  virtual void set(int id, Dims dims, std::vector<std::string> partial = {}, ReduceOp op = ReduceOp::kSum) = 0;
  // What node `id` needs of each of its operands, in order.
  virtual std::vector<ValueSharding>& needs(int id) = 0;
  // The cost model (propagate.cc): estimated bytes one device receives to take value `id` from
  // `from` to `to`, and to resolve `v`'s pending reduction as a value of node `id` (by the
  // cheaper reduce_scatter); each collective also costs a fixed latency. 0 when nothing moves.
  virtual double move_cost(int id, const ValueSharding& from, const ValueSharding& to) const = 0;
  virtual double reduce_cost(int id, const ValueSharding& v) const = 0;
  // The mesh axes over which value `id` is automatic: in a shard_map body manual over some
  // axes only (axis_names), the others; else none.
  virtual const std::vector<std::string>& automatic_axes(int id) const = 0;
  // Whether value `id`'s pending sum is one the program typed unreduced (explicit mode's
  // `{U:Y}`): made by a constraint or an input whose spec names unreduced axes, and kept as it
  // was by every op since. A rule keeps such a sum where it would otherwise resolve it first
  // (broadcast_in_dim, concatenate): the type says it is still pending after the op.
  virtual bool typed_unreduced(int id) const = 0;
  // Marks value `id`'s pending sum (set first) as typed unreduced: for a rule whose result's sum
  // is one a sub-graph's result is typed with (explicit mode pins a loop body's or a branch's
  // results to their types; a pinned result keeps only the sum its type names).
  virtual void mark_typed_unreduced(int id) = 0;

  // of(id), or replicated when not decided yet.
  ValueSharding of_or_replicated(int id) const;
  // `spec` as one entry per dimension of a rank-`rank` value.
  Dims padded(const PartitionSpec& spec, size_t rank) const;
  // The leading axes of `axes` that are unused so far (in `taken`) and divide `size`; adds them
  // to `taken`.
  Axes usable(const Axes& axes, int64_t size, std::set<std::string>* taken) const;
};

// How a node's operands follow its result: operand k's dimension d follows result dimension
// follow[k][d] (-1: it does not, and keeps what the forward pass asked of it). Only the result
// dimensions in `free` may change.
struct DimMap {
  std::vector<std::vector<int>> follow;
  std::vector<bool> free;
};

// What a partition handler sees of the program being emitted (partition.cc): one program for
// every device (SPMD), so a handler never depends on a device's position — what does is
// said symbolically (core/plan.h) and resolved by each device.
class PartitionContext {
 public:
  virtual ~PartitionContext() = default;
  virtual const Graph& graph() const = 0;
  virtual const Mesh& mesh() const = 0;
  virtual const Propagation& propagation() const = 0;
  // "%3 = tanh": what the node's instructions are for.
  virtual std::string cause(int id) const = 0;
  // The slot holding value `id`, and where it goes.
  virtual int slot_of(int id) const = 0;
  virtual void bind(int id, int slot) = 0;
  // A new input slot (a parameter's local shard).
  virtual int add_input(int id) = 0;
  // The slot holding value `id` moved from layout `from` to `to` (the instructions the move
  // needs, each with the cause "for <cause>").
  virtual absl::StatusOr<int> reshard(int id, const ValueSharding& from, const ValueSharding& to,
                                      const std::string& cause) = 0;
  // Appends `inst` writing a new slot; returns the slot.
  virtual int emit(Instruction inst) = 0;
  // A slot no instruction writes yet (a loop's results beyond its first).
  virtual int fresh_slot() = 0;

  // The slots of node `id`'s operands, each resharded to what the node needs of it.
  absl::StatusOr<std::vector<int>> operands_as_needed(int id);
  // Node `id` as a kernel of this device on `in`: the node with its local result shape.
  Instruction local_kernel(int id, const std::vector<int>& in) const;
};

// The default partition handler: the operands resharded as needed, then local_kernel.
absl::Status partition_kernel(PartitionContext& c, int id);

// A kernel of `op` on slots `in` giving a (dtype, shape) value, emitted for node `id` (its
// cause); returns its slot. For the local arithmetic a handler adds around a node's kernel.
int emit_kernel(PartitionContext& c, int id, Op op, DType dtype, Shape shape, std::vector<int> in,
                Attrs attributes = NoAttrs{});
// A collective `spec` on slots `in` over the replica groups of mesh `axes` (a permute's
// (source, target) `positions` along them, in pairs), giving a (dtype, local shape) value,
// emitted for node `id`; returns its slot. Each device resolves the groups and pairs.
int emit_collective(PartitionContext& c, int id, const CollectiveSpec& spec, std::vector<int> in, Axes axes,
                    std::vector<int64_t> positions, DType dtype, Shape shape);
// The position of this device's block along a dimension split over mesh `axes` whose blocks
// hold `block` elements: axis_index(axes) * block, a scalar of `dtype` (each device resolves
// axis_index). REQUIRES: axes is not empty; dtype is numeric.
int emit_block_start(PartitionContext& c, int id, const Axes& axes, int64_t block, DType dtype);
// The start-index vector of a dynamic_slice or dynamic_update_slice: the scalar slots
// `scalars` (one per dimension, of `dtype`) as a dtype[scalars.size()] value. Returns its slot.
int emit_start_vector(PartitionContext& c, int id, const std::vector<int>& scalars, DType dtype);
// The term of the value in `slot` (of `dtype` and local `shape`) in a sum pending over mesh
// `axes` that counts it once: the value on the first device along them, zeros on the others.
// Returns its slot.
int emit_first_device_term(PartitionContext& c, int id, int slot, const Axes& axes, DType dtype, const Shape& shape);

struct ShardingRule {
  absl::Status (*forward)(ShardingContext& c, int id);
  DimMap (*backward)(const Graph& g, const Node& n);
  // Whether the rule runs inside a shard_map body too; else body values are blocks, kept
  // replicated and never moved (propagate.cc).
  bool in_body = false;
  absl::Status (*partition)(PartitionContext& c, int id) = partition_kernel;
};
struct ShardingRuleEntry {
  Op op;
  ShardingRule rule;
};

absl::Span<const ShardingRuleEntry> elementwise_rules();
absl::Span<const ShardingRuleEntry> layout_rules();
absl::Span<const ShardingRuleEntry> reduction_rules();
absl::Span<const ShardingRuleEntry> dot_rules();
absl::Span<const ShardingRuleEntry> placement_rules();
absl::Span<const ShardingRuleEntry> indexing_rules();
absl::Span<const ShardingRuleEntry> control_rules();

// The rule of a value inside a shard_map body (collectives, axis_index, and every op there):
// a replicated value of the block's shape, never moved; each device holds its own.
absl::Status body_value(ShardingContext& c, int id);

// A DimMap of rank(n) free dimensions in which every operand follows the result one to one
// (elementwise ops); and one with no operands (sources).
DimMap identity_map(const Graph& g, const Node& n);

// How each device reads its part of a slice that keeps a split of dimension d (of size `dim`,
// in blocks of B = dim / n over n devices, `kept` elements in the result, b = kept / n per
// device) although the slice is not aligned with the blocks: XLA's windowed-input reshard of a
// slice (spmd_partitioner_util.cc: ReshardDataForSlicing, ExchangeHaloAndGetValidData). Device
// p's b elements lie in the window [off(p), off(p) + width) of its own block's coordinates,
// off(p) = first + p * step, read with the slice's stride; width = (b - 1) * stride + 1. The
// window reads left[p] elements of the previous device's block and right[p] of the next one's
// (max_left, max_right: their largest; 0: none). A window may reach outside the dimension (a
// negative start, a limit past dim): that is a padding of the operand, as a concatenate
// [fill, x, fill] reads x (partition_concatenate), and pad_left / pad_right say how far the
// windows' elements reach before the first element and past the last (0 for a slice); the
// halos count the operand's elements only.
struct SliceWindow {
  int64_t first = 0, step = 0, width = 0, max_left = 0, max_right = 0, pad_left = 0, pad_right = 0;
  std::vector<int64_t> left, right;  // per device
};
// The window of slice `s` on dimension d when keeping the split there is possible and cheaper
// than gathering: kept > 0 divides by n, each halo comes from the neighbouring block only
// (max_left, max_right <= B), the halos are less than the (n - 1) * B elements a gather
// receives, and every window lies in its device's buffer [pad_left, previous block's tail of
// max_left, own block, next block's head of max_right, pad_right]. nullopt otherwise.
std::optional<SliceWindow> slice_window(const SliceAttrs& s, size_t d, int64_t dim, int64_t kept, int64_t n);

}  // namespace tessera::internal

namespace tessera {
// The rule registered for `op`, or null.
const internal::ShardingRule* find_sharding_rule(Op op);
}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COMPILER_RULES_H_

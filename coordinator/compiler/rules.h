// Sharding rules: how each op's layouts follow one another during propagation
// (propagate.cc), registered per op family, each family in its own file (rules_*.cc):
//   rules_elementwise.cc  constant, iota, unary, binary, comparisons, select, convert
//   rules_layout.cc       broadcast_in_dim, reshape, transpose, slice, concatenate
//   rules_reduction.cc    reduce_{sum,max,min,prod}, argmax
//   rules_dot.cc          dot_general
//   rules_placement.cc    parameter, sharding_constraint, sharding_as, shard_map and its collectives
//
// A rule's forward half decides a node's result layout from its operands' (the layouts seen
// so far) and what it needs of each operand; its backward half says how the operands'
// dimensions follow the result's, so the backward pass can move a layout across the op.
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

struct ShardingRule {
  absl::Status (*forward)(ShardingContext& c, int id);
  DimMap (*backward)(const Graph& g, const Node& n);
  // Whether the rule runs inside a shard_map body too; else body values are blocks, kept
  // replicated and never moved (propagate.cc).
  bool in_body = false;
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

// The rule of a value inside a shard_map body (collectives, axis_index, and every op there):
// a replicated value of the block's shape, never moved; each device holds its own.
absl::Status body_value(ShardingContext& c, int id);

// A DimMap of rank(n) free dimensions in which every operand follows the result one to one
// (elementwise ops); and one with no operands (sources).
DimMap identity_map(const Graph& g, const Node& n);

}  // namespace tessera::internal

namespace tessera {
// The rule registered for `op`, or null.
const internal::ShardingRule* find_sharding_rule(Op op);
}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COMPILER_RULES_H_

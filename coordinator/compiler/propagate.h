// Sharding propagation: gives every value of a Graph a sharding, GSPMD-style, from the
// shardings fixed by the user (inputs, with_sharding_constraint, out_shardings).
//
// A value's sharding is, per dimension, the mesh axes it is split over (as a PartitionSpec),
// plus possibly a pending reduction: a *partial* value holds, on each device, a term of a
// sum (or max, min, prod) over some mesh axes — what a contraction or reduction over a
// sharded dimension leaves. Partial values flow only through ops linear in them; every other
// op needs its operands whole, and the partitioner resolves them with all_reduce (or
// reduce_scatter when the consumer wants the result sharded).
//
// The pass decides, for every node, the sharding of its result and the sharding it needs of
// each operand; where the two differ the partitioner inserts the reshard. It runs forward
// (each value from its operands), then backward (from the last node to the first, each value
// the user did not pin may take a layout its consumers or out_shardings want, when the
// estimated bytes moved by the whole neighbourhood — its operands' reshards, its consumers'
// reshards — fall; among equal costs the layout splitting it most). So a constraint or an
// output sharding pulls the computation before it into its layout, a reshard lands where the
// value is smallest, and operands that disagree settle on the layout that moves least.
// A contraction or reduction over a split dimension always stays a partial sum (GSPMD).
//
//   absl::StatusOr<Propagation> p = propagate(graph, mesh, input_specs, output_specs);
//   p->result[node].to_string();     // "P('data', 'model')" or "P('data',) partial(sum over 'model')"
#ifndef TESSERA_COORDINATOR_COMPILER_PROPAGATE_H_
#define TESSERA_COORDINATOR_COMPILER_PROPAGATE_H_

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collective.h"
#include "core/graph.h"
#include "core/mesh.h"
#include "core/partition_spec.h"

namespace tessera {

// Whether two pending reductions are over the same mesh axes: their axes are a set (JAX's
// unreduced and reduced axes are sets), whatever order the ops that made them listed them in.
inline bool same_axes(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  return a.size() == b.size() && std::is_permutation(a.begin(), a.end(), b.begin());
}

struct ValueSharding {
  std::vector<Axes> dims;            // one entry per dimension of the value
  std::vector<std::string> partial;  // mesh axes of a pending reduction; empty if whole
  ReduceOp partial_op = ReduceOp::kSum;

  static ValueSharding replicated(size_t rank) { return ValueSharding{std::vector<Axes>(rank), {}, ReduceOp::kSum}; }
  bool is_partial() const { return !partial.empty(); }
  PartitionSpec spec() const { return PartitionSpec(dims); }
  // "P('data', None)", with " partial(sum over 'model')" when partial.
  std::string to_string() const;
  bool operator==(const ValueSharding& o) const {
    return dims == o.dims && same_axes(partial, o.partial) && (partial.empty() || partial_op == o.partial_op);
  }
  bool operator!=(const ValueSharding& o) const { return !(*this == o); }
};

struct Propagation {
  std::vector<ValueSharding> result;                 // per node
  std::vector<std::vector<ValueSharding>> operands;  // per node, what it needs of each operand
};

// `inputs` has one spec per graph parameter; `outputs` one optional spec per graph output
// (nullopt: let propagation choose). INVALID_ARGUMENT when a spec does not fit its value
// (named by parameter or output index) or uses an axis not in `mesh`.
absl::StatusOr<Propagation> propagate(const Graph& graph, const Mesh& mesh, const std::vector<PartitionSpec>& inputs,
                                      const std::vector<std::optional<PartitionSpec>>& outputs);

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COMPILER_PROPAGATE_H_

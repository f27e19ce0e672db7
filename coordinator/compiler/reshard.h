// Resharding: the one place that turns a value's sharding into another, choosing the cheapest
// moves — the partitioner asks it whenever a producer's sharding differs from what a consumer
// needs (XLA's Reshard).
//
// Moves, in order of preference:
//   partial -> sharded        reduce_scatter over the pending axes onto the wanted dimension
//   partial -> whole          all_reduce over the pending axes
//   axis moves to another dim all_to_all (split the new dimension, concatenate the old one)
//   axis dropped              all_gather along its dimension
//   axis added                local slice (free: every device already holds the data)
//   same axes, other order    collective_permute
//   whole -> partial          local: each device's term is its block, zero-padded along the new
//                             pending axes that split it, and the value on the first device
//                             along the others, zeros elsewhere (an unreduced reshard)
//
//   absl::StatusOr<std::vector<ReshardStep>> steps = plan_reshard(from, to, shape, mesh);
//   steps->front().to_string();   // "all_gather(dim=0, axes=('data',))"
#ifndef TESSERA_COORDINATOR_COMPILER_RESHARD_H_
#define TESSERA_COORDINATOR_COMPILER_RESHARD_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/compiler/propagate.h"

namespace tessera {

struct ReshardStep {
  enum class Kind { kAllReduce, kReduceScatter, kAllGather, kAllToAll, kLocalSlice, kCollectivePermute, kUnreduce };
  Kind kind = Kind::kAllReduce;
  std::vector<std::string> axes;        // mesh axes the step runs over (its replica groups)
  ReduceOp reduce_op = ReduceOp::kSum;  // all_reduce, reduce_scatter
  int dim = 0;                          // reduce_scatter / all_gather / local slice: the dimension
  int split_dim = 0, concat_dim = 0;    // all_to_all
  ValueSharding after;                  // the value's sharding once this step has run

  // "all_to_all(split=1, concat=0, axes=('model',))"
  std::string to_string() const;
};

// `s` without the mesh axes of size 1 (they split and reduce nothing); plan_reshard plans
// between the shardings so reduced.
ValueSharding without_unit_axes(ValueSharding s, const Mesh& mesh);

// The steps that take a value of `shape` from `from` to `to` (empty when they are equal).
// `to` is whole, or partial with exactly `from`'s pending reduction, which then stays pending
// (only the layout changes), or a sum pending over axes of a whole `from` (kUnreduce, last: the
// steps before it take `from` to `to`'s layout, except that a dimension `from` splits over new
// pending axes after `to`'s keeps them, to be zero-padded). INVALID_ARGUMENT if either does not
// fit the shape, or `to` is partial otherwise.
absl::StatusOr<std::vector<ReshardStep>> plan_reshard(const ValueSharding& from, const ValueSharding& to,
                                                      const Shape& shape, const Mesh& mesh);

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COMPILER_RESHARD_H_

// Host reference for compiled programs: runs a whole Graph on full, unsharded HostArrays in
// this process, node by node, with no partitioning, sharding or collectives involved — the
// single-device computation every jit result is checked against.
//
// Each node is computed by the worker kernel of its op (run_kernel), which tests/worker/
// kernels_test.cc checks against naive loops; parameters take the given inputs and
// with_sharding_constraint is the identity. A shard_map body runs once per mesh position on
// that position's blocks, and its collectives are computed from their definitions with the
// same kernels (a sum over the group is adds, a gather a concatenate, ...): nothing of the
// workers' collective engine is involved. A scan runs its body graph on the host once per row
// (recursively), nothing of the plan's loop involved.
//
//   absl::StatusOr<Graph> g = trace(f, {{DType::kF32, {16, 8}}});
//   HostArray x = ...;
//   absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*g, {&x});   // one per output
#ifndef TESSERA_TESTS_SUPPORT_HOST_EVAL_H_
#define TESSERA_TESTS_SUPPORT_HOST_EVAL_H_

#include <vector>

#include "absl/status/statusor.h"
#include "core/graph.h"
#include "core/host_array.h"

namespace tessera {

// The values of `graph`'s outputs, in order, for `inputs` (one per parameter, in parameter
// order; the caller keeps them). INVALID_ARGUMENT when the inputs' count, dtypes or shapes do
// not match the parameters; a kernel's error names the node that failed.
absl::StatusOr<std::vector<HostArray>> evaluate_on_host(const Graph& graph,
                                                        const std::vector<const HostArray*>& inputs);

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_HOST_EVAL_H_

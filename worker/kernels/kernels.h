// Kernels: the local computation of one graph node on arrays in this process's memory.
//
// A worker runs its part of a compiled program node by node; run_kernel computes one node's
// result from its operands' values, with the semantics of the matching jax.lax op.
//
//   Graph g;
//   int x = g.add_parameter(DType::kF32, {4});
//   int t = *g.add_unary(Op::kTanh, x);
//   HostArray in = HostArray::from_vector<float>({4}, {0, 1, 2, 3});
//   absl::StatusOr<HostArray> out = run_kernel(g.node(t), {&in});   // f32[4]
#ifndef TESSERA_WORKER_KERNELS_KERNELS_H_
#define TESSERA_WORKER_KERNELS_KERNELS_H_

#include <vector>

#include "absl/status/statusor.h"
#include "core/graph.h"
#include "core/host_array.h"

namespace tessera {

// Computes `node`'s result (of type node.dtype, node.shape) from `operands`, one per
// node.operands entry, in order; the caller keeps ownership of the operands and the result
// owns its storage.
//
// Every op whose OpDef has kHasKernel (core/op.h) has one, registered by its family
// (worker/kernels/internal.h); kShardingConstraint returns a copy of its operand (placement is
// the caller's business). Semantics are lax's, including its
// choices for integers: add, sub, mul, neg, abs and the reductions wrap around; x / 0 == -1 and
// INT_MIN / -1 == INT_MIN; pow with a negative exponent is 1 for base 1 and 0 otherwise. Float
// to integer conversion truncates toward zero and saturates, NaN becoming 0. Float max/min
// (elementwise and reductions) propagate NaN; argmax returns the first NaN, else the first
// maximum. Kernels that compute on bool elements read any nonzero byte as true.
//
// INVALID_ARGUMENT, naming the op, when the operands are not what the node says: a wrong count,
// a null pointer, operands the op's type rule refuses (its message, e.g. "tanh: operand is
// i32[4]; it needs float32 or float64 (convert first)") or from which it computes another type
// than the node's ("tanh: the operands (f32[5]) give f32[5] but the node is f32[4]"); when the
// op is not defined for the dtype; for an op without a kernel, and for kParameter, whose value
// only the caller knows.
// RESOURCE_EXHAUSTED when the result or a temporary cannot be allocated.
absl::StatusOr<HostArray> run_kernel(const Node& node, const std::vector<const HostArray*>& operands);

// Whether `node` can write its result over `operand`'s storage: it is elementwise (unary,
// arithmetic binary or select) and its result has the operand's dtype and shape.
bool can_run_in_place(const Node& node, const HostArray& operand);
// The same for an operand of `dtype` and `shape` (a plan's memory estimate, before it runs).
bool can_run_in_place(const Node& node, DType dtype, const Shape& shape);

// run_kernel with the result written over operands[reuse]'s elements instead of new storage,
// so that array then holds the result. The interpreter uses it for an operand whose slot dies
// at this node and that nothing else holds (a donated input, an intermediate).
// REQUIRES: nobody else reads operands[reuse] now or later as the old value.
// The errors of run_kernel, and INVALID_ARGUMENT when can_run_in_place is false.
absl::Status run_kernel_in_place(const Node& node, const std::vector<const HostArray*>& operands, int reuse);

}  // namespace tessera

#endif  // TESSERA_WORKER_KERNELS_KERNELS_H_

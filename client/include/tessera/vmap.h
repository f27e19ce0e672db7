// Vectorizing map of traced functions, as jax.vmap.
//
// vmap(f, in_axes, out_axes) is itself a traced function: called inside jit (or any trace,
// a shard_map body included) it maps f over one dimension of its arguments. f is recorded
// once on one example's shapes; then every recorded op that reads a mapped value is recorded
// again over the whole batch by its op's batching rule (client/batching/), so the batched
// program is the ops of trace.h, compiled, differentiated and partitioned like any other.
// The example's recording reaches no output and is dropped by the compiler.
//
//   TracedFunction row_dot = [](const std::vector<Value>& in) {
//     return std::vector<Value>{dot(in[0], in[0])};                 // f32[3] -> f32[]
//   };
//   Jitted f = jit(vmap(row_dot, {0}, {0}));                         // f32[4,3] -> f32[4]
//
// Rules: the elementwise and layout ops, reductions, argmax/argsort, dot_general, gather/scatter
// with unmapped indices, dynamic_slice/update, random bits over a batch of keys, scan, while,
// switch/cond, sharding constraints and the shard_map collectives. Other ops reading a mapped
// value (gathers with mapped indices) fail the trace with INVALID_ARGUMENT naming the op.
#ifndef TESSERA_VMAP_H_
#define TESSERA_VMAP_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "tessera/trace.h"

namespace tessera {

// f mapped over dimension in_axes[i] of argument i (nullopt: the argument is not mapped and
// every example sees it whole; negative axes count from the end; empty: 0 for every argument),
// its result j's mapped dimension put at out_axes[j] (nullopt: the result must not depend on
// a mapped argument and is returned as it is; one entry: the same for every result; empty: 0).
// The batch size is the mapped arguments' (they must agree) or `axis_size`, which must agree
// with them and is needed when no argument is mapped. Errors fail the enclosing trace with
// INVALID_ARGUMENT naming the argument or result and the rule: in_axes of the wrong length, an
// axis out of range, sizes that differ, out_axes nullopt for a mapped result, an op without a
// batching rule. Called outside a trace it records nothing and returns invalid Values.
//
// On a mesh with Explicit axes (jax.vmap over arrays "sharded in types"): the mapped
// dimensions of the mapped arguments must be split alike (INVALID_ARGUMENT, JAX's "Mapped away
// dimension of inputs passed to vmap should be sharded the same"), an unmapped argument must
// not be split over those axes; f sees each example typed without the mapped dimension (its
// other dimensions keep their splits), and the results' mapped dimension is split as the
// arguments' was (a result that does not depend on a mapped argument too).
// `spmd_axis_name` (mesh axes, as jax.vmap's): every with_sharding_constraint (and reshard) in
// f splits the mapped dimension over these axes, which its spec must not name; with Explicit
// arguments split along the mapped dimension, it must name the same axes.
TracedFunction vmap(TracedFunction f, std::vector<std::optional<int64_t>> in_axes = {},
                    std::vector<std::optional<int64_t>> out_axes = {}, std::optional<int64_t> axis_size = {},
                    std::vector<std::string> spmd_axis_name = {});

namespace internal {
// As vmap, with the out_axes given once f has run (by the results' count), for bindings whose
// out_axes depend on the structure f returns.
TracedFunction vmap(TracedFunction f, std::vector<std::optional<int64_t>> in_axes,
                    std::function<std::vector<std::optional<int64_t>>(size_t num_results)> out_axes,
                    std::optional<int64_t> axis_size, std::vector<std::string> spmd_axis_name = {});
}  // namespace internal

}  // namespace tessera

#endif  // TESSERA_VMAP_H_

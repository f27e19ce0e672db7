// The check of explicit_axes' in_shardings, shared by the traced switch (client/trace.cc) and
// Python's eager explicit_axes (python/src/arrays.cc), which puts Arrays on the specs itself.
//
//   absl::Status s = internal::check_explicit_axes_in_sharding(1, {DType::kF32, {4, 6}}, P("X", "Y"), inner);
//   // on a mesh whose 'Y' stayed Auto: INVALID_ARGUMENT "explicit_axes: argument 1 f32[4,6] with
//   // in_shardings[1] = P('X', 'Y'): PartitionSpec passed to explicit_axes cannot contain ..."
//
// Internal to the SDK (and its Python module); kept out of tessera/mesh_context.h, which
// nearly every file includes.
#ifndef TESSERA_CLIENT_EXPLICIT_AXES_CHECK_H_
#define TESSERA_CLIENT_EXPLICIT_AXES_CHECK_H_

#include <cstddef>

#include "absl/status/status.h"
#include "core/mesh.h"
#include "core/op.h"
#include "core/partition_spec.h"

namespace tessera::internal {

// explicit_axes' in_shardings[i] for its argument i of type `type`, as JAX checks it
// (jax/_src/pjit.py's _explicit_axes reshards each argument to its in_sharding under the
// switched mesh): the spec's axes are axes of `inner` (the mesh with the switched axes
// Explicit), each named once, each Explicit where this is called (check_explicit_axes:
// Manual inside a shard_map body, Auto inside auto_axes or when not switched), the spec no
// longer than the rank and each split dividing its dimension. INVALID_ARGUMENT naming the
// argument, its type, the spec and the rule otherwise.
absl::Status check_explicit_axes_in_sharding(size_t i, const ArrayType& type, const PartitionSpec& spec,
                                             const Mesh& inner);

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_EXPLICIT_AXES_CHECK_H_

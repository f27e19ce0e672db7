// The ambient mesh, as jax.set_mesh and jax.sharding.get_abstract_mesh: a scope that makes
// `mesh` the mesh that bare PartitionSpecs resolve against on this thread.
//
//   {
//     MeshScope scope = set_mesh(*mesh);
//     absl::StatusOr<Array> x = client->device_put(host, P("data"));  // NamedSharding(*mesh, P("data"))
//     Jitted f = jit([](const std::vector<Value>& in) {
//       return std::vector<Value>{with_sharding_constraint(in[0] * 2.0, P("data"))};
//     });
//     absl::StatusOr<ShardMapped> g = shard_map(body, {P("data")}, {P("data")});  // over *mesh
//   }
//
// Scopes nest (the innermost wins) and end with their object. The ambient mesh is per thread,
// as JAX's configuration contexts are (a trace runs on the thread that calls the jitted
// function the first time for a signature). A jitted function's cache keys on the ambient
// mesh, so a function traced under one mesh is traced again under another, as jax.jit's cache
// does. Bare specs with no ambient mesh are INVALID_ARGUMENT naming the call and the two ways
// to give one.
#ifndef TESSERA_MESH_CONTEXT_H_
#define TESSERA_MESH_CONTEXT_H_

#include <cstddef>
#include <optional>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "core/sharding.h"

namespace tessera {

// While it lives, its mesh is this thread's ambient mesh. Neither copyable nor movable: it
// ends where it was made (set_mesh returns it by guaranteed copy elision).
class [[nodiscard]] MeshScope {
 public:
  explicit MeshScope(Mesh mesh);
  ~MeshScope();
  MeshScope(const MeshScope&) = delete;
  MeshScope& operator=(const MeshScope&) = delete;

 private:
  size_t depth_;  // the stack's size before this scope
};

// jax.set_mesh(mesh) used as a context manager.
inline MeshScope set_mesh(Mesh mesh) { return MeshScope(std::move(mesh)); }

// jax.sharding.get_mesh(): the innermost ambient mesh of this thread (what set_mesh set), or
// none (JAX: an empty Mesh).
std::optional<Mesh> get_mesh();

// jax.sharding.get_abstract_mesh(): the axis sizes, names and types in force where it is
// called, empty when there are none. Outside a trace: the ambient mesh's. Inside one, as JAX's
// (which sets the abstract mesh in jit, shard_map and auto_axes / explicit_axes): the ambient
// mesh's at the top of a jitted function; in a shard_map body, its mesh with the axes the body
// is manual over Manual (jax/_src/shard_map.py, _as_manual_mesh); inside auto_axes the
// switched axes Auto, inside explicit_axes Explicit (jax/_src/pjit.py, _get_new_mesh).
// Tessera's explicit mode takes its mesh from the arguments: with no ambient mesh, inside
// auto_axes the mesh is that one.
AbstractMesh get_abstract_mesh();

// NamedSharding(ambient mesh, spec); INVALID_ARGUMENT "<who>: the bare PartitionSpec P(...)
// needs a mesh: ..." when there is none.
absl::StatusOr<NamedSharding> ambient_sharding(const PartitionSpec& spec, absl::string_view who);

namespace internal {
// JAX's rule for reshard and every op's out_sharding (jax/_src/sharding_impls.py,
// canonicalize_sharding): their specs name Explicit mesh axes only. OK when each axis `spec`
// names is Explicit where this is called: `mesh`'s type of it, made Auto inside auto_axes and
// Manual inside a shard_map body manual over it (the trace in progress on this thread, as
// get_abstract_mesh()). Otherwise INVALID_ARGUMENT in JAX's words, naming `api` (the op), the
// spec, the first such axis and its type, and the fix.
absl::Status check_explicit_axes(absl::string_view api, const PartitionSpec& spec, const Mesh& mesh);
// The same against the axis types `in_force` gives (Python's use_abstract_mesh).
absl::Status check_explicit_axes(absl::string_view api, const PartitionSpec& spec, const AbstractMesh& in_force);
}  // namespace internal

}  // namespace tessera

#endif  // TESSERA_MESH_CONTEXT_H_

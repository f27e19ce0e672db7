#include "tessera/mesh_context.h"

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"

namespace tessera {
namespace {

std::vector<Mesh>& stack() {
  thread_local std::vector<Mesh> meshes;
  return meshes;
}

}  // namespace

MeshScope::MeshScope(Mesh mesh) : depth_(stack().size()) { stack().push_back(std::move(mesh)); }

// Truncating (not popping) keeps the stack right even if an inner scope outlived this one.
MeshScope::~MeshScope() {
  if (stack().size() > depth_) stack().erase(stack().begin() + static_cast<std::ptrdiff_t>(depth_), stack().end());
}

std::optional<Mesh> get_mesh() {
  if (stack().empty()) return std::nullopt;
  return stack().back();
}

AbstractMesh get_abstract_mesh() {
  const std::optional<Mesh> ambient = get_mesh();
  AbstractMesh mesh = ambient.has_value() ? ambient->abstract_mesh() : AbstractMesh();
  const internal::TraceState* t = internal::TraceState::current;
  if (t == nullptr) return mesh;
  if (!t->manual_meshes.empty()) {
    // A shard_map body (or a control-flow body in one): the axes of each enclosing body are Manual.
    mesh = t->manual_meshes.back().abstract_mesh();
    for (const std::vector<std::string>& axes : t->manual_axes) mesh = mesh.update_axis_types(axes, AxisType::kManual);
    return mesh;
  }
  // explicit_mesh is the mesh explicit_axes switched (or the arguments' Explicit mesh).
  if (t->explicit_mesh.has_value() && (!mesh.empty() || !t->auto_axes.empty())) {
    mesh = t->explicit_mesh->abstract_mesh().update_axis_types(t->auto_axes, AxisType::kAuto);
  }
  return mesh;
}

absl::StatusOr<NamedSharding> ambient_sharding(const PartitionSpec& spec, absl::string_view who) {
  std::optional<Mesh> mesh = get_mesh();
  if (!mesh.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": the bare PartitionSpec ", spec.to_string(),
                                                   " needs a mesh: use NamedSharding(mesh, spec), or set one with "
                                                   "`MeshScope scope = set_mesh(mesh);`"));
  }
  return NamedSharding(*std::move(mesh), spec);
}

}  // namespace tessera

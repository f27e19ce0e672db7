#include "tessera/mesh_context.h"

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/explicit_axes_check.h"
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

namespace internal {

absl::Status check_explicit_axes(absl::string_view api, const PartitionSpec& spec, const Mesh& mesh) {
  AbstractMesh in_force = mesh.abstract_mesh();
  if (const TraceState* t = TraceState::current; t != nullptr) {
    in_force = in_force.update_axis_types(t->auto_axes, AxisType::kAuto);
    for (const std::vector<std::string>& axes : t->manual_axes) {
      in_force = in_force.update_axis_types(axes, AxisType::kManual);
    }
  }
  return check_explicit_axes(api, spec, in_force);
}

absl::Status check_explicit_axes(absl::string_view api, const PartitionSpec& spec, const AbstractMesh& in_force) {
  const std::vector<std::string>& names = in_force.axis_names();
  // The partitions' axes, then the unreduced and reduced ones (JAX checks all three).
  std::vector<std::string> axes = spec.used_axes();
  axes.insert(axes.end(), spec.unreduced().begin(), spec.unreduced().end());
  axes.insert(axes.end(), spec.reduced().begin(), spec.reduced().end());
  for (const std::string& axis : axes) {
    const auto it = std::find(names.begin(), names.end(), axis);
    if (it == names.end()) continue;  // NamedSharding::validate's error, given where the spec is used
    const AxisType type = in_force.axis_types()[static_cast<size_t>(it - names.begin())];
    if (type == AxisType::kExplicit) continue;
    const std::string fix =
        type == AxisType::kAuto
            ? absl::StrCat("lay Auto axes out with with_sharding_constraint, or make '", axis,
                           "' Explicit (explicit_axes, or a mesh made with axis_types Explicit)")
            : absl::StrCat(
                  "inside shard_map a Manual axis is per-device code: name only the body's other axes, or "
                  "reshard outside the shard_map");
    // JAX's wording (canonicalize_sharding), then what to do.
    return absl::InvalidArgumentError(absl::StrCat("PartitionSpec passed to ", api,
                                                   " cannot contain axis names that are of type Auto or Manual. Got "
                                                   "PartitionSpec: ",
                                                   spec.to_string(), " with axis name: ", axis,
                                                   " of type: ", axis_type_name(type), " (in ", in_force.to_string(),
                                                   "); ", api, " takes Explicit axes only: ", fix));
  }
  return absl::OkStatus();
}

// JAX reshards each argument to its in_sharding: canonicalize_sharding
// (jax/_src/sharding_impls.py: the mesh's axes, each once, of type Explicit there), then
// get_sharding (jax/_src/core.py: the spec's length against the rank, _check_divisibility).
absl::Status check_explicit_axes_in_sharding(size_t i, const ArrayType& type, const PartitionSpec& spec,
                                             const Mesh& inner) {
  const NamedSharding sharding(inner, spec);
  absl::Status fits = sharding.validate_spec();
  if (fits.ok()) fits = check_explicit_axes("explicit_axes", spec, inner);
  if (fits.ok()) fits = sharding.validate(type.shape);
  if (fits.ok()) return fits;
  return absl::InvalidArgumentError(absl::StrCat("explicit_axes: argument ", i, " ",
                                                 type_to_string(type.dtype, type.shape), " with in_shardings[", i,
                                                 "] = ", spec.to_string(), ": ", fits.message()));
}

}  // namespace internal
}  // namespace tessera

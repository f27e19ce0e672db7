#include "tessera/mesh_context.h"

#include <cstddef>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

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

std::optional<Mesh> get_abstract_mesh() {
  if (stack().empty()) return std::nullopt;
  return stack().back();
}

absl::StatusOr<NamedSharding> ambient_sharding(const PartitionSpec& spec, absl::string_view who) {
  std::optional<Mesh> mesh = get_abstract_mesh();
  if (!mesh.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": the bare PartitionSpec ", spec.to_string(),
                                                   " needs a mesh: use NamedSharding(mesh, spec), or set one with "
                                                   "`MeshScope scope = set_mesh(mesh);`"));
  }
  return NamedSharding(*std::move(mesh), spec);
}

}  // namespace tessera

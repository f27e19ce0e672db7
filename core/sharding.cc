#include "core/sharding.h"

#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/axis_set_repr.h"
#include "core/status.h"

namespace tessera {

std::string index_to_string(const Index& index) {
  return absl::StrCat(
      "[",
      absl::StrJoin(index, ", ", [](std::string* out, const Slice& s) { absl::StrAppend(out, s.start, ":", s.stop); }),
      "]");
}

absl::Status NamedSharding::validate_spec() const {
  std::set<std::string> seen;
  for (int d = 0; d < spec_.size(); ++d) {
    for (const std::string& axis : spec_.axes(d)) {
      if (mesh_.axis_index(axis) < 0) {
        return absl::InvalidArgumentError(absl::StrCat("sharding ", spec_.to_string(), ": axis '", axis,
                                                       "' of dimension ", d, " is not in the mesh; its axes are ('",
                                                       absl::StrJoin(mesh_.axis_names(), "', '"), "')"));
      }
      if (!seen.insert(axis).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("sharding ", spec_.to_string(), ": mesh axis '", axis, "' is used more than once"));
      }
    }
  }
  TESSERA_RETURN_IF_ERROR(spec_.check());
  // jax/_src/named_sharding.py, _check_mesh_unreduced (its words).
  auto check_axes = [this](const std::string& what, const std::vector<std::string>& axes) -> absl::Status {
    for (const std::string& axis : axes) {
      const int i = mesh_.axis_index(axis);
      if (i < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " axes ", axis, " is not found in mesh.axis_names=('", absl::StrJoin(mesh_.axis_names(), "', '"),
            mesh_.rank() == 1 ? "'," : "'", "). Got pspec=", spec_.to_string()));
      }
      if (mesh_.axis_types()[i] != AxisType::kExplicit) {
        return absl::InvalidArgumentError(absl::StrCat(
            what, " axes can only refer to mesh axes that is of type `Explicit`. Got ", absl::AsciiStrToLower(what),
            " axes: frozenset(", axis_set_repr(axes), ") and mesh: ", mesh_.to_string()));
      }
    }
    return absl::OkStatus();
  };
  TESSERA_RETURN_IF_ERROR(check_axes("Unreduced", spec_.unreduced()));
  TESSERA_RETURN_IF_ERROR(check_axes("Reduced", spec_.reduced()));
  return absl::OkStatus();
}

absl::Status NamedSharding::validate(const Shape& shape) const {
  absl::Status spec_status = validate_spec();
  if (!spec_status.ok()) return spec_status;
  if (spec_.size() > static_cast<int>(shape.size())) {
    return absl::InvalidArgumentError(absl::StrCat("sharding ", spec_.to_string(), " has ", spec_.size(),
                                                   " entries but the array of shape ", shape_to_string(shape),
                                                   " has rank ", shape.size()));
  }
  for (int d = 0; d < spec_.size(); ++d) {
    const Axes& axes = spec_.axes(d);
    if (axes.empty()) continue;
    int64_t blocks = num_blocks(d);
    if (shape[d] % blocks == 0) continue;
    if (axes.size() == 1) {
      return absl::InvalidArgumentError(absl::StrCat("sharding ", spec_.to_string(), ": dimension ", d, " of size ",
                                                     shape[d], " is not divisible by mesh axis '", axes[0],
                                                     "' of size ", blocks));
    }
    return absl::InvalidArgumentError(absl::StrCat("sharding ", spec_.to_string(), ": dimension ", d, " of size ",
                                                   shape[d], " is not divisible by mesh axes ('",
                                                   absl::StrJoin(axes, "', '"), "') of total size ", blocks));
  }
  return absl::OkStatus();
}

int64_t NamedSharding::num_blocks(int dim) const { return mesh_.axes_size(spec_.axes(dim)); }

Shape NamedSharding::shard_shape(const Shape& shape) const {
  Shape out = shape;
  for (int d = 0; d < spec_.size(); ++d) out[d] /= num_blocks(d);
  return out;
}

std::vector<DeviceShard> NamedSharding::device_shards(const Shape& shape) const {
  const Shape block = shard_shape(shape);
  // Axes that split no dimension number the replicas, in mesh order.
  std::vector<bool> used(mesh_.rank(), false);
  for (const std::string& axis : spec_.used_axes()) used[mesh_.axis_index(axis)] = true;

  std::vector<DeviceShard> out;
  out.reserve(static_cast<size_t>(mesh_.size()));
  for (int64_t pos = 0; pos < mesh_.size(); ++pos) {
    const std::vector<int64_t> c = mesh_.coords(pos);
    DeviceShard shard;
    shard.device_id = mesh_.device_ids()[pos];
    shard.mesh_position = pos;
    for (size_t d = 0; d < shape.size(); ++d) {
      const int64_t b = block_index(c, static_cast<int>(d));
      shard.index.push_back({b * block[d], (b + 1) * block[d]});
    }
    for (int a = 0; a < mesh_.rank(); ++a) {
      if (!used[a]) shard.replica_id = shard.replica_id * mesh_.shape()[a] + c[a];
    }
    out.push_back(std::move(shard));
  }
  return out;
}

bool NamedSharding::is_fully_replicated() const { return num_replicas() == mesh_.size(); }

int64_t NamedSharding::num_replicas() const { return mesh_.size() / mesh_.axes_size(spec_.used_axes()); }

bool NamedSharding::is_equivalent_to(const NamedSharding& other, int ndim) const {
  if (mesh_.device_ids() != other.mesh_.device_ids()) return false;
  if (spec_.size() > ndim || other.spec_.size() > ndim) return false;
  if (!validate_spec().ok() || !other.validate_spec().ok()) return false;
  // Unreduced blocks are terms of a sum, not copies; reduced ones are laid out as replicated.
  if (spec_.unreduced() != other.spec_.unreduced()) return false;
  // Per dimension, the same number of blocks and, on every device, the same block: then both
  // hold the same pieces on the same devices. (Replicas follow: the devices of one block.)
  for (int d = 0; d < ndim; ++d) {
    if (num_blocks(d) != other.num_blocks(d)) return false;
  }
  for (int64_t pos = 0; pos < mesh_.size(); ++pos) {
    const std::vector<int64_t> c = mesh_.coords(pos), other_c = other.mesh_.coords(pos);
    for (int d = 0; d < ndim; ++d) {
      if (block_index(c, d) != other.block_index(other_c, d)) return false;
    }
  }
  return true;
}

int64_t NamedSharding::block_index(const std::vector<int64_t>& coords, int dim) const {
  int64_t block = 0;
  for (const std::string& axis : spec_.axes(dim)) {
    const int a = mesh_.axis_index(axis);
    block = block * mesh_.shape()[a] + coords[a];
  }
  return block;
}

std::string NamedSharding::to_string() const {
  return absl::StrCat("NamedSharding(mesh=", mesh_.to_string(), ", spec=", spec_.to_string(), ")");
}

}  // namespace tessera

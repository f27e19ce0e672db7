#include "core/mesh.h"

#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {

absl::StatusOr<Mesh> Mesh::create(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                  std::vector<int> device_ids) {
  if (shape.size() != axis_names.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mesh: shape has ", shape.size(), " axes but ", axis_names.size(), " axis names were given"));
  }
  // Names and axes travel in every request and status reply that carries the mesh: bounded,
  // so that one client's mesh cannot make replies too large for everyone (tessera status).
  constexpr size_t kMaxAxes = 32, kMaxAxisName = 128;
  if (shape.size() > kMaxAxes) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: ", shape.size(), " axes exceed the limit of ", kMaxAxes));
  }
  int64_t total = 1;
  std::set<std::string> seen_names;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (axis_names[i].size() > kMaxAxisName) {
      return absl::InvalidArgumentError(absl::StrCat("mesh: the name of axis ", i, " has ", axis_names[i].size(),
                                                     " bytes, over the limit of ", kMaxAxisName));
    }
    if (shape[i] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("mesh: axis '", axis_names[i], "' has size ", shape[i], "; sizes must be >= 1"));
    }
    if (axis_names[i].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("mesh: axis ", i, " has an empty name"));
    }
    if (!seen_names.insert(axis_names[i]).second) {
      return absl::InvalidArgumentError(absl::StrCat("mesh: axis name '", axis_names[i], "' is repeated"));
    }
    if (total > (int64_t{1} << 24) / shape[i]) {
      return absl::InvalidArgumentError("mesh: more than 2^24 devices");
    }
    total *= shape[i];
  }
  if (static_cast<int64_t>(device_ids.size()) != total) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: shape (", absl::StrJoin(shape, ", "), ") needs ", total,
                                                   " devices but ", device_ids.size(), " were given"));
  }
  std::set<int> seen_ids;
  for (int id : device_ids) {
    if (id < 0) return absl::InvalidArgumentError(absl::StrCat("mesh: device id ", id, " is negative"));
    if (!seen_ids.insert(id).second) {
      return absl::InvalidArgumentError(absl::StrCat("mesh: device ", id, " appears twice"));
    }
  }
  Mesh mesh;
  mesh.shape_ = std::move(shape);
  mesh.axis_names_ = std::move(axis_names);
  mesh.device_ids_ = std::move(device_ids);
  return mesh;
}

int Mesh::axis_index(absl::string_view name) const {
  for (size_t i = 0; i < axis_names_.size(); ++i) {
    if (axis_names_[i] == name) return static_cast<int>(i);
  }
  return -1;
}

int64_t Mesh::axis_size(absl::string_view name) const { return shape_[axis_index(name)]; }

int64_t Mesh::axes_size(const std::vector<std::string>& axes) const {
  int64_t n = 1;
  for (const std::string& a : axes) n *= axis_size(a);
  return n;
}

std::string axes_to_string(const std::vector<std::string>& axes) {
  return absl::StrCat(
      "(", absl::StrJoin(axes, ", ", [](std::string* o, const std::string& a) { absl::StrAppend(o, "'", a, "'"); }),
      axes.size() == 1 ? ",)" : ")");
}

std::vector<int64_t> Mesh::coords(int64_t position) const {
  std::vector<int64_t> c(shape_.size());
  for (int i = rank() - 1; i >= 0; --i) {
    c[i] = position % shape_[i];
    position /= shape_[i];
  }
  return c;
}

int Mesh::device_at(const std::vector<int64_t>& coords) const {
  int64_t position = 0;
  for (int i = 0; i < rank(); ++i) position = position * shape_[i] + coords[i];
  return device_ids_[position];
}

std::string Mesh::to_string() const {
  std::vector<std::string> parts;
  for (int i = 0; i < rank(); ++i) parts.push_back(absl::StrCat("'", axis_names_[i], "': ", shape_[i]));
  return absl::StrCat("Mesh(", absl::StrJoin(parts, ", "), ")");
}

absl::StatusOr<Mesh> make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                               std::vector<int> devices) {
  return Mesh::create(std::move(shape), std::move(axis_names), std::move(devices));
}

}  // namespace tessera

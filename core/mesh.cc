#include "core/mesh.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {

const char* axis_type_name(AxisType type) {
  switch (type) {
    case AxisType::kAuto:
      return "Auto";
    case AxisType::kExplicit:
      return "Explicit";
    case AxisType::kManual:
      return "Manual";
  }
  return "?";
}

absl::StatusOr<Mesh> Mesh::create(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                  std::vector<int> device_ids, std::vector<AxisType> axis_types) {
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
  if (axis_types.empty()) axis_types.assign(axis_names.size(), AxisType::kAuto);
  if (axis_types.size() != axis_names.size()) {
    return absl::InvalidArgumentError(absl::StrCat("mesh: ", axis_names.size(), " axis names but ", axis_types.size(),
                                                   " axis types were given; give one per axis (or none: all Auto)"));
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
  mesh.axis_types_ = std::move(axis_types);
  return mesh;
}

bool Mesh::has_axis_type(AxisType type) const {
  return std::find(axis_types_.begin(), axis_types_.end(), type) != axis_types_.end();
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

namespace {

// The text inside "Mesh(...)": "'data': 4, 'model': 2, axis_types=(Auto, Auto)" (a Python
// tuple: one entry keeps its trailing comma).
std::string mesh_fields(const std::vector<int64_t>& sizes, const std::vector<std::string>& names,
                        const std::vector<AxisType>& axis_types) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < names.size(); ++i) parts.push_back(absl::StrCat("'", names[i], "': ", sizes[i]));
  std::vector<std::string> types;
  for (AxisType t : axis_types) types.push_back(axis_type_name(t));
  return absl::StrCat(absl::StrJoin(parts, ", "), parts.empty() ? "" : ", ", "axis_types=(", absl::StrJoin(types, ", "),
                      types.size() == 1 ? ",)" : ")");
}

std::string mesh_fields(const Mesh& m) { return mesh_fields(m.shape(), m.axis_names(), m.axis_types()); }

}  // namespace

std::string Mesh::to_string() const { return absl::StrCat("Mesh(", mesh_fields(*this), ")"); }

AbstractMesh::AbstractMesh(std::vector<int64_t> axis_sizes, std::vector<std::string> axis_names,
                           std::vector<AxisType> axis_types)
    : axis_sizes_(std::move(axis_sizes)), axis_names_(std::move(axis_names)), axis_types_(std::move(axis_types)) {}

int64_t AbstractMesh::size() const {
  if (empty()) return 0;
  int64_t n = 1;
  for (int64_t s : axis_sizes_) n *= s;
  return n;
}

std::vector<std::string> AbstractMesh::axes_of_type(AxisType type) const {
  std::vector<std::string> axes;
  for (size_t i = 0; i < axis_names_.size(); ++i) {
    if (axis_types_[i] == type) axes.push_back(axis_names_[i]);
  }
  return axes;
}

AbstractMesh AbstractMesh::update_axis_types(const std::vector<std::string>& axes, AxisType type) const {
  AbstractMesh updated = *this;
  for (size_t i = 0; i < axis_names_.size(); ++i) {
    if (std::find(axes.begin(), axes.end(), axis_names_[i]) != axes.end()) updated.axis_types_[i] = type;
  }
  return updated;
}

// JAX's AbstractMesh.__repr__ (jax/_src/mesh.py): "()" for the axes of an empty mesh.
std::string AbstractMesh::to_string() const {
  return absl::StrCat("AbstractMesh(", empty() ? "(), " : "", mesh_fields(axis_sizes_, axis_names_, axis_types_), ")");
}

std::string Mesh::to_string_with_devices() const {
  return absl::StrCat("Mesh(", mesh_fields(*this), ", device_ids=[", absl::StrJoin(device_ids_, ", "), "])");
}

std::pair<std::string, std::string> distinguish(const Mesh& a, const Mesh& b) {
  if (a != b && a.to_string() == b.to_string()) return {a.to_string_with_devices(), b.to_string_with_devices()};
  return {a.to_string(), b.to_string()};
}

absl::StatusOr<Mesh> make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                               std::vector<int> devices, std::vector<AxisType> axis_types) {
  // As jax.make_mesh since JAX 0.9 (jax/_src/sharding_impls.py: `axis_types = (AxisType.Explicit,) *
  // len(mesh_devices.shape)` when none are given); Mesh::create keeps jax.sharding.Mesh's Auto.
  if (axis_types.empty()) axis_types.assign(axis_names.size(), AxisType::kExplicit);
  return Mesh::create(std::move(shape), std::move(axis_names), std::move(devices), std::move(axis_types));
}

}  // namespace tessera

// Mesh: devices arranged as an n-dimensional grid with named axes, each of a type, as
// jax.sharding.Mesh.
//
// Device ids are stored row-major over the grid: on a (4, 2) mesh ("data", "model") built by
// make_mesh from devices 0..7, the device at coordinates (i, j) is 2 * i + j, as JAX orders
// CPU devices. Each axis has an AxisType, as jax.sharding.AxisType: Auto (the compiler
// propagates shardings over it, GSPMD-style: what Tessera's jit does), Explicit (shardings are
// part of the values' types) or Manual (per-device code, what shard_map makes).
//
//   absl::StatusOr<Mesh> mesh = make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
//   mesh->axis_size("data") == 4; mesh->device_at({3, 1}) == 7;
//   mesh->to_string() == "Mesh('data': 4, 'model': 2, axis_types=(Auto, Auto))"
#ifndef TESSERA_CORE_MESH_H_
#define TESSERA_CORE_MESH_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace tessera {

// jax.sharding.AxisType.
enum class AxisType { kAuto, kExplicit, kManual };

// "Auto", "Explicit", "Manual": as JAX prints an AxisType.
const char* axis_type_name(AxisType type);

// jax.sharding.AbstractMesh: a mesh's axis sizes, names and types, without its devices. What
// get_abstract_mesh() reports (tessera/mesh_context.h: the axis types in force where it is
// called, Manual inside a shard_map body, Auto inside auto_axes) and what a traced value's type
// is over. Default-constructed it is empty (no axes), as JAX's empty_abstract_mesh. Compared
// by sizes, names and types.
//
//   AbstractMesh m({2, 2}, {"x", "y"}, {AxisType::kExplicit, AxisType::kManual});
//   m.to_string() == "AbstractMesh('x': 2, 'y': 2, axis_types=(Explicit, Manual))"
//   m.axes_of_type(AxisType::kManual) == {"y"}
//   AbstractMesh().to_string() == "AbstractMesh((), axis_types=())"
class AbstractMesh {
 public:
  AbstractMesh() = default;
  // REQUIRES: the three have the same length.
  AbstractMesh(std::vector<int64_t> axis_sizes, std::vector<std::string> axis_names, std::vector<AxisType> axis_types);

  const std::vector<int64_t>& axis_sizes() const { return axis_sizes_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  const std::vector<AxisType>& axis_types() const { return axis_types_; }
  bool empty() const { return axis_names_.empty(); }
  // The number of devices; 0 when empty, as JAX's.
  int64_t size() const;
  // The axes of each type, in mesh order (JAX's auto_axes, explicit_axes, manual_axes).
  std::vector<std::string> axes_of_type(AxisType type) const;
  // This mesh with the named axes of type `type` (names not in the mesh are ignored), as
  // JAX's AbstractMesh.update_axis_types.
  AbstractMesh update_axis_types(const std::vector<std::string>& axes, AxisType type) const;
  // As JAX's repr: "AbstractMesh('x': 2, axis_types=(Explicit,))"; Tessera's abstract meshes
  // have no AbstractDevice, so none is printed.
  std::string to_string() const;

  bool operator==(const AbstractMesh& other) const {
    return axis_sizes_ == other.axis_sizes_ && axis_names_ == other.axis_names_ && axis_types_ == other.axis_types_;
  }
  bool operator!=(const AbstractMesh& other) const { return !(*this == other); }

 private:
  std::vector<int64_t> axis_sizes_;
  std::vector<std::string> axis_names_;
  std::vector<AxisType> axis_types_;
};

// A value type, compared by shape, axis names, axis types and device order.
class Mesh {
 public:
  // The mesh of `device_ids` laid row-major over `shape`, its axes of `axis_types` (empty: all
  // Auto, as jax.sharding.Mesh's default). INVALID_ARGUMENT when: shape and axis_names differ
  // in length; axis_types is neither empty nor one per axis; an axis size is < 1; an axis name
  // is empty or repeated; the mesh has more than 2^24 devices; device_ids has not exactly
  // prod(shape) entries, or repeats an id, or holds a negative id. Whether the devices exist
  // is not checked.
  static absl::StatusOr<Mesh> create(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                     std::vector<int> device_ids, std::vector<AxisType> axis_types = {});

  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& axis_names() const { return axis_names_; }
  const std::vector<int>& device_ids() const { return device_ids_; }
  // One per axis.
  const std::vector<AxisType>& axis_types() const { return axis_types_; }
  // Whether some axis is of `type`.
  bool has_axis_type(AxisType type) const;
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t size() const { return static_cast<int64_t>(device_ids_.size()); }

  // Position of `name` among the axes, or -1.
  int axis_index(absl::string_view name) const;
  // REQUIRES: axis_index(name) >= 0.
  int64_t axis_size(absl::string_view name) const;
  // The product of the sizes of `axes` (1 for none). REQUIRES: each is an axis of the mesh.
  int64_t axes_size(const std::vector<std::string>& axes) const;

  // Grid coordinates of the device at row-major position `position`, and the device id at
  // `coords`. REQUIRES: 0 <= position < size(); one in-range coordinate per axis.
  std::vector<int64_t> coords(int64_t position) const;
  int device_at(const std::vector<int64_t>& coords) const;

  // "Mesh('data': 4, 'model': 2, axis_types=(Auto, Auto))", as JAX prints a mesh (str(mesh));
  // its devices are not shown (see distinguish()).
  std::string to_string() const;
  // to_string() and the devices: "Mesh('x': 4, axis_types=(Auto,), device_ids=[4, 5, 6, 7])".
  std::string to_string_with_devices() const;
  // The mesh without its devices (jax.sharding.Mesh.abstract_mesh).
  AbstractMesh abstract_mesh() const { return AbstractMesh(shape_, axis_names_, axis_types_); }

  bool operator==(const Mesh& other) const {
    return shape_ == other.shape_ && axis_names_ == other.axis_names_ && axis_types_ == other.axis_types_ &&
           device_ids_ == other.device_ids_;
  }
  bool operator!=(const Mesh& other) const { return !(*this == other); }

 private:
  Mesh() = default;

  std::vector<int64_t> shape_;
  std::vector<std::string> axis_names_;
  std::vector<int> device_ids_;
  std::vector<AxisType> axis_types_;
};

// How a message names two meshes: their to_string(), or, when two different meshes would
// print alike (the same shape, names and types on other devices), to_string_with_devices().
std::pair<std::string, std::string> distinguish(const Mesh& a, const Mesh& b);

// "('data',)", "('data', 'model')": mesh axes as a Python tuple prints.
std::string axes_to_string(const std::vector<std::string>& axes);

// jax.make_mesh: the devices, taken in the given order, laid row-major over `shape`, every axis
// Explicit unless `axis_types` says otherwise (as JAX >= 0.9's make_mesh; Mesh::create
// defaults to Auto, as jax.sharding.Mesh); Mesh::create's errors (INVALID_ARGUMENT when
// prod(shape) differs from the number of devices, ...).
absl::StatusOr<Mesh> make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                               std::vector<int> devices, std::vector<AxisType> axis_types = {});

}  // namespace tessera

#endif  // TESSERA_CORE_MESH_H_

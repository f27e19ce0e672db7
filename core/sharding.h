// NamedSharding: how a global array is split over a mesh, as jax.sharding.NamedSharding, and
// all the index math that follows from it.
//
// Dimension d of the array is split into prod(sizes of spec.axes(d)) equal blocks; the device
// at mesh coordinates c holds block linearize(c[a] for a in spec.axes(d)), the first axis
// major. Devices that hold the same blocks are replicas, numbered 0, 1, ... in mesh order.
//
//   NamedSharding s(mesh, P("data", None));            // mesh: (4, 2) ("data", "model")
//   absl::Status ok = s.validate({16, 8});              // OK
//   s.shard_shape({16, 8}) == Shape{4, 8};
//   s.device_shards({16, 8})[3]   // device 3: rows [4, 8), all columns, replica 1
#ifndef TESSERA_CORE_SHARDING_H_
#define TESSERA_CORE_SHARDING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "core/shape.h"

namespace tessera {

// A half-open range [start, stop) of one dimension.
struct Slice {
  int64_t start = 0;
  int64_t stop = 0;
  bool operator==(const Slice& o) const { return start == o.start && stop == o.stop; }
};

// One Slice per array dimension: the block of the global array a device holds.
using Index = std::vector<Slice>;

// "[0:4, 0:8]", numpy notation.
std::string index_to_string(const Index& index);

// The block of the global array one device holds.
struct DeviceShard {
  int device_id = 0;
  int64_t mesh_position = 0;  // row-major position of the device in the mesh
  Index index;
  int64_t replica_id = 0;
};

// A value type. Constructing one checks nothing: validate_spec() and validate(shape) do.
class NamedSharding {
 public:
  NamedSharding(Mesh mesh, PartitionSpec spec) : mesh_(std::move(mesh)), spec_(std::move(spec)) {}

  const Mesh& mesh() const { return mesh_; }
  const PartitionSpec& spec() const { return spec_; }

  // INVALID_ARGUMENT naming the problem when the spec uses an axis not in the mesh, or one
  // axis twice.
  absl::Status validate_spec() const;

  // validate_spec(), and INVALID_ARGUMENT when the spec has more entries than `shape` has
  // dimensions, or a dimension is not divisible by the product of its mesh axes' sizes.
  absl::Status validate(const Shape& shape) const;

  // The shape of every shard. REQUIRES: validate(shape) is OK.
  Shape shard_shape(const Shape& shape) const;

  // Every device of the mesh, in mesh order, with its block and replica id.
  // REQUIRES: validate(shape) is OK.
  std::vector<DeviceShard> device_shards(const Shape& shape) const;

  // True when every device holds the whole array. REQUIRES: validate_spec() is OK.
  bool is_fully_replicated() const;

  // Number of devices holding each block. REQUIRES: validate_spec() is OK.
  int64_t num_replicas() const;

  // "NamedSharding(mesh=Mesh('data': 4, 'model': 2), spec=P('data', None))".
  std::string to_string() const;

  // How many blocks dimension `dim` is split into (1 past the spec's entries).
  // REQUIRES: validate_spec() is OK.
  int64_t num_blocks(int dim) const;

  // jax.sharding.NamedSharding.is_equivalent_to: whether both place the same blocks of an
  // array of rank `ndim` on the same devices (mesh order and replicas included), whatever
  // their meshes' shapes and specs say: P('x') and P('x', None) on one mesh are equivalent
  // for a matrix. False when either does not fit rank `ndim` (validate_spec, or a spec
  // longer than the rank).
  bool is_equivalent_to(const NamedSharding& other, int ndim) const;

  // The same mesh (devices in the same order, the same axis types) and the same spec as
  // written, as JAX compares NamedShardings; see is_equivalent_to.
  bool operator==(const NamedSharding& o) const { return mesh_ == o.mesh_ && spec_ == o.spec_; }
  bool operator!=(const NamedSharding& o) const { return !(*this == o); }

 private:
  // Which block of dimension `dim` the device at mesh coordinates `coords` holds.
  int64_t block_index(const std::vector<int64_t>& coords, int dim) const;

  Mesh mesh_;
  PartitionSpec spec_;
};

}  // namespace tessera

#endif  // TESSERA_CORE_SHARDING_H_

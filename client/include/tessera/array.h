// Array: a global array whose shards live on the cluster's devices, as jax.Array.
//
//   absl::StatusOr<Array> x = client.device_put(host, sharding);
//   x->shape(); x->sharding().spec();                 // (16, 8), P('data', None)
//   for (const Shard& s : x->addressable_shards()) s.data();   // each device's block
//   absl::StatusOr<HostArray> whole = x->fetch();
//
// Arrays are cheap, copyable handles; the devices' buffers are released when the last handle
// goes away.
#ifndef TESSERA_ARRAY_H_
#define TESSERA_ARRAY_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/host_array.h"
#include "core/sharding.h"

namespace tessera {

class Array;
namespace internal {
struct ArrayState;
const ArrayState& array_state(const Array& array);
Array make_array(std::shared_ptr<ArrayState> state);
}  // namespace internal

// One device's block of an Array, as jax.Shard.
class Shard {
 public:
  int device_id() const { return shard_.device_id; }
  const Index& index() const { return shard_.index; }
  int64_t replica_id() const { return shard_.replica_id; }
  Shape shape() const;

  // Downloads this device's copy of the block. UNAVAILABLE or DEADLINE_EXCEEDED naming the
  // device if it cannot be read.
  absl::StatusOr<HostArray> data() const;

 private:
  friend class Array;
  Shard(std::shared_ptr<internal::ArrayState> array, DeviceShard shard)
      : array_(std::move(array)), shard_(std::move(shard)) {}
  std::shared_ptr<internal::ArrayState> array_;
  DeviceShard shard_;
};

class Array {
 public:
  uint64_t id() const;
  const Shape& shape() const;
  DType dtype() const;
  const NamedSharding& sharding() const;
  int64_t size() const { return num_elements(shape()); }

  // One Shard per device of the sharding's mesh, in mesh order (metadata only; data() fetches).
  std::vector<Shard> addressable_shards() const;

  // Assembles the whole array on the host, reading each block once, from an alive replica.
  // UNAVAILABLE naming the device when a block is only on lost or unreachable devices.
  absl::StatusOr<HostArray> fetch() const;

 private:
  friend class Client;
  friend const internal::ArrayState& internal::array_state(const Array& array);
  friend Array internal::make_array(std::shared_ptr<internal::ArrayState> state);
  explicit Array(std::shared_ptr<internal::ArrayState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::ArrayState> state_;
};

}  // namespace tessera

#endif  // TESSERA_ARRAY_H_

// Array: a global array whose shards live on the cluster's devices, as jax.Array.
//
//   absl::StatusOr<Array> x = client.device_put(host, sharding);
//   x->shape(); x->sharding().spec();                 // (16, 8), P('data', None)
//   for (const Shard& s : x->addressable_shards()) s.data();   // each device's block
//   absl::StatusOr<HostArray> whole = x->fetch();
//
// Arrays are cheap, copyable handles; the devices' buffers are released when the last handle
// goes away (for the output of a call still running: once the call finishes).
//
// A jitted call returns its outputs before it has run (asynchronous dispatch, as in JAX):
// their metadata is there at once, their data once the call finishes. Everything that reads
// data waits for that — block_until_ready(), fetch(), Shard::data(), passing the array to
// another call — and reports the call's error if it failed.
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

  // Downloads this device's copy of the block, once the array is ready (see
  // Array::block_until_ready, whose errors it returns). UNAVAILABLE or DEADLINE_EXCEEDED
  // naming the device if it cannot be read.
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
  // The coordinator's id of the array. For the output of a call still running this waits for
  // the call (as block_until_ready) and is 0 if the call failed.
  uint64_t id() const;
  const Shape& shape() const;
  DType dtype() const;
  const NamedSharding& sharding() const;
  int64_t size() const { return num_elements(shape()); }

  // One Shard per device of the sharding's mesh, in mesh order (metadata only; data() fetches).
  std::vector<Shard> addressable_shards() const;

  // Assembles the whole array on the host, reading each block once, from an alive replica,
  // once the array is ready (see block_until_ready, whose errors it returns). UNAVAILABLE
  // naming the device when a block is only on lost or unreachable devices.
  absl::StatusOr<HostArray> fetch() const;

  // Whether the array's data exists, or the call computing it has failed. Never blocks.
  bool is_ready() const;

  // Waits until the call that computes this array has finished, as
  // jax.Array.block_until_ready. OK at once for an array that device_put placed. Otherwise the
  // call's error: UNAVAILABLE or DEADLINE_EXCEEDED naming the device for a lost or
  // unreachable worker, the device and the instruction for a kernel error (RESOURCE_EXHAUSTED
  // when its output does not fit), the original error for a call whose argument was the output
  // of a failed call, and DEADLINE_EXCEEDED when the call has not finished by its deadline
  // (its JitOptions::timeout plus 10 s, after the calls computing its arguments).
  absl::Status block_until_ready() const;

 private:
  friend class Client;
  friend const internal::ArrayState& internal::array_state(const Array& array);
  friend Array internal::make_array(std::shared_ptr<internal::ArrayState> state);
  explicit Array(std::shared_ptr<internal::ArrayState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::ArrayState> state_;
};

// Waits for every array (Array::block_until_ready); the first error by position, if any.
absl::Status block_until_ready(const std::vector<Array>& arrays);

}  // namespace tessera

#endif  // TESSERA_ARRAY_H_

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
#include "absl/time/time.h"
#include "core/dtype.h"
#include "core/host_array.h"
#include "core/sharding.h"

namespace tessera {

class Array;
// Implementation details of the SDK, not for applications.
namespace internal {
struct ArrayState;
const ArrayState& array_state(const Array& array);
Array make_array(std::shared_ptr<ArrayState> state);
}  // namespace internal

// One device's block of an Array, as jax.Shard. Holds the array: its buffers live as long
// as the Shard does.
class Shard {
 public:
  // The device holding the block, the block's slice of the global array, which replica of
  // the block it is (0, 1, ... in mesh order), and the block's shape. Metadata only: these
  // never block and never fail.
  int device_id() const { return shard_.device_id; }
  const Index& index() const { return shard_.index; }
  int64_t replica_id() const { return shard_.replica_id; }
  Shape shape() const;

  // Downloads this device's copy of the block (a new HostArray the caller owns), once the
  // array is ready: first the errors of Array::block_until_ready. Then FAILED_PRECONDITION
  // when the device's worker restarted since (the block is gone: put the array again);
  // UNAVAILABLE naming the device when it is lost, UNAVAILABLE or DEADLINE_EXCEEDED when its
  // worker does not answer; DATA_LOSS when the worker sends a block of the wrong type or size.
  absl::StatusOr<HostArray> data() const;

 private:
  friend class Array;
  Shard(std::shared_ptr<internal::ArrayState> array, DeviceShard shard)
      : array_(std::move(array)), shard_(std::move(shard)) {}
  std::shared_ptr<internal::ArrayState> array_;
  DeviceShard shard_;
};

// A handle to a global array on the cluster. Made by Client::device_put, jitted calls and
// run_collective; there is no public constructor.
class Array {
 public:
  // The coordinator's id of the array. Surprising: for the output of a call still running
  // this blocks until the call finishes (as block_until_ready), and it is 0 when the call
  // failed or the array was donated.
  uint64_t id() const;
  // The global shape, dtype and sharding; known at once, even for a call still running.
  const Shape& shape() const;
  DType dtype() const;
  const NamedSharding& sharding() const;
  int64_t size() const { return num_elements(shape()); }
  // JAX's "committed": true for an array placed with a sharding (device_put) and for the
  // outputs of a call with a committed argument, a mesh it moved its arguments to, or
  // in/out_shardings. False for Client::array's (jnp.array: no sharding asked for, on the
  // default device) and for the outputs of a call on such arrays only that stayed there. A
  // jitted call moves an uncommitted argument where the call runs (jit.h); a committed one never.
  bool committed() const;

  // One Shard per device of the sharding's mesh, in mesh order (metadata only, never blocks;
  // Shard::data() downloads).
  std::vector<Shard> addressable_shards() const;

  // Assembles the whole array on the host (a new HostArray the caller owns), reading each
  // distinct block once, from an alive replica, once the array is ready: first the errors of
  // block_until_ready. Then, when a block is only on devices that are not alive,
  // FAILED_PRECONDITION if all their workers restarted since (the block is gone: put the
  // array again) and UNAVAILABLE naming them otherwise; UNAVAILABLE or DEADLINE_EXCEEDED
  // naming the device whose worker does not answer; DATA_LOSS for a malformed transfer.
  absl::StatusOr<HostArray> fetch() const;

  // fetch() into memory the caller owns (no HostArray in between): each block is written
  // straight into `out` when contiguous there (whole rows), else staged. The errors of fetch(),
  // and INVALID_ARGUMENT, before anything is read, when `out` is an invalid view or its dtype
  // or shape differ from the array's. On error, `out` may be partly written.
  absl::Status fetch_into(const MutableHostView& out) const;

  // Whether the array's data exists, or the call computing it has finished (possibly
  // failed). Never blocks.
  bool is_ready() const;

  // Waits until the call that computes this array has finished, as
  // jax.Array.block_until_ready. OK at once for an array that device_put or run_collective
  // placed. FAILED_PRECONDITION for an array donated to a jitted call (donate_argnums).
  // Otherwise the call's error: UNAVAILABLE or DEADLINE_EXCEEDED naming the device for a lost
  // or unreachable worker, FAILED_PRECONDITION when an argument lost its shard to a worker
  // restart, the device and the instruction for a kernel error (RESOURCE_EXHAUSTED when its
  // output does not fit), the root cause's code and message for a call whose argument was the
  // output of a failed call, and DEADLINE_EXCEEDED when the call has not finished by its
  // deadline (JitOptions::timeout plus about 11 s, counted from the dispatch or from the
  // latest deadline of the calls computing its arguments, whichever is later).
  absl::Status block_until_ready() const;

  // Waits at most `max_wait` for is_ready(); true when block_until_ready() would now return
  // at once (the data exists, the call finished, or its deadline passed). For callers that
  // must stay responsive while they wait, e.g. to a KeyboardInterrupt in Python.
  bool await_ready(absl::Duration max_wait) const;

 private:
  friend class Client;
  friend const internal::ArrayState& internal::array_state(const Array& array);
  friend Array internal::make_array(std::shared_ptr<internal::ArrayState> state);
  explicit Array(std::shared_ptr<internal::ArrayState> state) : state_(std::move(state)) {}
  std::shared_ptr<internal::ArrayState> state_;
};

// jax.device_get of several arrays: fetches them all at once (every block of every array in
// parallel) and returns them in order. The first error by position, as Array::fetch gives
// it, prefixed with "device_get: array i: ".
absl::StatusOr<std::vector<HostArray>> device_get(const std::vector<Array>& arrays);

// Waits for every array (Array::block_until_ready), even after an error; returns the first
// error by position, or OK.
absl::Status block_until_ready(const std::vector<Array>& arrays);

}  // namespace tessera

#endif  // TESSERA_ARRAY_H_

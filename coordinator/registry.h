// Registry: the coordinator's state — the devices of the cluster and the arrays placed on
// them. Thread-safe; no networking.
//
//   Registry registry(absl::Seconds(3));
//   absl::StatusOr<DeviceRecord> d = registry.register_worker("w0", "127.0.0.1:4000", -1, 1 << 30, now);
//   registry.heartbeat(d->id, d->incarnation, now);
//   registry.mark_lost(now + absl::Seconds(5));     // -> {d->id}
#ifndef TESSERA_COORDINATOR_REGISTRY_H_
#define TESSERA_COORDINATOR_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/dtype.h"
#include "core/sharding.h"

namespace tessera {

struct DeviceRecord {
  int id = 0;
  std::string name;
  std::string address;
  bool alive = false;
  int64_t memory_bytes = 0;
  uint64_t incarnation = 0;
  absl::Time last_heartbeat;
  absl::Time registered_at;  // of the current incarnation
};

// "device 3 (127.0.0.1:4711)": how errors name a device.
std::string describe_device(int id, const std::string& address);

struct ArrayRecord {
  uint64_t id = 0;
  DType dtype = DType::kF32;
  Shape shape;
  NamedSharding sharding;
  // Devices whose worker restarted after the array was placed: their shards are gone.
  std::set<int> lost_devices;
};

class Registry {
 public:
  explicit Registry(absl::Duration heartbeat_timeout) : heartbeat_timeout_(heartbeat_timeout) {}

  // Adds or revives a worker. A known `name` keeps its device id (incarnation + 1).
  // `previous_incarnation` is the one the worker process held before (0: a new process); when
  // it is not the device's current one the process is new, and every array with a shard on
  // the device records the device as lost. ALREADY_EXISTS if `requested_id` >= 0 belongs to
  // a worker of another name.
  absl::StatusOr<DeviceRecord> register_worker(const std::string& name, const std::string& address, int requested_id,
                                               int64_t memory_bytes, uint64_t previous_incarnation, absl::Time now);

  // NOT_FOUND for an unknown device; FAILED_PRECONDITION for a stale incarnation or a device
  // marked lost: either way the worker must register again.
  absl::Status heartbeat(int id, uint64_t incarnation, absl::Time now);

  // Marks alive devices whose last heartbeat is older than the timeout as lost; returns them.
  std::vector<int> mark_lost(absl::Time now);

  std::vector<DeviceRecord> devices() const;
  std::optional<DeviceRecord> device(int id) const;

  // Waits until at least `n` devices are alive; false on timeout.
  bool wait_for_alive(int n, absl::Duration timeout) const;

  // Records a new array. INVALID_ARGUMENT if the sharding does not fit the shape;
  // NOT_FOUND if the mesh names a device that never registered.
  absl::StatusOr<uint64_t> create_array(DType dtype, const Shape& shape, const NamedSharding& sharding);

  // NOT_FOUND if unknown (never created, or deleted).
  absl::StatusOr<ArrayRecord> get_array(uint64_t id) const;

  // Forgets the arrays; returns the records of those that existed.
  std::vector<ArrayRecord> remove_arrays(const std::vector<uint64_t>& ids);

  int64_t array_count() const;
  std::vector<ArrayRecord> arrays() const;

 private:
  int alive_count() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const absl::Duration heartbeat_timeout_;

  mutable absl::Mutex mu_;
  std::map<int, DeviceRecord> devices_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, ArrayRecord> arrays_ ABSL_GUARDED_BY(mu_);
  // Starts at the coordinator's start time in microseconds: a restarted coordinator never
  // hands out an id that workers may still hold a buffer (or a collective op) under.
  uint64_t next_array_id_ ABSL_GUARDED_BY(mu_) = static_cast<uint64_t>(absl::ToUnixMicros(absl::Now()));
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_REGISTRY_H_

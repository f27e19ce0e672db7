// Registry: the coordinator's state — the devices of the cluster, the arrays placed on them,
// the ids it hands out (coordinator/ids.h), the client sessions that own arrays (each with a
// lease), and the buffers that workers still hold from an earlier incarnation of the
// coordinator (orphans, until adopted again or reclaimed after a lease). Thread-safe; no
// networking.
//
//   Registry registry(absl::Seconds(3));
//   absl::StatusOr<DeviceRecord> d = registry.register_worker({"w0", "127.0.0.1:4000", -1, 1 << 30}, now);
//   registry.heartbeat(d->id, registry.epoch(), d->incarnation, now);
//   registry.mark_lost(now + absl::Seconds(5));     // -> {d->id}
#ifndef TESSERA_COORDINATOR_REGISTRY_H_
#define TESSERA_COORDINATOR_REGISTRY_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/ids.h"
#include "core/collective.h"
#include "core/dtype.h"
#include "core/sharding.h"

namespace tessera {

struct DeviceRecord {
  int id = 0;
  std::string name;
  std::string address;
  bool alive = false;
  int64_t memory_bytes = 0;
  uint64_t incarnation = 0;  // registrations of the device with this coordinator process
  uint64_t times_lost = 0;   // how often it was marked lost (missed heartbeats)
  bool draining = false;     // its worker said it drains: no new work (until it registers again)
  // Its worker drained and deregistered (not alive, and not lost: it said it goes), until it
  // registers again.
  bool left = false;
  uint64_t times_left = 0;  // how often it deregistered
  absl::Time last_heartbeat;
  absl::Time registered_at;  // of the current incarnation
};

// The alive devices and the incarnation of each, as of one version of the view (Registry::cluster_view).
struct ClusterView {
  uint64_t version = 0;
  std::vector<std::pair<int, uint64_t>> alive;  // (device id, incarnation), by id
};

// "device 3 (127.0.0.1:4711)": how errors name a device.
std::string describe_device(int id, const std::string& address);

// A buffer a worker reported holding when it registered.
struct HeldShard {
  DType dtype = DType::kF32;
  Shape shape;
};

// What a worker says when it registers.
struct WorkerRegistration {
  std::string name;  // stable: a restart with the same name keeps the device id
  std::string address;
  int requested_id = -1;  // -1: any free id
  int64_t memory_bytes = 0;
  // The registration this process held before (coordinator epoch and incarnation; 0 and 0 for
  // a process that has just started), and the buffers it holds.
  uint64_t previous_epoch = 0;
  uint64_t previous_incarnation = 0;
  std::map<uint64_t, HeldShard> held;
};

struct ArrayRecord {
  uint64_t id = 0;
  DType dtype = DType::kF32;
  Shape shape;
  NamedSharding sharding;
  // Devices whose worker restarted after the array was placed: their shards are gone.
  std::set<int> lost_devices;
  uint64_t session = 0;  // the owner; 0: none (the array lives until deleted)
};

// The global shape of the array a collective (RunCollective) makes of the blocks of `in`.
// INVALID_ARGUMENT naming the array when its blocks are replicated, the spec's groups do not
// cover the array's devices exactly once, or the spec does not fit a block's shape.
// REQUIRES: validate_collective(spec) is OK.
absl::StatusOr<Shape> collective_result_shape(const CollectiveSpec& spec, const ArrayRecord& in);

class Registry {
 public:
  // `start`: when the coordinator started (its epoch, see coordinator/ids.h). A session's
  // arrays, and orphans nobody adopts, are reclaimed a `lease` after the last renewal (report).
  explicit Registry(absl::Duration heartbeat_timeout, absl::Time start = absl::Now(),
                    absl::Duration lease = absl::Seconds(30))
      : heartbeat_timeout_(heartbeat_timeout), lease_(lease), ids_(start) {}

  // Every id the coordinator hands out comes from here.
  IdAllocator& ids() { return ids_; }
  uint64_t epoch() const { return ids_.epoch(); }

  // Adds or revives a worker. A known `name` keeps its device id (incarnation + 1). The worker
  // is the same process as the device's current one if its previous registration (epoch and
  // incarnation) is the device's current one; otherwise it is a new process, and every array
  // with a shard on the device records the device as lost. A worker registered with an
  // earlier incarnation of the coordinator has its held buffers of that incarnation recorded
  // as orphans (see adopt_array). ALREADY_EXISTS if `requested_id` >= 0 belongs to a worker of
  // another name.
  absl::StatusOr<DeviceRecord> register_worker(const WorkerRegistration& r, absl::Time now);

  // NOT_FOUND for an unknown device or a registration with another coordinator incarnation
  // (`epoch`); FAILED_PRECONDITION for a stale incarnation or a device marked lost: either
  // way the worker must register again.
  // `draining`: the worker says it drains (DeviceRecord::draining, kept until it registers
  // again); *newly_draining (if given) says whether this heartbeat was the first to say so.
  absl::Status heartbeat(int id, uint64_t epoch, uint64_t incarnation, absl::Time now, bool draining = false,
                         bool* newly_draining = nullptr);

  // The worker of device `id` drained and exits: the device is no longer alive and is
  // recorded as left (DeviceRecord::left), not lost. The same errors as heartbeat, except that
  // a device marked lost meanwhile may still leave (its worker says where it went).
  absl::Status deregister(int id, uint64_t epoch, uint64_t incarnation);

  // Marks alive devices whose last heartbeat is older than the timeout as lost; returns them.
  std::vector<int> mark_lost(absl::Time now);

  std::vector<DeviceRecord> devices() const;
  std::optional<DeviceRecord> device(int id) const;

  // The cluster view's current version: from 1, bumped by every change of the alive devices or
  // of an incarnation (register_worker, mark_lost, deregister). When it is not `held` (the
  // version a worker holds; 0: none), *view gets it with the alive devices and their
  // incarnations (by id), read under one lock; otherwise *view gets only the version: a worker
  // up to date costs no copy of the cluster. Returns whether the devices were filled in.
  bool cluster_view(uint64_t held, ClusterView* view) const;

  // Waits until at least `n` devices are alive; false on timeout.
  // With `taking_work`, only the devices that take new work count: alive and not draining.
  bool wait_for_alive(int n, absl::Duration timeout, bool taking_work = false) const;

  // Waits until a device registers after `since`, at most until `deadline`; false if none did.
  bool wait_for_registration(absl::Time since, absl::Time deadline) const;

  // Waits until every device of `ids` is alive, at most until `deadline`; false if not.
  bool wait_for_devices(const std::vector<int>& ids, absl::Time deadline) const;

  // Records a new array owned by `session` (0: none). INVALID_ARGUMENT if the sharding does
  // not fit the shape; NOT_FOUND if the mesh names a device that never registered; the
  // session's error (see check_session).
  absl::StatusOr<uint64_t> create_array(DType dtype, const Shape& shape, const NamedSharding& sharding,
                                        uint64_t session = 0);

  // NOT_FOUND if unknown (never created, or deleted); ABORTED for an id of an earlier
  // incarnation of the coordinator (adopt_array it again, or put it again).
  absl::StatusOr<ArrayRecord> get_array(uint64_t id) const;

  // Knows again an array of an earlier incarnation whose shards every device of its mesh
  // reported holding (dtype and block shape checked); OK if it is known already with the
  // same type and sharding. INVALID_ARGUMENT if the sharding does not fit the shape;
  // NOT_FOUND for an id of this incarnation that is not known; FAILED_PRECONDITION naming the
  // array and a device that does not hold its shard, or holds another type.
  // The adopted array belongs to a.session.
  absl::Status adopt_array(const ArrayRecord& a);

  // A new client session, leased from `now`.
  uint64_t open_session(absl::Time now);
  // Extends `session`'s lease from `now`. A session of an earlier coordinator incarnation is
  // taken over (its client will adopt its arrays again). FAILED_PRECONDITION if the session
  // lapsed or was never opened: its arrays are gone. OK for session 0 (none).
  absl::Status renew_session(uint64_t session, absl::Time now);
  // FAILED_PRECONDITION unless `session` is 0, open, or of an earlier incarnation (then taken
  // over, leased from `now`).
  absl::Status check_session(uint64_t session, absl::Time now);

  // What lapsed by `now` (sessions not renewed for a lease, and orphans reported longer than a
  // lease ago and not adopted), forgotten here: the sessions, and the buffers to free by device.
  struct Lapsed {
    std::vector<uint64_t> sessions;
    std::map<int, std::vector<uint64_t>> buffers;
    int64_t arrays = 0;   // of the sessions
    int64_t orphans = 0;  // of earlier incarnations
  };
  Lapsed take_lapsed(absl::Time now);
  absl::Duration lease() const { return lease_; }

  // Forgets the arrays; returns the records of those that existed.
  std::vector<ArrayRecord> remove_arrays(const std::vector<uint64_t>& ids);
  // Forgets those of the arrays `ids` that `may_remove` accepts, deciding each id on its own
  // and under the same lock as its removal (so its owner cannot change in between); returns
  // their records, and appends the ids it refused to *refused, in order. Unknown ids are
  // skipped. `may_remove` runs under the registry's lock: it must not call the registry.
  std::vector<ArrayRecord> remove_arrays_if(const std::vector<uint64_t>& ids,
                                            absl::FunctionRef<bool(const ArrayRecord&)> may_remove,
                                            std::vector<uint64_t>* refused);

  // Forgets the orphans among `ids`; returns which devices hold them.
  std::map<int, std::vector<uint64_t>> remove_orphans(const std::vector<uint64_t>& ids);
  int64_t orphan_count() const;

  int64_t array_count() const;
  std::vector<ArrayRecord> arrays() const;

 private:
  int alive_count(bool taking_work = false) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Device `id` if `epoch` and `incarnation` are its current registration's: NOT_FOUND for an
  // unknown device or another coordinator epoch, FAILED_PRECONDITION (naming `what`) for a
  // stale incarnation.
  absl::StatusOr<DeviceRecord*> current_device(int id, uint64_t epoch, uint64_t incarnation, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status check_session_locked(uint64_t session, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after construction.
  const absl::Duration heartbeat_timeout_;
  const absl::Duration lease_;
  IdAllocator ids_;

  mutable absl::Mutex mu_;
  std::map<int, DeviceRecord> devices_ ABSL_GUARDED_BY(mu_);
  uint64_t view_version_ ABSL_GUARDED_BY(mu_) = 1;  // see cluster_view
  // devices_ by worker name (a device is never removed): a registration finds its worker's
  // device in O(1), not by a walk of every device (65,536 registrations were quadratic).
  absl::flat_hash_map<std::string, int> device_of_name_ ABSL_GUARDED_BY(mu_);
  int first_free_id_ ABSL_GUARDED_BY(mu_) = 0;  // the lowest id not in devices_ (ids are never freed)
  std::map<uint64_t, ArrayRecord> arrays_ ABSL_GUARDED_BY(mu_);
  // Buffers of earlier incarnations that workers reported, by buffer id: who holds which
  // shard, and when it was first reported.
  struct Orphan {
    std::map<int, HeldShard> shards;
    absl::Time reported;
  };
  std::map<uint64_t, Orphan> orphans_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, absl::Time> sessions_ ABSL_GUARDED_BY(mu_);  // open sessions: last renewal
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_REGISTRY_H_

#include "coordinator/registry.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "coordinator/request_limits.h"
#include "core/graph.h"
#include "core/status.h"

namespace tessera {

std::string describe_device(int id, const std::string& address) {
  return absl::StrCat("device ", id, " (", address, ")");
}

absl::StatusOr<DeviceRecord> Registry::register_worker(const WorkerRegistration& r, absl::Time now) {
  const std::string& name = r.name;
  const int requested_id = r.requested_id;
  // Whatever the worker holds, no later id may collide with it: the largest held id a
  // coordinator could have handed out (advance_past ignores ids from kMaxAdvance on, so the
  // largest of all would skip the ones below it when it is such an id).
  const auto coordinators = r.held.lower_bound(IdAllocator::kMaxAdvance);
  if (coordinators != r.held.begin()) ids_.advance_past(std::prev(coordinators)->first);
  absl::MutexLock lock(&mu_);
  DeviceRecord* record = nullptr;
  if (auto known = device_of_name_.find(name); known != device_of_name_.end()) record = &devices_.at(known->second);
  if (record == nullptr) {
    int id = requested_id;
    if (id >= 0) {
      auto it = devices_.find(id);
      if (it != devices_.end()) {
        return absl::AlreadyExistsError(
            absl::StrCat("device id ", id, " is taken by worker '", it->second.name, "' at ", it->second.address));
      }
    } else {
      id = first_free_id_;
      if (id > kMaxDeviceId) {
        return absl::ResourceExhaustedError(absl::StrCat("worker '", name, "': every device id from 0 to ",
                                                         kMaxDeviceId, " is taken (the limit of a cluster's devices)"));
      }
    }
    record = &devices_[id];
    record->id = id;
    record->name = name;
    device_of_name_.emplace(name, id);
    while (devices_.count(first_free_id_) > 0) ++first_free_id_;
  } else if (requested_id >= 0 && requested_id != record->id) {
    return absl::AlreadyExistsError(
        absl::StrCat("worker '", name, "' is device ", record->id, ", not the requested device ", requested_id));
  } else if (r.previous_epoch != epoch() || r.previous_incarnation != record->incarnation) {
    // A new process under a known name: whatever the device held is gone.
    for (auto& [array_id, a] : arrays_) {
      const std::vector<int>& ids = a.sharding.mesh().device_ids();
      if (std::find(ids.begin(), ids.end(), record->id) != ids.end()) a.lost_devices.insert(record->id);
    }
  }
  if (r.previous_epoch != epoch()) {
    // Registered with an earlier incarnation of the coordinator (or just started): what it
    // holds from earlier incarnations may be adopted again. Its report is complete.
    for (auto it = orphans_.begin(); it != orphans_.end();) {
      it->second.shards.erase(record->id);
      it = it->second.shards.empty() ? orphans_.erase(it) : std::next(it);
    }
    for (const auto& [buffer, shard] : r.held) {
      if (!ids_.before_epoch(buffer)) continue;
      auto [orphan, added] = orphans_.try_emplace(buffer);
      if (added) orphan->second.reported = now;
      orphan->second.shards[record->id] = shard;
    }
  }
  record->address = r.address;
  record->alive = true;
  record->draining = false;  // a new registration: a new process, or the same one back
  record->left = false;
  record->memory_bytes = r.memory_bytes;
  record->incarnation += 1;
  record->last_heartbeat = now;
  record->registered_at = now;
  ++view_version_;  // a new incarnation, and perhaps a device alive again
  return *record;
}

absl::StatusOr<DeviceRecord*> Registry::current_device(int id, uint64_t epoch, uint64_t incarnation,
                                                       absl::string_view what) {
  if (epoch != this->epoch()) {
    return absl::NotFoundError(absl::StrCat("device ", id, " registered with coordinator epoch ", epoch,
                                            " but this coordinator is epoch ", this->epoch(), " (it restarted)"));
  }
  auto it = devices_.find(id);
  if (it == devices_.end()) return absl::NotFoundError(absl::StrCat("device ", id, " is not registered"));
  if (it->second.incarnation != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat("device ", id, " ", what, " from incarnation ", incarnation,
                                                      " but the current one is ", it->second.incarnation));
  }
  return &it->second;
}

absl::Status Registry::heartbeat(int id, uint64_t epoch, uint64_t incarnation, absl::Time now, bool draining,
                                 bool* newly_draining) {
  absl::MutexLock lock(&mu_);
  TESSERA_ASSIGN_OR_RETURN(DeviceRecord * d, current_device(id, epoch, incarnation, "heartbeat"));
  if (d->left) {
    return absl::FailedPreconditionError(
        absl::StrCat(describe_device(id, d->address), " left (its worker deregistered); it must register again"));
  }
  if (!d->alive) {
    // Its state is unknown since (a link cut, a pause): it comes back through registration.
    return absl::FailedPreconditionError(
        absl::StrCat(describe_device(id, d->address), " was marked lost after missing heartbeats for ",
                     absl::FormatDuration(heartbeat_timeout_), "; it must register again"));
  }
  d->last_heartbeat = now;
  if (newly_draining != nullptr) *newly_draining = draining && !d->draining;
  d->draining = d->draining || draining;
  return absl::OkStatus();
}

absl::Status Registry::deregister(int id, uint64_t epoch, uint64_t incarnation) {
  absl::MutexLock lock(&mu_);
  TESSERA_ASSIGN_OR_RETURN(DeviceRecord * d, current_device(id, epoch, incarnation, "deregistration"));
  if (!d->left) ++d->times_left;
  if (d->alive) ++view_version_;
  d->alive = false;
  d->left = true;
  d->draining = false;  // done draining: gone
  return absl::OkStatus();
}

std::vector<int> Registry::mark_lost(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<int> lost;
  for (auto& [id, d] : devices_) {
    if (d.alive && now - d.last_heartbeat > heartbeat_timeout_) {
      d.alive = false;
      ++d.times_lost;
      lost.push_back(id);
    }
  }
  if (!lost.empty()) ++view_version_;
  return lost;
}

std::vector<DeviceRecord> Registry::devices() const {
  absl::MutexLock lock(&mu_);
  std::vector<DeviceRecord> out;
  for (const auto& [id, d] : devices_) out.push_back(d);
  return out;
}

bool Registry::cluster_view(uint64_t held, ClusterView* view) const {
  absl::MutexLock lock(&mu_);
  view->version = view_version_;
  view->alive.clear();
  if (held == view_version_) return false;
  for (const auto& [id, d] : devices_) {
    if (d.alive) view->alive.emplace_back(id, d.incarnation);
  }
  return true;
}

std::optional<DeviceRecord> Registry::device(int id) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(id);
  if (it == devices_.end()) return std::nullopt;
  return it->second;
}

int Registry::alive_count(bool taking_work) const {
  int n = 0;
  for (const auto& [id, d] : devices_) n += d.alive && !(taking_work && d.draining) ? 1 : 0;
  return n;
}

bool Registry::wait_for_alive(int n, absl::Duration timeout, bool taking_work) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n, taking_work]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return alive_count(taking_work) >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

bool Registry::wait_for_registration(absl::Time since, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto registered = [this, since]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& [id, d] : devices_) {
      if (d.registered_at > since) return true;
    }
    return false;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&registered), deadline);
}

bool Registry::wait_for_devices(const std::vector<int>& ids, absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  auto all_alive = [this, &ids]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int id : ids) {
      auto it = devices_.find(id);
      if (it == devices_.end() || !it->second.alive) return false;
    }
    return true;
  };
  return mu_.AwaitWithDeadline(absl::Condition(&all_alive), deadline);
}

absl::StatusOr<uint64_t> Registry::create_array(DType dtype, const Shape& shape, const NamedSharding& sharding,
                                                uint64_t session) {
  TESSERA_RETURN_IF_ERROR(sharding.validate(shape));
  absl::MutexLock lock(&mu_);
  TESSERA_RETURN_IF_ERROR(check_session_locked(session, absl::Now()));
  for (int id : sharding.mesh().device_ids()) {
    if (devices_.count(id) == 0) {
      return absl::NotFoundError(absl::StrCat("the mesh names device ", id, ", which is not in the cluster"));
    }
  }
  const uint64_t id = ids_.next();
  arrays_.emplace(id, ArrayRecord{id, dtype, shape, sharding, {}, session});
  return id;
}

absl::StatusOr<Shape> collective_result_shape(const CollectiveSpec& spec, const ArrayRecord& in) {
  const std::string name = collective_name(spec.kind);
  const NamedSharding& sharding = in.sharding;
  if (sharding.num_replicas() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": array ", in.id, " under ", sharding.spec().to_string(),
                                                   " has replicated blocks; every device must hold its own block"));
  }
  const std::vector<int>& mesh_devices = sharding.mesh().device_ids();
  size_t grouped = 0;
  for (const std::vector<int>& group : spec.groups) {
    for (int d : group) {
      if (std::find(mesh_devices.begin(), mesh_devices.end(), d) == mesh_devices.end()) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": device ", d, " is not in the mesh of array ", in.id));
      }
      ++grouped;
    }
  }
  if (grouped != mesh_devices.size()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the replica groups cover ", grouped, " of the ",
                                                   mesh_devices.size(), " devices of array ", in.id));
  }
  const Shape block = sharding.shard_shape(in.shape);
  TESSERA_ASSIGN_OR_RETURN(Shape out_block, collective_output_shape(spec, block));
  Shape out_shape = in.shape;
  for (size_t d = 0; d < out_shape.size(); ++d) out_shape[d] = sharding.num_blocks(static_cast<int>(d)) * out_block[d];
  return out_shape;
}

absl::StatusOr<ArrayRecord> Registry::get_array(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = arrays_.find(id);
  if (it != arrays_.end()) return it->second;
  if (ids_.before_epoch(id)) {
    return absl::AbortedError(absl::StrCat("array ", id,
                                           " belongs to an earlier incarnation of the coordinator, which restarted "
                                           "since; adopt it again (AdoptArrays) or put it again"));
  }
  return absl::NotFoundError(absl::StrCat("array ", id, " does not exist"));
}

absl::Status Registry::adopt_array(const ArrayRecord& a) {
  TESSERA_RETURN_IF_ERROR(a.sharding.validate(a.shape));
  const std::string what =
      absl::StrCat("array ", a.id, " (", type_to_string(a.dtype, a.shape), " as ", a.sharding.to_string(), ")");
  const Shape block = a.sharding.shard_shape(a.shape);
  absl::MutexLock lock(&mu_);
  TESSERA_RETURN_IF_ERROR(check_session_locked(a.session, absl::Now()));
  auto known = arrays_.find(a.id);
  if (known != arrays_.end()) {
    const ArrayRecord& k = known->second;
    if (k.dtype == a.dtype && k.shape == a.shape && k.sharding == a.sharding) {
      if (a.session != 0) known->second.session = a.session;  // its client took it over
      return absl::OkStatus();
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "adopt: ", what, " is known as ", type_to_string(k.dtype, k.shape), " as ", k.sharding.to_string()));
  }
  if (!ids_.before_epoch(a.id)) {
    return absl::NotFoundError(absl::StrCat("adopt: ", what, " does not exist (its id is of this coordinator)"));
  }
  auto orphan = orphans_.find(a.id);
  for (int d : a.sharding.mesh().device_ids()) {
    auto device = devices_.find(d);
    const std::string where = describe_device(d, device == devices_.end() ? "?" : device->second.address);
    if (orphan == orphans_.end() || orphan->second.shards.count(d) == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "adopt: ", what, " from before the coordinator restarted is gone: ", where,
          " does not hold its shard (the worker restarted, or has not registered again); put the array again"));
    }
    const HeldShard& held = orphan->second.shards.at(d);
    if (held.dtype != a.dtype || held.shape != block) {
      return absl::FailedPreconditionError(absl::StrCat("adopt: ", what, ": ", where, " holds ",
                                                        type_to_string(held.dtype, held.shape), " under its id, not ",
                                                        type_to_string(a.dtype, block)));
    }
  }
  arrays_.emplace(a.id, ArrayRecord{a.id, a.dtype, a.shape, a.sharding, {}, a.session});
  orphans_.erase(orphan);
  return absl::OkStatus();
}

uint64_t Registry::open_session(absl::Time now) {
  const uint64_t id = ids_.next();
  absl::MutexLock lock(&mu_);
  sessions_[id] = now;
  return id;
}

absl::Status Registry::check_session_locked(uint64_t session, absl::Time now) {
  if (session == 0 || sessions_.count(session) > 0) return absl::OkStatus();
  if (ids_.before_epoch(session)) {
    sessions_[session] = now;  // opened with an earlier incarnation: taken over
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat("session ", session, " lapsed (no renewal for ",
                                                    absl::FormatDuration(lease_),
                                                    ") or was never opened; its arrays and programs were freed"));
}

absl::Status Registry::check_session(uint64_t session, absl::Time now) {
  absl::MutexLock lock(&mu_);
  return check_session_locked(session, now);
}

absl::Status Registry::renew_session(uint64_t session, absl::Time now) {
  absl::MutexLock lock(&mu_);
  TESSERA_RETURN_IF_ERROR(check_session_locked(session, now));
  if (session != 0) sessions_[session] = now;
  return absl::OkStatus();
}

Registry::Lapsed Registry::take_lapsed(absl::Time now) {
  absl::MutexLock lock(&mu_);
  Lapsed out;
  for (auto it = sessions_.begin(); it != sessions_.end();) {
    if (now - it->second <= lease_) {
      ++it;
      continue;
    }
    out.sessions.push_back(it->first);
    it = sessions_.erase(it);
  }
  if (!out.sessions.empty()) {
    const std::set<uint64_t> lapsed(out.sessions.begin(), out.sessions.end());
    for (auto it = arrays_.begin(); it != arrays_.end();) {
      if (lapsed.count(it->second.session) == 0) {
        ++it;
        continue;
      }
      for (int d : it->second.sharding.mesh().device_ids()) out.buffers[d].push_back(it->first);
      ++out.arrays;
      it = arrays_.erase(it);
    }
  }
  for (auto it = orphans_.begin(); it != orphans_.end();) {
    if (now - it->second.reported <= lease_) {
      ++it;
      continue;
    }
    for (const auto& [device, shard] : it->second.shards) out.buffers[device].push_back(it->first);
    ++out.orphans;
    it = orphans_.erase(it);
  }
  return out;
}

std::vector<ArrayRecord> Registry::remove_arrays(const std::vector<uint64_t>& ids) {
  std::vector<uint64_t> none;
  return remove_arrays_if(
      ids, [](const ArrayRecord&) { return true; }, &none);
}

std::vector<ArrayRecord> Registry::remove_arrays_if(const std::vector<uint64_t>& ids,
                                                    absl::FunctionRef<bool(const ArrayRecord&)> may_remove,
                                                    std::vector<uint64_t>* refused) {
  absl::MutexLock lock(&mu_);
  std::vector<ArrayRecord> out;
  for (uint64_t id : ids) {
    auto it = arrays_.find(id);
    if (it == arrays_.end()) continue;
    if (!may_remove(it->second)) {
      refused->push_back(id);
      continue;
    }
    out.push_back(std::move(it->second));
    arrays_.erase(it);
  }
  return out;
}

std::map<int, std::vector<uint64_t>> Registry::remove_orphans(const std::vector<uint64_t>& ids) {
  absl::MutexLock lock(&mu_);
  std::map<int, std::vector<uint64_t>> out;
  for (uint64_t id : ids) {
    auto it = orphans_.find(id);
    if (it == orphans_.end()) continue;
    for (const auto& [device, shard] : it->second.shards) out[device].push_back(id);
    orphans_.erase(it);
  }
  return out;
}

int64_t Registry::orphan_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(orphans_.size());
}

std::vector<ArrayRecord> Registry::arrays() const {
  absl::MutexLock lock(&mu_);
  std::vector<ArrayRecord> out;
  for (const auto& [id, a] : arrays_) out.push_back(a);
  return out;
}

int64_t Registry::array_count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(arrays_.size());
}

}  // namespace tessera

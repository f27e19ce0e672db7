#include "coordinator/registry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status.h"

namespace tessera {

std::string describe_device(int id, const std::string& address) {
  return absl::StrCat("device ", id, " (", address, ")");
}

absl::StatusOr<DeviceRecord> Registry::register_worker(const std::string& name, const std::string& address,
                                                       int requested_id, int64_t memory_bytes,
                                                       uint64_t previous_incarnation, absl::Time now) {
  absl::MutexLock lock(&mu_);
  DeviceRecord* record = nullptr;
  for (auto& [id, d] : devices_) {
    if (d.name == name) record = &d;
  }
  if (record == nullptr) {
    int id = requested_id;
    if (id >= 0) {
      auto it = devices_.find(id);
      if (it != devices_.end()) {
        return absl::AlreadyExistsError(
            absl::StrCat("device id ", id, " is taken by worker '", it->second.name, "' at ", it->second.address));
      }
    } else {
      id = 0;
      while (devices_.count(id) > 0) ++id;
    }
    record = &devices_[id];
    record->id = id;
    record->name = name;
  } else if (requested_id >= 0 && requested_id != record->id) {
    return absl::AlreadyExistsError(
        absl::StrCat("worker '", name, "' is device ", record->id, ", not the requested device ", requested_id));
  } else if (previous_incarnation != record->incarnation) {
    // A new process under a known name: whatever the device held is gone.
    for (auto& [array_id, a] : arrays_) {
      const std::vector<int>& ids = a.sharding.mesh().device_ids();
      if (std::find(ids.begin(), ids.end(), record->id) != ids.end()) a.lost_devices.insert(record->id);
    }
  }
  record->address = address;
  record->alive = true;
  record->memory_bytes = memory_bytes;
  record->incarnation += 1;
  record->last_heartbeat = now;
  record->registered_at = now;
  return *record;
}

absl::Status Registry::heartbeat(int id, uint64_t incarnation, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(id);
  if (it == devices_.end()) return absl::NotFoundError(absl::StrCat("device ", id, " is not registered"));
  if (it->second.incarnation != incarnation) {
    return absl::FailedPreconditionError(absl::StrCat("device ", id, " heartbeat from incarnation ", incarnation,
                                                      " but the current one is ", it->second.incarnation));
  }
  if (!it->second.alive) {
    // Its state is unknown since (a link cut, a pause): it comes back through registration.
    return absl::FailedPreconditionError(
        absl::StrCat(describe_device(id, it->second.address), " was marked lost after missing heartbeats for ",
                     absl::FormatDuration(heartbeat_timeout_), "; it must register again"));
  }
  it->second.last_heartbeat = now;
  return absl::OkStatus();
}

std::vector<int> Registry::mark_lost(absl::Time now) {
  absl::MutexLock lock(&mu_);
  std::vector<int> lost;
  for (auto& [id, d] : devices_) {
    if (d.alive && now - d.last_heartbeat > heartbeat_timeout_) {
      d.alive = false;
      lost.push_back(id);
    }
  }
  return lost;
}

std::vector<DeviceRecord> Registry::devices() const {
  absl::MutexLock lock(&mu_);
  std::vector<DeviceRecord> out;
  for (const auto& [id, d] : devices_) out.push_back(d);
  return out;
}

std::optional<DeviceRecord> Registry::device(int id) const {
  absl::MutexLock lock(&mu_);
  auto it = devices_.find(id);
  if (it == devices_.end()) return std::nullopt;
  return it->second;
}

int Registry::alive_count() const {
  int n = 0;
  for (const auto& [id, d] : devices_) n += d.alive ? 1 : 0;
  return n;
}

bool Registry::wait_for_alive(int n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return alive_count() >= n; };
  return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
}

absl::StatusOr<uint64_t> Registry::create_array(DType dtype, const Shape& shape, const NamedSharding& sharding) {
  TESSERA_RETURN_IF_ERROR(sharding.validate(shape));
  absl::MutexLock lock(&mu_);
  for (int id : sharding.mesh().device_ids()) {
    if (devices_.count(id) == 0) {
      return absl::NotFoundError(absl::StrCat("the mesh names device ", id, ", which is not in the cluster"));
    }
  }
  const uint64_t id = next_array_id_++;
  arrays_.emplace(id, ArrayRecord{id, dtype, shape, sharding, {}});
  return id;
}

absl::StatusOr<ArrayRecord> Registry::get_array(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = arrays_.find(id);
  if (it == arrays_.end()) return absl::NotFoundError(absl::StrCat("array ", id, " does not exist"));
  return it->second;
}

std::vector<ArrayRecord> Registry::remove_arrays(const std::vector<uint64_t>& ids) {
  absl::MutexLock lock(&mu_);
  std::vector<ArrayRecord> out;
  for (uint64_t id : ids) {
    auto it = arrays_.find(id);
    if (it == arrays_.end()) continue;
    out.push_back(std::move(it->second));
    arrays_.erase(it);
  }
  return out;
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

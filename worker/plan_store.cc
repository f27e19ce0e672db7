#include "worker/plan_store.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace tessera {

LoadedPlan::LoadedPlan(DevicePlan plan_in, std::map<int, std::string> peers_in)
    : plan(std::move(plan_in)),
      peers(std::move(peers_in)),
      has_collectives(plan_has_collectives(plan)),
      peaks(plan_peaks(plan)) {}

void PlanStore::add(uint64_t id, std::shared_ptr<LoadedPlan> loaded) {
  loaded->last_run = ++ticks_;
  absl::MutexLock lock(&mu_);
  if (plans_.count(id) == 0 && static_cast<int>(plans_.size()) >= max_plans_) {
    // Full: the least recently run goes (a run in progress keeps its own reference).
    auto oldest = plans_.begin();
    for (auto it = plans_.begin(); it != plans_.end(); ++it) {
      if (it->second->last_run < oldest->second->last_run) oldest = it;
    }
    plans_.erase(oldest);
    ++evicted_;
  }
  plans_[id] = std::move(loaded);
}

int PlanStore::unload(const std::vector<uint64_t>& ids) {
  absl::MutexLock lock(&mu_);
  int unloaded = 0;
  for (uint64_t id : ids) unloaded += static_cast<int>(plans_.erase(id));
  return unloaded;
}

void PlanStore::drop_before(uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  plans_.erase(plans_.begin(), plans_.lower_bound(epoch));
}

absl::StatusOr<std::shared_ptr<const LoadedPlan>> PlanStore::find(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = plans_.find(id);
  if (it == plans_.end()) return absl::NotFoundError(absl::StrCat("plan ", id, " is not loaded"));
  it->second->last_run = ++ticks_;
  return it->second;
}

PlanStore::Stats PlanStore::stats() const {
  absl::MutexLock lock(&mu_);
  return Stats{static_cast<int64_t>(plans_.size()), evicted_};
}

}  // namespace tessera

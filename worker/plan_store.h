// PlanStore: the plans LoadPlan delivered to this worker, at most max_plans of them; a new one
// beyond that drops the least recently loaded or run (the coordinator, which unloads what it
// evicts from its own cache, loads it again).
//
// Lock: mu_ guards plans_ and the eviction count. It is held only to look up, insert or erase
// (an insert beyond the limit scans for the oldest); nothing is called under it. A run keeps
// its own reference to its plan, so unloading never waits for runs.
//
//   PlanStore plans(4096);
//   plans.add(id, std::move(loaded));
//   absl::StatusOr<std::shared_ptr<const LoadedPlan>> p = plans.find(id);   // NOT_FOUND
#ifndef TESSERA_WORKER_PLAN_STORE_H_
#define TESSERA_WORKER_PLAN_STORE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/plan.h"
#include "worker/plan_peak.h"

namespace tessera {

// A plan as LoadPlan delivered it, with what every run of it needs. Its constructor computes
// all of that from the plan, so no caller can leave any of it unset.
struct LoadedPlan {
  LoadedPlan(DevicePlan plan, std::map<int, std::string> peers);

  const DevicePlan plan;
  const std::map<int, std::string> peers;  // device id -> address, for its collectives
  const bool has_collectives;
  // plan_peaks(plan): every run's peak when the plan has no donated inputs, and its loops' and
  // switches' bodies' peaks, which the peak of a run with donated inputs adds to its own.
  const PlanPeaks peaks;
  mutable std::atomic<uint64_t> last_run{0};  // when it was last loaded or run (a tick, for LRU)
};

class PlanStore {
 public:
  explicit PlanStore(int max_plans) : max_plans_(std::max(1, max_plans)) {}

  // Holds `loaded` as plan `id` (replacing one of that id), dropping the least recently run
  // one if the store is full.
  void add(uint64_t id, std::shared_ptr<LoadedPlan> loaded);
  // Drops the plans `ids`; returns how many were held.
  int unload(const std::vector<uint64_t>& ids);
  // Forgets the plans of earlier coordinator incarnations: every id below `epoch` is theirs,
  // and nothing will run those plans again.
  void drop_before(uint64_t epoch);
  // Plan `id`, marked as just run. NOT_FOUND "plan N is not loaded" (the coordinator matches
  // those words to load it again).
  absl::StatusOr<std::shared_ptr<const LoadedPlan>> find(uint64_t id);

  struct Stats {
    int64_t loaded = 0;
    int64_t evicted = 0;
  };
  Stats stats() const;

 private:
  const int max_plans_;
  std::atomic<uint64_t> ticks_{0};

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::shared_ptr<const LoadedPlan>> plans_ ABSL_GUARDED_BY(mu_);
  int64_t evicted_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_PLAN_STORE_H_

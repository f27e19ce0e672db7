// IdAllocator: every id the coordinator hands out — arrays, executables, executions and the
// op ids of their collectives, deletions on the RunPlans streams, client sessions — from one
// counter that starts at the coordinator's epoch.
//
// The epoch is the coordinator's start time in microseconds since the Unix epoch, times 256.
// A restarted coordinator therefore starts above every id an earlier incarnation handed out
// (unless that one handed out more than 256 ids per microsecond of its life, or the clock
// went back by more than the time between the two starts; workers also report the ids they
// hold when they register, and the counter moves past them), so an id never means two
// things, and an id below the epoch belongs to an earlier incarnation. Ids stay below 2^62
// until the year 2540: bit 62 is the workers' (their barrier ops).
//
//   IdAllocator ids;
//   uint64_t array = ids.next();       // >= ids.epoch()
//   uint64_t first = ids.next(8);      // 8 consecutive ids: first .. first + 7
//   ids.before_epoch(array);           // false
// Ids are predictable; what must not be is a run's tag (core/run_tag.h).
#ifndef TESSERA_COORDINATOR_IDS_H_
#define TESSERA_COORDINATOR_IDS_H_

#include <atomic>
#include <cstdint>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace tessera {

class IdAllocator {
 public:
  IdAllocator() : IdAllocator(absl::Now()) {}
  explicit IdAllocator(absl::Time start)
      : epoch_(static_cast<uint64_t>(absl::ToUnixMicros(start)) << 8), next_(epoch_) {}

  uint64_t epoch() const { return epoch_; }

  // The first of `n` consecutive fresh ids.
  uint64_t next(uint64_t n = 1) { return next_.fetch_add(n); }

  // Whether `id` was handed out by an earlier incarnation of the coordinator.
  bool before_epoch(uint64_t id) const { return id < epoch_; }

  // Ids advance_past moves the counter past: below 2^61 (epochs until the year 2255).
  static constexpr uint64_t kMaxAdvance = uint64_t{1} << 61;

  // Every later id exceeds `id` (one a worker holds: a guard against a clock that went back).
  // An id at or above kMaxAdvance is no coordinator's (a worker reports whatever ids its
  // buffers were put under) and is ignored: past it the counter would reach bit 62, the
  // workers', or wrap to 0 and hand out ids of earlier incarnations.
  void advance_past(uint64_t id) {
    if (id >= kMaxAdvance) return;
    uint64_t current = next_.load();
    while (current <= id && !next_.compare_exchange_weak(current, id + 1)) {
    }
  }

 private:
  const uint64_t epoch_;
  std::atomic<uint64_t> next_;
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_IDS_H_

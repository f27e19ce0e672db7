#include "core/profile.h"

#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>

namespace tessera {

int64_t profile_clock_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

int32_t profile_thread_id() {
  thread_local const int32_t id = static_cast<int32_t>(syscall(SYS_gettid));
  return id;
}

uint64_t message_flow_id(int source, int destination, uint64_t op, int32_t step, int32_t chunk) {
  // FNV-1a over the fields, then the top bit cleared: JSON readers parse ids as doubles, and
  // ids are written as strings anyway (client/profile.cc), so only distinctness matters.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint32_t>(source));
  mix(static_cast<uint32_t>(destination));
  mix(op);
  mix(static_cast<uint32_t>(step));
  mix(static_cast<uint32_t>(chunk));
  return h >> 1;
}

void ProfileRecorder::start(int64_t capacity) {
  absl::MutexLock lock(&mu_);
  capacity_ = static_cast<size_t>(std::clamp<int64_t>(capacity, 1, kMaxCapacity));
  ring_.clear();
  ring_.shrink_to_fit();
  next_ = 0;
  dropped_ = 0;
  start_ns_ = profile_clock_ns();
  on_.store(true, std::memory_order_relaxed);
}

void ProfileRecorder::stop() {
  absl::MutexLock lock(&mu_);
  on_.store(false, std::memory_order_relaxed);
}

void ProfileRecorder::add(ProfileEvent event) {
  if (!on()) return;
  absl::MutexLock lock(&mu_);
  // A span begun before start() (or after a stop and a new start) belongs to no profile.
  if (!on() || event.ts_ns < start_ns_) return;
  if (ring_.size() < capacity_) {
    ring_.push_back(std::move(event));
    return;
  }
  ring_[next_] = std::move(event);
  next_ = (next_ + 1) % capacity_;
  ++dropped_;
}

ProfileRecorder::Snapshot ProfileRecorder::snapshot(int64_t first, int64_t max_events, int64_t* total) const {
  absl::MutexLock lock(&mu_);
  Snapshot s;
  s.dropped = dropped_;
  s.start_ns = start_ns_;
  const int64_t n = static_cast<int64_t>(ring_.size());
  if (total != nullptr) *total = n;
  const int64_t begin = std::clamp<int64_t>(first, 0, n);
  const int64_t end = std::min(n, begin + std::max<int64_t>(max_events, 0));
  for (int64_t i = begin; i < end; ++i) {
    // Oldest first: once the ring wrapped, the oldest is at next_.
    s.events.push_back(ring_[(next_ + static_cast<size_t>(i)) % ring_.size()]);
  }
  return s;
}

void ProfileSpan::begin(const char* category, std::string name) {
  event_.phase = ProfileEvent::kComplete;
  event_.category = category;
  event_.name = std::move(name);
  event_.tid = profile_thread_id();
  event_.ts_ns = profile_clock_ns();
}

void ProfileSpan::end() {
  if (recorder_ == nullptr) return;
  event_.dur_ns = profile_clock_ns() - event_.ts_ns;
  recorder_->add(std::move(event_));
  recorder_ = nullptr;
}

void profile_flow(ProfileRecorder& recorder, ProfileEvent::Phase phase, uint64_t flow_id, std::string name,
                  int64_t ts_ns) {
  if (!recorder.on()) return;
  ProfileEvent e;
  e.phase = phase;
  e.name = std::move(name);
  e.category = "message";
  e.ts_ns = ts_ns != 0 ? ts_ns : profile_clock_ns();
  e.tid = profile_thread_id();
  e.flow_id = flow_id;
  recorder.add(std::move(e));
}

}  // namespace tessera

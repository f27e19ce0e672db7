// ProfileRecorder: one daemon's (or client's) timeline while a profile runs (docs/design.md,
// "Timeline"): complete spans (kernels, collectives, transfers, compiles, client calls) and the
// two ends of each collective message (flow events), in a ring of bounded capacity.
//
//   ProfileRecorder recorder;                    // off: a span costs one relaxed atomic load
//   recorder.start(ProfileRecorder::kDefaultCapacity);
//   { ProfileSpan span(&recorder, "kernel", [] { return std::string("dot_general"); });
//     span.arg("shape", "f32[8,8]"); ... }      // recorded when the span ends
//   ProfileRecorder::Snapshot s = recorder.stop();   // the events, oldest first, and the dropped
//
// Times are this process's monotonic clock (profile_clock_ns): a wall clock stepped by NTP
// during a profile would tear it. Processes' clocks differ (other hosts, other boots, time
// namespaces); the profiler estimates each one's offset when it merges them (client/profile.cc).
// No proto or gRPC header here.
#ifndef TESSERA_CORE_PROFILE_H_
#define TESSERA_CORE_PROFILE_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace tessera {

struct ProfileEvent {
  enum Phase : char { kComplete = 'X', kFlowStart = 's', kFlowEnd = 'f' };
  Phase phase = kComplete;
  std::string name;
  std::string category;  // "kernel", "collective", "transfer", "plan", "compile", "dispatch", "client", "message"
  int64_t ts_ns = 0;     // start (a flow event: when the message was sent / taken)
  int64_t dur_ns = 0;    // kComplete only
  int32_t tid = 0;       // the recording thread (gettid)
  uint64_t flow_id = 0;  // kFlowStart / kFlowEnd: the same id at both ends of a message
  std::vector<std::pair<std::string, std::string>> args;
};

// The profile's clock: CLOCK_MONOTONIC in nanoseconds. Only differences, and offsets between
// processes estimated by the profiler, mean anything.
int64_t profile_clock_ns();

// The kernel's id of the calling thread (cached per thread).
int32_t profile_thread_id();

// The id of the flow of one collective message: both ends compute it from what the message
// carries (op, step, chunk) and who sends it to whom.
uint64_t message_flow_id(int source, int destination, uint64_t op, int32_t step, int32_t chunk);

class ProfileRecorder {
 public:
  static constexpr int64_t kDefaultCapacity = 1 << 16;
  static constexpr int64_t kMaxCapacity = 1 << 20;

  // Whether a profile is recording: the only cost of a span while none is.
  bool on() const { return on_.load(std::memory_order_relaxed); }

  // Starts recording from now, dropping what an earlier profile left; `capacity` events at
  // most (in [1, kMaxCapacity], else INVALID_ARGUMENT is the caller's to give: it is clamped
  // here), beyond which the oldest go and are counted.
  void start(int64_t capacity);
  // Stops recording; the events stay readable (snapshot) until the next start.
  void stop();

  struct Snapshot {
    std::vector<ProfileEvent> events;  // oldest first
    int64_t dropped = 0;               // overwritten for the capacity
    int64_t start_ns = 0;              // when start() was called
  };
  // The events recorded, from `first` (an index into the oldest-first order) on, at most
  // `max_events` of them; `*total` (if set) gets how many there are.
  Snapshot snapshot(int64_t first = 0, int64_t max_events = kMaxCapacity, int64_t* total = nullptr) const;

  // Records `event` if recording and it started after start(); any thread.
  void add(ProfileEvent event);

 private:
  std::atomic<bool> on_{false};
  mutable absl::Mutex mu_;
  std::vector<ProfileEvent> ring_ ABSL_GUARDED_BY(mu_);
  size_t capacity_ ABSL_GUARDED_BY(mu_) = 0;
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;  // where the next event goes once the ring is full
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t start_ns_ ABSL_GUARDED_BY(mu_) = 0;
};

// A complete event from construction to destruction, recorded only when the recorder was on
// at construction (`name` is called only then).
class ProfileSpan {
 public:
  template <typename NameFn>
  ProfileSpan(ProfileRecorder* recorder, const char* category, NameFn&& name)
      : recorder_(recorder != nullptr && recorder->on() ? recorder : nullptr) {
    if (recorder_ == nullptr) return;
    begin(category, name());
  }
  ~ProfileSpan() { end(); }
  ProfileSpan(const ProfileSpan&) = delete;
  ProfileSpan& operator=(const ProfileSpan&) = delete;

  explicit operator bool() const { return recorder_ != nullptr; }
  void arg(std::string key, std::string value) {
    if (recorder_ != nullptr) event_.args.emplace_back(std::move(key), std::move(value));
  }
  // Records the span now (the destructor then does nothing).
  void end();

 private:
  void begin(const char* category, std::string name);
  ProfileRecorder* recorder_;
  ProfileEvent event_;
};

// Records one end of a flow (a collective message sent or taken) at `ts_ns` (0: now), if recording.
void profile_flow(ProfileRecorder& recorder, ProfileEvent::Phase phase, uint64_t flow_id, std::string name,
                  int64_t ts_ns = 0);

}  // namespace tessera

#endif  // TESSERA_CORE_PROFILE_H_

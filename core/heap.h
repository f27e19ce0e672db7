// The daemons' heap: glibc malloc's arenas, and handing freed pages back to the kernel.
//
// Past a cache's bound (the coordinator's programs, the workers' plans) every new entry frees
// an old one of a similar size, so the bytes in use stay flat; but glibc keeps the freed chunks
// of each of its per-thread arenas (as many as 8 per core by default), scattered among live
// ones, and the resident memory grows slowly (measured with mallinfo2 in docs/design.md,
// "Memory"). A daemon limits the arenas once at start, and trims after it released state:
//
//   limit_malloc_arenas(absl::GetFlag(FLAGS_malloc_arenas));  // in main, before threads
//   HeapTrimmer trimmer;
//   trimmer.released();           // where a cache evicts or a store drops entries
//   trimmer.trim_if_released();   // on a periodic thread (never a gRPC callback thread)
//
// A worker also frees memory as it runs (each run's intermediates, arrays deleted): glibc keeps
// those chunks too (a training step's peak stays resident), so it trims once it went idle:
//
//   HeapTrimmer trimmer({.min_freed_bytes = 64 << 20, .quiet = absl::Milliseconds(200)});
//   trimmer.trim_if_idle(HostArray::bytes_freed(), idle_for);   // on the periodic thread
#ifndef TESSERA_CORE_HEAP_H_
#define TESSERA_CORE_HEAP_H_

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace tessera {

// Sets glibc's M_ARENA_MAX to `arenas`, or to the number of cores (at least 2) when `arenas`
// is 0 or less. Returns the limit set. Call before starting threads (arenas made before stay).
int limit_malloc_arenas(int arenas);

// Counts releases of state and, when asked on a periodic thread, returns the free pages of
// every arena to the kernel (malloc_trim) if anything was released since the last time, or
// if enough bytes were freed since the last trim and the daemon has been idle a while.
// Thread-safe.
class HeapTrimmer {
 public:
  struct IdleTrim {
    // Trim once this many bytes were freed since the last idle trim (0: never on idle).
    int64_t min_freed_bytes = 0;
    // ... and nothing has run for this long: a daemon busy with back-to-back work (a training
    // loop) does not trim between its steps, whose next one would fault the pages in again.
    absl::Duration quiet = absl::Milliseconds(200);
  };

  HeapTrimmer() : idle_() {}
  explicit HeapTrimmer(IdleTrim idle) : idle_(idle) {}

  // Something was freed (an evicted program, unloaded plans, dropped messages).
  void released() { released_.fetch_add(1, std::memory_order_relaxed); }

  // malloc_trim(0) if released() was called since the last trim; returns whether it trimmed.
  // Takes each arena's lock in turn (about 0.1-1 ms for a 20 MB heap in 2 arenas here): call
  // it from a thread that may block briefly. `freed_bytes` (trim_if_idle's running count, if
  // known) marks what this trim returned, so the next idle trim waits for as much more.
  bool trim_if_released(int64_t freed_bytes = -1);

  // malloc_trim(0) if at least IdleTrim::min_freed_bytes were freed since its last trim and
  // `idle_for` (how long the daemon has had nothing in flight; zero while it is busy) is
  // positive and at least IdleTrim::quiet. `freed_bytes` is a running count of the bytes
  // freed, from 0 (HostArray::bytes_freed). Returns whether it trimmed. Same caveat as
  // trim_if_released.
  bool trim_if_idle(int64_t freed_bytes, absl::Duration idle_for);

  int64_t trims() const { return trims_.load(std::memory_order_relaxed); }
  // Of trims(), those trim_if_idle made, and those trim_if_released made (counted apart, so
  // each count only grows as a scrape reads it).
  int64_t idle_trims() const { return idle_trims_.load(std::memory_order_relaxed); }
  int64_t released_trims() const { return released_trims_.load(std::memory_order_relaxed); }
  // The bytes the trims gave back: the drop of the process's resident memory across each trim
  // (VmRSS from /proc/self/statm; what other threads allocate meanwhile counts against it).
  int64_t trimmed_bytes() const { return trimmed_bytes_.load(std::memory_order_relaxed); }

 private:
  // malloc_trim(0), counted.
  void trim();

  const IdleTrim idle_;
  std::atomic<int64_t> released_{0};
  std::atomic<int64_t> trims_{0};
  std::atomic<int64_t> idle_trims_{0};
  std::atomic<int64_t> released_trims_{0};
  std::atomic<int64_t> trimmed_bytes_{0};
  // trim_if_idle's `freed_bytes` at the last trim (the running count starts at 0).
  std::atomic<int64_t> freed_at_last_trim_{0};
};

}  // namespace tessera

#endif  // TESSERA_CORE_HEAP_H_

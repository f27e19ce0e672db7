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
#ifndef TESSERA_CORE_HEAP_H_
#define TESSERA_CORE_HEAP_H_

#include <atomic>
#include <cstdint>

namespace tessera {

// Sets glibc's M_ARENA_MAX to `arenas`, or to the number of cores (at least 2) when `arenas`
// is 0 or less. Returns the limit set. Call before starting threads (arenas made before stay).
int limit_malloc_arenas(int arenas);

// Counts releases of state and, when asked on a periodic thread, returns the free pages of
// every arena to the kernel (malloc_trim) if anything was released since the last time.
// Thread-safe.
class HeapTrimmer {
 public:
  // Something was freed (an evicted program, unloaded plans, dropped messages).
  void released() { released_.fetch_add(1, std::memory_order_relaxed); }

  // malloc_trim(0) if released() was called since the last trim; returns whether it trimmed.
  // Takes each arena's lock in turn (about 0.1-1 ms for a 20 MB heap in 2 arenas here): call
  // it from a thread that may block briefly.
  bool trim_if_released();

  int64_t trims() const { return trims_.load(std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> released_{0};
  std::atomic<int64_t> trims_{0};
};

}  // namespace tessera

#endif  // TESSERA_CORE_HEAP_H_

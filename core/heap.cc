#include "core/heap.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <thread>

namespace tessera {

namespace {

// This process's resident bytes (the second field of /proc/self/statm, in pages); -1 if unreadable.
int64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long long size = 0, resident = -1;
  const int read = std::fscanf(f, "%lld %lld", &size, &resident);
  std::fclose(f);
  return read == 2 ? resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)) : -1;
}

}  // namespace

int limit_malloc_arenas(int arenas) {
  const int limit = arenas > 0 ? arenas : std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  mallopt(M_ARENA_MAX, limit);
  return limit;
}

void HeapTrimmer::trim() {
  const int64_t before = resident_bytes();
  malloc_trim(0);
  const int64_t after = resident_bytes();
  if (before >= 0 && after >= 0 && after < before) trimmed_bytes_.fetch_add(before - after, std::memory_order_relaxed);
  trims_.fetch_add(1, std::memory_order_relaxed);
}

bool HeapTrimmer::trim_if_released(int64_t freed_bytes) {
  if (released_.exchange(0, std::memory_order_relaxed) == 0) return false;
  if (freed_bytes >= 0) freed_at_last_trim_.store(freed_bytes, std::memory_order_relaxed);
  trim();
  released_trims_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool HeapTrimmer::trim_if_idle(int64_t freed_bytes, absl::Duration idle_for) {
  if (idle_.min_freed_bytes <= 0 || idle_for <= absl::ZeroDuration() || idle_for < idle_.quiet) return false;
  if (freed_bytes - freed_at_last_trim_.load(std::memory_order_relaxed) < idle_.min_freed_bytes) return false;
  freed_at_last_trim_.store(freed_bytes, std::memory_order_relaxed);
  trim();
  idle_trims_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace tessera

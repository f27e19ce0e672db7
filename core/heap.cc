#include "core/heap.h"

#include <malloc.h>

#include <algorithm>
#include <thread>

namespace tessera {

int limit_malloc_arenas(int arenas) {
  const int limit = arenas > 0 ? arenas : std::max(2, static_cast<int>(std::thread::hardware_concurrency()));
  mallopt(M_ARENA_MAX, limit);
  return limit;
}

bool HeapTrimmer::trim_if_released() {
  if (released_.exchange(0, std::memory_order_relaxed) == 0) return false;
  malloc_trim(0);
  trims_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

}  // namespace tessera

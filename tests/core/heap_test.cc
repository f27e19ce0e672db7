// HeapTrimmer (core/heap.h): a trim only after a release, and a trim returns the free pages
// scattered among live chunks to the kernel. The reference is the kernel's own count of the
// process's resident pages (VmRSS, /proc/self/status), not glibc's statistics.
#include "core/heap.h"

#include <malloc.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace tessera {
namespace {

int64_t rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
  }
  return -1;
}

TEST(HeapTrimmer, TrimsOnlyAfterARelease) {
  HeapTrimmer trimmer;
  EXPECT_FALSE(trimmer.trim_if_released());
  trimmer.released();
  trimmer.released();
  EXPECT_TRUE(trimmer.trim_if_released());
  EXPECT_FALSE(trimmer.trim_if_released());
  EXPECT_EQ(trimmer.trims(), 1);
}

// As past a cache's bound: 64 MiB of 4 KiB entries, all freed but one in 16 (so the heap's top
// stays in use and glibc's automatic trim of the top returns nothing). The trim gives back
// the free pages in between.
TEST(HeapTrimmer, ATrimReturnsTheFreePagesAmongLiveChunks) {
  mallopt(M_TRIM_THRESHOLD, 1 << 30);  // as the worker sets it: no automatic trim
  constexpr size_t kChunk = 4096, kChunks = (64 << 20) / kChunk;
  std::vector<char*> chunks(kChunks);
  for (char*& c : chunks) {
    c = static_cast<char*>(malloc(kChunk));
    ASSERT_NE(c, nullptr);
    std::memset(c, 1, kChunk);  // resident
  }
  for (size_t i = 0; i < kChunks; ++i) {
    if (i % 16 != 15) {
      free(chunks[i]);
      chunks[i] = nullptr;
    }
  }
  const int64_t before = rss_kib();
  HeapTrimmer trimmer;
  trimmer.released();
  ASSERT_TRUE(trimmer.trim_if_released());
  const int64_t after = rss_kib();
  // 60 MiB were freed; at least half of it is back with the kernel.
  EXPECT_GT(before - after, 30 * 1024) << "RSS " << before << " KiB before the trim, " << after << " KiB after";
  for (char* c : chunks) free(c);
}

TEST(HeapTrimmer, ArenaLimitDefaultsToTheCoresAndAtLeastTwo) {
  EXPECT_EQ(limit_malloc_arenas(3), 3);
  EXPECT_GE(limit_malloc_arenas(0), 2);
}

}  // namespace
}  // namespace tessera

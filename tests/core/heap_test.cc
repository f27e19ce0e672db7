// HeapTrimmer (core/heap.h): a trim only after a release, or once enough was freed and the
// daemon stayed idle; a trim returns the free pages scattered among live chunks to the kernel.
// The reference is the kernel's own count of the process's resident pages (VmRSS,
// /proc/self/status), not glibc's statistics.
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

// A worker calls trim_if_idle on every heartbeat tick with the running count of freed bytes
// and how long no run has been in flight. A training loop frees far more than the bound every
// step but is never idle for the quiet period: no trim until it stops, then one.
TEST(HeapTrimmer, TrimsOnceIdleAfterFreeingEnoughAndNotBetweenBusyRuns) {
  HeapTrimmer trimmer({.min_freed_bytes = 1000, .quiet = absl::Milliseconds(200)});
  int64_t freed = 0;
  for (int step = 0; step < 50; ++step) {
    freed += 5000;  // each run frees 5x the bound
    // Ticks while the next run is already in flight, or in the gap between two runs.
    EXPECT_FALSE(trimmer.trim_if_idle(freed, absl::ZeroDuration())) << "step " << step;
    EXPECT_FALSE(trimmer.trim_if_idle(freed, absl::Milliseconds(199))) << "step " << step;
  }
  EXPECT_EQ(trimmer.trims(), 0);
  EXPECT_TRUE(trimmer.trim_if_idle(freed, absl::Milliseconds(200)));  // the loop ended
  // Idle on: nothing freed since, no trim; 999 bytes, still none; 1000, one more.
  EXPECT_FALSE(trimmer.trim_if_idle(freed, absl::Seconds(5)));
  EXPECT_FALSE(trimmer.trim_if_idle(freed + 999, absl::Seconds(6)));
  EXPECT_TRUE(trimmer.trim_if_idle(freed + 1000, absl::Seconds(7)));
  EXPECT_EQ(trimmer.trims(), 2);
  EXPECT_EQ(trimmer.idle_trims(), 2);
  // The release-driven trims count apart; one given the running count returns what was freed
  // so far, so the next idle tick does not trim the same bytes again.
  trimmer.released();
  EXPECT_TRUE(trimmer.trim_if_released(freed + 5000));
  EXPECT_EQ(trimmer.trims(), 3);
  EXPECT_EQ(trimmer.idle_trims(), 2);
  EXPECT_EQ(trimmer.released_trims(), 1);
  EXPECT_FALSE(trimmer.trim_if_idle(freed + 5000, absl::Seconds(8)));
  EXPECT_TRUE(trimmer.trim_if_idle(freed + 6000, absl::Seconds(9)));
  EXPECT_EQ(trimmer.idle_trims(), 3);
}

TEST(HeapTrimmer, NeverTrimsOnIdleWithoutABound) {
  HeapTrimmer trimmer;  // min_freed_bytes 0: the daemons' release-driven trims only
  EXPECT_FALSE(trimmer.trim_if_idle(int64_t{1} << 40, absl::Hours(1)));
  HeapTrimmer no_quiet({.min_freed_bytes = 1, .quiet = absl::ZeroDuration()});
  EXPECT_FALSE(no_quiet.trim_if_idle(10, absl::ZeroDuration()));  // busy is never idle
  EXPECT_TRUE(no_quiet.trim_if_idle(10, absl::Nanoseconds(1)));
  EXPECT_EQ(trimmer.trims() + no_quiet.trims(), 1);
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
  // 60 MiB were freed; at least half of it is back with the kernel, and the trimmer's own
  // count of what it gave back (its statm readings around malloc_trim) says as much.
  EXPECT_GT(before - after, 30 * 1024) << "RSS " << before << " KiB before the trim, " << after << " KiB after";
  EXPECT_GT(trimmer.trimmed_bytes(), int64_t{30} << 20);
  EXPECT_LE(trimmer.trimmed_bytes(), (before - after + 1024) * 1024);
  for (char* c : chunks) free(c);
}

TEST(HeapTrimmer, ArenaLimitDefaultsToTheCoresAndAtLeastTwo) {
  EXPECT_EQ(limit_malloc_arenas(3), 3);
  EXPECT_GE(limit_malloc_arenas(0), 2);
}

}  // namespace
}  // namespace tessera

// ShmRing (worker/collectives/shm_ring.h): messages through a ring in /dev/shm come out as they
// went in (checked byte by byte against what was written), across the ring's end and with the
// writer waiting for room; its bounds and its checks of what it opens give precise errors.
#include "worker/collectives/shm_ring.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::vector<std::byte> pattern(int64_t n, int seed) {
  std::vector<std::byte> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<std::byte>((i * 31 + seed) & 0xFF);
  return out;
}

TEST(ShmRing, MessagesArriveInOrderAcrossTheEndWhileTheWriterWaitsForRoom) {
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 42);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> peer = ShmRing::open((*ring)->name(), 42);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_FALSE((*ring)->attached());
  (*peer)->mark_attached();
  EXPECT_TRUE((*ring)->attached());
  // 40 messages of up to 700 KiB (about 14 MiB through a 2 MiB ring, some of 0 bytes): the
  // writer must wait for the reader, and messages straddle the ring's end.
  constexpr int kMessages = 40;
  auto size_of = [](int i) { return i % 7 == 0 ? int64_t{0} : (int64_t{i} * 104729) % (700 << 10); };
  std::thread writer([&] {
    for (int i = 0; i < kMessages; ++i) {
      const std::vector<std::byte> data = pattern(size_of(i), i);
      const ShmRing::Record record{uint64_t(1000 + i), i, -i, size_of(i)};
      ASSERT_TRUE((*ring)->fits(record.bytes));
      EXPECT_TRUE((*ring)->write(record, data.data(), absl::Now() + absl::Seconds(30))) << i;
    }
  });
  for (int i = 0; i < kMessages; ++i) {
    ShmRing::Record record;
    absl::StatusOr<bool> got = (*peer)->next(&record, absl::Now() + absl::Seconds(30));
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(*got) << "message " << i << " did not come";
    EXPECT_EQ(record.op, uint64_t(1000 + i));
    EXPECT_EQ(record.step, i);
    EXPECT_EQ(record.chunk, -i);
    ASSERT_EQ(record.bytes, size_of(i));
    std::vector<std::byte> data(static_cast<size_t>(record.bytes));
    (*peer)->copy_payload(record, data.data());
    EXPECT_TRUE(data == pattern(size_of(i), i)) << "message " << i;
    (*peer)->consume(record);
  }
  writer.join();
  EXPECT_FALSE((*peer)->drained_and_closed());
  ring->reset();  // the writer closes it
  EXPECT_TRUE((*peer)->drained_and_closed());
}

TEST(ShmRing, AFullRingTimesOutAndAnEmptyOneReturnsNothing) {
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 7);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> peer = ShmRing::open((*ring)->name(), 7);
  ASSERT_TRUE(peer.ok()) << peer.status();
  ShmRing::Record record;
  absl::StatusOr<bool> none = (*peer)->next(&record, absl::Now() + absl::Milliseconds(20));
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);
  const std::vector<std::byte> data = pattern(ShmRing::kMinBytes / 2 - 64, 1);
  EXPECT_FALSE((*ring)->fits(ShmRing::kMinBytes / 2));
  EXPECT_TRUE((*ring)->write({1, 0, 0, int64_t(data.size())}, data.data(), absl::Now()));
  EXPECT_TRUE((*ring)->write({1, 1, 0, int64_t(data.size())}, data.data(), absl::Now()));
  // Full: no room by the deadline.
  EXPECT_FALSE((*ring)->write({1, 2, 0, int64_t(data.size())}, data.data(), absl::Now() + absl::Milliseconds(20)));
}

TEST(ShmRing, BoundsAndChecksGivePreciseErrors) {
  absl::StatusOr<std::unique_ptr<ShmRing>> tiny = ShmRing::create(4096, 1);
  EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(tiny.status().message()), HasSubstr("ring of 4096 bytes"));

  absl::StatusOr<std::unique_ptr<ShmRing>> missing = ShmRing::open("/tessera-ring-0-0-nosuch", 1);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::unique_ptr<ShmRing>> outside = ShmRing::open("/tessera-ring-x/../../etc", 1);
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument);

  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 99);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> wrong = ShmRing::open((*ring)->name(), 98);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("token"));
}

// The peer writes the whole segment: a message whose size is near 2^63 (here 2^63 - 5, with
// a record written) is DATA_LOSS. fuzz_shm_ring's replay of such a segment showed the check
// adding the size to the record's bytes first: a signed overflow (UBSan), after which the
// message was accepted with that size.
TEST(ShmRing, AMessageSizeNear2To63IsDataLossNotAnOverflow) {
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 7);
  ASSERT_TRUE(ring.ok()) << ring.status();
  // The peer's own mapping of its segment (as a hostile peer keeps one).
  const int fd = shm_open((*ring)->name().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  const size_t size = static_cast<size_t>(ShmRing::kHeaderBytes + ShmRing::kMinBytes);
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  ASSERT_NE(base, MAP_FAILED);
  absl::StatusOr<std::unique_ptr<ShmRing>> reader = ShmRing::open((*ring)->name(), 7);
  ASSERT_TRUE(reader.ok()) << reader.status();
  // An empty message, then its size rewritten in the ring.
  ASSERT_TRUE((*ring)->write({5, 0, 0, 0}, nullptr, absl::Now() + absl::Seconds(10)));
  const int64_t huge = std::numeric_limits<int64_t>::max() - 4;
  std::memcpy(static_cast<std::byte*>(base) + ShmRing::kHeaderBytes + offsetof(ShmRing::Record, bytes), &huge,
              sizeof huge);
  ShmRing::Record record;
  absl::StatusOr<bool> got = (*reader)->next(&record, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << (got.ok() ? "accepted" : got.status().ToString());
  if (!got.ok()) {
    EXPECT_THAT(std::string(got.status().message()), HasSubstr(absl::StrCat(huge, " bytes")));
  }
  munmap(base, size);
}

}  // namespace
}  // namespace tessera

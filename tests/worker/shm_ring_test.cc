// ShmRing (worker/collectives/shm_ring.h): messages through a ring in a memfd come out as they
// went in (checked byte by byte against what was written), across the ring's end and with the
// writer waiting for room; its bounds and its checks of what it attaches give precise errors.
// ShmRingServer hands a ring over its Unix socket once, to its token only, and never lets a
// connection hold it longer than its deadline; the ring has no name anywhere.
#include "worker/collectives/shm_ring.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
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

// The reader's end of `ring`, attached from a duplicate of its memfd (as if handed over).
absl::StatusOr<std::unique_ptr<ShmRing>> reader_of(const ShmRing& ring, uint64_t token) {
  return ShmRing::attach(fcntl(ring.fd(), F_DUPFD_CLOEXEC, 0), token);
}

// The entries of /dev/shm that are the file `fd` is open on (the same device and inode).
std::vector<std::string> dev_shm_names_of(int fd) {
  std::vector<std::string> names;
  struct stat target;
  if (fstat(fd, &target) != 0) return {"(fstat failed)"};
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* entry = readdir(dir)) {
    struct stat st;
    const std::string path = absl::StrCat("/dev/shm/", entry->d_name);
    if (stat(path.c_str(), &st) == 0 && st.st_dev == target.st_dev && st.st_ino == target.st_ino) {
      names.push_back(path);
    }
  }
  closedir(dir);
  return names;
}

// A connection to `path` (a ring server's socket), or -1.
int connect_to(const std::string& path) {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.data(), path.size());
  if (connect(s, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    close(s);
    return -1;
  }
  return s;
}

// Whether the server closed connection `s` within `within` (its end: recv reads 0 bytes).
bool closed_within(int s, absl::Duration within) {
  pollfd readable{s, POLLIN, 0};
  if (poll(&readable, 1, static_cast<int>(absl::ToInt64Milliseconds(within))) != 1) return false;
  char byte;
  return recv(s, &byte, 1, MSG_DONTWAIT) == 0;
}

TEST(ShmRing, MessagesArriveInOrderAcrossTheEndWhileTheWriterWaitsForRoom) {
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 42);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> peer = reader_of(**ring, 42);
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
  absl::StatusOr<std::unique_ptr<ShmRing>> peer = reader_of(**ring, 7);
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

  absl::StatusOr<std::unique_ptr<ShmRing>> missing =
      ShmRing::fetch("/dev/shm/tessera-0-nosuch.sock", 1, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  for (const std::string& path :
       std::vector<std::string>{"/dev/shm/tessera-x/../../etc/passwd", "tessera-1.sock", "/etc/passwd",
                                "/dev/shm/tessera-.sock.x", std::string(200, '/') + "tessera-1.sock"}) {
    absl::StatusOr<std::unique_ptr<ShmRing>> outside = ShmRing::fetch(path, 1, absl::Now() + absl::Seconds(10));
    EXPECT_EQ(outside.status().code(), absl::StatusCode::kInvalidArgument) << path << ": " << outside.status();
  }

  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 99);
  ASSERT_TRUE(ring.ok()) << ring.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> wrong = reader_of(**ring, 98);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("token"));

  // Not a memfd; a memfd whose size its writer may still change.
  const int null = open("/dev/null", O_RDWR | O_CLOEXEC);
  absl::StatusOr<std::unique_ptr<ShmRing>> device = ShmRing::attach(null, 99);
  EXPECT_EQ(device.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(device.status().message()), HasSubstr("not a memfd"));
  const int unsealed = memfd_create("tessera-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(ftruncate(unsealed, ShmRing::kHeaderBytes + ShmRing::kMinBytes), 0);
  absl::StatusOr<std::unique_ptr<ShmRing>> shrinkable = ShmRing::attach(unsealed, 99);
  EXPECT_EQ(shrinkable.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(shrinkable.status().message()), HasSubstr("size not sealed"));
}

// Issue #18 item 3: a ring is a memfd handed over a Unix socket, never a named segment that any
// process of the user could open while it waits for its reader (before session 34 it was
// /dev/shm/tessera-ring-<pid>-<n>-<random> until the reader opened it). The server's socket is
// the owner's alone (0600); it hands the ring to its token once, refuses any other token, and
// goes with the server.
TEST(ShmRingServer, HandsARingOnceToItsTokenAndTheRingHasNoName) {
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start("/dev/shm");
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string path = (*server)->path();
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 0x1234'5678'9abc'def0);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_THAT(dev_shm_names_of((*ring)->fd()), ::testing::IsEmpty());
  ASSERT_TRUE((*server)->offer(**ring).ok());

  const absl::Time until = absl::Now() + absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ShmRing>> wrong = ShmRing::fetch(path, 0x1234'5678'9abc'def1, until);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("refused the token"));
  EXPECT_EQ((*server)->refused(), 1);
  EXPECT_EQ((*server)->handed_over(), 0);

  absl::StatusOr<std::unique_ptr<ShmRing>> peer = ShmRing::fetch(path, 0x1234'5678'9abc'def0, until);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*server)->handed_over(), 1);
  (*peer)->mark_attached();
  EXPECT_TRUE((*ring)->attached());
  EXPECT_THAT(dev_shm_names_of((*ring)->fd()), ::testing::IsEmpty());
  const std::vector<std::byte> data = pattern(1000, 3);
  ASSERT_TRUE((*ring)->write({9, 1, 2, 1000}, data.data(), until));
  ShmRing::Record record;
  absl::StatusOr<bool> got = (*peer)->next(&record, until);
  ASSERT_TRUE(got.ok() && *got) << got.status();
  ASSERT_EQ(record.bytes, 1000);
  std::vector<std::byte> out(1000);
  (*peer)->copy_payload(record, out.data());
  EXPECT_TRUE(out == data);

  // Spent: the token fetches nothing more.
  absl::StatusOr<std::unique_ptr<ShmRing>> again = ShmRing::fetch(path, 0x1234'5678'9abc'def0, until);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_EQ((*server)->refused(), 2);

  server->reset();
  EXPECT_NE(access(path.c_str(), F_OK), 0) << path << " is left behind";
  absl::StatusOr<std::unique_ptr<ShmRing>> gone = ShmRing::fetch(path, 0x1234'5678'9abc'def0, until);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

// A worker killed (kill -9: the faults tests, a crashed container) leaves its socket behind; the
// next server to start in the directory removes it, but not a live server's.
TEST(ShmRingServer, StartingRemovesTheSocketsOfKilledServersOnly) {
  absl::StatusOr<std::unique_ptr<ShmRingServer>> live = ShmRingServer::start("/dev/shm");
  ASSERT_TRUE(live.ok()) << live.status();
  // A killed server's socket: bound, then its process gone (closed without removing it).
  const std::string dead = absl::StrCat("/dev/shm/tessera-", getpid(), "-dead.sock");
  {
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, dead.data(), dead.size());
    ASSERT_EQ(bind(s, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0) << dead;
    ASSERT_EQ(listen(s, 1), 0);
    close(s);
  }
  ASSERT_EQ(access(dead.c_str(), F_OK), 0);
  absl::StatusOr<std::unique_ptr<ShmRingServer>> next = ShmRingServer::start("/dev/shm");
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_NE(access(dead.c_str(), F_OK), 0) << dead << " was left";
  EXPECT_EQ(access((*live)->path().c_str(), F_OK), 0) << "a live server's socket was removed";
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 11);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*live)->offer(**ring).ok());
  EXPECT_TRUE(ShmRing::fetch((*live)->path(), 11, absl::Now() + absl::Seconds(30)).ok());
}

// Bounded: connections beyond ShmRingServer::kMaxPending are closed at once, and those that
// send no token are closed at kHandoverTimeout; a withdrawn ring is refused.
TEST(ShmRingServer, SilentAndSurplusConnectionsAreClosedAndAWithdrawnRingRefused) {
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start("/dev/shm");
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> silent;
  for (int i = 0; i < ShmRingServer::kMaxPending; ++i) {
    silent.push_back(connect_to((*server)->path()));
    ASSERT_GE(silent.back(), 0);
  }
  // The server takes them in order: this one finds the others pending, and is closed while they
  // still are (a deadline would have closed the first of them no later).
  const int surplus = connect_to((*server)->path());
  ASSERT_GE(surplus, 0);
  EXPECT_TRUE(closed_within(surplus, absl::Seconds(30))) << "a connection past the limit was kept";
  EXPECT_FALSE(closed_within(silent[0], absl::ZeroDuration())) << "closed at its deadline, not as surplus";
  close(surplus);
  for (int s : silent) {
    EXPECT_TRUE(closed_within(s, ShmRingServer::kHandoverTimeout + absl::Seconds(30)));
    close(s);
  }
  EXPECT_EQ((*server)->refused(), ShmRingServer::kMaxPending + 1);

  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 5);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  (*server)->withdraw(5);
  absl::StatusOr<std::unique_ptr<ShmRing>> withdrawn =
      ShmRing::fetch((*server)->path(), 5, absl::Now() + absl::Seconds(30));
  EXPECT_EQ(withdrawn.status().code(), absl::StatusCode::kFailedPrecondition) << withdrawn.status();
}

// The peer writes the whole segment: a message whose size is near 2^63 (here 2^63 - 5, with
// a record written) is DATA_LOSS. fuzz_shm_ring's replay of such a segment showed the check
// adding the size to the record's bytes first: a signed overflow (UBSan), after which the
// message was accepted with that size.
TEST(ShmRing, AMessageSizeNear2To63IsDataLossNotAnOverflow) {
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 7);
  ASSERT_TRUE(ring.ok()) << ring.status();
  // The peer's own mapping of its segment (as a hostile peer keeps one).
  const size_t size = static_cast<size_t>(ShmRing::kHeaderBytes + ShmRing::kMinBytes);
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, (*ring)->fd(), 0);
  ASSERT_NE(base, MAP_FAILED);
  absl::StatusOr<std::unique_ptr<ShmRing>> reader = reader_of(**ring, 7);
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

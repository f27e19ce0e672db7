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
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/unix_sockets.h"

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

// A connection accepted on `listener` within `within`, or -1 (a test's server thread never
// blocks past its test).
int accept_within(int listener, absl::Duration within) {
  pollfd pending{listener, POLLIN, 0};
  if (poll(&pending, 1, static_cast<int>(absl::ToInt64Milliseconds(within))) != 1) return -1;
  return accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
}

// How many descriptors this process has open.
int open_fds() {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) n += entry.exists() ? 1 : 0;
  return n;
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
      ShmRing::fetch("/dev/shm/tessera-0-nosuch.sock", "/dev/shm", 1, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  // Servers in "/" name their sockets "/tessera-...": before, fetch compared "" with "/" and
  // refused them FAILED_PRECONDITION, not directly in "/".
  absl::StatusOr<std::unique_ptr<ShmRing>> at_root =
      ShmRing::fetch("/tessera-0-nosuch.sock", "/", 1, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(at_root.status().code(), absl::StatusCode::kNotFound) << at_root.status();
  // Wherever ".." leads, a path through it is not directly in the directory.
  absl::StatusOr<std::unique_ptr<ShmRing>> up =
      ShmRing::fetch("/dev/shm/x/../tessera-0-nosuch.sock", "/dev/shm", 1, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(up.status().code(), absl::StatusCode::kFailedPrecondition) << up.status();
  EXPECT_THAT(std::string(up.status().message()), HasSubstr("not directly in /dev/shm/, the directory"));
  for (const std::string& path :
       std::vector<std::string>{"/dev/shm/tessera-x/../../etc/passwd", "tessera-1.sock", "/etc/passwd",
                                "/dev/shm/tessera-.sock.x", std::string(200, '/') + "tessera-1.sock"}) {
    absl::StatusOr<std::unique_ptr<ShmRing>> outside =
        ShmRing::fetch(path, "/dev/shm", 1, absl::Now() + absl::Seconds(10));
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
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start(dir.path());
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string path = (*server)->path();
  // Another server starting probes this one's socket (is anybody listening?): no refusal
  // (before, each probe counted as one, and tests counting refusals failed under ctest -j2).
  ASSERT_TRUE(ShmRingServer::start(dir.path()).ok());
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0) << path;
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 0x1234'5678'9abc'def0);
  ASSERT_TRUE(ring.ok()) << ring.status();
  EXPECT_THAT(dev_shm_names_of((*ring)->fd()), ::testing::IsEmpty());
  const int kept = dup((*ring)->fd());  // the test's own: the server takes the ring's
  ASSERT_GE(kept, 0);
  ASSERT_TRUE((*server)->offer(**ring).ok());

  const absl::Time until = absl::Now() + absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ShmRing>> wrong = ShmRing::fetch(path, dir.path(), 0x1234'5678'9abc'def1, until);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kFailedPrecondition) << wrong.status();
  EXPECT_THAT(std::string(wrong.status().message()), HasSubstr("refused the token"));
  EXPECT_EQ((*server)->refused(), 1);
  EXPECT_EQ((*server)->handed_over(), 0);

  absl::StatusOr<std::unique_ptr<ShmRing>> peer = ShmRing::fetch(path, dir.path(), 0x1234'5678'9abc'def0, until);
  ASSERT_TRUE(peer.ok()) << peer.status();
  EXPECT_EQ((*server)->handed_over(), 1);
  (*peer)->mark_attached();
  EXPECT_TRUE((*ring)->attached());
  EXPECT_THAT(dev_shm_names_of(kept), ::testing::IsEmpty());
  close(kept);
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
  absl::StatusOr<std::unique_ptr<ShmRing>> again = ShmRing::fetch(path, dir.path(), 0x1234'5678'9abc'def0, until);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_EQ((*server)->refused(), 2);

  server->reset();
  EXPECT_NE(access(path.c_str(), F_OK), 0) << path << " is left behind";
  absl::StatusOr<std::unique_ptr<ShmRing>> gone = ShmRing::fetch(path, dir.path(), 0x1234'5678'9abc'def0, until);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

// Issue #18 (review S1): an offered ring costs its process one descriptor, the server's, until
// it is fetched or withdrawn, and none after; the fetched ring holds none either (only its
// mapping). Before, the ring kept its memfd and the server a duplicate: two per link for the
// link's life (a link offers a ring to every peer it sends to, remote ones too, which never fetch
// it), and a worker linked to ~500 peers ran out of a soft limit of 1024.
TEST(ShmRingServer, AnOfferedRingHoldsOneDescriptorUntilFetchedOrWithdrawnAndNoneAfter) {
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start(dir.path());
  ASSERT_TRUE(server.ok()) << server.status();
  const int baseline = open_fds();
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 21);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  EXPECT_EQ(open_fds(), baseline + 1);  // before: + 2
  EXPECT_EQ((*ring)->fd(), -1);
  const absl::Time until = absl::Now() + absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ShmRing>> peer = ShmRing::fetch((*server)->path(), dir.path(), 21, until);
  ASSERT_TRUE(peer.ok()) << peer.status();
  // The server's one thread answers connections in turn: once this refusal (the token is spent)
  // has come, it has closed the handover's connection and memfd.
  EXPECT_EQ(ShmRing::fetch((*server)->path(), dir.path(), 21, until).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(open_fds(), baseline);  // before: + 1, the ring's memfd
  // Both ends still work through their mappings.
  (*peer)->mark_attached();
  EXPECT_TRUE((*ring)->attached());
  const std::vector<std::byte> data = pattern(100, 4);
  ASSERT_TRUE((*ring)->write({3, 0, 0, 100}, data.data(), until));
  ShmRing::Record record;
  absl::StatusOr<bool> got = (*peer)->next(&record, until);
  ASSERT_TRUE(got.ok() && *got) << got.status();
  std::vector<std::byte> out(100);
  (*peer)->copy_payload(record, out.data());
  EXPECT_TRUE(out == data);
  // A ring that is offered and withdrawn (its link went, its peer never fetched it).
  absl::StatusOr<std::unique_ptr<ShmRing>> unfetched = ShmRing::create(ShmRing::kMinBytes, 22);
  ASSERT_TRUE(unfetched.ok()) << unfetched.status();
  ASSERT_TRUE((*server)->offer(**unfetched).ok());
  EXPECT_EQ(open_fds(), baseline + 1);  // before: + 2
  (*server)->withdraw(22);
  EXPECT_EQ(open_fds(), baseline);  // before: + 1
  // Offered twice: the ring has no memfd left to give.
  absl::Status again = (*server)->offer(**unfetched);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_THAT(std::string(again.message()), HasSubstr("has no memfd to offer"));
}

// A worker killed (kill -9: the faults tests, a crashed container) leaves its socket behind; the
// next server to start in the directory removes it, but not a live server's. Only sockets of
// this uid are touched: a file that is no socket keeps its name (before, a connection to it was
// refused and it was removed). A .bind name (a server killed between bind and rename) goes once
// it is a minute old (before, never); a younger one may be a server starting.
TEST(ShmRingServer, StartingRemovesTheSocketsOfKilledServersOnly) {
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> live = ShmRingServer::start(dir.path());
  ASSERT_TRUE(live.ok()) << live.status();
  // Killed servers' sockets: bound, then the process gone (closed without removing them).
  auto bound = [](const std::string& path) {
    const int s = listen_at(path);
    if (s >= 0) close(s);
    return s >= 0;
  };
  const std::string dead = absl::StrCat(dir.path(), "/tessera-", getpid(), "-dead.sock");
  const std::string old_binding = absl::StrCat(dir.path(), "/tessera-", getpid(), "-old.bind");
  const std::string new_binding = absl::StrCat(dir.path(), "/tessera-", getpid(), "-new.bind");
  ASSERT_TRUE(bound(dead) && bound(old_binding) && bound(new_binding));
  const timespec two_minutes_ago[2] = {absl::ToTimespec(absl::Now() - absl::Minutes(2)),
                                       absl::ToTimespec(absl::Now() - absl::Minutes(2))};
  ASSERT_EQ(utimensat(AT_FDCWD, old_binding.c_str(), two_minutes_ago, AT_SYMLINK_NOFOLLOW), 0);
  const std::string file = absl::StrCat(dir.path(), "/tessera-", getpid(), "-file.sock");
  const int made = open(file.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  ASSERT_GE(made, 0);
  close(made);
  std::string others;  // another uid's dead socket (root can make one)
  if (geteuid() == 0) {
    others = absl::StrCat(dir.path(), "/tessera-", getpid(), "-others.sock");
    ASSERT_TRUE(bound(others));
    ASSERT_EQ(lchown(others.c_str(), 12345, 12345), 0);
  }

  absl::StatusOr<std::unique_ptr<ShmRingServer>> next = ShmRingServer::start(dir.path());
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_NE(access(dead.c_str(), F_OK), 0) << dead << " was left";
  EXPECT_NE(access(old_binding.c_str(), F_OK), 0) << old_binding << " was left";
  EXPECT_EQ(access(new_binding.c_str(), F_OK), 0) << "a binding of a minute or less was removed";
  EXPECT_EQ(access(file.c_str(), F_OK), 0) << "a file that is no socket was removed";
  if (!others.empty()) {
    EXPECT_EQ(access(others.c_str(), F_OK), 0) << "another uid's socket was removed";
  }
  EXPECT_EQ(access((*live)->path().c_str(), F_OK), 0) << "a live server's socket was removed";
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 11);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*live)->offer(**ring).ok());
  EXPECT_TRUE(ShmRing::fetch((*live)->path(), dir.path(), 11, absl::Now() + absl::Seconds(30)).ok());
  EXPECT_EQ((*live)->refused(), 0) << "the probe counted as a refusal";
}

// Bounded: a connection beyond ShmRingServer::kMaxPending whose token is not there is answered
// kBusy (no fd) and closed at once, and those that send no token are closed at
// kHandoverTimeout; a fetch (its token sent as it connects) still gets its ring while they wait
// (before, it was closed as surplus, which its fetch took for a refused token); a withdrawn
// ring is refused.
TEST(ShmRingServer, SilentAndSurplusConnectionsAreClosedAndAWithdrawnRingRefused) {
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start(dir.path());
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> silent;
  for (int i = 0; i < ShmRingServer::kMaxPending; ++i) {
    silent.push_back(connect_to((*server)->path()));
    ASSERT_GE(silent.back(), 0);
  }
  // The server takes them in order: this one finds the others pending, and is told busy while
  // they still wait (a deadline would have closed the first of them no later).
  const int surplus = connect_to((*server)->path());
  ASSERT_GE(surplus, 0);
  pollfd answered{surplus, POLLIN, 0};
  ASSERT_EQ(poll(&answered, 1, 30'000), 1) << "a connection past the limit was kept";
  char byte = 0;
  EXPECT_EQ(recv(surplus, &byte, 1, MSG_DONTWAIT), 1);
  EXPECT_EQ(byte, ShmRingServer::kBusy);
  EXPECT_TRUE(closed_within(surplus, absl::Seconds(30)));
  EXPECT_FALSE(closed_within(silent[0], absl::ZeroDuration())) << "closed at its deadline, not as surplus";
  close(surplus);
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 5);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  // (Busy if the server took the connection before its token: asked again after a pause, as a
  // transport backs off, for at most 2 s of the silent connections' 5 s; a loaded machine may
  // take the connection before its token many times.)
  absl::StatusOr<std::unique_ptr<ShmRing>> fetched = absl::UnavailableError("not asked");
  const absl::Time ask_until = absl::Now() + absl::Seconds(2);
  for (int k = 0; absl::IsUnavailable(fetched.status()) && (k == 0 || absl::Now() < ask_until); ++k) {
    if (k > 0) absl::SleepFor(absl::Milliseconds(5));  // backoff between tries, not a wait for an event
    fetched = ShmRing::fetch((*server)->path(), dir.path(), 5, absl::Now() + absl::Seconds(30));
  }
  EXPECT_TRUE(fetched.ok()) << fetched.status();
  EXPECT_FALSE(closed_within(silent[0], absl::ZeroDuration())) << "the fetch did not come while they waited";
  for (int s : silent) {
    EXPECT_TRUE(closed_within(s, ShmRingServer::kHandoverTimeout + absl::Seconds(30)));
    close(s);
  }
  EXPECT_EQ((*server)->refused(), ShmRingServer::kMaxPending);
  EXPECT_GE((*server)->busy(), 1);

  ring = ShmRing::create(ShmRing::kMinBytes, 5);  // (the server took the first one's memfd, and handed it over)
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  (*server)->withdraw(5);
  absl::StatusOr<std::unique_ptr<ShmRing>> withdrawn =
      ShmRing::fetch((*server)->path(), dir.path(), 5, absl::Now() + absl::Seconds(30));
  EXPECT_EQ(withdrawn.status().code(), absl::StatusCode::kFailedPrecondition) << withdrawn.status();
}

// The socket path comes from the wire: fetch takes only one directly in its own servers'
// directory (before, any absolute path), before it connects anywhere; a busy answer (kBusy, no
// fd) is UNAVAILABLE (before, "refused the token"); and a fetch from a server that never
// answers stops within 100 ms of being cancelled (before, only at its deadline, 5 s in a
// transport, which its destructor waited for).
TEST(ShmRingServer, FetchTakesOnlyItsDirectorySaysBusyAndStopsWhenCancelled) {
  SocketDir dir, elsewhere;
  ASSERT_FALSE(dir.path().empty() || elsewhere.path().empty());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start(elsewhere.path());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 8);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  absl::StatusOr<std::unique_ptr<ShmRing>> outside =
      ShmRing::fetch((*server)->path(), dir.path(), 8, absl::Now() + absl::Seconds(30));
  EXPECT_EQ(outside.status().code(), absl::StatusCode::kFailedPrecondition) << outside.status();
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr(absl::StrCat("not directly in ", dir.path())));
  EXPECT_EQ((*server)->handed_over(), 0);
  EXPECT_FALSE((*ring)->attached());

  // A server that answers busy.
  const std::string busy_path = absl::StrCat(dir.path(), "/tessera-", getpid(), "-busy.sock");
  const int busy = listen_at(busy_path);
  ASSERT_GE(busy, 0);
  std::thread answer([busy] {
    const int connection = accept_within(busy, absl::Seconds(30));
    if (connection < 0) return;
    (void)!send(connection, &ShmRingServer::kBusy, 1, MSG_NOSIGNAL);
    close(connection);
  });
  absl::StatusOr<std::unique_ptr<ShmRing>> told_busy =
      ShmRing::fetch(busy_path, dir.path(), 8, absl::Now() + absl::Seconds(30));
  answer.join();
  close(busy);
  EXPECT_EQ(told_busy.status().code(), absl::StatusCode::kUnavailable) << told_busy.status();
  EXPECT_THAT(std::string(told_busy.status().message()), HasSubstr("busy"));

  // A server that never answers (the connection waits in its backlog): cancelled at the third
  // time fetch asks, long before the deadline.
  const std::string mute_path = absl::StrCat(dir.path(), "/tessera-", getpid(), "-mute.sock");
  const int mute = listen_at(mute_path);
  ASSERT_GE(mute, 0);
  int asked = 0;
  const absl::Time start = absl::Now();
  absl::StatusOr<std::unique_ptr<ShmRing>> cancelled =
      ShmRing::fetch(mute_path, dir.path(), 8, start + absl::Seconds(20), [&] { return ++asked >= 3; });
  EXPECT_EQ(cancelled.status().code(), absl::StatusCode::kCancelled) << cancelled.status();
  EXPECT_EQ(asked, 3);
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  close(mute);
}

// A ring server of another uid (here nobody, 65534: a child of this test that dropped root
// before it listened) is refused as soon as its credentials are seen (SO_PEERCRED),
// FAILED_PRECONDITION naming both uids; without the check the fetch sends its token and waits
// for the ring to its deadline. Changing uid needs root (the CI runs as root).
TEST(ShmRingServer, AServerOfAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "starting a server of another uid needs root";
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  ASSERT_EQ(chmod(dir.path().c_str(), 0777), 0);  // the other uid creates its socket there
  const std::string path = absl::StrCat(dir.path(), "/tessera-", getpid(), "-other.sock");
  int ready[2], hold[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  ASSERT_EQ(pipe2(hold, O_CLOEXEC), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // only async-signal-safe calls from here
    close(ready[0]);
    close(hold[1]);
    const bool dropped = setresgid(65534, 65534, 65534) == 0 && setresuid(65534, 65534, 65534) == 0;
    const char listening = dropped && listen_at(path) >= 0 ? 1 : 0;
    (void)!write(ready[1], &listening, 1);
    char ignored;
    (void)!read(hold[0], &ignored, 1);  // until the test is done with the socket
    _exit(0);
  }
  close(ready[1]);
  close(hold[0]);
  char listening = 0;
  const bool told = read(ready[0], &listening, 1) == 1;
  close(ready[0]);
  absl::StatusOr<std::unique_ptr<ShmRing>> fetched;
  if (told && listening == 1) fetched = ShmRing::fetch(path, dir.path(), 8, absl::Now() + absl::Seconds(5));
  close(hold[1]);
  int child_status = 0;
  ASSERT_EQ(waitpid(child, &child_status, 0), child);
  ASSERT_TRUE(told && listening == 1) << "the child could not listen as uid 65534";
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kFailedPrecondition) << fetched.status();
  EXPECT_THAT(std::string(fetched.status().message()),
              HasSubstr(" runs as uid 65534, not this process's 0: only a server of the same uid is taken"));
}

// A server that hands over two descriptors with its ring byte: no ring, and fetch keeps neither
// (it kept both open before: a control buffer of one descriptor's space holds two, and only a
// message of exactly one was looked at).
TEST(ShmRingServer, AnAnswerCarryingSeveralDescriptorsGivesNoRingAndLeavesNoneOpen) {
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string path = absl::StrCat(dir.path(), "/tessera-", getpid(), "-two.sock");
  const int listener = listen_at(path);
  ASSERT_GE(listener, 0);
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 9);
  ASSERT_TRUE(ring.ok()) << ring.status();
  const int second = dup((*ring)->fd());
  ASSERT_GE(second, 0);
  const int before = open_fds();
  std::thread answer([&] {
    const int connection = accept_within(listener, absl::Seconds(30));
    if (connection < 0) return;
    uint64_t token = 0;
    (void)!recv(connection, &token, sizeof token, MSG_WAITALL);
    const int fds[2] = {(*ring)->fd(), second};
    char byte = ShmRingServer::kRing;
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof fds)] = {};
    msghdr header{};
    header.msg_iov = &iov;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof fds);
    std::memcpy(CMSG_DATA(c), fds, sizeof fds);
    (void)!sendmsg(connection, &header, MSG_NOSIGNAL);
    close(connection);
  });
  absl::StatusOr<std::unique_ptr<ShmRing>> fetched =
      ShmRing::fetch(path, dir.path(), 9, absl::Now() + absl::Seconds(30));
  answer.join();
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kFailedPrecondition) << fetched.status();
  EXPECT_EQ(open_fds(), before);  // the connection's, the listener's and both received are closed
  close(second);
  close(listener);
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

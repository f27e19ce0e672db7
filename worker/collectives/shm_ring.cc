#include "worker/collectives/shm_ring.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "core/run_tag.h"  // random_run_tag

namespace tessera {
namespace {

constexpr uint64_t kMagic = 0x32474e4952534554;  // "TESRING2": records carry the run tag
constexpr int64_t kRecordBytes = 32;             // Record, as laid out in the ring

int64_t padded(int64_t n) { return (n + 7) / 8 * 8; }

// Sleeps while *word == expected, until `until` (a shared futex: the word lives in a segment
// several processes map).
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected, absl::Time until) {
  const absl::Duration left = until - absl::Now();
  if (left <= absl::ZeroDuration()) return;
  const timespec timeout = absl::ToTimespec(std::min(left, absl::Seconds(3600)));
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// A ring server's socket: <dir>/tessera-<pid>-<random>.sock (.bind until it listens).
constexpr char kSocketPrefix[] = "tessera-";
constexpr absl::string_view kSocketSuffix = ".sock";
constexpr absl::string_view kBindingSuffix = ".bind";

// Whether `file` (a name in a directory) is tessera-...<suffix>.
bool has_name(absl::string_view file, absl::string_view suffix) {
  return file.rfind(kSocketPrefix, 0) == 0 && file.size() > sizeof kSocketPrefix - 1 + suffix.size() &&
         file.substr(file.size() - suffix.size()) == suffix;
}

// Whether `file` (a name in a directory) is a ring server's socket's.
bool is_socket_name(absl::string_view file) { return has_name(file, kSocketSuffix); }

// Ring servers' directory `dir` as the prefix of their sockets' paths: with one '/' at its end
// ("/dev/shm", "/dev/shm/" and "/dev/shm//" are "/dev/shm/"; "/" and "" are "/"). start makes
// its socket's path with it, and fetch takes only a path that starts with it and has no other
// '/' after it.
std::string socket_prefix(absl::string_view dir) {
  while (!dir.empty() && dir.back() == '/') dir.remove_suffix(1);
  return absl::StrCat(dir, "/");
}

// How long fetch waits at a time before it asks whether it is cancelled.
constexpr int kFetchSliceMs = 100;

// The address of the Unix socket at `path`; false if the path is too long for one.
bool unix_address(const std::string& path, sockaddr_un* address) {
  *address = sockaddr_un{};
  if (path.size() >= sizeof address->sun_path) return false;
  address->sun_family = AF_UNIX;
  std::memcpy(address->sun_path, path.data(), path.size());
  return true;
}

// One byte with room for one fd beside it (SCM_RIGHTS): what a ring server sends, and reads.
struct FdMessage {
  FdMessage() {
    header.msg_iov = &iov;
    header.msg_iovlen = 1;
    header.msg_control = control;
    header.msg_controllen = sizeof control;
  }
  FdMessage(const FdMessage&) = delete;  // header points into it
  FdMessage& operator=(const FdMessage&) = delete;

  char byte = 1;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr header{};
};

// Milliseconds from now until `until` for poll: 0 when past, at most a minute (the caller
// loops and looks at the clock again).
int poll_timeout(absl::Time until) {
  const absl::Duration left = until - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(absl::ToInt64Milliseconds(std::min(left, absl::Minutes(1)))) + 1;
}

}  // namespace

// In the segment. head and tail count bytes ever written and consumed; each moves on one
// side only. data_seq and space_seq are the futex words, bumped after every write and
// consume.
struct ShmRing::Header {
  uint64_t magic;
  uint64_t token;
  int64_t capacity;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> closed;
  alignas(64) std::atomic<uint64_t> head;
  std::atomic<uint32_t> data_seq;
  alignas(64) std::atomic<uint64_t> tail;
  std::atomic<uint32_t> space_seq;
};
static_assert(sizeof(ShmRing::Record) == kRecordBytes, "the ring's record layout");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "atomics in shared memory must be lock-free");

ShmRing::ShmRing(int fd, bool creator, Header* header, int64_t capacity)
    : fd_(fd),
      creator_(creator),
      header_(header),
      data_(reinterpret_cast<std::byte*>(header) + kHeaderBytes),
      capacity_(capacity) {}

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::create(int64_t capacity, uint64_t token) {
  if (capacity < kMinBytes || capacity > kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory ring of ", capacity, " bytes: must be within [", kMinBytes, ", ", kMaxBytes, "]"));
  }
  // No name: a peer gets the ring only from this process (ShmRingServer), with its token.
  const int fd = memfd_create("tessera-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create for a shared-memory ring: ", std::strerror(errno)));
  const size_t size = static_cast<size_t>(kHeaderBytes + capacity);
  // tmpfs is sparse: pages are allocated as messages first touch them. Sealed at its size, so
  // that neither end can shrink it under the other's mapping (attach checks the seal).
  void* base = ftruncate(fd, static_cast<off_t>(size)) == 0 &&
                       fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0
                   ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  if (base == MAP_FAILED) {
    const int error = errno;
    close(fd);
    return absl::InternalError(
        absl::StrCat("mapping a shared-memory ring of ", size, " bytes: ", std::strerror(error)));
  }
  auto* header = new (base) Header{};
  header->token = token;
  header->capacity = capacity;
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kMagic;
  return std::unique_ptr<ShmRing>(new ShmRing(fd, /*creator=*/true, header, capacity));
}

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::attach(int fd, uint64_t token) {
  struct stat st;
  const int seals = fcntl(fd, F_GET_SEALS);  // EINVAL: not a memfd
  void* base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && seals >= 0 && (seals & F_SEAL_SHRINK) != 0 &&
      st.st_size >= kHeaderBytes + kMinBytes && st.st_size <= kHeaderBytes + kMaxBytes) {
    base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (base == MAP_FAILED) {
    return absl::FailedPreconditionError(absl::StrCat("shared-memory ring: the fd handed over is not a ring (",
                                                      seals < 0 ? "not a memfd" : "size not sealed or out of range",
                                                      ")"));
  }
  auto* header = static_cast<Header*>(base);
  if (header->magic != kMagic || header->token != token || header->capacity != st.st_size - kHeaderBytes) {
    munmap(base, static_cast<size_t>(st.st_size));
    return absl::FailedPreconditionError(
        "shared-memory ring: the memfd handed over is not the ring offered (magic, token or size differ)");
  }
  // The size mapped, not the header's again: the peer may have changed it since.
  return std::unique_ptr<ShmRing>(new ShmRing(-1, /*creator=*/false, header, st.st_size - kHeaderBytes));
}

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::fetch(const std::string& socket_path, const std::string& dir,
                                                        uint64_t token, absl::Time until,
                                                        const std::function<bool()>& cancelled) {
  sockaddr_un address;
  const size_t slash = socket_path.rfind('/');
  if (socket_path.empty() || socket_path[0] != '/' || !is_socket_name(socket_path.substr(slash + 1)) ||
      !unix_address(socket_path, &address)) {
    return absl::InvalidArgumentError(absl::StrCat("'", socket_path, "' is not a shared-memory ring server's socket"));
  }
  // The path comes from the wire: only a socket directly in our own servers' directory (its
  // exact prefix, so no "..", "." or "//" either).
  const std::string expected = socket_prefix(dir);
  if (absl::string_view(socket_path).substr(0, slash + 1) != expected) {
    return absl::FailedPreconditionError(absl::StrCat("shared-memory ring server socket ", socket_path,
                                                      ": not directly in ", expected,
                                                      ", the directory ring servers use here (no other is taken)"));
  }
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  absl::Cleanup closer = [s] { close(s); };
  // A Unix socket connects at once or not at all (EAGAIN: its backlog is full).
  if (connect(s, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    const int error = errno;
    const std::string what = absl::StrCat("shared-memory ring server ", socket_path, ": ", std::strerror(error));
    if (error == ENOENT || error == ECONNREFUSED) return absl::NotFoundError(what);
    if (error == EAGAIN) return absl::UnavailableError(what);
    return absl::FailedPreconditionError(what);
  }
  // Ours only: a server of another uid could hand us any memfd it likes.
  ucred peer{};
  socklen_t peer_bytes = sizeof peer;
  if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &peer, &peer_bytes) != 0 || peer.uid != geteuid()) {
    return absl::FailedPreconditionError(absl::StrCat("shared-memory ring server ", socket_path, " runs as uid ",
                                                      peer.uid, ", not this process's ", geteuid(),
                                                      ": only a server of the same uid is taken"));
  }
  if (send(s, &token, sizeof token, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof token)) {
    return absl::UnavailableError(
        absl::StrCat("shared-memory ring server ", socket_path, ": sending the token: ", std::strerror(errno)));
  }
  for (;;) {
    if (cancelled != nullptr && cancelled()) {
      return absl::CancelledError(absl::StrCat("fetching the ring from shared-memory ring server ", socket_path,
                                               ": stopped (the link or transport went)"));
    }
    pollfd readable{s, POLLIN, 0};
    const int ready = poll(&readable, 1, std::min(poll_timeout(until), kFetchSliceMs));
    if (ready < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("poll on ", socket_path, ": ", std::strerror(errno)));
    }
    if (ready > 0) break;
    if (absl::Now() >= until) {
      return absl::DeadlineExceededError(
          absl::StrCat("shared-memory ring server ", socket_path, " did not answer by the deadline"));
    }
  }
  FdMessage message;
  const ssize_t n = recvmsg(s, &message.header, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  // Every descriptor the message carried is ours once received: the ring is its only one, and
  // any other (a server sending several) is closed, never kept open.
  std::vector<int> received;
  for (cmsghdr* c = CMSG_FIRSTHDR(&message.header); c != nullptr; c = CMSG_NXTHDR(&message.header, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS || c->cmsg_len < CMSG_LEN(0)) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int one = -1;
      std::memcpy(&one, CMSG_DATA(c) + i * sizeof(int), sizeof one);
      received.push_back(one);
    }
  }
  int fd = -1;
  if (received.size() == 1) {
    fd = received[0];
  } else {
    for (int extra : received) close(extra);
  }
  if (n == 1 && message.byte == ShmRingServer::kBusy && received.empty()) {
    return absl::UnavailableError(absl::StrCat("shared-memory ring server ", socket_path, " is busy (",
                                               ShmRingServer::kMaxPending, " connections wait for it): try again"));
  }
  if (n != 1 || message.byte != ShmRingServer::kRing || fd < 0 || (message.header.msg_flags & MSG_CTRUNC) != 0) {
    if (fd >= 0) close(fd);
    return absl::FailedPreconditionError(absl::StrCat("shared-memory ring server ", socket_path,
                                                      " refused the token (no ring offered with it, or taken)"));
  }
  return attach(fd, token);
}

ShmRing::~ShmRing() {
  if (creator_) {
    header_->closed.store(1, std::memory_order_release);
    header_->data_seq.fetch_add(1, std::memory_order_release);
    futex_wake(&header_->data_seq);
  }
  if (fd_ >= 0) close(fd_);
  munmap(header_, static_cast<size_t>(kHeaderBytes + capacity_));
}

int ShmRing::release_fd() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

uint64_t ShmRing::token() const { return header_->token; }

bool ShmRing::fits(int64_t bytes) const { return bytes >= 0 && padded(kRecordBytes + bytes) <= capacity_ / 2; }

void ShmRing::mark_attached() { header_->attached.store(1, std::memory_order_release); }

bool ShmRing::attached() const { return header_->attached.load(std::memory_order_acquire) != 0; }

void ShmRing::copy_in(uint64_t at, const void* src, int64_t n) {
  if (n == 0) return;
  const int64_t offset = static_cast<int64_t>(at % static_cast<uint64_t>(capacity_));
  const int64_t first = std::min(n, capacity_ - offset);
  std::memcpy(data_ + offset, src, static_cast<size_t>(first));
  if (first < n) std::memcpy(data_, static_cast<const std::byte*>(src) + first, static_cast<size_t>(n - first));
}

void ShmRing::copy_out(uint64_t at, void* dst, int64_t n) const {
  if (n == 0) return;
  const int64_t offset = static_cast<int64_t>(at % static_cast<uint64_t>(capacity_));
  const int64_t first = std::min(n, capacity_ - offset);
  std::memcpy(dst, data_ + offset, static_cast<size_t>(first));
  if (first < n) std::memcpy(static_cast<std::byte*>(dst) + first, data_, static_cast<size_t>(n - first));
}

bool ShmRing::write(const Record& record, const std::byte* data, absl::Time until) {
  const int64_t need = padded(kRecordBytes + record.bytes);
  const uint64_t head = header_->head.load(std::memory_order_relaxed);  // ours alone
  for (;;) {
    const uint32_t seq = header_->space_seq.load(std::memory_order_acquire);
    const uint64_t tail = header_->tail.load(std::memory_order_acquire);
    if (capacity_ - static_cast<int64_t>(head - tail) >= need) break;
    if (absl::Now() >= until) return false;
    futex_wait(&header_->space_seq, seq, until);
  }
  copy_in(head, &record, kRecordBytes);
  copy_in(head + kRecordBytes, data, record.bytes);
  header_->head.store(head + static_cast<uint64_t>(need), std::memory_order_release);
  header_->data_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&header_->data_seq);
  return true;
}

absl::StatusOr<bool> ShmRing::next(Record* record, absl::Time until) {
  const uint64_t tail = header_->tail.load(std::memory_order_relaxed);  // ours alone
  const uint32_t seq = header_->data_seq.load(std::memory_order_acquire);
  uint64_t head = header_->head.load(std::memory_order_acquire);
  if (head == tail) {
    futex_wait(&header_->data_seq, seq, until);
    head = header_->head.load(std::memory_order_acquire);
    if (head == tail) return false;
  }
  const int64_t available = static_cast<int64_t>(head - tail);
  copy_out(tail, record, kRecordBytes);
  // (The size is the peer's: compared with what was written before it is added to, which a
  // size near 2^63 would overflow.)
  if (available > capacity_ || available < kRecordBytes || record->bytes < 0 ||
      record->bytes > available - kRecordBytes || padded(kRecordBytes + record->bytes) > available) {
    return absl::DataLossError(
        absl::StrCat("shared-memory ring: a message of ", record->bytes, " bytes with ", available, " bytes written"));
  }
  return true;
}

void ShmRing::copy_payload(const Record& record, std::byte* dst) const {
  copy_out(header_->tail.load(std::memory_order_relaxed) + kRecordBytes, dst, record.bytes);
}

void ShmRing::consume(const Record& record) {
  const uint64_t tail = header_->tail.load(std::memory_order_relaxed);
  header_->tail.store(tail + static_cast<uint64_t>(padded(kRecordBytes + record.bytes)), std::memory_order_release);
  header_->space_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&header_->space_seq);
}

bool ShmRing::drained_and_closed() const {
  return header_->closed.load(std::memory_order_acquire) != 0 &&
         header_->head.load(std::memory_order_acquire) == header_->tail.load(std::memory_order_relaxed);
}

void ShmRing::wake_reader() {
  header_->data_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&header_->data_seq);
}

void ShmRing::wake_writer() {
  header_->space_seq.fetch_add(1, std::memory_order_release);
  futex_wake(&header_->space_seq);
}

namespace {

// Removes the sockets of this uid's ring servers in `dir` that nobody listens on any more (their
// process was killed, so its destructor did not remove its socket): a connection to them is
// refused. A server listens before its socket gets its .sock name (start), so none is taken for
// stale while it starts; a .bind name older than a minute is a server killed between its bind
// and its rename (which follow each other at once). Only sockets (lstat: not what a link points
// to) of this uid are touched; at most 1024 of them are looked at.
void remove_stale_sockets(const std::string& dir) {
  DIR* entries = opendir(dir.c_str());
  if (entries == nullptr) return;
  const absl::Time now = absl::Now();
  int looked = 0;
  while (dirent* entry = readdir(entries)) {
    const bool binding = has_name(entry->d_name, kBindingSuffix);
    if (!binding && !is_socket_name(entry->d_name)) continue;
    if (++looked > 1024) break;
    const std::string path = absl::StrCat(socket_prefix(dir), entry->d_name);
    struct stat st;
    if (lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != geteuid()) continue;
    if (binding) {
      if (now - absl::TimeFromTimespec(st.st_mtim) > absl::Minutes(1)) unlink(path.c_str());
      continue;
    }
    sockaddr_un address;
    if (!unix_address(path, &address)) continue;
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (s < 0) break;
    // A live server takes the connection and closes it when it ends at once (no token).
    if (connect(s, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 && errno == ECONNREFUSED) {
      unlink(path.c_str());
    }
    close(s);
  }
  closedir(entries);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ShmRingServer>> ShmRingServer::start(const std::string& dir) {
  remove_stale_sockets(dir);
  // (64 random bits: the name need not be secret, only unlike another server's of this pid.)
  const std::string stem = absl::StrCat(socket_prefix(dir), kSocketPrefix, getpid(), "-", absl::Hex(random_run_tag()));
  const std::string path = absl::StrCat(stem, kSocketSuffix);
  const std::string binding = absl::StrCat(stem, kBindingSuffix);  // until it listens (remove_stale_sockets)
  sockaddr_un address;
  if (path.size() != binding.size() || !unix_address(binding, &address)) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory ring server: socket path ", path, " is longer than ",
                                                   sizeof address.sun_path - 1, " bytes"));
  }
  const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listener < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  // 0600 from the start: Linux gives the file bind creates the socket's own mode (less the
  // umask, which we do not change: other threads create files too); the chmod after is for
  // kernels that do not.
  if (fchmod(listener, 0600) != 0 || bind(listener, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) {
    const int error = errno;
    close(listener);
    return absl::InternalError(
        absl::StrCat("shared-memory ring server: binding ", binding, ": ", std::strerror(error)));
  }
  // (A bound socket keeps working under a new name: connections find it by its file.)
  if (chmod(binding.c_str(), 0600) != 0 || listen(listener, kMaxPending) != 0 ||
      rename(binding.c_str(), path.c_str()) != 0) {
    const int error = errno;
    close(listener);
    unlink(binding.c_str());
    return absl::InternalError(
        absl::StrCat("shared-memory ring server: listening on ", path, ": ", std::strerror(error)));
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const int error = errno;
    close(listener);
    unlink(path.c_str());
    return absl::InternalError(absl::StrCat("shared-memory ring server: eventfd: ", std::strerror(error)));
  }
  return std::unique_ptr<ShmRingServer>(new ShmRingServer(path, listener, wake));
}

ShmRingServer::ShmRingServer(std::string path, int listener, int wake)
    : path_(std::move(path)), listener_(listener), wake_(wake), thread_([this] { run(); }) {}

ShmRingServer::~ShmRingServer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  const uint64_t one = 1;
  (void)!write(wake_, &one, sizeof one);
  thread_.join();
  if (listener_ >= 0) {  // (else run() failed and removed it)
    unlink(path_.c_str());
    close(listener_);
  }
  close(wake_);
  absl::MutexLock lock(&mu_);  // (run() is over: for the annotations)
  for (const auto& [token, fd] : offers_) close(fd);
}

absl::Status ShmRingServer::offer(ShmRing& ring) {
  // The server's is the ring's only descriptor (none once handed over): a link offers a ring to
  // every peer it sends to, remote ones too, which never fetch it.
  const int fd = ring.release_fd();
  if (fd < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shared-memory ring server ", path_, ": the ring has no memfd to offer (offered already, or a reader's)"));
  }
  absl::MutexLock lock(&mu_);
  auto [it, added] = offers_.emplace(ring.token(), fd);
  if (!added) {
    close(it->second);
    it->second = fd;
  }
  return absl::OkStatus();
}

void ShmRingServer::withdraw(uint64_t token) {
  absl::MutexLock lock(&mu_);
  auto it = offers_.find(token);
  if (it == offers_.end()) return;
  close(it->second);
  offers_.erase(it);
}

int64_t ShmRingServer::handed_over() const {
  absl::MutexLock lock(&mu_);
  return handed_over_;
}

int64_t ShmRingServer::refused() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

int64_t ShmRingServer::busy() const {
  absl::MutexLock lock(&mu_);
  return busy_;
}

bool ShmRingServer::read_token(int connection, uint64_t* token, size_t* got) {
  const ssize_t n = recv(connection, reinterpret_cast<char*>(token) + *got, sizeof *token - *got, MSG_DONTWAIT);
  if (n > 0) {
    *got += static_cast<size_t>(n);
    if (*got < sizeof *token) return false;
    answer(connection, *token);
    return true;
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  // It went. Having sent nothing it asked for nothing (another server's probe for stale sockets).
  if (*got > 0) {
    absl::MutexLock lock(&mu_);
    ++refused_;
  }
  close(connection);
  return true;
}

void ShmRingServer::answer(int connection, uint64_t token) {
  int fd = -1;
  {
    absl::MutexLock lock(&mu_);
    auto it = offers_.find(token);
    if (it == offers_.end()) {
      ++refused_;
    } else {
      fd = it->second;  // once: the token is spent
      offers_.erase(it);
    }
  }
  if (fd >= 0) {
    FdMessage message;
    message.byte = kRing;
    cmsghdr* c = CMSG_FIRSTHDR(&message.header);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    // One byte into an empty socket buffer: never waits. Counted before the peer can see it.
    absl::MutexLock lock(&mu_);
    ++(sendmsg(connection, &message.header, MSG_NOSIGNAL | MSG_DONTWAIT) == 1 ? handed_over_ : refused_);
    close(fd);
  }
  close(connection);  // without a ring: the peer reads the end, a refusal
}

void ShmRingServer::run() {
  struct Pending {
    int fd;
    absl::Time deadline;
    uint64_t token = 0;
    size_t got = 0;  // bytes of the token read so far
  };
  std::vector<Pending> pending;
  std::vector<pollfd> polled;
  absl::Time accept_again = absl::InfinitePast();  // after accept ran out of fds
  int failed = 0;                                  // poll's errno, when it failed
  for (;;) {
    absl::Time next = absl::Now() + absl::Minutes(1);  // nothing pending: the wake-up ends the wait
    const bool accepting = absl::Now() >= accept_again;
    if (!accepting) next = accept_again;
    // (A negative fd is not polled.)
    polled.assign({{wake_, POLLIN, 0}, {accepting ? listener_ : -1, POLLIN, 0}});
    for (const Pending& p : pending) {
      polled.push_back({p.fd, POLLIN, 0});
      next = std::min(next, p.deadline);
    }
    if (poll(polled.data(), polled.size(), poll_timeout(next)) < 0 && errno != EINTR) {
      failed = errno;
      break;
    }
    {
      absl::MutexLock lock(&mu_);
      if (stop_) break;
    }
    // Read each pending connection's token (polled[i + 2] is pending[i]); answer, or drop it
    // at its end or deadline.
    const absl::Time now = absl::Now();
    std::vector<Pending> still;
    for (size_t i = 0; i < pending.size(); ++i) {
      Pending& p = pending[i];
      if (polled[i + 2].revents != 0 && read_token(p.fd, &p.token, &p.got)) continue;
      if (now >= p.deadline) {
        {
          absl::MutexLock lock(&mu_);
          ++refused_;
        }
        close(p.fd);
        continue;
      }
      still.push_back(p);
    }
    pending.swap(still);
    if (polled[1].revents != 0) {
      for (;;) {
        const int connection = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (connection < 0) {
          // EAGAIN: none left. Out of fds (EMFILE, ENFILE): the connection stays queued and the
          // listener readable; wait a second rather than spin on it.
          if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            accept_again = now + absl::Seconds(1);
          }
          break;
        }
        // Its token is usually there already (the client sends it as it connects).
        Pending p{connection, now + kHandoverTimeout};
        if (read_token(p.fd, &p.token, &p.got)) continue;
        if (pending.size() >= static_cast<size_t>(kMaxPending)) {
          // Busy, not a refusal: the client may try again (one byte into an empty buffer).
          (void)!send(connection, &kBusy, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
          {
            absl::MutexLock lock(&mu_);
            ++busy_;
          }
          close(connection);
          continue;
        }
        pending.push_back(p);
      }
    }
  }
  for (const Pending& p : pending) close(p.fd);
  if (failed != 0) {
    // Nobody answers here any more: no socket that takes connections and leaves them waiting.
    std::fprintf(stderr, "tessera-worker: shared-memory ring server %s stopped: poll: %s\n", path_.c_str(),
                 std::strerror(failed));
    unlink(path_.c_str());
    close(listener_);
    listener_ = -1;
  }
}

}  // namespace tessera

#include "core/shm_transfer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "core/status.h"

namespace tessera {
namespace {

constexpr uint64_t kMagic = 0x31524658464d5354;        // "TSMFXFR1"
constexpr uint64_t kDirectMagic = 0x31524944464d5354;  // "TSMFDIR1": the block is in the process's memory
constexpr char kMemfdName[] = "tessera-transfer";
// What seal() adds and what map_block requires: the file can neither change nor shrink under a
// mapping (no SIGBUS), nor grow.
constexpr int kSeals = F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW;

// The header page's first bytes.
struct SegmentHeader {
  uint64_t magic;
  uint64_t token;
  int64_t bytes;
  uint64_t address;  // kDirectMagic: where the block is in the owner's memory; else 0
};

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string namespace_inode(const char* path) {
  struct stat st;
  return stat(path, &st) == 0 ? std::to_string(st.st_ino) : "?";
}

// pread/pwrite of all `n` bytes at `offset` (the kernel moves at most ~2 GiB a call): the
// count moved before the file ended (short of n: it was shrunk), or -errno.
template <typename Buffer, typename Io>
int64_t move_all(int fd, Buffer buffer, int64_t n, int64_t offset, Io io) {
  int64_t done = 0;
  while (done < n) {
    const ssize_t got = io(fd, buffer + done, static_cast<size_t>(std::min<int64_t>(n - done, int64_t{1} << 30)),
                           static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return -errno;
    if (got == 0) break;
    done += got;
  }
  return done;
}

// The processes holding a lock on `fd`'s file, as /proc/locks names them ("process 123",
// "processes 123, 456"), or "a process" if none can be told. Only for messages.
std::string lock_holders(int fd) {
  struct stat st;
  if (fstat(fd, &st) != 0) return "a process";
  // "1: FLOCK  ADVISORY  WRITE 1234 00:01:5678 0 EOF"; a waiter's line has "->" after "1:".
  const std::string file = absl::StrCat(":", st.st_ino);
  std::ifstream in("/proc/locks");
  std::vector<std::string> pids;
  for (std::string line; std::getline(in, line);) {
    const std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() < 6 || fields[1] == "->" || !absl::EndsWith(fields[5], file)) continue;
    pids.emplace_back(fields[4]);
  }
  if (pids.empty()) return "a process";
  return absl::StrCat(pids.size() == 1 ? "process " : "processes ", absl::StrJoin(pids, ", "));
}

absl::Status io_status(const char* what, int64_t moved, int64_t n) {
  if (moved < 0) {
    return absl::InternalError(
        absl::StrCat("shared-memory transfer: ", what, " of ", n, " bytes: ", std::strerror(static_cast<int>(-moved))));
  }
  if (moved < n) {
    return absl::DataLossError(absl::StrCat("shared-memory transfer: the segment ended after ", moved, " of ", n,
                                            " bytes (", what, "; shrunk meanwhile)"));
  }
  return absl::OkStatus();
}

// Whether the link `path` (/proc/<pid>/fd/<fd>) points at a memfd made by ShmSegment::create.
bool is_transfer_memfd(const std::string& path) {
  char target[256] = {};
  const ssize_t n = readlink(path.c_str(), target, sizeof target - 1);
  const std::string expected = absl::StrCat("/memfd:", kMemfdName, " ");  // " (deleted)" follows
  return n >= 0 && absl::string_view(target, static_cast<size_t>(n)).substr(0, expected.size()) == expected;
}

}  // namespace

std::string shm_host_identity(bool pid_namespace) {
  std::string id =
      absl::StrCat(read_first_line("/proc/sys/kernel/random/boot_id"), "/ipc:", namespace_inode("/proc/self/ns/ipc"),
                   "/net:", namespace_inode("/proc/self/ns/net"));
  if (pid_namespace) absl::StrAppend(&id, "/pid:", namespace_inode("/proc/self/ns/pid"));
  return id;
}

std::string shm_transfer_host() { return shm_host_identity(true); }

absl::StatusOr<ShmSegment> ShmSegment::create(int64_t bytes) {
  if (bytes < 0 || bytes > kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory transfer of ", bytes, " bytes: must be within [0, ", kMaxBytes, "]"));
  }
  const int fd = memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create: ", std::strerror(errno)));
  ShmSegment segment(fd, 0, bytes);
  // tmpfs is sparse: the block's pages are allocated as they are written.
  if (ftruncate(fd, static_cast<off_t>(kDataOffset + bytes)) != 0) {
    return absl::InternalError(absl::StrCat("shared-memory transfer: sizing a memfd to ", kDataOffset + bytes,
                                            " bytes: ", std::strerror(errno)));
  }
  TESSERA_RETURN_IF_ERROR(segment.reuse(bytes));
  return segment;
}

absl::StatusOr<ShmSegment> ShmSegment::create_direct(const std::byte* data, int64_t bytes) {
  if (data == nullptr || bytes <= 0 || bytes > kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory transfer naming ", bytes, " bytes of memory: must be within [1, ", kMaxBytes, "]"));
  }
  TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, create(0));  // the header page alone
  segment.bytes_ = bytes;
  segment.capacity_ = 0;
  segment.address_ = reinterpret_cast<uint64_t>(data);
  const SegmentHeader header{kDirectMagic, segment.token_, bytes, segment.address_};
  TESSERA_RETURN_IF_ERROR(io_status(
      "writing the header", move_all(segment.fd_, reinterpret_cast<const char*>(&header), sizeof header, 0, pwrite),
      sizeof header));
  return segment;
}

absl::Status ShmSegment::reuse(int64_t bytes) {
  if (direct()) {
    return absl::FailedPreconditionError("shared-memory transfer: a segment naming memory cannot be reused");
  }
  if (sealed_) {
    return absl::FailedPreconditionError("shared-memory transfer: a sealed segment cannot be reused");
  }
  if (bytes < 0 || bytes > capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory transfer: a block of ", bytes, " bytes in a segment of ", capacity_));
  }
  // A fresh token: a worker still holding the segment's last name cannot mistake it for this one.
  // From the kernel, not a thread_local engine: static TLS is carved from every thread's stack
  // (a 2.5 KiB mt19937_64 per thread once overflowed civetweb's 100 KiB threads; the daemons
  // now give those 1 MiB, core/metrics_server.cc, but a token needs no per-thread state).
  if (getrandom(&token_, sizeof token_, 0) != static_cast<ssize_t>(sizeof token_)) {
    return absl::InternalError(absl::StrCat("shared-memory transfer: getrandom: ", std::strerror(errno)));
  }
  bytes_ = bytes;
  const SegmentHeader header{kMagic, token_, bytes_, 0};
  return io_status("writing the header",
                   move_all(fd_, reinterpret_cast<const char*>(&header), sizeof header, 0, pwrite), sizeof header);
}

absl::StatusOr<ShmSegment> ShmSegment::open(int32_t pid, int32_t fd, uint64_t token, int64_t bytes, bool writable) {
  const std::string where = absl::StrCat("shared-memory segment of process ", pid, " fd ", fd);
  if (pid <= 0 || fd < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": no such process or fd"));
  if (bytes < 0 || bytes > kMaxBytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a block of ", bytes, " bytes"));
  }
  // The process itself, before its pid is used for anything (/proc, the caller's check, the
  // move): a pid names whichever process has it at the time, and may be reused meanwhile.
  // Raw: glibc 2.36 has no pidfd_open.
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  const int pidfd_error = pidfd < 0 ? errno : 0;
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  // Checked before opening too: opening a device or a FIFO can have effects of its own.
  if (!is_transfer_memfd(path)) {
    if (pidfd >= 0) close(pidfd);
    if (access(path.c_str(), F_OK) != 0) {
      return absl::NotFoundError(absl::StrCat(where, ": cannot open ", path, " here: ", std::strerror(errno)));
    }
    return absl::InvalidArgumentError(absl::StrCat(where, " is not a Tessera transfer memfd"));
  }
  const int opened = ::open(path.c_str(), (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (opened < 0) {
    const int error = errno;
    if (pidfd >= 0) close(pidfd);
    return absl::NotFoundError(absl::StrCat(where, ": cannot open ", path, " here: ", std::strerror(error)));
  }
  ShmSegment segment(opened, token, bytes);
  segment.pid_ = pid;
  segment.pidfd_ = pidfd;  // closed with the segment
  // What we opened (not what the path named a moment before): a Tessera memfd, nothing else.
  if (!is_transfer_memfd(absl::StrCat("/proc/self/fd/", opened))) {
    return absl::InvalidArgumentError(absl::StrCat(where, " is not a Tessera transfer memfd"));
  }
  // The seals first: once sealed, the size and header checked below cannot change afterwards.
  const int seals = fcntl(opened, F_GET_SEALS);
  segment.sealed_ = seals >= 0 && (seals & kSeals) == kSeals;
  struct stat st;
  if (fstat(opened, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(where, " is not a regular file"));
  }
  if (st.st_size < kDataOffset) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " holds ", st.st_size, " bytes: too small for a header of ", kDataOffset));
  }
  SegmentHeader header{};
  const int64_t read = move_all(opened, reinterpret_cast<char*>(&header), sizeof header, 0, pread);
  if (absl::Status s = io_status("reading the header", read, sizeof header); !s.ok()) return s;
  if ((header.magic != kMagic && header.magic != kDirectMagic) || header.token != token) {
    return absl::InvalidArgumentError(absl::StrCat(where, " is not the segment named (magic or token differ)"));
  }
  if (header.magic == kDirectMagic) {
    // Its owner alone could write this header (the token proves the caller named its own
    // segment), so the memory it names is the owner's own block, read or written where it is.
    if (header.address == 0) return absl::InvalidArgumentError(absl::StrCat(where, " names memory at address 0"));
    if (pidfd < 0 && pidfd_error == ESRCH) {
      return absl::NotFoundError(absl::StrCat(where, ": the process had exited when its segment was opened"));
    }
    if (pidfd < 0) {
      // Without one, the process whose memory would be moved cannot be told from a later
      // holder of its pid: the client copies the block through a memfd instead.
      return absl::FailedPreconditionError(
          absl::StrCat(where, " names its process's memory, which is moved only ",
                       "through a pidfd of it: pidfd_open: ", std::strerror(pidfd_error)));
    }
    segment.address_ = header.address;
    segment.sealed_ = false;  // nothing to map
  } else if (st.st_size < kDataOffset + bytes) {
    return absl::InvalidArgumentError(absl::StrCat(where, " holds ", st.st_size, " bytes: too small for a header of ",
                                                   kDataOffset, " and a block of ", bytes));
  }
  if (header.bytes != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, " was made for a block of ", header.bytes, " bytes; this one has ", bytes));
  }
  if (!segment.direct() && segment.pidfd_ >= 0) close(std::exchange(segment.pidfd_, -1));  // no memory moved
  return segment;
}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      pid_(other.pid_),
      pidfd_(std::exchange(other.pidfd_, -1)),
      address_(other.address_),
      token_(other.token_),
      bytes_(other.bytes_),
      capacity_(other.capacity_),
      sealed_(other.sealed_) {}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    if (pidfd_ >= 0) close(pidfd_);
    fd_ = std::exchange(other.fd_, -1);
    pid_ = other.pid_;
    pidfd_ = std::exchange(other.pidfd_, -1);
    address_ = other.address_;
    token_ = other.token_;
    bytes_ = other.bytes_;
    capacity_ = other.capacity_;
    sealed_ = other.sealed_;
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  if (fd_ >= 0) close(fd_);
  if (pidfd_ >= 0) close(pidfd_);
}

absl::Status ShmSegment::write_block(const std::byte* src) {
  if (direct() && pid_ != 0) return write_process_memory(src);
  if (direct()) {
    return absl::FailedPreconditionError("shared-memory transfer: a segment naming memory holds no block to write");
  }
  return io_status("writing the block", move_all(fd_, reinterpret_cast<const char*>(src), bytes_, kDataOffset, pwrite),
                   bytes_);
}

absl::Status ShmSegment::read_block(std::byte* dst) const {
  if (direct() && pid_ != 0) return move_process_memory(dst, /*write=*/false);
  if (direct()) {
    return absl::FailedPreconditionError("shared-memory transfer: a segment naming memory holds no block to read");
  }
  return io_status("reading the block", move_all(fd_, reinterpret_cast<char*>(dst), bytes_, kDataOffset, pread),
                   bytes_);
}

absl::Status ShmSegment::write_process_memory(const std::byte* src) const {
  const std::string withdrawn =
      absl::StrCat("shared-memory transfer: writing ", bytes_, " bytes into process ", pid_, "'s memory at 0x",
                   absl::Hex(address_), ": the client withdrew the segment (its call ended), nothing written");
  // Never waits: the owner holds the lock only while it withdraws the segment.
  int locked;
  do {
    locked = flock(fd_, LOCK_EX | LOCK_NB);
  } while (locked != 0 && errno == EINTR);
  if (locked != 0) {
    if (errno == EWOULDBLOCK) return absl::AbortedError(withdrawn);
    return absl::InternalError(absl::StrCat("shared-memory transfer: locking a segment: ", std::strerror(errno)));
  }
  SegmentHeader header{};
  absl::Status status = io_status(
      "reading the header", move_all(fd_, reinterpret_cast<char*>(&header), sizeof header, 0, pread), sizeof header);
  if (status.ok() && (header.magic != kDirectMagic || header.token != token_ || header.address != address_ ||
                      header.bytes != bytes_)) {
    status = absl::AbortedError(withdrawn);
  }
  if (status.ok()) status = move_process_memory(const_cast<std::byte*>(src), /*write=*/true);
  flock(fd_, LOCK_UN);
  return status;
}

absl::Status ShmSegment::move_process_memory(std::byte* local, bool write) const {
  const std::string what =
      absl::StrCat("shared-memory transfer: ", write ? "writing " : "reading ", bytes_,
                   write ? " bytes into process " : " bytes of process ", pid_, "'s memory at 0x", absl::Hex(address_));
  // The pid is the process opened (not a later holder of the pid) if that process has not
  // exited by now (a zombie keeps its pid; poll says so as soon as it exits): checked here,
  // after the caller's checks that used the pid, and again once the bytes are moved.
  TESSERA_RETURN_IF_ERROR(same_process(what, /*began=*/false, write));
  int64_t done = 0;
  while (done < bytes_) {
    // The kernel moves at most ~2 GiB a call, and may stop short where the range's mapping ends.
    const size_t n = static_cast<size_t>(std::min<int64_t>(bytes_ - done, int64_t{1} << 30));
    const iovec here{local + done, n};
    const iovec there{reinterpret_cast<void*>(address_ + static_cast<uint64_t>(done)), n};
    const ssize_t got =
        write ? process_vm_writev(pid_, &here, 1, &there, 1, 0) : process_vm_readv(pid_, &here, 1, &there, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int error = got < 0 ? errno : EFAULT;
      const std::string message = absl::StrCat(what, ": ", std::strerror(error));
      if (error == EPERM || error == EACCES || error == ENOSYS) {
        return absl::FailedPreconditionError(absl::StrCat(message, " (this worker may not ", write ? "write" : "read",
                                                          " the client's memory: another user, or ptrace denied)"));
      }
      if (error == ESRCH) {
        TESSERA_RETURN_IF_ERROR(same_process(what, /*began=*/done > 0, write));
        return absl::NotFoundError(absl::StrCat(message, " (the process is gone)"));
      }
      if (error == EFAULT) {
        return absl::InvalidArgumentError(absl::StrCat(message, " (after ", done, " bytes: the range is not ",
                                                       write ? "writable" : "readable", " memory of the process)"));
      }
      return absl::InternalError(message);
    }
    done += got;
  }
  return same_process(what, /*began=*/true, write);
}

absl::Status ShmSegment::same_process(const std::string& what, bool began, bool write) const {
  if (pidfd_ < 0) {  // open() gives every direct segment one; a created one moves nothing
    return absl::FailedPreconditionError(absl::StrCat(what, ": no pidfd of the process"));
  }
  pollfd exited{pidfd_, POLLIN, 0};
  int ready;
  do {
    ready = poll(&exited, 1, 0);
  } while (ready < 0 && errno == EINTR);
  if (ready < 0) return absl::InternalError(absl::StrCat(what, ": polling its pidfd: ", std::strerror(errno)));
  if (ready == 0) return absl::OkStatus();
  const std::string reused = absl::StrCat(" (pid ", pid_, " may name another process now)");
  if (!began) {
    return absl::NotFoundError(absl::StrCat(what, ": the process exited after its segment was opened", reused,
                                            ": nothing ", write ? "written" : "read"));
  }
  return absl::NotFoundError(
      absl::StrCat(what, ": the process exited by the end of the transfer", reused, ": ",
                   write ? "the bytes written may have reached another process" : "the bytes read are not to be used"));
}

void ShmSegment::withdraw(absl::string_view who, absl::Duration warn_every,
                          const std::function<void(const std::string&)>& warn) {
  if (!direct() || pid_ != 0) {  // a caller's bug: no memory of this process to withdraw
    std::fprintf(stderr, "tessera: withdrawing a shared-memory segment (fd %d) that names no memory of this process\n",
                 fd_);
    std::abort();
  }
  const std::string what =
      absl::StrCat(who.empty() ? "" : absl::StrCat(who, ": "), "withdrawing the shared-memory segment (fd ", fd_,
                   ") naming ", bytes_, " bytes of this process's memory at 0x", absl::Hex(address_));
  // Nothing can be reported to a caller that may then reuse the memory a worker may write.
  auto die = [&what](const char* step, int error) {
    std::fprintf(stderr, "tessera: %s: %s: %s; aborting, since the memory could still be written by a worker\n",
                 what.c_str(), step, std::strerror(error));
    std::abort();
  };
  auto lock = [this](int how) {
    int locked;
    do {
      locked = flock(fd_, how);
    } while (locked != 0 && errno == EINTR);
    return locked == 0 ? 0 : errno;
  };
  int error = lock(LOCK_EX | LOCK_NB);
  if (error == EWOULDBLOCK) {
    // A worker holds the lock, writing: wait for it, saying so while it lasts.
    absl::Notification locked;
    std::thread warner([&] {
      const absl::Time start = absl::Now();
      while (!locked.WaitForNotificationWithTimeout(warn_every)) {
        const std::string message = absl::StrCat(
            what, ": ", lock_holders(fd_), " has held its lock for ",
            absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Seconds(1))),
            " (a write into that memory under way, or a worker stopped while writing); still waiting, since "
            "the memory may not be reused before it lets go");
        if (warn) {
          warn(message);
        } else {
          std::fprintf(stderr, "tessera client: %s\n", message.c_str());
        }
      }
    });
    error = lock(LOCK_EX);
    locked.Notify();
    warner.join();
  }
  if (error != 0) die("locking it", error);
  const SegmentHeader header{0, 0, 0, 0};
  const int64_t wrote = move_all(fd_, reinterpret_cast<const char*>(&header), sizeof header, 0, pwrite);
  if (wrote != sizeof header) die("overwriting its header", wrote < 0 ? static_cast<int>(-wrote) : EIO);
  flock(fd_, LOCK_UN);
}

absl::Status ShmSegment::seal() {
  if (direct()) {
    return absl::FailedPreconditionError("shared-memory transfer: a segment naming memory cannot be sealed");
  }
  if (ftruncate(fd_, static_cast<off_t>(kDataOffset + bytes_)) != 0) {
    return absl::InternalError(absl::StrCat("shared-memory transfer: trimming a segment to ", kDataOffset + bytes_,
                                            " bytes before sealing it: ", std::strerror(errno)));
  }
  capacity_ = bytes_;
  if (fcntl(fd_, F_ADD_SEALS, kSeals) != 0) {
    return absl::InternalError(absl::StrCat("shared-memory transfer: sealing a segment: ", std::strerror(errno)));
  }
  sealed_ = true;
  return absl::OkStatus();
}

absl::StatusOr<HostArray> ShmSegment::map_block(DType dtype, Shape shape) const {
  const int64_t nbytes = num_elements(shape) * dtype_size(dtype);
  if (nbytes != bytes_) {
    return absl::InvalidArgumentError(absl::StrCat("shared-memory transfer: ", dtype_name(dtype), " ",
                                                   shape_to_string(shape), " holds ", nbytes,
                                                   " bytes, the segment's block ", bytes_));
  }
  if (!sealed_) {
    return absl::FailedPreconditionError(
        "shared-memory transfer: only a segment sealed against writing, shrinking and growing can be mapped");
  }
  const long page = sysconf(_SC_PAGESIZE);
  if (page <= 0 || kDataOffset % page != 0) {
    return absl::FailedPreconditionError(absl::StrCat("shared-memory transfer: the page size ", page,
                                                      " does not divide the block's offset ", kDataOffset));
  }
  if (bytes_ == 0) return HostArray(dtype, std::move(shape));
  // Private and writable: a kernel that writes the buffer in place gets copies of the pages it
  // writes; the file, sealed, cannot change under the mapping, and cannot shrink (no SIGBUS).
  void* mapped = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_PRIVATE, fd_,
                      static_cast<off_t>(kDataOffset));
  if (mapped == MAP_FAILED) {
    const int error = errno;
    const std::string message =
        absl::StrCat("shared-memory transfer: mapping a block of ", bytes_, " bytes: ", std::strerror(error));
    return error == ENOMEM ? absl::ResourceExhaustedError(message) : absl::InternalError(message);
  }
  // The page tables at once, read-only (no copy-on-write), rather than a fault per 4 KiB page
  // at the first read: on the 2-core VM of docs/design.md, 256 MiB read through a fresh
  // mapping page by page took 179-188 ms, populating it 7-22 ms (the first passes over such
  // pages stay slower than warm memory all the same). Advice only: a kernel without
  // MADV_POPULATE_READ (before 5.14) faults them in as they are read.
  madvise(mapped, static_cast<size_t>(bytes_), MADV_POPULATE_READ);
  return HostArray::adopt(dtype, std::move(shape), static_cast<std::byte*>(mapped),
                          [](std::byte* data, size_t bytes) { munmap(data, bytes); });
}

}  // namespace tessera

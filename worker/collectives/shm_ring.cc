#include "worker/collectives/shm_ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

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

ShmRing::ShmRing(std::string name, bool owner, Header* header, int64_t capacity)
    : name_(std::move(name)),
      owner_(owner),
      header_(header),
      data_(reinterpret_cast<std::byte*>(header) + kHeaderBytes),
      capacity_(capacity) {}

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::create(int64_t capacity, uint64_t token) {
  if (capacity < kMinBytes || capacity > kMaxBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared-memory ring of ", capacity, " bytes: must be within [", kMinBytes, ", ", kMaxBytes, "]"));
  }
  static std::atomic<uint64_t> counter{0};
  std::random_device random;
  const std::string name = absl::StrCat("/tessera-ring-", getpid(), "-", counter.fetch_add(1), "-",
                                        absl::Hex(uint64_t{random()} << 32 | random()));
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("shm_open(", name, "): ", std::strerror(errno)));
  const size_t size = static_cast<size_t>(kHeaderBytes + capacity);
  // tmpfs is sparse: pages are allocated as messages first touch them.
  void* base = ftruncate(fd, static_cast<off_t>(size)) == 0
                   ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  const int error = errno;
  close(fd);
  if (base == MAP_FAILED) {
    shm_unlink(name.c_str());
    return absl::InternalError(
        absl::StrCat("mapping shared memory ", name, " of ", size, " bytes: ", std::strerror(error)));
  }
  auto* header = new (base) Header{};
  header->token = token;
  header->capacity = capacity;
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kMagic;
  return std::unique_ptr<ShmRing>(new ShmRing(name, true, header, capacity));
}

absl::StatusOr<std::unique_ptr<ShmRing>> ShmRing::open(const std::string& name, uint64_t token) {
  if (name.rfind("/tessera-ring-", 0) != 0 || name.find('/', 1) != std::string::npos || name.size() > 200) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a shared-memory ring's name"));
  }
  const int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("no shared-memory segment ", name, " here: ", std::strerror(errno)));
  }
  struct stat st;
  void* base = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_size >= kHeaderBytes + kMinBytes && st.st_size <= kHeaderBytes + kMaxBytes) {
    base = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (base == MAP_FAILED) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared-memory segment ", name, " of ", st.st_size, " bytes is not a ring"));
  }
  auto* header = static_cast<Header*>(base);
  if (header->magic != kMagic || header->token != token || header->capacity != st.st_size - kHeaderBytes) {
    munmap(base, static_cast<size_t>(st.st_size));
    return absl::FailedPreconditionError(
        absl::StrCat("shared-memory segment ", name, " is not the ring offered (magic, token or size differ)"));
  }
  shm_unlink(name.c_str());  // both ends have it mapped: nothing is left behind when they go
  return std::unique_ptr<ShmRing>(new ShmRing(name, false, header, header->capacity));
}

ShmRing::~ShmRing() {
  if (owner_) {
    header_->closed.store(1, std::memory_order_release);
    header_->data_seq.fetch_add(1, std::memory_order_release);
    futex_wake(&header_->data_seq);
    shm_unlink(name_.c_str());  // if the reader never opened it
  }
  munmap(header_, static_cast<size_t>(kHeaderBytes + capacity_));
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
    return absl::DataLossError(absl::StrCat("shared-memory ring ", name_, ": a message of ", record->bytes,
                                            " bytes with ", available, " bytes written"));
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

}  // namespace tessera

// ShmRing: a one-way ring of tagged messages in a /dev/shm segment, from one worker process
// to another on the same host. The sender creates the segment and names it (with a random
// token) to the receiver over their gRPC Exchange stream; the receiver opens it, checks the
// token, removes the name and says so in the segment (attached()), after which the sender
// writes its messages here instead of on gRPC. One writer and one reader; each side sleeps on
// a futex in the segment while the ring is empty (reader) or full (writer): no polling.
//
//   auto ring = ShmRing::create(4 << 20, token);                // sender
//   auto peer = ShmRing::open((*ring)->name(), token);          // receiver (another process)
//   (*peer)->mark_attached();
//   (*ring)->write({op, step, chunk}, data, bytes, until);      // false: no room by `until`
//   ShmRing::Record r; (*peer)->next(&r, until); (*peer)->copy_payload(r, dst); (*peer)->consume(r);
#ifndef TESSERA_WORKER_COLLECTIVES_SHM_RING_H_
#define TESSERA_WORKER_COLLECTIVES_SHM_RING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/shm_transfer.h"  // shm_host_identity

namespace tessera {

class ShmRing {
 public:
  // Smallest ring: room for two of the largest messages a link sends through it.
  static constexpr int64_t kMinBytes = int64_t{2} << 20;
  // Largest ring (a segment per peer pair and direction).
  static constexpr int64_t kMaxBytes = int64_t{1} << 30;
  // The segment's first page holds the ring's header; the ring's bytes follow it.
  static constexpr int64_t kHeaderBytes = 4096;

  struct Record {
    uint64_t op = 0;
    int32_t step = 0;
    int32_t chunk = 0;
    int64_t bytes = 0;     // of payload
    uint64_t run_tag = 0;  // the message's (MessageTag::run_tag)
  };

  // A new segment of `capacity` bytes (plus a header page) under a fresh unique name.
  // INVALID_ARGUMENT for a capacity outside [kMinBytes, kMaxBytes]; INTERNAL with errno's text
  // when /dev/shm refuses.
  static absl::StatusOr<std::unique_ptr<ShmRing>> create(int64_t capacity, uint64_t token);
  // The segment a peer created: NOT_FOUND when this host has no such segment (the peer is
  // elsewhere); FAILED_PRECONDITION when it is not a ring of this version or its token differs.
  // Removes the name (both ends keep their mapping).
  static absl::StatusOr<std::unique_ptr<ShmRing>> open(const std::string& name, uint64_t token);

  // The creator marks the ring closed (the reader drains it and stops) and removes the name.
  ~ShmRing();

  const std::string& name() const { return name_; }
  uint64_t token() const;
  int64_t capacity() const { return capacity_; }
  // Whether a message of `bytes` bytes may go through this ring (at most half of it).
  bool fits(int64_t bytes) const;

  // Receiver: opened and checked.
  void mark_attached();
  bool attached() const;

  // Writer. Copies one message in, waiting for room until `until`; false if there was none by
  // then (the caller checks its link and deadline and tries again). REQUIRES: fits(bytes), and
  // one writer at a time.
  bool write(const Record& header, const std::byte* data, absl::Time until);

  // Reader. Waits until `until` for the next message: true with its header in `*record`,
  // false if none came (or wake_reader() was called). DATA_LOSS for a header that cannot be
  // (the segment is corrupt). Then copy_payload (any number of times) and consume.
  absl::StatusOr<bool> next(Record* record, absl::Time until);
  void copy_payload(const Record& record, std::byte* dst) const;
  void consume(const Record& record);
  // The writer closed the ring and everything in it has been read.
  bool drained_and_closed() const;

  // Wakes a reader or writer that waits (to stop it, or to check its link).
  void wake_reader();
  void wake_writer();

 private:
  struct Header;
  ShmRing(std::string name, bool owner, Header* header, int64_t capacity);
  void copy_in(uint64_t at, const void* src, int64_t n);
  void copy_out(uint64_t at, void* dst, int64_t n) const;

  const std::string name_;
  const bool owner_;
  Header* const header_;
  std::byte* const data_;
  const int64_t capacity_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_SHM_RING_H_

// Fuzz target: a peer's shared-memory ring as a worker reads it (Transport's InboundRing:
// ShmRing::attach's checks of the memfd the peer's ring server handed over, then ShmRing::next,
// copy_payload and consume for each message, stopping at a message over kMaxChunkBytes). The
// peer creates the segment and keeps it mapped, so every byte of it (header and ring) is
// wire input.
//
// The input is the segment's first bytes: its header page (ShmRing::kHeaderBytes), then the
// ring's. The segment has the smallest ring (ShmRing::kMinBytes); the offer's token is the
// seeds' (make_seeds.cc writes them from a real ring).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz/fuzz_check.h"
#include "proto/rpc.h"
#include "worker/collectives/shm_ring.h"

using namespace tessera;

namespace {

constexpr uint64_t kToken = 0x5eed'7e55'e7a1'0001;  // make_seeds.cc's ring
constexpr int64_t kRecordBytes = 32;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int64_t total = ShmRing::kHeaderBytes + ShmRing::kMinBytes;
  if (static_cast<int64_t>(size) > total) return 0;
  // As the peer's ShmRing::create makes it: a memfd sealed at its size.
  const int fd = memfd_create("tessera-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) fuzz::fail("setup", "memfd_create");
  void* base = ftruncate(fd, total) == 0 && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) == 0
                   ? mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  if (base == MAP_FAILED) fuzz::fail("setup", "mmap");
  if (size > 0) std::memcpy(base, data, size);
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::attach(fd, kToken);  // takes the fd
  fuzz::check_rejection(ring.status(), "attach", {absl::StatusCode::kFailedPrecondition});
  if (ring.ok()) {
    (*ring)->mark_attached();
    fuzz::check((*ring)->capacity() == ShmRing::kMinBytes, "a ring of another size than its segment's");
    // Each message consumes at least a record's bytes of at most a ring's worth written.
    for (int64_t i = 0; i <= ShmRing::kMinBytes / kRecordBytes; ++i) {
      ShmRing::Record record;
      absl::StatusOr<bool> got = (*ring)->next(&record, absl::InfinitePast());
      fuzz::check_rejection(got.status(), "next", {absl::StatusCode::kDataLoss});
      if (!got.ok() || !*got) break;
      fuzz::check(record.bytes >= 0 && record.bytes <= ShmRing::kMinBytes - kRecordBytes,
                  "next accepted a message larger than the ring");
      if (record.bytes > kMaxChunkBytes) break;  // the reader stops the ring
      std::vector<std::byte> payload(static_cast<size_t>(record.bytes));
      (*ring)->copy_payload(record, payload.data());
      (*ring)->consume(record);
    }
  }
  munmap(base, total);
  return 0;
}

// Buffers handed between a client and a worker of the same process (Client::local in process,
// proto/in_process.h): PutShard and GetShard still run, with their checks, reservations and
// grants, but the shard's bytes do not travel in the stream; the message names a token under
// which the sender deposited the buffer, and the receiver takes it.
//
//   absl::StatusOr<uint64_t> token = Handoff::deposit(std::make_shared<const HostArray>(block));
//   header->set_handoff(*token);                                  // the worker, on PutShard:
//   std::shared_ptr<const HostArray> data = Handoff::take(header.handoff());  // nullptr: gone
#ifndef TESSERA_CORE_HANDOFF_H_
#define TESSERA_CORE_HANDOFF_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/host_array.h"

namespace tessera {

class Handoff {
 public:
  // At most this many buffers wait to be taken at once (a fetch of 1024 devices' shards fits).
  static constexpr int kMaxWaiting = 4096;

  // Deposits `buffer` under a fresh token (never 0, never reused in this process).
  // RESOURCE_EXHAUSTED when kMaxWaiting buffers wait already (the caller streams instead).
  static absl::StatusOr<uint64_t> deposit(std::shared_ptr<const HostArray> buffer);
  // The buffer deposited under `token`, which leaves the table; nullptr if there is none (taken
  // already, or a token of another process).
  static std::shared_ptr<const HostArray> take(uint64_t token);
  // Buffers taken since this process started (what a test of the path reads).
  static int64_t taken();
};

}  // namespace tessera

#endif  // TESSERA_CORE_HANDOFF_H_

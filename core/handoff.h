// Buffers handed between a client and a worker of the same process (Client::local in process,
// proto/in_process.h): PutShard and GetShard still run, with their checks, reservations and
// grants, but the shard's bytes do not travel in the stream; the message names a token under
// which the sender deposited the buffer, and the receiver takes it.
//
//   absl::StatusOr<uint64_t> token = Handoff::deposit(std::make_shared<const HostArray>(block));
//   header->set_handoff(*token);                                  // the worker, on PutShard:
//   std::shared_ptr<const HostArray> data = Handoff::take(header.handoff());  // nullptr: gone
//
// A replicated block is deposited once for all its devices (`takers`): each takes the same
// immutable buffer, so the client copies it once, not once per replica.
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

  // Deposits `buffer` under a fresh token (never 0, never reused in this process), to be taken
  // `takers` times (at least 1). RESOURCE_EXHAUSTED when kMaxWaiting buffers wait already (the
  // caller streams instead).
  static absl::StatusOr<uint64_t> deposit(std::shared_ptr<const HostArray> buffer, int takers = 1);
  // The buffer deposited under `token`, which leaves the table at its last take; nullptr if
  // there is none (taken already, or a token of another process).
  static std::shared_ptr<const HostArray> take(uint64_t token);
  // Removes what is left under `token` (takers that never came: their puts failed). Not a take.
  static void withdraw(uint64_t token);
  // Buffers taken, and deposited, since this process started (what a test of the path reads).
  static int64_t taken();
  static int64_t deposited();
};

}  // namespace tessera

#endif  // TESSERA_CORE_HANDOFF_H_

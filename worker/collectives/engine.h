// The collective engine: one device's part of a collective, over the Transport.
//
// Algorithms by size: up to kSmallBytes latency-optimal ones — all_reduce as a binomial tree
// (reduce to rank 0, broadcast back: 2(n-1) messages in 2 log2 n rounds, every device gets
// rank 0's bytes), the others as direct exchanges (one message to each peer, results reduced
// in rank order so every device gets bitwise the same answer);
// above it bandwidth-optimal rings (all_reduce = ring reduce-scatter + ring all-gather, each
// device sending 2(n-1)/n of the data), pipelined in chunks of ring_chunk_bytes(path). all_to_all and
// collective_permute are direct exchanges; broadcast is a pipelined chain from the root.
//
//   CollectiveRun run{op_id, spec, peers, self, deadline};
//   absl::StatusOr<std::shared_ptr<const HostArray>> out = run_collective(transport, run, input);
#ifndef TESSERA_WORKER_COLLECTIVES_ENGINE_H_
#define TESSERA_WORKER_COLLECTIVES_ENGINE_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/collective.h"
#include "core/host_array.h"
#include "proto/rpc.h"  // kMaxChunkBytes
#include "worker/collectives/algorithms.h"
#include "worker/collectives/transport.h"

namespace tessera {

inline constexpr int64_t kSmallBytes = 64 << 10;
// The messages of the chunked algorithms: direct exchanges, the broadcast chain, the blocks a
// reshard moves (move_blocks.h), and the rings on shared memory and in process.
inline constexpr int64_t kChunkBytes = 512 << 10;
// The rings' chunks on gRPC (all_reduce, all_gather, reduce_scatter above kSmallBytes): as
// large as the wire allows (proto/rpc.h), since there every message costs its receiver a
// gRPC read callback and a wake-up of the waiting collective: half as many of them cost 40%
// fewer context switches (docs/design.md, "The gRPC path's rings").
inline constexpr int64_t kGrpcRingChunkBytes = kMaxChunkBytes;
static_assert(kGrpcRingChunkBytes <= kMaxChunkBytes, "a ring chunk must fit the wire's limit");

// The chunk size of the rings on `path` (every member of a group runs the same path, so they
// agree on it).
inline int64_t ring_chunk_bytes(Path path) { return path == Path::kGrpc ? kGrpcRingChunkBytes : kChunkBytes; }

struct CollectiveRun {
  uint64_t op = 0;
  uint64_t run_tag = 0;  // carried by every message of the op (MessageTag::run_tag)
  CollectiveSpec spec;
  std::map<int, std::string> peers;  // device id -> address, for every member of self's group
  int self = 0;
  absl::Time start;  // when this device began the op
  absl::Time deadline;
  std::function<bool()> cancelled;  // true once the caller gave up on the op
  // A broadcast member other than the root that has no input of its own (a replicated put's
  // fan-out, worker/transfers.h): the buffer to receive into, of the input's dtype and shape
  // (the input then only says those, and may be this buffer).
  std::shared_ptr<HostArray> broadcast_into;
  // A broadcast's root whose input is still arriving (a replicated put's uploader, reading its
  // client's stream): called before each chunk is sent with the number of leading bytes of the
  // input that chunk needs, returns once they are in place (an error fails the op). Unset: the
  // input is whole.
  std::function<absl::Status(int64_t)> input_ready;
  // A broadcast's stall deadline (a replicated put's, --put_stall_ms): a wait on a member's
  // progress (a chain's acknowledgement, room in the link to it) that lasts this long fails
  // DEADLINE_EXCEEDED naming the member, before the op's deadline. Infinite: the deadline alone.
  absl::Duration stall_timeout = absl::InfiniteDuration();
  // ragged_all_to_all (CollectiveKind::kRaggedAllToAll): its operands after the first (the
  // `input`): output, input_offsets, send_sizes, output_offsets, recv_sizes (core/op.h).
  std::vector<std::shared_ptr<const HostArray>> ragged_operands;
};

// Runs this device's part. REQUIRES: validate_collective(run.spec) is OK and self is in a
// group. INVALID_ARGUMENT for shapes the collective cannot take; UNAVAILABLE or
// DEADLINE_EXCEEDED naming the peer that failed it.
// Large messages are sent straight from `input` and the result (zero-copy, see
// Transport::send): neither may change afterwards. The result may be `input` itself (a
// broadcast's root, a one-member group).
absl::StatusOr<std::shared_ptr<const HostArray>> run_collective(Transport& transport, const CollectiveRun& run,
                                                                std::shared_ptr<const HostArray> input);

// Instead of a receive that would wait: returns true when it parked the run to wait for the
// message `tag` from `device` without a thread (Transport::park); false: receive at once.
using ParkFn = std::function<bool(int device, MessageTag tag, absl::Time op_start)>;

// A collective that a run can leave at a receive whose message has not arrived and continue
// later, on whichever thread resumes it (the run's state is kept here, not on a stack): the
// small all_reduce's binomial tree, the one all_reduce in process chooses (algorithms.h). The
// same algorithm, messages, metrics and errors as run_collective.
//
//   absl::StatusOr<std::unique_ptr<SteppedCollective>> c = SteppedCollective::start(t, run, in);
//   // *c == nullptr: not one that steps; run_collective it.
//   absl::StatusOr<std::shared_ptr<const HostArray>> out = (*c)->advance(park);
//   // *out == nullptr: parked; advance again once resumed (with nullptr: it waits).
class SteppedCollective {
 public:
  // nullptr when `run` is not one that steps (not an all_reduce choosing the tree here, a group
  // of one, a member without an in-process address, or a profiled transport). Errors as
  // run_collective's, before any message.
  static absl::StatusOr<std::unique_ptr<SteppedCollective>> start(Transport& transport, CollectiveRun run,
                                                                  std::shared_ptr<const HostArray> input);
  ~SteppedCollective();

  // Runs until the result, or until `park` parked it (nullptr; without `park` it waits).
  absl::StatusOr<std::shared_ptr<const HostArray>> advance(const ParkFn& park);

 private:
  struct State;
  explicit SteppedCollective(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_ENGINE_H_

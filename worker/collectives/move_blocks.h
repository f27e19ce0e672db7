// Moving boxes of blocks between devices: one device's part of a ReshardArray (device_put of
// an array already on devices onto another sharding, possibly on other devices). The
// coordinator says what this device sends (boxes of its input block) and receives (boxes of
// its output block); each piece travels over the Transport as messages of at most kChunkBytes
// tagged (op, piece tag, chunk), never through a client.
//
//   BlockMoveRun run{op, peers, self, start, deadline, cancelled, sends, receives};
//   absl::StatusOr<std::shared_ptr<const HostArray>> block = move_blocks(transport, run, input,
//                                                                        dtype, out_shape);
#ifndef TESSERA_WORKER_COLLECTIVES_MOVE_BLOCKS_H_
#define TESSERA_WORKER_COLLECTIVES_MOVE_BLOCKS_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/host_array.h"
#include "core/sharding.h"
#include "worker/collectives/transport.h"

namespace tessera {

namespace pb {
class WorkerReshardRequest;
}

// One piece: `box` of this device's input block (a send) or output block (a receive), to or
// from `peer` (this device: a local copy, listed as both). Both ends use the same tag.
struct BlockPiece {
  int peer = 0;
  int tag = 0;
  Index box;
};

struct BlockMoveRun {
  uint64_t op = 0;
  uint64_t run_tag = 0;              // carried by every message of the op (MessageTag::run_tag)
  std::map<int, std::string> peers;  // device id -> address, for every peer of a piece
  int self = 0;
  absl::Time start;
  absl::Time deadline;
  std::function<bool()> cancelled;
  std::vector<BlockPiece> sends;
  std::vector<BlockPiece> receives;
};

// The sends and receives of a worker's Reshard request, appended to run->sends and
// run->receives (the rest of `run` is the caller's). INVALID_ARGUMENT naming the piece when its
// start and limit lists differ in length, or for more than kMaxBlockPieces either way.
absl::Status pieces_from_proto(const pb::WorkerReshardRequest& req, BlockMoveRun* run);

// Pieces a request may list each way: one per device of a cluster at most.
inline constexpr size_t kMaxBlockPieces = 1024;

// The pieces of `run` against the blocks they cut, as move_blocks checks them before it moves
// anything (see there): OK, or INVALID_ARGUMENT naming the piece and the rule.
absl::Status check_pieces(const BlockMoveRun& run, const std::shared_ptr<const HostArray>& input,
                          const std::optional<Shape>& out_shape);

// Runs this device's part: sends its pieces of `input` (null when it sends none), then
// assembles its output block of `out_shape` from the pieces it receives, and returns it
// (nullopt `out_shape`: it holds no block of the result, and returns null). Everything from
// the wire is checked first: INVALID_ARGUMENT naming the piece for a box outside its block, a
// peer without an address, a local piece without its other end, or receives that do not add
// up to the output block. UNAVAILABLE, DEADLINE_EXCEEDED or DATA_LOSS naming the peer that
// failed it; CANCELLED when `cancelled()` turns true.
absl::StatusOr<std::shared_ptr<const HostArray>> move_blocks(Transport& transport, const BlockMoveRun& run,
                                                             const std::shared_ptr<const HostArray>& input, DType dtype,
                                                             const std::optional<Shape>& out_shape);

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_MOVE_BLOCKS_H_

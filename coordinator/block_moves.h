// Block moves: how an array goes from one sharding to another, device to device (ReshardArray,
// the coordinator's side of device_put of an array already on devices). The two shardings may
// be on different meshes and different devices. An array unreduced over some axes moves term by
// term: each device takes its boxes from the devices at its own coordinates along them.
//
//   // (8,) on devices 0..3 split over 'x', to devices 4..7 split over 'x': four moves 0 -> 4, ...
//   std::vector<BlockMove> moves = plan_block_moves({8}, NamedSharding(low, P("x")),
//                                                   NamedSharding(high, P("x")));
//   moves[1].source == 1 && moves[1].target == 5 && moves[1].box == Index{{2, 4}};
#ifndef TESSERA_COORDINATOR_BLOCK_MOVES_H_
#define TESSERA_COORDINATOR_BLOCK_MOVES_H_

#include <map>
#include <optional>
#include <vector>

#include "core/shape.h"
#include "core/sharding.h"
#include "core/unreduced_move.h"
#include "proto/tessera.pb.h"

namespace tessera {

// One box of the global array that `source` holds (in its block of the old sharding) and
// `target` needs (in its block of the new one), in global coordinates.
struct BlockMove {
  int source = 0;
  int target = 0;
  Index box;
};

// The moves that give every device of `to` its block: each block of `to` is covered exactly
// once by its intersections with the distinct blocks of `from` (empty ones left out; with an
// unreduced `from` that check_unreduced_move accepts, the blocks of the target's term only). A
// box comes from the target itself when it holds that block of `from` (a local copy), else from
// the block's holders in turn, so replicas share the sends. Ordered by target, then by the
// block's first device in `from`. REQUIRES: from.validate(shape) and to.validate(shape).
std::vector<BlockMove> plan_block_moves(const Shape& shape, const NamedSharding& from, const NamedSharding& to);

// `box` in the coordinates of `block`, which contains it. REQUIRES: equal ranks.
Index relative_box(const Index& box, const Index& block);

// One device's part of a reshard: its block of the input and of the result (none if it holds
// none), and its Reshard request's pieces (sends: boxes of its block of `from`; receives: boxes of its block
// of `to`; each with the peer and the move's tag), the rest of the request unset.
struct ReshardPart {
  std::optional<Index> in_block;
  std::optional<Index> out_block;
  pb::WorkerReshardRequest request;
};

// Every device that sends, receives or holds a block of the result, with its part: the moves of
// plan_block_moves, tagged in their order. REQUIRES: as plan_block_moves.
std::map<int, ReshardPart> plan_reshard_parts(const Shape& shape, const NamedSharding& from, const NamedSharding& to);

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_BLOCK_MOVES_H_

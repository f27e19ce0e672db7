#include "coordinator/block_moves.h"

#include <algorithm>
#include <optional>
#include <string>

#include "core/unreduced_move.h"

namespace tessera {
namespace {

// The intersection of two blocks, or nothing when it holds no element. A rank-0 array's one
// element is every block's.
std::optional<Index> intersect(const Index& a, const Index& b) {
  Index out(a.size());
  for (size_t d = 0; d < a.size(); ++d) {
    out[d] = {std::max(a[d].start, b[d].start), std::min(a[d].stop, b[d].stop)};
    if (out[d].start >= out[d].stop) return std::nullopt;
  }
  return out;
}

// The term of a sum the device at `position` of `sharding`'s mesh holds, when the array is
// unreduced over `axes`: its coordinates along them (empty for none).
std::vector<int64_t> term_at(const NamedSharding& sharding, int64_t position, const std::vector<std::string>& axes) {
  std::vector<int64_t> term;
  if (axes.empty()) return term;
  const std::vector<int64_t> coords = sharding.mesh().coords(position);
  for (const std::string& axis : axes) term.push_back(coords[sharding.mesh().axis_index(axis)]);
  return term;
}

}  // namespace

std::vector<BlockMove> plan_block_moves(const Shape& shape, const NamedSharding& from, const NamedSharding& to) {
  // The terms an unreduced `from` holds: a device takes its boxes from the devices of its own
  // term only (they hold different values, not replicas). Replicas otherwise, as when the
  // sharding is not a move check_unreduced_move accepts (a caller's error: then any holder).
  const std::vector<std::string> axes =
      check_unreduced_move(from, to).ok() ? from.spec().unreduced() : std::vector<std::string>{};
  // The distinct blocks of `from` (by term), each with its holders in mesh order.
  struct Held {
    Index block;
    std::vector<int64_t> term;
    std::vector<int> holders;
    size_t next = 0;  // the holder that sends the next box another device needs
  };
  std::vector<Held> held;
  for (const DeviceShard& s : from.device_shards(shape)) {
    std::vector<int64_t> term = term_at(from, s.mesh_position, axes);
    auto it =
        std::find_if(held.begin(), held.end(), [&](const Held& h) { return h.block == s.index && h.term == term; });
    if (it == held.end()) {
      held.push_back({s.index, std::move(term), {s.device_id}});
    } else {
      it->holders.push_back(s.device_id);
    }
  }
  std::vector<BlockMove> moves;
  for (const DeviceShard& t : to.device_shards(shape)) {
    const std::vector<int64_t> term = term_at(to, t.mesh_position, axes);
    for (Held& h : held) {
      if (h.term != term) continue;
      std::optional<Index> box = intersect(t.index, h.block);
      if (!box.has_value()) continue;
      int source;
      if (std::find(h.holders.begin(), h.holders.end(), t.device_id) != h.holders.end()) {
        source = t.device_id;
      } else {
        source = h.holders[h.next];
        h.next = (h.next + 1) % h.holders.size();
      }
      moves.push_back({source, t.device_id, *std::move(box)});
    }
  }
  return moves;
}

Index relative_box(const Index& box, const Index& block) {
  Index out(box.size());
  for (size_t d = 0; d < box.size(); ++d) out[d] = {box[d].start - block[d].start, box[d].stop - block[d].start};
  return out;
}

std::map<int, ReshardPart> plan_reshard_parts(const Shape& shape, const NamedSharding& from, const NamedSharding& to) {
  std::map<int, Index> in_blocks;
  for (const DeviceShard& s : from.device_shards(shape)) in_blocks[s.device_id] = s.index;
  std::map<int, ReshardPart> parts;
  for (const DeviceShard& s : to.device_shards(shape)) parts[s.device_id].out_block = s.index;
  int tag = 0;
  for (const BlockMove& m : plan_block_moves(shape, from, to)) {
    auto add = [&](pb::BlockPiece* piece, int peer, const Index& block) {
      piece->set_peer(peer);
      piece->set_tag(tag);
      for (const Slice& s : relative_box(m.box, block)) {
        piece->add_start(s.start);
        piece->add_limit(s.stop);
      }
    };
    add(parts[m.source].request.add_sends(), m.target, in_blocks.at(m.source));
    ReshardPart& receiver = parts[m.target];
    add(receiver.request.add_receives(), m.source, *receiver.out_block);
    ++tag;
  }
  for (auto& [device, part] : parts) {
    if (auto it = in_blocks.find(device); it != in_blocks.end()) part.in_block = it->second;
  }
  return parts;
}

}  // namespace tessera

// Fuzz target: the coordinator's side of ReshardArray (coordinator_server.cc's reshard_array():
// device_put of an array already on devices onto another sharding), from the request to the
// workers' parts, and each part through the worker's own checks. The input array is made as
// CreateArray makes one (sharding_from_proto, the registry's create_array); the request's
// sharding is decoded and checked as reshard_array() does (sharding_from_proto, validate, the
// registry's create_array of the result), and plan_reshard_parts() writes every device's part.
// Asserted beyond "no crash":
//   - every device of the result's mesh has a part holding its block of the result;
//   - each move's two pieces (same tag) name each other and have the same extent;
//   - each device's part passes the worker's pieces_from_proto and check_pieces (the boxes lie
//     in its blocks, and its receives tile its block of the result exactly), for arrays of at
//     most 1 MiB (the checks need the input block's shape as a HostArray).
//
// The input: two bytes (little endian) giving the length of a CreateArrayRequest (the input
// array), that request, then the ReshardArrayRequest (its array_id is ignored). The registry
// holds devices 0-7.
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <utility>

#include "coordinator/block_moves.h"
#include "core/slicing.h"
#include "core/wire.h"
#include "fuzz/coordinator_fixture.h"
#include "proto/tessera.pb.h"
#include "worker/collectives/move_blocks.h"

using namespace tessera;

namespace {

constexpr int64_t kCheckedBytes = int64_t{1} << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pb::CreateArrayRequest create_input;
  pb::ReshardArrayRequest req;
  if (!fuzz::parse_two(data, size, create_input, req)) return 0;
  const std::optional<ArrayRecord> input = fuzz::create_as_coordinator(create_input);
  if (!input.has_value()) return 0;
  const DType dtype = input->dtype;
  const Shape& shape = input->shape;
  const NamedSharding& from = input->sharding;
  // reshard_array()'s checks, in its order: the target, that it fits, that its devices exist.
  absl::StatusOr<NamedSharding> to = sharding_from_proto(req.sharding());
  fuzz::check_rejection(to.status(), "sharding_from_proto");
  if (!to.ok()) return 0;
  absl::Status fits = to->validate(shape);
  fuzz::check_rejection(fits, "validate");
  if (!fits.ok()) return 0;
  absl::Status terms = check_unreduced_move(from, *to);
  fuzz::check_rejection(terms, "check_unreduced_move");
  if (!terms.ok()) return 0;
  absl::StatusOr<uint64_t> out_id = fuzz::eight_device_registry().create_array(dtype, shape, *to, 0);
  fuzz::check_rejection(out_id.status(), "create_array of the result",
                        {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound});
  if (!out_id.ok()) return 0;
  fuzz::eight_device_registry().remove_arrays({*out_id});

  std::map<int, ReshardPart> parts = plan_reshard_parts(shape, from, *to);
  std::map<int, Index> in_blocks;
  for (const DeviceShard& s : from.device_shards(shape)) in_blocks[s.device_id] = s.index;
  for (const DeviceShard& s : to->device_shards(shape)) {
    auto it = parts.find(s.device_id);
    fuzz::check(it != parts.end() && it->second.out_block == s.index, "a device of the result has no part");
  }
  // Each move's two pieces, by tag: (device, piece) of its send and of its receive.
  std::map<int, std::pair<int, const pb::BlockPiece*>> sends, receives;
  for (const auto& [device, part] : parts) {
    for (const pb::BlockPiece& p : part.request.sends()) {
      fuzz::check(sends.emplace(p.tag(), std::pair{device, &p}).second, "two sends with one tag");
    }
    for (const pb::BlockPiece& p : part.request.receives()) {
      fuzz::check(receives.emplace(p.tag(), std::pair{device, &p}).second, "two receives with one tag");
    }
  }
  fuzz::check(sends.size() == receives.size(), "a send without its receive, or a receive without its send");
  for (const auto& [tag, send] : sends) {
    auto r = receives.find(tag);
    fuzz::check(r != receives.end(), "a send without its receive");
    const auto& [receiver, receive] = r->second;
    fuzz::check(send.second->peer() == receiver && receive->peer() == send.first, "a move's pieces name others");
    fuzz::check(send.second->start_size() == receive->start_size(), "a move's pieces differ in rank");
    for (int d = 0; d < receive->start_size(); ++d) {
      fuzz::check(send.second->limit(d) - send.second->start(d) == receive->limit(d) - receive->start(d),
                  "a move's pieces differ in extent");
    }
  }
  // Each part as its worker checks it, when the blocks are small enough to make.
  if (num_elements(shape) * dtype_size(dtype) > kCheckedBytes) return 0;
  for (const auto& [device, part] : parts) {
    BlockMoveRun run;
    run.self = device;
    for (const auto& [peer, other] : parts) run.peers[peer] = absl::StrCat("127.0.0.1:", 7000 + peer);
    fuzz::check(pieces_from_proto(part.request, &run).ok(), "the worker refuses the pieces the coordinator wrote");
    std::shared_ptr<const HostArray> input;
    if (!run.sends.empty()) input = std::make_shared<HostArray>(dtype, block_shape(in_blocks.at(device)));
    std::optional<Shape> out_shape;
    if (part.out_block.has_value()) out_shape = block_shape(*part.out_block);
    const absl::Status checked = check_pieces(run, input, out_shape);
    if (!checked.ok()) fuzz::fail("check_pieces refuses the coordinator's part", checked.ToString());
  }
  return 0;
}

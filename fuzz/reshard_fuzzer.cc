// Fuzz target: a worker's Reshard request (worker_server.cc's reshard(): one device's part of
// a ReshardArray, a worker-to-worker block move), decoded and checked as the worker does it:
// pieces_from_proto, the dtype, the output block's shape and its reservation in the device's
// store, then check_pieces (worker/collectives/move_blocks.h). A request whose pieces are all
// local (peer = this device, 0) then runs move_blocks for real, and every element of the
// output block must be the input element its piece names (a host reference, element by
// element).
//
// The input: two bytes (little endian) giving the length of a ShardHeader, the input block
// this device holds (its dtype and shape; at most 1 MiB, as a 1 MiB device could hold), then
// the WorkerReshardRequest.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/slicing.h"
#include "core/wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"
#include "worker/buffer_store.h"
#include "worker/collectives/move_blocks.h"

using namespace tessera;

namespace {

constexpr int kSelf = 0;
constexpr int64_t kDeviceBytes = int64_t{1} << 20;

// Row-major offsets (in elements) of the elements of `box` in an array of `shape`, in the
// box's own row-major order.
std::vector<int64_t> offsets_of(const Index& box, const Shape& shape) {
  std::vector<int64_t> out;
  const Shape extent = block_shape(box);
  const int64_t n = num_elements(extent);
  std::vector<int64_t> at(box.size(), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t offset = 0;
    for (size_t d = 0; d < box.size(); ++d) offset = offset * shape[d] + box[d].start + at[d];
    out.push_back(offset);
    for (size_t d = box.size(); d-- > 0;) {
      if (++at[d] < extent[d]) break;
      at[d] = 0;
    }
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pb::ShardHeader held;
  pb::WorkerReshardRequest req;
  if (!fuzz::parse_two(data, size, held, req)) return 0;
  // The block this device holds as the request's input (the store's get).
  std::shared_ptr<HostArray> input;
  if (req.input_buffer() != 0) {
    absl::StatusOr<DType> held_dtype = dtype_from_proto(held.dtype());
    absl::StatusOr<Shape> held_shape =
        held_dtype.ok() ? shape_from_proto(held.shape(), *held_dtype) : held_dtype.status();
    if (!held_shape.ok() || num_elements(*held_shape) * dtype_size(*held_dtype) > kDeviceBytes) return 0;
    input = std::make_shared<HostArray>(*held_dtype, *held_shape);
    for (int64_t i = 0; i < input->nbytes(); ++i) input->data()[i] = static_cast<std::byte>(i * 7 + 1);
  }
  // What the worker's reshard() does, in its order.
  BlockMoveRun run;
  run.op = req.op_id();
  run.self = kSelf;
  for (const pb::PeerAddress& peer : req.peers()) run.peers[peer.device_id()] = peer.address();
  run.start = absl::Now();
  run.deadline = run.start + absl::Seconds(1);
  run.cancelled = [] { return false; };
  absl::Status pieces = pieces_from_proto(req, &run);
  fuzz::check_rejection(pieces, "pieces_from_proto");
  if (!pieces.ok()) return 0;
  absl::StatusOr<DType> dtype = dtype_from_proto(req.dtype());
  fuzz::check_rejection(dtype.status(), "dtype_from_proto");
  if (!dtype.ok()) return 0;
  std::optional<Shape> out_shape;
  BufferStore store(kDeviceBytes);
  if (req.output_buffer() != 0) {
    absl::StatusOr<Shape> shape = shape_from_proto(req.output_shape(), *dtype);
    fuzz::check_rejection(shape.status(), "shape_from_proto");
    if (!shape.ok()) return 0;
    absl::Status reserved = store.reserve(req.output_buffer(), num_elements(*shape) * dtype_size(*dtype));
    fuzz::check_rejection(reserved, "reserve", {absl::StatusCode::kResourceExhausted});
    if (!reserved.ok()) return 0;
    out_shape = *shape;
  }
  absl::Status checked = check_pieces(run, input, out_shape);
  fuzz::check_rejection(checked, "check_pieces");
  if (!checked.ok()) return 0;
  // Accepted: each piece is a box of its block, and the receives tile the output block.
  int64_t covered = 0;
  for (const BlockPiece& p : run.sends)
    fuzz::check(validate_index(p.box, input->shape()).ok(), "a send outside the input");
  for (const BlockPiece& p : run.receives) {
    fuzz::check(validate_index(p.box, *out_shape).ok(), "a receive outside the output block");
    covered += num_elements(block_shape(p.box));
  }
  fuzz::check(!out_shape.has_value() || covered == num_elements(*out_shape), "the receives do not cover the block");
  bool local = true;
  for (const auto* list : {&run.sends, &run.receives}) {
    for (const BlockPiece& p : *list) local = local && p.peer == kSelf;
  }
  if (!local) return 0;  // the sends and receives would need peers on the network
  static Transport transport;
  absl::StatusOr<std::shared_ptr<const HostArray>> out = move_blocks(transport, run, input, *dtype, out_shape);
  fuzz::check_rejection(out.status(), "move_blocks");
  if (!out.ok()) return 0;
  if (!out_shape.has_value()) {
    fuzz::check(*out == nullptr, "a device without an output block returned one");
    return 0;
  }
  fuzz::check(*out != nullptr && (*out)->shape() == *out_shape && (*out)->dtype() == *dtype,
              "the output block is not of the request's shape and dtype");
  // The reference: each receive's elements are those of the (last) local send of its tag.
  const int64_t esize = dtype_size(*dtype);
  for (const BlockPiece& r : run.receives) {
    const BlockPiece* send = nullptr;
    for (const BlockPiece& s : run.sends) {
      if (s.tag == r.tag) send = &s;
    }
    fuzz::check(send != nullptr && block_shape(send->box) == block_shape(r.box), "a receive without its local send");
    const std::vector<int64_t> from = offsets_of(send->box, input->shape());
    const std::vector<int64_t> to = offsets_of(r.box, *out_shape);
    for (size_t i = 0; i < to.size(); ++i) {
      if (std::memcmp((*out)->data() + to[i] * esize, input->data() + from[i] * esize, static_cast<size_t>(esize)) !=
          0) {
        fuzz::fail("move_blocks", "an output element is not the input element its piece names");
      }
    }
  }
  store.commit(req.output_buffer(), *std::move(out));
  return 0;
}

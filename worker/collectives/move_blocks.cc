#include "worker/collectives/move_blocks.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/slicing.h"
#include "core/status.h"
#include "proto/tessera.pb.h"
#include "worker/collectives/engine.h"

namespace tessera {
namespace {

int chunks_of(int64_t bytes) { return bytes == 0 ? 1 : static_cast<int>((bytes + kChunkBytes - 1) / kChunkBytes); }

bool overlap(const Index& a, const Index& b) {
  for (size_t d = 0; d < a.size(); ++d) {
    if (std::max(a[d].start, b[d].start) >= std::min(a[d].stop, b[d].stop)) return false;
  }
  return true;
}

std::string describe(const char* kind, const BlockPiece& p) {
  return absl::StrCat(kind, " ", index_to_string(p.box), " (tag ", p.tag, ", peer device ", p.peer, ")");
}

}  // namespace

absl::Status pieces_from_proto(const pb::WorkerReshardRequest& req, BlockMoveRun* run) {
  for (auto [pieces, list] : {std::pair{&req.sends(), &run->sends}, std::pair{&req.receives(), &run->receives}}) {
    if (static_cast<size_t>(pieces->size()) > kMaxBlockPieces) {
      return absl::InvalidArgumentError(absl::StrCat("reshard: ", req.sends_size(), " sends and ", req.receives_size(),
                                                     " receives; at most ", kMaxBlockPieces, " each"));
    }
    for (const pb::BlockPiece& p : *pieces) {
      if (p.start_size() != p.limit_size()) {
        return absl::InvalidArgumentError(absl::StrCat("reshard: a piece (tag ", p.tag(), ") has ", p.start_size(),
                                                       " starts and ", p.limit_size(), " limits"));
      }
      BlockPiece piece{p.peer(), p.tag(), {}};
      for (int d = 0; d < p.start_size(); ++d) piece.box.push_back({p.start(d), p.limit(d)});
      list->push_back(std::move(piece));
    }
  }
  return absl::OkStatus();
}

// An output block made of pieces that overlap or leave a gap would hold bytes of no piece:
// refused.
absl::Status check_pieces(const BlockMoveRun& run, const std::shared_ptr<const HostArray>& input,
                          const std::optional<Shape>& out_shape) {
  if (run.sends.size() > kMaxBlockPieces || run.receives.size() > kMaxBlockPieces) {
    return absl::InvalidArgumentError(absl::StrCat("reshard: ", run.sends.size(), " sends and ", run.receives.size(),
                                                   " receives; at most ", kMaxBlockPieces, " each"));
  }
  for (const BlockPiece& p : run.sends) {
    if (input == nullptr)
      return absl::InvalidArgumentError(absl::StrCat("reshard: ", describe("send", p), " but no input"));
    absl::Status in_block = validate_index(p.box, input->shape());
    if (!in_block.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("reshard: ", describe("send", p), " of the input block ",
                                                     shape_to_string(input->shape()), ": ", in_block.message()));
    }
  }
  int64_t covered = 0;
  for (size_t i = 0; i < run.receives.size(); ++i) {
    const BlockPiece& p = run.receives[i];
    if (!out_shape.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("reshard: ", describe("receive", p), " but no output block"));
    }
    absl::Status in_block = validate_index(p.box, *out_shape);
    if (!in_block.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("reshard: ", describe("receive", p), " of the output block ",
                                                     shape_to_string(*out_shape), ": ", in_block.message()));
    }
    for (size_t j = 0; j < i; ++j) {
      if (overlap(p.box, run.receives[j].box)) {
        return absl::InvalidArgumentError(
            absl::StrCat("reshard: ", describe("receive", p), " overlaps ", describe("receive", run.receives[j])));
      }
    }
    covered += num_elements(block_shape(p.box));
  }
  if (out_shape.has_value() && covered != num_elements(*out_shape)) {
    return absl::InvalidArgumentError(absl::StrCat("reshard: the receives cover ", covered, " of the ",
                                                   num_elements(*out_shape), " elements of the output block ",
                                                   shape_to_string(*out_shape)));
  }
  for (const std::vector<BlockPiece>* list : {&run.sends, &run.receives}) {
    for (const BlockPiece& p : *list) {
      if (p.peer != run.self && run.peers.count(p.peer) == 0) {
        return absl::InvalidArgumentError(absl::StrCat("reshard: no address for device ", p.peer, " of ",
                                                       describe(list == &run.sends ? "send" : "receive", p)));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const HostArray>> move_blocks(Transport& transport, const BlockMoveRun& run,
                                                             const std::shared_ptr<const HostArray>& input, DType dtype,
                                                             const std::optional<Shape>& out_shape) {
  TESSERA_RETURN_IF_ERROR(check_pieces(run, input, out_shape));
  ProfileSpan span(&transport.profile(), "collective", [] { return std::string("reshard"); });
  const int64_t esize = dtype_size(dtype);
  if (input != nullptr && input->dtype() != dtype) {
    return absl::InvalidArgumentError(absl::StrCat("reshard: the input block is ", dtype_name(input->dtype()),
                                                   ", the request says ", dtype_name(dtype)));
  }
  // Local pieces by tag: copied out here, copied in below.
  std::map<int, std::shared_ptr<const HostArray>> local;
  int64_t sent = 0;
  for (const BlockPiece& p : run.sends) {
    auto piece = std::make_shared<const HostArray>(extract_block(*input, p.box));
    if (p.peer == run.self) {
      local[p.tag] = piece;
      continue;
    }
    const int64_t bytes = piece->nbytes();
    const std::string& address = run.peers.at(p.peer);
    for (int c = 0; c < chunks_of(bytes); ++c) {
      const int64_t offset = c * kChunkBytes;
      TESSERA_RETURN_IF_ERROR(transport.send(p.peer, address, {run.op, p.tag, c, run.run_tag}, piece->data() + offset,
                                             std::min(kChunkBytes, bytes - offset), run.deadline, piece,
                                             run.cancelled));
    }
    sent += bytes;
  }
  if (span) span.arg("bytes_sent", absl::StrCat(sent));
  if (!out_shape.has_value()) return std::shared_ptr<const HostArray>();
  auto out = std::make_shared<HostArray>(dtype, *out_shape);
  for (const BlockPiece& p : run.receives) {
    const Shape shape = block_shape(p.box);
    if (p.peer == run.self) {
      auto it = local.find(p.tag);
      if (it == local.end() || it->second->shape() != shape) {
        return absl::InvalidArgumentError(
            absl::StrCat("reshard: ", describe("receive", p), " has no local send of its shape with its tag"));
      }
      copy_block_in(it->second->data(), *out_shape, esize, p.box, out->data());
      continue;
    }
    HostArray piece(dtype, shape);
    const int64_t bytes = piece.nbytes();
    const std::string& address = run.peers.at(p.peer);
    for (int c = 0; c < chunks_of(bytes); ++c) {
      const int64_t offset = c * kChunkBytes;
      const int64_t expected = std::min(kChunkBytes, bytes - offset);
      TESSERA_ASSIGN_OR_RETURN(Received data, transport.receive(p.peer, address, {run.op, p.tag, c, run.run_tag},
                                                                run.start, run.deadline, run.cancelled));
      if (data.size() != expected) {
        return absl::DataLossError(absl::StrCat("device ", p.peer, " sent ", data.size(), " bytes for chunk ", c,
                                                " of ", describe("receive", p), ", expected ", expected));
      }
      data.copy_to(piece.data() + offset);
    }
    copy_block_in(piece.data(), *out_shape, esize, p.box, out->data());
  }
  return std::shared_ptr<const HostArray>(std::move(out));
}

}  // namespace tessera

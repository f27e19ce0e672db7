#include "client/transfer.h"

#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/slicing.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"

namespace tessera::internal {

absl::Status put_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const HostView& global,
                       const Index& index, const std::string& who) {
  const int64_t elem = dtype_size(global.dtype);
  const Shape shape = block_shape(index);
  const int64_t bytes = num_elements(shape) * elem;
  // A contiguous block streams straight from the global array; others are gathered first.
  HostArray gathered;
  const std::byte* src = nullptr;
  const int64_t offset = contiguous_block_offset(global.shape, index);
  const auto* global_data = static_cast<const std::byte*>(global.data);
  if (offset >= 0) {
    src = global_data + offset * elem;
  } else {
    gathered = HostArray(global.dtype, shape);
    copy_block_out(global_data, global.shape, elem, index, gathered.data());
    src = gathered.data();
  }

  grpc::ClientContext ctx;
  set_deadline(&ctx, transfer_deadline(bytes));
  pb::PutShardReply reply;
  std::unique_ptr<grpc::ClientWriter<pb::ShardChunk>> writer = stub->PutShard(&ctx, &reply);
  pb::ShardChunk chunk;
  pb::ShardHeader* header = chunk.mutable_header();
  header->set_buffer_id(buffer_id);
  header->set_grant(grant);
  header->set_dtype(to_proto(global.dtype));
  to_proto(shape, header->mutable_shape());
  int64_t sent = 0;
  do {
    const int64_t n = std::min(kMaxChunkBytes, bytes - sent);
    chunk.set_data(src + sent, static_cast<size_t>(n));
    sent += n;
    // A failed write means the stream is broken; Finish() says why.
    if (!writer->Write(chunk)) break;
    chunk.clear_header();
  } while (sent < bytes);
  writer->WritesDone();
  return from_grpc(writer->Finish(), who);
}

absl::Status get_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const Index& index,
                       const MutableHostView& global, const std::string& who) {
  const int64_t elem = dtype_size(global.dtype);
  const Shape shape = block_shape(index);
  const int64_t bytes = num_elements(shape) * elem;
  HostArray staging;
  std::byte* dst = nullptr;
  const int64_t offset = contiguous_block_offset(global.shape, index);
  auto* global_data = static_cast<std::byte*>(global.data);
  if (offset >= 0) {
    dst = global_data + offset * elem;
  } else {
    staging = HostArray(global.dtype, shape);
    dst = staging.data();
  }

  grpc::ClientContext ctx;
  set_deadline(&ctx, transfer_deadline(bytes));
  pb::GetShardRequest req;
  req.set_buffer_id(buffer_id);
  req.set_grant(grant);
  std::unique_ptr<grpc::ClientReader<pb::ShardChunk>> reader = stub->GetShard(&ctx, req);
  pb::ShardChunk chunk;
  int64_t received = 0;
  absl::Status status;
  bool first = true;
  while (status.ok() && reader->Read(&chunk)) {
    if (first) {
      first = false;
      absl::StatusOr<DType> dtype = dtype_from_proto(chunk.header().dtype());
      Shape got(chunk.header().shape().dims().begin(), chunk.header().shape().dims().end());
      if (!dtype.ok() || *dtype != global.dtype || got != shape) {
        status = absl::DataLossError(absl::StrCat(
            who, ": buffer ", buffer_id, " holds ", dtype.ok() ? dtype_name(*dtype) : "an unknown dtype", " ",
            shape_to_string(got), ", expected ", dtype_name(global.dtype), " ", shape_to_string(shape)));
        ctx.TryCancel();
        break;
      }
    }
    const int64_t n = static_cast<int64_t>(chunk.data().size());
    if (n > bytes - received) {
      status = absl::DataLossError(absl::StrCat(who, ": buffer ", buffer_id, " sent more than its ", bytes, " bytes"));
      ctx.TryCancel();
      break;
    }
    if (n > 0) std::memcpy(dst + received, chunk.data().data(), static_cast<size_t>(n));
    received += n;
  }
  absl::Status finish = from_grpc(reader->Finish(), who);
  if (!status.ok()) return status;
  TESSERA_RETURN_IF_ERROR(finish);
  if (received != bytes) {
    return absl::DataLossError(absl::StrCat(who, ": buffer ", buffer_id, " sent ", received, " of ", bytes, " bytes"));
  }
  if (offset < 0) copy_block_in(staging.data(), global.shape, elem, index, global_data);
  return absl::OkStatus();
}

absl::Status run_parallel(int n, const std::function<absl::Status(int)>& task) {
  std::vector<absl::Status> results(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { results[i] = task(i); });
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : results) {
    TESSERA_RETURN_IF_ERROR(s);
  }
  return absl::OkStatus();
}

}  // namespace tessera::internal

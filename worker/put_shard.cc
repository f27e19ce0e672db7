#include "worker/put_shard.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"
#include "proto/tessera.pb.h"

namespace tessera {

absl::StatusOr<ArrayType> put_shard_type(const pb::ShardHeader& header) {
  if (header.buffer_id() == 0) return absl::InvalidArgumentError("PutShard: buffer id 0 is reserved");
  TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(header.dtype()));
  TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(header.shape(), dtype));
  return ArrayType{dtype, std::move(shape)};
}

absl::Status read_put_shard(pb::ShardChunk* chunk, const std::function<bool(pb::ShardChunk*)>& next, HostArray* data) {
  return PutShardStream(chunk, next, data).finish();
}

absl::Status PutShardStream::take() {
  if (index_ > 0 && chunk_->has_header()) {
    return absl::InvalidArgumentError(absl::StrCat("PutShard: message ", index_, " repeats the header"));
  }
  const int64_t n = static_cast<int64_t>(chunk_->data().size());
  if (n > kMaxChunkBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("PutShard: chunk ", index_, " holds ", n, " bytes; the limit is ", kMaxChunkBytes));
  }
  if (n > data_->nbytes() - offset_) {
    return absl::InvalidArgumentError(absl::StrCat("PutShard: more data than the shape ",
                                                   shape_to_string(data_->shape()), " of ", dtype_name(data_->dtype()),
                                                   " holds (", data_->nbytes(), " bytes)"));
  }
  if (n > 0) std::memcpy(data_->data() + offset_, chunk_->data().data(), static_cast<size_t>(n));
  offset_ += n;
  pending_ = false;
  return absl::OkStatus();
}

absl::Status PutShardStream::short_of_shard() const {
  return absl::InvalidArgumentError(absl::StrCat("PutShard: received ", offset_, " bytes but the shape ",
                                                 shape_to_string(data_->shape()), " of ", dtype_name(data_->dtype()),
                                                 " needs ", data_->nbytes()));
}

absl::Status PutShardStream::read_until(int64_t bytes) {
  while (offset_ < bytes) {
    if (!pending_) {
      if (ended_ || !next_(chunk_)) {
        ended_ = true;
        return short_of_shard();
      }
      ++index_;
      pending_ = true;
    }
    TESSERA_RETURN_IF_ERROR(take());
  }
  return absl::OkStatus();
}

absl::Status PutShardStream::finish() {
  while (true) {
    if (!pending_) {
      if (ended_ || !next_(chunk_)) break;
      ++index_;
      pending_ = true;
    }
    TESSERA_RETURN_IF_ERROR(take());
  }
  ended_ = true;
  if (offset_ != data_->nbytes()) return short_of_shard();
  return absl::OkStatus();
}

}  // namespace tessera

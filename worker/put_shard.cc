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
  int64_t offset = 0;
  int64_t index = 0;
  do {
    if (index > 0 && chunk->has_header()) {
      return absl::InvalidArgumentError(absl::StrCat("PutShard: message ", index, " repeats the header"));
    }
    const int64_t n = static_cast<int64_t>(chunk->data().size());
    if (n > kMaxChunkBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("PutShard: chunk ", index, " holds ", n, " bytes; the limit is ", kMaxChunkBytes));
    }
    if (n > data->nbytes() - offset) {
      return absl::InvalidArgumentError(absl::StrCat("PutShard: more data than the shape ",
                                                     shape_to_string(data->shape()), " of ", dtype_name(data->dtype()),
                                                     " holds (", data->nbytes(), " bytes)"));
    }
    if (n > 0) std::memcpy(data->data() + offset, chunk->data().data(), static_cast<size_t>(n));
    offset += n;
    ++index;
  } while (next(chunk));
  if (offset != data->nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("PutShard: received ", offset, " bytes but the shape ",
                                                   shape_to_string(data->shape()), " of ", dtype_name(data->dtype()),
                                                   " needs ", data->nbytes()));
  }
  return absl::OkStatus();
}

}  // namespace tessera

// PutShard's stream, decoded: the shard header of the first message, then every message's data
// into the shard, each checked against what the header declared. No gRPC here, so that the
// fuzz target (fuzz/put_shard_fuzzer.cc) runs the very code the worker does.
//
//   TESSERA_ASSIGN_OR_RETURN(ArrayType type, put_shard_type(first.header()));
//   HostArray data(type.dtype, type.shape);
//   TESSERA_RETURN_IF_ERROR(read_put_shard(&first, [&](pb::ShardChunk* c) { return reader->Read(c); }, &data));
#ifndef TESSERA_WORKER_PUT_SHARD_H_
#define TESSERA_WORKER_PUT_SHARD_H_

#include <functional>

#include "absl/status/statusor.h"
#include "core/host_array.h"
#include "core/op.h"

namespace tessera {
namespace pb {
class ShardHeader;
class ShardChunk;
}  // namespace pb

// The type of the shard a header announces. INVALID_ARGUMENT for the reserved buffer id 0, an
// unknown dtype or an invalid shape (core/wire.h's shape_from_proto: its bytes fit int64).
absl::StatusOr<ArrayType> put_shard_type(const pb::ShardHeader& header);

// Copies the data of `chunk` (the stream's first message) and of every message `next` reads
// into `data`, in order, until `next` returns false. INVALID_ARGUMENT when a later message
// repeats the header, a message holds more than kMaxChunkBytes, or the data does not fill
// `data` exactly.
absl::Status read_put_shard(pb::ShardChunk* chunk, const std::function<bool(pb::ShardChunk*)>& next, HostArray* data);

}  // namespace tessera

#endif  // TESSERA_WORKER_PUT_SHARD_H_

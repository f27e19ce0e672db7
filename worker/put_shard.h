// PutShard's stream, decoded: the shard header of the first message, then every message's data
// into the shard, each checked against what the header declared. No gRPC here, so that the
// fuzz target (fuzz/put_shard_fuzzer.cc) runs the very code the worker does.
//
//   TESSERA_ASSIGN_OR_RETURN(ArrayType type, put_shard_type(first.header()));
//   HostArray data(type.dtype, type.shape);
//   TESSERA_RETURN_IF_ERROR(read_put_shard(&first, [&](pb::ShardChunk* c) { return reader->Read(c); }, &data));
//
// A fan-out's uploader reads its stream piecemeal instead (PutShardStream), forwarding each
// part of the shard as soon as it is in:
//   PutShardStream stream(&first, next, &data);
//   TESSERA_RETURN_IF_ERROR(stream.read_until(bytes));   // ... then stream.finish()
#ifndef TESSERA_WORKER_PUT_SHARD_H_
#define TESSERA_WORKER_PUT_SHARD_H_

#include <cstdint>
#include <functional>
#include <utility>

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

// read_put_shard in steps, with the same checks and errors: read_until(b) copies messages until
// the first b bytes of the shard are in (an error if the stream ends before), finish() reads
// the rest and checks the data fills the shard exactly. `chunk`, `next` and `data` must outlive
// it; `chunk` holds the stream's first message, not yet read into `data`.
class PutShardStream {
 public:
  PutShardStream(pb::ShardChunk* chunk, std::function<bool(pb::ShardChunk*)> next, HostArray* data)
      : chunk_(chunk), next_(std::move(next)), data_(data) {}

  absl::Status read_until(int64_t bytes);
  absl::Status finish();
  // The shard's bytes copied so far.
  int64_t received() const { return offset_; }

 private:
  // Copies the message in *chunk_ (its index_) into data_.
  absl::Status take();
  // The error for a stream that ended with offset_ bytes of the shard.
  absl::Status short_of_shard() const;

  pb::ShardChunk* const chunk_;
  const std::function<bool(pb::ShardChunk*)> next_;
  HostArray* const data_;
  int64_t offset_ = 0;
  int64_t index_ = 0;    // of the message in *chunk_
  bool pending_ = true;  // *chunk_ holds a message not yet taken
  bool ended_ = false;   // next_ returned false
};

}  // namespace tessera

#endif  // TESSERA_WORKER_PUT_SHARD_H_

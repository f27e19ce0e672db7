// Fuzz target: a PutShard stream as a worker reads it (worker_server.cc's PutShard: the
// header's type, the reservation in the device's store, then every chunk's data).
//
// The input is a run of ShardChunk messages, each preceded by its length (two bytes, little
// endian). The shard is stored only when the stream fills it exactly, with the bytes sent.
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"
#include "worker/buffer_store.h"
#include "worker/put_shard.h"

using namespace tessera;

namespace {

// Reads the next length-prefixed chunk of the input; false at its end or on bytes that are no
// ShardChunk (as gRPC ends a stream it cannot parse).
struct ChunkReader {
  const uint8_t* data;
  size_t size;
  size_t pos = 0;
  std::string sent;  // the data of every chunk read

  bool next(pb::ShardChunk* chunk) {
    if (pos + 2 > size) return false;
    const size_t length = std::min<size_t>(data[pos] | data[pos + 1] << 8, size - pos - 2);
    const bool ok = chunk->ParseFromArray(data + pos + 2, static_cast<int>(length));
    pos += 2 + length;
    if (ok) sent += chunk->data();
    return ok;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ChunkReader reader{data, size, 0, {}};
  pb::ShardChunk chunk;
  if (!reader.next(&chunk) || !chunk.has_header()) return 0;  // answered before any decoding
  absl::StatusOr<ArrayType> type = put_shard_type(chunk.header());
  fuzz::check_rejection(type.status(), "put_shard_type");
  if (!type.ok()) return 0;
  BufferStore store(int64_t{1} << 20);             // a 1 MiB device
  const uint64_t id = chunk.header().buffer_id();  // (reading the next chunks overwrites `chunk`)
  const int64_t bytes = num_elements(type->shape) * dtype_size(type->dtype);
  absl::Status reserved = store.reserve(id, bytes);
  fuzz::check_rejection(reserved, "reserve", {absl::StatusCode::kResourceExhausted});
  if (!reserved.ok()) return 0;
  auto shard = std::make_shared<HostArray>(type->dtype, type->shape);
  absl::Status read = read_put_shard(
      &chunk, [&reader](pb::ShardChunk* c) { return reader.next(c); }, shard.get());
  fuzz::check_rejection(read, "read_put_shard");
  if (!read.ok()) {
    store.cancel(id);
    return 0;
  }
  fuzz::check(static_cast<int64_t>(reader.sent.size()) == shard->nbytes(), "stored a shard the stream did not fill");
  fuzz::check(reader.sent.empty() || std::memcmp(reader.sent.data(), shard->data(), reader.sent.size()) == 0,
              "the shard's bytes are not those sent");
  store.commit(id, std::move(shard));
  return 0;
}

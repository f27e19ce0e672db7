// Shard transfers between this process and a worker, in chunks of at most kMaxChunkBytes,
// straight from and into the global host array when the block is contiguous there.
#ifndef TESSERA_CLIENT_TRANSFER_H_
#define TESSERA_CLIENT_TRANSFER_H_

#include <cstddef>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "core/host_array.h"
#include "core/sharding.h"
#include "core/shm_transfer.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera::internal {

// A replicated block of at least this many bytes on workers of other processes is uploaded
// once and fanned out by the workers (ShardHeader.fan_out); a smaller one goes to each replica
// from here (a broadcast costs a round of messages more than it saves).
inline constexpr int64_t kFanOutMinBytes = 256 << 10;

// The calls of one device_put that fan blocks out: the first to fail cancels the others, whose
// workers would otherwise wait out the broadcast's deadline for a member that is gone (an
// uploader that died before it ever sent them anything). Thread-safe.
class PutCalls {
 public:
  // Registers `ctx` until done(ctx); cancels it at once if a call failed already.
  void start(grpc::ClientContext* ctx);
  // Unregisters `ctx`; the first failure cancels the calls still registered.
  void done(grpc::ClientContext* ctx, const absl::Status& status);
  // The first failure (what the others' cancellations follow from), or OK.
  absl::Status first_error() const;

 private:
  mutable absl::Mutex mu_;
  std::set<grpc::ClientContext*> running_ ABSL_GUARDED_BY(mu_);
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
};

// How shards travel between this process and one worker.
enum class TransferPath {
  kStream,        // PutShard / GetShard streams of chunks
  kHandoff,       // the worker is in this process: a buffer handed over (core/handoff.h)
  kSharedMemory,  // the worker is on this host: through a memfd of ours (core/shm_transfer.h)
};

// A replicated block's one memfd, for replicas that all take shared memory: the first of their
// calls to need it creates and writes it, every replica's worker reads it (copies it out, or,
// sealed, adopts its pages). Thread-safe.
class SharedSegment {
 public:
  // The segment holding block `index` of `global`, written once (the same for every caller:
  // the first caller's error too); `seal`: sealed for adoption (PutRoute::adopt).
  absl::StatusOr<const ShmSegment*> get(const HostView& global, const Index& index, bool seal);
  // Keeps the segment for later transfers unless sealed. REQUIRES: every replica's call ended OK.
  void release();

 private:
  absl::Mutex mu_;
  std::optional<absl::StatusOr<ShmSegment>> segment_ ABSL_GUARDED_BY(mu_);
};

// How one device's put travels, besides the default (its own copy of the block, streamed, or
// handed over when the worker is in this process).
struct PutRoute {
  // The block's fan-out: `uploader` sends the data with it, every other member the header alone.
  const pb::ShardFanOut* fan_out = nullptr;
  bool uploader = false;
  PutCalls* calls = nullptr;  // with a fan-out: the put's calls
  // In process: the block waits already under this handoff token, deposited once for all its
  // replicas (Handoff::deposit with a taker each; the caller withdraws it afterwards).
  uint64_t handoff = 0;
  // On this host: the block's memfd, shared by its replicas (each worker reads it; no fan-out).
  SharedSegment* segment = nullptr;
  // On this host: seal the memfd so that the workers adopt its pages instead of copying them
  // out (ConnectOptions::adopt_puts).
  bool adopt = false;
};

// The positions in `shards` of each distinct block's replicas, blocks in order of first
// appearance, replicas in `shards`' order.
std::vector<std::vector<size_t>> replicas_by_block(const std::vector<DeviceShard>& shards);

// Uploads block `index` of `global` as buffer `buffer_id`. Errors are prefixed with `who`.
// REQUIRES: validate_view(global) and validate_index(index, global.shape) are OK.
// `grant`: the array's (ArrayInfo.grant), which the worker checks. `path` kHandoff: the block
// is copied once into a buffer handed over to the worker (core/handoff.h); kSharedMemory: a
// contiguous block is read by the worker straight from `global` (a memfd naming it:
// ShmSegment::create_direct), any other copied once into a memfd the worker reads once (a
// fan-out's uploader's too); else streamed. REQUIRES with kSharedMemory: `global` unchanged
// until the call returns.
absl::Status put_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const HostView& global,
                       const Index& index, const std::string& who, TransferPath path = TransferPath::kStream,
                       const PutRoute& route = {});

// Downloads buffer `buffer_id` into block `index` of `global`, checking that the worker's
// dtype and shape are the ones expected (DATA_LOSS otherwise). Same REQUIRES. `path` kHandoff:
// asks the worker to hand its buffer over, copied once into `global`; kSharedMemory: the
// worker writes a block contiguous in `global` straight there (process_vm_writev, once it has
// seen that this process holds the call's connection; ShmSegment::create_direct, withdrawn
// before this returns, whatever the outcome), any other into a memfd of ours, read once into
// `global` (so too every block once a worker refused the first way: FAILED_PRECONDITION, and
// every block of a worker that does not announce it, `direct` false:
// HandshakeReply.writes_client_memory).
absl::Status get_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const Index& index,
                       const MutableHostView& global, const std::string& who, TransferPath path = TransferPath::kStream,
                       bool direct = false);

// Runs task(0) .. task(n - 1) on their own threads; returns the first error by task index.
absl::Status run_parallel(int n, const std::function<absl::Status(int)>& task);

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_TRANSFER_H_

#include "client/transfer.h"

#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/handoff.h"
#include "core/shm_transfer.h"
#include "core/slicing.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/in_process.h"
#include "proto/rpc.h"

namespace tessera::internal {

namespace {

void fill_header(uint64_t buffer_id, const std::string& grant, DType dtype, const Shape& shape,
                 pb::ShardHeader* header) {
  header->set_buffer_id(buffer_id);
  header->set_grant(grant);
  header->set_dtype(to_proto(dtype));
  to_proto(shape, header->mutable_shape());
}

// Registers a call with a put's PutCalls (if any) for its lifetime.
class CallScope {
 public:
  CallScope(PutCalls* calls, grpc::ClientContext* ctx) : calls_(calls), ctx_(ctx) {
    if (calls_ != nullptr) calls_->start(ctx_);
  }
  ~CallScope() {
    if (calls_ != nullptr) calls_->done(ctx_, status_);
  }
  absl::Status finish(absl::Status status) {
    status_ = status;
    return status;
  }

 private:
  PutCalls* const calls_;
  grpc::ClientContext* const ctx_;
  absl::Status status_;
};

// A PutShard of `header` alone: the bytes wait under handoff `token` (0: none; a fan-out
// member's come from its peers).
absl::Status put_header(pb::Worker::Stub* stub, const pb::ShardHeader& header, uint64_t token, absl::Duration deadline,
                        const std::string& who, PutCalls* calls) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, deadline);
  if (token != 0) ctx.AddMetadata(kHandoffKey, absl::StrCat(token));
  CallScope scope(calls, &ctx);
  pb::PutShardReply reply;
  std::unique_ptr<grpc::ClientWriter<pb::ShardChunk>> writer = stub->PutShard(&ctx, &reply);
  pb::ShardChunk chunk;
  *chunk.mutable_header() = header;
  writer->Write(chunk);  // a failure shows in Finish()
  writer->WritesDone();
  return scope.finish(from_grpc(writer->Finish(), who));
}

// The buffer a GetShard's worker handed over (the token in its initial metadata), or nullptr.
std::shared_ptr<const HostArray> take_handed_over(const grpc::ClientContext& ctx) {
  const auto& md = ctx.GetServerInitialMetadata();
  auto it = md.find(kHandoffKey);
  uint64_t token = 0;
  if (it == md.end() || !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &token)) {
    return nullptr;
  }
  return Handoff::take(token);
}

// `status` with `who: ` before its message.
absl::Status with_who(const absl::Status& status, const std::string& who) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(who, ": ", status.message()));
}
template <typename T>
absl::StatusOr<T> with_who(absl::StatusOr<T> value, const std::string& who) {
  if (!value.ok()) return with_who(value.status(), who);
  return value;
}

// Memfds of transfers that ended well (the worker answered, so it has closed its fd), kept for
// the next transfer of a size they hold: their pages stay allocated, and allocating a fresh
// segment's pages costs more than writing them (bench_transfer). Adopted puts
// (ConnectOptions::adopt_puts) neither take nor give back: their segments become the workers'
// buffers, sealed. At most kPooledSegments
// segments of at least kMinPooledBytes each, kPooledBytes of capacity in all; a segment is
// reused for blocks of half its capacity or more.
class SegmentPool {
 public:
  static constexpr int64_t kPooledBytes = int64_t{1} << 30;
  static constexpr int64_t kMinPooledBytes = int64_t{64} << 10;
  static constexpr size_t kPooledSegments = 64;

  static SegmentPool& instance() {
    static SegmentPool* const pool = new SegmentPool;
    return *pool;
  }

  absl::StatusOr<ShmSegment> take(int64_t bytes) {
    {
      absl::MutexLock lock(&mu_);
      auto it = by_capacity_.lower_bound(bytes);
      if (it != by_capacity_.end() && it->first <= 2 * bytes) {
        ShmSegment segment = std::move(it->second);
        by_capacity_.erase(it);
        held_ -= segment.capacity();
        if (segment.reuse(bytes).ok()) return segment;
      }
    }
    return ShmSegment::create(bytes);
  }

  // REQUIRES: no worker holds `segment` (its call ended OK).
  void give_back(ShmSegment segment) {
    absl::MutexLock lock(&mu_);
    if (segment.sealed() || segment.direct() || segment.capacity() < kMinPooledBytes ||
        held_ + segment.capacity() > kPooledBytes || by_capacity_.size() >= kPooledSegments) {
      return;  // closed here
    }
    held_ += segment.capacity();
    by_capacity_.emplace(segment.capacity(), std::move(segment));
  }

 private:
  absl::Mutex mu_;
  std::multimap<int64_t, ShmSegment> by_capacity_ ABSL_GUARDED_BY(mu_);
  int64_t held_ ABSL_GUARDED_BY(mu_) = 0;
};

// Set once a worker of this host refused to read a put's block from this process's memory
// (direct_put_refused), or to write a fetch's block into it (direct_fetch_refused), with
// FAILED_PRECONDITION (ShmSegment::create_direct: it may not ptrace us, cannot tell that we
// are its caller, or runs --shm_client_memory=false): later puts, or fetches, copy their
// blocks through the memfd instead. Apart, since a worker may take one and not the other.
std::atomic<bool> direct_put_refused{false};
std::atomic<bool> direct_fetch_refused{false};

// Sets `refused` (direct_put_refused or direct_fetch_refused), saying why the first time: the
// transfers that follow are slower (one more copy), which the user should be able to tell.
void stop_direct(std::atomic<bool>& refused, const char* transfers, const absl::Status& why) {
  if (refused.exchange(true, std::memory_order_relaxed)) return;
  std::fprintf(stderr, "tessera client: %s; this process's later %s copy their blocks through a memfd\n",
               std::string(why.message()).c_str(), transfers);
}

// A memfd for block `index` of `global`. A contiguous block that is not to be sealed, while no
// worker refused it (`direct`, direct_put_refused): a segment naming the block where it is in
// `global` (ShmSegment::create_direct), which the workers read from there: no copy here.
// Else the block written into it: straight from `global` when the block is contiguous there,
// else gathered first. `seal`: a fresh one, sealed, for the workers to adopt
// (core/shm_transfer.h); else one from the pool, which they copy out.
absl::StatusOr<ShmSegment> write_segment(const HostView& global, const Index& index, bool seal, bool direct = true) {
  const int64_t elem = dtype_size(global.dtype);
  const Shape shape = block_shape(index);
  const int64_t bytes = num_elements(shape) * elem;
  const auto* global_data = static_cast<const std::byte*>(global.data);
  const int64_t offset = contiguous_block_offset(global.shape, index);
  if (direct && !seal && offset >= 0 && bytes > 0 && !direct_put_refused.load(std::memory_order_relaxed)) {
    return ShmSegment::create_direct(global_data + offset * elem, bytes);
  }
  TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, seal ? ShmSegment::create(bytes) : SegmentPool::instance().take(bytes));
  if (offset >= 0) {
    TESSERA_RETURN_IF_ERROR(segment.write_block(global_data + offset * elem));
  } else {
    HostArray gathered(global.dtype, shape);
    copy_block_out(global_data, global.shape, elem, index, gathered.data());
    TESSERA_RETURN_IF_ERROR(segment.write_block(gathered.data()));
  }
  if (seal) TESSERA_RETURN_IF_ERROR(segment.seal());
  return segment;
}

// Names `segment`, a memfd of this process, for a worker of this host.
void name_segment(const ShmSegment& segment, pb::ShmSegment* named) {
  named->set_pid(getpid());
  named->set_fd(segment.fd());
  named->set_token(segment.token());
}

// One GetShard of block `index` into `global`: streamed (no `segment`), handed over in process
// (TransferPath::kHandoff), or written by the worker into `segment`, named on the request: a
// memfd, which the caller then reads the block out of, or a direct one naming the block's
// place in `global`, where the worker writes it (the caller withdraws it afterwards).
absl::Status receive_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const Index& index,
                           const MutableHostView& global, const std::string& who, TransferPath path,
                           const ShmSegment* segment) {
  const bool same_process = path == TransferPath::kHandoff;
  const int64_t elem = dtype_size(global.dtype);
  const Shape shape = block_shape(index);
  const int64_t bytes = num_elements(shape) * elem;
  const int64_t offset = contiguous_block_offset(global.shape, index);
  auto* global_data = static_cast<std::byte*>(global.data);
  HostArray staging;
  std::byte* dst = nullptr;                 // where streamed chunks go, set at the first one
  std::shared_ptr<const HostArray> handed;  // the worker's buffer, when it hands it over

  grpc::ClientContext ctx;
  set_deadline(&ctx, transfer_deadline(bytes));
  if (same_process) ctx.AddMetadata(kHandoffKey, kHandoffFetch);
  pb::GetShardRequest req;
  req.set_buffer_id(buffer_id);
  req.set_grant(grant);
  if (segment != nullptr) name_segment(*segment, req.mutable_shm());
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
      if (same_process) handed = take_handed_over(ctx);
      if (segment != nullptr && !chunk.header().has_shm()) {
        status = absl::DataLossError(
            absl::StrCat(who, ": buffer ", buffer_id, " was streamed, not written into the shared memory asked for"));
        ctx.TryCancel();
        break;
      }
      if (offset >= 0) {
        dst = global_data + offset * elem;
      } else if (handed == nullptr && segment == nullptr) {
        staging = HostArray(global.dtype, shape);
        dst = staging.data();
      }
    }
    const int64_t n = static_cast<int64_t>(chunk.data().size());
    if (segment != nullptr && n > 0) {
      status = absl::DataLossError(
          absl::StrCat(who, ": buffer ", buffer_id, " sent ", n, " bytes on its stream besides the shared memory"));
      ctx.TryCancel();
      break;
    }
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
  if (segment != nullptr) {
    if (first) {
      return absl::DataLossError(
          absl::StrCat(who, ": buffer ", buffer_id, " ended its stream without the header of the shared memory"));
    }
    return absl::OkStatus();
  }
  if (handed != nullptr && received == 0 && handed->nbytes() == bytes) {
    // The one copy, from the worker's buffer (which it keeps) into the caller's array.
    copy_block_in(handed->data(), global.shape, elem, index, global_data);
    return absl::OkStatus();
  }
  if (received != bytes) {
    return absl::DataLossError(absl::StrCat(who, ": buffer ", buffer_id, " sent ", received, " of ", bytes, " bytes"));
  }
  if (offset < 0) copy_block_in(staging.data(), global.shape, elem, index, global_data);
  return absl::OkStatus();
}

// get_shard through a memfd of the pool that the worker writes the block into (pwrite) and
// this process copies it out of, into the caller's array.
absl::Status get_shard_through_memfd(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant,
                                     const Index& index, const MutableHostView& global, const std::string& who) {
  const int64_t elem = dtype_size(global.dtype);
  const Shape shape = block_shape(index);
  const int64_t offset = contiguous_block_offset(global.shape, index);
  auto* global_data = static_cast<std::byte*>(global.data);
  TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, with_who(SegmentPool::instance().take(num_elements(shape) * elem), who));
  TESSERA_RETURN_IF_ERROR(
      receive_shard(stub, buffer_id, grant, index, global, who, TransferPath::kSharedMemory, &segment));
  // The one copy, from the segment into the caller's array.
  if (offset >= 0) {
    TESSERA_RETURN_IF_ERROR(with_who(segment.read_block(global_data + offset * elem), who));
  } else {
    HostArray staging(global.dtype, shape);
    TESSERA_RETURN_IF_ERROR(with_who(segment.read_block(staging.data()), who));
    copy_block_in(staging.data(), global.shape, elem, index, global_data);
  }
  SegmentPool::instance().give_back(std::move(segment));
  return absl::OkStatus();
}

}  // namespace

std::vector<std::vector<size_t>> replicas_by_block(const std::vector<DeviceShard>& shards) {
  std::vector<std::vector<size_t>> blocks;
  std::map<std::vector<int64_t>, size_t> by_start;
  for (size_t i = 0; i < shards.size(); ++i) {
    std::vector<int64_t> key;
    for (const Slice& sl : shards[i].index) key.push_back(sl.start);
    auto [it, inserted] = by_start.emplace(std::move(key), blocks.size());
    if (inserted) blocks.emplace_back();
    blocks[it->second].push_back(i);
  }
  return blocks;
}

absl::Status put_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const HostView& global,
                       const Index& index, const std::string& who, TransferPath path, const PutRoute& route) {
  const int64_t elem = dtype_size(global.dtype);
  const Shape shape = block_shape(index);
  const int64_t bytes = num_elements(shape) * elem;
  const auto* global_data = static_cast<const std::byte*>(global.data);
  // A fan-out member waits through the upload and the broadcast, which the workers bound by
  // fan_out.timeout_ms: the call outlives that, so that their error (naming the device that
  // failed it) is what comes back.
  const absl::Duration deadline = route.fan_out != nullptr
                                      ? absl::Milliseconds(route.fan_out->timeout_ms()) + kControlDeadline
                                      : transfer_deadline(bytes);
  pb::ShardHeader header;
  fill_header(buffer_id, grant, global.dtype, shape, &header);
  if (route.fan_out != nullptr) *header.mutable_fan_out() = *route.fan_out;
  // Only the header travels: the buffer waits already (route.handoff), or the fan-out's
  // uploader brings the bytes.
  if (route.handoff != 0) return put_header(stub, header, route.handoff, kControlDeadline, who, nullptr);
  if (route.fan_out != nullptr && !route.uploader) return put_header(stub, header, 0, deadline, who, route.calls);
  // A worker that may not read our memory (FAILED_PRECONDITION) gets the block written into the
  // segment instead, and so do the later puts of this process.
  auto refused = [](const ShmSegment& segment, const absl::Status& status) {
    if (!segment.direct() || status.code() != absl::StatusCode::kFailedPrecondition) return false;
    stop_direct(direct_put_refused, "puts", status);
    return true;
  };
  // Through a memfd of this call's: the worker reads the block where the segment names it (in
  // `global`; `direct`, see write_segment), adopts the segment as its buffer (route.adopt:
  // sealed, never pooled again; its mapping keeps the pages once ours closes) or copies it
  // out, as a fan-out's uploader does before it broadcasts. The segment goes when both have
  // closed it.
  auto put_through = [&](bool direct) -> absl::Status {
    TESSERA_ASSIGN_OR_RETURN(ShmSegment segment, with_who(write_segment(global, index, route.adopt, direct), who));
    name_segment(segment, header.mutable_shm());
    absl::Status status = put_header(stub, header, 0, deadline, who, route.calls);
    if (refused(segment, status)) {
      TESSERA_ASSIGN_OR_RETURN(segment, with_who(write_segment(global, index, route.adopt, false), who));
      name_segment(segment, header.mutable_shm());
      status = put_header(stub, header, 0, deadline, who, route.calls);
    }
    if (status.ok()) SegmentPool::instance().give_back(std::move(segment));  // not if sealed or direct
    return status;
  };
  if (route.segment != nullptr) {
    TESSERA_ASSIGN_OR_RETURN(const ShmSegment* segment, with_who(route.segment->get(global, index, route.adopt), who));
    name_segment(*segment, header.mutable_shm());
    const absl::Status status = put_header(stub, header, 0, deadline, who, nullptr);
    return refused(*segment, status) ? put_through(/*direct=*/false) : status;
  }
  // A fan-out's uploader (route.calls) writes the block at once: a refusal would cancel the
  // members' calls.
  if (path == TransferPath::kSharedMemory) return put_through(/*direct=*/route.calls == nullptr);
  if (path == TransferPath::kHandoff) {
    // The worker keeps this copy: the one copy of the bytes.
    auto block = std::make_shared<HostArray>(global.dtype, shape);
    copy_block_out(global_data, global.shape, elem, index, block->data());
    absl::StatusOr<uint64_t> token = Handoff::deposit(std::move(block));
    if (token.ok()) {
      const absl::Status status =
          put_header(stub, header, *token, route.fan_out != nullptr ? deadline : kControlDeadline, who, route.calls);
      Handoff::withdraw(*token);  // not taken if the worker refused the put
      return status;
    }
  }
  // A contiguous block streams straight from the global array; others are gathered first.
  HostArray gathered;
  const std::byte* src = nullptr;
  const int64_t offset = contiguous_block_offset(global.shape, index);
  if (offset >= 0) {
    src = global_data + offset * elem;
  } else {
    gathered = HostArray(global.dtype, shape);
    copy_block_out(global_data, global.shape, elem, index, gathered.data());
    src = gathered.data();
  }

  grpc::ClientContext ctx;
  set_deadline(&ctx, deadline);
  CallScope scope(route.calls, &ctx);
  pb::PutShardReply reply;
  std::unique_ptr<grpc::ClientWriter<pb::ShardChunk>> writer = stub->PutShard(&ctx, &reply);
  pb::ShardChunk chunk;
  *chunk.mutable_header() = std::move(header);
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
  return scope.finish(from_grpc(writer->Finish(), who));
}

absl::Status get_shard(pb::Worker::Stub* stub, uint64_t buffer_id, const std::string& grant, const Index& index,
                       const MutableHostView& global, const std::string& who, TransferPath path, bool direct) {
  const int64_t elem = dtype_size(global.dtype);
  const int64_t bytes = num_elements(block_shape(index)) * elem;
  const int64_t offset = contiguous_block_offset(global.shape, index);
  auto* global_data = static_cast<std::byte*>(global.data);
  if (path != TransferPath::kSharedMemory)
    return receive_shard(stub, buffer_id, grant, index, global, who, path, nullptr);
  if (direct && offset >= 0 && bytes > 0 && !direct_fetch_refused.load(std::memory_order_relaxed)) {
    // Written by the worker where the block goes (process_vm_writev): no copy here.
    TESSERA_ASSIGN_OR_RETURN(ShmSegment segment,
                             with_who(ShmSegment::create_direct(global_data + offset * elem, bytes), who));
    const absl::Status status = receive_shard(stub, buffer_id, grant, index, global, who, path, &segment);
    // Whatever the outcome (a call that timed out may have a worker about to write), no worker
    // writes into the caller's array once this returns (it waits for a worker writing, warning
    // while that lasts; it aborts the process rather than return with the memory exposed).
    segment.withdraw(who);
    // FAILED_PRECONDITION: the worker may not write our memory, or cannot tell that we are the
    // caller: through a memfd, as are later fetches of this process once that worked. Any
    // other error is the fetch's (a worker that would refuse a segment naming memory for not
    // knowing it, session 29's, does not announce writes_client_memory and is never sent one).
    if (status.code() != absl::StatusCode::kFailedPrecondition) return status;
    const absl::Status copied = get_shard_through_memfd(stub, buffer_id, grant, index, global, who);
    if (copied.ok()) stop_direct(direct_fetch_refused, "fetches", status);
    return copied;
  }
  return get_shard_through_memfd(stub, buffer_id, grant, index, global, who);
}

void SharedSegment::release() {
  absl::MutexLock lock(&mu_);
  if (segment_.has_value() && segment_->ok()) {
    SegmentPool::instance().give_back(**std::move(segment_));  // not if sealed
  }
  segment_.reset();
}

absl::StatusOr<const ShmSegment*> SharedSegment::get(const HostView& global, const Index& index, bool seal) {
  absl::MutexLock lock(&mu_);  // the other replicas wait for the bytes they are to name
  if (!segment_.has_value()) segment_ = write_segment(global, index, seal);
  if (!segment_->ok()) return segment_->status();
  return &**segment_;
}

void PutCalls::start(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  if (!first_error_.ok()) ctx->TryCancel();
  running_.insert(ctx);
}

void PutCalls::done(grpc::ClientContext* ctx, const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  running_.erase(ctx);
  if (status.ok() || !first_error_.ok()) return;
  first_error_ = status;
  for (grpc::ClientContext* other : running_) other->TryCancel();
}

absl::Status PutCalls::first_error() const {
  absl::MutexLock lock(&mu_);
  return first_error_;
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

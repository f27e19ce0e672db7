#include "worker/worker_server.h"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "core/profile_wire.h"
#include "core/slicing.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "core/wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/health.h"
#include "proto/rpc.h"
#include "proto/rpc_errors.h"
#include "proto/tessera.grpc.pb.h"
#include "proto/write_queue.h"
#include "worker/buffer_store.h"
#include "worker/collectives/engine.h"
#include "worker/collectives/transport.h"
#include "worker/interpreter.h"
#include "worker/kernels/blas.h"
#include "worker/put_shard.h"

namespace tessera {
namespace {

// At most this many held buffers go in a registration (about 25 bytes each, well under the
// coordinator's 4 MiB message limit); the others cannot be adopted after a coordinator restart.
constexpr int kMaxHeldBuffersReported = 100'000;

// Runs of one RunPlans stream that may wait for the runs making their inputs at once.
constexpr size_t kMaxDeferredRuns = 4096;

// A plan as LoadPlan delivered it, with what every run of it needs.
struct LoadedPlan {
  DevicePlan plan;
  std::map<int, std::string> peers;  // device id -> address, for its collectives
  bool has_collectives = false;
  mutable std::atomic<uint64_t> last_run{0};  // when it was last loaded or run (a tick, for LRU)
};

using WorkerServiceBase =
    pb::Worker::WithCallbackMethod_RunPlans<pb::Worker::WithRawCallbackMethod_Exchange<pb::Worker::Service>>;

class WorkerService;

// The reactor of a stream refused at its start (an unauthenticated or unauthorised caller):
// it finishes with `status` at once and deletes itself when gRPC is done.
template <typename Reactor>
class Refused final : public Reactor {
 public:
  explicit Refused(const absl::Status& status) { this->Finish(to_grpc(status)); }
  void OnDone() override { delete this; }
};

// The server side of the coordinator's RunPlans stream: each request is a run (or the cancel
// of one); each run's result goes back as its own message when the run ends, in any order.
// Reads never wait for a run: the next read starts first, then a small local plan runs on the
// thread that read it, and every other plan on a thread of its own. A run whose inputs are
// outputs of runs sent before it on this stream and still going (the coordinator forwards a
// call naming an earlier call's outputs at once) waits, without a thread, until they ended:
// it starts on the thread that ended the last of them, after that one's result is queued,
// or fails at once with the error of one that failed. One write is in flight;
// results finished meanwhile queue behind it. The reactor owns itself (runs on threads hold
// it too) until gRPC is done with it; when the coordinator's side ends, runs in progress are
// told to stop and their results dropped.
class PlanStreamReactor final : public grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>,
                                public std::enable_shared_from_this<PlanStreamReactor> {
 public:
  static PlanStreamReactor* start(WorkerService* service) {
    std::shared_ptr<PlanStreamReactor> r(new PlanStreamReactor(service));
    r->self_ = r;
    r->StartRead(&r->request_);
    return r.get();
  }

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override {
    std::shared_ptr<PlanStreamReactor> self;
    absl::MutexLock lock(&mu_);
    for (auto& [execution, cancelled] : running_) *cancelled = true;
    self = std::move(self_);  // the last reference may be a run's, on its own thread
  }

  // Queues the result of request `id`; starts its write if none is in flight.
  void post(uint64_t id, const absl::Status& status);

 private:
  explicit PlanStreamReactor(WorkerService* service) : service_(service) {}

  // A run waiting for the runs before it on this stream that make its inputs.
  struct Deferred {
    std::shared_ptr<pb::RunPlanRequest> req;
    std::shared_ptr<const LoadedPlan> loaded;
    int waiting = 0;       // producers still going
    absl::Status failure;  // of the first that failed
  };

  // Starts `req` on a thread of the plan pool (it is in running_ and its inputs exist).
  void run_on_thread(std::shared_ptr<pb::RunPlanRequest> req, std::shared_ptr<const LoadedPlan> loaded);
  // Run `req` (one in running_) ended with `status`: posts its result, then starts the runs
  // that waited for it (or fails them with its error), and finishes the stream if it is done.
  void end_run(std::shared_ptr<pb::RunPlanRequest> req, absl::Status status);

  // Whether the stream is to be finished now: the reading ended, no write is in flight and no
  // run is left on a thread of its own (the server, and the service those runs use, wait for
  // Finish before they go). The caller calls Finish, outside the lock.
  bool finish_now_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!reading_ended_ || results_.writing() || finished_ || !running_.empty()) return false;
    finished_ = true;
    return true;
  }

  WorkerService* const service_;
  pb::PlanStreamRequest request_;  // the read in flight; touched only by the reading callback

  absl::Mutex mu_;
  WriteQueue<pb::RunPlanResult> results_ ABSL_GUARDED_BY(mu_);
  bool reading_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // Runs on threads of their own or waiting for their inputs, by execution, with the flag that
  // tells them to stop.
  std::map<uint64_t, std::shared_ptr<std::atomic<bool>>> running_ ABSL_GUARDED_BY(mu_);
  // Of those: the run making each output buffer, the runs waiting, and what each waits for.
  std::map<uint64_t, uint64_t> producing_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Deferred> deferred_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<uint64_t>> dependents_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<PlanStreamReactor> self_ ABSL_GUARDED_BY(mu_);
};

class WorkerService final : public WorkerServiceBase {
 public:
  explicit WorkerService(const WorkerOptions& options)
      : auth_(options.credentials),
        max_plans_(std::max(1, options.max_plans)),
        store_(options.memory_bytes),
        started_(absl::Now()),
        transport_(options.credentials),
        put_stall_timeout_(options.put_stall_timeout),
        plan_threads_("plan runs on threads of their own (--max_plan_threads)", std::max(1, options.max_plan_threads)) {
  }

  // "device N: " before an error's message.
  absl::Status on_this_device(const absl::Status& status) const {
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat("device ", device_id_.load(), ": ", status.message()));
  }

  // Cancels the PutShard streams that received nothing for put_stall_timeout (their
  // reservations are released as they end). Called by the heartbeat thread.
  void cancel_stalled_puts(absl::Time now) {
    absl::MutexLock lock(&puts_mu_);
    for (const std::shared_ptr<PutWatch>& w : puts_) {
      if (now - absl::FromUnixNanos(w->progress.load()) <= put_stall_timeout_ || w->cancelled) continue;
      w->cancelled = true;
      w->ctx->TryCancel();
    }
  }

  // The threads plans that may wait run on (see PlanStreamReactor).
  ThreadPool& plan_threads() { return plan_threads_; }
  const CollectiveMetrics& collective_metrics() const { return transport_.collective_metrics(); }
  // Whether `req` may run on the thread at hand now that its inputs exist (see plan_for).
  bool may_run_inline(const LoadedPlan& plan, const pb::RunPlanRequest& req) const { return runs_inline(plan, req); }

  void set_device_id(int id) {
    device_id_ = id;
    transport_.set_self(id);
  }
  void set_incarnation(uint64_t incarnation) { incarnation_ = incarnation; }

  // Before serving: the collectives' paths and algorithms (see WorkerOptions).
  absl::Status configure_collectives(const WorkerOptions& options) {
    if (!options.all_reduce_algorithm.empty()) {
      std::optional<Algorithm> forced = algorithm_from_name(options.all_reduce_algorithm);
      if (!forced.has_value() || *forced == Algorithm::kChain) {
        return absl::InvalidArgumentError(absl::StrCat("tessera-worker: --all_reduce_algorithm '",
                                                       options.all_reduce_algorithm,
                                                       "' is none of tree, recursive_doubling, direct, ring"));
      }
      transport_.force_all_reduce(forced);
    }
    MailboxOptions mailbox;
    mailbox.bytes_per_peer = options.mailbox_bytes_per_peer;
    mailbox.unclaimed_ttl = options.mailbox_ttl;
    mailbox.reserve = [this](int64_t bytes) { return store_.charge(bytes); };
    mailbox.release = [this](int64_t bytes) { store_.uncharge(bytes); };
    TESSERA_RETURN_IF_ERROR(transport_.set_mailbox(std::move(mailbox)));
    return transport_.set_shm({options.shm, options.shm_ring_bytes, options.shm_host});
  }

  // Every buffer this device holds, for a registration.
  std::map<uint64_t, std::shared_ptr<const HostArray>> held_buffers() const { return store_.contents(); }

  // Forgets the plans of earlier coordinator incarnations: every id below `epoch` is theirs,
  // and nothing will run those plans again.
  void drop_plans_before(uint64_t epoch) {
    absl::MutexLock lock(&plans_mu_);
    plans_.erase(plans_.begin(), plans_.lower_bound(epoch));
  }

  grpc::Status Handshake(grpc::ServerContext* ctx, const pb::HandshakeRequest* req,
                         pb::HandshakeReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_protocol_version(kProtocolVersion);
    reply->set_server(absl::StrCat("tessera-worker device ", device_id_.load()));
    return to_grpc(check_protocol_version(req->protocol_version(), absl::StrCat("client '", req->peer(), "'")));
  }

  grpc::Status PutShard(grpc::ServerContext* ctx, grpc::ServerReader<pb::ShardChunk>* reader,
                        pb::PutShardReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    pb::ShardChunk chunk;
    if (!reader->Read(&chunk)) return to_grpc(absl::InvalidArgumentError("PutShard: empty stream"));
    if (!chunk.has_header()) {
      return to_grpc(absl::InvalidArgumentError("PutShard: the first message must carry the shard header"));
    }
    if (!caller->at_least(Role::kDaemon)) {
      absl::Status granted = auth_.check_grant(chunk.header().buffer_id(), chunk.header().grant(), "PutShard");
      if (!granted.ok()) return to_grpc(on_this_device(granted));
    }
    ProfileSpan span(&transport_.profile(), "transfer", [] { return std::string("put_shard"); });
    absl::StatusOr<std::shared_ptr<HostArray>> data = begin_put(chunk.header());
    if (!data.ok()) return to_grpc(data.status());
    const uint64_t id = chunk.header().buffer_id();
    if (span) {
      span.arg("buffer", absl::StrCat(id));
      span.arg("bytes", absl::StrCat((*data)->nbytes()));
    }
    // Watched while it holds its reservation: a stream that stalls is cancelled (see
    // cancel_stalled_puts), and the reservation goes with it.
    std::shared_ptr<PutWatch> watch = watch_put(ctx);
    absl::Status status = read_put_shard(
        &chunk,
        [reader, &watch](pb::ShardChunk* next) {
          const bool more = reader->Read(next);
          watch->progress = absl::ToUnixNanos(absl::Now());
          return more;
        },
        data->get());
    unwatch_put(watch);
    if (!status.ok() || watch->cancelled) {
      store_.cancel(id);
      if (watch->cancelled) {
        status = absl::DeadlineExceededError(absl::StrCat("PutShard: buffer ", id, " received no data for ",
                                                          absl::FormatDuration(put_stall_timeout_),
                                                          "; its reservation was released (--put_stall_ms)"));
      }
      return to_grpc(on_this_device(status));
    }
    reply->set_bytes((*data)->nbytes());
    bytes_put_.fetch_add((*data)->nbytes(), std::memory_order_relaxed);
    store_.commit(id, std::move(*data));
    return grpc::Status::OK;
  }

  grpc::Status GetShard(grpc::ServerContext* ctx, const pb::GetShardRequest* req,
                        grpc::ServerWriter<pb::ShardChunk>* writer) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    if (!caller->at_least(Role::kDaemon)) {
      absl::Status granted = auth_.check_grant(req->buffer_id(), req->grant(), "GetShard");
      if (!granted.ok()) return to_grpc(on_this_device(granted));
    }
    absl::StatusOr<std::shared_ptr<const HostArray>> buffer = store_.get(req->buffer_id());
    if (!buffer.ok()) return to_grpc(buffer.status());
    const HostArray& data = **buffer;
    ProfileSpan span(&transport_.profile(), "transfer", [] { return std::string("get_shard"); });
    if (span) {
      span.arg("buffer", absl::StrCat(req->buffer_id()));
      span.arg("bytes", absl::StrCat(data.nbytes()));
    }
    pb::ShardChunk chunk;
    chunk.mutable_header()->set_buffer_id(req->buffer_id());
    chunk.mutable_header()->set_dtype(to_proto(data.dtype()));
    to_proto(data.shape(), chunk.mutable_header()->mutable_shape());
    int64_t offset = 0;
    do {
      const int64_t n = std::min(kMaxChunkBytes, data.nbytes() - offset);
      chunk.set_data(data.data() + offset, static_cast<size_t>(n));
      offset += n;
      if (ctx->IsCancelled() || !writer->Write(chunk)) {
        return to_grpc(absl::CancelledError("GetShard: the reader went away"));
      }
      chunk.clear_header();
    } while (offset < data.nbytes());
    bytes_fetched_.fetch_add(data.nbytes(), std::memory_order_relaxed);
    return grpc::Status::OK;
  }

  grpc::Status DeleteBuffers(grpc::ServerContext* ctx, const pb::DeleteBuffersRequest* req,
                             pb::DeleteBuffersReply* reply) override {
    // Clients delete through the coordinator (DeleteArray), which checks the owner.
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kAdmin, "DeleteBuffers");
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_deleted(erase(req->buffer_ids()));
    return grpc::Status::OK;
  }

  // Frees the buffers `ids` (those this device holds); returns how many it held.
  int erase(const google::protobuf::RepeatedField<uint64_t>& ids) {
    return store_.erase(std::vector<uint64_t>(ids.begin(), ids.end()));
  }

  grpc::Status RunCollective(grpc::ServerContext* ctx, const pb::WorkerCollectiveRequest* req,
                             pb::WorkerCollectiveReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "RunCollective");
    if (!caller.ok()) return to_grpc(caller.status());
    absl::StatusOr<Shape> shape = run_collective(
        *req, [ctx] { return ctx->IsCancelled(); }, reply);
    transport_.finish_op(req->op_id());
    if (!shape.ok()) {
      return to_grpc(on_this_device(shape.status()));
    }
    to_proto(*shape, reply->mutable_output_shape());
    return grpc::Status::OK;
  }

  grpc::Status LoadPlan(grpc::ServerContext* ctx, const pb::LoadPlanRequest* req, pb::LoadPlanReply*) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "LoadPlan");
    if (!caller.ok()) return to_grpc(caller.status());
    // The program is the same for every device: this one resolves it for its own position.
    absl::StatusOr<DevicePlan> program = plan_from_proto(req->plan());
    if (!program.ok()) return to_grpc(program.status());
    absl::StatusOr<Mesh> mesh = mesh_from_proto(req->mesh());
    if (!mesh.ok()) return to_grpc(mesh.status());
    absl::StatusOr<DevicePlan> plan = resolve(*program, *mesh, device_id_.load());
    if (!plan.ok()) return to_grpc(plan.status());
    auto loaded = std::make_shared<LoadedPlan>();
    loaded->plan = *std::move(plan);
    for (const pb::PeerAddress& peer : req->peers()) loaded->peers[peer.device_id()] = peer.address();
    loaded->has_collectives = plan_has_collectives(loaded->plan);
    loaded->last_run = ++plan_ticks_;
    absl::MutexLock lock(&plans_mu_);
    if (plans_.count(req->plan_id()) == 0 && static_cast<int>(plans_.size()) >= max_plans_) {
      // Full: the least recently run goes (a run in progress keeps its own reference).
      auto oldest = plans_.begin();
      for (auto it = plans_.begin(); it != plans_.end(); ++it) {
        if (it->second->last_run < oldest->second->last_run) oldest = it;
      }
      plans_.erase(oldest);
      ++plans_evicted_;
    }
    plans_[req->plan_id()] = std::move(loaded);
    return grpc::Status::OK;
  }

  grpc::Status UnloadPlans(grpc::ServerContext* ctx, const pb::UnloadPlansRequest* req,
                           pb::UnloadPlansReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "UnloadPlans");
    if (!caller.ok()) return to_grpc(caller.status());
    absl::MutexLock lock(&plans_mu_);
    int unloaded = 0;
    for (uint64_t id : req->plan_ids()) unloaded += static_cast<int>(plans_.erase(id));
    reply->set_unloaded(unloaded);
    return grpc::Status::OK;
  }

  // The coordinator's RunPlans stream (see PlanStreamReactor).
  grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>* RunPlans(
      grpc::CallbackServerContext* ctx) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "RunPlans");
    if (!caller.ok()) {
      return new Refused<grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>>(caller.status());
    }
    return PlanStreamReactor::start(this);
  }

  // The loaded plan of `req`, and whether it may run on a gRPC callback thread (see
  // runs_inline). NOT_FOUND naming this device if it is not loaded.
  absl::StatusOr<std::pair<std::shared_ptr<const LoadedPlan>, bool>> plan_for(const pb::RunPlanRequest& req) {
    absl::StatusOr<std::shared_ptr<const LoadedPlan>> loaded = loaded_plan(req.plan_id());
    if (!loaded.ok()) return on_this_device(loaded.status());
    const bool inline_run = runs_inline(**loaded, req);
    return std::make_pair(*std::move(loaded), inline_run);
  }

  // Runs a loaded plan on stored buffers and stores its outputs; errors name this device.
  absl::Status run(const LoadedPlan& loaded, const pb::RunPlanRequest& req, std::function<bool()> cancelled) {
    const absl::Time start = absl::Now();
    {
      absl::MutexLock lock(&runs_mu_);
      ++runs_.in_flight;
    }
    absl::Status status = on_this_device(run_plan(loaded, req, std::move(cancelled)));
    run_seconds_.observe(absl::Now() - start);
    absl::MutexLock lock(&runs_mu_);
    --runs_.in_flight;
    runs_.last_end = absl::Now();
    ++runs_.runs;
    if (!status.ok()) {
      ++runs_.failed;
      runs_.last_error = status.ToString();
      runs_.last_error_at = absl::Now();
    }
    return status;
  }

  // Waits until no run has been in flight for `quiet` (runs the coordinator sent just before
  // the wait still arrive and finish), at most until `deadline`; returns the runs still in
  // flight then (0: drained).
  int64_t wait_for_idle(absl::Duration quiet, absl::Time deadline) {
    absl::MutexLock lock(&runs_mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_) { return runs_.in_flight == 0; };
    for (;;) {
      if (!runs_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) return runs_.in_flight;
      const absl::Time quiet_until = std::max(runs_.last_end, drain_started_) + quiet;
      if (absl::Now() >= quiet_until) return 0;
      // Something may start meanwhile: wake at the end of the quiet period, or at a start.
      auto busy_or_quiet = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_) { return runs_.in_flight > 0; };
      runs_mu_.AwaitWithDeadline(absl::Condition(&busy_or_quiet), std::min(quiet_until, deadline));
      if (absl::Now() >= deadline) return runs_.in_flight;
    }
  }
  void start_drain() {
    absl::MutexLock lock(&runs_mu_);
    drain_started_ = absl::Now();
  }
  int64_t runs_in_flight() {
    absl::MutexLock lock(&runs_mu_);
    return runs_.in_flight;
  }

  // Collective data arrives raw (see Transport): read by a callback reactor, not copied.
  // Only the cluster's daemons may send here; a stream whose credential names a device carries
  // only that device's messages (others are dropped and counted).
  grpc::ServerReadReactor<grpc::ByteBuffer>* Exchange(grpc::CallbackServerContext* ctx,
                                                      grpc::ByteBuffer* response) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "Exchange");
    if (!caller.ok()) return new Refused<grpc::ServerReadReactor<grpc::ByteBuffer>>(caller.status());
    if (!caller->open && caller->device < 0) {
      return new Refused<grpc::ServerReadReactor<grpc::ByteBuffer>>(
          absl::PermissionDeniedError("Exchange: the stream does not say which device sends it ('tessera-device')"));
    }
    return transport_.new_exchange_reader(response, caller->device);
  }

  // Any client may profile (as it may read GetStats): a trace holds op names, shapes and times,
  // never data.
  grpc::Status Profile(grpc::ServerContext* ctx, const pb::ProfileRequest* req, pb::ProfileReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    return to_grpc(answer_profile(transport_.profile(), *req, device_id_.load(), reply));
  }

  grpc::Status GetStats(grpc::ServerContext* ctx, const pb::GetStatsRequest*, pb::WorkerStats* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    fill_stats(reply);
    return grpc::Status::OK;
  }

  // What GetStats answers (and the metrics report).
  void fill_stats(pb::WorkerStats* reply) {
    reply->set_exchange_messages_forged(transport_.forged_messages());
    BufferStore::Stats stats = store_.stats();
    reply->set_device_id(device_id_.load());
    reply->set_buffer_count(stats.buffer_count);
    reply->set_bytes_used(stats.bytes_used);
    reply->set_memory_limit_bytes(stats.limit_bytes);
    reply->set_collective_messages_pending(transport_.pending_messages());
    reply->set_collective_bytes_pending(transport_.pending_bytes());
    reply->set_exchange_messages_dropped(transport_.dropped_messages());
    reply->set_shm_messages_received(transport_.shm_messages_received());
    reply->set_blas_kernel(blas_kernel_name());
    reply->set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - started_));
    reply->set_incarnation(incarnation_.load());
    {
      absl::MutexLock lock(&plans_mu_);
      reply->set_plans_loaded(static_cast<int64_t>(plans_.size()));
      reply->set_plans_evicted(plans_evicted_);
    }
    absl::MutexLock lock(&runs_mu_);
    reply->set_plan_runs_in_flight(runs_.in_flight);
    reply->set_bytes_put(bytes_put_.load(std::memory_order_relaxed));
    reply->set_bytes_fetched(bytes_fetched_.load(std::memory_order_relaxed));
    reply->set_plan_runs(runs_.runs);
    reply->set_plan_runs_failed(runs_.failed);
    reply->set_last_error(runs_.last_error);
    if (runs_.failed > 0) reply->set_last_error_age_ms(absl::ToInt64Milliseconds(absl::Now() - runs_.last_error_at));
  }

  const LatencyHistogram& run_seconds() const { return run_seconds_; }

 private:
  // A PutShard stream holding a reservation, and when it last received a message.
  struct PutWatch {
    grpc::ServerContext* ctx = nullptr;
    std::atomic<int64_t> progress{0};  // Unix ns
    std::atomic<bool> cancelled{false};
  };
  std::shared_ptr<PutWatch> watch_put(grpc::ServerContext* ctx) {
    auto w = std::make_shared<PutWatch>();
    w->ctx = ctx;
    w->progress = absl::ToUnixNanos(absl::Now());
    absl::MutexLock lock(&puts_mu_);
    puts_.insert(w);
    return w;
  }
  void unwatch_put(const std::shared_ptr<PutWatch>& w) {
    absl::MutexLock lock(&puts_mu_);  // cancel_stalled_puts never touches its context after this
    puts_.erase(w);
  }

  // Validates the header, reserves the memory and allocates the destination.
  absl::StatusOr<std::shared_ptr<HostArray>> begin_put(const pb::ShardHeader& header) {
    TESSERA_ASSIGN_OR_RETURN(ArrayType type, put_shard_type(header));
    const int64_t bytes = num_elements(type.shape) * dtype_size(type.dtype);
    absl::Status reserved = store_.reserve(header.buffer_id(), bytes);
    if (!reserved.ok()) {
      return absl::Status(reserved.code(),
                          absl::StrCat("shard ", type_to_string(type.dtype, type.shape), ": ", reserved.message()));
    }
    return std::make_shared<HostArray>(type.dtype, std::move(type.shape));
  }

  // Validates the request, runs this device's part and stores the result.
  absl::StatusOr<Shape> run_collective(const pb::WorkerCollectiveRequest& req, std::function<bool()> cancelled,
                                       pb::WorkerCollectiveReply* reply) {
    CollectiveRun run;
    run.op = req.op_id();
    TESSERA_ASSIGN_OR_RETURN(run.spec, collective_from_proto(req.spec()));
    run.self = device_id_.load();
    for (const pb::PeerAddress& peer : req.peers()) run.peers[peer.device_id()] = peer.address();
    const int64_t timeout_ms = req.timeout_ms() > 0 ? std::min<int64_t>(req.timeout_ms(), 3'600'000) : 10'000;
    run.start = absl::Now();
    run.deadline = run.start + absl::Milliseconds(timeout_ms);
    run.cancelled = std::move(cancelled);
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<const HostArray> input, store_.get(req.input_buffer()));
    TESSERA_ASSIGN_OR_RETURN(Shape out_shape, collective_output_shape(run.spec, input->shape()));
    const int64_t out_bytes = num_elements(out_shape) * dtype_size(input->dtype());
    TESSERA_RETURN_IF_ERROR(store_.reserve(req.output_buffer(), out_bytes));
    absl::Status barrier = req.barrier_first() ? run_barrier(run) : absl::OkStatus();
    const absl::Time started = absl::Now();
    absl::StatusOr<std::shared_ptr<const HostArray>> out =
        barrier.ok() ? tessera::run_collective(transport_, run, input) : barrier;
    if (!out.ok()) {
      store_.cancel(req.output_buffer());
      return absl::Status(out.status().code(),
                          absl::StrCat(collective_name(run.spec.kind), " (op ", run.op, "): ", out.status().message()));
    }
    store_.commit(req.output_buffer(), *std::move(out));
    reply->set_elapsed_ns(absl::ToInt64Nanoseconds(absl::Now() - started));
    return out_shape;
  }

  // A one-element all-reduce over run's groups, under an op id of its own (bit 62 set: no
  // array id or plan op id has it), so that every member starts its clock together.
  absl::Status run_barrier(const CollectiveRun& run) {
    CollectiveRun barrier = run;
    barrier.op = run.op | (uint64_t{1} << 62);
    barrier.spec = CollectiveSpec{};
    barrier.spec.kind = CollectiveKind::kAllReduce;
    barrier.spec.groups = run.spec.groups;
    absl::Status status = tessera::run_collective(transport_, barrier,
                                                  std::make_shared<const HostArray>(HostArray::zeros(DType::kI32, {1})))
                              .status();
    transport_.finish_op(barrier.op);
    return status;
  }

  absl::StatusOr<std::shared_ptr<const LoadedPlan>> loaded_plan(uint64_t plan_id) {
    absl::MutexLock lock(&plans_mu_);
    auto it = plans_.find(plan_id);
    if (it == plans_.end()) return absl::NotFoundError(absl::StrCat("plan ", plan_id, " is not loaded"));
    it->second->last_run = ++plan_ticks_;
    return it->second;
  }

  // Whether `plan` may run on a gRPC callback thread: by its cost (runs_inline).
  bool runs_inline(const LoadedPlan& plan, const pb::RunPlanRequest& req) const {
    int64_t input_bytes = 0;
    for (uint64_t id : req.input_buffers()) {
      absl::StatusOr<std::shared_ptr<const HostArray>> buffer = store_.get(id);
      if (buffer.ok()) input_bytes += (*buffer)->nbytes();
    }
    return tessera::runs_inline(plan.plan, input_bytes);
  }

  // Runs a loaded plan on stored buffers and stores its outputs.
  absl::Status run_plan(const LoadedPlan& loaded, const pb::RunPlanRequest& req, std::function<bool()> cancelled) {
    const DevicePlan& plan = loaded.plan;
    if (req.output_buffers_size() != static_cast<int>(plan.output_slots.size())) {
      return absl::InvalidArgumentError(absl::StrCat("run: the plan has ", plan.output_slots.size(), " outputs, got ",
                                                     req.output_buffers_size(), " output buffers"));
    }
    if (req.input_buffers_size() != static_cast<int>(plan.input_slots.size())) {
      return absl::InvalidArgumentError(absl::StrCat("run: the plan takes ", plan.input_slots.size(), " inputs, got ",
                                                     req.input_buffers_size(), " input buffers"));
    }
    std::vector<std::shared_ptr<const HostArray>> inputs;
    for (uint64_t id : req.input_buffers()) {
      TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<const HostArray> buffer, store_.get(id));
      inputs.push_back(std::move(buffer));
    }
    // Donated inputs leave the store: the run holds the only reference, so its kernels may
    // write over them, and their memory counts as free from now on.
    std::vector<uint64_t> donated;
    for (int d : plan.donated_inputs) donated.push_back(req.input_buffers(d));
    if (!donated.empty()) store_.erase(donated);
    // What the run holds at its peak (intermediates, outputs, donated inputs) is reserved in
    // the store for the run, under the execution's id (no buffer has it), before anything runs.
    const PlanPeak peak = peak_memory(plan, inputs);
    if (absl::Status reserved = store_.reserve(req.execution_id(), peak.bytes); !reserved.ok()) {
      const BufferStore::Stats stats = store_.stats();
      const std::string at = peak.instruction < 0 ? std::string("its donated inputs")
                                                  : absl::StrCat("instruction ", peak.instruction, " (",
                                                                 instruction_name(plan.code[peak.instruction]), ")");
      return absl::ResourceExhaustedError(absl::StrCat(
          "run: plan ", req.plan_id(), " needs ", peak.bytes, " bytes at once for its intermediates and outputs (at ",
          at, ") but only ", stats.limit_bytes - stats.bytes_used, " of the device's ", stats.limit_bytes,
          " bytes are free (--memory_bytes)"));
    }
    PlanRun run;
    run.execution = req.execution_id();
    if (loaded.has_collectives) run.peers = loaded.peers;
    run.self = device_id_.load();
    const int64_t timeout_ms = req.timeout_ms() > 0 ? std::min<int64_t>(req.timeout_ms(), 3'600'000) : 10'000;
    run.deadline = absl::Now() + absl::Milliseconds(timeout_ms);
    run.cancelled = std::move(cancelled);
    absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> outputs =
        tessera::run_plan(plan, std::move(inputs), transport_, run);
    store_.cancel(req.execution_id());  // the outputs are reserved one by one below
    if (!outputs.ok()) return outputs.status();
    for (int i = 0; i < req.output_buffers_size(); ++i) {
      absl::Status reserved = store_.reserve(req.output_buffers(i), (*outputs)[i]->nbytes());
      if (!reserved.ok()) {
        for (int j = 0; j < i; ++j) store_.erase({req.output_buffers(j)});
        return reserved;
      }
      store_.commit(req.output_buffers(i), (*outputs)[i]);
    }
    return absl::OkStatus();
  }

  const Authenticator auth_;
  const int max_plans_;
  std::atomic<int> device_id_{-1};
  std::atomic<uint64_t> incarnation_{0};
  BufferStore store_;
  const absl::Time started_;
  Transport transport_;
  absl::Mutex plans_mu_;
  std::map<uint64_t, std::shared_ptr<const LoadedPlan>> plans_ ABSL_GUARDED_BY(plans_mu_);
  int64_t plans_evicted_ ABSL_GUARDED_BY(plans_mu_) = 0;
  const absl::Duration put_stall_timeout_;
  absl::Mutex puts_mu_;
  std::set<std::shared_ptr<PutWatch>> puts_ ABSL_GUARDED_BY(puts_mu_);
  std::atomic<uint64_t> plan_ticks_{0};
  // For GetStats (tessera status).
  struct RunCounts {
    int64_t in_flight = 0;  // started, not finished
    absl::Time last_end;    // when the last run finished
    int64_t runs = 0;
    int64_t failed = 0;
    std::string last_error;
    absl::Time last_error_at;
  };
  absl::Mutex runs_mu_;
  RunCounts runs_ ABSL_GUARDED_BY(runs_mu_);
  std::atomic<int64_t> bytes_put_{0}, bytes_fetched_{0};  // PutShard / GetShard, whole shards
  absl::Time drain_started_ ABSL_GUARDED_BY(runs_mu_);
  LatencyHistogram run_seconds_{"tessera_worker_plan_run_seconds",
                                "Plan runs on this device, from the start of the run to its outputs stored."};
  // Last: its threads use everything above, and its destructor joins them.
  ThreadPool plan_threads_;
};

void PlanStreamReactor::OnReadDone(bool ok) {
  if (!ok) {  // the coordinator closed or cancelled the stream, or went away
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      reading_ended_ = true;  // results not yet sent are dropped (see OnWriteDone)
      for (auto& [execution, cancelled] : running_) *cancelled = true;
      finish = finish_now_locked();
    }
    if (finish) Finish(grpc::Status::OK);
    return;
  }
  if (request_.kind_case() == pb::PlanStreamRequest::kCancelExecution) {
    {
      absl::MutexLock lock(&mu_);
      auto it = running_.find(request_.cancel_execution());
      if (it != running_.end()) *it->second = true;
    }
    StartRead(&request_);
    return;
  }
  if (request_.kind_case() == pb::PlanStreamRequest::kDeleteBuffers) {
    const uint64_t id = request_.delete_buffers().request_id();
    service_->erase(request_.delete_buffers().buffer_ids());
    StartRead(&request_);
    post(id, absl::OkStatus());
    return;
  }
  if (request_.kind_case() != pb::PlanStreamRequest::kRun) {
    StartRead(&request_);  // a kind this build does not know: nothing to answer
    return;
  }
  auto req = std::make_shared<pb::RunPlanRequest>();
  req->Swap(request_.mutable_run());
  const uint64_t execution = req->execution_id();
  // Deletions riding on the run: nothing reads these buffers any more.
  if (req->free_buffers_size() > 0) service_->erase(req->free_buffers());
  absl::StatusOr<std::pair<std::shared_ptr<const LoadedPlan>, bool>> plan = service_->plan_for(*req);
  if (!plan.ok()) {
    StartRead(&request_);
    post(execution, plan.status());
    return;
  }
  auto [loaded, inline_run] = *std::move(plan);
  absl::Status refused;
  bool deferred = false;
  {
    absl::MutexLock lock(&mu_);
    std::set<uint64_t> producers;
    for (uint64_t id : req->input_buffers()) {
      auto it = producing_.find(id);
      if (it != producing_.end()) producers.insert(it->second);
    }
    if (!producers.empty() && deferred_.size() >= kMaxDeferredRuns) {
      refused = service_->on_this_device(absl::ResourceExhaustedError(absl::StrCat(
          "run: ", kMaxDeferredRuns, " runs on this stream wait for the runs making their inputs already")));
    } else {
      // Inline runs too: the next read (a consumer of this run) may be handled meanwhile.
      running_[execution] = std::make_shared<std::atomic<bool>>(false);
      for (uint64_t id : req->output_buffers()) producing_[id] = execution;
      if (!producers.empty()) {
        deferred = true;
        Deferred& d = deferred_[execution];
        d.req = req;
        d.loaded = loaded;
        d.waiting = static_cast<int>(producers.size());
        for (uint64_t p : producers) dependents_[p].push_back(execution);
      }
    }
  }
  StartRead(&request_);
  if (!refused.ok()) {
    post(execution, refused);
  } else if (deferred) {
    // Started by the end of the last of its producers.
  } else if (inline_run) {  // short, and nothing to wait for: no cancellation either
    absl::Status status = service_->run(*loaded, *req, nullptr);
    end_run(std::move(req), std::move(status));
  } else {
    run_on_thread(std::move(req), std::move(loaded));
  }
}

void PlanStreamReactor::run_on_thread(std::shared_ptr<pb::RunPlanRequest> req,
                                      std::shared_ptr<const LoadedPlan> loaded) {
  std::shared_ptr<std::atomic<bool>> cancelled;
  {
    absl::MutexLock lock(&mu_);
    cancelled = running_[req->execution_id()];
  }
  absl::Status started = service_->plan_threads().run([self = shared_from_this(), plan = loaded, req, cancelled] {
    self->end_run(req, self->service_->run(*plan, *req, [cancelled] { return cancelled->load(); }));
  });
  if (!started.ok()) end_run(std::move(req), service_->on_this_device(started));
}

void PlanStreamReactor::end_run(std::shared_ptr<pb::RunPlanRequest> req, absl::Status status) {
  // A queue, not recursion: a long chain of waiting runs may end here one after another.
  std::deque<std::pair<std::shared_ptr<pb::RunPlanRequest>, absl::Status>> ended;
  ended.emplace_back(std::move(req), std::move(status));
  while (!ended.empty()) {
    auto [run, result] = std::move(ended.front());
    ended.pop_front();
    const uint64_t execution = run->execution_id();
    post(execution, result);                       // before its dependents run: results go back in order
    std::vector<std::pair<Deferred, bool>> ready;  // and whether it was cancelled meanwhile
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      running_.erase(execution);
      for (uint64_t id : run->output_buffers()) {
        auto it = producing_.find(id);
        if (it != producing_.end() && it->second == execution) producing_.erase(it);
      }
      auto deps = dependents_.find(execution);
      if (deps != dependents_.end()) {
        for (uint64_t d : deps->second) {
          auto it = deferred_.find(d);
          if (it == deferred_.end()) continue;
          Deferred& w = it->second;
          if (!result.ok() && w.failure.ok()) {
            w.failure = absl::Status(result.code(),
                                     absl::StrCat("run: an input was to be made by execution ", execution,
                                                  " before it on this device, which failed: ", result.message()));
          }
          if (--w.waiting > 0) continue;
          auto flag = running_.find(d);
          ready.emplace_back(std::move(w), flag != running_.end() && flag->second->load());
          deferred_.erase(it);
        }
        dependents_.erase(deps);
      }
      finish = finish_now_locked();
    }
    for (auto& [w, cancelled] : ready) {
      if (!w.failure.ok()) {
        ended.emplace_back(std::move(w.req), std::move(w.failure));
      } else if (cancelled) {
        ended.emplace_back(std::move(w.req), service_->on_this_device(absl::CancelledError("run: cancelled")));
      } else if (service_->may_run_inline(*w.loaded, *w.req)) {
        absl::Status s = service_->run(*w.loaded, *w.req, nullptr);
        ended.emplace_back(std::move(w.req), std::move(s));
      } else {
        run_on_thread(std::move(w.req), std::move(w.loaded));
      }
    }
    if (finish) Finish(grpc::Status::OK);
  }
}

void PlanStreamReactor::post(uint64_t id, const absl::Status& status) {
  const pb::RunPlanResult* first = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (reading_ended_ || finished_) return;  // the coordinator is gone or done with this stream
    pb::RunPlanResult result;
    result.set_id(id);
    result.set_code(static_cast<int32_t>(status.code()));
    result.set_message(std::string(status.message()));
    first = results_.push(std::move(result));
  }
  if (first != nullptr) StartWrite(first);
}

// Results not yet sent when the reading ended are dropped: nobody reads them.
void PlanStreamReactor::OnWriteDone(bool ok) {
  const pb::RunPlanResult* next = nullptr;
  bool finish = false;
  {
    absl::MutexLock lock(&mu_);
    if (!ok) reading_ended_ = true;  // the stream is broken: the read fails too
    next = results_.pop(reading_ended_);
    finish = finish_now_locked();
  }
  if (next != nullptr) StartWrite(next);
  if (finish) Finish(grpc::Status::OK);
}

class WorkerServerImpl final : public WorkerServer {
 public:
  explicit WorkerServerImpl(const WorkerOptions& options)
      : options_(options), identity_(daemon_identity(options.credentials)), service_(options) {}
  ~WorkerServerImpl() override { shutdown(); }

  absl::Status init() {
    TESSERA_RETURN_IF_ERROR(service_.configure_collectives(options_));
    grpc::ServerBuilder builder;
    int port = 0;
    const std::string bind = options_.bind_host.empty() ? options_.host : options_.bind_host;
    builder.AddListeningPort(absl::StrCat(bind, ":", options_.port), server_credentials(options_.credentials), &port);
    configure_server(&builder);
    rpc_errors_.install(&builder);
    builder.RegisterService(&service_);
    builder.RegisterService(health_.service());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(absl::StrCat("tessera-worker: cannot listen on ", bind, ":", options_.port));
    }
    address_ = absl::StrCat(options_.host, ":", port);
    if (options_.health_port >= 0) {
      absl::StatusOr<std::unique_ptr<HealthPort>> health_port = health_.serve_plaintext(bind, options_.health_port);
      if (!health_port.ok())
        return absl::UnavailableError(absl::StrCat("tessera-worker: ", health_port.status().message()));
      health_port_ = *std::move(health_port);
    }

    TESSERA_RETURN_IF_ERROR(register_until_deadline());
    health_.set_ready(true);
    heartbeat_thread_ = std::thread([this] { heartbeat_loop(); });
    return absl::OkStatus();
  }

  int device_id() const override { return device_id_; }
  std::string address() const override { return address_; }
  int health_port() const override { return health_port_ == nullptr ? -1 : health_port_->port(); }

  std::vector<MetricSample> metrics() override {
    pb::WorkerStats s;
    service_.fill_stats(&s);
    const MetricLabels device = {{"device", absl::StrCat(s.device_id())}};
    std::vector<MetricSample> samples = {
        counter("tessera_worker_put_bytes_total", "Bytes of shards clients (and peers) put here (PutShard).",
                s.bytes_put(), device),
        counter("tessera_worker_fetched_bytes_total", "Bytes of shards read from here (GetShard).", s.bytes_fetched(),
                device),
        gauge("tessera_worker_plan_runs_in_flight", "Plan runs started and not finished.", s.plan_runs_in_flight(),
              device),
        gauge("tessera_worker_buffers", "Buffers held on this device.", s.buffer_count(), device),
        gauge("tessera_worker_used_bytes", "Bytes of the buffers held.", s.bytes_used(), device),
        gauge("tessera_worker_memory_limit_bytes", "The device's memory limit (--memory_bytes).",
              s.memory_limit_bytes(), device),
        gauge("tessera_worker_plans_loaded", "Programs loaded and held.", s.plans_loaded(), device),
        counter("tessera_worker_plan_runs_total", "Plan runs finished since the process started.", s.plan_runs(),
                device),
        counter("tessera_worker_plan_runs_failed_total", "Plan runs that failed.", s.plan_runs_failed(), device),
        gauge("tessera_worker_collective_messages_pending", "Collective messages received and not yet consumed.",
              s.collective_messages_pending(), device),
        counter("tessera_worker_shm_messages_received_total", "Collective messages that came through shared memory.",
                s.shm_messages_received(), device),
        counter("tessera_worker_exchange_messages_forged_total",
                "Exchange messages dropped because their sender was not their stream's device.",
                s.exchange_messages_forged(), device),
        gauge("tessera_worker_incarnation", "The registration this worker holds.", s.incarnation(), device),
        gauge("tessera_worker_uptime_seconds", "Since the process started.", s.uptime_ms() / 1000.0, device),
    };
    // Collectives by op, algorithm and the path whose table chose it (worker/collectives/algorithms.h).
    for (const CollectiveMetrics::Row& r : service_.collective_metrics().rows()) {
      MetricLabels labels = {{"device", absl::StrCat(s.device_id())},
                             {"op", collective_name(r.kind)},
                             {"algorithm", algorithm_name(r.algorithm)},
                             {"path", path_name(r.path)}};
      samples.push_back(
          counter("tessera_worker_collectives_total", "Collectives run on this device.", r.count, labels));
      samples.push_back(counter("tessera_worker_collectives_failed_total", "Collectives that failed on this device.",
                                r.failed, labels));
      samples.push_back(counter("tessera_worker_collective_bytes_total",
                                "Bytes of this device's inputs to its collectives.", r.bytes, labels));
    }
    for (MetricSample& m : rpc_errors_.samples("tessera_worker_rpc_errors_total", device))
      samples.push_back(std::move(m));
    return samples;
  }
  std::vector<const LatencyHistogram*> histograms() const override {
    std::vector<const LatencyHistogram*> out = {&service_.run_seconds()};
    for (const LatencyHistogram* h : service_.collective_metrics().histograms()) out.push_back(h);
    return out;
  }

  int64_t drain(absl::Duration timeout) override {
    health_.set_ready(false);
    service_.start_drain();
    const int64_t busy = service_.runs_in_flight();
    if (busy > 0) {
      std::fprintf(stderr, "tessera-worker: draining: %lld plan run(s) in flight; waiting up to %s for them\n",
                   static_cast<long long>(busy), absl::FormatDuration(timeout).c_str());
    }
    const int64_t left = service_.wait_for_idle(kDrainQuiet, absl::Now() + timeout);
    if (left > 0) {
      std::fprintf(stderr, "tessera-worker: drain timed out: %lld plan run(s) still in flight fail\n",
                   static_cast<long long>(left));
    } else if (busy > 0) {
      std::fprintf(stderr, "tessera-worker: drained: every plan run in flight finished\n");
    }
    return left;
  }

  void shutdown() override {
    if (!stopping_.HasBeenNotified()) stopping_.Notify();
    health_.set_ready(false);
    health_port_.reset();
    if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
    if (server_ != nullptr) {
      // Peers keep Exchange streams open for good: cancel what is in flight promptly.
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
      server_->Wait();
      server_.reset();
    }
  }

 private:
  // The first registration: attempts of at most kConnectDeadline each, every failure to reach
  // the coordinator logged and retried on a new channel (so a name that did not resolve is
  // looked up again), pauses from 1 s doubling to 5 s, until register_timeout.
  absl::Status register_until_deadline() {
    const absl::Time deadline = absl::Now() + options_.register_timeout;
    absl::Duration pause = absl::Seconds(1);
    for (int attempt = 1;; ++attempt) {
      coordinator_ = pb::Coordinator::NewStub(make_channel(options_.coordinator_address, identity_));
      absl::Status registered =
          register_worker(options_.device_id, std::min(deadline - absl::Now(), kConnectDeadline), false);
      if (registered.ok()) {
        if (attempt > 1) std::fprintf(stderr, "tessera-worker: registered at attempt %d\n", attempt);
        return registered;
      }
      // A refusal (another protocol version, a device id taken) is the coordinator's answer.
      if (!absl::IsUnavailable(registered) && !absl::IsDeadlineExceeded(registered)) return registered;
      const absl::Duration left = deadline - absl::Now();
      if (left <= pause) {
        return absl::DeadlineExceededError(absl::StrCat("tessera-worker: could not register with coordinator ",
                                                        options_.coordinator_address, " within ",
                                                        absl::FormatDuration(options_.register_timeout), " (", attempt,
                                                        " attempts); the last: ", registered.message()));
      }
      std::fprintf(stderr, "tessera-worker: registration attempt %d failed: %s; retrying in %s (%s left)\n", attempt,
                   std::string(registered.message()).c_str(), absl::FormatDuration(pause).c_str(),
                   absl::FormatDuration(absl::Trunc(left, absl::Seconds(1))).c_str());
      if (!options_.wait_or_stop) {
        absl::SleepFor(pause);
      } else if (options_.wait_or_stop(pause)) {
        return absl::CancelledError(
            absl::StrCat("tessera-worker: stopped while waiting to register with ", options_.coordinator_address));
      }
      pause = std::min(pause * 2, absl::Seconds(5));
    }
  }

  // Registers (again) as `device_id` (-1: any), telling the coordinator which incarnation
  // this process held before, if any: its buffers are still here.
  // `wait_for_ready`: wait for the connection until the deadline, instead of failing at once
  // when the coordinator cannot be reached (the first registration retries by itself).
  absl::Status register_worker(int device_id, absl::Duration timeout, bool wait_for_ready) {
    pb::RegisterWorkerRequest req;
    req.set_protocol_version(kProtocolVersion);
    req.set_name(options_.name.empty() ? address_ : options_.name);
    req.set_address(address_);
    req.set_requested_device_id(device_id);
    req.set_memory_bytes(options_.memory_bytes);
    req.set_previous_incarnation(incarnation_);
    req.set_previous_epoch(epoch_);
    // What this process holds: after a coordinator restart, clients adopt it again.
    for (const auto& [id, buffer] : service_.held_buffers()) {
      if (req.held_buffers_size() == kMaxHeldBuffersReported) {
        std::fprintf(stderr, "tessera-worker: reporting only the first %d of its buffers to the coordinator\n",
                     kMaxHeldBuffersReported);
        break;
      }
      pb::ShardHeader* h = req.add_held_buffers();
      h->set_buffer_id(id);
      h->set_dtype(to_proto(buffer->dtype()));
      to_proto(buffer->shape(), h->mutable_shape());
    }
    pb::RegisterWorkerReply reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, timeout);
    ctx.set_wait_for_ready(wait_for_ready);
    TESSERA_RETURN_IF_ERROR(from_grpc(coordinator_->RegisterWorker(&ctx, req, &reply),
                                      absl::StrCat("coordinator ", options_.coordinator_address)));
    device_id_ = reply.device_id();
    incarnation_ = reply.incarnation();
    if (reply.epoch() != epoch_) service_.drop_plans_before(reply.epoch());
    epoch_ = reply.epoch();
    service_.set_device_id(device_id_);
    service_.set_incarnation(incarnation_);
    heartbeat_interval_ = absl::Milliseconds(std::max<int64_t>(10, reply.heartbeat_interval_ms()));
    return absl::OkStatus();
  }

  void heartbeat_loop() {
    while (!stopping_.WaitForNotificationWithTimeout(heartbeat_interval_)) {
      pb::HeartbeatRequest req;
      req.set_device_id(device_id_);
      req.set_incarnation(incarnation_);
      req.set_epoch(epoch_);
      pb::HeartbeatReply reply;
      grpc::ClientContext ctx;
      set_deadline(&ctx, heartbeat_interval_ * 4);
      const grpc::Status status = coordinator_->Heartbeat(&ctx, req, &reply);
      service_.cancel_stalled_puts(absl::Now());
      // A missed heartbeat is not fatal: the coordinator decides when a device is lost. One it
      // refuses means it marked this device lost, or restarted and does not know it: register
      // again, keeping the device id (and the buffers, which the coordinator is told about).
      if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION &&
          status.error_code() != grpc::StatusCode::NOT_FOUND) {
        continue;
      }
      std::fprintf(stderr, "tessera-worker: device %d: %s; registering again\n", device_id_,
                   status.error_message().c_str());
      health_.set_ready(false);
      absl::Status registered = register_worker(device_id_, heartbeat_interval_ * 4, true);
      health_.set_ready(registered.ok());
      if (registered.ok()) {
        std::fprintf(stderr, "tessera-worker: device %d registered again, incarnation %lu\n", device_id_,
                     static_cast<unsigned long>(incarnation_));
      } else {
        std::fprintf(stderr, "tessera-worker: device %d: %s\n", device_id_, std::string(registered.message()).c_str());
      }
    }
  }

  // Constant after init().
  const WorkerOptions options_;
  const std::shared_ptr<const CallIdentity> identity_;  // what this worker sends the coordinator
  WorkerService service_;
  HealthService health_;
  std::unique_ptr<HealthPort> health_port_;  // options_.health_port's server, if any
  RpcErrorCounter rpc_errors_;               // outlives server_
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
  std::string address_;
  int device_id_ = -1;
  uint64_t incarnation_ = 0;
  uint64_t epoch_ = 0;  // of the coordinator incarnation this worker registered with
  absl::Duration heartbeat_interval_;

  absl::Notification stopping_;
  std::thread heartbeat_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::start(const WorkerOptions& options) {
  if (options.memory_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tessera-worker: memory_bytes must be positive, got ", options.memory_bytes));
  }
  auto server = std::make_unique<WorkerServerImpl>(options);
  TESSERA_RETURN_IF_ERROR(server->init());
  return std::unique_ptr<WorkerServer>(std::move(server));
}

}  // namespace tessera

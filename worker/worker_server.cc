#include "worker/worker_server.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/heap.h"
#include "core/host_array.h"
#include "core/profile_wire.h"
#include "core/run_tag.h"
#include "core/shm_transfer.h"
#include "core/slicing.h"
#include "core/status.h"
#include "core/wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/health.h"
#include "proto/in_process.h"
#include "proto/rpc.h"
#include "proto/rpc_errors.h"
#include "proto/tessera.grpc.pb.h"
#include "worker/buffer_store.h"
#include "worker/collectives/engine.h"
#include "worker/collectives/move_blocks.h"
#include "worker/collectives/peer_view.h"
#include "worker/collectives/transport.h"
#include "worker/device.h"
#include "worker/interpreter.h"
#include "worker/kernels/blas.h"
#include "worker/plan_runner.h"
#include "worker/plan_store.h"
#include "worker/registration.h"
#include "worker/transfers.h"

namespace tessera {
namespace {

// DeleteBuffers is a callback method: an array's frees arrive while other calls run (the
// next collective, say), and as a sync method each took a sync-server thread, so that gRPC
// made a new poller for the call it overlapped and ended the thread over two pollers
// afterwards: a thread made and ended per overlapping free (session 43, docs/design.md "The
// 4 KiB all_reduce"). It only erases buffers from the store: nothing in it waits.
using WorkerServiceBase = pb::Worker::WithCallbackMethod_DeleteBuffers<
    pb::Worker::WithCallbackMethod_RunPlans<pb::Worker::WithRawCallbackMethod_Exchange<pb::Worker::Service>>>;

// The reactor of a stream refused at its start (an unauthenticated or unauthorised caller):
// it finishes with `status` at once and deletes itself when gRPC is done.
template <typename Reactor>
class Refused final : public Reactor {
 public:
  explicit Refused(const absl::Status& status) { this->Finish(to_grpc(status)); }
  void OnDone() override { delete this; }
};

// What an Exchange stream declares of its sender (metadata; what is missing or malformed stays
// unset, and PeerView refuses it).
StreamClaim stream_claim(const grpc::ServerContextBase& ctx) {
  StreamClaim claim;
  const auto& metadata = ctx.client_metadata();
  auto number = [&metadata](const char* key, auto unset) {
    auto it = metadata.find(key);
    decltype(unset) value = unset;
    if (it == metadata.end() || !absl::SimpleAtoi(absl::string_view(it->second.data(), it->second.size()), &value)) {
      return unset;
    }
    return value;
  };
  claim.device = std::max(number(kDeviceKey, -1), -1);
  claim.epoch = number(kEpochKey, uint64_t{0});
  claim.incarnation = number(kIncarnationKey, uint64_t{0});
  return claim;
}

// The Worker service's edge: each handler checks its caller and the request, and hands the
// work to the part of the worker it belongs to (Transfers, PlanStore, PlanRunner, the
// collectives' Transport). Holds no lock of its own.
class WorkerService final : public WorkerServiceBase {
 public:
  explicit WorkerService(const WorkerOptions& options)
      : auth_(options.credentials),
        store_(options.memory_bytes),
        started_(absl::Now()),
        heap_(HeapTrimmer::IdleTrim{options.heap_trim_freed_bytes, options.heap_trim_quiet}),
        transport_(options.credentials),
        plans_(options.max_plans),
        transfers_(&store_, &auth_, &device_, &transport_, &transport_.profile(), options.put_stall_timeout,
                   options.in_process, options.shm_transfers && !options.in_process, options.shm_client_memory),
        runner_(&store_, &plans_, &transport_, &device_, options.max_plan_threads) {}

  const CollectiveMetrics& collective_metrics() const { return transport_.collective_metrics(); }
  const BufferStore& store() const { return store_; }
  PlanStore& plans() { return plans_; }
  PeerView& peers() { return peers_; }
  Transfers& transfers() { return transfers_; }
  PlanRunner& runner() { return runner_; }
  const LatencyHistogram& run_seconds() const { return runner_.run_seconds(); }

  // A registration's answer: the device id and incarnation this worker holds now.
  // Once per heartbeat: the mailbox forgets messages of ops that never started, and the heap
  // gives back the pages of plans and messages dropped since the last tick, or of the arrays
  // freed since the last idle trim once no run has been in flight for a while (core/heap.h):
  // here, off the run path, so a run never waits for a trim it did not cause.
  void tick() {
    transport_.sweep();
    peers_.expire(absl::Now());
    const int64_t dropped = transport_.dropped_messages() + plans_.stats().evicted;
    if (dropped != last_dropped_) heap_.released();
    last_dropped_ = dropped;
    const int64_t freed = HostArray::bytes_freed();
    if (!heap_.trim_if_released(freed)) heap_.trim_if_idle(freed, runner_.idle_for(started_));
  }
  const HeapTrimmer& heap() const { return heap_; }

  // Before every RegisterWorker (true): collective sends wait for its answer
  // (Transport::begin_registration); after one that failed, or when registration stops (false),
  // they go on under the registration declared before (Transport::end_registration).
  void registering(bool begins) {
    if (begins) {
      transport_.begin_registration();
    } else {
      transport_.end_registration();
    }
  }

  void registered(int id, uint64_t epoch, uint64_t incarnation) {
    device_.set(id);
    transport_.set_self(id);
    transport_.declare(epoch, incarnation);
    absl::MutexLock lock(&registration_mu_);
    epoch_ = epoch;
    incarnation_ = incarnation;
  }

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
    mailbox.messages_per_peer = options.mailbox_messages_per_peer;
    mailbox.unclaimed_ttl = options.mailbox_ttl;
    mailbox.reserve = [this](int64_t bytes) { return store_.charge(bytes); };
    mailbox.release = [this](int64_t bytes) { store_.uncharge(bytes); };
    TESSERA_RETURN_IF_ERROR(transport_.set_mailbox(std::move(mailbox)));
    return transport_.set_shm({options.shm, options.shm_ring_bytes, options.shm_host});
  }
  // In process (WorkerOptions::in_process): peers of this process file collective messages
  // straight into this worker's mailbox, under its address, until stop_in_process_collectives.
  absl::Status serve_collectives_in_process(const std::string& address) { return transport_.serve_in_process(address); }
  // The port the server listens on (Transfers::set_listening_port).
  void set_listening_port(int port) { transfers_.set_listening_port(port); }
  void stop_in_process_collectives() { transport_.close_in_process(); }

  grpc::Status Handshake(grpc::ServerContext* ctx, const pb::HandshakeRequest* req,
                         pb::HandshakeReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_protocol_version(kProtocolVersion);
    reply->set_server(absl::StrCat("tessera-worker device ", device_.id()));
    {
      absl::MutexLock lock(&registration_mu_);
      reply->set_epoch(epoch_);
      reply->set_incarnation(incarnation_);
    }
    if (transfers_.shm_transfers()) {
      reply->set_transfer_host(shm_transfer_host());
      reply->set_writes_client_memory(true);
    }
    return to_grpc(check_protocol_version(req->protocol_version(), absl::StrCat("client '", req->peer(), "'")));
  }

  grpc::Status PutShard(grpc::ServerContext* ctx, grpc::ServerReader<pb::ShardChunk>* reader,
                        pb::PutShardReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    return transfers_.put(ctx, *caller, reader, reply);
  }

  grpc::Status GetShard(grpc::ServerContext* ctx, const pb::GetShardRequest* req,
                        grpc::ServerWriter<pb::ShardChunk>* writer) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    return transfers_.get(ctx, *caller, req, writer);
  }

  grpc::ServerUnaryReactor* DeleteBuffers(grpc::CallbackServerContext* ctx, const pb::DeleteBuffersRequest* req,
                                          pb::DeleteBuffersReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    // Clients delete through the coordinator (DeleteArray), which checks the owner.
    absl::StatusOr<Caller> caller = auth_.require_coordinator(*ctx, Role::kAdmin, "DeleteBuffers");
    if (!caller.ok()) {
      reactor->Finish(to_grpc(caller.status()));
      return reactor;
    }
    reply->set_deleted(runner_.delete_buffers(req->buffer_ids()));
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::Status RunCollective(grpc::ServerContext* ctx, const pb::WorkerCollectiveRequest* req,
                             pb::WorkerCollectiveReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.require_coordinator(*ctx, Role::kDaemon, "RunCollective");
    if (!caller.ok()) return to_grpc(caller.status());
    if (absl::Status tagged = check_run_tag(*req, "RunCollective", "WorkerCollectiveRequest"); !tagged.ok()) {
      return to_grpc(device_.name_in(tagged));
    }
    absl::StatusOr<Shape> shape = run_collective(
        *req, [ctx] { return ctx->IsCancelled(); }, reply);
    transport_.finish_op(req->op_id());
    if (!shape.ok()) {
      return to_grpc(device_.name_in(shape.status()));
    }
    to_proto(*shape, reply->mutable_output_shape());
    return grpc::Status::OK;
  }

  grpc::Status Reshard(grpc::ServerContext* ctx, const pb::WorkerReshardRequest* req,
                       pb::WorkerReshardReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.require_coordinator(*ctx, Role::kDaemon, "Reshard");
    if (!caller.ok()) return to_grpc(caller.status());
    if (absl::Status tagged = check_run_tag(*req, "Reshard", "WorkerReshardRequest"); !tagged.ok()) {
      return to_grpc(device_.name_in(tagged));
    }
    absl::Status done = reshard(
        *req, [ctx] { return ctx->IsCancelled(); }, reply);
    transport_.finish_op(req->op_id());
    if (!done.ok()) return to_grpc(device_.name_in(done));
    return grpc::Status::OK;
  }

  grpc::Status LoadPlan(grpc::ServerContext* ctx, const pb::LoadPlanRequest* req, pb::LoadPlanReply*) override {
    absl::StatusOr<Caller> caller = auth_.require_coordinator(*ctx, Role::kDaemon, "LoadPlan");
    if (!caller.ok()) return to_grpc(caller.status());
    // The program is the same for every device: this one resolves it for its own position.
    absl::StatusOr<DevicePlan> program = plan_from_proto(req->plan());
    if (!program.ok()) return to_grpc(program.status());
    absl::StatusOr<Mesh> mesh = mesh_from_proto(req->mesh());
    if (!mesh.ok()) return to_grpc(mesh.status());
    absl::StatusOr<DevicePlan> plan = resolve(*program, *mesh, device_.id());
    if (!plan.ok()) return to_grpc(plan.status());
    std::map<int, std::string> peers;
    for (const pb::PeerAddress& peer : req->peers()) peers[peer.device_id()] = peer.address();
    plans_.add(req->plan_id(), std::make_shared<LoadedPlan>(*std::move(plan), std::move(peers)));
    return grpc::Status::OK;
  }

  grpc::Status UnloadPlans(grpc::ServerContext* ctx, const pb::UnloadPlansRequest* req,
                           pb::UnloadPlansReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.require_coordinator(*ctx, Role::kDaemon, "UnloadPlans");
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_unloaded(plans_.unload(std::vector<uint64_t>(req->plan_ids().begin(), req->plan_ids().end())));
    if (reply->unloaded() > 0) heap_.released();
    return grpc::Status::OK;
  }

  // The coordinator's RunPlans stream (see PlanRunner).
  grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>* RunPlans(
      grpc::CallbackServerContext* ctx) override {
    absl::StatusOr<Caller> caller = auth_.require_coordinator(*ctx, Role::kDaemon, "RunPlans");
    if (!caller.ok()) {
      return new Refused<grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>>(caller.status());
    }
    return runner_.open_stream();
  }

  // Collective data arrives raw (see Transport): read by a callback reactor, not copied.
  // Only the cluster's daemons may send here, and only as a current registration of the
  // cluster (PeerView: checked when the stream opens, and again by every view after: a stream
  // whose registration was replaced ends); a stream carries only the messages of the device it
  // declares (others are dropped and counted).
  grpc::ServerReadReactor<grpc::ByteBuffer>* Exchange(grpc::CallbackServerContext* ctx,
                                                      grpc::ByteBuffer* response) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "Exchange");
    if (!caller.ok()) return new Refused<grpc::ServerReadReactor<grpc::ByteBuffer>>(caller.status());
    if (!caller->open && caller->device < 0) {
      return new Refused<grpc::ServerReadReactor<grpc::ByteBuffer>>(
          absl::PermissionDeniedError("Exchange: the stream does not say which device sends it ('tessera-device')"));
    }
    // Over TLS the device is the certificate's (authenticate checked it); otherwise a claim.
    const StreamClaim claim = stream_claim(*ctx);
    return transport_.new_exchange_reader(response, claim.device, &peers_, claim);
  }

  // Any client may profile (as it may read GetStats): a trace holds op names, shapes and times,
  // never data.
  grpc::Status Profile(grpc::ServerContext* ctx, const pb::ProfileRequest* req, pb::ProfileReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    return to_grpc(answer_profile(transport_.profile(), *req, device_.id(), reply));
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
    reply->set_device_id(device_.id());
    reply->set_buffer_count(stats.buffer_count);
    reply->set_bytes_used(stats.bytes_used);
    reply->set_memory_limit_bytes(stats.limit_bytes);
    reply->set_collective_messages_pending(transport_.pending_messages());
    reply->set_collective_bytes_pending(transport_.pending_bytes());
    reply->set_exchange_messages_dropped(transport_.dropped_messages());
    reply->set_shm_messages_received(transport_.shm_messages_received());
    reply->set_in_process_messages_received(transport_.in_process_messages_received());
    reply->set_blas_kernel(blas_kernel_name());
    reply->set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - started_));
    {
      absl::MutexLock lock(&registration_mu_);
      reply->set_incarnation(incarnation_);
    }
    const PlanStore::Stats plans = plans_.stats();
    reply->set_plans_loaded(plans.loaded);
    reply->set_plans_evicted(plans.evicted);
    const PlanRunner::RunCounts runs = runner_.counts();
    reply->set_plan_runs_in_flight(runs.in_flight);
    reply->set_bytes_put(transfers_.bytes_put());
    reply->set_bytes_fetched(transfers_.bytes_fetched());
    reply->set_shm_bytes_put(transfers_.shm_bytes_put());
    reply->set_shm_bytes_fetched(transfers_.shm_bytes_fetched());
    reply->set_client_memory_bytes_read(transfers_.client_memory_bytes_read());
    reply->set_client_memory_bytes_written(transfers_.client_memory_bytes_written());
    reply->set_bytes_fanned_out(transfers_.bytes_fanned_out());
    reply->set_plan_runs(runs.runs);
    reply->set_plan_runs_stepped(runs.stepped);
    reply->set_plan_runs_failed(runs.failed);
    reply->set_last_error(runs.last_error);
    if (runs.failed > 0) reply->set_last_error_age_ms(absl::ToInt64Milliseconds(absl::Now() - runs.last_error_at));
  }

 private:
  // A collective's or reshard's messages carry its request's run tag, which a receiver checks
  // (docs/design.md, "Run tags"): tag 0 would take anyone's messages at the predictable op id.
  // Refused before the op is touched (its end is not recorded, so the real run of that op id
  // is not disturbed).
  template <typename Request>
  static absl::Status check_run_tag(const Request& req, absl::string_view method, absl::string_view message) {
    if (req.run_tag() != 0) return absl::OkStatus();
    return run_tag_0_refusal(absl::StrCat(method, " of op ", req.op_id()), absl::StrCat(message, ".run_tag"));
  }

  // Validates the request, runs this device's part and stores the result.
  // A run's op id, peers and clock from its request (RunCollective's or Reshard's): it starts
  // now and ends after the request's timeout_ms (0: 10 s; at most an hour).
  template <typename Request, typename Run>
  void start_run(const Request& req, std::function<bool()> cancelled, Run* run) const {
    run->op = req.op_id();
    run->run_tag = req.run_tag();
    run->self = device_.id();
    for (const pb::PeerAddress& peer : req.peers()) run->peers[peer.device_id()] = peer.address();
    const int64_t timeout_ms = req.timeout_ms() > 0 ? std::min<int64_t>(req.timeout_ms(), 3'600'000) : 10'000;
    run->start = absl::Now();
    run->deadline = run->start + absl::Milliseconds(timeout_ms);
    run->cancelled = std::move(cancelled);
  }

  // This device's part of a ReshardArray (worker/collectives/move_blocks.h): its output block
  // reserved first, stored only when complete.
  absl::Status reshard(const pb::WorkerReshardRequest& req, std::function<bool()> cancelled,
                       pb::WorkerReshardReply* reply) {
    BlockMoveRun run;
    start_run(req, std::move(cancelled), &run);
    TESSERA_RETURN_IF_ERROR(pieces_from_proto(req, &run));
    TESSERA_ASSIGN_OR_RETURN(const DType dtype, dtype_from_proto(req.dtype()));
    std::shared_ptr<const HostArray> input;
    if (req.input_buffer() != 0) {
      TESSERA_ASSIGN_OR_RETURN(input, store_.get(req.input_buffer()));
    }
    std::optional<Shape> out_shape;
    if (req.output_buffer() != 0) {
      TESSERA_ASSIGN_OR_RETURN(out_shape, shape_from_proto(req.output_shape(), dtype));
      TESSERA_RETURN_IF_ERROR(store_.reserve(req.output_buffer(), num_elements(*out_shape) * dtype_size(dtype)));
    }
    absl::StatusOr<std::shared_ptr<const HostArray>> out = move_blocks(transport_, run, input, dtype, out_shape);
    if (!out.ok()) {
      if (req.output_buffer() != 0) store_.cancel(req.output_buffer());
      return absl::Status(out.status().code(), absl::StrCat("reshard (op ", run.op, "): ", out.status().message()));
    }
    if (req.output_buffer() != 0) store_.commit(req.output_buffer(), *std::move(out));
    int64_t sent = 0;
    for (const BlockPiece& p : run.sends) {
      if (p.peer != run.self) sent += num_elements(block_shape(p.box)) * dtype_size(dtype);
    }
    reply->set_bytes_sent(sent);
    return absl::OkStatus();
  }

  absl::StatusOr<Shape> run_collective(const pb::WorkerCollectiveRequest& req, std::function<bool()> cancelled,
                                       pb::WorkerCollectiveReply* reply) {
    CollectiveRun run;
    TESSERA_ASSIGN_OR_RETURN(run.spec, collective_from_proto(req.spec()));
    start_run(req, std::move(cancelled), &run);
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

  const Authenticator auth_;
  WorkerDevice device_;
  // The registration this worker holds (0 and 0 before the first), as Handshake reports it.
  absl::Mutex registration_mu_;
  uint64_t epoch_ ABSL_GUARDED_BY(registration_mu_) = 0;
  uint64_t incarnation_ ABSL_GUARDED_BY(registration_mu_) = 0;
  BufferStore store_;
  const absl::Time started_;
  HeapTrimmer heap_;
  int64_t last_dropped_ = 0;  // by tick(), on the heartbeat thread only
  PeerView peers_;            // whom Exchange streams are taken from
  Transport transport_;
  PlanStore plans_;
  Transfers transfers_;
  // Last: its threads use everything above, and its destructor joins them.
  PlanRunner runner_;
};

class WorkerServerImpl final : public WorkerServer {
 public:
  explicit WorkerServerImpl(const WorkerOptions& options)
      : options_(options),
        service_(options),
        registration_(
            options, daemon_identity(options.credentials), &service_.store(), &service_.plans(), &health_,
            [this](int id, uint64_t epoch, uint64_t incarnation) { service_.registered(id, epoch, incarnation); },
            [this] { service_.tick(); }, &service_.peers(), [this](bool begins) { service_.registering(begins); }) {
    service_.peers().set_refresh([this] { registration_.beat_now(); });
  }
  ~WorkerServerImpl() override { shutdown(); }

  absl::Status init() {
    TESSERA_RETURN_IF_ERROR(service_.configure_collectives(options_));
    grpc::ServerBuilder builder;
    int port = 0;
    const std::string bind = options_.bind_host.empty() ? options_.host : options_.bind_host;
    if (!options_.in_process) {
      builder.AddListeningPort(absl::StrCat(bind, ":", options_.port), server_credentials(options_.credentials), &port);
    }
    configure_server(&builder, options_.max_sync_threads);
    rpc_errors_.install(&builder);
    builder.RegisterService(&service_);
    builder.RegisterService(health_.service());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || (port == 0 && !options_.in_process)) {
      return absl::UnavailableError(absl::StrCat("tessera-worker: cannot listen on ", bind, ":", options_.port));
    }
    if (options_.in_process) {
      TESSERA_ASSIGN_OR_RETURN(in_process_, InProcessAddress::add(server_.get()));
      address_ = in_process_->address();
      TESSERA_RETURN_IF_ERROR(service_.serve_collectives_in_process(address_));  // before peers know the address
    } else {
      address_ = absl::StrCat(options_.host, ":", port);
      service_.set_listening_port(port);
    }
    if (options_.health_port >= 0 && !options_.in_process) {
      absl::StatusOr<std::unique_ptr<HealthPort>> health_port = health_.serve_plaintext(bind, options_.health_port);
      if (!health_port.ok())
        return absl::UnavailableError(absl::StrCat("tessera-worker: ", health_port.status().message()));
      health_port_ = *std::move(health_port);
    }

    TESSERA_RETURN_IF_ERROR(registration_.start(address_));
    health_.set_ready(true);
    registration_.start_heartbeats();
    return absl::OkStatus();
  }

  int device_id() const override { return registration_.device_id(); }
  std::string address() const override { return address_; }
  int health_port() const override { return health_port_ == nullptr ? -1 : health_port_->port(); }

  std::vector<MetricSample> metrics() override {
    pb::WorkerStats s;
    service_.fill_stats(&s);
    const MetricLabels device = {{"device", absl::StrCat(s.device_id())}};
    const char* const kTrims =
        "Times the heap's free pages went back to the kernel (malloc_trim): after unloads and dropped messages "
        "(released), or once idle after the runs freed --heap_trim_freed_bytes (idle).";
    std::vector<MetricSample> samples = {
        counter("tessera_worker_put_bytes_total", "Bytes of shards clients (and peers) put here (PutShard).",
                s.bytes_put(), device),
        counter("tessera_worker_fetched_bytes_total", "Bytes of shards read from here (GetShard).", s.bytes_fetched(),
                device),
        counter("tessera_worker_shm_put_bytes_total",
                "Of the bytes put here, those read from a co-located client's shared memory.", s.shm_bytes_put(),
                device),
        counter("tessera_worker_shm_fetched_bytes_total",
                "Of the bytes read from here, those written into a co-located client's shared memory.",
                s.shm_bytes_fetched(), device),
        counter("tessera_worker_client_memory_read_bytes_total",
                "Of the bytes put through shared memory, those read straight from the client's memory (not its memfd).",
                s.client_memory_bytes_read(), device),
        counter("tessera_worker_client_memory_written_bytes_total",
                "Of the bytes fetched through shared memory, those written straight into the client's memory (not its "
                "memfd).",
                s.client_memory_bytes_written(), device),
        gauge("tessera_worker_plan_runs_in_flight", "Plan runs started and not finished.", s.plan_runs_in_flight(),
              device),
        gauge("tessera_worker_plan_runs_waiting",
              "Plan runs received that wait for runs before them (on their stream) to make their inputs.",
              static_cast<double>(service_.runner().counts().waiting), device),
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
        counter("tessera_worker_heap_trims_total", kTrims, static_cast<double>(service_.heap().released_trims()),
                {device[0], {"reason", "released"}}),
        counter("tessera_worker_heap_trims_total", kTrims, static_cast<double>(service_.heap().idle_trims()),
                {device[0], {"reason", "idle"}}),
        counter("tessera_worker_heap_trimmed_bytes_total",
                "Resident bytes the trims gave back to the kernel (the process's VmRSS drop across each).",
                static_cast<double>(service_.heap().trimmed_bytes()), device),
        counter("tessera_worker_freed_bytes_total",
                "Bytes of arrays freed to the allocator in this process (not kept by the buffer cache).",
                static_cast<double>(HostArray::bytes_freed()), device),
        gauge("tessera_worker_buffer_cache_bytes",
              "Bytes of freed buffers this process keeps for reuse (--buffer_cache_bytes bounds them).",
              static_cast<double>(HostArray::buffer_cache_bytes()), device),
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
    registration_.announce_draining();  // the coordinator stops sending work here
    service_.runner().start_drain();
    const int64_t busy = service_.runner().runs_in_flight();
    if (busy > 0) {
      std::fprintf(stderr, "tessera-worker: draining: %lld plan run(s) in flight; waiting up to %s for them\n",
                   static_cast<long long>(busy), absl::FormatDuration(timeout).c_str());
    }
    const int64_t left = service_.runner().wait_for_idle(options_.drain_quiet, absl::Now() + timeout);
    if (left > 0) {
      std::fprintf(stderr, "tessera-worker: drain timed out: %lld plan run(s) still in flight fail\n",
                   static_cast<long long>(left));
    } else if (busy > 0) {
      std::fprintf(stderr, "tessera-worker: drained: every plan run in flight finished\n");
    }
    // Deregister: the coordinator records the device as left, not lost after the heartbeat
    // timeout, and calls needing it fail at once naming it.
    if (absl::Status gone = registration_.leave(); gone.ok()) {
      std::fprintf(stderr, "tessera-worker: device %d deregistered\n", registration_.device_id());
    } else {
      std::fprintf(stderr,
                   "tessera-worker: device %d: deregistration failed (the coordinator will count it lost): %s\n",
                   registration_.device_id(), std::string(gone.message()).c_str());
    }
    return left;
  }

  std::shared_ptr<LocalRuns> local_runs() override { return service_.runner().local_runs(); }

  void stop_heartbeats() override { registration_.stop(); }

  void stop_all_but_server() override {
    health_.set_ready(false);
    health_port_.reset();
    registration_.stop();
    service_.stop_in_process_collectives();                // peers' sends here and waits on us fail at once
    service_.runner().stop_local_runs(absl::Seconds(10));  // runs handed over in process fail at once
  }

  void shutdown() override {
    stop_all_but_server();
    if (in_process_ != nullptr) in_process_->reset();  // no new channels to a server going away
    if (server_ != nullptr) {
      // Peers keep Exchange streams open for good: cancel what is in flight promptly.
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
      server_->Wait();
      server_.reset();
    }
  }

 private:
  // Constant after init().
  const WorkerOptions options_;
  WorkerService service_;
  HealthService health_;
  std::unique_ptr<HealthPort> health_port_;  // options_.health_port's server, if any
  RpcErrorCounter rpc_errors_;               // outlives server_
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<InProcessAddress> in_process_;  // options_.in_process: server_'s address
  std::string address_;
  // After what it uses; stopped in shutdown(), before the server goes.
  Registration registration_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<WorkerServer>> WorkerServer::start(const WorkerOptions& options) {
  if (options.memory_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tessera-worker: memory_bytes must be positive, got ", options.memory_bytes));
  }
  TESSERA_RETURN_IF_ERROR(check_max_sync_threads(options.max_sync_threads, "max_sync_threads"));
  // With TLS the worker serves and presents its device's own certificate (which names it).
  WorkerOptions own = options;
  TESSERA_ASSIGN_OR_RETURN(own.credentials, credentials_for_device(options.credentials, &own.device_id));
  auto server = std::make_unique<WorkerServerImpl>(own);
  TESSERA_RETURN_IF_ERROR(server->init());
  return std::unique_ptr<WorkerServer>(std::move(server));
}

}  // namespace tessera

#include "coordinator/coordinator_server.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "coordinator/registry.h"
#include "core/collective.h"
#include "core/status.h"
#include "core/wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera {
namespace {

void to_proto(const DeviceRecord& d, pb::DeviceInfo* out) {
  out->set_id(d.id);
  out->set_address(d.address);
  out->set_name(d.name);
  out->set_state(d.alive ? pb::ALIVE : pb::LOST);
  out->set_memory_bytes(d.memory_bytes);
  out->set_incarnation(d.incarnation);
}

// After the first member of a collective fails, how long the others get to report theirs
// before the rest are cancelled.
constexpr absl::Duration kFailureGrace = absl::Milliseconds(500);

// The coordinator's line to one worker.
struct WorkerChannel {
  std::unique_ptr<pb::Worker::Stub> stub;
  std::atomic<bool> reached{false};  // a call has succeeded: the worker was up at least once
};

class CoordinatorService final : public pb::Coordinator::Service {
 public:
  explicit CoordinatorService(const CoordinatorOptions& options)
      : options_(options), registry_(options.heartbeat_timeout) {}

  Registry& registry() { return registry_; }

  grpc::Status Handshake(grpc::ServerContext*, const pb::HandshakeRequest* req, pb::HandshakeReply* reply) override {
    reply->set_protocol_version(kProtocolVersion);
    reply->set_server("tessera-coordinator");
    return to_grpc(check_protocol_version(req->protocol_version(), absl::StrCat("client '", req->peer(), "'")));
  }

  grpc::Status RegisterWorker(grpc::ServerContext*, const pb::RegisterWorkerRequest* req,
                              pb::RegisterWorkerReply* reply) override {
    absl::Status version = check_protocol_version(req->protocol_version(), absl::StrCat("worker at ", req->address()));
    if (!version.ok()) return to_grpc(version);
    if (req->address().empty() || req->name().empty()) {
      return to_grpc(absl::InvalidArgumentError("RegisterWorker: name and address are required"));
    }
    if (req->memory_bytes() <= 0) {
      return to_grpc(absl::InvalidArgumentError(
          absl::StrCat("RegisterWorker: memory_bytes must be positive, got ", req->memory_bytes())));
    }
    absl::StatusOr<DeviceRecord> d = registry_.register_worker(req->name(), req->address(), req->requested_device_id(),
                                                               req->memory_bytes(), absl::Now());
    if (!d.ok()) return to_grpc(d.status());
    reply->set_device_id(d->id);
    reply->set_incarnation(d->incarnation);
    reply->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext*, const pb::HeartbeatRequest* req, pb::HeartbeatReply*) override {
    return to_grpc(registry_.heartbeat(req->device_id(), req->incarnation(), absl::Now()));
  }

  grpc::Status GetTopology(grpc::ServerContext*, const pb::GetTopologyRequest* req, pb::Topology* reply) override {
    if (req->min_alive_devices() > 0) {
      const absl::Duration wait = absl::Milliseconds(std::clamp<int64_t>(req->wait_ms(), 0, 600'000));
      if (!registry_.wait_for_alive(req->min_alive_devices(), wait)) {
        return to_grpc(absl::DeadlineExceededError(absl::StrCat("fewer than ", req->min_alive_devices(),
                                                                " devices alive after ", absl::FormatDuration(wait),
                                                                "; registered: ", registry_.devices().size())));
      }
    }
    for (const DeviceRecord& d : registry_.devices()) to_proto(d, reply->add_devices());
    return grpc::Status::OK;
  }

  grpc::Status CreateArray(grpc::ServerContext*, const pb::CreateArrayRequest* req,
                           pb::CreateArrayReply* reply) override {
    absl::StatusOr<uint64_t> id = create_array(*req);
    if (!id.ok()) return to_grpc(id.status());
    reply->set_array_id(*id);
    return grpc::Status::OK;
  }

  grpc::Status GetArray(grpc::ServerContext*, const pb::GetArrayRequest* req, pb::GetArrayReply* reply) override {
    absl::StatusOr<ArrayRecord> a = registry_.get_array(req->array_id());
    if (!a.ok()) return to_grpc(a.status());
    pb::ArrayInfo* info = reply->mutable_info();
    info->set_array_id(a->id);
    info->set_dtype(tessera::to_proto(a->dtype));
    tessera::to_proto(a->shape, info->mutable_shape());
    tessera::to_proto(a->sharding, info->mutable_sharding());
    for (int id : a->sharding.mesh().device_ids()) {
      std::optional<DeviceRecord> d = registry_.device(id);
      if (d.has_value()) to_proto(*d, reply->add_devices());
    }
    return grpc::Status::OK;
  }

  grpc::Status DeleteArray(grpc::ServerContext*, const pb::DeleteArrayRequest* req, pb::DeleteArrayReply*) override {
    std::vector<uint64_t> ids(req->array_ids().begin(), req->array_ids().end());
    delete_buffers(registry_.remove_arrays(ids));
    return grpc::Status::OK;
  }

  grpc::Status RunCollective(grpc::ServerContext*, const pb::RunCollectiveRequest* req,
                             pb::RunCollectiveReply* reply) override {
    absl::StatusOr<ArrayRecord> out = run_collective(*req);
    if (!out.ok()) return to_grpc(out.status());
    pb::ArrayInfo* info = reply->mutable_result();
    info->set_array_id(out->id);
    info->set_dtype(tessera::to_proto(out->dtype));
    tessera::to_proto(out->shape, info->mutable_shape());
    tessera::to_proto(out->sharding, info->mutable_sharding());
    return grpc::Status::OK;
  }

 private:
  // Issues one asynchronous call per target, all at once, and waits for every answer.
  // start(i, ctx, done) must start call i on `ctx` and have it call done(status). A call to a
  // worker never reached before waits for the connection (bounded by `deadline`; see
  // kConnectDeadline); one to a worker reached before fails fast if it is gone. With a `grace`, the
  // first failure cancels whatever is still running `grace` later: the members of a failed
  // collective need not all wait out their own deadline.
  using StartCall = std::function<void(int, grpc::ClientContext*, std::function<void(grpc::Status)>)>;
  static std::vector<grpc::Status> fan_out(const std::vector<WorkerChannel*>& workers, absl::Duration deadline,
                                           const StartCall& start, absl::Duration grace = absl::InfiniteDuration()) {
    const int n = static_cast<int>(workers.size());
    std::vector<grpc::Status> statuses(static_cast<size_t>(n));
    std::vector<grpc::ClientContext> contexts(static_cast<size_t>(n));
    absl::Mutex mu;
    int done = 0;
    bool failed = false;
    for (int i = 0; i < n; ++i) {
      set_deadline(&contexts[i], deadline);
      contexts[i].set_wait_for_ready(!workers[i]->reached);
      start(i, &contexts[i], [&, i](grpc::Status s) {
        if (s.ok()) workers[i]->reached = true;
        absl::MutexLock lock(&mu);
        if (!s.ok()) failed = true;
        statuses[i] = std::move(s);
        ++done;
      });
    }
    absl::MutexLock lock(&mu);
    auto all_done = [&]() { return done == n; };
    auto all_done_or_failed = [&]() { return done == n || failed; };
    mu.Await(absl::Condition(&all_done_or_failed));
    if (done < n && grace != absl::InfiniteDuration() && !mu.AwaitWithTimeout(absl::Condition(&all_done), grace)) {
      for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
    }
    mu.Await(absl::Condition(&all_done));
    return statuses;
  }

  // Frees the arrays' buffers on every alive device of their meshes. A device that does not
  // answer keeps garbage, never a wrong value (buffer ids are never reused).
  void delete_buffers(const std::vector<ArrayRecord>& arrays) {
    std::map<int, pb::DeleteBuffersRequest> per_device;
    for (const ArrayRecord& a : arrays) {
      for (int id : a.sharding.mesh().device_ids()) per_device[id].add_buffer_ids(a.id);
    }
    std::vector<WorkerChannel*> workers;
    std::vector<const pb::DeleteBuffersRequest*> requests;
    for (const auto& [device_id, request] : per_device) {
      std::optional<DeviceRecord> d = registry_.device(device_id);
      if (!d.has_value() || !d->alive) continue;
      workers.push_back(worker(d->address));
      requests.push_back(&request);
    }
    std::vector<pb::DeleteBuffersReply> replies(workers.size());
    fan_out(workers, kConnectDeadline, [&](int i, grpc::ClientContext* ctx, auto done) {
      workers[i]->stub->async()->DeleteBuffers(ctx, requests[i], &replies[i], std::move(done));
    });
  }

  // Runs one collective on the blocks of an array; the results become a new array with the
  // same sharding (so every device must hold a block of its own).
  absl::StatusOr<ArrayRecord> run_collective(const pb::RunCollectiveRequest& req) {
    TESSERA_ASSIGN_OR_RETURN(ArrayRecord in, registry_.get_array(req.array_id()));
    TESSERA_ASSIGN_OR_RETURN(CollectiveSpec spec, collective_from_proto(req.spec()));
    const std::string name = collective_name(spec.kind);
    const NamedSharding& sharding = in.sharding;
    if (sharding.num_replicas() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": array ", in.id, " under ", sharding.spec().to_string(),
                                                     " has replicated blocks; every device must hold its own block"));
    }
    const std::vector<int>& mesh_devices = sharding.mesh().device_ids();
    size_t grouped = 0;
    for (const std::vector<int>& group : spec.groups) {
      for (int d : group) {
        if (std::find(mesh_devices.begin(), mesh_devices.end(), d) == mesh_devices.end()) {
          return absl::InvalidArgumentError(absl::StrCat(name, ": device ", d, " is not in the mesh of array ", in.id));
        }
        ++grouped;
      }
    }
    if (grouped != mesh_devices.size()) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": the replica groups cover ", grouped, " of the ",
                                                     mesh_devices.size(), " devices of array ", in.id));
    }
    const Shape block = sharding.shard_shape(in.shape);
    TESSERA_ASSIGN_OR_RETURN(Shape out_block, collective_output_shape(spec, block));
    Shape out_shape = in.shape;
    for (size_t d = 0; d < out_shape.size(); ++d) {
      int64_t blocks = 1;
      for (const std::string& axis : sharding.spec().axes(static_cast<int>(d)))
        blocks *= sharding.mesh().axis_size(axis);
      out_shape[d] = blocks * out_block[d];
    }
    std::vector<pb::PeerAddress> peers;
    for (int d : mesh_devices) {
      std::optional<DeviceRecord> device = registry_.device(d);
      if (!device.has_value() || !device->alive) {
        return absl::UnavailableError(
            absl::StrCat(name, ": ", describe_device(d, device ? device->address : "?"), " is lost"));
      }
      pb::PeerAddress peer;
      peer.set_device_id(d);
      peer.set_address(device->address);
      peers.push_back(std::move(peer));
    }
    TESSERA_ASSIGN_OR_RETURN(uint64_t out_id, registry_.create_array(in.dtype, out_shape, sharding));

    const int64_t timeout_ms = req.timeout_ms() > 0 ? req.timeout_ms() : 10'000;
    pb::WorkerCollectiveRequest request;
    request.set_op_id(out_id);  // array ids are unique: so are the ops that make them
    *request.mutable_spec() = req.spec();
    request.set_input_buffer(in.id);
    request.set_output_buffer(out_id);
    for (const pb::PeerAddress& p : peers) *request.add_peers() = p;
    request.set_timeout_ms(timeout_ms);
    std::vector<pb::WorkerCollectiveReply> replies(peers.size());
    std::vector<WorkerChannel*> workers;
    for (const pb::PeerAddress& p : peers) workers.push_back(worker(p.address()));
    std::vector<grpc::Status> statuses = fan_out(
        workers, absl::Milliseconds(timeout_ms) + absl::Seconds(5),
        [&](int i, grpc::ClientContext* ctx, auto done) {
          workers[i]->stub->async()->RunCollective(ctx, &request, &replies[i], std::move(done));
        },
        kFailureGrace);
    // Report every failure, the likeliest root cause first: a member that is gone
    // (UNAVAILABLE) before members that only waited in vain for it (DEADLINE_EXCEEDED), and
    // members cancelled after the first failure last.
    std::vector<absl::Status> failures;
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) {
        failures.push_back(from_grpc(statuses[i], describe_device(peers[i].device_id(), peers[i].address())));
      }
    }
    if (!failures.empty()) {
      delete_buffers(registry_.remove_arrays({out_id}));
      std::stable_sort(failures.begin(), failures.end(), [](const absl::Status& a, const absl::Status& b) {
        auto rank = [](const absl::Status& s) {
          return s.code() == absl::StatusCode::kUnavailable ? 0 : s.code() == absl::StatusCode::kCancelled ? 2 : 1;
        };
        return rank(a) < rank(b);
      });
      std::string message = absl::StrCat(name, " failed on ", failures.size(), " of ", peers.size(), " devices: ");
      for (size_t i = 0; i < failures.size() && i < 3; ++i)
        absl::StrAppend(&message, i ? "; " : "", failures[i].message());
      if (failures.size() > 3) absl::StrAppend(&message, "; ...");
      return absl::Status(failures[0].code(), message);
    }
    return registry_.get_array(out_id);
  }

  // Converts and checks a CreateArray request; the registry checks the devices.
  absl::StatusOr<uint64_t> create_array(const pb::CreateArrayRequest& req) {
    TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(req.dtype()));
    TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(req.shape(), dtype));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(req.sharding()));
    return registry_.create_array(dtype, shape, sharding);
  }

  WorkerChannel* worker(const std::string& address) {
    absl::MutexLock lock(&stubs_mu_);
    auto& w = workers_[address];
    if (w == nullptr) {
      w = std::make_unique<WorkerChannel>();
      w->stub = pb::Worker::NewStub(make_channel(address));
    }
    return w.get();
  }

  // Constant after construction.
  const CoordinatorOptions options_;
  Registry registry_;

  absl::Mutex stubs_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<WorkerChannel>> workers_ ABSL_GUARDED_BY(stubs_mu_);
};

class CoordinatorServerImpl final : public CoordinatorServer {
 public:
  explicit CoordinatorServerImpl(const CoordinatorOptions& options) : options_(options), service_(options) {}
  ~CoordinatorServerImpl() override { shutdown(); }

  absl::Status init() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat(options_.host, ":", options_.port), grpc::InsecureServerCredentials(),
                             &port_);
    configure_server(&builder);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("tessera-coordinator: cannot listen on ", options_.host, ":", options_.port));
    }
    monitor_ = std::thread([this] { monitor_loop(); });
    return absl::OkStatus();
  }

  std::string address() const override { return absl::StrCat(options_.host, ":", port_); }
  int port() const override { return port_; }

  void shutdown() override {
    if (!stopping_.HasBeenNotified()) stopping_.Notify();
    if (monitor_.joinable()) monitor_.join();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      server_->Wait();
      server_.reset();
    }
  }

 private:
  // Marks silent workers lost; checks four times per heartbeat interval.
  void monitor_loop() {
    while (!stopping_.WaitForNotificationWithTimeout(options_.heartbeat_interval / 4)) {
      for (int id : service_.registry().mark_lost(absl::Now())) {
        std::optional<DeviceRecord> d = service_.registry().device(id);
        std::fprintf(stderr, "tessera-coordinator: %s missed heartbeats for %s; marked lost\n",
                     describe_device(id, d ? d->address : "?").c_str(),
                     absl::FormatDuration(options_.heartbeat_timeout).c_str());
      }
    }
  }

  const CoordinatorOptions options_;
  CoordinatorService service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Notification stopping_;
  std::thread monitor_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::start(const CoordinatorOptions& options) {
  if (options.heartbeat_interval <= absl::ZeroDuration() || options.heartbeat_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tessera-coordinator: heartbeat_timeout (", absl::FormatDuration(options.heartbeat_timeout),
        ") must exceed a positive heartbeat_interval (", absl::FormatDuration(options.heartbeat_interval), ")"));
  }
  auto server = std::make_unique<CoordinatorServerImpl>(options);
  TESSERA_RETURN_IF_ERROR(server->init());
  return std::unique_ptr<CoordinatorServer>(std::move(server));
}

}  // namespace tessera

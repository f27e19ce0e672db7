#include "coordinator/coordinator_server.h"

#include <cstdio>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/notification.h"
#include "coordinator/registry.h"
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
    std::vector<ArrayRecord> removed = registry_.remove_arrays(ids);
    // Fan out one DeleteBuffers per alive device, in parallel; a device that fails to answer
    // keeps garbage, never a wrong value (buffer ids are never reused).
    std::map<int, pb::DeleteBuffersRequest> per_device;
    for (const ArrayRecord& a : removed) {
      for (int id : a.sharding.mesh().device_ids()) per_device[id].add_buffer_ids(a.id);
    }
    struct Call {
      grpc::ClientContext ctx;
      pb::DeleteBuffersReply reply;
    };
    std::vector<std::unique_ptr<Call>> calls;
    std::vector<std::pair<pb::Worker::Stub*, const pb::DeleteBuffersRequest*>> targets;
    for (const auto& [device_id, request] : per_device) {
      std::optional<DeviceRecord> d = registry_.device(device_id);
      if (!d.has_value() || !d->alive) continue;
      targets.emplace_back(worker_stub(d->address), &request);
    }
    absl::BlockingCounter done(static_cast<int>(targets.size()));
    for (auto& [stub, request] : targets) {
      calls.push_back(std::make_unique<Call>());
      Call* call = calls.back().get();
      set_deadline(&call->ctx, kConnectDeadline);
      call->ctx.set_wait_for_ready(true);
      stub->async()->DeleteBuffers(&call->ctx, request, &call->reply, [&done](grpc::Status) { done.DecrementCount(); });
    }
    done.Wait();
    return grpc::Status::OK;
  }

 private:
  // Converts and checks a CreateArray request; the registry checks the devices.
  absl::StatusOr<uint64_t> create_array(const pb::CreateArrayRequest& req) {
    TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(req.dtype()));
    TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(req.shape(), dtype));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(req.sharding()));
    return registry_.create_array(dtype, shape, sharding);
  }

  pb::Worker::Stub* worker_stub(const std::string& address) {
    absl::MutexLock lock(&stubs_mu_);
    auto& stub = stubs_[address];
    if (stub == nullptr) stub = pb::Worker::NewStub(make_channel(address));
    return stub.get();
  }

  // Constant after construction.
  const CoordinatorOptions options_;
  Registry registry_;

  absl::Mutex stubs_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<pb::Worker::Stub>> stubs_ ABSL_GUARDED_BY(stubs_mu_);
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

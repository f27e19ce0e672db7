#include "tessera/client.h"

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "client/client_impl.h"
#include "client/transfer.h"
#include "core/bounded_join.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/handoff.h"
#include "core/run_tag.h"
#include "core/shm_transfer.h"
#include "core/slicing.h"
#include "core/status.h"
#include "core/unreduced_move.h"
#include "core/wire.h"
#include "grpcpp/alarm.h"
#include "proto/auth.h"
#include "proto/in_process.h"
#include "proto/rpc.h"
#include "tessera/jit.h"
#include "tessera/mesh_context.h"

namespace tessera {
namespace internal {

ClientImpl::ClientImpl(std::string coordinator_address, std::shared_ptr<LocalCluster> cluster, std::string token,
                       std::string ca_pem)
    : cluster_(std::move(cluster)),
      coordinator_address_(std::move(coordinator_address)),
      identity_(std::make_shared<CallIdentity>(std::move(token), -1, std::move(ca_pem))),
      coordinator_(pb::Coordinator::NewStub(make_channel(coordinator_address_, identity_))) {}

ClientImpl::~ClientImpl() {
  // Nothing dropped stays behind: what waits is sent, and waited for with the rest.
  Deletes batch = in_flight_->start_flush();
  if (!batch.empty()) send_deletes(std::move(batch));
  in_flight_->wait_idle();
  {
    absl::MutexLock lock(&mu_);
    stopping_.Notify();
    if (renewing_ != nullptr) renewing_->TryCancel();
  }
  if (renewer_.joinable()) renewer_.join();
}

grpc::Status ClientImpl::cancellable(absl::Duration timeout,
                                     const std::function<grpc::Status(grpc::ClientContext*)>& call) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, timeout);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_.HasBeenNotified()) return grpc::Status(grpc::StatusCode::CANCELLED, "the client is closing");
    renewing_ = &ctx;
  }
  grpc::Status status = call(&ctx);
  absl::MutexLock lock(&mu_);
  renewing_ = nullptr;
  return status;
}

absl::Status ClientImpl::init(const ConnectOptions& options) {
  shared_memory_ = options.shared_memory;
  adopt_puts_ = options.adopt_puts;
  const std::string who = absl::StrCat("coordinator ", coordinator_address_);
  pb::HandshakeRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_peer("tessera client");
  pb::HandshakeReply reply;
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, options.timeout);
    ctx.set_wait_for_ready(true);
    TESSERA_RETURN_IF_ERROR(from_grpc(coordinator_->Handshake(&ctx, req, &reply), who));
  }
  TESSERA_RETURN_IF_ERROR(check_protocol_version(reply.protocol_version(), who));
  {
    pb::OpenSessionRequest open;
    open.set_client("tessera client");
    pb::OpenSessionReply session;
    grpc::ClientContext ctx;
    set_deadline(&ctx, options.timeout);
    TESSERA_RETURN_IF_ERROR(from_grpc(coordinator_->OpenSession(&ctx, open, &session), who));
    identity_->set_session(session.credential());
    session_ = session.session_id();
    epoch_ = session.epoch();
    const absl::Duration lease = absl::Milliseconds(std::max<int64_t>(session.lease_ms(), 1));
    renewer_ = std::thread([this, lease] { renew_leases(lease); });
  }
  pb::GetTopologyRequest topo_req;
  topo_req.set_min_alive_devices(options.min_devices);
  topo_req.set_wait_ms(absl::ToInt64Milliseconds(options.timeout));
  pb::Topology topology;
  grpc::ClientContext ctx;
  set_deadline(&ctx, options.timeout + absl::Seconds(5));
  return from_grpc(coordinator_->GetTopology(&ctx, topo_req, &topology), who);
}

absl::StatusOr<pb::Worker::Stub*> ClientImpl::worker(const std::string& address, const std::string& who) {
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(address);
    if (it != workers_.end()) return it->second.get();
  }
  std::unique_ptr<pb::Worker::Stub> stub = pb::Worker::NewStub(make_channel(address, identity_));
  pb::HandshakeRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_peer("tessera client");
  pb::HandshakeReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, kConnectDeadline);
  ctx.set_wait_for_ready(true);
  TESSERA_RETURN_IF_ERROR(from_grpc(stub->Handshake(&ctx, req, &reply), who));
  TESSERA_RETURN_IF_ERROR(check_protocol_version(reply.protocol_version(), who));
  // The worker opens this process's memfds only if it sees the same host and PID namespace.
  static const std::string* const kHere = new std::string(shm_transfer_host());
  const bool shm = shared_memory_ && !reply.transfer_host().empty() && reply.transfer_host() == *kHere;
  absl::MutexLock lock(&mu_);
  auto& slot = workers_[address];
  if (slot == nullptr) {
    slot = std::move(stub);
    if (shm) shm_workers_.insert(address);
    if (shm && reply.writes_client_memory()) direct_fetch_workers_.insert(address);
  }
  return slot.get();
}

bool ClientImpl::writes_our_memory(const std::string& address) {
  absl::MutexLock lock(&mu_);
  return direct_fetch_workers_.count(address) > 0;
}

TransferPath ClientImpl::transfer_path(const std::string& address) {
  if (is_in_process_address(address)) return TransferPath::kHandoff;
  absl::MutexLock lock(&mu_);
  return shm_workers_.count(address) > 0 ? TransferPath::kSharedMemory : TransferPath::kStream;
}

absl::StatusOr<pb::Topology> ClientImpl::topology() {
  pb::GetTopologyRequest req;
  pb::Topology topology;
  grpc::ClientContext ctx;
  set_deadline(&ctx, kControlDeadline);
  TESSERA_RETURN_IF_ERROR(
      from_grpc(coordinator_->GetTopology(&ctx, req, &topology), absl::StrCat("coordinator ", coordinator_address_)));
  return topology;
}

void ClientImpl::track(uint64_t id, pb::ArrayInfo info) {
  info.set_array_id(id);
  absl::MutexLock lock(&mu_);
  tracked_[id] = std::move(info);
}

void ClientImpl::remember_grant(uint64_t id, const std::string& grant) {
  if (grant.empty()) return;
  absl::MutexLock lock(&mu_);
  grants_[id] = grant;
}

std::string ClientImpl::grant(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto it = grants_.find(id);
  return it == grants_.end() ? "" : it->second;
}

void ClientImpl::renew_leases(absl::Duration lease) {
  const absl::Duration every = lease / 4;
  while (!stopping_.WaitForNotificationWithTimeout(every)) {
    pb::RenewLeaseRequest req;
    req.set_session_id(session_.load());
    pb::RenewLeaseReply reply;
    const grpc::Status renewed =
        cancellable(every, [&](grpc::ClientContext* ctx) { return coordinator_->RenewLease(ctx, req, &reply); });
    if (renewed.ok() && reply.epoch() != epoch_) {
      epoch_ = reply.epoch();  // the coordinator restarted: it took the session over
      adopt_tracked();
    } else if (renewed.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
      // Lapsed (this process was stopped for longer than the lease): what it held is gone.
      std::fprintf(stderr, "tessera client: %s; opening a new session\n", renewed.error_message().c_str());
      pb::OpenSessionRequest open;
      open.set_client("tessera client");
      pb::OpenSessionReply session;
      if (cancellable(every, [&](grpc::ClientContext* ctx) {
            return coordinator_->OpenSession(ctx, open, &session);
          }).ok()) {
        identity_->set_session(session.credential());
        session_ = session.session_id();
        epoch_ = session.epoch();
        absl::MutexLock lock(&mu_);
        tracked_.clear();  // freed with the lapsed session: nothing to adopt after a restart
        grants_.clear();
      }
    }
    // Anything else (the coordinator is down or restarting): the next round tries again.
  }
}

void ClientImpl::adopt_tracked() {
  std::vector<pb::ArrayInfo> arrays;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, info] : tracked_) {
      arrays.push_back(info);
      auto grant = grants_.find(id);
      if (grant != grants_.end()) arrays.back().set_grant(grant->second);
    }
  }
  // In batches well under gRPC's 4 MiB message limit. What cannot be adopted fails precisely
  // when it is used (see with_adoption).
  constexpr size_t kBatch = 1000;
  for (size_t first = 0; first < arrays.size() && !stopping_.HasBeenNotified(); first += kBatch) {
    pb::AdoptArraysRequest req;
    req.set_session_id(session_.load());
    req.set_best_effort(true);
    for (size_t i = first; i < std::min(arrays.size(), first + kBatch); ++i) *req.add_arrays() = arrays[i];
    pb::AdoptArraysReply reply;
    cancellable(kControlDeadline,
                [&](grpc::ClientContext* ctx) { return coordinator_->AdoptArrays(ctx, req, &reply); });
  }
}

void ClientImpl::delete_array(uint64_t id) {
  std::string grant;
  {
    absl::MutexLock lock(&mu_);
    tracked_.erase(id);
    auto it = grants_.find(id);
    if (it != grants_.end()) {
      grant = std::move(it->second);
      grants_.erase(it);
    }
  }
  // Queued, not sent: the next Execute carries it, or the background DeleteArray (see InFlight).
  bool linger = false;
  if (in_flight_->queue_delete(id, grant, &linger)) {
    if (linger) linger_deletes();
    return;
  }
  // kMaxQueuedDeletes wait. gRPC's callback threads must not block: a DeleteArray of its own,
  // which ~ClientImpl waits for.
  if (on_callback_thread()) {
    send_deletes({{id, std::move(grant)}}, /*batch=*/false);
    return;
  }
  // A user thread waits for its deletion: the back-pressure on a loop that drops faster than
  // the coordinator deletes.
  pb::DeleteArrayRequest req;
  req.add_array_ids(id);
  req.add_grants(grant);
  pb::DeleteArrayReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, kControlDeadline);
  const grpc::Status status = coordinator_->DeleteArray(&ctx, req, &reply);
  if (!status.ok()) deletes_failed({{id, ""}}, delete_array_error(status));
}

void ClientImpl::deletes_failed(const Deletes& arrays, const absl::Status& error) {
  report_failed_deletes(arrays, error);
  in_flight_->count_failed_deletes(static_cast<int64_t>(arrays.size()), error);
}

void ClientImpl::report_failed_deletes(const Deletes& arrays, const absl::Status& status) {
  // Best effort: the buffers stay on live workers until they restart, or an admin frees them
  // (`tessera status` lists the arrays). Never silent: logged with the ids and counted
  // (Client::failed_deletes).
  const std::string ids =
      join_at_most(arrays, 8, ", ", [](std::string* out, const auto& a) { absl::StrAppend(out, a.first); });
  std::fprintf(stderr, "tessera client: deleting array%s %s failed: %s\n", arrays.size() == 1 ? "" : "s", ids.c_str(),
               status.ToString().c_str());
}

namespace {

// Whether a DeleteArray refused with `status` may succeed if sent again: the coordinator is
// unreachable for now, or had no thread for it (its synchronous server's are all busy).
bool passing(const grpc::Status& status) {
  return status.error_code() == grpc::StatusCode::UNAVAILABLE ||
         status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

}  // namespace

absl::Status delete_array_error(const grpc::Status& status) {
  // The coordinator's own refusals name the method already ("DeleteArray: array 7 belongs to
  // another session ..."); gRPC's ("Server Threadpool Exhausted") do not.
  if (absl::StartsWith(status.error_message(), "DeleteArray: ")) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  }
  return from_grpc(status, "DeleteArray");
}

Deletes refused_deletes(Deletes arrays, const grpc::Status& status,
                        const std::multimap<grpc::string_ref, grpc::string_ref>& trailers) {
  auto it = trailers.find(kRefusedDeletesTrailer);
  if (status.error_code() != grpc::StatusCode::PERMISSION_DENIED || it == trailers.end()) return arrays;
  absl::flat_hash_set<uint64_t> refused;
  for (absl::string_view id : absl::StrSplit(absl::string_view(it->second.data(), it->second.size()), ',')) {
    uint64_t value = 0;
    if (!absl::SimpleAtoi(id, &value)) return arrays;  // not the coordinator's: count them all
    refused.insert(value);
  }
  Deletes out;
  for (auto& d : arrays) {
    if (refused.contains(d.first)) out.push_back(std::move(d));
  }
  return out;
}

void ClientImpl::send_deletes(Deletes arrays, bool batch) {
  struct DeleteCall {
    grpc::ClientContext ctx;
    pb::DeleteArrayRequest request;
    pb::DeleteArrayReply reply;
    Deletes arrays;
  };
  auto* call = new DeleteCall;
  for (auto& [id, grant] : arrays) {
    call->request.add_array_ids(id);
    call->request.add_grants(grant);  // kept in call->arrays too, for a retry
  }
  call->arrays = std::move(arrays);
  set_deadline(&call->ctx, kControlDeadline);
  if (!batch) in_flight_->begin_call(absl::Now() + kControlDeadline);
  // The callback touches `this` only while the call still counts in InFlight (so ~ClientImpl
  // waits for it): before next_delete_batch, or when that hands it the next batch. A batch
  // refused for a passing reason waits again, and the next batch goes after a backoff
  // (a grpc::Alarm: no thread waits for it), the sender counted meanwhile.
  coordinator_->async()->DeleteArray(
      &call->ctx, &call->request, &call->reply, [this, call, batch, in_flight = in_flight_](grpc::Status s) {
        Deletes arrays = std::move(call->arrays);
        if (!s.ok()) arrays = refused_deletes(std::move(arrays), s, call->ctx.GetServerTrailingMetadata());
        delete call;
        if (batch && passing(s)) {
          Deletes given_up;
          int attempts = 0;
          std::optional<absl::Duration> wait = in_flight->retry_deletes(std::move(arrays), &given_up, &attempts);
          if (!given_up.empty()) {
            const absl::Status error = delete_array_error(s);
            const std::string why =
                wait.has_value() ? absl::StrCat(" (not sent again: ", kMaxQueuedDeletes, " deletions wait already)")
                                 : absl::StrCat(" (", attempts, " attempts in a row were refused)");
            deletes_failed(given_up, absl::Status(error.code(), absl::StrCat(error.message(), why)));
          }
          if (wait.has_value()) {
            send_deletes_after(*wait, &InFlight::next_delete_batch);
            return;
          }
        } else {
          if (batch) in_flight->end_delete_retries();
          if (!s.ok()) deletes_failed(arrays, delete_array_error(s));
        }
        if (!batch) {
          in_flight->end_call();
          return;
        }
        Deletes next = in_flight->next_delete_batch();
        if (!next.empty()) send_deletes(std::move(next));
      });
}

void ClientImpl::send_deletes_after(absl::Duration wait, Deletes (InFlight::*take)()) {
  auto* alarm = new grpc::Alarm;
  // On one of gRPC's executor threads; the Alarm may go in its own callback (gRPC holds a
  // reference to it until the callback returns). `this` is touched only with a batch to send,
  // which InFlight counts from `take` on.
  alarm->Set(std::chrono::system_clock::now() + absl::ToChronoMicroseconds(wait),
             [this, alarm, in_flight = in_flight_, take](bool) {
               delete alarm;
               Deletes batch = ((*in_flight).*take)();
               if (!batch.empty()) send_deletes(std::move(batch));
             });
}

void ClientImpl::linger_deletes() { send_deletes_after(kDeleteLinger, &InFlight::end_linger); }

absl::Status ClientImpl::flush_deletes() {
  Deletes batch = in_flight_->start_flush();
  if (!batch.empty()) send_deletes(std::move(batch));
  // One DeleteArray may be in flight and one more carry what queued meanwhile, after the
  // waits of a run of retries (kMaxDeleteRetries).
  return in_flight_->await_deletes(absl::Now() + 2 * kControlDeadline + absl::Seconds(1) +
                                   kFirstDeleteRetry * ((1 << kMaxDeleteRetries) - 1));
}

absl::Status with_adoption(const ArrayState& a, uint64_t id, const std::function<absl::Status()>& call) {
  absl::Status status = call();
  if (status.code() != absl::StatusCode::kAborted) return status;
  pb::AdoptArraysRequest req;
  req.set_session_id(a.client->session());
  pb::ArrayInfo* info = req.add_arrays();
  info->set_array_id(id);
  info->set_dtype(to_proto(a.dtype));
  to_proto(a.shape, info->mutable_shape());
  to_proto(a.sharding, info->mutable_sharding());
  info->set_grant(a.client->grant(id));
  pb::AdoptArraysReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, kControlDeadline);
  TESSERA_RETURN_IF_ERROR(from_grpc(a.client->coordinator()->AdoptArrays(&ctx, req, &reply),
                                    absl::StrCat("coordinator ", a.client->coordinator_address())));
  return call();
}

}  // namespace internal

absl::StatusOr<Client> Client::connect(const std::string& address, const ConnectOptions& options) {
  std::string token = options.token;
  std::string file = options.token_file;
  if (token.empty() && file.empty()) file = env_or("TESSERA_TOKEN_FILE", "");
  // A cluster embedded in this process (Client::local): its own client token and CA.
  const Credentials embedded = internal::LocalCluster::credentials_of(address);
  if (token.empty() && file.empty()) token = embedded.client;
  if (token.empty() && !file.empty()) {
    absl::StatusOr<std::string> read = read_token_file(file);
    if (!read.ok()) return absl::Status(read.status().code(), absl::StrCat("connect: ", read.status().message()));
    token = *std::move(read);
  }
  std::string ca = options.ca_file.empty() ? env_or("TESSERA_CA_FILE", "") : options.ca_file;
  if (!ca.empty()) {
    absl::StatusOr<std::string> read = read_file(ca);
    if (!read.ok()) return absl::Status(read.status().code(), absl::StrCat("connect: ", read.status().message()));
    ca = *std::move(read);
  } else {
    ca = embedded.ca_pem;
  }
  auto impl = std::make_shared<internal::ClientImpl>(address, internal::LocalCluster::find(address), std::move(token),
                                                     std::move(ca));
  TESSERA_RETURN_IF_ERROR(impl->init(options));
  return Client(std::move(impl));
}

absl::StatusOr<Client> Client::local(int num_devices, const LocalOptions& options) {
  Credentials credentials;
  if (options.check_credentials) {
    absl::StatusOr<Credentials> c =
        options.credentials_dir.empty() ? generate_credentials() : load_credentials(options.credentials_dir);
    if (!c.ok()) return absl::Status(c.status().code(), absl::StrCat("Client::local: ", c.status().message()));
    credentials = *std::move(c);
  }
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<internal::LocalCluster> cluster,
                           internal::LocalCluster::start(num_devices, options, credentials));
  const std::string address = cluster->coordinator_address();
  auto impl =
      std::make_shared<internal::ClientImpl>(address, std::move(cluster), credentials.client, credentials.ca_pem);
  ConnectOptions connect_options;
  connect_options.min_devices = num_devices;
  connect_options.shared_memory = options.shared_memory;
  TESSERA_RETURN_IF_ERROR(impl->init(connect_options));
  return Client(std::move(impl));
}

std::string Client::coordinator_address() const { return impl_->coordinator_address(); }

absl::StatusOr<std::vector<Device>> Client::devices() const {
  TESSERA_ASSIGN_OR_RETURN(pb::Topology topology, impl_->topology());
  std::vector<Device> out;
  for (const pb::DeviceInfo& d : topology.devices()) {
    out.push_back({d.id(), d.address(), d.state() == pb::ALIVE, d.draining()});
  }
  std::sort(out.begin(), out.end(), [](const Device& a, const Device& b) { return a.id < b.id; });
  return out;
}

absl::StatusOr<Mesh> Client::make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names) const {
  return make_mesh(std::move(shape), std::move(axis_names), std::initializer_list<AxisType>{});
}

absl::StatusOr<Mesh> Client::make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                       std::initializer_list<AxisType> axis_types) const {
  TESSERA_ASSIGN_OR_RETURN(std::vector<Device> all, devices());
  // The devices that take work: alive and not draining (a draining one refuses every new
  // program and array, so a mesh with it would fail until its worker is back).
  std::vector<int> ids;
  std::vector<int> draining;
  for (const Device& d : all) {
    if (d.alive && !d.draining) ids.push_back(d.id);
    if (d.alive && d.draining) draining.push_back(d.id);
  }
  int64_t wanted = 1;
  for (int64_t s : shape) wanted = s > 0 && wanted <= (int64_t{1} << 24) ? wanted * s : 0;
  // As jax.make_mesh: the first prod(shape) devices; more than there are is an error.
  if (wanted > static_cast<int64_t>(ids.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("make_mesh: the mesh shape (", absl::StrJoin(shape, ", "), ") needs ", wanted,
                     " devices but the cluster has ", ids.size(), " alive and not draining",
                     draining.empty() ? "" : absl::StrCat(" (draining: ", absl::StrJoin(draining, ", "), ")")));
  }
  if (wanted > 0) ids.resize(static_cast<size_t>(wanted));
  return tessera::make_mesh(std::move(shape), std::move(axis_names), std::move(ids), axis_types);
}

absl::StatusOr<Mesh> Client::make_mesh(std::vector<int64_t> shape, std::vector<std::string> axis_names,
                                       std::vector<int> device_ids, std::vector<AxisType> axis_types) const {
  return tessera::make_mesh(std::move(shape), std::move(axis_names), std::move(device_ids), std::move(axis_types));
}

namespace {

// How each of `shards` travels (see internal::PutRoute): a replicated block goes from here
// once. In this process (every replica's worker embedded) it is copied once into a buffer all
// its devices share (its token appended to `handoffs`); to workers of other processes, when
// it is large enough and the coordinator vouched for every replica's address, it goes to one
// replica, which broadcasts it to the others (a fan-out, appended to `fan_outs`). Successive
// blocks' uploads go to different positions of their replica sets, spreading them over the
// workers. The first of a fan-out's calls to fail cancels the others (`calls`).
std::vector<internal::PutRoute> put_routes(const HostView& host, const std::vector<DeviceShard>& shards,
                                           const std::map<int, std::string>& addresses,
                                           const pb::CreateArrayReply& reply, std::vector<pb::ShardFanOut>* fan_outs,
                                           std::vector<uint64_t>* handoffs, internal::PutCalls* calls,
                                           const std::function<bool(const std::string&)>& shared_memory,
                                           std::vector<std::unique_ptr<internal::SharedSegment>>* segments) {
  std::vector<internal::PutRoute> routes(shards.size());
  std::map<int, const pb::PeerAddress*> vouched;
  for (const pb::PeerAddress& peer : reply.peers()) vouched[peer.device_id()] = &peer;
  const std::vector<std::vector<size_t>> blocks = internal::replicas_by_block(shards);
  fan_outs->reserve(blocks.size());  // routes point into it
  const int64_t elem = dtype_size(host.dtype);
  for (size_t b = 0; b < blocks.size(); ++b) {
    const std::vector<size_t>& replicas = blocks[b];
    if (replicas.size() < 2) continue;
    const Index& index = shards[replicas[0]].index;
    const int64_t bytes = num_elements(block_shape(index)) * elem;
    auto address = [&](size_t i) {
      auto it = addresses.find(shards[i].device_id);
      return it == addresses.end() ? std::string() : it->second;
    };
    if (std::all_of(replicas.begin(), replicas.end(), [&](size_t i) { return is_in_process_address(address(i)); })) {
      auto block = std::make_shared<HostArray>(host.dtype, block_shape(index));
      copy_block_out(static_cast<const std::byte*>(host.data), host.shape, elem, index, block->data());
      absl::StatusOr<uint64_t> token = Handoff::deposit(std::move(block), static_cast<int>(replicas.size()));
      if (!token.ok()) continue;  // a full table: each replica its own copy
      handoffs->push_back(*token);
      for (size_t i : replicas) routes[i].handoff = *token;
      continue;
    }
    if (std::all_of(replicas.begin(), replicas.end(), [&](size_t i) { return shared_memory(address(i)); })) {
      // Every replica on this host: one memfd that each worker reads, cheaper than a broadcast
      // (which copies every byte into and out of each hop's ring).
      internal::SharedSegment* segment = segments->emplace_back(std::make_unique<internal::SharedSegment>()).get();
      for (size_t i : replicas) routes[i].segment = segment;
      continue;
    }
    if (bytes < internal::kFanOutMinBytes || std::any_of(replicas.begin(), replicas.end(), [&](size_t i) {
          auto it = vouched.find(shards[i].device_id);
          return it == vouched.end() || it->second->address() != address(i);
        })) {
      continue;
    }
    pb::ShardFanOut& fan_out = fan_outs->emplace_back();
    fan_out.set_timeout_ms(absl::ToInt64Milliseconds(transfer_deadline(bytes)));
    // Op ids (the array's id, with bit 63) are predictable: the members take the broadcast's
    // messages only with this tag, which goes to them alone, in their headers.
    fan_out.set_run_tag(random_run_tag());
    const size_t first = b % replicas.size();
    for (size_t k = 0; k < replicas.size(); ++k) {
      const size_t i = replicas[(first + k) % replicas.size()];
      *fan_out.add_members() = *vouched[shards[i].device_id];
      routes[i].fan_out = &fan_out;
      routes[i].calls = calls;
    }
    routes[replicas[first]].uploader = true;
  }
  return routes;
}

}  // namespace

absl::StatusOr<Array> Client::device_put(const HostArray& host, const NamedSharding& sharding) const {
  return device_put(host.view(), sharding);
}

absl::StatusOr<Array> Client::device_put(const HostArray& host, const PartitionSpec& spec) const {
  return device_put(host.view(), spec);
}

absl::StatusOr<Array> Client::device_put(const HostView& host, const PartitionSpec& spec) const {
  TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, ambient_sharding(spec, "device_put"));
  return device_put(host, sharding);
}

absl::StatusOr<Array> Client::array(const HostArray& host) const { return array(host.view()); }

absl::StatusOr<Array> Client::array(const HostView& host) const {
  TESSERA_ASSIGN_OR_RETURN(std::vector<Device> all, devices());
  if (all.empty()) return absl::FailedPreconditionError("array: the cluster has no device");
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, tessera::make_mesh({1}, {"_default"}, {all[0].id}, {AxisType::kAuto}));
  TESSERA_ASSIGN_OR_RETURN(Array placed, device_put(host, NamedSharding(mesh, PartitionSpec())));
  const internal::ArrayState& s = internal::array_state(placed);
  return internal::make_array(
      std::make_shared<internal::ArrayState>(s.client, s.buffers, s.dtype, s.shape, s.sharding, /*committed=*/false));
}

absl::StatusOr<Array> Client::device_put(const Array& x, const PartitionSpec& spec) const {
  TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, ambient_sharding(spec, "device_put"));
  return device_put(x, sharding);
}

absl::StatusOr<Array> Client::device_put(const Array& x, const NamedSharding& sharding) const {
  const internal::ArrayState& state = internal::array_state(x);
  if (state.client != impl_) {
    return absl::InvalidArgumentError("device_put: the array is on another client's cluster");
  }
  absl::Status valid = sharding.validate(x.shape());
  if (!valid.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("device_put: ", type_to_string(x.dtype(), x.shape()), ": ", valid.message()));
  }
  if (sharding == x.sharding()) {
    // A sharding asked for commits the array (JAX's device_put).
    return state.committed ? x
                           : internal::make_array(std::make_shared<internal::ArrayState>(
                                 state.client, state.buffers, state.dtype, state.shape, state.sharding));
  }
  if (sharding.mesh() == x.sharding().mesh()) return internal::relayout_on_mesh(x, sharding);
  const PartitionSpec& from = x.sharding().spec();
  if (!from.unreduced().empty() && !check_unreduced_move(x.sharding(), sharding).ok()) {
    // Unreduced onto another mesh but not onto the same unreduced axes: the sum first, on x's
    // mesh (its partitions kept), then the move. JAX has no such move across devices (its
    // device_put jits a reshard, dispatch.py _device_put_sharding_impl); the value is kept.
    TESSERA_ASSIGN_OR_RETURN(
        Array summed, internal::relayout_on_mesh(x, NamedSharding(x.sharding().mesh(), from.with_unreduced({}))));
    return device_put(summed, sharding);
  }
  if (from.unreduced().empty() && !sharding.spec().unreduced().empty()) {
    // Onto an unreduced spec of another mesh (JAX: jnp.arange(4) then device_put(.,
    // P(unreduced={'x'})), pjit_test.py test_device_put_unreduced_via_jit): the blocks move as
    // the spec's partitions say, then the cast runs on that mesh (the compiler's kUnreduce).
    TESSERA_ASSIGN_OR_RETURN(Array moved,
                             device_put(x, NamedSharding(sharding.mesh(), sharding.spec().with_unreduced({}))));
    return internal::relayout_on_mesh(moved, sharding);
  }
  // Else the coordinator moves the blocks: a reduced axis lays its array out as a replicated
  // one, and an unreduced array onto the same unreduced axes moves term by term, each device
  // getting the term of the device at its coordinates along them (coordinator/block_moves.h;
  // JAX moves each shard to its counterpart, pjit_test.py
  // test_device_put_unreduced_via_runtime_transfer).
  impl_->flush_deletes().IgnoreError();
  ProfileSpan span(&impl_->profile(), "client", [] { return std::string("device_put (reshard)"); });
  TESSERA_ASSIGN_OR_RETURN(uint64_t input_id, state.ready_id());
  pb::ReshardArrayRequest req;
  req.set_array_id(input_id);
  to_proto(sharding, req.mutable_sharding());
  req.set_session_id(impl_->session());
  constexpr absl::Duration kTimeout = absl::Seconds(60);
  req.set_timeout_ms(absl::ToInt64Milliseconds(kTimeout));
  pb::ReshardArrayReply reply;
  TESSERA_RETURN_IF_ERROR(internal::with_adoption(state, input_id, [&] {
    grpc::ClientContext ctx;
    set_deadline(&ctx, kTimeout + absl::Seconds(10));
    return from_grpc(impl_->coordinator()->ReshardArray(&ctx, req, &reply),
                     absl::StrCat("device_put: coordinator ", impl_->coordinator_address()));
  }));
  const pb::ArrayInfo& info = reply.result();
  impl_->track(info.array_id(), info);
  impl_->remember_grant(info.array_id(), info.grant());
  return internal::make_array(internal::ArrayState::placed(impl_, info.array_id(), x.dtype(), x.shape(), sharding));
}

absl::StatusOr<Array> Client::device_put(const HostView& host, const NamedSharding& sharding) const {
  TESSERA_RETURN_IF_ERROR(validate_view(host.dtype, host.shape, host.data, "device_put"));
  // A reduced spec is laid out as its partitions say (replicated over the reduced axes). An
  // unreduced one as JAX's device_put (dispatch.py: a jit resharding onto it; pjit_test.py
  // test_device_put_unreduced_via_jit): the value on the first device along the unreduced axes
  // and zeros on the others, so the terms sum to it: placed as the partitions say, then the
  // cast on the mesh (the compiler's kUnreduce).
  if (!sharding.spec().unreduced().empty()) {
    TESSERA_ASSIGN_OR_RETURN(Array whole,
                             device_put(host, NamedSharding(sharding.mesh(), sharding.spec().with_unreduced({}))));
    return internal::relayout_on_mesh(whole, sharding);
  }
  // The memory of arrays dropped before is free first (a failure was logged and counted).
  impl_->flush_deletes().IgnoreError();
  // Bool elements travel as bytes 0 and 1: another byte (from a view of foreign memory) would
  // later be read back as an invalid bool.
  if (host.dtype == DType::kBool) {
    const auto* bytes = static_cast<const uint8_t*>(host.data);
    const int64_t n = num_elements(host.shape);
    if (std::any_of(bytes, bytes + n, [](uint8_t b) { return b > 1; })) {
      HostArray normalized(DType::kBool, host.shape);
      auto* out = reinterpret_cast<uint8_t*>(normalized.data());
      for (int64_t i = 0; i < n; ++i) out[i] = bytes[i] != 0 ? 1 : 0;
      return device_put(normalized.view(), sharding);
    }
  }
  absl::Status valid = sharding.validate(host.shape);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("device_put: ", valid.message()));
  ProfileSpan span(&impl_->profile(), "client", [] { return std::string("device_put"); });
  span.arg("bytes", absl::StrCat(num_elements(host.shape) * dtype_size(host.dtype)));

  pb::CreateArrayRequest req;
  req.set_dtype(to_proto(host.dtype));
  to_proto(host.shape, req.mutable_shape());
  to_proto(sharding, req.mutable_sharding());
  req.set_session_id(impl_->session());
  pb::CreateArrayReply reply;
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    TESSERA_RETURN_IF_ERROR(from_grpc(impl_->coordinator()->CreateArray(&ctx, req, &reply),
                                      absl::StrCat("device_put: coordinator ", impl_->coordinator_address())));
  }
  pb::ArrayInfo info;
  info.set_dtype(req.dtype());
  *info.mutable_shape() = req.shape();
  *info.mutable_sharding() = req.sharding();
  impl_->track(reply.array_id(), std::move(info));
  impl_->remember_grant(reply.array_id(), reply.grant());
  // From here on the handle owns the array: if an upload fails, dropping it frees the rest.
  Array array(internal::ArrayState::placed(impl_, reply.array_id(), host.dtype, host.shape, sharding));
  TESSERA_ASSIGN_OR_RETURN(pb::Topology topology, impl_->topology());
  std::map<int, std::string> addresses;
  for (const pb::DeviceInfo& d : topology.devices()) addresses[d.id()] = d.address();

  const std::vector<DeviceShard> shards = sharding.device_shards(host.shape);
  std::vector<pb::ShardFanOut> fan_outs;
  std::vector<uint64_t> handoffs;
  internal::PutCalls calls;
  std::vector<std::unique_ptr<internal::SharedSegment>> segments;
  // Known once this client has reached the worker: before, its replicas each get their own
  // memfd (or a fan-out).
  auto shared_memory = [&](const std::string& address) {
    return impl_->transfer_path(address) == internal::TransferPath::kSharedMemory;
  };
  std::vector<internal::PutRoute> routes =
      put_routes(host, shards, addresses, reply, &fan_outs, &handoffs, &calls, shared_memory, &segments);
  for (internal::PutRoute& route : routes) route.adopt = impl_->adopt_puts();
  const absl::Status uploaded = internal::run_parallel(static_cast<int>(shards.size()), [&](int i) -> absl::Status {
    const DeviceShard& shard = shards[i];
    const std::string& address = addresses[shard.device_id];
    const std::string who = absl::StrCat("device_put: device ", shard.device_id, " (", address, ")");
    TESSERA_ASSIGN_OR_RETURN(pb::Worker::Stub * stub, impl_->worker(address, who));
    return internal::put_shard(stub, reply.array_id(), reply.grant(), host, shard.index, who,
                               impl_->transfer_path(address), routes[i]);
  });
  for (uint64_t token : handoffs) Handoff::withdraw(token);  // what a failed put left
  if (uploaded.ok()) {
    for (const auto& segment : segments) segment->release();
  }
  if (!uploaded.ok() && !calls.first_error().ok()) return calls.first_error();  // the cause, not a cancellation
  TESSERA_RETURN_IF_ERROR(uploaded);
  return array;
}

absl::Status Client::flush_deletes() const {
  TESSERA_RETURN_IF_ERROR(impl_->flush_deletes());
  return impl_->in_flight()->take_delete_error();
}

int64_t Client::failed_deletes() const { return impl_->in_flight()->deletes_failed(); }

int64_t Client::retried_deletes() const { return impl_->in_flight()->deletes_retried(); }

absl::StatusOr<DeviceStats> Client::device_stats(int device_id) const {
  // What it reports counts the arrays dropped before as freed (a failure was logged and counted).
  impl_->flush_deletes().IgnoreError();
  TESSERA_ASSIGN_OR_RETURN(std::vector<Device> all, devices());
  for (const Device& d : all) {
    if (d.id != device_id) continue;
    const std::string who = absl::StrCat("device ", d.id, " (", d.address, ")");
    TESSERA_ASSIGN_OR_RETURN(pb::Worker::Stub * stub, impl_->worker(d.address, who));
    pb::GetStatsRequest req;
    pb::WorkerStats stats;
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    TESSERA_RETURN_IF_ERROR(from_grpc(stub->GetStats(&ctx, req, &stats), who));
    return DeviceStats{stats.device_id(),
                       stats.buffer_count(),
                       stats.bytes_used(),
                       stats.memory_limit_bytes(),
                       stats.collective_messages_pending(),
                       stats.blas_kernel(),
                       stats.plans_loaded(),
                       stats.shm_messages_received(),
                       stats.plan_runs_in_flight(),
                       stats.bytes_put(),
                       stats.bytes_fetched(),
                       stats.bytes_fanned_out(),
                       stats.shm_bytes_put(),
                       stats.shm_bytes_fetched(),
                       stats.in_process_messages_received(),
                       stats.plan_runs_stepped(),
                       stats.client_memory_bytes_read(),
                       stats.client_memory_bytes_written()};
  }
  return absl::NotFoundError(absl::StrCat("device ", device_id, " is not in the cluster"));
}

}  // namespace tessera

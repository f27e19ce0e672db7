#include "coordinator/coordinator_server.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <thread>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/access.h"
#include "coordinator/block_moves.h"
#include "coordinator/execution_driver.h"
#include "coordinator/fan_out.h"
#include "coordinator/ids.h"
#include "coordinator/plan_stream.h"
#include "coordinator/program_cache.h"
#include "coordinator/registry.h"
#include "coordinator/registry_wire.h"
#include "coordinator/request_limits.h"
#include "coordinator/worker_channels.h"
#include "core/bounded_join.h"
#include "core/collective.h"
#include "core/profile_wire.h"
#include "core/run_tag.h"
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

namespace tessera {
namespace {

void to_proto(const DeviceRecord& d, pb::DeviceInfo* out) {
  out->set_id(d.id);
  out->set_address(d.address);
  out->set_name(d.name);
  out->set_state(d.alive ? pb::ALIVE : d.left ? pb::LEFT : pb::LOST);
  out->set_memory_bytes(d.memory_bytes);
  out->set_incarnation(d.incarnation);
  out->set_draining(d.draining);
}

void to_proto(const ArrayRecord& a, pb::ArrayInfo* out) {
  out->set_array_id(a.id);
  out->set_dtype(tessera::to_proto(a.dtype));
  tessera::to_proto(a.shape, out->mutable_shape());
  tessera::to_proto(a.sharding, out->mutable_sharding());
  for (int d : a.lost_devices) out->add_lost_devices(d);
}
// Right after it starts, the coordinator waits this long (at least) for the devices a request
// names to register: after a restart the workers come back within a heartbeat or two, and a
// client's first call should not fail for being early.
constexpr absl::Duration kRegistrationGrace = absl::Seconds(5);

// The most a GetClusterStatus reply lists (kMaxMessageBytes is the limit).
constexpr size_t kMaxStatusBytes = 3 << 20;

// How often a long wait in a handler checks whether its caller cancelled.
constexpr absl::Duration kCancelCheck = absl::Milliseconds(100);
// How long GetTopology's wait gives the counted workers to confirm their registration.
constexpr absl::Duration kConfirmTimeout = absl::Seconds(1);

// The time left before the caller's deadline (about 290 years without one): what a handler
// that waits may wait at most, so that a caller gone by its deadline holds no thread.
absl::Duration time_left(const grpc::ServerContextBase& ctx) {
  return std::max(absl::ZeroDuration(), absl::FromChrono(ctx.deadline() - std::chrono::system_clock::now()));
}

// The Coordinator service's edge: each handler checks its caller and the request, and hands
// the work to the part of the coordinator it belongs to (Registry, ProgramCache,
// ExecutionDriver, FanOut, WorkerChannels; docs/design.md, "The daemons by concept"). Holds
// no lock of its own.
// Execute, and the workers' Heartbeat and RegisterWorker, are callback methods: they never
// block, and they must not wait for one of the synchronous threads (max_sync_threads), which
// long waits (GetTopology, GetClusterStatus, RunCollective) can all hold: a worker whose
// heartbeats were refused for that would be marked lost.
using CoordinatorServiceBase =
    pb::Coordinator::WithCallbackMethod_Execute<pb::Coordinator::WithCallbackMethod_Heartbeat<
        pb::Coordinator::WithCallbackMethod_RegisterWorker<pb::Coordinator::Service>>>;

class CoordinatorService final : public CoordinatorServiceBase {
 public:
  explicit CoordinatorService(const CoordinatorOptions& options)
      : options_(options),
        started_(absl::Now()),
        registry_(options.heartbeat_timeout, started_, options.lease_timeout),
        registration_grace_(std::max(kRegistrationGrace, 2 * options.heartbeat_timeout)),
        auth_(options.credentials),
        channels_(daemon_identity(options.credentials)),
        fan_out_(&registry_, &channels_, options.heartbeat_interval, options.heartbeat_timeout),
        programs_(options.max_programs, &registry_, &channels_, &fan_out_),
        driver_(&registry_, &programs_, &fan_out_, &channels_, &auth_, options.max_plan_loads) {}

  void set_address(const std::string& address) { address_ = address; }

  Registry& registry() { return registry_; }
  ExecutionDriver& driver() { return driver_; }
  WorkerChannels& channels() { return channels_; }
  const WorkerChannels& channels() const { return channels_; }
  ProgramCache& programs() { return programs_; }

  grpc::Status Handshake(grpc::ServerContext* ctx, const pb::HandshakeRequest* req,
                         pb::HandshakeReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_protocol_version(kProtocolVersion);
    reply->set_server("tessera-coordinator");
    reply->set_epoch(registry_.epoch());
    return to_grpc(check_protocol_version(req->protocol_version(), absl::StrCat("client '", req->peer(), "'")));
  }

  grpc::ServerUnaryReactor* RegisterWorker(grpc::CallbackServerContext* ctx, const pb::RegisterWorkerRequest* req,
                                           pb::RegisterWorkerReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    const grpc::Status status = register_worker(*ctx, req, reply);
    if (status.ok()) add_peers(0, reply);
    reactor->Finish(status);
    return reactor;
  }

  // RegisterWorker's work (on its callback thread: it never blocks).
  grpc::Status register_worker(const grpc::ServerContextBase& ctx, const pb::RegisterWorkerRequest* req,
                               pb::RegisterWorkerReply* reply) {
    absl::StatusOr<Caller> caller = auth_.require(ctx, Role::kDaemon, "RegisterWorker");
    if (!caller.ok()) return to_grpc(caller.status());
    absl::Status certified = auth_.check_device(*caller, req->requested_device_id(), "RegisterWorker");
    if (!certified.ok()) return to_grpc(certified);
    absl::Status version = check_protocol_version(req->protocol_version(), absl::StrCat("worker at ", req->address()));
    if (!version.ok()) return to_grpc(version);
    absl::StatusOr<WorkerRegistration> registration = registration_from_proto(*req);
    if (!registration.ok()) return to_grpc(registration.status());
    absl::StatusOr<DeviceRecord> d = registry_.register_worker(*registration, absl::Now());
    if (!d.ok()) return to_grpc(d.status());
    if (options_.log_registrations) {
      std::string how;
      if (req->previous_epoch() != 0 && req->previous_epoch() != registry_.epoch()) {
        how = absl::StrCat(" (registered with an earlier coordinator before; holds ", req->held_buffers_size(),
                           " buffers)");
      } else if (d->incarnation > 1) {
        how = req->previous_incarnation() + 1 == d->incarnation ? " (the same process, back)"
                                                                : " (a new process: its shards are lost)";
      }
      std::fprintf(stderr, "tessera-coordinator: %s registered as '%s', incarnation %lu%s\n",
                   describe_device(d->id, d->address).c_str(), d->name.c_str(),
                   static_cast<unsigned long>(d->incarnation), how.c_str());
    }
    // A worker back at another address leaves no channel to its old one.
    evict_worker_channels();
    // The next call to this worker waits for the connection: the coordinator's channel may
    // still be backing off from the time the worker was unreachable (or gone).
    channels_.get(d->address)->reached = false;
    reply->set_device_id(d->id);
    reply->set_incarnation(d->incarnation);
    reply->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
    reply->set_epoch(registry_.epoch());
    return grpc::Status::OK;
  }

  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const pb::HeartbeatRequest* req,
                                      pb::HeartbeatReply* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "Heartbeat");
    if (caller.ok()) {
      if (absl::Status certified = auth_.check_device(*caller, req->device_id(), "Heartbeat"); !certified.ok()) {
        caller = certified;
      }
    }
    bool newly_draining = false;
    absl::Status beat = caller.status();
    if (caller.ok() && req->leaving()) {
      beat = registry_.deregister(req->device_id(), req->epoch(), req->incarnation());
      if (beat.ok() && options_.log_registrations) {
        std::fprintf(stderr, "tessera-coordinator: device %d left (its worker drained and deregistered)\n",
                     req->device_id());
      }
    } else if (caller.ok()) {
      beat = registry_.heartbeat(req->device_id(), req->epoch(), req->incarnation(), absl::Now(), req->draining(),
                                 &newly_draining);
    }
    if (newly_draining && options_.log_registrations) {
      std::fprintf(stderr, "tessera-coordinator: device %d is draining; no new work goes to it\n", req->device_id());
    }
    if (beat.ok() && !req->leaving()) {
      add_peers(req->view_version(), reply);
      heartbeats_.fetch_add(1, std::memory_order_relaxed);
      if (reply->has_peers()) heartbeat_views_.fetch_add(1, std::memory_order_relaxed);
    }
    reactor->Finish(to_grpc(beat));
    return reactor;
  }

  // The alive devices and their incarnations (the registrations a worker takes Exchange streams
  // from, worker/collectives/peer_view.h) with the view's version, on a registration's reply
  // (`held` 0), or on a heartbeat's when the worker's view (version `held`) is not the current
  // one. A worker up to date gets no peers: a reply of a few bytes, not one naming every device.
  template <typename Reply>
  void add_peers(uint64_t held, Reply* reply) {
    ClusterView view;
    if (!registry_.cluster_view(held, &view)) return;
    pb::ClusterPeers* peers = reply->mutable_peers();
    peers->set_version(view.version);
    peers->mutable_devices()->Reserve(static_cast<int>(view.alive.size()));
    for (const auto& [id, incarnation] : view.alive) {
      pb::PeerRegistration* p = peers->add_devices();
      p->set_device_id(id);
      p->set_incarnation(incarnation);
    }
  }

  grpc::Status GetTopology(grpc::ServerContext* ctx, const pb::GetTopologyRequest* req, pb::Topology* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    if (req->min_alive_devices() > 0) {
      // Bounded by the caller's deadline too, and given up when the caller goes: an abandoned
      // wait must not hold a server thread.
      absl::Duration wait = absl::Milliseconds(std::clamp<int64_t>(req->wait_ms(), 0, 600'000));
      wait = std::min(wait, time_left(*ctx));
      std::map<int, std::string> unconfirmed;
      if (!wait_for_alive(*ctx, req->min_alive_devices(), wait, &unconfirmed)) {
        // Each list names its first devices and counts the rest, so that the error stays
        // readable at thousands of devices (an unconfirmed device carries its worker's error, so
        // fewer of those); to_grpc cuts what long addresses still make too long for gRPC.
        constexpr size_t kNamed = 32, kNamedUnconfirmed = 8;
        // Draining devices are alive but take no new work: they do not count.
        int alive = 0;
        std::vector<std::string> lost, draining, left, unconfirmed_ones;
        for (const DeviceRecord& d : registry_.devices()) {
          if (d.alive && !d.draining && unconfirmed.count(d.id) > 0) {
            unconfirmed_ones.push_back(absl::StrCat(describe_device(d.id, d.address), ": ", unconfirmed.at(d.id)));
          } else if (d.alive && !d.draining) {
            ++alive;
          } else {
            (d.alive ? draining : d.left ? left : lost).push_back(describe_device(d.id, d.address));
          }
        }
        return to_grpc(absl::DeadlineExceededError(absl::StrCat(
            "waited ", absl::FormatDuration(wait), " for ", req->min_alive_devices(),
            " alive devices (not draining) but ", alive, " are",
            lost.empty() && draining.empty() && left.empty() && unconfirmed_ones.empty()
                ? std::string(" (no other device has registered)")
                : "",
            lost.empty() ? "" : absl::StrCat("; lost: ", join_at_most(lost, kNamed)),
            left.empty() ? "" : absl::StrCat("; left (drained): ", join_at_most(left, kNamed)),
            unconfirmed_ones.empty() ? ""
                                     : absl::StrCat("; registered but not confirmed by their workers: ",
                                                    join_at_most(unconfirmed_ones, kNamedUnconfirmed, "; ")),
            draining.empty() ? "" : absl::StrCat("; draining: ", join_at_most(draining, kNamed)))));
      }
    }
    for (const DeviceRecord& d : registry_.devices()) to_proto(d, reply->add_devices());
    return grpc::Status::OK;
  }

  grpc::Status CreateArray(grpc::ServerContext* ctx, const pb::CreateArrayRequest* req,
                           pb::CreateArrayReply* reply) override {
    absl::StatusOr<uint64_t> session = acting_session(*ctx, req->session_id(), "CreateArray");
    if (!session.ok()) return to_grpc(session.status());
    absl::StatusOr<uint64_t> id = create_array(*req, *session);
    if (!id.ok()) return to_grpc(id.status());
    reply->set_array_id(*id);
    reply->set_grant(auth_.grant(*id));
    // The addresses a replicated put's fan-out may send to (ShardHeader.fan_out), vouched for.
    absl::StatusOr<ArrayRecord> a = registry_.get_array(*id);
    if (!a.ok()) return to_grpc(a.status());
    for (int device : a->sharding.mesh().device_ids()) {
      std::optional<DeviceRecord> d = registry_.device(device);
      if (!d.has_value()) continue;
      pb::PeerAddress* peer = reply->add_peers();
      peer->set_device_id(device);
      peer->set_address(d->address);
      peer->set_grant(auth_.address_grant(*id, device, d->address));
    }
    return grpc::Status::OK;
  }

  grpc::Status GetArray(grpc::ServerContext* ctx, const pb::GetArrayRequest* req, pb::GetArrayReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    absl::StatusOr<ArrayRecord> a = registry_.get_array(req->array_id());
    if (!a.ok()) return to_grpc(a.status());
    absl::Status owner = check_owner(*caller, *a, "GetArray", "read");
    if (!owner.ok()) return to_grpc(owner);
    to_proto(*a, reply->mutable_info());
    reply->mutable_info()->set_grant(auth_.grant(a->id));
    for (int id : a->sharding.mesh().device_ids()) {
      std::optional<DeviceRecord> d = registry_.device(id);
      if (d.has_value()) to_proto(*d, reply->add_devices());
    }
    return grpc::Status::OK;
  }

  grpc::Status DeleteArray(grpc::ServerContext* ctx, const pb::DeleteArrayRequest* req,
                           pb::DeleteArrayReply*) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    Taken taken = take_arrays(*caller, req->array_ids(), req->grants(), "DeleteArray");
    // The caller's arrays go even when others of the batch were refused.
    fan_out_.delete_buffers(taken.buffers);
    // gRPC sends no reply with an error: the refused ids go in a trailer, so that the client
    // counts only those as failed, not the whole batch.
    if (!taken.refused.empty()) ctx->AddTrailingMetadata(kRefusedDeletesTrailer, absl::StrJoin(taken.refused, ","));
    return to_grpc(taken.refusal);
  }

  // What take_arrays took for deletion, and what it refused.
  struct Taken {
    std::map<int, std::vector<uint64_t>> buffers;  // of the arrays forgotten, by device
    std::vector<uint64_t> refused;                 // another session's arrays, left untouched
    absl::Status refusal;                          // refused_deletions: OK when none was refused
  };

  // Forgets the arrays `ids` (with their `grants`, in order; may be shorter) that `caller` may
  // delete, deciding each id on its own, and returns their buffers by device, to be deleted
  // there. Another session's array is refused and left untouched (Taken::refused, refusal),
  // whatever else the batch holds: one foreign id must not keep the caller's own deletions
  // from happening, nor fail the Execute they ride on. Unknown ids are skipped silently: a
  // failed Execute's deletions are sent again by the client (InFlight::requeue) whether or
  // not this coordinator took them the first time, so an id deleted already must be no error.
  Taken take_arrays(const Caller& caller, const google::protobuf::RepeatedField<uint64_t>& ids,
                    const google::protobuf::RepeatedPtrField<std::string>& grants, absl::string_view method) {
    Taken taken;
    std::vector<ArrayRecord> arrays = registry_.remove_arrays_if(
        std::vector<uint64_t>(ids.begin(), ids.end()), [&caller](const ArrayRecord& a) { return is_owner(caller, a); },
        &taken.refused);
    int64_t deleted = static_cast<int64_t>(arrays.size());
    taken.buffers = FanOut::buffers_of(arrays);
    // Arrays of an earlier incarnation that nobody adopted: their buffers go too. Their owner
    // is unknown here, so they go with their grant (or for an admin); else the lease reaps them.
    // With no orphans (a coordinator that has not restarted, or once they are adopted or
    // reaped) there is nothing to take: no grant is checked (a MAC per id).
    if (registry_.orphan_count() > 0) {
      const absl::flat_hash_set<uint64_t> refused(taken.refused.begin(), taken.refused.end());
      std::vector<uint64_t> orphan_ids;
      for (int i = 0; i < ids.size(); ++i) {
        if (refused.contains(ids[i])) continue;
        const std::string grant = i < grants.size() ? grants[i] : "";
        if (caller.at_least(Role::kAdmin) || auth_.check_grant(ids[i], grant, method).ok()) {
          orphan_ids.push_back(ids[i]);
        }
      }
      absl::flat_hash_set<uint64_t> orphans_taken;
      for (auto& [device, orphans] : registry_.remove_orphans(orphan_ids)) {
        orphans_taken.insert(orphans.begin(), orphans.end());
        taken.buffers[device].insert(taken.buffers[device].end(), orphans.begin(), orphans.end());
      }
      deleted += static_cast<int64_t>(orphans_taken.size());
    }
    taken.refusal = refused_deletions(method, taken.refused, deleted, ids.size());
    return taken;
  }

  grpc::Status AdoptArrays(grpc::ServerContext* ctx, const pb::AdoptArraysRequest* req,
                           pb::AdoptArraysReply* reply) override {
    absl::StatusOr<uint64_t> session = acting_session(*ctx, req->session_id(), "AdoptArrays");
    if (!session.ok()) return to_grpc(session.status());
    return to_grpc(adopt_arrays(*req, *session, reply));
  }

  grpc::Status OpenSession(grpc::ServerContext* ctx, const pb::OpenSessionRequest*,
                           pb::OpenSessionReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_session_id(registry_.open_session(absl::Now()));
    if (auth_.enabled()) reply->set_credential(auth_.session_credential(reply->session_id()));
    reply->set_lease_ms(absl::ToInt64Milliseconds(registry_.lease()));
    reply->set_epoch(registry_.epoch());
    return grpc::Status::OK;
  }

  grpc::Status RenewLease(grpc::ServerContext* ctx, const pb::RenewLeaseRequest* req,
                          pb::RenewLeaseReply* reply) override {
    absl::StatusOr<uint64_t> session = acting_session(*ctx, req->session_id(), "RenewLease");
    if (!session.ok()) return to_grpc(session.status());
    reply->set_epoch(registry_.epoch());
    return to_grpc(registry_.renew_session(*session, absl::Now()));
  }

  // Frees what lapsed (see Registry::take_lapsed) on the workers: the arrays of sessions not
  // renewed for a lease and orphans nobody adopted, and the programs no open session holds.
  // Blocks for the deletions (bounded): the reaper thread's.
  void reap_lapsed() {
    Registry::Lapsed lapsed = registry_.take_lapsed(absl::Now());
    if (lapsed.sessions.empty() && lapsed.buffers.empty()) return;
    std::vector<std::shared_ptr<Program>> unused = programs_.release(lapsed.sessions);
    if (options_.log_registrations) {
      std::fprintf(stderr,
                   "tessera-coordinator: %zu sessions lapsed after %s without renewal; freeing %ld arrays, %zu "
                   "programs and %ld buffers of earlier incarnations nobody adopted\n",
                   lapsed.sessions.size(), absl::FormatDuration(registry_.lease()).c_str(),
                   static_cast<long>(lapsed.arrays), unused.size(), static_cast<long>(lapsed.orphans));
    }
    fan_out_.delete_buffers(lapsed.buffers);
    programs_.unload_plans(std::move(unused));
  }

  // Any client may profile (workers answer the same): a trace holds op names and times, no data.
  grpc::Status Profile(grpc::ServerContext* ctx, const pb::ProfileRequest* req, pb::ProfileReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    return to_grpc(answer_profile(profile_, *req, -1, reply));
  }

  grpc::Status Compile(grpc::ServerContext* ctx, const pb::CompileRequest* req, pb::CompileReply* reply) override {
    ProfileSpan span(&profile_, "compile", [] { return std::string("compile"); });
    absl::StatusOr<uint64_t> acting = acting_session(*ctx, req->session_id(), "Compile");
    if (!acting.ok()) return to_grpc(acting.status());
    absl::Status session = registry_.check_session(*acting, absl::Now());
    if (!session.ok()) return to_grpc(session);
    absl::StatusOr<std::shared_ptr<Program>> program = compile(*req, *acting);
    if (!program.ok()) return to_grpc(program.status());
    reply->set_executable_id((*program)->id);
    for (const PartitionSpec& spec : (*program)->exe.output_specs) to_proto(spec, reply->add_output_specs());
    if (req->text() == pb::CompileRequest::TEXT_PROGRAM) reply->set_text((*program)->exe.as_text());
    if (req->text() == pb::CompileRequest::TEXT_DEVICE) {
      absl::StatusOr<std::string> text = (*program)->exe.device_text(req->text_device());
      if (!text.ok()) return to_grpc(text.status());
      reply->set_text(*std::move(text));
    }
    reply->set_epoch(registry_.epoch());
    const int64_t compilations = programs_.counts().compilations;
    reply->set_compilations(compilations);
    if (span) {
      span.arg("executable", absl::StrCat((*program)->id));
      span.arg("compilations", absl::StrCat(compilations));
    }
    return grpc::Status::OK;
  }
  // Callback API: the runs go out asynchronously and the reply goes from the last worker's
  // answer, on the thread that received it (in process, an embedded worker's small run ends,
  // and answers, on this thread: plan_stream.h's LocalPlanStream): no server thread waits for
  // the workers, and none has to be woken to answer (each wake-up is a context switch on this
  // machine). The first call of a program on a device loads its plan first, on a thread of its
  // own. A call naming outputs of calls still in flight (pending_inputs) is sent to the workers
  // as soon as those calls' runs were (each worker runs it after them, in the order of its
  // stream or session): neither the client nor the coordinator waits for them to finish.
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* ctx, const pb::ExecuteRequest* req,
                                    pb::ExecuteReply* reply) override {
    // What this thread does for the call: its checks and, unless it waits for producers or
    // plans to load, handing the runs to the workers' streams.
    ProfileSpan span(&profile_, "dispatch", [] { return std::string("execute"); });
    if (span) {  // formatted only when recording: an 18-digit id is an allocation per call
      span.arg("executable", absl::StrCat(req->executable_id()));
      span.arg("call", absl::StrCat(req->call_id()));
    }
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    absl::StatusOr<uint64_t> session =
        caller.ok() ? tessera::acting_session(*caller, req->session_id(), "execute") : caller.status();
    if (!session.ok()) {
      reactor->Finish(to_grpc(session.status()));
      return reactor;
    }
    // The client's deletions riding on this call: done whatever becomes of the call. Those
    // refused (another session's arrays) do not fail it: the call is fine, and the reply says
    // which were refused and why (the client reports them as failed deletions).
    Taken frees = take_arrays(*caller, req->delete_arrays(), req->delete_grants(), "execute: delete_arrays");
    if (!frees.refused.empty()) {
      reply->mutable_refused_deletes()->Assign(frees.refused.begin(), frees.refused.end());
      reply->set_delete_error(std::string(frees.refusal.message()));
    }
    const CallKey key{*session, req->call_id()};
    absl::Status arrived = driver_.arrive_call(key);
    if (!arrived.ok()) {
      fan_out_.delete_buffers(frees.buffers, /*wait=*/false);
      reactor->Finish(to_grpc(arrived));  // not recorded: the call id is another call's
      return reactor;
    }
    if (req->pending_inputs_size() == 0) {
      driver_.start_execution(key, *caller, *req, reactor, reply, {}, std::move(frees.buffers));
    } else {
      // The deletions ride on its runs once its producers' are sent (a chain), or go at once
      // if a producer has not arrived (await_producers).
      driver_.await_producers(key, *caller, req, reactor, reply, std::move(frees.buffers));
    }
    return reactor;
  }

  // Evicts the channel of every address no alive device has (a worker lost, or registered
  // again elsewhere): the channels are as many as the alive devices, not every address ever
  // seen. Never blocks on a call.
  void evict_worker_channels() {
    absl::flat_hash_set<std::string> alive;
    for (const DeviceRecord& d : registry_.devices()) {
      if (d.alive) alive.insert(d.address);
    }
    channels_.retain(alive);
  }

  // Ends every RunPlans stream, waiting (bounded) for gRPC to be done with each: after the
  // server stopped, before the service goes.
  void close_plan_streams() {
    for (const std::shared_ptr<PlanStream>& s : channels_.take_plan_streams()) s->close(absl::Seconds(2));
    // The calls nobody waited for end by their deadline (kConnectDeadline): their callbacks
    // use this service.
    fan_out_.wait_for_calls(kConnectDeadline + absl::Seconds(1));
  }

  grpc::Status RunCollective(grpc::ServerContext* ctx, const pb::RunCollectiveRequest* req,
                             pb::RunCollectiveReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    int64_t collective_ns = 0;
    absl::StatusOr<ArrayRecord> out = run_collective(*req, *caller, time_left(*ctx), &collective_ns);
    if (!out.ok()) return to_grpc(out.status());
    reply->set_collective_ns(collective_ns);
    to_proto(*out, reply->mutable_result());
    reply->mutable_result()->set_grant(auth_.grant(out->id));
    return grpc::Status::OK;
  }

  grpc::Status ReshardArray(grpc::ServerContext* ctx, const pb::ReshardArrayRequest* req,
                            pb::ReshardArrayReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    absl::StatusOr<ArrayRecord> out = reshard_array(*req, *caller, time_left(*ctx));
    if (!out.ok()) return to_grpc(out.status());
    to_proto(*out, reply->mutable_result());
    reply->mutable_result()->set_grant(auth_.grant(out->id));
    return grpc::Status::OK;
  }

  // The coordinator's metrics (core/metrics.h), from what it counts anyway.
  std::vector<MetricSample> metrics() {
    int64_t alive = 0, devices = 0, compilations = 0, programs = 0, evictions = 0, again = 0, lost = 0, left = 0;
    for (const DeviceRecord& d : registry_.devices()) {
      ++devices;
      alive += d.alive ? 1 : 0;
      again += static_cast<int64_t>(d.incarnation) - 1;
      lost += static_cast<int64_t>(d.times_lost);
      left += static_cast<int64_t>(d.times_left);
    }
    {
      const ProgramCache::Counts counts = programs_.counts();
      compilations = counts.compilations;
      evictions = counts.evictions;
      programs = counts.programs;
    }
    const auto arrays = static_cast<double>(registry_.array_count());
    const char* const kExecutions = "Executions answered, by result.";
    const char* const kRegistrations =
        "Worker registrations: a device's first, and again (the same worker back, or a new process under its name).";
    return {
        gauge("tessera_coordinator_devices", "Devices registered (alive, lost or left).", devices),
        gauge("tessera_coordinator_devices_alive", "Devices alive.", alive),
        counter("tessera_coordinator_registrations_total", kRegistrations, devices, {{"kind", "first"}}),
        counter("tessera_coordinator_registrations_total", kRegistrations, again, {{"kind", "again"}}),
        counter("tessera_coordinator_devices_lost_total", "Times a device was marked lost (missed heartbeats).", lost),
        counter("tessera_coordinator_devices_left_total",
                "Times a device's worker drained and deregistered (SIGTERM): gone, not lost.", left),
        counter("tessera_coordinator_heartbeats_total", "Worker heartbeats accepted (not a leaving worker's last).",
                static_cast<double>(heartbeats_.load(std::memory_order_relaxed))),
        counter("tessera_coordinator_heartbeat_views_total",
                "Heartbeat replies that carried the cluster view: the worker's view version was not the current one.",
                static_cast<double>(heartbeat_views_.load(std::memory_order_relaxed))),
        gauge("tessera_coordinator_arrays", "Arrays the coordinator knows.", arrays),
        gauge("tessera_coordinator_programs", "Compiled programs held.", programs),
        counter("tessera_coordinator_compilations_total", "Programs compiled.", compilations),
        counter("tessera_coordinator_compile_cache_hits_total", "Compile requests answered from the cache.",
                programs_.cache_hits()),
        counter("tessera_coordinator_compile_cache_misses_total",
                "Compile requests the cache did not hold, each compiled (it may then fail).", programs_.cache_misses()),
        counter("tessera_coordinator_compile_cache_evictions_total",
                "Programs evicted from the cache (least recently used, beyond --max_programs).", evictions),
        counter("tessera_coordinator_executions_total", kExecutions, driver_.executions_ok(), {{"result", "ok"}}),
        counter("tessera_coordinator_executions_total", kExecutions, driver_.executions_failed(),
                {{"result", "error"}}),
        counter("tessera_coordinator_deletes_on_runs_total",
                "Buffers (one per device holding a block) whose deletion rode on a call's runs (drops the client's "
                "next Execute carried), not on a message of its own to the device.",
                driver_.deletes_on_runs()),
        counter("tessera_coordinator_chained_calls_total",
                "Calls forwarded to the workers while a call whose output they read was still running (sent "
                "behind its runs on each worker's stream, not after its reply).",
                driver_.chained_calls()),
        gauge("tessera_coordinator_worker_channels", "Channels to workers held (one per alive device's address).",
              channels_.size()),
        gauge("tessera_coordinator_uptime_seconds", "Since the process started.",
              absl::ToDoubleSeconds(absl::Now() - started_)),
    };
  }
  std::vector<const LatencyHistogram*> histograms() const {
    return {&programs_.compile_seconds(), &driver_.execute_seconds()};
  }

  grpc::Status GetClusterStatus(grpc::ServerContext* ctx, const pb::GetClusterStatusRequest* req,
                                pb::ClusterStatus* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    // A client sees its own session's arrays and programs; an admin sees everyone's.
    const bool everything = caller->at_least(Role::kAdmin);
    reply->set_coordinator(address_);
    reply->set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - started_));
    // Every alive worker's stats, asked all at once; a worker that does not answer in time
    // gets its error instead.
    const absl::Duration timeout =
        std::min(req->stats_timeout_ms() > 0 ? absl::Milliseconds(std::min<int64_t>(req->stats_timeout_ms(), 60'000))
                                             : absl::Seconds(2),
                 time_left(*ctx));
    std::vector<DeviceRecord> devices = registry_.devices();
    std::vector<std::shared_ptr<WorkerChannel>> workers;
    std::vector<pb::DeviceStatus*> asked;
    for (const DeviceRecord& d : devices) {
      pb::DeviceStatus* status = reply->add_devices();
      to_proto(d, status->mutable_info());
      if (!d.alive) continue;
      workers.push_back(channels_.get(d.address));
      asked.push_back(status);
    }
    const pb::GetStatsRequest stats_request;
    std::vector<grpc::Status> statuses =
        fan_out_.fan_out(workers, timeout, [&](int i, grpc::ClientContext* ctx, auto done) {
          workers[i]->stub->async()->GetStats(ctx, &stats_request, asked[i]->mutable_stats(), std::move(done));
        });
    for (size_t i = 0; i < asked.size(); ++i) {
      if (statuses[i].ok()) continue;
      asked[i]->clear_stats();
      asked[i]->set_stats_error(statuses[i].error_message());
    }
    // Within kMaxStatusBytes: the devices first, then arrays and programs while they fit (the
    // rest counted), so that no number of them makes the status too large for everyone.
    size_t bytes = reply->ByteSizeLong();
    for (const ArrayRecord& a : registry_.arrays()) {
      if (!everything && (a.session == 0 || a.session != caller->session)) continue;
      pb::ArrayInfo info;
      to_proto(a, &info);
      bytes += info.ByteSizeLong() + 8;
      if (bytes > kMaxStatusBytes) {
        reply->set_arrays_omitted(reply->arrays_omitted() + 1);
        continue;
      }
      *reply->add_arrays() = std::move(info);
    }
    programs_.list(everything, caller->session, kMaxStatusBytes, &bytes, reply);
    return grpc::Status::OK;
  }

 private:
  // Whether `n` devices are alive and take work (not draining) within `wait`, each confirmed
  // by its worker: the process at its address must answer that it holds the incarnation the
  // registry counts. A worker killed and started again is counted alive until its heartbeat
  // timeout, and its new process serves before it registers: without the confirmation a
  // client's wait answered at once, its put reached the dead or the unregistered process, and
  // the new process's registration then declared the shards lost. False early if the caller
  // cancelled; on false, *unconfirmed says which counted devices their workers did not confirm.
  bool wait_for_alive(const grpc::ServerContextBase& ctx, int n, absl::Duration wait,
                      std::map<int, std::string>* unconfirmed) {
    const absl::Time deadline = absl::Now() + wait;
    for (;;) {
      while (!registry_.wait_for_alive(n, std::min(deadline - absl::Now(), kCancelCheck), /*taking_work=*/true)) {
        if (absl::Now() >= deadline || ctx.IsCancelled()) return false;
      }
      const absl::Time checked = absl::Now();
      std::vector<WorkerChannels::Registered> counted;
      for (const DeviceRecord& d : registry_.devices()) {
        if (d.alive && !d.draining) counted.push_back({d.id, d.address, registry_.epoch(), d.incarnation});
      }
      *unconfirmed = channels_.unconfirmed(counted, std::min(deadline, checked + kConfirmTimeout));
      if (static_cast<int>(counted.size() - unconfirmed->size()) >= n) return true;
      if (absl::Now() >= deadline || ctx.IsCancelled()) return false;
      // Ask again once a device registers (the new process), the registry marks one lost, or
      // after a short while (a channel still backing off from the outage).
      registry_.wait_for_registration(checked, std::min(deadline, absl::Now() + kCancelCheck));
    }
  }

  // The session a request acts for: a client's own (proved by its session credential), which
  // a session id in the request must match; an admin or a daemon may name any (0: none).
  // UNAUTHENTICATED as Authenticator::authenticate; PERMISSION_DENIED naming `method` for a
  // client without a session credential or naming another session.
  absl::StatusOr<uint64_t> acting_session(const grpc::ServerContextBase& ctx, uint64_t requested,
                                          absl::string_view method) const {
    TESSERA_ASSIGN_OR_RETURN(Caller caller, auth_.authenticate(ctx));
    return tessera::acting_session(caller, requested, method);
  }

  // Compiles (or finds) the program of `req`, held by `session` from now on.
  absl::StatusOr<std::shared_ptr<Program>> compile(const pb::CompileRequest& req, uint64_t session) {
    TESSERA_RETURN_IF_ERROR(check_compile_graph(req.graph(), req.input_specs_size()));
    TESSERA_ASSIGN_OR_RETURN(Graph graph, graph_from_proto(req.graph()));
    TESSERA_ASSIGN_OR_RETURN(Mesh mesh, mesh_from_proto(req.mesh()));
    await_registration(mesh.device_ids());
    for (int d : mesh.device_ids()) {
      if (!registry_.device(d).has_value()) {
        return absl::NotFoundError(absl::StrCat("jit: the mesh names device ", d, ", which is not in the cluster"));
      }
    }
    TESSERA_RETURN_IF_ERROR(check_not_draining(registry_, mesh.device_ids(), "jit"));
    std::vector<PartitionSpec> inputs;
    for (const pb::PartitionSpec& s : req.input_specs()) inputs.push_back(spec_from_proto(s));
    std::vector<std::optional<PartitionSpec>> outputs;
    for (const pb::OptionalSpec& s : req.output_specs()) {
      outputs.push_back(s.set() ? std::optional<PartitionSpec>(spec_from_proto(s.spec())) : std::nullopt);
    }
    if (outputs.empty()) outputs.resize(graph.outputs().size());
    std::vector<int> donated(req.donated_inputs().begin(), req.donated_inputs().end());
    std::sort(donated.begin(), donated.end());  // one program for {0, 1} and {1, 0}
    for (size_t i = 0; i < donated.size(); ++i) {
      if (donated[i] < 0 || donated[i] >= static_cast<int>(inputs.size()) || (i > 0 && donated[i] == donated[i - 1])) {
        return absl::InvalidArgumentError(absl::StrCat("jit: donated input ", donated[i], " is not one of the ",
                                                       inputs.size(), " inputs or is named twice"));
      }
    }
    // The whole request, byte for byte: a lookup compares it all, never just a hash.
    std::string key = compile_key(graph, mesh, inputs, outputs, donated);
    return programs_.compile(std::move(key), std::move(graph), mesh, inputs, outputs, donated, session);
  }

  // Runs one collective on the blocks of an array; the results become a new array with the
  // same sharding (so every device must hold a block of its own).
  // Sets *collective_ns to the slowest member's time (see RunCollectiveReply).
  // `caller` must own the input (or be an admin); the output belongs to its session. Waits for
  // the workers at most until the caller's deadline (`time_left`) or the run's timeout.
  absl::StatusOr<ArrayRecord> run_collective(const pb::RunCollectiveRequest& req, const Caller& caller,
                                             absl::Duration time_left, int64_t* collective_ns) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t session,
                             tessera::acting_session(caller, req.session_id(), "RunCollective"));
    TESSERA_ASSIGN_OR_RETURN(ArrayRecord in, registry_.get_array(req.array_id()));
    TESSERA_RETURN_IF_ERROR(check_owner(caller, in, "RunCollective", "read"));
    TESSERA_ASSIGN_OR_RETURN(CollectiveSpec spec, collective_from_proto(req.spec()));
    TESSERA_ASSIGN_OR_RETURN(const absl::Duration timeout, run_timeout("RunCollective", req.timeout_ms()));
    const std::string name = collective_name(spec.kind);
    const NamedSharding& sharding = in.sharding;
    TESSERA_ASSIGN_OR_RETURN(Shape out_shape, collective_result_shape(spec, in));
    const std::vector<int>& mesh_devices = sharding.mesh().device_ids();
    TESSERA_RETURN_IF_ERROR(check_not_lost(registry_, in, name));
    TESSERA_ASSIGN_OR_RETURN(Members members, fan_out_.alive_members(mesh_devices, name));
    const std::vector<pb::PeerAddress>& peers = members.peers;
    TESSERA_ASSIGN_OR_RETURN(uint64_t out_id, registry_.create_array(in.dtype, out_shape, sharding, session));

    pb::WorkerCollectiveRequest request;
    request.set_op_id(out_id);              // array ids are unique: so are the ops that make them
    request.set_run_tag(random_run_tag());  // op ids are predictable: the members' messages carry this
    *request.mutable_spec() = req.spec();
    request.set_input_buffer(in.id);
    request.set_output_buffer(out_id);
    for (const pb::PeerAddress& p : peers) *request.add_peers() = p;
    // The workers stop a second before the caller's deadline, when the fan-out gives up: a run
    // that finished after it would leave its output buffer on the workers, unrecorded.
    const absl::Duration worker_timeout =
        std::max(absl::Milliseconds(1), std::min(timeout, time_left - absl::Seconds(1)));
    request.set_timeout_ms(absl::ToInt64Milliseconds(worker_timeout));
    request.set_barrier_first(req.barrier_first());
    std::vector<pb::WorkerCollectiveReply> replies(peers.size());
    std::vector<std::shared_ptr<WorkerChannel>> workers;
    for (const pb::PeerAddress& p : peers) workers.push_back(channels_.get(p.address()));
    std::vector<grpc::Status> statuses = fan_out_.fan_out(
        workers, std::min(timeout + absl::Seconds(5), time_left),
        [&](int i, grpc::ClientContext* ctx, auto done) {
          workers[i]->stub->async()->RunCollective(ctx, &request, &replies[i], std::move(done));
        },
        kFailureGrace, &members);
    absl::Status failed = FanOut::first_failure(statuses, peers, name);
    if (!failed.ok()) {
      fan_out_.delete_buffers(registry_.remove_arrays({out_id}));
      return failed;
    }
    *collective_ns = 0;
    for (const pb::WorkerCollectiveReply& r : replies) *collective_ns = std::max(*collective_ns, r.elapsed_ns());
    return registry_.get_array(out_id);
  }

  // device_put of an array already on devices: a new array of the same values laid out by
  // req.sharding, on its mesh's devices, whatever they are. The coordinator plans the boxes
  // each device sends and receives (block_moves.h) and every device involved (holders of the
  // input that send, devices of the result) runs its part (the workers' Reshard): the data
  // moves worker to worker. `caller` must own the input; the result belongs to its session.
  absl::StatusOr<ArrayRecord> reshard_array(const pb::ReshardArrayRequest& req, const Caller& caller,
                                            absl::Duration time_left) {
    const std::string what = "device_put";
    TESSERA_ASSIGN_OR_RETURN(const uint64_t session, tessera::acting_session(caller, req.session_id(), "ReshardArray"));
    TESSERA_ASSIGN_OR_RETURN(ArrayRecord in, registry_.get_array(req.array_id()));
    TESSERA_RETURN_IF_ERROR(check_owner(caller, in, "ReshardArray", "read"));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding target, sharding_from_proto(req.sharding()));
    absl::Status fits = target.validate(in.shape);
    if (!fits.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", fits.message()));
    absl::Status terms = check_unreduced_move(in.sharding, target);
    if (!terms.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", terms.message()));
    TESSERA_ASSIGN_OR_RETURN(const absl::Duration timeout, run_timeout("ReshardArray", req.timeout_ms()));
    TESSERA_RETURN_IF_ERROR(check_not_lost(registry_, in, what));
    await_registration(target.mesh().device_ids());
    // The result's record first: NOT_FOUND for a device outside the cluster before any planning
    // (a mesh may name up to 2^20 devices).
    TESSERA_ASSIGN_OR_RETURN(uint64_t out_id, registry_.create_array(in.dtype, in.shape, target, session));
    // Each device's part: its block of the result (if any) and the pieces it sends and receives.
    std::map<int, ReshardPart> involved = plan_reshard_parts(in.shape, in.sharding, target);
    std::vector<int> devices;
    for (const auto& [d, p] : involved) devices.push_back(d);
    absl::StatusOr<Members> members = fan_out_.alive_members(devices, what);
    if (!members.ok()) {
      registry_.remove_arrays({out_id});
      return members.status();
    }
    const std::vector<pb::PeerAddress>& peers = members->peers;
    // The workers stop a second before the caller's deadline, when the fan-out gives up (see
    // run_collective).
    const absl::Duration worker_timeout =
        std::max(absl::Milliseconds(1), std::min(timeout, time_left - absl::Seconds(1)));
    std::vector<pb::WorkerReshardRequest> requests;
    std::vector<std::shared_ptr<WorkerChannel>> workers;
    const uint64_t run_tag = random_run_tag();  // the same for every member (see run_collective)
    for (const pb::PeerAddress& peer : peers) {
      ReshardPart& p = involved[peer.device_id()];
      pb::WorkerReshardRequest& r = p.request;
      r.set_op_id(out_id);  // array ids are unique: so are the ops that make them
      r.set_run_tag(run_tag);
      if (r.sends_size() > 0) r.set_input_buffer(in.id);
      if (p.out_block.has_value()) {
        r.set_output_buffer(out_id);
        tessera::to_proto(block_shape(*p.out_block), r.mutable_output_shape());
      }
      r.set_dtype(tessera::to_proto(in.dtype));
      r.set_timeout_ms(absl::ToInt64Milliseconds(worker_timeout));
      for (const pb::PeerAddress& other : peers) *r.add_peers() = other;
      requests.push_back(std::move(r));
      workers.push_back(channels_.get(peer.address()));
    }
    std::vector<pb::WorkerReshardReply> replies(peers.size());
    std::vector<grpc::Status> statuses = fan_out_.fan_out(
        workers, std::min(timeout + absl::Seconds(5), time_left),
        [&](int i, grpc::ClientContext* ctx, auto done) {
          workers[i]->stub->async()->Reshard(ctx, &requests[i], &replies[i], std::move(done));
        },
        kFailureGrace, &*members);
    absl::Status failed = FanOut::first_failure(statuses, peers, what);
    if (!failed.ok()) {
      fan_out_.delete_buffers(registry_.remove_arrays({out_id}));
      return failed;
    }
    return registry_.get_array(out_id);
  }

  // Converts and checks a CreateArray request; the registry checks the devices.
  absl::StatusOr<uint64_t> create_array(const pb::CreateArrayRequest& req, uint64_t session) {
    TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(req.dtype()));
    TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(req.shape(), dtype));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(req.sharding()));
    await_registration(sharding.mesh().device_ids());
    TESSERA_RETURN_IF_ERROR(check_not_draining(registry_, sharding.mesh().device_ids(), "device_put"));
    return registry_.create_array(dtype, shape, sharding, session);
  }

  // Adopts the arrays for `session`; with best_effort, lists those it could not. Each must
  // carry its grant: the proof that the caller owned it before the coordinator restarted.
  absl::Status adopt_arrays(const pb::AdoptArraysRequest& req, uint64_t session, pb::AdoptArraysReply* reply) {
    for (const pb::ArrayInfo& info : req.arrays()) {
      absl::StatusOr<ArrayRecord> a = array_from_proto(info);
      absl::Status adopted = a.status();
      if (a.ok()) adopted = auth_.check_grant(info.array_id(), info.grant(), "AdoptArrays");
      if (adopted.ok()) {
        a->session = session;
        await_registration(a->sharding.mesh().device_ids());
        adopted = registry_.adopt_array(*a);
      }
      if (adopted.ok()) continue;
      if (!req.best_effort()) return adopted;
      reply->add_not_adopted(info.array_id());
    }
    return absl::OkStatus();
  }

  // A coordinator that has just started waits (bounded, see kRegistrationGrace) until the
  // devices `ids` have registered; an older one returns at once. The caller then checks them.
  void await_registration(const std::vector<int>& ids) const {
    registry_.wait_for_devices(ids, started_ + registration_grace_);
  }
  // Constant after construction.
  const CoordinatorOptions options_;
  const absl::Time started_;
  ProfileRecorder profile_;  // this coordinator's timeline (core/profile.h): compiles and dispatches
  Registry registry_;
  const absl::Duration registration_grace_;
  std::string address_;  // set once, right after the port is bound and before it is announced
  const Authenticator auth_;
  WorkerChannels channels_;
  FanOut fan_out_;
  ProgramCache programs_;
  // Heartbeats accepted (not a leaving worker's last), and those whose reply carried the view.
  std::atomic<int64_t> heartbeats_{0}, heartbeat_views_{0};
  // Last: its pool's threads use everything above, and its destructor joins them.
  ExecutionDriver driver_;
};

class CoordinatorServerImpl final : public CoordinatorServer {
 public:
  explicit CoordinatorServerImpl(const CoordinatorOptions& options) : options_(options), service_(options) {}
  ~CoordinatorServerImpl() override { shutdown(); }

  absl::Status init() {
    grpc::ServerBuilder builder;
    if (!options_.in_process) {
      builder.AddListeningPort(absl::StrCat(options_.host, ":", options_.port),
                               server_credentials(options_.credentials), &port_);
    }
    configure_server(&builder, options_.max_sync_threads);
    rpc_errors_.install(&builder);
    builder.RegisterService(&service_);
    builder.RegisterService(health_.service());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || (port_ == 0 && !options_.in_process)) {
      return absl::UnavailableError(
          absl::StrCat("tessera-coordinator: cannot listen on ", options_.host, ":", options_.port));
    }
    if (options_.in_process) {
      TESSERA_ASSIGN_OR_RETURN(in_process_, InProcessAddress::add(server_.get()));
      address_ = in_process_->address();
    } else {
      address_ = absl::StrCat(options_.host, ":", port_);
    }
    if (options_.health_port >= 0 && !options_.in_process) {
      absl::StatusOr<std::unique_ptr<HealthPort>> health_port =
          health_.serve_plaintext(options_.host, options_.health_port);
      if (!health_port.ok())
        return absl::UnavailableError(absl::StrCat("tessera-coordinator: ", health_port.status().message()));
      health_port_ = *std::move(health_port);
    }
    update_health();
    service_.set_address(address());
    start_monitor();
    // Lapsed leases are reaped at a tenth of the lease (at most every second), off the monitor:
    // the deletions wait for the workers.
    const absl::Duration reap_every = std::clamp(options_.lease_timeout / 10, absl::Milliseconds(10), absl::Seconds(1));
    reaper_ = std::thread([this, reap_every] {
      while (!stopping_.WaitForNotificationWithTimeout(reap_every)) service_.reap_lapsed();
    });
    return absl::OkStatus();
  }

  std::string address() const override { return address_; }
  int port() const override { return port_; }
  int health_port() const override { return health_port_ == nullptr ? -1 : health_port_->port(); }
  std::vector<MetricSample> metrics() override {
    std::vector<MetricSample> samples = service_.metrics();
    for (MetricSample& m : rpc_errors_.samples("tessera_coordinator_rpc_errors_total", {}))
      samples.push_back(std::move(m));
    return samples;
  }
  std::vector<const LatencyHistogram*> histograms() const override { return service_.histograms(); }

  void hand_runs_in_process(const std::string& worker_address, std::shared_ptr<LocalRuns> runs) override {
    service_.channels().hand_runs_in_process(worker_address, std::move(runs));
  }
  int64_t requests_handed_over() const override { return service_.channels().handed_over(); }

  void shutdown() override {
    // The server first: its pending Executes end by their deadlines, which the monitor
    // enforces, so it stops only after them.
    {
      // A monitor tick's update_health from here on must not mark the server ready again.
      absl::MutexLock lock(&health_mu_);
      health_final_ = true;
      health_.set_ready(false);
    }
    health_port_.reset();
    if (in_process_ != nullptr) in_process_->reset();  // no new channels to a server going away
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      server_->Wait();
      server_.reset();
    }
    if (!stopping_.HasBeenNotified()) stopping_.Notify();
    service_.driver().stop_monitor();
    if (reaper_.joinable()) reaper_.join();
    service_.close_plan_streams();
  }

 private:
  // The execution driver's monitor, four ticks per heartbeat interval, with this server's steps
  // around the driver's checks: silent workers marked lost (before the watch, which fails
  // their executions naming them), their channels evicted, the heap trimmed, health updated.
  void start_monitor() {
    ExecutionDriver::MonitorSteps steps;
    steps.before_watch = [this] {
      for (int id : service_.registry().mark_lost(absl::Now())) {
        std::optional<DeviceRecord> d = service_.registry().device(id);
        std::fprintf(stderr, "tessera-coordinator: %s missed heartbeats for %s; marked lost\n",
                     describe_device(id, d ? d->address : "?").c_str(),
                     absl::FormatDuration(options_.heartbeat_timeout).c_str());
      }
    };
    // After the watch, which fails the executions of devices just marked lost naming them.
    steps.after_watch = [this] { service_.evict_worker_channels(); };
    steps.after = [this] {
      // Evicted programs' pages back to the kernel (core/heap.h): off the RPC threads.
      service_.programs().heap().trim_if_released();
      update_health();
    };
    service_.driver().start_monitor(options_.heartbeat_interval / 4, std::move(steps));
  }

  // Ready while the expected devices are alive; a change is logged.
  void update_health() {
    const bool ready = service_.registry().wait_for_alive(options_.expected_devices, absl::ZeroDuration());
    absl::MutexLock lock(&health_mu_);
    if (health_final_) return;  // shutting down: not ready, whatever the registry says
    if (ready != health_.ready() && options_.log_registrations && options_.expected_devices > 0) {
      std::fprintf(stderr, "tessera-coordinator: %s: %s %d devices alive (--expected_devices)\n",
                   ready ? "ready" : "not ready", ready ? "at least" : "fewer than", options_.expected_devices);
    }
    health_.set_ready(ready);
  }

  const CoordinatorOptions options_;
  CoordinatorService service_;
  HealthService health_;
  absl::Mutex health_mu_;  // a leaf: orders update_health's set_ready before shutdown's
  bool health_final_ ABSL_GUARDED_BY(health_mu_) = false;
  std::unique_ptr<HealthPort> health_port_;  // options_.health_port's server, if any
  RpcErrorCounter rpc_errors_;               // outlives server_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;                                  // 0 in process
  std::unique_ptr<InProcessAddress> in_process_;  // options_.in_process: server_'s address
  std::string address_;                           // set once in init()
  absl::Notification stopping_;                   // the reaper's
  std::thread reaper_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::start(const CoordinatorOptions& options) {
  if (options.lease_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("tessera-coordinator: lease_timeout must be positive, got ",
                                                   absl::FormatDuration(options.lease_timeout)));
  }
  if (options.heartbeat_interval <= absl::ZeroDuration() || options.heartbeat_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tessera-coordinator: heartbeat_timeout (", absl::FormatDuration(options.heartbeat_timeout),
        ") must exceed a positive heartbeat_interval (", absl::FormatDuration(options.heartbeat_interval), ")"));
  }
  if (options.expected_devices < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("tessera-coordinator: expected_devices must not be negative, got ", options.expected_devices));
  }
  TESSERA_RETURN_IF_ERROR(check_max_sync_threads(options.max_sync_threads, "max_sync_threads"));
  auto server = std::make_unique<CoordinatorServerImpl>(options);
  TESSERA_RETURN_IF_ERROR(server->init());
  return std::unique_ptr<CoordinatorServer>(std::move(server));
}

}  // namespace tessera

#include "coordinator/coordinator_server.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <functional>
#include <optional>
#include <set>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/propagate.h"
#include "coordinator/plan_stream.h"
#include "coordinator/registry.h"
#include "coordinator/request_limits.h"
#include "core/collective.h"
#include "core/profile_wire.h"
#include "core/status.h"
#include "core/thread_pool.h"
#include "core/wire.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/health.h"
#include "proto/rpc.h"
#include "proto/rpc_errors.h"
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

void to_proto(const ArrayRecord& a, pb::ArrayInfo* out) {
  out->set_array_id(a.id);
  out->set_dtype(tessera::to_proto(a.dtype));
  tessera::to_proto(a.shape, out->mutable_shape());
  tessera::to_proto(a.sharding, out->mutable_sharding());
  for (int d : a.lost_devices) out->add_lost_devices(d);
}

// After the first member of a collective fails, how long the others get to report theirs
// before the rest are cancelled.
constexpr absl::Duration kFailureGrace = absl::Milliseconds(500);

// Right after it starts, the coordinator waits this long (at least) for the devices a request
// names to register: after a restart the workers come back within a heartbeat or two, and a
// client's first call should not fail for being early.
constexpr absl::Duration kRegistrationGrace = absl::Seconds(5);

// The most a GetClusterStatus reply lists (kMaxMessageBytes is the limit).
constexpr size_t kMaxStatusBytes = 3 << 20;

// How often a long wait in a handler checks whether its caller cancelled.
constexpr absl::Duration kCancelCheck = absl::Milliseconds(100);

// Calls naming the outputs of calls still in flight (ExecuteRequest.pending_inputs): how long
// a call waits for a producer that has not reached the coordinator (gRPC may hand two calls to
// the handlers out of order; a producer whose Execute never came fails its consumers then),
// how many such producers may be awaited at once, and how many finished calls' outcomes are
// remembered for consumers that arrive after them (the SDK has at most 16 calls in flight).
constexpr absl::Duration kProducerArrival = absl::Seconds(10);
constexpr size_t kMaxAwaitedCalls = 1024;
constexpr size_t kMaxRememberedCalls = 4096;
constexpr size_t kMaxCalls = 1 << 16;

// The coordinator's line to one worker.
struct WorkerChannel {
  // The RunPlans stream to the worker's `incarnation`, opened if there is none or the one there
  // broke or belongs to an older incarnation (a stale one is closed; its pending runs fail).
  // Null if the worker has a newer incarnation already: a call checked before the worker
  // registered anew must not close the stream of the calls made since.
  std::shared_ptr<PlanStream> plan_stream(uint64_t incarnation) {
    std::shared_ptr<PlanStream> stale, current;
    {
      absl::MutexLock lock(&mu);
      if (plans != nullptr && plans->incarnation() > incarnation) return nullptr;
      if (plans != nullptr && (plans->broken() || plans->incarnation() != incarnation)) stale = std::move(plans);
      if (plans == nullptr) plans = PlanStream::open(stub.get(), incarnation);
      current = plans;
    }
    if (stale != nullptr) stale->close(absl::ZeroDuration());  // does not wait
    return current;
  }

  // The RunPlans stream to the worker's `incarnation` if one is open and healthy; else null.
  std::shared_ptr<PlanStream> open_plan_stream(uint64_t incarnation) {
    absl::MutexLock lock(&mu);
    if (plans == nullptr || plans->broken() || plans->incarnation() != incarnation) return nullptr;
    return plans;
  }

  std::unique_ptr<pb::Worker::Stub> stub;
  std::atomic<bool> reached{false};  // a call has succeeded: the worker was up at least once
  absl::Mutex mu;
  std::shared_ptr<PlanStream> plans ABSL_GUARDED_BY(mu);
};

class CoordinatorService final : public pb::Coordinator::WithCallbackMethod_Execute<pb::Coordinator::Service> {
 public:
  explicit CoordinatorService(const CoordinatorOptions& options)
      : options_(options),
        started_(absl::Now()),
        registry_(options.heartbeat_timeout, started_, options.lease_timeout),
        registration_grace_(std::max(kRegistrationGrace, 2 * options.heartbeat_timeout)),
        auth_(options.credentials),
        identity_(daemon_identity(options.credentials)),
        plan_loads_("first calls loading their plans (max_plan_loads)", std::max(1, options.max_plan_loads)) {}

  void set_address(const std::string& address) { address_ = address; }

  Registry& registry() { return registry_; }

  grpc::Status Handshake(grpc::ServerContext* ctx, const pb::HandshakeRequest* req,
                         pb::HandshakeReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    reply->set_protocol_version(kProtocolVersion);
    reply->set_server("tessera-coordinator");
    reply->set_epoch(registry_.epoch());
    return to_grpc(check_protocol_version(req->protocol_version(), absl::StrCat("client '", req->peer(), "'")));
  }

  grpc::Status RegisterWorker(grpc::ServerContext* ctx, const pb::RegisterWorkerRequest* req,
                              pb::RegisterWorkerReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "RegisterWorker");
    if (!caller.ok()) return to_grpc(caller.status());
    absl::Status version = check_protocol_version(req->protocol_version(), absl::StrCat("worker at ", req->address()));
    if (!version.ok()) return to_grpc(version);
    absl::Status valid = check_registration(req->name(), req->address(), req->requested_device_id());
    if (!valid.ok()) return to_grpc(valid);
    if (req->memory_bytes() <= 0) {
      return to_grpc(absl::InvalidArgumentError(
          absl::StrCat("RegisterWorker: memory_bytes must be positive, got ", req->memory_bytes())));
    }
    WorkerRegistration registration;
    registration.name = req->name();
    registration.address = req->address();
    registration.requested_id = req->requested_device_id();
    registration.memory_bytes = req->memory_bytes();
    registration.previous_epoch = req->previous_epoch();
    registration.previous_incarnation = req->previous_incarnation();
    for (const pb::ShardHeader& h : req->held_buffers()) {
      absl::StatusOr<DType> dtype = dtype_from_proto(h.dtype());
      absl::StatusOr<Shape> shape = dtype.ok() ? shape_from_proto(h.shape(), *dtype) : dtype.status();
      if (!shape.ok()) {
        return to_grpc(absl::InvalidArgumentError(
            absl::StrCat("RegisterWorker: held buffer ", h.buffer_id(), ": ", shape.status().message())));
      }
      registration.held[h.buffer_id()] = HeldShard{*dtype, *std::move(shape)};
    }
    absl::StatusOr<DeviceRecord> d = registry_.register_worker(registration, absl::Now());
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
    // The next call to this worker waits for the connection: the coordinator's channel may
    // still be backing off from the time the worker was unreachable (or gone).
    worker(d->address)->reached = false;
    reply->set_device_id(d->id);
    reply->set_incarnation(d->incarnation);
    reply->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(options_.heartbeat_interval));
    reply->set_epoch(registry_.epoch());
    return grpc::Status::OK;
  }

  grpc::Status Heartbeat(grpc::ServerContext* ctx, const pb::HeartbeatRequest* req, pb::HeartbeatReply*) override {
    absl::StatusOr<Caller> caller = auth_.require(*ctx, Role::kDaemon, "Heartbeat");
    if (!caller.ok()) return to_grpc(caller.status());
    return to_grpc(registry_.heartbeat(req->device_id(), req->epoch(), req->incarnation(), absl::Now()));
  }

  grpc::Status GetTopology(grpc::ServerContext* ctx, const pb::GetTopologyRequest* req, pb::Topology* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    if (req->min_alive_devices() > 0) {
      // Bounded by the caller's deadline too, and given up when the caller goes: an abandoned
      // wait must not hold a server thread.
      absl::Duration wait = absl::Milliseconds(std::clamp<int64_t>(req->wait_ms(), 0, 600'000));
      wait = std::min(wait, absl::FromChrono(ctx->deadline() - std::chrono::system_clock::now()));
      if (!wait_for_alive(*ctx, req->min_alive_devices(), wait)) {
        int alive = 0;
        std::vector<std::string> lost;
        for (const DeviceRecord& d : registry_.devices()) {
          if (d.alive) {
            ++alive;
          } else {
            lost.push_back(describe_device(d.id, d.address));
          }
        }
        return to_grpc(absl::DeadlineExceededError(
            absl::StrCat("waited ", absl::FormatDuration(wait), " for ", req->min_alive_devices(),
                         " alive devices but ", alive, " are alive",
                         lost.empty() ? std::string(" (no other device has registered)")
                                      : absl::StrCat("; lost: ", absl::StrJoin(lost, ", ")))));
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
    absl::StatusOr<std::map<int, std::vector<uint64_t>>> buffers =
        take_arrays(*caller, req->array_ids(), req->grants(), "DeleteArray");
    if (!buffers.ok()) return to_grpc(buffers.status());
    delete_buffers(*buffers);
    return grpc::Status::OK;
  }

  // Forgets the arrays `ids` (with their `grants`, in order; may be shorter) for a deletion by
  // `caller`, and returns their buffers by device, to be deleted there. PERMISSION_DENIED if
  // one is another session's (nothing is forgotten then); unknown ids are skipped.
  absl::StatusOr<std::map<int, std::vector<uint64_t>>> take_arrays(
      const Caller& caller, const google::protobuf::RepeatedField<uint64_t>& ids,
      const google::protobuf::RepeatedPtrField<std::string>& grants, absl::string_view method) {
    for (uint64_t id : ids) {
      absl::StatusOr<ArrayRecord> a = registry_.get_array(id);
      if (!a.ok()) continue;
      TESSERA_RETURN_IF_ERROR(check_owner(caller, *a, method, "delete"));
    }
    std::map<int, std::vector<uint64_t>> buffers =
        buffers_of(registry_.remove_arrays(std::vector<uint64_t>(ids.begin(), ids.end())));
    // Arrays of an earlier incarnation that nobody adopted: their buffers go too. Their owner
    // is unknown here, so they go with their grant (or for an admin); else the lease reaps them.
    std::vector<uint64_t> orphan_ids;
    for (int i = 0; i < ids.size(); ++i) {
      const std::string grant = i < grants.size() ? grants[i] : "";
      if (caller.at_least(Role::kAdmin) || auth_.check_grant(ids[i], grant, method).ok()) {
        orphan_ids.push_back(ids[i]);
      }
    }
    for (auto& [device, orphans] : registry_.remove_orphans(orphan_ids)) {
      buffers[device].insert(buffers[device].end(), orphans.begin(), orphans.end());
    }
    return buffers;
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
    std::vector<std::shared_ptr<Program>> unused = release_programs(lapsed.sessions);
    if (options_.log_registrations) {
      std::fprintf(stderr,
                   "tessera-coordinator: %zu sessions lapsed after %s without renewal; freeing %ld arrays, %zu "
                   "programs and %ld buffers of earlier incarnations nobody adopted\n",
                   lapsed.sessions.size(), absl::FormatDuration(registry_.lease()).c_str(),
                   static_cast<long>(lapsed.arrays), unused.size(), static_cast<long>(lapsed.orphans));
    }
    delete_buffers(lapsed.buffers);
    unload_plans(unused);
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
    absl::MutexLock lock(&programs_mu_);
    reply->set_compilations(compilations_);
    if (span) {
      span.arg("executable", absl::StrCat((*program)->id));
      span.arg("compilations", absl::StrCat(compilations_));
    }
    return grpc::Status::OK;
  }

  // One call of a session, by the client's call id (0: a call no other names).
  struct CallKey {
    uint64_t session = 0;
    uint64_t call = 0;
    bool operator==(const CallKey& o) const { return session == o.session && call == o.call; }
    template <typename H>
    friend H AbslHashValue(H h, const CallKey& k) {
      return H::combine(std::move(h), k.session, k.call);
    }
  };
  // How a call ended: OK with its outputs' ids, or its error.
  struct CallOutcome {
    absl::Status status;
    std::vector<uint64_t> outputs;
  };

 private:
  struct Execution;
  // Called once a named call is checked and about to run (`running`), or has failed before
  // (`outcome`): exactly one of them is set.
  using CallWaiter = std::function<void(const CallOutcome* outcome, const std::shared_ptr<Execution>& running)>;
  // A call others name: awaited (named before it arrived), arrived, running, or finished.
  struct CallEntry {
    bool arrived = false;
    absl::Time awaited_until = absl::InfiniteFuture();  // while not arrived
    std::shared_ptr<Execution> running;                 // from its checks to its end
    std::optional<CallOutcome> outcome;
    std::vector<CallWaiter> waiters;  // until it runs or ends
  };

 public:
  // Callback API: the RunPlan fan-out is asynchronous and the reply goes from the last
  // worker's answer, on the thread that received it: no server thread waits for the workers,
  // and none has to be woken to answer (each hand-off is a context switch on this machine).
  // The first call of a program on a device loads its plan first, on a thread of its own. A
  // call naming outputs of calls still in flight (pending_inputs) is sent to the workers as
  // soon as those calls' runs were (each worker runs it after them, in stream order): neither
  // the client nor the coordinator waits for them to finish.
  grpc::ServerUnaryReactor* Execute(grpc::CallbackServerContext* ctx, const pb::ExecuteRequest* req,
                                    pb::ExecuteReply* reply) override {
    // What this thread does for the call: its checks and, unless it waits for producers or
    // plans to load, handing the runs to the workers' streams.
    ProfileSpan span(&profile_, "dispatch", [] { return std::string("execute"); });
    span.arg("executable", absl::StrCat(req->executable_id()));
    span.arg("call", absl::StrCat(req->call_id()));
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    absl::StatusOr<uint64_t> session =
        caller.ok() ? acting_session(*caller, req->session_id(), "execute") : caller.status();
    if (!session.ok()) {
      reactor->Finish(to_grpc(session.status()));
      return reactor;
    }
    // The client's deletions riding on this call: done whatever becomes of the call.
    absl::StatusOr<std::map<int, std::vector<uint64_t>>> frees =
        take_arrays(*caller, req->delete_arrays(), req->delete_grants(), "execute: delete_arrays");
    if (!frees.ok()) {
      reactor->Finish(to_grpc(frees.status()));
      return reactor;
    }
    const CallKey key{*session, req->call_id()};
    absl::Status arrived = arrive_call(key);
    if (!arrived.ok()) {
      delete_buffers(*frees, /*wait=*/false);
      reactor->Finish(to_grpc(arrived));  // not recorded: the call id is another call's
      return reactor;
    }
    if (req->pending_inputs_size() == 0) {
      start_execution(key, *caller, *req, reactor, reply, {}, *std::move(frees));
    } else {
      // Not kept while the call waits for its producers: nothing reads these buffers.
      delete_buffers(*frees, /*wait=*/false);
      await_producers(key, *caller, req, reactor, reply);
    }
    return reactor;
  }

  // Checks `req` and runs it (its inputs all exist, or are outputs of `producers`, whose runs
  // were sent): the reply goes when every device answered, or at once with an error. Never
  // blocks.
  // `frees` are buffers to delete by device (arrays the client dropped): they ride on the runs
  // when every device holding one is a member, and are deleted on their own otherwise.
  void start_execution(const CallKey& key, const Caller& caller, const pb::ExecuteRequest& req,
                       grpc::ServerUnaryReactor* reactor, pb::ExecuteReply* reply,
                       std::vector<std::pair<int, std::shared_ptr<Execution>>> producers = {},
                       std::map<int, std::vector<uint64_t>> frees = {}) {
    absl::StatusOr<std::shared_ptr<Execution>> e = prepare_execution(req, caller, reactor, reply);
    if (!e.ok()) {
      delete_buffers(frees, /*wait=*/false);
      complete_call(key, e.status(), {});
      reactor->Finish(to_grpc(e.status()));
      return;
    }
    (*e)->call = key;
    (*e)->producers = std::move(producers);
    publish_running(key, *e);
    if (missing_plans(*(*e)->program, (*e)->members).empty()) {
      bool ride = true;
      for (const auto& [device, ids] : frees) {
        bool member = false;
        for (const pb::PeerAddress& p : (*e)->members.peers) member = member || p.device_id() == device;
        ride = ride && member;
      }
      if (ride) {
        std::set<uint64_t> ids;
        for (const auto& [device, buffers] : frees) ids.insert(buffers.begin(), buffers.end());
        for (uint64_t id : ids) (*e)->request.add_free_buffers(id);
        (*e)->frees = std::move(frees);
      } else {
        delete_buffers(frees, /*wait=*/false);
      }
      run_plans(*std::move(e));
      return;
    }
    delete_buffers(frees, /*wait=*/false);
    // Loading waits for the workers: on a thread of the pool, never this one. The server
    // waits for Finish before it goes, and the pool's destructor for the thread.
    std::shared_ptr<Execution> execution = *std::move(e);
    absl::Status started = plan_loads_.run([this, execution] {
      absl::Status loaded = load_plans(*execution->program, execution->members, execution->workers);
      if (loaded.ok()) {
        run_plans(execution);
      } else {
        fail_execution(*execution, loaded);
      }
    });
    if (!started.ok())
      fail_execution(*execution, absl::Status(started.code(), absl::StrCat("execute: ", started.message())));
  }

  // Records that call `key` reached the coordinator. INVALID_ARGUMENT if the session used its
  // id already (for a call that is not being retried), RESOURCE_EXHAUSTED past kMaxCalls.
  absl::Status arrive_call(const CallKey& key) {
    if (key.call == 0) return absl::OkStatus();
    absl::MutexLock lock(&calls_mu_);
    auto it = calls_.find(key);
    if (it == calls_.end()) {
      if (calls_.size() >= kMaxCalls) {
        return absl::ResourceExhaustedError(absl::StrCat("execute: ", kMaxCalls,
                                                         " calls named by call id are in flight or awaited; call ",
                                                         key.call, " is one too many"));
      }
      calls_[key].arrived = true;
      return absl::OkStatus();
    }
    if (it->second.arrived || it->second.outcome.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("execute: call id ", key.call, " was used already by session ",
                                                     key.session, "; each call of a session needs an id of its own"));
    }
    it->second.arrived = true;  // awaited by calls that came first
    --awaited_calls_;
    return absl::OkStatus();
  }

  // Call `key` ended with `status` (and these outputs): the calls waiting for it go on. One
  // that failed ABORTED (an earlier coordinator's program, or one out of the cache) is sent
  // again by the client under the same id: its consumers wait for that.
  void complete_call(const CallKey& key, const absl::Status& status, std::vector<uint64_t> outputs) {
    if (key.call == 0) return;
    std::vector<CallWaiter> waiters;
    CallOutcome outcome{status, std::move(outputs)};
    {
      absl::MutexLock lock(&calls_mu_);
      auto it = calls_.find(key);
      if (it == calls_.end()) return;
      CallEntry& entry = it->second;
      if (status.code() == absl::StatusCode::kAborted) {
        if (entry.waiters.empty()) {
          calls_.erase(it);
        } else {
          entry.arrived = false;
          entry.awaited_until = absl::Now() + kProducerArrival;
          ++awaited_calls_;
        }
        return;
      }
      entry.outcome = outcome;
      entry.running = nullptr;
      waiters.swap(entry.waiters);
      remembered_.push_back(key);
      while (remembered_.size() > kMaxRememberedCalls) {
        calls_.erase(remembered_.front());
        remembered_.pop_front();
      }
    }
    for (auto& w : waiters) w(&outcome, nullptr);
  }

  // Call `key` passed its checks as `e`: the calls waiting for it are sent after it.
  void publish_running(const CallKey& key, const std::shared_ptr<Execution>& e) {
    if (key.call == 0) return;
    std::vector<CallWaiter> waiters;
    {
      absl::MutexLock lock(&calls_mu_);
      auto it = calls_.find(key);
      if (it == calls_.end()) return;
      it->second.running = e;
      waiters.swap(it->second.waiters);
    }
    for (auto& w : waiters) w(nullptr, e);
  }

  // Every tick of the monitor: calls awaited longer than kProducerArrival fail their waiters.
  void expire_awaited_calls() {
    std::vector<std::pair<CallKey, std::vector<CallWaiter>>> expired;
    const absl::Time now = absl::Now();
    {
      absl::MutexLock lock(&calls_mu_);
      for (auto it = calls_.begin(); it != calls_.end();) {
        if (it->second.arrived || it->second.outcome.has_value() || now < it->second.awaited_until) {
          ++it;
          continue;
        }
        expired.emplace_back(it->first, std::move(it->second.waiters));
        --awaited_calls_;
        calls_.erase(it++);
      }
    }
    for (auto& [key, waiters] : expired) {
      CallOutcome outcome{absl::DeadlineExceededError(absl::StrCat("call ", key.call, " of session ", key.session,
                                                                   " did not reach the coordinator within ",
                                                                   absl::FormatDuration(kProducerArrival))),
                          {}};
      for (auto& w : waiters) w(&outcome, nullptr);
    }
  }

  // A call waiting for the producers its pending_inputs name.
  struct ProducerWait {
    CallKey key;
    Caller caller;
    pb::ExecuteRequest request;  // a copy, its pending inputs filled in as they finish
    grpc::ServerUnaryReactor* reactor = nullptr;
    pb::ExecuteReply* reply = nullptr;
    std::atomic<int> pending{0};
    absl::Mutex mu;
    absl::Status failure ABSL_GUARDED_BY(mu);  // the first producer's error
    std::vector<std::pair<int, std::shared_ptr<Execution>>> producers ABSL_GUARDED_BY(mu);  // running, by input
  };

  // Registers `req`'s wait for its producers; the last to finish starts it (or fails it with
  // the first failure). Never blocks.
  void await_producers(const CallKey& key, const Caller& caller, const pb::ExecuteRequest* req,
                       grpc::ServerUnaryReactor* reactor, pb::ExecuteReply* reply) {
    const uint64_t epoch = registry_.epoch();
    if (req->epoch() != 0 && req->epoch() != epoch) {
      // The producers ran under an earlier coordinator: nothing here is theirs.
      absl::Status aborted = absl::AbortedError(
          absl::StrCat("execute: executable ", req->executable_id(), " was compiled by coordinator epoch ",
                       req->epoch(), " but this is epoch ", epoch, " (the coordinator restarted); compile again"));
      complete_call(key, aborted, {});
      reactor->Finish(to_grpc(aborted));
      return;
    }
    auto wait = std::make_shared<ProducerWait>();
    wait->key = key;
    wait->caller = caller;
    wait->request = *req;
    wait->reactor = reactor;
    wait->reply = reply;
    const int n = req->pending_inputs_size();
    wait->pending.store(n + 1);  // one for this function
    auto one_done = [this, wait] {
      if (wait->pending.fetch_sub(1) != 1) return;
      absl::Status failure;
      std::vector<std::pair<int, std::shared_ptr<Execution>>> producers;
      {
        absl::MutexLock lock(&wait->mu);
        failure = wait->failure;
        producers.swap(wait->producers);
      }
      if (!failure.ok()) {
        complete_call(wait->key, failure, {});
        wait->reactor->Finish(to_grpc(failure));
        return;
      }
      start_execution(wait->key, wait->caller, wait->request, wait->reactor, wait->reply, std::move(producers));
    };
    auto fail = [wait](absl::Status status) {
      absl::MutexLock lock(&wait->mu);
      if (wait->failure.ok()) wait->failure = std::move(status);
    };
    for (int k = 0; k < n; ++k) {
      const pb::CallOutput& p = req->pending_inputs(k);
      if (p.input() < 0 || p.input() >= req->input_arrays_size() || req->input_arrays(p.input()) != 0 ||
          p.call_id() == 0 || p.call_id() == key.call || p.output() < 0) {
        fail(absl::InvalidArgumentError(absl::StrCat(
            "execute: pending input ", k, " (input ", p.input(), ", call ", p.call_id(), ", output ", p.output(),
            ") must name one of the ", req->input_arrays_size(), " inputs left 0, and an output of another call")));
        one_done();
        continue;
      }
      // The producer ended (outcome) or runs: then this is sent after its runs were.
      auto resolve = [wait, p, fail, one_done](const CallOutcome* outcome, const std::shared_ptr<Execution>& running) {
        auto take = [wait, p, fail, one_done](const absl::Status& status, const std::vector<uint64_t>& outputs,
                                              std::shared_ptr<Execution> producer) {
          if (!status.ok()) {
            fail(absl::Status(status.code(), absl::StrCat("execute: input ", p.input(),
                                                          " is an output of a failed call: ", status.message())));
          } else if (p.output() >= static_cast<int>(outputs.size())) {
            fail(absl::InvalidArgumentError(absl::StrCat("execute: input ", p.input(), " names output ", p.output(),
                                                         " of call ", p.call_id(), ", which has ", outputs.size())));
          } else {
            absl::MutexLock lock(&wait->mu);
            wait->request.set_input_arrays(p.input(), outputs[p.output()]);
            if (producer != nullptr) wait->producers.emplace_back(p.input(), std::move(producer));
          }
          one_done();
        };
        if (outcome != nullptr) {
          take(outcome->status, outcome->outputs, nullptr);
          return;
        }
        when_sent(*running, [take, running] {
          const absl::Status failed = failed_before_finish(*running);
          take(failed, running->output_ids, failed.ok() ? running : nullptr);
        });
      };
      std::optional<CallOutcome> known;
      std::shared_ptr<Execution> running;
      absl::Status refused;
      {
        absl::MutexLock lock(&calls_mu_);
        const CallKey producer{key.session, p.call_id()};
        auto it = calls_.find(producer);
        if (it != calls_.end() && it->second.outcome.has_value()) {
          known = it->second.outcome;
        } else if (it != calls_.end() && it->second.running != nullptr) {
          running = it->second.running;
        } else if (it == calls_.end() && (awaited_calls_ >= kMaxAwaitedCalls || calls_.size() >= kMaxCalls)) {
          refused = absl::ResourceExhaustedError(
              absl::StrCat("execute: input ", p.input(), " names call ", p.call_id(), ", which has not arrived, and ",
                           awaited_calls_, " such calls are awaited already (at most ", kMaxAwaitedCalls, ")"));
        } else {
          CallEntry& entry = calls_[producer];
          if (it == calls_.end()) {
            entry.awaited_until = absl::Now() + kProducerArrival;
            ++awaited_calls_;
          }
          entry.waiters.push_back(resolve);
        }
      }
      if (known.has_value()) {
        resolve(&*known, nullptr);
      } else if (running != nullptr) {
        resolve(nullptr, running);
      } else if (!refused.ok()) {
        fail(refused);
        one_done();
      }
    }
    one_done();
  }

  // Every tick of the monitor: an execution with a member lost (or registered anew) meanwhile
  // is cancelled and fails naming it, as fan_out's watch does; one with a failed member
  // cancels the rest kFailureGrace after the failure.
  void watch_executions() {
    std::vector<std::shared_ptr<Execution>> running;
    {
      absl::MutexLock lock(&executions_mu_);
      for (const auto& [id, e] : executions_) running.push_back(e);
    }
    const absl::Time now = absl::Now();
    for (const std::shared_ptr<Execution>& e : running) {
      const int lost = changed_member(e->members);
      const bool late = now > e->deadline;
      {
        absl::MutexLock lock(&e->mu);
        // Not before every run is sent: a cancel would miss the runs sent after it.
        if (!e->sent || e->cancelled || (lost < 0 && !late && now - e->first_failure < kFailureGrace)) continue;
        e->cancelled = true;
        e->lost = lost;
      }
      // Outside the lock: a cancelled run completes on this thread.
      const grpc::Status status =
          lost < 0 && late ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                                          absl::StrCat("no result within ", absl::FormatDuration(run_wait(*e))))
                           : grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      for (const std::shared_ptr<PlanStream>& stream : e->streams) {
        if (stream != nullptr) stream->cancel(e->id, status);
      }
    }
  }

  // Ends every RunPlans stream, waiting (bounded) for gRPC to be done with each: after the
  // server stopped, before the service goes.
  void close_plan_streams() {
    std::vector<std::shared_ptr<PlanStream>> streams;
    {
      absl::MutexLock lock(&stubs_mu_);
      for (auto& [address, w] : workers_) {
        absl::MutexLock stream_lock(&w->mu);
        if (w->plans != nullptr) streams.push_back(std::move(w->plans));
      }
    }
    for (const std::shared_ptr<PlanStream>& s : streams) s->close(absl::Seconds(2));
    // The calls nobody waited for end by their deadline (kConnectDeadline): their callbacks
    // use this service.
    absl::MutexLock lock(&async_mu_);
    auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(async_mu_) { return async_calls_ == 0; };
    async_mu_.AwaitWithTimeout(absl::Condition(&none), kConnectDeadline + absl::Seconds(1));
  }

  grpc::Status RunCollective(grpc::ServerContext* ctx, const pb::RunCollectiveRequest* req,
                             pb::RunCollectiveReply* reply) override {
    absl::StatusOr<Caller> caller = auth_.authenticate(*ctx);
    if (!caller.ok()) return to_grpc(caller.status());
    int64_t collective_ns = 0;
    absl::StatusOr<ArrayRecord> out = run_collective(*req, *caller, &collective_ns);
    if (!out.ok()) return to_grpc(out.status());
    reply->set_collective_ns(collective_ns);
    to_proto(*out, reply->mutable_result());
    reply->mutable_result()->set_grant(auth_.grant(out->id));
    return grpc::Status::OK;
  }

  // The coordinator's metrics (core/metrics.h), from what it counts anyway.
  std::vector<MetricSample> metrics() {
    int64_t alive = 0, devices = 0, compilations = 0, programs = 0, evictions = 0, again = 0, lost = 0;
    for (const DeviceRecord& d : registry_.devices()) {
      ++devices;
      alive += d.alive ? 1 : 0;
      again += static_cast<int64_t>(d.incarnation) - 1;
      lost += static_cast<int64_t>(d.times_lost);
    }
    {
      absl::MutexLock lock(&programs_mu_);
      compilations = compilations_;
      evictions = evictions_;
      programs = static_cast<int64_t>(programs_.size());
    }
    const auto arrays = static_cast<double>(registry_.array_count());
    const char* const kExecutions = "Executions answered, by result.";
    const char* const kRegistrations =
        "Worker registrations: a device's first, and again (the same worker back, or a new process under its name).";
    return {
        gauge("tessera_coordinator_devices", "Devices registered (alive or lost).", devices),
        gauge("tessera_coordinator_devices_alive", "Devices alive.", alive),
        counter("tessera_coordinator_registrations_total", kRegistrations, devices, {{"kind", "first"}}),
        counter("tessera_coordinator_registrations_total", kRegistrations, again, {{"kind", "again"}}),
        counter("tessera_coordinator_devices_lost_total", "Times a device was marked lost (missed heartbeats).", lost),
        gauge("tessera_coordinator_arrays", "Arrays the coordinator knows.", arrays),
        gauge("tessera_coordinator_programs", "Compiled programs held.", programs),
        counter("tessera_coordinator_compilations_total", "Programs compiled.", compilations),
        counter("tessera_coordinator_compile_cache_hits_total", "Compile requests answered from the cache.",
                cache_hits_.load()),
        counter("tessera_coordinator_compile_cache_evictions_total",
                "Programs evicted from the cache (least recently used, beyond --max_programs).", evictions),
        counter("tessera_coordinator_executions_total", kExecutions, executions_ok_.load(), {{"result", "ok"}}),
        counter("tessera_coordinator_executions_total", kExecutions, executions_failed_.load(), {{"result", "error"}}),
        gauge("tessera_coordinator_uptime_seconds", "Since the process started.",
              absl::ToDoubleSeconds(absl::Now() - started_)),
    };
  }
  std::vector<const LatencyHistogram*> histograms() const { return {&compile_seconds_, &execute_seconds_}; }

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
    const absl::Duration timeout = req->stats_timeout_ms() > 0
                                       ? absl::Milliseconds(std::min<int64_t>(req->stats_timeout_ms(), 60'000))
                                       : absl::Seconds(2);
    std::vector<DeviceRecord> devices = registry_.devices();
    std::vector<WorkerChannel*> workers;
    std::vector<pb::DeviceStatus*> asked;
    for (const DeviceRecord& d : devices) {
      pb::DeviceStatus* status = reply->add_devices();
      to_proto(d, status->mutable_info());
      if (!d.alive) continue;
      workers.push_back(worker(d.address));
      asked.push_back(status);
    }
    const pb::GetStatsRequest stats_request;
    std::vector<grpc::Status> statuses = fan_out(workers, timeout, [&](int i, grpc::ClientContext* ctx, auto done) {
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
    absl::MutexLock lock(&programs_mu_);
    reply->set_compilations(compilations_);
    reply->set_programs_evicted(evictions_);
    for (const auto& [id, program] : programs_) {
      if (!everything && program->sessions.count(caller->session) == 0) continue;
      if (bytes > kMaxStatusBytes) {
        reply->set_executables_omitted(reply->executables_omitted() + 1);
        continue;
      }
      pb::ExecutableInfo* info = reply->add_executables();
      info->set_executable_id(id);
      tessera::to_proto(program->exe.mesh, info->mutable_mesh());
      for (const PartitionSpec& spec : program->exe.input_specs) to_proto(spec, info->add_input_specs());
      for (const PartitionSpec& spec : program->exe.output_specs) to_proto(spec, info->add_output_specs());
      info->set_graph_nodes(static_cast<int64_t>(program->graph.size()));
      info->set_executions(program->executions.load());
      bytes += info->ByteSizeLong() + 8;
    }
    return grpc::Status::OK;
  }

 private:
  // Whether `n` devices are alive within `wait`; false early if the caller cancelled.
  bool wait_for_alive(const grpc::ServerContextBase& ctx, int n, absl::Duration wait) const {
    const absl::Time deadline = absl::Now() + wait;
    while (!registry_.wait_for_alive(n, std::min(deadline - absl::Now(), kCancelCheck))) {
      if (absl::Now() >= deadline || ctx.IsCancelled()) return false;
    }
    return true;
  }

  // The session a request acts for: a client's own (proved by its session credential), which
  // a session id in the request must match; an admin or a daemon may name any (0: none).
  // UNAUTHENTICATED as Authenticator::authenticate; PERMISSION_DENIED naming `method` for a
  // client without a session credential or naming another session.
  absl::StatusOr<uint64_t> acting_session(const grpc::ServerContextBase& ctx, uint64_t requested,
                                          absl::string_view method) const {
    TESSERA_ASSIGN_OR_RETURN(Caller caller, auth_.authenticate(ctx));
    return acting_session(caller, requested, method);
  }
  static absl::StatusOr<uint64_t> acting_session(const Caller& caller, uint64_t requested, absl::string_view method) {
    if (caller.at_least(Role::kAdmin)) return requested;
    if (caller.session == 0) {
      return absl::PermissionDeniedError(absl::StrCat(
          method, ": a client acts for its session; send the credential OpenSession handed out ('tessera-session')"));
    }
    if (requested != 0 && requested != caller.session) {
      return absl::PermissionDeniedError(absl::StrCat(method, ": session ", requested,
                                                      " is not the caller's (its credential is session ",
                                                      caller.session, "); a client acts only for its own session"));
    }
    return caller.session;
  }

  // OK if `caller` may act on array `a`: its owner's session, or an admin. PERMISSION_DENIED
  // naming the array and the rule otherwise.
  static absl::Status check_owner(const Caller& caller, const ArrayRecord& a, absl::string_view method,
                                  absl::string_view action) {
    if (caller.at_least(Role::kAdmin) || (a.session != 0 && a.session == caller.session)) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(method, ": array ", a.id, " belongs to another session; only ",
                                                    "its owner (or an admin credential) may ", action, " it"));
  }

  // A compiled program and the devices that have its plan loaded. A plan carries the address
  // of every device of the program, so each device's entry is the incarnations of all of
  // them when it got the plan: a worker that restarted has lost its plans, and the others
  // know it under an old address (an address changes only with a new incarnation).
  struct Program {
    Program(Graph g, Executable e) : graph(std::move(g)), exe(std::move(e)) {
      // Each device resolves the one program into a plan of as many instructions (and loops).
      op_span = std::max<uint64_t>(op_span, plan_op_span(exe.program));
    }
    uint64_t id = 0;
    Graph graph;
    Executable exe;
    // Ids an execution takes: its own, and one per instruction for the op ids of its
    // collectives (worker/interpreter.h's plan_op_id).
    uint64_t op_span = 1;
    absl::Mutex mu;
    std::map<int, std::vector<uint64_t>> loaded ABSL_GUARDED_BY(mu);
    std::atomic<int64_t> executions{0};
    // Guarded by programs_mu_: the sessions that compiled it (it is freed when the last
    // lapses); its compile_key; when it was last compiled or executed (a tick of use_ticks_,
    // for the cache's LRU order); the executions using it (it is not evicted while any runs).
    std::set<uint64_t> sessions;
    std::string key;
    uint64_t last_used = 0;
    int running = 0;
  };

  // Keeps a program out of eviction while an execution uses it (until destroyed).
  class ProgramUse {
   public:
    // REQUIRES: programs_mu_ held.
    ProgramUse(CoordinatorService* service, Program* program) : service_(service), program_(program) {
      ++program_->running;
    }
    ~ProgramUse() {
      absl::MutexLock lock(&service_->programs_mu_);
      --program_->running;
    }
    ProgramUse(const ProgramUse&) = delete;
    ProgramUse& operator=(const ProgramUse&) = delete;

   private:
    CoordinatorService* const service_;
    Program* const program_;
  };

  // The devices of one fan-out, in order: where to reach each and which incarnation of it.
  struct Members {
    std::vector<pb::PeerAddress> peers;
    std::vector<uint64_t> incarnations;
  };

  // One Execute between its checks and its reply: its outputs' records and the run on each
  // device.
  struct Execution {
    uint64_t id = 0;
    CallKey call;  // the client's call, if others name it
    // The running calls whose outputs are inputs (by input index): this call's runs go after
    // theirs on every stream, and its reply waits for their outcome (a failed one fails this).
    std::vector<std::pair<int, std::shared_ptr<Execution>>> producers;
    // The buffers request.free_buffers deletes, by device (for a member with no stream).
    std::map<int, std::vector<uint64_t>> frees;
    grpc::ServerUnaryReactor* reactor = nullptr;
    pb::ExecuteReply* reply = nullptr;
    std::shared_ptr<Program> program;
    std::unique_ptr<ProgramUse> use;  // before `program` goes
    Members members;
    std::vector<WorkerChannel*> workers;
    std::vector<uint64_t> output_ids;
    std::vector<ArrayRecord> outputs;
    pb::RunPlanRequest request;                        // the same for every member
    std::vector<std::shared_ptr<PlanStream>> streams;  // set by run_plans
    absl::Time deadline = absl::InfiniteFuture();      // past it, the monitor fails the call
    absl::Time started = absl::Now();
    absl::Mutex mu;
    std::vector<grpc::Status> statuses ABSL_GUARDED_BY(mu);
    int done ABSL_GUARDED_BY(mu) = 0;
    absl::Time first_failure ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();
    bool cancelled ABSL_GUARDED_BY(mu) = false;
    bool sent ABSL_GUARDED_BY(mu) = false;      // every run handed to its stream
    int lost ABSL_GUARDED_BY(mu) = -1;          // the member that was lost meanwhile, if any
    bool finished ABSL_GUARDED_BY(mu) = false;  // answered; `outcome` is how
    absl::Status outcome ABSL_GUARDED_BY(mu);
    absl::Status producer_failure;  // set before the reply is made, if a producer failed
    // What waits for `sent` (or an end before it) and for the end.
    std::vector<std::function<void()>> on_sent ABSL_GUARDED_BY(mu);
    std::vector<std::function<void()>> on_finished ABSL_GUARDED_BY(mu);
  };

  // Runs `f` once every run of `e` is handed to its stream, or `e` ended before: at once, on
  // this thread, if so. `f` must not block.
  static void when_sent(Execution& e, std::function<void()> f) {
    {
      absl::MutexLock lock(&e.mu);
      if (!e.sent && !e.finished) {
        e.on_sent.push_back(std::move(f));
        return;
      }
    }
    f();
  }
  // Runs `f` once `e` ended (as when_sent).
  static void when_finished(Execution& e, std::function<void()> f) {
    {
      absl::MutexLock lock(&e.mu);
      if (!e.finished) {
        e.on_finished.push_back(std::move(f));
        return;
      }
    }
    f();
  }
  // The error `e` ended with before its runs were all sent; OK otherwise.
  static absl::Status failed_before_finish(Execution& e) {
    absl::MutexLock lock(&e.mu);
    return e.finished ? e.outcome : absl::OkStatus();
  }
  // `e` ended with `outcome`: what waited for it goes on.
  static void settle(Execution& e, const absl::Status& outcome) {
    std::vector<std::function<void()>> waiting;
    {
      absl::MutexLock lock(&e.mu);
      e.finished = true;
      e.outcome = outcome;
      waiting.swap(e.on_sent);
      for (auto& f : e.on_finished) waiting.push_back(std::move(f));
      e.on_finished.clear();
    }
    for (auto& f : waiting) f();
  }

  // The index of the first of `members` that is lost or has registered anew since; -1 if none.
  int changed_member(const Members& members) const {
    for (size_t i = 0; i < members.peers.size(); ++i) {
      std::optional<DeviceRecord> d = registry_.device(members.peers[i].device_id());
      if (!d || !d->alive || d->incarnation != members.incarnations[i]) return static_cast<int>(i);
    }
    return -1;
  }

  // The devices `ids`, all alive; UNAVAILABLE naming the first that is lost.
  absl::StatusOr<Members> alive_members(const std::vector<int>& ids, const std::string& what) const {
    Members members;
    for (int d : ids) {
      std::optional<DeviceRecord> device = registry_.device(d);
      if (!device.has_value() || !device->alive) {
        return absl::UnavailableError(
            absl::StrCat(what, ": ", describe_device(d, device ? device->address : "?"), " is lost"));
      }
      pb::PeerAddress peer;
      peer.set_device_id(d);
      peer.set_address(device->address);
      members.peers.push_back(std::move(peer));
      members.incarnations.push_back(device->incarnation);
    }
    return members;
  }

  // FAILED_PRECONDITION when a device of `a` restarted since the array was placed: that
  // shard is gone, and the array must be put again.
  absl::Status check_not_lost(const ArrayRecord& a, const std::string& what) const {
    if (a.lost_devices.empty()) return absl::OkStatus();
    const int d = *a.lost_devices.begin();
    std::optional<DeviceRecord> device = registry_.device(d);
    return absl::FailedPreconditionError(absl::StrCat(what, ": array ", a.id, " lost its shard on ",
                                                      describe_device(d, device ? device->address : "?"),
                                                      " when that worker restarted; put the array again"));
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
    {
      absl::MutexLock lock(&programs_mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) {
        cache_hits_.fetch_add(1);
        return hold_locked(programs_[it->second], session);
      }
    }
    const absl::Time compile_start = absl::Now();
    TESSERA_ASSIGN_OR_RETURN(Propagation propagation, propagate(graph, mesh, inputs, outputs));
    TESSERA_ASSIGN_OR_RETURN(Executable exe, partition(graph, mesh, propagation, outputs, donated));
    compile_seconds_.observe(absl::Now() - compile_start);
    auto program = std::make_shared<Program>(std::move(graph), std::move(exe));
    std::vector<std::shared_ptr<Program>> evicted;
    {
      absl::MutexLock lock(&programs_mu_);
      auto it = cache_.find(key);
      if (it != cache_.end()) return hold_locked(programs_[it->second], session);  // compiled concurrently
      program->id = registry_.ids().next();
      ++compilations_;
      program->key = key;
      cache_[std::move(key)] = program->id;
      programs_[program->id] = program;
      hold_locked(program, session);
      evicted = evict_locked();
    }
    unload_plans(evicted, /*wait=*/false);
    return program;
  }

  // The least recently used programs beyond max_programs that no execution uses, forgotten;
  // their plans are the workers' to drop.
  std::vector<std::shared_ptr<Program>> evict_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(programs_mu_) {
    std::vector<std::shared_ptr<Program>> evicted;
    const size_t limit = static_cast<size_t>(std::max(1, options_.max_programs));
    while (programs_.size() > limit) {
      auto oldest = programs_.end();
      for (auto it = programs_.begin(); it != programs_.end(); ++it) {
        if (it->second->running == 0 &&
            (oldest == programs_.end() || it->second->last_used < oldest->second->last_used)) {
          oldest = it;
        }
      }
      if (oldest == programs_.end()) break;  // every one is running: over the bound until they end
      cache_.erase(oldest->second->key);
      evicted.push_back(std::move(oldest->second));
      programs_.erase(oldest);
      ++evictions_;
    }
    return evicted;
  }

  // `session` (0: none) holds `program` from now on.
  std::shared_ptr<Program> hold_locked(std::shared_ptr<Program> program, uint64_t session)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(programs_mu_) {
    if (session != 0) program->sessions.insert(session);
    program->last_used = ++use_ticks_;
    return program;
  }

  // Checks an Execute request against its program and creates its outputs' records.
  // `caller` must hold the program (it compiled it) and own the inputs, unless an admin.
  absl::StatusOr<std::shared_ptr<Execution>> prepare_execution(const pb::ExecuteRequest& req, const Caller& caller,
                                                               grpc::ServerUnaryReactor* reactor,
                                                               pb::ExecuteReply* reply) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t session, acting_session(caller, req.session_id(), "execute"));
    std::shared_ptr<Program> program;
    std::unique_ptr<ProgramUse> use;
    const uint64_t epoch = registry_.epoch();
    if (req.epoch() != 0 && req.epoch() != epoch) {
      return absl::AbortedError(absl::StrCat("execute: executable ", req.executable_id(),
                                             " was compiled by coordinator epoch ", req.epoch(), " but this is epoch ",
                                             epoch, " (the coordinator restarted); compile again"));
    }
    {
      absl::MutexLock lock(&programs_mu_);
      auto it = programs_.find(req.executable_id());
      if (it == programs_.end()) {
        if (registry_.ids().before_epoch(req.executable_id())) {
          return absl::AbortedError(absl::StrCat("execute: executable ", req.executable_id(),
                                                 " belongs to an earlier incarnation of the coordinator, which "
                                                 "restarted since; compile again"));
        }
        // Evicted from the compile cache, or released with the last session holding it: the
        // client compiles it again (the SDK does so by itself on ABORTED).
        return absl::AbortedError(absl::StrCat("execute: executable ", req.executable_id(),
                                               " is not in the compile cache (it holds the ", options_.max_programs,
                                               " most recently used programs, --max_programs); compile again"));
      }
      program = it->second;
      program->last_used = ++use_ticks_;
      use = std::make_unique<ProgramUse>(this, program.get());
      if (!caller.at_least(Role::kAdmin) && program->sessions.count(caller.session) == 0) {
        return absl::PermissionDeniedError(absl::StrCat("execute: executable ", req.executable_id(),
                                                        " was compiled by another session; a client runs only the "
                                                        "programs its own session compiled (Compile it first)"));
      }
    }
    TESSERA_ASSIGN_OR_RETURN(const absl::Duration timeout, run_timeout("execute", req.timeout_ms()));
    const Graph& graph = program->graph;
    const Executable& exe = program->exe;
    if (req.input_arrays_size() != static_cast<int>(graph.parameters().size())) {
      return absl::InvalidArgumentError(absl::StrCat("execute: the program takes ", graph.parameters().size(),
                                                     " inputs, got ", req.input_arrays_size()));
    }
    std::vector<uint64_t> input_ids;
    for (int i = 0; i < req.input_arrays_size(); ++i) {
      TESSERA_ASSIGN_OR_RETURN(ArrayRecord a, registry_.get_array(req.input_arrays(i)));
      TESSERA_RETURN_IF_ERROR(check_owner(caller, a, absl::StrCat("execute: input ", i), "read"));
      const Node& p = graph.node(graph.parameters()[i]);
      if (a.dtype != p.dtype || a.shape != p.shape) {
        return absl::InvalidArgumentError(absl::StrCat("execute: input ", i, " is ", type_to_string(a.dtype, a.shape),
                                                       " but the program takes ", type_to_string(p.dtype, p.shape)));
      }
      // The same layout (P('x') is P('x', None) for a matrix), not the same spec as written.
      if (!a.sharding.is_equivalent_to(NamedSharding(exe.mesh, exe.input_specs[i]), static_cast<int>(a.shape.size()))) {
        return absl::InvalidArgumentError(absl::StrCat("execute: input ", i, " is laid out as ", a.sharding.to_string(),
                                                       " but the program was compiled for ",
                                                       NamedSharding(exe.mesh, exe.input_specs[i]).to_string()));
      }
      TESSERA_RETURN_IF_ERROR(check_not_lost(a, absl::StrCat("execute: input ", i)));
      input_ids.push_back(a.id);
    }
    TESSERA_ASSIGN_OR_RETURN(Members members, alive_members(exe.mesh.device_ids(), "execute"));
    auto e = std::make_shared<Execution>();
    for (size_t i = 0; i < graph.outputs().size(); ++i) {
      const Node& o = graph.node(graph.outputs()[i]);
      absl::StatusOr<uint64_t> id =
          registry_.create_array(o.dtype, o.shape, NamedSharding(exe.mesh, exe.output_specs[i]), session);
      if (!id.ok()) {
        registry_.remove_arrays(e->output_ids);  // nothing ran: no device holds them yet
        return id.status();
      }
      e->output_ids.push_back(*id);
      e->outputs.push_back(*registry_.get_array(*id));
    }
    const size_t n = members.peers.size();
    e->id = registry_.ids().next(program->op_span + 1);
    pb::RunPlanRequest& r = e->request;
    r.set_execution_id(e->id);
    r.set_plan_id(program->id);
    for (uint64_t id : input_ids) r.add_input_buffers(id);
    for (uint64_t id : e->output_ids) r.add_output_buffers(id);
    r.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    for (size_t k = 0; k < n; ++k) e->workers.push_back(worker(members.peers[k].address()));
    e->statuses.resize(n);
    e->reactor = reactor;
    e->reply = reply;
    e->program = std::move(program);
    e->use = std::move(use);
    e->members = std::move(members);
    return e;
  }

  // What a member marked lost fails with.
  grpc::Status lost_status() const {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        absl::StrCat("the device was marked lost after missing heartbeats for ",
                                     absl::FormatDuration(options_.heartbeat_timeout)));
  }

  // How long the coordinator waits for a run's results: its timeout plus 5 s (as a unary
  // RunPlan's deadline was); the monitor fails the execution past it.
  static absl::Duration run_wait(const Execution& e) {
    return absl::Milliseconds(e.request.timeout_ms()) + absl::Seconds(5);
  }

  // The indices of the members that lack the program's plan for the members as they are now.
  static std::vector<int> missing_plans(Program& program, const Members& members) {
    std::vector<int> missing;
    absl::MutexLock lock(&program.mu);
    for (size_t k = 0; k < members.peers.size(); ++k) {
      auto it = program.loaded.find(members.peers[k].device_id());
      if (it == program.loaded.end() || it->second != members.incarnations) missing.push_back(static_cast<int>(k));
    }
    return missing;
  }

  // Sends every member its run on the member's RunPlans stream; the last result finishes the
  // Execute. Never blocks. The deadline (the run's timeout plus 5 s, as a unary RunPlan's
  // was) is the monitor's to enforce.
  void run_plans(std::shared_ptr<Execution> e) {
    const int n = static_cast<int>(e->workers.size());
    // Its runs start on the workers after its producers' runs: its wait starts after theirs.
    absl::Time start = absl::Now();
    for (const auto& [input, p] : e->producers) start = std::max(start, p->deadline);
    e->deadline = start + run_wait(*e);
    for (int k = 0; k < n; ++k) e->streams.push_back(e->workers[k]->plan_stream(e->members.incarnations[k]));
    {
      absl::MutexLock lock(&executions_mu_);
      executions_[e->id] = e;  // watched by watch_executions
    }
    for (int k = 0; k < n; ++k) {
      auto done = [this, e, k, n](grpc::Status s) {
        if (s.ok()) e->workers[k]->reached = true;
        {
          absl::MutexLock lock(&e->mu);
          if (!s.ok()) e->first_failure = std::min(e->first_failure, absl::Now());
          e->statuses[k] = std::move(s);
          if (++e->done < n) return;
        }
        finish_execution(e);
      };
      if (e->streams[k] == nullptr) {
        auto it = e->frees.find(e->members.peers[k].device_id());
        if (it != e->frees.end()) delete_buffers({{it->first, it->second}}, /*wait=*/false);
        done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the worker registered anew since the call was checked"));
      } else {
        e->streams[k]->run(e->request, std::move(done));
      }
    }
    std::vector<std::function<void()>> on_sent;
    {
      absl::MutexLock lock(&e->mu);
      e->sent = true;
      on_sent.swap(e->on_sent);
    }
    for (auto& f : on_sent) f();
  }

  // After every member answered: the reply, or the first failure.
  void finish_execution(const std::shared_ptr<Execution>& e) {
    if (!e->producers.empty()) {
      // Answer after the producers did: with the first one's error if one failed.
      auto producers = std::make_shared<std::vector<std::pair<int, std::shared_ptr<Execution>>>>();
      producers->swap(e->producers);
      auto left = std::make_shared<std::atomic<int>>(static_cast<int>(producers->size()) + 1);
      auto one_done = [this, e, producers, left] {
        if (left->fetch_sub(1) != 1) return;
        for (const auto& [input, p] : *producers) {
          const absl::Status failed = failed_before_finish(*p);  // finished: its outcome
          if (!failed.ok()) {
            e->producer_failure = absl::Status(
                failed.code(),
                absl::StrCat("execute: input ", input, " is an output of a failed call: ", failed.message()));
            break;
          }
        }
        producers->clear();
        finish_execution(e);
      };
      for (const auto& [input, p] : *producers) when_finished(*p, one_done);
      one_done();
      return;
    }
    {
      absl::MutexLock lock(&executions_mu_);
      executions_.erase(e->id);
    }
    absl::Status status;
    bool unloaded = false;
    {
      absl::MutexLock lock(&e->mu);
      if (e->lost >= 0) {
        e->statuses[e->lost] = lost_status();
      }
      status = first_failure(e->statuses, e->members.peers, "execute");
      // A worker that dropped the plan (it keeps at most --max_plans) gets it again next time.
      for (size_t k = 0; k < e->statuses.size(); ++k) {
        const grpc::Status& s = e->statuses[k];
        if (s.error_code() != grpc::StatusCode::NOT_FOUND || !absl::StrContains(s.error_message(), "is not loaded")) {
          continue;
        }
        absl::MutexLock program_lock(&e->program->mu);
        e->program->loaded.erase(e->members.peers[k].device_id());
        unloaded = true;
      }
    }
    if (unloaded) {
      // ABORTED: the SDK compiles again (a cache hit) and retries, which loads the plan again.
      status = absl::AbortedError(absl::StrCat(status.message(), "; its plan is loaded again at the next call"));
    }
    if (!e->producer_failure.ok()) status = e->producer_failure;
    execute_seconds_.observe(absl::Now() - e->started);
    if (!status.ok()) {
      executions_failed_.fetch_add(1);
      fail_execution(*e, status);  // never waits
      return;
    }
    executions_ok_.fetch_add(1);
    e->program->executions.fetch_add(1);
    for (const ArrayRecord& a : e->outputs) {
      e->reply->add_output_ids(a.id);
      e->reply->add_grants(auth_.grant(a.id));
    }
    complete_call(e->call, absl::OkStatus(), e->output_ids);
    settle(*e, absl::OkStatus());
    e->reactor->Finish(grpc::Status::OK);
  }

  // Starts deleting a failed execution's outputs everywhere and answers with `status`. Never
  // waits: it may run on a gRPC callback thread.
  void fail_execution(Execution& e, const absl::Status& status) {
    delete_buffers(buffers_of(registry_.remove_arrays(e.output_ids)), /*wait=*/false);
    complete_call(e.call, status, {});
    settle(e, status);
    e.reactor->Finish(to_grpc(status));
  }

  // Sends the program's plan to every device that does not have it yet.
  absl::Status load_plans(Program& program, const Members& members, const std::vector<WorkerChannel*>& workers) {
    const std::vector<pb::PeerAddress>& peers = members.peers;
    const std::vector<int> missing = missing_plans(program, members);
    if (missing.empty()) return absl::OkStatus();
    std::vector<pb::LoadPlanReply> replies(missing.size());
    std::vector<WorkerChannel*> targets;
    Members target;
    // One program for every device (each resolves it for its position): encoded once, and
    // every call reads the same request.
    pb::LoadPlanRequest request;
    request.set_plan_id(program.id);
    tessera::to_proto(program.exe.program, request.mutable_plan());
    tessera::to_proto(program.exe.mesh, request.mutable_mesh());
    for (const pb::PeerAddress& p : peers) *request.add_peers() = p;
    for (size_t m = 0; m < missing.size(); ++m) {
      targets.push_back(workers[missing[m]]);
      target.peers.push_back(peers[missing[m]]);
      target.incarnations.push_back(members.incarnations[missing[m]]);
    }
    std::vector<grpc::Status> statuses = fan_out(
        targets, kControlDeadline,
        [&](int m, grpc::ClientContext* ctx, auto done) {
          targets[m]->stub->async()->LoadPlan(ctx, &request, &replies[m], std::move(done));
        },
        absl::InfiniteDuration(), &target);
    TESSERA_RETURN_IF_ERROR(first_failure(statuses, target.peers, "load plan"));
    absl::MutexLock lock(&program.mu);
    for (size_t m = 0; m < target.peers.size(); ++m) {
      program.loaded[target.peers[m].device_id()] = members.incarnations;
    }
    return absl::OkStatus();
  }

  // Every failure of a fan-out, the likeliest root cause first: a member that is gone
  // (UNAVAILABLE) before members that only waited in vain for it (DEADLINE_EXCEEDED), and
  // members cancelled after the first failure last. OK if none failed.
  static absl::Status first_failure(const std::vector<grpc::Status>& statuses,
                                    const std::vector<pb::PeerAddress>& peers, const std::string& what) {
    std::vector<absl::Status> failures;
    for (size_t i = 0; i < statuses.size(); ++i) {
      if (!statuses[i].ok()) {
        failures.push_back(from_grpc(statuses[i], describe_device(peers[i].device_id(), peers[i].address())));
      }
    }
    if (failures.empty()) return absl::OkStatus();
    std::stable_sort(failures.begin(), failures.end(), [](const absl::Status& a, const absl::Status& b) {
      auto rank = [](const absl::Status& s) {
        return s.code() == absl::StatusCode::kUnavailable ? 0 : s.code() == absl::StatusCode::kCancelled ? 2 : 1;
      };
      return rank(a) < rank(b);
    });
    std::string message = absl::StrCat(what, " failed on ", failures.size(), " of ", peers.size(), " devices: ");
    for (size_t i = 0; i < failures.size() && i < 3; ++i)
      absl::StrAppend(&message, i ? "; " : "", failures[i].message());
    if (failures.size() > 3) absl::StrAppend(&message, "; ...");
    return absl::Status(failures[0].code(), message);
  }

  // Issues one asynchronous call per target, all at once, and waits for every answer.
  // start(i, ctx, done) must start call i on `ctx` and have it call done(status). A call to a
  // worker never reached before waits for the connection (bounded by `deadline`; see
  // kConnectDeadline); one to a worker reached before fails fast if it is gone. With a `grace`, the
  // first failure cancels whatever is still running `grace` later: the members of a failed
  // collective need not all wait out their own deadline. With `watch` (the targets' devices),
  // a target that is marked lost or registers anew meanwhile fails the fan-out at once:
  // every call is cancelled and the device's status says it was lost. A worker cut off the
  // network fails an execution within the heartbeat timeout, not the execution's deadline.
  using StartCall = std::function<void(int, grpc::ClientContext*, std::function<void(grpc::Status)>)>;
  std::vector<grpc::Status> fan_out(const std::vector<WorkerChannel*>& workers, absl::Duration deadline,
                                    const StartCall& start, absl::Duration grace = absl::InfiniteDuration(),
                                    const Members* watch = nullptr) {
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
    int lost = -1;  // index of a watched target that was lost meanwhile
    while (!mu.AwaitWithTimeout(absl::Condition(&all_done_or_failed), options_.heartbeat_interval / 4)) {
      if (watch == nullptr) continue;
      lost = changed_member(*watch);
      if (lost >= 0) break;
    }
    if (lost >= 0) {
      for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
    } else if (done < n && grace != absl::InfiniteDuration() &&
               !mu.AwaitWithTimeout(absl::Condition(&all_done), grace)) {
      for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
    }
    mu.Await(absl::Condition(&all_done));
    if (lost >= 0) {
      statuses[lost] = lost_status();
    }
    return statuses;
  }

  // Frees the arrays' buffers on every alive device of their meshes and returns once each
  // device answered (or kConnectDeadline passed). A device with an open RunPlans stream gets
  // the deletion on it, after the runs sent before: a message, where a DeleteBuffers call
  // costs a call object, headers and an HTTP/2 stream on both sides; the others get the call.
  // A device that does not answer keeps garbage, never a wrong value (buffer ids are never
  // reused).
  void delete_buffers(const std::vector<ArrayRecord>& arrays) { delete_buffers(buffers_of(arrays)); }

  // The buffers of `arrays`, by device.
  static std::map<int, std::vector<uint64_t>> buffers_of(const std::vector<ArrayRecord>& arrays) {
    std::map<int, std::vector<uint64_t>> out;
    for (const ArrayRecord& a : arrays) {
      for (int id : a.sharding.mesh().device_ids()) out[id].push_back(a.id);
    }
    return out;
  }

  // Frees `buffers` (by device), as above; without `wait`, only starts to (never blocks).
  void delete_buffers(const std::map<int, std::vector<uint64_t>>& buffers, bool wait = true) {
    std::map<int, pb::DeleteBuffersRequest> per_device;
    for (const auto& [device, ids] : buffers) {
      if (!ids.empty()) per_device[device].mutable_buffer_ids()->Assign(ids.begin(), ids.end());
    }
    std::vector<WorkerChannel*> workers;
    std::vector<const pb::DeleteBuffersRequest*> requests;
    std::vector<std::shared_ptr<PlanStream>> streams;
    std::vector<pb::StreamDelete> stream_requests;
    for (const auto& [device_id, request] : per_device) {
      std::optional<DeviceRecord> d = registry_.device(device_id);
      if (!d.has_value() || !d->alive) continue;
      WorkerChannel* w = worker(d->address);
      std::shared_ptr<PlanStream> stream = w->open_plan_stream(d->incarnation);
      if (stream == nullptr) {
        workers.push_back(w);
        requests.push_back(&request);
        continue;
      }
      pb::StreamDelete& r = stream_requests.emplace_back();
      r.set_request_id(registry_.ids().next());
      *r.mutable_buffer_ids() = request.buffer_ids();
      streams.push_back(std::move(stream));
    }
    // Shared with the callbacks, which may outlive this call after a timeout.
    struct Acks {
      absl::Mutex mu;
      size_t left ABSL_GUARDED_BY(mu) = 0;
    };
    auto acks = std::make_shared<Acks>();
    {
      absl::MutexLock lock(&acks->mu);
      acks->left = streams.size();
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      streams[i]->delete_buffers(stream_requests[i], [acks](grpc::Status) {
        absl::MutexLock lock(&acks->mu);
        --acks->left;
      });
    }
    if (!wait) {
      for (size_t i = 0; i < workers.size(); ++i) {
        call_async<pb::DeleteBuffersRequest, pb::DeleteBuffersReply>(
            workers[i], *requests[i], [](auto* stub, auto* ctx, auto* req, auto* reply, auto done) {
              stub->DeleteBuffers(ctx, req, reply, std::move(done));
            });
      }
      return;  // a stream that never answers fails its deletions when it ends
    }
    std::vector<pb::DeleteBuffersReply> replies(workers.size());
    fan_out(workers, kConnectDeadline, [&](int i, grpc::ClientContext* ctx, auto done) {
      workers[i]->stub->async()->DeleteBuffers(ctx, requests[i], &replies[i], std::move(done));
    });
    {
      absl::MutexLock lock(&acks->mu);
      auto answered = [&acks]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(acks->mu) { return acks->left == 0; };
      if (acks->mu.AwaitWithTimeout(absl::Condition(&answered), kConnectDeadline)) return;
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      streams[i]->cancel(stream_requests[i].request_id(),
                         grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "no answer to a deletion"));
    }
  }

  // Runs one collective on the blocks of an array; the results become a new array with the
  // same sharding (so every device must hold a block of its own).
  // Sets *collective_ns to the slowest member's time (see RunCollectiveReply).
  // `caller` must own the input (or be an admin); the output belongs to its session.
  absl::StatusOr<ArrayRecord> run_collective(const pb::RunCollectiveRequest& req, const Caller& caller,
                                             int64_t* collective_ns) {
    TESSERA_ASSIGN_OR_RETURN(const uint64_t session, acting_session(caller, req.session_id(), "RunCollective"));
    TESSERA_ASSIGN_OR_RETURN(ArrayRecord in, registry_.get_array(req.array_id()));
    TESSERA_RETURN_IF_ERROR(check_owner(caller, in, "RunCollective", "read"));
    TESSERA_ASSIGN_OR_RETURN(CollectiveSpec spec, collective_from_proto(req.spec()));
    TESSERA_ASSIGN_OR_RETURN(const absl::Duration timeout, run_timeout("RunCollective", req.timeout_ms()));
    const std::string name = collective_name(spec.kind);
    const NamedSharding& sharding = in.sharding;
    TESSERA_ASSIGN_OR_RETURN(Shape out_shape, collective_result_shape(spec, in));
    const std::vector<int>& mesh_devices = sharding.mesh().device_ids();
    TESSERA_RETURN_IF_ERROR(check_not_lost(in, name));
    TESSERA_ASSIGN_OR_RETURN(Members members, alive_members(mesh_devices, name));
    const std::vector<pb::PeerAddress>& peers = members.peers;
    TESSERA_ASSIGN_OR_RETURN(uint64_t out_id, registry_.create_array(in.dtype, out_shape, sharding, session));

    pb::WorkerCollectiveRequest request;
    request.set_op_id(out_id);  // array ids are unique: so are the ops that make them
    *request.mutable_spec() = req.spec();
    request.set_input_buffer(in.id);
    request.set_output_buffer(out_id);
    for (const pb::PeerAddress& p : peers) *request.add_peers() = p;
    request.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    request.set_barrier_first(req.barrier_first());
    std::vector<pb::WorkerCollectiveReply> replies(peers.size());
    std::vector<WorkerChannel*> workers;
    for (const pb::PeerAddress& p : peers) workers.push_back(worker(p.address()));
    std::vector<grpc::Status> statuses = fan_out(
        workers, timeout + absl::Seconds(5),
        [&](int i, grpc::ClientContext* ctx, auto done) {
          workers[i]->stub->async()->RunCollective(ctx, &request, &replies[i], std::move(done));
        },
        kFailureGrace, &members);
    absl::Status failed = first_failure(statuses, peers, name);
    if (!failed.ok()) {
      delete_buffers(registry_.remove_arrays({out_id}));
      return failed;
    }
    *collective_ns = 0;
    for (const pb::WorkerCollectiveReply& r : replies) *collective_ns = std::max(*collective_ns, r.elapsed_ns());
    return registry_.get_array(out_id);
  }

  // Converts and checks a CreateArray request; the registry checks the devices.
  absl::StatusOr<uint64_t> create_array(const pb::CreateArrayRequest& req, uint64_t session) {
    TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(req.dtype()));
    TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(req.shape(), dtype));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(req.sharding()));
    await_registration(sharding.mesh().device_ids());
    return registry_.create_array(dtype, shape, sharding, session);
  }

  static absl::StatusOr<ArrayRecord> array_from_proto(const pb::ArrayInfo& info) {
    TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(info.dtype()));
    TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(info.shape(), dtype));
    TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(info.sharding()));
    return ArrayRecord{info.array_id(), dtype, std::move(shape), std::move(sharding), {}, 0};
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

  // Forgets `lapsed` as holders of programs; returns the programs no session holds any more
  // (forgotten too), whose plans the workers may drop.
  std::vector<std::shared_ptr<Program>> release_programs(const std::vector<uint64_t>& lapsed) {
    std::vector<std::shared_ptr<Program>> unused;
    if (lapsed.empty()) return unused;
    absl::MutexLock lock(&programs_mu_);
    for (auto it = programs_.begin(); it != programs_.end();) {
      std::set<uint64_t>& holders = it->second->sessions;
      const size_t before = holders.size();
      for (uint64_t s : lapsed) holders.erase(s);
      if (before == 0 || !holders.empty()) {
        ++it;
        continue;
      }
      unused.push_back(it->second);
      it = programs_.erase(it);
    }
    absl::erase_if(cache_, [&](const auto& entry) { return programs_.count(entry.second) == 0; });
    return unused;
  }

  // Tells the devices that loaded `programs` to drop their plans (bounded; a device that does
  // not answer keeps them: plan ids are never reused). Without `wait`, only starts to.
  void unload_plans(const std::vector<std::shared_ptr<Program>>& programs, bool wait = true) {
    if (programs.empty()) return;
    std::map<int, pb::UnloadPlansRequest> per_device;
    for (const std::shared_ptr<Program>& p : programs) {
      absl::MutexLock lock(&p->mu);
      for (const auto& [device, incarnations] : p->loaded) per_device[device].add_plan_ids(p->id);
    }
    std::vector<WorkerChannel*> workers;
    std::vector<const pb::UnloadPlansRequest*> requests;
    for (const auto& [device, request] : per_device) {
      std::optional<DeviceRecord> d = registry_.device(device);
      if (!d.has_value() || !d->alive) continue;
      workers.push_back(worker(d->address));
      requests.push_back(&request);
    }
    if (!wait) {
      for (size_t i = 0; i < workers.size(); ++i) {
        call_async<pb::UnloadPlansRequest, pb::UnloadPlansReply>(
            workers[i], *requests[i], [](auto* stub, auto* ctx, auto* req, auto* reply, auto done) {
              stub->UnloadPlans(ctx, req, reply, std::move(done));
            });
      }
      return;
    }
    std::vector<pb::UnloadPlansReply> replies(workers.size());
    fan_out(workers, kConnectDeadline, [&](int i, grpc::ClientContext* ctx, auto done) {
      workers[i]->stub->async()->UnloadPlans(ctx, requests[i], &replies[i], std::move(done));
    });
  }

  // Starts one call to `w` that nobody waits for (deadline kConnectDeadline); counted until
  // its callback has run, so the service outlives it (close_plan_streams waits).
  // start(stub->async(), ctx, request, reply, done) starts it.
  template <typename Request, typename Reply, typename Start>
  void call_async(WorkerChannel* w, const Request& request, Start start) {
    struct Call {
      grpc::ClientContext ctx;
      Request request;
      Reply reply;
    };
    auto call = std::make_shared<Call>();
    call->request = request;
    set_deadline(&call->ctx, kConnectDeadline);
    {
      absl::MutexLock lock(&async_mu_);
      ++async_calls_;
    }
    start(w->stub->async(), &call->ctx, &call->request, &call->reply, [this, call](grpc::Status) {
      absl::MutexLock lock(&async_mu_);
      --async_calls_;
    });
  }

  // A coordinator that has just started waits (bounded, see kRegistrationGrace) until the
  // devices `ids` have registered; an older one returns at once. The caller then checks them.
  void await_registration(const std::vector<int>& ids) const {
    registry_.wait_for_devices(ids, started_ + registration_grace_);
  }

  WorkerChannel* worker(const std::string& address) {
    absl::MutexLock lock(&stubs_mu_);
    auto& w = workers_[address];
    if (w == nullptr) {
      w = std::make_unique<WorkerChannel>();
      w->stub = pb::Worker::NewStub(make_channel(address, identity_));
    }
    return w.get();
  }

  // Constant after construction.
  const CoordinatorOptions options_;
  const absl::Time started_;
  ProfileRecorder profile_;  // this coordinator's timeline (core/profile.h): compiles and dispatches
  Registry registry_;
  const absl::Duration registration_grace_;
  std::string address_;  // set once, right after the port is bound and before it is announced
  const Authenticator auth_;
  const std::shared_ptr<const CallIdentity> identity_;  // what this coordinator sends the workers

  absl::Mutex programs_mu_;
  absl::flat_hash_map<std::string, uint64_t> cache_ ABSL_GUARDED_BY(programs_mu_);  // compile_key -> id
  std::map<uint64_t, std::shared_ptr<Program>> programs_ ABSL_GUARDED_BY(programs_mu_);
  int64_t compilations_ ABSL_GUARDED_BY(programs_mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(programs_mu_) = 0;
  uint64_t use_ticks_ ABSL_GUARDED_BY(programs_mu_) = 0;

  // What --metrics_port reports beyond the registry (metrics()).
  std::atomic<int64_t> cache_hits_{0};
  std::atomic<int64_t> executions_ok_{0};
  std::atomic<int64_t> executions_failed_{0};
  LatencyHistogram compile_seconds_{"tessera_coordinator_compile_seconds",
                                    "Compilations (propagation and partitioning) of programs not in the cache."};
  LatencyHistogram execute_seconds_{"tessera_coordinator_execute_seconds",
                                    "Executions, from the request to every device's answer."};

  absl::Mutex calls_mu_;
  // Calls others name (ExecuteRequest.call_id): running, awaited or recently finished.
  absl::flat_hash_map<CallKey, CallEntry> calls_ ABSL_GUARDED_BY(calls_mu_);
  std::deque<CallKey> remembered_ ABSL_GUARDED_BY(calls_mu_);  // finished, oldest first
  size_t awaited_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;

  absl::Mutex executions_mu_;
  // The executions whose RunPlans are in flight, by id.
  absl::flat_hash_map<uint64_t, std::shared_ptr<Execution>> executions_ ABSL_GUARDED_BY(executions_mu_);

  absl::Mutex stubs_mu_;
  absl::flat_hash_map<std::string, std::unique_ptr<WorkerChannel>> workers_ ABSL_GUARDED_BY(stubs_mu_);

  absl::Mutex async_mu_;
  int async_calls_ ABSL_GUARDED_BY(async_mu_) = 0;  // call_async's calls in flight

  // Last: its threads use everything above, and its destructor joins them.
  ThreadPool plan_loads_;
};

class CoordinatorServerImpl final : public CoordinatorServer {
 public:
  explicit CoordinatorServerImpl(const CoordinatorOptions& options) : options_(options), service_(options) {}
  ~CoordinatorServerImpl() override { shutdown(); }

  absl::Status init() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(absl::StrCat(options_.host, ":", options_.port), server_credentials(options_.credentials),
                             &port_);
    configure_server(&builder);
    rpc_errors_.install(&builder);
    builder.RegisterService(&service_);
    builder.RegisterService(health_.service());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port_ == 0) {
      return absl::UnavailableError(
          absl::StrCat("tessera-coordinator: cannot listen on ", options_.host, ":", options_.port));
    }
    if (options_.health_port >= 0) {
      absl::StatusOr<std::unique_ptr<HealthPort>> health_port =
          health_.serve_plaintext(options_.host, options_.health_port);
      if (!health_port.ok())
        return absl::UnavailableError(absl::StrCat("tessera-coordinator: ", health_port.status().message()));
      health_port_ = *std::move(health_port);
    }
    update_health();
    service_.set_address(address());
    monitor_ = std::thread([this] { monitor_loop(); });
    // Lapsed leases are reaped at a tenth of the lease (at most every second), off the monitor:
    // the deletions wait for the workers.
    const absl::Duration reap_every = std::clamp(options_.lease_timeout / 10, absl::Milliseconds(10), absl::Seconds(1));
    reaper_ = std::thread([this, reap_every] {
      while (!stopping_.WaitForNotificationWithTimeout(reap_every)) service_.reap_lapsed();
    });
    return absl::OkStatus();
  }

  std::string address() const override { return absl::StrCat(options_.host, ":", port_); }
  int port() const override { return port_; }
  int health_port() const override { return health_port_ == nullptr ? -1 : health_port_->port(); }
  std::vector<MetricSample> metrics() override {
    std::vector<MetricSample> samples = service_.metrics();
    for (MetricSample& m : rpc_errors_.samples("tessera_coordinator_rpc_errors_total", {}))
      samples.push_back(std::move(m));
    return samples;
  }
  std::vector<const LatencyHistogram*> histograms() const override { return service_.histograms(); }

  void shutdown() override {
    // The server first: its pending Executes end by their deadlines, which the monitor
    // enforces, so it stops only after them.
    health_.set_ready(false);
    health_port_.reset();
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
      server_->Wait();
      server_.reset();
    }
    if (!stopping_.HasBeenNotified()) stopping_.Notify();
    if (monitor_.joinable()) monitor_.join();
    if (reaper_.joinable()) reaper_.join();
    service_.close_plan_streams();
  }

 private:
  // Marks silent workers lost and fails the executions waiting for them; checks four times
  // per heartbeat interval.
  void monitor_loop() {
    while (!stopping_.WaitForNotificationWithTimeout(options_.heartbeat_interval / 4)) {
      for (int id : service_.registry().mark_lost(absl::Now())) {
        std::optional<DeviceRecord> d = service_.registry().device(id);
        std::fprintf(stderr, "tessera-coordinator: %s missed heartbeats for %s; marked lost\n",
                     describe_device(id, d ? d->address : "?").c_str(),
                     absl::FormatDuration(options_.heartbeat_timeout).c_str());
      }
      service_.watch_executions();
      service_.expire_awaited_calls();
      update_health();
    }
  }

  // Ready while the expected devices are alive; a change is logged.
  void update_health() {
    const bool ready = service_.registry().wait_for_alive(options_.expected_devices, absl::ZeroDuration());
    if (ready != health_.ready() && options_.log_registrations && options_.expected_devices > 0) {
      std::fprintf(stderr, "tessera-coordinator: %s: %s %d devices alive (--expected_devices)\n",
                   ready ? "ready" : "not ready", ready ? "at least" : "fewer than", options_.expected_devices);
    }
    health_.set_ready(ready);
  }

  const CoordinatorOptions options_;
  CoordinatorService service_;
  HealthService health_;
  std::unique_ptr<HealthPort> health_port_;  // options_.health_port's server, if any
  RpcErrorCounter rpc_errors_;               // outlives server_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  absl::Notification stopping_;
  std::thread monitor_;
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
  auto server = std::make_unique<CoordinatorServerImpl>(options);
  TESSERA_RETURN_IF_ERROR(server->init());
  return std::unique_ptr<CoordinatorServer>(std::move(server));
}

}  // namespace tessera

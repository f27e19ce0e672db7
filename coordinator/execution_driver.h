// ExecutionDriver: every Execute between its checks and its reply: it checks the call against
// its program (prepare_execution), loads missing plans on a thread of its pool, hands one run
// per member to the member's RunPlans stream, and answers from the last member's result, on
// the gRPC thread that delivered it. A call naming outputs of calls still in flight
// (pending_inputs) waits, without a thread, in the call table until they were sent. The
// monitor thread (watch_executions, expire_awaited_calls) fails executions whose member was
// lost or whose deadline passed, and calls awaited too long; it is the driver's
// (start_monitor, stop_monitor), and runs between its checks the steps of the tick that are
// others' (MonitorSteps: the registry's heartbeats, the worker channels, the heap, health).
//
// Locks: calls_mu_ guards the call table; executions_mu_ the running executions; each
// Execution's mu its progress and waiters. Order: calls_mu_ and executions_mu_ are never
// held together, nor with an Execution::mu; Execution::mu before Program::mu
// (finish_execution). No lock is held while a waiter, a stream's run or cancel, or a gRPC
// Finish is called: each collects under its lock and acts after releasing it. Nothing here
// blocks on the gRPC callback thread that calls it, except prepare_execution's reads of the
// registry (short locks); loading plans blocks, on a thread of plan_loads_. The monitor thread
// holds no lock of the driver while it runs a MonitorSteps step.
//
//   driver.arrive_call(key);
//   driver.start_execution(key, caller, req, reactor, reply, {}, frees);   // never blocks
#ifndef TESSERA_COORDINATOR_EXECUTION_DRIVER_H_
#define TESSERA_COORDINATOR_EXECUTION_DRIVER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "coordinator/fan_out.h"
#include "coordinator/plan_stream.h"
#include "coordinator/program_cache.h"
#include "coordinator/registry.h"
#include "coordinator/worker_channels.h"
#include "core/metrics.h"
#include "core/thread_pool.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera {

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
  std::vector<std::shared_ptr<WorkerChannel>> workers;
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

class ExecutionDriver {
 public:
  ExecutionDriver(Registry* registry, ProgramCache* programs, FanOut* fan_out, WorkerChannels* channels,
                  const Authenticator* auth, int max_plan_loads)
      : registry_(registry),
        programs_(programs),
        fan_out_(fan_out),
        channels_(channels),
        auth_(auth),
        plan_loads_("first calls loading their plans (max_plan_loads)", std::max(1, max_plan_loads)) {}
  ~ExecutionDriver() { stop_monitor(); }

  // What a tick of the monitor does that is not the driver's, in the tick's order:
  //   before_watch();  watch_executions();  after_watch();  expire_awaited_calls();  after();
  // (e.g. the registry marks silent workers lost before the watch, so the watch fails their
  // executions naming them). Each may be empty; none may call stop_monitor.
  struct MonitorSteps {
    std::function<void()> before_watch;
    std::function<void()> after_watch;
    std::function<void()> after;
  };
  // Starts the monitor thread: a tick every `tick`, the first one `tick` after the start, until
  // stop_monitor. Once per driver (a second call aborts). The thread owns `steps`; what they capture must stay valid
  // until stop_monitor returns (the server calls it in shutdown(), before its members go).
  void start_monitor(absl::Duration tick, MonitorSteps steps);
  // Ends the monitor (the tick under way finishes first) and joins it. Idempotent; the
  // destructor calls it.
  void stop_monitor();

  // Checks `req` and runs it (its inputs all exist, or are outputs of `producers`, whose runs
  // were sent): the reply goes when every device answered, or at once with an error. Never
  // blocks.
  // `frees` are buffers to delete by device (arrays the client dropped): they ride on the runs
  // when every device holding one is a member, and are deleted on their own otherwise.
  void start_execution(const CallKey& key, const Caller& caller, const pb::ExecuteRequest& req,
                       grpc::ServerUnaryReactor* reactor, pb::ExecuteReply* reply,
                       std::vector<std::pair<int, std::shared_ptr<Execution>>> producers = {},
                       std::map<int, std::vector<uint64_t>> frees = {});

  // Records that call `key` reached the coordinator. INVALID_ARGUMENT if the session used its
  // id already (for a call that is not being retried), RESOURCE_EXHAUSTED past kMaxCalls.
  absl::Status arrive_call(const CallKey& key);

  // Call `key` ended with `status` (and these outputs): the calls waiting for it go on. One
  // that failed ABORTED (an earlier coordinator's program, or one out of the cache) is sent
  // again by the client under the same id: its consumers wait for that.
  void complete_call(const CallKey& key, const absl::Status& status, std::vector<uint64_t> outputs);

  // Every tick of the monitor: calls awaited longer than kProducerArrival fail their waiters.
  void expire_awaited_calls();

  // Registers `req`'s wait for its producers; the last to finish starts it (or fails it with
  // the first failure). Never blocks. `frees` (the deletions the call carries, by device) ride
  // on its runs as start_execution's do once the producers' runs are sent (a chain: no
  // StreamDelete of their own on every stream); a call waiting for a producer that has not
  // arrived deletes them at once instead, so nothing is kept while it may wait for long.
  void await_producers(const CallKey& key, const Caller& caller, const pb::ExecuteRequest* req,
                       grpc::ServerUnaryReactor* reactor, pb::ExecuteReply* reply,
                       std::map<int, std::vector<uint64_t>> frees = {});

  // Every tick of the monitor: an execution with a member lost (or registered anew) meanwhile
  // is cancelled and fails naming it, as fan_out's watch does; one with a failed member
  // cancels the rest kFailureGrace after the failure.
  void watch_executions();

  int64_t executions_ok() const { return executions_ok_.load(); }
  int64_t executions_failed() const { return executions_failed_.load(); }
  // Buffers, one per device holding a block, whose deletion rode on a call's runs
  // (free_buffers), not on a message of its own.
  int64_t deletes_on_runs() const { return deletes_on_runs_.load(); }
  // Calls forwarded to the workers while a call whose output they read was still running (a
  // chain: their runs go behind the producer's on each stream, not after its reply).
  int64_t chained_calls() const { return chained_calls_.load(); }
  const LatencyHistogram& execute_seconds() const { return execute_seconds_; }

 private:
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
    // The call's deletions, taken by its start or, if it has to wait, deleted at once.
    std::map<int, std::vector<uint64_t>> frees ABSL_GUARDED_BY(mu);
  };

  // Call `key` passed its checks as `e`: the calls waiting for it are sent after it.
  void publish_running(const CallKey& key, const std::shared_ptr<Execution>& e);
  // Runs `f` once every run of `e` is handed to its stream, or `e` ended before: at once, on
  // this thread, if so. `f` must not block.
  static void when_sent(Execution& e, std::function<void()> f);
  // Runs `f` once `e` ended (as when_sent).
  static void when_finished(Execution& e, std::function<void()> f);
  // The error `e` ended with before its runs were all sent; OK otherwise.
  static absl::Status failed_before_finish(Execution& e);
  // `e` ended with `outcome`: what waited for it goes on.
  static void settle(Execution& e, const absl::Status& outcome);
  // Checks an Execute request against its program and creates its outputs' records.
  // `caller` must hold the program (it compiled it) and own the inputs, unless an admin.
  absl::StatusOr<std::shared_ptr<Execution>> prepare_execution(const pb::ExecuteRequest& req, const Caller& caller,
                                                               grpc::ServerUnaryReactor* reactor,
                                                               pb::ExecuteReply* reply);
  // How long the coordinator waits for a run's results: its timeout plus 5 s (as a unary
  // RunPlan's deadline was); the monitor fails the execution past it.
  static absl::Duration run_wait(const Execution& e);
  // Sends every member its run on the member's RunPlans stream; the last result finishes the
  // Execute. Never blocks. The deadline (the run's timeout plus 5 s, as a unary RunPlan's
  // was) is the monitor's to enforce.
  void run_plans(std::shared_ptr<Execution> e);
  // After every member answered: the reply, or the first failure.
  void finish_execution(const std::shared_ptr<Execution>& e);
  // Starts deleting a failed execution's outputs everywhere and answers with `status`. Never
  // waits: it may run on a gRPC callback thread.
  void fail_execution(Execution& e, const absl::Status& status);

  Registry* const registry_;
  ProgramCache* const programs_;
  FanOut* const fan_out_;
  WorkerChannels* const channels_;
  const Authenticator* const auth_;

  std::atomic<int64_t> executions_ok_{0};
  std::atomic<int64_t> executions_failed_{0};
  std::atomic<int64_t> deletes_on_runs_{0};
  std::atomic<int64_t> chained_calls_{0};
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

  // The monitor (start_monitor): joined by stop_monitor, which the destructor calls first.
  absl::Notification monitor_stopping_;
  std::thread monitor_;

  // Last: its threads use everything above, and its destructor joins them.
  ThreadPool plan_loads_;
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_EXECUTION_DRIVER_H_

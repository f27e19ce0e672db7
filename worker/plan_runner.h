// PlanRunner: runs loaded plans on stored buffers, for the coordinator's RunPlans streams, or
// its sessions in process (local_runs: Client::local's coordinator hands an embedded worker
// its runs by a call, and takes the results by one, with the same code: plan_runner.cc's
// RunSession; only the carrier differs). Each session handles runs in order, and the thread
// that handed a request over (the gRPC thread that read it, or the coordinator's in process)
// only decodes and queues it: a small local plan (runs_inline) runs on the process's run
// executor (worker/run_executor.h; compute), in the order of the requests; one as small with
// all_reduces in process starts there and steps (parks at a receive that would wait, continued
// by the executor or plan thread that files its message, else on a plan thread: plan_runner.cc's
// SteppedRun); every other runs on a thread of the plan pool; and a run naming outputs of runs
// before it on its stream waits for them without a thread. A cancel on the stream (or its end)
// tells the run to stop. The runner counts runs for GetStats and for a drain (wait_for_idle).
//
// Locks: runs_mu_ guards the run counts, the tasks queued on the executor and the drain's
// start; held only to count, and to wait in wait_for_idle (the drain's thread) and the
// destructor. The executor's own mu_ is a leaf (held to push or take its queue, never with
// runs_mu_: compute counts, lets go, then posts). Each session has its own mu_ over the runs it
// tracks, and a stream's reactor its write_mu_ over its write queue; neither is held across a
// run, a pool hand-off, a gRPC call (StartWrite, Finish are called after it is released) or a
// result handed over in process. LocalGate's mu (a leaf) is held only to count requests being
// handled in process and the sessions open. Order: no two of these are held together; none
// is held while calling BufferStore or PlanStore (which take their own locks).
//
//   PlanRunner runner(&store, &plans, &transport, &device, 256);
//   return runner.open_stream();   // from the RunPlans handler, the caller checked
#ifndef TESSERA_WORKER_PLAN_RUNNER_H_
#define TESSERA_WORKER_PLAN_RUNNER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/metrics.h"
#include "core/thread_pool.h"
#include "grpcpp/grpcpp.h"
#include "proto/local_runs.h"
#include "proto/tessera.grpc.pb.h"
#include "worker/buffer_store.h"
#include "worker/collectives/transport.h"
#include "worker/device.h"
#include "worker/interpreter.h"
#include "worker/plan_store.h"
#include "worker/run_executor.h"

namespace tessera {

class PlanRunner {
 public:
  // Small runs of one runner queued for (or running on) the run executor at once, at most.
  static constexpr int kMaxQueuedRuns = 4096;

  PlanRunner(BufferStore* store, PlanStore* plans, Transport* transport, const WorkerDevice* device,
             int max_plan_threads, int max_queued_runs = kMaxQueuedRuns)
      : store_(store),
        plans_(plans),
        transport_(transport),
        device_(device),
        max_queued_runs_(std::max(1, max_queued_runs)),
        plan_threads_("plan runs on threads of their own (--max_plan_threads)", std::max(1, max_plan_threads)) {}
  // Waits for the small runs it queued on the run executor, hands the runs parked in the
  // transport to the plan threads, then waits until every stepped run is gone (one parking again meanwhile, on a thread
  // that drives it, is handed back by the transport's watchdog within 2 * Transport::kParkLimit and ends on a plan
  // thread by its deadline), before the plan threads stop: none is continued on a runner
  // that is gone.
  ~PlanRunner();

  // A new RunPlans stream (the reactor owns itself until gRPC is done with it).
  grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>* open_stream();
  // RunPlans streams opened by every runner of the process: what a test reads to see that no
  // stream carried the runs handed over in process.
  static int64_t streams_opened();

  // Opens sessions in process (proto/local_runs.h) for this process's coordinator of the
  // worker: what it may hand runs to instead of a RunPlans stream. The object may outlive the
  // runner: once stop_local_runs ran, it opens nothing and its sessions take nothing.
  std::shared_ptr<LocalRuns> local_runs();
  // Closes the sessions in process to new requests, waits at most `timeout` for those being
  // handled to return, then ends every session still open as a broken stream ends: its runs in
  // progress are told to stop, their results are dropped, and the coordinator's side is told
  // (LocalRuns::open's on_end), which fails the runs it has pending there with UNAVAILABLE.
  // Returns whether the requests being handled returned in time. Before the worker stops.
  // Idempotent.
  bool stop_local_runs(absl::Duration timeout);
  // Whether sessions in process may be used, the requests being handled in them, and the
  // sessions open (plan_runner.cc).
  struct LocalGate;

  // The loaded plan of `req`, and whether it is small enough to run on the run executor (see
  // runs_inline). NOT_FOUND naming this device if it is not loaded.
  absl::StatusOr<std::pair<std::shared_ptr<const LoadedPlan>, bool>> plan_for(const pb::RunPlanRequest& req);
  // Runs a loaded plan on stored buffers and stores its outputs; errors name this device.
  absl::Status run(const LoadedPlan& loaded, const pb::RunPlanRequest& req, std::function<bool()> cancelled);
  // Whether `req` may run on the run executor, or on the plan thread at hand, now that its
  // inputs exist (see plan_for).
  bool may_run_inline(const LoadedPlan& plan, const pb::RunPlanRequest& req) const { return runs_inline(plan, req); }
  // Whether `req` (of a plan with collectives) may start on the run executor (or the plan
  // thread at hand) and step: park at a receive whose message has not arrived, to be continued
  // by the thread that delivers it when that thread drives stepped runs (the executor, a plan
  // thread), else on a plan thread (interpreter.h's runs_stepped, with collectives in process).
  bool may_step(const LoadedPlan& plan, const pb::RunPlanRequest& req) const;
  // Queues `task` (a small run, or a stepped run's start) on the process's run executor, after
  // those queued before it: never on the calling thread, which may be a gRPC callback thread.
  // RESOURCE_EXHAUSTED naming the limit when this runner has max_queued_runs tasks queued or
  // running there already.
  absl::Status compute(std::function<void()> task);
  // The run executor's thread (for tests: what a small run computes on).
  std::thread::id run_thread_id() const { return executor_->thread_id(); }

  // The parts of run(), for a run that steps (plan_runner.cc's SteppedRun): count_start counts
  // a run in flight and returns its start; prepare checks `req` against the plan, takes its
  // inputs (donated ones leave the store), reserves its peak memory and fills `run`;
  // store_outputs gives the reservation back and stores the outputs (or passes on the run's
  // error); count_end counts the run's end and returns `status`.
  absl::Time count_start(bool stepped = false);
  absl::Status prepare(const LoadedPlan& loaded, const pb::RunPlanRequest& req, std::function<bool()> cancelled,
                       PlanRun* run, std::vector<std::shared_ptr<const HostArray>>* inputs);
  absl::Status store_outputs(const pb::RunPlanRequest& req,
                             absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> outputs);
  absl::Status count_end(absl::Time start, absl::Status status);
  // A stepped run (plan_runner.cc's SteppedRun) was made, or is gone: the destructor waits
  // for those alive.
  void stepped_run_made();
  void stepped_run_gone();
  Transport& transport() { return *transport_; }

  // Deletes the buffers `ids` (a buffer still being filled goes when it is committed) and
  // ends the fan-out op of each id this device neither holds nor is filling; returns how many
  // it held. Every deletion the coordinator sends comes here: DeleteBuffers, and on a RunPlans
  // stream a StreamDelete and the free_buffers of a run.
  int delete_buffers(const google::protobuf::RepeatedField<uint64_t>& ids);

  // Waits until no run has been in flight or queued on the run executor for `quiet` (runs the
  // coordinator sent just before the wait still arrive and finish), at most until `deadline`;
  // returns the runs still in flight or queued then (0: drained).
  int64_t wait_for_idle(absl::Duration quiet, absl::Time deadline);
  void start_drain();
  int64_t runs_in_flight();
  // How long no run has been in flight or queued: zero while one is, from the start of the process
  // (`since`) before the first.
  absl::Duration idle_for(absl::Time since);

  // For GetStats (tessera status).
  struct RunCounts {
    int64_t in_flight = 0;  // started, not finished
    int64_t waiting = 0;    // received, waiting for runs before them on their stream to make inputs
    absl::Time last_end;    // when the last run finished
    int64_t runs = 0;
    int64_t stepped = 0;  // of runs, those started stepped (may_step; plan_runner.cc's SteppedRun)
    int64_t failed = 0;
    std::string last_error;
    absl::Time last_error_at;
  };
  RunCounts counts();
  // A stream's runs that wait for their inputs: `delta` more (or fewer) of them.
  void count_waiting(int64_t delta) { waiting_.fetch_add(delta, std::memory_order_relaxed); }

  const LatencyHistogram& run_seconds() const { return run_seconds_; }
  // The threads plans that may wait run on (see the reactor).
  ThreadPool& plan_threads() { return plan_threads_; }
  const WorkerDevice& device() const { return *device_; }

 private:
  // Whether `plan` may run on a gRPC callback thread: by its cost (runs_inline).
  bool runs_inline(const LoadedPlan& plan, const pb::RunPlanRequest& req) const;
  // The bytes of `req`'s inputs in the store.
  int64_t input_bytes(const pb::RunPlanRequest& req) const;
  // Runs a loaded plan on stored buffers and stores its outputs.
  absl::Status run_plan(const LoadedPlan& loaded, const pb::RunPlanRequest& req, std::function<bool()> cancelled);

  BufferStore* const store_;
  PlanStore* const plans_;
  Transport* const transport_;
  const WorkerDevice* const device_;

  absl::Mutex runs_mu_;
  RunCounts runs_ ABSL_GUARDED_BY(runs_mu_);
  absl::Time drain_started_ ABSL_GUARDED_BY(runs_mu_);
  int64_t stepped_alive_ ABSL_GUARDED_BY(runs_mu_) = 0;  // SteppedRun objects not yet destroyed
  int64_t queued_ ABSL_GUARDED_BY(runs_mu_) = 0;         // tasks on the run executor (compute)
  int64_t busy_locked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_);
  const int max_queued_runs_;
  // RunCounts::waiting; counted under each stream's own lock (never with runs_mu_), so apart.
  std::atomic<int64_t> waiting_{0};
  LatencyHistogram run_seconds_{"tessera_worker_plan_run_seconds",
                                "Plan runs on this device, from the start of the run to its outputs stored."};
  static std::shared_ptr<LocalGate> make_local_gate();
  const std::shared_ptr<LocalGate> local_gate_ = make_local_gate();
  // The process's run executor (shared by every runner of the process; the last joins it).
  const std::shared_ptr<RunExecutor> executor_ = RunExecutor::shared();
  // Last: its threads use everything above, and its destructor joins them.
  ThreadPool plan_threads_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_PLAN_RUNNER_H_

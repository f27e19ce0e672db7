#include "worker/plan_runner.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
#include <map>
#include <set>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "core/run_tag.h"
#include "core/slicing.h"
#include "core/status.h"
#include "proto/write_queue.h"
#include "worker/interpreter.h"
#include "worker/plan_peak.h"
#include "worker/transfers.h"

namespace tessera {
namespace {

// Runs of one session (a RunPlans stream, or one in process) that may wait for the runs making
// their inputs at once.
constexpr size_t kMaxDeferredRuns = 4096;

// Stepped runs (SteppedRun) that one thread continues after the run it started with, those
// whose messages it delivered: beyond these, the next go to the plan threads.
constexpr int kMaxContinued = 16;

class RunSession;
class SteppedRun;

// The stepped runs a thread continues (see drive), while it drives them.
struct Driver {
  std::deque<std::shared_ptr<SteppedRun>> queue;
  int budget = kMaxContinued;
};
thread_local Driver* t_driver = nullptr;

// A run of a plan with collectives in process, started on the run executor (or the plan thread
// at hand, for a chained run) rather than a thread of its own, as a small run without
// collectives is (Client::local: a call's runs then start one after the other on the process's
// run executor, with no wake-up of a plan thread). At a receive whose message has not arrived
// it parks (Transport::park) and gives the thread back; the thread that files that message
// continues it after the run at hand if it drives stepped runs (drive: the executor, or a plan
// thread), at most kMaxContinued runs per thread, the next (and any filed by another thread) on
// a plan thread. No gRPC callback thread drives: the reactors only queue on the executor. A run parked for
// Transport::kParkLimit, or when a peer of this process stops, continues on a plan thread
// that waits as run_plan does: its deadline, cancellation and lost peers fail it as before.
// So it never waits on the thread at hand, nor runs more there than a bounded number of
// small plans. It ends as the other runs do (RunSession::end_run).
class SteppedRun final : public Transport::Parked, public std::enable_shared_from_this<SteppedRun> {
 public:
  SteppedRun(std::shared_ptr<RunSession> session, PlanRunner* runner, std::shared_ptr<pb::RunPlanRequest> req,
             std::shared_ptr<const LoadedPlan> loaded)
      : alive_(runner),
        session_(std::move(session)),
        runner_(runner),
        req_(std::move(req)),
        loaded_(std::move(loaded)) {}

  // Prepares the run and steps it on this thread (the executor, or a plan thread: see drive).
  void start(std::shared_ptr<std::atomic<bool>> cancelled);
  void resume(bool arrived) override;
  // Advances the run: with `may_wait`, to its end, waiting at its receives; else until it
  // parks, needs a thread, or ends.
  void step(bool may_wait);

 private:
  // Continues on a plan thread: stepping (driving the runs it resumes), or waiting.
  void to_thread(bool may_wait);
  void finish(absl::Status status);

  // Counts this run alive in its runner from first to last (declared first: destroyed last),
  // so that ~PlanRunner waits for the whole of it.
  struct Alive {
    explicit Alive(PlanRunner* runner) : runner(runner) { runner->stepped_run_made(); }
    ~Alive() { runner->stepped_run_gone(); }
    PlanRunner* const runner;
  };
  const Alive alive_;
  const std::shared_ptr<RunSession> session_;
  PlanRunner* const runner_;
  const std::shared_ptr<pb::RunPlanRequest> req_;
  const std::shared_ptr<const LoadedPlan> loaded_;
  absl::Time start_;
  PlanRun run_;
  std::unique_ptr<SteppedPlanRun> plan_run_;
};

// Steps `run` on this thread, then the runs it (and they) resumed, in turn: a queue, not
// recursion. On a thread driving already, `run` joins its queue.
void drive(std::shared_ptr<SteppedRun> run) {
  if (t_driver != nullptr) {
    t_driver->queue.push_back(std::move(run));
    return;
  }
  Driver driver;
  // However the loop is left (an exception from a step), the thread keeps no pointer to driver.
  struct Driving {
    explicit Driving(Driver* driver) { t_driver = driver; }
    ~Driving() { t_driver = nullptr; }
    Driving(const Driving&) = delete;
    Driving& operator=(const Driving&) = delete;
  } const driving(&driver);
  driver.queue.push_back(std::move(run));
  while (!driver.queue.empty()) {
    std::shared_ptr<SteppedRun> next = std::move(driver.queue.front());
    driver.queue.pop_front();
    next->step(/*may_wait=*/false);
  }
}

// The coordinator's runs on this worker, whatever carries them (a RunPlans stream's reactor,
// PlanStreamReactor, or the coordinator's hand-off in process, InProcessRunSession): each
// request is a run (or the cancel of one, or a deletion); each run's result goes back as its
// own message when the run ends, in any order. Requests never wait for a run, nor compute on
// the thread that handled them: a small local plan (runs_inline, or stepped: may_step) is queued
// on the process's run executor (PlanRunner::compute, in the order of the requests), every other
// plan runs on a thread of its own. A run whose inputs are outputs of runs sent before it in
// this session and still going (the coordinator forwards a call naming an earlier call's outputs
// at once) waits, without a thread, until they ended: it starts on the thread that ended the
// last of them (the executor or a plan thread: a run that ends OK on any other thread does not
// exist), after that one's result is sent, or fails at once with the error of one that failed. The session lives while
// its carrier holds it and runs on threads do; when the coordinator's side ends (end_reading), runs in progress are
// told to stop and their results dropped.
class RunSession : public std::enable_shared_from_this<RunSession> {
 public:
  virtual ~RunSession() {
    absl::MutexLock lock(&mu_);
    // Dropped with the session (none once every run ended: the runner may be gone by then).
    if (!deferred_.empty()) runner_->count_waiting(-static_cast<int64_t>(deferred_.size()));
  }

  // Handles one request, as read: decodes it and queues its run (never computes it here). Calls
  // read_next() once it is done with `request`.
  void handle(pb::PlanStreamRequest& request, const std::function<void()>& read_next);
  // The coordinator's side ended: runs in progress are told to stop, results are dropped.
  void end_reading();
  // Sends the result of request `id`, unless the coordinator's side ended.
  void post(uint64_t id, const absl::Status& status);
  // Run `req` (one in running_) ended with `status`: posts its result, then starts the runs
  // that waited for it (or fails them with its error), and ends the session if it is done.
  void end_run(std::shared_ptr<pb::RunPlanRequest> req, absl::Status status);

 protected:
  explicit RunSession(PlanRunner* runner) : runner_(runner) {}
  // Carries a result to the coordinator; under no lock of the session, never blocks.
  virtual void send(pb::RunPlanResult result) = 0;
  // The coordinator's side ended and no run is left; called once, under no lock of the session.
  virtual void ended() = 0;

  PlanRunner* const runner_;

 private:
  // A run waiting for the runs before it in this session that make its inputs.
  struct Deferred {
    std::shared_ptr<pb::RunPlanRequest> req;
    std::shared_ptr<const LoadedPlan> loaded;
    int waiting = 0;       // producers still going
    absl::Status failure;  // of the first that failed
  };

  // The flag that cancels run `execution` on a thread or stepped: its running_ entry's, or, when
  // that is missing or null (erased meanwhile, or overwritten by an inline run of the same
  // execution id), a flag nothing sets: never null.
  std::shared_ptr<std::atomic<bool>> cancel_flag(uint64_t execution) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts `req` on a thread of the plan pool (it is in running_ and its inputs exist).
  void run_on_thread(std::shared_ptr<pb::RunPlanRequest> req, std::shared_ptr<const LoadedPlan> loaded);
  // Starts `req` stepped, on this thread: the executor, or a plan thread (SteppedRun; it is in
  // running_, its inputs exist).
  void run_stepped(std::shared_ptr<pb::RunPlanRequest> req, std::shared_ptr<const LoadedPlan> loaded);

  // Whether the session ends now: the reading ended and no run is left on a thread of its own
  // (a stream's server, and the service those runs use, wait for its Finish before they go).
  // The caller calls ended(), outside the lock.
  bool end_now_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!reading_ended_ || ended_ || !running_.empty()) return false;
    ended_ = true;
    return true;
  }

  absl::Mutex mu_;
  bool reading_ended_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  // Runs in progress (inline ones too) or waiting for their inputs, by execution, with the flag
  // that tells them to stop (null for a small run queued on the executor as it arrived, which
  // nothing cancels: it is short and never waits).
  std::map<uint64_t, std::shared_ptr<std::atomic<bool>>> running_ ABSL_GUARDED_BY(mu_);
  // Of those: the run making each output buffer, the runs waiting, and what each waits for.
  std::map<uint64_t, uint64_t> producing_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Deferred> deferred_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, std::vector<uint64_t>> dependents_ ABSL_GUARDED_BY(mu_);
};

// The server side of the coordinator's RunPlans stream: carries a RunSession's requests and
// results. One write is in flight; results finished meanwhile queue behind it. The reactor
// owns itself (runs on threads hold it too) until gRPC is done with it; it finishes the stream
// once the session ended and the last result is written. Results not yet sent when the reading
// ended are dropped: nobody reads them.
class PlanStreamReactor final : public RunSession,
                                public grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult> {
 public:
  static PlanStreamReactor* start(PlanRunner* runner) {
    std::shared_ptr<PlanStreamReactor> r(new PlanStreamReactor(runner));
    {
      absl::MutexLock lock(&r->write_mu_);
      r->self_ = r;
    }
    r->StartRead(&r->request_);
    return r.get();
  }

  void OnReadDone(bool ok) override {
    if (ok) {
      handle(request_, [this] { StartRead(&request_); });
      return;
    }
    {  // the coordinator closed or cancelled the stream, or went away
      absl::MutexLock lock(&write_mu_);
      reading_ended_ = true;
    }
    end_reading();
  }
  void OnWriteDone(bool ok) override;
  void OnDone() override {
    end_reading();  // tells the runs still going to stop (it ended already: nothing else)
    std::shared_ptr<PlanStreamReactor> self;
    absl::MutexLock lock(&write_mu_);
    self = std::move(self_);  // the last reference may be a run's, on its own thread
  }

 private:
  explicit PlanStreamReactor(PlanRunner* runner) : RunSession(runner) {}

  void send(pb::RunPlanResult result) override;
  void ended() override;
  // Whether to finish the stream now: the session ended and no write is in flight. The caller
  // calls Finish, outside the lock.
  bool finish_now_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(write_mu_) {
    if (!session_ended_ || results_.writing() || finished_) return false;
    finished_ = true;
    return true;
  }

  pb::PlanStreamRequest request_;  // the read in flight; touched only by the reading callback

  absl::Mutex write_mu_;
  WriteQueue<pb::RunPlanResult> results_ ABSL_GUARDED_BY(write_mu_);
  bool reading_ended_ ABSL_GUARDED_BY(write_mu_) = false;  // or a write failed: results are dropped
  bool session_ended_ ABSL_GUARDED_BY(write_mu_) = false;
  bool finished_ ABSL_GUARDED_BY(write_mu_) = false;
  std::shared_ptr<PlanStreamReactor> self_ ABSL_GUARDED_BY(write_mu_);
};

void PlanStreamReactor::send(pb::RunPlanResult result) {
  const pb::RunPlanResult* first = nullptr;
  {
    absl::MutexLock lock(&write_mu_);
    if (reading_ended_ || finished_) return;  // the coordinator is gone or done with this stream
    first = results_.push(std::move(result));
  }
  if (first != nullptr) StartWrite(first);
}

void PlanStreamReactor::ended() {
  bool finish = false;
  {
    absl::MutexLock lock(&write_mu_);
    session_ended_ = true;
    finish = finish_now_locked();
  }
  if (finish) Finish(grpc::Status::OK);
}

void PlanStreamReactor::OnWriteDone(bool ok) {
  const pb::RunPlanResult* next = nullptr;
  bool finish = false;
  {
    absl::MutexLock lock(&write_mu_);
    if (!ok) reading_ended_ = true;  // the stream is broken: the read fails too
    next = results_.pop(reading_ended_);
    finish = finish_now_locked();
  }
  if (next != nullptr) StartWrite(next);
  if (finish) Finish(grpc::Status::OK);
}

// The in-process carrier (proto/local_runs.h): the coordinator hands each request over by a
// call, on its own thread, and each result goes to its callback. Nothing to finish: the session
// goes with the last of its holders (the coordinator's port, runs on threads). The runner's
// LocalGate holds it weakly, to end it when the worker stops (stop).
class InProcessRunSession final : public RunSession, public LocalRunSession {
 public:
  InProcessRunSession(PlanRunner* runner, std::shared_ptr<PlanRunner::LocalGate> gate,
                      std::function<void(const pb::RunPlanResult&)> on_result,
                      std::function<void(const std::string&)> on_end)
      : RunSession(runner), gate_(std::move(gate)), on_result_(std::move(on_result)), on_end_(std::move(on_end)) {}

  bool receive(pb::PlanStreamRequest message) override;
  void close() override { end_reading(); }
  // The worker stops: ends the session as a broken stream, and tells the coordinator's side.
  void stop() {
    end_reading();
    on_end_("its worker stopped");
  }

 private:
  void send(pb::RunPlanResult result) override { on_result_(result); }
  void ended() override {}

  const std::shared_ptr<PlanRunner::LocalGate> gate_;
  const std::function<void(const pb::RunPlanResult&)> on_result_;
  const std::function<void(const std::string&)> on_end_;
};

}  // namespace

// Lock order: a coordinator's WorkerChannel mu may be held while opening a session (enter);
// mu is a leaf: nothing is called under it.
struct PlanRunner::LocalGate {
  // Counts a request being handled; false once closed.
  bool enter() {
    absl::MutexLock lock(&mu);
    if (!open) return false;
    ++active;
    return true;
  }
  void leave() {
    absl::MutexLock lock(&mu);
    --active;
  }
  // Registers a new session (null once closed).
  std::shared_ptr<InProcessRunSession> open_session(PlanRunner* runner,
                                                    std::function<void(const pb::RunPlanResult&)> on_result,
                                                    std::function<void(const std::string&)> on_end,
                                                    std::shared_ptr<LocalGate> self) {
    absl::MutexLock lock(&mu);
    if (!open) return nullptr;
    auto session =
        std::make_shared<InProcessRunSession>(runner, std::move(self), std::move(on_result), std::move(on_end));
    sessions.erase(std::remove_if(sessions.begin(), sessions.end(),
                                  [](const std::weak_ptr<InProcessRunSession>& s) { return s.expired(); }),
                   sessions.end());
    sessions.push_back(session);
    return session;
  }

  absl::Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = true;
  int active ABSL_GUARDED_BY(mu) = 0;
  std::vector<std::weak_ptr<InProcessRunSession>> sessions ABSL_GUARDED_BY(mu);  // those opened, until stop
};

namespace {

bool InProcessRunSession::receive(pb::PlanStreamRequest message) {
  if (!gate_->enter()) return false;
  handle(message, [] {});
  gate_->leave();
  return true;
}

void RunSession::end_reading() {
  bool end = false;
  {
    absl::MutexLock lock(&mu_);
    reading_ended_ = true;  // results not yet sent are dropped (see post)
    for (auto& [execution, cancelled] : running_) {
      if (cancelled != nullptr) *cancelled = true;
    }
    end = end_now_locked();
  }
  if (end) ended();
}

void RunSession::handle(pb::PlanStreamRequest& request, const std::function<void()>& read_next) {
  if (request.kind_case() == pb::PlanStreamRequest::kCancelExecution) {
    {
      absl::MutexLock lock(&mu_);
      auto it = running_.find(request.cancel_execution());
      if (it != running_.end() && it->second != nullptr) *it->second = true;
    }
    read_next();
    return;
  }
  if (request.kind_case() == pb::PlanStreamRequest::kDeleteBuffers) {
    const uint64_t id = request.delete_buffers().request_id();
    runner_->delete_buffers(request.delete_buffers().buffer_ids());
    read_next();
    post(id, absl::OkStatus());
    return;
  }
  if (request.kind_case() != pb::PlanStreamRequest::kRun) {
    read_next();  // a kind this build does not know: nothing to answer
    return;
  }
  auto req = std::make_shared<pb::RunPlanRequest>();
  req->Swap(request.mutable_run());
  const uint64_t execution = req->execution_id();
  // Deletions riding on the run: nothing reads these buffers any more.
  if (req->free_buffers_size() > 0) runner_->delete_buffers(req->free_buffers());
  absl::StatusOr<std::pair<std::shared_ptr<const LoadedPlan>, bool>> plan = runner_->plan_for(*req);
  if (!plan.ok()) {
    read_next();
    post(execution, plan.status());
    return;
  }
  auto [loaded, inline_run] = *std::move(plan);
  absl::Status refused;
  bool deferred = false;
  bool gone = false;
  {
    absl::MutexLock lock(&mu_);
    // The coordinator's side ended meanwhile (a hand-off in process may race its end): the
    // result would be dropped, and a run tracked now would outlive the session's end.
    gone = reading_ended_;
    std::set<uint64_t> producers;
    for (uint64_t id : req->input_buffers()) {
      auto it = producing_.find(id);
      if (it != producing_.end()) producers.insert(it->second);
    }
    if (gone) {
      // Nothing to run.
    } else if (!producers.empty() && deferred_.size() >= kMaxDeferredRuns) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "run: ", kMaxDeferredRuns, " runs on this session wait for the runs making their inputs already"));
    } else {
      // Inline runs too: the next read (a consumer of this run) may be handled meanwhile. Every
      // run takes a cancel flag, a small one queued on the executor too: it may wait there
      // behind other sessions' runs, and a cancel followed by the deletion of its outputs (the
      // coordinator's fail_execution) must find it not started, so that it never stores
      // outputs nobody will delete.
      running_[execution] = std::make_shared<std::atomic<bool>>(false);
      for (uint64_t id : req->output_buffers()) producing_[id] = execution;
      if (!producers.empty()) {
        deferred = true;
        Deferred& d = deferred_[execution];
        d.req = req;
        d.loaded = loaded;
        d.waiting = static_cast<int>(producers.size());
        runner_->count_waiting(1);
        for (uint64_t p : producers) dependents_[p].push_back(execution);
      }
    }
  }
  read_next();
  if (gone) return;
  if (!refused.ok()) {
    post(execution, refused);
  } else if (deferred) {
    // Started by the end of the last of its producers.
  } else if (inline_run || runner_->may_step(*loaded, *req)) {
    // Small: computed on the run executor, in the order of this session's requests, never on
    // this thread (a gRPC callback thread, or the coordinator's handing runs over in process).
    // A cancel that comes while it is queued stops it before it starts (or, once started,
    // before its next instruction: the interpreter's check), with nothing stored.
    absl::Status queued = runner_->compute([self = shared_from_this(), req, loaded = std::move(loaded),
                                            small = inline_run, cancelled = cancel_flag(execution)]() mutable {
      if (small) {
        absl::Status status = cancelled->load()
                                  ? absl::CancelledError("run: cancelled before it started")
                                  : self->runner_->run(*loaded, *req, [cancelled] { return cancelled->load(); });
        self->end_run(std::move(req), std::move(status));
      } else {
        self->run_stepped(std::move(req), std::move(loaded));
      }
    });
    if (!queued.ok()) end_run(std::move(req), std::move(queued));
  } else {
    run_on_thread(std::move(req), std::move(loaded));
  }
}

std::shared_ptr<std::atomic<bool>> RunSession::cancel_flag(uint64_t execution) {
  {
    absl::MutexLock lock(&mu_);
    auto it = running_.find(execution);
    if (it != running_.end() && it->second != nullptr) return it->second;
  }
  return std::make_shared<std::atomic<bool>>(false);
}

void RunSession::run_on_thread(std::shared_ptr<pb::RunPlanRequest> req, std::shared_ptr<const LoadedPlan> loaded) {
  std::shared_ptr<std::atomic<bool>> cancelled = cancel_flag(req->execution_id());
  absl::Status started = runner_->plan_threads().run([self = shared_from_this(), plan = loaded, req, cancelled] {
    self->end_run(req, self->runner_->run(*plan, *req, [cancelled] { return cancelled->load(); }));
  });
  if (!started.ok()) end_run(std::move(req), started);
}

void RunSession::run_stepped(std::shared_ptr<pb::RunPlanRequest> req, std::shared_ptr<const LoadedPlan> loaded) {
  std::shared_ptr<std::atomic<bool>> cancelled = cancel_flag(req->execution_id());
  std::make_shared<SteppedRun>(shared_from_this(), runner_, std::move(req), std::move(loaded))
      ->start(std::move(cancelled));
}

void SteppedRun::start(std::shared_ptr<std::atomic<bool>> cancelled) {
  start_ = runner_->count_start(/*stepped=*/true);
  std::vector<std::shared_ptr<const HostArray>> inputs;
  absl::Status prepared = runner_->prepare(
      *loaded_, *req_, [cancelled] { return cancelled->load(); }, &run_, &inputs);
  if (!prepared.ok()) {  // nothing reserved
    session_->end_run(req_, runner_->count_end(start_, std::move(prepared)));
    return;
  }
  plan_run_ = std::make_unique<SteppedPlanRun>(loaded_->plan, std::move(inputs), runner_->transport(), run_,
                                               plan_op_id(run_.execution, 0));
  drive(shared_from_this());
}

void SteppedRun::resume(bool arrived) {
  if (arrived && t_driver != nullptr && t_driver->budget > 0) {  // after the run at hand
    --t_driver->budget;
    t_driver->queue.push_back(shared_from_this());
    return;
  }
  to_thread(/*may_wait=*/!arrived);
}

void SteppedRun::step(bool may_wait) {
  std::shared_ptr<SteppedRun> self = shared_from_this();  // parked, it may end on another thread meanwhile
  ParkFn park;
  if (!may_wait) {
    park = [this](int device, MessageTag tag, absl::Time op_start) {
      return runner_->transport().park(device, tag, op_start, shared_from_this());
    };
  }
  switch (plan_run_->advance(park)) {
    case SteppedPlanRun::State::kParked:
      return;  // touch nothing: it may be resumed already
    case SteppedPlanRun::State::kNeedsThread:
      to_thread(/*may_wait=*/true);
      return;
    case SteppedPlanRun::State::kDone:
      finish(runner_->store_outputs(*req_, plan_run_->take_result()));
      return;
  }
}

void SteppedRun::to_thread(bool may_wait) {
  absl::Status started = runner_->plan_threads().run([self = shared_from_this(), may_wait] {
    if (may_wait) {
      self->step(/*may_wait=*/true);
    } else {
      drive(self);
    }
  });
  if (started.ok()) return;
  plan_run_->abandon(started);
  finish(runner_->store_outputs(*req_, plan_run_->take_result()));
}

void SteppedRun::finish(absl::Status status) { session_->end_run(req_, runner_->count_end(start_, std::move(status))); }

void RunSession::end_run(std::shared_ptr<pb::RunPlanRequest> req, absl::Status status) {
  // A queue, not recursion: a long chain of waiting runs may end here one after another. Most
  // ends start nothing: the run at hand is kept inline, with no allocation.
  // What has ended is dropped once it is most of the queue, so a chain holds about what is still
  // to end (amortised: each entry is moved at most once more).
  absl::InlinedVector<std::pair<std::shared_ptr<pb::RunPlanRequest>, absl::Status>, 1> ends;
  ends.emplace_back(std::move(req), std::move(status));
  for (size_t next = 0; next < ends.size();) {
    {
      auto [run, result] = std::move(ends[next++]);  // what follows may grow the queue
      const uint64_t execution = run->execution_id();
      post(execution, result);                       // before its dependents run: results go back in order
      std::vector<std::pair<Deferred, bool>> ready;  // and whether it was cancelled meanwhile
      bool end = false;
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
            ready.emplace_back(std::move(w), flag != running_.end() && flag->second != nullptr && flag->second->load());
            deferred_.erase(it);
            runner_->count_waiting(-1);
          }
          dependents_.erase(deps);
        }
        end = end_now_locked();
      }
      for (auto& [w, cancelled] : ready) {
        if (!w.failure.ok()) {
          ends.emplace_back(std::move(w.req), std::move(w.failure));
        } else if (cancelled) {
          ends.emplace_back(std::move(w.req), absl::CancelledError("run: cancelled"));
        } else if (runner_->may_run_inline(*w.loaded, *w.req)) {
          // Here: a producer ended OK, so this is the executor or a plan thread (no other
          // thread computes a run), never a gRPC callback thread; no hand-off, no wake-up.
          absl::Status s = runner_->run(*w.loaded, *w.req, nullptr);
          ends.emplace_back(std::move(w.req), std::move(s));
        } else if (runner_->may_step(*w.loaded, *w.req)) {
          // A chained run with collectives in process steps too: on this thread (joining its
          // queue if it drives stepped runs already: drive), not a plan thread's wake-up.
          run_stepped(std::move(w.req), std::move(w.loaded));
        } else {
          run_on_thread(std::move(w.req), std::move(w.loaded));
        }
      }
      if (end) ended();
    }
    if (next > ends.size() / 2) {
      ends.erase(ends.begin(), ends.begin() + static_cast<std::ptrdiff_t>(next));
      next = 0;
    }
  }
}

void RunSession::post(uint64_t id, const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (reading_ended_) return;  // the coordinator is gone or done with this session
  }
  pb::RunPlanResult result;
  result.set_id(id);
  result.set_code(static_cast<int32_t>(status.code()));
  if (!status.ok()) result.set_message(std::string(status.message()));  // an OK result has none to send
  send(std::move(result));
}

}  // namespace

namespace {
std::atomic<int64_t> streams_opened_total{0};
}  // namespace

int64_t PlanRunner::streams_opened() { return streams_opened_total.load(std::memory_order_relaxed); }

grpc::ServerBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult>* PlanRunner::open_stream() {
  streams_opened_total.fetch_add(1, std::memory_order_relaxed);
  return PlanStreamReactor::start(this);
}

namespace {

// What PlanRunner::local_runs hands out: opens sessions while the gate is open. Holds the
// gate, not the runner, across its life: it may outlive the worker.
class LocalRunsOfRunner final : public LocalRuns {
 public:
  LocalRunsOfRunner(PlanRunner* runner, std::shared_ptr<PlanRunner::LocalGate> gate)
      : runner_(runner), gate_(std::move(gate)) {}
  std::shared_ptr<LocalRunSession> open(std::function<void(const pb::RunPlanResult&)> on_result,
                                        std::function<void(const std::string&)> on_end) override {
    return gate_->open_session(runner_, std::move(on_result), std::move(on_end), gate_);
  }

 private:
  PlanRunner* const runner_;
  const std::shared_ptr<PlanRunner::LocalGate> gate_;
};

}  // namespace

std::shared_ptr<LocalRuns> PlanRunner::local_runs() { return std::make_shared<LocalRunsOfRunner>(this, local_gate_); }

std::shared_ptr<PlanRunner::LocalGate> PlanRunner::make_local_gate() { return std::make_shared<LocalGate>(); }

bool PlanRunner::stop_local_runs(absl::Duration timeout) {
  std::vector<std::weak_ptr<InProcessRunSession>> sessions;
  bool idle = false;
  {
    absl::MutexLock lock(&local_gate_->mu);
    local_gate_->open = false;
    auto none_active = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(local_gate_->mu) { return local_gate_->active == 0; };
    idle = local_gate_->mu.AwaitWithTimeout(absl::Condition(&none_active), timeout);
    sessions.swap(local_gate_->sessions);
  }
  if (!idle) {
    std::fprintf(stderr,
                 "tessera-worker: device %d: requests handed over in process still handled after %s; their "
                 "sessions end now\n",
                 device_->id(), absl::FormatDuration(timeout).c_str());
  }
  // Outside the gate's lock: the coordinator's side fails its pending runs here (on_end).
  for (const std::weak_ptr<InProcessRunSession>& weak : sessions) {
    if (std::shared_ptr<InProcessRunSession> session = weak.lock()) session->stop();
  }
  return idle;
}

int PlanRunner::delete_buffers(const google::protobuf::RepeatedField<uint64_t>& ids) {
  std::vector<uint64_t> unknown;
  const int deleted = store_->erase(std::vector<uint64_t>(ids.begin(), ids.end()), &unknown);
  // A put's fan-out that failed may have left chunks here for an op this device never started
  // (its call was cancelled before it began): the array's deletion ends that op, so they go
  // now and any still on the way are dropped as they arrive, rather than holding memory and
  // the sender's mailbox share until the time-to-live (--mailbox_ttl_ms). Only for buffers
  // this device neither holds nor is filling: a buffer it holds (or fills) came from a run, or
  // from a put whose fan-out ran here and ended its op itself (Transfers::fan_out). Recording
  // every deleted buffer's end pushed the ends of real fan-outs out of the transport's memory
  // of 4096 under heavy deletion. The deletions on a RunPlans stream (a StreamDelete, a run's
  // free_buffers) recorded no end before: once the coordinator had a stream to the device,
  // which is after its first call, a failed put's late chunks waited for the time-to-live.
  for (uint64_t id : unknown) transport_->finish_op(id | Transfers::kFanOutOpBit);
  return deleted;
}

absl::StatusOr<std::pair<std::shared_ptr<const LoadedPlan>, bool>> PlanRunner::plan_for(const pb::RunPlanRequest& req) {
  absl::StatusOr<std::shared_ptr<const LoadedPlan>> loaded = plans_->find(req.plan_id());
  if (!loaded.ok()) return loaded.status();
  const bool inline_run = runs_inline(**loaded, req);
  return std::make_pair(*std::move(loaded), inline_run);
}

absl::Status PlanRunner::run(const LoadedPlan& loaded, const pb::RunPlanRequest& req, std::function<bool()> cancelled) {
  const absl::Time start = count_start();
  // Not named here: a run's only caller, the coordinator, names the device it called
  // (FanOut, "device 1 (address): ..."); it had read "device 1 (address): device 1: ...".
  return count_end(start, run_plan(loaded, req, std::move(cancelled)));
}

PlanRunner::~PlanRunner() {
  if (!stop_local_runs(absl::Seconds(10))) {
    // A request handed over in process is still inside handle(), which uses this runner: wait
    // for it however long it takes (logged every 10 s) rather than go from under it.
    absl::MutexLock lock(&local_gate_->mu);
    auto none_active = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(local_gate_->mu) { return local_gate_->active == 0; };
    absl::Duration waited = absl::Seconds(10);
    while (!local_gate_->mu.AwaitWithTimeout(absl::Condition(&none_active), absl::Seconds(10))) {
      waited += absl::Seconds(10);
      std::fprintf(stderr,
                   "tessera-worker: device %d: the runner goes only after the %d requests handed over in process "
                   "still handled return; waited %s\n",
                   device_->id(), local_gate_->active, absl::FormatDuration(waited).c_str());
    }
  }
  // Nothing handles a request in process from here. The small runs queued on the executor end
  // by themselves (they never wait); a stepped one they start is counted before they end.
  {
    absl::MutexLock lock(&runs_mu_);
    auto none_queued = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_) { return queued_ == 0; };
    runs_mu_.Await(absl::Condition(&none_queued));
  }
  transport_->unpark_all();
  absl::MutexLock lock(&runs_mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_) { return stepped_alive_ == 0; };
  runs_mu_.Await(absl::Condition(&none));
}

absl::Status PlanRunner::compute(std::function<void()> task) {
  {
    absl::MutexLock lock(&runs_mu_);
    if (queued_ >= max_queued_runs_) {
      return absl::ResourceExhaustedError(absl::StrCat("run: ", max_queued_runs_,
                                                       " small runs of this device are queued for its run thread "
                                                       "already, the limit of this worker; retry later"));
    }
    ++queued_;
  }
  executor_->post([this, task = std::move(task)]() mutable {
    task();
    task = nullptr;  // what it holds (its session) goes before the runner may
    absl::MutexLock lock(&runs_mu_);
    --queued_;
  });
  return absl::OkStatus();
}

void PlanRunner::stepped_run_made() {
  absl::MutexLock lock(&runs_mu_);
  ++stepped_alive_;
}

void PlanRunner::stepped_run_gone() {
  absl::MutexLock lock(&runs_mu_);
  --stepped_alive_;
}

absl::Time PlanRunner::count_start(bool stepped) {
  absl::MutexLock lock(&runs_mu_);
  ++runs_.in_flight;
  if (stepped) ++runs_.stepped;
  return absl::Now();
}

absl::Status PlanRunner::count_end(absl::Time start, absl::Status status) {
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

// Runs started and not finished, plus tasks queued on the run executor (a small run waiting
// there has not started; one running counts twice: an upper bound, 0 only when idle).
int64_t PlanRunner::busy_locked() const { return runs_.in_flight + queued_; }

int64_t PlanRunner::wait_for_idle(absl::Duration quiet, absl::Time deadline) {
  absl::MutexLock lock(&runs_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_) { return busy_locked() == 0; };
  for (;;) {
    if (!runs_mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) return busy_locked();
    const absl::Time quiet_until = std::max(runs_.last_end, drain_started_) + quiet;
    if (absl::Now() >= quiet_until) return 0;
    // Something may start meanwhile: wake at the end of the quiet period, or at a start.
    auto busy_or_quiet = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(runs_mu_) { return busy_locked() > 0; };
    runs_mu_.AwaitWithDeadline(absl::Condition(&busy_or_quiet), std::min(quiet_until, deadline));
    if (absl::Now() >= deadline) return busy_locked();
  }
}

void PlanRunner::start_drain() {
  absl::MutexLock lock(&runs_mu_);
  drain_started_ = absl::Now();
}

int64_t PlanRunner::runs_in_flight() {
  absl::MutexLock lock(&runs_mu_);
  return runs_.in_flight;
}

absl::Duration PlanRunner::idle_for(absl::Time since) {
  absl::MutexLock lock(&runs_mu_);
  if (busy_locked() > 0) return absl::ZeroDuration();
  return absl::Now() - std::max(since, runs_.last_end);
}

int64_t PlanRunner::input_bytes(const pb::RunPlanRequest& req) const {
  int64_t bytes = 0;
  for (uint64_t id : req.input_buffers()) {
    absl::StatusOr<std::shared_ptr<const HostArray>> buffer = store_->get(id);
    if (buffer.ok()) bytes += (*buffer)->nbytes();
  }
  return bytes;
}

bool PlanRunner::runs_inline(const LoadedPlan& plan, const pb::RunPlanRequest& req) const {
  return tessera::runs_inline(plan.plan, input_bytes(req));
}

bool PlanRunner::may_step(const LoadedPlan& plan, const pb::RunPlanRequest& req) const {
  return plan.has_collectives && transport_->in_process() && runs_stepped(plan.plan, input_bytes(req));
}

absl::Status PlanRunner::run_plan(const LoadedPlan& loaded, const pb::RunPlanRequest& req,
                                  std::function<bool()> cancelled) {
  PlanRun run;
  std::vector<std::shared_ptr<const HostArray>> inputs;
  TESSERA_RETURN_IF_ERROR(prepare(loaded, req, std::move(cancelled), &run, &inputs));
  return store_outputs(req, tessera::run_plan(loaded.plan, std::move(inputs), *transport_, run));
}

absl::Status PlanRunner::prepare(const LoadedPlan& loaded, const pb::RunPlanRequest& req,
                                 std::function<bool()> cancelled, PlanRun* run,
                                 std::vector<std::shared_ptr<const HostArray>>* inputs_out) {
  const DevicePlan& plan = loaded.plan;
  // Its collectives' messages carry the run's tag, which their receivers check (docs/design.md,
  // "Run tags"): tag 0 would take anyone's messages at the predictable op ids.
  if (loaded.has_collectives && req.run_tag() == 0) {
    return run_tag_0_refusal(
        absl::StrCat("run: execution ", req.execution_id(), " of plan ", req.plan_id(), ", which has collectives"),
        "RunPlanRequest.run_tag");
  }
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
    TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<const HostArray> buffer, store_->get(id));
    inputs.push_back(std::move(buffer));
  }
  // Donated inputs leave the store: the run holds the only reference, so its kernels may
  // write over them, and their memory counts as free from now on.
  std::vector<uint64_t> donated;
  for (int d : plan.donated_inputs) donated.push_back(req.input_buffers(d));
  if (!donated.empty()) store_->erase(donated);
  // What the run holds at its peak (intermediates, outputs, donated inputs) is reserved in
  // the store for the run, under the execution's id (no buffer has it), before anything runs.
  const PlanPeak peak =
      plan.donated_inputs.empty() ? loaded.peaks.without_donated : peak_memory(plan, inputs, loaded.peaks);
  if (absl::Status reserved = store_->reserve(req.execution_id(), peak.bytes); !reserved.ok()) {
    const BufferStore::Stats stats = store_->stats();
    const std::string at = peak.instruction < 0 ? std::string("its donated inputs")
                                                : absl::StrCat("instruction ", peak.instruction, " (",
                                                               instruction_name(plan.code[peak.instruction]), ")");
    return absl::ResourceExhaustedError(absl::StrCat(
        "run: plan ", req.plan_id(), " needs ", peak.bytes, " bytes at once for its intermediates and outputs (at ", at,
        ") but only ", stats.limit_bytes - stats.bytes_used, " of the device's ", stats.limit_bytes,
        " bytes are free (--memory_bytes)"));
  }
  run->execution = req.execution_id();
  run->run_tag = req.run_tag();
  run->has_collectives = loaded.has_collectives;
  if (loaded.has_collectives) run->peers = loaded.peers;
  run->self = device_->id();
  const int64_t timeout_ms = req.timeout_ms() > 0 ? std::min<int64_t>(req.timeout_ms(), 3'600'000) : 10'000;
  run->deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  run->cancelled = std::move(cancelled);
  *inputs_out = std::move(inputs);
  return absl::OkStatus();
}

absl::Status PlanRunner::store_outputs(const pb::RunPlanRequest& req,
                                       absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> outputs) {
  store_->cancel(req.execution_id());  // the outputs are reserved one by one below
  if (!outputs.ok()) return outputs.status();
  for (int i = 0; i < req.output_buffers_size(); ++i) {
    absl::Status reserved = store_->reserve(req.output_buffers(i), (*outputs)[i]->nbytes());
    if (!reserved.ok()) {
      for (int j = 0; j < i; ++j) store_->erase({req.output_buffers(j)});
      return reserved;
    }
    store_->commit(req.output_buffers(i), (*outputs)[i]);
  }
  return absl::OkStatus();
}

PlanRunner::RunCounts PlanRunner::counts() {
  absl::MutexLock lock(&runs_mu_);
  RunCounts counts = runs_;
  counts.waiting = waiting_.load(std::memory_order_relaxed);
  return counts;
}

}  // namespace tessera

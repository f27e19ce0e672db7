// LocalRuns: an embedded worker's runs handed over in process, without a RunPlans stream.
// Client::local's cluster (client/local_cluster.cc) gives its coordinator each of its workers'
// LocalRuns; the coordinator then opens a LocalRunSession where it would open a RunPlans
// stream (coordinator/plan_stream.h's LocalPlanStream), and the worker runs what it receives
// with the same code as a stream's messages (worker/plan_runner.h): only the carrier changes.
//
//   std::shared_ptr<LocalRunSession> s = runs->open([](const pb::RunPlanResult& r) { ... },
//                                                   [](const std::string& why) { ... });
//   s->receive(message);   // as one message read from the stream; the result comes to the callback
//   s->close();            // as the stream's end: runs in progress are told to stop
//
// Shared by the coordinator and the worker libraries, which include nothing of each other.
#ifndef TESSERA_PROTO_LOCAL_RUNS_H_
#define TESSERA_PROTO_LOCAL_RUNS_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tessera {
namespace pb {
class PlanStreamRequest;
class RunPlanResult;
}  // namespace pb

// A call's hand-overs as one: while a batch is open on a thread, a receiver that would wake a
// thread for each request it queues there (the worker's run executor, worker/run_executor.h)
// puts the wake-up off until the outermost batch on the thread ends. The coordinator opens one
// around a call's n hand-overs (ExecutionDriver::run_plans): one wake-up per call, not one per
// run. While any thread's batch holds the wake-up off, posts from every thread wait for it
// too; so nothing inside a batch may wait for any task of the executor, from any thread.
//
//   { HandOverBatch batch; for (auto& s : sessions) s->receive(m); }   // the wake-ups run here
class HandOverBatch {
 public:
  HandOverBatch() { ++state().depth; }
  ~HandOverBatch() {
    State& s = state();
    if (--s.depth > 0) return;
    std::vector<std::function<void()>> wakes;
    wakes.swap(s.wakes);
    for (std::function<void()>& wake : wakes) wake();
  }
  HandOverBatch(const HandOverBatch&) = delete;
  HandOverBatch& operator=(const HandOverBatch&) = delete;

  // For a receiver: with a batch open on this thread, keeps `wake` to run when the batch ends
  // and returns true; else returns false (wake now).
  static bool defer(std::function<void()> wake) {
    State& s = state();
    if (s.depth == 0) return false;
    s.wakes.push_back(std::move(wake));
    return true;
  }

 private:
  struct State {
    int depth = 0;
    std::vector<std::function<void()>> wakes;
  };
  static State& state() {
    thread_local State s;
    return s;
  }
};

// One session: what one RunPlans stream is to the worker.
class LocalRunSession {
 public:
  virtual ~LocalRunSession() = default;
  // Handles `message` as the stream's reactor handles one it read, on the caller's thread:
  // decodes and queues it (a small run runs on the worker's run executor, never here). Returns
  // false, having done nothing, if the worker has stopped. Never blocks.
  virtual bool receive(pb::PlanStreamRequest message) = 0;
  // As the end of the stream: runs in progress are told to stop and their results dropped.
  virtual void close() = 0;
};

// The worker's side. Every result of a session goes to the `on_result` it was opened with, on
// the thread that ended the run (for a small one the process's run executor, worker/
// run_executor.h: a small run's result never comes back on the caller of receive(); a refusal
// or a deletion's acknowledgement does), under no lock of the
// worker; it must not block. When the worker stops, each session still open ends as a broken
// stream does: its results are dropped from then on and `on_end` runs once, with why, on the
// stopping thread, under no lock of the worker (the coordinator then fails the runs pending).
class LocalRuns {
 public:
  virtual ~LocalRuns() = default;
  // A new session, or null if the worker has stopped.
  virtual std::shared_ptr<LocalRunSession> open(std::function<void(const pb::RunPlanResult&)> on_result,
                                                std::function<void(const std::string& why)> on_end) = 0;
};

}  // namespace tessera

#endif  // TESSERA_PROTO_LOCAL_RUNS_H_

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

namespace tessera {
namespace pb {
class PlanStreamRequest;
class RunPlanResult;
}  // namespace pb

// One session: what one RunPlans stream is to the worker.
class LocalRunSession {
 public:
  virtual ~LocalRunSession() = default;
  // Handles `message` as the stream's reactor handles one it read, on the caller's thread (a
  // small run runs there, as on the thread that read it). Returns false, having done nothing,
  // if the worker has stopped. Never blocks.
  virtual bool receive(pb::PlanStreamRequest message) = 0;
  // As the end of the stream: runs in progress are told to stop and their results dropped.
  virtual void close() = 0;
};

// The worker's side. Every result of a session goes to the `on_result` it was opened with, on
// the thread that ended the run (the caller of receive() for a small one), under no lock of the
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

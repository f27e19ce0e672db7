// PlanStream: the coordinator's long-lived RunPlans stream to one incarnation of a worker.
// Every jitted call sends one RunPlanRequest per device on the device's stream instead of
// starting a unary RunPlan: no call object, headers or HTTP/2 stream to set up per call. To an
// embedded worker of Client::local the same requests are handed over by a call instead
// (LocalPlanStream).
//
//   std::shared_ptr<PlanStream> s = GrpcPlanStream::open(stub, incarnation);
//   s->run(request, [](grpc::Status status) { ... });    // exactly once per request
//   s->cancel(request.execution_id(), grpc::Status(grpc::StatusCode::CANCELLED, "..."));
//
// Requests go out in order, one write in flight; results come back in the order the runs
// finish and are matched by execution id. A stream that breaks (the worker died, the
// connection dropped) fails every run still pending on it at once with UNAVAILABLE; the
// owner then opens a new one. Deadlines are the owner's: it cancels runs it gave up on.
#ifndef TESSERA_COORDINATOR_PLAN_STREAM_H_
#define TESSERA_COORDINATOR_PLAN_STREAM_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/local_runs.h"
#include "proto/tessera.grpc.pb.h"
#include "proto/write_queue.h"

namespace tessera {

// The coordinator's line for runs to one incarnation of a worker: a RunPlans stream
// (GrpcPlanStream), or, for an embedded worker of Client::local, a session handed its messages
// by a call (LocalPlanStream). WorkerChannel chooses the carrier when it opens one; callers
// see no difference.
class PlanStream {
 public:
  using Done = std::function<void(grpc::Status)>;
  virtual ~PlanStream() = default;

  // Sends `request`. `done` runs exactly once, on a gRPC thread, a worker's thread or the
  // caller's: with the worker's result, with UNAVAILABLE if the stream broke first (or had
  // already), or with the status given to cancel(). Never blocks (in process, a small run is
  // queued on the worker's run executor; a refusal may come back on the caller's thread). REQUIRES: no run of the
  // same execution is pending, and the caller holds no lock `done` takes. A completion may send
  // the next request, but nothing may wait for a result from inside a completion: in process
  // that result is completed after the completion returns, on the same thread (LocalPlanStream).
  void run(const pb::RunPlanRequest& request, Done done);

  // Deletes buffers on the worker, after every request sent before; `done` as for run(), with
  // the same rule: nothing waits for it from inside a completion.
  // REQUIRES: `request.request_id()` is unique among this stream's pending requests.
  void delete_buffers(const pb::StreamDelete& request, Done done);

  // If the run of `execution` is still pending, completes it with `status` and asks the worker
  // to stop it (a late result is then ignored). Never blocks.
  void cancel(uint64_t execution, const grpc::Status& status);

  // Whether the stream has ended or is ending: a new one must be opened.
  bool broken() const;

  // Ends the stream (pending runs fail with UNAVAILABLE) and waits at most `timeout` for its
  // carrier to be done with it (no result being delivered). Returns whether it was.
  virtual bool close(absl::Duration timeout) = 0;

  uint64_t incarnation() const { return incarnation_; }

 protected:
  // `broken` is what a request fails with once the stream is ending, until end() says why.
  PlanStream(uint64_t incarnation, std::string broken) : incarnation_(incarnation), why_(std::move(broken)) {}
  // Carries `message` to the worker (its request is pending already); never blocks.
  virtual void send(pb::PlanStreamRequest message) = 0;
  // Takes the callback pending under `id` (null if none: answered or cancelled already).
  Done take_locked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks the stream ending with UNAVAILABLE `why` (what later requests fail with) and fails
  // every request pending with it. Only the first call's `why` is kept: later ones (a worker's
  // stop after close()) fail what is pending with it too.
  void fail_pending(const std::string& why);

  mutable absl::Mutex mu_;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;  // ended, or ending: nothing is sent any more
  absl::flat_hash_map<uint64_t, Done> pending_ ABSL_GUARDED_BY(mu_);

 private:
  // Registers `done` under `id` and sends `message`; fails `done` at once if the stream broke.
  void request(uint64_t id, pb::PlanStreamRequest message, Done done);

  const uint64_t incarnation_;
  std::string why_ ABSL_GUARDED_BY(mu_);
  bool failed_ ABSL_GUARDED_BY(mu_) = false;  // fail_pending ran: why_ is its first why
};

// The RunPlans stream: the carrier to a worker reached over gRPC (every worker but an embedded
// one handed over in process).
class GrpcPlanStream final : public PlanStream,
                             public grpc::ClientBidiReactor<pb::PlanStreamRequest, pb::RunPlanResult> {
 public:
  // Opens a stream on `stub` (which must outlive it) to the worker's `incarnation`. With
  // `wait_for_ready` it waits for the connection, as a first call to a worker does: the
  // process may have just registered, or restarted under the same address. A worker that
  // never answers leaves its runs to the owner's deadlines and lost-device watch. Without, a
  // worker that cannot be connected to (its process is gone) fails the stream, and its runs
  // with UNAVAILABLE, at once.
  static std::shared_ptr<GrpcPlanStream> open(pb::Worker::Stub* stub, uint64_t incarnation, bool wait_for_ready = true);

  bool close(absl::Duration timeout) override;

  void OnWriteDone(bool ok) override;
  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  explicit GrpcPlanStream(uint64_t incarnation) : PlanStream(incarnation, "its RunPlans stream is broken") {}
  // Queues `message`; starts its write if none is in flight.
  void send(pb::PlanStreamRequest message) override;
  // Marks the stream ending; returns whether the caller must release the reactor's hold
  // (it was not ending yet and no write is in flight, whose completion would release it).
  bool end_locked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Constant after open().
  grpc::ClientContext ctx_;

  pb::RunPlanResult result_;  // the read in flight; touched only by the reading callback

  WriteQueue<pb::PlanStreamRequest> writes_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;                     // OnDone ran
  std::shared_ptr<GrpcPlanStream> self_ ABSL_GUARDED_BY(mu_);  // keeps the reactor alive until OnDone
};

// The in-process carrier (proto/local_runs.h): each request is handed to the embedded worker's
// session by a call on the caller's thread, and each result comes back by a call on the thread
// that ended the run; no message, completion or poller wake-up. Same pending runs, cancels and
// failures as a stream: a worker that stopped ends it (its pending runs fail with UNAVAILABLE).
//
// A result that comes back while its thread is handing a request over (a refusal, or a
// deletion's acknowledgement: small runs end on the run executor) is completed after the hand-off returns, by the
// outermost hand-off on the thread: completing it there may hand the next request over (a chained call's runs), which
// would otherwise nest one hand-off in the other, once per call of a chain.
class LocalPlanStream final : public PlanStream {
 public:
  // Opens a session of `runs` (broken at once if the worker stopped, or stops while it opens).
  // Each request handed over (a run, a deletion, a cancel) adds one to `*handed_over` if given:
  // its owner's count (WorkerChannels::handed_over, one per coordinator), which a test reads to
  // see that the calls took this path.
  static std::shared_ptr<LocalPlanStream> open(LocalRuns& runs, uint64_t incarnation,
                                               std::shared_ptr<std::atomic<int64_t>> handed_over = nullptr);
  // Closes the session if close() did not.
  ~LocalPlanStream() override;

  bool close(absl::Duration timeout) override;

 private:
  LocalPlanStream(uint64_t incarnation, std::shared_ptr<std::atomic<int64_t>> handed_over)
      : PlanStream(incarnation, "its in-process run session ended (its worker stopped)"),
        handed_over_(std::move(handed_over)) {}
  // Hands `message` to the session; a worker that stopped breaks the stream.
  void send(pb::PlanStreamRequest message) override;
  // A result from the worker: completes its pending request (none: cancelled or failed already).
  void deliver(const pb::RunPlanResult& result);
  // Ends the stream and fails what is pending with `why` (UNAVAILABLE).
  void end(const std::string& why);

  const std::shared_ptr<std::atomic<int64_t>> handed_over_;  // null: not counted

  int delivering_ ABSL_GUARDED_BY(mu_) = 0;                        // results being completed, which close() waits for
  std::shared_ptr<LocalRunSession> session_ ABSL_GUARDED_BY(mu_);  // null once ending
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_PLAN_STREAM_H_

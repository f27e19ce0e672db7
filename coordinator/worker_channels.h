// WorkerChannels: the coordinator's line to each worker, by address: its stub, whether a call
// ever reached it, and its RunPlans stream (coordinator/plan_stream.h) for the worker's
// current incarnation (a session in process for an embedded worker handed over). The table holds a channel only while
// an alive device has its address (retain, after every registration and whenever devices are marked lost): a worker
// gone, or back at another address, leaves none behind. Callers hold their channel by shared_ptr, so an evicted one
// lives until the calls that use it end.
//
// Locks: mu_ guards the table of channels; each WorkerChannel's mu guards its stream. Order:
// mu_ before a WorkerChannel::mu (take_plan_streams holds both). Neither is held across a
// call: opening a stream starts it without waiting, and a stale stream is closed (without
// waiting) after its channel's lock is released.
//
//   WorkerChannels channels(identity);
//   std::shared_ptr<WorkerChannel> w = channels.get("127.0.0.1:4000");
//   std::shared_ptr<PlanStream> s = w->plan_stream(incarnation);
//   channels.retain({"127.0.0.1:4001"});  // 127.0.0.1:4000's worker is gone
#ifndef TESSERA_COORDINATOR_WORKER_CHANNELS_H_
#define TESSERA_COORDINATOR_WORKER_CHANNELS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/plan_stream.h"
#include "proto/auth.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera {

// The coordinator's line to one worker.
struct WorkerChannel {
  // The RunPlans stream to the worker's `incarnation`, opened if there is none or the one there
  // broke or belongs to an older incarnation (a stale one is closed; its pending runs fail).
  // To an embedded worker handed over (WorkerChannels::hand_runs_in_process), a session in
  // process (LocalPlanStream) instead, chosen here; the rest holds for both.
  // Null if the worker has a newer incarnation already: a call checked before the worker
  // registered anew must not close the stream of the calls made since. The stream that
  // replaces a broken one of the same incarnation does not wait for the connection: that
  // process was reached and its stream ended (kill -9 closes its sockets), so a call to it
  // fails at once with UNAVAILABLE instead of waiting for the heartbeat timeout (a process
  // back at the address registers anew, under a new incarnation, and is waited for).
  std::shared_ptr<PlanStream> plan_stream(uint64_t incarnation) {
    std::shared_ptr<PlanStream> stale, current;
    {
      absl::MutexLock lock(&mu);
      if (plans != nullptr && plans->incarnation() > incarnation) return nullptr;
      if (plans != nullptr && (plans->broken() || plans->incarnation() != incarnation)) stale = std::move(plans);
      if (plans == nullptr && local != nullptr) {
        plans = LocalPlanStream::open(*local, incarnation, handed_over);
      } else if (plans == nullptr) {
        const bool broke = stale != nullptr && stale->incarnation() == incarnation;
        plans = GrpcPlanStream::open(stub.get(), incarnation, /*wait_for_ready=*/!broke);
      }
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
  std::shared_ptr<std::atomic<int64_t>> handed_over;  // its table's count (WorkerChannels::handed_over)
  std::atomic<bool> reached{false};                   // a call has succeeded: the worker was up at least once
  absl::Mutex mu;
  std::shared_ptr<PlanStream> plans ABSL_GUARDED_BY(mu);
  std::shared_ptr<LocalRuns> local ABSL_GUARDED_BY(mu);  // an embedded worker's, if handed over
};

class WorkerChannels {
 public:
  explicit WorkerChannels(std::shared_ptr<const CallIdentity> identity) : identity_(std::move(identity)) {}

  // The channel to `address`, made at its first use (or its first since it was evicted). Never
  // null.
  std::shared_ptr<WorkerChannel> get(const std::string& address);

  // Evicts the channel of every address not in `addresses` (those of the alive devices) and
  // closes its RunPlans stream without waiting (its pending runs fail; the worker is gone or
  // elsewhere). Returns how many were evicted.
  int retain(const absl::flat_hash_set<std::string>& addresses);

  // Runs to the worker at `address` are handed to `runs` (an embedded worker of this process
  // that this coordinator's cluster started: proto/local_runs.h) instead of a RunPlans stream,
  // from its next stream on; for as long as this table lives, whichever channel reaches it.
  void hand_runs_in_process(const std::string& address, std::shared_ptr<LocalRuns> runs);

  // Requests (runs, deletions, cancels) handed to embedded workers in process by this table's
  // channels so far: what a test reads to see that the calls took that path.
  int64_t handed_over() const { return handed_over_->load(std::memory_order_relaxed); }

  // How many channels the table holds.
  int size() const;

  // Takes every open RunPlans stream out of its channel, for the owner to close (shutdown).
  std::vector<std::shared_ptr<PlanStream>> take_plan_streams();

  // A registration the coordinator counts: the device, its worker's address, and the
  // coordinator epoch and incarnation it registered with.
  struct Registered {
    int device = 0;
    std::string address;
    uint64_t epoch = 0;
    uint64_t incarnation = 0;
  };
  // Asks each worker of `registered` at once (Handshake, waiting for the connection, until
  // `deadline`) which registration it holds. Returns, for each one that is not the incarnation
  // given (its process is gone and the address refuses or does not answer, or a new process
  // there has not registered yet), why not; empty if all are. Blocks until every answer is in
  // or the deadline passed: never call it on a gRPC callback thread.
  std::map<int, std::string> unconfirmed(const std::vector<Registered>& registered, absl::Time deadline);

 private:
  const std::shared_ptr<const CallIdentity> identity_;  // what this coordinator sends the workers
  const std::shared_ptr<std::atomic<int64_t>> handed_over_ = std::make_shared<std::atomic<int64_t>>(0);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<WorkerChannel>> workers_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<LocalRuns>> local_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_WORKER_CHANNELS_H_

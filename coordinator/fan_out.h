// FanOut: the coordinator's calls to many workers at once: fan_out (one asynchronous call
// per worker, then a wait for every answer, bounded, cancelling on a lost member or after the
// first failure's grace), calls nobody waits for (call_async, counted so that shutdown waits
// for their callbacks), and the deletion of buffers everywhere (on the RunPlans streams when
// they are open, by DeleteBuffers calls otherwise).
//
// Locks: async_mu_ guards the count of call_async's calls in flight; held only to count and,
// at shutdown, to wait for it to reach 0. Each fan_out and delete_buffers has a lock of its
// own on its stack (or shared with its callbacks), held only to count answers. fan_out and
// delete_buffers with `wait` BLOCK the calling thread until every worker answered or the
// deadline passed: call them only on a thread that may wait (a synchronous handler, the
// reaper, the plan-load pool), never on a gRPC callback thread; their non-waiting forms
// never block. No lock of the caller's may be held across them.
//
//   FanOut fan(&registry, &channels, heartbeat_interval, heartbeat_timeout);
//   std::vector<grpc::Status> s = fan.fan_out(workers, kConnectDeadline, start_call);
//   fan.delete_buffers(FanOut::buffers_of(arrays), /*wait=*/false);
#ifndef TESSERA_COORDINATOR_FAN_OUT_H_
#define TESSERA_COORDINATOR_FAN_OUT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/registry.h"
#include "coordinator/worker_channels.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"

namespace tessera {

// After the first member of a collective fails, how long the others get to report theirs
// before the rest are cancelled.
inline constexpr absl::Duration kFailureGrace = absl::Milliseconds(500);

// The devices of one fan-out, in order: where to reach each and which incarnation of it.
struct Members {
  std::vector<pb::PeerAddress> peers;
  std::vector<uint64_t> incarnations;
};

class FanOut {
 public:
  FanOut(Registry* registry, WorkerChannels* channels, absl::Duration heartbeat_interval,
         absl::Duration heartbeat_timeout)
      : registry_(registry),
        channels_(channels),
        heartbeat_interval_(heartbeat_interval),
        heartbeat_timeout_(heartbeat_timeout) {}

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
  std::vector<grpc::Status> fan_out(const std::vector<std::shared_ptr<WorkerChannel>>& workers, absl::Duration deadline,
                                    const StartCall& start, absl::Duration grace = absl::InfiniteDuration(),
                                    const Members* watch = nullptr);

  // Every failure of a fan-out, the likeliest root cause first: a member that is gone
  // (UNAVAILABLE) before members that only waited in vain for it (DEADLINE_EXCEEDED), and
  // members cancelled after the first failure last. OK if none failed.
  static absl::Status first_failure(const std::vector<grpc::Status>& statuses,
                                    const std::vector<pb::PeerAddress>& peers, const std::string& what);

  // Starts one call to `w` that nobody waits for (deadline kConnectDeadline); counted until
  // its callback has run, so the service outlives it (wait_for_calls waits).
  // start(stub->async(), ctx, request, reply, done) starts it.
  template <typename Request, typename Reply, typename Start>
  void call_async(const std::shared_ptr<WorkerChannel>& w, const Request& request, Start start) {
    struct Call {
      std::shared_ptr<WorkerChannel> channel;  // kept while the call runs, even if evicted meanwhile
      grpc::ClientContext ctx;
      Request request;
      Reply reply;
    };
    auto call = std::make_shared<Call>();
    call->channel = w;
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

  // Waits (at most `timeout`) until every call_async call has run its callback.
  void wait_for_calls(absl::Duration timeout);

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
  void delete_buffers(const std::map<int, std::vector<uint64_t>>& buffers, bool wait = true);

  // The index of the first of `members` that is lost or has registered anew since; -1 if none.
  int changed_member(const Members& members) const;
  // The devices `ids`, all alive and taking work; UNAVAILABLE naming the first that is lost
  // or draining (check_not_draining).
  absl::StatusOr<Members> alive_members(const std::vector<int>& ids, const std::string& what) const;
  // What a member marked lost fails with.
  grpc::Status lost_status() const;

 private:
  Registry* const registry_;
  WorkerChannels* const channels_;
  const absl::Duration heartbeat_interval_;
  const absl::Duration heartbeat_timeout_;

  absl::Mutex async_mu_;
  int async_calls_ ABSL_GUARDED_BY(async_mu_) = 0;  // call_async's calls in flight
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_FAN_OUT_H_

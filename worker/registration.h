// Registration: a worker's membership of the cluster: it registers with the coordinator
// (retrying until register_timeout), then heartbeats on a thread of its own, registering
// again, under the same device id and with the buffers it holds, when the coordinator has
// marked it lost or restarted.
//
// The registration's state (device id, incarnation, epoch, interval) is written by start()
// before the heartbeat thread starts and afterwards only by that thread; what other threads
// read or set (device_id(), draining_) is atomic. wake_mu_, a leaf, guards only wake_: the
// request to send the next heartbeat early. The heartbeat thread blocks on its own calls to
// the coordinator (each bounded by four heartbeat intervals) and holds no lock meanwhile.
//
//   Registration registration(options, identity, &store, &plans, &health, on_registered);
//   TESSERA_RETURN_IF_ERROR(registration.start(address));
//   registration.start_heartbeats();
//   registration.stop();   // joins the heartbeat thread
#ifndef TESSERA_WORKER_REGISTRATION_H_
#define TESSERA_WORKER_REGISTRATION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "proto/auth.h"
#include "proto/health.h"
#include "proto/tessera.grpc.pb.h"
#include "worker/buffer_store.h"
#include "worker/collectives/peer_view.h"
#include "worker/plan_store.h"
#include "worker/worker_server.h"

namespace tessera {

class Registration {
 public:
  // `registered(device_id, epoch, incarnation)` runs after every successful registration;
  // `tick()` on the heartbeat thread once per heartbeat interval (housekeeping that must not wait
  // for traffic: it must not block).
  // `peers` (optional) takes the coordinator's view of the cluster from every reply that has one,
  // and holds its version, which every heartbeat names (a reply carries the view only when it
  // changed since).
  // `registering(true)` (optional) runs before every RegisterWorker is sent, `registered` after
  // each one that succeeded, before the view of its reply is taken: the worker's collectives
  // send nothing in between (Transport::begin_registration), since the coordinator may send runs
  // as soon as it has recorded the registration, before its reply is here. `registering(false)`
  // after one that failed, and when stop() begins: nothing waits for that registration any
  // more (Transport::end_registration).
  Registration(
      const WorkerOptions& options, std::shared_ptr<const CallIdentity> identity, const BufferStore* store,
      PlanStore* plans, HealthService* health, std::function<void(int, uint64_t, uint64_t)> registered,
      std::function<void()> tick = [] {}, PeerView* peers = nullptr, std::function<void(bool)> registering = nullptr)
      : options_(options),
        identity_(std::move(identity)),
        store_(store),
        plans_(plans),
        health_(health),
        registered_(std::move(registered)),
        tick_(std::move(tick)),
        peers_(peers),
        registering_(std::move(registering)) {}
  ~Registration() { stop(); }

  // The first registration, of the worker serving at `address` (see WorkerServer::start).
  absl::Status start(const std::string& address);
  void start_heartbeats();
  // Says, in a heartbeat sent now and in every one after it, that this worker drains: the
  // coordinator sends it no new work (DeviceRecord::draining). Returns at once.
  void announce_draining();
  // Sends the next heartbeat now (a peer's stream waits for a fresh view). Returns at once.
  void beat_now();
  // Stops the heartbeats. Idempotent.
  void stop();
  // After a drain: stops the heartbeats, then tells the coordinator this worker leaves (a last
  // heartbeat with `leaving`), so it records the device as left rather than lost and fails
  // calls needing it at once. Waits at most two heartbeat intervals for the answer; a
  // coordinator that does not answer will mark the device lost instead. The coordinator's
  // error, if any (nothing to do about it: the worker exits either way).
  absl::Status leave();

  int device_id() const { return device_id_.load(); }

 private:
  // The first registration: attempts of at most kConnectDeadline each, every failure to reach
  // the coordinator logged and retried on a new channel (so a name that did not resolve is
  // looked up again), pauses from 1 s doubling to 5 s, until register_timeout.
  absl::Status register_until_deadline();
  // Registers (again) as `device_id` (-1: any), telling the coordinator which incarnation
  // this process held before, if any: its buffers are still here.
  // `wait_for_ready`: wait for the connection until the deadline, instead of failing at once
  // when the coordinator cannot be reached (the first registration retries by itself).
  absl::Status register_worker(int device_id, absl::Duration timeout, bool wait_for_ready);
  void heartbeat_loop();
  // Gives the view a reply brought (its ClusterPeers; nullptr: it had none) to peers_, for a
  // request that named the view of version `held` (0: none; PeerView::update); logs a malformed
  // or missing one, naming the `reply`.
  void take_view(uint64_t ticket, uint64_t held, const pb::ClusterPeers* peers, const char* reply);
  // Waits one heartbeat interval, or until woken (announce_draining, stop); true when stopping.
  bool wait_for_next_heartbeat();

  const WorkerOptions options_;
  const std::shared_ptr<const CallIdentity> identity_;  // what this worker sends the coordinator
  const BufferStore* const store_;
  PlanStore* const plans_;
  HealthService* const health_;
  const std::function<void(int, uint64_t, uint64_t)> registered_;
  const std::function<void()> tick_;
  PeerView* const peers_;
  const std::function<void(bool)> registering_;

  std::string address_;
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
  std::atomic<int> device_id_{-1};
  uint64_t incarnation_ = 0;
  uint64_t epoch_ = 0;  // of the coordinator incarnation this worker registered with
  absl::Duration heartbeat_interval_;

  std::atomic<bool> draining_{false};
  absl::Notification stopping_;
  absl::Mutex wake_mu_;
  bool wake_ ABSL_GUARDED_BY(wake_mu_) = false;  // send the next heartbeat now
  std::thread heartbeat_thread_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_REGISTRATION_H_

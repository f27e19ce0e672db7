// WorkerServer: one Tessera device — the Worker gRPC service over a BufferStore, registered
// with the coordinator and kept alive there by heartbeats.
//
// Used by tessera-worker (worker/main.cc) and by Client::local's embedded cluster.
//
//   WorkerOptions options;
//   options.coordinator_address = "127.0.0.1:5000";
//   absl::StatusOr<std::unique_ptr<WorkerServer>> worker = WorkerServer::start(options);
//   (*worker)->address();   // "127.0.0.1:<ephemeral port>"
//   (*worker)->shutdown();
#ifndef TESSERA_WORKER_WORKER_SERVER_H_
#define TESSERA_WORKER_WORKER_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/credentials.h"
#include "core/metrics.h"

namespace tessera {

class LocalRuns;  // proto/local_runs.h

struct WorkerOptions {
  std::string coordinator_address;
  // Address to advertise to the coordinator, clients and peers (an address or a name they
  // resolve), and to listen on unless bind_host is set.
  std::string host = "127.0.0.1";
  std::string bind_host;  // e.g. "0.0.0.0" when `host` is a name (a pod's DNS name)
  int port = 0;           // 0: an ephemeral port
  // Listen on no port: only this process reaches the worker, through in-process channels
  // (proto/in_process.h), at address() "in-process:<n>"; host, bind_host, port and
  // health_port are unused. What Client::local's embedded cluster does unless it runs TLS.
  bool in_process = false;
  // A plaintext port answering only grpc.health.v1 (proto/health.h), on the bind address, for
  // probes that speak no TLS; -1: none, 0: an ephemeral one.
  int health_port = -1;
  // Stable name; a worker restarting with the same name keeps its device id. Default: address.
  std::string name;
  int device_id = -1;  // -1: the coordinator picks
  int64_t memory_bytes = int64_t{2} << 30;
  // Collective data to workers of this host through shared memory (worker/collectives/
  // shm_ring.h): a ring per peer and direction of shm_ring_bytes, offered to peers on the host
  // named shm_host (empty: this one's boot id and IPC and network namespaces). Off: gRPC only.
  bool shm = true;
  int64_t shm_ring_bytes = int64_t{4} << 20;
  std::string shm_host;
  // Clients of this host (HandshakeReply.transfer_host, core/shm_transfer.h) put and fetch
  // through their memfds instead of streaming the bytes over gRPC. Off: streams only.
  bool shm_transfers = true;
  // With shm_transfers: a client's contiguous blocks are read from and written into its own
  // memory (ShmSegment::create_direct) once it is shown to hold the call's connection. Off:
  // such a segment is refused FAILED_PRECONDITION, and the client copies through its memfd.
  bool shm_client_memory = true;
  // For measuring worker/collectives/algorithms.h: "tree", "recursive_doubling", "direct" or
  // "ring" for every all_reduce of at most one chunk; empty: the table's choice.
  std::string all_reduce_algorithm;
  // How long to keep trying to register: each attempt that cannot reach the coordinator (its
  // name does not resolve yet, nothing listens yet) is logged and retried with a fresh channel.
  absl::Duration register_timeout = absl::Seconds(30);
  // Waits the pause between registration attempts; returning true (asked to stop: a daemon's
  // SIGTERM) ends start() with CANCELLED. Unset: the pause is slept.
  std::function<bool(absl::Duration)> wait_or_stop;
  // The tokens callers must present, and the cluster one this worker presents to the
  // coordinator and its peers (docs/design.md, "Security"). Empty: the development mode.
  Credentials credentials;
  // At most this many loaded plans (LoadPlan); a new one beyond it drops the least recently run
  // (the coordinator, which unloads what it evicts from its own cache, loads it again).
  int max_plans = 4096;
  // At most this many plans run at once on threads of their own (the others run where their
  // request arrived); one more fails RESOURCE_EXHAUSTED naming the limit.
  int max_plan_threads = 256;
  // Collective messages from one peer that may wait in the mailbox (charged to memory_bytes);
  // a message of an op that has not started here within mailbox_ttl of its arrival is dropped.
  int64_t mailbox_bytes_per_peer = int64_t{64} << 20;
  // Of those, messages of ops not started here when they arrived (MailboxOptions).
  int64_t mailbox_messages_per_peer = 1024;
  absl::Duration mailbox_ttl = absl::Seconds(60);
  // A PutShard stream that receives nothing for this long is cancelled and its reservation
  // released (checked every put_stall_timeout / 4 by a thread of its own), so a stalled client
  // cannot hold the memory or the thread.
  absl::Duration put_stall_timeout = absl::Seconds(10);
  // At most this many gRPC threads serve the synchronous methods (every method but RunPlans and
  // Exchange; one thread polls); a call that finds none fails RESOURCE_EXHAUSTED "Server
  // Threadpool Exhausted" (proto/rpc.h, configure_server). 2 to 65536.
  int max_sync_threads = 256;  // proto/rpc.h's kDefaultMaxSyncThreads
  // How long a drain waits with no run in flight before it counts the device as idle: the
  // time clients have to fetch what the last runs made before the worker exits.
  absl::Duration drain_quiet = absl::Milliseconds(200);
  // Freed memory back to the kernel (core/heap.h): once the arrays freed since the last such
  // trim (runs' intermediates and inputs, deleted arrays; HostArray::bytes_freed) reach
  // heap_trim_freed_bytes and no plan has run for heap_trim_quiet, the next heartbeat tick
  // calls malloc_trim. 0 bytes: never (only after unloads and dropped messages, as before).
  int64_t heap_trim_freed_bytes = int64_t{64} << 20;
  absl::Duration heap_trim_quiet = absl::Milliseconds(200);
};

class WorkerServer {
 public:
  // Binds, registers with the coordinator and starts heartbeating. Serves grpc.health.v1
  // (proto/health.h) from the bind: ready once registered, not ready while registering again.
  // DEADLINE_EXCEEDED if the coordinator cannot be reached within register_timeout, naming it
  // and the last attempt's error; the coordinator's error if it refuses the registration;
  // CANCELLED if wait_or_stop said so.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> start(const WorkerOptions& options);

  virtual ~WorkerServer() = default;

  virtual int device_id() const = 0;
  virtual std::string address() const = 0;
  // The plaintext health port (WorkerOptions::health_port), or -1.
  virtual int health_port() const = 0;
  // What --metrics_port reports (core/metrics.h): the stats GetStats answers, and histograms.
  virtual std::vector<MetricSample> metrics() = 0;
  virtual std::vector<const LatencyHistogram*> histograms() const = 0;

  // The first half of a graceful stop (SIGTERM): reports not ready, then waits until no plan
  // run has been in flight for WorkerOptions::drain_quiet (runs sent just before still arrive and finish; the
  // worker keeps heartbeating and serving meanwhile), at most `timeout`. Returns the runs still
  // in flight (0: drained), which shutdown() then fails. Then deregisters: the coordinator
  // records the device as left (DeviceState LEFT), not lost, and no heartbeat follows. Logs
  // what it waits for.
  virtual int64_t drain(absl::Duration timeout) = 0;

  // What this process's coordinator of the worker may hand runs to instead of a RunPlans
  // stream (proto/local_runs.h; Client::local's cluster gives it to its own coordinator, which
  // is the worker's by construction: the RunPlans handler's check that the caller is the
  // cluster's coordinator holds for it without a token). Opens nothing once shutdown() ran.
  virtual std::shared_ptr<LocalRuns> local_runs() = 0;

  // Stops the heartbeats only (the coordinator is about to go). Idempotent.
  virtual void stop_heartbeats() = 0;
  // Stops the worker as shutdown() does (heartbeats, in-process collectives, runs handed over
  // in process, which fail at once) but leaves its gRPC server answering until shutdown(): an
  // in-process server must not stop while channels made to it may still be called
  // (proto/in_process.h). For a test of an embedded worker that stops while its coordinator
  // stays up (LocalCluster::stop_worker). Idempotent when called one after another.
  // REQUIRES: not called concurrently with itself or shutdown().
  virtual void stop_all_but_server() = 0;
  // Stops heartbeats and the service, cancelling transfers in flight. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_WORKER_SERVER_H_

// CoordinatorServer: the Coordinator gRPC service — device registry with heartbeats,
// topology for clients, array metadata, and deletion fan-out to the workers.
//
// Used by tessera-coordinator (coordinator/main.cc) and by Client::local's embedded cluster.
//
//   absl::StatusOr<std::unique_ptr<CoordinatorServer>> c = CoordinatorServer::start({});
//   (*c)->address();    // "127.0.0.1:<ephemeral port>"
#ifndef TESSERA_COORDINATOR_COORDINATOR_SERVER_H_
#define TESSERA_COORDINATOR_COORDINATOR_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/credentials.h"
#include "core/metrics.h"

namespace tessera {

class LocalRuns;  // proto/local_runs.h

struct CoordinatorOptions {
  std::string host = "127.0.0.1";  // address to listen on
  int port = 0;                    // 0: an ephemeral port
  // Listen on no port: only this process reaches the coordinator, through in-process channels
  // (proto/in_process.h), at address() "in-process:<n>"; host, port and health_port are unused.
  // What Client::local's embedded cluster does unless it runs TLS.
  bool in_process = false;
  // A plaintext port answering only grpc.health.v1 (proto/health.h), on `host`, for probes that
  // speak no TLS; -1: none, 0: an ephemeral one.
  int health_port = -1;
  // Workers heartbeat every interval; one silent for `heartbeat_timeout` is marked lost.
  absl::Duration heartbeat_interval = absl::Milliseconds(500);
  absl::Duration heartbeat_timeout = absl::Seconds(3);
  // Log registrations to stderr (the daemon does; an embedded cluster stays quiet).
  bool log_registrations = false;
  // A client session not renewed for this long lapses: its arrays and programs are freed on
  // every worker (as are buffers of an earlier coordinator incarnation nobody adopts).
  absl::Duration lease_timeout = absl::Seconds(30);
  // grpc.health.v1 (proto/health.h) answers SERVING for "" while at least this many devices
  // are alive (checked at every monitor tick).
  int expected_devices = 0;
  // The tokens callers must present (docs/design.md, "Security"); the cluster one is also
  // what this coordinator presents to the workers. Empty: the development mode, nothing is
  // checked.
  Credentials credentials;
  // The compile cache holds at most this many programs (those running may exceed it for
  // their run); the least recently used one goes first, unloaded from the workers. A client
  // whose cached executable went compiles it again (Execute answers ABORTED).
  int max_programs = 1024;
  // First calls of programs whose plans are being loaded, at most this many at once (each
  // waits for the workers on a thread); one more fails RESOURCE_EXHAUSTED.
  int max_plan_loads = 64;
  // At most this many gRPC threads serve the synchronous methods (all but Execute, Heartbeat
  // and RegisterWorker; one thread polls); a call that finds none fails RESOURCE_EXHAUSTED
  // "Server Threadpool Exhausted" (proto/rpc.h, configure_server). 2 to 65536.
  int max_sync_threads = 256;  // proto/rpc.h's kDefaultMaxSyncThreads
};

class CoordinatorServer {
 public:
  // UNAVAILABLE if the port cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> start(const CoordinatorOptions& options);

  virtual ~CoordinatorServer() = default;
  virtual std::string address() const = 0;
  virtual int port() const = 0;  // 0 in process
  // The plaintext health port (CoordinatorOptions::health_port), or -1.
  virtual int health_port() const = 0;
  // What --metrics_port reports (core/metrics.h): counts of the registry, the compile cache
  // and executions, and histograms of compile and execute times.
  virtual std::vector<MetricSample> metrics() = 0;
  virtual std::vector<const LatencyHistogram*> histograms() const = 0;
  // Hands the runs of the worker at `worker_address` to `runs` instead of a RunPlans stream
  // (coordinator/worker_channels.h): for Client::local's cluster, which started that worker
  // in this process for this coordinator.
  virtual void hand_runs_in_process(const std::string& worker_address, std::shared_ptr<LocalRuns> runs) = 0;
  // Requests (runs, deletions, cancels) this coordinator handed to embedded workers in process
  // so far (WorkerChannels::handed_over).
  virtual int64_t requests_handed_over() const = 0;
  // Stops the service and the heartbeat monitor. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COORDINATOR_SERVER_H_

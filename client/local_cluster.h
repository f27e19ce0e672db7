// LocalCluster: a coordinator and n workers inside this process, reached through gRPC's
// in-process transport (proto/in_process.h), or on 127.0.0.1 ephemeral ports with TLS or
// LocalOptions::in_process off — what Client::local runs on, the stand-in for JAX's simulated
// CPU devices.
#ifndef TESSERA_CLIENT_LOCAL_CLUSTER_H_
#define TESSERA_CLIENT_LOCAL_CLUSTER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/coordinator_server.h"
#include "tessera/client.h"
#include "worker/worker_server.h"

namespace tessera::internal {

class LocalCluster {
 public:
  // Starts the coordinator, then the workers as devices 0 .. num_devices - 1.
  // The servers check `credentials` (none: the development mode).
  static absl::StatusOr<std::shared_ptr<LocalCluster>> start(int num_devices, const LocalOptions& options,
                                                             const Credentials& credentials);
  // Stops the workers' heartbeats, then the coordinator (nothing calls a worker after it), then
  // the workers: an in-process server must not be called once stopped (proto/in_process.h).
  ~LocalCluster();

  std::string coordinator_address() const { return coordinator_->address(); }

  // Requests (runs, deletions, cancels) this cluster's coordinator handed to its workers in
  // process so far (none over TCP): what a test reads to see that the calls took that path.
  int64_t requests_handed_over() const { return coordinator_->requests_handed_over(); }

  // For tests: stops the worker of `device` while the coordinator and the other workers go on,
  // as its process would stop (no heartbeat, no run taken; the runs handed to it fail
  // UNAVAILABLE naming it), except that its gRPC server answers until the cluster goes
  // (WorkerServer::stop_all_but_server). REQUIRES: 0 <= device < the cluster's devices, and
  // the cluster hands runs over in process (LocalOptions::in_process, no TLS): over TCP the
  // worker's RunPlans stream stays open and its runs go on until it is marked lost.
  void stop_worker(int device) { workers_.at(device)->stop_all_but_server(); }

  // The credentials of this process's embedded cluster whose coordinator is at `address`, or
  // none: what a Client::connect to it in the same process presents when given no token.
  static Credentials credentials_of(const std::string& address);
  // This process's embedded cluster whose coordinator is at `address`, or nullptr: a
  // Client::connect to it shares it, so that it lives as long as any of its clients.
  static std::shared_ptr<LocalCluster> find(const std::string& address);

 private:
  LocalCluster() = default;
  std::string registered_address_;  // in the process's table of embedded clusters (credentials_of)
  std::unique_ptr<CoordinatorServer> coordinator_;
  std::vector<std::unique_ptr<WorkerServer>> workers_;
};

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_LOCAL_CLUSTER_H_

#include "client/local_cluster.h"

#include <map>

#include "absl/base/const_init.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/status.h"
#include "worker/kernels/blas.h"

namespace tessera::internal {
namespace {

struct Embedded {
  Credentials credentials;
  std::weak_ptr<LocalCluster> cluster;
};
absl::Mutex clusters_mu(absl::kConstInit);
std::map<std::string, Embedded>& clusters() ABSL_EXCLUSIVE_LOCKS_REQUIRED(clusters_mu) {
  static auto* by_address = new std::map<std::string, Embedded>();
  return *by_address;
}

}  // namespace

Credentials LocalCluster::credentials_of(const std::string& address) {
  absl::MutexLock lock(&clusters_mu);
  auto it = clusters().find(address);
  return it == clusters().end() ? Credentials{} : it->second.credentials;
}

std::shared_ptr<LocalCluster> LocalCluster::find(const std::string& address) {
  absl::MutexLock lock(&clusters_mu);
  auto it = clusters().find(address);
  return it == clusters().end() ? nullptr : it->second.cluster.lock();
}

absl::StatusOr<std::shared_ptr<LocalCluster>> LocalCluster::start(int num_devices, const LocalOptions& options,
                                                                  const Credentials& credentials) {
  if (num_devices < 1 || num_devices > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("Client::local: num_devices must be in [1, 1024], got ", num_devices));
  }
  std::shared_ptr<LocalCluster> cluster(new LocalCluster());
  CoordinatorOptions coordinator_options;
  coordinator_options.heartbeat_interval = options.heartbeat_interval;
  coordinator_options.heartbeat_timeout = options.heartbeat_timeout;
  coordinator_options.credentials = credentials;
  // TLS needs a wire: a cluster with TLS files keeps TCP (and the daemons' mutual TLS).
  const bool in_process = options.in_process && !credentials.tls();
  coordinator_options.in_process = in_process;
  TESSERA_ASSIGN_OR_RETURN(cluster->coordinator_, CoordinatorServer::start(coordinator_options));
  cluster->registered_address_ = cluster->coordinator_->address();
  {
    absl::MutexLock lock(&clusters_mu);
    clusters()[cluster->registered_address_] = Embedded{credentials, cluster};
  }
  for (int i = 0; i < num_devices; ++i) {
    WorkerOptions worker_options;
    worker_options.coordinator_address = cluster->coordinator_->address();
    worker_options.name = absl::StrCat("local-", i);
    worker_options.device_id = i;
    worker_options.memory_bytes = options.memory_bytes_per_device;
    worker_options.credentials = credentials;
    worker_options.in_process = in_process;
    worker_options.all_reduce_algorithm = options.all_reduce_algorithm;
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<WorkerServer> worker, WorkerServer::start(worker_options));
    // In process, the coordinator hands this worker its runs by a call, not a stream message:
    // it is the worker's coordinator by construction (this cluster started both, with the same
    // credentials), so the RunPlans handler's check of its caller holds without a token.
    if (in_process) cluster->coordinator_->hand_runs_in_process(worker->address(), worker->local_runs());
    cluster->workers_.push_back(std::move(worker));
  }
  share_blas_threads(num_devices);  // the devices compute in this process's OpenBLAS
  return cluster;
}

LocalCluster::~LocalCluster() {
  if (!registered_address_.empty()) {
    absl::MutexLock lock(&clusters_mu);
    clusters().erase(registered_address_);
  }
  // The coordinator goes first: its shutdown closes its streams and in-process sessions (their
  // pending runs fail there, on its thread), so no run is handed to a worker that is stopping.
  // Each worker's shutdown then ends whatever session is still open (PlanRunner::
  // stop_local_runs: none, once the coordinator closed them) before its runner goes.
  for (auto& worker : workers_) worker->stop_heartbeats();
  if (coordinator_ != nullptr) coordinator_->shutdown();
  for (auto& worker : workers_) worker->shutdown();
}

}  // namespace tessera::internal

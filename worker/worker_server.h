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
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

struct WorkerOptions {
  std::string coordinator_address;
  // Address to listen on and to advertise to the coordinator and peers.
  std::string host = "127.0.0.1";
  int port = 0;  // 0: an ephemeral port
  // Stable name; a worker restarting with the same name keeps its device id. Default: address.
  std::string name;
  int device_id = -1;  // -1: the coordinator picks
  int64_t memory_bytes = int64_t{2} << 30;
  // How long to wait for the coordinator to answer the registration.
  absl::Duration register_timeout = absl::Seconds(30);
};

class WorkerServer {
 public:
  // Binds, registers with the coordinator and starts heartbeating. UNAVAILABLE or
  // DEADLINE_EXCEEDED if the coordinator cannot be reached within register_timeout;
  // the coordinator's error if it refuses the registration.
  static absl::StatusOr<std::unique_ptr<WorkerServer>> start(const WorkerOptions& options);

  virtual ~WorkerServer() = default;

  virtual int device_id() const = 0;
  virtual std::string address() const = 0;

  // Stops heartbeats and the service, cancelling transfers in flight. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_WORKER_SERVER_H_

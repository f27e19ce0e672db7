// HealthService: grpc.health.v1's Check for a Tessera daemon, with two service names.
//
//   ""          ready: a worker that has registered, a coordinator with its expected devices
//               alive (Kubernetes' readiness and startup probes, `tessera health`)
//   "liveness"  the process serves at all (Kubernetes' liveness probe: a worker waiting for
//               a restarted coordinator is alive, not ready, and must not be restarted)
//
// Any other name is NOT_FOUND, as the protocol says.
//
//   HealthService health;            // not ready
//   builder.RegisterService(health.service());
//   health.set_ready(true);
//
// A daemon serving TLS can also answer the same two names on a plaintext port of their own
// (`--health_port`): Kubernetes' gRPC probes speak no TLS, and the port says nothing but
// SERVING / NOT_SERVING, so it needs no credentials.
//
//   absl::StatusOr<std::unique_ptr<HealthPort>> port = health.serve_plaintext("0.0.0.0", 5001);
#ifndef TESSERA_PROTO_HEALTH_H_
#define TESSERA_PROTO_HEALTH_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace grpc {
class Service;
}

namespace tessera {

inline constexpr char kLivenessService[] = "liveness";

// A plaintext server answering only grpc.health.v1; stops (within 100 ms) when destroyed.
class HealthPort {
 public:
  virtual ~HealthPort() = default;
  virtual int port() const = 0;  // the bound port (the one asked for, or the ephemeral one for 0)
};

class HealthService {
 public:
  HealthService();
  ~HealthService();

  // The gRPC service to register with a ServerBuilder; owned by this object.
  grpc::Service* service();

  // Whether "" answers SERVING. Thread-safe; starts false.
  void set_ready(bool ready) { ready_.store(ready); }
  bool ready() const { return ready_.load(); }

  // Starts a plaintext server on host:port (0: an ephemeral port) answering as this service
  // does. UNAVAILABLE naming the address if it cannot listen. Must not outlive this object.
  absl::StatusOr<std::unique_ptr<HealthPort>> serve_plaintext(const std::string& host, int port);

  class Impl;  // the gRPC service (health.cc)

 private:
  std::atomic<bool> ready_{false};
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera

#endif  // TESSERA_PROTO_HEALTH_H_

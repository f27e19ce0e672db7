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
#ifndef TESSERA_PROTO_HEALTH_H_
#define TESSERA_PROTO_HEALTH_H_

#include <atomic>
#include <memory>

namespace grpc {
class Service;
}

namespace tessera {

inline constexpr char kLivenessService[] = "liveness";

class HealthService {
 public:
  HealthService();
  ~HealthService();

  // The gRPC service to register with a ServerBuilder; owned by this object.
  grpc::Service* service();

  // Whether "" answers SERVING. Thread-safe; starts false.
  void set_ready(bool ready) { ready_.store(ready); }
  bool ready() const { return ready_.load(); }

 private:
  class Impl;
  std::atomic<bool> ready_{false};
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera

#endif  // TESSERA_PROTO_HEALTH_H_

#include "proto/health.h"

#include "proto/health.grpc.pb.h"

namespace tessera {

namespace health = grpc::health::v1;

// The callback API: Check answers from an atomic, so it never blocks a gRPC thread.
class HealthService::Impl final : public health::Health::CallbackService {
 public:
  explicit Impl(const std::atomic<bool>* ready) : ready_(ready) {}

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx, const health::HealthCheckRequest* req,
                                  health::HealthCheckResponse* reply) override {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    if (req->service().empty()) {
      reply->set_status(ready_->load() ? health::HealthCheckResponse::SERVING
                                       : health::HealthCheckResponse::NOT_SERVING);
    } else if (req->service() == kLivenessService) {
      reply->set_status(health::HealthCheckResponse::SERVING);
    } else {
      reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "no health service '" + req->service() +
                                                                    "' (there are '' and '" + kLivenessService + "')"));
      return reactor;
    }
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const std::atomic<bool>* ready_;
};

HealthService::HealthService() : impl_(std::make_unique<Impl>(&ready_)) {}
HealthService::~HealthService() = default;

grpc::Service* HealthService::service() { return impl_.get(); }

}  // namespace tessera

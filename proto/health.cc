#include "proto/health.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
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

namespace {

class PlaintextHealthPort final : public HealthPort {
 public:
  PlaintextHealthPort(std::unique_ptr<HealthService::Impl> impl, std::unique_ptr<grpc::Server> server, int port)
      : impl_(std::move(impl)), server_(std::move(server)), port_(port) {}
  ~PlaintextHealthPort() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    server_->Wait();
  }
  int port() const override { return port_; }

 private:
  std::unique_ptr<HealthService::Impl> impl_;  // a service registers with one server: its own
  std::unique_ptr<grpc::Server> server_;
  int port_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HealthPort>> HealthService::serve_plaintext(const std::string& host, int port) {
  auto impl = std::make_unique<Impl>(&ready_);
  grpc::ServerBuilder builder;
  int bound = 0;
  builder.AddListeningPort(absl::StrCat(host, ":", port), grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(impl.get());
  // Probes only: a small request limit and few threads.
  builder.SetMaxReceiveMessageSize(4096);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port, " for health checks"));
  }
  return std::make_unique<PlaintextHealthPort>(std::move(impl), std::move(server), bound);
}

}  // namespace tessera

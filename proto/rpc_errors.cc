#include "proto/rpc_errors.h"

#include <grpcpp/support/server_interceptor.h>

#include <memory>

#include "absl/status/status.h"

namespace tessera {
namespace {

namespace gx = grpc::experimental;

class CountErrors final : public gx::Interceptor {
 public:
  CountErrors(RpcErrorCounter* counter, const char* method) : counter_(counter), method_(method) {}
  void Intercept(gx::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(gx::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (!status.ok()) counter_->add(method_ != nullptr ? method_ : "?", status.error_code());
    }
    methods->Proceed();
  }

 private:
  RpcErrorCounter* const counter_;
  const char* const method_;
};

class CountErrorsFactory final : public gx::ServerInterceptorFactoryInterface {
 public:
  explicit CountErrorsFactory(RpcErrorCounter* counter) : counter_(counter) {}
  gx::Interceptor* CreateServerInterceptor(gx::ServerRpcInfo* info) override {
    return new CountErrors(counter_, info->method());
  }

 private:
  RpcErrorCounter* const counter_;
};

}  // namespace

void RpcErrorCounter::install(grpc::ServerBuilder* builder) {
  std::vector<std::unique_ptr<gx::ServerInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<CountErrorsFactory>(this));
  builder->experimental().SetInterceptorCreators(std::move(factories));
}

void RpcErrorCounter::add(const std::string& method, grpc::StatusCode code) {
  absl::MutexLock lock(&mu_);
  std::pair<std::string, int> key{method, static_cast<int>(code)};
  // A client may name any method (they are answered UNIMPLEMENTED): past kMaxSeries pairs,
  // new ones count as method "other", so a scrape stays small.
  if (counts_.size() >= kMaxSeries && counts_.count(key) == 0) key.first = "other";
  ++counts_[key];
}

std::vector<MetricSample> RpcErrorCounter::samples(const std::string& name, const MetricLabels& labels) const {
  absl::MutexLock lock(&mu_);
  std::vector<MetricSample> out;
  for (const auto& [key, count] : counts_) {
    MetricLabels l = labels;
    l.emplace_back("method", key.first);
    l.emplace_back("code", absl::StatusCodeToString(static_cast<absl::StatusCode>(key.second)));
    out.push_back(counter(name, "RPCs this server answered with an error, by method and status code.",
                          static_cast<double>(count), std::move(l)));
  }
  return out;
}

}  // namespace tessera

// Counts the errors a daemon's gRPC server answers, by method and status code: the
// `tessera_<daemon>_rpc_errors_total{method, code}` metric (docs/design.md, "Metrics").
//
//   RpcErrorCounter errors;           // outlives the server
//   errors.install(&builder);         // before BuildAndStart
//   errors.samples("tessera_worker_rpc_errors_total", {{"device", "3"}})  // at each scrape
//
// A server interceptor reads each RPC's final status as it is sent (unary and streaming
// alike); counting takes a lock only for a non-OK status. Included only by the servers' .cc
// files (it pulls in gRPC).
#ifndef TESSERA_PROTO_RPC_ERRORS_H_
#define TESSERA_PROTO_RPC_ERRORS_H_

#include <grpcpp/server_builder.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/metrics.h"

namespace tessera {

class RpcErrorCounter {
 public:
  // At most this many (method, code) series, plus those of method "other".
  static constexpr size_t kMaxSeries = 256;

  // Adds the counting interceptor to `builder` (replacing any interceptors it had).
  void install(grpc::ServerBuilder* builder);
  void add(const std::string& method, grpc::StatusCode code);

  // A counter sample `name` per (method, code) counted so far, labelled `labels` and then
  // method ("/tessera.Worker/RunPlan") and code ("UNAVAILABLE").
  std::vector<MetricSample> samples(const std::string& name, const MetricLabels& labels) const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> counts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace tessera

#endif  // TESSERA_PROTO_RPC_ERRORS_H_

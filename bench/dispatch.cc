// bench_dispatch: latency of a cached jitted elementwise op on small (8, 8) arrays sharded over
// 8 local workers, next to a plain gRPC unary round trip measured in the same run.
//
//   bin/bench_dispatch [--iters=200] [--json]
#include <algorithm>
#include <cstdio>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "core/daemon.h"
#include "grpcpp/grpcpp.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"

ABSL_FLAG(int, iters, 200, "timed calls");
ABSL_FLAG(bool, json, false, "one JSON object instead of text");

namespace {

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * (v.size() - 1))];
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Times jit dispatch against a gRPC round trip.\nUsage: bench_dispatch [--iters=200]");
  tessera::parse_flags(argc, argv, "bench_dispatch", {});
  using namespace tessera;
  const int iters = std::max(10, absl::GetFlag(FLAGS_iters));
  absl::StatusOr<Client> client = Client::local(8);
  absl::StatusOr<Mesh> mesh = client.ok() ? client->make_mesh({4, 2}, {"data", "model"}) : client.status();
  if (!mesh.ok()) {
    std::fprintf(stderr, "bench_dispatch: %s\n", mesh.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Array> x =
      client->device_put(HostArray::ones(DType::kF32, {8, 8}), NamedSharding(*mesh, P("data", "model")));
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  std::vector<double> jit_us, rpc_us;
  for (int i = 0; i < iters + 10; ++i) {
    const absl::Time t = absl::Now();
    absl::StatusOr<std::vector<Array>> y = f({*x});
    const double us = absl::ToDoubleMicroseconds(absl::Now() - t);
    if (!y.ok()) {
      std::fprintf(stderr, "bench_dispatch: %s\n", y.status().ToString().c_str());
      return 1;
    }
    if (i >= 10) jit_us.push_back(us);
  }
  auto stub = pb::Coordinator::NewStub(make_channel(client->coordinator_address()));
  for (int i = 0; i < iters + 10; ++i) {
    pb::HandshakeRequest req;
    req.set_protocol_version(kProtocolVersion);
    pb::HandshakeReply reply;
    grpc::ClientContext ctx;
    const absl::Time t = absl::Now();
    stub->Handshake(&ctx, req, &reply);
    if (i >= 10) rpc_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  const double p50 = percentile(jit_us, 0.5), p99 = percentile(jit_us, 0.99), grpc50 = percentile(rpc_us, 0.5);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"p50_us\": %.1f, \"p99_us\": %.1f, \"grpc_p50_us\": %.1f}\n", p50, p99, grpc50);
  } else {
    std::printf(
        "cached jit (8, 8) on 8 workers: p50 %.0f us, p99 %.0f us; gRPC unary round trip p50 %.0f us "
        "(jit/rpc %.1fx)\n",
        p50, p99, grpc50, p50 / grpc50);
  }
  return 0;
}

// bench_matmul: a 2048x2048 float32 matmul jitted on one worker (a (1, 1) mesh) in GFLOP/s,
// next to OpenBLAS called directly in this process with the fastest kernel, same run.
//
//   bin/bench_matmul [--n=2048] [--iters=5] [--json]
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/daemon.h"
#include "core/subprocess.h"
#include "tessera/tessera.h"
#include "worker/kernels/blas.h"

ABSL_FLAG(int, n, 2048, "matrix size");
ABSL_FLAG(int, iters, 5, "timed repetitions (median)");
ABSL_FLAG(bool, json, false, "one JSON object instead of text");

int main(int argc, char** argv) {
  tessera::ensure_fast_blas(argv);  // the same kernel as the worker's, for a fair comparison
  absl::SetProgramUsageMessage("Times a jitted matmul on one worker against OpenBLAS.\nUsage: bench_matmul [--n=2048]");
  tessera::parse_flags(argc, argv, "bench_matmul", {});
  using namespace tessera;
  const int n = absl::GetFlag(FLAGS_n), iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const double flops = 2.0 * n * n * n;
  HostArray a = HostArray::ones(DType::kF32, {n, n}), b = HostArray::ones(DType::kF32, {n, n});
  HostArray c = HostArray::zeros(DType::kF32, {n, n});
  std::vector<double> blas;
  for (int i = 0; i < iters + 1; ++i) {
    const absl::Time t = absl::Now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.values<float>().data(), n,
                b.values<float>().data(), n, 0.0f, c.mutable_values<float>().data(), n);
    if (i > 0) blas.push_back(absl::ToDoubleSeconds(absl::Now() - t));
  }
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(executable_dir(), 1);
  absl::StatusOr<Client> client = cluster.ok() ? Client::connect(cluster->address) : cluster.status();
  absl::StatusOr<Mesh> mesh = client.ok() ? client->make_mesh({1, 1}, {"data", "model"}) : client.status();
  if (!mesh.ok()) {
    std::fprintf(stderr, "bench_matmul: %s\n", mesh.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Array> x = client->device_put(a, NamedSharding(*mesh, P()));
  absl::StatusOr<Array> y = client->device_put(b, NamedSharding(*mesh, P()));
  Jitted mm = jit([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; });
  std::vector<double> tessera_s;
  for (int i = 0; i < iters + 1; ++i) {
    const absl::Time t = absl::Now();
    absl::StatusOr<std::vector<Array>> out = mm({*x, *y});
    // jit returns at once: the time is the call until its result is ready, as in JAX.
    absl::Status done = out.ok() ? block_until_ready(*out) : out.status();
    if (!done.ok()) {
      std::fprintf(stderr, "bench_matmul: %s\n", done.ToString().c_str());
      return 1;
    }
    if (i > 0) tessera_s.push_back(absl::ToDoubleSeconds(absl::Now() - t));
  }
  absl::StatusOr<DeviceStats> stats = client->device_stats(0);
  const double g = flops / median(tessera_s) / 1e9, gb = flops / median(blas) / 1e9;
  const std::string kernel = stats.ok() ? stats->blas_kernel : "?";
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("{\"gflops\": %.2f, \"blas_gflops\": %.2f, \"kernel\": \"%s\"}\n", g, gb, kernel.c_str());
  } else {
    std::printf(
        "%dx%d float32 matmul: tessera (1 worker) %.1f GFLOP/s, OpenBLAS in-process %.1f GFLOP/s "
        "(%.2fx); worker kernel %s, local kernel %s\n",
        n, n, g, gb, g / gb, kernel.c_str(), openblas_get_corename());
  }
  return 0;
}

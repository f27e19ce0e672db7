// bench_collectives: each collective on 8 tessera-worker processes (and a coordinator) on
// 127.0.0.1, float32 buffers of several sizes; median time per op and bus bandwidth as
// nccl-tests counts it (S = the full buffer). When Open MPI is installed and
// bench_mpi_collectives was built, the same ops and sizes run under mpirun over TCP on
// loopback in the same run, and the ratios are printed side by side.
//
//   bin/bench_collectives [--ops=all_reduce,all_gather] [--bytes=4096,16777216] [--iters=10] [--json]

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/daemon.h"
#include "core/subprocess.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, ops, "all_reduce,all_gather,reduce_scatter,all_to_all,collective_permute,broadcast",
          "comma-separated collectives to run");
ABSL_FLAG(std::string, bytes, "4096,65536,1048576,16777216,67108864", "comma-separated buffer sizes S in bytes");
ABSL_FLAG(int, iters, 10, "timed repetitions per op and size (the median is reported)");
ABSL_FLAG(int, workers, 8, "worker processes");
ABSL_FLAG(bool, json, false, "print one JSON object per line instead of a table");
ABSL_FLAG(bool, mpi, true, "also run Open MPI over TCP when available");

namespace tessera {
namespace {

struct Result {
  double seconds = 0;  // the collective alone (as MPI times it after a barrier)
  double busbw_gbps = 0;
  double e2e_seconds = 0;  // the whole call from the client: dispatch through the coordinator included
};

// nccl-tests' bus bandwidth factor for S bytes on n ranks.
double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return double(n - 1) / n;
  return 1.0;
}

// The spec and the per-device input shape (float32) for `op` with full buffer S bytes.
std::pair<CollectiveSpec, Shape> setup(const std::string& op, int64_t bytes, int n) {
  CollectiveSpec spec;
  std::vector<int> all;
  for (int i = 0; i < n; ++i) all.push_back(i);
  spec.groups = {all};
  const int64_t elems = std::max<int64_t>(bytes / 4, n);
  Shape block = {1, elems};
  if (op == "all_reduce") {
    spec.kind = CollectiveKind::kAllReduce;
  } else if (op == "all_gather") {
    spec.kind = CollectiveKind::kAllGather;
    spec.dimension = 1;
    block = {1, elems / n};
  } else if (op == "reduce_scatter") {
    spec.kind = CollectiveKind::kReduceScatter;
    spec.dimension = 1;
    block = {1, elems / n * n};
  } else if (op == "all_to_all") {
    spec.kind = CollectiveKind::kAllToAll;
    spec.split_dimension = spec.concat_dimension = 1;
    block = {1, elems / n * n};
  } else if (op == "collective_permute") {
    spec.kind = CollectiveKind::kCollectivePermute;
    for (int i = 0; i < n; ++i) spec.pairs.emplace_back(i, (i + 1) % n);
  } else {
    spec.kind = CollectiveKind::kBroadcast;
  }
  return {spec, block};
}

absl::StatusOr<Result> run_tessera(const Client& client, const Mesh& mesh, const std::string& op, int64_t bytes,
                                   int iters) {
  const int n = static_cast<int>(mesh.size());
  auto [spec, block] = setup(op, bytes, n);
  absl::StatusOr<Array> x =
      client.device_put(HostArray::ones(DType::kF32, {n * block[0], block[1]}), NamedSharding(mesh, P("x")));
  if (!x.ok()) return x.status();
  std::vector<double> times, e2e;
  for (int i = 0; i < iters + 1; ++i) {
    const absl::Time start = absl::Now();
    CollectiveTiming timing;
    timing.barrier_first = true;
    absl::StatusOr<Array> y = run_collective(*x, spec, absl::Seconds(60), &timing);
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    if (!y.ok()) return y.status();
    if (i == 0) continue;  // the first run warms the streams up
    times.push_back(absl::ToDoubleSeconds(timing.collective));
    e2e.push_back(t);
  }
  Result r;
  r.seconds = median(times);
  r.e2e_seconds = median(e2e);
  r.busbw_gbps = double(bytes) * bus_factor(op, n) / r.seconds / 1e9;
  return r;
}

// Runs bench_mpi_collectives under mpirun; its JSON lines keyed by (op, bytes).
std::map<std::pair<std::string, int64_t>, Result> run_mpi(int n, const std::string& ops, const std::string& bytes,
                                                          int iters) {
  std::map<std::pair<std::string, int64_t>, Result> out;
  const std::string mpi_bench = executable_dir() + "/bench_mpi_collectives";
  if (access(mpi_bench.c_str(), X_OK) != 0) return out;
  absl::StatusOr<std::pair<int, std::string>> run =
      Subprocess::run({"/usr/bin/env", "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", std::to_string(n),
                       "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include",
                       "lo", mpi_bench, "--ops=" + ops, "--bytes=" + bytes, "--iters=" + std::to_string(iters)},
                      absl::Minutes(20));
  if (!run.ok() || run->first != 0) {
    std::fprintf(stderr, "bench_collectives: mpirun failed: %s\n",
                 run.ok() ? run->second.c_str() : run.status().ToString().c_str());
    return out;
  }
  std::istringstream lines(run->second);
  std::string line;
  while (std::getline(lines, line)) {
    char op[64];
    long long b = 0;
    double seconds = 0, busbw = 0;
    if (std::sscanf(line.c_str(), "{\"op\": \"%63[^\"]\", \"bytes\": %lld, \"seconds\": %lf, \"busbw_gbps\": %lf}", op,
                    &b, &seconds, &busbw) == 4) {
      out[{op, b}] = Result{seconds, busbw};
    }
  }
  return out;
}

int main_impl() {
  const int n = absl::GetFlag(FLAGS_workers);
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  std::vector<std::string> ops = absl::StrSplit(absl::GetFlag(FLAGS_ops), ',', absl::SkipEmpty());
  std::vector<int64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_bytes), ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v <= 0) {
      std::fprintf(stderr, "bench_collectives: --bytes: '%s' is not a positive integer\n", std::string(s).c_str());
      return 2;
    }
    sizes.push_back(v);
  }
  int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  absl::StatusOr<ProcessCluster> cluster =
      ProcessCluster::start(executable_dir(), n, {}, {absl::StrCat("--memory_bytes=", 6 * largest + (64 << 20))});
  if (!cluster.ok()) {
    std::fprintf(stderr, "bench_collectives: %s\n", cluster.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Client> client = Client::connect(cluster->address, {.min_devices = n});
  absl::StatusOr<Mesh> mesh = client.ok() ? client->make_mesh({n}, {"x"}) : client.status();
  if (!mesh.ok()) {
    std::fprintf(stderr, "bench_collectives: %s\n", mesh.status().ToString().c_str());
    return 1;
  }
  std::map<std::pair<std::string, int64_t>, Result> mpi;
  if (absl::GetFlag(FLAGS_mpi)) mpi = run_mpi(n, absl::GetFlag(FLAGS_ops), absl::GetFlag(FLAGS_bytes), iters);
  const bool json = absl::GetFlag(FLAGS_json);
  if (!json) {
    std::printf("%d worker processes on 127.0.0.1, float32, median of %d%s\n", n, iters,
                mpi.empty() ? " (Open MPI not run: install openmpi-bin libopenmpi-dev and rebuild to compare)" : "");
    std::printf(
        "time: the collective alone, slowest member, clocks started after a barrier (as MPI's);\n"
        "call: the whole run_collective call from the client (barrier and dispatch through the coordinator "
        "included)\n");
    std::printf("%-20s %10s %12s %12s %12s %12s %12s %10s\n", "op", "bytes", "time", "busbw GB/s", "call", "mpi time",
                "mpi GB/s", "time/mpi");
  }
  for (const std::string& op : ops) {
    for (int64_t bytes : sizes) {
      absl::StatusOr<Result> r = run_tessera(*client, *mesh, op, bytes, iters);
      if (!r.ok()) {
        std::fprintf(stderr, "bench_collectives: %s %lld: %s\n", op.c_str(), static_cast<long long>(bytes),
                     r.status().ToString().c_str());
        return 1;
      }
      auto m = mpi.find({op, bytes});
      if (json) {
        std::printf("{\"op\": \"%s\", \"bytes\": %lld, \"seconds\": %.9f, \"busbw_gbps\": %.4f, \"call_seconds\": %.9f",
                    op.c_str(), static_cast<long long>(bytes), r->seconds, r->busbw_gbps, r->e2e_seconds);
        if (m != mpi.end()) {
          std::printf(", \"mpi_seconds\": %.9f, \"mpi_busbw_gbps\": %.4f", m->second.seconds, m->second.busbw_gbps);
        }
        std::printf("}\n");
      } else {
        std::printf("%-20s %10lld %10.3fms %12.3f %10.3fms", op.c_str(), static_cast<long long>(bytes),
                    r->seconds * 1e3, r->busbw_gbps, r->e2e_seconds * 1e3);
        if (m != mpi.end()) {
          std::printf(" %10.3fms %12.3f %9.2fx", m->second.seconds * 1e3, m->second.busbw_gbps,
                      r->seconds / m->second.seconds);
        }
        std::printf("\n");
      }
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times Tessera's collectives on worker processes (and Open MPI's, when installed).\n"
      "Usage: bench_collectives [--ops=all_reduce,...] [--bytes=4096,...] [--iters=10] [--json]");
  tessera::parse_flags(argc, argv, "bench_collectives", {});
  return tessera::main_impl();
}

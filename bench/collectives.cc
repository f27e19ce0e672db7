// bench_collectives: each collective on 8 tessera-worker processes (and a coordinator) on
// 127.0.0.1, float32 buffers of several sizes; median time per op and bus bandwidth as
// nccl-tests counts it (S = the full buffer), on the shared-memory path, the gRPC path
// (workers started with --shm=false) or both, with the algorithm each size ran
// (worker/collectives/algorithms.h). When Open MPI's mpirun is on the PATH (looked up when
// the bench runs, not when it was configured), the same ops and sizes run under it over its
// shared-memory transport (btl vader) and over TCP on loopback in the same run, and the ratios
// are printed side by side: the shm path against MPI's shared memory, gRPC against MPI's TCP.
// bench_mpi_collectives is the one built next to this binary, or else compiled from
// bench/mpi_collectives.cc with mpicxx into a temporary directory.
//
//   bin/bench_collectives [--path=shm|grpc|both] [--ops=all_reduce,all_gather] [--bytes=4096,16777216]
//                         [--iters=10] [--json] [--all_reduce_algorithm=tree] [--keep_results=false]
//                         [--profile=/tmp/collectives]

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
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
#include "worker/collectives/algorithms.h"

ABSL_FLAG(std::string, ops, "all_reduce,all_gather,reduce_scatter,all_to_all,collective_permute,broadcast",
          "comma-separated collectives to run");
ABSL_FLAG(std::string, bytes, "4096,65536,1048576,16777216,67108864", "comma-separated buffer sizes S in bytes");
ABSL_FLAG(int, iters, 10, "timed repetitions per op and size (the median is reported)");
ABSL_FLAG(int, workers, 8, "worker processes");
ABSL_FLAG(bool, json, false, "print one JSON object per line instead of a table");
ABSL_FLAG(bool, mpi, true, "also run Open MPI (shared memory and TCP) when mpirun is on the PATH");
ABSL_FLAG(std::string, path, "both", "shm (workers share memory), grpc (workers run --shm=false) or both");
ABSL_FLAG(std::string, all_reduce_algorithm, "",
          "force every all_reduce up to 512 KiB to tree, recursive_doubling, direct or ring (tessera-worker's "
          "flag), to measure the thresholds of worker/collectives/algorithms.h");
ABSL_FLAG(bool, keep_results, true,
          "keep the timed runs' results until the last has run when they fit in 64 MiB per device, so that "
          "freeing one does not overlap the next; false: each goes at once, as before session 43");
ABSL_FLAG(std::string, profile, "",
          "record every path's timed runs in a timeline, PATH-<path>.json (Client::profile); empty: no profile");

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
  // An Array that goes frees its buffers on every worker (DeleteBuffers through the
  // coordinator, asynchronously): dropped in the loop, the last result's frees would run during
  // the next timed collective, as no MPI bench's do. The results are kept until the loop ends
  // while they fit in kHeldBytes per device (the small sizes, whose time those frees distort
  // most), otherwise each goes at once.
  constexpr int64_t kHeldBytes = int64_t{64} << 20;
  const bool hold = absl::GetFlag(FLAGS_keep_results) && (iters + 1) * bytes <= kHeldBytes;
  std::vector<Array> held;
  for (int i = 0; i < iters + 1; ++i) {
    const absl::Time start = absl::Now();
    CollectiveTiming timing;
    timing.barrier_first = true;
    absl::StatusOr<Array> y = run_collective(*x, spec, absl::Seconds(60), &timing);
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    if (!y.ok()) return y.status();
    if (hold) held.push_back(*std::move(y));
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

// The program `name` on the PATH, or "".
std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path == nullptr ? "/usr/bin:/bin" : path, ':', absl::SkipEmpty())) {
    const std::string candidate = absl::StrCat(dir, "/", name);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// bench_mpi_collectives: next to this binary when the build found MPI, or else compiled now
// from its source with mpicxx (so an Open MPI installed after the build is still compared).
// "" with the reason in `why` when neither works.
std::string mpi_bench_program(std::string* why) {
  const std::string built = executable_dir() + "/bench_mpi_collectives";
  if (access(built.c_str(), X_OK) == 0) return built;
  const std::string mpicxx = find_on_path("mpicxx");
  if (mpicxx.empty()) {
    *why = "mpirun is on the PATH but mpicxx is not (install libopenmpi-dev)";
    return "";
  }
  char dir[] = "/tmp/tessera-bench-mpi-XXXXXX";
  if (mkdtemp(dir) == nullptr) {
    *why = "cannot make a temporary directory";
    return "";
  }
  const std::string program = absl::StrCat(dir, "/bench_mpi_collectives");
  absl::StatusOr<std::pair<int, std::string>> built_now = Subprocess::run(
      {mpicxx, "-O2", "-std=c++17", "-o", program, TESSERA_SOURCE_DIR "/bench/mpi_collectives.cc"}, absl::Minutes(2));
  if (!built_now.ok() || built_now->first != 0) {
    *why = "mpicxx could not build bench/mpi_collectives.cc: " +
           (built_now.ok() ? built_now->second : built_now.status().ToString());
    return "";
  }
  return program;
}

// Runs bench_mpi_collectives under mpirun over Open MPI's `btl` ("vader,self": shared memory;
// "tcp,self": TCP on loopback); its JSON lines keyed by (op, bytes).
std::map<std::pair<std::string, int64_t>, Result> run_mpi(const std::string& mpirun, const std::string& program,
                                                          const std::string& btl, int n, const std::string& ops,
                                                          const std::string& bytes, int iters) {
  std::map<std::pair<std::string, int64_t>, Result> out;
  absl::StatusOr<std::pair<int, std::string>> run = Subprocess::run({mpirun,
                                                                     "--allow-run-as-root",
                                                                     "--oversubscribe",
                                                                     "-np",
                                                                     std::to_string(n),
                                                                     "--mca",
                                                                     "pml",
                                                                     "ob1",
                                                                     "--mca",
                                                                     "btl",
                                                                     btl,
                                                                     "--mca",
                                                                     "btl_tcp_if_include",
                                                                     "lo",
                                                                     "--mca",
                                                                     "oob_tcp_if_include",
                                                                     "lo",
                                                                     program,
                                                                     "--ops=" + ops,
                                                                     "--bytes=" + bytes,
                                                                     "--iters=" + std::to_string(iters)},
                                                                    absl::Minutes(20));
  if (!run.ok() || run->first != 0) {
    std::fprintf(stderr, "bench_collectives: mpirun (btl %s) failed: %s\n", btl.c_str(),
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

// The algorithm worker/collectives/algorithms.h picks for `op` of S = `bytes` on `path` (or
// the forced all_reduce one).
std::string algorithm_for(const std::string& op, int64_t bytes, int n, Path path) {
  const std::string forced = absl::GetFlag(FLAGS_all_reduce_algorithm);
  if (op == "all_reduce" && !forced.empty() && bytes <= (512 << 10)) return forced;
  return algorithm_name(choose_algorithm(setup(op, bytes, n).first.kind, bytes, n, path));
}

using MpiResults = std::map<std::pair<std::string, int64_t>, Result>;

// One path's cluster: every op and size, printed as it goes. 1 on a failure.
int run_path(Path path, int n, int iters, const std::vector<std::string>& ops, const std::vector<int64_t>& sizes,
             const MpiResults& mpi_shm, const MpiResults& mpi_tcp) {
  const int64_t largest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::string> worker_flags = {absl::StrCat("--memory_bytes=", 6 * largest + (64 << 20)),
                                           absl::StrCat("--shm=", path == Path::kShm ? "true" : "false")};
  if (const std::string forced = absl::GetFlag(FLAGS_all_reduce_algorithm); !forced.empty()) {
    worker_flags.push_back("--all_reduce_algorithm=" + forced);
  }
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(executable_dir(), n, {}, worker_flags);
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
  const bool json = absl::GetFlag(FLAGS_json);
  std::optional<ProfileScope> profile;
  if (const std::string p = absl::GetFlag(FLAGS_profile); !p.empty()) {
    absl::StatusOr<ProfileScope> started = client->profile(absl::StrCat(p, "-", path_name(path), ".json"));
    if (!started.ok()) {
      std::fprintf(stderr, "bench_collectives: --profile: %s\n", started.status().ToString().c_str());
      return 1;
    }
    profile.emplace(*std::move(started));
  }
  // The reference of the same kind: MPI's shared memory for ours, its TCP for gRPC.
  const MpiResults& same = path == Path::kShm ? mpi_shm : mpi_tcp;
  for (const std::string& op : ops) {
    for (int64_t bytes : sizes) {
      absl::StatusOr<Result> r = run_tessera(*client, *mesh, op, bytes, iters);
      if (!r.ok()) {
        std::fprintf(stderr, "bench_collectives: %s %lld on %s: %s\n", op.c_str(), static_cast<long long>(bytes),
                     path_name(path), r.status().ToString().c_str());
        return 1;
      }
      const std::string algorithm = algorithm_for(op, bytes, n, path);
      auto ms = mpi_shm.find({op, bytes});
      auto mt = mpi_tcp.find({op, bytes});
      auto m = same.find({op, bytes});
      if (json) {
        std::printf(
            "{\"op\": \"%s\", \"bytes\": %lld, \"path\": \"%s\", \"algorithm\": \"%s\", \"seconds\": %.9f, "
            "\"busbw_gbps\": %.4f, \"call_seconds\": %.9f",
            op.c_str(), static_cast<long long>(bytes), path_name(path), algorithm.c_str(), r->seconds, r->busbw_gbps,
            r->e2e_seconds);
        if (ms != mpi_shm.end()) {
          std::printf(", \"mpi_shm_seconds\": %.9f, \"mpi_shm_busbw_gbps\": %.4f", ms->second.seconds,
                      ms->second.busbw_gbps);
        }
        if (mt != mpi_tcp.end()) {
          std::printf(", \"mpi_seconds\": %.9f, \"mpi_busbw_gbps\": %.4f", mt->second.seconds, mt->second.busbw_gbps);
        }
        if (m != same.end()) std::printf(", \"busbw_vs_mpi\": %.4f", r->busbw_gbps / m->second.busbw_gbps);
        std::printf("}\n");
      } else {
        std::printf("%-18s %10lld %5s %-18s %9.3fms %9.3f %9.3fms", op.c_str(), static_cast<long long>(bytes),
                    path_name(path), algorithm.c_str(), r->seconds * 1e3, r->busbw_gbps, r->e2e_seconds * 1e3);
        for (const MpiResults* results : {&mpi_shm, &mpi_tcp}) {
          auto it = results->find({op, bytes});
          if (it != results->end()) {
            std::printf(" %9.3fms %9.3f", it->second.seconds * 1e3, it->second.busbw_gbps);
          } else {
            std::printf(" %11s %9s", "-", "-");
          }
        }
        if (m != same.end()) std::printf(" %8.2fx", r->busbw_gbps / m->second.busbw_gbps);
        std::printf("\n");
      }
      std::fflush(stdout);
    }
  }
  return 0;
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
  if (sizes.empty() || ops.empty()) {
    std::fprintf(stderr, "bench_collectives: --ops and --bytes must name at least one\n");
    return 2;
  }
  const std::string path_flag = absl::GetFlag(FLAGS_path);
  std::vector<Path> paths;
  if (path_flag == "shm" || path_flag == "both") paths.push_back(Path::kShm);
  if (path_flag == "grpc" || path_flag == "both") paths.push_back(Path::kGrpc);
  if (paths.empty()) {
    std::fprintf(stderr, "bench_collectives: --path: '%s' is none of shm, grpc, both\n", path_flag.c_str());
    return 2;
  }
  MpiResults mpi_shm, mpi_tcp;
  std::string no_mpi;
  if (!absl::GetFlag(FLAGS_mpi)) {
    no_mpi = "--mpi=false";
  } else if (const std::string mpirun = find_on_path("mpirun"); mpirun.empty()) {
    no_mpi = "no mpirun on the PATH: install openmpi-bin libopenmpi-dev (./dev bench does)";
  } else if (const std::string program = mpi_bench_program(&no_mpi); !program.empty()) {
    const std::string ops_flag = absl::GetFlag(FLAGS_ops), bytes_flag = absl::GetFlag(FLAGS_bytes);
    mpi_shm = run_mpi(mpirun, program, "vader,self", n, ops_flag, bytes_flag, iters);
    mpi_tcp = run_mpi(mpirun, program, "tcp,self", n, ops_flag, bytes_flag, iters);
  }
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("%d worker processes on 127.0.0.1, float32, median of %d%s%s\n", n, iters,
                no_mpi.empty() ? "" : "; Open MPI not run: ", no_mpi.c_str());
    std::printf(
        "time: the collective alone, slowest member, clocks started after a barrier (as MPI's);\n"
        "call: the whole run_collective call from the client (barrier and dispatch through the coordinator "
        "included);\n"
        "vs mpi: our bus bandwidth over Open MPI's on the same kind of path (shm: its shared memory, grpc: TCP)\n");
    std::printf("%-18s %10s %5s %-18s %11s %9s %11s %11s %9s %11s %9s %9s\n", "op", "bytes", "path", "algorithm",
                "time", "GB/s", "call", "mpi shm", "GB/s", "mpi tcp", "GB/s", "vs mpi");
  }
  for (Path path : paths) {
    if (int rc = run_path(path, n, iters, ops, sizes, mpi_shm, mpi_tcp); rc != 0) return rc;
  }
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times Tessera's collectives on worker processes (and Open MPI's, when installed).\n"
      "Usage: bench_collectives [--path=shm|grpc|both] [--ops=all_reduce,...] [--bytes=4096,...] [--iters=10] "
      "[--json]");
  tessera::parse_flags(argc, argv, "bench_collectives", {});
  return tessera::main_impl();
}

// bench_programs: the daemons' memory over many distinct programs (issue #17's goal: RSS
// flat within 10% over 30,000 calls with 4,000 distinct programs). Starts a coordinator and
// --workers tessera-worker processes on 127.0.0.1 twice: with the compile cache bounded
// (--max_programs, the default 1024) and, as the reference in the same run, with bounds
// beyond the program count (nothing evicted: what the daemons did before the bound). Each
// run compiles and calls --programs distinct programs (x * k + 1) once, then calls the most
// recent 256 of them until --calls calls were made in all, and prints the coordinator's and
// the largest worker's RSS (VmRSS) at every quarter of the programs and at the end.
//
//   bin/bench_programs [--programs=4000] [--calls=30000] [--workers=4] [--max_programs=1024]
//                      [--reference=false]

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "bench/stats.h"
#include "core/status.h"
#include "core/subprocess.h"
#include "tessera/tessera.h"

ABSL_FLAG(int, programs, 4000, "distinct programs compiled and called");
ABSL_FLAG(int, calls, 30000, "calls in all (the first --programs compile)");
ABSL_FLAG(int, workers, 4, "worker processes");
ABSL_FLAG(int, max_programs, 1024, "the coordinator's compile cache bound in the bounded run");
ABSL_FLAG(bool, reference, true, "also run the reference (bounds beyond the program count)");

namespace tessera {
namespace {

struct Sample {
  int programs = 0;
  int calls = 0;
  int64_t coordinator_kib = 0;
  int64_t worker_kib = 0;  // the largest worker's
};

Sample sample(const ProcessCluster& cluster, int programs, int calls) {
  Sample s{programs, calls, rss_kib(cluster.coordinator->pid()), 0};
  for (const auto& w : cluster.workers) s.worker_kib = std::max(s.worker_kib, rss_kib(w->pid()));
  return s;
}

// One cluster's run; the samples, or an error.
absl::StatusOr<std::vector<Sample>> run(int max_programs, int max_plans) {
  const int workers = absl::GetFlag(FLAGS_workers), programs = absl::GetFlag(FLAGS_programs);
  const int calls = absl::GetFlag(FLAGS_calls);
  char self[4096] = {};
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string path(self, n > 0 ? static_cast<size_t>(n) : 0);
  const std::string bin_dir = path.substr(0, path.rfind('/'));  // where the daemons are built too
  TESSERA_ASSIGN_OR_RETURN(
      ProcessCluster cluster,
      ProcessCluster::start(bin_dir, workers, {absl::StrCat("--max_programs=", max_programs)},
                            {absl::StrCat("--max_plans=", max_plans), "--memory_bytes=268435456"}));
  ConnectOptions options;
  options.min_devices = workers;
  TESSERA_ASSIGN_OR_RETURN(Client client, Client::connect(cluster.address, options));
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, client.make_mesh({workers}, {"x"}));
  const HostArray x0 = HostArray::arange(DType::kF32, {8 * workers});
  TESSERA_ASSIGN_OR_RETURN(Array x, client.device_put(x0, NamedSharding(mesh, P("x"))));
  std::vector<Sample> samples{sample(cluster, 0, 0)};
  std::vector<Jitted> recent;  // the last 256, called again after the distinct ones
  int made = 0;
  auto call = [&](Jitted& f, int k) -> absl::Status {
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> out, f({x}));
    TESSERA_ASSIGN_OR_RETURN(HostArray got, out[0].fetch());
    if (got.values<float>()[1] != x0.values<float>()[1] * static_cast<float>(k) + 1) {
      return absl::InternalError(absl::StrCat("program ", k, " computed a wrong value"));
    }
    ++made;
    return absl::OkStatus();
  };
  for (int k = 1; k <= programs; ++k) {
    Jitted f = jit([k](const std::vector<Value>& in) { return std::vector<Value>{in[0] * k + 1}; });
    TESSERA_RETURN_IF_ERROR(call(f, k));
    if (programs - k < 256) recent.push_back(std::move(f));
    if (k % (programs / 4) == 0) samples.push_back(sample(cluster, k, made));
  }
  for (int i = 0; made < calls; ++i) {
    const int index = i % static_cast<int>(recent.size());
    TESSERA_RETURN_IF_ERROR(call(recent[index], programs - static_cast<int>(recent.size()) + 1 + index));
  }
  samples.push_back(sample(cluster, programs, made));
  return samples;
}

int main_impl() {
  const int bound = absl::GetFlag(FLAGS_max_programs), programs = absl::GetFlag(FLAGS_programs);
  const int unbounded = 10 * programs + 1000;
  std::printf("%d distinct programs, %d calls, %d workers; RSS in MiB (coordinator / largest worker)\n", programs,
              absl::GetFlag(FLAGS_calls), absl::GetFlag(FLAGS_workers));
  std::vector<std::vector<Sample>> runs;
  std::vector<int> limits = {bound};
  if (absl::GetFlag(FLAGS_reference)) limits.push_back(unbounded);
  for (int limit : limits) {
    absl::StatusOr<std::vector<Sample>> samples = run(limit, limit == bound ? 4096 : unbounded);
    if (!samples.ok()) {
      std::fprintf(stderr, "bench_programs: %s\n", std::string(samples.status().message()).c_str());
      return 1;
    }
    runs.push_back(*std::move(samples));
  }
  if (runs.size() == 1) runs.push_back(runs[0]);  // no reference: its columns repeat the run
  std::printf("%10s %8s | %-28s | %-28s\n", "programs", "calls", absl::StrCat("--max_programs=", bound).c_str(),
              "reference (nothing evicted)");
  for (size_t i = 0; i < runs[0].size() && i < runs[1].size(); ++i) {
    const Sample &a = runs[0][i], &b = runs[1][i];
    std::printf("%10d %8d | %12.1f / %12.1f | %12.1f / %12.1f\n", a.programs, a.calls, a.coordinator_kib / 1024.0,
                a.worker_kib / 1024.0, b.coordinator_kib / 1024.0, b.worker_kib / 1024.0);
  }
  // Flat: the growth from the first quarter (past the bound's warm-up when programs >= 4 x
  // the bound) to the end, against the reference's growth over the same span.
  const Sample &a0 = runs[0][1], &a1 = runs[0].back(), &b0 = runs[1][1], &b1 = runs[1].back();
  std::printf(
      "growth from %d programs to the end: coordinator %+.1f%% (reference %+.1f%%), worker %+.1f%% "
      "(reference %+.1f%%)\n",
      a0.programs, 100.0 * (a1.coordinator_kib - a0.coordinator_kib) / a0.coordinator_kib,
      100.0 * (b1.coordinator_kib - b0.coordinator_kib) / b0.coordinator_kib,
      100.0 * (a1.worker_kib - a0.worker_kib) / a0.worker_kib, 100.0 * (b1.worker_kib - b0.worker_kib) / b0.worker_kib);
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return tessera::main_impl();
}

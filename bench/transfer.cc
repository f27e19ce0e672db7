// bench_transfer: device_put + fetch of a large float32 array on 8 devices, next to a plain
// memcpy of the same bytes measured in the same run: on Client::local(8) (in process), and on 8
// tessera-worker processes and a coordinator on 127.0.0.1 reached with Client::connect, whose
// transfers go through shared memory (a memfd per block, which the workers adopt on a put:
// core/shm_transfer.h; "processes/shm") and over gRPC streams (ConnectOptions::shared_memory =
// false: "processes/grpc"), one client after the other on the same workers; shared memory
// between the workers either way.
//
//   bin/bench_transfer [--mib=256] [--iters=3] [--cluster=in_process|processes|both]
//                      [--path=shm|grpc|both] [--layouts=all|data,data_model,replicated]
//                      [--adopt_puts] [--json]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/daemon.h"
#include "core/subprocess.h"
#include "tessera/tessera.h"

ABSL_FLAG(int, mib, 256, "array size in MiB");
ABSL_FLAG(int, iters, 3, "repetitions; the median is reported");
ABSL_FLAG(bool, json, false, "one JSON object per line instead of a table");
ABSL_FLAG(std::string, cluster, "both",
          "in_process (Client::local(8)), processes (8 tessera-worker processes, Client::connect) or both");
ABSL_FLAG(std::string, path, "both",
          "with processes: the client's transfers through shared memory (shm), gRPC streams (grpc) or both");
ABSL_FLAG(std::string, layouts, "all",
          "the layouts timed: all, or a comma-separated subset of data (P('data', None)), data_model "
          "(P('data', 'model')) and replicated (P())");
ABSL_FLAG(bool, adopt_puts, false,
          "with processes/shm: the workers adopt each put's memfd (ConnectOptions::adopt_puts), row "
          "processes/shm+adopt");

namespace tessera {
namespace {

// Puts and fetches `host` in each layout on `client`'s (4, 2) mesh; prints a row each. 1 on a failure.
int run_layouts(const Client& client, const std::string& cluster, const HostArray& host, int iters, double base) {
  absl::StatusOr<Mesh> mesh = client.make_mesh({4, 2}, {"data", "model"});
  if (!mesh.ok()) {
    std::fprintf(stderr, "bench_transfer: %s\n", mesh.status().ToString().c_str());
    return 1;
  }
  const std::string layouts = absl::GetFlag(FLAGS_layouts);
  const std::vector<std::string> asked = absl::StrSplit(layouts, ',');
  const bool all = std::find(asked.begin(), asked.end(), "all") != asked.end();
  for (const auto& [name, spec] : {std::pair{"data", P("data", None)}, std::pair{"data_model", P("data", "model")},
                                   std::pair{"replicated", P()}}) {
    if (!all && std::find(asked.begin(), asked.end(), name) == asked.end()) continue;
    std::vector<double> put_s, fetch_s;
    for (int i = 0; i < iters; ++i) {
      absl::Time t = absl::Now();
      absl::StatusOr<Array> a = client.device_put(host, NamedSharding(*mesh, spec));
      put_s.push_back(absl::ToDoubleSeconds(absl::Now() - t));
      if (!a.ok()) {
        std::fprintf(stderr, "device_put: %s\n", a.status().ToString().c_str());
        return 1;
      }
      t = absl::Now();
      absl::StatusOr<HostArray> back = a->fetch();
      fetch_s.push_back(absl::ToDoubleSeconds(absl::Now() - t));
      if (!back.ok() || *back != host) {
        std::fprintf(stderr, "fetch: %s\n", back.ok() ? "values differ" : back.status().ToString().c_str());
        return 1;
      }
    }
    const double put = median(put_s), fetch = median(fetch_s);
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"cluster\": \"%s\", \"layout\": \"%s\", \"bytes\": %lld, \"put_seconds\": %.6f, \"fetch_seconds\": %.6f, "
          "\"memcpy_seconds\": %.6f}\n",
          cluster.c_str(), spec.to_string().c_str(), static_cast<long long>(host.nbytes()), put, fetch, base);
    } else {
      std::printf("%-15s %-24s %12.1f %12.1f %12.1fx %12.1fx\n", cluster.c_str(), spec.to_string().c_str(), put * 1e3,
                  fetch * 1e3, put / base, fetch / base);
    }
  }
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times device_put and fetch against memcpy.\nUsage: bench_transfer [--mib=256] [--iters=3] "
      "[--cluster=in_process|processes|both] [--path=shm|grpc|both] [--layouts=all|data,data_model,replicated] "
      "[--adopt_puts] [--json]");
  tessera::parse_flags(argc, argv, "bench_transfer", {});
  using namespace tessera;
  for (const absl::string_view layout : absl::StrSplit(absl::GetFlag(FLAGS_layouts), ',')) {
    if (layout != "all" && layout != "data" && layout != "data_model" && layout != "replicated") {
      std::fprintf(stderr, "bench_transfer: --layouts names '%s', none of all, data, data_model, replicated\n",
                   std::string(layout).c_str());
      return 1;
    }
  }
  const int64_t mib = absl::GetFlag(FLAGS_mib);
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const int64_t cols = 1024;
  const Shape shape = {mib * 256, cols};  // float32 rows of 4 KiB
  HostArray host = HostArray::arange(DType::kF32, shape);
  HostArray copy(DType::kF32, shape);

  std::vector<double> memcpy_s;
  for (int i = 0; i < iters; ++i) {
    const absl::Time t = absl::Now();
    std::memcpy(copy.data(), host.data(), static_cast<size_t>(host.nbytes()));
    memcpy_s.push_back(absl::ToDoubleSeconds(absl::Now() - t));
  }

  const bool json = absl::GetFlag(FLAGS_json);
  const double base = median(memcpy_s);
  const double gib = static_cast<double>(host.nbytes()) / (1 << 30);
  if (!json) {
    std::printf("%lld MiB float32 on 8 workers; memcpy %.1f ms (%.2f GiB/s)\n", static_cast<long long>(mib), base * 1e3,
                gib / base);
    std::printf("%-15s %-24s %12s %12s %12s %12s\n", "cluster", "layout", "put ms", "fetch ms", "put/memcpy",
                "fetch/memcpy");
  }
  const std::string which = absl::GetFlag(FLAGS_cluster);
  if (which != "in_process" && which != "processes" && which != "both") {
    std::fprintf(stderr, "bench_transfer: --cluster=%s is none of in_process, processes, both\n", which.c_str());
    return 1;
  }
  const std::string path = absl::GetFlag(FLAGS_path);
  if (path != "shm" && path != "grpc" && path != "both") {
    std::fprintf(stderr, "bench_transfer: --path=%s is none of shm, grpc, both\n", path.c_str());
    return 1;
  }
  const int64_t memory = std::max<int64_t>(int64_t{4} << 30, 4 * host.nbytes());
  if (which != "processes") {
    absl::StatusOr<Client> client = Client::local(8, {.memory_bytes_per_device = memory});
    if (!client.ok()) {
      std::fprintf(stderr, "bench_transfer: %s\n", client.status().ToString().c_str());
      return 1;
    }
    if (run_layouts(*client, "in_process", host, iters, base) != 0) return 1;
  }
  if (which != "in_process") {
    absl::StatusOr<ProcessCluster> cluster =
        ProcessCluster::start(executable_dir(), 8, {}, {absl::StrCat("--memory_bytes=", memory)});
    if (!cluster.ok()) {
      std::fprintf(stderr, "bench_transfer: %s\n", cluster.status().ToString().c_str());
      return 1;
    }
    for (const bool shm : {true, false}) {
      if (path == (shm ? "grpc" : "shm")) continue;
      const bool adopt = shm && absl::GetFlag(FLAGS_adopt_puts);
      absl::StatusOr<Client> client =
          Client::connect(cluster->address, {.min_devices = 8, .shared_memory = shm, .adopt_puts = adopt});
      if (!client.ok()) {
        std::fprintf(stderr, "bench_transfer: %s\n", client.status().ToString().c_str());
        return 1;
      }
      const char* label = adopt ? "processes/shm+adopt" : shm ? "processes/shm" : "processes/grpc";
      if (run_layouts(*client, label, host, iters, base) != 0) return 1;
    }
  }
  return 0;
}

// bench_transfer: device_put + fetch of a large float32 array on Client::local(8), next to a
// plain memcpy of the same bytes measured in the same run.
//
//   bin/bench_transfer [--mib=256] [--iters=3] [--json]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/daemon.h"
#include "tessera/tessera.h"

ABSL_FLAG(int, mib, 256, "array size in MiB");
ABSL_FLAG(int, iters, 3, "repetitions; the median is reported");
ABSL_FLAG(bool, json, false, "one JSON object per line instead of a table");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times device_put and fetch against memcpy.\nUsage: bench_transfer [--mib=256] [--iters=3] [--json]");
  tessera::parse_flags(argc, argv, "bench_transfer", {});
  using namespace tessera;
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

  absl::StatusOr<Client> client = Client::local(8, {.memory_bytes_per_device = int64_t{4} << 30});
  if (!client.ok()) {
    std::fprintf(stderr, "bench_transfer: %s\n", client.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  const double base = median(memcpy_s);
  const double gib = static_cast<double>(host.nbytes()) / (1 << 30);
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("%lld MiB float32 on 8 local workers; memcpy %.1f ms (%.2f GiB/s)\n", static_cast<long long>(mib),
                base * 1e3, gib / base);
    std::printf("%-24s %12s %12s %12s %12s\n", "layout", "put ms", "fetch ms", "put/memcpy", "fetch/memcpy");
  }
  for (const PartitionSpec& spec : {P("data", None), P("data", "model"), P()}) {
    std::vector<double> put_s, fetch_s;
    for (int i = 0; i < iters; ++i) {
      absl::Time t = absl::Now();
      absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, spec));
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
          "{\"layout\": \"%s\", \"bytes\": %lld, \"put_seconds\": %.6f, \"fetch_seconds\": %.6f, "
          "\"memcpy_seconds\": %.6f}\n",
          spec.to_string().c_str(), static_cast<long long>(host.nbytes()), put, fetch, base);
    } else {
      std::printf("%-24s %12.1f %12.1f %12.1fx %12.1fx\n", spec.to_string().c_str(), put * 1e3, fetch * 1e3, put / base,
                  fetch / base);
    }
  }
  return 0;
}

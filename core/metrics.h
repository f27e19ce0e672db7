// Prometheus metrics of a daemon (docs/design.md, "Metrics"): `GET /metrics` on a port of its
// own (`--metrics_port`), in the Prometheus text format, served by prometheus-cpp's Exposer.
//
//   LatencyHistogram runs("tessera_worker_plan_run_seconds", "Plan runs, from start to outputs stored.");
//   runs.observe(absl::Now() - start);          // any thread; lock-free
//   absl::StatusOr<std::unique_ptr<MetricsServer>> m = MetricsServer::start(
//       "0.0.0.0", 9100, [&] { return std::vector<MetricSample>{gauge("tessera_worker_buffers", "...", 3)}; },
//       {&runs});
//
// The samples come from a function called at each scrape, on the exporter's own threads (never
// a gRPC thread), so a daemon reports what it already counts (its stats) without a second set
// of counters. Names follow Prometheus' conventions: `_total` counters, `_seconds`, `_bytes`.
// No prometheus-cpp header here.
#ifndef TESSERA_CORE_METRICS_H_
#define TESSERA_CORE_METRICS_H_

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tessera {

struct MetricSample {
  enum Type { kCounter, kGauge };
  std::string name;
  std::string help;
  Type type = kGauge;
  double value = 0;
  std::vector<std::pair<std::string, std::string>> labels;  // e.g. {{"code", "UNAVAILABLE"}}
};
using MetricLabels = std::vector<std::pair<std::string, std::string>>;
inline MetricSample gauge(std::string name, std::string help, double value, MetricLabels labels = {}) {
  return {std::move(name), std::move(help), MetricSample::kGauge, value, std::move(labels)};
}
inline MetricSample counter(std::string name, std::string help, double value, MetricLabels labels = {}) {
  return {std::move(name), std::move(help), MetricSample::kCounter, value, std::move(labels)};
}

// A histogram of durations with fixed buckets (seconds, upper bounds), counted with atomics.
class LatencyHistogram {
 public:
  // Default buckets: 100 µs to 60 s, roughly ×2.5 apart. Histograms of one name with
  // different `labels` are one family (e.g. one per collective op, algorithm and path). One
  // with labels is served once it has observed something (as a labelled counter appears
  // once its labels occur: no series for combinations that never ran); one without, always.
  LatencyHistogram(std::string name, std::string help, std::vector<double> bounds = {}, MetricLabels labels = {});
  void observe(absl::Duration d);

  struct Snapshot {
    std::vector<double> bounds;
    std::vector<uint64_t> cumulative;  // per bound, then +Inf
    uint64_t count = 0;
    double sum_seconds = 0;
  };
  Snapshot snapshot() const;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const MetricLabels& labels() const { return labels_; }

 private:
  const std::string name_, help_;
  const MetricLabels labels_;
  const std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, the last one +Inf
  std::atomic<uint64_t> count_{0};
  std::atomic<int64_t> sum_nanos_{0};
};

class MetricsServer {
 public:
  virtual ~MetricsServer() = default;
  // Serves GET /metrics on host:port (0: an ephemeral port): `source`'s samples and
  // `histograms` (which must outlive the server). UNAVAILABLE naming the address if it cannot
  // listen.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> start(const std::string& host, int port,
                                                              std::function<std::vector<MetricSample>()> source,
                                                              std::vector<const LatencyHistogram*> histograms);
  virtual int port() const = 0;
};

// A daemon's --metrics_port: serves `daemon`'s metrics() and histograms() on host:port and
// prints "NAME: metrics on port N"; nullptr when port < 0 (none). The error names the flag.
template <typename Daemon>
absl::StatusOr<std::unique_ptr<MetricsServer>> serve_daemon_metrics(const char* name, Daemon* daemon,
                                                                    const std::string& host, int port) {
  if (port < 0) return nullptr;
  absl::StatusOr<std::unique_ptr<MetricsServer>> started = MetricsServer::start(
      host, port, [daemon] { return daemon->metrics(); }, daemon->histograms());
  if (!started.ok())
    return absl::Status(started.status().code(), "--metrics_port: " + std::string(started.status().message()));
  std::printf("%s: metrics on port %d\n", name, (*started)->port());
  return started;
}

}  // namespace tessera

#endif  // TESSERA_CORE_METRICS_H_

// CollectiveMetrics: what one device's collectives did, by kind, algorithm and the path whose
// threshold table chose the algorithm (algorithms.h), for tessera-worker --metrics_port:
// counts, failures, input bytes and a latency histogram for each combination. Lock-free (atomics);
// the Transport owns one, the engine records every run_collective into it.
//
//   metrics.record(CollectiveKind::kAllReduce, Algorithm::kTree, Path::kShm, 4096, took, true);
//   for (const CollectiveMetrics::Row& r : metrics.rows()) ...   // the combinations seen
#ifndef TESSERA_WORKER_COLLECTIVES_COLLECTIVE_METRICS_H_
#define TESSERA_WORKER_COLLECTIVES_COLLECTIVE_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/time/time.h"
#include "core/collective.h"
#include "core/metrics.h"
#include "worker/collectives/algorithms.h"

namespace tessera {

class CollectiveMetrics {
 public:
  static constexpr int kKinds = static_cast<int>(CollectiveKind::kRaggedAllToAll) + 1;  // CollectiveKind's values
  static constexpr int kAlgorithms = 5;                                                 // Algorithm's values
  static constexpr int kPaths = 3;                                                      // Path's values

  // One latency histogram per combination (labels op, algorithm and path); each appears in
  // the scrape once it has observed a collective (core/metrics.h).
  CollectiveMetrics() {
    for (int k = 0; k < kKinds; ++k) {
      for (int a = 0; a < kAlgorithms; ++a) {
        for (int p = 0; p < kPaths; ++p) {
          cells_[index(static_cast<CollectiveKind>(k), static_cast<Algorithm>(a), static_cast<Path>(p))].latency =
              std::make_unique<LatencyHistogram>(
                  "tessera_worker_collective_seconds",
                  "Collectives on this device, from its start to its result, by op, algorithm and path.",
                  std::vector<double>{},
                  MetricLabels{{"op", collective_name(static_cast<CollectiveKind>(k))},
                               {"algorithm", algorithm_name(static_cast<Algorithm>(a))},
                               {"path", path_name(static_cast<Path>(p))}});
        }
      }
    }
  }

  void record(CollectiveKind kind, Algorithm algorithm, Path path, int64_t bytes, absl::Duration took, bool ok) {
    Cell& c = cells_[index(kind, algorithm, path)];
    c.count.fetch_add(1, std::memory_order_relaxed);
    if (!ok) c.failed.fetch_add(1, std::memory_order_relaxed);
    c.bytes.fetch_add(bytes, std::memory_order_relaxed);
    c.latency->observe(took);
  }

  struct Row {
    CollectiveKind kind;
    Algorithm algorithm;
    Path path;
    int64_t count, failed, bytes;
  };
  // Every combination that ran at least once.
  std::vector<Row> rows() const {
    std::vector<Row> out;
    for (int k = 0; k < kKinds; ++k) {
      for (int a = 0; a < kAlgorithms; ++a) {
        for (int p = 0; p < kPaths; ++p) {
          const Cell& c = cells_[(k * kAlgorithms + a) * kPaths + p];
          const int64_t n = c.count.load(std::memory_order_relaxed);
          if (n == 0) continue;
          out.push_back({static_cast<CollectiveKind>(k), static_cast<Algorithm>(a), static_cast<Path>(p), n,
                         c.failed.load(std::memory_order_relaxed), c.bytes.load(std::memory_order_relaxed)});
        }
      }
    }
    return out;
  }
  std::vector<const LatencyHistogram*> histograms() const {
    std::vector<const LatencyHistogram*> out;
    for (const Cell& c : cells_) out.push_back(c.latency.get());
    return out;
  }

 private:
  static int index(CollectiveKind kind, Algorithm algorithm, Path path) {
    return (static_cast<int>(kind) * kAlgorithms + static_cast<int>(algorithm)) * kPaths + static_cast<int>(path);
  }
  struct Cell {
    std::atomic<int64_t> count{0}, failed{0}, bytes{0};
    std::unique_ptr<LatencyHistogram> latency;  // set by the constructor
  };
  std::array<Cell, kKinds * kAlgorithms * kPaths> cells_;
};

}  // namespace tessera

#endif  // TESSERA_WORKER_COLLECTIVES_COLLECTIVE_METRICS_H_

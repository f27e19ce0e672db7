#include "core/metrics.h"

namespace tessera {

namespace {

std::vector<double> default_bounds() {
  return {1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

}  // namespace

LatencyHistogram::LatencyHistogram(std::string name, std::string help, std::vector<double> bounds, MetricLabels labels)
    : name_(std::move(name)),
      help_(std::move(help)),
      labels_(std::move(labels)),
      bounds_(bounds.empty() ? default_bounds() : std::move(bounds)),
      counts_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void LatencyHistogram::observe(absl::Duration d) {
  const double seconds = absl::ToDoubleSeconds(d);
  size_t bucket = 0;
  while (bucket < bounds_.size() && seconds > bounds_[bucket]) ++bucket;
  counts_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_nanos_.fetch_add(absl::ToInt64Nanoseconds(d), std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

LatencyHistogram::Snapshot LatencyHistogram::snapshot() const {
  Snapshot s;
  s.bounds = bounds_;
  uint64_t running = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    running += counts_[i].load(std::memory_order_relaxed);
    s.cumulative.push_back(running);
  }
  // Every observation is in one bucket: the total is the buckets' sum, so the +Inf bucket and
  // the count agree even while observations race with the scrape.
  running += counts_[bounds_.size()].load(std::memory_order_relaxed);
  s.cumulative.push_back(running);
  s.count = running;
  s.sum_seconds = static_cast<double>(sum_nanos_.load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

}  // namespace tessera

// Order statistics of benchmark samples, shared by the bench_* programs.
//
//   double m = median(times);              // the upper median: v[n / 2] once sorted
//   double p99 = percentile(times, 0.99);  // v[p * (n - 1)] once sorted
#ifndef TESSERA_BENCH_STATS_H_
#define TESSERA_BENCH_STATS_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace tessera {

// REQUIRES: !v.empty().
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// REQUIRES: !v.empty(), 0 <= p <= 1.
inline double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

}  // namespace tessera

#endif  // TESSERA_BENCH_STATS_H_

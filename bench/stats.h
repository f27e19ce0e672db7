// Order statistics of benchmark samples, the compiler's byte accounting and a process's
// resident memory, shared by the bench_* programs.
//
//   double m = median(times);              // the upper median: v[n / 2] once sorted
//   double p99 = percentile(times, 0.99);  // v[p * (n - 1)] once sorted
#ifndef TESSERA_BENCH_STATS_H_
#define TESSERA_BENCH_STATS_H_

#include <sys/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace tessera {

// VmRSS of process `pid` in KiB, from /proc/PID/status (0 if unreadable).
inline int64_t rss_kib(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) != 0) continue;
    int64_t kib = 0;
    std::string digits;
    for (char c : line) {
      if (c >= '0' && c <= '9') digits.push_back(c);
    }
    return absl::SimpleAtoi(digits, &kib) ? kib : 0;
  }
  return 0;
}

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

// The compiler's accounting in the header line of a program's as_text(): "..., 16 collectives,
// 20393037 bytes received per device". Zeros when the text has no such line.
struct PlanFigures {
  double bytes = 0;  // received by each device per run
  int collectives = 0;
};
inline PlanFigures parse_plan_header(const std::string& text) {
  PlanFigures f;
  const size_t bytes_at = text.find(" bytes received per device");
  const size_t coll_at = text.find(" collective");
  if (bytes_at == std::string::npos || coll_at == std::string::npos) return f;
  const size_t b0 = text.rfind(' ', bytes_at - 1) + 1, c0 = text.rfind(' ', coll_at - 1) + 1;
  double bytes = 0;
  int collectives = 0;
  if (absl::SimpleAtod(text.substr(b0, bytes_at - b0), &bytes)) f.bytes = bytes;
  if (absl::SimpleAtoi(text.substr(c0, coll_at - c0), &collectives)) f.collectives = collectives;
  return f;
}

}  // namespace tessera

#endif  // TESSERA_BENCH_STATS_H_

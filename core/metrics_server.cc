// MetricsServer: prometheus-cpp's Exposer over a daemon's samples (library tessera_metrics, which
// only the daemons' executables link: the SDK carries no HTTP server).
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <exception>
#include <limits>
#include <map>

#include "CivetServer.h"
#include "absl/strings/str_cat.h"
#include "core/metrics.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"

namespace tessera {

namespace {

class Collector final : public prometheus::Collectable {
 public:
  Collector(std::function<std::vector<MetricSample>()> source, std::vector<const LatencyHistogram*> histograms)
      : source_(std::move(source)), histograms_(std::move(histograms)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families;
    std::map<std::string, size_t> by_name;  // samples of one name (different labels) share a family
    for (MetricSample& s : source_()) {
      auto [it, added] = by_name.emplace(s.name, families.size());
      if (added) {
        prometheus::MetricFamily f;
        f.name = s.name;
        f.help = s.help;
        f.type = s.type == MetricSample::kCounter ? prometheus::MetricType::Counter : prometheus::MetricType::Gauge;
        families.push_back(std::move(f));
      }
      prometheus::ClientMetric m;
      for (auto& [k, v] : s.labels) m.label.push_back({k, v});
      if (s.type == MetricSample::kCounter) {
        m.counter.value = s.value;
      } else {
        m.gauge.value = s.value;
      }
      families[it->second].metric.push_back(std::move(m));
    }
    std::map<std::string, size_t> histogram_family;  // histograms of one name share a family too
    for (const LatencyHistogram* h : histograms_) {
      const LatencyHistogram::Snapshot snap = h->snapshot();
      if (!h->labels().empty() && snap.count == 0) continue;  // a labelled one once observed (metrics.h)
      auto [it, added] = histogram_family.emplace(h->name(), families.size());
      if (added) {
        prometheus::MetricFamily f;
        f.name = h->name();
        f.help = h->help();
        f.type = prometheus::MetricType::Histogram;
        families.push_back(std::move(f));
      }
      prometheus::ClientMetric m;
      for (const auto& [k, v] : h->labels()) m.label.push_back({k, v});
      m.histogram.sample_count = snap.count;
      m.histogram.sample_sum = snap.sum_seconds;
      for (size_t i = 0; i < snap.bounds.size(); ++i)
        m.histogram.bucket.push_back({snap.cumulative[i], snap.bounds[i]});
      m.histogram.bucket.push_back({snap.count, std::numeric_limits<double>::infinity()});
      families[it->second].metric.push_back(std::move(m));
    }
    return families;
  }

 private:
  const std::function<std::vector<MetricSample>()> source_;
  const std::vector<const LatencyHistogram*> histograms_;
};

// Answers the HTTP errors civetweb would otherwise answer itself (another path, POST, HEAD):
// one mg_write of a whole response, short and plain. (Its own error path ran out of stack:
// see pthread_attr_setstacksize below.)
int answer_http_error(mg_connection* conn, int status, const char* /*message*/) {
  const char* reason = status == 404 ? "Not Found" : status == 405 ? "Method Not Allowed" : "Error";
  const std::string body = absl::StrCat(status, " ", reason, ": this port serves GET /metrics only\n");
  const std::string response =
      absl::StrCat("HTTP/1.1 ", status, " ", reason, "\r\nContent-Type: text/plain\r\nContent-Length: ", body.size(),
                   "\r\nConnection: close\r\n\r\n", body);
  mg_write(conn, response.data(), response.size());
  return 0;  // handled
}

class MetricsServerImpl final : public MetricsServer {
 public:
  MetricsServerImpl(std::unique_ptr<prometheus::Exposer> exposer, std::shared_ptr<Collector> collector, int port)
      : exposer_(std::move(exposer)), collector_(std::move(collector)), port_(port) {}
  ~MetricsServerImpl() override { exposer_.reset(); }  // stops serving before the collector goes
  int port() const override { return port_; }

 private:
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::shared_ptr<Collector> collector_;
  int port_;
};

}  // namespace

// Threads that ask for a small stack get at least kMinThreadStack. Debian's civetweb 1.15 starts
// its threads with 100 KiB of stack, and glibc carves each thread's static TLS out of its stack:
// OpenBLAS alone has 60 KiB of it, so civetweb's error path (mg_send_http_error, vsnprintf)
// overflowed into the guard page and killed the daemon when it answered anything but
// GET /metrics; 1 KiB more of TLS anywhere in the process did it again (MetricsTlsTest in
// tests/cli/cli_test.cc preloads 64 KiB of TLS and asks for the error pages). This definition,
// exported from the daemons' executables (CMakeLists.txt: --export-dynamic-symbol), comes before
// libc's in the lookup of every library's call; the stack is virtual memory, touched only as used.
extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) noexcept {
  using Fn = int (*)(pthread_attr_t*, size_t);
  static const Fn libc = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  constexpr size_t kMinThreadStack = size_t{1} << 20;
  return libc(attr, std::max(size, kMinThreadStack));
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::start(const std::string& host, int port,
                                                                    std::function<std::vector<MetricSample>()> source,
                                                                    std::vector<const LatencyHistogram*> histograms) {
  const std::string address = absl::StrCat(host, ":", port);
  std::unique_ptr<prometheus::Exposer> exposer;
  try {
    // Two threads: scrapes are rare and cheap.
    CivetCallbacks callbacks;  // copied by civetweb when it starts
    callbacks.http_error = answer_http_error;
    exposer = std::make_unique<prometheus::Exposer>(address, 2, &callbacks);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address, ": ", e.what()));
  }
  const std::vector<int> ports = exposer->GetListeningPorts();
  if (ports.empty()) return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", address));
  auto collector = std::make_shared<Collector>(std::move(source), std::move(histograms));
  exposer->RegisterCollectable(collector);
  return std::make_unique<MetricsServerImpl>(std::move(exposer), std::move(collector), ports[0]);
}

}  // namespace tessera

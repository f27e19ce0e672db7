// Scraping a daemon's Prometheus metrics in tests: HTTP/1.0 to 127.0.0.1 by hand (no client
// library), and one sample of the text format.
//
//   absl::StatusOr<std::string> scrape = http_get(port, "/metrics");
//   EXPECT_EQ(sample(*scrape, "tessera_coordinator_devices_lost_total"), 0);
#ifndef TESSERA_TESTS_METRICS_SCRAPE_H_
#define TESSERA_TESTS_METRICS_SCRAPE_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tessera {

// `method` `path` to 127.0.0.1:`port` over HTTP/1.0 (the connection closes after the answer),
// for at most 10 s; the whole response, headers included, or an error.
inline absl::StatusOr<std::string> http_request(int port, const std::string& method, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string request = absl::StrCat(method, " ", path, " HTTP/1.0\r\n\r\n");
    if (write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = read(fd, buffer, sizeof(buffer))) > 0;) response.append(buffer, static_cast<size_t>(n));
    }
  }
  close(fd);
  if (response.empty()) return absl::UnavailableError(absl::StrCat("no answer from 127.0.0.1:", port, path));
  return response;
}
// GET `path`, as http_request.
inline absl::StatusOr<std::string> http_get(int port, const std::string& path) {
  return http_request(port, "GET", path);
}

// The value of the sample `series` (name and labels, as the text format prints them) in a
// Prometheus scrape; -1 if it is not there.
inline double sample(const std::string& scrape, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (!absl::StartsWith(line, series + " ")) continue;
    double value = -1;
    if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
  }
  return -1;
}

}  // namespace tessera

#endif  // TESSERA_TESTS_METRICS_SCRAPE_H_

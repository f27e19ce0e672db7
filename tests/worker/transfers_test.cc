// The worker's lookup of a caller's connection (worker/transfers.h,
// internal::established_tcp_inodes), which decides whether a put may read, or a fetch write,
// a client process's memory: real TCP connections on the loopback, each socket's inode taken
// from /proc/self/fd as the check compares it with /proc/<pid>/fd.
#include "worker/transfers.h"

#include <arpa/inet.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

// The inode of socket `fd`, read as the worker reads a client's fds: /proc/self/fd/<fd> links
// to "socket:[<inode>]". 0 if it does not.
uint64_t socket_inode(int fd) {
  char target[64];
  const ssize_t n = readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target, sizeof target);
  absl::string_view link(target, n > 0 ? static_cast<size_t>(n) : 0);
  uint64_t inode = 0;
  if (!absl::ConsumePrefix(&link, "socket:[") || !absl::ConsumeSuffix(&link, "]") || !absl::SimpleAtoi(link, &inode)) {
    return 0;
  }
  return inode;
}

int bound_port(int fd) {
  sockaddr_storage address{};
  socklen_t size = sizeof address;
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size) != 0) return -1;
  return ntohs(address.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&address)->sin_port
                                            : reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
}

// A listening socket on 127.0.0.1, an ephemeral port.
int listen_loopback() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || listen(fd, 16) != 0) {
    ADD_FAILURE() << "listening on 127.0.0.1: " << std::strerror(errno);
  }
  return fd;
}

// 127.0.0.1 (as ::ffff:127.0.0.1) or another IPv4 address, and `port`.
internal::TcpEndpoint ipv4(int port, const char* address = "127.0.0.1") {
  in_addr v4;
  EXPECT_EQ(inet_pton(AF_INET, address, &v4), 1) << address;
  return internal::TcpEndpoint::v4(&v4, port);
}

// A connection to a listener on 127.0.0.1: the connecting socket (`family` AF_INET, or AF_INET6
// connecting to ::ffff:127.0.0.1, v4-mapped) and the accepted one.
struct Loopback {
  explicit Loopback(int family = AF_INET) {
    listener = listen_loopback();
    listen_port = bound_port(listener);
    client = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int connected = -1;
    if (family == AF_INET) {
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      to.sin_port = htons(static_cast<uint16_t>(listen_port));
      connected = connect(client, reinterpret_cast<sockaddr*>(&to), sizeof to);
    } else {
      const int v4_too = 0;  // a host with net.ipv6.bindv6only=1 would refuse the v4-mapped address
      EXPECT_EQ(setsockopt(client, IPPROTO_IPV6, IPV6_V6ONLY, &v4_too, sizeof v4_too), 0) << std::strerror(errno);
      sockaddr_in6 to{};
      to.sin6_family = AF_INET6;
      inet_pton(AF_INET6, "::ffff:127.0.0.1", &to.sin6_addr);
      to.sin6_port = htons(static_cast<uint16_t>(listen_port));
      connected = connect(client, reinterpret_cast<sockaddr*>(&to), sizeof to);
    }
    if (connected != 0) {
      ADD_FAILURE() << "connect: " << std::strerror(errno);  // no accept: it would wait for ever
      return;
    }
    server = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);  // blocks at most until the handshake ends
    EXPECT_GE(server, 0) << std::strerror(errno);
    client_port = bound_port(client);
  }
  ~Loopback() {
    for (int fd : {client, server, listener}) {
      if (fd >= 0) close(fd);
    }
  }
  int listener = -1, client = -1, server = -1;
  int listen_port = -1, client_port = -1;
};

// Why this machine cannot open a NETLINK_SOCK_DIAG socket, or empty. Without one the kernel's
// lookups fail, and established_tcp_inodes reads /proc instead (worker/transfers.cc): the tests
// then skip the two kernel lookups only and check /proc and the fallback.
const std::string& sock_diag_missing() {
  static const std::string* const missing = [] {
    const int diag = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (diag >= 0) {
      close(diag);
      return new std::string();
    }
    auto* why = new std::string(absl::StrCat("socket(AF_NETLINK, NETLINK_SOCK_DIAG) failed: ", std::strerror(errno)));
    std::fprintf(stderr, "EstablishedTcpInodes: the kernel's lookups are not checked here: %s\n", why->c_str());
    return why;
  }();
  return *missing;
}

// Each lookup (the kernel's, one dump and a dump per family, unless this machine has no
// NETLINK_SOCK_DIAG; the /proc reader's; the entry point) finds `expected` among the sockets
// from `local` to port `remote_port`.
void expect_found(const internal::TcpEndpoint& local, int remote_port, const std::vector<uint64_t>& expected) {
  using Lookup = std::function<absl::StatusOr<std::vector<uint64_t>>()>;
  std::vector<std::pair<const char*, Lookup>> lookups = {
      {"/proc", [&] { return internal::proc_established_tcp_inodes(local, remote_port); }},
      {"established_tcp_inodes", [&] { return internal::established_tcp_inodes(local, remote_port); }}};
  if (sock_diag_missing().empty()) {
    lookups.push_back(
        {"one dump",
         [&] { return internal::sock_diag_established_tcp_inodes(local, remote_port, internal::SockDiag::kOneDump); }});
    lookups.push_back({"a dump per family", [&] {
                         return internal::sock_diag_established_tcp_inodes(local, remote_port,
                                                                           internal::SockDiag::kByFamily);
                       }});
  }
  for (const auto& [name, lookup] : lookups) {
    absl::StatusOr<std::vector<uint64_t>> found = lookup();
    ASSERT_TRUE(found.ok()) << name << ": " << found.status();
    EXPECT_EQ(*found, expected) << name << ", from port " << local.port << " to port " << remote_port;
  }
}

// What check_peer_process asks for a call from `peer` ("ipv4:127.0.0.1:<client_port>") to this
// worker's port: the client's socket (`family`, see Loopback), whose inode /proc/<client
// pid>/fd then shows.
void expect_connecting_socket_found(int family) {
  Loopback c(family);
  const uint64_t client_inode = socket_inode(c.client);
  ASSERT_NE(client_inode, 0u);
  expect_found(ipv4(c.client_port), c.listen_port, {client_inode});
  // Seen from the other end: the accepted socket.
  expect_found(ipv4(c.listen_port), c.client_port, {socket_inode(c.server)});
}

TEST(EstablishedTcpInodes, FindTheConnectingSocketOfALoopbackConnection) { expect_connecting_socket_found(AF_INET); }

// An IPv6 socket connected to an IPv4 address has a v4-mapped local end, as /proc/net/tcp6
// lists it. It needs an AF_INET6 socket only (connected to ::ffff:127.0.0.1, not [::1]: it
// runs where the loopback has no IPv6 address); skipped, saying why, where none can be made.
TEST(EstablishedTcpInodes, FindTheConnectingSocketOfAnIpv6SocketConnectedToAnIpv4Address) {
  const int v6 = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (v6 < 0) GTEST_SKIP() << "socket(AF_INET6) failed (no IPv6 in this kernel): " << std::strerror(errno);
  close(v6);
  expect_connecting_socket_found(AF_INET6);
}

TEST(EstablishedTcpInodes, FindNoneWithoutAnEstablishedConnection) {
  Loopback c;
  const int idle = listen_loopback();  // listening, never connected to
  const int idle_port = bound_port(idle);
  // A remote port with no connection from the client's end; the idle listener as a local end.
  expect_found(ipv4(c.client_port), idle_port, {});
  expect_found(ipv4(idle_port), c.listen_port, {});
  // The connection's ports from another address.
  expect_found(ipv4(c.client_port, "127.0.0.2"), c.listen_port, {});
  // Closed by the client: its socket leaves ESTABLISHED (FIN_WAIT2, the server's CLOSE_WAIT).
  close(std::exchange(c.client, -1));
  expect_found(ipv4(c.client_port), c.listen_port, {});
  close(idle);
}

}  // namespace
}  // namespace tessera

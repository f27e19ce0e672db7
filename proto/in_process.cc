#include "proto/in_process.h"

#include <map>

#include "absl/base/const_init.h"
#include "absl/base/thread_annotations.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace tessera {
namespace {

constexpr int kMaxPort = 65535;

absl::Mutex servers_mu(absl::kConstInit);
// The servers registered, by the port of their address. A server is registered before its
// address is announced and unregistered before it shuts down, so the pointer is live while here.
std::map<int, grpc::Server*>& servers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(servers_mu) {
  static auto* by_port = new std::map<int, grpc::Server*>();
  return *by_port;
}
int next_port ABSL_GUARDED_BY(servers_mu) = 1;

// Ports are handed out in turn (wrapping), so a stopped server's address is not reused soon:
// a peer still holding it fails instead of reaching a newer server.
absl::StatusOr<std::string> register_server(grpc::Server* server) {
  absl::MutexLock lock(&servers_mu);
  if (servers().size() >= static_cast<size_t>(kMaxPort)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("in-process servers: all ", kMaxPort, " addresses of this process are taken"));
  }
  while (servers().count(next_port) != 0) next_port = next_port % kMaxPort + 1;
  const int port = next_port;
  next_port = next_port % kMaxPort + 1;
  servers()[port] = server;
  return absl::StrCat(kInProcessHost, ":", port);
}

int port_of(absl::string_view address) {
  int port = 0;
  if (!absl::ConsumePrefix(&address, kInProcessHost) || !absl::ConsumePrefix(&address, ":") ||
      !absl::SimpleAtoi(address, &port) || port < 1 || port > kMaxPort) {
    return 0;
  }
  return port;
}

}  // namespace

bool is_in_process_address(absl::string_view address) { return port_of(address) != 0; }

namespace {
absl::string_view metadata_of(const grpc::ServerContextBase& ctx) {
  auto it = ctx.client_metadata().find(kHandoffKey);
  return it == ctx.client_metadata().end() ? absl::string_view()
                                           : absl::string_view(it->second.data(), it->second.size());
}
}  // namespace

uint64_t handoff_token(const grpc::ServerContextBase& ctx) {
  uint64_t token = 0;
  return absl::SimpleAtoi(metadata_of(ctx), &token) ? token : 0;
}

bool handoff_requested(const grpc::ServerContextBase& ctx) { return metadata_of(ctx) == kHandoffFetch; }

absl::StatusOr<std::unique_ptr<InProcessAddress>> InProcessAddress::add(grpc::Server* server) {
  absl::StatusOr<std::string> address = register_server(server);
  if (!address.ok()) return address.status();
  return std::unique_ptr<InProcessAddress>(new InProcessAddress(*std::move(address)));
}

void InProcessAddress::reset() {
  absl::MutexLock lock(&servers_mu);
  if (registered_) servers().erase(port_of(address_));
  registered_ = false;
}

std::shared_ptr<grpc::Channel> in_process_channel(
    const std::string& address, const grpc::ChannelArguments& args,
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors) {
  const int port = port_of(address);
  {
    // Under the lock: the server cannot be unregistered (and then shut down) meanwhile.
    absl::MutexLock lock(&servers_mu);
    auto it = servers().find(port);
    if (it != servers().end()) {
      return it->second->experimental().InProcessChannelWithInterceptors(args, std::move(interceptors));
    }
  }
  // Nothing to reach: a Unix socket that does not exist refuses every call (UNAVAILABLE) without
  // a DNS lookup of "in-process"; a wait_for_ready call waits for its deadline, as it would for
  // a stopped TCP server.
  return grpc::CreateCustomChannel(absl::StrCat("unix:/nonexistent/tessera-stopped-", kInProcessHost, "-", port),
                                   grpc::InsecureChannelCredentials(), args);
}

}  // namespace tessera

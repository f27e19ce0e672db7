// In-process servers: a daemon started in process (Client::local's embedded cluster) listens on
// no port; every channel this process makes for its address (make_channel, proto/rpc.h and
// proto/auth.h) is a gRPC in-process channel to it (grpc::Server::InProcessChannel): the same
// services and code paths as over TCP, without a socket or the kernel.
//
//   std::unique_ptr<grpc::Server> server = builder.BuildAndStart();  // no listening port
//   absl::StatusOr<std::unique_ptr<InProcessAddress>> registered = InProcessAddress::add(server.get());
//   (*registered)->address();                     // "in-process:3"
//   auto stub = pb::Worker::NewStub(make_channel((*registered)->address(), identity));
//   registered->reset();                          // before server->Shutdown()
//
// Includes gRPC: only the servers' and proto/'s .cc files include it.
#ifndef TESSERA_PROTO_IN_PROCESS_H_
#define TESSERA_PROTO_IN_PROCESS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/client_interceptor.h"

namespace tessera {

// The host of every in-process address: "in-process:<n>", n in [1, 65535] and unique among the
// servers of this process that are registered (it passes for host:port wherever an address
// travels: registration, plans, topology). Another process cannot reach it.
inline constexpr char kInProcessHost[] = "in-process";

// Metadata of PutShard and GetShard between a client and a worker of one process (core/handoff.h):
// a PutShard whose bytes were handed over under the token this carries, a GetShard asking for
// its buffer to be ("fetch"), and its answer's initial metadata naming the token.
inline constexpr char kHandoffKey[] = "tessera-handoff";
inline constexpr char kHandoffFetch[] = "fetch";
// The token a PutShard's caller handed its bytes over under; 0 if none (or not a number).
uint64_t handoff_token(const grpc::ServerContextBase& ctx);
// True if a GetShard's caller asks for the buffer to be handed over.
bool handoff_requested(const grpc::ServerContextBase& ctx);

// True if `address` is an in-process one (of this process or another).
bool is_in_process_address(absl::string_view address);

// Lifetime: a call started on an in-process channel after its server stopped crashes the process
// in gRPC 1.51 (the in-process transport's init_stream calls the server's accept_stream_cb, null
// once the server dropped the connection; seen in in_process_test). So a channel made before a
// server stopped must not be called afterwards: LocalCluster stops its daemons in an order that
// guarantees it among themselves, and its clients share the cluster. A channel made after
// reset() is safe: it reaches no server and fails UNAVAILABLE.

// Registers a server under a fresh in-process address for as long as it lives (or until
// reset()). Thread-safe.
class InProcessAddress {
 public:
  // RESOURCE_EXHAUSTED if 65535 servers of this process are registered.
  // REQUIRES: `server` outlives the registration.
  static absl::StatusOr<std::unique_ptr<InProcessAddress>> add(grpc::Server* server);
  ~InProcessAddress() { reset(); }
  InProcessAddress(const InProcessAddress&) = delete;
  InProcessAddress& operator=(const InProcessAddress&) = delete;

  const std::string& address() const { return address_; }
  // Unregisters: channels made for the address from now on fail UNAVAILABLE at once; those made
  // before keep working until the server shuts down (then they fail too). Call it before the
  // server's Shutdown(). Idempotent.
  void reset();

 private:
  explicit InProcessAddress(std::string address) : address_(std::move(address)) {}
  const std::string address_;
  bool registered_ = true;
};

// For an in-process `address`: a channel with `args` and `interceptors` to its server, or, if
// no server of this process is registered there (stopped, or another process's), a channel on
// which every call fails UNAVAILABLE (one waiting for ready: at its deadline).
// REQUIRES: is_in_process_address(address).
std::shared_ptr<grpc::Channel> in_process_channel(
    const std::string& address, const grpc::ChannelArguments& args,
    std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors);

}  // namespace tessera

#endif  // TESSERA_PROTO_IN_PROCESS_H_

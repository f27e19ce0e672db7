// Authentication and authority at the gRPC edge (docs/design.md, "Security"): who is calling
// (Authenticator, on the servers) and what a process sends on every call (CallIdentity, on
// its channels).
//
//   Authenticator auth(credentials);
//   absl::StatusOr<Caller> caller = auth.require(*ctx, Role::kDaemon, "LoadPlan");
//   if (!caller.ok()) return to_grpc(caller.status());
//
//   auto identity = std::make_shared<CallIdentity>(credentials.client);
//   auto stub = pb::Coordinator::NewStub(make_channel(address, identity));
//
// Includes gRPC: only the servers' and the SDK's .cc files include it.
#ifndef TESSERA_PROTO_AUTH_H_
#define TESSERA_PROTO_AUTH_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/credentials.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace tessera {

// Metadata keys.
inline constexpr char kAuthorizationKey[] = "authorization";  // "Bearer <token>"
inline constexpr char kSessionKey[] = "tessera-session";      // OpenSessionReply.credential
inline constexpr char kDeviceKey[] = "tessera-device";        // a worker's device id, to its peers
// A worker's Exchange streams also declare its registration: the coordinator's epoch and the
// worker's incarnation, in decimal. The receiver takes a stream only from a current
// registration of the cluster (worker/collectives/peer_view.h).
inline constexpr char kEpochKey[] = "tessera-epoch";
inline constexpr char kIncarnationKey[] = "tessera-incarnation";
// The trailer of a DeleteArray that refused some ids (PERMISSION_DENIED): those ids, in
// decimal, comma-separated; the others of the batch were deleted or unknown. The SDK reads it
// (client/client.cc, refused_deletes) to count only the refused ones as failed.
inline constexpr char kRefusedDeletesTrailer[] = "tessera-refused-deletes";

// What a caller may do, in increasing power: a client acts on its own session's arrays and
// programs, an admin on everyone's, a daemon (coordinator or worker) also runs the cluster's
// internal calls (registration, plans, collectives, Exchange).
enum class Role { kClient = 1, kAdmin = 2, kDaemon = 3 };
const char* role_name(Role role);

struct Caller {
  Role role = Role::kClient;
  uint64_t session = 0;  // the session its credential proves; 0: none sent
  int device = -1;       // a daemon's tessera-device; -1: none sent
  bool open = false;     // the development mode: nothing was checked, everyone may do anything
  // Over TLS, a daemon's certificate names the device it is (tessera://device/N) or none (the
  // coordinator's): the device, or -1. Unused without TLS, where tokens cannot tell daemons apart.
  bool certified = false;
  int certified_device = -1;
  bool at_least(Role r) const { return static_cast<int>(role) >= static_cast<int>(r); }
};

class Authenticator {
 public:
  // Empty credentials: the development mode (nothing is checked; every caller may do anything).
  explicit Authenticator(Credentials credentials);

  bool enabled() const { return !credentials_.empty(); }

  // The caller of `ctx`: its bearer token, compared in constant time with each role's, and
  // its session credential if it sent one. UNAUTHENTICATED for a missing or unknown token or
  // a session credential that does not verify. Over TLS, a daemon that sends tessera-device
  // must present that device's certificate: PERMISSION_DENIED naming both ids otherwise.
  absl::StatusOr<Caller> authenticate(const grpc::ServerContextBase& ctx) const;
  // authenticate, and PERMISSION_DENIED naming `method` and the role it takes when the
  // caller's is less.
  absl::StatusOr<Caller> require(const grpc::ServerContextBase& ctx, Role min, absl::string_view method) const;
  // require, for a worker's method that only the coordinator sends (plans, runs, deletions):
  // over TLS a daemon must also present the coordinator's certificate, PERMISSION_DENIED
  // naming `method` and the device whose certificate it presented otherwise (a worker holding
  // the cluster token and its own device's key cannot drive another worker). Without TLS the
  // daemons cannot be told apart and any may (docs/design.md, "Security").
  absl::StatusOr<Caller> require_coordinator(const grpc::ServerContextBase& ctx, Role min,
                                             absl::string_view method) const;

  // OK if `caller` may act as worker `device` in `method` (RegisterWorker, Heartbeat): over
  // TLS its certificate must name that device; without TLS any daemon may (tokens cannot tell
  // the daemons apart; docs/design.md, "Security"). PERMISSION_DENIED naming both ids otherwise.
  absl::Status check_device(const Caller& caller, int device, absl::string_view method) const;

  // The credential of `session` (what OpenSession hands its client): the id and its MAC.
  std::string session_credential(uint64_t session) const;
  // The capability for array `id` (ArrayInfo.grant): a MAC of the id under the cluster token,
  // so that every daemon can check it without asking the coordinator. Empty in the development mode.
  std::string grant(uint64_t array_id) const;
  // OK if `grant` is array `id`'s (or nothing is checked); PERMISSION_DENIED naming `what`
  // and the array otherwise.
  absl::Status check_grant(uint64_t array_id, absl::string_view grant, absl::string_view what) const;

  // The coordinator's word that device `device` of array `array_id` serves at `address`
  // (CreateArrayReply.peers): a MAC of the three, so that a worker fanning a put out sends the
  // cluster's credential only to addresses the coordinator vouched for, never to one a client
  // made up. Empty in the development mode.
  std::string address_grant(uint64_t array_id, int device, absl::string_view address) const;
  // OK if `grant` is address_grant(array_id, device, address) (or nothing is checked);
  // PERMISSION_DENIED naming `what`, the device and the address otherwise.
  absl::Status check_address_grant(uint64_t array_id, int device, absl::string_view address, absl::string_view grant,
                                   absl::string_view what) const;

 private:
  std::string mac(absl::string_view purpose, uint64_t id) const;
  std::string mac_of(absl::string_view message) const;

  const Credentials credentials_;
  // SHA-256 of each role's token: presented tokens are hashed and compared in constant time.
  std::string cluster_hash_, client_hash_, admin_hash_;
};

// What a process sends on every call of a channel made with it: its bearer token, its
// session credential once it has one, and a worker's device id; and, with the cluster CA's
// certificate, over TLS (verifying the server's certificate against it, and presenting
// `cert_pem` and `key_pem` when given: a daemon's mutual TLS). Thread-safe.
class CallIdentity {
 public:
  // An empty token sends nothing (the development mode).
  explicit CallIdentity(std::string token, int device = -1, std::string ca_pem = "", std::string cert_pem = "",
                        std::string key_pem = "")
      : token_(std::move(token)),
        device_(device),
        ca_pem_(std::move(ca_pem)),
        cert_pem_(std::move(cert_pem)),
        key_pem_(std::move(key_pem)) {}

  void set_session(std::string credential) {
    absl::MutexLock lock(&mu_);
    session_ = std::move(credential);
  }
  std::string session() const {
    absl::MutexLock lock(&mu_);
    return session_;
  }
  const std::string& token() const { return token_; }
  int device() const { return device_; }
  const std::string& ca_pem() const { return ca_pem_; }
  const std::string& cert_pem() const { return cert_pem_; }
  const std::string& key_pem() const { return key_pem_; }

 private:
  const std::string token_;
  const int device_;
  const std::string ca_pem_, cert_pem_, key_pem_;
  mutable absl::Mutex mu_;
  std::string session_ ABSL_GUARDED_BY(mu_);
};

// What a daemon presents to the others: the cluster token, its certificate, `device` (a
// worker's id on its Exchange streams; -1: none).
std::shared_ptr<CallIdentity> daemon_identity(const Credentials& c, int device = -1);

// The server side of `c`: TLS with the daemon certificate, asking every caller for a
// certificate of the cluster CA (clients may have none; daemons must, see authenticate), or
// plaintext without TLS credentials.
std::shared_ptr<grpc::ServerCredentials> server_credentials(const Credentials& c);

// make_channel (proto/rpc.h) whose every call carries `identity`, over TLS when it has a CA
// (an in-process address: the in-process channel, proto/in_process.h).
std::shared_ptr<grpc::Channel> make_channel(const std::string& address, std::shared_ptr<const CallIdentity> identity);

}  // namespace tessera

#endif  // TESSERA_PROTO_AUTH_H_

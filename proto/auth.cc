#include "proto/auth.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>

#include <map>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/auth_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/client_interceptor.h"
#include "proto/in_process.h"
#include "proto/rpc.h"

namespace tessera {
namespace {

// OpenSSL frees its global state (locks, providers) in an atexit handler unless told not to. A
// process that exits while an embedded cluster still serves calls — a Python program, whose
// interpreter exits with Client::local's threads running — then hashed a token with freed
// locks and crashed (SIGSEGV in CRYPTO_THREAD_read_lock under Authenticator::authenticate, one
// exit in a few). Asked at static initialisation, before gRPC or anything else here starts
// OpenSSL; the memory is the process's until it ends anyway.
[[maybe_unused]] const bool kOpenSslKeptUntilExit = OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr) == 1;

// OpenSSL 3's one-shot SHA256() and HMAC() look their algorithm up in the provider tables at
// every call (EVP_MD_fetch, EVP_MAC_fetch: locks and property queries), a few microseconds each;
// every call to a server hashes its token and MACs its session, and each array an Execute names
// or returns takes a MAC. The algorithms are fetched once for the process instead, and each
// thread keeps one HMAC context keyed with the last key it used (re-initialised per message,
// which reuses the key's inner and outer pads).
const EVP_MD* sha256_md() {
  static EVP_MD* const md = EVP_MD_fetch(nullptr, "SHA256", nullptr);
  return md;
}

std::string sha256(absl::string_view data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (sha256_md() == nullptr || EVP_Digest(data.data(), data.size(), out, &length, sha256_md(), nullptr) != 1) {
    SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), out);
    length = SHA256_DIGEST_LENGTH;
  }
  return std::string(reinterpret_cast<const char*>(out), length);
}

// A thread's HMAC-SHA256 context and the key it holds.
struct KeyedHmac {
  std::string key;
  EVP_MAC_CTX* ctx = nullptr;
  ~KeyedHmac() { EVP_MAC_CTX_free(ctx); }
};

// HMAC-SHA256 of `message` under `key` into out (at least EVP_MAX_MD_SIZE bytes): its length, or
// 0 if OpenSSL refused (the caller then takes the one-shot path).
size_t hmac_sha256(absl::string_view key, absl::string_view message, unsigned char* out) {
  static EVP_MAC* const mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  thread_local KeyedHmac keyed;
  if (mac == nullptr) return 0;
  bool reuse = keyed.ctx != nullptr && keyed.key.size() == key.size() &&
               CRYPTO_memcmp(keyed.key.data(), key.data(), key.size()) == 0;
  if (reuse) {
    reuse = EVP_MAC_init(keyed.ctx, nullptr, 0, nullptr) == 1;  // the same key: only the state resets
  }
  if (!reuse) {
    EVP_MAC_CTX_free(keyed.ctx);
    keyed.ctx = EVP_MAC_CTX_new(mac);
    keyed.key.clear();
    char digest[] = "SHA256";
    const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                                 OSSL_PARAM_construct_end()};
    if (keyed.ctx == nullptr ||
        EVP_MAC_init(keyed.ctx, reinterpret_cast<const unsigned char*>(key.data()), key.size(), params) != 1) {
      EVP_MAC_CTX_free(keyed.ctx);  // no context outlives a failure: an empty key must not reuse it
      keyed.ctx = nullptr;
      return 0;
    }
    keyed.key = std::string(key);
  }
  size_t length = 0;
  if (EVP_MAC_update(keyed.ctx, reinterpret_cast<const unsigned char*>(message.data()), message.size()) != 1 ||
      EVP_MAC_final(keyed.ctx, out, &length, EVP_MAX_MD_SIZE) != 1) {
    EVP_MAC_CTX_free(keyed.ctx);  // its state is unknown: the next call starts afresh
    keyed.ctx = nullptr;
    keyed.key.clear();
    return 0;
  }
  return length;
}

// Constant time in the contents (both are SHA-256 digests or MACs of equal length).
bool same(absl::string_view a, absl::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

absl::string_view metadata(const grpc::ServerContextBase& ctx, const char* key, bool* present) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(key);
  *present = it != md.end();
  return *present ? absl::string_view(it->second.data(), it->second.size()) : absl::string_view();
}

// The device the certificate of a TLS caller names (its SAN URI tessera://device/N), or -1.
int certificate_device(const grpc::ServerContextBase& ctx) {
  const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
  if (auth == nullptr) return -1;
  for (const grpc::string_ref& san : auth->FindPropertyValues(GRPC_X509_SAN_PROPERTY_NAME)) {
    if (int device = device_of_uri(std::string(san.data(), san.size())); device >= 0) return device;
  }
  return -1;
}

std::string certificate_holder(int device) {
  return device >= 0 ? absl::StrCat("device ", device, "'s") : "the coordinator's (it names no device)";
}

// Adds the identity's metadata to every call of a channel.
class IdentityInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit IdentityInterceptor(const CallIdentity* identity) : identity_(identity) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      std::multimap<std::string, std::string>* md = methods->GetSendInitialMetadata();
      if (!identity_->token().empty()) md->emplace(kAuthorizationKey, absl::StrCat("Bearer ", identity_->token()));
      if (std::string session = identity_->session(); !session.empty()) md->emplace(kSessionKey, std::move(session));
      if (identity_->device() >= 0) md->emplace(kDeviceKey, absl::StrCat(identity_->device()));
    }
    methods->Proceed();
  }

 private:
  const CallIdentity* const identity_;
};

class IdentityInterceptorFactory final : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit IdentityInterceptorFactory(std::shared_ptr<const CallIdentity> identity) : identity_(std::move(identity)) {}
  const CallIdentity& identity() const { return *identity_; }
  grpc::experimental::Interceptor* CreateClientInterceptor(grpc::experimental::ClientRpcInfo*) override {
    return new IdentityInterceptor(identity_.get());
  }

 private:
  const std::shared_ptr<const CallIdentity> identity_;
};

}  // namespace

const char* role_name(Role role) {
  switch (role) {
    case Role::kClient:
      return "client";
    case Role::kAdmin:
      return "admin";
    case Role::kDaemon:
      return "daemon";
  }
  return "?";
}

Authenticator::Authenticator(Credentials credentials) : credentials_(std::move(credentials)) {
  // A role without a token (a worker holds no admin.token) keeps an empty hash, which no
  // presented token's digest equals.
  for (const auto& [token, hash] : {std::pair<const std::string*, std::string*>{&credentials_.cluster, &cluster_hash_},
                                    {&credentials_.client, &client_hash_},
                                    {&credentials_.admin, &admin_hash_}}) {
    if (!token->empty()) *hash = sha256(*token);
  }
}

absl::StatusOr<Caller> Authenticator::authenticate(const grpc::ServerContextBase& ctx) const {
  Caller caller;
  if (!enabled()) {
    caller.role = Role::kDaemon;  // everything is allowed
    caller.open = true;
    return caller;
  }
  bool present = false;
  absl::string_view authorization = metadata(ctx, kAuthorizationKey, &present);
  if (!present) {
    return absl::UnauthenticatedError(
        "no credential: this cluster checks credentials; send metadata 'authorization: Bearer <token>' (the SDK's "
        "ConnectOptions::token or token_file, the CLI's --token_file)");
  }
  absl::string_view token = authorization;
  if (!absl::ConsumePrefix(&token, "Bearer ")) {
    return absl::UnauthenticatedError("the 'authorization' metadata is not of the form 'Bearer <token>'");
  }
  const std::string hash = sha256(token);
  // Every comparison runs, whichever matches: the time says nothing about the token.
  const bool daemon = same(hash, cluster_hash_), admin = same(hash, admin_hash_), client = same(hash, client_hash_);
  if (daemon) {
    // Over TLS, a daemon also proves itself with the cluster's certificate (mutual TLS).
    if (credentials_.tls() && (ctx.auth_context() == nullptr || !ctx.auth_context()->IsPeerAuthenticated())) {
      return absl::UnauthenticatedError(
          "the cluster token came without the cluster's daemon certificate: daemons use mutual TLS");
    }
    caller.role = Role::kDaemon;
    if (credentials_.tls()) {
      caller.certified = true;
      caller.certified_device = certificate_device(ctx);
    }
  } else if (admin) {
    caller.role = Role::kAdmin;
  } else if (client) {
    caller.role = Role::kClient;
  } else {
    return absl::UnauthenticatedError("the bearer token is not one of this cluster's credentials");
  }
  absl::string_view session = metadata(ctx, kSessionKey, &present);
  if (present) {
    const size_t dot = session.find('.');
    uint64_t id = 0;
    if (dot == absl::string_view::npos || !absl::SimpleAtoi(session.substr(0, dot), &id) || id == 0 ||
        !same(session_credential(id), session)) {
      return absl::UnauthenticatedError(
          "the session credential ('tessera-session') does not verify: use the one OpenSession handed out");
    }
    caller.session = id;
  }
  absl::string_view device = metadata(ctx, kDeviceKey, &present);
  if (present && caller.role == Role::kDaemon && !absl::SimpleAtoi(device, &caller.device)) {
    return absl::UnauthenticatedError(absl::StrCat("the 'tessera-device' metadata '", device, "' is not a device id"));
  }
  if (present && caller.certified && caller.device != caller.certified_device) {
    return absl::PermissionDeniedError(absl::StrCat("the caller claims device ", caller.device,
                                                    " ('tessera-device') but its certificate is ",
                                                    certificate_holder(caller.certified_device)));
  }
  return caller;
}

absl::Status Authenticator::check_device(const Caller& caller, int device, absl::string_view method) const {
  if (!caller.certified || (caller.certified_device >= 0 && caller.certified_device == device)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(method, ": the caller claims device ", device,
                                                  " but its certificate is ",
                                                  certificate_holder(caller.certified_device)));
}

absl::StatusOr<Caller> Authenticator::require(const grpc::ServerContextBase& ctx, Role min,
                                              absl::string_view method) const {
  absl::StatusOr<Caller> caller = authenticate(ctx);
  if (caller.ok() && !caller->at_least(min)) {
    return absl::PermissionDeniedError(absl::StrCat(method, " takes the ", role_name(min), " credential; the caller ",
                                                    "presented the ", role_name(caller->role), " one"));
  }
  return caller;
}

absl::StatusOr<Caller> Authenticator::require_coordinator(const grpc::ServerContextBase& ctx, Role min,
                                                          absl::string_view method) const {
  absl::StatusOr<Caller> caller = require(ctx, min, method);
  if (caller.ok() && caller->certified && caller->certified_device >= 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        method, " is the coordinator's to send, but the caller presents ", certificate_holder(caller->certified_device),
        " certificate: a worker takes plans, runs, block moves and deletions only from the coordinator (whose "
        "certificate names "
        "no device)"));
  }
  return caller;
}

std::string Authenticator::mac(absl::string_view purpose, uint64_t id) const {
  return mac_of(absl::StrCat("tessera-v1:", purpose, ":", id));
}

std::string Authenticator::mac_of(absl::string_view message) const {
  unsigned char out[EVP_MAX_MD_SIZE];
  if (hmac_sha256(credentials_.cluster, message, out) == 0) {
    unsigned int length = 0;
    HMAC(EVP_sha256(), credentials_.cluster.data(), static_cast<int>(credentials_.cluster.size()),
         reinterpret_cast<const unsigned char*>(message.data()), message.size(), out, &length);
  }
  // 128 bits are plenty for a MAC nobody can query offline.
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(out), 16));
}

std::string Authenticator::session_credential(uint64_t session) const {
  return absl::StrCat(session, ".", mac("session", session));
}

std::string Authenticator::grant(uint64_t array_id) const { return enabled() ? mac("array", array_id) : ""; }

std::string Authenticator::address_grant(uint64_t array_id, int device, absl::string_view address) const {
  // The address last: it is the only part that may contain ':'.
  return enabled() ? mac_of(absl::StrCat("tessera-v1:address:", array_id, ":", device, ":", address)) : "";
}

absl::Status Authenticator::check_address_grant(uint64_t array_id, int device, absl::string_view address,
                                                absl::string_view grant, absl::string_view what) const {
  if (!enabled() || same(address_grant(array_id, device, address), grant)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(what, ": the coordinator did not vouch for device ", device, " at '",
                                                  address, "' in array ", array_id,
                                                  " (CreateArrayReply.peers carries the grants)"));
}

absl::Status Authenticator::check_grant(uint64_t array_id, absl::string_view grant, absl::string_view what) const {
  if (!enabled() || same(mac("array", array_id), grant)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, ": no valid grant for array ", array_id,
      "; only its owner's session (which gets the grant from the coordinator) or an admin may move its data"));
}

std::shared_ptr<CallIdentity> daemon_identity(const Credentials& c, int device) {
  return std::make_shared<CallIdentity>(c.cluster, device, c.ca_pem, c.cert_pem, c.key_pem);
}

std::shared_ptr<grpc::ServerCredentials> server_credentials(const Credentials& c) {
  if (!c.tls()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = c.ca_pem;
  options.pem_key_cert_pairs.push_back({c.key_pem, c.cert_pem});
  return grpc::SslServerCredentials(options);
}

std::shared_ptr<grpc::Channel> make_channel(const std::string& address, std::shared_ptr<const CallIdentity> identity) {
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(std::make_unique<IdentityInterceptorFactory>(std::move(identity)));
  // A server of this process (Client::local's): no wire, so no TLS (such a cluster has none).
  if (is_in_process_address(address)) return in_process_channel(address, channel_arguments(), std::move(interceptors));
  const CallIdentity& who = static_cast<IdentityInterceptorFactory&>(*interceptors.front()).identity();
  std::shared_ptr<grpc::ChannelCredentials> transport = grpc::InsecureChannelCredentials();
  if (!who.ca_pem().empty()) {
    grpc::SslCredentialsOptions options;
    options.pem_root_certs = who.ca_pem();
    options.pem_cert_chain = who.cert_pem();
    options.pem_private_key = who.key_pem();
    transport = grpc::SslCredentials(options);
  }
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, transport, channel_arguments(),
                                                                 std::move(interceptors));
}

}  // namespace tessera

// Credentials: the secrets a Tessera cluster's processes present and check (docs/design.md,
// "Security"). Three bearer tokens, one per role: the daemons' (coordinator and workers, to
// each other), the clients', and the admins' (who may act on every session's arrays and
// programs). A credentials directory holds one file per token, and optionally the cluster's
// TLS: its CA certificate, the coordinator's certificate and key, and each worker's own,
// naming its device id (`tessera up` makes them).
//
//   absl::StatusOr<Credentials> c = load_credentials("/etc/tessera/credentials");
//   CoordinatorOptions options;
//   options.credentials = *c;
//
// No gRPC here: the servers' option structs hold a Credentials.
#ifndef TESSERA_CORE_CREDENTIALS_H_
#define TESSERA_CORE_CREDENTIALS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace tessera {

// A certificate and its private key (PEM).
struct KeyPair {
  std::string cert_pem, key_pem;
};

struct Credentials {
  std::string cluster;  // the daemons' token; also keys session credentials and array grants
  std::string client;   // accepted from clients
  std::string admin;    // accepted from admins
  // TLS (PEM), all three or none: the cluster CA's certificate, and the certificate (signed by
  // it) and key every daemon serves and presents to the others (mutual TLS).
  std::string ca_pem, cert_pem, key_pem;
  // TLS, per worker: device N's certificate (signed by the CA, valid for the same hosts, and
  // naming the device in the SAN URI tessera://device/N) and key. A worker serves and presents
  // its own instead of cert_pem (credentials_for_device), so that its peers and the
  // coordinator know which device it is; cert_pem, which names no device, is the
  // coordinator's.
  std::map<int, KeyPair> devices;
  bool tls() const { return !ca_pem.empty(); }
  // No tokens at all: the daemons check nothing (the development mode, loopback only).
  bool empty() const { return cluster.empty() && client.empty() && admin.empty(); }
};

// The files of a credentials directory.
inline constexpr char kClusterTokenFile[] = "cluster.token";
inline constexpr char kClientTokenFile[] = "client.token";
inline constexpr char kAdminTokenFile[] = "admin.token";
inline constexpr char kCaFile[] = "ca.pem";  // clients need it too (ConnectOptions::ca_file)
inline constexpr char kCertFile[] = "daemon.pem";
inline constexpr char kKeyFile[] = "daemon.key";
// Device N's certificate and key: device-N.pem, device-N.key.
std::string device_cert_file(int device);
std::string device_key_file(int device);
// The SAN URI of device N's certificate.
std::string device_uri(int device);
// The device a certificate's SAN URI names (tessera://device/N), or -1 for any other string.
// Inline: the proto library's authenticator reads it, and the core library links that one.
inline constexpr char kDeviceUriPrefix[] = "tessera://device/";
inline int device_of_uri(const std::string& uri) {
  absl::string_view rest = uri;
  int device = -1;
  if (!absl::ConsumePrefix(&rest, kDeviceUriPrefix) || !absl::SimpleAtoi(rest, &device) || device < 0 ||
      rest != absl::StrCat(device)) {
    return -1;
  }
  return device;
}

// Who reads a credentials directory, and so which of its files must be there. A deployment
// gives each daemon only what it needs (docs/design.md, "Security"; select_credentials):
//   kAll          every token; with ca.pem, daemon.pem and daemon.key (what `tessera credentials`
//                 writes; the CLI, `tessera up`)
//   kCoordinator  the same files: the coordinator verifies every role and presents daemon.pem
//   kWorker       cluster.token and client.token (admin.token if there: a worker without it
//                 refuses the admin token, which it needs for nothing but DeleteBuffers); with
//                 ca.pem its own device-N.pem and device-N.key (daemon.pem if there)
enum class CredentialsHolder { kAll, kCoordinator, kWorker };

// Reads `dir`'s token files (surrounding whitespace dropped), and its TLS files when ca.pem is
// there (and every device-N.pem with its device-N.key). NOT_FOUND naming a missing file that
// `holder` needs; INVALID_ARGUMENT naming a token shorter than 16 characters, or two equal
// tokens.
absl::StatusOr<Credentials> load_credentials(const std::string& dir,
                                             CredentialsHolder holder = CredentialsHolder::kAll);

// The files of a credentials directory that `holder` needs and nothing else: the coordinator's
// tokens, ca.pem, daemon.pem and daemon.key; worker `device`'s cluster.token, client.token, ca.pem,
// device-N.pem and device-N.key (the TLS files only when `tls`). For kAll, every file but the
// device ones.
std::vector<std::string> credential_files_for(CredentialsHolder holder, int device, bool tls);

// Copies from `from` (the whole directory, e.g. a Kubernetes Secret) into `to` (created if
// needed, mode 0700; files 0600, ca.pem 0644) only the files `holder` needs
// (credential_files_for; TLS ones when `from` holds ca.pem), then loads `to` as `holder` would.
// For a worker, `device` is its id: with TLS, device-N.pem and device-N.key must be in `from`.
// NOT_FOUND naming a missing file; INVALID_ARGUMENT for a worker's device below 0; INTERNAL
// naming the path on an I/O error.
absl::Status select_credentials(const std::string& from, const std::string& to, CredentialsHolder holder, int device);

// Three fresh random tokens (32 bytes each from /dev/urandom, as hex).
absl::StatusOr<Credentials> generate_credentials();

// Adds a fresh cluster CA, the coordinator's certificate and one certificate per device 0 ..
// devices-1 (Credentials::devices), all signed by it (P-256 keys, made with the openssl
// program) and valid for `hosts` (IP addresses or DNS names the daemons are reached by; a
// `*.` name covers a domain), to `c`. INTERNAL with openssl's output if it fails (NOT_FOUND if
// there is no openssl: Debian's package `openssl`); INVALID_ARGUMENT for `devices` outside
// [0, 4096].
absl::Status add_tls(Credentials* c, const std::vector<std::string>& hosts, int devices);

// What worker `*device` serves and presents: `c` with device *device's certificate and key in
// cert_pem and key_pem (the SAN URI names the device, so peers can check the claim). Without
// TLS, `c` as it is. For *device = -1 (the coordinator picks), the one device certificate `c`
// holds, setting *device to its id. NOT_FOUND naming device-N.pem when `c` has TLS but no
// certificate for the device; INVALID_ARGUMENT for -1 with none or several.
absl::StatusOr<Credentials> credentials_for_device(const Credentials& c, int* device);

// Writes `c` into `dir` (created if needed, mode 0700; files 0600; ca.pem 0644). INTERNAL
// naming the path on an I/O error.
absl::Status write_credentials(const std::string& dir, const Credentials& c);

// Removes what write_credentials writes (every device-N file included) from `dir`, and `dir`
// if that leaves it empty. Best effort: missing files are no error.
void remove_credentials(const std::string& dir);

// A token from `file` (whitespace dropped). NOT_FOUND naming the file; INVALID_ARGUMENT if
// it is empty.
absl::StatusOr<std::string> read_token_file(const std::string& file);
// The whole of `file`. NOT_FOUND naming it if it cannot be read.
absl::StatusOr<std::string> read_file(const std::string& file);

// The credentials from `dir` or, for an empty `dir`, none (the development mode). What the
// daemons do with --credentials, each as its `holder`.
absl::StatusOr<Credentials> credentials_from_flag(const std::string& dir,
                                                  CredentialsHolder holder = CredentialsHolder::kAll);

// What a daemon started without credentials prints on stderr: that it checks nothing, and
// louder when `listen_host` is not a loopback address. Empty when `c` has tokens.
std::string open_mode_warning(const Credentials& c, const std::string& listen_host, const std::string& program);

}  // namespace tessera

#endif  // TESSERA_CORE_CREDENTIALS_H_

#include "core/credentials.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <tuple>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/open_mode.h"
#include "core/status.h"
#include "core/subprocess.h"

namespace tessera {
namespace {

constexpr size_t kMinTokenLength = 16;

absl::StatusOr<std::string> random_token() {
  std::ifstream in("/dev/urandom", std::ios::binary);
  std::string bytes(32, '\0');
  if (!in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()))) {
    return absl::InternalError("credentials: cannot read /dev/urandom");
  }
  return absl::BytesToHexString(bytes);
}

// Created with `mode` (and set to it if the file existed), then written: a token or key is
// never readable by others, not even while it is being written.
absl::Status write_file(const std::string& path, const std::string& contents, mode_t mode) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return absl::InternalError(absl::StrCat("credentials: cannot write ", path, ": ", std::strerror(errno)));
  bool ok = fchmod(fd, mode) == 0;
  for (size_t done = 0; ok && done < contents.size();) {
    const ssize_t n = write(fd, contents.data() + done, contents.size() - done);
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) done += static_cast<size_t>(n);
  }
  const int error = errno;
  ok = close(fd) == 0 && ok;
  if (!ok) return absl::InternalError(absl::StrCat("credentials: cannot write ", path, ": ", std::strerror(error)));
  return absl::OkStatus();
}

constexpr int kMaxDeviceCertificates = 4096;

// The device of a file named device-N.pem, or -1.
int device_of_cert_file(absl::string_view name) {
  int device = -1;
  if (!absl::ConsumePrefix(&name, "device-") || !absl::ConsumeSuffix(&name, ".pem") ||
      !absl::SimpleAtoi(name, &device) || device < 0 || name != absl::StrCat(device)) {
    return -1;
  }
  return device;
}

// The device-N.pem files of `dir`, by device.
std::vector<int> device_cert_files(const std::string& dir) {
  std::vector<int> devices;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return devices;
  while (const dirent* e = readdir(d)) {
    if (int device = device_of_cert_file(e->d_name); device >= 0) devices.push_back(device);
  }
  closedir(d);
  return devices;
}

}  // namespace

std::string device_cert_file(int device) { return absl::StrCat("device-", device, ".pem"); }
std::string device_key_file(int device) { return absl::StrCat("device-", device, ".key"); }
std::string device_uri(int device) { return absl::StrCat(kDeviceUriPrefix, device); }

absl::StatusOr<std::string> read_file(const std::string& file) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(absl::StrCat("credentials: cannot read ", file));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::string> read_token_file(const std::string& file) {
  absl::StatusOr<std::string> text = read_file(file);
  if (!text.ok()) return text.status();
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("credentials: the token file ", file, " is empty"));
  return token;
}

absl::StatusOr<Credentials> load_credentials(const std::string& dir, CredentialsHolder holder) {
  const bool worker = holder == CredentialsHolder::kWorker;
  Credentials c;
  const std::pair<const char*, std::string*> files[] = {
      {kClusterTokenFile, &c.cluster}, {kClientTokenFile, &c.client}, {kAdminTokenFile, &c.admin}};
  for (const auto& [name, token] : files) {
    const std::string path = absl::StrCat(dir, "/", name);
    // A worker's directory may lack the admin token: it verifies clients and daemons only.
    if (worker && token == &c.admin && access(path.c_str(), F_OK) != 0) continue;
    absl::StatusOr<std::string> t = read_token_file(path);
    if (!t.ok()) return t.status();
    if (t->size() < kMinTokenLength) {
      return absl::InvalidArgumentError(absl::StrCat("credentials: the token in ", path, " has ", t->size(),
                                                     " characters; at least ", kMinTokenLength, " are required"));
    }
    *token = *std::move(t);
  }
  if (c.cluster == c.client || c.cluster == c.admin || c.client == c.admin) {
    return absl::InvalidArgumentError(
        absl::StrCat("credentials: the tokens in ", dir, " must differ (one per role: cluster, client, admin)"));
  }
  if (access(absl::StrCat(dir, "/", kCaFile).c_str(), F_OK) == 0) {
    for (const auto& [name, pem] :
         {std::pair<const char*, std::string*>{kCaFile, &c.ca_pem}, {kCertFile, &c.cert_pem}, {kKeyFile, &c.key_pem}}) {
      const std::string path = absl::StrCat(dir, "/", name);
      // The coordinator's certificate is not a worker's to hold (it presents its device's).
      if (worker && pem != &c.ca_pem && access(path.c_str(), F_OK) != 0) continue;
      TESSERA_ASSIGN_OR_RETURN(*pem, read_file(path));
    }
    for (int device : device_cert_files(dir)) {
      KeyPair& pair = c.devices[device];
      TESSERA_ASSIGN_OR_RETURN(pair.cert_pem, read_file(absl::StrCat(dir, "/", device_cert_file(device))));
      TESSERA_ASSIGN_OR_RETURN(pair.key_pem, read_file(absl::StrCat(dir, "/", device_key_file(device))));
    }
  }
  return c;
}

std::vector<std::string> credential_files_for(CredentialsHolder holder, int device, bool tls) {
  std::vector<std::string> files = {kClusterTokenFile, kClientTokenFile};
  if (holder != CredentialsHolder::kWorker) files.push_back(kAdminTokenFile);
  if (!tls) return files;
  files.push_back(kCaFile);
  if (holder == CredentialsHolder::kWorker) {
    files.push_back(device_cert_file(device));
    files.push_back(device_key_file(device));
  } else {
    files.push_back(kCertFile);
    files.push_back(kKeyFile);
  }
  return files;
}

absl::Status select_credentials(const std::string& from, const std::string& to, CredentialsHolder holder, int device) {
  const bool worker = holder == CredentialsHolder::kWorker;
  if (worker && device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("credentials: a worker's credentials are its device's; device ", device, " is not a device id"));
  }
  if (mkdir(to.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("credentials: mkdir ", to, ": ", std::strerror(errno)));
  }
  const bool tls = access(absl::StrCat(from, "/", kCaFile).c_str(), F_OK) == 0;
  for (const std::string& name : credential_files_for(holder, device, tls)) {
    absl::StatusOr<std::string> text = read_file(absl::StrCat(from, "/", name));
    if (!text.ok()) {
      return absl::NotFoundError(absl::StrCat("credentials: ", from, " has no ", name, ", which the ",
                                              worker ? absl::StrCat("worker of device ", device) : "coordinator",
                                              " needs (", text.status().message(), ")"));
    }
    TESSERA_RETURN_IF_ERROR(write_file(absl::StrCat(to, "/", name), *text, name == kCaFile ? 0644 : 0600));
  }
  TESSERA_ASSIGN_OR_RETURN(Credentials loaded, load_credentials(to, holder));
  if (worker) return credentials_for_device(loaded, &device).status();
  return absl::OkStatus();
}

absl::StatusOr<Credentials> credentials_for_device(const Credentials& c, int* device) {
  if (!c.tls()) return c;
  if (*device < 0) {
    if (c.devices.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "credentials: with TLS a worker presents its device's own certificate; give --device_id (the credentials ",
          "hold ", c.devices.size(), " device certificates, so none can be chosen for it)"));
    }
    *device = c.devices.begin()->first;
  }
  auto it = c.devices.find(*device);
  if (it == c.devices.end()) {
    return absl::NotFoundError(absl::StrCat(
        "credentials: no certificate for device ", *device, " (", device_cert_file(*device),
        "): with TLS every worker presents its own, naming its device; make them with `tessera credentials DIR ",
        "--devices=N`"));
  }
  Credentials out = c;
  out.cert_pem = it->second.cert_pem;
  out.key_pem = it->second.key_pem;
  out.devices.clear();  // a worker keeps no other device's key
  return out;
}

absl::StatusOr<Credentials> generate_credentials() {
  Credentials c;
  for (std::string* token : {&c.cluster, &c.client, &c.admin}) {
    absl::StatusOr<std::string> t = random_token();
    if (!t.ok()) return t.status();
    *token = *std::move(t);
  }
  return c;
}

absl::Status write_credentials(const std::string& dir, const Credentials& c) {
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::InternalError(absl::StrCat("credentials: mkdir ", dir, ": ", std::strerror(errno)));
  }
  for (const auto& [name, token] : {std::pair<const char*, const std::string*>{kClusterTokenFile, &c.cluster},
                                    {kClientTokenFile, &c.client},
                                    {kAdminTokenFile, &c.admin}}) {
    absl::Status s = write_file(absl::StrCat(dir, "/", name), *token + "\n", 0600);
    if (!s.ok()) return s;
  }
  if (!c.tls()) return absl::OkStatus();
  for (const auto& [name, pem, mode] : {std::tuple<const char*, const std::string*, mode_t>{kCaFile, &c.ca_pem, 0644},
                                        {kCertFile, &c.cert_pem, 0600},
                                        {kKeyFile, &c.key_pem, 0600}}) {
    absl::Status s = write_file(absl::StrCat(dir, "/", name), *pem, mode);
    if (!s.ok()) return s;
  }
  for (const auto& [device, pair] : c.devices) {
    TESSERA_RETURN_IF_ERROR(write_file(absl::StrCat(dir, "/", device_cert_file(device)), pair.cert_pem, 0600));
    TESSERA_RETURN_IF_ERROR(write_file(absl::StrCat(dir, "/", device_key_file(device)), pair.key_pem, 0600));
  }
  return absl::OkStatus();
}

void remove_credentials(const std::string& dir) {
  for (const char* f : {kClusterTokenFile, kClientTokenFile, kAdminTokenFile, kCaFile, kCertFile, kKeyFile}) {
    std::remove(absl::StrCat(dir, "/", f).c_str());
  }
  for (int device : device_cert_files(dir)) {
    std::remove(absl::StrCat(dir, "/", device_cert_file(device)).c_str());
    std::remove(absl::StrCat(dir, "/", device_key_file(device)).c_str());
  }
  rmdir(dir.c_str());
}

absl::Status add_tls(Credentials* c, const std::vector<std::string>& hosts, int devices) {
  if (devices < 0 || devices > kMaxDeviceCertificates) {
    return absl::InvalidArgumentError(absl::StrCat("credentials: the number of device certificates must be in [0, ",
                                                   kMaxDeviceCertificates, "], got ", devices));
  }
  char dir_template[] = "/tmp/tessera-tls-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("credentials: cannot make a temporary directory");
  const std::string dir = dir_template;
  std::vector<std::string> names;
  for (const std::string& h : hosts) {
    in6_addr ip6;
    in_addr ip4;
    const bool ip = inet_pton(AF_INET, h.c_str(), &ip4) == 1 || inet_pton(AF_INET6, h.c_str(), &ip6) == 1;
    names.push_back(absl::StrCat(ip ? "IP:" : "DNS:", h));
  }
  const std::string san = absl::StrCat("subjectAltName=", absl::StrJoin(names, ","));
  // The certificates to make: the coordinator's ("daemon"), which names no device, and each
  // device's, which also names it in a URI.
  struct Leaf {
    std::string name, subject, san;
    KeyPair* out;
  };
  std::vector<Leaf> leaves = {{"daemon", "/CN=tessera daemon", san, nullptr}};
  std::map<int, KeyPair> made_devices;
  for (int d = 0; d < devices; ++d) {
    leaves.push_back({absl::StrCat("device-", d), absl::StrCat("/CN=tessera device ", d),
                      absl::StrCat(san, names.empty() ? "" : ",", "URI:", device_uri(d)), &made_devices[d]});
  }
  std::vector<std::vector<std::string>> steps = {
      {"openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
       dir + "/ca.key", "-out", dir + "/ca.pem", "-days", "3650", "-subj", "/CN=tessera cluster CA"}};
  for (const Leaf& leaf : leaves) {
    const std::string base = absl::StrCat(dir, "/", leaf.name);
    steps.push_back({"openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
                     base + ".key", "-out", base + ".csr", "-subj", leaf.subject, "-addext", leaf.san});
    steps.push_back({"openssl", "x509", "-req", "-in", base + ".csr", "-CA", dir + "/ca.pem", "-CAkey", dir + "/ca.key",
                     "-CAcreateserial", "-out", base + ".pem", "-days", "825", "-copy_extensions", "copy"});
  }
  absl::Status status;
  for (const std::vector<std::string>& argv : steps) {
    absl::StatusOr<std::pair<int, std::string>> ran = Subprocess::run(argv, absl::Seconds(30));
    if (!ran.ok()) {
      status = absl::Status(ran.status().code(), absl::StrCat("credentials: cannot run openssl (Debian package ",
                                                              "'openssl'): ", ran.status().message()));
      break;
    }
    if (ran->first != 0) {
      status = absl::InternalError(absl::StrCat("credentials: ", absl::StrJoin(argv, " "), " failed: ", ran->second));
      break;
    }
  }
  std::string ca_pem;
  KeyPair daemon;
  if (status.ok()) {
    absl::StatusOr<std::string> ca = read_file(dir + "/ca.pem");
    if (ca.ok()) {
      ca_pem = *std::move(ca);
    } else {
      status = ca.status();
    }
  }
  for (const Leaf& leaf : leaves) {
    if (!status.ok()) break;
    KeyPair* out = leaf.out != nullptr ? leaf.out : &daemon;
    for (const auto& [suffix, pem] :
         {std::pair<const char*, std::string*>{".pem", &out->cert_pem}, {".key", &out->key_pem}}) {
      absl::StatusOr<std::string> text = read_file(absl::StrCat(dir, "/", leaf.name, suffix));
      if (!text.ok()) {
        status = text.status();
        break;
      }
      *pem = *std::move(text);
    }
  }
  // The CA's key is not kept: nobody can sign another certificate for this cluster.
  for (const char* f : {"ca.key", "ca.pem", "ca.srl"}) std::remove(absl::StrCat(dir, "/", f).c_str());
  for (const Leaf& leaf : leaves) {
    for (const char* suffix : {".key", ".csr", ".pem"}) std::remove(absl::StrCat(dir, "/", leaf.name, suffix).c_str());
  }
  rmdir(dir.c_str());
  if (!status.ok()) return status;
  c->ca_pem = std::move(ca_pem);
  c->cert_pem = std::move(daemon.cert_pem);
  c->key_pem = std::move(daemon.key_pem);
  c->devices = std::move(made_devices);
  return absl::OkStatus();
}

absl::StatusOr<Credentials> credentials_from_flag(const std::string& dir, CredentialsHolder holder) {
  if (dir.empty()) return Credentials{};
  return load_credentials(dir, holder);
}

bool is_loopback_host(const std::string& host) {
  if (host == "localhost") return true;  // the one name: any other may resolve anywhere
  std::string address = host;
  if (address.size() >= 2 && address.front() == '[' && address.back() == ']') {
    address = address.substr(1, address.size() - 2);
  }
  in_addr v4;
  if (inet_pton(AF_INET, address.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, address.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

absl::Status check_open_mode(const Credentials& c, const std::string& listen_host, bool insecure_any_host,
                             const std::string& program) {
  if (!c.empty() || insecure_any_host || is_loopback_host(listen_host)) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      program, ": no --credentials, and it would listen on ", listen_host,
      ", which is not a loopback address: without credentials every caller is trusted as an admin, so plaintext is "
      "for loopback only; give --credentials=DIR (`tessera credentials DIR` makes one), or --insecure_any_host on a "
      "network nobody else reaches"));
}

std::string open_mode_warning(const Credentials& c, const std::string& listen_host, const std::string& program) {
  if (!c.empty()) return "";
  const bool loopback = is_loopback_host(listen_host);
  return absl::StrCat(
      program, ": WARNING: no --credentials: every caller is trusted as an admin (development mode)",
      loopback ? "" : absl::StrCat("; listening on ", listen_host, ", so anyone who reaches the port owns the cluster"),
      "; give --credentials=DIR (tessera credentials DIR makes one)");
}

}  // namespace tessera

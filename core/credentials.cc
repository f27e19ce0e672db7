#include "core/credentials.h"

#include <arpa/inet.h>
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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::Status write_file(const std::string& path, const std::string& contents, mode_t mode) {
  std::ofstream out(path, std::ios::trunc);
  out << contents;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("credentials: cannot write ", path));
  if (chmod(path.c_str(), mode) != 0) {
    return absl::InternalError(absl::StrCat("credentials: chmod ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

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

absl::StatusOr<Credentials> load_credentials(const std::string& dir) {
  Credentials c;
  const std::pair<const char*, std::string*> files[] = {
      {kClusterTokenFile, &c.cluster}, {kClientTokenFile, &c.client}, {kAdminTokenFile, &c.admin}};
  for (const auto& [name, token] : files) {
    const std::string path = absl::StrCat(dir, "/", name);
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
      absl::StatusOr<std::string> text = read_file(absl::StrCat(dir, "/", name));
      if (!text.ok()) return text.status();
      *pem = *std::move(text);
    }
  }
  return c;
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
  return absl::OkStatus();
}

absl::Status add_tls(Credentials* c, const std::vector<std::string>& hosts) {
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
  const std::vector<std::vector<std::string>> steps = {
      {"openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
       dir + "/ca.key", "-out", dir + "/ca.pem", "-days", "3650", "-subj", "/CN=tessera cluster CA"},
      {"openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
       dir + "/daemon.key", "-out", dir + "/daemon.csr", "-subj", "/CN=tessera daemon", "-addext", san},
      {"openssl", "x509", "-req", "-in", dir + "/daemon.csr", "-CA", dir + "/ca.pem", "-CAkey", dir + "/ca.key",
       "-CAcreateserial", "-out", dir + "/daemon.pem", "-days", "825", "-copy_extensions", "copy"}};
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
  if (status.ok()) {
    for (const auto& [name, pem] : {std::pair<const char*, std::string*>{"ca.pem", &c->ca_pem},
                                    {"daemon.pem", &c->cert_pem},
                                    {"daemon.key", &c->key_pem}}) {
      absl::StatusOr<std::string> text = read_file(absl::StrCat(dir, "/", name));
      if (!text.ok()) {
        status = text.status();
        break;
      }
      *pem = *std::move(text);
    }
  }
  // The CA's key is not kept: nobody can sign another daemon certificate for this cluster.
  for (const char* f : {"ca.key", "ca.pem", "ca.srl", "daemon.key", "daemon.csr", "daemon.pem"}) {
    std::remove(absl::StrCat(dir, "/", f).c_str());
  }
  rmdir(dir.c_str());
  return status;
}

absl::StatusOr<Credentials> credentials_from_flag(const std::string& dir) {
  if (dir.empty()) return Credentials{};
  return load_credentials(dir);
}

std::string open_mode_warning(const Credentials& c, const std::string& listen_host, const std::string& program) {
  if (!c.empty()) return "";
  const bool loopback = listen_host == "127.0.0.1" || listen_host == "localhost" || listen_host == "::1" ||
                        absl::StartsWith(listen_host, "127.");
  return absl::StrCat(
      program, ": WARNING: no --credentials: every caller is trusted as an admin (development mode)",
      loopback ? "" : absl::StrCat("; listening on ", listen_host, ", so anyone who reaches the port owns the cluster"),
      "; give --credentials=DIR (tessera credentials DIR makes one)");
}

}  // namespace tessera

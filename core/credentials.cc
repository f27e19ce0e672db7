#include "core/credentials.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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

absl::Status write_file(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::trunc);
  out << contents << "\n";
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("credentials: cannot write ", path));
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::InternalError(absl::StrCat("credentials: chmod ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::string> read_token_file(const std::string& file) {
  std::ifstream in(file);
  if (!in) return absl::NotFoundError(absl::StrCat("credentials: cannot read the token file ", file));
  std::stringstream text;
  text << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(text.str()));
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
    absl::Status s = write_file(absl::StrCat(dir, "/", name), *token);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
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

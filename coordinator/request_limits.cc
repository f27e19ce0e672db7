#include "coordinator/request_limits.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

// `s` for an error message: at most 64 characters, non-printable bytes as '?'.
std::string shown(const std::string& s) {
  std::string out = s.substr(0, 64);
  for (char& c : out) {
    if (c < 0x20 || c > 0x7e) c = '?';
  }
  return s.size() > 64 ? absl::StrCat("'", out, "...' (", s.size(), " bytes)") : absl::StrCat("'", out, "'");
}

absl::Status check_printable(absl::string_view field, const std::string& s) {
  if (s.empty()) return absl::InvalidArgumentError(absl::StrCat("RegisterWorker: ", field, " is empty"));
  if (s.size() > kMaxRegistrationString) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker: ", field, " ", shown(s), " is longer than ", kMaxRegistrationString, " bytes"));
  }
  if (std::any_of(s.begin(), s.end(), [](char c) { return c <= 0x20 || c > 0x7e; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker: ", field, " ", shown(s), " has a space or a byte that is not printable ASCII"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<absl::Duration> run_timeout(absl::string_view what, int64_t timeout_ms) {
  if (timeout_ms <= 0) return absl::Seconds(10);
  if (timeout_ms > kMaxRunTimeoutMs) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": timeout_ms ", timeout_ms, " exceeds the limit of ", kMaxRunTimeoutMs, " (1 hour)"));
  }
  return absl::Milliseconds(timeout_ms);
}

absl::Status check_registration(const std::string& name, const std::string& address, int64_t requested_id) {
  if (requested_id < -1 || requested_id > kMaxDeviceId) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterWorker: requested device id ", requested_id,
                                                   " is out of range (-1 for any, or 0 to ", kMaxDeviceId, ")"));
  }
  if (absl::Status s = check_printable("name", name); !s.ok()) return s;
  if (absl::Status s = check_printable("address", address); !s.ok()) return s;
  const size_t colon = address.rfind(':');
  const std::string host = colon == std::string::npos ? "" : address.substr(0, colon);
  int port = 0;
  const bool bracketed = host.size() >= 2 && host.front() == '[' && host.back() == ']';
  if (colon == std::string::npos || host.empty() || (!bracketed && host.find(':') != std::string::npos) ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 1 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("RegisterWorker: address ", shown(address),
                                                   " is not host:port with a port from 1 to 65535 (an IPv6 host in "
                                                   "brackets)"));
  }
  return absl::OkStatus();
}

absl::Status check_compile_graph(const pb::Graph& graph, int inputs) {
  if (graph.nodes_size() == 0 || graph.outputs_size() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("jit: the graph has ", graph.nodes_size(), " nodes and ",
                                                   graph.outputs_size(), " outputs; a program needs an output"));
  }
  int64_t parameters = 0;
  for (int id = 0; id < graph.nodes_size(); ++id) {
    const pb::KernelNode& n = graph.nodes(id).node();
    if (n.op() != pb::OP_PARAMETER) continue;
    if (n.parameter().index() != parameters) {
      return absl::InvalidArgumentError(absl::StrCat("jit: graph node ", id, " is parameter index ",
                                                     n.parameter().index(), " but it is parameter ", parameters,
                                                     " in node order (parameters are numbered 0, 1, ... as they "
                                                     "appear)"));
    }
    ++parameters;
  }
  if (parameters != inputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("jit: the graph has ", parameters, " parameters but the request gives ", inputs, " input specs"));
  }
  return absl::OkStatus();
}

}  // namespace tessera

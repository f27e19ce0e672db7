// Request limits: the checks the coordinator applies to what arrives from the wire before it
// acts on it, each failing with a status that names the value and the limit.
//
//   TESSERA_ASSIGN_OR_RETURN(absl::Duration timeout, run_timeout("execute", req.timeout_ms()));
//   TESSERA_RETURN_IF_ERROR(check_registration(req.name(), req.address(), req.requested_device_id()));
//   TESSERA_RETURN_IF_ERROR(check_compile_graph(req.graph(), req.input_specs_size()));
#ifndef TESSERA_COORDINATOR_REQUEST_LIMITS_H_
#define TESSERA_COORDINATOR_REQUEST_LIMITS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace tessera {

namespace pb {
class Graph;
}

// The longest run an Execute or RunCollective may ask for (the workers cap theirs there too).
inline constexpr int64_t kMaxRunTimeoutMs = 3'600'000;
// Device ids a worker may ask for: [0, kMaxDeviceId].
inline constexpr int kMaxDeviceId = (1 << 16) - 1;
// The longest worker name and address a registration may carry.
inline constexpr size_t kMaxRegistrationString = 255;

// The run timeout of a request's `timeout_ms`: 10 s for 0 or less (unset), else the value.
// INVALID_ARGUMENT naming `what`, the value and kMaxRunTimeoutMs above it (2^62 ms would
// overflow every clock it is added to).
absl::StatusOr<absl::Duration> run_timeout(absl::string_view what, int64_t timeout_ms);

// A worker's registration: a name and an address of at most kMaxRegistrationString printable
// ASCII characters, the address "host:port" with a port in [1, 65535] (a host in brackets for
// IPv6), and a requested id of -1 (any) or in [0, kMaxDeviceId]. INVALID_ARGUMENT naming the
// field, the value (cut short) and the rule.
absl::Status check_registration(const std::string& name, const std::string& address, int64_t requested_id);

// A Compile request's graph before it is decoded: at least one output, and parameter nodes
// numbered 0, 1, ... in node order, as many as the request's `input_specs` (the decoder
// renumbers them, so an index the client meant otherwise would silently read another input).
// INVALID_ARGUMENT naming the node and the index.
absl::Status check_compile_graph(const pb::Graph& graph, int inputs);

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_REQUEST_LIMITS_H_

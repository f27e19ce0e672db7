// Plaintext is for loopback only (issue #17, item 1): a daemon started without --credentials
// trusts every caller as an admin, so it listens on a loopback address, or elsewhere only when
// told so by --insecure_any_host (a network nobody else reaches, such as the network-namespace
// test's). Kept out of core/credentials.h, which the servers include.
#ifndef TESSERA_CORE_OPEN_MODE_H_
#define TESSERA_CORE_OPEN_MODE_H_

#include <string>

#include "absl/status/status.h"
#include "core/credentials.h"

namespace tessera {

// An IPv4 address in 127.0.0.0/8, ::1 (bracketed or not), or the name "localhost" (no other
// name: it may resolve anywhere).
bool is_loopback_host(const std::string& host);

// OK with credentials, on a loopback `listen_host`, or with `insecure_any_host`; otherwise
// FAILED_PRECONDITION naming `program`, the host and both ways out.
absl::Status check_open_mode(const Credentials& c, const std::string& listen_host, bool insecure_any_host,
                             const std::string& program);

}  // namespace tessera

#endif  // TESSERA_CORE_OPEN_MODE_H_

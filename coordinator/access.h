// The checks every part of the coordinator applies to who acts and on what: the session a
// request acts for, an array's owner, and whether an array lost a shard. No state, no lock.
//
//   TESSERA_ASSIGN_OR_RETURN(uint64_t session, acting_session(caller, req.session_id(), "execute"));
//   TESSERA_RETURN_IF_ERROR(check_owner(caller, array, "execute: input 0", "read"));
#ifndef TESSERA_COORDINATOR_ACCESS_H_
#define TESSERA_COORDINATOR_ACCESS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "coordinator/registry.h"
#include "proto/auth.h"

namespace tessera {

// The session a request acts for: a client's own (proved by its session credential), which
// a session id in the request must match; an admin or a daemon may name any (0: none).
// PERMISSION_DENIED naming `method` for a client without a session credential or naming
// another session.
absl::StatusOr<uint64_t> acting_session(const Caller& caller, uint64_t requested, absl::string_view method);

// OK if `caller` may act on array `a`: its owner's session, or an admin. PERMISSION_DENIED
// naming the array and the rule otherwise.
absl::Status check_owner(const Caller& caller, const ArrayRecord& a, absl::string_view method,
                         absl::string_view action);
// Whether `caller` may act on array `a`: check_owner's rule, as a test.
bool is_owner(const Caller& caller, const ArrayRecord& a);

// The answer to a deletion of `batch` ids by `method` (DeleteArray, or an Execute's
// delete_arrays) when each id was decided on its own: OK when `refused` is empty, else
// PERMISSION_DENIED naming the refused ids (another session's arrays, left untouched; the
// first 8) and saying how many of the batch were `deleted`.
absl::Status refused_deletions(absl::string_view method, const std::vector<uint64_t>& refused, int64_t deleted,
                               int64_t batch);

// FAILED_PRECONDITION when a device of `a` restarted since the array was placed: that
// shard is gone, and the array must be put again.
absl::Status check_not_lost(const Registry& registry, const ArrayRecord& a, const std::string& what);

// UNAVAILABLE naming `what` and the device when device `d` is draining (its worker got
// SIGTERM and finishes only what it runs): the coordinator sends it no new work.
absl::Status check_not_draining(const DeviceRecord& d, absl::string_view what);
// The same for each of `ids` that the registry knows.
absl::Status check_not_draining(const Registry& registry, const std::vector<int>& ids, absl::string_view what);

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_ACCESS_H_

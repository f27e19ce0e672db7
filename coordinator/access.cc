#include "coordinator/access.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "core/bounded_join.h"
#include "core/status.h"

namespace tessera {

absl::StatusOr<uint64_t> acting_session(const Caller& caller, uint64_t requested, absl::string_view method) {
  if (caller.at_least(Role::kAdmin)) return requested;
  if (caller.session == 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        method, ": a client acts for its session; send the credential OpenSession handed out ('tessera-session')"));
  }
  if (requested != 0 && requested != caller.session) {
    return absl::PermissionDeniedError(absl::StrCat(method, ": session ", requested,
                                                    " is not the caller's (its credential is session ", caller.session,
                                                    "); a client acts only for its own session"));
  }
  return caller.session;
}

bool is_owner(const Caller& caller, const ArrayRecord& a) {
  return caller.at_least(Role::kAdmin) || (a.session != 0 && a.session == caller.session);
}

absl::Status check_owner(const Caller& caller, const ArrayRecord& a, absl::string_view method,
                         absl::string_view action) {
  if (is_owner(caller, a)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(method, ": array ", a.id, " belongs to another session; only ",
                                                  "its owner (or an admin credential) may ", action, " it"));
}

absl::Status refused_deletions(absl::string_view method, const std::vector<uint64_t>& refused, int64_t deleted,
                               int64_t batch) {
  if (refused.empty()) return absl::OkStatus();
  const bool one = refused.size() == 1;
  const std::string ids = join_at_most(refused, 8);
  std::string message =
      one ? absl::StrCat(method, ": array ", ids,
                         " belongs to another session; only its owner (or an admin credential) may delete it")
          : absl::StrCat(method, ": arrays ", ids,
                         " belong to other sessions; only their owners (or an admin credential) may delete them");
  const int64_t others = batch - static_cast<int64_t>(refused.size());
  if (others > 0 && deleted == others) {
    absl::StrAppend(&message, " (the other ", others, " of the ", batch, " arrays ", others == 1 ? "was" : "were",
                    " deleted)");
  } else if (others > 0) {
    // Ids the registry did not know were skipped: deleted already, or never made.
    absl::StrAppend(&message, " (", deleted, " of the other ", others, " of the ", batch, " arrays ",
                    deleted == 1 ? "was" : "were", " deleted; the rest are unknown here)");
  }
  return absl::PermissionDeniedError(message);
}

absl::Status check_not_lost(const Registry& registry, const ArrayRecord& a, const std::string& what) {
  if (a.lost_devices.empty()) return absl::OkStatus();
  const int d = *a.lost_devices.begin();
  std::optional<DeviceRecord> device = registry.device(d);
  return absl::FailedPreconditionError(absl::StrCat(what, ": array ", a.id, " lost its shard on ",
                                                    describe_device(d, device ? device->address : "?"),
                                                    " when that worker restarted; put the array again"));
}

absl::Status check_not_draining(const DeviceRecord& d, absl::string_view what) {
  if (!d.draining) return absl::OkStatus();
  // UNAVAILABLE, not FAILED_PRECONDITION: nothing the caller holds is wrong, and the same call
  // succeeds once the device is back (an orchestrator restarts the worker under its name and
  // device id: Kubernetes' StatefulSet does) or when made on a mesh without it: retry later.
  return absl::UnavailableError(absl::StrCat(what, ": ", describe_device(d.id, d.address),
                                             " is draining (its worker is stopping) and takes no new work; retry "
                                             "once it is back, or use a mesh without it"));
}

absl::Status check_not_draining(const Registry& registry, const std::vector<int>& ids, absl::string_view what) {
  for (int id : ids) {
    std::optional<DeviceRecord> d = registry.device(id);
    if (d.has_value()) TESSERA_RETURN_IF_ERROR(check_not_draining(*d, what));
  }
  return absl::OkStatus();
}

}  // namespace tessera

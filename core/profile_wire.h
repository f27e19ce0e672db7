// The Profile RPC's side in each daemon (core/profile.h's recorder on the wire), and the
// events' wire form, for worker_server.cc, coordinator_server.cc and the profiler
// (client/profile.cc). Includes the generated proto: keep it out of widely included headers.
#ifndef TESSERA_CORE_PROFILE_WIRE_H_
#define TESSERA_CORE_PROFILE_WIRE_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/profile.h"
#include "proto/tessera.pb.h"

namespace tessera {

// Answers `request` from `recorder`: the clock always; START (INVALID_ARGUMENT for a capacity
// outside [1, kMaxCapacity]), STOP, or FETCH of the events from first_event on, as many as fit
// in half of kMaxMessageBytes (at least one). `device_id`: -1 for the coordinator.
absl::Status answer_profile(ProfileRecorder& recorder, const pb::ProfileRequest& request, int device_id,
                            pb::ProfileReply* reply);

void to_proto(const ProfileEvent& event, pb::ProfileEvent* out);
// INVALID_ARGUMENT naming the phase when it is not X, s or f.
absl::StatusOr<ProfileEvent> from_proto(const pb::ProfileEvent& event);

}  // namespace tessera

#endif  // TESSERA_CORE_PROFILE_WIRE_H_

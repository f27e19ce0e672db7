#include "core/profile_wire.h"

#include "absl/strings/str_cat.h"
#include "proto/rpc.h"

namespace tessera {

absl::Status answer_profile(ProfileRecorder& recorder, const pb::ProfileRequest& request, int device_id,
                            pb::ProfileReply* reply) {
  reply->set_device_id(device_id);
  switch (request.action()) {
    case pb::ProfileRequest::CLOCK:
      break;
    case pb::ProfileRequest::START: {
      const int64_t capacity = request.capacity() == 0 ? ProfileRecorder::kDefaultCapacity : request.capacity();
      if (capacity < 1 || capacity > ProfileRecorder::kMaxCapacity) {
        return absl::InvalidArgumentError(absl::StrCat("Profile: capacity ", request.capacity(), " is outside [1, ",
                                                       ProfileRecorder::kMaxCapacity, "] events"));
      }
      recorder.start(capacity);
      break;
    }
    case pb::ProfileRequest::STOP:
      recorder.stop();
      break;
    case pb::ProfileRequest::FETCH: {
      if (request.first_event() < 0) {
        return absl::InvalidArgumentError(absl::StrCat("Profile: first_event ", request.first_event(), " is negative"));
      }
      // Events are small (a name and a few arguments): read a page of them and keep what fits.
      constexpr int64_t kPage = 8192;
      int64_t total = 0;
      ProfileRecorder::Snapshot s = recorder.snapshot(request.first_event(), kPage, &total);
      size_t bytes = 0;
      for (const ProfileEvent& e : s.events) {
        pb::ProfileEvent* out = reply->add_events();
        to_proto(e, out);
        bytes += out->ByteSizeLong() + 4;
        if (bytes > static_cast<size_t>(kMaxMessageBytes / 2)) break;
      }
      break;
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat("Profile: unknown action ", request.action()));
  }
  int64_t total = 0;
  ProfileRecorder::Snapshot head = recorder.snapshot(0, 0, &total);
  reply->set_total_events(total);
  reply->set_dropped_events(head.dropped);
  reply->set_start_ns(head.start_ns);
  reply->set_clock_ns(profile_clock_ns());
  return absl::OkStatus();
}

void to_proto(const ProfileEvent& event, pb::ProfileEvent* out) {
  out->set_phase(std::string(1, static_cast<char>(event.phase)));
  out->set_name(event.name);
  out->set_category(event.category);
  out->set_ts_ns(event.ts_ns);
  out->set_dur_ns(event.dur_ns);
  out->set_tid(event.tid);
  out->set_flow_id(event.flow_id);
  for (const auto& [k, v] : event.args) {
    pb::ProfileArg* a = out->add_args();
    a->set_key(k);
    a->set_value(v);
  }
}

absl::StatusOr<ProfileEvent> from_proto(const pb::ProfileEvent& event) {
  ProfileEvent e;
  if (event.phase() == "X") {
    e.phase = ProfileEvent::kComplete;
  } else if (event.phase() == "s") {
    e.phase = ProfileEvent::kFlowStart;
  } else if (event.phase() == "f") {
    e.phase = ProfileEvent::kFlowEnd;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("profile event '", event.name(), "': phase '", event.phase(), "' is not X, s or f"));
  }
  e.name = event.name();
  e.category = event.category();
  e.ts_ns = event.ts_ns();
  e.dur_ns = event.dur_ns();
  e.tid = event.tid();
  e.flow_id = event.flow_id();
  for (const pb::ProfileArg& a : event.args()) e.args.emplace_back(a.key(), a.value());
  return e;
}

}  // namespace tessera

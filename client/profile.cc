// The profiler (Client::start_profile / stop_profile; docs/design.md, "Timeline"): starts every
// daemon's recorder, estimates each daemon's clock offset NTP-style, and at the end fetches the
// events, aligns them to the coordinator's clock and writes Chrome's trace-event JSON and the
// HTML viewer (client/profile_html.cc).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "client/client_impl.h"
#include "client/profile_html.h"
#include "core/profile_wire.h"
#include "core/status.h"
#include "proto/rpc.h"
#include "tessera/client.h"

namespace tessera {
namespace internal {

// One daemon taking part in a profile.
struct ProfileDaemon {
  std::string name;  // "coordinator", "device 3"
  std::string address;
  int pid = 0;         // in the trace
  int sort_index = 0;  // the row's place
  std::function<grpc::Status(grpc::ClientContext*, const pb::ProfileRequest&, pb::ProfileReply*)> call;
  int64_t offset_ns = 0;  // its clock minus this client's, estimated at start
  int64_t rtt_ns = 0;     // of the sample the estimate took
  int64_t start_ns = 0;   // when its recording started (its clock): another START changes it
};

struct ClientImpl::Profiling {
  std::vector<ProfileDaemon> daemons;  // the coordinator first
  int64_t window_start_ns = 0;         // this client's clock, before any daemon started
  int64_t window_start_unix_ns = 0;    // this client's wall clock then (for the metadata)
};

}  // namespace internal

namespace {

using internal::ClientImpl;
using internal::ProfileDaemon;

constexpr int kClientPid = 1000001;
constexpr int kCoordinatorPid = 1000000;
constexpr int kClockSamples = 5;

absl::StatusOr<pb::ProfileReply> ask(const ProfileDaemon& d, const pb::ProfileRequest& req) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, kControlDeadline);
  pb::ProfileReply reply;
  TESSERA_RETURN_IF_ERROR(from_grpc(d.call(&ctx, req, &reply), absl::StrCat(d.name, " (", d.address, ")")));
  return reply;
}

// NTP's estimate from the sample of the shortest round trip: the daemon read its clock about
// halfway through it.
absl::Status estimate_offset(ProfileDaemon& d) {
  pb::ProfileRequest req;
  req.set_action(pb::ProfileRequest::CLOCK);
  int64_t best_rtt = INT64_MAX;
  for (int i = 0; i < kClockSamples; ++i) {
    const int64_t t0 = profile_clock_ns();
    TESSERA_ASSIGN_OR_RETURN(pb::ProfileReply reply, ask(d, req));
    const int64_t t1 = profile_clock_ns();
    if (t1 - t0 < best_rtt) {
      best_rtt = t1 - t0;
      d.offset_ns = reply.clock_ns() - (t0 + (t1 - t0) / 2);
    }
  }
  d.rtt_ns = best_rtt;
  return absl::OkStatus();
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '<':  // so that the HTML viewer can embed the JSON in a <script> as it is
        out += "\\u003c";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrFormat("\\u%04x", c);
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// Nanoseconds as the format's microseconds.
std::string micros(int64_t ns) { return absl::StrFormat("%.3f", static_cast<double>(ns) / 1000.0); }

struct Lane {
  int pid;
  ProfileEvent event;  // ts_ns on the coordinator's clock, from the window's start
};

std::string event_json(const Lane& l) {
  const ProfileEvent& e = l.event;
  std::string out = absl::StrCat("{\"ph\":\"", std::string(1, static_cast<char>(e.phase)), "\",\"pid\":", l.pid,
                                 ",\"tid\":", e.tid, ",\"ts\":", micros(e.ts_ns), ",\"name\":", json_string(e.name),
                                 ",\"cat\":", json_string(e.category));
  if (e.phase == ProfileEvent::kComplete) {
    absl::StrAppend(&out, ",\"dur\":", micros(e.dur_ns));
  } else {
    absl::StrAppend(&out, ",\"id\":\"", absl::StrFormat("%x", e.flow_id), "\"");
    if (e.phase == ProfileEvent::kFlowEnd) absl::StrAppend(&out, ",\"bp\":\"e\"");
  }
  if (!e.args.empty()) {
    out += ",\"args\":{";
    for (size_t i = 0; i < e.args.size(); ++i) {
      absl::StrAppend(&out, i == 0 ? "" : ",", json_string(e.args[i].first), ":", json_string(e.args[i].second));
    }
    out += "}";
  }
  return out + "}";
}

std::string metadata_json(const char* what, int pid, const std::string& key, const std::string& value, int tid = -1) {
  return absl::StrCat("{\"ph\":\"M\",\"pid\":", pid, tid >= 0 ? absl::StrCat(",\"tid\":", tid) : "", ",\"name\":\"",
                      what, "\",\"args\":{\"", key, "\":", value, "}}");
}

absl::Status write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("profile: cannot write '", path, "'"));
  return absl::OkStatus();
}

}  // namespace

ProfileScope::ProfileScope(ProfileScope&& other) noexcept
    : impl_(std::move(other.impl_)), path_(std::move(other.path_)) {}

ProfileScope::~ProfileScope() {
  if (impl_ == nullptr) return;
  absl::Status done = finish();
  if (!done.ok())
    std::fprintf(stderr, "tessera: the profile for %s failed: %s\n", path_.c_str(), done.ToString().c_str());
}

absl::Status ProfileScope::finish() {
  if (impl_ == nullptr) return absl::FailedPreconditionError("profile: this scope has finished already");
  std::shared_ptr<internal::ClientImpl> impl = std::move(impl_);
  impl_ = nullptr;
  return Client(std::move(impl)).stop_profile(path_);
}

absl::StatusOr<ProfileScope> Client::profile(const std::string& path, const ProfileOptions& options) const {
  TESSERA_RETURN_IF_ERROR(start_profile(options));
  return ProfileScope(impl_, path);
}

absl::Status Client::start_profile(const ProfileOptions& options) const {
  if (options.events_per_daemon < 1 || options.events_per_daemon > ProfileRecorder::kMaxCapacity) {
    return absl::InvalidArgumentError(absl::StrCat("profile: events_per_daemon ", options.events_per_daemon,
                                                   " is outside [1, ", ProfileRecorder::kMaxCapacity, "]"));
  }
  absl::MutexLock lock(&impl_->profiling_mu);
  if (impl_->profiling != nullptr) {
    return absl::FailedPreconditionError("profile: this client is profiling already; stop_profile first");
  }
  auto p = std::make_shared<ClientImpl::Profiling>();
  p->window_start_ns = profile_clock_ns();
  p->window_start_unix_ns = absl::GetCurrentTimeNanos();
  ClientImpl* impl = impl_.get();
  ProfileDaemon coordinator;
  coordinator.name = "coordinator";
  coordinator.address = impl->coordinator_address();
  coordinator.pid = kCoordinatorPid;
  coordinator.sort_index = 1;
  coordinator.call = [impl](grpc::ClientContext* ctx, const pb::ProfileRequest& req, pb::ProfileReply* reply) {
    return impl->coordinator()->Profile(ctx, req, reply);
  };
  p->daemons.push_back(std::move(coordinator));
  TESSERA_ASSIGN_OR_RETURN(pb::Topology topology, impl->topology());
  for (const pb::DeviceInfo& info : topology.devices()) {
    if (info.state() != pb::ALIVE) continue;
    ProfileDaemon d;
    d.name = absl::StrCat("device ", info.id());
    d.address = info.address();
    d.pid = info.id();
    d.sort_index = 2 + info.id();
    TESSERA_ASSIGN_OR_RETURN(pb::Worker::Stub * stub,
                             impl->worker(info.address(), absl::StrCat(d.name, " (", d.address, ")")));
    d.call = [stub](grpc::ClientContext* ctx, const pb::ProfileRequest& req, pb::ProfileReply* reply) {
      return stub->Profile(ctx, req, reply);
    };
    p->daemons.push_back(std::move(d));
  }
  // The clocks first (so the window opens before any daemon records), then the recorders.
  for (ProfileDaemon& d : p->daemons) TESSERA_RETURN_IF_ERROR(estimate_offset(d));
  pb::ProfileRequest start;
  start.set_action(pb::ProfileRequest::START);
  start.set_capacity(options.events_per_daemon);
  impl->profile().start(options.events_per_daemon);
  for (size_t i = 0; i < p->daemons.size(); ++i) {
    absl::StatusOr<pb::ProfileReply> started = ask(p->daemons[i], start);
    if (started.ok()) p->daemons[i].start_ns = started->start_ns();
    if (!started.ok()) {
      pb::ProfileRequest stop;
      stop.set_action(pb::ProfileRequest::STOP);
      for (size_t j = 0; j < i; ++j) (void)ask(p->daemons[j], stop);
      impl->profile().stop();
      return started.status();
    }
  }
  impl->profiling = std::move(p);
  return absl::OkStatus();
}

absl::Status Client::stop_profile(const std::string& path) const {
  std::shared_ptr<ClientImpl::Profiling> p;
  {
    absl::MutexLock lock(&impl_->profiling_mu);
    if (impl_->profiling == nullptr) return absl::FailedPreconditionError("profile: no profile is running");
    p = std::move(impl_->profiling);
    impl_->profiling = nullptr;
  }
  impl_->profile().stop();
  pb::ProfileRequest stop;
  stop.set_action(pb::ProfileRequest::STOP);
  absl::Status first_error;
  // Every daemon is stopped before any is read, so the window closes at once everywhere.
  std::vector<bool> stopped;
  for (const ProfileDaemon& d : p->daemons) {
    absl::StatusOr<pb::ProfileReply> r = ask(d, stop);
    stopped.push_back(r.ok());
    first_error.Update(r.status());
  }
  struct Fetched {
    std::vector<ProfileEvent> events;
    int64_t dropped = 0;
    std::string error;
  };
  std::vector<Fetched> fetched(p->daemons.size());
  const int64_t offset_coordinator = p->daemons[0].offset_ns;
  for (size_t i = 0; i < p->daemons.size(); ++i) {
    if (!stopped[i]) {
      fetched[i].error = "did not answer STOP";
      continue;
    }
    pb::ProfileRequest fetch;
    fetch.set_action(pb::ProfileRequest::FETCH);
    while (true) {
      fetch.set_first_event(static_cast<int64_t>(fetched[i].events.size()));
      absl::StatusOr<pb::ProfileReply> r = ask(p->daemons[i], fetch);
      if (!r.ok()) {
        fetched[i].error = std::string(r.status().message());
        first_error.Update(r.status());
        break;
      }
      if (r->start_ns() != p->daemons[i].start_ns) {
        // Its events are another profile's: one cluster, one profile at a time.
        const absl::Status restarted =
            absl::AbortedError(absl::StrCat(p->daemons[i].name, " (", p->daemons[i].address,
                                            "): another profile restarted its recording meanwhile; profile again"));
        fetched[i].events.clear();
        fetched[i].error = std::string(restarted.message());
        first_error.Update(restarted);
        break;
      }
      fetched[i].dropped = r->dropped_events();
      for (const pb::ProfileEvent& e : r->events()) {
        absl::StatusOr<ProfileEvent> event = from_proto(e);
        if (!event.ok()) {
          first_error.Update(
              absl::Status(event.status().code(), absl::StrCat(p->daemons[i].name, ": ", event.status().message())));
          continue;
        }
        fetched[i].events.push_back(*std::move(event));
      }
      if (r->events_size() == 0 || static_cast<int64_t>(fetched[i].events.size()) >= r->total_events()) break;
    }
  }
  const int64_t window_end_ns = profile_clock_ns();
  // Everything on the coordinator's clock, from the window's start.
  const int64_t origin = p->window_start_ns + offset_coordinator;
  std::vector<Lane> lanes;
  ProfileRecorder::Snapshot mine = impl_->profile().snapshot();
  for (ProfileEvent& e : mine.events) {
    e.ts_ns += offset_coordinator - origin;
    lanes.push_back({kClientPid, std::move(e)});
  }
  for (size_t i = 0; i < p->daemons.size(); ++i) {
    const int64_t shift = offset_coordinator - p->daemons[i].offset_ns - origin;
    for (ProfileEvent& e : fetched[i].events) {
      e.ts_ns += shift;
      lanes.push_back({p->daemons[i].pid, std::move(e)});
    }
  }
  // By lane and time, an enclosing span before what it encloses.
  std::stable_sort(lanes.begin(), lanes.end(), [](const Lane& a, const Lane& b) {
    if (a.event.ts_ns != b.event.ts_ns) return a.event.ts_ns < b.event.ts_ns;
    return a.event.dur_ns > b.event.dur_ns;
  });

  std::vector<std::string> items;
  std::set<std::pair<int, int>> threads;
  auto process = [&](int pid, int sort_index, const std::string& name) {
    items.push_back(metadata_json("process_name", pid, "name", json_string(name)));
    items.push_back(metadata_json("process_sort_index", pid, "sort_index", absl::StrCat(sort_index)));
  };
  process(kClientPid, 0, "client");
  for (const ProfileDaemon& d : p->daemons) process(d.pid, d.sort_index, absl::StrCat(d.name, " (", d.address, ")"));
  for (const Lane& l : lanes) {
    if (threads.insert({l.pid, l.event.tid}).second) {
      items.push_back(
          metadata_json("thread_name", l.pid, "name", json_string(absl::StrCat("thread ", l.event.tid)), l.event.tid));
    }
  }
  for (const Lane& l : lanes) items.push_back(event_json(l));

  int64_t dropped = mine.dropped;
  std::string daemons = absl::StrCat("{\"name\":\"client\",\"pid\":", kClientPid,
                                     ",\"clock_offset_ns\":", -offset_coordinator, ",\"rtt_ns\":", p->daemons[0].rtt_ns,
                                     ",\"events\":", mine.events.size(), ",\"dropped_events\":", mine.dropped, "}");
  for (size_t i = 0; i < p->daemons.size(); ++i) {
    const ProfileDaemon& d = p->daemons[i];
    dropped += fetched[i].dropped;
    absl::StrAppend(&daemons, ",{\"name\":", json_string(d.name), ",\"address\":", json_string(d.address),
                    ",\"pid\":", d.pid, ",\"clock_offset_ns\":", d.offset_ns - offset_coordinator,
                    ",\"rtt_ns\":", d.rtt_ns, ",\"events\":", fetched[i].events.size(),
                    ",\"dropped_events\":", fetched[i].dropped,
                    fetched[i].error.empty() ? "" : absl::StrCat(",\"error\":", json_string(fetched[i].error)), "}");
  }
  std::string json = "{\"traceEvents\":[\n";
  for (size_t i = 0; i < items.size(); ++i) absl::StrAppend(&json, i == 0 ? "" : ",\n", items[i]);
  absl::StrAppend(&json, "\n],\n\"displayTimeUnit\":\"ns\",\n\"metadata\":{\"clock\":\"coordinator\"",
                  ",\"window_start_unix_ns\":", p->window_start_unix_ns,
                  ",\"window_us\":", micros(window_end_ns - p->window_start_ns), ",\"dropped_events\":", dropped,
                  ",\"daemons\":[", daemons, "]}}\n");
  TESSERA_RETURN_IF_ERROR(write_file(path, json));
  TESSERA_RETURN_IF_ERROR(write_file(path + ".html", internal::timeline_html(json)));
  return first_error;
}

}  // namespace tessera

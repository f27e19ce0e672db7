#include "coordinator/fan_out.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "coordinator/access.h"
#include "core/status.h"
#include "proto/rpc.h"

namespace tessera {

std::vector<grpc::Status> FanOut::fan_out(const std::vector<std::shared_ptr<WorkerChannel>>& workers,
                                          absl::Duration deadline, const StartCall& start, absl::Duration grace,
                                          const Members* watch) {
  const int n = static_cast<int>(workers.size());
  std::vector<grpc::Status> statuses(static_cast<size_t>(n));
  std::vector<grpc::ClientContext> contexts(static_cast<size_t>(n));
  absl::Mutex mu;
  int done = 0;
  bool failed = false;
  for (int i = 0; i < n; ++i) {
    set_deadline(&contexts[i], deadline);
    contexts[i].set_wait_for_ready(!workers[i]->reached);
    start(i, &contexts[i], [&, i](grpc::Status s) {
      if (s.ok()) workers[i]->reached = true;
      absl::MutexLock lock(&mu);
      if (!s.ok()) failed = true;
      statuses[i] = std::move(s);
      ++done;
    });
  }
  auto all_done = [&]() { return done == n; };
  auto all_done_or_failed = [&]() { return done == n || failed; };
  int lost = -1;  // index of a watched target that was lost meanwhile
  mu.Lock();
  while (!mu.AwaitWithTimeout(absl::Condition(&all_done_or_failed), heartbeat_interval_ / 4)) {
    if (watch == nullptr) continue;
    lost = changed_member(*watch);
    if (lost >= 0) break;
  }
  if (lost >= 0 ||
      (done < n && grace != absl::InfiniteDuration() && !mu.AwaitWithTimeout(absl::Condition(&all_done), grace))) {
    // Not under mu: the calls' callbacks take it, and gRPC may run one inside TryCancel.
    mu.Unlock();
    for (grpc::ClientContext& ctx : contexts) ctx.TryCancel();
    mu.Lock();
  }
  mu.Await(absl::Condition(&all_done));
  mu.Unlock();
  if (lost >= 0) {
    statuses[lost] = lost_status();
  }
  return statuses;
}

absl::Status FanOut::first_failure(const std::vector<grpc::Status>& statuses, const std::vector<pb::PeerAddress>& peers,
                                   const std::string& what) {
  std::vector<absl::Status> failures;
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      failures.push_back(from_grpc(statuses[i], describe_device(peers[i].device_id(), peers[i].address())));
    }
  }
  if (failures.empty()) return absl::OkStatus();
  std::stable_sort(failures.begin(), failures.end(), [](const absl::Status& a, const absl::Status& b) {
    auto rank = [](const absl::Status& s) {
      return s.code() == absl::StatusCode::kUnavailable ? 0 : s.code() == absl::StatusCode::kCancelled ? 2 : 1;
    };
    return rank(a) < rank(b);
  });
  std::string message = absl::StrCat(what, " failed on ", failures.size(), " of ", peers.size(), " devices: ");
  for (size_t i = 0; i < failures.size() && i < 3; ++i) absl::StrAppend(&message, i ? "; " : "", failures[i].message());
  if (failures.size() > 3) absl::StrAppend(&message, "; ...");
  return absl::Status(failures[0].code(), message);
}

void FanOut::delete_buffers(const std::map<int, std::vector<uint64_t>>& buffers, bool wait) {
  std::map<int, pb::DeleteBuffersRequest> per_device;
  for (const auto& [device, ids] : buffers) {
    if (!ids.empty()) per_device[device].mutable_buffer_ids()->Assign(ids.begin(), ids.end());
  }
  std::vector<std::shared_ptr<WorkerChannel>> workers;
  std::vector<const pb::DeleteBuffersRequest*> requests;
  std::vector<std::shared_ptr<PlanStream>> streams;
  std::vector<pb::StreamDelete> stream_requests;
  for (const auto& [device_id, request] : per_device) {
    std::optional<DeviceRecord> d = registry_->device(device_id);
    if (!d.has_value() || !d->alive) continue;
    std::shared_ptr<WorkerChannel> w = channels_->get(d->address);
    std::shared_ptr<PlanStream> stream = w->open_plan_stream(d->incarnation);
    if (stream == nullptr) {
      workers.push_back(w);
      requests.push_back(&request);
      continue;
    }
    pb::StreamDelete& r = stream_requests.emplace_back();
    r.set_request_id(registry_->ids().next());
    *r.mutable_buffer_ids() = request.buffer_ids();
    streams.push_back(std::move(stream));
  }
  // Shared with the callbacks, which may outlive this call after a timeout.
  struct Acks {
    absl::Mutex mu;
    size_t left ABSL_GUARDED_BY(mu) = 0;
  };
  auto acks = std::make_shared<Acks>();
  {
    absl::MutexLock lock(&acks->mu);
    acks->left = streams.size();
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    streams[i]->delete_buffers(stream_requests[i], [acks](grpc::Status) {
      absl::MutexLock lock(&acks->mu);
      --acks->left;
    });
  }
  if (!wait) {
    for (size_t i = 0; i < workers.size(); ++i) {
      call_async<pb::DeleteBuffersRequest, pb::DeleteBuffersReply>(
          workers[i], *requests[i], [](auto* stub, auto* ctx, auto* req, auto* reply, auto done) {
            stub->DeleteBuffers(ctx, req, reply, std::move(done));
          });
    }
    return;  // a stream that never answers fails its deletions when it ends
  }
  std::vector<pb::DeleteBuffersReply> replies(workers.size());
  fan_out(workers, kConnectDeadline, [&](int i, grpc::ClientContext* ctx, auto done) {
    workers[i]->stub->async()->DeleteBuffers(ctx, requests[i], &replies[i], std::move(done));
  });
  {
    absl::MutexLock lock(&acks->mu);
    auto answered = [&acks]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(acks->mu) { return acks->left == 0; };
    if (acks->mu.AwaitWithTimeout(absl::Condition(&answered), kConnectDeadline)) return;
  }
  for (size_t i = 0; i < streams.size(); ++i) {
    streams[i]->cancel(stream_requests[i].request_id(),
                       grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "no answer to a deletion"));
  }
}

int FanOut::changed_member(const Members& members) const {
  for (size_t i = 0; i < members.peers.size(); ++i) {
    std::optional<DeviceRecord> d = registry_->device(members.peers[i].device_id());
    if (!d || !d->alive || d->incarnation != members.incarnations[i]) return static_cast<int>(i);
  }
  return -1;
}

absl::StatusOr<Members> FanOut::alive_members(const std::vector<int>& ids, const std::string& what) const {
  Members members;
  for (int d : ids) {
    std::optional<DeviceRecord> device = registry_->device(d);
    if (!device.has_value() || !device->alive) {
      return absl::UnavailableError(absl::StrCat(
          what, ": ", describe_device(d, device ? device->address : "?"),
          device.has_value() && device->left
              ? " left the cluster (its worker drained and deregistered); retry once it is back, or use a mesh "
                "without it"
              : " is lost"));
    }
    TESSERA_RETURN_IF_ERROR(check_not_draining(*device, what));
    pb::PeerAddress peer;
    peer.set_device_id(d);
    peer.set_address(device->address);
    members.peers.push_back(std::move(peer));
    members.incarnations.push_back(device->incarnation);
  }
  return members;
}

grpc::Status FanOut::lost_status() const {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      absl::StrCat("the device was marked lost after missing heartbeats for ",
                                   absl::FormatDuration(heartbeat_timeout_)));
}

void FanOut::wait_for_calls(absl::Duration timeout) {
  absl::MutexLock lock(&async_mu_);
  auto none = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(async_mu_) { return async_calls_ == 0; };
  async_mu_.AwaitWithTimeout(absl::Condition(&none), timeout);
}

}  // namespace tessera

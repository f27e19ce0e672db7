#include "worker/registration.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/rpc.h"

namespace tessera {
namespace {

// At most this many held buffers go in a registration (about 25 bytes each, well under the
// coordinator's 4 MiB message limit); the others cannot be adopted after a coordinator restart.
constexpr int kMaxHeldBuffersReported = 100'000;

}  // namespace

absl::Status Registration::start(const std::string& address) {
  address_ = address;
  return register_until_deadline();
}

void Registration::start_heartbeats() {
  heartbeat_thread_ = std::thread([this] { heartbeat_loop(); });
}

void Registration::announce_draining() {
  draining_ = true;
  absl::MutexLock lock(&wake_mu_);
  wake_ = true;
}

void Registration::beat_now() {
  absl::MutexLock lock(&wake_mu_);
  wake_ = true;
}

void Registration::take_view(uint64_t ticket, uint64_t held, const pb::ClusterPeers* peers, const char* reply) {
  if (peers_ == nullptr) return;
  const absl::Status taken = peers_->update(ticket, epoch_, held, peers, reply);
  if (!taken.ok()) std::fprintf(stderr, "tessera-worker: %s\n", std::string(taken.message()).c_str());
}

bool Registration::wait_for_next_heartbeat() {
  absl::MutexLock lock(&wake_mu_);
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(wake_mu_) { return wake_; };
  wake_mu_.AwaitWithTimeout(absl::Condition(&woken), heartbeat_interval_);
  wake_ = false;
  return stopping_.HasBeenNotified();
}

void Registration::stop() {
  if (!stopping_.HasBeenNotified()) stopping_.Notify();
  // A RegisterWorker in flight (bounded by its deadline) is joined below; what waits for its
  // answer goes on now (a drain or shutdown waits for the runs).
  if (registering_) registering_(false);
  {
    absl::MutexLock lock(&wake_mu_);
    wake_ = true;
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
}

absl::Status Registration::leave() {
  stop();  // no heartbeat after this one: it would register the device again
  if (coordinator_ == nullptr || device_id_.load() < 0) return absl::OkStatus();  // never registered
  pb::HeartbeatRequest req;
  req.set_draining(true);
  req.set_leaving(true);
  req.set_device_id(device_id_);
  req.set_incarnation(incarnation_);
  req.set_epoch(epoch_);
  pb::HeartbeatReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, heartbeat_interval_ * 2);
  return from_grpc(coordinator_->Heartbeat(&ctx, req, &reply),
                   absl::StrCat("coordinator ", options_.coordinator_address));
}

absl::Status Registration::register_until_deadline() {
  const absl::Time deadline = absl::Now() + options_.register_timeout;
  absl::Duration pause = absl::Seconds(1);
  for (int attempt = 1;; ++attempt) {
    coordinator_ = pb::Coordinator::NewStub(make_channel(options_.coordinator_address, identity_));
    absl::Status registered =
        register_worker(options_.device_id, std::min(deadline - absl::Now(), kConnectDeadline), false);
    if (registered.ok()) {
      if (attempt > 1) std::fprintf(stderr, "tessera-worker: registered at attempt %d\n", attempt);
      return registered;
    }
    // A refusal (another protocol version, a device id taken) is the coordinator's answer.
    if (!absl::IsUnavailable(registered) && !absl::IsDeadlineExceeded(registered)) return registered;
    const absl::Duration left = deadline - absl::Now();
    if (left <= pause) {
      return absl::DeadlineExceededError(absl::StrCat("tessera-worker: could not register with coordinator ",
                                                      options_.coordinator_address, " within ",
                                                      absl::FormatDuration(options_.register_timeout), " (", attempt,
                                                      " attempts); the last: ", registered.message()));
    }
    std::fprintf(stderr, "tessera-worker: registration attempt %d failed: %s; retrying in %s (%s left)\n", attempt,
                 std::string(registered.message()).c_str(), absl::FormatDuration(pause).c_str(),
                 absl::FormatDuration(absl::Trunc(left, absl::Seconds(1))).c_str());
    if (!options_.wait_or_stop) {
      absl::SleepFor(pause);
    } else if (options_.wait_or_stop(pause)) {
      return absl::CancelledError(
          absl::StrCat("tessera-worker: stopped while waiting to register with ", options_.coordinator_address));
    }
    pause = std::min(pause * 2, absl::Seconds(5));
  }
}

absl::Status Registration::register_worker(int device_id, absl::Duration timeout, bool wait_for_ready) {
  pb::RegisterWorkerRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_name(options_.name.empty() ? address_ : options_.name);
  req.set_address(address_);
  req.set_requested_device_id(device_id);
  req.set_memory_bytes(options_.memory_bytes);
  req.set_previous_incarnation(incarnation_);
  req.set_previous_epoch(epoch_);
  // What this process holds: after a coordinator restart, clients adopt it again.
  for (const auto& [id, buffer] : store_->contents()) {
    if (req.held_buffers_size() == kMaxHeldBuffersReported) {
      std::fprintf(stderr, "tessera-worker: reporting only the first %d of its buffers to the coordinator\n",
                   kMaxHeldBuffersReported);
      break;
    }
    pb::ShardHeader* h = req.add_held_buffers();
    h->set_buffer_id(id);
    h->set_dtype(to_proto(buffer->dtype()));
    to_proto(buffer->shape(), h->mutable_shape());
  }
  pb::RegisterWorkerReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, timeout);
  ctx.set_wait_for_ready(wait_for_ready);
  const uint64_t ticket = peers_ != nullptr ? peers_->ask() : 0;
  // From here until registered_, no collective message goes out under the old declaration. If
  // this fails, they go on under it (Transport::end_registration says why) rather than wait for
  // a registration that may never come.
  if (registering_) registering_(true);
  if (stopping_.HasBeenNotified()) {  // stop() ran since the loop's check: end the hold it missed
    if (registering_) registering_(false);
    return absl::CancelledError(absl::StrCat("device ", device_id, ": not registering again: the worker is stopping"));
  }
  absl::Status answered = from_grpc(coordinator_->RegisterWorker(&ctx, req, &reply),
                                    absl::StrCat("coordinator ", options_.coordinator_address));
  if (!answered.ok()) {
    if (registering_) registering_(false);
    return answered;
  }
  device_id_ = reply.device_id();
  incarnation_ = reply.incarnation();
  if (reply.epoch() != epoch_) plans_->drop_before(reply.epoch());
  epoch_ = reply.epoch();
  // Declared before the view is taken: the view ends the streams peers opened under their
  // replaced registrations, and this worker's sends must already go under its new one.
  registered_(device_id_, epoch_, incarnation_);
  take_view(ticket, 0, reply.has_peers() ? &reply.peers() : nullptr, "RegisterWorker reply");
  heartbeat_interval_ = absl::Milliseconds(std::max<int64_t>(10, reply.heartbeat_interval_ms()));
  return absl::OkStatus();
}

void Registration::heartbeat_loop() {
  while (!wait_for_next_heartbeat()) {
    tick_();
    pb::HeartbeatRequest req;
    req.set_draining(draining_.load());
    req.set_device_id(device_id_);
    req.set_incarnation(incarnation_);
    req.set_epoch(epoch_);
    // The view this worker holds: the reply carries the coordinator's only when it is another
    // (without a PeerView, none is held and every reply carries it).
    const uint64_t held = peers_ != nullptr ? peers_->view_version(epoch_) : 0;
    req.set_view_version(held);
    pb::HeartbeatReply reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, heartbeat_interval_ * 4);
    const uint64_t ticket = peers_ != nullptr ? peers_->ask() : 0;
    const grpc::Status status = coordinator_->Heartbeat(&ctx, req, &reply);
    if (status.ok()) take_view(ticket, held, reply.has_peers() ? &reply.peers() : nullptr, "Heartbeat reply");
    // A missed heartbeat is not fatal: the coordinator decides when a device is lost. One it
    // refuses means it marked this device lost, or restarted and does not know it: register
    // again, keeping the device id (and the buffers, which the coordinator is told about).
    if (status.error_code() != grpc::StatusCode::FAILED_PRECONDITION &&
        status.error_code() != grpc::StatusCode::NOT_FOUND) {
      continue;
    }
    std::fprintf(stderr, "tessera-worker: device %d: %s; registering again\n", device_id_.load(),
                 status.error_message().c_str());
    if (stopping_.HasBeenNotified()) break;  // stop() ended the hold: begin no new one
    health_->set_ready(false);
    absl::Status registered = register_worker(device_id_.load(), heartbeat_interval_ * 4, true);
    health_->set_ready(registered.ok());
    if (registered.ok()) {
      std::fprintf(stderr, "tessera-worker: device %d registered again, incarnation %lu\n", device_id_.load(),
                   static_cast<unsigned long>(incarnation_));
      // A registration clears the coordinator's draining mark: say it again at once rather
      // than a heartbeat interval later, when new work may already have been sent here.
      if (draining_.load()) {
        absl::MutexLock lock(&wake_mu_);
        wake_ = true;
      }
    } else {
      std::fprintf(stderr, "tessera-worker: device %d: %s\n", device_id_.load(),
                   std::string(registered.message()).c_str());
    }
  }
}

}  // namespace tessera

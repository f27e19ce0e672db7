#include "coordinator/plan_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/rpc.h"

namespace tessera {

// The reactor keeps one hold from open() until the stream is ending and no write is in flight:
// OnDone cannot run while a sender may still start a write (gRPC forbids a write after
// OnDone), and every write is started only while the hold is kept.
std::shared_ptr<PlanStream> PlanStream::open(pb::Worker::Stub* stub, uint64_t incarnation, bool wait_for_ready) {
  std::shared_ptr<PlanStream> s(new PlanStream(incarnation));
  {
    absl::MutexLock lock(&s->mu_);
    s->self_ = s;
  }
  s->ctx_.set_wait_for_ready(wait_for_ready);
  stub->async()->RunPlans(&s->ctx_, s.get());
  s->AddHold();
  s->StartRead(&s->result_);
  s->StartCall();
  return s;
}

void PlanStream::run(const pb::RunPlanRequest& request, Done done) {
  pb::PlanStreamRequest message;
  *message.mutable_run() = request;
  this->request(request.execution_id(), std::move(message), std::move(done));
}

void PlanStream::delete_buffers(const pb::StreamDelete& request, Done done) {
  pb::PlanStreamRequest message;
  *message.mutable_delete_buffers() = request;
  this->request(request.request_id(), std::move(message), std::move(done));
}

void PlanStream::request(uint64_t id, pb::PlanStreamRequest message, Done done) {
  {
    absl::MutexLock lock(&mu_);
    if (!ending_) {
      pending_[id] = std::move(done);
      done = nullptr;
    }
  }
  if (done) {
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, "its RunPlans stream is broken"));
    return;
  }
  send(std::move(message));
}

void PlanStream::cancel(uint64_t execution, const grpc::Status& status) {
  Done done;
  {
    absl::MutexLock lock(&mu_);
    done = take_locked(execution);
  }
  if (!done) return;
  pb::PlanStreamRequest message;
  message.set_cancel_execution(execution);
  send(std::move(message));
  done(status);
}

bool PlanStream::broken() const {
  absl::MutexLock lock(&mu_);
  return ending_;
}

bool PlanStream::end_locked() {
  if (ending_) return false;
  ending_ = true;
  return !writes_.writing();
}

PlanStream::Done PlanStream::take_locked(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return nullptr;
  Done done = std::move(it->second);
  pending_.erase(it);
  return done;
}

void PlanStream::send(pb::PlanStreamRequest message) {
  const pb::PlanStreamRequest* first = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (ending_) return;  // OnDone fails whatever is pending
    first = writes_.push(std::move(message));
  }
  if (first != nullptr) StartWrite(first);
}

void PlanStream::OnWriteDone(bool ok) {
  const pb::PlanStreamRequest* next = nullptr;
  bool release = false;
  {
    absl::MutexLock lock(&mu_);
    if (!ok) ending_ = true;  // the read fails too, and OnDone follows
    next = writes_.pop(ending_);
    release = ending_;
  }
  if (next != nullptr) StartWrite(next);
  if (release) RemoveHold();
}

void PlanStream::OnReadDone(bool ok) {
  if (!ok) {
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      release = end_locked();
    }
    if (release) RemoveHold();
    return;
  }
  const uint64_t id = result_.id();
  const int code = result_.code();
  grpc::Status status = to_grpc(absl::Status(static_cast<absl::StatusCode>(code), result_.message()));
  Done done;
  {
    absl::MutexLock lock(&mu_);
    done = take_locked(id);  // null if cancelled already: a late result is dropped
  }
  StartRead(&result_);  // the next result may arrive while this one is handled
  if (done) done(std::move(status));
}

bool PlanStream::close(absl::Duration timeout) {
  bool release = false;
  {
    absl::MutexLock lock(&mu_);
    release = end_locked();
  }
  ctx_.TryCancel();
  if (release) RemoveHold();
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&done_), timeout);
}

void PlanStream::OnDone(const grpc::Status& status) {
  absl::flat_hash_map<uint64_t, Done> pending;
  std::shared_ptr<PlanStream> self;  // the last reference may go with it
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    ending_ = true;
    pending.swap(pending_);
    self = std::move(self_);
  }
  const grpc::Status broken(
      grpc::StatusCode::UNAVAILABLE,
      absl::StrCat("its RunPlans stream ended", status.ok() ? "" : absl::StrCat(" (", status.error_message(), ")")));
  for (auto& [execution, done] : pending) done(broken);
}

}  // namespace tessera

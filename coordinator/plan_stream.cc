#include "coordinator/plan_stream.h"

#include <atomic>
#include <functional>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "proto/rpc.h"

namespace tessera {

// The reactor keeps one hold from open() until the stream is ending and no write is in flight:
// OnDone cannot run while a sender may still start a write (gRPC forbids a write after
// OnDone), and every write is started only while the hold is kept.
std::shared_ptr<GrpcPlanStream> GrpcPlanStream::open(pb::Worker::Stub* stub, uint64_t incarnation,
                                                     bool wait_for_ready) {
  std::shared_ptr<GrpcPlanStream> s(new GrpcPlanStream(incarnation));
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
  bool ending = false;
  std::string why;
  {
    absl::MutexLock lock(&mu_);
    ending = ending_;
    if (ending) {
      why = why_;
    } else {
      pending_[id] = std::move(done);
    }
  }
  if (ending) {
    done(grpc::Status(grpc::StatusCode::UNAVAILABLE, why));
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

PlanStream::Done PlanStream::take_locked(uint64_t id) {
  auto it = pending_.find(id);
  if (it == pending_.end()) return nullptr;
  Done done = std::move(it->second);
  pending_.erase(it);
  return done;
}

void PlanStream::fail_pending(const std::string& why) {
  absl::flat_hash_map<uint64_t, Done> pending;
  std::string first;
  {
    absl::MutexLock lock(&mu_);
    ending_ = true;
    if (!failed_) {  // the first end says why: a worker's stop after close() changes nothing
      failed_ = true;
      why_ = why;
    }
    first = why_;
    pending.swap(pending_);
  }
  const grpc::Status broken(grpc::StatusCode::UNAVAILABLE, first);
  for (auto& [id, done] : pending) done(broken);
}

bool GrpcPlanStream::end_locked() {
  if (ending_) return false;
  ending_ = true;
  return !writes_.writing();
}

void GrpcPlanStream::send(pb::PlanStreamRequest message) {
  const pb::PlanStreamRequest* first = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (ending_) return;  // OnDone fails whatever is pending
    first = writes_.push(std::move(message));
  }
  if (first != nullptr) StartWrite(first);
}

void GrpcPlanStream::OnWriteDone(bool ok) {
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

void GrpcPlanStream::OnReadDone(bool ok) {
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

bool GrpcPlanStream::close(absl::Duration timeout) {
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

void GrpcPlanStream::OnDone(const grpc::Status& status) {
  std::shared_ptr<GrpcPlanStream> self;  // the last reference may go with it
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    ending_ = true;  // no write may start after OnDone
    self = std::move(self_);
  }
  fail_pending(
      absl::StrCat("its RunPlans stream ended", status.ok() ? "" : absl::StrCat(" (", status.error_message(), ")")));
}

namespace {
// A result that came back inside a hand-off, completed after it (LocalPlanStream::send).
struct HandedBack {
  std::shared_ptr<LocalPlanStream> stream;
  pb::RunPlanResult result;
};
// Most hand-offs get back one result (a small run's) or none: kept inline, no allocation.
using HandedBackQueue = absl::InlinedVector<HandedBack, 1>;

// The results a thread completes after the hand-off at hand (LocalPlanStream::send), while it
// hands requests over; null when it hands none.
thread_local HandedBackQueue* t_handed_back = nullptr;

// Makes `queue` the thread's t_handed_back if it has none, for the guard's life; however the
// scope is left (an exception from receive() or a completion), the thread keeps no pointer to
// it.
class HandedBackScope {
 public:
  explicit HandedBackScope(HandedBackQueue* queue) : outermost_(t_handed_back == nullptr) {
    if (outermost_) t_handed_back = queue;
  }
  ~HandedBackScope() {
    if (outermost_) t_handed_back = nullptr;
  }
  HandedBackScope(const HandedBackScope&) = delete;
  HandedBackScope& operator=(const HandedBackScope&) = delete;
  bool outermost() const { return outermost_; }

 private:
  const bool outermost_;
};
}  // namespace

std::shared_ptr<LocalPlanStream> LocalPlanStream::open(LocalRuns& runs, uint64_t incarnation,
                                                       std::shared_ptr<std::atomic<int64_t>> handed_over) {
  std::shared_ptr<LocalPlanStream> s(new LocalPlanStream(incarnation, std::move(handed_over)));
  // The session keeps no hold on the stream: a result after the stream went is dropped.
  std::weak_ptr<LocalPlanStream> weak = s;
  std::shared_ptr<LocalRunSession> session = runs.open(
      [weak](const pb::RunPlanResult& result) {
        std::shared_ptr<LocalPlanStream> stream = weak.lock();
        if (stream == nullptr) return;
        if (t_handed_back != nullptr) {  // inside a hand-off: after it (see the class comment)
          t_handed_back->push_back(HandedBack{std::move(stream), result});
          return;
        }
        stream->deliver(result);
      },
      [weak](const std::string& why) {
        if (std::shared_ptr<LocalPlanStream> stream = weak.lock()) stream->end(why);
      });
  {
    absl::MutexLock lock(&s->mu_);
    // The worker stopped before open (null), or while it opened: its on_end ran already (end()
    // found no session) and the stream stays ended.
    s->ending_ = s->ending_ || session == nullptr;
    if (!s->ending_) s->session_ = std::move(session);
  }
  if (session != nullptr) session->close();  // ended while it opened: as end() closes it
  return s;
}

LocalPlanStream::~LocalPlanStream() {
  std::shared_ptr<LocalRunSession> session;
  {
    absl::MutexLock lock(&mu_);
    session = std::move(session_);
  }
  if (session != nullptr) session->close();  // the worker's runs in progress are told to stop
}

void LocalPlanStream::send(pb::PlanStreamRequest message) {
  std::shared_ptr<LocalRunSession> session;
  {
    absl::MutexLock lock(&mu_);
    session = session_;
  }
  if (session == nullptr) return;  // ending: end() failed whatever is pending
  if (handed_over_ != nullptr) handed_over_->fetch_add(1, std::memory_order_relaxed);
  HandedBackQueue handed_back;
  const HandedBackScope scope(&handed_back);
  // Not under mu_: a small run ends inside, and its result comes back through deliver().
  if (!session->receive(std::move(message))) end("its worker stopped");
  if (!scope.outermost()) return;
  // Completing a result may hand the next request over: that one returns here, so however
  // long the chain, a thread holds at most two hand-offs. In the order they came; what was
  // completed is dropped once it is most of the queue, so the queue holds about what is still to
  // complete, however long the chain (amortised: each entry is moved at most once more).
  for (size_t next = 0; next < handed_back.size();) {
    HandedBack back = std::move(handed_back[next++]);  // completing it may grow the queue
    back.stream->deliver(back.result);
    if (next > handed_back.size() / 2) {
      handed_back.erase(handed_back.begin(), handed_back.begin() + static_cast<std::ptrdiff_t>(next));
      next = 0;
    }
  }
}

void LocalPlanStream::deliver(const pb::RunPlanResult& result) {
  Done done;
  {
    absl::MutexLock lock(&mu_);
    done = take_locked(result.id());
    if (!done) return;  // cancelled or failed already: a late result is dropped
    ++delivering_;
  }
  done(to_grpc(absl::Status(static_cast<absl::StatusCode>(result.code()), result.message())));
  absl::MutexLock lock(&mu_);
  --delivering_;
}

void LocalPlanStream::end(const std::string& why) {
  std::shared_ptr<LocalRunSession> session;
  {
    absl::MutexLock lock(&mu_);
    session = std::move(session_);
  }
  if (session != nullptr) session->close();  // the worker's runs in progress are told to stop
  fail_pending(absl::StrCat("its in-process run session ended (", why, ")"));
}

bool LocalPlanStream::close(absl::Duration timeout) {
  end("closed by the coordinator");
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return delivering_ == 0; };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

}  // namespace tessera

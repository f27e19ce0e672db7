#include "client/execution.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "client/client_impl.h"
#include "proto/rpc.h"

namespace tessera::internal {
namespace {

thread_local bool t_on_callback_thread = false;

// Marks the current thread as running a gRPC callback for as long as it lives.
class CallbackScope {
 public:
  CallbackScope() : was_(t_on_callback_thread) { t_on_callback_thread = true; }
  ~CallbackScope() { t_on_callback_thread = was_; }

 private:
  const bool was_;
};

// The slack between an Execute RPC's deadline and the one waiters use.
constexpr absl::Duration kRpcSlack = absl::Seconds(10);

// One Execute RPC in flight: gRPC needs all three until the callback runs.
struct ExecuteCall {
  grpc::ClientContext ctx;
  pb::ExecuteRequest request;
  pb::ExecuteReply reply;
};

}  // namespace

bool on_callback_thread() { return t_on_callback_thread; }

absl::Status InFlight::begin_execution(absl::Time finish_by, const std::string& who) {
  absl::MutexLock lock(&mu_);
  auto has_room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return executions_ < kMaxExecutionsInFlight; };
  // Everything in flight has finished by latest_: a slot is free by then at the latest.
  if (!mu_.AwaitWithDeadline(absl::Condition(&has_room), latest_ + absl::Seconds(1))) {
    return absl::DeadlineExceededError(
        absl::StrCat(who, ": ", kMaxExecutionsInFlight, " calls are in flight and none finished by its deadline"));
  }
  ++executions_;
  ++count_;
  latest_ = std::max(latest_, finish_by);
  return absl::OkStatus();
}

void InFlight::begin_call(absl::Time finish_by) {
  absl::MutexLock lock(&mu_);
  ++count_;
  latest_ = std::max(latest_, finish_by);
}

Deletes InFlight::start_batch() {
  if (delete_in_flight_ || deletes_.empty()) return {};
  delete_in_flight_ = true;
  ++count_;
  latest_ = std::max(latest_, absl::Now() + kControlDeadline);
  Deletes batch;
  batch.swap(deletes_);
  return batch;
}

bool InFlight::start_linger() {
  if (delete_in_flight_ || lingering_ || deletes_.empty()) return false;
  lingering_ = true;
  ++count_;
  latest_ = std::max(latest_, absl::Now() + kDeleteLinger + kControlDeadline);
  return true;
}

bool InFlight::end_execution() {
  absl::MutexLock lock(&mu_);
  --count_;
  return --executions_ == 0 && start_linger();
}

bool InFlight::queue_delete(uint64_t id, std::string grant, bool* linger) {
  absl::MutexLock lock(&mu_);
  if (deletes_.size() >= kMaxQueuedDeletes) return false;
  deletes_.emplace_back(id, std::move(grant));
  if (executions_ == 0) *linger = start_linger();
  return true;
}

Deletes InFlight::end_linger() {
  absl::MutexLock lock(&mu_);
  lingering_ = false;
  --count_;  // start_batch counts the batch's sender in the same hold: never 0 in between
  return executions_ == 0 ? start_batch() : Deletes();
}

Deletes InFlight::take_deletes() {
  absl::MutexLock lock(&mu_);
  Deletes deletes;
  deletes.swap(deletes_);
  return deletes;
}

void InFlight::requeue(Deletes deletes) {
  absl::MutexLock lock(&mu_);
  for (auto& d : deletes) deletes_.push_back(std::move(d));
}

std::optional<absl::Duration> InFlight::retry_deletes(Deletes arrays, Deletes* given_up, int* attempts) {
  absl::MutexLock lock(&mu_);
  *attempts = ++delete_retries_;
  if (delete_retries_ > kMaxDeleteRetries) {
    delete_retries_ = 0;
    *given_up = std::move(arrays);
    return std::nullopt;
  }
  // Bounded by the queue: what does not fit is given up now (drops made meanwhile queued).
  const size_t room = kMaxQueuedDeletes - std::min(kMaxQueuedDeletes, deletes_.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    (i < room ? deletes_ : *given_up).push_back(std::move(arrays[i]));
  }
  deletes_retried_ += static_cast<int64_t>(std::min(room, arrays.size()));
  const absl::Duration wait = kFirstDeleteRetry * (1 << (delete_retries_ - 1));
  latest_ = std::max(latest_, absl::Now() + wait + kControlDeadline);
  return wait;
}

void InFlight::end_delete_retries() {
  absl::MutexLock lock(&mu_);
  delete_retries_ = 0;
}

void InFlight::count_failed_deletes(int64_t n, const absl::Status& error) {
  if (n == 0) return;
  absl::MutexLock lock(&mu_);
  deletes_failed_ += n;
  delete_error_ = error;
}

Deletes InFlight::next_delete_batch() {
  absl::MutexLock lock(&mu_);
  delete_in_flight_ = false;
  --count_;
  return start_batch();
}

Deletes InFlight::start_flush() {
  absl::MutexLock lock(&mu_);
  return start_batch();
}

absl::Status InFlight::await_deletes(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return deletes_.empty() && !delete_in_flight_; };
  if (mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("flush_deletes: ", deletes_.size(),
                                                  " deletions still wait and a DeleteArray is ",
                                                  delete_in_flight_ ? "in flight" : "not in flight"));
}

int64_t InFlight::deletes_failed() const {
  absl::MutexLock lock(&mu_);
  return deletes_failed_;
}

int64_t InFlight::deletes_retried() const {
  absl::MutexLock lock(&mu_);
  return deletes_retried_;
}

absl::Status InFlight::take_delete_error() {
  absl::MutexLock lock(&mu_);
  absl::Status error = std::move(delete_error_);
  delete_error_ = absl::OkStatus();
  return error;
}

void InFlight::end_call() {
  absl::MutexLock lock(&mu_);
  --count_;
}

void InFlight::wait_idle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return count_ == 0; };
  if (mu_.AwaitWithDeadline(absl::Condition(&idle), latest_ + absl::Seconds(5))) return;
  // gRPC runs every callback by its call's deadline; getting here means a bug, and freeing
  // the client under a live callback would be worse than waiting on.
  std::fprintf(stderr, "tessera client: %d calls still in flight past their deadlines; waiting for them\n", count_);
  mu_.Await(absl::Condition(&idle));
}

ArrayBuffers::~ArrayBuffers() {
  if (!donated_.load()) free_buffers();  // else the donating call freed them
}

void ArrayBuffers::free_buffers() {
  if (producer_ != nullptr) {
    producer_->release_output(output_);
  } else {
    client_->delete_array(id_);
  }
}

std::vector<std::shared_ptr<Execution>> ArrayBuffers::donate() {
  donated_.store(true);
  std::vector<std::shared_ptr<Execution>> running;
  absl::MutexLock lock(&readers_mu_);
  for (const std::weak_ptr<Execution>& r : readers_) {
    std::shared_ptr<Execution> e = r.lock();
    if (e != nullptr && !e->ready()) running.push_back(std::move(e));
  }
  readers_.clear();
  return running;
}

void ArrayBuffers::add_reader(const std::shared_ptr<Execution>& reader) {
  absl::MutexLock lock(&readers_mu_);
  // Forget the readers that have finished, so the list stays short in a long loop.
  readers_.erase(std::remove_if(readers_.begin(), readers_.end(),
                                [](const std::weak_ptr<Execution>& r) {
                                  std::shared_ptr<Execution> e = r.lock();
                                  return e == nullptr || e->ready();
                                }),
                 readers_.end());
  readers_.push_back(reader);
}

bool ArrayBuffers::ready() const { return producer_ == nullptr || producer_->ready(); }

bool ArrayBuffers::await_ready(absl::Duration max_wait) const {
  return producer_ == nullptr || producer_->await_done(max_wait);
}

absl::StatusOr<uint64_t> ArrayBuffers::wait() const {
  if (producer_ == nullptr) return id_;
  absl::Status status = producer_->wait();
  if (!status.ok()) return status;
  return producer_->output_id(output_);
}

Execution::Execution(ClientImpl* client, std::vector<std::shared_ptr<ArrayBuffers>> inputs, int num_outputs,
                     absl::Duration timeout, absl::Time deadline, std::string who)
    : client_(client),
      in_flight_(client->in_flight()),
      num_outputs_(num_outputs),
      timeout_(timeout),
      who_(std::move(who)),
      deadline_(deadline),
      call_id_(client->next_call_id()),
      inputs_(std::move(inputs)),
      released_(static_cast<size_t>(num_outputs), false) {}

absl::Time Execution::finish_by(const std::vector<std::shared_ptr<ArrayBuffers>>& inputs, absl::Duration timeout) {
  // Execute is sent once the last input is ready (by its producer's deadline at the latest)
  // and its RPC ends by timeout + kRpcSlack after that.
  absl::Time start = absl::Now();
  for (const auto& in : inputs) {
    if (in->producer() != nullptr) start = std::max(start, in->producer()->deadline());
  }
  return start + timeout + kRpcSlack + absl::Seconds(1);
}

void Execution::start(ExecutableRef executable, const std::vector<std::shared_ptr<Execution>>& after,
                      Recompile recompile) {
  executable_ = executable;
  recompile_ = std::move(recompile);
  // Inputs whose producers' Execute is in flight are named as those calls' outputs: sent now.
  bool in_flight = false, can_forward = after.empty();
  for (const auto& in : inputs_) {
    if (in->producer() == nullptr || in->producer()->ready()) continue;
    in_flight = true;
    if (!in->producer()->sent()) can_forward = false;  // still waiting for its own inputs
  }
  if (in_flight && can_forward) {
    forward();
    return;
  }
  // One count per input still being computed and per call to wait for, and one for this
  // function, so that dispatch() runs once, after the last of them.
  std::vector<std::shared_ptr<Execution>> waits = after;
  for (const auto& in : inputs_) {
    if (in->producer() != nullptr) waits.push_back(in->producer());
  }
  pending_inputs_.store(static_cast<int>(waits.size()) + 1);
  std::shared_ptr<Execution> self = shared_from_this();
  for (const std::shared_ptr<Execution>& w : waits) w->on_finish([self] { self->input_ready(); });
  input_ready();
}

void Execution::input_ready() {
  if (pending_inputs_.fetch_sub(1) == 1) dispatch();
}

void Execution::dispatch() {
  std::vector<uint64_t> ids;
  for (size_t i = 0; i < inputs_.size(); ++i) {
    // Every producer has finished: this does not block.
    absl::StatusOr<uint64_t> id = inputs_[i]->wait();
    if (!id.ok()) {
      const Execution& producer = *inputs_[i]->producer();
      finish(failed_input(who_, i, producer), {}, producer.root_cause());
      return;
    }
    ids.push_back(*id);
  }
  send(std::move(ids), absl::Now() + timeout_ + kRpcSlack, recompile_ != nullptr);
}

void Execution::forward() {
  std::vector<uint64_t> ids(inputs_.size(), 0);
  std::vector<pb::CallOutput> pending;
  named_producers_.assign(inputs_.size(), nullptr);
  for (size_t i = 0; i < inputs_.size(); ++i) {
    const std::shared_ptr<Execution>& producer = inputs_[i]->producer();
    if (producer != nullptr && !producer->ready()) {
      pb::CallOutput& p = pending.emplace_back();
      p.set_input(static_cast<int32_t>(i));
      p.set_call_id(producer->call_id());
      p.set_output(inputs_[i]->output());
      named_producers_[i] = producer;
      continue;
    }
    absl::StatusOr<uint64_t> id = inputs_[i]->wait();  // ready: does not block
    if (!id.ok()) {
      finish(failed_input(who_, i, *producer), {}, producer->root_cause());
      return;
    }
    ids[i] = *id;
  }
  // By the producers' deadlines plus this call's timeout (deadline_ is one second later).
  send(std::move(ids), deadline_ - absl::Seconds(1), recompile_ != nullptr, std::move(pending));
}

void Execution::after_producers(std::function<void()> f) {
  auto left = std::make_shared<std::atomic<int>>(1);
  auto then = std::make_shared<std::function<void()>>(std::move(f));
  auto one_done = [left, then] {
    if (left->fetch_sub(1) == 1) (*then)();
  };
  for (const std::shared_ptr<Execution>& p : named_producers_) {
    if (p == nullptr) continue;
    left->fetch_add(1);
    p->on_finish(one_done);
  }
  one_done();
}

void Execution::send(std::vector<uint64_t> inputs, absl::Time rpc_deadline, bool may_recompile,
                     std::vector<pb::CallOutput> pending) {
  auto call = std::make_unique<ExecuteCall>();
  call->request.set_executable_id(executable_.id);
  call->request.set_epoch(executable_.epoch);
  call->request.mutable_input_arrays()->Assign(inputs.begin(), inputs.end());
  call->request.set_timeout_ms(absl::ToInt64Milliseconds(timeout_));
  call->request.set_session_id(client_->session());
  call->request.set_call_id(call_id_);
  for (auto& [id, grant] : in_flight_->take_deletes()) {
    call->request.add_delete_arrays(id);
    call->request.add_delete_grants(std::move(grant));
  }
  const bool named = !pending.empty();
  for (pb::CallOutput& p : pending) *call->request.add_pending_inputs() = std::move(p);
  call->ctx.set_deadline(absl::ToChronoTime(rpc_deadline));
  ExecuteCall* raw = call.release();
  sent_.store(true);
  client_->coordinator()->async()->Execute(
      &raw->ctx, &raw->request, &raw->reply,
      [self = shared_from_this(), raw, inputs = std::move(inputs), may_recompile, named](grpc::Status s) mutable {
        CallbackScope scope;
        std::unique_ptr<ExecuteCall> owned(raw);
        if (!s.ok() && owned->request.delete_arrays_size() > 0) {  // the deletions it carried wait again
          Deletes carried;
          for (int k = 0; k < owned->request.delete_arrays_size(); ++k) {
            carried.emplace_back(owned->request.delete_arrays(k),
                                 k < owned->request.delete_grants_size() ? owned->request.delete_grants(k) : "");
          }
          self->in_flight_->requeue(std::move(carried));
        }
        if (!s.ok() && named) {
          // Report a failed producer's own error (its reply may come after this one); after a
          // coordinator restart (ABORTED), send again the usual way once the producers are done.
          owned.reset();
          const bool aborted = s.error_code() == grpc::StatusCode::ABORTED;
          self->after_producers([self, status = from_grpc(s, self->who_), aborted]() mutable {
            for (size_t i = 0; i < self->named_producers_.size(); ++i) {
              const std::shared_ptr<Execution>& p = self->named_producers_[i];
              if (p != nullptr && !p->wait().ok()) {  // finished: does not block
                self->finish(failed_input(self->who_, i, *p), {}, p->root_cause());
                return;
              }
            }
            if (aborted) {
              self->dispatch();
            } else {
              self->finish(std::move(status), {});
            }
          });
          return;
        }
        if (s.error_code() == grpc::StatusCode::ABORTED && may_recompile) {
          // The coordinator restarted since the program was compiled: adopt the inputs and
          // compile again, then send once more, all within this call's deadline (the
          // Execute that failed answered at once, so its budget is left).
          owned.reset();
          const absl::Time deadline = self->deadline_ - absl::Seconds(1);
          const std::vector<uint64_t> ids = inputs;
          self->recompile_(ids, deadline,
                           [self, inputs = std::move(inputs), deadline](absl::StatusOr<ExecutableRef> e) mutable {
                             CallbackScope scope;
                             if (!e.ok()) {
                               self->finish(e.status(), {});
                               return;
                             }
                             self->executable_ = *e;
                             self->send(std::move(inputs), deadline, false);
                           });
          return;
        }
        absl::Status status = from_grpc(s, self->who_);
        std::vector<uint64_t> ids;
        if (status.ok()) {
          const pb::ExecuteReply& reply = owned->reply;
          if (reply.refused_deletes_size() > 0) {
            // The call ran; some deletions it carried were refused (another session's arrays,
            // left untouched): failed deletions, as a refused DeleteArray's would be.
            Deletes refused;
            for (uint64_t id : reply.refused_deletes()) refused.emplace_back(id, "");
            self->client_->deletes_failed(
                refused, absl::PermissionDeniedError(reply.delete_error().empty()
                                                         ? "execute: delete_arrays: refused by the coordinator"
                                                         : reply.delete_error()));
          }
          for (int k = 0; k < reply.output_ids_size(); ++k) {
            ids.push_back(reply.output_ids(k));
            self->client_->remember_grant(reply.output_ids(k), k < reply.grants_size() ? reply.grants(k) : "");
          }
          if (static_cast<int>(ids.size()) != self->num_outputs_) {
            status = absl::InternalError(absl::StrCat(self->who_, ": Execute returned ", ids.size(),
                                                      " outputs, the program has ", self->num_outputs_));
            // Nobody will ever hold these: free them now.
            for (uint64_t id : ids) self->client_->delete_array(id);
            ids.clear();
          }
        }
        owned.reset();
        self->finish(std::move(status), std::move(ids));
      });
}

void Execution::finish(absl::Status status, std::vector<uint64_t> ids, absl::Status root_cause) {
  std::vector<std::function<void()>> continuations;
  std::vector<uint64_t> orphans;  // outputs whose handles went while this ran
  if (status.ok() && outputs_ != nullptr) {
    for (size_t i = 0; i < ids.size() && i < outputs_->size(); ++i) client_->track(ids[i], (*outputs_)[i]);
  }
  {
    absl::MutexLock lock(&mu_);
    done_ = true;
    root_cause_ = root_cause.ok() ? status : std::move(root_cause);
    status_ = std::move(status);
    output_ids_ = std::move(ids);
    continuations.swap(continuations_);
    if (status_.ok()) {
      for (int i = 0; i < num_outputs_; ++i) {
        if (released_[i]) orphans.push_back(output_ids_[i]);
      }
    }
  }

  // The inputs are no longer read: their buffers may go now (if this held the last owner).
  inputs_.clear();
  named_producers_.clear();
  for (uint64_t id : orphans) client_->delete_array(id);
  for (std::function<void()>& f : continuations) f();
  // Last: once this execution no longer counts, ~ClientImpl may run (unless it was the last
  // and deletions wait: their linger then counts until it ends).
  if (in_flight_->end_execution()) client_->linger_deletes();
}

bool Execution::ready() const {
  absl::MutexLock lock(&mu_);
  return done_;
}

bool Execution::await_done(absl::Duration max_wait) const {
  absl::MutexLock lock(&mu_);
  const absl::Time until = std::min(absl::Now() + max_wait, deadline_);
  return mu_.AwaitWithDeadline(absl::Condition(&done_), until) || absl::Now() >= deadline_;
}

absl::Status Execution::wait() const {
  absl::MutexLock lock(&mu_);
  // Only a wait that blocks shows on the timeline (the SDK also asks finished calls).
  ProfileSpan span(done_ ? nullptr : &client_->profile(), "client", [] { return std::string("wait"); });
  if (span) span.arg("call", absl::StrCat(call_id_));
  if (!mu_.AwaitWithDeadline(absl::Condition(&done_), deadline_)) {
    return absl::DeadlineExceededError(absl::StrCat(who_, ": the call has not finished by its deadline ",
                                                    absl::FormatTime(deadline_), " (timeout ",
                                                    absl::FormatDuration(timeout_), " plus the wait for its inputs)"));
  }
  return status_;
}

absl::Status Execution::root_cause() const {
  absl::MutexLock lock(&mu_);
  return root_cause_;
}

absl::Status Execution::failed_input(const std::string& who, size_t index, const Execution& failed) {
  // The root cause, not the chain: a long chain of failed calls keeps a short message.
  const absl::Status cause = failed.root_cause();
  return absl::Status(cause.code(),
                      absl::StrCat(who, ": argument ", index, " is an output of a failed call: ", cause.message()));
}

uint64_t Execution::output_id(int i) const {
  absl::MutexLock lock(&mu_);
  return output_ids_[i];
}

void Execution::on_finish(std::function<void()> f) {
  {
    absl::MutexLock lock(&mu_);
    if (!done_) {
      continuations_.push_back(std::move(f));
      return;
    }
  }
  f();
}

void Execution::release_output(int i) {
  uint64_t id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (!done_) {
      released_[i] = true;
      return;
    }
    if (status_.ok()) id = output_ids_[i];
  }
  if (id != 0) client_->delete_array(id);
}

}  // namespace tessera::internal

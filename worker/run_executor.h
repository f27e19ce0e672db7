// RunExecutor: the thread that computes the small runs a worker would otherwise have computed
// on the thread that handed it their request (a RunPlans reactor's gRPC callback thread, or the
// coordinator's Execute thread handing runs over in process), so that what runs on a gRPC
// callback thread only decodes and queues (issue #17). Tasks run one at a time, in the order
// they were posted; a task never waits (a run that might wait goes to a plan thread, a stepped
// run parks). The process has one, shared by its PlanRunners (Client::local's embedded workers
// all post to it, so a call's runs, and the rounds of a stepped psum between them, stay on one
// thread, as they stayed on the coordinator's before): made by the first, joined when the last
// lets go of it.
//
//   std::shared_ptr<RunExecutor> executor = RunExecutor::shared();
//   executor->post([] { ... });   // never waits; the caller bounds what it posts
//
// Lock: mu_ (a leaf) guards the queue; held only to push or take the queue, never across a task.
// A post wakes the thread only when it sleeps (most posts of a busy thread take the lock once and
// signal nothing), and, within a hand-over batch (proto/local_runs.h's HandOverBatch: the
// coordinator handing a call's runs over in process), once at the batch's end.
#ifndef TESSERA_WORKER_RUN_EXECUTOR_H_
#define TESSERA_WORKER_RUN_EXECUTOR_H_

#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/local_runs.h"

namespace tessera {

class RunExecutor : public std::enable_shared_from_this<RunExecutor> {
 public:
  RunExecutor() : thread_([this] { loop(); }) {}
  RunExecutor(const RunExecutor&) = delete;
  RunExecutor& operator=(const RunExecutor&) = delete;
  // Runs the tasks posted already, then joins the thread. REQUIRES: not called on that thread.
  ~RunExecutor() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      if (sleeping_) wake_.Signal();
    }
    thread_.join();
  }

  // The process's executor: the one alive, or a new one.
  static std::shared_ptr<RunExecutor> shared() {
    static absl::Mutex* const mu = new absl::Mutex;
    static std::weak_ptr<RunExecutor>* const current = new std::weak_ptr<RunExecutor>;
    absl::MutexLock lock(mu);
    std::shared_ptr<RunExecutor> executor = current->lock();
    if (executor == nullptr) {
      executor = std::make_shared<RunExecutor>();
      *current = executor;
    }
    return executor;
  }

  // Queues `task` after those posted before it. Never waits; unbounded here (PlanRunner bounds
  // what each runner has queued: kMaxQueuedRuns).
  void post(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(task));
    if (!sleeping_ || wake_deferred_) return;
    // A hand-over batch open on this thread (a call's runs handed over one after another)
    // wakes the thread once, at its end (proto/local_runs.h). Never on this executor's thread:
    // it does not sleep while it posts.
    if (HandOverBatch::defer([self = shared_from_this()] { self->wake_deferred(); })) {
      wake_deferred_ = true;
      return;
    }
    sleeping_ = false;  // one signal per sleep
    wake_.Signal();
  }

  std::thread::id thread_id() const { return thread_.get_id(); }

 private:
  void wake_deferred() {
    absl::MutexLock lock(&mu_);
    wake_deferred_ = false;
    if (!sleeping_) return;  // woken meanwhile by another thread's post
    sleeping_ = false;
    wake_.Signal();
  }

  void loop() {
    std::vector<std::function<void()>> batch;
    absl::MutexLock lock(&mu_);
    while (true) {
      while (queue_.empty() && !stopping_) {
        sleeping_ = true;
        wake_.Wait(&mu_);
        sleeping_ = false;
      }
      if (queue_.empty()) return;  // stopping, and nothing left
      batch.swap(queue_);          // the whole queue at once: one lock per batch, not per task
      mu_.Unlock();
      for (std::function<void()>& task : batch) {
        task();
        task = nullptr;  // what it holds goes before the next task runs
      }
      batch.clear();
      mu_.Lock();
    }
  }

  absl::Mutex mu_;
  absl::CondVar wake_;
  std::vector<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool sleeping_ ABSL_GUARDED_BY(mu_) = false;
  bool wake_deferred_ ABSL_GUARDED_BY(mu_) = false;  // a hand-over batch will wake the thread
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: it starts with everything above made
};

}  // namespace tessera

#endif  // TESSERA_WORKER_RUN_EXECUTOR_H_

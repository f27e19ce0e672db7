// ThreadPool: the threads a daemon runs work on that may block (a plan waiting for its peers'
// collective data, a fan-out waiting for the workers), so that none of it runs on a gRPC
// callback thread. At most `limit` threads, made as needed and reused; a task that finds every
// one busy is refused rather than queued (a queue would let a task wait behind others that
// wait, across processes, for it). Every thread is joined by the destructor, after the tasks
// handed to it have run.
//
//   ThreadPool pool("plan runs", 256);
//   absl::Status started = pool.run([] { ... });   // RESOURCE_EXHAUSTED when 256 are busy
#ifndef TESSERA_CORE_THREAD_POOL_H_
#define TESSERA_CORE_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace tessera {

class ThreadPool {
 public:
  // `what` names the pool's work in errors ("plan runs").
  ThreadPool(std::string what, int limit) : what_(std::move(what)), limit_(limit) {}
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs the tasks handed over already, then joins every thread. REQUIRES: each task ends by
  // itself within a bounded time.
  ~ThreadPool() {
    std::vector<std::thread> threads;
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
      threads.swap(threads_);
    }
    for (std::thread& t : threads) t.join();
  }

  // Hands `task` to an idle thread (or a new one). Never waits. RESOURCE_EXHAUSTED naming the
  // work and the limit when `limit` tasks are running; UNAVAILABLE once the pool is stopping.
  absl::Status run(std::function<void()> task) {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError(absl::StrCat(what_, ": shutting down"));
    if (busy_ >= static_cast<int>(threads_.size())) {
      if (static_cast<int>(threads_.size()) >= limit_) {
        return absl::ResourceExhaustedError(
            absl::StrCat(what_, ": ", limit_, " are running already, the limit of this process; retry later"));
      }
      threads_.emplace_back([this] { loop(); });
    }
    ++busy_;
    tasks_.push_back(std::move(task));
    return absl::OkStatus();
  }

  // Tasks running or handed over (for tests and stats).
  int busy() const {
    absl::MutexLock lock(&mu_);
    return busy_;
  }
  int threads() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(threads_.size());
  }

 private:
  void loop() {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !tasks_.empty() || stopping_; };
    while (true) {
      mu_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // stopping, and nothing left
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      mu_.Unlock();
      task();
      task = nullptr;  // what it holds goes before the task counts as done
      mu_.Lock();
      --busy_;
    }
  }

  const std::string what_;
  const int limit_;
  mutable absl::Mutex mu_;
  std::vector<std::thread> threads_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  int busy_ ABSL_GUARDED_BY(mu_) = 0;  // tasks queued or running; never more than threads_
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace tessera

#endif  // TESSERA_CORE_THREAD_POOL_H_

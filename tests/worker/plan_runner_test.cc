// PlanRunner's sessions (worker/plan_runner.cc's RunSession, here through the in-process carrier
// Client::local's coordinator uses): what the thread that hands a request over does is decode
// and queue it, never compute it (issue #17, Deliver item 5). A small run, and a stepped
// all_reduce, compute on the process's run executor (worker/run_executor.h); the executor's
// queue per runner is bounded.
#include "worker/plan_runner.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/psum_plan.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// out = x * x on f32[4]: one kernel, no collective (runs_inline).
DevicePlan square_plan() {
  Instruction mul;
  mul.out = 1;
  mul.in = {0, 0};
  mul.node.op = Op::kMul;
  mul.node.dtype = DType::kF32;
  mul.node.shape = {4};
  mul.node.operands = {0, 0};
  DevicePlan plan;
  plan.num_slots = 2;
  plan.input_slots = {0};
  plan.output_slots = {1};
  plan.code = {mul};
  return plan;
}

pb::PlanStreamRequest run_request(uint64_t plan, uint64_t execution, uint64_t input, uint64_t output) {
  pb::PlanStreamRequest m;
  pb::RunPlanRequest* r = m.mutable_run();
  r->set_plan_id(plan);
  r->set_execution_id(execution);
  r->add_input_buffers(input);
  r->add_output_buffers(output);
  r->set_timeout_ms(30'000);
  r->set_run_tag(0x5eed'0000'0000'0001ULL);
  return m;
}

// The results of a session, with the thread each came back on (the thread that ended the run:
// for a small run, the one that computed it, since RunSession::end_run follows
// PlanRunner::run on the same thread).
struct Results {
  absl::Mutex mu;
  std::map<uint64_t, pb::RunPlanResult> by_id ABSL_GUARDED_BY(mu);
  std::map<uint64_t, std::thread::id> thread ABSL_GUARDED_BY(mu);

  std::function<void(const pb::RunPlanResult&)> callback() {
    return [this](const pb::RunPlanResult& r) {
      absl::MutexLock lock(&mu);
      by_id[r.id()] = r;
      thread[r.id()] = std::this_thread::get_id();
    };
  }
  // Waits (at most 30 s) for `n` results.
  bool wait_for(size_t n) {
    absl::MutexLock lock(&mu);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return by_id.size() >= n; };
    return mu.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(30));
  }
};

// One worker's state, in process.
struct Device {
  Device(int id, int max_queued_runs = PlanRunner::kMaxQueuedRuns)
      : store(1 << 20), plans(16), runner(&store, &plans, &transport, &device_of(id), 4, max_queued_runs) {}
  const WorkerDevice& device_of(int id) {
    device.set(id);
    transport.set_self(id);
    return device;
  }
  void put(uint64_t id, std::shared_ptr<const HostArray> a) {
    ASSERT_TRUE(store.reserve(id, a->nbytes()).ok());
    store.commit(id, std::move(a));
  }
  WorkerDevice device;
  Transport transport;
  BufferStore store;
  PlanStore plans;
  PlanRunner runner;  // last: goes first
};

// The request is handed over on this thread, as the coordinator's Execute thread (a gRPC
// callback thread) hands it over in process, or a RunPlans reactor reads it: the run computes
// on the run executor, and receive() returns before it ran. On main's code the small run ran
// inside receive(), on this thread.
TEST(PlanRunnerThreads, ASmallRunComputesOnTheRunExecutorNotOnTheThreadThatHandedItOver) {
  Device d(0);
  d.plans.add(7, std::make_shared<LoadedPlan>(square_plan(), std::map<int, std::string>{}));
  d.put(100, psum_block(1));
  Results results;
  std::shared_ptr<LocalRunSession> session = d.runner.local_runs()->open(results.callback(), [](const std::string&) {});
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->receive(run_request(7, 1, 100, 200)));
  ASSERT_TRUE(results.wait_for(1));
  {
    absl::MutexLock lock(&results.mu);
    EXPECT_EQ(results.by_id[1].code(), 0) << results.by_id[1].message();
    EXPECT_NE(results.thread[1], std::this_thread::get_id());
    EXPECT_EQ(results.thread[1], d.runner.run_thread_id());
  }
  // The host's x * x.
  absl::StatusOr<std::shared_ptr<const HostArray>> out = d.store.get(200);
  ASSERT_TRUE(out.ok()) << out.status();
  for (int i = 0; i < 4; ++i) EXPECT_EQ((*out)->values<float>()[i], static_cast<float>((1 + i) * (1 + i)));
  EXPECT_EQ(d.runner.counts().runs, 1);
  session->close();
}

// A session of a device whose result of run 1 holds the run executor (inside run 1's task,
// which counts as queued) until `release` is notified; `blocked` tells that it holds it.
struct HeldExecutor {
  absl::Notification blocked, release;
  std::shared_ptr<LocalRunSession> open(Device& d, Results& results) {
    return d.runner.local_runs()->open(
        [this, record = results.callback()](const pb::RunPlanResult& r) {
          record(r);
          if (r.id() == 1) {
            blocked.Notify();
            release.WaitForNotificationWithTimeout(absl::Seconds(30));
          }
        },
        [](const std::string&) {});
  }
};

// A runner queues at most max_queued_runs small runs on the executor (running ones included):
// the next is refused at once with RESOURCE_EXHAUSTED naming the limit, the runs queued still
// run, and the session goes on.
TEST(PlanRunnerThreads, TheRunExecutorsQueueIsBoundedPerRunnerAndRefusesNamingTheLimit) {
  Device d(0, /*max_queued_runs=*/2);
  d.plans.add(7, std::make_shared<LoadedPlan>(square_plan(), std::map<int, std::string>{}));
  d.put(100, psum_block(1));
  Results results;
  HeldExecutor held;
  std::shared_ptr<LocalRunSession> session = held.open(d, results);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->receive(run_request(7, 1, 100, 201)));
  ASSERT_TRUE(held.blocked.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(session->receive(run_request(7, 2, 100, 202)));  // queued: 2 of 2
  ASSERT_TRUE(session->receive(run_request(7, 3, 100, 203)));  // refused
  {
    absl::MutexLock lock(&results.mu);
    ASSERT_EQ(results.by_id.count(3), 1u) << "the refusal comes back at once";
    EXPECT_EQ(results.by_id[3].code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_THAT(results.by_id[3].message(), HasSubstr("2 small runs of this device are queued for its run thread"));
    EXPECT_EQ(results.by_id.count(2), 0u);
  }
  held.release.Notify();
  ASSERT_TRUE(results.wait_for(3));
  {
    absl::MutexLock lock(&results.mu);
    EXPECT_EQ(results.by_id[1].code(), 0) << results.by_id[1].message();
    EXPECT_EQ(results.by_id[2].code(), 0) << results.by_id[2].message();
  }
  EXPECT_TRUE(d.store.get(202).ok());
  EXPECT_FALSE(d.store.get(203).ok());
  // The queue emptied: the next run is taken.
  ASSERT_TRUE(session->receive(run_request(7, 4, 100, 204)));
  ASSERT_TRUE(results.wait_for(4));
  {
    absl::MutexLock lock(&results.mu);
    EXPECT_EQ(results.by_id[4].code(), 0) << results.by_id[4].message();
  }
  session->close();
}

// A small run queued behind a busy executor is cancelled and its output deleted (what the
// coordinator's fail_execution sends when it gives up on a call): it never starts, so it never
// stores the output that deletion found absent (a buffer nobody would delete again). Review of
// s43-exec: without a cancel flag for queued small runs the run stored 202 after its deletion.
TEST(PlanRunnerThreads, ASmallRunCancelledWhileQueuedNeverStoresItsDeletedOutput) {
  Device d(0);
  d.plans.add(7, std::make_shared<LoadedPlan>(square_plan(), std::map<int, std::string>{}));
  d.put(100, psum_block(1));
  Results results;
  HeldExecutor held;
  std::shared_ptr<LocalRunSession> session = held.open(d, results);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->receive(run_request(7, 1, 100, 201)));
  ASSERT_TRUE(held.blocked.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(session->receive(run_request(7, 2, 100, 202)));  // queued behind run 1
  pb::PlanStreamRequest cancel;
  cancel.set_cancel_execution(2);
  ASSERT_TRUE(session->receive(cancel));
  pb::PlanStreamRequest deletion;
  deletion.mutable_delete_buffers()->set_request_id(99);
  deletion.mutable_delete_buffers()->add_buffer_ids(202);
  ASSERT_TRUE(session->receive(deletion));
  held.release.Notify();
  ASSERT_TRUE(results.wait_for(3));  // runs 1 and 2, the deletion's acknowledgement
  {
    absl::MutexLock lock(&results.mu);
    EXPECT_EQ(results.by_id[1].code(), 0) << results.by_id[1].message();
    EXPECT_EQ(results.by_id[2].code(), static_cast<int>(absl::StatusCode::kCancelled)) << results.by_id[2].message();
  }
  EXPECT_TRUE(d.store.get(201).ok());
  EXPECT_FALSE(d.store.get(202).ok()) << "run 2 stored the output deleted while it was queued";
  session->close();
}

// A drain (wait_for_idle) counts a small run queued on the run executor as not idle: run 1
// has ended (its result is being handed back, holding the executor) while run 2 waits behind
// it, not started; the drain must not report 0 then, and does once run 2 has ended. Review of
// s43-exec: only started runs were counted, so a drain could end with a run still queued.
TEST(PlanRunnerThreads, ADrainWaitsForSmallRunsQueuedOnTheRunExecutor) {
  Device d(0);
  d.plans.add(7, std::make_shared<LoadedPlan>(square_plan(), std::map<int, std::string>{}));
  d.put(100, psum_block(1));
  Results results;
  HeldExecutor held;
  std::shared_ptr<LocalRunSession> session = held.open(d, results);
  ASSERT_NE(session, nullptr);
  ASSERT_TRUE(session->receive(run_request(7, 1, 100, 201)));
  ASSERT_TRUE(held.blocked.WaitForNotificationWithTimeout(absl::Seconds(30)));
  ASSERT_TRUE(session->receive(run_request(7, 2, 100, 202)));  // queued behind run 1
  EXPECT_GT(d.runner.wait_for_idle(absl::ZeroDuration(), absl::Now() + absl::Milliseconds(100)), 0);
  EXPECT_EQ(d.runner.idle_for(absl::InfinitePast()), absl::ZeroDuration());
  held.release.Notify();
  ASSERT_TRUE(results.wait_for(2));
  EXPECT_EQ(d.runner.wait_for_idle(absl::ZeroDuration(), absl::Now() + absl::Seconds(30)), 0);
  EXPECT_TRUE(d.store.get(202).ok());
  session->close();
}

// Eight embedded workers, each handed its run of out = psum(x * x) + x from this thread, as the
// coordinator hands a call's runs over in process: every run starts stepped (none on a plan
// thread), none computes on this thread, and every device gets the host's sum.
TEST(PlanRunnerThreads, ASteppedAllReduceComputesOffTheHandingThreadAndMatchesTheHostSum) {
  constexpr int n = 8;
  std::vector<int> group;
  std::map<int, std::string> peers;
  for (int d = 0; d < n; ++d) {
    group.push_back(d);
    peers[d] = absl::StrCat("in-process:", 61300 + d);
  }
  std::vector<std::unique_ptr<Device>> devices;
  for (int d = 0; d < n; ++d) {
    devices.push_back(std::make_unique<Device>(d));
    ASSERT_TRUE(devices[d]->transport.serve_in_process(peers[d]).ok());
    devices[d]->plans.add(9, std::make_shared<LoadedPlan>(psum_plan(group), peers));
    devices[d]->put(100, psum_block(static_cast<float>(d)));
  }
  std::vector<Results> results(n);
  std::vector<std::shared_ptr<LocalRunSession>> sessions;
  for (int d = 0; d < n; ++d) {
    sessions.push_back(devices[d]->runner.local_runs()->open(results[d].callback(), [](const std::string&) {}));
    ASSERT_NE(sessions[d], nullptr);
  }
  for (int d = 0; d < n; ++d) ASSERT_TRUE(sessions[d]->receive(run_request(9, 1000, 100, 200)));
  for (int d = 0; d < n; ++d) {
    ASSERT_TRUE(results[d].wait_for(1)) << "device " << d;
    absl::MutexLock lock(&results[d].mu);
    EXPECT_EQ(results[d].by_id[1000].code(), 0) << "device " << d << ": " << results[d].by_id[1000].message();
    EXPECT_NE(results[d].thread[1000], std::this_thread::get_id()) << "device " << d;
    EXPECT_EQ(devices[d]->runner.counts().stepped, 1) << "device " << d;
  }
  // The host's sum: sum over s, i of (s + i)^2 per element i, plus the device's own block.
  for (int d = 0; d < n; ++d) {
    absl::StatusOr<std::shared_ptr<const HostArray>> out = devices[d]->store.get(200);
    ASSERT_TRUE(out.ok()) << "device " << d << ": " << out.status();
    for (int i = 0; i < 4; ++i) {
      float want = 0;
      for (int s = 0; s < n; ++s) want += static_cast<float>((s + i) * (s + i));
      EXPECT_EQ((*out)->values<float>()[i], want + static_cast<float>(d + i)) << "device " << d << " element " << i;
    }
  }
  for (auto& s : sessions) s->close();
}

}  // namespace
}  // namespace tessera

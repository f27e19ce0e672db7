// Stepped runs (worker/interpreter.h's SteppedPlanRun over Transport::park): a run of a plan
// with an all_reduce in process leaves off at a receive whose message has not arrived and is
// continued by the thread that files that message; one nobody answers is handed back to wait
// on a thread, where it fails as a waiting run does.
#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/support/psum_plan.h"
#include "worker/collectives/transport.h"
#include "worker/interpreter.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Records how a parked run was resumed: on the test's thread by a message (queued, to be
// advanced after the run at hand, as the worker's driver does), or handed back.
struct Resumes {
  std::thread::id test_thread = std::this_thread::get_id();
  std::deque<int> queue;  // devices to advance again, touched only on the test's thread
  std::atomic<int> handed_back{0};
  std::atomic<int> elsewhere{0};
  absl::Notification first_handed_back;
};

class QueuedResume final : public Transport::Parked {
 public:
  QueuedResume(Resumes* resumes, int device) : resumes_(resumes), device_(device) {}
  void resume(bool arrived) override {
    if (!arrived) {
      if (resumes_->handed_back++ == 0) resumes_->first_handed_back.Notify();
    } else if (std::this_thread::get_id() != resumes_->test_thread) {
      ++resumes_->elsewhere;
    } else {
      resumes_->queue.push_back(device_);
    }
  }

 private:
  Resumes* const resumes_;
  const int device_;
};

struct Cluster {
  explicit Cluster(int n, int base_port) {
    for (int d = 0; d < n; ++d) {
      transports.push_back(std::make_unique<Transport>());
      transports[d]->set_self(d);
      peers[d] = absl::StrCat("in-process:", base_port + d);
      EXPECT_TRUE(transports[d]->serve_in_process(peers[d]).ok());
    }
  }
  PlanRun run(int d, absl::Duration timeout) const {
    PlanRun r;
    r.execution = 1000;
    r.peers = peers;
    r.self = d;
    r.deadline = absl::Now() + timeout;
    return r;
  }
  ParkFn park(int d, Resumes* resumes) {
    return [this, d, resumes](int source, MessageTag tag, absl::Time op_start) {
      return transports[d]->park(source, tag, op_start, std::make_shared<QueuedResume>(resumes, d));
    };
  }
  std::vector<std::unique_ptr<Transport>> transports;
  std::map<int, std::string> peers;
};

// Eight runs started one after the other on one thread, as the coordinator's thread starts a
// call's runs in process: each goes as far as its messages allow and parks; the thread whose
// send files a parked run's message continues it. All of the all_reduce's rounds run so, on
// this thread alone, and every device gets the host's sum.
TEST(SteppedRun, EightRunsOfAPsumStepOnOneThreadAndMatchTheHostSum) {
  constexpr int n = 8;
  Cluster cluster(n, 61100);
  std::vector<int> group;
  for (int d = 0; d < n; ++d) group.push_back(d);
  const DevicePlan plan = psum_plan(group);
  std::vector<PlanRun> runs;
  std::vector<std::unique_ptr<SteppedPlanRun>> stepped;
  for (int d = 0; d < n; ++d) runs.push_back(cluster.run(d, absl::Seconds(30)));
  for (int d = 0; d < n; ++d) {
    stepped.push_back(std::make_unique<SteppedPlanRun>(plan,
                                                       std::vector<std::shared_ptr<const HostArray>>{psum_block(d)},
                                                       *cluster.transports[d], runs[d], plan_op_id(1000, 0)));
  }
  Resumes resumes;
  std::vector<bool> done(n, false);
  std::vector<absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>>> results(n);
  auto advance = [&](int d) {
    const SteppedPlanRun::State state = stepped[d]->advance(cluster.park(d, &resumes));
    ASSERT_NE(state, SteppedPlanRun::State::kNeedsThread) << "device " << d;
    if (state == SteppedPlanRun::State::kDone) {
      done[d] = true;
      results[d] = stepped[d]->take_result();
    }
  };
  int advances = 0;
  for (int d = 0; d < n; ++d) {
    advance(d);
    ++advances;
    while (!resumes.queue.empty()) {  // after the run at hand, those it resumed
      const int next = resumes.queue.front();
      resumes.queue.pop_front();
      advance(next);
      ++advances;
    }
  }
  EXPECT_EQ(resumes.handed_back.load(), 0);
  EXPECT_EQ(resumes.elsewhere.load(), 0);
  int64_t resumed = 0;
  for (auto& t : cluster.transports) resumed += t->parked_resumed();
  EXPECT_EQ(advances, n + resumed);
  // The tree parks at least every receive whose sender starts later: rank 0 waits for rank 1.
  EXPECT_GE(resumed, n - 1);
  // The host's sum: sum over d, i of (d + i)^2 per element i, plus the device's own block.
  for (int d = 0; d < n; ++d) {
    ASSERT_TRUE(done[d]) << "device " << d << " never finished";
    ASSERT_TRUE(results[d].ok()) << results[d].status();
    const auto values = (*results[d])[0]->values<float>();
    for (int i = 0; i < 4; ++i) {
      float want = 0;
      for (int s = 0; s < n; ++s) want += static_cast<float>((s + i) * (s + i));
      EXPECT_EQ(values[i], want + static_cast<float>(d + i)) << "device " << d << " element " << i;
    }
  }
  for (auto& t : cluster.transports) EXPECT_EQ(t->pending_messages(), 0);
}

// A run parked for a message its peer never sends is handed back within 2 * kParkLimit, and
// advanced then where it may wait fails at its deadline naming the peer, as a waiting run does.
TEST(SteppedRun, AParkedRunNobodyAnswersIsHandedBackAndFailsAtItsDeadlineNamingThePeer) {
  Cluster cluster(2, 61120);
  const DevicePlan plan = psum_plan({0, 1});
  const PlanRun run = cluster.run(0, absl::Milliseconds(400));
  SteppedPlanRun stepped(plan, {psum_block(0)}, *cluster.transports[0], run, plan_op_id(1000, 0));
  Resumes resumes;
  const absl::Time parked_at = absl::Now();
  ASSERT_EQ(stepped.advance(cluster.park(0, &resumes)), SteppedPlanRun::State::kParked);
  ASSERT_TRUE(resumes.first_handed_back.WaitForNotificationWithTimeout(absl::Seconds(10)));
  const absl::Duration parked_for = absl::Now() - parked_at;
  EXPECT_GE(parked_for, Transport::kParkLimit);
  EXPECT_LT(parked_for, absl::Seconds(5));
  EXPECT_EQ(resumes.handed_back.load(), 1);
  ASSERT_EQ(stepped.advance(nullptr), SteppedPlanRun::State::kDone);
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> result = stepped.take_result();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kDeadlineExceeded) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("instruction 1 (all_reduce)"));
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("device 1 (in-process:61121) sent nothing"));
  // The failed run purged its op range (issue #17, "failed runs purge their op range"): a
  // peer's message for an op after the failed instruction, which the run never reached
  // (plan_op_id(1000, 2)), is dropped at once rather than held for the mailbox's time-to-live.
  const int64_t dropped = cluster.transports[0]->dropped_messages();
  const std::string late = "late";
  ASSERT_TRUE(cluster.transports[1]
                  ->send(0, cluster.peers[0], {plan_op_id(1000, 2), 0, 0},
                         reinterpret_cast<const std::byte*>(late.data()), 4, absl::Now() + absl::Seconds(10))
                  .ok());
  EXPECT_EQ(cluster.transports[0]->pending_messages(), 0);
  EXPECT_EQ(cluster.transports[0]->dropped_messages(), dropped + 1);
}

// A peer of this process that stops while a run is parked for its message: the run is handed
// back at once and fails UNAVAILABLE naming the peer (not at its deadline).
TEST(SteppedRun, APeerThatStopsHandsTheParkedRunBackAndFailsItNamingThePeer) {
  Cluster cluster(2, 61130);
  // Device 1 sent to device 0 before (as a member does in an earlier op).
  const std::string byte = "x";
  ASSERT_TRUE(cluster.transports[1]
                  ->send(0, cluster.peers[0], {7, 0, 0}, reinterpret_cast<const std::byte*>(byte.data()), 1,
                         absl::Now() + absl::Seconds(10))
                  .ok());
  cluster.transports[0]->finish_op(7);
  const DevicePlan plan = psum_plan({0, 1});
  const PlanRun run = cluster.run(0, absl::Seconds(60));
  SteppedPlanRun stepped(plan, {psum_block(0)}, *cluster.transports[0], run, plan_op_id(1000, 0));
  Resumes resumes;
  ASSERT_EQ(stepped.advance(cluster.park(0, &resumes)), SteppedPlanRun::State::kParked);
  const absl::Time stopped_at = absl::Now();
  cluster.transports[1]->close_in_process();
  ASSERT_TRUE(resumes.first_handed_back.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_EQ(stepped.advance(nullptr), SteppedPlanRun::State::kDone);
  EXPECT_LT(absl::Now() - stopped_at, absl::Seconds(5)) << "it waited for its deadline";
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> result = stepped.take_result();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable) << result.status();
  EXPECT_THAT(std::string(result.status().message()), HasSubstr("device 1 (in-process:61131) went away"));
}

}  // namespace
}  // namespace tessera

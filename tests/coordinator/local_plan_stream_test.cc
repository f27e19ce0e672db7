// LocalPlanStream (coordinator/plan_stream.h), the in-process carrier of a coordinator's runs,
// against a worker side written here (proto/local_runs.h): a run answered inside its hand-off,
// as a small run is, whose completion hands the next run over (a chain of dependent calls)
// nests no hand-off in another however long the chain; a worker that stops with runs pending
// fails them, and later ones, with UNAVAILABLE saying why, as a broken RunPlans stream does.
#include <atomic>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "coordinator/plan_stream.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/local_runs.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A worker side: answers each run at once, inside receive() (as a small run is), unless told
// to keep it; counts how deeply receive() nests on the thread.
class FakeRuns final : public LocalRuns {
 public:
  struct Session final : LocalRunSession {
    FakeRuns* runs;
    bool receive(pb::PlanStreamRequest message) override {
      if (runs->stopped) return false;
      if (runs->throw_once) {
        runs->throw_once = false;
        throw std::runtime_error("the worker's handler threw");
      }
      ++runs->depth;
      runs->max_depth = std::max(runs->max_depth, runs->depth);
      ++runs->received;
      if (message.has_run() && runs->answer) {
        pb::RunPlanResult result;
        result.set_id(message.run().execution_id());
        runs->on_result(result);
      }
      --runs->depth;
      return true;
    }
    void close() override { runs->closed = true; }
  };

  std::shared_ptr<LocalRunSession> open(std::function<void(const pb::RunPlanResult&)> result,
                                        std::function<void(const std::string&)> end) override {
    on_result = std::move(result);
    on_end = std::move(end);
    auto session = std::make_shared<Session>();
    session->runs = this;
    // The worker stops after registering the session, before open() returns it: what
    // PlanRunner::stop_local_runs may do between LocalGate::open_session and the caller.
    if (stop_in_open) on_end("its worker stopped");
    return session;
  }

  std::function<void(const pb::RunPlanResult&)> on_result;
  std::function<void(const std::string&)> on_end;
  bool answer = true;
  bool stopped = false;
  bool stop_in_open = false;
  bool throw_once = false;
  bool closed = false;
  int depth = 0;
  int max_depth = 0;
  int received = 0;
};

pb::RunPlanRequest run_of(uint64_t execution) {
  pb::RunPlanRequest req;
  req.set_execution_id(execution);
  return req;
}

// Each run's completion sends the next, as the coordinator forwards a call that awaited the
// one before it (coordinator/execution_driver.cc's awaited calls) from the completion.
TEST(LocalPlanStream, AChainOfRunsAnsweredInsideTheirHandOffNestsNoHandOffInAnother) {
  FakeRuns runs;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  constexpr int kChain = 2000;
  std::vector<int> order;
  std::function<void(int)> send = [&](int k) {
    stream->run(run_of(static_cast<uint64_t>(k)), [&, k](grpc::Status status) {
      EXPECT_TRUE(status.ok()) << status.error_message();
      order.push_back(k);
      if (k + 1 < kChain) send(k + 1);
    });
  };
  send(0);
  ASSERT_EQ(order.size(), static_cast<size_t>(kChain));
  for (int k = 0; k < kChain; ++k) ASSERT_EQ(order[static_cast<size_t>(k)], k);
  EXPECT_EQ(runs.received, kChain);
  // One hand-off at a time: each next run is handed over after the one before returned.
  EXPECT_EQ(runs.max_depth, 1);
  EXPECT_TRUE(stream->close(absl::Seconds(10)));
}

TEST(LocalPlanStream, AWorkerThatStopsFailsTheRunsPendingAndLaterOnesUnavailable) {
  FakeRuns runs;
  runs.answer = false;  // runs on threads of their own, still going
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  std::vector<grpc::Status> results;
  for (uint64_t e : {1, 2}) stream->run(run_of(e), [&](grpc::Status s) { results.push_back(s); });
  EXPECT_TRUE(results.empty());
  EXPECT_FALSE(stream->broken());

  runs.on_end("its worker stopped");  // what PlanRunner::stop_local_runs does to open sessions
  ASSERT_EQ(results.size(), 2u);
  for (const grpc::Status& s : results) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
    EXPECT_THAT(s.error_message(), HasSubstr("its worker stopped"));
  }
  EXPECT_TRUE(stream->broken());
  EXPECT_TRUE(runs.closed);

  // A run sent after fails at once, saying why (not handed over).
  const int received = runs.received;
  grpc::Status late;
  stream->run(run_of(3), [&](grpc::Status s) { late = s; });
  EXPECT_EQ(late.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(late.error_message(), HasSubstr("its worker stopped"));
  EXPECT_EQ(runs.received, received);
}

// Each stream counts in the counter it was opened with (its coordinator's: WorkerChannels), so
// two coordinators in one process count apart; a request the worker's side refuses counts (it
// was tried), one on a stream already ended does not (it was not handed over).
TEST(LocalPlanStream, EachRequestHandedOverCountsInItsOwnersCounterOnly) {
  FakeRuns first_runs, second_runs;
  second_runs.answer = false;  // its run stays pending, for the cancel below
  auto first_count = std::make_shared<std::atomic<int64_t>>(0);
  auto second_count = std::make_shared<std::atomic<int64_t>>(0);
  std::shared_ptr<LocalPlanStream> first = LocalPlanStream::open(first_runs, 1, first_count);
  std::shared_ptr<LocalPlanStream> second = LocalPlanStream::open(second_runs, 1, second_count);
  std::vector<grpc::Status> results;
  auto keep = [&](grpc::Status s) { results.push_back(std::move(s)); };
  for (uint64_t e : {1, 2}) first->run(run_of(e), keep);
  second->run(run_of(7), keep);
  pb::StreamDelete deletion;
  deletion.set_request_id(8);
  second->delete_buffers(deletion, keep);
  second->cancel(7, grpc::Status(grpc::StatusCode::CANCELLED, "cancelled"));
  EXPECT_EQ(first_count->load(), 2);
  EXPECT_EQ(second_count->load(), 3);  // the run, the deletion, the cancel
  EXPECT_EQ(first_runs.received, 2);
  EXPECT_EQ(second_runs.received, 3);

  second_runs.stopped = true;  // refuses the next hand-off, which ends the stream
  second->run(run_of(9), keep);
  EXPECT_EQ(second_count->load(), 4);  // tried: the refusal comes from the worker's side
  second->run(run_of(10), keep);       // the stream has ended: not handed over
  EXPECT_EQ(second_count->load(), 4);
  EXPECT_EQ(first_count->load(), 2);
  EXPECT_TRUE(first->close(absl::Seconds(10)));
  EXPECT_TRUE(second->close(absl::Seconds(10)));
}

TEST(LocalPlanStream, ARunOnAClosedStreamFailsSayingTheCoordinatorClosedIt) {
  FakeRuns runs;
  runs.answer = false;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  grpc::Status pending;
  stream->run(run_of(1), [&](grpc::Status s) { pending = s; });
  EXPECT_TRUE(stream->close(absl::Seconds(10)));
  EXPECT_EQ(pending.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(pending.error_message(), HasSubstr("closed by the coordinator"));
  grpc::Status late;
  stream->run(run_of(2), [&](grpc::Status s) { late = s; });
  EXPECT_EQ(late.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(late.error_message(), HasSubstr("closed by the coordinator"));
}

TEST(LocalPlanStream, ACancelCompletesTheRunTellsTheWorkerAndDropsTheLateResult) {
  FakeRuns runs;
  runs.answer = false;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  std::vector<grpc::Status> results;
  stream->run(run_of(7), [&](grpc::Status s) { results.push_back(s); });
  stream->cancel(7, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "call deadline"));
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(runs.received, 2);  // the run, then its cancel
  pb::RunPlanResult late;
  late.set_id(7);
  runs.on_result(late);  // the run's result after the cancel: dropped
  EXPECT_EQ(results.size(), 1u);
}

// A stop that races open() (its on_end runs before open() has the session) leaves the stream
// ended, its session closed: a run fails at once rather than go to a worker that stopped.
TEST(LocalPlanStream, AWorkerThatStopsWhileTheStreamOpensLeavesItEnded) {
  FakeRuns runs;
  runs.stop_in_open = true;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  EXPECT_TRUE(stream->broken());
  EXPECT_TRUE(runs.closed);
  grpc::Status status;
  stream->run(run_of(1), [&](grpc::Status s) { status = s; });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("its worker stopped"));
  EXPECT_EQ(runs.received, 0);
}

// The first end says why: a worker's stop after the coordinator closed the stream does not
// change what later requests fail with.
TEST(LocalPlanStream, AWorkerStopAfterCloseKeepsTheCoordinatorsReason) {
  FakeRuns runs;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  EXPECT_TRUE(stream->close(absl::Seconds(10)));
  runs.on_end("its worker stopped");
  grpc::Status late;
  stream->run(run_of(1), [&](grpc::Status s) { late = s; });
  EXPECT_EQ(late.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(late.error_message(), HasSubstr("closed by the coordinator"));
  EXPECT_THAT(late.error_message(), Not(HasSubstr("its worker stopped")));
}

// A session that refuses a hand-off (its worker stopped, receive() returns false) ends the
// stream: the run fails with UNAVAILABLE at once, and so do later ones.
TEST(LocalPlanStream, ARefusedHandOffFailsTheRunAndEndsTheStream) {
  FakeRuns runs;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  runs.stopped = true;
  grpc::Status status;
  stream->run(run_of(1), [&](grpc::Status s) { status = s; });
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(status.error_message(), HasSubstr("its worker stopped"));
  EXPECT_TRUE(stream->broken());
  EXPECT_TRUE(runs.closed);
}

// A hand-off left by an exception leaves the thread as it was: the next run's result, answered
// inside its hand-off, is completed (not queued for a hand-off that is gone).
TEST(LocalPlanStream, AHandOffLeftByAnExceptionLeavesLaterOnesCompleted) {
  FakeRuns runs;
  std::shared_ptr<LocalPlanStream> stream = LocalPlanStream::open(runs, 1);
  runs.throw_once = true;
  EXPECT_THROW(stream->run(run_of(1), [](grpc::Status) {}), std::runtime_error);
  int completed = 0;
  for (uint64_t e : {2, 3}) {
    stream->run(run_of(e), [&](grpc::Status s) {
      EXPECT_TRUE(s.ok()) << s.error_message();
      ++completed;
    });
  }
  EXPECT_EQ(completed, 2);
  EXPECT_EQ(runs.max_depth, 1);
}

}  // namespace
}  // namespace tessera

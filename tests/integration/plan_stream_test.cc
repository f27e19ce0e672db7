// The coordinator's RunPlans streams under failure, on real processes (issue #4: no hangs).
// A worker that stops answering (SIGSTOP: its connections stay open, nothing breaks) fails the
// calls that wait for it once it is marked lost, while other calls on the same streams keep
// running; once it resumes it registers anew and serves again: its stream reconnects to the
// new incarnation, and the result of the run given up on arrives late and is ignored. A
// worker killed while runs are pending on its stream fails all of them, naming it.
// Ordering is asserted through readiness, never through timing; every wait has a deadline;
// teardown resumes and kills only this test's processes, by pid.
#include <signal.h>

#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/process_cluster_fixture.h"

namespace tessera {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

class PlanStreamTest : public ProcessClusterTest {
 protected:
  void TearDown() override {
    if (stopped_ > 0) ::kill(stopped_, SIGCONT);
    ProcessClusterTest::TearDown();
  }

  // SIGSTOP, then waits (at most 5 s) until every thread of the worker is stopped: kill()
  // returns before a thread busy in the kernel (a page fault, in D state) has stopped, and a
  // call sent in that window could still be served (seen once in a fresh-Debian run).
  void stop(int device) {
    stopped_ = workers_[static_cast<size_t>(device)]->pid();
    ASSERT_TRUE(sigstop_and_wait(stopped_).ok()) << "worker " << device << " did not stop";
  }
  void resume() {
    ASSERT_EQ(::kill(stopped_, SIGCONT), 0);
    stopped_ = -1;
  }

  // Waits (bounded) until all 8 devices are alive again.
  void wait_for_all_alive() {
    ConnectOptions options;
    options.min_devices = 8;
    options.timeout = absl::Seconds(20);
    absl::StatusOr<Client> again = Client::connect(address_, options);
    ASSERT_TRUE(again.ok()) << again.status();
  }

  pid_t stopped_ = -1;
};

// Column sums of arange(16, 8) as float32: 960 + 16 j.
void expect_column_sums(const Array& a) {
  absl::StatusOr<HostArray> got = a.fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->shape(), (Shape{8}));
  for (int64_t j = 0; j < 8; ++j) EXPECT_EQ(got->values<float>()[j], 960.0f + 16.0f * static_cast<float>(j));
}

TEST_F(PlanStreamTest, AStoppedWorkerFailsItsCallsWithoutBlockingOthersAndServesAgain) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Mesh> low = client_->make_mesh({2, 2}, {"a", "b"}, {0, 1, 2, 3});
  ASSERT_TRUE(low.ok()) << low.status();
  const HostArray values = HostArray::arange(DType::kF32, {16, 8});
  absl::StatusOr<Array> x = client_->device_put(values, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<Array> xl = client_->device_put(values, NamedSharding(*low, P("a", "b")));
  ASSERT_TRUE(xl.ok()) << xl.status();
  // A sum over the split dimension: every device's plan waits for its peers (an all-reduce).
  Jitted total = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; });
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  {
    absl::StatusOr<std::vector<Array>> warm = total({*x});
    ASSERT_TRUE(warm.ok()) << warm.status();
    expect_column_sums((*warm)[0]);
    ASSERT_TRUE(twice({*xl}).ok());  // plans loaded, streams open
  }

  stop(7);
  absl::StatusOr<std::vector<Array>> waiting = total({*x});
  ASSERT_TRUE(waiting.ok()) << waiting.status();
  // Devices 0-6 run that plan on threads of their own, waiting for device 7's data; their
  // streams still deliver other runs, and a call on devices 0-3 completes meanwhile.
  absl::StatusOr<std::vector<Array>> doubled = twice({*xl});
  ASSERT_TRUE(doubled.ok()) << doubled.status();
  absl::StatusOr<HostArray> got = (*doubled)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  for (int64_t i = 0; i < 128; ++i) ASSERT_EQ(got->values<float>()[i], 2.0f * static_cast<float>(i));

  // The stopped worker is marked lost (heartbeat timeout 1.5 s): the call fails naming it.
  absl::Status failed = (*waiting)[0].block_until_ready();
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_THAT(std::string(failed.message()), HasSubstr("device 7"));

  // Back: the same process registers anew (keeping its buffers), the plans are loaded again
  // and its stream reconnects to the new incarnation.
  resume();
  wait_for_all_alive();
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::vector<Array>> again = total({*x});
    ASSERT_TRUE(again.ok()) << again.status();
    expect_column_sums((*again)[0]);
  }
}

TEST_F(PlanStreamTest, AWorkerKilledWithRunsPendingFailsEveryOneOfThem) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray values = HostArray::arange(DType::kF32, {16, 8});
  absl::StatusOr<Array> x = client_->device_put(values, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(x.ok()) << x.status();
  Jitted total = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; });
  {
    absl::StatusOr<std::vector<Array>> warm = total({*x});
    ASSERT_TRUE(warm.ok()) << warm.status();
    expect_column_sums((*warm)[0]);
  }
  // Several calls pending on device 7's stream (it is stopped, so none can finish), then it dies.
  stop(7);
  std::vector<Array> pending;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::vector<Array>> y = total({*x});
    ASSERT_TRUE(y.ok()) << y.status();
    pending.push_back((*y)[0]);
  }
  workers_[7]->kill();  // SIGKILL ends a stopped process too
  stopped_ = -1;
  for (const Array& y : pending) {
    absl::Status status = y.block_until_ready();
    EXPECT_THAT(status.code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded)) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr("device 7"));
  }
}

}  // namespace
}  // namespace tessera

// A worker stopped (SIGSTOP) and continued (SIGCONT), with real processes (issue #17 item 3).
// Held stopped past the keepalive window, the peers' connections to it time out, and it wakes
// with stale keepalive state of its own, so connections break again just after it continues:
// messages accepted for a peer whose stream then failed used to be dropped silently, and the
// first collective call after SIGCONT hung for its whole timeout with an error naming the
// neighbours. Now a broken stream fails its ops at both ends at once, naming the peer: every
// call either succeeds with the right values or fails within bounded time naming the stopped
// device, and the next call succeeds. Results are checked against host computations; every
// wait has a deadline; teardown resumes and kills only this test's processes, by pid.
#include <signal.h>

#include <cstdio>
#include <optional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// How long the worker stays stopped: longer than a keepalive ping's interval plus its timeout
// (5 s + 5 s, proto/rpc.cc), so that its peers' connections to it time out meanwhile. This is
// the length of the fault, not a wait for anything.
constexpr absl::Duration kStopped = absl::Seconds(12);
constexpr int kStoppedDevice = 2;
// A call's devices may wait this long for each other: a call that hung would take all of it.
constexpr absl::Duration kCallTimeout = absl::Seconds(30);
// What "bounded" means below: well under kCallTimeout, well over a heartbeat timeout (1.5 s).
constexpr absl::Duration kBound = absl::Seconds(10);

class StoppedWorkerTest : public FaultClusterTest {
 protected:
  void TearDown() override {
    if (stopped_ > 0) ::kill(stopped_, SIGCONT);
  }

  void stop() {
    stopped_ = cluster_.workers[kStoppedDevice]->pid();
    ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  }
  void resume() {
    ASSERT_EQ(::kill(stopped_, SIGCONT), 0);
    stopped_ = -1;
  }

  // A client, an array of kFaultWorkers rows of `columns` split over a mesh {"x"}, and a jitted
  // sum over its rows (an all-reduce across every device).
  void set_up_sum(int64_t columns) {
    absl::StatusOr<Client> client = connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    absl::StatusOr<Mesh> mesh = client_->make_mesh({kFaultWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const HostArray host = HostArray::arange(DType::kF32, {kFaultWorkers, columns});
    want_ = column_sums(host);
    absl::StatusOr<Array> x = client_->device_put(host, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(x.ok()) << x.status();
    x_ = *std::move(x);
    JitOptions options;
    options.timeout = kCallTimeout;
    total_ = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; }, options);
  }
  // The sum's result, not waited for.
  Array start_sum() { return (*(*total_)({*x_}))[0]; }
  // The sum, waited for: checked against the host's when it succeeds.
  absl::Status call() {
    absl::StatusOr<std::vector<Array>> t = (*total_)({*x_});
    if (!t.ok()) return t.status();
    absl::StatusOr<HostArray> got = (*t)[0].fetch();
    if (!got.ok()) return got.status();
    EXPECT_TRUE(*got == want_);
    return absl::OkStatus();
  }

  pid_t stopped_ = -1;
  std::optional<Client> client_;
  std::optional<Array> x_;
  HostArray want_;
  std::optional<Jitted> total_;
};

// A call that did not succeed failed UNAVAILABLE naming the stopped device.
void expect_named_failure(const absl::Status& status) {
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("device ", kStoppedDevice))) << status;
}

TEST_F(StoppedWorkerTest, EveryCallSucceedsOrFailsBoundedNamingTheDeviceAndTheNextOneSucceeds) {
  // 256 KiB per device: the all-reduce is a pipelined ring, many messages per call.
  set_up_sum(1 << 16);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(call().ok());  // the Exchange streams are open

  // Stopped while calls are running, then while the cluster is idle.
  for (const bool busy : {true, false}) {
    SCOPED_TRACE(busy ? "stopped during calls" : "stopped while idle");
    std::vector<Array> running;
    if (busy) {
      for (int i = 0; i < 3; ++i) running.push_back(start_sum());
    }
    stop();
    const absl::Time stopped = absl::Now();
    for (const Array& r : running) {
      absl::StatusOr<HostArray> got = r.fetch();
      if (got.ok()) {
        EXPECT_TRUE(*got == want_);  // finished before the stop
      } else {
        expect_named_failure(got.status());  // marked lost after the heartbeat timeout
        EXPECT_LT(absl::Now() - stopped, kBound);
        std::printf("[ timing ] SIGSTOP -> a running call failed %s: %s\n",
                    absl::FormatDuration(absl::Now() - stopped).c_str(),
                    std::string(got.status().message()).substr(0, 160).c_str());
      }
    }
    absl::SleepFor(kStopped - (absl::Now() - stopped));  // the fault's length (see kStopped)
    resume();
    const absl::Time continued = absl::Now();
    ASSERT_TRUE(connect().ok());  // it registered again

    const absl::Time first_start = absl::Now();
    const absl::Status first = call();
    const absl::Duration first_took = absl::Now() - first_start;
    if (!first.ok()) {
      expect_named_failure(first);
      EXPECT_LT(first_took, kBound) << first;
    }
    const absl::Status next = call();
    EXPECT_TRUE(next.ok()) << next;
    std::printf("[ timing ] %s: SIGCONT -> registered %s; first call %s in %s (%s); next call %s\n",
                busy ? "busy" : "idle", absl::FormatDuration(first_start - continued).c_str(),
                first.ok() ? "succeeded" : "failed", absl::FormatDuration(first_took).c_str(),
                first.ok() ? "-" : std::string(first.message()).substr(0, 300).c_str(),
                next.ok() ? "succeeded" : "failed");
  }
}

// The same cluster at the coordinator's default heartbeat flags (interval 500 ms, timeout 3 s):
// a call that needs a device stopped before it was made fails naming that device once the
// coordinator marks it lost, in well under kBound (issue #17's goal is 5 s; the test prints
// the time, it does not assert it), and once the device continues and registered again a
// call succeeds.
class StoppedWorkerAtDefaultHeartbeatTest : public StoppedWorkerTest {
 protected:
  std::vector<std::string> drill_flags() const override { return {}; }
};

TEST_F(StoppedWorkerAtDefaultHeartbeatTest, ACallNeedingTheStoppedDeviceFailsNamingItThenOneSucceeds) {
  set_up_sum(1 << 10);
  ASSERT_TRUE(call().ok());

  stop();
  const absl::Time stopped = absl::Now();
  const absl::Status during = call();
  const absl::Duration failed_after = absl::Now() - stopped;
  expect_named_failure(during);
  EXPECT_LT(failed_after, kBound) << during;
  std::printf("[ timing ] default heartbeat: SIGSTOP -> a call needing the device failed %s: %s\n",
              absl::FormatDuration(failed_after).c_str(), std::string(during.message()).substr(0, 160).c_str());

  resume();
  ASSERT_TRUE(connect().ok());  // it registered again
  absl::Status after = call();
  if (!after.ok()) {
    expect_named_failure(after);  // a stream broken by the stop, found by this call
    after = call();
  }
  EXPECT_TRUE(after.ok()) << after;
}

}  // namespace
}  // namespace tessera

// A member killed (kill -9) in the middle of a collective over TCP (gRPC Exchange streams, no
// shared memory), with credentials: the call fails in bounded time naming the device, through
// the transport (the coordinator's heartbeat timeout is 60 s, far beyond the bound), the
// survivors' next collective is right (against host sums), and the daemons serve a new
// client afterwards. Every wait has a deadline; teardown kills only this test's processes, by
// pid. (tests/integration/multiprocess_test.cc has the kill without credentials;
// shm_peer_killed_test.cc the one on shared memory.)
#include <signal.h>

#include <cstdio>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kVictim = 2;
// What "bounded" means: well under the call's timeout (30 s) and the heartbeat timeout (60 s).
constexpr absl::Duration kBound = absl::Seconds(5);

class TcpPeerKilledTest : public PeerKilledDrill {
 protected:
  std::vector<std::string> drill_worker_flags() const override { return {"--shm=false"}; }
};

// A jitted call's outcome: calls are asynchronous, so its error (or its values) comes with the fetch.
absl::Status outcome(const absl::StatusOr<std::vector<Array>>& call) {
  if (!call.ok()) return call.status();
  return (*call)[0].fetch().status();
}

// 4 x 2^18 float32 per device whose column sums are exact in float32 (small integers), so the
// all-reduce's order of additions does not matter.
HostArray small_integers(int64_t rows, int64_t cols) {
  HostArray out(DType::kF32, {rows, cols});
  for (int64_t i = 0; i < rows * cols; ++i) out.mutable_values<float>()[i] = static_cast<float>(i % 7);
  return out;
}

int64_t runs_in_flight(const Client& client, int device) {
  absl::StatusOr<DeviceStats> stats = client.device_stats(device);
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->plan_runs_in_flight : -1;
}

TEST_F(TcpPeerKilledTest, AMemberKilledMidCollectiveFailsTheCallBoundedNamingTheDevice) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  // 4 MiB per device: the all-reduce of the column sums moves several chunks per peer.
  const HostArray host = small_integers(kFaultWorkers * 4, 1 << 18);
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  JitOptions options;
  options.timeout = absl::Seconds(30);
  Jitted column_sum = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; }, options);
  {
    absl::StatusOr<std::vector<Array>> warm = column_sum({*x});
    ASSERT_TRUE(warm.ok()) << warm.status();
    expect_equal((*warm)[0], column_sums(host));
  }

  // The victim stops before the call, so the survivors are surely inside the op, waiting on
  // it, when it dies: device 0's run is in flight before the kill.
  stopped_ = cluster_.workers[kVictim]->pid();
  ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  absl::Status result;
  std::thread call([&] { result = outcome(column_sum({*x})); });
  EXPECT_TRUE(poll_until([&] { return runs_in_flight(*client, 0) > 0; }, absl::Seconds(20)))
      << "the op did not start on device 0";
  cluster_.workers[kVictim]->kill();
  stopped_ = -1;
  const absl::Time killed = absl::Now();
  call.join();
  const absl::Duration took = absl::Now() - killed;
  std::printf("collective over TCP with a member killed mid-op failed %s after the kill: %s\n",
              absl::FormatDuration(took).c_str(), result.ToString().c_str());
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr(absl::StrCat("device ", kVictim)));
  EXPECT_LT(took, kBound);
  absl::StatusOr<DeviceStats> stats = client->device_stats(0);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->shm_messages_received, 0) << "the data went through shared memory, not TCP";

  // The survivors carry on among themselves, right.
  absl::StatusOr<Mesh> rest = client->make_mesh({3}, {"y"}, {0, 1, 3});
  ASSERT_TRUE(rest.ok()) << rest.status();
  const HostArray small = small_integers(6, 32);
  absl::StatusOr<Array> z = client->device_put(small, NamedSharding(*rest, P("y")));
  ASSERT_TRUE(z.ok()) << z.status();
  absl::StatusOr<std::vector<Array>> total = column_sum({*z});
  ASSERT_TRUE(total.ok()) << total.status();
  expect_equal((*total)[0], column_sums(small));

  // And serve a new client.
  ConnectOptions again;
  again.min_devices = kFaultWorkers - 1;
  again.timeout = absl::Seconds(20);
  again.token = credentials_.client;
  absl::StatusOr<Client> after = Client::connect(cluster_.address, again);
  ASSERT_TRUE(after.ok()) << after.status();
  absl::StatusOr<Mesh> mesh2 = after->make_mesh({3}, {"y"}, {0, 1, 3});
  ASSERT_TRUE(mesh2.ok()) << mesh2.status();
  absl::StatusOr<Array> w = after->device_put(small, NamedSharding(*mesh2, P("y")));
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::vector<Array>> total2 = column_sum({*w});
  ASSERT_TRUE(total2.ok()) << total2.status();
  expect_equal((*total2)[0], column_sums(small));
}

// kill -9 of a worker between calls, its RunPlans stream idle: the coordinator's next call
// fails at once naming it, long before the heartbeat timeout (60 s here; 1.5 s by default) marks
// the device lost. Before, the stream that replaced the broken one waited for a connection
// that never came (wait_for_ready), and the call failed only at the heartbeat timeout.
TEST_F(TcpPeerKilledTest, AWorkerKilledBetweenCallsFailsTheNextCallAtOnce) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {kFaultWorkers * 2, 16});
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  JitOptions options;
  options.timeout = absl::Seconds(30);
  Jitted scale = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 3.0f + 1.0f}; }, options);
  {
    absl::StatusOr<std::vector<Array>> warm = scale({*x});  // every device's stream is open
    ASSERT_TRUE(warm.ok()) << warm.status();
    expect_equal((*warm)[0], affine(host, 3, 1));
  }
  cluster_.workers[kVictim]->kill();
  const absl::Time killed = absl::Now();
  const absl::Status next = outcome(scale({*x}));
  const absl::Duration took = absl::Now() - killed;
  std::printf("call after a kill -9 between calls failed %s after the kill: %s\n", absl::FormatDuration(took).c_str(),
              next.ToString().c_str());
  EXPECT_EQ(next.code(), absl::StatusCode::kUnavailable) << next;
  EXPECT_THAT(std::string(next.message()), HasSubstr(absl::StrCat("device ", kVictim)));
  // The bound is the (a dead worker named within 5 s), far below what the fault used to
  // cost (the heartbeat timeout, 60 s here, or the call's deadline): not a speed measurement.
  EXPECT_LT(took, kBound);
  // A second call fails within it too (its stream does not wait for the dead worker either).
  const absl::Time again = absl::Now();
  EXPECT_FALSE(outcome(scale({*x})).ok());
  EXPECT_LT(absl::Now() - again, kBound);
}

}  // namespace
}  // namespace tessera

// A member killed (kill -9) in the middle of a collective on the shared-memory path: the
// survivors' waits on it fail in bounded time naming it, through the transport alone (the
// coordinator's heartbeat timeout is set far beyond the bound, so it is not what notices), and
// the survivors run the next collective among themselves. Results are checked against host
// sums; every wait has a deadline; teardown resumes and kills only this test's processes.
#include <signal.h>

#include <cstdio>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

constexpr int kVictim = 3;
constexpr absl::Duration kCallTimeout = absl::Seconds(30);
// What "bounded" means: well under the call's timeout and the coordinator's heartbeat timeout.
constexpr absl::Duration kBound = absl::Seconds(5);

class ShmPeerKilledTest : public PeerKilledDrill {};

int64_t shm_messages(const Client& client, int device) {
  absl::StatusOr<DeviceStats> stats = client.device_stats(device);
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? stats->shm_messages_received : -1;
}

TEST_F(ShmPeerKilledTest, AMemberKilledMidCollectiveFailsItBoundedNamingTheDevice) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  // 16 MiB per device: a ring of 32 chunks per segment, longer than one ring of shared memory.
  absl::StatusOr<Array> x =
      client->device_put(HostArray::ones(DType::kF32, {kFaultWorkers, 1 << 22}), NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllReduce;
  spec.groups = {{0, 1, 2, 3}};
  for (int i = 0; i < 2; ++i) {  // the second runs with every ring attached
    absl::StatusOr<Array> warm = run_collective(*x, spec, kCallTimeout);
    ASSERT_TRUE(warm.ok()) << warm.status();
    EXPECT_EQ(warm->fetch()->values<float>()[12345], 4.0f);
  }
  const int64_t before = shm_messages(*client, 1);
  ASSERT_GT(before, 0) << "the workers did not use shared memory";

  // The victim stops before the op, so the op is surely under way without it: device 0 sends
  // device 1 its segment through shared memory, then everyone waits for the victim.
  stopped_ = cluster_.workers[kVictim]->pid();
  ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  absl::Status result;
  std::thread call([&] { result = run_collective(*x, spec, kCallTimeout).status(); });
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (shm_messages(*client, 1) == before && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));  // polling a condition, with a deadline
  }
  EXPECT_GT(shm_messages(*client, 1), before) << "the op did not start on shared memory";
  cluster_.workers[kVictim]->kill();
  stopped_ = -1;
  const absl::Time killed = absl::Now();
  call.join();
  const absl::Duration took = absl::Now() - killed;
  std::printf("collective with a member killed mid-op failed %s after the kill: %s\n",
              absl::FormatDuration(took).c_str(), result.ToString().c_str());
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr(absl::StrCat("device ", kVictim)));
  // A survivor's own error, from its transport: not only the coordinator's failed call to the victim.
  EXPECT_THAT(std::string(result.message()),
              AnyOf(HasSubstr("went away during op"), HasSubstr("stopped taking collective data"),
                    HasSubstr("failed with messages of op")));
  EXPECT_LT(took, kBound);

  // The survivors carry on among themselves, through shared memory.
  absl::StatusOr<Mesh> rest = client->make_mesh({3}, {"y"}, {0, 1, 2});
  ASSERT_TRUE(rest.ok()) << rest.status();
  absl::StatusOr<Array> z =
      client->device_put(HostArray::ones(DType::kF32, {3, 1 << 20}), NamedSharding(*rest, P("y")));
  ASSERT_TRUE(z.ok()) << z.status();
  CollectiveSpec survivors = spec;
  survivors.groups = {{0, 1, 2}};
  const int64_t before_rest = shm_messages(*client, 1);
  absl::StatusOr<Array> sum = run_collective(*z, survivors, kCallTimeout);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_EQ(sum->fetch()->values<float>()[777], 3.0f);
  EXPECT_GT(shm_messages(*client, 1), before_rest);
}

}  // namespace
}  // namespace tessera

// A replicated put's fan-out (ShardHeader.fan_out: one upload, then a broadcast among the
// workers) on real worker processes with credentials, so that the coordinator's address grants
// are checked: the put arrives whole on every replica, the client uploads it once, and a
// member killed (kill -9) in the middle of the broadcast fails the put in bounded time naming
// it, through the transport alone (the coordinator's heartbeat timeout is far beyond the
// bound), leaving no buffer of the array on the survivors. Every wait has a deadline; teardown
// resumes and kills only this test's processes.
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
using ::testing::Not;

// Members in chain order 0 -> 1 -> 2 -> 3 (the uploader of a one-block array is its first
// replica); the victim is in the middle, so that both a sender and a receiver must notice.
constexpr int kVictim = 2;
// What "bounded" means: well under the coordinator's heartbeat timeout (60 s here) and the
// put's own deadline (10 s + 1 s per 16 MiB).
constexpr absl::Duration kBound = absl::Seconds(5);

// The fan-out is the streams' path: a co-located client's replicated block through shared
// memory is one memfd every replica reads, with no broadcast (tests/integration/shm_transfer_test.cc).
class PutFanOutKilledTest : public PeerKilledDrill {
 protected:
  bool client_shared_memory() const override { return false; }
};

DeviceStats stats_of(const Client& client, int device) {
  absl::StatusOr<DeviceStats> stats = client.device_stats(device);
  EXPECT_TRUE(stats.ok()) << stats.status();
  return stats.ok() ? *stats : DeviceStats{};
}

TEST_F(PutFanOutKilledTest, AMemberKilledMidBroadcastFailsThePutBoundedNamingIt) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  // 48 MiB, every device a copy: 96 chunks of 512 KiB along the chain, far more than a ring of
  // shared memory (4 MiB) holds.
  HostArray host(DType::kI32, {12, 1 << 20});
  for (int64_t i = 0; i < host.size(); ++i) host.mutable_values<int32_t>()[i] = static_cast<int32_t>(i * 31 - 7);

  // A whole put first: every copy equals the host array, the client sent it once.
  std::vector<DeviceStats> before;
  for (int d = 0; d < kFaultWorkers; ++d) before.push_back(stats_of(*client, d));
  {
    absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, P()));
    ASSERT_TRUE(a.ok()) << a.status();
    int64_t put = 0, fanned_out = 0;
    for (int d = 0; d < kFaultWorkers; ++d) {
      const DeviceStats s = stats_of(*client, d);
      put += s.bytes_put - before[d].bytes_put;
      fanned_out += s.bytes_fanned_out - before[d].bytes_fanned_out;
    }
    EXPECT_EQ(put, host.nbytes());
    EXPECT_EQ(fanned_out, host.nbytes() * (kFaultWorkers - 1));
    for (const Shard& s : a->addressable_shards()) {
      absl::StatusOr<HostArray> got = s.data();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == host) << "device " << s.device_id();
    }
  }
  // The victim stops first, so the broadcast is surely under way without it: device 1 takes
  // chunks from device 0 through shared memory, then stalls on the victim's full ring.
  stopped_ = cluster_.workers[kVictim]->pid();
  ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  const int64_t shm_before = stats_of(*client, 1).shm_messages_received;
  absl::Status result;
  std::thread put([&] { result = client->device_put(host, NamedSharding(*mesh, P())).status(); });
  EXPECT_TRUE(poll_until([&] { return stats_of(*client, 1).shm_messages_received > shm_before; }, absl::Seconds(20)))
      << "the broadcast did not start";
  cluster_.workers[kVictim]->kill();
  stopped_ = -1;
  const absl::Time killed = absl::Now();
  put.join();
  const absl::Duration took = absl::Now() - killed;
  std::printf("replicated put with a member killed mid-broadcast failed %s after the kill: %s\n",
              absl::FormatDuration(took).c_str(), result.ToString().c_str());
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr(absl::StrCat("device ", kVictim)));
  EXPECT_LT(took, kBound);

  // No copy of either array stays: the survivors drop what they stored of the failed one (and
  // of the first, whose handle went).
  for (int d = 0; d < kFaultWorkers; ++d) {
    if (d == kVictim) continue;
    poll_until([&] { return stats_of(*client, d).buffer_count == before[d].buffer_count; }, absl::Seconds(10));
    EXPECT_EQ(stats_of(*client, d).buffer_count, before[d].buffer_count) << "device " << d;
  }
}

// The uploader killed before it sent anything, on a fresh cluster (no Exchange link between
// the workers yet, so no stream's end tells the other members): the client's call to it fails,
// which cancels the members' calls, so the put fails in bounded time naming it rather than
// after the broadcast's deadline (10 s + 1 s per 16 MiB).
TEST_F(PutFanOutKilledTest, TheUploaderKilledBeforeItSendsFailsThePutBoundedNamingIt) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::ones(DType::kF32, {12, 1 << 20});  // 48 MiB
  std::vector<int64_t> used;
  for (int d = 0; d < kFaultWorkers; ++d) used.push_back(stats_of(*client, d).bytes_used);
  constexpr int kUploader = 0;  // the first replica of the array's one block
  stopped_ = cluster_.workers[kUploader]->pid();
  ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  absl::Status result;
  std::thread put([&] { result = client->device_put(host, NamedSharding(*mesh, P())).status(); });
  // The other members reserve the block when their header arrives, then wait for the uploader.
  for (int d = 1; d < kFaultWorkers; ++d) {
    EXPECT_TRUE(
        poll_until([&] { return stats_of(*client, d).bytes_used >= used[d] + host.nbytes(); }, absl::Seconds(20)))
        << "device " << d << " did not start";
  }
  cluster_.workers[kUploader]->kill();
  stopped_ = -1;
  const absl::Time killed = absl::Now();
  put.join();
  const absl::Duration took = absl::Now() - killed;
  std::printf("replicated put with its uploader killed failed %s after the kill: %s\n",
              absl::FormatDuration(took).c_str(), result.ToString().c_str());
  EXPECT_EQ(result.code(), absl::StatusCode::kUnavailable) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr(absl::StrCat("device ", kUploader)));
  // The failed put drops its array, whose DeleteArray is the coordinator's first contact with
  // the dead uploader on this fresh cluster: that waits up to 5 s for the connection (docs/
  // design.md, "Control path and failure"). Still far below the broadcast's deadline (13 s).
  EXPECT_LT(took, kBound + absl::Seconds(5));
  // The members gave their reservations back.
  for (int d = 1; d < kFaultWorkers; ++d) {
    poll_until([&] { return stats_of(*client, d).bytes_used == used[d]; }, absl::Seconds(10));
    EXPECT_EQ(stats_of(*client, d).bytes_used, used[d]) << "device " << d;
  }
}

// The stall deadline during the broadcast (docs/design.md, "Data path"): the uploader's watch
// times the client's stream only while the broadcast waits for the client's bytes; a wait on a
// member (room in the link to it, its acknowledgement) has the same deadline and, crossed,
// fails the put DEADLINE_EXCEEDED naming that member. The old watch kept timing the client
// while the broadcast waited on a member, so it cancelled the upload's stream as the client's
// stall: device_put failed CANCELLED "device_put: device 0 (...): Cancelled on the server
// side", naming no member (this test on the old worker). Device 1, the uploader's
// successor in the chain, is stopped (SIGSTOP) before the put: it takes nothing, so the
// uploader's wait for it crosses the deadline; resumed, it finds the uploader's first chunks
// for an op it never started (its own call was cancelled). The failed put's deletion ends that
// op there (worker DeleteBuffers), so those chunks go at once: before, 32 of them (16 MiB of
// the device's memory) stayed until the mailbox's time-to-live (60 s by default, kept here),
// and this test failed on that (the old worker: 16777216 bytes used after the retry). The
// retried put stores every copy, and nothing else stays.
class PutFanOutStallTest : public PutFanOutKilledTest {
 protected:
  std::vector<std::string> drill_worker_flags() const override { return {"--put_stall_ms=1000"}; }
};

TEST_F(PutFanOutStallTest, AMemberMakingNoProgressFailsThePutNamingItNotTheClient) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  HostArray host(DType::kI32, {12, 1 << 20});  // 48 MiB, far more than the rings and queues hold
  for (int64_t i = 0; i < host.size(); ++i) host.mutable_values<int32_t>()[i] = static_cast<int32_t>(i * 13 + 5);
  std::vector<int64_t> used;
  for (int d = 0; d < kFaultWorkers; ++d) used.push_back(stats_of(*client, d).bytes_used);
  constexpr int kSlow = 1;
  stopped_ = cluster_.workers[kSlow]->pid();
  ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  const absl::Status result = client->device_put(host, NamedSharding(*mesh, P())).status();
  ASSERT_EQ(::kill(stopped_, SIGCONT), 0);
  stopped_ = -1;
  std::printf("replicated put with member %d stopped: %s\n", kSlow, result.ToString().c_str());
  EXPECT_EQ(result.code(), absl::StatusCode::kDeadlineExceeded) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr(absl::StrCat("device ", kSlow, " (")));
  EXPECT_THAT(std::string(result.message()), HasSubstr("--put_stall_ms"));
  EXPECT_THAT(std::string(result.message()), Not(HasSubstr("received no data")));
  // The failed put's array is deleted on every device, the resumed one included.
  ASSERT_TRUE(client->flush_deletes().ok());
  {
    // Its chunks from the uploader reach the resumed member before the retry's (one ring per
    // pair, in order), and go as they arrive.
    absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, P()));
    ASSERT_TRUE(a.ok()) << a.status();
    for (const Shard& s : a->addressable_shards()) {
      absl::StatusOr<HostArray> got = s.data();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == host) << "device " << s.device_id();
    }
  }
  ASSERT_TRUE(client->flush_deletes().ok());
  // Nothing stays: the members' reservations, the copies, the failed put's chunks. Everything
  // that could come has come (the retry followed it), so a reading equal to the start is final.
  for (int d = 0; d < kFaultWorkers; ++d) {
    poll_until([&] { return stats_of(*client, d).bytes_used == used[d]; }, absl::Seconds(10));
    EXPECT_EQ(stats_of(*client, d).bytes_used, used[d]) << "device " << d;
    EXPECT_EQ(stats_of(*client, d).collective_messages_pending, 0) << "device " << d;
  }
}

}  // namespace
}  // namespace tessera

// A worker killed (kill -9) and started again at the same address: a new process, so a new
// incarnation whose buffers are empty (issue #17; the race deploy_compose met in session 12).
// The coordinator used to count the dead process's incarnation alive until its heartbeat
// timeout: a client's wait for every device (GetTopology with min_alive_devices) answered at
// once, the client put its arrays while the new process was not registered yet (or not even
// listening), and then the put failed, or the new process's registration declared the fresh
// shards lost and the next call failed FAILED_PRECONDITION "put the array again". Now the
// wait counts a device only once the process at its address confirms the incarnation the
// coordinator registered (its Handshake says which registration it holds), so the wait
// means what it says. Results are checked against host computations; every wait has a
// deadline; teardown kills only this test's processes, by pid.
#include <cstdio>
#include <optional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"
#include "tests/support/exchange_stream.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kVictim = 3;

class WorkerRestartTest : public FaultClusterTest {
 protected:
  // kill -9 of worker kVictim (returns once it is reaped); remembers its address.
  void kill_victim(const Client& client) {
    absl::StatusOr<std::vector<Device>> devices = client.devices();
    ASSERT_TRUE(devices.ok()) << devices.status();
    address_ = (*devices)[kVictim].address;
    cluster_.workers[kVictim]->kill();
  }

  // A new worker process for device kVictim at its old address. Does not wait for it: a
  // client's wait for the cluster is what the tests check.
  void spawn_victim() {
    absl::StatusOr<std::unique_ptr<Subprocess>> worker =
        Subprocess::spawn({kBin + "/tessera-worker", "--coordinator=" + cluster_.address,
                           "--port=" + address_.substr(address_.rfind(':') + 1), absl::StrCat("--device_id=", kVictim),
                           "--memory_bytes=268435456", "--credentials=" + credentials_dir_});
    ASSERT_TRUE(worker.ok()) << worker.status();
    cluster_.workers[kVictim] = *std::move(worker);
  }

  // The stats of the worker at `address`, as the admin sees them.
  absl::StatusOr<pb::WorkerStats> worker_stats(const std::string& address) const {
    pb::WorkerStats stats;
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    auto admin = std::make_shared<CallIdentity>(credentials_.admin);
    const grpc::Status s = pb::Worker::NewStub(make_channel(address, admin))->GetStats(&ctx, {}, &stats);
    if (!s.ok()) return from_grpc(s, address);
    return stats;
  }

  std::string address_;
};

Jitted total = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; });

// Everything a client does with a fresh cluster: a put, and a jitted call with an all-reduce
// (the column sums of x over the split dimension), checked against the host.
// Returns x (nullopt after a failure).
std::optional<Array> put_and_sum(Client& client) {
  absl::StatusOr<Mesh> mesh = client.make_mesh({kFaultWorkers}, {"x"});
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  if (!mesh.ok()) return std::nullopt;
  const HostArray host = HostArray::arange(DType::kF32, {kFaultWorkers * 2, 8});
  absl::StatusOr<Array> x = client.device_put(host, NamedSharding(*mesh, P("x")));
  EXPECT_TRUE(x.ok()) << x.status();
  if (!x.ok()) return std::nullopt;
  absl::StatusOr<std::vector<Array>> out = total({*x});
  EXPECT_TRUE(out.ok()) << out.status();
  if (out.ok()) expect_equal((*out)[0], column_sums(host));
  return *x;
}

// deploy_compose's sequence: a call, kill -9 of a worker, the next call fails naming it, the
// worker's process starts again, the client waits for every device, puts and calls again.
TEST_F(WorkerRestartTest, AWaitForEveryDeviceAfterARestartWaitsForTheNewProcess) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  const std::optional<Array> x = put_and_sum(*client);
  ASSERT_TRUE(x.has_value());
  kill_victim(*client);

  const absl::Time killed = absl::Now();
  // No process serves device 3 now: a wait for every device must not answer yet. (It used
  // to, at once: the dead process's incarnation counted alive until its heartbeat timeout,
  // and the client's put then failed, or reached the new process before it registered.)
  ConnectOptions early;
  early.min_devices = kFaultWorkers;
  early.timeout = absl::Milliseconds(700);  // under the heartbeat timeout (1.5 s)
  early.token = credentials_.client;
  absl::StatusOr<Client> too_early = Client::connect(cluster_.address, early);
  ASSERT_FALSE(too_early.ok()) << "a wait for " << kFaultWorkers << " devices answered with device " << kVictim
                               << "'s process dead";
  EXPECT_EQ(too_early.status().code(), absl::StatusCode::kDeadlineExceeded) << too_early.status();
  EXPECT_THAT(std::string(too_early.status().message()), HasSubstr(absl::StrCat("device ", kVictim, " (")))
      << too_early.status();

  absl::StatusOr<std::vector<Array>> after = total({*x});
  const absl::Status failed = after.ok() ? (*after)[0].block_until_ready() : after.status();
  ASSERT_FALSE(failed.ok());
  EXPECT_THAT(std::string(failed.message()), HasSubstr(absl::StrCat("device ", kVictim))) << failed;
  std::printf("[ timing ] kill -9 -> the next call failed: %s (%s)\n",
              absl::FormatDuration(absl::Now() - killed).c_str(), std::string(failed.message()).substr(0, 200).c_str());

  spawn_victim();
  const absl::Time spawned = absl::Now();
  absl::StatusOr<Client> waited = connect();  // waits (at most 20 s) for every device
  ASSERT_TRUE(waited.ok()) << waited.status();
  absl::StatusOr<std::vector<Device>> devices = waited->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  EXPECT_TRUE((*devices)[kVictim].alive);
  std::printf("[ timing ] new process -> the wait for %d devices answered: %s\n", kFaultWorkers,
              absl::FormatDuration(absl::Now() - spawned).c_str());
  // Put at once: the data must land on the registered new process and stay there.
  put_and_sum(*waited);
  put_and_sum(*client);
}

// Issue #17 item 1, "collective messages only from ... registered peers of the current
// cluster incarnation": once device 3's worker restarted (incarnation 2), a stream declaring
// its earlier incarnation — what its old process would send, had it survived — is refused
// PERMISSION_DENIED naming the device, both incarnations and the rule; one declaring the
// current incarnation is taken, but its message claiming device 2 is dropped and counted,
// never filed under device 2. The collectives after it are right (against the host).
// Before, every such stream was taken.
TEST_F(WorkerRestartTest, AStreamOfAnEarlierIncarnationIsRefusedAndAForgedSenderDropped) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(put_and_sum(*client).has_value());
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  absl::StatusOr<pb::HandshakeReply> old = worker_registration((*devices)[kVictim].address, credentials_.client);
  ASSERT_TRUE(old.ok()) << old.status();
  kill_victim(*client);
  spawn_victim();
  absl::StatusOr<Client> waited = connect();  // waits (at most 20 s) for the new process
  ASSERT_TRUE(waited.ok()) << waited.status();
  absl::StatusOr<pb::HandshakeReply> now = worker_registration(address_, credentials_.client);
  ASSERT_TRUE(now.ok()) << now.status();
  ASSERT_EQ(now->epoch(), old->epoch());
  ASSERT_GT(now->incarnation(), old->incarnation());

  const DeclaredSender current{kVictim, now->epoch(), now->incarnation()};
  const DeclaredSender earlier{kVictim, old->epoch(), old->incarnation()};
  pb::ExchangeMessage forged;
  forged.set_source_device(2);
  forged.set_op_id(now->epoch() + 1);  // an op id this coordinator handed out
  forged.set_data(std::string(64, '\x7f'));
  for (int w = 0; w < kVictim; ++w) {
    SCOPED_TRACE(absl::StrCat("worker ", w));
    const std::string& address = (*devices)[w].address;
    absl::StatusOr<pb::WorkerStats> before = worker_stats(address);
    ASSERT_TRUE(before.ok()) << before.status();
    // The current incarnation first: once it is taken, this worker knows of it for sure.
    grpc::Status taken = exchange_stream(address, credentials_.cluster, current, {forged});
    EXPECT_TRUE(taken.ok()) << taken.error_message();
    grpc::Status refused = exchange_stream(address, credentials_.cluster, earlier, {forged});
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
    EXPECT_THAT(refused.error_message(),
                HasSubstr(absl::StrCat("refused a stream from device ", kVictim, " (incarnation ", old->incarnation(),
                                       " of coordinator epoch ", old->epoch(), ")")));
    EXPECT_THAT(refused.error_message(), HasSubstr(absl::StrCat("an earlier incarnation of device ", kVictim,
                                                                ", whose current one is ", now->incarnation())));
    absl::StatusOr<pb::WorkerStats> after = worker_stats(address);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(after->exchange_messages_forged(), before->exchange_messages_forged() + 1);
    EXPECT_EQ(after->collective_messages_pending(), 0);
  }
  put_and_sum(*waited);
}

}  // namespace
}  // namespace tessera

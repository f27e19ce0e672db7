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

using ::testing::AnyOf;
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

  // A client of the fresh cluster after a checked put and all-reduce (client_), the devices
  // (devices_) and the registration device kVictim holds (old_).
  void use_cluster();
  // kill -9 of device kVictim's worker and a new process at its address; waits for it (waited_,
  // a client of the cluster again) and reads its registration (now_): the same coordinator
  // epoch, a newer incarnation.
  void restart_victim() {
    kill_victim(*client_);
    spawn_victim();
    absl::StatusOr<Client> waited = connect();  // waits (at most 20 s) for the new process
    ASSERT_TRUE(waited.ok()) << waited.status();
    waited_ = *std::move(waited);
    absl::StatusOr<pb::HandshakeReply> now = worker_registration(address_, credentials_.client);
    ASSERT_TRUE(now.ok()) << now.status();
    ASSERT_EQ(now->epoch(), old_->epoch());
    ASSERT_GT(now->incarnation(), old_->incarnation());
    now_ = *now;
  }

  std::string address_;
  std::optional<Client> client_, waited_;
  std::optional<std::vector<Device>> devices_;
  std::optional<pb::HandshakeReply> old_, now_;
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

void WorkerRestartTest::use_cluster() {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE(put_and_sum(*client).has_value());
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  absl::StatusOr<pb::HandshakeReply> old = worker_registration((*devices)[kVictim].address, credentials_.client);
  ASSERT_TRUE(old.ok()) << old.status();
  client_ = *std::move(client);
  devices_ = *devices;
  old_ = *old;
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
  ASSERT_NO_FATAL_FAILURE(use_cluster());
  const pb::HandshakeReply* old = &*old_;
  const std::vector<Device>* devices = &*devices_;
  ASSERT_NO_FATAL_FAILURE(restart_victim());
  const pb::HandshakeReply* now = &*now_;

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
  put_and_sum(*waited_);
}

// Session 29's gap in issue #17 item 1: a stream is checked when it opens, but a stream taken
// before its sender's registration was replaced must not be read afterwards either. A stream
// declaring device 3's registration, opened while it is current and left open (as the
// streams of a stopped or partitioned old process stay open), is taken: its first message is
// filed at worker 0. Device 3's worker restarts (a new incarnation). Once worker 0 knows the
// new incarnation (a stream declaring it is taken there), the old stream has been ended
// PERMISSION_DENIED naming the device, both incarnations and the rule, and a message written
// on it afterwards is never filed. The next all-reduce is right (against the host). Before,
// the stream stayed open and read until its deadline (DEADLINE_EXCEEDED here, 30 s).
TEST_F(WorkerRestartTest, AStreamTakenBeforeItsSenderRegisteredAgainIsEnded) {
  ASSERT_NO_FATAL_FAILURE(use_cluster());
  const pb::HandshakeReply* old = &*old_;
  const std::vector<Device>* devices = &*devices_;
  const std::string target = (*devices)[0].address;
  absl::StatusOr<pb::WorkerStats> before = worker_stats(target);
  ASSERT_TRUE(before.ok()) << before.status();

  // The old registration's stream, held open.
  auto stub = pb::Worker::NewStub(make_channel(target, std::make_shared<CallIdentity>(credentials_.cluster, kVictim)));
  grpc::ClientContext ctx;
  // Far beyond the waits below (the held message, the restart, a fresh stream: up to 50 s under
  // ASan and load), so the stream's end is the worker's verdict, never this deadline.
  set_deadline(&ctx, absl::Seconds(120));
  ctx.AddMetadata(kEpochKey, absl::StrCat(old->epoch()));
  ctx.AddMetadata(kIncarnationKey, absl::StrCat(old->incarnation()));
  pb::ExchangeReply reply;
  std::unique_ptr<grpc::ClientWriter<pb::ExchangeMessage>> stream = stub->Exchange(&ctx, &reply);
  pb::ExchangeMessage message;
  message.set_source_device(kVictim);
  message.set_op_id(old->epoch() + 1'000'000);  // an op far ahead: held as an early message
  message.set_data(std::string(64, '\x7f'));
  ASSERT_TRUE(stream->Write(message));
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<pb::WorkerStats> held = worker_stats(target);
  while (held.ok() && held->collective_messages_pending() == before->collective_messages_pending() &&
         absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));  // polling a condition, with a deadline
    held = worker_stats(target);
  }
  ASSERT_TRUE(held.ok()) << held.status();
  ASSERT_EQ(held->collective_messages_pending(), before->collective_messages_pending() + 1)
      << "the stream of the current registration was not read";

  ASSERT_NO_FATAL_FAILURE(restart_victim());
  const pb::HandshakeReply* now = &*now_;
  // Taken only once worker 0's view names the new incarnation: the view that ends the old stream.
  grpc::Status taken = exchange_stream(target, credentials_.cluster, {kVictim, now->epoch(), now->incarnation()}, {});
  ASSERT_TRUE(taken.ok()) << taken.error_message();

  message.set_op_id(old->epoch() + 1'000'001);
  stream->Write(message);  // may fail: the stream is over
  const grpc::Status ended = stream->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::PERMISSION_DENIED) << ended.error_message();
  EXPECT_THAT(ended.error_message(),
              HasSubstr(absl::StrCat("ended the stream from device ", kVictim, " (incarnation ", old->incarnation(),
                                     " of coordinator epoch ", old->epoch(), ")")));
  // Replaced by the new process's registration, or, if the coordinator marked the old process
  // lost before the new one registered (a slow start), by the view without the device.
  EXPECT_THAT(ended.error_message(),
              AnyOf(HasSubstr(absl::StrCat("current incarnation is ", now->incarnation(),
                                           ", which replaced incarnation ", old->incarnation())),
                    HasSubstr(absl::StrCat("device ", kVictim, " is no longer a registered device of this cluster"))));
  EXPECT_THAT(ended.error_message(), HasSubstr("a worker takes collective data only from the current incarnations"));
  absl::StatusOr<pb::WorkerStats> after = worker_stats(target);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->collective_messages_pending(), held->collective_messages_pending())
      << "a message of the replaced registration was filed";
  put_and_sum(*waited_);
}

}  // namespace
}  // namespace tessera

// Everything bounded (issue #17 item 5), with real processes: a coordinator and two
// tessera-worker processes on 127.0.0.1 with small bounds (8 MiB devices, a compile cache of
// 4 programs, a mailbox share of 4 MiB and a 500 ms TTL). Each test crosses a bound, checks
// the precise error (code, the limit and the value), and then that the daemons still serve
// right answers.
#include <set>

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator_server.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/support/exchange_stream.h"
#include "worker/collectives/transport.h"
#include "worker/worker_server.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int kWorkers = 2;
constexpr int kMaxPrograms = 4;

class BoundsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ProcessCluster> cluster =
        ProcessCluster::start(TESSERA_BIN_DIR, kWorkers, {absl::StrCat("--max_programs=", kMaxPrograms)},
                              {"--memory_bytes=8388608", "--mailbox_bytes_per_peer=4194304", "--mailbox_ttl_ms=500"});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    ConnectOptions options;
    options.min_devices = kWorkers;
    absl::StatusOr<Client> client = Client::connect(cluster_.address, options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(*std::move(client));
    absl::StatusOr<Mesh> mesh = client_->make_mesh({kWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    mesh_.emplace(*mesh);
    absl::StatusOr<Array> x = client_->device_put(x0_, NamedSharding(*mesh_, P("x")));
    ASSERT_TRUE(x.ok()) << x.status();
    x_.emplace(*std::move(x));
    coordinator_ = pb::Coordinator::NewStub(make_channel(cluster_.address));
  }
  void TearDown() override {
    x_.reset();
    client_.reset();
  }

  // Whatever was thrown at them, the daemons still compute x * k + 1 right.
  void expect_serving(int k) {
    Jitted f = jit([k](const std::vector<Value>& in) { return std::vector<Value>{in[0] * k + 1}; });
    absl::StatusOr<std::vector<Array>> out = f({*x_});
    ASSERT_TRUE(out.ok()) << out.status();
    absl::StatusOr<HostArray> got = (*out)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t i = 0; i < x0_.size(); ++i) EXPECT_EQ(got->values<float>()[i], x0_.values<float>()[i] * k + 1) << i;
  }

  pb::ClusterStatus cluster_status() {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::ClusterStatus status;
    EXPECT_TRUE(coordinator_->GetClusterStatus(&ctx, {}, &status).ok());
    return status;
  }

  const HostArray x0_ = HostArray::arange(DType::kF32, {16});
  ProcessCluster cluster_;
  std::optional<Client> client_;
  std::optional<Mesh> mesh_;
  std::optional<Array> x_;
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
};

void expect_error(const grpc::Status& s, grpc::StatusCode code, const std::vector<std::string>& parts) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  for (const std::string& p : parts) EXPECT_THAT(s.error_message(), HasSubstr(p));
}

// The program: a 512 MiB intermediate on an 8 MiB device ran. Now the worker checks
// the plan's peak (its liveness) against its free memory before it runs anything.
TEST_F(BoundsTest, APlanWhosePeakExceedsTheDeviceFailsBeforeItRuns) {
  Jitted big = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{in[0] + sum(iota(DType::kF32, {int64_t{1} << 27}, 0))};
  });
  absl::StatusOr<std::vector<Array>> out = big({*x_});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::Status status = (*out)[0].block_until_ready();
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr("bytes at once for its intermediates and outputs"),
                    ContainsRegex("at instruction [0-9]+ \\((iota|reduce_sum)\\)"),
                    HasSubstr("of the device's 8388608 bytes are free (--memory_bytes)")));
  // The coordinator names the device it called, once ("device 1 (addr): ..."); the worker
  // used to name itself again ("device 1 (addr): device 1: ...").
  EXPECT_THAT(std::string(status.message()), Not(ContainsRegex("device [0-9]+ \\([^)]*\\): device [0-9]+:")));
  for (int d = 0; d < kWorkers; ++d) {
    absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->bytes_used, x0_.nbytes() / kWorkers) << "device " << d << " kept a reservation";
  }
  expect_serving(3);
}

// The compile cache keeps kMaxPrograms; the rest are evicted and unloaded from the workers.
// A client whose cached executable was evicted compiles it again by itself and gets its own
// program's answer, never another's.
TEST_F(BoundsTest, TheCompileCacheEvictsAndAnEvictedProgramIsCompiledAgain) {
  std::vector<Jitted> programs;
  for (int k = 1; k <= 3 * kMaxPrograms; ++k) {
    programs.push_back(jit([k](const std::vector<Value>& in) { return std::vector<Value>{in[0] * k + 1}; }));
  }
  for (int round = 0; round < 2; ++round) {
    for (int k = 1; k <= 3 * kMaxPrograms; ++k) {
      SCOPED_TRACE(absl::StrCat("round ", round, ", k = ", k));
      absl::StatusOr<std::vector<Array>> out = programs[k - 1]({*x_});
      ASSERT_TRUE(out.ok()) << out.status();
      absl::StatusOr<HostArray> got = (*out)[0].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      for (int64_t i = 0; i < x0_.size(); ++i) ASSERT_EQ(got->values<float>()[i], x0_.values<float>()[i] * k + 1);
    }
  }
  pb::ClusterStatus status = cluster_status();
  EXPECT_LE(status.executables_size(), kMaxPrograms);
  EXPECT_GE(status.programs_evicted(), 6 * kMaxPrograms - kMaxPrograms);  // round 2 recompiled every one
  EXPECT_GE(status.compilations(), 6 * kMaxPrograms);
  // The workers drop what the coordinator evicted (asynchronously: poll, bounded).
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (int d = 0; d < kWorkers; ++d) {
    int64_t plans = -1;
    while (absl::Now() < deadline) {
      absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
      ASSERT_TRUE(stats.ok()) << stats.status();
      plans = stats->plans_loaded;
      if (plans <= kMaxPrograms) break;
      absl::SleepFor(absl::Milliseconds(20));  // polling a state with no change feed
    }
    EXPECT_LE(plans, kMaxPrograms) << "device " << d;
  }
}

// Workers that keep fewer plans than the coordinator's cache: a run of a plan the worker
// dropped fails NOT_FOUND there, the coordinator forgets the device has it and answers
// ABORTED, and the SDK's retry loads it again. Every call gets its own program's answer.
TEST(BoundsWorkerPlans, AWorkerThatDroppedAPlanGetsItAgain) {
  absl::StatusOr<ProcessCluster> cluster =
      ProcessCluster::start(TESSERA_BIN_DIR, kWorkers, {}, {"--max_plans=2", "--memory_bytes=8388608"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ConnectOptions options;
  options.min_devices = kWorkers;
  absl::StatusOr<Client> client = Client::connect(cluster->address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok());
  const HostArray x0 = HostArray::arange(DType::kF32, {16});
  absl::StatusOr<Array> x = client->device_put(x0, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  std::vector<Jitted> programs;
  for (int k = 1; k <= 4; ++k) {
    programs.push_back(jit([k](const std::vector<Value>& in) { return std::vector<Value>{in[0] * k - 2}; }));
  }
  for (int round = 0; round < 3; ++round) {
    for (int k = 1; k <= 4; ++k) {
      SCOPED_TRACE(absl::StrCat("round ", round, ", k = ", k));
      absl::StatusOr<std::vector<Array>> out = programs[k - 1]({*x});
      ASSERT_TRUE(out.ok()) << out.status();
      absl::StatusOr<HostArray> got = (*out)[0].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      for (int64_t i = 0; i < x0.size(); ++i) ASSERT_EQ(got->values<float>()[i], x0.values<float>()[i] * k - 2);
    }
  }
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok());
  for (const Device& d : *devices) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::WorkerStats stats;
    ASSERT_TRUE(pb::Worker::NewStub(make_channel(d.address))->GetStats(&ctx, {}, &stats).ok());
    EXPECT_LE(stats.plans_loaded(), 2);
    EXPECT_GE(stats.plans_evicted(), 8);
  }
}

TEST_F(BoundsTest, RequestLimitsNameTheLimit) {
  // A timeout of 2^62 ms overflowed into an immediate DEADLINE_EXCEEDED blaming every device.
  pb::RunCollectiveRequest collective;
  collective.set_array_id(x_->id());
  collective.mutable_spec()->set_kind(pb::ALL_REDUCE);
  collective.mutable_spec()->set_reduce_op(pb::SUM);
  for (int d = 0; d < kWorkers; ++d) collective.mutable_spec()->add_groups()->add_device_ids(d);
  collective.set_timeout_ms(int64_t{1} << 62);
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::RunCollectiveReply reply;
    expect_error(coordinator_->RunCollective(&ctx, collective, &reply), grpc::StatusCode::INVALID_ARGUMENT,
                 {"RunCollective: timeout_ms 4611686018427387904 exceeds the limit of 3600000"});
  }
  // A 15 MB request: RESOURCE_EXHAUSTED naming the sizes, from our channel (it refuses to
  // send it) and from the server (a channel without a send limit).
  pb::HandshakeRequest huge;
  huge.set_peer(std::string(15'000'000, 'p'));
  for (std::shared_ptr<grpc::Channel> channel :
       {make_channel(cluster_.address), grpc::CreateChannel(cluster_.address, grpc::InsecureChannelCredentials())}) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::HandshakeReply reply;
    grpc::Status s = pb::Coordinator::NewStub(channel)->Handshake(&ctx, huge, &reply);
    expect_error(s, grpc::StatusCode::RESOURCE_EXHAUSTED, {"larger than max", "4194304"});
  }
  // Junk registrations.
  {
    pb::RegisterWorkerRequest junk = worker_request("junk", "not an address", 2147483647, 1 << 20);
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::RegisterWorkerReply reply;
    expect_error(coordinator_->RegisterWorker(&ctx, junk, &reply), grpc::StatusCode::INVALID_ARGUMENT,
                 {"requested device id 2147483647 is out of range"});
    junk.set_requested_device_id(-1);
    grpc::ClientContext ctx2;
    set_deadline(&ctx2, absl::Seconds(10));
    expect_error(coordinator_->RegisterWorker(&ctx2, junk, &reply), grpc::StatusCode::INVALID_ARGUMENT,
                 {"address 'not an address' has a space"});
  }
  // A 3 MiB axis name made every `tessera status` too large to answer.
  {
    pb::CreateArrayRequest create;
    create.set_dtype(pb::F32);
    create.mutable_shape()->add_dims(2);
    pb::Mesh* mesh = create.mutable_sharding()->mutable_mesh();
    mesh->add_shape(2);
    mesh->add_axis_names(std::string(3 << 20, 'a'));
    mesh->set_device_ids_in_order(true);
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::CreateArrayReply reply;
    expect_error(coordinator_->CreateArray(&ctx, create, &reply), grpc::StatusCode::INVALID_ARGUMENT,
                 {"the name of axis 0 has 3145728 bytes, over the limit of 128"});
  }
  // Compile: a parameter index beyond the inputs, and an empty graph.
  {
    pb::CompileRequest compile;
    pb::GraphNode* node = compile.mutable_graph()->add_nodes();
    node->mutable_node()->set_op(pb::OP_PARAMETER);
    node->mutable_node()->set_dtype(pb::F32);
    node->mutable_node()->mutable_shape()->add_dims(16);
    node->mutable_node()->mutable_parameter()->set_index(7);
    compile.mutable_graph()->add_outputs(0);
    compile.mutable_mesh()->add_shape(kWorkers);
    compile.mutable_mesh()->add_axis_names("x");
    compile.mutable_mesh()->set_device_ids_in_order(true);
    compile.add_input_specs();
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::CompileReply reply;
    expect_error(coordinator_->Compile(&ctx, compile, &reply), grpc::StatusCode::INVALID_ARGUMENT,
                 {"graph node 0 is parameter index 7 but it is parameter 0"});
    compile.clear_graph();
    compile.clear_input_specs();
    grpc::ClientContext ctx2;
    set_deadline(&ctx2, absl::Seconds(10));
    expect_error(coordinator_->Compile(&ctx2, compile, &reply), grpc::StatusCode::INVALID_ARGUMENT,
                 {"the graph has 0 nodes and 0 outputs"});
  }
  // GetTopology's wait ends at the caller's deadline, not at wait_ms.
  {
    pb::GetTopologyRequest wait;
    wait.set_min_alive_devices(1000);
    wait.set_wait_ms(600'000);
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Milliseconds(300));
    pb::Topology topology;
    const absl::Time start = absl::Now();
    grpc::Status s = coordinator_->GetTopology(&ctx, wait, &topology);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::Topology topology;
    ASSERT_TRUE(coordinator_->GetTopology(&ctx, {}, &topology).ok());
    EXPECT_EQ(topology.devices_size(), kWorkers);  // the junk registrations left nothing
  }
  collective.set_timeout_ms(10'000);
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(20));
    pb::RunCollectiveReply reply;
    grpc::Status s = coordinator_->RunCollective(&ctx, collective, &reply);
    EXPECT_TRUE(s.ok()) << s.error_message();
  }
  expect_serving(5);
}

// However many arrays there are, the status stays within the message limit: the rest are
// counted, not listed (each of these records carries 32 axis names of 128 bytes, ~4 KiB).
// An error message longer than gRPC's metadata bound would fail the call with "metadata size
// exceeds limit" and lose the code and the reason: to_grpc cuts it, saying how much.
TEST(BoundsStatus, AnOverlongErrorIsCutKeepingItsCodeAndStart) {
  const std::string reason = "GetTopology: waited 1s for 5000 alive devices; lost: " + std::string(100'000, 'd');
  const grpc::Status cut = to_grpc(absl::DeadlineExceededError(reason));
  EXPECT_EQ(cut.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_EQ(cut.error_message(), absl::StrCat(reason.substr(0, kMaxStatusMessage), "... (",
                                              reason.size() - kMaxStatusMessage, " more bytes cut)"));
  const std::string fits(kMaxStatusMessage, 'f');
  EXPECT_EQ(to_grpc(absl::NotFoundError(fits)).error_message(), fits);
  EXPECT_TRUE(to_grpc(absl::OkStatus()).error_message().empty());
}

TEST_F(BoundsTest, ClusterStatusListsWhatFitsAndCountsTheRest) {
  pb::CreateArrayRequest create;
  create.set_dtype(pb::F32);
  create.mutable_shape()->add_dims(1);
  pb::Mesh* mesh = create.mutable_sharding()->mutable_mesh();
  for (int a = 0; a < 32; ++a) {
    mesh->add_shape(1);
    mesh->add_axis_names(absl::StrCat(a, std::string(120, 'a')));
  }
  mesh->add_device_ids(0);
  constexpr int kArrays = 1000;
  for (int i = 0; i < kArrays; ++i) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::CreateArrayReply reply;
    grpc::Status s = coordinator_->CreateArray(&ctx, create, &reply);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  pb::ClusterStatus status = cluster_status();  // an admin's: every array
  EXPECT_GT(status.arrays_omitted(), 0);
  EXPECT_EQ(status.arrays_size() + status.arrays_omitted(), kArrays + 1);  // and x
  EXPECT_LE(status.ByteSizeLong(), size_t{3} << 20);
  EXPECT_EQ(status.devices_size(), kWorkers);
  expect_serving(7);
}

// A PutShard that reserves most of a device and stalls held every other put there for as long
// as it stayed open; now the worker cancels it after --put_stall_ms and frees the memory.
TEST(BoundsPutShard, AStalledPutLosesItsReservation) {
  absl::StatusOr<ProcessCluster> cluster =
      ProcessCluster::start(TESSERA_BIN_DIR, 1, {}, {"--memory_bytes=8388608", "--put_stall_ms=300"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<Client> client = Client::connect(cluster->address);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok());
  auto worker = pb::Worker::NewStub(make_channel((*devices)[0].address));
  grpc::ClientContext stalled_ctx;
  set_deadline(&stalled_ctx, absl::Seconds(60));
  pb::PutShardReply stalled_reply;
  std::unique_ptr<grpc::ClientWriter<pb::ShardChunk>> stalled = worker->PutShard(&stalled_ctx, &stalled_reply);
  pb::ShardChunk header;
  header.mutable_header()->set_buffer_id(uint64_t{1} << 60);
  header.mutable_header()->set_dtype(pb::F32);
  header.mutable_header()->mutable_shape()->add_dims(6 << 18);  // 6 MiB of the 8, then nothing
  ASSERT_TRUE(stalled->Write(header));
  absl::StatusOr<Mesh> mesh = client->make_mesh({1}, {"x"});
  ASSERT_TRUE(mesh.ok());
  const HostArray big = HostArray::arange(DType::kF32, {1 << 20});  // 4 MiB
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  absl::StatusOr<Array> put = absl::UnknownError("not tried");
  while (absl::Now() < deadline) {
    put = client->device_put(big, NamedSharding(*mesh, P()));
    if (put.ok()) break;
    ASSERT_EQ(put.status().code(), absl::StatusCode::kResourceExhausted) << put.status();
    absl::SleepFor(absl::Milliseconds(50));  // polling, bounded: the stall bound is 300 ms
  }
  ASSERT_TRUE(put.ok()) << put.status();
  absl::StatusOr<HostArray> back = put->fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(*back == big);
  EXPECT_FALSE(stalled->Finish().ok());  // the worker cancelled it
}

// A flood of messages for ops that never start (a late or broken peer): the mailbox keeps at
// most the sender's share (4 MiB, each message charged its 1 MiB and its bookkeeping,
// Transport::kHeldMessageBytes: three fit). The next one waits and the flood's stream is read
// no further (flow control: the writer's Write waits) until the held ones expire at the TTL and
// make room for the next three; so the stream is slowed, never refused, the mailbox never holds
// more than the share, every message is either held or dropped and counted, and it empties
// itself after the TTL; real collectives still run.
TEST_F(BoundsTest, AFloodOfUnclaimedExchangeMessagesIsBoundedAndExpires) {
  absl::StatusOr<std::vector<Device>> devices = client_->devices();
  ASSERT_TRUE(devices.ok());
  auto worker = pb::Worker::NewStub(make_channel((*devices)[0].address));
  {
    // Worker 0's own device, declaring its registration (a stream must, to be read): nothing
    // real sends it collective data, so nothing real shares this part of its mailbox.
    absl::StatusOr<pb::HandshakeReply> self = worker_registration((*devices)[0].address, "");
    ASSERT_TRUE(self.ok()) << self.status();
    std::vector<pb::ExchangeMessage> flood(20);
    for (int i = 0; i < 20; ++i) {
      flood[i].set_source_device(0);
      flood[i].set_op_id((uint64_t{1} << 61) + static_cast<uint64_t>(i));  // ops nobody will start
      flood[i].set_data(std::string(1 << 20, 'f'));
    }
    EXPECT_TRUE(exchange_stream((*devices)[0].address, "", {0, self->epoch(), self->incarnation()}, flood).ok());
  }
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  pb::WorkerStats stats;
  ASSERT_TRUE(worker->GetStats(&ctx, {}, &stats).ok());
  const int64_t held = stats.collective_bytes_pending() >> 20;
  EXPECT_GE(held, 1);
  EXPECT_LE(held, 3) << "more than the share";
  EXPECT_EQ(stats.collective_bytes_pending(), held << 20);
  EXPECT_EQ(stats.exchange_messages_dropped() + held, 20) << "a message neither held nor counted";
  EXPECT_EQ(stats.bytes_used(), x0_.nbytes() / kWorkers + held * ((1 << 20) + Transport::kHeldMessageBytes))
      << "the mailbox is charged to the memory";
  // After the TTL, the next delivery sweeps them out. A real collective delivers.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllGather;
  spec.groups = {{0, 1}};
  while (absl::Now() < deadline) {
    absl::StatusOr<Array> gathered = run_collective(*x_, spec);
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    absl::StatusOr<HostArray> got = gathered->addressable_shards()[0].data();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t i = 0; i < x0_.size(); ++i) ASSERT_EQ(got->values<float>()[i], x0_.values<float>()[i]);
    grpc::ClientContext again;
    set_deadline(&again, absl::Seconds(10));
    ASSERT_TRUE(worker->GetStats(&again, {}, &stats).ok());
    if (stats.collective_bytes_pending() == 0) break;
    absl::SleepFor(absl::Milliseconds(100));  // polling, bounded: the TTL is 500 ms
  }
  EXPECT_EQ(stats.collective_bytes_pending(), 0);
  EXPECT_EQ(stats.exchange_messages_dropped(), 20);
  // The gathered arrays' deletions go in the background: done once the flush returns (the
  // worker's own GetStats below does not flush, as Client::device_stats does).
  const absl::Status flushed = client_->flush_deletes();
  ASSERT_TRUE(flushed.ok()) << flushed;
  grpc::ClientContext last;
  set_deadline(&last, absl::Seconds(10));
  ASSERT_TRUE(worker->GetStats(&last, {}, &stats).ok());
  EXPECT_EQ(stats.bytes_used(), x0_.nbytes() / kWorkers) << "the mailbox gave its memory back";
}

// The coordinator's channels to the workers are as many as the alive devices, not one per
// address ever seen (issue #17 item 5: "a WorkerChannel per address ever seen"): a device whose
// worker is replaced by one at another address, five times over, leaves no channel to the old
// addresses, and devices marked lost leave none at all. A coordinator and workers in this
// process (a worker restarted under its name gets a new ephemeral port, as a process would);
// the count is the coordinator's gauge tessera_coordinator_worker_channels.
TEST(BoundsWorkerChannels, AReplacedOrLostWorkerLeavesNoChannel) {
  CoordinatorOptions coordinator_options;
  coordinator_options.heartbeat_interval = absl::Milliseconds(100);
  coordinator_options.heartbeat_timeout = absl::Milliseconds(600);
  absl::StatusOr<std::unique_ptr<CoordinatorServer>> coordinator = CoordinatorServer::start(coordinator_options);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  auto gauge_value = [&](const std::string& name) {
    for (const MetricSample& m : (*coordinator)->metrics()) {
      if (m.name == name) return m.value;
    }
    ADD_FAILURE() << "no metric " << name;
    return -1.0;
  };
  auto channels = [&] { return gauge_value("tessera_coordinator_worker_channels"); };
  WorkerOptions options;
  options.coordinator_address = (*coordinator)->address();
  options.memory_bytes = int64_t{16} << 20;
  options.shm = false;
  options.name = "stable";
  options.device_id = 1;
  absl::StatusOr<std::unique_ptr<WorkerServer>> stable = WorkerServer::start(options);
  ASSERT_TRUE(stable.ok()) << stable.status();

  options.name = "replaced";
  options.device_id = 0;
  std::set<std::string> addresses;  // device 0's, one per worker that served it
  std::unique_ptr<WorkerServer> replaced;
  for (int i = 0; i < 5; ++i) {
    if (replaced != nullptr) replaced->shutdown();
    absl::StatusOr<std::unique_ptr<WorkerServer>> w = WorkerServer::start(options);  // returns once registered
    ASSERT_TRUE(w.ok()) << w.status();
    replaced = *std::move(w);
    addresses.insert(replaced->address());
    EXPECT_EQ(channels(), 2) << "after worker " << i << " of device 0, at " << replaced->address();
  }
  EXPECT_GE(addresses.size(), 2u);  // the ports differ (a reuse of one would only weaken the check)

  // The last replacement serves: a device_put over both devices and its fetch are right.
  ConnectOptions connect;
  connect.min_devices = 2;
  absl::StatusOr<Client> client = Client::connect((*coordinator)->address(), connect);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {4, 2});
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<HostArray> got = x->fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == host);
  EXPECT_EQ(channels(), 2);

  // Both workers go: once both devices are marked lost, no channel is left.
  x = absl::CancelledError("dropped");
  client = absl::CancelledError("dropped");
  replaced->shutdown();
  (*stable)->shutdown();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((gauge_value("tessera_coordinator_devices_alive") > 0 || channels() > 0) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));  // polling a state with no change feed
  }
  EXPECT_EQ(gauge_value("tessera_coordinator_devices_alive"), 0);
  EXPECT_EQ(channels(), 0);
  (*coordinator)->shutdown();
}

}  // namespace
}  // namespace tessera

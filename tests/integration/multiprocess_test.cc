// A real cluster: tessera-coordinator and 8 tessera-worker processes on 127.0.0.1 ephemeral
// ports, driven through Client::connect. Every wait has a deadline; teardown kills only the
// processes this test started, by pid.
#include <csignal>

#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/process_cluster_fixture.h"

namespace tessera {
namespace {

using tessera::Subprocess;
using ::testing::AllOf;
using ::testing::HasSubstr;

const std::string kBin = TESSERA_BIN_DIR;

class MultiProcessTest : public ProcessClusterTest {};

TEST_F(MultiProcessTest, RoundTripThenAWorkerDies) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (const PartitionSpec& spec : {P("data", None), P(None, "model"), P("data", "model"), P(Axes{"data", "model"}),
                                    P(Axes{"model", "data"}), P()}) {
    SCOPED_TRACE(spec.to_string());
    const HostArray host = HostArray::arange(DType::kF64, {16, 8});
    absl::StatusOr<Array> a = client_->device_put(host, NamedSharding(*mesh, spec));
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<HostArray> back = a->fetch();
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == host);
  }

  // `sharded` has a block only device 7 holds; `elsewhere` lives on devices 0-3 alone;
  // `replicated` has a copy everywhere.
  const HostArray values = HostArray::arange(DType::kI32, {16, 8});
  absl::StatusOr<Array> sharded = client_->device_put(values, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::StatusOr<Mesh> low = client_->make_mesh({2, 2}, {"a", "b"}, {0, 1, 2, 3});
  ASSERT_TRUE(low.ok());
  absl::StatusOr<Array> elsewhere = client_->device_put(values, NamedSharding(*low, P("a", "b")));
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  absl::StatusOr<Array> replicated = client_->device_put(values, NamedSharding(*mesh, P()));
  ASSERT_TRUE(replicated.ok()) << replicated.status();

  workers_[7]->kill();

  const absl::Time start = absl::Now();
  absl::StatusOr<HostArray> lost = sharded->fetch();
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(lost.ok());
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kUnavailable) << lost.status();
  EXPECT_THAT(std::string(lost.status().message()), HasSubstr("device 7"));
  EXPECT_LT(took, absl::Seconds(10));

  absl::StatusOr<HostArray> kept = elsewhere->fetch();
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(*kept == values);
  absl::StatusOr<HostArray> copy = replicated->fetch();
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(*copy == values);

  // A new array that needs device 7 fails naming it, and leaves nothing behind elsewhere.
  absl::StatusOr<Array> put = client_->device_put(values, NamedSharding(*mesh, P("data", "model")));
  ASSERT_FALSE(put.ok());
  EXPECT_THAT(std::string(put.status().message()), HasSubstr("device 7"));
}

TEST_F(MultiProcessTest, CoordinatorMarksASilentWorkerLost) {
  workers_[3]->kill();
  // The coordinator's heartbeat timeout is 1.5 s; a client waiting for 8 alive devices now
  // gets DEADLINE_EXCEEDED, and the topology reports device 3 lost once the timeout passed.
  ConnectOptions options;
  options.min_devices = 8;
  options.timeout = absl::Seconds(3);
  // Wait (bounded) until fewer than 8 are alive: ask for 8 with a short window repeatedly.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool marked_lost = false;
  while (!marked_lost && absl::Now() < deadline) {
    absl::StatusOr<Client> c = Client::connect(address_, options);
    if (c.ok()) continue;  // not yet noticed; connect itself waited up to 3 s
    EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
    absl::StatusOr<std::vector<Device>> devices = client_->devices();
    ASSERT_TRUE(devices.ok());
    EXPECT_FALSE((*devices)[3].alive);
    EXPECT_TRUE((*devices)[2].alive);
    marked_lost = true;
  }
  EXPECT_TRUE(marked_lost);
}

TEST(DaemonFlags, EveryBinaryHasHelp) {
  for (const std::string bin : {"tessera-coordinator", "tessera-worker"}) {
    absl::StatusOr<std::pair<int, std::string>> out = Subprocess::run({kBin + "/" + bin, "--help"}, absl::Seconds(20));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_THAT(out->second, AllOf(HasSubstr("Usage: " + bin), HasSubstr("--port")));
  }
}

TEST(DaemonFlags, WorkerWithoutCoordinatorExplainsWhy) {
  absl::StatusOr<std::pair<int, std::string>> out =
      Subprocess::run({kBin + "/tessera-worker", "--port=0"}, absl::Seconds(20));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->first, 2);
  EXPECT_THAT(out->second, HasSubstr("--coordinator"));
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

TEST_F(MultiProcessTest, ACollectiveFailsBoundedWhenAMemberDiesAndSurvivorsCarryOn) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({8}, {"x"});
  ASSERT_TRUE(mesh.ok());
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllReduce;
  spec.groups = {{0, 1, 2, 3, 4, 5, 6, 7}};
  for (const Shape& shape : {Shape{8, 16}, Shape{8, 1 << 18}}) {  // direct exchange, then ring
    SCOPED_TRACE(shape_to_string(shape));
    absl::StatusOr<Array> x = client_->device_put(HostArray::ones(DType::kF32, shape), NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(x.ok()) << x.status();
    absl::StatusOr<Array> warm = run_collective(*x, spec);  // opens the streams between workers
    ASSERT_TRUE(warm.ok()) << warm.status();
    EXPECT_EQ(warm->fetch()->values<float>()[0], 8.0f);
  }
  absl::StatusOr<Array> x =
      client_->device_put(HostArray::ones(DType::kF32, {8, 1 << 18}), NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();

  workers_[5]->kill();
  const absl::Time start = absl::Now();
  absl::StatusOr<Array> y = run_collective(*x, spec, absl::Seconds(4));
  const absl::Duration took = absl::Now() - start;
  ASSERT_FALSE(y.ok());
  EXPECT_THAT(y.status().code(), AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded));
  EXPECT_THAT(std::string(y.status().message()), HasSubstr("device 5"));
  EXPECT_LT(took, absl::Seconds(10));
  std::printf("collective with a dead member failed after %s: %s\n", absl::FormatDuration(took).c_str(),
              y.status().ToString().c_str());

  // The survivors still run collectives among themselves, and hold nothing from the failure.
  absl::StatusOr<Mesh> rest = client_->make_mesh({4}, {"y"}, {0, 1, 2, 3});
  CollectiveSpec survivors;
  survivors.kind = CollectiveKind::kAllGather;
  survivors.groups = {{0, 1, 2, 3}};
  survivors.dimension = 1;
  absl::StatusOr<Array> z =
      client_->device_put(HostArray::arange(DType::kI32, {4, 1 << 18}), NamedSharding(*rest, P("y")));
  ASSERT_TRUE(z.ok()) << z.status();
  absl::StatusOr<Array> gathered = run_collective(*z, survivors);
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  absl::StatusOr<HostArray> got = gathered->fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->shape(), (Shape{4, 4 << 18}));
  EXPECT_EQ(got->values<int32_t>()[(3 << 18) + 5], (3 << 18) + 5);  // device 0's copy of device 3's block
  for (int d : {0, 1, 2, 3, 4, 6, 7}) {
    absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->collective_messages_pending, 0) << "device " << d;
    EXPECT_FALSE(stats->blas_kernel.empty());
    // The daemon picks the fast kernel itself when the CPU has AVX-512 (see worker/main.cc).
    if (__builtin_cpu_supports("avx512f") && std::getenv("OPENBLAS_CORETYPE") == nullptr) {
      EXPECT_EQ(stats->blas_kernel, "SkylakeX") << "device " << d;
    }
    // x (the failed op's input) on every survivor; z and its gather on 0-3.
    EXPECT_EQ(stats->buffer_count, d < 4 ? 3 : 1) << "device " << d;
  }
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A worker that restarts under the same name gets its device id back and is usable again;
// what it held before is reported lost, naming it, never read as if it were still there.
TEST_F(MultiProcessTest, AWorkerThatRestartsIsUsableAgainAndItsShardsAreReportedLost) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray values = HostArray::arange(DType::kF32, {16, 8});
  absl::StatusOr<Array> sharded = client_->device_put(values, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::StatusOr<Array> replicated = client_->device_put(values, NamedSharding(*mesh, P()));
  ASSERT_TRUE(replicated.ok()) << replicated.status();
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  ASSERT_TRUE(twice({*sharded}).ok());  // every device has the plan now

  // Device 3 restarts: same address, so the same name (the default) and device id.
  absl::StatusOr<std::vector<Device>> devices = client_->devices();
  ASSERT_TRUE(devices.ok());
  const std::string address = (*devices)[3].address;
  workers_[3]->kill();
  absl::StatusOr<std::unique_ptr<Subprocess>> restarted = Subprocess::spawn(
      {kBin + "/tessera-worker", "--coordinator=" + address_, "--port=" + address.substr(address.rfind(':') + 1),
       "--device_id=3", "--memory_bytes=268435456"});
  ASSERT_TRUE(restarted.ok()) << restarted.status();
  workers_[3] = *std::move(restarted);
  ASSERT_TRUE(workers_[3]->read_line_with("device 3 listening on " + address, absl::Seconds(20)).ok());

  absl::StatusOr<HostArray> gone = sharded->fetch();
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_THAT(std::string(gone.status().message()), AllOf(HasSubstr("device 3"), HasSubstr("restarted")));
  // Calls are asynchronous: the outputs report the failure.
  absl::StatusOr<std::vector<Array>> run = twice({*sharded});
  ASSERT_TRUE(run.ok()) << run.status();
  absl::Status ran = (*run)[0].block_until_ready();
  EXPECT_EQ(ran.code(), absl::StatusCode::kFailedPrecondition) << ran;
  EXPECT_THAT(std::string(ran.message()), AllOf(HasSubstr("device 3"), HasSubstr("restarted")));
  absl::StatusOr<HostArray> copy = replicated->fetch();  // the other replicas serve it
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_TRUE(*copy == values);

  // The device is usable again: a new array, and the cached program (its plan reloaded there).
  absl::StatusOr<Array> fresh = client_->device_put(values, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::StatusOr<std::vector<Array>> out = twice({*fresh});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> doubled = (*out)[0].fetch();
  ASSERT_TRUE(doubled.ok()) << doubled.status();
  for (int64_t i = 0; i < 128; ++i) ASSERT_EQ(doubled->values<float>()[i], 2.0f * static_cast<float>(i));
}

}  // namespace
}  // namespace tessera

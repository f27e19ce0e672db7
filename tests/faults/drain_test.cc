// A worker sent SIGTERM while a program runs on it, with real processes (issue #19 item 1: a
// drain on SIGTERM, as a pod deletion sends it): the worker reports not ready but keeps
// serving until no run is in flight, so the call in flight finishes with the host's values
// instead of failing; then it exits within its drain timeout, with a non-zero status (stopped,
// not done: what a Job's restartPolicy needs), and the next call needing it fails UNAVAILABLE
// naming it, in bounded time. Every wait has a deadline; teardown kills only
// this test's processes, by pid.
#include <signal.h>
#include <sysexits.h>

#include <cmath>
#include <optional>
#include <random>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"
#include "tests/metrics_scrape.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kDrained = 1;
constexpr int kSteps = 80;
constexpr int64_t kRows = 512, kDim = 512;
// Bounds on a hang, not speed goals: a run here takes a few seconds on 2 shared cores.
constexpr absl::Duration kBound = absl::Seconds(60);

// v <- tanh(v @ w + x), kSteps times from v = x: long enough to be caught in flight, and a
// contraction (|w| is small), so float32 and the double reference agree.
std::vector<Value> chain(const std::vector<Value>& in) {
  Value v = in[0];
  for (int s = 0; s < kSteps; ++s) v = tanh(matmul(v, in[1]) + in[0]);
  return {v};
}

// Rows are independent: the reference computes only `rows` of the result, in double.
std::vector<std::vector<double>> host_chain(const HostArray& x, const HostArray& w, const std::vector<int64_t>& rows) {
  std::vector<std::vector<double>> out;
  for (int64_t i : rows) {
    std::vector<double> v(kDim), next(kDim);
    for (int64_t j = 0; j < kDim; ++j) v[j] = x.values<float>()[i * kDim + j];
    for (int s = 0; s < kSteps; ++s) {
      for (int64_t j = 0; j < kDim; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < kDim; ++k) acc += v[k] * w.values<float>()[k * kDim + j];
        next[j] = std::tanh(acc + x.values<float>()[i * kDim + j]);
      }
      v.swap(next);
    }
    out.push_back(v);
  }
  return out;
}

HostArray uniform(Shape shape, float scale, uint32_t seed) {
  HostArray a(DType::kF32, std::move(shape));
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  for (float& v : a.mutable_values<float>()) v = dist(rng);
  return a;
}

// Rows of device 0's block and of the drained device's.
const std::vector<int64_t> kChecked = {0, 1, kRows / kFaultWorkers* kDrained, kRows / kFaultWorkers* kDrained + 1};

void expect_close(const Array& got, const std::vector<std::vector<double>>& want) {
  absl::StatusOr<HostArray> host = got.fetch();
  ASSERT_TRUE(host.ok()) << host.status();
  for (size_t r = 0; r < kChecked.size(); ++r) {
    for (int64_t j = 0; j < kDim; ++j) {
      ASSERT_NEAR(host->values<float>()[kChecked[r] * kDim + j], want[r][j], 1e-4) << "row " << kChecked[r];
    }
  }
}

// `tessera status` of the cluster at `coordinator` lists every device, kDrained in state
// `drained` and the others alive.
void expect_status_states(const std::string& coordinator, const std::string& token_file, const std::string& drained) {
  absl::StatusOr<std::pair<int, std::string>> shown = Subprocess::run(
      {kBin + "/tessera", "status", "--coordinator=" + coordinator, "--token_file=" + token_file}, absl::Seconds(30));
  ASSERT_TRUE(shown.ok()) << shown.status();
  ASSERT_EQ(shown->first, 0) << shown->second;
  int devices = 0;
  for (absl::string_view line : absl::StrSplit(shown->second, '\n')) {
    // DEVICE ADDRESS STATE ...: the rows whose second word is an address.
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    int id = -1;
    if (words.size() < 3 || !absl::SimpleAtoi(words[0], &id) || words[1].find(':') == std::string::npos) continue;
    EXPECT_EQ(words[2], id == kDrained ? drained : "alive") << line;
    ++devices;
  }
  EXPECT_EQ(devices, kFaultWorkers) << shown->second;
}

// Waits (at most kBound) until the run computing `result` shows as in flight on kDrained.
void wait_until_in_flight(Client& client, const Array& result) {
  const absl::Time start = absl::Now();
  int64_t in_flight = 0;
  while (in_flight == 0 && absl::Now() - start < kBound && !result.is_ready()) {
    absl::StatusOr<DeviceStats> stats = client.device_stats(kDrained);
    ASSERT_TRUE(stats.ok()) << stats.status();
    in_flight = stats->plan_runs_in_flight;
    if (in_flight == 0) absl::SleepFor(absl::Milliseconds(5));  // between polls of a state with no change feed
  }
  ASSERT_EQ(in_flight, 1) << "the run never showed as in flight on device " << kDrained;
}

// The drained worker exits once no run has been in flight for --drain_quiet_ms; the test
// fetches the last run's result from it in that time, a hidden bound on the test's own
// speed: 5 s (200 ms, the default, does not always leave it on a loaded machine).
class DrainTest : public FaultClusterTest {
  std::vector<std::string> drill_worker_flags() const override {
    return {"--drain_quiet_ms=5000", "--drain_timeout_ms=20000"};
  }
};

TEST_F(DrainTest, ARunInFlightAtSigtermFinishesThenTheWorkerExits) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray x = uniform({kRows, kDim}, 1.0f, 1), w = uniform({kDim, kDim}, 1.0f / 32, 2);
  const std::vector<std::vector<double>> want = host_chain(x, w, kChecked);
  absl::StatusOr<Array> xs = client->device_put(x, NamedSharding(*mesh, P("x", None)));  // rows: no collective
  absl::StatusOr<Array> ws = client->device_put(w, NamedSharding(*mesh, P()));
  ASSERT_TRUE(xs.ok() && ws.ok()) << xs.status() << ws.status();
  JitOptions options;
  options.timeout = kBound;
  Jitted f = jit(chain, options);
  absl::StatusOr<std::vector<Array>> first = f({*xs, *ws});  // compiles and loads the plans
  ASSERT_TRUE(first.ok()) << first.status();
  expect_close((*first)[0], want);

  absl::StatusOr<std::vector<Array>> second = f({*xs, *ws});  // returns at once; runs meanwhile
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_NO_FATAL_FAILURE(wait_until_in_flight(*client, (*second)[0]));
  ASSERT_EQ(::kill(cluster_.workers[kDrained]->pid(), SIGTERM), 0);

  // The run in flight finishes, with the same values.
  ASSERT_TRUE((*second)[0].block_until_ready().ok()) << (*second)[0].block_until_ready();
  expect_close((*second)[0], want);
  // Then the worker exits by itself: its stdout closes, and its exit status says it was
  // stopped, not done (EX_TEMPFAIL, as its --help documents): a Kubernetes Job with
  // restartPolicy OnFailure replaces a pod that exits non-zero, and counts one that exits 0 as
  // complete (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle, "Pod phase").
  absl::StatusOr<std::string> line = cluster_.workers[kDrained]->read_line_with("no such line", kBound);
  EXPECT_EQ(line.status().code(), absl::StatusCode::kUnavailable) << line.status();
  absl::StatusOr<int> exit_status = cluster_.workers[kDrained]->wait_for_exit(kBound);
  ASSERT_TRUE(exit_status.ok()) << exit_status.status();
  EXPECT_EQ(*exit_status, EX_TEMPFAIL);
  // And the next call needing it fails, naming it.
  absl::StatusOr<std::vector<Array>> third = f({*xs, *ws});
  absl::Status status = third.ok() ? (*third)[0].block_until_ready() : third.status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("device ", kDrained))) << status;
}

// The other branch of the drain: a run still in flight when --drain_timeout_ms passes fails,
// rather than holding the pod past its grace period (issue #19 item 1: "finish or fail
// in-flight runs"). The run is a while_loop that does not end by itself (i < 2^30 iterations
// of a (64, 512) @ (512, 512) step per device), so it is in flight whatever the machine's
// speed; the worker gives up on it after 300 ms, deregisters and exits EX_TEMPFAIL, and the
// call fails UNAVAILABLE naming the device, in bounded time.
class DrainTimeoutTest : public FaultClusterTest {
  std::vector<std::string> drill_worker_flags() const override {
    return {"--drain_quiet_ms=200", "--drain_timeout_ms=300"};
  }
};

TEST_F(DrainTimeoutTest, ARunStillInFlightWhenTheDrainTimesOutFailsNamingTheDevice) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray x = uniform({kRows, kDim}, 1.0f, 1), w = uniform({kDim, kDim}, 1.0f / 32, 2);
  absl::StatusOr<Array> xs = client->device_put(x, NamedSharding(*mesh, P("x", None)));
  absl::StatusOr<Array> ws = client->device_put(w, NamedSharding(*mesh, P()));
  ASSERT_TRUE(xs.ok() && ws.ok()) << xs.status() << ws.status();
  JitOptions options;
  options.timeout = kBound;
  Jitted endless = jit(
      [](const std::vector<Value>& in) {
        const Value x = in[0], w = in[1];
        std::vector<Value> out =
            while_loop([](const std::vector<Value>& c) { return c[0] < full({}, 1 << 30, DType::kI32); },
                       [&](const std::vector<Value>& c) {
                         return std::vector<Value>{c[0] + 1, tanh(matmul(c[1], w) + x)};
                       },
                       {full({}, 0, DType::kI32), x});
        return std::vector<Value>{out[1]};
      },
      options);
  absl::StatusOr<std::vector<Array>> running = endless({*xs, *ws});
  ASSERT_TRUE(running.ok()) << running.status();
  ASSERT_NO_FATAL_FAILURE(wait_until_in_flight(*client, (*running)[0]));
  const absl::Time sigterm = absl::Now();
  ASSERT_EQ(::kill(cluster_.workers[kDrained]->pid(), SIGTERM), 0);

  absl::StatusOr<int> exit_status = cluster_.workers[kDrained]->wait_for_exit(kBound);
  ASSERT_TRUE(exit_status.ok()) << exit_status.status() << ": the worker outlived its drain timeout";
  EXPECT_EQ(*exit_status, EX_TEMPFAIL);
  const absl::Status failed = (*running)[0].block_until_ready();
  const absl::Duration took = absl::Now() - sigterm;
  RecordProperty("failed_after_sigterm_us", absl::StrCat(absl::ToInt64Microseconds(took)));
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_THAT(std::string(failed.message()), HasSubstr(absl::StrCat("device ", kDrained))) << failed;
  EXPECT_LT(took, kBound);
}

// What the drills below run before and after a device drains: `2x + 1` jitted over an (8, 4)
// array on every device, run once and checked against the host.
class AffineDrill : public FaultClusterTest {
 protected:
  void run_affine() {
    absl::StatusOr<Client> client = connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(*std::move(client));
    absl::StatusOr<Mesh> mesh = client_->make_mesh({kFaultWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    mesh_.emplace(*mesh);
    absl::StatusOr<Array> x = client_->device_put(host_, NamedSharding(*mesh_, P("x")));
    ASSERT_TRUE(x.ok()) << x.status();
    x_.emplace(*x);
    JitOptions options;
    options.timeout = kBound;
    f_.emplace(jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; }, options));
    absl::StatusOr<std::vector<Array>> before = (*f_)({*x_});
    ASSERT_TRUE(before.ok()) << before.status();
    expect_equal((*before)[0], affine(host_, 2, 1));
    before_.emplace(*before);
  }

  const HostArray host_ = HostArray::arange(DType::kF32, {8, 4});
  std::optional<Client> client_;
  std::optional<Mesh> mesh_;
  std::optional<Array> x_;
  std::optional<Jitted> f_;
  std::optional<std::vector<Array>> before_;
};

// A draining worker tells the coordinator at once (its heartbeat says so, sent when SIGTERM
// arrives): the coordinator refuses new Execute, Compile and CreateArray calls that need the
// device, UNAVAILABLE naming it, without waiting for the worker to go, and `tessera status`
// shows it draining. The drain lasts --drain_quiet_ms (no run is in flight), long enough for
// the checks; the worker then exits.
class DrainingRefusedTest : public AffineDrill {
  std::vector<std::string> drill_worker_flags() const override {
    return {"--drain_quiet_ms=15000", "--drain_timeout_ms=30000"};
  }
};

void expect_refused_as_draining(const absl::Status& status, absl::Duration took, const char* call) {
  ::testing::Test::RecordProperty(absl::StrCat(call, "_refused_us"), absl::StrCat(absl::ToInt64Microseconds(took)));
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("device ", kDrained, " (")));
  EXPECT_THAT(std::string(status.message()), HasSubstr("is draining")) << status;
  EXPECT_LT(took, absl::Seconds(5)) << "not refused at once";
}

TEST_F(DrainingRefusedTest, TheCoordinatorSendsADrainingDeviceNoNewWorkAndStatusShowsIt) {
  ASSERT_NO_FATAL_FAILURE(run_affine());
  std::optional<Client>& client = client_;
  std::optional<Mesh>& mesh = mesh_;
  std::optional<Array>& x = x_;
  Jitted& f = *f_;
  std::optional<std::vector<Array>>& before = before_;
  const HostArray& host = host_;
  JitOptions options;
  options.timeout = kBound;

  ASSERT_EQ(::kill(cluster_.workers[kDrained]->pid(), SIGTERM), 0);
  // The coordinator learns it from the heartbeat the drain sends at once.
  auto stub =
      pb::Coordinator::NewStub(make_channel(cluster_.address, std::make_shared<CallIdentity>(credentials_.client)));
  const absl::Time start = absl::Now();
  bool draining = false;
  while (!draining && absl::Now() - start < kBound) {
    pb::Topology topology;
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    const grpc::Status s = stub->GetTopology(&ctx, pb::GetTopologyRequest(), &topology);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (const pb::DeviceInfo& d : topology.devices()) {
      if (d.id() == kDrained) {
        EXPECT_EQ(d.state(), pb::ALIVE);  // it still finishes what it runs
        draining = d.draining();
      } else {
        EXPECT_FALSE(d.draining()) << "device " << d.id();
      }
    }
    if (!draining) absl::SleepFor(absl::Milliseconds(5));  // between polls of a state with no change feed
  }
  ASSERT_TRUE(draining) << "the coordinator never saw device " << kDrained << " draining";
  const absl::Duration noticed = absl::Now() - start;
  EXPECT_LT(noticed, absl::Seconds(5)) << "the drain was announced late";
  RecordProperty("draining_seen_us", absl::StrCat(absl::ToInt64Microseconds(noticed)));

  absl::Time t = absl::Now();
  absl::StatusOr<std::vector<Array>> executed = f({*x});  // Execute of a compiled program
  absl::Status status = executed.ok() ? (*executed)[0].block_until_ready() : executed.status();
  expect_refused_as_draining(status, absl::Now() - t, "execute");
  t = absl::Now();
  Jitted g = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 3.0}; }, options);
  absl::StatusOr<std::vector<Array>> compiled = g({*x});  // Compile
  status = compiled.ok() ? (*compiled)[0].block_until_ready() : compiled.status();
  expect_refused_as_draining(status, absl::Now() - t, "compile");
  t = absl::Now();
  absl::StatusOr<Array> put = client->device_put(host, NamedSharding(*mesh, P("x")));  // CreateArray
  expect_refused_as_draining(put.status(), absl::Now() - t, "device_put");

  // `tessera status` lists it as draining, the others alive.
  expect_status_states(cluster_.address, client_token_file(), "draining");

  // The SDK sees it draining, and a new default mesh leaves it out (as jax.make_mesh takes the
  // devices that can run work): 3 devices make a mesh of the others, which computes right;
  // 4 are not there. GetTopology's wait for alive devices does not count it either.
  absl::StatusOr<std::vector<Device>> seen = client->devices();
  ASSERT_TRUE(seen.ok()) << seen.status();
  ASSERT_EQ(seen->size(), static_cast<size_t>(kFaultWorkers));
  for (const Device& d : *seen) {
    EXPECT_TRUE(d.alive) << d.id;
    EXPECT_EQ(d.draining, d.id == kDrained) << d.id;
  }
  absl::StatusOr<Mesh> others = client->make_mesh({kFaultWorkers - 1}, {"x"});
  ASSERT_TRUE(others.ok()) << others.status();
  std::vector<int> expected_ids;
  for (int id = 0; id < kFaultWorkers; ++id) {
    if (id != kDrained) expected_ids.push_back(id);
  }
  EXPECT_EQ(others->device_ids(), expected_ids);
  const HostArray rows = HostArray::arange(DType::kF32, {6, 4});
  absl::StatusOr<Array> y = client->device_put(rows, NamedSharding(*others, P("x")));
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<std::vector<Array>> on_others = f({*y});
  ASSERT_TRUE(on_others.ok()) << on_others.status();
  expect_equal((*on_others)[0], affine(rows, 2, 1));
  absl::StatusOr<Mesh> all = client->make_mesh({kFaultWorkers}, {"x"});
  EXPECT_EQ(all.status().code(), absl::StatusCode::kInvalidArgument) << all.status();
  EXPECT_THAT(std::string(all.status().message()),
              HasSubstr(absl::StrCat("the cluster has ", kFaultWorkers - 1,
                                     " alive and not draining (draining: ", kDrained, ")")));
  {
    pb::GetTopologyRequest wait_all;
    wait_all.set_min_alive_devices(kFaultWorkers);
    wait_all.set_wait_ms(200);
    pb::Topology topology;
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    const grpc::Status s = stub->GetTopology(&ctx, wait_all, &topology);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_THAT(s.error_message(), AllOf(HasSubstr(absl::StrCat("but ", kFaultWorkers - 1, " are")),
                                         HasSubstr(absl::StrCat("draining: device ", kDrained, " ("))));
  }

  // The drained array is still readable (a fetch is not new work), and the worker then exits.
  expect_equal((*before)[0], affine(host, 2, 1));
  absl::StatusOr<std::string> line = cluster_.workers[kDrained]->read_line_with("no such line", kBound);
  EXPECT_EQ(line.status().code(), absl::StatusCode::kUnavailable) << line.status();
}

// A drained worker deregisters (issue #19): after SIGTERM and its drain, its last heartbeat
// says it leaves, and the coordinator records the device as LEFT, not lost: within a bound
// well under the heartbeat timeout (1.5 s here), the lost-device counter stays at 0 while
// the left one counts it, the state stays LEFT past several heartbeat timeouts (the
// coordinator's loss check runs meanwhile and must not turn it into LOST), and a call needing
// the device fails at once, UNAVAILABLE naming it and saying it left.
class DeregisterTest : public AffineDrill {
  std::vector<std::string> drill_flags() const override {
    std::vector<std::string> flags = kFaultCoordinatorFlags;  // heartbeat timeout 1.5 s
    flags.push_back("--metrics_port=0");
    return flags;
  }
};

TEST_F(DeregisterTest, ADrainedWorkerLeavesAndIsNotCountedLost) {
  const int metrics_port = coordinator_metrics_port();
  ASSERT_GT(metrics_port, 0);
  auto counter = [&](const std::string& series) {
    absl::StatusOr<std::string> scrape = http_get(metrics_port, "/metrics");
    return scrape.ok() ? sample(*scrape, series) : -2;
  };
  ASSERT_NO_FATAL_FAILURE(run_affine());
  std::optional<Array>& x = x_;
  Jitted& f = *f_;
  EXPECT_EQ(counter("tessera_coordinator_devices_lost_total"), 0);
  EXPECT_EQ(counter("tessera_coordinator_devices_left_total"), 0);

  ASSERT_EQ(::kill(cluster_.workers[kDrained]->pid(), SIGTERM), 0);
  const absl::Time signalled = absl::Now();
  auto stub =
      pb::Coordinator::NewStub(make_channel(cluster_.address, std::make_shared<CallIdentity>(credentials_.client)));
  auto state_of_drained = [&]() {
    pb::Topology topology;
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    const grpc::Status s = stub->GetTopology(&ctx, pb::GetTopologyRequest(), &topology);
    EXPECT_TRUE(s.ok()) << s.error_message();
    for (const pb::DeviceInfo& d : topology.devices()) {
      if (d.id() == kDrained) return d.state();
      EXPECT_EQ(d.state(), pb::ALIVE) << "device " << d.id();
    }
    return pb::DEVICE_STATE_INVALID;
  };
  pb::DeviceState state = pb::ALIVE;
  while (state == pb::ALIVE && absl::Now() - signalled < kBound) {
    state = state_of_drained();
    if (state == pb::ALIVE) absl::SleepFor(absl::Milliseconds(5));  // between polls of a state with no change feed
  }
  const absl::Duration left_after = absl::Now() - signalled;
  // LEFT, not LOST: the drain's quiet period (200 ms) and a heartbeat's round trip come well
  // before the 1.5 s after which a silent worker would be marked lost (the state says which
  // came first; the time is only bounded against a hang).
  ASSERT_EQ(state, pb::LEFT) << pb::DeviceState_Name(state) << " after " << left_after;
  EXPECT_LT(left_after, absl::Seconds(5));
  RecordProperty("left_seen_us", absl::StrCat(absl::ToInt64Microseconds(left_after)));
  std::printf("[ timing ] SIGTERM -> device %d LEFT at the coordinator: %s\n", kDrained,
              absl::FormatDuration(left_after).c_str());
  absl::StatusOr<std::string> line = cluster_.workers[kDrained]->read_line_with("no such line", kBound);
  EXPECT_EQ(line.status().code(), absl::StatusCode::kUnavailable) << line.status();

  // A call needing it fails at once, naming it and saying it left.
  const absl::Time t = absl::Now();
  absl::StatusOr<std::vector<Array>> after = f({*x});
  const absl::Status status = after.ok() ? (*after)[0].block_until_ready() : after.status();
  const absl::Duration refused = absl::Now() - t;
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()),
              AllOf(HasSubstr(absl::StrCat("device ", kDrained, " (")), HasSubstr("left the cluster")))
      << status;
  EXPECT_LT(refused, absl::Seconds(5)) << status;
  RecordProperty("refused_us", absl::StrCat(absl::ToInt64Microseconds(refused)));

  // Watched for three heartbeat timeouts from the worker's exit: still LEFT, never LOST.
  const absl::Time watch_end = absl::Now() + absl::Milliseconds(3 * 1500);
  while (absl::Now() < watch_end) {
    ASSERT_EQ(state_of_drained(), pb::LEFT);
    absl::SleepFor(absl::Milliseconds(50));  // an observation window: nothing is awaited
  }
  EXPECT_EQ(counter("tessera_coordinator_devices_lost_total"), 0);
  EXPECT_EQ(counter("tessera_coordinator_devices_left_total"), 1);
  EXPECT_EQ(counter("tessera_coordinator_devices_alive"), kFaultWorkers - 1);

  // `tessera status` shows it left, the others alive.
  expect_status_states(cluster_.address, client_token_file(), "left");
}

// The exit status tells a drain on SIGTERM (stopped from outside: a pod deleted or evicted) from
// one on SIGINT (an interrupt at a terminal): EX_TEMPFAIL and 0, as tessera-worker --help says;
// a plain cluster (no credentials), idle workers.
TEST(DrainExit, SigtermExitsTempfailAndSigintZero) {
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(kBin, 2);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (const auto& [worker, sig, want] : {std::tuple{0, SIGTERM, EX_TEMPFAIL}, std::tuple{1, SIGINT, 0}}) {
    Subprocess& p = *cluster->workers[worker];
    ASSERT_EQ(::kill(p.pid(), sig), 0);
    absl::StatusOr<int> exit_status = p.wait_for_exit(kBound);
    ASSERT_TRUE(exit_status.ok()) << exit_status.status();
    EXPECT_EQ(*exit_status, want) << "after signal " << sig;
  }
  // What the Job controller sees in the container's status: the help says it.
  absl::StatusOr<std::pair<int, std::string>> help = Subprocess::run({kBin + "/tessera-worker", "--help"}, kBound);
  ASSERT_TRUE(help.ok()) << help.status();
  EXPECT_THAT(help->second,
              HasSubstr(absl::StrCat("Exit status: ", EX_TEMPFAIL, " (EX_TEMPFAIL) after a drain on SIGTERM")));
}

}  // namespace
}  // namespace tessera

// A worker sent SIGTERM while a program runs on it, with real processes (issue #19 item 1: a
// drain on SIGTERM, as a pod deletion sends it): the worker reports not ready but keeps
// serving until no run is in flight, so the call in flight finishes with the host's values
// instead of failing; then it exits within its drain timeout, and the next call needing it
// fails UNAVAILABLE naming it, in bounded time. Every wait has a deadline; teardown kills only
// this test's processes, by pid.
#include <signal.h>

#include <cmath>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

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

// The drained worker exits once no run has been in flight for --drain_quiet_ms; the test
// fetches the last run's result from it in that time, which 200 ms (the default) does not
// always leave on a loaded machine.
class DrainTest : public FaultClusterTest {
  std::vector<std::string> drill_worker_flags() const override {
    return {"--drain_quiet_ms=3000", "--drain_timeout_ms=20000"};
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
  const absl::Time start = absl::Now();
  int64_t in_flight = 0;
  while (in_flight == 0 && absl::Now() - start < kBound && !(*second)[0].is_ready()) {
    absl::StatusOr<DeviceStats> stats = client->device_stats(kDrained);
    ASSERT_TRUE(stats.ok()) << stats.status();
    in_flight = stats->plan_runs_in_flight;
    if (in_flight == 0) absl::SleepFor(absl::Milliseconds(5));  // between polls of a state with no change feed
  }
  ASSERT_EQ(in_flight, 1) << "the run never showed as in flight on device " << kDrained;
  ASSERT_EQ(::kill(cluster_.workers[kDrained]->pid(), SIGTERM), 0);

  // The run in flight finishes, with the same values.
  ASSERT_TRUE((*second)[0].block_until_ready().ok()) << (*second)[0].block_until_ready();
  expect_close((*second)[0], want);
  // Then the worker exits by itself: its stdout closes.
  absl::StatusOr<std::string> line = cluster_.workers[kDrained]->read_line_with("no such line", kBound);
  EXPECT_EQ(line.status().code(), absl::StatusCode::kUnavailable) << line.status();
  // And the next call needing it fails, naming it.
  absl::StatusOr<std::vector<Array>> third = f({*xs, *ws});
  absl::Status status = third.ok() ? (*third)[0].block_until_ready() : third.status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr(absl::StrCat("device ", kDrained))) << status;
}

}  // namespace
}  // namespace tessera

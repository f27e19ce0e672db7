// Coordinator kill -9 and restart on the same port, with real processes (issue #17 item 2):
// no id of the old incarnation means anything to the new one, so a client's cached program
// is compiled again (never another client's), its arrays whose buffers survived are adopted
// again, and collectives run (never hang on op ids the workers remember as finished).
// Results are checked against host computations; every wait has a deadline; teardown kills
// only this test's processes, by pid.
#include <cmath>
#include <cstdio>
#include <optional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int kWorkers = kFaultWorkers;

class CoordinatorRestartTest : public FaultClusterTest {};

TEST_F(CoordinatorRestartTest, CachedProgramsNeverRunAnotherClientsProgram) {
  absl::StatusOr<Client> a = connect();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<Mesh> mesh = a->make_mesh({kWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {8, 4});
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  absl::StatusOr<Array> x = a->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  absl::StatusOr<std::vector<Array>> before = f({*x});
  ASSERT_TRUE(before.ok()) << before.status();
  expect_equal((*before)[0], affine(host, 2, 1));

  restart_coordinator();
  // Another client compiles another program first: under the old scheme it got the id the
  // first client has cached.
  absl::StatusOr<Client> b = connect();
  ASSERT_TRUE(b.ok()) << b.status();
  Jitted g = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 3.0 + 7.0}; });
  absl::StatusOr<Array> bx = b->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(bx.ok()) << bx.status();
  absl::StatusOr<std::vector<Array>> other = g({*bx});
  ASSERT_TRUE(other.ok()) << other.status();
  expect_equal((*other)[0], affine(host, 3, 7));

  // The first client's cached program on a new array: its own program, compiled again.
  absl::StatusOr<Array> y = a->device_put(affine(host, 1, 100), NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<std::vector<Array>> after = f({*y});
  ASSERT_TRUE(after.ok()) << after.status();
  expect_equal((*after)[0], affine(affine(host, 1, 100), 2, 1));
  // And on the array put before the restart, whose buffers the workers kept.
  absl::StatusOr<std::vector<Array>> old = f({*x});
  ASSERT_TRUE(old.ok()) << old.status();
  expect_equal((*old)[0], affine(host, 2, 1));
}

TEST_F(CoordinatorRestartTest, CollectivesAndJitCallsRunAgainAndOldArraysAreAdopted) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {8, 4});
  // Every call's devices wait at most 5 s for each other: a collective that hung on op ids the
  // workers remember as finished fails DEADLINE_EXCEEDED, and the result checks catch it.
  JitOptions options;
  options.timeout = absl::Seconds(5);
  auto column_sum = [](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; };
  Jitted total = jit(column_sum, options);  // an all-reduce inside the plan
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllReduce;
  spec.groups = {{0, 1, 2, 3}};
  // Block i of an all-reduce over P("x") rows: the sum of every device's block.
  HostArray reduced_host(DType::kF32, {8, 4});
  for (int64_t i = 0; i < 32; ++i) {
    const int64_t r = (i / 4) % 2, c = i % 4;
    float acc = 0;
    for (int d = 0; d < kWorkers; ++d) acc += host.values<float>()[(2 * d + r) * 4 + c];
    reduced_host.mutable_values<float>()[i] = acc;
  }
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  std::optional<Array> unused = *client->device_put(host, NamedSharding(*mesh, P("x")));
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<std::vector<Array>> t = total({*x});
    ASSERT_TRUE(t.ok()) << t.status();
    expect_equal((*t)[0], column_sums(host));
  }
  absl::StatusOr<Array> reduced = run_collective(*x, spec);
  ASSERT_TRUE(reduced.ok()) << reduced.status();
  expect_equal(*reduced, reduced_host);

  restart_coordinator();
  // The first call right away: the new coordinator waits for the workers to register again.
  const absl::Time restarted = absl::Now();
  absl::StatusOr<Array> z = client->device_put(affine(host, 1, 1), NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(z.ok()) << z.status();
  absl::StatusOr<std::vector<Array>> t = total({*z});
  ASSERT_TRUE(t.ok()) << t.status();
  expect_equal((*t)[0], column_sums(affine(host, 1, 1)));
  std::printf("[ timing ] coordinator restart -> first successful call (device_put + jit with an all-reduce) %s\n",
              absl::FormatDuration(absl::Now() - restarted).c_str());

  // Arrays from before the restart are adopted again: by a jit call, a collective, a fetch.
  absl::StatusOr<std::vector<Array>> again = total({*x});
  ASSERT_TRUE(again.ok()) << again.status();
  expect_equal((*again)[0], column_sums(host));
  absl::StatusOr<Array> reduced_again = run_collective(*x, spec);
  ASSERT_TRUE(reduced_again.ok()) << reduced_again.status();
  expect_equal(*reduced_again, reduced_host);
  expect_equal(*reduced, reduced_host);
  // Another client compiling the same program gets other execution ids: its collectives run
  // (they used to wait for messages the workers dropped as an old op's).
  absl::StatusOr<Client> other = connect();
  ASSERT_TRUE(other.ok()) << other.status();
  absl::StatusOr<Array> ox = other->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(ox.ok()) << ox.status();
  Jitted other_total = jit(column_sum, options);
  absl::StatusOr<std::vector<Array>> ot = other_total({*ox});
  ASSERT_TRUE(ot.ok()) << ot.status();
  expect_equal((*ot)[0], column_sums(host));

  // An array from before the restart that nobody adopted is freed on every worker when dropped.
  std::vector<int64_t> held;
  for (int d = 0; d < kWorkers; ++d) held.push_back(client->device_stats(d)->buffer_count);
  unused.reset();
  for (int d = 0; d < kWorkers; ++d) EXPECT_EQ(client->device_stats(d)->buffer_count, held[d] - 1) << "device " << d;
}

// A chain of calls sent at once (each naming the previous one's output before its reply came)
// when the coordinator dies: every link either fails, naming why, or holds exactly its host
// value; none runs against another program's outputs. Chains sent afterwards are right.
TEST_F(CoordinatorRestartTest, AChainInFlightFailsOrIsRightAndNeverRunsAgainstOtherOutputs) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  constexpr int64_t n = 512;
  HostArray eye = HostArray::zeros(DType::kF32, {n, n});
  for (int64_t i = 0; i < n; ++i) eye.mutable_values<float>()[i * n + i] = 1.0f;
  const HostArray host = affine(HostArray::arange(DType::kF32, {n, n}), 1.0f / (n * n), -0.5f);
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  absl::StatusOr<Array> w = client->device_put(eye, NamedSharding(*mesh, P()));
  ASSERT_TRUE(x.ok() && w.ok());
  // Slow: 8 (128, 512) x (512, 512) matmuls per device; with w the identity, tanh 8 times.
  Jitted slow = jit([](const std::vector<Value>& in) {
    Value y = in[0];
    for (int i = 0; i < 8; ++i) y = tanh(matmul(y, in[1]));
    return std::vector<Value>{y};
  });
  Jitted twice = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; });
  HostArray head_host(DType::kF32, {n, n});
  for (int64_t i = 0; i < n * n; ++i) {
    float y = host.values<float>()[i];
    for (int k = 0; k < 8; ++k) y = std::tanh(y);
    head_host.mutable_values<float>()[i] = y;
  }
  ASSERT_TRUE(twice({*x}).ok());
  absl::StatusOr<std::vector<Array>> head = slow({*x, *w});
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<Array> chain = {(*head)[0]};
  for (int i = 0; i < 8; ++i) {
    absl::StatusOr<std::vector<Array>> next = twice({chain.back()});
    ASSERT_TRUE(next.ok()) << next.status();
    chain.push_back((*next)[0]);
  }
  EXPECT_FALSE(chain.back().is_ready());
  restart_coordinator();
  HostArray want = head_host.clone();
  for (size_t k = 0; k < chain.size(); ++k) {
    absl::StatusOr<HostArray> got = chain[k].fetch();
    if (got.ok()) {
      ASSERT_EQ(got->shape(), want.shape());
      for (int64_t i = 0; i < n * n; ++i) {
        const float v = want.values<float>()[i];
        ASSERT_NEAR(got->values<float>()[i], v, 1e-5 * (1 + std::abs(v))) << "link " << k << ", element " << i;
      }
    } else {
      EXPECT_THAT(got.status().code(),
                  testing::AnyOf(absl::StatusCode::kUnavailable, absl::StatusCode::kAborted,
                                 absl::StatusCode::kCancelled, absl::StatusCode::kFailedPrecondition))
          << "link " << k << ": " << got.status();
      if (k > 0 && !chain[k - 1].block_until_ready().ok()) {
        EXPECT_THAT(std::string(got.status().message()), HasSubstr("output of a failed call")) << "link " << k;
      }
    }
    want = affine(want, 2, 0);
  }
  // Another client's program on the new coordinator, then this client's chain again.
  absl::StatusOr<Client> other = connect();
  ASSERT_TRUE(other.ok()) << other.status();
  Jitted g = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 3.0 + 7.0}; });
  absl::StatusOr<Array> ox = other->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(ox.ok()) << ox.status();
  absl::StatusOr<std::vector<Array>> og = g({*ox});
  ASSERT_TRUE(og.ok()) << og.status();
  absl::StatusOr<Array> fresh = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  Array last = *fresh;
  for (int i = 0; i < 6; ++i) {
    absl::StatusOr<std::vector<Array>> next = twice({last});
    ASSERT_TRUE(next.ok()) << next.status();
    last = (*next)[0];
  }
  expect_equal(last, affine(host, 64, 0));
  expect_equal((*og)[0], affine(host, 3, 7));
}

// A worker that restarted too lost its shards: the arrays that had one there fail precisely,
// naming the array and the device, and new arrays work.
TEST_F(CoordinatorRestartTest, AnArrayWhoseShardsAreGoneFailsNamingTheArrayAndTheDevice) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {8, 4});
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_TRUE(f({*x}).ok());
  const std::string address = (*client->devices())[3].address;

  cluster_.workers[3]->kill();
  restart_coordinator();
  absl::StatusOr<std::unique_ptr<Subprocess>> worker = Subprocess::spawn(
      {kBin + "/tessera-worker", "--coordinator=" + cluster_.address,
       "--port=" + address.substr(address.rfind(':') + 1), "--device_id=3", "--credentials=" + credentials_dir_});
  ASSERT_TRUE(worker.ok()) << worker.status();
  cluster_.workers[3] = *std::move(worker);
  ASSERT_TRUE(cluster_.workers[3]->read_line_with("listening on", absl::Seconds(20)).ok());

  absl::StatusOr<HostArray> gone = x->fetch();
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition) << gone.status();
  EXPECT_THAT(std::string(gone.status().message()), AllOf(HasSubstr(absl::StrCat("array ", x->id())),
                                                          HasSubstr("device 3"), HasSubstr("put the array again")));
  absl::StatusOr<std::vector<Array>> run = f({*x});
  ASSERT_TRUE(run.ok()) << run.status();
  absl::Status ran = (*run)[0].block_until_ready();
  EXPECT_EQ(ran.code(), absl::StatusCode::kFailedPrecondition) << ran;
  EXPECT_THAT(std::string(ran.message()), AllOf(HasSubstr(absl::StrCat("array ", x->id())), HasSubstr("device 3")));

  absl::StatusOr<Array> fresh = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  absl::StatusOr<std::vector<Array>> out = f({*fresh});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_equal((*out)[0], affine(host, 2, 1));
}

}  // namespace
}  // namespace tessera

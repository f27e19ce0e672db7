// Leases, with real processes (issue #17 item 4): a client process killed (kill -9) while it
// holds arrays and a program stops renewing its session's lease; once the lease lapses the
// coordinator frees its arrays and programs on every worker, within a bounded time, while a
// live client's arrays stay. After a coordinator restart, what nobody adopts again is
// reclaimed the same way. Workers' buffer and plan counts (GetStats) are the evidence; every
// wait has a deadline; teardown kills only this test's processes, by pid.
#include <cstdio>
#include <optional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

constexpr absl::Duration kLease = absl::Seconds(1);
// A lapse is noticed within a tenth of the lease and its deletions take milliseconds: this is
// a bound on a hang, not a speed goal.
constexpr absl::Duration kReclaimBound = absl::Seconds(10);

class LeaseTest : public FaultClusterTest {
 protected:
  // A live client (the observer) holding an array of its own, and every device's counts then.
  void SetUp() override {
    FaultClusterTest::SetUp();
    if (HasFatalFailure()) return;
    absl::StatusOr<Client> observer = connect();
    ASSERT_TRUE(observer.ok()) << observer.status();
    observer_.emplace(*std::move(observer));
    absl::StatusOr<Mesh> mesh = observer_->make_mesh({kFaultWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    absl::StatusOr<Array> kept = observer_->device_put(values_, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(kept.ok()) << kept.status();
    kept_.emplace(*std::move(kept));
    before_ = counts(*observer_);
  }
  void TearDown() override {
    kept_.reset();
    observer_.reset();
  }

  std::vector<std::string> drill_flags() const override {
    std::vector<std::string> flags = kFaultCoordinatorFlags;
    flags.push_back(absl::StrCat("--lease_timeout_ms=", absl::ToInt64Milliseconds(kLease)));
    return flags;
  }

  // A holder_client process that holds 3 arrays (1 buffer each per device) and 1 plan.
  std::unique_ptr<Subprocess> start_holder() {
    SubprocessOptions options;
    options.pipe_stdin = true;  // it holds until stdin closes (or it is killed)
    absl::StatusOr<std::unique_ptr<Subprocess>> holder =
        Subprocess::spawn({kBin + "/holder_client", "--coordinator=" + cluster_.address,
                           absl::StrCat("--devices=", kFaultWorkers), "--token_file=" + client_token_file()},
                          options);
    EXPECT_TRUE(holder.ok()) << holder.status();
    if (!holder.ok()) return nullptr;
    absl::StatusOr<std::string> line = (*holder)->read_line_with("holding", absl::Seconds(30));
    EXPECT_TRUE(line.ok()) << line.status();
    return *std::move(holder);
  }

  struct Counts {
    int64_t buffers = 0;
    int64_t plans = 0;
  };
  // Every device's buffers and plans (GetStats).
  static std::vector<Counts> counts(const Client& client) {
    std::vector<Counts> out;
    for (int d = 0; d < kFaultWorkers; ++d) {
      absl::StatusOr<DeviceStats> s = client.device_stats(d);
      EXPECT_TRUE(s.ok()) << s.status();
      out.push_back(s.ok() ? Counts{s->buffer_count, s->plans_loaded} : Counts{-1, -1});
    }
    return out;
  }

  // Polls the devices' counts until every device is at most at `want`, or `bound` passes;
  // returns how long it took (InfiniteDuration if it never got there).
  static absl::Duration wait_for_at_most(const Client& client, const std::vector<Counts>& want, absl::Duration bound) {
    const absl::Time start = absl::Now();
    while (absl::Now() - start < bound) {
      const std::vector<Counts> now = counts(client);
      bool done = true;
      for (int d = 0; d < kFaultWorkers; ++d) {
        done = done && now[d].buffers >= 0 && now[d].buffers <= want[d].buffers && now[d].plans <= want[d].plans;
      }
      if (done) return absl::Now() - start;
      absl::SleepFor(absl::Milliseconds(20));  // between polls of a state with no change feed
    }
    return absl::InfiniteDuration();
  }

  const HostArray values_ = HostArray::arange(DType::kI32, {kFaultWorkers, 16});
  std::optional<Client> observer_;
  std::optional<Array> kept_;
  std::vector<Counts> before_;
};

TEST_F(LeaseTest, AKilledClientsArraysAndProgramsAreFreedOnEveryWorker) {
  const std::vector<Counts>& before = before_;
  std::unique_ptr<Subprocess> holder = start_holder();
  ASSERT_NE(holder, nullptr);
  const std::vector<Counts> holding = counts(*observer_);
  for (int d = 0; d < kFaultWorkers; ++d) {
    EXPECT_EQ(holding[d].buffers, before[d].buffers + 3) << "device " << d;
    EXPECT_EQ(holding[d].plans, before[d].plans + 1) << "device " << d;
  }

  holder->kill();
  const absl::Duration took = wait_for_at_most(*observer_, before, kReclaimBound);
  std::printf("[ timing ] client kill -9 -> its arrays and plans freed on every worker: %s (lease %s)\n",
              absl::FormatDuration(took).c_str(), absl::FormatDuration(kLease).c_str());
  EXPECT_LT(took, kReclaimBound);
  const std::vector<Counts> after = counts(*observer_);
  for (int d = 0; d < kFaultWorkers; ++d) {
    EXPECT_EQ(after[d].buffers, before[d].buffers) << "device " << d;
    EXPECT_EQ(after[d].plans, before[d].plans) << "device " << d;
  }
  // The observer's session is renewed: its array outlived several leases.
  expect_equal(*kept_, values_);
}

TEST_F(LeaseTest, AfterACoordinatorRestartWhatNobodyAdoptsIsReclaimedAndTheLiveClientKeepsItsArrays) {
  const std::vector<Counts>& before = before_;
  std::unique_ptr<Subprocess> holder = start_holder();
  ASSERT_NE(holder, nullptr);

  // The holder dies, then the coordinator, before the lease lapses: the new coordinator learns
  // of every buffer from the workers. The observer's renewals take its session over and adopt
  // its array; nobody adopts the holder's.
  holder->kill();
  restart_coordinator();
  absl::StatusOr<Client> again = connect();  // the workers registered again, reporting what they hold
  ASSERT_TRUE(again.ok()) << again.status();
  const absl::Duration took = wait_for_at_most(*observer_, before, kReclaimBound);
  std::printf("[ timing ] coordinator restart -> buffers nobody adopted freed: %s (lease %s)\n",
              absl::FormatDuration(took).c_str(), absl::FormatDuration(kLease).c_str());
  EXPECT_LT(took, kReclaimBound);
  // Reclaimed in the same pass as the holder's buffers had it not been adopted (both were
  // reported by the same registrations): still there, and still right.
  const std::vector<Counts> after = counts(*observer_);
  for (int d = 0; d < kFaultWorkers; ++d) EXPECT_EQ(after[d].buffers, before[d].buffers) << "device " << d;
  expect_equal(*kept_, values_);
}

}  // namespace
}  // namespace tessera

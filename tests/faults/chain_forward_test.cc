// A chained call is forwarded by the coordinator while its producer still runs (issue #18
// item 1: "a call whose inputs are outputs of calls still running is forwarded to the workers
// at once, ordered on each worker's stream, and never waits for a reply on the client").
// Real processes: one worker is stopped (SIGSTOP) so that the producer, an all-reduce over
// every device, cannot end; the call reading its output is sent by the client and forwarded
// by the coordinator all the same (its counter of chained calls grows while the producer has
// not ended) and received by a running worker, where it waits for the producer's output
// (device 0's gauge of waiting runs); once the worker continues, both results equal the host's. The heartbeat
// timeout is 60 s (PeerKilledDrill), so the stopped worker is never marked lost meanwhile.
#include <signal.h>

#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"
#include "tests/metrics_scrape.h"

namespace tessera {
namespace {

class ChainForwardDrill : public PeerKilledDrill {
 protected:
  std::vector<std::string> drill_flags() const override {
    std::vector<std::string> flags = PeerKilledDrill::drill_flags();
    flags.push_back("--metrics_port=0");
    return flags;
  }
  std::vector<std::string> drill_worker_flags() const override { return {"--metrics_port=0"}; }
};

TEST_F(ChainForwardDrill, ACallReadingARunningCallsOutputIsForwardedBeforeThatCallEnds) {
  const int metrics_port = coordinator_metrics_port();
  ASSERT_GT(metrics_port, 0);
  auto chained = [&] {
    absl::StatusOr<std::string> scrape = http_get(metrics_port, "/metrics");
    return scrape.ok() ? sample(*scrape, "tessera_coordinator_chained_calls_total") : -2;
  };
  int worker_port = -1;  // device 0's metrics (never stopped)
  {
    absl::StatusOr<std::string> line = cluster_.workers[0]->read_line_with("metrics on port", absl::Seconds(20));
    ASSERT_TRUE(line.ok() && absl::SimpleAtoi(line->substr(line->rfind(' ') + 1), &worker_port)) << line.status();
  }
  auto waiting = [&] {
    absl::StatusOr<std::string> scrape = http_get(worker_port, "/metrics");
    return scrape.ok() ? sample(*scrape, "tessera_worker_plan_runs_waiting{device=\"0\"}") : -2;
  };

  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {kFaultWorkers, 256});
  const HostArray sums = column_sums(host);
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  // The producer: a sum over the split rows, an all-reduce that needs every device.
  Jitted total = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; });
  Jitted affine_of = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  {
    // Both compiled and their plans loaded on every worker before the stop.
    absl::StatusOr<std::vector<Array>> warm = total({*x});
    ASSERT_TRUE(warm.ok()) << warm.status();
    absl::StatusOr<std::vector<Array>> warm_next = affine_of({(*warm)[0]});
    ASSERT_TRUE(warm_next.ok()) << warm_next.status();
    ASSERT_TRUE((*warm_next)[0].block_until_ready().ok());
  }
  const double before = chained();
  ASSERT_GE(before, 0);

  stopped_ = cluster_.workers[1]->pid();
  ASSERT_TRUE(sigstop_and_wait(stopped_).ok());
  absl::StatusOr<std::vector<Array>> produced = total({*x});
  ASSERT_TRUE(produced.ok()) << produced.status();
  absl::StatusOr<std::vector<Array>> consumed = affine_of({(*produced)[0]});
  ASSERT_TRUE(consumed.ok()) << consumed.status();
  // Forwarded while its producer cannot end (device 1 is stopped): the counter grows.
  EXPECT_TRUE(poll_until([&] { return chained() >= before + 1; }, absl::Seconds(10)))
      << "the chained call was not forwarded while its producer ran; counter " << chained() << ", before " << before;
  // And device 0 received its run, which waits there for the producer's output.
  EXPECT_TRUE(poll_until([&] { return waiting() == 1; }, absl::Seconds(5)))
      << "device 0 did not receive the chained call's run while the producer ran; runs waiting " << waiting();
  EXPECT_FALSE((*produced)[0].is_ready());
  ASSERT_EQ(::kill(stopped_, SIGCONT), 0);
  stopped_ = -1;

  absl::StatusOr<HostArray> got_sums = (*produced)[0].fetch();
  ASSERT_TRUE(got_sums.ok()) << got_sums.status();
  EXPECT_TRUE(*got_sums == sums);
  absl::StatusOr<HostArray> got = (*consumed)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == affine(sums, 2.0f, 1.0f));
  EXPECT_EQ(chained(), before + 1);  // the one chained call, counted once
  EXPECT_EQ(waiting(), 0);
}

}  // namespace
}  // namespace tessera

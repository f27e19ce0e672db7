// The docker-compose topology (deploy/docker-compose.yml) built out of network namespaces:
// one bridge, one namespace per process with its own 10.x address — the coordinator, 8
// workers, and the client — so that nothing can lean on 127.0.0.1. The client reaches the
// cluster through the coordinator's address alone. Then one worker's link is cut: the next
// execution fails within the bound, naming that worker; the link comes back: the worker
// registers again and executions succeed again.
//
// Needs root and ip(8); skipped with the reason otherwise. Every namespace, link and process
// it makes carries this run's name and is removed when the test ends, failed or not.
//
// The daemons run without credentials on the 10.x addresses (--insecure_any_host: the
// namespaces are this test's own); k8s_netns_test runs them across namespaces with TLS.
#include <signal.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/topology.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr int kWorkers = 8;
constexpr int kCoordinatorPort = 5000;
constexpr int kWorkerPort = 6000;
// The coordinator's defaults: workers heartbeat every 0.5 s and are lost after 3 s of silence.
constexpr absl::Duration kHeartbeatTimeout = absl::Seconds(3);
// An execution that needs a worker cut off the network fails within this.
const absl::Duration kFailureBound = kHeartbeatTimeout + absl::Seconds(3);

class NetnsClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);  // a client that died must fail a write, not kill the test
    std::string skip;
    absl::Status error;
    topology_ = make_cluster_topology(kWorkers, &skip, &error);
    if (topology_ == nullptr) GTEST_SKIP() << skip;
    ASSERT_TRUE(error.ok()) << error;
  }

  void TearDown() override {
    // Processes first (by pid, through their handles), then the network they lived in.
    client_.reset();
    workers_.clear();
    coordinator_.reset();
    if (topology_ != nullptr) {
      topology_->remove();
      EXPECT_THAT(topology_->leftovers(), ::testing::IsEmpty());
    }
  }

  std::string bin(const std::string& name) const { return absl::StrCat(TESSERA_BIN_DIR, "/", name); }
  std::string coordinator_address() const { return absl::StrCat(topology_->address(1), ":", kCoordinatorPort); }

  absl::StatusOr<std::unique_ptr<Subprocess>> start_worker(int i) {
    absl::StatusOr<std::unique_ptr<Subprocess>> w = Subprocess::spawn(topology_->in(
        absl::StrCat("w", i),
        {bin("tessera-worker"), "--coordinator=" + coordinator_address(), "--host=" + topology_->address(10 + i),
         absl::StrCat("--port=", kWorkerPort), absl::StrCat("--device_id=", i), absl::StrCat("--name=worker-", i),
         absl::StrCat("--memory_bytes=", 256 << 20), "--insecure_any_host"}));
    return w;
  }

  // Sends one command to the client and returns its one-line answer.
  std::string ask(const std::string& command, absl::Duration timeout) {
    absl::Status sent = client_->write_line(command);
    if (!sent.ok()) return sent.ToString();
    absl::StatusOr<std::string> line = client_->read_line_with("", timeout);
    return line.ok() ? *line : line.status().ToString();
  }

  std::unique_ptr<Topology> topology_;
  std::unique_ptr<Subprocess> coordinator_;
  std::vector<std::unique_ptr<Subprocess>> workers_;
  std::unique_ptr<Subprocess> client_;
};

TEST_F(NetnsClusterTest, ClientAcrossHostsThenAWorkerIsCutOffAndComesBack) {
  absl::StatusOr<std::unique_ptr<Subprocess>> c =
      Subprocess::spawn(topology_->in("c", {bin("tessera-coordinator"), "--host=" + topology_->address(1),
                                            absl::StrCat("--port=", kCoordinatorPort), "--insecure_any_host"}));
  ASSERT_TRUE(c.ok()) << c.status();
  coordinator_ = *std::move(c);
  ASSERT_TRUE(coordinator_->read_line_with("listening on", absl::Seconds(20)).ok());
  for (int i = 0; i < kWorkers; ++i) {
    absl::StatusOr<std::unique_ptr<Subprocess>> w = start_worker(i);
    ASSERT_TRUE(w.ok()) << w.status();
    workers_.push_back(*std::move(w));
  }
  for (int i = 0; i < kWorkers; ++i) {
    absl::StatusOr<std::string> line = workers_[i]->read_line_with("listening on", absl::Seconds(20));
    ASSERT_TRUE(line.ok()) << "worker " << i << ": " << line.status();
    EXPECT_THAT(*line, HasSubstr(absl::StrCat(topology_->address(10 + i), ":", kWorkerPort)));
  }

  // JAX's seed program, from the client's namespace, through the coordinator's address.
  absl::StatusOr<std::pair<int, std::string>> seed = Subprocess::run(
      topology_->in("cl", {bin("example_seed_layer"), "--coordinator=" + coordinator_address()}), absl::Seconds(60));
  ASSERT_TRUE(seed.ok()) << seed.status();
  EXPECT_EQ(seed->first, 0) << seed->second;
  EXPECT_EQ(seed->second, "(16, 4)\nP('data', 'model')\n8 (4, 2)\n");

  // The CLI sees the cluster from there too.
  absl::StatusOr<std::pair<int, std::string>> status = Subprocess::run(
      topology_->in("cl", {bin("tessera"), "status", "--coordinator=" + coordinator_address()}), absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->first, 0) << status->second;
  EXPECT_THAT(status->second, HasSubstr("devices 8 (8 alive)"));
  EXPECT_THAT(status->second, HasSubstr(topology_->address(17) + ":6000"));

  // A collective-heavy program, held by one client process across the cut.
  absl::StatusOr<std::unique_ptr<Subprocess>> client =
      Subprocess::spawn(topology_->in("cl", {bin("cluster_client"), "--coordinator=" + coordinator_address()}),
                        SubprocessOptions{.pipe_stdin = true});
  ASSERT_TRUE(client.ok()) << client.status();
  client_ = *std::move(client);
  const std::string ready = ask("setup", absl::Seconds(60));
  ASSERT_THAT(ready, StartsWith("ready")) << ready;
  EXPECT_THAT(ready, HasSubstr("all_reduce"));
  EXPECT_THAT(ready, HasSubstr("all_to_all"));
  EXPECT_THAT(ready, HasSubstr("all_gather"));
  ASSERT_THAT(ask("run", absl::Seconds(30)), StartsWith("ok"));
  // Each worker is a host of its own here (its network namespace is part of its shared-memory
  // host identity, tessera-worker --shm_host): every collective byte went through gRPC.
  EXPECT_EQ(ask("shm", absl::Seconds(30)), "shm 0");

  // Worker 5's cable is pulled: the next execution fails within the bound, naming it.
  constexpr int kCut = 5;
  ASSERT_TRUE(topology_->set_link(absl::StrCat("w", kCut), false).ok());
  const absl::Time cut = absl::Now();
  const std::string failed = ask("run", kFailureBound + absl::Seconds(10));
  const absl::Duration took = absl::Now() - cut;
  ASSERT_THAT(failed, StartsWith("error")) << failed;
  EXPECT_THAT(failed, HasSubstr(absl::StrCat("device ", kCut, " (", topology_->address(10 + kCut))));
  EXPECT_LE(took, kFailureBound) << failed;
  EXPECT_THAT(failed, HasSubstr("UNAVAILABLE"));

  // While it is cut off, executions fail at once: the device is lost.
  const std::string lost = ask("run", absl::Seconds(10));
  EXPECT_THAT(lost, StartsWith("error"));
  EXPECT_THAT(lost, HasSubstr(absl::StrCat("device ", kCut)));
  EXPECT_THAT(lost, HasSubstr("is lost"));

  // The cable is back: the worker registers again (a new incarnation, the same process and
  // buffers), and the same arrays and program run again.
  ASSERT_TRUE(topology_->set_link(absl::StrCat("w", kCut), true).ok());
  const absl::Time back = absl::Now();
  ASSERT_EQ(ask("wait_devices 8", absl::Seconds(40)), "devices 8");
  std::printf("[ timing ] cut -> failure %s; link up -> 8 devices again %s\n", absl::FormatDuration(took).c_str(),
              absl::FormatDuration(absl::Now() - back).c_str());
  const std::string again = ask("run", absl::Seconds(30));
  EXPECT_THAT(again, StartsWith("ok")) << again;
  EXPECT_THAT(ask("run", absl::Seconds(30)), StartsWith("ok"));

  status = Subprocess::run(topology_->in("cl", {bin("tessera"), "status", "--coordinator=" + coordinator_address()}),
                           absl::Seconds(30));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_THAT(status->second, HasSubstr("devices 8 (8 alive)"));
  // Device 5's row shows its second incarnation.
  bool found = false;
  for (absl::string_view row : absl::StrSplit(status->second, '\n')) {
    std::vector<absl::string_view> cells = absl::StrSplit(row, ' ', absl::SkipEmpty());
    if (cells.size() > 4 && cells[0] == absl::StrCat(kCut) && cells[1] == topology_->address(10 + kCut) + ":6000") {
      found = true;
      EXPECT_EQ(cells[2], "alive") << row;
      EXPECT_EQ(cells[3], "2") << row;
    }
  }
  EXPECT_TRUE(found) << status->second;
}

}  // namespace
}  // namespace tessera

// A fixture with a real cluster: a coordinator and 8 tessera-worker processes on 127.0.0.1
// (fast heartbeats, so a killed worker is marked lost within 1.5 s) and a Client connected to
// it. Tests kill workers by pid through workers_.
//
//   class MyTest : public ProcessClusterTest {};
//   TEST_F(MyTest, X) { workers_[7]->kill(); ... client_->make_mesh(...) ... }
//
// REQUIRES: the test target defines TESSERA_BIN_DIR (where the daemons are built).
#ifndef TESSERA_TESTS_INTEGRATION_PROCESS_CLUSTER_FIXTURE_H_
#define TESSERA_TESTS_INTEGRATION_PROCESS_CLUSTER_FIXTURE_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/subprocess.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {

class ProcessClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<ProcessCluster> cluster =
        ProcessCluster::start(TESSERA_BIN_DIR, 8, {"--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=1500"},
                              {"--memory_bytes=268435456"});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
    address_ = cluster_.address;
    ConnectOptions options;
    options.min_devices = 8;
    options.timeout = absl::Seconds(20);
    absl::StatusOr<Client> client = Client::connect(address_, options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(*std::move(client));
  }
  // The client goes first: it may still be deleting buffers on the workers.
  void TearDown() override { client_.reset(); }

  ProcessCluster cluster_;
  std::vector<std::unique_ptr<Subprocess>>& workers_ = cluster_.workers;
  std::string address_;
  std::optional<Client> client_;
};

}  // namespace tessera

#endif  // TESSERA_TESTS_INTEGRATION_PROCESS_CLUSTER_FIXTURE_H_

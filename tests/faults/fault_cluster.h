// The fault drills' cluster (tests/faults/): a coordinator and kFaultWorkers tessera-worker
// processes on 127.0.0.1 ephemeral ports with fast heartbeats (a silent worker is marked lost
// within 1.5 s), checking credentials (fresh tokens in a directory of the test's own, as
// `tessera credentials` writes them), and the host references their checks use. Tests restart the coordinator on
// its port, and stop, continue, kill and restart workers, by pid.
//
//   class MyDrill : public FaultClusterTest {};
//   TEST_F(MyDrill, X) { absl::StatusOr<Client> c = connect(); restart_coordinator(); ... }
//
// REQUIRES: the test target defines TESSERA_BIN_DIR (where the daemons are built).
#ifndef TESSERA_TESTS_FAULTS_FAULT_CLUSTER_H_
#define TESSERA_TESTS_FAULTS_FAULT_CLUSTER_H_

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/credentials.h"
#include "core/subprocess.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {

inline const std::string kBin = TESSERA_BIN_DIR;
inline constexpr int kFaultWorkers = 4;
inline const std::vector<std::string> kFaultCoordinatorFlags = {"--heartbeat_interval_ms=200",
                                                                "--heartbeat_timeout_ms=1500"};

class FaultClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    credentials_dir_ = absl::StrCat(::testing::TempDir(), "/tessera-credentials-", getpid(), "-",
                                    ::testing::UnitTest::GetInstance()->random_seed(), "-", ++dirs_made_);
    absl::StatusOr<Credentials> credentials = generate_credentials();
    ASSERT_TRUE(credentials.ok()) << credentials.status();
    credentials_ = *credentials;
    if (tls()) {
      ASSERT_TRUE(add_tls(&credentials_, {"127.0.0.1"}, kFaultWorkers).ok());
    }
    ASSERT_TRUE(write_credentials(credentials_dir_, credentials_).ok());
    std::vector<std::string> worker_flags = drill_worker_flags();
    worker_flags.push_back("--memory_bytes=268435456");
    worker_flags.push_back("--credentials=" + credentials_dir_);
    absl::StatusOr<ProcessCluster> cluster =
        ProcessCluster::start(kBin, kFaultWorkers, coordinator_flags(), worker_flags);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }

  // The coordinator's flags (a drill may add its own), with the credentials.
  virtual std::vector<std::string> drill_flags() const { return kFaultCoordinatorFlags; }
  // Flags a drill adds to every worker's.
  virtual std::vector<std::string> drill_worker_flags() const { return {}; }
  std::vector<std::string> coordinator_flags() const {
    std::vector<std::string> flags = drill_flags();
    flags.push_back("--credentials=" + credentials_dir_);
    return flags;
  }

  ~FaultClusterTest() override { remove_credentials(credentials_dir_); }

  // Whether the daemons serve TLS (a cluster CA of the test's own; mutual TLS between them, each
  // worker with its device's own certificate).
  virtual bool tls() const { return false; }
  // Whether connect()'s clients put and fetch through shared memory (ConnectOptions::
  // shared_memory); false: over gRPC streams, where replicated blocks fan out.
  virtual bool client_shared_memory() const { return true; }

  // The file holding the client token (what a client's --token_file names).
  std::string client_token_file() const { return absl::StrCat(credentials_dir_, "/", kClientTokenFile); }

  // A client of the cluster with `token` (default: the client token), once every device is
  // alive (waits at most 20 s).
  absl::StatusOr<Client> connect(const std::string& token = "") const {
    ConnectOptions options;
    options.min_devices = kFaultWorkers;
    options.timeout = absl::Seconds(20);
    options.token = token.empty() ? credentials_.client : token;
    if (tls()) options.ca_file = absl::StrCat(credentials_dir_, "/", kCaFile);
    options.shared_memory = client_shared_memory();
    return Client::connect(cluster_.address, options);
  }

  // The port of the coordinator's metrics (a drill that adds --metrics_port=0 to its flags),
  // from the line it prints; -1 (and a test failure) if it printed none within 20 s.
  int coordinator_metrics_port() const {
    absl::StatusOr<std::string> line = cluster_.coordinator->read_line_with("metrics on port", absl::Seconds(20));
    int port = -1;
    EXPECT_TRUE(line.ok() && absl::SimpleAtoi(line->substr(line->rfind(' ') + 1), &port)) << line.status();
    return port;
  }

  // kill -9 of the coordinator, and a new one on the same port; returns when it listens.
  void restart_coordinator() {
    cluster_.coordinator->kill();
    std::vector<std::string> argv = {kBin + "/tessera-coordinator",
                                     "--port=" + cluster_.address.substr(cluster_.address.rfind(':') + 1)};
    const std::vector<std::string> flags = coordinator_flags();
    argv.insert(argv.end(), flags.begin(), flags.end());
    absl::StatusOr<std::unique_ptr<Subprocess>> c = Subprocess::spawn(argv);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_.coordinator = *std::move(c);
    ASSERT_TRUE(cluster_.coordinator->read_line_with("listening on " + cluster_.address, absl::Seconds(20)).ok());
  }

  std::string credentials_dir_;
  Credentials credentials_;
  ProcessCluster cluster_;

 private:
  inline static int dirs_made_ = 0;
};

// A drill that stops (SIGSTOP) and kills workers mid-op, with the coordinator's heartbeat
// timeout (60 s) far beyond its bounds, so that what notices a dead peer is the transport, not
// the coordinator. A worker left stopped (stopped_) is resumed at teardown.
class PeerKilledDrill : public FaultClusterTest {
 protected:
  std::vector<std::string> drill_flags() const override {
    return {"--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=60000"};
  }
  void TearDown() override {
    if (stopped_ > 0) ::kill(stopped_, SIGCONT);
  }
  pid_t stopped_ = -1;
};

// Polls `done` every 10 ms until it holds or `timeout` passed (a condition with a deadline,
// not a sleep as synchronisation); returns done().
inline bool poll_until(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (!done() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  return done();
}

// a * x + b, elementwise, for float32 x.
inline HostArray affine(const HostArray& x, float a, float b) {
  HostArray out(DType::kF32, x.shape());
  for (int64_t i = 0; i < num_elements(x.shape()); ++i) out.mutable_values<float>()[i] = a * x.values<float>()[i] + b;
  return out;
}

// The column sums of a float32 matrix (jnp.sum(x, axis=0)).
inline HostArray column_sums(const HostArray& x) {
  const int64_t rows = x.shape()[0], cols = x.shape()[1];
  HostArray out = HostArray::zeros(DType::kF32, {cols});
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out.mutable_values<float>()[j] += x.values<float>()[i * cols + j];
  return out;
}

// Fetches `a` and expects exactly `want`.
inline void expect_equal(const Array& a, const HostArray& want) {
  absl::StatusOr<HostArray> got = a.fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(*got == want);
}

}  // namespace tessera

#endif  // TESSERA_TESTS_FAULTS_FAULT_CLUSTER_H_

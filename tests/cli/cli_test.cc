// bin/tessera: the state file, and up / status / top / run-example / health / down on real daemons
// (127.0.0.1 ephemeral ports, a state file of the test's own); --help and environment
// variables on every binary.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cli/state.h"
#include "core/credentials.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/metrics_scrape.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

const std::string kBin = TESSERA_BIN_DIR;

std::string temp_dir() {
  std::string pattern = ::testing::TempDir() + "tessera-cli-XXXXXX";
  return mkdtemp(pattern.data()) != nullptr ? pattern : "";
}

absl::StatusOr<std::pair<int, std::string>> tessera(std::vector<std::string> args,
                                                    absl::Duration timeout = absl::Seconds(60)) {
  args.insert(args.begin(), kBin + "/tessera");
  return Subprocess::run(args, timeout);
}

TEST(StateFile, RoundTripsAndRejectsGarbageNamingTheLine) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string path = dir + "/sub/state";
  ClusterState state;
  state.coordinator_address = "10.0.0.1:5000";
  state.processes.push_back({"coordinator", {1234, 99}, dir + "/sub/state-coordinator.log"});
  state.processes.push_back({"worker-0", {1235, 100}, dir + "/sub/state worker.log"});
  ASSERT_TRUE(write_state(path, state).ok());
  absl::StatusOr<ClusterState> back = read_state(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->coordinator_address, "10.0.0.1:5000");
  ASSERT_EQ(back->processes.size(), 2u);
  EXPECT_EQ(back->processes[1].role, "worker-0");
  EXPECT_EQ(back->processes[1].process.pid, 1235);
  EXPECT_EQ(back->processes[1].process.start_ticks, 100u);
  EXPECT_EQ(back->processes[1].log, dir + "/sub/state worker.log");

  EXPECT_EQ(read_state(dir + "/none").status().code(), absl::StatusCode::kNotFound);
  std::ofstream(path) << "coordinator_address a:1\nprocess worker-0 -4 1 log\n";
  absl::StatusOr<ClusterState> bad = read_state(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), AllOf(HasSubstr("line 2"), HasSubstr("pid")));
}

TEST(StateFile, AProcessIsNamedByPidAndStartTime) {
  DaemonProcess self{getpid(), process_start_ticks(getpid())};
  EXPECT_NE(self.start_ticks, 0u);
  EXPECT_TRUE(process_running(self));
  DaemonProcess reused = self;
  reused.start_ticks += 1;  // the same pid, another process: never signalled
  EXPECT_FALSE(process_running(reused));
  absl::StatusOr<std::string> how = stop_process(reused, absl::Seconds(1));
  ASSERT_TRUE(how.ok());
  EXPECT_EQ(*how, "not running");
}

TEST(Cli, UpStatusRunExampleHealthDown) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string state_flag = "--state=" + dir + "/state";
  absl::StatusOr<std::pair<int, std::string>> up =
      tessera({"up", "--workers=8", "--memory_bytes=268435456", state_flag});
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_EQ(up->first, 0) << up->second;
  absl::StatusOr<ClusterState> state = read_state(dir + "/state");
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_EQ(state->processes.size(), 9u);
  EXPECT_THAT(up->second, HasSubstr(state->coordinator_address + "\n"));
  for (const StartedProcess& p : state->processes) EXPECT_TRUE(process_running(p.process)) << p.role;

  // A second up refuses while the first cluster runs.
  absl::StatusOr<std::pair<int, std::string>> again = tessera({"up", "--workers=1", state_flag});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->first, 1);
  EXPECT_THAT(again->second, AllOf(HasSubstr("still running"), HasSubstr("tessera down")));

  absl::StatusOr<std::pair<int, std::string>> example = tessera({"run-example", "seed_layer", state_flag});
  ASSERT_TRUE(example.ok()) << example.status();
  EXPECT_EQ(example->first, 0) << example->second;
  EXPECT_EQ(example->second, "(16, 4)\nP('data', 'model')\n8 (4, 2)\n");

  absl::StatusOr<std::pair<int, std::string>> status = tessera({"status", state_flag});
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->first, 0) << status->second;
  EXPECT_THAT(status->second, AllOf(HasSubstr("devices 8 (8 alive)"), HasSubstr("256.0 MiB"), HasSubstr("EXECUTABLE"),
                                    HasSubstr("P('data', 'model')")));
  // The example's executable stays cached on the coordinator, run once, on make_mesh's Explicit axes.
  EXPECT_THAT(status->second, HasSubstr("Mesh('data': 4, 'model': 2, axis_types=(Explicit, Explicit))"));

  // The daemons check the credentials up made: none is refused, the client token accepted.
  const std::string credentials = dir + "/state-credentials";
  EXPECT_THAT(up->second, HasSubstr(credentials + "/client.token"));
  // Each worker has a certificate of its own, naming its device (and the workers started with them).
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(access(absl::StrCat(credentials, "/", device_cert_file(i)).c_str(), F_OK), 0) << i;
  }
  EXPECT_NE(access(absl::StrCat(credentials, "/", device_cert_file(8)).c_str(), F_OK), 0);
  ConnectOptions no_token;
  no_token.token = "not-this-clusters-token";
  no_token.timeout = absl::Seconds(5);
  no_token.ca_file = credentials + "/ca.pem";
  EXPECT_EQ(Client::connect(state->coordinator_address, no_token).status().code(), absl::StatusCode::kUnauthenticated);
  ConnectOptions with_token;
  with_token.token_file = credentials + "/client.token";
  with_token.ca_file = credentials + "/ca.pem";
  absl::StatusOr<Client> client = Client::connect(state->coordinator_address, with_token);
  EXPECT_TRUE(client.ok()) << client.status();
  client = absl::CancelledError("dropped");
  // Over plaintext, a TLS cluster does not answer at all.
  absl::StatusOr<std::pair<int, std::string>> plaintext =
      tessera({"health", "--address=" + state->coordinator_address, "--timeout_s=2"});
  ASSERT_TRUE(plaintext.ok());
  EXPECT_EQ(plaintext->first, 1) << plaintext->second;

  // The daemons serve TLS with the CA up made: health (which needs no token) verifies them.
  absl::StatusOr<std::pair<int, std::string>> health =
      tessera({"health", "--address=" + state->coordinator_address, "--ca_file=" + credentials + "/ca.pem"});
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->first, 0) << health->second;
  EXPECT_THAT(health->second, HasSubstr("serving: " + state->coordinator_address));

  absl::StatusOr<std::pair<int, std::string>> down = tessera({"down", state_flag});
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->first, 0) << down->second;
  for (const StartedProcess& p : state->processes) EXPECT_FALSE(process_running(p.process)) << p.role;
  EXPECT_NE(access((dir + "/state").c_str(), F_OK), 0) << "the state file is removed";
  EXPECT_NE(access(credentials.c_str(), F_OK), 0) << "so are the credentials";
  absl::StatusOr<std::pair<int, std::string>> twice = tessera({"down", state_flag});
  ASSERT_TRUE(twice.ok());
  EXPECT_EQ(twice->first, 1);
  EXPECT_THAT(twice->second, HasSubstr("no state file"));
}

TEST(Cli, CredentialsWritesFreshTokensOnceAndDaemonsReadThem) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  absl::StatusOr<std::pair<int, std::string>> made = tessera({"credentials", dir + "/c"});
  ASSERT_TRUE(made.ok());
  ASSERT_EQ(made->first, 0) << made->second;
  absl::StatusOr<Credentials> c = load_credentials(dir + "/c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->client.size(), 64u);
  EXPECT_NE(c->client, c->admin);
  EXPECT_TRUE(c->tls()) << "a CA and a daemon certificate for 127.0.0.1 and localhost";
  // And one certificate per device 0 .. 7 (the default --devices), each naming its device in a
  // SAN URI (read back with the openssl program, independently of our code), the coordinator's
  // naming none; a worker takes its own, and one with no certificate is refused, naming it.
  ASSERT_EQ(c->devices.size(), 8u);
  for (int device : {0, 7}) {
    absl::StatusOr<std::pair<int, std::string>> text =
        Subprocess::run({"openssl", "x509", "-noout", "-ext", "subjectAltName", "-in",
                         absl::StrCat(dir, "/c/", device_cert_file(device))},
                        absl::Seconds(30));
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_THAT(text->second, AllOf(HasSubstr(absl::StrCat("URI:tessera://device/", device)),
                                    HasSubstr("IP Address:127.0.0.1"), HasSubstr("DNS:localhost")));
    int chosen = device;
    absl::StatusOr<Credentials> own = credentials_for_device(*c, &chosen);
    ASSERT_TRUE(own.ok()) << own.status();
    EXPECT_EQ(own->cert_pem, c->devices.at(device).cert_pem);
    EXPECT_NE(own->cert_pem, c->cert_pem);
    EXPECT_TRUE(own->devices.empty()) << "a worker keeps no other device's key";
  }
  absl::StatusOr<std::pair<int, std::string>> coordinator_san = Subprocess::run(
      {"openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", dir + "/c/daemon.pem"}, absl::Seconds(30));
  ASSERT_TRUE(coordinator_san.ok()) << coordinator_san.status();
  EXPECT_THAT(coordinator_san->second, Not(HasSubstr("URI:")));
  int unknown = 8;
  EXPECT_EQ(credentials_for_device(*c, &unknown).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::pair<int, std::string>> no_certificate = Subprocess::run(
      {kBin + "/tessera-worker", "--coordinator=127.0.0.1:1", "--device_id=8", "--credentials=" + dir + "/c"},
      absl::Seconds(30));
  ASSERT_TRUE(no_certificate.ok()) << no_certificate.status();
  EXPECT_NE(no_certificate->first, 0);
  EXPECT_THAT(no_certificate->second, HasSubstr("no certificate for device 8 (device-8.pem)"));
  absl::StatusOr<std::pair<int, std::string>> again = tessera({"credentials", dir + "/c"});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->first, 1);
  EXPECT_THAT(again->second, HasSubstr("holds credentials already"));
  // --keep_existing (a deployment's every start) keeps them, byte for byte.
  absl::StatusOr<std::pair<int, std::string>> kept = tessera({"credentials", dir + "/c", "--keep_existing"});
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->first, 0) << kept->second;
  EXPECT_THAT(kept->second, HasSubstr("(kept)"));
  absl::StatusOr<Credentials> same = load_credentials(dir + "/c");
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_EQ(same->cluster, c->cluster);
  EXPECT_EQ(same->ca_pem, c->ca_pem);
  // ... but not a broken directory: one token missing is named, not papered over.
  ASSERT_EQ(unlink((dir + "/c/admin.token").c_str()), 0);
  absl::StatusOr<std::pair<int, std::string>> broken = tessera({"credentials", dir + "/c", "--keep_existing"});
  ASSERT_TRUE(broken.ok());
  EXPECT_EQ(broken->first, 1);
  EXPECT_THAT(broken->second, HasSubstr("admin.token"));
  // A daemon refuses a directory without them, naming the file.
  absl::StatusOr<std::pair<int, std::string>> bad =
      Subprocess::run({kBin + "/tessera-coordinator", "--credentials=" + dir + "/none"}, absl::Seconds(30));
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_EQ(bad->first, 2);
  EXPECT_THAT(bad->second, HasSubstr(dir + "/none/cluster.token"));
}

// A Kubernetes init container's job (deploy/k8s/): each daemon's share of the credentials and
// nothing else; a worker serves with only its share, refuses the admin token it does not hold,
// and the files' absence is named, never papered over.
TEST(Cli, SelectCredentialsGivesEachDaemonOnlyItsFiles) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  absl::StatusOr<std::pair<int, std::string>> made = tessera({"credentials", dir + "/all"});
  ASSERT_TRUE(made.ok() && made->first == 0) << made.status() << (made.ok() ? made->second : "");
  auto files = [](const std::string& d) {
    absl::StatusOr<std::pair<int, std::string>> ls = Subprocess::run({"/bin/ls", "-A", d}, absl::Seconds(10));
    return ls.ok() ? std::vector<std::string>(absl::StrSplit(ls->second, '\n', absl::SkipEmpty()))
                   : std::vector<std::string>{ls.status().ToString()};
  };
  absl::StatusOr<std::pair<int, std::string>> worker3 =
      tessera({"select-credentials", "--role=worker", "--device_id=3", dir + "/all", dir + "/w3"});
  ASSERT_TRUE(worker3.ok());
  ASSERT_EQ(worker3->first, 0) << worker3->second;
  EXPECT_THAT(files(dir + "/w3"),
              ElementsAre("ca.pem", "client.token", "cluster.token", "device-3.key", "device-3.pem"));
  absl::StatusOr<Credentials> all = load_credentials(dir + "/all");
  ASSERT_TRUE(all.ok()) << all.status();
  absl::StatusOr<Credentials> own = load_credentials(dir + "/w3", CredentialsHolder::kWorker);
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(own->cluster, all->cluster);
  EXPECT_EQ(own->client, all->client);
  EXPECT_TRUE(own->admin.empty());
  EXPECT_TRUE(own->cert_pem.empty()) << "not the coordinator's certificate";
  ASSERT_EQ(own->devices.size(), 1u);
  EXPECT_EQ(own->devices.at(3).key_pem, all->devices.at(3).key_pem);
  // As the coordinator would load it (every token), it is incomplete, and says what is missing.
  EXPECT_THAT(load_credentials(dir + "/w3").status().message(), HasSubstr("w3/admin.token"));
  // The device from the environment, as a StatefulSet's pod has it.
  absl::StatusOr<std::pair<int, std::string>> ordinal =
      Subprocess::run({"/usr/bin/env", "-i", "POD_NAME=tessera-worker-5", kBin + "/tessera", "select-credentials",
                       "--role=worker", "--device_id_from=ordinal", dir + "/all", dir + "/w5"},
                      absl::Seconds(30));
  ASSERT_TRUE(ordinal.ok());
  ASSERT_EQ(ordinal->first, 0) << ordinal->second;
  EXPECT_THAT(files(dir + "/w5"),
              ElementsAre("ca.pem", "client.token", "cluster.token", "device-5.key", "device-5.pem"));
  absl::StatusOr<std::pair<int, std::string>> coordinator =
      tessera({"select-credentials", "--role=coordinator", dir + "/all", dir + "/c"});
  ASSERT_TRUE(coordinator.ok());
  ASSERT_EQ(coordinator->first, 0) << coordinator->second;
  EXPECT_THAT(files(dir + "/c"),
              ElementsAre("admin.token", "ca.pem", "client.token", "cluster.token", "daemon.key", "daemon.pem"));
  // A device the Secret has no certificate for is named.
  absl::StatusOr<std::pair<int, std::string>> missing =
      tessera({"select-credentials", "--role=worker", "--device_id=9", dir + "/all", dir + "/w9"});
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->first, 1);
  EXPECT_THAT(missing->second, HasSubstr("has no device-9.pem, which the worker of device 9 needs"));

  // A cluster of those shares: worker 3 serves with its own files (TLS, its certificate) and
  // answers the client token; the admin token, which it does not hold, is not one it knows.
  absl::StatusOr<std::unique_ptr<Subprocess>> c =
      Subprocess::spawn({kBin + "/tessera-coordinator", "--port=0", "--credentials=" + dir + "/c"});
  ASSERT_TRUE(c.ok()) << c.status();
  absl::StatusOr<std::string> c_line = (*c)->read_line_with("listening on", absl::Seconds(20));
  ASSERT_TRUE(c_line.ok()) << c_line.status();
  absl::StatusOr<std::unique_ptr<Subprocess>> w =
      Subprocess::spawn({kBin + "/tessera-worker", "--coordinator=" + last_word(*c_line), "--device_id=3",
                         "--credentials=" + dir + "/w3"});
  ASSERT_TRUE(w.ok()) << w.status();
  absl::StatusOr<std::string> w_line = (*w)->read_line_with("device 3 listening on", absl::Seconds(20));
  ASSERT_TRUE(w_line.ok()) << w_line.status();
  auto stats = [&](const std::string& token) {
    auto stub =
        pb::Worker::NewStub(make_channel(last_word(*w_line), std::make_shared<CallIdentity>(token, -1, all->ca_pem)));
    pb::WorkerStats reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    return stub->GetStats(&ctx, pb::GetStatsRequest(), &reply);
  };
  const grpc::Status as_client = stats(all->client);
  EXPECT_TRUE(as_client.ok()) << as_client.error_message();
  const grpc::Status as_admin = stats(all->admin);
  EXPECT_EQ(as_admin.error_code(), grpc::StatusCode::UNAUTHENTICATED) << as_admin.error_message();
  EXPECT_THAT(as_admin.error_message(), HasSubstr("not one of this cluster's credentials"));
  (*w)->kill();
  (*c)->kill();
  for (const char* d : {"/w3", "/w5", "/c", "/all"}) remove_credentials(dir + d);
}

TEST(Cli, HealthOfNothingFailsAndUnknownCommandsAreNamed) {
  absl::StatusOr<std::pair<int, std::string>> health =
      tessera({"health", "--address=127.0.0.1:1", "--timeout_s=1"}, absl::Seconds(30));
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->first, 1);
  absl::StatusOr<std::pair<int, std::string>> unknown = tessera({"upp"});
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(unknown->first, 2);
  EXPECT_THAT(unknown->second, HasSubstr("unknown command 'upp'"));
  absl::StatusOr<std::pair<int, std::string>> no_workers = tessera({"up", "--state=/nonexistent/x/state"});
  ASSERT_TRUE(no_workers.ok());
  EXPECT_THAT(no_workers->second, HasSubstr("--workers must be at least 1, got 0"));
}

// `tessera health` until it exits with `want` (0 serving, 1 not), for at most 15 s; returns
// its last output.
std::string wait_health(const std::vector<std::string>& args, int want) {
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  std::string last;
  while (true) {
    std::vector<std::string> argv = {"health", "--timeout_s=2"};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<std::pair<int, std::string>> h = tessera(argv, absl::Seconds(10));
    last = h.ok() ? absl::StrCat("exit ", h->first, ": ", h->second) : h.status().ToString();
    if ((h.ok() && h->first == want) || absl::Now() >= deadline) return last;
  }
}

// A worker started before its coordinator retries, logging each attempt, and registers once
// the coordinator is there; grpc.health.v1 on the coordinator follows --expected_devices.
TEST(Cli, HealthFollowsRegistrationsAndALateCoordinatorIsWaitedFor) {
  // A free port for the coordinator: the one a first coordinator got, which then goes.
  absl::StatusOr<std::unique_ptr<Subprocess>> first = Subprocess::spawn({kBin + "/tessera-coordinator", "--port=0"});
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<std::string> line = (*first)->read_line_with("listening on", absl::Seconds(20));
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = last_word(*line);
  (*first)->kill();

  // Worker stderr goes to the pipe the test reads.
  auto worker = [&](int id) {
    return Subprocess::spawn({"/bin/sh", "-c", "exec \"$@\" 2>&1", "sh", kBin + "/tessera-worker",
                              "--coordinator=" + address, absl::StrCat("--device_id=", id), "--register_timeout_s=60"});
  };
  absl::StatusOr<std::unique_ptr<Subprocess>> w0 = worker(0);
  ASSERT_TRUE(w0.ok()) << w0.status();
  absl::StatusOr<std::string> retry = (*w0)->read_line_with("registration attempt 2 failed", absl::Seconds(20));
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_THAT(*retry, AllOf(HasSubstr("coordinator " + address), HasSubstr("retrying in 2s")));

  // SIGTERM while waiting (a pod deleted during its long wait) ends the wait at once.
  absl::StatusOr<std::unique_ptr<Subprocess>> doomed = worker(5);
  ASSERT_TRUE(doomed.ok()) << doomed.status();
  ASSERT_TRUE((*doomed)->read_line_with("registration attempt 1 failed", absl::Seconds(20)).ok());
  kill((*doomed)->pid(), SIGTERM);
  absl::StatusOr<std::string> stopped = (*doomed)->read_line_with("stopped while waiting", absl::Seconds(10));
  ASSERT_TRUE(stopped.ok()) << stopped.status();
  EXPECT_THAT(*stopped, HasSubstr("stopped while waiting to register with " + address));

  absl::StatusOr<std::unique_ptr<Subprocess>> coordinator = Subprocess::spawn(
      {kBin + "/tessera-coordinator", "--port=" + address.substr(address.rfind(':') + 1), "--expected_devices=2"});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  ASSERT_TRUE((*coordinator)->read_line_with("listening on " + address, absl::Seconds(20)).ok());
  ASSERT_TRUE((*w0)->read_line_with("device 0 listening on", absl::Seconds(20)).ok());

  // One of two devices: alive, not ready.
  EXPECT_THAT(wait_health({"--address=" + address}, 1),
              AllOf(HasSubstr("NOT_SERVING"), HasSubstr("--expected_devices")));
  EXPECT_THAT(wait_health({"--address=" + address, "--service=liveness"}, 0), HasSubstr("serving: " + address));
  EXPECT_THAT(wait_health({"--address=" + address, "--service=ready"}, 1),
              AllOf(HasSubstr("NOT_FOUND"), HasSubstr("no health service 'ready'")));

  absl::StatusOr<std::unique_ptr<Subprocess>> w1 = worker(1);
  ASSERT_TRUE(w1.ok()) << w1.status();
  absl::StatusOr<std::string> listening = (*w1)->read_line_with("device 1 listening on", absl::Seconds(20));
  ASSERT_TRUE(listening.ok()) << listening.status();
  EXPECT_THAT(wait_health({"--address=" + address}, 0), HasSubstr("serving: " + address));
  EXPECT_THAT(wait_health({"--address=" + last_word(*listening)}, 0), HasSubstr("serving"));

  // A device lost (3 s without heartbeats): not ready again.
  (*w1)->kill();
  EXPECT_THAT(wait_health({"--address=" + address}, 1), HasSubstr("NOT_SERVING"));
}

// Daemons serving TLS answer grpc.health.v1 on a plaintext --health_port too (Kubernetes' gRPC
// probes speak no TLS), following the same readiness, while their main port stays TLS only.
TEST(Cli, APlaintextHealthPortAnswersForATlsDaemon) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  absl::StatusOr<std::pair<int, std::string>> made = tessera({"credentials", dir + "/c"});
  ASSERT_TRUE(made.ok() && made->first == 0) << (made.ok() ? made->second : made.status().ToString());
  const std::string credentials = "--credentials=" + dir + "/c";
  absl::StatusOr<std::unique_ptr<Subprocess>> coordinator = Subprocess::spawn(
      {kBin + "/tessera-coordinator", "--port=0", "--health_port=0", "--expected_devices=1", credentials});
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  absl::StatusOr<std::string> line = (*coordinator)->read_line_with("listening on", absl::Seconds(20));
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = last_word(*line);
  absl::StatusOr<std::string> health_line = (*coordinator)->read_line_with("health checks", absl::Seconds(20));
  ASSERT_TRUE(health_line.ok()) << health_line.status();
  const std::string health = "127.0.0.1:" + last_word(*health_line);
  EXPECT_THAT(wait_health({"--address=" + health, "--service=liveness"}, 0), HasSubstr("serving: " + health));
  EXPECT_THAT(wait_health({"--address=" + health}, 1), HasSubstr("NOT_SERVING"));
  // The main port speaks only TLS: a plaintext probe there gets no answer.
  absl::StatusOr<std::pair<int, std::string>> plain =
      tessera({"health", "--timeout_s=2", "--address=" + address, "--service=liveness"}, absl::Seconds(10));
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->first, 1) << plain->second;

  absl::StatusOr<std::unique_ptr<Subprocess>> worker = Subprocess::spawn(
      {kBin + "/tessera-worker", "--coordinator=" + address, "--device_id=0", "--health_port=0", credentials});
  ASSERT_TRUE(worker.ok()) << worker.status();
  ASSERT_TRUE((*worker)->read_line_with("device 0 listening on", absl::Seconds(20)).ok());
  absl::StatusOr<std::string> worker_health = (*worker)->read_line_with("health checks", absl::Seconds(20));
  ASSERT_TRUE(worker_health.ok()) << worker_health.status();
  EXPECT_THAT(wait_health({"--address=127.0.0.1:" + last_word(*worker_health)}, 0), HasSubstr("serving"));
  EXPECT_THAT(wait_health({"--address=" + health}, 0), HasSubstr("serving: " + health));
}

// Each (series, value) of `expected` is in `scrape`.
void expect_samples(const std::string& scrape, const std::vector<std::pair<std::string, double>>& expected) {
  for (const auto& [series, value] : expected) EXPECT_EQ(sample(scrape, series), value) << series << " in:\n" << scrape;
}

// Scrapes `port` until the sample `series` is `value` (or, with `at_least`, at least `value`),
// for 30 s at most; the failure shows the last scrape. For what a daemon updates after the call
// that caused it returned (deletions are asynchronous; heartbeat ticks).
testing::AssertionResult scrape_until(int port, const std::string& series, double value, bool at_least = false) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::string last;
  while (absl::Now() < deadline) {
    last = http_get(port, "/metrics").value_or("");
    const double v = sample(last, series);
    if (v == value || (at_least && v >= value)) return testing::AssertionSuccess();
    absl::SleepFor(absl::Milliseconds(50));  // a poll interval, bounded by the deadline
  }
  return testing::AssertionFailure() << series << " never became " << (at_least ? "at least " : "") << value << ":\n"
                                     << last;
}

// --metrics_port: each daemon serves Prometheus' text format, and the counters follow the calls.
// The coordinator keeps one program (--max_programs=1), so the second program evicts the first.
// Prometheus' naming conventions (prometheus.io/docs/practices/naming, issue #19 item 4):
// every family in a scrape is `prefix` + snake_case, a counter ends in _total, a histogram
// (a latency or a size) in its base unit _seconds or _bytes, a gauge of bytes in _bytes, and no
// name uses another unit (ms, KiB, MiB). The library's own exposer_* families are left out.
void expect_prometheus_names(const std::string& scrape, const std::string& prefix) {
  int families = 0;
  for (absl::string_view line : absl::StrSplit(scrape, '\n')) {
    if (!absl::StartsWith(line, "# TYPE ")) continue;
    const std::vector<std::string> words = absl::StrSplit(line, ' ');
    ASSERT_EQ(words.size(), 4u) << line;
    const std::string& name = words[2];
    const std::string& kind = words[3];
    SCOPED_TRACE(std::string(line));
    // prometheus-cpp's Exposer adds its own (exposer_scrapes_total, exposer_request_latencies
    // in microseconds, ...): the library's names, not ours.
    if (absl::StartsWith(name, "exposer_")) continue;
    ++families;
    EXPECT_TRUE(absl::StartsWith(name, prefix));
    EXPECT_TRUE(std::all_of(name.begin(), name.end(),
                            [](char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'; }));
    if (kind == "counter") {
      EXPECT_TRUE(absl::EndsWith(name, "_total"));
    }
    if (kind == "histogram") {
      EXPECT_TRUE(absl::EndsWith(name, "_seconds") || absl::EndsWith(name, "_bytes"));
    }
    if (kind == "gauge" && absl::StrContains(name, "bytes")) {
      EXPECT_TRUE(absl::EndsWith(name, "_bytes"));
    }
    for (const char* unit : {"_ms", "_millis", "_kib", "_mib", "_kb", "_mb"}) {
      EXPECT_FALSE(absl::StrContains(name, absl::StrCat(unit, "_")) || absl::EndsWith(name, unit)) << unit;
    }
  }
  EXPECT_GE(families, 10) << scrape;
}

TEST(Cli, DaemonsServePrometheusMetricsThatFollowTheCalls) {
  absl::StatusOr<ProcessCluster> cluster =
      ProcessCluster::start(kBin, 2, {"--metrics_port=0", "--max_programs=1"}, {"--metrics_port=0"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto port_of = [](Subprocess& p) {
    absl::StatusOr<std::string> line = p.read_line_with("metrics on port", absl::Seconds(20));
    int port = -1;
    return line.ok() && absl::SimpleAtoi(last_word(*line), &port) ? port : -1;
  };
  const int coordinator = port_of(*cluster->coordinator);
  const int worker = port_of(*cluster->workers[1]);
  ASSERT_GT(coordinator, 0);
  ASSERT_GT(worker, 0);
  absl::StatusOr<std::string> before = http_get(coordinator, "/metrics");
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_THAT(*before, AllOf(HasSubstr("200 OK"), HasSubstr("# TYPE tessera_coordinator_executions_total counter")));
  EXPECT_EQ(sample(*before, "tessera_coordinator_devices_alive"), 2) << *before;
  EXPECT_EQ(sample(*before, "tessera_coordinator_executions_total{result=\"ok\"}"), 0) << *before;
  EXPECT_EQ(sample(*before, "tessera_coordinator_compile_cache_misses_total"), 0) << *before;
  EXPECT_EQ(sample(*before, "tessera_coordinator_compile_cache_hits_total"), 0) << *before;
  EXPECT_EQ(sample(*before, "tessera_coordinator_compile_seconds_count"), 0) << *before;

  absl::StatusOr<Client> client = Client::connect(cluster->address, {.min_devices = 2});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Array> x = client->device_put(HostArray(DType::kF32, {1024}), NamedSharding(*mesh, P("data")));
  ASSERT_TRUE(x.ok()) << x.status();
  // Buffers and bytes per device: x's shard on each (512 float32).
  absl::StatusOr<std::string> put = http_get(worker, "/metrics");
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(sample(*put, "tessera_worker_buffers{device=\"1\"}"), 1) << *put;
  EXPECT_EQ(sample(*put, "tessera_worker_used_bytes{device=\"1\"}"), 512 * 4) << *put;
  // Two Jitted objects of one program: a miss (one compilation), then a cache hit; three
  // executions.
  auto plus_one = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; };
  Jitted first = jit(plus_one), second = jit(plus_one);
  std::vector<Array> kept;
  for (Jitted* f : {&first, &first, &second}) {
    absl::StatusOr<std::vector<Array>> out = (*f)({*x});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)[0].block_until_ready().ok());
    kept.push_back((*out)[0]);
  }
  absl::StatusOr<std::string> after = http_get(coordinator, "/metrics");
  ASSERT_TRUE(after.ok()) << after.status();
  expect_samples(*after, {{"tessera_coordinator_compilations_total", 1},
                          {"tessera_coordinator_compile_cache_hits_total", 1},
                          {"tessera_coordinator_compile_cache_misses_total", 1},
                          {"tessera_coordinator_compile_seconds_count", 1},
                          {"tessera_coordinator_compile_seconds_bucket{le=\"+Inf\"}", 1},
                          {"tessera_coordinator_compile_cache_evictions_total", 0},
                          {"tessera_coordinator_programs", 1},
                          {"tessera_coordinator_executions_total{result=\"ok\"}", 3},
                          {"tessera_coordinator_executions_total{result=\"error\"}", 0},
                          {"tessera_coordinator_execute_seconds_count", 3},
                          {"tessera_coordinator_execute_seconds_bucket{le=\"+Inf\"}", 3}});
  EXPECT_GT(sample(*after, "tessera_coordinator_compile_seconds_sum"), 0) << *after;
  absl::StatusOr<std::string> w = http_get(worker, "/metrics");
  ASSERT_TRUE(w.ok()) << w.status();
  expect_prometheus_names(*after, "tessera_coordinator_");
  expect_prometheus_names(*w, "tessera_worker_");
  EXPECT_EQ(sample(*w, "tessera_worker_plan_runs_total{device=\"1\"}"), 3) << *w;
  EXPECT_EQ(sample(*w, "tessera_worker_plan_run_seconds_count"), 3) << *w;
  // x's shard and the three outputs' shards (all kept), 512 float32 each.
  EXPECT_EQ(sample(*w, "tessera_worker_used_bytes{device=\"1\"}"), 4 * 512 * 4) << *w;
  EXPECT_EQ(sample(*w, "tessera_worker_buffers{device=\"1\"}"), 4) << *w;
  // The outputs dropped: their buffers are deleted (asynchronously), x's stays.
  kept.clear();
  EXPECT_TRUE(scrape_until(worker, "tessera_worker_used_bytes{device=\"1\"}", 512 * 4));
  EXPECT_TRUE(scrape_until(worker, "tessera_worker_buffers{device=\"1\"}", 1));
  // Anything but GET /metrics is a 404, and the daemon goes on serving (Debian's civetweb used to
  // crash answering such a request itself: core/metrics_server.cc).
  EXPECT_THAT(http_get(worker, "/other").value_or(""), HasSubstr("404 Not Found"));
  EXPECT_THAT(http_request(worker, "POST", "/metrics").value_or(""), HasSubstr("404 Not Found"));
  EXPECT_THAT(http_request(coordinator, "DELETE", "/").value_or(""), HasSubstr("405 Method Not Allowed"));

  // A collective (the sum over the split dimension: an all_reduce of one float32 between the
  // two devices, a binomial tree on the shared-memory table at that size), a fetch, and the
  // shard put above: the worker counts each, labelled as it ran.
  Jitted total = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0])}; });
  absl::StatusOr<std::vector<Array>> s = total({*x});
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE((*s)[0].block_until_ready().ok()) << (*s)[0].block_until_ready();
  ASSERT_TRUE(x->fetch().ok());
  w = http_get(worker, "/metrics");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(sample(*w, "tessera_worker_put_bytes_total{device=\"1\"}"), 512 * 4) << *w;
  EXPECT_EQ(sample(*w, "tessera_worker_fetched_bytes_total{device=\"1\"}"), 512 * 4) << *w;
  const std::string labels = "{device=\"1\",op=\"all_reduce\",algorithm=\"tree\",path=\"shm\"}";
  EXPECT_EQ(sample(*w, "tessera_worker_collectives_total" + labels), 1) << *w;
  EXPECT_EQ(sample(*w, "tessera_worker_collectives_failed_total" + labels), 0) << *w;
  EXPECT_EQ(sample(*w, "tessera_worker_collective_bytes_total" + labels), 4) << *w;
  // Its latency, labelled alike (no device label: a worker process is one device); no series
  // for what never ran.
  const std::string latency = "{op=\"all_reduce\",algorithm=\"tree\",path=\"shm\"";
  EXPECT_EQ(sample(*w, "tessera_worker_collective_seconds_count" + latency + "}"), 1) << *w;
  EXPECT_EQ(sample(*w, "tessera_worker_collective_seconds_bucket" + latency + ",le=\"+Inf\"}"), 1) << *w;
  EXPECT_GT(sample(*w, "tessera_worker_collective_seconds_sum" + latency + "}"), 0) << *w;
  EXPECT_THAT(*w, Not(HasSubstr("tessera_worker_collective_seconds_count{op=\"all_gather\"")));
  EXPECT_THAT(*w, Not(HasSubstr("tessera_worker_collective_seconds_count{op=\"all_reduce\",algorithm=\"ring\"")));
  // The second program evicted the first (--max_programs=1): a miss, a compilation and an
  // eviction more.
  absl::StatusOr<std::string> evicted = http_get(coordinator, "/metrics");
  ASSERT_TRUE(evicted.ok()) << evicted.status();
  expect_samples(*evicted, {{"tessera_coordinator_compile_cache_misses_total", 2},
                            {"tessera_coordinator_compilations_total", 2},
                            {"tessera_coordinator_compile_cache_hits_total", 1},
                            {"tessera_coordinator_compile_cache_evictions_total", 1},
                            {"tessera_coordinator_programs", 1},
                            {"tessera_coordinator_compile_seconds_count", 2}});

  // RPC errors by method and code: a handshake of another protocol version, refused by each
  // daemon with FAILED_PRECONDITION, twice to the coordinator and once to the worker.
  EXPECT_THAT(*w, Not(HasSubstr("tessera_worker_rpc_errors_total{")));
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  auto old_handshake = [](const std::string& address, bool to_worker) {
    auto channel = make_channel(address);
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::HandshakeRequest req;
    req.set_protocol_version(kProtocolVersion - 1);
    pb::HandshakeReply reply;
    return to_worker ? pb::Worker::NewStub(channel)->Handshake(&ctx, req, &reply).error_code()
                     : pb::Coordinator::NewStub(channel)->Handshake(&ctx, req, &reply).error_code();
  };
  EXPECT_EQ(old_handshake(cluster->address, false), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(old_handshake(cluster->address, false), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(old_handshake((*devices)[1].address, true), grpc::StatusCode::FAILED_PRECONDITION);
  const std::string handshake = absl::StrCat("method=\"/", pb::Coordinator::service_full_name(), "/Handshake\"");
  const std::string worker_handshake = absl::StrCat("method=\"/", pb::Worker::service_full_name(), "/Handshake\"");
  absl::StatusOr<std::string> c = http_get(coordinator, "/metrics");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(sample(*c, "tessera_coordinator_rpc_errors_total{" + handshake + ",code=\"FAILED_PRECONDITION\"}"), 2)
      << *c;
  w = http_get(worker, "/metrics");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(
      sample(*w, "tessera_worker_rpc_errors_total{device=\"1\"," + worker_handshake + ",code=\"FAILED_PRECONDITION\"}"),
      1)
      << *w;
}

// A daemon with 64 KiB more of static TLS (tests/cli/tls_ballast.cc, preloaded) still answers
// every request on its metrics port and goes on serving. glibc carves static TLS out of each
// thread's stack, and civetweb gives its threads 100 KiB: with OpenBLAS's 60 KiB there, 1 KiB
// more was enough for the worker to die answering GET /other (SIGSEGV in civetweb's error path).
// The daemons now give such threads at least 1 MiB (core/metrics_server.cc).
TEST(Cli, DaemonsWithMoreThreadLocalDataStillAnswerErrorsOnTheMetricsPort) {
  ASSERT_EQ(setenv("LD_PRELOAD", TESSERA_TLS_BALLAST, 1), 0);
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(kBin, 1, {"--metrics_port=0"}, {"--metrics_port=0"});
  unsetenv("LD_PRELOAD");
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  for (Subprocess* daemon : {cluster->coordinator.get(), cluster->workers[0].get()}) {
    std::ifstream maps(absl::StrCat("/proc/", daemon->pid(), "/maps"));
    const std::string mapped((std::istreambuf_iterator<char>(maps)), std::istreambuf_iterator<char>());
    ASSERT_THAT(mapped, HasSubstr("libtls_ballast.so")) << "pid " << daemon->pid();  // the ballast is in
    absl::StatusOr<std::string> line = daemon->read_line_with("metrics on port", absl::Seconds(20));
    ASSERT_TRUE(line.ok()) << line.status();
    int port = -1;
    ASSERT_TRUE(absl::SimpleAtoi(last_word(*line), &port)) << *line;
    EXPECT_THAT(http_get(port, "/other").value_or(""), HasSubstr("404 Not Found"));
    EXPECT_THAT(http_request(port, "POST", "/metrics").value_or(""), HasSubstr("404 Not Found"));
    EXPECT_THAT(http_request(port, "DELETE", "/").value_or(""), HasSubstr("405 Method Not Allowed"));
    EXPECT_THAT(http_get(port, "/" + std::string(20000, 'a')).value_or(""), HasSubstr("400"));
    absl::StatusOr<std::string> scrape = http_get(port, "/metrics");
    ASSERT_TRUE(scrape.ok()) << "pid " << daemon->pid() << ": " << scrape.status();
    EXPECT_THAT(*scrape, HasSubstr("200 OK"));  // after the errors: still serving
  }
}

// The collective labels follow what each collective used: the path of the worker's transport
// (--shm=false: gRPC) and the algorithm its threshold table picks by size
// (worker/collectives/algorithms.h, kGrpcThresholds: an all_reduce up to 512 KiB is a binomial
// tree, a larger one a ring). Two sums over the split dimension: of an (2, 4) array, an
// all_reduce of 4 float32 per device (16 bytes: tree), and of an (2, 262144) one, 1 MiB per
// device (ring); their values against the host's.
TEST(Cli, CollectiveMetricsNameTheGrpcPathAndTheAlgorithmBySize) {
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(kBin, 2, {}, {"--metrics_port=0", "--shm=false"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::string> line = cluster->workers[0]->read_line_with("metrics on port", absl::Seconds(20));
  int port = -1;
  ASSERT_TRUE(line.ok() && absl::SimpleAtoi(last_word(*line), &port)) << line.status();
  absl::StatusOr<Client> client = Client::connect(cluster->address, {.min_devices = 2});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  Jitted column_sums = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; });
  constexpr int64_t kSmall = 4, kLarge = 262144;
  for (const int64_t cols : {kSmall, kLarge}) {
    // Rows 0..cols-1 and cols..2cols-1: column j sums to cols + 2j, exact in float32.
    absl::StatusOr<Array> x =
        client->device_put(HostArray::arange(DType::kF32, {2, cols}), NamedSharding(*mesh, P("data", None)));
    ASSERT_TRUE(x.ok()) << x.status();
    absl::StatusOr<std::vector<Array>> out = column_sums({*x});
    ASSERT_TRUE(out.ok()) << out.status();
    absl::StatusOr<HostArray> got = (*out)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->values<float>().size(), static_cast<size_t>(cols));
    for (int64_t j = 0; j < cols; ++j) ASSERT_EQ(got->values<float>()[j], static_cast<float>(cols + 2 * j)) << j;
  }
  absl::StatusOr<std::string> w = http_get(port, "/metrics");
  ASSERT_TRUE(w.ok()) << w.status();
  for (const auto& [algorithm, bytes] : {std::pair{"tree", kSmall * 4}, std::pair{"ring", kLarge * 4}}) {
    const std::string labels = absl::StrCat("op=\"all_reduce\",algorithm=\"", algorithm, "\",path=\"grpc\"");
    expect_samples(*w, {{"tessera_worker_collectives_total{device=\"0\"," + labels + "}", 1},
                        {"tessera_worker_collectives_failed_total{device=\"0\"," + labels + "}", 0},
                        {"tessera_worker_collective_bytes_total{device=\"0\"," + labels + "}", bytes},
                        {"tessera_worker_collective_seconds_count{" + labels + "}", 1},
                        {"tessera_worker_collective_seconds_bucket{" + labels + ",le=\"+Inf\"}", 1}});
    EXPECT_GT(sample(*w, "tessera_worker_collective_seconds_sum{" + labels + "}"), 0) << *w;
  }
  EXPECT_THAT(*w, Not(HasSubstr("path=\"shm\""))) << "a collective on the shared-memory path with --shm=false";
  EXPECT_EQ(sample(*w, "tessera_worker_shm_messages_received_total{device=\"0\"}"), 0) << *w;
}

// The coordinator counts registrations (first and again) and devices marked lost: a worker
// stopped past the heartbeat timeout (3 s by default) is lost once, and registers again
// once continued.
TEST(Cli, TheCoordinatorCountsLostDevicesAndRegistrationsAgain) {
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(kBin, 1, {"--metrics_port=0"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::string> line = cluster->coordinator->read_line_with("metrics on port", absl::Seconds(20));
  int port = -1;
  ASSERT_TRUE(line.ok() && absl::SimpleAtoi(last_word(*line), &port)) << line.status();
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_registrations_total{kind=\"first\"}", 1));
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_registrations_total{kind=\"again\"}", 0));
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_devices_lost_total", 0));
  const pid_t worker = cluster->workers[0]->pid();
  ASSERT_TRUE(sigstop_and_wait(worker).ok());
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_devices_lost_total", 1));
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_devices_alive", 0));
  ASSERT_EQ(::kill(worker, SIGCONT), 0);
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_registrations_total{kind=\"again\"}", 1));
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_devices_alive", 1));
  EXPECT_TRUE(scrape_until(port, "tessera_coordinator_registrations_total{kind=\"first\"}", 1));
}

// A worker gives the memory its runs freed back to the kernel once it is idle (core/heap.h,
// --heap_trim_freed_bytes, --heap_trim_quiet_ms), checked on every heartbeat tick (50 ms
// here): not while runs follow each other, though each frees more than the bound, and once
// they stop. No buffer cache, so freed arrays go back to malloc and count.
TEST(Cli, AWorkerTrimsItsHeapOnceIdleAfterItsRunsFreedMemory) {
  constexpr int64_t kBound = int64_t{4} << 20;
  absl::StatusOr<ProcessCluster> cluster =
      ProcessCluster::start(kBin, 1, {"--heartbeat_interval_ms=50"},
                            {"--metrics_port=0", "--buffer_cache_bytes=0",
                             absl::StrCat("--heap_trim_freed_bytes=", kBound), "--heap_trim_quiet_ms=2000"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<std::string> line = cluster->workers[0]->read_line_with("metrics on port", absl::Seconds(20));
  int port = -1;
  ASSERT_TRUE(line.ok() && absl::SimpleAtoi(last_word(*line), &port)) << line.status();
  const std::string idle_trims = "tessera_worker_heap_trims_total{device=\"0\",reason=\"idle\"}";
  const std::string freed = "tessera_worker_freed_bytes_total{device=\"0\"}";
  absl::StatusOr<std::string> start = http_get(port, "/metrics");
  ASSERT_TRUE(start.ok()) << start.status();
  EXPECT_EQ(sample(*start, idle_trims), 0) << *start;
  const double freed_at_start = sample(*start, freed);
  ASSERT_GE(freed_at_start, 0) << *start;

  absl::StatusOr<Client> client = Client::connect(cluster->address, {.min_devices = 1});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({1}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Array> x = client->device_put(HostArray::zeros(DType::kF32, {kBound / 4}), NamedSharding(*mesh, P()));
  ASSERT_TRUE(x.ok()) << x.status();
  // A chain of runs issued back to back, each output (4 MiB) the next one's input and then
  // dropped: the worker always has the next run, and frees at least the bound per run.
  Jitted step = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 0.5 + 1.0}; });
  constexpr int kRuns = 200;
  Array y = *x;
  for (int i = 0; i < kRuns; ++i) {
    absl::StatusOr<std::vector<Array>> out = step({y});
    ASSERT_TRUE(out.ok()) << out.status();
    y = (*out)[0];
  }
  ASSERT_TRUE(y.block_until_ready().ok());
  absl::StatusOr<std::string> busy = http_get(port, "/metrics");
  ASSERT_TRUE(busy.ok()) << busy.status();
  EXPECT_EQ(sample(*busy, "tessera_worker_plan_runs_total{device=\"0\"}"), kRuns) << *busy;
  EXPECT_EQ(sample(*busy, idle_trims), 0) << "a trim between back-to-back runs:\n" << *busy;
  // Every output but the last is freed (deletions are asynchronous), then the worker idles.
  EXPECT_TRUE(scrape_until(port, freed, freed_at_start + (kRuns - 1) * kBound, /*at_least=*/true));
  EXPECT_TRUE(scrape_until(port, idle_trims, 1, /*at_least=*/true));
  absl::StatusOr<std::string> after = http_get(port, "/metrics");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_LT(sample(*after, idle_trims), 10) << *after;  // far fewer than the runs: after them
  EXPECT_GT(sample(*after, "tessera_worker_heap_trimmed_bytes_total{device=\"0\"}"), 0) << *after;
  // The results are still right after the trims: 200 steps of y -> y/2 + 1 from 0 reach 2.
  absl::StatusOr<HostArray> result = y.fetch();
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_FLOAT_EQ(result->values<float>()[0], 2.0f);
}

// status (issue #19 item 6): per device its address, state, incarnation, buffers and bytes used
// against the limit, the programs loaded, plan runs and failures and the last error, in the
// table and as JSON; top: the same every second. The references: the SDK's topology for the
// addresses, and what the test put there (x and the two kept outputs, 4 KiB each per device).
TEST(Cli, StatusShowsRunsAndTheLastErrorPerDeviceAndTopRefreshes) {
  // 1 MiB per device: a program whose 2 MiB output cannot be stored fails on every device.
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(kBin, 2, {}, {"--memory_bytes=1048576"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  absl::StatusOr<Client> client = Client::connect(cluster->address, {.min_devices = 2});
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  HostArray host(DType::kF32, {1024});
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P()));
  ASSERT_TRUE(x.ok()) << x.status();
  Jitted small = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; });
  Jitted big = jit([](const std::vector<Value>& in) { return std::vector<Value>{broadcast_to(in[0], {512, 1024})}; });
  std::vector<Array> kept;  // each run's output stays: 3 buffers of 4 KiB per device
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<std::vector<Array>> out = small({*x});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_TRUE((*out)[0].block_until_ready().ok());
    kept.push_back((*out)[0]);
  }
  absl::StatusOr<std::vector<Device>> devices_seen = client->devices();
  ASSERT_TRUE(devices_seen.ok()) << devices_seen.status();
  ASSERT_EQ(devices_seen->size(), 2u);
  absl::StatusOr<std::vector<Array>> failed = big({*x});
  absl::Status outcome = failed.ok() ? (*failed)[0].block_until_ready() : failed.status();
  ASSERT_EQ(outcome.code(), absl::StatusCode::kResourceExhausted) << outcome;

  absl::StatusOr<std::pair<int, std::string>> table = tessera({"status", "--coordinator=" + cluster->address});
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->first, 0) << table->second;
  EXPECT_THAT(table->second, AllOf(HasSubstr("PROGRAMS"), HasSubstr("RUNS (FAIL)"), HasSubstr("LAST ERROR")));
  int rows = 0;
  for (absl::string_view row : absl::StrSplit(table->second, '\n')) {
    std::vector<absl::string_view> cells = absl::StrSplit(row, ' ', absl::SkipEmpty());
    if (cells.size() < 13 || (cells[0] != "0" && cells[0] != "1")) continue;
    ++rows;
    // DEVICE ADDRESS STATE INC BUFFERS USED / LIMIT(4 words) PROGRAMS RUNS (FAIL) ...
    EXPECT_EQ(cells[1], (*devices_seen)[cells[0] == "0" ? 0 : 1].address) << row;
    EXPECT_EQ(cells[2], "alive") << row;
    EXPECT_EQ(cells[3], "1") << row;  // the first incarnation
    EXPECT_EQ(cells[4], "3") << row;  // buffers
    EXPECT_EQ(absl::StrJoin(cells.begin() + 5, cells.begin() + 10, " "), "12.0 KiB / 1.0 MiB") << row;
    EXPECT_EQ(cells[10], "2") << row;    // both programs loaded
    EXPECT_EQ(cells[11], "3") << row;    // three runs
    EXPECT_EQ(cells[12], "(1)") << row;  // one failed
    // The device's own last error (its GetStats): the worker no longer names itself in it;
    // the coordinator names the device when it passes an error on, and the row is the device.
    EXPECT_THAT(row, HasSubstr("ago: RESOURCE_EXHAUSTED")) << row;
  }
  EXPECT_EQ(rows, 2) << table->second;

  absl::StatusOr<std::pair<int, std::string>> json =
      Subprocess::run({kBin + "/tessera", "status", "--json", "--coordinator=" + cluster->address}, absl::Seconds(30));
  ASSERT_TRUE(json.ok()) << json.status();
  EXPECT_EQ(json->first, 0) << json->second;
  google::protobuf::Struct parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json->second, &parsed).ok()) << json->second;
  const auto& devices = parsed.fields().at("devices").list_value().values();
  ASSERT_EQ(devices.size(), 2);
  for (const auto& d : devices) {
    const auto& info = d.struct_value().fields().at("info").struct_value().fields();
    const int id = static_cast<int>(info.at("id").number_value());
    ASSERT_TRUE(id == 0 || id == 1) << json->second;
    EXPECT_EQ(info.at("address").string_value(), (*devices_seen)[id].address);
    EXPECT_EQ(info.at("state").string_value(), "ALIVE");
    EXPECT_FALSE(info.at("draining").bool_value());
    EXPECT_EQ(info.at("incarnation").string_value(), "1");
    const auto& stats = d.struct_value().fields().at("stats").struct_value().fields();
    EXPECT_EQ(stats.at("buffer_count").string_value(), "3");
    EXPECT_EQ(stats.at("bytes_used").string_value(), "12288");
    EXPECT_EQ(stats.at("memory_limit_bytes").string_value(), "1048576");
    EXPECT_EQ(stats.at("plans_loaded").string_value(), "2");
    EXPECT_EQ(stats.at("plan_runs").string_value(), "3");
    EXPECT_EQ(stats.at("plan_runs_failed").string_value(), "1");
    EXPECT_THAT(stats.at("last_error").string_value(), HasSubstr("RESOURCE_EXHAUSTED"));
  }

  absl::StatusOr<std::pair<int, std::string>> top =
      tessera({"top", "--iterations=2", "--coordinator=" + cluster->address});
  ASSERT_TRUE(top.ok()) << top.status();
  EXPECT_EQ(top->first, 0) << top->second;
  const std::vector<std::string> frames = absl::StrSplit(top->second, "\x1b[H\x1b[2J", absl::SkipEmpty());
  ASSERT_EQ(frames.size(), 2u) << top->second;
  for (const std::string& frame : frames) EXPECT_THAT(frame, HasSubstr("devices 2 (2 alive)"));

  // Without --iterations, top refreshes until interrupted: three frames come (the first at
  // once, then one a second: a deadline of 10 s each), it is still running, and Ctrl-C (SIGINT)
  // ends it.
  absl::StatusOr<std::unique_ptr<Subprocess>> running =
      Subprocess::spawn({kBin + "/tessera", "top", "--coordinator=" + cluster->address});
  ASSERT_TRUE(running.ok()) << running.status();
  for (int frame = 0; frame < 3; ++frame) {
    absl::StatusOr<std::string> devices = (*running)->read_line_with("devices 2 (2 alive)", absl::Seconds(10));
    ASSERT_TRUE(devices.ok()) << "frame " << frame << ": " << devices.status();
    absl::StatusOr<std::string> footer = (*running)->read_line_with("(every 1 s; Ctrl-C to stop)", absl::Seconds(10));
    ASSERT_TRUE(footer.ok()) << "frame " << frame << ": " << footer.status();
  }
  EXPECT_EQ((*running)->wait_for_exit(absl::ZeroDuration()).status().code(), absl::StatusCode::kDeadlineExceeded);
  ASSERT_EQ(::kill((*running)->pid(), SIGINT), 0);
  absl::StatusOr<int> exited = (*running)->wait_for_exit(absl::Seconds(10));
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_EQ(*exited, 128 + SIGINT);
}

// `tessera profile` records whatever the cluster runs meanwhile: here a client's jitted calls
// on the cluster `up` started (TLS and tokens), through the client token.
TEST(Cli, ProfileRecordsARunningClustersTimeline) {
  const std::string dir = temp_dir();
  ASSERT_FALSE(dir.empty());
  const std::string state_flag = "--state=" + dir + "/state";
  absl::StatusOr<std::pair<int, std::string>> no_out = tessera({"profile", state_flag});
  ASSERT_TRUE(no_out.ok());
  EXPECT_EQ(no_out->first, 1);
  EXPECT_THAT(no_out->second, HasSubstr("--out FILE is required"));
  absl::StatusOr<std::pair<int, std::string>> up =
      tessera({"up", "--workers=2", "--memory_bytes=268435456", state_flag});
  ASSERT_TRUE(up.ok()) << up.status();
  ASSERT_EQ(up->first, 0) << up->second;
  absl::StatusOr<ClusterState> state = read_state(dir + "/state");
  ASSERT_TRUE(state.ok()) << state.status();
  ConnectOptions options;
  options.token_file = dir + "/state-credentials/client.token";
  options.ca_file = dir + "/state-credentials/ca.pem";
  options.min_devices = 2;
  absl::StatusOr<Client> client = Client::connect(state->coordinator_address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"data"});
  ASSERT_TRUE(mesh.ok());
  absl::StatusOr<Array> x =
      client->device_put(HostArray::arange(DType::kF32, {8, 4}), NamedSharding(*mesh, P("data", None)));
  ASSERT_TRUE(x.ok()) << x.status();
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(exp(in[0]))}; });
  std::atomic<bool> stop{false};
  std::atomic<int> calls{0};
  std::thread caller([&] {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (!stop.load() && absl::Now() < give_up) {
      absl::StatusOr<std::vector<Array>> y = f({*x});
      if (!y.ok() || !(*y)[0].block_until_ready().ok()) return;
      calls.fetch_add(1);
    }
  });
  const std::string out = dir + "/trace.json";
  absl::StatusOr<std::pair<int, std::string>> profile =
      tessera({"profile", "--duration_ms=1500", "--out=" + out, state_flag});
  stop.store(true);
  caller.join();
  ASSERT_TRUE(profile.ok()) << profile.status();
  ASSERT_EQ(profile->first, 0) << profile->second;
  EXPECT_THAT(profile->second, HasSubstr(out + ".html"));
  EXPECT_GT(calls.load(), 0);
  std::ifstream in(out);
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  google::protobuf::Struct trace;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &trace).ok()) << json.substr(0, 500);
  // Rows for the coordinator and both devices; each device ran the reduction's kernels, the
  // coordinator dispatched the calls (the profile's own client made none).
  std::map<double, std::string> names;
  std::map<std::string, int> spans;  // "pid/cat/name"
  for (const google::protobuf::Value& v : trace.fields().at("traceEvents").list_value().values()) {
    const auto& e = v.struct_value().fields();
    if (e.at("ph").string_value() == "M" && e.at("name").string_value() == "process_name") {
      names[e.at("pid").number_value()] = e.at("args").struct_value().fields().at("name").string_value();
    }
    if (e.at("ph").string_value() == "X") {
      ++spans[absl::StrCat(static_cast<int64_t>(e.at("pid").number_value()), "/", e.at("cat").string_value(), "/",
                           e.at("name").string_value())];
    }
  }
  for (int d = 0; d < 2; ++d) {
    EXPECT_THAT(names[d], HasSubstr(absl::StrCat("device ", d, " (")));
    EXPECT_GT(spans[absl::StrCat(d, "/kernel/exp")], 0) << d;
    EXPECT_GT(spans[absl::StrCat(d, "/plan/plan")], 0) << d;
  }
  EXPECT_GT(spans["1000000/dispatch/execute"], 0);
  EXPECT_EQ(access((out + ".html").c_str(), R_OK), 0);
  absl::StatusOr<std::pair<int, std::string>> down = tessera({"down", state_flag});
  ASSERT_TRUE(down.ok()) << down.status();
  EXPECT_EQ(down->first, 0) << down->second;
}

TEST(Cli, EveryBinaryHasHelpNamingItsEnvironmentVariables) {
  const std::vector<std::pair<std::string, std::string>> binaries = {
      {"tessera", "TESSERA_COORDINATOR"},
      {"tessera-coordinator", "TESSERA_COORDINATOR_PORT"},
      {"tessera-worker", "TESSERA_WORKER_MEMORY_BYTES"},
      {"example_device_put", "TESSERA_COORDINATOR"},
      {"example_seed_layer", "TESSERA_COORDINATOR"},
  };
  for (const auto& [bin, variable] : binaries) {
    absl::StatusOr<std::pair<int, std::string>> out = Subprocess::run({kBin + "/" + bin, "--help"}, absl::Seconds(20));
    ASSERT_TRUE(out.ok()) << bin << ": " << out.status();
    EXPECT_THAT(out->second, HasSubstr(variable)) << bin;
    EXPECT_THAT(out->second, ::testing::Not(HasSubstr("No flags matched"))) << bin;
  }
}

// Issue #19 item 1: a worker keeps retrying its registration "with a configurable wait
// (default >= 10 minutes)": cold starts and pods starting out of order outlast JAX's 300 s
// barrier. The default as the binary itself reports it in --help.
TEST(Cli, AWorkerWaitsAtLeastTenMinutesToRegisterByDefault) {
  absl::StatusOr<std::pair<int, std::string>> out =
      Subprocess::run({kBin + "/tessera-worker", "--help"}, absl::Seconds(20));
  ASSERT_TRUE(out.ok()) << out.status();
  const size_t flag = out->second.find("--register_timeout_s ");
  ASSERT_NE(flag, std::string::npos) << out->second;
  const size_t at = out->second.find("default: ", flag);
  ASSERT_NE(at, std::string::npos) << out->second.substr(flag, 400);
  int64_t seconds = 0;
  ASSERT_TRUE(absl::SimpleAtoi(out->second.substr(at + 9, out->second.find(';', at) - at - 9), &seconds))
      << out->second.substr(flag, 400);
  EXPECT_GE(seconds, 600);
}

TEST(Cli, FlagsComeFromTheEnvironmentAndBadValuesAreNamed) {
  absl::StatusOr<std::pair<int, std::string>> out = Subprocess::run(
      {"/usr/bin/env", "TESSERA_COORDINATOR_PORT=fifty", kBin + "/tessera-coordinator"}, absl::Seconds(20));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->first, 2);
  EXPECT_THAT(out->second, AllOf(HasSubstr("$TESSERA_COORDINATOR_PORT='fifty'"), HasSubstr("--port")));
  // And a good one is used: the worker finds its coordinator in the environment (none runs
  // there, so it gives up after the registration timeout, also from the environment).
  out = Subprocess::run({"/usr/bin/env", "TESSERA_COORDINATOR=127.0.0.1:1", "TESSERA_WORKER_REGISTER_TIMEOUT_S=1",
                         kBin + "/tessera-worker"},
                        absl::Seconds(20));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->first, 1);
  EXPECT_THAT(out->second, HasSubstr("coordinator 127.0.0.1:1"));
}

// Plaintext is for loopback only (issue #17, item 1: "a development flag allows plaintext on
// loopback only, with a warning"): without credentials a daemon refuses any other address,
// naming it and both ways out, before it listens; --insecure_any_host (or its variable) lets it
// listen there, with the warning.
TEST(Cli, DaemonsWithoutCredentialsListenOnLoopbackOnly) {
  const std::string rule = "which is not a loopback address: without credentials every caller is trusted as an admin";
  absl::StatusOr<std::pair<int, std::string>> out =
      Subprocess::run({kBin + "/tessera-coordinator", "--host=0.0.0.0"}, absl::Seconds(20));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->first, 2);
  EXPECT_THAT(out->second, AllOf(HasSubstr("tessera-coordinator: no --credentials, and it would listen on 0.0.0.0"),
                                 HasSubstr(rule), HasSubstr("--credentials=DIR"), HasSubstr("--insecure_any_host")));
  EXPECT_THAT(out->second, Not(HasSubstr("listening on")));
  // A worker checks the address it binds, which --bind_host gives apart from the advertised one.
  out = Subprocess::run({kBin + "/tessera-worker", "--coordinator=127.0.0.1:1", "--bind_host=0.0.0.0"},
                        absl::Seconds(20));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->first, 2);
  EXPECT_THAT(out->second,
              AllOf(HasSubstr("tessera-worker: no --credentials, and it would listen on 0.0.0.0"), HasSubstr(rule)));
  // Allowed by the flag's variable: the worker gets as far as its registration (no coordinator
  // runs at 127.0.0.1:1, so it gives up after the timeout).
  out = Subprocess::run({"/usr/bin/env", "TESSERA_WORKER_INSECURE_ANY_HOST=true", kBin + "/tessera-worker",
                         "--coordinator=127.0.0.1:1", "--bind_host=0.0.0.0", "--register_timeout_s=1"},
                        absl::Seconds(20));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->first, 1);
  EXPECT_THAT(out->second, HasSubstr("coordinator 127.0.0.1:1"));
  EXPECT_THAT(out->second, Not(HasSubstr("no --credentials, and it would listen")));
}

}  // namespace
}  // namespace tessera

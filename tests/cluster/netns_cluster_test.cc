// The docker-compose topology (deploy/docker-compose.yml) built out of network namespaces:
// one bridge, one namespace per process with its own 10.x address — the coordinator, 8
// workers, and the client — so that nothing can lean on 127.0.0.1. The client reaches the
// cluster through the coordinator's address alone. Then one worker's link is cut: the next
// execution fails within the bound, naming that worker; the link comes back: the worker
// registers again and executions succeed again.
//
// Needs root and ip(8); skipped with the reason otherwise. Every namespace, link and process
// it makes carries this run's name and is removed when the test ends, failed or not.
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/status.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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

std::string find_ip() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

// The namespaces, the bridge and the veth pairs of one run, named "tsn<pid>..." so that two
// runs never collide and a run never touches anything else. Removed by the destructor.
class Topology {
 public:
  explicit Topology(std::string ip) : ip_(std::move(ip)), tag_(absl::StrCat("tsn", getpid())) {
    // 10.213.N.0/24, N from the pid: a fresh subnet per concurrent run.
    subnet_ = absl::StrCat("10.213.", getpid() % 250 + 1, ".");
  }
  ~Topology() { remove(); }

  // Host names: "c" (coordinator), "w0".."w7", "cl" (client).
  absl::Status add_host(const std::string& host, int address_suffix) {
    const std::string ns = netns(host), outside = veth(host, 'h'), inside = veth(host, 'n');
    TESSERA_RETURN_IF_ERROR(run({"netns", "add", ns}));
    namespaces_.push_back(ns);
    TESSERA_RETURN_IF_ERROR(run({"link", "add", outside, "type", "veth", "peer", "name", inside}));
    links_.push_back(outside);
    TESSERA_RETURN_IF_ERROR(run({"link", "set", inside, "netns", ns}));
    TESSERA_RETURN_IF_ERROR(run({"link", "set", outside, "master", bridge()}));
    TESSERA_RETURN_IF_ERROR(run({"link", "set", outside, "up"}));
    TESSERA_RETURN_IF_ERROR(run({"-n", ns, "link", "set", "lo", "up"}));
    TESSERA_RETURN_IF_ERROR(run({"-n", ns, "addr", "add", address(address_suffix) + "/24", "dev", inside}));
    TESSERA_RETURN_IF_ERROR(run({"-n", ns, "link", "set", inside, "up"}));
    return absl::OkStatus();
  }

  absl::Status add_bridge() {
    TESSERA_RETURN_IF_ERROR(run({"link", "add", bridge(), "type", "bridge"}));
    links_.push_back(bridge());
    return run({"link", "set", bridge(), "up"});
  }

  // Cuts (or restores) a host's cable: the bridge side of its veth pair goes down (up).
  absl::Status set_link(const std::string& host, bool up) {
    return run({"link", "set", veth(host, 'h'), up ? "up" : "down"});
  }

  std::string address(int suffix) const { return absl::StrCat(subnet_, suffix); }

  // argv run inside `host`'s namespace.
  std::vector<std::string> in(const std::string& host, std::vector<std::string> argv) const {
    std::vector<std::string> out = {ip_, "netns", "exec", netns(host)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

  void remove() {
    for (const std::string& ns : namespaces_) run({"netns", "del", ns}).IgnoreError();
    for (const std::string& link : links_) {
      // A veth pair went with its namespace; the bridge and a surviving host end go here.
      if (access(absl::StrCat("/sys/class/net/", link).c_str(), F_OK) == 0) run({"link", "del", link}).IgnoreError();
    }
    namespaces_.clear();
    links_.clear();
  }

  // Removes what earlier runs that were killed (a ctest timeout) left behind: names of this
  // form whose pid no longer runs. Their processes died with them (PDEATHSIG).
  void remove_stale() const {
    for (const char* what : {"netns", "link"}) {
      absl::StatusOr<std::pair<int, std::string>> listed =
          Subprocess::run({ip_, "-o", what, "list"}, absl::Seconds(10));
      if (!listed.ok()) continue;
      for (absl::string_view line : absl::StrSplit(listed->second, '\n')) {
        const size_t at = line.find("tsn");
        if (at == absl::string_view::npos) continue;
        size_t end = at + 3;
        while (end < line.size() && absl::ascii_isdigit(line[end])) ++end;
        int pid = 0;
        if (!absl::SimpleAtoi(line.substr(at + 3, end - at - 3), &pid) || pid <= 0) continue;
        if (kill(pid, 0) == 0 || errno != ESRCH) continue;  // that run is still going
        size_t name_end = end;
        while (name_end < line.size() && line[name_end] != ' ' && line[name_end] != ':' && line[name_end] != '@') {
          ++name_end;
        }
        const std::string name(line.substr(at, name_end - at));
        if (std::string(what) == "netns") {
          run({"netns", "del", name}).IgnoreError();
        } else if (access(absl::StrCat("/sys/class/net/", name).c_str(), F_OK) == 0) {
          run({"link", "del", name}).IgnoreError();
        }
      }
    }
  }

  // Whether anything of this run is left (for the test's own check of its cleanup).
  std::vector<std::string> leftovers() const {
    std::vector<std::string> out;
    absl::StatusOr<std::pair<int, std::string>> listed = Subprocess::run({ip_, "netns", "list"}, absl::Seconds(10));
    if (listed.ok() && listed->second.find(tag_) != std::string::npos) out.push_back("a namespace");
    absl::StatusOr<std::pair<int, std::string>> links = Subprocess::run({ip_, "-o", "link"}, absl::Seconds(10));
    if (links.ok() && links->second.find(tag_) != std::string::npos) out.push_back("a link");
    return out;
  }

 private:
  absl::Status run(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {ip_};
    argv.insert(argv.end(), args.begin(), args.end());
    absl::StatusOr<std::pair<int, std::string>> r = Subprocess::run(argv, absl::Seconds(10));
    if (!r.ok()) return r.status();
    if (r->first != 0) {
      std::string cmd;
      for (const std::string& a : argv) absl::StrAppend(&cmd, a, " ");
      return absl::InternalError(absl::StrCat(cmd, "exited ", r->first, ": ", r->second));
    }
    return absl::OkStatus();
  }

  std::string netns(const std::string& host) const { return absl::StrCat(tag_, "-", host); }
  std::string bridge() const { return absl::StrCat(tag_, "br"); }
  // Interface names have at most 15 characters: "tsn" + a pid of at most 7 digits + "h" + "w7".
  std::string veth(const std::string& host, char side) const { return absl::StrCat(tag_, std::string(1, side), host); }

  const std::string ip_;
  const std::string tag_;
  std::string subnet_;
  std::vector<std::string> namespaces_;
  std::vector<std::string> links_;
};

class NetnsClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to make network namespaces (running as uid " << geteuid() << ")";
    ip_ = find_ip();
    if (ip_.empty()) GTEST_SKIP() << "needs ip(8) (iproute2), found in none of /usr/sbin /sbin /usr/bin /bin";
    signal(SIGPIPE, SIG_IGN);  // a client that died must fail a write, not kill the test
    topology_ = std::make_unique<Topology>(ip_);
    topology_->remove_stale();
    absl::Status bridge = topology_->add_bridge();
    if (!bridge.ok()) GTEST_SKIP() << "cannot make a bridge here: " << bridge.message();
    // The first namespace doubles as the probe: some roots can make a bridge but not mount
    // the namespaces' /run/netns (a chroot without /run, a container without mount rights).
    absl::Status first = topology_->add_host("c", 1);
    if (!first.ok()) GTEST_SKIP() << "cannot make a network namespace here: " << first.message();
    for (int i = 0; i < kWorkers; ++i) {
      absl::Status added = topology_->add_host(absl::StrCat("w", i), 10 + i);
      ASSERT_TRUE(added.ok()) << added;
    }
    absl::Status client = topology_->add_host("cl", 100);
    ASSERT_TRUE(client.ok()) << client;
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
         absl::StrCat("--memory_bytes=", 256 << 20)}));
    return w;
  }

  // Sends one command to the client and returns its one-line answer.
  std::string ask(const std::string& command, absl::Duration timeout) {
    absl::Status sent = client_->write_line(command);
    if (!sent.ok()) return sent.ToString();
    absl::StatusOr<std::string> line = client_->read_line_with("", timeout);
    return line.ok() ? *line : line.status().ToString();
  }

  std::string ip_;
  std::unique_ptr<Topology> topology_;
  std::unique_ptr<Subprocess> coordinator_;
  std::vector<std::unique_ptr<Subprocess>> workers_;
  std::unique_ptr<Subprocess> client_;
};

TEST_F(NetnsClusterTest, ClientAcrossHostsThenAWorkerIsCutOffAndComesBack) {
  absl::StatusOr<std::unique_ptr<Subprocess>> c = Subprocess::spawn(topology_->in(
      "c", {bin("tessera-coordinator"), "--host=" + topology_->address(1), absl::StrCat("--port=", kCoordinatorPort)}));
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

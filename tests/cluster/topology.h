// Topology: network namespaces joined by one bridge, each a "host" with its own 10.x address,
// for the cluster tests (netns_cluster_test.cc, k8s_netns_test.cc). Needs root and ip(8).
//
//   Topology t(find_ip());
//   t.remove_stale();
//   t.add_bridge();
//   t.add_host("c", 1);                                  // 10.213.N.1
//   t.write_etc("c", "hosts", "10.213.N.1 coordinator\n");  // that host's /etc/hosts
//   Subprocess::spawn(t.in("c", {"tessera-coordinator", ...}));
//
// Everything of one run (namespaces, links, /etc/netns/<namespace>/) carries "tsn<pid>" and is
// removed by the destructor; remove_stale() removes what runs that died left.
#ifndef TESSERA_TESTS_CLUSTER_TOPOLOGY_H_
#define TESSERA_TESTS_CLUSTER_TOPOLOGY_H_

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/status.h"
#include "core/subprocess.h"

namespace tessera {

inline std::string find_ip() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

class Topology;

// The cluster's hosts on one bridge: "c" (address suffix 1), "w0".."w<workers-1>" (10 + i) and
// "cl" (100), stale leftovers of dead runs removed first. Sets `skip` and returns null when
// this machine cannot make them (not root, no ip(8), no bridge or namespaces): for GTEST_SKIP.
std::unique_ptr<Topology> make_cluster_topology(int workers, std::string* skip, absl::Status* error);

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

  // Turns IPv6 off in `host`'s namespace.
  absl::Status disable_ipv6(const std::string& host) const {
    return run({"netns", "exec", netns(host), "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"});
  }

  // Writes `host`'s /etc/<file> (hosts, resolv.conf, nsswitch.conf): `ip netns exec`
  // bind-mounts /etc/netns/<namespace>/<file> over it. Rewritten in place, so a process
  // already running sees the new contents (as a DNS record that appears).
  absl::Status write_etc(const std::string& host, const std::string& file, const std::string& content) const {
    const std::string dir = absl::StrCat("/etc/netns/", netns(host));
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    std::ofstream out(absl::StrCat(dir, "/", file), std::ios::trunc);
    out << content;
    out.close();
    if (error || !out) return absl::InternalError(absl::StrCat("cannot write ", dir, "/", file));
    return absl::OkStatus();
  }

  // argv run inside `host`'s namespace.
  std::vector<std::string> in(const std::string& host, std::vector<std::string> argv) const {
    std::vector<std::string> out = {ip_, "netns", "exec", netns(host)};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

  void remove() {
    for (const std::string& ns : namespaces_) {
      run({"netns", "del", ns}).IgnoreError();
      std::error_code ignored;
      std::filesystem::remove_all(absl::StrCat("/etc/netns/", ns), ignored);
    }
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
          std::error_code ignored;
          std::filesystem::remove_all(absl::StrCat("/etc/netns/", name), ignored);
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

inline std::unique_ptr<Topology> make_cluster_topology(int workers, std::string* skip, absl::Status* error) {
  if (geteuid() != 0) {
    *skip = absl::StrCat("needs root to make network namespaces (running as uid ", geteuid(), ")");
    return nullptr;
  }
  const std::string ip = find_ip();
  if (ip.empty()) {
    *skip = "needs ip(8) (iproute2), found in none of /usr/sbin /sbin /usr/bin /bin";
    return nullptr;
  }
  auto topology = std::make_unique<Topology>(ip);
  topology->remove_stale();
  absl::Status bridge = topology->add_bridge();
  if (!bridge.ok()) {
    *skip = absl::StrCat("cannot make a bridge here: ", bridge.message());
    return nullptr;
  }
  // The first namespace doubles as the probe: some roots can make a bridge but not mount
  // the namespaces' /run/netns (a chroot without /run, a container without mount rights).
  absl::Status first = topology->add_host("c", 1);
  if (!first.ok()) {
    *skip = absl::StrCat("cannot make a network namespace here: ", first.message());
    return nullptr;
  }
  for (int i = 0; i < workers && error->ok(); ++i) *error = topology->add_host(absl::StrCat("w", i), 10 + i);
  if (error->ok()) *error = topology->add_host("cl", 100);
  return topology;
}

}  // namespace tessera

#endif  // TESSERA_TESTS_CLUSTER_TOPOLOGY_H_

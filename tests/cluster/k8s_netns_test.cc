// The Kubernetes manifests (deploy/k8s/) run for real, without a cluster: each overlay is
// rendered (`kubectl kustomize`, through tests/deploy/k8s.mjs), and every pod it makes runs
// in a network namespace of its own with exactly the command line and environment the
// rendered YAML gives it (downward-API values and $(VAR) references filled in as the kubelet
// does; only PATH, the image's, points at this build). Names resolve as the cluster's DNS
// would answer for the rendered Services (each namespace's /etc/hosts), so a manifest that
// advertises a name no Service publishes fails here.
//
// StatefulSet: the workers start first, while the coordinator's name does not resolve yet (its
// pod does not exist), log their retries, and register once it is there; device ids come
// from the pod ordinals; grpc.health.v1 readiness of the coordinator follows its expected
// devices; JAX's seed program and a collective-heavy program run from a client namespace
// through the Service `tessera`; SIGTERM stops a worker and the coordinator within their
// terminationGracePeriodSeconds. Indexed Job: device ids from JOB_COMPLETION_INDEX, the seed
// program, and a worker stopped by SIGTERM exits non-zero (its index is then run again).
//
// Needs root, ip(8), node with .cache/node (./dev install) and kubectl; skipped otherwise.
#include <signal.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/credentials.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tests/cluster/topology.h"
#include "tests/metrics_scrape.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

constexpr char kNamespace[] = "tessera-test";
constexpr char kSeedOutput[] = "(16, 4)\nP('data', 'model')\n8 (4, 2)\n";

std::string bin(const std::string& name) { return absl::StrCat(TESSERA_BIN_DIR, "/", name); }

// A volume mount of a container: "secret" (the Secret) or "emptyDir" (the pod's own).
struct Mount {
  std::string path, volume, kind;
  bool read_only = false;
};

// A container as the kubelet starts it.
struct Container {
  std::vector<std::string> argv;
  std::vector<std::pair<std::string, std::string>> env;
  std::vector<Mount> mounts;
};

// One pod of a rendered overlay, as tests/deploy/k8s.mjs describes it.
struct Pod : Container {
  std::string name, role, hostname;
  std::vector<Container> init;  // run to completion, in order, before the daemon
  int grace_seconds = 0;
  std::string restart_policy;  // the pod template's (Always, OnFailure or Never)
  int scrape_port = 0;         // prometheus.io/port when prometheus.io/scrape is "true", else 0
  std::string scrape_path;     // prometheus.io/path (default /metrics)
  std::string host;            // the namespace it runs in
};

Container container_of(const google::protobuf::Struct& json) {
  const auto& f = json.fields();
  Container c;
  for (const auto& a : f.at("argv").list_value().values()) c.argv.push_back(a.string_value());
  for (const auto& e : f.at("env").list_value().values()) {
    c.env.emplace_back(e.list_value().values(0).string_value(), e.list_value().values(1).string_value());
  }
  for (const auto& m : f.at("mounts").list_value().values()) {
    const auto& mf = m.struct_value().fields();
    c.mounts.push_back(Mount{mf.at("path").string_value(), mf.at("volume").string_value(), mf.at("kind").string_value(),
                             mf.at("read_only").bool_value()});
  }
  return c;
}

struct Rendered {
  std::vector<Pod> pods;
  std::map<std::string, std::vector<std::string>> dns;  // name -> pod names
};

// Renders `overlay`; a non-empty `skip` when node, its packages or kubectl are missing.
absl::StatusOr<Rendered> render(const std::string& overlay, std::string* skip) {
  const std::string source = TESSERA_SOURCE_DIR;
  absl::StatusOr<std::pair<int, std::string>> out =
      Subprocess::run({"/usr/bin/env", "node", source + "/tests/deploy/k8s.mjs", "pods", source,
                       source + "/deploy/k8s/overlays/" + overlay, kNamespace},
                      absl::Seconds(60));
  if (!out.ok()) {
    *skip = absl::StrCat("cannot run node: ", out.status().message());
    return out.status();
  }
  if (out->first == 77 || out->first == 127) {
    *skip = out->second;
    return absl::UnavailableError(out->second);
  }
  if (out->first != 0) return absl::InternalError(absl::StrCat("k8s.mjs pods ", overlay, ": ", out->second));
  google::protobuf::Struct json;
  const auto parsed = google::protobuf::util::JsonStringToMessage(out->second, &json);
  if (!parsed.ok()) return absl::InternalError(absl::StrCat("k8s.mjs printed no JSON: ", out->second));
  Rendered r;
  for (const auto& p : json.fields().at("pods").list_value().values()) {
    const auto& f = p.struct_value().fields();
    Pod pod;
    static_cast<Container&>(pod) = container_of(p.struct_value());
    pod.name = f.at("name").string_value();
    pod.role = f.at("role").string_value();
    pod.hostname = f.at("hostname").string_value();
    pod.grace_seconds = static_cast<int>(f.at("grace_seconds").number_value());
    pod.restart_policy = f.at("restart_policy").string_value();
    pod.scrape_port = static_cast<int>(f.at("scrape_port").number_value());
    pod.scrape_path = f.at("scrape_path").string_value();
    for (const auto& i : f.at("init").list_value().values()) pod.init.push_back(container_of(i.struct_value()));
    r.pods.push_back(pod);
  }
  for (const auto& [name, pods] : json.fields().at("dns").struct_value().fields()) {
    for (const auto& p : pods.list_value().values()) r.dns[name].push_back(p.string_value());
  }
  return r;
}

std::string env_of(const Pod& pod, const std::string& name) {
  for (const auto& [k, v] : pod.env) {
    if (k == name) return v;
  }
  return "";
}

class K8sNetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    signal(SIGPIPE, SIG_IGN);
    std::string skip;
    absl::Status error;
    topology_ = make_cluster_topology(8, &skip, &error);
    if (topology_ == nullptr) GTEST_SKIP() << skip;
    ASSERT_TRUE(error.ok()) << error;
    // The Secret tessera-credentials, as deploy/README.md makes it: tokens, and TLS for the
    // names the daemons are reached by in this namespace (the probes use the plaintext health
    // ports); the kubelet would mount it where the manifests say.
    char dir[] = "/tmp/tessera-k8s-secret-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    secret_ = dir;
    absl::StatusOr<Credentials> tokens = generate_credentials();
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    const std::string domain = absl::StrCat(kNamespace, ".svc.cluster.local");
    ASSERT_TRUE(
        add_tls(&*tokens, {"*.tessera-workers." + domain, "tessera." + domain, "tessera-coordinator." + domain}, 8)
            .ok());
    ASSERT_TRUE(write_credentials(secret_, *tokens).ok());
  }

  void TearDown() override {
    client_.reset();
    processes_.clear();
    if (topology_ != nullptr) {
      topology_->remove();
      EXPECT_THAT(topology_->leftovers(), ::testing::IsEmpty());
    }
    if (!secret_.empty()) {
      remove_credentials(secret_);
    }
    // The pods' emptyDirs: the credentials files, and then each directory (the others stay empty).
    for (const auto& [name, dir] : volumes_) remove_credentials(dir);
  }

  // Places the pods on the hosts (the coordinator on "c", worker i on "wi") and gives every
  // host the same resolver: its hosts file (publish_dns), and a nameserver on its own loopback
  // that nobody serves, so no lookup ever leaves the namespace. IPv4 only, as many clusters
  // are: with IPv6 on, gRPC's resolver also asks for AAAA records, which no hosts entry has,
  // and waits 3 s for that absent nameserver on every lookup (a cluster's DNS answers at once).
  absl::Status place(Rendered* r) {
    int worker = 0;
    for (Pod& pod : r->pods) {
      if (pod.role == "coordinator") {
        pod.host = "c";
        address_[pod.name] = topology_->address(1);
      } else {
        pod.host = absl::StrCat("w", worker);
        address_[pod.name] = topology_->address(10 + worker++);
      }
    }
    if (worker != 8) return absl::InternalError(absl::StrCat(worker, " workers rendered, not 8"));
    for (const std::string host : {"c", "w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "cl"}) {
      TESSERA_RETURN_IF_ERROR(topology_->write_etc(host, "resolv.conf", "nameserver 127.0.0.1\n"));
      TESSERA_RETURN_IF_ERROR(topology_->write_etc(host, "nsswitch.conf", "hosts: files dns\n"));
      TESSERA_RETURN_IF_ERROR(topology_->disable_ipv6(host));
    }
    return absl::OkStatus();
  }

  // Every host's /etc/hosts: the DNS names of the rendered Services, leaving out those of
  // pods of `missing_role` (not created yet).
  absl::Status publish_dns(const Rendered& r, const std::string& missing_role) {
    std::map<std::string, std::string> role;
    for (const Pod& p : r.pods) role[p.name] = p.role;
    std::string hosts = "127.0.0.1 localhost\n";
    for (const auto& [name, pods] : r.dns) {
      for (const std::string& pod : pods) {
        if (role[pod] != missing_role) absl::StrAppend(&hosts, address_[pod], " ", name, "\n");
      }
    }
    for (const std::string host : {"c", "w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "cl"}) {
      TESSERA_RETURN_IF_ERROR(topology_->write_etc(host, "hosts", hosts));
    }
    return absl::OkStatus();
  }

  // The directory standing for `volume` of `pod`: the Secret is the test's copy of it; each
  // emptyDir is a directory of the pod's own, made on first use (a volume, as the kubelet
  // mounts one).
  absl::StatusOr<std::string> volume_dir(const Pod& pod, const Mount& m) {
    if (m.kind == "secret") return secret_;
    std::string& dir = volumes_[pod.name + "/" + m.volume];
    if (dir.empty()) {
      char made[] = "/tmp/tessera-k8s-volume-XXXXXX";
      if (mkdtemp(made) == nullptr) return absl::InternalError("mkdtemp failed");
      dir = made;
    }
    return dir;
  }

  // `c`'s command line under env -i, the image's PATH pointing at this build, each path under
  // one of its mounts replaced by the volume's directory.
  absl::StatusOr<std::vector<std::string>> command_of(const Pod& pod, const Container& c) {
    std::vector<std::pair<std::string, std::string>> mounted;  // mount path -> directory
    for (const Mount& m : c.mounts) {
      TESSERA_ASSIGN_OR_RETURN(std::string dir, volume_dir(pod, m));
      mounted.emplace_back(m.path, dir);
    }
    auto map = [&](std::string text) {
      for (const auto& [path, dir] : mounted) {
        if (absl::StartsWith(text, path) && (text.size() == path.size() || text[path.size()] == '/')) {
          return dir + text.substr(path.size());
        }
      }
      return text;
    };
    std::vector<std::string> argv = {
        "/bin/sh", "-c", "exec \"$@\" 2>&1", "sh", "/usr/bin/env", "-i", absl::StrCat("PATH=", TESSERA_BIN_DIR)};
    for (const auto& [k, v] : c.env) argv.push_back(absl::StrCat(k, "=", map(v)));
    for (const std::string& a : c.argv) argv.push_back(map(a));
    return argv;
  }

  // Starts `pod`: its init containers run to completion, in order (one that fails is an
  // error with its output, as the kubelet would not start the pod), then its container:
  // exactly its command line and environment; stderr merged into the pipe the test reads.
  absl::StatusOr<Subprocess*> start(const Pod& pod) {
    for (const Container& init : pod.init) {
      TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> argv, command_of(pod, init));
      TESSERA_ASSIGN_OR_RETURN(auto done, Subprocess::run(topology_->in(pod.host, argv), absl::Seconds(30)));
      if (done.first != 0) {
        return absl::FailedPreconditionError(
            absl::StrCat(pod.name, ": init container ", init.argv[0], " exited ", done.first, ": ", done.second));
      }
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<std::string> argv, command_of(pod, pod));
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Subprocess> p, Subprocess::spawn(topology_->in(pod.host, argv)));
    Subprocess* raw = p.get();
    processes_[pod.name] = std::move(p);
    return raw;
  }

  // The files `pod`'s daemon sees in its credentials directory (its --credentials, through
  // the environment the manifest gives it), sorted; and that it mounts no Secret.
  std::vector<std::string> credential_files(const Pod& pod) {
    for (const Mount& m : pod.mounts) EXPECT_NE(m.kind, "secret") << pod.name << " mounts the Secret at " << m.path;
    const std::string variable =
        pod.role == "worker" ? "TESSERA_WORKER_CREDENTIALS" : "TESSERA_COORDINATOR_CREDENTIALS";
    const std::string path = env_of(pod, variable);
    for (const Mount& m : pod.mounts) {
      if (m.path != path) continue;
      EXPECT_TRUE(m.read_only) << pod.name << ": " << path;
      absl::StatusOr<std::string> dir = volume_dir(pod, m);
      if (!dir.ok()) return {dir.status().ToString()};
      absl::StatusOr<std::pair<int, std::string>> ls = Subprocess::run({"/bin/ls", "-A", *dir}, absl::Seconds(10));
      if (!ls.ok()) return {ls.status().ToString()};
      return absl::StrSplit(ls->second, '\n', absl::SkipEmpty());
    }
    return {absl::StrCat(pod.name, ": ", variable, "=", path, " is no mount of its container")};
  }

  // `tessera health` from the client's host until it exits with `want` (0 serving, 1 not),
  // for at most `timeout`; returns its last output.
  // `main_address` is a daemon's main port; the probe goes, as the kubelet's, to its plaintext
  // health port (deploy/daemons.json: the main port + 1).
  std::string wait_health(const std::string& main_address, const std::string& service, int want,
                          absl::Duration timeout) {
    const size_t colon = main_address.rfind(':');
    const std::string address =
        absl::StrCat(main_address.substr(0, colon), ":", std::stoi(main_address.substr(colon + 1)) + 1);
    const absl::Time deadline = absl::Now() + timeout;
    std::string last;
    while (true) {
      absl::StatusOr<std::pair<int, std::string>> h = Subprocess::run(
          topology_->in("cl",
                        {bin("tessera"), "health", "--address=" + address, "--service=" + service, "--timeout_s=2"}),
          absl::Seconds(10));
      last = h.ok() ? absl::StrCat("exit ", h->first, ": ", h->second) : h.status().ToString();
      if (h.ok() && h->first == want) return last;
      if (absl::Now() >= deadline)
        return absl::StrCat("still not exit ", want, " after ", absl::FormatDuration(timeout), "; ", last);
    }
  }

  // Sends SIGTERM to `pod`'s process and waits for it to exit (its output to end), at most
  // `limit`; returns how long it took, or `limit` and more if it did not exit.
  absl::Duration stop(const Pod& pod, absl::Duration limit) {
    Subprocess* p = processes_.at(pod.name).get();
    const absl::Time start = absl::Now();
    kill(p->pid(), SIGTERM);
    absl::StatusOr<std::string> end = p->read_line_with("\x01 never printed", limit);
    const absl::Duration took = absl::Now() - start;
    return absl::IsUnavailable(end.status()) ? took : limit + absl::Seconds(1);
  }

  // `argv` as an application in the client's namespace runs it: verifying the daemons with the
  // Secret's CA and, unless `anonymous`, presenting its client token.
  std::vector<std::string> as_client(std::vector<std::string> argv, bool anonymous = false) const {
    std::vector<std::string> env = {"/usr/bin/env", absl::StrCat("TESSERA_CA_FILE=", secret_, "/", kCaFile)};
    if (!anonymous) env.push_back(absl::StrCat("TESSERA_TOKEN_FILE=", secret_, "/", kClientTokenFile));
    argv.insert(argv.begin(), env.begin(), env.end());
    return topology_->in("cl", argv);
  }

  std::string cluster_address(const std::string& service) const {
    return absl::StrCat(service, ".", kNamespace, ".svc.cluster.local:5000");
  }

  std::string ask(const std::string& command, absl::Duration timeout) {
    absl::Status sent = client_->write_line(command);
    if (!sent.ok()) return sent.ToString();
    absl::StatusOr<std::string> line = client_->read_line_with("", timeout);
    return line.ok() ? *line : line.status().ToString();
  }

  // The worker pods' "listening on" lines: device i on its own pod DNS name.
  void expect_workers_registered(const Rendered& r, absl::Duration timeout) {
    int i = 0;
    for (const Pod& pod : r.pods) {
      if (pod.role != "worker") continue;
      absl::StatusOr<std::string> line = processes_.at(pod.name)->read_line_with("listening on", timeout);
      ASSERT_TRUE(line.ok()) << pod.name << ": " << line.status();
      EXPECT_THAT(*line, HasSubstr(absl::StrCat("device ", i, " listening on ", pod.hostname, ".tessera-workers.",
                                                kNamespace, ".svc.cluster.local:6000")));
      ++i;
    }
  }

  // Each pod scraped as a Prometheus inside the cluster would, by the common pod-annotation
  // rules (prometheus.io/scrape, /port, /path): from the client's host at the pod's address,
  // over plain HTTP. Every pod is annotated, and after the seed program every daemon counts a
  // call: the coordinator an execution, each worker its plan run.
  void expect_scraped_after_a_call(const Rendered& r) {
    int device = 0;  // the workers' pods are in device order (expect_workers_registered)
    for (const Pod& pod : r.pods) {
      SCOPED_TRACE(pod.name);
      ASSERT_GT(pod.scrape_port, 0) << "not annotated for scraping";
      // bash's /dev/tcp: HTTP/1.0, the connection closes after the answer.
      absl::StatusOr<std::pair<int, std::string>> got = Subprocess::run(
          topology_->in("cl", {"/bin/bash", "-c",
                               "exec 3<>/dev/tcp/$0/$1 && printf 'GET %s HTTP/1.0\\r\\n\\r\\n' \"$2\" >&3 && "
                               "timeout 10 cat <&3",
                               address_.at(pod.name), absl::StrCat(pod.scrape_port), pod.scrape_path}),
          absl::Seconds(20));
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->first, 0) << got->second;
      EXPECT_THAT(got->second, HasSubstr("200 OK"));
      const std::string series = pod.role == "coordinator"
                                     ? std::string("tessera_coordinator_executions_total{result=\"ok\"}")
                                     : absl::StrCat("tessera_worker_plan_runs_total{device=\"", device++, "\"}");
      EXPECT_GE(sample(got->second, series), 1) << series << " in\n" << got->second.substr(0, 3000);
    }
  }

  void run_seed_program() {
    const absl::Time start = absl::Now();
    absl::StatusOr<std::pair<int, std::string>> seed = Subprocess::run(
        as_client({bin("example_seed_layer"), "--coordinator=" + cluster_address("tessera")}), absl::Seconds(60));
    ASSERT_TRUE(seed.ok()) << seed.status();
    EXPECT_EQ(seed->first, 0) << seed->second;
    EXPECT_EQ(seed->second, kSeedOutput);
    std::printf("[ timing ] seed program from the client namespace: %s\n",
                absl::FormatDuration(absl::Now() - start).c_str());
    // The daemons check the Secret's tokens: without one the same program is refused.
    absl::StatusOr<std::pair<int, std::string>> anonymous =
        Subprocess::run(as_client({bin("example_seed_layer"), "--coordinator=" + cluster_address("tessera")},
                                  /*anonymous=*/true),
                        absl::Seconds(60));
    ASSERT_TRUE(anonymous.ok()) << anonymous.status();
    EXPECT_NE(anonymous->first, 0) << anonymous->second;
    EXPECT_THAT(anonymous->second, HasSubstr("UNAUTHENTICATED"));
  }

  std::unique_ptr<Topology> topology_;
  std::string secret_;                          // the Secret's files
  std::map<std::string, std::string> address_;  // pod name -> its host's address
  std::map<std::string, std::string> volumes_;  // "pod/volume" -> the directory standing for an emptyDir
  std::map<std::string, std::unique_ptr<Subprocess>> processes_;
  std::unique_ptr<Subprocess> client_;
};

TEST_F(K8sNetnsTest, StatefulSetWorkersWaitForALateCoordinatorThenServeAndDrain) {
  std::string skip;
  absl::StatusOr<Rendered> rendered = render("statefulset", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  ASSERT_TRUE(place(&*rendered).ok());
  const Pod* coordinator = nullptr;
  std::vector<const Pod*> workers;
  for (const Pod& p : rendered->pods) {
    if (p.role == "coordinator") {
      coordinator = &p;
    } else {
      workers.push_back(&p);
    }
  }
  ASSERT_NE(coordinator, nullptr);
  ASSERT_EQ(workers.size(), 8u);
  EXPECT_EQ(workers[3]->name, "tessera-worker-3");
  EXPECT_EQ(env_of(*workers[3], "TESSERA_WORKER_HOST"),
            absl::StrCat("tessera-worker-3.tessera-workers.", kNamespace, ".svc.cluster.local"));

  // The workers first: the coordinator's pod does not exist, its name does not resolve.
  ASSERT_TRUE(publish_dns(*rendered, "coordinator").ok());
  for (const Pod* w : workers) ASSERT_TRUE(start(*w).ok()) << w->name;
  const std::string coordinator_name = env_of(*workers[0], "TESSERA_COORDINATOR");
  for (const Pod* w : workers) {
    absl::StatusOr<std::string> retry =
        processes_.at(w->name)->read_line_with("registration attempt 1 failed", absl::Seconds(20));
    ASSERT_TRUE(retry.ok()) << w->name << ": " << retry.status();
    EXPECT_THAT(*retry, HasSubstr(coordinator_name.substr(0, coordinator_name.find(':'))));
    EXPECT_THAT(*retry, HasSubstr("retrying in 1s"));
    if (w == workers[0]) std::printf("[ log ] %s: %s\n", w->name.c_str(), retry->c_str());
  }
  // The worker serves health before it registers: alive, not ready.
  const std::string worker0 = absl::StrCat(env_of(*workers[0], "TESSERA_WORKER_HOST"), ":6000");
  EXPECT_THAT(wait_health(worker0, "liveness", 0, absl::Seconds(10)), HasSubstr("serving"));
  EXPECT_THAT(wait_health(worker0, "", 1, absl::Seconds(10)), HasSubstr("NOT_SERVING"));

  // Each worker sees only its own credentials: what its init container (`tessera
  // select-credentials`, from the manifest) copied out of the Secret, which the worker's own
  // container does not mount. What a worker needs (docs/design.md, "Security"): the tokens it
  // verifies callers by, the CA, and its device's certificate and key; no other device's key,
  // no admin token, not the coordinator's certificate.
  for (size_t i = 0; i < workers.size(); ++i) {
    EXPECT_THAT(credential_files(*workers[i]),
                ::testing::ElementsAre("ca.pem", "client.token", "cluster.token", absl::StrCat("device-", i, ".key"),
                                       absl::StrCat("device-", i, ".pem")))
        << workers[i]->name;
  }
  // Holding device 3's files, a worker cannot be device 4: it has no certificate to present.
  {
    const std::string dir = env_of(*workers[3], "TESSERA_WORKER_CREDENTIALS");
    std::string own;
    for (const Mount& m : workers[3]->mounts) {
      if (m.path == dir) own = *volume_dir(*workers[3], m);
    }
    absl::StatusOr<std::pair<int, std::string>> as_4 =
        Subprocess::run(topology_->in("w4", {bin("tessera-worker"), "--device_id=4", "--credentials=" + own,
                                             "--coordinator=" + coordinator_name, "--register_timeout_s=1"}),
                        absl::Seconds(20));
    ASSERT_TRUE(as_4.ok()) << as_4.status();
    EXPECT_NE(as_4->first, 0) << as_4->second;
    EXPECT_THAT(as_4->second, HasSubstr("no certificate for device 4 (device-4.pem)"));
  }

  // The coordinator's pod appears, and with it its DNS records.
  ASSERT_TRUE(start(*coordinator).ok());
  EXPECT_THAT(credential_files(*coordinator), ::testing::ElementsAre("admin.token", "ca.pem", "client.token",
                                                                     "cluster.token", "daemon.key", "daemon.pem"));
  ASSERT_TRUE(processes_.at(coordinator->name)->read_line_with("listening on", absl::Seconds(20)).ok());
  const absl::Time up = absl::Now();
  ASSERT_TRUE(publish_dns(*rendered, "").ok());
  expect_workers_registered(*rendered, absl::Seconds(30));
  std::printf("[ timing ] coordinator up -> 8 workers registered (retrying every 1-5 s): %s\n",
              absl::FormatDuration(absl::Now() - up).c_str());
  EXPECT_THAT(wait_health(cluster_address("tessera"), "", 0, absl::Seconds(10)), HasSubstr("serving"));
  EXPECT_THAT(wait_health(worker0, "", 0, absl::Seconds(10)), HasSubstr("serving"));

  run_seed_program();
  expect_scraped_after_a_call(*rendered);
  absl::StatusOr<std::unique_ptr<Subprocess>> client =
      Subprocess::spawn(as_client({bin("cluster_client"), "--coordinator=" + cluster_address("tessera")}),
                        SubprocessOptions{.pipe_stdin = true});
  ASSERT_TRUE(client.ok()) << client.status();
  client_ = *std::move(client);
  const std::string ready = ask("setup", absl::Seconds(60));
  ASSERT_THAT(ready, StartsWith("ready")) << ready;
  EXPECT_THAT(ready, HasSubstr("all_reduce all_to_all all_gather"));
  EXPECT_THAT(ask("run", absl::Seconds(30)), StartsWith("ok"));

  // SIGTERM, as a pod deletion sends it: the worker exits within its grace period, and the
  // coordinator is not ready while a device it expects is missing.
  const absl::Duration grace = absl::Seconds(workers[3]->grace_seconds);
  const absl::Duration worker_stop = stop(*workers[3], grace);
  EXPECT_LE(worker_stop, grace);
  EXPECT_THAT(wait_health(cluster_address("tessera"), "", 1, absl::Seconds(10)), HasSubstr("NOT_SERVING"));
  // It deregistered on its way out: the coordinator shows it left, not lost.
  {
    absl::StatusOr<std::pair<int, std::string>> shown = Subprocess::run(
        as_client({bin("tessera"), "status", "--coordinator=" + cluster_address("tessera")}), absl::Seconds(30));
    ASSERT_TRUE(shown.ok()) << shown.status();
    ASSERT_EQ(shown->first, 0) << shown->second;
    std::string row;
    for (absl::string_view line : absl::StrSplit(shown->second, '\n')) {
      if (absl::StartsWith(line, "3 ")) row = std::string(line);
    }
    std::vector<std::string> words = absl::StrSplit(row, ' ', absl::SkipEmpty());
    ASSERT_GE(words.size(), 3u) << shown->second;
    EXPECT_EQ(words[2], "left") << row;
  }
  // The StatefulSet makes the pod again under the same name: device 3 again, ready again.
  ASSERT_TRUE(start(*workers[3]).ok());
  absl::StatusOr<std::string> again =
      processes_.at(workers[3]->name)->read_line_with("listening on", absl::Seconds(30));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_THAT(*again, HasSubstr("device 3 listening on tessera-worker-3.tessera-workers"));
  EXPECT_THAT(wait_health(cluster_address("tessera"), "", 0, absl::Seconds(10)), HasSubstr("serving"));

  client_.reset();
  const absl::Duration coordinator_grace = absl::Seconds(coordinator->grace_seconds);
  const absl::Duration coordinator_stop = stop(*coordinator, coordinator_grace);
  EXPECT_LE(coordinator_stop, coordinator_grace);
  std::printf("[ timing ] SIGTERM -> exit: worker %s, coordinator %s (grace %s / %s)\n",
              absl::FormatDuration(worker_stop).c_str(), absl::FormatDuration(coordinator_stop).c_str(),
              absl::FormatDuration(grace).c_str(), absl::FormatDuration(coordinator_grace).c_str());
}

TEST_F(K8sNetnsTest, IndexedJobWorkersTakeTheirCompletionIndex) {
  std::string skip;
  absl::StatusOr<Rendered> rendered = render("indexed-job", &skip);
  if (!skip.empty()) GTEST_SKIP() << skip;
  ASSERT_TRUE(rendered.ok()) << rendered.status();
  ASSERT_TRUE(place(&*rendered).ok());
  ASSERT_TRUE(publish_dns(*rendered, "").ok());
  for (const Pod& p : rendered->pods) {
    if (p.role == "worker") {
      EXPECT_THAT(p.name, StartsWith(p.hostname + "-")) << "an Indexed Job's pod name is HOST-random";
      EXPECT_EQ(env_of(p, "TESSERA_WORKER_DEVICE_ID_FROM"), "job_index");
    }
    ASSERT_TRUE(start(p).ok()) << p.name;
  }
  expect_workers_registered(*rendered, absl::Seconds(30));
  for (const Pod& p : rendered->pods) {
    if (p.role != "worker") continue;
    const std::string device = env_of(p, "JOB_COMPLETION_INDEX");
    EXPECT_THAT(credential_files(p), ::testing::ElementsAre("ca.pem", "client.token", "cluster.token",
                                                            "device-" + device + ".key", "device-" + device + ".pem"))
        << p.name;
  }
  EXPECT_THAT(wait_health(cluster_address("tessera"), "", 0, absl::Seconds(10)), HasSubstr("serving"));
  run_seed_program();
  expect_scraped_after_a_call(*rendered);

  // A worker's pod deleted, evicted or preempted (SIGTERM): under the Job's restartPolicy
  // (OnFailure or Never: not restarted in place when the pod goes), a container that exits 0
  // leaves the pod Succeeded, and the Job counts its index complete and never runs it again
  // (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle, "Pod phase"). So it must exit
  // non-zero, within its grace period.
  const Pod* evicted = nullptr;
  for (const Pod& p : rendered->pods) {
    if (p.role == "worker" && evicted == nullptr) evicted = &p;
  }
  ASSERT_NE(evicted, nullptr);
  EXPECT_THAT(evicted->restart_policy, ::testing::AnyOf("OnFailure", "Never"));
  const absl::Duration grace = absl::Seconds(evicted->grace_seconds);
  EXPECT_LE(stop(*evicted, grace), grace);
  absl::StatusOr<int> status = processes_.at(evicted->name)->wait_for_exit(absl::Seconds(10));
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_NE(*status, 0) << evicted->name << " exited 0 after SIGTERM: its Job would count index "
                        << env_of(*evicted, "JOB_COMPLETION_INDEX") << " complete and never replace it";
}

}  // namespace
}  // namespace tessera

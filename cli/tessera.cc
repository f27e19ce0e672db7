// tessera: starts, inspects and stops Tessera clusters on this machine, and runs the examples
// against one.
//
//   tessera up --workers 8             # coordinator + 8 workers in the background; prints the address
//   tessera status                     # devices, arrays and executables of that cluster (--json)
//   tessera top                        # status every second
//   tessera run-example seed_layer     # bin/example_seed_layer --coordinator=<that address>
//   tessera down                       # stops exactly the processes `up` started, by pid
//   tessera health --address HOST:PORT # grpc.health.v1: exit 0 when the daemon there is ready
//   tessera credentials DIR            # fresh tokens for a cluster (up makes its own)
//   tessera profile --duration_ms=2000 --out=trace.json   # a timeline of whatever the cluster runs
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "cli/state.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/open_mode.h"
#include "core/status.h"
#include "core/subprocess.h"
#include "core/wire.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/health.grpc.pb.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/client.h"

ABSL_FLAG(std::string, coordinator, "",
          "status, top, run-example, profile: host:port of the coordinator; default: the cluster in the state file "
          "(env TESSERA_COORDINATOR)");
ABSL_FLAG(std::string, state, "",
          "up, down, status, run-example: the state file that up writes and down reads; default: "
          "$XDG_RUNTIME_DIR/tessera/state, else /tmp/tessera-$UID/state (env TESSERA_STATE)");
ABSL_FLAG(int, workers, 0, "up: how many workers to start, devices 0 .. N-1 (env TESSERA_WORKERS)");
ABSL_FLAG(int, port, 0, "up: the coordinator's port; 0 picks a free one (env TESSERA_COORDINATOR_PORT)");
ABSL_FLAG(std::string, host, "127.0.0.1", "up: the address every daemon listens on and advertises (env TESSERA_HOST)");
ABSL_FLAG(int64_t, memory_bytes, int64_t{1} << 30, "up: each worker's memory limit (env TESSERA_WORKER_MEMORY_BYTES)");
ABSL_FLAG(int, timeout_s, 30, "up: seconds to wait until every worker has registered; status, health: per call");
ABSL_FLAG(std::string, address, "", "health: host:port of the coordinator or worker to probe");
ABSL_FLAG(bool, json, false,
          "status: print the coordinator's ClusterStatus as JSON (proto3 mapping: 64-bit numbers are strings)");
ABSL_FLAG(int, iterations, 0, "top: stop after this many refreshes; 0: until interrupted");
ABSL_FLAG(std::string, token_file, "",
          "status, top, run-example, profile: the file holding the token to present; default: the admin token (for "
          "run-example and profile: the client token) of the cluster `up` started, if any (env TESSERA_TOKEN_FILE)");
ABSL_FLAG(std::string, credentials, "",
          "up: the daemons' credentials directory (`tessera credentials DIR` makes one); default: fresh ones in "
          "STATE-credentials/ (env TESSERA_CREDENTIALS)");
ABSL_FLAG(std::string, ca_file, "",
          "status, top, run-example, health: the cluster CA's certificate, for TLS; default: without --coordinator, "
          "the ca.pem of the cluster `up` started, if any (env TESSERA_CA_FILE)");
ABSL_FLAG(std::string, tls_hosts, "127.0.0.1,localhost",
          "credentials: the addresses and DNS names the daemons' certificate is valid for ('*.domain' covers a "
          "domain); empty: no TLS, tokens only. up: its --host is added");
ABSL_FLAG(int, devices, 8,
          "credentials: with TLS, how many workers get a certificate of their own naming their device id "
          "(device-N.pem and device-N.key for N = 0 .. devices-1; a worker presents its own, so it cannot claim "
          "another device)");
ABSL_FLAG(bool, keep_existing, false,
          "credentials: if DIR holds credentials already, keep them and exit 0 (a deployment's first start makes "
          "them, every later start keeps them); default: refuse");
ABSL_FLAG(std::string, role, "",
          "select-credentials: whose files to copy: 'coordinator' (every token, ca.pem, daemon.pem/.key) or "
          "'worker' (cluster.token, client.token, ca.pem, and its own device-N.pem/.key)");
ABSL_FLAG(std::string, device_id_from, "",
          "select-credentials: a worker's device id from the environment, as tessera-worker's flag of that name: "
          "'ordinal' ($POD_NAME's last number) or 'job_index' ($JOB_COMPLETION_INDEX)");
ABSL_FLAG(int, device_id, -1, "select-credentials: a worker's device id (instead of --device_id_from)");
ABSL_FLAG(bool, insecure, false,
          "up: start the daemons without credentials (the development mode: nothing is checked; --host must be a "
          "loopback address)");
ABSL_FLAG(int64_t, duration_ms, 1000,
          "profile: how long to record, in milliseconds (SIGINT/SIGTERM ends it early, and the trace is still "
          "written)");
ABSL_FLAG(std::string, out, "", "profile: the trace file to write (Chrome trace-event JSON), and OUT.html beside it");
ABSL_FLAG(int64_t, events_per_daemon, int64_t{1} << 16,
          "profile: each daemon's ring of events, at most 1048576; beyond it the oldest go (counted in the trace)");
ABSL_FLAG(std::string, service, "",
          "health: the grpc.health.v1 service to ask for: '' (ready: a registered worker, a coordinator with its "
          "expected devices alive) or 'liveness' (the process serves)");

namespace tessera {
namespace {

constexpr char kUsage[] =
    "start, inspect and stop Tessera clusters on this machine.\n"
    "\n"
    "  tessera up --workers N [--port P] [--host ADDR] [--memory_bytes B] [--state FILE]\n"
    "             [--credentials DIR | --insecure]\n"
    "      starts a coordinator and N workers as background daemons (logs beside the state file),\n"
    "      waits until all N have registered, and prints the coordinator's address; the daemons check\n"
    "      credentials and TLS: fresh tokens, a cluster CA, the coordinator's certificate and one per\n"
    "      worker (naming its device) in\n"
    "      STATE-credentials/ (programs need client.token and ca.pem; admin.token is for status)\n"
    "  tessera credentials DIR [--tls_hosts H1,H2,...] [--devices N] [--keep_existing]\n"
    "      writes fresh tokens into DIR (cluster.token, client.token, admin.token; mode 0600) and, unless\n"
    "      --tls_hosts is empty, a cluster CA (ca.pem), the coordinator's certificate (daemon.pem) and\n"
    "      one per device 0 .. N-1 (device-N.pem, naming it; default 8) for those hosts; a DIR\n"
    "      that holds credentials is refused, or with --keep_existing kept as it is\n"
    "  tessera select-credentials FROM TO --role coordinator|worker [--device_id_from ordinal|job_index]\n"
    "      copies into TO only the files of credentials directory FROM that one daemon needs (a\n"
    "      Kubernetes init container's job: the daemon never sees the whole Secret): the coordinator's\n"
    "      tokens, ca.pem and daemon.pem/.key, or worker N's cluster.token, client.token, ca.pem and\n"
    "      device-N.pem/.key; then checks TO loads as that daemon's --credentials\n"
    "  tessera status [--coordinator HOST:PORT] [--token_file FILE] [--json]\n"
    "      one row per device (id, address, state, incarnation, buffers, bytes used / limit,\n"
    "      programs loaded, plan runs and failures, BLAS kernel, uptime, last error), then the\n"
    "      cluster's arrays and executables; --json: all of it as JSON, for scripts\n"
    "  tessera top [--coordinator HOST:PORT] [--iterations N]\n"
    "      status, refreshed every second until interrupted\n"
    "  tessera down [--state FILE]\n"
    "      stops the processes up started (SIGTERM, then SIGKILL after 5 s) and removes the state\n"
    "  tessera run-example NAME [--coordinator HOST:PORT] [-- ARGS...]\n"
    "      runs bin/example_NAME --coordinator=HOST:PORT ARGS... (NAME: device_put, seed_layer,\n"
    "      shard_map, mlp_train; mlp_train takes --data=PATH)\n"
    "  tessera profile --out FILE [--duration_ms MS] [--coordinator HOST:PORT] [--token_file FILE]\n"
    "                  [--events_per_daemon N]\n"
    "      records a timeline of everything the cluster runs for MS milliseconds (default 1000; Ctrl-C\n"
    "      ends it early): every client's calls' compiles and dispatches on the coordinator, and each\n"
    "      device's plan runs, kernels, collectives (bytes, algorithm, path), messages and transfers;\n"
    "      writes FILE, Chrome's trace-event JSON (open it in https://ui.perfetto.dev or\n"
    "      chrome://tracing), clocks aligned to the coordinator's, and FILE.html, a viewer that needs\n"
    "      no network; presents the client token (of the cluster up started, or --token_file)\n"
    "  tessera health --address HOST:PORT [--service liveness]\n"
    "      grpc.health.v1 Check: exit 0 if the daemon there is SERVING: a worker that has registered, a\n"
    "      coordinator with its --expected_devices alive; with --service liveness, one that serves at all\n"
    "\n"
    "Flags can also come from the environment variables named in their help; the command line wins.";

// The credentials directory `up` makes beside the state file.
std::string credentials_dir(const std::string& state_path) { return state_path + "-credentials"; }

// Whether the cluster is the one `up` started (no --coordinator): then its credentials
// directory holds what to present.
bool cluster_of_state() { return absl::GetFlag(FLAGS_coordinator).empty(); }

// The token to present: --token_file's, else `file` of the cluster `up` started (if it has
// credentials), else none (a cluster in the development mode).
absl::StatusOr<std::string> token(const std::string& state_path, const char* file) {
  std::string path = absl::GetFlag(FLAGS_token_file);
  if (path.empty()) {
    if (!cluster_of_state()) return std::string();
    path = absl::StrCat(credentials_dir(state_path), "/", file);
    if (access(path.c_str(), R_OK) != 0) return std::string();
  }
  return read_token_file(path);
}

// What the CLI presents: `token`, over TLS when there is --ca_file or, with `use_state`, the
// cluster `up` started has a CA.
absl::StatusOr<std::shared_ptr<CallIdentity>> cli_identity(const std::string& state_path, const std::string& token,
                                                           bool use_state) {
  std::string ca = absl::GetFlag(FLAGS_ca_file);
  std::string pem;
  if (ca.empty() && use_state) {
    ca = absl::StrCat(credentials_dir(state_path), "/", kCaFile);
    if (access(ca.c_str(), R_OK) != 0) ca.clear();
  }
  if (!ca.empty()) {
    TESSERA_ASSIGN_OR_RETURN(pem, read_file(ca));
  }
  return std::make_shared<CallIdentity>(token, -1, pem);
}

// The cluster's address: --coordinator / $TESSERA_COORDINATOR, else the one in the state file.
absl::StatusOr<std::string> coordinator_address(const std::string& state_path) {
  std::string address = absl::GetFlag(FLAGS_coordinator);
  if (!address.empty()) return address;
  absl::StatusOr<ClusterState> state = read_state(state_path);
  if (!state.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("no --coordinator (or $TESSERA_COORDINATOR) given, and ",
                                                   state.status().message(), " (tessera up writes it)"));
  }
  return state->coordinator_address;
}

std::string format_bytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? absl::StrCat(bytes, " B") : absl::StrFormat("%.1f %s", value, units[unit]);
}

std::string format_uptime(int64_t ms) {
  const int64_t s = ms / 1000;
  if (s < 60) return absl::StrCat(s, "s");
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  if (s < 86400) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  return absl::StrFormat("%dd%02dh", s / 86400, (s / 3600) % 24);
}

// Checks the peer's protocol version over its service's Handshake.
template <typename Stub>
absl::StatusOr<pb::HandshakeReply> handshake(Stub* stub, const std::string& who, absl::Duration timeout) {
  pb::HandshakeRequest req;
  req.set_protocol_version(kProtocolVersion);
  req.set_peer("tessera cli");
  pb::HandshakeReply reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, timeout);
  ctx.set_wait_for_ready(true);  // a daemon that has only just started may refuse a first connect
  TESSERA_RETURN_IF_ERROR(from_grpc(stub->Handshake(&ctx, req, &reply), who));
  TESSERA_RETURN_IF_ERROR(check_protocol_version(reply.protocol_version(), who));
  return reply;
}

// The last lines of a daemon's log, for an error message.
std::string log_tail(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  const size_t from = lines.size() > 5 ? lines.size() - 5 : 0;
  return absl::StrJoin(lines.begin() + static_cast<std::ptrdiff_t>(from), lines.end(), "\n  ");
}

// Waits until `log` has a line containing `needle`; returns that line. Fails at once, with
// the log's tail, if `process` exits first. Polls the file: the daemon writes it, not us.
absl::StatusOr<std::string> wait_for_log_line(const StartedProcess& p, const std::string& needle, absl::Time deadline) {
  while (true) {
    std::ifstream in(p.log);
    for (std::string line; std::getline(in, line);) {
      if (absl::StrContains(line, needle)) return line;
    }
    if (!process_running(p.process)) {
      return absl::UnavailableError(
          absl::StrCat(p.role, " (pid ", p.process.pid, ") exited during startup; ", p.log, ":\n  ", log_tail(p.log)));
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(p.role, " (pid ", p.process.pid, ") printed no '", needle,
                                                      "' in time; ", p.log, ":\n  ", log_tail(p.log)));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

// Stops every process of `state`, workers first; one line per process on stderr.
bool stop_all(const ClusterState& state) {
  bool ok = true;
  for (auto it = state.processes.rbegin(); it != state.processes.rend(); ++it) {
    absl::StatusOr<std::string> how = stop_process(it->process, absl::Seconds(5));
    std::fprintf(stderr, "tessera: %s (pid %d): %s\n", it->role.c_str(), it->process.pid,
                 how.ok() ? how->c_str() : std::string(how.status().message()).c_str());
    ok = ok && how.ok();
  }
  return ok;
}

absl::Status up(const std::string& state_path) {
  const int workers = absl::GetFlag(FLAGS_workers);
  if (workers < 1) return absl::InvalidArgumentError(absl::StrCat("up: --workers must be at least 1, got ", workers));
  absl::StatusOr<ClusterState> previous = read_state(state_path);
  if (previous.ok()) {
    for (const StartedProcess& p : previous->processes) {
      if (process_running(p.process)) {
        return absl::FailedPreconditionError(
            absl::StrCat("up: the cluster at ", previous->coordinator_address, " from state file ", state_path,
                         " is still running (", p.role, ", pid ", p.process.pid, "); run 'tessera down' first"));
      }
    }
  } else if (!absl::IsNotFound(previous.status())) {
    return previous.status();
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  const std::string bin = executable_dir();
  const std::string host = absl::GetFlag(FLAGS_host);
  // Credentials by default: fresh ones for every cluster `up` starts, or the given directory.
  std::string credentials = absl::GetFlag(FLAGS_credentials);
  Credentials tokens;
  if (absl::GetFlag(FLAGS_insecure)) {
    if (!credentials.empty()) return absl::InvalidArgumentError("up: give --credentials or --insecure, not both");
    std::fprintf(stderr, "%s\n", open_mode_warning(tokens, host, "tessera up").c_str());
    if (!is_loopback_host(host)) {
      return absl::InvalidArgumentError(
          absl::StrCat("up: --insecure is for loopback only, but --host is ", host, "; drop --insecure"));
    }
  } else if (credentials.empty()) {
    credentials = credentials_dir(state_path);
    TESSERA_ASSIGN_OR_RETURN(tokens, generate_credentials());
    std::vector<std::string> hosts = {"127.0.0.1", "localhost"};
    if (host != "127.0.0.1" && host != "localhost") hosts.push_back(host);
    TESSERA_RETURN_IF_ERROR(add_tls(&tokens, hosts, workers));
  } else {
    TESSERA_ASSIGN_OR_RETURN(tokens, load_credentials(credentials));
  }

  ClusterState state;
  // Written first: it makes the directory the daemons' logs go to.
  TESSERA_RETURN_IF_ERROR(write_state(state_path, state));
  if (credentials == credentials_dir(state_path)) TESSERA_RETURN_IF_ERROR(write_credentials(credentials, tokens));
  const std::vector<std::string> credentials_flag =
      credentials.empty() ? std::vector<std::string>{} : std::vector<std::string>{"--credentials=" + credentials};
  auto start = [&](const std::string& role, std::vector<std::string> argv) -> absl::StatusOr<StartedProcess> {
    argv.insert(argv.end(), credentials_flag.begin(), credentials_flag.end());
    StartedProcess p;
    p.role = role;
    p.log = absl::StrCat(state_path, "-", role, ".log");
    std::remove(p.log.c_str());
    TESSERA_ASSIGN_OR_RETURN(p.process, DaemonProcess::start(argv, p.log));
    state.processes.push_back(p);
    // Recorded at once: whatever happens next, `down` can stop what is running.
    TESSERA_RETURN_IF_ERROR(write_state(state_path, state));
    return p;
  };
  absl::Status status = [&]() -> absl::Status {
    TESSERA_ASSIGN_OR_RETURN(StartedProcess coordinator,
                             start("coordinator", {bin + "/tessera-coordinator", "--host=" + host,
                                                   absl::StrCat("--port=", absl::GetFlag(FLAGS_port))}));
    TESSERA_ASSIGN_OR_RETURN(std::string line, wait_for_log_line(coordinator, "listening on", deadline));
    state.coordinator_address = last_word(line);
    TESSERA_RETURN_IF_ERROR(write_state(state_path, state));
    for (int i = 0; i < workers; ++i) {
      TESSERA_RETURN_IF_ERROR(
          start(absl::StrCat("worker-", i),
                {bin + "/tessera-worker", "--coordinator=" + state.coordinator_address, "--host=" + host, "--port=0",
                 absl::StrCat("--device_id=", i), absl::StrCat("--name=worker-", i),
                 absl::StrCat("--memory_bytes=", absl::GetFlag(FLAGS_memory_bytes))})
              .status());
    }
    // The coordinator waits for the registrations itself; a worker that dies meanwhile is
    // reported with its log.
    auto stub = pb::Coordinator::NewStub(
        make_channel(state.coordinator_address, std::make_shared<CallIdentity>(tokens.admin, -1, tokens.ca_pem)));
    const std::string who = absl::StrCat("coordinator ", state.coordinator_address);
    while (true) {
      pb::GetTopologyRequest req;
      req.set_min_alive_devices(workers);
      req.set_wait_ms(std::max<int64_t>(0, std::min<int64_t>(500, absl::ToInt64Milliseconds(deadline - absl::Now()))));
      pb::Topology topology;
      grpc::ClientContext ctx;
      set_deadline(&ctx, absl::Milliseconds(req.wait_ms()) + kControlDeadline);
      absl::Status registered = from_grpc(stub->GetTopology(&ctx, req, &topology), who);
      if (registered.ok()) return absl::OkStatus();
      for (const StartedProcess& p : state.processes) {
        if (!process_running(p.process)) {
          return absl::UnavailableError(absl::StrCat(p.role, " (pid ", p.process.pid, ") exited during startup; ",
                                                     p.log, ":\n  ", log_tail(p.log)));
        }
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("up: not all ", workers, " workers registered within ",
                                                        absl::GetFlag(FLAGS_timeout_s), " s: ", registered.message()));
      }
    }
  }();
  if (!status.ok()) {
    stop_all(state);
    std::remove(state_path.c_str());
    return status;
  }
  std::fprintf(stderr, "tessera: coordinator and %d workers up; logs %s-*.log; state %s\n", workers, state_path.c_str(),
               state_path.c_str());
  if (!credentials.empty()) {
    std::fprintf(stderr, "tessera: clients present %s/%s (ConnectOptions::token_file, $TESSERA_TOKEN_FILE)%s\n",
                 credentials.c_str(), kClientTokenFile,
                 tokens.tls() ? absl::StrCat(" and verify the servers with ", credentials, "/", kCaFile,
                                             " (ConnectOptions::ca_file, $TESSERA_CA_FILE)")
                                    .c_str()
                              : "");
  }
  std::printf("%s\n", state.coordinator_address.c_str());
  return absl::OkStatus();
}

absl::Status down(const std::string& state_path) {
  TESSERA_ASSIGN_OR_RETURN(ClusterState state, read_state(state_path));
  const bool ok = stop_all(state);
  if (!ok) return absl::InternalError(absl::StrCat("down: some processes survived; state kept in ", state_path));
  if (std::remove(state_path.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("down: cannot remove ", state_path));
  }
  // The tokens up made die with the cluster.
  remove_credentials(credentials_dir(state_path));
  std::fprintf(stderr, "tessera: cluster %s is down; logs kept in %s-*.log\n", state.coordinator_address.c_str(),
               state_path.c_str());
  return absl::OkStatus();
}

// "P('data', None)" from a spec on the wire, via the sharding model (which checks it).
std::string spec_text(const pb::Mesh& mesh, const pb::PartitionSpec& spec) {
  pb::NamedSharding sharding;
  *sharding.mutable_mesh() = mesh;
  *sharding.mutable_spec() = spec;
  absl::StatusOr<NamedSharding> s = sharding_from_proto(sharding);
  return s.ok() ? s->spec().to_string() : "?";
}

// The cluster's status from the coordinator at `address`, as the holder of `token` sees it.
absl::StatusOr<pb::ClusterStatus> fetch_status(const std::string& address,
                                               const std::shared_ptr<CallIdentity>& identity) {
  const std::string who = absl::StrCat("coordinator ", address);
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  auto stub = pb::Coordinator::NewStub(make_channel(address, identity));
  TESSERA_RETURN_IF_ERROR(handshake(stub.get(), who, std::min(timeout, kConnectDeadline)).status());
  pb::GetClusterStatusRequest req;
  req.set_stats_timeout_ms(2000);
  pb::ClusterStatus cluster;
  grpc::ClientContext ctx;
  set_deadline(&ctx, timeout);
  TESSERA_RETURN_IF_ERROR(from_grpc(stub->GetClusterStatus(&ctx, req, &cluster), who));
  return cluster;
}

// A cell of at most `width` characters (a long error message is cut, saying so).
std::string cut(const std::string& text, size_t width) {
  return text.size() <= width ? text : text.substr(0, width - 3) + "...";
}

void print_status(const std::string& address, const pb::ClusterStatus& cluster) {
  int alive = 0;
  for (const pb::DeviceStatus& d : cluster.devices()) alive += d.info().state() == pb::ALIVE ? 1 : 0;
  std::printf("coordinator %s  up %s  devices %d (%d alive)  arrays %d  executables %d\n", address.c_str(),
              format_uptime(cluster.uptime_ms()).c_str(), cluster.devices_size(), alive, cluster.arrays_size(),
              cluster.executables_size());
  std::printf("\n%-6s %-24s %-6s %-4s %-8s %-24s %-8s %-12s %-12s %-8s %s\n", "DEVICE", "ADDRESS", "STATE", "INC",
              "BUFFERS", "USED / LIMIT", "PROGRAMS", "RUNS (FAIL)", "BLAS", "UPTIME", "LAST ERROR");
  for (const pb::DeviceStatus& d : cluster.devices()) {
    const pb::DeviceInfo& info = d.info();
    const char* state = info.state() == pb::LEFT    ? "left"
                        : info.state() != pb::ALIVE ? "lost"
                        : info.draining()           ? "draining"
                                                    : "alive";
    if (d.has_stats()) {
      const pb::WorkerStats& s = d.stats();
      const std::string last_error =
          s.last_error().empty()
              ? "-"
              : cut(absl::StrCat(format_uptime(s.last_error_age_ms()), " ago: ", s.last_error()), 80);
      std::printf("%-6d %-24s %-6s %-4lu %-8ld %-24s %-8ld %-12s %-12s %-8s %s\n", info.id(), info.address().c_str(),
                  state, static_cast<unsigned long>(info.incarnation()), static_cast<long>(s.buffer_count()),
                  absl::StrCat(format_bytes(s.bytes_used()), " / ", format_bytes(s.memory_limit_bytes())).c_str(),
                  static_cast<long>(s.plans_loaded()),
                  absl::StrCat(s.plan_runs(), " (", s.plan_runs_failed(), ")").c_str(), s.blas_kernel().c_str(),
                  format_uptime(s.uptime_ms()).c_str(), last_error.c_str());
    } else {
      std::printf("%-6d %-24s %-6s %-4lu %-8s %-24s %-8s %-12s %-12s %-8s %s\n", info.id(), info.address().c_str(),
                  state, static_cast<unsigned long>(info.incarnation()), "-",
                  absl::StrCat("- / ", format_bytes(info.memory_bytes())).c_str(), "-", "-", "-", "-",
                  d.stats_error().empty() ? "-" : cut(absl::StrCat("(stats: ", d.stats_error(), ")"), 80).c_str());
    }
  }
  std::printf("\n%-18s %-8s %-14s %-30s %s\n", "ARRAY", "DTYPE", "SHAPE", "SHARDING", "LOST ON");
  for (const pb::ArrayInfo& a : cluster.arrays()) {
    absl::StatusOr<DType> dtype = dtype_from_proto(a.dtype());
    absl::StatusOr<Shape> shape = dtype.ok() ? shape_from_proto(a.shape(), *dtype) : dtype.status();
    absl::StatusOr<NamedSharding> sharding = sharding_from_proto(a.sharding());
    std::printf(
        "%-18lu %-8s %-14s %-30s %s\n", static_cast<unsigned long>(a.array_id()),
        dtype.ok() ? dtype_name(*dtype).c_str() : "?", shape.ok() ? shape_to_string(*shape).c_str() : "?",
        sharding.ok() ? absl::StrCat(sharding->spec().to_string(), " on ", sharding->mesh().to_string()).c_str() : "?",
        a.lost_devices().empty() ? "-" : absl::StrJoin(a.lost_devices(), ",").c_str());
  }
  std::printf("\n%-10s %-26s %-6s %-6s %-40s %s\n", "EXECUTABLE", "MESH", "NODES", "RUNS", "INPUTS", "OUTPUTS");
  for (const pb::ExecutableInfo& e : cluster.executables()) {
    absl::StatusOr<Mesh> mesh = mesh_from_proto(e.mesh());
    std::vector<std::string> inputs, outputs;
    for (const pb::PartitionSpec& s : e.input_specs()) inputs.push_back(spec_text(e.mesh(), s));
    for (const pb::PartitionSpec& s : e.output_specs()) outputs.push_back(spec_text(e.mesh(), s));
    std::printf("%-10lu %-26s %-6ld %-6ld %-40s %s\n", static_cast<unsigned long>(e.executable_id()),
                mesh.ok() ? mesh->to_string().c_str() : "?", static_cast<long>(e.graph_nodes()),
                static_cast<long>(e.executions()), absl::StrJoin(inputs, " ").c_str(),
                absl::StrJoin(outputs, " ").c_str());
  }
}

absl::Status status(const std::string& state_path) {
  TESSERA_ASSIGN_OR_RETURN(std::string address, coordinator_address(state_path));
  TESSERA_ASSIGN_OR_RETURN(std::string admin, token(state_path, kAdminTokenFile));
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<CallIdentity> identity, cli_identity(state_path, admin, cluster_of_state()));
  TESSERA_ASSIGN_OR_RETURN(pb::ClusterStatus cluster, fetch_status(address, identity));
  if (absl::GetFlag(FLAGS_json)) {
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    options.preserve_proto_field_names = true;
    std::string json;
    if (!google::protobuf::util::MessageToJsonString(cluster, &json, options).ok()) {
      return absl::InternalError("status: cannot print the status as JSON");
    }
    std::printf("%s\n", json.c_str());
    return absl::OkStatus();
  }
  print_status(address, cluster);
  return absl::OkStatus();
}

// `status` again every second, on a cleared screen, until interrupted (or --iterations).
// A coordinator that does not answer is reported and asked again.
absl::Status top(const std::string& state_path) {
  TESSERA_ASSIGN_OR_RETURN(std::string address, coordinator_address(state_path));
  TESSERA_ASSIGN_OR_RETURN(std::string admin, token(state_path, kAdminTokenFile));
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<CallIdentity> identity, cli_identity(state_path, admin, cluster_of_state()));
  const int iterations = absl::GetFlag(FLAGS_iterations);
  for (int i = 0; iterations <= 0 || i < iterations; ++i) {
    if (i > 0) absl::SleepFor(absl::Seconds(1));
    absl::StatusOr<pb::ClusterStatus> cluster = fetch_status(address, identity);
    std::printf("\x1b[H\x1b[2J");  // home, clear
    if (cluster.ok()) {
      print_status(address, *cluster);
    } else {
      std::printf("%s\n", cluster.status().ToString().c_str());
    }
    std::printf("\n(every 1 s; Ctrl-C to stop)\n");
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

// grpc.health.v1 Check, as Kubernetes' grpc probes make it (over TLS when the cluster has a CA:
// see cli_identity; health asks for no token).
absl::Status health(const std::string& state_path) {
  const std::string address = absl::GetFlag(FLAGS_address);
  if (address.empty()) return absl::InvalidArgumentError("health: --address HOST:PORT is required");
  const std::string service = absl::GetFlag(FLAGS_service);
  const absl::Duration timeout = std::min(absl::Seconds(absl::GetFlag(FLAGS_timeout_s)), kConnectDeadline);
  TESSERA_ASSIGN_OR_RETURN(std::shared_ptr<CallIdentity> identity, cli_identity(state_path, "", false));
  auto stub = grpc::health::v1::Health::NewStub(make_channel(address, identity));
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  grpc::health::v1::HealthCheckResponse reply;
  grpc::ClientContext ctx;
  set_deadline(&ctx, timeout);
  ctx.set_wait_for_ready(true);  // a daemon that has only just started may refuse a first connect
  TESSERA_RETURN_IF_ERROR(from_grpc(stub->Check(&ctx, req, &reply), absl::StrCat("health: ", address)));
  const std::string what = service.empty() ? "" : absl::StrCat(" (service '", service, "')");
  if (reply.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(
        "health: ", address, what, " answers ",
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(reply.status()),
        service.empty() ? " (a worker that has not registered, or a coordinator with fewer devices alive than its "
                          "--expected_devices)"
                        : ""));
  }
  std::printf("serving: %s%s\n", address.c_str(), what.c_str());
  return absl::OkStatus();
}

// Fresh tokens into a new directory.
absl::Status credentials(const std::vector<char*>& args) {
  if (args.size() != 3) return absl::InvalidArgumentError("credentials: DIR is required");
  const std::string dir = args[2];
  if (access(absl::StrCat(dir, "/", kClusterTokenFile).c_str(), F_OK) == 0) {
    if (absl::GetFlag(FLAGS_keep_existing)) {
      // Kept only if they load: a half-written directory is an error, never silently reused.
      TESSERA_RETURN_IF_ERROR(load_credentials(dir).status());
      std::printf("%s (kept)\n", dir.c_str());
      return absl::OkStatus();
    }
    return absl::AlreadyExistsError(absl::StrCat("credentials: ", dir,
                                                 " holds credentials already; a cluster may "
                                                 "use them: remove them first to make new ones"));
  }
  TESSERA_ASSIGN_OR_RETURN(Credentials tokens, generate_credentials());
  const std::vector<std::string> hosts = absl::StrSplit(absl::GetFlag(FLAGS_tls_hosts), ',', absl::SkipEmpty());
  if (!hosts.empty()) TESSERA_RETURN_IF_ERROR(add_tls(&tokens, hosts, absl::GetFlag(FLAGS_devices)));
  TESSERA_RETURN_IF_ERROR(write_credentials(dir, tokens));
  std::printf("%s\n", dir.c_str());
  return absl::OkStatus();
}

// One daemon's share of a credentials directory (a Kubernetes init container runs this).
absl::Status select_credentials_command(const std::vector<char*>& args) {
  if (args.size() != 4) return absl::InvalidArgumentError("select-credentials: FROM and TO are required");
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role == "coordinator") {
    TESSERA_RETURN_IF_ERROR(tessera::select_credentials(args[2], args[3], CredentialsHolder::kCoordinator, -1));
    std::printf("%s: the coordinator's credentials\n", args[3]);
    return absl::OkStatus();
  }
  if (role != "worker") {
    return absl::InvalidArgumentError(
        absl::StrCat("select-credentials: --role '", role, "' is neither 'coordinator' nor 'worker'"));
  }
  int device = absl::GetFlag(FLAGS_device_id);
  if (const std::string from = absl::GetFlag(FLAGS_device_id_from); !from.empty()) {
    if (device >= 0)
      return absl::InvalidArgumentError("select-credentials: give --device_id or --device_id_from, not both");
    TESSERA_ASSIGN_OR_RETURN(device, device_id_from_environment(from));
  }
  TESSERA_RETURN_IF_ERROR(tessera::select_credentials(args[2], args[3], CredentialsHolder::kWorker, device));
  std::printf("%s: device %d's credentials\n", args[3], device);
  return absl::OkStatus();
}

// A timeline of the running cluster (Client::start_profile / stop_profile, as a client).
absl::Status profile(const std::string& state_path) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("profile: --out FILE is required");
  const int64_t duration_ms = absl::GetFlag(FLAGS_duration_ms);
  if (duration_ms < 1 || duration_ms > 3600 * 1000) {
    return absl::InvalidArgumentError(
        absl::StrCat("profile: --duration_ms ", duration_ms, " is outside [1, 3600000] (one hour)"));
  }
  block_termination_signals();  // before the client's threads: Ctrl-C ends the recording, not the process
  TESSERA_ASSIGN_OR_RETURN(std::string address, coordinator_address(state_path));
  ConnectOptions options;
  options.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  options.token_file = absl::GetFlag(FLAGS_token_file);
  if (options.token_file.empty() && cluster_of_state()) {
    const std::string file = absl::StrCat(credentials_dir(state_path), "/", kClientTokenFile);
    if (access(file.c_str(), R_OK) == 0) options.token_file = file;
  }
  options.ca_file = absl::GetFlag(FLAGS_ca_file);
  if (options.ca_file.empty() && cluster_of_state()) {
    const std::string file = absl::StrCat(credentials_dir(state_path), "/", kCaFile);
    if (access(file.c_str(), R_OK) == 0) options.ca_file = file;
  }
  TESSERA_ASSIGN_OR_RETURN(Client client, Client::connect(address, options));
  TESSERA_RETURN_IF_ERROR(client.start_profile(ProfileOptions{absl::GetFlag(FLAGS_events_per_daemon)}));
  std::fprintf(stderr, "profiling %s for %ld ms\n", address.c_str(), static_cast<long>(duration_ms));
  const int signal = wait_for_termination_signal_for(absl::Milliseconds(duration_ms));
  if (signal != 0) std::fprintf(stderr, "signal %d: stopping early\n", signal);
  TESSERA_RETURN_IF_ERROR(client.stop_profile(out));
  std::printf("%s\n%s.html\n", out.c_str(), out.c_str());
  return absl::OkStatus();
}

absl::Status run_example(const std::string& state_path, const std::vector<char*>& args) {
  if (args.size() < 3)
    return absl::InvalidArgumentError("run-example: NAME is required (device_put, seed_layer, shard_map, mlp_train)");
  const std::string name = args[2];
  const std::string program = absl::StrCat(executable_dir(), "/example_", name);
  if (access(program.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat("run-example: no example '", name, "' (", program, " is missing)"));
  }
  TESSERA_ASSIGN_OR_RETURN(std::string address, coordinator_address(state_path));
  // The example connects with the client token (Client::connect reads $TESSERA_TOKEN_FILE).
  std::string token_file = absl::GetFlag(FLAGS_token_file);
  if (token_file.empty() && cluster_of_state())
    token_file = absl::StrCat(credentials_dir(state_path), "/", kClientTokenFile);
  if (access(token_file.c_str(), R_OK) == 0) setenv("TESSERA_TOKEN_FILE", token_file.c_str(), 1);
  std::string ca_file = absl::GetFlag(FLAGS_ca_file);
  if (ca_file.empty() && cluster_of_state()) ca_file = absl::StrCat(credentials_dir(state_path), "/", kCaFile);
  if (access(ca_file.c_str(), R_OK) == 0) setenv("TESSERA_CA_FILE", ca_file.c_str(), 1);
  std::vector<std::string> argv = {program, "--coordinator=" + address};
  for (size_t i = 3; i < args.size(); ++i) argv.push_back(args[i]);
  std::vector<char*> raw;
  for (std::string& a : argv) raw.push_back(a.data());
  raw.push_back(nullptr);
  std::fflush(stdout);
  execv(program.c_str(), raw.data());
  return absl::InternalError(absl::StrCat("run-example: cannot execute ", program));
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(tessera::kUsage);
  std::vector<char*> args = tessera::parse_flags(argc, argv, "tessera",
                                                 {{"coordinator", "TESSERA_COORDINATOR"},
                                                  {"state", "TESSERA_STATE"},
                                                  {"workers", "TESSERA_WORKERS"},
                                                  {"port", "TESSERA_COORDINATOR_PORT"},
                                                  {"host", "TESSERA_HOST"},
                                                  {"memory_bytes", "TESSERA_WORKER_MEMORY_BYTES"},
                                                  {"token_file", "TESSERA_TOKEN_FILE"},
                                                  {"ca_file", "TESSERA_CA_FILE"},
                                                  {"credentials", "TESSERA_CREDENTIALS"}});
  if (args.size() < 2) {
    std::cerr << tessera::kUsage << "\n";
    return 2;
  }
  const std::string command = args[1];
  std::string state_path = absl::GetFlag(FLAGS_state);
  if (state_path.empty()) state_path = tessera::default_state_path();
  absl::Status status;
  if (command == "up") {
    status = tessera::up(state_path);
  } else if (command == "down") {
    status = tessera::down(state_path);
  } else if (command == "status") {
    status = tessera::status(state_path);
  } else if (command == "top") {
    status = tessera::top(state_path);
  } else if (command == "health") {
    status = tessera::health(state_path);
  } else if (command == "credentials") {
    status = tessera::credentials(args);
  } else if (command == "select-credentials") {
    status = tessera::select_credentials_command(args);
  } else if (command == "profile") {
    status = tessera::profile(state_path);
  } else if (command == "run-example") {
    status = tessera::run_example(state_path, args);
  } else if (command == "help") {
    std::cout << tessera::kUsage << "\n";
    return 0;
  } else {
    std::cerr << "tessera: unknown command '" << command << "'\n" << tessera::kUsage << "\n";
    return 2;
  }
  if (!status.ok()) {
    std::cerr << "tessera: " << status << "\n";
    return 1;
  }
  return 0;
}

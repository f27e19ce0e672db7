// bench_dispatch: latency of a cached jitted elementwise op on small (8, 8) arrays sharded over
// 8 local workers, next to plain gRPC unary round trips measured in the same run: to the
// coordinator over the cluster's own channel (in-process unless --in_process=false), and to a
// health server on 127.0.0.1 over TCP (what the cluster's hops cost before they were in process).
// The call and the round trip are also timed alternating (interleaved_*), so that the ratio is read on one machine
// state.
//
//   bin/bench_dispatch [--iters=200] [--back_to_back=200] [--chain_rounds=5] [--json] [--check_credentials=false]
//                      [--in_process=false] [--profile=/tmp/dispatch.json] [--threads]
//                      [--all_reduce_algorithm=tree|recursive_doubling|direct]
//
// Calls are asynchronous, so it times three things: a call followed by block_until_ready (the
// latency, p50 and p99), the call alone (dispatch: how long the caller is held), and N calls
// issued back to back and then waited for (time per call: what asynchronous dispatch buys),
// both on one input and as a chain where each call consumes the previous one's output (and the
// same for a call holding a scalar psum), alternating --chain_rounds times (medians). It
// also times a jitted shard_map whose body holds one scalar psum over the 8 devices against the
// same body without it (alternating, call + block_until_ready p50 each; it prints the path and
// the all_reduce algorithm the psum took, worker/collectives/algorithms.h), and counts the context
// switches of the call + wait loop per thread (--threads: by thread name, with each group's CPU
// time per call from /proc's schedstat), which is where the hops of one call show.
// --profile records all of that as a timeline (Client::profile), to compare with a run without;
// every run also times a span while no profile runs (core/profile.h) and counts the spans one
// call records, so the cost of the recording points when off is a ratio against the call.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "client/local_cluster.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/profile.h"
#include "core/status.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/health.grpc.pb.h"
#include "proto/health.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "worker/collectives/algorithms.h"

ABSL_FLAG(int, iters, 200, "timed calls");
ABSL_FLAG(int, back_to_back, 200, "calls issued back to back before waiting for them");
ABSL_FLAG(bool, json, false, "one JSON object instead of text");
ABSL_FLAG(std::string, profile, "", "record the timed calls in this trace (and PATH.html); empty: no profile");
ABSL_FLAG(bool, check_credentials, true,
          "the cluster checks tokens (as Client::local does); false: the development mode, to see what the checks "
          "cost");

ABSL_FLAG(bool, threads, false,
          "print the call + wait loop's context switches and CPU time per call by thread name (which threads a "
          "call wakes)");
ABSL_FLAG(std::string, all_reduce_algorithm, "",
          "force the psum's all_reduce to tree, recursive_doubling or direct on every embedded worker (to measure "
          "worker/collectives/algorithms.h on the in-process path); empty: the table's choice");
ABSL_FLAG(int, chain_rounds, 5,
          "how many times the back-to-back phases (independent, dropping, chained; psum independent and chained) "
          "alternate; each figure is the median over the rounds");
ABSL_FLAG(bool, in_process, true,
          "the embedded cluster's channels are in-process ones (LocalOptions::in_process); false: TCP on 127.0.0.1");

namespace {

// Context switches (voluntary and not) of every thread of this process so far: the embedded
// cluster's coordinator and workers run in it too, so this counts the whole path of a call.
long context_switches() {
  long total = 0;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream status(std::string("/proc/self/task/") + e->d_name + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0 || line.rfind("nonvoluntary_ctxt_switches:", 0) == 0) {
        total += std::stol(line.substr(line.find(':') + 1));
      }
    }
  }
  closedir(dir);
  return total;
}

// Per thread group (the thread's name: gRPC names its threads, Tessera's are the process's
// name): threads, context switches (voluntary and not) and CPU nanoseconds (schedstat) so far.
struct ThreadGroup {
  int threads = 0;
  long switches = 0;
  double cpu_ns = 0;
};

std::map<std::string, ThreadGroup> thread_groups() {
  std::map<std::string, ThreadGroup> out;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return out;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const std::string task = std::string("/proc/self/task/") + e->d_name;
    std::string name;
    std::getline(std::ifstream(task + "/comm"), name);
    ThreadGroup& g = out[name];
    ++g.threads;
    std::ifstream status(task + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("voluntary_ctxt_switches:", 0) == 0 || line.rfind("nonvoluntary_ctxt_switches:", 0) == 0) {
        g.switches += std::stol(line.substr(line.find(':') + 1));
      }
    }
    double run_ns = 0;
    if (std::ifstream(task + "/schedstat") >> run_ns) g.cpu_ns += run_ns;
  }
  closedir(dir);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Times jit dispatch against a gRPC round trip.\nUsage: bench_dispatch [--iters=200]");
  tessera::parse_flags(argc, argv, "bench_dispatch", {});
  using namespace tessera;
  const int iters = std::max(10, absl::GetFlag(FLAGS_iters));
  // The round trip below presents the client token too: its credentials come from a directory.
  const std::string dir = absl::StrCat("/tmp/bench-dispatch-credentials-", getpid());
  absl::StatusOr<Credentials> credentials = generate_credentials();
  if (!credentials.ok() || !write_credentials(dir, *credentials).ok()) {
    std::fprintf(stderr, "bench_dispatch: cannot write credentials to %s\n", dir.c_str());
    return 1;
  }
  LocalOptions local;
  local.check_credentials = absl::GetFlag(FLAGS_check_credentials);
  local.credentials_dir = dir;
  local.in_process = absl::GetFlag(FLAGS_in_process);
  local.all_reduce_algorithm = absl::GetFlag(FLAGS_all_reduce_algorithm);
  absl::StatusOr<Client> client = Client::local(8, local);
  absl::StatusOr<Mesh> mesh = client.ok() ? client->make_mesh({4, 2}, {"data", "model"}) : client.status();
  if (!mesh.ok()) {
    std::fprintf(stderr, "bench_dispatch: %s\n", mesh.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Array> x =
      client->device_put(HostArray::ones(DType::kF32, {8, 8}), NamedSharding(*mesh, P("data", "model")));
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  auto fail = [](const absl::Status& status) {
    std::fprintf(stderr, "bench_dispatch: %s\n", status.ToString().c_str());
    return 1;
  };
  const std::string profile_path = absl::GetFlag(FLAGS_profile);
  if (!profile_path.empty()) {
    absl::Status started = client->start_profile();
    if (!started.ok()) return fail(started);
  }
  std::vector<double> jit_us, dispatch_us, rpc_us, drop_us, step_us;
  long switches_before = 0;
  int64_t handed_before = 0;
  // The count of this bench's own cluster (its coordinator's), whoever else runs in the process.
  const std::shared_ptr<internal::LocalCluster> cluster = internal::LocalCluster::find(client->coordinator_address());
  auto handed_over = [&cluster] { return cluster == nullptr ? 0 : cluster->requests_handed_over(); };
  std::map<std::string, ThreadGroup> groups_before;
  const bool per_thread = absl::GetFlag(FLAGS_threads);
  for (int i = 0; i < iters + 10; ++i) {
    if (i == 10 && per_thread) groups_before = thread_groups();
    if (i == 10) switches_before = context_switches();
    if (i == 10) handed_before = handed_over();
    const absl::Time t = absl::Now();
    auto y = std::make_optional(f({*x}));
    const absl::Time dispatched = absl::Now();
    if (!y->ok()) return fail(y->status());
    absl::Status ready = (**y)[0].block_until_ready();
    const absl::Time done = absl::Now();
    if (!ready.ok()) return fail(ready);
    // The drop of the output (a loop's `y = f(x)` drops the previous y): its deletion.
    y.reset();
    const absl::Time dropped = absl::Now();
    if (i >= 10) {
      jit_us.push_back(absl::ToDoubleMicroseconds(done - t));
      dispatch_us.push_back(absl::ToDoubleMicroseconds(dispatched - t));
      drop_us.push_back(absl::ToDoubleMicroseconds(dropped - done));
      step_us.push_back(absl::ToDoubleMicroseconds(dropped - t));
    }
  }
  const double switches_per_call = static_cast<double>(context_switches() - switches_before) / iters;
  // Runs (and deletions) the coordinator handed to embedded workers by a call, not a stream
  // message (coordinator/plan_stream.h's LocalPlanStream): 8 per call in process, 0 over TCP.
  const double handed_per_call = static_cast<double>(handed_over() - handed_before) / iters;
  // The same window by thread group (threads started meanwhile count from 0).
  std::string by_thread;
  if (per_thread) {
    for (const auto& [name, g] : thread_groups()) {
      const ThreadGroup before = groups_before.count(name) ? groups_before[name] : ThreadGroup{};
      const double switches = static_cast<double>(g.switches - before.switches) / iters;
      const double cpu_us = (g.cpu_ns - before.cpu_ns) / 1000.0 / iters;
      if (switches < 0.05 && cpu_us < 0.5) continue;
      absl::StrAppend(&by_thread, "  ", name, " (", g.threads, " threads): ", absl::StrFormat("%.1f", switches),
                      " switches, ", absl::StrFormat("%.0f", cpu_us), " us CPU per call\n");
    }
  }
  // N calls back to back, then one wait for all of them: independent calls on one input, and
  // a chain where each call consumes the previous output (it runs when that one is ready).
  // The chain drops each link's output as the next call takes its place; so that the goal's
  // ratio can be read like for like, independent calls are also timed dropping each output
  // when the next call returns (a deletion per call, as in the chain). The same for a jitted
  // shard_map holding one scalar psum (independent against chained). The phases alternate
  // --chain_rounds times and each figure is the median over the rounds (each ratio the median
  // of the rounds' ratios), so that one slow window on a loaded machine does not decide it.
  const int n = std::max(1, absl::GetFlag(FLAGS_back_to_back));
  const int rounds = std::max(1, absl::GetFlag(FLAGS_chain_rounds));
  Jitted g = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 0.5 + 1.0}; });
  // Values stay bounded along a chain: each block becomes a quarter of itself plus 1/256 of the
  // whole array's sum.
  const ShardMapped bounded_psum = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] * 0.25 + psum(sum(in[0]), {"data", "model"}) * (1.0 / 256)};
      },
      *mesh, {P("data", "model")}, {P("data", "model")});
  Jitted chained_psum = jit([&bounded_psum](const std::vector<Value>& in) { return bounded_psum(in); });
  for (Jitted* k : {&g, &chained_psum}) {  // compiled and loaded before the clock starts, as f was
    absl::StatusOr<std::vector<Array>> warm = (*k)({*x});
    if (!warm.ok()) return fail(warm.status());
    absl::Status ready = (*warm)[0].block_until_ready();
    if (!ready.ok()) return fail(ready);
  }
  // Calls of k back to back on x, then one wait for all of them: us per call.
  auto independent = [&](Jitted& k) -> absl::StatusOr<double> {
    std::vector<Array> outputs;
    const absl::Time t = absl::Now();
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::vector<Array>> y = k({*x});
      if (!y.ok()) return y.status();
      outputs.push_back((*y)[0]);
    }
    TESSERA_RETURN_IF_ERROR(block_until_ready(outputs));
    return absl::ToDoubleMicroseconds(absl::Now() - t) / n;
  };
  // Calls of k each consuming the previous output, then one wait: us per call.
  auto chained = [&](Jitted& k) -> absl::StatusOr<double> {
    Array y = *x;
    const absl::Time t = absl::Now();
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<std::vector<Array>> next = k({y});
      if (!next.ok()) return next.status();
      y = (*next)[0];
    }
    TESSERA_RETURN_IF_ERROR(y.block_until_ready());
    return absl::ToDoubleMicroseconds(absl::Now() - t) / n;
  };
  std::vector<double> independent_round, dropping_round, chained_round, chained_switches_round, chain_ratio;
  std::vector<double> psum_independent_round, psum_chained_round, psum_chain_ratio;
  for (int r = 0; r < rounds; ++r) {
    absl::StatusOr<double> independent_us = independent(f);
    if (!independent_us.ok()) return fail(independent_us.status());
    double dropping_us = 0;
    {
      Array y = *x;
      const absl::Time t = absl::Now();
      for (int i = 0; i < n; ++i) {
        absl::StatusOr<std::vector<Array>> next = f({*x});
        if (!next.ok()) return fail(next.status());
        y = (*next)[0];
      }
      absl::Status ready = y.block_until_ready();
      if (!ready.ok()) return fail(ready);
      dropping_us = absl::ToDoubleMicroseconds(absl::Now() - t) / n;
    }
    const long before = context_switches();
    absl::StatusOr<double> chained_us = chained(g);
    if (!chained_us.ok()) return fail(chained_us.status());
    chained_switches_round.push_back(static_cast<double>(context_switches() - before) / n);
    absl::StatusOr<double> psum_independent_us = independent(chained_psum);
    if (!psum_independent_us.ok()) return fail(psum_independent_us.status());
    absl::StatusOr<double> psum_chained_us = chained(chained_psum);
    if (!psum_chained_us.ok()) return fail(psum_chained_us.status());
    independent_round.push_back(*independent_us);
    dropping_round.push_back(dropping_us);
    chained_round.push_back(*chained_us);
    chain_ratio.push_back(*chained_us / *independent_us);
    psum_independent_round.push_back(*psum_independent_us);
    psum_chained_round.push_back(*psum_chained_us);
    psum_chain_ratio.push_back(*psum_chained_us / *psum_independent_us);
  }
  const double independent_us = median(independent_round), dropping_us = median(dropping_round);
  const double chained_us = median(chained_round), chained_switches = median(chained_switches_round);
  const double chained_over_independent = median(chain_ratio);
  const double chained_over_dropping = median([&] {
    std::vector<double> v;
    for (int r = 0; r < rounds; ++r) v.push_back(chained_round[r] / dropping_round[r]);
    return v;
  }());
  const double psum_independent_us = median(psum_independent_round), psum_chained_us = median(psum_chained_round);
  const double psum_chained_over_independent = median(psum_chain_ratio);
  const auto [chain_ratio_min, chain_ratio_max] = std::minmax_element(chain_ratio.begin(), chain_ratio.end());
  // One scalar psum over the 8 devices in a jitted call, against the same call without it:
  // a shard_map adding to each block the sum of the whole array (psum of the blocks' sums), or
  // of its own block. Alternating, so that both see the same machine.
  std::vector<double> psum_us, no_psum_us;
  {
    auto body = [](bool with_psum) {
      return [with_psum](const std::vector<Value>& in) {
        const Value total = with_psum ? psum(sum(in[0]), {"data", "model"}) : sum(in[0]);
        return std::vector<Value>{in[0] * 2.0 + 1.0 + total};
      };
    };
    const ShardMapped with = shard_map(body(true), *mesh, {P("data", "model")}, {P("data", "model")});
    const ShardMapped without = shard_map(body(false), *mesh, {P("data", "model")}, {P("data", "model")});
    Jitted p = jit([&with](const std::vector<Value>& in) { return with(in); });
    Jitted h = jit([&without](const std::vector<Value>& in) { return without(in); });
    for (int i = 0; i < iters + 10; ++i) {
      for (Jitted* k : {&p, &h}) {
        const absl::Time t = absl::Now();
        absl::StatusOr<std::vector<Array>> y = (*k)({*x});
        if (!y.ok()) return fail(y.status());
        absl::Status ready = (*y)[0].block_until_ready();
        if (!ready.ok()) return fail(ready);
        if (i >= 10) (k == &p ? psum_us : no_psum_us).push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
      }
    }
  }
  if (!profile_path.empty()) {
    absl::Status stopped = client->stop_profile(profile_path);
    if (!stopped.ok()) return fail(stopped);
  }
  // What the recording points cost while no profile runs: a span on a recorder that is off,
  // times the spans one call records (counted in a profile of 20 calls).
  double span_off_ns = 0;
  {
    ProfileRecorder off;
    constexpr int kSpans = 10000000;
    const absl::Time t = absl::Now();
    for (int i = 0; i < kSpans; ++i) {
      ProfileSpan span(&off, "kernel", [] { return std::string("never"); });
    }
    span_off_ns = absl::ToDoubleNanoseconds(absl::Now() - t) / kSpans;
  }
  double spans_per_call = 0;
  {
    const std::string counted = absl::StrCat(dir, "/spans.json");
    absl::Status started = client->start_profile();
    if (!started.ok()) return fail(started);
    constexpr int kCalls = 20;
    for (int i = 0; i < kCalls; ++i) {
      absl::StatusOr<std::vector<Array>> y = f({*x});
      if (!y.ok() || !(*y)[0].block_until_ready().ok()) return fail(y.ok() ? absl::InternalError("call") : y.status());
    }
    absl::Status stopped = client->stop_profile(counted);
    if (!stopped.ok()) return fail(stopped);
    std::ifstream in(counted);
    const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (size_t at = json.find("\"ph\":\"X\""); at != std::string::npos; at = json.find("\"ph\":\"X\"", at + 1)) {
      spans_per_call += 1.0 / kCalls;
    }
    std::remove(counted.c_str());
    std::remove((counted + ".html").c_str());
  }
  auto stub = pb::Coordinator::NewStub(
      make_channel(client->coordinator_address(), std::make_shared<CallIdentity>(credentials->client)));
  for (int i = 0; i < iters + 10; ++i) {
    pb::HandshakeRequest req;
    req.set_protocol_version(kProtocolVersion);
    pb::HandshakeReply reply;
    grpc::ClientContext ctx;
    const absl::Time t = absl::Now();
    stub->Handshake(&ctx, req, &reply);
    if (i >= 10) rpc_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  // The same call and round trip alternating, so that both see the same machine: on a loaded
  // machine the windows above, seconds apart, can differ by 3x.
  std::vector<double> interleaved_jit_us, interleaved_rpc_us;
  for (int i = 0; i < iters + 10; ++i) {
    absl::Time t = absl::Now();
    {
      absl::StatusOr<std::vector<Array>> y = f({*x});
      if (!y.ok()) return fail(y.status());
      absl::Status ready = (*y)[0].block_until_ready();
      if (!ready.ok()) return fail(ready);
    }
    if (i >= 10) interleaved_jit_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
    pb::HandshakeRequest req;
    req.set_protocol_version(kProtocolVersion);
    pb::HandshakeReply reply;
    grpc::ClientContext ctx;
    t = absl::Now();
    stub->Handshake(&ctx, req, &reply);
    if (i >= 10) interleaved_rpc_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  const double interleaved50 = percentile(interleaved_jit_us, 0.5);
  const double interleaved_grpc50 = percentile(interleaved_rpc_us, 0.5);
  // The TCP reference: a unary call to a health server on a loopback port of this process.
  HealthService health;
  absl::StatusOr<std::unique_ptr<HealthPort>> health_port = health.serve_plaintext("127.0.0.1", 0);
  if (!health_port.ok()) return fail(health_port.status());
  auto health_stub =
      grpc::health::v1::Health::NewStub(make_channel(absl::StrCat("127.0.0.1:", (*health_port)->port())));
  std::vector<double> tcp_us;
  for (int i = 0; i < iters + 10; ++i) {
    grpc::health::v1::HealthCheckRequest req;
    grpc::health::v1::HealthCheckResponse reply;
    grpc::ClientContext ctx;
    const absl::Time t = absl::Now();
    health_stub->Check(&ctx, req, &reply);
    if (i >= 10) tcp_us.push_back(absl::ToDoubleMicroseconds(absl::Now() - t));
  }
  const double p50 = percentile(jit_us, 0.5), p99 = percentile(jit_us, 0.99), grpc50 = percentile(rpc_us, 0.5);
  const double tcp50 = percentile(tcp_us, 0.5);
  const char* transport = local.in_process && !credentials->tls() ? "in_process" : "tcp";
  const double dispatch50 = percentile(dispatch_us, 0.5);
  const double drop50 = percentile(drop_us, 0.5), step50 = percentile(step_us, 0.5);
  const double psum50 = percentile(psum_us, 0.5), no_psum50 = percentile(no_psum_us, 0.5);
  // The path and algorithm of the psum's all_reduce (one f32 over the 8 workers), as the
  // workers choose them: Client::local's workers over TCP keep shared memory between them.
  const Path psum_path = local.in_process ? Path::kInProcess : Path::kShm;
  const std::string psum_algorithm =
      local.all_reduce_algorithm.empty()
          ? algorithm_name(choose_algorithm(CollectiveKind::kAllReduce, sizeof(float), 8, psum_path))
          : local.all_reduce_algorithm + " (forced)";
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"transport\": \"%s\", \"p50_us\": %.1f, \"p99_us\": %.1f, \"grpc_p50_us\": %.1f, "
        "\"grpc_tcp_p50_us\": %.1f, \"dispatch_p50_us\": %.1f, "
        "\"back_to_back\": %d, \"back_to_back_us_per_call\": %.1f, \"back_to_back_dropping_us_per_call\": %.1f, "
        "\"chained_us_per_call\": %.1f, \"chained_over_dropping\": %.2f, "
        "\"context_switches_per_call\": %.1f, \"chained_context_switches_per_call\": %.1f, \"profiled\": %s, "
        "\"span_off_ns\": %.2f, \"spans_per_call\": %.1f, \"drop_p50_us\": %.1f, \"step_p50_us\": %.1f, "
        "\"jit_over_rpc\": %.2f, \"chained_over_independent\": %.2f, \"psum_p50_us\": %.1f, "
        "\"no_psum_p50_us\": %.1f, \"psum_over_no_psum\": %.2f, \"psum_path\": \"%s\", \"psum_algorithm\": \"%s\", "
        "\"chain_rounds\": %d, \"chained_over_independent_min\": %.2f, \"chained_over_independent_max\": %.2f, "
        "\"psum_back_to_back_us_per_call\": %.1f, \"psum_chained_us_per_call\": %.1f, "
        "\"psum_chained_over_independent\": %.2f, \"interleaved_p50_us\": %.1f, \"interleaved_grpc_p50_us\": %.1f, "
        "\"interleaved_jit_over_rpc\": %.2f, \"runs_handed_over_per_call\": %.1f}\n",
        transport, p50, p99, grpc50, tcp50, dispatch50, n, independent_us, dropping_us, chained_us,
        chained_over_dropping, switches_per_call, chained_switches, profile_path.empty() ? "false" : "true",
        span_off_ns, spans_per_call, drop50, step50, p50 / grpc50, chained_over_independent, psum50, no_psum50,
        psum50 / no_psum50, path_name(psum_path), psum_algorithm.c_str(), rounds, *chain_ratio_min, *chain_ratio_max,
        psum_independent_us, psum_chained_us, psum_chained_over_independent, interleaved50, interleaved_grpc50,
        interleaved50 / interleaved_grpc50, handed_per_call);
  } else {
    std::printf(
        "cached jit (8, 8) on 8 workers (%s), call + block_until_ready: p50 %.0f us, p99 %.0f us; gRPC unary "
        "round trip p50 %.0f us on the cluster's channel (jit/rpc %.1fx), %.0f us over TCP loopback (jit/rpc "
        "%.1fx)\n"
        "dispatch alone (the call returns): p50 %.0f us\n"
        "drop of the ready output: p50 %.0f us (drop/rpc %.2fx); a loop's step (call + wait + drop): p50 %.0f us "
        "(step/rpc %.1fx)\n"
        "%d calls back to back, then block_until_ready (medians of %d rounds): %.0f us per call (independent), "
        "%.0f us per call (each consuming the previous output; chained/independent %.2fx, rounds %.2f-%.2fx); "
        "independent calls dropping each output as the chain does: %.0f us per call (chained/dropping %.2fx)\n"
        "the same with a jitted shard_map holding one scalar psum: %.0f us per call (independent), %.0f us per "
        "call (chained; chained/independent %.2fx)\n"
        "context switches per call, all threads (client, coordinator, workers): %.1f (call + block_until_ready), "
        "%.1f (chained); runs handed to the workers in process, not on streams: %.1f per call\n"
        "a jitted shard_map with one scalar psum over the 8 devices (all_reduce %s on the %s path), call + "
        "block_until_ready: p50 %.0f us; the same without the psum %.0f us (psum/no psum %.2fx)\n",
        transport, p50, p99, grpc50, p50 / grpc50, tcp50, p50 / tcp50, dispatch50, drop50, drop50 / grpc50, step50,
        step50 / grpc50, n, rounds, independent_us, chained_us, chained_over_independent, *chain_ratio_min,
        *chain_ratio_max, dropping_us, chained_over_dropping, psum_independent_us, psum_chained_us,
        psum_chained_over_independent, switches_per_call, chained_switches, handed_per_call, psum_algorithm.c_str(),
        path_name(psum_path), psum50, no_psum50, psum50 / no_psum50);
    std::printf(
        "the call and the round trip on the cluster's channel alternating: p50 %.0f us and %.0f us (jit/rpc %.2fx)\n"
        "issue #18 goals, this run: jit/rpc %.2fx (at most 2), chained/independent %.2fx (at most 1.2), psum/no psum "
        "%.2fx (at most 1.5)\n",
        interleaved50, interleaved_grpc50, interleaved50 / interleaved_grpc50, p50 / grpc50, chained_over_independent,
        psum50 / no_psum50);
    if (per_thread) std::printf("by thread, call + block_until_ready:\n%s", by_thread.c_str());
    std::printf(
        "%s; with no profile running a span costs %.2f ns and a call records %.0f spans (all daemons): "
        "%.5f%% of the call's p50\n",
        profile_path.empty() ? "not profiled" : "profiled (the timed calls above were recorded)", span_off_ns,
        spans_per_call, 100.0 * span_off_ns * spans_per_call / 1000.0 / p50);
  }
  for (const char* f : {kClusterTokenFile, kClientTokenFile, kAdminTokenFile}) {
    std::remove(absl::StrCat(dir, "/", f).c_str());
  }
  rmdir(dir.c_str());
  return 0;
}

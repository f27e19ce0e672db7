// bench_soak: the trust issue's memory goal (#17): each daemon's resident memory stays flat
// (within 10 %) over 30,000 calls with 4,000 distinct programs and a flood of 10,000 forged or
// never-started Exchange messages. Real processes: a tessera-coordinator and --workers
// tessera-worker processes on 127.0.0.1 checking tokens (credentials of the run's own), and
// this process as their client.
//
//   bin/bench_soak [--workers=8] [--programs=4000] [--calls=30000] [--flood=10000] [--json]
//
// Phases: (1) warm-up: --warmup distinct programs, one call each (past the coordinator's
// program-cache bound, so it evicts from here on); the baseline RSS of every daemon is read
// (VmRSS of /proc/PID/status). (2) the rest of the distinct programs, one call each, (3) the
// remaining calls on the last 16 programs, (4) the flood on worker 0's Exchange service, half
// claiming another device than the stream authenticated (dropped and counted), half for op ids
// that never start (kept in the mailbox until its per-peer cap or their time-to-live, 3 s
// here), (5) once worker 0 holds none of them. (bench_programs measures the program-cache part
// alone, against a reference run with nothing evicted; this one adds the flood and reads every
// daemon.) RSS is read after each phase; the figure is each
// daemon's largest reading over its baseline. Every 97th
// call's result is fetched and checked against the host (x * c for its program's c).
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"

ABSL_FLAG(int, workers, 8, "tessera-worker processes");
ABSL_FLAG(int, programs, 4000, "distinct programs (x * c, one c each)");
ABSL_FLAG(int, warmup, 2000,
          "of the distinct programs, how many run before the baseline (default: more than the coordinator's "
          "--max_programs, 1024, so its program cache is full and evicting at the baseline)");
ABSL_FLAG(int, calls, 30000, "calls in all (at least --programs)");
ABSL_FLAG(int, flood, 10000, "Exchange messages sent to worker 0 (half forged, half for ops that never start)");
ABSL_FLAG(bool, json, false, "one JSON object per daemon instead of text");

namespace tessera {
namespace {

int fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "bench_soak: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

// One Exchange stream to `stub` carrying `count` messages of 1 KiB from a stream authenticated
// as device `as`: even ones claim device `as + 1` (forged), odd ones are `as`'s own for op ids
// far beyond any run's (never started). Returns how the worker ended the stream.
grpc::Status flood(pb::Worker::Stub* stub, int as, int count, uint64_t first_op) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(60));
  pb::ExchangeReply reply;
  auto writer = stub->Exchange(&ctx, &reply);
  for (int k = 0; k < count; ++k) {
    pb::ExchangeMessage m;
    m.set_source_device(k % 2 == 0 ? as + 1 : as);
    m.set_op_id(first_op + static_cast<uint64_t>(k));
    m.set_data(std::string(1024, '\x7f'));
    if (!writer->Write(m)) break;
  }
  writer->WritesDone();
  return writer->Finish();
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  using namespace tessera;
  absl::SetProgramUsageMessage(
      "Resident memory of each daemon over many calls, programs and forged messages (issue #17's goal).\n"
      "Usage: bench_soak [--workers=8] [--programs=4000] [--calls=30000] [--flood=10000] [--json]");
  parse_flags(argc, argv, "bench_soak", {});
  const int workers = std::max(2, absl::GetFlag(FLAGS_workers));
  const int programs = std::max(4, absl::GetFlag(FLAGS_programs));
  const int calls = std::max(programs, absl::GetFlag(FLAGS_calls));
  const int flood_count = std::max(0, absl::GetFlag(FLAGS_flood));
  const int warmup = std::clamp(absl::GetFlag(FLAGS_warmup), 1, programs);
  const bool json = absl::GetFlag(FLAGS_json);

  absl::StatusOr<Credentials> credentials = generate_credentials();
  if (!credentials.ok()) return fail("credentials", credentials.status());
  const std::string dir = absl::StrCat("/tmp/tessera-soak-", getpid());
  absl::Status written = write_credentials(dir, *credentials);
  if (!written.ok()) return fail("credentials", written);
  struct Cleanup {
    std::string dir;
    ~Cleanup() { remove_credentials(dir); }
  } cleanup{dir};
  absl::StatusOr<ProcessCluster> cluster =
      ProcessCluster::start(executable_dir(), workers, {"--credentials=" + dir},
                            {"--credentials=" + dir, "--memory_bytes=268435456", "--mailbox_ttl_ms=3000"});
  if (!cluster.ok()) return fail("starting the cluster", cluster.status());
  ConnectOptions options;
  options.min_devices = workers;
  options.timeout = absl::Seconds(30);
  options.token = credentials->client;
  absl::StatusOr<Client> client = Client::connect(cluster->address, options);
  if (!client.ok()) return fail("connect", client.status());
  absl::StatusOr<Mesh> mesh = client->make_mesh({workers}, {"x"});
  if (!mesh.ok()) return fail("make_mesh", mesh.status());
  HostArray host(DType::kF32, {static_cast<int64_t>(workers), 16});
  for (int64_t i = 0; i < num_elements(host.shape()); ++i)
    host.mutable_values<float>()[i] = 0.25f * static_cast<float>(i);
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  if (!x.ok()) return fail("device_put", x.status());

  std::vector<pid_t> pids = {cluster->coordinator->pid()};
  std::vector<std::string> names = {"coordinator"};
  for (int w = 0; w < workers; ++w) {
    pids.push_back(cluster->workers[w]->pid());
    names.push_back(absl::StrCat("worker ", w));
  }
  // By daemon, the RSS after each phase: warm-up (the baseline), distinct programs, repeated calls, flood.
  std::vector<std::vector<int64_t>> rss(pids.size());
  const auto read_rss = [&] {
    for (size_t d = 0; d < pids.size(); ++d) rss[d].push_back(rss_kib(pids[d]));
  };

  int done = 0, checked = 0;
  const auto call = [&](int program, bool check) -> absl::Status {
    const float c = 0.5f + static_cast<float>(program);
    Jitted f = jit([c](const std::vector<Value>& in) { return std::vector<Value>{in[0] * c}; });
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> out, f({*x}));
    if (++done % 97 == 0 || check) {
      TESSERA_ASSIGN_OR_RETURN(HostArray got, out[0].fetch());
      for (int64_t i = 0; i < num_elements(host.shape()); ++i) {
        if (got.values<float>()[i] != host.values<float>()[i] * c) {
          return absl::InternalError(absl::StrCat("program ", program, " element ", i, ": ", got.values<float>()[i],
                                                  ", want ", host.values<float>()[i] * c));
        }
      }
      ++checked;
    }
    return absl::OkStatus();
  };
  const absl::Time start = absl::Now();
  for (int p = 0; p < warmup; ++p) {
    absl::Status s = call(p, false);
    if (!s.ok()) return fail("warm-up", s);
  }
  read_rss();
  for (int p = warmup; p < programs; ++p) {
    absl::Status s = call(p, false);
    if (!s.ok()) return fail("distinct programs", s);
  }
  read_rss();
  for (int k = done; k < calls; ++k) {
    absl::Status s = call(programs - 1 - k % 16, false);
    if (!s.ok()) return fail("repeated calls", s);
  }
  read_rss();
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  if (!devices.ok()) return fail("devices", devices.status());
  auto stub =
      pb::Worker::NewStub(make_channel((*devices)[0].address, std::make_shared<CallIdentity>(credentials->cluster, 1)));
  int sent = 0, streams = 0;
  while (sent < flood_count && streams < 1000) {
    const int batch = std::min(1000, flood_count - sent);
    grpc::Status s = flood(stub.get(), 1, batch, (uint64_t{1} << 60) + static_cast<uint64_t>(sent));
    ++streams;
    if (!s.ok() && s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      return fail("flood", absl::InternalError(s.error_message()));
    }
    sent += batch;
  }
  read_rss();
  // The never-started ops' messages outlive their time-to-live (--mailbox_ttl_ms=3000): wait
  // (at most 10 s) until worker 0 has dropped them all, then read the RSS once more.
  auto admin =
      pb::Worker::NewStub(make_channel((*devices)[0].address, std::make_shared<CallIdentity>(credentials->admin)));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  int64_t pending = -1;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(5));
    pb::WorkerStats stats;
    grpc::Status s = admin->GetStats(&ctx, pb::GetStatsRequest(), &stats);
    if (!s.ok()) return fail("GetStats", absl::InternalError(s.error_message()));
    pending = stats.collective_messages_pending();
    if (pending == 0) break;
    absl::SleepFor(absl::Milliseconds(200));  // polling a counter, bounded by the deadline
  }
  read_rss();
  // Everyone else is still served: one more checked call.
  absl::Status after = call(0, true);
  if (!after.ok()) return fail("a call after the flood", after);
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (pending != 0) {
    std::printf(
        "worker 0 still held %lld unconsumed Exchange messages 10 s after the flood (their time-to-live is 3 s)\n",
        static_cast<long long>(pending));
  }
  if (!json) {
    std::printf(
        "%d calls (%d distinct programs, %d results checked), %d Exchange messages to worker 0 in %d streams, "
        "%.1f s\n",
        done, programs, checked, sent, streams, seconds);
    std::printf("RSS in KiB after each phase, and the largest over the warm-up's\n");
    std::printf("%-12s %10s %10s %10s %10s %10s %10s\n", "daemon", "warm-up", "programs", "calls", "flood", "ttl",
                "peak/base");
  }
  double worst = 0;
  for (size_t d = 0; d < pids.size(); ++d) {
    const std::vector<int64_t>& r = rss[d];
    const int64_t peak = *std::max_element(r.begin(), r.end());
    const double ratio = r[0] > 0 ? static_cast<double>(peak) / static_cast<double>(r[0]) : 0;
    worst = std::max(worst, ratio);
    if (json) {
      std::printf(
          "{\"daemon\": \"%s\", \"warmup_kib\": %ld, \"programs_kib\": %ld, \"calls_kib\": %ld, "
          "\"flood_kib\": %ld, \"after_ttl_kib\": %ld, \"ratio\": %.3f}\n",
          names[d].c_str(), r[0], r[1], r[2], r[3], r[4], ratio);
    } else {
      std::printf("%-12s %10ld %10ld %10ld %10ld %10ld %9.2fx\n", names[d].c_str(), r[0], r[1], r[2], r[3], r[4],
                  ratio);
    }
  }
  if (!json) std::printf("largest growth over the warm-up: %.2fx (goal <= 1.10x)\n", worst);
  return 0;
}

// bench_programs: the trust issue's memory goal (#17): each daemon's resident memory stays flat
// (within 10 %) over 30,000 calls with 4,000 distinct programs and a flood of 10,000 forged or
// never-started Exchange messages. Real processes: a tessera-coordinator and --workers
// tessera-worker processes on 127.0.0.1 checking tokens (credentials of the run's own), and
// this process as their client; started twice, with the compile caches bounded
// (--max_programs, the coordinator's default 1024) and, as the reference, with bounds beyond
// the program count (nothing evicted: what the daemons did before the bound).
//
//   bin/bench_programs [--workers=8] [--programs=4000] [--warmup=2000] [--calls=30000]
//                      [--flood=10000] [--max_programs=1024] [--reference=true] [--json]
//
// Phases of each run: (1) warm-up: --warmup distinct programs (x * c + 1, one c each), one
// call each (past the program-cache bound, so it evicts from here on); the baseline RSS of
// every daemon is read (VmRSS of /proc/PID/status). (2) the rest of the distinct programs, one
// call each, (3) the remaining calls on the last 16 programs, (4) the flood on worker 0's
// Exchange service, half claiming another device than the stream authenticated (dropped and
// counted), half for op ids that never start (kept in the mailbox until its per-peer cap or
// their time-to-live, 3 s here), (5) once worker 0 holds none of them. RSS is read after each
// phase; the figure is each daemon's largest reading over its baseline. Every 97th call's
// result, and the last call's, is fetched and checked against the host.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/credentials.h"
#include "core/daemon.h"
#include "core/status.h"
#include "core/subprocess.h"
#include "grpcpp/grpcpp.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"

ABSL_FLAG(int, workers, 8, "tessera-worker processes");
ABSL_FLAG(int, programs, 4000, "distinct programs (x * c + 1, one c each)");
ABSL_FLAG(int, warmup, 2000,
          "of the distinct programs, how many run before the baseline (default: more than the coordinator's "
          "--max_programs, so its program cache is full and evicting at the baseline)");
ABSL_FLAG(int, calls, 30000, "calls in all (at least --programs)");
ABSL_FLAG(int, flood, 10000, "Exchange messages sent to worker 0 (half forged, half for ops that never start)");
ABSL_FLAG(int, max_programs, 1024, "the coordinator's program-cache bound in the bounded run");
ABSL_FLAG(bool, reference, true, "also run the reference (bounds beyond the program count)");
ABSL_FLAG(bool, json, false, "one JSON object per daemon and run instead of text");

namespace tessera {
namespace {

constexpr int kPhases = 5;
const char* const kPhaseNames[kPhases] = {"warm-up", "programs", "calls", "flood", "ttl"};

// One Exchange stream to `stub` carrying `count` messages of 1 KiB from a stream authenticated
// as device `as`, declaring `as`'s registration (`as_handshake`, so that the stream is taken):
// even ones claim device `as + 1` (forged), odd ones are `as`'s own for op ids far beyond any
// run's (never started). Returns how the worker ended the stream.
grpc::Status flood(pb::Worker::Stub* stub, int as, const pb::HandshakeReply& as_handshake, int count,
                   uint64_t first_op) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(60));
  ctx.AddMetadata(kEpochKey, absl::StrCat(as_handshake.epoch()));
  ctx.AddMetadata(kIncarnationKey, absl::StrCat(as_handshake.incarnation()));
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

// One run's readings: by daemon (coordinator first), the RSS in KiB after each phase.
struct Run {
  int max_programs = 0;
  std::vector<std::string> names;
  std::vector<std::vector<int64_t>> rss;
  int calls = 0, checked = 0, sent = 0, streams = 0;
  int64_t pending = -1;  // worker 0's unconsumed Exchange messages at the end
  double seconds = 0;
};

absl::StatusOr<Run> run(const Credentials& credentials, const std::string& credentials_dir, int max_programs,
                        int max_plans) {
  const int workers = std::max(2, absl::GetFlag(FLAGS_workers));
  const int programs = std::max(4, absl::GetFlag(FLAGS_programs));
  const int calls = std::max(programs, absl::GetFlag(FLAGS_calls));
  const int flood_count = std::max(0, absl::GetFlag(FLAGS_flood));
  const int warmup = std::clamp(absl::GetFlag(FLAGS_warmup), 1, programs);
  TESSERA_ASSIGN_OR_RETURN(
      ProcessCluster cluster,
      ProcessCluster::start(executable_dir(), workers,
                            {"--credentials=" + credentials_dir, absl::StrCat("--max_programs=", max_programs)},
                            {"--credentials=" + credentials_dir, absl::StrCat("--max_plans=", max_plans),
                             "--memory_bytes=268435456", "--mailbox_ttl_ms=3000"}));
  ConnectOptions options;
  options.min_devices = workers;
  options.timeout = absl::Seconds(30);
  options.token = credentials.client;
  TESSERA_ASSIGN_OR_RETURN(Client client, Client::connect(cluster.address, options));
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, client.make_mesh({workers}, {"x"}));
  HostArray host(DType::kF32, {static_cast<int64_t>(workers), 16});
  for (int64_t i = 0; i < num_elements(host.shape()); ++i)
    host.mutable_values<float>()[i] = 0.25f * static_cast<float>(i);
  TESSERA_ASSIGN_OR_RETURN(Array x, client.device_put(host, NamedSharding(mesh, P("x"))));

  Run r;
  r.max_programs = max_programs;
  std::vector<pid_t> pids = {cluster.coordinator->pid()};
  r.names = {"coordinator"};
  for (int w = 0; w < workers; ++w) {
    pids.push_back(cluster.workers[w]->pid());
    r.names.push_back(absl::StrCat("worker ", w));
  }
  r.rss.resize(pids.size());
  const auto read_rss = [&] {
    for (size_t d = 0; d < pids.size(); ++d) r.rss[d].push_back(rss_kib(pids[d]));
  };
  const auto call = [&](int program, bool check) -> absl::Status {
    const float c = 0.5f + static_cast<float>(program);
    Jitted f = jit([c](const std::vector<Value>& in) { return std::vector<Value>{in[0] * c + 1}; });
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> out, f({x}));
    if (++r.calls % 97 == 0 || check) {
      TESSERA_ASSIGN_OR_RETURN(HostArray got, out[0].fetch());
      for (int64_t i = 0; i < num_elements(host.shape()); ++i) {
        const float want = host.values<float>()[i] * c + 1;
        if (got.values<float>()[i] != want) {
          return absl::InternalError(
              absl::StrCat("program ", program, " element ", i, ": ", got.values<float>()[i], ", want ", want));
        }
      }
      ++r.checked;
    }
    return absl::OkStatus();
  };
  const absl::Time start = absl::Now();
  for (int p = 0; p < warmup; ++p) TESSERA_RETURN_IF_ERROR(call(p, false));
  read_rss();
  for (int p = warmup; p < programs; ++p) TESSERA_RETURN_IF_ERROR(call(p, false));
  read_rss();
  while (r.calls < calls) TESSERA_RETURN_IF_ERROR(call(programs - 1 - r.calls % 16, false));
  read_rss();

  TESSERA_ASSIGN_OR_RETURN(std::vector<Device> devices, client.devices());
  auto stub =
      pb::Worker::NewStub(make_channel(devices[0].address, std::make_shared<CallIdentity>(credentials.cluster, 1)));
  pb::HandshakeReply device_1;
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::HandshakeRequest req;
    req.set_protocol_version(kProtocolVersion);
    grpc::Status s =
        pb::Worker::NewStub(make_channel(devices[1].address, std::make_shared<CallIdentity>(credentials.client)))
            ->Handshake(&ctx, req, &device_1);
    if (!s.ok()) return absl::InternalError(absl::StrCat("Handshake of device 1: ", s.error_message()));
  }
  while (r.sent < flood_count && r.streams < 1000) {
    const int batch = std::min(1000, flood_count - r.sent);
    grpc::Status s = flood(stub.get(), 1, device_1, batch, (uint64_t{1} << 60) + static_cast<uint64_t>(r.sent));
    ++r.streams;
    if (!s.ok() && s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      return absl::InternalError(absl::StrCat("flood: ", s.error_message()));
    }
    r.sent += batch;
  }
  read_rss();
  // The never-started ops' messages outlive their time-to-live (--mailbox_ttl_ms=3000): wait
  // (at most 10 s) until worker 0 has dropped them all, then read the RSS once more.
  auto admin = pb::Worker::NewStub(make_channel(devices[0].address, std::make_shared<CallIdentity>(credentials.admin)));
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(5));
    pb::WorkerStats stats;
    grpc::Status s = admin->GetStats(&ctx, pb::GetStatsRequest(), &stats);
    if (!s.ok()) return absl::InternalError(absl::StrCat("GetStats: ", s.error_message()));
    r.pending = stats.collective_messages_pending();
    if (r.pending == 0) break;
    absl::SleepFor(absl::Milliseconds(200));  // polling a counter, bounded by the deadline
  }
  read_rss();
  // Everyone else is still served: one more checked call.
  TESSERA_RETURN_IF_ERROR(call(0, true));
  r.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return r;
}

// Each daemon's largest reading over its warm-up reading.
double ratio(const std::vector<int64_t>& rss) {
  return rss[0] > 0 ? static_cast<double>(*std::max_element(rss.begin(), rss.end())) / static_cast<double>(rss[0]) : 0;
}

void print(const Run& r, bool reference, bool json) {
  const char* label = reference ? "reference" : "bounded";
  if (!json) {
    std::printf(
        "%s run (--max_programs=%d): %d calls, %d results checked, %d Exchange messages to worker 0 in %d "
        "streams, %.1f s\n",
        label, r.max_programs, r.calls, r.checked, r.sent, r.streams, r.seconds);
    if (r.pending != 0) {
      std::printf("worker 0 still held %lld unconsumed Exchange messages 10 s after the flood (time-to-live 3 s)\n",
                  static_cast<long long>(r.pending));
    }
    std::printf("%-12s", "RSS KiB");
    for (const char* phase : kPhaseNames) std::printf(" %10s", phase);
    std::printf(" %10s\n", "peak/base");
  }
  double worst = 0;
  for (size_t d = 0; d < r.rss.size(); ++d) {
    const std::vector<int64_t>& v = r.rss[d];
    worst = std::max(worst, ratio(v));
    if (json) {
      std::printf(
          "{\"run\": \"%s\", \"daemon\": \"%s\", \"warmup_kib\": %ld, \"programs_kib\": %ld, \"calls_kib\": %ld, "
          "\"flood_kib\": %ld, \"after_ttl_kib\": %ld, \"ratio\": %.3f}\n",
          label, r.names[d].c_str(), v[0], v[1], v[2], v[3], v[4], ratio(v));
    } else {
      std::printf("%-12s", r.names[d].c_str());
      for (int64_t kib : v) std::printf(" %10ld", kib);
      std::printf(" %9.2fx\n", ratio(v));
    }
  }
  if (!json) std::printf("%s: largest growth over the warm-up %.2fx (goal <= 1.10x)\n", label, worst);
}

int fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "bench_programs: %s: %s\n", what.c_str(), s.ToString().c_str());
  return 1;
}

int main_impl() {
  absl::StatusOr<Credentials> credentials = generate_credentials();
  if (!credentials.ok()) return fail("credentials", credentials.status());
  const std::string dir = absl::StrCat("/tmp/tessera-bench-programs-", getpid());
  absl::Status written = write_credentials(dir, *credentials);
  if (!written.ok()) return fail("credentials", written);
  struct Cleanup {
    std::string dir;
    ~Cleanup() { remove_credentials(dir); }
  } cleanup{dir};
  const bool json = absl::GetFlag(FLAGS_json);
  const int bound = absl::GetFlag(FLAGS_max_programs);
  absl::StatusOr<Run> bounded = run(*credentials, dir, bound, 4096);
  if (!bounded.ok()) return fail("the bounded run", bounded.status());
  print(*bounded, false, json);
  if (absl::GetFlag(FLAGS_reference)) {
    const int unbounded = 10 * absl::GetFlag(FLAGS_programs) + 1000;
    absl::StatusOr<Run> reference = run(*credentials, dir, unbounded, unbounded);
    if (!reference.ok()) return fail("the reference run", reference.status());
    print(*reference, true, json);
  }
  return 0;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Resident memory of each daemon over many calls, programs and forged messages (issue #17's goal).\n"
      "Usage: bench_programs [--workers=8] [--programs=4000] [--warmup=2000] [--calls=30000] [--flood=10000]\n"
      "                      [--max_programs=1024] [--reference=true] [--json]");
  tessera::parse_flags(argc, argv, "bench_programs", {});
  return tessera::main_impl();
}

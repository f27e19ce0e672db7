// The timeline (Client::profile, docs/design.md "Timeline"): a known program run under a
// profile on Client::local(8) and on real processes, and the trace's structure and content
// checked: every device's kernels and collectives (with their bytes, algorithm and path), each
// message's flow start matched by one finish on the receiving device, spans nested per lane,
// everything inside the profile's window after the clocks' alignment. The HTML viewer is opened
// in headless Chromium and its rows are checked in the DOM it rendered.
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using google::protobuf::Struct;
using PbValue = google::protobuf::Value;
using ::testing::AllOf;
using ::testing::HasSubstr;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A trace event as the checks need it.
struct Event {
  std::string ph, name, cat, id;
  int64_t pid = 0, tid = 0;
  double ts = 0, dur = 0;
  std::map<std::string, std::string> args;
};

struct Trace {
  std::vector<Event> events;  // in file order, metadata left out
  std::map<int64_t, std::string> process_names;
  Struct metadata;
};

Trace parse(const std::string& json) {
  Struct root;
  auto parsed = google::protobuf::util::JsonStringToMessage(json, &root);
  EXPECT_TRUE(parsed.ok()) << parsed.ToString();
  Trace t;
  t.metadata = root.fields().at("metadata").struct_value();
  for (const PbValue& v : root.fields().at("traceEvents").list_value().values()) {
    const auto& f = v.struct_value().fields();
    Event e;
    e.ph = f.at("ph").string_value();
    e.pid = static_cast<int64_t>(f.at("pid").number_value());
    e.name = f.at("name").string_value();
    if (e.ph == "M") {
      if (e.name == "process_name")
        t.process_names[e.pid] = f.at("args").struct_value().fields().at("name").string_value();
      continue;
    }
    e.tid = static_cast<int64_t>(f.at("tid").number_value());
    e.ts = f.at("ts").number_value();
    e.cat = f.at("cat").string_value();
    if (e.ph == "X") e.dur = f.at("dur").number_value();
    if (f.count("id") > 0) e.id = f.at("id").string_value();
    if (f.count("args") > 0) {
      for (const auto& [k, a] : f.at("args").struct_value().fields()) e.args[k] = a.string_value();
    }
    t.events.push_back(std::move(e));
  }
  return t;
}

const std::set<std::string> kAlgorithms = {"tree", "recursive_doubling", "direct", "ring", "chain"};

// What every trace must satisfy whatever the program: a name per process, per-lane order and
// nesting, the window, matched flows each bound to a collective at both ends (and some flows,
// unless the program sends no `messages`).
void check_structure(const Trace& t, bool messages = true) {
  const double window = t.metadata.fields().at("window_us").number_value();
  ASSERT_GT(window, 0);
  constexpr double kRounding = 0.002;  // ts and dur are each printed to 1 ns
  std::map<std::pair<int64_t, int64_t>, std::vector<const Event*>> lanes;
  std::map<std::string, std::vector<const Event*>> starts, finishes;
  for (const Event& e : t.events) {
    SCOPED_TRACE(absl::StrCat(e.ph, " ", e.name, " pid ", e.pid, " ts ", e.ts));
    EXPECT_TRUE(t.process_names.count(e.pid) > 0) << "no process_name for pid " << e.pid;
    EXPECT_GE(e.ts, -kRounding);
    EXPECT_LE(e.ts + e.dur, window + kRounding);
    EXPECT_GE(e.dur, 0);
    lanes[{e.pid, e.tid}].push_back(&e);
    if (e.ph == "s") starts[e.id].push_back(&e);
    if (e.ph == "f") finishes[e.id].push_back(&e);
  }
  for (const auto& [lane, events] : lanes) {
    SCOPED_TRACE(absl::StrCat("lane pid ", lane.first, " tid ", lane.second));
    std::vector<double> open_ends;  // the spans enclosing the current one
    double last = -1;
    for (const Event* e : events) {
      EXPECT_GE(e->ts, last) << e->name << ": timestamps go back on one lane";
      last = e->ts;
      if (e->ph != "X") continue;
      while (!open_ends.empty() && open_ends.back() <= e->ts + kRounding) open_ends.pop_back();
      if (!open_ends.empty()) {
        EXPECT_LE(e->ts + e->dur, open_ends.back() + kRounding) << e->name << " overlaps a span it does not nest in";
      }
      open_ends.push_back(e->ts + e->dur);
    }
  }
  // Flow ends sit inside a collective on their lane (how viewers bind the arrows).
  auto in_collective = [&](const Event& f) {
    for (const Event* x : lanes[{f.pid, f.tid}]) {
      if (x->ph == "X" && x->cat == "collective" && x->ts <= f.ts + kRounding && f.ts <= x->ts + x->dur + kRounding) {
        return true;
      }
    }
    return false;
  };
  EXPECT_EQ(starts.empty(), !messages);
  // NTP's bound: a daemon's estimated offset is off by at most half the round trip it was
  // measured over, so after the alignment a message may seem taken up to half of both round
  // trips before it was sent.
  std::map<int64_t, double> half_rtt_us;
  for (const PbValue& d : t.metadata.fields().at("daemons").list_value().values()) {
    half_rtt_us[static_cast<int64_t>(d.struct_value().fields().at("pid").number_value())] =
        d.struct_value().fields().at("rtt_ns").number_value() / 2000.0;
  }
  for (const auto& [id, s] : starts) {
    SCOPED_TRACE(absl::StrCat("flow ", id));
    ASSERT_EQ(s.size(), 1u);
    ASSERT_EQ(finishes[id].size(), 1u) << "a message sent by pid " << s[0]->pid << " was never taken";
    const Event& f = *finishes[id][0];
    EXPECT_NE(f.pid, s[0]->pid) << "a message to its own device";
    EXPECT_GE(f.ts + half_rtt_us[f.pid] + half_rtt_us[s[0]->pid] + kRounding, s[0]->ts)
        << "taken before it was sent, by more than the clocks' alignment can be off";
    EXPECT_TRUE(in_collective(*s[0]));
    EXPECT_TRUE(in_collective(f));
  }
  for (const auto& [id, f] : finishes) EXPECT_EQ(starts.count(id), 1u) << "flow " << id << " finished unstarted";
  EXPECT_EQ(t.metadata.fields().at("dropped_events").number_value(), 0);
}

// pid of device d in the trace, by its process name ("device d (address)").
int64_t device_pid(const Trace& t, int d) {
  for (const auto& [pid, name] : t.process_names) {
    if (absl::StartsWith(name, absl::StrCat("device ", d, " ("))) return pid;
  }
  ADD_FAILURE() << "no row for device " << d;
  return -1;
}

std::vector<const Event*> spans(const Trace& t, int64_t pid, const std::string& cat, const std::string& name) {
  std::vector<const Event*> out;
  for (const Event& e : t.events) {
    if (e.ph == "X" && e.pid == pid && e.cat == cat && e.name == name) out.push_back(&e);
  }
  return out;
}

// y = all_gather(psum(x_block @ w_block, "model"), "data", tiled): x (16, 8) on P("data",
// "model"), w (8, 4) on P("model", None), a (4, 2) mesh. JAX's semantics
// (jax/_src/lax/parallel.py, psum and all_gather's docstrings): the psum adds the two partial
// products of a row block, the tiled all_gather concatenates the four row blocks, so y = x @ w
// on every device. check_vma is off: JAX types all_gather's result as varying along 'data'
// (docs/notebooks/shard_map.md), though a tiled gather's result is the same on every device.
Jitted matmul_psum_all_gather(const Mesh& mesh) {
  ShardMapped f = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{all_gather(psum(matmul(in[0], in[1]), "model"), "data", 0, true)};
      },
      mesh, {P("data", "model"), P("model", None)}, {P()}, ShardMapOptions{false});
  return jit([f](const std::vector<Value>& in) { return f(in); });
}

HostArray host_matmul(const HostArray& x, const HostArray& w) {
  HostArray y(DType::kF32, {16, 4});
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 4; ++j) {
      float acc = 0;
      for (int k = 0; k < 8; ++k) acc += x.values<float>()[i * 8 + k] * w.values<float>()[k * 4 + j];
      y.mutable_values<float>()[i * 4 + j] = acc;
    }
  }
  return y;
}

// Runs the program `calls` times under a profile written to `path`; checks the result.
void run_profiled(Client& client, const std::string& path, int calls) {
  absl::StatusOr<Mesh> mesh = client.make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray x = HostArray::arange(DType::kF32, {16, 8});
  const HostArray w = HostArray::arange(DType::kF32, {8, 4});
  absl::StatusOr<ProfileScope> profile = client.profile(path);
  ASSERT_TRUE(profile.ok()) << profile.status();
  absl::StatusOr<Array> xd = client.device_put(x, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(xd.ok()) << xd.status();
  absl::StatusOr<Array> wd = client.device_put(w, NamedSharding(*mesh, P("model", None)));
  ASSERT_TRUE(wd.ok()) << wd.status();
  Jitted f = matmul_psum_all_gather(*mesh);
  for (int i = 0; i < calls; ++i) {
    absl::StatusOr<std::vector<Array>> y = f({*xd, *wd});
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<HostArray> got = (*y)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(*got == host_matmul(x, w));
  }
  absl::Status done = profile->finish();
  ASSERT_TRUE(done.ok()) << done;
  absl::Status again = profile->finish();
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
}

// Each device: a dot_general kernel per call, an all_reduce over the 2 devices of its 'model'
// row and an all_gather over the 4 of its 'data' column per call, each of a (4, 4) f32 block.
void check_program(const Trace& t, int calls) {
  for (int d = 0; d < 8; ++d) {
    SCOPED_TRACE(absl::StrCat("device ", d));
    const int64_t pid = device_pid(t, d);
    EXPECT_EQ(spans(t, pid, "kernel", "dot_general").size(), static_cast<size_t>(calls));
    EXPECT_EQ(spans(t, pid, "plan", "plan").size(), static_cast<size_t>(calls));
    for (const auto& [name, group] :
         std::vector<std::pair<std::string, std::string>>{{"all_reduce", "2"}, {"all_gather", "4"}}) {
      std::vector<const Event*> c = spans(t, pid, "collective", name);
      ASSERT_EQ(c.size(), static_cast<size_t>(calls)) << name;
      for (const Event* e : c) {
        EXPECT_EQ(e->args.at("bytes"), "64") << name;  // a (4, 4) f32 block
        EXPECT_EQ(e->args.at("group_size"), group) << name;
        EXPECT_TRUE(kAlgorithms.count(e->args.at("algorithm")) > 0) << e->args.at("algorithm");
        EXPECT_TRUE(e->args.at("path") == "shm" || e->args.at("path") == "grpc" || e->args.at("path") == "in_process")
            << e->args.at("path");
      }
    }
    // The shards put here (x's and w's blocks), and the fetches of the replicated result, each
    // read from its lowest-numbered replica (docs/design.md, "Data path"): device 0.
    EXPECT_EQ(spans(t, pid, "transfer", "put_shard").size(), 2u);
    EXPECT_EQ(spans(t, pid, "transfer", "get_shard").size(), d == 0 ? static_cast<size_t>(calls) : 0u);
  }
  const int64_t client_pid = [&] {
    for (const auto& [pid, name] : t.process_names) {
      if (name == "client") return pid;
    }
    return int64_t{-1};
  }();
  EXPECT_EQ(spans(t, client_pid, "client", "jit call").size(), static_cast<size_t>(calls));
  EXPECT_EQ(spans(t, client_pid, "client", "device_put").size(), 2u);
  EXPECT_EQ(spans(t, client_pid, "client", "fetch").size(), static_cast<size_t>(calls));
  int64_t coordinator_pid = -1;
  for (const auto& [pid, name] : t.process_names) {
    if (absl::StartsWith(name, "coordinator")) coordinator_pid = pid;
  }
  EXPECT_EQ(spans(t, coordinator_pid, "compile", "compile").size(), 1u);  // then the client's cache
  EXPECT_EQ(spans(t, coordinator_pid, "dispatch", "execute").size(), static_cast<size_t>(calls));
  // Each daemon's clock offset and round trip, and the client's, are in the metadata.
  const auto& daemons = t.metadata.fields().at("daemons").list_value().values();
  EXPECT_EQ(daemons.size(), 10);  // the client, the coordinator, 8 devices
  for (const PbValue& d : daemons) {
    EXPECT_TRUE(d.struct_value().fields().count("clock_offset_ns") > 0);
    EXPECT_GT(d.struct_value().fields().at("rtt_ns").number_value(), 0);
  }
}

std::string test_dir() {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/profile_test_", getpid());
  mkdir(dir.c_str(), 0755);
  return dir;
}

TEST(Profile, AJittedMatmulWithPsumAndAllGatherOnLocal8) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string path = test_dir() + "/local8.json";
  run_profiled(*client, path, 3);
  const Trace t = parse(read_file(path));
  check_structure(t);
  check_program(t, 3);
  // The viewer was written next to it, the trace inside.
  const std::string html = read_file(path + ".html");
  EXPECT_TRUE(absl::StrContains(html, "<script id=\"trace\" type=\"application/json\">"));
  EXPECT_TRUE(absl::StrContains(html, "\"all_gather\""));
  EXPECT_FALSE(absl::StrContains(html, "https://")) << "the viewer must need no network";
}

// A wait that blocks shows on the client's row (docs/design.md, "Timeline": only a wait that
// blocks is recorded): block_until_ready right after a call whose run takes far longer than
// its dispatch (40 chained (256, 256) matmuls per device) blocks, and its span is inside the
// call's window, after the jit call's start, with the call's id.
TEST(Profile, AWaitThatBlocksIsOnTheClientsRow) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({8}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray x = HostArray::ones(DType::kF32, {8 * 256, 256});
  absl::StatusOr<Array> xd = client->device_put(x, NamedSharding(*mesh, P("x", None)));
  ASSERT_TRUE(xd.ok()) << xd.status();
  Jitted chain = jit([](const std::vector<Value>& in) {
    Value v = in[0];
    for (int i = 0; i < 40; ++i) v = tanh(matmul(v, full({256, 256}, 1.0 / 256)));
    return std::vector<Value>{v};
  });
  ASSERT_TRUE(chain({*xd}).ok());  // compiled outside the profile
  const std::string path = test_dir() + "/wait.json";
  absl::StatusOr<ProfileScope> profile = client->profile(path);
  ASSERT_TRUE(profile.ok()) << profile.status();
  absl::StatusOr<std::vector<Array>> y = chain({*xd});
  ASSERT_TRUE(y.ok()) << y.status();
  ASSERT_TRUE((*y)[0].block_until_ready().ok());
  ASSERT_TRUE(profile->finish().ok());
  const Trace t = parse(read_file(path));
  check_structure(t, /*messages=*/false);
  int64_t client_pid = -1;
  for (const auto& [pid, name] : t.process_names) {
    if (name == "client") client_pid = pid;
  }
  const std::vector<const Event*> calls = spans(t, client_pid, "client", "jit call");
  const std::vector<const Event*> waits = spans(t, client_pid, "client", "wait");
  ASSERT_EQ(calls.size(), 1u);
  ASSERT_EQ(waits.size(), 1u);
  EXPECT_GE(waits[0]->ts, calls[0]->ts);
  EXPECT_GT(waits[0]->dur, 0);
  EXPECT_FALSE(waits[0]->args.at("call").empty());
}

TEST(Profile, StartAndStopAreChecked) {
  absl::StatusOr<Client> client = Client::local(2);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::Status none = client->stop_profile(test_dir() + "/none.json");
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition) << none;
  EXPECT_THAT(std::string(none.message()), HasSubstr("no profile is running"));
  absl::Status bad = client->start_profile(ProfileOptions{0});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_THAT(std::string(bad.message()), HasSubstr("events_per_daemon 0"));
  ASSERT_TRUE(client->start_profile().ok());
  absl::Status twice = client->start_profile();
  EXPECT_EQ(twice.code(), absl::StatusCode::kFailedPrecondition) << twice;
  absl::Status unwritable = client->stop_profile("/nonexistent-dir/trace.json");
  EXPECT_EQ(unwritable.code(), absl::StatusCode::kInternal) << unwritable;
  EXPECT_THAT(std::string(unwritable.message()), HasSubstr("/nonexistent-dir/trace.json"));
}

// One profile at a time per cluster: a second profiler restarting the daemons' recording makes
// the first one's stop fail, naming a daemon, rather than hand it the other's events.
TEST(Profile, AnotherProfileRestartingTheDaemonsIsNamed) {
  absl::StatusOr<Client> first = Client::local(2);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<Client> second = Client::connect(first->coordinator_address());
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_TRUE(first->start_profile().ok());
  ASSERT_TRUE(second->start_profile().ok());
  const std::string dir = test_dir();
  absl::Status stopped = first->stop_profile(dir + "/first.json");
  EXPECT_EQ(stopped.code(), absl::StatusCode::kAborted) << stopped;
  EXPECT_THAT(std::string(stopped.message()), HasSubstr("another profile restarted its recording"));
  EXPECT_TRUE(second->stop_profile(dir + "/second.json").ok());
}

// A ring smaller than the events: the oldest go, and the trace says how many.
TEST(Profile, ARingTooSmallDropsTheOldestAndCountsThem) {
  absl::StatusOr<Client> client = Client::local(2);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({2}, {"data"});
  ASSERT_TRUE(mesh.ok());
  const std::string path = test_dir() + "/small.json";
  ASSERT_TRUE(client->start_profile(ProfileOptions{4}).ok());
  const HostArray x = HostArray::arange(DType::kF32, {4, 4});
  absl::StatusOr<Array> xd = client->device_put(x, NamedSharding(*mesh, P("data", None)));
  ASSERT_TRUE(xd.ok());
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{exp(in[0])}; });
  for (int i = 0; i < 10; ++i) {
    absl::StatusOr<std::vector<Array>> y = f({*xd});
    ASSERT_TRUE(y.ok()) << y.status();
    ASSERT_TRUE((*y)[0].block_until_ready().ok());  // a call still running at the stop is cut short
  }
  ASSERT_TRUE(client->stop_profile(path).ok());
  const Trace t = parse(read_file(path));
  // A put, 10 plan spans and 10 kernel spans on each device, 4 kept.
  for (int d = 0; d < 2; ++d) {
    int64_t kept = 0;
    for (const Event& e : t.events) kept += e.pid == device_pid(t, d) ? 1 : 0;
    EXPECT_EQ(kept, 4);
  }
  EXPECT_GE(t.metadata.fields().at("dropped_events").number_value(), 2 * 17);
}

TEST(Profile, RealProcessesAlignedToTheCoordinatorsClock) {
  absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(TESSERA_BIN_DIR, 8, {}, {"--memory_bytes=268435456"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ConnectOptions options;
  options.min_devices = 8;
  options.timeout = absl::Seconds(20);
  absl::StatusOr<Client> client = Client::connect(cluster->address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string path = test_dir() + "/processes.json";
  run_profiled(*client, path, 2);
  const Trace t = parse(read_file(path));
  check_structure(t);
  check_program(t, 2);
}

// The same program on daemons whose clocks really differ: each runs in its own time namespace
// (time_namespaces(7), `unshare --time --monotonic S`: its CLOCK_MONOTONIC, the profile's clock,
// runs S seconds ahead of the test's), as processes on different hosts or boots would. The
// trace must come out as on one clock, and the offsets in its metadata must be the ones set,
// within the estimate's bound (half of each of the two round trips). Needs root (a time
// namespace needs CAP_SYS_ADMIN); skipped with the reason otherwise.
TEST(Profile, DaemonsWhoseClocksDifferByDaysAreAligned) {
  if (geteuid() != 0) GTEST_SKIP() << "a time namespace needs root (CAP_SYS_ADMIN)";
  absl::StatusOr<std::pair<int, std::string>> probe =
      Subprocess::run({"/usr/bin/unshare", "--time", "--monotonic", "1", "true"}, absl::Seconds(10));
  ASSERT_TRUE(probe.ok()) << probe.status();
  ASSERT_EQ(probe->first, 0) << "unshare --time failed: " << probe->second;

  constexpr int64_t kCoordinatorSkewS = 7 * 86400;
  auto device_skew_s = [](int d) { return int64_t{d} * 86400 + 12345 + (d % 3) * 3600; };
  auto in_namespace = [](int64_t skew_s, std::vector<std::string> argv) {
    argv.insert(argv.begin(), {"/usr/bin/unshare", "--time", "--monotonic", absl::StrCat(skew_s)});
    return argv;
  };
  const std::string bin = TESSERA_BIN_DIR;
  absl::StatusOr<std::unique_ptr<Subprocess>> coordinator =
      Subprocess::spawn(in_namespace(kCoordinatorSkewS, {bin + "/tessera-coordinator", "--port=0"}));
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  absl::StatusOr<std::string> line = (*coordinator)->read_line_with("listening on", absl::Seconds(20));
  ASSERT_TRUE(line.ok()) << line.status();
  const std::string address = last_word(*line);
  std::vector<std::unique_ptr<Subprocess>> workers;
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<std::unique_ptr<Subprocess>> w = Subprocess::spawn(
        in_namespace(device_skew_s(d), {bin + "/tessera-worker", "--coordinator=" + address, "--port=0",
                                        absl::StrCat("--device_id=", d), "--memory_bytes=268435456"}));
    ASSERT_TRUE(w.ok()) << w.status();
    workers.push_back(*std::move(w));
  }
  ConnectOptions options;
  options.min_devices = 8;
  options.timeout = absl::Seconds(20);
  absl::StatusOr<Client> client = Client::connect(address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string path = test_dir() + "/skewed.json";
  run_profiled(*client, path, 2);
  const Trace t = parse(read_file(path));
  check_structure(t);
  check_program(t, 2);

  // Each row's offset from the coordinator's clock is the skew set, give or take the two
  // estimates' errors (each at most half its round trip).
  std::map<std::string, std::pair<double, double>> offsets;  // name: offset, round trip (ns)
  for (const PbValue& d : t.metadata.fields().at("daemons").list_value().values()) {
    const auto& f = d.struct_value().fields();
    offsets[f.at("name").string_value()] = {f.at("clock_offset_ns").number_value(), f.at("rtt_ns").number_value()};
  }
  ASSERT_EQ(offsets.count("coordinator"), 1u);
  const double coordinator_rtt = offsets["coordinator"].second;
  auto expect_offset = [&](const std::string& name, int64_t skew_s) {
    SCOPED_TRACE(name);
    ASSERT_EQ(offsets.count(name), 1u);
    const double want = static_cast<double>(skew_s - kCoordinatorSkewS) * 1e9;
    EXPECT_NEAR(offsets[name].first, want, (offsets[name].second + coordinator_rtt) / 2 + 1000);
  };
  expect_offset("client", 0);
  for (int d = 0; d < 8; ++d) expect_offset(absl::StrCat("device ", d), device_skew_s(d));
}

// docs/guide.md, "Seeing where the time goes": its command tracing the seed program, run as the
// guide writes it (build/bin/ is this build's, /tmp/ this test's directory), and the trace
// checked against what the seed program does (examples/seed_layer.cc): x (16, 8) on P("data",
// None) and w (8, 4) on P(None, "model") over a (4, 2) mesh, jit(tanh(x @ w)), which needs no
// communication (each device multiplies its row block of x by its column block of w), then a
// fetch of y on P("data", "model"), whose 8 blocks are distinct.
TEST(Profile, TheGuidesTraceOfTheSeedProgram) {
  const std::string guide = read_file(TESSERA_SOURCE_DIR "/docs/guide.md");
  const size_t section = guide.find("\n## Seeing where the time goes\n");
  ASSERT_NE(section, std::string::npos) << "docs/guide.md has no section 'Seeing where the time goes'";
  const size_t end = guide.find("\n## ", section + 1);
  const std::string text = guide.substr(section, end == std::string::npos ? std::string::npos : end - section);
  std::string command;
  bool in_sh = false;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line == "```sh")
      in_sh = true;
    else if (line == "```")
      in_sh = false;
    else if (in_sh && absl::StartsWith(line, "build/bin/example_seed_layer "))
      command = std::string(line);
  }
  ASSERT_FALSE(command.empty()) << "no `build/bin/example_seed_layer ...` line in a ```sh block of the section";
  command = command.substr(0, command.find('#'));  // the comment
  const std::string dir = test_dir();
  std::vector<std::string> argv;
  std::string path;
  for (absl::string_view word : absl::StrSplit(command, ' ', absl::SkipEmpty())) {
    std::string w =
        absl::StrReplaceAll(word, {{"build/bin/", absl::StrCat(TESSERA_BIN_DIR, "/")}, {"/tmp/", dir + "/"}});
    if (absl::StartsWith(w, "--profile=")) path = w.substr(std::string("--profile=").size());
    argv.push_back(std::move(w));
  }
  ASSERT_FALSE(path.empty()) << "the guide's command has no --profile=FILE: " << command;
  absl::StatusOr<std::pair<int, std::string>> ran = Subprocess::run(argv, absl::Seconds(120));
  ASSERT_TRUE(ran.ok()) << ran.status();
  ASSERT_EQ(ran->first, 0) << ran->second;
  EXPECT_THAT(ran->second, HasSubstr(absl::StrCat("timeline: ", path, " and ", path, ".html")));
  ASSERT_FALSE(read_file(path + ".html").empty());

  const Trace t = parse(read_file(path));
  check_structure(t, /*messages=*/false);
  for (int d = 0; d < 8; ++d) {
    SCOPED_TRACE(absl::StrCat("device ", d));
    const int64_t pid = device_pid(t, d);
    EXPECT_EQ(spans(t, pid, "plan", "plan").size(), 1u);
    EXPECT_EQ(spans(t, pid, "kernel", "dot_general").size(), 1u);
    EXPECT_EQ(spans(t, pid, "kernel", "tanh").size(), 1u);
    for (const Event& e : t.events) EXPECT_FALSE(e.pid == pid && e.cat == "collective") << e.name;
    EXPECT_EQ(spans(t, pid, "transfer", "get_shard").size(), 1u);  // its block of y
  }
  int64_t client_pid = -1, coordinator_pid = -1;
  for (const auto& [pid, name] : t.process_names) {
    if (name == "client") client_pid = pid;
    if (absl::StartsWith(name, "coordinator")) coordinator_pid = pid;
  }
  EXPECT_EQ(spans(t, client_pid, "client", "device_put").size(), 2u);
  EXPECT_EQ(spans(t, client_pid, "client", "jit call").size(), 1u);
  EXPECT_EQ(spans(t, client_pid, "client", "fetch").size(), 1u);
  EXPECT_EQ(spans(t, coordinator_pid, "compile", "compile").size(), 1u);
  EXPECT_EQ(spans(t, coordinator_pid, "dispatch", "execute").size(), 1u);
}

// Runs chromium headless on `args` (at most 60 s); its output.
std::string chromium(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {"chromium",      "--headless",     "--no-sandbox",
                                   "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage"};
  argv.insert(argv.end(), args.begin(), args.end());
  absl::StatusOr<std::pair<int, std::string>> r = Subprocess::run(argv, absl::Seconds(60));
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return "";
  EXPECT_EQ(r->first, 0) << r->second;
  return r->second;
}

// The attribute `name` of the first tag in `text`.
std::string attribute(const std::string& text, const std::string& name) {
  const std::string key = name + "=\"";
  const size_t at = text.find(key);
  if (at == std::string::npos) return "";
  const size_t begin = at + key.size();
  return text.substr(begin, text.find('"', begin) - begin);
}

TEST(ProfileHtml, HeadlessChromiumRendersARowPerDevice) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  const std::string path = test_dir() + "/viewer.json";
  run_profiled(*client, path, 2);
  const Trace t = parse(read_file(path));
  const std::string url = "file://" + path + ".html";
  const std::string dom = chromium({"--virtual-time-budget=5000", "--dump-dom", url});
  ASSERT_TRUE(absl::StrContains(dom, "data-rendered=\"true\"")) << dom.substr(0, 2000);
  // One row per process, in order: the client, the coordinator, devices 0-7.
  std::vector<std::string> rows = absl::StrSplit(dom, "<div class=\"row\"");
  ASSERT_EQ(rows.size(), 11u) << dom.substr(0, 2000);
  EXPECT_EQ(attribute(rows[1], "data-name"), "client");
  EXPECT_TRUE(absl::StartsWith(attribute(rows[2], "data-name"), "coordinator (")) << attribute(rows[2], "data-name");
  for (int d = 0; d < 8; ++d) {
    const std::string& row = rows[3 + d];
    SCOPED_TRACE(attribute(row, "data-name"));
    EXPECT_TRUE(absl::StartsWith(attribute(row, "data-name"), absl::StrCat("device ", d, " (")));
    // Every span of the device's in the trace is drawn, with its category.
    auto count = [&row](const std::string& cat) {
      int n = 0;
      for (size_t at = row.find("data-cat=\"" + cat + "\""); at != std::string::npos;
           at = row.find("data-cat=\"" + cat + "\"", at + 1)) {
        ++n;
      }
      return n;
    };
    std::map<std::string, int> expected;
    int total = 0;
    for (const Event& e : t.events) {
      if (e.ph == "X" && e.pid == device_pid(t, d)) {
        ++expected[e.cat];
        ++total;
      }
    }
    EXPECT_EQ(attribute(row, "data-events"), absl::StrCat(total));
    for (const std::string cat : {"kernel", "collective", "plan", "transfer"}) {
      EXPECT_EQ(count(cat), expected[cat]) << cat;
    }
    EXPECT_EQ(expected["collective"], 4);  // 2 calls of an all_reduce and an all_gather
    // What hovering a collective shows: its name, category, times and arguments.
    const std::string tip = attribute(row.substr(row.find("data-cat=\"collective\"")), "data-tip");
    EXPECT_THAT(tip, AllOf(HasSubstr("[collective]"), HasSubstr("duration "), HasSubstr("bytes: 64"),
                           HasSubstr("algorithm: "), HasSubstr("path: ")))
        << tip;
  }
  EXPECT_TRUE(absl::StrContains(dom, "<line"));  // the messages' arrows
  // The time axis under the rows: ticks from 0 at a constant step of 1, 2 or 5 x 10^k us,
  // labelled, within the window.
  const size_t axis = dom.find("<div class=\"row axis\"");
  ASSERT_NE(axis, std::string::npos) << "no time axis";
  std::vector<double> ticks;
  for (size_t at = dom.find("data-us=\"", axis); at != std::string::npos; at = dom.find("data-us=\"", at + 1)) {
    double us = 0;
    ASSERT_TRUE(absl::SimpleAtod(attribute(dom.substr(at), "data-us"), &us));
    ticks.push_back(us);
  }
  ASSERT_GE(ticks.size(), 3u);
  EXPECT_EQ(ticks[0], 0);
  const double step = ticks[1];
  const double decade = std::pow(10, std::floor(std::log10(step)));
  EXPECT_TRUE(step == decade || step == 2 * decade || step == 5 * decade) << step;
  for (size_t i = 1; i < ticks.size(); ++i) EXPECT_NEAR(ticks[i] - ticks[i - 1], step, step * 1e-9);
  EXPECT_LE(ticks.back(), t.metadata.fields().at("window_us").number_value() + 0.002);
  EXPECT_THAT(dom.substr(axis), HasSubstr(">0.0 us<"));
  // The screenshot, kept as the test's artifact in the build tree.
  const std::string artifacts = std::string(TESSERA_BINARY_DIR) + "/test-artifacts";
  mkdir(artifacts.c_str(), 0755);
  const std::string png = artifacts + "/profile_timeline.png";
  std::remove(png.c_str());
  chromium({"--virtual-time-budget=5000", "--window-size=1600,900", "--screenshot=" + png, url});
  struct stat st {};
  ASSERT_EQ(stat(png.c_str(), &st), 0) << png;
  EXPECT_GT(st.st_size, 10000) << png;
}

}  // namespace
}  // namespace tessera

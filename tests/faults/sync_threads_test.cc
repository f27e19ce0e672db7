// The daemons' bound on gRPC's synchronous-server threads (--max_sync_threads; issue #17
// item 5), with real processes: long-waiting synchronous calls occupy every thread of the
// coordinator (GetTopology waiting for devices that never come) or of a worker (PutShard
// streams that send nothing); the next synchronous call fails RESOURCE_EXHAUSTED at once (gRPC
// 1.51's "Server Threadpool Exhausted", src/cpp/server/server_cc.cc), while the callback
// methods (Execute, the workers' Heartbeat, RunPlans, Exchange) go on serving, no device is
// marked lost, and the daemon serves everything again once the waits end. Every wait has a
// deadline; teardown kills only this test's processes, by pid.
#include <signal.h>
#include <sys/wait.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/health.grpc.pb.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Threads of each daemon's synchronous server: one polls, so kThreads - 1 calls run at once.
constexpr int kThreads = 4;
constexpr int kHeld = kThreads - 1;
// Calls started to occupy them: the ones beyond kHeld are refused.
constexpr int kStarted = kThreads + 2;
// What gRPC answers a synchronous call that finds no thread (server_cc.cc).
constexpr char kExhausted[] = "Server Threadpool Exhausted";
constexpr absl::Duration kBound = absl::Seconds(20);  // a bound on a hang, not a speed goal

// How calls started with gRPC's callback API ended.
class Ends {
 public:
  void add(const grpc::Status& s) {
    absl::MutexLock lock(&mu_);
    statuses_.push_back(s);
  }
  // Whether at least n ended within `timeout`.
  bool await(size_t n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto ended = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return statuses_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&ended), timeout);
  }
  std::vector<grpc::Status> statuses() {
    absl::MutexLock lock(&mu_);
    return statuses_;
  }

 private:
  absl::Mutex mu_;
  std::vector<grpc::Status> statuses_ ABSL_GUARDED_BY(mu_);
};

// A GetTopology that waits (up to 10 minutes) for more devices than the cluster has.
struct TopologyWait {
  TopologyWait(pb::Coordinator::Stub* stub, Ends* ends) {
    req.set_min_alive_devices(1000);
    req.set_wait_ms(600'000);
    set_deadline(&ctx, absl::Seconds(120));
    stub->async()->GetTopology(&ctx, &req, &reply, [ends](grpc::Status s) { ends->add(s); });
  }
  grpc::ClientContext ctx;
  pb::GetTopologyRequest req;
  pb::Topology reply;
};

// A PutShard stream that sends nothing: its handler waits for the header.
class StalledPut final : public grpc::ClientWriteReactor<pb::ShardChunk> {
 public:
  StalledPut(pb::Worker::Stub* stub, Ends* ends) : ends_(ends) {
    set_deadline(&ctx, absl::Seconds(120));
    stub->async()->PutShard(&ctx, &reply_, this);
    StartCall();
  }
  void OnDone(const grpc::Status& s) override { ends_->add(s); }
  grpc::ClientContext ctx;

 private:
  Ends* const ends_;
  pb::PutShardReply reply_;
};

// kStarted calls of `Call` started at once, each holding a synchronous thread of its server
// until cancelled. The destructor cancels those still held and waits (bounded) for them.
template <typename Call>
class Occupation {
 public:
  template <typename Stub>
  explicit Occupation(Stub* stub) {
    for (int i = 0; i < kStarted; ++i) calls_.push_back(std::make_unique<Call>(stub, &ends_));
  }
  ~Occupation() { cancel_all(); }

  // Waits until the calls beyond the threads were refused; expects at most kHeld of them to be
  // held, and `probe` (a call made after them) refused while kHeld are. gRPC's thread manager
  // may refuse one more than that under load (a thread between polling and a call counts as
  // busy; seen twice in full ctest runs on 2 loaded cores): then fewer are held and the probe
  // may find a thread, but every refusal is still "Server Threadpool Exhausted", not a hang.
  void expect_refused_beyond_the_threads(const std::function<grpc::Status()>& probe) {
    ASSERT_TRUE(ends_.await(kStarted - kHeld, kBound)) << "fewer calls than expected were refused";
    const grpc::Status refused = probe();
    const std::vector<grpc::Status> ended = ends_.statuses();
    EXPECT_GE(ended.size(), static_cast<size_t>(kStarted - kHeld));
    EXPECT_LT(ended.size(), static_cast<size_t>(kStarted)) << "no call was held";
    if (ended.size() == static_cast<size_t>(kStarted - kHeld) || !refused.ok()) {
      EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << refused.error_message();
      EXPECT_EQ(refused.error_message(), kExhausted);
    }
    for (const grpc::Status& s : ended) {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      EXPECT_EQ(s.error_message(), kExhausted);
    }
  }

  // Ends the held calls (their callers cancel), expecting each call refused or cancelled.
  void end() {
    ASSERT_TRUE(cancel_all()) << "the cancelled calls did not end";
    for (const grpc::Status& s : ends_.statuses()) {
      EXPECT_TRUE(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
                  s.error_code() == grpc::StatusCode::CANCELLED)
          << s.error_code() << " " << s.error_message();
    }
  }

 private:
  bool cancel_all() {
    for (auto& c : calls_) c->ctx.TryCancel();
    return ends_.await(calls_.size(), kBound);
  }

  Ends ends_;  // outlives the calls
  std::vector<std::unique_ptr<Call>> calls_;
};

// Whether the child `pid` is still running (not exited, not killed by a signal).
bool running(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, WNOHANG) == 0;
}

// Retries `call` while it fails RESOURCE_EXHAUSTED (a freed thread returns to gRPC's pool
// when its handler has seen the cancellation, within 100 ms), at most kBound.
grpc::Status once_threads_free(const std::function<grpc::Status()>& call) {
  const absl::Time start = absl::Now();
  grpc::Status s = call();
  while (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED && absl::Now() - start < kBound) {
    absl::SleepFor(absl::Milliseconds(20));  // between polls of a state with no change feed
    s = call();
  }
  return s;
}

// The integers -3..3 over and over: every sum of them is exact in float32.
HostArray small_integers(Shape shape) {
  HostArray a(DType::kF32, std::move(shape));
  int64_t i = 0;
  for (float& v : a.mutable_values<float>()) v = static_cast<float>(i++ % 7 - 3);
  return a;
}

class SyncThreadsTest : public FaultClusterTest {
 protected:
  // A lease long enough that the client's renewal (a synchronous call) never runs in a test.
  std::vector<std::string> drill_flags() const override {
    std::vector<std::string> flags = kFaultCoordinatorFlags;
    flags.push_back(absl::StrCat("--max_sync_threads=", kThreads));
    flags.push_back("--lease_timeout_ms=600000");
    return flags;
  }
  std::vector<std::string> drill_worker_flags() const override {
    return {absl::StrCat("--max_sync_threads=", kThreads), "--put_stall_ms=600000"};
  }

  void SetUp() override {
    FaultClusterTest::SetUp();
    if (HasFatalFailure()) return;
    absl::StatusOr<Client> client = connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(*std::move(client));
    absl::StatusOr<Mesh> mesh = client_->make_mesh({kFaultWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    mesh_.emplace(*mesh);
    absl::StatusOr<Array> x = client_->device_put(host_, NamedSharding(*mesh_, P("x", None)));
    ASSERT_TRUE(x.ok()) << x.status();
    x_.emplace(*std::move(x));
    // Compiled and loaded now: while the threads are held, no Compile or LoadPlan is needed.
    {
      absl::StatusOr<std::vector<Array>> out = affine_({*x_});
      ASSERT_TRUE(out.ok()) << out.status();
      expect_equal((*out)[0], affine(host_, 2, 1));
      out = column_sum_({*x_});
      ASSERT_TRUE(out.ok()) << out.status();
      expect_equal((*out)[0], column_sums(host_));
    }
    // The outputs just dropped are deleted in the background: a DeleteArray (a synchronous
    // call on the coordinator), and the coordinator's deletions on the workers. Flushed now,
    // so that none holds a synchronous thread when a test starts its calls and counts how many
    // of them its daemon's threads held (one thread taken by a deletion made it kHeld - 1).
    const absl::Status flushed = client_->flush_deletes();
    ASSERT_TRUE(flushed.ok()) << flushed;
  }

  // Runs both programs until 3 heartbeat timeouts passed (a device whose heartbeats were
  // refused would be marked lost by then, and the next run would fail naming it); each run
  // must finish. Returns the last runs' results, to fetch later.
  std::vector<Array> run_through_heartbeat_timeouts() {
    std::vector<Array> last;
    const absl::Time start = absl::Now();
    int runs = 0;
    while (absl::Now() - start < absl::Milliseconds(3 * 1500) || runs < 2) {
      absl::StatusOr<std::vector<Array>> a = affine_({*x_});
      absl::StatusOr<std::vector<Array>> s = column_sum_({*x_});
      EXPECT_TRUE(a.ok() && s.ok()) << a.status() << s.status();
      if (!a.ok() || !s.ok()) return last;
      absl::Status ready = (*a)[0].block_until_ready();
      EXPECT_TRUE(ready.ok()) << ready;
      ready = (*s)[0].block_until_ready();
      EXPECT_TRUE(ready.ok()) << ready;
      if (!ready.ok()) return last;
      last = {(*a)[0], (*s)[0]};
      ++runs;
    }
    return last;
  }

  void expect_every_daemon_running() {
    EXPECT_TRUE(running(cluster_.coordinator->pid())) << "the coordinator exited";
    for (size_t i = 0; i < cluster_.workers.size(); ++i) {
      EXPECT_TRUE(running(cluster_.workers[i]->pid())) << "worker " << i << " exited";
    }
  }

  std::shared_ptr<CallIdentity> identity() const { return std::make_shared<CallIdentity>(credentials_.client); }

  const HostArray host_ = small_integers({16, 8});
  Jitted affine_ = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  // Rows split over "x": an all-reduce, on the workers' Exchange streams.
  Jitted column_sum_ = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; });
  std::optional<Client> client_;
  std::optional<Mesh> mesh_;
  std::optional<Array> x_;
};

TEST_F(SyncThreadsTest, CoordinatorRefusesSyncCallsBeyondItsThreadsAndKeepsExecuting) {
  auto stub = pb::Coordinator::NewStub(make_channel(cluster_.address, identity()));
  Occupation<TopologyWait> waits(stub.get());
  auto topology = [&stub](pb::Topology* reply) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    return stub->GetTopology(&ctx, pb::GetTopologyRequest(), reply);
  };
  pb::Topology ignored;
  waits.expect_refused_beyond_the_threads([&] { return topology(&ignored); });

  // grpc.health.v1 (a callback service: the orchestrator's probes), Execute and the workers'
  // heartbeats (callback methods) go on.
  {
    auto health = grpc::health::v1::Health::NewStub(make_channel(cluster_.address, identity()));
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    grpc::health::v1::HealthCheckResponse serving;
    const grpc::Status checked = health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &serving);
    ASSERT_TRUE(checked.ok()) << checked.error_code() << " " << checked.error_message();
    EXPECT_EQ(serving.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }
  std::vector<Array> made = run_through_heartbeat_timeouts();
  ASSERT_EQ(made.size(), 2u);

  // The waits end (their callers cancel); the coordinator serves synchronous calls again.
  waits.end();
  pb::Topology topo;
  const grpc::Status again = once_threads_free([&] { return topology(&topo); });
  ASSERT_TRUE(again.ok()) << again.error_code() << " " << again.error_message();
  ASSERT_EQ(topo.devices_size(), kFaultWorkers);
  for (const pb::DeviceInfo& d : topo.devices()) EXPECT_EQ(d.state(), pb::ALIVE) << "device " << d.id();
  expect_equal(made[0], affine(host_, 2, 1));
  expect_equal(made[1], column_sums(host_));
  // A new program: Compile is synchronous.
  Jitted fresh = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 3.0 - 2.0}; });
  absl::StatusOr<std::vector<Array>> out = fresh({*x_});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_equal((*out)[0], affine(host_, 3, -2));
  expect_every_daemon_running();
}

// A dropped array's background DeleteArray that finds every synchronous thread of the
// coordinator busy is refused RESOURCE_EXHAUSTED (this fixture saw about 1000 such per run
// before); the client sends it again with a backoff instead of giving up, so once a thread is
// free the array is deleted on every worker, and nothing counts as failed. Before, the flush
// returned "DeleteArray: Server Threadpool Exhausted", failed_deletes was 1, and the buffers
// stayed on the workers until the session's lease lapsed.
TEST_F(SyncThreadsTest, ABackgroundDeletionRefusedForWantOfThreadsIsSentAgainAndFreesTheBuffers) {
  std::vector<int64_t> baseline;
  for (int d = 0; d < kFaultWorkers; ++d) {
    absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
    ASSERT_TRUE(stats.ok()) << stats.status();
    baseline.push_back(stats->buffer_count);
  }
  absl::StatusOr<Array> y = client_->device_put(host_, NamedSharding(*mesh_, P("x", None)));
  ASSERT_TRUE(y.ok()) << y.status();
  std::optional<Array> dropped(*std::move(y));
  {
    auto stub = pb::Coordinator::NewStub(make_channel(cluster_.address, identity()));
    Occupation<TopologyWait> waits(stub.get());
    pb::Topology ignored;
    waits.expect_refused_beyond_the_threads([&] {
      grpc::ClientContext ctx;
      set_deadline(&ctx, kControlDeadline);
      return stub->GetTopology(&ctx, pb::GetTopologyRequest(), &ignored);
    });
    if (HasFatalFailure()) return;
    ASSERT_EQ(client_->retried_deletes(), 0);
    dropped.reset();  // no call in flight: a DeleteArray of its own, refused for want of a thread
    EXPECT_TRUE(poll_until([&] { return client_->retried_deletes() >= 1; }, kBound))
        << "the refused deletion was not sent again";
    waits.end();
    // A held thread is free once its handler saw the cancellation (within 100 ms).
    pb::Topology topology;
    const grpc::Status served = once_threads_free([&] {
      grpc::ClientContext ctx;
      set_deadline(&ctx, kControlDeadline);
      return stub->GetTopology(&ctx, pb::GetTopologyRequest(), &topology);
    });
    ASSERT_TRUE(served.ok()) << served.error_code() << " " << served.error_message();
  }
  const absl::Status flushed = client_->flush_deletes();
  EXPECT_TRUE(flushed.ok()) << flushed;
  EXPECT_EQ(client_->failed_deletes(), 0);
  for (int d = 0; d < kFaultWorkers; ++d) {
    absl::StatusOr<DeviceStats> stats = client_->device_stats(d);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->buffer_count, baseline[d]) << "device " << d;
  }
  expect_every_daemon_running();
}

TEST_F(SyncThreadsTest, WorkerRefusesSyncCallsBeyondItsThreadsAndKeepsRunningPlans) {
  constexpr int kBusy = 1;
  absl::StatusOr<std::vector<Device>> devices = client_->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  auto stub = pb::Worker::NewStub(make_channel((*devices)[kBusy].address, identity()));
  // Its block on the busy device is freed while the device's threads are held (below).
  absl::StatusOr<Array> freed_later = client_->device_put(host_, NamedSharding(*mesh_, P("x", None)));
  ASSERT_TRUE(freed_later.ok()) << freed_later.status();
  Occupation<StalledPut> puts(stub.get());
  auto stats = [&stub](pb::WorkerStats* reply) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    return stub->GetStats(&ctx, pb::GetStatsRequest(), reply);
  };
  pb::WorkerStats ignored;
  puts.expect_refused_beyond_the_threads([&] { return stats(&ignored); });
  // DeleteBuffers is a callback method (session 43): the coordinator's frees still reach that
  // device, and its block of freed_later goes. As a synchronous method it was refused here
  // "Server Threadpool Exhausted", and each free that overlapped another call made and ended
  // a thread of gRPC's.
  {
    auto admin = pb::Worker::NewStub(
        make_channel((*devices)[kBusy].address, std::make_shared<CallIdentity>(credentials_.admin)));
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    pb::DeleteBuffersRequest req;
    req.add_buffer_ids(freed_later->id());
    pb::DeleteBuffersReply deleted;
    const grpc::Status freed = admin->DeleteBuffers(&ctx, req, &deleted);
    ASSERT_TRUE(freed.ok()) << freed.error_code() << " " << freed.error_message();
    EXPECT_EQ(deleted.deleted(), 1);
  }
  // A put to that device is refused at once, saying so.
  absl::StatusOr<Array> refused = client_->device_put(host_, NamedSharding(*mesh_, P("x", None)));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr(kExhausted));

  // RunPlans and Exchange are callback methods: plans, their collectives among them, still run.
  std::vector<Array> made = run_through_heartbeat_timeouts();
  ASSERT_EQ(made.size(), 2u);

  puts.end();
  pb::WorkerStats after;
  const grpc::Status again = once_threads_free([&] { return stats(&after); });
  ASSERT_TRUE(again.ok()) << again.error_code() << " " << again.error_message();
  EXPECT_EQ(after.device_id(), kBusy);
  expect_equal(made[0], affine(host_, 2, 1));
  expect_equal(made[1], column_sums(host_));
  absl::StatusOr<Array> put = client_->device_put(host_, NamedSharding(*mesh_, P("x", None)));
  ASSERT_TRUE(put.ok()) << put.status();
  expect_equal(*put, host_);
  expect_every_daemon_running();
}

// Opens a PutShard stream on `stub` that sends nothing; returns how long until the worker
// cancelled it (the client sees CANCELLED: gRPC sends no status then), or kBound.
absl::Duration stalled_put_lifetime(pb::Worker::Stub* stub) {
  Ends ends;
  const absl::Time start = absl::Now();
  StalledPut put(stub, &ends);
  if (!ends.await(1, kBound)) {
    ADD_FAILURE() << "the stalled put was not cancelled";
    put.ctx.TryCancel();
    EXPECT_TRUE(ends.await(1, kBound));
    return kBound;
  }
  const grpc::Status s = ends.statuses()[0];
  EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  return absl::Now() - start;
}

// A cluster whose tests call a worker directly.
class WorkerCallsTest : public FaultClusterTest {
 protected:
  // A stub of device `d`'s worker (its address from the topology) calling with the client token.
  std::unique_ptr<pb::Worker::Stub> worker_stub(int d) {
    absl::StatusOr<Client> client = connect();
    EXPECT_TRUE(client.ok()) << client.status();
    absl::StatusOr<std::vector<Device>> devices = client.ok() ? client->devices() : client.status();
    EXPECT_TRUE(devices.ok()) << devices.status();
    const std::string address = devices.ok() ? (*devices)[d].address : "127.0.0.1:1";
    return pb::Worker::NewStub(make_channel(address, std::make_shared<CallIdentity>(credentials_.client)));
  }
};

// A PutShard stream that never sends its header is cancelled after --put_stall_ms, as one
// that stalls after it: it held a synchronous thread without bound before.
class StalledHeaderTest : public WorkerCallsTest {
  std::vector<std::string> drill_worker_flags() const override { return {"--put_stall_ms=1000"}; }
};

TEST_F(StalledHeaderTest, APutThatSendsNothingIsCancelledAfterTheStallTimeout) {
  std::unique_ptr<pb::Worker::Stub> stub = worker_stub(0);
  const absl::Duration lifetime = stalled_put_lifetime(stub.get());
  EXPECT_GE(lifetime, absl::Milliseconds(1000));
  EXPECT_LT(lifetime, kBound);
}

// The stall watch does not wait on the coordinator: with the coordinator stopped (SIGSTOP),
// each Heartbeat RPC takes its whole deadline (4 intervals, 20 s here), after which alone the
// stall was checked before (so the old check passed this test only if a heartbeat happened to
// return in the 2.5 s after the put began: about 1 run in 10); a put stalled for
// --put_stall_ms is now cancelled within about that time.
class StalledPutSlowCoordinatorTest : public WorkerCallsTest {
  std::vector<std::string> drill_flags() const override {
    return {"--heartbeat_interval_ms=5000", "--heartbeat_timeout_ms=60000"};
  }
  std::vector<std::string> drill_worker_flags() const override { return {"--put_stall_ms=500"}; }
};

TEST_F(StalledPutSlowCoordinatorTest, AStalledPutIsCancelledWhileHeartbeatsHang) {
  std::unique_ptr<pb::Worker::Stub> stub = worker_stub(0);
  ASSERT_EQ(::kill(cluster_.coordinator->pid(), SIGSTOP), 0);
  struct Continue {  // the coordinator runs again however the test ends
    ~Continue() { ::kill(pid, SIGCONT); }
    pid_t pid;
  } resume{cluster_.coordinator->pid()};
  const absl::Duration lifetime = stalled_put_lifetime(stub.get());
  EXPECT_GE(lifetime, absl::Milliseconds(500));
  // 500 ms, checked every 125 ms: well under one 20 s heartbeat RPC to the stopped coordinator.
  EXPECT_LT(lifetime, absl::Seconds(3)) << "the stall was noticed late";
}

TEST(SyncThreadsFlags, OutOfRangeIsRefusedNamingTheFlag) {
  for (const std::string daemon : {"tessera-coordinator", "tessera-worker"}) {
    for (const std::string value : {"1", "0", "-3", "65537"}) {
      SCOPED_TRACE(daemon + " " + value);
      std::vector<std::string> argv = {kBin + "/" + daemon, "--max_sync_threads=" + value};
      if (daemon == "tessera-worker") argv.push_back("--coordinator=127.0.0.1:1");
      absl::StatusOr<std::pair<int, std::string>> run = Subprocess::run(argv, absl::Seconds(30));
      ASSERT_TRUE(run.ok()) << run.status();
      EXPECT_EQ(run->first, 2) << run->second;
      EXPECT_THAT(run->second, HasSubstr("--max_sync_threads=" + value + ": must be 2 to 65536"));
    }
  }
}

}  // namespace
}  // namespace tessera

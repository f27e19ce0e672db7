// Client::local's in-process transport (proto/in_process.h): the embedded cluster opens no TCP
// socket, as the kernel sees it (/proc), yet runs puts, fetches, compiled calls and collectives
// over the same services; puts and fetches hand buffers over (core/handoff.h) rather than stream
// them; an in-process address whose server has stopped fails its calls UNAVAILABLE in bounded
// time.
#include "proto/in_process.h"

#include <dirent.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/local_cluster.h"
#include "core/handoff.h"
#include "core/status.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/health.grpc.pb.h"
#include "proto/health.h"
#include "proto/rpc.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"
#include "worker/plan_runner.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// Requests (runs, deletions, cancels) the coordinator of `client`'s embedded cluster handed to
// its workers in process so far: that cluster's own count, whatever else runs in the process.
int64_t handed_over(const Client& client) {
  std::shared_ptr<internal::LocalCluster> cluster = internal::LocalCluster::find(client.coordinator_address());
  EXPECT_NE(cluster, nullptr) << client.coordinator_address();
  return cluster == nullptr ? -1 : cluster->requests_handed_over();
}

// The TCP sockets this process holds, by the kernel's tables: the inodes of /proc/self/fd's
// "socket:[inode]" links found in /proc/self/net/tcp and tcp6 (state 0A is LISTEN).
struct TcpSockets {
  int listening = 0;
  int all = 0;
};
TcpSockets tcp_sockets_of_this_process() {
  std::set<std::string> inodes;
  DIR* dir = opendir("/proc/self/fd");
  EXPECT_NE(dir, nullptr);
  if (dir == nullptr) return {};
  while (dirent* e = readdir(dir)) {
    char target[256];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    const std::string t(target, static_cast<size_t>(n));
    if (t.rfind("socket:[", 0) == 0) inodes.insert(t.substr(8, t.size() - 9));
  }
  closedir(dir);
  TcpSockets out;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
      std::istringstream fields(line);
      std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (inodes.count(inode) == 0) continue;
      ++out.all;
      if (state == "0A") ++out.listening;
    }
  }
  return out;
}

// psum over 4 devices of x[i] = i + 1 (one element each): every device holds 1 + 2 + 3 + 4.
void run_puts_calls_and_a_collective(Client& client) {
  absl::StatusOr<Mesh> mesh = client.make_mesh({4}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  HostArray x = HostArray::arange(DType::kF32, {4});
  for (int i = 0; i < 4; ++i) x.mutable_values<float>()[i] += 1.0f;
  absl::StatusOr<Array> a = client.device_put(x, NamedSharding(*mesh, P("data")));
  ASSERT_TRUE(a.ok()) << a.status();
  ShardMapped f = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{psum(in[0], "data")}; }, *mesh,
                            {P("data")}, {P("data")}, {.check_vma = false});
  absl::StatusOr<std::vector<Array>> out = f({*a});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> sums = (*out)[0].fetch();
  ASSERT_TRUE(sums.ok()) << sums.status();
  ASSERT_EQ(sums->shape(), (Shape{4}));
  for (int i = 0; i < 4; ++i) EXPECT_EQ(sums->values<float>()[i], 10.0f) << "device " << i;
  absl::StatusOr<HostArray> back = a->fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  for (int i = 0; i < 4; ++i) EXPECT_EQ(back->values<float>()[i], static_cast<float>(i + 1));
}

TEST(InProcessCluster, OpensNoTcpSocket) {
  const TcpSockets before = tcp_sockets_of_this_process();
  {
    absl::StatusOr<Client> client = Client::local(4);  // in process by default
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<std::vector<Device>> devices = client->devices();
    ASSERT_TRUE(devices.ok()) << devices.status();
    for (const Device& d : *devices) EXPECT_THAT(d.address, StartsWith("in-process:"));
    EXPECT_THAT(client->coordinator_address(), StartsWith("in-process:"));
    run_puts_calls_and_a_collective(*client);
    const TcpSockets during = tcp_sockets_of_this_process();
    EXPECT_EQ(during.listening, before.listening);
    EXPECT_EQ(during.all, before.all);
    // A second client of the cluster in this process reaches it too, by its address.
    absl::StatusOr<Client> other = Client::connect(client->coordinator_address());
    ASSERT_TRUE(other.ok()) << other.status();
    absl::StatusOr<std::vector<Device>> seen = other->devices();
    ASSERT_TRUE(seen.ok()) << seen.status();
    EXPECT_EQ(seen->size(), 4u);
  }
}

// The control: over TCP the same check sees the coordinator's and the workers' listeners.
TEST(InProcessCluster, TcpWhenAskedListensOnePortPerDaemon) {
  const TcpSockets before = tcp_sockets_of_this_process();
  LocalOptions options;
  options.in_process = false;
  absl::StatusOr<Client> client = Client::local(4, options);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_THAT(client->coordinator_address(), StartsWith("127.0.0.1:"));
  run_puts_calls_and_a_collective(*client);
  EXPECT_EQ(tcp_sockets_of_this_process().listening, before.listening + 5);
}

// Every shard of a put and of a fetch is handed over, contiguous in the host array or not, and
// arrives intact; over TCP nothing is.
TEST(InProcessCluster, PutsAndFetchesHandBuffersOver) {
  for (bool in_process : {true, false}) {
    SCOPED_TRACE(in_process ? "in process" : "tcp");
    LocalOptions options;
    options.in_process = in_process;
    absl::StatusOr<Client> client = Client::local(4, options);
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<Mesh> mesh = client->make_mesh({4}, {"data"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    for (const PartitionSpec& spec : {P("data", None), P(None, "data")}) {
      SCOPED_TRACE(spec.to_string());
      HostArray x = HostArray::zeros(DType::kI32, {8, 12});
      for (int64_t i = 0; i < x.size(); ++i) x.mutable_values<int32_t>()[i] = static_cast<int32_t>(i * 7919 - 300);
      const int64_t before = Handoff::taken();
      absl::StatusOr<Array> a = client->device_put(x, NamedSharding(*mesh, spec));
      ASSERT_TRUE(a.ok()) << a.status();
      EXPECT_EQ(Handoff::taken() - before, in_process ? 4 : 0);
      absl::StatusOr<HostArray> back = a->fetch();
      ASSERT_TRUE(back.ok()) << back.status();
      EXPECT_EQ(Handoff::taken() - before, in_process ? 8 : 0);
      ASSERT_EQ(back->shape(), x.shape());
      for (int64_t i = 0; i < x.size(); ++i) {
        ASSERT_EQ(back->values<int32_t>()[i], x.values<int32_t>()[i]) << "element " << i;
      }
    }
  }
}

// A jitted call's runs go to the embedded workers by a call, one hand-off per device and
// none of the RunPlans streams' messages (LocalPlanStream), with the values a stream gives; over
// TCP the streams carry them and nothing is handed over. A run that fails on an embedded
// worker fails the call as it would on a stream: its error, naming the device.
TEST(InProcessCluster, AJittedCallHandsEachWorkerItsRunWithoutAStreamMessage) {
  for (bool in_process : {true, false}) {
    SCOPED_TRACE(in_process ? "in process" : "tcp");
    LocalOptions options;
    options.in_process = in_process;
    options.memory_bytes_per_device = 512 << 10;
    absl::StatusOr<Client> client = Client::local(4, options);
    ASSERT_TRUE(client.ok()) << client.status();
    absl::StatusOr<Mesh> mesh = client->make_mesh({4}, {"data"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const HostArray x = HostArray::arange(DType::kF32, {8});
    absl::StatusOr<Array> xs = client->device_put(x, NamedSharding(*mesh, P("data")));
    ASSERT_TRUE(xs.ok()) << xs.status();
    Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
    const int64_t streams_before = PlanRunner::streams_opened();
    absl::StatusOr<std::vector<Array>> warm = f({*xs});  // loads the plans (LoadPlan, not counted)
    ASSERT_TRUE(warm.ok()) << warm.status();
    ASSERT_TRUE((*warm)[0].block_until_ready().ok());
    const int64_t before = handed_over(*client);
    std::vector<Array> outs;
    for (int call = 0; call < 3; ++call) {
      absl::StatusOr<std::vector<Array>> y = f({*xs});
      ASSERT_TRUE(y.ok()) << y.status();
      outs.push_back((*y)[0]);
    }
    for (const Array& out : outs) {
      absl::StatusOr<HostArray> got = out.fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      for (int i = 0; i < 8; ++i) EXPECT_EQ(got->values<float>()[i], 2.0f * static_cast<float>(i) + 1.0f);
    }
    EXPECT_EQ(handed_over(*client) - before, in_process ? 3 * 4 : 0);
    // In process no worker's RunPlans handler was entered; over TCP the warm-up call opened
    // each device's stream.
    if (in_process) {
      EXPECT_EQ(PlanRunner::streams_opened() - streams_before, 0);
    } else {
      EXPECT_GE(PlanRunner::streams_opened() - streams_before, 4);
    }

    // Each device's block of the broadcast, (2, 131072) f32, is 1 MiB: more than the device
    // holds, so every worker refuses the run before it starts (worker/plan_runner.cc's prepare).
    Jitted big = jit([](const std::vector<Value>& in) {
      return std::vector<Value>{broadcast_in_dim(in[0], {8, 131072}, {0})};
    });
    const int64_t before_big = handed_over(*client);
    absl::StatusOr<std::vector<Array>> y = big({*xs});
    absl::Status failed = y.ok() ? (*y)[0].block_until_ready() : y.status();
    EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted) << failed;
    EXPECT_THAT(std::string(failed.message()),
                HasSubstr(absl::StrCat("device 0 (", in_process ? "in-process:" : "127.0.0.1:")));
    EXPECT_THAT(std::string(failed.message()), HasSubstr("bytes at once"));
    // Its 4 runs, then the deletion of its outputs' buffers on each device (the coordinator's
    // fail_execution: a StreamDelete where a stream is open), handed over as well.
    EXPECT_EQ(handed_over(*client) - before_big, in_process ? 4 + 4 : 0);
    // The cluster goes on: the next call runs.
    absl::StatusOr<std::vector<Array>> after = f({*xs});
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_TRUE((*after)[0].block_until_ready().ok());
  }
}

// A chain of `calls` dependent calls on a fresh Client::local(4), issued without waiting for
// any: x + 1 applied `calls` times to arange(8); the last one's values, or the first error.
// `*handed` is what the cluster's coordinator handed over in process from the first call on.
absl::StatusOr<HostArray> chain_of_calls(bool in_process, int calls, int64_t* handed) {
  LocalOptions options;
  options.in_process = in_process;
  TESSERA_ASSIGN_OR_RETURN(Client client, Client::local(4, options));
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, client.make_mesh({4}, {"data"}));
  TESSERA_ASSIGN_OR_RETURN(Array y,
                           client.device_put(HostArray::arange(DType::kF32, {8}), NamedSharding(mesh, P("data"))));
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; });
  const int64_t before = handed_over(client);
  for (int call = 0; call < calls; ++call) {
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> next, f({y}));
    y = next[0];
  }
  absl::StatusOr<HostArray> last = y.fetch();
  *handed = handed_over(client) - before;
  return last;
}

// Each call names the output of the one before, so each worker runs it after that one
// (deferred behind its producer when that is still going), whichever carrier takes the runs:
// handed over in process, or the RunPlans streams' reactors over TCP. Values only: 300 nested
// hand-offs would fit a thread's stack, so this cannot see nesting; LocalPlanStream's unit test
// (tests/coordinator/local_plan_stream_test.cc) counts the depth.
TEST(InProcessCluster, AChainOfDependentCallsIssuedWithoutWaitingGivesTheHostsValues) {
  constexpr int kChain = 300;
  for (bool in_process : {true, false}) {
    SCOPED_TRACE(in_process ? "in process" : "tcp");
    int64_t handed = 0;
    absl::StatusOr<HostArray> got = chain_of_calls(in_process, kChain, &handed);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(got->shape(), (Shape{8}));
    for (int i = 0; i < 8; ++i) EXPECT_EQ(got->values<float>()[i], static_cast<float>(i + kChain)) << "element " << i;
    if (in_process) {
      EXPECT_GE(handed, 4 * kChain);  // and deletions of the arrays dropped
    } else {
      EXPECT_EQ(handed, 0);
    }
  }
}

grpc::Status check_health(const std::shared_ptr<grpc::Channel>& channel, absl::Duration timeout) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  set_deadline(&ctx, timeout);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse reply;
  return stub->Check(&ctx, req, &reply);
}

// The health a worker's own server answers for the whole server ("").
absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> served_health(const std::string& address) {
  auto stub = grpc::health::v1::Health::NewStub(make_channel(address));
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse reply;
  const grpc::Status s = stub->Check(&ctx, req, &reply);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("Check of ", address, ": ", s.error_message()));
  return reply.status();
}

// An embedded worker that stops while its coordinator stays up (LocalCluster::stop_worker: as
// its process would stop, its server left answering). The run it had been handed (a while loop
// that never ends: a plan thread's run, still going) fails at once with UNAVAILABLE naming
// its device, not at the call's deadline (2 minutes: DEADLINE_EXCEEDED if it waited);
// the other devices' runs are cancelled by the coordinator; a later call fails naming it too,
// and the worker's server answers health NOT_SERVING. With `collective`, the loop's condition
// sums a carry split over the devices (an all_reduce per iteration), so the other devices'
// runs are inside collectives with the stopped one: the call still fails at once naming it.
// (Which path ends those peers' waits first, the stopped worker's ended collectives or the
// coordinator's cancel after its run failed, this test does not tell apart; transport_test's
// TransportInProcess.StoppingAWorkersInProcessCollectivesFailsAPeersCollectiveWithItNamingIt
// shows the stop alone ends a wait in an op begun before it.)
void stop_a_worker_mid_run(bool collective) {
  // Heartbeats that would take 10 minutes to mark the stopped worker lost: every failure below
  // comes from its ended run session, not from the lost-device path (which also says UNAVAILABLE
  // naming it), and a call that waited would end DEADLINE_EXCEEDED at its 2 minutes.
  LocalOptions local;
  local.heartbeat_timeout = absl::Minutes(10);
  absl::StatusOr<Client> client = Client::local(4, local);
  ASSERT_TRUE(client.ok()) << client.status();
  std::shared_ptr<internal::LocalCluster> cluster = internal::LocalCluster::find(client->coordinator_address());
  ASSERT_NE(cluster, nullptr);
  absl::StatusOr<Mesh> mesh = client->make_mesh({4}, {"data"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Array> x =
      client->device_put(HostArray::zeros(DType::kF32, {8}), NamedSharding(*mesh, collective ? P("data") : P()));
  ASSERT_TRUE(x.ok()) << x.status();
  JitOptions options;
  options.timeout = absl::Minutes(2);
  Jitted forever = jit_support::never_ending_loop(options);
  Jitted add_one = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; }, options);
  absl::StatusOr<std::vector<Array>> warm = add_one({*x});  // loads add_one's plans while all are up
  ASSERT_TRUE(warm.ok()) << warm.status();
  ASSERT_TRUE((*warm)[0].block_until_ready().ok());

  const int64_t before = cluster->requests_handed_over();
  absl::StatusOr<std::vector<Array>> looping = forever({*x});
  ASSERT_TRUE(looping.ok()) << looping.status();
  EXPECT_EQ(jit_support::all_reduce_count(forever.as_text()), collective ? 1u : 0u) << forever.as_text();
  // Its 4 runs handed over (each to a plan thread, looping): polled, with a deadline.
  const absl::Time handed_by = absl::Now() + absl::Seconds(30);
  while (cluster->requests_handed_over() - before < 4 && absl::Now() < handed_by) {
    absl::SleepFor(absl::Milliseconds(2));  // polling a count with no change feed
  }
  ASSERT_GE(cluster->requests_handed_over() - before, 4);
  EXPECT_FALSE((*looping)[0].is_ready());

  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  ASSERT_EQ(devices->size(), 4u);
  for (int d = 0; d < 4; ++d) ASSERT_EQ((*devices)[d].id, d);
  EXPECT_EQ(served_health((*devices)[1].address).value_or(grpc::health::v1::HealthCheckResponse::UNKNOWN),
            grpc::health::v1::HealthCheckResponse::SERVING);

  const absl::Time stop = absl::Now();
  cluster->stop_worker(1);
  absl::Status stopped = (*looping)[0].block_until_ready();
  EXPECT_LT(absl::Now() - stop, absl::Seconds(30)) << "the call waited for its deadline, not the stopped worker";
  EXPECT_EQ(stopped.code(), absl::StatusCode::kUnavailable) << stopped;
  EXPECT_THAT(std::string(stopped.message()), HasSubstr("device 1 (in-process:")) << stopped;
  if (!collective) {
    EXPECT_THAT(std::string(stopped.message()), HasSubstr("its in-process run session ended (its worker stopped)"))
        << stopped;
  }
  for (int d : {0, 1, 2, 3}) {
    EXPECT_EQ(
        served_health((*devices)[d].address).value_or(grpc::health::v1::HealthCheckResponse::UNKNOWN),
        d == 1 ? grpc::health::v1::HealthCheckResponse::NOT_SERVING : grpc::health::v1::HealthCheckResponse::SERVING)
        << "device " << d;
  }

  // A later call's run on device 1 is refused at once, naming it; the others' are not.
  absl::StatusOr<std::vector<Array>> later = add_one({*x});
  absl::Status refused = later.ok() ? (*later)[0].block_until_ready() : later.status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("device 1 (in-process:")) << refused;
  for (const char* other : {"device 0 (", "device 2 (", "device 3 ("}) {
    EXPECT_THAT(std::string(refused.message()), Not(HasSubstr(other))) << refused;
  }
}

TEST(InProcessCluster, AnEmbeddedWorkerThatStopsFailsItsRunsAndLaterCallsNamingIt) { stop_a_worker_mid_run(false); }

TEST(InProcessCluster, AnEmbeddedWorkerThatStopsMidCollectiveFailsTheCallNamingIt) { stop_a_worker_mid_run(true); }

TEST(InProcessAddress, StoppedServerFailsUnavailableWithinTheDeadline) {
  HealthService health;
  grpc::ServerBuilder builder;  // no listening port
  configure_server(&builder);
  builder.RegisterService(health.service());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  absl::StatusOr<std::unique_ptr<InProcessAddress>> registered = InProcessAddress::add(server.get());
  ASSERT_TRUE(registered.ok()) << registered.status();
  const std::string address = (*registered)->address();
  EXPECT_TRUE(is_in_process_address(address));
  EXPECT_FALSE(is_in_process_address("127.0.0.1:5000"));
  std::shared_ptr<grpc::Channel> before = make_channel(address);
  EXPECT_TRUE(check_health(before, absl::Seconds(5)).ok());

  // Unregistered: a channel made from now on fails at once (the deadline is long), before and
  // after the server stops. (`before` is not called again: see proto/in_process.h.)
  (*registered)->reset();
  for (bool stopped : {false, true}) {
    if (stopped) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
      server->Wait();
    }
    const absl::Time start = absl::Now();
    const grpc::Status status = check_health(make_channel(address), absl::Seconds(20));
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  }
}

// A second client of an in-process cluster shares it: the cluster outlives the client that
// started it, and the second one keeps working (its channels must never see a stopped server).
TEST(InProcessCluster, ASecondClientKeepsTheClusterAlive) {
  absl::StatusOr<Client> owner = Client::local(2);
  ASSERT_TRUE(owner.ok()) << owner.status();
  absl::StatusOr<Client> other = Client::connect(owner->coordinator_address());
  ASSERT_TRUE(other.ok()) << other.status();
  owner = absl::CancelledError("dropped");  // the owner's client goes; `other` holds the cluster
  absl::StatusOr<Mesh> mesh = other->make_mesh({2}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray x = HostArray::arange(DType::kF32, {4, 2});
  absl::StatusOr<Array> a = other->device_put(x, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(a.ok()) << a.status();
  Jitted f = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; });
  absl::StatusOr<std::vector<Array>> y = f({*a});
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<HostArray> back = (*y)[0].fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(back->values<float>()[i], 2.0f * static_cast<float>(i) + 1.0f);
}

}  // namespace
}  // namespace tessera

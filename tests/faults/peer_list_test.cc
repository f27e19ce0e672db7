// The coordinator's view of a large cluster reaches its workers (issue #17, session 38). The
// alive devices and their incarnations used to travel in the trailer `tessera-peers` of every
// RegisterWorker and Heartbeat reply; gRPC bounds metadata (8 KiB by default in 1.51), so from
// about a thousand devices (8 KiB at 6-8 bytes an entry) the replies failed and no worker learnt of a new peer: each
// refused every stream of a device registered since (UNAVAILABLE once PeerView::kMaxWait passed without a view). Now
// the view is a field of the replies (ClusterPeers). A real coordinator and kFaultWorkers real workers on 127.0.0.1;
// 2,000 more registrations, sent as a worker would (RegisterWorker with the cluster token), make the cluster's view;
// every wait has a deadline.
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tests/faults/fault_cluster.h"
#include "tests/metrics_scrape.h"
#include "tests/support/exchange_stream.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

constexpr int kRegistered = 2000;

class PeerListTest : public FaultClusterTest {
 protected:
  // The registrations this test sends never heartbeat: they stay alive for its length.
  std::vector<std::string> drill_flags() const override {
    return {"--heartbeat_interval_ms=200", "--heartbeat_timeout_ms=300000"};
  }
};

std::map<int, uint64_t> view_of(const pb::ClusterPeers& peers) {
  std::map<int, uint64_t> view;
  for (const pb::PeerRegistration& p : peers.devices()) {
    EXPECT_TRUE(view.emplace(p.device_id(), p.incarnation()).second) << "device " << p.device_id() << " twice";
  }
  return view;
}

// Raw calls as a worker makes them (the cluster token), for the simulated devices of these tests.
class RawWorkerCalls {
 public:
  RawWorkerCalls(const std::string& address, const std::string& cluster_token)
      : coordinator_(pb::Coordinator::NewStub(make_channel(address, std::make_shared<CallIdentity>(cluster_token)))) {}

  // Registers device `device` under `name` (the same name again: a new incarnation).
  pb::RegisterWorkerReply register_device(int device, const std::string& name) {
    // 127.0.0.1:1 is never called: these devices are in no mesh.
    const pb::RegisterWorkerRequest req = worker_request(name, "127.0.0.1:1", device);
    pb::RegisterWorkerReply reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    const grpc::Status s = coordinator_->RegisterWorker(&ctx, req, &reply);
    EXPECT_TRUE(s.ok()) << "device " << device << ": " << s.error_message();
    EXPECT_TRUE(reply.has_peers()) << "device " << device;  // every registration reply has the view
    return reply;
  }

  // A heartbeat of `device`'s registration (`r`) naming view version `held`.
  pb::HeartbeatReply beat(const pb::RegisterWorkerReply& r, uint64_t held, bool leaving = false) {
    pb::HeartbeatRequest req;
    req.set_device_id(r.device_id());
    req.set_incarnation(r.incarnation());
    req.set_epoch(r.epoch());
    req.set_view_version(held);
    req.set_draining(leaving);
    req.set_leaving(leaving);
    pb::HeartbeatReply reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    const grpc::Status s = coordinator_->Heartbeat(&ctx, req, &reply);
    EXPECT_TRUE(s.ok()) << "device " << r.device_id() << ": " << s.error_message();
    return reply;
  }

  pb::Coordinator::Stub& coordinator() { return *coordinator_; }

 private:
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
};

// 2,000 registrations beyond the cluster's 4 workers: each RegisterWorker reply, and a
// Heartbeat reply after the last, names every alive device with its current incarnation (the
// workers' as their Handshakes say, 1 for the new ones); each real worker then takes a stream
// of the last and of the first device registered, and refuses one of a device never
// registered PERMISSION_DENIED naming the first 32 alive devices and how many more. On main
// (the trailer) the registrations' replies fail from about the thousandth on (the trailer exceeds
// the metadata limit) and the workers refuse the new devices' streams UNAVAILABLE.
TEST_F(PeerListTest, AViewOfTwoThousandDevicesReachesEveryWorker) {
  absl::StatusOr<Client> client = connect();  // waits (at most 20 s) for every device
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  ASSERT_EQ(devices->size(), static_cast<size_t>(kFaultWorkers));
  std::map<int, uint64_t> expected;
  uint64_t epoch = 0;
  for (const Device& d : *devices) {
    absl::StatusOr<pb::HandshakeReply> r = worker_registration(d.address, credentials_.client);
    ASSERT_TRUE(r.ok()) << r.status();
    expected[d.id] = r->incarnation();
    epoch = r->epoch();
  }

  RawWorkerCalls calls(cluster_.address, credentials_.cluster);
  pb::RegisterWorkerReply last;
  for (int i = 0; i < kRegistered; ++i) {
    const int device = kFaultWorkers + i;
    last = calls.register_device(device, absl::StrCat("listed-", device));
    ASSERT_FALSE(HasFailure()) << "registration " << i << " (device " << device << ")";
    ASSERT_EQ(last.device_id(), device);
    ASSERT_EQ(last.incarnation(), 1u);
    ASSERT_EQ(last.epoch(), epoch);
    expected[device] = 1;
    ASSERT_TRUE(last.has_peers()) << "registration " << i;
    ASSERT_EQ(last.peers().devices_size(), static_cast<int>(expected.size())) << "registration " << i;
  }
  EXPECT_EQ(view_of(last.peers()), expected);
  {
    const pb::HeartbeatReply reply = calls.beat(last, 0);  // the last device's registration
    ASSERT_FALSE(HasFailure());
    ASSERT_TRUE(reply.has_peers());
    EXPECT_EQ(view_of(reply.peers()), expected);
  }

  // A wait for every device answers DEADLINE_EXCEEDED naming the first 8 of the 2,000 devices
  // whose workers do not answer (127.0.0.1:1) and counting the rest: the whole list (about
  // 200 KB) overflowed the status trailer, so the caller saw no reason at all.
  {
    pb::GetTopologyRequest wait;
    wait.set_min_alive_devices(static_cast<int>(expected.size()));
    wait.set_wait_ms(1000);
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(30));
    pb::Topology topology;
    const grpc::Status s = calls.coordinator().GetTopology(&ctx, wait, &topology);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("alive devices (not draining) but ", kFaultWorkers, " are")));
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat("registered but not confirmed by their workers: device ",
                                                          kFaultWorkers, " (127.0.0.1:1): its worker did not answer")));
    EXPECT_THAT(s.error_message(), HasSubstr(absl::StrCat(" and ", kRegistered - 8, " more")));
    EXPECT_LT(s.error_message().size(), 8192u);
  }

  const int unknown = kFaultWorkers + kRegistered;
  for (const Device& d : *devices) {
    SCOPED_TRACE(absl::StrCat("worker ", d.id));
    // Each waits, unread, for a view asked for after it came (PeerView), and is taken once it names the device.
    for (int device : {kFaultWorkers + kRegistered - 1, kFaultWorkers}) {
      const grpc::Status taken = exchange_stream(d.address, credentials_.cluster, {device, epoch, 1}, {});
      EXPECT_TRUE(taken.ok()) << "device " << device << ": " << taken.error_code() << " " << taken.error_message();
    }
    const grpc::Status refused = exchange_stream(d.address, credentials_.cluster, {unknown, epoch, 1}, {});
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::PERMISSION_DENIED) << refused.error_message();
    EXPECT_THAT(refused.error_message(),
                HasSubstr(absl::StrCat("device ", unknown,
                                       " is not a registered device of this cluster (alive: 0, 1, 2, 3, 4, 5, ")));
    EXPECT_THAT(refused.error_message(), HasSubstr(absl::StrCat(", 31 and ", expected.size() - 32, " more)")));
  }
}

// Session 40: a heartbeat reply carries the cluster view only when the version the heartbeat
// names is not the coordinator's current one, so N workers' heartbeats cost O(N) bytes an
// interval, not O(N^2). With 1,000 simulated devices beyond the 4 workers: a heartbeat naming
// the current version gets no peers (its reply is empty), one naming 0 or an older version gets
// the whole view with the current version; a registration, a registration again under a known
// name (a new incarnation) and a device that leaves each give a new version, and the next
// heartbeat naming the old one carries the new view. Every heartbeat reply carried the view
// before (about 7 KB here; the steady-state bound of 64 bytes fails then).
TEST_F(PeerListTest, AHeartbeatCarriesTheViewOnlyWhenItsVersionIsNotTheCurrentOne) {
  constexpr int kSimulated = 1000;
  absl::StatusOr<Client> client = connect();  // waits (at most 20 s) for every device
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  std::map<int, uint64_t> expected;
  for (const Device& d : *devices) {
    absl::StatusOr<pb::HandshakeReply> r = worker_registration(d.address, credentials_.client);
    ASSERT_TRUE(r.ok()) << r.status();
    expected[d.id] = r->incarnation();
  }
  RawWorkerCalls calls(cluster_.address, credentials_.cluster);
  std::vector<pb::RegisterWorkerReply> registered;
  std::set<uint64_t> versions;
  for (int i = 0; i < kSimulated; ++i) {
    const int device = kFaultWorkers + i;
    registered.push_back(calls.register_device(device, absl::StrCat("versioned-", device)));
    ASSERT_FALSE(HasFailure()) << "registration " << i;
    expected[device] = 1;
    // Each registration is a new view: a version not seen before.
    ASSERT_TRUE(versions.insert(registered.back().peers().version()).second) << "registration " << i;
    ASSERT_NE(registered.back().peers().version(), 0u);
  }
  const uint64_t current = registered.back().peers().version();
  EXPECT_EQ(view_of(registered.back().peers()), expected);

  // Every simulated device heartbeats once holding no view (version 0, as every heartbeat was
  // answered before), then once holding the view its registration brought, and then the current.
  size_t full_bytes = 0, steady_bytes = 0;
  for (int i = 0; i < kSimulated; ++i) {
    const pb::HeartbeatReply full = calls.beat(registered[i], 0);
    ASSERT_TRUE(full.has_peers()) << "device " << registered[i].device_id();
    ASSERT_EQ(full.peers().version(), current);
    ASSERT_EQ(full.peers().devices_size(), static_cast<int>(expected.size()));
    full_bytes += full.ByteSizeLong();
    // Its registration's view is older (but the last one's), so it gets the current one.
    const pb::HeartbeatReply older = calls.beat(registered[i], registered[i].peers().version());
    ASSERT_EQ(older.has_peers(), i != kSimulated - 1) << "device " << registered[i].device_id();
    if (older.has_peers()) {
      ASSERT_EQ(older.peers().version(), current);
    }
    const pb::HeartbeatReply steady = calls.beat(registered[i], current);
    ASSERT_FALSE(steady.has_peers()) << "device " << registered[i].device_id();
    steady_bytes += steady.ByteSizeLong();
  }
  const pb::HeartbeatReply full = calls.beat(registered[0], 0);
  EXPECT_EQ(view_of(full.peers()), expected);
  const double full_per_beat = static_cast<double>(full_bytes) / kSimulated;
  const double steady_per_beat = static_cast<double>(steady_bytes) / kSimulated;
  std::printf("heartbeat reply bytes with %zu devices: %.1f holding no view, %.1f holding the current one\n",
              expected.size(), full_per_beat, steady_per_beat);
  RecordProperty("full_view_reply_bytes", static_cast<int>(full_per_beat));
  RecordProperty("steady_state_reply_bytes", static_cast<int>(steady_per_beat));
  EXPECT_GT(full_per_beat, 5.0 * static_cast<double>(expected.size()));  // about 7 bytes a device
  EXPECT_LT(steady_per_beat, 64.0);

  // Each change gives a new version; a heartbeat naming the one before gets the new view.
  uint64_t held = current;
  auto next_view = [&](const std::string& change) {
    SCOPED_TRACE(change);
    const pb::HeartbeatReply reply = calls.beat(registered[0], held);
    EXPECT_TRUE(reply.has_peers());
    EXPECT_TRUE(versions.insert(reply.peers().version()).second) << "version " << reply.peers().version() << " again";
    EXPECT_EQ(view_of(reply.peers()), expected);
    held = reply.peers().version();
    EXPECT_FALSE(calls.beat(registered[0], held).has_peers());  // and then none again
  };
  // A new device.
  const int added = kFaultWorkers + kSimulated;
  const pb::RegisterWorkerReply add = calls.register_device(added, absl::StrCat("versioned-", added));
  expected[added] = 1;
  EXPECT_EQ(view_of(add.peers()), expected);
  next_view("a registration");
  // The same name again: a new incarnation of device 5.
  const pb::RegisterWorkerReply again = calls.register_device(kFaultWorkers + 1, "versioned-5");
  ASSERT_EQ(again.incarnation(), 2u);
  expected[kFaultWorkers + 1] = 2;
  next_view("a registration again");
  // A device that leaves (its last heartbeat gets no view).
  EXPECT_FALSE(calls.beat(add, 0, /*leaving=*/true).has_peers());
  expected.erase(added);
  next_view("a device that left");
}

class PeerViewLostTest : public FaultClusterTest {
 protected:
  std::vector<std::string> drill_flags() const override {
    return {"--heartbeat_interval_ms=100", "--heartbeat_timeout_ms=1000"};
  }
};

// A device marked lost gives a new view version too: a simulated device that stops heartbeating
// is lost after the heartbeat timeout (1 s), and a device that goes on heartbeating (every
// 100 ms, as a worker does, naming the version it holds) gets the view without it in a reply
// (other views may come first: real workers slow to beat), and the heartbeat naming that view's
// version gets none.
TEST_F(PeerViewLostTest, ALostDeviceGivesANewViewToTheNextHeartbeat) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  RawWorkerCalls calls(cluster_.address, credentials_.cluster);
  const pb::RegisterWorkerReply silent = calls.register_device(kFaultWorkers, "silent");
  const pb::RegisterWorkerReply beating = calls.register_device(kFaultWorkers + 1, "beating");
  ASSERT_FALSE(HasFailure());
  std::map<int, uint64_t> with_silent = view_of(beating.peers());
  ASSERT_EQ(with_silent.count(kFaultWorkers), 1u);
  uint64_t held = beating.peers().version();
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  std::optional<pb::ClusterPeers> changed;
  while (!changed.has_value() && absl::Now() < deadline) {
    const pb::HeartbeatReply reply = calls.beat(beating, held);
    ASSERT_FALSE(HasFailure());
    if (reply.has_peers()) {
      EXPECT_NE(reply.peers().version(), held);
      held = reply.peers().version();
      // Another change (a real worker slow to beat on a loaded machine) comes as a view too.
      if (view_of(reply.peers()).count(kFaultWorkers) == 0) changed = reply.peers();
    }
    absl::SleepFor(absl::Milliseconds(100));  // the heartbeat interval (pacing, not a wait for the loss)
  }
  ASSERT_TRUE(changed.has_value()) << "no view without device " << kFaultWorkers << " within 20 s";
  std::map<int, uint64_t> without = with_silent;
  without.erase(kFaultWorkers);
  EXPECT_EQ(view_of(*changed), without);
  EXPECT_FALSE(calls.beat(beating, changed->version()).has_peers());
}

class ViewVersionMetricsTest : public FaultClusterTest {
 protected:
  std::vector<std::string> drill_flags() const override {
    return {"--heartbeat_interval_ms=100", "--heartbeat_timeout_ms=300000", "--metrics_port=0"};
  }
};

// Real workers name the view version they hold (worker/registration.cc): once every worker has
// the view of the last registration, heartbeats go on and their replies carry no view. Each
// worker but the last registered gets the view in a heartbeat reply at least once (its
// registration's view is outdated by the next registration), so the coordinator's
// tessera_coordinator_heartbeat_views_total reaches kFaultWorkers - 1; after that, over 10
// heartbeats per worker, it grows by at most kFaultWorkers - 1 (a worker slow to beat on a loaded
// machine may still be getting the last view: nothing changes the view after connect). A worker
// naming no version (0) would get the view in every one of those 40 replies.
TEST_F(ViewVersionMetricsTest, ASettledClustersHeartbeatsCarryNoView) {
  const int port = coordinator_metrics_port();
  ASSERT_GT(port, 0);
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  auto counter = [port](const std::string& series) {
    absl::StatusOr<std::string> scrape = http_get(port, "/metrics");
    EXPECT_TRUE(scrape.ok()) << scrape.status();
    return scrape.ok() ? sample(*scrape, series) : -1;
  };
  // Polls (with a deadline) until `done` holds; each worker beats every 100 ms.
  auto wait_until = [](const std::function<bool()>& done) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (!done() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(50));
    return done();
  };
  ASSERT_TRUE(wait_until([&] { return counter("tessera_coordinator_heartbeat_views_total") >= kFaultWorkers - 1; }))
      << "the workers' heartbeats did not get the view of the last registration";
  const double views = counter("tessera_coordinator_heartbeat_views_total");
  const double beats = counter("tessera_coordinator_heartbeats_total");
  ASSERT_TRUE(wait_until([&] { return counter("tessera_coordinator_heartbeats_total") >= beats + 10 * kFaultWorkers; }))
      << "heartbeats stopped";
  EXPECT_LE(counter("tessera_coordinator_heartbeat_views_total"), views + kFaultWorkers - 1)
      << "heartbeats of a settled cluster carried the view";
  EXPECT_EQ(counter("tessera_coordinator_devices_lost_total"), 0);
}

}  // namespace
}  // namespace tessera

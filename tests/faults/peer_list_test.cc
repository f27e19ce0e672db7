// The coordinator's view of a large cluster reaches its workers (issue #17, session 38). The
// alive devices and their incarnations used to travel in the trailer `tessera-peers` of every
// RegisterWorker and Heartbeat reply; gRPC bounds metadata (8 KiB by default in 1.51), so from
// about a thousand devices (8 KiB at 6-8 bytes an entry) the replies failed and no worker learnt of a new peer: each
// refused every stream of a device registered since (UNAVAILABLE once PeerView::kMaxWait passed without a view). Now
// the view is a field of the replies (ClusterPeers). A real coordinator and kFaultWorkers real workers on 127.0.0.1;
// 2,000 more registrations, sent as a worker would (RegisterWorker with the cluster token), make the cluster's view;
// every wait has a deadline.
#include <map>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tests/faults/fault_cluster.h"
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

  auto coordinator =
      pb::Coordinator::NewStub(make_channel(cluster_.address, std::make_shared<CallIdentity>(credentials_.cluster)));
  pb::RegisterWorkerReply last;
  for (int i = 0; i < kRegistered; ++i) {
    const int device = kFaultWorkers + i;
    pb::RegisterWorkerRequest req;
    req.set_protocol_version(kProtocolVersion);
    req.set_name(absl::StrCat("listed-", device));
    req.set_address("127.0.0.1:1");  // never called: these devices are in no mesh
    req.set_requested_device_id(device);
    req.set_memory_bytes(int64_t{1} << 30);
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    const grpc::Status s = coordinator->RegisterWorker(&ctx, req, &last);
    ASSERT_TRUE(s.ok()) << "registration " << i << " (device " << device << "): " << s.error_message();
    ASSERT_EQ(last.device_id(), device);
    ASSERT_EQ(last.incarnation(), 1u);
    ASSERT_EQ(last.epoch(), epoch);
    expected[device] = 1;
    ASSERT_TRUE(last.has_peers()) << "registration " << i;
    ASSERT_EQ(last.peers().devices_size(), static_cast<int>(expected.size())) << "registration " << i;
  }
  EXPECT_EQ(view_of(last.peers()), expected);
  {
    pb::HeartbeatRequest beat;
    beat.set_device_id(kFaultWorkers + kRegistered - 1);
    beat.set_incarnation(1);
    beat.set_epoch(epoch);
    pb::HeartbeatReply reply;
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    const grpc::Status s = coordinator->Heartbeat(&ctx, beat, &reply);
    ASSERT_TRUE(s.ok()) << s.error_message();
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
    const grpc::Status s = coordinator->GetTopology(&ctx, wait, &topology);
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

}  // namespace
}  // namespace tessera

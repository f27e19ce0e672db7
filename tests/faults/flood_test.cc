// Issue #17 item 8, "a flood of ... forged messages": while a victim client runs
// collective-heavy calls, an insider holding the cluster token (not TLS: its streams' device
// claims cannot be checked) floods every worker with Exchange messages that name another
// device than the one its stream claims, tagged with the op ids just above the victim's
// (where the victim's next collectives will be). Every forged message is dropped and counted
// by the worker it reached, none is left queued, every victim result is right (checked
// against the host), and the daemons serve afterwards. Every wait has a deadline; teardown
// kills only this test's processes, by pid.
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"

namespace tessera {
namespace {

constexpr int kStreamsPerWorker = 10;
constexpr int kMessagesPerStream = 100;  // 4 workers x 10 streams x 100 = 4,000 forged messages

class FloodTest : public FaultClusterTest {};

TEST_F(FloodTest, ForgedExchangeMessagesDuringCollectivesAreDroppedAndResultsStayRight) {
  absl::StatusOr<Client> client = connect();
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kF32, {kFaultWorkers * 4, 64});
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  JitOptions options;
  options.timeout = absl::Seconds(10);
  Jitted column_sum = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; }, options);
  const HostArray want = column_sums(host);
  {
    absl::StatusOr<std::vector<Array>> first = column_sum({*x});
    ASSERT_TRUE(first.ok()) << first.status();
    expect_equal((*first)[0], want);
  }

  // The flood: worker w's streams claim device (w + 1) % n and carry messages naming
  // (w + 2) % n, op ids from the victim's last array id on (ids are predictable).
  const uint64_t base = x->id();
  std::vector<std::atomic<int64_t>> sent(kFaultWorkers);
  std::vector<std::thread> flooders;
  for (int w = 0; w < kFaultWorkers; ++w) {
    flooders.emplace_back([&, w] {
      auto identity = std::make_shared<CallIdentity>(credentials_.cluster, (w + 1) % kFaultWorkers);
      std::unique_ptr<pb::Worker::Stub> stub = pb::Worker::NewStub(make_channel((*devices)[w].address, identity));
      for (int s = 0; s < kStreamsPerWorker; ++s) {
        grpc::ClientContext ctx;
        set_deadline(&ctx, kControlDeadline);
        pb::ExchangeReply reply;
        auto writer = stub->Exchange(&ctx, &reply);
        for (int k = 0; k < kMessagesPerStream; ++k) {
          pb::ExchangeMessage m;
          m.set_source_device((w + 2) % kFaultWorkers);
          m.set_op_id(base + static_cast<uint64_t>(s * kMessagesPerStream + k));
          m.set_data(std::string(1024, '\x7f'));
          if (!writer->Write(m)) break;
          sent[w].fetch_add(1);
        }
        writer->WritesDone();
        const grpc::Status status = writer->Finish();
        EXPECT_TRUE(status.ok()) << "worker " << w << ": " << status.error_message();
      }
    });
  }
  // Meanwhile the victim's all-reduces, right every time.
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<std::vector<Array>> total = column_sum({*x});
    ASSERT_TRUE(total.ok()) << total.status();
    expect_equal((*total)[0], want);
  }
  for (std::thread& t : flooders) t.join();

  auto admin = std::make_shared<CallIdentity>(credentials_.admin);
  for (int w = 0; w < kFaultWorkers; ++w) {
    SCOPED_TRACE(absl::StrCat("worker ", w));
    pb::WorkerStats stats;
    grpc::ClientContext ctx;
    set_deadline(&ctx, kControlDeadline);
    ASSERT_TRUE(pb::Worker::NewStub(make_channel((*devices)[w].address, admin))
                    ->GetStats(&ctx, pb::GetStatsRequest(), &stats)
                    .ok());
    EXPECT_EQ(sent[w].load(), kStreamsPerWorker * kMessagesPerStream);
    EXPECT_EQ(stats.exchange_messages_forged(), sent[w].load());
    EXPECT_EQ(stats.collective_messages_pending(), 0);
  }
  // The daemons still serve: a new client's put and call.
  absl::StatusOr<Client> after = connect();
  ASSERT_TRUE(after.ok()) << after.status();
  absl::StatusOr<Mesh> mesh2 = after->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh2.ok()) << mesh2.status();
  absl::StatusOr<Array> y = after->device_put(host, NamedSharding(*mesh2, P("x")));
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<std::vector<Array>> total = column_sum({*y});
  ASSERT_TRUE(total.ok()) << total.status();
  expect_equal((*total)[0], want);
}

}  // namespace
}  // namespace tessera

// Issue #17 item 8, "a flood of ... forged messages": while a victim client runs
// collective-heavy calls, an insider holding the cluster token (not TLS: its streams' device
// claims cannot be checked) floods every worker with Exchange messages that name another
// device than the one its stream claims (declaring that device's current registration, so
// that the stream is taken), tagged with the op ids just above the victim's (where the
// victim's next collectives will be). Every forged message is dropped and counted by the
// worker it reached, none is left queued, every victim result is right (checked against the
// host), and the daemons serve afterwards. Streams of senders that are no current
// registration of the cluster (issue #17 item 1) are refused when they open. Every wait has a
// deadline; teardown kills only this test's processes, by pid.
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/faults/fault_cluster.h"
#include "tests/support/exchange_stream.h"

namespace tessera {
namespace {

constexpr int kStreamsPerWorker = 10;
constexpr int kMessagesPerStream = 100;  // 4 workers x 10 streams x 100 = 4,000 forged messages

// Joins the flooders. Run by an absl::Cleanup on every way out of a test: a victim check that
// fails returns early (ASSERT_NO_FATAL_FAILURE), and destroying a joinable std::thread would
// terminate the binary (std::terminate) instead of failing the test. Each flooder ends by its
// streams' deadlines.
void join_all(std::vector<std::thread>& threads) {
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
}

class FloodTest : public FaultClusterTest {
 protected:
  // The victim: a client with x on every device, and its collective-heavy call, checked once.
  void start_victim() {
    absl::StatusOr<Client> client = connect();
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(*std::move(client));
    absl::StatusOr<std::vector<Device>> devices = client_->devices();
    ASSERT_TRUE(devices.ok()) << devices.status();
    devices_ = *devices;
    absl::StatusOr<Mesh> mesh = client_->make_mesh({kFaultWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    absl::StatusOr<Array> x = client_->device_put(host_, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(x.ok()) << x.status();
    x_.emplace(*std::move(x));
    check_victim_call();
  }
  void check_victim_call() {
    absl::StatusOr<std::vector<Array>> total = column_sum_({*x_});
    ASSERT_TRUE(total.ok()) << total.status();
    expect_equal((*total)[0], want_);
  }
  // What a stream from device `d` declares to be taken: its worker's current registration.
  DeclaredSender declared(int d) {
    absl::StatusOr<pb::HandshakeReply> r = worker_registration(devices_[d].address, credentials_.client);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? DeclaredSender{d, r->epoch(), r->incarnation()} : DeclaredSender{d};
  }
  // Every worker's stats, as the admin sees them.
  std::vector<pb::WorkerStats> worker_stats() {
    auto admin = std::make_shared<CallIdentity>(credentials_.admin);
    std::vector<pb::WorkerStats> out(kFaultWorkers);
    for (int w = 0; w < kFaultWorkers; ++w) {
      grpc::ClientContext ctx;
      set_deadline(&ctx, kControlDeadline);
      const grpc::Status s =
          pb::Worker::NewStub(make_channel(devices_[w].address, admin))->GetStats(&ctx, pb::GetStatsRequest(), &out[w]);
      EXPECT_TRUE(s.ok()) << "worker " << w << ": " << s.error_message();
    }
    return out;
  }
  // The daemons still serve: a new client's put and call.
  void check_served_afterwards() {
    absl::StatusOr<Client> after = connect();
    ASSERT_TRUE(after.ok()) << after.status();
    absl::StatusOr<Mesh> mesh = after->make_mesh({kFaultWorkers}, {"x"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    absl::StatusOr<Array> y = after->device_put(host_, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<std::vector<Array>> total = column_sum_({*y});
    ASSERT_TRUE(total.ok()) << total.status();
    expect_equal((*total)[0], want_);
  }

  const HostArray host_ = HostArray::arange(DType::kF32, {kFaultWorkers * 4, 64});
  const HostArray want_ = column_sums(host_);
  Jitted column_sum_ = jit([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {0})}; },
                           [] {
                             JitOptions options;
                             options.timeout = absl::Seconds(10);
                             return options;
                           }());
  std::optional<Client> client_;
  std::vector<Device> devices_;
  std::optional<Array> x_;
};

TEST_F(FloodTest, ForgedExchangeMessagesDuringCollectivesAreDroppedAndResultsStayRight) {
  ASSERT_NO_FATAL_FAILURE(start_victim());

  // The flood: worker w's streams claim device (w + 1) % n and carry messages naming
  // (w + 2) % n, op ids from the victim's last array id on (ids are predictable).
  const uint64_t base = x_->id();
  std::vector<DeclaredSender> senders;
  for (int w = 0; w < kFaultWorkers; ++w) senders.push_back(declared((w + 1) % kFaultWorkers));
  std::vector<std::atomic<int64_t>> sent(kFaultWorkers);
  std::vector<std::thread> flooders;
  absl::Cleanup join_flooders = [&flooders] { join_all(flooders); };
  for (int w = 0; w < kFaultWorkers; ++w) {
    flooders.emplace_back([&, w] {
      for (int s = 0; s < kStreamsPerWorker; ++s) {
        std::vector<pb::ExchangeMessage> messages(kMessagesPerStream);
        for (int k = 0; k < kMessagesPerStream; ++k) {
          messages[k].set_source_device((w + 2) % kFaultWorkers);
          messages[k].set_op_id(base + static_cast<uint64_t>(s * kMessagesPerStream + k));
          messages[k].set_data(std::string(1024, '\x7f'));
        }
        // The stream is read to its end (its status OK): every message reached the worker.
        const grpc::Status status = exchange_stream(devices_[w].address, credentials_.cluster, senders[w], messages);
        EXPECT_TRUE(status.ok()) << "worker " << w << ": " << status.error_message();
        if (status.ok()) sent[w].fetch_add(kMessagesPerStream);
      }
    });
  }
  // Meanwhile the victim's all-reduces, right every time.
  for (int i = 0; i < 20; ++i) ASSERT_NO_FATAL_FAILURE(check_victim_call());
  std::move(join_flooders).Invoke();

  const std::vector<pb::WorkerStats> stats = worker_stats();
  for (int w = 0; w < kFaultWorkers; ++w) {
    SCOPED_TRACE(absl::StrCat("worker ", w));
    EXPECT_EQ(sent[w].load(), kStreamsPerWorker * kMessagesPerStream);
    EXPECT_EQ(stats[w].exchange_messages_forged(), sent[w].load());
    EXPECT_EQ(stats[w].collective_messages_pending(), 0);
  }
  check_served_afterwards();
}

// Issue #17 item 1, "op ids are not guessable by outsiders": the drill that made 5 of 5
// all-reduces silently wrong. An insider with the cluster token opens, at every worker,
// streams declaring each other device's current registration (so they are taken, and their
// messages name their stream's own device: not forged in the sense above) and sends messages
// aimed at the victim's next op ids (the coordinator's counter, just above its last result's
// id) at every step of the 4-device tree all-reduce (0, 1, the broadcast's 64), of the right
// size, with no run tag or a wrong one. Each run's devices take only messages carrying the
// run's random tag (RunPlanRequest.run_tag): every victim result stays right (checked against
// the host), and at each worker at least the 9 messages aimed at each call's all-reduce op
// (3 sources x 3 steps) are dropped and counted when the run claims its ops. Before protocol
// version 28 nothing was counted, and the forged messages were taken as the peers' (wrong sums).
TEST_F(FloodTest, MessagesAtTheVictimsNextOpIdsWithoutItsRunTagAreDroppedAndResultsStayRight) {
  ASSERT_NO_FATAL_FAILURE(start_victim());
  constexpr int kCalls = 5;
  constexpr uint64_t kWindow = 32;  // op ids aimed at after the last id seen
  const std::vector<pb::WorkerStats> before = worker_stats();
  std::vector<DeclaredSender> senders;
  for (int d = 0; d < kFaultWorkers; ++d) senders.push_back(declared(d));
  uint64_t last_id = x_->id();
  const std::string forged_sum(64 * sizeof(float), '\x49');  // 64 floats of about 8.2e5 each
  for (int call = 0; call < kCalls; ++call) {
    SCOPED_TRACE(absl::StrCat("call ", call));
    for (int w = 0; w < kFaultWorkers; ++w) {
      for (int d = 0; d < kFaultWorkers; ++d) {
        if (d == w) continue;
        std::vector<pb::ExchangeMessage> messages;
        for (uint64_t op = last_id + 1; op <= last_id + kWindow; ++op) {
          for (int step : {0, 1, 64}) {
            pb::ExchangeMessage& m = messages.emplace_back();
            m.set_source_device(d);
            m.set_op_id(op);
            m.set_step(step);
            m.set_data(forged_sum);
            // Half carry no tag, half a made-up one.
            if (messages.size() % 2 == 0) m.set_run_tag(0x0123456789abcdefULL + op);
          }
        }
        const grpc::Status status = exchange_stream(devices_[w].address, credentials_.cluster, senders[d], messages);
        ASSERT_TRUE(status.ok()) << "worker " << w << ", as device " << d << ": " << status.error_message();
      }
    }
    absl::StatusOr<std::vector<Array>> total = column_sum_({*x_});
    ASSERT_TRUE(total.ok()) << total.status();
    expect_equal((*total)[0], want_);
    last_id = (*total)[0].id();
  }
  const std::vector<pb::WorkerStats> after = worker_stats();
  for (int w = 0; w < kFaultWorkers; ++w) {
    SCOPED_TRACE(absl::StrCat("worker ", w));
    EXPECT_GE(after[w].exchange_messages_forged() - before[w].exchange_messages_forged(), 9 * kCalls);
  }
  check_served_afterwards();
}

// The same drill aimed at a replicated put's fan-out (ShardHeader.fan_out: one upload, then a
// broadcast among the workers under the op id buffer id | 2^63, which the client starts, not
// the coordinator). Before each of 3 puts of a 256 KiB block to every device (the smallest that
// fans out: one chunk), the insider sends every worker, from each other device's declared
// registration, messages at the fan-out ops of the next array ids, step 0, chunk 0, of the
// block's size, each once untagged and once with a made-up tag. The members take only messages
// carrying the client's random tag (ShardFanOut.run_tag): every copy equals the host array, the
// put went by the fan-out (bytes_fanned_out), and each member counts the 6 messages aimed at
// its put's op (3 sources x 2) as forged: the uploader too, which only sends (before, it never
// claimed the op, so they were held as early messages under their sources' quotas, uncounted). Before protocol version
// 29 the fan-out's messages carried tag 0: the untagged ones were taken as the peer's (copies of 0x49 bytes) and only
// the 3 wrongly tagged ones were counted.
class FanOutFloodTest : public FloodTest {
 protected:
  bool client_shared_memory() const override { return false; }  // a co-located put does not fan out
};

TEST_F(FanOutFloodTest, MessagesAtTheVictimsNextFanOutOpsWithoutItsRunTagAreDroppedAndCopiesStayRight) {
  ASSERT_NO_FATAL_FAILURE(start_victim());
  constexpr int kPuts = 3;
  constexpr uint64_t kWindow = 4;  // array ids aimed at after the last id seen
  constexpr uint64_t kFanOutOpBit = uint64_t{1} << 63;
  std::vector<DeclaredSender> senders;
  for (int d = 0; d < kFaultWorkers; ++d) senders.push_back(declared(d));
  HostArray block(DType::kI32, {4, 16 << 10});  // 256 KiB
  for (int64_t i = 0; i < block.size(); ++i) block.mutable_values<int32_t>()[i] = static_cast<int32_t>(i * 7 + 3);
  const std::string forged(static_cast<size_t>(block.nbytes()), '\x49');
  absl::StatusOr<Mesh> mesh = client_->make_mesh({kFaultWorkers}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  // The latest id handed out, as the victim sees it (its check call drew more after x's).
  absl::StatusOr<Array> latest = client_->device_put(host_, NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(latest.ok()) << latest.status();
  uint64_t last_id = latest->id();
  // Kept until the end: dropping one sends its deletions, whose request ids are drawn from the
  // same counter, past the window.
  std::vector<Array> puts;
  for (int put = 0; put < kPuts; ++put) {
    SCOPED_TRACE(absl::StrCat("put ", put));
    const std::vector<pb::WorkerStats> before = worker_stats();
    for (int w = 0; w < kFaultWorkers; ++w) {
      for (int d = 0; d < kFaultWorkers; ++d) {
        if (d == w) continue;
        std::vector<pb::ExchangeMessage> messages;
        for (uint64_t id = last_id + 1; id <= last_id + kWindow; ++id) {
          for (uint64_t tag : {uint64_t{0}, uint64_t{0x0123456789abcdefULL} + id}) {
            pb::ExchangeMessage& m = messages.emplace_back();
            m.set_source_device(d);
            m.set_op_id(id | kFanOutOpBit);
            m.set_data(forged);
            m.set_run_tag(tag);
          }
        }
        const grpc::Status status = exchange_stream(devices_[w].address, credentials_.cluster, senders[d], messages);
        ASSERT_TRUE(status.ok()) << "worker " << w << ", as device " << d << ": " << status.error_message();
      }
    }
    absl::StatusOr<Array> copies = client_->device_put(block, NamedSharding(*mesh, P()));
    ASSERT_TRUE(copies.ok()) << copies.status();
    ASSERT_LE(copies->id() - last_id, kWindow) << "the window missed the put's array id";
    for (const Shard& s : copies->addressable_shards()) {
      absl::StatusOr<HostArray> got = s.data();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(*got == block) << "device " << s.device_id();
    }
    const std::vector<pb::WorkerStats> after = worker_stats();
    int members = 0;
    for (int w = 0; w < kFaultWorkers; ++w) {
      SCOPED_TRACE(absl::StrCat("worker ", w));
      // On every member, the uploader too (the root, which never receives: its fan-out claims
      // the op when it begins), each peer's two forgeries at the put's op were dropped.
      EXPECT_GE(after[w].exchange_messages_forged() - before[w].exchange_messages_forged(), 2 * (kFaultWorkers - 1));
      if (after[w].bytes_fanned_out() == before[w].bytes_fanned_out()) continue;  // the uploader
      EXPECT_EQ(after[w].bytes_fanned_out() - before[w].bytes_fanned_out(), block.nbytes());
      ++members;
    }
    EXPECT_EQ(members, kFaultWorkers - 1) << "the put did not fan out";
    last_id = copies->id();
    puts.push_back(*std::move(copies));
  }
  check_served_afterwards();
}

// Issue #17 item 1, "collective messages only from ... registered peers of the current
// cluster incarnation": a stream whose sender is no current registration of the cluster is
// refused PERMISSION_DENIED when it opens, naming the sender and the rule, before anything of
// it is read — an outsider (device 99 of this 4-device cluster, with the cluster token), a
// real device under an earlier coordinator epoch, a stream that does not declare its
// registration — while the victim's all-reduces stay right. (An earlier incarnation of a real
// device: WorkerRestartTest.) Before, each stream was taken and its messages held as early
// messages until their ops ended or the time-to-live.
TEST_F(FloodTest, StreamsOfSendersThatAreNoCurrentRegistrationAreRefusedWhenTheyOpen) {
  ASSERT_NO_FATAL_FAILURE(start_victim());
  const std::vector<pb::WorkerStats> before = worker_stats();
  const DeclaredSender peer = declared(1);
  pb::ExchangeMessage m;
  m.set_source_device(99);
  m.set_op_id(x_->id() + 1);  // where the victim's next collective goes
  m.set_data(std::string(1024, '\x7f'));
  struct Case {
    DeclaredSender sender;
    std::vector<std::string> error;  // what the refusal says
  };
  const std::vector<Case> cases = {
      {{99, peer.epoch, 1},
       {"device 99 (incarnation 1 of coordinator epoch", "device 99 is not a registered device of this cluster",
        "alive: 0, 1, 2, 3", "only from the current incarnations of the cluster's registered devices"}},
      {{1, peer.epoch - 1, peer.incarnation},
       {absl::StrCat("device 1 (incarnation ", peer.incarnation, " of coordinator epoch ", peer.epoch - 1, ")"),
        absl::StrCat("an earlier coordinator epoch than this worker's registration (", peer.epoch, ")")}},
      {{1, 0, 0}, {"the stream does not declare its sender ('tessera-device' 1, 'tessera-epoch' 0"}},
  };
  for (int w : {0, 2}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat("worker ", w, ", device ", c.sender.device, " epoch ", c.sender.epoch));
      m.set_source_device(c.sender.device);
      const grpc::Status status = exchange_stream(devices_[w].address, credentials_.cluster, c.sender, {m, m});
      EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
      for (const std::string& e : c.error) EXPECT_THAT(status.error_message(), ::testing::HasSubstr(e));
      ASSERT_NO_FATAL_FAILURE(check_victim_call());
    }
  }
  const std::vector<pb::WorkerStats> after = worker_stats();
  for (int w = 0; w < kFaultWorkers; ++w) {
    SCOPED_TRACE(absl::StrCat("worker ", w));
    EXPECT_EQ(after[w].collective_messages_pending(), 0);
    // Never read: nothing filed, dropped or counted.
    EXPECT_EQ(after[w].exchange_messages_dropped(), before[w].exchange_messages_dropped());
    EXPECT_EQ(after[w].exchange_messages_forged(), before[w].exchange_messages_forged());
  }
  check_served_afterwards();
}

// Issue #17 item 8, "a flood of malformed ... messages": bytes that are no ExchangeMessage,
// over streams authenticated with the cluster token, at every worker while the victim's
// collectives run. The worker's decoder (Transport::deliver) refuses each stream's first
// message and ends the stream with INVALID_ARGUMENT naming what is wrong; nothing is filed,
// the victim's results stay right and the daemons serve afterwards.
struct Malformed {
  std::string bytes;
  std::string error;  // what the worker's error says
};
const std::vector<Malformed>& malformed_messages() {
  static const auto* const kMessages = new std::vector<Malformed>{
      // A key varint of more than 5 bytes.
      {std::string(8, '\xff'), "key longer than 5 bytes"},
      // source_device (field 1, varint) cut short.
      {std::string("\x08\x80", 2), "truncated message"},
      // data (field 5) claiming 200 bytes, carrying 3.
      {std::string("\x08\x01\x10\x07\x2a\xc8\x01"
                   "abc",
                   10),
       "data of 200 bytes in a message with 3 left"},
      // A field ExchangeMessage does not have (15, varint).
      {std::string("\x08\x01\x78\x01", 4), "unexpected field 15 of wire type 0"},
      // Only a header: no data, no lost ops, no offer.
      {std::string("\x08\x01\x10\x07", 4), "neither data"},
      // A group start (wire type 3), which proto3 has no use for.
      {std::string("\x0b\x0c", 2), "unexpected field 1 of wire type 3"},
  };
  return *kMessages;
}

TEST_F(FloodTest, MalformedExchangeMessagesDuringCollectivesEndTheirStreamsAndResultsStayRight) {
  ASSERT_NO_FATAL_FAILURE(start_victim());
  const std::vector<pb::WorkerStats> before = worker_stats();
  const grpc::internal::RpcMethod exchange("/tessera.pb.Worker/Exchange", grpc::internal::RpcMethod::CLIENT_STREAMING);
  std::vector<std::atomic<int>> refused(kFaultWorkers);
  std::vector<DeclaredSender> senders;
  for (int w = 0; w < kFaultWorkers; ++w) senders.push_back(declared((w + 1) % kFaultWorkers));
  std::vector<std::thread> flooders;
  absl::Cleanup join_flooders = [&flooders] { join_all(flooders); };
  for (int w = 0; w < kFaultWorkers; ++w) {
    flooders.emplace_back([&, w] {
      auto identity = std::make_shared<CallIdentity>(credentials_.cluster, senders[w].device);
      std::shared_ptr<grpc::Channel> channel = make_channel(devices_[w].address, identity);
      for (int s = 0; s < kStreamsPerWorker * 5; ++s) {
        const Malformed& m = malformed_messages()[s % malformed_messages().size()];
        grpc::ClientContext ctx;
        set_deadline(&ctx, kControlDeadline);
        ctx.AddMetadata(kEpochKey, absl::StrCat(senders[w].epoch));
        ctx.AddMetadata(kIncarnationKey, absl::StrCat(senders[w].incarnation));
        grpc::ByteBuffer reply;
        std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
            grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(channel.get(), exchange, &ctx, &reply));
        // Several copies: the worker reads the first, ends the stream, and the rest fail to write.
        for (int k = 0; k < 10; ++k) {
          grpc::Slice slice(m.bytes);
          if (!writer->Write(grpc::ByteBuffer(&slice, 1))) break;
        }
        writer->WritesDone();
        const grpc::Status status = writer->Finish();
        EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
            << "worker " << w << ": " << status.error_message();
        EXPECT_THAT(status.error_message(), ::testing::HasSubstr("Exchange: "));
        EXPECT_THAT(status.error_message(), ::testing::HasSubstr(m.error));
        if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) refused[w].fetch_add(1);
      }
    });
  }
  for (int i = 0; i < 20; ++i) ASSERT_NO_FATAL_FAILURE(check_victim_call());
  std::move(join_flooders).Invoke();

  const std::vector<pb::WorkerStats> after = worker_stats();
  for (int w = 0; w < kFaultWorkers; ++w) {
    SCOPED_TRACE(absl::StrCat("worker ", w));
    EXPECT_EQ(refused[w].load(), kStreamsPerWorker * 5);
    // Nothing of it was filed, dropped or counted as forged: it never was a message.
    EXPECT_EQ(after[w].collective_messages_pending(), 0);
    EXPECT_EQ(after[w].exchange_messages_forged(), before[w].exchange_messages_forged());
    EXPECT_EQ(after[w].exchange_messages_dropped(), before[w].exchange_messages_dropped());
  }
  check_served_afterwards();
}

}  // namespace
}  // namespace tessera

// Transport: a message accepted for a peer whose stream then fails is never silently lost —
// the op fails at once on both ends, naming the peer (issue #17 item 3). Two transports
// served by real gRPC servers on 127.0.0.1, the sender's link running through a TCP relay
// this test holds (bytes stay unread, as with a stopped peer) and cuts (the connections drop,
// and the held bytes with them). Every wait has a deadline.
#include "worker/collectives/transport.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tests/support/psum_plan.h"
#include "tests/support/unix_sockets.h"
#include "worker/collectives/engine.h"
#include "worker/collectives/peer_view.h"
#include "worker/collectives/shm_ring.h"
#include "worker/interpreter.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// A transport behind a gRPC server of its own (only Exchange is served). With `peers`, streams
// are taken as a worker takes them: by the registration they declare (PeerView).
class Endpoint {
 public:
  explicit Endpoint(int device, PeerView* peers = nullptr) : service_(&transport_, peers) {
    transport_.set_self(device);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    configure_server(&builder);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
  }
  ~Endpoint() { server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(100)); }

  Transport& transport() { return transport_; }
  int port() const { return port_; }
  // The Exchange streams opened here so far, by the incarnation they declared ("" for none).
  std::map<std::string, int> declared() {
    absl::MutexLock lock(&service_.mu);
    return service_.declared;
  }

 private:
  class Service final : public pb::Worker::WithRawCallbackMethod_Exchange<pb::Worker::Service> {
   public:
    Service(Transport* transport, PeerView* peers) : transport_(transport), peers_(peers) {}
    grpc::ServerReadReactor<grpc::ByteBuffer>* Exchange(grpc::CallbackServerContext* ctx,
                                                        grpc::ByteBuffer* response) override {
      auto said = [ctx](const char* key) {
        auto it = ctx->client_metadata().find(key);
        return it == ctx->client_metadata().end() ? std::string() : std::string(it->second.data(), it->second.size());
      };
      {
        absl::MutexLock lock(&mu);
        ++declared[said(kIncarnationKey)];
      }
      if (peers_ == nullptr) return transport_->new_exchange_reader(response);
      StreamClaim claim;
      if (!absl::SimpleAtoi(said(kDeviceKey), &claim.device)) claim.device = -1;
      if (!absl::SimpleAtoi(said(kEpochKey), &claim.epoch)) claim.epoch = 0;
      if (!absl::SimpleAtoi(said(kIncarnationKey), &claim.incarnation)) claim.incarnation = 0;
      return transport_->new_exchange_reader(response, claim.device, peers_, claim);
    }

    absl::Mutex mu;
    std::map<std::string, int> declared ABSL_GUARDED_BY(mu);  // streams opened, by declared incarnation

   private:
    Transport* const transport_;
    PeerView* const peers_;
  };

  Transport transport_;  // outlives the server, whose readers deliver into it
  Service service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// Relays TCP connections from its port to `target_port`. hold() stops reading from the
// connecting side (what it sends stays in the socket buffers); cut() closes the connecting
// side of every connection so far, dropping what was held, and leaves the target side open
// and silent: to the target, its streams look alive. New connections relay normally.
class Relay {
 public:
  explicit Relay(int target_port) : target_port_(target_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    listen(listen_fd_, 16);
    socklen_t len = sizeof(addr);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  ~Relay() {
    stopping_ = true;
    acceptor_.join();
    for (std::thread& t : relays_) t.join();
    close(listen_fd_);
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  // Returns once every relaying thread has stopped reading from its connecting side.
  void hold() {
    absl::MutexLock lock(&mu_);
    held_ = true;
    auto all_held = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return holding_ == live_; };
    ASSERT_TRUE(mu_.AwaitWithTimeout(absl::Condition(&all_held), absl::Seconds(10)));
  }

  // Closes the connecting side of every connection so far and stops holding.
  void cut() {
    absl::MutexLock lock(&mu_);
    ++generation_;
    held_ = false;
  }

 private:
  void accept_loop() {
    while (!stopping_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (poll(&p, 1, 20) <= 0) continue;
      const int in = accept(listen_fd_, nullptr, nullptr);
      if (in < 0) continue;
      const int out = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<uint16_t>(target_port_));
      if (connect(out, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
        close(in);
        close(out);
        continue;
      }
      int generation = 0;
      {
        absl::MutexLock lock(&mu_);
        generation = generation_;
        ++live_;
      }
      relays_.emplace_back([this, in, out, generation] { relay(in, out, generation); });
    }
  }

  // Copies both ways until either side closes, the connection is cut, or the relay stops;
  // after a cut, keeps the target side open (and unread) until the relay stops.
  void relay(int in, int out, int generation) {
    char buffer[64 << 10];
    bool holding = false;
    while (!stopping_) {
      bool held = false;
      {
        absl::MutexLock lock(&mu_);
        if (generation_ != generation) break;
        held = held_;
        if (held != holding) holding_ += held ? 1 : -1;
        holding = held;
      }
      pollfd p[2] = {{in, static_cast<short>(held ? 0 : POLLIN), 0}, {out, POLLIN, 0}};
      if (poll(p, 2, 20) <= 0) continue;
      if ((p[0].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = read(in, buffer, sizeof(buffer));
        if (n <= 0 || write(out, buffer, static_cast<size_t>(n)) != n) break;
      }
      if ((p[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0) {
        const ssize_t n = read(out, buffer, sizeof(buffer));
        if (n <= 0 || write(in, buffer, static_cast<size_t>(n)) != n) break;
      }
    }
    close(in);
    bool was_cut = false;
    {
      absl::MutexLock lock(&mu_);
      --live_;
      if (holding) --holding_;
      was_cut = generation_ != generation;
    }
    while (was_cut && !stopping_) poll(nullptr, 0, 20);
    close(out);
  }

  const int target_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::vector<std::thread> relays_;  // touched by the acceptor only, joined after it
  absl::Mutex mu_;
  bool held_ ABSL_GUARDED_BY(mu_) = false;
  int generation_ ABSL_GUARDED_BY(mu_) = 0;
  int live_ ABSL_GUARDED_BY(mu_) = 0;
  int holding_ ABSL_GUARDED_BY(mu_) = 0;
};

constexpr int kSender = 0;
constexpr int kReceiver = 1;
// Long enough that a wait that hangs is obvious; the failures below come long before.
constexpr absl::Duration kDeadline = absl::Seconds(20);
constexpr absl::Duration kBound = absl::Seconds(5);

class TransportLossTest : public ::testing::Test {
 protected:
  absl::Status send(uint64_t op, int step) {
    const std::byte data[8] = {};
    return sender_.transport().send(kReceiver, relay_.address(), {op, step, 0}, data, sizeof(data),
                                    absl::Now() + kDeadline);
  }
  // What the receiver gets of op's message `step` from the sender, and how long it waited.
  absl::Status receive(uint64_t op, int step, absl::Duration* took) {
    const absl::Time start = absl::Now();
    absl::Status status =
        receiver_.transport().receive(kSender, "sender", {op, step, 0}, start, start + kDeadline).status();
    *took = absl::Now() - start;
    return status;
  }

  Endpoint receiver_{kReceiver};
  Endpoint sender_{kSender};
  Relay relay_{receiver_.port()};
};

TEST_F(TransportLossTest, AMessageLostWithItsStreamFailsTheOpAtBothEndsAndTheNextOpRuns) {
  absl::Duration took;
  ASSERT_TRUE(send(10, 0).ok());
  ASSERT_TRUE(receive(10, 0, &took).ok());  // the link is up
  sender_.transport().finish_op(10);
  receiver_.transport().finish_op(10);

  // Op 11's message is accepted, then its connection drops with it: the sender's op 11
  // (waiting for the receiver's answer) fails at once naming the receiver.
  relay_.hold();
  ASSERT_TRUE(send(11, 0).ok());
  relay_.cut();
  const absl::Time cut = absl::Now();
  absl::Status answer = sender_.transport().receive(kReceiver, "receiver", {11, 1, 0}, cut, cut + kDeadline).status();
  EXPECT_LT(absl::Now() - cut, kBound);
  EXPECT_EQ(answer.code(), absl::StatusCode::kUnavailable) << answer;
  EXPECT_THAT(std::string(answer.message()),
              HasSubstr(absl::StrCat("the stream to device 1 (", relay_.address(), ") failed")));
  EXPECT_EQ(send(11, 2).code(), absl::StatusCode::kUnavailable);
  // The receiver waits for that message in vain no more: the sender's notice fails it.
  absl::Status lost = receive(11, 0, &took);
  EXPECT_LT(took, kBound) << lost;
  EXPECT_EQ(lost.code(), absl::StatusCode::kUnavailable) << lost;
  EXPECT_THAT(std::string(lost.message()), HasSubstr("device 0 (sender) lost messages of op 11"));
  sender_.transport().finish_op(11);
  receiver_.transport().finish_op(11);

  // An op the sender had finished when its last message was lost: only the notice can tell.
  relay_.hold();
  ASSERT_TRUE(send(12, 0).ok());
  sender_.transport().finish_op(12);
  relay_.cut();
  absl::Status finished = receive(12, 0, &took);
  EXPECT_LT(took, kBound) << finished;
  EXPECT_EQ(finished.code(), absl::StatusCode::kUnavailable) << finished;
  EXPECT_THAT(std::string(finished.message()), HasSubstr("lost messages of op 12"));
  receiver_.transport().finish_op(12);

  // The next op runs on a fresh link, and nothing is left over.
  ASSERT_TRUE(send(13, 0).ok());
  EXPECT_TRUE(receive(13, 0, &took).ok());
  sender_.transport().finish_op(13);
  receiver_.transport().finish_op(13);
  EXPECT_EQ(receiver_.transport().pending_messages(), 0);
}

// What the Exchange reader does with each message's bytes (fuzz/exchange_fuzzer.cc found the
// first two: a truncated key and an empty message were filed as a message of op 0 from
// device 0; their inputs are in fuzz/corpus/exchange/).
grpc::ByteBuffer raw(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

TEST(TransportDeliver, RejectsTruncatedEmptyAndUnsourcedMessagesAndFilesAGoodOne) {
  Transport transport;
  transport.set_self(0);
  int source = -1;
  grpc::ByteBuffer truncated = raw("\xfa");  // a key's varint cut short
  absl::Status status = transport.deliver(&truncated, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("truncated"));
  // Found next: field 1's key 0x08 written in 6 bytes, which protobuf rejects (a key is at
  // most 5), was read as field 1.
  grpc::ByteBuffer long_key = raw(std::string("\x88\x80\x80\x80\x80\x00\x02", 7));
  status = transport.deliver(&long_key, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("a key longer than 5 bytes"));
  grpc::ByteBuffer empty = raw("");
  status = transport.deliver(&empty, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("neither data (field 5), lost ops (field 6) nor a shared-memory offer"));
  pb::ExchangeMessage m;
  m.set_source_device(-5);
  m.set_op_id(9);
  m.set_data("abcd");
  grpc::ByteBuffer unsourced = raw(m.SerializeAsString());
  status = transport.deliver(&unsourced, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("source device -5 is not a device id"));
  EXPECT_EQ(source, -1);
  EXPECT_EQ(transport.pending_messages(), 0);
  // Found by fuzz_exchange once offers existed: a shared-memory offer whose segment name is
  // not text (protobuf refuses a proto3 string that is not UTF-8) was accepted.
  grpc::ByteBuffer binary_offer = raw(std::string("\x08\x02\x3a\x02\xff\x01", 6));
  status = transport.deliver(&binary_offer, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("field 7 has byte 255, not printable ASCII"));
  EXPECT_EQ(source, -1);
  // Found by fuzz_exchange in CI (session 13's last run): lost_ops (field 6) whose length is a
  // 10-byte varint above 2^63 was compared as a negative int64, passed the bounds check, read
  // as no ops, and the data after it was filed; protobuf rejects the length.
  grpc::ByteBuffer huge_length =
      raw(std::string("\x32\xfb\xff\xff\xff\xff\xff\xff\xff\xff\x01\x10\x09\x2a\x04\x61\x62\x0c\x64", 19));
  status = transport.deliver(&huge_length, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("truncated"));
  EXPECT_EQ(source, -1);
  EXPECT_EQ(transport.pending_messages(), 0);

  m.set_source_device(2);
  grpc::ByteBuffer good = raw(m.SerializeAsString());
  ASSERT_TRUE(transport.deliver(&good, &source, -1).ok());
  EXPECT_EQ(source, 2);
  absl::StatusOr<Received> got = transport.receive(2, "", {9, 0, 0}, absl::InfinitePast(), absl::InfinitePast());
  ASSERT_TRUE(got.ok()) << got.status();
  std::string bytes(static_cast<size_t>(got->size()), '\0');
  got->copy_to(reinterpret_cast<std::byte*>(bytes.data()));
  EXPECT_EQ(bytes, "abcd");
}

// A stream authenticated as device 2 (its 'tessera-device', see proto/auth.h): a message or a
// shared-memory offer claiming another device is dropped and counted, a malformed one still
// ends the stream, and the ring it offers as itself is read as device 2's messages.
TEST(TransportDeliver, AnAuthenticatedStreamCarriesOnlyItsDevicesMessagesAndRing) {
  Transport transport;
  transport.set_self(0);
  ASSERT_TRUE(transport.set_shm({true, ShmRing::kMinBytes, "transport-test-host"}).ok());
  int source = -1;
  pb::ExchangeMessage forged;
  forged.set_source_device(1);
  forged.set_op_id(5);
  forged.set_data("abcd");
  grpc::ByteBuffer message = raw(forged.SerializeAsString());
  ASSERT_TRUE(transport.deliver(&message, &source, 2).ok());
  EXPECT_EQ(transport.forged_messages(), 1);
  EXPECT_EQ(transport.pending_messages(), 0);
  EXPECT_EQ(source, -1);

  // The sender's side: its ring, offered through its server.
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start("/dev/shm");
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 77);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  pb::ExchangeMessage offer;
  offer.set_source_device(1);
  offer.set_shm_segment((*server)->path());
  offer.set_shm_token(77);
  offer.set_shm_host("transport-test-host");
  message = raw(offer.SerializeAsString());
  ASSERT_TRUE(transport.deliver(&message, &source, 2).ok());
  EXPECT_EQ(transport.forged_messages(), 2);
  EXPECT_EQ(source, -1);

  grpc::ByteBuffer empty = raw("");
  absl::Status status = transport.deliver(&empty, &source, 2);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("neither data (field 5), lost ops (field 6) nor a shared-memory offer"));
  EXPECT_EQ(transport.forged_messages(), 2);

  offer.set_source_device(2);
  message = raw(offer.SerializeAsString());
  ASSERT_TRUE(transport.deliver(&message, &source, 2).ok());
  EXPECT_EQ(source, 2);
  const std::string data = "wxyz";
  ASSERT_TRUE(
      (*ring)->write({5, 0, 0, 4}, reinterpret_cast<const std::byte*>(data.data()), absl::Now() + absl::Seconds(10)));
  absl::StatusOr<Received> got =
      transport.receive(2, "", {5, 0, 0}, absl::InfinitePast(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  std::string bytes(static_cast<size_t>(got->size()), '\0');
  got->copy_to(reinterpret_cast<std::byte*>(bytes.data()));
  EXPECT_EQ(bytes, data);
  EXPECT_TRUE((*ring)->attached());
  EXPECT_EQ(transport.shm_messages_received(), 1);
  absl::StatusOr<Received> as_forged = transport.receive(1, "", {5, 0, 0}, absl::InfinitePast(), absl::InfinitePast());
  EXPECT_EQ(as_forged.status().code(), absl::StatusCode::kDeadlineExceeded) << as_forged.status();
  EXPECT_EQ(transport.forged_messages(), 2);
}

// The mailbox's bounds (issue #17 item 5): a source's share, the device's memory, messages of
// ops that never start, and the ops a failed run will not start.
pb::ExchangeMessage data_message(int source, uint64_t op, int chunk, std::string data) {
  pb::ExchangeMessage m;
  m.set_source_device(source);
  m.set_op_id(op);
  m.set_chunk(chunk);
  m.set_data(std::move(data));
  return m;
}

absl::Status deliver(Transport& transport, const pb::ExchangeMessage& m) {
  grpc::ByteBuffer buffer = raw(m.SerializeAsString());
  int source = -1;
  return transport.deliver(&buffer, &source, -1);
}

TEST(TransportMailbox, ASourcesShareAndTheDevicesMemoryBoundItAndTheOpFailsAtOnce) {
  Transport transport;
  transport.set_self(0);
  int64_t charged = 0;
  bool memory_full = false;
  MailboxOptions options;
  // Two messages of 4 bytes, each charged its bookkeeping too.
  constexpr int64_t kCharge = 4 + Transport::kHeldMessageBytes;
  options.bytes_per_peer = 2 * kCharge;
  options.reserve = [&](int64_t bytes) {
    if (memory_full) return false;
    charged += bytes;
    return true;
  };
  options.release = [&](int64_t bytes) { charged -= bytes; };
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  ASSERT_TRUE(deliver(transport, data_message(2, 9, 0, "abcd")).ok());
  ASSERT_TRUE(deliver(transport, data_message(2, 9, 1, "efgh")).ok());
  ASSERT_TRUE(deliver(transport, data_message(2, 9, 2, "ijkl")).ok());  // over device 2's share: dropped
  ASSERT_TRUE(deliver(transport, data_message(3, 9, 0, "mnop")).ok());  // device 3's share is its own
  EXPECT_EQ(transport.pending_messages(), 3);
  EXPECT_EQ(transport.pending_bytes(), 12);
  EXPECT_EQ(charged, 3 * kCharge);
  EXPECT_EQ(transport.dropped_messages(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<Received> dropped = transport.receive(2, "h:1", {9, 0, 2}, absl::InfinitePast(), deadline);
  EXPECT_EQ(dropped.status().code(), absl::StatusCode::kResourceExhausted) << dropped.status();
  EXPECT_THAT(
      std::string(dropped.status().message()),
      AllOf(HasSubstr("op 9 from device 2"), HasSubstr(absl::StrCat(2 * kCharge, " bytes, --mailbox_bytes_per_peer"))));
  absl::StatusOr<Received> kept = transport.receive(3, "h:1", {9, 0, 0}, absl::InfinitePast(), deadline);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(charged, 2 * kCharge);
  memory_full = true;
  ASSERT_TRUE(deliver(transport, data_message(3, 10, 0, "qrst")).ok());
  absl::StatusOr<Received> no_memory = transport.receive(3, "h:1", {10, 0, 0}, absl::InfinitePast(), deadline);
  EXPECT_EQ(no_memory.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(no_memory.status().message()), HasSubstr("free memory (--memory_bytes)"));
  transport.finish_op(9);
  transport.finish_op(10);
  EXPECT_EQ(transport.pending_messages(), 0);
  EXPECT_EQ(transport.pending_bytes(), 0);
  EXPECT_EQ(charged, 0);
}

// A source's messages held for ops not started here are bounded by number too
// (--mailbox_messages_per_peer): bench_programs' flood held 5,000 one-KiB messages of ops that
// never start, well within the byte share. The (cap+1)-th is refused and its op's wait names
// the bound; a started op's messages are not counted (they are taken as they come), and taking
// a held one makes room again.
TEST(TransportMailbox, ASourcesEarlyMessagesAreBoundedByNumber) {
  Transport transport;
  transport.set_self(0);
  MailboxOptions options;
  options.messages_per_peer = 3;  // the byte share (64 MiB) is far away
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  for (uint64_t op = 1; op <= 4; ++op) ASSERT_TRUE(deliver(transport, data_message(2, op, 0, "abcd")).ok());
  ASSERT_TRUE(deliver(transport, data_message(3, 4, 0, "efgh")).ok());  // device 3 counts apart
  EXPECT_EQ(transport.pending_messages(), 4);
  EXPECT_EQ(transport.dropped_messages(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<Received> dropped = transport.receive(2, "h:1", {4, 0, 0}, absl::InfinitePast(), deadline);
  EXPECT_EQ(dropped.status().code(), absl::StatusCode::kResourceExhausted) << dropped.status();
  EXPECT_THAT(std::string(dropped.status().message()),
              AllOf(HasSubstr("op 4 from device 2"), HasSubstr("3 messages, --mailbox_messages_per_peer")));
  // Op 5 starts here (its receive times out: nothing sent yet); then its messages are held
  // beyond the count, as many as come.
  EXPECT_EQ(transport.receive(2, "h:1", {5, 0, 0}, absl::InfinitePast(), absl::Now()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  for (int chunk = 0; chunk < 5; ++chunk) {
    ASSERT_TRUE(deliver(transport, data_message(2, 5, chunk, std::string(4, static_cast<char>('0' + chunk)))).ok());
  }
  EXPECT_EQ(transport.pending_messages(), 9);
  EXPECT_EQ(transport.dropped_messages(), 1);
  for (int chunk = 0; chunk < 5; ++chunk) {
    absl::StatusOr<Received> got = transport.receive(2, "h:1", {5, 0, chunk}, absl::InfinitePast(), deadline);
    ASSERT_TRUE(got.ok()) << got.status();
    std::string bytes(4, '\0');
    got->copy_to(reinterpret_cast<std::byte*>(bytes.data()));
    EXPECT_EQ(bytes, std::string(4, static_cast<char>('0' + chunk)));
  }
  // Taking one of the three early messages makes room for one more early message, not two.
  ASSERT_TRUE(transport.receive(2, "h:1", {1, 0, 0}, absl::InfinitePast(), deadline).ok());
  ASSERT_TRUE(deliver(transport, data_message(2, 6, 0, "ijkl")).ok());
  ASSERT_TRUE(deliver(transport, data_message(2, 7, 0, "mnop")).ok());
  EXPECT_EQ(transport.dropped_messages(), 2);
  EXPECT_TRUE(transport.receive(2, "h:1", {6, 0, 0}, absl::InfinitePast(), deadline).ok());
  EXPECT_EQ(transport.receive(2, "h:1", {7, 0, 0}, absl::InfinitePast(), deadline).status().code(),
            absl::StatusCode::kResourceExhausted);
  transport.finish_ops(1, 8);
  EXPECT_EQ(transport.pending_messages(), 0);
  options.messages_per_peer = 0;
  EXPECT_EQ(transport.set_mailbox(options).code(), absl::StatusCode::kInvalidArgument);
}

// Ops of a plan run going here (begin_run_ops) are awaited, not early, however far ahead the
// sender is: a device that only sends (a one-way permute pipeline of more ops than the count)
// is not refused. Messages held before the run began stop counting when it begins; after the
// run ends (end_run_ops), messages of ops it did not reach count again.
TEST(TransportMailbox, OpsOfARunGoingHereAreNotCountedAsEarly) {
  Transport transport;
  transport.set_self(0);
  MailboxOptions options;
  options.messages_per_peer = 3;
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  // Three early messages, at the count, before the run's plan reached this worker.
  for (uint64_t op = 100; op < 103; ++op) ASSERT_TRUE(deliver(transport, data_message(2, op, 0, "a")).ok());
  transport.begin_run_ops(100, 2000, /*run_tag=*/0);
  for (uint64_t op = 103; op < 1200; ++op) ASSERT_TRUE(deliver(transport, data_message(2, op, 0, "b")).ok());
  EXPECT_EQ(transport.pending_messages(), 1100);
  EXPECT_EQ(transport.dropped_messages(), 0);
  // Outside the run's range the count still holds: 3 more early messages, the fourth refused.
  for (uint64_t op = 5000; op < 5004; ++op) ASSERT_TRUE(deliver(transport, data_message(2, op, 0, "c")).ok());
  EXPECT_EQ(transport.dropped_messages(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (uint64_t op = 100; op < 1200; ++op) {
    ASSERT_TRUE(transport.receive(2, "h:1", {op, 0, 0}, absl::InfinitePast(), deadline).ok()) << op;
  }
  transport.end_run_ops(100, 2000, /*run_tag=*/0);
  ASSERT_TRUE(deliver(transport, data_message(2, 1500, 0, "d")).ok());  // the run has ended: early again
  EXPECT_EQ(transport.dropped_messages(), 2);
  EXPECT_EQ(transport.receive(2, "h:1", {1500, 0, 0}, absl::InfinitePast(), deadline).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// A flood of tiny messages is bounded by its bookkeeping, not only by its data: each message is
// charged kHeldMessageBytes (256) beyond its byte, so a share of 2,570 bytes keeps 10 of 100
// one-byte messages (before, it kept every one: 100 bytes of data, some 20 KB held).
TEST(TransportMailbox, EachMessageIsChargedItsBookkeeping) {
  Transport transport;
  transport.set_self(0);
  int64_t charged = 0;
  MailboxOptions options;
  options.bytes_per_peer = 2570;
  options.reserve = [&](int64_t bytes) {
    charged += bytes;
    return true;
  };
  options.release = [&](int64_t bytes) { charged -= bytes; };
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  for (uint64_t op = 1; op <= 100; ++op) ASSERT_TRUE(deliver(transport, data_message(2, op, 0, "x")).ok());
  EXPECT_EQ(transport.pending_messages(), 10);
  EXPECT_EQ(transport.pending_bytes(), 10);
  EXPECT_EQ(charged, options.bytes_per_peer);
  EXPECT_EQ(transport.dropped_messages(), 90);
  transport.finish_ops(1, 101);
  EXPECT_EQ(charged, 0);
}

// A message of an op not started here keeps a copy of its own data, not the buffer it arrived
// in: gRPC's slices of a message point into the socket reads it came in, shared with the
// messages around it, and one held message kept them all (bench_programs' flood: 5,000 held
// messages of 1 KiB took 10.7 MB, now 5.6 MB). Here the message arrives inside a 64 KiB
// buffer whose release the test sees: released once the test lets go of it, while the message
// is still held, and the message's data is whole.
TEST(TransportMailbox, AHeldMessageKeepsNoneOfTheBufferItArrivedIn) {
  Transport transport;
  transport.set_self(0);
  const std::string message = data_message(1, 40, 0, std::string(1000, 'q')).SerializeAsString();
  static std::atomic<int> released{0};
  released = 0;
  char* buffer = new char[64 << 10];
  std::memcpy(buffer, message.data(), message.size());
  {
    grpc::Slice whole(buffer, 64 << 10, [](void* p) {
      delete[] static_cast<char*>(p);
      ++released;
    });
    grpc::Slice just_the_message = whole.sub(0, message.size());
    grpc::ByteBuffer received(&just_the_message, 1);
    int source = -1;
    ASSERT_TRUE(transport.deliver(&received, &source, -1).ok());
  }
  EXPECT_EQ(released.load(), 1) << "the held message still points into the buffer it arrived in";
  EXPECT_EQ(transport.pending_messages(), 1);
  absl::StatusOr<Received> got =
      transport.receive(1, "h:1", {40, 0, 0}, absl::InfinitePast(), absl::Now() + absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 1000);
  std::string data(1000, '\0');
  got->copy_to(reinterpret_cast<std::byte*>(data.data()));
  EXPECT_EQ(data, std::string(1000, 'q'));
}

TEST(TransportMailbox, MessagesOfOpsThatNeverStartAreDroppedAfterTheTtl) {
  Transport transport;
  transport.set_self(0);
  MailboxOptions options;
  options.unclaimed_ttl = absl::Milliseconds(40);
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  // Op 21 has started here (a receive waited for it), op 20 never does.
  EXPECT_EQ(transport.receive(1, "h:1", {21, 0, 1}, absl::InfinitePast(), absl::InfinitePast()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  ASSERT_TRUE(deliver(transport, data_message(1, 20, 0, "old")).ok());
  ASSERT_TRUE(deliver(transport, data_message(1, 21, 0, "awaited")).ok());
  absl::SleepFor(absl::Milliseconds(60));  // the rule under test is an age: let them age past it
  ASSERT_TRUE(deliver(transport, data_message(1, 22, 0, "new")).ok());  // a delivery sweeps
  EXPECT_EQ(transport.pending_messages(), 2);
  EXPECT_EQ(transport.dropped_messages(), 1);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  absl::StatusOr<Received> old = transport.receive(1, "h:1", {20, 0, 0}, absl::InfinitePast(), deadline);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(old.status().message()), HasSubstr("longer than the mailbox keeps unclaimed messages"));
  EXPECT_TRUE(transport.receive(1, "h:1", {21, 0, 0}, absl::InfinitePast(), deadline).ok());
  EXPECT_TRUE(transport.receive(1, "h:1", {22, 0, 0}, absl::InfinitePast(), deadline).ok());
}

// Without another delivery the worker's heartbeat sweeps (Transport::sweep): a flood of messages
// for ops that never start is let go after the time-to-live even when nothing more arrives
// (bench_soak found them held for good: the sweep ran only when a message was filed).
TEST(TransportMailbox, ASweepWithoutNewMessagesDropsWhatOutlivedTheTtl) {
  Transport transport;
  transport.set_self(0);
  MailboxOptions options;
  options.unclaimed_ttl = absl::Milliseconds(40);
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  for (uint64_t op = 30; op < 40; ++op) ASSERT_TRUE(deliver(transport, data_message(1, op, 0, "never")).ok());
  transport.sweep();  // younger than the time-to-live: kept
  EXPECT_EQ(transport.pending_messages(), 10);
  absl::SleepFor(absl::Milliseconds(60));  // the rule under test is an age: let them age past it
  transport.sweep();
  EXPECT_EQ(transport.pending_messages(), 0);
  EXPECT_EQ(transport.pending_bytes(), 0);
  EXPECT_EQ(transport.dropped_messages(), 10);
}

// Behind the stream check (PeerView, below: a worker refuses the stream of a device that is no
// current registration when it opens), the mailbox keeps its own rule: an op receives only from
// the device it names, so a message of another device under the same tag never reaches it,
// and such messages are bounded by their source's share and go when the op ends. (Before
// session 29 this was all that held: the outsider's stream was taken.)
TEST(TransportMailbox, AnOutsidersMessagesNeverReachAnOpAndGoWithIt) {
  Transport transport;
  transport.set_self(0);
  for (int authenticated : {-1, 99}) {
    const uint64_t op = authenticated < 0 ? 40 : 41;
    grpc::ByteBuffer outsider = raw(data_message(99, op, 0, "evil").SerializeAsString());
    int source = -1;
    ASSERT_TRUE(transport.deliver(&outsider, &source, authenticated).ok());
    EXPECT_EQ(source, 99);
    EXPECT_EQ(transport.forged_messages(), 0);
    EXPECT_EQ(transport.pending_messages(), 1);  // held, as an early message of device 99
    ASSERT_TRUE(deliver(transport, data_message(1, op, 0, "good")).ok());
    absl::StatusOr<Received> got =
        transport.receive(1, "h:1", {op, 0, 0}, absl::InfinitePast(), absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(got.ok()) << got.status();
    std::string bytes(static_cast<size_t>(got->size()), '\0');
    got->copy_to(reinterpret_cast<std::byte*>(bytes.data()));
    EXPECT_EQ(bytes, "good");
    transport.finish_op(op);
    EXPECT_EQ(transport.pending_messages(), 0) << "op " << op;
  }
}

TEST(TransportMailbox, FinishingARangeDropsItsOpsNowAndLater) {
  Transport transport;
  transport.set_self(0);
  for (uint64_t op : {30, 31, 35}) ASSERT_TRUE(deliver(transport, data_message(1, op, 0, "x")).ok());
  transport.finish_ops(30, 35);  // a failed run's ops 30..34
  EXPECT_EQ(transport.pending_messages(), 1);
  ASSERT_TRUE(deliver(transport, data_message(1, 32, 0, "late")).ok());
  ASSERT_TRUE(deliver(transport, data_message(1, 34, 0, "late")).ok());
  EXPECT_EQ(transport.pending_messages(), 1);
  EXPECT_EQ(transport.dropped_messages(), 2);
  EXPECT_TRUE(transport.receive(1, "h:1", {35, 0, 0}, absl::InfinitePast(), absl::Now() + absl::Seconds(10)).ok());
  // Single ops finished one after another merge into one range; none is forgotten early.
  for (uint64_t op = 100; op < 100 + 10'000; ++op) transport.finish_op(op);
  ASSERT_TRUE(deliver(transport, data_message(1, 100, 0, "late")).ok());
  EXPECT_EQ(transport.pending_messages(), 0);
}

// A run that fails finishes the ops of the instructions it will not run when it has
// collectives: a peer's late message for its all_reduce is dropped, now and later. A run
// without collectives (PlanRun::has_collectives false, as LoadedPlan computes it) claimed no
// op range and finishes none: a message at its failed instruction's op is held like any other
// early one (before session 41 that op's end was recorded and the message dropped). Both fail
// naming the instruction: psum_plan's mul, whose node says f32[4], refuses f32[3] operands at
// instruction 0 (op plan_op_id(7, 0) = 8), before the all_reduce (op 9); without collectives
// the plan is that mul alone.
TEST(TransportMailbox, AFailedRunFinishesTheOpsItWillNotRunOnlyWithCollectives) {
  for (bool collectives : {true, false}) {
    SCOPED_TRACE(collectives ? "with an all_reduce" : "without collectives");
    DevicePlan plan = psum_plan({0, 1});
    if (!collectives) {
      plan.code.resize(1);
      plan.output_slots = {1};
    }
    ASSERT_EQ(plan_has_collectives(plan), collectives);
    Transport transport;
    transport.set_self(0);
    PlanRun run;
    run.execution = 7;
    run.run_tag = 5;
    run.peers = {{0, "h:0"}, {1, "h:1"}};
    run.deadline = absl::Now() + absl::Seconds(10);
    run.has_collectives = collectives;
    std::vector<std::shared_ptr<const HostArray>> inputs;
    inputs.push_back(std::make_shared<const HostArray>(HostArray::ones(DType::kF32, {3})));
    absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> out =
        run_plan(plan, std::move(inputs), transport, run);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(
        std::string(out.status().message()),
        HasSubstr("instruction 0 (mul): mul: the operands (f32[3], f32[3]) give f32[3] but the node is f32[4]"));
    ASSERT_TRUE(deliver(transport, data_message(1, plan_op_id(7, collectives ? 1 : 0), 0, "late")).ok());
    EXPECT_EQ(transport.dropped_messages(), collectives ? 1 : 0);
    EXPECT_EQ(transport.pending_messages(), collectives ? 0 : 1);
  }
}

// A put's fan-out runs under its buffer id with bit 63 (Transfers::kFanOutOpBit), ids that do
// not grow with the runs': their ends are remembered apart, so that many fan-outs never push a
// run's range out (before, 4,096 of them did: each new run's range was then the lowest and
// forgotten at once, and a late message of a finished run was filed and held until the
// time-to-live); and the first finished of them are the first forgotten.
TEST(TransportMailbox, FanOutEndsAreRememberedApartFromTheRunsRanges) {
  Transport transport;
  transport.set_self(0);
  const uint64_t fan_out = Transport::kUnorderedOps;
  for (uint64_t id = 5'000; id > 0; --id) transport.finish_op(fan_out | id);  // ids in any order
  transport.finish_op(7);                                                     // a run's op, after them
  ASSERT_TRUE(deliver(transport, data_message(1, 7, 0, "late")).ok());
  ASSERT_TRUE(deliver(transport, data_message(1, fan_out | 1, 0, "late")).ok());  // finished last: kept in mind
  EXPECT_EQ(transport.pending_messages(), 0);
  EXPECT_EQ(transport.dropped_messages(), 2);
  ASSERT_TRUE(deliver(transport, data_message(1, fan_out | 5'000, 0, "unknown")).ok());  // finished first: forgotten
  EXPECT_EQ(transport.pending_messages(), 1);
}

// In process (Client::local's embedded workers): a transport serving an in-process address
// takes its peers' messages straight into its mailbox. No gRPC server serves these addresses,
// so a message that took the stream path could never arrive (its wait would end at the
// deadline); the counter says which path each took.
TEST(TransportInProcess, MessagesGoStraightIntoThePeersMailboxSmallAndLarge) {
  Transport a, b;
  a.set_self(0);
  b.set_self(1);
  const std::string at_a = "in-process:60001", at_b = "in-process:60002";
  ASSERT_TRUE(a.serve_in_process(at_a).ok());
  ASSERT_TRUE(b.serve_in_process(at_b).ok());
  EXPECT_TRUE(a.in_process());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  const std::string small = "four";
  ASSERT_TRUE(a.send(1, at_b, {7, 0, 0}, reinterpret_cast<const std::byte*>(small.data()), 4, deadline).ok());
  // A large message of an op running at the receiver is zero-copy: it reads the sender's bytes.
  auto big = std::make_shared<std::vector<std::byte>>(Transport::kZeroCopyMinBytes * 2);
  for (size_t i = 0; i < big->size(); ++i) (*big)[i] = static_cast<std::byte>(i * 7 + 1);
  const std::vector<std::byte> want = *big;
  std::optional<absl::StatusOr<Received>> large;
  std::thread waiter([&] { large = b.receive(0, at_a, {7, 1, 0}, absl::InfinitePast(), deadline); });
  ASSERT_TRUE(a.send(1, at_b, {7, 1, 0}, big->data(), static_cast<int64_t>(big->size()), deadline, big).ok());
  waiter.join();
  absl::StatusOr<Received> got = b.receive(0, at_a, {7, 0, 0}, absl::InfinitePast(), deadline);
  ASSERT_TRUE(got.ok()) << got.status();
  std::string text(4, ' ');
  got->copy_to(reinterpret_cast<std::byte*>(text.data()));
  EXPECT_EQ(text, "four");
  ASSERT_TRUE(large->ok()) << large->status();
  std::vector<std::byte> out((*large)->size());
  (*large)->copy_to(out.data());
  EXPECT_EQ(out, want);
  EXPECT_EQ(b.in_process_messages_received(), 2);
  EXPECT_EQ(a.in_process_messages_received(), 0);
  // Another transport may not serve the same address, and only in-process addresses are served.
  Transport c;
  EXPECT_EQ(c.serve_in_process(at_b).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c.serve_in_process("127.0.0.1:5").code(), absl::StatusCode::kInvalidArgument);
  b.finish_op(7);
  EXPECT_EQ(b.pending_messages(), 0);
}

// A peer transport that goes: a wait for its message of a running op fails at once naming it
// (not at the deadline), and a send to it fails naming it.
TEST(TransportInProcess, APeerThatStopsFailsTheWaitsOnItAndTheSendsToItNamingIt) {
  Transport a;
  a.set_self(0);
  const std::string at_a = "in-process:60011", at_b = "in-process:60012";
  ASSERT_TRUE(a.serve_in_process(at_a).ok());
  auto b = std::make_unique<Transport>();
  b->set_self(3);
  ASSERT_TRUE(b->serve_in_process(at_b).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  const std::string byte = "x";
  // b has sent to a before (as every member of a collective does in its first op).
  ASSERT_TRUE(b->send(0, at_a, {20, 0, 0}, reinterpret_cast<const std::byte*>(byte.data()), 1, deadline).ok());
  ASSERT_TRUE(a.receive(3, at_b, {20, 0, 0}, absl::InfinitePast(), deadline).ok());
  const absl::Time op_start = absl::Now();
  std::optional<absl::StatusOr<Received>> waited;
  absl::Time failed_at;
  absl::Notification waiting;
  std::thread waiter([&] {
    waiting.Notify();
    waited = a.receive(3, at_b, {21, 0, 0}, op_start, deadline);
    failed_at = absl::Now();
  });
  waiting.WaitForNotification();
  b.reset();  // its worker stopped
  waiter.join();
  EXPECT_EQ(waited->status().code(), absl::StatusCode::kUnavailable) << waited->status();
  EXPECT_THAT(std::string(waited->status().message()), HasSubstr("device 3 (in-process:60012) went away during op 21"));
  EXPECT_LT(failed_at - op_start, absl::Seconds(10)) << "the wait lasted to the deadline";
  absl::Status sent = a.send(3, at_b, {21, 1, 0}, reinterpret_cast<const std::byte*>(byte.data()), 1, deadline);
  EXPECT_EQ(sent.code(), absl::StatusCode::kUnavailable) << sent;
  EXPECT_THAT(std::string(sent.message()), HasSubstr("device 3 (in-process:60012) is not serving collectives"));
}

// A worker that stops (WorkerServer::stop_all_but_server: stop_in_process_collectives, which is
// close_in_process on its transport) while a peer is inside a collective with it: the peer's
// collective fails at once naming the stopped device, with no cancel (its `cancelled` never
// says true, as when no coordinator cancels the run) and with the stopped worker's gRPC server
// still up and its transport alive, as stop_all_but_server leaves them. So the stop alone ends
// the peers' waits (in_process_test's stop_a_worker_mid_run cannot tell it from the cancel).
TEST(TransportInProcess, StoppingAWorkersInProcessCollectivesFailsAPeersCollectiveWithItNamingIt) {
  Endpoint a(0), b(3);  // each behind a gRPC server of its own on 127.0.0.1, as a worker is
  const std::map<int, std::string> peers = {{0, "in-process:60021"}, {3, "in-process:60022"}};
  ASSERT_TRUE(a.transport().serve_in_process(peers.at(0)).ok());
  ASSERT_TRUE(b.transport().serve_in_process(peers.at(3)).ok());
  CollectiveSpec sum;
  sum.kind = CollectiveKind::kAllReduce;
  sum.reduce_op = ReduceOp::kSum;
  sum.groups = {{0, 3}};
  auto all_reduce = [&](Endpoint& e, int self, uint64_t op, absl::Time start, absl::Duration timeout) {
    CollectiveRun run;
    run.op = op;
    run.spec = sum;
    run.peers = peers;
    run.self = self;
    run.start = start;
    run.deadline = start + timeout;
    run.cancelled = [] { return false; };  // no coordinator cancels it
    return run_collective(
        e.transport(), run,
        std::make_shared<const HostArray>(HostArray::from_vector<float>({4}, std::vector<float>(4, self + 1.0f))));
  };
  // A first all_reduce both run: 1 + 4 on each. It is what the test stands on: close_in_process
  // tells only the peers it has sent to (in_process_sent_to_), so without it device 0 would wait
  // in the next one to its deadline.
  std::optional<absl::StatusOr<std::shared_ptr<const HostArray>>> at_b;
  std::thread b_runs([&] { at_b = all_reduce(b, 3, 40, absl::Now(), absl::Seconds(20)); });
  absl::StatusOr<std::shared_ptr<const HostArray>> at_a = all_reduce(a, 0, 40, absl::Now(), absl::Seconds(20));
  b_runs.join();
  ASSERT_TRUE(at_a.ok()) << at_a.status();
  ASSERT_TRUE(at_b->ok()) << at_b->status();
  EXPECT_EQ((*at_a)->values<float>()[0], 5.0f);
  EXPECT_EQ((**at_b)->values<float>()[3], 5.0f);

  // The next: device 0 begins it (op_start, before the stop: a stop before an op began does not
  // fail it, see Transport::ready_locked) and waits in it for device 3, whose worker stops
  // instead of joining.
  const absl::Time op_start = absl::Now();
  std::optional<absl::StatusOr<std::shared_ptr<const HostArray>>> waited;
  absl::Time failed_at;
  absl::Notification waiting;
  // Device 0 is rank 0 of the tree all_reduce of 16 bytes: it receives before it sends, so the
  // stop fails its wait ("went away"), not a send ("is not serving collectives"); with a ring
  // a stop before its first send would fail the send instead.
  std::thread a_runs([&] {
    waiting.Notify();
    waited = all_reduce(a, 0, 41, op_start, absl::Seconds(15));
    failed_at = absl::Now();
  });
  waiting.WaitForNotification();
  b.transport().close_in_process();  // what stop_in_process_collectives does
  a_runs.join();
  ASSERT_TRUE(waited.has_value());
  EXPECT_EQ(waited->status().code(), absl::StatusCode::kUnavailable) << waited->status();
  EXPECT_THAT(std::string(waited->status().message()), HasSubstr("device 3 (in-process:60022) went away during op 41"))
      << waited->status();
  EXPECT_LT(failed_at - op_start, absl::Seconds(10)) << "the collective lasted to its deadline";
  EXPECT_FALSE(b.transport().in_process());
  a.transport().finish_op(40);
  a.transport().finish_op(41);
}

// The mailbox's bounds apply to messages filed in process as to those read from a stream: one
// over the source's share is dropped and the op's wait fails at once saying why.
TEST(TransportInProcess, TheMailboxsBoundsStillApply) {
  Transport a, b;
  a.set_self(0);
  b.set_self(1);
  MailboxOptions options;
  options.bytes_per_peer = 100 + Transport::kHeldMessageBytes;
  ASSERT_TRUE(b.set_mailbox(options).ok());
  ASSERT_TRUE(a.serve_in_process("in-process:60021").ok());
  ASSERT_TRUE(b.serve_in_process("in-process:60022").ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  const std::vector<std::byte> data(101);
  ASSERT_TRUE(a.send(1, "in-process:60022", {30, 0, 0}, data.data(), 101, deadline).ok());
  absl::StatusOr<Received> got = b.receive(0, "in-process:60021", {30, 0, 0}, absl::InfinitePast(), deadline);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("--mailbox_bytes_per_peer"));
  EXPECT_EQ(b.dropped_messages(), 1);
}

// Flow control at a source's share (issue #17 items 3 and 5): a message that would pass its
// sender's share of the mailbox waits, and its stream (or ring) is read no further, until the
// receiver takes messages of that sender. Two transports behind real gRPC servers on 127.0.0.1.

// Waits, bounded, until `ready()` (the test's view of another thread's progress).
bool eventually(const std::function<bool()>& ready) {
  for (const absl::Time until = absl::Now() + kDeadline; absl::Now() < until;) {
    if (ready()) return true;
    absl::SleepFor(absl::Milliseconds(5));  // polling, bounded by kDeadline
  }
  return ready();
}

// An Exchange message of `device`'s offering the ring of `token` at ring server `socket`.
grpc::ByteBuffer ring_offer(int device, const std::string& socket, uint64_t token) {
  pb::ExchangeMessage offer;
  offer.set_source_device(device);
  offer.set_shm_segment(socket);
  offer.set_shm_token(token);
  offer.set_shm_host("transport-test-host");
  return raw(offer.SerializeAsString());
}

// Delivers "abcd" of op 5 from device 1 through `transport`'s gRPC path and receives it there;
// "ring" of op 5 step 1, written first into `ring` (device 1's, which `transport` must not have
// opened), is not read: its receive ends DEADLINE_EXCEEDED, and nothing came through shared
// memory.
void expect_grpc_message_arrives(Transport& transport, ShmRing& ring) {
  const std::string in_ring = "ring";
  ASSERT_TRUE(
      ring.write({5, 1, 0, 4}, reinterpret_cast<const std::byte*>(in_ring.data()), absl::Now() + absl::Seconds(10)));
  pb::ExchangeMessage data;
  data.set_source_device(1);
  data.set_op_id(5);
  data.set_data("abcd");
  grpc::ByteBuffer message = raw(data.SerializeAsString());
  int source = -1;
  ASSERT_TRUE(transport.deliver(&message, &source, -1).ok());
  absl::StatusOr<Received> got =
      transport.receive(1, "", {5, 0, 0}, absl::InfinitePast(), absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(got.ok()) << got.status();
  std::string bytes(static_cast<size_t>(got->size()), '\0');
  got->copy_to(reinterpret_cast<std::byte*>(bytes.data()));
  EXPECT_EQ(bytes, "abcd");
  absl::StatusOr<Received> unread =
      transport.receive(1, "", {5, 1, 0}, absl::InfinitePast(), absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(unread.status().code(), absl::StatusCode::kDeadlineExceeded)
      << (unread.ok() ? "the refused ring's message was read" : unread.status().ToString());
  EXPECT_EQ(transport.shm_messages_received(), 0);
}

// Issue #18 item 3: an offer whose token the sender's ring server does not know (a stale or
// forged offer) is refused at the socket: the receiver reads no ring and the source's messages
// keep arriving over gRPC; the sender's ring stays unattached and is still there for its own
// token, which a later offer presents.
TEST(TransportDeliver, AnOfferWithAnotherTokenIsRefusedAndTheSourceKeepsGrpc) {
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  Transport transport;
  transport.set_self(0);
  ASSERT_TRUE(transport.set_shm({true, ShmRing::kMinBytes, "transport-test-host", dir.path()}).ok());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start(dir.path());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 77);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  int source = -1;
  grpc::ByteBuffer message = ring_offer(1, (*server)->path(), 78);
  ASSERT_TRUE(transport.deliver(&message, &source, -1).ok());
  EXPECT_TRUE(eventually([&] { return (*server)->refused() > 0; })) << "the offer was never tried";
  EXPECT_EQ((*server)->refused(), 1);
  EXPECT_EQ((*server)->handed_over(), 0);
  EXPECT_FALSE((*ring)->attached());
  expect_grpc_message_arrives(transport, **ring);

  message = ring_offer(1, (*server)->path(), 77);
  ASSERT_TRUE(transport.deliver(&message, &source, -1).ok());
  EXPECT_TRUE(eventually([&] { return (*ring)->attached(); })) << "the ring was not fetched with its token";
  EXPECT_EQ((*server)->handed_over(), 1);
}

// The socket an offer names comes from the wire: one outside the receiver's ShmOptions::socket_dir
// is not connected to (before, any absolute path was), and the source keeps gRPC.
TEST(TransportDeliver, AnOfferNamingAnotherDirectoryIsRefusedAndTheSourceKeepsGrpc) {
  SocketDir dir, elsewhere;
  ASSERT_FALSE(dir.path().empty() || elsewhere.path().empty());
  absl::StatusOr<std::unique_ptr<ShmRingServer>> server = ShmRingServer::start(elsewhere.path());
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::unique_ptr<ShmRing>> ring = ShmRing::create(ShmRing::kMinBytes, 77);
  ASSERT_TRUE(ring.ok()) << ring.status();
  ASSERT_TRUE((*server)->offer(**ring).ok());
  {
    Transport transport;
    transport.set_self(0);
    ASSERT_TRUE(transport.set_shm({true, ShmRing::kMinBytes, "transport-test-host", dir.path()}).ok());
    int source = -1;
    grpc::ByteBuffer message = ring_offer(1, (*server)->path(), 77);
    ASSERT_TRUE(transport.deliver(&message, &source, -1).ok());
    expect_grpc_message_arrives(transport, **ring);
  }  // joins the ring's reader thread: its fetch is over
  EXPECT_EQ((*server)->handed_over(), 0);
  EXPECT_FALSE((*ring)->attached());
}

// A transport that goes stops its ring readers' fetches at once: a peer that takes the
// connection but never answers (SIGSTOPped; here a socket nobody accepts on) does not hold the
// destructor until the fetch's deadline (ShmRingServer::kHandoverTimeout, 5 s), as it did before.
TEST(TransportDeliver, ATransportGoesWithoutWaitingForARingServerThatDoesNotAnswer) {
  SocketDir dir;
  ASSERT_FALSE(dir.path().empty());
  auto transport = std::make_unique<Transport>();
  transport->set_self(0);
  ASSERT_TRUE(transport->set_shm({true, ShmRing::kMinBytes, "transport-test-host", dir.path()}).ok());
  // (After the transport's own server started: its probe for stale sockets would connect.)
  const std::string path = absl::StrCat(dir.path(), "/tessera-", getpid(), "-mute.sock");
  const int mute = listen_at(path);
  ASSERT_GE(mute, 0) << path;
  int source = -1;
  grpc::ByteBuffer message = ring_offer(1, path, 77);
  ASSERT_TRUE(transport->deliver(&message, &source, -1).ok());
  // The reader connected (its connection waits in the backlog: the socket is readable).
  pollfd connected{mute, POLLIN, 0};
  ASSERT_EQ(poll(&connected, 1, 30'000), 1) << "the ring's reader never connected";
  const absl::Time start = absl::Now();
  transport.reset();
  EXPECT_LT(absl::Now() - start, ShmRingServer::kHandoverTimeout / 2) << "the destructor waited for the fetch";
  close(mute);
}

// Sends one-byte messages of op `op` from `from` (device `f`) to `to` (device `t`) until one
// arrives through the shared-memory ring `from` offered (until then they take gRPC), bounded
// by kDeadline (not by a count: on a loaded machine 1000 round trips took less than the fetch).
void attach_ring(Endpoint& from, int f, Endpoint& to, int t, uint64_t op) {
  const std::string at = absl::StrCat("127.0.0.1:", to.port());
  const std::byte one[1] = {std::byte{9}};
  const int64_t before = to.transport().shm_messages_received();
  const absl::Time until = absl::Now() + kDeadline;
  for (int k = 0; to.transport().shm_messages_received() == before && absl::Now() < until; ++k) {
    const absl::Status sent = from.transport().send(t, at, {op, 0, k}, one, 1, absl::Now() + kDeadline);
    ASSERT_TRUE(sent.ok()) << sent;
    const absl::Status got =
        to.transport().receive(f, "from", {op, 0, k}, absl::InfinitePast(), absl::Now() + kDeadline).status();
    ASSERT_TRUE(got.ok()) << got;
  }
  ASSERT_GT(to.transport().shm_messages_received(), before) << "the ring from " << f << " to " << t << " never opened";
  from.transport().finish_op(op);
  to.transport().finish_op(op);
}

// 16 MiB of one op from device 0 to device 1, in chunks of 512 KiB, whose receiver starts
// taking them only once the sender has sent all it could: 4 times the receiver's share of 4 MiB.
// The receiver's mailbox pauses the sender's stream (or ring) at the share and the sender's last
// chunks wait in its link; when device 1 takes what is held, the stream reads on, and every chunk
// arrives, checked against what was sent. Before session 28, the mailbox refused the chunk over
// the share and the wait for it failed RESOURCE_EXHAUSTED "... would exceed their share of the
// mailbox" (so did bench_collectives' 64 MiB permute through RunCollective). Raw sends: since
// session 29 the collectives send in windows within the share (CyclicExchangeTest), and no
// longer pause a stream by themselves.
class TransportFlowControlTest : public ::testing::TestWithParam<bool> {};

TEST_P(TransportFlowControlTest, AReceiverThatStartsLateGetsMessagesPastItsShare) {
  const bool shm = GetParam();
  Endpoint a(0), b(1);
  MailboxOptions options;
  options.bytes_per_peer = int64_t{4} << 20;
  ASSERT_TRUE(b.transport().set_mailbox(options).ok());
  if (shm) {
    ShmOptions ring;
    ring.enabled = true;
    ASSERT_TRUE(a.transport().set_shm(ring).ok());
    ASSERT_TRUE(b.transport().set_shm(ring).ok());
    ASSERT_NO_FATAL_FAILURE(attach_ring(a, 0, b, 1, 76));  // until then messages take gRPC
  }
  constexpr int kChunks = 32;
  constexpr int64_t kChunk = 512 << 10;
  std::vector<std::byte> data(kChunks * kChunk);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 7 + i / 4093) & 0xff);
  const std::string at_b = absl::StrCat("127.0.0.1:", b.port());
  absl::Status sent;
  std::thread sender([&] {
    for (int c = 0; c < kChunks && sent.ok(); ++c) {
      sent = a.transport().send(1, at_b, {77, 0, c}, data.data() + c * kChunk, kChunk, absl::Now() + kDeadline);
    }
  });
  // Device 1 starts late: only once its mailbox holds all of device 0's share it can and a
  // message waits (the stream or ring paused).
  EXPECT_TRUE(eventually([&] { return b.transport().waiting_messages() > 0; })) << "the stream never paused";
  EXPECT_LE(b.transport().pending_bytes(), options.bytes_per_peer);
  int64_t wrong = 0;
  std::vector<std::byte> got(kChunk);
  for (int c = 0; c < kChunks; ++c) {
    absl::StatusOr<Received> chunk =
        b.transport().receive(0, "a", {77, 0, c}, absl::InfinitePast(), absl::Now() + kDeadline);
    if (!chunk.ok() || chunk->size() != kChunk) {  // (not ASSERT: the sender's thread is joined below)
      ADD_FAILURE() << "chunk " << c << ": "
                    << (chunk.ok() ? absl::StrCat(chunk->size(), " bytes") : chunk.status().ToString());
      break;
    }
    chunk->copy_to(got.data());
    wrong += std::memcmp(got.data(), data.data() + c * kChunk, kChunk) != 0;
  }
  sender.join();
  EXPECT_TRUE(sent.ok()) << sent;
  EXPECT_EQ(wrong, 0) << "chunks differ from what was sent";
  EXPECT_GT(b.transport().paused_messages(), 0);
  EXPECT_EQ(b.transport().dropped_messages(), 0);
  if (shm) {
    EXPECT_GT(b.transport().shm_messages_received(), kChunks / 2) << "the ring was not used";
  }
  a.transport().finish_op(77);
  b.transport().finish_op(77);
  EXPECT_EQ(b.transport().pending_messages(), 0);
  EXPECT_EQ(b.transport().waiting_messages(), 0);
}

INSTANTIATE_TEST_SUITE_P(Paths, TransportFlowControlTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "Shm" : "Grpc"; });

// An expectation (Transport::expect_at) whose message came before it, through the ring, is
// dropped by the receive that returns that message (not read in place), so a repeat of the
// message (a buggy or forged peer of the run) is not written to the place after the receive's
// copy: the place keeps what the receive copied there. Before, the expectation stayed until
// forget_expected and the ring's reader copied the repeat over the received data.
TEST(TransportExpectAtTest, AMessageThatCameBeforeItsExpectationDropsItAndARepeatIsNotWrittenThere) {
  Endpoint a(0), b(1);
  ShmOptions ring;
  ring.enabled = true;
  ASSERT_TRUE(a.transport().set_shm(ring).ok());
  ASSERT_TRUE(b.transport().set_shm(ring).ok());
  ASSERT_NO_FATAL_FAILURE(attach_ring(a, 0, b, 1, 76));
  const std::string at_b = absl::StrCat("127.0.0.1:", b.port());
  const MessageTag tag{80, 1, 0};
  const std::string first = "first message", repeat = "forged repeat";
  ASSERT_EQ(first.size(), repeat.size());
  const int64_t shm_before = b.transport().shm_messages_received();
  ASSERT_TRUE(
      a.transport()
          .send(1, at_b, tag, reinterpret_cast<const std::byte*>(first.data()), first.size(), absl::Now() + kDeadline)
          .ok());
  ASSERT_TRUE(eventually([&] { return b.transport().shm_messages_received() > shm_before; }));
  auto place = std::make_shared<std::string>(first.size(), '.');
  std::byte* dst = reinterpret_cast<std::byte*>(place->data());
  b.transport().expect_at(0, tag, dst, static_cast<int64_t>(place->size()), place);
  EXPECT_EQ(b.transport().expected_messages(), 1);
  absl::StatusOr<Received> got = b.transport().receive(0, "a", tag, absl::InfinitePast(), absl::Now() + kDeadline);
  ASSERT_TRUE(got.ok()) << got.status();
  got->copy_to(dst);
  EXPECT_EQ(*place, first);
  EXPECT_EQ(b.transport().expected_messages(), 0) << "the expectation outlived its message";
  const int64_t placed_before = b.transport().placed_messages();
  ASSERT_TRUE(
      a.transport()
          .send(1, at_b, tag, reinterpret_cast<const std::byte*>(repeat.data()), repeat.size(), absl::Now() + kDeadline)
          .ok());
  ASSERT_TRUE(eventually([&] { return b.transport().shm_messages_received() > shm_before + 1; }));
  EXPECT_EQ(*place, first) << "the repeat was written over the received message";
  EXPECT_EQ(b.transport().placed_messages(), placed_before);
  b.transport().forget_expected(tag.op);
  a.transport().finish_op(tag.op);
  b.transport().finish_op(tag.op);
  EXPECT_EQ(b.transport().pending_messages(), 0);
}

// Two endpoints, device 0's ring to device 1 attached by attach(). Device 1's reader of it is
// held between its take of an expected place and its copy there (ShmOptions::
// before_placed_copy) for the first message of `op` it reads in place: `taken` says it is
// there, `released` lets it copy.
struct HeldRing {
  explicit HeldRing(uint64_t op) : op(op) {}
  void attach() {
    ShmOptions ring;
    ring.enabled = true;
    ASSERT_TRUE(a.transport().set_shm(ring).ok());
    ring.before_placed_copy = [this](const MessageTag& tag) {
      if (tag.op != this->op || held.exchange(true)) return;
      taken.Notify();
      released.WaitForNotificationWithTimeout(kDeadline);  // bounded: a failed test goes on
    };
    ASSERT_TRUE(b.transport().set_shm(ring).ok());
    ASSERT_NO_FATAL_FAILURE(attach_ring(a, 0, b, 1, 76));
  }
  absl::Status send(MessageTag tag, const std::string& data) {
    return a.transport().send(1, absl::StrCat("127.0.0.1:", b.port()), tag,
                              reinterpret_cast<const std::byte*>(data.data()), static_cast<int64_t>(data.size()),
                              absl::Now() + kDeadline);
  }
  // A place of `bytes` dots where b expects `tag`'s message from device 0.
  std::shared_ptr<std::string> expect_place(const MessageTag& tag, size_t bytes) {
    auto place = std::make_shared<std::string>(bytes, '.');
    b.transport().expect_at(0, tag, reinterpret_cast<std::byte*>(place->data()), static_cast<int64_t>(bytes), place);
    return place;
  }
  // Runs `call` on a thread while the reader is held after its take of a place: it must not
  // return within 200 ms (`returned_early` otherwise); then releases the reader and joins.
  void expect_waits_for_the_copy(const std::function<void()>& call, const char* returned_early) {
    absl::Notification returned;
    std::thread caller([&] {
      call();
      returned.Notify();
    });
    EXPECT_FALSE(returned.WaitForNotificationWithTimeout(absl::Milliseconds(200))) << returned_early;
    released.Notify();
    caller.join();
  }
  const uint64_t op;
  std::atomic<bool> held{false};
  absl::Notification taken, released;  // before the endpoints: their readers use them until joined
  Endpoint a{0}, b{1};
};

// Issue #18 (design.md, "reads chunks in place"): forget_expected waits for the copies to the
// op's places under way, so that nothing writes there once it returns (the collective then
// hands its result out). The reader is held after its take of the place: forget_expected does
// not return until the copy is done, and then the place holds the message, which the mailbox
// files as read in place.
TEST(TransportExpectAtTest, ForgetExpectedWaitsForACopyUnderWayToThePlace) {
  constexpr uint64_t kOp = 90;
  HeldRing ring(kOp);
  ASSERT_NO_FATAL_FAILURE(ring.attach());
  Transport& b = ring.b.transport();
  const MessageTag tag{kOp, 0, 0};
  const std::string message = "read in place";
  const std::shared_ptr<std::string> place = ring.expect_place(tag, message.size());
  std::byte* dst = reinterpret_cast<std::byte*>(place->data());
  const int64_t placed_before = b.placed_messages();
  ASSERT_TRUE(ring.send(tag, message).ok());
  ASSERT_TRUE(ring.taken.WaitForNotificationWithTimeout(kDeadline)) << "the reader never took the place";
  std::string at_return;
  // A copy under way is waited for; nothing else stops forget_expected.
  ring.expect_waits_for_the_copy(
      [&] {
        b.forget_expected(kOp);
        at_return = *place;
      },
      "forget_expected returned while the reader's copy to the place was under way");
  EXPECT_EQ(at_return, message) << "the copy to the place was not done when forget_expected returned";
  absl::StatusOr<Received> got = b.receive(0, "a", tag, absl::InfinitePast(), absl::Now() + kDeadline);
  ASSERT_TRUE(got.ok()) << got.status();
  got->copy_to(dst);  // at its own place: copies nothing
  EXPECT_EQ(*place, message);
  EXPECT_EQ(b.placed_messages(), placed_before + 1);
  EXPECT_EQ(b.expected_messages(), 0);
  ring.a.transport().finish_op(kOp);
  b.finish_op(kOp);
}

// The same for the receive of a message that came another way (before its expectation): the
// receive drops the expectation (Transport::unexpect) and waits for a copy there under way, a
// repeat's, so that its caller's copy of the message it got is the last write to the place.
// The reader is held after its take of the repeat's place: the receive does not return until
// that copy is done, and the place ends up holding the message received, not the repeat.
TEST(TransportExpectAtTest, AReceiveThatDropsItsExpectationWaitsForARepeatsCopyUnderWay) {
  constexpr uint64_t kOp = 91;
  HeldRing ring(kOp);
  ASSERT_NO_FATAL_FAILURE(ring.attach());
  Transport& b = ring.b.transport();
  const MessageTag tag{kOp, 1, 0};
  const std::string first = "first message", repeat = "forged repeat";
  ASSERT_EQ(first.size(), repeat.size());
  const int64_t shm_before = b.shm_messages_received();
  ASSERT_TRUE(ring.send(tag, first).ok());
  ASSERT_TRUE(eventually([&] { return b.shm_messages_received() > shm_before; }));  // filed, not in place
  const std::shared_ptr<std::string> place = ring.expect_place(tag, first.size());
  std::byte* dst = reinterpret_cast<std::byte*>(place->data());
  ASSERT_TRUE(ring.send(tag, repeat).ok());
  ASSERT_TRUE(ring.taken.WaitForNotificationWithTimeout(kDeadline)) << "the reader never took the place";
  absl::Status received;
  ring.expect_waits_for_the_copy(
      [&] {
        absl::StatusOr<Received> got = b.receive(0, "a", tag, absl::InfinitePast(), absl::Now() + kDeadline);
        received = got.status();
        if (got.ok()) got->copy_to(dst);
      },
      "the receive returned while a repeat's copy to the place was under way");
  ASSERT_TRUE(received.ok()) << received;
  // The repeat is filed too (it came): wait for that, the reader's last step, before looking.
  ASSERT_TRUE(eventually([&] { return b.shm_messages_received() > shm_before + 1; }));
  EXPECT_EQ(*place, first) << "the repeat was written over the received message";
  EXPECT_EQ(b.expected_messages(), 0);
  ring.a.transport().finish_op(kOp);
  b.finish_op(kOp);
}

// Collectives whose members all send before they receive, on a cycle (issue #17 item 5): a
// collective_permute shifting by one over 4 devices, and an all_to_all over 4, each sending
// 32 MiB to each peer: more than the receiver's share (lowered here), the sender's link queue
// (16 MiB) and gRPC's window together. Every member sends in windows interleaved with its
// receives (engine.cc, exchange_in_windows), sized from the share, so none of its sends waits
// for a receiver that is itself sending, and no stream or ring pauses at the share. Before,
// every member's sends waited for room and the ops failed DEADLINE_EXCEEDED (gRPC, shared
// memory), or at once RESOURCE_EXHAUSTED over the share (in process). Results are checked
// against the host's: permute out[target] = in[source]; all_to_all (split and concat on
// dimension 0) block j of device d's result = block d of device j's input.
enum class Via { kGrpc, kShm, kInProcess };

class CyclicExchangeTest : public ::testing::TestWithParam<Via> {
 protected:
  static constexpr int kDevices = 4;
  static constexpr int64_t kPerPeer = int64_t{32} << 20;

  // kDevices endpoints whose mailboxes give each source `share` bytes, on the test's path.
  void start(int64_t share) {
    for (int d = 0; d < kDevices; ++d) {
      endpoints_.push_back(std::make_unique<Endpoint>(d));
      MailboxOptions options;
      options.bytes_per_peer = share;
      ASSERT_TRUE(endpoints_[d]->transport().set_mailbox(options).ok());
      peers_[d] = absl::StrCat("127.0.0.1:", endpoints_[d]->port());
      if (GetParam() == Via::kShm) {
        ShmOptions ring;
        ring.enabled = true;
        ASSERT_TRUE(endpoints_[d]->transport().set_shm(ring).ok());
      } else if (GetParam() == Via::kInProcess) {
        peers_[d] = absl::StrCat("in-process:", 60100 + d);
        ASSERT_TRUE(endpoints_[d]->transport().serve_in_process(peers_[d]).ok());
      }
    }
    if (GetParam() != Via::kShm) return;
    for (int f = 0; f < kDevices; ++f) {
      for (int t = 0; t < kDevices; ++t) {
        if (f != t) {
          ASSERT_NO_FATAL_FAILURE(attach_ring(*endpoints_[f], f, *endpoints_[t], t, 10 + f * kDevices + t));
        }
      }
    }
  }

  // Device d's input: `elements` float32 values, distinct across devices.
  static std::shared_ptr<const HostArray> input(int d, int64_t elements) {
    HostArray x(DType::kF32, {elements});
    absl::Span<float> v = x.mutable_values<float>();
    for (int64_t i = 0; i < elements; ++i) v[i] = static_cast<float>(i % 1000003 + d * 7);
    return std::make_shared<const HostArray>(std::move(x));
  }

  // Runs `spec` as op `op` on devices [0, `devices`) at once, each on a thread of its own.
  std::vector<absl::StatusOr<std::shared_ptr<const HostArray>>> run_all(
      const CollectiveSpec& spec, const std::vector<std::shared_ptr<const HostArray>>& in, uint64_t op = 91,
      int devices_running = kDevices) {
    std::vector<absl::StatusOr<std::shared_ptr<const HostArray>>> out(kDevices, absl::UnknownError("not run"));
    std::vector<std::thread> devices;
    for (int d = 0; d < devices_running; ++d) {
      shm_before_[d] = endpoints_[d]->transport().shm_messages_received();
      devices.emplace_back([&, d] {
        CollectiveRun run;
        run.op = op;
        run.spec = spec;
        run.peers = peers_;
        run.self = d;
        run.start = absl::Now();
        run.deadline = run.start + kDeadline;
        out[d] = run_collective(endpoints_[d]->transport(), run, in[d]);
      });
    }
    for (std::thread& t : devices) t.join();
    return out;
  }

  // After the op: nothing paused at the share, dropped, or left in a mailbox; the path was used.
  void expect_clean_finish() {
    for (int d = 0; d < kDevices; ++d) {
      Transport& t = endpoints_[d]->transport();
      EXPECT_EQ(t.paused_messages(), 0) << "device " << d << ": a sender passed the share";
      EXPECT_EQ(t.dropped_messages(), 0) << "device " << d;
      if (GetParam() == Via::kShm) {  // at least one peer's data came through the ring
        EXPECT_GE(t.shm_messages_received() - shm_before_[d], kPerPeer / kChunkBytes) << "device " << d;
      }
      if (GetParam() == Via::kInProcess) {
        EXPECT_GE(t.in_process_messages_received(), kPerPeer / kChunkBytes) << "device " << d;
      }
      t.finish_op(91);
      EXPECT_EQ(t.pending_messages(), 0) << "device " << d;
    }
  }

  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  std::map<int, std::string> peers_;
  int64_t shm_before_[kDevices] = {};
};

// A window of 15 chunks acknowledged every 3 (a share of 8 MiB), the default's shape (31 and 7).
TEST_P(CyclicExchangeTest, AShiftedPermuteLargerThanShareAndLinkQueueCompletes) {
  ASSERT_NO_FATAL_FAILURE(start(int64_t{8} << 20));
  constexpr int64_t kElements = kPerPeer / 4;
  std::vector<std::shared_ptr<const HostArray>> in;
  for (int d = 0; d < kDevices; ++d) in.push_back(input(d, kElements));
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kCollectivePermute;
  spec.groups = {{0, 1, 2, 3}};
  for (int d = 0; d < kDevices; ++d) spec.pairs.push_back({d, (d + 1) % kDevices});
  auto out = run_all(spec, in);
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_TRUE(out[d].ok()) << "device " << d << ": " << out[d].status();
    ASSERT_EQ((*out[d])->shape(), Shape{kElements});
    const float* got = (*out[d])->values<float>().data();
    const float* want = in[(d + kDevices - 1) % kDevices]->values<float>().data();
    int64_t wrong = 0;
    for (int64_t i = 0; i < kElements; ++i) wrong += got[i] != want[i];
    EXPECT_EQ(wrong, 0) << "device " << d;
  }
  expect_clean_finish();
}

// A window of one chunk, acknowledged each (a share of 1 MiB).
TEST_P(CyclicExchangeTest, AnAllToAllLargerThanShareAndLinkQueuePerPeerCompletes) {
  ASSERT_NO_FATAL_FAILURE(start(int64_t{1} << 20));
  constexpr int64_t kBlock = kPerPeer / 4;  // elements each device sends each peer
  std::vector<std::shared_ptr<const HostArray>> in;
  for (int d = 0; d < kDevices; ++d) in.push_back(input(d, kBlock * kDevices));
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllToAll;
  spec.groups = {{0, 1, 2, 3}};
  spec.split_dimension = 0;
  spec.concat_dimension = 0;
  auto out = run_all(spec, in);
  for (int d = 0; d < kDevices; ++d) {
    ASSERT_TRUE(out[d].ok()) << "device " << d << ": " << out[d].status();
    ASSERT_EQ((*out[d])->shape(), Shape{kBlock * kDevices});
    const float* got = (*out[d])->values<float>().data();
    int64_t wrong = 0;
    for (int j = 0; j < kDevices; ++j) {
      const float* want = in[j]->values<float>().data() + d * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) wrong += got[j * kBlock + i] != want[i];
    }
    EXPECT_EQ(wrong, 0) << "device " << d;
  }
  expect_clean_finish();
}

INSTANTIATE_TEST_SUITE_P(Paths, CyclicExchangeTest, ::testing::Values(Via::kGrpc, Via::kShm, Via::kInProcess),
                         [](const ::testing::TestParamInfo<Via>& p) {
                           return p.param == Via::kShm ? "Shm" : p.param == Via::kInProcess ? "InProcess" : "Grpc";
                         });

// The rings' chunk size per path (engine.h, ring_chunk_bytes): on gRPC the wire's limit of 1 MiB
// (proto/rpc.h, kMaxChunkBytes; half as many messages as 512 KiB ones measured faster there,
// docs/design.md "Collectives"), 512 KiB on shared memory and in process. Counted as the
// messages each device receives in a ring all_gather, all_reduce and reduce_scatter over 4
// devices whose segments are 2.5 MiB and 12 bytes (3 chunks of 1 MiB, or 6 of 512 KiB, the last
// ragged), with results against the host's.
class RingChunkTest : public CyclicExchangeTest {};

TEST_P(RingChunkTest, RingsOnGrpcSendChunksOfOneMiBOthersOf512KiB) {
  ASSERT_NO_FATAL_FAILURE(start(int64_t{64} << 20));
  const int64_t chunk = GetParam() == Via::kGrpc ? int64_t{1} << 20 : int64_t{512} << 10;
  constexpr int64_t kSegment = 655363;  // float32s: 2621452 bytes
  const int64_t chunks = (kSegment * 4 + chunk - 1) / chunk;
  ASSERT_EQ(chunks, GetParam() == Via::kGrpc ? 3 : 6);
  auto received = [this](int d) {
    const Transport& t = endpoints_[d]->transport();
    return t.grpc_messages_received() + t.shm_messages_received() + t.in_process_messages_received();
  };
  uint64_t op = 500;
  struct Case {
    CollectiveKind kind;
    int64_t elements;  // each device's input
    int64_t messages;  // each device receives: segments x chunks
  };
  const std::vector<Case> cases = {{CollectiveKind::kAllGather, kSegment, 3 * chunks},
                                   {CollectiveKind::kAllReduce, 4 * kSegment, 6 * chunks},
                                   {CollectiveKind::kReduceScatter, 4 * kSegment, 3 * chunks}};
  for (const Case& c : cases) {
    SCOPED_TRACE(collective_name(c.kind));
    std::vector<std::shared_ptr<const HostArray>> in;
    for (int d = 0; d < kDevices; ++d) in.push_back(input(d, c.elements));
    CollectiveSpec spec;
    spec.kind = c.kind;
    spec.groups = {{0, 1, 2, 3}};
    spec.dimension = 0;
    std::vector<int64_t> before(kDevices);
    for (int d = 0; d < kDevices; ++d) before[d] = received(d);
    auto out = run_all(spec, in, ++op);
    for (int d = 0; d < kDevices; ++d) {
      ASSERT_TRUE(out[d].ok()) << "device " << d << ": " << out[d].status();
      EXPECT_EQ(received(d) - before[d], c.messages) << "device " << d;
      endpoints_[d]->transport().finish_op(op);
      const float* got = (*out[d])->values<float>().data();
      int64_t wrong = 0;
      if (c.kind == CollectiveKind::kAllGather) {  // block j is device j's input
        ASSERT_EQ((*out[d])->size(), kDevices * kSegment);
        for (int j = 0; j < kDevices; ++j) {
          for (int64_t i = 0; i < kSegment; ++i) wrong += got[j * kSegment + i] != in[j]->values<float>()[i];
        }
      } else {  // the sum of the inputs; reduce_scatter: block d of it
        const int64_t first = c.kind == CollectiveKind::kAllReduce ? 0 : d * kSegment;
        ASSERT_EQ((*out[d])->size(), c.kind == CollectiveKind::kAllReduce ? c.elements : kSegment);
        for (int64_t i = 0; i < (*out[d])->size(); ++i) {
          float want = 0;
          for (int j = 0; j < kDevices; ++j) want += in[j]->values<float>()[first + i];
          wrong += got[i] != want;
        }
      }
      EXPECT_EQ(wrong, 0) << "device " << d;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, RingChunkTest, ::testing::Values(Via::kGrpc, Via::kShm, Via::kInProcess),
                         [](const ::testing::TestParamInfo<Via>& p) {
                           return p.param == Via::kShm ? "Shm" : p.param == Via::kInProcess ? "InProcess" : "Grpc";
                         });

// The ring all_gather (and the all-gather half of a ring all_reduce) over a group of 4, two of 2
// and one of 3 (device 3 not running), results against the host's: all_gather = the group's inputs
// concatenated along the dimension, all_reduce = their element-wise sum. Sizes of several
// chunks with a ragged last one (all_reduce's segments too), 1-, 4- and 8-byte dtypes, a
// gather along dimension 1 (whose blocks the result interleaves). On shared memory the chunks
// are read from the ring straight into the result (Transport::expect_at): in each op some
// devices of each group count some placed so (see run), and no other path does; no op leaves
// an expectation behind.
class RingAllGatherTest : public CyclicExchangeTest {};

TEST_P(RingAllGatherTest, ResultsMatchTheHostsAndShmReadsChunksInPlace) {
  ASSERT_NO_FATAL_FAILURE(start(int64_t{64} << 20));
  // Device d's value at flat index i: small integers, exact in every dtype here.
  auto value = [](int d, int64_t i) { return static_cast<double>((i * 7 + d * 13) % 101 - 50); };
  auto make = [&](int d, DType dtype, const Shape& shape) {
    HostArray x(dtype, shape);
    for (int64_t i = 0; i < x.size(); ++i) {
      if (dtype == DType::kI8) x.mutable_values<int8_t>()[i] = static_cast<int8_t>(value(d, i));
      if (dtype == DType::kF32) x.mutable_values<float>()[i] = static_cast<float>(value(d, i));
      if (dtype == DType::kF64) x.mutable_values<double>()[i] = value(d, i);
    }
    return std::make_shared<const HostArray>(std::move(x));
  };
  auto at = [](const HostArray& x, int64_t i) {
    if (x.dtype() == DType::kI8) return static_cast<double>(x.values<int8_t>()[i]);
    if (x.dtype() == DType::kF32) return static_cast<double>(x.values<float>()[i]);
    return x.values<double>()[i];
  };
  uint64_t op = 300;
  struct Layout {
    std::vector<std::vector<int>> groups;
    int devices;  // running: [0, devices)
  };
  // Runs `spec` on the layout's devices as the next op; after it, the chunks placed (see
  // above) and the expectations left, and the op is finished. A chunk that came before its
  // receiver made its expectations goes the usual way, so how many are placed depends on timing,
  // but not whether: all_reduce (`every`): each device places its all-gather's chunks, which
  // need its own contribution to the reduce-scatter, sent after it made them; all_gather: a
  // device's first chunk is sent by its previous one after that one made its own expectations,
  // so not every device of a group can have got all its chunks before making its own.
  auto run = [&](const Layout& layout, CollectiveSpec spec, const std::vector<std::shared_ptr<const HostArray>>& in,
                 bool every) {
    spec.groups = layout.groups;
    std::vector<int64_t> placed(kDevices);
    for (int d = 0; d < kDevices; ++d) placed[d] = -endpoints_[d]->transport().placed_messages();
    auto out = run_all(spec, in, ++op, layout.devices);
    for (int d = 0; d < layout.devices; ++d) {
      Transport& t = endpoints_[d]->transport();
      placed[d] += t.placed_messages();
      EXPECT_EQ(t.expected_messages(), 0) << "device " << d << ": expectations left behind";
      t.finish_op(op);
    }
    for (const std::vector<int>& g : layout.groups) {
      int placing = 0;
      for (int d : g) {
        placing += placed[d] > 0;
        if (GetParam() != Via::kShm) {
          EXPECT_EQ(placed[d], 0) << "device " << d;
        } else if (every) {
          EXPECT_GT(placed[d], 0) << "device " << d << ": no chunk read in place";
        }
      }
      if (GetParam() == Via::kShm) {
        EXPECT_GT(placing, 0) << "no device of the group of device " << g[0] << " read a chunk in place";
      }
    }
    return out;
  };
  struct Gather {
    DType dtype;
    Shape shape;  // each device's input
    int dimension;
  };
  // 600003, 560008 and 666660 bytes a device: 2, 2 and 2 chunks of 512 KiB, the last ragged.
  const std::vector<Gather> gathers = {
      {DType::kI8, {3, 200001}, 1}, {DType::kF64, {1, 70001}, 0}, {DType::kF32, {5, 33333}, 1}};
  const std::vector<Layout> layouts = {{{{0, 1, 2, 3}}, 4}, {{{0, 1}, {2, 3}}, 4}, {{{0, 1, 2}}, 3}};
  for (const Layout& layout : layouts) {
    // The members of device d's group, in order (block j of a result is member j's input).
    auto group_of = [&layout](int d) {
      for (const std::vector<int>& g : layout.groups) {
        if (std::find(g.begin(), g.end(), d) != g.end()) return g;
      }
      return std::vector<int>{};
    };
    SCOPED_TRACE(absl::StrCat("groups of ", layout.groups[0].size()));
    for (const Gather& c : gathers) {
      SCOPED_TRACE(absl::StrCat(dtype_name(c.dtype), " dimension ", c.dimension));
      std::vector<std::shared_ptr<const HostArray>> in;
      for (int d = 0; d < kDevices; ++d) in.push_back(make(d, c.dtype, c.shape));
      CollectiveSpec spec;
      spec.kind = CollectiveKind::kAllGather;
      spec.dimension = c.dimension;
      auto out = run(layout, spec, in, /*every=*/false);
      for (int d = 0; d < layout.devices; ++d) {
        const std::vector<int> g = group_of(d);
        const int64_t n = static_cast<int64_t>(g.size()), rows = c.shape[0], cols = c.shape[1];
        const Shape want_shape = c.dimension == 0 ? Shape{rows * n, cols} : Shape{rows, cols * n};
        ASSERT_TRUE(out[d].ok()) << "device " << d << ": " << out[d].status();
        ASSERT_EQ((*out[d])->shape(), want_shape);
        int64_t wrong = 0;
        for (int64_t j = 0; j < n; ++j) {  // block j is member j's input
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t k = 0; k < cols; ++k) {
              const int64_t i = c.dimension == 0 ? (j * rows + r) * cols + k : r * cols * n + j * cols + k;
              wrong += at(**out[d], i) != value(g[j], r * cols + k);
            }
          }
        }
        EXPECT_EQ(wrong, 0) << "device " << d;
      }
    }
    {  // 1000003 float32s: in a group of 4, segments of about 1 MB, 2 chunks each, the last ragged.
      SCOPED_TRACE("all_reduce");
      const Shape shape = {1, 1000003};
      std::vector<std::shared_ptr<const HostArray>> in;
      for (int d = 0; d < kDevices; ++d) in.push_back(make(d, DType::kF32, shape));
      CollectiveSpec spec;
      spec.kind = CollectiveKind::kAllReduce;
      auto out = run(layout, spec, in, /*every=*/true);
      for (int d = 0; d < layout.devices; ++d) {
        ASSERT_TRUE(out[d].ok()) << "device " << d << ": " << out[d].status();
        int64_t wrong = 0;
        for (int64_t i = 0; i < shape[1]; ++i) {
          double want = 0;
          for (int j : group_of(d)) want += value(j, i);
          wrong += at(**out[d], i) != want;
        }
        EXPECT_EQ(wrong, 0) << "device " << d;
      }
    }
  }
  for (int d = 0; d < kDevices; ++d) {
    Transport& t = endpoints_[d]->transport();
    EXPECT_EQ(t.pending_messages(), 0) << "device " << d;
    EXPECT_EQ(t.dropped_messages(), 0) << "device " << d;
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, RingAllGatherTest, ::testing::Values(Via::kGrpc, Via::kShm, Via::kInProcess),
                         [](const ::testing::TestParamInfo<Via>& p) {
                           return p.param == Via::kShm ? "Shm" : p.param == Via::kInProcess ? "InProcess" : "Grpc";
                         });

pb::ExchangeMessage tagged_message(int source, uint64_t op, int chunk, uint64_t run_tag, std::string data) {
  pb::ExchangeMessage m = data_message(source, op, chunk, std::move(data));
  m.set_run_tag(run_tag);
  return m;
}

std::string text_of(const absl::StatusOr<Received>& got) {
  if (!got.ok()) return got.status().ToString();
  std::string out(static_cast<size_t>(got->size()), '\0');
  got->copy_to(reinterpret_cast<std::byte*>(out.data()));
  return out;
}

// Issue #17 item 1, "op ids are not guessable": op ids are the coordinator's counter, so a
// holder of the cluster token could aim messages at a victim's next ops (5 of 5 all-reduces
// silently wrong). Every message of a run carries the run's random tag (MessageTag::run_tag);
// once a run (begin_run_ops) or a receive has claimed an op, a message of it with another tag
// (or none) is dropped and counted, never filed, on every path; one held early, before the run
// claimed its op, is kept with its tag (never replacing the right one) and judged at the claim.
class TransportRunTagTest : public ::testing::TestWithParam<Via> {};

TEST_P(TransportRunTagTest, AMessageWithoutItsRunsTagIsDroppedAndCountedOnEveryPath) {
  Endpoint a(0), b(1);
  std::string at_b = absl::StrCat("127.0.0.1:", b.port());
  if (GetParam() == Via::kShm) {
    ShmOptions ring;
    ring.enabled = true;
    ASSERT_TRUE(a.transport().set_shm(ring).ok());
    ASSERT_TRUE(b.transport().set_shm(ring).ok());
    ASSERT_NO_FATAL_FAILURE(attach_ring(a, 0, b, 1, 5));  // until then messages take gRPC
  } else if (GetParam() == Via::kInProcess) {
    at_b = "in-process:60201";
    ASSERT_TRUE(a.transport().serve_in_process("in-process:60200").ok());
    ASSERT_TRUE(b.transport().serve_in_process(at_b).ok());
  }
  Transport& to = b.transport();
  const uint64_t kTag = 0x5eed5eed5eed5eedULL;
  auto send = [&](MessageTag tag, const std::string& text) {
    const absl::Status sent = a.transport().send(1, at_b, tag, reinterpret_cast<const std::byte*>(text.data()),
                                                 static_cast<int64_t>(text.size()), absl::Now() + kDeadline);
    ASSERT_TRUE(sent.ok()) << sent;
  };
  const int64_t shm_before = to.shm_messages_received();
  // Ops 100..109 are a run's here, with kTag: untagged and wrongly tagged messages go at once.
  to.begin_run_ops(100, 110, kTag);
  ASSERT_NO_FATAL_FAILURE(send({100, 0, 0, 0}, "none"));
  ASSERT_NO_FATAL_FAILURE(send({100, 0, 0, kTag + 1}, "evil"));
  ASSERT_NO_FATAL_FAILURE(send({100, 0, 0, kTag}, "good"));
  EXPECT_EQ(text_of(to.receive(0, "a", {100, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline)), "good");
  // The three went one link (and, on shm, one ring) in order: the two before were judged.
  ASSERT_TRUE(eventually([&] { return to.forged_messages() == 2; })) << to.forged_messages();
  EXPECT_EQ(to.pending_messages(), 0);
  // Op 300, not claimed here yet (the run's plan has not arrived): its messages are held with
  // their tags, the right one not replaced by a forged one under the same op, step and chunk,
  // and those of other tags go when the run claims the op.
  ASSERT_NO_FATAL_FAILURE(send({300, 1, 0, kTag}, "early"));
  ASSERT_NO_FATAL_FAILURE(send({300, 1, 0, 0}, "none"));
  ASSERT_NO_FATAL_FAILURE(send({300, 1, 0, 7}, "evil"));
  ASSERT_TRUE(eventually([&] { return to.pending_messages() == 3; })) << to.pending_messages();
  EXPECT_EQ(to.forged_messages(), 2);
  to.begin_run_ops(300, 301, kTag);
  EXPECT_EQ(to.forged_messages(), 4);
  EXPECT_EQ(to.pending_messages(), 1);
  EXPECT_EQ(text_of(to.receive(0, "a", {300, 1, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline)), "early");
  // An op no run holds (a RunCollective's): its first receive claims it with its tag.
  ASSERT_NO_FATAL_FAILURE(send({400, 0, 0, 9}, "evil"));
  ASSERT_NO_FATAL_FAILURE(send({400, 0, 0, kTag}, "right"));
  ASSERT_TRUE(eventually([&] { return to.pending_messages() == 2; })) << to.pending_messages();
  EXPECT_EQ(text_of(to.receive(0, "a", {400, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline)), "right");
  EXPECT_EQ(to.forged_messages(), 5);
  ASSERT_NO_FATAL_FAILURE(send({400, 0, 1, 0}, "none"));
  ASSERT_TRUE(eventually([&] { return to.forged_messages() == 6; })) << to.forged_messages();
  EXPECT_EQ(to.pending_messages(), 0);
  to.end_run_ops(100, 110, kTag);
  to.end_run_ops(300, 301, kTag);
  for (uint64_t op : {100, 300, 400}) to.finish_op(op);
  // Each message took the test's path.
  if (GetParam() == Via::kShm) {
    EXPECT_EQ(to.shm_messages_received() - shm_before, 9);
  } else if (GetParam() == Via::kInProcess) {
    EXPECT_EQ(to.in_process_messages_received(), 9);
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, TransportRunTagTest, ::testing::Values(Via::kGrpc, Via::kShm, Via::kInProcess),
                         [](const ::testing::TestParamInfo<Via>& p) {
                           return p.param == Via::kShm ? "Shm" : p.param == Via::kInProcess ? "InProcess" : "Grpc";
                         });

// Issue #17 (review of the run tags): a refusal is the refused message's alone, by its run tag.
// A forged early message of an op (its id guessed) that the mailbox refuses (it outlived the
// time-to-live, or its source's early messages were at their number) must not fail the op for
// the run that claims it later: the refusal goes when the run claims the op with another tag,
// and the run's real message is filed and received. The forged message counts once, as dropped
// when refused: its refusal going at the claim is not a second message (before, it was counted
// as forged too).
// `refuse(transport, forged)` has the mailbox refuse the forged message; the run then claims
// op 300 with its tag and its real message comes.
void expect_the_runs_message_despite_a_forged_refusal(
    const MailboxOptions& options, const std::function<void(Transport&, const pb::ExchangeMessage&)>& refuse) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  for (uint64_t forged_tag : {uint64_t{0}, uint64_t{7}}) {
    SCOPED_TRACE(absl::StrCat("forged tag ", forged_tag));
    Transport transport;
    transport.set_self(0);
    ASSERT_TRUE(transport.set_mailbox(options).ok());
    ASSERT_NO_FATAL_FAILURE(refuse(transport, tagged_message(1, 300, 0, forged_tag, "evil")));
    ASSERT_EQ(transport.dropped_messages(), 1) << "the forged message was refused";
    transport.begin_run_ops(300, 301, kTag);
    EXPECT_EQ(transport.forged_messages(), 0) << "its refusal went at the claim, counted again";
    EXPECT_EQ(transport.dropped_messages(), 1);
    ASSERT_TRUE(deliver(transport, tagged_message(1, 300, 0, kTag, "real")).ok());
    EXPECT_EQ(
        text_of(transport.receive(1, "h:1", {300, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + absl::Seconds(10))),
        "real");
    transport.end_run_ops(300, 301, kTag);
    transport.finish_ops(299, 301);
  }
}

TEST(TransportRunTagRefusal, AForgedMessageRefusedForTheTtlDoesNotFailTheRunsOp) {
  MailboxOptions options;
  options.unclaimed_ttl = absl::Milliseconds(40);
  expect_the_runs_message_despite_a_forged_refusal(options, [&](Transport& t, const pb::ExchangeMessage& forged) {
    ASSERT_TRUE(deliver(t, forged).ok());
    absl::SleepFor(absl::Milliseconds(60));  // the rule under test is an age: let it age past it
    t.sweep();
  });
}

TEST(TransportRunTagRefusal, AForgedMessageRefusedForTheCountDoesNotFailTheRunsOp) {
  MailboxOptions options;
  options.messages_per_peer = 1;
  expect_the_runs_message_despite_a_forged_refusal(options, [](Transport& t, const pb::ExchangeMessage& forged) {
    // Device 1's one early message (of op 299, the run's too), then the forged one: over the count.
    ASSERT_TRUE(deliver(t, tagged_message(1, 299, 0, 0x5eed5eed5eed5eedULL, "held")).ok());
    ASSERT_TRUE(deliver(t, forged).ok());
  });
}

// A mailbox of one early message per source (messages_per_peer = 1): device 1's one early
// message (op 299), then the run's real message of op 300, refused over the count.
void refuse_op_300_of_device_1(Transport& transport, uint64_t tag) {
  MailboxOptions options;
  options.messages_per_peer = 1;
  transport.set_self(0);
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  ASSERT_TRUE(deliver(transport, tagged_message(1, 299, 0, tag, "held")).ok());
  ASSERT_TRUE(deliver(transport, tagged_message(1, 300, 0, tag, "real")).ok());
  ASSERT_EQ(transport.dropped_messages(), 1);
}

// Issue #17 (last read of session 32): with the run tag in the refusal's key, one sender could
// make a refusal per made-up tag for a single op, up to the 4,096 remembered, and the oldest op's
// went first: the op a run waits on, whose wait then ended at its deadline instead of failing at
// once, saying why. At most Transport::kRefusedTagsPerSource tags are remembered per (op, source).
TEST(TransportRunTagRefusal, MadeUpTagsForOneOpDoNotPushOutTheRunsRefusal) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Transport transport;
  ASSERT_NO_FATAL_FAILURE(refuse_op_300_of_device_1(transport, kTag));
  // A forger declaring device 1: messages of op 301 under 4,096 made-up tags, each over the count.
  for (uint64_t t = 1; t <= 4096; ++t) {
    ASSERT_TRUE(deliver(transport, tagged_message(1, 301, 0, kTag ^ t, "evil")).ok());
  }
  EXPECT_EQ(transport.dropped_messages(), 4097) << "each refused message is counted";
  transport.begin_run_ops(300, 301, kTag);
  absl::StatusOr<Received> got =
      transport.receive(1, "h:1", {300, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("a message of op 300 from device 1"), HasSubstr("--mailbox_messages_per_peer")));
  transport.end_run_ops(300, 301, kTag);
  // A run's own refusal is kept when it came first, however many made-up tags follow.
  ASSERT_TRUE(deliver(transport, tagged_message(1, 302, 0, kTag, "real")).ok());
  for (uint64_t t = 1; t <= 100; ++t) {
    ASSERT_TRUE(deliver(transport, tagged_message(1, 302, 0, kTag ^ t, "evil")).ok());
  }
  transport.begin_run_ops(302, 303, kTag);
  got = transport.receive(1, "h:1", {302, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  transport.end_run_ops(302, 303, kTag);
  transport.finish_ops(299, 303);
}

// Issue #17 (session 33's note): the cap of kRefusedTagsPerSource tags per (op, source) held
// against a source's own earlier tags too. A client retrying a put's fan-out under the same
// buffer id draws a fresh tag each time (client.cc), so by its fifth attempt the refusals of its
// earlier ones filled the cap, the current attempt's was not remembered, and its wait ended at
// its deadline instead of failing at once. Past the cap the newest tag now replaces an older one
// (not the first: MadeUpTagsForOneOpDoNotPushOutTheRunsRefusal).
TEST(TransportRunTagRefusal, AFanOutRetriedUnderFreshTagsFailsAtOnceWithItsNewestRefusal) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  constexpr uint64_t kOp = Transport::kUnorderedOps | 300;  // the fan-out of buffer 300
  MailboxOptions options;
  options.messages_per_peer = 1;
  Transport transport;
  transport.set_self(0);
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  // Device 1's one early message, then each attempt's message of the fan-out, over the count.
  ASSERT_TRUE(deliver(transport, tagged_message(1, 299, 0, kTag, "held")).ok());
  for (uint64_t attempt = 1; attempt <= 5; ++attempt) {
    ASSERT_TRUE(deliver(transport, tagged_message(1, kOp, 0, kTag ^ attempt, "earlier attempt")).ok());
  }
  ASSERT_TRUE(deliver(transport, tagged_message(1, kOp, 0, kTag, "this attempt")).ok());
  EXPECT_EQ(transport.dropped_messages(), 6) << "each refused message is counted";
  // This attempt's member claims the op (Transfers::fan_out) and waits for its message.
  transport.begin_run_ops(kOp, kOp + 1, kTag);
  absl::StatusOr<Received> got =
      transport.receive(1, "h:1", {kOp, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr(absl::StrCat("a message of op ", kOp, " from device 1")),
                    HasSubstr("--mailbox_messages_per_peer")));
  transport.end_run_ops(kOp, kOp + 1, kTag);
  transport.finish_op(kOp);
  transport.finish_op(299);
}

// Another source refused on 4,097 distinct later op ids (one tag each, under the per-(op,
// source) cap) pushed out the oldest entry when the remembered refusals were bounded only in
// all: a run's real refusal of the op it had claimed, whose wait then ended at its deadline
// rather than at once with RESOURCE_EXHAUSTED. Now that source's refusals are bounded by its own
// share (Transport::kRememberedPerSource) and push out only its own; that a claimed op's entry
// outlasts the same source's unclaimed ones is
// TransportRememberedBounds.ASourcesClaimedOpsRefusalAndLossOutlastItsOwnLaterUnclaimedOnes.
TEST(TransportRunTagRefusal, RefusalsOfManyUnclaimedOpsDoNotPushOutAClaimedOpsRefusal) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Transport transport;
  ASSERT_NO_FATAL_FAILURE(refuse_op_300_of_device_1(transport, kTag));
  transport.begin_run_ops(300, 301, kTag);
  // A forger declaring device 2: one held message, then one of each of 4,097 later ops, refused.
  ASSERT_TRUE(deliver(transport, tagged_message(2, 301, 0, 7, "held")).ok());
  for (uint64_t op = 302; op <= 302 + 4096; ++op) {
    ASSERT_TRUE(deliver(transport, tagged_message(2, op, 0, 7, "evil")).ok());
  }
  EXPECT_EQ(transport.dropped_messages(), 4098) << "each refused message is counted";
  absl::StatusOr<Received> got =
      transport.receive(1, "h:1", {300, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("a message of op 300 from device 1"));
  transport.end_run_ops(300, 301, kTag);
  transport.finish_ops(299, 302 + 4097);
}

// transport.h: the messages of ops a run here owns are awaited, not early. The time-to-live
// sweep spared only ops a receive had begun, so a message of a claimed op that no receive had
// reached yet (the run busy with earlier steps) was refused at its age and the op failed
// RESOURCE_EXHAUSTED. A message of an op nobody claimed still goes at its age.
TEST(TransportRunTagRefusal, AClaimedOpsMessageIsNotDroppedForItsAge) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  MailboxOptions options;
  options.unclaimed_ttl = absl::Milliseconds(40);
  Transport transport;
  transport.set_self(0);
  ASSERT_TRUE(transport.set_mailbox(options).ok());
  transport.begin_run_ops(300, 301, kTag);
  ASSERT_TRUE(deliver(transport, tagged_message(1, 300, 0, kTag, "real")).ok());
  ASSERT_TRUE(deliver(transport, tagged_message(1, 500, 0, kTag, "unclaimed")).ok());
  absl::SleepFor(absl::Milliseconds(60));  // the rule under test is an age: let both age past it
  transport.sweep();
  EXPECT_EQ(transport.dropped_messages(), 1) << "only the unclaimed op's message goes";
  EXPECT_EQ(transport.pending_messages(), 1);
  EXPECT_EQ(text_of(transport.receive(1, "h:1", {300, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline)),
            "real");
  transport.end_run_ops(300, 301, kTag);
  transport.finish_ops(300, 501);
}

// A run's claim drops the messages held early for its ops under other tags: the room they took
// in their source's share goes at once to the message waiting for it (its stream paused), which
// before waited for the next filing or sweep (up to a quarter of the time-to-live).
TEST(TransportRunTagRefusal, TheRoomAClaimMakesGoesToTheMessageWaitingForIt) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Endpoint a(0), b(1);
  MailboxOptions options;
  options.bytes_per_peer = 2 * (4 + Transport::kHeldMessageBytes);  // two messages of 4 bytes
  ASSERT_TRUE(b.transport().set_mailbox(options).ok());
  const std::string at_b = absl::StrCat("127.0.0.1:", b.port());
  auto send = [&](MessageTag tag, const std::string& text) {
    const absl::Status sent = a.transport().send(1, at_b, tag, reinterpret_cast<const std::byte*>(text.data()),
                                                 static_cast<int64_t>(text.size()), absl::Now() + kDeadline);
    ASSERT_TRUE(sent.ok()) << sent;
  };
  // Two forged early messages of op 300 fill device 0's share; the run's own waits for room.
  ASSERT_NO_FATAL_FAILURE(send({300, 0, 0, 7}, "evil"));
  ASSERT_NO_FATAL_FAILURE(send({300, 0, 1, 7}, "evil"));
  ASSERT_NO_FATAL_FAILURE(send({300, 0, 2, kTag}, "real"));
  ASSERT_TRUE(eventually([&] { return b.transport().waiting_messages() == 1; })) << "the stream never paused";
  EXPECT_EQ(b.transport().pending_messages(), 2);
  b.transport().begin_run_ops(300, 301, kTag);
  EXPECT_EQ(b.transport().forged_messages(), 2);
  EXPECT_EQ(b.transport().waiting_messages(), 0) << "the room the claim made was not given to the waiting message";
  EXPECT_EQ(b.transport().pending_messages(), 1);
  EXPECT_EQ(text_of(b.transport().receive(0, "a", {300, 0, 2, kTag}, absl::InfinitePast(), absl::Now() + kDeadline)),
            "real");
  b.transport().end_run_ops(300, 301, kTag);
  b.transport().finish_op(300);
}

// The decoder (Transport::deliver) reads field 10 wherever it comes: our senders write it before
// the data, protobuf's serialization after it. A second data field is refused (protobuf would
// keep the last; a sender of ours writes one), and so is a run tag cut short, named.
TEST(TransportDeliver, ARunTagAfterTheDataTwoDataFieldsAndATruncatedRunTag) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Transport transport;
  transport.set_self(0);
  int source = -1;
  const std::string in_protobufs_order = tagged_message(2, 9, 0, kTag, "abcd").SerializeAsString();
  ASSERT_GE(in_protobufs_order.size(), 9u);
  ASSERT_EQ(static_cast<uint8_t>(in_protobufs_order[in_protobufs_order.size() - 9]), (10 << 3) | 1)
      << "protobuf wrote the run tag (fixed64 field 10) last";
  grpc::ByteBuffer tagged = raw(in_protobufs_order);
  ASSERT_TRUE(transport.deliver(&tagged, &source, -1).ok());
  EXPECT_EQ(text_of(transport.receive(2, "", {9, 0, 0, kTag}, absl::InfinitePast(), absl::InfinitePast())), "abcd");
  EXPECT_EQ(transport.forged_messages(), 0);

  grpc::ByteBuffer two_data =
      raw(tagged_message(2, 10, 0, kTag, "abcd").SerializeAsString() + std::string("\x2a\x02xy", 4));
  absl::Status status = transport.deliver(&two_data, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("two data fields"));

  grpc::ByteBuffer truncated_tag =
      raw(data_message(2, 11, 0, "abcd").SerializeAsString() + std::string("\x51\x01\x02\x03", 4));
  status = transport.deliver(&truncated_tag, &source, -1);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(std::string(status.message()), HasSubstr("truncated run_tag (field 10): 3 of its 8 bytes"));
  EXPECT_EQ(transport.pending_messages(), 0);
  transport.finish_ops(9, 12);
}

// Issue #17: a notice of lost ops (ExchangeMessage.lost_ops) fails the receiver's waits for
// those ops' messages from its source at once. Op ids are predictable, so a forger declaring
// device 1 could fail the victim's next ops UNAVAILABLE; since protocol version 29 each lost op
// carries its run tag (lost_op_tags) and the notice counts only for a run that claimed the op
// with that tag. One of another tag (or none) is dropped and counted as forged, whether it
// comes after the run claimed the op or before (then when the run claims it); the run's wait
// goes on (here to its deadline: no message comes) and takes the real message when it comes. A
// notice with the right tag still fails the wait at once, naming the source.
pb::ExchangeMessage notice(int source, const std::vector<std::pair<uint64_t, uint64_t>>& ops) {
  pb::ExchangeMessage m;
  m.set_source_device(source);
  for (const auto& [op, tag] : ops) {
    m.add_lost_ops(op);
    m.add_lost_op_tags(tag);
  }
  return m;
}

TEST(TransportRunTagNotice, ANoticeOfLostOpsCountsOnlyWithTheTagTheRunClaimedTheOpWith) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Transport transport;
  transport.set_self(0);
  auto receive = [&](uint64_t op, absl::Duration wait) {
    return transport.receive(1, "h:1", {op, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + wait);
  };
  // Op 300 claimed first, then notices naming it untagged and with another tag.
  transport.begin_run_ops(300, 301, kTag);
  ASSERT_TRUE(deliver(transport, notice(1, {{300, 0}})).ok());
  ASSERT_TRUE(deliver(transport, notice(1, {{300, 7}})).ok());
  EXPECT_EQ(transport.forged_messages(), 2);
  // Nothing failed the wait: it ends at its deadline, not UNAVAILABLE.
  absl::StatusOr<Received> waited = receive(300, absl::Milliseconds(200));
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded) << waited.status();
  ASSERT_TRUE(deliver(transport, tagged_message(1, 300, 0, kTag, "real")).ok());
  EXPECT_EQ(text_of(receive(300, kDeadline)), "real");

  // Op 400: the forged notice comes before the run claims the op, and goes when it does.
  ASSERT_TRUE(deliver(transport, notice(1, {{400, 7}})).ok());
  EXPECT_EQ(transport.forged_messages(), 2);
  transport.begin_run_ops(400, 401, kTag);
  EXPECT_EQ(transport.forged_messages(), 3);
  waited = receive(400, absl::Milliseconds(200));
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kDeadlineExceeded) << waited.status();

  // Op 500: the run's own tag, before and after the claim: the wait fails at once.
  ASSERT_TRUE(deliver(transport, notice(1, {{500, kTag}, {501, 7}})).ok());
  transport.begin_run_ops(500, 502, kTag);
  EXPECT_EQ(transport.forged_messages(), 4);  // 501's
  for (uint64_t op : {500, 501}) {
    if (op == 501) {
      ASSERT_TRUE(deliver(transport, notice(1, {{501, kTag}})).ok());
    }
    waited = receive(op, kDeadline);
    EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();
    EXPECT_THAT(waited.status().message(), HasSubstr(absl::StrCat("device 1 (h:1) lost messages of op ", op)));
  }
  EXPECT_EQ(transport.forged_messages(), 4);
  for (auto [first, end] : {std::pair<uint64_t, uint64_t>{300, 301}, {400, 401}, {500, 502}}) {
    transport.end_run_ops(first, end, kTag);
    transport.finish_ops(first, end);
  }

  // Each lost op needs its tag: a notice of a version-28 worker (no tags) or with too few or
  // too many is refused.
  pb::ExchangeMessage untagged;
  untagged.set_source_device(1);
  untagged.add_lost_ops(600);
  pb::ExchangeMessage extra = notice(1, {{600, kTag}});
  extra.add_lost_op_tags(kTag);
  for (const pb::ExchangeMessage& bad : {untagged, extra}) {
    const absl::Status refused = deliver(transport, bad);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_THAT(refused.message(), HasSubstr(absl::StrCat("Exchange: a notice names 1 lost ops and ",
                                                          bad.lost_op_tags_size(), " run tags (lost_op_tags)")));
  }
}

// As refusals (MadeUpTagsForOneOpDoNotPushOutTheRunsRefusal): the mailbox remembers at most
// kRefusedTagsPerSource tags' notices of loss per (op, source). Before, a forger declaring
// device 2 could name one op under 4,096 made-up tags (256 a notice) and fill the 4,096
// remembered losses, pushing out the oldest op's: device 1's real loss of op 300, whose run's
// wait then ended at its deadline rather than failing at once UNAVAILABLE.
TEST(TransportRunTagNotice, MadeUpTagsForOneOpDoNotPushOutAnotherSourcesLoss) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Transport transport;
  transport.set_self(0);
  ASSERT_TRUE(deliver(transport, notice(1, {{300, kTag}})).ok());
  for (uint64_t first = 1; first <= 4096; first += 256) {
    std::vector<std::pair<uint64_t, uint64_t>> ops;
    for (uint64_t t = first; t < first + 256; ++t) ops.push_back({301, kTag ^ t});
    ASSERT_TRUE(deliver(transport, notice(2, ops)).ok());
  }
  transport.begin_run_ops(300, 302, kTag);
  absl::StatusOr<Received> waited =
      transport.receive(1, "h:1", {300, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(waited.status().message(), HasSubstr("device 1 (h:1) lost messages of op 300"));
  // The claim dropped and counted the forger's four remembered tags of op 301 (the rest were not
  // remembered, as a refusal past the cap is not).
  EXPECT_EQ(transport.forged_messages(), Transport::kRefusedTagsPerSource);
  transport.end_run_ops(300, 302, kTag);
  transport.finish_ops(300, 302);
}

// The same for notices of lost ops: a client retrying a fan-out under fresh tags, whose
// earlier attempts' streams failed, the uploader noticing each loss. Past the cap the newest
// attempt's loss replaces an older one: its member's wait fails at once, UNAVAILABLE naming the
// uploader (before: not remembered, DEADLINE_EXCEEDED at its deadline). The first loss and the
// two latest of the earlier attempts stay, and go at the claim, counted as forged.
TEST(TransportRunTagNotice, AFanOutRetriedUnderFreshTagsFailsAtOnceWithItsNewestLoss) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  constexpr uint64_t kOp = Transport::kUnorderedOps | 300;  // the fan-out of buffer 300
  Transport transport;
  transport.set_self(0);
  for (uint64_t attempt = 1; attempt <= 5; ++attempt) {
    ASSERT_TRUE(deliver(transport, notice(1, {{kOp, kTag ^ attempt}})).ok());
  }
  ASSERT_TRUE(deliver(transport, notice(1, {{kOp, kTag}})).ok());
  transport.begin_run_ops(kOp, kOp + 1, kTag);
  EXPECT_EQ(transport.forged_messages(), Transport::kRefusedTagsPerSource - 1);
  absl::StatusOr<Received> waited =
      transport.receive(1, "h:1", {kOp, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kUnavailable) << waited.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(waited.status().message(), HasSubstr(absl::StrCat("device 1 (h:1) lost messages of op ", kOp)));
  transport.end_run_ops(kOp, kOp + 1, kTag);
  transport.finish_op(kOp);
}

// `device`'s messages of the ops [first, end), each refused over the count (the device holds
// its share of early messages already), then its notices naming the ops as lost (256 a
// notice); each op's under the run tag `tag(op)`.
void refuse_and_notice_ops(Transport& transport, int device, uint64_t first, uint64_t end,
                           const std::function<uint64_t(uint64_t)>& tag) {
  for (uint64_t op = first; op < end; ++op) {
    ASSERT_TRUE(deliver(transport, tagged_message(device, op, 0, tag(op), "refused")).ok());
  }
  for (uint64_t from = first; from < end; from += 256) {
    std::vector<std::pair<uint64_t, uint64_t>> ops;
    for (uint64_t op = from; op < std::min(from + 256, end); ++op) ops.push_back({op, tag(op)});
    ASSERT_TRUE(deliver(transport, notice(device, ops)).ok());
  }
}

// Issue #17 (session 37): the refusals and losses remembered for the ops' waits were bounded
// only in all (4,096 of each), the lowest op no run had claimed going first, whoever's it was: a
// source refused on more later ops than that, or naming as many in its notices (a flood, or a
// forger declaring a device of its own), pushed out another source's refusal and loss of ops not
// claimed yet, and the run's waits for them then ended at their deadline instead of failing at
// once, naming them. The bounds are now per source too, charged to the source
// (Transport::kRememberedPerSource: its own oldest go), and past the bound in all the source
// holding the most pays (Transport::kRememberedInAll).
TEST(TransportRememberedBounds, AFloodOfOneSourcesRefusalsAndNoticesDoesNotPushOutAnothersRefusalOrLoss) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  Transport transport;
  // Device 1: its message of op 300 refused over the count, and its notice of a loss of op 310;
  // no run here claimed either op yet.
  ASSERT_NO_FATAL_FAILURE(refuse_op_300_of_device_1(transport, kTag));
  ASSERT_TRUE(deliver(transport, notice(1, {{310, kTag}})).ok());
  // Device 2: one held message, then one of each of 4,097 later ops under made-up tags, each
  // refused over the count, and notices naming the same ops (256 a notice).
  constexpr uint64_t kFirst = 401, kEnd = kFirst + 4097;
  ASSERT_TRUE(deliver(transport, tagged_message(2, 400, 0, 7, "held")).ok());
  ASSERT_NO_FATAL_FAILURE(refuse_and_notice_ops(transport, 2, kFirst, kEnd, [](uint64_t op) { return op; }));
  EXPECT_EQ(transport.dropped_messages(), 1 + 4097) << "each refused message is counted";
  // Device 2's refusals and losses, each bounded by its share; device 1's kept.
  EXPECT_EQ(transport.remembered_of(2),
            std::make_pair(Transport::kRememberedPerSource, Transport::kRememberedPerSource));
  EXPECT_EQ(transport.remembered_of(1), std::make_pair(size_t{1}, size_t{1}));
  // A run here claims ten of device 2's latest ops with another tag than theirs: their refusals
  // and losses go (drop_mismatched_locked), and device 2's counts with them.
  transport.begin_run_ops(kEnd - 10, kEnd, kTag);
  EXPECT_EQ(transport.remembered_of(2),
            std::make_pair(Transport::kRememberedPerSource - 10, Transport::kRememberedPerSource - 10));
  transport.end_run_ops(kEnd - 10, kEnd, kTag);
  transport.begin_run_ops(300, 311, kTag);
  auto receive = [&](uint64_t op) {
    return transport.receive(1, "h:1", {op, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  };
  absl::StatusOr<Received> got = receive(300);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(std::string(got.status().message()),
              AllOf(HasSubstr("a message of op 300 from device 1 (h:1) was dropped"),
                    HasSubstr("--mailbox_messages_per_peer")));
  got = receive(310);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();  // before: DEADLINE_EXCEEDED
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("device 1 (h:1) lost messages of op 310"));
  transport.end_run_ops(300, 311, kTag);
  transport.finish_ops(299, kEnd);
  EXPECT_EQ(transport.remembered_of(1), std::make_pair(size_t{0}, size_t{0})) << "they go with their ops";
  EXPECT_EQ(transport.remembered_of(2), std::make_pair(size_t{0}, size_t{0})) << "they go with their ops";
}

// Within one source's share the oldest of an op no run claimed goes first, before any of a
// claimed op: device 1's refusal of op 300 and its loss of op 310, both claimed by a run here,
// outlast device 1's own refusals and losses of kRememberedPerSource + 1 later ops no run
// claimed (a peer running ahead, or a forger declaring device 1), and the run's waits fail at
// once naming them (with the oldest of device 1's going first whatever its op, they would be
// pushed out and the waits would end at their deadline).
TEST(TransportRememberedBounds, ASourcesClaimedOpsRefusalAndLossOutlastItsOwnLaterUnclaimedOnes) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  constexpr uint64_t kPerSource = Transport::kRememberedPerSource;
  Transport transport;
  ASSERT_NO_FATAL_FAILURE(refuse_op_300_of_device_1(transport, kTag));  // holds op 299's message
  ASSERT_TRUE(deliver(transport, notice(1, {{310, kTag}})).ok());
  transport.begin_run_ops(300, 311, kTag);
  constexpr uint64_t kFirst = 401, kEnd = kFirst + kPerSource + 1;
  ASSERT_NO_FATAL_FAILURE(refuse_and_notice_ops(transport, 1, kFirst, kEnd, [](uint64_t) { return kTag; }));
  EXPECT_EQ(transport.dropped_messages(), 1 + kPerSource + 1) << "each refused message is counted";
  EXPECT_EQ(transport.remembered_of(1), std::make_pair(kPerSource, kPerSource));
  auto receive = [&](uint64_t op) {
    return transport.receive(1, "h:1", {op, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  };
  absl::StatusOr<Received> got = receive(300);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("a message of op 300 from device 1 (h:1) was dropped"));
  got = receive(310);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
  EXPECT_THAT(std::string(got.status().message()), HasSubstr("device 1 (h:1) lost messages of op 310"));
  transport.end_run_ops(300, 311, kTag);
  transport.finish_ops(299, kEnd);
  EXPECT_EQ(transport.remembered_of(1), std::make_pair(size_t{0}, size_t{0}));
}

// The bounds themselves (transport.h, kRememberedPerSource and kRememberedInAll): a source's
// refusals past its bound push out its own oldest (the wait for that op then ends at its
// deadline, the newest fails at once); past the bound in all, a newcomer is not locked out but
// takes from the sources holding the most until the shares are even, and a source holding
// fewer (device 1, one refusal) keeps them.
TEST(TransportRememberedBounds, EachSourcesEntriesAreBoundedItsOwnOldestGoingFirstAndTheLargestPays) {
  constexpr uint64_t kTag = 0x5eed5eed5eed5eedULL;
  constexpr uint64_t kPerSource = Transport::kRememberedPerSource;
  Transport transport;
  ASSERT_NO_FATAL_FAILURE(refuse_op_300_of_device_1(transport, kTag));
  // Device 2: one held message, then kPerSource + 10 refused, ops 1001 to 1000 + kPerSource + 10.
  ASSERT_TRUE(deliver(transport, tagged_message(2, 1000, 0, kTag, "held")).ok());
  for (uint64_t op = 1001; op <= 1000 + kPerSource + 10; ++op) {
    ASSERT_TRUE(deliver(transport, tagged_message(2, op, 0, kTag, "over")).ok());
  }
  EXPECT_EQ(transport.remembered_of(2), std::make_pair(kPerSource, size_t{0}));
  EXPECT_EQ(transport.remembered_of(1), std::make_pair(size_t{1}, size_t{0}));
  transport.begin_run_ops(1001, 1000 + kPerSource + 11, kTag);
  absl::StatusOr<Received> oldest =
      transport.receive(2, "h:2", {1001, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(oldest.status().code(), absl::StatusCode::kDeadlineExceeded) << oldest.status();
  absl::StatusOr<Received> newest =
      transport.receive(2, "h:2", {1000 + kPerSource + 10, 0, 0, kTag}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(newest.status().code(), absl::StatusCode::kResourceExhausted) << newest.status();
  transport.end_run_ops(1001, 1000 + kPerSource + 11, kTag);
  transport.finish_ops(1000, 1000 + kPerSource + 11);
  EXPECT_EQ(transport.remembered_of(2), std::make_pair(size_t{0}, size_t{0})) << "they go with their ops";

  // Devices 2 to 6 each refused on kPerSource ops of their own: more than kRememberedInAll.
  for (int device = 2; device <= 6; ++device) {
    const uint64_t base = 10000 * static_cast<uint64_t>(device);
    ASSERT_TRUE(deliver(transport, tagged_message(device, base, 0, kTag, "held")).ok());
    for (uint64_t op = base + 1; op <= base + kPerSource; ++op) {
      ASSERT_TRUE(deliver(transport, tagged_message(device, op, 0, kTag, "over")).ok());
    }
  }
  size_t in_all = transport.remembered_of(1).first;
  for (int device = 2; device <= 6; ++device) {
    const size_t held = transport.remembered_of(device).first;
    in_all += held;
    // Even shares of what device 1 leaves: (4,096 - 1) / 5 = 819, give or take one.
    EXPECT_GE(held, (Transport::kRememberedInAll - 1) / 5 - 1) << "device " << device;
    EXPECT_LE(held, (Transport::kRememberedInAll - 1) / 5 + 1) << "device " << device;
  }
  EXPECT_EQ(in_all, Transport::kRememberedInAll);
  EXPECT_EQ(transport.remembered_of(1), std::make_pair(size_t{1}, size_t{0})) << "device 1 holds the fewest";
  transport.finish_ops(299, 70000);
}

// A sender whose messages are never taken (its op started here, but nothing takes them) is
// still bounded: the mailbox holds its share, one message per stream waits, and the rest stays
// with the sender. A message that waits longer than the time-to-live is refused with what is
// held of its op, the op's wait fails naming the peer, the share and both flags, and the stream
// reads on: the sender's next op is delivered (no hang).
TEST(TransportFlowControl, AStreamPausedPastTheTtlIsRefusedAndReadsOn) {
  Endpoint a(0), b(1);
  MailboxOptions options;
  options.bytes_per_peer = 2 * ((512 << 10) + Transport::kHeldMessageBytes);  // two chunks
  options.unclaimed_ttl = absl::Milliseconds(200);
  ASSERT_TRUE(b.transport().set_mailbox(options).ok());
  const std::string at_b = absl::StrCat("127.0.0.1:", b.port());
  // Op 5 has started at b: a receive of a message nobody sends.
  EXPECT_EQ(b.transport().receive(0, "a", {5, 1, 0}, absl::InfinitePast(), absl::InfinitePast()).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  const std::vector<std::byte> chunk(512 << 10, std::byte{3});
  for (int c = 0; c < 6; ++c) {
    ASSERT_TRUE(a.transport().send(1, at_b, {5, 0, c}, chunk.data(), 512 << 10, absl::Now() + kDeadline).ok());
  }
  const std::byte next[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  ASSERT_TRUE(a.transport().send(1, at_b, {6, 0, 0}, next, 4, absl::Now() + kDeadline).ok());
  ASSERT_TRUE(eventually([&] { return b.transport().waiting_messages() > 0; })) << "the stream never paused";
  EXPECT_EQ(b.transport().pending_messages(), 2);
  absl::SleepFor(options.unclaimed_ttl + absl::Milliseconds(50));  // the rule under test is an age
  b.transport().sweep();
  absl::StatusOr<Received> refused =
      b.transport().receive(0, "a", {5, 0, 2}, absl::InfinitePast(), absl::Now() + kDeadline);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              AllOf(HasSubstr("op 5 from device 0 (a)"), HasSubstr("stayed paused"),
                    HasSubstr(absl::StrCat(options.bytes_per_peer, " bytes, --mailbox_bytes_per_peer")),
                    HasSubstr("--mailbox_ttl_ms")));
  absl::StatusOr<Received> got =
      b.transport().receive(0, "a", {6, 0, 0}, absl::InfinitePast(), absl::Now() + kDeadline);
  ASSERT_TRUE(got.ok()) << got.status();
  std::byte bytes[4];
  got->copy_to(bytes);
  EXPECT_EQ(std::memcmp(bytes, next, 4), 0);
  EXPECT_EQ(b.transport().waiting_messages(), 0);
  EXPECT_EQ(b.transport().pending_messages(), 0) << "op 5's held chunks went with the refusal";
  b.transport().finish_ops(5, 7);
}

// Issue #17 item 1, "collective messages only from ... registered peers of the current
// cluster incarnation": what a worker decides of an Exchange stream when it opens, from the
// coordinator's view (epoch 1000; device 0 at incarnation 1, device 1 at 3). The processes'
// side: FloodTest.StreamsOfSendersThatAreNoCurrentRegistrationAreRefusedWhenTheyOpen and
// WorkerRestartTest.AStreamOfAnEarlierIncarnationIsRefusedAndAForgedSenderDropped.
struct Decisions {
  std::function<void(absl::Status)> record(int i) {
    return [this, i](absl::Status s) {
      absl::MutexLock lock(&mu);
      got[i] = std::move(s);
    };
  }
  std::optional<absl::Status> of(int i) {
    absl::MutexLock lock(&mu);
    auto it = got.find(i);
    return it == got.end() ? std::nullopt : std::optional<absl::Status>(it->second);
  }
  absl::Mutex mu;
  std::map<int, absl::Status> got;
};

// A coordinator's view: its ClusterPeers naming `devices` (device, incarnation), in this order.
pb::ClusterPeers peers(const std::vector<std::pair<int, uint64_t>>& devices, uint64_t version = 0) {
  pb::ClusterPeers view;
  view.set_version(version);
  for (const auto& [device, incarnation] : devices) {
    pb::PeerRegistration* p = view.add_devices();
    p->set_device_id(device);
    p->set_incarnation(incarnation);
  }
  return view;
}

TEST(PeerView, ACurrentRegistrationIsTakenAndStaleOnesAreRefusedAtOnce) {
  PeerView view;
  Decisions d;
  view.admit({7, 5, 5}, d.record(0));  // no view yet: nothing to check against
  ASSERT_TRUE(d.of(0).has_value() && d.of(0)->ok());
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}})).ok());
  view.admit({1, 1000, 3}, d.record(1));
  view.admit({1, 1000, 2}, d.record(2));  // an earlier process of device 1
  view.admit({1, 999, 3}, d.record(3));   // registered with an earlier coordinator
  view.admit({1, 0, 0}, d.record(4));     // declares nothing but its device
  ASSERT_TRUE(d.of(1).has_value());
  EXPECT_TRUE(d.of(1)->ok()) << *d.of(1);
  for (int i : {2, 3, 4}) {
    ASSERT_TRUE(d.of(i).has_value()) << i;
    EXPECT_EQ(d.of(i)->code(), absl::StatusCode::kPermissionDenied) << *d.of(i);
  }
  EXPECT_THAT(std::string(d.of(2)->message()),
              AllOf(HasSubstr("device 1 (incarnation 2 of coordinator epoch 1000)"),
                    HasSubstr("an earlier incarnation of device 1, whose current one is 3")));
  EXPECT_THAT(std::string(d.of(3)->message()), HasSubstr("an earlier coordinator epoch than this worker's"));
  EXPECT_THAT(std::string(d.of(4)->message()), HasSubstr("does not declare its sender"));
  EXPECT_EQ(view.waiting(), 0);
}

// A stream of a device the view does not know (yet), or of a newer incarnation or epoch, waits
// for a view asked for after it came: taken if that view names it, refused if not — never
// refused on a view that may predate its sender's registration.
TEST(PeerView, AnUnknownSenderWaitsForAFreshViewAndIsDecidedByIt) {
  int refreshes = 0;
  PeerView view([&refreshes] { ++refreshes; });
  Decisions d;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}})).ok());
  const uint64_t in_flight = view.ask();  // a heartbeat sent before the streams came
  view.admit({2, 1000, 1}, d.record(0));  // device 2, registered a moment ago
  view.admit({99, 1000, 1}, d.record(1));
  view.admit({1, 1000, 4}, d.record(2));  // device 1 registered again
  EXPECT_EQ(refreshes, 3);
  EXPECT_EQ(view.waiting(), 3);
  // The older heartbeat's answer, without device 2 or incarnation 4: proves nothing.
  ASSERT_TRUE(view.update(in_flight, 1000, peers({{0, 1}, {1, 3}})).ok());
  EXPECT_EQ(view.waiting(), 3);
  EXPECT_FALSE(d.of(1).has_value());
  // The next one, asked after they came, names device 2 and device 1's incarnation 4.
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 4}, {2, 1}})).ok());
  EXPECT_EQ(view.waiting(), 0);
  ASSERT_TRUE(d.of(0).has_value() && d.of(2).has_value() && d.of(1).has_value());
  EXPECT_TRUE(d.of(0)->ok()) << *d.of(0);
  EXPECT_TRUE(d.of(2)->ok()) << *d.of(2);
  EXPECT_EQ(d.of(1)->code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(d.of(1)->message()),
              AllOf(HasSubstr("device 99 (incarnation 1 of coordinator epoch 1000)"),
                    HasSubstr("device 99 is not a registered device of this cluster (alive: 0, 1, 2)")));
  // No view at all within PeerView::kMaxWait: UNAVAILABLE, naming the sender.
  view.admit({98, 1000, 1}, d.record(3));
  view.expire(absl::Now());
  EXPECT_EQ(view.waiting(), 1);
  view.expire(absl::Now() + PeerView::kMaxWait);
  ASSERT_TRUE(d.of(3).has_value());
  EXPECT_EQ(d.of(3)->code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(d.of(3)->message()), HasSubstr("device 98"));
}

// A malformed view (a device twice, a negative device id, incarnation 0) is refused
// INVALID_ARGUMENT naming the entry and the rule, and leaves the view as it was: the streams
// it would have refused are still taken.
TEST(PeerView, AMalformedViewIsRefusedNamingTheEntryAndChangesNothing) {
  PeerView view;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}})).ok());
  const std::vector<std::pair<pb::ClusterPeers, std::string>> malformed = {
      {peers({{0, 1}, {2, 1}, {0, 2}}), "entry 2 (device 0, incarnation 2)"},
      {peers({{0, 1}, {-1, 1}}), "entry 1 (device -1, incarnation 1)"},
      {peers({{5, 0}}), "entry 0 (device 5, incarnation 0)"}};
  for (const auto& [view_sent, entry] : malformed) {
    const absl::Status s = view.update(view.ask(), 1001, view_sent);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(std::string(s.message()),
                AllOf(HasSubstr(absl::StrCat("the coordinator's ClusterPeers ", entry)),
                      HasSubstr("is not a distinct device (id from 0) with an incarnation from 1")));
  }
  Decisions d;
  view.admit({1, 1000, 3}, d.record(0));
  ASSERT_TRUE(d.of(0).has_value());
  EXPECT_TRUE(d.of(0)->ok()) << *d.of(0);
}

// A reply without a view to a request that held none (no ClusterPeers: only a coordinator of
// another protocol version sends one) is refused naming the reply and changes nothing: taken as
// an empty view it would refuse every peer's stream as "not a registered device" (the s38
// review's case).
TEST(PeerView, AReplyWithoutPeersIsRefusedNamingItAndChangesNothing) {
  PeerView view;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}})).ok());  // a view of version 0
  const absl::Status s = view.update(view.ask(), 1000, view.view_version(1000), nullptr, "Heartbeat reply");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("the coordinator's Heartbeat reply names no peers (ClusterPeers, protocol version "),
                    HasSubstr("though the request held no view of epoch 1000"), HasSubstr("the view is unchanged")));
  Decisions d;
  view.admit({1, 1000, 3}, d.record(0));  // taken at once: the view still names it
  ASSERT_TRUE(d.of(0).has_value());
  EXPECT_TRUE(d.of(0)->ok()) << *d.of(0);
  // An empty view is a view (no device alive): there the same claim is not taken (it waits for
  // a newer view, then is refused), which is what a missing view taken as empty would do.
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({})).ok());
  view.admit({1, 1000, 3}, d.record(1));
  EXPECT_FALSE(d.of(1).has_value() && d.of(1)->ok());
}

// Issue #17 (session 40): a heartbeat names the version of the view held, and the coordinator
// sends the view only when it is another. The version is the view's: it is replaced with it
// (and not by a malformed view), a reply without a view keeps both, and it counts only within
// the view's coordinator epoch (a heartbeat of another epoch names none, so gets the view).
TEST(PeerView, TheVersionHeldChangesWithTheViewAndOnlyWithIt) {
  PeerView view;
  EXPECT_EQ(view.view_version(1000), 0u);  // no view yet
  const pb::ClusterPeers registered = peers({{0, 1}, {1, 3}}, 7);
  ASSERT_TRUE(view.update(view.ask(), 1000, 0, &registered, "RegisterWorker reply").ok());
  EXPECT_EQ(view.view_version(1000), 7u);
  EXPECT_EQ(view.view_version(1001), 0u);  // another coordinator epoch: the view held is none of its
  // A heartbeat naming version 7 gets no view: the view and its version stay.
  ASSERT_TRUE(view.update(view.ask(), 1000, 7, nullptr, "Heartbeat reply").ok());
  EXPECT_EQ(view.view_version(1000), 7u);
  Decisions d;
  view.admit({1, 1000, 3}, d.record(0));  // still named: taken at once
  ASSERT_TRUE(d.of(0).has_value());
  EXPECT_TRUE(d.of(0)->ok()) << *d.of(0);
  // A malformed view of version 8 changes neither.
  EXPECT_EQ(view.update(view.ask(), 1000, peers({{0, 1}, {0, 2}}, 8)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(view.view_version(1000), 7u);
  // A view of version 8 (device 1 registered again) replaces both.
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 4}}, 8)).ok());
  EXPECT_EQ(view.view_version(1000), 8u);
  view.admit({1, 1000, 3}, d.record(1));  // now an earlier incarnation: refused at once
  ASSERT_TRUE(d.of(1).has_value());
  EXPECT_EQ(d.of(1)->code(), absl::StatusCode::kPermissionDenied) << *d.of(1);
  // A registration with a new coordinator epoch restarts the versions: its view (version 1)
  // replaces the one of epoch 1000, and that epoch's version counts no more.
  ASSERT_TRUE(view.update(view.ask(), 2000, peers({{0, 1}}, 1)).ok());
  EXPECT_EQ(view.view_version(2000), 1u);
  EXPECT_EQ(view.view_version(1000), 0u);
}

// A reply without a view says the view held is current: a stream waiting for a view asked for
// after it came is decided by it then (taken if the view names it, refused if not), as a reply
// carrying the same view would — not left waiting until PeerView::kMaxWait. A reply that
// confirms a version no longer held (the view changed since its request) decides nothing.
TEST(PeerView, AReplyThatTheViewHeldIsCurrentDecidesTheStreamsWaitingForIt) {
  PeerView view;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}}, 5)).ok());
  const uint64_t in_flight = view.ask();  // a heartbeat sent before the stream came
  Decisions d;
  view.admit({99, 1000, 1}, d.record(0));  // not in the view: waits for a fresh one
  view.admit({0, 1000, 1}, d.record(1));   // named: taken at once
  ASSERT_TRUE(d.of(1).has_value() && d.of(1)->ok());
  EXPECT_EQ(view.waiting(), 1);
  // The older heartbeat's "version 5 is current": device 99 may have registered after the
  // coordinator answered it, so it proves nothing.
  ASSERT_TRUE(view.update(in_flight, 1000, 5, nullptr, "Heartbeat reply").ok());
  EXPECT_EQ(view.waiting(), 1);
  // A reply to a request that named version 4 (the view held since is 5): proves nothing.
  ASSERT_TRUE(view.update(view.ask(), 1000, 4, nullptr, "Heartbeat reply").ok());
  EXPECT_EQ(view.waiting(), 1);
  // Nor does "version 5 is current" from another coordinator epoch (its version 5 is another view).
  ASSERT_TRUE(view.update(view.ask(), 1001, 5, nullptr, "Heartbeat reply").ok());
  EXPECT_EQ(view.waiting(), 1);
  // Version 5 is current at a heartbeat asked after the stream came: device 99 is not registered.
  ASSERT_TRUE(view.update(view.ask(), 1000, 5, nullptr, "Heartbeat reply").ok());
  EXPECT_EQ(view.waiting(), 0);
  ASSERT_TRUE(d.of(0).has_value());
  EXPECT_EQ(d.of(0)->code(), absl::StatusCode::kPermissionDenied) << *d.of(0);
  EXPECT_THAT(std::string(d.of(0)->message()),
              HasSubstr("device 99 is not a registered device of this cluster (alive: 0, 1)"));
}

// Issue #17 item 1, re-checked: a stream admitted under a registration is told to end by the
// first view that says the registration was replaced — a newer incarnation of its device, the
// device gone, or this worker registered with a newer coordinator epoch — naming the device,
// the incarnation it declared, the current one and the rule; never by a view that still names
// it, and never once the stream ended. (The view used to be consulted only when a stream
// opened; the processes' side: WorkerRestartTest.AStreamTakenBeforeItsSenderRegisteredAgainIsEnded.)
TEST(PeerView, AnAdmittedStreamIsEndedByTheFirstViewThatSaysItsRegistrationWasReplaced) {
  PeerView view;
  Decisions d, replaced;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}, {2, 5}})).ok());
  view.admit({1, 1000, 3}, d.record(0), replaced.record(0));
  view.admit({0, 1000, 1}, d.record(1), replaced.record(1));
  view.admit({2, 1000, 5}, d.record(2), replaced.record(2));
  const uint64_t gone = view.admit({2, 1000, 5}, d.record(3), replaced.record(3));
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(d.of(i).has_value() && d.of(i)->ok()) << i;
  EXPECT_EQ(view.admitted(), 4);
  view.ended(gone);  // its stream ended: no view tells it anything
  EXPECT_EQ(view.admitted(), 3);

  // The same registrations: nothing ends.
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 3}, {2, 5}})).ok());
  for (int i = 0; i < 4; ++i) EXPECT_FALSE(replaced.of(i).has_value()) << i;

  // Device 1 registered again (incarnation 4), device 2 is gone.
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 4}})).ok());
  ASSERT_TRUE(replaced.of(0).has_value());
  EXPECT_EQ(replaced.of(0)->code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(replaced.of(0)->message()),
              AllOf(HasSubstr("ended the stream from device 1 (incarnation 3 of coordinator epoch 1000)"),
                    HasSubstr("device 1's current incarnation is 4, which replaced incarnation 3"),
                    HasSubstr("a worker takes collective data only from the current incarnations")));
  EXPECT_FALSE(replaced.of(1).has_value());
  ASSERT_TRUE(replaced.of(2).has_value());
  EXPECT_EQ(replaced.of(2)->code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(replaced.of(2)->message()),
              AllOf(HasSubstr("device 2 (incarnation 5 of coordinator epoch 1000)"),
                    HasSubstr("device 2 is no longer a registered device of this cluster (alive: 0, 1")));
  EXPECT_FALSE(replaced.of(3).has_value()) << "told after its stream ended";
  EXPECT_EQ(view.admitted(), 1);

  // This worker registered with a restarted coordinator (epoch 1001): device 0's stream of
  // epoch 1000 ends too, once.
  ASSERT_TRUE(view.update(view.ask(), 1001, peers({{0, 1}, {1, 1}})).ok());
  ASSERT_TRUE(replaced.of(1).has_value());
  EXPECT_THAT(std::string(replaced.of(1)->message()),
              AllOf(HasSubstr("device 0 (incarnation 1 of coordinator epoch 1000)"),
                    HasSubstr("a registration of coordinator epoch 1001, whose current incarnation of device 0 is 1")));
  EXPECT_EQ(view.admitted(), 0);
}

// A stream that waited for a fresh view and was admitted by it is checked by the views after.
TEST(PeerView, AStreamAdmittedByAFreshViewIsCheckedByTheNextOnes) {
  PeerView view;
  Decisions d, replaced;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}})).ok());
  view.admit({3, 1000, 2}, d.record(0), replaced.record(0));
  EXPECT_EQ(view.waiting(), 1);
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {3, 2}})).ok());
  ASSERT_TRUE(d.of(0).has_value() && d.of(0)->ok());
  EXPECT_EQ(view.admitted(), 1);
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {3, 3}})).ok());
  ASSERT_TRUE(replaced.of(0).has_value());
  EXPECT_THAT(std::string(replaced.of(0)->message()),
              HasSubstr("current incarnation is 3, which replaced incarnation 2"));
}

// Issue #17 item 2 of session 29's gaps: a waiting stream that ends (cancelled, its sender gone)
// leaves the waiting list at once — it neither stays until the next view nor counts toward
// PeerView::kMaxWaiting — and no later view or expiry calls it. Before, ended streams stayed
// until a view decided them: 1,024 cancelled streams refused every new one RESOURCE_EXHAUSTED.
TEST(PeerView, AStreamThatEndsWhileWaitingLeavesTheListAndTheCap) {
  PeerView view;
  Decisions d;
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}})).ok());
  std::vector<uint64_t> ids;
  for (int i = 0; i < PeerView::kMaxWaiting; ++i) ids.push_back(view.admit({1, 1000, 1}, d.record(i)));
  EXPECT_EQ(view.waiting(), PeerView::kMaxWaiting);
  view.admit({1, 1000, 1}, d.record(-1));  // the cap is real
  ASSERT_TRUE(d.of(-1).has_value());
  EXPECT_EQ(d.of(-1)->code(), absl::StatusCode::kResourceExhausted) << *d.of(-1);
  EXPECT_THAT(std::string(d.of(-1)->message()), HasSubstr("1024 streams already wait"));

  for (uint64_t id : ids) view.ended(id);  // every one of them was cancelled
  EXPECT_EQ(view.waiting(), 0);
  const uint64_t live = view.admit({1, 1000, 1}, d.record(-2));
  EXPECT_EQ(view.waiting(), 1);
  EXPECT_FALSE(d.of(-2).has_value()) << *d.of(-2);  // it waits: not refused for the ended ones
  EXPECT_NE(live, 0u);

  view.expire(absl::Now() + PeerView::kMaxWait);
  ASSERT_TRUE(view.update(view.ask(), 1000, peers({{0, 1}, {1, 1}})).ok());
  for (int i = 0; i < PeerView::kMaxWaiting; ++i) ASSERT_FALSE(d.of(i).has_value()) << "stream " << i << " ended";
  ASSERT_TRUE(d.of(-2).has_value());  // the live one was decided (its wait expired first)
  EXPECT_EQ(view.waiting(), 0);
}

// Receives message `tag` from device 0 at `to` and checks its four bytes against `sent`.
void expect_four_bytes(Transport& to, MessageTag tag, absl::Time start, const std::byte* sent) {
  absl::StatusOr<Received> got = to.receive(0, "", tag, start, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 4);
  std::byte bytes[4];
  got->copy_to(bytes);
  EXPECT_EQ(std::memcmp(bytes, sent, 4), 0);
}

// Device 0 (a), registered as incarnation 1 of coordinator epoch 7, sends to device 1 (b).
class TransportRegistration : public ::testing::Test {
 protected:
  TransportRegistration() { a.transport().declare(7, 1); }

  Endpoint a{0}, b{1};
  const std::string to_b = absl::StrCat("127.0.0.1:", b.port());
  const absl::Time start = absl::Now();
};

// Issue #17, the review of session 30: a peer that refuses or ends this worker's stream says why
// (here PERMISSION_DENIED: the registration the stream declares was replaced), and the op whose
// messages it carried failed with "device 1 stopped taking collective data" (UNAVAILABLE), not
// the reason. Now the op's error has the peer's code and message, naming the device.
TEST(TransportLoss, APeersRefusalReachesTheOpsErrorWithItsCodeAndReason) {
  PeerView view;
  ASSERT_TRUE(view.update(view.ask(), 7, peers({{0, 2}, {1, 1}})).ok());  // device 0's current incarnation is 2
  Endpoint a(0), b(1, &view);
  a.transport().declare(7, 1);  // a's streams declare incarnation 1: replaced
  const std::string to_b = absl::StrCat("127.0.0.1:", b.port());
  const std::byte one[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  const absl::Time start = absl::Now();
  // The send fails if the refusal came first; otherwise the op fails when it comes.
  absl::Status failed = a.transport().send(1, to_b, {51, 0, 0}, one, 4, absl::Now() + absl::Seconds(20));
  if (failed.ok()) failed = a.transport().receive(1, to_b, {51, 1, 0}, start, absl::Now() + absl::Seconds(20)).status();
  EXPECT_EQ(failed.code(), absl::StatusCode::kPermissionDenied) << failed;  // before: UNAVAILABLE
  EXPECT_THAT(std::string(failed.message()),
              AllOf(HasSubstr(absl::StrCat("device 1 (", to_b, ")")),
                    HasSubstr("device 0 (incarnation 1 of coordinator epoch 7)"),
                    HasSubstr("an earlier incarnation of device 0, whose current one is 2")));
  EXPECT_EQ(b.transport().pending_messages(), 0);  // nothing of it was read
}

// Waits (with a deadline, no sleep: each check is a call into the transport) until `a` holds
// `n` sends for its registration.
bool until_held(Transport& a, int n) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (a.held_sends() != n) {
    if (absl::Now() >= deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

// Issue #17 (session 29's gap 3): while this worker registers again, its collective messages
// wait for the new registration, and then go on fresh links declaring it — never on a link
// declaring the registration being replaced (a run the coordinator sends as soon as it recorded
// the new registration may come before the registration's reply). Peers end the old links'
// streams themselves (PeerView); they are not cancelled by the sender.
TEST_F(TransportRegistration, SendsWaitForTheNewRegistrationAndGoOnLinksDeclaringIt) {
  const std::byte one[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  ASSERT_TRUE(a.transport().send(1, to_b, {11, 0, 0}, one, 4, absl::Now() + absl::Seconds(20)).ok());
  ASSERT_TRUE(b.transport().receive(0, "", {11, 0, 0}, start, absl::Now() + absl::Seconds(20)).ok());
  // A link's streams (three) all open when it is made; some may not have reached b yet.
  constexpr int kStreamsPerLink = 3;
  EXPECT_GE(b.declared()["1"], 1);

  a.transport().begin_registration();
  const absl::Status held = a.transport().send(1, to_b, {12, 0, 0}, one, 4, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(held.code(), absl::StatusCode::kDeadlineExceeded) << held;
  EXPECT_THAT(std::string(held.message()), AllOf(HasSubstr("device 0 to register again"), HasSubstr("device 1")));

  absl::Status sent;
  std::thread sender([&] { sent = a.transport().send(1, to_b, {13, 0, 0}, one, 4, absl::Now() + absl::Seconds(20)); });
  // Declared only once the send is held, so that the release is what this exercises (a declare
  // before the sender blocked would let it through without a wait).
  const bool was_held = until_held(a.transport(), 1);
  a.transport().declare(7, 2);
  sender.join();
  ASSERT_TRUE(was_held);
  ASSERT_TRUE(sent.ok()) << sent;
  expect_four_bytes(b.transport(), {13, 0, 0}, start, one);
  // The message of the new registration came on a new link declaring it; no stream declaring
  // incarnation 1 opened but the first link's, and op 12's message never went out.
  std::map<std::string, int> declared = b.declared();
  EXPECT_GE(declared["2"], 1);
  EXPECT_LE(declared["1"], kStreamsPerLink);
  EXPECT_EQ(declared.size(), 2u);
  EXPECT_EQ(b.transport().pending_messages(), 0);
  for (uint64_t op : {11, 12, 13}) b.transport().finish_op(op);
}

// Issue #17, the review of session 30: a held send ignored its run's cancel flag (the run's
// thread, and a SIGTERM's drain behind it, waited for the run's deadline). Now the held send
// of a cancelled run returns CANCELLED, naming its op and peer, long before its deadline.
TEST_F(TransportRegistration, AHeldSendOfACancelledRunReturnsCancelled) {
  const std::byte one[4] = {std::byte{1}, std::byte{2}, std::byte{3}, std::byte{4}};
  a.transport().begin_registration();
  std::atomic<bool> cancelled{false};
  absl::Status sent;
  std::thread sender([&] {
    sent = a.transport().send(1, to_b, {21, 0, 0}, one, 4, absl::Now() + absl::Seconds(30), nullptr,
                              [&] { return cancelled.load(); });
  });
  const bool was_held = until_held(a.transport(), 1);
  cancelled = true;
  sender.join();
  ASSERT_TRUE(was_held);
  // Before: DEADLINE_EXCEEDED after 30 s.
  EXPECT_EQ(sent.code(), absl::StatusCode::kCancelled) << sent;
  EXPECT_THAT(std::string(sent.message()),
              AllOf(HasSubstr("op 21 was cancelled"), HasSubstr("device 1"), HasSubstr("device 0 to register again")));
  EXPECT_EQ(a.transport().held_sends(), 0);
  EXPECT_EQ(b.declared().size(), 0u);  // nothing went out
}

// Issue #17, the review of session 30: a RegisterWorker that failed left the hold on for good.
// Now end_registration (what a failed attempt, or a stopping registration, calls) lets the held
// send go on under the registration declared before: it arrives, on a stream declaring it.
TEST_F(TransportRegistration, AFailedRegistrationLetsHeldSendsGoOnUnderTheOldOne) {
  const std::byte one[4] = {std::byte{5}, std::byte{6}, std::byte{7}, std::byte{8}};
  a.transport().begin_registration();
  absl::Status sent;
  std::thread sender([&] { sent = a.transport().send(1, to_b, {31, 0, 0}, one, 4, absl::Now() + absl::Seconds(30)); });
  const bool was_held = until_held(a.transport(), 1);
  a.transport().end_registration();
  sender.join();
  ASSERT_TRUE(was_held);
  ASSERT_TRUE(sent.ok()) << sent;  // before: DEADLINE_EXCEEDED after 30 s
  expect_four_bytes(b.transport(), {31, 0, 0}, start, one);
  std::map<std::string, int> declared = b.declared();
  EXPECT_GE(declared["1"], 1);
  EXPECT_EQ(declared.size(), 1u);  // only the old registration's streams
  // The next registration holds sends again.
  a.transport().begin_registration();
  EXPECT_EQ(a.transport().send(1, to_b, {32, 0, 0}, one, 4, absl::Now() + absl::Milliseconds(200)).code(),
            absl::StatusCode::kDeadlineExceeded);
  b.transport().finish_op(31);
}

}  // namespace
}  // namespace tessera

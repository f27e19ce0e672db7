// Bad input from the wire: raw, malformed messages sent straight to a worker and the
// coordinator get precise errors, and nothing else is disturbed.
#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/credentials.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"
#include "tests/support/exchange_stream.h"

namespace tessera {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

class WireValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The raw stubs present the cluster's own credential, as a (broken) daemon would: what is
    // tested here is the validation behind the credential check (tests/faults/auth_test.cc
    // tests the check).
    absl::StatusOr<Credentials> credentials = generate_credentials();
    ASSERT_TRUE(credentials.ok());
    const std::string dir = absl::StrCat(::testing::TempDir(), "/wire-validation-credentials-", getpid());
    ASSERT_TRUE(write_credentials(dir, *credentials).ok());
    LocalOptions options;
    options.credentials_dir = dir;
    absl::StatusOr<Client> client = Client::local(2, options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_.emplace(*std::move(client));
    absl::StatusOr<std::vector<Device>> devices = client_->devices();
    ASSERT_TRUE(devices.ok());
    credentials_ = *credentials;
    devices_ = *devices;
    auto identity = std::make_shared<CallIdentity>(credentials->cluster);
    worker_ = pb::Worker::NewStub(make_channel((*devices)[0].address, identity));
    coordinator_ = pb::Coordinator::NewStub(make_channel(client_->coordinator_address(), identity));
    absl::StatusOr<Mesh> mesh = client_->make_mesh({2}, {"x"});
    ASSERT_TRUE(mesh.ok());
    absl::StatusOr<Array> kept = client_->device_put(kept_values_, NamedSharding(*mesh, P("x")));
    ASSERT_TRUE(kept.ok()) << kept.status();
    kept_.emplace(*std::move(kept));
  }

  void TearDown() override {
    // Whatever was thrown at the worker, the array it held is intact and it still serves.
    absl::StatusOr<HostArray> back = kept_->fetch();
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == kept_values_);
  }

  // Sends `chunks` as one PutShard stream; returns the worker's answer.
  grpc::Status put(const std::vector<pb::ShardChunk>& chunks) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::PutShardReply reply;
    auto writer = worker_->PutShard(&ctx, &reply);
    for (const pb::ShardChunk& c : chunks) {
      if (!writer->Write(c)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  static pb::ShardChunk header(uint64_t id, int dtype, std::vector<int64_t> dims, std::string data = "") {
    pb::ShardChunk c;
    c.mutable_header()->set_buffer_id(id);
    c.mutable_header()->set_dtype(static_cast<pb::DType>(dtype));
    for (int64_t d : dims) c.mutable_header()->mutable_shape()->add_dims(d);
    c.set_data(std::move(data));
    return c;
  }
  static pb::ShardChunk data(std::string bytes) {
    pb::ShardChunk c;
    c.set_data(std::move(bytes));
    return c;
  }

  const HostArray kept_values_ = HostArray::arange(DType::kI64, {64});
  Credentials credentials_;
  std::vector<Device> devices_;
  std::optional<Client> client_;
  std::optional<Array> kept_;
  std::unique_ptr<pb::Worker::Stub> worker_;
  std::unique_ptr<pb::Coordinator::Stub> coordinator_;
};

void expect_error(const grpc::Status& s, grpc::StatusCode code, std::vector<std::string> parts) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  for (const std::string& p : parts) EXPECT_THAT(s.error_message(), HasSubstr(p));
}

TEST_F(WireValidationTest, PutShardWithoutHeader) {
  expect_error(put({data("abcd")}), grpc::StatusCode::INVALID_ARGUMENT, {"first message", "header"});
}

TEST_F(WireValidationTest, PutShardWithUnknownDtype) {
  expect_error(put({header(1000, 77, {1})}), grpc::StatusCode::INVALID_ARGUMENT, {"dtype 77"});
}

TEST_F(WireValidationTest, PutShardWithNegativeDimension) {
  expect_error(put({header(1000, pb::F32, {4, -2})}), grpc::StatusCode::INVALID_ARGUMENT, {"dimension 1", "negative"});
}

TEST_F(WireValidationTest, PutShardWithOverflowingShape) {
  expect_error(put({header(1000, pb::F64, {1LL << 40, 1LL << 30})}), grpc::StatusCode::INVALID_ARGUMENT, {"too large"});
}

TEST_F(WireValidationTest, PutShardLargerThanDeviceMemory) {
  expect_error(put({header(1000, pb::F32, {1LL << 40})}), grpc::StatusCode::RESOURCE_EXHAUSTED,
               {"4398046511104 bytes"});
}

TEST_F(WireValidationTest, PutShardWithTooMuchData) {
  expect_error(put({header(1000, pb::I32, {2}, std::string(8, 'x')), data("y")}), grpc::StatusCode::INVALID_ARGUMENT,
               {"more data", "(2,)", "8 bytes"});
}

TEST_F(WireValidationTest, PutShardWithTooLittleData) {
  expect_error(put({header(1000, pb::I32, {4}, std::string(8, 'x'))}), grpc::StatusCode::INVALID_ARGUMENT,
               {"received 8 bytes", "needs 16"});
}

TEST_F(WireValidationTest, PutShardWithOversizedChunk) {
  expect_error(put({header(1000, pb::F32, {1 << 20}, std::string((1 << 20) + 1, 'x'))}),
               grpc::StatusCode::INVALID_ARGUMENT, {"1048577 bytes", "limit is 1048576"});
}

TEST_F(WireValidationTest, PutShardWithRepeatedHeader) {
  expect_error(put({header(1000, pb::I32, {2}, std::string(4, 'x')), header(1000, pb::I32, {2})}),
               grpc::StatusCode::INVALID_ARGUMENT, {"repeats the header"});
}

TEST_F(WireValidationTest, PutShardOverAnExistingBuffer) {
  expect_error(put({header(kept_->id(), pb::I64, {32}, std::string(256, 'x'))}), grpc::StatusCode::ALREADY_EXISTS,
               {"already exists"});
}

TEST_F(WireValidationTest, FailedPutsLeaveNoReservation) {
  put({header(1000, pb::I32, {1 << 18}, std::string(8, 'x'))});
  absl::StatusOr<DeviceStats> stats = client_->device_stats(0);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->buffer_count, 1);
  EXPECT_EQ(stats->bytes_used, 32 * 8);
  // And the id is free again: a correct upload under it succeeds.
  EXPECT_TRUE(put({header(1000, pb::I32, {2}, std::string(8, 'x'))}).ok());
}

// Issue #17: a put's fan-out runs under op id buffer id | 2^63 (Transfers::kFanOutOpBit), so
// buffer id 2^63 - 1 made op 2^64 - 1, whose range [op, op + 1) is empty: the members' claim of
// the op (Transport::begin_run_ops) and its end (finish_op) did nothing. And an id with bit 63
// shares its op with the id without it. Both are refused before anything runs, naming the id
// and the rule (before, the uploader ran the broadcast). The members' addresses carry the
// coordinator's grants, so only the id is wrong.
TEST_F(WireValidationTest, PutShardFanOutOfABufferIdWithoutItsOwnOpId) {
  const Authenticator auth(credentials_);
  for (uint64_t id : {(uint64_t{1} << 63) - 1, (uint64_t{1} << 63) | 1000}) {
    SCOPED_TRACE(absl::StrCat("buffer ", id));
    pb::ShardChunk chunk = header(id, pb::F32, {4}, std::string(16, 'x'));
    pb::ShardFanOut* f = chunk.mutable_header()->mutable_fan_out();
    f->set_run_tag(0x5eed);
    f->set_timeout_ms(2000);
    for (int d : {0, 1}) {
      pb::PeerAddress* member = f->add_members();
      member->set_device_id(devices_[d].id);
      member->set_address(devices_[d].address);
      member->set_grant(auth.address_grant(id, devices_[d].id, devices_[d].address));
    }
    expect_error(put({chunk}), grpc::StatusCode::INVALID_ARGUMENT,
                 {absl::StrCat("PutShard: the fan-out of buffer ", id,
                               " runs under op id buffer id | 2^63, so its buffer id must be below 2^63 - 1 "
                               "(9223372036854775807)")});
  }
}

TEST_F(WireValidationTest, GetShardOfUnknownBuffer) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  pb::GetShardRequest req;
  req.set_buffer_id(987654);
  auto reader = worker_->GetShard(&ctx, req);
  pb::ShardChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  expect_error(reader->Finish(), grpc::StatusCode::NOT_FOUND, {"buffer 987654"});
}

TEST_F(WireValidationTest, HandshakeWithAnotherProtocolVersion) {
  for (bool to_worker : {true, false}) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::HandshakeRequest req;
    req.set_protocol_version(999);
    req.set_peer("old client");
    pb::HandshakeReply reply;
    grpc::Status s = to_worker ? worker_->Handshake(&ctx, req, &reply) : coordinator_->Handshake(&ctx, req, &reply);
    // gRPC drops the reply body of a failed call: the message carries both versions.
    expect_error(s, grpc::StatusCode::FAILED_PRECONDITION,
                 {"version 999", absl::StrCat("version ", kProtocolVersion), "old client"});
  }
}

TEST_F(WireValidationTest, RegisterWorkerWithAnotherProtocolVersion) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  pb::RegisterWorkerRequest req = worker_request("w", "127.0.0.1:1", -1, 1);
  req.set_protocol_version(0);
  pb::RegisterWorkerReply reply;
  expect_error(coordinator_->RegisterWorker(&ctx, req, &reply), grpc::StatusCode::FAILED_PRECONDITION,
               {"version 0", "127.0.0.1:1"});
}

TEST_F(WireValidationTest, CreateArrayWithMalformedMesh) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  pb::CreateArrayRequest req;
  req.set_dtype(pb::F32);
  req.mutable_shape()->add_dims(4);
  pb::Mesh* mesh = req.mutable_sharding()->mutable_mesh();
  mesh->add_shape(2);
  mesh->add_axis_names("x");
  mesh->add_device_ids(1);
  mesh->add_device_ids(1);
  pb::CreateArrayReply reply;
  expect_error(coordinator_->CreateArray(&ctx, req, &reply), grpc::StatusCode::INVALID_ARGUMENT,
               {"device 1 appears twice"});
}

TEST_F(WireValidationTest, CreateArrayWithSpecNotFittingTheShape) {
  grpc::ClientContext ctx;
  set_deadline(&ctx, absl::Seconds(10));
  pb::CreateArrayRequest req;
  req.set_dtype(pb::F32);
  req.mutable_shape()->add_dims(3);
  pb::Mesh* mesh = req.mutable_sharding()->mutable_mesh();
  mesh->add_shape(2);
  mesh->add_axis_names("x");
  mesh->add_device_ids(0);
  mesh->add_device_ids(1);
  req.mutable_sharding()->mutable_spec()->add_dims()->add_axes("x");
  pb::CreateArrayReply reply;
  expect_error(coordinator_->CreateArray(&ctx, req, &reply), grpc::StatusCode::INVALID_ARGUMENT,
               {"dimension 0 of size 3", "'x' of size 2"});
}

// An id this coordinator never handed out is NOT_FOUND; one below its epoch (the first id it
// handed out, in the handshake) is an earlier incarnation's: ABORTED, adopt or put it again.
TEST_F(WireValidationTest, GetArrayOfUnknownId) {
  pb::HandshakeRequest hello;
  hello.set_protocol_version(kProtocolVersion);
  pb::HandshakeReply epoch;
  {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    ASSERT_TRUE(coordinator_->Handshake(&ctx, hello, &epoch).ok());
  }
  ASSERT_GT(epoch.epoch(), 123456u);
  const uint64_t never = epoch.epoch() + (uint64_t{1} << 40);
  for (const auto& [id, code, words] : {std::tuple{never, grpc::StatusCode::NOT_FOUND, std::string("does not exist")},
                                        std::tuple{uint64_t{123456}, grpc::StatusCode::ABORTED,
                                                   std::string("earlier incarnation of the coordinator")}}) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::GetArrayRequest req;
    req.set_array_id(id);
    pb::GetArrayReply reply;
    expect_error(coordinator_->GetArray(&ctx, req, &reply), code, {absl::StrCat("array ", id), words});
  }
}

}  // namespace
}  // namespace tessera

// A replicated or partly replicated device_put sends each distinct block from the client once
// (docs/design.md, "Data path"): in process the block is copied once into a buffer all its
// devices share; over TCP it goes to one replica, which broadcasts it to the others (a fan-out,
// ShardHeader.fan_out). Every device's own copy of its block is read back (Shard::data, not
// fetch, which reads one replica per block) and compared with the host array's block, sliced
// here by plain loops; the bytes the workers received from the client and from their peers are
// counted through GetStats.
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/handoff.h"
#include "gmock/gmock.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

// The block `index` of row-major `host`, element by element (an odometer over the block).
std::vector<int32_t> host_block(const HostArray& host, const Index& index) {
  const Shape& shape = host.shape();
  const int rank = static_cast<int>(shape.size());
  std::vector<int64_t> at(rank);
  for (int d = 0; d < rank; ++d) at[d] = index[d].start;
  std::vector<int32_t> out;
  while (true) {
    int64_t flat = 0;
    for (int d = 0; d < rank; ++d) flat = flat * shape[d] + at[d];
    out.push_back(host.values<int32_t>()[flat]);
    int d = rank - 1;
    while (d >= 0 && ++at[d] == index[d].stop) {
      at[d] = index[d].start;
      --d;
    }
    if (d < 0) return out;
  }
}

// Distinct values everywhere, so a block from the wrong place cannot pass.
HostArray numbered(const Shape& shape) {
  HostArray x(DType::kI32, shape);
  for (int64_t i = 0; i < x.size(); ++i) x.mutable_values<int32_t>()[i] = static_cast<int32_t>(i * 7919 + 13);
  return x;
}

struct Case {
  std::vector<int64_t> mesh_shape;
  std::vector<std::string> axes;
  PartitionSpec spec;
  Shape shape;
  int64_t distinct_blocks;
};

// Every block at least 256 KiB (client/transfer.h's kFanOutMinBytes), so that the TCP cluster
// fans them out, and one small replicated array, which goes to each replica from the client.
std::vector<Case> cases() {
  return {
      {{8}, {"x"}, P(), {256, 512}, 1},    // 512 KiB, 8 copies
      {{8}, {"x"}, P(), {1024, 1024}, 1},  // 4 MiB: a stream of several chunks, a chain of several
      {{8}, {"x"}, P(), {2048, 3072}, 1},  // 24 MiB: more chunks than the chain's window (engine.cc)
      {{4, 2}, {"data", "model"}, P("data", None), {512, 1024}, 4},       // 2 replicas a block
      {{2, 4}, {"data", "model"}, P("data", None), {256, 1024}, 2},       // 4 replicas a block
      {{2, 2, 2}, {"a", "b", "c"}, P("a", None, "c"), {8, 64, 1024}, 4},  // 3-D, 'b' replicates
      {{2, 2, 2}, {"a", "b", "c"}, P(None, "b", None), {4, 6, 10}, 2},    // small: no fan-out
  };
}

int64_t block_bytes(const Case& c) { return num_elements(c.shape) * 4 / c.distinct_blocks; }

void expect_every_copy_equal(const Array& a, const HostArray& host) {
  absl::StatusOr<HostArray> whole = a.fetch();
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_TRUE(*whole == host);
  for (const Shard& s : a.addressable_shards()) {
    SCOPED_TRACE(absl::StrCat("device ", s.device_id(), " block ", index_to_string(s.index())));
    absl::StatusOr<HostArray> got = s.data();
    ASSERT_TRUE(got.ok()) << got.status();
    const std::vector<int32_t> want = host_block(host, s.index());
    ASSERT_EQ(got->size(), static_cast<int64_t>(want.size()));
    for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(got->values<int32_t>()[i], want[i]) << "element " << i;
  }
}

struct Counts {
  int64_t put = 0, fanned_out = 0;
};
Counts counts(const Client& client) {
  Counts c;
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<DeviceStats> s = client.device_stats(d);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) continue;
    c.put += s->bytes_put;
    c.fanned_out += s->bytes_fanned_out;
  }
  return c;
}

// Over TCP: the workers received each distinct block from the client once, and every other
// replica's bytes from their peers.
TEST(ReplicatedPut, OverTcpEachDistinctBlockLeavesTheClientOnce) {
  LocalOptions options;
  options.in_process = false;
  options.shared_memory = false;  // the client's streams (shm_transfer_test covers the other path)
  absl::StatusOr<Client> client = Client::local(8, options);
  ASSERT_TRUE(client.ok()) << client.status();
  for (const Case& c : cases()) {
    const PartitionSpec& spec = c.spec;
    SCOPED_TRACE(absl::StrCat(spec.to_string(), " on a mesh of ", c.mesh_shape.size(), " axes"));
    absl::StatusOr<Mesh> mesh = client->make_mesh(c.mesh_shape, c.axes);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const HostArray host = numbered(c.shape);
    const Counts before = counts(*client);
    absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, spec));
    ASSERT_TRUE(a.ok()) << a.status();
    const Counts after = counts(*client);
    const int64_t replicas = 8 / c.distinct_blocks;
    if (block_bytes(c) >= (256 << 10)) {
      EXPECT_EQ(after.put - before.put, host.nbytes());
      EXPECT_EQ(after.fanned_out - before.fanned_out, host.nbytes() * (replicas - 1));
    } else {
      EXPECT_EQ(after.put - before.put, host.nbytes() * replicas);
      EXPECT_EQ(after.fanned_out - before.fanned_out, 0);
    }
    expect_every_copy_equal(*a, host);
  }
}

// The uploader forwards the block while the upload still streams in (docs/design.md, "Data
// path"): when the last byte of a 24 MiB block arrived from the client, it had already handed
// the broadcast everything before the client's last message (at most kMaxChunkBytes, 1 MiB).
// Read from the put's timeline: the uploader's put_shard span says how many bytes it had
// forwarded then (forwarded_before_last_byte). Receiving the whole block before broadcasting
// it, as the fan-out first did, reads 0.
TEST(ReplicatedPut, OverTcpTheUploaderForwardsBeforeTheUploadEnds) {
  LocalOptions options;
  options.in_process = false;
  options.shared_memory = false;  // the client's streams (shm_transfer_test covers the other path)
  absl::StatusOr<Client> client = Client::local(8, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({8}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = numbered({2048, 3072});
  const std::string path = ::testing::TempDir() + "/replicated_put_forwarding.json";
  ASSERT_TRUE(client->start_profile().ok());
  absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, P()));
  ASSERT_TRUE(a.ok()) << a.status();
  const absl::Status stopped = client->stop_profile(path);
  ASSERT_TRUE(stopped.ok()) << stopped;

  std::ifstream in(path, std::ios::binary);
  std::stringstream json;
  json << in.rdbuf();
  google::protobuf::Struct root;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json.str(), &root).ok());
  std::vector<int64_t> forwarded;  // one per uploader
  for (const google::protobuf::Value& v : root.fields().at("traceEvents").list_value().values()) {
    const auto& f = v.struct_value().fields();
    if (f.count("name") == 0 || f.at("name").string_value() != "put_shard" || f.count("args") == 0) continue;
    const auto& args = f.at("args").struct_value().fields();
    auto it = args.find("forwarded_before_last_byte");
    if (it == args.end()) continue;
    int64_t bytes = -1;
    EXPECT_TRUE(absl::SimpleAtoi(it->second.string_value(), &bytes)) << it->second.string_value();
    forwarded.push_back(bytes);
  }
  ASSERT_EQ(forwarded.size(), 1u) << "one block, one uploader";
  EXPECT_GE(forwarded[0], host.nbytes() - (1 << 20));
  EXPECT_LT(forwarded[0], host.nbytes());
  expect_every_copy_equal(*a, host);
}

// A fan-out member that cannot take the block fails the put with its reservation's error,
// naming the member once: the client names the device it called, and the worker does not name
// itself again (the message used to read "device_put: device 3 (...): device 3: shard ...").
// Device 3 alone holds 768 KiB of its 1 MiB first, so the 512 KiB replicated block fits
// everywhere else; the free bytes in the message are the host's arithmetic, 1 MiB - 768 KiB.
TEST(ReplicatedPut, AMemberWithoutRoomFailsThePutNamingItOnce) {
  LocalOptions options;
  options.in_process = false;
  options.shared_memory = false;  // the client's streams (shm_transfer_test covers the other path)
  options.memory_bytes_per_device = 1 << 20;
  absl::StatusOr<Client> client = Client::local(8, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> just_3 = client->make_mesh({1}, {"x"}, std::vector<int>{3});
  ASSERT_TRUE(just_3.ok()) << just_3.status();
  absl::StatusOr<Array> filler = client->device_put(numbered({192, 1024}), NamedSharding(*just_3, P()));
  ASSERT_TRUE(filler.ok()) << filler.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({8}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  absl::StatusOr<Array> a = client->device_put(numbered({256, 512}), NamedSharding(*mesh, P()));
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
  EXPECT_THAT(std::string(a.status().message()),
              ::testing::MatchesRegex("device_put: device 3 \\(127\\.0\\.0\\.1:[0-9]+\\): shard i32\\[256,512\\]: "
                                      "buffer [0-9]+ needs 524288 bytes but only "
                                      "262144 of the device's 1048576 bytes are free"));
}

// In process: the client copies each distinct block once (one handoff deposit) and every
// replica's device takes that buffer.
TEST(ReplicatedPut, InProcessEachDistinctBlockIsCopiedOnce) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.spec.to_string());
    absl::StatusOr<Mesh> mesh = client->make_mesh(c.mesh_shape, c.axes);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const HostArray host = numbered(c.shape);
    const int64_t deposited = Handoff::deposited(), taken = Handoff::taken();
    absl::StatusOr<Array> a = client->device_put(host, NamedSharding(*mesh, c.spec));
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(Handoff::deposited() - deposited, c.distinct_blocks);
    EXPECT_EQ(Handoff::taken() - taken, 8);
    expect_every_copy_equal(*a, host);
  }
}

}  // namespace
}  // namespace tessera

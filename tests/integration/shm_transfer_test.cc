// Co-located transfers (docs/design.md, "Co-located clients"): a Client::connect client on the
// workers' host has the worker read a put's contiguous block from its memory and write a
// fetch's there (a header-only memfd naming the place: ShmSegment::create_direct), puts other
// blocks through a memfd of its own, sealed, whose pages every replica's worker adopts as its
// buffer (a private mapping, no copy), or unsealed, copied out, and fetches them through a
// memfd the worker writes once (core/shm_transfer.h); workers started with
// --shm_client_memory=false get every block through the memfd; a client that turns it off, or
// workers started with --shm_transfers=false, stream over gRPC. Real
// tessera-worker and tessera-coordinator processes on 127.0.0.1; the path taken is read from
// the workers' own counters (GetStats: shm_bytes_put, shm_bytes_fetched) and their
// /proc/<pid>/maps (an adopted buffer is a mapping of memfd:tessera-transfer), and the values
// from the host array, checked element by element against the formula that made them.
#include "core/shm_transfer.h"

#include <fcntl.h>
#include <linux/sched.h>  // struct clone_args
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/auth.h"
#include "proto/rpc.h"
#include "proto/tessera.grpc.pb.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// Element i of every array here: distinct values, so a block from the wrong place cannot pass.
int32_t value_at(int64_t i) { return static_cast<int32_t>(i * 7919 + 13); }

HostArray numbered(const Shape& shape) {
  HostArray x(DType::kI32, shape);
  for (int64_t i = 0; i < x.size(); ++i) x.mutable_values<int32_t>()[i] = value_at(i);
  return x;
}

// The 2-D block `index` of an array of `cols` columns made by numbered(), by plain loops.
void expect_block(const HostArray& got, const Index& index, int64_t cols) {
  ASSERT_EQ(got.shape(), (Shape{index[0].stop - index[0].start, index[1].stop - index[1].start}));
  int64_t k = 0;
  for (int64_t r = index[0].start; r < index[0].stop; ++r) {
    for (int64_t c = index[1].start; c < index[1].stop; ++c, ++k) {
      ASSERT_EQ(got.values<int32_t>()[k], value_at(r * cols + c)) << "row " << r << " column " << c;
    }
  }
}

struct Counts {
  int64_t put = 0, shm_put = 0, fetched = 0, shm_fetched = 0, fanned_out = 0;
  // Of shm_put and shm_fetched: read from, or written into, the client's own memory.
  int64_t memory_read = 0, memory_written = 0;
};

Counts counts(const Client& client, int devices) {
  Counts c;
  for (int d = 0; d < devices; ++d) {
    absl::StatusOr<DeviceStats> s = client.device_stats(d);
    EXPECT_TRUE(s.ok()) << s.status();
    if (!s.ok()) continue;
    c.put += s->bytes_put;
    c.shm_put += s->shm_bytes_put;
    c.fetched += s->bytes_fetched;
    c.shm_fetched += s->shm_bytes_fetched;
    c.fanned_out += s->bytes_fanned_out;
    c.memory_read += s->client_memory_bytes_read;
    c.memory_written += s->client_memory_bytes_written;
  }
  return c;
}

// The fds of process `pid` that are transfer memfds (what a leaked segment would be).
int transfer_memfds_open(pid_t pid) {
  int n = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), error)) {
    std::error_code link_error;
    const std::string target = std::filesystem::read_symlink(entry.path(), link_error).string();
    if (target.find("memfd:tessera-transfer") != std::string::npos) ++n;
  }
  return n;
}

// The mappings of transfer memfds in process `pid` (/proc/<pid>/maps): a worker's adopted
// buffers, one each.
int transfer_memfds_mapped(pid_t pid) {
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  EXPECT_TRUE(maps.good()) << "cannot read /proc/" << pid << "/maps";
  int n = 0;
  for (std::string line; std::getline(maps, line);) {
    if (line.find("/memfd:tessera-transfer") != std::string::npos) ++n;
  }
  return n;
}

class ShmTransferTest : public ::testing::Test {
 protected:
  // A coordinator and 4 workers; `worker_flags` for every worker.
  void start(const std::vector<std::string>& worker_flags = {}) {
    std::vector<std::string> flags = {"--memory_bytes=268435456"};
    flags.insert(flags.end(), worker_flags.begin(), worker_flags.end());
    absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(TESSERA_BIN_DIR, 4, {}, flags);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }
  Client connect(bool shared_memory, bool adopt_puts = false) {
    ConnectOptions options;
    options.min_devices = 4;
    options.timeout = absl::Seconds(20);
    options.shared_memory = shared_memory;
    options.adopt_puts = adopt_puts;
    absl::StatusOr<Client> client = Client::connect(cluster_.address, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  // Puts and fetches every layout on `client`; checks every device's block, the whole array
  // fetched, that the workers took (shm) or did not take the shared-memory path, and that they
  // adopted the client's memfds (`adopted`: ConnectOptions::adopt_puts) or copied them out.
  void round_trips(const Client& client, bool shm, bool adopted = false) {
    absl::StatusOr<Mesh> mesh = client.make_mesh({2, 2}, {"a", "b"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    struct Case {
      PartitionSpec spec;
      Shape shape;
      int64_t replicas;  // of each block
    };
    // Contiguous blocks, column blocks (gathered on the client, scattered back), a replicated
    // block large enough to be fanned out by the workers (client/transfer.h's kFanOutMinBytes)
    // and a small one sent to each replica, 3 MiB blocks (several gRPC chunks when streamed).
    const std::vector<Case> cases = {{P("a", "b"), {64, 96}, 1},
                                     {P(None, Axes{"a", "b"}), {40, 128}, 1},
                                     {P("a", None), {512, 1024}, 2},
                                     {P(), {8, 24}, 4},
                                     {P(Axes{"a", "b"}, None), {4096, 768}, 1},
                                     // Odd sizes, contiguous blocks (read where they are in the
                                     // host array: ShmSegment::create_direct), one replicated.
                                     {P(Axes{"a", "b"}, None), {4 * 333, 77}, 1},
                                     {P("a", None), {2 * 1001, 3}, 2},
                                     {P(), {1, 12345}, 4}};
    for (const Case& c : cases) {
      SCOPED_TRACE(absl::StrCat(c.spec.to_string(), " of ", shape_to_string(c.shape)));
      const HostArray host = numbered(c.shape);
      ASSERT_TRUE(client.flush_deletes().ok());  // the last case's array is gone, and its mappings
      const Counts before = counts(client, 4);
      absl::StatusOr<Array> a = client.device_put(host, NamedSharding(*mesh, c.spec));
      ASSERT_TRUE(a.ok()) << a.status();
      const Counts put = counts(client, 4);
      // Adopted, each device's buffer is the client's memfd mapped (one device per worker, one
      // shard per device); copied out or streamed, an ordinary allocation.
      for (const auto& w : cluster_.workers) {
        EXPECT_EQ(transfer_memfds_mapped(w->pid()), adopted ? 1 : 0) << "worker " << w->pid();
      }
      // Through shared memory every replica's worker reads the block from the client's one
      // memfd; streamed, a block of 256 KiB or more goes to one replica, which fans it out.
      const int64_t block_bytes = host.nbytes() * c.replicas / 4;
      const bool fan_out = !shm && c.replicas > 1 && block_bytes >= (256 << 10);
      const int64_t from_client = put.put - before.put;
      EXPECT_EQ(from_client, host.nbytes() * (fan_out ? 1 : c.replicas));
      EXPECT_EQ(put.fanned_out - before.fanned_out, fan_out ? host.nbytes() * (c.replicas - 1) : 0);
      EXPECT_EQ(put.shm_put - before.shm_put, shm ? from_client : 0);

      absl::StatusOr<HostArray> whole = a->fetch();
      ASSERT_TRUE(whole.ok()) << whole.status();
      expect_block(*whole, {{0, c.shape[0]}, {0, c.shape[1]}}, c.shape[1]);
      const Counts fetched = counts(client, 4);
      EXPECT_EQ(fetched.fetched - put.fetched, host.nbytes());  // each distinct block once
      EXPECT_EQ(fetched.shm_fetched - put.shm_fetched, shm ? host.nbytes() : 0);
      for (const Shard& s : a->addressable_shards()) {
        SCOPED_TRACE(absl::StrCat("device ", s.device_id(), " block ", index_to_string(s.index())));
        absl::StatusOr<HostArray> block = s.data();
        ASSERT_TRUE(block.ok()) << block.status();
        expect_block(*block, s.index(), c.shape[1]);
      }
    }
    for (const auto& w : cluster_.workers) EXPECT_EQ(transfer_memfds_open(w->pid()), 0) << "worker " << w->pid();
    // Every array deleted: no buffer, no byte charged, no mapping left on any worker.
    ASSERT_TRUE(client.flush_deletes().ok());
    for (int d = 0; d < 4; ++d) {
      absl::StatusOr<DeviceStats> s = client.device_stats(d);
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->buffer_count, 0) << "device " << d;
      EXPECT_EQ(s->bytes_used, 0) << "device " << d;
    }
    for (const auto& w : cluster_.workers) {
      EXPECT_EQ(transfer_memfds_mapped(w->pid()), 0) << "worker " << w->pid();
    }
    // The client keeps the memfds of transfers that went well for the next ones (bounded:
    // client/transfer.cc's SegmentPool keeps at most 64); an adopted put's went to the workers.
    EXPECT_LE(transfer_memfds_open(getpid()), 64) << "this client";
  }

  ProcessCluster cluster_;
};

TEST_F(ShmTransferTest, CoLocatedPutsAndFetchesGoThroughSharedMemory) {
  start();
  const Client client = connect(/*shared_memory=*/true);
  round_trips(client, /*shm=*/true);
  // Again: now the blocks travel through the memfds the first round's transfers left to the
  // client's pool (fresh token, stale bytes beyond the block), and must arrive the same.
  round_trips(client, /*shm=*/true);
}

// ConnectOptions::adopt_puts: every put's memfd is sealed and becomes the workers' buffers
// (mapped, one per device, every replica of a block mapping the same memfd), unmapped when the
// arrays are deleted; fetches as before. Twice: the second round's fetches reuse pooled memfds,
// which puts never take.
TEST_F(ShmTransferTest, AdoptedPutsAreTheWorkersBuffers) {
  start();
  const Client client = connect(/*shared_memory=*/true, /*adopt_puts=*/true);
  round_trips(client, /*shm=*/true, /*adopted=*/true);
  round_trips(client, /*shm=*/true, /*adopted=*/true);
}

TEST_F(ShmTransferTest, AClientThatTurnsItOffStreams) {
  start();
  round_trips(connect(/*shared_memory=*/false), /*shm=*/false);
}

TEST_F(ShmTransferTest, WorkersWithoutItStream) {
  start({"--shm_transfers=false"});
  round_trips(connect(/*shared_memory=*/true), /*shm=*/false);
}

// Every dtype (core/dtype.h's kAllDTypes) through the direct fetch (and put) of contiguous
// blocks, odd sizes, one block per device and then replicated: the bytes fetched are the host
// array's, compared byte for byte (a transfer moves bytes: no value is computed on), and every
// one of them was read from, and written into, the client's own memory (the workers'
// client_memory_bytes_{read,written}: not the memfd fallback, which also counts as shm).
TEST_F(ShmTransferTest, EveryDTypeRoundTripsThroughTheClientsMemory) {
  start();
  const Client client = connect(/*shared_memory=*/true);
  absl::StatusOr<Mesh> mesh = client.make_mesh({4}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (const DType dtype : kAllDTypes) {
    for (const PartitionSpec& spec : {P("x", None), P()}) {
      SCOPED_TRACE(absl::StrCat(dtype_name(dtype), " ", spec.to_string()));
      HostArray host(dtype, {4 * 777, 3});
      for (int64_t i = 0; i < host.nbytes(); ++i) {
        // bool's bytes stay 0 or 1; every other dtype gets bytes that differ along the array.
        host.data()[i] = static_cast<std::byte>(dtype == DType::kBool ? (i * 7 / 3) % 2 : (i * 131 + 7) % 251);
      }
      const Counts before = counts(client, 4);
      absl::StatusOr<Array> a = client.device_put(host, NamedSharding(*mesh, spec));
      ASSERT_TRUE(a.ok()) << a.status();
      const Counts put = counts(client, 4);
      absl::StatusOr<HostArray> back = a->fetch();
      ASSERT_TRUE(back.ok()) << back.status();
      ASSERT_EQ(back->dtype(), dtype);
      ASSERT_EQ(back->shape(), host.shape());
      EXPECT_EQ(std::memcmp(back->data(), host.data(), static_cast<size_t>(host.nbytes())), 0);
      const Counts fetched = counts(client, 4);
      EXPECT_EQ(put.shm_put - before.shm_put, host.nbytes() * (spec == P() ? 4 : 1));
      EXPECT_EQ(put.memory_read - before.memory_read, host.nbytes() * (spec == P() ? 4 : 1));
      EXPECT_EQ(fetched.shm_fetched - put.shm_fetched, host.nbytes());
      EXPECT_EQ(fetched.memory_written - put.memory_written, host.nbytes());
      ASSERT_TRUE(client.flush_deletes().ok());
    }
  }
}

// A worker of this build announces that it writes fetches into its clients' memory
// (HandshakeReply.writes_client_memory, which is what the client's direct fetches wait for: a
// worker of session 29's build refuses them INVALID_ARGUMENT, and does not announce it). A
// fetch that the worker refuses for a reason of its own (its destination is read-only memory:
// INVALID_ARGUMENT, "not writable memory") fails with that error, not the memfd's retry's (the
// client's copy out of the memfd would fail, INTERNAL), and leaves no fallback behind: the next
// fetch, into the same memory made writable, is written there (client_memory_bytes_written).
TEST_F(ShmTransferTest, AFetchIntoMemoryTheWorkerCannotWriteFailsWithItsReason) {
  start();
  const Client client = connect(/*shared_memory=*/true);
  absl::StatusOr<std::vector<Device>> devices = client.devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  {
    std::unique_ptr<pb::Worker::Stub> worker =
        pb::Worker::NewStub(make_channel((*devices)[0].address, std::make_shared<CallIdentity>("")));
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::HandshakeRequest req;
    req.set_protocol_version(kProtocolVersion);
    pb::HandshakeReply reply;
    const grpc::Status shook = worker->Handshake(&ctx, req, &reply);
    ASSERT_TRUE(shook.ok()) << shook.error_message();
    EXPECT_FALSE(reply.transfer_host().empty());
    EXPECT_TRUE(reply.writes_client_memory());
  }
  absl::StatusOr<Mesh> one = client.make_mesh({1}, {"x"}, std::vector<int>{0});
  ASSERT_TRUE(one.ok()) << one.status();
  const long page = sysconf(_SC_PAGESIZE);
  const HostArray host = numbered({2, page / 4});  // two pages of int32
  absl::StatusOr<Array> a = client.device_put(host, NamedSharding(*one, P()));
  ASSERT_TRUE(a.ok()) << a.status();
  auto* pages =
      static_cast<std::byte*>(mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(pages, MAP_FAILED);
  std::memset(pages, 0xee, 2 * page);
  ASSERT_EQ(mprotect(pages, 2 * page, PROT_READ), 0);
  const MutableHostView into{DType::kI32, host.shape(), pages};
  const absl::Status refused = a->fetch_into(into);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_THAT(
      refused.message(),
      HasSubstr(absl::StrCat("writing ", 2 * page, " bytes into process ", getpid(), "'s memory at 0x",
                             absl::Hex(reinterpret_cast<uintptr_t>(pages)),
                             ": Bad address (after 0 bytes: the range is not writable memory of the process)")));
  EXPECT_TRUE(std::all_of(pages, pages + 2 * page, [](std::byte b) { return b == std::byte{0xee}; }));
  ASSERT_EQ(mprotect(pages, 2 * page, PROT_READ | PROT_WRITE), 0);
  const Counts before = counts(client, 4);
  const absl::Status fetched = a->fetch_into(into);
  ASSERT_TRUE(fetched.ok()) << fetched;
  EXPECT_EQ(std::memcmp(pages, host.data(), static_cast<size_t>(host.nbytes())), 0);
  const Counts after = counts(client, 4);
  EXPECT_EQ(after.shm_fetched - before.shm_fetched, host.nbytes());
  EXPECT_EQ(after.memory_written - before.memory_written, host.nbytes());
  ASSERT_EQ(munmap(pages, 2 * page), 0);
}

// Workers started with --shm_client_memory=false neither read nor write a client's memory:
// a segment naming it is refused FAILED_PRECONDITION, naming the flag, with nothing read,
// reserved or written. The client's fallback: the first fetch and the first put of a
// contiguous block, each refused, are done again through a memfd, and so are all later ones
// (the shm counters count them), equal to the host's, in every layout. (The direct way, with
// the flag at its default, is every other test here.) The client's fallback flags are
// process-wide, one for puts and one for fetches: ctest runs each test in a process of its own.
TEST_F(ShmTransferTest, WorkersThatTakeNoClientMemoryGetEveryBlockThroughTheMemfd) {
  start({"--shm_client_memory=false"});
  const Client client = connect(/*shared_memory=*/true);
  absl::StatusOr<std::vector<Device>> devices = client.devices();
  ASSERT_TRUE(devices.ok()) << devices.status();
  std::unique_ptr<pb::Worker::Stub> worker =
      pb::Worker::NewStub(make_channel((*devices)[0].address, std::make_shared<CallIdentity>("")));
  constexpr int64_t kElements = 777;
  const HostArray host = numbered({1, kElements});
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(host.data(), host.nbytes());
    ASSERT_TRUE(segment.ok()) << segment.status();
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::PutShardReply reply;
    auto writer = worker->PutShard(&ctx, &reply);
    pb::ShardChunk chunk;
    chunk.mutable_header()->set_buffer_id(1001);
    chunk.mutable_header()->set_dtype(pb::I32);
    chunk.mutable_header()->mutable_shape()->add_dims(1);
    chunk.mutable_header()->mutable_shape()->add_dims(kElements);
    chunk.mutable_header()->mutable_shm()->set_pid(getpid());
    chunk.mutable_header()->mutable_shm()->set_fd(segment->fd());
    chunk.mutable_header()->mutable_shm()->set_token(segment->token());
    writer->Write(chunk);
    writer->WritesDone();
    const grpc::Status refused = writer->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("--shm_client_memory=false"));
  }
  // A fetch first, while no put has fallen back: column blocks are put gathered, through
  // memfds (no direct put is tried); each device's block fetched alone, into an array of its
  // own, is contiguous there: the client names that memory, is refused, and fetches again
  // through a memfd.
  {
    absl::StatusOr<Mesh> two = client.make_mesh({2}, {"x"}, std::vector<int>{0, 1});
    ASSERT_TRUE(two.ok()) << two.status();
    const HostArray columns = numbered({5, 2 * kElements});
    absl::StatusOr<Array> c = client.device_put(columns, NamedSharding(*two, P(None, "x")));
    ASSERT_TRUE(c.ok()) << c.status();
    const Counts before = counts(client, 4);
    for (const Shard& s : c->addressable_shards()) {
      SCOPED_TRACE(absl::StrCat("device ", s.device_id()));
      absl::StatusOr<HostArray> block = s.data();
      ASSERT_TRUE(block.ok()) << block.status();
      expect_block(*block, s.index(), 2 * kElements);
    }
    EXPECT_EQ(counts(client, 4).shm_fetched - before.shm_fetched, columns.nbytes());
  }
  ASSERT_TRUE(client.flush_deletes().ok());
  // A contiguous put: refused the direct way, then through a memfd.
  absl::StatusOr<Mesh> one = client.make_mesh({1}, {"x"}, std::vector<int>{0});
  ASSERT_TRUE(one.ok()) << one.status();
  const Counts before_put = counts(client, 4);
  std::optional<absl::StatusOr<Array>> a = client.device_put(host, NamedSharding(*one, P()));
  ASSERT_TRUE(a->ok()) << a->status();
  EXPECT_EQ(counts(client, 4).shm_put - before_put.shm_put, host.nbytes());
  {
    HostArray into(DType::kI32, {1, kElements});
    std::fill_n(into.mutable_values<int32_t>().data(), kElements, -1);
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(into.data(), into.nbytes());
    ASSERT_TRUE(segment.ok()) << segment.status();
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::GetShardRequest req;
    req.set_buffer_id((*a)->id());
    req.mutable_shm()->set_pid(getpid());
    req.mutable_shm()->set_fd(segment->fd());
    req.mutable_shm()->set_token(segment->token());
    auto reader = worker->GetShard(&ctx, req);
    pb::ShardChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    const grpc::Status refused = reader->Finish();
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << refused.error_message();
    EXPECT_THAT(refused.error_message(), HasSubstr("--shm_client_memory=false"));
    EXPECT_EQ(std::count(into.values<int32_t>().begin(), into.values<int32_t>().end(), -1), kElements);
  }
  // The same array fetched by the client (through a memfd now, at once).
  absl::StatusOr<HostArray> back = (*a)->fetch();
  ASSERT_TRUE(back.ok()) << back.status();
  expect_block(*back, {{0, 1}, {0, kElements}}, kElements);
  a.reset();
  round_trips(client, /*shm=*/true);
  // Every block went through a memfd: nothing was read from or written into this process.
  const Counts all = counts(client, 4);
  EXPECT_GT(all.shm_put, 0);
  EXPECT_GT(all.shm_fetched, 0);
  EXPECT_EQ(all.memory_read, 0);
  EXPECT_EQ(all.memory_written, 0);
}

// Raw PutShard and GetShard calls naming bad segments, sent straight to a worker process: each
// fails with its precise error, leaves no reservation and no open segment behind, and the
// worker keeps serving.
class ShmTransferWireTest : public ShmTransferTest {
 protected:
  void SetUp() override {
    start();
    client_.emplace(connect(true));
    absl::StatusOr<std::vector<Device>> devices = client_->devices();
    ASSERT_TRUE(devices.ok()) << devices.status();
    worker_ = pb::Worker::NewStub(make_channel((*devices)[0].address, std::make_shared<CallIdentity>("")));
  }

  static pb::ShardChunk header(uint64_t id, int64_t elements, const pb::ShmSegment& shm) {
    pb::ShardChunk c;
    c.mutable_header()->set_buffer_id(id);
    c.mutable_header()->set_dtype(pb::I32);
    c.mutable_header()->mutable_shape()->add_dims(1);
    c.mutable_header()->mutable_shape()->add_dims(elements);
    *c.mutable_header()->mutable_shm() = shm;
    return c;
  }
  static pb::ShmSegment named(pid_t pid, int fd, uint64_t token) {
    pb::ShmSegment s;
    s.set_pid(pid);
    s.set_fd(fd);
    s.set_token(token);
    return s;
  }

  grpc::Status put(const pb::ShardChunk& chunk) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::PutShardReply reply;
    auto writer = worker_->PutShard(&ctx, &reply);
    writer->Write(chunk);
    writer->WritesDone();
    return writer->Finish();
  }

  // After each call: nothing reserved or stored on device 0, no segment open or mapped there.
  void expect_nothing_left() {
    absl::StatusOr<DeviceStats> s = client_->device_stats(0);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->bytes_used, 0);
    EXPECT_EQ(s->buffer_count, 0);
    EXPECT_EQ(transfer_memfds_open(cluster_.workers[0]->pid()), 0);
    EXPECT_EQ(transfer_memfds_mapped(cluster_.workers[0]->pid()), 0);
  }

  // Buffer `id` of device 0 as `elements` int32 values, streamed (no segment named).
  HostArray fetch_streamed(uint64_t id, int64_t elements) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::GetShardRequest req;
    req.set_buffer_id(id);
    auto reader = worker_->GetShard(&ctx, req);
    HostArray back(DType::kI32, {1, elements});
    int64_t at = 0;
    pb::ShardChunk chunk;
    while (reader->Read(&chunk)) {
      EXPECT_LE(at + static_cast<int64_t>(chunk.data().size()), back.nbytes());
      if (at + static_cast<int64_t>(chunk.data().size()) > back.nbytes()) break;
      std::memcpy(back.data() + at, chunk.data().data(), chunk.data().size());
      at += static_cast<int64_t>(chunk.data().size());
    }
    const grpc::Status finished = reader->Finish();
    EXPECT_TRUE(finished.ok()) << finished.error_message();
    EXPECT_EQ(at, back.nbytes());
    return back;
  }

  // A GetShard of buffer `id` naming `shm`: its status; an OK one must have answered with the
  // header alone (its shm set, no data).
  grpc::Status fetch_into(uint64_t id, const pb::ShmSegment& shm) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::GetShardRequest req;
    req.set_buffer_id(id);
    *req.mutable_shm() = shm;
    auto reader = worker_->GetShard(&ctx, req);
    int messages = 0;
    pb::ShardChunk chunk;
    while (reader->Read(&chunk)) {
      ++messages;
      EXPECT_TRUE(chunk.has_header() && chunk.header().has_shm());
      EXPECT_TRUE(chunk.data().empty());
    }
    const grpc::Status status = reader->Finish();
    if (status.ok()) {
      EXPECT_EQ(messages, 1);
    }
    return status;
  }

  void delete_buffers(const std::vector<uint64_t>& ids) {
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::DeleteBuffersRequest req;
    for (uint64_t id : ids) req.add_buffer_ids(id);
    pb::DeleteBuffersReply reply;
    const grpc::Status deleted = worker_->DeleteBuffers(&ctx, req, &reply);
    EXPECT_TRUE(deleted.ok()) << deleted.error_message();
  }

  std::optional<Client> client_;
  std::unique_ptr<pb::Worker::Stub> worker_;
};

// A child process that alone holds `segment` (its copy of the fd: this process's is closed)
// until it is killed, by kill_and_reap() or at the end of the scope. The child only closes fds
// and pauses: no allocation or lock after fork in this threaded process. The constructor returns
// once the child has closed what it closes (it closes its end of a pipe last, which this
// process waits for, 10 s at most). pid() <= 0 if fork failed.
class SegmentHolder {
 public:
  // `segment_only`: the child closes every fd but `segment`'s and 0 to 2 (the test's
  // connections to the workers among them).
  explicit SegmentHolder(ShmSegment* segment, bool segment_only = false) {
    int ready[2];
    if (pipe2(ready, O_CLOEXEC) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      if (segment_only) {
        const unsigned kept[2] = {static_cast<unsigned>(std::min(segment->fd(), ready[1])),
                                  static_cast<unsigned>(std::max(segment->fd(), ready[1]))};
        if (kept[0] > 3) close_range(3, kept[0] - 1, 0);
        if (kept[1] > kept[0] + 1) close_range(kept[0] + 1, kept[1] - 1, 0);
        close_range(kept[1] + 1, ~0U, 0);
      }
      close(ready[1]);  // done: the parent's read ends
      for (;;) pause();
    }
    close(ready[1]);
    if (pid_ > 0) {
      pollfd done{ready[0], POLLIN, 0};
      char byte;
      if (poll(&done, 1, 10'000) != 1 || read(ready[0], &byte, 1) != 0) kill_and_reap();
    }
    close(ready[0]);
    *segment = *ShmSegment::create(0);
  }
  ~SegmentHolder() { kill_and_reap(); }
  SegmentHolder(const SegmentHolder&) = delete;
  SegmentHolder& operator=(const SegmentHolder&) = delete;

  pid_t pid() const { return pid_; }
  // Whether the child was killed and reaped now.
  bool kill_and_reap() {
    const bool reaped = pid_ > 0 && ::kill(pid_, SIGKILL) == 0 && waitpid(pid_, nullptr, 0) == pid_;
    pid_ = -1;
    return reaped;
  }

 private:
  pid_t pid_ = -1;
};

void expect_error(const grpc::Status& s, grpc::StatusCode code, const std::string& part) {
  EXPECT_EQ(s.error_code(), code) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr(part));
}

TEST_F(ShmTransferWireTest, BadSegmentsFailPreciselyAndLeaveNothing) {
  constexpr int64_t kElements = 1024;
  absl::StatusOr<ShmSegment> segment = ShmSegment::create(kElements * 4);
  ASSERT_TRUE(segment.ok()) << segment.status();
  const pid_t self = getpid();

  // Another token: not the segment named.
  expect_error(put(header(501, kElements, named(self, segment->fd(), segment->token() + 1))),
               grpc::StatusCode::INVALID_ARGUMENT, "magic or token differ");
  expect_nothing_left();
  // A header announcing more than the segment was made for.
  expect_error(put(header(502, kElements / 2, named(self, segment->fd(), segment->token()))),
               grpc::StatusCode::INVALID_ARGUMENT, "was made for a block of 4096 bytes; this one has 2048");
  expect_nothing_left();
  // An fd that is no memfd of ours: a plain file.
  const std::string path = absl::StrCat(::testing::TempDir(), "/shm-transfer-plain-", self);
  const int plain = ::open(path.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
  ASSERT_GE(plain, 0);
  ASSERT_EQ(ftruncate(plain, 8192), 0);
  expect_error(put(header(503, kElements, named(self, plain, segment->token()))), grpc::StatusCode::INVALID_ARGUMENT,
               "is not a Tessera transfer memfd");
  close(plain);
  unlink(path.c_str());
  expect_nothing_left();
  // An fd that is not open.
  expect_error(put(header(504, kElements, named(self, 1 << 20, segment->token()))), grpc::StatusCode::NOT_FOUND,
               absl::StrCat("cannot open /proc/", self, "/fd/", 1 << 20, " here"));
  expect_nothing_left();
  // A segment shrunk below its block (by its owner, after making it).
  ASSERT_EQ(ftruncate(segment->fd(), ShmSegment::kDataOffset + 100), 0);
  expect_error(put(header(505, kElements, named(self, segment->fd(), segment->token()))),
               grpc::StatusCode::INVALID_ARGUMENT,
               absl::StrCat("holds ", ShmSegment::kDataOffset + 100,
                            " bytes: too small for a header of 4096 and a "
                            "block of 4096"));
  expect_nothing_left();
  // A block larger than the device's memory: refused before the segment is touched.
  expect_error(put(header(506, int64_t{1} << 30, named(self, segment->fd(), segment->token()))),
               grpc::StatusCode::RESOURCE_EXHAUSTED, "buffer 506 needs 4294967296 bytes");
  expect_nothing_left();
  // A fetch into a segment made for another size.
  {
    absl::StatusOr<ShmSegment> small = ShmSegment::create(16);
    ASSERT_TRUE(small.ok());
    absl::StatusOr<Mesh> mesh = client_->make_mesh({1}, {"x"}, std::vector<int>{0});
    ASSERT_TRUE(mesh.ok());
    absl::StatusOr<Array> a = client_->device_put(numbered({1, kElements}), NamedSharding(*mesh, P()));
    ASSERT_TRUE(a.ok()) << a.status();
    grpc::ClientContext ctx;
    set_deadline(&ctx, absl::Seconds(10));
    pb::GetShardRequest req;
    req.set_buffer_id(a->id());
    *req.mutable_shm() = named(self, small->fd(), small->token());
    auto reader = worker_->GetShard(&ctx, req);
    pb::ShardChunk chunk;
    EXPECT_FALSE(reader->Read(&chunk));
    expect_error(reader->Finish(), grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("GetShard: buffer ", a->id(), " i32[1,1024]: shared-memory segment of process ", self,
                              " fd ", small->fd(), " holds 4112 bytes: too small"));
    // The array is intact and still fetched right (through shared memory).
    absl::StatusOr<HostArray> back = a->fetch();
    ASSERT_TRUE(back.ok()) << back.status();
    expect_block(*back, {{0, 1}, {0, kElements}}, kElements);
  }
  ASSERT_TRUE(client_->flush_deletes().ok());
  expect_nothing_left();
}

// A segment held by another process: the worker reads it from there (a real second client
// process); once that process is killed, a put naming it fails NOT_FOUND, and nothing is left.
TEST_F(ShmTransferWireTest, ASegmentOfAClientKilledBeforeTheWorkerOpensItFailsThePut) {
  constexpr int64_t kElements = 4096;
  const HostArray host = numbered({1, kElements});
  absl::StatusOr<ShmSegment> segment = ShmSegment::create(host.nbytes());
  ASSERT_TRUE(segment.ok()) << segment.status();
  ASSERT_TRUE(segment->write_block(host.data()).ok());
  const int fd = segment->fd();
  const uint64_t token = segment->token();
  SegmentHolder holding(&*segment);
  ASSERT_GT(holding.pid(), 0) << "fork: " << std::strerror(errno);
  const pid_t holder = holding.pid();

  const grpc::Status from_holder = put(header(601, kElements, named(holder, fd, token)));
  ASSERT_TRUE(from_holder.ok()) << from_holder.error_message();
  expect_block(fetch_streamed(601, kElements), {{0, 1}, {0, kElements}}, kElements);
  delete_buffers({601});

  ASSERT_TRUE(holding.kill_and_reap());
  expect_error(put(header(602, kElements, named(holder, fd, token))), grpc::StatusCode::NOT_FOUND,
               absl::StrCat("PutShard: buffer 602 i32[1,4096]: shared-memory segment of process ", holder, " fd ", fd,
                            ": cannot open /proc/", holder, "/fd/", fd, " here"));
  expect_nothing_left();
}

// A sealed segment is adopted: the worker's buffer is the client's pages, mapped privately.
// The client can no longer change them (the kernel refuses every write, shrink and growth
// with EPERM), and they outlive the client: a holder process killed after the put leaves the
// buffer whole. Deleting the buffer unmaps it.
TEST_F(ShmTransferWireTest, ASealedSegmentIsAdoptedAndOutlivesItsClient) {
  constexpr int64_t kElements = 1 << 20;  // 4 MiB
  const HostArray host = numbered({1, kElements});
  absl::StatusOr<ShmSegment> segment = ShmSegment::create(host.nbytes());
  ASSERT_TRUE(segment.ok()) << segment.status();
  ASSERT_TRUE(segment->write_block(host.data()).ok());
  ASSERT_TRUE(segment->seal().ok());
  EXPECT_TRUE(segment->sealed());
  // Sealed: no write through the fd, no shared writable mapping, no change of size, no hole.
  const int32_t other = -1;
  errno = 0;
  EXPECT_EQ(pwrite(segment->fd(), &other, sizeof other, ShmSegment::kDataOffset), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, segment->fd(), ShmSegment::kDataOffset),
            MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(ftruncate(segment->fd(), ShmSegment::kDataOffset), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(ftruncate(segment->fd(), ShmSegment::kDataOffset + 2 * host.nbytes()), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(fallocate(segment->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, ShmSegment::kDataOffset, 4096), -1);
  EXPECT_EQ(errno, EPERM);
  absl::Status rewritten = segment->write_block(host.data());
  EXPECT_EQ(rewritten.code(), absl::StatusCode::kInternal) << rewritten;
  EXPECT_THAT(std::string(rewritten.message()), HasSubstr("Operation not permitted"));
  EXPECT_EQ(segment->reuse(16).code(), absl::StatusCode::kFailedPrecondition);

  // Held by a child process alone, which is killed once the put is done.
  const int fd = segment->fd();
  const uint64_t token = segment->token();
  SegmentHolder holding(&*segment);
  ASSERT_GT(holding.pid(), 0) << "fork: " << std::strerror(errno);
  const pid_t holder = holding.pid();

  const pid_t worker = cluster_.workers[0]->pid();
  const grpc::Status adopted = put(header(701, kElements, named(holder, fd, token)));
  ASSERT_TRUE(adopted.ok()) << adopted.error_message();
  EXPECT_EQ(transfer_memfds_mapped(worker), 1);  // the buffer, mapped
  EXPECT_EQ(transfer_memfds_open(worker), 0);    // no fd kept
  {
    absl::StatusOr<DeviceStats> s = client_->device_stats(0);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->buffer_count, 1);
    EXPECT_EQ(s->bytes_used, host.nbytes());  // charged to the device as any buffer
    EXPECT_EQ(s->shm_bytes_put, host.nbytes());
  }
  ASSERT_TRUE(holding.kill_and_reap());

  expect_block(fetch_streamed(701, kElements), {{0, 1}, {0, kElements}}, kElements);
  EXPECT_EQ(transfer_memfds_mapped(worker), 1);
  delete_buffers({701});
  expect_nothing_left();
}

// A segment not sealed as the client's puts seal it (an older client's, or one sealed against
// shrinking but not writing, or against writing but not shrinking, so that a mapping could
// change or fault) is copied out instead, as before adoption: the put succeeds, the worker maps
// nothing, and what the client does to its segment afterwards (rewrite it, shrink it to
// nothing) does not reach the buffer.
TEST_F(ShmTransferWireTest, ASegmentNotFullySealedIsCopiedOut) {
  constexpr int64_t kElements = 1 << 18;  // 1 MiB
  const HostArray host = numbered({1, kElements});
  const HostArray zeros = HostArray::zeros(DType::kI32, {1, kElements});
  const int seals[] = {0, F_SEAL_SHRINK | F_SEAL_GROW, F_SEAL_WRITE | F_SEAL_GROW};
  std::vector<ShmSegment> segments;
  const pid_t worker = cluster_.workers[0]->pid();
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(absl::StrCat("seals ", seals[i]));
    absl::StatusOr<ShmSegment> segment = ShmSegment::create(host.nbytes());
    ASSERT_TRUE(segment.ok()) << segment.status();
    ASSERT_TRUE(segment->write_block(host.data()).ok());
    if (seals[i] != 0) {
      ASSERT_EQ(fcntl(segment->fd(), F_ADD_SEALS, seals[i]), 0) << std::strerror(errno);
    }
    const grpc::Status copied = put(header(801 + i, kElements, named(getpid(), segment->fd(), segment->token())));
    ASSERT_TRUE(copied.ok()) << copied.error_message();
    EXPECT_EQ(transfer_memfds_mapped(worker), 0);
    segments.push_back(*std::move(segment));
  }
  // The client changes what it still may: the first two rewritten, the third shrunk to nothing.
  ASSERT_TRUE(segments[0].write_block(zeros.data()).ok());
  ASSERT_TRUE(segments[1].write_block(zeros.data()).ok());
  ASSERT_EQ(ftruncate(segments[2].fd(), 0), 0) << std::strerror(errno);
  for (int i = 0; i < 3; ++i) {
    SCOPED_TRACE(absl::StrCat("seals ", seals[i]));
    expect_block(fetch_streamed(801 + i, kElements), {{0, 1}, {0, kElements}}, kElements);
  }
  absl::StatusOr<DeviceStats> s = client_->device_stats(0);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->bytes_used, 3 * host.nbytes());
  EXPECT_EQ(s->shm_bytes_put, 3 * host.nbytes());
  delete_buffers({801, 802, 803});
  expect_nothing_left();
}

// A segment naming a block in its client's memory (ShmSegment::create_direct, what a co-located
// client's puts of contiguous blocks send): the worker reads the block from there, odd sizes
// included, and it is the host's; a range that is not the client's memory, wholly or from some
// byte on, fails INVALID_ARGUMENT naming it and leaves nothing.
TEST_F(ShmTransferWireTest, ASegmentNamingTheClientsMemoryIsReadFromThere) {
  const pid_t self = getpid();
  const pid_t worker = cluster_.workers[0]->pid();
  uint64_t id = 901;
  for (const int64_t elements : {int64_t{1}, int64_t{777}, (int64_t{1} << 20) + 3}) {
    SCOPED_TRACE(absl::StrCat(elements, " elements"));
    const HostArray host = numbered({1, elements});
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(host.data(), host.nbytes());
    ASSERT_TRUE(segment.ok()) << segment.status();
    EXPECT_TRUE(segment->direct());
    const int64_t read_before = client_->device_stats(0)->client_memory_bytes_read;
    const grpc::Status read = put(header(id, elements, named(self, segment->fd(), segment->token())));
    ASSERT_TRUE(read.ok()) << read.error_message();
    EXPECT_EQ(client_->device_stats(0)->client_memory_bytes_read - read_before, host.nbytes());
    EXPECT_EQ(transfer_memfds_mapped(worker), 0);
    expect_block(fetch_streamed(id, elements), {{0, 1}, {0, elements}}, elements);
    delete_buffers({id++});
    expect_nothing_left();
  }
  // Two pages of which the second is unmapped: the read stops after the first.
  const long page = sysconf(_SC_PAGESIZE);
  void* pages = mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(pages, MAP_FAILED);
  ASSERT_EQ(munmap(static_cast<std::byte*>(pages) + page, page), 0);
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(static_cast<std::byte*>(pages), 2 * page);
    ASSERT_TRUE(segment.ok()) << segment.status();
    expect_error(put(header(id, 2 * page / 4, named(self, segment->fd(), segment->token()))),
                 grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("reading ", 2 * page, " bytes of process ", self, "'s memory"));
    expect_nothing_left();
  }
  ASSERT_EQ(munmap(pages, page), 0);
  // The whole range unmapped now.
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(static_cast<std::byte*>(pages), page);
    ASSERT_TRUE(segment.ok()) << segment.status();
    expect_error(put(header(id, page / 4, named(self, segment->fd(), segment->token()))),
                 grpc::StatusCode::INVALID_ARGUMENT, "the range is not readable memory of the process");
    expect_nothing_left();
  }
  expect_nothing_left();
}

// A fetch naming a block's place in the client's memory (ShmSegment::create_direct, what a
// co-located client's fetches of contiguous blocks send): the worker writes the block there
// (process_vm_writev), odd sizes included, equal to the host's, and counts it as a shared-memory
// fetch. Each bound: a byte count other than the buffer's is refused before anything is
// written; read-only memory fails INVALID_ARGUMENT naming the pid, the address and the bytes,
// and a range writable for its first page only fails the same way, naming the bytes written
// before; a segment its owner is withdrawing (holding its lock) or has withdrawn gets nothing
// written. Nothing is left reserved, open or mapped on the worker.
TEST_F(ShmTransferWireTest, AFetchNamingTheClientsMemoryIsWrittenThere) {
  const pid_t self = getpid();
  uint64_t id = 1101;
  for (const int64_t elements : {int64_t{1}, int64_t{777}, (int64_t{1} << 20) + 3}) {
    SCOPED_TRACE(absl::StrCat(elements, " elements"));
    const HostArray host = numbered({1, elements});
    absl::StatusOr<ShmSegment> source = ShmSegment::create_direct(host.data(), host.nbytes());
    ASSERT_TRUE(source.ok()) << source.status();
    ASSERT_TRUE(put(header(id, elements, named(self, source->fd(), source->token()))).ok());
    HostArray into(DType::kI32, {1, elements});
    std::fill_n(into.mutable_values<int32_t>().data(), elements, -1);
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(into.data(), into.nbytes());
    ASSERT_TRUE(segment.ok()) << segment.status();
    const DeviceStats before = *client_->device_stats(0);
    const grpc::Status wrote = fetch_into(id, named(self, segment->fd(), segment->token()));
    ASSERT_TRUE(wrote.ok()) << wrote.error_message();
    segment->withdraw();
    expect_block(into, {{0, 1}, {0, elements}}, elements);
    const DeviceStats after = *client_->device_stats(0);
    EXPECT_EQ(after.shm_bytes_fetched - before.shm_bytes_fetched, host.nbytes());
    EXPECT_EQ(after.client_memory_bytes_written - before.client_memory_bytes_written, host.nbytes());
    EXPECT_EQ(transfer_memfds_open(cluster_.workers[0]->pid()), 0);
    delete_buffers({id++});
    expect_nothing_left();
  }
  const long page = sysconf(_SC_PAGESIZE);
  const int64_t elements = 2 * page / 4;
  const HostArray host = numbered({1, elements});
  {
    absl::StatusOr<ShmSegment> source = ShmSegment::create_direct(host.data(), host.nbytes());
    ASSERT_TRUE(source.ok()) << source.status();
    ASSERT_TRUE(put(header(id, elements, named(self, source->fd(), source->token()))).ok());
  }
  auto* pages =
      static_cast<std::byte*>(mmap(nullptr, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(pages, MAP_FAILED);
  std::memset(pages, 0xee, 2 * page);
  auto untouched = [&](int64_t from) {
    return std::all_of(pages + from, pages + 2 * page, [](std::byte b) { return b == std::byte{0xee}; });
  };
  // A segment made for another byte count than the buffer's.
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(pages, page);
    ASSERT_TRUE(segment.ok()) << segment.status();
    expect_error(fetch_into(id, named(self, segment->fd(), segment->token())), grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("was made for a block of ", page, " bytes; this one has ", 2 * page));
    EXPECT_TRUE(untouched(0));
  }
  // Read-only, wholly.
  ASSERT_EQ(mprotect(pages, 2 * page, PROT_READ), 0);
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(pages, 2 * page);
    ASSERT_TRUE(segment.ok()) << segment.status();
    expect_error(fetch_into(id, named(self, segment->fd(), segment->token())), grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("writing ", 2 * page, " bytes into process ", self, "'s memory at 0x",
                              absl::Hex(reinterpret_cast<uintptr_t>(pages)),
                              ": Bad address (after 0 bytes: the range is not writable memory of the process)"));
    EXPECT_TRUE(untouched(0));
  }
  // Writable for the first page only: a partial write, an error naming what was written.
  ASSERT_EQ(mprotect(pages, page, PROT_READ | PROT_WRITE), 0);
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(pages, 2 * page);
    ASSERT_TRUE(segment.ok()) << segment.status();
    expect_error(fetch_into(id, named(self, segment->fd(), segment->token())), grpc::StatusCode::INVALID_ARGUMENT,
                 absl::StrCat("writing ", 2 * page, " bytes into process ", self, "'s memory at 0x",
                              absl::Hex(reinterpret_cast<uintptr_t>(pages)), ": Bad address (after ", page,
                              " bytes: the range is not writable memory of the process)"));
    EXPECT_EQ(std::memcmp(pages, host.data(), static_cast<size_t>(page)), 0);
    EXPECT_TRUE(untouched(page));
  }
  ASSERT_EQ(mprotect(pages, 2 * page, PROT_READ | PROT_WRITE), 0);
  std::memset(pages, 0xee, 2 * page);
  // Being withdrawn (its owner holds the lock): nothing written.
  {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(pages, 2 * page);
    ASSERT_TRUE(segment.ok()) << segment.status();
    ASSERT_EQ(flock(segment->fd(), LOCK_EX), 0);
    expect_error(fetch_into(id, named(self, segment->fd(), segment->token())), grpc::StatusCode::ABORTED,
                 "the client withdrew the segment (its call ended), nothing written");
    EXPECT_TRUE(untouched(0));
    ASSERT_EQ(flock(segment->fd(), LOCK_UN), 0);
    // Withdrawn: refused when opened.
    segment->withdraw();
    expect_error(fetch_into(id, named(self, segment->fd(), segment->token())), grpc::StatusCode::INVALID_ARGUMENT,
                 "magic or token differ");
    EXPECT_TRUE(untouched(0));
  }
  ASSERT_EQ(munmap(pages, 2 * page), 0);
  delete_buffers({id});
  expect_nothing_left();
}

// A direct segment naming a process other than the caller's connection's owner: the attack
// in which a client has another process hold a copy of its memfd (a worker it put through,
// say) and names that process, with an address in its memory. Here the other process is a
// child forked from this test (so the block is at the same address in its memory, with the
// same values) that holds the memfd but none of this test's connections: refused
// PERMISSION_DENIED naming it and the caller's peer, nothing read, reserved or left. Named
// as itself, this process (which holds the connection) gets the block read, the host's.
TEST_F(ShmTransferWireTest, ASegmentNamingMemoryOfAProcessNotTheCallersIsRefused) {
  constexpr int64_t kElements = 3001;
  const HostArray host = numbered({1, kElements});
  absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(host.data(), host.nbytes());
  ASSERT_TRUE(segment.ok()) << segment.status();
  const int fd = segment->fd();
  const uint64_t token = segment->token();
  {
    SegmentHolder holding(&*segment, /*segment_only=*/true);  // the child's copy of it alone is left
    ASSERT_GT(holding.pid(), 0) << "fork: " << std::strerror(errno);
    const pid_t other = holding.pid();
    // The holder's copy of the memfd is this one (the worker could open it there).
    EXPECT_TRUE(std::filesystem::exists(absl::StrCat("/proc/", other, "/fd/", fd)));
    expect_error(put(header(801, kElements, named(other, fd, token))), grpc::StatusCode::PERMISSION_DENIED,
                 absl::StrCat("PutShard: buffer 801 i32[1,3001]: process ", other,
                              " does not hold this call's connection (peer 'ipv"));
    expect_nothing_left();
  }
  segment = ShmSegment::create_direct(host.data(), host.nbytes());
  ASSERT_TRUE(segment.ok()) << segment.status();
  const grpc::Status read = put(header(802, kElements, named(getpid(), segment->fd(), segment->token())));
  ASSERT_TRUE(read.ok()) << read.error_message();
  expect_block(fetch_streamed(802, kElements), {{0, 1}, {0, kElements}}, kElements);
  delete_buffers({802});
  expect_nothing_left();
}

// A fetch naming memory of a process that does not hold the call's connection (a forked child
// holding the memfd alone, the destination at the same address in its memory): refused
// PERMISSION_DENIED naming it and the caller's peer, and nothing written, in the child's
// memory (read back with process_vm_readv) nor in this one's. Named as itself, this process
// gets the block written.
TEST_F(ShmTransferWireTest, AFetchNamingMemoryOfAProcessNotTheCallersIsRefused) {
  constexpr int64_t kElements = 3001;
  const pid_t self = getpid();
  const HostArray host = numbered({1, kElements});
  {
    absl::StatusOr<ShmSegment> source = ShmSegment::create_direct(host.data(), host.nbytes());
    ASSERT_TRUE(source.ok()) << source.status();
    ASSERT_TRUE(put(header(1201, kElements, named(self, source->fd(), source->token()))).ok());
  }
  HostArray into(DType::kI32, {1, kElements});
  std::fill_n(into.mutable_values<int32_t>().data(), kElements, -1);
  absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(into.data(), into.nbytes());
  ASSERT_TRUE(segment.ok()) << segment.status();
  const int fd = segment->fd();
  const uint64_t token = segment->token();
  {
    SegmentHolder holding(&*segment, /*segment_only=*/true);
    ASSERT_GT(holding.pid(), 0) << "fork: " << std::strerror(errno);
    const pid_t other = holding.pid();
    EXPECT_TRUE(std::filesystem::exists(absl::StrCat("/proc/", other, "/fd/", fd)));
    expect_error(fetch_into(1201, named(other, fd, token)), grpc::StatusCode::PERMISSION_DENIED,
                 absl::StrCat("GetShard: buffer 1201 i32[1,3001]: process ", other,
                              " does not hold this call's connection (peer 'ipv"));
    std::vector<int32_t> theirs(kElements, 0);
    const iovec local{theirs.data(), static_cast<size_t>(into.nbytes())};
    const iovec remote{into.data(), static_cast<size_t>(into.nbytes())};
    ASSERT_EQ(process_vm_readv(other, &local, 1, &remote, 1, 0), into.nbytes()) << std::strerror(errno);
    EXPECT_EQ(std::count(theirs.begin(), theirs.end(), -1), kElements);
    EXPECT_EQ(std::count(into.values<int32_t>().begin(), into.values<int32_t>().end(), -1), kElements);
  }
  segment = ShmSegment::create_direct(into.data(), into.nbytes());
  ASSERT_TRUE(segment.ok()) << segment.status();
  const grpc::Status wrote = fetch_into(1201, named(self, segment->fd(), segment->token()));
  ASSERT_TRUE(wrote.ok()) << wrote.error_message();
  segment->withdraw();
  expect_block(into, {{0, 1}, {0, kElements}}, kElements);
  delete_buffers({1201});
  expect_nothing_left();
}

// withdraw() while another process holds the segment's lock, as a worker does while it writes
// into the memory, and is stopped there (SIGSTOP; the process opened the memfd as a worker does,
// /proc/<pid>/fd/<fd>, and took the lock): withdraw keeps waiting, since the memory may not be
// reused before that writer lets go, and says so, naming the fetch's device, the segment and the
// holder's pid, again and again; once the holder is killed (its lock goes with it) withdraw
// returns, and the segment is withdrawn: a worker opening it now is refused, nothing written.
TEST(ShmSegmentWithdrawTest, WaitsForAStoppedLockHolderAndSaysSo) {
  std::vector<int32_t> into(1024, -1);
  const int64_t bytes = static_cast<int64_t>(into.size() * sizeof(int32_t));
  absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(reinterpret_cast<std::byte*>(into.data()), bytes);
  ASSERT_TRUE(segment.ok()) << segment.status();
  const std::string path = absl::StrCat("/proc/", getpid(), "/fd/", segment->fd());
  int ready[2];
  ASSERT_EQ(pipe2(ready, O_CLOEXEC), 0);
  const pid_t holder = fork();
  ASSERT_GE(holder, 0) << "fork: " << std::strerror(errno);
  if (holder == 0) {  // no allocation or lock after fork in this threaded process
    const int fd = open(path.c_str(), O_RDWR);
    if (fd < 0 || flock(fd, LOCK_EX) != 0 || write(ready[1], "k", 1) != 1) _exit(1);
    raise(SIGSTOP);
    for (;;) pause();
  }
  close(ready[1]);
  pollfd locked{ready[0], POLLIN, 0};
  char byte = 0;
  const bool holding = poll(&locked, 1, 10'000) == 1 && read(ready[0], &byte, 1) == 1;
  close(ready[0]);
  absl::Mutex mu;
  std::vector<std::string> warnings;
  absl::Notification warned_twice;
  std::atomic<bool> returned{false};
  std::thread withdrawing([&] {
    segment->withdraw("fetch: device 7 (127.0.0.1:1)", absl::Milliseconds(20), [&](const std::string& m) {
      absl::MutexLock lock(&mu);
      warnings.push_back(m);
      if (warnings.size() == 2) warned_twice.Notify();
    });
    returned = true;
  });
  EXPECT_TRUE(holding) << "the child did not take the lock";
  EXPECT_TRUE(holding && warned_twice.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_FALSE(returned);
  {
    absl::MutexLock lock(&mu);
    // No ASSERT before the kill and join below: returning would leave the child stopped and
    // the thread joinable (std::terminate).
    if (warnings.empty()) warnings.push_back("(no warning)");
    EXPECT_THAT(warnings[0],
                HasSubstr(absl::StrCat("fetch: device 7 (127.0.0.1:1): withdrawing the shared-memory "
                                       "segment (fd ",
                                       segment->fd(), ") naming ", bytes, " bytes of this process's memory at 0x",
                                       absl::Hex(reinterpret_cast<uintptr_t>(into.data())))));
    EXPECT_THAT(warnings[0], HasSubstr(absl::StrCat(": process ", holder, " has held its lock for ")));
  }
  EXPECT_EQ(kill(holder, SIGKILL), 0);
  EXPECT_EQ(waitpid(holder, nullptr, 0), holder);
  withdrawing.join();
  EXPECT_EQ(ShmSegment::open(getpid(), segment->fd(), segment->token(), bytes, /*writable=*/true).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::count(into.begin(), into.end(), -1), static_cast<int64_t>(into.size()));
}

// A child of this process with pid `pid`, which must be free: a copy of this process (as fork
// makes: this one's memory at the same addresses) that only waits to be killed. clone3 with
// set_tid (Linux 5.5), which needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE (the tests run as
// root; without them the test is skipped): how a pid's reuse is forced. -errno if the kernel refuses (EEXIST: another
// process took the pid first).
pid_t child_with_pid(pid_t pid) {
  clone_args args{};
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uint64_t>(&pid);
  args.set_tid_size = 1;
  const long child = syscall(SYS_clone3, &args, sizeof args);
  if (child == 0) {  // no allocation or lock in the copy of a threaded process
    for (;;) pause();
  }
  return child < 0 ? -errno : static_cast<pid_t>(child);
}

// A direct segment opened as a worker opens a fetch's (/proc/<pid>/fd/<fd>, writable), whose
// process then exits and is reaped, its pid taken by another process (a copy of this one: the
// block's place at the same address in its memory) before the move's first poll of the
// segment's pidfd: writing the block there fails NOT_FOUND naming the exit, and so does reading
// it (a put's), each moving nothing: the other process's memory is as it was (read back with
// process_vm_readv) and so is the read's destination. Without the segment's pidfd the write went
// into the new holder. (A pid reaped and reused between that poll and process_vm_writev can still
// receive the write; the poll after it reports so: see write_block in core/shm_transfer.h.)
TEST(ShmSegmentProcessTest, AnExitedProcesssPidTakenByAnotherGetsNothing) {
  constexpr int64_t kElements = 1000;
  constexpr int64_t kBytes = kElements * sizeof(int32_t);
  std::vector<int32_t> into(kElements, -1);
  // Another process may take the freed pid before clone3 does (EEXIST): a fresh holder then.
  constexpr int kAttempts = 5;
  pid_t first = -1;
  pid_t second = -EEXIST;
  std::optional<ShmSegment> opened;
  for (int attempt = 0; attempt < kAttempts && second == -EEXIST; ++attempt) {
    absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(reinterpret_cast<std::byte*>(into.data()), kBytes);
    ASSERT_TRUE(segment.ok()) << segment.status();
    const int fd = segment->fd();
    const uint64_t token = segment->token();
    SegmentHolder holding(&*segment, /*segment_only=*/true);  // the segment's process
    first = holding.pid();
    ASSERT_GT(first, 0) << "fork: " << std::strerror(errno);
    absl::StatusOr<ShmSegment> reopened = ShmSegment::open(first, fd, token, kBytes, /*writable=*/true);
    ASSERT_TRUE(reopened.ok()) << reopened.status();
    opened = *std::move(reopened);
    ASSERT_TRUE(holding.kill_and_reap());
    second = child_with_pid(first);
  }
  if (second == -EPERM) {
    GTEST_SKIP() << "clone3 with set_tid needs CAP_SYS_ADMIN (or, from Linux 5.9, CAP_CHECKPOINT_RESTORE), "
                    "which this process lacks";
  }
  if (second == -ENOSYS) GTEST_SKIP() << "clone3 is not available (ENOSYS: a seccomp filter, or a kernel without it)";
  if (second == -EINVAL || second == -E2BIG) {
    GTEST_SKIP() << "clone3 with set_tid is not supported by this kernel (Linux 5.5 or later needed): "
                 << std::strerror(-second);
  }
  ASSERT_EQ(second, first) << "clone3 with set_tid " << first << " (" << kAttempts
                           << " attempts): " << std::strerror(-second);
  absl::Cleanup reap = [second] {
    kill(second, SIGKILL);
    waitpid(second, nullptr, 0);
  };
  const std::string where =
      absl::StrCat(" process ", first, "'s memory at 0x", absl::Hex(reinterpret_cast<uintptr_t>(into.data())),
                   ": the process exited after its segment was opened (pid ", first, " may name another process now)");
  std::vector<int32_t> block(kElements);
  std::iota(block.begin(), block.end(), 1);
  const absl::Status wrote = opened->write_block(reinterpret_cast<const std::byte*>(block.data()));
  EXPECT_EQ(wrote.code(), absl::StatusCode::kNotFound) << wrote;
  EXPECT_THAT(wrote.message(), HasSubstr(absl::StrCat("writing ", kBytes, " bytes into", where, ": nothing written")));
  std::vector<int32_t> theirs(kElements, 0);
  const iovec local{theirs.data(), static_cast<size_t>(kBytes)};
  const iovec remote{into.data(), static_cast<size_t>(kBytes)};
  ASSERT_EQ(process_vm_readv(second, &local, 1, &remote, 1, 0), kBytes) << std::strerror(errno);
  EXPECT_EQ(std::count(theirs.begin(), theirs.end(), -1), kElements);
  std::vector<int32_t> read(kElements, 0);
  const absl::Status got = opened->read_block(reinterpret_cast<std::byte*>(read.data()));
  EXPECT_EQ(got.code(), absl::StatusCode::kNotFound) << got;
  EXPECT_THAT(got.message(), HasSubstr(absl::StrCat("reading ", kBytes, " bytes of", where, ": nothing read")));
  EXPECT_EQ(std::count(read.begin(), read.end(), 0), kElements);
}

// A direct segment this process created names its own memory and holds no block: moving the
// block either way is the caller's mistake, refused FAILED_PRECONDITION saying so (not "no pidfd
// of the process", which a created segment never has), the memory untouched.
TEST(ShmSegmentProcessTest, ACreatedDirectSegmentHoldsNoBlockToReadOrWrite) {
  std::vector<int32_t> mine(16, 7);
  absl::StatusOr<ShmSegment> segment =
      ShmSegment::create_direct(reinterpret_cast<std::byte*>(mine.data()), mine.size() * sizeof(int32_t));
  ASSERT_TRUE(segment.ok()) << segment.status();
  std::vector<int32_t> other(16, -1);
  const absl::Status read = segment->read_block(reinterpret_cast<std::byte*>(other.data()));
  EXPECT_EQ(read.code(), absl::StatusCode::kFailedPrecondition) << read;
  EXPECT_EQ(read.message(), "shared-memory transfer: a segment naming memory holds no block to read");
  const absl::Status wrote = segment->write_block(reinterpret_cast<const std::byte*>(other.data()));
  EXPECT_EQ(wrote.code(), absl::StatusCode::kFailedPrecondition) << wrote;
  EXPECT_EQ(wrote.message(), "shared-memory transfer: a segment naming memory holds no block to write");
  EXPECT_EQ(std::count(mine.begin(), mine.end(), 7), 16);
  EXPECT_EQ(std::count(other.begin(), other.end(), -1), 16);
}

// A withdraw that the kernel refuses (here the lock, on an fd closed under the segment: EBADF)
// cannot tell its caller that the memory is safe to reuse, nor leave it exposed: the process
// aborts, naming the fetch's device and the segment.
TEST(ShmSegmentWithdrawDeathTest, AFailedWithdrawAbortsTheProcess) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  std::vector<std::byte> into(64);
  absl::StatusOr<ShmSegment> segment = ShmSegment::create_direct(into.data(), 64);
  ASSERT_TRUE(segment.ok()) << segment.status();
  EXPECT_DEATH(
      {
        close(segment->fd());
        segment->withdraw("fetch: device 7 (127.0.0.1:1)");
      },
      "fetch: device 7 \\(127.0.0.1:1\\): withdrawing the shared-memory segment \\(fd [0-9]+\\) naming 64 bytes of "
      "this process's memory at 0x[0-9a-f]+: locking it: Bad file descriptor; aborting");
}

// A segment that names no memory of this process (one holding its block, as the pool's do)
// cannot be withdrawn: calling withdraw on it is the caller's bug, and the process aborts.
TEST(ShmSegmentWithdrawDeathTest, ASegmentNamingNoMemoryOfThisProcessIsNotWithdrawn) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  absl::StatusOr<ShmSegment> pooled = ShmSegment::create(16);
  ASSERT_TRUE(pooled.ok()) << pooled.status();
  EXPECT_DEATH(pooled->withdraw(),
               "withdrawing a shared-memory segment \\(fd [0-9]+\\) that names no memory of this process");
}

}  // namespace
}  // namespace tessera

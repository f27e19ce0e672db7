// Every collective x replica-group layout x dtype x size, run by 8 embedded workers (which
// share memory: the shm path) against a host reference computed here element by element; a
// representative subset again on 8 worker processes run with --shm=false (the gRPC path),
// and the all_reduce algorithms the table does not choose, forced.
#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <thread>

#include "core/subprocess.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// A 2-D block of values as doubles: the reference side of every comparison.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;
  double& at(int64_t r, int64_t c) { return v[r * cols + c]; }
  double at(int64_t r, int64_t c) const { return v[r * cols + c]; }
};

Mat zeros(int64_t rows, int64_t cols) { return Mat{rows, cols, std::vector<double>(rows * cols, 0.0)}; }

double combine(DType dtype, ReduceOp op, double a, double b) {
  if (dtype == DType::kBool) return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? std::max(a, b) : std::min(a, b);
  switch (op) {
    case ReduceOp::kSum:
      return a + b;
    case ReduceOp::kMax:
      return std::max(a, b);
    case ReduceOp::kMin:
      return std::min(a, b);
    case ReduceOp::kProd:
      return a * b;
  }
  return 0;
}

Mat concat(const std::vector<Mat>& parts, int dim) {
  Mat out = dim == 0 ? zeros(parts[0].rows * parts.size(), parts[0].cols)
                     : zeros(parts[0].rows, parts[0].cols * parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    for (int64_t r = 0; r < parts[i].rows; ++r) {
      for (int64_t c = 0; c < parts[i].cols; ++c) {
        if (dim == 0)
          out.at(i * parts[i].rows + r, c) = parts[i].at(r, c);
        else
          out.at(r, i * parts[i].cols + c) = parts[i].at(r, c);
      }
    }
  }
  return out;
}

Mat piece(const Mat& m, int dim, int n, int i) {
  Mat out = dim == 0 ? zeros(m.rows / n, m.cols) : zeros(m.rows, m.cols / n);
  for (int64_t r = 0; r < out.rows; ++r) {
    for (int64_t c = 0; c < out.cols; ++c)
      out.at(r, c) = dim == 0 ? m.at(i * out.rows + r, c) : m.at(r, i * out.cols + c);
  }
  return out;
}

// The expected result on every device, from every device's input.
std::map<int, Mat> reference(const CollectiveSpec& spec, DType dtype, const std::map<int, Mat>& in) {
  std::map<int, Mat> out;
  for (const std::vector<int>& group : spec.groups) {
    const int n = static_cast<int>(group.size());
    Mat reduced = in.at(group[0]);
    for (int j = 1; j < n; ++j) {
      for (size_t k = 0; k < reduced.v.size(); ++k)
        reduced.v[k] = combine(dtype, spec.reduce_op, reduced.v[k], in.at(group[j]).v[k]);
    }
    std::vector<Mat> members;
    for (int d : group) members.push_back(in.at(d));
    for (int r = 0; r < n; ++r) {
      const int device = group[r];
      switch (spec.kind) {
        case CollectiveKind::kAllReduce:
          out[device] = reduced;
          break;
        case CollectiveKind::kAllGather:
          out[device] = concat(members, spec.dimension);
          break;
        case CollectiveKind::kReduceScatter:
          out[device] = piece(reduced, spec.dimension, n, r);
          break;
        case CollectiveKind::kAllToAll: {
          std::vector<Mat> parts;
          for (int j = 0; j < n; ++j) parts.push_back(piece(members[j], spec.split_dimension, n, r));
          out[device] = concat(parts, spec.concat_dimension);
          break;
        }
        case CollectiveKind::kCollectivePermute: {
          out[device] = zeros(in.at(device).rows, in.at(device).cols);
          for (const auto& [s, t] : spec.pairs) {
            if (t == device) out[device] = in.at(s);
          }
          break;
        }
        case CollectiveKind::kBroadcast:
          out[device] = in.at(group[spec.root]);
          break;
        case CollectiveKind::kRaggedAllToAll:  // only a plan's instruction (ragged_all_to_all_test)
          break;
      }
    }
  }
  return out;
}

// Rows [p * rows, (p + 1) * rows) of a (8 * rows, cols) array, as a Mat.
template <typename T>
void to_doubles(const HostArray& a, int64_t begin, std::vector<double>* out) {
  const auto values = a.values<T>();
  for (size_t i = 0; i < out->size(); ++i) (*out)[i] = static_cast<double>(values[begin + i]);
}

Mat block_of(const HostArray& a, int p, int64_t rows) {
  const int64_t cols = a.shape()[1];
  Mat m = zeros(rows, cols);
  const int64_t begin = p * rows * cols;
  switch (a.dtype()) {
    case DType::kF32:
      to_doubles<float>(a, begin, &m.v);
      break;
    case DType::kF64:
      to_doubles<double>(a, begin, &m.v);
      break;
    case DType::kI32:
      to_doubles<int32_t>(a, begin, &m.v);
      break;
    case DType::kI64:
      to_doubles<int64_t>(a, begin, &m.v);
      break;
    case DType::kBool:
      to_doubles<bool>(a, begin, &m.v);
      break;
    case DType::kU32:
      to_doubles<uint32_t>(a, begin, &m.v);
      break;
    case DType::kBF16:
      to_doubles<BFloat16>(a, begin, &m.v);
      break;
    case DType::kF16:
      to_doubles<Float16>(a, begin, &m.v);
      break;
    case DType::kU8:
      to_doubles<uint8_t>(a, begin, &m.v);
      break;
    case DType::kI8:
      to_doubles<int8_t>(a, begin, &m.v);
      break;
    case DType::kI16:
      to_doubles<int16_t>(a, begin, &m.v);
      break;
  }
  return m;
}

HostArray small_integers(DType dtype, const Shape& shape, uint32_t seed) {
  HostArray a(dtype, shape);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(-3, 3);
  for (int64_t i = 0; i < a.size(); ++i) {
    const int v = dist(rng);
    switch (dtype) {
      case DType::kF32:
        a.mutable_values<float>()[i] = static_cast<float>(v);
        break;
      case DType::kF64:
        a.mutable_values<double>()[i] = v;
        break;
      case DType::kI32:
        a.mutable_values<int32_t>()[i] = v;
        break;
      case DType::kI64:
        a.mutable_values<int64_t>()[i] = v;
        break;
      case DType::kBool:
        a.mutable_values<bool>()[i] = v > 0;
        break;
      case DType::kU32:
        a.mutable_values<uint32_t>()[i] = static_cast<uint32_t>(v + 3);  // 0..6: sums of 8 stay exact
        break;
      // Halves compute each step in float32 and round: in [-2, 2] products of 8 are signed powers
      // of two up to 256 and sums at most 16, all exact in bfloat16 and float16. One-byte integers
      // would wrap on a product of 8 values beyond +-1 (uint8: 0 or 1).
      case DType::kBF16:
        a.mutable_values<BFloat16>()[i] = BFloat16(std::clamp(v, -2, 2));
        break;
      case DType::kF16:
        a.mutable_values<Float16>()[i] = Float16(std::clamp(v, -2, 2));
        break;
      case DType::kU8:
        a.mutable_values<uint8_t>()[i] = static_cast<uint8_t>(v > 0);
        break;
      case DType::kI8:
        a.mutable_values<int8_t>()[i] = static_cast<int8_t>(std::clamp(v, -1, 1));
        break;
      case DType::kI16:
        a.mutable_values<int16_t>()[i] = static_cast<int16_t>(v);
        break;
    }
  }
  return a;
}

struct Layout {
  std::vector<int64_t> mesh_shape;
  std::vector<std::string> names;
  std::vector<std::string> over;
  std::string label;
};

// Keep gtest (and ctest's listing) from dumping the parameters' bytes.
void PrintTo(const Layout& layout, std::ostream* os) { *os << layout.label; }

std::vector<Layout> layouts() {
  return {{{8}, {"x"}, {"x"}, "8_over_x"},
          {{4, 2}, {"data", "model"}, {"data"}, "4x2_over_data"},
          {{4, 2}, {"data", "model"}, {"model"}, "4x2_over_model"},
          {{4, 2}, {"data", "model"}, {"data", "model"}, "4x2_over_both"},
          {{2, 4}, {"a", "b"}, {"a"}, "2x4_over_a"},
          {{2, 4}, {"a", "b"}, {"b"}, "2x4_over_b"},
          {{2, 4}, {"a", "b"}, {"b", "a"}, "2x4_over_b_a"}};
}

struct Case {
  std::string name;
  CollectiveSpec spec;  // groups filled per layout
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

std::vector<Case> cases() {
  std::vector<Case> out;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd}) {
    CollectiveSpec s;
    s.kind = CollectiveKind::kAllReduce;
    s.reduce_op = op;
    out.push_back({"all_reduce_" + reduce_op_name(op), s});
  }
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    for (int dim : {0, 1}) {
      CollectiveSpec s;
      s.kind = CollectiveKind::kReduceScatter;
      s.reduce_op = op;
      s.dimension = dim;
      out.push_back({"reduce_scatter_" + reduce_op_name(op) + "_dim" + std::to_string(dim), s});
    }
  }
  for (int dim : {0, 1}) {
    CollectiveSpec s;
    s.kind = CollectiveKind::kAllGather;
    s.dimension = dim;
    out.push_back({"all_gather_dim" + std::to_string(dim), s});
  }
  for (auto [split, concat] : {std::pair{0, 1}, std::pair{1, 0}, std::pair{1, 1}}) {
    CollectiveSpec s;
    s.kind = CollectiveKind::kAllToAll;
    s.split_dimension = split;
    s.concat_dimension = concat;
    out.push_back({"all_to_all_split" + std::to_string(split) + "_concat" + std::to_string(concat), s});
  }
  CollectiveSpec permute;
  permute.kind = CollectiveKind::kCollectivePermute;
  out.push_back({"collective_permute", permute});
  CollectiveSpec bcast;
  bcast.kind = CollectiveKind::kBroadcast;
  out.push_back({"broadcast", bcast});
  return out;
}

class CollectivesTest : public ::testing::TestWithParam<std::tuple<Layout, Case>> {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<Client> client = Client::local(8, {.memory_bytes_per_device = int64_t{1} << 30});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = new Client(*std::move(client));
  }
  static void TearDownTestSuite() { delete client_; }
  static Client* client_;
};
Client* CollectivesTest::client_ = nullptr;

// Block shapes for a group of n: one element (or the least a split needs), an odd size,
// one of a ragged size past the small-message threshold (ring segments of unequal length),
// and, for f32 and bf16 only, 3 MiB per device. The large-block path (the pipelined chain
// and its segmenting) works on bytes whatever the dtype, and the kernels that do depend on
// it already run on every dtype in the smaller blocks; 3 MiB on all 12 dtypes made single
// cases of this suite take over two minutes in CI.
std::vector<Shape> block_shapes(const CollectiveSpec& spec, DType dtype, int64_t n) {
  int64_t need_rows = 1, need_cols = 1;
  if (spec.kind == CollectiveKind::kReduceScatter) (spec.dimension == 0 ? need_rows : need_cols) = n;
  if (spec.kind == CollectiveKind::kAllToAll) (spec.split_dimension == 0 ? need_rows : need_cols) = n;
  const int64_t ragged = (int64_t{96} << 10) / dtype_size(dtype) + 1;  // 96 KiB and one element
  std::vector<Shape> shapes = {{need_rows, need_cols}, {need_rows * 3, need_cols * 5}, {need_rows, need_cols * ragged}};
  if (dtype == DType::kF32 || dtype == DType::kBF16) {
    shapes.push_back({(int64_t{3} << 20) / (1024 * dtype_size(dtype)), 1024});
  }
  return shapes;
}

// Runs `c` over `layout` on `client`'s 8 devices for every dtype and block shape and checks
// every device's result against the host reference.
void check_against_reference(const Client& client, const Layout& layout, const Case& c);

// Collective messages the first `n` devices received through shared memory so far (or, with
// `in_process`, that peers of their process filed straight into their mailboxes).
int64_t shm_messages(const Client& client, bool in_process = false, int n = 8) {
  int64_t total = 0;
  for (int d = 0; d < n; ++d) {
    absl::StatusOr<DeviceStats> stats = client.device_stats(d);
    EXPECT_TRUE(stats.ok()) << stats.status();
    if (stats.ok()) total += in_process ? stats->in_process_messages_received : stats->shm_messages_received;
  }
  return total;
}

TEST_P(CollectivesTest, MatchesHostReference) {
  const auto& [layout, c] = GetParam();
  const int64_t before = shm_messages(*client_, /*in_process=*/true), shm_before = shm_messages(*client_);
  check_against_reference(*client_, layout, c);
  // Embedded workers of one process: their collectives' messages went straight into their
  // peers' mailboxes (every layout's groups have two members or more), none through a ring.
  EXPECT_GT(shm_messages(*client_, /*in_process=*/true), before);
  EXPECT_EQ(shm_messages(*client_), shm_before);
}

// The shared-memory path (workers of one host, not of one process): the embedded cluster over
// TCP (LocalOptions::in_process = false), whose workers offer each other rings; one case of
// each collective over the 1-D layout (about 20 s each on 2 cores).
class ShmCollectivesTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<Client> client =
        Client::local(8, {.memory_bytes_per_device = int64_t{1} << 30, .in_process = false});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = new Client(*std::move(client));
  }
  static void TearDownTestSuite() { delete client_; }
  static Client* client_;
};
Client* ShmCollectivesTest::client_ = nullptr;

TEST_P(ShmCollectivesTest, MatchesHostReference) {
  const int64_t before = shm_messages(*client_);
  check_against_reference(*client_, layouts()[0], GetParam());
  EXPECT_GT(shm_messages(*client_), before);
  EXPECT_EQ(shm_messages(*client_, /*in_process=*/true), 0);
}

// A jitted shard_map holding one scalar psum over the 8 devices of `client` (what bench_dispatch
// times), called 3 times: every block plus the sum of the whole array, against the host's sum.
void check_jitted_psum(const Client& client, uint32_t seed) {
  absl::StatusOr<Mesh> mesh = client.make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = small_integers(DType::kF32, {8, 8}, seed);
  absl::StatusOr<Array> x = client.device_put(host, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(x.ok()) << x.status();
  const ShardMapped body = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] + psum(sum(in[0]), {"data", "model"})};
      },
      *mesh, {P("data", "model")}, {P("data", "model")});
  Jitted f = jit([&body](const std::vector<Value>& in) { return body(in); });
  double total = 0;
  for (float v : host.values<float>()) total += v;
  for (int call = 0; call < 3; ++call) {
    absl::StatusOr<std::vector<Array>> y = f({*x});
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<HostArray> got = (*y)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t i = 0; i < 64; ++i) {
      ASSERT_EQ(got->values<float>()[i], static_cast<float>(host.values<float>()[i] + total)) << "element " << i;
    }
  }
}

// The jitted psum on Client::local(8), and every device took its messages in process.
TEST(Collectives, AJittedScalarPsumGoesInProcessAndMatchesTheHostSum) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<int64_t> before(8), stepped_before(8);
  for (int d = 0; d < 8; ++d) {
    before[d] = client->device_stats(d)->in_process_messages_received;
    stepped_before[d] = client->device_stats(d)->plan_runs_stepped;
  }
  ASSERT_NO_FATAL_FAILURE(check_jitted_psum(*client, 5));
  // The table's in-process algorithm: every device takes at least one message per call.
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<DeviceStats> stats = client->device_stats(d);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_GE(stats->in_process_messages_received - before[d], 3) << "device " << d;
    EXPECT_EQ(stats->shm_messages_received, 0) << "device " << d;
    // Its inputs ready and its only collective a tree all_reduce in process, each of the 3
    // calls started stepped on every device (design.md, "Stepped runs"), not on a plan thread.
    EXPECT_EQ(stats->plan_runs_stepped - stepped_before[d], 3) << "device " << d;
  }
}

// A chain of jitted psums on Client::local(8), each call consuming the last one's output and
// sent before it finished: on a device, a run whose input the run before it still makes
// waits for it and then starts on the thread that ended it, stepped as a first run is
// (design.md, "Stepped runs"), not on a plan thread. Every run of every call started stepped
// on every device, and each link matches the host: x / 2 + sum(x) / 64 per step (the psum of
// the blocks' sums is the whole array's sum, added to every element).
TEST(Collectives, AChainOfJittedPsumsStepsOnEveryDeviceAndMatchesTheHost) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = small_integers(DType::kF32, {8, 8}, 9);
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("data", "model")));
  ASSERT_TRUE(x.ok()) << x.status();
  const ShardMapped body = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] * 0.5 + psum(sum(in[0]), {"data", "model"}) * (1.0 / 64)};
      },
      *mesh, {P("data", "model")}, {P("data", "model")});
  Jitted f = jit([&body](const std::vector<Value>& in) { return body(in); });
  {
    absl::StatusOr<std::vector<Array>> warm = f({*x});  // compiled, its plans loaded
    ASSERT_TRUE(warm.ok() && (*warm)[0].block_until_ready().ok());
  }
  std::vector<int64_t> stepped_before(8);
  for (int d = 0; d < 8; ++d) stepped_before[d] = client->device_stats(d)->plan_runs_stepped;
  constexpr int kCalls = 12;
  Array y = *x;
  for (int call = 0; call < kCalls; ++call) {
    absl::StatusOr<std::vector<Array>> next = f({y});
    ASSERT_TRUE(next.ok()) << next.status();
    y = (*next)[0];
  }
  absl::StatusOr<HostArray> got = y.fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  // The host: v <- v / 2 + mean(v), in double; the values stay small exact binary fractions.
  std::vector<double> want(host.values<float>().begin(), host.values<float>().end());
  for (int call = 0; call < kCalls; ++call) {
    double total = 0;
    for (double v : want) total += v;
    for (double& v : want) v = v * 0.5 + total / 64;
  }
  for (int64_t i = 0; i < 64; ++i) {
    ASSERT_NEAR(got->values<float>()[i], want[i], 1e-3 * (1 + std::abs(want[i]))) << "element " << i;
  }
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<DeviceStats> stats = client->device_stats(d);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->plan_runs_stepped - stepped_before[d], kCalls) << "device " << d;
  }
}

void check_against_reference(const Client& client, const Layout& layout, const Case& c) {
  const Client* client_ = &client;
  absl::StatusOr<Mesh> mesh = client_->make_mesh(layout.mesh_shape, layout.names);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  CollectiveSpec spec = c.spec;
  absl::StatusOr<std::vector<std::vector<int>>> groups = replica_groups(*mesh, layout.over);
  ASSERT_TRUE(groups.ok()) << groups.status();
  spec.groups = *groups;
  const int n = static_cast<int>(spec.groups[0].size());
  for (const std::vector<int>& g : spec.groups) {
    // Permute: a shift by one inside each group, the first member left without a source.
    for (int r = 0; r + 1 < n; ++r) spec.pairs.emplace_back(g[r], g[r + 1]);
  }
  spec.root = n > 1 ? 1 : 0;
  const NamedSharding per_device(*mesh, P(Axes(layout.names.begin(), layout.names.end()), None));
  uint32_t seed = 7;
  // The dtypes of #15 item 6 (halves and small integers) run on one layout per group size
  // (8, 4, 2: every algorithm the tables choose), the older ones on all: the kernels are the
  // same per dtype whatever the mesh, and the suite stays within its time.
  const bool every_dtype =
      layout.label == "8_over_x" || layout.label == "4x2_over_data" || layout.label == "4x2_over_model";
  for (DType dtype : kAllDTypes) {
    const bool added = dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kU8 || dtype == DType::kI8 ||
                       dtype == DType::kI16;
    if (added && !every_dtype) continue;
    for (const Shape& block : block_shapes(spec, dtype, n)) {
      SCOPED_TRACE(dtype_name(dtype) + " block " + shape_to_string(block));
      const HostArray host = small_integers(dtype, {8 * block[0], block[1]}, seed++);
      absl::StatusOr<Array> x = client_->device_put(host, per_device);
      ASSERT_TRUE(x.ok()) << x.status();
      absl::StatusOr<Array> y = run_collective(*x, spec);
      ASSERT_TRUE(y.ok()) << y.status();
      absl::StatusOr<HostArray> got = y->fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      std::map<int, Mat> inputs;
      for (int p = 0; p < 8; ++p) inputs[mesh->device_ids()[p]] = block_of(host, p, block[0]);
      const std::map<int, Mat> want = reference(spec, dtype, inputs);
      const int64_t out_rows = got->shape()[0] / 8;
      for (int p = 0; p < 8; ++p) {
        const Mat& w = want.at(mesh->device_ids()[p]);
        ASSERT_EQ(out_rows, w.rows);
        ASSERT_EQ(got->shape()[1], w.cols);
        const Mat g = block_of(*got, p, out_rows);
        for (size_t k = 0; k < w.v.size(); ++k) {
          // Small integers: every dtype computes these exactly.
          ASSERT_EQ(g.v[k], w.v[k]) << "device " << mesh->device_ids()[p] << " element " << k;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, CollectivesTest,
                         ::testing::Combine(::testing::ValuesIn(layouts()), ::testing::ValuesIn(cases())),
                         [](const auto& info) {
                           return std::get<0>(info.param).label + "_" + std::get<1>(info.param).name;
                         });

// 8 worker processes with `worker_flags`, and a client of them.
class ProcessCollectives {
 public:
  explicit ProcessCollectives(std::vector<std::string> worker_flags) {
    worker_flags.push_back("--memory_bytes=1073741824");
    absl::StatusOr<ProcessCluster> cluster = ProcessCluster::start(TESSERA_BIN_DIR, 8, {}, worker_flags);
    EXPECT_TRUE(cluster.ok()) << cluster.status();
    if (!cluster.ok()) return;
    cluster_ = *std::move(cluster);
    absl::StatusOr<Client> client = Client::connect(cluster_.address, {.min_devices = 8});
    EXPECT_TRUE(client.ok()) << client.status();
    if (client.ok()) client_ = std::make_unique<Client>(*std::move(client));
  }
  ~ProcessCollectives() { client_.reset(); }  // before the processes go

  const Client* client() const { return client_.get(); }

 private:
  ProcessCluster cluster_;
  // (A unique_ptr, not an optional: GCC 12 warns that an optional's destructor may read an
  // uninitialized member, a false positive that -Werror turns into a failure.)
  std::unique_ptr<Client> client_;
};

// The gRPC path (workers run --shm=false): one case of each collective over the 1-D and a
// 2-D layout, which between them take every algorithm the table chooses on gRPC.
class GrpcCollectivesTest : public ::testing::TestWithParam<Case> {};

TEST_P(GrpcCollectivesTest, MatchesHostReference) {
  ProcessCollectives cluster({"--shm=false"});
  ASSERT_NE(cluster.client(), nullptr);
  for (const Layout& layout : {layouts()[0], layouts()[3]}) {
    SCOPED_TRACE(layout.label);
    check_against_reference(*cluster.client(), layout, GetParam());
  }
  EXPECT_EQ(shm_messages(*cluster.client()), 0);
}

std::vector<Case> grpc_cases() {
  std::vector<Case> out;
  for (const Case& c : cases()) {
    if (c.name == "all_reduce_sum" || c.name == "reduce_scatter_max_dim1" || c.name == "all_gather_dim0" ||
        c.name == "all_to_all_split1_concat0" || c.name == "collective_permute" || c.name == "broadcast") {
      out.push_back(c);
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grpc, GrpcCollectivesTest, ::testing::ValuesIn(grpc_cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(Shm, ShmCollectivesTest, ::testing::ValuesIn(grpc_cases()),
                         [](const auto& info) { return info.param.name; });

// An all_reduce over the one axis of `mesh` (n devices) of an (n, cols) f32 array of small
// integers, one row per device, against the host's sum of the rows on every member.
void check_all_reduce_of_rows(const Client& client, const Mesh& mesh, int64_t cols, uint32_t seed) {
  const int n = static_cast<int>(mesh.device_ids().size());
  const HostArray host = small_integers(DType::kF32, {n, cols}, seed);
  absl::StatusOr<Array> x = client.device_put(host, NamedSharding(mesh, P("x")));
  ASSERT_TRUE(x.ok()) << x.status();
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllReduce;
  spec.groups = {mesh.device_ids()};
  absl::StatusOr<Array> y = run_collective(*x, spec);
  ASSERT_TRUE(y.ok()) << y.status();
  absl::StatusOr<HostArray> got = y->fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  for (int64_t k = 0; k < cols; ++k) {
    float want = 0;
    for (int r = 0; r < n; ++r) want += host.values<float>()[r * cols + k];
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(got->values<float>()[r * cols + k], want) << "device " << r << " element " << k;
    }
  }
}

// The all_reduce algorithms the table does not choose here (they are there to measure it
// again), forced on every worker: groups of 8 and of 6 (recursive doubling folds the two
// past the power of two in), on shared memory and on gRPC.
TEST(ForcedAllReduce, RecursiveDoublingAndDirectMatchTheReference) {
  for (const std::string algorithm : {"recursive_doubling", "direct"}) {
    for (const std::string shm : {"true", "false"}) {
      SCOPED_TRACE(algorithm + " shm=" + shm);
      ProcessCollectives cluster({"--all_reduce_algorithm=" + algorithm, "--shm=" + shm});
      ASSERT_NE(cluster.client(), nullptr);
      for (int n : {8, 6}) {
        std::vector<int> ids;
        for (int d = 0; d < n; ++d) ids.push_back(d);
        absl::StatusOr<Mesh> mesh = cluster.client()->make_mesh({n}, {"x"}, ids);
        ASSERT_TRUE(mesh.ok()) << mesh.status();
        for (int64_t cols : {int64_t{3}, int64_t{5000}}) {
          ASSERT_NO_FATAL_FAILURE(check_all_reduce_of_rows(*cluster.client(), *mesh, cols, 11));
        }
      }
      if (shm == "true") {
        EXPECT_GT(shm_messages(*cluster.client()), 0);
      }
    }
  }
}

TEST(Collectives, ConcurrentCollectivesOnDisjointGroups) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<std::thread> threads;
  std::vector<absl::Status> results(2);
  for (int half = 0; half < 2; ++half) {
    threads.emplace_back([&, half] {
      std::vector<int> ids;
      for (int i = 0; i < 4; ++i) ids.push_back(half * 4 + i);
      absl::StatusOr<Mesh> mesh = client->make_mesh({4}, {"x"}, ids);
      CollectiveSpec spec;
      spec.kind = CollectiveKind::kAllReduce;
      spec.groups = {ids};
      const HostArray host = HostArray::arange(DType::kI64, {4, 300000});  // 2.3 MiB per device: ring path
      for (int iter = 0; iter < 5 && results[half].ok(); ++iter) {
        absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P("x")));
        absl::StatusOr<Array> y = x.ok() ? run_collective(*x, spec) : x;
        absl::StatusOr<HostArray> got = y.ok() ? y->fetch() : y.status();
        if (!got.ok()) {
          results[half] = got.status();
          break;
        }
        for (int64_t c = 0; c < 300000; c += 997) {
          const int64_t want = 4 * c + 300000 * (0 + 1 + 2 + 3);
          if (got->values<int64_t>()[c] != want) results[half] = absl::InternalError("wrong sum");
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];
}

// With barrier_first every member runs a one-element all-reduce over the same groups before
// its clock starts; the result is the same, and the reported time is the slowest member's,
// which cannot exceed the whole call.
TEST(Collectives, TimedWithABarrierFirst) {
  absl::StatusOr<Client> client = Client::local(8);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  CollectiveSpec spec;
  spec.kind = CollectiveKind::kAllReduce;
  spec.groups = *replica_groups(*mesh, {"data"});  // {0,2,4,6}, {1,3,5,7}
  const HostArray host = HostArray::arange(DType::kI32, {8, 5});
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P(Axes{"data", "model"})));
  ASSERT_TRUE(x.ok()) << x.status();
  for (bool barrier : {false, true}) {
    CollectiveTiming timing;
    timing.barrier_first = barrier;
    const absl::Time start = absl::Now();
    absl::StatusOr<Array> y = run_collective(*x, spec, absl::Seconds(10), &timing);
    const absl::Duration call = absl::Now() - start;
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<HostArray> got = y->fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    // Row r of the result is the sum of the rows of its "data" group: r % 2 picks the group.
    for (int64_t r = 0; r < 8; ++r) {
      for (int64_t c = 0; c < 5; ++c) {
        int32_t want = 0;
        for (int64_t k = r % 2; k < 8; k += 2) want += static_cast<int32_t>(k * 5 + c);
        ASSERT_EQ(got->values<int32_t>()[r * 5 + c], want) << "row " << r << " column " << c;
      }
    }
    EXPECT_GT(timing.collective, absl::ZeroDuration());
    EXPECT_LE(timing.collective, call);
  }
}

// Small all-reduces run as a binomial tree; groups whose size is not a power of two (3 and
// 6 here) have incomplete subtrees. Every member must get the group's sum.
TEST(Collectives, SmallAllReduceOnGroupsOfThreeAndSix) {
  absl::StatusOr<Client> client = Client::local(6);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({3, 2}, {"a", "b"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray host = HostArray::arange(DType::kI64, {6, 7});  // block of device d: row d
  absl::StatusOr<Array> x = client->device_put(host, NamedSharding(*mesh, P(Axes{"a", "b"})));
  ASSERT_TRUE(x.ok()) << x.status();
  for (const std::vector<std::string>& axes : {std::vector<std::string>{"a"}, std::vector<std::string>{"a", "b"}}) {
    CollectiveSpec spec;
    spec.kind = CollectiveKind::kAllReduce;
    spec.groups = *replica_groups(*mesh, axes);  // {0,2,4}, {1,3,5}; or all six
    absl::StatusOr<Array> y = run_collective(*x, spec);
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<HostArray> got = y->fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t d = 0; d < 6; ++d) {
      for (int64_t c = 0; c < 7; ++c) {
        int64_t want = 0;
        for (int64_t e = 0; e < 6; ++e) {
          if (axes.size() == 2 || e % 2 == d % 2) want += e * 7 + c;
        }
        ASSERT_EQ(got->values<int64_t>()[d * 7 + c], want)
            << "device " << d << " column " << c << " over " << axes.size() << " axes";
      }
    }
  }
}

TEST(Collectives, BadSpecsAreInvalidArgument) {
  absl::StatusOr<Client> client = Client::local(4);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<Mesh> mesh = client->make_mesh({4}, {"x"});
  absl::StatusOr<Array> x = client->device_put(HostArray::arange(DType::kF32, {4, 6}), NamedSharding(*mesh, P("x")));
  ASSERT_TRUE(x.ok());
  auto expect_invalid = [&](CollectiveSpec spec, const std::string& part) {
    absl::StatusOr<Array> y = run_collective(*x, spec);
    ASSERT_FALSE(y.ok()) << part;
    EXPECT_EQ(y.status().code(), absl::StatusCode::kInvalidArgument) << y.status();
    EXPECT_THAT(std::string(y.status().message()), HasSubstr(part));
  };
  CollectiveSpec s;
  s.kind = CollectiveKind::kAllReduce;
  s.groups = {{0, 1}, {1, 2, 3}};
  expect_invalid(s, "replica group 1 has 3 devices");
  s.groups = {{0, 1}, {1, 3}};
  expect_invalid(s, "device 1 is in more than one replica group");
  s.groups = {{0, 1}};
  expect_invalid(s, "cover 2 of the 4 devices");
  s.groups = {{0, 1, 2, 9}};
  expect_invalid(s, "device 9 is not in the mesh");
  s.groups = {{0, 1, 2, 3}};
  s.kind = CollectiveKind::kReduceScatter;
  s.dimension = 1;  // blocks are (1, 6): 6 is not divisible by 4
  expect_invalid(s, "dimension 1 of size 6 is not divisible by the group size 4");
  s.dimension = 2;
  expect_invalid(s, "dimension 2 is out of range");
  s.kind = CollectiveKind::kCollectivePermute;
  s.pairs = {{0, 1}, {0, 2}};
  expect_invalid(s, "device 0 is a source twice");
  s.kind = CollectiveKind::kBroadcast;
  s.root = 4;
  expect_invalid(s, "root 4");
  // A replicated array has no per-device blocks.
  absl::StatusOr<Array> r = client->device_put(HostArray::arange(DType::kF32, {4, 6}), NamedSharding(*mesh, P()));
  ASSERT_TRUE(r.ok());
  s.kind = CollectiveKind::kAllReduce;
  absl::StatusOr<Array> y = run_collective(*r, s);
  ASSERT_FALSE(y.ok());
  EXPECT_THAT(std::string(y.status().message()), HasSubstr("replicated"));
}

}  // namespace
}  // namespace tessera

// lax.ragged_all_to_all in shard_map bodies on Client::local(8): against a host computation of
// the semantics jax/_src/lax/parallel.py's docstring defines (its SEND/RECEIVE pseudocode, with
// output_offsets the sender's view) on the (8) mesh and on the (4, 2) mesh over each axis, with
// uneven sizes, zero-size slices and several slices per device; the docstring's example and
// tests/ragged_collective_test.py's expected values; JAX's trace errors; the run-time bounds
// checks; the varying type; and the gradient (JAX's _ragged_all_to_all_transpose) against the
// transpose worked on the host.
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

// One device's six operands: operand (n_rows, cols), output (m_rows, cols), four K-vectors.
struct DeviceArgs {
  std::vector<float> operand, output;
  std::vector<int32_t> input_offsets, send_sizes, output_offsets, recv_sizes;
};

// A case: the blocks of every device (in mesh order, row-major over the mesh's axes) and the
// replica groups of the axis it runs over (blocks ordered by their position along it).
struct RaggedCase {
  int64_t n_rows = 0, m_rows = 0, cols = 0;
  std::vector<DeviceArgs> devices;
  std::vector<std::vector<int>> groups;
};

// The groups over mesh axis `axis` of a mesh of `shape`: the blocks that differ only in their
// coordinate along it, ordered by it.
std::vector<std::vector<int>> groups_over(const std::vector<int64_t>& shape, size_t axis) {
  int64_t total = 1, inner = 1;
  for (int64_t s : shape) total *= s;
  for (size_t a = axis + 1; a < shape.size(); ++a) inner *= shape[a];
  std::vector<std::vector<int>> out;
  for (int64_t b = 0; b < total; ++b) {
    if ((b / inner) % shape[axis] != 0) continue;  // not the first of its group
    out.emplace_back();
    for (int64_t p = 0; p < shape[axis]; ++p) out.back().push_back(static_cast<int>(b + p * inner));
  }
  return out;
}

// The docstring's semantics, on the host: on the receiver at position p of a group, for each
// i < K, the slice that the sender at position src = i / (K / n) sent it (the sender's slice
// j = p * (K / n) + i % (K / n): operand rows [input_offsets[j], + send_sizes[j])) is written at
// rows [all_to_all(output_offsets)[i] = sender's output_offsets[j], + recv_sizes[i]) of output,
// in order of i.
std::vector<std::vector<float>> host_reference(const RaggedCase& c) {
  std::vector<std::vector<float>> out(c.devices.size());
  for (const std::vector<int>& group : c.groups) {
    const int n = static_cast<int>(group.size());
    for (int p = 0; p < n; ++p) {
      const DeviceArgs& me = c.devices[group[p]];
      const int64_t k = static_cast<int64_t>(me.recv_sizes.size()), per = k / n;
      std::vector<float> result = me.output;
      for (int64_t i = 0; i < k; ++i) {
        const DeviceArgs& sender = c.devices[group[i / per]];
        const int64_t j = p * per + i % per;
        for (int64_t r = 0; r < me.recv_sizes[i]; ++r) {
          for (int64_t col = 0; col < c.cols; ++col) {
            result[(sender.output_offsets[j] + r) * c.cols + col] =
                sender.operand[(sender.input_offsets[j] + r) * c.cols + col];
          }
        }
      }
      out[group[p]] = std::move(result);
    }
  }
  return out;
}

// Valid random operands: on each receiver the slices it gets land one after the other with
// random gaps (so no two overlap), sizes 0..3 with the first slice each receiver gets empty;
// senders read from random rows (slices may overlap there), or with `disjoint_reads` from
// rows no two of a sender's slices share. Distinct values everywhere.
// The groups are `groups` (blocks by position in each).
RaggedCase random_case_in_groups(std::vector<std::vector<int>> groups, int64_t per_device, int64_t cols, uint32_t seed,
                                 bool disjoint_reads = false) {
  std::mt19937 rng(seed);
  RaggedCase c;
  c.groups = std::move(groups);
  const int n = static_cast<int>(c.groups[0].size());
  const int64_t k = n * per_device;
  c.n_rows = disjoint_reads ? k * 4 + 2 : 6;
  c.m_rows = k * 4 + 2;
  c.cols = cols;
  c.devices.resize(c.groups.size() * n);
  for (size_t b = 0; b < c.devices.size(); ++b) {
    DeviceArgs& d = c.devices[b];
    for (int64_t e = 0; e < c.n_rows * cols; ++e) d.operand.push_back(static_cast<float>(1000 * (b + 1) + e));
    for (int64_t e = 0; e < c.m_rows * cols; ++e) d.output.push_back(-static_cast<float>(1000 * (b + 1) + e));
    d.input_offsets.assign(k, 0);
    d.send_sizes.assign(k, 0);
    d.output_offsets.assign(k, 0);
    d.recv_sizes.assign(k, 0);
  }
  for (const std::vector<int>& group : c.groups) {
    for (int p = 0; p < n; ++p) {
      int64_t cursor = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int64_t size = i == 0 ? 0 : static_cast<int64_t>(rng() % 4);
        const int64_t at = cursor + static_cast<int64_t>(rng() % 2);
        cursor = at + size;
        DeviceArgs& sender = c.devices[group[i / per_device]];
        const int64_t j = p * per_device + i % per_device;
        sender.output_offsets[j] = static_cast<int32_t>(at);
        sender.send_sizes[j] = static_cast<int32_t>(size);
        sender.input_offsets[j] = static_cast<int32_t>(rng() % (c.n_rows - size + 1));
        c.devices[group[p]].recv_sizes[i] = static_cast<int32_t>(size);
      }
    }
  }
  if (disjoint_reads) {
    for (DeviceArgs& d : c.devices) {
      int64_t cursor = 0;
      for (int64_t j = 0; j < k; ++j) {
        d.input_offsets[j] = static_cast<int32_t>(cursor + static_cast<int64_t>(rng() % 2));
        cursor = d.input_offsets[j] + d.send_sizes[j];
      }
    }
  }
  return c;
}

RaggedCase random_case(const std::vector<int64_t>& mesh_shape, size_t axis, int64_t per_device, int64_t cols,
                       uint32_t seed, bool disjoint_reads = false) {
  return random_case_in_groups(groups_over(mesh_shape, axis), per_device, cols, seed, disjoint_reads);
}

class RaggedAllToAllTest : public MeshesSuite {
 protected:
  const Mesh& mesh8() const { return meshes_[0]; }
  const Mesh& mesh42() const { return meshes_[1]; }
  const Mesh& mesh24() const { return meshes_[2]; }

  // The per-device blocks stacked into global arrays, split over every mesh axis.
  static std::vector<HostArray> globals(const RaggedCase& c) {
    std::vector<float> operand, output;
    std::vector<int32_t> index[4];
    for (const DeviceArgs& d : c.devices) {
      operand.insert(operand.end(), d.operand.begin(), d.operand.end());
      output.insert(output.end(), d.output.begin(), d.output.end());
      const std::vector<int32_t>* parts[] = {&d.input_offsets, &d.send_sizes, &d.output_offsets, &d.recv_sizes};
      for (int k = 0; k < 4; ++k) index[k].insert(index[k].end(), parts[k]->begin(), parts[k]->end());
    }
    const int64_t devices = static_cast<int64_t>(c.devices.size());
    std::vector<HostArray> out;
    out.push_back(HostArray::from_vector<float>({devices * c.n_rows, c.cols}, operand));
    out.push_back(HostArray::from_vector<float>({devices * c.m_rows, c.cols}, output));
    for (const std::vector<int32_t>& v : index) {
      out.push_back(HostArray::from_vector<int32_t>({static_cast<int64_t>(v.size())}, v));
    }
    return out;
  }

  // `hosts` put on `mesh`: matrices laid out `matrix`, vectors `vector`.
  static absl::StatusOr<std::vector<Array>> put_all(const std::vector<HostArray>& hosts, const Mesh& mesh,
                                                    const PartitionSpec& matrix, const PartitionSpec& vector) {
    std::vector<Array> out;
    for (const HostArray& h : hosts) {
      TESSERA_ASSIGN_OR_RETURN(Array a,
                               client_->device_put(h, NamedSharding(mesh, h.shape().size() == 2 ? matrix : vector)));
      out.push_back(std::move(a));
    }
    return out;
  }

  // shard_map(body) on `mesh` over c's arrays, every argument split over all its axes.
  static absl::StatusOr<HostArray> run_body(const Mesh& mesh, const RaggedCase& c, TracedFunction body) {
    const Axes all = mesh.axis_names();
    ShardMapped f =
        shard_map(std::move(body), mesh, {P(all, None), P(all, None), P(all), P(all), P(all), P(all)}, {P(all, None)});
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> args, put_all(globals(c), mesh, P(all, None), P(all)));
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> out, f(args));
    return out[0].fetch();
  }

  // shard_map(ragged_all_to_all over `axis`) on `mesh`, every argument split over all its axes.
  static absl::StatusOr<HostArray> run(const Mesh& mesh, const std::string& axis, const RaggedCase& c) {
    return run_body(mesh, c, [axis](const std::vector<Value>& in) {
      return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], axis)};
    });
  }

  static void expect_matches_host(const HostArray& got, const RaggedCase& c) {
    const std::vector<std::vector<float>> want = host_reference(c);
    ASSERT_EQ(got.shape(), (Shape{static_cast<int64_t>(c.devices.size()) * c.m_rows, c.cols}));
    const int64_t block = c.m_rows * c.cols;
    for (size_t b = 0; b < want.size(); ++b) {
      for (int64_t e = 0; e < block; ++e) {
        ASSERT_EQ(got.values<float>()[b * block + e], want[b][e])
            << "device block " << b << ", row " << e / c.cols << ", column " << e % c.cols;
      }
    }
  }
};

// The docstring's example (jax/_src/lax/parallel.py, ragged_all_to_all: "if we apply a
// ragged_all_to_all along an axis of size 2 ..."), which tests/ragged_collective_test.py's
// test_ragged_all_to_all runs in int32: axis index 0 gets [1, 3, 0, 0], axis index 1
// [2, 2, 4, 0]. Here on 'data' of the (2, 4) mesh: four groups of two, each the example.
TEST_F(RaggedAllToAllTest, JaxDocstringExampleValueByValue) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = mesh24();
  std::vector<int32_t> operand, output, input_offsets, send_sizes, output_offsets, recv_sizes;
  for (int d = 0; d < 2; ++d) {
    for (int m = 0; m < 4; ++m) {
      const bool zero = d == 0;
      for (int32_t v : zero ? std::vector<int32_t>{1, 2, 2} : std::vector<int32_t>{3, 4, 0}) operand.push_back(v);
      for (int r = 0; r < 4; ++r) output.push_back(0);
      for (int32_t v : {0, 1}) input_offsets.push_back(v);
      for (int32_t v : zero ? std::vector<int32_t>{1, 2} : std::vector<int32_t>{1, 1}) send_sizes.push_back(v);
      for (int32_t v : zero ? std::vector<int32_t>{0, 0} : std::vector<int32_t>{1, 2}) output_offsets.push_back(v);
      for (int32_t v : zero ? std::vector<int32_t>{1, 1} : std::vector<int32_t>{2, 1}) recv_sizes.push_back(v);
    }
  }
  const Axes all = mesh.axis_names();
  ShardMapped f = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data")};
      },
      mesh, std::vector<PartitionSpec>(6, P(all)), {P(all)});
  std::vector<HostArray> hosts;
  for (const std::vector<int32_t>* v : {&operand, &output, &input_offsets, &send_sizes, &output_offsets, &recv_sizes}) {
    hosts.push_back(HostArray::from_vector<int32_t>({static_cast<int64_t>(v->size())}, *v));
  }
  absl::StatusOr<std::vector<Array>> args = put_all(hosts, mesh, P(all), P(all));
  ASSERT_TRUE(args.ok()) << args.status();
  absl::StatusOr<std::vector<Array>> out = f(*args);
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->dtype(), DType::kI32);
  std::vector<int32_t> want;
  for (int d = 0; d < 2; ++d) {
    for (int m = 0; m < 4; ++m) {
      for (int32_t v : d == 0 ? std::vector<int32_t>{1, 3, 0, 0} : std::vector<int32_t>{2, 2, 4, 0}) want.push_back(v);
    }
  }
  EXPECT_EQ(std::vector<int32_t>(got->values<int32_t>().begin(), got->values<int32_t>().end()), want);
}

TEST_F(RaggedAllToAllTest, EightDevicesMatchTheHost) {
  ASSERT_NE(client_, nullptr);
  for (int64_t per_device : {1, 2}) {
    SCOPED_TRACE(absl::StrCat(per_device, " slices per device"));
    const RaggedCase c = random_case({8}, 0, per_device, 3, 10 + static_cast<uint32_t>(per_device));
    absl::StatusOr<HostArray> got = run(mesh8(), "data", c);
    ASSERT_TRUE(got.ok()) << got.status();
    expect_matches_host(*got, c);
  }
}

TEST_F(RaggedAllToAllTest, FourByTwoMeshOverOneAxisMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  for (size_t axis : {0, 1}) {
    for (int64_t per_device : {1, 2}) {
      const std::string name = mesh42().axis_names()[axis];
      SCOPED_TRACE(absl::StrCat("over '", name, "', ", per_device, " slices per device"));
      const RaggedCase c = random_case({4, 2}, axis, per_device, 2, 20 + static_cast<uint32_t>(10 * axis + per_device));
      absl::StatusOr<HostArray> got = run(mesh42(), name, c);
      ASSERT_TRUE(got.ok()) << got.status();
      expect_matches_host(*got, c);
    }
  }
}

// In a body manual over 'data' only (axis_names) on the (4, 2) mesh with Auto axes, operand and
// output split over the automatic 'model' along their columns: ragged_all_to_all moves rows
// only, so it runs on each device's columns as they are — its local result is
// (rows, cols / 2) and nothing moves over 'model' — and the result is the host's.
TEST_F(RaggedAllToAllTest, AxisNamesKeepTheAutomaticSplitOfTheColumns) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[1];
  const RaggedCase c = random_case({4}, 0, 2, 4, 41);
  ShardMapped body = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data")};
      },
      mesh, {P("data", None), P("data", None), P("data"), P("data"), P("data"), P("data")}, {P("data", None)},
      {.axis_names = {"data"}});
  Jitted f = jit([body](const std::vector<Value>& in) { return body(in); });
  absl::StatusOr<std::vector<Array>> args = put_all(globals(c), mesh, P("data", "model"), P("data"));
  ASSERT_TRUE(args.ok()) << args.status();
  absl::StatusOr<std::vector<Array>> out = f(*args);
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  expect_matches_host(*got, c);
  const std::string plan = f.as_text();
  EXPECT_THAT(plan, HasSubstr(absl::StrCat("ragged_all_to_all(axes=('data',)) s0 f32[", c.m_rows, ",2] "))) << plan;
  EXPECT_THAT(plan, ::testing::Not(HasSubstr("axes=('model',)"))) << plan;
  EXPECT_EQ((*out)[0].sharding().spec(), P("data", "model"));
}

// axis_index_groups (jax/_src/lax/parallel.py's ragged_all_to_all; tests/ragged_collective_test.py's
// test_ragged_all_to_all_axis_index_groups runs groups [[0, 1], [2, 3]]): each group of positions
// along the axis exchanges among itself, slice i going to the group's member i / (K / g). The
// host reference runs the docstring's semantics within each group; groups in order, out of
// order and of other sizes on the (8) mesh, and over 'data' of the (4, 2) mesh.
TEST_F(RaggedAllToAllTest, AxisIndexGroupsExchangeWithinEachGroupAsTheHost) {
  ASSERT_NE(client_, nullptr);
  struct GroupsCase {
    const Mesh* mesh;
    std::string axis;
    std::vector<std::vector<int64_t>> positions;  // axis_index_groups
    std::vector<std::vector<int>> blocks;         // the same groups as device blocks (mesh order)
    int64_t per_device;
  };
  const std::vector<GroupsCase> cases = {
      {&mesh8(), "data", {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}, 1},
      {&mesh8(), "data", {{0, 3, 5, 6}, {7, 2, 4, 1}}, {{0, 3, 5, 6}, {7, 2, 4, 1}}, 2},
      {&mesh8(), "data", {{4, 1, 0, 5, 2, 7, 6, 3}}, {{4, 1, 0, 5, 2, 7, 6, 3}}, 1},
      // 'data' of (4, 2): position p with 'model' coordinate m is block 2 * p + m.
      {&mesh42(), "data", {{0, 2}, {3, 1}}, {{0, 4}, {6, 2}, {1, 5}, {7, 3}}, 3},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const GroupsCase& g = cases[i];
    SCOPED_TRACE(absl::StrCat("case ", i));
    const RaggedCase c = random_case_in_groups(g.blocks, g.per_device, 2, 60 + static_cast<uint32_t>(i));
    absl::StatusOr<HostArray> got = run_body(*g.mesh, c, [&g](const std::vector<Value>& in) {
      return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], g.axis, g.positions)};
    });
    ASSERT_TRUE(got.ok()) << got.status();
    expect_matches_host(*got, c);
  }
  // Groups that are not a partition of the positions into equal sizes.
  const RaggedCase c = random_case({8}, 0, 1, 2, 7);
  for (const auto& [groups, error] : std::vector<std::pair<std::vector<std::vector<int64_t>>, std::string>>{
           {{{0, 1, 2, 3}, {4, 5, 6}}, "group 1 has 3 positions and group 0 has 4: all groups must be the same size"},
           {{{0, 1, 2, 3}, {4, 5, 6, 6}}, "position 6 is in two groups"},
           {{{0, 1, 2, 3}, {4, 5, 6, 8}}, "position 8 is not a position along the axes (of size 8)"},
           {{{0, 1, 2}, {3, 4, 5}}, "the groups must cover every position along the axes (of size 8) exactly once"},
           {{{0, 1, 2}, {3, 4, 5}, {6, 7, 0}}, "position 0 is in two groups"},
       }) {
    absl::StatusOr<HostArray> out = run_body(mesh8(), c, [&groups](const std::vector<Value>& in) {
      return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data", groups)};
    });
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(error));
  }
}

// vmap of ragged_all_to_all in a shard_map body (JAX's _ragged_all_to_all_batched_collective):
// each example exchanges as it would alone. Three examples per device, each a random case of
// its own (index arrays batched), and three sharing their index arrays (unbatched, broadcast);
// each example's result against the host reference of its case.
TEST_F(RaggedAllToAllTest, VmapRunsEachExampleAsItsOwnExchange) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kExamples = 3;
  for (bool shared : {false, true}) {
    SCOPED_TRACE(shared ? "index arrays shared by the examples" : "index arrays per example");
    std::vector<RaggedCase> examples;
    for (int64_t b = 0; b < kExamples; ++b) {
      examples.push_back(random_case({4, 2}, 0, 2, 2, 80 + static_cast<uint32_t>(shared ? 0 : b)));
      for (DeviceArgs& d : examples.back().devices) {
        for (float& v : d.operand) v += 100000.0f * static_cast<float>(b);
        for (float& v : d.output) v -= 100000.0f * static_cast<float>(b);
      }
    }
    // Each device's block holds its examples one after the other.
    RaggedCase merged = examples[0];
    merged.n_rows *= kExamples;
    merged.m_rows *= kExamples;
    for (size_t d = 0; d < merged.devices.size(); ++d) {
      DeviceArgs& m = merged.devices[d];
      for (int64_t b = 1; b < kExamples; ++b) {
        const DeviceArgs& e = examples[b].devices[d];
        m.operand.insert(m.operand.end(), e.operand.begin(), e.operand.end());
        m.output.insert(m.output.end(), e.output.begin(), e.output.end());
        if (shared) continue;
        m.input_offsets.insert(m.input_offsets.end(), e.input_offsets.begin(), e.input_offsets.end());
        m.send_sizes.insert(m.send_sizes.end(), e.send_sizes.begin(), e.send_sizes.end());
        m.output_offsets.insert(m.output_offsets.end(), e.output_offsets.begin(), e.output_offsets.end());
        m.recv_sizes.insert(m.recv_sizes.end(), e.recv_sizes.begin(), e.recv_sizes.end());
      }
    }
    const RaggedCase& one = examples[0];
    const int64_t k = static_cast<int64_t>(one.devices[0].input_offsets.size());
    absl::StatusOr<HostArray> got = run_body(mesh42(), merged, [&](const std::vector<Value>& in) {
      std::vector<Value> per_example = {reshape(in[0], {kExamples, one.n_rows, one.cols}),
                                        reshape(in[1], {kExamples, one.m_rows, one.cols})};
      std::vector<std::optional<int64_t>> in_axes = {0, 0};
      for (int j = 2; j < 6; ++j) {
        per_example.push_back(shared ? in[j] : reshape(in[j], {kExamples, k}));
        in_axes.push_back(shared ? std::nullopt : std::optional<int64_t>(0));
      }
      TracedFunction exchange = vmap(
          [](const std::vector<Value>& v) {
            return std::vector<Value>{ragged_all_to_all(v[0], v[1], v[2], v[3], v[4], v[5], "data")};
          },
          in_axes);
      return std::vector<Value>{reshape(exchange(per_example)[0], {kExamples * one.m_rows, one.cols})};
    });
    ASSERT_TRUE(got.ok()) << got.status();
    const int64_t block = one.m_rows * one.cols;
    for (int64_t b = 0; b < kExamples; ++b) {
      const std::vector<std::vector<float>> want = host_reference(examples[b]);
      for (size_t d = 0; d < want.size(); ++d) {
        for (int64_t e = 0; e < block; ++e) {
          ASSERT_EQ(got->values<float>()[(d * kExamples + b) * block + e], want[d][e])
              << "example " << b << ", device block " << d << ", row " << e / one.cols;
        }
      }
    }
  }
}

// Nothing sent anywhere: the result is `output` on every device.
TEST_F(RaggedAllToAllTest, AllSizesZeroKeepsTheOutput) {
  ASSERT_NE(client_, nullptr);
  RaggedCase c = random_case({8}, 0, 1, 3, 5);
  for (DeviceArgs& d : c.devices) {
    std::fill(d.send_sizes.begin(), d.send_sizes.end(), 0);
    std::fill(d.recv_sizes.begin(), d.recv_sizes.end(), 0);
  }
  absl::StatusOr<HostArray> got = run(mesh8(), "data", c);
  ASSERT_TRUE(got.ok()) << got.status();
  expect_matches_host(*got, c);
  EXPECT_EQ(got->values<float>()[0], c.devices[0].output[0]);
}

// A slice outside the operand or outside its receiver's output fails the run before anything
// is read or written, naming the device, the slice, the values and the rule; so does a
// receiver whose recv_sizes disagree with what is sent.
TEST_F(RaggedAllToAllTest, OutOfRangeOffsetsFailNamingTheDeviceAndTheValues) {
  ASSERT_NE(client_, nullptr);
  const std::vector<int>& ids = mesh8().device_ids();
  {
    RaggedCase c = random_case({8}, 0, 1, 3, 7);
    c.devices[5].input_offsets[3] = 5;
    c.devices[5].send_sizes[3] = 2;  // rows [5, 7) of 6
    c.devices[3].recv_sizes[5] = 2;
    absl::StatusOr<HostArray> got = run(mesh8(), "data", c);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_THAT(std::string(got.status().message()),
                HasSubstr(absl::StrCat("ragged_all_to_all on device ", ids[5], ": slice 3 (to device ", ids[3],
                                       ") is input_offsets[3] = 5, send_sizes[3] = 2: rows [5, 7) of the operand's 6 "
                                       "must be a range inside it")));
  }
  {
    RaggedCase c = random_case({8}, 0, 1, 3, 8);
    c.devices[2].output_offsets[6] = -1;
    absl::StatusOr<HostArray> got = run(mesh8(), "data", c);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_THAT(std::string(got.status().message()),
                HasSubstr(absl::StrCat("ragged_all_to_all on device ", ids[2], ": slice 6 (to device ", ids[6],
                                       ") is output_offsets[6] = -1")));
  }
  {
    RaggedCase c = random_case({8}, 0, 1, 3, 9);
    c.devices[1].output_offsets[4] = static_cast<int32_t>(c.m_rows);
    c.devices[1].send_sizes[4] = 1;
    c.devices[4].recv_sizes[1] = 1;
    absl::StatusOr<HostArray> got = run(mesh8(), "data", c);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_THAT(std::string(got.status().message()),
                HasSubstr(absl::StrCat("output_offsets[4] = ", c.m_rows, ", send_sizes[4] = 1: rows [", c.m_rows, ", ",
                                       c.m_rows + 1, ") of device ", ids[4], "'s output must be a range inside its ",
                                       c.m_rows, " rows")));
  }
  {
    RaggedCase c = random_case({8}, 0, 1, 3, 11);
    c.devices[6].recv_sizes[2] = c.devices[2].send_sizes[6] + 1;
    absl::StatusOr<HostArray> got = run(mesh8(), "data", c);
    ASSERT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    EXPECT_THAT(std::string(got.status().message()),
                HasSubstr(absl::StrCat("ragged_all_to_all on device ", ids[6], ": device ", ids[2], " sends ",
                                       c.devices[2].send_sizes[6], " rows as its slice 6 but recv_sizes[2] here is ",
                                       c.devices[6].recv_sizes[2],
                                       ": each device's send_sizes must equal all_to_all(recv_sizes")));
  }
}

// tests/ragged_collective_test.py's test_ragged_all_to_all_errors, word for word where JAX
// has them, and the checks its docstring and XLA add.
TEST_F(RaggedAllToAllTest, TraceErrorsAreJaxs) {
  ASSERT_NE(client_, nullptr);
  auto error = [&](std::vector<ArrayType> types) {
    ShardMapped f = shard_map(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data")};
        },
        mesh8(), std::vector<PartitionSpec>(6, P()), {P("data")}, {.check_vma = false});
    return trace([f](const std::vector<Value>& in) { return f(in); }, types).status();
  };
  const ArrayType operand{DType::kF32, {6}}, output{DType::kF32, {7}}, ints{DType::kI32, {8}};
  const char* names[] = {"input_offsets", "send_sizes", "output_offsets", "recv_sizes"};
  for (int k = 0; k < 4; ++k) {
    SCOPED_TRACE(names[k]);
    std::vector<ArrayType> types = {operand, output, ints, ints, ints, ints};
    types[2 + k] = {DType::kF32, {8}};
    EXPECT_THAT(std::string(error(types).message()),
                HasSubstr(absl::StrCat("ragged_all_to_all ", names[k], " must be integer type.")));
    types[2 + k] = {DType::kI32, {1, 8}};
    EXPECT_THAT(std::string(error(types).message()),
                HasSubstr(absl::StrCat("ragged_all_to_all ", names[k],
                                       " must be rank 1 with positive dimension size, but got shape (1, 8)")));
    types[2 + k] = {DType::kI32, {0}};
    EXPECT_THAT(std::string(error(types).message()),
                HasSubstr(absl::StrCat("ragged_all_to_all ", names[k],
                                       " must be rank 1 with positive dimension size, but got shape (0,)")));
  }
  absl::Status s = error({operand, output, ints, {DType::kI32, {16}}, ints, ints});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("must have one length, but send_sizes has shape (16,)"));
  const ArrayType three{DType::kI32, {3}};
  EXPECT_THAT(std::string(error({operand, output, three, three, three, three}).message()),
              HasSubstr("(3) must be divisible by the size of mesh axes ('data',) (8)"));
  EXPECT_THAT(std::string(error({operand, {DType::kI32, {7}}, ints, ints, ints, ints}).message()),
              HasSubstr("operand f32[6] and output i32[7] must have one dtype"));
  EXPECT_THAT(std::string(error({{DType::kF32, {6, 2}}, {DType::kF32, {7, 3}}, ints, ints, ints, ints}).message()),
              HasSubstr("operand f32[6,2] and output f32[7,3] must have one rank"));
  // Outside a shard_map body, as every collective.
  absl::StatusOr<Graph> outside = trace(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data")};
      },
      {operand, output, ints, ints, ints, ints});
  EXPECT_THAT(std::string(outside.status().message()), HasSubstr("only inside a shard_map body"));
}

// The result differs along the axis (each device's holds what others sent it): an out_spec
// that leaves the axis out is refused naming ragged_all_to_all, as for all_to_all.
TEST_F(RaggedAllToAllTest, ResultIsVaryingAlongTheAxis) {
  ASSERT_NE(client_, nullptr);
  ShardMapped f = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data")};
      },
      mesh42(), {P(), P(), P(), P(), P(), P()}, {P()});
  const ArrayType ints{DType::kI32, {4}};
  absl::Status s = trace([f](const std::vector<Value>& in) { return f(in); },
                         {{DType::kF32, {6}}, {DType::kF32, {6}}, ints, ints, ints, ints})
                       .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("may differ along mesh axis 'data' (it depends on ragged_all_to_all over 'data'"));
}

// grad with respect to operand and output of sum(ragged_all_to_all(...) * w), against the
// transpose worked on the host: the output's cotangent is w where nothing was written, 0
// where something was; each operand row sent gets w at the rows it was written to, summed over
// the slices that sent it (JAX's _ragged_all_to_all_transpose; ragged_collective_test.py's
// test_ragged_all_to_all_grad checks the same by finite differences). A sender's slices read
// disjoint rows here: JAX's transpose writes each slice's cotangent back with a
// ragged_all_to_all, so where two slices read one row the last one's wins, not their sum.
TEST_F(RaggedAllToAllTest, GradIsJaxsTranspose) {
  ASSERT_NE(client_, nullptr);
  const RaggedCase c = random_case({4, 2}, 0, 2, 2, 31, /*disjoint_reads=*/true);
  const Mesh& mesh = mesh42();
  const Axes all = mesh.axis_names();
  ShardMapped body = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ragged_all_to_all(in[0], in[1], in[2], in[3], in[4], in[5], "data") * in[6]};
      },
      mesh, {P(all, None), P(all, None), P(all), P(all), P(all), P(all), P(all, None)}, {P(all, None)});
  TracedFunction loss = [body](const std::vector<Value>& in) { return std::vector<Value>{sum(body(in)[0], {})}; };
  Jitted f = jit(grad(loss, {0, 1}));
  std::vector<HostArray> host = globals(c);
  const int64_t devices = static_cast<int64_t>(c.devices.size());
  std::vector<float> w;
  for (int64_t e = 0; e < devices * c.m_rows * c.cols; ++e) w.push_back(static_cast<float>(e % 17) - 8.0f);
  host.push_back(HostArray::from_vector<float>({devices * c.m_rows, c.cols}, w));
  absl::StatusOr<std::vector<Array>> args = put_all(host, mesh, P(all, None), P(all));
  ASSERT_TRUE(args.ok()) << args.status();
  absl::StatusOr<std::vector<Array>> out = f(*args);
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> d_operand = (*out)[0].fetch();
  absl::StatusOr<HostArray> d_output = (*out)[1].fetch();
  ASSERT_TRUE(d_operand.ok() && d_output.ok());
  // The transpose on the host.
  std::vector<float> want_operand(devices * c.n_rows * c.cols, 0.0f), want_output = w;
  for (const std::vector<int>& group : c.groups) {
    const int n = static_cast<int>(group.size());
    for (int p = 0; p < n; ++p) {
      const int receiver = group[p];
      const DeviceArgs& me = c.devices[receiver];
      const int64_t k = static_cast<int64_t>(me.recv_sizes.size()), per = k / n;
      for (int64_t i = 0; i < k; ++i) {
        const int sender = group[i / per];
        const DeviceArgs& s = c.devices[sender];
        const int64_t j = p * per + i % per;
        for (int64_t r = 0; r < me.recv_sizes[i]; ++r) {
          for (int64_t col = 0; col < c.cols; ++col) {
            const int64_t at = (receiver * c.m_rows + s.output_offsets[j] + r) * c.cols + col;
            want_operand[(sender * c.n_rows + s.input_offsets[j] + r) * c.cols + col] += w[at];
            want_output[at] = 0.0f;
          }
        }
      }
    }
  }
  ASSERT_EQ(d_operand->shape(), (Shape{devices * c.n_rows, c.cols}));
  ASSERT_EQ(d_output->shape(), (Shape{devices * c.m_rows, c.cols}));
  for (size_t e = 0; e < want_operand.size(); ++e) EXPECT_EQ(d_operand->values<float>()[e], want_operand[e]) << e;
  for (size_t e = 0; e < want_output.size(); ++e) EXPECT_EQ(d_output->values<float>()[e], want_output[e]) << e;
}

}  // namespace
}  // namespace tessera

// Mesh and NamedSharding against JAX's documented semantics.
//
// The layout tables below are written out by hand from JAX's rules, on a (4, 2) mesh
// ("data", "model") of devices 0..7 laid row-major, so the device at coordinates (i, j) is
// 2 * i + j (jax.make_mesh's order for CPU devices):
//   - dimension d is split into prod(sizes of spec[d]) blocks; a device holds block
//     linearize(coords on those axes), the first axis major;
//   - replica_id (JAX's Shard.replica_id) is the device's rank, in mesh order, among the
//     devices holding the same block.
#include "core/sharding.h"

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "core/shape.h"
#include "core/unreduced_move.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {

// Readable failure messages for Index comparisons.
inline void PrintTo(const Slice& s, std::ostream* os) { *os << s.start << ":" << s.stop; }

namespace {

using ::testing::HasSubstr;

const std::vector<int> kDevices = {0, 1, 2, 3, 4, 5, 6, 7};

Mesh Mesh4x2() { return make_mesh({4, 2}, {"data", "model"}, kDevices).value(); }

// What one device must hold: its block of the global array and its replica id.
struct Expected {
  Index index;
  int64_t replica_id;
};

// Checks every derived quantity of NamedSharding(Mesh4x2(), spec) on `shape`.
void CheckLayout(const Shape& shape, const PartitionSpec& spec, const Shape& shard_shape, int64_t num_replicas,
                 bool fully_replicated, const std::vector<Expected>& expected) {
  SCOPED_TRACE(spec.to_string() + " on " + shape_to_string(shape));
  NamedSharding sharding(Mesh4x2(), spec);
  absl::Status status = sharding.validate(shape);
  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(sharding.shard_shape(shape), shard_shape);
  EXPECT_EQ(sharding.num_replicas(), num_replicas);
  EXPECT_EQ(sharding.is_fully_replicated(), fully_replicated);

  std::vector<DeviceShard> shards = sharding.device_shards(shape);
  ASSERT_EQ(shards.size(), expected.size());
  for (size_t d = 0; d < expected.size(); ++d) {
    SCOPED_TRACE("device " + std::to_string(d));
    EXPECT_EQ(shards[d].device_id, static_cast<int>(d));
    EXPECT_EQ(shards[d].mesh_position, static_cast<int64_t>(d));
    EXPECT_EQ(shards[d].index, expected[d].index);
    EXPECT_EQ(shards[d].replica_id, expected[d].replica_id);
  }
}

// ---- Mesh ----------------------------------------------------------------------------------

TEST(Mesh, MakeMesh4x2IsRowMajor) {
  Mesh mesh = Mesh4x2();
  EXPECT_EQ(mesh.shape(), (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(mesh.axis_names(), (std::vector<std::string>{"data", "model"}));
  EXPECT_EQ(mesh.device_ids(), kDevices);
  EXPECT_EQ(mesh.rank(), 2);
  EXPECT_EQ(mesh.size(), 8);
  EXPECT_EQ(mesh.axis_index("data"), 0);
  EXPECT_EQ(mesh.axis_index("model"), 1);
  EXPECT_EQ(mesh.axis_index("expert"), -1);
  EXPECT_EQ(mesh.axis_size("data"), 4);
  EXPECT_EQ(mesh.axis_size("model"), 2);

  const std::vector<std::vector<int64_t>> coords = {{0, 0}, {0, 1}, {1, 0}, {1, 1}, {2, 0}, {2, 1}, {3, 0}, {3, 1}};
  for (size_t p = 0; p < coords.size(); ++p) {
    EXPECT_EQ(mesh.coords(static_cast<int64_t>(p)), coords[p]) << "position " << p;
    EXPECT_EQ(mesh.device_at(coords[p]), static_cast<int>(p)) << "position " << p;
  }
}

TEST(Mesh, DeviceAtFollowsGivenDeviceOrder) {
  Mesh mesh = make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0}).value();
  EXPECT_EQ(mesh.device_at({0, 0}), 7);
  EXPECT_EQ(mesh.device_at({1, 1}), 4);
  EXPECT_EQ(mesh.device_at({3, 1}), 0);
  EXPECT_NE(mesh, Mesh4x2());
  EXPECT_EQ(Mesh4x2(), Mesh4x2());
}

// jax/_src/mesh.py Mesh.__str__ always shows the axis types, a Python tuple of their names;
// docs/multi_process.md prints `Mesh('a': 8, axis_types=(Explicit,))`, and
// docs/pallas/tpu/core_map.md prints `jax.make_mesh((jax.device_count(),), ('device',))` as
// `Mesh('device': 4, axis_types=(Explicit,))` (make_mesh's default since JAX 0.9).
TEST(Mesh, ToStringAsJax) {
  EXPECT_EQ(Mesh4x2().to_string(), "Mesh('data': 4, 'model': 2, axis_types=(Explicit, Explicit))");
  EXPECT_EQ(make_mesh({4}, {"device"}, {0, 1, 2, 3}).value().to_string(), "Mesh('device': 4, axis_types=(Explicit,))");
  EXPECT_EQ(Mesh::create({8}, {"x"}, kDevices).value().to_string(), "Mesh('x': 8, axis_types=(Auto,))");
  EXPECT_EQ(make_mesh({8}, {"x"}, kDevices, {AxisType::kAuto}).value().to_string(), "Mesh('x': 8, axis_types=(Auto,))");
  EXPECT_EQ(make_mesh({8}, {"a"}, kDevices, {AxisType::kExplicit}).value().to_string(),
            "Mesh('a': 8, axis_types=(Explicit,))");
  EXPECT_EQ(make_mesh({2, 2}, {"x", "y"}, {0, 1, 2, 3}, {AxisType::kExplicit, AxisType::kExplicit}).value().to_string(),
            "Mesh('x': 2, 'y': 2, axis_types=(Explicit, Explicit))");
  EXPECT_EQ(make_mesh({2, 4}, {"x", "y"}, kDevices, {AxisType::kManual, AxisType::kAuto}).value().to_string(),
            "Mesh('x': 2, 'y': 4, axis_types=(Manual, Auto))");
}

// jax.sharding.Mesh defaults every axis to Auto (jax/_src/mesh.py, _normalize_axis_types with
// AxisType.Auto) and jax.make_mesh to Explicit (tests/array_test.py test_make_mesh_axis_types:
// `jax.make_mesh((1, 1), ('x', 'y'))` has axis_types `(AxisType.Explicit,) * 2`); a mesh is the
// same mesh only with the same devices and axis types.
TEST(Mesh, AxisTypes) {
  EXPECT_EQ(make_mesh({1, 1}, {"x", "y"}, {0}).value().axis_types(),
            (std::vector<AxisType>{AxisType::kExplicit, AxisType::kExplicit}));
  EXPECT_EQ(Mesh4x2().axis_types(), (std::vector<AxisType>{AxisType::kExplicit, AxisType::kExplicit}));
  const Mesh m = Mesh::create({4, 2}, {"data", "model"}, kDevices).value();
  EXPECT_EQ(m.axis_types(), (std::vector<AxisType>{AxisType::kAuto, AxisType::kAuto}));
  EXPECT_TRUE(m.has_axis_type(AxisType::kAuto));
  EXPECT_FALSE(m.has_axis_type(AxisType::kExplicit));
  EXPECT_NE(Mesh4x2(), m);
  const Mesh explicit_mesh =
      make_mesh({4, 2}, {"data", "model"}, kDevices, {AxisType::kExplicit, AxisType::kAuto}).value();
  EXPECT_TRUE(explicit_mesh.has_axis_type(AxisType::kExplicit));
  EXPECT_NE(explicit_mesh, m);
  EXPECT_EQ(explicit_mesh,
            make_mesh({4, 2}, {"data", "model"}, kDevices, {AxisType::kExplicit, AxisType::kAuto}).value());
  EXPECT_EQ(make_mesh({4, 2}, {"data", "model"}, kDevices, {AxisType::kAuto, AxisType::kAuto}).value(), m);
  // JAX: "Number of axis names should match the number of axis_types".
  absl::StatusOr<Mesh> short_types = make_mesh({4, 2}, {"data", "model"}, kDevices, {AxisType::kExplicit});
  ASSERT_EQ(short_types.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_types.status().message(), HasSubstr("2 axis names but 1 axis types"));
  EXPECT_EQ(std::string(axis_type_name(AxisType::kManual)), "Manual");
}

// jax.sharding.AbstractMesh (jax/_src/mesh.py): a mesh's sizes, names and types without its
// devices; repr as JAX's: the explicit-sharding notebook prints
// `AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Explicit))` inside auto_axes(axes='X'),
// docs/export/export.md `AbstractMesh('a': 4, axis_types=(Explicit,))`, and the empty mesh's
// repr is `AbstractMesh((), axis_types=())` (mesh_repr "()" when shape_tuple is empty), size 0.
// update_axis_types as JAX's; meshes on other devices have equal abstract meshes.
TEST(Mesh, AbstractMeshAsJax) {
  const AbstractMesh a = make_mesh({2, 4}, {"X", "Y"}, kDevices).value().abstract_mesh();
  EXPECT_EQ(a.to_string(), "AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))");
  EXPECT_EQ(a.update_axis_types({"X"}, AxisType::kAuto).to_string(),
            "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Explicit))");
  EXPECT_EQ(make_mesh({4}, {"a"}, {0, 1, 2, 3}).value().abstract_mesh().to_string(),
            "AbstractMesh('a': 4, axis_types=(Explicit,))");
  EXPECT_EQ(AbstractMesh().to_string(), "AbstractMesh((), axis_types=())");
  EXPECT_TRUE(AbstractMesh().empty());
  EXPECT_EQ(AbstractMesh().size(), 0);
  EXPECT_EQ(a.size(), 8);
  const AbstractMesh mixed({2, 2, 2}, {"x", "y", "z"}, {AxisType::kManual, AxisType::kAuto, AxisType::kManual});
  EXPECT_EQ(mixed.axes_of_type(AxisType::kManual), (std::vector<std::string>{"x", "z"}));
  EXPECT_EQ(mixed.axes_of_type(AxisType::kAuto), (std::vector<std::string>{"y"}));
  EXPECT_TRUE(mixed.axes_of_type(AxisType::kExplicit).empty());
  EXPECT_EQ(make_mesh({4}, {"x"}, {4, 5, 6, 7}).value().abstract_mesh(),
            make_mesh({4}, {"x"}, {0, 1, 2, 3}).value().abstract_mesh());
  EXPECT_NE(a, a.update_axis_types({"Y"}, AxisType::kManual));
  EXPECT_EQ(a, a.update_axis_types({"nope"}, AxisType::kManual));
}

// Two meshes that print alike are told apart by their devices; others print as they are.
TEST(Mesh, DistinguishNamesDevicesOnlyWhenNeeded) {
  const Mesh low = make_mesh({4}, {"x"}, {0, 1, 2, 3}).value();
  const Mesh high = make_mesh({4}, {"x"}, {4, 5, 6, 7}).value();
  auto [a, b] = distinguish(high, low);
  EXPECT_EQ(a, "Mesh('x': 4, axis_types=(Explicit,), device_ids=[4, 5, 6, 7])");
  EXPECT_EQ(b, "Mesh('x': 4, axis_types=(Explicit,), device_ids=[0, 1, 2, 3])");
  auto [c, d] = distinguish(Mesh4x2(), low);
  EXPECT_EQ(c, "Mesh('data': 4, 'model': 2, axis_types=(Explicit, Explicit))");
  EXPECT_EQ(d, "Mesh('x': 4, axis_types=(Explicit,))");
  // The same devices and names with other axis types print apart without their devices.
  auto [g, h] = distinguish(low, Mesh::create({4}, {"x"}, {0, 1, 2, 3}).value());
  EXPECT_EQ(g, "Mesh('x': 4, axis_types=(Explicit,))");
  EXPECT_EQ(h, "Mesh('x': 4, axis_types=(Auto,))");
  auto [e, f] = distinguish(low, low);
  EXPECT_EQ(e, f);
  EXPECT_EQ(e, low.to_string());
}

TEST(Mesh, WrongDeviceCount) {
  absl::StatusOr<Mesh> mesh = make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6});
  ASSERT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mesh.status().message(), HasSubstr("8 devices"));
  EXPECT_THAT(mesh.status().message(), HasSubstr("7"));

  mesh = Mesh::create({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7, 8});
  ASSERT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mesh.status().message(), HasSubstr("9"));
}

TEST(Mesh, DuplicateDevice) {
  absl::StatusOr<Mesh> mesh = Mesh::create({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 6});
  ASSERT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mesh.status().message(), HasSubstr("device 6"));
}

TEST(Mesh, RepeatedAxisName) {
  absl::StatusOr<Mesh> mesh = Mesh::create({4, 2}, {"data", "data"}, kDevices);
  ASSERT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mesh.status().message(), HasSubstr("'data'"));
}

TEST(Mesh, OtherInvalidArguments) {
  EXPECT_EQ(Mesh::create({4, 2}, {"data"}, kDevices).status().code(),
            absl::StatusCode::kInvalidArgument);  // names and shape differ in length
  EXPECT_EQ(Mesh::create({8, 0}, {"data", "model"}, {}).status().code(),
            absl::StatusCode::kInvalidArgument);  // axis of size 0
  EXPECT_EQ(Mesh::create({4, 2}, {"data", ""}, kDevices).status().code(),
            absl::StatusCode::kInvalidArgument);  // empty name
  EXPECT_EQ(Mesh::create({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, -1}).status().code(),
            absl::StatusCode::kInvalidArgument);  // negative id
}

// ---- Layout tables: (8, 2) -------------------------------------------------------------------

TEST(Sharding, DataNoneOn4x2Mesh8x2) {
  CheckLayout({8, 2}, P("data", None), {2, 2}, 2, false,
              {{{{0, 2}, {0, 2}}, 0},
               {{{0, 2}, {0, 2}}, 1},
               {{{2, 4}, {0, 2}}, 0},
               {{{2, 4}, {0, 2}}, 1},
               {{{4, 6}, {0, 2}}, 0},
               {{{4, 6}, {0, 2}}, 1},
               {{{6, 8}, {0, 2}}, 0},
               {{{6, 8}, {0, 2}}, 1}});
}

TEST(Sharding, NoneModelOn4x2Mesh8x2) {
  CheckLayout({8, 2}, P(None, "model"), {8, 1}, 4, false,
              {{{{0, 8}, {0, 1}}, 0},
               {{{0, 8}, {1, 2}}, 0},
               {{{0, 8}, {0, 1}}, 1},
               {{{0, 8}, {1, 2}}, 1},
               {{{0, 8}, {0, 1}}, 2},
               {{{0, 8}, {1, 2}}, 2},
               {{{0, 8}, {0, 1}}, 3},
               {{{0, 8}, {1, 2}}, 3}});
}

TEST(Sharding, DataModelOn4x2Mesh8x2) {
  CheckLayout({8, 2}, P("data", "model"), {2, 1}, 1, false,
              {{{{0, 2}, {0, 1}}, 0},
               {{{0, 2}, {1, 2}}, 0},
               {{{2, 4}, {0, 1}}, 0},
               {{{2, 4}, {1, 2}}, 0},
               {{{4, 6}, {0, 1}}, 0},
               {{{4, 6}, {1, 2}}, 0},
               {{{6, 8}, {0, 1}}, 0},
               {{{6, 8}, {1, 2}}, 0}});
}

TEST(Sharding, DataModelTupleOn4x2Mesh8x2) {
  CheckLayout({8, 2}, P(Axes{"data", "model"}), {1, 2}, 1, false,
              {{{{0, 1}, {0, 2}}, 0},
               {{{1, 2}, {0, 2}}, 0},
               {{{2, 3}, {0, 2}}, 0},
               {{{3, 4}, {0, 2}}, 0},
               {{{4, 5}, {0, 2}}, 0},
               {{{5, 6}, {0, 2}}, 0},
               {{{6, 7}, {0, 2}}, 0},
               {{{7, 8}, {0, 2}}, 0}});
}

// Block of dimension 0 = c_model * 4 + c_data.
TEST(Sharding, ModelDataTupleOn4x2Mesh8x2) {
  CheckLayout({8, 2}, P(Axes{"model", "data"}), {1, 2}, 1, false,
              {{{{0, 1}, {0, 2}}, 0},
               {{{4, 5}, {0, 2}}, 0},
               {{{1, 2}, {0, 2}}, 0},
               {{{5, 6}, {0, 2}}, 0},
               {{{2, 3}, {0, 2}}, 0},
               {{{6, 7}, {0, 2}}, 0},
               {{{3, 4}, {0, 2}}, 0},
               {{{7, 8}, {0, 2}}, 0}});
}

TEST(Sharding, ReplicatedOn4x2Mesh8x2) {
  CheckLayout({8, 2}, P(), {8, 2}, 8, true,
              {{{{0, 8}, {0, 2}}, 0},
               {{{0, 8}, {0, 2}}, 1},
               {{{0, 8}, {0, 2}}, 2},
               {{{0, 8}, {0, 2}}, 3},
               {{{0, 8}, {0, 2}}, 4},
               {{{0, 8}, {0, 2}}, 5},
               {{{0, 8}, {0, 2}}, 6},
               {{{0, 8}, {0, 2}}, 7}});
}

// ---- Layout tables: (16, 8) ------------------------------------------------------------------

TEST(Sharding, DataNoneOn4x2Mesh16x8) {
  CheckLayout({16, 8}, P("data", None), {4, 8}, 2, false,
              {{{{0, 4}, {0, 8}}, 0},
               {{{0, 4}, {0, 8}}, 1},
               {{{4, 8}, {0, 8}}, 0},
               {{{4, 8}, {0, 8}}, 1},
               {{{8, 12}, {0, 8}}, 0},
               {{{8, 12}, {0, 8}}, 1},
               {{{12, 16}, {0, 8}}, 0},
               {{{12, 16}, {0, 8}}, 1}});
}

TEST(Sharding, NoneModelOn4x2Mesh16x8) {
  CheckLayout({16, 8}, P(None, "model"), {16, 4}, 4, false,
              {{{{0, 16}, {0, 4}}, 0},
               {{{0, 16}, {4, 8}}, 0},
               {{{0, 16}, {0, 4}}, 1},
               {{{0, 16}, {4, 8}}, 1},
               {{{0, 16}, {0, 4}}, 2},
               {{{0, 16}, {4, 8}}, 2},
               {{{0, 16}, {0, 4}}, 3},
               {{{0, 16}, {4, 8}}, 3}});
}

TEST(Sharding, DataModelOn4x2Mesh16x8) {
  CheckLayout({16, 8}, P("data", "model"), {4, 4}, 1, false,
              {{{{0, 4}, {0, 4}}, 0},
               {{{0, 4}, {4, 8}}, 0},
               {{{4, 8}, {0, 4}}, 0},
               {{{4, 8}, {4, 8}}, 0},
               {{{8, 12}, {0, 4}}, 0},
               {{{8, 12}, {4, 8}}, 0},
               {{{12, 16}, {0, 4}}, 0},
               {{{12, 16}, {4, 8}}, 0}});
}

TEST(Sharding, DataModelTupleOn4x2Mesh16x8) {
  CheckLayout({16, 8}, P(Axes{"data", "model"}), {2, 8}, 1, false,
              {{{{0, 2}, {0, 8}}, 0},
               {{{2, 4}, {0, 8}}, 0},
               {{{4, 6}, {0, 8}}, 0},
               {{{6, 8}, {0, 8}}, 0},
               {{{8, 10}, {0, 8}}, 0},
               {{{10, 12}, {0, 8}}, 0},
               {{{12, 14}, {0, 8}}, 0},
               {{{14, 16}, {0, 8}}, 0}});
}

TEST(Sharding, ModelDataTupleOn4x2Mesh16x8) {
  CheckLayout({16, 8}, P(Axes{"model", "data"}), {2, 8}, 1, false,
              {{{{0, 2}, {0, 8}}, 0},
               {{{8, 10}, {0, 8}}, 0},
               {{{2, 4}, {0, 8}}, 0},
               {{{10, 12}, {0, 8}}, 0},
               {{{4, 6}, {0, 8}}, 0},
               {{{12, 14}, {0, 8}}, 0},
               {{{6, 8}, {0, 8}}, 0},
               {{{14, 16}, {0, 8}}, 0}});
}

TEST(Sharding, ReplicatedOn4x2Mesh16x8) {
  CheckLayout({16, 8}, P(), {16, 8}, 8, true,
              {{{{0, 16}, {0, 8}}, 0},
               {{{0, 16}, {0, 8}}, 1},
               {{{0, 16}, {0, 8}}, 2},
               {{{0, 16}, {0, 8}}, 3},
               {{{0, 16}, {0, 8}}, 4},
               {{{0, 16}, {0, 8}}, 5},
               {{{0, 16}, {0, 8}}, 6},
               {{{0, 16}, {0, 8}}, 7}});
}

// ---- Other layouts ---------------------------------------------------------------------------

// Dimensions past the spec are whole, as with trailing Nones: P('data') lays a matrix out as P('data', None).
TEST(Sharding, ShortSpecLeavesTrailingDimensionsWhole) {
  CheckLayout({8, 2}, P("data"), {2, 2}, 2, false,
              {{{{0, 2}, {0, 2}}, 0},
               {{{0, 2}, {0, 2}}, 1},
               {{{2, 4}, {0, 2}}, 0},
               {{{2, 4}, {0, 2}}, 1},
               {{{4, 6}, {0, 2}}, 0},
               {{{4, 6}, {0, 2}}, 1},
               {{{6, 8}, {0, 2}}, 0},
               {{{6, 8}, {0, 2}}, 1}});
  CheckLayout({4, 6, 3}, P(None, "model"), {4, 3, 3}, 4, false,
              {{{{0, 4}, {0, 3}, {0, 3}}, 0},
               {{{0, 4}, {3, 6}, {0, 3}}, 0},
               {{{0, 4}, {0, 3}, {0, 3}}, 1},
               {{{0, 4}, {3, 6}, {0, 3}}, 1},
               {{{0, 4}, {0, 3}, {0, 3}}, 2},
               {{{0, 4}, {3, 6}, {0, 3}}, 2},
               {{{0, 4}, {0, 3}, {0, 3}}, 3},
               {{{0, 4}, {3, 6}, {0, 3}}, 3}});
}

// A dimension of size 0 divides evenly: every device holds an empty block.
TEST(Sharding, ZeroSizeDimension) {
  CheckLayout({0, 2}, P("data", "model"), {0, 1}, 1, false,
              {{{{0, 0}, {0, 1}}, 0},
               {{{0, 0}, {1, 2}}, 0},
               {{{0, 0}, {0, 1}}, 0},
               {{{0, 0}, {1, 2}}, 0},
               {{{0, 0}, {0, 1}}, 0},
               {{{0, 0}, {1, 2}}, 0},
               {{{0, 0}, {0, 1}}, 0},
               {{{0, 0}, {1, 2}}, 0}});
}

// Blocks and replica ids follow mesh positions; device ids are whatever sits there.
TEST(Sharding, PermutedDevicesKeepMeshOrder) {
  Mesh mesh = make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0}).value();
  std::vector<DeviceShard> shards = NamedSharding(mesh, P("data", None)).device_shards({8, 2});
  const std::vector<Expected> expected = {{{{0, 2}, {0, 2}}, 0}, {{{0, 2}, {0, 2}}, 1}, {{{2, 4}, {0, 2}}, 0},
                                          {{{2, 4}, {0, 2}}, 1}, {{{4, 6}, {0, 2}}, 0}, {{{4, 6}, {0, 2}}, 1},
                                          {{{6, 8}, {0, 2}}, 0}, {{{6, 8}, {0, 2}}, 1}};
  ASSERT_EQ(shards.size(), expected.size());
  for (size_t p = 0; p < expected.size(); ++p) {
    SCOPED_TRACE("position " + std::to_string(p));
    EXPECT_EQ(shards[p].device_id, 7 - static_cast<int>(p));
    EXPECT_EQ(shards[p].mesh_position, static_cast<int64_t>(p));
    EXPECT_EQ(shards[p].index, expected[p].index);
    EXPECT_EQ(shards[p].replica_id, expected[p].replica_id);
  }
}

TEST(Sharding, ToStringAndEquality) {
  NamedSharding s(Mesh4x2(), P("data", None));
  EXPECT_EQ(s.to_string(),
            "NamedSharding(mesh=Mesh('data': 4, 'model': 2, axis_types=(Explicit, Explicit)), spec=P('data', None))");
  EXPECT_EQ(s, NamedSharding(Mesh4x2(), P("data", None)));
  // As jax.sharding.NamedSharding.__eq__: the specs as written (jax/_src/named_sharding.py).
  EXPECT_NE(s, NamedSharding(Mesh4x2(), P("data")));
  EXPECT_NE(s, NamedSharding(Mesh4x2(), P(None, "data")));
  Mesh reversed = make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0}).value();
  EXPECT_NE(s, NamedSharding(reversed, P("data", None)));
  EXPECT_NE(
      s, NamedSharding(make_mesh({4, 2}, {"data", "model"}, kDevices, {AxisType::kExplicit, AxisType::kAuto}).value(),
                       P("data", None)));
}

// jax.sharding.NamedSharding.is_equivalent_to(other, ndim): the same blocks on the same
// devices. The cases follow JAX's tests/array_test.py test_are_shardings_equivalent where
// they involve NamedShardings only: P('x') on a one-device mesh is the whole array on that
// device, and a (2, 1) mesh's P('x', 'y') is a (2,) mesh's P('x') on the same devices.
TEST(Sharding, IsEquivalentTo) {
  const NamedSharding s(Mesh4x2(), P("data"));
  EXPECT_TRUE(s.is_equivalent_to(NamedSharding(Mesh4x2(), P("data", None)), 2));
  EXPECT_TRUE(NamedSharding(Mesh4x2(), P("data", None)).is_equivalent_to(s, 2));
  EXPECT_FALSE(s.is_equivalent_to(NamedSharding(Mesh4x2(), P("data", None)), 1));  // P('data', None) has rank 2
  EXPECT_FALSE(s.is_equivalent_to(NamedSharding(Mesh4x2(), P(None, "data")), 2));
  EXPECT_FALSE(s.is_equivalent_to(NamedSharding(Mesh4x2(), P("model")), 2));
  EXPECT_FALSE(s.is_equivalent_to(NamedSharding(Mesh4x2(), P(Axes{"data", "model"})), 2));
  const Mesh one = make_mesh({1}, {"x"}, {0}).value();
  EXPECT_TRUE(NamedSharding(one, P("x")).is_equivalent_to(NamedSharding(one, P()), 2));
  const Mesh tall = make_mesh({2, 1}, {"x", "y"}, {0, 1}).value();
  const Mesh flat = make_mesh({2}, {"x"}, {0, 1}).value();
  EXPECT_TRUE(NamedSharding(tall, P("x", "y")).is_equivalent_to(NamedSharding(flat, P("x")), 2));
  EXPECT_FALSE(NamedSharding(tall, P("x", "y")).is_equivalent_to(NamedSharding(flat, P()), 2));
  EXPECT_FALSE(
      NamedSharding(flat, P("x")).is_equivalent_to(NamedSharding(make_mesh({2}, {"x"}, {1, 0}).value(), P("x")), 1));
  // The same layout on meshes of other shapes: (4, 2)'s P(('data', 'model')) is an (8,) mesh's
  // P('i'), device by device.
  const Mesh line = make_mesh({8}, {"i"}, kDevices).value();
  EXPECT_TRUE(NamedSharding(Mesh4x2(), P(Axes{"data", "model"})).is_equivalent_to(NamedSharding(line, P("i")), 1));
  EXPECT_FALSE(NamedSharding(Mesh4x2(), P(Axes{"model", "data"})).is_equivalent_to(NamedSharding(line, P("i")), 1));
  EXPECT_FALSE(NamedSharding(Mesh4x2(), P("nope")).is_equivalent_to(s, 2));
}

// ---- Validation ------------------------------------------------------------------------------

absl::Status Validate(const PartitionSpec& spec, const Shape& shape) {
  return NamedSharding(Mesh4x2(), spec).validate(shape);
}

TEST(ShardingValidation, AxisNotInMesh) {
  for (const PartitionSpec& spec : {P("batch", None), P(None, Axes{"data", "batch"})}) {
    SCOPED_TRACE(spec.to_string());
    absl::Status status = NamedSharding(Mesh4x2(), spec).validate_spec();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("axis 'batch'"));
    EXPECT_EQ(Validate(spec, {8, 2}).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ShardingValidation, AxisUsedTwice) {
  const std::vector<std::pair<PartitionSpec, std::string>> cases = {
      {P("data", "data"), "axis 'data'"},
      {P(Axes{"model", "model"}), "axis 'model'"},
      {P("model", Axes{"data", "model"}), "axis 'model'"},
  };
  for (const auto& [spec, fact] : cases) {
    SCOPED_TRACE(spec.to_string());
    absl::Status status = NamedSharding(Mesh4x2(), spec).validate_spec();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(fact));
    EXPECT_EQ(Validate(spec, {8, 8}).code(), absl::StatusCode::kInvalidArgument);
  }
}

// JAX counts every entry of the spec, trailing Nones included, against the rank.
TEST(ShardingValidation, SpecLongerThanRank) {
  for (const PartitionSpec& spec : {P("data", None, None), P(None, None, None)}) {
    SCOPED_TRACE(spec.to_string());
    absl::Status status = Validate(spec, {8, 2});
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr("3 entries"));
    EXPECT_THAT(status.message(), HasSubstr("rank 2"));
  }
  absl::Status scalar = Validate(P("data"), {});
  EXPECT_EQ(scalar.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(scalar.message(), HasSubstr("rank 0"));
}

TEST(ShardingValidation, DimensionNotDivisible) {
  struct Case {
    PartitionSpec spec;
    Shape shape;
    std::string message;
  };
  const std::vector<Case> cases = {
      {P("data", None), {10, 2}, "dimension 0 of size 10 is not divisible by mesh axis 'data' of size 4"},
      {P(None, "model"), {8, 3}, "dimension 1 of size 3 is not divisible by mesh axis 'model' of size 2"},
      {P("data", "model"), {8, 5}, "dimension 1 of size 5 is not divisible by mesh axis 'model' of size 2"},
      {P(Axes{"data", "model"}),
       {12, 8},
       "dimension 0 of size 12 is not divisible by mesh axes ('data', 'model') of total size 8"},
      {P(None, Axes{"model", "data"}),
       {16, 4},
       "dimension 1 of size 4 is not divisible by mesh axes ('model', 'data') of total size 8"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.spec.to_string() + " on " + shape_to_string(c.shape));
    absl::Status status = Validate(c.spec, c.shape);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(status.message(), HasSubstr(c.message));
  }
}

TEST(ShardingValidation, ValidLayoutsPass) {
  for (const Shape& shape : {Shape{8, 2}, Shape{16, 8}}) {
    for (const PartitionSpec& spec : {P("data", None), P(None, "model"), P("data", "model"), P(Axes{"data", "model"}),
                                      P(Axes{"model", "data"}), P()}) {
      EXPECT_TRUE(Validate(spec, shape).ok()) << spec.to_string() << " on " << shape_to_string(shape);
    }
  }
  EXPECT_TRUE(Validate(P(), {}).ok());  // a replicated scalar
}

// jax/_src/named_sharding.py, _check_mesh_unreduced (its words): an unreduced or reduced
// axis must be an Explicit axis of the mesh; the overlap checks of the spec come first.
TEST(Sharding, UnreducedAxesMustBeExplicitAxesOfTheMesh) {
  const Mesh explicit_mesh =
      *Mesh::create({2, 2}, {"X", "Y"}, {0, 1, 2, 3}, {AxisType::kExplicit, AxisType::kExplicit});
  const Mesh mixed = *Mesh::create({2, 2}, {"X", "Y"}, {0, 1, 2, 3}, {AxisType::kExplicit, AxisType::kAuto});
  EXPECT_TRUE(NamedSharding(explicit_mesh, P("X", None).with_unreduced({"Y"})).validate({4, 4}).ok());
  EXPECT_TRUE(NamedSharding(explicit_mesh, P().with_reduced({"X", "Y"})).validate_spec().ok());

  const absl::Status unknown = NamedSharding(explicit_mesh, P().with_unreduced({"Z"})).validate_spec();
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.message(),
            "Unreduced axes Z is not found in mesh.axis_names=('X', 'Y'). Got pspec=P(unreduced={'Z'}, "
            "unreduced_kind=sum)");
  EXPECT_EQ(NamedSharding(mixed, P().with_unreduced({"Y"})).validate_spec().message(),
            "Unreduced axes can only refer to mesh axes that is of type `Explicit`. Got unreduced axes: "
            "frozenset({'Y'}) and mesh: Mesh('X': 2, 'Y': 2, axis_types=(Explicit, Auto))");
  EXPECT_EQ(NamedSharding(mixed, P().with_reduced({"Y"})).validate_spec().message(),
            "Reduced axes can only refer to mesh axes that is of type `Explicit`. Got reduced axes: "
            "frozenset({'Y'}) and mesh: Mesh('X': 2, 'Y': 2, axis_types=(Explicit, Auto))");
  EXPECT_THAT(NamedSharding(explicit_mesh, P("X").with_unreduced({"X"})).validate_spec().message(),
              HasSubstr("partitions cannot overlap with unreduced axes"));
  // Unreduced blocks are terms of a sum: not laid out as the replicated array.
  EXPECT_FALSE(
      NamedSharding(explicit_mesh, P().with_unreduced({"Y"})).is_equivalent_to(NamedSharding(explicit_mesh, P()), 2));
  EXPECT_TRUE(NamedSharding(explicit_mesh, P().with_unreduced({"Y"}))
                  .is_equivalent_to(NamedSharding(explicit_mesh, P(None, None).with_unreduced({"Y"})), 2));
}

}  // namespace
}  // namespace tessera

namespace tessera {
namespace {

// check_unreduced_move (core/unreduced_move.h), the coordinator's check of a ReshardArray
// (device_put of an Array): an array unreduced over axes moves only onto the same unreduced
// axes of the same sizes, each device taking its counterpart's term (JAX's pjit_test.py
// test_device_put_unreduced_via_runtime_transfer moves shard i to device i); an array that is
// not unreduced moves only onto a sharding without unreduced axes (a copy would put the whole
// value on every device along them, so their sum would count it once per device).
TEST(UnreducedMove, TermsMoveOnlyOntoTheSameUnreducedAxesOfTheSameSizes) {
  const Mesh low = make_mesh({2, 2}, {"x", "y"}, {0, 1, 2, 3}).value();
  const Mesh high = make_mesh({2, 2}, {"x", "y"}, {4, 5, 6, 7}).value();
  const Mesh x4 = make_mesh({4}, {"x"}, {4, 5, 6, 7}).value();
  const Mesh z2 = make_mesh({2}, {"z"}, {4, 5}).value();
  const NamedSharding ux(low, P(None).with_unreduced({"x"}));
  // The same axes and sizes, on other devices, with another split of the other axis: OK.
  EXPECT_TRUE(check_unreduced_move(ux, NamedSharding(high, P(None).with_unreduced({"x"}))).ok());
  EXPECT_TRUE(check_unreduced_move(ux, NamedSharding(high, P("y").with_unreduced({"x"}))).ok());
  // Nothing unreduced on either side: any move.
  EXPECT_TRUE(check_unreduced_move(NamedSharding(low, P("x")), NamedSharding(x4, P("x"))).ok());
  struct Refused {
    NamedSharding from, to;
    std::string message;
  };
  const std::vector<Refused> refused = {
      // 'x' of size 4 on the target: terms would have no counterpart, or two.
      {ux, NamedSharding(x4, P(None).with_unreduced({"x"})),
       "moves only onto the same unreduced axes of the same sizes"},
      // The target has no 'x' at all.
      {ux, NamedSharding(z2, P(None).with_unreduced({"z"})),
       "moves only onto the same unreduced axes of the same sizes"},
      // The target is not unreduced: the terms would be taken as replicas.
      {ux, NamedSharding(high, P(None)), "an array unreduced over {'x'}"},
      // Other unreduced axes.
      {ux, NamedSharding(high, P(None).with_unreduced({"x", "y"})), "its devices along them hold terms of a sum"},
      // Not unreduced onto unreduced: every device along 'x' would hold the whole value.
      {NamedSharding(low, P(None)), NamedSharding(high, P(None).with_unreduced({"x"})),
       "an array that is not unreduced (P(None,) on "},
  };
  for (const Refused& r : refused) {
    SCOPED_TRACE(r.from.spec().to_string() + " -> " + r.to.spec().to_string());
    const absl::Status s = check_unreduced_move(r.from, r.to);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr(r.message));
    EXPECT_THAT(s.message(), HasSubstr(r.to.spec().to_string()));
  }
}

}  // namespace
}  // namespace tessera

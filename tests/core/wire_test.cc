// Wire forms of the core model that are not covered with the graph (graph_test.cc) or the
// compile key (compile_key_test.cc).
#include "core/wire.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

TEST(Wire, MeshOfDevicesInOrderIsCompactAndRoundTrips) {
  std::vector<int> ids(4096);
  for (int i = 0; i < 4096; ++i) ids[i] = i;
  const Mesh big = *make_mesh({512, 8}, {"data", "model"}, ids);
  pb::Mesh wire;
  to_proto(big, &wire);
  EXPECT_TRUE(wire.device_ids_in_order());
  EXPECT_EQ(wire.device_ids_size(), 0);
  EXPECT_LT(wire.ByteSizeLong(), 32u);
  absl::StatusOr<Mesh> back = mesh_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->device_ids(), ids);
  EXPECT_EQ(*back, big);

  // Any other order is listed, and comes back as it was.
  const Mesh shuffled = *make_mesh({2, 2}, {"x", "y"}, {1, 0, 2, 3});
  pb::Mesh listed;
  to_proto(shuffled, &listed);
  EXPECT_FALSE(listed.device_ids_in_order());
  absl::StatusOr<Mesh> shuffled_back = mesh_from_proto(listed);
  ASSERT_TRUE(shuffled_back.ok()) << shuffled_back.status();
  EXPECT_EQ(*shuffled_back, shuffled);
}

TEST(Wire, MeshInOrderFromTheWireIsChecked) {
  pb::Mesh wire;
  wire.add_shape(1 << 11);
  wire.add_shape(1 << 11);  // 4M devices: over the limit, refused before any is listed
  wire.add_axis_names("x");
  wire.add_axis_names("y");
  wire.set_device_ids_in_order(true);
  absl::StatusOr<Mesh> m = mesh_from_proto(wire);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("at most 1048576 devices"));
  wire.set_shape(1, 0);
  EXPECT_THAT(std::string(mesh_from_proto(wire).status().message()), HasSubstr("dimension 0 is out of range"));
  wire.set_shape(1, 2);
  wire.set_shape(0, 2);
  wire.add_device_ids(0);
  EXPECT_THAT(std::string(mesh_from_proto(wire).status().message()),
              HasSubstr("device_ids_in_order is set but device_ids are listed too"));
}

// Axis types travel with the mesh; an all-Auto mesh (the common one) sends none, so its wire
// form and compile keys are what they were before axis types.
TEST(Wire, MeshAxisTypesRoundTrip) {
  const Mesh typed = *Mesh::create({2, 2}, {"x", "y"}, {0, 1, 2, 3}, {AxisType::kExplicit, AxisType::kManual});
  pb::Mesh wire;
  to_proto(typed, &wire);
  ASSERT_EQ(wire.axis_types_size(), 2);
  absl::StatusOr<Mesh> back = mesh_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, typed);
  EXPECT_EQ(back->to_string(), "Mesh('x': 2, 'y': 2, axis_types=(Explicit, Manual))");

  const Mesh automatic = *Mesh::create({2, 2}, {"x", "y"}, {0, 1, 2, 3});
  pb::Mesh plain;
  to_proto(automatic, &plain);
  EXPECT_EQ(plain.axis_types_size(), 0);
  EXPECT_EQ(*mesh_from_proto(plain), automatic);
  EXPECT_NE(compile_key(Graph(), automatic, {}, {}, {}), compile_key(Graph(), typed, {}, {}, {}));

  wire.set_axis_types(1, static_cast<pb::AxisType>(7));
  EXPECT_EQ(mesh_from_proto(wire).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(mesh_from_proto(wire).status().message()), HasSubstr("axis type 7 is not one of"));
  wire.mutable_axis_types()->RemoveLast();
  EXPECT_THAT(std::string(mesh_from_proto(wire).status().message()), HasSubstr("2 axis names but 1 axis types"));
}

}  // namespace
}  // namespace tessera

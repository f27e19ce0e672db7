// Graph: shape and dtype inference of every op, and the errors for operands that do not fit.
#include "core/graph.h"

#include "core/pvary_cast.h"
#include "core/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

void expect_invalid(const absl::StatusOr<int>& r, const std::string& part) {
  ASSERT_FALSE(r.ok()) << part;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(part));
}

TEST(Graph, DotGeneralOrdersBatchThenLhsFreeThenRhsFree) {
  Graph g;
  const int a = g.add_parameter(DType::kF32, {2, 3, 5, 7});  // batch 0, contract 2
  const int b = g.add_parameter(DType::kF32, {11, 2, 5});    // batch 1, contract 2
  absl::StatusOr<int> d = g.add_dot_general(a, b, DotDims{{0}, {1}, {2}, {2}});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(g.node(*d).shape, (Shape{2, 3, 7, 11}));
  expect_invalid(g.add_dot_general(a, b, DotDims{{0}, {0}, {2}, {2}}), "batch dimensions 0 and 0 differ in size");
  expect_invalid(g.add_dot_general(a, b, DotDims{{}, {}, {2, 2}, {2, 0}}), "axis 2 appears twice");
}

TEST(Graph, BroadcastInDim) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {3, 1});
  absl::StatusOr<int> y = g.add_broadcast_in_dim(x, {2, 3, 5}, {1, 2});
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(g.node(*y).shape, (Shape{2, 3, 5}));
  expect_invalid(g.add_broadcast_in_dim(x, {2, 4, 5}, {1, 2}), "operand dimension 0 of size 3 cannot become size 4");
  expect_invalid(g.add_broadcast_in_dim(x, {3, 5}, {1, 0}), "dims must increase");
  expect_invalid(g.add_broadcast_in_dim(x, {3, 5}, {0}), "one dim per operand dimension");
}

TEST(Graph, TransposeReduceSliceConcatenate) {
  Graph g;
  const int x = g.add_parameter(DType::kI32, {2, 3, 4});
  EXPECT_EQ(g.node(*g.add_transpose(x, {2, 0, 1})).shape, (Shape{4, 2, 3}));
  EXPECT_EQ(g.node(*g.add_reduce(Op::kReduceMax, x, {2, 0})).shape, (Shape{3}));
  EXPECT_EQ(g.node(*g.add_slice(x, {0, 1, 0}, {2, 3, 4})).shape, (Shape{2, 2, 4}));
  EXPECT_EQ(g.node(*g.add_concatenate({x, x, x}, 1)).shape, (Shape{2, 9, 4}));
  expect_invalid(g.add_transpose(x, {0, 1}), "permutation of every dimension");
  expect_invalid(g.add_slice(x, {0, 0, 0}, {2, 4, 4}), "dimension 1 is out of bounds");
  const int y = g.add_parameter(DType::kI32, {2, 3, 5});
  expect_invalid(g.add_concatenate({x, y}, 1), "agree off the axis");
  expect_invalid(g.add_reduce(Op::kAdd, x, {0}), "add is not a reduction");
}

// _slice_shape_rule (jax/_src/lax/slicing.py) skips the stride checks only for one stride of 1
// per dimension: lax.slice(x2d, (0, 0), (2, 2), (1,)) is refused for its length, as any other
// stride list of the wrong length. One 1 per dimension is stored empty, as no strides.
TEST(Graph, UnitStridesOfTheWrongLengthAreRefused) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {4, 4});
  expect_invalid(g.add_slice(x, {0, 0}, {2, 2}, {1}),
                 "slice strides must have length equal to the number of dimensions");
  expect_invalid(g.add_slice(x, {0, 0}, {2, 2}, {1, 1, 1}), "slice strides must have length equal");
  const absl::StatusOr<int> unit = g.add_slice(x, {0, 0}, {2, 2}, {1, 1});
  ASSERT_TRUE(unit.ok()) << unit.status();
  EXPECT_TRUE(g.node(*unit).attrs<SliceAttrs>().strides.empty());
  expect_invalid(g.add_slice(x, {0, 0}, {4, 4}, {1, -2}), "slice strides must be positive, got (1, -2)");
}

TEST(Graph, ElementwiseDtypes) {
  Graph g;
  const int f = g.add_parameter(DType::kF32, {4});
  const int i = g.add_parameter(DType::kI32, {4});
  const int b = g.add_parameter(DType::kBool, {4});
  EXPECT_EQ(g.node(*g.add_binary(Op::kLt, f, f)).dtype, DType::kBool);
  EXPECT_EQ(g.node(*g.add_binary(Op::kAnd, b, b)).dtype, DType::kBool);
  EXPECT_EQ(g.node(*g.add_unary(Op::kNot, b)).dtype, DType::kBool);
  EXPECT_EQ(g.node(*g.add_select(b, f, f)).dtype, DType::kF32);
  expect_invalid(g.add_binary(Op::kAdd, b, b), "bool is not a numeric dtype");
  expect_invalid(g.add_binary(Op::kAnd, f, f), "needs bool or an integer dtype");
  expect_invalid(g.add_unary(Op::kExp, i), "needs float32, float64, bfloat16 or float16");
  expect_invalid(g.add_select(f, f, f), "bool predicate");
  expect_invalid(g.add_binary(Op::kAdd, f, i), "differ");
  expect_invalid(g.add_unary(Op::kTanh, 99), "operand %99 does not exist");
}

TEST(Graph, OutputsMustExist) {
  Graph g;
  g.add_parameter(DType::kF32, {1});
  EXPECT_TRUE(g.set_outputs({0}).ok());
  EXPECT_EQ(g.set_outputs({3}).code(), absl::StatusCode::kInvalidArgument);
}

// A pvary node's dimension names its cast (core/pvary_cast.h): 0 varying (add_pvary's), 1
// unreduced, 2 reduced, 3 invariant, each the operand's type, printed after its axes; any other
// refused.
TEST(Graph, PvaryCarriesItsCastInItsDimension) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  Graph g;
  const int x = g.add_parameter(DType::kF32, {16, 8});
  const auto cast = [&](int64_t dimension) {
    Node n;
    n.op = Op::kPvary;
    n.operands = {x};
    n.attributes = CollectiveAttrs{mesh, {"model"}, ReduceOp::kSum, dimension, 0, 0, {}};
    return g.add_node(std::move(n));
  };
  absl::StatusOr<int> varying = g.add_pvary(x, mesh, {"model"});
  absl::StatusOr<int> unreduced = cast(static_cast<int64_t>(PvaryCast::kUnreduced));
  absl::StatusOr<int> reduced = cast(static_cast<int64_t>(PvaryCast::kReduced));
  absl::StatusOr<int> invariant = cast(static_cast<int64_t>(PvaryCast::kInvariant));
  ASSERT_TRUE(varying.ok() && unreduced.ok() && reduced.ok() && invariant.ok());
  EXPECT_EQ(g.node(*unreduced).shape, (Shape{16, 8}));
  const std::string text = g.to_text();
  EXPECT_THAT(text, HasSubstr("%1 = pvary(%0) f32[16,8] axes=('model',) mesh="));
  EXPECT_THAT(text, HasSubstr("%2 = pvary(%0) f32[16,8] axes=('model',) to=unreduced mesh="));
  EXPECT_THAT(text, HasSubstr("%3 = pvary(%0) f32[16,8] axes=('model',) to=reduced mesh="));
  EXPECT_THAT(text, HasSubstr("%4 = pvary(%0) f32[16,8] axes=('model',) to=invariant mesh="));
  expect_invalid(cast(4), "pvary: dimension 4 names no cast (0 varying, 1 unreduced, 2 reduced, 3 invariant)");
  expect_invalid(cast(-1), "pvary: dimension -1 names no cast");
}

TEST(Graph, ShardMapOpsInferBlockShapesAndCheckTheirRules) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  Graph g;
  const int x = g.add_parameter(DType::kF32, {16, 8});
  absl::StatusOr<int> in = g.add_shard_map_in(x, NamedSharding(mesh, P("data", "model")));
  ASSERT_TRUE(in.ok()) << in.status();
  EXPECT_EQ(g.node(*in).shape, (Shape{4, 4}));
  absl::StatusOr<int> gathered = g.add_collective(Op::kAllGather, *in, mesh, {"data"}, {0});
  ASSERT_TRUE(gathered.ok());
  EXPECT_EQ(g.node(*gathered).shape, (Shape{16, 4}));
  absl::StatusOr<int> scattered = g.add_collective(Op::kReduceScatter, *in, mesh, {"model"}, {1}, ReduceOp::kSum);
  ASSERT_TRUE(scattered.ok());
  EXPECT_EQ(g.node(*scattered).shape, (Shape{4, 2}));
  absl::StatusOr<int> moved = g.add_collective(Op::kAllToAll, *in, mesh, {"model"}, {0, 1});
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(g.node(*moved).shape, (Shape{2, 8}));
  absl::StatusOr<int> out = g.add_shard_map_out(*gathered, NamedSharding(mesh, P(None, "model")));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(g.node(*out).shape, (Shape{16, 8}));
  expect_invalid(g.add_collective(Op::kAllReduce, *in, mesh, {"batch"}, {}), "axis 'batch' is not in the mesh");
  expect_invalid(g.add_collective(Op::kAllReduce, *in, mesh, {"data", "data"}, {}), "axis 'data' is named twice");
  expect_invalid(
      g.add_collective(Op::kReduceScatter, *in, mesh, {"data", "model"}, {0}),
      "dimension 0 of size 4 is not divisible by the group size 8 (reduce_scatter of f32[4,4] over mesh axes "
      "('data', 'model'))");
  expect_invalid(g.add_collective(Op::kCollectivePermute, *in, mesh, {"data"}, {0, 1, 0, 2}), "source 0 appears twice");
  expect_invalid(g.add_collective(Op::kCollectivePermute, *in, mesh, {"data"}, {0, 5}), "position 5 is outside [0, 4)");
  expect_invalid(g.add_collective(Op::kAllGather, *in, mesh, {"data"}, {2}), "dimension 2 is out of range");
  const int odd = g.add_parameter(DType::kF32, {6, 8});
  expect_invalid(g.add_shard_map_in(odd, NamedSharding(mesh, P("data"))), "dimension 0 of size 6");
  expect_invalid(g.add_sharding_as(x, *in), "the shapes differ");
}

TEST(Graph, ShardMapGraphsRoundTripTheWireAndBadOnesAreRefused) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  Graph g;
  const int x = g.add_parameter(DType::kF32, {16, 8});
  const int in = *g.add_shard_map_in(x, NamedSharding(mesh, P("data", None)));
  const int sum = *g.add_collective(Op::kAllReduce, in, mesh, {"model"}, {}, ReduceOp::kMax);
  const int index = *g.add_axis_index(mesh, {"data"});
  const int out = *g.add_shard_map_out(sum, NamedSharding(mesh, P("data", None)));
  const int like = *g.add_sharding_as(out, x);
  ASSERT_TRUE(g.set_outputs({like, index}).ok());
  pb::Graph wire;
  to_proto(g, &wire);
  absl::StatusOr<Graph> back = graph_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->to_text(), g.to_text());
  EXPECT_THAT(g.to_text(), HasSubstr("all_reduce(%1) f32[4,8] axes=('model',) max"));
  // A reduce op out of range, and an axis the mesh does not have, from the wire.
  pb::Graph bad = wire;
  bad.mutable_nodes(sum)->mutable_node()->mutable_collective()->set_reduce_op(static_cast<pb::ReduceOp>(9));
  absl::StatusOr<Graph> refused = graph_from_proto(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("node 2 has unknown reduce op 9"));
  bad = wire;
  bad.mutable_nodes(sum)->mutable_node()->mutable_collective()->set_axes(0, "batch");
  refused = graph_from_proto(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("axis 'batch' is not in the mesh"));
}

// graph_from_proto refuses `wire` with INVALID_ARGUMENT saying `part`.
void expect_refused(const pb::Graph& wire, const std::string& part) {
  absl::StatusOr<Graph> refused = graph_from_proto(wire);
  ASSERT_FALSE(refused.ok()) << part;
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr(part));
}

// shard_map boundaries of a body manual over some axes only (axis_names) carry those axes
// across the wire; axes outside the mesh, out of its order or repeated, a spec naming another
// axis, and manual axes on a constraint are refused, in memory and from the wire.
TEST(Graph, ManualAxesOfShardMapBoundariesRoundTripAndAreChecked) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  Graph g;
  const int x = g.add_parameter(DType::kF32, {16, 8});
  const int in = *g.add_shard_map_in(x, NamedSharding(mesh, P("data", None)), {"data"});
  const int out = *g.add_shard_map_out(in, NamedSharding(mesh, P("data", None)), {"data"});
  ASSERT_TRUE(g.set_outputs({out}).ok());
  EXPECT_THAT(g.to_text(), HasSubstr("manual_axes=('data',)"));
  pb::Graph wire;
  to_proto(g, &wire);
  absl::StatusOr<Graph> back = graph_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->node(in).attrs<ShardingAttrs>().manual_axes, (std::vector<std::string>{"data"}));
  EXPECT_EQ(back->to_text(), g.to_text());
  expect_invalid(g.add_shard_map_in(x, NamedSharding(mesh, P("data", "model")), {"data"}),
                 "shard_map_in: spec P('data', 'model') names 'model', which is not one of the manual axes ('data',)");
  expect_invalid(g.add_shard_map_in(x, NamedSharding(mesh, P("data", None)), {"model", "data"}),
                 "manual axes ('model', 'data') must be distinct axes of");
  expect_invalid(g.add_shard_map_out(in, NamedSharding(mesh, P()), {"data", "data"}), "must be distinct axes");
  expect_invalid(g.add_shard_map_out(in, NamedSharding(mesh, P()), {"rows"}), "must be distinct axes");
  pb::Graph bad = wire;
  bad.mutable_nodes(in)->mutable_node()->mutable_sharding()->set_manual_axes(0, "model");
  expect_refused(bad, "names 'data', which is not one of the manual axes ('model',)");
  Node constraint;
  constraint.op = Op::kShardingConstraint;
  constraint.operands = {x};
  constraint.attributes = ShardingAttrs{NamedSharding(mesh, P()), {"data"}};
  expect_invalid(g.add_node(constraint), "manual axes belong to shard_map boundaries only");
}

// Each op's node carries its op's attributes struct (OpDef::attrs); one of another kind, from
// memory or from the wire, is refused naming the op and both kinds.
TEST(Graph, NodesCarryTheirOpsAttributesKind) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {4, 8});
  Node wrong;
  wrong.op = Op::kSlice;
  wrong.operands = {x};
  wrong.attributes = IotaAttrs{0};
  expect_invalid(g.add_node(wrong), "slice: the node carries iota attributes, not slice");
  wrong.attributes = NoAttrs{};
  expect_invalid(g.add_node(wrong), "slice: the node carries none attributes, not slice");
  wrong.op = Op::kTanh;
  wrong.attributes = SliceAttrs{{0, 0}, {4, 8}, {}};
  expect_invalid(g.add_node(wrong), "tanh: the node carries slice attributes, not none");
  EXPECT_EQ(g.size(), 1) << "a refused node leaves the graph unchanged";

  const int s = *g.add_slice(x, {1, 0}, {3, 8});
  EXPECT_EQ(g.node(s).attrs<SliceAttrs>().start, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(g.node(s).attrs<SliceAttrs>().limit, (std::vector<int64_t>{3, 8}));
  EXPECT_EQ(g.node(s).shape, (Shape{2, 8}));
  const Mesh mesh = *make_mesh({2}, {"data"}, {0, 1});
  const int c = *g.add_sharding_constraint(s, NamedSharding(mesh, P("data", None)));
  ASSERT_TRUE(g.set_outputs({c}).ok());
  pb::Graph wire;
  to_proto(g, &wire);
  // The wire's attributes are typed too: the oneof case names the kind.
  EXPECT_EQ(wire.nodes(s).node().attrs_case(), pb::KernelNode::kSlice);
  EXPECT_EQ(wire.nodes(c).node().attrs_case(), pb::KernelNode::kSharding);
  pb::Graph bad = wire;
  bad.mutable_nodes(s)->mutable_node()->mutable_iota()->set_dimension(0);
  expect_refused(bad, "graph: node 1: slice: the node carries iota attributes, not slice");
  bad = wire;
  bad.mutable_nodes(s)->mutable_node()->clear_attrs();
  expect_refused(bad, "the node carries none attributes, not slice");
  bad = wire;
  bad.mutable_nodes(c)->mutable_node()->mutable_sharding()->clear_sharding();
  expect_refused(bad, "graph: node 2 has no sharding");
}

TEST(Graph, CollectivesTakeTheirDimensionAttributesByName) {
  Graph g;
  const Mesh mesh = *make_mesh({2, 2}, {"data", "model"}, {0, 1, 2, 3});
  const int in = *g.add_shard_map_in(g.add_parameter(DType::kF32, {8, 4}), NamedSharding(mesh, P("data", None)));
  const int moved = *g.add_collective(Op::kAllToAll, in, mesh, {"model"}, {0, 1});
  const CollectiveAttrs& a = g.node(moved).attrs<CollectiveAttrs>();
  EXPECT_EQ(a.split_dimension, 0);
  EXPECT_EQ(a.concat_dimension, 1);
  EXPECT_EQ(a.axes, (std::vector<std::string>{"model"}));
  EXPECT_EQ(a.mesh, mesh);
  EXPECT_EQ(g.node(moved).shape, (Shape{2, 8}));
  const int permuted = *g.add_collective(Op::kCollectivePermute, in, mesh, {"data"}, {0, 1, 1, 0});
  EXPECT_EQ(g.node(permuted).attrs<CollectiveAttrs>().positions, (std::vector<int64_t>{0, 1, 1, 0}));
  expect_invalid(g.add_collective(Op::kAllGather, in, mesh, {"data"}, {}), "all_gather: 0 dimension attributes");
  expect_invalid(g.add_collective(Op::kAllToAll, in, mesh, {"data"}, {0}), "all_to_all: 1 dimension attributes");
  // From the wire: positions on another collective, and a mesh missing.
  ASSERT_TRUE(g.set_outputs({moved}).ok());
  pb::Graph wire;
  to_proto(g, &wire);
  pb::Graph bad = wire;
  bad.mutable_nodes(moved)->mutable_node()->mutable_collective()->add_positions(0);
  expect_refused(bad, "all_to_all: only collective_permute takes positions");
  bad = wire;
  bad.mutable_nodes(moved)->mutable_node()->mutable_collective()->clear_mesh();
  expect_refused(bad, "graph: node 2 has no mesh");
}

}  // namespace
}  // namespace tessera

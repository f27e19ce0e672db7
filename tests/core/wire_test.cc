// Wire forms of the core model that are not covered with the graph (graph_test.cc) or the
// compile key (compile_key_test.cc).
#include "core/wire.h"

#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "core/graph.h"
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

TEST(Wire, SpecUnreducedAndReducedRoundTrip) {
  const PartitionSpec spec = P("X", None).with_unreduced({"Z", "Y"}).with_reduced({"W"});
  pb::PartitionSpec wire;
  to_proto(spec, &wire);
  EXPECT_EQ(spec_from_proto(wire), spec);
  EXPECT_EQ(spec_from_proto(wire).to_string(), "P('X', None, unreduced={'Y', 'Z'}, reduced={'W'}, unreduced_kind=sum)");
  // An ordinary spec's bytes did not change: no unreduced or reduced fields.
  pb::PartitionSpec plain;
  to_proto(P("X", None), &plain);
  EXPECT_EQ(plain.unreduced_size() + plain.reduced_size(), 0);
}

// A scan of `results` result nodes (as the tracer makes them: one node per result, all sharing
// one body; the scan VJP's forward loop has one per residual) over a body of c' = c * 2 and
// ys = c + c, the body given per node by `body_of(j)`.
Graph scan_graph(int results, const std::function<std::shared_ptr<const Graph>(int)>& body_of) {
  Graph g;
  const int init = *g.add_constant(DType::kF32, {4}, 1.0);
  std::vector<int> outs;
  for (int j = 0; j < results; ++j) {
    Node n;
    n.op = Op::kScan;
    n.operands = {init};
    n.attributes = ScanAttrs{body_of(j), 3, false, 1, j == 0 ? 0 : 1};
    outs.push_back(*g.add_node(std::move(n)));
  }
  EXPECT_TRUE(g.set_outputs(outs).ok());
  return g;
}

std::shared_ptr<const Graph> doubling_body() {
  auto body = std::make_shared<Graph>();
  const int c = body->add_parameter(DType::kF32, {4});
  EXPECT_TRUE(body->set_outputs({*body->add_binary(Op::kMul, c, *body->add_constant(DType::kF32, {4}, 2.0)),
                                 *body->add_binary(Op::kAdd, c, c)})
                  .ok());
  return body;
}

// Protocol 19: a graph's sub-graphs are written once each, however many result nodes share them
// (before, each scan node carried its own copy: the transformer's step was 275 KB, mostly copies).
TEST(Wire, SubGraphsSharedByResultNodesAreWrittenOnceAndDecodedShared) {
  const std::shared_ptr<const Graph> body = doubling_body();
  pb::Graph two, eight;
  to_proto(scan_graph(2, [&](int) { return body; }), &two);
  to_proto(scan_graph(8, [&](int) { return body; }), &eight);
  ASSERT_EQ(eight.subgraphs_size(), 1);
  EXPECT_EQ(eight.nodes(1).node().scan().body(), 0);
  EXPECT_EQ(eight.nodes(8).node().scan().body(), 0);
  // Six more result nodes cost six small nodes, not six bodies.
  const size_t body_bytes = eight.subgraphs(0).ByteSizeLong();
  EXPECT_LT(eight.ByteSizeLong() - two.ByteSizeLong(), 6 * body_bytes);

  absl::StatusOr<Graph> back = graph_from_proto(eight);
  ASSERT_TRUE(back.ok()) << back.status();
  const Node& first = back->node(1);
  for (int id = 2; id <= 8; ++id) {
    EXPECT_EQ(back->node(id).attrs<ScanAttrs>().body.get(), first.attrs<ScanAttrs>().body.get()) << id;
  }
  EXPECT_TRUE(graph_extends(*first.attrs<ScanAttrs>().body, *body));
  EXPECT_TRUE(graph_extends(*body, *first.attrs<ScanAttrs>().body));

  // Equal bodies built apart are one entry too, so the compile key does not depend on sharing.
  pb::Graph apart;
  to_proto(scan_graph(8, [](int) { return doubling_body(); }), &apart);
  EXPECT_EQ(apart.subgraphs_size(), 1);
  EXPECT_EQ(compile_key(scan_graph(8, [](int) { return doubling_body(); }), *Mesh::create({1}, {"x"}, {0}), {}, {}, {}),
            compile_key(scan_graph(8, [&](int) { return body; }), *Mesh::create({1}, {"x"}, {0}), {}, {}, {}));
}

TEST(Wire, ASubGraphIndexOutsideTheTableIsRefusedNamingIt) {
  const std::shared_ptr<const Graph> body = doubling_body();
  pb::Graph wire;
  to_proto(scan_graph(2, [&](int) { return body; }), &wire);
  wire.mutable_nodes(2)->mutable_node()->mutable_scan()->set_body(1);
  absl::StatusOr<Graph> bad = graph_from_proto(wire);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("graph: node 2: its body is sub-graph 1, but the graph has 1 (indices from 0)"));
  wire.mutable_nodes(2)->mutable_node()->mutable_scan()->set_body(-3);
  EXPECT_THAT(std::string(graph_from_proto(wire).status().message()), HasSubstr("its body is sub-graph -3"));
  // A broken sub-graph is named by its index.
  wire.mutable_nodes(2)->mutable_node()->mutable_scan()->set_body(0);
  wire.mutable_subgraphs(0)->mutable_outputs()->Set(0, 9);
  EXPECT_THAT(std::string(graph_from_proto(wire).status().message()), HasSubstr("graph: sub-graph 0: "));
}

// A slice's strides from the wire go through the type rule as lax.slice's (_slice_shape_rule,
// jax/_src/lax/slicing.py): a stride of INT64_MAX is valid and keeps one element (its size rule
// overflowed before), zero, negative and wrong-length strides are refused, and one stride of 1
// per dimension decodes stored empty, as add_slice builds it.
TEST(Wire, SliceStridesFromTheWireAreCheckedAndSizedWithoutOverflow) {
  Graph g;
  const int x = g.add_parameter(DType::kF32, {16, 16});
  ASSERT_TRUE(g.add_slice(x, {0, 0}, {16, 16}, {2, 4}).ok());
  pb::Graph wire;
  to_proto(g, &wire);
  // The node claims its type on the wire, checked against the type rule's.
  auto with_strides = [&](std::vector<int64_t> strides, std::vector<int64_t> claimed = {8, 4}) {
    pb::Graph w = wire;
    pb::KernelNode* node = w.mutable_nodes(1)->mutable_node();
    node->mutable_slice()->mutable_strides()->Assign(strides.begin(), strides.end());
    node->mutable_shape()->mutable_dims()->Assign(claimed.begin(), claimed.end());
    return graph_from_proto(w);
  };
  absl::StatusOr<Graph> far = with_strides({std::numeric_limits<int64_t>::max(), 1}, {1, 16});
  ASSERT_TRUE(far.ok()) << far.status();
  EXPECT_EQ(far->node(1).shape, (Shape{1, 16}));
  absl::StatusOr<Graph> unit = with_strides({1, 1}, {16, 16});
  ASSERT_TRUE(unit.ok()) << unit.status();
  EXPECT_TRUE(unit->node(1).attrs<SliceAttrs>().strides.empty());
  for (const std::vector<int64_t>& bad : std::vector<std::vector<int64_t>>{{0, 1}, {1, -1}, {2}, {1}}) {
    SCOPED_TRACE(bad.size() == 1 ? bad[0] : bad[1]);
    const absl::Status refused = with_strides(bad, {16, 16}).status();
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(refused.message()), HasSubstr("slice strides must"));
  }
}

// The node-count bound (issue #17, "graph sizes have limits with INVALID_ARGUMENT naming the
// limit"): a graph of 2^20 + 1 nodes is refused before any node is decoded, and so is one
// nested as a sub-graph, named by its index.
TEST(Wire, AGraphOverTheNodeLimitIsRefusedNamingTheLimit) {
  constexpr int kLimit = 1 << 20;
  pb::Graph big;
  big.mutable_nodes()->Reserve(kLimit + 1);
  for (int i = 0; i <= kLimit; ++i) big.add_nodes();
  absl::StatusOr<Graph> bad = graph_from_proto(big);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("graph: 1048577 nodes is over the limit of 1048576"));
  pb::Graph outer;
  *outer.add_subgraphs() = std::move(big);
  bad = graph_from_proto(outer);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("graph: sub-graph 0: graph: 1048577 nodes is over the limit of 1048576"));
}

}  // namespace
}  // namespace tessera

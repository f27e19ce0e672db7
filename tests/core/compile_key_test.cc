// compile_key: the program cache's key is the whole compile request, canonical and exact.
// Every field of a node, of the mesh and of the request is varied here; each variation must
// give a key of its own, and the same program built twice (or sent through the wire) the
// same key. Issue 14 item 1: keys were a hash of text that printed constants with 6 digits.
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>

#include "core/graph.h"
#include "core/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"

namespace tessera {
namespace {

double nan_with_payload(uint64_t payload) {
  const uint64_t bits = 0x7ff8000000000000ull | payload;
  double v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

struct Request {
  Graph graph;
  Mesh mesh = *make_mesh({4, 2}, {"x", "y"}, {0, 1, 2, 3, 4, 5, 6, 7});
  std::vector<PartitionSpec> inputs;
  std::vector<std::optional<PartitionSpec>> outputs;
  std::vector<int> donated;
  std::string key() const { return compile_key(graph, mesh, inputs, outputs, donated); }
};

// A program touching every field of every attributes struct (core/op_attrs.h): parameter
// dtype, shape and index (the graph numbers parameters: varied by their order), constant
// value, iota dimension, broadcast result_dims, transpose permutation, reduction axes,
// argmax axis, slice start/limit/strides, concatenate axis, all four dot dimension lists, the
// shardings of sharding_constraint and shard_map_in/out, each collective's mesh, axes,
// reduce op, dimension, split/concat dimensions and positions, axis_index's mesh and axes,
// gather and scatter's axis, mode and fill value, dynamic_slice's sizes, scan's length,
// reverse, carry count, output and body, and random_bits' shape and words.
struct Knobs {
  DType dtype = DType::kF32;
  Shape shape = {8, 4};
  Scalar constant = 0.5;
  DType constant_dtype = DType::kF32;
  int64_t iota_dim = 0;
  std::vector<int64_t> slice_start = {0, 0}, slice_limit = {8, 4}, slice_strides = {};
  DotDims dot{{}, {}, {1}, {1}};
  std::vector<int64_t> permutation = {1, 0};
  std::vector<int64_t> reduce_axes = {0};
  Op binary = Op::kAdd;
  bool swap_operands = false;
  PartitionSpec constraint = P("x", None);
  std::vector<int> constraint_devices = {0, 1, 2, 3, 4, 5, 6, 7};
  std::vector<std::string> collective_axes = {"y"};
  ReduceOp reduce_op = ReduceOp::kSum;
  Op collective = Op::kAllReduce;
  std::vector<int64_t> collective_dims = {};
  bool two_outputs = true;
  // Attributes on a second, square parameter q (4, 4): varying one keeps every type.
  bool q_first = false;  // q is parameter 0, x parameter 1
  std::vector<int64_t> broadcast_dims = {0, 1};
  int64_t argmax_axis = 0;
  int64_t concat_axis = 0;
  DotDims q_dot{{}, {}, {1}, {0}};
  PartitionSpec map_in = P("x", None), map_out = P("x", None);
  std::vector<int> collective_devices = {0, 1, 2, 3, 4, 5, 6, 7};  // the body collectives' mesh
  int64_t gather_dim = 0, scatter_dim = 0;
  std::vector<int64_t> all_to_all_dims = {0, 1};  // split, concat
  std::vector<int64_t> positions = {0, 1, 1, 0};
  std::vector<std::string> index_axes = {"x"};
  std::vector<int> index_devices = {0, 1, 2, 3, 4, 5, 6, 7};
  int64_t take_axis = 0;
  IndexMode take_mode = IndexMode::kFillOrDrop;
  std::optional<Scalar> take_fill;
  int64_t batched_take_dims = 1;  // a per-row take of q along axis 1 (GatherAttrs.batch_dims)
  Op scatter_op = Op::kScatter;
  IndexMode scatter_mode = IndexMode::kFillOrDrop;
  std::vector<int64_t> window = {2, 2};
  // scan: its loop's fields and a field of a node of its body.
  int64_t scan_length = 4;
  bool scan_reverse = false;
  int64_t scan_carries = 1;  // 1: a carry and an xs; 2: two carries, no xs
  int64_t scan_output = 0;
  double scan_body_constant = 2.0;
  int64_t branches = 2;  // a switch's branch count (BranchesAttrs.graphs)
  int64_t branches_output = 0;
  double branch_constant = 2.0;
  Shape random_shape = {3, 4};  // random_bits' counted shape
  bool random_words = false;
};

// The scan of `k`: carries of f32[4] (c' = c + other * constant, the second carry kept),
// xs rows of f32[4]; the body's last result is c * other.
absl::StatusOr<int> add_scan(Graph& g, const Knobs& k) {
  auto body = std::make_shared<Graph>();
  const int c = body->add_parameter(DType::kF32, {4});
  const int other = body->add_parameter(DType::kF32, {4});
  const int scaled = *body->add_binary(Op::kMul, other, *body->add_constant(DType::kF32, {4}, k.scan_body_constant));
  std::vector<int> outs = {*body->add_binary(Op::kAdd, c, scaled)};
  if (k.scan_carries == 2) outs.push_back(other);
  outs.push_back(*body->add_binary(Op::kMul, c, other));
  EXPECT_TRUE(body->set_outputs(outs).ok());
  const int init = *g.add_constant(DType::kF32, {4}, 0.0);
  const int second =
      k.scan_carries == 2 ? *g.add_constant(DType::kF32, {4}, 1.0) : *g.add_iota(DType::kF32, {k.scan_length, 4}, 1);
  Node n;
  n.op = Op::kScan;
  n.operands = {init, second};
  n.attributes = ScanAttrs{body, k.scan_length, k.scan_reverse, k.scan_carries, k.scan_output};
  return g.add_node(std::move(n));
}

// A switch of `branches` branches (x * c, x + c, ...) with two results each: every field of
// BranchesAttrs.
absl::StatusOr<int> add_switch(Graph& g, const Knobs& k) {
  std::vector<std::shared_ptr<const Graph>> graphs;
  for (int64_t b = 0; b < k.branches; ++b) {
    auto body = std::make_shared<Graph>();
    const int x = body->add_parameter(DType::kF32, {4});
    const int c = *body->add_constant(DType::kF32, {4}, b == 0 ? k.branch_constant : 1.0);
    EXPECT_TRUE(body->set_outputs({*body->add_binary(b == 0 ? Op::kMul : Op::kAdd, x, c), x}).ok());
    graphs.push_back(body);
  }
  Node n;
  n.op = Op::kSwitch;
  n.operands = {*g.add_constant(DType::kI32, {}, 1), *g.add_constant(DType::kF32, {4}, 0.5)};
  n.attributes = BranchesAttrs{graphs, k.branches_output};
  return g.add_node(std::move(n));
}

Request build(const Knobs& k) {
  Request r;
  Graph& g = r.graph;
  const int q_early = k.q_first ? g.add_parameter(DType::kF32, {4, 4}) : -1;
  const int p = g.add_parameter(k.dtype, k.shape);
  const int q = k.q_first ? q_early : g.add_parameter(DType::kF32, {4, 4});
  EXPECT_TRUE(g.add_broadcast_in_dim(q, {4, 4, 4}, k.broadcast_dims).ok());
  EXPECT_TRUE(g.add_argmax(q, k.argmax_axis, DType::kI32).ok());
  EXPECT_TRUE(g.add_concatenate({q, q}, k.concat_axis).ok());
  EXPECT_TRUE(g.add_dot_general(q, q, k.q_dot).ok());
  const int idx = *g.add_iota(DType::kI32, {3}, 0);
  EXPECT_TRUE(g.add_gather(q, idx, GatherAttrs{k.take_axis, k.take_mode, k.take_fill}).ok());
  const int rows = *g.add_gather(q, idx, GatherAttrs{});
  EXPECT_TRUE(g.add_gather(q, *g.add_iota(DType::kI32, {4, 4}, 1),
                           GatherAttrs{1, IndexMode::kClip, std::nullopt, k.batched_take_dims})
                  .ok());
  EXPECT_TRUE(g.add_scatter(k.scatter_op, q, idx, rows, GatherAttrs{0, k.scatter_mode, std::nullopt}).ok());
  EXPECT_TRUE(g.add_dynamic_slice(q, *g.add_iota(DType::kI32, {2}, 0), k.window).ok());
  EXPECT_TRUE(g.add_random_bits(*g.add_constant(DType::kU32, {2}, Scalar(0)),
                                *g.add_constant(DType::kI64, {}, Scalar(0)), k.random_shape, k.random_words)
                  .ok());
  const int c = *g.add_constant(k.constant_dtype, k.shape, k.constant);
  const int cc = k.constant_dtype == k.dtype ? c : *g.add_convert(c, k.dtype);
  const int io = *g.add_iota(k.dtype, k.shape, k.iota_dim);
  const int s = *g.add_slice(*g.add_binary(k.binary, k.swap_operands ? io : p, k.swap_operands ? p : io), k.slice_start,
                             k.slice_limit, k.slice_strides);
  const int sum = *g.add_binary(Op::kAdd, *g.add_slice(cc, k.slice_start, k.slice_limit, k.slice_strides), s);
  const int d = *g.add_dot_general(sum, sum, k.dot);
  const int t = *g.add_transpose(d, k.permutation);
  const int red = *g.add_reduce(Op::kReduceSum, t, k.reduce_axes);
  const Mesh constraint_mesh = *make_mesh({4, 2}, {"x", "y"}, k.constraint_devices);
  const int sc = *g.add_sharding_constraint(p, NamedSharding(constraint_mesh, k.constraint));
  const int in = *g.add_shard_map_in(sc, NamedSharding(r.mesh, k.map_in));
  const int col = *g.add_collective(k.collective, in, r.mesh, k.collective_axes, k.collective_dims, k.reduce_op);
  const int out = *g.add_shard_map_out(col, NamedSharding(r.mesh, k.map_out));
  const Mesh body_mesh = *make_mesh({4, 2}, {"x", "y"}, k.collective_devices);
  EXPECT_TRUE(g.add_collective(Op::kAllGather, in, body_mesh, {"y"}, {k.gather_dim}).ok());
  EXPECT_TRUE(g.add_collective(Op::kReduceScatter, in, body_mesh, {"y"}, {k.scatter_dim}, ReduceOp::kSum).ok());
  EXPECT_TRUE(g.add_collective(Op::kAllToAll, in, body_mesh, {"y"}, k.all_to_all_dims).ok());
  EXPECT_TRUE(g.add_collective(Op::kCollectivePermute, in, body_mesh, {"y"}, k.positions).ok());
  EXPECT_TRUE(g.add_axis_index(*make_mesh({4, 2}, {"x", "y"}, k.index_devices), k.index_axes).ok());
  EXPECT_TRUE(add_scan(g, k).ok());
  EXPECT_TRUE(add_switch(g, k).ok());
  EXPECT_TRUE(g.set_outputs(k.two_outputs ? std::vector<int>{red, out} : std::vector<int>{out, red}).ok());
  r.inputs = {P("x", None)};
  r.outputs = {std::nullopt, P("x", None)};
  return r;
}

TEST(CompileKey, EveryFieldOfANodeAndOfTheRequestMakesItsOwnKey) {
  std::map<std::string, std::function<void(Knobs&)>> node_variations = {
      {"base", [](Knobs&) {}},
      {"dtype", [](Knobs& k) { k.dtype = DType::kF64; }},
      {"shape",
       [](Knobs& k) {
         k.shape = {8, 8};
         k.slice_limit = {8, 8};
       }},
      {"constant 7th digit", [](Knobs& k) { k.constant = 0.5000001; }},
      {"constant dtype", [](Knobs& k) { k.constant_dtype = DType::kF64; }},
      {"integer constant",
       [](Knobs& k) {
         k.constant = int64_t{0};
         k.constant_dtype = DType::kI64;
       }},
      {"integer constant 2^53+1",
       [](Knobs& k) {
         k.constant = (int64_t{1} << 53) + 1;
         k.constant_dtype = DType::kI64;
       }},
      {"integer constant 2^53",
       [](Knobs& k) {
         k.constant = int64_t{1} << 53;
         k.constant_dtype = DType::kI64;
       }},
      {"constant 0", [](Knobs& k) { k.constant = 0.0; }},
      {"constant -0", [](Knobs& k) { k.constant = -0.0; }},
      {"constant nan", [](Knobs& k) { k.constant = std::numeric_limits<double>::quiet_NaN(); }},
      {"constant nan payload", [](Knobs& k) { k.constant = nan_with_payload(1); }},
      {"constant 1e6", [](Knobs& k) { k.constant = 1000000.0; }},
      {"constant 1e6+1", [](Knobs& k) { k.constant = 1000001.0; }},
      {"iota dimension", [](Knobs& k) { k.iota_dim = 1; }},
      {"slice start",
       [](Knobs& k) {
         k.slice_start = {1, 0};
       }},
      {"slice limit",
       [](Knobs& k) {
         k.slice_limit = {8, 3};
       }},
      {"slice strides",
       [](Knobs& k) {
         k.slice_strides = {1, 2};
       }},
      {"dot lhs contracting",
       [](Knobs& k) {
         k.dot = DotDims{{}, {}, {0}, {0}};
       }},
      {"dot batch",
       [](Knobs& k) {
         k.dot = DotDims{{0}, {0}, {1}, {1}};
         k.permutation = {0};
       }},
      {"transpose",
       [](Knobs& k) {
         k.permutation = {0, 1};
       }},
      {"reduce axes", [](Knobs& k) { k.reduce_axes = {1}; }},
      {"op", [](Knobs& k) { k.binary = Op::kMul; }},
      {"operand order", [](Knobs& k) { k.swap_operands = true; }},
      {"constraint spec", [](Knobs& k) { k.constraint = P(None, "y"); }},
      {"constraint devices", [](Knobs& k) { k.constraint_devices = {7, 6, 5, 4, 3, 2, 1, 0}; }},
      {"collective axes", [](Knobs& k) { k.collective_axes = {"x"}; }},
      {"collective reduce op", [](Knobs& k) { k.reduce_op = ReduceOp::kMax; }},
      {"collective op",
       [](Knobs& k) {
         k.collective = Op::kAllGather;
         k.collective_dims = {1};
       }},
      {"outputs", [](Knobs& k) { k.two_outputs = false; }},
      {"parameter index", [](Knobs& k) { k.q_first = true; }},
      {"broadcast result_dims",
       [](Knobs& k) {
         k.broadcast_dims = {0, 2};
       }},
      {"argmax axis", [](Knobs& k) { k.argmax_axis = 1; }},
      {"concatenate axis", [](Knobs& k) { k.concat_axis = 1; }},
      {"dot lhs_contracting",
       [](Knobs& k) {
         k.q_dot = DotDims{{}, {}, {0}, {0}};
       }},
      {"dot rhs_contracting",
       [](Knobs& k) {
         k.q_dot = DotDims{{}, {}, {1}, {1}};
       }},
      {"dot lhs_batch",
       [](Knobs& k) {
         k.q_dot = DotDims{{0}, {1}, {1}, {0}};
       }},
      {"dot rhs_batch",
       [](Knobs& k) {
         k.q_dot = DotDims{{1}, {0}, {0}, {1}};
       }},
      {"shard_map_in sharding", [](Knobs& k) { k.map_in = P(None, "x"); }},
      {"shard_map_out sharding", [](Knobs& k) { k.map_out = P(None, "x"); }},
      {"collective mesh", [](Knobs& k) { k.collective_devices = {7, 6, 5, 4, 3, 2, 1, 0}; }},
      {"all_gather dimension", [](Knobs& k) { k.gather_dim = 1; }},
      {"reduce_scatter dimension", [](Knobs& k) { k.scatter_dim = 1; }},
      {"all_to_all split_dimension",
       [](Knobs& k) {
         k.all_to_all_dims = {1, 1};
       }},
      {"all_to_all concat_dimension",
       [](Knobs& k) {
         k.all_to_all_dims = {0, 0};
       }},
      {"collective_permute positions",
       [](Knobs& k) {
         k.positions = {0, 0, 1, 1};
       }},
      {"axis_index axes", [](Knobs& k) { k.index_axes = {"y"}; }},
      {"axis_index mesh", [](Knobs& k) { k.index_devices = {7, 6, 5, 4, 3, 2, 1, 0}; }},
      {"gather axis", [](Knobs& k) { k.take_axis = 1; }},
      {"gather mode", [](Knobs& k) { k.take_mode = IndexMode::kClip; }},
      {"gather fill 0.0", [](Knobs& k) { k.take_fill = Scalar(0.0); }},
      {"gather fill 0", [](Knobs& k) { k.take_fill = Scalar(0); }},
      {"gather batch_dims", [](Knobs& k) { k.batched_take_dims = 0; }},
      {"scatter op", [](Knobs& k) { k.scatter_op = Op::kScatterAdd; }},
      {"scatter mode", [](Knobs& k) { k.scatter_mode = IndexMode::kClip; }},
      {"dynamic_slice sizes",
       [](Knobs& k) {
         k.window = {2, 3};
       }},
      {"scan length", [](Knobs& k) { k.scan_length = 3; }},
      {"scan reverse", [](Knobs& k) { k.scan_reverse = true; }},
      {"scan num_carry", [](Knobs& k) { k.scan_carries = 2; }},
      {"scan output", [](Knobs& k) { k.scan_output = 1; }},
      {"scan body", [](Knobs& k) { k.scan_body_constant = 3.0; }},
      {"branch count", [](Knobs& k) { k.branches = 3; }},
      {"branches output", [](Knobs& k) { k.branches_output = 1; }},
      {"a branch's body", [](Knobs& k) { k.branch_constant = 3.0; }},
      {"random_bits shape",
       [](Knobs& k) {
         k.random_shape = {4, 3};
       }},
      {"random_bits words", [](Knobs& k) { k.random_words = true; }},
  };
  std::map<std::string, std::string> keys;  // key -> variation
  for (const auto& [name, vary] : node_variations) {
    SCOPED_TRACE(name);
    Knobs k;
    vary(k);
    const std::string key = build(k).key();
    EXPECT_EQ(build(k).key(), key) << "the same program built twice";
    Request r = build(k);
    pb::Graph wire;
    to_proto(r.graph, &wire);
    absl::StatusOr<Graph> back = graph_from_proto(wire);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(compile_key(*back, r.mesh, r.inputs, r.outputs, r.donated), key) << "the same program from the wire";
    auto [it, fresh] = keys.emplace(key, name);
    EXPECT_TRUE(fresh) << name << " has the key of " << it->second;
  }
  // The request around the graph: mesh shape, axis names, device order; specs; donation.
  std::map<std::string, std::function<void(Request&)>> request_variations = {
      {"mesh device order",
       [](Request& r) {
         r.mesh = *make_mesh({4, 2}, {"x", "y"}, {1, 0, 2, 3, 4, 5, 6, 7});
       }},
      {"mesh axis names",
       [](Request& r) {
         r.mesh = *make_mesh({4, 2}, {"x", "z"}, {0, 1, 2, 3, 4, 5, 6, 7});
       }},
      {"mesh shape",
       [](Request& r) {
         r.mesh = *make_mesh({2, 4}, {"x", "y"}, {0, 1, 2, 3, 4, 5, 6, 7});
       }},
      {"input spec", [](Request& r) { r.inputs = {P(None, "x")}; }},
      {"input spec replicated", [](Request& r) { r.inputs = {P()}; }},
      {"output spec set", [](Request& r) { r.outputs[0] = P(); }},
      {"output spec", [](Request& r) { r.outputs[1] = P("y", None); }},
      {"donated", [](Request& r) { r.donated = {0}; }},
  };
  for (const auto& [name, vary] : request_variations) {
    SCOPED_TRACE(name);
    Request r = build(Knobs{});
    vary(r);
    auto [it, fresh] = keys.emplace(r.key(), name);
    EXPECT_TRUE(fresh) << name << " has the key of " << it->second;
  }
}

TEST(CompileKey, SurvivesTheWireAndPrintsConstantsExactly) {
  Knobs k;
  k.constant = 0.1234568;
  Request r = build(k);
  pb::Graph wire;
  to_proto(r.graph, &wire);
  absl::StatusOr<Graph> back = graph_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(compile_key(*back, r.mesh, r.inputs, r.outputs, r.donated), r.key());
  EXPECT_THAT(r.graph.to_text(), ::testing::HasSubstr("value=0.1234568"));

  // Integer constants keep every bit through the wire; floating ones their sign and payload.
  for (const Scalar& s : {Scalar((int64_t{1} << 53) + 1), Scalar(-0.0), Scalar(nan_with_payload(5)),
                          Scalar(std::numeric_limits<int64_t>::min())}) {
    Graph g;
    const int c = *g.add_constant(s.is_integer() ? DType::kI64 : DType::kF64, {2}, s);
    ASSERT_TRUE(g.set_outputs({c}).ok());
    pb::Graph w;
    to_proto(g, &w);
    absl::StatusOr<Graph> b = graph_from_proto(w);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->node(c).attrs<ConstantAttrs>().value, s) << s.to_string();
  }
}

TEST(Scalar, ComparesBitsAndPrintsTheShortestExactText) {
  EXPECT_NE(Scalar(0.0), Scalar(-0.0));
  EXPECT_NE(Scalar(1.0), Scalar(int64_t{1}));  // a float and an integer constant differ
  EXPECT_EQ(Scalar(nan_with_payload(3)), Scalar(nan_with_payload(3)));
  EXPECT_NE(Scalar(nan_with_payload(3)), Scalar(nan_with_payload(4)));
  EXPECT_EQ(Scalar(0.1234567).to_string(), "0.1234567");
  EXPECT_EQ(Scalar(1000001.0).to_string(), "1000001");
  EXPECT_EQ(Scalar(0.1).to_string(), "0.1");
  EXPECT_EQ(Scalar(1.0 / 3).to_string(), "0.3333333333333333");
  EXPECT_EQ(Scalar(-0.0).to_string(), "-0");
  EXPECT_EQ(Scalar((int64_t{1} << 53) + 1).to_string(), "9007199254740993");
  EXPECT_EQ(Scalar(std::numeric_limits<double>::quiet_NaN()).to_string(), "nan");
  EXPECT_EQ(Scalar(nan_with_payload(1)).to_string(), "nan(0x7ff8000000000001)");
  EXPECT_EQ(Scalar(true).int_value(), 1);
}

}  // namespace
}  // namespace tessera

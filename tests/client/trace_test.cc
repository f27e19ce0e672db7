// Tracing: the graphs functions record, the shapes and dtypes inferred, and the errors
// reported at trace time, naming the op and the shapes.
#include <type_traits>
#include <utility>

#include "core/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"
#include "tessera/tessera.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

absl::StatusOr<Graph> trace1(const std::function<Value(const std::vector<Value>&)>& f,
                             const std::vector<ArrayType>& inputs) {
  return trace([&](const std::vector<Value>& in) { return std::vector<Value>{f(in)}; }, inputs);
}

const Node& output(const Graph& g, int i = 0) { return g.node(g.outputs()[i]); }

TEST(Trace, SeedLayerRecordsDotThenTanh) {
  absl::StatusOr<Graph> g = trace1([](const auto& in) { return tanh(matmul(in[0], in[1])); },
                                   {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->to_text(),
            "%0 = parameter() f32[16,8] index=0\n"
            "%1 = parameter() f32[8,4] index=1\n"
            "%2 = dot_general(%0, %1) f32[16,4] lhs_batch={} rhs_batch={} lhs_contracting={1} rhs_contracting={0}\n"
            "%3 = tanh(%2) f32[16,4]\n"
            "ROOT (%3)\n");
}

// Regression: Value::shape() returned a reference into the graph's node storage, which
// moves as ops are added, so a shape held across later ops dangled (found by the random jit
// graphs, as std::bad_array_new_length). It is a value now; ASan builds also catch a relapse.
static_assert(std::is_same_v<decltype(std::declval<const Value&>().shape()), Shape>,
              "Value::shape() must not hand out a reference into the growing graph");
TEST(Trace, ShapeHeldAcrossLaterOpsStaysValid) {
  absl::StatusOr<Graph> g = trace1(
      [](const auto& in) {
        const Shape& s = in[0].shape();  // binds to the returned value: lives as long as s
        Value v = in[0];
        for (int i = 0; i < 100; ++i) v = tanh(v);  // grows the graph's storage many times over
        return reshape(v, {s[1], s[0]});
      },
      {{DType::kF32, {16, 8}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).shape, (Shape{8, 16}));
}

TEST(Trace, BinaryOpsBroadcastLikeNumpy) {
  absl::StatusOr<Graph> g =
      trace1([](const auto& in) { return in[0] + in[1]; }, {{DType::kF32, {16, 4}}, {DType::kF32, {4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).shape, (Shape{16, 4}));
  const Node& b = g->node(output(*g).operands[1]);
  EXPECT_EQ(b.op, Op::kBroadcastInDim);
  EXPECT_EQ(b.attrs<BroadcastAttrs>().result_dims, (std::vector<int64_t>{1}));
  // Size-1 dimensions stretch: (3, 1) + (1, 5) -> (3, 5).
  absl::StatusOr<Graph> h =
      trace1([](const auto& in) { return in[0] * in[1]; }, {{DType::kI32, {3, 1}}, {DType::kI32, {1, 5}}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(output(*h).shape, (Shape{3, 5}));
}

TEST(Trace, ScalarsTakeTheArraysDtype) {
  absl::StatusOr<Graph> g = trace1([](const auto& in) { return 2.0 * in[0] - 1.0; }, {{DType::kF64, {3}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).dtype, DType::kF64);
  EXPECT_EQ(output(*g).op, Op::kSub);
}

// JAX's weak types (jnp.arange(3, dtype=int32) * 0.5 is float32, * 2 stays int32; True + 1 is
// int32, True + 1.0 float32; a float array keeps its dtype with either; `/` is true division).
TEST(Trace, ScalarsAreWeaklyTypedAsInJax) {
  struct Case {
    std::string name;
    std::function<Value(const std::vector<Value>&)> f;
    DType input;
    DType want;
  };
  const std::vector<Case> cases = {
      {"int32 * 0.5", [](const auto& in) { return in[0] * 0.5; }, DType::kI32, DType::kF32},
      {"0.5 - int64", [](const auto& in) { return 0.5 - in[0]; }, DType::kI64, DType::kF32},
      {"int32 * 2", [](const auto& in) { return in[0] * 2; }, DType::kI32, DType::kI32},
      {"int64 - int64_t{3}", [](const auto& in) { return in[0] - int64_t{3}; }, DType::kI64, DType::kI64},
      {"int32 / 2 (true division)", [](const auto& in) { return in[0] / 2; }, DType::kI32, DType::kF32},
      {"int32 / int32", [](const auto& in) { return in[0] / in[0]; }, DType::kI32, DType::kF32},
      {"div(int32, int32) (lax.div)", [](const auto& in) { return div(in[0], in[0]); }, DType::kI32, DType::kI32},
      {"bool + 1", [](const auto& in) { return in[0] + 1; }, DType::kBool, DType::kI32},
      {"bool + 1.0", [](const auto& in) { return in[0] + 1.0; }, DType::kBool, DType::kF32},
      {"float64 * 2", [](const auto& in) { return 2 * in[0]; }, DType::kF64, DType::kF64},
      {"float32 / 3.0", [](const auto& in) { return in[0] / 3.0; }, DType::kF32, DType::kF32},
      {"float32 - size_t{1}", [](const auto& in) { return in[0] - size_t{1}; }, DType::kF32, DType::kF32},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    absl::StatusOr<Graph> g = trace1(c.f, {{c.input, {3}}});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(output(*g).dtype, c.want);
  }
}

TEST(Trace, ComparisonsAndWhere) {
  absl::StatusOr<Graph> g = trace1([](const auto& in) { return where(in[0] > in[1], in[0], in[1]); },
                                   {{DType::kF32, {4, 4}}, {DType::kF32, {4, 4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).op, Op::kSelect);
  EXPECT_EQ(g->node(output(*g).operands[0]).dtype, DType::kBool);
}

TEST(Trace, ReductionsWithAndWithoutKeepdims) {
  for (bool keep : {false, true}) {
    absl::StatusOr<Graph> g =
        trace1([keep](const auto& in) { return sum(in[0], {-1}, keep); }, {{DType::kF32, {2, 3, 4}}});
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(output(*g).shape, keep ? (Shape{2, 3, 1}) : (Shape{2, 3}));
  }
  absl::StatusOr<Graph> m = trace1([](const auto& in) { return mean(in[0]); }, {{DType::kF32, {2, 3}}});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(output(*m).shape, Shape{});
  EXPECT_EQ(output(*m).op, Op::kDiv);
  const Node& divisor = m->node(output(*m).operands[1]);
  EXPECT_EQ(divisor.op, Op::kConstant);
  EXPECT_EQ(divisor.attrs<ConstantAttrs>().value.to_double(), 6.0) << "mean divides by the element count";
}

TEST(Trace, ShapeOpsMoveDimensions) {
  absl::StatusOr<Graph> g = trace(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{transpose(in[0], {1, 0}),
                                  reshape(in[0], {4, 4}),
                                  expand_dims(in[0], 0),
                                  squeeze(expand_dims(in[0], -1), {2}),
                                  slice(in[0], {0, 2}, {2, 8}),
                                  concatenate({in[0], in[0]}, 1),
                                  argmax(in[0], 1),
                                  convert(in[0], DType::kI64)};
      },
      {{DType::kF32, {2, 8}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g, 0).shape, (Shape{8, 2}));
  EXPECT_EQ(output(*g, 1).shape, (Shape{4, 4}));
  EXPECT_EQ(output(*g, 2).shape, (Shape{1, 2, 8}));
  EXPECT_EQ(output(*g, 3).shape, (Shape{2, 8}));
  EXPECT_EQ(output(*g, 4).shape, (Shape{2, 6}));
  EXPECT_EQ(output(*g, 5).shape, (Shape{2, 16}));
  EXPECT_EQ(output(*g, 6).shape, (Shape{2}));
  EXPECT_EQ(output(*g, 6).dtype, DType::kI32);
  EXPECT_EQ(output(*g, 7).dtype, DType::kI64);
}

TEST(Trace, BatchedDotGeneral) {
  absl::StatusOr<Graph> g =
      trace1([](const auto& in) { return matmul(in[0], in[1]); }, {{DType::kF32, {5, 2, 3}}, {DType::kF32, {5, 3, 7}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).shape, (Shape{5, 2, 7}));
}

TEST(Trace, IotaFullAndShardingConstraint) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  absl::StatusOr<Graph> g = trace1(
      [&](const auto& in) {
        return with_sharding_constraint(
            in[0] + convert(iota(DType::kI32, {16, 8}, 1), DType::kF32) + full({16, 8}, 0.5),
            NamedSharding(mesh, P("data", None)));
      },
      {{DType::kF32, {16, 8}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).op, Op::kShardingConstraint);
  EXPECT_THAT(g->to_text(), HasSubstr("spec=P('data', None)) devices={0,1,2,3,4,5,6,7}"));
}

TEST(Trace, MixedDtypesPromoteAsJaxDoes) {
  // jnp.promote_types: bool < int32 < int64 < float32 < float64; int64 with float32 is float32.
  EXPECT_EQ(promote_types(DType::kI32, DType::kF32), DType::kF32);
  EXPECT_EQ(promote_types(DType::kI64, DType::kF32), DType::kF32);
  EXPECT_EQ(promote_types(DType::kI32, DType::kI64), DType::kI64);
  EXPECT_EQ(promote_types(DType::kBool, DType::kI32), DType::kI32);
  EXPECT_EQ(promote_types(DType::kF32, DType::kF64), DType::kF64);
  EXPECT_EQ(promote_types(DType::kBool, DType::kBool), DType::kBool);
  absl::StatusOr<Graph> g =
      trace1([](const auto& in) { return in[0] * in[1]; }, {{DType::kF32, {2}}, {DType::kI32, {2}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).dtype, DType::kF32);
  EXPECT_EQ(g->node(output(*g).operands[1]).op, Op::kConvert);  // the int32 operand, converted
  g = trace1([](const auto& in) { return where(in[0] > in[1], in[0], in[1]); },
             {{DType::kI32, {2}}, {DType::kF64, {2}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(output(*g).dtype, DType::kF64);
}

struct ErrorCase {
  std::string name;
  std::function<Value(const std::vector<Value>&)> f;
  std::vector<ArrayType> inputs;
  std::vector<std::string> message;
};

TEST(Trace, ErrorsNameTheOpAndTheShapes) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  const std::vector<ErrorCase> cases = {
      {"matmul",
       [](const auto& in) { return matmul(in[0], in[1]); },
       {{DType::kF32, {16, 8}}, {DType::kF32, {4, 4}}},
       {"dot_general of f32[16,8] and f32[4,4]", "contracting dimensions 1 (size 8) and 0 (size 4) differ"}},
      {"broadcast",
       [](const auto& in) { return in[0] + in[1]; },
       {{DType::kF32, {16, 4}}, {DType::kF32, {3}}},
       {"add: operands f32[16,4] and f32[3] do not broadcast"}},
      // (tanh of an int computes in float32, as jnp; floor still needs a float.)
      {"floor of int", [](const auto& in) { return floor(in[0]); }, {{DType::kI32, {2}}}, {"floor", "i32[2]", "float"}},
      {"reshape",
       [](const auto& in) {
         return reshape(in[0], {3, 3});
       },
       {{DType::kF32, {2, 4}}},
       {"cannot reshape f32[2,4] (8 elements) to (3, 3) (9)"}},
      {"axis",
       [](const auto& in) { return sum(in[0], {2}); },
       {{DType::kF32, {2, 4}}},
       {"reduce_sum of f32[2,4]", "axis 2 is out of range for rank 2"}},
      {"constraint",
       [&](const auto& in) { return with_sharding_constraint(in[0], NamedSharding(mesh, P("data"))); },
       {{DType::kF32, {6, 4}}},
       {"with_sharding_constraint on f32[6,4]", "dimension 0 of size 6", "'data' of size 4"}},
  };
  for (const ErrorCase& c : cases) {
    SCOPED_TRACE(c.name);
    // The failing op is followed by more ops: the first error is the one reported.
    absl::StatusOr<Graph> g = trace1([&](const auto& in) { return exp(c.f(in) * 2.0); }, c.inputs);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
    for (const std::string& part : c.message) EXPECT_THAT(std::string(g.status().message()), HasSubstr(part));
  }
}

TEST(Trace, GraphsRoundTripThroughTheWireWithAllChecks) {
  const Mesh mesh = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  absl::StatusOr<Graph> g = trace(
      [&](const std::vector<Value>& in) {
        Value y = with_sharding_constraint(tanh(matmul(in[0], in[1])) + 1.0, NamedSharding(mesh, P("data", None)));
        return std::vector<Value>{y,
                                  argmax(y, 1),
                                  sum(transpose(y, {1, 0}), {0}, true),
                                  where(y > y, y, -y),
                                  concatenate({slice(y, {0, 0}, {4, 4}), iota(DType::kF32, {4, 4}, 0)}, 0),
                                  convert(reshape(y, {64}), DType::kI64)};
      },
      {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  pb::Graph wire;
  to_proto(*g, &wire);
  absl::StatusOr<Graph> back = graph_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->to_text(), g->to_text());

  pb::Graph bad = wire;
  bad.mutable_nodes(2)->set_operands(0, 40);
  EXPECT_THAT(std::string(graph_from_proto(bad).status().message()),
              HasSubstr("graph: node 2: dot_general: operand %40"));
  bad = wire;
  bad.mutable_nodes(2)->mutable_node()->mutable_shape()->set_dims(0, 17);
  EXPECT_THAT(std::string(graph_from_proto(bad).status().message()),
              HasSubstr("node 2 claims f32[17,4] but computes f32[16,4]"));
  bad = wire;
  bad.mutable_nodes(3)->mutable_node()->set_op(77);
  EXPECT_THAT(std::string(graph_from_proto(bad).status().message()), HasSubstr("unknown op 77"));
}

}  // namespace
}  // namespace tessera

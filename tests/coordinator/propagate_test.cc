// Sharding propagation: expected shardings of results and of what each op needs of its
// operands, for the layouts the partitioner must handle (traced programs, as jit sees them).
#include "coordinator/compiler/propagate.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/shard_map.h"
#include "tessera/trace.h"
#include "tests/support/plan_matchers.h"

namespace tessera {
namespace {

using ::tessera::testing::StatusIs;

class PropagateTest : public ::testing::Test {
 protected:
  const Mesh mesh_ = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});

  // Traces f, propagates the input specs, and returns the result sharding of every output.
  std::vector<std::string> run(const TracedFunction& f, const std::vector<ArrayType>& types,
                               const std::vector<PartitionSpec>& specs,
                               std::vector<std::optional<PartitionSpec>> outputs = {}) {
    absl::StatusOr<Graph> g = trace(f, types);
    EXPECT_TRUE(g.ok()) << g.status();
    if (!g.ok()) return {};
    graph_ = *std::move(g);
    if (outputs.empty()) outputs.resize(graph_.outputs().size());
    absl::StatusOr<Propagation> p = propagate(graph_, mesh_, specs, outputs);
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return {};
    prop_ = *std::move(p);
    std::vector<std::string> out;
    for (int o : graph_.outputs()) out.push_back(prop_.result[o].to_string());
    return out;
  }
  // What node `id` needs of operand k.
  std::string need(int id, int k) const { return prop_.operands[id][k].to_string(); }
  int find(Op op) const {
    for (int i = 0; i < graph_.size(); ++i) {
      if (graph_.node(i).op == op) return i;
    }
    return -1;
  }

  Graph graph_;
  Propagation prop_;
};

std::vector<Value> seed(const std::vector<Value>& in) { return {tanh(matmul(in[0], in[1]))}; }

TEST_F(PropagateTest, SeedLayerShardsTheResultOverBothAxes) {
  // JAX: x P('data', None) @ w P(None, 'model') -> P('data', 'model'), no communication.
  EXPECT_THAT(run(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", None), P(None, "model")}),
              ::testing::ElementsAre("P('data', 'model')"));
  const int d = find(Op::kDotGeneral);
  EXPECT_EQ(need(d, 0), "P('data', None)");
  EXPECT_EQ(need(d, 1), "P(None, 'model')");
}

TEST_F(PropagateTest, ShardedContractionLeavesAPartialSumThatTanhCannotTake) {
  run(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)});
  const int d = find(Op::kDotGeneral);
  EXPECT_EQ(prop_.result[d].to_string(), "P(None, None) partial(sum over 'model')");
  // tanh is not linear: it needs the sum resolved (the partitioner's all_reduce).
  EXPECT_EQ(need(find(Op::kTanh), 0), "P(None, None)");
}

TEST_F(PropagateTest, OneSidedContractionShardsTheOtherSideToMatch) {
  run(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P()});
  const int d = find(Op::kDotGeneral);
  EXPECT_EQ(need(d, 1), "P('model', None)");  // a local slice of the replicated w
  EXPECT_EQ(prop_.result[d].to_string(), "P(None, None) partial(sum over 'model')");
}

TEST_F(PropagateTest, PartialSumsFlowThroughLinearOps) {
  // (x @ w) * 2 - b is linear in the partial product only up to the subtraction of b, which
  // is whole: the sum must be resolved there.
  run(
      [](const std::vector<Value>& in) {
        Value y = matmul(in[0], in[1]) * 2.0;
        return std::vector<Value>{y, y - in[2]};
      },
      {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}, {DType::kF32, {16, 4}}}, {P(None, "model"), P("model"), P()});
  EXPECT_EQ(prop_.result[graph_.outputs()[0]].to_string(), "P(None, None) partial(sum over 'model')");
  EXPECT_EQ(need(graph_.outputs()[1], 0), "P(None, None)");
  EXPECT_FALSE(prop_.result[graph_.outputs()[1]].is_partial());
}

TEST_F(PropagateTest, SumOverAShardedAxisIsPartial) {
  EXPECT_THAT(run(
                  [](const std::vector<Value>& in) {
                    return std::vector<Value>{sum(in[0], {0}), sum(in[0], {1})};
                  },
                  {{DType::kF32, {16, 8}}}, {P("data", "model")}),
              ::testing::ElementsAre("P('model',) partial(sum over 'data')", "P('data',) partial(sum over 'model')"));
  EXPECT_THAT(run([](const std::vector<Value>& in) { return std::vector<Value>{max(in[0], {0})}; },
                  {{DType::kF32, {16, 8}}}, {P("data", None)}),
              ::testing::ElementsAre("P(None,) partial(max over 'data')"));
}

// The axes of a pending sum are a set: an add of two sums pending over the same axes listed in
// another order keeps the pending sum (needing no resolution of either operand).
TEST_F(PropagateTest, PendingSumsOverTheSameAxesInAnyOrderAddAsPartial) {
  run([](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0]) + sum(in[1])}; },
      {{DType::kF32, {8, 4}}, {DType::kF32, {8, 4}}}, {P("data", "model"), P("model", "data")});
  const int add = graph_.outputs()[0];
  const ValueSharding& r = prop_.result[add];
  EXPECT_TRUE(same_axes(r.partial, {"data", "model"})) << r.to_string();
  EXPECT_TRUE(prop_.operands[add][0].is_partial()) << need(add, 0);
  EXPECT_TRUE(prop_.operands[add][1].is_partial()) << need(add, 1);
}

TEST_F(PropagateTest, TransposeAndReshapeMoveTheSpec) {
  EXPECT_THAT(run(
                  [](const std::vector<Value>& in) {
                    return std::vector<Value>{transpose(in[0], {1, 0})};
                  },
                  {{DType::kF32, {16, 8}}}, {P("data", "model")}),
              ::testing::ElementsAre("P('model', 'data')"));
  EXPECT_THAT(run(
                  [](const std::vector<Value>& in) {
                    return std::vector<Value>{reshape(in[0], {16, 2, 4})};
                  },
                  {{DType::kF32, {16, 8}}}, {P("data", "model")}),
              ::testing::ElementsAre("P('data', 'model', None)"));
  // Merging (16, 8) -> (128,) keeps the major dimension's split.
  EXPECT_THAT(run([](const std::vector<Value>& in) { return std::vector<Value>{reshape(in[0], {128})}; },
                  {{DType::kF32, {16, 8}}}, {P("data", "model")}),
              ::testing::ElementsAre("P('data',)"));
  EXPECT_EQ(need(find(Op::kReshape), 0), "P('data', None)");
}

TEST_F(PropagateTest, ElementwiseOperandsAgreeOnTheMostSplitLayout) {
  EXPECT_THAT(run([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; },
                  {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}}, {P("data", None), P(None, "model")}),
              ::testing::ElementsAre("P('data', 'model')"));
  const int add = find(Op::kAdd);
  EXPECT_EQ(need(add, 0), "P('data', 'model')");
  EXPECT_EQ(need(add, 1), "P('data', 'model')");
}

TEST_F(PropagateTest, ConstantsTakeTheirUsersLayout) {
  run([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; }, {{DType::kF32, {16, 8}}},
      {P("data", None)});
  EXPECT_EQ(prop_.result[find(Op::kConstant)].to_string(), "P('data', None)");
}

TEST_F(PropagateTest, ShardingConstraintPinsTheValue) {
  EXPECT_THAT(
      run(
          [&](const std::vector<Value>& in) {
            return std::vector<Value>{exp(with_sharding_constraint(in[0], NamedSharding(mesh_, P(None, "model"))))};
          },
          {{DType::kF32, {16, 8}}}, {P("data", None)}),
      ::testing::ElementsAre("P(None, 'model')"));
  EXPECT_EQ(need(find(Op::kShardingConstraint), 0), "P(None, 'model')");
}

// Backward propagation: what consumers want pulls producers, where that moves fewer bytes.

TEST_F(PropagateTest, ConstraintPullsTheComputationBeforeIt) {
  // GSPMD: exp runs in the constraint's layout on a locally sliced input, rather than on the
  // whole array followed by a slice.
  run(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{with_sharding_constraint(exp(in[0]), NamedSharding(mesh_, P("data", None)))};
      },
      {{DType::kF32, {16, 8}}}, {P()});
  EXPECT_EQ(prop_.result[find(Op::kExp)].to_string(), "P('data', None)");
  EXPECT_EQ(need(find(Op::kExp), 0), "P('data', None)");
}

TEST_F(PropagateTest, OutShardingsPullTheContraction) {
  // Replicated operands, a sharded result wanted: each device computes only its block.
  EXPECT_THAT(run([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
                  {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(), P()}, {P("data", "model")}),
              ::testing::ElementsAre("P('data', 'model')"));
  const int d = find(Op::kDotGeneral);
  EXPECT_EQ(need(d, 0), "P('data', None)");
  EXPECT_EQ(need(d, 1), "P(None, 'model')");
}

TEST_F(PropagateTest, ReshardGoesWhereTheValueIsSmallest) {
  // A gather wanted after a reduction stays after it: 16 values move, not 16 x 1024.
  EXPECT_THAT(run([](const std::vector<Value>& in) { return std::vector<Value>{sum(exp(in[0]), {1})}; },
                  {{DType::kF32, {16, 1024}}}, {P("data", None)}, {P()}),
              ::testing::ElementsAre("P('data',)"));
  EXPECT_EQ(prop_.result[find(Op::kExp)].to_string(), "P('data', None)");
  // One wanted after a broadcast moves before it: the (16,) operand is gathered instead.
  EXPECT_THAT(run(
                  [](const std::vector<Value>& in) {
                    return std::vector<Value>{exp(broadcast_in_dim(in[0], {16, 1024}, {0}))};
                  },
                  {{DType::kF32, {16}}}, {P("data")}, {P()}),
              ::testing::ElementsAre("P(None, None)"));
  EXPECT_EQ(need(find(Op::kBroadcastInDim), 0), "P(None,)");
}

TEST_F(PropagateTest, ConflictingOperandsSettleOnTheLayoutThatMovesLeast) {
  // Forward alone takes the first operand's layout, then moves both b and the result; with
  // the result wanted like b, only a moves.
  EXPECT_THAT(
      run([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; },
          {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}}, {P("data", None), P(None, "data")}, {P(None, "data")}),
      ::testing::ElementsAre("P(None, 'data')"));
  const int add = find(Op::kAdd);
  EXPECT_EQ(need(add, 0), "P(None, 'data')");
  EXPECT_EQ(need(add, 1), "P(None, 'data')");
}

TEST_F(PropagateTest, PartialSumIsSplitBeforeItIsResolved) {
  // The constraint after tanh pulls the rows split into the contraction: the all_reduce then
  // sums a quarter of the rows on each device.
  run(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{
            with_sharding_constraint(tanh(matmul(in[0], in[1])), NamedSharding(mesh_, P("data", None)))};
      },
      {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)});
  const int d = find(Op::kDotGeneral);
  EXPECT_EQ(prop_.result[d].to_string(), "P('data', None) partial(sum over 'model')");
  EXPECT_EQ(need(d, 0), "P('data', 'model')");
  EXPECT_EQ(need(find(Op::kTanh), 0), "P('data', None)");
}

TEST_F(PropagateTest, ConstantsUsedTwoWaysTakeTheCheaperLayout) {
  // A constant is made wherever it is needed, so any layout is free: it takes the layout
  // that splits it most among those its users want.
  run(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] + 1.0, in[1] * 1.0};
      },
      {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}}, {P("data", None), P("data", "model")});
  // Tracing makes one constant per use; each takes its user's layout.
  for (int i = 0; i < graph_.size(); ++i) {
    if (graph_.node(i).op != Op::kConstant) continue;
    EXPECT_NE(prop_.result[i].to_string(), "P(None, None)") << "constant %" << i;
  }
}

// A shard_map body manual over 'data' only (axis_names): the compiler lays its values out over
// 'model', as GSPMD/Shardy propagate shardings through JAX's partial-manual bodies (JAX's
// tests/shard_map_test.py, test_partial_auto_explicit_multi_explicit: the result is split over
// the manual axis then the automatic one, P(('i', 'l'), ...)). w's columns stay split over
// 'model', so each device multiplies its block of x by its columns only, and nothing moves.
TEST_F(PropagateTest, BodyManualOverSomeAxesIsSplitOverTheOthers) {
  const Mesh mesh = *Mesh::create({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  const TracedFunction body = [mesh](const std::vector<Value>& in) {
    return shard_map([](const std::vector<Value>& b) { return std::vector<Value>{tanh(matmul(b[0], b[1]))}; }, mesh,
                     {P("data", None), P()}, {P("data", None)}, {.axis_names = {"data"}})(in);
  };
  absl::StatusOr<Graph> g = trace(body, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  graph_ = *std::move(g);
  absl::StatusOr<Propagation> p = propagate(graph_, mesh, {P("data", None), P(None, "model")}, {std::nullopt});
  ASSERT_TRUE(p.ok()) << p.status();
  prop_ = *std::move(p);
  const int d = find(Op::kDotGeneral);
  ASSERT_GE(d, 0);
  EXPECT_EQ(prop_.result[d].to_string(), "P(None, 'model')");
  EXPECT_EQ(need(d, 1), "P(None, 'model')");
  // w enters the body as it is: manual axes (none) first, then its automatic split; it is
  // pvary'd along 'data' before the dot (core.auto_insert_reshard, as JAX), keeping that split.
  const int w_pvary = graph_.node(d).operands[1];
  ASSERT_EQ(graph_.node(w_pvary).op, Op::kPvary);
  EXPECT_EQ(need(w_pvary, 0), "P(None, 'model')");
  const int w_in = graph_.node(w_pvary).operands[0];
  ASSERT_EQ(graph_.node(w_in).op, Op::kShardMapIn);
  EXPECT_EQ(need(w_in, 0), "P(None, 'model')");
  EXPECT_EQ(prop_.result[graph_.outputs()[0]].to_string(), "P('data', 'model')");
  // A body manual over every axis keeps its values whole (blocks never split).
  const TracedFunction full = [mesh](const std::vector<Value>& in) {
    return shard_map([](const std::vector<Value>& b) { return std::vector<Value>{tanh(matmul(b[0], b[1]))}; }, mesh,
                     {P("data", None), P()}, {P("data", None)})(in);
  };
  g = trace(full, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
  ASSERT_TRUE(g.ok()) << g.status();
  graph_ = *std::move(g);
  p = propagate(graph_, mesh, {P("data", None), P(None, "model")}, {std::nullopt});
  ASSERT_TRUE(p.ok()) << p.status();
  prop_ = *std::move(p);
  EXPECT_EQ(prop_.result[find(Op::kDotGeneral)].to_string(), "P(None, None)");
  EXPECT_EQ(prop_.result[graph_.outputs()[0]].to_string(), "P('data', None)");
}

TEST_F(PropagateTest, BadSpecsNameTheInput) {
  absl::StatusOr<Graph> g = trace(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
  ASSERT_TRUE(g.ok());
  absl::StatusOr<Propagation> p = propagate(*g, mesh_, {P("data", None), P("batch")}, {std::nullopt});
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kInvalidArgument, "input 1 f32[8,4]"));
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kInvalidArgument, "'batch'"));
  p = propagate(*g, mesh_, {P("data", None), P()}, {P(None, Axes{"data", "model"})});
  // 4 columns cannot split 8 ways.
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kInvalidArgument, "output 0 f32[16,4]"));
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kInvalidArgument, "dimension 1 of size 4"));
}

// A graph from the wire may pin a value onto another mesh (the SDK refuses that at the call:
// JitTest.AConstraintOntoAnotherMeshIsRefusedAtTheCall). Two meshes of the same shape, names
// and types on other devices print alike, so the message shows their devices (issue 16 item 6).
TEST_F(PropagateTest, AValueOnAnotherMeshIsRefusedNamingBothMeshesDevices) {
  const Mesh reversed = *make_mesh({4, 2}, {"data", "model"}, {7, 6, 5, 4, 3, 2, 1, 0});
  absl::StatusOr<Graph> g = trace(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{exp(with_sharding_constraint(in[0], NamedSharding(reversed, P(None, "model"))))};
      },
      {{DType::kF32, {16, 8}}});
  ASSERT_TRUE(g.ok()) << g.status();
  absl::StatusOr<Propagation> p = propagate(*g, mesh_, {P("data", None)}, {std::nullopt});
  EXPECT_THAT(p.status(), StatusIs(absl::StatusCode::kInvalidArgument, "is on " + reversed.to_string_with_devices() +
                                                                           " but the arguments are on " +
                                                                           mesh_.to_string_with_devices()));
  EXPECT_THAT(p.status().message(), ::testing::HasSubstr("device_ids=[7, 6, 5, 4, 3, 2, 1, 0]"));
}

}  // namespace
}  // namespace tessera

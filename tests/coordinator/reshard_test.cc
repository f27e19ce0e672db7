// Resharding: each transition uses its collective (the layouts of ARCHITECTURE.md's table).
#include "coordinator/compiler/reshard.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::ElementsAre;

class ReshardTest : public ::testing::Test {
 protected:
  const Mesh mesh_ = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});

  static ValueSharding s(std::vector<Axes> dims, std::vector<std::string> partial = {}) {
    return ValueSharding{std::move(dims), std::move(partial), ReduceOp::kSum};
  }

  // The steps on `mesh` (or the suite's).
  std::vector<std::string> plan(const ValueSharding& from, const ValueSharding& to, const Shape& shape = {16, 8},
                                const Mesh* mesh = nullptr) {
    absl::StatusOr<std::vector<ReshardStep>> steps = plan_reshard(from, to, shape, mesh != nullptr ? *mesh : mesh_);
    EXPECT_TRUE(steps.ok()) << steps.status();
    std::vector<std::string> out;
    if (!steps.ok()) return out;
    for (const ReshardStep& step : *steps) out.push_back(step.to_string());
    if (!steps->empty()) {
      EXPECT_EQ(steps->back().after, to) << "the last step must reach the target";
    }
    return out;
  }
};

TEST_F(ReshardTest, EqualShardingsNeedNothing) { EXPECT_TRUE(plan(s({{"data"}, {}}), s({{"data"}, {}})).empty()); }

// A mesh axis of size 1 splits nothing and reduces over one device: shardings that differ
// only in such axes place the same shards on the same devices, which is what JAX calls
// equivalent (Sharding.is_equivalent_to, jax/_src/sharding.py), so nothing moves.
TEST_F(ReshardTest, AxesOfSizeOneMoveNothing) {
  const Mesh mesh = *make_mesh({4, 1}, {"data", "one"}, {0, 1, 2, 3});
  auto run = [&](const ValueSharding& from, const ValueSharding& to) { return plan(from, to, {16, 8}, &mesh); };
  EXPECT_TRUE(run(s({{}, {}}), s({{"one"}, {}})).empty());                // no local_slice
  EXPECT_TRUE(run(s({{"data"}, {}}), s({{"data", "one"}, {}})).empty());  // no local_slice
  EXPECT_TRUE(run(s({{"one", "data"}, {}}), s({{"data"}, {}})).empty());  // no all_gather
  EXPECT_TRUE(run(s({{"one"}, {}}), s({{}, {"one"}})).empty());           // no all_to_all
  EXPECT_TRUE(run(s({{}, {}}, {"one"}), s({{}, {}})).empty());            // no all_reduce
  // What does move still does, and ends on the target as given.
  EXPECT_THAT(run(s({{"one"}, {}}), s({{"data"}, {"one"}})), ElementsAre("local_slice(dim=0, axes=('data',))"));
  EXPECT_THAT(run(s({{"data"}, {}}, {"one"}), s({{}, {}})), ElementsAre("all_gather(dim=0, axes=('data',))"));
}

TEST_F(ReshardTest, ReplicatedToShardedIsALocalSlice) {
  EXPECT_THAT(plan(s({{}, {}}), s({{"data"}, {"model"}})),
              ElementsAre("local_slice(dim=0, axes=('data',))", "local_slice(dim=1, axes=('model',))"));
}

// A dimension split over two axes is gathered by one all_gather over both (its groups order
// devices major-to-minor, as the dimension's blocks are), not one per axis; a dimension sliced
// over two axes is one local slice. Only the axes that must leave are gathered.
TEST_F(ReshardTest, ShardedToReplicatedIsAnAllGather) {
  EXPECT_THAT(plan(s({{"data", "model"}, {}}), s({{}, {}})), ElementsAre("all_gather(dim=0, axes=('data', 'model'))"));
  EXPECT_THAT(plan(s({{"model", "data"}, {}}), s({{}, {}})), ElementsAre("all_gather(dim=0, axes=('model', 'data'))"));
  EXPECT_THAT(plan(s({{"data", "model"}, {}}), s({{"data"}, {}})), ElementsAre("all_gather(dim=0, axes=('model',))"));
  EXPECT_THAT(plan(s({{}, {}}), s({{"data", "model"}, {}})), ElementsAre("local_slice(dim=0, axes=('data', 'model'))"));
}

TEST_F(ReshardTest, AnAxisMovingToAnotherDimensionIsAnAllToAll) {
  EXPECT_THAT(plan(s({{"data"}, {}}), s({{}, {"data"}})), ElementsAre("all_to_all(split=1, concat=0, axes=('data',))"));
  // Two axes moving together, in the order the target wants them: one all_to_all over both
  // (jit_ops_test's tuple_to_other_dim runs it against the host).
  EXPECT_THAT(plan(s({{"data", "model"}, {}}), s({{}, {"data", "model"}})),
              ElementsAre("all_to_all(split=1, concat=0, axes=('data', 'model'))"));
}

TEST_F(ReshardTest, PartialToWholeIsAnAllReduce) {
  EXPECT_THAT(plan(s({{}, {}}, {"model"}), s({{}, {}})), ElementsAre("all_reduce(sum, axes=('model',))"));
}

TEST_F(ReshardTest, PartialToShardedIsAReduceScatter) {
  EXPECT_THAT(plan(s({{}, {}}, {"model"}), s({{}, {"model"}}), {16, 4}),
              ElementsAre("reduce_scatter(sum, dim=1, axes=('model',))"));
  // Over two axes, one wanted as a split: reduce_scatter that one, all_reduce the other.
  EXPECT_THAT(plan(s({{}, {}}, {"data", "model"}), s({{"data"}, {}})),
              ElementsAre("reduce_scatter(sum, dim=0, axes=('data',))", "all_reduce(sum, axes=('model',))"));
}

TEST_F(ReshardTest, ReorderedAxesAreACollectivePermute) {
  EXPECT_THAT(plan(s({{"data", "model"}, {}}), s({{"model", "data"}, {}})),
              ElementsAre("collective_permute(axes=('data', 'model'))"));
}

TEST_F(ReshardTest, SwappingTwoDimensionsAxes) {
  EXPECT_THAT(plan(s({{"data"}, {"model"}}), s({{"model"}, {"data"}})),
              ElementsAre("all_gather(dim=0, axes=('data',))", "all_to_all(split=0, concat=1, axes=('model',))",
                          "local_slice(dim=1, axes=('data',))"));
}

// Regression: an op linear in a partial operand that needs another layout of it (a slice
// cutting a split dimension of a partial product) asked for a partial target, which the
// planner refused ("the target sharding cannot be partial"), failing the whole compilation.
TEST_F(ReshardTest, PartialValueChangesLayoutAndStaysPartial) {
  EXPECT_THAT(plan(s({{"model"}, {}}, {"data"}), s({{}, {}}, {"data"})),
              ElementsAre("all_gather(dim=0, axes=('model',))"));
  EXPECT_THAT(plan(s({{"model"}, {}}, {"data"}), s({{}, {"model"}}, {"data"})),
              ElementsAre("all_to_all(split=1, concat=0, axes=('model',))"));
  EXPECT_THAT(plan(s({{}, {}}, {"data"}), s({{"model"}, {}}, {"data"})),
              ElementsAre("local_slice(dim=0, axes=('model',))"));
  // Another pending reduction is summed first, then made pending anew (kUnreduce); a split over
  // a pending axis is refused.
  EXPECT_THAT(plan(s({{}, {}}, {"data"}), s({{}, {}}, {"model"})),
              ElementsAre("all_reduce(sum, axes=('data',))", "unreduce(axes=('model',))"));
  EXPECT_EQ(plan_reshard(s({{}, {}}, {"data"}), s({{"data"}, {}}, {"data"}), {16, 8}, mesh_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A whole value made a sum pending over new axes (explicit mode's reshard onto unreduced axes,
// a reduced value's cotangent): local, no collective. A dimension split over a new pending axis
// after the target's own keeps its split up to kUnreduce (which zero-pads each block in place);
// a split the target does not keep otherwise is gathered first.
TEST_F(ReshardTest, WholeValueMadePendingIsLocal) {
  EXPECT_THAT(plan(s({{}, {}}), s({{}, {}}, {"data"})), ElementsAre("unreduce(axes=('data',))"));
  EXPECT_THAT(plan(s({{"data"}, {}}), s({{}, {}}, {"data"})), ElementsAre("unreduce(axes=('data',))"));
  EXPECT_THAT(plan(s({{"model"}, {}}), s({{}, {}}, {"data"})),
              ElementsAre("all_gather(dim=0, axes=('model',))", "unreduce(axes=('data',))"));
  EXPECT_EQ(plan_reshard(s({{}, {}}), s({{"data"}, {}}, {"data"}), {16, 8}, mesh_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ReshardTest, BadTargets) {
  EXPECT_EQ(plan_reshard(s({{}, {}}), s({{}, {"data"}}), {16, 6}, mesh_).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tessera

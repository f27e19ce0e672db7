// Graph: shape and dtype inference of every op, and the errors for operands that do not fit.
#include "core/graph.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
  expect_invalid(g.add_unary(Op::kExp, i), "needs float32 or float64");
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

}  // namespace
}  // namespace tessera

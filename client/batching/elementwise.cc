// Batching the elementwise ops: every operand batched (a broadcast for those that are not),
// the op unchanged.
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> elementwise(const BatchArgs& a) {
  std::vector<Value> operands;
  for (size_t k = 0; k < a.x.size(); ++k) operands.push_back(a.batched_operand(k));
  Shape shape = {a.size};
  shape.insert(shape.end(), a.node.shape.begin(), a.node.shape.end());
  return a.add(a.node, operands, std::move(shape));
}

constexpr BatchEntry kRules[] = {
    {Op::kNeg, elementwise},     {Op::kAbs, elementwise},          {Op::kExp, elementwise},
    {Op::kLog, elementwise},     {Op::kTanh, elementwise},         {Op::kLogistic, elementwise},
    {Op::kSqrt, elementwise},    {Op::kRsqrt, elementwise},        {Op::kSin, elementwise},
    {Op::kCos, elementwise},     {Op::kFloor, elementwise},        {Op::kCeil, elementwise},
    {Op::kSign, elementwise},    {Op::kNot, elementwise},          {Op::kAdd, elementwise},
    {Op::kSub, elementwise},     {Op::kMul, elementwise},          {Op::kDiv, elementwise},
    {Op::kPow, elementwise},     {Op::kMax, elementwise},          {Op::kMin, elementwise},
    {Op::kAnd, elementwise},     {Op::kOr, elementwise},           {Op::kEq, elementwise},
    {Op::kNe, elementwise},      {Op::kLt, elementwise},           {Op::kLe, elementwise},
    {Op::kGt, elementwise},      {Op::kGe, elementwise},           {Op::kSelect, elementwise},
    {Op::kConvert, elementwise}, {Op::kErf, elementwise},          {Op::kErfInv, elementwise},
    {Op::kRem, elementwise},     {Op::kStopGradient, elementwise}, {Op::kShiftRightLogical, elementwise},
};

}  // namespace

absl::Span<const BatchEntry> elementwise_batching() { return kRules; }

}  // namespace tessera::internal

// VJPs of the reductions: the cotangent broadcast back over the reduced dimensions.
#include <algorithm>

#include "absl/status/status.h"
#include "client/vjp/vjp.h"

namespace tessera::internal {
namespace {

// The result's cotangent (or any value of the result's shape) back in the operand's shape.
Value back(const VjpArgs& a, const Value& v) {
  std::vector<int64_t> kept;
  for (int64_t d = 0; d < a.x[0].rank(); ++d) {
    if (!std::binary_search(a.node.attrs<ReduceAttrs>().axes.begin(), a.node.attrs<ReduceAttrs>().axes.end(), d))
      kept.push_back(d);
  }
  return broadcast_in_dim(v, a.x[0].shape(), kept);
}

// reduce_max/min: the gradient goes to the extreme elements, split evenly among ties.
absl::Status extreme(const VjpArgs& a) {
  const Value hit = convert(a.x[0] == back(a, a.out), a.x[0].dtype());
  a.add(0, back(a, a.g / sum(hit, a.node.attrs<ReduceAttrs>().axes)) * hit);
  return absl::OkStatus();
}

}  // namespace

absl::Span<const VjpEntry> reduction_vjps() {
  static const VjpEntry kRules[] = {
      // Typed as the operand's cotangent, as JAX's _reduce_sum_transpose_rule broadcasts with
      // out_sharding of the operand's: split as the operand is (so a contraction after it is
      // split alike), unreduced where the operand is reduced.
      {Op::kReduceSum,
       [](const VjpArgs& a) {
         a.add(0, typed_as(a.x[0], [&] { return back(a, a.g); }));
         return absl::OkStatus();
       }},
      {Op::kReduceProd,
       [](const VjpArgs& a) {
         a.add(0, back(a, a.g * a.out) / a.x[0]);
         return absl::OkStatus();
       }},
      {Op::kReduceMax, extreme},
      {Op::kReduceMin, extreme},
  };
  return kRules;
}

}  // namespace tessera::internal

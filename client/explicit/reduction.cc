// Explicit-mode sharding rules of the reductions: the reduced dimensions leave the type, the
// others keep their splits (jax/_src/lax/lax.py, _reduce_op_sharding_rule). A reduction over
// a split dimension is legal: the compiler sums the blocks (an all-reduce), and the result is
// replicated over those axes.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"

namespace tessera::internal {
namespace {

TypeRuleResult drop_dims(const TypeRuleCall& c, const std::vector<int64_t>& axes) {
  TypeRuleResult r;
  const TypeSpec& in = c.operands[0].spec;
  for (size_t d = 0; d < in.size(); ++d) {
    if (std::find(axes.begin(), axes.end(), static_cast<int64_t>(d)) == axes.end()) r.spec.push_back(in[d]);
  }
  return r;
}

TypeRuleResult reduce(const TypeRuleCall& c) { return drop_dims(c, c.node.attrs<ReduceAttrs>().axes); }
TypeRuleResult argmax(const TypeRuleCall& c) { return drop_dims(c, {c.node.attrs<ArgmaxAttrs>().axis}); }

}  // namespace

// jax/_src/lax/control_flow/loops.py, _cumred_sharding_rule: cumsum/cumprod/cummax/cummin
// keep the operand's sharding, and refuse a split scanned dimension.
TypeRuleResult cumulative_type_rule(const TypedOperand& x, int64_t axis) {
  TypeRuleResult r{x.spec, "", ""};
  if (!x.spec[axis].empty()) {
    r.error = absl::StrCat("Input should be unsharded over the axis being reduced. Got input type=",
                           type_string(x.dtype, x.shape, x.spec), " and axis=", axis);
    r.fix = absl::StrCat("reshard the operand so that dimension ", axis, " is not split (reshard(x, P(...)))");
  }
  return r;
}

absl::Span<const std::pair<Op, TypeRule>> reduction_type_rules() {
  static const std::pair<Op, TypeRule> kRules[] = {
      {Op::kReduceSum, reduce},  {Op::kReduceMax, reduce}, {Op::kReduceMin, reduce},
      {Op::kReduceProd, reduce}, {Op::kArgmax, argmax},
  };
  return kRules;
}

}  // namespace tessera::internal

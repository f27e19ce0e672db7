// Explicit-mode sharding rules of the reductions: the reduced dimensions leave the type, the
// others keep their splits (jax/_src/lax/lax.py, _reduce_op_sharding_rule). A reduction over
// a split dimension is legal: the compiler sums the blocks (an all-reduce), and the result is
// replicated over those axes. reduce_sum of an unreduced operand stays unreduced alike
// (jax/_src/lax/lax.py, _reduce_sum_ur_rule); the others have no unreduced rule (JAX's
// _reduce_max_ur_rule / _reduce_min_ur_rule pass the axes through under a TODO, but a maximum of
// per-device terms is not the maximum of their sum, so Tessera refuses them). reduce_sum,
// reduce_max and reduce_min keep the operand's reduced axes (_reduce_op_reduced_rule: the
// operand is replicated over them, so is its reduction); reduce_prod and argmax have no
// `ur_rule` in JAX and refuse a reduced operand, as call_ur_rule does (reduced.cc).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"

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

// The operand's unreduced axes (_reduce_op_unreduced_rule without out_sharding; JAX's
// tests/pjit_test.py test_reduce_sum_unreduced_error, case 2: reduce_sum of a {U:y} value is
// {U:y}). Summing a dimension split over another axis would add that axis to the pending sum,
// where JAX's result sums it at once: Tessera keeps one pending sum per value (the compiler's
// partial axes), so that is refused rather than typed one way and computed another.
UnreducedRuleResult reduce_sum_unreduced(const TypeRuleCall& c) {
  const TypedOperand& x = c.operands[0];
  UnreducedRuleResult r{x.unreduced, "", ""};
  if (x.unreduced.empty()) return r;
  for (int64_t d : c.node.attrs<ReduceAttrs>().axes) {
    if (x.spec[d].empty()) continue;
    r.error = absl::StrCat("summing dimension ", d, ", split over ", axes_to_string(x.spec[d]),
                           ", of an operand unreduced over ", axis_set_repr(x.unreduced),
                           " would leave a sum pending over both; Tessera keeps a value unreduced over the axes it "
                           "was made unreduced over only");
    r.fix = absl::StrCat("reshard the operand so that dimension ", d,
                         " is not split, keeping its unreduced axes "
                         "(reshard(x, P(..., unreduced=",
                         axis_set_repr(x.unreduced), "))), or reduce it first");
    return r;
  }
  return r;
}

}  // namespace

// jax/_src/lax/control_flow/loops.py, _cumred_sharding_rule: cumsum/cumprod/cummax/cummin
// keep the operand's sharding, and refuse a split scanned dimension. Their primitives have no
// `ur_rule` (_cumulative_reduction_primitive), so a reduced operand is refused as call_ur_rule
// refuses it, though the adds Tessera builds them of would keep it.
TypeRuleResult cumulative_type_rule(absl::string_view name, const TypedOperand& x, int64_t axis) {
  TypeRuleResult r{x.spec, "", ""};
  if (!x.reduced.empty()) {
    const ReducedRuleResult refused = no_reduced_rule(name);
    return TypeRuleResult{{}, refused.error, refused.fix};
  }
  if (!x.spec[axis].empty()) {
    r.error = absl::StrCat("Input should be unsharded over the axis being reduced. Got input type=",
                           type_string(x.dtype, x.shape, x.spec), " and axis=", axis);
    r.fix = absl::StrCat("reshard the operand so that dimension ", axis, " is not split (reshard(x, P(...)))");
  }
  return r;
}

absl::Span<const ExplicitRule> reduction_type_rules() {
  static const ExplicitRule kRules[] = {
      {Op::kReduceSum, reduce, reduce_sum_unreduced, keep_reduced},  // _reduce_op_reduced_rule
      {Op::kReduceMax, reduce, nullptr, keep_reduced},               // _reduce_max_ur_rule
      {Op::kReduceMin, reduce, nullptr, keep_reduced},               // _reduce_min_ur_rule
      {Op::kReduceProd, reduce},
      // argmax_p has no ur_rule: JAX's call_ur_rule refuses an unreduced operand with the words
      // it refuses a reduced one with ("unreduced/reduced rule for argmax is not implemented").
      {Op::kArgmax, argmax, no_unreduced_rule},
  };
  return kRules;
}

}  // namespace tessera::internal

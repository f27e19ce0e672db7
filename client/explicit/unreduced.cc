// The unreduced axes of an op's result in explicit mode (`f32[2,2]{U:X}`: a sum over the
// devices along X waiting to happen; docs/new_docs/301/sharding-ad.md in jax-ml/jax). Each op's
// rule is its family's (JAX's `ur_rule=`, jax/_src/lax/lax.py), registered beside its type
// rule: placement.cc (reshard, sharding_as), dot.cc (dot_general), elementwise.cc (add, mul,
// div, convert, select), layout.cc (transpose, reshape, broadcast_in_dim, concatenate, slice),
// reduction.cc (reduce_sum). An op without one refuses an unreduced operand, as JAX's unop_ur_rule /
// nary_ur_rule; rev and argmax, which JAX registers without any ur_rule, refuse it with
// call_ur_rule's words instead (no_unreduced_rule, reduced.cc).
#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"

namespace tessera::internal {

absl::StatusOr<std::vector<std::string>> result_unreduced(const TypeRuleCall& call) {
  const ExplicitRule* rule = find_explicit_rule(call.node.op);
  UnreducedRuleResult r;
  if (rule != nullptr && rule->unreduced != nullptr) {
    r = rule->unreduced(call);
  } else {
    for (const TypedOperand& o : call.operands) {
      if (o.unreduced.empty()) continue;
      r.error = absl::StrCat("unreduced rule for ", op_name(call.node.op),
                             " is not implemented (as JAX's nary_ur_rule / unop_ur_rule): an unreduced operand is a "
                             "sum over devices waiting to happen, which only ops linear in it take");
      r.fix = kReduceFirstFix;
      break;
    }
  }
  if (!r.error.empty()) {
    return type_rule_error(op_name(call.node.op), call.operands, TypeRuleResult{{}, r.error, r.fix});
  }
  return r.unreduced;
}

}  // namespace tessera::internal

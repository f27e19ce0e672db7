// Explicit-mode sharding rules of the sorting ops, as JAX's (jax/_src/lax/lax.py):
// _sort_abstract_eval refuses an operand split over the sorting dimension ("Arguments to sort
// must be unsharded over the sorting dimension"), and the result keeps the operand's
// sharding; _top_k_abstract_eval likewise over the top_k axis ("The input should be unsharded
// over the axis along which to compute the top_k values"). argsort (Op::kArgsort*) is sort's
// rule; sort and top_k are composites over it (client/lax.cc) and check top_k's rule first.
//
// Reduced and unreduced operands. Neither abstract eval calls a ur_rule: each returns its
// operand's type (sort_p's avals unchanged, top_k_p's `operand.update(shape=...)` for the values
// and the int32 indices), so a reduced operand's sort, argsort (jnp.argsort sorts a
// broadcasted_iota made with the operand's sharding beside it) and top_k values and indices are
// reduced alike. jnp.argsort(descending=True) reverses with lax.rev, which has no ur_rule, so
// call_ur_rule refuses a reduced operand there. An unreduced operand JAX passes through too,
// sorting each device's term; the order of a sum is not the order of its terms, so Tessera
// refuses it, as it refuses reduce_max's (reduction.cc).
#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"

namespace tessera::internal {
namespace {

TypeRuleResult argsort(const TypeRuleCall& c) {
  TypeRuleResult r{c.operands[0].spec, "", ""};
  const int64_t axis = c.node.attrs<ArgmaxAttrs>().axis;
  if (!r.spec[axis].empty()) {
    r.error =
        absl::StrCat("Arguments to sort must be unsharded over the sorting dimension. Got sorting dimension=", axis,
                     " split over ", axes_to_string(r.spec[axis]));
    r.fix = absl::StrCat("reshard the operand so that dimension ", axis, " is not split (reshard(x, P(...)))");
  }
  return r;
}

// jnp.argsort(descending=True) of a reduced operand: JAX reverses it with lax.rev first, and
// rev_p has no ur_rule.
ReducedRuleResult argsort_descending_reduced(const TypeRuleCall& c) {
  if (c.operands[0].reduced.empty()) return ReducedRuleResult{};
  ReducedRuleResult r = no_reduced_rule("rev");
  r.error += " (jnp.argsort with descending=True reverses its operand with lax.rev)";
  return r;
}

}  // namespace

TypeRuleResult sorting_unreduced_rule(absl::string_view name, const TypedOperand& x) {
  TypeRuleResult r{x.spec, "", ""};
  if (!x.unreduced.empty()) {
    r.error = absl::StrCat("unreduced rule for ", name,
                           " is not implemented: the order of a sum over devices is not the order of its terms "
                           "(JAX's sort and top_k keep an unreduced operand's type and sort each device's term)");
    r.fix = kReduceFirstFix;
  }
  return r;
}

TypeRuleResult top_k_type_rule(const TypedOperand& x, int64_t axis) {
  TypeRuleResult r = sorting_unreduced_rule("top_k", x);
  if (!r.error.empty()) return r;
  if (!x.spec[axis].empty()) {
    r.error = absl::StrCat(
        "The input should be unsharded over the axis along which to compute the top_k values. Got input type=",
        type_string(x.dtype, x.shape, x.spec), " and axis=", axis);
    r.fix = absl::StrCat("reshard the operand so that dimension ", axis, " is not split (reshard(x, P(...)))");
  }
  return r;
}

absl::Span<const ExplicitRule> sort_type_rules() {
  static const ExplicitRule kRules[] = {{Op::kArgsort, argsort, nullptr, keep_reduced},
                                        {Op::kArgsortDescending, argsort, nullptr, argsort_descending_reduced}};
  return kRules;
}

}  // namespace tessera::internal

// Explicit-mode sharding rules of the sorting ops, as JAX's (jax/_src/lax/lax.py):
// _sort_abstract_eval refuses an operand split over the sorting dimension ("Arguments to sort
// must be unsharded over the sorting dimension"), and the result keeps the operand's
// sharding; _top_k_abstract_eval likewise over the top_k axis ("The input should be unsharded
// over the axis along which to compute the top_k values"). argsort (Op::kArgsort*) is sort's
// rule; sort and top_k are composites over it (client/lax.cc) and check top_k's rule first.
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

}  // namespace

TypeRuleResult top_k_type_rule(const TypedOperand& x, int64_t axis) {
  TypeRuleResult r{x.spec, "", ""};
  if (!x.spec[axis].empty()) {
    r.error = absl::StrCat(
        "The input should be unsharded over the axis along which to compute the top_k values. Got input type=",
        type_string(x.dtype, x.shape, x.spec), " and axis=", axis);
    r.fix = absl::StrCat("reshard the operand so that dimension ", axis, " is not split (reshard(x, P(...)))");
  }
  return r;
}

absl::Span<const ExplicitRule> sort_type_rules() {
  static const ExplicitRule kRules[] = {{Op::kArgsort, argsort}, {Op::kArgsortDescending, argsort}};
  return kRules;
}

}  // namespace tessera::internal

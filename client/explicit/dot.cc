// Explicit-mode sharding rule of dot_general, as JAX's _dot_general_sharding_rule
// (jax/_src/lax/lax.py): batch dimensions must be split alike on both operands (split on one
// and unsplit on the other is refused, in JAX's words), and contracting ones must agree; a
// contracting dimension split on both operands leaves a sum over devices whose layout is
// ambiguous (all-reduce to a replicated result, or reduce-scatter to a split one), an error
// unless the call gives out_sharding. The result is batch, lhs free, rhs free, each keeping
// its operand's split. With out_sharding nothing is checked: the result is out_sharding.
// Its unreduced rule is _dot_general_unreduced_rule: an unreduced out_sharding over the
// contracting splits leaves each device's partial sum.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"

namespace tessera::internal {
namespace {

std::string spec_tuple(const TypeSpec& spec, const std::vector<int64_t>& dims) {
  std::vector<std::string> parts;
  for (int64_t d : dims) {
    const Axes& a = spec[d];
    parts.push_back(a.empty() ? "None" : a.size() == 1 ? absl::StrCat("'", a[0], "'") : axes_to_string(a));
  }
  return absl::StrCat("(", absl::StrJoin(parts, ", "), parts.size() == 1 ? ",)" : ")");
}

TypeRuleResult dot_general(const TypeRuleCall& c) {
  TypeRuleResult r;
  if (c.out_sharding_given) {
    // JAX's rule returns out_sharding as it is, checking neither batch nor contracting splits
    // (operands split differently are resharded to it); the constraint after the op types the
    // result, and the product before it is the compiler's to lay out.
    r.spec.assign(c.node.shape.size(), Axes{});
    return r;
  }
  const DotDims& dd = c.node.attrs<DotAttrs>().dims;
  const TypeSpec& l = c.operands[0].spec;
  const TypeSpec& rs = c.operands[1].spec;
  for (size_t i = 0; i < dd.lhs_batch.size(); ++i) {
    const Axes &a = l[dd.lhs_batch[i]], &b = rs[dd.rhs_batch[i]];
    // Split on one side only is refused too: JAX compares the specs, None included.
    if (a != b) {
      r.error = absl::StrCat(
          "dot_general requires lhs batch dimensions and rhs batch dimensions to have the same sharding, got ",
          spec_tuple(l, dd.lhs_batch), " and ", spec_tuple(rs, dd.rhs_batch));
      r.fix = "reshard one operand to the other's batch sharding (reshard(x, P(...)))";
      return r;
    }
    r.spec.push_back(a);
  }
  bool both_split = false;
  for (size_t i = 0; i < dd.lhs_contracting.size(); ++i) {
    const Axes &a = l[dd.lhs_contracting[i]], &b = rs[dd.rhs_contracting[i]];
    if (!a.empty() && !b.empty() && a != b) {
      r.error = absl::StrCat("contracting dimensions must be split alike, got lhs ", spec_tuple(l, dd.lhs_contracting),
                             " and rhs ", spec_tuple(rs, dd.rhs_contracting));
      r.fix = "reshard one operand to the other's contracting sharding (reshard(x, P(...)))";
      return r;
    }
    both_split = both_split || (!a.empty() && !b.empty());
  }
  if (both_split && !c.out_sharding_given) {
    r.error = absl::StrCat(
        "contracting dimensions are split on both operands, so the result is a sum over devices and it is ambiguous "
        "how it should be sharded (as JAX says: lhs_contracting_spec=",
        spec_tuple(l, dd.lhs_contracting), ", rhs_contracting_spec=", spec_tuple(rs, dd.rhs_contracting), ")");
    r.fix =
        "give out_sharding: the contracted axes on a result dimension reduce-scatter, a result without them "
        "all-reduces";
    return r;
  }
  for (int64_t d : dot_free_dims(static_cast<int64_t>(l.size()), dd.lhs_batch, dd.lhs_contracting)) {
    r.spec.push_back(l[d]);
  }
  for (int64_t d : dot_free_dims(static_cast<int64_t>(rs.size()), dd.rhs_batch, dd.rhs_contracting)) {
    r.spec.push_back(rs[d]);
  }
  return r;
}

// No unreduced operand; an unreduced out_sharding must name exactly the axes the contracting
// dimensions are split over, alike on both operands (jax/_src/lax/lax.py,
// _dot_general_unreduced_rule, its words).
UnreducedRuleResult dot_general_unreduced(const TypeRuleCall& c) {
  UnreducedRuleResult r;
  if (!c.operands[0].unreduced.empty() || !c.operands[1].unreduced.empty()) {
    r.error = "lhs or rhs passed to dot_general cannot be unreduced";
    r.fix = kReduceFirstFix;
    return r;
  }
  if (!c.out_sharding_given || c.out_unreduced.empty()) return r;
  const DotDims& dd = c.node.attrs<DotAttrs>().dims;
  std::vector<std::string> contracted, lhs, rhs;
  for (size_t i = 0; i < dd.lhs_contracting.size(); ++i) {
    const Axes& a = c.operands[0].spec[dd.lhs_contracting[i]];
    const Axes& b = c.operands[1].spec[dd.rhs_contracting[i]];
    lhs.push_back(a.empty() ? "None" : axes_to_string(a));
    rhs.push_back(b.empty() ? "None" : axes_to_string(b));
    if (a != b) {
      r.error = absl::StrCat(
          "lhs and rhs contracting dims should be sharded identically when out_sharding provided to dot_general "
          "mentions unreduced_axes. Got lhs_contracting_spec=(",
          absl::StrJoin(lhs, ", "), "), rhs_contracting_spec=(", absl::StrJoin(rhs, ", "), ")");
      r.fix = "reshard one operand to the other's contracting sharding (reshard(x, P(...)))";
      return r;
    }
    contracted.insert(contracted.end(), a.begin(), a.end());
  }
  std::sort(contracted.begin(), contracted.end());
  if (contracted != c.out_unreduced) {
    r.error =
        absl::StrCat("out_sharding's unreduced axes should be equal to the contracting specs. Got unreduced axes=",
                     axis_frozenset_repr(c.out_unreduced), " and contracting specs over ", axis_set_repr(contracted));
    r.fix = "name in unreduced={...} exactly the mesh axes the contracting dimensions are split over";
    return r;
  }
  r.unreduced = c.out_unreduced;
  return r;
}

}  // namespace

absl::Span<const ExplicitRule> dot_type_rules() {
  static const ExplicitRule kRules[] = {
      // Not reduced, whatever its operands: jax/_src/lax/lax.py's _dot_general_ur_rule.
      {Op::kDotGeneral, dot_general, dot_general_unreduced, no_reduced}};
  return kRules;
}

}  // namespace tessera::internal

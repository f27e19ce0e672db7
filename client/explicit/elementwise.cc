// Explicit-mode sharding rules of the elementwise ops (every op with kElementwise: unary,
// binary, comparisons, select, convert, ...). As JAX's broadcasting_sharding_rule
// (jax/_src/lax/lax.py): the operands (of one shape: the tracer broadcasts first) must agree
// dimension by dimension; an unsplit dimension meets any split, two different splits are an
// error. Unreduced rules (lax.py's `ur_rule=`): add keeps operands unreduced alike
// (_add_ur_rule), convert keeps its operand's (_convert_element_type_ur_rule; to a float type
// of 32 bits or more only), mul and div take
// an unreduced operand only beside one reduced over the same axes (_mul_ur_rule, _div_ur_rule:
// the product is unreduced, and no longer reduced); select keeps its cases' when they are
// unreduced alike (_select_ur_rule); the other ops (sub, neg, cos, ...:
// nary_ur_rule / unop_ur_rule) have none. Reduced rules: every op's result is reduced over the
// axes its operands are (default_unop_reduced_rule / default_nary_reduced_rule, with their
// errors: client/explicit/reduced.cc), except a product with an unreduced factor.
#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"

namespace tessera::internal {
namespace {

TypeRuleResult elementwise(const TypeRuleCall& c) { return consensus(c); }

std::string type_of(const TypedOperand& o) { return type_string(o.dtype, o.shape, o.spec, o.unreduced, o.reduced); }

constexpr const char* kReducedFactorFix =
    "reshard the other operand to P(..., reduced={...}) over the unreduced axes, or the unreduced operand first "
    "(reshard(x, P(...)) runs its sum)";

// Both unreduced alike, or neither.
UnreducedRuleResult add(const TypeRuleCall& c) {
  const std::vector<std::string>&x = c.operands[0].unreduced, &y = c.operands[1].unreduced;
  UnreducedRuleResult r;
  if (x == y) {
    r.unreduced = x;
  } else if (!x.empty() && !y.empty()) {
    r.error = absl::StrCat("lhs and rhs to `add` must be unreduced along the same mesh axes. Got lhs=",
                           axis_frozenset_repr(x), ", rhs=", axis_frozenset_repr(y));
    r.fix = kReduceFirstFix;
  } else {
    const char* u = x.empty() ? "rhs" : "lhs";
    const char* other = x.empty() ? "lhs" : "rhs";
    r.error = absl::StrCat(u, " is unreduced while ", other,
                           " is not. `add` operation does not allow this because there will be implicit "
                           "communication");
    r.fix = absl::StrCat("reduce ", u, " via `reshard` (reshard(x, P(...))) before calling `add`");
  }
  return r;
}

// mul is bilinear: an unreduced factor needs the other reduced over the same axes.
UnreducedRuleResult mul(const TypeRuleCall& c) {
  const TypedOperand &x = c.operands[0], &y = c.operands[1];
  UnreducedRuleResult r;
  if (!x.unreduced.empty() && !y.unreduced.empty()) {
    r.error = absl::StrCat("lhs and rhs to `mul` cannot be unreduced since mul is bilinear. Got lhs=",
                           axis_frozenset_repr(x.unreduced), ", rhs=", axis_frozenset_repr(y.unreduced));
    r.fix = kReduceFirstFix;
  } else if (!x.unreduced.empty() || !y.unreduced.empty()) {
    const bool left = !x.unreduced.empty();
    const TypedOperand &u = left ? x : y, &other = left ? y : x;
    if (other.reduced == u.unreduced) {
      r.unreduced = u.unreduced;
      return r;
    }
    r.error = absl::StrCat(left ? "RHS" : "LHS", " should be reduced along the same axes ", left ? "LHS" : "RHS",
                           " is unreduced on. Got lhs=", type_of(x), " and rhs=", type_of(y));
    r.fix = kReducedFactorFix;
  }
  return r;
}

UnreducedRuleResult div(const TypeRuleCall& c) {
  const TypedOperand &x = c.operands[0], &y = c.operands[1];
  UnreducedRuleResult r;
  if (!y.unreduced.empty()) {
    r.error = absl::StrCat("The denominator cannot be unreduced passed to `div`. Got y=", type_of(y));
    r.fix = kReduceFirstFix;
  } else if (!x.unreduced.empty() && x.unreduced != y.reduced) {
    r.error =
        absl::StrCat("Denominator should be reduced along the same axes numerator is unreduced on. Got x=", type_of(x),
                     ", y=", type_of(y));
    r.fix = kReducedFactorFix;
  } else {
    r.unreduced = x.unreduced;
  }
  return r;
}

// A cast keeps the sum pending (_convert_element_type_ur_rule), here between float types of 32
// bits or more: the compiler sums before a cast to an integer or half type, where casting each
// term would change the sum (coordinator/compiler/rules_elementwise.cc), so those refuse.
UnreducedRuleResult convert(const TypeRuleCall& c) {
  const TypedOperand& x = c.operands[0];
  UnreducedRuleResult r{x.unreduced, "", ""};
  const DType to = c.node.dtype;
  if (!x.unreduced.empty() && !(is_floating(x.dtype) && is_floating(to) && !is_half(to))) {
    r.error = absl::StrCat("casting an unreduced value to ", dtype_name(to),
                           " would cast each device's term, not their sum (Tessera keeps a sum pending through "
                           "casts between float types of 32 bits or more only)");
    r.fix = kReduceFirstFix;
  }
  return r;
}

// jax/_src/lax/lax.py, _select_ur_rule: the cases' unreduced axes, which _select_sharding_rule
// has made equal (it compares the cases' whole shardings, unreduced axes included): each device
// picks between its terms by a predicate every device holds whole, so the pick of the sums is
// the sum of the picks. JAX does not look at the predicate's unreduced axes; a predicate that
// is itself a sum pending is refused here (no op makes one: comparisons refuse unreduced
// operands).
UnreducedRuleResult select(const TypeRuleCall& c) {
  const TypedOperand &which = c.operands[0], &on_true = c.operands[1], &on_false = c.operands[2];
  UnreducedRuleResult r{on_true.unreduced, "", ""};
  if (on_true.unreduced != on_false.unreduced) {
    r.error = absl::StrCat("select cases must have the same shardings, got [", type_of(on_true), ", ",
                           type_of(on_false), "]");
    r.fix = kReduceFirstFix;
  } else if (!which.unreduced.empty()) {
    r.error = absl::StrCat("select `which` cannot be unreduced. Got which=", type_of(which));
    r.fix = kReduceFirstFix;
  }
  return r;
}

// A product with an unreduced factor pairs it with the other's reduced axes (the same ones,
// _mul_ur_rule checked): the result is unreduced over them and no longer reduced.
ReducedRuleResult product_reduced(const TypeRuleCall& c) {
  ReducedRuleResult r = nary_reduced(c);
  for (const TypedOperand& o : c.operands) {
    if (!o.unreduced.empty()) r.reduced.clear();
  }
  return r;
}

}  // namespace

absl::Span<const ExplicitRule> elementwise_type_rules() {
  static const std::vector<ExplicitRule> kRules = [] {
    static const std::pair<Op, UnreducedRule> kUnreduced[] = {
        {Op::kAdd, add}, {Op::kMul, mul}, {Op::kDiv, div}, {Op::kConvert, convert}, {Op::kSelect, select}};
    std::vector<ExplicitRule> rules;
    for (const OpDef& def : op_table()) {
      if (!(def.traits & kElementwise)) continue;
      rules.push_back(
          {def.op, elementwise, nullptr, def.op == Op::kMul || def.op == Op::kDiv ? product_reduced : nary_reduced});
      for (const auto& [op, rule] : kUnreduced) {
        if (op == def.op) rules.back().unreduced = rule;
      }
    }
    return rules;
  }();
  return kRules;
}

}  // namespace tessera::internal

// The reduced axes of an op's result in explicit mode (`f32[8]{R:X}`: a value laid out as a
// replicated one over X whose cotangent is unreduced over X, so the backward pass leaves the sum
// over X to where the user reshards it; docs/new_docs/301/sharding-ad.md in jax-ml/jax). Each
// op's rule is its family's, registered beside its type and unreduced rules (the reduced half of
// JAX's `ur_rule=`, jax/_src/lax/lax.py): elementwise.cc (every elementwise op:
// default_unop_reduced_rule / default_nary_reduced_rule, mul and div dropping the axes an
// unreduced operand pairs with), placement.cc (a constraint: its spec's), layout.cc (transpose,
// reshape, slice, dynamic_slice, broadcast_in_dim and concatenate keep their operand's,
// dynamic_update_slice its operand's and update's alike), reduction.cc (reduce_sum, reduce_max
// and reduce_min keep their operand's), placement.cc (gather keeps its table's, scatter_add
// refuses them), dot.cc (none, as JAX's _dot_general_ur_rule). An op without
// one refuses a reduced operand, as JAX's call_ur_rule does for a primitive without ur_rule.
#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"

namespace tessera::internal {

ReducedRuleResult no_reduced_rule(absl::string_view op) {
  return ReducedRuleResult{{},
                           absl::StrCat("unreduced/reduced rule for ", op,
                                        " is not implemented (as JAX's call_ur_rule for a primitive without ur_rule)"),
                           "reshard the reduced operand first (reshard(x, P(...)) drops its reduced axes)"};
}

UnreducedRuleResult no_unreduced_rule(const TypeRuleCall& c) {
  for (const TypedOperand& o : c.operands) {
    if (!o.unreduced.empty()) {
      return UnreducedRuleResult{{}, no_reduced_rule(op_name(c.node.op)).error, kReduceFirstFix};
    }
  }
  return UnreducedRuleResult{};
}

ReducedRuleResult keep_reduced(const TypeRuleCall& c) { return ReducedRuleResult{c.operands[0].reduced, "", ""}; }

ReducedRuleResult no_reduced(const TypeRuleCall&) { return ReducedRuleResult{}; }

ReducedRuleResult common_reduced(const TypeRuleCall& c, absl::string_view error) {
  ReducedRuleResult r;
  for (const TypedOperand& o : c.operands) {
    if (o.reduced.empty() || o.reduced == r.reduced) continue;
    if (!r.reduced.empty()) {
      r.error = absl::StrCat(error, "{", axis_frozenset_repr(r.reduced), ", ", axis_frozenset_repr(o.reduced), "}");
      r.fix = "reshard the operands to the same reduced axes (reshard(x, P(..., reduced={...})))";
      return r;
    }
    r.reduced = o.reduced;
  }
  return r;
}

ReducedRuleResult nary_reduced(const TypeRuleCall& c) {
  ReducedRuleResult r = common_reduced(c, "All inputs should be reduced across the same mesh axes. Got specs: ");
  if (r.reduced.empty() || !r.error.empty()) return r;
  const std::set<std::string> reduced(r.reduced.begin(), r.reduced.end());
  for (const TypedOperand& o : c.operands) {
    // Its axes (JAX's replicated_axes: the Explicit axes it neither splits, nor is unreduced
    // or reduced over, are those it is replicated over).
    std::set<std::string> used(o.unreduced.begin(), o.unreduced.end());
    used.insert(o.reduced.begin(), o.reduced.end());
    std::set<std::string> split;
    for (const Axes& axes : o.spec) split.insert(axes.begin(), axes.end());
    used.insert(split.begin(), split.end());
    const std::string type = type_string(o.dtype, o.shape, o.spec, o.unreduced, o.reduced, &c.mesh);
    const bool replicated = std::any_of(reduced.begin(), reduced.end(), [&](const std::string& a) {
      return used.count(a) == 0 && c.mesh.axis_index(a) >= 0 &&
             c.mesh.axis_types()[c.mesh.axis_index(a)] == AxisType::kExplicit;
    });
    if (replicated) {
      r.error = absl::StrCat(
          "Inputs cannot be replicated on the same axes that another input is reduced on. Got input type: ", type,
          " and reduced spec: ", axis_frozenset_repr(r.reduced));
      r.fix = absl::StrCat("reshard that input to P(..., reduced=", axis_set_repr(r.reduced),
                           ") too, or the reduced one to P(...)");
      return r;
    }
    if (std::any_of(reduced.begin(), reduced.end(), [&](const std::string& a) { return split.count(a) > 0; })) {
      r.error = absl::StrCat(
          "Inputs cannot be sharded/varying on the same axes that another input is reduced on. Reshard the input "
          "which is reduced to be sharded on the mesh axes it is reduced on via `reshard(inp, P(...))`. Got input "
          "type: ",
          type, " and reduced spec: ", axis_frozenset_repr(r.reduced));
      r.fix = "reshard the reduced input to the other's sharding (reshard(x, P(...)))";
      return r;
    }
  }
  return r;
}

absl::StatusOr<std::vector<std::string>> result_reduced(const TypeRuleCall& call) {
  const ExplicitRule* rule = find_explicit_rule(call.node.op);
  ReducedRuleResult r;
  if (rule != nullptr && rule->reduced != nullptr) {
    r = rule->reduced(call);
  } else {
    for (const TypedOperand& o : call.operands) {
      if (o.reduced.empty()) continue;
      r = no_reduced_rule(op_name(call.node.op));
      break;
    }
  }
  if (!r.error.empty()) {
    return type_rule_error(op_name(call.node.op), call.operands, TypeRuleResult{{}, r.error, r.fix});
  }
  return r.reduced;
}

}  // namespace tessera::internal

// Explicit-mode unreduced rules: which ops take an unreduced operand (`f32[2,2]{U:X}`, a sum
// over the devices along X waiting to happen) and which results are unreduced, as JAX's
// (jax/_src/lax/lax.py: _add_ur_rule, _dot_general_unreduced_rule, nary_ur_rule /
// unop_ur_rule, _convert_element_type_ur_rule; docs/new_docs/301/sharding-ad.md, "an unreduced
// array is a reduction waiting to happen"). A sharding constraint (reshard) gives its spec's
// unreduced axes; from an unreduced operand to none it is the sum (the compiler's all-reduce,
// or reduce-scatter onto a split dimension).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit/rules.h"

namespace tessera::internal {
namespace {

// Python's repr of a frozenset of names, as JAX's messages print one: {'X', 'Y'}.
std::string set_repr(const std::vector<std::string>& axes) {
  return absl::StrCat(
      "{", absl::StrJoin(axes, ", ", [](std::string* out, const std::string& a) { absl::StrAppend(out, "'", a, "'"); }),
      "}");
}

absl::Status error(const TypeRuleCall& call, const std::string& what, const std::string& fix) {
  return type_rule_error(op_name(call.node.op), call.operands, TypeRuleResult{{}, what, fix});
}

constexpr const char* kReduceFirst =
    "reshard the unreduced operand first (reshard(x, P(...)) runs its sum: an all-reduce, or a reduce-scatter onto a "
    "split dimension)";

// dot_general: no unreduced operand; an unreduced out_sharding must name exactly the axes the
// contracting dimensions are split over, alike on both operands (_dot_general_unreduced_rule).
absl::StatusOr<std::vector<std::string>> dot_general(const TypeRuleCall& call) {
  if (!call.operands[0].unreduced.empty() || !call.operands[1].unreduced.empty()) {
    return error(call, "lhs or rhs passed to dot_general cannot be unreduced", kReduceFirst);
  }
  if (!call.out_sharding_given || call.out_unreduced.empty()) return std::vector<std::string>{};
  const DotDims& dd = call.node.attrs<DotAttrs>().dims;
  std::vector<std::string> contracted;
  std::vector<std::string> lhs, rhs;
  for (size_t i = 0; i < dd.lhs_contracting.size(); ++i) {
    const Axes& a = call.operands[0].spec[dd.lhs_contracting[i]];
    const Axes& b = call.operands[1].spec[dd.rhs_contracting[i]];
    lhs.push_back(a.empty() ? "None" : axes_to_string(a));
    rhs.push_back(b.empty() ? "None" : axes_to_string(b));
    if (a != b) {
      return error(call,
                   absl::StrCat("lhs and rhs contracting dims should be sharded identically when out_sharding provided "
                                "to dot_general mentions unreduced_axes. Got lhs_contracting_spec=(",
                                absl::StrJoin(lhs, ", "), "), rhs_contracting_spec=(", absl::StrJoin(rhs, ", "), ")"),
                   "reshard one operand to the other's contracting sharding (reshard(x, P(...)))");
    }
    contracted.insert(contracted.end(), a.begin(), a.end());
  }
  std::sort(contracted.begin(), contracted.end());
  if (contracted != call.out_unreduced) {
    return error(call,
                 absl::StrCat("out_sharding's unreduced axes should be equal to the contracting specs. Got unreduced "
                              "axes=",
                              set_repr(call.out_unreduced), " and contracting specs over ", set_repr(contracted)),
                 "name in unreduced={...} exactly the mesh axes the contracting dimensions are split over");
  }
  return call.out_unreduced;
}

// add: both unreduced alike, or neither (_add_ur_rule).
absl::StatusOr<std::vector<std::string>> add(const TypeRuleCall& call) {
  const std::vector<std::string>&x = call.operands[0].unreduced, &y = call.operands[1].unreduced;
  if (x == y) return x;
  if (!x.empty() && !y.empty()) {
    return error(call,
                 absl::StrCat("lhs and rhs to `add` must be unreduced along the same mesh axes. Got lhs=", set_repr(x),
                              ", rhs=", set_repr(y)),
                 kReduceFirst);
  }
  const char* u = x.empty() ? "rhs" : "lhs";
  const char* other = x.empty() ? "lhs" : "rhs";
  return error(call,
               absl::StrCat(u, " is unreduced while ", other,
                            " is not. `add` operation does not allow this because there will be implicit "
                            "communication"),
               absl::StrCat("reduce ", u, " via `reshard` (reshard(x, P(...))) before calling `add`"));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> result_unreduced(const TypeRuleCall& call) {
  const Node& n = call.node;
  if (n.op == Op::kShardingConstraint) {
    const std::vector<std::string>& to = n.attrs<ShardingAttrs>().sharding.spec().unreduced();
    const std::vector<std::string>& from = call.operands[0].unreduced;
    // The same unreduced axes (a layout change), or none: the sum runs.
    if (to.empty() || to == from) return to;
    return error(call,
                 absl::StrCat("resharding to ", n.attrs<ShardingAttrs>().sharding.spec().to_string(),
                              " makes an unreduced value from one unreduced over ",
                              from.empty() ? std::string("no axis") : set_repr(from),
                              "; Tessera makes unreduced values only as a contraction's partial sums"),
                 "give the contraction out_sharding=P(..., unreduced={...}) (dot_general, matmul, einsum), or "
                 "reshard to the operand's own unreduced axes");
  }
  if (n.op == Op::kDotGeneral) return dot_general(call);
  bool any = false;
  for (const TypedOperand& o : call.operands) any = any || !o.unreduced.empty();
  if (!any) return std::vector<std::string>{};
  if (n.op == Op::kAdd) return add(call);
  // A cast between float types keeps the sum pending (_convert_element_type_ur_rule).
  if (n.op == Op::kConvert) return call.operands[0].unreduced;
  const std::string name(op_name(n.op));
  return error(call,
               absl::StrCat("unreduced rule for ", name,
                            " is not implemented (as JAX's nary_ur_rule / unop_ur_rule): an unreduced operand is a sum "
                            "over devices waiting to happen, and only add (of operands unreduced alike), convert and "
                            "reshard take one"),
               kReduceFirst);
}

}  // namespace tessera::internal

// Explicit-mode sharding rules of the layout ops: the spec moves with the data (transpose
// permutes it, broadcast_in_dim maps it, slice and rev keep it, as JAX's rules in
// jax/_src/lax/lax.py and slicing.py, rev's being _rev_sharding_rule); reshape as the
// explicit-sharding notebook describes (singleton dimensions stripped; a dimension kept whole
// keeps its split; a split or merge of unsplit dimensions is unsplit; a split or merge touching
// a split dimension is an error asking for out_sharding); slice, dynamic_slice and pad keep the
// operand's sharding when each changed split dimension still divides (slicing.py's
// _get_sharding_for_varying_out_shape, and lax.py's _pad_sharding_rule), dynamic_update_slice
// needs the update laid out as the operand
// (_dynamic_update_slice_sharding_rule). Unreduced rules: transpose, reshape and
// broadcast_in_dim move (or copy) each device's term as they move the value, slice cuts it,
// and concatenate joins the terms of operands unreduced alike, so the result is unreduced as
// its operands (lax.py's _transpose_ur_rule, _reshape_unreduced_rule,
// _broadcast_in_dim_unreduced_rule, _concatenate_unreduced_rule; slicing.py's _slice_ur_rule;
// squeeze is a reshape, as _squeeze_ur_rule keeps them too). dynamic_slice has none, as JAX's
// _dynamic_slice_ur_rule refuses an unreduced operand; pad refuses one where JAX keeps it
// (pad_type_rule, below). Reduced rules (the reduced half of the same `ur_rule`s): every layout
// op but rev keeps its operand's reduced axes (a reduced value is laid out as a replicated one),
// dynamic_slice too (_dynamic_slice_ur_rule), dynamic_update_slice needs its operand and update
// reduced alike (_dus_reduced_rule), broadcast_in_dim and concatenate as below; pad, built of
// broadcasts and concatenates, keeps its operand's as JAX's _pad_ur_rule does. The compiler keeps such a typed pending
// sum through them (coordinator/compiler/rules_layout.cc). rev has no unreduced or reduced
// rule: rev_p is registered without a ur_rule, so JAX's call_ur_rule (lax/utils.py) refuses an
// unreduced or reduced operand ("unreduced/reduced rule for rev is not implemented"), and so
// does Tessera.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"

namespace tessera::internal {
namespace {

TypeRuleResult transpose(const TypeRuleCall& c) {
  TypeRuleResult r;
  for (int64_t p : c.node.attrs<TransposeAttrs>().permutation) r.spec.push_back(c.operands[0].spec[p]);
  return r;
}

TypeRuleResult broadcast_in_dim(const TypeRuleCall& c) {
  TypeRuleResult r;
  r.spec.assign(c.node.shape.size(), Axes{});
  const TypedOperand& x = c.operands[0];
  const std::vector<int64_t>& dims = c.node.attrs<BroadcastAttrs>().result_dims;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (x.shape[i] == c.node.shape[dims[i]]) r.spec[dims[i]] = x.spec[i];
  }
  return r;
}

// JAX's _get_sharding_for_varying_out_shape (jax/_src/lax/slicing.py), the rule of slice,
// dynamic_slice and pad: the result keeps the operand's sharding, and a split dimension whose
// size changes must still divide by its axes.
TypeRuleResult varying_shape(const Mesh& mesh, const TypedOperand& x, const Shape& out, const char* name) {
  TypeRuleResult r{x.spec, "", ""};
  if (std::all_of(out.begin(), out.end(), [](int64_t n) { return n == 1; })) {
    r.spec.assign(out.size(), Axes{});
    return r;
  }
  for (size_t d = 0; d < out.size(); ++d) {
    if (x.shape[d] == out[d] || x.spec[d].empty()) continue;
    const int64_t blocks = mesh.axes_size(x.spec[d]);
    if (out[d] % blocks != 0) {
      r.error = absl::StrCat(name, " on sharded dims where out dim (", out[d], ") is not divisible by mesh axes (",
                             blocks, ") with spec ", axes_to_string(x.spec[d]),
                             " is not implemented. Got input type=", type_string(x.dtype, x.shape, x.spec),
                             " and output shape=", shape_to_string(out));
      r.fix = absl::StrCat("reshard the operand so that dimension ", d, " is not split (reshard(x, P(...)))");
      return r;
    }
  }
  return r;
}

// lax.py's _rev_sharding_rule: the operand's sharding (a split reversed dimension stays split;
// the compiler moves the blocks). rev_p has no ur_rule, so an unreduced or reduced operand is
// refused with call_ur_rule's words (no_unreduced_rule, and no reduced rule registered).
TypeRuleResult rev(const TypeRuleCall& c) { return TypeRuleResult{c.operands[0].spec, "", ""}; }

TypeRuleResult slice(const TypeRuleCall& c) { return varying_shape(c.mesh, c.operands[0], c.node.shape, "slicing"); }
TypeRuleResult dynamic_slice(const TypeRuleCall& c) {
  return varying_shape(c.mesh, c.operands[0], c.node.shape, "dynamic_slice");
}

// JAX's _dynamic_update_slice_sharding_rule: the update must be laid out as the operand.
TypeRuleResult dynamic_update_slice(const TypeRuleCall& c) {
  TypeRuleResult r{c.operands[0].spec, "", ""};
  if (c.operands[0].spec != c.operands[1].spec) {
    r.error = "dynamic_update_slice operand sharding must be equal to update sharding";
    r.fix = "reshard the update to the operand's sharding (reshard(update, P(...)))";
  }
  return r;
}

TypeRuleResult concatenate(const TypeRuleCall& c) { return consensus(c); }

TypeRuleResult reshape(const TypeRuleCall& c) {
  TypeRuleResult r;
  const TypedOperand& x = c.operands[0];
  const Shape& out = c.node.shape;
  r.spec.assign(out.size(), Axes{});
  for (int64_t n : x.shape) {
    if (n == 0) return r;  // nothing to split
  }
  // Walk the dimensions larger than 1 of both shapes in groups of equal element count.
  std::vector<size_t> in_dims, out_dims;
  for (size_t d = 0; d < x.shape.size(); ++d) {
    if (x.shape[d] != 1) in_dims.push_back(d);
  }
  for (size_t d = 0; d < out.size(); ++d) {
    if (out[d] != 1) out_dims.push_back(d);
  }
  size_t i = 0, j = 0;
  while (i < in_dims.size() && j < out_dims.size()) {
    std::vector<size_t> a{in_dims[i++]}, b{out_dims[j++]};
    int64_t pa = x.shape[a[0]], pb = out[b[0]];
    while (pa != pb) {
      if (pa < pb) {
        a.push_back(in_dims[i]);
        pa *= x.shape[in_dims[i++]];
      } else {
        b.push_back(out_dims[j]);
        pb *= out[out_dims[j++]];
      }
    }
    if (a.size() == 1 && b.size() == 1) {
      r.spec[b[0]] = x.spec[a[0]];
      continue;
    }
    bool split = false;
    for (size_t d : a) split = split || !x.spec[d].empty();
    if (split && !c.out_sharding_given) {
      r.error =
          absl::StrCat(a.size() == 1 ? "splitting" : "merging", " operand dimension", a.size() == 1 ? " " : "s ",
                       absl::StrJoin(a, ", "), " into result dimension", b.size() == 1 ? " " : "s ",
                       absl::StrJoin(b, ", "), " moves a split dimension, and how the result is split is ambiguous");
      r.fix = "give reshape an out_sharding, or reshard the operand so that those dimensions are not split";
      return r;
    }
  }
  return r;
}

// The operand's unreduced axes: jax/_src/lax/lax.py's _transpose_ur_rule and
// jax/_src/lax/slicing.py's _slice_ur_rule (each device's term is permuted or sliced as the
// value is, and the slice of the sum is the sum of the slices).
UnreducedRuleResult keep_unreduced(const TypeRuleCall& c) {
  return UnreducedRuleResult{c.operands[0].unreduced, "", ""};
}

// jax/_src/lax/lax.py, _reshape_unreduced_rule (and _broadcast_in_dim_unreduced_rule): the
// operand's unreduced axes; an out_sharding must name the same ones. (JAX's broadcast takes the
// out_sharding's, which may differ from a *reduced* operand's; Tessera has no reduced types, and
// a sum cannot be made pending over other axes, so it asks for the operand's.)
UnreducedRuleResult operand_unreduced(const TypeRuleCall& c) {
  const TypedOperand& x = c.operands[0];
  UnreducedRuleResult r{x.unreduced, "", ""};
  if (!x.unreduced.empty() && c.out_sharding_given && c.out_unreduced != x.unreduced) {
    r.error = absl::StrCat("out_sharding passed to ", op_name(c.node.op),
                           " must be unreduced over the same mesh axes as operand. Got out_sharding's unreduced axes ",
                           axis_set_repr(c.out_unreduced),
                           " and operand type: ", type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced));
    r.fix = absl::StrCat("give out_sharding=P(..., unreduced=", axis_set_repr(x.unreduced),
                         "), or reshard the operand first (reshard(x, P(...)) runs its sum)");
  }
  return r;
}

// jax/_src/lax/lax.py, _concatenate_unreduced_rule: the operands' unreduced axes, which must
// be the same ("All operands should be unreduced along the same mesh axes"). JAX lets an
// operand that is not unreduced join unreduced ones (it may be *reduced* there); Tessera has
// no reduced types, and such an operand's whole value would be each device's term, counted
// once per device by the sum, so it is refused as add refuses it (_add_ur_rule).
UnreducedRuleResult concatenate_unreduced(const TypeRuleCall& c) {
  UnreducedRuleResult r;
  std::vector<std::vector<std::string>> specs;
  for (const TypedOperand& o : c.operands) {
    if (!o.unreduced.empty() && std::find(specs.begin(), specs.end(), o.unreduced) == specs.end()) {
      specs.push_back(o.unreduced);
    }
  }
  if (specs.empty()) return r;
  if (specs.size() > 1) {
    r.error = absl::StrCat("All operands should be unreduced along the same mesh axes. Got unreduced specs: {",
                           absl::StrJoin(specs, ", ",
                                         [](std::string* out, const std::vector<std::string>& u) {
                                           absl::StrAppend(out, axis_frozenset_repr(u));
                                         }),
                           "}");
    r.fix = kReduceFirstFix;
    return r;
  }
  for (size_t k = 0; k < c.operands.size(); ++k) {
    if (!c.operands[k].unreduced.empty()) continue;
    r.error = absl::StrCat("operand ", k, " is not unreduced while others are unreduced over ", axis_set_repr(specs[0]),
                           ": its whole value would be each device's term, counted once per device by the sum "
                           "(JAX lets a reduced operand join; Tessera has no reduced types)");
    r.fix = kReduceFirstFix;
    return r;
  }
  r.unreduced = specs[0];
  return r;
}

}  // namespace

// jax/_src/lax/lax.py, _pad_sharding_rule: the operand's spec where the padding keeps the
// dimension's size or the dimension is unsplit.
TypeRuleResult pad_type_rule(const Mesh& mesh, const TypedOperand& x, const Shape& out) {
  return varying_shape(mesh, x, out, "padding");
}

// JAX's _pad_ur_rule (jax/_src/lax/lax.py) keeps the operand's unreduced axes, whatever the
// padding value: each device pads its term with it, so the sum holds the value once per device
// along them. Tessera keeps them where that sum is pad(sum, value): a padding value of zero, or
// one unreduced over the same axes (each device pads its term with its term of the value); it
// refuses another value rather than count it once per device.
TypeRuleResult pad_unreduced_rule(const TypedOperand& x, bool padding_value_sums) {
  if (padding_value_sums) return TypeRuleResult{x.spec, "", ""};
  return TypeRuleResult{{},
                        absl::StrCat("padding an operand unreduced over ", axis_set_repr(x.unreduced),
                                     " with a padding value that is neither zero nor unreduced over the same axes: "
                                     "each device's term would be padded with it (JAX's _pad_ur_rule), so the sum "
                                     "would count it once per device"),
                        "pad with zero and add the padding afterwards, or reshard the unreduced operand first"};
}

// jax/_src/lax/lax.py, _broadcast_in_dim_reduced_rule: with an out_sharding, its reduced axes
// (the constraint Tessera records after the op gives them), else the operand's.
ReducedRuleResult broadcast_in_dim_reduced(const TypeRuleCall& c) {
  return c.out_sharding_given ? ReducedRuleResult{} : keep_reduced(c);
}

// jax/_src/lax/lax.py, _concatenate_reduced_rule: the operands reduced are so over the same axes.
ReducedRuleResult concatenate_reduced(const TypeRuleCall& c) {
  return common_reduced(c, "All operands should be reduced along the same mesh axes. Got reduced specs: ");
}

// jax/_src/lax/slicing.py, _dus_reduced_rule: the operand and the update reduced over the same
// axes (each device holds both whole, so it writes its own copy), and the result as they are.
ReducedRuleResult dynamic_update_slice_reduced(const TypeRuleCall& c) {
  const TypedOperand &x = c.operands[0], &u = c.operands[1];
  if (x.reduced == u.reduced) return ReducedRuleResult{x.reduced, "", ""};
  return ReducedRuleResult{
      {},
      absl::StrCat("dynamic_update_slice operand and update must be reduced along the same axes. Got operand sharding ",
                   type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &c.mesh), " and update sharding ",
                   type_string(u.dtype, u.shape, u.spec, u.unreduced, u.reduced, &c.mesh), "."),
      absl::StrCat("reshard the update to the operand's reduced axes (reshard(update, P(..., reduced=",
                   axis_set_repr(x.reduced), ")))")};
}

// jax/_src/lax/slicing.py, _dus_unreduced_rule: the operand and the update unreduced over the
// same axes, and the result unreduced alike (each device writes its term of the update into its
// term of the operand: their sum is the operand's sum with the update's sum written in).
UnreducedRuleResult dynamic_update_slice_unreduced(const TypeRuleCall& c) {
  const TypedOperand &x = c.operands[0], &u = c.operands[1];
  if (x.unreduced == u.unreduced) return UnreducedRuleResult{x.unreduced, "", ""};
  return UnreducedRuleResult{
      {},
      absl::StrCat("dynamic_update_slice operand and update must be unreduced along the same axes. Got operand "
                   "sharding ",
                   type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &c.mesh), " and update sharding ",
                   type_string(u.dtype, u.shape, u.spec, u.unreduced, u.reduced, &c.mesh), "."),
      kReduceFirstFix};
}

absl::Span<const ExplicitRule> layout_type_rules() {
  static const ExplicitRule kRules[] = {
      {Op::kTranspose, transpose, keep_unreduced, keep_reduced},
      {Op::kBroadcastInDim, broadcast_in_dim, operand_unreduced, broadcast_in_dim_reduced},
      {Op::kReshape, reshape, operand_unreduced, keep_reduced},
      {Op::kSlice, slice, keep_unreduced, keep_reduced},
      {Op::kRev, rev, no_unreduced_rule},  // lax.py: rev_p has no ur_rule
      {Op::kConcatenate, concatenate, concatenate_unreduced, concatenate_reduced},
      {Op::kDynamicSlice, dynamic_slice, nullptr, keep_reduced},  // slicing.py's _dynamic_slice_ur_rule
      {Op::kDynamicUpdateSlice, dynamic_update_slice, dynamic_update_slice_unreduced, dynamic_update_slice_reduced},
  };
  return kRules;
}

}  // namespace tessera::internal

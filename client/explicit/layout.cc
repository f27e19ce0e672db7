// Explicit-mode sharding rules of the layout ops: the spec moves with the data (transpose
// permutes it, broadcast_in_dim maps it, slice keeps it, as JAX's rules in jax/_src/lax/lax.py
// and slicing.py); reshape as the explicit-sharding notebook describes (singleton dimensions
// stripped; a dimension kept whole keeps its split; a split or merge of unsplit dimensions is
// unsplit; a split or merge touching a split dimension is an error asking for out_sharding).
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit/rules.h"

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

TypeRuleResult keep(const TypeRuleCall& c) { return TypeRuleResult{c.operands[0].spec, "", ""}; }

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

}  // namespace

absl::Span<const std::pair<Op, TypeRule>> layout_type_rules() {
  static const std::pair<Op, TypeRule> kRules[] = {
      {Op::kTranspose, transpose}, {Op::kBroadcastInDim, broadcast_in_dim}, {Op::kReshape, reshape},
      {Op::kSlice, keep},          {Op::kConcatenate, concatenate},
  };
  return kRules;
}

}  // namespace tessera::internal

// Explicit-mode sharding rules of the ops that make or place values: a sharding constraint
// (reshard, out_sharding) is its spec; sharding_as (a gradient taking its parameter's layout)
// is its second operand's; constants, iota and random bits are unsplit, as JAX's nullary ops
// are without out_sharding (docs/notebooks/explicit-sharding.md); a gather keeps the splits
// of the table's other dimensions and of the indices, and refuses a split of the dimension it
// indexes.
#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"

namespace tessera::internal {
namespace {

TypeRuleResult constraint(const TypeRuleCall& c) {
  return TypeRuleResult{
      type_spec_of(c.node.attrs<ShardingAttrs>().sharding.spec(), c.mesh, static_cast<int>(c.node.shape.size())), "",
      ""};
}

TypeRuleResult sharding_as(const TypeRuleCall& c) { return TypeRuleResult{c.operands[1].spec, "", ""}; }

TypeRuleResult unsplit(const TypeRuleCall& c) { return TypeRuleResult{TypeSpec(c.node.shape.size()), "", ""}; }

TypeRuleResult gather(const TypeRuleCall& c) {
  TypeRuleResult r;
  const int64_t axis = c.node.attrs<GatherAttrs>().axis;
  const TypeSpec& x = c.operands[0].spec;
  if (!x[axis].empty()) {
    r.error = absl::StrCat("the indexed dimension ", axis, " is split over ", axes_to_string(x[axis]));
    r.fix = absl::StrCat("reshard the table so that dimension ", axis, " is not split (reshard(x, P(...)))");
    return r;
  }
  r.spec.assign(x.begin(), x.begin() + axis);
  r.spec.insert(r.spec.end(), c.operands[1].spec.begin(), c.operands[1].spec.end());
  r.spec.insert(r.spec.end(), x.begin() + axis + 1, x.end());
  return r;
}

}  // namespace

absl::Span<const std::pair<Op, TypeRule>> placement_type_rules() {
  static const std::pair<Op, TypeRule> kRules[] = {
      {Op::kShardingConstraint, constraint},
      {Op::kShardingAs, sharding_as},
      {Op::kConstant, unsplit},
      {Op::kIota, unsplit},
      {Op::kRandomBits, unsplit},
      {Op::kGather, gather},
  };
  return kRules;
}

}  // namespace tessera::internal

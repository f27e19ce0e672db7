// Explicit-mode sharding rules of shard_map, as JAX's (jax/_src/shard_map.py): on a mesh
// whose axes are all Explicit, an argument enters with its own sharding: an in_spec that is
// not the argument's type is an error rather than an implicit reshard ("in_specs passed to
// shard_map: ... does not match the specs of the input"), and an omitted in_specs is inferred
// from the arguments' types (client/shard_map.cc). Inside the body values are per-device
// blocks, split over no Explicit axis (the body's axes are Manual: its types carry no mesh
// axis, as _shard_shaped_array's); a result's type is its out_spec (_unshard_shaped_array).
// On a mesh mixing Auto and Explicit axes JAX checks nothing, and neither does this.
#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"
#include "core/op_attrs.h"

namespace tessera::internal {

bool all_explicit(const Mesh& mesh) {
  for (AxisType t : mesh.axis_types()) {
    if (t != AxisType::kExplicit) return false;
  }
  return true;
}

namespace {

TypeRuleResult shard_map_in(const TypeRuleCall& c) {
  TypeRuleResult r = shard_map_in_type_rule(c.operands[0], c.node.attrs<ShardingAttrs>().sharding);
  r.spec = TypeSpec(c.node.shape.size());
  return r;
}

TypeRuleResult shard_map_out(const TypeRuleCall& c) {
  return TypeRuleResult{
      type_spec_of(c.node.attrs<ShardingAttrs>().sharding.spec(), c.mesh, static_cast<int>(c.node.shape.size())), "",
      ""};
}

}  // namespace

TypeRuleResult shard_map_in_type_rule(const TypedOperand& x, const NamedSharding& in) {
  TypeRuleResult r;
  if (!all_explicit(in.mesh())) return r;
  const TypeSpec want = type_spec_of(in.spec(), in.mesh(), static_cast<int>(x.shape.size()));
  if (want == x.spec) return r;
  r.error = absl::StrCat("in_specs passed to shard_map: ", to_partition_spec(want).to_string(),
                         " does not match the specs of the input: ", to_partition_spec(x.spec).to_string(),
                         " for arg: ", type_string(x.dtype, x.shape, x.spec));
  r.fix =
      "`in_specs` is an optional argument so you can omit specifying it and shard_map will infer the in_specs "
      "from the arguments. If you want to reshard your inputs, you can use `reshard` on the arguments and then "
      "pass those args to shard_map.";
  return r;
}

absl::Span<const std::pair<Op, TypeRule>> shard_map_type_rules() {
  static const std::pair<Op, TypeRule> kRules[] = {
      {Op::kShardMapIn, shard_map_in},
      {Op::kShardMapOut, shard_map_out},
  };
  return kRules;
}

}  // namespace tessera::internal

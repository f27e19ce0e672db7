// Explicit-mode sharding rules of shard_map, as JAX's (jax/_src/shard_map.py): on a mesh
// whose axes are all Explicit, an argument enters with its own sharding: an in_spec that is
// not the argument's type is an error rather than an implicit reshard ("in_specs passed to
// shard_map: ... does not match the specs of the input"), and an omitted in_specs is inferred
// from the arguments' types (client/shard_map.cc). Inside the body values are per-device
// blocks, split over no Explicit axis (the body's axes are Manual: its types carry no mesh
// axis, as _shard_shaped_array's); a result's type is its out_spec (_unshard_shaped_array).
// A body manual over some axes only (axis_names) keeps its values' split over the others,
// through its collectives too.
// On a mesh mixing Auto and Explicit axes JAX checks nothing, and neither does this.
#include <algorithm>

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

// The mesh axes a boundary leaves automatic (shard_map's axis_names; none when it is manual
// over every axis).
std::vector<std::string> automatic_axes(const ShardingAttrs& a) {
  std::vector<std::string> out;
  if (a.manual_axes.empty()) return out;
  for (const std::string& axis : a.sharding.mesh().axis_names()) {
    if (std::find(a.manual_axes.begin(), a.manual_axes.end(), axis) == a.manual_axes.end()) out.push_back(axis);
  }
  return out;
}

// In a body manual over some axes only, the block keeps the argument's split over the others
// (JAX's test_partial_auto_explicit_multi_explicit: P('i', 'j', 'k', 'l') under axis_names
// {'i', 'j'} is P(None, None, 'k', 'l') inside), and only the manual axes meet the in_spec.
TypeRuleResult shard_map_in(const TypeRuleCall& c) {
  const ShardingAttrs& a = c.node.attrs<ShardingAttrs>();
  TypedOperand manual = c.operands[0];
  without_axes(manual.spec, automatic_axes(a));
  TypeRuleResult r = shard_map_in_type_rule(manual, a.sharding);
  r.spec = TypeSpec(c.node.shape.size());
  if (!a.manual_axes.empty()) {
    r.spec = c.operands[0].spec;
    without_axes(r.spec, a.manual_axes);
  }
  return r;
}

// The out_spec's manual axes, then on each dimension the block's split over the automatic
// ones (the same test: x.T of P(None, None, 'k', 'l') under out_specs P('i', 'j', None, None)
// is P(('i', 'l'), ('j', 'k'), None, None)).
TypeRuleResult shard_map_out(const TypeRuleCall& c) {
  const ShardingAttrs& a = c.node.attrs<ShardingAttrs>();
  TypeSpec spec = type_spec_of(a.sharding.spec(), c.mesh, static_cast<int>(c.node.shape.size()));
  if (!a.manual_axes.empty()) {
    const TypeSpec& block = c.operands[0].spec;
    for (size_t d = 0; d < spec.size() && d < block.size(); ++d) {
      spec[d].insert(spec[d].end(), block[d].begin(), block[d].end());
    }
  }
  return TypeRuleResult{spec, "", ""};
}

// The collectives of a body manual over some axes only: the result keeps the operand's split
// over the automatic ones (ragged_all_to_all: its output operand's), as JAX's abstract evals
// update only the shape and the varying axes of the operand's type (jax/_src/lax/parallel.py).
// A dimension the collective resizes (all_gather, psum_scatter, all_to_all) must still divide
// by the axes it is split over.
TypeRuleResult collective(const TypeRuleCall& c) {
  const TypedOperand& x = c.operands[c.node.op == Op::kRaggedAllToAll ? 1 : 0];
  TypeRuleResult r{x.spec, "", ""};
  for (size_t d = 0; d < r.spec.size() && d < c.node.shape.size(); ++d) {
    const int64_t n = c.mesh.axes_size(r.spec[d]);
    if (n <= 1 || c.node.shape[d] % n == 0) continue;
    r.error =
        absl::StrCat("its result's dimension ", d, " of size ", c.node.shape[d], " is split over ",
                     axes_to_string(r.spec[d]), " (of size ", n, ") in the operand's type, which does not divide it");
    r.fix = absl::StrCat("reshard dimension ", d, " whole before the shard_map, or use another dimension");
    r.spec.clear();
    return r;
  }
  return r;
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

absl::Span<const ExplicitRule> shard_map_type_rules() {
  static const ExplicitRule kRules[] = {
      {Op::kShardMapIn, shard_map_in},      {Op::kShardMapOut, shard_map_out}, {Op::kAllReduce, collective},
      {Op::kAllGather, collective},         {Op::kReduceScatter, collective},  {Op::kAllToAll, collective},
      {Op::kCollectivePermute, collective}, {Op::kPvary, collective},          {Op::kRaggedAllToAll, collective},
  };
  return kRules;
}

}  // namespace tessera::internal

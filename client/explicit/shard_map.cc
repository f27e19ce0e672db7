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
// Reduced and unreduced manual axes (JAX's ManualAxisType, jax/_src/core.py): an in_spec's
// unreduced / reduced axes must be the argument's, and the body's parameter keeps them
// (_shard_shaped_array: `f32[2,6]{U:x}`, each device's block its term of the pending sum, or
// a copy of the reduced value); a result's are its out_spec's (_unshard_shaped_array, whose
// equality check client/shard_map.cc makes). The collectives' rules are their abstract evals'
// (jax/_src/lax/parallel.py): psum and psum_scatter over the axes an operand is unreduced over
// run its sum (unreduced_psum, unreduced_psum_scatter), pmax / pmin refuse it
// (check_unreduced_kind), and every collective refuses an operand reduced over its axes, or
// unreduced over the axes of one that does not sum (check_unreduced_args); pvary of an operand
// reduced over exactly its axes is reduced_vary_cast (Reduced -> Varying, what
// core.py's auto_insert_reshard inserts where a reduced value meets a varying one). The other
// casts of a pvary node (core/pvary_cast.h) are vary_unreduced_cast (pcast to='unreduced':
// unreduced over its axes too; refused for an operand unreduced or reduced over them, as
// _vary_unreduced_cast_abstract_eval and check_unreduced_args) and preduced (pcast to='reduced',
// and all_gather(to='reduced')'s second half: reduced over its axes too; refused for an operand
// reduced over them, _preduced_abstract_eval); which states they take is pcast's check
// (client/shard_map.cc, _get_from and _pcast_funcs).
#include <algorithm>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"
#include "core/op_attrs.h"
#include "core/pvary_cast.h"

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

// The axes of `axes` that `of` holds, in `axes`' order.
std::vector<std::string> common_axes(const std::vector<std::string>& axes, const std::vector<std::string>& of) {
  std::vector<std::string> out;
  for (const std::string& a : axes) {
    if (std::find(of.begin(), of.end(), a) != of.end()) out.push_back(a);
  }
  return out;
}

std::vector<std::string> sorted_axes(std::vector<std::string> axes) {
  std::sort(axes.begin(), axes.end());
  return axes;
}

// `from` less the axes of `axes`.
std::vector<std::string> less_axes(const std::vector<std::string>& from, const std::vector<std::string>& axes) {
  std::vector<std::string> out;
  for (const std::string& a : from) {
    if (std::find(axes.begin(), axes.end(), a) == axes.end()) out.push_back(a);
  }
  return out;
}

// What a pvary node casts to (core/pvary_cast.h).
PvaryCast cast_of(const Node& n) {
  PvaryCast cast = PvaryCast::kVarying;
  pvary_cast_of(n.attrs<CollectiveAttrs>().dimension, &cast);
  return cast;
}

// `a` and `b`'s axes, sorted.
std::vector<std::string> union_axes(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  std::vector<std::string> out = a;
  for (const std::string& x : b) {
    if (std::find(out.begin(), out.end(), x) == out.end()) out.push_back(x);
  }
  return sorted_axes(std::move(out));
}

// The JAX function of a collective node, as its abstract eval names it in check_unreduced_args.
// Recorded by client/shard_map.cc, a collective reaches refuse_args only with check_vma off
// (with it on, the pvary JAX inserts first refuses, auto_pvary_takes) or as a gradient's. The
// casts do not: vary_unreduced_cast and preduced have their own words, and the invariant cast
// reads an all_gather whose operand auto_pvary_takes refused an unreduced or reduced type over
// the gathered axes (so the gather's result is neither over them), which
// AllGatherToInvaryingOfAReducedValueIsRefusedAsJax asserts; the name is JAX's all the same.
std::string collective_name(const Node& n) {
  if (n.op == Op::kPvary && cast_of(n) == PvaryCast::kUnreduced) return "vary_unreduced_cast";
  if (n.op == Op::kPvary && cast_of(n) == PvaryCast::kReduced) return "preduced";
  if (n.op == Op::kPvary && cast_of(n) == PvaryCast::kInvariant) return "all_gather_invariant";
  static constexpr std::pair<Op, const char*> kNames[] = {
      {Op::kAllReduce, "psum"},      {Op::kAllGather, "all_gather"},       {Op::kReduceScatter, "reduce_scatter"},
      {Op::kAllToAll, "all_to_all"}, {Op::kCollectivePermute, "ppermute"}, {Op::kPvary, "pvary"},
  };
  for (const auto& [op, name] : kNames) {
    if (op == n.op) return name;
  }
  return std::string(op_name(n.op));
}

// check_unreduced_args (jax/_src/core.py): "<name> cannot accept args which are <what>. Got
// <type> and axes={'x'}", or no error.
std::string refuse_args(const TypeRuleCall& c, const TypedOperand& x, const char* what) {
  const CollectiveAttrs& a = c.node.attrs<CollectiveAttrs>();
  return absl::StrCat(collective_name(c.node), " cannot accept args which are ", what, ". Got ",
                      type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &c.mesh),
                      " and axes=", axis_set_repr(sorted_axes(a.axes)));
}

// The collectives' unreduced rules: psum and psum_scatter over the axes x is unreduced over sum
// them (unreduced_psum, unreduced_psum_scatter: the result is unreduced over the rest, and
// psum_scatter's varies along the axes, which the varying rules say); pmax and pmin of such an
// x are unreduced_pmax / unreduced_pmin, which take only a max / min kind (Tessera's pending
// sums are sums); any other collective over an axis x is unreduced over is refused.
UnreducedRuleResult collective_unreduced(const TypeRuleCall& c) {
  const CollectiveAttrs& a = c.node.attrs<CollectiveAttrs>();
  const TypedOperand& x = c.operands[c.node.op == Op::kRaggedAllToAll ? 1 : 0];
  UnreducedRuleResult r{x.unreduced, "", ""};
  const bool to_unreduced = c.node.op == Op::kPvary && cast_of(c.node) == PvaryCast::kUnreduced;
  if (common_axes(a.axes, x.unreduced).empty()) {
    // vary_unreduced_cast: unreduced over its axes too.
    if (to_unreduced) r.unreduced = union_axes(x.unreduced, a.axes);
    return r;
  }
  if (to_unreduced) {  // _vary_unreduced_cast_abstract_eval's words
    r.error = absl::StrCat("vary_unreduced_cast input cannot be unreduced across the axis_name provided. Got x=",
                           type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &c.mesh),
                           " and axis_name=", axis_tuple_repr(a.axes));
    r.fix = "psum it over those axes first";
    r.unreduced.clear();
    return r;
  }
  // all_gather(to='reduced') of an x unreduced over some of its axes: all_gather_reduced's
  // abstract eval keeps x's unreduced axes (it checks only their kind), which client/shard_map.cc
  // gives its gather and cast as their result's (out_unreduced).
  if ((c.node.op == Op::kAllGather || c.node.op == Op::kPvary) && !c.out_unreduced.empty() &&
      c.out_unreduced == x.unreduced) {
    return r;
  }
  const bool sums = c.node.op == Op::kAllReduce || c.node.op == Op::kReduceScatter;
  if (sums && a.reduce_op == ReduceOp::kSum) {
    r.unreduced = less_axes(x.unreduced, a.axes);
    return r;
  }
  if (sums) {
    const char* kind = a.reduce_op == ReduceOp::kMax ? "max" : "min";
    r.error = absl::StrCat("unreduced_p", kind,
                           " cannot accept args with unreduced_kind=sum. Expected unreduced_kind=", kind);
    r.fix = "psum it first (its unreduced axes are a pending sum)";
  } else {
    r.error = refuse_args(c, x, "unreduced");
    r.fix = "psum it over those axes first (or psum_scatter it)";
  }
  r.unreduced.clear();
  return r;
}

// The collectives' reduced rules: pvary over exactly axes x is reduced over is
// reduced_vary_cast (the result varies along them and is no longer reduced); every other
// collective, and pvary over only some of them, refuses x reduced over its axes
// (check_unreduced_args); x reduced over other axes keeps them.
ReducedRuleResult collective_reduced(const TypeRuleCall& c) {
  const CollectiveAttrs& a = c.node.attrs<CollectiveAttrs>();
  const TypedOperand& x = c.operands[c.node.op == Op::kRaggedAllToAll ? 1 : 0];
  ReducedRuleResult r{x.reduced, "", ""};
  const std::vector<std::string> hit = common_axes(a.axes, x.reduced);
  const bool to_reduced = c.node.op == Op::kPvary && cast_of(c.node) == PvaryCast::kReduced;
  if (hit.empty()) {
    // preduced (and all_gather(to='reduced')'s cast): reduced over its axes too.
    if (to_reduced) r.reduced = union_axes(x.reduced, a.axes);
    return r;
  }
  if (to_reduced) {  // _preduced_abstract_eval's words
    r.reduced.clear();
    r.error = absl::StrCat("preduced input cannot be reduced across the axis_name provided. Got x=",
                           type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &c.mesh),
                           " and axis_name=", axis_tuple_repr(a.axes));
    r.fix = "leave out the axes it is reduced over already";
    return r;
  }
  if (c.node.op == Op::kPvary && cast_of(c.node) == PvaryCast::kVarying && hit.size() == a.axes.size()) {
    r.reduced = less_axes(x.reduced, a.axes);
    return r;
  }
  // unreduced_psum: a psum over axes x is unreduced over (_get_from's state, 'unreduced' before
  // 'reduced') keeps x's reduced axes, as _unreduced_psum_abstract_eval checks none (such an x
  // is all_gather(to='reduced')'s of a value unreduced over some of the gathered axes).
  if (c.node.op == Op::kAllReduce && a.reduce_op == ReduceOp::kSum &&
      common_axes(a.axes, x.unreduced).size() == a.axes.size()) {
    return r;
  }
  r.reduced.clear();
  r.error = refuse_args(c, x, "reduced");
  r.fix = c.node.op == Op::kPvary && cast_of(c.node) == PvaryCast::kVarying
              ? "pcast it to='varying' over all the axes it is reduced over"
              : "pcast it to='varying' over those axes first (reduced_vary_cast)";
  return r;
}

// A boundary's unreduced and reduced axes: its spec's (an in_spec's are its argument's, an
// out_spec's its result's, as client/shard_map.cc checks with JAX's words).
UnreducedRuleResult boundary_unreduced(const TypeRuleCall& c) {
  return UnreducedRuleResult{c.node.attrs<ShardingAttrs>().sharding.spec().unreduced(), "", ""};
}
ReducedRuleResult boundary_reduced(const TypeRuleCall& c) {
  return ReducedRuleResult{c.node.attrs<ShardingAttrs>().sharding.spec().reduced(), "", ""};
}

}  // namespace

std::string shard_map_spec_unreduced_error(const char* kind, const Mesh& mesh, bool full_manual,
                                           const std::vector<std::string>& manual_axes, const PartitionSpec& spec) {
  if (!spec.has_unreduced_or_reduced()) return "";
  if (!full_manual) {
    return absl::StrCat(
        "unreduced/reduced can only be passed to ", kind,
        "_specs when shard_map is in full manual mode. Got mesh axis names ", axes_to_string(mesh.axis_names()),
        ", manual_axes: ", axis_frozenset_repr(sorted_axes(manual_axes)), ", specs: ", spec.to_string());
  }
  for (const auto& [what, axes] : {std::pair{"unreduced", &spec.unreduced()}, std::pair{"reduced", &spec.reduced()}}) {
    for (const std::string& a : *axes) {
      const int i = mesh.axis_index(a);
      if (i >= 0 && mesh.axis_types()[i] == AxisType::kExplicit) continue;
      return absl::StrCat(what, " in ", kind, "_specs ", spec.to_string(),
                          " can only be used when the mesh passed to shard_map contains axis names all of type "
                          "`Explicit`. Got mesh ",
                          mesh.to_string());
    }
  }
  return "";
}

std::string shard_map_out_unreduced_error(const PartitionSpec& spec, const TypedOperand& out, const Mesh& mesh) {
  for (const auto& [what, want, have] : {std::tuple{"unreduced", &spec.unreduced(), &out.unreduced},
                                         std::tuple{"reduced", &spec.reduced(), &out.reduced}}) {
    if (*want == *have) continue;
    return absl::StrCat("out_specs passed to shard_map should be equal to the ", what,
                        " present on the out_aval. Got out_specs=", spec.to_string(), " and out_aval=",
                        type_string(out.dtype, out.shape, out.spec, out.unreduced, out.reduced, &mesh));
  }
  return "";
}

TypeRuleResult shard_map_in_type_rule(const TypedOperand& x, const NamedSharding& in) {
  TypeRuleResult r;
  // _shard_shaped_array: the in_spec's unreduced and reduced axes are the argument's.
  for (const auto& [what, want, have] : {std::tuple{"unreduced", &in.spec().unreduced(), &x.unreduced},
                                         std::tuple{"reduced", &in.spec().reduced(), &x.reduced}}) {
    if (*want == *have) continue;
    r.error = absl::StrCat("in_specs containing ", what, " ", in.spec().to_string(),
                           " passed to shard_map should be equal to the ", what, " present on the in_aval ",
                           type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &in.mesh()));
    r.fix = absl::StrCat("reshard the argument to P(..., ", what, "=", axis_set_repr(*want),
                         ") first, or give the in_spec the argument's ", what, " axes");
    return r;
  }
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
      {Op::kShardMapIn, shard_map_in, boundary_unreduced, boundary_reduced},
      {Op::kShardMapOut, shard_map_out, boundary_unreduced, boundary_reduced},
      {Op::kAllReduce, collective, collective_unreduced, collective_reduced},
      {Op::kAllGather, collective, collective_unreduced, collective_reduced},
      {Op::kReduceScatter, collective, collective_unreduced, collective_reduced},
      {Op::kAllToAll, collective, collective_unreduced, collective_reduced},
      {Op::kCollectivePermute, collective, collective_unreduced, collective_reduced},
      {Op::kPvary, collective, collective_unreduced, collective_reduced},
      {Op::kRaggedAllToAll, collective, collective_unreduced, collective_reduced},
  };
  return kRules;
}

}  // namespace tessera::internal

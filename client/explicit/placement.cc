// Explicit-mode sharding rules of the ops that make or place values: a sharding constraint
// (reshard, out_sharding) is its spec; sharding_as (a gradient taking its parameter's layout)
// is its second operand's; constants, iota and random bits are unsplit, as JAX's nullary ops
// are without out_sharding (docs/notebooks/explicit-sharding.md), except for the batch of a
// batch of keys; a gather keeps the splits
// of the table's other dimensions, and refuses a split of the dimension it indexes or of the
// indices; a scatter is the gather's rule in reverse (below). A gather keeps its table's reduced
// axes, a scatter_add keeps an operand and updates unreduced alike and refuses reduced ones, as
// slicing.py's _gather_ur_rule and _scatter_ur_rule (scatter has none: it refuses both).
#include <algorithm>
#include <initializer_list>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/explicit/rules.h"
#include "core/axis_set_repr.h"

namespace tessera::internal {
namespace {

// An operand's type as a refusal's "Got operand=..." prints it: "f32[8@b,8]".
std::string operand_type(const TypedOperand& o, const Mesh& mesh) {
  return type_string(o.dtype, o.shape, o.spec, o.unreduced, o.reduced, &mesh);
}

TypeRuleResult constraint(const TypeRuleCall& c) {
  return TypeRuleResult{
      type_spec_of(c.node.attrs<ShardingAttrs>().sharding.spec(), c.mesh, static_cast<int>(c.node.shape.size())), "",
      ""};
}

// A constraint's unreduced axes are its spec's: the operand's own (a layout change), none (the
// sum runs: the compiler's all-reduce, or reduce-scatter onto a split dimension), or, from an
// operand not unreduced, new ones (JAX's reshard onto P(..., unreduced={'X'}), as
// tests/pjit_test.py's test_sharded_unreduced_roundtrip and test_scalar_to_unreduced: each
// device's term is its block where the operand was split over X, zero-padded, and the value on
// the first device along X otherwise; the compiler's kUnreduce, coordinator/compiler/reshard.h).
// An operand unreduced over other axes is refused, as in JAX.
UnreducedRuleResult constraint_unreduced(const TypeRuleCall& c) {
  const PartitionSpec& spec = c.node.attrs<ShardingAttrs>().sharding.spec();
  const std::vector<std::string>& from = c.operands[0].unreduced;
  UnreducedRuleResult r{spec.unreduced(), "", ""};
  if (r.unreduced.empty() || r.unreduced == from || from.empty()) return r;
  r.error = absl::StrCat("resharding to ", spec.to_string(), " makes an unreduced value from one unreduced over ",
                         axis_set_repr(from));
  r.fix = "reshard to the operand's own unreduced axes, or to P(...) first (the sum runs)";
  return r;
}

// A constraint's reduced axes are its spec's (reshard(x, P(reduced={'X'})): laid out as its
// partitions say, replicated over X).
ReducedRuleResult constraint_reduced(const TypeRuleCall& c) {
  return ReducedRuleResult{c.node.attrs<ShardingAttrs>().sharding.spec().reduced(), "", ""};
}

TypeRuleResult sharding_as(const TypeRuleCall& c) { return TypeRuleResult{c.operands[1].spec, "", ""}; }

// sharding_as takes only the layout of the value it is laid out as, never its unreduced axes:
// grad lays a gradient out as its argument, and the cotangent of an unreduced argument is
// reduced (JAX's primal_sharding_to_cotangent_sharding, jax/_src/core.py: P.to_ct_spec swaps
// unreduced and reduced), which Tessera lays out replicated. So the result is never unreduced:
// an unreduced first operand is summed, as a reshard onto a spec without unreduced axes sums it
// (the compiler's sharding_as needs its operand whole, rules_placement.cc).
UnreducedRuleResult sharding_as_unreduced(const TypeRuleCall&) { return UnreducedRuleResult{}; }

TypeRuleResult unsplit(const TypeRuleCall& c) { return TypeRuleResult{TypeSpec(c.node.shape.size()), "", ""}; }

// A batch of keys: the batch dimensions split as the keys (or their counters) are, the bits of
// each key unsplit, as JAX's random_bits_p (its keys' spec, then None: jax/_src/random/prng.py).
TypeRuleResult random_bits(const TypeRuleCall& c) {
  TypeRuleResult r{TypeSpec(c.node.shape.size()), "", ""};
  const TypeSpec &key = c.operands[0].spec, &counter = c.operands[1].spec;
  for (size_t d = 0; d < counter.size(); ++d) {
    if (!key[d].empty() && !counter[d].empty() && key[d] != counter[d]) {
      r.error = absl::StrCat("batch dimension ", d, " of the keys is split over ", axes_to_string(key[d]),
                             " and of their counters over ", axes_to_string(counter[d]));
      r.fix = "reshard the keys and the counters alike (reshard(x, P(...)))";
      return r;
    }
    r.spec[d] = key[d].empty() ? counter[d] : key[d];
  }
  return r;
}

// Why the first `batch_dims` dimensions of the named specs do not resolve (two of them split
// differently), or "" (JAX's _gather_spec_computation's batching_dims_resolve_unambiguously,
// _scatter_spec_computation's _is_resolvable).
std::string unresolved_batch_dims(int64_t batch_dims,
                                  std::initializer_list<std::pair<const char*, const TypeSpec*>> specs) {
  for (int64_t k = 0; k < batch_dims; ++k) {
    const std::pair<const char*, const TypeSpec*>* first = nullptr;
    for (const auto& s : specs) {
      if ((*s.second)[k].empty()) continue;
      if (first == nullptr) {
        first = &s;
      } else if ((*first->second)[k] != (*s.second)[k]) {
        return absl::StrCat("batch dimension ", k, " of the ", first->first, " is split over ",
                            axes_to_string((*first->second)[k]), " and of the ", s.first, " over ",
                            axes_to_string((*s.second)[k]));
      }
    }
  }
  return "";
}

// JAX's _gather_sharding_rule (_gather_spec_computation, jax/_src/lax/slicing.py) on Tessera's
// gather (jnp.take: the indexed dimension collapsed, every dimension of the indices a query, none
// a batching one): the indexed dimension must be unsplit (a slice of it needs the whole
// dimension), and so must the indices (split queries into a table "would require collectives on
// inputs"; tests/pjit_test.py test_indices_sharded_gather_error refuses x[ids, :] with ids P('x'));
// the table's other dimensions keep their splits. A split the rule refuses is left to an
// out_sharding, which gathers with the Explicit axes as Auto (take's, IndexRef::get's). The
// refusal is _gather_sharding_rule's text, as lax.gather's (client/lax_gather.cc: x[ids] and
// jnp.take are JAX's gather_p too), the types in Tessera's notation (JAX prints the avals' repr,
// ShapedArray(float32[8@b,8])); which dimension is split goes into the fix.
// Batch dimensions (GatherAttrs.batch_dims, JAX's operand_batching_dims with
// start_indices_batching_dims) resolve unambiguously: split alike, or on one side only, and the
// result takes the split ("Resolve any batched shardings into indices shardings").
TypeRuleResult gather(const TypeRuleCall& c) {
  TypeRuleResult r;
  const GatherAttrs& a = c.node.attrs<GatherAttrs>();
  const int64_t axis = a.axis;
  const TypeSpec &x = c.operands[0].spec, &idx = c.operands[1].spec;
  std::string why = unresolved_batch_dims(a.batch_dims, {{"operand", &x}, {"indices", &idx}});
  if (!x[axis].empty() && why.empty()) {
    why = absl::StrCat("the indexed dimension ", axis, " is split over ", axes_to_string(x[axis]));
  }
  for (size_t d = static_cast<size_t>(a.batch_dims); d < idx.size() && why.empty(); ++d) {
    if (!idx[d].empty()) why = absl::StrCat("dimension ", d, " of the indices is split over ", axes_to_string(idx[d]));
  }
  if (!why.empty()) {
    r.error = absl::StrCat(
        "Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing as out sharding "
        "could not be resolved unambiguously (or would require collectives on inputs). Got operand=",
        operand_type(c.operands[0], c.mesh), ", indices=", operand_type(c.operands[1], c.mesh));
    r.fix = absl::StrCat(why,
                         ", and the indexed dimension and the indices must be unsplit: give the gather an "
                         "out_sharding (take(x, indices, axis, P(...)), at(x, indices).get(P(...))), or reshard the "
                         "table and the indices");
    return r;
  }
  r.spec.assign(x.begin(), x.begin() + axis);
  for (int64_t k = 0; k < a.batch_dims; ++k) {
    if (!idx[k].empty()) r.spec[k] = idx[k];
  }
  r.spec.insert(r.spec.end(), idx.begin() + a.batch_dims, idx.end());
  r.spec.insert(r.spec.end(), x.begin() + axis + 1, x.end());
  return r;
}

// JAX's _scatter_sharding_rule (_scatter_spec_computation, jax/_src/lax/slicing.py) on
// Tessera's scatter (the table x indexed along `axis` by every element of `indices`; the
// updates x[:axis] + indices.shape + x[axis+1:]): the indexed dimension of x and the queries'
// dimensions (of the indices, and the updates' matching ones) must be unsplit, and each other
// dimension of x, a full window, must be split exactly as the updates' matching one ("Full slice
// dims must resolve unambiguously between operand and updates": the same split, or none on
// both; a split on one side only would need a collective). The result is laid out as x. The
// refusal is _scatter_sharding_rule's text, as the lax scatters' (client/lax_gather.cc), the types
// in Tessera's notation; which dimension is split goes into the fix.
TypeRuleResult scatter(const TypeRuleCall& c) {
  TypeRuleResult r;
  const GatherAttrs& a = c.node.attrs<GatherAttrs>();
  const int64_t axis = a.axis, n = a.batch_dims;
  const TypeSpec &x = c.operands[0].spec, &idx = c.operands[1].spec, &upd = c.operands[2].spec;
  const int64_t q = static_cast<int64_t>(idx.size());
  // Batch dimensions resolve among the three (rule 1) into the result's.
  std::string why = unresolved_batch_dims(n, {{"operand", &x}, {"indices", &idx}, {"updates", &upd}});
  if (!x[axis].empty() && why.empty()) {
    why = absl::StrCat("the indexed dimension ", axis, " is split over ", axes_to_string(x[axis]));
  }
  for (int64_t d = n; d < q && why.empty(); ++d) {
    if (!idx[d].empty()) {
      why = absl::StrCat("dimension ", d, " of the indices is split over ", axes_to_string(idx[d]));
    } else if (!upd[axis + d - n].empty()) {
      why = absl::StrCat("dimension ", axis + d - n, " of the updates, a query dimension, is split over ",
                         axes_to_string(upd[axis + d - n]));
    }
  }
  r.spec = x;
  r.spec[axis] = Axes{};
  for (int64_t k = 0; k < n; ++k) {
    if (r.spec[k].empty()) r.spec[k] = !idx[k].empty() ? idx[k] : upd[k];
  }
  for (int64_t d = n; d < static_cast<int64_t>(x.size()) && why.empty(); ++d) {
    if (d == axis) continue;
    const int64_t ud = d < axis ? d : d - 1 + q - n;
    if (x[d] != upd[ud]) {
      auto split = [](const Axes& a) { return a.empty() ? std::string("unsplit") : "split over " + axes_to_string(a); };
      why = absl::StrCat("window dimension ", d, " of the operand is ", split(x[d]), " and dimension ", ud,
                         " of the updates ", split(upd[ud]));
    }
  }
  if (!why.empty()) {
    r.error = absl::StrCat(
        "Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the scatter update as out "
        "sharding could not be resolved unambiguously (or would require collectives on inputs). Got operand=",
        operand_type(c.operands[0], c.mesh), ", indices=", operand_type(c.operands[1], c.mesh),
        ", updates=", operand_type(c.operands[2], c.mesh));
    r.fix = absl::StrCat(
        why,
        ", and the indexed dimension and the indices must be unsplit, the other dimensions split alike in the "
        "operand and the updates: give the scatter an out_sharding (at(x, indices).set(updates, P(...)), "
        "at(x, indices).add(updates, P(...)), which run it under auto_axes as JAX's "
        "`.at[...].set/add/mul/...(out_sharding=)`), or reshard the operands accordingly (reshard(x, P(...)))");
    r.spec.clear();
  }
  return r;
}

// jax/_src/lax/slicing.py, _gather_reduced_rule: the table's reduced axes (each device holds the
// table whole and gathers its own copy); reduced indices are refused, and so is a reduced
// table with split indices (JAX raises NotImplementedError there).
ReducedRuleResult gather_reduced(const TypeRuleCall& c) {
  const TypedOperand &x = c.operands[0], &idx = c.operands[1];
  ReducedRuleResult r{x.reduced, "", ""};
  if (!idx.reduced.empty()) {
    r.error = absl::StrCat("gather indices cannot be reduced. Got indices sharding ",
                           type_string(idx.dtype, idx.shape, idx.spec, idx.unreduced, idx.reduced, &c.mesh), ".");
    r.fix = "reshard the indices to P(...) first (reshard(indices, P(...)) drops their reduced axes)";
  } else if (!x.reduced.empty() &&
             std::any_of(idx.spec.begin(), idx.spec.end(), [](const Axes& a) { return !a.empty(); })) {
    r.error = absl::StrCat("a gather from a table reduced over ", axis_set_repr(x.reduced),
                           " with split indices is not implemented (JAX's _gather_reduced_rule raises "
                           "NotImplementedError)");
    r.fix = "give take an out_sharding (it gathers with the axes as Auto), or reshard the indices to P(...)";
  }
  return r;
}

// jax/_src/lax/slicing.py, _scatter_ur_rule (scatter_add's only: JAX's scatter has no
// ur_rule): no reduced operand.
ReducedRuleResult scatter_add_reduced(const TypeRuleCall& c) {
  ReducedRuleResult r;
  for (const TypedOperand& o : c.operands) {
    if (o.reduced.empty()) continue;
    r.error = "reduced rule for scatter is not implemented (as JAX's _scatter_ur_rule)";
    r.fix = "reshard the reduced operand first (reshard(x, P(...)) drops its reduced axes)";
    break;
  }
  return r;
}

// jax/_src/lax/slicing.py, _scatter_unreduced_rule: the operand and the updates unreduced over
// the same axes (each device adds its term of the updates into its term of the operand: a sum
// of scatter_adds is the scatter_add of the sums), the indices not unreduced, and, when
// unreduced, not split (JAX raises NotImplementedError there). The result is unreduced alike.
UnreducedRuleResult scatter_add_unreduced(const TypeRuleCall& c) {
  const TypedOperand &x = c.operands[0], &idx = c.operands[1], &u = c.operands[2];
  UnreducedRuleResult r{x.unreduced, "", ""};
  if (!idx.unreduced.empty()) {
    r.error = absl::StrCat("scatter indices cannot be unreduced. Got indices sharding ",
                           type_string(idx.dtype, idx.shape, idx.spec, idx.unreduced, idx.reduced, &c.mesh), ".");
    r.fix = kReduceFirstFix;
  } else if (x.unreduced != u.unreduced) {
    r.error =
        absl::StrCat("scatter operand and updates must be unreduced along the same axes. Got operand sharding ",
                     type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced, &c.mesh), " and updates sharding ",
                     type_string(u.dtype, u.shape, u.spec, u.unreduced, u.reduced, &c.mesh), ".");
    r.fix = kReduceFirstFix;
  } else if (!x.unreduced.empty() &&
             std::any_of(idx.spec.begin(), idx.spec.end(), [](const Axes& a) { return !a.empty(); })) {
    r.error =
        "a scatter_add of unreduced values with split indices is not implemented (JAX's "
        "_scatter_unreduced_rule raises NotImplementedError)";
    r.fix = "reshard the indices to P(...)";
  }
  if (!r.error.empty()) r.unreduced.clear();
  return r;
}

}  // namespace

absl::Span<const ExplicitRule> placement_type_rules() {
  static const ExplicitRule kRules[] = {
      {Op::kShardingConstraint, constraint, constraint_unreduced, constraint_reduced},
      {Op::kShardingAs, sharding_as, sharding_as_unreduced, no_reduced},
      {Op::kConstant, unsplit},
      {Op::kIota, unsplit},
      {Op::kRandomBits, random_bits},
      {Op::kGather, gather, nullptr, gather_reduced},
      {Op::kScatter, scatter},  // no ur_rule in JAX: refuses unreduced and reduced operands
      {Op::kScatterAdd, scatter, scatter_add_unreduced, scatter_add_reduced},
  };
  return kRules;
}

}  // namespace tessera::internal

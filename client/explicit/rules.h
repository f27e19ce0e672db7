// Explicit sharding ("sharding in types", issue 16 item 2): on a mesh with Explicit axes a
// traced Value's type carries its sharding over those axes, and every op has a rule giving its
// result's sharding from its operands', or an error. The rules follow JAX's
// (docs/notebooks/explicit-sharding.md, "Sharding rules and operations with ambiguous
// sharding"; jax/_src/lax/lax.py's broadcasting_sharding_rule and _dot_general_sharding_rule),
// one file per op family as the compiler's rules are: explicit/{elementwise,layout,reduction,
// dot,placement,sort,control,shard_map}.cc. Each family registers, per op, its type rule and,
// for the ops an unreduced value (`f32[8,4]{U:Y}`) may go through, its unreduced rule (JAX's
// `ur_rule`s), as ExplicitRule entries. Internal to the client library.
#ifndef TESSERA_CLIENT_EXPLICIT_RULES_H_
#define TESSERA_CLIENT_EXPLICIT_RULES_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/graph.h"
#include "core/mesh.h"
#include "core/partition_spec.h"

namespace tessera::internal {

// A value's sharding in its type: the Explicit mesh axes of each dimension (one entry per
// dimension; empty: not split over an Explicit axis).
using TypeSpec = std::vector<Axes>;

struct TypedOperand {
  DType dtype;
  Shape shape;
  TypeSpec spec;
  // The Explicit mesh axes it is unreduced over (sorted; JAX's `{U:X}`): on the devices along
  // them it holds terms whose sum is its value. Empty for an ordinary value.
  std::vector<std::string> unreduced = {};
  // The Explicit mesh axes it is reduced over (sorted; JAX's `{R:X}`): laid out as a value
  // replicated over them, its cotangent is unreduced over them (JAX's P.to_ct_spec).
  std::vector<std::string> reduced = {};
};

// What a rule sees: the node (its op and attributes, the result's dtype and shape), its
// operands' types, and whether the call gave an out_sharding (which then decides the result:
// a rule may leave an ambiguous result to it instead of failing).
struct TypeRuleCall {
  const Mesh& mesh;
  const Node& node;
  std::vector<TypedOperand> operands;
  bool out_sharding_given = false;
  // The out_sharding's unreduced axes (P(..., unreduced={'X'})), when one is given.
  std::vector<std::string> out_unreduced = {};
};

// A rule's answer: the result's spec, or what is wrong ("dimension 0 is split over 'X' in one
// operand and over 'Y' in another") and how to fix it; the caller names the op and the types.
struct TypeRuleResult {
  TypeSpec spec;
  std::string error;
  std::string fix;
};
using TypeRule = TypeRuleResult (*)(const TypeRuleCall&);

// An unreduced rule's answer (JAX's `ur_rule`s, jax/_src/lax/lax.py): the result's unreduced
// axes (sorted), or what is wrong and how to fix it, worded as type_rule_error prints them.
struct UnreducedRuleResult {
  std::vector<std::string> unreduced;
  std::string error;
  std::string fix;
};
using UnreducedRule = UnreducedRuleResult (*)(const TypeRuleCall&);

// A reduced rule's answer (the reduced half of JAX's `ur_rule`s): the result's reduced axes
// (sorted), or what is wrong and how to fix it.
struct ReducedRuleResult {
  std::vector<std::string> reduced;
  std::string error;
  std::string fix;
};
using ReducedRule = ReducedRuleResult (*)(const TypeRuleCall&);

// One op's explicit-mode rules as its family registers them, as JAX's standard_primitive takes
// sharding_rule= and ur_rule=: the type rule, the unreduced rule, or none (null: the op
// refuses an unreduced operand, as JAX's unop_ur_rule / nary_ur_rule do), and the reduced rule,
// or none (null: the op refuses a reduced operand, as JAX's call_ur_rule does for a primitive
// without ur_rule).
struct ExplicitRule {
  Op op;
  TypeRule type;
  UnreducedRule unreduced = nullptr;
  ReducedRule reduced = nullptr;
};

// The families' rules.
absl::Span<const ExplicitRule> elementwise_type_rules();
absl::Span<const ExplicitRule> layout_type_rules();
absl::Span<const ExplicitRule> reduction_type_rules();
absl::Span<const ExplicitRule> dot_type_rules();
absl::Span<const ExplicitRule> placement_type_rules();
absl::Span<const ExplicitRule> sort_type_rules();
absl::Span<const ExplicitRule> control_type_rules();
absl::Span<const ExplicitRule> shard_map_type_rules();
// The rules of `op`, or null when it has none yet (then only replicated operands are accepted,
// and no unreduced one).
const ExplicitRule* find_explicit_rule(Op op);

// The rules of the composites (client/lax.cc), each on its operand's type, in its family's
// file: top_k (sort.cc), the cumulative reductions (reduction.cc), pad (layout.cc: the
// result's shape `out`).
TypeRuleResult top_k_type_rule(const TypedOperand& x, int64_t axis);
// sort's and top_k's refusal of an unreduced operand `x` (named `name`), or no error.
TypeRuleResult sorting_unreduced_rule(absl::string_view name, const TypedOperand& x);
TypeRuleResult cumulative_type_rule(absl::string_view name, const TypedOperand& x, int64_t axis);
TypeRuleResult pad_type_rule(const Mesh& mesh, const TypedOperand& x, const Shape& out);
// Whether pad keeps an unreduced operand's axes (padding_value_sums: the padding value is zero
// or unreduced over the same axes); the error and fix otherwise.
TypeRuleResult pad_unreduced_rule(const TypedOperand& x, bool padding_value_sums);
// Control flow (control.cc). The type spec of result `j` of sub-graph `g`, a body traced in
// explicit mode (which pins each result to its type; an unpinned result is unsplit).
TypeSpec body_output_spec(const Graph& g, size_t j, const Mesh& mesh);
// scan's xs must be unsplit along the scanned dimension: JAX's "0th dimension of all xs should
// be replicated. Got P(...), ..." (loops.py, _infer_scan_length).
TypeRuleResult scan_xs_type_rule(const std::vector<TypedOperand>& xs);
// Empty when the carries' types agree, else JAX's _check_carry_type message for `name`
// ("scan body", "while_loop body"), the carries at paths [k]. In a shard_map body with
// check_vma a type also has the manual axes it varies along (`in_varying`, `out_varying`: one
// list per carry, in mesh order, or empty when not in such a body); a carry that becomes
// varying gets JAX's advice to pcast its initial value.
std::string carry_type_mismatch(absl::string_view name, const std::vector<TypedOperand>& in,
                                const std::vector<TypedOperand>& out,
                                const std::vector<std::vector<std::string>>& in_varying = {},
                                const std::vector<std::vector<std::string>>& out_varying = {});
// Empty when the branches' output types agree, else JAX's _check_branch_outputs message for
// `api` ("cond", "switch") without the functions' source lines. In a shard_map body with
// check_vma a type also has the manual axes it varies along (`varying1`, `varying2`: one list
// per output, in mesh order); an output missing axes the other branch's varies along gets the
// advice to pcast it.
std::string branch_type_mismatch(absl::string_view api, absl::string_view name1, absl::string_view name2,
                                 const std::vector<TypedOperand>& out1, const std::vector<TypedOperand>& out2,
                                 const std::vector<std::vector<std::string>>& varying1 = {},
                                 const std::vector<std::vector<std::string>>& varying2 = {});
// shard_map (shard_map.cc): on a mesh of only Explicit axes the in_spec `in` must be x's type.
// Its unreduced and reduced axes must be x's too (_shard_shaped_array's errors).
TypeRuleResult shard_map_in_type_rule(const TypedOperand& x, const NamedSharding& in);
// Empty, or JAX's refusal (shard_map.py's _check_unreduced) of `spec`, one of the `kind`
// ("in", "out") specs, with unreduced or reduced axes: the body is not manual over every axis
// (`full_manual`), or an axis is not Explicit.
std::string shard_map_spec_unreduced_error(const char* kind, const Mesh& mesh, bool full_manual,
                                           const std::vector<std::string>& manual_axes, const PartitionSpec& spec);
// Empty, or JAX's refusal (_unshard_shaped_array) of an out_spec `spec` whose unreduced or
// reduced axes are not those of the body's result `out`.
std::string shard_map_out_unreduced_error(const PartitionSpec& spec, const TypedOperand& out, const Mesh& mesh);
// Whether every axis of `mesh` is Explicit: where shard_map checks in_specs against the
// arguments' types and infers omitted ones from them (client/explicit/shard_map.cc).
bool all_explicit(const Mesh& mesh);

// A composite's rule failed: INVALID_ARGUMENT "<name>: <error> (operand <type>); <fix>", as
// result_type_spec words an op's.
absl::Status type_rule_error(absl::string_view name, const std::vector<TypedOperand>& operands,
                             const TypeRuleResult& r);

// The result's type spec of `call`: the op's rule, then the checks every result gets (no mesh
// axis twice). INVALID_ARGUMENT "<op>: <what> (operands f32[8@X,4], f32[8@Y,4]); <fix>".
absl::StatusOr<TypeSpec> result_type_spec(const TypeRuleCall& call);

// The unreduced axes of `call`'s result: the op's unreduced rule (registered beside its type
// rule, in its family's file), or, for an op without one, none, and an unreduced operand is
// INVALID_ARGUMENT "<op>: unreduced rule for <op> is not implemented ... (operand
// f32[8,4]{U:Y}); reshard the unreduced operand first ..." (JAX's unop_ur_rule / nary_ur_rule).
absl::StatusOr<std::vector<std::string>> result_unreduced(const TypeRuleCall& call);
// The reduced axes of `call`'s result (client/explicit/reduced.cc): the op's reduced rule, or,
// for an op without one, none, and a reduced operand is INVALID_ARGUMENT "<op>: unreduced/reduced
// rule for <op> is not implemented ... (operand f32[8]{R:X}); reshard it to P(...) first".
absl::StatusOr<std::vector<std::string>> result_reduced(const TypeRuleCall& call);
// The reduced rules the families share: the operand's reduced axes (JAX's
// default_unop_reduced_rule: layout ops that keep the replicated layout over them), and none
// (a result that is not reduced whatever its operands, as dot_general's in JAX).
ReducedRuleResult keep_reduced(const TypeRuleCall& call);
// The refusal of an op with no reduced rule (JAX's call_ur_rule): "unreduced/reduced rule for
// <op> is not implemented ...", also for the composites JAX binds as one primitive (cumsum).
ReducedRuleResult no_reduced_rule(absl::string_view op);
// The same refusal of an unreduced operand, for an op registered in JAX without ur_rule (rev,
// argmax), whose call_ur_rule refuses unreduced and reduced operands alike: not the words of
// nary_ur_rule / unop_ur_rule, which result_unreduced gives an op without an unreduced rule.
UnreducedRuleResult no_unreduced_rule(const TypeRuleCall& call);
ReducedRuleResult no_reduced(const TypeRuleCall& call);
// JAX's default_nary_reduced_rule (jax/_src/lax/lax.py): operands reduced over one set of axes
// (or not reduced), no other operand replicated, split or unreduced over them.
ReducedRuleResult nary_reduced(const TypeRuleCall& call);
// The axes the reduced operands are reduced over, which must be one set: else `error` ("All
// inputs should be reduced across the same mesh axes. Got specs: ") and the two sets.
ReducedRuleResult common_reduced(const TypeRuleCall& call, absl::string_view error);

// `spec` of a value of rank `rank` as its type sees it: padded to the rank, only Explicit axes
// of `mesh` kept.
TypeSpec type_spec_of(const PartitionSpec& spec, const Mesh& mesh, int rank);
// "f32[16@data,8]", "f32[8@(X,Y),4]": as JAX prints a type (jax/_src/core.py,
// _get_shape_sharding_str), with Tessera's dtype names.
// With unreduced axes, "f32[2,2]{U:X}", "f32[2,2]{U:(X,Y)}" (core.py's _vma_ur_str).
// With reduced axes, "f32[8]{R:X}", "f32[8]{U:X, R:Y}". Given the mesh, each set in its axis
// order (core.py's order_wrt_mesh), else as given (sorted).
std::string type_string(DType dtype, const Shape& shape, const TypeSpec& spec,
                        const std::vector<std::string>& unreduced = {}, const std::vector<std::string>& reduced = {},
                        const Mesh* mesh = nullptr);
// The braces of a type's unreduced and reduced axes: "{U:X}", "{U:(X,Y)}", "{R:X}",
// "{U:X, R:Y}"; empty for none. `varying` (a shard_map body's manual axes) comes first, "{V:i}".
// With `mesh_axes` (the mesh's axis names in order) each set is printed in that order.
std::string unreduced_string(const std::vector<std::string>& unreduced, const std::vector<std::string>& reduced = {},
                             const std::vector<std::string>& mesh_axes = {},
                             const std::vector<std::string>& varying = {});
// The spec as a PartitionSpec, one entry per dimension.
inline PartitionSpec to_partition_spec(const TypeSpec& spec) { return PartitionSpec(spec); }

// `spec` with `axes` taken out of every dimension (auto_axes, explicit_axes: the axes that
// are Auto there or again).
void without_axes(TypeSpec& spec, const std::vector<std::string>& axes);

// The elementwise rule, also concatenate's: each dimension takes the one split its operands
// give it; an unsplit dimension meets any split, two different splits are an error.
TypeRuleResult consensus(const TypeRuleCall& call);

// Shared by the families: "reshard(x, P(...)) an operand first" and friends.
inline constexpr const char* kReshardFix = "reshard an operand first (reshard(x, P(...)))";
inline constexpr const char* kReduceFirstFix =
    "reshard the unreduced operand first (reshard(x, P(...)) runs its sum: an all-reduce, or a reduce-scatter onto a "
    "split dimension)";

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_EXPLICIT_RULES_H_

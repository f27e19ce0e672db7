// Explicit-mode sharding rules of control flow, as JAX's (jax/_src/lax/control_flow/): a
// carry's sharding is part of its type, so a body must give each carry back with the type it
// got (loops.py, _check_carry_type: "scan body function carry input and carry output must have
// equal types"); scan's xs enter split along their leading dimension by the scan, each row
// typed as its xs without that dimension (core.py, _map_shaped_array), and an xs whose leading
// dimension is split is an error (loops.py, _infer_scan_length: "0th dimension of all xs
// should be replicated"); the stacked ys are the body's result types with an unsplit leading
// dimension (_unmap_shaped_array with no mesh axis, in _scan_abstract_eval); cond/switch
// branches must agree on their output types (conditionals.py, _check_branch_outputs), which
// are the results' types. while_loop and fori_loop are scan's carry rule; checkpoint is a
// one-branch switch.
//
// A body traced in explicit mode pins each result to its type (trace.cc), so the sub-graphs
// carry their result types as those constraints: body_output_spec reads them back, which lets
// a scan or switch node be typed again wherever its graph is inlined.
#include <algorithm>
#include <cctype>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit/rules.h"
#include "core/op_attrs.h"

namespace tessera::internal {
namespace {

// JAX's list of differences: one is a sentence, several a bullet list ("  * a;\n\n  * b.\n"
// for carries, "  * a;\n  * b.\n" for branch outputs).
std::string differences(std::vector<std::string> diffs, const char* between) {
  if (diffs.size() == 1) {
    diffs[0][0] = static_cast<char>(std::toupper(static_cast<unsigned char>(diffs[0][0])));
    return absl::StrCat(diffs[0], ".\n");
  }
  std::string out;
  for (size_t i = 0; i + 1 < diffs.size(); ++i) absl::StrAppend(&out, "  * ", diffs[i], ";", between);
  return absl::StrCat(out, "  * ", diffs.back(), ".\n");
}

// core.py's aval_mismatch_extra: what differs besides the sharding (which it leaves unsaid).
std::string mismatch_extra(const TypedOperand& a, const TypedOperand& b, bool manual_axis_types_differ = false) {
  std::vector<std::string> m;
  if (a.dtype != b.dtype) m.push_back("the dtypes do not match");
  if (a.shape != b.shape) m.push_back("the shapes do not match");
  if (manual_axis_types_differ) m.push_back("the manual axis types do not match");
  if (m.empty()) return "";
  if (m.size() == 1) return ", so " + m[0];
  const std::string last = m.back();
  m.pop_back();
  return absl::StrCat(", so ", absl::StrJoin(m, ", "), ", and ", last);
}

// core.py's typematch: in explicit mode the whole sharding, its unreduced and reduced axes too
// (cmp_shape_shd_mat_memsp compares the NamedShardings, whose specs carry them).
bool same_type(const TypedOperand& a, const TypedOperand& b) {
  return a.dtype == b.dtype && a.shape == b.shape && a.spec == b.spec && a.unreduced == b.unreduced &&
         a.reduced == b.reduced;
}

std::string type_text(const TypedOperand& x) { return type_string(x.dtype, x.shape, x.spec, x.unreduced, x.reduced); }

// The unreduced and reduced axes of result `j` of body `g` (what its result is pinned to).
PartitionSpec body_output_pin(const Graph& g, size_t j) {
  const Node& n = g.node(g.outputs()[j]);
  return n.op == Op::kShardingConstraint ? n.attrs<ShardingAttrs>().sharding.spec() : PartitionSpec();
}

// Result `output` of a scan: a carry is of its initial value's type (the body gives it back
// alike: checked when traced), a stacked ys of the body's result's (core.py's
// _unmap_shaped_array inserts the new dimension's partition only, keeping the unreduced and
// reduced axes).
PartitionSpec scan_result_pin(const TypeRuleCall& c) {
  const ScanAttrs& a = c.node.attrs<ScanAttrs>();
  if (a.output < a.num_carry) {
    const TypedOperand& carry = c.operands[a.output];
    return PartitionSpec().with_unreduced(carry.unreduced).with_reduced(carry.reduced);
  }
  return body_output_pin(*a.body, static_cast<size_t>(a.output));
}

UnreducedRuleResult scan_unreduced(const TypeRuleCall& c) { return {scan_result_pin(c).unreduced(), "", ""}; }
ReducedRuleResult scan_reduced(const TypeRuleCall& c) { return {scan_result_pin(c).reduced(), "", ""}; }

// while_loop(carry..., consts...): each result is its carry, of the carry's type.
UnreducedRuleResult while_unreduced(const TypeRuleCall& c) {
  return {c.operands[c.node.attrs<BranchesAttrs>().output].unreduced, "", ""};
}
ReducedRuleResult while_reduced(const TypeRuleCall& c) {
  return {c.operands[c.node.attrs<BranchesAttrs>().output].reduced, "", ""};
}

// switch(index, operands...): the branches' output type (conditionals.py's _cond_abstract_eval
// returns branches[0].out_avals; they agree: checked when traced). An unreduced index is a sum
// not yet taken: each device would pick a branch by its own term.
UnreducedRuleResult switch_unreduced(const TypeRuleCall& c) {
  const BranchesAttrs& a = c.node.attrs<BranchesAttrs>();
  if (!c.operands[0].unreduced.empty()) {
    return {{},
            "the index is unreduced (a sum over devices not yet taken, which would pick a branch per device by its "
            "own term)",
            kReduceFirstFix};
  }
  return {body_output_pin(*a.graphs[0], static_cast<size_t>(a.output)).unreduced(), "", ""};
}
ReducedRuleResult switch_reduced(const TypeRuleCall& c) {
  const BranchesAttrs& a = c.node.attrs<BranchesAttrs>();
  return {body_output_pin(*a.graphs[0], static_cast<size_t>(a.output)).reduced(), "", ""};
}

TypeRuleResult scan(const TypeRuleCall& c) {
  const ScanAttrs& a = c.node.attrs<ScanAttrs>();
  TypeRuleResult r = scan_xs_type_rule(
      std::vector<TypedOperand>(c.operands.begin() + static_cast<std::ptrdiff_t>(a.num_carry), c.operands.end()));
  if (!r.error.empty()) return r;
  if (a.output < a.num_carry) {
    r.spec = c.operands[a.output].spec;  // a carry keeps its type (checked when traced)
    return r;
  }
  r.spec = body_output_spec(*a.body, static_cast<size_t>(a.output), c.mesh);
  r.spec.insert(r.spec.begin(), Axes{});
  return r;
}

// while_loop(carry...): each result is its carry, of the carry's type.
TypeRuleResult while_loop(const TypeRuleCall& c) {
  return TypeRuleResult{c.operands[c.node.attrs<BranchesAttrs>().output].spec, "", ""};
}

// switch(index, operands...): the branches' output type (they agree: checked when traced).
TypeRuleResult switch_(const TypeRuleCall& c) {
  const BranchesAttrs& a = c.node.attrs<BranchesAttrs>();
  return TypeRuleResult{body_output_spec(*a.graphs[0], static_cast<size_t>(a.output), c.mesh), "", ""};
}

}  // namespace

TypeSpec body_output_spec(const Graph& g, size_t j, const Mesh& mesh) {
  const Node& n = g.node(g.outputs()[j]);
  const int rank = static_cast<int>(n.shape.size());
  if (n.op != Op::kShardingConstraint) return TypeSpec(rank);
  return type_spec_of(n.attrs<ShardingAttrs>().sharding.spec(), mesh, rank);
}

TypeRuleResult scan_xs_type_rule(const std::vector<TypedOperand>& xs) {
  TypeRuleResult r;
  bool split = false;
  std::vector<std::string> specs;
  for (const TypedOperand& x : xs) {
    split = split || (!x.spec.empty() && !x.spec[0].empty());
    specs.push_back(to_partition_spec(x.spec).to_string());
  }
  if (split) {
    r.error = absl::StrCat("0th dimension of all xs should be replicated. Got ", absl::StrJoin(specs, ", "));
    r.fix = "reshard the xs so that the scanned dimension is not split (reshard(xs, P(None, ...)))";
  }
  return r;
}

namespace {

// List k of `v`, or none past its end.
const std::vector<std::string>& varying(const std::vector<std::vector<std::string>>& v, size_t k) {
  static const std::vector<std::string> kNone;
  return k < v.size() ? v[k] : kNone;
}

// x's type with the manual axes it varies along, as jax/_src/core.py's _vma_ur_str: {V:i}, or
// {V:(i,j)} for several.
std::string text(const TypedOperand& x, const std::vector<std::string>& axes) {
  if (axes.empty()) return type_text(x);
  return absl::StrCat(type_string(x.dtype, x.shape, x.spec), unreduced_string(x.unreduced, x.reduced, {}, axes));
}

// The axes of `of` not in `in`, as a Python tuple: ('i',) or ('i', 'j'); empty when none.
std::string missing_axes(const std::vector<std::string>& of, const std::vector<std::string>& in) {
  std::vector<std::string> missing;
  for (const std::string& a : of) {
    if (std::find(in.begin(), in.end(), a) == in.end()) missing.push_back("'" + a + "'");
  }
  if (missing.empty()) return "";
  return missing.size() == 1 ? absl::StrCat("(", missing[0], ",)")
                             : absl::StrCat("(", absl::StrJoin(missing, ", "), ")");
}

// loops.py's and conditionals.py's advice: "This might be fixed by ..." and the notebook's link.
std::string pcast_advice(const std::vector<std::string>& pcasts, const char* between) {
  std::string advice;
  if (pcasts.size() == 1) {
    advice = absl::StrCat("This might be fixed by ", pcasts[0], ".\n");
  } else if (!pcasts.empty()) {
    advice = "This might be fixed by:\n";
    for (size_t i = 0; i + 1 < pcasts.size(); ++i) absl::StrAppend(&advice, "  * ", pcasts[i], ";", between);
    absl::StrAppend(&advice, "  * ", pcasts.back(), ".\n");
  }
  if (!advice.empty()) {
    absl::StrAppend(&advice,
                    "See https://docs.jax.dev/en/latest/notebooks/shard_map.html#scan-vma for more information.\n\n");
  }
  return advice;
}

}  // namespace

std::string carry_type_mismatch(absl::string_view name, const std::vector<TypedOperand>& in,
                                const std::vector<TypedOperand>& out,
                                const std::vector<std::vector<std::string>>& in_varying,
                                const std::vector<std::vector<std::string>>& out_varying) {
  std::vector<std::string> diffs, pcasts;
  for (size_t k = 0; k < in.size() && k < out.size(); ++k) {
    const std::vector<std::string>&vin = varying(in_varying, k), &vout = varying(out_varying, k);
    if (same_type(in[k], out[k]) && vin == vout) continue;
    const std::string extra = mismatch_extra(in[k], out[k], vin != vout);
    const std::string path = absl::StrCat("the input carry at path [", k, "]");
    diffs.push_back(absl::StrCat(path, " has type ", text(in[k], vin),
                                 " but the corresponding output carry component has type ", text(out[k], vout), extra));
    // loops.py: the axes the output varies along and the input does not, pcast onto the input.
    const std::string axes = missing_axes(vout, vin);
    if (axes.empty()) continue;
    pcasts.push_back(absl::StrCat("applying `jax.lax.pcast(..., ", axes,
                                  ", to='varying')`, to the initial carry value corresponding to ", path));
  }
  if (diffs.empty()) return "";
  return absl::StrCat(name, " function carry input and carry output must have equal types, but they differ:\n\n",
                      differences(std::move(diffs), "\n\n"), "\n", pcast_advice(pcasts, "\n"),
                      "Revise the function so that all output types match the corresponding input types.");
}

std::string branch_type_mismatch(absl::string_view api, absl::string_view name1, absl::string_view name2,
                                 const std::vector<TypedOperand>& out1, const std::vector<TypedOperand>& out2,
                                 const std::vector<std::vector<std::string>>& varying1,
                                 const std::vector<std::vector<std::string>>& varying2) {
  std::vector<std::string> diffs, pcasts;
  for (size_t j = 0; j < out1.size() && j < out2.size(); ++j) {
    const std::vector<std::string>&v1 = varying(varying1, j), &v2 = varying(varying2, j);
    if (same_type(out1[j], out2[j]) && v1 == v2) continue;
    diffs.push_back(absl::StrCat("the output of ", name1, " at path [", j, "] has type ", text(out1[j], v1),
                                 " but the corresponding output of ", name2, " has type ", text(out2[j], v2),
                                 mismatch_extra(out1[j], out2[j], v1 != v2)));
    // conditionals.py: each branch's output is advised to be pcast along the axes the other
    // one's varies along and it does not. (JAX's list comprehension gives an empty tuple to the
    // wrong branch when only one side lacks axes; this names the branch that lacks them.)
    for (const auto& [name, own, other] : {std::tuple{name1, &v1, &v2}, std::tuple{name2, &v2, &v1}}) {
      const std::string axes = missing_axes(*other, *own);
      if (axes.empty()) continue;
      pcasts.push_back(absl::StrCat("applying `jax.lax.pcast(..., ", axes, ", to='varying')` to the output of ", name,
                                    " at path [", j, "]"));
    }
  }
  if (diffs.empty()) return "";
  return absl::StrCat(api, " branches must have equal output types but they differ.\n\n",
                      differences(std::move(diffs), "\n"), "\n", pcast_advice(pcasts, "\n"), "Revise ", name1,
                      " and/or ", name2, " so that all output types match.");
}

absl::Span<const ExplicitRule> control_type_rules() {
  static const ExplicitRule kRules[] = {
      {Op::kScan, scan, scan_unreduced, scan_reduced},
      {Op::kWhile, while_loop, while_unreduced, while_reduced},
      {Op::kSwitch, switch_, switch_unreduced, switch_reduced},
  };
  return kRules;
}

}  // namespace tessera::internal

#include "client/explicit/rules.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera::internal {

const ExplicitRule* find_explicit_rule(Op op) {
  // shard_map's first: pvary is also kElementwise, which the elementwise family takes by trait,
  // but its reduced rule (reduced_vary_cast) is shard_map's.
  for (auto family : {shard_map_type_rules, elementwise_type_rules, layout_type_rules, reduction_type_rules,
                      dot_type_rules, placement_type_rules, sort_type_rules, control_type_rules}) {
    for (const ExplicitRule& rule : family()) {
      if (rule.op == op) return &rule;
    }
  }
  return nullptr;
}

TypeRuleResult consensus(const TypeRuleCall& c) {
  TypeRuleResult r;
  r.spec.assign(c.node.shape.size(), Axes{});
  for (size_t d = 0; d < r.spec.size(); ++d) {
    for (const TypedOperand& o : c.operands) {
      if (d >= o.spec.size() || o.spec[d].empty()) continue;
      if (r.spec[d].empty()) {
        r.spec[d] = o.spec[d];
      } else if (r.spec[d] != o.spec[d]) {
        r.error = absl::StrCat("dimension ", d, " is split over ", axes_to_string(r.spec[d]),
                               " in one operand and over ", axes_to_string(o.spec[d]), " in another");
        r.fix = "reshard one operand to the other's sharding (reshard(x, P(...)))";
        return r;
      }
    }
  }
  return r;
}

void without_axes(TypeSpec& spec, const std::vector<std::string>& axes) {
  if (axes.empty()) return;
  for (Axes& a : spec) {
    a.erase(std::remove_if(a.begin(), a.end(),
                           [&](const std::string& x) { return std::find(axes.begin(), axes.end(), x) != axes.end(); }),
            a.end());
  }
}

TypeSpec type_spec_of(const PartitionSpec& spec, const Mesh& mesh, int rank) {
  TypeSpec out(rank);
  for (int d = 0; d < rank; ++d) {
    for (const std::string& a : spec.axes(d)) {
      const int i = mesh.axis_index(a);
      if (i >= 0 && mesh.axis_types()[i] == AxisType::kExplicit) out[d].push_back(a);
    }
  }
  return out;
}

std::string unreduced_string(const std::vector<std::string>& unreduced, const std::vector<std::string>& reduced,
                             const std::vector<std::string>& mesh_axes, const std::vector<std::string>& varying) {
  // As jax/_src/core.py's _vma_ur_str: "V:i", "U:X", "R:(X,Y)", joined by ", " in braces, each
  // set in the mesh's order (order_wrt_mesh).
  auto part = [&](const char* prefix, std::vector<std::string> axes) {
    if (!mesh_axes.empty()) {
      auto rank = [&](const std::string& a) {
        return std::find(mesh_axes.begin(), mesh_axes.end(), a) - mesh_axes.begin();
      };
      std::stable_sort(axes.begin(), axes.end(),
                       [&](const std::string& a, const std::string& b) { return rank(a) < rank(b); });
    }
    const std::string joined = absl::StrJoin(axes, ",");
    return absl::StrCat(prefix, ":", axes.size() == 1 ? joined : absl::StrCat("(", joined, ")"));
  };
  std::vector<std::string> parts;
  if (!varying.empty()) parts.push_back(part("V", varying));
  if (!unreduced.empty()) parts.push_back(part("U", unreduced));
  if (!reduced.empty()) parts.push_back(part("R", reduced));
  if (parts.empty()) return "";
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::string type_string(DType dtype, const Shape& shape, const TypeSpec& spec,
                        const std::vector<std::string>& unreduced, const std::vector<std::string>& reduced,
                        const Mesh* mesh) {
  std::string name = type_to_string(dtype, {});
  name.resize(name.size() - 2);  // "f32[]" -> "f32"
  std::vector<std::string> dims;
  for (size_t d = 0; d < shape.size(); ++d) {
    const Axes none;
    const Axes& axes = d < spec.size() ? spec[d] : none;
    if (axes.empty()) {
      dims.push_back(absl::StrCat(shape[d]));
    } else if (axes.size() == 1) {
      dims.push_back(absl::StrCat(shape[d], "@", axes[0]));
    } else {
      dims.push_back(absl::StrCat(shape[d], "@(", absl::StrJoin(axes, ","), ")"));
    }
  }
  return absl::StrCat(
      name, "[", absl::StrJoin(dims, ","), "]",
      unreduced_string(unreduced, reduced, mesh == nullptr ? std::vector<std::string>{} : mesh->axis_names()));
}

absl::Status type_rule_error(absl::string_view name, const std::vector<TypedOperand>& operands,
                             const TypeRuleResult& r) {
  std::vector<std::string> types;
  for (const TypedOperand& o : operands) {
    types.push_back(type_string(o.dtype, o.shape, o.spec, o.unreduced, o.reduced));
  }
  return absl::InvalidArgumentError(absl::StrCat(name, ": ", r.error, " (operand", types.size() == 1 ? " " : "s ",
                                                 absl::StrJoin(types, ", "), "); ", r.fix));
}

absl::StatusOr<TypeSpec> result_type_spec(const TypeRuleCall& call) {
  const Node& n = call.node;
  auto fail = [&](const std::string& what, const std::string& fix) {
    return type_rule_error(op_name(n.op), call.operands, TypeRuleResult{{}, what, fix});
  };
  TypeRuleResult r;
  if (const ExplicitRule* rule = find_explicit_rule(n.op)) {
    r = rule->type(call);
  } else {
    // No rule yet: replicated operands give a replicated result, anything else is refused
    // rather than guessed.
    r.spec.assign(n.shape.size(), Axes{});
    for (const TypedOperand& o : call.operands) {
      for (const Axes& a : o.spec) {
        if (!a.empty()) {
          r.error = "has no explicit-sharding rule yet, and an operand is split over an Explicit mesh axis";
          r.fix = "reshard it to P() first, or make that mesh axis Auto";
        }
      }
    }
  }
  if (!r.error.empty()) return fail(r.error, r.fix);
  r.spec.resize(n.shape.size());
  std::set<std::string> seen;
  for (const Axes& axes : r.spec) {
    for (const std::string& a : axes) {
      if (!seen.insert(a).second) {
        // JAX's wording (docs/notebooks/explicit-sharding.ipynb): "add operation with inputs:
        // i32[4@X,4], i32[4,4@X] produces an illegally sharded result: i32[4@X,4@X]".
        std::vector<std::string> types;
        for (const TypedOperand& o : call.operands) types.push_back(type_string(o.dtype, o.shape, o.spec));
        return absl::InvalidArgumentError(
            absl::StrCat(op_name(n.op), " operation with inputs: ", absl::StrJoin(types, ", "),
                         " produces an illegally sharded result: ", type_string(n.dtype, n.shape, r.spec),
                         " (mesh axis '", a, "' twice); ", kReshardFix));
      }
    }
  }
  // A split must divide its dimension, as NamedSharding::validate requires of any layout.
  for (size_t d = 0; d < r.spec.size(); ++d) {
    if (r.spec[d].empty()) continue;
    const int64_t blocks = call.mesh.axes_size(r.spec[d]);
    if (n.shape[d] % blocks != 0) {
      return fail(absl::StrCat("the result would be ", type_string(n.dtype, n.shape, r.spec), ", but dimension ", d,
                               " (", n.shape[d], ") does not divide into ", blocks, " blocks"),
                  kReshardFix);
    }
  }
  return r.spec;
}

}  // namespace tessera::internal

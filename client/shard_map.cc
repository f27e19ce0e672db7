#include "tessera/shard_map.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/trace_state.h"
#include "core/axis_set_repr.h"
#include "core/pvary_cast.h"
#include "tessera/mesh_context.h"

namespace tessera {

using internal::normalize_axis;
using internal::TraceState;

namespace {

std::string axes_text(const Axes& axes) {
  return axes.size() == 1 ? absl::StrCat("'", axes[0], "'") : axes_to_string(axes);
}

// "psum(f32[4,8], 'data')": how errors name a collective call.
std::string call_text(const char* fn, const Value& x, const AxisNames& axes) {
  return absl::StrCat(fn, "(", type_to_string(x.dtype(), x.shape()), ", ", axes_text(axes.names), ")");
}

// The mesh of the innermost shard_map body being traced, or null after failing the trace.
const Mesh* manual_mesh(TraceState* t, const std::string& call) {
  if (t->manual_meshes.empty()) {
    t->fail(absl::InvalidArgumentError(
        absl::StrCat(call,
                     ": collectives and axis queries work only inside a shard_map body, which binds the mesh "
                     "axes they name")));
    return nullptr;
  }
  return &t->manual_meshes.back();
}

// False after failing the trace when `axes` names an axis of the body's mesh that the body is
// not manual over (shard_map's axis_names): JAX binds only the manual axes for collectives.
bool only_manual_axes(TraceState* t, const Axes& axes, const std::string& call) {
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr) return false;
  const std::vector<std::string>& manual = t->manual_axes.back();
  for (const std::string& a : axes) {
    if (mesh->axis_index(a) < 0 || std::find(manual.begin(), manual.end(), a) != manual.end()) continue;
    t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": unbound axis name: ", a,
                                                    " (the shard_map body is manual over ", axes_to_string(manual),
                                                    " only, its axis_names; '", a, "' is automatic there)")));
    return false;
  }
  return true;
}

bool auto_pvary_takes(TraceState* t, const Value& x, const AxisNames& axes, bool takes_unreduced,
                      const std::string& call);

// A collective node over `axes`, after JAX's auto pvary (`auto_pvary`: false for
// all_gather(to='reduced'), which binds all_gather_reduced on x as it is).
Value collective(Op op, const Value& x, const AxisNames& axes, std::vector<int64_t> dims, ReduceOp reduce_op,
                 const std::string& call, bool auto_pvary = true) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return Value();
  // psum, pmax, pmin and psum_scatter of a value unreduced over their axes are its pending
  // reduction (unreduced_psum, ...: _get_from's 'unreduced'), which their type rules check.
  const bool reduces = op == Op::kAllReduce || op == Op::kReduceScatter;
  if (auto_pvary && !auto_pvary_takes(t, x, axes, reduces, call)) return Value();
  absl::StatusOr<int> id =
      t->graph.add_collective(op, TraceState::id(x), *mesh, axes.names, std::move(dims), reduce_op);
  if (!id.ok()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", id.status().message())));
  return t->make(*id);
}

// The axes' total size on the innermost body's mesh, or nullopt after failing the trace.
std::optional<int64_t> group_size(TraceState* t, const AxisNames& axes, const std::string& call) {
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return std::nullopt;
  for (const std::string& a : axes.names) {
    if (mesh->axis_index(a) < 0) {
      t->fail(
          absl::InvalidArgumentError(absl::StrCat(call, ": axis '", a, "' is not in the mesh ", mesh->to_string())));
      return std::nullopt;
    }
  }
  return mesh->axes_size(axes.names);
}

using internal::Variance;

// JAX's rule for the varying manual axes of each op that changes them (the table of
// collectives in docs/notebooks/shard_map.md; the abstract evals of jax/_src/lax/parallel.py):
// an `invariant` op's result is the same on every device along its axes (psum: Varying ->
// Invariant); the others' results vary along theirs. Any other op's result varies along the
// union of its operands' axes.
struct VaryingRule {
  Op op;
  bool invariant;
  const char* call;    // the JAX function that makes such a node, for messages
  const char* effect;  // why its result varies
};
constexpr VaryingRule kVaryingRules[] = {
    {Op::kAllReduce, true, "psum", ""},
    // Its devices hold the same values, but JAX types the result as varying (Varying ->
    // Varying in the table: all_gather is psum_scatter's transpose), and so does this.
    {Op::kAllGather, false, "all_gather", "whose result JAX types as varying along it"},
    {Op::kReduceScatter, false, "psum_scatter", "which differs along it"},
    {Op::kAllToAll, false, "all_to_all", "which differs along it"},
    // JAX types the result as its `output` operand (_ragged_all_to_all_effectful_abstract_eval
    // returns output.update(...)), but it holds what other devices along the axes sent: it
    // differs along them, as the collective table's all_to_all does.
    {Op::kRaggedAllToAll, false, "ragged_all_to_all", "which differs along it"},
    {Op::kCollectivePermute, false, "ppermute", "which differs along it"},
    {Op::kAxisIndex, false, "axis_index", "which differs along it"},
    {Op::kPvary, false, "pvary", "which types it as varying along it"},
};

const VaryingRule* varying_rule(Op op) {
  for (const VaryingRule& r : kVaryingRules) {
    if (r.op == op) return &r;
  }
  return nullptr;
}

// The mesh axes a node with a varying rule acts over (axis_index's attributes, or a
// collective's and pvary's).
const std::vector<std::string>& node_axes(const Node& n) {
  if (const auto* a = std::get_if<AxisIndexAttrs>(&n.attributes)) return a->axes;
  return n.attrs<CollectiveAttrs>().axes;
}

// Adds to `var` how each value of `g` from `start` on may differ between devices along each
// mesh axis, and why, from its operands' (already in `var`) by the rules above. A scan's or a
// while_loop's carry result varies as its carry (a body must give a carry back with the type
// it got, checked when traced: carry_type_mismatch), a scan's row result as the body computes
// it. An axis of a pvary
// in `inserted` (insert_pvary's) varies for the reason given there.
void propagate_variance(const Graph& g, int start, std::map<int, Variance>& var,
                        const std::map<int, Variance>* inserted = nullptr) {
  for (int id = start; id < g.size(); ++id) {
    const Node& n = g.node(id);
    Variance& v = var[id];
    if (const auto* scan = std::get_if<ScanAttrs>(&n.attributes)) {
      if (scan->output < scan->num_carry) {
        v = var[n.operands[scan->output]];
        continue;
      }
      // The body's parameters are the node's operands (carries, loop invariants, rows).
      std::map<int, Variance> inner;
      for (size_t i = 0; i < scan->body->parameters().size() && i < n.operands.size(); ++i) {
        inner[scan->body->parameters()[i]] = var[n.operands[i]];
      }
      propagate_variance(*scan->body, 0, inner);
      v = inner[scan->body->outputs()[scan->output]];
      continue;
    }
    if (n.op == Op::kWhile || n.op == Op::kSwitch) {
      // A while loop's result j is carry j (its loop invariants carried unchanged); a switch's
      // is what its branches make of the operands after the index. Both also vary as the
      // predicate or index: a device leaving the loop or taking a branch of its own computes a
      // value of its own. (JAX types these results by the carries and the branches only:
      // _while_loop_abstract_eval and _cond_abstract_eval in jax/_src/lax/control_flow, so its
      // test_cond_rep_rule accepts out_specs=P('x') on a cond whose predicate varies along
      // 'y'. Tessera's check is that a result is the same on every device its out_spec leaves
      // out, so it counts the predicate.)
      const BranchesAttrs& b = n.attrs<BranchesAttrs>();
      const bool is_while = n.op == Op::kWhile;
      const size_t first = is_while ? 0 : 1;  // where the graphs' parameters start among the operands
      if (is_while) v = var[n.operands[b.output]];
      for (size_t k = 0; k < b.graphs.size(); ++k) {
        const Graph& sub = *b.graphs[k];
        const bool predicate = is_while && k == 0;
        if (is_while && !predicate) continue;  // the body: its carry keeps its type (checked when traced)
        std::map<int, Variance> inner;
        for (size_t i = 0; i < sub.parameters().size() && first + i < n.operands.size(); ++i) {
          inner[sub.parameters()[i]] = var[n.operands[first + i]];
        }
        propagate_variance(sub, 0, inner);
        const Variance& out = inner[sub.outputs()[predicate ? 0 : b.output]];
        for (const auto& [axis, why] : out) {
          v.emplace(axis, predicate ? absl::StrCat("the while_loop's predicate varies along it: ", why) : why);
        }
      }
      if (!is_while) {
        for (const auto& [axis, why] : var[n.operands[0]]) {
          v.emplace(axis, absl::StrCat("the switch's index varies along it: ", why));
        }
      }
      continue;
    }
    for (int o : n.operands) {
      auto it = var.find(o);
      if (it != var.end()) v.insert(it->second.begin(), it->second.end());
    }
    // A shard_map nested in this body: its arguments vary along their in_specs' axes too, its
    // results no longer along the axes it made manual (its out_specs say how they are laid
    // out along them; jax/_src/shard_map.py's _unshard_shaped_array).
    if (n.op == Op::kShardMapIn) {
      const PartitionSpec& spec = n.attrs<ShardingAttrs>().sharding.spec();
      for (const std::string& a : spec.used_axes()) {
        v[a] = absl::StrCat("a nested shard_map's in_spec ", spec.to_string(), " splits it over it");
      }
      continue;
    }
    if (n.op == Op::kShardMapOut) {
      const ShardingAttrs& attrs = n.attrs<ShardingAttrs>();
      for (const std::string& a : attrs.manual_axes.empty() ? attrs.sharding.mesh().axis_names() : attrs.manual_axes) {
        v.erase(a);
      }
      continue;
    }
    // pcast to unreduced or reduced (core/pvary_cast.h): the value no longer varies along its
    // axes (vary_unreduced_cast: Varying -> Unreduced; preduced and all_gather(to='reduced'):
    // -> Reduced).
    if (n.op == Op::kPvary && n.attrs<CollectiveAttrs>().dimension != static_cast<int64_t>(PvaryCast::kVarying)) {
      for (const std::string& a : n.attrs<CollectiveAttrs>().axes) v.erase(a);
      continue;
    }
    const VaryingRule* rule = varying_rule(n.op);
    if (rule == nullptr) continue;
    const std::vector<std::string>& axes = node_axes(n);
    const auto why = inserted == nullptr ? nullptr : [&]() -> const Variance* {
      auto it = inserted->find(id);
      return it == inserted->end() ? nullptr : &it->second;
    }();
    for (const std::string& a : axes) {
      if (rule->invariant) {
        v.erase(a);
      } else if (why != nullptr && why->count(a) > 0) {
        v[a] = why->at(a);
      } else {
        v[a] = absl::StrCat("it depends on ", rule->call, " over ", axes_text(axes), ", ", rule->effect);
      }
    }
  }
}

// How each value of a body may differ between devices along each mesh axis, and why: its
// arguments `inputs` (shard_map_in nodes: along the axes their in_specs name) and the values
// from `start` on (a value lifted into the body is a shard_map_in of P(): along none).
std::map<int, Variance> body_variance(const Graph& g, int start, const std::vector<int>& inputs,
                                      const std::map<int, Variance>* inserted = nullptr,
                                      const std::map<int, Variance>& seeds = {}) {
  std::map<int, Variance> var = seeds;  // a nested body's parameters (TraceState::ManualBody)
  for (size_t i = 0; i < inputs.size(); ++i) {
    const PartitionSpec& spec = g.node(inputs[i]).attrs<ShardingAttrs>().sharding.spec();
    for (const std::string& a : spec.used_axes()) {
      var[inputs[i]][a] = absl::StrCat("argument ", i, " is split over it by its in_spec ", spec.to_string());
    }
  }
  propagate_variance(g, start, var, inserted);
  return var;
}

}  // namespace

namespace internal {

// What the body is; shared by the traced and the jitted entry points.
struct ShardMapBody {
  ShardMapBody(TracedFunction f, Mesh mesh, std::vector<PartitionSpec> in_specs, std::vector<PartitionSpec> out_specs,
               bool check_vma, std::vector<std::string> axis_names, bool out_specs_for_all)
      : f(std::move(f)),
        mesh(std::move(mesh)),
        in_specs(std::move(in_specs)),
        out_specs(std::move(out_specs)),
        check_vma(check_vma),
        axis_names(std::move(axis_names)),
        out_specs_for_all(out_specs_for_all) {}

  TracedFunction f;
  Mesh mesh;
  std::vector<PartitionSpec> in_specs, out_specs;
  bool check_vma;
  std::vector<std::string> axis_names;  // as given: empty is every axis
  bool out_specs_for_all;               // ShardMapOptions::out_specs_for_all

  std::vector<Value> operator()(const std::vector<Value>& args) const;

 private:
  // Checks that each result is the same on every device along the axes its out_spec leaves
  // out, tracking for every body value the axes it may differ along and why.
  absl::Status check_replication(const Graph& g, int body_start, const std::vector<int>& in_ids,
                                 const std::vector<int>& results, const std::vector<PartitionSpec>& outs,
                                 const std::vector<std::string>& manual, const std::map<int, Variance>& inserted_pvary,
                                 const std::map<int, Variance>& seeds) const;
  // The axes the body makes manual, in mesh order (axis_names, or all, less the `enclosing`
  // bodies' manual axes and the Explicit axes an enclosing vmap maps over, `vmapped`), or
  // INVALID_ARGUMENT naming an axis that is not the mesh's, axis_names naming a vmapped axis, or
  // when none is left; then that every spec names only those, as jax/_src/shard_map.py's
  // _shmap_checks and _check_specs (and not an enclosing body's axis).
  absl::StatusOr<std::vector<std::string>> manual_axes(const std::vector<PartitionSpec>& specs,
                                                       const std::vector<std::string>& enclosing,
                                                       const std::vector<std::string>& vmapped) const;
};

}  // namespace internal

using internal::ShardMapBody;

struct ShardMapped::State {
  std::shared_ptr<const ShardMapBody> body;
  std::optional<Jitted> jitted;
};

std::vector<Value> ShardMapBody::operator()(const std::vector<Value>& given) const {
  std::vector<Value> failed(out_specs.size());
  TraceState* t = TraceState::current;
  // Inside a control-flow body (a scan's, a fori_loop's), an argument of an enclosing trace is
  // captured into the body first, as every op's operands are.
  std::vector<Value> args = given;
  for (Value& a : args) {
    a = TraceState::local(a);
    if (!a.ok()) return failed;  // a failed argument, or its capture failed (the error recorded)
    t = TraceState::of(a);
  }
  if (t == nullptr) return failed;  // not tracing: nothing to record the error in
  auto fail = [&](const std::string& message) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("shard_map: ", message)));
    return failed;
  };
  // Inside a shard_map body, a shard_map over the axes it left automatic (JAX's nested
  // shard_map, tests/shard_map_test.py test_nested_partial_auto): the body is manual over
  // both, the mesh is the enclosing body's (JAX's "context mesh"). So too inside a control-flow
  // body (scan, while_loop, cond) of a shard_map body, whose trace carries the enclosing body's
  // mesh and manual axes (its `nested` entry): the boundaries go into the loop's or branch's
  // graph, which the compiler compiles as a program of its own, run once per iteration.
  std::vector<std::string> enclosing;
  if (!t->manual_meshes.empty()) {
    if (mesh != t->manual_meshes.back()) {
      // jax/_src/shard_map.py's _shmap_checks, its words.
      return fail(absl::StrCat("The context mesh ", t->manual_meshes.back().to_string(),
                               " should match the mesh passed to shard_map ", mesh.to_string(),
                               " (a shard_map inside a shard_map body runs on the enclosing body's mesh)"));
    }
    enclosing = t->manual_axes.back();
  }
  absl::StatusOr<std::vector<std::string>> manual = manual_axes(in_specs, enclosing, t->all_vmapped_axes());
  if (!manual.ok()) return fail(std::string(manual.status().message()));
  // Unreduced and reduced axes in the specs (jax/_src/shard_map.py's _check_unreduced): only in
  // a body manual over every axis (JAX's NotImplementedError: UNIMPLEMENTED), and Explicit.
  const bool full_manual = enclosing.empty() && manual->size() == mesh.axis_names().size();
  for (const auto& [kind, list] : {std::pair{"in", &in_specs}, std::pair{"out", &out_specs}}) {
    for (const PartitionSpec& spec : *list) {
      const std::string bad = internal::shard_map_spec_unreduced_error(kind, mesh, full_manual, *manual, spec);
      if (bad.empty()) continue;
      const std::string message = absl::StrCat("shard_map: ", bad);
      t->fail(full_manual ? absl::InvalidArgumentError(message) : absl::UnimplementedError(message));
      return failed;
    }
  }
  // The axes the body is automatic over: left out of the arguments' types (explicit mode)
  // where the specs are compared or inferred, as JAX's _manual_spec keeps only manual axes.
  // The axes its body binds: the enclosing bodies' and its own.
  std::vector<std::string> automatic, bound;
  for (const std::string& a : mesh.axis_names()) {
    const bool own = std::find(manual->begin(), manual->end(), a) != manual->end();
    const bool outer = std::find(enclosing.begin(), enclosing.end(), a) != enclosing.end();
    if (own || outer) bound.push_back(a);
    if (!own && !outer) automatic.push_back(a);
  }
  // What the boundaries record (ShardingAttrs::manual_axes): the axes they make manual, empty
  // for a top-level body manual over every axis.
  const std::vector<std::string> recorded =
      automatic.empty() && enclosing.empty() ? std::vector<std::string>{} : *manual;
  // Inside an enclosing body each argument already varies as its value there (JAX's
  // _shard_shaped_array: the in_spec's axes | the aval's varying axes).
  std::map<int, Variance> seeds;
  // On a mesh of Explicit axes only, in_specs may be omitted (empty): each argument enters as
  // its type says (jax/_src/shard_map.py, in_specs=Infer).
  std::vector<PartitionSpec> specs = in_specs;
  if (specs.empty() && !args.empty() && internal::all_explicit(mesh) && t->explicit_mesh.has_value()) {
    for (const Value& a : args) {
      std::optional<internal::TypedOperand> typed = internal::typed_operand(a);
      if (!typed.has_value()) return failed;
      internal::without_axes(typed->spec, automatic);
      specs.push_back(
          internal::to_partition_spec(typed->spec).with_unreduced(typed->unreduced).with_reduced(typed->reduced));
    }
  }
  if (args.size() != specs.size()) {
    return fail(
        absl::StrCat(args.size(), " arguments but ", specs.size(), " in_specs",
                     specs.empty() ? " (in_specs may be omitted only on a mesh whose axes are all Explicit)" : ""));
  }
  std::vector<Value> blocks;
  std::vector<int> in_ids;
  for (size_t i = 0; i < args.size(); ++i) {
    if (TraceState::of(args[i]) != t) return fail("the arguments come from different traces");
    // Explicit mode: an argument enters with its own sharding; a different in_spec is an error
    // rather than an implicit reshard (JAX >= 0.9; client/explicit/shard_map.cc).
    if (std::optional<internal::TypedOperand> typed = internal::typed_operand(args[i])) {
      internal::without_axes(typed->spec, automatic);
      const internal::TypeRuleResult r = internal::shard_map_in_type_rule(*typed, NamedSharding(mesh, specs[i]));
      if (!r.error.empty()) return fail(absl::StrCat(r.error, ". ", r.fix));
    }
    absl::StatusOr<int> id =
        t->graph.add_shard_map_in(TraceState::id(args[i]), NamedSharding(mesh, specs[i]), recorded);
    if (!id.ok()) return fail(absl::StrCat("argument ", i, ": ", id.status().message()));
    if (!enclosing.empty()) seeds[*id] = t->variance_of(TraceState::id(args[i]));
    in_ids.push_back(*id);
    blocks.push_back(t->make(*id));
  }
  // With check_vma off the body's parameters are typed without their unreduced and reduced
  // axes (jax/_src/shard_map.py's _shard_shaped_array: unreduced = reduced = frozenset() unless
  // check_vma); their blocks are what they are (an unreduced argument's, its terms).
  if (!check_vma && t->explicit_mesh.has_value()) {
    absl::Status typed = t->type_new_nodes();
    if (!typed.ok()) {
      t->fail(typed);
      return failed;
    }
    for (int id : in_ids) {
      t->unreduced.erase(id);
      t->reduced.erase(id);
    }
  }
  const int body_start = t->graph.size();
  TraceState* outer = TraceState::current;
  TraceState::current = t;
  t->manual_meshes.push_back(mesh);
  t->manual_axes.push_back(bound);
  t->manual_bodies.push_back({body_start, in_ids, {}, *manual, recorded, check_vma, {}, -1, {}, false, seeds});
  std::vector<Value> results = f(blocks);
  // A result the body closed over is lifted into it too (TraceState::id), before it ends.
  std::vector<int> result_ids;
  for (const Value& r : results) result_ids.push_back(r.ok() && TraceState::of(r) == t ? TraceState::id(r) : -1);
  // The values lifted into it, and into the enclosing bodies while it was traced.
  std::set<int> lifted;
  for (const TraceState::ManualBody& b : t->manual_bodies) {
    for (const auto& [value, in] : b.lifted) lifted.insert(in);
  }
  const std::map<int, Variance> inserted_pvary = std::move(t->manual_bodies.back().inserted_pvary);
  t->manual_bodies.pop_back();
  t->manual_axes.pop_back();
  t->manual_meshes.pop_back();
  TraceState::current = outer;
  // One spec for every result: a failed body still has as many (invalid) results as it gave.
  if (out_specs_for_all) failed.resize(results.size());
  if (!t->error.ok()) return failed;
  const std::vector<PartitionSpec> outs =
      out_specs_for_all && out_specs.size() == 1 ? std::vector<PartitionSpec>(results.size(), out_specs[0]) : out_specs;
  if (results.size() != outs.size()) {
    return fail(
        absl::StrCat("the body returned ", results.size(), " results but there are ", outs.size(), " out_specs"));
  }
  const std::set<int> inputs(in_ids.begin(), in_ids.end());
  auto inside = [&](int id) { return id >= body_start || inputs.count(id) > 0; };
  for (int id = body_start; id < t->graph.size(); ++id) {
    if (lifted.count(id) > 0) continue;  // a closed-over value entering the body
    for (int o : t->graph.node(id).operands) {
      if (!inside(o)) {
        return fail(absl::StrCat("the body uses %", o, " ",
                                 type_to_string(t->graph.node(o).dtype, t->graph.node(o).shape),
                                 ", a value from outside it; pass it in as an argument"));
      }
    }
  }
  for (size_t i = 0; i < results.size(); ++i) {
    if (result_ids[i] < 0 || !inside(result_ids[i])) {
      return fail(absl::StrCat("result ", i, " is not a value of the body"));
    }
  }
  // A result's unreduced and reduced (manual) axes are its out_spec's (JAX's
  // _unshard_shaped_array, with check_vma).
  for (size_t i = 0; check_vma && t->explicit_mesh.has_value() && i < result_ids.size(); ++i) {
    std::optional<internal::TypedOperand> typed = internal::typed_operand(results[i]);
    if (!typed.has_value()) return failed;
    const std::string bad = internal::shard_map_out_unreduced_error(outs[i], *typed, mesh);
    if (!bad.empty()) return fail(absl::StrCat("output ", i, ": ", bad));
  }
  if (check_vma) {
    absl::Status replicated =
        check_replication(t->graph, body_start, in_ids, result_ids, outs, *manual, inserted_pvary, seeds);
    if (!replicated.ok()) return fail(std::string(replicated.message()));
  }
  std::vector<Value> out;
  for (size_t i = 0; i < result_ids.size(); ++i) {
    absl::StatusOr<int> id = t->graph.add_shard_map_out(result_ids[i], NamedSharding(mesh, outs[i]), recorded);
    if (!id.ok()) return fail(absl::StrCat("output ", i, ": ", id.status().message()));
    out.push_back(t->make(*id));
  }
  return out;
}

}  // namespace tessera

namespace tessera::internal {

namespace {
std::vector<std::pair<std::string, std::string>> varying_in(TraceState& t, size_t k, int id);
}  // namespace

int TraceState::lift(int id) {
  // Into each body from the outermost on: a value read in a nested shard_map body that belongs
  // to an enclosing body, or to the function, enters each body it is not of through a
  // shard_map_in of P() of that body (JAX's closed-over values, extra inputs replicated over
  // the manual axes); once it has entered one, it enters every body inside it.
  // A control-flow body's `nested` entry (its first) lifts nothing: its values, and those it
  // captures, are the enclosing body's already.
  // A parameter capturing a value of an enclosing trace (TraceState::capture) stands for a value
  // from outside every body, also when it was first read inside one (added after its start).
  bool entered = false;
  const bool captured_param = std::find(captured_params.begin(), captured_params.end(), id) != captured_params.end();
  for (size_t k = 0; k < manual_bodies.size() && error.ok(); ++k) {
    ManualBody& body = manual_bodies[k];
    if (body.nested) continue;
    if (!entered && !captured_param &&
        (id >= body.start || std::find(body.inputs.begin(), body.inputs.end(), id) != body.inputs.end())) {
      continue;
    }
    id = lift_into(k, id);
    entered = true;
  }
  return id;
}

int TraceState::lift_into(size_t k, int id) {
  ManualBody& body = manual_bodies[k];
  auto it = body.lifted.find(id);
  if (it != body.lifted.end()) return it->second;
  if (explicit_mesh.has_value()) {  // a value split by its type would not be whole on each device
    absl::Status typed = type_new_nodes();
    if (!typed.ok()) {
      fail(typed);
      return id;
    }
    const Node& n = graph.node(id);
    const TypeSpec& spec = specs.at(static_cast<size_t>(id));
    const auto manual_axis = [&](const std::string& a) {
      return std::find(body.manual.begin(), body.manual.end(), a) != body.manual.end();
    };
    if (std::any_of(spec.begin(), spec.end(),
                    [&](const Axes& axes) { return std::any_of(axes.begin(), axes.end(), manual_axis); })) {
      fail(absl::InvalidArgumentError(absl::StrCat(
          "shard_map: the body closes over %", id, " ", type_string(n.dtype, n.shape, spec),
          ", which enters it whole on every device (P()), but its type is split; reshard it to P() first, or pass "
          "it in as an argument with its in_spec")));
      return id;
    }
  }
  absl::StatusOr<int> in = graph.add_shard_map_in(id, NamedSharding(manual_meshes[k], PartitionSpec()), body.recorded);
  if (!in.ok()) {
    fail(in.status());
    return id;
  }
  body.lifted.emplace(id, *in);
  // It varies as it does in the enclosing body, if any (a closed-over value keeps its varying
  // axes: JAX traces it with its own aval, jax/_src/shard_map.py's _shard_map_staging).
  if (k > 0) {
    for (auto& [axis, why] : varying_in(*this, k - 1, id)) manual_bodies[k].seeds[*in].emplace(axis, why);
  }
  return *in;
}

namespace {

// TraceState::varying in t's k-th body (of manual_bodies).
std::vector<std::pair<std::string, std::string>> varying_in(TraceState& t, size_t k, int id) {
  std::vector<std::pair<std::string, std::string>> out;
  if (k >= t.manual_bodies.size() || !t.manual_bodies[k].check_vma) return out;
  const Graph& graph = t.graph;
  TraceState::ManualBody& body = t.manual_bodies[k];
  // Computed once per node: binary ops ask for their operands' (insert_pvary).
  if (body.variance_upto < 0) {
    body.variance = body_variance(graph, body.start, body.inputs, &body.inserted_pvary, body.seeds);
  } else {
    // Parameters a nested body captured since (TraceState::capture).
    for (const auto& [param, seed] : body.seeds) {
      if (param >= body.variance_upto) body.variance[param] = seed;
    }
    propagate_variance(graph, body.variance_upto, body.variance, &body.inserted_pvary);
  }
  body.variance_upto = graph.size();
  const std::map<int, Variance>& var = body.variance;
  auto it = var.find(id);
  if (it == var.end()) return out;
  for (const std::string& a : t.manual_meshes[k].axis_names()) {
    auto why = it->second.find(a);
    if (why != it->second.end()) out.emplace_back(a, why->second);
  }
  return out;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> TraceState::varying(int id) {
  return varying_in(*this, manual_bodies.size() - 1, id);
}

Variance TraceState::variance_of(int id) {
  Variance out;
  for (auto& [axis, why] : varying(id)) out.emplace(std::move(axis), std::move(why));
  return out;
}

void TraceState::nest_in(TraceState& parent, const std::vector<Variance>& inputs) {
  if (parent.manual_bodies.empty()) return;
  const ManualBody& outer = parent.manual_bodies.back();
  manual_meshes.push_back(parent.manual_meshes.back());
  manual_axes.push_back(parent.manual_axes.back());
  ManualBody body;
  body.manual = outer.manual;
  body.recorded = outer.recorded;
  body.check_vma = outer.check_vma;
  body.nested = true;
  for (size_t k = 0; k < inputs.size(); ++k) body.seeds[static_cast<int>(k)] = inputs[k];
  manual_bodies.push_back(std::move(body));
}

std::vector<Value> insert_pvary(TraceState* t, std::vector<Value> values) {
  if (t == nullptr || t->manual_bodies.empty() || !t->manual_bodies.back().check_vma) return values;
  std::vector<std::vector<std::string>> axes;
  Variance all;  // every axis an operand varies along, and why (the first operand's reason)
  for (const Value& v : values) {
    std::vector<std::string>& a = axes.emplace_back();
    if (!v.ok()) return values;
    for (const auto& [axis, why] : t->varying(TraceState::id(v))) {
      a.push_back(axis);
      all.emplace(axis, why);
    }
  }
  for (size_t i = 0; i < values.size(); ++i) {
    std::vector<std::string> missing;
    for (const std::string& a : t->manual_meshes.back().axis_names()) {
      if (all.count(a) > 0 && std::find(axes[i].begin(), axes[i].end(), a) == axes[i].end()) missing.push_back(a);
    }
    if (missing.empty()) continue;
    values[i] = pvary(values[i], AxisNames(missing));
    if (!values[i].ok()) return values;
    Variance& why = t->manual_bodies.back().inserted_pvary[TraceState::id(values[i])];
    for (const std::string& a : missing) why[a] = all[a];
  }
  return values;
}

std::vector<std::vector<std::string>> TraceState::outputs_varying(const Graph& g, const std::vector<int>& params) {
  std::vector<std::vector<std::string>> out(g.outputs().size());
  if (manual_bodies.empty() || !manual_bodies.back().check_vma) return out;
  std::map<int, Variance> var;
  for (size_t i = 0; i < params.size() && i < g.parameters().size(); ++i) {
    var[g.parameters()[i]] = variance_of(params[i]);
  }
  propagate_variance(g, 0, var);
  for (size_t j = 0; j < out.size(); ++j) {
    for (const std::string& a : manual_meshes.back().axis_names()) {
      if (var[g.outputs()[j]].count(a) > 0) out[j].push_back(a);
    }
  }
  return out;
}

}  // namespace tessera::internal

namespace tessera {

absl::StatusOr<std::vector<std::string>> ShardMapBody::manual_axes(const std::vector<PartitionSpec>& specs,
                                                                   const std::vector<std::string>& enclosing,
                                                                   const std::vector<std::string>& vmapped) const {
  for (const std::string& a : axis_names) {
    if (mesh.axis_index(a) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("axis_names ", axes_to_string(axis_names),
                                                     " must be a subset of the mesh's axis names ",
                                                     axes_to_string(mesh.axis_names()), ", but '", a, "' is not one"));
    }
  }
  const auto is_vmapped = [&](const std::string& a) {
    return std::find(vmapped.begin(), vmapped.end(), a) != vmapped.end();
  };
  // Inside vmap over a dimension split over Explicit axes the body is automatic over them: JAX's
  // _shmap_checks takes the mesh's axes less the axis env's explicit_mesh_axis_names, its words.
  std::vector<std::string> unmapped;
  for (const std::string& a : mesh.axis_names()) {
    if (!is_vmapped(a)) unmapped.push_back(a);
  }
  for (const std::string& a : axis_names) {
    if (!is_vmapped(a)) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("jax.shard_map requires axis_names=", axes_to_string(axis_names),
                     " to be a subset of mesh.axis_names=", axes_to_string(unmapped), ": '", a,
                     "' is an Explicit axis that an enclosing vmap maps over (its arguments' "
                     "mapped dimension is split over ",
                     axes_to_string(vmapped), "), which the body stays automatic over"));
  }
  const auto is_enclosing = [&](const std::string& a) {
    return std::find(enclosing.begin(), enclosing.end(), a) != enclosing.end();
  };
  // Axes an enclosing body is already manual over stay so, as JAX's newly_manual_axes =
  // axis_names - mesh.manual_axes.
  std::vector<std::string> manual;
  for (const std::string& a : unmapped) {
    if (is_enclosing(a)) continue;
    if (axis_names.empty() || std::find(axis_names.begin(), axis_names.end(), a) != axis_names.end()) {
      manual.push_back(a);
    }
  }
  if (manual.empty() && !enclosing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("axis_names ", axes_to_string(axis_names.empty() ? unmapped : axis_names),
                     " leave no axis to be manual over: the enclosing shard_map body is manual over ",
                     axes_to_string(enclosing), " already; a nested shard_map splits the axes it left automatic"));
  }
  if (manual.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "no axis of ", mesh.to_string(), " is left to be manual over: an enclosing vmap maps over ",
        axes_to_string(vmapped),
        " (its arguments' mapped dimension is split over them), which the body stays automatic over; a shard_map "
        "manual over no axis is not supported: call the body directly, or map over a dimension split over fewer "
        "axes"));
  }
  for (const auto& [kind, list] : {std::pair{"in", &specs}, std::pair{"out", &out_specs}}) {
    for (size_t i = 0; i < list->size(); ++i) {
      for (const std::string& a : (*list)[i].used_axes()) {
        if (std::find(manual.begin(), manual.end(), a) != manual.end()) continue;
        if (is_enclosing(a)) {
          // Each device holds its own block along an enclosing body's manual axis: there is
          // nothing to split along it again.
          return absl::InvalidArgumentError(absl::StrCat(
              kind, "_specs[", i, "] = ", (*list)[i].to_string(), " refers to '", a,
              "', which the enclosing shard_map body is already manual over (its Manual axes are ",
              axes_to_string(enclosing), "); a nested shard_map's specs may name only the axes it makes manual ",
              axes_to_string(manual), ": leave '", a, "' out (the block is already split along it)"));
        }
        return absl::InvalidArgumentError(absl::StrCat(
            kind, "_specs argument must refer to an axis marked as manual ", axes_to_string(manual), ", but ", kind,
            "_specs[", i, "] refers to '", a, "'; check the ", kind, "_specs values passed to shard_map",
            is_vmapped(a) ? absl::StrCat(" ('", a,
                                         "' is an Explicit axis that an enclosing vmap maps over: the specs describe "
                                         "one example, which is not split over it)")
                          : ""));
      }
    }
  }
  return manual;
}

absl::Status ShardMapBody::check_replication(const Graph& g, int body_start, const std::vector<int>& in_ids,
                                             const std::vector<int>& results, const std::vector<PartitionSpec>& outs,
                                             const std::vector<std::string>& manual,
                                             const std::map<int, Variance>& inserted_pvary,
                                             const std::map<int, Variance>& seeds) const {
  std::map<int, Variance> var = body_variance(g, body_start, in_ids, &inserted_pvary, seeds);
  for (size_t i = 0; i < results.size(); ++i) {
    const std::vector<std::string> named = outs[i].used_axes();
    const Node& r = g.node(results[i]);
    for (const std::string& a : manual) {
      if (std::find(named.begin(), named.end(), a) != named.end()) continue;
      auto it = var[results[i]].find(a);
      if (it == var[results[i]].end()) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("output ", i, " ", type_to_string(r.dtype, r.shape), " may differ along mesh axis '", a, "' (",
                       it->second, "), but out_specs[", i, "] = ", outs[i].to_string(), " leaves '", a,
                       "' out, which says it is the same on every device along it; reduce it over '", a,
                       "' (psum, pmean, pmax, pmin), name '", a, "' in the out_spec, or set check_vma = false"));
    }
  }
  return absl::OkStatus();
}

ShardMapped shard_map(TracedFunction f, Mesh mesh, std::vector<PartitionSpec> in_specs,
                      std::vector<PartitionSpec> out_specs, ShardMapOptions options) {
  auto body =
      std::make_shared<const ShardMapBody>(std::move(f), std::move(mesh), std::move(in_specs), std::move(out_specs),
                                           options.check_vma, options.axis_names, options.out_specs_for_all);
  ShardMapped out;
  out.state_ = std::make_shared<ShardMapped::State>();
  out.state_->body = body;
  out.state_->jitted.emplace(jit([body](const std::vector<Value>& in) { return (*body)(in); }, options.jit));
  return out;
}

absl::StatusOr<ShardMapped> shard_map(TracedFunction f, std::vector<PartitionSpec> in_specs,
                                      std::vector<PartitionSpec> out_specs, ShardMapOptions options) {
  std::optional<Mesh> mesh = get_mesh();
  if (!mesh.has_value()) {
    return absl::InvalidArgumentError(
        "shard_map: no mesh given and no ambient mesh: pass one, or set one with `MeshScope scope = set_mesh(mesh);`");
  }
  return shard_map(std::move(f), *std::move(mesh), std::move(in_specs), std::move(out_specs), options);
}

std::vector<Value> ShardMapped::operator()(const std::vector<Value>& args) const { return (*state_->body)(args); }

absl::StatusOr<std::vector<Array>> ShardMapped::operator()(const std::vector<Array>& args) const {
  return (*state_->jitted)(args);
}

std::string ShardMapped::as_text() const { return state_->jitted->as_text(); }

namespace {

// `axes` in `mesh`'s order, as jax/_src/core.py's order_wrt_mesh (an axis not in the mesh left
// out).
std::vector<std::string> in_mesh_order(const Mesh& mesh, const Axes& axes) {
  std::vector<std::string> ordered;
  for (const std::string& a : mesh.axis_names()) {
    if (std::find(axes.begin(), axes.end(), a) != axes.end()) ordered.push_back(a);
  }
  return ordered;
}

// The state of x along each of `axes`, as jax/_src/lax/parallel.py's _get_from names it:
// "varying", "unreduced", "reduced" or "invarying" (with check_vma off, or outside explicit
// mode, only the typed ones: a body value then varies along nothing).
std::set<std::string> axis_states(TraceState* t, const Value& x, const AxisNames& axes,
                                  const internal::TypedOperand* typed, std::vector<std::string>* varying) {
  for (const auto& [a, why] : t->varying(TraceState::id(x))) varying->push_back(a);
  const auto has = [](const std::vector<std::string>& set, const std::string& a) {
    return std::find(set.begin(), set.end(), a) != set.end();
  };
  std::set<std::string> states;
  for (const std::string& a : axes.names) {
    states.insert(has(*varying, a)                               ? "varying"
                  : typed != nullptr && has(typed->unreduced, a) ? "unreduced"
                  : typed != nullptr && has(typed->reduced, a)   ? "reduced"
                                                                 : "invarying");
  }
  return states;
}

// A body value's type as JAX's str_short prints it: f32[2,6]{V:x, U:y}.
std::string body_type_string(const internal::TypedOperand& typed, const Mesh& mesh,
                             const std::vector<std::string>& varying) {
  return absl::StrCat(internal::type_string(typed.dtype, typed.shape, typed.spec),
                      internal::unreduced_string(typed.unreduced, typed.reduced, mesh.axis_names(), varying));
}

// JAX's insert_collective_pvary (jax/_src/lax/parallel.py; psum's bind_psum_invariant alike):
// with check_vma on, a collective first casts x to varying along the axes it does not vary
// along (pvary), whose check_unreduced_args refuses an x unreduced or reduced over them, in
// pvary's words, which are then JAX's error for the collective. `takes_unreduced`: x unreduced
// over the axes is left to the collective (psum and its kin: unreduced_psum). False after
// failing the trace.
bool auto_pvary_takes(TraceState* t, const Value& x, const AxisNames& axes, bool takes_unreduced,
                      const std::string& call) {
  if (!t->explicit_mesh.has_value() || t->manual_bodies.empty() || !t->manual_bodies.back().check_vma) return true;
  const std::optional<internal::TypedOperand> typed = internal::typed_operand(x);
  if (!typed.has_value()) return true;  // a type error, which recording the collective reports
  std::vector<std::string> varying, vary_names;
  axis_states(t, x, axes, &*typed, &varying);
  for (const std::string& a : axes.names) {
    if (std::find(varying.begin(), varying.end(), a) == varying.end()) vary_names.push_back(a);
  }
  std::sort(vary_names.begin(), vary_names.end());
  const auto over_any = [&](const std::vector<std::string>& over) {
    return std::any_of(vary_names.begin(), vary_names.end(),
                       [&](const std::string& a) { return std::find(over.begin(), over.end(), a) != over.end(); });
  };
  // _get_from's 'unreduced' comes before 'reduced': such an x is the collective's own (no pvary).
  if (takes_unreduced && over_any(typed->unreduced)) return true;
  for (const auto& [what, over] : {std::pair{"unreduced", &typed->unreduced}, std::pair{"reduced", &typed->reduced}}) {
    if (!over_any(*over)) continue;
    t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": pvary cannot accept args which are ", what, ". Got ",
                                                    body_type_string(*typed, t->manual_meshes.back(), varying),
                                                    " and axes=", axis_set_repr(vary_names))));
    return false;
  }
  return true;
}

// _get_from's refusal of axes along which x is in several states, its words (`name` is the
// JAX function), after `call`.
absl::Status mixed_states_error(const std::string& call, absl::string_view name, const Value& x, const AxisNames& axes,
                                const internal::TypedOperand* typed, const std::vector<std::string>& varying,
                                const std::set<std::string>& states, const Mesh& mesh) {
  const std::string type =
      typed == nullptr ? type_to_string(x.dtype(), x.shape()) : body_type_string(*typed, mesh, varying);
  return absl::InvalidArgumentError(absl::StrCat(
      call, ": ", name,
      " can only accept axis_name which corresponds to one of varying, unreduced, reduced or invarying state of the "
      "input. Got input type: ",
      type, ", axes: ", axis_tuple_repr(axes.names),
      " and input state: ", axis_set_repr(std::vector<std::string>(states.begin(), states.end()))));
}

// _get_from for psum and its kin: they take axes along which x is in one state (varying,
// unreduced, reduced or invarying), which picks the collective (psum of unreduced axes is
// unreduced_psum). False after failing the trace with JAX's words (`name` is the JAX function)
// when an unreduced or reduced axis is among states that differ (a mix of varying and
// invarying axes alone is taken, as Tessera always has).
bool one_state(const Value& x, const AxisNames& axes, const char* name, const std::string& call) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return false;
  const std::optional<internal::TypedOperand> typed = internal::typed_operand(x);
  if (!typed.has_value() || (typed->unreduced.empty() && typed->reduced.empty())) return true;
  std::vector<std::string> varying;
  const std::set<std::string> states = axis_states(t, x, axes, &*typed, &varying);
  if (states.size() <= 1 || (states.count("unreduced") == 0 && states.count("reduced") == 0)) return true;
  t->fail(
      mixed_states_error(call, absl::StrCat("jax.lax.", name), x, axes, &*typed, varying, states, *t->explicit_mesh));
  return false;
}

}  // namespace

Value psum(const Value& x, const AxisNames& axes) {
  const std::string call = call_text("psum", x, axes);
  if (!one_state(x, axes, "psum", call)) return Value();
  return collective(Op::kAllReduce, x, axes, {}, ReduceOp::kSum, call);
}

Value pmax(const Value& x, const AxisNames& axes) {
  const std::string call = call_text("pmax", x, axes);
  if (!one_state(x, axes, "pmax", call)) return Value();
  return collective(Op::kAllReduce, x, axes, {}, ReduceOp::kMax, call);
}

Value pmin(const Value& x, const AxisNames& axes) {
  const std::string call = call_text("pmin", x, axes);
  if (!one_state(x, axes, "pmin", call)) return Value();
  return collective(Op::kAllReduce, x, axes, {}, ReduceOp::kMin, call);
}

Value pmean(const Value& x, const AxisNames& axes) {
  const std::string call = call_text("pmean", x, axes);
  if (!one_state(x, axes, "pmean", call)) return Value();
  Value sum = collective(Op::kAllReduce, x, axes, {}, ReduceOp::kSum, call);
  if (!sum.ok()) return sum;
  return sum / static_cast<double>(*group_size(TraceState::common({&sum}), axes, "pmean"));
}

namespace {

Value gather(const Value& x, const AxisNames& axes, int64_t axis, bool tiled, bool auto_pvary) {
  const std::string call = call_text("all_gather", x, axes);
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  axis = normalize_axis(axis, tiled ? x.rank() : x.rank() + 1);
  if (axis < 0 || axis > x.rank() || (tiled && axis == x.rank())) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": axis ", axis, " is out of range")));
  }
  // Stacked: each device's x gains a dimension of size 1 there, and the gather tiles it.
  const Value in = tiled ? x : expand_dims(x, axis);
  return collective(Op::kAllGather, in, axes, {axis}, ReduceOp::kSum, call, auto_pvary);
}

}  // namespace

Value all_gather(const Value& x, const AxisNames& axes, int64_t axis, bool tiled) {
  return gather(x, axes, axis, tiled, true);
}

Value psum_scatter(const Value& x, const AxisNames& axes, int64_t scatter_dimension, bool tiled) {
  const std::string call = call_text("psum_scatter", x, axes);
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  const int64_t d = normalize_axis(scatter_dimension, x.rank());
  if (!tiled && d >= 0 && d < x.rank()) {
    std::optional<int64_t> n = group_size(t, axes, call);
    if (!n) return Value();
    if (x.shape()[d] != *n) {
      return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": scatter_dimension ", d, " has size ",
                                                             x.shape()[d], "; not tiled, it must be ", *n,
                                                             ", the size of ", axes_text(axes.names))));
    }
  }
  if (!one_state(x, axes, "psum_scatter", call)) return Value();
  Value out = collective(Op::kReduceScatter, x, axes, {d}, ReduceOp::kSum, call);
  return tiled || !out.ok() ? out : squeeze(out, {d});
}

Value ppermute(const Value& x, const AxisNames& axes, const std::vector<std::pair<int64_t, int64_t>>& perm) {
  std::vector<int64_t> flat;
  for (const auto& [source, target] : perm) {
    flat.push_back(source);
    flat.push_back(target);
  }
  return collective(Op::kCollectivePermute, x, axes, std::move(flat), ReduceOp::kSum, call_text("ppermute", x, axes));
}

Value pbroadcast(const Value& x, const AxisNames& axes, int64_t source) {
  const std::string call = absl::StrCat("pbroadcast(", type_to_string(x.dtype(), x.shape()), ", ",
                                        axes_text(axes.names), ", source=", source, ")");
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  std::optional<int64_t> n = group_size(t, axes, call);
  if (!n) return Value();
  if (source < 0 || source >= *n) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": source ", source, " is not a position along ",
                                                           axes_text(axes.names), ", which has ", *n, " devices")));
  }
  // lax.pbroadcast's definition (jax/_src/lax/parallel.py): the source's x, the others' zeros,
  // summed; bool as psum takes it, through int32. JAX types the result as x (varying along the
  // axes); the sum is invariant, so it is cast back.
  const bool boolean = x.dtype() == DType::kBool;
  const Value in = boolean ? convert(x, DType::kI32) : x;
  Value sum = psum(where(axis_index(axes) == source, in, full(in.shape(), 0, in.dtype())), axes);
  if (boolean) sum = sum != 0;
  const Value out = pvary(sum, axes);
  if (out.ok() && TraceState::id(out) != TraceState::id(sum)) {  // typed (check_vma): errors name pbroadcast
    Variance& why = t->manual_bodies.back().inserted_pvary[TraceState::id(out)];
    for (const std::string& a : axes.names) {
      why[a] = absl::StrCat("it depends on pbroadcast over ", axes_text(axes.names),
                            ", which JAX types as varying along it");
    }
  }
  return out;
}

Value all_to_all(const Value& x, const AxisNames& axes, int64_t split_axis, int64_t concat_axis, bool tiled) {
  const std::string call = call_text("all_to_all", x, axes);
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  int64_t split = normalize_axis(split_axis, x.rank()), concat = normalize_axis(concat_axis, x.rank());
  if (split < 0 || split >= x.rank() || concat < 0 || concat >= x.rank()) {
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat(call, ": split_axis ", split_axis, " or concat_axis ", concat_axis, " is out of range")));
  }
  if (tiled) return collective(Op::kAllToAll, x, axes, {split, concat}, ReduceOp::kSum, call);
  std::optional<int64_t> n = group_size(t, axes, call);
  if (!n) return Value();
  if (x.shape()[split] != *n) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": split_axis ", split, " has size ", x.shape()[split],
                                                           "; not tiled, it must be ", *n, ", the size of ",
                                                           axes_text(axes.names))));
  }
  if (split == concat) return collective(Op::kAllToAll, x, axes, {split, concat}, ReduceOp::kSum, call);
  // As lax.all_to_all: a size-1 dimension where the blocks stack, a tiled all_to_all into it,
  // then the split dimension (now of size 1) goes.
  Value in = x;
  if (split < concat) {
    in = expand_dims(x, ++concat);
  } else {
    in = expand_dims(x, concat);
    ++split;
  }
  Value out = collective(Op::kAllToAll, in, axes, {split, concat}, ReduceOp::kSum, call);
  return out.ok() ? squeeze(out, {split}) : out;
}

Value ragged_all_to_all(const Value& operand, const Value& output, const Value& input_offsets, const Value& send_sizes,
                        const Value& output_offsets, const Value& recv_sizes, const AxisNames& axes) {
  TraceState* t = TraceState::common({&operand, &output, &input_offsets, &send_sizes, &output_offsets, &recv_sizes});
  if (t == nullptr) return Value();
  const std::string call =
      absl::StrCat("ragged_all_to_all(", type_to_string(operand.dtype(), operand.shape()), ", ",
                   type_to_string(output.dtype(), output.shape()), ", ", axes_text(axes.names), ")");
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return Value();
  absl::StatusOr<int> id = t->graph.add_ragged_all_to_all(
      {TraceState::id(operand), TraceState::id(output), TraceState::id(input_offsets), TraceState::id(send_sizes),
       TraceState::id(output_offsets), TraceState::id(recv_sizes)},
      *mesh, axes.names);
  if (!id.ok()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", id.status().message())));
  return t->make(*id);
}

Value ragged_all_to_all(const Value& operand, const Value& output, const Value& input_offsets, const Value& send_sizes,
                        const Value& output_offsets, const Value& recv_sizes, const AxisNames& axes,
                        const std::vector<std::vector<int64_t>>& axis_index_groups) {
  const auto whole = [&](const Value& io, const Value& ss, const Value& oo, const Value& rs) {
    return ragged_all_to_all(operand, output, io, ss, oo, rs, axes);
  };
  // Index arrays that are not vectors of one length: the call above gives JAX's error.
  const int64_t k = input_offsets.ok() && input_offsets.rank() == 1 ? input_offsets.shape()[0] : 0;
  bool vectors = k > 0;
  for (const Value* v : {&send_sizes, &output_offsets, &recv_sizes}) vectors = vectors && v->shape() == Shape{k};
  if (axis_index_groups.empty() || !vectors) return whole(input_offsets, send_sizes, output_offsets, recv_sizes);
  TraceState* t = TraceState::common({&operand, &output, &input_offsets, &send_sizes, &output_offsets, &recv_sizes});
  if (t == nullptr) return Value();
  const std::string call = absl::StrCat("ragged_all_to_all(", axes_text(axes.names), ", axis_index_groups=",
                                        absl::StrJoin(axis_index_groups, ", ",
                                                      [](std::string* out, const std::vector<int64_t>& g) {
                                                        absl::StrAppend(out, "{", absl::StrJoin(g, ", "), "}");
                                                      }),
                                        ")");
  const std::optional<int64_t> n = group_size(t, axes, call);
  if (!n.has_value()) return Value();
  // Each position once, in groups of one size (jax/_src/lax/parallel.py's docstring: "Groups
  // must cover all axis indices exactly once, and all groups must be the same size").
  const int64_t g = static_cast<int64_t>(axis_index_groups[0].size());
  std::vector<int> group_of(static_cast<size_t>(*n), -1), position_in(static_cast<size_t>(*n), 0);
  std::string bad;
  for (size_t gi = 0; gi < axis_index_groups.size() && bad.empty(); ++gi) {
    const std::vector<int64_t>& group = axis_index_groups[gi];
    if (static_cast<int64_t>(group.size()) != g) {
      bad = absl::StrCat("group ", gi, " has ", group.size(), " positions and group 0 has ", g,
                         ": all groups must be the same size");
    }
    for (size_t p = 0; p < group.size() && bad.empty(); ++p) {
      const int64_t e = group[p];
      if (e < 0 || e >= *n) {
        bad = absl::StrCat("position ", e, " is not a position along the axes (of size ", *n, ")");
      } else if (group_of[static_cast<size_t>(e)] >= 0) {
        bad = absl::StrCat("position ", e, " is in two groups");
      } else {
        group_of[static_cast<size_t>(e)] = static_cast<int>(gi);
        position_in[static_cast<size_t>(e)] = static_cast<int>(p);
      }
    }
  }
  if (bad.empty() && std::find(group_of.begin(), group_of.end(), -1) != group_of.end()) {
    bad = absl::StrCat("the groups must cover every position along the axes (of size ", *n, ") exactly once");
  }
  if (bad.empty() && k % g != 0) {
    bad = absl::StrCat("the index arrays' length ", k, " does not divide by the groups' size ", g);
  }
  if (!bad.empty()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", bad)));
  // Over the whole axes, this device's slice i' (of n * s, s = K / g) goes to position
  // e = i' / s: its own slice position_in[e] * s + i' % s when e is in its group, else an
  // empty one. Positions are rows of (n, s) tables.
  const int64_t s = k / g;
  const auto vector_of = [](const std::vector<int>& values) {
    std::vector<Value> parts;
    for (int v : values) parts.push_back(full({1}, v, DType::kI32));
    return concatenate(parts, 0);
  };
  const Shape rows = {*n, s};
  const Value groups = vector_of(group_of);
  const Value mine = dynamic_slice(groups, {axis_index(axes)}, {1});
  const Value same =
      reshape(broadcast_in_dim(groups, rows, {0}) == broadcast_in_dim(reshape(mine, {}), rows, {}), {*n * s});
  const Value source =
      reshape(broadcast_in_dim(vector_of(position_in), rows, {0}) * full(rows, static_cast<double>(s), DType::kI32) +
                  iota(DType::kI32, rows, 1),
              {*n * s});
  const Value zero = full({*n * s}, 0, DType::kI32);
  const auto spread = [&](const Value& a) {
    return where(same, take(a, where(same, source, zero), 0, IndexMode::kClip), full({*n * s}, 0, a.dtype()));
  };
  return whole(spread(input_offsets), spread(send_sizes), spread(output_offsets), spread(recv_sizes));
}

Value axis_index(const AxisNames& axes) {
  TraceState* t = TraceState::current;
  if (t == nullptr || !t->error.ok()) return Value();
  const std::string call = absl::StrCat("axis_index(", axes_text(axes.names), ")");
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return Value();
  absl::StatusOr<int> id = t->graph.add_axis_index(*mesh, axes.names);
  if (!id.ok()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", id.status().message())));
  return t->make(*id);
}

int64_t axis_size(const AxisNames& axes) {
  TraceState* t = TraceState::current;
  if (t == nullptr) return 1;
  return group_size(t, axes, absl::StrCat("axis_size(", axes_text(axes.names), ")")).value_or(1);
}

Value pvary(const Value& x, const AxisNames& axes) {
  const std::string call = call_text("pvary", x, axes);
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (axes.names.empty()) return x;
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return Value();
  // The axes in mesh order, as jax/_src/core.py's pvary orders them (checked as a collective's).
  std::vector<std::string> ordered = in_mesh_order(*mesh, axes.names);
  const int id = TraceState::id(x);
  if (ordered.size() != axes.names.size()) {  // an axis not in the mesh, or one named twice: the op's check says which
    absl::StatusOr<int> bad = t->graph.add_pvary(id, *mesh, axes.names);
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat(call, ": ", bad.ok() ? "the axes do not match the mesh" : bad.status().message())));
  }
  if (!t->manual_bodies.back().check_vma) return x;  // nothing is typed: JAX returns x too
  std::vector<std::string> already;
  std::string why;
  for (const auto& [a, reason] : t->varying(id)) {
    if (std::find(ordered.begin(), ordered.end(), a) == ordered.end()) continue;
    already.push_back(a);
    if (why.empty()) why = reason;
  }
  if (!already.empty()) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(
        call,
        ": pvary is an invariant->varying cast, so the axes it names must not be ones x already varies along, "
        "but x varies along ",
        axes_to_string(already), " (", why, "); leave them out, or drop the pvary")));
  }
  absl::StatusOr<int> out = t->graph.add_pvary(id, *mesh, std::move(ordered));
  if (!out.ok()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", out.status().message())));
  return t->make(*out);
}

namespace {

// A pvary node casting x to unreduced or reduced over `axes` (core/pvary_cast.h): no
// instruction runs it; its type rules are client/explicit/shard_map.cc's.
Value cast_node(TraceState* t, const Value& x, const Mesh& mesh, const AxisNames& axes, PvaryCast cast,
                const std::string& call) {
  Node n;
  n.op = Op::kPvary;
  n.operands = {TraceState::id(x)};
  n.attributes = CollectiveAttrs{mesh, axes.names, ReduceOp::kSum, static_cast<int64_t>(cast), 0, 0, {}};
  const std::vector<std::string> ordered = in_mesh_order(mesh, axes.names);
  if (ordered.size() == axes.names.size()) n.attrs<CollectiveAttrs>().axes = ordered;
  absl::StatusOr<int> id = t->graph.add_node(std::move(n));
  if (!id.ok()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", id.status().message())));
  return t->make(*id);
}

// Reduced and unreduced axes are types of explicit mode only: elsewhere the casts to them are
// refused, naming the call.
bool explicit_types(TraceState* t, const std::string& call) {
  if (t->explicit_mesh.has_value()) return true;
  t->fail(absl::InvalidArgumentError(
      absl::StrCat(call,
                   ": reduced and unreduced axes are types of explicit mode: the mesh's axes must all be Explicit "
                   "(make_mesh(..., {AxisType::kExplicit, ...}))")));
  return false;
}

// all_gather(x, axes, axis, tiled, to='invarying'), JAX's all_gather_invariant
// (jax/_src/lax/parallel.py): x cast to varying along the axes it does not vary along (JAX's
// auto_pcast pvary, whose check_unreduced_args refuses an x unreduced or reduced over them, in
// its words), the gather, then its blocks, the same on every device along the axes, typed
// invariant there (_all_gather_invariant_effectful_abstract_eval: the result's varying axes are
// x's less `axes`). Lowered as the gather; JAX's transpose (a dynamic_slice of the invariant
// cotangent at axis_index) is the gather's reduce-scatter here, where an invariant value's
// cotangent is each device's share (client/vjp/shard_map.cc); with check_vma off, the slice.
Value all_gather_invariant(TraceState* t, const Value& x, const AxisNames& axes, int64_t axis, bool tiled,
                           const std::string& call) {
  if (axes.names.empty()) return x;
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return Value();
  if (!auto_pvary_takes(t, x, axes, false, call)) return Value();
  const Value gathered = all_gather(x, axes, axis, tiled);
  if (!gathered.ok()) return gathered;
  if (!t->manual_bodies.back().check_vma) {
    // Untyped: the gather, its own block written back from x (the same values) so that the
    // gradient is JAX's transpose, x's slice of this device's cotangent, not the gather's
    // reduce-scatter (which sums every device's slice). With check_vma off JAX divides an
    // out_spec's cotangent by the unmentioned axes' size (_shard_map_transpose), so the two
    // differ: JAX's gradient of sum(f(.)) out as P() is f'(x) / N.
    const int64_t dim = axis < 0 ? axis + static_cast<int64_t>(gathered.shape().size()) : axis;
    const Value own = tiled ? x : expand_dims(x, dim);
    std::vector<Value> starts(gathered.shape().size(), full({}, 0.0, DType::kI32));
    starts[dim] = axis_index(axes) * own.shape()[dim];
    return dynamic_update_slice(stop_gradient(gathered), own, starts);
  }
  return cast_node(t, gathered, *mesh, axes, PvaryCast::kInvariant, call);
}

}  // namespace

Value pcast(const Value& x, const AxisNames& axes, const std::string& to) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  const std::string call =
      absl::StrCat("pcast(", type_to_string(x.dtype(), x.shape()), ", ", axes_text(axes.names), ", to='", to, "')");
  if (axes.names.empty()) return x;
  if (to != "varying" && to != "reduced" && to != "unreduced") {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(
        call, ": Got unexpected `to` value. Allowed `to` values are: {'unreduced', 'reduced', 'varying'}")));
  }
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call)) return Value();
  // The state of x along the axes, one of them (jax/_src/lax/parallel.py's _get_from), picks
  // the cast (_pcast_funcs).
  std::optional<internal::TypedOperand> typed;
  if (t->explicit_mesh.has_value()) {
    typed = internal::typed_operand(x);
    if (!typed.has_value()) return Value();
  }
  std::vector<std::string> varying;
  const std::set<std::string> states = axis_states(t, x, axes, typed.has_value() ? &*typed : nullptr, &varying);
  if (states.size() > 1) {
    return t->fail(mixed_states_error(call, "jax.lax.pcast", x, axes, typed.has_value() ? &*typed : nullptr, varying,
                                      states, *mesh));
  }
  const std::string from = *states.begin();
  if ((from == "invarying" || from == "reduced") && to == "varying") return pvary(x, axes);  // pvary, reduced_vary_cast
  if (from == "invarying" && to == "reduced") {  // preduced: with check_vma off, x (as JAX's preduced)
    if (!t->manual_bodies.back().check_vma) return x;
    if (!explicit_types(t, call)) return Value();
    return cast_node(t, x, *mesh, axes, PvaryCast::kReduced, call);
  }
  if (from == "varying" && to == "unreduced") {  // vary_unreduced_cast
    if (!explicit_types(t, call)) return Value();
    return cast_node(t, x, *mesh, axes, PvaryCast::kUnreduced, call);
  }
  return t->fail(absl::InvalidArgumentError(
      absl::StrCat(call, ": Unsupported pcast from=", from, ", to='", to, "'",
                   from == to ? absl::StrCat(" (x is already ", from, " along ", axes_text(axes.names), ")") : "")));
}

Value all_gather(const Value& x, const AxisNames& axes, int64_t axis, bool tiled, const std::string& to) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  const std::string call = absl::StrCat("all_gather(", type_to_string(x.dtype(), x.shape()), ", ",
                                        axes_text(axes.names), ", to='", to, "')");
  if (to == "varying") return all_gather(x, axes, axis, tiled);
  if (to == "invarying") return all_gather_invariant(t, x, axes, axis, tiled, call);
  if (to != "reduced") {
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat(call,
                     ": Got unexpected `to` value for `jax.lax.all_gather`. Allowed `to` values are: {'varying', "
                     "'reduced', 'invarying'}")));
  }
  if (axes.names.empty()) return x;
  const Mesh* mesh = manual_mesh(t, call);
  if (mesh == nullptr || !only_manual_axes(t, axes.names, call) || !explicit_types(t, call)) return Value();
  // all_gather_reduced's abstract eval (jax/_src/lax/parallel.py), its words: a Varying ->
  // Reduced collective (with check_vma off nothing varies, and JAX refuses it so too).
  const std::optional<internal::TypedOperand> typed = internal::typed_operand(x);
  if (!typed.has_value()) return Value();
  std::vector<std::string> varying;
  axis_states(t, x, axes, &*typed, &varying);
  const std::string type = body_type_string(*typed, *mesh, varying);
  const std::string axis_name = axis_tuple_repr(axes.names);
  if (varying.empty()) {
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat(call, ": all_gather_reduced only accepts inputs that are varying. Got ", type)));
  }
  if (std::none_of(axes.names.begin(), axes.names.end(), [&](const std::string& a) {
        return std::find(varying.begin(), varying.end(), a) != varying.end();
      })) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(
        call, ": all_gather_reduced is a Varying -> Reduced collective. This means that the axis_name=", axis_name,
        " passed to `all_gather_reduced` must be present in jax.typeof(x).mat.varying=",
        axis_frozenset_repr(varying))));
  }
  if (std::any_of(axes.names.begin(), axes.names.end(), [&](const std::string& a) {
        return std::find(typed->reduced.begin(), typed->reduced.end(), a) != typed->reduced.end();
      })) {
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat(call, ": all_gather_reduced's input cannot be reduced across the axis_name provided. Got x=", type,
                     " and axis_name=", axis_name)));
  }
  // The gather, then its blocks (the same on every device along the axes) typed reduced there.
  // An x unreduced over some of the axes keeps its unreduced axes (the abstract eval checks only
  // their kind, a sum here): both nodes are given them as their result's, typed when made.
  const bool unreduced_gather = std::any_of(axes.names.begin(), axes.names.end(), [&](const std::string& a) {
    return std::find(typed->unreduced.begin(), typed->unreduced.end(), a) != typed->unreduced.end();
  });
  if (unreduced_gather) ++t->deferred_typing;
  const Value gathered = gather(x, axes, axis, tiled, false);
  const Value out = gathered.ok() ? cast_node(t, gathered, *mesh, axes, PvaryCast::kReduced, call) : gathered;
  if (!unreduced_gather) return out;
  --t->deferred_typing;
  if (!out.ok()) return out;
  for (const Value* v : {&gathered, &out}) t->out_unreduced[TraceState::id(*v)] = typed->unreduced;
  const absl::Status types = t->type_new_nodes();
  if (!types.ok()) return t->fail(absl::InvalidArgumentError(absl::StrCat(call, ": ", types.message())));
  return out;
}

}  // namespace tessera

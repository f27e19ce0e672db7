// Control flow: scan, traced into a body sub-graph (core/op_attrs.h's ScanAttrs); a body may
// read values of the enclosing traces (TraceState::capture), which become loop invariants.
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"
#include "tessera/trace.h"

namespace tessera {

using internal::TraceState;

namespace {

// The trace the operands belong to (the current one when there are none), or null. Inside a
// body, operands of an enclosing trace are captured first (`local`).
TraceState* trace_of(std::vector<Value>& a, std::vector<Value>& b) {
  TraceState* t = nullptr;
  for (std::vector<Value>* list : {&a, &b}) {
    for (Value& v : *list) {
      if (!v.ok()) return nullptr;
      v = TraceState::local(v);
      if (t == nullptr) t = TraceState::of(v);
      if (TraceState::of(v) != t) {
        t->fail(absl::InvalidArgumentError("scan: the carries and xs come from different traces"));
        return nullptr;
      }
    }
  }
  if (t == nullptr) t = TraceState::current;
  return t != nullptr && t->error.ok() ? t : nullptr;
}

std::vector<Value> concat(std::vector<Value> a, const std::vector<Value>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<Value> range(const std::vector<Value>& v, size_t from, size_t to) {
  return std::vector<Value>(v.begin() + static_cast<std::ptrdiff_t>(from), v.begin() + static_cast<std::ptrdiff_t>(to));
}

// In a shard_map body of trace t: how each of `values` (of t) varies, for a body traced on them
// (trace_body's input_vma); empty elsewhere.
std::vector<internal::Variance> vma_of(TraceState* t, const std::vector<Value>& values) {
  std::vector<internal::Variance> out;
  if (t->manual_bodies.empty()) return out;
  for (const Value& v : values) out.push_back(t->variance_of(TraceState::id(v)));
  return out;
}

}  // namespace

namespace internal {
namespace {

// Explicit mode (client/explicit/control.cc): the types of `values`, values of one trace in
// explicit mode; nullopt outside it (or when typing failed, with the trace's error recorded).
std::optional<std::vector<TypedOperand>> typed(const std::vector<Value>& values) {
  std::vector<TypedOperand> out;
  for (const Value& v : values) {
    std::optional<TypedOperand> o = typed_operand(v);
    if (!o.has_value()) return std::nullopt;
    out.push_back(*std::move(o));
  }
  return out;
}

// The types of the first `n` results of `g`, a body traced in explicit mode over `mesh`: each
// as its result is pinned (its spec, unreduced and reduced axes).
std::vector<TypedOperand> output_types(const Graph& g, const Mesh& mesh, size_t n) {
  std::vector<TypedOperand> out;
  for (size_t j = 0; j < n && j < g.outputs().size(); ++j) {
    const Node& r = g.node(g.outputs()[j]);
    TypedOperand& o = out.emplace_back(TypedOperand{r.dtype, r.shape, body_output_spec(g, j, mesh)});
    if (r.op != Op::kShardingConstraint) continue;
    o.unreduced = r.attrs<ShardingAttrs>().sharding.spec().unreduced();
    o.reduced = r.attrs<ShardingAttrs>().sharding.spec().reduced();
  }
  return out;
}

// Empty when the body `g` (traced in t, its parameters the values `params`) gives each of the
// carries `init` back with its type: its sharding in explicit mode (`init_types`), and in a
// shard_map body with check_vma the manual axes it varies along (JAX's vma); else JAX's
// _check_carry_type message for `name`.
std::string carry_mismatch(TraceState* t, const char* name, const std::vector<Value>& init,
                           const std::optional<std::vector<TypedOperand>>& init_types, const Graph& g,
                           const std::vector<Value>& params) {
  std::vector<int> ids;
  for (const Value& v : params) ids.push_back(TraceState::id(v));
  std::vector<std::vector<std::string>> in_varying, out_varying = t->outputs_varying(g, ids);
  out_varying.resize(init.size());
  for (const Value& c : init) {
    std::vector<std::string>& axes = in_varying.emplace_back();
    for (const auto& [axis, why] : t->varying(TraceState::id(c))) axes.push_back(axis);
  }
  if (!init_types.has_value() && in_varying == out_varying) return "";
  std::vector<TypedOperand> in_types, out_types;
  if (init_types.has_value()) {
    in_types = *init_types;
    out_types = output_types(g, *t->explicit_mesh, init.size());
  } else {
    for (size_t k = 0; k < init.size() && k < g.outputs().size(); ++k) {
      const Node& r = g.node(g.outputs()[k]);
      in_types.push_back({init[k].dtype(), init[k].shape(), TypeSpec(init[k].shape().size())});
      out_types.push_back({r.dtype, r.shape, TypeSpec(r.shape.size())});
    }
  }
  return carry_type_mismatch(name, in_types, out_types, in_varying, out_varying);
}

}  // namespace
}  // namespace internal

ScanResult scan(const ScanFunction& f, const std::vector<Value>& init_in, const std::vector<Value>& xs_in,
                std::optional<int64_t> length, bool reverse) {
  ScanResult failed{std::vector<Value>(init_in.size()), {}};
  std::vector<Value> init = init_in, xs = xs_in;
  TraceState* t = trace_of(init, xs);
  if (t == nullptr) return failed;
  auto fail = [&](const std::string& message) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("scan: ", message)));
    return failed;
  };
  std::vector<ArrayType> types;
  for (const Value& c : init) types.push_back({c.dtype(), c.shape()});
  for (size_t k = 0; k < xs.size(); ++k) {
    Shape row = xs[k].shape();
    if (row.empty()) return fail(absl::StrCat("xs ", k, " is a scalar; scan needs a leading dimension to scan over"));
    if (!length.has_value()) length = row[0];
    if (row[0] != *length) {
      return fail(absl::StrCat("xs ", k, " has ", row[0], " rows, but the length is ", *length,
                               " (every xs needs the same leading dimension)"));
    }
    row.erase(row.begin());
    types.push_back({xs[k].dtype(), row});
  }
  if (!length.has_value()) return fail("with no xs, the length must be given");
  const size_t carries = init.size();
  // Explicit mode: the body's parameters are typed, a carry as its initial value, a row as
  // its xs without the scanned dimension, which must be unsplit (JAX's _infer_scan_length).
  std::optional<std::vector<internal::TypedOperand>> init_types, xs_types;
  std::vector<internal::TypedOperand> specs;
  if (t->explicit_mesh.has_value()) {
    init_types = internal::typed(init);
    xs_types = internal::typed(xs);
    if (!init_types.has_value() || !xs_types.has_value()) return failed;
    // A split scanned dimension fails the trace here, as JAX checks it first; the body is
    // still traced (its errors no longer count) so that the failed result has its ys.
    const internal::TypeRuleResult r = internal::scan_xs_type_rule(*xs_types);
    if (!r.error.empty()) t->fail(internal::type_rule_error("scan", *xs_types, r));
    // A row keeps its xs's unreduced and reduced axes (core.py's _map_shaped_array).
    specs = *init_types;
    for (internal::TypedOperand row : *xs_types) {
      row.spec.erase(row.spec.begin());
      row.shape.erase(row.shape.begin());
      specs.push_back(std::move(row));
    }
  }
  size_t returned = carries;  // how many carries the body gave back
  std::vector<Value> consts;  // the outer values the body reads
  absl::StatusOr<Graph> traced = internal::trace_body(
      t,
      [&](const std::vector<Value>& in) {
        ScanStep step = f(range(in, 0, carries), range(in, carries, in.size()));
        returned = step.carry.size();
        failed.ys.resize(step.ys.size());  // from here a failed scan has as many (invalid) ys
        return concat(std::move(step.carry), step.ys);
      },
      types, &consts, specs, vma_of(t, concat(init, xs)));
  if (!t->error.ok()) return failed;
  if (returned != carries) {
    return fail(absl::StrCat("the body returned ", returned, " carries for ", carries, " initial ones"));
  }
  if (!traced.ok()) return fail(absl::StrCat("its body: ", traced.status().message()));
  const std::string mismatch =
      internal::carry_mismatch(t, "scan body", init, init_types, *traced, concat(concat(init, xs), consts));
  if (!mismatch.empty()) {
    t->fail(absl::InvalidArgumentError(mismatch));
    return failed;
  }
  // The consts become carries the body hands on unchanged (loop invariants), after the
  // carries: the body takes (carries, consts, rows) and returns (carries, consts, ys).
  const size_t num_k = consts.size();
  std::vector<ArrayType> order(types.begin(), types.begin() + static_cast<std::ptrdiff_t>(carries));
  for (const Value& k : consts) order.push_back({k.dtype(), k.shape()});
  order.insert(order.end(), types.begin() + static_cast<std::ptrdiff_t>(carries), types.end());
  absl::StatusOr<Graph> body =
      num_k == 0 ? std::move(traced)
                 : trace(
                       [&](const std::vector<Value>& in) {
                         const std::vector<Value> k = range(in, carries, carries + num_k);
                         std::vector<Value> out = internal::inline_graph(
                             *traced, concat(concat(range(in, 0, carries), range(in, carries + num_k, in.size())), k));
                         return concat(concat(range(out, 0, carries), k), range(out, carries, out.size()));
                       },
                       order);
  if (!body.ok()) return fail(absl::StrCat("its body: ", body.status().message()));
  auto shared = std::make_shared<const Graph>(*std::move(body));
  std::vector<int> operands;
  for (const Value& v : concat(concat(init, consts), xs)) operands.push_back(TraceState::id(v));
  ScanResult out;
  for (size_t j = 0; j < shared->outputs().size(); ++j) {
    if (j >= carries && j < carries + num_k) continue;  // a const: the loop's own
    Node n;
    n.op = Op::kScan;
    n.operands = operands;
    n.attributes = ScanAttrs{shared, *length, reverse, static_cast<int64_t>(carries + num_k), static_cast<int64_t>(j)};
    Value v = t->make(t->graph.add_node(std::move(n)));
    if (!v.ok()) return failed;
    (j < carries ? out.carry : out.ys).push_back(v);
  }
  return out;
}

std::vector<Value> fori_loop(int64_t lower, int64_t upper, const ForiBody& body, const std::vector<Value>& init) {
  std::vector<Value> none, operands = init;
  TraceState* t = trace_of(operands, none);
  if (t == nullptr) return std::vector<Value>(init.size());
  TraceState* outer = TraceState::current;
  TraceState::current = t;  // the counter's constant goes into the operands' trace
  const Value i0 = full({}, static_cast<double>(lower), DType::kI32);
  TraceState::current = outer;
  std::vector<Value> carry = concat({i0}, operands);
  ScanResult r = scan(
      [&body](const std::vector<Value>& c, const std::vector<Value>&) {
        std::vector<Value> rest(c.begin() + 1, c.end());
        std::vector<Value> next = {c[0] + 1};
        std::vector<Value> out = body(c[0], rest);
        next.insert(next.end(), out.begin(), out.end());
        return ScanStep{next, {}};
      },
      carry, {}, std::max<int64_t>(0, upper - lower));
  return std::vector<Value>(r.carry.begin() + 1, r.carry.end());
}

}  // namespace tessera

// ---- while_loop, switch, cond, checkpoint ----------------------------------------------------

namespace tessera {
namespace {

using internal::TraceState;

std::vector<ArrayType> types_of(const std::vector<Value>& values) {
  std::vector<ArrayType> out;
  for (const Value& v : values) out.push_back({v.dtype(), v.shape()});
  return out;
}

std::string types_text(const std::vector<ArrayType>& types) {
  std::string out;
  for (const ArrayType& t : types) absl::StrAppend(&out, out.empty() ? "" : ", ", type_to_string(t.dtype, t.shape));
  return "(" + out + ")";
}

// One function of a while loop or switch traced into a sub-graph of trace t: its graph
// (parameters: its inputs, then the outer values it read, `consts`).
struct SubGraph {
  Graph graph;
  std::vector<Value> consts;
};

// `g` (parameters: `inputs` then its consts) as a graph of the inputs then all of `all`
// (where each of its consts is, by node; `all` grows by the ones missing), returning its
// results and, when `hand_on`, `all` after them (a while body's loop invariants).
absl::StatusOr<Graph> over_consts(const SubGraph& g, const std::vector<ArrayType>& inputs,
                                  const std::vector<Value>& all, bool hand_on) {
  std::vector<size_t> where;
  for (const Value& k : g.consts) {
    for (size_t j = 0; j < all.size(); ++j) {
      if (all[j].node() == k.node()) where.push_back(j);
    }
  }
  std::vector<ArrayType> types = inputs;
  for (const Value& k : all) types.push_back({k.dtype(), k.shape()});
  const size_t n = inputs.size();
  return trace(
      [&](const std::vector<Value>& in) {
        std::vector<Value> args = range(in, 0, n);
        for (size_t w : where) args.push_back(in[n + w]);
        std::vector<Value> out = internal::inline_graph(g.graph, args);
        return hand_on ? concat(out, range(in, n, in.size())) : out;
      },
      types);
}

// The consts of every sub-graph, each once (by node of trace t).
std::vector<Value> all_consts(const std::vector<SubGraph>& subs) {
  std::vector<Value> all;
  for (const SubGraph& s : subs) {
    for (const Value& k : s.consts) {
      bool seen = false;
      for (const Value& a : all) seen = seen || a.node() == k.node();
      if (!seen) all.push_back(k);
    }
  }
  return all;
}

// Nodes of `op` with BranchesAttrs on `operands`, one per result: the op's results.
std::vector<Value> add_nodes(TraceState* t, Op op, std::vector<std::shared_ptr<const Graph>> graphs,
                             const std::vector<Value>& operands, size_t results, int64_t saved = 0) {
  std::vector<int> ids;
  for (const Value& v : operands) ids.push_back(TraceState::id(v));
  std::vector<Value> out;
  for (size_t j = 0; j < results; ++j) {
    Node n;
    n.op = op;
    n.operands = ids;
    n.attributes = BranchesAttrs{graphs, static_cast<int64_t>(j), saved};
    Value v = t->make(t->graph.add_node(std::move(n)));
    if (!v.ok()) return std::vector<Value>(results);
    out.push_back(v);
  }
  return out;
}

// The trace of `values` (captured into the current body when they are outer values), or null
// with the error recorded. In a shard_map body each device runs the loop or takes the branch
// its own predicate or index says, as JAX's per-device code does.
TraceState* control_trace(std::vector<Value>& values) {
  std::vector<Value> none;
  return trace_of(values, none);
}

}  // namespace

std::vector<Value> while_loop(const WhileCond& cond, const WhileBody& body, const std::vector<Value>& init_in) {
  std::vector<Value> failed(init_in.size()), init = init_in;
  TraceState* t = control_trace(init);
  if (t == nullptr) return failed;
  auto fail = [&](const std::string& m) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("while_loop: ", m)));
    return failed;
  };
  if (init.empty()) return fail("it needs at least one carry");
  const std::vector<ArrayType> types = types_of(init);
  std::optional<std::vector<internal::TypedOperand>> init_types;  // explicit mode
  if (t->explicit_mesh.has_value()) {
    init_types = internal::typed(init);
    if (!init_types.has_value()) return failed;
  }
  const std::vector<internal::TypedOperand> specs =
      init_types.has_value() ? *init_types : std::vector<internal::TypedOperand>{};
  std::vector<SubGraph> subs(2);
  std::vector<ArrayType> pred_type;
  absl::StatusOr<Graph> p = internal::trace_body(
      t,
      [&](const std::vector<Value>& c) {
        const Value v = cond(c);
        if (v.ok()) pred_type = {{v.dtype(), v.shape()}};
        return std::vector<Value>{v};
      },
      types, &subs[0].consts, specs, vma_of(t, init));
  if (!t->error.ok()) return failed;
  if (!p.ok()) return fail(absl::StrCat("cond_fun: ", p.status().message()));
  if (pred_type != std::vector<ArrayType>{{DType::kBool, {}}}) {
    return fail(absl::StrCat("cond_fun must return a bool scalar, not ", types_text(pred_type)));
  }
  subs[0].graph = *std::move(p);
  std::vector<ArrayType> returned;
  absl::StatusOr<Graph> b = internal::trace_body(
      t,
      [&](const std::vector<Value>& c) {
        std::vector<Value> out = body(c);
        returned = types_of(out);
        return out;
      },
      types, &subs[1].consts, specs, vma_of(t, init));
  if (!t->error.ok()) return failed;
  if (!b.ok()) return fail(absl::StrCat("body_fun: ", b.status().message()));
  if (returned.size() == types.size()) {  // as scan's carries
    const std::string mismatch =
        internal::carry_mismatch(t, "while_loop body", init, init_types, *b, concat(init, subs[1].consts));
    if (!mismatch.empty()) {
      t->fail(absl::InvalidArgumentError(mismatch));
      return failed;
    }
  }
  if (returned != types) {
    return fail(absl::StrCat("body_fun returns ", types_text(returned), " for carries ", types_text(types),
                             " (a carry keeps its dtype and shape)"));
  }
  subs[1].graph = *std::move(b);
  const std::vector<Value> consts = all_consts(subs);
  absl::StatusOr<Graph> pg = over_consts(subs[0], types, consts, false);
  absl::StatusOr<Graph> bg = pg.ok() ? over_consts(subs[1], types, consts, true) : pg.status();
  if (!bg.ok()) return fail(std::string(bg.status().message()));
  std::vector<Value> out = add_nodes(
      t, Op::kWhile, {std::make_shared<const Graph>(*std::move(pg)), std::make_shared<const Graph>(*std::move(bg))},
      concat(init, consts), init.size() + consts.size());
  out.resize(init.size());  // the consts' results are the loop's own
  return out;
}

namespace {

bool is_integral(DType d) { return d != DType::kBool && !is_floating(d); }

// lax.switch, its errors naming `op` and each branch by `name(k)`; in explicit mode JAX's
// message for branches whose output types differ compares branch 0 with branch k, or (cond,
// `true_first`) true_fun, branch 1, with false_fun, as conditionals.py's _check_branch_outputs.
// `saved`, when given, is read once the branches are traced: BranchesAttrs::saved.
std::vector<Value> switch_named(const char* op, const std::function<std::string(size_t)>& name, const Value& index_in,
                                const std::vector<Branch>& branches, const std::vector<Value>& operands_in,
                                bool true_first = false, const int64_t* saved = nullptr) {
  // What a failed trace returns: as many invalid values as branch 0 returns once it is
  // known (one before), so that a caller's out[0] is an invalid value, never out of range.
  size_t outputs = 1;
  auto failed = [&] { return std::vector<Value>(outputs); };
  std::vector<Value> values = concat({index_in}, operands_in);
  TraceState* t = control_trace(values);
  if (t == nullptr) return failed();
  auto fail = [&](const std::string& m) {
    t->fail(absl::InvalidArgumentError(absl::StrCat(op, ": ", m)));
    return failed();
  };
  Value index = values[0];
  const std::vector<Value> operands = range(values, 1, values.size());
  if (branches.empty()) return fail("it needs at least one branch");
  if (index.rank() != 0 || !(is_integral(index.dtype()) || index.dtype() == DType::kBool)) {
    return fail(absl::StrCat("the index is ", type_to_string(index.dtype(), index.shape()), ", not an integer scalar"));
  }
  if (index.dtype() != DType::kI32) {  // clamped before it narrows, as lax.switch clamps
    if (index.dtype() != DType::kBool) {
      index =
          clamp(full({}, 0.0, index.dtype()), index, full({}, static_cast<double>(branches.size() - 1), index.dtype()));
    }
    index = convert(index, DType::kI32);
  }
  const std::vector<ArrayType> types = types_of(operands);
  std::optional<std::vector<internal::TypedOperand>> operand_types;  // explicit mode
  if (t->explicit_mesh.has_value()) {
    operand_types = internal::typed(operands);
    if (!operand_types.has_value()) return failed();
  }
  const std::vector<internal::TypedOperand> specs =
      operand_types.has_value() ? *operand_types : std::vector<internal::TypedOperand>{};
  std::vector<SubGraph> subs(branches.size());
  std::vector<std::vector<ArrayType>> results(branches.size());
  std::vector<std::vector<internal::TypedOperand>> typed_results(branches.size());
  std::vector<std::vector<std::vector<std::string>>> varying(branches.size());  // per branch, per result
  for (size_t k = 0; k < branches.size(); ++k) {
    absl::StatusOr<Graph> g = internal::trace_body(
        t,
        [&](const std::vector<Value>& in) {
          std::vector<Value> out = branches[k](in);
          results[k] = types_of(out);
          return out;
        },
        types, &subs[k].consts, specs, vma_of(t, operands));
    if (k == 0) outputs = std::max<size_t>(1, results[0].size());
    if (!t->error.ok()) return failed();
    if (!g.ok()) return fail(absl::StrCat(name(k), ": ", g.status().message()));
    // In a shard_map body with check_vma a type has its varying manual axes too, which the
    // branches must agree on (conditionals.py's _check_branch_outputs: core.typematch compares
    // them; JAX inserts no pvary there).
    std::vector<int> params;
    for (const Value& v : concat(operands, subs[k].consts)) params.push_back(TraceState::id(v));
    varying[k] = t->outputs_varying(*g, params);
    if (operand_types.has_value()) {
      typed_results[k] = internal::output_types(*g, *t->explicit_mesh, results[k].size());
    } else {
      for (size_t j = 0; j < g->outputs().size(); ++j) {
        const Node& r = g->node(g->outputs()[j]);
        typed_results[k].push_back({r.dtype, r.shape, internal::TypeSpec(r.shape.size())});
      }
    }
    if ((operand_types.has_value() || varying[k] != varying[0]) && results[k].size() == results[0].size()) {
      const size_t a = true_first ? k : 0, b = true_first ? 0 : k;
      const std::string mismatch = internal::branch_type_mismatch(op, name(a), name(b), typed_results[a],
                                                                  typed_results[b], varying[a], varying[b]);
      if (!mismatch.empty()) {
        t->fail(absl::InvalidArgumentError(mismatch));
        return failed();
      }
    }
    if (results[k] != results[0]) {
      return fail(absl::StrCat(name(k), " returns ", types_text(results[k]), " but ", name(0), " returns ",
                               types_text(results[0]), " (every branch must return the same dtypes and shapes)"));
    }
    subs[k].graph = *std::move(g);
  }
  if (results[0].empty()) return fail("the branches return nothing");
  const std::vector<Value> consts = all_consts(subs);
  std::vector<std::shared_ptr<const Graph>> graphs;
  for (const SubGraph& s : subs) {
    absl::StatusOr<Graph> g = over_consts(s, types, consts, false);
    if (!g.ok()) return fail(std::string(g.status().message()));
    graphs.push_back(std::make_shared<const Graph>(*std::move(g)));
  }
  return add_nodes(t, Op::kSwitch, std::move(graphs), concat(concat({index}, operands), consts), results[0].size(),
                   saved == nullptr ? 0 : *saved);
}

}  // namespace

std::vector<Value> switch_(const Value& index, const std::vector<Branch>& branches,
                           const std::vector<Value>& operands) {
  return switch_named(
      "switch", [](size_t k) { return absl::StrCat("branch ", k); }, index, branches, operands);
}

std::vector<Value> cond(const Value& pred, const Branch& on_true, const Branch& on_false,
                        const std::vector<Value>& operands) {
  Value p = pred;
  if (p.ok() && p.rank() != 0) {
    TraceState::of(p)->fail(absl::InvalidArgumentError(
        absl::StrCat("cond: the predicate is ", type_to_string(p.dtype(), p.shape()), ", not a scalar")));
    return std::vector<Value>(1);  // invalid, as switch_named's failures
  }
  if (p.ok() && p.dtype() != DType::kBool) p = p != full({}, 0.0, p.dtype());  // a number: nonzero is true
  return switch_named(
      "cond", [](size_t k) { return std::string(k == 0 ? "false_fun" : "true_fun"); }, p, {on_false, on_true}, operands,
      /*true_first=*/true);
}

namespace checkpoint_policies {
bool everything_saveable(const SaveableOp&) { return true; }
bool nothing_saveable(const SaveableOp&) { return false; }
bool dots_saveable(const SaveableOp& op) { return op.primitive == "dot_general"; }
bool dots_with_no_batch_dims_saveable(const SaveableOp& op) {
  return op.primitive == "dot_general" && op.lhs_batch.empty() && op.rhs_batch.empty();
}
}  // namespace checkpoint_policies

namespace {

// What `policy` keeps of the values f's `results` are computed from in body trace `t` (not
// its parameters: the arguments, which the VJP has anyway). A result may be kept too
// (returned twice): the VJP reads kept values only.
std::vector<Value> kept_by(const CheckpointPolicy& policy, TraceState* t, const std::vector<Value>& results) {
  std::vector<bool> needed(t->graph.size(), false);
  for (const Value& r : results) {
    if (r.ok() && TraceState::of(r) == t) needed[TraceState::id(r)] = true;
  }
  for (int id = t->graph.size() - 1; id >= 0; --id) {
    if (!needed[id]) continue;
    for (int o : t->graph.node(id).operands) needed[o] = true;
  }
  std::vector<Value> kept;
  for (int id = 0; id < t->graph.size(); ++id) {
    const Node& n = t->graph.node(id);
    if (!needed[id] || n.op == Op::kParameter) continue;
    SaveableOp op;
    op.primitive = op_name(n.op);
    if (n.op == Op::kDotGeneral) {
      const DotDims& d = n.attrs<DotAttrs>().dims;
      op.lhs_contracting = d.lhs_contracting;
      op.rhs_contracting = d.rhs_contracting;
      op.lhs_batch = d.lhs_batch;
      op.rhs_batch = d.rhs_batch;
    }
    if (policy(op)) kept.push_back(t->make(id));
  }
  return kept;
}

}  // namespace

TracedFunction checkpoint(TracedFunction f, CheckpointPolicy policy) {
  return [f = std::move(f), policy = std::move(policy)](const std::vector<Value>& args) -> std::vector<Value> {
    std::vector<Value> in = args;
    TraceState* t = control_trace(in);
    if (t == nullptr) return std::vector<Value>(1);
    TraceState* outer = TraceState::current;
    TraceState::current = t;
    const Value zero = full({}, 0, DType::kI32);
    TraceState::current = outer;
    size_t results = 0;
    int64_t saved = 0;
    std::vector<Value> out = switch_named(
        "checkpoint", [](size_t) { return std::string("f"); }, zero, {[&](const std::vector<Value>& a) {
          std::vector<Value> r = f(a);
          results = r.size();
          if (policy == nullptr || !TraceState::current->error.ok()) return r;
          const std::vector<Value> kept = kept_by(policy, TraceState::current, r);
          saved = static_cast<int64_t>(kept.size());
          return concat(r, kept);
        }},
        in, false, &saved);
    if (out.size() > results) out.resize(results);  // the kept values are the VJP's
    return out;
  };
}

}  // namespace tessera

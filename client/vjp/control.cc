// VJPs of control flow: scan, switch (and so cond and checkpoint); while_loop has none.
#include <algorithm>
#include <cassert>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/vjp/vjp.h"
#include "core/status.h"

namespace tessera::internal {
namespace {

std::vector<Value> concat(std::vector<Value> a, const std::vector<Value>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// Explicit mode: each of `values`' types (nullopt outside it). A cotangent has its primal's
// type, as JAX's transposes give it (so a backward carry keeps its type through the loop, and
// every backward branch returns the operands' types).
std::vector<std::optional<TypedOperand>> types_of(const std::vector<Value>& values) {
  std::vector<std::optional<TypedOperand>> out;
  for (const Value& v : values) out.push_back(typed_operand(v));
  return out;
}
Value as_type(const Value& v, const std::optional<TypedOperand>& type) {
  return type.has_value() && v.ok() ? reshard(v, to_partition_spec(type->spec)) : v;
}

// How each node of a scan's joint body (primal carries and rows, then cotangents: the body's
// VJP) depends on its inputs; a node takes the first class that applies.
enum class Needs {
  kCotangent,  // reads a cotangent: the backward pass proper
  kCaptured,   // reads a value of the enclosing trace: recomputed in the backward body
  kVarying,    // reads a carry that changes, or a row: the forward loop saves what is read
  kInvariant,  // loop invariants and constants only: recomputed in the backward body
};

std::vector<Needs> classify(const Graph& g, size_t primals, size_t inputs, const std::vector<bool>& invariant) {
  std::vector<Needs> c(g.size(), Needs::kInvariant);
  for (int id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    if (n.op == Op::kParameter) {
      const auto p = static_cast<size_t>(n.attrs<ParameterAttrs>().index);
      c[id] = p >= inputs                            ? Needs::kCaptured
              : p >= primals                         ? Needs::kCotangent
              : p < invariant.size() && invariant[p] ? Needs::kInvariant
                                                     : Needs::kVarying;
      continue;
    }
    for (int o : n.operands) c[id] = std::min(c[id], c[o]);
  }
  return c;
}

// A node's identity within one graph: op, type, operands and attributes.
std::string node_key(const Node& n) {
  return absl::StrCat(static_cast<int>(n.op), " ", type_to_string(n.dtype, n.shape), " ",
                      absl::StrJoin(n.operands, ","), attrs_to_text(n));
}

// The forward body `body` extended by the joint graph's `results` (node ids whose class is
// kVarying or kInvariant): their nodes appended where `body` lacks them, as extra results. A
// joint parameter below `primals` is the body's parameter of that index. The compiler runs the
// forward scan and the scan of the extension as one loop (coordinator/compiler/rules_control.cc).
absl::StatusOr<Graph> extend_body(const Graph& body, const Graph& joint, const std::vector<int>& results) {
  Graph out = body;
  std::map<std::string, int> known;
  for (int id = 0; id < body.size(); ++id) {
    if (body.node(id).op != Op::kParameter) known.emplace(node_key(body.node(id)), id);
  }
  std::vector<int> at(joint.size(), -1);  // joint id -> out id
  std::function<absl::StatusOr<int>(int)> add = [&](int id) -> absl::StatusOr<int> {
    if (at[id] >= 0) return at[id];
    Node n = joint.node(id);
    if (n.op == Op::kParameter) return at[id] = body.parameters()[n.attrs<ParameterAttrs>().index];
    for (int& o : n.operands) {
      TESSERA_ASSIGN_OR_RETURN(o, add(o));
    }
    const std::string key = node_key(n);
    if (auto it = known.find(key); it != known.end()) return at[id] = it->second;
    TESSERA_ASSIGN_OR_RETURN(const int made, out.add_node(std::move(n)));
    known.emplace(key, made);
    return at[id] = made;
  };
  std::vector<int> outputs = body.outputs();
  for (int r : results) {
    TESSERA_ASSIGN_OR_RETURN(const int made, add(r));
    outputs.push_back(made);
  }
  TESSERA_RETURN_IF_ERROR(out.set_outputs(std::move(outputs)));
  return out;
}

// JAX's scan transpose with partial evaluation (jax/_src/lax/control_flow/loops.py,
// _scan_partial_eval): the body's VJP is traced once as a joint body of (carry_t, x_t) and the
// cotangents; the values of it that depend on the iteration but not on the cotangents and that
// the backward part reads (residuals) become extra stacked results of the forward loop itself —
// the forward scan's body extended, which the compiler runs as the same loop — and the backward
// scan reads them by row instead of computing the forward again. What depends only on loop
// invariants (a weight's transpose) is recomputed in the backward body rather than stacked. A
// residual that is a row of an xs is read from the xs. Carries the body hands on unchanged
// (captured consts: loop invariants) have cotangents that are carries of the backward scan, so
// they sum over the iterations.
absl::Status scan_vjp(const VjpArgs& a) {
  const ScanAttrs& s = a.node.attrs<ScanAttrs>();
  const Graph& body = *s.body;
  const size_t carries = static_cast<size_t>(s.num_carry);
  const size_t results = body.outputs().size();
  const std::vector<Value> init(a.x.begin(), a.x.begin() + static_cast<std::ptrdiff_t>(carries));
  const std::vector<Value> xs(a.x.begin() + static_cast<std::ptrdiff_t>(carries), a.x.end());
  // The cotangents of every result of this scan: this node's, and its other nodes'.
  std::vector<Value> ct(results);
  const int self = TraceState::id(a.out);
  for (int id = 0; id < a.trace->graph.size(); ++id) {
    const Node& m = a.trace->graph.node(id);
    if (m.op != Op::kScan || m.operands != a.node.operands) continue;
    const ScanAttrs& r = m.attrs<ScanAttrs>();
    if (r.body != s.body || r.length != s.length || r.reverse != s.reverse || r.num_carry != s.num_carry) continue;
    ct[r.output] = id == self ? a.g : a.take_cotangent(id);
  }
  for (size_t j = 0; j < results; ++j) {  // none: zero (of the result's type)
    if (ct[j].ok()) continue;
    const Node& out = body.node(body.outputs()[j]);
    Shape shape = out.shape;
    if (j >= carries) shape.insert(shape.begin(), s.length);
    ct[j] = full(shape, 0.0, out.dtype);
  }
  // A carry the body hands on unchanged (a captured const, a weight) is a loop invariant.
  std::vector<bool> invariant(carries);
  for (size_t k = 0; k < carries; ++k) {
    const Node& r = body.node(body.outputs()[k]);
    invariant[k] = r.op == Op::kParameter && r.attrs<ParameterAttrs>().index == static_cast<int64_t>(k);
    for (size_t j = 0; j < k; ++j) {  // one value twice: the VJP's primals must be distinct
      if (invariant[j] && a.node.operands[j] == a.node.operands[k]) invariant[k] = false;
    }
  }
  const std::vector<std::optional<TypedOperand>> carry_types = types_of(init);
  std::vector<Value> ct_carry(ct.begin(), ct.begin() + static_cast<std::ptrdiff_t>(carries));
  for (size_t k = 0; k < carries; ++k) ct_carry[k] = as_type(ct_carry[k], carry_types[k]);
  const std::vector<Value> ct_ys(ct.begin() + static_cast<std::ptrdiff_t>(carries), ct.end());

  // The joint body: (carries, rows, carries' cotangents, ys rows' cotangents) -> (the carries'
  // and rows' cotangents, then the residuals).
  const size_t primals = carries + xs.size();
  const size_t inputs = primals + results;
  std::vector<ArrayType> types;
  std::vector<TypedOperand> specs;
  const bool typed = a.trace->explicit_mesh.has_value();
  auto add_input = [&](const Value& v, bool row) {
    Shape shape = v.shape();
    if (row) shape.erase(shape.begin());
    types.push_back({v.dtype(), shape});
    if (!typed) return;
    std::optional<TypedOperand> t = typed_operand(v);
    TypedOperand in = t.has_value() ? *std::move(t) : TypedOperand{v.dtype(), v.shape(), TypeSpec(v.shape().size())};
    if (row && !in.spec.empty()) in.spec.erase(in.spec.begin());
    in.shape = shape;
    specs.push_back(std::move(in));
  };
  for (const Value& v : init) add_input(v, false);
  for (const Value& v : xs) add_input(v, true);
  for (const Value& v : ct_carry) add_input(v, false);
  for (const Value& v : ct_ys) add_input(v, true);
  std::vector<int> residuals;  // joint node ids
  std::vector<Value> captured;
  absl::StatusOr<Graph> joint = trace_body(
      a.trace,
      [&](const std::vector<Value>& in) {
        const std::vector<Value> at(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(primals));
        const std::vector<Value> cts(in.begin() + static_cast<std::ptrdiff_t>(primals), in.end());
        std::vector<Value> d = vjp([&](const std::vector<Value>& p) { return inline_graph(body, p); }, at, cts);
        for (size_t k = 0; k < carries; ++k) d[k] = as_type(d[k], carry_types[k]);
        // The residuals: varying values the backward part, or the results, read.
        TraceState* t = TraceState::current;
        const Graph& g = t->graph;
        const std::vector<Needs> c = classify(g, primals, inputs, invariant);
        std::vector<bool> residual(g.size(), false);
        auto backward = [&](int id) { return c[id] == Needs::kCotangent || c[id] == Needs::kCaptured; };
        for (int id = 0; id < g.size(); ++id) {
          if (!backward(id)) continue;
          for (int o : g.node(id).operands) residual[o] = residual[o] || c[o] == Needs::kVarying;
        }
        for (const Value& v : d) {
          if (v.ok() && TraceState::of(v) == t && c[TraceState::id(v)] == Needs::kVarying) {
            residual[TraceState::id(v)] = true;
          }
        }
        // A broadcast is rebuilt in the backward body from its operand (saved in its stead)
        // rather than stacked `length` times at its broadcast size.
        for (int id = g.size() - 1; id >= 0; --id) {
          if (!residual[id] || g.node(id).op != Op::kBroadcastInDim) continue;
          residual[id] = false;
          const int o = g.node(id).operands[0];
          // A residual is varying, and a broadcast has its one operand's class: the operand is
          // varying too.
          assert(c[o] == Needs::kVarying);
          residual[o] = true;
        }
        for (int id = 0; id < g.size(); ++id) {
          if (!residual[id]) continue;
          residuals.push_back(id);
          d.push_back(t->make(id));
        }
        return d;
      },
      types, &captured, specs);
  if (!a.trace->error.ok()) return a.trace->error;
  if (!joint.ok()) return joint.status();
  // Each residual's stack: an xs itself for a row, else a result of the extended forward loop.
  std::vector<int> extra;  // joint output ids the forward loop adds
  for (size_t i = 0; i < residuals.size(); ++i) {
    const Node& r = joint->node(residuals[i]);
    const bool row = r.op == Op::kParameter && static_cast<size_t>(r.attrs<ParameterAttrs>().index) >= carries;
    if (!row) extra.push_back(joint->outputs()[primals + i]);
  }
  TESSERA_ASSIGN_OR_RETURN(Graph extended, extend_body(body, *joint, extra));
  auto forward = std::make_shared<const Graph>(std::move(extended));
  std::vector<Value> stacks;
  for (size_t i = 0, next = 0; i < residuals.size(); ++i) {
    const Node& r = joint->node(residuals[i]);
    if (r.op == Op::kParameter && static_cast<size_t>(r.attrs<ParameterAttrs>().index) >= carries) {
      stacks.push_back(xs[static_cast<size_t>(r.attrs<ParameterAttrs>().index) - carries]);
      continue;
    }
    Node n;
    n.op = Op::kScan;
    n.operands = a.node.operands;
    n.attributes = ScanAttrs{forward, s.length, s.reverse, s.num_carry, static_cast<int64_t>(results + next++)};
    stacks.push_back(a.trace->make(a.trace->graph.add_node(std::move(n))));
  }
  if (!a.trace->error.ok()) return a.trace->error;
  // Backwards: carry the carries' cotangents; per row, the joint body's backward part on the
  // residuals' rows.
  std::vector<size_t> wanted(primals);
  for (size_t j = 0; j < primals; ++j) wanted[j] = j;
  const size_t num_res = residuals.size();
  std::vector<Value> floating_xs;  // read for their rows' layouts
  for (const Value& x : xs) {
    if (is_floating(x.dtype())) floating_xs.push_back(x);
  }
  ScanResult back = scan(
      [&](const std::vector<Value>& dc, const std::vector<Value>& row) {
        std::vector<Value> args(inputs);
        for (size_t k = 0; k < carries; ++k) {
          if (invariant[k]) args[k] = TraceState::local(init[k]);
          args[primals + k] = dc[k];
        }
        for (size_t j = 0; j + carries < results; ++j) args[primals + carries + j] = row[num_res + j];
        for (const Value& v : captured) args.push_back(TraceState::local(v));
        std::map<int, Value> given;
        for (size_t i = 0; i < num_res; ++i) given.emplace(residuals[i], row[i]);
        std::vector<Value> d = inline_graph(*joint, args, given, wanted);
        std::vector<Value> d_carry(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(carries));
        std::vector<Value> d_x(d.begin() + static_cast<std::ptrdiff_t>(carries), d.end());
        // Each row's cotangent laid out as the row: a gradient summed over a split batch is
        // reduce-scattered to a weight's split (FSDP) rather than all-reduced whole.
        for (size_t k = 0, next = num_res + (results - carries); k < xs.size(); ++k) {
          if (!is_floating(xs[k].dtype())) continue;
          const Value& x_row = row[next++];
          if (d_x[k].ok()) d_x[k] = sharded_like(d_x[k], x_row);
        }
        return ScanStep{d_carry, d_x};
      },
      ct_carry, concat(concat(stacks, ct_ys), floating_xs), s.length, !s.reverse);
  // A failed scan records its error and returns no ys: stop before reading them.
  if (!a.trace->error.ok()) return a.trace->error;
  for (size_t k = 0; k < carries; ++k) a.add(k, back.carry[k]);
  for (size_t k = 0; k < xs.size(); ++k) a.add(carries + k, back.ys[k]);
  return absl::OkStatus();
}

// As JAX (jax/_src/lax/control_flow/loops.py, _while_transpose_error): a while loop's trip
// count is known only when it runs, so there is no reverse-mode rule.
absl::Status while_vjp(const VjpArgs&) {
  return absl::InvalidArgumentError(
      "while_loop: reverse-mode differentiation does not work for lax.while_loop (its trip count is known only at run "
      "time); use scan or fori_loop with static bounds");
}

// A switch's VJP is a switch on the same index over the branches' VJPs (JAX's cond transpose):
// branch b's backward is the VJP of branch b at the operands, its forward recomputed there, so
// the cotangent goes through the taken branch only and nothing of the forward is kept. This is
// also checkpoint's: its function is a one-branch switch. A checkpoint with a saving policy
// returns the values it keeps after f's results (BranchesAttrs::saved): its backward reads
// them, as JAX's remat partial evaluation does with the policy's residuals
// (jax/_src/ad_checkpoint.py, remat_partial_eval). f's VJP is recorded as without them, then
// every use of a kept node reads the kept value instead (Graph::replace_uses), so the node,
// and what only it needed, is not computed again: the compiler drops them as dead code.
absl::Status switch_vjp(const VjpArgs& a) {
  const BranchesAttrs& s = a.node.attrs<BranchesAttrs>();
  const Graph& first = *s.graphs[0];
  const size_t outputs = first.outputs().size();
  const size_t results = outputs - static_cast<size_t>(s.saved);
  std::vector<Value> ct(outputs), kept(outputs - results);
  const int self = TraceState::id(a.out);
  for (int id = 0; id < a.trace->graph.size(); ++id) {
    const Node& m = a.trace->graph.node(id);
    if (m.op != Op::kSwitch || m.operands != a.node.operands || m.attrs<BranchesAttrs>().graphs != s.graphs) continue;
    const size_t j = static_cast<size_t>(m.attrs<BranchesAttrs>().output);
    ct[j] = id == self ? a.g : a.take_cotangent(id);
    if (j >= results) kept[j - results] = a.trace->make(id);
  }
  // A kept value with a cotangent (grad of grad: the first backward pass read it) is one more
  // result of f to differentiate; then f's VJP recomputes everything, reading nothing kept.
  bool kept_differentiated = false;
  for (size_t j = results; j < outputs; ++j) kept_differentiated = kept_differentiated || ct[j].ok();
  const size_t differentiated = kept_differentiated ? outputs : results;
  const size_t saved = kept_differentiated ? 0 : outputs - results;
  ct.resize(differentiated);
  if (saved == 0) kept.clear();
  for (size_t j = 0; j < differentiated; ++j) {
    if (!ct[j].ok()) ct[j] = full(first.node(first.outputs()[j]).shape, 0.0, first.node(first.outputs()[j]).dtype);
  }
  for (size_t j = 0; j < saved; ++j) {  // a kept value nothing read in the forward pass
    if (kept[j].ok()) continue;
    Node m = a.node;
    m.attrs<BranchesAttrs>().output = static_cast<int64_t>(results + j);
    kept[j] = a.trace->make(a.trace->graph.add_node(std::move(m)));
  }
  const std::vector<Value> operands(a.x.begin() + 1, a.x.end());
  const size_t n = operands.size();
  const std::vector<std::optional<TypedOperand>> operand_types = types_of(operands);
  std::vector<size_t> wanted(differentiated);
  for (size_t j = 0; j < differentiated; ++j) wanted[j] = j;
  std::vector<Branch> backward;
  for (const std::shared_ptr<const Graph>& g : s.graphs) {
    backward.push_back([g, n, saved, &wanted, &operand_types](const std::vector<Value>& in) {
      const auto at = [&in](size_t k) { return in.begin() + static_cast<std::ptrdiff_t>(k); };
      const std::vector<Value> primals(in.begin(), at(n)), kept_in(at(n), at(n + saved)), cts(at(n + saved), in.end());
      std::vector<int> recorded;
      std::vector<Value> d =
          vjp([&](const std::vector<Value>& p) { return inline_graph(*g, p, {}, wanted, &recorded); }, primals, cts);
      TraceState* t = TraceState::current;
      for (size_t j = 0; j < saved && t->error.ok(); ++j) {
        const int node = recorded.empty() ? -1 : recorded[g->outputs()[wanted.size() + j]];
        const int kept_id = TraceState::id(kept_in[j]);
        if (node <= kept_id) continue;  // nothing f's results need (or not a node of f's VJP)
        const absl::Status replaced = t->graph.replace_uses(node, kept_id);
        if (!replaced.ok()) t->fail(replaced);
      }
      for (size_t k = 0; k < d.size() && k < operand_types.size(); ++k) d[k] = as_type(d[k], operand_types[k]);
      return d;
    });
  }
  const std::vector<Value> d = switch_(a.x[0], backward, concat(concat(operands, kept), ct));
  if (!a.trace->error.ok()) return a.trace->error;
  for (size_t k = 0; k < n && k < d.size(); ++k) a.add(1 + k, d[k]);
  return absl::OkStatus();
}

}  // namespace

absl::Span<const VjpEntry> control_vjps() {
  static const VjpEntry kRules[] = {
      {Op::kScan, scan_vjp},
      {Op::kWhile, while_vjp},
      {Op::kSwitch, switch_vjp},
  };
  return kRules;
}

}  // namespace tessera::internal

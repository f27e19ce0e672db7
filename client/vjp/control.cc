// VJPs of control flow: scan, switch (and so cond and checkpoint); while_loop has none.
//
// The simplest correct form (JAX's scan transpose, without its partial evaluation): a second
// forward scan saves the carry entering each iteration, stacked; the backward pass is a scan
// the other way over (saved carry, x, cotangent of y) rows whose body is the VJP of the forward
// body at (carry_t, x_t) — the body's forward recomputed inside it — carrying the carries'
// cotangents. Its final carry is the cotangent of the initial carries, its stacked ys those of
// the xs. Carries the body hands on unchanged (captured consts: loop invariants) are not
// saved; their cotangents are carries of the backward scan, so they sum over the iterations.
#include <optional>

#include "client/vjp/vjp.h"

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
  // A carry the body hands on unchanged (a captured const, a weight) is a loop invariant: it
  // is not saved per row; the backward body reads it as a const of its own.
  std::vector<bool> invariant(carries);
  for (size_t k = 0; k < carries; ++k) {
    const Node& r = body.node(body.outputs()[k]);
    invariant[k] = r.op == Op::kParameter && r.attrs<ParameterAttrs>().index == static_cast<int64_t>(k);
    for (size_t j = 0; j < k; ++j) {  // one value twice: the VJP's primals must be distinct
      if (invariant[j] && a.node.operands[j] == a.node.operands[k]) invariant[k] = false;
    }
  }
  // The other carries entering each iteration, stacked by row.
  ScanResult saved = scan(
      [&](const std::vector<Value>& c, const std::vector<Value>& x) {
        std::vector<Value> out = inline_graph(body, concat(c, x));
        out.resize(carries);
        std::vector<Value> entering;
        for (size_t k = 0; k < carries; ++k) {
          if (!invariant[k]) entering.push_back(c[k]);
        }
        return ScanStep{out, entering};
      },
      init, xs, s.length, s.reverse);
  const size_t num_saved = saved.ys.size();
  // Backwards: carry the carries' cotangents; per row, the body's VJP at (carry_t, x_t).
  const std::vector<std::optional<TypedOperand>> carry_types = types_of(init);
  std::vector<Value> ct_carry(ct.begin(), ct.begin() + static_cast<std::ptrdiff_t>(carries));
  for (size_t k = 0; k < carries; ++k) ct_carry[k] = as_type(ct_carry[k], carry_types[k]);
  const std::vector<Value> ct_ys(ct.begin() + static_cast<std::ptrdiff_t>(carries), ct.end());
  ScanResult back = scan(
      [&](const std::vector<Value>& dc, const std::vector<Value>& row) {
        std::vector<Value> at;
        for (size_t k = 0, next = 0; k < carries; ++k)
          at.push_back(invariant[k] ? TraceState::local(init[k]) : row[next++]);
        for (size_t k = 0; k < xs.size(); ++k) at.push_back(row[num_saved + k]);
        const std::vector<Value> dy(row.begin() + static_cast<std::ptrdiff_t>(num_saved + xs.size()), row.end());
        std::vector<Value> d =
            vjp([&](const std::vector<Value>& in) { return inline_graph(body, in); }, at, concat(dc, dy));
        std::vector<Value> d_carry(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(carries));
        for (size_t k = 0; k < carries; ++k) d_carry[k] = as_type(d_carry[k], carry_types[k]);
        const std::vector<Value> d_x(d.begin() + static_cast<std::ptrdiff_t>(carries), d.end());
        return ScanStep{d_carry, d_x};
      },
      ct_carry, concat(concat(saved.ys, xs), ct_ys), s.length, !s.reverse);
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
// also checkpoint's: its function is a one-branch switch.
absl::Status switch_vjp(const VjpArgs& a) {
  const BranchesAttrs& s = a.node.attrs<BranchesAttrs>();
  const Graph& first = *s.graphs[0];
  const size_t results = first.outputs().size();
  std::vector<Value> ct(results);
  const int self = TraceState::id(a.out);
  for (int id = 0; id < a.trace->graph.size(); ++id) {
    const Node& m = a.trace->graph.node(id);
    if (m.op != Op::kSwitch || m.operands != a.node.operands || m.attrs<BranchesAttrs>().graphs != s.graphs) continue;
    const int64_t j = m.attrs<BranchesAttrs>().output;
    ct[j] = id == self ? a.g : a.take_cotangent(id);
  }
  for (size_t j = 0; j < results; ++j) {
    if (!ct[j].ok()) ct[j] = full(first.node(first.outputs()[j]).shape, 0.0, first.node(first.outputs()[j]).dtype);
  }
  const std::vector<Value> operands(a.x.begin() + 1, a.x.end());
  const size_t n = operands.size();
  const std::vector<std::optional<TypedOperand>> operand_types = types_of(operands);
  std::vector<Branch> backward;
  for (const std::shared_ptr<const Graph>& g : s.graphs) {
    backward.push_back([g, n, &operand_types](const std::vector<Value>& in) {
      const std::vector<Value> primals(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(n));
      const std::vector<Value> cts(in.begin() + static_cast<std::ptrdiff_t>(n), in.end());
      std::vector<Value> d = vjp([&g](const std::vector<Value>& p) { return inline_graph(*g, p); }, primals, cts);
      for (size_t k = 0; k < d.size() && k < operand_types.size(); ++k) d[k] = as_type(d[k], operand_types[k]);
      return d;
    });
  }
  const std::vector<Value> d = switch_(a.x[0], backward, concat(operands, ct));
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

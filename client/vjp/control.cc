// VJPs of control flow: scan.
//
// The simplest correct form (JAX's scan transpose, without its partial evaluation): a second
// forward scan saves the carry entering each iteration, stacked; the backward pass is a scan
// the other way over (saved carry, x, cotangent of y) rows whose body is the VJP of the forward
// body at (carry_t, x_t) — the body's forward recomputed inside it — carrying the carries'
// cotangents. Its final carry is the cotangent of the initial carries, its stacked ys those of
// the xs.
#include "client/vjp/vjp.h"

namespace tessera::internal {
namespace {

// `g` recorded in the current trace on `args` (its parameters, in order): its outputs.
std::vector<Value> inline_graph(const Graph& g, const std::vector<Value>& args) {
  std::vector<Value> value(g.size());
  TraceState* t = args.empty() ? TraceState::current : TraceState::of(args[0]);
  for (int id = 0; id < g.size(); ++id) {
    Node n = g.node(id);
    if (n.op == Op::kParameter) {
      value[id] = args[n.attrs<ParameterAttrs>().index];
      continue;
    }
    for (int& o : n.operands) {
      if (!value[o].ok()) return std::vector<Value>(g.outputs().size());
      o = TraceState::id(value[o]);
    }
    value[id] = t->make(t->graph.add_node(std::move(n)));
  }
  std::vector<Value> out;
  for (int o : g.outputs()) out.push_back(value[o]);
  return out;
}

std::vector<Value> concat(std::vector<Value> a, const std::vector<Value>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
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
  // The carry entering each iteration, stacked by row.
  ScanResult saved = scan(
      [&](const std::vector<Value>& c, const std::vector<Value>& x) {
        std::vector<Value> out = inline_graph(body, concat(c, x));
        out.resize(carries);
        return ScanStep{out, c};
      },
      init, xs, s.length, s.reverse);
  // Backwards: carry the carries' cotangents; per row, the body's VJP at (carry_t, x_t).
  const std::vector<Value> ct_carry(ct.begin(), ct.begin() + static_cast<std::ptrdiff_t>(carries));
  const std::vector<Value> ct_ys(ct.begin() + static_cast<std::ptrdiff_t>(carries), ct.end());
  const size_t primals = a.x.size();
  ScanResult back = scan(
      [&](const std::vector<Value>& dc, const std::vector<Value>& row) {
        const std::vector<Value> at(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(primals));
        const std::vector<Value> dy(row.begin() + static_cast<std::ptrdiff_t>(primals), row.end());
        std::vector<Value> d =
            vjp([&](const std::vector<Value>& in) { return inline_graph(body, in); }, at, concat(dc, dy));
        const std::vector<Value> d_carry(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(carries));
        const std::vector<Value> d_x(d.begin() + static_cast<std::ptrdiff_t>(carries), d.end());
        return ScanStep{d_carry, d_x};
      },
      ct_carry, concat(concat(saved.ys, xs), ct_ys), s.length, !s.reverse);
  for (size_t k = 0; k < carries; ++k) a.add(k, back.carry[k]);
  for (size_t k = 0; k < xs.size(); ++k) a.add(carries + k, back.ys[k]);
  return absl::OkStatus();
}

}  // namespace

absl::Span<const VjpEntry> control_vjps() {
  static const VjpEntry kRules[] = {
      {Op::kScan, scan_vjp},
  };
  return kRules;
}

}  // namespace tessera::internal

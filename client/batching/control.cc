// Batching the control-flow ops, as JAX batches them (jax/_src/lax/control_flow/loops.py,
// _scan_batching_rule and _while_loop_batching_rule; conditionals.py, _cond_batching_rule):
//   - scan: a carry is batched when its initial value is, or when the body makes it depend on
//     a batched value (a fixed point over the body); the body runs vmapped (its batched xs
//     rows and carries, batch dimension first), the ys come back batch dimension first.
//   - while: the same fixed point over the body and predicate. A predicate that does not
//     depend on a batched value stays one loop; a batched one runs while any example's holds,
//     each example keeping its carries once its own predicate is false (every carry the body
//     changes batched; one it hands on unchanged, a closed-over value, stays unbatched).
//   - switch (cond): an unbatched index keeps the switch, its branches vmapped; a batched one
//     runs every branch on the whole batch and selects each example's result (select_n).
// The results of one op are several nodes (core/op_attrs.h); the first node batched batches
// the op once and records its siblings' results (BatchArgs::record).
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"
#include "tessera/vmap.h"

namespace tessera::internal {
namespace {

using Axes = std::vector<std::optional<int64_t>>;

// Which outputs of `g` depend on a parameter marked in `batched` (by parameter index).
std::vector<bool> batched_outputs(const Graph& g, const std::vector<bool>& batched) {
  std::vector<bool> node(g.size(), false);
  for (int id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    if (n.op == Op::kParameter) {
      const int64_t p = n.attrs<ParameterAttrs>().index;
      node[id] = p < static_cast<int64_t>(batched.size()) && batched[p];
      continue;
    }
    for (int o : n.operands) node[id] = node[id] || node[o];
  }
  std::vector<bool> out;
  for (int o : g.outputs()) out.push_back(node[o]);
  return out;
}

// Marks carry j (the first `carries` parameters and outputs of each of `graphs`) batched when
// its output depends on a batched parameter, until nothing changes: the least fixed point
// (JAX's `carry_batched` loop).
void carry_fixed_point(const std::vector<const Graph*>& graphs, size_t carries, std::vector<bool>& batched) {
  for (bool changed = true; changed;) {
    changed = false;
    for (const Graph* g : graphs) {
      const std::vector<bool> out = batched_outputs(*g, batched);
      for (size_t j = 0; j < carries && j < out.size(); ++j) {
        if (out[j] && !batched[j]) batched[j] = changed = true;
      }
    }
  }
}

// Whether `g` returns its parameter j as its output j (a loop body handing a carry on).
bool hands_on(const Graph& g, size_t j) {
  if (j >= g.outputs().size()) return false;
  const Node& n = g.node(g.outputs()[j]);
  return n.op == Op::kParameter && n.attrs<ParameterAttrs>().index == static_cast<int64_t>(j);
}

Axes axes_of(const std::vector<bool>& batched) {
  Axes out;
  for (bool b : batched) out.push_back(b ? std::optional<int64_t>(0) : std::nullopt);
  return out;
}

// `g` inlined under the vmap of `a` (its size and spmd_axis_name): parameters batched as `in`
// says, outputs as `out` (nullopt: not batched, which the fixed point guarantees).
std::vector<Value> vmapped_graph(const Graph& g, const std::vector<Value>& args, const std::vector<bool>& in,
                                 const Axes& out, const BatchArgs& a) {
  TracedFunction inlined = [&g](const std::vector<Value>& x) { return inline_graph(g, x); };
  return vmap(
      inlined, axes_of(in), [out](size_t) { return out; }, a.size, a.layout.spmd_axes)(args);
}

std::vector<Value> operands_as(const BatchArgs& a, const std::vector<bool>& batched) {
  std::vector<Value> out;
  for (size_t k = 0; k < a.x.size(); ++k) out.push_back(batched[k] ? a.batched_operand(k) : a.x[k]);
  return out;
}

// `pred` (bool[size]) chooses on_true or on_false for each example (both batched).
Value select_examples(const Value& pred, const Value& on_true, const Value& on_false) {
  return where(broadcast_in_dim(pred, on_true.shape(), {0}), on_true, on_false);
}

// Every result of the op as its nodes take them (output j), batch dimension first; the
// node's own is returned, the siblings' recorded.
absl::StatusOr<Value> finish(const BatchArgs& a, std::vector<Value> results, const std::vector<bool>& batched) {
  for (size_t j = 0; j < results.size(); ++j) {
    if (!batched[j]) results[j] = a.broadcast(results[j]);
  }
  return a.record(results);
}

absl::StatusOr<Value> scan_rule(const BatchArgs& a) {
  const ScanAttrs& s = a.node.attrs<ScanAttrs>();
  const size_t carries = static_cast<size_t>(s.num_carry);
  std::vector<bool> in = a.batched;
  carry_fixed_point({s.body.get()}, carries, in);
  const std::vector<Value> operands = operands_as(a, in);
  std::vector<Value> init(operands.begin(), operands.begin() + static_cast<std::ptrdiff_t>(carries)), xs;
  for (size_t k = carries; k < operands.size(); ++k) xs.push_back(in[k] ? move_dim(operands[k], 0, 1) : operands[k]);
  Axes out = axes_of(std::vector<bool>(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(carries)));
  const Graph& body = *s.body;
  const size_t num_ys = body.outputs().size() - carries;
  out.insert(out.end(), num_ys, std::optional<int64_t>(0));
  const ScanResult r = scan(
      [&](const std::vector<Value>& c, const std::vector<Value>& row) {
        std::vector<Value> args = c;
        args.insert(args.end(), row.begin(), row.end());
        std::vector<Value> results = vmapped_graph(body, args, in, out, a);
        if (results.size() != carries + num_ys) return ScanStep{c, std::vector<Value>(num_ys)};
        return ScanStep{std::vector<Value>(results.begin(), results.begin() + static_cast<std::ptrdiff_t>(carries)),
                        std::vector<Value>(results.begin() + static_cast<std::ptrdiff_t>(carries), results.end())};
      },
      init, xs, s.length, s.reverse);
  std::vector<Value> results = r.carry;
  for (const Value& y : r.ys) results.push_back(move_dim(y, 1, 0));
  std::vector<bool> batched(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(carries));
  batched.insert(batched.end(), num_ys, true);
  return finish(a, std::move(results), batched);
}

absl::StatusOr<Value> while_rule(const BatchArgs& a) {
  const BranchesAttrs& w = a.node.attrs<BranchesAttrs>();
  const Graph& pred = *w.graphs[0];
  const Graph& body = *w.graphs[1];
  const size_t carries = a.x.size();
  std::vector<bool> in = a.batched;
  carry_fixed_point({&body}, carries, in);
  const bool batched_pred = batched_outputs(pred, in)[0];
  if (batched_pred) {
    // Each example keeps its carries once it stops, so a carry the body changes is batched; one
    // it hands on unchanged (a closed-over value: client/control.cc passes them as carries) is
    // the same whichever example stops, and stays as it is.
    for (size_t j = 0; j < carries; ++j) in[j] = in[j] || !hands_on(body, j);
  }
  const Axes carry_axes = axes_of(in);
  std::vector<Value> results = while_loop(
      [&](const std::vector<Value>& c) {
        if (!batched_pred) return vmapped_graph(pred, c, in, {std::nullopt}, a)[0];
        const Value p = vmapped_graph(pred, c, in, {0}, a)[0];
        return max(convert(p, DType::kI32)) > 0;  // any example's predicate holds
      },
      [&](const std::vector<Value>& c) {
        std::vector<Value> next = vmapped_graph(body, c, in, carry_axes, a);
        if (!batched_pred || next.size() != c.size()) return next;
        const Value p = vmapped_graph(pred, c, in, {0}, a)[0];
        for (size_t j = 0; j < next.size(); ++j) {
          if (in[j]) next[j] = select_examples(p, next[j], c[j]);
        }
        return next;
      },
      operands_as(a, in));
  return finish(a, std::move(results), in);
}

absl::StatusOr<Value> switch_rule(const BatchArgs& a) {
  const BranchesAttrs& b = a.node.attrs<BranchesAttrs>();
  const std::vector<bool> in(a.batched.begin() + 1, a.batched.end());
  const std::vector<Value> operands(a.x.begin() + 1, a.x.end());
  const size_t num_results = b.graphs[0]->outputs().size();
  const Axes out(num_results, std::optional<int64_t>(0));
  if (!a.batched[0]) {
    std::vector<Branch> branches;
    for (const std::shared_ptr<const Graph>& g : b.graphs) {
      branches.push_back([&a, &in, &out, g](const std::vector<Value>& x) { return vmapped_graph(*g, x, in, out, a); });
    }
    return finish(a, switch_(a.x[0], branches, operands), std::vector<bool>(num_results, true));
  }
  // A batched index (int32: client/control.cc): every branch on the batch, each example's
  // result by its own index clamped to the branches, as the op clamps it.
  const DType dtype = a.x[0].dtype();
  const Value index = clamp(full({}, 0, dtype), a.x[0], full({}, static_cast<double>(b.graphs.size() - 1), dtype));
  std::vector<Value> results;
  for (size_t k = 0; k < b.graphs.size(); ++k) {
    std::vector<Value> r = vmapped_graph(*b.graphs[k], operands, in, out, a);
    if (r.size() != num_results) return Value();
    if (k == 0) {
      results = std::move(r);
      continue;
    }
    const Value chosen = index == static_cast<int64_t>(k);
    for (size_t j = 0; j < num_results; ++j) results[j] = select_examples(chosen, r[j], results[j]);
  }
  return finish(a, std::move(results), std::vector<bool>(num_results, true));
}

constexpr BatchEntry kRules[] = {
    {Op::kScan, scan_rule},
    {Op::kWhile, while_rule},
    {Op::kSwitch, switch_rule},
};

}  // namespace

absl::Span<const BatchEntry> control_batching() { return kRules; }

}  // namespace tessera::internal

#include "tessera/grad.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"
#include "client/vjp/vjp.h"
#include "core/status.h"

namespace tessera {

using internal::TraceState;
using internal::zeros_like;

namespace internal {

VjpRule find_vjp(Op op) {
  struct Registry {
    VjpRule rules[kNumOps] = {};
    Registry() {
      for (absl::Span<const VjpEntry> family : {elementwise_vjps(), layout_vjps(), reduction_vjps(), dot_vjps(),
                                                indexing_vjps(), shard_map_vjps(), control_vjps()}) {
        for (const VjpEntry& e : family) rules[static_cast<int>(e.op)] = e.rule;
      }
    }
  };
  static const Registry* const kRegistry = new Registry();
  return is_op(op) ? kRegistry->rules[static_cast<int>(op)] : nullptr;
}

}  // namespace internal

namespace {

// The vector-Jacobian products of nodes `last` down to `start` of trace t, from the cotangents
// in `ct` (by node; accumulated there). With `wrt` (the nodes differentiated), a node none of
// whose operands depends on them is skipped, and a rule may skip the cotangents of operands
// that do not (VjpArgs::wants), as JAX transposes into undefined primals only; without `wrt`,
// all are wanted. INVALID_ARGUMENT naming an op without a rule, or its rule's error.
absl::Status backprop(TraceState* t, int start, int last, std::map<int, Value>& ct,
                      const std::optional<std::vector<int>>& wrt = std::nullopt) {
  std::vector<bool> depends(last + 1, !wrt.has_value());
  if (wrt.has_value()) {
    for (int w : *wrt) {
      if (w <= last) depends[w] = true;
    }
    for (int id = start; id <= last; ++id) {
      for (int o : t->graph.node(id).operands) depends[id] = depends[id] || depends[o];
    }
  }
  auto value = [&](int id) { return t->make(id); };
  auto add_ct = [&](int id, const Value& g) {
    if (!g.ok() || !is_floating(t->graph.node(id).dtype)) return;
    auto it = ct.find(id);
    if (it == ct.end()) {
      ct.emplace(id, g);
    } else {
      it->second = it->second + g;
    }
  };
  const std::function<Value(int)> take = [&](int other) {
    auto it = ct.find(other);
    if (it == ct.end()) return Value();
    Value v = it->second;
    ct.erase(it);
    return v;
  };
  for (int id = last; id >= start; --id) {
    auto it = ct.find(id);
    if (it == ct.end()) continue;
    // No operand depends on a differentiated value: no cotangent of this node's is wanted.
    if (!depends[id]) continue;
    const Value g = it->second;
    const Node n = t->graph.node(id);  // a copy: the rules below add nodes
    std::vector<Value> x;
    for (int o : n.operands) x.push_back(value(o));
    const Value out = value(id);
    if (has_trait(n.op, kNoGradient)) continue;
    const internal::VjpRule rule = internal::find_vjp(n.op);
    if (rule == nullptr) return absl::InvalidArgumentError(absl::StrCat(op_name(n.op), " has no VJP rule"));
    const std::function<void(size_t, const Value&)> add = [&](size_t k, const Value& v) { add_ct(n.operands[k], v); };
    const std::function<bool(size_t)> wants = [&](size_t k) { return depends[n.operands[k]]; };
    TESSERA_RETURN_IF_ERROR(rule(internal::VjpArgs{n, x, out, g, t, add, take, wants}));
    if (!t->error.ok()) return t->error;
  }
  return absl::OkStatus();
}

// Records f on `args` in their trace, then the vector-Jacobian products back from its first
// result: {value, gradients of argnums}.
std::vector<Value> value_and_grads(const TracedFunction& f, const std::vector<int>& argnums,
                                   const std::vector<Value>& args) {
  std::vector<Value> failed(argnums.size() + 1);
  TraceState* t = TraceState::current;
  for (const Value& a : args) {
    if (!a.ok()) return failed;
    t = TraceState::of(a);
  }
  if (t == nullptr) return failed;
  auto fail = [&](const std::string& message) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("grad: ", message)));
    return failed;
  };
  for (int k : argnums) {
    if (k < 0 || k >= static_cast<int>(args.size())) {
      return fail(absl::StrCat("argnum ", k, " is out of range for ", args.size(), " arguments"));
    }
    if (!is_floating(args[k].dtype())) {
      return fail(absl::StrCat("argument ", k, " is ", type_to_string(args[k].dtype(), args[k].shape()),
                               "; gradients need float inputs (as JAX's grad requires real-valued inputs)"));
    }
  }
  const int start = t->graph.size();
  std::vector<Value> results = f(args);
  if (!t->error.ok()) return failed;
  if (results.empty() || !results[0].ok() || TraceState::of(results[0]) != t) {
    return fail("the function returned no value of this trace");
  }
  const Value y = results[0];
  if (y.rank() != 0 || !is_floating(y.dtype())) {
    return fail(
        absl::StrCat("the function must return a float scalar first, not ", type_to_string(y.dtype(), y.shape())));
  }
  std::map<int, Value> ct;  // cotangents, by node
  // The seed is typed as y's cotangent (JAX's _one_vjp, jax/_src/lax/lax.py: ones with
  // primal_sharding_to_cotangent_sharding of y's): unreduced where y is reduced, so a max of a
  // reduced value (tests/pjit_test.py, test_reduce_max_reduced_reshard) has an unreduced seed.
  const std::optional<internal::TypedOperand> typed_y = internal::typed_operand(y);
  const auto ones = [&] { return full({}, 1.0, y.dtype()); };
  ct.emplace(TraceState::id(y),
             typed_y.has_value() && !typed_y->reduced.empty() ? internal::typed_as(y, ones) : ones());
  std::vector<int> wrt;
  for (int k : argnums) wrt.push_back(TraceState::id(args[k]));
  absl::Status status = backprop(t, start, TraceState::id(y), ct, wrt);
  if (!status.ok()) {
    if (!t->error.ok()) return failed;
    return fail(std::string(status.message()));
  }
  // Each gradient in its argument's layout, as JAX gives it; that of an argument typed reduced
  // (P(..., reduced={'X'})) is unreduced over the same axes (JAX's to_ct_spec): its sum over X
  // waits for the user's reshard, where it runs once; that of one typed unreduced is reduced
  // over them (tests/shard_map_test.py's test_eager_unreduced_in: P(None, reduced={'x'})).
  std::vector<Value> out = {y};
  for (int k : argnums) {
    auto it = ct.find(TraceState::id(args[k]));
    const Value g = it != ct.end() ? it->second : zeros_like(args[k]);
    const std::optional<internal::TypedOperand> type = internal::typed_operand(args[k]);
    if (type.has_value() && (!type->reduced.empty() || !type->unreduced.empty())) {
      out.push_back(with_sharding_constraint(
          g, NamedSharding(
                 *t->explicit_mesh,
                 internal::to_partition_spec(type->spec).with_unreduced(type->reduced).with_reduced(type->unreduced))));
      continue;
    }
    out.push_back(t->make(t->graph.add_sharding_as(TraceState::id(g), TraceState::id(args[k]))));
  }
  return out;
}

}  // namespace

namespace internal {

std::vector<Value> vjp(const TracedFunction& f, const std::vector<Value>& primals,
                       const std::vector<Value>& cotangents) {
  std::vector<Value> failed(primals.size());
  TraceState* t = TraceState::current;
  for (const Value& p : primals) {
    if (!p.ok()) return failed;
    t = TraceState::of(p);
  }
  if (t == nullptr || !t->error.ok()) return failed;
  const int start = t->graph.size();
  std::vector<Value> results = f(primals);
  if (!t->error.ok()) return failed;
  std::map<int, Value> ct;
  int last = start - 1;
  for (size_t j = 0; j < results.size() && j < cotangents.size(); ++j) {
    if (!results[j].ok() || !cotangents[j].ok() || !is_floating(results[j].dtype())) continue;
    const int id = TraceState::id(results[j]);
    auto it = ct.find(id);
    if (it == ct.end()) {
      ct.emplace(id, cotangents[j]);
    } else {
      it->second = it->second + cotangents[j];
    }
    last = std::max(last, id);
  }
  absl::Status status = backprop(t, start, last, ct);
  if (!status.ok()) {
    t->fail(status);
    return failed;
  }
  std::vector<Value> out;
  for (const Value& p : primals) {
    auto it = ct.find(TraceState::id(p));
    out.push_back(it != ct.end() ? it->second : zeros_like(p));
  }
  return out;
}

}  // namespace internal

TracedFunction grad(TracedFunction f, std::vector<int> argnums) {
  return [f = std::move(f), argnums = std::move(argnums)](const std::vector<Value>& args) {
    std::vector<Value> out = value_and_grads(f, argnums, args);
    out.erase(out.begin());
    return out;
  };
}

TracedFunction value_and_grad(TracedFunction f, std::vector<int> argnums) {
  return [f = std::move(f), argnums = std::move(argnums)](const std::vector<Value>& args) {
    return value_and_grads(f, argnums, args);
  };
}

}  // namespace tessera

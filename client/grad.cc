#include "tessera/grad.h"

#include <algorithm>
#include <map>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"

namespace tessera {

using internal::TraceState;

namespace {

Value zeros_like(const Value& x) { return full(x.shape(), 0.0, x.dtype()); }

// lax's _balanced_eq: 1 where x is the result alone, 1/2 where both operands are.
Value balanced_eq(const Value& x, const Value& result, const Value& other) {
  return where(x == result, where(other == result, full({}, 0.5, x.dtype()), full({}, 1.0, x.dtype())),
               full({}, 0.0, x.dtype()));
}

// The inverse of a permutation.
std::vector<int64_t> inverse(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

// The cotangent of one operand of a dot_general, from the result's cotangent `g` and the
// other operand: a dot_general contracting g's dimensions of the other's free ones with
// those, ordered so that for the usual layouts (lhs [batch, free, contracting], rhs [batch,
// contracting, free]) it comes out in the operand's own order; otherwise a transpose follows.
// `lhs` says which operand.
Value dot_cotangent(const Value& g, const Value& other, const DotDims& dd, bool lhs, int64_t operand_rank) {
  const std::vector<int64_t>& my_batch = lhs ? dd.lhs_batch : dd.rhs_batch;
  const std::vector<int64_t>& my_contracting = lhs ? dd.lhs_contracting : dd.rhs_contracting;
  const std::vector<int64_t>& other_batch = lhs ? dd.rhs_batch : dd.lhs_batch;
  const std::vector<int64_t>& other_contracting = lhs ? dd.rhs_contracting : dd.lhs_contracting;
  const int64_t nb = static_cast<int64_t>(my_batch.size());
  const std::vector<int64_t> my_free = dot_free_dims(operand_rank, my_batch, my_contracting);
  const std::vector<int64_t> other_free = dot_free_dims(other.rank(), other_batch, other_contracting);
  // g's dimensions: batch, lhs free, rhs free; the other operand's free ones are contracted.
  const int64_t other_free_start = lhs ? nb + static_cast<int64_t>(my_free.size()) : nb;
  std::vector<int64_t> g_batch(nb), g_contracting;
  std::iota(g_batch.begin(), g_batch.end(), 0);
  for (size_t k = 0; k < other_free.size(); ++k) g_contracting.push_back(other_free_start + static_cast<int64_t>(k));
  // lhs: dot(g, rhs) gives [batch, my free, my contracting]; rhs: dot(lhs, g) gives [batch,
  // my contracting, my free]. "My contracting" dimensions come in the order of the other's
  // contracting dimensions they pair with, sorted.
  const Value d = lhs ? dot_general(g, other, DotDims{g_batch, other_batch, g_contracting, other_free})
                      : dot_general(other, g, DotDims{other_batch, g_batch, other_free, g_contracting});
  std::vector<int64_t> sorted_other_contracting = other_contracting;
  std::sort(sorted_other_contracting.begin(), sorted_other_contracting.end());
  const int64_t free_at = lhs ? nb : nb + static_cast<int64_t>(my_contracting.size());
  const int64_t contracting_at = lhs ? nb + static_cast<int64_t>(my_free.size()) : nb;
  std::vector<int64_t> perm(operand_rank);
  for (int64_t i = 0; i < nb; ++i) perm[my_batch[i]] = i;
  for (size_t k = 0; k < my_free.size(); ++k) perm[my_free[k]] = free_at + static_cast<int64_t>(k);
  for (size_t j = 0; j < my_contracting.size(); ++j) {
    const int64_t r =
        std::find(sorted_other_contracting.begin(), sorted_other_contracting.end(), other_contracting[j]) -
        sorted_other_contracting.begin();
    perm[my_contracting[j]] = contracting_at + r;
  }
  // Operand dimension i is d's dimension perm[i]: transpose's own convention.
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int64_t>(i);
  return identity ? d : transpose(d, perm);
}

// The cotangent of a broadcast_in_dim's operand: summed over the dimensions it was
// broadcast along (new ones, and stretched size-1 ones), back in the operand's shape. The
// graph keeps `dims` increasing, so what remains is in the operand's order.
Value unbroadcast(const Value& g, const Shape& in, const Shape& out, const std::vector<int64_t>& dims) {
  std::vector<int64_t> summed;
  for (int64_t r = 0; r < static_cast<int64_t>(out.size()); ++r) {
    auto it = std::find(dims.begin(), dims.end(), r);
    if (it == dims.end() || in[it - dims.begin()] != out[r]) summed.push_back(r);
  }
  return reshape(summed.empty() ? g : sum(g, summed), in);
}

// The cotangent of a slice's operand: g padded with zeros back to the operand's shape.
Value unslice(const Value& g, const Shape& in, const std::vector<int64_t>& start, const std::vector<int64_t>& limit) {
  Value out = g;
  for (size_t d = 0; d < in.size(); ++d) {
    std::vector<Value> parts;
    Shape shape = out.shape();
    if (start[d] > 0) {
      shape[d] = start[d];
      parts.push_back(full(shape, 0.0, g.dtype()));
    }
    parts.push_back(out);
    if (limit[d] < in[d]) {
      shape[d] = in[d] - limit[d];
      parts.push_back(full(shape, 0.0, g.dtype()));
    }
    if (parts.size() > 1) out = concatenate(parts, static_cast<int64_t>(d));
  }
  return out;
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
  auto value = [&](int id) { return t->make(id); };
  std::map<int, Value> ct;  // cotangents, by node
  auto add_ct = [&](int id, const Value& g) {
    if (!g.ok() || !is_floating(t->graph.node(id).dtype)) return;
    auto it = ct.find(id);
    if (it == ct.end()) {
      ct.emplace(id, g);
    } else {
      it->second = it->second + g;
    }
  };
  add_ct(TraceState::id(y), full({}, 1.0, y.dtype()));
  for (int id = TraceState::id(y); id >= start; --id) {
    auto it = ct.find(id);
    if (it == ct.end()) continue;
    const Value g = it->second;
    const Node n = t->graph.node(id);  // a copy: the rules below add nodes
    std::vector<Value> x;
    for (int o : n.operands) x.push_back(value(o));
    const Value out = value(id);
    switch (n.op) {
      case Op::kNeg:
        add_ct(n.operands[0], -g);
        break;
      case Op::kAbs:
        add_ct(n.operands[0], g * sign(x[0]));
        break;
      case Op::kExp:
        add_ct(n.operands[0], g * out);
        break;
      case Op::kLog:
        add_ct(n.operands[0], g / x[0]);
        break;
      case Op::kTanh:
        add_ct(n.operands[0], g * (1.0 - out * out));
        break;
      case Op::kLogistic:
        add_ct(n.operands[0], g * out * (1.0 - out));
        break;
      case Op::kSqrt:
        add_ct(n.operands[0], g * 0.5 / out);
        break;
      case Op::kRsqrt:
        add_ct(n.operands[0], g * -0.5 * out / x[0]);
        break;
      case Op::kSin:
        add_ct(n.operands[0], g * cos(x[0]));
        break;
      case Op::kCos:
        add_ct(n.operands[0], -(g * sin(x[0])));
        break;
      case Op::kAdd:
        add_ct(n.operands[0], g);
        add_ct(n.operands[1], g);
        break;
      case Op::kSub:
        add_ct(n.operands[0], g);
        add_ct(n.operands[1], -g);
        break;
      case Op::kMul:
        add_ct(n.operands[0], g * x[1]);
        add_ct(n.operands[1], g * x[0]);
        break;
      case Op::kDiv:
        add_ct(n.operands[0], g / x[1]);
        add_ct(n.operands[1], -(g * x[0] / (x[1] * x[1])));
        break;
      case Op::kPow:
        add_ct(n.operands[0], g * x[1] * pow(x[0], x[1] - 1.0));
        // d/db a^b = log(a) a^b; at a == 0 JAX takes log(1), so 0^b contributes nothing.
        add_ct(n.operands[1],
               g * log(where(x[0] == zeros_like(x[0]), full(x[0].shape(), 1.0, x[0].dtype()), x[0])) * out);
        break;
      case Op::kMax:
      case Op::kMin:
        add_ct(n.operands[0], g * balanced_eq(x[0], out, x[1]));
        add_ct(n.operands[1], g * balanced_eq(x[1], out, x[0]));
        break;
      case Op::kSelect:
        add_ct(n.operands[1], where(x[0], g, zeros_like(g)));
        add_ct(n.operands[2], where(x[0], zeros_like(g), g));
        break;
      case Op::kConvert:
        if (is_floating(x[0].dtype())) add_ct(n.operands[0], convert(g, x[0].dtype()));
        break;
      case Op::kBroadcastInDim:
        add_ct(n.operands[0], unbroadcast(g, x[0].shape(), n.shape, n.dims));
        break;
      case Op::kReshape:
        add_ct(n.operands[0], reshape(g, x[0].shape()));
        break;
      case Op::kTranspose:
        add_ct(n.operands[0], transpose(g, inverse(n.dims)));
        break;
      case Op::kReduceSum:
      case Op::kReduceMax:
      case Op::kReduceMin:
      case Op::kReduceProd: {
        std::vector<int64_t> kept;
        for (int64_t d = 0; d < x[0].rank(); ++d) {
          if (!std::binary_search(n.dims.begin(), n.dims.end(), d)) kept.push_back(d);
        }
        auto back = [&](const Value& v) { return broadcast_in_dim(v, x[0].shape(), kept); };
        if (n.op == Op::kReduceSum) {
          add_ct(n.operands[0], back(g));
        } else if (n.op == Op::kReduceProd) {
          add_ct(n.operands[0], back(g * out) / x[0]);
        } else {  // the gradient goes to the extreme elements, split evenly among ties
          const Value hit = convert(x[0] == back(out), x[0].dtype());
          add_ct(n.operands[0], back(g / sum(hit, n.dims)) * hit);
        }
        break;
      }
      case Op::kDotGeneral:
        add_ct(n.operands[0], dot_cotangent(g, x[1], n.dot, /*lhs=*/true, x[0].rank()));
        add_ct(n.operands[1], dot_cotangent(g, x[0], n.dot, /*lhs=*/false, x[1].rank()));
        break;
      case Op::kSlice:
        add_ct(n.operands[0], unslice(g, x[0].shape(), n.dims, n.limits));
        break;
      case Op::kConcatenate: {
        const int64_t axis = n.dims[0];
        int64_t offset = 0;
        for (size_t k = 0; k < x.size(); ++k) {
          std::vector<int64_t> begin(n.shape.size(), 0), end = n.shape;
          begin[axis] = offset;
          end[axis] = offset + x[k].shape()[axis];
          offset = end[axis];
          add_ct(n.operands[k], slice(g, begin, end));
        }
        break;
      }
      case Op::kShardingConstraint:
        add_ct(n.operands[0], with_sharding_constraint(g, *n.sharding));
        break;
      // shard_map: each device's block is its own variable, and these are the transposes of
      // the linear maps between them (pmap's convention). An output replicated over axes its
      // out_spec leaves out is one copy of identical blocks: each block gets its share of the
      // cotangent; an argument replicated over axes its in_spec leaves out was read by every
      // device along them: its cotangent is their sum.
      case Op::kShardMapOut: {
        const NamedSharding& s = *n.sharding;
        const int64_t copies = s.num_replicas();
        Value blocks = t->make(t->graph.add_shard_map_in(TraceState::id(g), s));
        add_ct(n.operands[0], copies == 1 ? blocks : blocks * (1.0 / static_cast<double>(copies)));
        break;
      }
      case Op::kShardMapIn: {
        const NamedSharding& s = *n.sharding;
        std::vector<std::string> unnamed;
        const std::vector<std::string> named = s.spec().used_axes();
        for (const std::string& a : s.mesh().axis_names()) {
          if (std::find(named.begin(), named.end(), a) == named.end()) unnamed.push_back(a);
        }
        Value summed = g;
        if (!unnamed.empty()) {
          summed = t->make(t->graph.add_collective(Op::kAllReduce, TraceState::id(g), s.mesh(), unnamed, {}));
        }
        if (summed.ok()) add_ct(n.operands[0], t->make(t->graph.add_shard_map_out(TraceState::id(summed), s)));
        break;
      }
      case Op::kAllReduce:
      case Op::kAllGather:
      case Op::kReduceScatter:
      case Op::kAllToAll:
      case Op::kCollectivePermute: {
        const Mesh& mesh = n.sharding->mesh();
        auto collective = [&](Op op, const Value& v, std::vector<int64_t> dims) {
          return t->make(t->graph.add_collective(op, TraceState::id(v), mesh, n.axes, std::move(dims)));
        };
        const auto reduce_op = static_cast<ReduceOp>(n.index);
        if (n.op == Op::kAllReduce && reduce_op == ReduceOp::kSum) {
          add_ct(n.operands[0], collective(Op::kAllReduce, g, {}));
        } else if (n.op == Op::kAllReduce && (reduce_op == ReduceOp::kMax || reduce_op == ReduceOp::kMin)) {
          // To the devices holding the extreme, split evenly among ties.
          const Value hit = convert(x[0] == out, x[0].dtype());
          add_ct(n.operands[0], collective(Op::kAllReduce, g, {}) * hit / collective(Op::kAllReduce, hit, {}));
        } else if (n.op == Op::kAllReduce) {
          return fail("differentiating an all_reduce product is not supported");
        } else if (n.op == Op::kAllGather) {
          add_ct(n.operands[0], collective(Op::kReduceScatter, g, n.dims));
        } else if (n.op == Op::kReduceScatter) {
          add_ct(n.operands[0], collective(Op::kAllGather, g, n.dims));
        } else if (n.op == Op::kAllToAll) {
          add_ct(n.operands[0], collective(Op::kAllToAll, g, {n.dims[1], n.dims[0]}));
        } else {  // ppermute: back along every pair
          std::vector<int64_t> inverted;
          for (size_t i = 0; i + 1 < n.dims.size(); i += 2) {
            inverted.push_back(n.dims[i + 1]);
            inverted.push_back(n.dims[i]);
          }
          add_ct(n.operands[0], collective(Op::kCollectivePermute, g, inverted));
        }
        break;
      }
      default:  // no gradient: constants, iota, comparisons, logic, argmax, floor, ceil, sign
        break;
    }
    if (!t->error.ok()) return failed;
  }
  // Each gradient in its argument's layout, as JAX gives it.
  std::vector<Value> out = {y};
  for (int k : argnums) {
    auto it = ct.find(TraceState::id(args[k]));
    const Value g = it != ct.end() ? it->second : zeros_like(args[k]);
    out.push_back(t->make(t->graph.add_sharding_as(TraceState::id(g), TraceState::id(args[k]))));
  }
  return out;
}

}  // namespace

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

#include "tessera/trace.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/explicit_axes_check.h"
#include "client/trace_state.h"
#include "core/status.h"
#include "tessera/mesh_context.h"

namespace tessera {
namespace internal {

thread_local TraceState* TraceState::current = nullptr;

TypeSpec TraceState::without_auto_axes(TypeSpec spec) const {
  without_axes(spec, auto_axes);
  return spec;
}

const std::vector<std::string>& TraceState::unreduced_of(int id) const {
  static const std::vector<std::string>* const kNone = new std::vector<std::string>();
  auto it = unreduced.find(id);
  return it == unreduced.end() ? *kNone : it->second;
}

const std::vector<std::string>& TraceState::reduced_of(int id) const {
  static const std::vector<std::string>* const kNone = new std::vector<std::string>();
  auto it = reduced.find(id);
  return it == reduced.end() ? *kNone : it->second;
}

absl::Status TraceState::type_new_nodes() {
  for (int id = static_cast<int>(specs.size()); id < graph.size(); ++id) {
    const Node& n = graph.node(id);
    TypeRuleCall call{*explicit_mesh, n, {}, out_sharding_scopes > 0};
    if (auto given = out_unreduced.find(id); given != out_unreduced.end()) {
      call.out_unreduced = std::move(given->second);
      out_unreduced.erase(given);
    }
    for (int o : n.operands) {
      const Node& on = graph.node(o);
      call.operands.push_back({on.dtype, on.shape, without_auto_axes(specs[o]), unreduced_of(o), reduced_of(o)});
    }
    absl::StatusOr<std::vector<std::string>> u = result_unreduced(call);
    if (!u.ok()) return u.status();
    absl::StatusOr<std::vector<std::string>> r = result_reduced(call);
    if (!r.ok()) return r.status();
    absl::StatusOr<TypeSpec> spec = result_type_spec(call);
    if (!spec.ok()) return spec.status();
    specs.push_back(without_auto_axes(*std::move(spec)));
    if (!auto_axes.empty()) typed_auto_axes[id] = auto_axes;
    if (!u->empty()) unreduced[id] = *std::move(u);
    if (!r->empty()) reduced[id] = *std::move(r);
  }
  return absl::OkStatus();
}

}  // namespace internal

using internal::normalize_axis;
using internal::TraceState;

namespace {

// numpy's broadcast of two shapes, or nullopt.
std::optional<Shape> broadcast_shapes(const Shape& a, const Shape& b) {
  const size_t rank = std::max(a.size(), b.size());
  Shape out(rank);
  for (size_t i = 0; i < rank; ++i) {
    const int64_t da = i < rank - a.size() ? 1 : a[i - (rank - a.size())];
    const int64_t db = i < rank - b.size() ? 1 : b[i - (rank - b.size())];
    if (da != db && da != 1 && db != 1) return std::nullopt;
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// A negative axis counts from the end, as in numpy.
Value unary(Op op, const Value& x) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_unary(op, TraceState::id(x)));
}

// The transcendental ops compute integers and bools in float32, as jnp promotes them
// (promote_dtypes_inexact).
Value inexact_unary(Op op, const Value& x) {
  return unary(op, x.ok() && !is_floating(x.dtype()) ? convert(x, DType::kF32) : x);
}

Value binary(Op op, const Value& x, const Value& y) {
  TraceState* t = TraceState::common({&x, &y});
  if (t == nullptr) return Value();
  const std::string what = absl::StrCat(op_name(op), ": operands ", type_to_string(x.dtype(), x.shape()), " and ",
                                        type_to_string(y.dtype(), y.shape()));
  std::optional<Shape> shape = broadcast_shapes(x.shape(), y.shape());
  if (!shape.has_value()) return t->fail(absl::InvalidArgumentError(absl::StrCat(what, " do not broadcast")));
  // Mixed dtypes meet at their promotion, as in jnp.
  const DType dtype = promote_types(x.dtype(), y.dtype());
  const std::vector<Value> ab =
      internal::insert_pvary(t, {broadcast_to(convert(x, dtype), *shape), broadcast_to(convert(y, dtype), *shape)});
  const Value &a = ab[0], &b = ab[1];
  if (!a.ok() || !b.ok()) return Value();
  return t->make(t->graph.add_binary(op, TraceState::id(a), TraceState::id(b)));
}

// A constant of x's dtype and shape: how a scalar meets a Value.
Value like(const Value& x, Scalar value) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_constant(x.dtype(), x.shape(), value));
}

Value reduce(Op op, const Value& x, std::vector<int64_t> axes, bool keepdims) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (axes.empty()) {
    for (int d = 0; d < x.rank(); ++d) axes.push_back(d);
  }
  for (int64_t& a : axes) a = normalize_axis(a, x.rank());
  Value r = t->make(t->graph.add_reduce(op, TraceState::id(x), axes));
  if (!keepdims || !r.ok()) return r;
  Shape kept = x.shape();
  for (int64_t a : axes) kept[a] = 1;
  return reshape(r, kept);
}

}  // namespace

DType Value::dtype() const { return ok() ? trace_->graph.node(id_).dtype : DType::kF32; }
Shape Value::shape() const { return ok() ? trace_->graph.node(id_).shape : Shape(); }

namespace internal {

int TraceState::capture(const Value& v) {
  const Value outer = of(v) == parent ? v : parent->make(parent->capture(v));  // through the bodies between
  for (size_t k = 0; k < captured.size(); ++k) {
    if (captured[k].id_ == outer.id_) return captured_params[k];
  }
  // In explicit mode the parameter has the captured value's type (every node before it is
  // typed first, so its spec lands at its id).
  if (explicit_mesh.has_value()) {
    absl::Status typed = type_new_nodes();
    // The parent's too: inside a with_out_sharding its nodes wait to be typed (deferred_typing).
    if (typed.ok() && parent->explicit_mesh.has_value()) typed = parent->type_new_nodes();
    if (!typed.ok()) fail(typed);
  }
  const int p = graph.add_parameter(outer.dtype(), outer.shape());
  if (explicit_mesh.has_value() && error.ok() && static_cast<int>(specs.size()) == p) {
    const bool typed_outside = parent->explicit_mesh.has_value() && outer.id_ < static_cast<int>(parent->specs.size());
    specs.push_back(typed_outside ? parent->specs[outer.id_] : TypeSpec(outer.shape().size()));
    if (typed_outside && !parent->unreduced_of(outer.id_).empty()) unreduced[p] = parent->unreduced_of(outer.id_);
    if (typed_outside && !parent->reduced_of(outer.id_).empty()) reduced[p] = parent->reduced_of(outer.id_);
  }
  captured.push_back(outer);
  captured_params.push_back(p);
  // In a shard_map body the parameter varies as the value it captures (also when captured from
  // inside a shard_map called in this body: its nested entry is the first).
  if (!manual_bodies.empty() && manual_bodies.front().nested)
    manual_bodies.front().seeds[p] = parent->variance_of(outer.id_);
  return p;
}

namespace {

absl::StatusOr<Graph> trace_in(TraceState* parent, const TracedFunction& f, const std::vector<ArrayType>& inputs,
                               const std::vector<NamedSharding>& input_shardings, std::vector<Value>* captured,
                               const std::vector<TypedOperand>& input_types = {},
                               const std::vector<Variance>& input_vma = {}) {
  auto state = std::make_shared<TraceState>();
  state->parent = parent;
  if (parent != nullptr) state->nest_in(*parent, input_vma);
  // A body of a trace in explicit mode is typed too, its parameters by `input_types`.
  if (parent != nullptr && parent->explicit_mesh.has_value()) {
    if (!input_types.empty() && input_types.size() != inputs.size()) {
      return absl::InternalError(
          absl::StrCat("trace: ", input_types.size(), " input types for ", inputs.size(), " inputs"));
    }
    state->explicit_mesh = parent->explicit_mesh;
    state->constraint_mesh = parent->constraint_mesh;
    state->auto_axes = parent->auto_axes;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (input_types.empty()) {
        state->specs.push_back(TypeSpec(inputs[i].shape.size()));
        continue;
      }
      state->specs.push_back(input_types[i].spec);
      if (!input_types[i].unreduced.empty()) state->unreduced[static_cast<int>(i)] = input_types[i].unreduced;
      if (!input_types[i].reduced.empty()) state->reduced[static_cast<int>(i)] = input_types[i].reduced;
    }
  }
  if (!input_shardings.empty()) {
    if (input_shardings.size() != inputs.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("trace: ", input_shardings.size(), " input shardings for ", inputs.size(), " inputs"));
    }
    const Mesh& mesh = input_shardings[0].mesh();
    if (mesh.has_axis_type(AxisType::kExplicit)) state->explicit_mesh = mesh;
    state->args_on_auto_axes = has_auto_split(mesh);
  }
  std::vector<Value> in;
  for (size_t i = 0; i < inputs.size(); ++i) {
    absl::Status valid = validate_shape(inputs[i].shape, dtype_size(inputs[i].dtype), absl::StrCat("input ", i));
    if (!valid.ok()) return valid;
    if (state->explicit_mesh.has_value() && parent == nullptr) {
      if (input_shardings[i].mesh() != *state->explicit_mesh) {
        return absl::InvalidArgumentError(absl::StrCat("trace: input ", i, " is on another mesh than input 0"));
      }
      state->specs.push_back(internal::type_spec_of(input_shardings[i].spec(), *state->explicit_mesh,
                                                    static_cast<int>(inputs[i].shape.size())));
      if (!input_shardings[i].spec().unreduced().empty()) {
        state->unreduced[static_cast<int>(i)] = input_shardings[i].spec().unreduced();
      }
      if (!input_shardings[i].spec().reduced().empty()) {
        state->reduced[static_cast<int>(i)] = input_shardings[i].spec().reduced();
      }
    }
    in.push_back(state->make(state->graph.add_parameter(inputs[i].dtype, inputs[i].shape)));
  }
  TraceState* outer = TraceState::current;
  TraceState::current = state.get();
  std::vector<Value> out = f(in);
  std::vector<int> ids;
  for (size_t i = 0; i < out.size() && state->error.ok(); ++i) {
    if (out[i].ok() && parent != nullptr) out[i] = TraceState::local(out[i]);  // a body may return a captured value
    if (!out[i].ok() || TraceState::of(out[i]) != state.get()) {
      TraceState::current = outer;
      return absl::InvalidArgumentError(absl::StrCat("trace: output ", i, " is not a value of this trace"));
    }
    // In explicit mode a result is laid out as its type says: pinned, so the compiler cannot
    // choose another layout for it.
    if (state->explicit_mesh.has_value()) {
      out[i] = with_sharding_constraint(
          out[i], NamedSharding(*state->explicit_mesh, internal::to_partition_spec(state->specs[TraceState::id(out[i])])
                                                           .with_unreduced(state->unreduced_of(TraceState::id(out[i])))
                                                           .with_reduced(state->reduced_of(TraceState::id(out[i])))));
      if (!state->error.ok()) {
        TraceState::current = outer;  // `state` dies with this call
        return state->error;
      }
    }
    ids.push_back(TraceState::id(out[i]));
  }
  TraceState::current = outer;
  if (!state->error.ok()) return state->error;
  absl::Status set = state->graph.set_outputs(ids);
  if (!set.ok()) return set;
  if (captured != nullptr) *captured = std::move(state->captured);
  return std::move(state->graph);
}

}  // namespace

absl::StatusOr<Graph> trace_body(TraceState* parent, const TracedFunction& f, const std::vector<ArrayType>& inputs,
                                 std::vector<Value>* captured, const std::vector<TypedOperand>& input_types,
                                 const std::vector<Variance>& input_vma) {
  return trace_in(parent, f, inputs, {}, captured, input_types, input_vma);
}

std::vector<bool> pinned_by_constraints(const Graph& g, int start, const std::vector<int>& outputs) {
  std::vector<int> uses(g.size(), 0), user(g.size(), -1);
  for (int o : outputs) ++uses[o];
  for (int id = start; id < g.size(); ++id) {
    for (int o : g.node(id).operands) {
      ++uses[o];
      user[o] = id;
    }
  }
  std::vector<bool> pinned(g.size(), false);
  for (int id = g.size() - 1; id >= start; --id) {
    if (uses[id] == 1 && user[id] >= 0) {
      pinned[id] = g.node(user[id]).op == Op::kShardingConstraint || pinned[user[id]];
    }
  }
  return pinned;
}

std::vector<Value> inline_graph(const Graph& g, const std::vector<Value>& args) {
  std::vector<size_t> all(g.outputs().size());
  for (size_t j = 0; j < all.size(); ++j) all[j] = j;
  return inline_graph(g, args, {}, all);
}

std::vector<Value> inline_graph(const Graph& g, const std::vector<Value>& args, const std::map<int, Value>& given,
                                const std::vector<size_t>& wanted, std::vector<int>* recorded) {
  std::vector<Value> value(g.size());
  if (recorded != nullptr) recorded->assign(g.size(), -1);
  TraceState* t = TraceState::current;
  for (const Value& a : args) {
    if (!a.ok()) continue;
    if (t == nullptr || t->parent == nullptr) t = TraceState::of(a);
    break;
  }
  // What the wanted outputs read, back to the given nodes.
  std::vector<bool> needed(g.size(), false);
  for (size_t j : wanted) needed[g.outputs()[j]] = true;
  for (int id = g.size() - 1; id >= 0; --id) {
    if (!needed[id] || given.count(id) > 0) continue;
    for (int o : g.node(id).operands) needed[o] = true;
  }
  // Explicit mode types the inlined nodes again (pinned_by_constraints).
  std::vector<bool> pinned(g.size(), false);
  if (t != nullptr && t->explicit_mesh.has_value()) pinned = pinned_by_constraints(g, 0, g.outputs());
  // A value constrained to unreduced axes was made under an unreduced out_sharding (a
  // contraction's partial sums): it is typed so again.
  std::map<int, std::vector<std::string>> constrained_unreduced;
  for (int id = 0; t != nullptr && t->explicit_mesh.has_value() && id < g.size(); ++id) {
    const Node& c = g.node(id);
    if (c.op == Op::kShardingConstraint && !c.attrs<ShardingAttrs>().sharding.spec().unreduced().empty()) {
      constrained_unreduced[c.operands[0]] = c.attrs<ShardingAttrs>().sharding.spec().unreduced();
    }
  }
  for (int id = 0; id < g.size(); ++id) {
    if (!needed[id]) continue;
    if (auto it = given.find(id); it != given.end()) {
      value[id] = it->second;
      continue;
    }
    Node n = g.node(id);
    if (n.op == Op::kParameter) {
      value[id] = args[n.attrs<ParameterAttrs>().index];
      continue;
    }
    for (int& o : n.operands) {
      if (!value[o].ok()) return std::vector<Value>(wanted.size());
      o = TraceState::id(value[o]);
    }
    if (pinned[id]) ++t->out_sharding_scopes;
    const absl::StatusOr<int> added = t->graph.add_node(std::move(n));
    if (recorded != nullptr && added.ok()) (*recorded)[id] = *added;
    if (auto u = constrained_unreduced.find(id); u != constrained_unreduced.end() && added.ok()) {
      t->out_unreduced[*added] = u->second;
    }
    value[id] = t->make(added);
    if (pinned[id]) --t->out_sharding_scopes;
  }
  std::vector<Value> out;
  for (size_t j : wanted) out.push_back(TraceState::local(value[g.outputs()[j]]));
  return out;
}

}  // namespace internal

void fail_trace(const absl::Status& status) {
  if (!status.ok() && TraceState::current != nullptr) TraceState::current->fail(status);
}

absl::StatusOr<Graph> trace(const TracedFunction& f, const std::vector<ArrayType>& inputs) {
  return internal::trace_in(nullptr, f, inputs, {}, nullptr);
}

absl::StatusOr<Graph> trace(const TracedFunction& f, const std::vector<ArrayType>& inputs,
                            const std::vector<NamedSharding>& input_shardings) {
  return internal::trace_in(nullptr, f, inputs, input_shardings, nullptr);
}

Value neg(const Value& x) { return unary(Op::kNeg, x); }
Value abs(const Value& x) { return unary(Op::kAbs, x); }
Value exp(const Value& x) { return inexact_unary(Op::kExp, x); }
Value log(const Value& x) { return inexact_unary(Op::kLog, x); }
Value tanh(const Value& x) { return inexact_unary(Op::kTanh, x); }
Value erf(const Value& x) { return inexact_unary(Op::kErf, x); }
Value erf_inv(const Value& x) { return inexact_unary(Op::kErfInv, x); }
Value logistic(const Value& x) { return inexact_unary(Op::kLogistic, x); }
Value sqrt(const Value& x) { return inexact_unary(Op::kSqrt, x); }
Value rsqrt(const Value& x) { return inexact_unary(Op::kRsqrt, x); }
Value sin(const Value& x) { return inexact_unary(Op::kSin, x); }
Value cos(const Value& x) { return inexact_unary(Op::kCos, x); }
Value floor(const Value& x) { return unary(Op::kFloor, x); }
Value stop_gradient(const Value& x) { return unary(Op::kStopGradient, x); }
Value ceil(const Value& x) { return unary(Op::kCeil, x); }
Value sign(const Value& x) { return unary(Op::kSign, x); }
Value logical_not(const Value& x) { return unary(Op::kNot, x); }

Value add(const Value& x, const Value& y) { return binary(Op::kAdd, x, y); }
Value sub(const Value& x, const Value& y) { return binary(Op::kSub, x, y); }
Value mul(const Value& x, const Value& y) { return binary(Op::kMul, x, y); }
Value div(const Value& x, const Value& y) { return binary(Op::kDiv, x, y); }
Value pow(const Value& x, const Value& y) { return binary(Op::kPow, x, y); }
Value maximum(const Value& x, const Value& y) { return binary(Op::kMax, x, y); }
Value minimum(const Value& x, const Value& y) { return binary(Op::kMin, x, y); }
Value logical_and(const Value& x, const Value& y) { return binary(Op::kAnd, x, y); }
Value logical_or(const Value& x, const Value& y) { return binary(Op::kOr, x, y); }
Value rem(const Value& x, const Value& y) { return binary(Op::kRem, x, y); }

Value remainder(const Value& x, const Value& y) {
  // jnp.remainder: lax.rem, moved by y where it is nonzero and its sign differs from y's.
  const Value r = rem(x, y);
  if (!r.ok()) return r;
  const Value zero = full({}, 0.0, r.dtype());
  return where(logical_and(r != zero, (r < zero) != (y < zero)), r + y, r);
}

Value shift_right_logical(const Value& x, const Value& y) { return binary(Op::kShiftRightLogical, x, y); }
Value clamp(const Value& lo, const Value& x, const Value& hi) { return minimum(maximum(x, lo), hi); }
Value clip(const Value& x, const Value& lo, const Value& hi) { return clamp(lo, x, hi); }

Value where(const Value& pred, const Value& on_true, const Value& on_false) {
  TraceState* t = TraceState::common({&pred, &on_true, &on_false});
  if (t == nullptr) return Value();
  std::optional<Shape> shape = broadcast_shapes(on_true.shape(), on_false.shape());
  if (shape.has_value()) shape = broadcast_shapes(*shape, pred.shape());
  if (!shape.has_value()) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat("where: shapes ", shape_to_string(pred.shape()), ", ",
                                                           shape_to_string(on_true.shape()), " and ",
                                                           shape_to_string(on_false.shape()), " do not broadcast")));
  }
  const DType dtype = promote_types(on_true.dtype(), on_false.dtype());
  const std::vector<Value> pab =
      internal::insert_pvary(t, {broadcast_to(pred, *shape), broadcast_to(convert(on_true, dtype), *shape),
                                 broadcast_to(convert(on_false, dtype), *shape)});
  const Value &p = pab[0], &a = pab[1], &b = pab[2];
  if (!p.ok() || !a.ok() || !b.ok()) return Value();
  return t->make(t->graph.add_select(TraceState::id(p), TraceState::id(a), TraceState::id(b)));
}

Value operator-(const Value& x) { return neg(x); }
Value operator+(const Value& x, const Value& y) { return add(x, y); }
Value operator-(const Value& x, const Value& y) { return sub(x, y); }
Value operator*(const Value& x, const Value& y) { return mul(x, y); }
Value operator/(const Value& x, const Value& y) {
  if (is_floating(x.dtype()) || is_floating(y.dtype())) return div(x, y);
  return div(convert(x, DType::kF32), convert(y, DType::kF32));  // jnp's true division
}
namespace {

// JAX's weak types: a Python float meeting an integer or bool array computes in float32, a
// Python int meeting a bool array in int32; otherwise the array's dtype wins.
Value weak_float(const Value& x) { return is_floating(x.dtype()) ? x : convert(x, DType::kF32); }
Value weak_int(const Value& x) { return x.dtype() == DType::kBool ? convert(x, DType::kI32) : x; }

// `a op y` (`y op a` when scalar_first), y a constant of a's dtype and shape; kRem stands for
// remainder (Python's %).
Value with_scalar(Op op, const Value& a, Scalar y, bool scalar_first) {
  Value s = like(a, y);
  // A scalar meeting a value typed reduced is reduced over the same axes, as JAX's
  // insert_reduced_reshard (jax/_src/core.py) reshards a rank-0 operand to P(reduced=...): `x * 2`
  // of a reduced x is reduced (tests/pjit_test.py, test_reduced_mul_scalar_fwd).
  if (const std::optional<internal::TypedOperand> type = internal::typed_operand(a);
      type.has_value() && !type->reduced.empty()) {
    s = with_sharding_constraint(
        s, NamedSharding(*TraceState::of(TraceState::local(a))->explicit_mesh,
                         PartitionSpec(std::vector<Axes>(a.shape().size())).with_reduced(type->reduced)));
  }
  const Value& l = scalar_first ? s : a;
  const Value& r = scalar_first ? a : s;
  return op == Op::kRem ? remainder(l, r) : binary(op, l, r);
}

}  // namespace

Value operator+(const Value& x, double y) { return with_scalar(Op::kAdd, weak_float(x), y, false); }
Value operator-(const Value& x, double y) { return with_scalar(Op::kSub, weak_float(x), y, false); }
Value operator*(const Value& x, double y) { return with_scalar(Op::kMul, weak_float(x), y, false); }
Value operator/(const Value& x, double y) { return with_scalar(Op::kDiv, weak_float(x), y, false); }
Value operator+(double x, const Value& y) { return with_scalar(Op::kAdd, weak_float(y), x, true); }
Value operator-(double x, const Value& y) { return with_scalar(Op::kSub, weak_float(y), x, true); }
Value operator*(double x, const Value& y) { return with_scalar(Op::kMul, weak_float(y), x, true); }
Value operator/(double x, const Value& y) { return with_scalar(Op::kDiv, weak_float(y), x, true); }

Value internal::with_weak_int(Op op, const Value& x, int64_t y, bool scalar_first) {
  // `/` is true division (float32 for integers), as jnp's.
  const Value a = op == Op::kDiv ? weak_float(x) : weak_int(x);
  return with_scalar(op, a, Scalar(y), scalar_first);
}
Value operator==(const Value& x, const Value& y) { return binary(Op::kEq, x, y); }
Value operator!=(const Value& x, const Value& y) { return binary(Op::kNe, x, y); }
Value operator<(const Value& x, const Value& y) { return binary(Op::kLt, x, y); }
Value operator<=(const Value& x, const Value& y) { return binary(Op::kLe, x, y); }
Value operator>(const Value& x, const Value& y) { return binary(Op::kGt, x, y); }
Value operator>=(const Value& x, const Value& y) { return binary(Op::kGe, x, y); }
Value operator%(const Value& x, const Value& y) { return remainder(x, y); }

Value internal::with_weak_float(Op op, const Value& x, double y, bool scalar_first) {
  return with_scalar(op, weak_float(x), y, scalar_first);
}

Value convert(const Value& x, DType dtype) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (x.dtype() == dtype) return x;
  return t->make(t->graph.add_convert(TraceState::id(x), dtype));
}

Value broadcast_in_dim(const Value& x, Shape shape, std::vector<int64_t> dims) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_broadcast_in_dim(TraceState::id(x), std::move(shape), std::move(dims)));
}

Value broadcast_to(const Value& x, Shape shape) {
  if (x.ok() && x.shape() == shape) return x;
  std::vector<int64_t> dims;
  const int64_t offset = static_cast<int64_t>(shape.size()) - x.rank();
  for (int i = 0; i < x.rank(); ++i) dims.push_back(offset + i);
  return broadcast_in_dim(x, std::move(shape), std::move(dims));
}

Value broadcast_in_dim(const Value& x, Shape shape, std::vector<int64_t> dims, const PartitionSpec& out_sharding) {
  return internal::with_out_sharding("broadcast_in_dim", x, out_sharding,
                                     [&] { return broadcast_in_dim(x, std::move(shape), std::move(dims)); });
}

Value broadcast_to(const Value& x, Shape shape, const PartitionSpec& out_sharding) {
  return internal::with_out_sharding("broadcast_to", x, out_sharding,
                                     [&] { return broadcast_to(x, std::move(shape)); });
}

Value reshape(const Value& x, Shape shape) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (x.shape() == shape) return x;
  return t->make(t->graph.add_reshape(TraceState::id(x), std::move(shape)));
}

Value transpose(const Value& x, std::vector<int64_t> permutation) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_transpose(TraceState::id(x), std::move(permutation)));
}

Value expand_dims(const Value& x, int64_t axis) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  axis = normalize_axis(axis, x.rank() + 1);
  if (axis < 0 || axis > x.rank()) {
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat("expand_dims: axis ", axis, " is out of range for shape ", shape_to_string(x.shape()))));
  }
  Shape shape = x.shape();
  shape.insert(shape.begin() + axis, 1);
  return reshape(x, shape);
}

Value squeeze(const Value& x, std::vector<int64_t> axes) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  Shape shape;
  for (int64_t& a : axes) a = normalize_axis(a, x.rank());
  for (int d = 0; d < x.rank(); ++d) {
    const bool named = std::find(axes.begin(), axes.end(), d) != axes.end();
    if (named && x.shape()[d] != 1) {
      return t->fail(absl::InvalidArgumentError(
          absl::StrCat("squeeze: dimension ", d, " of shape ", shape_to_string(x.shape()), " is not 1")));
    }
    if (!(named || (axes.empty() && x.shape()[d] == 1))) shape.push_back(x.shape()[d]);
  }
  return reshape(x, shape);
}

Value sum(const Value& x, std::vector<int64_t> axes, bool keepdims) {
  return reduce(Op::kReduceSum, x, std::move(axes), keepdims);
}
Value max(const Value& x, std::vector<int64_t> axes, bool keepdims) {
  return reduce(Op::kReduceMax, x, std::move(axes), keepdims);
}
Value min(const Value& x, std::vector<int64_t> axes, bool keepdims) {
  return reduce(Op::kReduceMin, x, std::move(axes), keepdims);
}
Value prod(const Value& x, std::vector<int64_t> axes, bool keepdims) {
  return reduce(Op::kReduceProd, x, std::move(axes), keepdims);
}

Value mean(const Value& x, std::vector<int64_t> axes, bool keepdims) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (x.dtype() != DType::kF32 && x.dtype() != DType::kF64) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat("mean: operand is ", type_to_string(x.dtype(), x.shape()),
                                                           "; convert it to a float dtype first")));
  }
  int64_t count = 1;
  if (axes.empty()) {
    count = num_elements(x.shape());
  } else {
    for (int64_t a : axes) {
      a = normalize_axis(a, x.rank());
      if (a >= 0 && a < x.rank()) count *= x.shape()[a];
    }
  }
  Value s = sum(x, std::move(axes), keepdims);
  return s / static_cast<double>(count);
}

Value argmax(const Value& x, int64_t axis, DType index_dtype) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_argmax(TraceState::id(x), normalize_axis(axis, x.rank()), index_dtype));
}

Value dot_general(const Value& lhs, const Value& rhs, DotDims dims) {
  TraceState* t = TraceState::common({&lhs, &rhs});
  if (t == nullptr) return Value();
  // In a shard_map body the operands first vary alike (lax.py's dot_general calls
  // core.auto_insert_reshard(lhs, rhs) before binding).
  const std::vector<Value> lr = internal::insert_pvary(t, {lhs, rhs});
  if (!lr[0].ok() || !lr[1].ok()) return Value();
  return t->make(t->graph.add_dot_general(TraceState::id(lr[0]), TraceState::id(lr[1]), std::move(dims)));
}

namespace {

// jnp.matmul's program (jax/_src/numpy/tensor_contractions.py, matmul): the operands with the
// dimensions it squeezes reshaped away, one dot_general, a transpose into numpy's order, and
// the dimensions squeezed from both operands inserted back.
struct MatmulProgram {
  Value lhs, rhs;             // the squeezed operands
  DotDims dims;               // the dot_general's; its product is batch, lhs free, rhs free
  std::vector<int64_t> perm;  // the product into numpy's order; empty when it is in it
  Shape shape;                // the result's, with the dimensions squeezed from both
};

std::optional<MatmulProgram> matmul_program(TraceState* t, const Value& lhs, const Value& rhs) {
  const int a = lhs.rank(), b = rhs.rank();
  const Shape ls = lhs.shape(), rs = rhs.shape();
  if (a == 0 || b == 0) {
    t->fail(absl::InvalidArgumentError(
        absl::StrCat("matmul: shapes ", shape_to_string(ls), " and ", shape_to_string(rs), " include a scalar")));
    return std::nullopt;
  }
  // A vector or a matrix on the right contracts with lhs's last dimension and leaves lhs's
  // others in front, as jnp: (B, S, D) @ (D, F) is (B, S, F), one dot_general, no batch.
  if (b <= 2) {
    Shape shape(ls.begin(), ls.end() - 1);
    if (b == 2) shape.push_back(rs[1]);
    return MatmulProgram{lhs, rhs, DotDims{{}, {}, {a - 1}, {0}}, {}, std::move(shape)};
  }
  // A vector on the left contracts with rhs's second to last: (K) @ (..., K, N) is (..., N).
  if (a == 1) {
    Shape shape(rs.begin(), rs.end() - 2);
    shape.push_back(rs[b - 1]);
    return MatmulProgram{lhs, rhs, DotDims{{}, {}, {0}, {b - 2}}, {}, std::move(shape)};
  }
  // Otherwise the batch dimensions (all but the last two) broadcast as numpy's, taken in
  // jnp.matmul's order of cases: one only one operand has is a free dimension of the
  // dot_general keeping its split; one both have as an unsplit 1 is squeezed from both (and
  // inserted back at the end); one an operand has as an unsplit 1 is squeezed from it and is a
  // free dimension of the other's; one both have with one size and one split is a batch
  // dimension; anything else is refused. No operand is broadcast, so the explicit rules see
  // each operand's own splits.
  const std::optional<internal::TypedOperand> ta = internal::typed_operand(lhs), tb = internal::typed_operand(rhs);
  const Axes unsplit;
  auto split_of = [&](const std::optional<internal::TypedOperand>& typed, int64_t d) -> const Axes& {
    return typed.has_value() ? typed->spec[d] : unsplit;
  };
  const int64_t n = std::max(a, b) - 2;
  MatmulProgram p;
  Shape lshape, rshape;           // the operands without their squeezed dimensions
  std::vector<int64_t> at, l_at;  // result dimension of each product dimension: batch, lhs free
  std::vector<int64_t> r_at;      // and rhs free
  for (int64_t i = 0; i < n; ++i) {
    const int64_t dl = i - (n - (a - 2)), dr = i - (n - (b - 2));  // < 0: the operand lacks it
    const bool l_one = dl >= 0 && ls[dl] == 1 && split_of(ta, dl).empty();
    const bool r_one = dr >= 0 && rs[dr] == 1 && split_of(tb, dr).empty();
    if (dl < 0 || (dr >= 0 && l_one && !r_one)) {
      rshape.push_back(rs[dr]);
      r_at.push_back(i);
    } else if (dr < 0 || (r_one && !l_one)) {
      lshape.push_back(ls[dl]);
      l_at.push_back(i);
    } else if (l_one && r_one) {
      // Squeezed from both: no dimension of the product.
    } else if (ls[dl] == rs[dr] && split_of(ta, dl) == split_of(tb, dr)) {
      p.dims.lhs_batch.push_back(static_cast<int64_t>(lshape.size()));
      p.dims.rhs_batch.push_back(static_cast<int64_t>(rshape.size()));
      lshape.push_back(ls[dl]);
      rshape.push_back(rs[dr]);
      at.push_back(i);
    } else {
      t->fail(absl::InvalidArgumentError(absl::StrCat("matmul: Incompatible types for matmul arguments: ",
                                                      type_of(lhs).to_string(), " and ", type_of(rhs).to_string())));
      return std::nullopt;
    }
    p.shape.push_back(dl < 0 || (dr >= 0 && l_one) ? rs[dr] : ls[dl]);
  }
  lshape.insert(lshape.end(), ls.end() - 2, ls.end());
  rshape.insert(rshape.end(), rs.end() - 2, rs.end());
  p.shape.push_back(ls[a - 2]);
  p.shape.push_back(rs[b - 1]);
  l_at.push_back(n);
  r_at.push_back(n + 1);
  p.dims.lhs_contracting = {static_cast<int64_t>(lshape.size()) - 1};
  p.dims.rhs_contracting = {static_cast<int64_t>(rshape.size()) - 2};
  p.lhs = reshape(lhs, std::move(lshape));
  p.rhs = reshape(rhs, std::move(rshape));
  at.insert(at.end(), l_at.begin(), l_at.end());
  at.insert(at.end(), r_at.begin(), r_at.end());
  if (!std::is_sorted(at.begin(), at.end())) {
    // Product dimension perm[j] is the one whose result dimension is the j-th smallest
    // (numpy.argsort, as jnp.matmul; the dimensions squeezed from both are not among them).
    p.perm.resize(at.size());
    std::iota(p.perm.begin(), p.perm.end(), int64_t{0});
    std::sort(p.perm.begin(), p.perm.end(), [&](int64_t x, int64_t y) { return at[x] < at[y]; });
  }
  return p;
}

// jnp.matmul's program of lhs and rhs, its dot_general given out_sharding when there is one:
// the dot_general, then the transpose, and the dimensions squeezed from both operands inserted
// back (a reshape of size-1 dimensions, as jnp.matmul's lax.expand_dims).
Value traced_matmul(const Value& lhs, const Value& rhs, const std::optional<PartitionSpec>& out_sharding) {
  TraceState* t = TraceState::common({&lhs, &rhs});
  if (t == nullptr) return Value();
  const std::optional<MatmulProgram> p = matmul_program(t, lhs, rhs);
  if (!p.has_value()) return Value();
  const Value product = out_sharding.has_value() ? dot_general(p->lhs, p->rhs, p->dims, *out_sharding)
                                                 : dot_general(p->lhs, p->rhs, p->dims);
  return reshape(p->perm.empty() ? product : transpose(product, p->perm), p->shape);
}

}  // namespace

Value matmul(const Value& lhs, const Value& rhs) { return traced_matmul(lhs, rhs, std::nullopt); }

Value dot(const Value& lhs, const Value& rhs) { return matmul(lhs, rhs); }

Value dot_general(const Value& lhs, const Value& rhs, DotDims dims, const PartitionSpec& out_sharding) {
  return internal::with_out_sharding("dot_general", lhs, out_sharding,
                                     [&] { return dot_general(lhs, rhs, std::move(dims)); });
}

// As jnp.matmul, out_sharding is its dot_general's (of the product's rank, in its order: batch,
// lhs free, rhs free, without the dimensions squeezed from both operands); the transpose and
// the reshape after it carry its splits and unreduced axes into numpy's order.
Value matmul(const Value& lhs, const Value& rhs, const PartitionSpec& out_sharding) {
  return traced_matmul(lhs, rhs, out_sharding);
}

Value reshape(const Value& x, Shape shape, const PartitionSpec& out_sharding) {
  return internal::with_out_sharding("reshape", x, out_sharding, [&] { return reshape(x, std::move(shape)); });
}

Value slice(const Value& x, std::vector<int64_t> start, std::vector<int64_t> limit, std::vector<int64_t> strides) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_slice(TraceState::id(x), std::move(start), std::move(limit), std::move(strides)));
}

Value rev(const Value& x, std::vector<int64_t> dimensions) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_rev(TraceState::id(x), std::move(dimensions)));
}

Value concatenate(const std::vector<Value>& xs, int64_t axis) {
  if (xs.empty()) {
    if (TraceState::current != nullptr)
      TraceState::current->fail(absl::InvalidArgumentError("concatenate: no operands"));
    return Value();
  }
  TraceState* t = nullptr;
  for (const Value& x : xs) {
    t = TraceState::common({&x, &xs[0]});
    if (t == nullptr) return Value();
  }
  // In a shard_map body the operands first vary alike (lax.py's concatenate calls
  // core.auto_insert_reshard(*operands) before binding).
  std::vector<int> ids;
  for (const Value& x : internal::insert_pvary(t, xs)) {
    if (!x.ok()) return Value();
    ids.push_back(TraceState::id(x));
  }
  return t->make(t->graph.add_concatenate(ids, normalize_axis(axis, xs[0].rank())));
}

Value gather(const Value& x, const Value& indices, const GatherAttrs& attrs) {
  TraceState* t = TraceState::common({&x, &indices});
  if (t == nullptr) return Value();
  GatherAttrs a = attrs;
  a.axis = normalize_axis(a.axis, x.rank());
  return t->make(t->graph.add_gather(TraceState::id(x), TraceState::id(indices), std::move(a)));
}

Value gather(const Value& x, const Value& indices, int64_t axis, IndexMode mode, std::optional<Scalar> fill_value) {
  return gather(x, indices, GatherAttrs{axis, mode, std::move(fill_value)});
}

namespace {

Value scatter_op(Op op, const Value& x, const Value& indices, const Value& updates, const GatherAttrs& attrs) {
  TraceState* t = TraceState::common({&x, &indices, &updates});
  if (t == nullptr) return Value();
  GatherAttrs a = attrs;
  a.axis = normalize_axis(a.axis, x.rank());
  return t->make(
      t->graph.add_scatter(op, TraceState::id(x), TraceState::id(indices), TraceState::id(updates), std::move(a)));
}

// jnp's _normalize_index: an index in [-n, 0) counts from the end of a dimension of size n.
Value wrap_negative(const Value& x, const Value& indices, int64_t axis) {
  axis = normalize_axis(axis, x.rank());
  if (!x.ok() || !indices.ok() || axis < 0 || axis >= x.rank()) return indices;
  const Value n = full(indices.shape(), static_cast<double>(x.shape()[axis]), indices.dtype());
  return where(indices < full(indices.shape(), 0.0, indices.dtype()), indices + n, indices);
}

// The updates of a scatter into x at `indices`: broadcast to their shape, in x's dtype. In
// explicit mode laid out as the indexed slice of x, as JAX's .at[] lays them out (jax/_src/ops/
// scatter.py _scatter_impl: broadcast_to(y, slice_shape, out_sharding=indexer.slice_sharding)):
// x's other dimensions split as x's, the indices' dimensions as the indices (_index_to_gather's
// slice_spec takes the index arrays' own spec, aia_spec), which the scatter's rule refuses
// unless unsplit (no collective on the inputs), as JAX's does.
Value updates_for(const Value& x, const Value& indices, int64_t axis, const Value& updates) {
  axis = normalize_axis(axis, x.rank());
  if (!x.ok() || !indices.ok() || axis < 0 || axis >= x.rank()) return updates;
  const Shape xs = x.shape(), i = indices.shape();  // by value: one copy each
  Shape shape(xs.begin(), xs.begin() + axis);
  shape.insert(shape.end(), i.begin(), i.end());
  shape.insert(shape.end(), xs.begin() + axis + 1, xs.end());
  // The updates keep their own unreduced axes (no sum runs here; the scatter's unreduced rule
  // then asks them to match the operand's).
  const Value u = convert(updates, x.dtype());
  const Value b = broadcast_to(u, shape);
  const TraceState* t = TraceState::common({&x});
  if (t == nullptr || !t->explicit_mesh.has_value() || !b.ok()) return b;
  std::vector<Axes> dims = type_of(x).spec.partitions_only().dims();
  dims.resize(x.rank());
  dims.erase(dims.begin() + axis);
  std::vector<Axes> i_dims = type_of(indices).spec.partitions_only().dims();
  i_dims.resize(i.size());
  dims.insert(dims.begin() + axis, i_dims.begin(), i_dims.end());
  const PartitionSpec b_spec = type_of(b).spec;
  std::vector<Axes> b_dims = b_spec.partitions_only().dims();
  b_dims.resize(shape.size());
  if (b_dims == dims) return b;
  return broadcast_to(u, shape, PartitionSpec(std::move(dims)).with_unreduced(b_spec.unreduced()));
}

}  // namespace

Value scatter(const Value& x, const Value& indices, const Value& updates, int64_t axis, IndexMode mode) {
  return scatter_op(Op::kScatter, x, indices, updates, GatherAttrs{axis, mode, std::nullopt});
}
Value scatter_add(const Value& x, const Value& indices, const Value& updates, int64_t axis, IndexMode mode) {
  return scatter_op(Op::kScatterAdd, x, indices, updates, GatherAttrs{axis, mode, std::nullopt});
}
Value scatter(const Value& x, const Value& indices, const Value& updates, const GatherAttrs& attrs) {
  return scatter_op(Op::kScatter, x, indices, updates, attrs);
}
Value scatter_add(const Value& x, const Value& indices, const Value& updates, const GatherAttrs& attrs) {
  return scatter_op(Op::kScatterAdd, x, indices, updates, attrs);
}

Value take(const Value& x, const Value& indices, int64_t axis, IndexMode mode, std::optional<Scalar> fill_value) {
  // jnp.take wraps negative indices in fill mode only (jax/_src/numpy/indexing.py, _take).
  const Value i = mode == IndexMode::kFillOrDrop ? wrap_negative(x, indices, axis) : indices;
  return gather(x, i, axis, mode, fill_value);
}

Value take(const Value& x, const Value& indices, int64_t axis, const PartitionSpec& out_sharding, IndexMode mode,
           std::optional<Scalar> fill_value) {
  return internal::auto_out_sharding("take", x, out_sharding, [&] { return take(x, indices, axis, mode, fill_value); });
}

Value IndexRef::get() const { return gather(x_, wrap_negative(x_, indices_, axis_), axis_, IndexMode::kClip); }
Value IndexRef::get(const PartitionSpec& out_sharding) const {
  return internal::auto_out_sharding(".get", x_, out_sharding, [&] { return get(); });
}
Value IndexRef::set(const Value& updates) const {
  return scatter(x_, wrap_negative(x_, indices_, axis_), updates_for(x_, indices_, axis_, updates), axis_);
}
Value IndexRef::add(const Value& updates) const {
  return scatter_add(x_, wrap_negative(x_, indices_, axis_), updates_for(x_, indices_, axis_, updates), axis_);
}

namespace {

// Scalar starts as one vector of their promoted integer dtype (int32 for none).
Value stack_starts(const std::vector<Value>& starts) {
  if (starts.empty()) return full({0}, 0.0, DType::kI32);
  DType dtype = DType::kI32;
  for (const Value& s : starts) dtype = promote_types(dtype, s.dtype());
  std::vector<Value> parts;
  for (const Value& s : starts) parts.push_back(reshape(convert(s, dtype), {1}));
  return concatenate(parts, 0);
}

}  // namespace

Value dynamic_slice(const Value& x, const std::vector<Value>& starts, std::vector<int64_t> sizes) {
  const Value s = stack_starts(starts);
  TraceState* t = TraceState::common({&x, &s});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_dynamic_slice(TraceState::id(x), TraceState::id(s), std::move(sizes)));
}

Value dynamic_update_slice(const Value& x, const Value& update, const std::vector<Value>& starts) {
  const Value s = stack_starts(starts);
  TraceState* t = TraceState::common({&x, &update, &s});
  if (t == nullptr) return Value();
  return t->make(t->graph.add_dynamic_update_slice(TraceState::id(x), TraceState::id(update), TraceState::id(s)));
}

Value iota(DType dtype, Shape shape, int64_t dimension) {
  TraceState* t = TraceState::current;
  if (t == nullptr || !t->error.ok()) return Value();
  return t->make(t->graph.add_iota(dtype, std::move(shape), dimension));
}

Value full(Shape shape, double value, DType dtype) {
  TraceState* t = TraceState::current;
  if (t == nullptr || !t->error.ok()) return Value();
  return t->make(t->graph.add_constant(dtype, std::move(shape), value));
}

// Made unsplit (the explicit rule of iota and constants), then laid out by out_sharding: the
// compiler makes each block where it lives (a constraint pins a source op's layout).
Value iota(DType dtype, Shape shape, int64_t dimension, const PartitionSpec& out_sharding) {
  const Value r = iota(dtype, std::move(shape), dimension);
  return r.ok() ? internal::reshard_for("iota", r, out_sharding) : r;
}

Value full(Shape shape, double value, DType dtype, const PartitionSpec& out_sharding) {
  const Value r = full(std::move(shape), value, dtype);
  return r.ok() ? internal::reshard_for("full", r, out_sharding) : r;
}

Value with_sharding_constraint(const Value& x, const NamedSharding& sharding) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  // In a shard_map body manual over some axes only, a constraint may name only the others,
  // where the compiler lays the body's values out (JAX's test_partial_auto_error_wsc_manual).
  if (!t->manual_axes.empty() && t->manual_axes.back().size() < t->manual_meshes.back().axis_names().size()) {
    const std::vector<std::string>& manual = t->manual_axes.back();
    for (const std::string& axis : sharding.spec().used_axes()) {
      if (std::find(manual.begin(), manual.end(), axis) == manual.end()) continue;
      return t->fail(absl::InvalidArgumentError(
          absl::StrCat("with_sharding_constraint: ", sharding.spec().to_string(), " names '", axis,
                       "', a manual axis of the enclosing shard_map (its axis_names are ", axes_to_string(manual),
                       "); inside the body only its automatic axes may be named")));
    }
  }
  return t->make(t->graph.add_sharding_constraint(TraceState::id(x), sharding));
}

std::string ShapedType::to_string() const {
  return absl::StrCat(internal::type_string(dtype, shape, spec.dims()),
                      internal::unreduced_string(spec.unreduced(), spec.reduced(), mesh_axes, varying));
}

namespace {

// The sharding part of v's type: its spec over the Explicit axes (all None outside explicit mode).
PartitionSpec type_spec(const Value& v) {
  TraceState* t = v.ok() ? TraceState::of(v) : nullptr;
  if (t != nullptr && t->explicit_mesh.has_value() && t->type_new_nodes().ok()) {
    const int id = TraceState::type_id(v);
    return internal::to_partition_spec(t->without_auto_axes(t->specs[id]))
        .with_unreduced(t->unreduced_of(id))
        .with_reduced(t->reduced_of(id));
  }
  return PartitionSpec(std::vector<Axes>(v.shape().size()));
}

}  // namespace

ShapedType type_of(const Value& v) {
  ShapedType type{v.dtype(), v.shape(), type_spec(v), {}};
  TraceState* t = v.ok() ? TraceState::of(v) : nullptr;
  if (t != nullptr && t->explicit_mesh.has_value()) type.mesh_axes = t->explicit_mesh->axis_names();
  // The varying axes are computed from the body's graph when asked (TraceState::varying).
  if (t != nullptr && !t->manual_bodies.empty()) {
    for (const auto& [axis, why] : t->varying(TraceState::type_id(v))) type.varying.push_back(axis);
  }
  return type;
}

Value reshard(const Value& x, const PartitionSpec& spec) { return internal::reshard_for("reshard", x, spec); }

namespace internal {
namespace {

// Where `api`'s spec lays a value of trace t out: on the explicit mesh in explicit mode, else
// on the ambient mesh; its axes Explicit ones only (check_explicit_axes).
absl::StatusOr<NamedSharding> out_sharding_target(const TraceState& t, absl::string_view api,
                                                  const PartitionSpec& spec) {
  absl::StatusOr<NamedSharding> target = t.explicit_mesh.has_value()
                                             ? absl::StatusOr<NamedSharding>(NamedSharding(*t.explicit_mesh, spec))
                                             : ambient_sharding(spec, api);
  if (!target.ok()) return target;
  TESSERA_RETURN_IF_ERROR(check_explicit_axes(api, spec, target->mesh()));
  // Inside explicit_axes the axes are Explicit by the types; the constraint goes on the mesh of
  // the program (the same devices), as explicit_axes' own in_shardings do.
  if (t.explicit_mesh.has_value() && t.constraint_mesh.has_value()) return NamedSharding(*t.constraint_mesh, spec);
  return target;
}

}  // namespace

Value reshard_for(absl::string_view api, const Value& x, const PartitionSpec& spec) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  absl::StatusOr<NamedSharding> target = out_sharding_target(*t, api, spec);
  if (!target.ok()) return t->fail(target.status());
  return with_sharding_constraint(x, *target);
}

Value with_out_sharding(absl::string_view api, const Value& operand, const PartitionSpec& out_sharding,
                        const std::function<Value()>& op) {
  TraceState* t = TraceState::common({&operand});
  if (t == nullptr) return Value();
  // Checked before op is traced, as JAX canonicalizes out_sharding before binding.
  absl::StatusOr<NamedSharding> target = out_sharding_target(*t, api, out_sharding);
  if (!target.ok()) return t->fail(target.status());
  if (!t->explicit_mesh.has_value()) return with_sharding_constraint(op(), *target);
  // The nodes op makes are typed when it returns: out_sharding's unreduced axes are its
  // result's (the op given out_sharding, as JAX binds it as that primitive's param), not those
  // of the ops a composite makes on the way (their own out_sharding is none).
  ++t->out_sharding_scopes;
  ++t->deferred_typing;
  const Value r = op();
  --t->deferred_typing;
  if (r.ok() && TraceState::of(r) == t && !out_sharding.unreduced().empty()) {
    const int id = TraceState::id(r);
    if (id >= static_cast<int>(t->specs.size())) t->out_unreduced[id] = out_sharding.unreduced();
  }
  const absl::Status typed = t->type_new_nodes();
  --t->out_sharding_scopes;
  if (!typed.ok()) return t->fail(typed);
  return with_sharding_constraint(r, *target);
}

std::optional<TypedOperand> typed_operand(const Value& value) {
  // A value of an enclosing trace read in a body is the body's parameter capturing it (id() says
  // so too; its trace must be the body's).
  const Value x = TraceState::local(value);
  TraceState* t = x.ok() ? TraceState::of(x) : nullptr;
  if (t == nullptr || !t->explicit_mesh.has_value() || !t->type_new_nodes().ok()) return std::nullopt;
  const int id = TraceState::id(x);
  return TypedOperand{x.dtype(), x.shape(), t->without_auto_axes(t->specs[id]), t->unreduced_of(id), t->reduced_of(id)};
}

namespace {

// The type of a cotangent of `like`: like's with unreduced and reduced swapped (JAX's
// to_ct_spec, docs/new_docs/301/sharding-ad.md): the cotangent of a reduced value is unreduced
// over the same axes (the sum over them waits for the user's reshard); that of an unreduced
// value is reduced, laid out as a replicated one, which Tessera types replicated.
PartitionSpec cotangent_spec(const Value& like) {
  const PartitionSpec spec = type_spec(like);
  return spec.partitions_only().with_unreduced(spec.reduced());
}

}  // namespace

Value typed_as(const Value& like, const std::function<Value()>& op) {
  TraceState* t = TraceState::common({&like});
  if (t == nullptr || !t->explicit_mesh.has_value()) return op();
  return with_out_sharding("reshard", like, cotangent_spec(like), op);
}

Value auto_out_sharding(absl::string_view api, const Value& operand, const PartitionSpec& out_sharding,
                        const std::function<Value()>& op) {
  TraceState* t = TraceState::common({&operand});
  if (t == nullptr) return Value();
  std::vector<std::string> explicit_axes;
  if (t->explicit_mesh.has_value()) explicit_axes = t->explicit_mesh->abstract_mesh().axes_of_type(AxisType::kExplicit);
  if (explicit_axes.empty()) return with_out_sharding(api, operand, out_sharding, op);
  absl::Status explicit_only = check_explicit_axes(api, out_sharding, *t->explicit_mesh);
  if (!explicit_only.ok()) return t->fail(explicit_only);
  return tessera::auto_axes([&](const std::vector<Value>&) { return std::vector<Value>{op()}; },
                            std::move(explicit_axes),
                            std::vector<PartitionSpec>{out_sharding})(std::vector<Value>{})[0];
}

Value auto_typed_as(const Value& like, const std::function<Value()>& op) {
  TraceState* t = TraceState::common({&like});
  if (t == nullptr || !t->explicit_mesh.has_value()) return op();
  return auto_out_sharding("reshard", like, cotangent_spec(like), op);
}

}  // namespace internal

namespace {

// The axes `axes` names (all of the mesh's when empty), each checked to be an axis of `mesh`
// that is not Manual (JAX: going from Manual to Auto or Explicit is not allowed).
absl::StatusOr<std::vector<std::string>> switched_axes(const char* who, const Mesh& mesh,
                                                       std::vector<std::string> axes) {
  if (axes.empty()) axes = mesh.axis_names();
  for (const std::string& a : axes) {
    const int i = mesh.axis_index(a);
    if (i < 0) return absl::InvalidArgumentError(absl::StrCat(who, ": '", a, "' is not an axis of ", mesh.to_string()));
    if (mesh.axis_types()[i] == AxisType::kManual) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": '", a,
                                                     "' is a Manual axis (inside shard_map); going from Manual to ",
                                                     who, " is not allowed, as in JAX"));
    }
  }
  return axes;
}

}  // namespace

namespace internal {

TracedFunction auto_axes(TracedFunction f, std::vector<std::string> axes,
                         std::function<std::vector<PartitionSpec>()> out_shardings_of) {
  return [f = std::move(f), axes = std::move(axes),
          out_shardings_of = std::move(out_shardings_of)](const std::vector<Value>& in) -> std::vector<Value> {
    TraceState* t = TraceState::current;
    if (t == nullptr) return {Value()};
    // As jax.sharding.auto_axes: with no Explicit axis to switch, f runs as it is.
    if (!t->explicit_mesh.has_value()) return f(in);
    const Mesh& mesh = *t->explicit_mesh;
    absl::StatusOr<std::vector<std::string>> names = switched_axes("auto_axes", mesh, axes);
    if (!names.ok()) return {t->fail(names.status())};
    std::vector<std::string> explicit_names;
    for (const std::string& a : *names) {
      if (mesh.axis_types()[mesh.axis_index(a)] == AxisType::kExplicit) explicit_names.push_back(a);
    }
    if (explicit_names.empty()) return f(in);
    absl::Status typed = t->type_new_nodes();
    if (!typed.ok()) return {t->fail(typed)};
    const size_t depth = t->auto_axes.size();
    t->auto_axes.insert(t->auto_axes.end(), explicit_names.begin(), explicit_names.end());
    std::vector<Value> out = f(in);
    typed = t->type_new_nodes();
    t->auto_axes.resize(depth);
    if (!typed.ok()) return {t->fail(typed)};
    const std::vector<PartitionSpec> out_shardings = out_shardings_of();
    if (out_shardings.size() != out.size()) {
      t->fail(absl::InvalidArgumentError(
          absl::StrCat("auto_axes: ", out_shardings.size(), " out_shardings for ", out.size(), " results")));
      return {Value()};
    }
    for (size_t i = 0; i < out.size(); ++i) out[i] = reshard_for("auto_axes", out[i], out_shardings[i]);
    return out;
  };
}

}  // namespace internal

AxesSwitched auto_axes(TracedFunction f, std::vector<std::string> axes, std::vector<PartitionSpec> out_shardings) {
  return AxesSwitched(internal::auto_axes(std::move(f), std::move(axes),
                                          [out_shardings = std::move(out_shardings)] { return out_shardings; }));
}

AxesSwitched explicit_axes(TracedFunction f, std::vector<std::string> axes, std::vector<PartitionSpec> in_shardings) {
  return AxesSwitched([f = std::move(f), axes = std::move(axes),
                       in_shardings = std::move(in_shardings)](const std::vector<Value>& in) -> std::vector<Value> {
    TraceState* t = TraceState::current;
    if (t == nullptr) return {Value()};
    std::optional<Mesh> mesh = t->explicit_mesh.has_value() ? t->explicit_mesh : get_mesh();
    if (!mesh.has_value()) {
      // JAX's wording (jax/_src/pjit.py, _explicit_axes).
      return {t->fail(absl::InvalidArgumentError(
          "explicit_axes: Context mesh cannot be empty. Please use `set_mesh` (a MeshScope) to enter into a mesh "
          "context when using `explicit_axes` API (or call it inside a trace in explicit mode)."))};
    }
    absl::StatusOr<std::vector<std::string>> names = switched_axes("explicit_axes", *mesh, axes);
    if (!names.ok()) return {t->fail(names.status())};
    if (in_shardings.size() != in.size()) {
      return {t->fail(absl::InvalidArgumentError(
          absl::StrCat("explicit_axes: ", in_shardings.size(), " in_shardings for ", in.size(), " arguments")))};
    }
    // The axes that become Explicit here, and the mesh the types see meanwhile: JAX's
    // use_abstract_mesh(cur_mesh.update_axis_types({a: Explicit})) (jax/_src/pjit.py,
    // _get_new_mesh), cur_mesh being the one in force, where an enclosing auto_axes made its
    // axes Auto: those named here are Explicit again inside, so they leave the auto_axes list.
    std::vector<std::string> switched;
    std::vector<AxisType> types = mesh->axis_types();
    const std::vector<std::string> outer_auto = t->auto_axes;
    for (const std::string& a : *names) {
      AxisType& type = types[mesh->axis_index(a)];
      const bool auto_here = std::find(outer_auto.begin(), outer_auto.end(), a) != outer_auto.end();
      if (type != AxisType::kExplicit || auto_here) switched.push_back(a);
      type = AxisType::kExplicit;
    }
    absl::StatusOr<Mesh> inner = Mesh::create(mesh->shape(), mesh->axis_names(), mesh->device_ids(), types);
    if (!inner.ok()) return {t->fail(inner.status())};
    const std::optional<Mesh> saved = t->explicit_mesh;
    if (saved.has_value()) {
      absl::Status typed = t->type_new_nodes();
      if (!typed.ok()) return {t->fail(typed)};
    }
    std::vector<std::string> inner_auto;
    for (const std::string& a : outer_auto) {
      if (std::find(names->begin(), names->end(), a) == names->end()) inner_auto.push_back(a);
    }
    t->auto_axes = std::move(inner_auto);
    for (size_t i = 0; i < in.size(); ++i) {
      if (!in[i].ok()) continue;  // its op failed the trace already
      absl::Status fits =
          internal::check_explicit_axes_in_sharding(i, {in[i].dtype(), in[i].shape()}, in_shardings[i], *inner);
      if (!fits.ok()) {
        t->auto_axes = outer_auto;
        return {t->fail(fits)};
      }
    }
    // Nodes traced outside explicit mode are untyped: unsplit over every Explicit axis.
    for (int id = static_cast<int>(t->specs.size()); id < t->graph.size(); ++id) {
      t->specs.emplace_back(t->graph.node(id).shape.size());
    }
    const int start = t->graph.size();
    t->explicit_mesh = *inner;
    const std::optional<Mesh> saved_constraint_mesh = t->constraint_mesh;
    if (!t->constraint_mesh.has_value()) t->constraint_mesh = *mesh;
    std::vector<Value> args;
    for (size_t i = 0; i < in.size(); ++i) {
      args.push_back(with_sharding_constraint(in[i], NamedSharding(*mesh, in_shardings[i])));
    }
    std::vector<Value> out = f(args);
    absl::Status typed = t->type_new_nodes();
    // Leaving: the switched axes leave the types of what was traced inside (JAX reshards the
    // results to their specs without those axes, which on Auto axes constrains nothing).
    for (int id = start; id < static_cast<int>(t->specs.size()); ++id) internal::without_axes(t->specs[id], switched);
    t->explicit_mesh = saved;
    t->constraint_mesh = saved_constraint_mesh;
    t->auto_axes = outer_auto;
    if (!typed.ok()) return {t->fail(typed)};
    return out;
  });
}

Value with_sharding_constraint(const Value& x, const PartitionSpec& spec) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  absl::StatusOr<NamedSharding> sharding = ambient_sharding(spec, "with_sharding_constraint");
  if (!sharding.ok()) {
    t->fail(sharding.status());
    return Value();
  }
  return with_sharding_constraint(x, *sharding);
}

}  // namespace tessera

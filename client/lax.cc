// Issue #15's composites over the graph's ops (trace.h, "Composites"): pad, the cumulative
// reductions, argmin, tril/triu and einsum. Each is traced from existing ops, so its kernels,
// sharding rules and VJPs are theirs (concatenate, slice, reshape, broadcast_in_dim,
// dot_general, transpose, select, argmax).
#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"
#include "tessera/trace.h"

namespace tessera {
namespace {

using internal::normalize_axis;
using internal::TraceState;

// x[start:limit] along dimension `d` only.
Value slice_dim(const Value& x, int64_t d, int64_t start, int64_t limit) {
  std::vector<int64_t> lo(x.rank(), 0);
  std::vector<int64_t> hi = x.shape();
  lo[d] = start;
  hi[d] = limit;
  return slice(x, std::move(lo), std::move(hi));
}

// x's shape with dimension `d` of `size`.
Shape with_dim(const Shape& shape, int64_t d, int64_t size) {
  Shape s = shape;
  s[d] = size;
  return s;
}

Value invalid(TraceState* t, std::string message) { return t->fail(absl::InvalidArgumentError(std::move(message))); }

// The inclusive scan of `combine` (associative and commutative) along `axis`: log2(n) steps,
// step d combining each element with the one d before it (after it, reversed) — the
// Hillis-Steele prefix scan, in slices and concatenates.
Value cumulative(const char* name, const Value& x, int64_t axis, bool reverse,
                 Value (*combine)(const Value&, const Value&)) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  axis = normalize_axis(axis, x.rank());
  if (axis < 0 || axis >= x.rank()) {
    return invalid(t, absl::StrCat(name, ": axis ", axis, " is out of range for shape ", shape_to_string(x.shape())));
  }
  if (std::optional<internal::TypedOperand> typed = internal::typed_operand(x)) {
    internal::TypeRuleResult r = internal::cumulative_type_rule(name, *typed, axis);
    if (!r.error.empty()) return t->fail(internal::type_rule_error(name, {*typed}, r));
  }
  const int64_t n = x.shape()[axis];
  Value y = x;
  for (int64_t d = 1; d < n; d *= 2) {
    const Value earlier = slice_dim(y, axis, 0, n - d), later = slice_dim(y, axis, d, n);
    y = reverse ? concatenate({combine(earlier, later), slice_dim(y, axis, n - d, n)}, axis)
                : concatenate({slice_dim(y, axis, 0, d), combine(earlier, later)}, axis);
  }
  return y;
}

// jnp's cumsum and cumprod count bools as int32.
Value counted(const Value& x) { return x.ok() && x.dtype() == DType::kBool ? convert(x, DType::kI32) : x; }

Value triangle(const char* name, const Value& x, int64_t k, bool lower) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  const int64_t r = x.rank();
  if (r < 2) return invalid(t, absl::StrCat(name, ": operand is ", shape_to_string(x.shape()), "; it needs rank >= 2"));
  const Shape m = {x.shape()[r - 2], x.shape()[r - 1]};
  const Value shifted = iota(DType::kI32, m, 0) + k, col = iota(DType::kI32, m, 1);
  const Value keep = broadcast_in_dim(lower ? col <= shifted : col >= shifted, x.shape(), {r - 2, r - 1});
  return where(keep, x, full(x.shape(), 0.0, x.dtype()));
}

// x[..., idx[..., j]] along the last dimension (jnp.take_along_axis): one gather on the
// flattened x, the indices offset by their row, so grad is gather's (a scatter_add). In
// explicit mode the result is typed as idx (the flattening is laid out by the compiler).
Value take_along_last(const Value& x, const Value& idx) {
  if (!x.ok() || !idx.ok()) return Value();
  return internal::typed_as(idx, [&] {
    const int64_t n = x.shape().back(), k = idx.shape().back();
    if (n == 0 || k == 0) return reshape(x, idx.shape());
    const int64_t rows = num_elements(x.shape()) / n;
    const Value flat_idx = reshape(reshape(idx, {rows, k}) + iota(DType::kI32, {rows, k}, 0) * n, {rows * k});
    return reshape(gather(reshape(x, {rows * n}), flat_idx, 0, IndexMode::kClip), idx.shape());
  });
}

}  // namespace

Value argsort(const Value& x, int64_t axis, bool descending) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  Node n;
  n.op = descending ? Op::kArgsortDescending : Op::kArgsort;
  n.operands = {TraceState::id(x)};
  n.attributes = ArgmaxAttrs{normalize_axis(axis, x.rank())};
  return t->make(t->graph.add_node(std::move(n)));
}

// sort and top_k of a value reduced over some axes are reduced alike, values and indices (JAX's
// _sort_abstract_eval and _top_k_abstract_eval return the operand's type): they run on x
// resharded to its layout without the reduced axes (a reduced value is laid out as a replicated
// one: no data moves), since take_along_last's index arithmetic would meet a replicated iota,
// which the nary rule refuses beside a reduced operand; the results are then typed reduced.
Value sort(const Value& x) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (x.rank() == 0) return invalid(t, "sort: the operand is a scalar; it needs rank >= 1");
  if (std::optional<internal::TypedOperand> typed = internal::typed_operand(x)) {
    const internal::TypeRuleResult r = internal::sorting_unreduced_rule("sort", *typed);
    if (!r.error.empty()) return t->fail(internal::type_rule_error("sort", {*typed}, r));
    if (!typed->reduced.empty()) {
      const PartitionSpec plain = internal::to_partition_spec(typed->spec);
      return internal::reshard_for("sort", sort(internal::reshard_for("sort", x, plain)),
                                   plain.with_reduced(typed->reduced));
    }
  }
  return take_along_last(x, argsort(x, -1));
}

std::pair<Value, Value> top_k(const Value& x, int64_t k) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return {};
  if (x.rank() == 0 || k < 0 || k > x.shape().back()) {
    invalid(t, absl::StrCat("top_k: k = ", k, " for an operand of shape ", shape_to_string(x.shape()),
                            "; it needs rank >= 1 and 0 <= k <= the last dimension"));
    return {};
  }
  if (std::optional<internal::TypedOperand> typed = internal::typed_operand(x)) {
    internal::TypeRuleResult r = internal::top_k_type_rule(*typed, x.rank() - 1);
    if (!r.error.empty()) {
      t->fail(internal::type_rule_error("top_k", {*typed}, r));
      return {};
    }
    if (!typed->reduced.empty()) {
      const PartitionSpec plain = internal::to_partition_spec(typed->spec);
      const auto [values, indices] = top_k(internal::reshard_for("top_k", x, plain), k);
      const PartitionSpec reduced = plain.with_reduced(typed->reduced);
      return {internal::reshard_for("top_k", values, reduced), internal::reshard_for("top_k", indices, reduced)};
    }
  }
  std::vector<int64_t> start(x.rank(), 0);
  std::vector<int64_t> limit = x.shape();
  limit.back() = k;
  const Value indices = slice(argsort(x, -1, true), std::move(start), std::move(limit));
  return {take_along_last(x, indices), indices};
}

Value pad(const Value& x, const Value& padding_value, const std::vector<PadDim>& config) {
  TraceState* t = TraceState::common({&x, &padding_value});
  if (t == nullptr) return Value();
  if (static_cast<int64_t>(config.size()) != x.rank()) {
    return invalid(t, absl::StrCat("pad: ", config.size(), " padding entries for an operand of shape ",
                                   shape_to_string(x.shape()), "; it needs one per dimension"));
  }
  if (padding_value.rank() != 0 || padding_value.dtype() != x.dtype()) {
    return invalid(t,
                   absl::StrCat("pad: padding_value is ", type_to_string(padding_value.dtype(), padding_value.shape()),
                                "; it must be a scalar of the operand's dtype ", dtype_name(x.dtype())));
  }
  Shape out = x.shape();
  for (int64_t d = 0; d < x.rank(); ++d) {
    const PadDim& p = config[d];
    const int64_t n = x.shape()[d];
    if (p.interior < 0) {
      return invalid(t, absl::StrCat("pad: interior padding ", p.interior, " of dimension ", d, " is negative"));
    }
    out[d] = p.low + p.high + n + std::max<int64_t>(n - 1, 0) * p.interior;
    if (out[d] < 0) {
      return invalid(t, absl::StrCat("pad: dimension ", d, " of ", shape_to_string(x.shape()), " padded by (", p.low,
                                     ", ", p.high, ", ", p.interior, ") would have negative size ", out[d]));
    }
  }
  std::optional<internal::TypedOperand> typed = internal::typed_operand(x);
  // The fills' scalar: padding_value, or, for an operand unreduced over some axes, the same
  // value typed unreduced over them (see pad_type_rule).
  Value fill_value = padding_value;
  if (typed.has_value() && !typed->unreduced.empty()) {
    std::optional<internal::TypedOperand> typed_value = internal::typed_operand(padding_value);
    const Node& v = t->graph.node(TraceState::id(TraceState::local(padding_value)));
    const std::optional<double> constant =
        v.op == Op::kConstant ? std::optional<double>(v.attrs<ConstantAttrs>().value.to_double()) : std::nullopt;
    const bool zero = constant == 0.0;
    const bool same_terms = typed_value.has_value() && typed_value->unreduced == typed->unreduced;
    internal::TypeRuleResult r = internal::pad_unreduced_rule(*typed, zero || same_terms);
    if (!r.error.empty()) return t->fail(internal::type_rule_error("pad", {*typed}, r));
    if (!same_terms) {
      const PartitionSpec unreduced = PartitionSpec().with_unreduced(typed->unreduced);
      // A zero of every device's term (-0.0 kept), typed unreduced as the vjp's zeros are.
      fill_value = internal::with_out_sharding("pad", padding_value, unreduced,
                                               [&] { return full({}, *constant, padding_value.dtype()); });
    }
  }
  auto padded = [&] {
    Value y = x;
    for (int64_t d = 0; d < x.rank(); ++d) {
      const PadDim& p = config[d];
      const int64_t n = y.shape()[d];
      auto fill = [&](const Shape& s) { return broadcast_in_dim(fill_value, s, {}); };
      if (p.interior > 0 && n > 1) {  // each element followed by `interior` fills, the last one's dropped
        Shape column = y.shape();
        column.insert(column.begin() + d + 1, 1);
        const Value spread = concatenate({reshape(y, column), fill(with_dim(column, d + 1, p.interior))}, d + 1);
        y = slice_dim(reshape(spread, with_dim(y.shape(), d, n * (1 + p.interior))), d, 0, n + (n - 1) * p.interior);
      }
      std::vector<Value> parts;
      if (p.low > 0) parts.push_back(fill(with_dim(y.shape(), d, p.low)));
      parts.push_back(y);
      if (p.high > 0) parts.push_back(fill(with_dim(y.shape(), d, p.high)));
      if (parts.size() > 1) y = concatenate(parts, d);
      if (p.low < 0 || p.high < 0) {  // negative padding crops
        const int64_t start = std::max<int64_t>(-p.low, 0);
        y = slice_dim(y, d, start, start + out[d]);
      }
    }
    return y;
  };
  // In explicit mode, lax.py's _pad_sharding_rule gives the result's type; the steps between
  // are the compiler's to lay out.
  if (!typed.has_value()) return padded();
  internal::TypeRuleResult r = internal::pad_type_rule(*t->explicit_mesh, *typed, out);
  if (!r.error.empty()) return t->fail(internal::type_rule_error("pad", {*typed}, r));
  // Unreduced and reduced as the operand (JAX's _pad_ur_rule: getu(operand), getr(operand)).
  const PartitionSpec spec =
      internal::to_partition_spec(r.spec).with_unreduced(typed->unreduced).with_reduced(typed->reduced);
  if (typed->unreduced.empty()) return internal::with_out_sharding("pad", x, spec, padded);
  // An unreduced operand's steps keep its axes (fills, concatenates, reshapes and slices of
  // terms): typed as ops without an out_sharding, once made (their layouts are the compiler's
  // until the result is pinned, as with_out_sharding's are), then the result pinned to its type.
  ++t->deferred_typing;
  const Value y = padded();
  --t->deferred_typing;
  const absl::Status steps = t->type_new_nodes();
  if (!steps.ok()) return t->fail(steps);
  return internal::reshard_for("pad", y, spec);
}

Value pad(const Value& x, std::vector<std::pair<int64_t, int64_t>> pad_width, double constant_value) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  if (pad_width.size() == 1) pad_width.resize(x.rank(), pad_width[0]);
  std::vector<PadDim> config;
  for (const auto& [before, after] : pad_width) {
    if (before < 0 || after < 0) {
      return invalid(t, absl::StrCat("pad: pad_width (", before, ", ", after, ") is negative; jnp.pad needs >= 0"));
    }
    config.push_back({before, after, 0});
  }
  return pad(x, full({}, constant_value, x.dtype()), config);
}

Value cumsum(const Value& x, int64_t axis, bool reverse) {
  return cumulative("cumsum", counted(x), axis, reverse, add);
}
Value cumprod(const Value& x, int64_t axis, bool reverse) {
  return cumulative("cumprod", counted(x), axis, reverse, mul);
}
Value cummax(const Value& x, int64_t axis, bool reverse) { return cumulative("cummax", x, axis, reverse, maximum); }
Value cummin(const Value& x, int64_t axis, bool reverse) { return cumulative("cummin", x, axis, reverse, minimum); }

Value argmin(const Value& x, int64_t axis, DType index_dtype) {
  TraceState* t = TraceState::common({&x});
  if (t == nullptr) return Value();
  // argmin_p has no ur_rule (jax/_src/lax/lax.py), so call_ur_rule refuses a reduced or
  // unreduced operand, naming argmin (not the argmax or neg it is traced from here).
  if (std::optional<internal::TypedOperand> typed = internal::typed_operand(x);
      typed.has_value() && (!typed->reduced.empty() || !typed->unreduced.empty())) {
    internal::ReducedRuleResult r = internal::no_reduced_rule("argmin");
    if (!typed->unreduced.empty()) r.fix = internal::kReduceFirstFix;
    return t->fail(internal::type_rule_error("argmin", {*typed}, internal::TypeRuleResult{{}, r.error, r.fix}));
  }
  // An order-reversing map keeps the first minimum first: -x for floats (NaN stays NaN, which
  // argmax takes first, as jnp.argmin does), ~x for integers (no overflow), !x for bool.
  return argmax(is_floating(x.dtype()) ? -x : logical_not(x), axis, index_dtype);
}

Value tril(const Value& x, int64_t k) { return triangle("tril", x, k, true); }
Value triu(const Value& x, int64_t k) { return triangle("triu", x, k, false); }

namespace {

// out_sharding (over einsum's output labels `out`) in the order of the dot_general's result
// labels `result`, of which `out` is a permutation: jax/_src/numpy/einsum.py's
// _get_inverse_sharding (its unreduced and reduced axes kept). A spec longer than the output
// is passed as it is, for the constraint to refuse.
PartitionSpec dot_out_sharding(const PartitionSpec& out_sharding, const std::string& out, const std::string& result) {
  if (out_sharding.size() > static_cast<int>(out.size())) return out_sharding;
  std::vector<Axes> dims;
  for (char c : result) dims.push_back(out_sharding.axes(static_cast<int>(out.find(c))));
  return PartitionSpec(std::move(dims), out_sharding.unreduced(), out_sharding.reduced());
}

// einsum, its out_sharding (when given) the dot_general's, as jnp.einsum passes it.
Value einsum_with(const std::string& subscripts, const Value& a, const Value& b, const PartitionSpec* out_sharding) {
  TraceState* t = TraceState::common({&a, &b});
  if (t == nullptr) return Value();
  std::string spec;
  for (char c : subscripts) {
    if (c != ' ') spec.push_back(c);
  }
  const size_t comma = spec.find(','), arrow = spec.find("->");
  if (comma == std::string::npos || arrow == std::string::npos || comma > arrow ||
      spec.find(',', comma + 1) != std::string::npos) {
    return invalid(t, absl::StrCat("einsum: subscripts '", subscripts,
                                   "' must have the form 'ab,bc->ac': two operands and an explicit output"));
  }
  const std::string in[2] = {spec.substr(0, comma), spec.substr(comma + 1, arrow - comma - 1)};
  const std::string out = spec.substr(arrow + 2);
  const Value* operands[2] = {&a, &b};
  std::map<char, int64_t> pos[2];  // label -> dimension, per operand
  for (int k = 0; k < 2; ++k) {
    if (static_cast<int64_t>(in[k].size()) != operands[k]->rank()) {
      return invalid(t, absl::StrCat("einsum: operand ", k, " has subscripts '", in[k], "' but shape ",
                                     shape_to_string(operands[k]->shape())));
    }
    for (size_t d = 0; d < in[k].size(); ++d) {
      const char c = in[k][d];
      if (!std::isalpha(static_cast<unsigned char>(c))) {
        return invalid(t, absl::StrCat("einsum: '", std::string(1, c), "' in '", subscripts,
                                       "' is not a label (letters only; no ellipsis)"));
      }
      if (!pos[k].emplace(c, d).second) {
        return invalid(t, absl::StrCat("einsum: label '", std::string(1, c), "' repeats in operand ", k, " ('", in[k],
                                       "'); traces and diagonals are not supported"));
      }
    }
  }
  for (size_t i = 0; i < out.size(); ++i) {
    const char c = out[i];
    if (out.find(c, i + 1) != std::string::npos || (!pos[0].count(c) && !pos[1].count(c))) {
      return invalid(t, absl::StrCat("einsum: output label '", std::string(1, c), "' of '", subscripts,
                                     "' repeats or names no operand dimension"));
    }
  }
  // A label of one operand only and not of the output is summed out first.
  Value x[2] = {a, b};
  std::string labels[2] = {in[0], in[1]};
  for (int k = 0; k < 2; ++k) {
    std::vector<int64_t> summed;
    std::string kept;
    for (size_t d = 0; d < labels[k].size(); ++d) {
      const char c = labels[k][d];
      if (!pos[1 - k].count(c) && out.find(c) == std::string::npos) {
        summed.push_back(static_cast<int64_t>(d));
      } else {
        kept.push_back(c);
      }
    }
    if (!summed.empty()) x[k] = sum(x[k], summed);
    labels[k] = kept;
  }
  // dot_general's result: batch labels (lhs order), then lhs free, then rhs free.
  DotDims dims;
  std::string result;
  for (size_t d = 0; d < labels[0].size(); ++d) {
    const char c = labels[0][d];
    const size_t other = labels[1].find(c);
    if (other == std::string::npos) continue;
    const bool batch = out.find(c) != std::string::npos;
    (batch ? dims.lhs_batch : dims.lhs_contracting).push_back(static_cast<int64_t>(d));
    (batch ? dims.rhs_batch : dims.rhs_contracting).push_back(static_cast<int64_t>(other));
    if (batch) result.push_back(c);
  }
  for (int k = 0; k < 2; ++k) {
    for (char c : labels[k]) {
      if (labels[1 - k].find(c) == std::string::npos) result.push_back(c);
    }
  }
  const Value product = out_sharding == nullptr
                            ? dot_general(x[0], x[1], dims)
                            : internal::with_out_sharding("einsum", x[0], dot_out_sharding(*out_sharding, out, result),
                                                          [&] { return dot_general(x[0], x[1], dims); });
  std::vector<int64_t> permutation;
  for (char c : out) permutation.push_back(static_cast<int64_t>(result.find(c)));
  bool identity = true;
  for (size_t i = 0; i < permutation.size(); ++i) identity = identity && permutation[i] == static_cast<int64_t>(i);
  return identity ? product : transpose(product, permutation);
}

}  // namespace

Value einsum(const std::string& subscripts, const Value& a, const Value& b, const PartitionSpec& out_sharding) {
  return einsum_with(subscripts, a, b, &out_sharding);
}

Value einsum(const std::string& subscripts, const Value& a, const Value& b) {
  return einsum_with(subscripts, a, b, nullptr);
}

}  // namespace tessera

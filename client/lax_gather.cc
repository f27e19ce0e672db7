// lax.gather / lax.scatter_add / lax.scatter with dimension numbers, and jnp.take_along_axis
// (trace.h). Each is a composite over the one-axis gather / scatter ops: the operand's
// dimensions that the indices address (start_index_map / scatter_dims_to_operand_dims, the
// batching and the collapsed / inserted ones) are moved to the front and folded into one, the
// index vectors become one linear index into it (clamped, or masked to -1 so the one-axis op
// fills or drops), and the other dimensions, taken from 0 with their slice size, ride along
// whole. So the kernels, sharding rules, VJPs and vmap are those of gather, scatter(_add),
// transpose, reshape and slice. scatter_mul / min / max have no one-axis op: their updates are
// sorted by linear index and combined within runs of equal indices by a segmented scan
// (log2(n) shifted steps), and each run's total is scattered once (combine_scatter).
// scatter_sub is scatter_add of the negated updates; scatter_apply counts the windows on each
// element with a scatter_add and applies func that many times. On Explicit axes a split
// batching dimension runs block by block (gather_by_batch_blocks, scatter_by_batch_blocks).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/trace_state.h"
#include "tessera/shard_map.h"
#include "tessera/trace.h"

namespace tessera {
namespace {

using internal::TraceState;
using Dims = std::vector<int64_t>;

std::string dims_str(const Dims& d) { return absl::StrCat("(", absl::StrJoin(d, ", "), ")"); }

bool contains(const Dims& d, int64_t v) { return std::find(d.begin(), d.end(), v) != d.end(); }

int64_t position(const Dims& d, int64_t v) { return std::find(d.begin(), d.end(), v) - d.begin(); }

// JAX's dimension-number checks (jax/_src/lax/slicing.py: _is_sorted, _no_duplicate_dims,
// _sorted_dims_in_range, _dims_in_range, _disjoint_dims), as INVALID_ARGUMENT messages.
struct DimsChecker {
  const char* op;        // "gather" / "scatter"
  const char* op_title;  // "Gather" / "Scatter", as JAX's messages start
  std::string error;

  bool failed() const { return !error.empty(); }
  void fail(std::string message) {
    if (error.empty()) error = std::move(message);
  }
  void sorted(const Dims& d, const char* name) {
    if (!std::is_sorted(d.begin(), d.end()))
      fail(absl::StrCat(name, " in ", op, " op must be sorted; got ", dims_str(d)));
  }
  void unique(const Dims& d, const char* name) {
    Dims s = d;
    std::sort(s.begin(), s.end());
    if (std::adjacent_find(s.begin(), s.end()) != s.end()) {
      fail(absl::StrCat(name, " in ", op, " op must not repeat; got: ", dims_str(d), "."));
    }
  }
  void in_range(const Dims& d, int64_t rank, const char* name) {
    for (int64_t v : d) {
      if (v < 0 || v >= rank) {
        fail(absl::StrCat("Invalid ", name, " set in ", op, " op; valid range is [0, ", rank, "); got: ", v, "."));
      }
    }
  }
  void disjoint(const Dims& a, const Dims& b, const char* name_a, const char* name_b) {
    for (int64_t v : a) {
      if (contains(b, v)) {
        fail(absl::StrCat(name_a, " and ", name_b, " in ", op, " op must be disjoint; got: ", dims_str(a), " and ",
                          dims_str(b), "."));
      }
    }
  }
  // The operand's batching dimensions, then (after the caller's disjointness checks) the
  // indices': as _gather_shape_rule and _scatter_shape_rule check them.
  void operand_batching(const Dims& operand_batching, int64_t rank) {
    unique(operand_batching, "operand_batching_dims");
    sorted(operand_batching, "operand_batching_dims");
    in_range(operand_batching, rank, "operand_batching_dims");
  }
  void indices_batching(const Dims& operand_batching, const Dims& indices_batching, const Shape& operand,
                        const Shape& indices, const char* indices_name) {
    unique(indices_batching, indices_name);
    in_range(indices_batching, static_cast<int64_t>(indices.size()), indices_name);
    if (contains(indices_batching, static_cast<int64_t>(indices.size()) - 1)) {
      fail(absl::StrCat(op_title, " op cannot have the index vector dimension as a batching dimension; got ",
                        dims_str(indices_batching), "."));
    }
    if (operand_batching.size() != indices_batching.size()) {
      fail(absl::StrCat(op_title, " op requires equal numbers of operand_batching_dims and ", indices_name, ", got ",
                        dims_str(operand_batching), " and ", dims_str(indices_batching), "."));
    }
    if (failed()) return;
    Dims operand_shape, indices_shape;
    for (size_t k = 0; k < operand_batching.size(); ++k) {
      operand_shape.push_back(operand[operand_batching[k]]);
      indices_shape.push_back(indices[indices_batching[k]]);
    }
    if (operand_shape != indices_shape) {
      fail(absl::StrCat(op_title,
                        " op requires operand batching dimensions and indices batching dimensions to have the "
                        "same shape, got ",
                        dims_str(operand_shape), " and ", dims_str(indices_shape), "."));
    }
  }
};

// Checks shared by both ops before any shape arithmetic: integer indices of rank >= 1.
std::string check_indices(const char* op, const Value& indices) {
  if (indices.dtype() != DType::kI32 && indices.dtype() != DType::kI64) {
    return absl::StrCat(op, ": indices are ", dtype_name(indices.dtype()), shape_to_string(indices.shape()),
                        "; they need int32 or int64");
  }
  if (indices.rank() < 1) {
    return absl::StrCat(op,
                        ": indices are a scalar; the index vector is their last dimension (JAX's implicit "
                        "index_vector_dim), so scalar indices need a trailing dimension of size 1");
  }
  return "";
}

// How the operand is addressed: `linear` (increasing) are the operand dimensions folded into the
// linear index, `free` the others (taken from 0, `window` long); `window[d]` is dimension d's
// slice size; `mapped[k]` is the operand dimension index component k addresses; `batching` /
// `indices_batching` pair operand dimensions with the indices' batch dimensions.
struct Addressing {
  Dims linear, free, window, mapped, batching, indices_batching;
  Dims collapsed;  // collapsed_slice_dims / inserted_window_dims
  // Mapped dimensions with a window of the whole dimension (not collapsed) kept free: their
  // only start is 0, so they need not fold, their starts only checked against 0 (linear_index).
  Dims whole_mapped;

  bool windowed(int64_t d) const { return !contains(collapsed, d) && !contains(batching, d); }
  // The linear dimensions that keep a window dimension (mapped and not collapsed).
  Dims windowed_linear() const {
    Dims out;
    for (int64_t d : linear)
      if (windowed(d)) out.push_back(d);
    return out;
  }
  // Where operand dimension d's window lies in the one-axis op's result (or updates): after the
  // `nb` batch dimensions, the windowed linear dimensions, then the free ones.
  int64_t window_position(int64_t d, int64_t nb) const {
    const Dims wl = windowed_linear();
    if (contains(wl, d)) return nb + position(wl, d);
    return nb + static_cast<int64_t>(wl.size()) + position(free, d);
  }
};

// Whether every split of a value of trace `t` shows in its type: no mesh axis of size > 1 that
// the compiler lays out (Auto, or Explicit made Auto by auto_axes) can split it. In explicit mode
// by the types' mesh; otherwise by the arguments' mesh and the meshes that the constraints and
// shard_maps so far in this trace's graph and its enclosing traces' graphs name (none: the values
// are whole, as on one device). Not those inside the bodies of loops or conds traced before: a
// split named only there folds, and the compiler gathers it (correct values, a collective more).
bool splits_typed(TraceState* t) {
  if (t == nullptr) return true;
  if (t->explicit_mesh.has_value()) return !internal::has_auto_split(*t->explicit_mesh, t->auto_axes);
  for (; t != nullptr; t = t->parent) {
    if (t->args_on_auto_axes) return false;
    for (; t->auto_constraint_scanned < t->graph.size(); ++t->auto_constraint_scanned) {
      const auto* s = std::get_if<ShardingAttrs>(&t->graph.node(t->auto_constraint_scanned).attributes);
      if (s != nullptr && internal::has_auto_split(s->sharding.mesh())) t->auto_constraint_seen = true;
    }
    if (t->auto_constraint_seen) return false;
  }
  return true;
}

// A mapped dimension the window takes whole (its only start is 0) stays free when it may be
// split: on an Explicit axis (a fold would merge the split; JAX's explicit-mode rules let a full
// slice keep its split), or on any axis when some split is not in the types (an Auto axis: the
// trace cannot tell, and a fold would make the compiler gather it). fold_operand then transposes
// the linear dimensions to the front, which keeps every split (a transpose is local). It stays
// free too when it comes after every dimension that must fold (the operand keeps its order).
// Otherwise, with every split known and none on it, it folds as a linear dimension with start 0:
// kept free before a folded one, fold_operand would transpose the whole operand (and
// unfold_operand back), as for x[B,H,T,D] written at (b, 0, t_b, 0).
Addressing make_addressing(const Value& x, Dims window, Dims mapped, Dims collapsed, Dims batching,
                           Dims indices_batching) {
  const Shape operand = x.shape();
  const PartitionSpec spec = type_of(x).spec;  // all None outside explicit mode
  const bool known = splits_typed(x.ok() ? TraceState::of(x) : nullptr);
  Addressing a{{},
               {},
               std::move(window),
               std::move(mapped),
               std::move(batching),
               std::move(indices_batching),
               std::move(collapsed),
               {}};
  const int64_t rank = static_cast<int64_t>(operand.size());
  auto addressed = [&](int64_t d) {
    return contains(a.mapped, d) || contains(a.collapsed, d) || contains(a.batching, d);
  };
  auto whole = [&](int64_t d) { return contains(a.mapped, d) && a.windowed(d) && a.window[d] == operand[d]; };
  int64_t last_folded = -1;  // the last dimension that must fold
  for (int64_t d = 0; d < rank; ++d)
    if (addressed(d) && !whole(d)) last_folded = d;
  for (int64_t d = 0; d < rank; ++d) {
    const bool split = !known || !spec.axes(static_cast<int>(d)).empty();
    const bool keep_free = whole(d) && (split || d > last_folded);
    if (keep_free) a.whole_mapped.push_back(d);
    (addressed(d) && !keep_free ? a.linear : a.free).push_back(d);
  }
  return a;
}

// A lax gather / scatter that is the one-axis op with batch dimensions (GatherAttrs.batch_dims):
// the operand's batching dimensions (at least one) are its first n, paired in order with the indices' first n;
// exactly one mapped dimension `axis` is cut, to a window of 1 (collapsed or not), and every other
// dimension is taken whole (a mapped one then has start 0 only: clamped to it when `clamps`, and
// refused here otherwise, as its fill / drop would need a check). Then each example reads
// (writes) one element per query along `axis`, exactly as the folded form, with no transpose of
// the operand and no linear index: a per-example KV-cache read or write x[B,H,T,D] at t[B]
// (vmap of dynamic_slice / dynamic_update_slice) stays local to the batch's split on any axes.
struct BatchedTake {
  int64_t axis = 0, batch_dims = 0, component = 0;  // component: which index addresses `axis`
  bool keep_axis = false;                           // axis's window of 1 is a dimension of the result
  int64_t queries = 0;                              // the indices' dimensions after the batch, before the vector

  // Where operand dimension d (windowed) and index dimension b (not the vector) lie in the one-axis
  // op's result (updates), with axis's window of 1 kept after X[:axis] when keep_axis.
  int64_t operand_position(int64_t d) const {
    return d <= axis ? d : axis + (keep_axis ? 1 : 0) + queries + (d - axis - 1);
  }
  int64_t index_position(int64_t b) const { return b < batch_dims ? b : axis + (keep_axis ? 1 : 0) + (b - batch_dims); }
};

std::optional<BatchedTake> batched_take(const Shape& xs, const Shape& is, const Dims& window, const Dims& mapped,
                                        const Dims& collapsed, const Dims& batching, const Dims& indices_batching,
                                        bool clamps) {
  const int64_t n = static_cast<int64_t>(batching.size()), rank = static_cast<int64_t>(xs.size());
  if (n == 0) return std::nullopt;  // jnp.take's forms keep the folded path
  for (int64_t k = 0; k < n; ++k) {
    if (batching[k] != k || indices_batching[k] != k || window[k] != 1) return std::nullopt;
  }
  BatchedTake t{-1, n, 0, false, static_cast<int64_t>(is.size()) - 1 - n};
  for (size_t k = 0; k < mapped.size(); ++k) {
    const int64_t d = mapped[k];
    if (window[d] == xs[d]) continue;
    if (t.axis >= 0 || window[d] != 1) return std::nullopt;
    t.axis = d;
    t.component = static_cast<int64_t>(k);
  }
  if (t.axis < 0 || (!clamps && mapped.size() != 1)) return std::nullopt;
  // Another collapsed (inserted) dimension of size 1 would be whole, but the one-axis op keeps it.
  for (int64_t d : collapsed) {
    if (d != t.axis) return std::nullopt;
  }
  for (int64_t d = n; d < rank; ++d) {
    if (d != t.axis && window[d] != xs[d]) return std::nullopt;
  }
  t.keep_axis = !contains(collapsed, t.axis);
  return t;
}

// Component k of the indices' index vectors (their last dimension), without that dimension:
// one start per batch position.
Value index_component(const Value& indices, int64_t k) {
  const Shape is = indices.shape();  // Value::shape() returns a copy
  std::vector<int64_t> start(is.size(), 0), limit(is.begin(), is.end());
  start.back() = k;
  limit.back() = k + 1;
  return reshape(slice(indices, start, limit), Shape(is.begin(), is.end() - 1));
}

// The one-axis op's result shape with axis's window of 1 kept (keep_axis), and without it.
Shape kept_shape(const Value& g, const BatchedTake& t) {
  Shape shape = g.shape();
  if (t.keep_axis) shape.insert(shape.begin() + t.axis, 1);
  return shape;
}

// The linear index into the folded dimensions, of shape B + (window of each windowed linear
// dimension), B the indices' batch shape: sum over the linear dimensions of (start + offset) *
// stride. kClip clamps each start to [0, dim - window]; kFillOrDrop (and kOneHot, for a
// scatter) makes the whole slice -1 (out of range for the one-axis op, which then fills or
// drops) when any start is outside, a whole-window dimension's included (outside unless 0).
// (kPromiseInBounds never reaches here: callers pass what
// XLA does with it, JAX's GatherScatterMode docstring: "out-of-bounds gathers will be clamped
// but out-of-bounds scatters will be discarded"; an unchecked start would fold into another
// row's element.)
Value linear_index(const Value& indices, const Shape& operand, const Addressing& a, GatherScatterMode mode) {
  const Shape is = indices.shape();  // Value::shape() returns a copy
  const Shape batch(is.begin(), is.end() - 1);
  const int64_t nb = static_cast<int64_t>(batch.size());
  const Dims wl = a.windowed_linear();
  Shape out = batch;
  for (int64_t d : wl) out.push_back(a.window[d]);
  int64_t folded = 1;
  for (int64_t d : a.linear) folded *= operand[d];
  // Never narrower than the indices: their values are compared before any conversion.
  const DType dt =
      indices.dtype() == DType::kI64 || folded > std::numeric_limits<int32_t>::max() ? DType::kI64 : DType::kI32;
  const Value ind = convert(indices, dt);
  Dims batch_dims(nb);
  std::iota(batch_dims.begin(), batch_dims.end(), 0);
  Value linear = full(out, 0.0, dt);
  std::optional<Value> in_bounds;
  auto start_of = [&](int64_t d) { return index_component(ind, position(a.mapped, d)); };  // shape B
  const Value zero = full(batch, 0.0, dt);
  if (mode != GatherScatterMode::kClip) {
    for (int64_t d : a.whole_mapped) {  // clip clamps these to 0; fill / drop needs exactly 0
      const Value ok = start_of(d) == zero;
      in_bounds = in_bounds ? logical_and(*in_bounds, ok) : ok;
    }
  }
  int64_t stride = 1;
  for (auto it = a.linear.rbegin(); it != a.linear.rend(); ++it) {
    const int64_t d = *it;
    std::optional<Value> start;
    if (contains(a.mapped, d)) {
      Value s = start_of(d);
      const Value last = full(batch, static_cast<double>(operand[d] - a.window[d]), dt);
      if (mode == GatherScatterMode::kClip) {
        s = clamp(zero, s, last);
      } else {
        const Value ok = logical_and(s >= zero, s <= last);
        in_bounds = in_bounds ? logical_and(*in_bounds, ok) : ok;
        s = where(ok, s, zero);  // no overflow in the product below; masked after
      }
      start = s;
    } else if (contains(a.batching, d)) {
      start = iota(dt, batch, a.indices_batching[position(a.batching, d)]);
    }
    std::optional<Value> at;
    if (start) at = broadcast_in_dim(*start, out, batch_dims);
    if (a.windowed(d)) {
      const Value offset = iota(dt, out, nb + position(wl, d));
      at = at ? *at + offset : offset;
    }
    if (at) linear = linear + (stride == 1 ? *at : *at * full(out, static_cast<double>(stride), dt));
    stride *= operand[d];
  }
  if (in_bounds) linear = where(broadcast_in_dim(*in_bounds, out, batch_dims), linear, full(out, -1.0, dt));
  return linear;
}

// The operand cut to its free dimensions' windows, the linear dimensions first and folded
// into one: shape (prod of the linear dimensions) + (the free windows).
Value fold_operand(const Value& x, const Addressing& a) {
  Value y = x;
  std::vector<int64_t> lo(x.rank(), 0), hi = x.shape();
  for (int64_t d : a.free) hi[d] = a.window[d];
  if (hi != x.shape()) y = slice(y, lo, hi);
  Dims perm = a.linear;
  perm.insert(perm.end(), a.free.begin(), a.free.end());
  Dims identity(x.rank());
  std::iota(identity.begin(), identity.end(), 0);
  if (perm != identity) y = transpose(y, perm);
  Shape folded = {1};
  for (int64_t d : a.linear) folded[0] *= x.shape()[d];
  for (int64_t d : a.free) folded.push_back(a.window[d]);
  return reshape(y, folded);
}

// The inverse of fold_operand after a scatter into the folded operand.
Value unfold_operand(const Value& folded, const Value& x, const Addressing& a) {
  Shape unfolded;
  for (int64_t d : a.linear) unfolded.push_back(x.shape()[d]);
  for (int64_t d : a.free) unfolded.push_back(a.window[d]);
  Value y = reshape(folded, unfolded);
  Dims perm = a.linear;
  perm.insert(perm.end(), a.free.begin(), a.free.end());
  Dims inverse(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inverse[perm[i]] = static_cast<int64_t>(i);
  if (!std::is_sorted(perm.begin(), perm.end())) y = transpose(y, inverse);
  if (y.shape() == x.shape()) return y;
  // Free windows shorter than their dimensions: the rest of x is kept as it was.
  std::vector<Value> zeros(x.rank(), full({}, 0.0, DType::kI32));
  return dynamic_update_slice(x, y, zeros);
}

// How a scatter combines an update with what is there.
// kSub (lax.scatter_sub) is kAdd of the negated updates: x - u1 - u2 == x + (-u1) + (-u2) exactly
// in floating point and modulo 2^n for integers, and its VJP is then JAX's
// _scatter_addsub_transpose_rule (the updates' cotangent the negated gather of the result's).
enum class Combine { kSet, kAdd, kSub, kMul, kMin, kMax };

Value combine(Combine c, const Value& a, const Value& b) {
  return c == Combine::kMul ? a * b : c == Combine::kMin ? minimum(a, b) : maximum(a, b);
}

// full(x's shape, value, dtype), laid out as x on Explicit axes: a plain constant is replicated,
// and a scatter of split updates onto it would gather them.
Value full_as(const Value& x, double value, DType dtype) {
  const TraceState* t = TraceState::common({&x});
  if (t != nullptr && t->explicit_mesh.has_value()) {
    return full(x.shape(), value, dtype, type_of(x).spec.partitions_only());
  }
  return full(x.shape(), value, dtype);
}

Value zeros_like(const Value& x) { return full_as(x, 0.0, x.dtype()); }

// x + 0 with the gradient of x: exactly +0 (x - x) where x is finite, and 0 elsewhere.
Value zero_with_gradient(const Value& x) {
  const Value z = zeros_like(x);
  const Value finite = where((x - x) == z, x, z);
  return finite - stop_gradient(finite);
}

// scatter_mul / min / max on the folded operand f (n, free...) with linear indices idx (B..., W...)
// (-1: dropped) and updates u (B..., W..., free...). The updates, sorted by index, are combined
// within each run of equal indices by a segmented inclusive scan (Hillis-Steele: at step s an
// element takes in the one s before it when their indices agree, which in sorted order means the
// whole stretch between them agrees); the last of each run holds the run's total and is the one
// scattered (the others get index -1). scatter_mul multiplies f by the totals scattered onto
// ones; min / max scatter them onto f itself, so untouched elements combine with themselves.
Value combine_scatter(Combine c, const Value& f, const Value& idx, const Value& u) {
  if (!f.ok() || !idx.ok() || !u.ok()) return Value();  // a refused fold: its error is recorded
  const int64_t k = num_elements(idx.shape());
  const Shape fs = f.shape();
  Shape flat = {k};
  flat.insert(flat.end(), fs.begin() + 1, fs.end());
  Value keys = reshape(idx, {k});
  const Value order = argsort(keys);
  keys = gather(keys, order, 0, IndexMode::kClip);
  Value vals = gather(reshape(u, flat), order, 0, IndexMode::kClip);
  Dims row_dims = {0};
  auto shifted_slice = [&](const Value& v, int64_t lo, int64_t hi) {
    std::vector<int64_t> start(v.rank(), 0), limit = v.shape();
    start[0] = lo;
    limit[0] = hi;
    return slice(v, start, limit);
  };
  for (int64_t s = 1; s < k; s *= 2) {
    const Value same =
        concatenate({full({s}, 0.0, DType::kBool), shifted_slice(keys, s, k) == shifted_slice(keys, 0, k - s)}, 0);
    const Value prev = concatenate({shifted_slice(vals, 0, s), shifted_slice(vals, 0, k - s)}, 0);
    vals = where(broadcast_in_dim(same, flat, row_dims), combine(c, vals, prev), vals);
  }
  const Value yes = full({1}, 1.0, DType::kBool);  // the last element ends its run
  const Value last = k == 1 ? yes : concatenate({shifted_slice(keys, 0, k - 1) != shifted_slice(keys, 1, k), yes}, 0);
  const Value target = where(last, keys, full({k}, -1.0, keys.dtype()));
  if (c == Combine::kMul) return f * scatter(full_as(f, 1.0, f.dtype()), target, vals, 0, IndexMode::kFillOrDrop);
  const Value m = combine(c, f, scatter(f, target, vals, 0, IndexMode::kFillOrDrop));
  if (!is_floating(f.dtype())) return m;
  // The gradient of _scatter_extremal_jvp (jax/_src/lax/slicing.py): every element equal to the
  // result (the operand's and the updates') gets an equal share of its cotangent. The value is
  // m's exactly (m - (+0)); the gradient flows through the zeros that stand for the contenders.
  const Value result = stop_gradient(m);
  const Value u_flat = reshape(u, flat);
  const Value raw_keys = reshape(idx, {k});
  const Value at_update = gather(result, raw_keys, 0, IndexMode::kFillOrDrop);  // NaN where dropped
  const Value f_won = f == result, u_won = u_flat == at_update;
  const Value zeros_f = zeros_like(f), zeros_u = zeros_like(u_flat);
  const Value count =
      convert(f_won, f.dtype()) + scatter_add(zeros_f, raw_keys, convert(u_won, f.dtype()), 0, IndexMode::kFillOrDrop);
  const Value share =
      where(f_won, zero_with_gradient(f), zeros_f) +
      scatter_add(zeros_f, raw_keys, where(u_won, zero_with_gradient(u_flat), zeros_u), 0, IndexMode::kFillOrDrop);
  const Value ones = full_as(f, 1.0, f.dtype());
  return result - (stop_gradient(share) - share) / where(count > zeros_f, count, ones);
}

std::optional<Value> scatter_by_batch_blocks(TraceState* t, const char* name, Combine combine_op, const Value& x,
                                             const Value& indices, const Value& updates,
                                             const ScatterDimensionNumbers& dn, const Dims& scatter_dims,
                                             GatherScatterMode mode, std::string* error, bool build);

// by_blocks: whether a scatter whose batching dimensions are split on Explicit axes runs block by
// block (false inside a block). check_only: validate the operands and their layout, build nothing
// and return x (scatter_apply's check on the operand's own type).
Value scatter_general(const char* name, Combine combine_op, const Value& x, const Value& indices, const Value& updates,
                      const ScatterDimensionNumbers& dn, GatherScatterMode mode, bool by_blocks = true,
                      bool check_only = false) {
  TraceState* t = TraceState::common({&x, &indices, &updates});
  if (t == nullptr) return Value();
  auto invalid = [&](const std::string& message) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(name, ": ", message)));
  };
  if (std::string e = check_indices(name, indices); !e.empty()) return t->fail(absl::InvalidArgumentError(e));
  if (combine_op >= Combine::kAdd && combine_op <= Combine::kMul && x.dtype() == DType::kBool) {
    // JAX's scatter_add / sub / mul trace lax.add / sub / mul, which take numbers only (_num).
    const char* op = combine_op == Combine::kAdd ? "add" : combine_op == Combine::kSub ? "sub" : "mul";
    return invalid(absl::StrCat(op, " does not accept dtype bool; the operand needs a numeric dtype"));
  }
  if (updates.dtype() != x.dtype()) {
    return invalid(absl::StrCat("the updates are ", dtype_name(updates.dtype()), "; they need the operand's dtype ",
                                dtype_name(x.dtype())));
  }
  if (combine_op >= Combine::kMin && x.dtype() == DType::kBool) {
    // JAX takes bool here (lax.min / max take any dtype) and XLA combines PRED with minimum and
    // maximum: and, or. On 0 / 1 in int32 those are min and max, so the int32 scatter's result,
    // != 0, is the bool one.
    const Value r = scatter_general(name, combine_op, convert(x, DType::kI32), indices, convert(updates, DType::kI32),
                                    dn, mode, by_blocks);
    return r.ok() ? r != 0 : Value();
  }
  const Shape& xs = x.shape();
  const Shape& is = indices.shape();
  const Shape& us = updates.shape();
  const int64_t rank = x.rank(), ni = indices.rank(), nu = updates.rank();
  const int64_t expected_rank = ni - 1 + static_cast<int64_t>(dn.update_window_dims.size());
  if (nu != expected_rank) return invalid(absl::StrCat("Updates tensor must be of rank ", expected_rank, "; got ", nu));
  DimsChecker c{"scatter", "Scatter", ""};
  c.sorted(dn.update_window_dims, "update_window_dims");
  c.unique(dn.update_window_dims, "update_window_dims");
  c.in_range(dn.update_window_dims, nu, "update_window_dims");
  c.sorted(dn.inserted_window_dims, "inserted_window_dims");
  c.unique(dn.inserted_window_dims, "inserted_window_dims");
  c.in_range(dn.inserted_window_dims, rank, "inserted_window_dims");
  c.operand_batching(dn.operand_batching_dims, rank);
  c.disjoint(dn.inserted_window_dims, dn.operand_batching_dims, "inserted_window_dims", "operand_batching_dims");
  c.disjoint(dn.scatter_dims_to_operand_dims, dn.operand_batching_dims, "scatter_dims_to_operand_dims",
             "operand_batching_dims");
  c.indices_batching(dn.operand_batching_dims, dn.scatter_indices_batching_dims, xs, is,
                     "scatter_indices_batching_dims");
  if (c.failed()) return invalid(c.error);
  const int64_t window_rank = static_cast<int64_t>(dn.update_window_dims.size() + dn.inserted_window_dims.size() +
                                                   dn.operand_batching_dims.size());
  if (window_rank != rank) {
    return invalid(
        absl::StrCat("Scatter op has window of size ", window_rank, "; doesn't match operand of rank ", rank, "."));
  }
  if (static_cast<int64_t>(dn.scatter_dims_to_operand_dims.size()) != is.back()) {
    return invalid(
        absl::StrCat("Scatter op has ", dn.scatter_dims_to_operand_dims.size(),
                     " elements in scatter_dims_to_operand_dims and the bound of dimension index_vector_dim=", ni - 1,
                     " of indices is ", is.back(), ". These two numbers must be equal"));
  }
  for (size_t k = 0; k < dn.scatter_dims_to_operand_dims.size(); ++k) {
    const int64_t d = dn.scatter_dims_to_operand_dims[k];
    if (d < 0 || d >= rank) {
      return invalid(absl::StrCat("Invalid scatter_dims_to_operand_dims mapping; domain is [0, ", rank, "), got: ", k,
                                  "->", d, "."));
    }
  }
  c.unique(dn.scatter_dims_to_operand_dims, "scatter_dims_to_operand_dims");
  if (c.failed()) return invalid(c.error);
  // Window sizes: the updates' along update_window_dims, for the operand's dimensions that are
  // neither inserted nor batching, in order; 1 for those.
  Dims window(rank, 1);
  size_t pos = 0;
  for (int64_t d = 0; d < rank; ++d) {
    if (contains(dn.inserted_window_dims, d) || contains(dn.operand_batching_dims, d)) continue;
    const int64_t ud = dn.update_window_dims[pos++];
    if (us[ud] > xs[d]) {
      return invalid(absl::StrCat(
          "Bounds of the window dimensions of updates must not exceed the bounds of the corresponding dimensions of "
          "operand. For dimension ",
          ud, ", updates bound is ", us[ud], ", operand bound is ", xs[d], "."));
    }
    window[d] = us[ud];
  }
  Dims scatter_dims;  // the updates' dimensions that are not window dimensions: the indices' batch dimensions
  for (int64_t d = 0; d < nu; ++d)
    if (!contains(dn.update_window_dims, d)) scatter_dims.push_back(d);
  for (size_t i = 0; i < scatter_dims.size(); ++i) {
    if (us[scatter_dims[i]] != is[i]) {
      return invalid(absl::StrCat(
          "Bounds of the scatter dimensions of updates must be the same as the bounds of the corresponding dimensions "
          "of scatter indices. For scatter dimension ",
          scatter_dims[i], ", updates bound is ", us[scatter_dims[i]], ", indices bound is ", is[i], "."));
    }
  }
  if (num_elements(us) == 0) return x;
  if (by_blocks) {
    std::string error;
    std::optional<Value> blocks =
        scatter_by_batch_blocks(t, name, combine_op, x, indices, updates, dn, scatter_dims, mode, &error, !check_only);
    if (!error.empty()) return invalid(error);
    if (blocks.has_value()) return *blocks;
  }
  if (check_only) return x;
  // Promised in bounds drops as XLA; ONE_HOT drops too.
  const bool clamps = mode == GatherScatterMode::kClip;
  std::optional<BatchedTake> bt =
      combine_op <= Combine::kSub
          ? batched_take(xs, is, window, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims,
                         dn.operand_batching_dims, dn.scatter_indices_batching_dims, clamps)
          : std::nullopt;
  if (bt.has_value()) {
    // The updates in the one-axis op's order (axis's window of 1 kept, then dropped).
    Dims order(nu);
    for (int64_t b = 0; b < ni - 1; ++b) order[bt->index_position(b)] = scatter_dims[b];
    for (int64_t d = 0, k = 0; d < rank; ++d) {
      if (contains(dn.inserted_window_dims, d) || contains(dn.operand_batching_dims, d)) continue;
      order[bt->operand_position(d)] = dn.update_window_dims[k++];
    }
    Dims identity(nu);
    std::iota(identity.begin(), identity.end(), 0);
    Value u = order == identity ? updates : transpose(updates, order);
    if (bt->keep_axis) u = squeeze(u, {bt->axis});
    if (combine_op == Combine::kSub) u = -u;
    const Value idx = index_component(indices, bt->component);
    const GatherAttrs attrs{bt->axis, clamps ? IndexMode::kClip : IndexMode::kFillOrDrop, std::nullopt, bt->batch_dims};
    return combine_op == Combine::kSet ? scatter(x, idx, u, attrs) : scatter_add(x, idx, u, attrs);
  }
  const Addressing a = make_addressing(x, window, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims,
                                       dn.operand_batching_dims, dn.scatter_indices_batching_dims);
  // The updates in the order of the one-axis op's: batch, windowed linear, free windows.
  const int64_t nb = ni - 1;
  Dims perm(nu);
  for (int64_t i = 0; i < nb; ++i) perm[i] = scatter_dims[i];
  pos = 0;
  for (int64_t d = 0; d < rank; ++d) {
    if (!a.windowed(d)) continue;
    perm[a.window_position(d, nb)] = dn.update_window_dims[pos++];
  }
  Dims identity(nu);
  std::iota(identity.begin(), identity.end(), 0);
  const Value u = perm == identity ? updates : transpose(updates, perm);
  const Value folded = fold_operand(x, a);
  const Value idx = linear_index(
      indices, xs, a,
      mode == GatherScatterMode::kPromiseInBounds ? GatherScatterMode(GatherScatterMode::kFillOrDrop) : mode);
  if (!folded.ok() || !idx.ok() || !u.ok()) return Value();  // refused (e.g. a fold of a split dim)
  Value r;
  switch (combine_op) {
    case Combine::kSet:
      r = scatter(folded, idx, u, 0, IndexMode::kFillOrDrop);
      break;
    case Combine::kAdd:
    case Combine::kSub:
      r = scatter_add(folded, idx, combine_op == Combine::kSub ? -u : u, 0, IndexMode::kFillOrDrop);
      break;
    default:
      r = combine_scatter(combine_op, folded, idx, u);
  }
  return unfold_operand(r, x, a);
}

// jnp.take_along_axis(mode="one_hot") (jax/_src/numpy/indexing.py): one_hot(indices, n) contracted
// with x along `axis`, the other dimensions batch (x and indices already broadcast alike). An
// index outside [0, n) has no hot entry and gives 0; a bool x goes through int32.
Value one_hot_take(const Value& x, const Value& indices, int64_t axis) {
  const int64_t rank = x.rank(), n = x.shape()[axis];
  Shape hot_shape = indices.shape();
  hot_shape.push_back(n);
  Dims leading(rank);
  std::iota(leading.begin(), leading.end(), 0);
  const DType dt = x.dtype() == DType::kBool ? DType::kI32 : x.dtype();
  const Value hot =
      convert(broadcast_in_dim(indices, hot_shape, leading) == iota(indices.dtype(), hot_shape, rank), dt);
  DotDims dims;
  for (int64_t d = 0; d < rank; ++d) {
    if (d == axis) continue;
    dims.lhs_batch.push_back(d);
    dims.rhs_batch.push_back(d);
  }
  dims.lhs_contracting = {rank};
  dims.rhs_contracting = {axis};
  // The result is (the other dimensions..., indices' `axis`): move that one back into place.
  const Value r = dot_general(hot, convert(x, dt), dims);
  Dims perm(rank);
  for (int64_t o = 0; o < rank; ++o) perm[o] = o < axis ? o : o == axis ? rank - 1 : o - 1;
  const Value y = axis == rank - 1 ? r : transpose(r, perm);
  return x.dtype() == DType::kBool ? y != full(y.shape(), 0.0, dt) : y;
}

Axes spec_entry(const PartitionSpec& spec, int64_t d) { return d < spec.size() ? spec.axes(d) : Axes{}; }

Value gather_impl(const Value& x, const Value& indices, const GatherDimensionNumbers& dn,
                  std::vector<int64_t> slice_sizes, GatherScatterMode mode, std::optional<Scalar> fill_value,
                  bool by_blocks);

// On Explicit axes, a gather whose batching dimensions are split (the operand's or the
// indices', alike or one of them) is one independent gather per block, as JAX's explicit-mode
// rule says (_gather_spec_computation in jax/_src/lax/slicing.py: batching splits resolve into
// the indices', sliced operand dimensions must be whole or replicated, the indices' other
// dimensions replicated; the result's batch dimensions take the indices' resolved splits). It
// runs as a shard_map manual over those axes (the folding reshape inside sees whole blocks), so
// no data moves. nullopt when no batching dimension is split; an error message (JAX's
// _gather_sharding_rule's, naming `.at[...].get(out_sharding=)`) when JAX's rule cannot resolve
// the layout, checked on every Explicit gather (a sliced split dimension, split indices), so a
// refusal is JAX's text, not the folding reshape's, the types after "Got" in Tessera's notation
// (f32[8@b,8]; JAX prints the avals' repr, ShapedArray(float32[8@b,8])). The one-axis gather
// (client/explicit/placement.cc) refuses in the same text.
std::optional<Value> gather_by_batch_blocks(TraceState* t, const Value& x, const Value& indices,
                                            const GatherDimensionNumbers& dn, const Dims& slice_sizes,
                                            GatherScatterMode mode, const std::optional<Scalar>& fill_value,
                                            std::string* error) {
  if (!t->explicit_mesh.has_value()) return std::nullopt;
  const PartitionSpec x_spec = type_of(x).spec, i_spec = type_of(indices).spec;
  const int64_t rank = x.rank(), ni = indices.rank();
  std::vector<Axes> x_dims(rank), i_dims(ni), x_manual(rank), i_manual(ni);
  for (int64_t d = 0; d < rank; ++d) x_dims[d] = spec_entry(x_spec, d);
  for (int64_t d = 0; d < ni; ++d) i_dims[d] = spec_entry(i_spec, d);
  Axes manual;
  for (size_t k = 0; k < dn.operand_batching_dims.size(); ++k) {
    const int64_t od = dn.operand_batching_dims[k], id = dn.start_indices_batching_dims[k];
    if (x_dims[od].empty() && i_dims[id].empty()) continue;
    const Axes resolved = i_dims[id].empty() ? x_dims[od] : i_dims[id];
    x_dims[od] = i_dims[id] = x_manual[od] = i_manual[id] = resolved;
    manual.insert(manual.end(), resolved.begin(), resolved.end());
  }
  bool resolves = true;
  for (size_t k = 0; k < dn.operand_batching_dims.size(); ++k) {
    const Axes a = spec_entry(x_spec, dn.operand_batching_dims[k]),
               b = spec_entry(i_spec, dn.start_indices_batching_dims[k]);
    if (!a.empty() && !b.empty() && a != b) resolves = false;
  }
  for (int64_t d : dn.start_index_map) {
    if (slice_sizes[d] != x.shape()[d] && !x_dims[d].empty()) resolves = false;
  }
  for (int64_t d = 0; d < ni; ++d) {
    if (!contains(dn.start_indices_batching_dims, d) && !i_dims[d].empty()) resolves = false;
  }
  if (!resolves) {
    *error = absl::StrCat(
        "Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing as out sharding "
        "could not be resolved unambiguously (or would require collectives on inputs). Got operand=",
        type_of(x).to_string(), ", indices=", type_of(indices).to_string());
    return std::nullopt;
  }
  if (manual.empty()) return std::nullopt;
  // The result's dimensions: offset ones whole over the manual axes, the batch ones as the indices'.
  const int64_t out_rank = static_cast<int64_t>(dn.offset_dims.size()) + ni - 1;
  std::vector<Axes> out_manual(out_rank);
  for (int64_t o = 0, b = 0; o < out_rank; ++o) {
    if (!contains(dn.offset_dims, o)) out_manual[o] = i_manual[b++];
  }
  const Value xr = PartitionSpec(x_dims) == x_spec.partitions_only() ? x : reshard(x, PartitionSpec(x_dims));
  const Value ir =
      PartitionSpec(i_dims) == i_spec.partitions_only() ? indices : reshard(indices, PartitionSpec(i_dims));
  ShardMapOptions options;
  options.axis_names = manual;
  const ShardMapped blocks = shard_map(
      [dn, slice_sizes, mode, fill_value](const std::vector<Value>& in) {
        return std::vector<Value>{gather_impl(in[0], in[1], dn, slice_sizes, mode, fill_value, false)};
      },
      *t->explicit_mesh, {PartitionSpec(x_manual), PartitionSpec(i_manual)}, {PartitionSpec(out_manual)}, options);
  return blocks({xr, ir})[0];
}

// On Explicit axes, a scatter whose batching dimensions are split (the operand's, the indices'
// or the updates', alike or some of them) is one independent scatter per block, as JAX's
// explicit-mode rule says (_scatter_spec_computation in jax/_src/lax/slicing.py; its test
// tests/pjit_test.py test_scatter_sharding_rule): the batching splits resolve into one, window
// dimensions are split alike in the operand and the updates (full windows) or whole, inserted
// ones whole, the indices' and the updates' other query dimensions and the index vector whole;
// the result is laid out as the operand, its batching dimensions as resolved and its window
// dimensions the updates' split where the operand has none. It runs as a shard_map manual over
// the batching axes, so no data moves. nullopt when no batching dimension is split; JAX's
// error message (_scatter_sharding_rule's text, the types in Tessera's notation as the gather's)
// when its rule cannot resolve the layout, checked on every Explicit scatter, so a refusal is
// JAX's, not the folding reshape's. build false: the check alone (nullopt or the error).
// The one-axis scatters (client/explicit/placement.cc) refuse in the same text.
std::optional<Value> scatter_by_batch_blocks(TraceState* t, const char* name, Combine combine_op, const Value& x,
                                             const Value& indices, const Value& updates,
                                             const ScatterDimensionNumbers& dn, const Dims& scatter_dims,
                                             GatherScatterMode mode, std::string* error, bool build) {
  if (!t->explicit_mesh.has_value()) return std::nullopt;
  const PartitionSpec x_spec = type_of(x).spec, i_spec = type_of(indices).spec, u_spec = type_of(updates).spec;
  const int64_t rank = x.rank(), ni = indices.rank(), nu = updates.rank();
  std::vector<Axes> x_dims(rank), i_dims(ni), u_dims(nu), x_manual(rank), i_manual(ni), u_manual(nu);
  for (int64_t d = 0; d < rank; ++d) x_dims[d] = spec_entry(x_spec, d);
  for (int64_t d = 0; d < ni; ++d) i_dims[d] = spec_entry(i_spec, d);
  for (int64_t d = 0; d < nu; ++d) u_dims[d] = spec_entry(u_spec, d);
  bool resolves = true;
  Axes manual;
  Dims updates_batching;
  for (size_t k = 0; k < dn.operand_batching_dims.size(); ++k) {
    const int64_t od = dn.operand_batching_dims[k], id = dn.scatter_indices_batching_dims[k], ud = scatter_dims[id];
    updates_batching.push_back(ud);
    Axes resolved;  // _is_resolvable: at most one distinct split among the three
    for (const Axes* s : {&x_dims[od], &i_dims[id], &u_dims[ud]}) {
      if (s->empty()) continue;
      if (!resolved.empty() && resolved != *s) resolves = false;
      resolved = *s;
    }
    if (resolved.empty()) continue;
    x_dims[od] = i_dims[id] = u_dims[ud] = x_manual[od] = i_manual[id] = u_manual[ud] = resolved;
    manual.insert(manual.end(), resolved.begin(), resolved.end());
  }
  for (int64_t d = 0, pos = 0; d < rank; ++d) {
    if (contains(dn.operand_batching_dims, d)) continue;
    if (contains(dn.inserted_window_dims, d)) {
      resolves = resolves && x_dims[d].empty();
      continue;
    }
    const int64_t ud = dn.update_window_dims[pos++];
    const bool full_alike = updates.shape()[ud] == x.shape()[d] && u_dims[ud] == x_dims[d];
    resolves = resolves && (full_alike || (u_dims[ud].empty() && x_dims[d].empty()));
  }
  for (int64_t d = 0; d < nu; ++d) {
    if (!contains(updates_batching, d) && !contains(dn.update_window_dims, d) && !u_dims[d].empty()) resolves = false;
  }
  for (int64_t d = 0; d < ni; ++d) {
    if (!contains(dn.scatter_indices_batching_dims, d) && !i_dims[d].empty()) resolves = false;
  }
  if (!resolves) {
    *error = absl::StrCat(
        "Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec for the scatter update as out "
        "sharding could not be resolved unambiguously (or would require collectives on inputs). Got operand=",
        type_of(x).to_string(), ", indices=", type_of(indices).to_string(), ", updates=", type_of(updates).to_string());
    return std::nullopt;
  }
  if (manual.empty() || !build) return std::nullopt;
  auto laid_out = [](const Value& v, const PartitionSpec& spec, const std::vector<Axes>& dims) {
    return PartitionSpec(dims) == spec.partitions_only() ? v : reshard(v, PartitionSpec(dims));
  };
  ShardMapOptions options;
  options.axis_names = manual;
  const ShardMapped blocks = shard_map(
      [name, combine_op, dn, mode](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_general(name, combine_op, in[0], in[1], in[2], dn, mode, false)};
      },
      *t->explicit_mesh, {PartitionSpec(x_manual), PartitionSpec(i_manual), PartitionSpec(u_manual)},
      {PartitionSpec(x_manual)}, options);
  return blocks({laid_out(x, x_spec, x_dims), laid_out(indices, i_spec, i_dims), laid_out(updates, u_spec, u_dims)})[0];
}

}  // namespace

Value gather(const Value& x, const Value& indices, const GatherDimensionNumbers& dn, std::vector<int64_t> slice_sizes,
             GatherScatterMode mode, std::optional<Scalar> fill_value) {
  return gather_impl(x, indices, dn, std::move(slice_sizes), mode, std::move(fill_value), true);
}

namespace {

Value gather_impl(const Value& x, const Value& indices, const GatherDimensionNumbers& dn,
                  std::vector<int64_t> slice_sizes, GatherScatterMode mode, std::optional<Scalar> fill_value,
                  bool by_blocks) {
  TraceState* t = TraceState::common({&x, &indices});
  if (t == nullptr) return Value();
  auto invalid = [&](const std::string& message) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat("gather: ", message)));
  };
  if (std::string e = check_indices("gather", indices); !e.empty()) return t->fail(absl::InvalidArgumentError(e));
  if (fill_value.has_value() && mode != GatherScatterMode::kFillOrDrop)
    return invalid("a fill value needs the fill mode");
  if (mode == GatherScatterMode::kOneHot) {
    // JAX's _gather_lower (jax/_src/lax/slicing.py) asserts the mode is FILL_OR_DROP, CLIP or
    // PROMISE_IN_BOUNDS; ONE_HOT is jnp.take_along_axis's.
    return invalid(
        "GatherScatterMode::kOneHot is take_along_axis's mode; lax.gather takes kClip, kFillOrDrop or "
        "kPromiseInBounds");
  }
  const Shape& xs = x.shape();
  const Shape& is = indices.shape();
  const int64_t rank = x.rank(), ni = indices.rank();
  const int64_t out_rank = static_cast<int64_t>(dn.offset_dims.size()) + ni - 1;
  // The order of _gather_shape_rule's checks, with its messages.
  DimsChecker c{"gather", "Gather", ""};
  c.sorted(dn.offset_dims, "offset_dims");
  c.unique(dn.offset_dims, "offset_dims");
  if (c.failed()) return invalid(c.error);
  for (size_t i = 0; i < dn.offset_dims.size(); ++i) {
    if (dn.offset_dims[i] < 0 || dn.offset_dims[i] >= out_rank) {
      return invalid(absl::StrCat("Offset dimension ", i, " in gather op is out of bounds; got ", dn.offset_dims[i],
                                  ", but should have been in [0, ", out_rank, ")"));
    }
  }
  if (static_cast<int64_t>(dn.start_index_map.size()) != is.back()) {
    return invalid(absl::StrCat("Gather op has ", dn.start_index_map.size(),
                                " elements in start_index_map and the bound of dimension index_vector_dim=", ni - 1,
                                " of indices is ", is.back(), ". These two numbers must be equal."));
  }
  for (size_t k = 0; k < dn.start_index_map.size(); ++k) {
    const int64_t d = dn.start_index_map[k];
    if (d < 0 || d >= rank) {
      return invalid(absl::StrCat("Invalid start_index_map; domain is [0, ", rank, "), got: ", k, "->", d, "."));
    }
  }
  c.unique(dn.start_index_map, "start_index_map");
  c.sorted(dn.collapsed_slice_dims, "collapsed_slice_dims");
  c.in_range(dn.collapsed_slice_dims, rank, "collapsed_slice_dims");
  c.unique(dn.collapsed_slice_dims, "collapsed_slice_dims");
  c.operand_batching(dn.operand_batching_dims, rank);
  c.disjoint(dn.collapsed_slice_dims, dn.operand_batching_dims, "collapsed_slice_dims", "operand_batching_dims");
  c.disjoint(dn.start_index_map, dn.operand_batching_dims, "start_index_map", "operand_batching_dims");
  c.indices_batching(dn.operand_batching_dims, dn.start_indices_batching_dims, xs, is, "start_indices_batching_dims");
  if (c.failed()) return invalid(c.error);
  if (static_cast<int64_t>(slice_sizes.size()) != rank) {
    return invalid(
        absl::StrCat("Gather op must have one slice size for every input dimension; got: "
                     "len(slice_sizes)=",
                     slice_sizes.size(), ", input_shape.rank=", rank));
  }
  if (slice_sizes.size() != dn.offset_dims.size() + dn.collapsed_slice_dims.size() + dn.operand_batching_dims.size()) {
    return invalid(absl::StrCat(
        "All components of the offset index in a gather op must either be a offset dimension or explicitly "
        "collapsed/batching; got len(slice_sizes)=",
        slice_sizes.size(), ", output_slice_sizes=", dims_str(dn.offset_dims), ", collapsed_slice_dims=",
        dims_str(dn.collapsed_slice_dims), ", operand_batching_dims=", dims_str(dn.operand_batching_dims), "."));
  }
  // _gather_shape_rule skips this check for empty indices; XLA's gather shape inference (whose
  // text JAX's is) does not, so indices of shape (B, 0) with B > 0, which take one slice per
  // batch position at start 0, are checked. Only when no slice is taken (a batch dimension of 0)
  // may a slice size exceed its dimension.
  const bool no_slices = num_elements(Shape(is.begin(), is.end() - 1)) == 0;
  for (int64_t d = 0; d < rank; ++d) {
    if (!no_slices && (slice_sizes[d] < 0 || slice_sizes[d] > xs[d])) {
      return invalid(absl::StrCat("Slice size at index ", d, " in gather op is out of range, must be within [0, ",
                                  xs[d], " + 1), got ", slice_sizes[d], "."));
    }
  }
  for (size_t i = 0; i < dn.collapsed_slice_dims.size(); ++i) {
    const int64_t bound = slice_sizes[dn.collapsed_slice_dims[i]];
    if (bound != 1) {
      return invalid(absl::StrCat("Gather op can only collapse slice dims with bound 1, but bound is ", bound,
                                  " for index ", dn.collapsed_slice_dims[i], " at position ", i, "."));
    }
  }
  for (size_t i = 0; i < dn.operand_batching_dims.size(); ++i) {
    const int64_t bound = slice_sizes[dn.operand_batching_dims[i]];
    if (bound > 1) {
      return invalid(absl::StrCat("Gather op can only have operand batching dims with bound 0/1, but bound is ", bound,
                                  " for index ", dn.operand_batching_dims[i], " at position ", i, "."));
    }
  }
  // _gather_shape_computation: offset dims take the slice sizes of the operand's dimensions
  // that are neither collapsed nor batching, in order; the others the indices' batch dims.
  const Addressing a = make_addressing(x, slice_sizes, dn.start_index_map, dn.collapsed_slice_dims,
                                       dn.operand_batching_dims, dn.start_indices_batching_dims);
  Dims offset_operand_dims;
  for (int64_t d = 0; d < rank; ++d)
    if (a.windowed(d)) offset_operand_dims.push_back(d);
  Shape out(out_rank);
  Dims perm(out_rank);  // result dimension -> dimension of the one-axis gather's result
  const int64_t nb = ni - 1;
  for (int64_t o = 0, b = 0, k = 0; o < out_rank; ++o) {
    if (contains(dn.offset_dims, o)) {
      const int64_t d = offset_operand_dims[k++];
      out[o] = slice_sizes[d];
      perm[o] = a.window_position(d, nb);
    } else {
      out[o] = is[b];
      perm[o] = b++;
    }
  }
  if (num_elements(out) == 0) return full(out, 0.0, x.dtype());
  if (by_blocks) {
    std::string error;
    std::optional<Value> blocks = gather_by_batch_blocks(t, x, indices, dn, slice_sizes, mode, fill_value, &error);
    if (!error.empty()) return invalid(error);
    if (blocks.has_value()) return *blocks;
  }
  const bool clamps = mode != GatherScatterMode::kFillOrDrop;  // clip; promised in bounds clamps as XLA
  if (std::optional<BatchedTake> bt = batched_take(xs, is, slice_sizes, dn.start_index_map, dn.collapsed_slice_dims,
                                                   dn.operand_batching_dims, dn.start_indices_batching_dims, clamps)) {
    const Value g =
        gather(x, index_component(indices, bt->component),
               GatherAttrs{bt->axis, clamps ? IndexMode::kClip : IndexMode::kFillOrDrop, fill_value, bt->batch_dims});
    if (!g.ok()) return Value();
    // The result's dimensions: offset ones the windowed operand dimensions in order, the others
    // the indices' in order.
    Dims taken(out_rank);
    for (int64_t o = 0, b = 0, k = 0; o < out_rank; ++o) {
      taken[o] = contains(dn.offset_dims, o) ? bt->operand_position(offset_operand_dims[k++]) : bt->index_position(b++);
    }
    const Value kept = bt->keep_axis ? reshape(g, kept_shape(g, *bt)) : g;
    Dims identity(out_rank);
    std::iota(identity.begin(), identity.end(), 0);
    return taken == identity ? kept : transpose(kept, taken);
  }
  const Value folded = fold_operand(x, a);
  // Promised in bounds: clamped as XLA does (see linear_index).
  const Value idx = linear_index(
      indices, xs, a, mode == GatherScatterMode::kPromiseInBounds ? GatherScatterMode(GatherScatterMode::kClip) : mode);
  const Value g =
      gather(folded, idx, 0,
             mode == GatherScatterMode::kClip || mode == GatherScatterMode::kPromiseInBounds ? IndexMode::kClip
                                                                                             : IndexMode::kFillOrDrop,
             std::move(fill_value));
  Dims identity(out_rank);
  std::iota(identity.begin(), identity.end(), 0);
  return perm == identity ? g : transpose(g, perm);
}

}  // namespace

Value scatter_add(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
                  GatherScatterMode mode) {
  return scatter_general("scatter_add", Combine::kAdd, x, indices, updates, dn, mode);
}

Value scatter(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
              GatherScatterMode mode) {
  return scatter_general("scatter", Combine::kSet, x, indices, updates, dn, mode);
}

Value scatter_mul(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
                  GatherScatterMode mode) {
  return scatter_general("scatter_mul", Combine::kMul, x, indices, updates, dn, mode);
}

Value scatter_min(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
                  GatherScatterMode mode) {
  return scatter_general("scatter_min", Combine::kMin, x, indices, updates, dn, mode);
}

Value scatter_max(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
                  GatherScatterMode mode) {
  return scatter_general("scatter_max", Combine::kMax, x, indices, updates, dn, mode);
}

Value scatter_sub(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
                  GatherScatterMode mode) {
  return scatter_general("scatter_sub", Combine::kSub, x, indices, updates, dn, mode);
}

// As XLA's scatter with `func` as the update computation (JAX's scatter_apply): each window
// applies func once to each element it covers. So an element is func applied `count` times, count
// the windows landing on it, which a scatter_add of ones counts with the mode's out-of-range
// rule. One application to the whole operand serves every element hit; the r = max(count) - 1
// further steps (step s applies func where count > s) run as r's binary digits: chunks of 2^j
// steps from the largest j down, each a fori_loop of static length under a cond taken when at
// least 2^j steps remain. So exactly r steps run (none when no element is hit twice), the plan
// holds log2(windows) loops, and grad and vmap go through fori_loop and cond (a while_loop to r
// would have no gradient).
Value scatter_apply(const Value& x, const Value& indices, const std::function<Value(const Value&)>& func,
                    const ScatterDimensionNumbers& dn, Shape update_shape, GatherScatterMode mode) {
  TraceState* t = TraceState::common({&x, &indices});
  if (t == nullptr) return Value();
  // The layout is checked first on x's own type, with the updates' placeholder of x's dtype, as JAX
  // binds scatter_p (lax.scatter_apply: operand, indices, lax.full(update_shape, 0, operand.dtype)),
  // so a refusal names x and scatter_apply, not the int32 counts below.
  if (!scatter_general("scatter_apply", Combine::kSet, x, indices, full(update_shape, 0.0, x.dtype()), dn, mode, true,
                       true)
           .ok()) {
    return Value();
  }
  // The counts laid out as the operand; the updates' placeholder replicated, as JAX's
  // lax.full(update_shape, 0) is.
  const Value count = scatter_general("scatter_apply", Combine::kAdd, full_as(x, 0.0, DType::kI32), indices,
                                      full(update_shape, 1.0, DType::kI32), dn, mode);
  if (!count.ok()) return Value();
  const Value fx = func(x);
  if (!fx.ok()) return Value();
  if (fx.shape() != x.shape() || fx.dtype() != x.dtype()) {
    return t->fail(absl::InvalidArgumentError(
        absl::StrCat("scatter_apply: func must map each element to one of the operand's dtype ", dtype_name(x.dtype()),
                     " (elementwise); it gave ", dtype_name(fx.dtype()), dims_str(fx.shape()), " for ",
                     dtype_name(x.dtype()), dims_str(x.shape()))));
  }
  const Value once = where(count > 0, fx, x);
  const Shape& is = indices.shape();
  const int64_t windows = num_elements(Shape(is.begin(), is.end() - 1));
  if (windows <= 1) return once;
  const Value steps = max(count) - 1;  // r, at most windows - 1
  int64_t chunk = 1;
  while (chunk * 2 <= windows - 1) chunk *= 2;
  std::vector<Value> carry = {once, full({}, 0.0, DType::kI32)};  // the operand, the steps done
  // A failed step leaves an invalid carry (cond of a failed branch); stop there, the failure recorded.
  for (; chunk >= 1 && carry.size() == 2 && carry[0].ok(); chunk /= 2) {
    const Branch run = [&](const std::vector<Value>& y) {
      const Value done = y[1];
      std::vector<Value> r = fori_loop(0, chunk,
                                       [&](const Value& i, const std::vector<Value>& c) {
                                         return std::vector<Value>{where(count > done + i + 1, func(c[0]), c[0])};
                                       },
                                       {y[0]});
      if (r.empty()) return r;
      return std::vector<Value>{r[0], done + static_cast<int32_t>(chunk)};
    };
    const Branch skip = [](const std::vector<Value>& y) { return y; };
    carry = cond(steps - carry[1] >= static_cast<int32_t>(chunk), run, skip, carry);
  }
  return carry.size() == 2 ? carry[0] : Value();
}

Value take_along_axis(const Value& x, const Value& indices, int64_t axis, GatherScatterMode mode,
                      std::optional<Scalar> fill_value) {
  TraceState* t = TraceState::common({&x, &indices});
  if (t == nullptr) return Value();
  const int64_t rank = x.rank();
  const int64_t ax = internal::normalize_axis(axis, rank);
  auto invalid = [&](const std::string& message) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat("take_along_axis: ", message)));
  };
  if (ax < 0 || ax >= rank) {
    return invalid(absl::StrCat("axis ", axis, " is out of range for shape ", shape_to_string(x.shape())));
  }
  if (std::string e = check_indices("take_along_axis", indices); !e.empty()) {
    return t->fail(absl::InvalidArgumentError(e));
  }
  if (indices.rank() != rank) {
    return invalid(absl::StrCat("indices ", shape_to_string(indices.shape()), " and x ", shape_to_string(x.shape()),
                                " need the same rank"));
  }
  // numpy broadcasting in every dimension but `axis`.
  Shape xs = x.shape(), is = indices.shape();
  for (int64_t d = 0; d < rank; ++d) {
    if (d == ax || xs[d] == is[d]) continue;
    if (xs[d] != 1 && is[d] != 1) {
      return invalid(absl::StrCat("dimension ", d, " of indices ", shape_to_string(indices.shape()), " and of x ",
                                  shape_to_string(x.shape()), " do not broadcast"));
    }
    xs[d] = is[d] = std::max(xs[d], is[d]);
  }
  Dims all(rank);
  std::iota(all.begin(), all.end(), 0);
  const Value xb = xs == x.shape() ? x : broadcast_in_dim(x, xs, all);
  Value ib = is == indices.shape() ? indices : broadcast_in_dim(indices, is, all);
  const int64_t n = xs[ax];
  // Negatives wrap except with kPromiseInBounds (jnp.take_along_axis: wrap_negative_indices
  // defaults to mode != "promise_in_bounds").
  if (mode != GatherScatterMode::kPromiseInBounds) {
    ib = where(ib < 0, ib + full(is, static_cast<double>(n), ib.dtype()), ib);
  }
  if (mode == GatherScatterMode::kOneHot) {
    if (fill_value.has_value()) return invalid("a fill value needs the fill mode");
    return one_hot_take(xb, ib, ax);
  }
  Shape vec = is;
  vec.push_back(1);
  GatherDimensionNumbers dn;
  dn.collapsed_slice_dims = {ax};
  dn.start_index_map = {ax};
  for (int64_t d = 0; d < rank; ++d) {
    if (d == ax) continue;
    dn.operand_batching_dims.push_back(d);
    dn.start_indices_batching_dims.push_back(d);
  }
  return gather(xb, reshape(ib, vec), dn, Dims(rank, 1), mode, std::move(fill_value));
}

// IndexRef's other forms are in client/trace.cc; these take the path of its get(out_sharding).
Value IndexRef::set(const Value& updates, const PartitionSpec& out_sharding) const {
  return internal::auto_out_sharding(".set", x_, out_sharding, [&] { return set(updates); });
}
Value IndexRef::add(const Value& updates, const PartitionSpec& out_sharding) const {
  return internal::auto_out_sharding(".add", x_, out_sharding, [&] { return add(updates); });
}

}  // namespace tessera

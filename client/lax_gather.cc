// lax.gather / lax.scatter_add / lax.scatter with dimension numbers, and jnp.take_along_axis
// (trace.h). Each is a composite over the one-axis gather / scatter ops: the operand's
// dimensions that the indices address (start_index_map / scatter_dims_to_operand_dims, the
// batching and the collapsed / inserted ones) are moved to the front and folded into one, the
// index vectors become one linear index into it (clamped, or masked to -1 so the one-axis op
// fills or drops), and the other dimensions, taken from 0 with their slice size, ride along
// whole. So the kernels, sharding rules, VJPs and vmap are those of gather, scatter(_add),
// transpose, reshape and slice.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/trace_state.h"
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

Addressing make_addressing(int64_t rank, Dims window, Dims mapped, Dims collapsed, Dims batching,
                           Dims indices_batching) {
  Addressing a{{},
               {},
               std::move(window),
               std::move(mapped),
               std::move(batching),
               std::move(indices_batching),
               std::move(collapsed)};
  for (int64_t d = 0; d < rank; ++d) {
    const bool linear = contains(a.mapped, d) || contains(a.collapsed, d) || contains(a.batching, d);
    (linear ? a.linear : a.free).push_back(d);
  }
  return a;
}

// The linear index into the folded dimensions, of shape B + (window of each windowed linear
// dimension), B the indices' batch shape: sum over the linear dimensions of (start + offset) *
// stride. kClip clamps each start to [0, dim - window]; kFillOrDrop makes the whole slice -1
// (out of range for the one-axis op, which then fills or drops) when any start is outside.
Value linear_index(const Value& indices, const Shape& operand, const Addressing& a, IndexMode mode) {
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
  int64_t stride = 1;
  for (auto it = a.linear.rbegin(); it != a.linear.rend(); ++it) {
    const int64_t d = *it;
    std::optional<Value> start;
    if (contains(a.mapped, d)) {
      const int64_t k = position(a.mapped, d);
      std::vector<int64_t> lo(nb + 1, 0), hi = indices.shape();
      lo[nb] = k;
      hi[nb] = k + 1;
      Value s = reshape(slice(ind, lo, hi), batch);
      const Value zero = full(batch, 0.0, dt), last = full(batch, static_cast<double>(operand[d] - a.window[d]), dt);
      if (mode == IndexMode::kClip) {
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

Value scatter_general(const char* name, bool add, const Value& x, const Value& indices, const Value& updates,
                      const ScatterDimensionNumbers& dn, IndexMode mode) {
  TraceState* t = TraceState::common({&x, &indices, &updates});
  if (t == nullptr) return Value();
  auto invalid = [&](const std::string& message) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat(name, ": ", message)));
  };
  if (std::string e = check_indices(name, indices); !e.empty()) return t->fail(absl::InvalidArgumentError(e));
  if (updates.dtype() != x.dtype()) {
    return invalid(absl::StrCat("the updates are ", dtype_name(updates.dtype()), "; they need the operand's dtype ",
                                dtype_name(x.dtype())));
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
  const Addressing a = make_addressing(rank, window, dn.scatter_dims_to_operand_dims, dn.inserted_window_dims,
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
  const Value idx = linear_index(indices, xs, a, mode);
  const Value r =
      add ? scatter_add(folded, idx, u, 0, IndexMode::kFillOrDrop) : scatter(folded, idx, u, 0, IndexMode::kFillOrDrop);
  return unfold_operand(r, x, a);
}

}  // namespace

Value gather(const Value& x, const Value& indices, const GatherDimensionNumbers& dn, std::vector<int64_t> slice_sizes,
             IndexMode mode, std::optional<Scalar> fill_value) {
  TraceState* t = TraceState::common({&x, &indices});
  if (t == nullptr) return Value();
  auto invalid = [&](const std::string& message) {
    return t->fail(absl::InvalidArgumentError(absl::StrCat("gather: ", message)));
  };
  if (std::string e = check_indices("gather", indices); !e.empty()) return t->fail(absl::InvalidArgumentError(e));
  if (fill_value.has_value() && mode != IndexMode::kFillOrDrop) return invalid("a fill value needs the fill mode");
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
  const bool no_indices = num_elements(is) == 0;
  for (int64_t d = 0; d < rank; ++d) {
    if (!no_indices && (slice_sizes[d] < 0 || slice_sizes[d] > xs[d])) {
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
  const Addressing a = make_addressing(rank, slice_sizes, dn.start_index_map, dn.collapsed_slice_dims,
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
  const Value folded = fold_operand(x, a);
  const Value idx = linear_index(indices, xs, a, mode);
  const Value g = gather(folded, idx, 0, mode, std::move(fill_value));
  Dims identity(out_rank);
  std::iota(identity.begin(), identity.end(), 0);
  return perm == identity ? g : transpose(g, perm);
}

Value scatter_add(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
                  IndexMode mode) {
  return scatter_general("scatter_add", true, x, indices, updates, dn, mode);
}

Value scatter(const Value& x, const Value& indices, const Value& updates, const ScatterDimensionNumbers& dn,
              IndexMode mode) {
  return scatter_general("scatter", false, x, indices, updates, dn, mode);
}

Value take_along_axis(const Value& x, const Value& indices, int64_t axis, IndexMode mode,
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
  ib = where(ib < 0, ib + full(is, static_cast<double>(n), ib.dtype()), ib);  // negatives wrap
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

}  // namespace tessera

// lax.gather / lax.scatter_add / lax.scatter with dimension numbers and jnp.take_along_axis
// (trace.h, client/lax_gather.cc), jitted on Client::local(8) with sharded operands and
// indices, against host loops written here over XLA's operation semantics of Gather and
// Scatter (the definition jax/_src/lax/slicing.py's docstrings point to), not against the
// composite's own lowering. Cases from JAX's tests/lax_test.py (testGather, testScatterAddSub,
// testGatherShapeCheckingRule) and the docstrings of lax.gather and jnp.take_along_axis. The
// modes are lax.GatherScatterMode's (jax/_src/lax/slicing.py); scatter_mul / min / max are
// checked against the same host loop with their combiner, their gradients in grad_test.cc.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/vmap.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

using jit_support::random_f32;
using ::testing::HasSubstr;
using Dims = std::vector<int64_t>;

bool has(const Dims& d, int64_t v) {
  for (int64_t x : d)
    if (x == v) return true;
  return false;
}
// Row-major multi-index <-> flat index.
Dims unravel(int64_t flat, const Shape& shape) {
  Dims out(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1; d >= 0; --d) {
    out[d] = flat % shape[d];
    flat /= shape[d];
  }
  return out;
}
int64_t ravel(const Dims& index, const Shape& shape) {
  int64_t flat = 0;
  for (size_t d = 0; d < shape.size(); ++d) flat = flat * shape[d] + index[d];
  return flat;
}

// The start of operand dimension d for the batch position `batch` (the indices' index without
// the index vector): XLA's Gather/Scatter semantics, with JAX's modes applied to the mapped
// dimensions (clip: clamped to [0, n - window]; fill/drop: nullopt when any is outside).
std::optional<Dims> starts(const HostArray& idx, const Dims& batch, const Shape& operand, const Dims& window,
                           const Dims& mapped, const Dims& batching, const Dims& indices_batching, IndexMode mode) {
  Dims start(operand.size(), 0);
  const int64_t k_count = idx.shape().back();
  for (int64_t k = 0; k < k_count; ++k) {
    Dims at = batch;
    at.push_back(k);
    const int64_t d = mapped[k];
    int64_t s = static_cast<int64_t>(idx.element_as_double(ravel(at, idx.shape())));
    const int64_t last = operand[d] - window[d];
    if (mode == IndexMode::kClip) {
      s = std::min(std::max<int64_t>(s, 0), last);
    } else if (s < 0 || s > last) {
      return std::nullopt;
    }
    start[d] = s;
  }
  for (size_t k = 0; k < batching.size(); ++k) start[batching[k]] = batch[indices_batching[k]];
  return start;
}

// lax.gather on the host, element by element of the result.
std::vector<double> host_gather(const HostArray& x, const HostArray& idx, const GatherDimensionNumbers& dn,
                                const Dims& slice_sizes, IndexMode mode, double fill, Shape* out_shape) {
  const int64_t rank = static_cast<int64_t>(x.shape().size());
  const int64_t out_rank = static_cast<int64_t>(dn.offset_dims.size() + idx.shape().size()) - 1;
  Dims window_dims;  // operand dims with an output dimension, in order
  for (int64_t d = 0; d < rank; ++d)
    if (!has(dn.collapsed_slice_dims, d) && !has(dn.operand_batching_dims, d)) window_dims.push_back(d);
  Shape out(out_rank);
  for (int64_t o = 0, b = 0, k = 0; o < out_rank; ++o) {
    out[o] = has(dn.offset_dims, o) ? slice_sizes[window_dims[k++]] : idx.shape()[b++];
  }
  *out_shape = out;
  std::vector<double> values(num_elements(out));
  for (int64_t flat = 0; flat < static_cast<int64_t>(values.size()); ++flat) {
    const Dims o = unravel(flat, out);
    Dims batch, offsets;
    for (int64_t i = 0; i < out_rank; ++i) (has(dn.offset_dims, i) ? offsets : batch).push_back(o[i]);
    const std::optional<Dims> start = starts(idx, batch, x.shape(), slice_sizes, dn.start_index_map,
                                             dn.operand_batching_dims, dn.start_indices_batching_dims, mode);
    if (!start) {
      values[flat] = fill;
      continue;
    }
    Dims in = *start;
    for (size_t k = 0; k < window_dims.size(); ++k) in[window_dims[k]] += offsets[k];
    values[flat] = x.element_as_double(ravel(in, x.shape()));
  }
  return values;
}

// lax.scatter_add / scatter / scatter_mul / min / max on the host, update element by update
// element: `combine(old, update)` is what the target becomes.
std::vector<double> host_scatter_with(const HostArray& x, const HostArray& idx, const HostArray& u,
                                      const ScatterDimensionNumbers& dn, IndexMode mode,
                                      const std::function<double(double, double)>& combine) {
  const int64_t rank = static_cast<int64_t>(x.shape().size());
  std::vector<double> out(x.size());
  for (int64_t i = 0; i < x.size(); ++i) out[i] = x.element_as_double(i);
  Dims window(rank, 1), window_dims;
  for (int64_t d = 0, k = 0; d < rank; ++d) {
    if (has(dn.inserted_window_dims, d) || has(dn.operand_batching_dims, d)) continue;
    window[d] = u.shape()[dn.update_window_dims[k++]];
    window_dims.push_back(d);
  }
  for (int64_t flat = 0; flat < u.size(); ++flat) {
    const Dims ui = unravel(flat, u.shape());
    Dims batch, offsets;
    for (size_t i = 0; i < ui.size(); ++i) {
      (has(dn.update_window_dims, static_cast<int64_t>(i)) ? offsets : batch).push_back(ui[i]);
    }
    const std::optional<Dims> start = starts(idx, batch, x.shape(), window, dn.scatter_dims_to_operand_dims,
                                             dn.operand_batching_dims, dn.scatter_indices_batching_dims, mode);
    if (!start) continue;  // the whole window is dropped
    Dims in = *start;
    for (size_t k = 0; k < window_dims.size(); ++k) in[window_dims[k]] += offsets[k];
    double& target = out[ravel(in, x.shape())];
    target = combine(target, u.element_as_double(flat));
  }
  return out;
}

std::vector<double> host_scatter(const HostArray& x, const HostArray& idx, const HostArray& u,
                                 const ScatterDimensionNumbers& dn, IndexMode mode, bool add) {
  return host_scatter_with(x, idx, u, dn, mode, [add](double old, double v) { return add ? old + v : v; });
}

// `idx` with each start of index component k (operand dimension mapped[k], window[d] long)
// moved into [0, operand[d] - window[d]] by a modulus: in bounds, for kPromiseInBounds.
HostArray in_bounds(const HostArray& idx, const Shape& operand, const Dims& window, const Dims& mapped) {
  std::vector<int32_t> v(idx.size());
  const int64_t k_count = idx.shape().back();
  for (int64_t i = 0; i < idx.size(); ++i) {
    const int64_t d = mapped[i % k_count];
    const int64_t span = operand[d] - window[d] + 1;
    v[i] = static_cast<int32_t>(((static_cast<int64_t>(idx.element_as_double(i)) % span) + span) % span);
  }
  return HostArray::from_vector<int32_t>(idx.shape(), v);
}

// Example b of a (float32 or int32) array with a leading batch dimension.
HostArray example(const HostArray& a, int64_t b) {
  const Shape shape(a.shape().begin() + 1, a.shape().end());
  const int64_t n = num_elements(shape);
  if (a.dtype() == DType::kI32) {
    std::vector<int32_t> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = static_cast<int32_t>(a.element_as_double(b * n + i));
    return HostArray::from_vector<int32_t>(shape, v);
  }
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(a.element_as_double(b * n + i));
  return HostArray::from_vector<float>(shape, v);
}

// `got` (float32) equals `want` within `tol` relative; NaN matches NaN.
void expect_values(const HostArray& got, const Shape& shape, const std::vector<double>& want, const std::string& where,
                   double tol = 1e-5) {
  ASSERT_EQ(got.shape(), shape) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.element_as_double(static_cast<int64_t>(i));
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(g)) << where << " element " << i << ": " << g << ", want NaN";
    } else if (std::isinf(want[i])) {
      EXPECT_EQ(g, want[i]) << where << " element " << i;
    } else {
      ASSERT_NEAR(g, want[i], tol * (1 + std::abs(want[i]))) << where << " element " << i;
    }
  }
}

HostArray ints(Shape shape, std::vector<int32_t> v) { return HostArray::from_vector<int32_t>(std::move(shape), v); }

struct GatherCase {
  std::string name;
  Shape x;
  HostArray idx;
  GatherDimensionNumbers dn;
  Dims slice_sizes;
};

// JAX's tests/lax_test.py testGather cases (their shapes, dimension numbers and slice sizes;
// JAX draws random in-range indices, these are fixed, several out of range on purpose), and
// forms of our own: a window that is not trailing, multi-axis indexing.
std::vector<GatherCase> gather_cases() {
  std::vector<GatherCase> out;
  out.push_back({"lax_test_collapse_1d", {8}, ints({2, 1}, {0, 2}), {{}, {0}, {0}}, {1}});
  out.push_back({"lax_test_window_2", {8}, ints({3, 1}, {0, 7, -1}), {{1}, {}, {0}}, {2}});
  out.push_back({"lax_test_rows", {8, 6}, ints({3, 1}, {0, 2, 9}), {{1}, {0}, {0}}, {1, 3}});
  out.push_back({"lax_test_two_index_dims", {8, 6}, ints({2, 2}, {0, 2, 1, 4}), {{1}, {0}, {0, 1}}, {1, 3}});
  out.push_back({"lax_test_batching", {2, 6}, ints({2, 2, 1}, {0, 2, 1, 7}), {{}, {1}, {1}, {0}, {0}}, {1, 1}});
  out.push_back({"lax_test_two_batching_dims",
                 {2, 4, 10},
                 ints({4, 2, 1}, {0, 1, 2, 3, 4, 5, 6, 8}),
                 {{2}, {}, {2}, {0, 1}, {1, 0}},
                 {1, 1, 3}});
  // x[i, j] (jnp's _rewriting_take for two integer arrays: start_index_map (0, 1), both
  // collapsed), the index arrays (2, 3) broadcast to one (2, 3, 2) array of pairs.
  out.push_back(
      {"x_i_j", {8, 6, 4}, ints({2, 3, 2}, {0, 0, 7, 5, 3, 2, 1, 6, 8, 1, 2, 2}), {{2}, {0, 1}, {0, 1}}, {1, 1, 4}});
  // A window of (2, 3) at (i, j) of the middle and last dimensions, dimension 0 taken whole,
  // offset dimensions before and after the batch dimension.
  out.push_back(
      {"windows_around_batch", {4, 8, 6}, ints({4, 2}, {0, 0, 6, 3, 7, 1, 2, -1}), {{0, 2, 3}, {}, {1, 2}}, {4, 2, 3}});
  // A dimension neither indexed nor whole: its slice starts at 0 (XLA) and is cut to 2.
  out.push_back({"unindexed_partial_slice", {8, 6}, ints({4, 1}, {5, 0, 7, 3}), {{1}, {0}, {0}}, {1, 2}});
  // A batching dimension and one element per query along dimension 1 (the one-axis op with
  // batch_dims: lax_gather.cc's batched_take), with the queries' dimension before the window.
  out.push_back({"batched_take_queries",
                 {2, 6, 3},
                 ints({2, 4, 1}, {0, 5, 2, 9, 1, 1, -1, 3}),
                 {{2}, {1}, {1}, {0}, {0}},
                 {1, 1, 3}});
  // The same with another collapsed dimension of size 1, which the one-axis op would keep: it
  // takes the general path (session 38's review found batched_take lowering it wrongly).
  out.push_back({"batched_take_and_a_collapsed_unit_dimension",
                 {2, 1, 5, 3},
                 ints({2, 1}, {3, 7}),
                 {{1}, {1, 2}, {2}, {0}, {0}},
                 {1, 1, 1, 3}});
  return out;
}

class GatherTest : public jit_support::LocalJitSuite {
 protected:
  static Mesh auto_mesh(std::vector<int64_t> shape) {
    absl::StatusOr<Mesh> m = client_->make_mesh(shape, {"a", "b"}, {AxisType::kAuto, AxisType::kAuto});
    EXPECT_TRUE(m.ok()) << m.status();
    return *m;
  }
  // Specs of `shape` on `mesh`: replicated, and each dimension split over each axis that
  // divides it.
  static std::vector<PartitionSpec> layouts(const Shape& shape, const Mesh& mesh) {
    std::vector<PartitionSpec> out = {P()};
    for (size_t d = 0; d < shape.size(); ++d) {
      for (size_t a = 0; a < mesh.axis_names().size(); ++a) {
        if (shape[d] % mesh.shape()[a] != 0) continue;
        std::vector<Axes> entries(shape.size());
        entries[d] = {mesh.axis_names()[a]};
        out.push_back(PartitionSpec(entries));
      }
    }
    return out;
  }
  static absl::StatusOr<HostArray> run1(const TracedFunction& f, const std::vector<Array>& args) {
    absl::StatusOr<std::vector<Array>> r = jit(f)(args);
    if (!r.ok()) return r.status();
    return (*r)[0].fetch();
  }
};

TEST_F(GatherTest, MatchesHostLoopsInBothModesOnEveryLayout) {
  const std::vector<Mesh> meshes = {*auto_mesh_, auto_mesh({2, 2})};
  for (const GatherCase& c : gather_cases()) {
    const HostArray x = random_f32(c.x, 7);
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      Shape want_shape;
      const std::vector<double> want = host_gather(x, c.idx, c.dn, c.slice_sizes, mode, -5.0, &want_shape);
      const TracedFunction f = [&](const std::vector<Value>& in) {
        return std::vector<Value>{
            gather(in[0], in[1], c.dn, c.slice_sizes, mode,
                   mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(Scalar(-5.0)) : std::nullopt)};
      };
      for (const Mesh& mesh : meshes) {
        const std::vector<PartitionSpec> idx_layouts = layouts(c.idx.shape(), mesh);
        size_t i = 0;
        for (const PartitionSpec& xs : layouts(c.x, mesh)) {
          const PartitionSpec& is = idx_layouts[i++ % idx_layouts.size()];
          const std::string where =
              absl::StrCat(c.name, " mode ", static_cast<int>(mode), " mesh ", mesh.shape()[0], "x", mesh.shape()[1],
                           " x ", xs.to_string(), " indices ", is.to_string());
          absl::StatusOr<HostArray> got = run1(f, {put_on(mesh, x, xs), put_on(mesh, c.idx, is)});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          expect_values(*got, want_shape, want, where);
        }
      }
    }
  }
}

// The fill mode's default fill value is JAX's (NaN for floats, the lowest int32 for int32), and
// int64 indices beyond int32's range are out of range, not wrapped.
TEST_F(GatherTest, FillModeDefaultsAndWideIndices) {
  const HostArray x = HostArray::arange(DType::kI32, {5, 3});
  const HostArray idx = HostArray::from_vector<int64_t>({3, 1}, {4, int64_t{1} << 32, -1});
  const GatherDimensionNumbers dn{{1}, {0}, {0}};
  absl::StatusOr<HostArray> got = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], dn, {1, 3}, GatherScatterMode::kFillOrDrop)};
      },
      {put(x, P()), put(idx, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  const int32_t lo = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(*got, HostArray::from_vector<int32_t>({3, 3}, {12, 13, 14, lo, lo, lo, lo, lo, lo}));
  absl::StatusOr<HostArray> nan = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], dn, {1, 3}, GatherScatterMode::kFillOrDrop)};
      },
      {put(random_f32({5, 3}, 1), P()), put(idx, P())});
  ASSERT_TRUE(nan.ok()) << nan.status();
  EXPECT_FALSE(std::isnan(nan->element_as_double(0)));
  for (int64_t i = 3; i < 9; ++i) EXPECT_TRUE(std::isnan(nan->element_as_double(i))) << i;
}

// lax.gather's default mode is PROMISE_IN_BOUNDS (jax/_src/lax/slicing.py, gather: "if mode is
// None: mode = GatherScatterMode.PROMISE_IN_BOUNDS"), unlike the scatters' FILL_OR_DROP
// (GatherScatterMode.from_any(None)); with XLA "out-of-bounds gathers will be clamped"
// (GatherScatterMode's docstring): each start clamped to [0, dim - slice size], as CLIP. So
// x[i, j] with i and j out of range on either side, and a (2, 2) window past the end, give the
// clamped elements, on every layout of a (4, 2) mesh.
TEST_F(GatherTest, DefaultModeIsPromiseInBoundsWhichClampsAsXla) {
  const HostArray x = random_f32({8, 4}, 17);
  const HostArray idx = ints({4, 2}, {11, 1, -3, 2, 7, 9, -1, -8});
  const GatherDimensionNumbers point{{}, {0, 1}, {0, 1}}, window{{1, 2}, {}, {0, 1}};
  Shape ps, ws;
  const std::vector<double> want_point = host_gather(x, idx, point, {1, 1}, IndexMode::kClip, 0, &ps);
  const std::vector<double> want_window = host_gather(x, idx, window, {2, 2}, IndexMode::kClip, 0, &ws);
  Jitted f = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{gather(in[0], in[1], point, {1, 1}), gather(in[0], in[1], window, {2, 2})};
  });
  for (const PartitionSpec& xs : {P(), P("data", None), P(None, "model"), P("data", "model")}) {
    for (const PartitionSpec& is : {P(), P("data", None)}) {
      const std::string where = absl::StrCat("x ", xs.to_string(), " indices ", is.to_string());
      absl::StatusOr<std::vector<Array>> got = f({put_on(*auto_mesh_, x, xs), put_on(*auto_mesh_, idx, is)});
      ASSERT_TRUE(got.ok()) << where << ": " << got.status();
      expect_values(fetch((*got)[0]), ps, want_point, where);
      expect_values(fetch((*got)[1]), ws, want_window, where);
    }
  }
}

// lax.gather's docstring (jax/_src/lax/slicing.py): x = [10, 11, 12], indices [0, 1, 1, 2, 2, 2]
// with a trailing index dimension, offset_dims=(), collapsed_slice_dims=(0,),
// start_index_map=(0,), slice_sizes=(1,) gives [10, 11, 11, 12, 12, 12].
TEST_F(GatherTest, LaxGatherDocstringExample) {
  const HostArray x = HostArray::from_vector<int32_t>({3}, {10, 11, 12});
  const HostArray idx = ints({6, 1}, {0, 1, 1, 2, 2, 2});
  absl::StatusOr<HostArray> got = run1(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], GatherDimensionNumbers{{}, {0}, {0}}, {1}, IndexMode::kClip)};
      },
      {put(x, P()), put(idx, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, HostArray::from_vector<int32_t>({6}, {10, 11, 11, 12, 12, 12}));
}

// jnp.take_along_axis's docstring (jax/_src/numpy/indexing.py): x = [[1, 2, 3], [4, 5, 6]] with
// [[0, 2], [1, 0]] along axis 1 is [[1, 3], [5, 4]]; [[1, 0, 2]] along axis 0 is
// [[4, 2, nan]]; the argsort of [[5, 3, 4], [2, 7, 6]] along axis 1 sorts it.
TEST_F(GatherTest, TakeAlongAxisDocstringExamplesAndHostLoops) {
  const HostArray x = HostArray::from_vector<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  const HostArray i1 = ints({2, 2}, {0, 2, 1, 0}), i0 = ints({1, 3}, {1, 0, 2});
  absl::StatusOr<std::vector<Array>> got = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{take_along_axis(in[0], in[1], 1), take_along_axis(in[0], in[2], 0),
                              take_along_axis(in[3], argsort(in[3], 1), 1)};
  })({put(x, P()), put(i1, P("model", None)), put(i0, P()),
      put(HostArray::from_vector<int32_t>({2, 3}, {5, 3, 4, 2, 7, 6}), P())});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(fetch((*got)[0]), HostArray::from_vector<float>({2, 2}, {1, 3, 5, 4}));
  const HostArray second = fetch((*got)[1]);
  expect_values(second, {1, 3}, {4, 2, std::nan("")}, "take_along_axis axis 0");
  EXPECT_EQ(fetch((*got)[2]), HostArray::from_vector<int32_t>({2, 3}, {3, 4, 5, 2, 6, 7}));
  // On Explicit axes an operand split on a batching dimension, like the indices' (or the
  // indices alone split there), is what JAX's explicit-mode rule accepts
  // (_gather_spec_computation in jax/_src/lax/slicing.py: batching splits resolve into the
  // indices', the result's batch dimension takes them): one gather per block, no collective,
  // the result split over 'model' as the indices. Indices split on a dimension that is not a
  // batching one are JAX's error.
  Jitted split = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{take_along_axis(in[0], in[1], 1),
                              type_of(take_along_axis(in[0], in[1], 1)).spec == P("model", None)
                                  ? full({}, 1.0, DType::kI32)
                                  : full({}, 0.0, DType::kI32)};
  });
  for (const PartitionSpec& xs : {P("model", None), P()}) {
    absl::StatusOr<std::vector<Array>> r = split({put(x, xs), put(i1, P("model", None))});
    ASSERT_TRUE(r.ok()) << xs.to_string() << ": " << r.status();
    EXPECT_EQ(fetch((*r)[0]), HostArray::from_vector<float>({2, 2}, {1, 3, 5, 4})) << xs.to_string();
    EXPECT_EQ(fetch((*r)[1]), HostArray::from_vector<int32_t>({}, {1})) << "result type for x " << xs.to_string();
  }
  for (const char* collective : {"all_gather", "all_reduce", "all_to_all", "collective_permute"}) {
    EXPECT_THAT(split.as_text(), ::testing::Not(HasSubstr(collective))) << split.as_text();
  }
  const HostArray x4 = random_f32({4, 6}, 5);
  absl::StatusOr<std::vector<Array>> refused = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{take_along_axis(in[0], in[1], 1)};
  })({put(x4, P("data", None)), put(ints({4, 2}, {0, 1, 2, 3, 4, 5, 0, 1}), P("data", "model"))});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing"));

  // (8, 6, 4) along axis 1 with (8, 5, 4) indices, negatives wrapping and some out of range,
  // split over 'data' on both: the host loop of numpy's definition.
  const HostArray big = random_f32({8, 6, 4}, 3);
  std::vector<int32_t> iv(8 * 5 * 4);
  for (size_t k = 0; k < iv.size(); ++k) iv[k] = static_cast<int32_t>((k * 5) % 15) - 7;  // [-7, 7]
  const HostArray idx = ints({8, 5, 4}, iv);
  for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
    std::vector<double> want(iv.size());
    for (int64_t a = 0; a < 8; ++a) {
      for (int64_t j = 0; j < 5; ++j) {
        for (int64_t c = 0; c < 4; ++c) {
          const int64_t flat = (a * 5 + j) * 4 + c;
          int64_t r = iv[flat] < 0 ? iv[flat] + 6 : iv[flat];
          if (mode == IndexMode::kClip) r = std::min<int64_t>(std::max<int64_t>(r, 0), 5);
          want[flat] = r < 0 || r >= 6 ? -1.0 : big.element_as_double((a * 6 + r) * 4 + c);
        }
      }
    }
    absl::StatusOr<HostArray> r = run1(
        [mode](const std::vector<Value>& in) {
          return std::vector<Value>{take_along_axis(
              in[0], in[1], 1, mode, mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(-1.0) : std::nullopt)};
        },
        {put_on(*auto_mesh_, big, P("data", None, "model")), put_on(*auto_mesh_, idx, P("data", None, None))});
    ASSERT_TRUE(r.ok()) << r.status();
    expect_values(*r, {8, 5, 4}, want, absl::StrCat("take_along_axis mode ", static_cast<int>(mode)));
  }
}

struct ScatterCase {
  std::string name;
  Shape x;
  HostArray idx;
  Shape updates;
  ScatterDimensionNumbers dn;
};

// JAX's tests/lax_test.py testScatterAddSub cases (shapes and dimension numbers; fixed indices,
// some out of range), x.at[i, j].add(u), and a window shorter than its dimension.
std::vector<ScatterCase> scatter_cases() {
  std::vector<ScatterCase> out;
  out.push_back({"lax_test_insert_1d", {8}, ints({2, 1}, {0, 2}), {2}, {{}, {0}, {0}}});
  out.push_back({"lax_test_window_2_repeated", {8}, ints({3, 1}, {0, 0, 7}), {3, 2}, {{1}, {}, {0}}});
  out.push_back({"lax_test_rows", {8, 6}, ints({3, 1}, {0, 2, 1}), {3, 3}, {{1}, {0}, {0}}});
  out.push_back({"lax_test_batching", {2, 6}, ints({2, 2, 1}, {0, 2, 1, 9}), {2, 2}, {{}, {1}, {1}, {0}, {0}}});
  out.push_back({"lax_test_two_batching_dims",
                 {2, 4, 10},
                 ints({4, 2, 1}, {0, 1, 2, 3, 4, 5, 8, -1}),
                 {4, 2, 3},
                 {{2}, {}, {2}, {0, 1}, {1, 0}}});
  out.push_back({"x_at_i_j_add",
                 {8, 6, 4},
                 ints({2, 3, 2}, {0, 0, 7, 5, 3, 2, 1, 6, 8, 1, 2, 2}),
                 {2, 3, 4},
                 {{2}, {0, 1}, {0, 1}}});
  out.push_back({"windows_around_batch",
                 {4, 8, 6},
                 ints({4, 2}, {0, 0, 6, 3, 7, 1, 2, -1}),
                 {4, 4, 2, 3},
                 {{0, 2, 3}, {}, {1, 2}}});
  // batched_take's scatter (one element per query, per example), repeated rows included, and
  // the form with another inserted dimension of size 1 that must take the general path (it
  // wrote past a vector in session 38's first version).
  out.push_back({"batched_take_queries",
                 {2, 6, 3},
                 ints({2, 4, 1}, {0, 5, 5, 9, 1, 1, -1, 3}),
                 {2, 4, 3},
                 {{2}, {1}, {1}, {0}, {0}}});
  out.push_back({"batched_take_and_an_inserted_unit_dimension",
                 {2, 1, 5, 3},
                 ints({2, 1}, {3, 4}),
                 {2, 3},
                 {{1}, {1, 2}, {2}, {0}, {0}}});
  return out;
}

// The window size of each operand dimension of a scatter case: the updates' along its window
// dimension, 1 for inserted and batching dimensions.
Dims scatter_window(const ScatterCase& c) {
  Dims window(c.x.size(), 1);
  for (size_t d = 0, k = 0; d < c.x.size(); ++d) {
    if (has(c.dn.inserted_window_dims, d) || has(c.dn.operand_batching_dims, d)) continue;
    window[d] = c.updates[c.dn.update_window_dims[k++]];
  }
  return window;
}

TEST_F(GatherTest, ScatterAddMatchesHostLoopsInBothModesOnEveryLayout) {
  const std::vector<Mesh> meshes = {*auto_mesh_, auto_mesh({2, 2})};
  for (const ScatterCase& c : scatter_cases()) {
    const HostArray x = random_f32(c.x, 11), u = random_f32(c.updates, 12);
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const std::vector<double> want = host_scatter(x, c.idx, u, c.dn, mode, true);
      const TracedFunction f = [&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_add(in[0], in[1], in[2], c.dn, mode)};
      };
      for (const Mesh& mesh : meshes) {
        const std::vector<PartitionSpec> idx_layouts = layouts(c.idx.shape(), mesh);
        const std::vector<PartitionSpec> u_layouts = layouts(c.updates, mesh);
        size_t i = 0;
        for (const PartitionSpec& xs : layouts(c.x, mesh)) {
          const PartitionSpec& is = idx_layouts[i % idx_layouts.size()];
          const PartitionSpec& us = u_layouts[i++ % u_layouts.size()];
          const std::string where =
              absl::StrCat(c.name, " mode ", static_cast<int>(mode), " mesh ", mesh.shape()[0], "x", mesh.shape()[1],
                           " x ", xs.to_string(), " indices ", is.to_string(), " updates ", us.to_string());
          absl::StatusOr<HostArray> got = run1(f, {put_on(mesh, x, xs), put_on(mesh, c.idx, is), put_on(mesh, u, us)});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          expect_values(*got, c.x, want, where);
        }
      }
    }
  }
}

// scatter (set) with windows that do not overlap (with overlaps XLA writes one of them).
TEST_F(GatherTest, ScatterSetMatchesHostLoops) {
  const ScatterDimensionNumbers dn{{1}, {0}, {0, 1}};
  const HostArray x = random_f32({8, 6}, 21), u = random_f32({4, 2}, 22);
  const HostArray idx = ints({4, 2}, {1, 0, 3, 4, 6, 5, -1, 2});  // (6, 5) and (-1, 2): outside
  for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
    const std::vector<double> want = host_scatter(x, idx, u, dn, mode, false);
    absl::StatusOr<HostArray> got =
        run1([&](const std::vector<Value>& in) { return std::vector<Value>{scatter(in[0], in[1], in[2], dn, mode)}; },
             {put_on(*auto_mesh_, x, P("data", "model")), put_on(*auto_mesh_, idx, P()),
              put_on(*auto_mesh_, u, P("data", None))});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_values(*got, {8, 6}, want, absl::StrCat("scatter mode ", static_cast<int>(mode)));
  }
}

// The gradient of a gather with windows and batching dimensions is the scatter_add of the
// cotangent: checked against the host loop (each operand element's gradient is the sum of the
// weights of the result elements it was gathered into; clipped windows count, filled not).
TEST_F(GatherTest, GatherGradientIsTheScatterOfTheCotangent) {
  const GatherDimensionNumbers dn{{0, 2, 3}, {}, {1, 2}};
  const Dims sizes = {4, 2, 3};
  const HostArray x = random_f32({4, 8, 6}, 31);
  const HostArray idx = ints({4, 2}, {0, 0, 6, 3, 7, 1, 2, -1});
  for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
    Shape out_shape;
    host_gather(x, idx, dn, sizes, mode, 0.0, &out_shape);
    const HostArray w = random_f32(out_shape, 32);
    // d/dx sum(gather(x) * w): scatter w back through the same addressing.
    std::vector<double> want(x.size(), 0.0);
    {
      HostArray ids = HostArray::arange(DType::kF32, x.shape());
      Shape s;
      const std::vector<double> source = host_gather(ids, idx, dn, sizes, mode, -1.0, &s);
      for (size_t k = 0; k < source.size(); ++k)
        if (source[k] >= 0) want[static_cast<int64_t>(source[k])] += w.element_as_double(static_cast<int64_t>(k));
    }
    absl::StatusOr<HostArray> got =
        run1(grad([&](const std::vector<Value>& in) {
               return std::vector<Value>{
                   sum(gather(in[0], in[1], dn, sizes, mode,
                              mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(0.0) : std::nullopt) *
                       in[2])};
             }),
             {put_on(*auto_mesh_, x, P("data", None, "model")), put_on(*auto_mesh_, idx, P("data", None)),
              put_on(*auto_mesh_, w, P())});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_values(*got, x.shape(), want, absl::StrCat("grad mode ", static_cast<int>(mode)));
  }
}

// An operand split on a dimension the gather takes whole keeps its split: the program moves
// no part of the operand (x[i] of a (16, 8) x split over 'model' on dimension 1, indices
// split over 'data': no collective at all).
TEST_F(GatherTest, OperandSplitOnAWholeDimensionIsNotGathered) {
  Jitted f = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{gather(in[0], in[1], GatherDimensionNumbers{{1}, {0}, {0}}, {1, 8})};
  });
  const HostArray x = random_f32({16, 8}, 41);
  const HostArray idx = ints({4, 1}, {3, 15, 0, 7});
  absl::StatusOr<std::vector<Array>> got =
      f({put_on(*auto_mesh_, x, P(None, "model")), put_on(*auto_mesh_, idx, P("data", None))});
  ASSERT_TRUE(got.ok()) << got.status();
  Shape s;
  expect_values(fetch((*got)[0]), {4, 8}, host_gather(x, idx, {{1}, {0}, {0}}, {1, 8}, IndexMode::kFillOrDrop, 0, &s),
                "whole dimension split");
  const std::string plan = f.as_text();
  for (const char* collective : {"all_gather", "all_reduce", "all_to_all", "collective_permute"}) {
    EXPECT_THAT(plan, ::testing::Not(HasSubstr(collective))) << plan;
  }
}

// GatherScatterMode::PROMISE_IN_BOUNDS (jax/_src/lax/slicing.py: "The user promises that indices
// are in bounds"; out-of-bounds results are implementation-defined, so only in-bounds indices
// are tested): every gather and scatter_add case with its indices moved in bounds equals the
// host loop (whose clip mode then changes nothing), on a replicated and a split layout; and
// take_along_axis, whose negative indices do not wrap in that mode (wrap_negative_indices
// defaults to mode != "promise_in_bounds" in jax/_src/numpy/indexing.py).
TEST_F(GatherTest, PromiseInBoundsEqualsTheHostLoopForInBoundsIndices) {
  const Mesh mesh = auto_mesh({2, 2});
  for (const GatherCase& c : gather_cases()) {
    const HostArray x = random_f32(c.x, 51);
    const HostArray idx = in_bounds(c.idx, c.x, c.slice_sizes, c.dn.start_index_map);
    Shape want_shape;
    const std::vector<double> want = host_gather(x, idx, c.dn, c.slice_sizes, IndexMode::kClip, 0, &want_shape);
    const TracedFunction f = [&](const std::vector<Value>& in) {
      return std::vector<Value>{gather(in[0], in[1], c.dn, c.slice_sizes, GatherScatterMode::kPromiseInBounds)};
    };
    const std::vector<PartitionSpec> specs = layouts(c.x, mesh);
    for (const PartitionSpec& xs : {specs.front(), specs.back()}) {
      const std::string where = absl::StrCat(c.name, " x ", xs.to_string());
      absl::StatusOr<HostArray> got = run1(f, {put_on(mesh, x, xs), put_on(mesh, idx, P())});
      ASSERT_TRUE(got.ok()) << where << ": " << got.status();
      expect_values(*got, want_shape, want, where);
    }
  }
  for (const ScatterCase& c : scatter_cases()) {
    const HostArray x = random_f32(c.x, 52), u = random_f32(c.updates, 53);
    const Dims window = scatter_window(c);
    const HostArray idx = in_bounds(c.idx, c.x, window, c.dn.scatter_dims_to_operand_dims);
    const std::vector<double> want = host_scatter(x, idx, u, c.dn, IndexMode::kClip, true);
    absl::StatusOr<HostArray> got = run1(
        [&](const std::vector<Value>& in) {
          return std::vector<Value>{scatter_add(in[0], in[1], in[2], c.dn, GatherScatterMode::kPromiseInBounds)};
        },
        {put_on(mesh, x, layouts(c.x, mesh).back()), put_on(mesh, idx, P()), put_on(mesh, u, P())});
    ASSERT_TRUE(got.ok()) << c.name << ": " << got.status();
    expect_values(*got, c.x, want, c.name);
  }
  const HostArray x = HostArray::from_vector<float>({2, 3}, {1, 2, 3, 4, 5, 6});
  absl::StatusOr<HostArray> got = run1(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{take_along_axis(in[0], in[1], 1, GatherScatterMode::kPromiseInBounds)};
      },
      {put(x, P()), put(ints({2, 2}, {2, 0, 1, 1}), P())});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, HostArray::from_vector<float>({2, 2}, {3, 1, 5, 5}));
}

// PROMISE_IN_BOUNDS with an index out of bounds: what XLA does, as JAX's GatherScatterMode
// docstring says (jax/_src/lax/slicing.py: "out-of-bounds gathers will be clamped but
// out-of-bounds scatters will be discarded"), never another row's element: start (0, 5) of a
// (5, 4) operand would otherwise fold into the linear index of element (1, 1).
TEST_F(GatherTest, PromiseInBoundsClampsGathersAndDropsScattersOutOfBoundsAsXla) {
  const HostArray x = HostArray::arange(DType::kF32, {5, 4});
  const HostArray idx = ints({2, 2}, {0, 5, 4, 1});
  const GatherDimensionNumbers gdn{{}, {0, 1}, {0, 1}};
  Shape want_shape;
  const std::vector<double> gathered = host_gather(x, idx, gdn, {1, 1}, IndexMode::kClip, 0, &want_shape);
  absl::StatusOr<HostArray> got = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], gdn, {1, 1}, GatherScatterMode::kPromiseInBounds)};
      },
      {put(x, P()), put(idx, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_values(*got, want_shape, gathered, "gather");
  const ScatterDimensionNumbers sdn{{}, {0, 1}, {0, 1}};
  const HostArray u = HostArray::from_vector<float>({2}, {100, 1000});
  const std::vector<double> scattered = host_scatter(x, idx, u, sdn, IndexMode::kFillOrDrop, true);
  got = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_add(in[0], in[1], in[2], sdn, GatherScatterMode::kPromiseInBounds)};
      },
      {put(x, P()), put(idx, P()), put(u, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_values(*got, {5, 4}, scattered, "scatter_add");
}

// GatherScatterMode::ONE_HOT. JAX implements it in jnp.take_along_axis alone
// (jax/_src/numpy/indexing.py): negative indices wrap, then
// einsum(one_hot(indices, n), x) along the axis, so an out-of-range index gives 0 and, as in
// any such contraction, an infinity along the axis turns the other results of its row into NaN
// (0 * inf). lax.gather's lowering (_gather_lower) asserts the mode is one of the other three,
// so a gather refuses it; lax.scatter hands it to XLA's scatter unclamped, which skips
// out-of-bounds windows: the drop of FILL_OR_DROP.
TEST_F(GatherTest, OneHotModeIsJaxs) {
  const float inf = std::numeric_limits<float>::infinity();
  const HostArray x = HostArray::from_vector<float>({4, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, -1, inf, 2});
  const HostArray idx = ints({4, 4}, {0, 2, -1, 3, -3, 1, 7, 2, 2, -4, 0, 1, 0, 2, 1, 5});
  const double nan = std::nan("");
  // Row 3 holds inf at column 1: the index naming it gives inf, every other one NaN.
  const std::vector<double> want = {1, 3, 3, 0, 4, 5, 0, 6, 9, 0, 7, 8, nan, nan, inf, nan};
  for (const PartitionSpec& xs : {P(), P("data", None)}) {
    absl::StatusOr<HostArray> got = run1(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{take_along_axis(in[0], in[1], 1, GatherScatterMode::kOneHot)};
        },
        {put_on(*auto_mesh_, x, xs), put_on(*auto_mesh_, idx, P())});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_values(*got, {4, 4}, want, absl::StrCat("one_hot x ", xs.to_string()));
  }
  // Along axis 0 of an int32 x with broadcast indices (1, 3).
  absl::StatusOr<HostArray> along0 = run1(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{take_along_axis(in[0], in[1], 0, GatherScatterMode::kOneHot)};
      },
      {put(HostArray::arange(DType::kI32, {4, 3}), P()), put(ints({1, 3}, {3, -4, 4}), P())});
  ASSERT_TRUE(along0.ok()) << along0.status();
  EXPECT_EQ(*along0, HostArray::from_vector<int32_t>({1, 3}, {9, 1, 0}));

  const absl::Status refused =
      trace(
          [](const std::vector<Value>& in) {
            return std::vector<Value>{
                gather(in[0], in[1], GatherDimensionNumbers{{1}, {0}, {0}}, {1, 3}, GatherScatterMode::kOneHot)};
          },
          {ArrayType{DType::kF32, {5, 3}}, ArrayType{DType::kI32, {2, 1}}})
          .status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("gather: GatherScatterMode::kOneHot is take_along_axis's"));

  const std::vector<ScatterCase> cases = scatter_cases();
  const ScatterCase& c = cases[1];  // repeated and out-of-range windows
  const HostArray sx = random_f32(c.x, 54), su = random_f32(c.updates, 55);
  absl::StatusOr<HostArray> scattered = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_add(in[0], in[1], in[2], c.dn, GatherScatterMode::kOneHot)};
      },
      {put(sx, P()), put(c.idx, P()), put(su, P())});
  ASSERT_TRUE(scattered.ok()) << scattered.status();
  expect_values(*scattered, c.x, host_scatter(sx, c.idx, su, c.dn, IndexMode::kFillOrDrop, true), "one_hot scatter");
}

// lax.scatter_mul / scatter_min / scatter_max: every update combined into its target, repeated
// windows included, out-of-range ones dropped (FILL_OR_DROP) or clamped (CLIP), as the host loop
// over XLA's Scatter semantics with the combiner; float32 on a replicated and a split layout,
// and int32 (exact).
TEST_F(GatherTest, ScatterMulMinMaxMatchHostLoops) {
  struct Combiner {
    const char* name;
    std::function<Value(const Value&, const Value&, const Value&, const ScatterDimensionNumbers&, GatherScatterMode)>
        op;
    std::function<double(double, double)> host;
  };
  const std::vector<Combiner> combiners = {
      {"scatter_mul",
       [](const Value& x, const Value& i, const Value& u, const ScatterDimensionNumbers& dn, GatherScatterMode m) {
         return scatter_mul(x, i, u, dn, m);
       },
       [](double a, double b) { return a * b; }},
      {"scatter_min",
       [](const Value& x, const Value& i, const Value& u, const ScatterDimensionNumbers& dn, GatherScatterMode m) {
         return scatter_min(x, i, u, dn, m);
       },
       [](double a, double b) { return std::min(a, b); }},
      {"scatter_max",
       [](const Value& x, const Value& i, const Value& u, const ScatterDimensionNumbers& dn, GatherScatterMode m) {
         return scatter_max(x, i, u, dn, m);
       },
       [](double a, double b) { return std::max(a, b); }},
  };
  const Mesh mesh = auto_mesh({2, 2});
  for (const ScatterCase& c : scatter_cases()) {
    const HostArray x = random_f32(c.x, 61), u = random_f32(c.updates, 62);
    std::vector<int32_t> iu(u.size());
    for (int64_t k = 0; k < u.size(); ++k) iu[k] = static_cast<int32_t>((k * 7) % 11) - 5;
    const HostArray xi = HostArray::arange(DType::kI32, c.x), ui = HostArray::from_vector<int32_t>(c.updates, iu);
    for (const Combiner& comb : combiners) {
      for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
        const TracedFunction f = [&](const std::vector<Value>& in) {
          return std::vector<Value>{comb.op(in[0], in[1], in[2], c.dn, mode)};
        };
        const std::string where = absl::StrCat(c.name, " ", comb.name, " mode ", static_cast<int>(mode));
        const std::vector<double> want = host_scatter_with(x, c.idx, u, c.dn, mode, comb.host);
        const std::vector<PartitionSpec> specs = layouts(c.x, mesh);
        for (const PartitionSpec& xs : {specs.front(), specs.back()}) {
          absl::StatusOr<HostArray> got =
              run1(f, {put_on(mesh, x, xs), put_on(mesh, c.idx, P()), put_on(mesh, u, P())});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          expect_values(*got, c.x, want, absl::StrCat(where, " x ", xs.to_string()));
        }
        absl::StatusOr<HostArray> got = run1(f, {put(xi, P()), put(c.idx, P()), put(ui, P())});
        ASSERT_TRUE(got.ok()) << where << " int32: " << got.status();
        const std::vector<double> want_i = host_scatter_with(xi, c.idx, ui, c.dn, mode, comb.host);
        for (size_t k = 0; k < want_i.size(); ++k) {
          ASSERT_EQ(got->element_as_double(static_cast<int64_t>(k)), want_i[k]) << where << " int32 element " << k;
        }
      }
    }
  }
}

// scatter_min / max on bool operands, which JAX takes (they trace lax.min / lax.max, whose
// dtypes are _any in jax/_src/lax/lax.py; scatter_mul and scatter_add refuse bool: see
// ScatterSubAndApplyErrors) and XLA combines with PRED's minimum and maximum: and, or. The host
// loop runs them on 0 / 1 with min and max (the same truth tables). Every scatter case, both
// modes (repeated and out-of-range windows), the operand split on its last dividing layout on the
// Auto meshes (8), (4, 2) and (2, 4); bools made on the devices from int32 (x != 0).
TEST_F(GatherTest, ScatterMinMaxOnBoolAreAndOr) {
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  const std::vector<Mesh> meshes = {*flat, auto_mesh({4, 2}), auto_mesh({2, 4})};
  const std::vector<std::function<double(double, double)>> host = {[](double a, double b) { return std::min(a, b); },
                                                                   [](double a, double b) { return std::max(a, b); }};
  const char* names[] = {"scatter_min", "scatter_max"};
  for (const ScatterCase& c : scatter_cases()) {
    std::vector<int32_t> xv(num_elements(c.x)), uv(num_elements(c.updates));
    for (size_t k = 0; k < xv.size(); ++k) xv[k] = (k * 5 + 1) % 3 != 0;  // mostly true
    for (size_t k = 0; k < uv.size(); ++k) uv[k] = (k * 7) % 3 == 0;      // mostly false
    const HostArray x = HostArray::from_vector<int32_t>(c.x, xv), u = HostArray::from_vector<int32_t>(c.updates, uv);
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const TracedFunction f = [&](const std::vector<Value>& in) {
        const Value xb = in[0] != 0, ub = in[2] != 0;
        return std::vector<Value>{scatter_min(xb, in[1], ub, c.dn, mode), scatter_max(xb, in[1], ub, c.dn, mode)};
      };
      for (const Mesh& mesh : meshes) {
        const PartitionSpec xs = layouts(c.x, mesh).back();
        const std::string where = absl::StrCat(c.name, " mode ", static_cast<int>(mode), " mesh ",
                                               absl::StrJoin(mesh.shape(), "x"), " x ", xs.to_string());
        absl::StatusOr<std::vector<Array>> got =
            jit(f)({put_on(mesh, x, xs), put_on(mesh, c.idx, P()), put_on(mesh, u, P())});
        ASSERT_TRUE(got.ok()) << where << ": " << got.status();
        for (size_t k = 0; k < host.size(); ++k) {
          const HostArray r = fetch((*got)[k]);
          ASSERT_EQ(r.dtype(), DType::kBool) << where << " " << names[k];
          const std::vector<double> want = host_scatter_with(x, c.idx, u, c.dn, mode, host[k]);
          for (size_t e = 0; e < want.size(); ++e) {
            ASSERT_EQ(r.element_as_double(static_cast<int64_t>(e)), want[e]) << where << " " << names[k] << " " << e;
          }
        }
      }
    }
  }
}

// Ties in scatter_min / scatter_max share the cotangent equally among the operand's element and
// the updates equal to the result, as JAX's _scatter_extremal_jvp (jax/_src/lax/slicing.py:
// "the resulting tangent at that location will be the average of the associated tangents"):
// min(x[0] = 1, 1, 1) gives each a third; x[1] = 5 is untouched, so its gradient is 1.
TEST_F(GatherTest, ScatterMinMaxTiesShareTheCotangent) {
  const HostArray x = HostArray::from_vector<float>({2}, {1, 5}), u = HostArray::from_vector<float>({3}, {1, 1, 2});
  const HostArray idx = ints({3, 1}, {0, 0, 0});
  const ScatterDimensionNumbers dn{{}, {0}, {0}};
  absl::StatusOr<std::vector<Array>> got = jit(
      grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(scatter_min(in[0], in[1], in[2], dn))}; },
           {0, 2}))({put(x, P()), put(idx, P()), put(u, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_values(fetch((*got)[0]), {2}, {1.0 / 3, 1}, "scatter_min grad x");
  expect_values(fetch((*got)[1]), {3}, {1.0 / 3, 1.0 / 3, 0}, "scatter_min grad updates");
  // max(x[0] = 1, 1, 1, 2) = 2: the update 2 alone takes it.
  got = jit(
      grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(scatter_max(in[0], in[1], in[2], dn))}; },
           {0, 2}))({put(x, P()), put(idx, P()), put(u, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_values(fetch((*got)[0]), {2}, {0, 1}, "scatter_max grad x");
  expect_values(fetch((*got)[1]), {3}, {0, 0, 1}, "scatter_max grad updates");
}

// vmap of the composites (client/vmap.cc batches the ops they are built of): each example's
// gather, scatter_add, scatter_max and take_along_axis equal the host loop on that example.
TEST_F(GatherTest, VmapMatchesPerExampleHostLoops) {
  const int64_t batch = 4;
  const GatherDimensionNumbers gdn{{1}, {0}, {0, 1}};
  const ScatterDimensionNumbers sdn{{1}, {0}, {0, 1}};
  const Dims sizes = {1, 2};
  const HostArray x = random_f32({batch, 8, 6}, 71), u = random_f32({batch, 3, 2}, 72);
  const HostArray idx = ints({batch, 3, 2}, {0, 1, 7, 4, 2, 2, 9, 0, 3, 3, 3, 3, 1, 5, 6, 0, -1, 2, 4, 4, 0, 0, 7, 5});
  std::vector<int32_t> tv(batch * 8 * 2);
  for (size_t k = 0; k < tv.size(); ++k) tv[k] = static_cast<int32_t>((k * 5) % 9) - 2;  // [-2, 6]
  const HostArray along = ints({batch, 8, 2}, tv);
  absl::StatusOr<std::vector<Array>> got = jit(vmap([&](const std::vector<Value>& in) {
    return std::vector<Value>{gather(in[0], in[1], gdn, sizes, IndexMode::kClip), scatter_add(in[0], in[1], in[2], sdn),
                              scatter_max(in[0], in[1], in[2], sdn), take_along_axis(in[0], in[3], 1)};
  }))({put_on(*auto_mesh_, x, P("data", None, None)), put_on(*auto_mesh_, idx, P()), put_on(*auto_mesh_, u, P()),
       put_on(*auto_mesh_, along, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<HostArray> out;
  for (const Array& a : *got) out.push_back(fetch(a));
  for (int64_t b = 0; b < batch; ++b) {
    const HostArray xb = example(x, b), ib = example(idx, b), ub = example(u, b), tb = example(along, b);
    const std::string where = absl::StrCat("example ", b);
    Shape s;
    expect_values(example(out[0], b), {3, 2}, host_gather(xb, ib, gdn, sizes, IndexMode::kClip, 0, &s),
                  where + " gather");
    expect_values(example(out[1], b), {8, 6}, host_scatter(xb, ib, ub, sdn, IndexMode::kFillOrDrop, true),
                  where + " scatter_add");
    expect_values(
        example(out[2], b), {8, 6},
        host_scatter_with(xb, ib, ub, sdn, IndexMode::kFillOrDrop, [](double a, double v) { return std::max(a, v); }),
        where + " scatter_max");
    std::vector<double> want(8 * 2);
    for (int64_t r = 0; r < 8; ++r) {
      for (int64_t j = 0; j < 2; ++j) {
        int64_t i = static_cast<int64_t>(tb.element_as_double(r * 2 + j));
        if (i < 0) i += 6;
        want[r * 2 + j] = i < 0 || i >= 6 ? std::nan("") : xb.element_as_double(r * 6 + i);
      }
    }
    expect_values(example(out[3], b), {8, 2}, want, where + " take_along_axis");
  }
}

// Dimension numbers breaking JAX's rules: the messages of _gather_shape_rule /
// _scatter_shape_rule (tests/lax_test.py testGatherShapeCheckingRule and
// testScatterShapeCheckingRule cases), as INVALID_ARGUMENT at trace time.
TEST_F(GatherTest, DimensionNumbersErrorsAreJaxs) {
  auto gather_error = [](Shape x, Shape idx, GatherDimensionNumbers dn, Dims sizes) {
    return trace([&](const std::vector<Value>& in) { return std::vector<Value>{gather(in[0], in[1], dn, sizes)}; },
                 {ArrayType{DType::kF32, x}, ArrayType{DType::kI32, idx}})
        .status();
  };
  // Every case of testGatherShapeCheckingRule, in its order: operand and indices shapes,
  // (offset_dims, collapsed_slice_dims, start_index_map, operand_batching_dims,
  // start_indices_batching_dims), slice sizes, and JAX's message.
  const Shape x = {10, 9, 8, 7, 6};
  struct Expect {
    absl::Status status;
    std::string message;
  };
  const std::vector<Expect> cases = {
      {gather_error(x, {5, 4, 3, 2, 1}, {{4, 5, 6, 8, 7}, {}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "offset_dims in gather op must be sorted"},
      {gather_error(x, {5, 4, 3, 2, 1}, {{4, 5, 6, 7, 7}, {}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "offset_dims in gather op must not repeat"},
      {gather_error(x, {5, 4, 3, 2, 1}, {{4, 5, 100, 101, 102}, {}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "Offset dimension 2 in gather op is out of bounds"},
      {gather_error(x, {5, 4, 3, 2, 1}, {{4, 5, 6, 7, 9}, {}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "Offset dimension 4 in gather op is out of bounds"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {4}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "All components of the offset index in a gather op must either be a offset dimension or explicitly "
       "collapsed/batching"},
      {gather_error({10, 9, 8, 7, 6, 5}, {10, 4, 3, 2, 4}, {{4, 5, 6, 7, 8}, {4}, {1, 2, 3, 4}, {0}, {0}},
                    {10, 9, 8, 7, 6, 5}),
       "All components of the offset index in a gather op must either be a offset dimension or explicitly "
       "collapsed/batching"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {0, 1, 2, 3, 19}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "Invalid collapsed_slice_dims set in gather op; valid range is"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {0, 1, 2, 3, 3}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "collapsed_slice_dims in gather op must not repeat"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {}, {0, 1, 2, 3}}, {10, 9, 8, 7, 6}),
       "Gather op has 4 elements in start_index_map and the bound of dimension index_vector_dim=4 of indices is 5. "
       "These two numbers must be equal."},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {}, {0, 1, 2, 3, 7}}, {10, 9, 8, 7, 6}),
       "Invalid start_index_map"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {}, {0, 1, 2, 3, 3}}, {10, 9, 8, 7, 6}),
       "start_index_map in gather op must not repeat"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7, 8}, {2, 1}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "collapsed_slice_dims in gather op must be sorted"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7}, {2}, {0, 1, 2, 3, 4}}, {10, 9, 8, 100, 6}),
       "Slice size at index 3 in gather op is out of range"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7}, {}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7}),
       "Gather op must have one slice size for every input dimension"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6, 7}, {1}, {0, 1, 2, 3, 4}}, {10, 9, 8, 7, 6}),
       "Gather op can only collapse slice dims with bound 1, but bound is 9 for index 1 at position 0."},
      {gather_error(x, {5, 4, 3, 2, 3}, {{4, 5, 6}, {0, 1}, {0, 1, 4}, {2, 3, 3}}, {10, 9, 8, 7, 6}),
       "operand_batching_dims in gather op must not repeat"},
      {gather_error(x, {5, 4, 3, 2, 3}, {{4, 5, 6}, {0, 1}, {0, 1, 4}, {3, 2}}, {10, 9, 8, 7, 6}),
       "operand_batching_dims in gather op must be sorted"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6}, {0, 1}, {0, 1, 2, 3, 4}, {0, 10}}, {10, 9, 8, 7, 6}),
       "Invalid operand_batching_dims set in gather op; valid range is"},
      {gather_error(x, {5, 4, 3, 2, 3}, {{4, 5, 6}, {0, 1, 2}, {0, 1, 4}, {2, 3}}, {10, 9, 8, 7, 6}),
       "collapsed_slice_dims and operand_batching_dims in gather op must be disjoint"},
      {gather_error(x, {5, 4, 3, 2, 4}, {{4, 5, 6}, {0, 1}, {0, 1, 2, 4}, {2, 3}}, {10, 9, 8, 7, 6}),
       "start_index_map and operand_batching_dims in gather op must be disjoint"},
      {gather_error(x, {9, 4, 3, 2, 4}, {{4, 5, 6, 7}, {}, {0, 2, 3, 4}, {1}, {0}}, {10, 9, 8, 7, 6}),
       "Gather op can only have operand batching dims with bound 0/1, but bound is 9 for index 1 at position 0."},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6}, {0, 1}, {0, 1, 2, 3, 4}, {}, {0, 1, 0}}, {10, 9, 8, 7, 6}),
       "start_indices_batching_dims in gather op must not repeat"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6}, {0, 1}, {0, 1, 2, 3, 4}, {}, {0, 5}}, {10, 9, 8, 7, 6}),
       "Invalid start_indices_batching_dims set in gather op; valid range"},
      {gather_error(x, {5, 4, 3, 2, 5}, {{4, 5, 6}, {0, 1}, {0, 1, 2, 3, 4}, {}, {0, 4}}, {10, 9, 8, 7, 6}),
       "Gather op cannot have the index vector dimension as a batching dimension"},
      {gather_error(x, {5, 4, 3, 2, 4}, {{4, 5, 6}, {1, 2}, {1, 2, 3, 4}, {0}, {0, 1}}, {10, 9, 8, 7, 6}),
       "Gather op requires equal numbers of operand_batching_dims and start_indices_batching_dims"},
      {gather_error(x, {10, 9, 3, 2, 3}, {{4, 5, 6, 7, 8}, {2, 3, 4}, {2, 3, 4}, {0, 1}, {1, 0}}, {10, 9, 8, 7, 6}),
       "Gather op requires operand batching dimensions and indices batching dimensions to have the same shape, got "
       "(10, 9) and (9, 10)."},
      // Indices (2, 0): an empty index vector, but two slices taken at start 0, so the slice
      // sizes are checked (XLA's gather shape inference, whose text JAX's rule repeats; JAX's
      // own check is skipped for empty indices and the error comes from XLA).
      {gather_error({4, 3}, {2, 0}, {{1, 2}, {}, {}}, {5, 3}),
       "Slice size at index 0 in gather op is out of range, must be within [0, 4 + 1), got 5."},
  };
  for (const Expect& e : cases) {
    EXPECT_EQ(e.status.code(), absl::StatusCode::kInvalidArgument) << e.message << ": " << e.status;
    EXPECT_THAT(std::string(e.status.message()), HasSubstr(e.message));
  }
  // No slice taken at all (indices (0, 0)): nothing to check, the result is empty, as in JAX.
  absl::StatusOr<Graph> empty = trace(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], GatherDimensionNumbers{{1, 2}, {}, {}}, {5, 3})};
      },
      {ArrayType{DType::kF32, {4, 3}}, ArrayType{DType::kI32, {0, 0}}});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->node(empty->outputs()[0]).shape, (Shape{0, 5, 3}));
  const absl::Status scatter_status =
      trace(
          [](const std::vector<Value>& in) {
            return std::vector<Value>{scatter_add(in[0], in[1], in[2], ScatterDimensionNumbers{{1}, {0}, {0}})};
          },
          {ArrayType{DType::kF32, {10, 5}}, ArrayType{DType::kI32, {3, 1}}, ArrayType{DType::kF32, {3, 6}}})
          .status();
  EXPECT_EQ(scatter_status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(scatter_status.message()),
              HasSubstr("Bounds of the window dimensions of updates must not exceed the bounds of the corresponding "
                        "dimensions of operand. For dimension 1, updates bound is 6, operand bound is 5."));
}

// lax.scatter_sub and lax.scatter_apply (jax/_src/lax/slicing.py) against the host loop over
// XLA's Scatter semantics with their combiners: scatter_sub subtracts every update (repeated
// windows each); scatter_apply (XLA's scatter with `func` as the update computation, the updates
// a placeholder of update_shape) applies func once per window covering an element, so twice on
// an element two windows cover. Every GatherScatterMode: kClip clamps, kFillOrDrop and kOneHot
// drop out-of-range windows, kPromiseInBounds with in-bounds indices equals the clamped loop.
// On Auto meshes (8), (4, 2) and (2, 4), several layouts of operand, indices and updates.
TEST_F(GatherTest, ScatterSubAndApplyMatchHostLoopsInEveryModeOnEveryMesh) {
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  const std::vector<Mesh> meshes = {*flat, auto_mesh({4, 2}), auto_mesh({2, 4})};
  const auto twice_plus_one = [](const Value& v) { return v * 2.0 + 1.0; };
  for (const ScatterCase& c : scatter_cases()) {
    const HostArray x = random_f32(c.x, 81), u = random_f32(c.updates, 82);
    const Dims window = scatter_window(c);
    for (GatherScatterMode mode : {GatherScatterMode::kClip, GatherScatterMode::kFillOrDrop, GatherScatterMode::kOneHot,
                                   GatherScatterMode::kPromiseInBounds}) {
      const bool promised = mode == GatherScatterMode::kPromiseInBounds;
      const HostArray idx = promised ? in_bounds(c.idx, c.x, window, c.dn.scatter_dims_to_operand_dims) : c.idx.clone();
      const IndexMode host_mode =
          mode == GatherScatterMode::kClip || promised ? IndexMode::kClip : IndexMode::kFillOrDrop;
      const std::vector<double> want_sub =
          host_scatter_with(x, idx, u, c.dn, host_mode, [](double old, double v) { return old - v; });
      const std::vector<double> want_apply =
          host_scatter_with(x, idx, u, c.dn, host_mode, [](double old, double) { return old * 2.0 + 1.0; });
      const TracedFunction f = [&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_sub(in[0], in[1], in[2], c.dn, mode),
                                  scatter_apply(in[0], in[1], twice_plus_one, c.dn, c.updates, mode)};
      };
      for (const Mesh& mesh : meshes) {
        const std::vector<PartitionSpec> x_layouts = layouts(c.x, mesh), idx_layouts = layouts(idx.shape(), mesh),
                                         u_layouts = layouts(c.updates, mesh);
        for (size_t i = 0; i < x_layouts.size(); ++i) {
          const PartitionSpec &xs = x_layouts[i], &is = idx_layouts[i % idx_layouts.size()],
                              &us = u_layouts[(i + 1) % u_layouts.size()];
          const std::string where =
              absl::StrCat(c.name, " mode ", static_cast<int>(mode), " mesh ", absl::StrJoin(mesh.shape(), "x"), " x ",
                           xs.to_string(), " indices ", is.to_string(), " updates ", us.to_string());
          absl::StatusOr<std::vector<Array>> got =
              jit(f)({put_on(mesh, x, xs), put_on(mesh, idx, is), put_on(mesh, u, us)});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          expect_values(fetch((*got)[0]), c.x, want_sub, absl::StrCat("scatter_sub ", where));
          expect_values(fetch((*got)[1]), c.x, want_apply, absl::StrCat("scatter_apply ", where));
        }
      }
    }
  }
  // int32: exact; element 2 hit twice (3 * 3 * 1 for scatter_apply), index 5 dropped.
  const ScatterDimensionNumbers dn{{}, {0}, {0}};
  absl::StatusOr<std::vector<Array>> got = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{scatter_sub(in[0], in[1], in[2], dn),
                              scatter_apply(in[0], in[1], [](const Value& v) { return v * 3; }, dn, {4})};
  })({put(HostArray::from_vector<int32_t>({3}, {-5, 7, 1}), P()), put(ints({4, 1}, {0, 2, 2, 5}), P()),
      put(HostArray::from_vector<int32_t>({4}, {1, 4, -6, 9}), P())});
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(fetch((*got)[0]), HostArray::from_vector<int32_t>({3}, {-6, 7, 3}));
  EXPECT_EQ(fetch((*got)[1]), HostArray::from_vector<int32_t>({3}, {-15, 7, 9}));
}

// scatter_apply's further applications run in chunks of 2^j steps for the binary digits of
// max(count) - 1 (control_test's ScatterApplyPlan): counts whose largest is 1, 2, 4, 6 and 9
// (r = 0, 1, 3 = 2 + 1, 5 = 4 + 1, 8 = 8 of at most 15 steps for 16 windows) in fill mode, where
// the index 9 is dropped (in clip mode it clamps onto 7: r = 8, 7, 8, 6 and 8), take different
// chunks, and each element must still be func applied exactly its count of times, as the host
// loop over XLA's Scatter semantics; int32 (exact) with x -> 2x + 1, and in fill mode an
// out-of-range window (index 9) dropped. On the Auto meshes (8), (4, 2) and (2, 4), the operand
// replicated and split.
TEST_F(GatherTest, ScatterApplyRunsEachChunkOfTheLargestCount) {
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  const std::vector<Mesh> meshes = {*flat, auto_mesh({4, 2}), auto_mesh({2, 4})};
  const ScatterDimensionNumbers dn{{}, {0}, {0}};
  const HostArray x = HostArray::from_vector<int32_t>({8}, {0, 1, -1, 2, 3, -2, 5, 1});
  const std::vector<std::vector<int32_t>> index_sets = {
      {0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9, 9, 9, 9, 9},  // fill: each once (r = 0); clip: 7 nine times (r = 8)
      {0, 0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9, 9, 9, 9},  // fill: r = 1; clip: r = 7
      {3, 3, 3, 3, 1, 1, 6, 9, 9, 9, 9, 9, 9, 9, 9, 9},  // fill: r = 3; clip: r = 8
      {5, 5, 5, 5, 5, 5, 0, 0, 0, 7, 9, 9, 9, 9, 9, 9},  // fill: r = 5; clip: r = 6
      {2, 2, 2, 2, 2, 2, 2, 2, 2, 4, 4, 9, 9, 9, 9, 9},  // fill and clip: r = 8
  };
  const auto twice_plus_one = [](const Value& v) { return v * 2 + 1; };
  for (const std::vector<int32_t>& iv : index_sets) {
    const HostArray idx = ints({16, 1}, iv);
    const HostArray u = HostArray::from_vector<int32_t>({16}, std::vector<int32_t>(16, 0));
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const std::vector<double> want =
          host_scatter_with(x, idx, u, dn, mode, [](double old, double) { return old * 2 + 1; });
      for (const Mesh& mesh : meshes) {
        for (const PartitionSpec& xs : {P(), layouts(x.shape(), mesh).back()}) {
          const std::string where = absl::StrCat("indices ", absl::StrJoin(iv, ","), " mode ", static_cast<int>(mode),
                                                 " mesh ", absl::StrJoin(mesh.shape(), "x"), " x ", xs.to_string());
          absl::StatusOr<std::vector<Array>> got = jit([&](const std::vector<Value>& in) {
            return std::vector<Value>{scatter_apply(in[0], in[1], twice_plus_one, dn, {16}, mode)};
          })({put_on(mesh, x, xs), put_on(mesh, idx, P())});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          const HostArray r = fetch((*got)[0]);
          for (size_t e = 0; e < want.size(); ++e) {
            ASSERT_EQ(r.element_as_double(static_cast<int64_t>(e)), want[e]) << where << " element " << e;
          }
        }
      }
    }
  }
}

// The scatters that combine, by name, with their combiner on the host: set first.
struct ScatterCombiner {
  const char* name;
  std::function<Value(const Value&, const Value&, const Value&, const ScatterDimensionNumbers&, GatherScatterMode)> op;
  std::function<double(double, double)> host;
};
std::vector<ScatterCombiner> scatter_combiners() {
  return {
      {"set", [](const auto&... a) { return scatter(a...); }, [](double, double v) { return v; }},
      {"add", [](const auto&... a) { return scatter_add(a...); }, [](double o, double v) { return o + v; }},
      {"sub", [](const auto&... a) { return scatter_sub(a...); }, [](double o, double v) { return o - v; }},
      {"mul", [](const auto&... a) { return scatter_mul(a...); }, [](double o, double v) { return o * v; }},
      {"min", [](const auto&... a) { return scatter_min(a...); }, [](double o, double v) { return std::min(o, v); }},
      {"max", [](const auto&... a) { return scatter_max(a...); }, [](double o, double v) { return std::max(o, v); }},
  };
}

// The errors: scatter_add / sub / mul refuse bool as JAX's do (they trace lax.add / sub / mul on
// the operand's dtype, and add_p, sub_p and mul_p take only _num dtypes in jax/_src/lax/lax.py:
// "mul does not accept dtype bool ..."), the one-axis scatter_add in the same words; scatter_apply's func must keep the
// operand's shape and dtype (XLA's update computation maps a scalar to one of the operand's
// type), and its windows are checked as a scatter's updates (update_shape in their place).
TEST_F(GatherTest, ScatterSubAndApplyErrors) {
  const ScatterDimensionNumbers dn{{}, {0}, {0}};
  auto status_of = [](const TracedFunction& f, std::vector<ArrayType> types) { return trace(f, types).status(); };
  for (const ScatterCombiner& comb : scatter_combiners()) {
    const std::string name = comb.name;
    if (name != "add" && name != "sub" && name != "mul") continue;
    const absl::Status refused = status_of(
        [&](const std::vector<Value>& in) {
          return std::vector<Value>{comb.op(in[0], in[1], in[2], dn, GatherScatterMode::kFillOrDrop)};
        },
        {ArrayType{DType::kBool, {4}}, ArrayType{DType::kI32, {2, 1}}, ArrayType{DType::kBool, {2}}});
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_THAT(std::string(refused.message()),
                HasSubstr(absl::StrCat("scatter_", name, ": ", name, " does not accept dtype bool")));
  }
  // The one-axis scatter_add (x.at[i].add) in the same words.
  const absl::Status one_axis =
      status_of([&](const std::vector<Value>& in) { return std::vector<Value>{scatter_add(in[0], in[1], in[2], 0)}; },
                {ArrayType{DType::kBool, {4}}, ArrayType{DType::kI32, {2}}, ArrayType{DType::kBool, {2}}});
  EXPECT_EQ(one_axis.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(one_axis.message()), HasSubstr("scatter_add"));
  EXPECT_THAT(std::string(one_axis.message()),
              HasSubstr(": add does not accept dtype bool; the operand needs a numeric dtype"));
  const absl::Status widened = status_of(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_apply(in[0], in[1], [](const Value& v) { return v * 0.5; }, dn, {2})};
      },
      {ArrayType{DType::kI32, {4}}, ArrayType{DType::kI32, {2, 1}}});
  EXPECT_EQ(widened.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(widened.message()), HasSubstr("scatter_apply: func must map each element to one of the "
                                                        "operand's dtype int32"));
  const absl::Status bad_window = status_of(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_apply(in[0], in[1], [](const Value& v) { return v; },
                                                ScatterDimensionNumbers{{1}, {0}, {0}}, {2, 6})};
      },
      {ArrayType{DType::kF32, {10, 5}}, ArrayType{DType::kI32, {2, 1}}});
  EXPECT_EQ(bad_window.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(bad_window.message()),
      HasSubstr("scatter_apply: Bounds of the window dimensions of updates must not exceed the bounds of the "
                "corresponding dimensions of operand. For dimension 1, updates bound is 6, operand bound is 5."));
}

// On Explicit axes a scatter whose batching dimension is split alike on the operand, the indices
// and the updates is what JAX's explicit-mode rule accepts (_scatter_spec_computation in
// jax/_src/lax/slicing.py; tests/pjit_test.py test_scatter_sharding_rule: vmap of
// x.at[i].set/add/mul/min/max(u) with operand (2, 10, 8) P('x', None, 'y') or P('x', None,
// None), indices P('x'), updates P('x', 'y') or P('x', None) on an Explicit (2, 2) mesh, whose
// result is laid out as the operand): one scatter per block, no collective, values as the host
// loop, and their gradients laid out as the operand and the updates. Then the same on the (4, 2) mesh with repeated and
// out-of-range indices in both modes, an operand split alone (the indices and updates resolve to its split, cut
// locally), and the layouts JAX refuses, with its message.
TEST_F(GatherTest, ExplicitScatterOnSplitBatchingDimsRunsBlockByBlock) {
  absl::StatusOr<Mesh> made = client_->make_mesh({2, 2}, {"x", "y"});
  ASSERT_TRUE(made.ok()) << made.status();
  const Mesh mesh = *made;
  // vmap(lambda x, i, u: x.at[i].op(u)): batching (0) / (0), inserted (1), window (2) <- (1).
  const ScatterDimensionNumbers dn{{1}, {1}, {1}, {0}, {0}};
  const std::vector<ScatterCombiner> combiners = scatter_combiners();
  const HostArray x = random_f32({2, 10, 8}, 91), u = random_f32({2, 8}, 92), idx = ints({2, 1}, {2, 3});
  const std::vector<std::pair<PartitionSpec, PartitionSpec>> specs = {{P("x", None, "y"), P("x", "y")},
                                                                      {P("x", None, None), P("x", None)}};
  for (const ScatterCombiner& comb : combiners) {
    const std::vector<double> want = host_scatter_with(x, idx, u, dn, IndexMode::kFillOrDrop, comb.host);
    for (const auto& [xs, us] : specs) {
      const std::string where = absl::StrCat(comb.name, " x ", xs.to_string(), " updates ", us.to_string());
      Jitted f = jit([&](const std::vector<Value>& in) {
        const Value r = comb.op(in[0], in[1], in[2], dn, GatherScatterMode::kFillOrDrop);
        return std::vector<Value>{r, full({}, type_of(r).spec == xs ? 1.0 : 0.0, DType::kI32)};
      });
      absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, xs), put_on(mesh, idx, P("x")), put_on(mesh, u, us)});
      ASSERT_TRUE(got.ok()) << where << ": " << got.status();
      expect_values(fetch((*got)[0]), {2, 10, 8}, want, where);
      EXPECT_EQ(fetch((*got)[1]), HostArray::from_vector<int32_t>({}, {1})) << where << ": result type";
      EXPECT_TRUE((*got)[0].sharding().is_equivalent_to(NamedSharding(mesh, xs), 3)) << where;
      for (const char* collective :
           {"all_gather", "all_reduce", "all_to_all", "collective_permute", "reduce_scatter"}) {
        EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr(collective))) << where << "\n" << f.as_text();
      }
      // As the JAX test: the gradients of the operand and the updates laid out as they are.
      absl::StatusOr<std::vector<Array>> grads = jit(grad(
          [&](const std::vector<Value>& in) {
            return std::vector<Value>{sum(comb.op(in[0], in[1], in[2], dn, GatherScatterMode::kFillOrDrop))};
          },
          {0, 2}))({put_on(mesh, x, xs), put_on(mesh, idx, P("x")), put_on(mesh, u, us)});
      ASSERT_TRUE(grads.ok()) << where << " grad: " << grads.status();
      EXPECT_TRUE((*grads)[0].sharding().is_equivalent_to(NamedSharding(mesh, xs), 3)) << where << " grad x";
      EXPECT_TRUE((*grads)[1].sharding().is_equivalent_to(NamedSharding(mesh, us), 2)) << where << " grad updates";
    }
  }
  // (8, 6, 4) on the (4, 2) mesh: rows 1-2 of each of the 8 batch entries, windows of 3 whole
  // columns split over 'model' alike, starts repeated and out of range.
  const ScatterDimensionNumbers rows{{2}, {1}, {1}, {0}, {0}};
  const HostArray big = random_f32({8, 6, 4}, 93), bu = random_f32({8, 3, 4}, 94);
  std::vector<int32_t> iv(8 * 3);
  for (size_t k = 0; k < iv.size(); ++k) iv[k] = static_cast<int32_t>((k * 5) % 9) - 1;  // [-1, 7], repeats
  const HostArray bidx = ints({8, 3, 1}, iv);
  for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
    for (const ScatterCombiner& comb : combiners) {
      if (std::string(comb.name) == "set") continue;  // repeated windows: XLA writes one of them
      const std::vector<double> want = host_scatter_with(big, bidx, bu, rows, mode, comb.host);
      const std::string where = absl::StrCat(comb.name, " (8, 6, 4) mode ", static_cast<int>(mode));
      Jitted f = jit(
          [&](const std::vector<Value>& in) { return std::vector<Value>{comb.op(in[0], in[1], in[2], rows, mode)}; });
      absl::StatusOr<std::vector<Array>> got =
          f({put(big, P("data", None, "model")), put(bidx, P("data")), put(bu, P("data", None, "model"))});
      ASSERT_TRUE(got.ok()) << where << ": " << got.status();
      expect_values(fetch((*got)[0]), {8, 6, 4}, want, where);
      EXPECT_TRUE((*got)[0].sharding().is_equivalent_to(NamedSharding(*mesh_, P("data", None, "model")), 3)) << where;
      for (const char* collective :
           {"all_gather", "all_reduce", "all_to_all", "collective_permute", "reduce_scatter"}) {
        EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr(collective))) << where << "\n" << f.as_text();
      }
    }
  }
  // Only the operand split on the batching dimension: JAX's _is_resolvable takes its split for
  // the indices and the updates, and the result is laid out as the operand.
  {
    const std::vector<double> want =
        host_scatter_with(big, bidx, bu, rows, IndexMode::kFillOrDrop, [](double o, double v) { return o + v; });
    absl::StatusOr<std::vector<Array>> got = jit([&](const std::vector<Value>& in) {
      return std::vector<Value>{scatter_add(in[0], in[1], in[2], rows)};
    })({put(big, P("data", None, None)), put(bidx, P()), put(bu, P())});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_values(fetch((*got)[0]), {8, 6, 4}, want, "operand split alone");
    EXPECT_TRUE((*got)[0].sharding().is_equivalent_to(NamedSharding(*mesh_, P("data", None, None)), 3));
  }
  // Refused as JAX refuses: the batching dimension split differently on the operand and the
  // indices (_is_resolvable), and a query dimension (neither batching nor window) of the indices
  // split (rule 4 of _scatter_spec_computation).
  struct Refused {
    const char* name;
    PartitionSpec x, i, u;
  };
  const std::vector<Refused> refused = {
      {"batching split over different axes", P("data", None, None), P("model"), P()},
  };
  for (const Refused& r : refused) {
    absl::StatusOr<std::vector<Array>> got = jit([&](const std::vector<Value>& in) {
      return std::vector<Value>{scatter_add(in[0], in[1], in[2], rows)};
    })({put(big, r.x), put(bidx, r.i), put(bu, r.u)});
    ASSERT_FALSE(got.ok()) << r.name;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << r.name;
    EXPECT_THAT(std::string(got.status().message()),
                HasSubstr("scatter_add: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec "
                          "for the scatter update as out sharding could not be resolved unambiguously (or would "
                          "require collectives on inputs)"))
        << r.name;
  }
  // Indices (8, 2, 1) with batching dimension 1 and the query dimension 0 split.
  absl::StatusOr<std::vector<Array>> query_split = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{scatter_add(in[0], in[1], in[2], ScatterDimensionNumbers{{}, {1}, {1}, {0}, {1}})};
  })({put(random_f32({2, 6}, 95), P("model", None)),
      put(ints({8, 2, 1}, std::vector<int32_t>(16, 1)), P("data", "model")),
      put(random_f32({8, 2}, 96), P(None, "model"))});
  ASSERT_FALSE(query_split.ok());
  EXPECT_THAT(std::string(query_split.status().message()),
              HasSubstr("scatter_add: Use `.at[...].set/add/mul/...(out_sharding=)`"));
}

// On Explicit axes a window of a whole dimension that the indices address (its only start is 0),
// split alike in the operand and the updates, is what JAX's explicit-mode rule accepts
// (_scatter_spec_computation in jax/_src/lax/slicing.py, rule 2: "Full slice dims must resolve
// unambiguously between `operand` and `updates`"), the result laid out as the operand; so is a
// gather's full slice of a split dimension (_gather_spec_computation: "the subset of dims in
// `start_index_map` where the slice size is not equal to the operand size" must be replicated),
// its result's offset dimension split as the operand's. Such a dimension is not folded into the
// linear index (a split there was refused by the fold's reshape before), so no data moves. Rows
// of a (4, 8) operand with starts (row, column): column 0 fits; 1, 5 and -1 clamp to 0 (clip) or
// drop / fill the window (fill); row 7 likewise; PROMISE_IN_BOUNDS drops those scatter windows
// and clamps those gathers, as XLA (JAX's GatherScatterMode docstring). Every combiner, the three
// modes, on the Explicit (8), (4, 2) and (2, 4) meshes; then the same window next to a split
// batching dimension.
TEST_F(GatherTest, ExplicitWholeWindowOnAnIndexedSplitDimension) {
  const ScatterDimensionNumbers dn{{1}, {0}, {0, 1}};
  const GatherDimensionNumbers gdn{{1}, {0}, {0, 1}};
  const HostArray x = random_f32({4, 8}, 101), u = random_f32({7, 8}, 102);
  const HostArray idx = ints({7, 2}, {0, 0, 2, 0, 2, 0, 3, 1, 7, 0, 1, 5, 2, -1});
  std::vector<ScatterCombiner> combiners = scatter_combiners();
  combiners.erase(combiners.begin());  // set: repeated windows write one of them (XLA); below alone
  // scatter (set) with unique targets: rows 0 and 3 (3 only when its start clamps).
  const HostArray set_idx = ints({2, 2}, {0, 0, 3, 1}), set_u = random_f32({2, 8}, 103);
  std::vector<Mesh> meshes;
  for (const Shape& shape : std::vector<Shape>{{8}, {4, 2}, {2, 4}}) {
    absl::StatusOr<Mesh> m =
        shape.size() == 1 ? client_->make_mesh(shape, {"b"}) : client_->make_mesh(shape, {"a", "b"});
    ASSERT_TRUE(m.ok()) << m.status();
    meshes.push_back(*m);
  }
  for (const Mesh& mesh : meshes) {
    const PartitionSpec split = P(None, "b");
    for (GatherScatterMode mode :
         {GatherScatterMode::kClip, GatherScatterMode::kFillOrDrop, GatherScatterMode::kPromiseInBounds}) {
      const IndexMode scatter_host = mode == GatherScatterMode::kClip ? IndexMode::kClip : IndexMode::kFillOrDrop;
      const IndexMode gather_host = mode == GatherScatterMode::kFillOrDrop ? IndexMode::kFillOrDrop : IndexMode::kClip;
      const std::string where =
          absl::StrCat("mesh ", absl::StrJoin(mesh.shape(), "x"), " mode ", static_cast<int>(mode));
      Jitted f = jit([&](const std::vector<Value>& in) {
        std::vector<Value> out;
        for (const ScatterCombiner& c : combiners) out.push_back(c.op(in[0], in[1], in[2], dn, mode));
        out.push_back(scatter(in[0], in[3], in[4], dn, mode));
        out.push_back(gather(in[0], in[1], gdn, {1, 8}, mode));
        return out;
      });
      absl::StatusOr<std::vector<Array>> got =
          f({put_on(mesh, x, split), put_on(mesh, idx, P()), put_on(mesh, u, split), put_on(mesh, set_idx, P()),
             put_on(mesh, set_u, split)});
      ASSERT_TRUE(got.ok()) << where << ": " << got.status();
      for (size_t k = 0; k < combiners.size(); ++k) {
        const std::string at = absl::StrCat(combiners[k].name, " ", where);
        expect_values(fetch((*got)[k]), {4, 8}, host_scatter_with(x, idx, u, dn, scatter_host, combiners[k].host), at);
        EXPECT_TRUE((*got)[k].sharding().is_equivalent_to(NamedSharding(mesh, split), 2)) << at;
      }
      expect_values(fetch((*got)[5]), {4, 8},
                    host_scatter_with(x, set_idx, set_u, dn, scatter_host, [](double, double v) { return v; }),
                    absl::StrCat("set ", where));
      EXPECT_TRUE((*got)[5].sharding().is_equivalent_to(NamedSharding(mesh, split), 2)) << "set " << where;
      Shape gs;
      const std::vector<double> want_g =
          host_gather(x, idx, gdn, {1, 8}, gather_host, std::numeric_limits<double>::quiet_NaN(), &gs);
      expect_values(fetch((*got)[6]), gs, want_g, absl::StrCat("gather ", where));
      EXPECT_TRUE((*got)[6].sharding().is_equivalent_to(NamedSharding(mesh, split), 2)) << "gather " << where;
      for (const char* collective : {"all_gather", "all_to_all", "collective_permute"}) {
        EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr(collective))) << where << "\n" << f.as_text();
      }
    }
  }
  // With a batching dimension split over 'a' (vmap of the rows above: (4, 4, 8), the batch
  // first), indices and updates split alike on it, the window split over 'b' in both.
  const ScatterDimensionNumbers bdn{{2}, {1}, {1, 2}, {0}, {0}};
  const HostArray bx = random_f32({4, 4, 8}, 104), bu = random_f32({4, 3, 8}, 105);
  const HostArray bidx = ints({4, 3, 2}, {0, 0, 2, 0, 2, 0, 3, 1, 7, 0, 1, 0, 1, 5, 1, 0, 0, 0, 3, 0, 3, 0, -1, 0});
  for (size_t m = 1; m < meshes.size(); ++m) {
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const std::string where =
          absl::StrCat("batched mesh ", absl::StrJoin(meshes[m].shape(), "x"), " mode ", static_cast<int>(mode));
      absl::StatusOr<std::vector<Array>> got = jit([&](const std::vector<Value>& in) {
        return std::vector<Value>{scatter_add(in[0], in[1], in[2], bdn, mode)};
      })({put_on(meshes[m], bx, P("a", None, "b")), put_on(meshes[m], bidx, P("a")),
          put_on(meshes[m], bu, P("a", None, "b"))});
      ASSERT_TRUE(got.ok()) << where << ": " << got.status();
      expect_values(fetch((*got)[0]), {4, 4, 8},
                    host_scatter_with(bx, bidx, bu, bdn, mode, [](double o, double v) { return o + v; }), where);
      EXPECT_TRUE((*got)[0].sharding().is_equivalent_to(NamedSharding(meshes[m], P("a", None, "b")), 3)) << where;
    }
  }
}

// x[i, j] and x.at[i, j].<every combiner> (lax.gather and the scatters with point windows) on an
// (8, 8) operand split P('b', None) on an Explicit (8) mesh: the sliced dimension 0 is split, so
// JAX's explicit-mode rules refuse them (jax/_src/lax/slicing.py _gather_sharding_rule,
// _scatter_sharding_rule: "Use `.at[...].get(out_sharding=)` ..." / "Use
// `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec ..."), and so does
// Tessera, with JAX's text naming the op and the operands' types (in Tessera's notation, where
// JAX prints ShapedArray(float32[8@b,8])), not the words of the reshape
// folding the indexed dimensions (which refused them before), nor an exception (the combiner
// once built its scan on the refused fold's empty shape and threw std::length_error).
TEST_F(GatherTest, ExplicitSplitSlicedDimensionIsRefusedWithJaxsAdvice) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({8}, {"b"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const ScatterDimensionNumbers dn{{}, {0, 1}, {0, 1}};
  const HostArray x = random_f32({8, 8}, 106), u = random_f32({3}, 107), idx = ints({3, 2}, {0, 1, 4, 5, 0, 2});
  std::vector<ScatterCombiner> combiners = scatter_combiners();
  auto refusal = [&](const TracedFunction& f) {
    absl::StatusOr<std::vector<Array>> got =
        jit(f)({put_on(*mesh, x, P("b", None)), put_on(*mesh, idx, P()), put_on(*mesh, u, P())});
    return got.ok() ? absl::OkStatus() : got.status();
  };
  for (const ScatterCombiner& comb : combiners) {
    const absl::Status refused = refusal([&](const std::vector<Value>& in) {
      return std::vector<Value>{comb.op(in[0], in[1], in[2], dn, GatherScatterMode::kFillOrDrop)};
    });
    ASSERT_FALSE(refused.ok()) << comb.name;
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << comb.name << ": " << refused;
    EXPECT_THAT(
        std::string(refused.message()),
        HasSubstr(absl::StrCat(std::string(comb.name) == "set" ? "scatter" : absl::StrCat("scatter_", comb.name),
                               ": Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec "
                               "for the scatter update as out sharding could not be resolved unambiguously (or "
                               "would require collectives on inputs). Got operand=f32[8@b,8], indices=i32[3,2], "
                               "updates=f32[3]")))
        << refused;
    EXPECT_THAT(std::string(refused.message()), ::testing::Not(HasSubstr("reshape"))) << refused;
  }
  const absl::Status gathered = refusal([&](const std::vector<Value>& in) {
    return std::vector<Value>{gather(in[0], in[1], GatherDimensionNumbers{{}, {0, 1}, {0, 1}}, {1, 1})};
  });
  EXPECT_EQ(gathered.code(), absl::StatusCode::kInvalidArgument) << gathered;
  EXPECT_THAT(std::string(gathered.message()),
              HasSubstr("gather: Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather "
                        "indexing as out sharding could not be resolved unambiguously (or would require collectives on "
                        "inputs). Got operand=f32[8@b,8], indices=i32[3,2]"))
      << gathered;
  EXPECT_THAT(std::string(gathered.message()), ::testing::Not(HasSubstr("reshape"))) << gathered;
}

// x.at[i].apply(f) (lax.scatter_apply) with x split on a window dimension, the placeholder
// updates unsplit: JAX binds scatter_p on x, the indices and lax.full(update_shape, 0, x.dtype)
// (jax/_src/lax/slicing.py scatter_apply), so _scatter_sharding_rule refuses it naming x's type
// (a window dimension split on the operand only). Tessera checks that layout before building its
// int32 count scatter, so the refusal names x and scatter_apply, not the counts (it printed
// operand=i32[8,8@b] ... updates=i32[2,8] for this f32 x).
TEST_F(GatherTest, ExplicitScatterApplyRefusalNamesTheOperand) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({8}, {"b"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const ScatterDimensionNumbers rows{{1}, {0}, {0}};
  absl::StatusOr<std::vector<Array>> got = jit([&](const std::vector<Value>& in) {
    return std::vector<Value>{scatter_apply(in[0], in[1], [](const Value& v) { return v * 2.0; }, rows, {2, 8})};
  })({put_on(*mesh, random_f32({8, 8}, 108), P(None, "b")), put_on(*mesh, ints({2, 1}, {1, 5}), P())});
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  EXPECT_THAT(std::string(got.status().message()),
              HasSubstr("scatter_apply: Use `.at[...].set/add/mul/...(out_sharding=)` to provide output PartitionSpec "
                        "for the scatter update as out sharding could not be resolved unambiguously (or would require "
                        "collectives on inputs). Got operand=f32[8,8@b], indices=i32[2,1], updates=f32[2,8]"))
      << got.status();
  EXPECT_THAT(std::string(got.status().message()), ::testing::Not(HasSubstr("i32[8,8"))) << got.status();
}

// vmap of scatter_apply (per-example indices: its cond's predicate is batched): each example as
// the host loop on it, func applied once per window, so twice or three times where examples
// repeat an index, and the out-of-range index 9 dropped.
TEST_F(GatherTest, VmapOfScatterApplyMatchesPerExampleHostLoops) {
  const ScatterDimensionNumbers dn{{}, {0}, {0}};
  const HostArray x = random_f32({4, 6}, 97), unused = random_f32({3}, 98);
  const HostArray idx = ints({4, 3, 1}, {0, 0, 1, 2, 3, 4, 5, 5, 5, 1, 9, 2});
  absl::StatusOr<std::vector<Array>> got = jit(vmap([&](const std::vector<Value>& in) {
    return std::vector<Value>{scatter_apply(in[0], in[1], [](const Value& v) { return v * 2.0 + 1.0; }, dn, {3})};
  }))({put_on(*auto_mesh_, x, P("data", None)), put_on(*auto_mesh_, idx, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  const HostArray r = fetch((*got)[0]);
  for (int64_t b = 0; b < 4; ++b) {
    const std::vector<double> want =
        host_scatter_with(example(x, b), example(idx, b), unused, dn, IndexMode::kFillOrDrop,
                          [](double old, double) { return old * 2.0 + 1.0; });
    expect_values(example(r, b), {6}, want, absl::StrCat("example ", b));
  }
}

// A batched_take form (lax_gather.cc: the one-axis op with batch_dims) in an unusual layout, or
// one it must leave to the general path. The operand is (8, 6, 2): a batching dimension of 8
// (split on every mesh), T = 6 indexed, D = 2 taken whole.
struct BatchedTakeCase {
  std::string name;
  HostArray idx;  // (8, 4, k)
  GatherDimensionNumbers gather_dn;
  Dims slice_sizes;
  Shape updates;  // the matching scatter's updates
  ScatterDimensionNumbers scatter_dn;
  bool fill_takes_the_one_axis_op;  // clip mode always does
};

// Positions along T per (example, query) in [-1, 6] (-1 and 6 out of range), distinct per example;
// with `whole`, first a start along D that is 0, 1 or 2 (only 0 is in range for D's window of 2).
HostArray batched_take_indices(bool whole) {
  std::vector<int32_t> v;
  for (int32_t b = 0; b < 8; ++b) {
    for (int32_t q = 0; q < 4; ++q) {
      if (whole) v.push_back((b + q) % 3);
      v.push_back((b * 5 + q * 3) % 8 - 1);
    }
  }
  return ints({8, 4, whole ? 2 : 1}, v);
}

std::vector<BatchedTakeCase> batched_take_cases() {
  std::vector<BatchedTakeCase> out;
  // The window of D before the queries' dimension: result (8, 2, 4).
  out.push_back({"window_before_queries",
                 batched_take_indices(false),
                 {{1}, {1}, {1}, {0}, {0}},
                 {1, 1, 2},
                 {8, 2, 4},
                 {{1}, {1}, {1}, {0}, {0}},
                 true});
  // The window first, before the batching dimension too: result (2, 8, 4).
  out.push_back({"window_first",
                 batched_take_indices(false),
                 {{0}, {1}, {1}, {0}, {0}},
                 {1, 1, 2},
                 {2, 8, 4},
                 {{0}, {1}, {1}, {0}, {0}},
                 true});
  // T's window of 1 not collapsed, a dimension of the result after the queries' (the
  // one-axis op's result has it before them): result (8, 4, 1, 2).
  out.push_back({"kept_window_after_queries",
                 batched_take_indices(false),
                 {{2, 3}, {}, {1}, {0}, {0}},
                 {1, 1, 2},
                 {8, 4, 1, 2},
                 {{2, 3}, {}, {1}, {0}, {0}},
                 true});
  // D also in start_index_map, first, and taken whole: clip clamps its start to 0 (the
  // one-axis op reads component 1 for T); fill mode must check that start is 0, so it takes
  // the general path (a nonzero start fills the whole slice, drops the whole window).
  out.push_back({"whole_mapped_dimension",
                 batched_take_indices(true),
                 {{2}, {1}, {2, 1}, {0}, {0}},
                 {1, 1, 2},
                 {8, 4, 2},
                 {{2}, {1}, {2, 1}, {0}, {0}},
                 false});
  return out;
}

// Whether the graph holds a gather / scatter / scatter_add with batch dimensions (the one-axis
// op that batched_take lowers onto).
bool has_batched_one_axis_op(const Graph& g) {
  for (int id = 0; id < g.size(); ++id) {
    const Node& n = g.node(id);
    if ((n.op == Op::kGather || n.op == Op::kScatter || n.op == Op::kScatterAdd) &&
        n.attrs<GatherAttrs>().batch_dims > 0) {
      return true;
    }
  }
  return false;
}

// batched_take's layouts against the host loops over XLA's semantics, gather, scatter_add,
// scatter_sub and scatter (set; the positions are distinct per example in fill mode), in clip and
// fill mode, on the Auto meshes (8), (4, 2) and (2, 4) with the operand, the indices and the
// updates each replicated or split, and the path each takes: the one-axis op with batch_dims, or
// (a whole mapped dimension in fill mode) the general folded path, whose values then show the
// nonzero starts filled or dropped.
TEST_F(GatherTest, BatchedTakeLayoutsMatchHostLoopsOnEveryMesh) {
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  const std::vector<Mesh> meshes = {*flat, auto_mesh({4, 2}), auto_mesh({2, 4})};
  const Shape xs = {8, 6, 2};
  const HostArray x = random_f32(xs, 91);
  for (const BatchedTakeCase& c : batched_take_cases()) {
    const HostArray u = random_f32(c.updates, 92);
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const GatherScatterMode gmode =
          mode == IndexMode::kClip ? GatherScatterMode::kClip : GatherScatterMode::kFillOrDrop;
      Shape gather_shape;
      const std::vector<double> want_gather =
          host_gather(x, c.idx, c.gather_dn, c.slice_sizes, mode, -5.0, &gather_shape);
      const std::vector<double> want_add = host_scatter(x, c.idx, u, c.scatter_dn, mode, true);
      const std::vector<double> want_sub =
          host_scatter_with(x, c.idx, u, c.scatter_dn, mode, [](double old, double v) { return old - v; });
      const std::vector<double> want_set = host_scatter(x, c.idx, u, c.scatter_dn, mode, false);
      const bool set = mode == IndexMode::kFillOrDrop;  // clipped positions may repeat
      using Op3 = std::function<Value(const Value& x, const Value& idx, const Value& u)>;
      std::vector<Op3> ops = {
          [&](const Value& x, const Value& idx, const Value&) {
            return gather(x, idx, c.gather_dn, c.slice_sizes, gmode,
                          mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(Scalar(-5.0)) : std::nullopt);
          },
          [&](const Value& x, const Value& idx, const Value& u) { return scatter_add(x, idx, u, c.scatter_dn, gmode); },
          [&](const Value& x, const Value& idx, const Value& u) { return scatter_sub(x, idx, u, c.scatter_dn, gmode); },
      };
      if (set) {
        ops.push_back(
            [&](const Value& x, const Value& idx, const Value& u) { return scatter(x, idx, u, c.scatter_dn, gmode); });
      }
      const TracedFunction f = [&](const std::vector<Value>& in) {
        std::vector<Value> out;
        for (const Op3& op : ops) out.push_back(op(in[0], in[1], in[2]));
        return out;
      };
      const std::string what = absl::StrCat(c.name, " mode ", static_cast<int>(mode));
      const bool one_axis = mode == IndexMode::kClip || c.fill_takes_the_one_axis_op;
      // Each op on its own: which path it takes.
      const std::vector<ArrayType> types = {{DType::kF32, xs}, {DType::kI32, c.idx.shape()}, {DType::kF32, c.updates}};
      for (size_t k = 0; k < ops.size(); ++k) {
        absl::StatusOr<Graph> g =
            trace([&](const std::vector<Value>& in) { return std::vector<Value>{ops[k](in[0], in[1], in[2])}; }, types);
        ASSERT_TRUE(g.ok()) << what << ": " << g.status();
        EXPECT_EQ(has_batched_one_axis_op(*g), one_axis) << what << " op " << k << "\n" << g->to_text();
      }
      for (const Mesh& mesh : meshes) {
        const std::vector<PartitionSpec> x_layouts = layouts(xs, mesh), idx_layouts = layouts(c.idx.shape(), mesh),
                                         u_layouts = layouts(c.updates, mesh);
        for (size_t i = 0; i < x_layouts.size(); ++i) {
          const PartitionSpec &xl = x_layouts[i], &il = idx_layouts[i % idx_layouts.size()],
                              &ul = u_layouts[(i + 1) % u_layouts.size()];
          const std::string where =
              absl::StrCat(what, " mesh ", absl::StrJoin(mesh.shape(), "x"), " x ", xl.to_string(), " indices ",
                           il.to_string(), " updates ", ul.to_string());
          absl::StatusOr<std::vector<Array>> got =
              jit(f)({put_on(mesh, x, xl), put_on(mesh, c.idx, il), put_on(mesh, u, ul)});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          expect_values(fetch((*got)[0]), gather_shape, want_gather, absl::StrCat("gather ", where));
          expect_values(fetch((*got)[1]), xs, want_add, absl::StrCat("scatter_add ", where));
          expect_values(fetch((*got)[2]), xs, want_sub, absl::StrCat("scatter_sub ", where));
          if (set) expect_values(fetch((*got)[3]), xs, want_set, absl::StrCat("scatter ", where));
        }
      }
    }
  }
}

// The vocabulary-parallel lookup with batch dimensions: a per-example cache x (8, 8, 8, 2) split
// over 'a' along the dimension it is read along (P(None, None, 'a', None)), gathered with
// batch_dims 1 (positions (8, 3)) or 2 (positions (8, 8, 3)) along that dimension, fill and clip
// mode (positions -2..9 of 8: some out of range). Each device reads only the positions in its
// block (fill 0 elsewhere) and one all_reduce over 'a' (psum) adds the blocks: no all_gather of
// x (rules_indexing.cc, partition_gather). On the Auto meshes (8), (4, 2) and (2, 4), the
// positions replicated or (two axes) their batch over 'b', which x's batch then follows with no
// collective. Values are the host loop's.
TEST_F(GatherTest, VocabularyParallelGatherWithBatchDimsIsALocalLookupAndOnePsum) {
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  const std::vector<Mesh> meshes = {*flat, auto_mesh({4, 2}), auto_mesh({2, 4})};
  constexpr int64_t kN = 8, kH = 8, kT = 8, kD = 2, kQ = 3;
  const HostArray x = random_f32({kN, kH, kT, kD}, 93);
  for (int64_t batch_dims : {1, 2}) {
    const Shape is = batch_dims == 1 ? Shape{kN, kQ} : Shape{kN, kH, kQ};
    std::vector<int32_t> pv(num_elements(is));
    for (size_t i = 0; i < pv.size(); ++i) pv[i] = static_cast<int32_t>((i * 5) % 12) - 2;
    const HostArray positions = ints(is, pv);
    for (IndexMode mode : {IndexMode::kFillOrDrop, IndexMode::kClip}) {
      // out[n, h, q, d] = x[n, h, p[n, (h,) q], d]
      std::vector<double> want;
      for (int64_t n = 0; n < kN; ++n) {
        for (int64_t h = 0; h < kH; ++h) {
          for (int64_t q = 0; q < kQ; ++q) {
            int64_t t = pv[batch_dims == 1 ? n * kQ + q : (n * kH + h) * kQ + q];
            if (mode == IndexMode::kClip) t = std::clamp<int64_t>(t, 0, kT - 1);
            for (int64_t d = 0; d < kD; ++d) {
              want.push_back(t < 0 || t >= kT ? -3.0 : x.values<float>()[((n * kH + h) * kT + t) * kD + d]);
            }
          }
        }
      }
      const GatherAttrs attrs{2, mode, mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(-3.0) : std::nullopt,
                              batch_dims};
      for (const Mesh& mesh : meshes) {
        std::vector<PartitionSpec> position_specs = {P()};
        if (mesh.axis_names().size() == 2) {
          std::vector<Axes> spec(is.size());
          spec[0] = {"b"};
          position_specs.push_back(PartitionSpec(spec));
        }
        for (const PartitionSpec& ps : position_specs) {
          const std::string where = absl::StrCat("batch_dims ", batch_dims, " mode ", static_cast<int>(mode), " mesh ",
                                                 absl::StrJoin(mesh.shape(), "x"), " positions ", ps.to_string());
          Jitted f =
              jit([&attrs](const std::vector<Value>& in) { return std::vector<Value>{gather(in[0], in[1], attrs)}; });
          absl::StatusOr<std::vector<Array>> got =
              f({put_on(mesh, x, P(None, None, "a", None)), put_on(mesh, positions, ps)});
          ASSERT_TRUE(got.ok()) << where << ": " << got.status();
          expect_values(fetch((*got)[0]), {kN, kH, kQ, kD}, want, where);
          const std::string plan = f.as_text();
          EXPECT_EQ(jit_support::all_reduce_count(plan), 1u) << where << "\n" << plan;
          EXPECT_THAT(plan, HasSubstr("all_reduce(sum, axes=('a',))")) << where << "\n" << plan;
          for (const char* moves : {"all_gather", "all_to_all", "collective_permute", "reduce_scatter"}) {
            EXPECT_THAT(plan, ::testing::Not(HasSubstr(moves))) << where << "\n" << plan;
          }
        }
      }
    }
  }
}

// A cache x (N, H, T, D) = (4, 3, 6, 2) read along T by the one-axis gather with batch
// dimensions (GatherAttrs axis 2; batch_dims 1: positions (N, Q), batch_dims 2: (N, H, Q)) at Q = 5
// positions, on the host, in clip or fill mode, with the fill value 0.
struct CacheRead {
  static constexpr int64_t kN = 4, kH = 3, kT = 6, kD = 2, kQ = 5;
  int64_t batch_dims;
  IndexMode mode;

  Shape positions_shape() const { return batch_dims == 1 ? Shape{kN, kQ} : Shape{kN, kH, kQ}; }
  // The element of x read by result element (n, h, q, d) at positions `p`, or -1 (filled / dropped).
  int64_t source(const int32_t* p, int64_t n, int64_t h, int64_t q, int64_t d) const {
    int64_t t = p[batch_dims == 1 ? n * kQ + q : (n * kH + h) * kQ + q];
    if (mode == IndexMode::kClip) t = std::clamp<int64_t>(t, 0, kT - 1);
    return t < 0 || t >= kT ? -1 : ((n * kH + h) * kT + t) * kD + d;
  }
  // visit(r, source(...)) for each element r of the result (N, H, Q, D), in order.
  void for_each_result(const int32_t* p, const std::function<void(int64_t r, int64_t s)>& visit) const {
    for (int64_t n = 0, r = 0; n < kN; ++n)
      for (int64_t h = 0; h < kH; ++h)
        for (int64_t q = 0; q < kQ; ++q)
          for (int64_t d = 0; d < kD; ++d, ++r) visit(r, source(p, n, h, q, d));
  }
  // sum(gather(x, p)^2 * w) on the host in float32.
  float quadratic(const float* x, const int32_t* p, const float* w) const {
    float total = 0;
    for_each_result(p, [&](int64_t r, int64_t s) {
      const float g = s < 0 ? 0.0f : x[s];
      total += g * g * w[r];
    });
    return total;
  }
  // Its cotangent 2 x w summed over the result elements that read each element of x, added to `dx`.
  void add_quadratic_cotangent(const float* x, const int32_t* p, const float* w, double* dx) const {
    for_each_result(p, [&](int64_t r, int64_t s) {
      if (s >= 0) dx[s] += 2.0 * x[s] * w[r];
    });
  }
  // sum(gather(x, p)^2 * w) traced, of inputs (x, p, w).
  TracedFunction traced_quadratic() const {
    const GatherAttrs attrs{2, mode, mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(0.0) : std::nullopt,
                            batch_dims};
    return [attrs](const std::vector<Value>& in) {
      const Value g = gather(in[0], in[1], attrs);
      return std::vector<Value>{sum(g * g * in[2])};
    };
  }
};

// The central differences (h(at + eps e_i) - h(at - eps e_i)) / 2 eps of a host function, for
// each element i of `at`.
std::vector<double> central_differences(const std::function<float(const std::vector<float>&)>& h,
                                        const std::vector<float>& at, float eps) {
  std::vector<double> out(at.size());
  for (size_t i = 0; i < at.size(); ++i) {
    std::vector<float> up = at, down = at;
    up[i] += eps;
    down[i] -= eps;
    out[i] = (static_cast<double>(h(up)) - h(down)) / (2.0 * eps);
  }
  return out;
}

// a + step * direction, element by element (float32 arrays of one shape).
HostArray shifted(const HostArray& a, const HostArray& direction, float step) {
  HostArray out(DType::kF32, a.shape());
  for (int64_t i = 0; i < a.size(); ++i) {
    out.mutable_values<float>()[i] = a.values<float>()[i] + step * direction.values<float>()[i];
  }
  return out;
}

// The host's reference for V examples of a float32 function f(v, x) of x (f_v) with its cotangent:
// each example's value at x, its gradient at x (x shared) and at x_v (x mapped: the v-th of xs),
// their sum over the examples at x, and the central differences (eps) of each.
struct PerExampleGradients {
  std::vector<double> values, shared, mapped, total, shared_cd, mapped_cd, total_cd;
};
PerExampleGradients per_example_gradients(int64_t examples, const HostArray& x, const HostArray& xs,
                                          const std::function<float(int64_t v, const float* at)>& f,
                                          const std::function<void(int64_t v, const float* at, double* dx)>& cotangent,
                                          float eps) {
  const int64_t n = x.size();
  const std::vector<float> x0(x.values<float>().begin(), x.values<float>().end());
  PerExampleGradients want;
  want.values.resize(examples);
  want.shared.assign(examples * n, 0.0);
  want.mapped.assign(examples * n, 0.0);
  want.total.assign(n, 0.0);
  for (int64_t v = 0; v < examples; ++v) {
    const HostArray mapped = example(xs, v);
    const std::vector<float> xv(mapped.values<float>().begin(), mapped.values<float>().end());
    want.values[v] = f(v, x0.data());
    cotangent(v, x0.data(), want.shared.data() + v * n);
    cotangent(v, xv.data(), want.mapped.data() + v * n);
    cotangent(v, x0.data(), want.total.data());
    auto f_v = [&](const std::vector<float>& at) { return f(v, at.data()); };
    const std::vector<double> at_x = central_differences(f_v, x0, eps), at_xv = central_differences(f_v, xv, eps);
    want.shared_cd.insert(want.shared_cd.end(), at_x.begin(), at_x.end());
    want.mapped_cd.insert(want.mapped_cd.end(), at_xv.begin(), at_xv.end());
  }
  want.total_cd = central_differences(
      [&](const std::vector<float>& at) {
        float sum_v = 0;
        for (int64_t v = 0; v < examples; ++v) sum_v += f(v, at.data());
        return sum_v;
      },
      x0, eps);
  return want;
}

// vmap and grad of f(x, p, w) (p and w mapped; x shared, or mapped as xs): the examples' values
// with x shared and mapped, (a) grad(sum(vmap(f))) with x shared, (b) vmap(grad(f)) with x shared,
// (c) vmap(grad(f)) with x mapped.
struct VmapGrads {
  explicit VmapGrads(const TracedFunction& f)
      : per_example(vmap(f, {std::nullopt, 0, 0})),
        values_shared(jit(per_example)),
        values_mapped(jit(vmap(f))),
        grad_of_sum(
            jit(grad([pe = per_example](const std::vector<Value>& in) { return std::vector<Value>{sum(pe(in)[0])}; }))),
        grads_shared(jit(vmap(grad(f), {std::nullopt, 0, 0}))),
        grads_mapped(jit(vmap(grad(f)))) {}
  // The values and (a), (b), (c) run on x (or xs), p, w against `want`: within 1e-4 of the host's
  // values and cotangents, within 1e-2 of its central differences. The gradients as fetched in
  // (a), (b), (c).
  void check(const PerExampleGradients& want, const Array& x, const Array& xs, const Array& p, const Array& w,
             const std::string& at, HostArray* a, HostArray* b, HostArray* c) {
    const Shape x_shape = x.shape(), xs_shape = xs.shape();
    absl::StatusOr<std::vector<Array>> got = values_shared({x, p, w});
    ASSERT_TRUE(got.ok()) << at << ": " << got.status();
    expect_values(*(*got)[0].fetch(), {xs_shape[0]}, want.values, absl::StrCat("f_v ", at), 1e-4);
    const std::vector<std::pair<Jitted*, std::vector<Array>>> runs = {
        {&grad_of_sum, {x, p, w}}, {&grads_shared, {x, p, w}}, {&grads_mapped, {xs, p, w}}};
    const std::vector<const std::vector<double>*> host = {&want.total, &want.shared, &want.mapped},
                                                  central = {&want.total_cd, &want.shared_cd, &want.mapped_cd};
    const std::vector<HostArray*> out = {a, b, c};
    for (size_t k = 0; k < runs.size(); ++k) {
      const std::string what = absl::StrCat("(", std::string(1, static_cast<char>('a' + k)), ") ");
      got = (*runs[k].first)(runs[k].second);
      ASSERT_TRUE(got.ok()) << what << at << ": " << got.status();
      absl::StatusOr<HostArray> g = (*got)[0].fetch();
      ASSERT_TRUE(g.ok()) << what << at << ": " << g.status();
      const Shape& shape = k == 0 ? x_shape : xs_shape;
      expect_values(*g, shape, *host[k], absl::StrCat(what, "host cotangent ", at), 1e-4);
      expect_values(*g, shape, *central[k], absl::StrCat(what, "central differences ", at), 1e-2);
      *out[k] = *std::move(g);
    }
  }
  TracedFunction per_example;
  Jitted values_shared, values_mapped, grad_of_sum, grads_shared, grads_mapped;
};

// The gradients of the one-axis gather and scatter_add with batch dimensions (GatherAttrs
// batch_dims 1 and 2 on a cache x (N, H, T, D) = (4, 3, 6, 2) read / written along T at 5
// positions per example (per example and head), repeats and out-of-range ones included), clip and
// fill mode: f(x) = sum(gather(x)^2 * w) and g(x, u) = sum(scatter_add(x, u)^2 * w), against the
// host's analytic cotangent (d/dx f: 2 x w summed over the positions that read x, clamped or
// dropped as the mode says; d/dx g = 2 y w, d/du g = 2 y w read back at the positions) and
// against central differences of the host's float32 f and g, element by element (eps 1e-2 on a
// quadratic: exact but for float32 rounding, within 1e-2). And, as JAX's check_grads
// (jax/_src/public_test_util.py, numerical_jvp), along two random directions v the jitted
// function's own central difference (f(x + eps v) - f(x - eps v)) / 2 eps matches <grad, v>.
// Jitted on the (4, 2) Auto mesh with the batch replicated and split over 'data'.
TEST_F(GatherTest, BatchDimsGradientsMatchCentralDifferencesAndTheHostCotangent) {
  constexpr int64_t kN = CacheRead::kN, kH = CacheRead::kH, kT = CacheRead::kT, kD = CacheRead::kD, kQ = CacheRead::kQ;
  constexpr float kEps = 1e-2f;
  const HostArray x = random_f32({kN, kH, kT, kD}, 94);
  for (int64_t batch_dims : {1, 2}) {
    const Shape is = CacheRead{batch_dims, IndexMode::kClip}.positions_shape();
    std::vector<int32_t> pv(num_elements(is));
    for (size_t i = 0; i < pv.size(); ++i) pv[i] = static_cast<int32_t>((i * 7) % 9) - 1;  // -1..7 of 6; repeats
    const HostArray positions = ints(is, pv);
    const Shape rs = {kN, kH, kQ, kD};
    const HostArray w = random_f32(rs, 95), wx = random_f32(x.shape(), 96), u = random_f32(rs, 97);
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const std::string where = absl::StrCat("batch_dims ", batch_dims, " mode ", static_cast<int>(mode));
      const CacheRead read{batch_dims, mode};
      const float* wv = w.values<float>().data();
      const float* wxv = wx.values<float>().data();
      const float* uv = u.values<float>().data();
      // The host's float32 f and g (the fill value 0).
      auto host_f = [&](const std::vector<float>& xv) { return read.quadratic(xv.data(), pv.data(), wv); };
      auto scattered = [&](const std::vector<float>& xv, const std::vector<float>& us) {
        std::vector<float> y = xv;
        read.for_each_result(pv.data(), [&](int64_t r, int64_t s) {
          if (s >= 0) y[s] += us[r];
        });
        return y;
      };
      auto host_g = [&](const std::vector<float>& xv, const std::vector<float>& us) {
        const std::vector<float> y = scattered(xv, us);
        float total = 0;
        for (size_t i = 0; i < y.size(); ++i) total += y[i] * y[i] * wxv[i];
        return total;
      };
      const std::vector<float> x0(x.values<float>().begin(), x.values<float>().end()), u0(uv, uv + u.size());
      // Analytic cotangents.
      std::vector<double> df(x.size(), 0.0), dgx(x.size()), dgu(u.size(), 0.0);
      read.add_quadratic_cotangent(x0.data(), pv.data(), wv, df.data());
      const std::vector<float> y0 = scattered(x0, u0);
      for (size_t i = 0; i < dgx.size(); ++i) dgx[i] = 2.0 * y0[i] * wxv[i];
      read.for_each_result(pv.data(), [&](int64_t r, int64_t s) {
        if (s >= 0) dgu[r] = dgx[s];
      });
      // Central differences of the host's float32 functions, element by element.
      const std::vector<double> cf = central_differences(host_f, x0, kEps);
      const std::vector<double> cgx =
          central_differences([&](const std::vector<float>& xv) { return host_g(xv, u0); }, x0, kEps);
      const std::vector<double> cgu =
          central_differences([&](const std::vector<float>& us) { return host_g(x0, us); }, u0, kEps);
      for (size_t i = 0; i < df.size(); ++i) {
        ASSERT_NEAR(cf[i], df[i], 1e-2 * (1 + std::abs(df[i]))) << where << " host f element " << i;
        ASSERT_NEAR(cgx[i], dgx[i], 1e-2 * (1 + std::abs(dgx[i]))) << where << " host g element " << i;
      }
      for (size_t i = 0; i < dgu.size(); ++i) {
        ASSERT_NEAR(cgu[i], dgu[i], 1e-2 * (1 + std::abs(dgu[i]))) << where << " host g update " << i;
      }

      const TracedFunction f = read.traced_quadratic();
      const TracedFunction g = [mode, batch_dims](const std::vector<Value>& in) {
        const Value y = scatter_add(in[0], in[1], in[3], GatherAttrs{2, mode, std::nullopt, batch_dims});
        return std::vector<Value>{sum(y * y * in[2])};
      };
      for (const char* batch : {"", "data"}) {
        const std::string at = absl::StrCat(where, " batch over '", batch, "'");
        const Axes split = *batch == '\0' ? Axes{} : Axes{batch};
        auto on = [&](const HostArray& a) {
          std::vector<Axes> spec(a.shape().size());
          spec[0] = split;
          return put_on(*auto_mesh_, a, PartitionSpec(spec));
        };
        const Array xa = on(x), pa = on(positions), wa = on(w), wxa = on(wx), ua = on(u);
        absl::StatusOr<std::vector<Array>> got = jit(grad(f))({xa, pa, wa});
        ASSERT_TRUE(got.ok()) << at << ": " << got.status();
        const HostArray grad_f = fetch((*got)[0]);
        expect_values(grad_f, x.shape(), df, absl::StrCat("d/dx f ", at));
        for (int64_t i = 0; i < x.size(); ++i) {
          ASSERT_NEAR(grad_f.values<float>()[i], cf[i], 1e-2 * (1 + std::abs(cf[i]))) << at << " element " << i;
        }
        got = jit(grad(g, {0, 3}))({xa, pa, wxa, ua});
        ASSERT_TRUE(got.ok()) << at << ": " << got.status();
        const HostArray grad_gx = fetch((*got)[0]), grad_gu = fetch((*got)[1]);
        expect_values(grad_gx, x.shape(), dgx, absl::StrCat("d/dx g ", at));
        expect_values(grad_gu, rs, dgu, absl::StrCat("d/du g ", at));
        for (int64_t i = 0; i < x.size(); ++i) {
          ASSERT_NEAR(grad_gx.values<float>()[i], cgx[i], 1e-2 * (1 + std::abs(cgx[i]))) << at << " element " << i;
        }
        for (int64_t i = 0; i < u.size(); ++i) {
          ASSERT_NEAR(grad_gu.values<float>()[i], cgu[i], 1e-2 * (1 + std::abs(cgu[i]))) << at << " update " << i;
        }
        // The jitted functions' own central differences along random directions.
        for (uint32_t seed : {98u, 99u}) {
          const HostArray v = random_f32(x.shape(), seed);
          const HostArray up = shifted(x, v, kEps), down = shifted(x, v, -kEps);
          double along = 0;
          for (int64_t i = 0; i < x.size(); ++i) {
            along += grad_f.values<float>()[i] * static_cast<double>(v.values<float>()[i]);
          }
          Jitted fj = jit(f);
          absl::StatusOr<std::vector<Array>> fu = fj({on(up), pa, wa}), fd = fj({on(down), pa, wa});
          ASSERT_TRUE(fu.ok() && fd.ok()) << at;
          const double numeric =
              (fetch((*fu)[0]).element_as_double(0) - fetch((*fd)[0]).element_as_double(0)) / (2.0 * kEps);
          EXPECT_NEAR(numeric, along, 1e-2 * (1 + std::abs(along))) << at << " direction " << seed;
        }
      }
    }
  }
}

// vmap of the one-axis gather with batch dimensions through grad (#15): V = 8 examples, each with
// its own positions p_v and weights w_v, read a cache x (CacheRead's, batch_dims 1 and 2, clip
// and fill mode) by f_v(x) = sum(gather(x, p_v)^2 * w_v). Three compositions:
//  (a) grad(sum(vmap(f))) with x shared by every example (unmapped): vmap moves its batch into
//      the indices' query dimensions (client/batching/indexing.cc, batched_indices_rule), so the
//      transpose is one scatter_add into x summing over the examples: sum_v d f_v / d x;
//  (b) vmap(grad(f)) with x shared: each example's own d f_v / d x (V of them);
//  (c) vmap(grad(f)) with x mapped (x_v per example): d f_v / d x_v.
// Each against the host's cotangent (a plain loop: 2 x w summed over the result elements that
// read each element) and the host's central differences of its float32 f_v (eps 1e-2 on a
// quadratic: exact but for rounding), and, as JAX's check_grads (jax/_src/public_test_util.py,
// numerical_jvp), the jitted vmap(f)'s own central difference along a random direction equals
// <gradient, direction> per example and summed. The forward values are the host's too. On the
// Auto meshes (8), (4, 2) and (2, 4) with the examples replicated or split over one axis or both,
// with x's (and the indices') batch N split over the other axis; and on the Explicit (4, 2) mesh,
// where a split over an Explicit axis takes the broadcast of x instead (the deliberate
// difference from JAX documented in indexing.cc). This test checks values only: which of the two
// paths vmap takes (no per-example copy of x) is vmap_test's
// GatherWithBatchDimsFromASharedOperandCopiesNothingPerExample.
TEST_F(GatherTest, VmapOfBatchDimsGatherGradientsMatchTheHostAndCentralDifferences) {
  constexpr int64_t kV = 8, kN = CacheRead::kN, kH = CacheRead::kH, kT = CacheRead::kT, kD = CacheRead::kD,
                    kQ = CacheRead::kQ;
  constexpr float kEps = 1e-2f;
  const Shape x_shape = {kN, kH, kT, kD};
  const int64_t x_size = num_elements(x_shape), r_size = kN * kH * kQ * kD;
  const HostArray x = random_f32(x_shape, 101), xs = random_f32({kV, kN, kH, kT, kD}, 102);
  const HostArray w = random_f32({kV, kN, kH, kQ, kD}, 103);
  const HostArray direction = random_f32(x_shape, 104), directions = random_f32(xs.shape(), 105);
  // The meshes with their layouts: the axes the examples are split over, and those N is.
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  struct Layout {
    Axes examples, n;
  };
  const std::vector<std::pair<Mesh, std::vector<Layout>>> meshes = {
      {*flat, {{{}, {}}, {{"a"}, {}}}},
      {auto_mesh({4, 2}), {{{}, {}}, {{"a"}, {}}, {{"a"}, {"b"}}, {{"a", "b"}, {}}, {{}, {"b"}}}},
      {auto_mesh({2, 4}), {{{}, {}}, {{"a"}, {}}, {{"a"}, {"b"}}, {{"a", "b"}, {}}}},
      {*mesh_, {{{}, {}}, {{}, {"model"}}, {{"data"}, {}}, {{"data"}, {"model"}}}},
  };
  for (int64_t batch_dims : {1, 2}) {
    Shape ps_shape = CacheRead{batch_dims, IndexMode::kClip}.positions_shape();
    const int64_t p_size = num_elements(ps_shape);
    ps_shape.insert(ps_shape.begin(), kV);
    std::vector<int32_t> pv(num_elements(ps_shape));
    for (size_t i = 0; i < pv.size(); ++i) pv[i] = static_cast<int32_t>((i * 7) % 9) - 1;  // -1..7 of 6; repeats
    const HostArray positions = ints(ps_shape, pv);
    for (IndexMode mode : {IndexMode::kClip, IndexMode::kFillOrDrop}) {
      const std::string where = absl::StrCat("batch_dims ", batch_dims, " mode ", static_cast<int>(mode));
      const CacheRead read{batch_dims, mode};
      const float* wv = w.values<float>().data();
      const PerExampleGradients want = per_example_gradients(
          kV, x, xs,
          [&](int64_t v, const float* at) { return read.quadratic(at, pv.data() + v * p_size, wv + v * r_size); },
          [&](int64_t v, const float* at, double* dx) {
            read.add_quadratic_cotangent(at, pv.data() + v * p_size, wv + v * r_size, dx);
          },
          kEps);
      // The host's cotangents are its central differences (the reference checks itself).
      for (size_t i = 0; i < want.shared.size(); ++i) {
        ASSERT_NEAR(want.shared_cd[i], want.shared[i], 1e-2 * (1 + std::abs(want.shared[i]))) << where << " " << i;
        ASSERT_NEAR(want.mapped_cd[i], want.mapped[i], 1e-2 * (1 + std::abs(want.mapped[i]))) << where << " " << i;
      }
      VmapGrads run(read.traced_quadratic());
      for (const auto& mesh_and_layouts : meshes) {
        const Mesh& mesh = mesh_and_layouts.first;
        for (const Layout& layout : mesh_and_layouts.second) {
          const std::string at =
              absl::StrCat(where, " mesh ", absl::StrJoin(mesh.shape(), "x"), " examples over '",
                           absl::StrJoin(layout.examples, ","), "' N over '", absl::StrJoin(layout.n, ","), "'");
          // An array with the examples first (`examples`) or x itself laid out as the layout says.
          auto on = [&](const HostArray& a, bool examples) {
            std::vector<Axes> spec(a.shape().size());
            if (examples) spec[0] = layout.examples;
            spec[examples ? 1 : 0] = layout.n;
            return put_on(mesh, a, PartitionSpec(spec));
          };
          const Array pa = on(positions, true), wa = on(w, true);
          HostArray g_total, g_shared, g_mapped;
          run.check(want, on(x, false), on(xs, true), pa, wa, at, &g_total, &g_shared, &g_mapped);
          if (HasFatalFailure()) return;
          // The jitted vmap(f)'s own central differences along the directions.
          const HostArray up = shifted(x, direction, kEps), down = shifted(x, direction, -kEps);
          const HostArray ups = shifted(xs, directions, kEps), downs = shifted(xs, directions, -kEps);
          absl::StatusOr<std::vector<Array>> fu = run.values_shared({on(up, false), pa, wa}),
                                             fd = run.values_shared({on(down, false), pa, wa}),
                                             fus = run.values_mapped({on(ups, true), pa, wa}),
                                             fds = run.values_mapped({on(downs, true), pa, wa});
          ASSERT_TRUE(fu.ok() && fd.ok() && fus.ok() && fds.ok()) << at;
          const HostArray vu = fetch((*fu)[0]), vd = fetch((*fd)[0]), vus = fetch((*fus)[0]), vds = fetch((*fds)[0]);
          double sum_numeric = 0, sum_along = 0;
          for (int64_t v = 0; v < kV; ++v) {
            double along = 0, along_mapped = 0;
            for (int64_t i = 0; i < x_size; ++i) {
              along += g_shared.values<float>()[v * x_size + i] * static_cast<double>(direction.values<float>()[i]);
              along_mapped += g_mapped.values<float>()[v * x_size + i] *
                              static_cast<double>(directions.values<float>()[v * x_size + i]);
            }
            const double numeric = (vu.element_as_double(v) - vd.element_as_double(v)) / (2.0 * kEps);
            const double numeric_mapped = (vus.element_as_double(v) - vds.element_as_double(v)) / (2.0 * kEps);
            EXPECT_NEAR(numeric, along, 1e-2 * (1 + std::abs(along))) << at << " (b) example " << v;
            EXPECT_NEAR(numeric_mapped, along_mapped, 1e-2 * (1 + std::abs(along_mapped)))
                << at << " (c) example " << v;
            sum_numeric += numeric;
          }
          for (int64_t i = 0; i < x_size; ++i) {
            sum_along += g_total.values<float>()[i] * static_cast<double>(direction.values<float>()[i]);
          }
          EXPECT_NEAR(sum_numeric, sum_along, 1e-2 * (1 + std::abs(sum_along))) << at << " (a)";
        }
      }
    }
  }
}

// vmap of dynamic_slice with a start per example, through grad (#15): V = 8 examples each read the
// window (4, 3) of x (10, 3) at rows (s_v, 0), s_v in -2..9 (clamped into [0, 6] as lax clamps),
// f_v(x) = sum(dynamic_slice(x, (s_v, 0))^2 * w_v). vmap batches it as a gather with the starts as
// indices (client/batching/indexing.cc, dynamic_slice_rule, as JAX's _dynamic_slice_batching_rule
// -> _gather_batching_rule). (a) grad(sum(vmap(f))) with x shared, (b) vmap(grad(f)) with x shared,
// (c) vmap(grad(f)) with x mapped, against the host's cotangent loop (2 x w added into each
// example's clamped window) and the host's central differences of its float32 f_v; the forward
// values against the host. On the Auto meshes (8), (4, 2) and (2, 4), the examples replicated,
// split over one axis or over both.
TEST_F(GatherTest, VmapOfDynamicSliceWithPerExampleStartsGradientsMatchTheHostAndCentralDifferences) {
  constexpr int64_t kV = 8, kT = 10, kD = 3, kW = 4;
  const HostArray x = random_f32({kT, kD}, 111), xs = random_f32({kV, kT, kD}, 112), w = random_f32({kV, kW, kD}, 113);
  const std::vector<int32_t> starts = {-2, 0, 3, 9, 6, 7, 1, 5};
  const float* wv = w.values<float>().data();
  // Example v's window starts at row c_v = clamp(s_v, 0, T - W): f_v and its cotangent.
  auto window = [&](int64_t v) { return std::clamp<int64_t>(starts[v], 0, kT - kW) * kD; };
  const PerExampleGradients want = per_example_gradients(
      kV, x, xs,
      [&](int64_t v, const float* at) {
        float total = 0;
        for (int64_t e = 0; e < kW * kD; ++e) total += at[window(v) + e] * at[window(v) + e] * wv[v * kW * kD + e];
        return total;
      },
      [&](int64_t v, const float* at, double* dx) {
        for (int64_t e = 0; e < kW * kD; ++e) dx[window(v) + e] += 2.0 * at[window(v) + e] * wv[v * kW * kD + e];
      },
      1e-2f);
  VmapGrads run([](const std::vector<Value>& in) {
    const Value rows = dynamic_slice(in[0], {in[1], full({}, 0, DType::kI32)}, {kW, kD});
    return std::vector<Value>{sum(rows * rows * in[2])};
  });
  absl::StatusOr<Mesh> flat = client_->make_mesh({8}, {"a"}, {AxisType::kAuto});
  ASSERT_TRUE(flat.ok()) << flat.status();
  const std::vector<std::pair<Mesh, std::vector<Axes>>> meshes = {
      {*flat, {{}, {"a"}}},
      {auto_mesh({4, 2}), {{}, {"a"}, {"b"}, {"a", "b"}}},
      {auto_mesh({2, 4}), {{}, {"a"}, {"b"}, {"a", "b"}}},
  };
  for (const auto& mesh_and_layouts : meshes) {
    const Mesh& mesh = mesh_and_layouts.first;
    for (const Axes& examples : mesh_and_layouts.second) {
      const std::string at = absl::StrCat("mesh ", absl::StrJoin(mesh.shape(), "x"), " examples over '",
                                          absl::StrJoin(examples, ","), "'");
      auto on = [&](const HostArray& a) {
        std::vector<Axes> spec(a.shape().size());
        spec[0] = examples;
        return put_on(mesh, a, PartitionSpec(spec));
      };
      HostArray a, b, c;
      run.check(want, put_on(mesh, x, P()), on(xs), on(ints({kV}, starts)), on(w), at, &a, &b, &c);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace tessera

// lax.gather / lax.scatter_add / lax.scatter with dimension numbers and jnp.take_along_axis
// (trace.h, client/lax_gather.cc), jitted on Client::local(8) with sharded operands and
// indices, against host loops written here over XLA's operation semantics of Gather and
// Scatter (the definition jax/_src/lax/slicing.py's docstrings point to), not against the
// composite's own lowering. Cases from JAX's tests/lax_test.py (testGather, testScatterAddSub,
// testGatherShapeCheckingRule) and the docstrings of lax.gather and jnp.take_along_axis.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

// lax.scatter_add / lax.scatter on the host, update element by update element.
std::vector<double> host_scatter(const HostArray& x, const HostArray& idx, const HostArray& u,
                                 const ScatterDimensionNumbers& dn, IndexMode mode, bool add) {
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
    target = add ? target + u.element_as_double(flat) : u.element_as_double(flat);
  }
  return out;
}

// `got` (float32) equals `want` within 1e-5 relative; NaN matches NaN.
void expect_values(const HostArray& got, const Shape& shape, const std::vector<double>& want,
                   const std::string& where) {
  ASSERT_EQ(got.shape(), shape) << where;
  for (size_t i = 0; i < want.size(); ++i) {
    const double g = got.element_as_double(static_cast<int64_t>(i));
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(g)) << where << " element " << i << ": " << g << ", want NaN";
    } else {
      ASSERT_NEAR(g, want[i], 1e-5 * (1 + std::abs(want[i]))) << where << " element " << i;
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

// The default fill value is JAX's (NaN for floats, the lowest int32 for int32), and int64
// indices beyond int32's range are out of range, not wrapped.
TEST_F(GatherTest, FillModeDefaultsAndWideIndices) {
  const HostArray x = HostArray::arange(DType::kI32, {5, 3});
  const HostArray idx = HostArray::from_vector<int64_t>({3, 1}, {4, int64_t{1} << 32, -1});
  const GatherDimensionNumbers dn{{1}, {0}, {0}};
  absl::StatusOr<HostArray> got = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], dn, {1, 3})};
      },
      {put(x, P()), put(idx, P())});
  ASSERT_TRUE(got.ok()) << got.status();
  const int32_t lo = std::numeric_limits<int32_t>::min();
  EXPECT_EQ(*got, HostArray::from_vector<int32_t>({3, 3}, {12, 13, 14, lo, lo, lo, lo, lo, lo}));
  absl::StatusOr<HostArray> nan = run1(
      [&](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], dn, {1, 3})};
      },
      {put(random_f32({5, 3}, 1), P()), put(idx, P())});
  ASSERT_TRUE(nan.ok()) << nan.status();
  EXPECT_FALSE(std::isnan(nan->element_as_double(0)));
  for (int64_t i = 3; i < 9; ++i) EXPECT_TRUE(std::isnan(nan->element_as_double(i))) << i;
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
  // Not built: on Explicit axes an operand split on an addressed dimension (here a batching
  // one, which JAX's _gather_spec_computation accepts when the indices split alike) meets the
  // fold's reshape, which refuses to guess the merged layout (docs/design.md).
  absl::StatusOr<std::vector<Array>> split = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{take_along_axis(in[0], in[1], 1)};
  })({put(x, P("model", None)), put(i1, P("model", None))});
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(split.status().message()), HasSubstr("reshape: merging operand dimensions"));

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
  return out;
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
  };
  for (const Expect& e : cases) {
    EXPECT_EQ(e.status.code(), absl::StatusCode::kInvalidArgument) << e.message << ": " << e.status;
    EXPECT_THAT(std::string(e.status.message()), HasSubstr(e.message));
  }
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

}  // namespace
}  // namespace tessera

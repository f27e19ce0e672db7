// lax.slice with strides (jax/_src/lax/slicing.py: slice, _slice_shape_rule,
// _slice_sharding_rule, _slice_transpose_fancy, _slice_batching_rule) and lax.rev
// (jax/_src/lax/lax.py: rev, _rev_shape_rule, _rev_sharding_rule, _rev_batch_rule, its
// deflinear2 transpose) on (8), (4, 2) and (2, 4) meshes of Auto and Explicit axes: values
// against host loops, the result's split, the plan's collectives, JAX's errors, grad and vmap.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/compiler/rules.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/grad.h"
#include "tessera/vmap.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

using jit_support::count_of;
using jit_support::expect_near;
using jit_support::random_f32;
using ::testing::HasSubstr;
using Dims = std::vector<int64_t>;

// A rev of a rank-2 x: its name, the dimensions reversed, and whether they reverse the rows and
// the columns.
struct RevCase {
  const char* name;
  Dims dims;
  bool rows, cols;
};

const RevCase kRevCases[] = {
    {"rev(x, {0})", {0}, true, false},
    {"rev(x, {1})", {1}, false, true},
    {"rev(x, {1, 0})", {1, 0}, true, true},
    {"rev(x, {})", {}, false, false},
};

class SliceTest : public jit_support::LocalJitSuite {
 protected:
  // The (8), (4, 2) and (2, 4) meshes over the suite's devices, axes named 'a' (and 'b').
  static std::vector<Mesh> meshes(AxisType type) {
    std::vector<Mesh> out;
    for (const Dims& shape : {Dims{8}, Dims{4, 2}, Dims{2, 4}}) {
      absl::StatusOr<Mesh> m = shape.size() == 1 ? client_->make_mesh(shape, {"a"}, {type})
                                                 : client_->make_mesh(shape, {"a", "b"}, {type, type});
      EXPECT_TRUE(m.ok()) << m.status();
      out.push_back(*m);
    }
    return out;
  }
  // x split over 'a' on dimension 0 and over 'b' (when the mesh has it) on dimension 1.
  static PartitionSpec split_spec(const Mesh& mesh) {
    return mesh.axis_names().size() == 1 ? P("a", None) : P("a", "b");
  }
  // split_spec(mesh), and on (4, 2) also x's rows split over both axes, P(('a', 'b'), None).
  static std::vector<PartitionSpec> split_specs(const Mesh& mesh) {
    std::vector<PartitionSpec> specs = {split_spec(mesh)};
    if (mesh.axis_names().size() == 2 && mesh.axis_size("a") == 4) specs.push_back(P(Axes{"a", "b"}, None));
    return specs;
  }
  // Numpy's x[start:limit:strides] of a rank-2 row-major x, by loops.
  static std::vector<double> host_slice(const HostArray& x, const Dims& start, const Dims& limit, const Dims& strides) {
    std::vector<double> out;
    for (int64_t i = start[0]; i < limit[0]; i += strides[0]) {
      for (int64_t j = start[1]; j < limit[1]; j += strides[1]) {
        out.push_back(x.element_as_double(i * x.shape()[1] + j));
      }
    }
    return out;
  }
  // Numpy's x[::-1, :] (rows), x[:, ::-1] (cols) or both of a rank-2 row-major x, by loops.
  static std::vector<double> host_rev(const HostArray& x, bool rows, bool cols) {
    const int64_t m = x.shape()[0], n = x.shape()[1];
    std::vector<double> out;
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j)
        out.push_back(x.element_as_double((rows ? m - 1 - i : i) * n + (cols ? n - 1 - j : j)));
    }
    return out;
  }
  // rev(x split as `spec` on `mesh`, c.dims) equals numpy's reversal, keeps the split
  // (_rev_sharding_rule), and its plan is one collective_permute where a split dimension is
  // reversed, no collective otherwise.
  static void expect_rev_permutes_the_blocks(const Mesh& mesh, const HostArray& x, const PartitionSpec& spec,
                                             const RevCase& c) {
    SCOPED_TRACE(absl::StrCat(c.name, " of x split as ", spec.to_string(), " on ", mesh.to_string()));
    Jitted f = jit([&](const std::vector<Value>& in) { return std::vector<Value>{rev(in[0], c.dims)}; });
    absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, spec)});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_near(fetch((*got)[0]), host_rev(x, c.rows, c.cols), 0);
    EXPECT_EQ((*got)[0].sharding().spec(), spec);
    const bool split_reversed = (c.rows && !spec.dims()[0].empty()) || (c.cols && !spec.dims()[1].empty());
    expect_no_collective_but_permute(f.as_text(), split_reversed);
    EXPECT_EQ(count_of(f.as_text(), "collective_permute"), split_reversed ? 1u : 0u) << f.as_text();
  }
  static void expect_no_collective_but_permute(const std::string& program, bool permute) {
    for (const char* collective : {"all_gather", "all_to_all", "all_reduce", "reduce_scatter"}) {
      EXPECT_THAT(program, ::testing::Not(HasSubstr(collective))) << program;
    }
    if (permute) {
      EXPECT_THAT(program, HasSubstr("collective_permute")) << program;
    } else {
      EXPECT_THAT(program, ::testing::Not(HasSubstr("collective_permute"))) << program;
    }
  }
  // The program of a padding of x split as `spec` (what add_padding predicts: `kept` and its
  // `permutes`): an all_gather when the split is not kept, else the result split as x with
  // exactly `permutes` collective_permutes and no other collective.
  static void expect_padding_program(bool kept, size_t permutes, const Jitted& f, const Array& got,
                                     const PartitionSpec& spec) {
    if (!kept) {
      EXPECT_THAT(f.as_text(), HasSubstr("all_gather")) << f.as_text();
      return;
    }
    EXPECT_EQ(got.sharding().spec(), spec);
    expect_no_collective_but_permute(f.as_text(), permutes > 0);
    EXPECT_EQ(count_of(f.as_text(), "collective_permute"), permutes) << f.as_text();
  }
};

struct StridedCase {
  const char* name;
  Dims start, limit, strides;
};

// Each case's values equal numpy's on every mesh and mode. Where every device's block is a
// whole number of runs of `stride` elements and the slice keeps the same position of each run
// (x[::2], x[1::2, ::4], x[1::2, 1::2] of a (16, 8) x), the split is kept and the program moves
// nothing: no collective at all, the result split as x. JAX's _slice_sharding_rule keeps x's
// sharding too (the result's dimension divides by its mesh axes). x[1::2, ::4] on (2, 4) keeps 2
// columns, which do not divide over 'b' (4): JAX's error on Explicit axes; on Auto axes the
// compiler gathers that dimension.
TEST_F(SliceTest, StridedSlicesMatchNumpyAndKeepAnAlignedSplitWithoutCollectives) {
  const HostArray x = random_f32({16, 8}, 1);
  const std::vector<StridedCase> cases = {
      {"x[::2]", {0, 0}, {16, 8}, {2, 1}},
      {"x[1::2, ::4]", {1, 0}, {16, 8}, {2, 4}},
      {"x[1::2, 1::2]", {1, 1}, {16, 8}, {2, 2}},
  };
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      for (const StridedCase& c : cases) {
        SCOPED_TRACE(absl::StrCat(c.name, " on ", mesh.to_string()));
        Jitted f = jit([&](const std::vector<Value>& in) {
          return std::vector<Value>{slice(in[0], c.start, c.limit, c.strides)};
        });
        absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, split_spec(mesh))});
        const bool indivisible = c.strides[1] == 4 && mesh.axis_names().size() == 2 && mesh.axis_size("b") == 4;
        if (indivisible && type == AxisType::kExplicit) {
          ASSERT_FALSE(got.ok());
          EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
          EXPECT_THAT(std::string(got.status().message()),
                      HasSubstr("slicing on sharded dims where out dim (2) is not divisible by mesh axes (4) with "
                                "spec ('b',) is not implemented"));
          continue;
        }
        ASSERT_TRUE(got.ok()) << got.status();
        expect_near(fetch((*got)[0]), host_slice(x, c.start, c.limit, c.strides), 0);
        if (indivisible) {
          EXPECT_EQ((*got)[0].sharding().spec(), P("a", None)) << "dimension 1 gathered";
          continue;
        }
        EXPECT_EQ((*got)[0].sharding().spec(), split_spec(mesh));
        for (const char* collective : {"all_gather", "all_to_all", "collective_permute", "all_reduce"}) {
          EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr(collective))) << f.as_text();
        }
      }
    }
  }
}

// A slice that is not aligned with the blocks (x[1:7:3] keeps indices 1 and 4 of 8) cannot
// keep a split its 2 elements do not divide: on Auto axes the compiler gathers the dimension
// first over 8 and 4 devices; over 2 ('a' of the (2, 4) mesh) each device's element is in its
// own block (index 1 of block 0, index 0 of block 1), so the split is kept and nothing moves.
// On Explicit axes the result keeps x's split when its 2 elements divide by the axis (as JAX's
// _get_sharding_for_varying_out_shape) and is JAX's error otherwise (8 and 4 devices).
TEST_F(SliceTest, UnalignedStridedSliceOfASplitDimensionIsReadInPlaceGathersOrIsJaxsError) {
  const HostArray x = HostArray::arange(DType::kF32, {8, 4});
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      SCOPED_TRACE(mesh.to_string());
      Jitted f = jit([](const std::vector<Value>& in) {
        return std::vector<Value>{slice(in[0], {1, 0}, {7, 4}, {3, 1})};
      });
      absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, P("a", None))});
      const int64_t a = mesh.axis_size("a");
      if (type == AxisType::kExplicit && a != 2) {
        ASSERT_FALSE(got.ok());
        EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
        EXPECT_THAT(
            std::string(got.status().message()),
            HasSubstr(absl::StrCat("slicing on sharded dims where out dim (2) is not divisible by mesh axes (", a,
                                   ") with spec ('a',) is not implemented. Got input type=f32[8@a,4] and "
                                   "output shape=(2, 4)")));
        continue;
      }
      ASSERT_TRUE(got.ok()) << got.status();
      expect_near(fetch((*got)[0]), {4, 5, 6, 7, 16, 17, 18, 19}, 0);
      if (a == 2) {
        EXPECT_EQ((*got)[0].sharding().spec(), P("a", None));
        if (type == AxisType::kAuto) expect_no_collective_but_permute(f.as_text(), false);
      } else {
        EXPECT_THAT(f.as_text(), HasSubstr("all_gather")) << f.as_text();
      }
    }
  }
}

// How far the devices' parts of x[start:limit:stride] reach before and after their blocks when
// a dimension of `dim` is split over n devices (each device keeps its 1/n of the result): the
// halos (left, right) a device must receive, by walking every kept element.
std::pair<int64_t, int64_t> halos_of(int64_t start, int64_t limit, int64_t stride, int64_t dim, int64_t n) {
  const int64_t block = dim / n, kept = (limit - start + stride - 1) / stride;
  int64_t left = 0, right = 0;
  for (int64_t j = 0; j < kept; ++j) {
    const int64_t p = j / (kept / n), at = start + j * stride;
    left = std::max(left, p * block - at);
    right = std::max(right, at - ((p + 1) * block - 1));
  }
  return {left, right};
}

// A slice not aligned with the blocks of a split dimension keeps the split when each device's
// part lies in its block and its neighbours' (XLA's HandleSlice -> ExchangeHaloAndGetValidData,
// xla/service/spmd/spmd_partitioner_util.cc): on Auto axes the plan sends the halos by
// collective_permute, one per side that has one, and gathers nothing. x f32[64, 8] split as x
// is on every mesh (and P(('a', 'b'), None) on (4, 2)); Explicit axes keep JAX's type (every
// result here divides, _slice_sharding_rule keeps x's sharding), and values equal numpy's on
// both. x[40:64] over 8 reaches 35 elements past device 0's block: it still gathers.
TEST_F(SliceTest, UnalignedSliceOfASplitDimensionExchangesHalosNotGathers) {
  const HostArray x = random_f32({64, 8}, 6);
  const std::vector<StridedCase> cases = {
      {"x[1:57]", {1, 0}, {57, 8}, {1, 1}},        {"x[8:64]", {8, 0}, {64, 8}, {1, 1}},
      {"x[7:55:2]", {7, 0}, {55, 8}, {2, 1}},      {"x[6:52:3]", {6, 0}, {52, 8}, {3, 1}},
      {"x[7:55:2, 1:5]", {7, 1}, {55, 5}, {2, 1}}, {"x[40:64]", {40, 0}, {64, 8}, {1, 1}},
  };
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      for (const PartitionSpec& spec : split_specs(mesh)) {
        for (const StridedCase& c : cases) {
          SCOPED_TRACE(absl::StrCat(c.name, " of x split as ", spec.to_string(), " on ", mesh.to_string()));
          Jitted f = jit([&](const std::vector<Value>& in) {
            return std::vector<Value>{slice(in[0], c.start, c.limit, c.strides)};
          });
          absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, spec)});
          ASSERT_TRUE(got.ok()) << got.status();
          expect_near(fetch((*got)[0]), host_slice(x, c.start, c.limit, c.strides), 0);
          if (type == AxisType::kExplicit) {
            EXPECT_EQ((*got)[0].sharding().spec(), spec);
            continue;
          }
          // Whether a split is kept is internal::slice_window's decision (one hop per side, halos
          // fewer than a gather receives; partition_test's SliceWindow.* checks it against a
          // per-device simulation); the halos, and so the permutes, are counted here on their own.
          size_t sides = 0;
          bool gathered = false;
          for (size_t d = 0; d < 2; ++d) {
            const int64_t n = mesh.axes_size(spec.dims()[d]), dim = x.shape()[d];
            if (n == 1 || (c.start[d] == 0 && c.limit[d] == dim && c.strides[d] == 1)) continue;
            const int64_t kept = (c.limit[d] - c.start[d] + c.strides[d] - 1) / c.strides[d];
            gathered = gathered ||
                       !internal::slice_window(SliceAttrs{c.start, c.limit, c.strides}, d, dim, kept, n).has_value();
            const auto [left, right] = halos_of(c.start[d], c.limit[d], c.strides[d], dim, n);
            sides += (left > 0 ? 1 : 0) + (right > 0 ? 1 : 0);
          }
          // Pinned by hand, not by slice_window: over 8 devices (blocks of 8), x[40:64] reaches
          // 35 elements past device 0's block, beyond one hop.
          if (absl::string_view(c.name) == "x[40:64]" && mesh.axis_names().size() == 1) {
            EXPECT_TRUE(gathered);
          }
          if (gathered) {
            EXPECT_THAT(f.as_text(), HasSubstr("all_gather")) << f.as_text();
            continue;
          }
          EXPECT_EQ((*got)[0].sharding().spec(), spec);
          expect_no_collective_but_permute(f.as_text(), sides > 0);
          EXPECT_EQ(count_of(f.as_text(), "collective_permute"), sides) << f.as_text();
        }
      }
    }
  }
}

// Where the devices' windows need no halo but start at different places of their blocks,
// nothing moves: x[1:31] of 32 over 2 devices keeps [1, 16) of block 0 and [0, 15) of block 1,
// read at an axis_index-based offset by a dynamic_slice (XLA's partition-id-based offset).
TEST_F(SliceTest, UnalignedSliceWithoutHalosReadsEachBlockAtItsOwnOffset) {
  const HostArray x = random_f32({32, 4}, 7);
  const Mesh mesh = meshes(AxisType::kAuto)[2];  // (2, 4)
  Jitted f = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{slice(in[0], {1, 0}, {31, 4}, {1, 1})};
  });
  absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, P("a", None))});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(fetch((*got)[0]), host_slice(x, {1, 0}, {31, 4}, {1, 1}), 0);
  EXPECT_EQ((*got)[0].sharding().spec(), P("a", None));
  expect_no_collective_but_permute(f.as_text(), false);
  EXPECT_THAT(f.as_text(), HasSubstr("dynamic_slice")) << f.as_text();
}

// A pending sum passes through the halo exchange (the permutes stay within the sum's replica
// groups, and every step is linear): x @ w with the contraction split over 'b' is a sum pending
// over 'b', its rows split over 'a' (4 devices); x[7:55:2] of it exchanges the terms' row halos
// over 'a' (the plan sums over 'b' after, at the slice's smaller shape) and equals numpy's
// (x @ w)[7:55:2] with no gather.
TEST_F(SliceTest, APendingSumPassesThroughAHaloExchangingSlice) {
  const HostArray x = random_f32({64, 8}, 10);
  const HostArray w = random_f32({8, 4}, 11);
  std::vector<double> want;
  for (int64_t r = 7; r < 55; r += 2) {
    for (int64_t c = 0; c < 4; ++c) {
      double acc = 0;
      for (int64_t k = 0; k < 8; ++k) acc += x.element_as_double(r * 8 + k) * w.element_as_double(k * 4 + c);
      want.push_back(acc);
    }
  }
  const Mesh mesh = meshes(AxisType::kAuto)[1];  // (4, 2)
  Jitted f = jit([](const std::vector<Value>& in) {
    return std::vector<Value>{slice(matmul(in[0], in[1]), {7, 0}, {55, 4}, {2, 1})};
  });
  absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, P("a", "b")), put_on(mesh, w, P("b", None))});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(fetch((*got)[0]), want, 1e-5);
  EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr("all_gather"))) << f.as_text();
  EXPECT_THAT(f.as_text(), HasSubstr("collective_permute")) << f.as_text();
}

// grad through a slice that exchanges halos: d/dx sum(x[7:55:2] * w) is w at rows 7, 9, ..., 53
// and 0 elsewhere (_slice_transpose_fancy's pad), with x and w split over the rows.
TEST_F(SliceTest, GradOfAHaloExchangingSliceIsTheCotangentAtTheKeptRows) {
  const HostArray x = random_f32({64, 8}, 8);
  const HostArray w = random_f32({24, 8}, 9);
  std::vector<double> want(x.size(), 0.0);
  for (int64_t r = 0; r < 24; ++r) {
    for (int64_t c = 0; c < 8; ++c) want[(7 + 2 * r) * 8 + c] = w.element_as_double(r * 8 + c);
  }
  for (const Mesh& mesh : meshes(AxisType::kAuto)) {
    SCOPED_TRACE(mesh.to_string());
    absl::StatusOr<std::vector<Array>> got = jit(grad([](const std::vector<Value>& in) {
      return std::vector<Value>{sum(slice(in[0], {7, 0}, {55, 8}, {2, 1}) * in[1])};
    }))({put_on(mesh, x, P("a", None)), put_on(mesh, w, P("a", None))});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_near(fetch((*got)[0]), want, 0);
  }
}

// How a dimension of x (`size` elements) padded by `low` and `high` fills and split over n
// devices reads x: the device holding padded block j needs x's elements [j·B - low, (j+1)·B -
// low) that lie in x (B = (low + size + high) / n), from the blocks of `size / n`. The halos
// (left, right) a device receives from its neighbours' blocks, walking every element, and
// whether one lies beyond the neighbouring block.
struct PaddingHalos {
  int64_t left = 0, right = 0;
  bool beyond = false;
};
PaddingHalos padding_halos(int64_t low, int64_t size, int64_t high, int64_t n) {
  const int64_t block = (low + size + high) / n, own = size / n;
  PaddingHalos h;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t at = j * block - low; at < (j + 1) * block - low; ++at) {
      if (at < 0 || at >= size) continue;  // the fill's
      const int64_t owner = at / own;
      if (owner < j) h.left = std::max(h.left, j * own - at);
      if (owner > j) h.right = std::max(h.right, at - ((j + 1) * own - 1));
      h.beyond = h.beyond || owner < j - 1 || owner > j + 1;
    }
  }
  return h;
}

// Whether, and by how many permutes, a padding of a split dimension keeps its split (the
// halo exchange of partition_concatenate): on Auto axes it must when every halo comes from a
// neighbour and the halos are fewer than the (n - 1)·size/n elements a gather receives.
struct PaddingPlan {
  bool kept = true;
  size_t permutes = 0;
};
void add_padding(PaddingPlan& plan, int64_t low, int64_t size, int64_t high, int64_t n) {
  if (n == 1 || (low == 0 && high == 0)) return;
  const PaddingHalos h = padding_halos(low, size, high, n);
  if ((low + size + high) % n != 0 || size % n != 0 || h.beyond || h.left + h.right >= (n - 1) * (size / n)) {
    plan.kept = false;
    return;
  }
  plan.permutes += (h.left > 0 ? 1 : 0) + (h.right > 0 ? 1 : 0);
}

// grad through a unit-stride slice of a split dimension: its VJP pads the cotangent with zeros
// (client/vjp/layout.cc unslice, a concatenate; jax/_src/lax/slicing.py _slice_transpose_rule),
// which on Auto axes keeps the cotangent's split by the halo exchange that mirrors the slice's
// (each device's block of the gradient reads its own block of the cotangent and halos of its
// neighbours', the fill where it lies outside): no all_gather, one collective_permute per side
// that has a halo, the gradient split as x. d/dx sum(x[r0:r1, c0:c1] * w) is w inside the slice
// and 0 elsewhere, on (8), (4, 2), (2, 4) and P(('a', 'b'), None); Explicit axes give the same
// values. x[40:64] over 8 or 4 reaches past the neighbouring block (and over 2 a halo as large
// as the gather): it still gathers.
TEST_F(SliceTest, GradOfAUnitStrideHaloSliceKeepsTheCotangentSplit) {
  const HostArray x = random_f32({64, 8}, 12);
  const std::vector<StridedCase> cases = {
      {"x[1:57]", {1, 0}, {57, 8}, {1, 1}},   {"x[8:64]", {8, 0}, {64, 8}, {1, 1}},
      {"x[3:51]", {3, 0}, {51, 8}, {1, 1}},   {"x[7:55, 1:5]", {7, 1}, {55, 5}, {1, 1}},
      {"x[40:64]", {40, 0}, {64, 8}, {1, 1}},
  };
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      for (const PartitionSpec& spec : split_specs(mesh)) {
        for (const StridedCase& c : cases) {
          SCOPED_TRACE(absl::StrCat("grad of ", c.name, " of x split as ", spec.to_string(), " on ", mesh.to_string()));
          const Dims kept = {c.limit[0] - c.start[0], c.limit[1] - c.start[1]};
          const HostArray w = random_f32(kept, 13);
          std::vector<double> want(x.size(), 0.0);
          for (int64_t r = 0; r < kept[0]; ++r) {
            for (int64_t k = 0; k < kept[1]; ++k)
              want[(c.start[0] + r) * 8 + c.start[1] + k] = w.element_as_double(r * kept[1] + k);
          }
          Jitted f = jit(grad([&](const std::vector<Value>& in) {
            return std::vector<Value>{sum(slice(in[0], c.start, c.limit, c.strides) * in[1])};
          }));
          absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, spec), put_on(mesh, w, spec)});
          ASSERT_TRUE(got.ok()) << got.status();
          expect_near(fetch((*got)[0]), want, 0);
          if (type == AxisType::kExplicit) continue;
          PaddingPlan plan;
          for (size_t d = 0; d < 2; ++d) {
            add_padding(plan, c.start[d], kept[d], x.shape()[d] - c.limit[d], mesh.axes_size(spec.dims()[d]));
          }
          // Pinned by hand: over 8 devices x[40:64]'s cotangent (3 rows a device) is needed 5
          // blocks away.
          if (absl::string_view(c.name) == "x[40:64]" && mesh.axis_names().size() == 1) {
            EXPECT_FALSE(plan.kept);
          }
          expect_padding_program(plan.kept, plan.permutes, f, (*got)[0], spec);
        }
      }
    }
  }
}

// jnp.pad of a split dimension with a constant (client/lax.cc pad: the scalar broadcast on
// either side, then a concatenate): the same halo exchange, the fill selected by position
// (any value, not only a gradient's zeros). x f32[24, 8] padded by (3, 5), (5, 3) and (1, 7)
// rows of 2.5 is numpy's np.pad on every mesh and every split of split_specs (rows over 'a',
// over ('a', 'b'): the select's block start over two axes); a user's concatenate of fills
// -1.5 before and 4.0 after x (jnp.concatenate; a swap of the two fills shows) likewise. On Auto
// axes the split stays with no gather.
TEST_F(SliceTest, PadOfASplitDimensionExchangesHalosAndFillsTheRest) {
  const HostArray x = random_f32({24, 8}, 14);
  for (const auto& [low, high] : std::vector<std::pair<int64_t, int64_t>>{{3, 5}, {5, 3}, {1, 7}}) {
    auto padded = [&](double low_fill, double high_fill) {
      std::vector<double> want;
      for (int64_t r = -low; r < 24 + high; ++r) {
        for (int64_t k = 0; k < 8; ++k) {
          want.push_back(r < 0 ? low_fill : r >= 24 ? high_fill : x.element_as_double(r * 8 + k));
        }
      }
      return want;
    };
    const struct {
      const char* name;
      std::function<Value(const Value&)> op;
      std::vector<double> want;
    } ops[] = {
        {"jnp.pad with 2.5",
         [&](const Value& v) {
           return pad(v, {{low, high}, {0, 0}}, 2.5);
         },
         padded(2.5, 2.5)},
        {"concatenate of -1.5, x and 4.0",
         [&](const Value& v) {
           return concatenate({full({low, 8}, -1.5, DType::kF32), v, full({high, 8}, 4.0, DType::kF32)}, 0);
         },
         padded(-1.5, 4.0)},
    };
    for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
      for (const Mesh& mesh : meshes(type)) {
        for (const PartitionSpec& spec : split_specs(mesh)) {
          for (const auto& op : ops) {
            SCOPED_TRACE(absl::StrCat(op.name, " by (", low, ", ", high, ") of x split as ", spec.to_string(), " on ",
                                      mesh.to_string()));
            Jitted f = jit([&](const std::vector<Value>& in) { return std::vector<Value>{op.op(in[0])}; });
            absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, spec)});
            ASSERT_TRUE(got.ok()) << got.status();
            expect_near(fetch((*got)[0]), op.want, 0);
            if (type == AxisType::kExplicit) continue;
            PaddingPlan plan;
            add_padding(plan, low, 24, high, mesh.axes_size(spec.dims()[0]));
            expect_padding_program(plan.kept, plan.permutes, f, (*got)[0], spec);
          }
        }
      }
    }
  }
}

// _slice_shape_rule's checks: a stride below 1 ("slice strides must be positive"), one stride
// per dimension; the result's length is ceil((limit - start) / stride) (core.stride_dim), so an
// empty range gives 0 elements.
TEST_F(SliceTest, ShapeRuleAndErrorsAreJaxs) {
  const HostArray x = random_f32({6, 5}, 2);
  auto run = [&](Dims start, Dims limit, Dims strides) {
    return jit([=](const std::vector<Value>& in) { return std::vector<Value>{slice(in[0], start, limit, strides)}; })(
        {put_on(*auto_mesh_, x, P())});
  };
  absl::StatusOr<std::vector<Array>> zero = run({0, 0}, {6, 5}, {0, 1});
  ASSERT_FALSE(zero.ok());
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(zero.status().message()), HasSubstr("slice strides must be positive, got (0, 1)"));
  absl::StatusOr<std::vector<Array>> negative = run({0, 0}, {6, 5}, {1, -2});
  ASSERT_FALSE(negative.ok());
  EXPECT_THAT(std::string(negative.status().message()), HasSubstr("slice strides must be positive, got (1, -2)"));
  absl::StatusOr<std::vector<Array>> short_strides = run({0, 0}, {6, 5}, {2});
  ASSERT_FALSE(short_strides.ok());
  EXPECT_EQ(short_strides.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(short_strides.status().message()),
              HasSubstr("slice strides must have length equal to the number of dimensions of the operand"));
  // lax.slice's docstring: x[0:3, 0:4:2]-style shapes; (6 - 1) / 2 rounds up to 3, (5 - 0) / 3 to 2.
  absl::StatusOr<std::vector<Array>> shaped = run({1, 0}, {6, 5}, {2, 3});
  ASSERT_TRUE(shaped.ok()) << shaped.status();
  EXPECT_EQ((*shaped)[0].shape(), (Shape{3, 2}));
  expect_near(fetch((*shaped)[0]), host_slice(x, {1, 0}, {6, 5}, {2, 3}), 0);
  absl::StatusOr<std::vector<Array>> empty = run({3, 0}, {3, 5}, {2, 2});
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ((*empty)[0].shape(), (Shape{0, 3}));
}

// grad through a strided slice is the cotangent padded with stride - 1 zeros between its
// elements (_slice_transpose_fancy: lax.pad with interior padding): d/dx sum(x[1:14:3, ::2] * w)
// is w at rows 1, 4, 7, 10, 13 and even columns, 0 elsewhere, with x split on the strided
// columns (on Explicit axes not over 8 devices: 4 columns do not divide, JAX's error above).
TEST_F(SliceTest, GradPadsTheCotangentWithInteriorZeros) {
  const HostArray x = random_f32({16, 8}, 3);
  const HostArray w = random_f32({5, 4}, 4);
  std::vector<double> want(x.size(), 0.0);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t c = 0; c < 4; ++c) want[(1 + 3 * r) * 8 + 2 * c] = w.element_as_double(r * 4 + c);
  }
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      const bool flat = mesh.axis_names().size() == 1;
      if (flat && type == AxisType::kExplicit) continue;
      SCOPED_TRACE(mesh.to_string());
      Jitted f = jit(grad([](const std::vector<Value>& in) {
        return std::vector<Value>{sum(slice(in[0], {1, 0}, {14, 8}, {3, 2}) * in[1])};
      }));
      absl::StatusOr<std::vector<Array>> got =
          f({put_on(mesh, x, P(None, flat ? "a" : "b")), put_on(mesh, w, flat ? P() : P(None, "b"))});
      ASSERT_TRUE(got.ok()) << got.status();
      expect_near(fetch((*got)[0]), want, 0);
      // Dimension 1 (::2 of 8, over 'b' of 2, w split there too) is aligned: on Auto axes its
      // cotangent is spread in runs of 2 and merged back, not padded with an interior cut (which
      // gathered it), so nothing moves. Explicit axes keep pad (JAX's type rule).
      if (type == AxisType::kAuto && !flat && mesh.axis_size("a") == 4) {
        for (const char* collective : {"all_gather", "all_to_all", "collective_permute"}) {
          EXPECT_THAT(f.as_text(), ::testing::Not(HasSubstr(collective))) << f.as_text();
        }
      }
    }
  }
}

// vmap over a strided slice slices each example alike (_slice_batching_rule: stride 1 on the
// batch dimension).
TEST_F(SliceTest, VmapSlicesEachExample) {
  const HostArray xs = random_f32({4, 9}, 5);
  absl::StatusOr<std::vector<Array>> got = jit(vmap([](const std::vector<Value>& in) {
    return std::vector<Value>{slice(in[0], {2}, {9}, {3})};
  }))({put_on(*auto_mesh_, xs, P("data", None))});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(fetch((*got)[0]), host_slice(xs, {0, 2}, {4, 9}, {1, 3}), 0);
}

// lax.rev keeps the operand's sharding (_rev_sharding_rule), a split reversed dimension
// included: each device reverses its block and the blocks trade places (position p along the
// dimension's axes takes n-1-p's), one collective_permute and never a gather. Reversing an
// unsplit dimension is local. Values against numpy's x[::-1] by loops, on every mesh and mode.
TEST_F(SliceTest, RevKeepsTheSplitAndPermutesTheBlocks) {
  const HostArray x = random_f32({16, 8}, 6);
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      for (const RevCase& c : kRevCases) {
        for (const PartitionSpec& spec : {split_spec(mesh), P(None, mesh.axis_names().back())}) {
          expect_rev_permutes_the_blocks(mesh, x, spec, c);
        }
      }
    }
  }
}

// A dimension split over two mesh axes, P(('a', 'b'), None) or P(None, ('b', 'a')): its blocks
// are numbered over both axes, the first major, and the block of position p goes to N-1-p of
// the N = |a|*|b| devices along the dimension, so rev is one collective_permute over both axes
// (reversing only the first axis's digit would leave each group of 'b' blocks in its order),
// and the split is kept (_rev_sharding_rule). Values against numpy's x[::-1] by loops.
TEST_F(SliceTest, RevOfADimensionSplitOverTwoAxesPermutesOverBoth) {
  const HostArray x = random_f32({16, 16}, 12);
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      if (mesh.axis_names().size() != 2) continue;
      for (const PartitionSpec& spec : {P(Axes{"a", "b"}, None), P(None, Axes{"b", "a"})}) {
        for (const RevCase& c : kRevCases) expect_rev_permutes_the_blocks(mesh, x, spec, c);
      }
    }
  }
}

// rev is linear (lax.py: ad.deflinear2(rev_p, ...)), and it only moves elements, so a result
// pending a sum (a matmul whose contraction is split) or a max (a reduce_max over a split
// dimension) reverses before or after the reduction alike. On Auto axes: values against the
// host's loops, and the plan reduces once (one all_reduce or reduce_scatter), permutes the
// blocks of the split reversed dimension once, and gathers nothing.
TEST_F(SliceTest, APendingSumOrMaxPassesThroughRev) {
  const HostArray x = random_f32({16, 8}, 13);
  const HostArray w = random_f32({8, 6}, 14);
  std::vector<double> product(16 * 6, 0.0), row_max(16, -1e30);
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < 6; ++j) {
      for (int64_t k = 0; k < 8; ++k)
        product[i * 6 + j] += x.element_as_double(i * 8 + k) * w.element_as_double(k * 6 + j);
    }
    for (int64_t k = 0; k < 8; ++k) row_max[i] = std::max(row_max[i], x.element_as_double(i * 8 + k));
  }
  HostArray product_array(DType::kF32, {16, 6});
  for (size_t i = 0; i < product.size(); ++i) product_array.mutable_values<float>()[i] = static_cast<float>(product[i]);
  const std::vector<double> reversed_max(row_max.rbegin(), row_max.rend());
  for (const Mesh& mesh : meshes(AxisType::kAuto)) {
    // Rows over 'a' and the contraction over 'b' (on (8), the contraction over 'a'): the
    // matmul's result is pending a sum over the contraction's axis.
    const bool two = mesh.axis_names().size() == 2;
    const PartitionSpec xs = two ? P("a", "b") : P(None, "a");
    const PartitionSpec ws = two ? P("b", None) : P("a", None);
    auto expect_reduces_once = [&](const std::string& program, bool permute) {
      for (const char* collective : {"all_gather", "all_to_all"}) {
        EXPECT_THAT(program, ::testing::Not(HasSubstr(collective))) << program;
      }
      EXPECT_EQ(count_of(program, "all_reduce") + count_of(program, "reduce_scatter"), 1u) << program;
      EXPECT_EQ(count_of(program, "collective_permute"), permute ? 1u : 0u) << program;
      // Passed through, not settled first: the reduction comes after the local rev.
      const size_t reduced = std::min(program.find("= all_reduce("), program.find("= reduce_scatter("));
      EXPECT_LT(program.find("= rev("), reduced) << "the reduction should follow the rev\n" << program;
    };
    for (const RevCase& c : {RevCase{"rev(x @ w, {0})", {0}, true, false}, RevCase{"rev(x @ w, {1})", {1}, false, true},
                             RevCase{"rev(x @ w, {0, 1})", {0, 1}, true, true}}) {
      SCOPED_TRACE(absl::StrCat(c.name, " with x ", xs.to_string(), " on ", mesh.to_string()));
      Jitted f =
          jit([&](const std::vector<Value>& in) { return std::vector<Value>{rev(matmul(in[0], in[1]), c.dims)}; });
      absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, xs), put_on(mesh, w, ws)});
      ASSERT_TRUE(got.ok()) << got.status();
      expect_near(fetch((*got)[0]), host_rev(product_array, c.rows, c.cols), 1e-5);
      expect_reduces_once(f.as_text(), two && c.rows);
    }
    // The row max over the split columns is pending a max over the columns' axis.
    SCOPED_TRACE(absl::StrCat("rev(max(x, {1}), {0}) with x ", xs.to_string(), " on ", mesh.to_string()));
    Jitted g = jit([](const std::vector<Value>& in) { return std::vector<Value>{rev(max(in[0], {1}), {0})}; });
    absl::StatusOr<std::vector<Array>> got = g({put_on(mesh, x, xs)});
    ASSERT_TRUE(got.ok()) << got.status();
    expect_near(fetch((*got)[0]), reversed_max, 0);
    expect_reduces_once(g.as_text(), two);
  }
}

// rev_p has no ur_rule (lax.py registers rev_p with a sharding_rule and a vma_rule only), so
// call_ur_rule (jax/_src/lax/utils.py) refuses an operand with unreduced or reduced axes:
// "unreduced/reduced rule for rev is not implemented". Explicit axes only (on Auto axes there
// are no typed unreduced or reduced axes).
TEST_F(SliceTest, RevRefusesAnUnreducedOrReducedOperandOnExplicitAxes) {
  const HostArray x = random_f32({16, 8}, 15);
  for (const Mesh& mesh : meshes(AxisType::kExplicit)) {
    if (mesh.axis_names().size() != 2) continue;
    SCOPED_TRACE(mesh.to_string());
    auto refusal = [](const Jitted& f, const Array& arg) {
      absl::StatusOr<std::vector<Array>> got = f({arg});
      EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
      return std::string(got.status().message());
    };
    const Jitted reduced = jit([](const std::vector<Value>& in) { return std::vector<Value>{rev(in[0], {0})}; });
    EXPECT_THAT(refusal(reduced, put_on(mesh, x, P("a", None).with_reduced({"b"}))),
                ::testing::AllOf(HasSubstr("rev: unreduced/reduced rule for rev is not implemented"),
                                 HasSubstr("(operand f32[16@a,8]{R:b})")));
    const Jitted unreduced = jit([](const std::vector<Value>& in) {
      return std::vector<Value>{rev(reshard(in[0], P("a", None).with_unreduced({"b"})), {1})};
    });
    EXPECT_THAT(refusal(unreduced, put_on(mesh, x, P("a", None))),
                ::testing::AllOf(HasSubstr("rev: unreduced/reduced rule for rev is not implemented"),
                                 HasSubstr("(operand f32[16@a,8]{U:b})")));
  }
}

// jnp's x[::-2] under jit (jax/_src/numpy/indexing.py NDIndexer.to_static_slice and
// _static_slice): the slice of the same rows from the lowest, x[1:16:2], then lax.rev of the
// dimension. On a split dimension the slice is aligned (each device keeps its block's odd
// rows) and the rev permutes the blocks: the split is kept and nothing is gathered. x[5:1:-2]
// is x[3:6:2] reversed: rows 5 and 3.
TEST_F(SliceTest, NegativeStepIsASliceThenRevKeepingTheSplit) {
  const HostArray x = random_f32({16, 8}, 7);
  std::vector<double> want;
  for (int64_t i = 15; i >= 0; i -= 2) {
    for (int64_t j = 0; j < 8; ++j) want.push_back(x.element_as_double(i * 8 + j));
  }
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      SCOPED_TRACE(mesh.to_string());
      // x[::-2]: the aligned x[1::2], then rev.
      Jitted f = jit([](const std::vector<Value>& in) {
        return std::vector<Value>{rev(slice(in[0], {1, 0}, {16, 8}, {2, 1}), {0})};
      });
      const PartitionSpec spec = P("a", None);
      absl::StatusOr<std::vector<Array>> got = f({put_on(mesh, x, spec)});
      ASSERT_TRUE(got.ok()) << got.status();
      expect_near(fetch((*got)[0]), want, 0);
      EXPECT_EQ((*got)[0].sharding().spec(), spec);
      EXPECT_THAT(f.as_text(), HasSubstr("collective_permute")) << f.as_text();
      // x[5:1:-2] keeps 2 rows: on Explicit axes of more than 2 devices that is JAX's own
      // slicing error (the out dimension does not divide), so only Auto axes compute it here.
      if (type != AxisType::kAuto) continue;
      Jitted g = jit([](const std::vector<Value>& in) {
        return std::vector<Value>{rev(slice(in[0], {3, 0}, {6, 8}, {2, 1}), {0})};
      });
      absl::StatusOr<std::vector<Array>> two = g({put_on(mesh, x, spec)});
      ASSERT_TRUE(two.ok()) << two.status();
      std::vector<double> five_three = host_slice(x, {5, 0}, {6, 8}, {1, 1});
      const std::vector<double> three = host_slice(x, {3, 0}, {4, 8}, {1, 1});
      five_three.insert(five_three.end(), three.begin(), three.end());
      expect_near(fetch((*two)[0]), five_three, 0);
    }
  }
}

// grad of rev is rev of the cotangent (lax.py: ad.deflinear2(rev_p, lambda t, ...: [rev(t,
// dimensions)])): d/dx sum(rev(x, {0, 1}) * w) is w reversed along both, x split on both.
TEST_F(SliceTest, GradOfRevReversesTheCotangent) {
  const HostArray x = random_f32({16, 8}, 8);
  const HostArray w = random_f32({16, 8}, 9);
  for (AxisType type : {AxisType::kAuto, AxisType::kExplicit}) {
    for (const Mesh& mesh : meshes(type)) {
      SCOPED_TRACE(mesh.to_string());
      absl::StatusOr<std::vector<Array>> got = jit(grad([](const std::vector<Value>& in) {
        return std::vector<Value>{sum(rev(in[0], {0, 1}) * in[1])};
      }))({put_on(mesh, x, split_spec(mesh)), put_on(mesh, w, split_spec(mesh))});
      ASSERT_TRUE(got.ok()) << got.status();
      expect_near(fetch((*got)[0]), host_rev(w, true, true), 0);
      EXPECT_EQ((*got)[0].sharding().spec(), split_spec(mesh));
    }
  }
}

// vmap of rev reverses each example along its own dimension (_rev_batch_rule shifts the
// dimensions past the batch dimension): rev(x, {0}) of each row is the row reversed.
TEST_F(SliceTest, VmapRevReversesEachExample) {
  const HostArray xs = random_f32({4, 9}, 10);
  absl::StatusOr<std::vector<Array>> got = jit(vmap([](const std::vector<Value>& in) {
    return std::vector<Value>{rev(in[0], {0})};
  }))({put_on(*auto_mesh_, xs, P("data", None))});
  ASSERT_TRUE(got.ok()) << got.status();
  expect_near(fetch((*got)[0]), host_rev(xs, false, true), 0);
}

// JAX's _rev_shape_rule (jax/_src/lax/lax.py) raises a TypeError, the input being wrong, for
// dimensions that repeat ("rev dimensions must be unique, got (1, 1)."), that reach the
// operand's rank ("rev dimensions must all be less than operand ndim, got dimensions (2,) for
// operand ndim 2.") and, through _check_shapelike, that are negative ("rev dimensions must
// have every element be nonnegative"): lax.rev takes no negative dimension. Tessera's
// counterpart is INVALID_ARGUMENT; its words are its own (core/op.cc's check of an op's
// dimensions), so this asserts the meaning: the op and operand, the dimension at fault and why.
TEST_F(SliceTest, RevRefusesRepeatedOutOfRangeOrNegativeDimensionsAsJax) {
  const HostArray x = random_f32({6, 5}, 11);
  auto refusal = [&](Dims dims) {
    absl::StatusOr<std::vector<Array>> got = jit([=](const std::vector<Value>& in) {
      return std::vector<Value>{rev(in[0], dims)};
    })({put_on(*auto_mesh_, x, P())});
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
    return std::string(got.status().message());
  };
  EXPECT_THAT(refusal({1, 1}),
              ::testing::AllOf(HasSubstr("rev of f32[6,5] along {1,1}"), HasSubstr("1 appears twice")));
  EXPECT_THAT(refusal({0, 2}),
              ::testing::AllOf(HasSubstr("rev of f32[6,5] along {0,2}"), HasSubstr("2 is out of range for rank 2")));
  EXPECT_THAT(refusal({-1}),
              ::testing::AllOf(HasSubstr("rev of f32[6,5] along {-1}"), HasSubstr("-1 is out of range for rank 2")));
}

}  // namespace
}  // namespace tessera

// vmap over arrays laid out on a mesh, run under jit on an embedded cluster: explicitly
// sharded arguments (JAX's "sharding in types" vmap: tests/pjit_test.py, ShardingInTypesTest's
// test_mul_vmap, test_dot_general_vmap, test_reshape_vmap, test_shit_vmap_error_check,
// test_spmd_axis_name_explicit_mode_assert, test_unmapped_last_vmap) and spmd_axis_name
// (PJitTest's test_with_sharding_constraint_spmd_axis_name, test_wsc_vmap_abstract_mesh,
// test_with_sharding_constraint_vmap_spmd_axis_name_error). Values against the host, shardings
// as JAX's tests assert them.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

using jit_support::expect_near;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

// 0, 1, 2, ... as float32 in `shape` (JAX's tests' np.arange(n).reshape(shape)).
HostArray arange(Shape shape) {
  HostArray a(DType::kF32, std::move(shape));
  float v = 0;
  for (float& x : a.mutable_values<float>()) x = v++;
  return a;
}

std::vector<double> values_of(const HostArray& a) {
  return std::vector<double>(a.values<float>().begin(), a.values<float>().end());
}

class VmapTest : public jit_support::LocalJitSuite {
 protected:
  // JAX's tests' jtu.with_explicit_mesh((2, 2), ('x', 'y')), or with other axis types.
  static Mesh mesh_2x2(AxisType type = AxisType::kExplicit) {
    absl::StatusOr<Mesh> mesh = client_->make_mesh({2, 2}, {"x", "y"}, {type, type});
    EXPECT_TRUE(mesh.ok()) << mesh.status();
    return *mesh;
  }
  static void expect_sharding(const Array& a, const Mesh& mesh, const PartitionSpec& spec) {
    EXPECT_TRUE(a.sharding().is_equivalent_to(NamedSharding(mesh, spec), static_cast<int>(a.shape().size())))
        << a.sharding().to_string() << " is not " << spec.to_string();
  }
  // The vmap-of-shard_map check: a body reading a mapped argument x (a row of xs, f32[8,16] laid
  // out as `xs_spec`), an unmapped one w (f32[16] as `w_spec`), a psum and axis_index, with in
  // and out specs P(spec), run as jit(vmap(shard_map, {0, None}, spmd_axis_name = spmd)). The
  // result must be laid out as `out_sharding`, and each row is what the host computes as the
  // body defines it: x * w + <x, w> + the position of the element's block along `spec`.
  static void check_vmapped_shard_map(const Mesh& mesh, const Axes& spec_axes, const Axes& spmd,
                                      const PartitionSpec& xs_spec, const PartitionSpec& w_spec,
                                      const PartitionSpec& out_sharding) {
    constexpr int64_t kBatch = 8, kLength = 16;
    const HostArray xs = arange({kBatch, kLength});
    HostArray w(DType::kF32, {kLength});
    for (int64_t j = 0; j < kLength; ++j) w.mutable_values<float>()[j] = 0.25f * static_cast<float>(j % 5) - 0.5f;
    const PartitionSpec spec{std::vector<Axes>{spec_axes}};
    ShardMapped sm = shard_map(
        [&spec_axes](const std::vector<Value>& in) {
          const Value y = in[0] * in[1];
          const Value position = convert(axis_index(AxisNames(spec_axes)), DType::kF32);
          return std::vector<Value>{y + psum(sum(y, {0}), AxisNames(spec_axes)) + position};
        },
        mesh, {spec, spec}, {spec});
    TracedFunction f = [&sm](const std::vector<Value>& in) { return sm(in); };
    absl::StatusOr<std::vector<Array>> out =
        jit(vmap(f, {0, std::nullopt}, {}, std::nullopt, spmd))({put_on(mesh, xs, xs_spec), put_on(mesh, w, w_spec)});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_sharding((*out)[0], mesh, out_sharding);
    const int64_t block = kLength / mesh.axes_size(spec_axes);
    std::vector<double> want;
    for (int64_t b = 0; b < kBatch; ++b) {
      double dot = 0;
      for (int64_t j = 0; j < kLength; ++j) dot += xs.values<float>()[b * kLength + j] * w.values<float>()[j];
      for (int64_t j = 0; j < kLength; ++j) {
        want.push_back(xs.values<float>()[b * kLength + j] * w.values<float>()[j] + dot +
                       static_cast<double>(j / block));
      }
    }
    expect_near(fetch((*out)[0]), want);
  }
};

// test_mul_vmap: the example is typed without the batch dimension (P('y')), the result keeps
// the argument's sharding, and so does the gradient of its sum.
TEST_F(VmapTest, ExplicitlyShardedArgumentsMapWithTheirOtherDimensionsSplit) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({8, 2});
  std::vector<double> want;
  for (float v : x.values<float>()) want.push_back((v * 2.0) * (v * 2.0));
  std::vector<std::string> seen;
  TracedFunction f = [&seen](const std::vector<Value>& in) {
    seen.push_back(type_of(in[0]).to_string());
    Value y = in[0] * 2.0;
    seen.push_back(type_of(y).to_string());
    y = y * y;
    seen.push_back(type_of(y).to_string());
    return std::vector<Value>{y};
  };
  const Array xs = put_on(mesh, x, P("x", "y"));
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f))({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(seen, ElementsAre("f32[2@y]", "f32[2@y]", "f32[2@y]"));
  expect_sharding((*out)[0], mesh, P("x", "y"));
  EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[8@x,2@y]");
  expect_near(fetch((*out)[0]), want);

  // grad of the sum: 2 * (2x) * 2 = 8x, laid out as x.
  absl::StatusOr<std::vector<Array>> g =
      jit(grad([&f](const std::vector<Value>& in) { return std::vector<Value>{sum(vmap(f)(in)[0])}; }))({xs});
  ASSERT_TRUE(g.ok()) << g.status();
  expect_sharding((*g)[0], mesh, P("x", "y"));
  std::vector<double> want_grad;
  for (float v : x.values<float>()) want_grad.push_back(8.0 * v);
  expect_near(fetch((*g)[0]), want_grad);
}

// test_dot_general_vmap: both mapped dimensions split over 'x'; the einsum's out_sharding
// P(None, 'y') holds per example, and the mapped dimension, put last, keeps 'x'.
TEST_F(VmapTest, ExplicitContractionWithOutShardingMapsOverASplitDimension) {
  const Mesh mesh = mesh_2x2();
  const HostArray a = arange({4, 2, 2}), b = arange({2, 4, 2});
  TracedFunction f = [](const std::vector<Value>& in) {
    return std::vector<Value>{einsum("xy,yz->xz", in[0], in[1], P(None, "y"))};
  };
  absl::StatusOr<std::vector<Array>> out =
      jit(vmap(f, {0, 1}, {2}))({put_on(mesh, a, P("x", None, "y")), put_on(mesh, b, P(None, "x", "y"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].shape(), (Shape{2, 2, 4}));
  expect_sharding((*out)[0], mesh, P(None, "y", "x"));
  // out[i, k, n] = sum_j a[n, i, j] * b[j, n, k]
  std::vector<double> want(16);
  const auto av = a.values<float>(), bv = b.values<float>();
  for (int i = 0; i < 2; ++i) {
    for (int k = 0; k < 2; ++k) {
      for (int n = 0; n < 4; ++n) {
        double s = 0;
        for (int j = 0; j < 2; ++j) s += av[n * 4 + i * 2 + j] * bv[j * 8 + n * 2 + k];
        want[i * 8 + k * 4 + n] = s;
      }
    }
  }
  expect_near(fetch((*out)[0]), want);
}

// test_reshape_vmap: mapped along dimension 1 (split over 'x'); reshape's out_sharding holds
// per example and the result's mapped dimension, first, keeps 'x'.
TEST_F(VmapTest, ExplicitReshapeWithOutShardingMapsOverASplitDimension) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({2, 8});
  std::string seen;
  TracedFunction f = [&seen](const std::vector<Value>& in) {
    Value y = reshape(in[0], {1, 2}, P(None, "y")) * 2.0;
    seen = type_of(y).to_string();
    return std::vector<Value>{y};
  };
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f, {1}))({put_on(mesh, x, P(None, "x"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(seen, "f32[1,2@y]");
  EXPECT_EQ((*out)[0].shape(), (Shape{8, 1, 2}));
  expect_sharding((*out)[0], mesh, P("x", None, "y"));
  std::vector<double> want;  // out[n, 0, i] = 2 * x[i, n]
  for (int n = 0; n < 8; ++n) {
    for (int i = 0; i < 2; ++i) want.push_back(2.0 * x.values<float>()[i * 8 + n]);
  }
  expect_near(fetch((*out)[0]), want);
}

// test_unmapped_last_vmap: a result that depends on no mapped argument is broadcast along the
// mapped dimension split as the arguments' was.
TEST_F(VmapTest, AnUnmappedResultGetsTheMappedDimensionsSplit) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({2}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  TracedFunction f = [](const std::vector<Value>&) { return std::vector<Value>{full({4}, 0.0)}; };
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f, {0}, {-1}))({put_on(*mesh, arange({8}), P("x"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].shape(), (Shape{4, 8}));
  expect_sharding((*out)[0], *mesh, P(None, "x"));
  expect_near(fetch((*out)[0]), std::vector<double>(32, 0.0));
}

// test_spmd_axis_name_explicit_mode_assert: spmd_axis_name naming the axis the arguments split
// the mapped dimension over is that split; naming another is an error (JAX's wording).
TEST_F(VmapTest, SpmdAxisNameMustBeTheExplicitSplitOfTheMappedDimension) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({8, 2});
  const Array xs = put_on(mesh, x, P("x", "y"));
  std::vector<std::string> seen;
  TracedFunction f = [&seen](const std::vector<Value>& in) {
    seen.push_back(type_of(in[0]).to_string());
    return std::vector<Value>{in[0] * 2.0};
  };
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f, {}, {}, std::nullopt, {"x"}))({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(seen, ElementsAre("f32[2@y]"));
  expect_sharding((*out)[0], mesh, P("x", "y"));
  std::vector<double> want;
  for (float v : x.values<float>()) want.push_back(2.0 * v);
  expect_near(fetch((*out)[0]), want);

  out = jit(vmap(f, {}, {}, std::nullopt, {"y"}))({xs});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(),
              HasSubstr("vmap: Only one of spmd_axis_name or arrays sharded on `Explicit` mesh axis type is allowed. "
                        "Got spmd_axis_name=('y',) and arrays sharded on explicit_mesh_axis=('x',)"));
}

// test_shit_vmap_error_check (and _check_ema_unmapped_args, jax/_src/api.py): the mapped
// dimensions must be split alike, and an unmapped argument must not use their axes.
TEST_F(VmapTest, MappedDimensionsSplitDifferentlyAreAnError) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({8, 2}), xt = arange({2, 8});
  TracedFunction f = [](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; };
  absl::StatusOr<std::vector<Array>> out =
      jit(vmap(f, {0, 1}))({put_on(mesh, x, P("x", None)), put_on(mesh, xt, P(None, "y"))});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(),
              HasSubstr("vmap: Mapped away dimension of inputs passed to vmap should be sharded the same. Got "
                        "inconsistent axis specs: x vs y"));

  TracedFunction add = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; };
  out = jit(vmap(add, {0, std::nullopt}))({put_on(mesh, x, P("x", None)), put_on(mesh, arange({2}), P("x"))});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(),
              HasSubstr("vmap: Unmapped values passed to vmap cannot be sharded along the mesh axis you are vmapping "
                        "over. Got type: f32[2@x], in_axes: None and vmapped mesh axis: ('x',)"));
}

// vmap over a split dimension through the other families: a reduction, a broadcast operand, a
// scan carrying the batch, a with_sharding_constraint (reshard) per example; values against
// the host and the mapped dimension's split kept.
TEST_F(VmapTest, ExplicitSplitMapsThroughReductionsScansAndConstraints) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({8, 4});
  TracedFunction f = [](const std::vector<Value>& in) {
    const Value row = reshard(in[0], P("y"));    // f32[4@y]
    const Value centred = row - sum(row) / 4.0;  // a reduction, broadcast back
    const Value w = iota(DType::kF32, {4}, 0);   // unmapped: broadcast along the batch
    ScanResult r = scan(
        [&](const std::vector<Value>& c, const std::vector<Value>&) {
          return ScanStep{{c[0] + centred * w}, {}};
        },
        {centred * 0.0}, {}, 3);
    return std::vector<Value>{r.carry[0]};
  };
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f))({put_on(mesh, x, P("x", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_sharding((*out)[0], mesh, P("x", "y"));
  std::vector<double> want;
  for (int n = 0; n < 8; ++n) {
    double mean = 0;
    for (int j = 0; j < 4; ++j) mean += x.values<float>()[n * 4 + j] / 4.0;
    for (int j = 0; j < 4; ++j) want.push_back(3.0 * (x.values<float>()[n * 4 + j] - mean) * j);
  }
  expect_near(fetch((*out)[0]), want);
}

// spmd_axis_name on Auto axes (PJitTest.test_with_sharding_constraint_spmd_axis_name): a
// constraint to P('data', None, None) per example is P('mdl', 'data', None, None) on the batch,
// also inside a scan. JAX's test asserts the scan's result laid out so too; Tessera's loop
// keeps its carry laid out as its initial value (replicated here), so there the constraint in
// the body is what is checked.
TEST_F(VmapTest, SpmdAxisNameSplitsTheMappedDimensionOfConstraints) {
  absl::StatusOr<Mesh> mesh =
      client_->make_mesh({2, 2, 2}, {"replica", "data", "mdl"}, {AxisType::kAuto, AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const HostArray x = arange({8, 4, 2, 2});
  const NamedSharding data(*mesh, P("data", None, None));
  TracedFunction f = [&](const std::vector<Value>& in) {
    return std::vector<Value>{with_sharding_constraint(in[0], data)};
  };
  const Array xs = put_on(*mesh, x, P());
  Jitted jitted = jit(vmap(f, {}, {}, std::nullopt, {"mdl"}));
  absl::StatusOr<std::vector<Array>> out = jitted({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_sharding((*out)[0], *mesh, P("mdl", "data", None, None));
  expect_near(fetch((*out)[0]), values_of(x));

  TracedFunction with_scan = [&](const std::vector<Value>& in) {
    ScanResult r = scan(
        [&](const std::vector<Value>& c, const std::vector<Value>&) {
          return ScanStep{{f(c)[0]}, {}};
        },
        in, {}, 1);
    return r.carry;
  };
  jitted = jit(vmap(with_scan, {}, {}, std::nullopt, {"mdl"}));
  out = jitted({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(jitted.as_text(), HasSubstr("-> P('mdl', 'data', None, None))"));
  expect_near(fetch((*out)[0]), values_of(x));

  // Without spmd_axis_name the mapped dimension is left whole.
  out = jit(vmap(f))({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_sharding((*out)[0], *mesh, P(None, "data", None, None));
}

// PJitTest.test_wsc_vmap_abstract_mesh: P('x') per example is P(None, 'x') on the batch, and
// P('y', 'x') with spmd_axis_name='y'; test_with_sharding_constraint_vmap_spmd_axis_name_error:
// the spec may not name spmd_axis_name.
TEST_F(VmapTest, SpmdAxisNameOnAutoAxes) {
  const Mesh mesh = mesh_2x2(AxisType::kAuto);
  const HostArray x = arange({8, 2});
  TracedFunction f = [&mesh](const std::vector<Value>& in) {
    return std::vector<Value>{with_sharding_constraint(in[0], NamedSharding(mesh, P("x"))) * 2.0};
  };
  const Array xs = put_on(mesh, x, P("x", "y"));
  std::vector<double> want;
  for (float v : x.values<float>()) want.push_back(2.0 * v);
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f))({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_sharding((*out)[0], mesh, P(None, "x"));
  expect_near(fetch((*out)[0]), want);
  out = jit(vmap(f, {}, {}, std::nullopt, {"y"}))({xs});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_sharding((*out)[0], mesh, P("y", "x"));
  expect_near(fetch((*out)[0]), want);

  out = jit(vmap(f, {}, {}, std::nullopt, {"x"}))({xs});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(),
              HasSubstr("vmap: vmap spmd_axis_name ('x',) cannot appear in with_sharding_constraint spec, but got "
                        "spec P('x',)"));
  out = jit(vmap(f, {}, {}, std::nullopt, {"z"}))({xs});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(), HasSubstr("vmap spmd_axis_name 'z' is not an axis of Mesh('x': 2, 'y': 2"));
}

// vmap of a shard_map (jax/_src/shard_map.py's _shard_map_batch): each batched argument's
// in_spec and each batched result's out_spec gain the batch dimension first, whole
// (tests/shard_map_test.py test_vmap_basic, test_vmap with bdims (0, None)) or split over
// spmd_axis_name (test_vmap_spmd_axis_name: P('x') becomes P('y', 'x')). The body reads a
// batched argument, an unbatched one, a psum and axis_index; the host computes each example as
// the body defines it: x * w + <x, w> + the position of the element's block.
TEST_F(VmapTest, VmapOfAShardMapRunsTheBodyOnTheBatchedBlocks) {
  struct Case {
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    Axes spec;                   // the example's in_spec and out_spec: P(spec)
    Axes spmd;                   // vmap's spmd_axis_name
    PartitionSpec out_sharding;  // the result's, as JAX's batch_spec gives it
  };
  const Case cases[] = {
      {{8}, {"x"}, {"x"}, {}, P(None, "x")},
      {{4, 2}, {"data", "model"}, {"data", "model"}, {}, P(None, Axes{"data", "model"})},
      {{4, 2}, {"data", "model"}, {"model"}, {"data"}, P("data", "model")},
      {{4, 2}, {"data", "model"}, {"data"}, {"model"}, P("model", "data")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(
        absl::StrCat(axes_to_string(c.names), " spec ", axes_to_string(c.spec), " spmd ", axes_to_string(c.spmd)));
    absl::StatusOr<Mesh> mesh = c.shape.size() == 1
                                    ? client_->make_mesh(c.shape, c.names, {AxisType::kAuto})
                                    : client_->make_mesh(c.shape, c.names, {AxisType::kAuto, AxisType::kAuto});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    check_vmapped_shard_map(*mesh, c.spec, c.spmd, P(), P(), c.out_sharding);
  }
}

// The gradient of a shard_map under vmap (tests/shard_map_test.py test_vmap_of_grad_spmd_axis_name,
// test_vmap_grad_shmap_spmd_axis_name_residuals: sin over 'j' on a (4, 2) ('i', 'j') mesh): each
// example's gradient is cos(x). With spmd_axis_name 'i' it is refused: Tessera's gradient of the
// shard_map sums the argument's cotangent over 'i', which its in_spec leaves out, and with the
// batch split over 'i' that sum would add different examples (JAX's gradient has no such sum,
// and its test only checks that it runs).
TEST_F(VmapTest, VmapOfTheGradientOfAShardMap) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"i", "j"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  HostArray xs = arange({4, 16});
  for (float& v : xs.mutable_values<float>()) v *= 0.1f;
  ShardMapped sm =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{sin(in[0])}; }, *mesh, {P("j")}, {P("j")});
  TracedFunction loss = [&sm](const std::vector<Value>& in) { return std::vector<Value>{sum(sm(in)[0], {0})}; };
  std::vector<double> want;
  for (float v : xs.values<float>()) want.push_back(std::cos(static_cast<double>(v)));
  const Array x = put_on(*mesh, xs, P());
  absl::StatusOr<std::vector<Array>> out = jit(vmap(grad(loss)))({x});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_near(fetch((*out)[0]), want);

  out = jit(vmap(grad(loss), {}, {}, std::nullopt, {"i"}))({x});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(
      out.status().message(),
      HasSubstr("in a shard_map body batched over vmap spmd_axis_name ('i',) would combine different examples"));
}

// tests/shard_map_test.py test_vmap_spmd_axis_name_error and test_temporary_error_suppression_flag:
// spmd_axis_name may appear in no in_spec or out_spec of the shard_map, batched or not.
TEST_F(VmapTest, SpmdAxisNameInAShardMapsSpecsIsJaxsError) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({4, 2}, {"i", "j"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const Array xs = put_on(*mesh, arange({4, 16}), P());
  const auto expect_error = [&](const TracedFunction& f, const std::vector<std::optional<int64_t>>& in_axes,
                                const std::vector<Array>& args, const std::string& message) {
    absl::StatusOr<std::vector<Array>> out = jit(vmap(f, in_axes, {}, std::nullopt, {"i"}))(args);
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(out.status().message(), HasSubstr(message));
  };
  ShardMapped f =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{sin(in[0])}; }, *mesh, {P("i")}, {P("i")});
  expect_error([&f](const std::vector<Value>& in) { return f(in); }, {}, {xs},
               "vmap: vmap spmd_axis_name cannot appear in shard_map in_specs: ('i',) is in P('i',)");
  ShardMapped g = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{sin(in[0])}; }, *mesh,
                            {P("j")}, {P(Axes{"i", "j"})}, ShardMapOptions{.check_vma = false});
  expect_error([&g](const std::vector<Value>& in) { return g(in); }, {}, {xs},
               "vmap spmd_axis_name cannot appear in shard_map out_specs: ('i',) is in P(('i', 'j'),)");
  // An unbatched argument's in_spec names it.
  ShardMapped h = shard_map(
      [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + all_gather(in[1], "i", 0, true)}; }, *mesh,
      {P(None), P("i")}, {P(None)}, ShardMapOptions{.check_vma = false});
  expect_error([&h](const std::vector<Value>& in) { return h(in); }, {0, std::nullopt},
               {put_on(*mesh, arange({4, 8}), P()), put_on(*mesh, arange({8}), P())},
               "vmap spmd_axis_name cannot appear in shard_map in_specs: ('i',) is in P('i',)");
}

// vmap of a shard_map over a dimension split over Explicit axes (jax/_src/shard_map.py's
// _shard_map_batch with explicit_mesh_axis): the shard_map is traced manual over the mesh's
// other axes only (_shmap_checks leaves the axis env's explicit_mesh_axis_names out of the
// default axis_names), its specs gain the batch dimension whole, and the result's mapped
// dimension is split over the same axes. tests/shard_map_test.py test_vmap_explicit_mesh_axis
// ((1, 2, 2) ('z', 'x', 'y'): P(('z', 'x'), 'y') in, in_specs P('y'), the result's sharding is
// the argument's) and test_vmap_explicit_mesh_axis_single_axis ((2, 2) ('data', 'model') under
// set_mesh, the shard_map without a mesh: P('data', 'model') out). Then the same with a body that
// reads an unmapped argument, a psum and axis_index on (4, 2), (2, 4) and (1, 2, 2) meshes, each
// example computed by the host as the body defines it: x * w + <x, w> + the position of the
// element's block; and on (8) with the mapped dimension whole (the shard_map manual over 'x').
TEST_F(VmapTest, VmapOfAShardMapOverAnExplicitlySplitDimension) {
  {  // test_vmap_explicit_mesh_axis, as JAX writes it
    absl::StatusOr<Mesh> mesh = client_->make_mesh({1, 2, 2}, {"z", "x", "y"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    ShardMapped f = shard_map([](const std::vector<Value>& in) { return in; }, *mesh, {P("y")}, {P("y")});
    const PartitionSpec s = P(Axes{"z", "x"}, "y");
    absl::StatusOr<std::vector<Array>> out =
        jit(vmap([&f](const std::vector<Value>& in) { return f(in); }))({put_on(*mesh, arange({4, 4}), s)});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_sharding((*out)[0], *mesh, s);
    expect_near(fetch((*out)[0]), values_of(arange({4, 4})));
  }
  {  // test_vmap_explicit_mesh_axis_single_axis: the ambient mesh
    absl::StatusOr<Mesh> named = client_->make_mesh({2, 2}, {"data", "model"});
    ASSERT_TRUE(named.ok()) << named.status();
    MeshScope scope = set_mesh(*named);
    const Array x = put_on(*named, arange({4, 4}), P("data", "model"));
    std::string seen;
    absl::StatusOr<ShardMapped> f = shard_map(
        [&seen](const std::vector<Value>& in) {
          seen = type_of(in[0]).to_string();
          return in;
        },
        {P("model")}, {P("model")});
    ASSERT_TRUE(f.ok()) << f.status();
    absl::StatusOr<std::vector<Array>> out = jit(vmap([&f](const std::vector<Value>& in) { return (*f)(in); }))({x});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(seen, "f32[2]{V:model}");  // one example's block: manual over 'model', 'data' mapped away
    expect_sharding((*out)[0], *named, P("data", "model"));
    expect_near(fetch((*out)[0]), values_of(arange({4, 4})));
  }
  struct Case {
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    Axes mapped;  // the mapped dimension's split
    Axes spec;    // the example's in_spec and out_spec: P(spec)
  };
  const Case cases[] = {
      {{4, 2}, {"data", "model"}, {"data"}, {"model"}},
      {{4, 2}, {"data", "model"}, {"model"}, {"data"}},
      {{2, 4}, {"data", "model"}, {"data"}, {"model"}},
      {{1, 2, 2}, {"z", "x", "y"}, {"z", "x"}, {"y"}},
      {{8}, {"x"}, {}, {"x"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(axes_to_string(c.names), " mapped over ", axes_to_string(c.mapped), " spec ",
                              axes_to_string(c.spec)));
    absl::StatusOr<Mesh> mesh = client_->make_mesh(c.shape, c.names);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const PartitionSpec split{std::vector<Axes>{c.mapped, c.spec}};
    check_vmapped_shard_map(*mesh, c.spec, {}, split, PartitionSpec{std::vector<Axes>{c.spec}}, split);
  }
}

// The gradient of a shard_map under vmap over a dimension split over an Explicit axis (JAX's
// test_vmap_of_grad_spmd_axis_name does it over spmd_axis_name on Auto axes; its
// test_mul_vmap takes grad of a vmap over Explicit axes): each example's gradient of
// sum(sin(x)) is cos(x), laid out as x, on (4, 2) and (2, 4) meshes; and grad of the sum over
// the batch of the vmapped shard_map too.
TEST_F(VmapTest, GradOfAShardMapUnderVmapOverAnExplicitlySplitDimension) {
  HostArray xs = arange({4, 16});
  for (float& v : xs.mutable_values<float>()) v *= 0.1f;
  std::vector<double> want;
  for (float v : xs.values<float>()) want.push_back(std::cos(static_cast<double>(v)));
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{4, 2}, std::vector<int64_t>{2, 4}}) {
    SCOPED_TRACE(absl::StrCat(shape[0], "x", shape[1]));
    absl::StatusOr<Mesh> mesh = client_->make_mesh(shape, {"i", "j"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    ShardMapped sm = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{sin(in[0])}; }, *mesh,
                               {P("j")}, {P("j")});
    TracedFunction loss = [&sm](const std::vector<Value>& in) { return std::vector<Value>{sum(sm(in)[0], {0})}; };
    const Array x = put_on(*mesh, xs, P("i", "j"));
    absl::StatusOr<std::vector<Array>> out = jit(vmap(grad(loss)))({x});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_sharding((*out)[0], *mesh, P("i", "j"));
    expect_near(fetch((*out)[0]), want);

    TracedFunction mapped = vmap([&sm](const std::vector<Value>& in) { return sm(in); });
    out = jit(grad([&mapped](const std::vector<Value>& in) { return std::vector<Value>{sum(mapped(in)[0])}; }))({x});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_sharding((*out)[0], *mesh, P("i", "j"));
    expect_near(fetch((*out)[0]), want);
  }
}

// tests/shard_map_test.py test_vmap_explicit_mesh_axis_error: a shard_map whose axis_names name
// the Explicit axis vmap maps over is JAX's "jax.shard_map requires axis_names ... to be a
// subset of" error, and spmd_axis_name naming another axis JAX's "Only one of spmd_axis_name or
// arrays sharded on `Explicit` mesh axis type is allowed". Specs naming it are _check_specs'
// error.
TEST_F(VmapTest, VmapOfAShardMapManualOverTheMappedExplicitAxisIsJaxsError) {
  const Mesh mesh = mesh_2x2();
  const Array x = put_on(mesh, arange({4, 4}), P("x", "y"));
  ShardMapped f = shard_map([](const std::vector<Value>& in) { return in; }, mesh, {P("x")}, {P("x")},
                            ShardMapOptions{.axis_names = {"x", "y"}});
  const TracedFunction call = [&f](const std::vector<Value>& in) { return f(in); };
  absl::StatusOr<std::vector<Array>> out = jit(vmap(call))({x});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(),
              HasSubstr("shard_map: jax.shard_map requires axis_names=('x', 'y') to be a subset of "
                        "mesh.axis_names=('y',): 'x' is an Explicit axis that an enclosing vmap maps over"));

  out = jit(vmap(call, {}, {}, std::nullopt, {"y"}))({x});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(),
              HasSubstr("vmap: Only one of spmd_axis_name or arrays sharded on `Explicit` mesh axis type is allowed"));

  ShardMapped g = shard_map([](const std::vector<Value>& in) { return in; }, mesh, {P("x")}, {P("x")});
  out = jit(vmap([&g](const std::vector<Value>& in) { return g(in); }))({x});
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(out.status().message(),
              HasSubstr("shard_map: in_specs argument must refer to an axis marked as manual ('y',), but in_specs[0] "
                        "refers to 'x'"));
}

// tests/pjit_test.py test_explicit_ctx_vmap_over_auto_axes: auto_axes with out_sharding P() per
// example, mapped over a dimension split over ('x', 'y'): the result keeps P(('x', 'y'), None).
// JAX's input is all ones; here some entries are zero so that where picks both sides.
TEST_F(VmapTest, AutoAxesUnderVmapOverAnExplicitlySplitDimension) {
  const Mesh mesh = mesh_2x2();
  HostArray x(DType::kF32, {20, 2});
  std::vector<double> want;
  for (size_t k = 0; k < 40; ++k) {
    x.mutable_values<float>()[k] = static_cast<float>(k % 3);
    want.push_back(k % 3 != 0 ? 1.0 : 0.0);
  }
  TracedFunction f = auto_axes(
      [](const std::vector<Value>& in) { return std::vector<Value>{where(in[0] != 0.0, full({2}, 1.0), in[0])}; }, {},
      {P()});
  const PartitionSpec s = P(Axes{"x", "y"}, None);
  absl::StatusOr<std::vector<Array>> out = jit(vmap(f))({put_on(mesh, x, s)});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_sharding((*out)[0], mesh, s);
  expect_near(fetch((*out)[0]), want);
}

// tests/pjit_test.py test_vmap_spmd_axis_name_explicit_axes_inside: on an Auto mesh, vmap with
// spmd_axis_name 'x' of a function that switches to explicit_axes with in_sharding P('y'): the
// types inside are JAX's; JAX's test only runs it, here the product is checked against the host.
// (Before, a reshard inside explicit_axes on an Auto mesh was placed on the switched mesh, which
// jit refused as another mesh.)
TEST_F(VmapTest, ExplicitAxesInsideVmapWithSpmdAxisName) {
  const Mesh mesh = mesh_2x2(AxisType::kAuto);
  MeshScope scope = set_mesh(mesh);  // jtu.with_explicit_mesh sets the mesh
  const HostArray x = arange({2, 8});
  std::vector<std::string> seen;
  TracedFunction f = explicit_axes(
      [&seen](const std::vector<Value>& in) {
        seen.push_back(type_of(in[0]).to_string());
        seen.push_back(type_of(in[1]).to_string());
        const Value a = reshard(in[0], P());
        seen.push_back(type_of(a).to_string());
        const Value out = a * in[1];
        seen.push_back(type_of(out).to_string());
        return std::vector<Value>{out};
      },
      {}, {P("y"), P("y")});
  absl::StatusOr<std::vector<Array>> out =
      jit(vmap(f, {}, {}, std::nullopt, {"x"}))({put_on(mesh, x, P()), put_on(mesh, x, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(seen, ElementsAre("f32[8@y]", "f32[8@y]", "f32[8]", "f32[8@y]"));
  std::vector<double> want;
  for (float v : x.values<float>()) want.push_back(static_cast<double>(v) * v);
  expect_near(fetch((*out)[0]), want);
  // Without vmap too (the reshard inside explicit_axes is placed on the arguments' mesh).
  seen.clear();
  out = jit(f)({put_on(mesh, x, P()), put_on(mesh, x, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(seen, ElementsAre("f32[2@y,8]", "f32[2@y,8]", "f32[2,8]", "f32[2@y,8]"));
  expect_near(fetch((*out)[0]), want);
}

// vmap inside a shard_map body of the casts (jax/_src/lax/parallel.py): the batching rules of
// preduced, vary_unreduced_cast and reduced_vary_cast raise NotImplementedError, and
// all_gather_reduced's raises NotImplementedError("Please file an issue at
// https://github.com/jax-ml/jax/issues"): UNIMPLEMENTED naming the primitive. pvary
// (_pvary_batcher) and all_gather_invariant (_all_gather_invariant_batched_collective) batch:
// their values against the host (each row gathered whole is the argument's row; pvary is the
// row).
TEST_F(VmapTest, CastsJaxDoesNotBatchAreUnimplementedAsJax) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({4, 8});
  const auto run = [&](const std::function<Value(const Value&)>& cast, const PartitionSpec& in,
                       const PartitionSpec& out) {
    ShardMapped body = shard_map(
        [&](const std::vector<Value>& v) {
          TracedFunction each = [&](const std::vector<Value>& r) { return std::vector<Value>{cast(r[0])}; };
          return vmap(each)(v);
        },
        mesh, {in}, {out});
    return jit([&](const std::vector<Value>& v) { return body(v); })({put_on(mesh, x, in)});
  };
  const auto expect_unimplemented = [](const absl::StatusOr<std::vector<Array>>& r, const std::string& what) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(what));
  };
  expect_unimplemented(run([](const Value& r) { return pcast(r, "x", "unreduced"); }, P(None, "x"), P(None, "x")),
                       "vmap: pcast(..., to='unreduced') over ('x',)");
  expect_unimplemented(run([](const Value& r) { return pcast(r, "x", "unreduced"); }, P(None, "x"), P(None, "x")),
                       "JAX's batching rule for vary_unreduced_cast raises NotImplementedError");
  expect_unimplemented(run([](const Value& r) { return pcast(r, "x", "reduced"); }, P(), P()),
                       "JAX's batching rule for preduced raises NotImplementedError");
  expect_unimplemented(run([](const Value& r) { return all_gather(r, "x", 0, true, "reduced"); }, P(None, "x"), P()),
                       "JAX's batching rule for all_gather_reduced raises NotImplementedError: Please file an issue at "
                       "https://github.com/jax-ml/jax/issues");
  // reduced_vary_cast: a row of a value reduced over 'x', cast to varying.
  ShardMapped from_reduced = shard_map(
      [](const std::vector<Value>& v) {
        const Value reduced = pcast(v[0], "x", "reduced");
        TracedFunction each = [](const std::vector<Value>& r) {
          return std::vector<Value>{pcast(r[0], "x", "varying")};
        };
        return vmap(each)({reduced});
      },
      mesh, {P()}, {P(None, "x")});
  expect_unimplemented(jit([&](const std::vector<Value>& v) { return from_reduced(v); })({put_on(mesh, x, P())}),
                       "JAX's batching rule for reduced_vary_cast raises NotImplementedError");

  absl::StatusOr<std::vector<Array>> gathered =
      run([](const Value& r) { return all_gather(r, "x", 0, true, "invarying"); }, P(None, "x"), P());
  ASSERT_TRUE(gathered.ok()) << gathered.status();
  expect_near(fetch((*gathered)[0]), values_of(x));
  absl::StatusOr<std::vector<Array>> varied = run([](const Value& r) { return pcast(r, "y", "varying"); }, P(), P("y"));
  ASSERT_TRUE(varied.ok()) << varied.status();
  std::vector<double> tiled;  // each device's copy along 'y' is a block of the P('y') result
  for (int copy = 0; copy < 2; ++copy) {
    for (double v : values_of(x)) tiled.push_back(v);
  }
  expect_near(fetch((*varied)[0]), tiled);
}

// vmap inside a shard_map body of the sums of an unreduced value (jax/_src/lax/parallel.py):
// psum and psum_scatter over the axes a value is unreduced over are unreduced_psum and
// unreduced_reduce_scatter, whose batching rules (_unreduced_psum_batcher,
// _unreduced_reduce_scatter_batcher: fancy_primitive_batchers, which
// jax/_src/interpreters/batching.py's BatchTrace.process_primitive calls for every primitive bound
// inside vmap) raise NotImplementedError, the second with "Please file an issue at ...", for a
// mapped operand and an unmapped one alike; so does all_gather_reduced's. preduced's is a
// primitive_batchers rule, which binds an unmapped operand as it is; of a mapped gather over
// other axes it is preduced that refuses, not all_gather_reduced. psum of a value that is not
// unreduced batches: its value against the host.
TEST_F(VmapTest, UnreducedSumsJaxDoesNotBatchAreUnimplementedAsJax) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({4, 8});
  // f runs under vmap over the rows of u (v cast to unreduced over 'x') in a body whose
  // argument is split P(None, 'x'); `v` is the body's argument, unmapped.
  const auto run = [&](const std::function<std::vector<Value>(const Value& row, const Value& v)>& f, bool unreduced,
                       const PartitionSpec& out) {
    ShardMapped body = shard_map(
        [&](const std::vector<Value>& in) {
          const Value v = in[0];
          const Value u = unreduced ? pcast(v, "x", "unreduced") : v;
          TracedFunction each = [&](const std::vector<Value>& r) { return f(r[0], v); };
          return std::vector<Value>{vmap(each)({u})[0]};
        },
        mesh, {P(None, "x")}, {out});
    return jit([&](const std::vector<Value>& v) { return body(v); })({put_on(mesh, x, P(None, "x"))});
  };
  const auto expect_unimplemented = [](const absl::StatusOr<std::vector<Array>>& r, const std::string& what) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kUnimplemented) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(what));
  };
  const auto one = [](const Value& v) { return std::vector<Value>{v}; };
  expect_unimplemented(run([&](const Value& r, const Value&) { return one(psum(r, "x")); }, true, P()),
                       "vmap: psum(...) over ('x',) (node %");
  expect_unimplemented(run([&](const Value& r, const Value&) { return one(psum(r, "x")); }, true, P()),
                       "of a mapped value: JAX's batching rule for unreduced_psum raises NotImplementedError");
  expect_unimplemented(run([&](const Value& r, const Value&) { return one(pmean(r, "x")); }, true, P()),
                       "JAX's batching rule for unreduced_psum raises NotImplementedError");
  expect_unimplemented(
      run([&](const Value& r, const Value&) { return one(psum_scatter(r, "x", 0, true)); }, true, P(None, "x")),
      "JAX's batching rule for unreduced_reduce_scatter raises NotImplementedError: Please file an issue at "
      "https://github.com/jax-ml/jax/issues");
  // Unmapped operands: the unreduced value closed over, and all_gather(to='reduced') of v.
  const auto unmapped_psum = [&](const Value& r, const Value& v) {
    return std::vector<Value>{r, psum(pcast(v, "x", "unreduced"), "x")};
  };
  expect_unimplemented(run(unmapped_psum, false, P(None, "x")),
                       "inside vmap, of a value it does not map: JAX's batching rule for unreduced_psum raises "
                       "NotImplementedError");
  const auto unmapped_gather = [&](const Value& r, const Value& v) {
    return std::vector<Value>{r, all_gather(v, "x", 1, true, "reduced")};
  };
  expect_unimplemented(run(unmapped_gather, false, P(None, "x")),
                       "JAX's batching rule for all_gather_reduced raises NotImplementedError: Please file an issue");
  // pcast to reduced over 'y' of a gather over 'x': preduced (primitive_batchers), refused only
  // for the mapped gather, and named preduced.
  const absl::StatusOr<std::vector<Array>> preduced_of_gather =
      run([&](const Value& r, const Value&) { return one(pcast(all_gather(r, "x", 0, true), "y", "reduced")); }, false,
          P());
  expect_unimplemented(preduced_of_gather, "JAX's batching rule for preduced raises NotImplementedError");
  ASSERT_FALSE(preduced_of_gather.ok());
  EXPECT_THAT(preduced_of_gather.status().message(), Not(HasSubstr("all_gather_reduced")));

  // Not unreduced: psum batches (each row summed over the two devices along 'x', each holding
  // 4 of its 8 columns: row i's columns j and j + 4 added).
  absl::StatusOr<std::vector<Array>> summed =
      run([&](const Value& r, const Value&) { return one(psum(r, "x")); }, false, P());
  ASSERT_TRUE(summed.ok()) << summed.status();
  const std::vector<double> host = values_of(x);
  std::vector<double> want;
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 4; ++j) want.push_back(host[i * 8 + j] + host[i * 8 + j + 4]);
  }
  expect_near(fetch((*summed)[0]), want);
}

// A batch of int32 starts (one per example) as a host array.
HostArray int32s(const std::vector<int32_t>& v) {
  HostArray a(DType::kI32, {static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), a.mutable_values<int32_t>().begin());
  return a;
}

// lax's clamp of a dynamic start: into [0, dim - size], so the window fits.
int64_t clamped_start(int64_t start, int64_t dim, int64_t size) { return std::clamp<int64_t>(start, 0, dim - size); }

// vmap of dynamic_slice with per-example starts on an Explicit mesh. JAX batches it as a gather
// (jax/_src/lax/slicing.py, _dynamic_slice_batching_rule -> _gather_batching_rule): operand and
// starts both mapped give a gather whose batch dimension is an operand_batching_dim and a
// start_indices_batching_dim, and _gather_spec_computation resolves the two splits, alike over
// 'x', into the result's: f32[4@x,3]. Starts unmapped: the operand's batch dimension is an offset
// dimension of a full window, so its split stays: f32[4@x,3]. Operand unmapped with the starts
// split: the starts become indices split on a dimension that is not a batching one, which
// _gather_sharding_rule refuses ("would require collectives on inputs"). A window dimension
// split over another axis and taken whole keeps its split.
TEST_F(VmapTest, DynamicSliceWithPerExampleStartsOnASplitBatch) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({2}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  constexpr int64_t kBatch = 4, kLength = 6, kWindow = 3;
  const HostArray x = arange({kBatch, kLength});
  const std::vector<int32_t> starts = {-1, 2, 5, 1};
  std::vector<std::string> seen;
  TracedFunction f = [&seen](const std::vector<Value>& in) {
    seen.push_back(type_of(in[0]).to_string() + " " + type_of(in[1]).to_string());
    return std::vector<Value>{dynamic_slice(in[0], {in[1]}, {kWindow})};
  };
  // The host loop: example b's window at its start (or at `shared`, for every example).
  const auto want = [&](std::optional<int32_t> shared) {
    std::vector<double> w;
    for (int64_t b = 0; b < kBatch; ++b) {
      const int64_t s = clamped_start(shared.value_or(starts[b]), kLength, kWindow);
      for (int64_t j = 0; j < kWindow; ++j) w.push_back(x.values<float>()[b * kLength + s + j]);
    }
    return w;
  };
  const Array xs = put_on(*mesh, x, P("x", None));

  absl::StatusOr<std::vector<Array>> out = jit(vmap(f))({xs, put_on(*mesh, int32s(starts), P("x"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(seen, ElementsAre("f32[6] i32[]"));
  EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[4@x,3]");
  expect_near(fetch((*out)[0]), want(std::nullopt));

  HostArray five(DType::kI32, {});
  five.mutable_values<int32_t>()[0] = 5;
  out = jit(vmap(f, {0, std::nullopt}))({xs, put_on(*mesh, five, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[4@x,3]");
  expect_near(fetch((*out)[0]), want(5));

  out = jit(vmap(f, {std::nullopt, 0}))({put_on(*mesh, arange({kLength}), P()), put_on(*mesh, int32s(starts), P("x"))});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
  EXPECT_THAT(out.status().message(),
              HasSubstr("Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing as "
                        "out sharding could not be resolved unambiguously (or would require collectives on inputs)"));

  // On (2, 2): a window covering a dimension split over 'y' whole keeps that split (an offset
  // dimension of the gather takes the operand's), f32[4@x,1,6@y].
  const Mesh xy = mesh_2x2();
  const HostArray x3 = arange({kBatch, 2, kLength});
  TracedFunction rows = [](const std::vector<Value>& in) {
    return std::vector<Value>{dynamic_slice(in[0], {in[1], full({}, 0, DType::kI32)}, {1, kLength})};
  };
  out = jit(vmap(rows))({put_on(xy, x3, P("x", None, "y")), put_on(xy, int32s(starts), P("x"))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[4@x,1,6@y]");
  std::vector<double> want_rows;
  for (int64_t b = 0; b < kBatch; ++b) {
    const int64_t r = clamped_start(starts[b], 2, 1);
    for (int64_t j = 0; j < kLength; ++j) want_rows.push_back(x3.values<float>()[(b * 2 + r) * kLength + j]);
  }
  expect_near(fetch((*out)[0]), want_rows);
}

// vmap of dynamic_update_slice with per-example starts on an Explicit mesh. JAX batches it as a
// scatter (_dynamic_update_slice_batching_rule -> _scatter_batching_rule), broadcasting an
// unmapped operand or update along the batch split over the vmapped mesh axis
// (batching.bdim_at_front with axis_data.explicit_mesh_axis), so every mix of mapped operand,
// update and starts resolves under _scatter_spec_computation to the operand's layout,
// f32[4@x,6]: starts mapped (a batching dimension of operand, indices and updates, split alike),
// or unmapped (the batch a full window dimension of operand and updates, split alike).
TEST_F(VmapTest, DynamicUpdateSliceWithPerExampleStartsOnASplitBatch) {
  absl::StatusOr<Mesh> mesh = client_->make_mesh({2}, {"x"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  constexpr int64_t kBatch = 4, kLength = 6, kWindow = 3;
  const HostArray x = arange({kBatch, kLength});
  HostArray u(DType::kF32, {kBatch, kWindow});
  for (int64_t i = 0; i < kBatch * kWindow; ++i) u.mutable_values<float>()[i] = -1.0f - static_cast<float>(i);
  const std::vector<int32_t> starts = {-1, 2, 5, 1};
  HostArray five(DType::kI32, {});
  five.mutable_values<int32_t>()[0] = 5;
  TracedFunction f = [](const std::vector<Value>& in) {
    return std::vector<Value>{dynamic_update_slice(in[0], in[1], {in[2]})};
  };
  // The host loop: example b's row (row 0 of x when x is unmapped) with its update (row 0 of u
  // when u is unmapped) written at its start (or at `shared`).
  const auto want = [&](bool x_mapped, bool u_mapped, std::optional<int32_t> shared) {
    std::vector<double> w;
    for (int64_t b = 0; b < kBatch; ++b) {
      const int64_t s = clamped_start(shared.value_or(starts[b]), kLength, kWindow);
      for (int64_t j = 0; j < kLength; ++j) {
        const bool in_window = j >= s && j < s + kWindow;
        w.push_back(in_window ? u.values<float>()[(u_mapped ? b : 0) * kWindow + j - s]
                              : x.values<float>()[(x_mapped ? b : 0) * kLength + j]);
      }
    }
    return w;
  };
  const Array xs = put_on(*mesh, x, P("x", None)), us = put_on(*mesh, u, P("x", None));
  const Array x0 = put_on(*mesh, arange({kLength}), P());
  HostArray u_row(DType::kF32, {kWindow});
  for (int64_t j = 0; j < kWindow; ++j) u_row.mutable_values<float>()[j] = u.values<float>()[j];
  const Array u0 = put_on(*mesh, u_row, P());
  const Array ss = put_on(*mesh, int32s(starts), P("x")), s5 = put_on(*mesh, five, P());
  struct Case {
    std::vector<std::optional<int64_t>> in_axes;
    std::vector<Array> args;
    bool x_mapped, u_mapped;
    std::optional<int32_t> shared;
  };
  const std::vector<Case> cases = {
      {{0, 0, 0}, {xs, us, ss}, true, true, std::nullopt},
      {{0, 0, std::nullopt}, {xs, us, s5}, true, true, 5},
      {{0, std::nullopt, 0}, {xs, u0, ss}, true, false, std::nullopt},
      {{std::nullopt, 0, 0}, {x0, us, ss}, false, true, std::nullopt},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("x mapped ", c.x_mapped, ", update mapped ", c.u_mapped, ", starts mapped ",
                              !c.shared.has_value()));
    absl::StatusOr<std::vector<Array>> out = jit(vmap(f, c.in_axes))(c.args);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[4@x,6]");
    expect_near(fetch((*out)[0]), want(c.x_mapped, c.u_mapped, c.shared));
  }
}

// vmap of dynamic_update_slice / dynamic_slice with per-example starts on a KV cache x[B,H,T,D]:
// each example writes (reads) its row of every head at its own position t_b, starts (0, t_b, 0).
// JAX batches them as a scatter / gather with the batch a batching dimension and every dimension
// in start_index_map, mode CLIP (_dynamic_update_slice_batching_rule / _dynamic_slice_batching_rule,
// jax/_src/lax/slicing.py). The windows take H and D whole. The case, and what a host loop
// writes and reads, for the two tests below.
struct KvCacheCase {
  static constexpr int64_t kH = 2, kT = 5, kD = 4;
  const int64_t batch;  // 4 or 8
  HostArray cache = arange({batch, kH, kT, kD});
  HostArray rows{DType::kF32, {batch, kH, 1, kD}};
  std::vector<int32_t> positions = {0, 3, 7, -2, 4, 1, 9, 2};  // 7 and 9 clamp to kT - 1, -2 to 0
  TracedFunction write = [](const std::vector<Value>& in) {
    const Value zero = full({}, 0, DType::kI32);
    return std::vector<Value>{dynamic_update_slice(in[0], in[1], {zero, in[2], zero})};
  };
  TracedFunction read = [](const std::vector<Value>& in) {
    const Value zero = full({}, 0, DType::kI32);
    return std::vector<Value>{dynamic_slice(in[0], {zero, in[1], zero}, {kH, 1, kD})};
  };
  std::vector<double> written, got;  // the host loop's cache after the write, and rows read
  std::vector<double> touched;       // 1 where the loop writes (reads) the cache, else 0

  explicit KvCacheCase(int64_t examples = 4) : batch(examples) {
    positions.resize(batch);
    for (int64_t i = 0; i < batch * kH * kD; ++i) rows.mutable_values<float>()[i] = -1.0f - static_cast<float>(i);
    const float* c = cache.values<float>().data();
    const float* r = rows.values<float>().data();
    written.assign(c, c + batch * kH * kT * kD);
    touched.assign(written.size(), 0.0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t t = clamped_start(positions[b], kT, 1);
      for (int64_t h = 0; h < kH; ++h) {
        for (int64_t d = 0; d < kD; ++d) {
          written[((b * kH + h) * kT + t) * kD + d] = r[(b * kH + h) * kD + d];
          touched[((b * kH + h) * kT + t) * kD + d] = 1.0;
          got.push_back(c[((b * kH + h) * kT + t) * kD + d]);
        }
      }
    }
  }
};

// H comes before T, which is sliced, so keeping H out of the folded index would transpose the
// whole cache into (B, T, H, D) and back on every step. The traced program holds no transpose,
// and the values are the host loop's.
TEST_F(VmapTest, PerExampleKvCacheWriteAndReadTransposeNoOperand) {
  const KvCacheCase kv;
  const int64_t kB = kv.batch;
  constexpr int64_t kH = KvCacheCase::kH, kT = KvCacheCase::kT, kD = KvCacheCase::kD;
  const ArrayType cache_type{DType::kF32, {kB, kH, kT, kD}}, rows_type{DType::kF32, {kB, kH, 1, kD}},
      positions_type{DType::kI32, {kB}};
  auto expect_no_transpose = [](const absl::StatusOr<Graph>& g) {
    ASSERT_TRUE(g.ok()) << g.status();
    int transposes = 0;
    for (int id = 0; id < g->size(); ++id) transposes += g->node(id).op == Op::kTranspose ? 1 : 0;
    EXPECT_EQ(transposes, 0) << g->to_text();
  };
  expect_no_transpose(trace(vmap(kv.write), {cache_type, rows_type, positions_type}));
  expect_no_transpose(trace(vmap(kv.read), {cache_type, positions_type}));

  const Array xs = put(kv.cache, P()), ps = put(int32s(kv.positions), P());
  absl::StatusOr<std::vector<Array>> out = jit(vmap(kv.write))({xs, put(kv.rows, P()), ps});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_near(fetch((*out)[0]), kv.written);
  out = jit(vmap(kv.read))({xs, ps});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ((*out)[0].shape(), (Shape{kB, kH, 1, kD}));
  expect_near(fetch((*out)[0]), kv.got);

  // On Explicit (2, 2) with the batch split over 'x' and the heads over 'y': H, split, stays out
  // of the folded index (a fold would merge its split), so it keeps its split, as JAX's
  // _gather_sharding_rule / _scatter_sharding_rule keep a full window dimension's.
  const Mesh xy = mesh_2x2();
  const PartitionSpec heads = P("x", "y", None, None);
  const Array xs2 = put_on(xy, kv.cache, heads), ps2 = put_on(xy, int32s(kv.positions), P("x"));
  out = jit(vmap(kv.write))({xs2, put_on(xy, kv.rows, heads), ps2});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[4@x,2@y,5,4]");
  expect_near(fetch((*out)[0]), kv.written);
  out = jit(vmap(kv.read))({xs2, ps2});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[4@x,2@y,1,4]");
  expect_near(fetch((*out)[0]), kv.got);
}

// The same cache under plain jit on Auto axes, the heads split over 'model' (the usual tensor-
// parallel attention layout) or whole, the batch over 'data', over both axes or whole: the trace
// sees no split. The batching dimension and the one position along T are the one-axis
// scatter / gather with batch_dims 1 (lax_gather.cc's batched_take), H and D whole windows, so
// nothing is folded or transposed and a split of the batch stays local, as XLA's SPMD
// partitioner keeps a gather's or a scatter's batching dimensions (operand_batching_dims; JAX's
// _gather_sharding_rule). So the compiled write and read hold no collective at all, on the
// (4, 2) and (2, 4) meshes (before session 38 the batch over 'data' folded with T and the
// one-axis ops ran over 'data'). The values and gradients are the host loop's.
TEST_F(VmapTest, PerExampleKvCacheOnAutoAxesMovesNothing) {
  absl::StatusOr<Mesh> mesh_2x4 = client_->make_mesh({2, 4}, {"data", "model"}, {AxisType::kAuto, AxisType::kAuto});
  ASSERT_TRUE(mesh_2x4.ok()) << mesh_2x4.status();
  static constexpr const char* kCollectives[] = {"all_gather", "all_reduce", "all_to_all", "collective_permute",
                                                 "reduce_scatter"};
  auto expect_no_collective = [](const std::string& plan) {
    for (const char* collective : kCollectives) EXPECT_THAT(plan, Not(HasSubstr(collective))) << plan;
  };
  // Only int32 values (the positions) move, never the cache or the rows.
  auto expect_only_positions_move = [](const std::string& plan) {
    const std::vector<std::string> lines = absl::StrSplit(plan, '\n');
    for (const std::string& line : lines) {
      for (const char* collective : kCollectives) {
        if (absl::StrContains(line, collective)) {
          EXPECT_THAT(line, HasSubstr(" i32[")) << plan;
        }
      }
    }
  };
  const Axes data = {"data"}, model = {"model"}, both = {"data", "model"}, whole = {};
  struct Case {
    const Mesh* mesh;
    Axes batch, heads;
  };
  // H = 2 splits over 'model' on (4, 2) only; 8 examples split over both axes.
  const std::vector<Case> cases = {
      {auto_mesh_, whole, model}, {auto_mesh_, data, model},  {auto_mesh_, data, whole}, {auto_mesh_, both, whole},
      {&*mesh_2x4, data, whole},  {&*mesh_2x4, model, whole}, {&*mesh_2x4, both, whole},
  };
  for (const Case& c : cases) {
    const PartitionSpec spec{std::vector<Axes>{c.batch, c.heads, whole, whole}};
    SCOPED_TRACE(absl::StrCat(c.mesh->to_string(), " ", spec.to_string()));
    const KvCacheCase kv(c.batch == both ? 8 : 4);
    const Array xs = put_on(*c.mesh, kv.cache, spec),
                ps = put_on(*c.mesh, int32s(kv.positions), PartitionSpec{std::vector<Axes>{c.batch}});
    Jitted write = jit(vmap(kv.write)), read = jit(vmap(kv.read));
    absl::StatusOr<std::vector<Array>> out = write({xs, put_on(*c.mesh, kv.rows, spec), ps});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near(fetch((*out)[0]), kv.written);
    out = read({xs, ps});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near(fetch((*out)[0]), kv.got);
    expect_no_collective(write.as_text());
    expect_no_collective(read.as_text());
    // The gradients: d sum(read) / d cache is 1 where an example reads;
    // d sum(write) / d cache is 1 but where an example writes, d sum(write) / d rows 1. The read's
    // gradient may gather the positions (the compiler lays out the cotangent's broadcast, which
    // the select meets, before the positions' concatenate with the zero starts), never the cache.
    const TracedFunction read_sum = [&kv](const std::vector<Value>& in) {
      return std::vector<Value>{sum(vmap(kv.read)(in)[0])};
    };
    const TracedFunction write_sum = [&kv](const std::vector<Value>& in) {
      return std::vector<Value>{sum(vmap(kv.write)(in)[0])};
    };
    Jitted read_grad = jit(grad(read_sum)), write_grad = jit(grad(write_sum, {0, 1}));
    out = read_grad({xs, ps});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near(fetch((*out)[0]), kv.touched);
    out = write_grad({xs, put_on(*c.mesh, kv.rows, spec), ps});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_only_positions_move(read_grad.as_text());
    expect_no_collective(write_grad.as_text());
    std::vector<double> kept(kv.touched.size());
    for (size_t i = 0; i < kept.size(); ++i) kept[i] = 1.0 - kv.touched[i];
    expect_near(fetch((*out)[0]), kept);
    expect_near(fetch((*out)[1]), std::vector<double>(kv.got.size(), 1.0));
  }
}

// The result type of each kernel instruction of a plan's text ("%3 = gather(...) f32[4,1,1,4]  ;
// ...") as its element count, by line.
std::vector<std::pair<int64_t, std::string>> kernel_result_sizes(const std::string& plan) {
  std::vector<std::pair<int64_t, std::string>> out;
  const std::vector<std::string> lines = absl::StrSplit(plan, '\n');
  for (const std::string& line : lines) {
    const size_t cause = line.find("  ; ");
    const size_t close = line.rfind(") ", cause);
    if (cause == std::string::npos || close == std::string::npos || line.find(" = ") == std::string::npos) continue;
    const std::string type = line.substr(close + 2, cause - close - 2);
    const size_t open = type.find('[');
    if (open == std::string::npos) continue;
    int64_t n = 1;
    const std::vector<std::string> dims = absl::StrSplit(type.substr(open + 1, type.size() - open - 2), ',');
    for (const std::string& d : dims) n *= d.empty() ? 1 : std::stoll(d);
    out.emplace_back(n, line);
  }
  return out;
}

// The heads-only tensor-parallel layout (H over 'model', the batch whole): the read is one
// element of T per example, no instruction of the compiled read holds T of them (the reverted
// session-37 select made a (B, H, T, D)-sized mask and product per read), and the write's only
// cache-sized instruction is the scatter itself. A -0.0 in the cache reads back as -0.0 (the
// select's sum read it as +0.0), and the gradient of a product of reads has no NaN where the
// cache holds an infinity elsewhere (a masked product passes inf * 0 into it).
TEST_F(VmapTest, PerExampleKvCacheHeadsOnlyLayoutReadsOneElementPerExample) {
  KvCacheCase kv;
  constexpr int64_t kH = KvCacheCase::kH, kT = KvCacheCase::kT, kD = KvCacheCase::kD;
  const int64_t local_cache = kv.batch * (kH / 2) * kT * kD;  // H over 'model' (2)
  float* c = kv.cache.mutable_values<float>().data();
  for (int64_t b = 0; b < kv.batch; ++b) {
    const int64_t t = std::clamp<int64_t>(kv.positions[b], 0, kT - 1);
    c[((b * kH + 0) * kT + t) * kD + 0] = -0.0f;                                              // read by example b
    c[((b * kH + 1) * kT + (t + 1) % kT) * kD + 1] = std::numeric_limits<float>::infinity();  // not read
  }
  const PartitionSpec heads = P(None, "model", None, None);
  const Array xs = put_on(*auto_mesh_, kv.cache, heads), ps = put_on(*auto_mesh_, int32s(kv.positions), P());
  Jitted read = jit(vmap(kv.read)), write = jit(vmap(kv.write));
  absl::StatusOr<std::vector<Array>> out = read({xs, ps});
  ASSERT_TRUE(out.ok()) << out.status();
  const HostArray rows = fetch((*out)[0]);
  ASSERT_EQ(rows.shape(), (Shape{kv.batch, kH, 1, kD}));
  for (int64_t b = 0; b < kv.batch; ++b) {
    const float first = rows.values<float>()[b * kH * kD];
    EXPECT_EQ(first, 0.0f) << "example " << b;
    EXPECT_TRUE(std::signbit(first)) << "example " << b << " read -0.0 as +0.0";
  }
  for (const auto& [elements, line] : kernel_result_sizes(read.as_text())) {
    EXPECT_LT(elements, kT * kv.batch * (kH / 2)) << line << "\n" << read.as_text();
  }
  out = write({xs, put_on(*auto_mesh_, kv.rows, heads), ps});
  ASSERT_TRUE(out.ok()) << out.status();
  int cache_sized = 0;
  for (const auto& [elements, line] : kernel_result_sizes(write.as_text())) cache_sized += elements >= local_cache;
  EXPECT_LE(cache_sized, 1) << write.as_text();
  // d sum(exp(read / 100)) / d cache: finite everywhere (0 where nothing is read, no inf * 0).
  const TracedFunction read_exp = [&kv](const std::vector<Value>& in) {
    return std::vector<Value>{sum(exp(vmap(kv.read)(in)[0] * 0.01))};
  };
  Jitted read_grad = jit(grad(read_exp));
  out = read_grad({xs, ps});
  ASSERT_TRUE(out.ok()) << out.status();
  const HostArray g = fetch((*out)[0]);
  for (int64_t e = 0; e < g.size(); ++e) {
    ASSERT_TRUE(std::isfinite(g.element_as_double(e))) << "element " << e << "\n" << read_grad.as_text();
  }
}

// vmap of a gather that has batch dimensions of its own (a per-example cache x (N, H, T, D) =
// (4, 2, 6, 3) read along T, batch_dims 1: indices (N, Q), or batch_dims 2: indices (N, H, Q)),
// x shared by every one of V = 8 examples (unmapped) and the indices mapped. As JAX's
// _gather_batching_rule with an unbatched operand and batched indices (jax/_src/lax/slicing.py),
// vmap's batch is one more query dimension of the indices: the traced program never copies x
// per example (session 38's rule broadcast x to (V, N, H, T, D)), and no instruction of the
// compiled plan is that large. Values are the host loop's, in fill mode (out-of-range positions
// read the fill value) and clip mode, on the Auto (4, 2) mesh replicated and split, and on the
// Explicit (2, 2) mesh with x's batch split and vmap's batch whole or split (then x is
// broadcast along the split batch, which the Explicit rule resolves as a batching dimension;
// without batch dimensions that layout is refused, as JAX: the test after this one).
TEST_F(VmapTest, GatherWithBatchDimsFromASharedOperandCopiesNothingPerExample) {
  constexpr int64_t kV = 8, kN = 4, kH = 2, kT = 6, kD = 3, kQ = 3;
  const HostArray x = arange({kN, kH, kT, kD});
  const int64_t x_size = kN * kH * kT * kD;
  for (int64_t batch_dims : {1, 2}) {
    Shape example_indices = batch_dims == 1 ? Shape{kN, kQ} : Shape{kN, kH, kQ};
    Shape indices_shape = example_indices;
    indices_shape.insert(indices_shape.begin(), kV);
    HostArray idx(DType::kI32, indices_shape);
    for (int64_t i = 0; i < idx.size(); ++i) idx.mutable_values<int32_t>()[i] = static_cast<int32_t>((i * 7) % 10 - 2);
    for (IndexMode mode : {IndexMode::kFillOrDrop, IndexMode::kClip}) {
      SCOPED_TRACE(absl::StrCat("batch_dims ", batch_dims, " mode ", static_cast<int>(mode)));
      const GatherAttrs attrs{2, mode, mode == IndexMode::kFillOrDrop ? std::optional<Scalar>(-7.0) : std::nullopt,
                              batch_dims};
      const TracedFunction f = [attrs](const std::vector<Value>& in) {
        return std::vector<Value>{gather(in[0], in[1], attrs)};
      };
      // The host loop: out[v, n, h, q, d] = x[n, h, idx[v, n, (h,) q], d]. read(e, t, o) is
      // called for each element e = (v, n, h, q, d) of the result, in order, with the position t
      // it reads (clamped in clip mode; out of range in fill mode) and its offset o in x.
      auto for_each_read = [&](const std::function<void(int64_t, int64_t, int64_t)>& read) {
        int64_t e = 0;
        for (int64_t v = 0; v < kV; ++v) {
          for (int64_t n = 0; n < kN; ++n) {
            for (int64_t h = 0; h < kH; ++h) {
              for (int64_t q = 0; q < kQ; ++q) {
                const int64_t at = batch_dims == 1 ? (v * kN + n) * kQ + q : ((v * kN + n) * kH + h) * kQ + q;
                int64_t t = idx.values<int32_t>()[at];
                if (mode == IndexMode::kClip) t = std::clamp<int64_t>(t, 0, kT - 1);
                for (int64_t d = 0; d < kD; ++d) read(e++, t, ((n * kH + h) * kT + t) * kD + d);
              }
            }
          }
        }
      };
      std::vector<double> want;
      for_each_read(
          [&](int64_t, int64_t t, int64_t o) { want.push_back(t < 0 || t >= kT ? -7.0 : x.values<float>()[o]); });
      const TracedFunction batched = vmap(f, {std::nullopt, 0});
      absl::StatusOr<Graph> g =
          trace(batched, {ArrayType{DType::kF32, {kN, kH, kT, kD}}, ArrayType{DType::kI32, indices_shape}});
      ASSERT_TRUE(g.ok()) << g.status();
      for (int id = 0; id < g->size(); ++id) {
        EXPECT_LT(num_elements(g->node(id).shape), kV * x_size) << "node " << id << "\n" << g->to_text();
      }
      Jitted run = jit(batched);
      absl::StatusOr<std::vector<Array>> out = run({put_on(*auto_mesh_, x, P()), put_on(*auto_mesh_, idx, P())});
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ((*out)[0].shape(), (Shape{kV, kN, kH, kQ, kD}));
      expect_near(fetch((*out)[0]), want);
      for (const auto& [elements, line] : kernel_result_sizes(run.as_text())) {
        EXPECT_LT(elements, kV * x_size) << line << "\n" << run.as_text();
      }
      // Its gradient with respect to the shared x (the transpose: a scatter_add into x summing
      // over the examples) against the host's: gx[n, h, t, d] sums w[v, n, h, q, d] over the
      // examples v and queries q that read t (clamped in clip mode, none out of range in fill).
      const HostArray w = arange({kV, kN, kH, kQ, kD});
      std::vector<double> gx(x_size, 0.0);
      for_each_read([&](int64_t e, int64_t t, int64_t o) {
        if (t >= 0 && t < kT) gx[o] += w.values<float>()[e];
      });
      const TracedFunction loss = [batched](const std::vector<Value>& in) {
        return std::vector<Value>{sum(batched({in[0], in[1]})[0] * in[2])};
      };
      Jitted dloss = jit(grad(loss));
      out = dloss({put_on(*auto_mesh_, x, P()), put_on(*auto_mesh_, idx, P()), put_on(*auto_mesh_, w, P())});
      ASSERT_TRUE(out.ok()) << out.status();
      expect_near(fetch((*out)[0]), gx);
      // Split layouts: x's batch over 'model', the examples over 'data' (or the batch too).
      std::vector<Axes> idx_spec(indices_shape.size());
      idx_spec[0] = {"data"};
      out = run(
          {put_on(*auto_mesh_, x, P("model", None, None, None)), put_on(*auto_mesh_, idx, PartitionSpec{idx_spec})});
      ASSERT_TRUE(out.ok()) << out.status();
      expect_near(fetch((*out)[0]), want);
      idx_spec[1] = {"model"};
      out = run(
          {put_on(*auto_mesh_, x, P("model", None, None, None)), put_on(*auto_mesh_, idx, PartitionSpec{idx_spec})});
      ASSERT_TRUE(out.ok()) << out.status();
      expect_near(fetch((*out)[0]), want);
      // Explicit (2, 2): x's batch over 'x', the examples whole, then over 'y'.
      const Mesh xy = mesh_2x2();
      std::vector<Axes> explicit_spec(indices_shape.size());
      explicit_spec[1] = {"x"};
      const Array xs = put_on(xy, x, P("x", None, None, None));
      out = jit(batched)({xs, put_on(xy, idx, PartitionSpec{explicit_spec})});
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[8,4@x,2,3,3]");
      expect_near(fetch((*out)[0]), want);
      explicit_spec[0] = {"y"};
      out = jit(batched)({xs, put_on(xy, idx, PartitionSpec{explicit_spec})});
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(type_of((*out)[0]).to_string(), "f32[8@y,4@x,2,3,3]");
      expect_near(fetch((*out)[0]), want);
    }
  }
}

// A one-axis take in clip mode of rows `ids` (examples x queries) from x (rows x width, 0, 1,
// 2, ...), and the host loop's result and gradient: out[v, q, d] = x[clamp(ids[v, q]), d]
// (jnp.take(mode='clip') clamps, wrapping no negative); d/dx sum(out * w) adds w[v, q, d] into
// that row.
struct TakeRows {
  HostArray x, ids, w;
  std::vector<double> want, want_grad;
};
TakeRows clip_take_case(int64_t examples, int64_t rows, int64_t width, int64_t queries) {
  TakeRows c{
      arange({rows, width}), HostArray(DType::kI32, {examples, queries}), arange({examples, queries, width}), {}, {}};
  for (int64_t i = 0; i < c.ids.size(); ++i) c.ids.mutable_values<int32_t>()[i] = static_cast<int32_t>((i * 5) % 8 - 1);
  c.want_grad.assign(rows * width, 0.0);
  for (int64_t vq = 0; vq < examples * queries; ++vq) {
    const int64_t t = std::clamp<int64_t>(c.ids.values<int32_t>()[vq], 0, rows - 1);
    for (int64_t d = 0; d < width; ++d) {
      c.want.push_back(c.x.values<float>()[t * width + d]);
      c.want_grad[t * width + d] += c.w.values<float>()[vq * width + d];
    }
  }
  return c;
}

// A one-axis take (batch_dims 0) from an x shared by every example, vmapped with the examples
// split over an Explicit axis, is refused as JAX refuses it. JAX's _gather_batching_rule with an
// unbatched operand and batched indices (jax/_src/lax/slicing.py) makes vmap's batch a dimension
// of the indices that is not a batching dimension (start_indices_batching_dims shifted past it);
// _gather_spec_computation then finds a split non-batching dimension of the indices
// (indices_non_batch_dims_replicated is false) and returns None, and _gather_sharding_rule raises
// "Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing ..."
// (the unvmapped case is tests/pjit_test.py test_indices_sharded_gather_error). The forward pass
// and grad (whose forward runs the same gather) are refused in those words; with the examples
// whole the same functions run, with the host loop's values and gradient. Only an op with batch
// dimensions of its own broadcasts x along a split batch instead (client/batching/indexing.cc, a
// deliberate difference: see GatherWithBatchDimsFromASharedOperandCopiesNothingPerExample).
TEST_F(VmapTest, OneAxisTakeFromASharedOperandOnAnExplicitSplitBatchIsRefusedAsJax) {
  const Mesh xy = mesh_2x2();
  const TakeRows c = clip_take_case(8, 6, 3, 3);
  const HostArray &x = c.x, &ids = c.ids, &w = c.w;
  const TracedFunction take_rows = [](const std::vector<Value>& in) {
    return std::vector<Value>{gather(in[0], in[1], GatherAttrs{0, IndexMode::kClip, std::nullopt, 0})};
  };
  const TracedFunction batched = vmap(take_rows, {std::nullopt, 0});
  const TracedFunction loss = [batched](const std::vector<Value>& in) {
    return std::vector<Value>{sum(batched({in[0], in[1]})[0] * in[2])};
  };
  const Array xa = put_on(xy, x, P()), split = put_on(xy, ids, P("y", None)), whole = put_on(xy, ids, P());
  const Array wa = put_on(xy, w, P("y", None, None));
  auto expect_refused = [](const absl::StatusOr<std::vector<Array>>& got, const std::string& what) {
    ASSERT_FALSE(got.ok()) << what;
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << what << ": " << got.status();
    EXPECT_THAT(got.status().message(),
                HasSubstr("Use `.at[...].get(out_sharding=)` to provide output PartitionSpec for the gather indexing"))
        << what;
  };
  expect_refused(jit(batched)({xa, split}), "vmap(take)");
  expect_refused(jit(grad(loss))({xa, split, wa}), "grad of vmap(take)");
  // The examples whole: the same functions run.
  absl::StatusOr<std::vector<Array>> out = jit(batched)({xa, whole});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_near(fetch((*out)[0]), c.want);
  out = jit(grad(loss))({xa, whole, put_on(xy, w, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  expect_near(fetch((*out)[0]), c.want_grad);
}

// The same take with out_sharding (the fix JAX's refusal above names) runs as JAX runs it:
// jax/_src/numpy/indexing.py's rewriting_take gathers under auto_axes over every Explicit axis
// (so _gather_sharding_rule never sees the split indices), then reshards to out_sharding, whose
// batching rule (jax/_src/pjit.py _reshard_batcher -> batching.get_sharding_for_vmap) puts the
// vmapped Explicit axis on the batch dimension in front of out_sharding's spec: P(None, None)
// gives P(batch, None, None). On (4, 2), (2, 4) and (8) meshes with the examples split over each
// axis in turn, out_sharding P(None, None) and, on two axes, P(None, other) with x split over the
// other axis too; values and the gradient of sum(vmap(take) * w) with respect to the shared x (a
// scatter of w back, laid out as x) against the host loop.
TEST_F(VmapTest, OneAxisTakeWithOutShardingFromASharedOperandOnAnExplicitSplitBatch) {
  constexpr int64_t kV = 8, kD = 4, kQ = 3;
  const TakeRows rows = clip_take_case(kV, 6, kD, kQ);
  const HostArray &x = rows.x, &ids = rows.ids, &w = rows.w;
  struct Case {
    std::vector<int64_t> shape;
    std::vector<std::string> names;
    std::string batch;  // the axis the examples are split over
    std::string other;  // the mesh's other axis ("" for one axis)
  };
  const Case cases[] = {
      {{4, 2}, {"data", "model"}, "data", "model"},
      {{4, 2}, {"data", "model"}, "model", "data"},
      {{2, 4}, {"data", "model"}, "data", "model"},
      {{2, 4}, {"data", "model"}, "model", "data"},
      {{8}, {"data"}, "data", ""},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Mesh> mesh = client_->make_mesh(c.shape, c.names);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    for (const bool split_d : {false, true}) {
      if (split_d && c.other.empty()) continue;
      SCOPED_TRACE(absl::StrCat(axes_to_string(c.names), " ", absl::StrJoin(c.shape, "x"), ", examples over ", c.batch,
                                split_d ? ", d over " + c.other : ""));
      const PartitionSpec out_sharding = split_d ? P(None, c.other) : P(None, None);
      const PartitionSpec x_spec = split_d ? P(None, c.other) : P();
      std::vector<std::string> seen;
      const TracedFunction take_rows = [&](const std::vector<Value>& in) {
        const Value r = take(in[0], in[1], 0, out_sharding, IndexMode::kClip);
        seen.push_back(type_of(r).to_string());
        return std::vector<Value>{r};
      };
      const TracedFunction batched = vmap(take_rows, {std::nullopt, 0});
      const Array xa = put_on(*mesh, x, x_spec), ida = put_on(*mesh, ids, P(c.batch, None));
      absl::StatusOr<std::vector<Array>> out = jit(batched)({xa, ida});
      ASSERT_TRUE(out.ok()) << out.status();
      const std::string d_type = split_d ? absl::StrCat(kD, "@", c.other) : absl::StrCat(kD);
      EXPECT_THAT(seen, ElementsAre(absl::StrCat("f32[", kQ, ",", d_type, "]")));
      EXPECT_EQ(type_of((*out)[0]).to_string(), absl::StrCat("f32[", kV, "@", c.batch, ",", kQ, ",", d_type, "]"));
      expect_sharding((*out)[0], *mesh, split_d ? P(c.batch, None, c.other) : P(c.batch, None, None));
      expect_near(fetch((*out)[0]), rows.want);
      const TracedFunction loss = [batched](const std::vector<Value>& in) {
        return std::vector<Value>{sum(batched({in[0], in[1]})[0] * in[2])};
      };
      out = jit(grad(loss))({xa, ida, put_on(*mesh, w, P(c.batch, None, None))});
      ASSERT_TRUE(out.ok()) << out.status();
      expect_sharding((*out)[0], *mesh, x_spec);
      expect_near(fetch((*out)[0]), rows.want_grad);
    }
  }
}

// JAX's tests/pjit_test.py test_select_batch: vmap of a.at[b].get(out_sharding=P('y', None))
// over a and b split P('x', 'y', None) is typed P('x', 'y', None, None) inside the jit and out
// (the batch takes the vmapped 'x' in front of out_sharding's spec). On JAX's (2, 2) mesh and
// on (4, 2) (the (2, 4) and (8) meshes do not divide its (4, 2, ...) shapes over 'y' / name
// no 'y'). JAX's arrays are ones; here a is 0, 1, 2, ... and b mixes negative indices (which
// wrap) and positive ones, for the host loop: out[v, i, j, :] = a[v, b[v, i, j] mod 2, :].
TEST_F(VmapTest, ExplicitSelectBatchWithOutShardingAsJax) {
  constexpr int64_t kV = 4, kN = 2, kD = 3, kK = 2;
  const HostArray a = arange({kV, kN, kD});
  HostArray b(DType::kI32, {kV, kN, kK});
  for (int64_t i = 0; i < b.size(); ++i) b.mutable_values<int32_t>()[i] = static_cast<int32_t>((i * 3) % 4 - 2);
  std::vector<double> want;
  for (int64_t vij = 0; vij < kV * kN * kK; ++vij) {
    const int64_t v = vij / (kN * kK), row = (b.values<int32_t>()[vij] + kN) % kN;
    for (int64_t d = 0; d < kD; ++d) want.push_back(a.values<float>()[(v * kN + row) * kD + d]);
  }
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{2, 2}, std::vector<int64_t>{4, 2}}) {
    SCOPED_TRACE(absl::StrCat(shape[0], "x", shape[1]));
    absl::StatusOr<Mesh> mesh = client_->make_mesh(shape, {"x", "y"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    std::vector<std::string> seen;
    const TracedFunction select = [](const std::vector<Value>& in) {
      return std::vector<Value>{at(in[0], in[1]).get(P("y", None))};
    };
    const TracedFunction vmap_select = [&](const std::vector<Value>& in) {
      const Value out = vmap(select)(in)[0];
      seen.push_back(type_of(out).to_string());
      return std::vector<Value>{out};
    };
    absl::StatusOr<std::vector<Array>> out =
        jit(vmap_select)({put_on(*mesh, a, P("x", "y", None)), put_on(*mesh, b, P("x", "y", None))});
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_THAT(seen, ElementsAre("f32[4@x,2@y,2,3]"));
    expect_sharding((*out)[0], *mesh, P("x", "y", None, None));
    expect_near(fetch((*out)[0]), want);
  }
}

// Nested vmaps over two Explicit axes (jax.vmap(jax.vmap(f)) of an f32[4@x,6@y,5] array): the
// inner vmap's per-example slices are made inside the outer example's auto_axes scope and
// batched in it again (client/vmap.cc batch_nodes); the result keeps both splits, as JAX's
// get_sharding_for_vmap puts each vmapped axis back on its batch dimension, and each row is
// what the host computes.
TEST_F(VmapTest, ExplicitNestedVmapsOverTwoSplitDimensionsKeepBothSplits) {
  const Mesh mesh = mesh_2x2();
  const HostArray x = arange({4, 6, 5});
  std::vector<std::string> seen;
  TracedFunction f = [&seen](const std::vector<Value>& in) {
    seen.push_back(type_of(in[0]).to_string());
    return std::vector<Value>{sin(in[0]) * 2.0 + sum(in[0])};
  };
  absl::StatusOr<std::vector<Array>> out = jit(vmap(vmap(f)))({put_on(mesh, x, P("x", "y", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_THAT(seen, ElementsAre("f32[5]"));
  expect_sharding((*out)[0], mesh, P("x", "y", None));
  std::vector<double> want;
  const absl::Span<const float> v = x.values<float>();
  for (size_t row = 0; row < 24; ++row) {
    double total = 0;
    for (size_t k = 0; k < 5; ++k) total += v[row * 5 + k];
    for (size_t k = 0; k < 5; ++k) want.push_back(2.0 * std::sin(static_cast<double>(v[row * 5 + k])) + total);
  }
  expect_near(fetch((*out)[0]), want);
}

// JAX's tests/pjit_test.py test_vmap_grad_sharded_gather: jit(vmap(value_and_grad(
// mean(t.at[i].get(out_sharding=P('y')))))) over tokens and ids split P('x', None): the values
// come out P('x'), the gradients laid out as the tokens, P('x', None). On JAX's (2, 4) mesh, on
// (4, 2), and on (8) (one axis 'x': out_sharding P(None) there, as the mesh has no 'y'). JAX's
// ids are 0..511, past the 256 tokens of a row; here they are taken mod 256 so that every id is
// in range (Tessera's .get clamps, JAX's fills), for the host loop: value[b] = mean over q of
// t[b, ids[b, q]], grad[b, j] = (the number of q with ids[b, q] = j) / 16.
TEST_F(VmapTest, ExplicitVmapOfValueAndGradOfAShardedGatherAsJax) {
  constexpr int64_t kB = 32, kT = 256, kQ = 16;
  const HostArray tokens = arange({kB, kT});
  HostArray ids(DType::kI32, {kB, kQ});
  for (int64_t i = 0; i < ids.size(); ++i) ids.mutable_values<int32_t>()[i] = static_cast<int32_t>(i % kT);
  std::vector<double> want_value(kB, 0.0), want_grad(kB * kT, 0.0);
  for (int64_t bq = 0; bq < kB * kQ; ++bq) {
    const int64_t b = bq / kQ, j = ids.values<int32_t>()[bq];
    want_value[b] += tokens.values<float>()[b * kT + j] / kQ;
    want_grad[b * kT + j] += 1.0 / kQ;
  }
  struct Case {
    std::vector<int64_t> shape;
    std::vector<std::string> names;
  };
  const Case cases[] = {{{2, 4}, {"x", "y"}}, {{4, 2}, {"x", "y"}}, {{8}, {"x"}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(axes_to_string(c.names) + " " + absl::StrJoin(c.shape, "x"));
    absl::StatusOr<Mesh> mesh = client_->make_mesh(c.shape, c.names);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const PartitionSpec out_sharding = c.names.size() == 2 ? P("y") : P(None);
    const TracedFunction sum_gather = [&out_sharding](const std::vector<Value>& in) {
      return std::vector<Value>{mean(at(in[0], in[1]).get(out_sharding))};
    };
    const Array t = put_on(*mesh, tokens, P("x", None));
    absl::StatusOr<std::vector<Array>> out =
        jit(vmap(value_and_grad(sum_gather)))({t, put_on(*mesh, ids, P("x", None))});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 2u);
    EXPECT_EQ((*out)[0].shape(), (Shape{kB}));
    expect_sharding((*out)[0], *mesh, P("x"));
    EXPECT_EQ((*out)[1].shape(), tokens.shape());
    expect_sharding((*out)[1], *mesh, P("x", None));
    EXPECT_TRUE((*out)[1].sharding().is_equivalent_to(t.sharding(), 2)) << (*out)[1].sharding().to_string();
    expect_near(fetch((*out)[0]), want_value);
    expect_near(fetch((*out)[1]), want_grad);
  }
}

}  // namespace
}  // namespace tessera

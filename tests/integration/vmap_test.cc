// vmap over arrays laid out on a mesh, run under jit on an embedded cluster: explicitly
// sharded arguments (JAX's "sharding in types" vmap: tests/pjit_test.py, ShardingInTypesTest's
// test_mul_vmap, test_dot_general_vmap, test_reshape_vmap, test_shit_vmap_error_check,
// test_spmd_axis_name_explicit_mode_assert, test_unmapped_last_vmap) and spmd_axis_name
// (PJitTest's test_with_sharding_constraint_spmd_axis_name, test_wsc_vmap_abstract_mesh,
// test_with_sharding_constraint_vmap_spmd_axis_name_error). Values against the host, shardings
// as JAX's tests assert them.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"

namespace tessera {
namespace {

using jit_support::expect_near;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

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
  constexpr int64_t kBatch = 8, kLength = 16;
  const HostArray xs = arange({kBatch, kLength});
  HostArray w(DType::kF32, {kLength});
  for (int64_t j = 0; j < kLength; ++j) w.mutable_values<float>()[j] = 0.25f * static_cast<float>(j % 5) - 0.5f;
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
    const PartitionSpec spec{std::vector<Axes>{c.spec}};
    ShardMapped sm = shard_map(
        [&c](const std::vector<Value>& in) {
          const Value y = in[0] * in[1];
          const Value position = convert(axis_index(AxisNames(c.spec)), DType::kF32);
          return std::vector<Value>{y + psum(sum(y, {0}), AxisNames(c.spec)) + position};
        },
        *mesh, {spec, spec}, {spec});
    TracedFunction f = [&sm](const std::vector<Value>& in) { return sm(in); };
    Jitted jitted = jit(vmap(f, {0, std::nullopt}, {}, std::nullopt, c.spmd));
    absl::StatusOr<std::vector<Array>> out = jitted({put_on(*mesh, xs, P()), put_on(*mesh, w, P())});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_sharding((*out)[0], *mesh, c.out_sharding);
    const int64_t block = kLength / mesh->axes_size(c.spec);
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

}  // namespace
}  // namespace tessera

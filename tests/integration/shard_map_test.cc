// shard_map on Client::local(8): every collective over each axis and tuple of axes of the
// (8), (4, 2) and (2, 4) meshes against the host reference (tests/support/host_eval.h runs
// the body once per mesh position and computes collectives from their definitions), a few
// results against values worked out by hand from JAX's documentation, shard_map standalone
// and nested in jit with automatic code around it, and the replication check and errors.
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"
#include "tests/support/host_eval.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

const std::vector<MeshDef>& meshes() { return test_meshes(); }

// One collective, over `axes`, of a body whose argument is split over every mesh axis.
struct CollectiveCase {
  std::string name;
  int mesh = 0;
  Axes axes;
  Shape input;  // global; in_spec P(all mesh axes, None)
  std::function<Value(const Value&, const Axes&)> body;
  // The out_spec, from the axes reduced over (`axes`) and the others.
  std::function<PartitionSpec(const Axes& over, const Axes& others)> out_spec;
  // JAX types all_gather's result as varying along its axes (docs/notebooks/shard_map.md,
  // "Varying -> Varying"), so an out_spec leaving them out runs only with check_vma off, as
  // in JAX.
  bool check_vma = true;
};

void PrintTo(const CollectiveCase& c, std::ostream* os) { *os << c.name; }

Axes concat(Axes a, const Axes& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::vector<CollectiveCase> collective_cases() {
  std::vector<CollectiveCase> out;
  for (int m = 0; m < static_cast<int>(meshes().size()); ++m) {
    const MeshDef& mesh = meshes()[m];
    std::vector<Axes> choices;
    for (const std::string& a : mesh.axes) choices.push_back({a});
    if (mesh.axes.size() == 2) {
      choices.push_back({mesh.axes[0], mesh.axes[1]});
      choices.push_back({mesh.axes[1], mesh.axes[0]});
    }
    for (const Axes& axes : choices) {
      int64_t n = 1;
      for (const std::string& a : axes) {
        for (size_t i = 0; i < mesh.axes.size(); ++i) {
          if (mesh.axes[i] == a) n *= mesh.shape[i];
        }
      }
      const std::string suffix = absl::StrCat("_", mesh.name, "_over_", absl::StrJoin(axes, "_"));
      auto add = [&](std::string name, Shape input, std::function<Value(const Value&, const Axes&)> body,
                     std::function<PartitionSpec(const Axes&, const Axes&)> spec) {
        out.push_back({name + suffix, m, axes, std::move(input), std::move(body), std::move(spec)});
      };
      // Replicated over the axes reduced: the out_spec names only the others.
      auto others_rows = [](const Axes&, const Axes& others) { return P(others, None); };
      auto others_rows3 = [](const Axes&, const Axes& others) { return P(others, None, None); };
      // Different on every device: the out_spec names every axis.
      auto all_rows = [](const Axes& over, const Axes& others) { return P(concat(others, over), None); };
      add(
          "psum", {16, 8}, [](const Value& x, const Axes& a) { return psum(x, a); }, others_rows);
      add(
          "pmean", {16, 8}, [](const Value& x, const Axes& a) { return pmean(x, a); }, others_rows);
      add(
          "pmax", {16, 8}, [](const Value& x, const Axes& a) { return pmax(x, a); }, others_rows);
      add(
          "pmin", {16, 8}, [](const Value& x, const Axes& a) { return pmin(x, a); }, others_rows);
      add(
          "all_gather_tiled", {16, 8}, [](const Value& x, const Axes& a) { return all_gather(x, a, 0, true); },
          others_rows);
      add(
          "all_gather_tiled_dim1", {16, 8}, [](const Value& x, const Axes& a) { return all_gather(x, a, 1, true); },
          others_rows);
      add(
          "all_gather_stacked", {16, 8}, [](const Value& x, const Axes& a) { return all_gather(x, a, 0, false); },
          others_rows3);
      add(
          "all_gather_stacked_axis2", {16, 8}, [](const Value& x, const Axes& a) { return all_gather(x, a, 2, false); },
          others_rows3);
      add(
          "psum_scatter_tiled", {16, 8}, [](const Value& x, const Axes& a) { return psum_scatter(x, a, 1, true); },
          [](const Axes& over, const Axes& others) { return P(others, over); });
      // Not tiled: the scattered dimension has the axes' size, and goes.
      add(
          "psum_scatter", {8 * n, 4}, [](const Value& x, const Axes& a) { return psum_scatter(x, a, 0, false); },
          [](const Axes& over, const Axes& others) { return P(concat(others, over)); });
      add(
          "ppermute_ring", {16, 8},
          [n](const Value& x, const Axes& a) {
            std::vector<std::pair<int64_t, int64_t>> perm;
            for (int64_t i = 0; i < n; ++i) perm.emplace_back(i, (i + 1) % n);
            return ppermute(x, a, perm);
          },
          all_rows);
      add(
          "ppermute_one_pair", {16, 8},
          [](const Value& x, const Axes& a) {
            return ppermute(x, a, {{0, 1}});
          },
          all_rows);
      add(
          "all_to_all_tiled", {16, 8}, [](const Value& x, const Axes& a) { return all_to_all(x, a, 1, 0, true); },
          all_rows);
      add(
          "all_to_all_tiled_same_dim", {16 * n, 8},
          [](const Value& x, const Axes& a) { return all_to_all(x, a, 0, 0, true); }, all_rows);
      add(
          "all_to_all", {8 * n, 4}, [](const Value& x, const Axes& a) { return all_to_all(x, a, 0, 1, false); },
          all_rows);
      add(
          "all_to_all_concat_first", {16, n},
          [](const Value& x, const Axes& a) { return all_to_all(x, a, 1, 0, false); },
          [](const Axes& over, const Axes& others) { return P(None, concat(others, over)); });
      add(
          "axis_index", {16, 8},
          [](const Value&, const Axes& a) { return broadcast_to(convert(axis_index(a), DType::kF32), {1}); },
          [](const Axes& over, const Axes&) { return P(over); });
    }
  }
  for (CollectiveCase& c : out) c.check_vma = c.name.rfind("all_gather", 0) != 0;
  return out;
}

class ShardMapCollectiveTest : public MeshesSuite, public ::testing::WithParamInterface<CollectiveCase> {};

TEST_P(ShardMapCollectiveTest, MatchesHostReference) {
  const CollectiveCase& c = GetParam();
  ASSERT_NE(client_, nullptr);
  // Auto axes, where shard_map moves an argument laid out otherwise than its in_spec (as JAX's
  // does on Auto axes; on Explicit ones JAX >= 0.9 refuses that: ExplicitShardMap).
  const Mesh& mesh = auto_meshes_[c.mesh];
  Axes others;
  for (const std::string& a : mesh.axis_names()) {
    if (std::find(c.axes.begin(), c.axes.end(), a) == c.axes.end()) others.push_back(a);
  }
  const PartitionSpec in_spec = P(mesh.axis_names(), None);
  const PartitionSpec out_spec = c.out_spec(c.axes, others);
  ShardMapped f = shard_map([&c](const std::vector<Value>& in) { return std::vector<Value>{c.body(in[0], c.axes)}; },
                            mesh, {in_spec}, {out_spec}, {.check_vma = c.check_vma});
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)));
  const HostArray x = random_array(DType::kF32, c.input, Domain::kSigned, rng);
  // Inside jit, and the argument laid out otherwise than the in_spec: shard_map moves it.
  absl::StatusOr<JitCheck> r =
      run_against_host(*client_, mesh, [f](const std::vector<Value>& in) { return f(in); }, {&x}, {P()});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(results_match(r->got[0], r->want[0], kF32Tolerance)) << r->plan_text;
  EXPECT_EQ(r->out_specs[0], out_spec) << r->out_specs[0].to_string();
}

INSTANTIATE_TEST_SUITE_P(All, ShardMapCollectiveTest, ::testing::ValuesIn(collective_cases()),
                         [](const ::testing::TestParamInfo<CollectiveCase>& info) { return info.param.name; });

class ShardMapTest : public MeshesSuite {
 protected:
  const Mesh& mesh42() const { return meshes_[1]; }
  Array put(const HostArray& x, const PartitionSpec& spec) const {
    absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(mesh42(), spec));
    EXPECT_TRUE(a.ok()) << a.status();
    return *std::move(a);
  }
  // The trace error of calling `f` on one (16, 8) float32 argument inside jit.
  static absl::Status trace_error(const TracedFunction& f, Shape shape = {16, 8}) {
    return trace(f, {{DType::kF32, std::move(shape)}}).status();
  }
  // The trace error of calling `f` on arguments of `types`.
  static absl::Status trace_error(const ShardMapped& f, const std::vector<ArrayType>& types) {
    return trace([f](const std::vector<Value>& in) { return f(in); }, types).status();
  }

  // `body` (of x, w) run in jit on random x (16, 8) laid out P('data', None) and w (8, 4)
  // P(None, 'model') of `mesh`: its results fetched, its plan, and tanh(x @ w) on the host.
  struct TanhMatmulRun {
    std::vector<HostArray> got;
    std::vector<PartitionSpec> specs;
    std::string plan;
    HostArray want;
  };
  static absl::StatusOr<TanhMatmulRun> run_tanh_matmul(const Mesh& mesh, const ShardMapped& body, uint32_t seed) {
    Jitted f = jit([body](const std::vector<Value>& in) { return body(in); });
    std::mt19937 rng(seed);
    const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
    const HostArray w = random_array(DType::kF32, {8, 4}, Domain::kSigned, rng);
    TESSERA_ASSIGN_OR_RETURN(Array xs, client_->device_put(x, NamedSharding(mesh, P("data", None))));
    TESSERA_ASSIGN_OR_RETURN(Array ws, client_->device_put(w, NamedSharding(mesh, P(None, "model"))));
    TESSERA_ASSIGN_OR_RETURN(std::vector<Array> out, f({xs, ws}));
    TanhMatmulRun run;
    for (const Array& a : out) {
      TESSERA_ASSIGN_OR_RETURN(HostArray h, a.fetch());
      run.got.push_back(std::move(h));
      run.specs.push_back(a.sharding().spec());
    }
    run.plan = f.as_text();
    TESSERA_ASSIGN_OR_RETURN(
        Graph plain, trace([](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; },
                           {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}));
    TESSERA_ASSIGN_OR_RETURN(std::vector<HostArray> want, evaluate_on_host(plain, {&x, &w}));
    run.want = std::move(want[0]);
    return run;
  }
};

// Results worked out by hand from JAX's documented semantics, independent of host_eval.
TEST_F(ShardMapTest, PsumAndAxisIndexAsJaxDocumentsThem) {
  ASSERT_NE(client_, nullptr);
  // x[i, j] = 2i + j on (8, 2) under P('data', 'model'): device (d, m) holds rows 2d..2d+1 of
  // column m. psum over 'data' adds the four row blocks: out[i, j] = sum_d x[2d + i, j].
  const HostArray x = HostArray::arange(DType::kF32, {8, 2});
  ShardMapped f = shard_map(
      [](const std::vector<Value>& in) {
        Value index = broadcast_to(convert(axis_index("model"), DType::kF32), {1, 1});
        Value stacked = all_gather(in[0], "data", 0, false);  // (4, 2, 1): the four blocks in order
        return std::vector<Value>{psum(in[0], "data"), index, stacked};
      },
      mesh42(), {P("data", "model")}, {P(None, "model"), P("data", "model"), P(None, None, "model")},
      {.check_vma = false});  // JAX types all_gather as varying along 'data', though every device holds the same
  absl::StatusOr<std::vector<Array>> out = f({put(x, P("data", "model"))});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> sum = (*out)[0].fetch();
  absl::StatusOr<HostArray> index = (*out)[1].fetch();
  absl::StatusOr<HostArray> stacked = (*out)[2].fetch();
  ASSERT_TRUE(sum.ok() && index.ok() && stacked.ok());
  ASSERT_EQ(sum->shape(), (Shape{2, 2}));
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      double want = 0;
      for (int d = 0; d < 4; ++d) want += 2 * (2 * d + i) + j;
      EXPECT_EQ(sum->element_as_double(i * 2 + j), want) << i << "," << j;
    }
  }
  ASSERT_EQ(index->shape(), (Shape{4, 2}));
  for (int d = 0; d < 4; ++d) {
    for (int m = 0; m < 2; ++m) EXPECT_EQ(index->element_as_double(d * 2 + m), m);
  }
  // Stacked: out[d, i, j] = x[2d + i, j], whichever device reads it.
  ASSERT_EQ(stacked->shape(), (Shape{4, 2, 2}));
  for (int64_t e = 0; e < stacked->size(); ++e) EXPECT_EQ(stacked->element_as_double(e), e);
}

TEST_F(ShardMapTest, PpermuteShiftsBlocksAndZeroFillsAsXla) {
  ASSERT_NE(client_, nullptr);
  // Along 'data' (4 devices), 0 -> 1 -> 2 -> 3 (no wrap): device 0 gets zeros.
  const HostArray x = HostArray::arange(DType::kF32, {8, 2});
  ShardMapped f = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ppermute(in[0], "data", {{0, 1}, {1, 2}, {2, 3}})};
      },
      mesh42(), {P("data", None)}, {P("data", None)});
  absl::StatusOr<std::vector<Array>> out = f({put(x, P("data", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok());
  for (int64_t e = 0; e < got->size(); ++e) EXPECT_EQ(got->element_as_double(e), e < 4 ? 0 : e - 4) << e;
}

// lax.pbroadcast, as JAX's tests/shard_map_test.py test_pbroadcast runs it (there on (4, 2)
// ('x', 'y') with check_vma=False; here 'data', 'model'): the devices at position 0 along the
// axes add 1, and pbroadcast from source 0 gives every device a + 1.
TEST_F(ShardMapTest, PbroadcastReplicatesFromTheSourceAsJaxsTest) {
  ASSERT_NE(client_, nullptr);
  const HostArray a = HostArray::arange(DType::kI32, {4, 4});
  for (const Axes& replicate_on : {Axes{"data"}, Axes{"data", "model"}}) {
    const PartitionSpec spec = replicate_on.size() == 1 ? P("model", None) : P(None, None);
    ShardMapped f = shard_map(
        [replicate_on](const std::vector<Value>& in) {
          const Value x = where(axis_index(replicate_on) == 0, in[0] + 1, in[0]);
          return std::vector<Value>{pbroadcast(x, replicate_on, 0)};
        },
        mesh42(), {spec}, {spec}, {.check_vma = false});
    absl::StatusOr<std::vector<Array>> out = f({put(a, spec)});
    ASSERT_TRUE(out.ok()) << out.status();
    absl::StatusOr<HostArray> got = (*out)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t e = 0; e < 16; ++e) EXPECT_EQ(got->element_as_double(e), e + 1) << spec.to_string() << " " << e;
  }
}

// From a source other than 0, on values that differ along the axis: every block is the
// source's; the result is typed as varying along the axis (JAX's abstract eval gives x's type),
// so out_specs=P() is refused; source out of range is refused naming it. And its gradient,
// JAX's transpose rule (parallel.py _pbroadcast_transpose_rule): the source's block gets the
// sum of every device's cotangent, the others zero.
TEST_F(ShardMapTest, PbroadcastFromAnySourceIsTypedVaryingAndItsGradientSumsIntoTheSource) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(5);
  const HostArray x = random_array(DType::kF32, {8, 3}, Domain::kSigned, rng);
  const HostArray w = random_array(DType::kF32, {8, 3}, Domain::kSigned, rng);
  ShardMapped f =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pbroadcast(in[0], "data", 2) * in[1]}; },
                mesh42(), {P("data", None), P("data", None)}, {P("data", None)});
  absl::StatusOr<std::vector<Array>> out = f({put(x, P("data", None)), put(w, P("data", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  // Block d (rows 2d, 2d + 1) is x's block 2 (rows 4, 5) times w's block d.
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 3; ++c) {
      EXPECT_NEAR(got->element_as_double(r * 3 + c),
                  x.element_as_double((4 + r % 2) * 3 + c) * w.element_as_double(r * 3 + c), 1e-6)
          << r << "," << c;
    }
  }
  TracedFunction loss = [f](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in)[0], {})}; };
  absl::StatusOr<std::vector<Array>> grads = jit(grad(loss, {0}))({put(x, P("data", None)), put(w, P("data", None))});
  ASSERT_TRUE(grads.ok()) << grads.status();
  absl::StatusOr<HostArray> dx = (*grads)[0].fetch();
  ASSERT_TRUE(dx.ok()) << dx.status();
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 3; ++c) {
      double want = 0;  // d loss / d x[r, c]: rows of block 2 collect w's matching row of every block
      if (r / 2 == 2) {
        for (int d = 0; d < 4; ++d) want += w.element_as_double((2 * d + r % 2) * 3 + c);
      }
      EXPECT_NEAR(dx->element_as_double(r * 3 + c), want, 1e-5) << r << "," << c;
    }
  }
  const absl::Status unnamed = trace_error(
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pbroadcast(in[0], "data", 0)}; }, mesh42(),
                {P("data", None)}, {P()}),
      {{DType::kF32, {8, 3}}});
  EXPECT_EQ(unnamed.code(), absl::StatusCode::kInvalidArgument) << unnamed;
  EXPECT_THAT(unnamed.message(), HasSubstr("may differ along mesh axis 'data' (it depends on pbroadcast over 'data', "
                                           "which JAX types as varying along it)"));
  const absl::Status out_of_range = trace_error(
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pbroadcast(in[0], "data", 4)}; }, mesh42(),
                {P("data", None)}, {P("data", None)}),
      {{DType::kF32, {8, 3}}});
  EXPECT_EQ(out_of_range.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out_of_range.message(),
              HasSubstr("pbroadcast(f32[2,3], 'data', source=4): source 4 is not a position along 'data', which has 4 "
                        "devices"));
}

TEST_F(ShardMapTest, StandaloneMatmulWithPsumMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  // The contracting dimension split over 'model': each device multiplies its blocks, psum adds.
  ShardMapped f =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{psum(matmul(in[0], in[1]), "model")}; },
                mesh42(), {P("data", "model"), P("model", None)}, {P("data", None)});
  std::mt19937 rng(7);
  const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
  const HostArray w = random_array(DType::kF32, {8, 4}, Domain::kSigned, rng);
  absl::StatusOr<std::vector<Array>> out = f({put(x, P("data", "model")), put(w, P("model", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok());
  absl::StatusOr<Graph> plain =
      trace([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
            {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
  ASSERT_TRUE(plain.ok());
  absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*plain, {&x, &w});
  ASSERT_TRUE(want.ok());
  EXPECT_TRUE(results_match(*got, (*want)[0], kF32Tolerance));
  EXPECT_EQ((*out)[0].sharding().spec(), P("data", None));
  EXPECT_THAT(f.as_text(), HasSubstr("all_reduce("));
}

// On Auto axes, where the code around the shard_map is partitioned automatically and its
// arguments are moved to the in_specs (on Explicit axes JAX >= 0.9 asks for a reshard first:
// ExplicitShardMap).
TEST_F(ShardMapTest, NestedInJitWithAutomaticCodeAround) {
  ASSERT_NE(client_, nullptr);
  const Mesh& autos = auto_meshes_[1];
  ShardMapped mm = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{psum_scatter(matmul(in[0], in[1]), "model", 1, true)};
      },
      autos, {P("data", "model"), P("model", None)}, {P("data", "model")});
  TracedFunction f = [mm](const std::vector<Value>& in) {
    Value h = tanh(in[0]) * 2.0;  // automatic, before
    Value y = mm({h, in[1]})[0];
    return std::vector<Value>{exp(y * 0.1) + 1.0, sum(y, {0})};  // automatic, after
  };
  std::mt19937 rng(11);
  const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
  const HostArray w = random_array(DType::kF32, {8, 4}, Domain::kSigned, rng);
  absl::StatusOr<JitCheck> r = run_against_host(*client_, autos, f, {&x, &w}, {P("data", None), P()});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(results_match(r->got[0], r->want[0], kF32Tolerance)) << r->plan_text;
  EXPECT_TRUE(results_match(r->got[1], r->want[1], kF32Tolerance)) << r->plan_text;
  EXPECT_EQ(r->out_specs[0], P("data", "model"));
  EXPECT_THAT(r->plan_text, HasSubstr("reduce_scatter("));
}

// shard_map's axis_names (JAX >= 0.9; tests/shard_map_test.py's test_partial_auto): manual over
// 'data' only, automatic over 'model'. The body's collectives over 'data' work, the code around
// it (and a constraint over 'model' after it) is partitioned automatically, and the results
// are a plain host computation's: tanh(x @ w), its column sums (a psum over 'data' of each
// block's), and each device's position along 'data'. On the (4, 2) and (2, 4) meshes, Auto axes.
TEST_F(ShardMapTest, AxisNamesMakeTheBodyManualOverSomeAxesOnly) {
  ASSERT_NE(client_, nullptr);
  for (int m : {1, 2}) {
    const Mesh& mesh = auto_meshes_[m];
    SCOPED_TRACE(mesh.to_string());
    const int64_t data = mesh.shape()[0];
    ShardMapped body = shard_map(
        [](const std::vector<Value>& in) {
          Value h = tanh(matmul(in[0], in[1]));  // this device's rows of tanh(x @ w)
          return std::vector<Value>{h, psum(sum(h, {0}), "data"),
                                    broadcast_to(convert(axis_index("data"), DType::kF32), {1})};
        },
        mesh, {P("data", None), P()}, {P("data", None), P(), P("data")}, {.axis_names = {"data"}});
    Jitted f = jit([body, mesh](const std::vector<Value>& in) {
      std::vector<Value> out = body({in[0] * 0.5, in[1]});  // automatic code before it
      // and after, over 'model'
      out[0] = with_sharding_constraint(out[0] + 1.0, NamedSharding(mesh, P(None, "model")));
      return out;
    });
    std::mt19937 rng(31 + m);
    const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
    const HostArray w = random_array(DType::kF32, {8, 4}, Domain::kSigned, rng);
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", "model")));
    absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P(None, "model")));
    ASSERT_TRUE(xs.ok() && ws.ok());
    absl::StatusOr<std::vector<Array>> out = f({*xs, *ws});
    ASSERT_TRUE(out.ok()) << out.status();
    // The host computation, without shard_map.
    absl::StatusOr<Graph> plain = trace(
        [](const std::vector<Value>& in) {
          Value h = tanh(matmul(in[0] * 0.5, in[1]));
          return std::vector<Value>{h + 1.0, sum(h, {0})};
        },
        {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
    ASSERT_TRUE(plain.ok()) << plain.status();
    absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*plain, {&x, &w});
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<HostArray> h = (*out)[0].fetch();
    absl::StatusOr<HostArray> sums = (*out)[1].fetch();
    absl::StatusOr<HostArray> positions = (*out)[2].fetch();
    ASSERT_TRUE(h.ok() && sums.ok() && positions.ok());
    EXPECT_TRUE(results_match(*h, (*want)[0], kF32Tolerance)) << f.as_text();
    EXPECT_TRUE(results_match(*sums, (*want)[1], kF32Tolerance)) << f.as_text();
    ASSERT_EQ(positions->shape(), (Shape{data}));
    for (int64_t i = 0; i < data; ++i) EXPECT_EQ(positions->element_as_double(i), i);
    EXPECT_EQ((*out)[0].sharding().spec(), P(None, "model"));
    // The psum ran on the sum's split over 'model' (AxisNamesCollectivesRunOnTheAutomaticSplit).
    EXPECT_EQ((*out)[1].sharding().spec().to_string(), "P('model',)");
  }
}

// A shard_map inside a shard_map body, over the axis the outer one left automatic (JAX's
// nested shard_map: tests/shard_map_test.py test_nested_partial_auto, where the outer body is
// manual over 'i' (axis_names={'i'}) and the inner one, with the default axis_names, over 'j'
// too; test_smap_nested_psum, where a value inside the inner body varies along both axes
// ({'x', 'y'}), a psum over the inner axis leaves {'x'}, and the inner's result in the outer
// body varies along {'x'}). The outer runs over 'data', the inner over 'model' with a psum over
// it, then the outer sums over 'data' with a psum: on (4, 2) and (2, 4) meshes, against a
// plain host computation without shard_map.
TEST_F(ShardMapTest, NestedShardMapOverTheAxesTheOuterLeftAutomaticMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  for (int m : {1, 2}) {
    const Mesh& mesh = auto_meshes_[m];
    SCOPED_TRACE(mesh.to_string());
    std::vector<std::string> types;
    ShardMapped inner = shard_map(
        [&](const std::vector<Value>& in) {
          const Value rows = psum(sum(in[0], {1}), "model");  // each row's sum over the whole row
          types = {type_of(in[0]).to_string(), type_of(rows).to_string()};
          return std::vector<Value>{in[0] * in[0], rows};
        },
        mesh, {P(None, "model")}, {P(None, "model"), P()});
    ShardMapped outer = shard_map(
        [&](const std::vector<Value>& in) {
          std::vector<Value> out = inner({in[0] + 1.0});
          types.push_back(type_of(out[1]).to_string());
          out.push_back(psum(sum(out[0], {0}), "data"));  // the column sums of the squares
          return out;
        },
        mesh, {P("data", None)}, {P("data", None), P("data"), P()}, {.axis_names = {"data"}});
    Jitted f = jit([outer](const std::vector<Value>& in) { return outer({in[0] * 0.5}); });
    std::mt19937 rng(71 + m);
    const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", "model")));
    ASSERT_TRUE(xs.ok()) << xs.status();
    absl::StatusOr<std::vector<Array>> out = f({*xs});
    ASSERT_TRUE(out.ok()) << out.status();
    // As JAX types them: both axes inside, the psum's result not along 'model', the inner's
    // result in the outer body along 'data' only.
    const std::string rows_per_data = std::to_string(16 / mesh.shape()[0]);
    EXPECT_THAT(
        types, ::testing::ElementsAre(
                   absl::StrCat("f32[", rows_per_data, ",", 8 / mesh.shape()[1], "]{V:(data,model)}"),
                   absl::StrCat("f32[", rows_per_data, "]{V:data}"), absl::StrCat("f32[", rows_per_data, "]{V:data}")));
    absl::StatusOr<Graph> plain = trace(
        [](const std::vector<Value>& in) {
          const Value y = in[0] * 0.5 + 1.0;
          return std::vector<Value>{y * y, sum(y, {1}), sum(y * y, {0})};
        },
        {{DType::kF32, {16, 8}}});
    ASSERT_TRUE(plain.ok()) << plain.status();
    absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*plain, {&x});
    ASSERT_TRUE(want.ok()) << want.status();
    for (size_t i = 0; i < 3; ++i) {
      absl::StatusOr<HostArray> got = (*out)[i].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(results_match(*got, (*want)[i], kF32Tolerance)) << i << "\n" << f.as_text();
    }
    // The inner out_spec's 'model' after the outer's 'data': the squares leave split over both.
    EXPECT_EQ((*out)[0].sharding().spec(), P("data", "model"));
  }
}

// What a nested shard_map may not do. Its specs may not name an axis the enclosing body is
// already manual over (along it each device holds its own block already; JAX checks nothing
// here and fails in lowering), and with the default axis_names it makes the other axes manual
// (JAX's newly_manual_axes = axis_names - mesh.manual_axes); axis_names leaving none is an
// error. It runs on the enclosing body's mesh (JAX's "The context mesh ... should match the
// mesh passed to shard_map", test_partial_auto_mismatch_mesh_error). After it, the outer body is automatic over 'model'
// again: a collective over it is JAX's unbound axis name.
TEST_F(ShardMapTest, NestedShardMapRefusesTheAxesTheOuterIsManualOver) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[1];
  const auto identity = [](const std::vector<Value>& in) { return in; };
  const auto nested = [&](ShardMapped inner,
                          std::function<std::vector<Value>(const std::vector<Value>&)> after = nullptr) {
    ShardMapped outer = shard_map(
        [inner, after](const std::vector<Value>& in) {
          std::vector<Value> out = inner(in);
          return after ? after(out) : out;
        },
        mesh, {P("data", None)}, {P("data", None)}, {.axis_names = {"data"}});
    return trace_error(outer, {{DType::kF32, {16, 8}}});
  };
  EXPECT_THAT(nested(shard_map(identity, mesh, {P("data", "model")}, {P("data", "model")})).message(),
              HasSubstr("shard_map: in_specs[0] = P('data', 'model') refers to 'data', which the enclosing shard_map "
                        "body is already manual over (its Manual axes are ('data',)); a nested shard_map's specs may "
                        "name only the axes it makes manual ('model',)"));
  EXPECT_THAT(nested(shard_map(identity, mesh, {P(None, "model")}, {P("data", "model")})).message(),
              HasSubstr("out_specs[0] = P('data', 'model') refers to 'data', which the enclosing shard_map body is "
                        "already manual over"));
  EXPECT_THAT(nested(shard_map(identity, mesh, {P()}, {P()}, {.axis_names = {"data"}})).message(),
              HasSubstr("axis_names ('data',) leave no axis to be manual over: the enclosing shard_map body is manual "
                        "over ('data',) already"));
  EXPECT_THAT(nested(shard_map(identity, auto_meshes_[2], {P(None, "model")}, {P(None, "model")})).message(),
              HasSubstr("The context mesh Mesh('data': 4, 'model': 2"));
  EXPECT_THAT(nested(shard_map(identity, mesh, {P(None, "model")}, {P(None, "model")}),
                     [](const std::vector<Value>& out) { return std::vector<Value>{psum(out[0], "model")}; })
                  .message(),
              HasSubstr("unbound axis name: model"));
}

// A nested shard_map body closing over a value of the enclosing body and one of the function
// (JAX's closed-over values are extra inputs of the inner shard_map; shard_map_test.py's
// test_vmap_closure builds its bodies so): each enters the inner body whole (P()), the
// function's through the outer body first. Values against the host: each row's sum of squares
// (psum over 'model'), plus the row's sum of the outer body's 2x, plus the sum of w.
TEST_F(ShardMapTest, NestedShardMapBodyClosesOverEnclosingValuesAsTheHost) {
  ASSERT_NE(client_, nullptr);
  for (int m : {1, 2}) {
    const Mesh& mesh = auto_meshes_[m];
    SCOPED_TRACE(mesh.to_string());
    Jitted f = jit([&mesh](const std::vector<Value>& in) {
      const Value w = in[1];
      ShardMapped outer = shard_map(
          [&mesh, w](const std::vector<Value>& a) {
            const Value doubled = a[0] * 2.0;
            ShardMapped inner = shard_map(
                [doubled, w](const std::vector<Value>& b) {
                  return std::vector<Value>{psum(sum(b[0] * b[0], {1}), "model") + sum(doubled, {1}) + sum(w)};
                },
                mesh, {P(None, "model")}, {P()});
            return inner(a);
          },
          mesh, {P("data", None)}, {P("data")}, {.axis_names = {"data"}});
      return outer({in[0]});
    });
    std::mt19937 rng(83 + m);
    const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
    const HostArray w = random_array(DType::kF32, {8}, Domain::kSigned, rng);
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", "model")));
    absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P()));
    ASSERT_TRUE(xs.ok() && ws.ok()) << xs.status() << ws.status();
    absl::StatusOr<std::vector<Array>> out = f({*xs, *ws});
    ASSERT_TRUE(out.ok()) << out.status();
    absl::StatusOr<Graph> plain = trace(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{sum(in[0] * in[0], {1}) + sum(in[0] * 2.0, {1}) + sum(in[1])};
        },
        {{DType::kF32, {16, 8}}, {DType::kF32, {8}}});
    ASSERT_TRUE(plain.ok()) << plain.status();
    absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*plain, {&x, &w});
    ASSERT_TRUE(want.ok()) << want.status();
    absl::StatusOr<HostArray> got = (*out)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_TRUE(results_match(*got, (*want)[0], kF32Tolerance)) << f.as_text();
  }
}

// A shard_map inside a control-flow body of a shard_map body (JAX allows a shard_map wherever
// it traces, a loop or cond body included: jax/_src/shard_map.py's newly_manual_axes =
// axis_names - mesh.manual_axes, as tests/shard_map_test.py's test_nested_partial_auto builds
// the nesting without a loop). On the (4, 2) Auto and Explicit meshes the outer body is manual over 'data'
// (axis_names) with x's (4, 8) block; the inner shard_map is manual over 'model' and psums
// each row's sum over it. Per row r of the block, one step is
//   c[r][j] <- c[r][j] / 2 + w[k][j] + rowsum(c[r]) / 100           (rowsum over the whole row)
// with the scan's ys the row sums before the step, and the fori_loop's step adds i and sum(w) /
// 1000 (two values the inner body closes over: the loop's counter and an outer-body value the
// loop captures) instead of w[k]. The host runs the same loops on the rows.
struct NestedLoopHost {
  std::vector<double> carry, ys, looped;
};
NestedLoopHost nested_loop_on_host(const HostArray& x, const HostArray& w, int64_t steps) {
  const int64_t rows = x.shape()[0], cols = x.shape()[1];
  NestedLoopHost h;
  h.carry.assign(x.values<float>().begin(), x.values<float>().end());
  h.looped = h.carry;
  h.ys.assign(steps * rows, 0.0);
  double w_total = 0;
  for (int64_t i = 0; i < w.size(); ++i) w_total += w.element_as_double(i);
  const auto step = [&](std::vector<double>& c, int64_t r, const std::function<double(int64_t)>& add) {
    double total = 0;
    for (int64_t j = 0; j < cols; ++j) total += c[r * cols + j];
    for (int64_t j = 0; j < cols; ++j) c[r * cols + j] = c[r * cols + j] * 0.5 + add(j) + total * 0.01;
    return total;
  };
  for (int64_t k = 0; k < steps; ++k) {
    for (int64_t r = 0; r < rows; ++r) {
      h.ys[k * rows + r] = step(h.carry, r, [&](int64_t j) { return w.element_as_double(k * cols + j); });
      step(h.looped, r, [&](int64_t) { return static_cast<double>(k) + w_total * 0.001; });
    }
  }
  return h;
}

// The scan's and the fori_loop's inner shard_maps (manual over 'model', inside the outer body
// manual over 'data'): each row's sum psum'd over 'model'.
Value row_sums(const Value& block) { return psum(sum(block, {1}), "model"); }
Value with_row_sums(const Value& block, const Value& sums) {
  return block * 0.5 + reshape(sums, {sums.shape()[0], 1}) * 0.01;
}
ShardMapped scan_step(const Mesh& mesh) {
  return shard_map(
      [](const std::vector<Value>& in) {
        const Value sums = row_sums(in[0]);
        return std::vector<Value>{with_row_sums(in[0], sums) + in[1], sums};
      },
      mesh, {P(None, "model"), P("model")}, {P(None, "model"), P()});
}
// The outer shard_map: a scan over w's rows and a fori_loop, each step a shard_map call.
ShardMapped loops_calling_a_shard_map(const Mesh& mesh, int64_t steps) {
  return shard_map(
      [mesh, steps](const std::vector<Value>& in) {
        const ShardMapped step = scan_step(mesh);
        ScanResult r = scan(
            [&step, &mesh](const std::vector<Value>& c, const std::vector<Value>& row) {
              // On Explicit axes the row's type must be the in_spec's (JAX's in_specs check; a
              // reshard takes Explicit axes only).
              const bool typed = mesh.axis_types()[1] == AxisType::kExplicit;
              std::vector<Value> out = step({c[0], typed ? reshard(row[0], P("model")) : row[0]});
              return ScanStep{{out[0]}, {out[1]}};
            },
            {in[0]}, {in[1]});
        const Value w = in[1];
        const std::vector<Value> looped =
            fori_loop(0, steps,
                      [&mesh, w](const Value& i, const std::vector<Value>& c) {
                        const Value counter = convert(i, DType::kF32);
                        return shard_map(
                            [counter, w](const std::vector<Value>& b) {
                              return std::vector<Value>{with_row_sums(b[0], row_sums(b[0])) + counter + sum(w) * 0.001};
                            },
                            mesh, {P(None, "model")}, {P(None, "model")})(c);
                      },
                      {in[0]});
        return std::vector<Value>{r.carry[0], r.ys[0], looped[0]};
      },
      mesh, {P("data", None), P()}, {P("data", None), P(None, "data"), P("data", None)}, {.axis_names = {"data"}});
}

// x (16, 8) and w (steps, 8), random from `seed`.
std::pair<HostArray, HostArray> loop_inputs(uint32_t seed, int64_t steps) {
  std::mt19937 rng(seed);
  HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
  return {std::move(x), random_array(DType::kF32, {steps, 8}, Domain::kSigned, rng)};
}

// Each of `got` against the host's values `want` (same element order).
void expect_near_host(const std::vector<Array>& got, const std::vector<std::vector<double>>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    absl::StatusOr<HostArray> h = got[k].fetch();
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_EQ(h->size(), static_cast<int64_t>(want[k].size())) << k;
    for (int64_t i = 0; i < h->size(); ++i) {
      EXPECT_NEAR(h->element_as_double(i), want[k][i], 1e-4 * (1 + std::abs(want[k][i])))
          << "result " << k << " at " << i;
    }
  }
}

TEST_F(ShardMapTest, NestedShardMapInALoopBodyOfAShardMapBodyMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kSteps = 3;
  const auto [x, w] = loop_inputs(97, kSteps);
  const NestedLoopHost want = nested_loop_on_host(x, w, kSteps);
  for (const Mesh& mesh : {auto_meshes_[1], mesh42()}) {
    SCOPED_TRACE(mesh.to_string());
    const MeshScope scope = set_mesh(mesh);  // for the bare spec of the row's reshard
    const ShardMapped outer = loops_calling_a_shard_map(mesh, kSteps);
    Jitted f = jit([outer](const std::vector<Value>& in) { return outer(in); });
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", "model")));
    absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P()));
    ASSERT_TRUE(xs.ok() && ws.ok()) << xs.status() << ws.status();
    absl::StatusOr<std::vector<Array>> out = f({*xs, *ws});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near_host(*out, {want.carry, want.ys, want.looped});
  }
}

// x + 2 * sum(w), elementwise: two iterations of adding the sum of w.
std::vector<double> x_plus_twice_sum(const HostArray& x, const HostArray& w) {
  double total = 0;
  for (float v : w.values<float>()) total += v;
  std::vector<double> want(x.values<float>().begin(), x.values<float>().end());
  for (double& v : want) v += 2 * total;
  return want;
}

// w f32[4,8] P(None, 'model') entering an inner shard_map as P(): refused on Explicit axes (its
// type is split), else the host's values.
void expect_entered_as_p(const absl::StatusOr<std::vector<Array>>& out, const Mesh& mesh,
                         const std::vector<double>& want) {
  if (mesh.axis_types()[1] == AxisType::kExplicit) {
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(out.status().message()),
                HasSubstr("f32[4,8@model], which enters it whole on every device (P()), but its type is split; "
                          "reshard it to P() first"));
  } else {
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near_host(*out, {want});
  }
}

// Two fori_loop steps over carry c, each calling a shard_map over 'model' (`options`) whose body
// adds sum(w), w closed over; the loop body reads w before the call when `read_before`.
std::vector<Value> add_sum_twice_through_a_shard_map(const Mesh& mesh, const Value& w, const Value& c, bool read_before,
                                                     const ShardMapOptions& options = {}) {
  return fori_loop(0, 2,
                   [&mesh, w, read_before, options](const Value&, const std::vector<Value>& carry) {
                     if (read_before) (void)(w * 1.0);  // captures w before the call
                     return shard_map([w](const std::vector<Value>& b) { return std::vector<Value>{b[0] + sum(w)}; },
                                      mesh, {P(None, "model")}, {P(None, "model")}, options)(carry);
                   },
                   {c});
}

// For both read orders on each of `meshes` (an Auto and an Explicit (4, 2) mesh): `make(mesh,
// read_before)`'s function, on random x (16, 8) laid out P('data', 'model') and w (4, 8) laid
// out P(None, 'model') (from `seed`), gives expect_entered_as_p's outcome. `make`'s function may
// keep a reference to the mesh: it lives until the call returns.
void expect_both_read_orders_enter_as_p(Client& client, const std::vector<Mesh>& meshes, uint32_t seed,
                                        const std::function<Jitted(const Mesh&, bool)>& make) {
  std::mt19937 rng(seed);
  const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
  const HostArray w = random_array(DType::kF32, {4, 8}, Domain::kSigned, rng);
  const std::vector<double> want = x_plus_twice_sum(x, w);
  for (const bool read_before : {false, true}) {
    for (const Mesh& mesh : meshes) {
      SCOPED_TRACE(absl::StrCat(mesh.to_string(), read_before ? ", read before" : ", first read inside"));
      Jitted f = make(mesh, read_before);
      absl::StatusOr<Array> xs = client.device_put(x, NamedSharding(mesh, P("data", "model")));
      absl::StatusOr<Array> ws = client.device_put(w, NamedSharding(mesh, P(None, "model")));
      ASSERT_TRUE(xs.ok() && ws.ok()) << xs.status() << ws.status();
      absl::StatusOr<std::vector<Array>> out = f({*xs, *ws});
      expect_entered_as_p(out, mesh, want);
    }
  }
}

// A value of the function read inside an inner shard_map called in a fori_loop body of the
// outer body enters the inner body as a closed-over value (a shard_map_in of P()) whether the
// loop body read it before the inner call or first inside it: the same values (the host's:
// each row plus 2 * sum(w), w whole on every device) on Auto axes, and on Explicit axes, where
// w's type is split over the inner manual axis 'model', the same refusal as directly nested
// (OnExplicitAxesAClosedOverSplitValueIsAnErrorNamingIt). JAX closes over it the same way
// whatever the read order: a const of the body enters with _repspec, P() (jax/_src/shard_map.py,
// _shard_map_staging).
TEST_F(ShardMapTest, AValueFirstReadInsideAShardMapInALoopBodyEntersItLikeOneReadBefore) {
  ASSERT_NE(client_, nullptr);
  expect_both_read_orders_enter_as_p(*client_, {auto_meshes_[1], mesh42()}, 23, [](const Mesh& mesh, bool read_before) {
    const ShardMapped outer = shard_map(
        [&mesh, read_before](const std::vector<Value>& in) {
          return add_sum_twice_through_a_shard_map(mesh, in[1], in[0], read_before);
        },
        mesh, {P("data", None), P()}, {P("data", None)}, {.axis_names = {"data"}});
    return jit([outer](const std::vector<Value>& in) { return outer(in); });
  });
}

// The same at the top level of a loop body (no outer shard_map): a jit argument first read inside
// a shard_map called in a fori_loop body enters it as one read before the call does (a
// shard_map_in of P(): the values on Auto axes, the refusal of a split type on Explicit ones).
TEST_F(ShardMapTest, AJitValueFirstReadInsideAShardMapInATopLevelLoopBodyEntersItLikeOneReadBefore) {
  ASSERT_NE(client_, nullptr);
  expect_both_read_orders_enter_as_p(*client_, {auto_meshes_[1], mesh42()}, 29, [](const Mesh& mesh, bool read_before) {
    return jit([&mesh, read_before](const std::vector<Value>& in) {
      return add_sum_twice_through_a_shard_map(mesh, in[1], in[0], read_before, {.axis_names = {"model"}});
    });
  });
}

// A value of the outer body read inside an inner shard_map keeps the varying axes it has there
// (JAX traces a closed-over value with its own aval, vma included: jax/_src/shard_map.py's
// _shard_map_staging, the consts pe.separate_consts takes out of the traced jaxpr): v, split
// over 'data' by the outer in_spec, varies along 'data' in the inner body too, directly nested
// and in a fori_loop body, read there first or before the inner call.
TEST_F(ShardMapTest, AClosedOverValueKeepsItsVaryingAxesInANestedShardMapBody) {
  ASSERT_NE(client_, nullptr);
  for (const int where : {0, 1, 2}) {  // directly nested; in a loop, read first inside; read before
    SCOPED_TRACE(where);
    std::vector<std::string> varying = {"unset"};
    const Mesh mesh = mesh42();
    const ShardMapped outer = shard_map(
        [&](const std::vector<Value>& in) {
          const Value v = in[0] * 2.0;
          const ShardMapped inner = shard_map(
              [&v, &varying](const std::vector<Value>& b) {
                varying = type_of(v * 1.0).varying;
                return std::vector<Value>{b[0]};
              },
              mesh, {P(None, "model")}, {P(None, "model")});
          if (where == 0) return inner({in[0]});
          return fori_loop(0, 1,
                           [&](const Value&, const std::vector<Value>& c) {
                             if (where == 2) (void)(v * 1.0);  // captures v before the inner call
                             return inner(c);
                           },
                           {in[0]});
        },
        mesh, {P("data", None)}, {P("data", None)}, {.axis_names = {"data"}});
    ASSERT_TRUE(trace_error([outer](const std::vector<Value>& in) { return outer(in); }).ok());
    EXPECT_EQ(varying, (std::vector<std::string>{"data"}));
  }
}

// The same inside a cond branch and a while_loop body of the outer body. The predicate is each
// 'data' block's own (sum > 0: some blocks take the branch with the inner psum over 'model',
// the others double their block; the devices along 'model' of one block agree, so the psum
// meets all its peers), and the while_loop runs the step three times on a counter it carries.
TEST_F(ShardMapTest, NestedShardMapInACondBranchAndAWhileBodyOfAShardMapBodyMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  for (const Mesh& mesh : {auto_meshes_[1], mesh42()}) {
    SCOPED_TRACE(mesh.to_string());
    const ShardMapped step = shard_map(
        [](const std::vector<Value>& in) { return std::vector<Value>{with_row_sums(in[0], row_sums(in[0]))}; }, mesh,
        {P(None, "model")}, {P(None, "model")});
    const ShardMapped outer = shard_map(
        [step](const std::vector<Value>& in) {
          const std::vector<Value> branched = cond(
              sum(in[0]) > 0.0, [step](const std::vector<Value>& b) { return step(b); },
              [](const std::vector<Value>& b) { return std::vector<Value>{b[0] * 2.0}; }, {in[0]});
          const std::vector<Value> looped = while_loop([](const std::vector<Value>& c) { return c[1] < 3.0; },
                                                       [step](const std::vector<Value>& c) {
                                                         return std::vector<Value>{step({c[0]})[0], c[1] + 1.0};
                                                       },
                                                       {in[0], full({}, 0.0, DType::kF32)});
          return std::vector<Value>{branched[0], looped[0]};
        },
        mesh, {P("data", None)}, {P("data", None), P("data", None)}, {.axis_names = {"data"}});
    Jitted f = jit([outer](const std::vector<Value>& in) { return outer(in); });
    std::mt19937 rng(101);
    HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
    // Blocks 0 and 2 positive, 1 and 3 negative: both branches run.
    for (int64_t i = 0; i < x.size(); ++i) {
      const float v = std::abs(x.values<float>()[i]) + 0.1f;
      x.mutable_values<float>()[i] = (i / 32) % 2 == 0 ? v : -v;
    }
    std::vector<double> branched(x.values<float>().begin(), x.values<float>().end()), looped = branched;
    for (int64_t b = 0; b < 4; ++b) {
      double total = 0;
      for (int64_t i = b * 32; i < (b + 1) * 32; ++i) total += branched[i];
      for (int64_t r = b * 4; r < (b + 1) * 4; ++r) {
        double row = 0;
        for (int64_t j = 0; j < 8; ++j) row += branched[r * 8 + j];
        for (int64_t j = 0; j < 8; ++j) {
          double& v = branched[r * 8 + j];
          v = total > 0 ? v * 0.5 + row * 0.01 : v * 2;
        }
      }
    }
    for (int k = 0; k < 3; ++k) {
      for (int64_t r = 0; r < 16; ++r) {
        double row = 0;
        for (int64_t j = 0; j < 8; ++j) row += looped[r * 8 + j];
        for (int64_t j = 0; j < 8; ++j) looped[r * 8 + j] = looped[r * 8 + j] * 0.5 + row * 0.01;
      }
    }
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", "model")));
    ASSERT_TRUE(xs.ok()) << xs.status();
    absl::StatusOr<std::vector<Array>> out = f({*xs});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near_host(*out, {branched, looped});
  }
}

// grad through the scan of NestedShardMapInALoopBody...: the step is linear per row, c' = A c +
// w[k] with A = I / 2 + 11^T / 100 (symmetric), so for loss = sum(carry^2) the host's gradient
// is 2 A^3 c3 per row of x and 2 sum_rows A^(2-k) c3 for row k of w (c3: the final carry).
TEST_F(ShardMapTest, GradThroughAScanCallingANestedShardMapMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kSteps = 3;
  const auto [x, w] = loop_inputs(103, kSteps);
  const std::vector<double> c3 = nested_loop_on_host(x, w, kSteps).carry;
  const auto times_a = [](std::vector<double> v) {  // A applied to each row of v
    for (size_t r = 0; r < v.size() / 8; ++r) {
      double row = 0;
      for (int j = 0; j < 8; ++j) row += v[r * 8 + j];
      for (int j = 0; j < 8; ++j) v[r * 8 + j] = v[r * 8 + j] * 0.5 + row * 0.01;
    }
    return v;
  };
  std::vector<double> g = c3;
  for (double& v : g) v *= 2;
  std::vector<double> dw(kSteps * 8, 0.0);
  for (int64_t k = kSteps - 1; k >= 0; --k) {  // g = 2 A^(2-k) c3 at step k
    for (size_t i = 0; i < g.size(); ++i) dw[k * 8 + i % 8] += g[i];
    g = times_a(g);
  }
  for (const Mesh& mesh : {auto_meshes_[1], mesh42()}) {
    SCOPED_TRACE(mesh.to_string());
    const MeshScope scope = set_mesh(mesh);  // for the bare spec of the row's reshard
    const ShardMapped outer = loops_calling_a_shard_map(mesh, kSteps);
    Jitted f = jit(grad(
        [outer](const std::vector<Value>& in) {
          const Value c = outer(in)[0];
          return std::vector<Value>{sum(c * c)};
        },
        {0, 1}));
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", "model")));
    absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P()));
    ASSERT_TRUE(xs.ok() && ws.ok()) << xs.status() << ws.status();
    absl::StatusOr<std::vector<Array>> out = f({*xs, *ws});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_near_host(*out, {g, dw});
  }
}

// The line of `plan` that computes `op` (its first), for the local shape each device computes.
std::string plan_line(const std::string& plan, const std::string& op) {
  const size_t at = plan.find(absl::StrCat("= ", op, "("));
  if (at == std::string::npos) return "";
  const size_t start = plan.rfind('\n', at);
  return plan.substr(start == std::string::npos ? 0 : start + 1, plan.find('\n', at) - start - 1);
}

// A body manual over 'data' only has its work split over 'model' by the compiler, as GSPMD and
// Shardy split a partial-manual JAX body (the body sees its values sharded over the automatic
// axes: tests/shard_map_test.py's test_partial_auto_explicit_multi_explicit types the result
// P(('i', 'l'), ('j', 'k'), ...), the manual axes then the automatic ones): each device
// multiplies its block of x by its own columns of w — the dot's local result is
// (rows / data, 4 / model), not the whole block — nothing is gathered, and the result leaves
// split over both axes. Checked against a plain host computation.
TEST_F(ShardMapTest, AxisNamesSplitTheBodysWorkOverTheAutomaticAxes) {
  ASSERT_NE(client_, nullptr);
  for (int m : {1, 2}) {
    const Mesh& mesh = auto_meshes_[m];
    SCOPED_TRACE(mesh.to_string());
    const int64_t data = mesh.shape()[0], model = mesh.shape()[1];
    ShardMapped body =
        shard_map([](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; }, mesh,
                  {P("data", None), P()}, {P("data", None)}, {.axis_names = {"data"}});
    absl::StatusOr<TanhMatmulRun> run = run_tanh_matmul(mesh, body, 71 + m);
    ASSERT_TRUE(run.ok()) << run.status();
    EXPECT_TRUE(results_match(run->got[0], run->want, kF32Tolerance)) << run->plan;
    EXPECT_THAT(plan_line(run->plan, "dot_general"), HasSubstr(absl::StrCat(" f32[", 16 / data, ",", 4 / model, "]")))
        << run->plan;
    EXPECT_THAT(run->plan, ::testing::Not(HasSubstr("all_gather"))) << run->plan;
    EXPECT_EQ(run->specs[0].to_string(), "P('data', 'model')");
  }
}

// A psum and a ppermute over the manual axis act on each element alone, so they run on each
// device's piece of the block as the compiler split it over 'model' (local (rows/data,
// 4/model)), with nothing gathered first; values against the host: the psum adds the 'data'
// blocks of tanh(x @ w), the ppermute moves block i to i + 1 around the ring.
// Collectives that only move values (ppermute, all_gather, all_to_all) are compared with the
// host's tanh(x @ w) within kMoved: each device computes its block's matmul, the host the whole
// one, and OpenBLAS's result may differ in the last bit with the shape (seen on a fresh machine
// in session 38: 1-ulp differences, against tanh values in (-1, 1); a misplaced block differs by
// far more).
constexpr double kMoved = 1e-6;

TEST_F(ShardMapTest, AxisNamesCollectivesRunOnTheAutomaticSplit) {
  ASSERT_NE(client_, nullptr);
  for (int m : {1, 2}) {
    const Mesh& mesh = auto_meshes_[m];
    SCOPED_TRACE(mesh.to_string());
    const int64_t data = mesh.shape()[0], model = mesh.shape()[1], rows = 16 / data;
    std::vector<std::pair<int64_t, int64_t>> ring;
    for (int64_t i = 0; i < data; ++i) ring.push_back({i, (i + 1) % data});
    ShardMapped body = shard_map(
        [ring](const std::vector<Value>& in) {
          Value h = tanh(matmul(in[0], in[1]));
          return std::vector<Value>{psum(h, "data"), ppermute(h, "data", ring)};
        },
        mesh, {P("data", None), P()}, {P(), P("data", None)}, {.axis_names = {"data"}});
    absl::StatusOr<TanhMatmulRun> run = run_tanh_matmul(mesh, body, 91 + m);
    ASSERT_TRUE(run.ok()) << run.status();
    const HostArray* sums = &run->got[0];
    const HostArray* moved = &run->got[1];
    ASSERT_EQ(sums->shape(), (Shape{rows, 4}));
    ASSERT_EQ(moved->shape(), (Shape{16, 4}));
    const HostArray& want = run->want;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < 4; ++c) {
        double sum = 0;
        for (int64_t b = 0; b < data; ++b) sum += want.element_as_double((b * rows + r) * 4 + c);
        EXPECT_NEAR(sums->element_as_double(r * 4 + c), sum, 1e-5) << r << "," << c;
      }
    }
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t from = ((r / rows + data - 1) % data) * rows + r % rows;  // block i came from i - 1
      for (int64_t c = 0; c < 4; ++c) {
        // kMoved: the permute moves values exactly, but they are a device's matmul of its block.
        EXPECT_NEAR(moved->element_as_double(r * 4 + c), want.element_as_double(from * 4 + c), kMoved) << r << "," << c;
      }
    }
    const std::string local = absl::StrCat(" f32[", rows, ",", 4 / model, "]");
    EXPECT_THAT(plan_line(run->plan, "all_reduce"), HasSubstr(local)) << run->plan;
    EXPECT_THAT(plan_line(run->plan, "collective_permute"), HasSubstr(local)) << run->plan;
    EXPECT_THAT(run->plan, ::testing::Not(HasSubstr("all_gather"))) << run->plan;
    EXPECT_EQ(run->specs[0].to_string(), "P(None, 'model')");
  }
}

// all_gather, psum_scatter and all_to_all over the manual axis move rows only (dimension 0),
// so they too run on each device's piece as the compiler split it over 'model' along the
// columns: local results (16, 4/model), (rows/data, 4/model), (rows, 4/model), nothing gathered
// over 'model' first. Values against the host's tanh(x @ w), from lax's definitions:
// all_gather stacks the 'data' blocks (the whole value); psum_scatter's row g (of rows) is the
// sum over blocks b of row b * rows + g; all_to_all sends piece j of block i (q = rows / data
// rows) to device j, which stacks them by i: its global row j * rows + i * q + t is
// want[i * rows + j * q + t].
TEST_F(ShardMapTest, AxisNamesMovingCollectivesRunOnTheAutomaticSplit) {
  ASSERT_NE(client_, nullptr);
  for (int m : {1, 2}) {
    const Mesh& mesh = auto_meshes_[m];
    SCOPED_TRACE(mesh.to_string());
    const int64_t data = mesh.shape()[0], model = mesh.shape()[1], rows = 16 / data, q = rows / data;
    ShardMapped body = shard_map(
        [](const std::vector<Value>& in) {
          Value h = tanh(matmul(in[0], in[1]));
          return std::vector<Value>{all_gather(h, "data", 0, true), psum_scatter(h, "data", 0, true),
                                    all_to_all(h, "data", 0, 0, true)};
        },
        mesh, {P("data", None), P()}, {P(), P("data", None), P("data", None)},
        {.check_vma = false, .axis_names = {"data"}});  // all_gather's result is typed varying, as JAX types it
    absl::StatusOr<TanhMatmulRun> run = run_tanh_matmul(mesh, body, 97 + m);
    ASSERT_TRUE(run.ok()) << run.status();
    const HostArray& want = run->want;
    const HostArray &gathered = run->got[0], &scattered = run->got[1], &moved = run->got[2];
    ASSERT_EQ(gathered.shape(), (Shape{16, 4}));
    ASSERT_EQ(scattered.shape(), (Shape{rows, 4}));
    ASSERT_EQ(moved.shape(), (Shape{16, 4}));
    for (int64_t e = 0; e < 64; ++e) EXPECT_NEAR(gathered.element_as_double(e), want.element_as_double(e), kMoved) << e;
    for (int64_t g = 0; g < rows; ++g) {
      for (int64_t c = 0; c < 4; ++c) {
        double sum = 0;
        for (int64_t b = 0; b < data; ++b) sum += want.element_as_double((b * rows + g) * 4 + c);
        EXPECT_NEAR(scattered.element_as_double(g * 4 + c), sum, 1e-5) << g << "," << c;
      }
    }
    for (int64_t j = 0; j < data; ++j) {
      for (int64_t i = 0; i < data; ++i) {
        for (int64_t t = 0; t < q; ++t) {
          for (int64_t c = 0; c < 4; ++c) {
            EXPECT_NEAR(moved.element_as_double((j * rows + i * q + t) * 4 + c),
                        want.element_as_double((i * rows + j * q + t) * 4 + c), kMoved)
                << j << "," << i << "," << t << "," << c;
          }
        }
      }
    }
    const std::string cols = absl::StrCat(",", 4 / model, "]");
    EXPECT_THAT(plan_line(run->plan, "all_gather"), HasSubstr(absl::StrCat(" f32[16", cols))) << run->plan;
    EXPECT_THAT(plan_line(run->plan, "reduce_scatter"), HasSubstr(absl::StrCat(" f32[", q, cols))) << run->plan;
    EXPECT_THAT(plan_line(run->plan, "all_to_all"), HasSubstr(absl::StrCat(" f32[", rows, cols))) << run->plan;
    // Nothing moves over 'model': the pieces stay where the dot made them.
    for (const std::string op : {"all_gather", "reduce_scatter", "all_to_all"}) {
      EXPECT_THAT(plan_line(run->plan, op), HasSubstr("axes=('data',)")) << run->plan;
    }
    EXPECT_THAT(run->plan, ::testing::Not(HasSubstr("axes=('model',)"))) << run->plan;
  }
}

// JAX's tests/shard_map_test.py, on a (2, 2, 2) mesh: test_partial_auto_propagate_through (a
// body manual over 'j' and 'k' constrains x * x to P('i'), its automatic axis: the result is
// v * v, laid out P('i')), and test_partial_auto_ppermute on (4, 2) (a constraint over the
// automatic 'j', then a ppermute over the manual 'i': [6, 7, 0, 1, 2, 3, 4, 5]); and
// test_partial_auto_error_wsc_manual: a constraint naming a manual axis is refused ("manual").
TEST_F(ShardMapTest, AxisNamesBodiesTakeConstraintsOverTheAutomaticAxes) {
  ASSERT_NE(client_, nullptr);
  absl::StatusOr<Mesh> made = client_->make_mesh({2, 2, 2}, {"i", "j", "k"});
  ASSERT_TRUE(made.ok()) << made.status();
  const Mesh mesh3 = with_auto_axes(*made);
  const NamedSharding sharding(mesh3, P("i"));
  ShardMapped g = shard_map(
      [sharding](const std::vector<Value>& in) {
        return std::vector<Value>{with_sharding_constraint(in[0] * in[0], sharding)};
      },
      mesh3, {P()}, {P()}, {.check_vma = false, .axis_names = {"j", "k"}});
  Jitted f = jit([g](const std::vector<Value>& in) { return g(in); });
  const HostArray v = HostArray::arange(DType::kF32, {4, 8});
  absl::StatusOr<Array> vs = client_->device_put(v, sharding);
  ASSERT_TRUE(vs.ok()) << vs.status();
  absl::StatusOr<std::vector<Array>> out = f({*vs});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->shape(), (Shape{4, 8}));
  for (int64_t i = 0; i < 32; ++i) EXPECT_EQ(got->element_as_double(i), static_cast<double>(i * i)) << i;
  EXPECT_TRUE((*out)[0].sharding().is_equivalent_to(sharding, 2)) << (*out)[0].sharding().to_string();
  // Each device squares its half of the rows, not the whole (4, 8).
  EXPECT_THAT(plan_line(f.as_text(), "mul"), HasSubstr(" f32[2,8]")) << f.as_text();

  const Mesh& mesh = auto_meshes_[1];
  ShardMapped permuted = shard_map(
      [&mesh](const std::vector<Value>& in) {
        Value x = with_sharding_constraint(in[0], NamedSharding(mesh, P("model")));
        return std::vector<Value>{ppermute(x, "data", {{0, 1}, {1, 2}, {2, 3}, {3, 0}})};
      },
      mesh, {P("data")}, {P("data")}, {.check_vma = false, .axis_names = {"data"}});
  Jitted p = jit([permuted](const std::vector<Value>& in) { return permuted(in); });
  absl::StatusOr<Array> xs = client_->device_put(HostArray::arange(DType::kF32, {8}), NamedSharding(mesh, P()));
  ASSERT_TRUE(xs.ok()) << xs.status();
  out = p({*xs});
  ASSERT_TRUE(out.ok()) << out.status();
  got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<double> want = {6, 7, 0, 1, 2, 3, 4, 5};
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(got->element_as_double(i), want[i]) << i;

  absl::Status s = trace_error([&mesh](const std::vector<Value>& in) {
    return shard_map(
        [&mesh](const std::vector<Value>& b) {
          return std::vector<Value>{with_sharding_constraint(b[0], NamedSharding(mesh, P("data", "model"))) * 2.0};
        },
        mesh, {P("data", None)}, {P("data", None)}, {.check_vma = false, .axis_names = {"data"}})(in);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()),
            "with_sharding_constraint: P('data', 'model') names 'data', a manual axis of the enclosing shard_map (its "
            "axis_names are ('data',)); inside the body only its automatic axes may be named");
}

// JAX's tests/shard_map_test.py, test_partial_auto_explicit_multi_explicit, on Explicit axes:
// on a (2, 1, 2, 2) mesh ('i', 'j', 'k', 'l'), an argument P('i', 'j', 'k', 'l') enters a body
// manual over 'i' and 'j' (in_specs inferred from its type) typed P(None, None, 'k', 'l'); its
// transpose is P('l', 'k', None, None), and the shard_map's result under out_specs
// P('i', 'j', None, None) is P(('i', 'l'), ('j', 'k'), None, None), in its type and on the
// devices. Values against the host.
TEST_F(ShardMapTest, AxisNamesOnExplicitAxesKeepTheAutomaticSplitInTheTypes) {
  ASSERT_NE(client_, nullptr);
  absl::StatusOr<Mesh> mesh = client_->make_mesh({2, 1, 2, 2}, {"i", "j", "k", "l"});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  std::string inside, transposed, result;
  ShardMapped g = shard_map(
      [&](const std::vector<Value>& in) {
        inside = type_of(in[0]).to_string();
        Value out = transpose(in[0], {3, 2, 1, 0});
        transposed = type_of(out).to_string();
        return std::vector<Value>{out};
      },
      *mesh, {}, {P("i", "j", None, None)}, {.axis_names = {"i", "j"}});
  Jitted f = jit([&](const std::vector<Value>& in) {
    std::vector<Value> out = g(in);
    result = type_of(out[0]).to_string();
    return out;
  });
  const HostArray v = HostArray::arange(DType::kF32, {4, 2, 2, 4});
  absl::StatusOr<Array> vs = client_->device_put(v, NamedSharding(*mesh, P("i", "j", "k", "l")));
  ASSERT_TRUE(vs.ok()) << vs.status();
  absl::StatusOr<std::vector<Array>> out = f({*vs});
  ASSERT_TRUE(out.ok()) << out.status();
  // Varying along the manual axes its inferred in_spec names (JAX prints {V:(i,j)} after the
  // shape; jax/_src/core.py's _vma_ur_str, size-1 axes kept as remove_size_one_mesh_axis_from_type
  // defaults to False).
  EXPECT_EQ(inside, "f32[2,2,2@k,4@l]{V:(i,j)}");
  EXPECT_EQ(transposed, "f32[4@l,2@k,2,2]{V:(i,j)}");
  EXPECT_EQ(result, "f32[8@(i,l),2@(j,k),2,2]");
  EXPECT_EQ((*out)[0].sharding().spec().to_string(), "P(('i', 'l'), ('j', 'k'), None, None)");
  // The host: each 'i' block of rows (2 of them) transposed, the blocks stacked along dim 0.
  absl::StatusOr<Graph> plain = trace(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{concatenate({transpose(slice(in[0], {0, 0, 0, 0}, {2, 2, 2, 4}), {3, 2, 1, 0}),
                                               transpose(slice(in[0], {2, 0, 0, 0}, {4, 2, 2, 4}), {3, 2, 1, 0})},
                                              0)};
      },
      {{DType::kF32, {4, 2, 2, 4}}});
  ASSERT_TRUE(plain.ok()) << plain.status();
  absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*plain, {&v});
  ASSERT_TRUE(want.ok()) << want.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(results_match(*got, (*want)[0], 0.0)) << f.as_text();
}

// What axis_names refuses, in JAX's words (jax/_src/shard_map.py's _shmap_checks and
// _check_specs; tests/shard_map_test.py's test_partial_auto_error_wrong_in_specs: "in_specs
// refers to 'j'"): specs naming an automatic axis, axis_names outside the mesh, and (JAX:
// "unbound axis name") a collective or axis_index over an automatic axis.
TEST_F(ShardMapTest, AxisNamesRefuseSpecsAndCollectivesOverAutomaticAxes) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[1];
  auto identity = [](const std::vector<Value>& in) { return std::vector<Value>{in[0]}; };
  absl::Status s = trace_error([&](const std::vector<Value>& in) {
    return shard_map(identity, mesh, {P("data", "model")}, {P("data", None)}, {.axis_names = {"data"}})(in);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()),
            "shard_map: in_specs argument must refer to an axis marked as manual ('data',), but in_specs[0] refers "
            "to 'model'; check the in_specs values passed to shard_map");
  s = trace_error([&](const std::vector<Value>& in) {
    return shard_map(identity, mesh, {P("data", None)}, {P("data", "model")}, {.axis_names = {"data"}})(in);
  });
  EXPECT_EQ(std::string(s.message()),
            "shard_map: out_specs argument must refer to an axis marked as manual ('data',), but out_specs[0] "
            "refers to 'model'; check the out_specs values passed to shard_map");
  s = trace_error([&](const std::vector<Value>& in) {
    return shard_map(identity, mesh, {P("data", None)}, {P("data", None)}, {.axis_names = {"data", "rows"}})(in);
  });
  EXPECT_EQ(std::string(s.message()),
            "shard_map: axis_names ('data', 'rows') must be a subset of the mesh's axis names ('data', 'model'), "
            "but 'rows' is not one");
  s = trace_error([&](const std::vector<Value>& in) {
    return shard_map([](const std::vector<Value>& b) { return std::vector<Value>{psum(b[0], "model")}; }, mesh,
                     {P("data", None)}, {P("data", None)}, {.axis_names = {"data"}})(in);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()),
            "psum(f32[4,8], 'model'): unbound axis name: model (the shard_map body is manual over ('data',) only, "
            "its axis_names; 'model' is automatic there)");
  s = trace_error([&](const std::vector<Value>& in) {
    return shard_map(
        [](const std::vector<Value>& b) {
          return std::vector<Value>{b[0] + convert(axis_index(AxisNames{"data", "model"}), DType::kF32)};
        },
        mesh, {P("data", None)}, {P("data", None)}, {.axis_names = {"data"}})(in);
  });
  EXPECT_THAT(std::string(s.message()), HasSubstr("axis_index(('data', 'model')): unbound axis name: model"));
  // All axes named: the full manual shard_map, as an empty axis_names.
  s = trace_error([&](const std::vector<Value>& in) {
    return shard_map([](const std::vector<Value>& b) { return std::vector<Value>{psum(b[0], "model")}; }, mesh,
                     {P("data", "model")}, {P("data", None)}, {.axis_names = {"model", "data"}})(in);
  });
  EXPECT_TRUE(s.ok()) << s;
}

TEST_F(ShardMapTest, OutputNotReplicatedWhereTheOutSpecSaysIsAnError) {
  ASSERT_NE(client_, nullptr);
  auto body = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0}; };
  // x is split over 'data', so each device's block differs along it; P() claims replication.
  ShardMapped f = shard_map(body, mesh42(), {P("data", None)}, {P()});
  absl::Status s = trace_error([f](const std::vector<Value>& in) { return f(in); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output 0 f32[4,8] may differ along mesh axis 'data'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("argument 0 is split over it by its in_spec P('data', None)"));
  // Through axis_index, and through ppermute of a replicated value.
  ShardMapped g = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] + broadcast_to(convert(axis_index("model"), DType::kF32), {16, 8})};
      },
      mesh42(), {P()}, {P()});
  s = trace_error([g](const std::vector<Value>& in) { return g(in); });
  EXPECT_THAT(std::string(s.message()), HasSubstr("mesh axis 'model' (it depends on axis_index over 'model'"));
  ShardMapped h = shard_map(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{ppermute(in[0], "data", {{0, 1}})};
      },
      mesh42(), {P()}, {P()});
  s = trace_error([h](const std::vector<Value>& in) { return h(in); });
  EXPECT_THAT(std::string(s.message()), HasSubstr("ppermute over 'data'"));
  // With the check off the program runs, and the devices' blocks are what they are.
  ShardMapped unchecked = shard_map(body, mesh42(), {P("data", None)}, {P()}, ShardMapOptions{false});
  const HostArray x = HostArray::ones(DType::kF32, {16, 8});
  absl::StatusOr<std::vector<Array>> out = unchecked({put(x, P("data", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->shape(), (Shape{4, 8}));
  EXPECT_EQ(got->element_as_double(0), 2.0);
}

TEST_F(ShardMapTest, ReductionsMakeOutputsReplicated) {
  ASSERT_NE(client_, nullptr);
  for (int which = 0; which < 3; ++which) {
    ShardMapped f = shard_map(
        [which](const std::vector<Value>& in) {
          const Value& x = in[0];
          Value y = which == 0 ? pmean(x, "data") : which == 1 ? pmax(x, {"data", "model"}) : sum(psum(x, "data"), {});
          return std::vector<Value>{y};
        },
        mesh42(), {P("data", None)}, {P()});
    EXPECT_TRUE(trace_error([f](const std::vector<Value>& in) { return f(in); }).ok()) << which;
  }
}

// JAX's check_vma types all_gather's result as varying along its axes (docs/notebooks/
// shard_map.md, the table of collectives: all_gather is Varying -> Varying; psum is
// Varying -> Invariant), so out_specs=P() on it is refused, as JAX refuses it; check_vma=false
// accepts it, and the psum of a gathered value is replicated again.
TEST_F(ShardMapTest, AllGatherResultIsVaryingAsJaxTypesIt) {
  ASSERT_NE(client_, nullptr);
  auto gathered = [](const std::vector<Value>& in) { return std::vector<Value>{all_gather(in[0], "data", 0, true)}; };
  ShardMapped checked = shard_map(gathered, mesh42(), {P("data", None)}, {P()});
  absl::Status s = trace_error([checked](const std::vector<Value>& in) { return checked(in); });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("may differ along mesh axis 'data'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("all_gather over 'data'"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("(psum, pmean, pmax, pmin)"));
  ShardMapped unchecked = shard_map(gathered, mesh42(), {P("data", None)}, {P()}, {.check_vma = false});
  EXPECT_TRUE(trace_error([unchecked](const std::vector<Value>& in) { return unchecked(in); }).ok());
  ShardMapped named = shard_map(gathered, mesh42(), {P("data", None)}, {P("data")});
  EXPECT_TRUE(trace_error([named](const std::vector<Value>& in) { return named(in); }).ok());
  ShardMapped summed = shard_map(
      [](const std::vector<Value>& in) { return std::vector<Value>{psum(all_gather(in[0], "data", 0, true), "data")}; },
      mesh42(), {P("data", None)}, {P()});
  EXPECT_TRUE(trace_error([summed](const std::vector<Value>& in) { return summed(in); }).ok());
}

// all_gather(to='invarying'), JAX's all_gather_invariant (jax/_src/lax/parallel.py: Varying ->
// Invariant, its result's varying axes x's less the gathered ones; its transpose a
// dynamic_slice of the cotangent at axis_index). As tests/shard_map_test.py's
// test_all_gather_invariant_basic (mesh (4,) there, (8) here: the result is typed invariant,
// out_specs=P() takes it, its value is the argument, grad of its sum is laid out as the argument)
// and test_all_gather_invariant_complex (on (4, 2): the gather over 'data' varies along 'model'
// only, the one over 'model' along 'data' only, out_specs leaving the gathered axis out), on the
// Explicit meshes and their Auto twins; values and gradients against the host (the gathered
// value is x, so the gradient of sum(sin(.)) is cos(x)). With check_vma off JAX still binds
// all_gather_invariant_p (parallel.py all_gather_invariant), whose transpose is a dynamic_slice
// of the cotangent at axis_index (no sum: _all_gather_invariant_transpose_rule), and
// _shard_map_transpose (jax/_src/shard_map.py) divides an output's cotangent by the size of the
// mesh axes its out_spec leaves out: the gradient is cos(x) / N, N those axes' size (8 for P()
// on (8) and (4, 2), 4 for P(None, 'model'), 2 for P('data', None)); the plain gather's
// reduce-scatter gave cos(x).
TEST_F(ShardMapTest, AllGatherToInvaryingIsTypedInvariantAsJax) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(23);
  const HostArray x = random_array(DType::kF32, {16, 4}, Domain::kSigned, rng);
  const auto host_cos = [&] {
    std::vector<double> out;
    for (int64_t i = 0; i < x.size(); ++i) out.push_back(std::cos(x.element_as_double(i)));
    return out;
  }();
  struct Case {
    const char* name;
    int mesh;  // index into meshes_ / auto_meshes_
    PartitionSpec in, out;
    AxisNames axes;
    int64_t axis;
    std::vector<std::string> varying;  // the result's, as JAX types it
    double unmentioned;                // the size of the mesh axes `out` leaves out
  };
  const std::vector<Case> cases = {
      {"basic (8)", 0, P("data", None), P(), AxisNames("data"), 0, {}, 8},
      {"tuple (4, 2)", 1, P(Axes{"data", "model"}, None), P(), AxisNames({"data", "model"}), 0, {}, 8},
      {"complex c (4, 2)", 1, P("data", "model"), P(None, "model"), AxisNames("data"), 0, {"model"}, 4},
      {"complex d (4, 2)", 1, P("data", "model"), P("data", None), AxisNames("model"), -1, {"data"}, 2},
  };
  for (const Case& c : cases) {
    for (const Mesh& mesh : {meshes_[c.mesh], auto_meshes_[c.mesh]}) {
      SCOPED_TRACE(absl::StrCat(c.name, " on ", mesh.to_string()));
      std::vector<std::string> varying = {"unset"};
      ShardMapped body = shard_map(
          [&](const std::vector<Value>& in) {
            const Value out = all_gather(in[0], c.axes, c.axis, true, "invarying");
            varying = type_of(out).varying;
            return std::vector<Value>{out};
          },
          mesh, {c.in}, {c.out});
      absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, c.in));
      ASSERT_TRUE(xs.ok()) << xs.status();
      absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) { return body(in); })({*xs});
      ASSERT_TRUE(y.ok()) << y.status();
      EXPECT_EQ(varying, c.varying);
      EXPECT_TRUE((*y)[0].sharding().is_equivalent_to(NamedSharding(mesh, c.out), 2)) << (*y)[0].sharding().to_string();
      absl::StatusOr<HostArray> got = (*y)[0].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(results_match(*got, x, 0));
      TracedFunction loss = [&](const std::vector<Value>& in) { return std::vector<Value>{sum(sin(body(in)[0]), {})}; };
      absl::StatusOr<std::vector<Array>> g = jit(grad(loss, {0}))({*xs});
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ((*g)[0].sharding().spec(), c.in);  // as the argument (JAX: NamedSharding(mesh, P('x')))
      absl::StatusOr<HostArray> dx = (*g)[0].fetch();
      ASSERT_TRUE(dx.ok()) << dx.status();
      for (int64_t i = 0; i < x.size(); ++i) EXPECT_NEAR(dx->element_as_double(i), host_cos[i], 1e-5) << i;

      // check_vma off: the same value, JAX's gradient cos(x) / N.
      ShardMapped untyped = shard_map(
          [&](const std::vector<Value>& in) {
            return std::vector<Value>{all_gather(in[0], c.axes, c.axis, true, "invarying")};
          },
          mesh, {c.in}, {c.out}, {.check_vma = false});
      y = jit([&](const std::vector<Value>& in) { return untyped(in); })({*xs});
      ASSERT_TRUE(y.ok()) << y.status();
      got = (*y)[0].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(results_match(*got, x, 0));
      loss = [&](const std::vector<Value>& in) { return std::vector<Value>{sum(sin(untyped(in)[0]), {})}; };
      g = jit(grad(loss, {0}))({*xs});
      ASSERT_TRUE(g.ok()) << g.status();
      dx = (*g)[0].fetch();
      ASSERT_TRUE(dx.ok()) << dx.status();
      for (int64_t i = 0; i < x.size(); ++i) {
        EXPECT_NEAR(dx->element_as_double(i), host_cos[i] / c.unmentioned, 1e-5) << "check_vma off " << i;
      }
    }
  }

  // Not tiled: the blocks stack along a new dimension (x's (2, 4) blocks, 8 of them, in order);
  // with check_vma off too, its gradient then cos(x) / 8.
  absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(meshes_[0], P("data", None)));
  ASSERT_TRUE(xs.ok()) << xs.status();
  for (const bool check_vma : {true, false}) {
    SCOPED_TRACE(absl::StrCat("stacked, check_vma ", check_vma));
    ShardMapped stacked = shard_map(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{all_gather(in[0], "data", 0, false, "invarying")};
        },
        meshes_[0], {P("data", None)}, {P()}, {.check_vma = check_vma});
    absl::StatusOr<std::vector<Array>> y = jit([&](const std::vector<Value>& in) { return stacked(in); })({*xs});
    ASSERT_TRUE(y.ok()) << y.status();
    absl::StatusOr<HostArray> got = (*y)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->shape(), (Shape{8, 2, 4}));
    for (int64_t i = 0; i < x.size(); ++i) EXPECT_EQ(got->element_as_double(i), x.element_as_double(i)) << i;
    if (check_vma) continue;
    TracedFunction loss = [&](const std::vector<Value>& in) {
      return std::vector<Value>{sum(sin(stacked(in)[0]), {})};
    };
    absl::StatusOr<std::vector<Array>> g = jit(grad(loss, {0}))({*xs});
    ASSERT_TRUE(g.ok()) << g.status();
    absl::StatusOr<HostArray> dx = (*g)[0].fetch();
    ASSERT_TRUE(dx.ok()) << dx.status();
    for (int64_t i = 0; i < x.size(); ++i) EXPECT_NEAR(dx->element_as_double(i), host_cos[i] / 8, 1e-5) << i;
  }

  // The gather over 'data' of a value varying along 'model' too: out_specs=P() is refused
  // naming 'model' (it still varies along it), as JAX's check.
  ShardMapped partial = shard_map(
      [](const std::vector<Value>& in) { return std::vector<Value>{all_gather(in[0], "data", 0, true, "invarying")}; },
      mesh42(), {P("data", "model")}, {P()});
  const absl::Status refused = trace_error(partial, {{DType::kF32, {16, 4}}});
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()), HasSubstr("may differ along mesh axis 'model'"));
}

// JAX's all_gather_invariant first casts x to varying along the axes it does not vary along
// (auto_pcast: pvary), whose check_unreduced_args refuses an x reduced or unreduced over them
// ("pvary cannot accept args which are reduced. Got ... and axes={'data'}"); with check_vma off
// nothing is typed and the gather runs.
TEST_F(ShardMapTest, AllGatherToInvaryingOfAReducedValueIsRefusedAsJax) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(29);
  const Array x = put(random_array(DType::kF32, {4, 4}, Domain::kSigned, rng), P(None, "model"));
  const auto run = [&](bool check_vma) {
    ShardMapped body = shard_map(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{all_gather(pcast(in[0], "data", "reduced"), "data", 0, true, "invarying")};
        },
        mesh42(), {P(None, "model")}, {P(None, "model")}, {.check_vma = check_vma});
    return jit([body](const std::vector<Value>& in) { return body(in); })({x}).status();
  };
  const absl::Status refused = run(true);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("pvary cannot accept args which are reduced. Got f32[4,2]{V:model, R:data} and axes={'data'}"));
  EXPECT_TRUE(run(false).ok());
}

TEST_F(ShardMapTest, BadUseIsAnInvalidArgumentAtTraceTime) {
  ASSERT_NE(client_, nullptr);
  auto error_of = [&](std::function<Value(const Value&)> body, PartitionSpec in = P("data", None),
                      PartitionSpec out = P("data", None), Shape shape = {16, 8}) {
    ShardMapped f = shard_map([body](const std::vector<Value>& v) { return std::vector<Value>{body(v[0])}; }, mesh42(),
                              {in}, {out});
    absl::Status s = trace_error([f](const std::vector<Value>& v) { return f(v); }, shape);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_THAT(error_of([](const Value& x) { return psum(x, "batch"); }),
              HasSubstr("psum(f32[4,8], 'batch'): all_reduce: axis 'batch' is not in the mesh"));
  EXPECT_THAT(error_of([](const Value& x) { return x; }, P("data", None), P("data", None), {6, 8}),
              HasSubstr("argument 0: shard_map: in_spec for f32[6,8]"));
  EXPECT_THAT(error_of([](const Value& x) {
                return ppermute(x, "data", {{0, 1}, {0, 2}});
              }),
              HasSubstr("source 0 appears twice"));
  EXPECT_THAT(error_of([](const Value& x) {
                return ppermute(x, "data", {{0, 1}, {2, 1}});
              }),
              HasSubstr("target 1 appears twice"));
  EXPECT_THAT(error_of([](const Value& x) {
                return ppermute(x, "data", {{0, 4}});
              }),
              HasSubstr("position 4 is outside [0, 4)"));
  EXPECT_THAT(error_of([](const Value& x) { return all_to_all(x, "data", 1, 0, true); }, P("data", None),
                       P("data", None), {16, 6}),
              // The rule is collective_output_shape's (core/collective.h), the one the workers apply.
              HasSubstr("split dimension 1 of size 6 is not divisible by the group size 4 (all_to_all of f32[4,6]"));
  EXPECT_THAT(error_of([](const Value& x) { return all_to_all(x, "data", 1, 0, false); }),
              HasSubstr("split_axis 1 has size 8; not tiled, it must be 4"));
  EXPECT_THAT(error_of([](const Value& x) { return psum_scatter(x, "model", 0, false); }),
              HasSubstr("scatter_dimension 0 has size 4; not tiled, it must be 2"));
  // Outside a shard_map body.
  absl::Status s = trace_error([](const std::vector<Value>& in) { return std::vector<Value>{psum(in[0], "data")}; });
  EXPECT_THAT(std::string(s.message()), HasSubstr("only inside a shard_map body"));
}

// A value of the enclosing function that the body reads (closes over) enters the body whole on
// every device, as JAX's shard_map passes a body's closed-over values (jax/_src/shard_map.py:
// the consts go in with in_names {}, i.e. P()); as the shard_map notebook's
// `shard_map(lambda: x, in_specs=(), out_specs=P('i', 'j'))()` prints jnp.tile(x, (4, 2)).
// Worked by hand: x[i, j] = 8i + j (16, 8) under P('data', None) on (4, 2); w = 2 * arange(8)
// closed over; out[i, j] = x[i, j] + w[j]; the closed-over value returned as it is under
// P('data') (each of the 4 devices along 'data' returns the whole (8,): tiled to (32,)).
TEST_F(ShardMapTest, AValueTheBodyClosesOverEntersItWholeOnEveryDevice) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = HostArray::arange(DType::kF32, {16, 8});
  const HostArray w = HostArray::arange(DType::kF32, {8});
  Jitted f = jit([&](const std::vector<Value>& in) {
    const Value outer = in[1] * 2.0;
    ShardMapped body = shard_map(
        [outer](const std::vector<Value>& v) {
          return std::vector<Value>{v[0] + broadcast_to(outer, {4, 8}), outer};
        },
        mesh42(), {P("data", None)}, {P("data", None), P("data")});
    return body({in[0]});
  });
  absl::StatusOr<std::vector<Array>> out = f({put(x, P("data", None)), put(w, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> sum = (*out)[0].fetch();
  absl::StatusOr<HostArray> tiled = (*out)[1].fetch();
  ASSERT_TRUE(sum.ok() && tiled.ok());
  ASSERT_EQ(sum->shape(), (Shape{16, 8}));
  for (int64_t e = 0; e < 16 * 8; ++e) EXPECT_EQ(sum->element_as_double(e), e + 2 * (e % 8)) << e;
  ASSERT_EQ(tiled->shape(), (Shape{32}));
  for (int64_t e = 0; e < 32; ++e) EXPECT_EQ(tiled->element_as_double(e), 2 * (e % 8)) << e;
  // Read twice, it enters once; the trace shows one shard_map_in per argument and capture.
  absl::StatusOr<Graph> g = trace(
      [&](const std::vector<Value>& in) {
        ShardMapped body =
            shard_map([&in](const std::vector<Value>& v) { return std::vector<Value>{v[0] * in[1] + in[1]}; }, mesh42(),
                      {P("data", None)}, {P("data", None)});
        return body({in[0]});
      },
      {{DType::kF32, {16, 8}}, {DType::kF32, {4, 8}}});
  ASSERT_TRUE(g.ok()) << g.status();
  int ins = 0;
  for (const Node& n : g->nodes()) ins += n.op == Op::kShardMapIn ? 1 : 0;
  EXPECT_EQ(ins, 2) << g->to_text();
}

// On Explicit axes a closed-over value whose type is split would not be whole on each device:
// an error naming it and the two ways out.
TEST_F(ShardMapTest, OnExplicitAxesAClosedOverSplitValueIsAnErrorNamingIt) {
  ASSERT_NE(client_, nullptr);
  ASSERT_EQ(mesh42().axis_types()[0], AxisType::kExplicit);
  const HostArray x = HostArray::arange(DType::kF32, {16, 8});
  Jitted f = jit([&](const std::vector<Value>& in) {
    ShardMapped body = shard_map(
        [&in](const std::vector<Value>& v) {
          return std::vector<Value>{v[0] + slice(in[0], {0, 0}, {4, 8})};
        },
        mesh42(), {P("data", None)}, {P("data", None)});
    return body({in[0]});
  });
  absl::StatusOr<std::vector<Array>> out = f({put(x, P("data", None))});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out.status().message()),
              HasSubstr("the body closes over %0 f32[16@data,8], which enters it whole on every device (P()), but its "
                        "type is split; reshard it to P() first, or pass it in as an argument with its in_spec"));
}

TEST_F(ShardMapTest, AMeshOtherThanTheArgumentsIsAnError) {
  ASSERT_NE(client_, nullptr);
  // Same devices, other shape: the arguments are on (4, 2), the shard_map on (2, 4).
  // The argument is laid out as the in_spec says (on Explicit axes JAX >= 0.9 refuses any other).
  ShardMapped f = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{psum(in[0], "data")}; },
                            meshes_[2], {P("data", None)}, {P()});
  absl::StatusOr<std::vector<Array>> out = f({put(HostArray::ones(DType::kF32, {16, 8}), P("data", None))});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  // Refused at the call, naming both meshes (never at the coordinator, with its address).
  EXPECT_EQ(std::string(out.status().message()),
            absl::StrCat("jit: a shard_map onto ", meshes_[2].to_string(), " in a function whose arguments are on ",
                         meshes_[1].to_string(),
                         "; Tessera moves values within one mesh: put the arguments on that mesh, or name theirs"));
}

// Arguments made without a sharding (Client::array, as jnp.array: uncommitted, on the default
// device) of a jit whose function has code before and after a shard_map: JAX runs the call on
// the shard_map's devices and moves the arguments there (jax/_src/interpreters/pxla.py,
// _get_and_check_device_assignment, takes the devices from the function's shardings;
// jax/_src/dispatch.py's get_intermediate_shardings lists a shard_map's mesh). The values are
// a host computation's, on Explicit and on Auto axes; the outputs are committed to that mesh,
// the arguments themselves stay where they were, and a second call compiles nothing.
TEST_F(ShardMapTest, UncommittedArgumentsMoveToTheMeshOfAShardMapInsideALargerFunction) {
  ASSERT_NE(client_, nullptr);
  for (const Mesh& mesh : {mesh42(), auto_meshes_[1]}) {
    SCOPED_TRACE(mesh.to_string());
    ShardMapped mm = shard_map(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{psum_scatter(matmul(in[0], in[1]), "model", 1, true)};
        },
        mesh, {P("data", "model"), P("model", None)}, {P("data", "model")});
    TracedFunction f = [mm](const std::vector<Value>& in) {
      Value h = tanh(in[0]) * 2.0;  // before
      Value y = mm({h, in[1]})[0];
      return std::vector<Value>{exp(y * 0.1) + 1.0, sum(y, {0})};  // after
    };
    std::mt19937 rng(5);
    const HostArray x = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
    const HostArray w = random_array(DType::kF32, {8, 4}, Domain::kSigned, rng);
    absl::StatusOr<Array> xs = client_->array(x);
    absl::StatusOr<Array> ws = client_->array(w);
    ASSERT_TRUE(xs.ok() && ws.ok());
    EXPECT_FALSE(xs->committed());
    EXPECT_EQ(xs->sharding().mesh().size(), 1);
    Jitted jf = jit(f);
    absl::StatusOr<std::vector<Array>> out = jf({*xs, *ws});
    ASSERT_TRUE(out.ok()) << out.status();
    absl::StatusOr<Graph> graph = trace(f, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}});
    ASSERT_TRUE(graph.ok()) << graph.status();
    absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*graph, {&x, &w});
    ASSERT_TRUE(want.ok()) << want.status();
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<HostArray> got = (*out)[i].fetch();
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(results_match(*got, (*want)[i], kF32Tolerance)) << jf.as_text();
      EXPECT_EQ((*out)[i].sharding().mesh(), mesh);
      EXPECT_TRUE((*out)[i].committed());
    }
    EXPECT_EQ((*out)[0].sharding().spec(), P("data", "model"));
    EXPECT_FALSE(xs->committed());
    EXPECT_EQ(xs->sharding().mesh().size(), 1);
    const int64_t compiled = jf.compilations();
    ASSERT_TRUE(jf({*xs, *ws}).ok());
    EXPECT_EQ(jf.compilations(), compiled);
  }
}

// JAX's rule for the other cases (pxla.py): with a committed argument the uncommitted ones go
// to its mesh, replicated (or as in_shardings says); with none and no mesh named, the call runs
// on the default device and its outputs stay uncommitted; a sharding asked for commits them.
TEST_F(ShardMapTest, UncommittedArgumentsGoWhereTheCommittedOnesAre) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = HostArray::arange(DType::kF32, {16, 8});
  absl::StatusOr<Array> u = client_->array(x);
  ASSERT_TRUE(u.ok()) << u.status();
  Jitted add = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1] * 2.0}; });
  absl::StatusOr<std::vector<Array>> mixed = add({put(x, P("data", None)), *u});
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_EQ((*mixed)[0].sharding().mesh(), mesh42());
  EXPECT_TRUE((*mixed)[0].committed());
  absl::StatusOr<std::vector<Array>> alone = add({*u, *u});
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_EQ((*alone)[0].sharding().mesh(), u->sharding().mesh());
  EXPECT_FALSE((*alone)[0].committed());
  for (const absl::StatusOr<std::vector<Array>>* r : {&mixed, &alone}) {
    absl::StatusOr<HostArray> got = (**r)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t i = 0; i < 16 * 8; ++i) EXPECT_EQ(got->element_as_double(i), 3.0 * i) << i;
  }
  // in_shardings places an uncommitted argument (a committed one would be an error).
  JitOptions options;
  options.in_shardings = {P("data", None), P(None, "model")};
  Jitted placed = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; }, options);
  absl::StatusOr<std::vector<Array>> both = placed({put(x, P("data", None)), *u});
  ASSERT_TRUE(both.ok()) << both.status();
  absl::StatusOr<HostArray> got = (*both)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  for (int64_t i = 0; i < 16 * 8; ++i) EXPECT_EQ(got->element_as_double(i), 2.0 * i) << i;
  // device_put with a sharding commits, even onto the sharding the array already has.
  absl::StatusOr<Array> same = client_->device_put(*u, u->sharding());
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->committed());
}

// JAX's rule when nothing names a mesh (jax/_src/interpreters/pxla.py,
// _get_and_check_device_assignment: "if first_sharding_info is None and not ctx_mesh.empty ...
// device_assignment = ctx_mesh._flat_devices_tuple"; lower_sharding_computation commits the
// outputs when the context mesh is set): under set_mesh, a jit's uncommitted arguments go to
// the ambient mesh, replicated or as in_shardings says, and its outputs are committed there;
// the arguments themselves stay where they were, and without the scope the call stays on the
// default device, uncommitted.
TEST_F(ShardMapTest, UncommittedArgumentsGoToTheAmbientMesh) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = HostArray::arange(DType::kF32, {16, 8});
  absl::StatusOr<Array> u = client_->array(x);
  ASSERT_TRUE(u.ok()) << u.status();
  const TracedFunction affine = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] * 2.0 + 1.0}; };
  Jitted f = jit(affine);
  JitOptions split;
  split.in_shardings = {P("data", None)};
  Jitted g = jit(affine, split);
  const auto check = [&](const absl::StatusOr<std::vector<Array>>& out, bool on_mesh) {
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ((*out)[0].committed(), on_mesh);
    EXPECT_EQ((*out)[0].sharding().mesh() == mesh42(), on_mesh) << (*out)[0].sharding().to_string();
    absl::StatusOr<HostArray> got = (*out)[0].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    for (int64_t i = 0; i < 16 * 8; ++i) EXPECT_EQ(got->element_as_double(i), 2.0 * i + 1) << i;
  };
  {
    MeshScope scope = set_mesh(mesh42());
    check(f({*u}), true);
    absl::StatusOr<std::vector<Array>> placed = g({*u});
    check(placed, true);
    ASSERT_TRUE(placed.ok());
    EXPECT_EQ((*placed)[0].sharding().spec(), P("data", None));
  }
  EXPECT_FALSE(u->committed());
  EXPECT_EQ(u->sharding().mesh().size(), 1);
  check(f({*u}), false);
  EXPECT_EQ((*f({*u}))[0].sharding().mesh().size(), 1);
}

// The shard_map notebook's cell 22 (docs/notebooks/shard_map.md: "JAX implicitly inserts
// jax.lax.pcast(..., to='varying') calls in many cases, especially for binary operations", and
// its jaxpr of x * y shows the pvary): in a body x * y with x split over the axis and y not,
// y is pvary'd along it first, so the program has one pvary, read by the multiplication; the
// values are x's blocks times y, worked out here.
TEST_F(ShardMapTest, BinaryOpsMakeTheirOperandsVaryAlikeAsJaxDoes) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[0];  // (8) 'data'
  std::vector<std::string> seen;
  ShardMapped f = shard_map(
      [&seen](const std::vector<Value>& in) {
        Value z = in[0] * in[1];
        seen.push_back(type_of(z).to_string());
        return std::vector<Value>{z};
      },
      mesh, {P("data"), P()}, {P("data")});
  const TracedFunction traced = [f](const std::vector<Value>& in) { return f(in); };
  absl::StatusOr<Graph> g = trace(traced, {{DType::kF32, {16}}, {DType::kF32, {2}}});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(seen, std::vector<std::string>{"f32[2]{V:data}"});
  int pvaries = 0;
  for (int id = 0; id < g->size(); ++id) {
    const Node& n = g->node(id);
    if (n.op == Op::kPvary) {
      ++pvaries;
      EXPECT_EQ(g->node(n.operands[0]).op, Op::kShardMapIn);  // y's block
      EXPECT_EQ(g->node(n.operands[0]).attrs<ShardingAttrs>().sharding.spec(), P()) << g->to_text();
    }
    if (n.op == Op::kMul) {
      EXPECT_EQ(g->node(n.operands[1]).op, Op::kPvary) << g->to_text();
    }
  }
  EXPECT_EQ(pvaries, 1) << g->to_text();
  // Outside check_vma nothing is typed, and nothing is inserted (JAX's pvary is then a no-op).
  ShardMapOptions unchecked;
  unchecked.check_vma = false;
  ShardMapped plain = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{in[0] * in[1]}; }, mesh,
                                {P("data"), P()}, {P("data")}, unchecked);
  absl::StatusOr<Graph> h =
      trace([plain](const std::vector<Value>& in) { return plain(in); }, {{DType::kF32, {16}}, {DType::kF32, {2}}});
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_THAT(h->to_text(), Not(HasSubstr("pvary")));
  const HostArray x = HostArray::arange(DType::kF32, {16});
  const HostArray y = HostArray::from_vector<float>({2}, {3.0f, -1.0f});
  absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data")));
  absl::StatusOr<Array> ys = client_->device_put(y, NamedSharding(mesh, P()));
  ASSERT_TRUE(xs.ok() && ys.ok());
  absl::StatusOr<std::vector<Array>> out = jit(traced)({*xs, *ys});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  for (int i = 0; i < 16; ++i) EXPECT_EQ(got->element_as_double(i), i * (i % 2 == 0 ? 3.0 : -1.0)) << i;
}

// dot_general and concatenate make their operands vary alike too: jax/_src/lax/lax.py calls
// core.auto_insert_reshard(lhs, rhs) in dot_general and core.auto_insert_reshard(*operands) in
// concatenate before binding (core.py: an operand missing an axis another varies along is
// pvary'd along it). In a body with x split over 'data' and w, c not, w's and c's blocks are
// pvary'd, each read by its op, and both results vary along 'data'. The values are worked
// out here: each device's block of x times w, and its block over c.
TEST_F(ShardMapTest, DotGeneralAndConcatenateMakeTheirOperandsVaryAlikeAsJaxDoes) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[0];  // (8) 'data'
  std::vector<std::string> seen;
  ShardMapped f = shard_map(
      [&seen](const std::vector<Value>& in) {
        Value d = matmul(in[0], in[1]);
        Value c = concatenate({in[0], in[2]}, 0);
        seen = {type_of(d).to_string(), type_of(c).to_string()};
        return std::vector<Value>{d, c};
      },
      mesh, {P("data", None), P(), P()}, {P("data", None), P("data", None)});
  const TracedFunction traced = [f](const std::vector<Value>& in) { return f(in); };
  const std::vector<ArrayType> types = {{DType::kF32, {16, 3}}, {DType::kF32, {3, 2}}, {DType::kF32, {1, 3}}};
  absl::StatusOr<Graph> g = trace(traced, types);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(seen, (std::vector<std::string>{"f32[2,2]{V:data}", "f32[3,3]{V:data}"}));
  int pvaries = 0, dots = 0, concats = 0;
  for (int id = 0; id < g->size(); ++id) {
    const Node& n = g->node(id);
    if (n.op == Op::kPvary) {
      ++pvaries;
      EXPECT_EQ(n.attrs<CollectiveAttrs>().axes, std::vector<std::string>{"data"});
      EXPECT_EQ(g->node(n.operands[0]).op, Op::kShardMapIn) << g->to_text();
    }
    if (n.op == Op::kDotGeneral) {
      ++dots;
      EXPECT_EQ(g->node(n.operands[0]).op, Op::kShardMapIn) << g->to_text();  // x's block, varying already
      EXPECT_EQ(g->node(n.operands[1]).op, Op::kPvary) << g->to_text();
    }
    if (n.op == Op::kConcatenate) {
      ++concats;
      EXPECT_EQ(g->node(n.operands[0]).op, Op::kShardMapIn) << g->to_text();
      EXPECT_EQ(g->node(n.operands[1]).op, Op::kPvary) << g->to_text();
    }
  }
  EXPECT_EQ(pvaries, 2) << g->to_text();
  EXPECT_EQ(dots, 1) << g->to_text();
  EXPECT_EQ(concats, 1) << g->to_text();
  const HostArray x = HostArray::arange(DType::kF32, {16, 3});
  const HostArray w = HostArray::from_vector<float>({3, 2}, {1, -1, 2, 0, 0.5f, 3});
  const HostArray c = HostArray::from_vector<float>({1, 3}, {-7, 8, 9});
  absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", None)));
  absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P()));
  absl::StatusOr<Array> cs = client_->device_put(c, NamedSharding(mesh, P()));
  ASSERT_TRUE(xs.ok() && ws.ok() && cs.ok());
  absl::StatusOr<std::vector<Array>> out = jit(traced)({*xs, *ws, *cs});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> d = (*out)[0].fetch();
  absl::StatusOr<HostArray> joined = (*out)[1].fetch();
  ASSERT_TRUE(d.ok() && joined.ok());
  ASSERT_EQ(d->shape(), (Shape{16, 2}));
  ASSERT_EQ(joined->shape(), (Shape{24, 3}));  // 8 blocks of 3 rows: x's 2, then c
  const float wv[3][2] = {{1, -1}, {2, 0}, {0.5f, 3}};
  for (int r = 0; r < 16; ++r) {
    for (int j = 0; j < 2; ++j) {
      double want = 0;
      for (int k = 0; k < 3; ++k) want += (r * 3 + k) * wv[k][j];
      EXPECT_EQ(d->element_as_double(r * 2 + j), want) << r << "," << j;
    }
  }
  const double cv[3] = {-7, 8, 9};
  for (int r = 0; r < 24; ++r) {
    const int block = r / 3, row = r % 3;
    for (int j = 0; j < 3; ++j) {
      const double want = row < 2 ? (block * 2 + row) * 3 + j : cv[j];
      EXPECT_EQ(joined->element_as_double(r * 3 + j), want) << r << "," << j;
    }
  }
}

// The notebook's cell 23 (docs/notebooks/shard_map.md, "scan-vma"): a scan inside a shard_map
// body whose carry swaps a varying and an invariant value raises, with the message of
// jax/_src/lax/control_flow/loops.py's _check_carry_type (the carries named by their path, as
// JAX names them when it cannot read the body's parameter names); cell 24: with the invariant
// one pcast to varying first, it runs, and two swaps give the values back.
TEST_F(ShardMapTest, AScanCarryThatBecomesVaryingIsJaxsError) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[0];  // (8) 'data'
  const auto swapping = [&mesh](bool pcast_first) {
    return shard_map(
        [pcast_first](const std::vector<Value>& in) {
          const Value y = pcast_first ? pcast(in[1], "data", "varying") : in[1];
          ScanResult r = scan(
              [](const std::vector<Value>& c, const std::vector<Value>&) {
                return ScanStep{{c[1], c[0]}, {}};  // swap the carry
              },
              {in[0], y}, {}, 2);
          return r.carry;
        },
        mesh, {P("data"), P()}, {P("data"), P("data")});
  };
  const ShardMapped bad = swapping(false);
  absl::Status s =
      trace([bad](const std::vector<Value>& in) { return bad(in); }, {{DType::kF32, {16}}, {DType::kF32, {2}}})
          .status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("scan body function carry input and carry output must have equal types, but they differ:\n\n"
                        "  * the input carry at path [0] has type f32[2]{V:data} but the corresponding output carry "
                        "component has type f32[2], so the manual axis types do not match;\n\n"
                        "  * the input carry at path [1] has type f32[2] but the corresponding output carry component "
                        "has type f32[2]{V:data}, so the manual axis types do not match.\n\n"
                        "This might be fixed by applying `jax.lax.pcast(..., ('data',), to='varying')`, to the "
                        "initial carry value corresponding to the input carry at path [1].\n"
                        "See https://docs.jax.dev/en/latest/notebooks/shard_map.html#scan-vma for more "
                        "information.\n\n"
                        "Revise the function so that all output types match the corresponding input types."));
  const ShardMapped good = swapping(true);
  const HostArray x = HostArray::arange(DType::kF32, {16});
  const HostArray y = HostArray::from_vector<float>({2}, {3.0f, -1.0f});
  absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data")));
  absl::StatusOr<Array> ys = client_->device_put(y, NamedSharding(mesh, P()));
  ASSERT_TRUE(xs.ok() && ys.ok());
  absl::StatusOr<std::vector<Array>> out = good({*xs, *ys});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> x_ = (*out)[0].fetch();
  absl::StatusOr<HostArray> y_ = (*out)[1].fetch();
  ASSERT_TRUE(x_.ok() && y_.ok());
  ASSERT_EQ(y_->shape(), (Shape{16}));  // y's block on each of the 8 devices, stacked by P('data')
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(x_->element_as_double(i), i) << i;
    EXPECT_EQ(y_->element_as_double(i), i % 2 == 0 ? 3.0 : -1.0) << i;
  }
}

// A scan body inside a shard_map body is typed as JAX types it (jax/_src/lax/control_flow/
// loops.py traces the body with the carries' and rows' avals, vma included): a row of a split
// xs varies along 'data', the carry starts invariant, a closed-over invariant w is pvary'd
// where it meets the row (core.auto_insert_reshard), a psum inside gives an invariant value.
// The carry stays invariant, so out_specs=P() on it is accepted, while the stacked ys vary and
// out_specs=P() on them is refused. The values are worked out here.
TEST_F(ShardMapTest, AScanBodyInsideAShardMapBodyIsTypedByItsVaryingAxes) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[0];  // (8) 'data'
  std::vector<std::string> seen;
  const auto body = [&seen](const std::vector<Value>& in) {
    ScanResult r = scan(
        [&](const std::vector<Value>& c, const std::vector<Value>& rows) {
          const Value y = rows[0] * in[1];
          const Value total = psum(sum(y), "data");
          seen = {type_of(rows[0]).to_string(), type_of(y).to_string(), type_of(total).to_string(),
                  type_of(c[0]).to_string()};
          return ScanStep{{c[0] + total}, {y}};
        },
        {full({}, 0.0, DType::kF32)}, {in[0]});
    return std::vector<Value>{r.carry[0], r.ys[0]};
  };
  const std::vector<ArrayType> types = {{DType::kF32, {16, 4}}, {DType::kF32, {4}}};
  absl::Status s = trace_error(shard_map(body, mesh, {P("data", None), P()}, {P(), P()}), types);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output 1 f32[2,4] may differ along mesh axis 'data'"));
  ShardMapped f = shard_map(body, mesh, {P("data", None), P()}, {P(), P("data", None)});
  const TracedFunction traced = [f](const std::vector<Value>& in) { return f(in); };
  absl::StatusOr<Graph> g = trace(traced, types);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(seen, (std::vector<std::string>{"f32[4]{V:data}", "f32[4]{V:data}", "f32[]", "f32[]"}));
  int scans = 0;
  for (int id = 0; id < g->size(); ++id) {
    const auto* a = std::get_if<ScanAttrs>(&g->node(id).attributes);
    if (a == nullptr || a->output != 0) continue;
    ++scans;
    int pvaries = 0;
    for (int k = 0; k < a->body->size(); ++k) pvaries += a->body->node(k).op == Op::kPvary ? 1 : 0;
    EXPECT_EQ(pvaries, 1) << a->body->to_text();
  }
  EXPECT_EQ(scans, 1) << g->to_text();
  const HostArray x = HostArray::arange(DType::kF32, {16, 4});
  const HostArray w = HostArray::from_vector<float>({4}, {1, -2, 0.5f, 3});
  absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", None)));
  absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P()));
  ASSERT_TRUE(xs.ok() && ws.ok());
  absl::StatusOr<std::vector<Array>> out = jit(traced)({*xs, *ws});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> total = (*out)[0].fetch();
  absl::StatusOr<HostArray> ys = (*out)[1].fetch();
  ASSERT_TRUE(total.ok() && ys.ok());
  const float wv[4] = {1, -2, 0.5f, 3};
  double want = 0;
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 4; ++j) {
      want += (i * 4 + j) * wv[j];
      EXPECT_EQ(ys->element_as_double(i * 4 + j), (i * 4 + j) * wv[j]) << i << "," << j;
    }
  }
  EXPECT_EQ(total->element_as_double(0), want);
}

// cond in a shard_map body (jax/_src/lax/control_flow/conditionals.py). Its branches must agree
// on their outputs' varying axes: tests/shard_map_test.py's test_cond_pvary_errors, with JAX's
// _check_branch_outputs message and pcast advice (JAX raises TypeError). The cases of its
// test_cond_rep_rule: x and x + 1 vary along 'data' only, whatever the other operand does;
// branches pcast to ('data', 'model') need that out_spec. A predicate that differs between
// devices runs each device's own branch (values worked out here); Tessera then types the
// result as varying along the predicate's axes too, so out_specs=P() is refused where JAX,
// which types a cond by its branches only (_cond_abstract_eval), accepts it.
TEST_F(ShardMapTest, CondInsideAShardMapBodyIsTypedAsJaxTypesIt) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = mesh42();  // (4, 2) 'data', 'model'
  const std::vector<ArrayType> types = {{DType::kF32, {8}}, {DType::kF32, {4}}};
  const auto with = [&](Branch on_true, Branch on_false, PartitionSpec out) {
    ShardMapped f = shard_map(
        [on_true, on_false](const std::vector<Value>& in) {
          return cond(full({}, 1.0, DType::kBool), on_true, on_false, {in[0], in[1]});
        },
        mesh, {P("data"), P("model")}, {out});
    return trace_error(f, types);
  };
  const Branch first = [](const std::vector<Value>& in) { return std::vector<Value>{in[0]}; };
  const Branch second = [](const std::vector<Value>& in) { return std::vector<Value>{in[1]}; };
  const Branch plus_one = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; };
  absl::Status s = with(first, second, P(Axes{"data", "model"}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()),
            "cond branches must have equal output types but they differ.\n\n"
            "The output of true_fun at path [0] has type f32[2]{V:data} but the corresponding output of false_fun has "
            "type f32[2]{V:model}, so the manual axis types do not match.\n\n"
            "This might be fixed by:\n"
            "  * applying `jax.lax.pcast(..., ('model',), to='varying')` to the output of true_fun at path [0];\n"
            "  * applying `jax.lax.pcast(..., ('data',), to='varying')` to the output of false_fun at path [0].\n"
            "See https://docs.jax.dev/en/latest/notebooks/shard_map.html#scan-vma for more information.\n\n"
            "Revise true_fun and/or false_fun so that all output types match.");
  EXPECT_TRUE(with(first, plus_one, P("data")).ok());
  s = with(first, plus_one, P());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output 0 f32[2] may differ along mesh axis 'data'"));
  const Branch x_both = [](const std::vector<Value>& in) {
    return std::vector<Value>{pcast(in[0], "model", "varying")};
  };
  const Branch y_both = [](const std::vector<Value>& in) {
    return std::vector<Value>{pcast(in[1], "data", "varying")};
  };
  EXPECT_TRUE(with(x_both, y_both, P(Axes{"data", "model"})).ok());
  s = with(x_both, y_both, P("data"));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("may differ along mesh axis 'model'"));
  // Each device's own predicate: its block of x sums to more than 20 or not.
  const auto per_device = [&](PartitionSpec out) {
    return shard_map(
        [](const std::vector<Value>& in) {
          return cond(
              sum(in[0]) > 20.0, [](const std::vector<Value>& y) { return std::vector<Value>{y[0] * 2.0}; },
              [](const std::vector<Value>& y) { return std::vector<Value>{y[0] - 1.0}; }, {in[1]});
        },
        mesh, {P("data"), P()}, {std::move(out)});
  };
  s = trace_error(per_device(P()), {{DType::kF32, {8}}, {DType::kF32, {2}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output 0 f32[2] may differ along mesh axis 'data'"));
  const HostArray x3 = HostArray::from_vector<float>({8}, {0, 1, 10, 11, 2, 3, 20, 30});  // sums 1, 21, 5, 50
  const HostArray y = HostArray::from_vector<float>({2}, {3, -4});
  absl::StatusOr<Array> xs = client_->device_put(x3, NamedSharding(mesh, P("data")));
  absl::StatusOr<Array> ys = client_->device_put(y, NamedSharding(mesh, P()));
  ASSERT_TRUE(xs.ok() && ys.ok());
  absl::StatusOr<std::vector<Array>> out = per_device(P("data"))({*xs, *ys});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<double> want = {2, -5, 6, -8, 2, -5, 6, -8};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got->element_as_double(i), want[i]) << i;
}

// while_loop in a shard_map body: tests/shard_map_test.py's test_while_rep_rule ('x', 'y' as
// 'data', 'model'): three carries made to vary along both axes are rotated five times; the
// results need out_specs P(('data', 'model')), and each of P('data'), P('model'), P(None) is
// refused. A body that makes a carry varying is loops.py's _check_carry_type error for
// 'while_loop body'. A predicate of each device's own runs each device's own trip count.
// The values are worked out here.
TEST_F(ShardMapTest, WhileLoopInsideAShardMapBodyIsTypedAsJaxTypesIt) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = mesh42();  // (4, 2) 'data', 'model'
  const PartitionSpec both = P(Axes{"data", "model"});
  const auto rotating = [&](PartitionSpec out) {
    ShardMapOptions options;
    options.out_specs_for_all = true;
    return shard_map(
        [](const std::vector<Value>& in) {
          const Value x = pcast(sum(in[0]), AxisNames({"data", "model"}), "varying");
          const Value y = pcast(sum(in[1]), "model", "varying");
          const Value z = sum(in[2]);
          std::vector<Value> out = while_loop([](const std::vector<Value>& c) { return c[0] < 5; },
                                              [](const std::vector<Value>& c) {
                                                return std::vector<Value>{c[0] + 1, c[2], c[3], c[1]};
                                              },
                                              {full({}, 0.0, DType::kI32), x, y, z});
          return std::vector<Value>{expand_dims(out[1], 0), expand_dims(out[2], 0), expand_dims(out[3], 0)};
        },
        mesh, {P(None), P("data"), both}, {std::move(out)}, options);
  };
  const std::vector<ArrayType> types(3, ArrayType{DType::kF32, {8}});
  for (const PartitionSpec& out : {P("data"), P("model"), P(None)}) {
    absl::Status s = trace_error(rotating(out), types);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << out.to_string();
    EXPECT_THAT(std::string(s.message()), HasSubstr("may differ along mesh axis")) << out.to_string();
  }
  const HostArray a = HostArray::arange(DType::kF32, {8});
  absl::StatusOr<Array> whole = client_->device_put(a, NamedSharding(mesh, P(None)));
  absl::StatusOr<Array> by_data = client_->device_put(a, NamedSharding(mesh, P("data")));
  absl::StatusOr<Array> by_both = client_->device_put(a, NamedSharding(mesh, both));
  ASSERT_TRUE(whole.ok() && by_data.ok() && by_both.ok());
  absl::StatusOr<std::vector<Array>> out = rotating(both)({*whole, *by_data, *by_both});
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 3u);
  // Five rotations of (x, y, z) give (z, x, y): device (d, m), at position 2d + m, holds its
  // element of z, the sum of all of x (28), and its block of y's sum (4d + 1).
  std::vector<HostArray> got;
  for (const Array& r : *out) {
    absl::StatusOr<HostArray> h = r.fetch();
    ASSERT_TRUE(h.ok()) << h.status();
    got.push_back(*std::move(h));
  }
  for (int p = 0; p < 8; ++p) {
    EXPECT_EQ(got[0].element_as_double(p), p) << p;
    EXPECT_EQ(got[1].element_as_double(p), 28) << p;
    EXPECT_EQ(got[2].element_as_double(p), 4 * (p / 2) + 1) << p;
  }
  // A carry the body makes varying.
  ShardMapped growing = shard_map(
      [](const std::vector<Value>& in) {
        return while_loop([](const std::vector<Value>& c) { return sum(c[0]) < 100.0; },
                          [in](const std::vector<Value>& c) { return std::vector<Value>{c[0] + in[0]}; }, {in[1]});
      },
      mesh, {P("data"), P()}, {P("data")});
  absl::Status s = trace_error(growing, {{DType::kF32, {8}}, {DType::kF32, {2}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("while_loop body function carry input and carry output must have equal types, but they "
                        "differ:\n\nThe input carry at path [0] has type f32[2] but the corresponding output carry "
                        "component has type f32[2]{V:data}, so the manual axis types do not match.\n\n"
                        "This might be fixed by applying `jax.lax.pcast(..., ('data',), to='varying')`, to the "
                        "initial carry value corresponding to the input carry at path [0]."));
  // Each device doubles its block until it sums to 50 or more: blocks (0, 1), (2, 3), (4, 5),
  // (6, 7) take 6, 4, 3 and 2 doublings.
  ShardMapped doubling = shard_map(
      [](const std::vector<Value>& in) {
        return while_loop([](const std::vector<Value>& c) { return sum(c[0]) < 50.0; },
                          [](const std::vector<Value>& c) { return std::vector<Value>{c[0] * 2.0}; }, {in[0]});
      },
      mesh, {P("data")}, {P("data")});
  absl::StatusOr<std::vector<Array>> doubled = doubling({*by_data});
  ASSERT_TRUE(doubled.ok()) << doubled.status();
  absl::StatusOr<HostArray> d = (*doubled)[0].fetch();
  ASSERT_TRUE(d.ok()) << d.status();
  for (int p = 0; p < 8; ++p) {
    double block = 0, v = p;
    for (int q = p / 2 * 2; q < p / 2 * 2 + 2; ++q) block += q;
    for (; block < 50; block *= 2) v *= 2;
    EXPECT_EQ(d->element_as_double(p), v) << p;
  }
}

// Each of `results` fetched, within 1e-4 * (1 + |want|) of its host values.
void expect_results_near(const std::vector<Array>& results, const std::vector<std::vector<double>>& want) {
  ASSERT_EQ(results.size(), want.size());
  for (size_t k = 0; k < want.size(); ++k) {
    SCOPED_TRACE(absl::StrCat("result ", k));
    absl::StatusOr<HostArray> got = results[k].fetch();
    ASSERT_TRUE(got.ok()) << got.status();
    jit_support::expect_near(*got, want[k], 1e-4);
  }
}

// Loops with a collective inside a shard_map body, under jit, on the Explicit and the Auto
// (4, 2) mesh: a fori_loop whose body psums its varying carry's column sums over 'data' every
// iteration, and a scan over the block's rows whose invariant carry adds each row's psum over
// 'data' (the loop's collectives run once per iteration, not once per loop). JAX types these as
// tests/shard_map_test.py's test_scan_vma / test_fori_loop_rep_rule do; the values are the host's
// loops over the whole array.
TEST_F(ShardMapTest, LoopsWithAPsumInsideAShardMapBody) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kRows = 8, kCols = 4, kSteps = 3;
  const HostArray x = HostArray::arange(DType::kF32, {kRows, kCols});
  const HostArray w = HostArray::from_vector<float>({kCols}, {1, -2, 0.5f, 3});
  const auto body = [](const std::vector<Value>& in) {
    const std::vector<Value> looped =
        fori_loop(0, kSteps,
                  [](const Value& i, const std::vector<Value>& c) {
                    const Value total = psum(sum(c[0], {0}), "data");
                    return std::vector<Value>{c[0] * 0.5 + total * 0.125 + convert(i, DType::kF32)};
                  },
                  {in[0]});
    ScanResult r = scan(
        [&in](const std::vector<Value>& c, const std::vector<Value>& rows) {
          const Value next = c[0] + psum(rows[0] * in[1], "data");
          return ScanStep{{next}, {rows[0] + next}};
        },
        {full({kCols}, 0.0, DType::kF32)}, {in[0]});
    return std::vector<Value>{looped[0], r.carry[0], r.ys[0]};
  };
  // The host: the fori_loop over the whole array; the scan's carry after step k is the sum over
  // every block b of rows 2b..2b+k times w, and block b's row k of ys is its row plus that.
  std::vector<double> looped(x.values<float>().begin(), x.values<float>().end());
  for (int64_t step = 0; step < kSteps; ++step) {
    std::vector<double> total(kCols, 0.0);
    for (int64_t i = 0; i < kRows * kCols; ++i) total[i % kCols] += looped[i];
    for (int64_t i = 0; i < kRows * kCols; ++i) looped[i] = looped[i] * 0.5 + total[i % kCols] * 0.125 + step;
  }
  constexpr int64_t kBlock = kRows / 4;  // rows per block along 'data'
  std::vector<double> carry(kCols, 0.0), ys(kRows * kCols);
  for (int64_t k = 0; k < kBlock; ++k) {
    for (int64_t j = 0; j < kCols; ++j) {
      for (int64_t b = 0; b < 4; ++b)
        carry[j] += x.values<float>()[(b * kBlock + k) * kCols + j] * w.values<float>()[j];
      for (int64_t b = 0; b < 4; ++b) {
        ys[(b * kBlock + k) * kCols + j] = x.values<float>()[(b * kBlock + k) * kCols + j] + carry[j];
      }
    }
  }
  for (const Mesh& mesh : {mesh42(), auto_meshes_[1]}) {
    SCOPED_TRACE(mesh.to_string());
    const ShardMapped f = shard_map(body, mesh, {P("data", None), P()}, {P("data", None), P(), P("data", None)});
    absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data", None)));
    absl::StatusOr<Array> ws = client_->device_put(w, NamedSharding(mesh, P()));
    ASSERT_TRUE(xs.ok() && ws.ok());
    absl::StatusOr<std::vector<Array>> out = jit([&f](const std::vector<Value>& in) { return f(in); })({*xs, *ws});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_results_near(*out, {looped, carry, ys});
  }
}

// A scan (and a fori_loop) under jit whose body calls a shard_map, on the Explicit and the Auto
// (4, 2) mesh: the carry f32[8] laid out P('data') and each row of xs f32[3, 8] P(None, 'data')
// go into the shard_map's blocks, which psum over 'data'; the shard_map's result is the next
// carry and the stacked output. The values are the host's loop: c' = c / 2 + row + sum(c) / 100.
TEST_F(ShardMapTest, AScanWhoseBodyCallsAShardMap) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kSteps = 3, kLength = 8;
  const HostArray c0 = HostArray::arange(DType::kF32, {kLength});
  HostArray rows(DType::kF32, {kSteps, kLength});
  for (int64_t i = 0; i < kSteps * kLength; ++i) rows.mutable_values<float>()[i] = 0.25f * static_cast<float>(i % 7);
  std::vector<double> c(c0.values<float>().begin(), c0.values<float>().end()), ys, looped = c;
  for (int64_t k = 0; k < kSteps; ++k) {
    double total = 0;
    for (double v : c) total += v;
    for (int64_t j = 0; j < kLength; ++j) c[j] = c[j] / 2 + rows.values<float>()[k * kLength + j] + total / 100;
    ys.insert(ys.end(), c.begin(), c.end());
  }
  for (int64_t k = 0; k < kSteps; ++k) {  // the fori_loop: the same step with row 0 each time
    double total = 0;
    for (double v : looped) total += v;
    for (int64_t j = 0; j < kLength; ++j) looped[j] = looped[j] / 2 + rows.values<float>()[j] + total / 100;
  }
  for (const Mesh& mesh : {mesh42(), auto_meshes_[1]}) {
    SCOPED_TRACE(mesh.to_string());
    const ShardMapped step = shard_map(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{in[0] * 0.5 + in[1] + psum(sum(in[0]), "data") * 0.01};
        },
        mesh, {P("data"), P("data")}, {P("data")});
    TracedFunction f = [&step](const std::vector<Value>& in) {
      ScanResult r = scan(
          [&step](const std::vector<Value>& carry, const std::vector<Value>& row) {
            const Value next = step({carry[0], row[0]})[0];
            return ScanStep{{next}, {next}};
          },
          {in[0]}, {in[1]});
      const Value row0 = squeeze(slice(in[1], {0, 0}, {1, kLength}), {0});
      const std::vector<Value> looped = fori_loop(0, kSteps,
                                                  [&](const Value&, const std::vector<Value>& carry) {
                                                    return step({carry[0], row0});
                                                  },
                                                  {in[0]});
      return std::vector<Value>{r.carry[0], r.ys[0], looped[0]};
    };
    absl::StatusOr<Array> cs = client_->device_put(c0, NamedSharding(mesh, P("data")));
    absl::StatusOr<Array> xs = client_->device_put(rows, NamedSharding(mesh, P(None, "data")));
    ASSERT_TRUE(cs.ok() && xs.ok());
    absl::StatusOr<std::vector<Array>> out = jit(f)({*cs, *xs});
    ASSERT_TRUE(out.ok()) << out.status();
    expect_results_near(*out, {c, ys, looped});
  }
}

TEST_F(ShardMapTest, AxisSizeIsKnownWhileTracing) {
  ASSERT_NE(client_, nullptr);
  std::vector<int64_t> sizes;
  ShardMapped f = shard_map(
      [&sizes](const std::vector<Value>& in) {
        sizes = {axis_size("data"), axis_size("model"), axis_size({"data", "model"})};
        return std::vector<Value>{in[0]};
      },
      mesh42(), {P()}, {P()});
  ASSERT_TRUE(trace_error([f](const std::vector<Value>& in) { return f(in); }).ok());
  EXPECT_EQ(sizes, (std::vector<int64_t>{4, 2, 8}));
}

// Varying manual axes as JAX types them (docs/notebooks/shard_map.md at JAX cec06d1, the cell
// whose comments read f32[2,2]{V:(i,j)} for an argument under P('i', 'j') and f32[2,2]{V:i}
// after psum over 'j', and `jax.typeof(y).manual_axis_type.varying == {'i'}`): type_of shows
// them in mesh order, psum drops its axes, and with check_vma off nothing is typed.
TEST_F(ShardMapTest, TypeOfShowsTheVaryingManualAxesAsJaxDoes) {
  ASSERT_NE(client_, nullptr);
  std::vector<ShapedType> types;
  auto body = [&types](const std::vector<Value>& in) {
    const Value y = psum(in[0], "model");
    types = {type_of(in[0]), type_of(y), type_of(in[1]), type_of(pvary(in[1], "model"))};
    return std::vector<Value>{y};
  };
  auto traced = [](const ShardMapped& f) {
    return trace([f](const std::vector<Value>& in) { return f(in); }, {{DType::kF32, {16, 8}}, {DType::kF32, {4}}});
  };
  absl::StatusOr<Graph> g = traced(shard_map(body, mesh42(), {P("data", "model"), P()}, {P("data", None)}));
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_EQ(types.size(), 4u);
  EXPECT_EQ(types[0].varying, (std::vector<std::string>{"data", "model"}));
  EXPECT_EQ(types[0].to_string(), "f32[4,4]{V:(data,model)}");
  EXPECT_EQ(types[1].varying, (std::vector<std::string>{"data"}));
  EXPECT_EQ(types[1].to_string(), "f32[4,4]{V:data}");
  EXPECT_TRUE(types[2].varying.empty());  // in_spec P(): invariant, printed as JAX prints it
  EXPECT_EQ(types[2].to_string(), "f32[4]");
  EXPECT_EQ(types[3].to_string(), "f32[4]{V:model}");
  g = traced(shard_map(body, mesh42(), {P("data", "model"), P()}, {P("data", None)}, {.check_vma = false}));
  ASSERT_TRUE(g.ok()) << g.status();
  for (const ShapedType& t : types) EXPECT_TRUE(t.varying.empty()) << t.to_string();
}

// lax.pvary / pcast(to='varying') (jax/_src/lax/parallel.py: _pvary_abstract_eval adds its
// axes to the input's varying set and lowers to its operand): a replicated argument made
// varying may leave by an out_spec naming the axis, where each device's copy is one block
// (x tiled 4 times along 'data', worked by hand); out_spec P() on it is refused naming pvary,
// as JAX refuses it; the plan runs no instruction for it.
TEST_F(ShardMapTest, PvaryMakesAValueVaryingAndRunsAsItsOperand) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = HostArray::arange(DType::kF32, {4, 8});
  ShardMapped f = shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pvary(in[0] * 2.0, "data")}; },
                            mesh42(), {P()}, {P("data", None)});
  absl::StatusOr<std::vector<Array>> out = f({put(x, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->shape(), (Shape{16, 8}));
  for (int64_t e = 0; e < got->size(); ++e) EXPECT_EQ(got->element_as_double(e), 2.0 * (e % 32)) << e;
  EXPECT_THAT(f.as_text(), Not(HasSubstr("pvary")));
  // pcast(to='varying') is the same op.
  ShardMapped g =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{pcast(in[0], "model", "varying")}; },
                mesh42(), {P()}, {P(None, "model")});
  out = g({put(x, P())});
  ASSERT_TRUE(out.ok()) << out.status();
  got = (*out)[0].fetch();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->shape(), (Shape{4, 16}));
  for (int64_t r = 0; r < 4; ++r) {
    for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(got->element_as_double(r * 16 + c), r * 8 + c % 8) << r << "," << c;
  }
  // Refused where the out_spec leaves the axis out; accepted without the pvary.
  absl::Status s = trace_error([this](const std::vector<Value>& in) {
    return shard_map([](const std::vector<Value>& b) { return std::vector<Value>{pvary(b[0], "data")}; }, mesh42(),
                     {P()}, {P()})(in);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("may differ along mesh axis 'data' (it depends on pvary over 'data', which types it as "
                        "varying along it), but out_specs[0] = P() leaves 'data' out"));
  s = trace_error([this](const std::vector<Value>& in) {
    return shard_map([](const std::vector<Value>& b) { return std::vector<Value>{b[0] * 2.0}; }, mesh42(), {P()},
                     {P()})(in);
  });
  EXPECT_TRUE(s.ok()) << s;
}

// pvary's and pcast's errors, as JAX's (jax/_src/lax/parallel.py: _pvary_abstract_eval's
// "pvary is a invariant->variant collective", _get_from's mixed states, pcast's
// "Unsupported pcast from=varying, to='varying'" and "Got unexpected `to` value"; pcast
// to='reduced' is preduced, whose reduced type exists in explicit mode only: traced without
// one (trace_error) it is refused); with check_vma off pvary is x itself, as
// jax/_src/core.py's pvary returns x then.
TEST_F(ShardMapTest, PvaryAndPcastRefuseWhatJaxRefuses) {
  ASSERT_NE(client_, nullptr);
  auto error_of = [&](std::function<Value(const Value&)> body, PartitionSpec in = P("data", None)) {
    absl::Status s = trace_error([&](const std::vector<Value>& v) {
      return shard_map([body](const std::vector<Value>& b) { return std::vector<Value>{body(b[0])}; }, mesh42(), {in},
                       {P("data", "model")})(v);
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  EXPECT_THAT(error_of([](const Value& x) { return pvary(x, "data"); }),
              HasSubstr("pvary(f32[4,8], 'data'): pvary is an invariant->varying cast, so the axes it names must not "
                        "be ones x already varies along, but x varies along ('data',) (argument 0 is split over it "
                        "by its in_spec P('data', None))"));
  EXPECT_THAT(error_of([](const Value& x) { return pcast(x, "data", "varying"); }),
              HasSubstr("Unsupported pcast from=varying, to='varying'"));
  EXPECT_THAT(error_of([](const Value& x) {
                return pcast(x, AxisNames{"data", "model"}, "varying");
              }),
              HasSubstr("pcast can only accept axis_name which corresponds to one of varying, unreduced, reduced or "
                        "invarying state of the input"));
  EXPECT_THAT(error_of([](const Value& x) { return pcast(x, "model", "sideways"); }),
              HasSubstr("Got unexpected `to` value. Allowed `to` values are: {'unreduced', 'reduced', 'varying'}"));
  EXPECT_THAT(error_of([](const Value& x) { return pcast(x, "model", "reduced"); }),
              HasSubstr("pcast(f32[4,8], 'model', to='reduced'): reduced and unreduced axes are types of explicit "
                        "mode"));
  EXPECT_THAT(error_of([](const Value& x) { return pvary(x, "rows"); }, P()),
              HasSubstr("pvary: axis 'rows' is not in the mesh"));
  EXPECT_THAT(error_of(
                  [](const Value& x) {
                    return pvary(x, AxisNames{"model", "model"});
                  },
                  P()),
              HasSubstr("axis 'model' is named twice"));
  absl::Status s = trace_error([](const std::vector<Value>& in) { return std::vector<Value>{pvary(in[0], "data")}; });
  EXPECT_THAT(std::string(s.message()), HasSubstr("only inside a shard_map body"));
  // Both axes at once, in mesh order whatever the order named.
  std::string text;
  s = trace_error([this, &text](const std::vector<Value>& in) {
    return shard_map(
        [&text](const std::vector<Value>& b) {
          const Value y = pvary(b[0], AxisNames{"model", "data"});
          text = type_of(y).to_string();
          return std::vector<Value>{y};
        },
        mesh42(), {P()}, {P("data", "model")})(in);
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(text, "f32[16,8]{V:(data,model)}");
  // check_vma off: no node, the value itself.
  int before = -1, after = -2;
  s = trace_error([&](const std::vector<Value>& in) {
    return shard_map(
        [&](const std::vector<Value>& b) {
          before = b[0].node();
          after = pvary(b[0], "data").node();
          return std::vector<Value>{b[0]};
        },
        mesh42(), {P()}, {P()}, {.check_vma = false})(in);
  });
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(before, after);
}

// grad through pvary against the host. loss(x, w) = sum(tanh(pvary(x, 'data')) * w_block) over
// the four devices along 'data', x (4, 8) whole on each (P()), w (16, 8) under P('data', None):
//   d loss / dx[r, c] = (1 - tanh(x[r, c])^2) * sum_d w[4d + r, c]   (JAX: pvary's transpose psums)
//   d loss / dw[4d + r, c] = tanh(x[r, c]).
TEST_F(ShardMapTest, GradThroughPvaryMatchesTheHost) {
  ASSERT_NE(client_, nullptr);
  ShardMapped body =
      shard_map([](const std::vector<Value>& in) { return std::vector<Value>{tanh(pvary(in[0], "data")) * in[1]}; },
                mesh42(), {P(), P("data", None)}, {P("data", None)});
  TracedFunction loss = [body](const std::vector<Value>& in) { return std::vector<Value>{sum(body(in)[0], {})}; };
  Jitted f = jit(grad(loss, {0, 1}));
  std::mt19937 rng(11);
  const HostArray x = random_array(DType::kF32, {4, 8}, Domain::kSigned, rng);
  const HostArray w = random_array(DType::kF32, {16, 8}, Domain::kSigned, rng);
  absl::StatusOr<std::vector<Array>> out = f({put(x, P()), put(w, P("data", None))});
  ASSERT_TRUE(out.ok()) << out.status();
  absl::StatusOr<HostArray> dx = (*out)[0].fetch();
  absl::StatusOr<HostArray> dw = (*out)[1].fetch();
  ASSERT_TRUE(dx.ok() && dw.ok());
  ASSERT_EQ(dx->shape(), (Shape{4, 8}));
  ASSERT_EQ(dw->shape(), (Shape{16, 8}));
  for (int r = 0; r < 4; ++r) {
    for (int c = 0; c < 8; ++c) {
      const double t = std::tanh(x.element_as_double(r * 8 + c));
      double column = 0;
      for (int d = 0; d < 4; ++d) column += w.element_as_double((4 * d + r) * 8 + c);
      EXPECT_NEAR(dx->element_as_double(r * 8 + c), (1 - t * t) * column, 1e-5) << r << "," << c;
      for (int d = 0; d < 4; ++d) EXPECT_NEAR(dw->element_as_double((4 * d + r) * 8 + c), t, 1e-6) << d << "," << r;
    }
  }
}

// A shard_map body with control flow in it, for value_and_grad, and the same function written
// out on the host: `host(x, w, d, n)` is device d's block of the result (of n devices), x the
// whole (16, 4) argument split by rows, w the (4) replicated one.
struct BodyGradCase {
  std::string name;
  std::function<Value(const Value& block, const Value& w, const Axes& axes)> body;
  std::function<std::vector<double>(const std::vector<double>& x, const std::vector<double>& w, int d, int n)> host;
  // When set, the same body without checkpoint: the values and gradients must be its own.
  std::function<Value(const Value& block, const Value& w, const Axes& axes)> plain;
};

void PrintTo(const BodyGradCase& c, std::ostream* os) { *os << c.name; }

constexpr int kBodyRows = 16, kBodyCols = 4;

double at(const std::vector<double>& x, int row, int col) { return x[row * kBodyCols + col]; }

std::vector<BodyGradCase> body_grad_cases() {
  using Block = std::vector<double>;
  const auto rows_of = [](int d, int n) { return std::pair<int, int>{d * (kBodyRows / n), (d + 1) * (kBodyRows / n)}; };
  const auto each = [rows_of](int d, int n, const std::function<double(int, int)>& f) {
    Block out;
    for (int r = rows_of(d, n).first; r < rows_of(d, n).second; ++r) {
      for (int c = 0; c < kBodyCols; ++c) out.push_back(f(r, c));
    }
    return out;
  };
  const auto block_sum = [rows_of](const Block& x, int d, int n) {
    double s = 0;
    for (int r = rows_of(d, n).first; r < rows_of(d, n).second; ++r) {
      for (int c = 0; c < kBodyCols; ++c) s += at(x, r, c);
    }
    return s;
  };
  const auto total = [](const Block& v) {
    double s = 0;
    for (double e : v) s += e;
    return s;
  };
  std::vector<BodyGradCase> out;
  // An invariant predicate (w is replicated): every device takes the same branch; the branches'
  // operands differ in how they vary (x's block varies, w does not).
  out.push_back(
      {"cond_invariant_predicate",
       [](const Value& b, const Value& w, const Axes&) {
         return cond(
             sum(w) > 0.0, [](const std::vector<Value>& o) { return std::vector<Value>{sin(o[0]) * o[1]}; },
             [](const std::vector<Value>& o) { return std::vector<Value>{o[0] * o[0]}; }, {b, w})[0];
       },
       [=](const Block& x, const Block& w, int d, int n) {
         const bool p = total(w) > 0;
         return each(d, n, [&](int r, int c) { return p ? std::sin(at(x, r, c)) * w[c] : at(x, r, c) * at(x, r, c); });
       },
       {}});
  // A predicate of each device's block: each device takes its own branch.
  out.push_back({"cond_varying_predicate",
                 [](const Value& b, const Value& w, const Axes&) {
                   return cond(
                       sum(b) > 0.0, [](const std::vector<Value>& o) { return std::vector<Value>{sin(o[0]) * o[1]}; },
                       [](const std::vector<Value>& o) { return std::vector<Value>{o[0] * o[0] + o[1]}; }, {b, w})[0];
                 },
                 [=](const Block& x, const Block& w, int d, int n) {
                   const bool p = block_sum(x, d, n) > 0;
                   return each(d, n, [&](int r, int c) {
                     return p ? std::sin(at(x, r, c)) * w[c] : at(x, r, c) * at(x, r, c) + w[c];
                   });
                 },
                 {}});
  // A varying index (the device's position), clamped: a branch that does not read w (its
  // cotangent there is zero), one that reads an outer value (captured), one that reads w twice.
  out.push_back({"switch_varying_index",
                 [](const Value& b, const Value& w, const Axes& axes) {
                   const Value scale = b * 0.5;
                   return switch_(axis_index(axes) - 1,
                                  {[](const std::vector<Value>& o) { return std::vector<Value>{o[0] * o[1]}; },
                                   [](const std::vector<Value>& o) { return std::vector<Value>{exp(o[0] * 0.5)}; },
                                   [scale](const std::vector<Value>& o) {
                                     return std::vector<Value>{tanh(o[0] * scale) + o[1] * o[1]};
                                   }},
                                  {b, w})[0];
                 },
                 [=](const Block& x, const Block& w, int d, int n) {
                   const int k = std::clamp(d - 1, 0, 2);
                   return each(d, n, [&](int r, int c) {
                     const double v = at(x, r, c);
                     return k == 0 ? v * w[c] : k == 1 ? std::exp(v * 0.5) : std::tanh(v * v * 0.5) + w[c] * w[c];
                   });
                 },
                 {}});
  // An invariant index with a collective in a branch (every device takes it, so every device
  // joins the psum): branch 1 scales the block by the column sums of the whole argument.
  out.push_back({"switch_invariant_index_with_psum",
                 [](const Value& b, const Value& w, const Axes& axes) {
                   return switch_(convert(sum(w) > 0.0, DType::kI32),
                                  {[](const std::vector<Value>& o) { return std::vector<Value>{o[0] * o[1]}; },
                                   [axes](const std::vector<Value>& o) {
                                     return std::vector<Value>{o[0] * psum(sum(o[0], {0}), axes) + o[1]};
                                   }},
                                  {b, w})[0];
                 },
                 [=](const Block& x, const Block& w, int d, int n) {
                   std::vector<double> column(kBodyCols, 0.0);
                   for (int r = 0; r < kBodyRows; ++r) {
                     for (int c = 0; c < kBodyCols; ++c) column[c] += at(x, r, c);
                   }
                   const bool p = total(w) > 0;
                   return each(d, n,
                               [&](int r, int c) { return p ? at(x, r, c) * column[c] + w[c] : at(x, r, c) * w[c]; });
                 },
                 {}});
  // checkpoint (remat) of a layer inside the body, as JAX allows it there
  // (tests/shard_map_test.py's test_shmap_of_remat_basic: shard_map of jax.remat(sin) with
  // everything_saveable, its gradient cos(x)): tanh(b * w), a matmul by the outer product of w
  // (what dots_saveable keeps), a psum of column sums (a collective the backward pass computes
  // again unless kept), each policy and none; and a checkpoint around a cond on a per-device
  // predicate.
  const auto layer = [](const Value& b, const Value& w, const Axes& axes) {
    const Value h = tanh(b * w);
    const Value m = matmul(h, reshape(w, {kBodyCols, 1}) * reshape(w, {1, kBodyCols}));
    return m * psum(sum(h, {0}), axes) + sin(b);
  };
  const auto layer_host = [=](const Block& x, const Block& w, int d, int n) {
    std::vector<double> column(kBodyCols, 0.0);
    for (int r = 0; r < kBodyRows; ++r) {
      for (int c = 0; c < kBodyCols; ++c) column[c] += std::tanh(at(x, r, c) * w[c]);
    }
    return each(d, n, [&](int r, int c) {
      double m = 0;
      for (int k = 0; k < kBodyCols; ++k) m += std::tanh(at(x, r, k) * w[k]) * w[k] * w[c];
      return m * column[c] + std::sin(at(x, r, c));
    });
  };
  for (const auto& [name, policy] : std::vector<std::pair<std::string, CheckpointPolicy>>{
           {"", nullptr},
           {"_nothing_saveable", checkpoint_policies::nothing_saveable},
           {"_dots_saveable", checkpoint_policies::dots_saveable},
           {"_everything_saveable", checkpoint_policies::everything_saveable}}) {
    out.push_back({"checkpoint" + name,
                   [layer, policy = policy](const Value& b, const Value& w, const Axes& axes) {
                     return checkpoint(
                         [&](const std::vector<Value>& a) { return std::vector<Value>{layer(a[0], a[1], axes)}; },
                         policy)({b, w})[0];
                   },
                   layer_host, layer});
  }
  const auto branchy = [](const Value& b, const Value& w) {
    return cond(
        sum(b) > 0.0, [](const std::vector<Value>& o) { return std::vector<Value>{tanh(o[0] * o[1]) * o[1]}; },
        [](const std::vector<Value>& o) { return std::vector<Value>{exp(o[0] * 0.5) + o[1]}; }, {b, w})[0];
  };
  out.push_back({"checkpoint_of_cond",
                 [branchy](const Value& b, const Value& w, const Axes&) {
                   return checkpoint([&](const std::vector<Value>& a) {
                     return std::vector<Value>{branchy(a[0], a[1]) * a[0]};
                   })({b, w})[0];
                 },
                 [=](const Block& x, const Block& w, int d, int n) {
                   const bool p = block_sum(x, d, n) > 0;
                   return each(d, n, [&](int r, int c) {
                     const double v = at(x, r, c);
                     return (p ? std::tanh(v * w[c]) * w[c] : std::exp(v * 0.5) + w[c]) * v;
                   });
                 },
                 [branchy](const Value& b, const Value& w, const Axes&) { return branchy(b, w) * b; }});
  return out;
}

class ShardMapBodyGradTest : public MeshesSuite, public ::testing::WithParamInterface<BodyGradCase> {};

// grad and value_and_grad through cond and switch inside a shard_map body (JAX differentiates
// them there: jax/_src/lax/control_flow/conditionals.py's _cond_transpose under shard_map, as
// tests/shard_map_test.py's test_cond_rep_rule and test_switch bodies do) on the (8) and (4, 2)
// meshes, Auto and Explicit axes, x split by rows over every axis (and on (4, 2) over 'data'
// only: the body's values are then invariant along 'model'), w replicated, for a w whose sum is
// positive and one whose sum is negative (either branch of an invariant predicate). The
// reference is the function written out on the host per device (BodyGradCase::host): the loss
// sum(f(x, w) * r) against it, each gradient element against central differences of it (float64).
TEST_P(ShardMapBodyGradTest, ValuesAndGradientsMatchTheHost) {
  const BodyGradCase& c = GetParam();
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)));
  const HostArray x = random_array(DType::kF64, {kBodyRows, kBodyCols}, Domain::kSigned, rng);
  const HostArray r = random_array(DType::kF64, {kBodyRows, kBodyCols}, Domain::kSigned, rng);
  const std::vector<double> xv(x.values<double>().begin(), x.values<double>().end());
  const std::vector<double> rv(r.values<double>().begin(), r.values<double>().end());
  for (const double sign : {1.0, -1.0}) {
    HostArray w = random_array(DType::kF64, {kBodyCols}, Domain::kPositive, rng);
    for (double& e : w.mutable_values<double>()) e *= sign;
    const std::vector<double> wv(w.values<double>().begin(), w.values<double>().end());
    for (const std::pair<Mesh, Axes>& layout : std::vector<std::pair<Mesh, Axes>>{{auto_meshes_[0], {"data"}},
                                                                                  {auto_meshes_[1], {"data", "model"}},
                                                                                  {auto_meshes_[1], {"data"}},
                                                                                  {meshes_[0], {"data"}},
                                                                                  {meshes_[1], {"data", "model"}},
                                                                                  {meshes_[1], {"data"}}}) {
      {
        const Mesh& mesh = layout.first;
        const Axes& axes = layout.second;
        SCOPED_TRACE(absl::StrCat(mesh.to_string(), " rows split over ", axes_to_string(axes), ", w sum ",
                                  sign > 0 ? "positive" : "negative"));
        const int n = static_cast<int>(mesh.axes_size(axes));
        const auto host_loss = [&](const std::vector<double>& xs, const std::vector<double>& ws) {
          double l = 0;
          for (int d = 0; d < n; ++d) {
            const std::vector<double> block = c.host(xs, ws, d, n);
            for (size_t e = 0; e < block.size(); ++e) l += block[e] * rv[d * block.size() + e];
          }
          return l;
        };
        const auto loss_of = [&](const std::function<Value(const Value&, const Value&, const Axes&)>& body) {
          ShardMapped f = shard_map(
              [body, axes](const std::vector<Value>& in) { return std::vector<Value>{body(in[0], in[1], axes)}; }, mesh,
              {P(axes, None), P()}, {P(axes, None)});
          return TracedFunction([f](const std::vector<Value>& in) {
            return std::vector<Value>{sum(f({in[0], in[1]})[0] * in[2])};
          });
        };
        const TracedFunction loss = loss_of(c.body);
        std::vector<Array> args;
        for (const auto& [a, spec] : std::vector<std::pair<const HostArray*, PartitionSpec>>{
                 {&x, P(axes, None)}, {&w, P()}, {&r, P(axes, None)}}) {
          absl::StatusOr<Array> put = client_->device_put(*a, NamedSharding(mesh, spec));
          ASSERT_TRUE(put.ok()) << put.status();
          args.push_back(*std::move(put));
        }
        Jitted step = jit(value_and_grad(loss, {0, 1}));
        absl::StatusOr<std::vector<Array>> got = step(args);
        ASSERT_TRUE(got.ok()) << got.status();
        ASSERT_EQ(got->size(), 3u);
        absl::StatusOr<HostArray> value = (*got)[0].fetch();
        ASSERT_TRUE(value.ok()) << value.status();
        const double want = host_loss(xv, wv);
        EXPECT_NEAR(value->element_as_double(0), want, 1e-9 * (1 + std::abs(want)));
        // grad alone gives the same gradients.
        absl::StatusOr<std::vector<Array>> grads = jit(grad(loss, {0, 1}))(args);
        ASSERT_TRUE(grads.ok()) << grads.status();
        if (c.plain) {  // a checkpoint's values and gradients are those of its function as it is
          absl::StatusOr<std::vector<Array>> plain = jit(value_and_grad(loss_of(c.plain), {0, 1}))(args);
          ASSERT_TRUE(plain.ok()) << plain.status();
          for (int k = 0; k < 3; ++k) {
            absl::StatusOr<HostArray> a = (*got)[k].fetch();
            absl::StatusOr<HostArray> b = (*plain)[k].fetch();
            ASSERT_TRUE(a.ok() && b.ok());
            ASSERT_EQ(a->shape(), b->shape());
            for (int64_t i = 0; i < a->size(); ++i) {
              EXPECT_NEAR(a->element_as_double(i), b->element_as_double(i),
                          1e-12 * (1 + std::abs(b->element_as_double(i))))
                  << "result " << k << " element " << i;
            }
          }
        }
        constexpr double h = 1e-6;
        for (int k = 0; k < 2; ++k) {
          absl::StatusOr<HostArray> g = (*got)[k + 1].fetch();
          absl::StatusOr<HostArray> g_alone = (*grads)[k].fetch();
          ASSERT_TRUE(g.ok() && g_alone.ok());
          EXPECT_EQ(*g, *g_alone);
          const std::vector<double>& base = k == 0 ? xv : wv;
          for (size_t i = 0; i < base.size(); ++i) {
            std::vector<double> plus = base, minus = base;
            plus[i] += h;
            minus[i] -= h;
            const double fd = k == 0 ? (host_loss(plus, wv) - host_loss(minus, wv)) / (2 * h)
                                     : (host_loss(xv, plus) - host_loss(xv, minus)) / (2 * h);
            EXPECT_NEAR(g->element_as_double(static_cast<int64_t>(i)), fd, 1e-5 * (1 + std::abs(fd)))
                << "d/d " << (k == 0 ? "x" : "w") << " element " << i;
          }
        }
      }
    }
  }
}

// What checkpoint does inside a body, in the program of value_and_grad: the layer is a switch
// whose backward is a second switch; with nothing saveable the backward computes the layer's
// tanh and its psum (an all_reduce) again, with everything saveable neither (jax.checkpoint's policies, as
// CheckpointPlan.APolicyKeepsWhatItNamesAndTheBackwardComputesItNoMore checks outside shard_map).
TEST_F(ShardMapTest, CheckpointInsideABodyRecomputesWhatItDoesNotKeep) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[0];  // (8) 'data'
  const auto count = [](const std::string& text, const std::string& what) {
    int n = 0;
    for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
    return n;
  };
  std::mt19937 rng(5);
  const HostArray x = random_array(DType::kF32, {16, 4}, Domain::kSigned, rng);
  absl::StatusOr<Array> xs = client_->device_put(x, NamedSharding(mesh, P("data")));
  ASSERT_TRUE(xs.ok()) << xs.status();
  for (const auto& [policy, recomputed] : std::vector<std::pair<CheckpointPolicy, bool>>{
           {checkpoint_policies::nothing_saveable, true}, {checkpoint_policies::everything_saveable, false}}) {
    SCOPED_TRACE(recomputed ? "nothing_saveable" : "everything_saveable");
    const TracedFunction layer = [](const std::vector<Value>& a) {
      const Value h = tanh(a[0] * 3.0);
      return std::vector<Value>{h * psum(sum(h, {0}), "data")};
    };
    ShardMapped f = shard_map(checkpoint(layer, policy), mesh, {P("data")}, {P("data")});
    Jitted step = jit(value_and_grad([f](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in)[0])}; }));
    absl::StatusOr<std::vector<Array>> g = step({*xs});
    ASSERT_TRUE(g.ok()) << g.status();
    const std::string text = step.as_text();
    ASSERT_EQ(count(text, "= switch("), 2) << text;
    const std::string backward = text.substr(text.rfind("= switch("));
    EXPECT_EQ(count(backward, "tanh") > 0, recomputed) << text;
    // The psum's transpose is an all_reduce of 4 floats, 28 bytes per device on 8 devices
    // (2 (n - 1) / n of 16 bytes); recomputed, the layer's psum joins it (combined: 56).
    EXPECT_THAT(backward, HasSubstr(recomputed ? "branches=1) 56B/device" : "branches=1) 28B/device")) << text;
  }
}

INSTANTIATE_TEST_SUITE_P(CondSwitchAndCheckpoint, ShardMapBodyGradTest, ::testing::ValuesIn(body_grad_cases()),
                         [](const ::testing::TestParamInfo<BodyGradCase>& info) { return info.param.name; });

}  // namespace
}  // namespace tessera

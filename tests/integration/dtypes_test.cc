// bfloat16, float16, int8, uint8 and int16 through the whole system (issue #15 item 6): device_put
// and fetch, jitted elementwise ops, matmuls, reductions and shard_map collectives on the (8)
// and (4, 2) meshes of Client::local(8), grad through a bfloat16 matmul, and promotion in
// tracing — each against a host reference written here in float32 (or exact integers), rounded
// to the half where the system rounds.
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/support/halves.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

// Small integers as floats: sums of a few of them are exact in either half.
std::vector<float> small_integers(int n, std::mt19937& rng) {
  std::uniform_int_distribution<int> d(-4, 4);
  std::vector<float> out;
  for (int i = 0; i < n; ++i) out.push_back(static_cast<float>(d(rng)));
  return out;
}

class DTypesTest : public MeshesSuite {
 protected:
  // meshes_[0] is (8) over "data", meshes_[1] (4, 2) over ("data", "model").
  Array put(const HostArray& x, const Mesh& mesh, const PartitionSpec& spec) const {
    absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(mesh, spec));
    EXPECT_TRUE(a.ok()) << a.status();
    return *std::move(a);
  }
  std::vector<HostArray> call(const TracedFunction& f, const std::vector<Array>& args) const {
    absl::StatusOr<std::vector<Array>> out = jit(f)(args);
    EXPECT_TRUE(out.ok()) << out.status();
    std::vector<HostArray> hosts;
    if (!out.ok()) return hosts;
    for (const Array& a : *out) {
      absl::StatusOr<HostArray> h = a.fetch();
      EXPECT_TRUE(h.ok()) << h.status();
      if (h.ok()) hosts.push_back(*std::move(h));
    }
    return hosts;
  }
  // The layouts of a (16, 8) argument tried on each mesh.
  static std::vector<PartitionSpec> layouts(const Mesh& mesh) {
    std::vector<PartitionSpec> out = {P(), P("data", None), P(None, "data")};
    if (mesh.axis_names().size() == 2) {
      out.push_back(P("data", "model"));
      out.push_back(P(Axes{"data", "model"}, None));
    }
    return out;
  }
};

TEST_F(DTypesTest, PutAndFetchKeepEveryBit) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(5);
  std::vector<HostArray> inputs;
  inputs.push_back(halves<BFloat16>({16, 8}, uniform_floats(128, -1e3f, 1e3f, rng)));
  inputs.push_back(halves<Float16>({16, 8}, uniform_floats(128, -1e3f, 1e3f, rng)));
  std::vector<int8_t> i8;
  std::vector<uint8_t> u8;
  std::vector<int16_t> i16;
  for (int i = 0; i < 128; ++i) {
    i8.push_back(static_cast<int8_t>(i * 7 - 300));
    u8.push_back(static_cast<uint8_t>(i * 13));
    i16.push_back(static_cast<int16_t>(i * 517 - 30000));
  }
  inputs.push_back(HostArray::from_vector<int8_t>({16, 8}, i8));
  inputs.push_back(HostArray::from_vector<uint8_t>({16, 8}, u8));
  inputs.push_back(HostArray::from_vector<int16_t>({16, 8}, i16));
  // NaN, inf, -0 and a float16 subnormal travel as they are.
  inputs[1].mutable_values<Float16>()[0] = Float16::from_bits(0x7E01);
  inputs[1].mutable_values<Float16>()[1] = Float16::from_bits(0xFC00);
  inputs[1].mutable_values<Float16>()[2] = Float16::from_bits(0x8000);
  inputs[1].mutable_values<Float16>()[3] = Float16::from_bits(0x0003);
  for (const Mesh& mesh : meshes_) {
    for (const PartitionSpec& spec : layouts(mesh)) {
      for (const HostArray& x : inputs) {
        const Array a = put(x, mesh, spec);
        EXPECT_EQ(a.dtype(), x.dtype());
        absl::StatusOr<HostArray> back = a.fetch();
        ASSERT_TRUE(back.ok()) << back.status();
        EXPECT_TRUE(*back == x) << dtype_name(x.dtype()) << " on " << mesh.to_string() << " " << spec.to_string();
      }
    }
  }
}

// tanh(x) * y + 1.0 rounds after each op (the weak 1.0 takes x's dtype, as in JAX); x < y is
// bool; convert to float32 is exact.
template <typename H>
void check_elementwise(const std::vector<HostArray>& out, const std::vector<float>& xs, const std::vector<float>& ys,
                       const std::string& where) {
  ASSERT_EQ(out.size(), 3u) << where;
  ASSERT_EQ(out[0].dtype(), dtype_of<H>()) << where;
  ASSERT_EQ(out[1].dtype(), DType::kBool) << where;
  ASSERT_EQ(out[2].dtype(), DType::kF32) << where;
  int bad = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const H tanh_x(std::tanh(xs[i]));
    const H product(static_cast<float>(tanh_x) * ys[i]);
    const H want(static_cast<float>(product) + 1.0f);
    bad += out[0].values<H>()[i].bits() != want.bits();
    bad += out[1].values<bool>()[i] != (xs[i] < ys[i]);
    bad += out[2].values<float>()[i] != xs[i];
  }
  EXPECT_EQ(bad, 0) << where;
}

TEST_F(DTypesTest, ElementwiseOpsRoundAfterEachOpOnEveryLayout) {
  ASSERT_NE(client_, nullptr);
  const TracedFunction f = [](const std::vector<Value>& in) {
    return std::vector<Value>{tanh(in[0]) * in[1] + 1.0, in[0] < in[1], convert(in[0], DType::kF32)};
  };
  std::mt19937 rng(9);
  const std::vector<float> x = uniform_floats(128, -3, 3, rng), y = uniform_floats(128, -3, 3, rng);
  const HostArray bx = halves<BFloat16>({16, 8}, x), by = halves<BFloat16>({16, 8}, y);
  const HostArray hx = halves<Float16>({16, 8}, x), hy = halves<Float16>({16, 8}, y);
  for (const Mesh& mesh : meshes_) {
    for (const PartitionSpec& spec : layouts(mesh)) {
      const std::string where = absl::StrCat(mesh.to_string(), " ", spec.to_string());
      check_elementwise<BFloat16>(call(f, {put(bx, mesh, spec), put(by, mesh, P())}), floats<BFloat16>(bx),
                                  floats<BFloat16>(by), "bfloat16 " + where);
      check_elementwise<Float16>(call(f, {put(hx, mesh, spec), put(hy, mesh, spec)}), floats<Float16>(hx),
                                 floats<Float16>(hy), "float16 " + where);
    }
  }
}

// x @ w and sum(x, axis 1) in bfloat16. With the contraction whole on each device the result is
// the float32 sum rounded once (within one unit of bfloat16's last place: BLAS adds in its own
// order). Split over devices, each device's partial result is a bfloat16 (rounded) and the
// partials are summed by an all-reduce in float32 per step, rounded per step: the error is then
// bounded by the number of roundings times half an ulp of the sum of |terms|.
TEST_F(DTypesTest, MatmulsAndSumsAccumulateInFloat32) {
  ASSERT_NE(client_, nullptr);
  constexpr int m = 16, k = 256, n = 8;
  std::mt19937 rng(13);
  const HostArray x = halves<BFloat16>({m, k}, uniform_floats(m * k, -1, 1, rng));
  const HostArray w = halves<BFloat16>({k, n}, uniform_floats(k * n, -1, 1, rng));
  const std::vector<float> xs = floats<BFloat16>(x), ws = floats<BFloat16>(w);
  // A contraction split on both operands says where its sum goes (out_sharding, as JAX >= 0.9
  // asks on make_mesh's Explicit axes): all-reduced, the result keeping x's row split.
  struct Layout {
    PartitionSpec x, w;
    bool split_contraction;
    PartitionSpec out = P();
  };
  for (const Mesh& mesh : meshes_) {
    std::vector<Layout> cases = {{P("data", None), P(), false}, {P(None, "data"), P("data", None), true, P()}};
    if (mesh.axis_names().size() == 2) cases.push_back({P("data", "model"), P("model", None), true, P("data", None)});
    for (const Layout& l : cases) {
      const std::string where = absl::StrCat(mesh.to_string(), " x ", l.x.to_string(), " w ", l.w.to_string());
      const TracedFunction f = [&l](const std::vector<Value>& in) {
        return std::vector<Value>{l.split_contraction ? matmul(in[0], in[1], l.out) : matmul(in[0], in[1]),
                                  sum(in[0], {1})};
      };
      const std::vector<HostArray> out = call(f, {put(x, mesh, l.x), put(w, mesh, l.w)});
      ASSERT_EQ(out.size(), 2u);
      ASSERT_EQ(out[0].dtype(), DType::kBF16) << where;
      ASSERT_EQ(out[1].dtype(), DType::kBF16) << where;
      const double roundings = l.split_contraction ? 2 * 8 : 1;
      int bad = 0;
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          float want = 0;
          double scale = 0;
          for (int p = 0; p < k; ++p) {
            want += xs[i * k + p] * ws[p * n + j];
            scale += std::abs(xs[i * k + p] * ws[p * n + j]);
          }
          const double got = static_cast<float>(out[0].values<BFloat16>()[i * n + j]);
          const double tol = roundings * std::ldexp(std::max(std::abs(want), 1e-3f), -7) +
                             (l.split_contraction ? roundings * std::ldexp(scale, -9) : k * 0x1p-24 * scale);
          if (std::abs(got - static_cast<float>(BFloat16(want))) > tol) ++bad;
        }
        float row = 0;
        for (int p = 0; p < k; ++p) row += xs[i * k + p];
        const double got = static_cast<float>(out[1].values<BFloat16>()[i]);
        double row_scale = 0;
        for (int p = 0; p < k; ++p) row_scale += std::abs(xs[i * k + p]);
        const double tol = std::ldexp(std::max(std::abs(row), 1e-3f), -7) +
                           (l.x.dims().size() > 1 && !l.x.dims()[1].empty() ? 16 * std::ldexp(row_scale, -9)
                                                                            : k * 0x1p-24 * row_scale);
        if (std::abs(got - static_cast<float>(BFloat16(row))) > tol) ++bad;
      }
      EXPECT_EQ(bad, 0) << where;
    }
  }
  // Integer-valued operands: every partial sum is exact in bfloat16 (|sums| < 256 here), so
  // the sharded result is exact too — and 1000 ones sum to 1000, where a bfloat16 accumulator
  // stops at 256.
  const HostArray ones = HostArray::ones(DType::kBF16, {8, 1000});
  const std::vector<HostArray> s = call(
      [](const std::vector<Value>& in) { return std::vector<Value>{sum(in[0], {1})}; }, {put(ones, meshes_[0], P())});
  ASSERT_EQ(s.size(), 1u);
  for (float v : floats<BFloat16>(s[0])) EXPECT_EQ(v, 1000.0f);
}

// psum, pmax, all_gather and psum_scatter on halves inside shard_map: integer values, whose
// per-step float32 sums rounded to the half are exact, so the results are exact; a float16 psum
// of general values is within one rounding per step.
TEST_F(DTypesTest, CollectivesOnHalves) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(17);
  for (const Mesh& mesh : meshes_) {
    const int64_t devices = 8, rows = 16, cols = 8;
    const int64_t block = rows / devices;
    const Axes axes = mesh.axis_names();
    ShardMapped f = shard_map(
        [axes](const std::vector<Value>& in) {
          return std::vector<Value>{psum(in[0], axes), pmax(in[0], axes), all_gather(in[0], axes, 0, true),
                                    psum_scatter(in[0], axes, 1, true)};
        },
        // (check_vma off: JAX types a tiled all_gather's result as varying, though it is not.)
        mesh, {P(axes, None)}, {P(), P(), P(), P(None, axes)}, {.check_vma = false});
    const std::vector<float> v = small_integers(static_cast<int>(rows * cols), rng);
    for (DType d : {DType::kBF16, DType::kF16}) {
      const HostArray x = d == DType::kBF16 ? halves<BFloat16>({rows, cols}, v) : halves<Float16>({rows, cols}, v);
      const std::vector<HostArray> out =
          call([f](const std::vector<Value>& in) { return f(in); }, {put(x, mesh, P(axes, None))});
      ASSERT_EQ(out.size(), 4u);
      const std::string where = absl::StrCat(dtype_name(d), " on ", mesh.to_string());
      std::vector<float> total(block * cols, 0), top(block * cols, -1e9f);
      for (int64_t dev = 0; dev < devices; ++dev) {
        for (int64_t e = 0; e < block * cols; ++e) {
          total[e] += v[dev * block * cols + e];
          top[e] = std::max(top[e], v[dev * block * cols + e]);
        }
      }
      auto as_floats = [d](const HostArray& a) { return d == DType::kBF16 ? floats<BFloat16>(a) : floats<Float16>(a); };
      EXPECT_EQ(out[0].dtype(), d) << where;
      EXPECT_EQ(as_floats(out[0]), total) << where;
      EXPECT_EQ(as_floats(out[1]), top) << where;
      EXPECT_EQ(as_floats(out[2]), v) << where;      // the blocks gathered in order: x itself
      EXPECT_EQ(as_floats(out[3]), total) << where;  // device i keeps column i of the sum
    }
  }
}

// jax.grad of sum(x @ w) with respect to w: the cotangent has the primal's dtype (bfloat16), and
// equals x^T @ ones, i.e. the column sums of x (integer-valued here, so exact).
TEST_F(DTypesTest, GradThroughABfloat16MatmulIsBfloat16) {
  ASSERT_NE(client_, nullptr);
  const TracedFunction loss = [](const std::vector<Value>& in) {
    return std::vector<Value>{sum(matmul(in[0], in[1]))};
  };
  std::mt19937 rng(19);
  const std::vector<float> xv = small_integers(16 * 8, rng), wv = small_integers(8 * 4, rng);
  const HostArray x = halves<BFloat16>({16, 8}, xv), w = halves<BFloat16>({8, 4}, wv);
  for (const Mesh& mesh : meshes_) {
    const std::vector<HostArray> out = call(grad(loss, {1}), {put(x, mesh, P("data", None)), put(w, mesh, P())});
    ASSERT_EQ(out.size(), 1u);
    ASSERT_EQ(out[0].dtype(), DType::kBF16);
    ASSERT_EQ(out[0].shape(), (Shape{8, 4}));
    for (int p = 0; p < 8; ++p) {
      float column = 0;
      for (int i = 0; i < 16; ++i) column += xv[i * 8 + p];
      for (int j = 0; j < 4; ++j) {
        EXPECT_EQ(static_cast<float>(out[0].values<BFloat16>()[p * 4 + j]), column) << p << "," << j;
      }
    }
  }
}

// jnp.promote_types in tracing (docs/type_promotion.rst's table; tests/core/float16_test.cc
// checks the whole table): mixed operands convert to the join first, Python scalars are weak.
TEST_F(DTypesTest, MixedOperandsPromoteAsJax) {
  ASSERT_NE(client_, nullptr);
  const TracedFunction f = [](const std::vector<Value>& in) {
    const Value &bf = in[0], &f16 = in[1], &i8 = in[2], &u8 = in[3], &i32 = in[4];
    return std::vector<Value>{bf + i32, bf + f16, i8 + u8, u8 + i32, bf * 2.0, i8 * 3, u8 + 1};
  };
  const HostArray bf = halves<BFloat16>({4}, {1.5f, -2.0f, 256.0f, 0.25f});
  const HostArray f16 = halves<Float16>({4}, {0.5f, 1.0f, 1.0f, 1e-3f});
  const HostArray i8 = HostArray::from_vector<int8_t>({4}, {100, -128, 127, -1});
  const HostArray u8 = HostArray::from_vector<uint8_t>({4}, {200, 255, 1, 0});
  const HostArray i32 = HostArray::from_vector<int32_t>({4}, {1, 2, 1, 100000});
  const Mesh& mesh = meshes_[0];
  const std::vector<HostArray> out =
      call(f, {put(bf, mesh, P()), put(f16, mesh, P()), put(i8, mesh, P()), put(u8, mesh, P()), put(i32, mesh, P())});
  ASSERT_EQ(out.size(), 7u);
  EXPECT_EQ(out[0].dtype(), DType::kBF16);  // bf + i4 = bf
  // 256 + 1 = 257 rounds to 256 in bfloat16 (tie, even); 100000 becomes 99840 first.
  EXPECT_EQ(floats<BFloat16>(out[0]), (std::vector<float>{2.5f, 0.0f, 256.0f, 99840.0f}));
  EXPECT_EQ(out[1].dtype(), DType::kF32);  // bf + f2 = f4
  EXPECT_EQ(std::vector<float>(out[1].values<float>().begin(), out[1].values<float>().end()),
            (std::vector<float>{2.0f, -1.0f, 257.0f, 0.25f + static_cast<float>(Float16(1e-3f))}));
  EXPECT_EQ(out[2].dtype(), DType::kI16);  // i1 + u1 = i2: no wrap-around
  EXPECT_EQ(std::vector<int16_t>(out[2].values<int16_t>().begin(), out[2].values<int16_t>().end()),
            (std::vector<int16_t>{300, 127, 128, -1}));
  EXPECT_EQ(out[3].dtype(), DType::kI32);   // u1 + i4 = i4
  EXPECT_EQ(out[4].dtype(), DType::kBF16);  // weak float keeps bf
  EXPECT_EQ(floats<BFloat16>(out[4]), (std::vector<float>{3.0f, -4.0f, 512.0f, 0.5f}));
  EXPECT_EQ(out[5].dtype(), DType::kI8);  // weak int keeps i1, and wraps: 100 * 3 = 300 - 256
  EXPECT_EQ(std::vector<int8_t>(out[5].values<int8_t>().begin(), out[5].values<int8_t>().end()),
            (std::vector<int8_t>{44, -128, 125, -3}));
  EXPECT_EQ(out[6].dtype(), DType::kU8);
  EXPECT_EQ(std::vector<uint8_t>(out[6].values<uint8_t>().begin(), out[6].values<uint8_t>().end()),
            (std::vector<uint8_t>{201, 0, 2, 1}));
}

}  // namespace
}  // namespace tessera

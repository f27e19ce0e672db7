// tessera::nn's composites through jit on sharded inputs of Client::local(8), against plain
// loops on the host written from each function's definition (jax.nn's docstrings, optax's and
// flax's), and their gradients through grad against central differences in grad_test.cc.
#include "tessera/nn.h"

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

using Rows = std::vector<std::vector<double>>;

class NnTest : public MeshesSuite {
 protected:
  // f through jit on the (4, 2) mesh with `specs`, output 0 fetched as doubles.
  std::vector<double> run(const TracedFunction& f, const std::vector<const HostArray*>& inputs,
                          const std::vector<PartitionSpec>& specs) {
    const Mesh& mesh = meshes_[1];
    std::vector<Array> args;
    for (size_t i = 0; i < inputs.size(); ++i) {
      absl::StatusOr<Array> a = client_->device_put(*inputs[i], NamedSharding(mesh, specs[i]));
      EXPECT_TRUE(a.ok()) << a.status();
      if (!a.ok()) return {};
      args.push_back(*std::move(a));
    }
    absl::StatusOr<std::vector<Array>> out = jit(f)(args);
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    absl::StatusOr<HostArray> host = (*out)[0].fetch();
    EXPECT_TRUE(host.ok()) << host.status();
    if (!host.ok()) return {};
    std::vector<double> values(static_cast<size_t>(host->size()));
    for (int64_t i = 0; i < host->size(); ++i) {
      values[i] = host->dtype() == DType::kF32 ? host->values<float>()[i] : host->values<double>()[i];
    }
    return values;
  }

  HostArray random(Shape shape, double lo = -3, double hi = 3) {
    HostArray a(DType::kF32, std::move(shape));
    std::uniform_real_distribution<float> u(static_cast<float>(lo), static_cast<float>(hi));
    for (float& v : a.mutable_values<float>()) v = u(rng_);
    return a;
  }
  static std::vector<double> as_doubles(const HostArray& a) {
    return std::vector<double>(a.values<float>().begin(), a.values<float>().end());
  }
  static void expect_near(const std::vector<double>& got, const std::vector<double>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 2e-5 * std::max(1.0, std::abs(want[i]))) << "element " << i;
    }
  }

  std::mt19937 rng_{7};
};

constexpr int64_t kRows = 8, kCols = 16;

// Per row of a (rows, cols) matrix: the host's softmax, log-softmax and logsumexp.
std::vector<double> softmax_rows(const std::vector<double>& x, bool log_space) {
  std::vector<double> out(x.size());
  for (int64_t r = 0; r < kRows; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t c = 0; c < kCols; ++c) m = std::max(m, x[r * kCols + c]);
    for (int64_t c = 0; c < kCols; ++c) s += std::exp(x[r * kCols + c] - m);
    for (int64_t c = 0; c < kCols; ++c) {
      const double v = x[r * kCols + c];
      out[r * kCols + c] = log_space ? v - m - std::log(s) : std::exp(v - m) / s;
    }
  }
  return out;
}

TEST_F(NnTest, ActivationsMatchTheirDefinitions) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = random({kRows, kCols});
  const std::vector<double> xs = as_doubles(x);
  const double c = std::sqrt(2.0 / M_PI);
  struct Case {
    const char* name;
    std::function<Value(const Value&)> f;
    std::function<double(double)> want;
  };
  const std::vector<Case> cases = {
      {"relu", [](const Value& v) { return nn::relu(v); }, [](double v) { return v > 0 ? v : 0.0; }},
      {"gelu tanh", [](const Value& v) { return nn::gelu(v); },
       [c](double v) { return 0.5 * v * (1 + std::tanh(c * (v + 0.044715 * v * v * v))); }},
      {"gelu exact", [](const Value& v) { return nn::gelu(v, false); },
       [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }},
      {"silu", [](const Value& v) { return nn::silu(v); }, [](double v) { return v / (1 + std::exp(-v)); }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const auto f = k.f;
    std::vector<double> want;
    for (double v : xs) want.push_back(k.want(v));
    expect_near(
        run([f](const std::vector<Value>& in) { return std::vector<Value>{f(in[0])}; }, {&x}, {P("data", "model")}),
        want);
  }
}

// Rows split over 'data' and the softmax axis over 'model': the max and the sum are reduced
// across devices.
TEST_F(NnTest, SoftmaxFamilyOverASplitAxis) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = random({kRows, kCols}, -20, 20);
  const std::vector<double> xs = as_doubles(x);
  const std::vector<PartitionSpec> split = {P("data", "model")};
  expect_near(run([](const std::vector<Value>& in) { return std::vector<Value>{nn::softmax(in[0])}; }, {&x}, split),
              softmax_rows(xs, false));
  expect_near(
      run([](const std::vector<Value>& in) { return std::vector<Value>{nn::log_softmax(in[0], 1)}; }, {&x}, split),
      softmax_rows(xs, true));
  std::vector<double> lse(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    double m = -INFINITY, s = 0;
    for (int64_t c = 0; c < kCols; ++c) m = std::max(m, xs[r * kCols + c]);
    for (int64_t c = 0; c < kCols; ++c) s += std::exp(xs[r * kCols + c] - m);
    lse[r] = m + std::log(s);
  }
  expect_near(run([](const std::vector<Value>& in) { return std::vector<Value>{nn::logsumexp(in[0])}; }, {&x}, split),
              lse);
  // Large values do not overflow, and a row of -inf gives -inf (jax.nn.logsumexp), not NaN.
  HostArray big =
      HostArray::from_vector<float>({2, 4}, {1000, 1000, 999, -1000, -INFINITY, -INFINITY, -INFINITY, -INFINITY});
  const std::vector<double> got =
      run([](const std::vector<Value>& in) { return std::vector<Value>{nn::logsumexp(in[0], -1)}; }, {&big}, {P()});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_NEAR(got[0], 1000 + std::log(2 + std::exp(-1.0)), 1e-3);
  EXPECT_EQ(got[1], -INFINITY);
}

TEST_F(NnTest, CrossEntropyOnIntegerLabelsAndOneHot) {
  ASSERT_NE(client_, nullptr);
  const HostArray logits = random({kRows, kCols});
  std::vector<int32_t> labels(kRows);
  for (int64_t r = 0; r < kRows; ++r) labels[r] = static_cast<int32_t>((r * 5 + 3) % kCols);
  const HostArray label_array = HostArray::from_vector<int32_t>({kRows}, labels);
  const std::vector<double> logp = softmax_rows(as_doubles(logits), true);
  std::vector<double> want(kRows);
  for (int64_t r = 0; r < kRows; ++r) want[r] = -logp[r * kCols + labels[r]];
  expect_near(run([](const std::vector<Value>& in) { return std::vector<Value>{nn::cross_entropy(in[0], in[1])}; },
                  {&logits, &label_array}, {P("data", "model"), P("data")}),
              want);
  // one_hot: a label outside [0, classes) is a row of zeros (jax.nn.one_hot).
  const HostArray odd = HostArray::from_vector<int32_t>({4}, {0, 3, -1, 4});
  const std::vector<double> hot =
      run([](const std::vector<Value>& in) { return std::vector<Value>{nn::one_hot(in[0], 4)}; }, {&odd}, {P()});
  EXPECT_EQ(hot, (std::vector<double>{1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0}));
}

TEST_F(NnTest, LayerAndRmsNormOverTheLastAxis) {
  ASSERT_NE(client_, nullptr);
  const HostArray x = random({kRows, kCols});
  const HostArray scale = random({kCols}, 0.5, 1.5), bias = random({kCols});
  const std::vector<double> xs = as_doubles(x), ss = as_doubles(scale), bs = as_doubles(bias);
  std::vector<double> ln(xs.size()), rms(xs.size());
  for (int64_t r = 0; r < kRows; ++r) {
    double mean = 0, var = 0, sq = 0;
    for (int64_t c = 0; c < kCols; ++c) mean += xs[r * kCols + c] / kCols;
    for (int64_t c = 0; c < kCols; ++c) {
      const double v = xs[r * kCols + c];
      var += (v - mean) * (v - mean) / kCols;
      sq += v * v / kCols;
    }
    for (int64_t c = 0; c < kCols; ++c) {
      const double v = xs[r * kCols + c];
      ln[r * kCols + c] = (v - mean) / std::sqrt(var + 1e-6) * ss[c] + bs[c];
      rms[r * kCols + c] = v / std::sqrt(sq + 1e-6) * ss[c];
    }
  }
  expect_near(run([](const std::vector<Value>& in) { return std::vector<Value>{nn::layer_norm(in[0], in[1], in[2])}; },
                  {&x, &scale, &bias}, {P("data", "model"), P("model"), P()}),
              ln);
  expect_near(run([](const std::vector<Value>& in) { return std::vector<Value>{nn::rms_norm(in[0], in[1])}; },
                  {&x, &scale}, {P("data", None), P()}),
              rms);
}

// Causal multi-head attention, (B, T, N, H) = (4, 4, 2, 8), heads split over 'model' and the
// batch over 'data'; and an explicit mask that keeps nothing in one row (uniform weights).
TEST_F(NnTest, DotProductAttentionCausalAndMasked) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t B = 4, T = 4, N = 2, H = 8;
  const HostArray q = random({B, T, N, H}), k = random({B, T, N, H}), v = random({B, T, N, H});
  const std::vector<double> qs = as_doubles(q), ks = as_doubles(k), vs = as_doubles(v);
  auto at = [](int64_t b, int64_t t, int64_t n, int64_t h) { return ((b * T + t) * N + n) * H + h; };
  auto reference = [&](const std::function<bool(int64_t, int64_t, int64_t, int64_t)>& keep) {
    std::vector<double> out(qs.size());
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t t = 0; t < T; ++t) {
          std::vector<double> w(T);
          double m = -INFINITY, s = 0;
          for (int64_t u = 0; u < T; ++u) {
            double dot = 0;
            for (int64_t h = 0; h < H; ++h) dot += qs[at(b, t, n, h)] * ks[at(b, u, n, h)];
            w[u] = keep(b, n, t, u) ? dot / std::sqrt(static_cast<double>(H)) : std::numeric_limits<float>::lowest();
            m = std::max(m, w[u]);
          }
          for (int64_t u = 0; u < T; ++u) s += (w[u] = std::exp(w[u] - m));
          for (int64_t h = 0; h < H; ++h) {
            double acc = 0;
            for (int64_t u = 0; u < T; ++u) acc += w[u] / s * vs[at(b, u, n, h)];
            out[at(b, t, n, h)] = acc;
          }
        }
      }
    }
    return out;
  };
  const std::vector<PartitionSpec> specs = {P("data", None, "model"), P("data", None, "model"),
                                            P("data", None, "model")};
  expect_near(run(
                  [](const std::vector<Value>& in) {
                    return std::vector<Value>{nn::dot_product_attention(in[0], in[1], in[2], std::nullopt, true)};
                  },
                  {&q, &k, &v}, specs),
              reference([](int64_t, int64_t, int64_t t, int64_t u) { return u <= t; }));
  // Mask (B, N, T, S): keep s != t, and nothing at all in row t = 0 of batch 1, head 0.
  std::vector<bool> mask(B * N * T * T);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t u = 0; u < T; ++u) {
          mask[((b * N + n) * T + t) * T + u] = u != t && !(b == 1 && n == 0 && t == 0);
        }
      }
    }
  }
  const HostArray mask_array = HostArray::from_vector<bool>({B, N, T, T}, mask);
  expect_near(
      run(
          [](const std::vector<Value>& in) {
            return std::vector<Value>{nn::dot_product_attention(in[0], in[1], in[2], in[3])};
          },
          {&q, &k, &v, &mask_array}, {specs[0], specs[1], specs[2], P("data", "model")}),
      reference([&](int64_t b, int64_t n, int64_t t, int64_t u) { return mask[((b * N + n) * T + t) * T + u]; }));
}

}  // namespace
}  // namespace tessera

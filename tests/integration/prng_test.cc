// tessera::random on Client::local(8): keys, split, fold_in, bits and uniform against the
// values JAX documents or its tests assert for given keys (each cited where it is used), and
// every sampler sharded on the (8), (4, 2) and (2, 4) meshes against the unsharded result
// (the host reference of tests/support/), bit for bit, with the compiler's accounting showing
// that nothing moves.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tessera/random.h"
#include "tessera/tessera.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

// Threefry-2x32, written again from Salmon et al. (SC'11) and Random123's threefry.h (20
// rounds, rotations R_32x2 = 13 15 26 6 17 29 16 24, key parity 0x1BD11BDA), independent of
// the kernel's.
std::pair<uint32_t, uint32_t> reference_threefry(uint32_t k0, uint32_t k1, uint64_t counter) {
  const uint32_t rotation[8] = {13, 15, 26, 6, 17, 29, 16, 24};
  const uint32_t key[3] = {k0, k1, 0x1BD11BDAu ^ k0 ^ k1};
  uint32_t x[2] = {static_cast<uint32_t>(counter >> 32) + key[0], static_cast<uint32_t>(counter) + key[1]};
  for (uint32_t round = 0; round < 20; ++round) {
    x[0] += x[1];
    const uint32_t r = rotation[round % 8];
    x[1] = ((x[1] << r) | (x[1] >> (32 - r))) ^ x[0];
    if (round % 4 == 3) {  // key injection s = round / 4 + 1
      const uint32_t s = round / 4 + 1;
      x[0] += key[s % 3];
      x[1] += key[(s + 1) % 3] + s;
    }
  }
  return {x[0], x[1]};
}

// uniform's float32 for 32 random bits in [lo, lo + span), computed in float as JAX does.
float reference_uniform(uint32_t bits, float lo, float span) {
  const float unit = std::ldexp(static_cast<float>(bits >> 9), -23);
  return std::max(lo, unit * span + lo);
}

// Whether `got` prints as `digits` in JAX: numpy prints a float32 with its shortest round-trip
// digits, up to 8 after the point (its default precision), rounding past that. So a value
// shown with fewer than 8 decimals is that float exactly; one with 8 is within half a unit of
// the 8th.
::testing::AssertionResult prints_as(float got, const std::string& digits) {
  const float shown = std::strtof(digits.c_str(), nullptr);
  const size_t decimals = digits.size() - digits.find('.') - 1;
  const bool ok = decimals < 8 ? got == shown : std::abs(static_cast<double>(got) - std::stod(digits)) <= 5e-9;
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << absl::StrFormat("%.9g", got) << ", JAX shows " << digits;
}

std::vector<uint32_t> u32(const HostArray& a) { return {a.values<uint32_t>().begin(), a.values<uint32_t>().end()}; }

// HostArrays are move-only: an initializer list cannot hold them.
template <typename... A>
std::vector<HostArray> arrays(A... a) {
  std::vector<HostArray> out;
  (out.push_back(std::move(a)), ...);
  return out;
}

class PrngTest : public MeshesSuite {
 protected:
  // f on `inputs` (replicated on the (4, 2) mesh), every output fetched (and equal to the host's).
  std::vector<HostArray> run(const TracedFunction& f, const std::vector<HostArray>& inputs) {
    std::vector<const HostArray*> in;
    for (const HostArray& h : inputs) in.push_back(&h);
    absl::StatusOr<JitCheck> r = run_against_host(*client_, meshes_[1], f, in, std::vector<PartitionSpec>(in.size()));
    EXPECT_TRUE(r.ok()) << r.status();
    if (!r.ok()) return {};
    for (size_t o = 0; o < r->got.size(); ++o) EXPECT_TRUE(results_match(r->got[o], r->want[o], 0.0)) << o;
    return std::move(r->got);
  }
};

TEST_F(PrngTest, KeysSplitFoldInAndUniformMatchJax) {
  ASSERT_NE(client_, nullptr);
  const TracedFunction f = [](const std::vector<Value>& in) {
    const Value k0 = random::key(0), k72 = random::key(72);
    return std::vector<Value>{
        k0,                                                     // 0
        random::key(-3),                                        // 1
        random::key(in[0]),                                     // 2: int32 -2
        random::key(in[1]),                                     // 3: int64 -3
        random::fold_in(k0, 4),                                 // 4
        random::uniform(k0, {3}),                               // 5
        random::uniform(k0),                                    // 6
        random::uniform(random::key_at(random::split(k0), 1)),  // 7
        random::split(k72, 3),                                  // 8
        random::fold_in(k72, 0),                                // 9
        random::fold_in(k72, in[2]),                            // 10: a traced 1
        random::fold_in(k72, 2),                                // 11
        random::bits(random::key(1701), {3}),                   // 12
    };
  };
  const std::vector<HostArray> out =
      run(f, arrays(HostArray::from_vector<int32_t>({}, {-2}), HostArray::from_vector<int64_t>({}, {-3}),
                    HostArray::from_vector<int32_t>({}, {1})));
  ASSERT_EQ(out.size(), 13u);
  // jax tests/random_test.py test_prng_seeds_and_keys: seed 0 -> [0, 0]; np.int32(-2) ->
  // [0, 4294967294]; np.int64(-3) -> [4294967295, 4294967293] (with jax_enable_x64, where an
  // int64 seed stays 64 bits, as every int64 seed here does).
  EXPECT_EQ(u32(out[0]), (std::vector<uint32_t>{0, 0}));
  EXPECT_EQ(u32(out[1]), (std::vector<uint32_t>{4294967295u, 4294967293u}));
  EXPECT_EQ(u32(out[2]), (std::vector<uint32_t>{0, 4294967294u}));
  EXPECT_EQ(u32(out[3]), (std::vector<uint32_t>{4294967295u, 4294967293u}));
  // testPRNGValues: key_data(fold_in(PRNGKey(0), 4)) == [2285895361, 433833334].
  EXPECT_EQ(u32(out[4]), (std::vector<uint32_t>{2285895361u, 433833334u}));
  // docs/jep/9263-typed-keys.md: jax.random.uniform(key(0), shape=(3,)) is
  // Array([0.947667, 0.9785799, 0.33229148]); jax/random.py's module docstring:
  // uniform(key(0)) is 0.947667 and, after `key, subkey = split(key)`, uniform(subkey) is
  // 0.00729382. Both doctested with the partitionable layout, so these are exact float32s.
  ASSERT_EQ(out[5].shape(), (Shape{3}));
  EXPECT_TRUE(prints_as(out[5].values<float>()[0], "0.947667"));
  EXPECT_TRUE(prints_as(out[5].values<float>()[1], "0.9785799"));
  EXPECT_TRUE(prints_as(out[5].values<float>()[2], "0.33229148"));
  ASSERT_EQ(out[6].shape(), Shape{});
  EXPECT_TRUE(prints_as(out[6].values<float>()[0], "0.947667"));
  EXPECT_TRUE(prints_as(out[7].values<float>()[0], "0.00729382"));
  // test_threefry_split_fold_in_symmetry: fold_in(key(72), i) == split(key(72), 3)[i].
  const std::vector<uint32_t> split = u32(out[8]);
  ASSERT_EQ(out[8].shape(), (Shape{3, 2}));
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(u32(out[9 + i]), (std::vector<uint32_t>{split[2 * i], split[2 * i + 1]})) << "fold_in " << i;
  }
  // bits: the xor of the two words at counter i (JAX's _threefry_random_bits_partitionable).
  for (uint64_t i = 0; i < 3; ++i) {
    const auto [w0, w1] = reference_threefry(0, 1701, i);
    EXPECT_EQ(out[12].values<uint32_t>()[i], w0 ^ w1) << i;
  }
}

TEST_F(PrngTest, UniformTakesMinvalMaxvalAndFloat64) {
  ASSERT_NE(client_, nullptr);
  const TracedFunction f = [](const std::vector<Value>& in) {
    return std::vector<Value>{random::bits(in[0], {4, 64}), random::uniform(in[0], {4, 64}, DType::kF32, -2.5, 7.0),
                              random::uniform(in[0], {4, 64}, DType::kF64), random::split(in[0], {4, 64})};
  };
  const std::vector<HostArray> out = run(f, arrays(HostArray::from_vector<uint32_t>({2}, {0x12345678u, 0x9abcdef0u})));
  ASSERT_EQ(out.size(), 4u);
  const float lo = -2.5f, span = 7.0f - lo;
  for (int64_t i = 0; i < 256; ++i) {
    SCOPED_TRACE(i);
    const auto [w0, w1] = reference_threefry(0x12345678u, 0x9abcdef0u, static_cast<uint64_t>(i));
    ASSERT_EQ(out[0].values<uint32_t>()[i], w0 ^ w1);
    const float u = out[1].values<float>()[i];
    ASSERT_EQ(u, reference_uniform(w0 ^ w1, lo, span));
    ASSERT_GE(u, -2.5f);
    ASSERT_LT(u, 7.0f);
    // float64: the top 52 of the 64 bits (w0 << 32) | w1, JAX's with jax_enable_x64.
    const uint64_t bits64 = (uint64_t{w0} << 32) | w1;
    ASSERT_EQ(out[2].values<double>()[i], std::ldexp(static_cast<double>(bits64 >> 12), -52));
    ASSERT_EQ(out[3].values<uint32_t>()[2 * i], w0);
    ASSERT_EQ(out[3].values<uint32_t>()[2 * i + 1], w1);
  }
}

// Every sampler under every layout of a (16, 8) result on each mesh equals the unsharded
// result bit for bit, and the program has no collective (the compiler's accounting:
// categorical's logits are replicated, so its argmax is local too).
TEST_F(PrngTest, ShardedSamplesEqualTheUnshardedResultAndMoveNothing) {
  ASSERT_NE(client_, nullptr);
  const TracedFunction f = [](const std::vector<Value>& in) {
    return std::vector<Value>{random::bits(in[0], {16, 8}),
                              random::uniform(in[0], {16, 8}),
                              random::uniform(in[0], {16, 8}, DType::kF64, -1.0, 1.0),
                              random::normal(in[0], {16, 8}),
                              random::truncated_normal(in[0], -0.5, 2.0, {16, 8}),
                              random::bernoulli(in[0], 0.3, {16, 8}),
                              random::categorical(in[0], in[1])};
  };
  const HostArray key = HostArray::from_vector<uint32_t>({2}, {0, 42});
  std::mt19937 rng(5);
  const HostArray logits = random_array(DType::kF32, {16, 8, 4}, Domain::kSigned, rng);
  for (size_t m = 0; m < meshes_.size(); ++m) {
    const std::vector<std::string>& axes = test_meshes()[m].axes;
    std::vector<PartitionSpec> layouts = {P(axes[0]), P(None, axes[0]), P()};
    if (axes.size() == 2) {
      const std::string &x = axes[0], &y = axes[1];
      layouts = {P(x),          P(None, y),          P(x, y),    P(y, x), P(Axes{x, y}),
                 P(Axes{y, x}), P(None, Axes{x, y}), P(y, None), P()};
    }
    for (const PartitionSpec& spec : layouts) {
      SCOPED_TRACE(std::string(test_meshes()[m].name) + " " + spec.to_string());
      JitOptions options;
      options.out_shardings = std::vector<std::optional<PartitionSpec>>(7, spec);
      absl::StatusOr<JitCheck> r = run_against_host(*client_, meshes_[m], f, {&key, &logits}, {P(), P()}, options);
      ASSERT_TRUE(r.ok()) << r.status();
      for (size_t o = 0; o < r->got.size(); ++o) {
        EXPECT_TRUE(results_match(r->got[o], r->want[o], 0.0)) << "output " << o;
        EXPECT_TRUE(NamedSharding(meshes_[m], r->out_specs[o]).is_equivalent_to(NamedSharding(meshes_[m], spec), 2))
            << "output " << o << " is " << r->out_specs[o].to_string();
      }
      EXPECT_NE(r->plan_text.find(": 0 collectives, 0 bytes received per device"), std::string::npos) << r->plan_text;
    }
  }
}

// The samplers built on uniform, on 2^16 samples of a fixed key: each value as JAX's formula
// gives it from the bits (normal within float rounding of a double-precision inverse error
// function, the others exactly), and the sample moments within 5 standard errors of the
// distribution's (a bound that a fixed key either meets or not: the test cannot flake).
TEST_F(PrngTest, NormalTruncatedNormalBernoulliAndCategoricalFollowJaxsFormulas) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kRows = 256, kCols = 256, kN = kRows * kCols;
  const TracedFunction f = [](const std::vector<Value>& in) {
    const Value logits = log(full({kRows, 3}, 1.0) * in[1]);  // each row log(0.1, 0.2, 0.7)
    return std::vector<Value>{random::bits(in[0], {kRows, kCols}), random::normal(in[0], {kRows, kCols}),
                              random::truncated_normal(in[0], 0.0, 2.0, {kRows, kCols}),
                              random::bernoulli(in[0], 0.3, {kRows, kCols}), random::categorical(in[0], logits)};
  };
  const std::vector<HostArray> out = run(
      f, arrays(HostArray::from_vector<uint32_t>({2}, {0, 7}), HostArray::from_vector<float>({3}, {0.1f, 0.2f, 0.7f})));
  ASSERT_EQ(out.size(), 5u);
  // Double-precision erfinv by Newton's method on std::erf, independent of the kernel's.
  auto erfinv = [](double x) {
    double y = 0;
    for (int i = 0; i < 100; ++i) y -= (std::erf(y) - x) / (1.1283791670955126 * std::exp(-y * y));
    return y;
  };
  const float lo = std::nextafter(-1.0f, 0.0f), span = 1.0f - lo;
  double normal_sum = 0, normal_sq = 0, trunc_sum = 0, ones = 0;
  for (int64_t i = 0; i < kN; ++i) {
    SCOPED_TRACE(i);
    const uint32_t b = out[0].values<uint32_t>()[i];
    // normal: sqrt(2) * erf_inv(uniform in [nextafter(-1, 0), 1)) (jax _normal_real).
    const double z = out[1].values<float>()[i];
    // XLA's float32 erf_inv (Giles' single-precision polynomial, so JAX's too) is within a few
    // 1e-6 relative in the far tails (|z| > 3).
    ASSERT_NEAR(z, std::sqrt(2.0) * erfinv(reference_uniform(b, lo, span)), 1e-5 * std::max(1.0, std::abs(z)));
    normal_sum += z;
    normal_sq += z * z;
    const float t = out[2].values<float>()[i];
    ASSERT_GT(t, 0.0f);
    ASSERT_LT(t, 2.0f);
    trunc_sum += t;
    // bernoulli: uniform < p, exactly.
    ASSERT_EQ(out[3].values<bool>()[i], reference_uniform(b, 0.0f, 1.0f) < 0.3f);
    ones += out[3].values<bool>()[i] ? 1 : 0;
  }
  const double n = static_cast<double>(kN);
  EXPECT_NEAR(normal_sum / n, 0.0, 5 / std::sqrt(n));
  EXPECT_NEAR(normal_sq / n - (normal_sum / n) * (normal_sum / n), 1.0, 5 * std::sqrt(2 / n));
  // A standard normal truncated to (0, 2): mean (phi(0) - phi(2)) / (Phi(2) - Phi(0)), standard
  // deviation below 0.6.
  const double phi0 = 1 / std::sqrt(2 * M_PI), phi2 = std::exp(-2.0) / std::sqrt(2 * M_PI);
  EXPECT_NEAR(trunc_sum / n, (phi0 - phi2) / (0.5 * std::erf(2 / std::sqrt(2.0))), 5 * 0.6 / std::sqrt(n));
  EXPECT_NEAR(ones / n, 0.3, 5 * std::sqrt(0.3 * 0.7 / n));
  // categorical over 256 rows of (0.1, 0.2, 0.7): counts within 5 standard errors.
  ASSERT_EQ(out[4].shape(), (Shape{kRows}));
  double counts[3] = {0, 0, 0};
  for (int64_t r = 0; r < kRows; ++r) {
    const int32_t c = out[4].values<int32_t>()[r];
    ASSERT_GE(c, 0);
    ASSERT_LT(c, 3);
    counts[c] += 1;
  }
  const double p[3] = {0.1, 0.2, 0.7};
  for (int c = 0; c < 3; ++c) EXPECT_NEAR(counts[c] / kRows, p[c], 5 * std::sqrt(p[c] * (1 - p[c]) / kRows)) << c;
}

}  // namespace
}  // namespace tessera

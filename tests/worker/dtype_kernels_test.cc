// The kernels on bfloat16, float16, int8, uint8 and int16 (issue #15 item 6), against host
// references written here: a half op is the float32 op on the widened operands, rounded once to
// the half (XLA:CPU's float normalization; ml_dtypes' arithmetic on numpy arrays); a half
// reduction or dot product accumulates in float32 and rounds once; small integers wrap around as
// numpy's and lax's do.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/float16.h"
#include "core/graph.h"
#include "core/host_array.h"
#include "gtest/gtest.h"
#include "tests/support/halves.h"
#include "worker/kernels/kernels.h"

namespace tessera {
namespace {

template <typename H>
std::vector<uint16_t> bits(const HostArray& a) {
  std::vector<uint16_t> out;
  for (H h : a.values<H>()) out.push_back(h.bits());
  return out;
}

HostArray run(const Graph& g, int id, const std::vector<const HostArray*>& in) {
  absl::StatusOr<HostArray> out = run_kernel(g.node(id), in);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *std::move(out) : HostArray();
}

template <typename H>
class HalfKernels : public ::testing::Test {};
using HalfTypes = ::testing::Types<BFloat16, Float16>;
TYPED_TEST_SUITE(HalfKernels, HalfTypes);

TYPED_TEST(HalfKernels, ElementwiseOpsRoundTheFloat32Result) {
  using H = TypeParam;
  const DType d = dtype_of<H>();
  std::mt19937 rng(7);
  const HostArray x = halves<H>({64}, uniform_floats(64, 0.25f, 3.0f, rng));
  const HostArray y = halves<H>({64}, uniform_floats(64, -3.0f, 3.0f, rng));
  const std::vector<float> xs = floats<H>(x), ys = floats<H>(y);
  struct Unary {
    Op op;
    std::function<float(float)> f;
  };
  for (const Unary& u : std::vector<Unary>{{Op::kExp, [](float v) { return std::exp(v); }},
                                           {Op::kLog, [](float v) { return std::log(v); }},
                                           {Op::kTanh, [](float v) { return std::tanh(v); }},
                                           {Op::kSqrt, [](float v) { return std::sqrt(v); }},
                                           {Op::kNeg, [](float v) { return -v; }}}) {
    Graph g;
    const int p = g.add_parameter(d, {64});
    const int id = *g.add_unary(u.op, p);
    ASSERT_EQ(g.node(id).dtype, d);
    const HostArray out = run(g, id, {&x});
    for (int i = 0; i < 64; ++i) {
      EXPECT_EQ(out.values<H>()[i].bits(), H(u.f(xs[i])).bits()) << op_name(u.op) << " of " << xs[i];
    }
  }
  struct Binary {
    Op op;
    std::function<float(float, float)> f;
  };
  for (const Binary& b : std::vector<Binary>{{Op::kAdd, [](float p, float q) { return p + q; }},
                                             {Op::kSub, [](float p, float q) { return p - q; }},
                                             {Op::kMul, [](float p, float q) { return p * q; }},
                                             {Op::kDiv, [](float p, float q) { return p / q; }},
                                             {Op::kPow, [](float p, float q) { return std::pow(p, q); }},
                                             {Op::kMax, [](float p, float q) { return std::max(p, q); }}}) {
    Graph g;
    const int p = g.add_parameter(d, {64}), q = g.add_parameter(d, {64});
    const int id = *g.add_binary(b.op, p, q);
    const HostArray out = run(g, id, {&x, &y});
    for (int i = 0; i < 64; ++i) {
      EXPECT_EQ(out.values<H>()[i].bits(), H(b.f(xs[i], ys[i])).bits())
          << op_name(b.op) << " of " << xs[i] << ", " << ys[i];
    }
  }
  // One add whose float32 sum lies exactly on a tie: 1 + 2^-8 (bfloat16) or 1 + 2^-11 (float16)
  // rounds to even, 1.
  const float tie = std::is_same_v<H, BFloat16> ? 0x1p-8f : 0x1p-11f;
  Graph g;
  const int p = g.add_parameter(d, {1}), q = g.add_parameter(d, {1});
  const int id = *g.add_binary(Op::kAdd, p, q);
  const HostArray one = halves<H>({1}, {1.0f}), small = halves<H>({1}, {tie});
  EXPECT_EQ(static_cast<float>(run(g, id, {&one, &small}).values<H>()[0]), 1.0f);
}

TYPED_TEST(HalfKernels, InPlaceWritesTheRoundedResult) {
  using H = TypeParam;
  Graph g;
  const int p = g.add_parameter(dtype_of<H>(), {3});
  const int id = *g.add_binary(Op::kMul, p, p);
  HostArray x = halves<H>({3}, {1.5f, -2.0f, 3.0f});
  ASSERT_TRUE(run_kernel_in_place(g.node(id), {&x, &x}, 0).ok());
  EXPECT_EQ(floats<H>(x), (std::vector<float>{2.25f, 4.0f, 9.0f}));
}

TYPED_TEST(HalfKernels, ComparisonsGiveBool) {
  using H = TypeParam;
  Graph g;
  const int p = g.add_parameter(dtype_of<H>(), {4}), q = g.add_parameter(dtype_of<H>(), {4});
  const int id = *g.add_binary(Op::kLt, p, q);
  ASSERT_EQ(g.node(id).dtype, DType::kBool);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const HostArray x = halves<H>({4}, {1.0f, 2.0f, nan, -0.0f}), y = halves<H>({4}, {2.0f, 2.0f, 1.0f, 0.0f});
  const HostArray out = run(g, id, {&x, &y});
  EXPECT_EQ(std::vector<bool>(out.values<bool>().begin(), out.values<bool>().end()),
            (std::vector<bool>{true, false, false, false}));
}

// A sum of 1000 ones is 1000 when accumulated in float32; a bfloat16 accumulator would stop at
// 256 (256 + 1 rounds back to 256), a float16 one at 2048 (not reached) — so the bfloat16 case
// shows the accumulation type. Random sums: the float32 sum rounded once, within one unit of
// the half's last place (the kernel adds in another order and rounds through float32).
TYPED_TEST(HalfKernels, ReductionsAccumulateInFloat32) {
  using H = TypeParam;
  const DType d = dtype_of<H>();
  {
    Graph g;
    const int p = g.add_parameter(d, {1000});
    const int id = *g.add_reduce(Op::kReduceSum, p, {0});
    const HostArray ones = HostArray::ones(d, {1000});
    EXPECT_EQ(static_cast<float>(run(g, id, {&ones}).values<H>()[0]), 1000.0f);
  }
  std::mt19937 rng(3);
  const HostArray x = halves<H>({8, 300}, uniform_floats(2400, -1.0f, 1.0f, rng));
  const std::vector<float> xs = floats<H>(x);
  Graph g;
  const int p = g.add_parameter(d, {8, 300});
  const int sum = *g.add_reduce(Op::kReduceSum, p, {1});
  const int max = *g.add_reduce(Op::kReduceMax, p, {1});
  const HostArray s = run(g, sum, {&x}), m = run(g, max, {&x});
  for (int r = 0; r < 8; ++r) {
    float want = 0, want_max = -std::numeric_limits<float>::infinity();
    for (int c = 0; c < 300; ++c) {
      want += xs[r * 300 + c];
      want_max = std::max(want_max, xs[r * 300 + c]);
    }
    const float got = static_cast<float>(s.values<H>()[r]);
    const float ulp = std::ldexp(1.0f, std::ilogb(want) - (std::is_same_v<H, BFloat16> ? 7 : 10));
    EXPECT_LE(std::abs(got - static_cast<float>(H(want))), ulp) << "row " << r << ": float32 sum " << want;
    EXPECT_EQ(static_cast<float>(m.values<H>()[r]), want_max);
  }
  // argmax ranks the widened values.
  const int arg = *g.add_argmax(p, 1, DType::kI32);
  const HostArray a = run(g, arg, {&x});
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(xs[r * 300 + a.values<int32_t>()[r]], static_cast<float>(m.values<H>()[r])) << r;
  }
}

TYPED_TEST(HalfKernels, DotAccumulatesInFloat32AndRoundsOnce) {
  using H = TypeParam;
  const DType d = dtype_of<H>();
  std::mt19937 rng(11);
  const int m = 5, k = 300, n = 3;
  const HostArray a = halves<H>({m, k}, uniform_floats(m * k, -1.0f, 1.0f, rng));
  const HostArray b = halves<H>({k, n}, uniform_floats(k * n, -1.0f, 1.0f, rng));
  const std::vector<float> as = floats<H>(a), bs = floats<H>(b);
  Graph g;
  const int p = g.add_parameter(d, {m, k}), q = g.add_parameter(d, {k, n});
  const int id = *g.add_dot_general(p, q, DotDims{{}, {}, {1}, {0}});
  ASSERT_EQ(g.node(id).dtype, d);
  const HostArray c = run(g, id, {&a, &b});
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double want = 0, scale = 0;
      for (int p2 = 0; p2 < k; ++p2) {
        want += static_cast<double>(as[i * k + p2]) * bs[p2 * n + j];
        scale += std::abs(static_cast<double>(as[i * k + p2]) * bs[p2 * n + j]);
      }
      // The float32 result is within k * 2^-24 * scale of the exact one; rounding it to the half
      // then moves it by at most half a unit of the half's last place.
      const float got = static_cast<float>(c.values<H>()[i * n + j]);
      const double half_ulp = std::ldexp(1.0, std::ilogb(want) - (std::is_same_v<H, BFloat16> ? 8 : 11));
      EXPECT_LE(std::abs(got - want), half_ulp + k * 0x1p-24 * scale + 1e-30) << i << "," << j;
    }
  }
  // 1000 products of ones: 1000 in float32, 256 in a bfloat16 accumulator.
  Graph g2;
  const int u = g2.add_parameter(d, {1, 1000}), v = g2.add_parameter(d, {1000, 1});
  const int dot = *g2.add_dot_general(u, v, DotDims{{}, {}, {1}, {0}});
  const HostArray ones_u = HostArray::ones(d, {1, 1000}), ones_v = HostArray::ones(d, {1000, 1});
  EXPECT_EQ(static_cast<float>(run(g2, dot, {&ones_u, &ones_v}).values<H>()[0]), 1000.0f);
}

TYPED_TEST(HalfKernels, LayoutAndSelectMoveTheBits) {
  using H = TypeParam;
  const DType d = dtype_of<H>();
  const HostArray x = halves<H>({2, 3}, {1, 2, 3, 4, 5, 6});
  Graph g;
  const int p = g.add_parameter(d, {2, 3});
  const int t = *g.add_transpose(p, {1, 0});
  const int s = *g.add_slice(p, {0, 1}, {2, 3});
  const int c = *g.add_constant(d, {2}, 0.1);
  EXPECT_EQ(floats<H>(run(g, t, {&x})), (std::vector<float>{1, 4, 2, 5, 3, 6}));
  EXPECT_EQ(floats<H>(run(g, s, {&x})), (std::vector<float>{2, 3, 5, 6}));
  EXPECT_EQ(bits<H>(run(g, c, {})), (std::vector<uint16_t>{H(0.1).bits(), H(0.1).bits()}));
  const int pred = g.add_parameter(DType::kBool, {2, 3}), other = g.add_parameter(d, {2, 3});
  const int sel = *g.add_select(pred, p, other);
  const HostArray mask = HostArray::from_vector<bool>({2, 3}, {true, false, true, false, true, false});
  const HostArray y = halves<H>({2, 3}, {-1, -2, -3, -4, -5, -6});
  EXPECT_EQ(floats<H>(run(g, sel, {&mask, &x, &y})), (std::vector<float>{1, -2, 3, -4, 5, -6}));
}

// convert_element_type between every pair of dtypes, on values every dtype holds exactly (bool:
// nonzero is true), then the cases that round, saturate or wrap.
TEST(DTypeKernels, ConvertBetweenEveryPair) {
  const std::vector<int> values = {0, 1, 2, 3, 5, 0};
  for (DType from : kAllDTypes) {
    for (DType to : kAllDTypes) {
      Graph g;
      const int p = g.add_parameter(from, {6});
      const int id = *g.add_convert(p, to);
      // x: the values, written through a convert from int32 (checked by the round trip below).
      Graph gi;
      const int pi = gi.add_parameter(DType::kI32, {6});
      const HostArray ints = HostArray::from_vector<int32_t>({6}, {0, 1, 2, 3, 5, 0});
      const HostArray xin = run(gi, *gi.add_convert(pi, from), {&ints});
      const HostArray out = run(g, id, {&xin});
      ASSERT_EQ(out.dtype(), to);
      for (int i = 0; i < 6; ++i) {
        const double want = from == DType::kBool || to == DType::kBool ? (values[i] != 0) : values[i];
        EXPECT_EQ(out.element_as_double(i), want) << dtype_name(from) << " -> " << dtype_name(to) << " at " << i;
      }
    }
  }
}

TEST(DTypeKernels, ConvertRoundsSaturatesAndWraps) {
  auto convert = [](const HostArray& x, DType to) {
    Graph g;
    const int p = g.add_parameter(x.dtype(), x.shape());
    return run(g, *g.add_convert(p, to), {&x});
  };
  // float32 -> halves: ties to even (1 + 2^-8 is a bfloat16 tie, exact in float16; 1 + 3 * 2^-11
  // a float16 tie), overflow to inf, NaN kept.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const HostArray f =
      HostArray::from_vector<float>({5}, {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-11f, 70000.0f, nan, 0x1p-24f});
  EXPECT_EQ(bits<BFloat16>(convert(f, DType::kBF16)), (std::vector<uint16_t>{0x3F80, 0x3F80, 0x4789, 0x7FC0, 0x3380}));
  EXPECT_EQ(bits<Float16>(convert(f, DType::kF16)), (std::vector<uint16_t>{0x3C04, 0x3C02, 0x7C00, 0x7E00, 0x0001}));
  // float64 -> float16 rounds once (not through a rounded float32).
  const HostArray d = HostArray::from_vector<double>({1}, {1.0 + 0x1p-11 + 0x1p-40});
  EXPECT_EQ(bits<Float16>(convert(d, DType::kF16)), (std::vector<uint16_t>{0x3C01}));
  // bfloat16 -> float16: 1e5 is beyond float16 (inf); 2^-20 is a float16 subnormal, exact.
  const HostArray b = halves<BFloat16>({2}, {1e5f, 0x1p-20f});
  EXPECT_EQ(floats<Float16>(convert(b, DType::kF16)),
            (std::vector<float>{std::numeric_limits<float>::infinity(), 0x1p-20f}));
  // Halves -> int8/uint8 truncate toward zero and saturate, NaN -> 0 (the kernels' rule for every
  // float-to-integer conversion, core/op.h).
  const HostArray h = halves<Float16>({5}, {300.0f, -300.0f, -1.5f, nan, 2.75f});
  const HostArray i8 = convert(h, DType::kI8), u8 = convert(h, DType::kU8);
  EXPECT_EQ(std::vector<int8_t>(i8.values<int8_t>().begin(), i8.values<int8_t>().end()),
            (std::vector<int8_t>{127, -128, -1, 0, 2}));
  EXPECT_EQ(std::vector<uint8_t>(u8.values<uint8_t>().begin(), u8.values<uint8_t>().end()),
            (std::vector<uint8_t>{255, 0, 0, 0, 2}));
  // Integer -> narrower integer wraps (numpy's astype, lax.convert_element_type).
  const HostArray n = HostArray::from_vector<int32_t>({4}, {300, -129, 255, -1});
  const HostArray n8 = convert(n, DType::kI8), nu8 = convert(n, DType::kU8);
  EXPECT_EQ(std::vector<int8_t>(n8.values<int8_t>().begin(), n8.values<int8_t>().end()),
            (std::vector<int8_t>{44, 127, -1, -1}));
  EXPECT_EQ(std::vector<uint8_t>(nu8.values<uint8_t>().begin(), nu8.values<uint8_t>().end()),
            (std::vector<uint8_t>{44, 127, 255, 255}));
}

// numpy's wrap-around on int8/uint8/int16 (np.int8(127) + np.int8(1) == -128, ...), which lax
// shares; division by zero and INT_MIN / -1 as XLA (core/op.h's run_kernel contract).
TEST(DTypeKernels, SmallIntegersWrapAround) {
  auto binary = [](Op op, const HostArray& x, const HostArray& y) {
    Graph g;
    const int p = g.add_parameter(x.dtype(), x.shape()), q = g.add_parameter(y.dtype(), y.shape());
    return run(g, *g.add_binary(op, p, q), {&x, &y});
  };
  auto i8 = [](std::vector<int8_t> v) { return HostArray::from_vector<int8_t>({static_cast<int64_t>(v.size())}, v); };
  auto u8 = [](std::vector<uint8_t> v) { return HostArray::from_vector<uint8_t>({static_cast<int64_t>(v.size())}, v); };
  auto values8 = [](const HostArray& a) {
    return std::vector<int8_t>(a.values<int8_t>().begin(), a.values<int8_t>().end());
  };
  auto valuesu8 = [](const HostArray& a) {
    return std::vector<uint8_t>(a.values<uint8_t>().begin(), a.values<uint8_t>().end());
  };
  EXPECT_EQ(values8(binary(Op::kAdd, i8({127, -128, 100}), i8({1, -1, 100}))), (std::vector<int8_t>{-128, 127, -56}));
  EXPECT_EQ(values8(binary(Op::kMul, i8({16, -128}), i8({16, -1}))), (std::vector<int8_t>{0, -128}));
  EXPECT_EQ(values8(binary(Op::kDiv, i8({-128, 7, -7}), i8({-1, 0, 2}))), (std::vector<int8_t>{-128, -1, -3}));
  EXPECT_EQ(values8(binary(Op::kShiftRightLogical, i8({-1, -128}), i8({1, 7}))), (std::vector<int8_t>{127, 1}));
  EXPECT_EQ(valuesu8(binary(Op::kSub, u8({0, 5}), u8({1, 10}))), (std::vector<uint8_t>{255, 251}));
  EXPECT_EQ(valuesu8(binary(Op::kMul, u8({200, 255}), u8({2, 255}))), (std::vector<uint8_t>{144, 1}));
  EXPECT_EQ(valuesu8(binary(Op::kPow, u8({3, 2}), u8({5, 8}))), (std::vector<uint8_t>{243, 0}));
  const HostArray s = binary(Op::kMul, HostArray::from_vector<int16_t>({2}, {300, -32768}),
                             HostArray::from_vector<int16_t>({2}, {300, -1}));
  EXPECT_EQ(std::vector<int16_t>(s.values<int16_t>().begin(), s.values<int16_t>().end()),
            (std::vector<int16_t>{24464, -32768}));  // 90000 mod 2^16; INT16_MIN * -1 wraps
  Graph g;
  const int p = g.add_parameter(DType::kI8, {3});
  const HostArray x = i8({-128, 5, 100});
  EXPECT_EQ(values8(run(g, *g.add_unary(Op::kNeg, p), {&x})), (std::vector<int8_t>{-128, -5, -100}));
  EXPECT_EQ(values8(run(g, *g.add_unary(Op::kAbs, p), {&x})), (std::vector<int8_t>{-128, 5, 100}));
  EXPECT_EQ(values8(run(g, *g.add_reduce(Op::kReduceSum, p, {0}), {&x})), (std::vector<int8_t>{-23}));  // -23 mod 2^8
  Graph gu;
  const int q = gu.add_parameter(DType::kU8, {3});
  const HostArray y = u8({200, 100, 7});
  EXPECT_EQ(valuesu8(run(gu, *gu.add_reduce(Op::kReduceSum, q, {0}), {&y})), (std::vector<uint8_t>{51}));  // 307 - 256
  EXPECT_EQ(valuesu8(run(gu, *gu.add_reduce(Op::kReduceMax, q, {0}), {&y})), (std::vector<uint8_t>{200}));
  const HostArray dot = [&] {
    Graph gd;
    const int l = gd.add_parameter(DType::kU8, {1, 3}), r = gd.add_parameter(DType::kU8, {3, 1});
    const HostArray lhs = HostArray::from_vector<uint8_t>({1, 3}, {200, 100, 7});
    const HostArray rhs = HostArray::from_vector<uint8_t>({3, 1}, {2, 3, 1});
    return run(gd, *gd.add_dot_general(l, r, DotDims{{}, {}, {1}, {0}}), {&lhs, &rhs});
  }();
  EXPECT_EQ(valuesu8(dot), (std::vector<uint8_t>{(400 + 300 + 7) % 256}));
}

}  // namespace
}  // namespace tessera

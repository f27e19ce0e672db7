// BFloat16 and Float16 (core/float16.h) bit for bit, and jnp.promote_types over every dtype.
#include "core/float16.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/host_array.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Known encodings (IEEE 754-2008 binary16; bfloat16 is float32's top half): 1.0, -2.0, the
// largest finite, the smallest normal and subnormal, +-inf.
TEST(Float16, KnownBitPatternsRoundTrip) {
  struct Case {
    float value;
    uint16_t bf16, f16;
  };
  const std::vector<Case> cases = {
      {1.0f, 0x3F80, 0x3C00},     {-2.0f, 0xC000, 0xC000},    {0.5f, 0x3F00, 0x3800},
      {0.0f, 0x0000, 0x0000},     {-0.0f, 0x8000, 0x8000},    {kInf, 0x7F80, 0x7C00},
      {-kInf, 0xFF80, 0xFC00},    {65504.0f, 0x4780, 0x7BFF},  // f16's largest finite
      {0x1p-14f, 0x3880, 0x0400},                              // f16's smallest normal
      {0x1p-24f, 0x3380, 0x0001},                              // f16's smallest subnormal
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.value);
    EXPECT_EQ(BFloat16(c.value).bits(), c.bf16);
    EXPECT_EQ(Float16(c.value).bits(), c.f16);
    EXPECT_EQ(static_cast<float>(Float16::from_bits(c.f16)), c.value);
    EXPECT_EQ(std::signbit(static_cast<float>(BFloat16::from_bits(c.bf16))), std::signbit(c.value));
  }
  EXPECT_EQ(static_cast<float>(BFloat16::from_bits(0x7F7F)), 0x1.FEp127f);     // bf16's largest finite
  EXPECT_EQ(static_cast<float>(Float16::from_bits(0x03FF)), 1023 * 0x1p-24f);  // largest subnormal
}

TEST(Float16, RoundsToNearestTiesToEven) {
  // bfloat16 keeps 8 significant bits: 1 + 2^-8 is the tie between 1 and 1 + 2^-7 (even: 1);
  // 1 + 3 * 2^-8 the tie between 1 + 2^-7 and 1 + 2^-6 (even: 1 + 2^-6); above a tie rounds up.
  EXPECT_EQ(BFloat16(1.0f + 0x1p-8f).bits(), 0x3F80);
  EXPECT_EQ(BFloat16(1.0f + 3 * 0x1p-8f).bits(), 0x3F82);
  EXPECT_EQ(BFloat16(1.0f + 0x1p-8f + 0x1p-20f).bits(), 0x3F81);
  // float16 keeps 11: 1 + 2^-11 is a tie (down to 1), 1 + 3 * 2^-11 (up to 1 + 2^-9).
  EXPECT_EQ(Float16(1.0f + 0x1p-11f).bits(), 0x3C00);
  EXPECT_EQ(Float16(1.0f + 3 * 0x1p-11f).bits(), 0x3C02);
  EXPECT_EQ(Float16(1.0f + 0x1p-11f + 0x1p-20f).bits(), 0x3C01);
  // Subnormal float16: 2^-25 is the tie between 0 and 2^-24 (even: 0); 3 * 2^-25 rounds to 2 * 2^-24.
  EXPECT_EQ(Float16(0x1p-25f).bits(), 0x0000);
  EXPECT_EQ(Float16(3 * 0x1p-25f).bits(), 0x0002);
  EXPECT_EQ(Float16(-0x1p-26f).bits(), 0x8000);  // underflows to -0
  // The rounding carries into the exponent: just below 2 rounds to 2.
  EXPECT_EQ(Float16(0x1.FFFp0f).bits(), 0x4000);
  EXPECT_EQ(BFloat16(0x1.FFp0f).bits(), 0x4000);
}

TEST(Float16, OverflowsToInfinityAndKeepsNaN) {
  // 65520 is the tie between 65504 and 2^16 (even: 2^16, beyond the range: inf).
  EXPECT_EQ(Float16(65519.0f).bits(), 0x7BFF);
  EXPECT_EQ(Float16(65520.0f).bits(), 0x7C00);
  EXPECT_EQ(Float16(-1e6f).bits(), 0xFC00);
  EXPECT_EQ(BFloat16(std::numeric_limits<float>::max()).bits(), 0x7F80);
  EXPECT_EQ(Float16(1e300).bits(), 0x7C00);  // from double
  EXPECT_EQ(BFloat16(1e300).bits(), 0x7F80);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(nan))));
  EXPECT_TRUE(std::isnan(static_cast<float>(Float16(nan))));
  EXPECT_TRUE(std::isnan(static_cast<float>(Float16(-nan))));
  EXPECT_TRUE(std::signbit(static_cast<float>(Float16(-nan))));
  // A signalling NaN whose payload lies only in the dropped bits stays a NaN, not inf.
  uint32_t snan_bits = 0x7F800001;
  float snan;
  std::memcpy(&snan, &snan_bits, sizeof snan);
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(snan))));
  EXPECT_TRUE(std::isnan(static_cast<float>(Float16(snan))));
}

TEST(Float16, DoublesAndIntegersRoundOnce) {
  // 1 + 2^-11 + 2^-40 lies above float16's tie: correctly rounded it is 1 + 2^-10; through a
  // float rounded to nearest (1 + 2^-11, the tie) it would be 1.
  EXPECT_EQ(Float16(1.0 + 0x1p-11 + 0x1p-40).bits(), 0x3C01);
  EXPECT_EQ(BFloat16(1.0 + 0x1p-8 + 0x1p-40).bits(), 0x3F81);
  EXPECT_EQ(Float16(1.0 + 0x1p-11).bits(), 0x3C00);  // the exact tie still goes to even
  EXPECT_EQ(Float16(int32_t{2049}).bits(), 0x6800);  // 2049 is the tie between 2048 and 2050: 2048
  EXPECT_EQ(Float16(int32_t{2051}).bits(), 0x6802);  // tie between 2050 and 2052: 2052
  EXPECT_EQ(BFloat16(int64_t{257}).bits(), 0x4380);  // 256
  EXPECT_EQ(BFloat16(true).bits(), 0x3F80);
}

TEST(Float16, HostArraysHoldThem) {
  HostArray a = HostArray::arange(DType::kBF16, {3});
  EXPECT_EQ(a.nbytes(), 6);
  EXPECT_EQ(a.values<BFloat16>()[2].bits(), 0x4000);
  EXPECT_EQ(a.element_as_double(1), 1.0);
  HostArray h = HostArray::ones(DType::kF16, {2});
  EXPECT_EQ(h.values<Float16>()[1].bits(), 0x3C00);
  HostArray i = HostArray::from_vector<int8_t>({2}, {-128, 127});
  EXPECT_EQ(i.dtype(), DType::kI8);
  EXPECT_EQ(i.element_as_double(0), -128.0);
}

// Every pair of Tessera's dtypes, against the table of JAX's docs/type_promotion.rst (its rows
// and columns b1 u1 u4 i1 i2 i4 i8 bf f2 f4 f8, generated there from jnp.promote_types).
TEST(DType, PromoteTypesIsJaxsTable) {
  const DType b1 = DType::kBool, u1 = DType::kU8, u4 = DType::kU32, i1 = DType::kI8, i2 = DType::kI16, i4 = DType::kI32,
              i8 = DType::kI64, bf = DType::kBF16, f2 = DType::kF16, f4 = DType::kF32, f8 = DType::kF64;
  const std::vector<DType> order = {b1, u1, u4, i1, i2, i4, i8, bf, f2, f4, f8};
  const std::vector<std::vector<DType>> table = {
      {b1, u1, u4, i1, i2, i4, i8, bf, f2, f4, f8},  // b1
      {u1, u1, u4, i2, i2, i4, i8, bf, f2, f4, f8},  // u1
      {u4, u4, u4, i8, i8, i8, i8, bf, f2, f4, f8},  // u4
      {i1, i2, i8, i1, i2, i4, i8, bf, f2, f4, f8},  // i1
      {i2, i2, i8, i2, i2, i4, i8, bf, f2, f4, f8},  // i2
      {i4, i4, i8, i4, i4, i4, i8, bf, f2, f4, f8},  // i4
      {i8, i8, i8, i8, i8, i8, i8, bf, f2, f4, f8},  // i8
      {bf, bf, bf, bf, bf, bf, bf, bf, f4, f4, f8},  // bf
      {f2, f2, f2, f2, f2, f2, f2, f4, f2, f4, f8},  // f2
      {f4, f4, f4, f4, f4, f4, f4, f4, f4, f4, f8},  // f4
      {f8, f8, f8, f8, f8, f8, f8, f8, f8, f8, f8},  // f8
  };
  ASSERT_EQ(order.size(), std::size(kAllDTypes));
  for (size_t r = 0; r < order.size(); ++r) {
    for (size_t c = 0; c < order.size(); ++c) {
      EXPECT_EQ(promote_types(order[r], order[c]), table[r][c])
          << dtype_name(order[r]) << " with " << dtype_name(order[c]) << " gives "
          << dtype_name(promote_types(order[r], order[c])) << ", want " << dtype_name(table[r][c]);
    }
  }
}

}  // namespace
}  // namespace tessera

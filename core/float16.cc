#include "core/float16.h"

#include <cmath>
#include <cstring>

namespace tessera::internal {
namespace {

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}
float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// `v` rounded to float with round-to-odd: an inexact result gets an odd last bit. float has
// 13 or more bits beyond either 16-bit format's precision, so rounding this float to nearest
// gives the correctly rounded 16-bit value of `v` (no double rounding).
float round_to_odd_float(double v) {
  const float f = static_cast<float>(v);
  if (std::isnan(v) || static_cast<double>(f) == v) return f;
  uint32_t b = bits_of(f);
  if ((b & 1) == 0) b = std::fabs(static_cast<double>(f)) > std::fabs(v) ? b - 1 : b + 1;  // toward v
  return float_of(b);
}

}  // namespace

uint16_t float_to_bfloat16_bits(float v) {
  const uint32_t b = bits_of(v);
  if (std::isnan(v)) return static_cast<uint16_t>((b >> 16) | 0x0040);  // quiet, sign and top payload kept
  // Adding 0x7FFF plus the lowest kept bit rounds the dropped 16 bits to nearest, ties to even;
  // a carry moves into the exponent (the largest finite values round to inf).
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

uint16_t float_to_float16_bits(float v) {
  const uint32_t b = bits_of(v);
  const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000u);
  const uint32_t x = b & 0x7FFFFFFFu;
  if (x > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((x >> 13) & 0x3FFu));  // NaN, quiet
  if (x >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // |v| >= 65520 (or inf): inf
  if (x < 0x38800000u) {
    // |v| < 2^-14: a subnormal (or zero) of unit 2^-24. Scaling by 2^24 is exact; nearbyint
    // rounds ties to even; 1024 is the smallest normal's encoding, as it should be.
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(float_of(x) * 0x1p24f)));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 23 mantissa bits to 10.
  const uint32_t m = x - 0x38000000u;
  return static_cast<uint16_t>(sign | ((m + 0xFFFu + ((m >> 13) & 1u)) >> 13));
}

uint16_t double_to_bfloat16_bits(double v) { return float_to_bfloat16_bits(round_to_odd_float(v)); }
uint16_t double_to_float16_bits(double v) { return float_to_float16_bits(round_to_odd_float(v)); }

float bfloat16_bits_to_float(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

float float16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t e = (bits >> 10) & 0x1Fu;
  const uint32_t m = bits & 0x3FFu;
  if (e == 0x1F) return float_of(sign | 0x7F800000u | (m << 13));  // inf, NaN (payload kept)
  if (e == 0) {
    const float magnitude = static_cast<float>(m) * 0x1p-24f;  // subnormal or zero: exact
    return sign != 0 ? -magnitude : magnitude;
  }
  return float_of(sign | ((e + 112) << 23) | (m << 13));
}

}  // namespace tessera::internal

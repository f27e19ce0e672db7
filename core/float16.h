// BFloat16 and Float16: the 16-bit storage types of DType::kBF16 and DType::kF16 on the host.
//
// Each is its 16 bits and nothing else (no arithmetic: the kernels compute in float32 and round
// back, as XLA:CPU does). Conversions round to nearest, ties to even, as XLA and ml_dtypes:
//
//   BFloat16(1.0f).bits() == 0x3F80;  Float16(1.0f).bits() == 0x3C00
//   static_cast<float>(Float16::from_bits(0x0001)) == 0x1p-24f   // the smallest subnormal
//   Float16(65520.0f) is +inf (the tie above 65504 rounds to the even neighbour, 2^16)
//
// NaN stays NaN (quiet, sign kept), +-inf stays +-inf; a finite value beyond the largest finite
// one rounds to inf; subnormals are kept (no flush to zero). A double rounds once (not through a
// rounded float: the float is computed with round-to-odd, so the second rounding is exact), and
// an integer rounds as its double does (exact up to 2^53).
#ifndef TESSERA_CORE_FLOAT16_H_
#define TESSERA_CORE_FLOAT16_H_

#include <cstdint>
#include <type_traits>

namespace tessera {

namespace internal {
uint16_t float_to_bfloat16_bits(float v);
uint16_t float_to_float16_bits(float v);
uint16_t double_to_bfloat16_bits(double v);
uint16_t double_to_float16_bits(double v);
float bfloat16_bits_to_float(uint16_t bits);
float float16_bits_to_float(uint16_t bits);
}  // namespace internal

// The two formats share one class template; only the conversions differ.
enum class HalfFormat { kBFloat16, kFloat16 };

template <HalfFormat kFormat>
class Half {
 public:
  constexpr Half() = default;  // +0
  explicit Half(float v)
      : bits_(kIsBFloat ? internal::float_to_bfloat16_bits(v) : internal::float_to_float16_bits(v)) {}
  explicit Half(double v)
      : bits_(kIsBFloat ? internal::double_to_bfloat16_bits(v) : internal::double_to_float16_bits(v)) {}
  template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  explicit Half(I v) : Half(static_cast<double>(v)) {}
  static constexpr Half from_bits(uint16_t bits) {
    Half h;
    h.bits_ = bits;
    return h;
  }
  constexpr uint16_t bits() const { return bits_; }
  // Exact.
  explicit operator float() const {
    return kIsBFloat ? internal::bfloat16_bits_to_float(bits_) : internal::float16_bits_to_float(bits_);
  }
  explicit operator double() const { return static_cast<double>(static_cast<float>(*this)); }

 private:
  static constexpr bool kIsBFloat = kFormat == HalfFormat::kBFloat16;
  uint16_t bits_ = 0;
};

using BFloat16 = Half<HalfFormat::kBFloat16>;
using Float16 = Half<HalfFormat::kFloat16>;

static_assert(sizeof(BFloat16) == 2 && sizeof(Float16) == 2, "16-bit storage");

// BFloat16 or Float16.
template <typename T>
inline constexpr bool kIsHalf = std::is_same_v<T, BFloat16> || std::is_same_v<T, Float16>;

}  // namespace tessera

#endif  // TESSERA_CORE_FLOAT16_H_

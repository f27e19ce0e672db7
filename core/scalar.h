// Scalar: a number exactly as a program wrote it — an int64 or a double, bit for bit.
//
// Constants in graphs and plans carry a Scalar, so nothing between the tracer and the kernel
// rounds them: an int64 beyond 2^53, -0.0 and a NaN's payload all arrive as written, and two
// Scalars compare equal only when they are the same kind with the same bits.
//
//   Scalar a = 0.1234567;            // floating
//   Scalar b = int64_t{1} << 60;     // integer, exact
//   a.to_string();                   // "0.1234567" (the shortest text that reads back the same bits)
//   Scalar(0.0) == Scalar(-0.0);     // false
#ifndef TESSERA_CORE_SCALAR_H_
#define TESSERA_CORE_SCALAR_H_

#include <cstdint>
#include <string>
#include <type_traits>

namespace tessera {

class Scalar {
 public:
  // Integer 0.
  constexpr Scalar() = default;
  // A floating value (float widens exactly).
  constexpr Scalar(double v) : integer_(false), float_(v) {}  // NOLINT: implicit on purpose
  // An integer (bool as 0 or 1).
  template <typename I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  constexpr Scalar(I v) : integer_(true), int_(static_cast<int64_t>(v)) {}  // NOLINT: implicit on purpose

  bool is_integer() const { return integer_; }
  // REQUIRES: is_integer() / !is_integer().
  int64_t int_value() const { return int_; }
  double float_value() const { return float_; }
  // The value as a double (an integer rounds to the nearest double).
  double to_double() const { return integer_ ? static_cast<double>(int_) : float_; }

  // Integers in decimal; doubles as the shortest %g text that reads back the same bits
  // ("-0", "inf", "nan" or "nan(0x7ff8000000000001)" for a NaN that is not the default one).
  std::string to_string() const;

  // The same kind and the same bits: -0.0 differs from 0.0, a NaN equals the same NaN.
  friend bool operator==(const Scalar& a, const Scalar& b);
  friend bool operator!=(const Scalar& a, const Scalar& b) { return !(a == b); }

 private:
  bool integer_ = true;
  int64_t int_ = 0;
  double float_ = 0;
};

}  // namespace tessera

#endif  // TESSERA_CORE_SCALAR_H_

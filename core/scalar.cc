#include "core/scalar.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tessera {
namespace {

uint64_t bits_of(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

}  // namespace

std::string Scalar::to_string() const {
  if (integer_) return absl::StrCat(int_);
  if (std::isnan(float_)) {
    // Only the default quiet NaN prints bare: any other payload is part of the program.
    const uint64_t bits = bits_of(float_);
    const uint64_t quiet = bits_of(std::numeric_limits<double>::quiet_NaN());
    return bits == quiet ? "nan" : absl::StrFormat("nan(0x%016x)", bits);
  }
  for (int digits = 6; digits < 17; ++digits) {
    std::string text = absl::StrFormat("%.*g", digits, float_);
    if (bits_of(std::strtod(text.c_str(), nullptr)) == bits_of(float_)) return text;
  }
  return absl::StrFormat("%.17g", float_);
}

bool operator==(const Scalar& a, const Scalar& b) {
  if (a.integer_ != b.integer_) return false;
  return a.integer_ ? a.int_ == b.int_ : bits_of(a.float_) == bits_of(b.float_);
}

}  // namespace tessera

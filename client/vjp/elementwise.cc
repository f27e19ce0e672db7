// VJPs of the elementwise ops: unary and binary arithmetic, select, convert.
#include "absl/status/status.h"
#include "client/vjp/vjp.h"

namespace tessera::internal {
namespace {

constexpr double kTwoOverSqrtPi = 1.12837916709551257390;  // d/dx erf(x) = 2/sqrt(pi) exp(-x^2)

// lax's _balanced_eq: 1 where x is the result alone, 1/2 where both operands are.
Value balanced_eq(const Value& x, const Value& result, const Value& other) {
  return where(x == result, where(other == result, full({}, 0.5, x.dtype()), full({}, 1.0, x.dtype())),
               full({}, 0.0, x.dtype()));
}

// A rule adding f(args) to operand 0's cotangent, the common case of a unary op.
#define TESSERA_UNARY_VJP(expr)                \
  [](const VjpArgs& a) {                       \
    [[maybe_unused]] const Value& x = a.x[0];  \
    [[maybe_unused]] const Value& out = a.out; \
    const Value& g = a.g;                      \
    a.add(0, expr);                            \
    return absl::OkStatus();                   \
  }

}  // namespace

absl::Span<const VjpEntry> elementwise_vjps() {
  static const VjpEntry kRules[] = {
      {Op::kNeg, TESSERA_UNARY_VJP(-g)},
      {Op::kAbs, TESSERA_UNARY_VJP(g * sign(x))},
      {Op::kExp, TESSERA_UNARY_VJP(g * out)},
      {Op::kLog, TESSERA_UNARY_VJP(g / x)},
      {Op::kTanh, TESSERA_UNARY_VJP(g * (1.0 - out * out))},
      {Op::kLogistic, TESSERA_UNARY_VJP(g * out * (1.0 - out))},
      {Op::kSqrt, TESSERA_UNARY_VJP(g * 0.5 / out)},
      {Op::kRsqrt, TESSERA_UNARY_VJP(g * -0.5 * out / x)},
      {Op::kSin, TESSERA_UNARY_VJP(g * cos(x))},
      {Op::kCos, TESSERA_UNARY_VJP(-(g * sin(x)))},
      {Op::kErf, TESSERA_UNARY_VJP(g * kTwoOverSqrtPi * exp(-(x * x)))},
      {Op::kErfInv, TESSERA_UNARY_VJP(g / kTwoOverSqrtPi * exp(out * out))},
      {Op::kAdd,
       [](const VjpArgs& a) {
         a.add(0, a.g);
         a.add(1, a.g);
         return absl::OkStatus();
       }},
      {Op::kSub,
       [](const VjpArgs& a) {
         a.add(0, a.g);
         a.add(1, -a.g);
         return absl::OkStatus();
       }},
      {Op::kMul,
       [](const VjpArgs& a) {
         a.add(0, a.g * a.x[1]);
         a.add(1, a.g * a.x[0]);
         return absl::OkStatus();
       }},
      {Op::kDiv,
       [](const VjpArgs& a) {
         a.add(0, a.g / a.x[1]);
         a.add(1, -(a.g * a.x[0] / (a.x[1] * a.x[1])));
         return absl::OkStatus();
       }},
      // lax.rem's derivatives: 1 in x, -trunc(x / y) in y.
      {Op::kRem,
       [](const VjpArgs& a) {
         const Value q = a.x[0] / a.x[1];
         a.add(0, a.g);
         a.add(1, -(a.g * sign(q) * floor(abs(q))));
         return absl::OkStatus();
       }},
      {Op::kPow,
       [](const VjpArgs& a) {
         const Value &x = a.x[0], &y = a.x[1];
         a.add(0, a.g * y * pow(x, y - 1.0));
         // d/db a^b = log(a) a^b; at a == 0 JAX takes log(1), so 0^b contributes nothing.
         a.add(1, a.g * log(where(x == zeros_like(x), full(x.shape(), 1.0, x.dtype()), x)) * a.out);
         return absl::OkStatus();
       }},
      {Op::kMax,
       [](const VjpArgs& a) {
         a.add(0, a.g * balanced_eq(a.x[0], a.out, a.x[1]));
         a.add(1, a.g * balanced_eq(a.x[1], a.out, a.x[0]));
         return absl::OkStatus();
       }},
      {Op::kMin,
       [](const VjpArgs& a) {
         a.add(0, a.g * balanced_eq(a.x[0], a.out, a.x[1]));
         a.add(1, a.g * balanced_eq(a.x[1], a.out, a.x[0]));
         return absl::OkStatus();
       }},
      {Op::kSelect,
       [](const VjpArgs& a) {
         a.add(1, where(a.x[0], a.g, zeros_like(a.g)));
         a.add(2, where(a.x[0], zeros_like(a.g), a.g));
         return absl::OkStatus();
       }},
      {Op::kConvert,
       [](const VjpArgs& a) {
         if (is_floating(a.x[0].dtype())) a.add(0, convert(a.g, a.x[0].dtype()));
         return absl::OkStatus();
       }},
  };
  return kRules;
}

#undef TESSERA_UNARY_VJP

}  // namespace tessera::internal

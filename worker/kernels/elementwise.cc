// Elementwise kernels: constant, iota, random_bits, unary and binary arithmetic, comparisons,
// select, convert. Plain loops over the operands' storage; the op and dtype are resolved once, outside
// the loop, so each loop body is a single inlined expression.
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status.h"
#include "worker/kernels/internal.h"

namespace tessera::internal {
namespace {

absl::Status undefined_for(Op op, const HostArray& x) {
  return absl::InvalidArgumentError(absl::StrCat(op_name(op), ": not defined for ", dtype_name(x.dtype()),
                                                 " operands (", type_to_string(x.dtype(), x.shape()), ")"));
}

// Does nothing: `into` is an operand's storage, which its own array frees.
void keep_storage(std::byte*, size_t) {}

// A kernel's result: new storage, or (in place) a placeholder while it writes `into`, which
// run_kernel_in_place drops unread (it reads only the status). The placeholder allocates
// nothing: a rank-0 view of `into` (an empty Shape holds no heap memory) that leaves the
// storage to its owner.
template <typename Out>
HostArray result(std::byte* into, const Shape& shape) {
  return into != nullptr ? HostArray::adopt(dtype_of<Out>(), Shape{}, into, keep_storage)
                         : HostArray(dtype_of<Out>(), shape);
}
template <typename Out>
Stored<Out>* destination(std::byte* into, HostArray* out) {
  return into != nullptr ? reinterpret_cast<Stored<Out>*>(into) : mutable_stored<Out>(out);
}

template <typename In, typename Out, typename F>
HostArray map1(const HostArray& x, F f, std::byte* into) {
  assert(into == nullptr || (std::is_same_v<In, Out>));  // in place only where elements keep their type
  HostArray out = result<Out>(into, x.shape());
  Stored<Out>* o = destination<Out>(into, &out);
  const Stored<In>* in = stored<In>(x);
  const int64_t n = x.size();
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<Stored<Out>>(f(load<In>(in[i])));
  return out;
}

// How the operands of an elementwise kernel that broadcasts (core/op.cc's infer_type: a
// rank-0 operand, or one of the result's rank with size 1 along the dimensions it repeats;
// passes/broadcast_operands.cc makes such kernels) are walked: the result's shape and each
// operand's strides over it (0 along a repeated dimension), with the result's dimensions of
// size 1 dropped and adjacent dimensions merged where every operand steps alike, so the last
// dimension is a long run in which each operand's stride is 1 or 0.
struct Walk {
  Shape shape;                                // the result's
  std::vector<int64_t> dims;                  // merged; never empty
  std::vector<std::vector<int64_t>> strides;  // per operand, per merged dimension
};

Walk broadcast_walk(const std::vector<const HostArray*>& xs) {
  Walk w;
  for (const HostArray* x : xs) {
    if (x->shape().size() > w.shape.size()) w.shape = Shape(x->shape().size(), 1);
  }
  for (const HostArray* x : xs) {
    for (size_t d = 0; d < x->shape().size(); ++d) {
      if (x->shape()[d] != 1) w.shape[d] = x->shape()[d];  // the type rule made them agree
    }
  }
  std::vector<std::vector<int64_t>> full(xs.size());  // per result dimension
  for (size_t k = 0; k < xs.size(); ++k) {
    const Shape& s = xs[k]->shape();
    full[k].assign(w.shape.size(), 0);
    if (s.empty()) continue;
    const std::vector<int64_t> own = row_major_strides(s);
    for (size_t d = 0; d < s.size(); ++d) full[k][d] = s[d] == w.shape[d] ? own[d] : 0;
  }
  w.strides.resize(xs.size());
  for (size_t d = 0; d < w.shape.size(); ++d) {
    if (w.shape[d] == 1) continue;
    bool merges = !w.dims.empty();
    for (size_t k = 0; k < xs.size() && merges; ++k) {
      merges = full[k][d] == 0 ? w.strides[k].back() == 0 : w.strides[k].back() == full[k][d] * w.shape[d];
    }
    if (merges) {
      w.dims.back() *= w.shape[d];
      for (size_t k = 0; k < xs.size(); ++k) w.strides[k].back() = full[k][d];
    } else {
      w.dims.push_back(w.shape[d]);
      for (size_t k = 0; k < xs.size(); ++k) w.strides[k].push_back(full[k][d]);
    }
  }
  if (w.dims.empty()) {  // one element
    w.dims.push_back(1);
    for (auto& s : w.strides) s.push_back(0);
  }
  return w;
}

// Calls run(offsets, first) for each run of the walk's last dimension, in row-major order:
// offsets[k] is operand k's element where the run starts, `first` the result's.
template <typename Run>
void for_each_run(const Walk& w, Run run) {
  const size_t rank = w.dims.size(), n = w.strides.size();
  const int64_t inner = w.dims.back();
  const int64_t size = num_elements(w.shape);
  std::vector<int64_t> index(rank, 0), offsets(n, 0);
  for (int64_t first = 0; first < size; first += inner) {
    run(offsets.data(), first);
    for (size_t d = rank - 1; d-- > 0;) {
      for (size_t k = 0; k < n; ++k) offsets[k] += w.strides[k][d];
      if (++index[d] < w.dims[d]) break;
      for (size_t k = 0; k < n; ++k) offsets[k] -= w.strides[k][d] * w.dims[d];
      index[d] = 0;
    }
  }
}

template <typename In, typename Out, typename F>
HostArray map2(const HostArray& x, const HostArray& y, F f, std::byte* into) {
  assert(into == nullptr || (std::is_same_v<In, Out>));  // in place only where elements keep their type
  const Stored<In>* a = stored<In>(x);
  const Stored<In>* b = stored<In>(y);
  if (x.shape() == y.shape()) {
    HostArray out = result<Out>(into, x.shape());
    Stored<Out>* o = destination<Out>(into, &out);
    const int64_t n = x.size();
    for (int64_t i = 0; i < n; ++i) o[i] = static_cast<Stored<Out>>(f(load<In>(a[i]), load<In>(b[i])));
    return out;
  }
  // One operand repeated along some dimensions: within a run it is an array or one value,
  // loaded once.
  const Walk w = broadcast_walk({&x, &y});
  HostArray out = result<Out>(into, w.shape);
  Stored<Out>* o = destination<Out>(into, &out);
  const int64_t n = w.dims.back(), sa = w.strides[0].back(), sb = w.strides[1].back();
  for_each_run(w, [&](const int64_t* at, int64_t first) {
    const Stored<In>* ra = a + at[0];
    const Stored<In>* rb = b + at[1];
    Stored<Out>* ro = o + first;
    if (sa != 0 && sb != 0) {
      for (int64_t i = 0; i < n; ++i) ro[i] = static_cast<Stored<Out>>(f(load<In>(ra[i]), load<In>(rb[i])));
    } else if (sb != 0) {
      const auto av = load<In>(ra[0]);
      for (int64_t i = 0; i < n; ++i) ro[i] = static_cast<Stored<Out>>(f(av, load<In>(rb[i])));
    } else if (sa != 0) {
      const auto bv = load<In>(rb[0]);
      for (int64_t i = 0; i < n; ++i) ro[i] = static_cast<Stored<Out>>(f(load<In>(ra[i]), bv));
    } else {
      const auto v = static_cast<Stored<Out>>(f(load<In>(ra[0]), load<In>(rb[0])));
      for (int64_t i = 0; i < n; ++i) ro[i] = v;
    }
  });
  return out;
}

// Integer arithmetic that can overflow runs in an unsigned type, where it wraps by definition.
template <typename T>
using Unsigned = Wrapping<T>;

template <typename T>
T wrapping_neg(T v) {
  return static_cast<T>(Unsigned<T>{0} - static_cast<Unsigned<T>>(v));
}

// XLA's choices for the two divisions C leaves undefined.
template <typename T>
T int_div(T a, T b) {
  if (b == 0) return static_cast<T>(-1);  // all ones for unsigned types
  if constexpr (std::is_signed_v<T>) {
    if (b == -1) return wrapping_neg(a);  // INT_MIN / -1 == INT_MIN
  }
  return static_cast<T>(a / b);
}

// XLA's integer remainder: x % 0 == x and INT_MIN % -1 == 0 (C++ leaves both undefined); otherwise
// C++'s, which takes the dividend's sign as lax.rem does.
template <typename T>
T int_rem(T a, T b) {
  if (b == 0) return a;
  if constexpr (std::is_signed_v<T>) {
    if (b == -1) return 0;
  }
  return static_cast<T>(a % b);
}

// Exponentiation by squaring, wrapping; a negative exponent gives 1 for base 1, else 0 (XLA).
template <typename T>
T int_pow(T base, T exponent) {
  if constexpr (std::is_signed_v<T>) {
    if (exponent < 0) return base == 1 ? T(1) : T(0);
  }
  Unsigned<T> result = 1;
  Unsigned<T> b = static_cast<Unsigned<T>>(base);
  for (Unsigned<T> e = static_cast<Unsigned<T>>(exponent); e != 0; e >>= 1) {
    if (e & 1) result *= b;
    b *= b;
  }
  return static_cast<T>(result);
}

// lax.max/min on floats: NaN wins.
template <typename T>
T float_max(T a, T b) {
  return (std::isnan(a) || a > b) ? a : b;
}
template <typename T>
T float_min(T a, T b) {
  return (std::isnan(a) || a < b) ? a : b;
}

// One element from any dtype to any other: to bool is "nonzero"; float to integer truncates
// toward zero and saturates, NaN becoming 0 (as XLA; a plain cast would be undefined).
template <typename To, typename From>
To convert_value(From v) {
  if constexpr (kIsHalf<From>) {
    return convert_value<To>(static_cast<float>(v));  // exact, then as from float32
  } else if constexpr (kIsHalf<To>) {
    return To(v);  // rounded once, to nearest even (core/float16.h)
  } else if constexpr (kIsBool<To>) {
    return v != From{};
  } else if constexpr (kIsInt<To> && kIsFloat<From>) {
    // 2^digits and -2^(bits-1) (signed) or 0 (unsigned): exact in every float type.
    const From high = std::ldexp(From(1), std::numeric_limits<To>::digits);
    constexpr From kLow = static_cast<From>(std::numeric_limits<To>::min());
    if (std::isnan(v)) return 0;
    if (v <= kLow) return std::numeric_limits<To>::min();
    if (v >= high) return std::numeric_limits<To>::max();
    return static_cast<To>(v);
  } else {
    return static_cast<To>(v);
  }
}

// lax.erf_inv as XLA computes it in float32 (ErfInv32 in xla/client/lib/math.cc: Giles,
// "Approximating the erfinv function", GPU Computing Gems 2010): w = -log1p(-x^2), a degree-8
// polynomial in w - 2.5 (w < 5) or sqrt(w) - 3, times x; +-1 give +-inf, |x| > 1 NaN. float64
// starts from the same polynomial in double and takes two Newton steps on erf (erfc in the
// tails, where erf(y) - x would cancel), which reach double precision.
template <typename T>
T erf_inv(T x) {
  static constexpr float kCentral[9] = {2.81022636e-08f,  3.43273939e-07f, -3.5233877e-06f,
                                        -4.39150654e-06f, 0.00021858087f,  -0.00125372503f,
                                        -0.00417768164f,  0.246640727f,    1.50140941f};
  static constexpr float kTail[9] = {-0.000200214257f, 0.000100950558f, 0.00134934322f, -0.00367342844f, 0.00573950773f,
                                     -0.0076224613f,   0.00943887047f,  1.00167406f,    2.83297682f};
  if (std::abs(x) == T(1)) return x * std::numeric_limits<T>::infinity();
  T w = -std::log1p(-x * x);
  const bool central = w < T(5);
  const float* c = central ? kCentral : kTail;
  w = central ? w - T(2.5) : std::sqrt(w) - T(3);
  T p = c[0];
  for (int i = 1; i < 9; ++i) p = T(c[i]) + p * w;
  T y = p * x;
  if constexpr (std::is_same_v<T, double>) {
    constexpr double kTwoOverSqrtPi = 1.1283791670955126;
    for (int step = 0; step < 2 && std::isfinite(y); ++step) {
      const double slope = kTwoOverSqrtPi * std::exp(-y * y);
      if (std::abs(x) <= 0.5) {
        y -= (std::erf(y) - x) / slope;
      } else {  // on |y|: erfc(|y|) = 1 - |x|, whose terms keep their precision
        y += (x > 0 ? 1 : -1) * (std::erfc(std::abs(y)) - (1 - std::abs(x))) / slope;
      }
    }
  }
  return y;
}

template <typename T>
absl::StatusOr<HostArray> unary_typed(Op op, const HostArray& x, std::byte* into) {
  if constexpr (kIsHalf<T>) {
    return undefined_for(op, x);  // unreachable: unary_kernel widens halves (in_float32)
  } else if constexpr (kIsBool<T>) {
    if (op == Op::kNot)
      return map1<T, T>(
          x, [](bool v) { return !v; }, into);
  } else if constexpr (kIsInt<T> && !std::is_signed_v<T>) {
    switch (op) {  // unsigned: abs is the identity, sign is 0 or 1, neg wraps
      case Op::kNeg:
        return map1<T, T>(
            x, [](T v) { return wrapping_neg(v); }, into);
      case Op::kAbs:
        return map1<T, T>(
            x, [](T v) { return v; }, into);
      case Op::kSign:
        return map1<T, T>(
            x, [](T v) { return static_cast<T>(v != 0); }, into);
      case Op::kNot:
        return map1<T, T>(
            x, [](T v) { return static_cast<T>(~v); }, into);
      default:
        break;
    }
  } else if constexpr (kIsInt<T>) {
    switch (op) {
      case Op::kNeg:
        return map1<T, T>(
            x, [](T v) { return wrapping_neg(v); }, into);
      case Op::kAbs:
        return map1<T, T>(
            x, [](T v) { return v < 0 ? wrapping_neg(v) : v; }, into);
      case Op::kSign:
        return map1<T, T>(
            x, [](T v) { return static_cast<T>((v > 0) - (v < 0)); }, into);
      case Op::kNot:
        return map1<T, T>(
            x, [](T v) { return static_cast<T>(~v); }, into);
      default:
        break;
    }
  } else {
    if constexpr (std::is_same_v<T, float>) {
      if (op == Op::kExp || op == Op::kTanh) {  // vectorized (vector_math.cc)
        HostArray out = result<T>(into, x.shape());
        float* o = destination<T>(into, &out);
        (op == Op::kExp ? exp_f32 : tanh_f32)(stored<T>(x), o, x.size());
        return out;
      }
    }
    switch (op) {
      case Op::kNeg:
        return map1<T, T>(
            x, [](T v) { return -v; }, into);
      case Op::kAbs:
        return map1<T, T>(
            x, [](T v) { return std::abs(v); }, into);
      case Op::kExp:
        return map1<T, T>(
            x, [](T v) { return std::exp(v); }, into);
      case Op::kLog:
        return map1<T, T>(
            x, [](T v) { return std::log(v); }, into);
      case Op::kTanh:
        return map1<T, T>(
            x, [](T v) { return std::tanh(v); }, into);
      case Op::kLogistic:
        return map1<T, T>(
            x, [](T v) { return T(1) / (T(1) + std::exp(-v)); }, into);
      case Op::kSqrt:
        return map1<T, T>(
            x, [](T v) { return std::sqrt(v); }, into);
      case Op::kRsqrt:
        return map1<T, T>(
            x, [](T v) { return T(1) / std::sqrt(v); }, into);
      case Op::kSin:
        return map1<T, T>(
            x, [](T v) { return std::sin(v); }, into);
      case Op::kCos:
        return map1<T, T>(
            x, [](T v) { return std::cos(v); }, into);
      case Op::kErf:
        return map1<T, T>(
            x, [](T v) { return std::erf(v); }, into);
      case Op::kErfInv:
        return map1<T, T>(
            x, [](T v) { return erf_inv(v); }, into);
      case Op::kFloor:
        return map1<T, T>(
            x, [](T v) { return std::floor(v); }, into);
      case Op::kCeil:
        return map1<T, T>(
            x, [](T v) { return std::ceil(v); }, into);
      case Op::kSign:
        // -0.0 and NaN map to themselves, as lax.sign.
        return map1<T, T>(
            x, [](T v) { return v > 0   ? T(1)
                                : v < 0 ? T(-1)
                                        : v; }, into);
      default:
        break;
    }
  }
  return undefined_for(op, x);
}

template <typename T>
absl::StatusOr<HostArray> binary_typed_numeric(Op op, const HostArray& x, const HostArray& y, std::byte* into);

template <typename T>
absl::StatusOr<HostArray> binary_typed(Op op, const HostArray& x, const HostArray& y, std::byte* into) {
  if constexpr (kIsHalf<T>) {
    return undefined_for(op, x);  // unreachable: binary_kernel widens halves (in_float32)
  } else {
    return binary_typed_numeric<T>(op, x, y, into);
  }
}

template <typename T>
absl::StatusOr<HostArray> binary_typed_numeric(Op op, const HostArray& x, const HostArray& y, std::byte* into) {
  switch (op) {
    case Op::kEq:
      return map2<T, bool>(
          x, y, [](T a, T b) { return a == b; }, into);
    case Op::kNe:
      return map2<T, bool>(
          x, y, [](T a, T b) { return a != b; }, into);
    case Op::kLt:
      return map2<T, bool>(
          x, y, [](T a, T b) { return a < b; }, into);
    case Op::kLe:
      return map2<T, bool>(
          x, y, [](T a, T b) { return a <= b; }, into);
    case Op::kGt:
      return map2<T, bool>(
          x, y, [](T a, T b) { return a > b; }, into);
    case Op::kGe:
      return map2<T, bool>(
          x, y, [](T a, T b) { return a >= b; }, into);
    default:
      break;
  }
  if constexpr (kIsBool<T>) {
    switch (op) {
      case Op::kAnd:
      case Op::kMin:
        return map2<T, T>(
            x, y, [](bool a, bool b) { return a && b; }, into);
      case Op::kOr:
      case Op::kMax:
        return map2<T, T>(
            x, y, [](bool a, bool b) { return a || b; }, into);
      default:
        break;
    }
  } else if constexpr (kIsInt<T>) {
    using U = Unsigned<T>;
    switch (op) {
      case Op::kAdd:
        return map2<T, T>(
            x, y, [](T a, T b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }, into);
      case Op::kSub:
        return map2<T, T>(
            x, y, [](T a, T b) { return static_cast<T>(static_cast<U>(a) - static_cast<U>(b)); }, into);
      case Op::kMul:
        return map2<T, T>(
            x, y, [](T a, T b) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(b)); }, into);
      case Op::kDiv:
        return map2<T, T>(
            x, y, [](T a, T b) { return int_div(a, b); }, into);
      case Op::kPow:
        return map2<T, T>(
            x, y, [](T a, T b) { return int_pow(a, b); }, into);
      case Op::kRem:
        return map2<T, T>(
            x, y, [](T a, T b) { return int_rem(a, b); }, into);
      case Op::kMax:
        return map2<T, T>(
            x, y, [](T a, T b) { return a > b ? a : b; }, into);
      case Op::kMin:
        return map2<T, T>(
            x, y, [](T a, T b) { return a < b ? a : b; }, into);
      case Op::kAnd:
        return map2<T, T>(
            x, y, [](T a, T b) { return static_cast<T>(a & b); }, into);
      case Op::kOr:
        return map2<T, T>(
            x, y, [](T a, T b) { return static_cast<T>(a | b); }, into);
      case Op::kShiftRightLogical:
        return map2<T, T>(
            x, y,
            [](T a, T b) {
              const U by = static_cast<U>(b);  // a negative shift is a huge one, as in XLA
              // Shifted in T's own width: zeros come in at bit sizeof(T) * 8 - 1.
              return by >= sizeof(T) * 8 ? T(0) : static_cast<T>(static_cast<std::make_unsigned_t<T>>(a) >> by);
            },
            into);
      default:
        break;
    }
  } else {
    switch (op) {
      case Op::kAdd:
        return map2<T, T>(
            x, y, [](T a, T b) { return a + b; }, into);
      case Op::kSub:
        return map2<T, T>(
            x, y, [](T a, T b) { return a - b; }, into);
      case Op::kMul:
        return map2<T, T>(
            x, y, [](T a, T b) { return a * b; }, into);
      case Op::kDiv:
        return map2<T, T>(
            x, y, [](T a, T b) { return a / b; }, into);
      case Op::kPow:
        return map2<T, T>(
            x, y, [](T a, T b) { return std::pow(a, b); }, into);
      case Op::kRem:
        return map2<T, T>(
            x, y, [](T a, T b) { return std::fmod(a, b); }, into);
      case Op::kMax:
        return map2<T, T>(
            x, y, [](T a, T b) { return float_max(a, b); }, into);
      case Op::kMin:
        return map2<T, T>(
            x, y, [](T a, T b) { return float_min(a, b); }, into);
      default:
        break;
    }
  }
  return undefined_for(op, x);
}

absl::StatusOr<HostArray> constant_kernel(const Node& node) {
  HostArray out(node.dtype, node.shape);
  visit_dtype(node.dtype, [&](auto zero) {
    using T = decltype(zero);
    const Scalar& s = node.attrs<ConstantAttrs>().value;  // exact: an int64 constant never passes through a double
    const Stored<T> v =
        static_cast<Stored<T>>(s.is_integer() ? convert_value<T>(s.int_value()) : convert_value<T>(s.float_value()));
    Stored<T>* o = mutable_stored<T>(&out);
    for (int64_t i = 0; i < out.size(); ++i) o[i] = v;
  });
  return out;
}

absl::StatusOr<HostArray> iota_kernel(const Node& node) {
  if (node.dtype == DType::kBool) {
    return absl::InvalidArgumentError(
        absl::StrCat("iota: not defined for bool (", type_to_string(node.dtype, node.shape), ")"));
  }
  HostArray out(node.dtype, node.shape);
  const size_t axis = static_cast<size_t>(node.attrs<IotaAttrs>().dimension);
  int64_t outer = 1, inner = 1;
  for (size_t d = 0; d < axis; ++d) outer *= node.shape[d];
  for (size_t d = axis + 1; d < node.shape.size(); ++d) inner *= node.shape[d];
  const int64_t n = node.shape[axis];
  visit_dtype(node.dtype, [&](auto zero) {
    using T = decltype(zero);
    Stored<T>* o = mutable_stored<T>(&out);
    for (int64_t i = 0; i < outer; ++i) {
      for (int64_t k = 0; k < n; ++k) {
        const Stored<T> v = static_cast<Stored<T>>(convert_value<T>(k));
        for (int64_t j = 0; j < inner; ++j) *o++ = v;
      }
    }
  });
  return out;
}

// Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3",
// SC'11; as jax/_src/random/threefry2x32.py): the two words of counter (x0, x1) under key
// (k0, k1). Four rounds of add, rotate and xor per block, the key schedule injected after each.
std::pair<uint32_t, uint32_t> threefry2x32(uint32_t k0, uint32_t k1, uint32_t x0, uint32_t x1) {
  static constexpr int kRotations[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  x0 += ks[0];
  x1 += ks[1];
  for (int i = 0; i < 5; ++i) {
    for (int r : kRotations[i % 2]) {
      x0 += x1;
      x1 = (x1 << r) | (x1 >> (32 - r));
      x1 ^= x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  return {x0, x1};
}

// Element i of the counted shape (row-major) gets counter `first + i`, split into its high and
// low words as jax's iota_2x32_shape does; a block (a device's) walks its own elements only.
// A batch of keys runs each key, at its own counter, into its own run of the result.
absl::StatusOr<HostArray> random_bits_kernel(const Node& node, const std::vector<const HostArray*>& xs) {
  const RandomBitsAttrs& a = node.attrs<RandomBitsAttrs>();
  const size_t rank = a.shape.size();
  const int64_t batch_rank = xs[0]->shape().size() - 1;
  const int64_t keys = num_elements(xs[1]->shape());
  const std::vector<int64_t> strides = row_major_strides(Shape(a.shape));
  const Shape block(node.shape.begin() + batch_rank, node.shape.begin() + batch_rank + static_cast<int64_t>(rank));
  HostArray out(DType::kU32, node.shape);
  uint32_t* o = mutable_stored<uint32_t>(&out);
  const int64_t inner = rank == 0 ? 1 : block[rank - 1];
  const int64_t rows = inner == 0 ? 0 : num_elements(block) / inner;
  for (int64_t k = 0; k < keys; ++k) {
    const uint32_t* key = stored<uint32_t>(*xs[0]) + 2 * k;
    const uint64_t first = static_cast<uint64_t>(stored<int64_t>(*xs[1])[k]);
    std::vector<int64_t> index(rank, 0);  // of the row's first element
    for (int64_t row = 0; row < rows; ++row) {
      uint64_t counter = first;
      for (size_t d = 0; d + 1 < rank; ++d) counter += static_cast<uint64_t>(index[d] * strides[d]);
      for (int64_t j = 0; j < inner; ++j, ++counter) {
        const auto [w0, w1] =
            threefry2x32(key[0], key[1], static_cast<uint32_t>(counter >> 32), static_cast<uint32_t>(counter));
        if (a.words) {
          *o++ = w0;
          *o++ = w1;
        } else {
          *o++ = w0 ^ w1;
        }
      }
      for (int64_t d = static_cast<int64_t>(rank) - 2; d >= 0; --d) {
        if (++index[d] < block[d]) break;
        index[d] = 0;
      }
    }
  }
  return out;
}

absl::StatusOr<HostArray> unary_kernel(const Node& node, const std::vector<const HostArray*>& xs, std::byte* into) {
  if (has_half(node, xs)) return in_float32(unary_kernel, node, xs, into);
  const HostArray& x = *xs[0];
  return visit_dtype(x.dtype(), [&](auto zero) { return unary_typed<decltype(zero)>(node.op, x, into); });
}

absl::StatusOr<HostArray> binary_kernel(const Node& node, const std::vector<const HostArray*>& xs, std::byte* into) {
  if (has_half(node, xs)) return in_float32(binary_kernel, node, xs, into);
  const HostArray &x = *xs[0], &y = *xs[1];
  return visit_dtype(x.dtype(), [&](auto zero) { return binary_typed<decltype(zero)>(node.op, x, y, into); });
}

absl::StatusOr<HostArray> select_kernel(const Node& node, const std::vector<const HostArray*>& xs, std::byte* into) {
  const HostArray &pred = *xs[0], &on_true = *xs[1], &on_false = *xs[2];
  return visit_dtype(node.dtype, [&](auto zero) -> HostArray {
    using T = decltype(zero);
    HostArray out = result<T>(into, node.shape);
    const uint8_t* p = stored<bool>(pred);
    const Stored<T>* t = stored<T>(on_true);
    const Stored<T>* f = stored<T>(on_false);
    Stored<T>* o = destination<T>(into, &out);
    if (pred.shape() == node.shape && on_true.shape() == node.shape && on_false.shape() == node.shape) {
      const int64_t n = on_true.size();
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<Stored<T>>(load<T>(p[i] != 0 ? t[i] : f[i]));
      return out;
    }
    const Walk w = broadcast_walk({&pred, &on_true, &on_false});  // as map2's
    const int64_t n = w.dims.back(), sp = w.strides[0].back(), st = w.strides[1].back(), sf = w.strides[2].back();
    for_each_run(w, [&](const int64_t* at, int64_t first) {
      for (int64_t i = 0; i < n; ++i) {
        o[first + i] = static_cast<Stored<T>>(load<T>(p[at[0] + i * sp] != 0 ? t[at[1] + i * st] : f[at[2] + i * sf]));
      }
    });
    return out;
  });
}

absl::StatusOr<HostArray> convert_kernel(const Node& node, const HostArray& x) {
  return visit_dtype(x.dtype(), [&](auto from) {
    using From = decltype(from);
    return visit_dtype(node.dtype, [&](auto to) {
      using To = decltype(to);
      return map1<From, To>(
          x, [](From v) { return convert_value<To>(v); }, nullptr);
    });
  });
}

}  // namespace

bool has_half(const Node& node, const std::vector<const HostArray*>& xs) {
  if (is_half(node.dtype)) return true;
  for (const HostArray* x : xs) {
    if (is_half(x->dtype())) return true;
  }
  return false;
}

absl::StatusOr<HostArray> in_float32(KernelFn kernel, const Node& node, const std::vector<const HostArray*>& xs,
                                     std::byte* into) {
  std::vector<HostArray> widened;
  widened.reserve(xs.size());  // the pointers below stay valid
  std::vector<const HostArray*> operands;
  for (const HostArray* x : xs) {
    if (is_half(x->dtype())) {
      Node convert = node;
      convert.dtype = DType::kF32;
      TESSERA_ASSIGN_OR_RETURN(HostArray w, convert_kernel(convert, *x));
      widened.push_back(std::move(w));
      operands.push_back(&widened.back());
    } else {
      operands.push_back(x);
    }
  }
  Node wide = node;
  if (is_half(node.dtype)) wide.dtype = DType::kF32;
  TESSERA_ASSIGN_OR_RETURN(HostArray out, kernel(wide, operands, nullptr));
  if (!is_half(node.dtype)) return out;  // a comparison's bool, an argmax's indices
  return visit_dtype(node.dtype, [&](auto zero) {
    using T = decltype(zero);
    if constexpr (kIsHalf<T>) {
      HostArray rounded = result<T>(into, node.shape);
      T* o = destination<T>(into, &rounded);
      const float* in = stored<float>(out);
      for (int64_t i = 0; i < out.size(); ++i) o[i] = T(in[i]);
      return rounded;
    } else {
      return HostArray();  // unreachable: node.dtype is a half
    }
  });
}

absl::Span<const KernelEntry> elementwise_kernels() {
  static constexpr KernelFn kConstant = [](const Node& n, const std::vector<const HostArray*>&, std::byte*) {
    return constant_kernel(n);
  };
  static constexpr KernelFn kIota = [](const Node& n, const std::vector<const HostArray*>&, std::byte*) {
    return iota_kernel(n);
  };
  static constexpr KernelFn kConvert = [](const Node& n, const std::vector<const HostArray*>& xs, std::byte*) {
    return convert_kernel(n, *xs[0]);
  };
  static constexpr KernelFn kRandomBits = [](const Node& n, const std::vector<const HostArray*>& xs, std::byte*) {
    return random_bits_kernel(n, xs);
  };
  // Rows are appended one per line, the table above them kept as it is.
  // clang-format off
  static constexpr KernelEntry kKernels[] = {
      {Op::kConstant, Backend::kCpu, kConstant}, {Op::kIota, Backend::kCpu, kIota},
      {Op::kNeg, Backend::kCpu, unary_kernel},   {Op::kAbs, Backend::kCpu, unary_kernel},
      {Op::kExp, Backend::kCpu, unary_kernel},   {Op::kLog, Backend::kCpu, unary_kernel},
      {Op::kTanh, Backend::kCpu, unary_kernel},  {Op::kLogistic, Backend::kCpu, unary_kernel},
      {Op::kSqrt, Backend::kCpu, unary_kernel},  {Op::kRsqrt, Backend::kCpu, unary_kernel},
      {Op::kSin, Backend::kCpu, unary_kernel},   {Op::kCos, Backend::kCpu, unary_kernel},
      {Op::kFloor, Backend::kCpu, unary_kernel}, {Op::kCeil, Backend::kCpu, unary_kernel},
      {Op::kSign, Backend::kCpu, unary_kernel},  {Op::kNot, Backend::kCpu, unary_kernel},
      {Op::kAdd, Backend::kCpu, binary_kernel},  {Op::kSub, Backend::kCpu, binary_kernel},
      {Op::kMul, Backend::kCpu, binary_kernel},  {Op::kDiv, Backend::kCpu, binary_kernel},
      {Op::kPow, Backend::kCpu, binary_kernel},  {Op::kMax, Backend::kCpu, binary_kernel},
      {Op::kMin, Backend::kCpu, binary_kernel},  {Op::kAnd, Backend::kCpu, binary_kernel},
      {Op::kOr, Backend::kCpu, binary_kernel},   {Op::kEq, Backend::kCpu, binary_kernel},
      {Op::kNe, Backend::kCpu, binary_kernel},   {Op::kLt, Backend::kCpu, binary_kernel},
      {Op::kLe, Backend::kCpu, binary_kernel},   {Op::kGt, Backend::kCpu, binary_kernel},
      {Op::kGe, Backend::kCpu, binary_kernel},   {Op::kSelect, Backend::kCpu, select_kernel},
      {Op::kConvert, Backend::kCpu, kConvert},   {Op::kErf, Backend::kCpu, unary_kernel},
      {Op::kRem, Backend::kCpu, binary_kernel},
      {Op::kRandomBits, Backend::kCpu, kRandomBits},
      {Op::kShiftRightLogical, Backend::kCpu, binary_kernel},
      {Op::kErfInv, Backend::kCpu, unary_kernel},
  };
  // clang-format on
  return kKernels;
}

}  // namespace tessera::internal

#include "worker/collectives/reduce.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace tessera {
namespace {

// Integers compute in their unsigned type; floats in their own.
template <typename T>
auto wide(T x) {
  if constexpr (std::is_integral_v<T>) {
    // unsigned int for the types C++ promotes to int, where int16 * int16 could overflow.
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    return static_cast<U>(x);
  } else {
    return x;
  }
}

// Elements are loaded and stored with memcpy: data straight from the wire need not be
// aligned for T (the compiler still emits plain vector loads).
template <typename T, typename F>
void apply(std::byte* out, const std::byte* x, const std::byte* y, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) {
    T a, b;
    std::memcpy(&a, x + i * sizeof(T), sizeof(T));
    std::memcpy(&b, y + i * sizeof(T), sizeof(T));
    a = f(a, b);
    std::memcpy(out + i * sizeof(T), &a, sizeof(T));
  }
}

template <typename T>
void reduce_typed(ReduceOp op, std::byte* out, const std::byte* x, const std::byte* y, int64_t n) {
  if constexpr (std::is_same_v<T, bool>) {
    // As bytes: a peer's byte other than 0 or 1 still reads as true, never as UB.
    if (op == ReduceOp::kSum || op == ReduceOp::kMax) {
      apply<uint8_t>(out, x, y, n, [](uint8_t x, uint8_t y) -> uint8_t { return (x | y) != 0; });
    } else {
      apply<uint8_t>(out, x, y, n, [](uint8_t x, uint8_t y) -> uint8_t { return x != 0 && y != 0; });
    }
    return;
  } else {
    switch (op) {
      // Integers wrap around (as XLA's do) instead of overflowing into undefined behaviour.
      case ReduceOp::kSum:
        apply<T>(out, x, y, n, [](T x, T y) { return static_cast<T>(wide<T>(x) + wide<T>(y)); });
        break;
      case ReduceOp::kMax:
        apply<T>(out, x, y, n, [](T x, T y) { return std::max(x, y); });
        break;
      case ReduceOp::kMin:
        apply<T>(out, x, y, n, [](T x, T y) { return std::min(x, y); });
        break;
      case ReduceOp::kProd:
        apply<T>(out, x, y, n, [](T x, T y) { return static_cast<T>(wide<T>(x) * wide<T>(y)); });
        break;
    }
  }
}

// bfloat16/float16: each step computes in float32 and rounds to the half (a ring's partial sums
// are rounded once per hop, as XLA's bf16 all-reduce on CPU).
template <typename T>
void reduce_half(ReduceOp op, std::byte* out, const std::byte* x, const std::byte* y, int64_t n) {
  apply<T>(out, x, y, n, [op](T a, T b) {
    const float fa = static_cast<float>(a), fb = static_cast<float>(b);
    switch (op) {
      case ReduceOp::kSum:
        return T(fa + fb);
      case ReduceOp::kMax:
        return T(std::max(fa, fb));
      case ReduceOp::kMin:
        return T(std::min(fa, fb));
      case ReduceOp::kProd:
        break;
    }
    return T(fa * fb);
  });
}

}  // namespace

void reduce(DType dtype, ReduceOp op, std::byte* out, const std::byte* a, const std::byte* b, int64_t n) {
  switch (dtype) {
    case DType::kF32:
      reduce_typed<float>(op, out, a, b, n);
      break;
    case DType::kF64:
      reduce_typed<double>(op, out, a, b, n);
      break;
    case DType::kI32:
      reduce_typed<int32_t>(op, out, a, b, n);
      break;
    case DType::kI64:
      reduce_typed<int64_t>(op, out, a, b, n);
      break;
    case DType::kBool:
      reduce_typed<bool>(op, out, a, b, n);
      break;
    case DType::kU32:
      reduce_typed<uint32_t>(op, out, a, b, n);
      break;
    case DType::kBF16:
      reduce_half<BFloat16>(op, out, a, b, n);
      break;
    case DType::kF16:
      reduce_half<Float16>(op, out, a, b, n);
      break;
    case DType::kU8:
      reduce_typed<uint8_t>(op, out, a, b, n);
      break;
    case DType::kI8:
      reduce_typed<int8_t>(op, out, a, b, n);
      break;
    case DType::kI16:
      reduce_typed<int16_t>(op, out, a, b, n);
      break;
  }
}

}  // namespace tessera

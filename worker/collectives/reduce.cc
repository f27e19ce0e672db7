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
    return static_cast<std::make_unsigned_t<T>>(x);
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
  }
}

}  // namespace tessera

// DType: the element types Tessera arrays can hold.
//
//   DType t = dtype_of<float>();          // DType::kF32
//   dtype_size(t) == 4; dtype_name(t) == "float32"
#ifndef TESSERA_CORE_DTYPE_H_
#define TESSERA_CORE_DTYPE_H_

#include <cstdint>
#include <string>

namespace tessera {

enum class DType : uint8_t { kF32, kF64, kI32, kI64, kBool, kU32 };

// Every DType, in enum order.
inline constexpr DType kAllDTypes[] = {DType::kF32, DType::kF64, DType::kI32, DType::kI64, DType::kBool, DType::kU32};

// Bytes per element (bool is one byte, as in numpy).
int64_t dtype_size(DType dtype);

// numpy's name: "float32", "float64", "int32", "int64", "bool", "uint32".
std::string dtype_name(DType dtype);

// float32 or float64.
inline bool is_floating(DType d) { return d == DType::kF32 || d == DType::kF64; }

// jnp.promote_types: the dtype a binary op on `a` and `b` computes in, their join on JAX's
// promotion lattice (bool -> int32 -> int64 -> float32 -> float64 and bool -> uint32 -> int64
// for these dtypes: int32 meeting uint32 gives int64, an integer meeting float32 gives
// float32, not float64 as in numpy).
DType promote_types(DType a, DType b);

// The DType of a C++ element type: float, double, int32_t, int64_t, bool or uint32_t (any other type
// does not build).
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::kF32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::kF64;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::kI32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::kI64;
}
template <>
constexpr DType dtype_of<bool>() {
  return DType::kBool;
}
template <>
constexpr DType dtype_of<uint32_t>() {
  return DType::kU32;
}

}  // namespace tessera

#endif  // TESSERA_CORE_DTYPE_H_

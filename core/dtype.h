// DType: the element types Tessera arrays can hold.
//
//   DType t = dtype_of<float>();          // DType::kF32
//   dtype_size(t) == 4; dtype_name(t) == "float32"
#ifndef TESSERA_CORE_DTYPE_H_
#define TESSERA_CORE_DTYPE_H_

#include <cstdint>
#include <string>

#include "core/float16.h"

namespace tessera {

enum class DType : uint8_t { kF32, kF64, kI32, kI64, kBool, kU32, kBF16, kF16, kU8, kI8, kI16 };

// Every DType, in enum order.
inline constexpr DType kAllDTypes[] = {DType::kF32,  DType::kF64, DType::kI32, DType::kI64, DType::kBool, DType::kU32,
                                       DType::kBF16, DType::kF16, DType::kU8,  DType::kI8,  DType::kI16};
inline constexpr DType kLastDType = DType::kI16;

// Bytes per element (bool is one byte, as in numpy).
int64_t dtype_size(DType dtype);

// numpy's name: "float32", "float64", "int32", "int64", "bool", "uint32", "bfloat16",
// "float16", "uint8", "int8", "int16" (ml_dtypes' and JAX's for bfloat16).
std::string dtype_name(DType dtype);

// float32, float64, bfloat16 or float16.
inline bool is_floating(DType d) {
  return d == DType::kF32 || d == DType::kF64 || d == DType::kBF16 || d == DType::kF16;
}
// bfloat16 or float16: storage types, computed on in float32 and rounded back.
inline bool is_half(DType d) { return d == DType::kBF16 || d == DType::kF16; }

// jnp.promote_types: the dtype a binary op on `a` and `b` computes in, their join on JAX's
// promotion lattice (jax/_src/dtypes.py, _type_promotion_lattice, "standard" mode; the table
// of docs/type_promotion.rst), restricted to these dtypes:
//   bool -> uint8 -> {int16, uint32},  bool -> int8 -> int16 -> int32 -> int64,
//   uint32 -> int64,  int64 -> {bfloat16, float16} -> float32 -> float64.
// So int8 with uint8 gives int16, int32 with uint32 int64, bfloat16 with float16 float32, and
// any integer with a float keeps the float (int32 with bfloat16 is bfloat16, with float32
// float32, not float64 as in numpy). The lattice's uint16 and uint64 do not exist here; no
// join of these dtypes passes through them.
DType promote_types(DType a, DType b);

// The DType of a C++ element type: float, double, int32_t, int64_t, bool, uint32_t, BFloat16,
// Float16, uint8_t, int8_t or int16_t (any other type does not build).
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
template <>
constexpr DType dtype_of<BFloat16>() {
  return DType::kBF16;
}
template <>
constexpr DType dtype_of<Float16>() {
  return DType::kF16;
}
template <>
constexpr DType dtype_of<uint8_t>() {
  return DType::kU8;
}
template <>
constexpr DType dtype_of<int8_t>() {
  return DType::kI8;
}
template <>
constexpr DType dtype_of<int16_t>() {
  return DType::kI16;
}

}  // namespace tessera

#endif  // TESSERA_CORE_DTYPE_H_

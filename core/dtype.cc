#include "core/dtype.h"

namespace tessera {
namespace {

constexpr int kNumDTypes = static_cast<int>(kLastDType) + 1;
constexpr uint32_t bit(DType d) { return 1u << static_cast<int>(d); }

// The dtypes directly above `d` on the lattice (core/dtype.h).
uint32_t parents(DType d) {
  switch (d) {
    case DType::kBool:
      return bit(DType::kU8) | bit(DType::kI8);
    case DType::kU8:
      return bit(DType::kI16) | bit(DType::kU32);  // through uint16, which does not exist here
    case DType::kI8:
      return bit(DType::kI16);
    case DType::kI16:
      return bit(DType::kI32);
    case DType::kI32:
    case DType::kU32:
      return bit(DType::kI64);
    case DType::kI64:
      return bit(DType::kBF16) | bit(DType::kF16);  // through the weak float
    case DType::kBF16:
    case DType::kF16:
      return bit(DType::kF32);
    case DType::kF32:
      return bit(DType::kF64);
    case DType::kF64:
      return 0;
  }
  return 0;
}

// `d` and every dtype above it.
uint32_t upper_set(DType d) {
  uint32_t set = bit(d), frontier = bit(d);
  while (frontier != 0) {
    uint32_t next = 0;
    for (int i = 0; i < kNumDTypes; ++i) {
      if (frontier & (1u << i)) next |= parents(static_cast<DType>(i));
    }
    frontier = next & ~set;
    set |= next;
  }
  return set;
}

}  // namespace

DType promote_types(DType a, DType b) {
  // The join is the common upper bound whose own upper set is all of them (a lattice has one).
  const uint32_t common = upper_set(a) & upper_set(b);
  for (int i = 0; i < kNumDTypes; ++i) {
    if ((common & (1u << i)) && upper_set(static_cast<DType>(i)) == common) return static_cast<DType>(i);
  }
  return DType::kF64;  // unreachable: float64 is above everything
}

int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kF64:
      return 8;
    case DType::kI32:
    case DType::kU32:
      return 4;
    case DType::kI64:
      return 8;
    case DType::kBool:
    case DType::kU8:
    case DType::kI8:
      return 1;
    case DType::kBF16:
    case DType::kF16:
    case DType::kI16:
      return 2;
  }
  return 0;
}

std::string dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF64:
      return "float64";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kBool:
      return "bool";
    case DType::kU32:
      return "uint32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kU8:
      return "uint8";
    case DType::kI8:
      return "int8";
    case DType::kI16:
      return "int16";
  }
  return "invalid";
}

}  // namespace tessera

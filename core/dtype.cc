#include "core/dtype.h"

namespace tessera {

DType promote_types(DType a, DType b) {
  // The one pair the chain below does not order: neither holds the other's values.
  if ((a == DType::kI32 && b == DType::kU32) || (a == DType::kU32 && b == DType::kI32)) return DType::kI64;
  auto rank = [](DType d) {
    switch (d) {
      case DType::kBool:
        return 0;
      case DType::kI32:
      case DType::kU32:
        return 1;
      case DType::kI64:
        return 2;
      case DType::kF32:
        return 3;
      case DType::kF64:
        return 4;
    }
    return 0;
  };
  return rank(a) >= rank(b) ? a : b;
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
      return 1;
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
  }
  return "invalid";
}

}  // namespace tessera

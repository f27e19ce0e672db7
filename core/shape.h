// Shape: the extent of each dimension of an array, outermost first (row-major).
//
//   Shape s = {16, 8};
//   num_elements(s) == 128; shape_to_string(s) == "(16, 8)"; shape_to_string({4}) == "(4,)"
#ifndef TESSERA_CORE_SHAPE_H_
#define TESSERA_CORE_SHAPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace tessera {

using Shape = std::vector<int64_t>;

// Product of the dimensions (1 for a scalar). REQUIRES: validate_shape(shape) is OK.
int64_t num_elements(const Shape& shape);

// Python's tuple notation, as JAX prints shapes: "(16, 8)", "(4,)", "()".
std::string shape_to_string(const Shape& shape);

// INVALID_ARGUMENT, prefixed with `where`, when a dimension is negative or the byte size of
// an array of this shape with `elem_size`-byte elements would overflow int64.
absl::Status validate_shape(const Shape& shape, int64_t elem_size, absl::string_view where);

}  // namespace tessera

#endif  // TESSERA_CORE_SHAPE_H_

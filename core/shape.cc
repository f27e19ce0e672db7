#include "core/shape.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {

int64_t num_elements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_to_string(const Shape& shape) {
  if (shape.size() == 1) return absl::StrCat("(", shape[0], ",)");
  return absl::StrCat("(", absl::StrJoin(shape, ", "), ")");
}

absl::Status validate_shape(const Shape& shape, int64_t elem_size, absl::string_view where) {
  int64_t bytes = elem_size;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": dimension ", i, " of shape ", shape_to_string(shape), " is negative"));
    }
    if (shape[i] != 0 && bytes > std::numeric_limits<int64_t>::max() / shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": shape ", shape_to_string(shape), " is too large (over 2^63 bytes)"));
    }
    bytes *= shape[i];
  }
  return absl::OkStatus();
}

}  // namespace tessera

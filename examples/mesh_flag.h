// The examples' --mesh=DATAxMODEL flag ("4x2", "8x1", "1x1"): the mesh's two axis sizes.
#ifndef TESSERA_EXAMPLES_MESH_FLAG_H_
#define TESSERA_EXAMPLES_MESH_FLAG_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace tessera {

// {data, model}; INVALID_ARGUMENT naming the value unless it is two positive sizes joined by 'x'.
inline absl::StatusOr<std::pair<int64_t, int64_t>> parse_mesh_flag(const std::string& value) {
  std::vector<std::string> parts = absl::StrSplit(value, 'x');
  int64_t data = 0, model = 0;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &data) || !absl::SimpleAtoi(parts[1], &model) || data < 1 ||
      model < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--mesh=", value, " is not DATAxMODEL (e.g. 4x2 or 1x1)"));
  }
  return std::make_pair(data, model);
}

}  // namespace tessera

#endif  // TESSERA_EXAMPLES_MESH_FLAG_H_

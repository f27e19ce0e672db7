#include "core/axis_set_repr.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {

std::string axis_set_repr(const std::vector<std::string>& axes) {
  return absl::StrCat(
      "{", absl::StrJoin(axes, ", ", [](std::string* out, const std::string& a) { absl::StrAppend(out, "'", a, "'"); }),
      "}");
}

}  // namespace tessera

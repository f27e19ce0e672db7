#include "core/axis_set_repr.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {
namespace {

std::string quoted(const std::vector<std::string>& axes) {
  return absl::StrJoin(axes, ", ", [](std::string* out, const std::string& a) { absl::StrAppend(out, "'", a, "'"); });
}

}  // namespace

std::string axis_set_repr(const std::vector<std::string>& axes) { return absl::StrCat("{", quoted(axes), "}"); }

std::string axis_frozenset_repr(const std::vector<std::string>& axes) {
  return axes.empty() ? "frozenset()" : absl::StrCat("frozenset(", axis_set_repr(axes), ")");
}

std::string axis_tuple_repr(const std::vector<std::string>& axes) {
  return absl::StrCat("(", quoted(axes), axes.size() == 1 ? ",)" : ")");
}

}  // namespace tessera

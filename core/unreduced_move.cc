#include "core/unreduced_move.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {

absl::Status check_unreduced_move(const NamedSharding& from, const NamedSharding& to) {
  const std::vector<std::string>& axes = from.spec().unreduced();
  if (axes.empty()) return absl::OkStatus();
  bool same = to.spec().unreduced() == axes;
  for (const std::string& axis : axes) {
    if (!same) break;
    same = to.mesh().axis_index(axis) >= 0 && to.mesh().axis_size(axis) == from.mesh().axis_size(axis);
  }
  if (same) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "an array unreduced over ", absl::StrJoin(axes, ", "), " (", from.spec().to_string(), " on ",
      from.mesh().to_string(), ") moves only onto the same unreduced axes of the same sizes, not onto ",
      to.spec().to_string(), " on ", to.mesh().to_string(), ": its devices along them hold terms of a sum"));
}

}  // namespace tessera

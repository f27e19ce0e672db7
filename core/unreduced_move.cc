#include "core/unreduced_move.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/axis_set_repr.h"

namespace tessera {

absl::Status check_unreduced_move(const NamedSharding& from, const NamedSharding& to) {
  const std::vector<std::string>& axes = from.spec().unreduced();
  if (axes.empty() && to.spec().unreduced().empty()) return absl::OkStatus();
  if (axes.empty()) {
    // A move copies values: onto unreduced axes each device along them would hold the whole
    // value, so the sum they stand for would count it once per device (JAX puts the value on
    // the first device and zeros on the others: a cast, not a move).
    return absl::InvalidArgumentError(
        absl::StrCat("an array that is not unreduced (", from.spec().to_string(), " on ", from.mesh().to_string(),
                     ") moves only onto a sharding without unreduced axes, not onto ", to.spec().to_string(), " on ",
                     to.mesh().to_string(), ": its devices along ", axis_set_repr(to.spec().unreduced()),
                     " would each hold the whole value of their sum"));
  }
  bool same = to.spec().unreduced() == axes;
  for (const std::string& axis : axes) {
    if (!same) break;
    same = to.mesh().axis_index(axis) >= 0 && to.mesh().axis_size(axis) == from.mesh().axis_size(axis);
  }
  if (same) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "an array unreduced over ", axis_set_repr(axes), " (", from.spec().to_string(), " on ", from.mesh().to_string(),
      ") moves only onto the same unreduced axes of the same sizes, not onto ", to.spec().to_string(), " on ",
      to.mesh().to_string(), ": its devices along them hold terms of a sum"));
}

}  // namespace tessera

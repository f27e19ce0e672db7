// A list in an error message or a log line, bounded: the first `limit` items joined, then
// "and K more", so that a message about thousands of devices or arrays still fits gRPC's 8 KiB
// status trailer and stays readable.
//
//   join_at_most(std::vector<int>{3, 5, 8}, 2)            // "3, 5 and 1 more"
//   join_at_most(devices, 32, ", ", [](std::string* out, const auto& d) {
//     absl::StrAppend(out, d.first);
//   });
#ifndef TESSERA_CORE_BOUNDED_JOIN_H_
#define TESSERA_CORE_BOUNDED_JOIN_H_

#include <cstddef>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace tessera {

// The first `limit` items of `items` (any range with std::size), each appended by
// `format(&text, item)`, separated by `separator`; " and K more" when K items were left out
// ("K more" when none is named).
template <typename Range, typename Formatter>
std::string join_at_most(const Range& items, size_t limit, absl::string_view separator, Formatter&& format) {
  std::string text;
  size_t named = 0;
  for (const auto& item : items) {
    if (named == limit) break;
    if (named++ > 0) text.append(separator.data(), separator.size());
    format(&text, item);
  }
  const size_t total = static_cast<size_t>(std::size(items));
  if (total > named) absl::StrAppend(&text, named > 0 ? " and " : "", total - named, " more");
  return text;
}

// The same with the items formatted as absl::StrCat formats them.
template <typename Range>
std::string join_at_most(const Range& items, size_t limit, absl::string_view separator = ", ") {
  return join_at_most(items, limit, separator, absl::AlphaNumFormatter());
}

}  // namespace tessera

#endif  // TESSERA_CORE_BOUNDED_JOIN_H_

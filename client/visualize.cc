#include "tessera/visualize.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace tessera {
namespace {

// The picture JAX draws for a square array: 25 columns wide and 10 lines tall in all, split
// in proportion to the blocks; a tile is never narrower than its label.
constexpr int kFullWidth = 25;
constexpr int kFullHeight = 10;

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

std::string centered(const std::string& label, int width) {
  const int left = (width - static_cast<int>(label.size())) / 2;
  return std::string(left, ' ') + label + std::string(width - left - label.size(), ' ');
}

}  // namespace

absl::StatusOr<std::string> visualize_sharding(const Shape& shape, const NamedSharding& sharding) {
  if (shape.size() != 1 && shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("visualize_sharding: only 1-D and 2-D arrays can be drawn; got shape ", shape_to_string(shape)));
  }
  TESSERA_RETURN_IF_ERROR(sharding.validate(shape));
  const bool two_d = shape.size() == 2;
  const int64_t rows = two_d ? shape[0] : 1;
  const int64_t cols = two_d ? shape[1] : shape[0];

  // Tiles keyed by (row start, column start) -> devices holding that block.
  std::map<int64_t, int64_t> row_sizes, col_sizes;
  std::map<std::pair<int64_t, int64_t>, std::set<int>> tiles;
  for (const DeviceShard& s : sharding.device_shards(shape)) {
    const Slice r = two_d ? s.index[0] : Slice{0, 1};
    const Slice c = two_d ? s.index[1] : s.index[0];
    row_sizes[r.start] = r.stop - r.start;
    col_sizes[c.start] = c.stop - c.start;
    tiles[{r.start, c.start}].insert(s.device_id);
  }
  std::map<std::pair<int64_t, int64_t>, std::string> labels;
  for (const auto& [key, devices] : tiles) labels[key] = absl::StrCat("CPU ", absl::StrJoin(devices, ","));

  std::vector<int> widths, heights;
  for (const auto& [col, size] : col_sizes) {
    int width = cols == 0 ? kFullWidth - 2 : static_cast<int>(kFullWidth * size / cols) - 2;
    for (const auto& [row, unused] : row_sizes) {
      width = std::max<int>(width, static_cast<int>(labels[{row, col}].size()));
    }
    widths.push_back(std::max(width, 1));
  }
  for (const auto& [row, size] : row_sizes) {
    heights.push_back(two_d && rows > 0 ? std::max<int>(1, static_cast<int>(kFullHeight * size / rows) - 1) : 1);
  }

  auto rule = [&](const char* left, const char* mid, const char* right) {
    std::string line = left;
    for (size_t i = 0; i < widths.size(); ++i) {
      line += repeat("─", widths[i]);
      line += i + 1 < widths.size() ? mid : right;
    }
    return line + "\n";
  };
  std::string out = rule("┌", "┬", "┐");
  size_t r = 0;
  for (const auto& [row, unused] : row_sizes) {
    const int h = heights[r];
    for (int line = 0; line < h; ++line) {
      out += "│";
      size_t c = 0;
      for (const auto& [col, unused2] : col_sizes) {
        out += line == (h - 1) / 2 ? centered(labels[{row, col}], widths[c]) : std::string(widths[c], ' ');
        out += "│";
        ++c;
      }
      out += "\n";
    }
    if (++r < row_sizes.size()) out += rule("├", "┼", "┤");
  }
  out += rule("└", "┴", "┘");
  return out;
}

absl::StatusOr<std::string> visualize_array_sharding(const Array& array) {
  return visualize_sharding(array.shape(), array.sharding());
}

}  // namespace tessera

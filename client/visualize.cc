#include "tessera/visualize.h"

#include <algorithm>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status.h"

namespace tessera {
namespace {

// jax/_src/debugging.py's visualize_sharding with its defaults (scale 1, min_width 9,
// max_width 80) and no colour: the picture JAX prints when its output is not a colour terminal,
// as JAX's own tests check it (tests/debugging_primitives_test.py, VisualizeShardingTest).
constexpr int kBaseHeight = 10;
constexpr double kHeightToWidthRatio = 2.5;
constexpr int kMinWidth = 9;
constexpr int kMaxWidth = 80;

// Python's divmod: the quotient rounds towards minus infinity, the remainder has b's sign.
std::pair<int, int> floor_divmod(int a, int b) {
  int q = a / b, r = a % b;
  if (r != 0 && (r < 0) != (b < 0)) --q, r += b;
  return {q, r};
}

std::string repeat(const std::string& s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

// One cell of rich's table: the label and the padding debugging.py asks for around it.
struct Cell {
  std::string label;
  int left = 0, right = 0, top = 0, bottom = 0;
  int width() const { return left + static_cast<int>(label.size()) + right; }
};

}  // namespace

absl::StatusOr<std::string> visualize_sharding(const Shape& shape, const NamedSharding& sharding) {
  if (shape.size() != 1 && shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("visualize_sharding: only 1-D and 2-D arrays can be drawn; got shape ", shape_to_string(shape)));
  }
  for (int64_t d : shape) {
    if (d == 0) {
      return absl::InvalidArgumentError(absl::StrCat("visualize_sharding: the array of shape ", shape_to_string(shape),
                                                     " is empty; there is nothing to draw"));
    }
  }
  TESSERA_RETURN_IF_ERROR(sharding.validate(shape));
  const bool two_d = shape.size() == 2;

  // Blocks keyed by (row start, column start) -> the devices holding it, and each row's and
  // column's extent.
  std::map<int64_t, int64_t> row_sizes, col_sizes;
  std::map<std::pair<int64_t, int64_t>, std::set<int>> tiles;
  for (const DeviceShard& s : sharding.device_shards(shape)) {
    const Slice r = two_d ? s.index[0] : Slice{0, 1};
    const Slice c = two_d ? s.index[1] : s.index[0];
    row_sizes[r.start] = r.stop - r.start;
    col_sizes[c.start] = c.stop - c.start;
    tiles[{r.start, c.start}].insert(s.device_id);
  }

  // debugging.py's sizes: the picture is base_height lines tall and base_height * (columns /
  // rows) * 2.5 characters wide, each tile its share of that, at least 9 and at most 80 wide.
  const double aspect_ratio = static_cast<double>(two_d ? shape[1] : 1) / static_cast<double>(shape[0]);
  const int base_width = static_cast<int>(kBaseHeight * aspect_ratio);
  std::vector<std::vector<Cell>> rows;
  for (const auto& [row, row_size] : row_sizes) {
    std::vector<Cell>& cells = rows.emplace_back();
    for (const auto& [col, col_size] : col_sizes) {
      Cell cell;
      cell.label = absl::StrCat("CPU ", absl::StrJoin(tiles[{row, col}], ","));
      const double chunk_width = static_cast<double>(col_size) / static_cast<double>(two_d ? shape[1] : shape[0]);
      int width = static_cast<int>(chunk_width * base_width * kHeightToWidthRatio);
      const int height =
          two_d ? static_cast<int>(static_cast<double>(row_size) / static_cast<double>(shape[0]) * kBaseHeight) : 1;
      width = std::min(std::max(width, kMinWidth), kMaxWidth);
      auto [left, extra] = floor_divmod(width - static_cast<int>(cell.label.size()) - 2, 2);
      auto [top, extra_lines] = floor_divmod(height - 2, 2);
      cell.left = std::max(left, 0);
      cell.right = std::max(left + extra, 0);
      cell.top = std::max(top, 0);
      cell.bottom = std::max(top + extra_lines, 0);
      cells.push_back(std::move(cell));
    }
  }

  // rich's table (box.SQUARE, show_lines, no cell padding of its own): a column is as wide as
  // its widest padded cell; a cell narrower than its column centres its label in the room
  // between its own paddings (rich.align: the odd space goes right).
  std::vector<int> widths(col_sizes.size(), 0);
  for (const std::vector<Cell>& cells : rows) {
    for (size_t c = 0; c < cells.size(); ++c) widths[c] = std::max(widths[c], cells[c].width());
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
  for (size_t r = 0; r < rows.size(); ++r) {
    const std::vector<Cell>& cells = rows[r];
    int height = 0;
    for (const Cell& cell : cells) height = std::max(height, cell.top + 1 + cell.bottom);
    for (int line = 0; line < height; ++line) {
      out += "│";
      for (size_t c = 0; c < cells.size(); ++c) {
        const Cell& cell = cells[c];
        if (line != cell.top) {
          out += std::string(widths[c], ' ');
        } else {
          const int room = widths[c] - cell.left - cell.right;
          const int excess = room - static_cast<int>(cell.label.size());
          out += std::string(cell.left + excess / 2, ' ') + cell.label +
                 std::string(excess - excess / 2 + cell.right, ' ');
        }
        out += "│";
      }
      out += "\n";
    }
    out += r + 1 < rows.size() ? rule("├", "┼", "┤") : rule("└", "┴", "┘");
  }
  return out;
}

absl::StatusOr<std::string> visualize_array_sharding(const Array& array) {
  return visualize_sharding(array.shape(), array.sharding());
}

}  // namespace tessera

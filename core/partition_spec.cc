#include "core/partition_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {
namespace {

const Axes& empty_axes() {
  static const Axes* const kEmpty = new Axes();
  return *kEmpty;
}

}  // namespace

const Axes& PartitionSpec::axes(int d) const { return d >= 0 && d < size() ? dims_[d] : empty_axes(); }

std::vector<std::string> PartitionSpec::used_axes() const {
  std::vector<std::string> out;
  for (const Axes& axes : dims_) out.insert(out.end(), axes.begin(), axes.end());
  return out;
}

std::string PartitionSpec::to_string() const {
  std::vector<std::string> parts;
  for (const Axes& axes : dims_) {
    if (axes.empty()) {
      parts.push_back("None");
    } else if (axes.size() == 1) {
      parts.push_back(absl::StrCat("'", axes[0], "'"));
    } else {
      parts.push_back(absl::StrCat(
          "(",
          absl::StrJoin(axes, ", ", [](std::string* out, const std::string& a) { absl::StrAppend(out, "'", a, "'"); }),
          ")"));
    }
  }
  // JAX prints the spec's tuple: one entry keeps Python's trailing comma, P('data',).
  std::string tail = dims_.size() == 1 ? "," : "";
  return absl::StrCat("P(", absl::StrJoin(parts, ", "), tail, ")");
}

}  // namespace tessera

#include "core/partition_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tessera {
namespace {

const Axes& empty_axes() {
  static const Axes* const kEmpty = new Axes();
  return *kEmpty;
}

size_t significant_size(const std::vector<Axes>& dims) {
  size_t n = dims.size();
  while (n > 0 && dims[n - 1].empty()) --n;
  return n;
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

bool PartitionSpec::operator==(const PartitionSpec& other) const {
  size_t n = significant_size(dims_);
  if (n != significant_size(other.dims_)) return false;
  for (size_t i = 0; i < n; ++i) {
    if (dims_[i] != other.dims_[i]) return false;
  }
  return true;
}

}  // namespace tessera

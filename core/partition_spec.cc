#include "core/partition_spec.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/axis_set_repr.h"

namespace tessera {
namespace {

const Axes& empty_axes() {
  static const Axes* const kEmpty = new Axes();
  return *kEmpty;
}

// Sorted, each once: JAX's frozenset, with an order to print and compare by.
std::vector<std::string> axis_set(std::vector<std::string> axes) {
  std::sort(axes.begin(), axes.end());
  axes.erase(std::unique(axes.begin(), axes.end()), axes.end());
  return axes;
}

// Python's repr of the entries' tuple, as partition_spec.py prints it in its messages.
std::string partitions_repr(const std::vector<Axes>& dims) {
  std::string out = PartitionSpec(dims).to_string();  // "P(...)"
  out = out.substr(2, out.size() - 3);
  return absl::StrCat("(", out, ")");
}

}  // namespace

PartitionSpec::PartitionSpec(std::vector<Axes> dims, std::vector<std::string> unreduced,
                             std::vector<std::string> reduced)
    : dims_(std::move(dims)), unreduced_(axis_set(std::move(unreduced))), reduced_(axis_set(std::move(reduced))) {}

PartitionSpec PartitionSpec::with_unreduced(std::vector<std::string> unreduced) const {
  return PartitionSpec(dims_, std::move(unreduced), reduced_);
}

PartitionSpec PartitionSpec::with_reduced(std::vector<std::string> reduced) const {
  return PartitionSpec(dims_, unreduced_, std::move(reduced));
}

absl::Status PartitionSpec::check() const {
  // jax/_src/partition_spec.py, _check (its words; its sets printed sorted).
  for (const std::string& u : unreduced_) {
    if (std::binary_search(reduced_.begin(), reduced_.end(), u)) {
      return absl::InvalidArgumentError(
          absl::StrCat("`unreduced` and `reduced` argument to PartitionSpec cannot overlap. Got unreduced: ",
                       axis_frozenset_repr(unreduced_), " and reduced: ", axis_frozenset_repr(reduced_)));
    }
  }
  for (const Axes& axes : dims_) {
    for (const std::string& a : axes) {
      if (std::binary_search(unreduced_.begin(), unreduced_.end(), a)) {
        return absl::InvalidArgumentError(
            absl::StrCat("partitions cannot overlap with unreduced axes passed to PartitionSpec. Got partitions: ",
                         partitions_repr(dims_), " and unreduced axes: ", axis_frozenset_repr(unreduced_)));
      }
      if (std::binary_search(reduced_.begin(), reduced_.end(), a)) {
        return absl::InvalidArgumentError(
            absl::StrCat("partitions cannot overlap with reduced axes passed to PartitionSpec. Got partitions: ",
                         partitions_repr(dims_), " and reduced axes: ", axis_frozenset_repr(reduced_)));
      }
    }
  }
  return absl::OkStatus();
}

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
  std::string entries = absl::StrCat(absl::StrJoin(parts, ", "), tail);
  if (unreduced_.empty() && reduced_.empty()) return absl::StrCat("P(", entries, ")");
  // P.__repr__: the entries, then unreduced / reduced, then unreduced_kind (sum, the default
  // when unreduced is not empty): "P('x', unreduced={'y'}, unreduced_kind=sum)".
  std::vector<std::string> extra;
  if (!entries.empty()) extra.push_back(tail.empty() ? entries : parts[0]);
  if (!unreduced_.empty()) extra.push_back(absl::StrCat("unreduced=", axis_set_repr(unreduced_)));
  if (!reduced_.empty()) extra.push_back(absl::StrCat("reduced=", axis_set_repr(reduced_)));
  if (!unreduced_.empty()) extra.push_back("unreduced_kind=sum");
  return absl::StrCat("P(", absl::StrJoin(extra, ", "), ")");
}

}  // namespace tessera

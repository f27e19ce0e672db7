// PartitionSpec: for each array dimension, the mesh axes it is split over, as
// jax.sharding.PartitionSpec.
//
// An entry is None (not split), one axis, or several axes major-to-minor. Specs compare as
// written, as JAX's do: P('data') != P('data', None), although both lay a matrix out alike
// (NamedSharding::is_equivalent_to says so).
//
//   PartitionSpec a = P("data", None);             // P('data', None)
//   PartitionSpec b = P(Axes{"data", "model"});    // P(('data', 'model'),)
//   PartitionSpec c = P();                         // fully replicated
//   PartitionSpec d = P("X", None).with_unreduced({"Y"});
//                              // P('X', None, unreduced={'Y'}, unreduced_kind=sum)
//
// Besides its entries a spec may name `unreduced` and `reduced` mesh axes, as JAX's
// `P(..., unreduced={'Y'}, reduced={'Z'})`: an array unreduced over Y holds, on the devices
// along Y, terms whose sum is its value (a reduction waiting to happen; Tessera's only
// unreduced_kind is sum); one reduced over Z is laid out as a replicated one and differs
// only in its cotangent's type (jax/_src/partition_spec.py, docs/new_docs/301/sharding-ad.md).
#ifndef TESSERA_CORE_PARTITION_SPEC_H_
#define TESSERA_CORE_PARTITION_SPEC_H_

#include <string>
#include <vector>

#include "absl/status/status.h"

namespace tessera {

// The mesh axes of one dimension, major-to-minor; empty means None.
using Axes = std::vector<std::string>;

// The type of None.
struct NoneType {};
// Spells a dimension that is not split: P("data", None).
inline constexpr NoneType None{};

// One argument of P(...): None, one axis name, or Axes{...}.
class SpecEntry {
 public:
  SpecEntry(NoneType) {}
  SpecEntry(const char* axis) : axes_{axis} {}
  SpecEntry(std::string axis) : axes_{std::move(axis)} {}
  SpecEntry(Axes axes) : axes_(std::move(axes)) {}
  const Axes& axes() const { return axes_; }

 private:
  Axes axes_;
};

// A value type. Holds axis names only: whether they exist in a mesh is checked by
// NamedSharding::validate_spec.
class PartitionSpec {
 public:
  // P(): fully replicated.
  PartitionSpec() = default;
  // One entry per dimension; an empty Axes is None.
  explicit PartitionSpec(std::vector<Axes> dims) : dims_(std::move(dims)) {}
  // With unreduced and reduced axes (each kept sorted, once).
  PartitionSpec(std::vector<Axes> dims, std::vector<std::string> unreduced, std::vector<std::string> reduced);

  // Number of entries as written, trailing Nones included.
  int size() const { return static_cast<int>(dims_.size()); }
  // The axes of dimension d; empty (None) for d >= size().
  const Axes& axes(int d) const;
  const std::vector<Axes>& dims() const { return dims_; }

  // Every axis used, in order of appearance (repeats included). Unreduced and reduced
  // axes split no dimension and are not listed.
  std::vector<std::string> used_axes() const;

  // The unreduced / reduced mesh axes, sorted; empty for an ordinary spec.
  const std::vector<std::string>& unreduced() const { return unreduced_; }
  const std::vector<std::string>& reduced() const { return reduced_; }
  bool has_unreduced_or_reduced() const { return !unreduced_.empty() || !reduced_.empty(); }
  // This spec's entries with these unreduced / reduced axes (JAX's spec.update(unreduced=...)).
  PartitionSpec with_unreduced(std::vector<std::string> unreduced) const;
  PartitionSpec with_reduced(std::vector<std::string> reduced) const;
  // The entries alone (JAX's P(*spec.partitions)).
  PartitionSpec partitions_only() const { return PartitionSpec(dims_); }

  // JAX's checks at construction (partition_spec.py's _check), INVALID_ARGUMENT with its
  // words: an axis both unreduced and reduced, or an entry's axis also unreduced or reduced.
  // Whether the axes exist in a mesh, and are Explicit, NamedSharding::validate_spec checks.
  absl::Status check() const;

  // "P('data', None)", "P(('data', 'model'),)", "P()", as JAX prints specs; entries as
  // written, trailing Nones included; then "unreduced={'Y'}, reduced={'Z'},
  // unreduced_kind=sum" as JAX's repr (sets printed sorted, where Python's order is its hash's).
  std::string to_string() const;

  // Equal entries, as written (trailing Nones count), and equal unreduced and reduced axes,
  // as jax.sharding.PartitionSpec.
  bool operator==(const PartitionSpec& other) const {
    return dims_ == other.dims_ && unreduced_ == other.unreduced_ && reduced_ == other.reduced_;
  }
  bool operator!=(const PartitionSpec& other) const { return !(*this == other); }

 private:
  std::vector<Axes> dims_;
  std::vector<std::string> unreduced_, reduced_;
};

// jax.sharding.PartitionSpec: P("data", None), P(Axes{"data", "model"}), P().
template <typename... Entries>
PartitionSpec P(Entries... entries) {
  return PartitionSpec(std::vector<Axes>{SpecEntry(std::move(entries)).axes()...});
}

}  // namespace tessera

#endif  // TESSERA_CORE_PARTITION_SPEC_H_

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
#ifndef TESSERA_CORE_PARTITION_SPEC_H_
#define TESSERA_CORE_PARTITION_SPEC_H_

#include <string>
#include <vector>

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

  // Number of entries as written, trailing Nones included.
  int size() const { return static_cast<int>(dims_.size()); }
  // The axes of dimension d; empty (None) for d >= size().
  const Axes& axes(int d) const;
  const std::vector<Axes>& dims() const { return dims_; }

  // Every axis used, in order of appearance (repeats included).
  std::vector<std::string> used_axes() const;

  // "P('data', None)", "P(('data', 'model'),)", "P()", as JAX prints specs; entries as
  // written, trailing Nones included.
  std::string to_string() const;

  // Equal entries, as written (trailing Nones count), as jax.sharding.PartitionSpec.
  bool operator==(const PartitionSpec& other) const { return dims_ == other.dims_; }
  bool operator!=(const PartitionSpec& other) const { return !(*this == other); }

 private:
  std::vector<Axes> dims_;
};

// jax.sharding.PartitionSpec: P("data", None), P(Axes{"data", "model"}), P().
template <typename... Entries>
PartitionSpec P(Entries... entries) {
  return PartitionSpec(std::vector<Axes>{SpecEntry(std::move(entries)).axes()...});
}

}  // namespace tessera

#endif  // TESSERA_CORE_PARTITION_SPEC_H_

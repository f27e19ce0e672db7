// CollectiveSpec: one collective over replica groups of devices — what it computes and the
// shapes it takes and gives. The model only; the workers' engine runs it.
//
//   CollectiveSpec spec;
//   spec.kind = CollectiveKind::kAllReduce;
//   spec.groups = *replica_groups(mesh, {"data"});   // (4, 2) mesh: {0,2,4,6}, {1,3,5,7}
//   absl::StatusOr<Shape> out = collective_output_shape(spec, {1024});   // (1024,)
#ifndef TESSERA_CORE_COLLECTIVE_H_
#define TESSERA_CORE_COLLECTIVE_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/mesh.h"
#include "core/shape.h"

namespace tessera {

// kRaggedAllToAll (lax.ragged_all_to_all, core/op.h) runs only as a plan's instruction, on its
// six operands: its result has the shape of its second (`output`), not one computed from the first.
enum class CollectiveKind {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kAllToAll,
  kCollectivePermute,
  kBroadcast,
  kRaggedAllToAll,  // the last: CollectiveMetrics counts the kinds from it
};

// For bool, kSum and kMax are logical or, kMin and kProd logical and (as XLA's PRED).
enum class ReduceOp { kSum, kMax, kMin, kProd };

// "all_reduce", "all_gather", ...; "sum", "max", "min", "prod".
std::string collective_name(CollectiveKind kind);
std::string reduce_op_name(ReduceOp op);

// One collective: which, over which groups, and its attributes (each field used only by the
// kinds named beside it).
struct CollectiveSpec {
  CollectiveKind kind = CollectiveKind::kAllReduce;
  ReduceOp reduce_op = ReduceOp::kSum;     // all_reduce, reduce_scatter
  std::vector<std::vector<int>> groups;    // device ids; disjoint
  int dimension = 0;                       // all_gather: concat; reduce_scatter: scatter
  int split_dimension = 0;                 // all_to_all
  int concat_dimension = 0;                // all_to_all
  std::vector<std::pair<int, int>> pairs;  // collective_permute: (source, target) device ids
  int root = 0;                            // broadcast: position within each group
};

// The groups of devices that differ only in their coordinates along `axes`; inside a group
// devices are ordered with `axes` major-to-minor, as a psum over those axes sees them.
// INVALID_ARGUMENT for an axis not in the mesh or named twice.
absl::StatusOr<std::vector<std::vector<int>>> replica_groups(const Mesh& mesh, const std::vector<std::string>& axes);

// Checks the spec's own rules, INVALID_ARGUMENT naming the first broken: at least one group;
// non-empty groups, all of one size, disjoint, of non-negative ids; for a permute, sources and
// targets each unique and each pair within one group; for a broadcast, a root inside the
// group. Shapes and dimensions are checked by collective_output_shape.
absl::Status validate_collective(const CollectiveSpec& spec);

// The shape each device's result has, given each device's input shape. INVALID_ARGUMENT
// when a dimension is out of range or not divisible by the group size where it must be.
// REQUIRES: validate_collective(spec) is OK.
absl::StatusOr<Shape> collective_output_shape(const CollectiveSpec& spec, const Shape& input);

// The group holding `device` and the device's position in it; {-1, -1} if none.
std::pair<int, int> find_in_groups(const CollectiveSpec& spec, int device);

}  // namespace tessera

#endif  // TESSERA_CORE_COLLECTIVE_H_

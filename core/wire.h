// Conversions between the core model and its wire form (proto/tessera.proto).
//
// Everything arriving from the wire is validated here: a message that does not describe a
// valid value yields INVALID_ARGUMENT naming the field and the rule it breaks. The generated
// proto types are only forward-declared, so this header stays light.
//
//   pb::NamedSharding msg;  to_proto(sharding, &msg);
//   TESSERA_ASSIGN_OR_RETURN(NamedSharding back, sharding_from_proto(msg));
#ifndef TESSERA_CORE_WIRE_H_
#define TESSERA_CORE_WIRE_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collective.h"
#include "core/dtype.h"
#include "core/graph.h"
#include "core/mesh.h"
#include "core/plan.h"
#include "core/shape.h"
#include "core/sharding.h"

namespace tessera {
namespace pb {
enum DType : int;
class Shape;
class Mesh;
class PartitionSpec;
class NamedSharding;
class CollectiveSpec;
class DevicePlan;
class Instruction;
class Graph;
class KernelNode;
}  // namespace pb

pb::DType to_proto(DType dtype);
absl::StatusOr<DType> dtype_from_proto(int dtype);

void to_proto(const Shape& shape, pb::Shape* out);
// Also checks that the byte size of a `dtype` array of this shape fits int64.
absl::StatusOr<Shape> shape_from_proto(const pb::Shape& shape, DType dtype);

void to_proto(const Mesh& mesh, pb::Mesh* out);
absl::StatusOr<Mesh> mesh_from_proto(const pb::Mesh& mesh);

void to_proto(const PartitionSpec& spec, pb::PartitionSpec* out);
// Any spec decodes; validate it against its mesh and array (NamedSharding::validate).
PartitionSpec spec_from_proto(const pb::PartitionSpec& spec);

void to_proto(const NamedSharding& sharding, pb::NamedSharding* out);
// Validates the mesh and the spec against it (not against any array shape).
absl::StatusOr<NamedSharding> sharding_from_proto(const pb::NamedSharding& sharding);

void to_proto(const CollectiveSpec& spec, pb::CollectiveSpec* out);
// Also runs validate_collective().
absl::StatusOr<CollectiveSpec> collective_from_proto(const pb::CollectiveSpec& spec);

void to_proto(const Graph& graph, pb::Graph* out);
// Rebuilds the graph through Graph's own add_* calls, so a graph from the wire gets every
// check a traced one does; errors name the node.
absl::StatusOr<Graph> graph_from_proto(const pb::Graph& graph);

// The canonical bytes of a compile request: the graph encoded from its decoded form (every
// attribute, constants bit for bit: -0.0, NaN payloads, int64 beyond 2^53), the mesh with its
// device ids, the input specs, the output specs (unset ones included) and the donated inputs
// (REQUIRES: sorted). Two requests that differ in anything the compiler reads have different
// keys; the coordinator's program cache compares whole keys, so no hash collision can hand
// one program's executable to another. The same in every process.
std::string compile_key(const Graph& graph, const Mesh& mesh, const std::vector<PartitionSpec>& inputs,
                        const std::vector<std::optional<PartitionSpec>>& outputs, const std::vector<int>& donated);

void to_proto(const Instruction& instruction, pb::Instruction* out);
// The instruction's wire form, deterministic: two instructions with equal bytes compute the
// same value from the same slots (the compiler's CSE compares these, minus `out`; `cause` is
// never sent).
std::string canonical_bytes(const Instruction& instruction);

void to_proto(const DevicePlan& plan, pb::DevicePlan* out);
// Checks everything a worker relies on before resolving it: known ops and kinds, slots in
// range, every slot read after it is written, valid shapes. A program's collectives are
// checked when a device resolves it (resolve() in core/plan.h runs validate_collective).
absl::StatusOr<DevicePlan> plan_from_proto(const pb::DevicePlan& plan);

}  // namespace tessera

#endif  // TESSERA_CORE_WIRE_H_

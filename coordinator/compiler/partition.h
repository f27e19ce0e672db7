// Partitioning: turns a Graph and its propagated shardings into one SPMD program for all
// devices — a linear list of instructions over numbered buffer slots: local kernels on shard
// shapes, the collectives and local slices that resharding needs, and frees after each slot's
// last use. What differs by device is said symbolically and resolved by each worker
// (core/plan.h), so compile time and program size do not grow with the mesh.
//
//   absl::StatusOr<Propagation> p = propagate(graph, mesh, input_specs, output_specs);
//   absl::StatusOr<Executable> exe = partition(graph, mesh, *p, output_specs);
//   std::cout << exe->as_text();   // the program, each collective with its cause and axes
#ifndef TESSERA_COORDINATOR_COMPILER_PARTITION_H_
#define TESSERA_COORDINATOR_COMPILER_PARTITION_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "coordinator/compiler/propagate.h"
#include "core/collective.h"
#include "core/graph.h"
#include "core/plan.h"
#include "core/sharding.h"

namespace tessera {

struct Executable {
  Mesh mesh;
  std::vector<PartitionSpec> input_specs;
  std::vector<PartitionSpec> output_specs;
  DevicePlan program;            // the one program every device runs, in SPMD form (core/plan.h)
  std::vector<std::string> log;  // notable decisions, e.g. involuntary full rematerialization

  // The program, one instruction per line, collectives annotated with their cause and the
  // mesh axes (or layouts) they run over.
  std::string as_text() const;
  // The plan `device_id` runs (resolve(program, mesh, device_id)) as text: replica groups as
  // device ids, local slices as offsets. resolve()'s errors.
  absl::StatusOr<std::string> device_text(int device_id) const;
};

// `donated`: the inputs (parameter positions) the caller gives up, as jit's donate_argnums;
// their slots are freed after their last use like intermediates, so the worker can write an
// elementwise result over them.
// REQUIRES: `propagation` came from propagate(graph, mesh, ..., outputs); `donated` names
// distinct parameters.
absl::StatusOr<Executable> partition(const Graph& graph, const Mesh& mesh, const Propagation& propagation,
                                     const std::vector<std::optional<PartitionSpec>>& outputs,
                                     const std::vector<int>& donated = {});

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COMPILER_PARTITION_H_

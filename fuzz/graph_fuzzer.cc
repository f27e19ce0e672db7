// Fuzz target: a Compile request as the coordinator decodes it (coordinator_server.cc's
// compile(), up to the compiler): the graph (graph_from_proto), the mesh, the specs and the
// canonical key. A graph that decodes must encode and decode again to the same key.
#include <cstddef>
#include <cstdint>

#include "core/wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pb::CompileRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<Graph> graph = graph_from_proto(req.graph());
  fuzz::check_rejection(graph.status(), "graph_from_proto");
  absl::StatusOr<Mesh> mesh = mesh_from_proto(req.mesh());
  fuzz::check_rejection(mesh.status(), "mesh_from_proto");
  if (!graph.ok() || !mesh.ok()) return 0;
  std::vector<PartitionSpec> inputs;
  for (const pb::PartitionSpec& s : req.input_specs()) inputs.push_back(spec_from_proto(s));
  std::vector<std::optional<PartitionSpec>> outputs;
  for (const pb::OptionalSpec& s : req.output_specs()) {
    outputs.push_back(s.set() ? std::optional<PartitionSpec>(spec_from_proto(s.spec())) : std::nullopt);
  }
  for (const PartitionSpec& s : inputs) fuzz::check_rejection(NamedSharding(*mesh, s).validate_spec(), "validate_spec");
  const std::string key = compile_key(*graph, *mesh, inputs, outputs, {});
  pb::Graph again;
  to_proto(*graph, &again);
  absl::StatusOr<Graph> back = graph_from_proto(again);
  if (!back.ok()) fuzz::fail("a decoded graph does not decode again", back.status().ToString());
  fuzz::check(compile_key(*back, *mesh, inputs, outputs, {}) == key, "the graph's round trip changed its key");
  return 0;
}

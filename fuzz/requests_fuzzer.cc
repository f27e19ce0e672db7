// Fuzz target: the coordinator's checks of CreateArray and RunCollective requests
// (coordinator_server.cc's create_array() and run_collective(), up to the workers), and a
// worker's of a WorkerCollectiveRequest's spec against its input (worker_server.cc).
//
// The input: two bytes (little endian) giving the length of a CreateArrayRequest, that
// request, then a RunCollectiveRequest whose spec runs on the array created (its array_id is
// ignored). The registry holds devices 0-7.
#include <cstddef>
#include <cstdint>

#include "fuzz/coordinator_fixture.h"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pb::CreateArrayRequest create;
  pb::RunCollectiveRequest run;
  if (!fuzz::parse_two(data, size, create, run)) return 0;
  // The collective's spec alone, as the coordinator and each worker decode it.
  absl::StatusOr<CollectiveSpec> spec = collective_from_proto(run.spec());
  fuzz::check_rejection(spec.status(), "collective_from_proto");
  // CreateArray: the conversions, then the registry's checks (session 0: no owner).
  const std::optional<ArrayRecord> array = fuzz::create_as_coordinator(create);
  if (!array.has_value() || !spec.ok()) return 0;
  const Shape& shape = array->shape;
  const NamedSharding& sharding = array->sharding;
  // RunCollective on it: the result's shape, and each device's block as its worker checks it.
  absl::StatusOr<Shape> result = collective_result_shape(*spec, *array);
  fuzz::check_rejection(result.status(), "collective_result_shape");
  if (!result.ok()) return 0;
  fuzz::check(sharding.validate(*result).ok(), "the collective's result does not fit the array's sharding");
  absl::StatusOr<Shape> block = collective_output_shape(*spec, sharding.shard_shape(shape));
  fuzz::check(block.ok() && *block == sharding.shard_shape(*result), "a worker's block differs from the array's");
  return 0;
}

// Fuzz target: the coordinator's checks of CreateArray and RunCollective requests
// (coordinator_server.cc's create_array() and run_collective(), up to the workers), and a
// worker's of a WorkerCollectiveRequest's spec against its input (worker_server.cc).
//
// The input: two bytes (little endian) giving the length of a CreateArrayRequest, that
// request, then a RunCollectiveRequest whose spec runs on the array created (its array_id is
// ignored). The registry holds devices 0-7.
#include <cstddef>
#include <cstdint>

#include "coordinator/registry.h"
#include "core/wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"

using namespace tessera;

namespace {

Registry& registry() {
  static Registry* r = [] {
    auto* registry = new Registry(absl::Hours(1));
    for (int d = 0; d < 8; ++d) {
      WorkerRegistration w;
      w.name = absl::StrCat("w", d);
      w.address = absl::StrCat("127.0.0.1:", 7000 + d);
      w.requested_id = d;
      if (!registry->register_worker(w, absl::Now()).ok()) fuzz::fail("setup", "register_worker");
    }
    return registry;
  }();
  return *r;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pb::CreateArrayRequest create;
  pb::RunCollectiveRequest run;
  if (!fuzz::parse_two(data, size, create, run)) return 0;
  // The collective's spec alone, as the coordinator and each worker decode it.
  absl::StatusOr<CollectiveSpec> spec = collective_from_proto(run.spec());
  fuzz::check_rejection(spec.status(), "collective_from_proto");
  // CreateArray: the conversions, then the registry's checks (session 0: no owner).
  absl::StatusOr<DType> dtype = dtype_from_proto(create.dtype());
  fuzz::check_rejection(dtype.status(), "dtype_from_proto");
  if (!dtype.ok()) return 0;
  absl::StatusOr<Shape> shape = shape_from_proto(create.shape(), *dtype);
  fuzz::check_rejection(shape.status(), "shape_from_proto");
  absl::StatusOr<NamedSharding> sharding = sharding_from_proto(create.sharding());
  fuzz::check_rejection(sharding.status(), "sharding_from_proto");
  if (!shape.ok() || !sharding.ok()) return 0;
  absl::StatusOr<uint64_t> id = registry().create_array(*dtype, *shape, *sharding, 0);
  fuzz::check_rejection(id.status(), "create_array", {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound});
  if (!id.ok() || !spec.ok()) return 0;
  absl::StatusOr<ArrayRecord> array = registry().get_array(*id);
  fuzz::check(array.ok(), "a created array is not found");
  registry().remove_arrays({*id});
  // RunCollective on it: the result's shape, and each device's block as its worker checks it.
  absl::StatusOr<Shape> result = collective_result_shape(*spec, *array);
  fuzz::check_rejection(result.status(), "collective_result_shape");
  if (!result.ok()) return 0;
  fuzz::check(sharding->validate(*result).ok(), "the collective's result does not fit the array's sharding");
  absl::StatusOr<Shape> block = collective_output_shape(*spec, sharding->shard_shape(*shape));
  fuzz::check(block.ok() && *block == sharding->shard_shape(*result), "a worker's block differs from the array's");
  return 0;
}

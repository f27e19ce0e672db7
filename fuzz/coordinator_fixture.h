// What the fuzz targets of coordinator requests share: a registry of devices 0-7 (at
// 127.0.0.1:7000 + d), and an array made from a CreateArrayRequest as the coordinator's
// create_array() makes one (the conversions, then the registry's checks).
#ifndef TESSERA_FUZZ_COORDINATOR_FIXTURE_H_
#define TESSERA_FUZZ_COORDINATOR_FIXTURE_H_

#include <optional>

#include "absl/strings/str_cat.h"
#include "coordinator/registry.h"
#include "core/wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"

namespace tessera::fuzz {

inline Registry& eight_device_registry() {
  static Registry* r = [] {
    auto* registry = new Registry(absl::Hours(1));
    for (int d = 0; d < 8; ++d) {
      WorkerRegistration w;
      w.name = absl::StrCat("w", d);
      w.address = absl::StrCat("127.0.0.1:", 7000 + d);
      w.requested_id = d;
      if (!registry->register_worker(w, absl::Now()).ok()) fail("setup", "register_worker");
    }
    return registry;
  }();
  return *r;
}

// The record of the array `create` makes in eight_device_registry() (session 0: no owner),
// removed from the registry again; nullopt when a check refuses it (the refusal's code and
// message checked).
inline std::optional<ArrayRecord> create_as_coordinator(const pb::CreateArrayRequest& create) {
  absl::StatusOr<DType> dtype = dtype_from_proto(create.dtype());
  check_rejection(dtype.status(), "dtype_from_proto");
  if (!dtype.ok()) return std::nullopt;
  absl::StatusOr<Shape> shape = shape_from_proto(create.shape(), *dtype);
  check_rejection(shape.status(), "shape_from_proto");
  absl::StatusOr<NamedSharding> sharding = sharding_from_proto(create.sharding());
  check_rejection(sharding.status(), "sharding_from_proto");
  if (!shape.ok() || !sharding.ok()) return std::nullopt;
  Registry& registry = eight_device_registry();
  absl::StatusOr<uint64_t> id = registry.create_array(*dtype, *shape, *sharding, 0);
  check_rejection(id.status(), "create_array", {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound});
  if (!id.ok()) return std::nullopt;
  absl::StatusOr<ArrayRecord> array = registry.get_array(*id);
  check(array.ok(), "a created array is not found");
  registry.remove_arrays({*id});
  return *std::move(array);
}

}  // namespace tessera::fuzz

#endif  // TESSERA_FUZZ_COORDINATOR_FIXTURE_H_

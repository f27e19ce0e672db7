#include "coordinator/registry_wire.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "coordinator/request_limits.h"
#include "core/status.h"
#include "core/wire.h"
#include "proto/tessera.pb.h"

namespace tessera {

absl::StatusOr<WorkerRegistration> registration_from_proto(const pb::RegisterWorkerRequest& req) {
  TESSERA_RETURN_IF_ERROR(check_registration(req.name(), req.address(), req.requested_device_id()));
  if (req.memory_bytes() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RegisterWorker: memory_bytes must be positive, got ", req.memory_bytes()));
  }
  WorkerRegistration registration;
  registration.name = req.name();
  registration.address = req.address();
  registration.requested_id = req.requested_device_id();
  registration.memory_bytes = req.memory_bytes();
  registration.previous_epoch = req.previous_epoch();
  registration.previous_incarnation = req.previous_incarnation();
  for (const pb::ShardHeader& h : req.held_buffers()) {
    absl::StatusOr<DType> dtype = dtype_from_proto(h.dtype());
    absl::StatusOr<Shape> shape = dtype.ok() ? shape_from_proto(h.shape(), *dtype) : dtype.status();
    if (!shape.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("RegisterWorker: held buffer ", h.buffer_id(), ": ", shape.status().message()));
    }
    registration.held[h.buffer_id()] = HeldShard{*dtype, *std::move(shape)};
  }
  return registration;
}

absl::StatusOr<ArrayRecord> array_from_proto(const pb::ArrayInfo& info) {
  TESSERA_ASSIGN_OR_RETURN(DType dtype, dtype_from_proto(info.dtype()));
  TESSERA_ASSIGN_OR_RETURN(Shape shape, shape_from_proto(info.shape(), dtype));
  TESSERA_ASSIGN_OR_RETURN(NamedSharding sharding, sharding_from_proto(info.sharding()));
  return ArrayRecord{info.array_id(), dtype, std::move(shape), std::move(sharding), {}, 0};
}

}  // namespace tessera

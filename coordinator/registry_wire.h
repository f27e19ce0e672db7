// The registry's records (coordinator/registry.h) from their wire form: what a worker's
// RegisterWorker says (with the buffers it holds) and the ArrayInfo an AdoptArrays names.
// The coordinator's handlers decode with these, and so do the fuzz targets (fuzz/).
//
//   TESSERA_ASSIGN_OR_RETURN(WorkerRegistration r, registration_from_proto(req));
//   TESSERA_ASSIGN_OR_RETURN(ArrayRecord a, array_from_proto(req.arrays(0)));
#ifndef TESSERA_COORDINATOR_REGISTRY_WIRE_H_
#define TESSERA_COORDINATOR_REGISTRY_WIRE_H_

#include "absl/status/statusor.h"
#include "coordinator/registry.h"

namespace tessera {

namespace pb {
class ArrayInfo;
class RegisterWorkerRequest;
}  // namespace pb

// A worker's registration (its protocol version is the caller's to check): check_registration
// (coordinator/request_limits.h) of its name, address and requested id, a positive
// memory_bytes, and each held buffer's dtype and shape. INVALID_ARGUMENT naming the field, the
// buffer and the rule.
absl::StatusOr<WorkerRegistration> registration_from_proto(const pb::RegisterWorkerRequest& req);

// An array to adopt: its id, dtype, shape and sharding (no session: the caller's).
// INVALID_ARGUMENT as dtype_from_proto, shape_from_proto and sharding_from_proto say.
absl::StatusOr<ArrayRecord> array_from_proto(const pb::ArrayInfo& info);

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_REGISTRY_WIRE_H_

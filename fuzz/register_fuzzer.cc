// Fuzz target: what re-registering workers report holding, and the arrays a client adopts
// from it after a coordinator restart (coordinator_server.cc's RegisterWorker and
// AdoptArrays): registration_from_proto and array_from_proto (coordinator/registry_wire.h),
// then Registry::register_worker and Registry::adopt_array, on a registry started at a fixed
// time. Beyond the rejections' codes it checks the id rules of coordinator/ids.h after every
// registration: a fresh id is at least the epoch, below 2^62 (bit 62 is the workers'), and
// above every held id of a coordinator (below 2^61); and an adopted array is known again as
// it was named, each of its devices having reported its block.
//
// The input: a count of registrations (the first byte, modulo 9), each a RegisterWorkerRequest
// preceded by its length (two bytes, little endian), then an AdoptArraysRequest.
#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/registry.h"
#include "coordinator/registry_wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"

using namespace tessera;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int count = data[0] % 9;
  size_t pos = 1;
  std::vector<pb::RegisterWorkerRequest> registrations(static_cast<size_t>(count));
  for (pb::RegisterWorkerRequest& r : registrations) {
    if (pos + 2 > size) return 0;
    const size_t length = std::min<size_t>(data[pos] | data[pos + 1] << 8, size - pos - 2);
    if (!r.ParseFromArray(data + pos + 2, static_cast<int>(length))) return 0;
    pos += 2 + length;
  }
  pb::AdoptArraysRequest adopt;
  if (!adopt.ParseFromArray(data + pos, static_cast<int>(size - pos))) return 0;

  Registry registry(absl::Seconds(3), absl::FromUnixSeconds(1'700'000'000));
  const absl::Time now = absl::FromUnixSeconds(1'700'000'001);
  // What each device reported holding (its last accepted registration's), for the adoptions.
  std::map<int, std::map<uint64_t, HeldShard>> held;
  uint64_t highest_held = 0;  // of the coordinator's ids (below 2^61) reported
  uint64_t last_id = 0;
  for (const pb::RegisterWorkerRequest& req : registrations) {
    absl::StatusOr<WorkerRegistration> r = registration_from_proto(req);
    fuzz::check_rejection(r.status(), "registration_from_proto");
    if (!r.ok()) continue;
    fuzz::check(r->held.size() <= static_cast<size_t>(req.held_buffers_size()), "more held buffers than reported");
    absl::StatusOr<DeviceRecord> d = registry.register_worker(*r, now);
    fuzz::check_rejection(d.status(), "register_worker", {absl::StatusCode::kAlreadyExists});
    if (!d.ok()) continue;
    fuzz::check(d->address == r->address && d->alive, "the registered device is not the registration");
    if (r->previous_epoch != registry.epoch()) held[d->id] = r->held;
    for (const auto& [id, shard] : r->held) {
      if (id < (uint64_t{1} << 61)) highest_held = std::max(highest_held, id);
    }
    const uint64_t fresh = registry.open_session(now);
    if (fresh < registry.epoch() || fresh >= (uint64_t{1} << 62) || fresh <= highest_held || fresh <= last_id) {
      fuzz::fail("register_worker",
                 absl::StrCat("a fresh id ", fresh, " after a registration (epoch ", registry.epoch(),
                              ", highest held ", highest_held, ", last id ", last_id, ")"));
    }
    last_id = fresh;
  }
  std::set<uint64_t> adopted_ids;
  for (const pb::ArrayInfo& info : adopt.arrays()) {
    absl::StatusOr<ArrayRecord> a = array_from_proto(info);
    fuzz::check_rejection(a.status(), "array_from_proto");
    if (!a.ok()) continue;
    absl::Status adopted = registry.adopt_array(*a);
    fuzz::check_rejection(
        adopted, "adopt_array",
        {absl::StatusCode::kInvalidArgument, absl::StatusCode::kFailedPrecondition, absl::StatusCode::kNotFound});
    if (!adopted.ok()) continue;
    absl::StatusOr<ArrayRecord> known = registry.get_array(a->id);
    fuzz::check(known.ok() && known->dtype == a->dtype && known->shape == a->shape && known->sharding == a->sharding,
                "an adopted array is not known as it was named");
    // The first adoption of an id (a later one finds it known): every device reported its block.
    if (!adopted_ids.insert(a->id).second) continue;
    const Shape block = a->sharding.shard_shape(a->shape);
    for (int device : a->sharding.mesh().device_ids()) {
      auto h = held.find(device);
      const bool reported = h != held.end() && h->second.count(a->id) > 0 && h->second.at(a->id).dtype == a->dtype &&
                            h->second.at(a->id).shape == block;
      fuzz::check(reported, "adopted without every device's block");
    }
  }
  return 0;
}

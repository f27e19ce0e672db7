// Fuzz target: a LoadPlan request as a worker decodes it (worker_server.cc's LoadPlan): the
// program (plan_from_proto), the mesh, and the program resolved for devices of the mesh
// (resolve() in core/plan.h), then what the worker and `explain` read of a resolved plan. A
// program that decodes must encode and decode again to the same bytes.
#include <cstddef>
#include <cstdint>

#include "core/wire.h"
#include "fuzz/fuzz_check.h"
#include "proto/tessera.pb.h"

using namespace tessera;

namespace {

std::string plan_bytes(const DevicePlan& plan) {
  pb::DevicePlan w;
  to_proto(plan, &w);
  return w.SerializeAsString();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pb::LoadPlanRequest req;
  if (!req.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<DevicePlan> program = plan_from_proto(req.plan());
  fuzz::check_rejection(program.status(), "plan_from_proto");
  absl::StatusOr<Mesh> mesh = mesh_from_proto(req.mesh());
  fuzz::check_rejection(mesh.status(), "mesh_from_proto");
  if (!program.ok()) return 0;
  absl::StatusOr<DevicePlan> back = plan_from_proto([&] {
    pb::DevicePlan w;
    to_proto(*program, &w);
    return w;
  }());
  if (!back.ok()) fuzz::fail("a decoded plan does not decode again", back.status().ToString());
  fuzz::check(plan_bytes(*back) == plan_bytes(*program), "the plan's round trip changed it");
  if (!mesh.ok()) return 0;
  // The first devices of the mesh and its last (each worker resolves for its own), and one
  // that is not in it.
  const std::vector<int>& ids = mesh->device_ids();
  std::vector<int> devices(ids.begin(), ids.begin() + std::min<size_t>(ids.size(), 3));
  if (ids.size() > 3) devices.push_back(ids.back());
  devices.push_back(-1);
  for (int d : devices) {
    absl::StatusOr<DevicePlan> plan = resolve(*program, *mesh, d);
    fuzz::check_rejection(plan.status(), "resolve", {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound});
    if (!plan.ok()) continue;
    plan_to_text(plan->device >= 0 ? *plan : *program, *mesh, "device:");
    collective_bytes_per_device(*plan, *mesh);
  }
  plan_to_text(*program, *mesh, "program:");
  return 0;
}

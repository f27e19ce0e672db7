// example_device_put: places a (16, 8) array on an 8-device local cluster under each layout of
// a (4, 2) ("data", "model") mesh, and prints each spec, shard shape and picture, as JAX would.
// Each layout is fetched back and compared with the original; a mismatch exits non-zero.
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "core/daemon.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, coordinator, "",
          "host:port of a running cluster's coordinator; empty runs Client::local(8) (env TESSERA_COORDINATOR)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Shows how a (16, 8) array is laid out under each PartitionSpec.\n"
      "Usage: example_device_put [--coordinator=HOST:PORT]");
  tessera::parse_flags(argc, argv, "example_device_put", {{"coordinator", "TESSERA_COORDINATOR"}});
  using tessera::Axes;
  using tessera::None;
  using tessera::P;

  const std::string address = absl::GetFlag(FLAGS_coordinator);
  absl::StatusOr<tessera::Client> client =
      address.empty() ? tessera::Client::local(8) : tessera::Client::connect(address, {.min_devices = 8});
  if (!client.ok()) {
    std::cerr << "example_device_put: " << client.status() << "\n";
    return 1;
  }
  absl::StatusOr<tessera::Mesh> mesh = client->make_mesh({4, 2}, {"data", "model"});
  if (!mesh.ok()) {
    std::cerr << "example_device_put: " << mesh.status() << "\n";
    return 1;
  }
  const tessera::HostArray x = tessera::HostArray::arange(tessera::DType::kF32, {16, 8});
  std::cout << "mesh: " << mesh->to_string() << ", array: float32" << tessera::shape_to_string(x.shape()) << "\n\n";

  for (const tessera::PartitionSpec& spec : {P("data", None), P(None, "model"), P("data", "model"),
                                             P(Axes{"data", "model"}), P(Axes{"model", "data"}), P()}) {
    tessera::NamedSharding sharding(*mesh, spec);
    absl::StatusOr<tessera::Array> array = client->device_put(x, sharding);
    if (!array.ok()) {
      std::cerr << "device_put " << spec.to_string() << ": " << array.status() << "\n";
      return 1;
    }
    absl::StatusOr<tessera::HostArray> back = array->fetch();
    if (!back.ok() || *back != x) {
      std::cerr << "fetch " << spec.to_string() << ": "
                << (back.ok() ? "values differ from what was put" : back.status().ToString()) << "\n";
      return 1;
    }
    std::cout << spec.to_string() << "  shard shape " << tessera::shape_to_string(sharding.shard_shape(x.shape()))
              << "\n"
              << *tessera::visualize_array_sharding(*array) << "\n";
  }
  return 0;
}

// example_seed_layer: the jit seed program on Client::local(8), as JAX runs it:
//
//   mesh = make_mesh((4, 2), ("data", "model"))
//   x = device_put(ones((16, 8)), NamedSharding(mesh, P("data", None)))
//   w = device_put(ones((8, 4)), NamedSharding(mesh, P(None, "model")))
//   y = jit(lambda x, w: tanh(x @ w))(x, w)
//
// Prints the result's shape, spec, and shard count and shape, then checks every value
// against tanh(x @ w) computed on the host; exits non-zero on a mismatch.
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "core/daemon.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, coordinator, "",
          "host:port of a running cluster's coordinator; empty runs Client::local(8) (env TESSERA_COORDINATOR)");
ABSL_FLAG(bool, plans, false, "also print every device's compiled plan");
ABSL_FLAG(std::string, profile, "",
          "record a timeline of the run (puts, the call, the fetch) into this file, in Chrome's trace-event "
          "JSON, and a viewer into FILE.html (docs/guide.md, \"Seeing where the time goes\")");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Runs jit(tanh(x @ w)) on sharded arrays.\nUsage: example_seed_layer [--coordinator=HOST:PORT] [--plans] "
      "[--profile=FILE]");
  tessera::parse_flags(argc, argv, "example_seed_layer", {{"coordinator", "TESSERA_COORDINATOR"}});
  using namespace tessera;
  const std::string address = absl::GetFlag(FLAGS_coordinator);
  absl::StatusOr<Client> client = address.empty() ? Client::local(8) : Client::connect(address, {.min_devices = 8});
  absl::StatusOr<Mesh> mesh = client.ok() ? client->make_mesh({4, 2}, {"data", "model"}) : client.status();
  if (!mesh.ok()) {
    std::cerr << "example_seed_layer: " << mesh.status() << "\n";
    return 1;
  }
  std::optional<ProfileScope> profile;
  if (const std::string path = absl::GetFlag(FLAGS_profile); !path.empty()) {
    absl::StatusOr<ProfileScope> started = client->profile(path);
    if (!started.ok()) {
      std::cerr << "example_seed_layer: " << started.status() << "\n";
      return 1;
    }
    profile.emplace(*std::move(started));
  }
  const HostArray x_host = HostArray::ones(DType::kF32, {16, 8});
  const HostArray w_host = HostArray::ones(DType::kF32, {8, 4});
  absl::StatusOr<Array> x = client->device_put(x_host, NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> w = client->device_put(w_host, NamedSharding(*mesh, P(None, "model")));
  if (!x.ok() || !w.ok()) {
    std::cerr << "example_seed_layer: " << (x.ok() ? w.status() : x.status()) << "\n";
    return 1;
  }
  Jitted layer = jit([](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; });
  absl::StatusOr<std::vector<Array>> out = layer({*x, *w});
  if (!out.ok()) {
    std::cerr << "example_seed_layer: " << out.status() << "\n";
    return 1;
  }
  const Array& y = (*out)[0];
  const std::vector<Shard> shards = y.addressable_shards();
  std::cout << shape_to_string(y.shape()) << "\n"
            << y.sharding().spec().to_string() << "\n"
            << shards.size() << " " << shape_to_string(shards[0].shape()) << "\n";
  if (absl::GetFlag(FLAGS_plans)) std::cout << layer.as_text();

  absl::StatusOr<HostArray> got = y.fetch();
  if (!got.ok()) {
    std::cerr << "example_seed_layer: " << got.status() << "\n";
    return 1;
  }
  if (profile.has_value()) {
    if (absl::Status written = profile->finish(); !written.ok()) {
      std::cerr << "example_seed_layer: " << written << "\n";
      return 1;
    }
    std::cout << "timeline: " << absl::GetFlag(FLAGS_profile) << " and " << absl::GetFlag(FLAGS_profile) << ".html\n";
  }
  // The host reference: tanh(x @ w), element by element.
  for (int64_t i = 0; i < 16; ++i) {
    for (int64_t j = 0; j < 4; ++j) {
      double acc = 0;
      for (int64_t k = 0; k < 8; ++k) acc += x_host.values<float>()[i * 8 + k] * w_host.values<float>()[k * 4 + j];
      const double want = std::tanh(acc), have = got->values<float>()[i * 4 + j];
      if (std::abs(have - want) > 1e-5) {
        std::fprintf(stderr, "example_seed_layer: y[%ld, %ld] = %.7f, expected %.7f\n", static_cast<long>(i),
                     static_cast<long>(j), have, want);
        return 1;
      }
    }
  }
  return 0;
}

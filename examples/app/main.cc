// A Tessera application outside the source tree: a sharded layer, jitted, checked against
// the same computation on the host. Built as app_xtensor (APP_WITH_XTENSOR), its data goes
// in and out as xtensor containers instead.
//
//   app                               runs its own 8-device cluster in this process
//   app --coordinator=host:port       uses a running cluster (tessera up, docker compose)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "tessera/tessera.h"
#ifdef APP_WITH_XTENSOR
#include "tessera/xtensor.h"
#endif

using namespace tessera;

namespace {

int fail(const absl::Status& status) {
  std::cerr << "app: " << status << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_fast_blas(argv);
  std::string coordinator;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--coordinator=", 0) == 0) {
      coordinator = arg.substr(std::strlen("--coordinator="));
    } else if (arg == "--coordinator" && i + 1 < argc) {
      coordinator = argv[++i];
    } else {
      std::cerr << "usage: " << argv[0] << " [--coordinator=HOST:PORT]\n"
                << "Runs tanh(x @ w) with x split over 'data' and w over 'model' and checks it on the host.\n"
                << "Without --coordinator, starts an 8-device cluster inside this process.\n";
      return arg == "--help" ? 0 : 2;
    }
  }
  std::printf("tessera %s (built against %s), protocol %d\n", version(), TESSERA_VERSION_STRING, protocol_version());

  absl::StatusOr<Client> client = coordinator.empty() ? Client::local(8) : Client::connect(coordinator);
  if (!client.ok()) return fail(client.status());
  absl::StatusOr<std::vector<Device>> devices = client->devices();
  if (!devices.ok()) return fail(devices.status());
  const int64_t n = static_cast<int64_t>(devices->size());
  absl::StatusOr<Mesh> mesh =
      n % 2 == 0 ? client->make_mesh({n / 2, 2}, {"data", "model"}) : client->make_mesh({n, 1}, {"data", "model"});
  if (!mesh.ok()) return fail(mesh.status());

  const int64_t rows = 4 * n, k = 16, cols = 8;
  const HostArray x = HostArray::arange(DType::kF32, {rows, k});
  std::vector<float> w_values(k * cols);
  for (int64_t i = 0; i < k * cols; ++i) w_values[i] = 0.001f * static_cast<float>(i % 13);
  const HostArray w = HostArray::from_vector<float>({k, cols}, w_values);
#ifdef APP_WITH_XTENSOR
  absl::StatusOr<Array> xs = device_put(*client, as_xtensor<float>(x), NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> ws = device_put(*client, as_xtensor<float>(w), NamedSharding(*mesh, P(None, "model")));
#else
  absl::StatusOr<Array> xs = client->device_put(x, NamedSharding(*mesh, P("data", None)));
  absl::StatusOr<Array> ws = client->device_put(w, NamedSharding(*mesh, P(None, "model")));
#endif
  if (!xs.ok()) return fail(xs.status());
  if (!ws.ok()) return fail(ws.status());

  Jitted layer = jit([](const std::vector<Value>& in) { return std::vector<Value>{tanh(matmul(in[0], in[1]))}; });
  absl::StatusOr<std::vector<Array>> out = layer({*xs, *ws});
  if (!out.ok()) return fail(out.status());
  absl::StatusOr<std::string> picture = visualize_array_sharding((*out)[0]);
  if (!picture.ok()) return fail(picture.status());
  std::cout << "tanh(x @ w) is " << (*out)[0].sharding().spec().to_string() << " on " << mesh->to_string() << ":\n"
            << *picture;
#ifdef APP_WITH_XTENSOR
  absl::StatusOr<xt::xarray<float>> got = fetch_xarray<float>((*out)[0]);
  if (!got.ok()) return fail(got.status());
  const float* result = got->data();
#else
  absl::StatusOr<HostArray> got = (*out)[0].fetch();
  if (!got.ok()) return fail(got.status());
  const float* result = got->values<float>().data();
#endif

  double worst = 0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      double sum = 0;
      for (int64_t l = 0; l < k; ++l) sum += double(x.values<float>()[i * k + l]) * w_values[l * cols + j];
      worst = std::max(worst, std::abs(std::tanh(sum) - result[i * cols + j]));
    }
  }
  std::printf("largest difference from the host: %.2g\n", worst);
  if (worst > 1e-5) return fail(absl::InternalError("the cluster's result differs from the host's"));
  std::printf("app: ok\n");
  return 0;
}

// example_mlp_train: a two-layer MLP classifier trained on the handwritten digits (1,797 8x8
// images, 10 classes; the CSV Debian's python3-sklearn ships, which ./dev demo extracts) on a
// (4, 2) mesh of Client::local(8): the batch split over 'data', the hidden layer over 'model'.
// One jitted step computes the loss, its gradients (value_and_grad) and the SGD update.
//
//   example_mlp_train --data=PATH/digits.csv [--mesh=4x2] [--epochs=40]
//
// Prints "epoch N loss L" per epoch, then "test accuracy: A" on a held-out 20% (fixed seed)
// and the mean step time. With --mesh=1x1 the same run gives the same losses (to float32
// rounding). Exits non-zero when the data cannot be read or a step fails.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/daemon.h"
#include "examples/mesh_flag.h"
#include "examples/mlp_model.h"
#include "tessera/tessera.h"

ABSL_FLAG(std::string, data, "", "digits.csv (64 pixel values 0..16 and a label per line)");
ABSL_FLAG(std::string, mesh, "4x2",
          "DATAxMODEL mesh: the batch splits over the first axis, the hidden layer over the second");
ABSL_FLAG(int, epochs, 40, "passes over the training set");
ABSL_FLAG(int, hidden, 64, "hidden units");
ABSL_FLAG(int, batch, 64, "examples per step");
ABSL_FLAG(double, lr, 0.5, "SGD learning rate");
ABSL_FLAG(std::string, coordinator, "",
          "host:port of a running cluster's coordinator; empty runs Client::local(8) (env TESSERA_COORDINATOR)");

namespace {

using namespace tessera;

constexpr int kPixels = 64, kClasses = 10;

struct Digits {
  std::vector<float> x;  // n x 64, scaled to [0, 1]
  std::vector<int> y;
};

absl::StatusOr<Digits> read_digits(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot open '", path, "' (./dev demo extracts it to .cache/digits.csv; see --help)"));
  }
  Digits d;
  std::string line;
  int row = 0;
  while (std::getline(in, line)) {
    ++row;
    if (line.empty()) continue;
    std::vector<std::string> fields = absl::StrSplit(line, ',');
    if (fields.size() != kPixels + 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", row, ": ", fields.size(), " fields, expected ", kPixels + 1));
    }
    for (int i = 0; i <= kPixels; ++i) {
      double v = 0;
      if (!absl::SimpleAtod(fields[i], &v)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", row, ": '", fields[i], "' is not a number"));
      }
      if (i < kPixels) {
        d.x.push_back(static_cast<float>(v / 16.0));
      } else if (v < 0 || v >= kClasses || v != std::floor(v)) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", row, ": label ", fields[i], " is not 0..9"));
      } else {
        d.y.push_back(static_cast<int>(v));
      }
    }
  }
  if (d.y.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": no examples"));
  return d;
}

// Rows `rows` of the data as a (n, 64) image array and a (n, 10) one-hot label array.
std::pair<HostArray, HostArray> batch_of(const Digits& d, const std::vector<int>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  HostArray x(DType::kF32, {n, kPixels});
  HostArray y = HostArray::zeros(DType::kF32, {n, kClasses});
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(d.x.begin() + rows[i] * kPixels, kPixels, x.mutable_values<float>().begin() + i * kPixels);
    y.mutable_values<float>()[i * kClasses + d.y[rows[i]]] = 1.0f;
  }
  return {std::move(x), std::move(y)};
}

int fail(const absl::Status& status) {
  std::cerr << "example_mlp_train: " << status << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Trains a two-layer MLP on the digits data set on a sharded mesh.\n"
      "Usage: example_mlp_train --data=PATH/digits.csv [--mesh=4x2] [--epochs=40]");
  parse_flags(argc, argv, "example_mlp_train", {{"coordinator", "TESSERA_COORDINATOR"}});
  absl::StatusOr<std::pair<int64_t, int64_t>> mesh_sizes = parse_mesh_flag(absl::GetFlag(FLAGS_mesh));
  if (!mesh_sizes.ok()) return fail(mesh_sizes.status());
  const auto [data_size, model_size] = *mesh_sizes;
  const int epochs = absl::GetFlag(FLAGS_epochs), hidden = absl::GetFlag(FLAGS_hidden),
            batch = absl::GetFlag(FLAGS_batch);
  if (batch % data_size != 0 || hidden % model_size != 0) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--batch=", batch, " must divide by ", data_size, " and --hidden=", hidden, " by ", model_size)));
  }
  if (absl::GetFlag(FLAGS_data).empty()) return fail(absl::InvalidArgumentError("--data is required (see --help)"));
  absl::StatusOr<Digits> digits = read_digits(absl::GetFlag(FLAGS_data));
  if (!digits.ok()) return fail(digits.status());

  const std::string address = absl::GetFlag(FLAGS_coordinator);
  absl::StatusOr<Client> client = address.empty() ? Client::local(8) : Client::connect(address, {.min_devices = 8});
  if (!client.ok()) return fail(client.status());
  std::vector<int> devices(data_size * model_size);
  std::iota(devices.begin(), devices.end(), 0);
  // Auto axes: the compiler propagates the layouts and adds the collectives (GSPMD), as
  // jax.make_mesh(..., axis_types=(Auto, Auto)); on make_mesh's default Explicit axes the second
  // matmul, contracting the 'model'-split hidden layer, would need an out_sharding.
  absl::StatusOr<Mesh> mesh =
      client->make_mesh({data_size, model_size}, {"data", "model"}, devices, {AxisType::kAuto, AxisType::kAuto});
  if (!mesh.ok()) return fail(mesh.status());

  // Held-out 20%, and the training order, from a fixed seed.
  std::mt19937 rng(2026);
  std::vector<int> order(digits->y.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  // (A multiple of 8, so that every mesh of up to 8 devices splits it and tests the same rows.)
  const size_t n_test = order.size() / 5 / 8 * 8;
  std::vector<int> test(order.begin(), order.begin() + n_test), train(order.begin() + n_test, order.end());

  // Parameters: uniform in +-1/sqrt(fan_in); the hidden layer split over 'model'.
  auto init = [&](Shape shape, int64_t fan_in) {
    HostArray a(DType::kF32, std::move(shape));
    std::uniform_real_distribution<float> u(-1.0f / std::sqrt(float(fan_in)), 1.0f / std::sqrt(float(fan_in)));
    for (float& v : a.mutable_values<float>()) v = u(rng);
    return a;
  };
  const std::vector<PartitionSpec> param_specs = {P(None, "model"), P("model"), P("model", None), P()};
  std::vector<HostArray> host_params;
  host_params.push_back(init({kPixels, hidden}, kPixels));
  host_params.push_back(HostArray::zeros(DType::kF32, {hidden}));
  host_params.push_back(init({hidden, kClasses}, hidden));
  host_params.push_back(HostArray::zeros(DType::kF32, {kClasses}));
  std::vector<Array> params;
  for (size_t i = 0; i < host_params.size(); ++i) {
    absl::StatusOr<Array> p = client->device_put(host_params[i], NamedSharding(*mesh, param_specs[i]));
    if (!p.ok()) return fail(p.status());
    params.push_back(*std::move(p));
  }

  // One step: the loss, its gradients with respect to the parameters, and the SGD update;
  // the old parameters are donated (freed as soon as the step has run).
  const double lr = absl::GetFlag(FLAGS_lr);
  JitOptions step_options;
  step_options.donate_argnums = {0, 1, 2, 3};
  Jitted step = jit(mlp::train_step(lr), step_options);
  Jitted predict =
      jit([](const std::vector<Value>& in) { return std::vector<Value>{argmax(mlp::logits(in, in[4]), 1)}; });

  const int steps_per_epoch = static_cast<int>(train.size()) / batch;
  double step_seconds = 0;
  int steps = 0;
  for (int epoch = 1; epoch <= epochs; ++epoch) {
    std::shuffle(train.begin(), train.end(), rng);
    std::vector<Array> losses;
    for (int s = 0; s < steps_per_epoch; ++s) {
      std::vector<int> rows(train.begin() + s * batch, train.begin() + (s + 1) * batch);
      auto [x, y] = batch_of(*digits, rows);
      absl::StatusOr<Array> xs = client->device_put(x, NamedSharding(*mesh, P("data", None)));
      absl::StatusOr<Array> ys = client->device_put(y, NamedSharding(*mesh, P("data", None)));
      if (!xs.ok() || !ys.ok()) return fail(xs.ok() ? ys.status() : xs.status());
      const absl::Time t = absl::Now();
      absl::StatusOr<std::vector<Array>> out = step({params[0], params[1], params[2], params[3], *xs, *ys});
      if (!out.ok()) return fail(out.status());
      absl::Status ready = (*out)[0].block_until_ready();
      if (!ready.ok()) return fail(ready);
      step_seconds += absl::ToDoubleSeconds(absl::Now() - t);
      ++steps;
      losses.push_back((*out)[0]);
      params.assign(out->begin() + 1, out->end());
    }
    absl::StatusOr<std::vector<HostArray>> values = device_get(losses);
    if (!values.ok()) return fail(values.status());
    double total = 0;
    for (const HostArray& v : *values) total += v.element_as_double(0);
    std::printf("epoch %d loss %.6f\n", epoch, total / losses.size());
  }

  auto [tx, ty] = batch_of(*digits, test);
  absl::StatusOr<Array> txs = client->device_put(tx, NamedSharding(*mesh, P("data", None)));
  if (!txs.ok()) return fail(txs.status());
  absl::StatusOr<std::vector<Array>> predicted = predict({params[0], params[1], params[2], params[3], *txs});
  absl::StatusOr<HostArray> labels = predicted.ok() ? (*predicted)[0].fetch() : predicted.status();
  if (!labels.ok()) return fail(labels.status());
  int correct = 0;
  for (size_t i = 0; i < test.size(); ++i) correct += labels->element_as_double(i) == digits->y[test[i]] ? 1 : 0;
  std::printf("test accuracy: %.4f\n", double(correct) / test.size());
  std::printf("mean step time: %.3f ms (%d steps on a %lldx%lld mesh)\n", 1e3 * step_seconds / std::max(steps, 1),
              steps, static_cast<long long>(data_size), static_cast<long long>(model_size));
  return 0;
}

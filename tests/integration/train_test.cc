// A small training run on synthetic data: a two-layer MLP regressing a smooth function,
// jit(value_and_grad + SGD) on Client::local(8). The loss falls, and the run gives the same
// losses and parameters on (1, 1), (8, 1), (4, 2) and (2, 4) meshes (batch over 'data',
// hidden layer over 'model') up to float32 rounding.
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

constexpr int64_t kBatch = 32, kIn = 8, kHidden = 16, kSteps = 25;

// On make_mesh's Explicit axes (JAX >= 0.9's default) the hidden layer's 'model' split is
// contracted on both operands of the second matmul: out_sharding says the sum over 'model' is
// all-reduced into rows over 'data' (what JAX's _dot_general_sharding_rule asks for).
std::vector<Value> loss(const std::vector<Value>& in) {
  const Value h = tanh(matmul(in[4], in[0]) + in[1]);
  const Value err = matmul(h, in[2], P("data", None)) + in[3] - in[5];
  return {mean(err * err)};
}

struct TrainRun {
  std::vector<double> losses;
  std::vector<HostArray> params;
};

// kSteps of SGD on `mesh`, from the same initial parameters and batches.
TrainRun train(const Client& client, const Mesh& mesh) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random = [&](Shape shape, float scale) {
    HostArray a(DType::kF32, std::move(shape));
    for (float& v : a.mutable_values<float>()) v = u(rng) * scale;
    return a;
  };
  const std::vector<PartitionSpec> specs = {P(None, "model"), P("model"), P("model", None), P()};
  std::vector<HostArray> init;
  init.push_back(random({kIn, kHidden}, 0.5f));
  init.push_back(HostArray::zeros(DType::kF32, {kHidden}));
  init.push_back(random({kHidden, 1}, 0.5f));
  init.push_back(HostArray::zeros(DType::kF32, {1}));
  std::vector<Array> params;
  for (size_t i = 0; i < init.size(); ++i) {
    absl::StatusOr<Array> p = client.device_put(init[i], NamedSharding(mesh, specs[i]));
    EXPECT_TRUE(p.ok()) << p.status();
    params.push_back(*std::move(p));
  }
  JitOptions options;
  options.donate_argnums = {0, 1, 2, 3};  // the parameters, updated in place as in JAX
  Jitted step = jit(
      [](const std::vector<Value>& in) {
        std::vector<Value> vg = value_and_grad(loss, {0, 1, 2, 3})(in);
        std::vector<Value> out = {vg[0]};
        for (int i = 0; i < 4; ++i) out.push_back(in[i] - vg[i + 1] * 0.1);
        return out;
      },
      options);
  TrainRun run;
  for (int s = 0; s < kSteps; ++s) {
    HostArray x = random({kBatch, kIn}, 1.0f);
    HostArray y(DType::kF32, {kBatch, 1});
    for (int64_t i = 0; i < kBatch; ++i) {  // a smooth target: sin of a sum of the inputs
      double t = 0;
      for (int64_t j = 0; j < kIn; ++j) t += x.values<float>()[i * kIn + j] * (j % 2 ? 0.5 : -0.3);
      y.mutable_values<float>()[i] = static_cast<float>(std::sin(t));
    }
    absl::StatusOr<Array> xs = client.device_put(x, NamedSharding(mesh, P("data", None)));
    absl::StatusOr<Array> ys = client.device_put(y, NamedSharding(mesh, P("data", None)));
    EXPECT_TRUE(xs.ok() && ys.ok());
    absl::StatusOr<std::vector<Array>> out = step({params[0], params[1], params[2], params[3], *xs, *ys});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return run;
    absl::StatusOr<HostArray> l = (*out)[0].fetch();
    EXPECT_TRUE(l.ok()) << l.status();
    run.losses.push_back(l.ok() ? l->element_as_double(0) : NAN);
    params.assign(out->begin() + 1, out->end());
    for (size_t i = 0; i < params.size(); ++i) {
      // Laid out as put (P() for a matrix comes back as P(None, None): the same layout).
      EXPECT_TRUE(params[i].sharding().is_equivalent_to(NamedSharding(mesh, specs[i]),
                                                        static_cast<int>(params[i].shape().size())))
          << "parameter " << i << ": " << params[i].sharding().spec().to_string();
    }
  }
  for (const Array& p : params) {
    absl::StatusOr<HostArray> h = p.fetch();
    EXPECT_TRUE(h.ok()) << h.status();
    run.params.push_back(h.ok() ? *std::move(h) : HostArray());
  }
  return run;
}

TEST(Train, LossFallsAndEveryMeshGivesTheSameRun) {
  std::unique_ptr<Client> client = start_local_client();
  ASSERT_NE(client, nullptr);
  absl::StatusOr<Mesh> single = client->make_mesh({1, 1}, {"data", "model"}, {0});
  ASSERT_TRUE(single.ok()) << single.status();
  const TrainRun reference = train(*client, *single);
  ASSERT_EQ(reference.losses.size(), static_cast<size_t>(kSteps));
  // The loss falls: the last steps' mean is well under the first steps'.
  const double first = (reference.losses[0] + reference.losses[1] + reference.losses[2]) / 3;
  const double last = (reference.losses[kSteps - 1] + reference.losses[kSteps - 2] + reference.losses[kSteps - 3]) / 3;
  EXPECT_LT(last, 0.7 * first) << "first " << first << ", last " << last;
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{8, 1}, {4, 2}, {2, 4}}) {
    SCOPED_TRACE(::testing::Message() << "mesh (" << shape[0] << ", " << shape[1] << ")");
    absl::StatusOr<Mesh> mesh = client->make_mesh(shape, {"data", "model"});
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    const TrainRun run = train(*client, *mesh);
    ASSERT_EQ(run.losses.size(), reference.losses.size());
    for (size_t s = 0; s < run.losses.size(); ++s) {
      EXPECT_NEAR(run.losses[s], reference.losses[s], 1e-4 * std::abs(reference.losses[s])) << "step " << s;
    }
    for (size_t i = 0; i < run.params.size(); ++i) {
      EXPECT_TRUE(results_match(run.params[i], reference.params[i], 1e-4)) << "parameter " << i;
    }
  }
}

}  // namespace
}  // namespace tessera

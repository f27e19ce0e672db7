// tessera/optim.h against a plain host implementation of optax's formulas (optax/_src/alias.py:
// sgd = trace + scale(-lr), adam = scale_by_adam + scale(-lr), adamw = scale_by_adam +
// add_decayed_weights + scale(-lr); transform.py: bias correction mu / (1 - b1^t);
// clipping.py: clip_by_global_norm) over several steps in float32 and float64, each step one
// jitted program with the parameters and the state donated; and a training step with FSDP-like
// sharded parameters on Client::local(8) giving the run of one device.
#include "tessera/optim.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"

namespace tessera {

Client& shared_client();  // tree_test.cc

namespace {

using ::testing::HasSubstr;
using Leaves = std::map<std::string, std::vector<double>>;

// What a case runs: optional clipping, then sgd (with momentum) or adam(w).
struct Case {
  std::string name;
  bool adam = false;
  double lr = 0.1, momentum = 0, b1 = 0.9, b2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool nesterov = false, adamw = false;
  double max_norm = 0;  // 0: no clipping
  // With decay_steps > 0, adamw's learning rate is warmup_cosine_decay_schedule(0, lr, warmup,
  // decay_steps, lr / 10).
  int64_t warmup = 0, decay_steps = 0;
};

// optax.warmup_cosine_decay_schedule(init, peak, warmup, decay_steps, end) at `count`
// (optax/_src/schedule.py: linear_schedule, then cosine_decay_schedule with alpha = end / peak).
double host_schedule(double init, double peak, int64_t warmup, int64_t decay_steps, double end, int64_t count) {
  if (count < warmup) return init + (peak - init) * static_cast<double>(count) / static_cast<double>(warmup);
  const double span = static_cast<double>(decay_steps - warmup);
  const double t = std::min(static_cast<double>(count - warmup), span);
  const double alpha = end / peak;
  return peak * ((1 - alpha) * 0.5 * (1 + std::cos(M_PI * t / span)) + alpha);
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

optim::GradientTransformation make(const Case& c) {
  optim::GradientTransformation opt =
      !c.adam ? optim::sgd(c.lr, c.momentum, c.nesterov)
      : c.decay_steps > 0
          ? optim::adamw(optim::warmup_cosine_decay_schedule(0.0, c.lr, c.warmup, c.decay_steps, c.lr / 10), c.b1, c.b2,
                         c.eps, c.weight_decay)
      : c.adamw ? optim::adamw(c.lr, c.b1, c.b2, c.eps, c.weight_decay)
                : optim::adam(c.lr, c.b1, c.b2, c.eps);
  return c.max_norm > 0 ? optim::chain({optim::clip_by_global_norm(c.max_norm), opt}) : opt;
}

// optax's formulas, on the host in double.
struct HostOptimizer {
  Case c;
  Leaves trace, mu, nu;
  int count = 0;

  void step(Leaves& params, Leaves g) {
    if (c.max_norm > 0) {
      double sq = 0;
      for (auto& [n, v] : g)
        for (double x : v) sq += x * x;
      const double norm = std::sqrt(sq);
      if (!(norm < c.max_norm))
        for (auto& [n, v] : g)
          for (double& x : v) x = x / norm * c.max_norm;
    }
    ++count;
    for (auto& [n, p] : params) {
      std::vector<double>& gs = g[n];
      for (size_t i = 0; i < p.size(); ++i) {
        double u;
        if (!c.adam) {
          if (c.momentum != 0) {
            double& t = trace.emplace(n, std::vector<double>(p.size(), 0)).first->second[i];
            t = gs[i] + c.momentum * t;
            u = c.nesterov ? gs[i] + c.momentum * t : t;
          } else {
            u = gs[i];
          }
        } else {
          double& m = mu.emplace(n, std::vector<double>(p.size(), 0)).first->second[i];
          double& v = nu.emplace(n, std::vector<double>(p.size(), 0)).first->second[i];
          m = (1 - c.b1) * gs[i] + c.b1 * m;
          v = (1 - c.b2) * gs[i] * gs[i] + c.b2 * v;
          const double m_hat = m / (1 - std::pow(c.b1, count)), v_hat = v / (1 - std::pow(c.b2, count));
          u = m_hat / (std::sqrt(v_hat) + c.eps);
          if (c.adamw) u += c.weight_decay * p[i];
        }
        const double lr =
            c.decay_steps > 0 ? host_schedule(0.0, c.lr, c.warmup, c.decay_steps, c.lr / 10, count - 1) : c.lr;
        p[i] += -lr * u;
      }
    }
  }
};

HostArray to_host(DType dtype, Shape shape, const std::vector<double>& v) {
  if (dtype == DType::kF64) return HostArray::from_vector<double>(std::move(shape), v);
  return HostArray::from_vector<float>(std::move(shape), std::vector<float>(v.begin(), v.end()));
}

std::vector<double> from_host(const HostArray& a) {
  std::vector<double> out(a.size());
  for (int64_t i = 0; i < a.size(); ++i) out[i] = a.element_as_double(i);
  return out;
}

const std::map<std::string, Shape>& shapes() {
  static const auto* const s = new std::map<std::string, Shape>{{"layer.w", {8, 3}}, {"layer.b", {3}}};
  return *s;
}

Tree<Array> put(const Mesh& mesh, DType dtype, const Leaves& leaves) {
  Tree<HostArray> host;
  for (const auto& [n, v] : leaves) host.set(n, to_host(dtype, shapes().at(n), v));
  absl::StatusOr<Tree<Array>> out =
      device_put(shared_client(), host, mesh, ShardingRule::globs({{"*.w", P("data", None)}, {"*", P()}}));
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? *out : Tree<Array>();
}

class OptimTest : public ::testing::TestWithParam<std::tuple<Case, DType>> {};

TEST_P(OptimTest, MatchesOptaxFormulasOverSteps) {
  const auto& [c, dtype] = GetParam();
  const Mesh mesh = *shared_client().make_mesh({4}, {"data"}, {0, 1, 2, 3});
  std::mt19937 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  auto random = [&](double scale) {
    Leaves l;
    for (const auto& [n, s] : shapes()) {
      for (int64_t i = 0; i < num_elements(s); ++i) l[n].push_back(normal(rng) * scale);
    }
    return l;
  };
  Leaves host_params = random(1.0);
  if (dtype == DType::kF32) {  // the host starts from the same rounded values
    for (auto& [n, v] : host_params)
      for (double& x : v) x = static_cast<float>(x);
  }
  const optim::GradientTransformation opt = make(c);
  Tree<Array> params = put(mesh, dtype, host_params);
  // (The parameters come back too: sgd without momentum has an empty state, and a program
  // needs an output.)
  absl::StatusOr<std::vector<Tree<Array>>> state = jit([&](const std::vector<Tree<Value>>& in) {
    return std::vector<Tree<Value>>{opt.init(in[0]), in[0]};
  })({params});
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->at(0).size(), c.momentum == 0 && !c.adam ? 0u : c.adam ? (c.decay_steps > 0 ? 6u : 5u) : 2u);
  // The state is split like its parameter.
  for (const auto& [name, a] : state->at(0)) {
    if (absl::EndsWith(name, ".w")) {
      EXPECT_EQ(a.sharding().spec(), P("data", None)) << name;
    }
  }
  TreeJitOptions options;
  options.donate_argnums = {0, 1};
  TreeJitted step = jit(
      [&](const std::vector<Tree<Value>>& in) {
        auto [updates, new_state] = opt.update(in[2], in[1], in[0]);
        return std::vector<Tree<Value>>{optim::apply_updates(in[0], updates), new_state};
      },
      options);
  HostOptimizer host{c, {}, {}, {}, 0};
  Tree<Array> opt_state = state->at(0);
  for (int s = 0; s < 6; ++s) {
    Leaves g = random(s % 2 == 0 ? 0.05 : 3.0);  // clipping (max_norm 1) on every other step
    if (dtype == DType::kF32) {
      for (auto& [n, v] : g)
        for (double& x : v) x = static_cast<float>(x);
    }
    absl::StatusOr<std::vector<Tree<Array>>> out = step({params, opt_state, put(mesh, dtype, g)});
    ASSERT_TRUE(out.ok()) << out.status();
    host.step(host_params, g);
    params = out->at(0);
    opt_state = out->at(1);
    for (const auto& [n, want] : host_params) {
      std::vector<double> got = from_host(*params.find(n)->fetch());
      ASSERT_EQ(params.find(n)->dtype(), dtype);
      for (size_t i = 0; i < want.size(); ++i) {
        // (A schedule's step size is float32, as optax's without x64: in float64 each scheduled
        // step carries its float32 rounding, about 1e-9 here.)
        const double f64 = c.decay_steps > 0 ? 1e-8 : 1e-12;
        EXPECT_NEAR(got[i], want[i], dtype == DType::kF64 ? f64 : 2e-6 * std::max(1.0, std::abs(want[i])))
            << c.name << " step " << s << " " << n << "[" << i << "]";
      }
    }
  }
}

std::string case_name(const ::testing::TestParamInfo<std::tuple<Case, DType>>& info) {
  return std::get<0>(info.param).name + (std::get<1>(info.param) == DType::kF64 ? "F64" : "F32");
}

INSTANTIATE_TEST_SUITE_P(
    Optax, OptimTest,
    ::testing::Combine(
        ::testing::Values(
            Case{.name = "Sgd"}, Case{.name = "Momentum", .momentum = 0.9},
            Case{.name = "Nesterov", .momentum = 0.9, .nesterov = true}, Case{.name = "Adam", .adam = true, .lr = 0.01},
            Case{.name = "AdamW", .adam = true, .lr = 0.01, .weight_decay = 0.1, .adamw = true},
            Case{.name = "ClippedAdamW", .adam = true, .lr = 0.01, .weight_decay = 0.1, .adamw = true, .max_norm = 1.0},
            Case{.name = "ClippedSgd", .max_norm = 1.0},
            Case{.name = "ScheduledAdamW",
                 .adam = true,
                 .lr = 0.01,
                 .weight_decay = 0.1,
                 .adamw = true,
                 .warmup = 2,
                 .decay_steps = 5}),
        ::testing::Values(DType::kF32, DType::kF64)),
    case_name);

TEST(Optim, WarmupCosineDecayScheduleIsOptaxs) {
  const Mesh mesh = *shared_client().make_mesh({1}, {"data"}, {0});
  std::vector<int32_t> counts(12);
  for (size_t i = 0; i < counts.size(); ++i) counts[i] = static_cast<int32_t>(i);
  absl::StatusOr<Array> in =
      shared_client().device_put(HostArray::from_vector<int32_t>({12}, counts), NamedSharding(mesh, P()));
  ASSERT_TRUE(in.ok()) << in.status();
  const optim::Schedule schedule = optim::warmup_cosine_decay_schedule(0.1, 1.0, 3, 9, 0.05);
  absl::StatusOr<std::vector<Array>> out =
      jit([&](const std::vector<Value>& x) { return std::vector<Value>{schedule(x[0])}; })({*in});
  ASSERT_TRUE(out.ok()) << out.status();
  const HostArray got = *(*out)[0].fetch();
  ASSERT_EQ(got.dtype(), DType::kF32);
  for (int32_t c : counts) {  // warmup, the decay, and the end value held past decay_steps
    EXPECT_NEAR(got.element_as_double(c), host_schedule(0.1, 1.0, 3, 9, 0.05, c), 1e-6) << "count " << c;
  }
  EXPECT_NEAR(got.element_as_double(11), 0.05, 1e-7);
}

TEST(Optim, MismatchedTreesNameTheLeaf) {
  const Mesh mesh = *shared_client().make_mesh({1}, {"data"}, {0});
  Tree<Array> params = put(mesh, DType::kF32, {{"layer.w", std::vector<double>(24, 1.0)}, {"layer.b", {1, 2, 3}}});
  Tree<Array> grads = put(mesh, DType::kF32, {{"layer.w", std::vector<double>(24, 1.0)}});
  const optim::GradientTransformation opt = optim::adam(0.1);
  absl::StatusOr<std::vector<Tree<Array>>> out = jit([&](const std::vector<Tree<Value>>& in) {
    auto [updates, state] = opt.update(in[1], opt.init(in[0]), in[0]);
    return std::vector<Tree<Value>>{updates, state};
  })({params, grads});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("'layer.b' is in the first moments but not in the updates"));
}

// A two-layer regression trained with clip + adamw, params sharded over 'data' by their first
// dimension (FSDP-like) and the batch over 'data'; the same run on one device.
struct TrainRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<double>> params;
};

TrainRun train(const Mesh& mesh) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random = [&](Shape shape, float scale) {
    HostArray a(DType::kF32, std::move(shape));
    for (float& v : a.mutable_values<float>()) v = u(rng) * scale;
    return a;
  };
  Tree<HostArray> host;
  host.set("layers.0.w", random({8, 16}, 0.5f)).set("layers.0.b", HostArray::zeros(DType::kF32, {16}));
  host.set("layers.1.w", random({16, 1}, 0.5f)).set("layers.1.b", HostArray::zeros(DType::kF32, {1}));
  const ShardingRule fsdp = ShardingRule::globs({{"*.w", P("data", None)}, {"*", P()}});
  TrainRun run;
  absl::StatusOr<Tree<Array>> params = device_put(shared_client(), host, mesh, fsdp);
  EXPECT_TRUE(params.ok()) << params.status();
  if (!params.ok()) return run;
  const optim::GradientTransformation opt =
      optim::chain({optim::clip_by_global_norm(1.0), optim::adamw(0.02, 0.9, 0.999, 1e-8, 0.01)});
  TreeJitted init = jit([&](const std::vector<Tree<Value>>& in) { return std::vector<Tree<Value>>{opt.init(in[0])}; });
  TreeFunction loss = [](const std::vector<Tree<Value>>& in) {
    const Tree<Value> l0 = in[0].subtree("layers.0"), l1 = in[0].subtree("layers.1");
    const Value h = tanh(matmul(*in[1].find("x"), *l0.find("w")) + *l0.find("b"));
    const Value err = matmul(h, *l1.find("w")) + *l1.find("b") - *in[1].find("y");
    return std::vector<Tree<Value>>{mean(err * err)};
  };
  TreeJitOptions options;
  options.donate_argnums = {0, 1};
  options.in_shardings = {fsdp, std::nullopt, std::nullopt};
  TreeJitted step = jit(
      [&](const std::vector<Tree<Value>>& in) {
        std::vector<Tree<Value>> vg = value_and_grad(loss, {0})({in[0], in[2]});
        auto [updates, state] = opt.update(vg[1], in[1], in[0]);
        return std::vector<Tree<Value>>{vg[0], optim::apply_updates(in[0], updates), state};
      },
      options);
  absl::StatusOr<std::vector<Tree<Array>>> state = init({*params});
  EXPECT_TRUE(state.ok()) << state.status();
  if (!state.ok()) return run;
  Tree<Array> p = *params, s = state->at(0);
  for (int k = 0; k < 12; ++k) {
    Tree<HostArray> batch;
    HostArray x = random({32, 8}, 1.0f);
    HostArray y(DType::kF32, {32, 1});
    for (int64_t i = 0; i < 32; ++i) {
      double t = 0;
      for (int64_t j = 0; j < 8; ++j) t += x.values<float>()[i * 8 + j] * (j % 2 ? 0.5 : -0.3);
      y.mutable_values<float>()[i] = static_cast<float>(std::sin(t));
    }
    batch.set("x", std::move(x)).set("y", std::move(y));
    absl::StatusOr<Tree<Array>> b = device_put(shared_client(), batch, mesh, P("data", None));
    EXPECT_TRUE(b.ok()) << b.status();
    absl::StatusOr<std::vector<Tree<Array>>> out = step({p, s, *b});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return run;
    run.losses.push_back(out->at(0).find("")->fetch()->element_as_double(0));
    p = out->at(1);
    s = out->at(2);
  }
  // The parameters and their moments stay split as put.
  EXPECT_EQ(p.find("layers.0.w")->sharding().spec(), P("data", None));
  const Array* mu = s.find("1.0.mu.layers.0.w");
  EXPECT_NE(mu, nullptr) << absl::StrJoin(s.structure()->names(), ", ");
  if (mu != nullptr) {
    EXPECT_EQ(mu->sharding().spec(), P("data", None));
  }
  for (const auto& [n, a] : p) run.params[n] = from_host(*a.fetch());
  return run;
}

// On Auto axes: the compiler gathers the FSDP-split weights where the matmuls need them (on
// make_mesh's Explicit axes the weights' 'data' split meets the batch's, which JAX >= 0.9
// refuses without a reshard).
TEST(Optim, FsdpShardedTrainStepGivesTheOneDeviceRun) {
  const TrainRun one = train(*shared_client().make_mesh({1}, {"data"}, {0}, {AxisType::kAuto}));
  const TrainRun eight = train(*shared_client().make_mesh({8}, {"data"}, {0, 1, 2, 3, 4, 5, 6, 7}, {AxisType::kAuto}));
  ASSERT_EQ(one.losses.size(), 12u);
  ASSERT_EQ(eight.losses.size(), 12u);
  EXPECT_LT(one.losses.back(), 0.5 * one.losses.front());
  for (size_t i = 0; i < one.losses.size(); ++i) EXPECT_NEAR(eight.losses[i], one.losses[i], 1e-5) << i;
  for (const auto& [n, v] : one.params) {
    for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(eight.params.at(n)[i], v[i], 1e-5) << n << "[" << i << "]";
  }
}

}  // namespace
}  // namespace tessera

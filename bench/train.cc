// bench_train: the step time of a larger MLP (batch 1024, 784 -> 2048 -> 2048 -> 10, float32:
// jit(value_and_grad + SGD), parameters donated) on a (4, 2) mesh of Client::local(8) next to
// the same step on a (1, 1) mesh, measured in the same run, with where the time goes.
//
//   bin/bench_train [--iters=8] [--batch=1024] [--hidden=2048] [--json]
//
// Layout (Megatron-style): the batch over 'data'; w1 split by columns and w2 by rows over
// 'model', so the hidden activations stay split and one all_reduce joins the second layer;
// the gradients are summed over 'data'. On 2 cores 8 workers cannot be faster than one: the
// goal is a sharded step within 1.5x of the single-device one.
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "bench/stats.h"
#include "core/daemon.h"
#include "tessera/tessera.h"
#include "worker/kernels/blas.h"

ABSL_FLAG(int, iters, 8, "timed steps per mesh (median)");
ABSL_FLAG(int, batch, 1024, "examples per step");
ABSL_FLAG(int, hidden, 2048, "width of both hidden layers");
ABSL_FLAG(bool, json, false, "one JSON object instead of text");

namespace {

using namespace tessera;

constexpr int64_t kIn = 784, kOut = 10;

std::vector<Value> loss(const std::vector<Value>& in) {
  const Value h1 = maximum(matmul(in[6], in[0]) + in[1], full({}, 0.0));
  const Value h2 = maximum(matmul(h1, in[2]) + in[3], full({}, 0.0));
  const Value z = matmul(h2, in[4]) + in[5];
  const Value shifted = z - max(z, {1}, true);
  return {-mean(sum(in[7] * (shifted - log(sum(exp(shifted), {1}, true))), {1}))};
}

struct MeshTimes {
  double step_s = 0;         // call until its outputs are ready (median)
  double dispatch_s = 0;     // the call itself (median): how long the caller is held
  int collectives = 0;       // in one device's plan
  std::string device0_plan;  // as_text() of device 0 (every device runs the same collectives)
};

absl::StatusOr<MeshTimes> time_steps(const Client& client, const Mesh& mesh, int64_t batch, int64_t hidden, int iters) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  auto random = [&](Shape shape) {
    HostArray a(DType::kF32, std::move(shape));
    for (float& v : a.mutable_values<float>()) v = u(rng);
    return a;
  };
  const std::vector<std::pair<Shape, PartitionSpec>> layout = {{{kIn, hidden}, P(None, "model")},
                                                               {{hidden}, P("model")},
                                                               {{hidden, hidden}, P("model", None)},
                                                               {{hidden}, P()},
                                                               {{hidden, kOut}, P()},
                                                               {{kOut}, P()},
                                                               {{batch, kIn}, P("data", None)},
                                                               {{batch, kOut}, P("data", None)}};
  std::vector<Array> args;
  for (const auto& [shape, spec] : layout) {
    absl::StatusOr<Array> a = client.device_put(random(shape), NamedSharding(mesh, spec));
    if (!a.ok()) return a.status();
    args.push_back(*std::move(a));
  }
  JitOptions options;
  options.donate_argnums = {0, 1, 2, 3, 4, 5};
  Jitted step = jit(
      [](const std::vector<Value>& in) {
        std::vector<Value> vg = value_and_grad(loss, {0, 1, 2, 3, 4, 5})(in);
        std::vector<Value> out = {vg[0]};
        for (int i = 0; i < 6; ++i) out.push_back(in[i] - vg[i + 1] * 0.01);
        return out;
      },
      options);
  std::vector<double> steps, dispatches;
  for (int i = 0; i < iters + 2; ++i) {  // two warm-up steps: compilation, plan loading
    const absl::Time t = absl::Now();
    absl::StatusOr<std::vector<Array>> out = step(args);
    const absl::Time dispatched = absl::Now();
    if (!out.ok()) return out.status();
    absl::Status ready = block_until_ready(*out);
    if (!ready.ok()) return ready;
    if (i >= 2) {
      steps.push_back(absl::ToDoubleSeconds(absl::Now() - t));
      dispatches.push_back(absl::ToDoubleSeconds(dispatched - t));
    }
    std::copy(out->begin() + 1, out->end(), args.begin());
  }
  MeshTimes m;
  m.step_s = median(steps);
  m.dispatch_s = median(dispatches);
  m.device0_plan = step.as_text(mesh.device_ids()[0]);
  for (const char* c : {"all_reduce(", "all_gather(", "reduce_scatter(", "all_to_all(", "collective_permute("}) {
    for (size_t at = m.device0_plan.find(c); at != std::string::npos; at = m.device0_plan.find(c, at + 1)) {
      ++m.collectives;
    }
  }
  return m;
}

// The step's all_reduces (from device 0's plan) run on their own, one after another, with the
// same replica groups and block shapes: the time the step spends in them (median of 3 each).
absl::StatusOr<double> all_reduce_seconds(const Client& client, const Mesh& mesh, const std::string& plan) {
  double total = 0;
  for (absl::string_view line : absl::StrSplit(plan, '\n')) {
    const size_t at = line.find("= all_reduce(sum, groups={");
    if (at == absl::string_view::npos) continue;
    CollectiveSpec spec;
    spec.kind = CollectiveKind::kAllReduce;
    const size_t g0 = line.find('{', at) + 1, g1 = line.find("}}", at);
    for (absl::string_view group : absl::StrSplit(line.substr(g0, g1 - g0), "},{")) {
      spec.groups.emplace_back();
      for (absl::string_view d : absl::StrSplit(absl::StripPrefix(group, "{"), ',')) {
        int id = 0;
        if (absl::SimpleAtoi(d, &id)) spec.groups.back().push_back(id);
      }
    }
    const size_t s0 = line.find("f32[", g1) + 4, s1 = line.find(']', s0);
    Shape block;
    for (absl::string_view dim : absl::StrSplit(line.substr(s0, s1 - s0), ',', absl::SkipEmpty())) {
      int64_t n = 0;
      if (absl::SimpleAtoi(dim, &n)) block.push_back(n);
    }
    if (block.empty()) block = {1};
    Shape global = block;
    global[0] *= mesh.size();  // every device its own block of that shape
    absl::StatusOr<Array> x =
        client.device_put(HostArray::ones(DType::kF32, global), NamedSharding(mesh, P(mesh.axis_names())));
    if (!x.ok()) return x.status();
    std::vector<double> times;
    for (int i = 0; i < 3; ++i) {
      CollectiveTiming timing;
      absl::StatusOr<Array> y = run_collective(*x, spec, absl::Seconds(30), &timing);
      if (!y.ok()) return y.status();
      times.push_back(absl::ToDoubleSeconds(timing.collective));
    }
    total += median(times);
  }
  return total;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_fast_blas(argv);  // the in-process workers compute with this process's OpenBLAS
  absl::SetProgramUsageMessage(
      "Times an MLP training step on a (4, 2) mesh against a (1, 1) mesh.\nUsage: bench_train [--iters=8]");
  parse_flags(argc, argv, "bench_train", {});
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const int64_t batch = absl::GetFlag(FLAGS_batch), hidden = absl::GetFlag(FLAGS_hidden);
  absl::StatusOr<Client> client = Client::local(8);
  // Auto axes: the step relies on GSPMD-style propagation (Explicit axes would ask for out_sharding).
  const std::vector<AxisType> automatic = {AxisType::kAuto, AxisType::kAuto};
  absl::StatusOr<Mesh> single =
      client.ok() ? client->make_mesh({1, 1}, {"data", "model"}, {0}, automatic) : client.status();
  absl::StatusOr<Mesh> sharded =
      client.ok() ? client->make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7}, automatic) : client.status();
  if (!single.ok() || !sharded.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", (single.ok() ? sharded.status() : single.status()).ToString().c_str());
    return 1;
  }
  absl::StatusOr<MeshTimes> one = time_steps(*client, *single, batch, hidden, iters);
  absl::StatusOr<MeshTimes> eight = one.ok() ? time_steps(*client, *sharded, batch, hidden, iters) : one.status();
  if (!eight.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", eight.status().ToString().c_str());
    return 1;
  }
  // A cached tiny call on the (4, 2) mesh: what dispatching one step costs, without compute.
  absl::StatusOr<Array> tiny =
      client->device_put(HostArray::ones(DType::kF32, {8, 8}), NamedSharding(*sharded, P("data", "model")));
  Jitted touch = jit([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + 1.0}; });
  std::vector<double> round_trips;
  for (int i = 0; tiny.ok() && i < 50; ++i) {
    const absl::Time t = absl::Now();
    absl::StatusOr<std::vector<Array>> out = touch({*tiny});
    if (out.ok() && block_until_ready(*out).ok()) round_trips.push_back(absl::ToDoubleSeconds(absl::Now() - t));
  }
  const double call_s = round_trips.empty() ? 0 : median(round_trips);
  const double ratio = eight->step_s / one->step_s;
  absl::StatusOr<double> reduce_s = all_reduce_seconds(*client, *sharded, eight->device0_plan);
  if (!reduce_s.ok()) {
    std::fprintf(stderr, "bench_train: %s\n", reduce_s.status().ToString().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::printf(
        "{\"step_1x1_ms\": %.2f, \"step_4x2_ms\": %.2f, \"ratio\": %.3f, \"dispatch_4x2_ms\": %.3f, "
        "\"empty_call_4x2_ms\": %.3f, \"collectives_per_step\": %d, \"all_reduces_ms\": %.2f}\n",
        1e3 * one->step_s, 1e3 * eight->step_s, ratio, 1e3 * eight->dispatch_s, 1e3 * call_s, eight->collectives,
        1e3 * *reduce_s);
  } else {
    std::printf("MLP step, batch %lld, 784 -> %lld -> %lld -> 10, float32 (median of %d steps):\n",
                static_cast<long long>(batch), static_cast<long long>(hidden), static_cast<long long>(hidden), iters);
    std::printf("  (1, 1) mesh: %8.2f ms\n", 1e3 * one->step_s);
    std::printf("  (4, 2) mesh: %8.2f ms  = %.2fx the single device (goal <= 1.5x)\n", 1e3 * eight->step_s, ratio);
    std::printf("  where the (4, 2) step goes: its %d all_reduces run alone %.1f ms; an empty call's round trip\n",
                eight->collectives, 1e3 * *reduce_s);
    std::printf("  %.2f ms (the call itself returns in %.3f ms); the rest, %.1f ms, is the kernels (%.1f ms on one\n",
                1e3 * call_s, 1e3 * eight->dispatch_s, 1e3 * (eight->step_s - *reduce_s - call_s), 1e3 * one->step_s);
    std::printf("  device) sharing the 2 cores among 8 workers\n");
  }
  return 0;
}

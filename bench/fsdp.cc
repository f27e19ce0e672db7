// bench_fsdp: step time and bytes moved of the distributed-arrays MLP step (bench/fsdp_mlp.h)
// under data parallelism, automatic FSDP (parameters P('data', None), as JAX users write it)
// and FSDP with each weight pinned to P() before use, on the (8,) and (4, 2) meshes of
// Client::local(8), next to the same step on one device, measured in the same run. Issue 14
// item 6's goal: automatic FSDP moves at most 1.2x the bytes of the pinned one.
//
//   bin/bench_fsdp [--iters=5] [--json]
//
// Bytes are the compiler's accounting (what device 0 receives per step, as as_text() prints
// it); times are medians of --iters steps after two warm-up steps, parameters donated. On 2
// cores 8 workers share the machine, so a sharded step is not expected to beat one device.
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "bench/fsdp_mlp.h"
#include "bench/stats.h"
#include "core/daemon.h"
#include "tessera/tessera.h"
#include "worker/kernels/blas.h"

ABSL_FLAG(int, iters, 5, "timed steps per layout and mesh (median)");
ABSL_FLAG(bool, json, false, "one JSON object per line instead of text");

namespace tessera {
namespace {

struct Figures {
  double step_ms = 0;
  double bytes = 0;  // received by device 0 per step
  int collectives = 0;
};

absl::StatusOr<Figures> time_layout(const Client& client, const Mesh& mesh, FsdpLayout layout, int iters) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  const std::vector<ArrayType> types = fsdp_mlp_types();
  const std::vector<PartitionSpec> specs = fsdp_mlp_specs(layout);
  std::vector<Array> args;
  for (size_t i = 0; i < types.size(); ++i) {
    HostArray a(types[i].dtype, types[i].shape);
    for (float& v : a.mutable_values<float>()) v = u(rng);
    // A one-device mesh has no 'data' to split over: everything is replicated there.
    absl::StatusOr<Array> put = client.device_put(a, NamedSharding(mesh, mesh.size() == 1 ? P() : specs[i]));
    if (!put.ok()) return put.status();
    args.push_back(*std::move(put));
  }
  JitOptions options;
  options.donate_argnums = {0, 1, 2, 3, 4, 5, 6, 7};
  Jitted step = jit(fsdp_mlp_step(mesh, layout), options);
  std::vector<double> times;
  for (int i = 0; i < iters + 2; ++i) {
    const absl::Time t = absl::Now();
    absl::StatusOr<std::vector<Array>> out = step(args);
    if (!out.ok()) return out.status();
    TESSERA_RETURN_IF_ERROR(block_until_ready(*out));
    if (i >= 2) times.push_back(1e3 * absl::ToDoubleSeconds(absl::Now() - t));
    std::copy(out->begin() + 1, out->end(), args.begin());
  }
  Figures f;
  f.step_ms = median(times);
  const PlanFigures plan = parse_plan_header(step.as_text());
  f.bytes = plan.bytes;
  f.collectives = plan.collectives;
  return f;
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  using namespace tessera;
  ensure_fast_blas(argv);  // the in-process workers compute with this process's OpenBLAS
  absl::SetProgramUsageMessage(
      "Times the distributed-arrays MLP step under DP, automatic FSDP and pinned FSDP on Client::local(8).\n"
      "Usage: bench_fsdp [--iters=5] [--json]");
  parse_flags(argc, argv, "bench_fsdp", {});
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const bool json = absl::GetFlag(FLAGS_json);
  absl::StatusOr<Client> client = Client::local(8);
  if (!client.ok()) {
    std::fprintf(stderr, "bench_fsdp: %s\n", client.status().ToString().c_str());
    return 1;
  }
  // Auto axes throughout: automatic FSDP is GSPMD-style propagation from pinned parameters.
  absl::StatusOr<Mesh> one = client->make_mesh({1}, {"data"}, {0}, {AxisType::kAuto});
  absl::StatusOr<Figures> reference =
      one.ok() ? time_layout(*client, *one, FsdpLayout::kDataParallel, iters) : absl::StatusOr<Figures>(one.status());
  if (!reference.ok()) {
    std::fprintf(stderr, "bench_fsdp: one device: %s\n", reference.status().ToString().c_str());
    return 1;
  }
  if (!json) std::printf("MLP step 784->1024->1024->1024->10, batch 1024 (median of %d steps)\n", iters);
  if (!json) std::printf("  one device           %8.1f ms\n", reference->step_ms);
  struct MeshCase {
    const char* name;
    std::vector<int64_t> shape;
    std::vector<std::string> axes;
  };
  for (const MeshCase& m : {MeshCase{"(8,)", {8}, {"data"}}, MeshCase{"(4,2)", {4, 2}, {"data", "model"}}}) {
    absl::StatusOr<Mesh> mesh = client->make_mesh(m.shape, m.axes, {0, 1, 2, 3, 4, 5, 6, 7},
                                                  std::vector<AxisType>(m.axes.size(), AxisType::kAuto));
    if (!mesh.ok()) {
      std::fprintf(stderr, "bench_fsdp: %s\n", mesh.status().ToString().c_str());
      return 1;
    }
    double pinned_bytes = 0, pinned_ms = 0;
    for (FsdpLayout l : {FsdpLayout::kPinned, FsdpLayout::kAuto, FsdpLayout::kDataParallel}) {
      absl::StatusOr<Figures> f = time_layout(*client, *mesh, l, iters);
      if (!f.ok()) {
        std::fprintf(stderr, "bench_fsdp: %s on %s: %s\n", fsdp_layout_name(l), m.name, f.status().ToString().c_str());
        return 1;
      }
      if (l == FsdpLayout::kPinned) {
        pinned_bytes = f->bytes;
        pinned_ms = f->step_ms;
      }
      if (json) {
        std::printf(
            "{\"program\": \"mlp_%s\", \"mesh\": \"%s\", \"step_ms\": %.2f, \"bytes_per_device\": %.0f, "
            "\"collectives\": %d, \"bytes_vs_pinned\": %.3f, \"time_vs_pinned\": %.3f, \"time_vs_one_device\": %.3f, "
            "\"one_device_step_ms\": %.2f}\n",
            fsdp_layout_name(l), m.name, f->step_ms, f->bytes, f->collectives, f->bytes / pinned_bytes,
            f->step_ms / pinned_ms, f->step_ms / reference->step_ms, reference->step_ms);
      } else {
        std::printf(
            "  %-11s %-6s %8.1f ms (%.2fx pinned, %.2fx one device), %6.1f MB received by device 0 (%.2fx "
            "pinned), %d collectives\n",
            fsdp_layout_name(l), m.name, f->step_ms, f->step_ms / pinned_ms, f->step_ms / reference->step_ms,
            f->bytes / 1e6, f->bytes / pinned_bytes, f->collectives);
      }
    }
  }
  return 0;
}

// bench_compile: compile time and program size of the digits MLP training step (examples/
// mlp_model.h: value_and_grad + SGD, batch over 'data', hidden layer over 'model') on meshes of
// 8 to 4096 devices — compile only (propagation and partitioning, no workers). The partitioner
// emits one SPMD program whatever the mesh (core/plan.h), so both figures should stay flat:
// the goal is at most 1.5x from 8 to 4096 devices. Also times what each worker does with the
// program once (resolve it for its position) and reports the ratios against 8 devices.
//
//   bin/bench_compile [--iters=5] [--json]
//
// Then the bytes each device receives per step of the distributed-arrays MLP under data
// parallelism, automatic FSDP and hand-pinned FSDP (issue 14 item 6's goal: automatic <= 1.2x
// pinned), from the compiler's accounting.
//
// --json prints one object per line: {"program", "devices", "compile_ms", "program_bytes",
// "resolve_ms"}, then {"program", "mesh", "bytes_per_device", "collectives", "vs_pinned"}. program_bytes is the
// LoadPlan payload every worker receives (the program and its mesh, whose device list is the only part that grows:
// about 2 bytes per device).
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/time/clock.h"
#include "bench/fsdp_mlp.h"
#include "bench/stats.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/propagate.h"
#include "core/daemon.h"
#include "core/wire.h"
#include "examples/mlp_model.h"
#include "proto/tessera.pb.h"
#include "tessera/grad.h"

ABSL_FLAG(int, iters, 5, "timed compilations per mesh (median)");
ABSL_FLAG(bool, json, false, "one JSON object per line instead of text");
ABSL_FLAG(bool, print_programs, false, "also print the MLP steps' programs (as_text)");

namespace tessera {
namespace {

// Bytes each device receives per step (the compiler's accounting) for data parallelism
// (parameters replicated), FSDP as JAX users write it (parameters P('data', None)) and FSDP
// with every weight pinned to P() before use. Goal: automatic FSDP <= 1.2x the pinned one.
void fsdp_bytes(bool json) {
  const std::vector<ArrayType> types = fsdp_mlp_types();
  struct MeshCase {
    const char* name;
    std::vector<int64_t> shape;
    std::vector<std::string> axes;
  };
  for (const MeshCase& m : {MeshCase{"(8,)", {8}, {"data"}}, MeshCase{"(4,2)", {4, 2}, {"data", "model"}}}) {
    const Mesh mesh = *make_mesh(m.shape, m.axes, {0, 1, 2, 3, 4, 5, 6, 7});
    double pinned = 0;
    for (FsdpLayout l : {FsdpLayout::kPinned, FsdpLayout::kAuto, FsdpLayout::kDataParallel}) {
      const char* layout = fsdp_layout_name(l);
      const bool pin = l == FsdpLayout::kPinned;
      const std::vector<PartitionSpec> specs = fsdp_mlp_specs(l);
      absl::StatusOr<Graph> g = trace(fsdp_mlp_step(mesh, l), types);
      const std::vector<std::optional<PartitionSpec>> outputs(g.ok() ? g->outputs().size() : 0);
      absl::StatusOr<Propagation> p = g.ok() ? propagate(*g, mesh, specs, outputs) : g.status();
      absl::StatusOr<Executable> e = p.ok() ? partition(*g, mesh, *p, outputs) : p.status();
      if (!e.ok()) {
        std::fprintf(stderr, "bench_compile: %s on %s: %s\n", layout, m.name, e.status().ToString().c_str());
        continue;
      }
      const double bytes = static_cast<double>(collective_bytes_per_device(e->program, e->mesh));
      int collectives = 0;
      for (const Instruction& i : e->program.code) collectives += i.kind == Instruction::Kind::kCollective;
      if (pin) pinned = bytes;
      if (absl::GetFlag(FLAGS_print_programs)) std::printf("# %s on %s\n%s", layout, m.name, e->as_text().c_str());
      if (json) {
        std::printf(
            "{\"program\": \"mlp_%s\", \"mesh\": \"%s\", \"bytes_per_device\": %.0f, \"collectives\": %d, "
            "\"vs_pinned\": %.3f}\n",
            layout, m.name, bytes, collectives, bytes / pinned);
      } else {
        std::printf("%-12s %-6s %12.1f MB received per device per step, %3d collectives, %.2fx the pinned FSDP\n",
                    layout, m.name, bytes / 1e6, collectives, bytes / pinned);
      }
    }
  }
}

}  // namespace
}  // namespace tessera

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Times compiling the digits MLP train step for meshes of 8 to 4096 devices (no workers).\n"
      "Usage: bench_compile [--iters=5] [--json]");
  tessera::parse_flags(argc, argv, "bench_compile", {});
  using namespace tessera;
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const bool json = absl::GetFlag(FLAGS_json);
  // The example's model at a batch every data axis below divides: 64 pixels, 64 hidden units
  // (split over 'model' = 8), 10 classes.
  constexpr int64_t kBatch = 4096, kPixels = 64, kHidden = 64, kClasses = 10;
  const std::vector<ArrayType> types = {{DType::kF32, {kPixels, kHidden}},  {DType::kF32, {kHidden}},
                                        {DType::kF32, {kHidden, kClasses}}, {DType::kF32, {kClasses}},
                                        {DType::kF32, {kBatch, kPixels}},   {DType::kF32, {kBatch, kClasses}}};
  const std::vector<PartitionSpec> specs = {P(None, "model"), P("model"),     P("model", None), P(),
                                            P("data", None),  P("data", None)};
  absl::StatusOr<Graph> graph = trace(mlp::train_step(0.1), types);
  if (!graph.ok()) {
    std::fprintf(stderr, "bench_compile: %s\n", graph.status().ToString().c_str());
    return 1;
  }
  const std::vector<std::optional<PartitionSpec>> outputs(graph->outputs().size());
  const std::vector<int> donated = {0, 1, 2, 3};
  double base_ms = 0, base_bytes = 0;
  if (!json)
    std::printf("%-10s %8s %12s %14s %12s %10s %10s\n", "program", "devices", "compile_ms", "program_bytes",
                "resolve_ms", "compile_x", "bytes_x");
  for (int64_t devices : {8, 64, 512, 4096}) {
    std::vector<int> ids(devices);
    for (int64_t i = 0; i < devices; ++i) ids[i] = static_cast<int>(i);
    const Mesh mesh = *make_mesh({devices / 8, 8}, {"data", "model"}, ids);
    std::vector<double> compile_s, resolve_s;
    std::optional<Executable> exe;
    for (int i = 0; i < iters; ++i) {
      const absl::Time t = absl::Now();
      absl::StatusOr<Propagation> p = propagate(*graph, mesh, specs, outputs);
      absl::StatusOr<Executable> e = p.ok() ? partition(*graph, mesh, *p, outputs, donated) : p.status();
      if (!e.ok()) {
        std::fprintf(stderr, "bench_compile: %lld devices: %s\n", static_cast<long long>(devices),
                     e.status().ToString().c_str());
        return 1;
      }
      compile_s.push_back(absl::ToDoubleSeconds(absl::Now() - t));
      exe = *std::move(e);
      const absl::Time r = absl::Now();
      absl::StatusOr<DevicePlan> mine = resolve(exe->program, exe->mesh, ids.back());
      if (!mine.ok()) {
        std::fprintf(stderr, "bench_compile: %s\n", mine.status().ToString().c_str());
        return 1;
      }
      resolve_s.push_back(absl::ToDoubleSeconds(absl::Now() - r));
    }
    pb::LoadPlanRequest load;
    to_proto(exe->program, load.mutable_plan());
    to_proto(exe->mesh, load.mutable_mesh());
    const double compile_ms = 1e3 * median(compile_s), resolve_ms = 1e3 * median(resolve_s);
    const double bytes = static_cast<double>(load.ByteSizeLong());
    if (devices == 8) {
      base_ms = compile_ms;
      base_bytes = bytes;
    }
    if (json) {
      std::printf(
          "{\"program\": \"mlp_step\", \"devices\": %lld, \"compile_ms\": %.3f, \"program_bytes\": %.0f, "
          "\"resolve_ms\": %.3f}\n",
          static_cast<long long>(devices), compile_ms, bytes, resolve_ms);
    } else {
      std::printf("%-10s %8lld %12.3f %14.0f %12.3f %9.2fx %9.2fx\n", "mlp_step", static_cast<long long>(devices),
                  compile_ms, bytes, resolve_ms, compile_ms / base_ms, bytes / base_bytes);
    }
  }
  fsdp_bytes(json);
  return 0;
}

// The compiled training step of example_transformer (examples/transformer_model.h) under fsdp,
// compiled here without a cluster (trace, propagate, partition: what the coordinator's program
// cache does) and read through the compiler's byte accounting, the figure bench_transformer
// reports as bytes_per_step (as_text()'s header: collective_bytes_per_device of the program).
//
// Issue #15's goal: fsdp moves no more than 1.2x the bytes of the hand-written FSDP plan, in
// which every parameter, stored split over the data-parallel axes ('data' and 'model' under
// fsdp), is all-gathered once for use and its gradient reduce-scattered back to its block:
// (n-1)/n of the parameter's bytes each way.
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/propagate.h"
#include "core/plan.h"
#include "core/shape.h"
#include "examples/transformer_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera::transformer {
namespace {

struct Step {
  std::optional<Executable> exe;  // none when the compilation failed (the test has failed then)
  Tree<ArrayType> params;         // name -> type
};

// The leaves of `types` as flat ArrayTypes and Values unflattened back into the tree.
Tree<Value> unflatten_values(const Tree<ArrayType>& types, const std::vector<Value>& flat, size_t* at) {
  Tree<Value> out;
  for (const auto& [name, type] : types) out.set(name, flat[(*at)++]);
  return out;
}

// Model::train_step compiled for `mesh` as jit would: inputs params (in their storage layouts),
// optimiser state (as optimizer_init lays it out: each moment as its parameter, the count
// replicated), tokens and targets (the layout's batch_spec); new parameters pinned to their storage
// layouts (train_step's out_shardings).
Step compile_step(const Config& c, Layout layout, const Mesh& mesh) {
  const Model model(c, layout, mesh);
  Step step;
  for (const auto& [name, info] : param_infos(c, layout)) step.params.set(name, ArrayType{DType::kF32, info.shape});
  auto param_spec = [&](const std::string& name) { return storage_spec(c, layout, mesh, name); };

  // The optimiser state's names and types, from tracing its init.
  Tree<ArrayType> state;
  {
    std::vector<ArrayType> types = step.params.flatten();
    absl::StatusOr<Graph> g = trace(
        [&](const std::vector<Value>& in) {
          size_t at = 0;
          const Tree<Value> s = model.optimizer().init(unflatten_values(step.params, in, &at));
          for (const auto& [name, v] : s) state.set(name, ArrayType{v.dtype(), v.shape()});
          return s.flatten();
        },
        types);
    EXPECT_TRUE(g.ok()) << g.status();
  }
  auto state_spec = [&](const std::string& name) {
    for (const auto& [p, type] : step.params) {
      if (absl::EndsWith(name, "." + p)) return param_spec(p);
    }
    return PartitionSpec();
  };

  std::vector<ArrayType> types;
  std::vector<NamedSharding> shardings;
  for (const auto& [name, type] : step.params) {
    types.push_back(type);
    shardings.emplace_back(mesh, param_spec(name));
  }
  for (const auto& [name, type] : state) {
    types.push_back(type);
    shardings.emplace_back(mesh, state_spec(name));
  }
  for (int k = 0; k < 2; ++k) {
    types.push_back(ArrayType{DType::kI32, {c.batch, c.seq}});
    shardings.emplace_back(mesh, model.batch_spec());
  }
  const TreeFunction f = model.train_step_function();
  absl::StatusOr<Graph> g = trace(
      [&](const std::vector<Value>& in) {
        size_t at = 0;
        const Tree<Value> params = unflatten_values(step.params, in, &at);
        const Tree<Value> s = unflatten_values(state, in, &at);
        Tree<Value> batch;
        batch.set("targets", in[at + 1]);
        batch.set("tokens", in[at]);
        const std::vector<Tree<Value>> out = f({params, s, batch});
        std::vector<Value> flat = out[0].flatten();
        for (const auto& [name, v] : out[1])
          flat.push_back(with_sharding_constraint(v, NamedSharding(mesh, param_spec(name))));
        for (const Value& v : out[2].flatten()) flat.push_back(v);
        return flat;
      },
      types, shardings);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return step;
  std::vector<PartitionSpec> specs;
  for (const NamedSharding& s : shardings) specs.push_back(s.spec());
  const std::vector<std::optional<PartitionSpec>> outputs(g->outputs().size());
  absl::StatusOr<Propagation> p = propagate(*g, mesh, specs, outputs);
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return step;
  absl::StatusOr<Executable> exe = partition(*g, mesh, *p, outputs);
  EXPECT_TRUE(exe.ok()) << exe.status();
  if (exe.ok()) step.exe.emplace(*std::move(exe));
  return step;
}

// The element counts of the top-level program's all_reduces (not the loop's): a combined one
// counts all it carries.
std::vector<int64_t> top_level_all_reduce_elements(const Executable& exe) {
  std::vector<int64_t> out;
  for (const Instruction& i : exe.program.code) {
    if (i.kind != Instruction::Kind::kCollective || i.collective.kind != CollectiveKind::kAllReduce) continue;
    out.push_back(num_elements(i.node.shape));
  }
  return out;
}

Config small() {
  Config c;
  c.vocab = 256;  // the embedding and the output projection are most of the parameters
  c.d_model = 32;
  c.heads = 2;
  c.layers = 1;
  c.seq = 8;
  c.batch = 8;
  return c;
}

Mesh mesh_4x2() {
  return *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7}, {AxisType::kAuto, AxisType::kAuto});
}

// The parameters outside the scanned layers (token and position embeddings, final norm, output
// projection) are FSDP-split like the layers' weights: gathered for use, their gradients
// reduce-scattered, never all-reduced whole. Here they are 57% of the parameters, so an
// all_reduce of their gradients (2(n-1)/n of their bytes instead of (n-1)/n) would also break
// the 1.2x goal (1.29x).
TEST(TransformerPlan, FsdpStepMovesTheBytesOfGatheringEachWeightAndScatteringEachGradient) {
  const Config c = small();
  const Mesh mesh = mesh_4x2();
  const Step step = compile_step(c, Layout::kFsdp, mesh);
  ASSERT_TRUE(step.exe.has_value());
  const Executable& exe = *step.exe;
  const std::string text = exe.as_text();

  // The hand count: each parameter's bytes, (n-1)/n of them gathered and (n-1)/n scattered
  // (nccl-tests' convention, which collective_bytes_per_device documents), over the n devices
  // of the data-parallel axes.
  const int64_t n = mesh.axis_size("data") * mesh.axis_size("model");
  int64_t reference = 0, smallest_outside = -1;
  for (const auto& [name, type] : step.params) {
    const int64_t elements = num_elements(type.shape);
    ASSERT_EQ(elements % n, 0) << name << " must split over 'data' for the hand count";
    reference += 2 * (n - 1) * 4 * elements / n;
    if (!stacked(name) && (smallest_outside < 0 || elements < smallest_outside)) smallest_outside = elements;
  }
  ASSERT_EQ(smallest_outside, c.d_model);  // ln_f's scale and bias

  // Outside the loop only scalars are all-reduced (the mean loss, the global norm; combined).
  for (int64_t elements : top_level_all_reduce_elements(exe)) EXPECT_LT(elements, smallest_outside) << text;
  const int64_t bytes = collective_bytes_per_device(exe.program, exe.mesh);
  EXPECT_LE(static_cast<double>(bytes), 1.2 * static_cast<double>(reference)) << "reference " << reference << "\n"
                                                                              << text;
}

// The collectives of `plan` and of its loops' bodies (once each).
void collectives_of(const DevicePlan& plan, std::vector<const Instruction*>* out) {
  for (const Instruction& i : plan.code) {
    if (i.kind == Instruction::Kind::kCollective) out->push_back(&i);
    if (i.kind == Instruction::Kind::kLoop && i.body != nullptr) collectives_of(*i.body, out);
  }
}

// dp on (4, 2) is data parallelism on all 8 devices, as a JAX user writes it: the batch over
// ('data', 'model'), every parameter replicated. Each device computes its own B/8 examples (the
// scan's carry is (B/8, T, D)) and the step moves what pure DP moves and nothing else: every
// gradient all-reduced over both axes, 2(k-1)/k of its bytes with k = 8 (nccl-tests' convention,
// as collective_bytes_per_device), plus the mean loss, one scalar (7 B). With the batch over
// 'data' alone each 'model' pair computed the same examples (the carry was (B/4, T, D)) and the
// gradients were all-reduced over 'data' only (k = 4: 1.5x the bytes instead of 1.75x).
TEST(TransformerPlan, DpSplitsTheBatchOverEveryDeviceAndAllReducesEachGradientOverBoth) {
  const Config c = small();
  const Mesh mesh = mesh_4x2();
  const Step step = compile_step(c, Layout::kDp, mesh);
  ASSERT_TRUE(step.exe.has_value());
  const Executable& exe = *step.exe;
  const std::string text = exe.as_text();
  const int64_t k = mesh.axis_size("data") * mesh.axis_size("model"), f32 = 4;
  int64_t reference = 2 * (k - 1) * f32 / k;  // the mean loss
  for (const auto& [name, type] : step.params) {
    const int64_t elements = num_elements(type.shape);
    reference += 2 * (k - 1) * f32 * elements / k;
  }
  std::vector<const Instruction*> collectives;
  collectives_of(exe.program, &collectives);
  ASSERT_FALSE(collectives.empty()) << text;
  for (const Instruction* i : collectives) {
    EXPECT_EQ(i->collective.kind, CollectiveKind::kAllReduce) << i->cause << "\n" << text;
    EXPECT_THAT(i->axes, ::testing::UnorderedElementsAre("data", "model")) << i->cause << "\n" << text;
  }
  const int64_t bytes = collective_bytes_per_device(exe.program, exe.mesh);
  EXPECT_GE(bytes, reference - 8) << text;  // each collective's count rounds down
  EXPECT_LE(bytes, reference) << text;
  bool found = false;
  for (const Instruction& i : exe.program.code) {
    if (i.kind != Instruction::Kind::kLoop || found) continue;
    found = true;
    EXPECT_EQ(i.out_types[0].shape, (Shape{c.batch / k, c.seq, c.d_model})) << "the forward loop's carry\n" << text;
  }
  EXPECT_TRUE(found) << text;
}

// fsdp on (4, 2) is FSDP over all 8 devices ('model' splits nothing else): the batch over
// ('data', 'model'), so each device computes its own B/8 examples (the scan's carry is
// (B/8, T, D)), and every parameter stored in 8 blocks over both axes, gathered over both for use
// and its gradient reduce-scattered over both. With the batch over 'data' alone (session 25 and
// before) each 'model' pair computed the same examples, twice the one-device work on the mesh:
// the carry was (B/4, T, D) and the collectives ran over 'data' only.
TEST(TransformerPlan, FsdpSplitsTheBatchAndEveryParameterOverEveryDevice) {
  const Config c = small();
  const Mesh mesh = mesh_4x2();
  const Step step = compile_step(c, Layout::kFsdp, mesh);
  ASSERT_TRUE(step.exe.has_value());
  const Executable& exe = *step.exe;
  const std::string text = exe.as_text();
  const int64_t k = mesh.axis_size("data") * mesh.axis_size("model");
  for (const auto& [name, type] : step.params) {
    const PartitionSpec stored = storage_spec(c, Layout::kFsdp, mesh, name);
    int split = 0;
    for (int d = 0; d < stored.size(); ++d) {
      if (stored.axes(d).empty()) continue;
      ++split;
      EXPECT_THAT(stored.axes(d), ::testing::ElementsAre("data", "model")) << name;
    }
    EXPECT_EQ(split, 1) << name << " " << stored.to_string();
  }
  std::vector<const Instruction*> collectives;
  collectives_of(exe.program, &collectives);
  ASSERT_FALSE(collectives.empty()) << text;
  for (const Instruction* i : collectives) {
    EXPECT_THAT(i->axes, ::testing::UnorderedElementsAre("data", "model")) << i->cause << "\n" << text;
  }
  int loops = 0;
  for (const Instruction& i : exe.program.code) {
    if (i.kind != Instruction::Kind::kLoop) continue;
    ++loops;
    EXPECT_EQ(i.out_types[0].shape, (Shape{c.batch / k, c.seq, c.d_model})) << "a loop's carry\n" << text;
  }
  EXPECT_EQ(loops, 2) << text;  // the forward scan and its VJP's backward one
}

// fsdp_tp stores the same parameters outside the loop split over 'data' (their use layouts do not
// split them over 'model'): their gradients are reduce-scattered too.
TEST(TransformerPlan, FsdpTpStepAllReducesOnlyScalarsOutsideTheLoop) {
  const Config c = small();
  const Step step = compile_step(c, Layout::kFsdpTp, mesh_4x2());
  ASSERT_TRUE(step.exe.has_value());
  for (int64_t elements : top_level_all_reduce_elements(*step.exe)) {
    EXPECT_LT(elements, c.d_model) << step.exe->as_text();
  }
}

// The bytes per device of the loops' collectives (the scan's forward and backward bodies, each
// times its trip count).
int64_t in_loop_bytes(const Executable& exe) {
  int64_t bytes = 0;
  for (const Instruction& i : exe.program.code) {
    if (i.kind == Instruction::Kind::kLoop) bytes += collective_bytes_per_device(i, exe.mesh);
  }
  return bytes;
}

// Inside the loops fsdp_tp moves, per layer, what FSDP and Megatron each move, and nothing
// more (nccl-tests' convention, as collective_bytes_per_device: all_gather and reduce_scatter
// (k-1)/k of the whole, all_reduce 2(k-1)/k, over k devices), with n = |data|, m = |model|:
//   forward:  every leaf stored over 'data' gathered from its block to its use layout; the
//             attention output's and the MLP output's all_reduce over 'model' (B/n, T, D);
//   backward: every such leaf's gradient reduce-scattered back to its block; the layer norms'
//             gradients are also pending over 'model' (their outputs feed matmuls that split
//             columns over 'model', whose transposes sum over it), so their blocks are then
//             all-reduced over 'model'; the MLP's first bias, split over 'model' and not over
//             'data', all-reduced over 'data'; Megatron's two all_reduces over 'model' of the
//             layer norms' input cotangents (B/n, T, D), each with the norm's (B/n, T) row sum
//             of its partial products (the compiler reduces it before broadcasting it back).
// The layer norms' gradients used to be all-reduced whole over ('model', 'data') and then
// sliced over 'data': 2 * 7/8 of each instead of 3/4 + 2 * 1/2 * 1/4 (1.75x their bytes).
TEST(TransformerPlan, FsdpTpLoopsMoveTheHandCountWithTheLayerNormsReduceScattered) {
  const Config c = small();
  const Mesh mesh = mesh_4x2();
  const Step step = compile_step(c, Layout::kFsdpTp, mesh);
  ASSERT_TRUE(step.exe.has_value());
  const int64_t n = mesh.axis_size("data"), m = mesh.axis_size("model"), f32 = 4;
  int64_t per_layer = 0;
  for (const auto& [name, info] : param_infos(c, Layout::kFsdpTp)) {
    if (!stacked(name)) continue;
    int64_t use = f32;  // bytes of one layer's row in its use layout on a device
    for (size_t d = 1; d < info.shape.size(); ++d) use *= info.shape[d];
    const PartitionSpec stored = storage_spec(c, Layout::kFsdpTp, mesh, name);
    bool over_data = false, over_model = false;
    for (int d = 0; d < stored.size(); ++d) {
      for (const std::string& axis : stored.axes(d)) {
        over_data = over_data || axis == "data";
        over_model = over_model || axis == "model";
      }
    }
    if (over_model) use /= m;
    if (!over_data) {
      per_layer += 2 * (n - 1) * use / n;  // the gradient's all_reduce over 'data'
      continue;
    }
    per_layer += (n - 1) * use / n;  // the gather
    per_layer += (n - 1) * use / n;  // the gradient's reduce_scatter
    if (absl::StartsWith(name, "layers.ln")) per_layer += 2 * (m - 1) * (use / n) / m;
  }
  const int64_t rows = c.batch / n * c.seq;
  per_layer += 2 * 2 * (m - 1) * rows * c.d_model * f32 / m;        // forward: attention, MLP outputs
  per_layer += 2 * 2 * (m - 1) * rows * (c.d_model + 1) * f32 / m;  // backward: the norms' inputs
  EXPECT_EQ(in_loop_bytes(*step.exe), c.layers * per_layer) << step.exe->as_text();
}

// The reduce_scatters of `plan` itself (not of its loops' bodies).
int reduce_scatters(const DevicePlan& plan) {
  int n = 0;
  for (const Instruction& i : plan.code) {
    n += i.kind == Instruction::Kind::kCollective && i.collective.kind == CollectiveKind::kReduceScatter;
  }
  return n;
}

// Every FSDP gradient in the backward loop's body (each stacked leaf's row, the layer norms'
// included) is reduce-scattered over 'data', all independent of each other: the combiner sends
// them as one message per iteration (11 reduce_scatters before it: 7 weights and biases and 4
// layer-norm parameters), and the gradients outside the loop as one. The bytes do not change
// (FsdpTpLoopsMoveTheHandCountWithTheLayerNormsReduceScattered still holds); the values are
// Transformer.EveryMeshAndLayoutGivesTheOneDeviceLossesAndTheLossFalls's (fsdp_tp against 1x1).
TEST(TransformerPlan, FsdpTpReduceScattersEachLoopIterationsGradientsAsOne) {
  const Step step = compile_step(small(), Layout::kFsdpTp, mesh_4x2());
  ASSERT_TRUE(step.exe.has_value());
  const DevicePlan& program = step.exe->program;
  const Instruction* backward = nullptr;
  for (const Instruction& i : program.code) {
    if (i.kind == Instruction::Kind::kLoop && i.reverse) backward = &i;
  }
  ASSERT_NE(backward, nullptr) << step.exe->as_text();
  EXPECT_EQ(reduce_scatters(*backward->body), 1) << step.exe->as_text();
  EXPECT_EQ(reduce_scatters(program), 1) << step.exe->as_text();
}

// tp on (4, 2) is Megatron over 'model' with the batch over 'data' (n = 4, m = 2), every
// collective counted by hand (nccl-tests' convention, as collective_bytes_per_device: an
// all_reduce over k devices moves 2(k-1)/k of its bytes):
//   forward, per layer: the attention block's and the MLP block's outputs, each all-reduced
//     over 'model' once ((B/n, T, D): Megatron's g), and nothing else;
//   backward, per layer: the two layer norms' input cotangents all-reduced over 'model'
//     ((B/n, T, D), each with the norm's (B/n, T) row sum of its partial products, as in
//     FsdpTpLoopsMoveTheHandCountWithTheLayerNormsReduceScattered), and each stacked gradient
//     summed over the data-parallel axis 'data': a leaf split over 'model' holds its own block
//     (over 'data' alone), the layer norms' scales and biases feed column-split matmuls, so their
//     gradients are partial over 'model' too (over both: k = n * m), and the MLP's output bias
//     is added after the row-split matmul's all-reduce, so its gradient is already whole over
//     'model' (over 'data' alone);
//   outside the loops: the unstacked gradients (embeddings, output projection, final norm) and
//     the mean loss over 'data', and over 'model' only scalars (each 'model'-split gradient's
//     partial sum of squares for the global norm).
TEST(TransformerPlan, TpMovesMegatronsAllReducesAndTheDataParallelGradientsOnly) {
  const Config c = small();
  const Mesh mesh = mesh_4x2();
  const Step step = compile_step(c, Layout::kTp, mesh);
  ASSERT_TRUE(step.exe.has_value());
  const Executable& exe = *step.exe;
  const std::string text = exe.as_text();
  const int64_t n = mesh.axis_size("data"), m = mesh.axis_size("model"), f32 = 4;
  const int64_t rows = c.batch / n * c.seq;
  int64_t per_layer = 2 * 2 * (m - 1) * rows * c.d_model * f32 / m;  // forward: attention, MLP outputs
  per_layer += 2 * 2 * (m - 1) * rows * (c.d_model + 1) * f32 / m;   // backward: the norms' inputs
  int64_t unstacked = 1;                                             // the mean loss
  for (const auto& [name, info] : param_infos(c, Layout::kTp)) {
    if (!stacked(name)) {
      unstacked += num_elements(info.shape);
      continue;
    }
    int64_t use = 1;  // elements of one layer's row on a device
    for (size_t d = 1; d < info.shape.size(); ++d) use *= info.shape[d];
    const PartitionSpec stored = storage_spec(c, Layout::kTp, mesh, name);
    bool over_model = false;
    for (int d = 0; d < stored.size(); ++d) {
      for (const std::string& axis : stored.axes(d)) over_model = over_model || axis == "model";
    }
    if (over_model) {
      per_layer += 2 * (n - 1) * (use / m) * f32 / n;
    } else if (absl::StartsWith(name, "layers.ln")) {
      per_layer += 2 * (n * m - 1) * use * f32 / (n * m);
    } else {
      per_layer += 2 * (n - 1) * use * f32 / n;
    }
  }
  EXPECT_EQ(in_loop_bytes(exe), c.layers * per_layer) << text;
  for (const Instruction& l : exe.program.code) {
    if (l.kind != Instruction::Kind::kLoop) continue;
    std::vector<const Instruction*> collectives;
    collectives_of(*l.body, &collectives);
    for (const Instruction* i : collectives) EXPECT_EQ(i->collective.kind, CollectiveKind::kAllReduce) << text;
    if (l.reverse) continue;
    ASSERT_EQ(collectives.size(), 2u) << text;  // the forward loop: Megatron's two
    for (const Instruction* i : collectives) {
      EXPECT_THAT(i->axes, ::testing::ElementsAre("model")) << text;
      EXPECT_EQ(i->node.shape, (Shape{c.batch / n, c.seq, c.d_model})) << text;
    }
  }
  int64_t over_data = 0;
  for (const Instruction& i : exe.program.code) {
    if (i.kind != Instruction::Kind::kCollective) continue;
    EXPECT_EQ(i.collective.kind, CollectiveKind::kAllReduce) << text;
    if (i.axes == std::vector<std::string>{"data"}) {
      over_data += num_elements(i.node.shape);
    } else {
      EXPECT_THAT(i.axes, ::testing::ElementsAre("model")) << text;
      EXPECT_LT(num_elements(i.node.shape), c.d_model) << text;
    }
  }
  EXPECT_EQ(over_data, unstacked) << text;
}

}  // namespace
}  // namespace tessera::transformer

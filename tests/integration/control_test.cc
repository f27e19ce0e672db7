// Control flow on Client::local(8): scan (jax.lax.scan, jax/_src/lax/control_flow/loops.py's
// documented semantics) against the host reference — which runs the body graph once per row
// on the host (tests/support/host_eval.cc), nothing of the plan's loop — and against the same
// function unrolled into straight-line code, on the (8), (4, 2) and (2, 4) meshes with carries
// split and replicated; the compiled loop's shape (one loop instruction, the body's
// collectives inside it, the program's size independent of the length); and errors. The meshes
// have Auto axes (MeshesSuite's auto_meshes_): the carries' and operands' layouts meet in the
// bodies and the compiler reconciles them (GSPMD), which explicit mode refuses as JAX >= 0.9
// does (explicit control flow: trace_test's ExplicitControlFlow, ExplicitJitTest).
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/propagate.h"
#include "core/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"
#include "tests/support/host_eval.h"
#include "tests/support/jit_check.h"
#include "tests/support/plan_matchers.h"
#include "worker/interpreter.h"
#include "worker/plan_peak.h"

namespace tessera {
namespace {

using ::tessera::testing::collectives;
using ::tessera::testing::the_loop;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int64_t kDim = 8;  // the carry is (kDim, kDim): divisible by every mesh axis

// One step of a small recurrent layer: the carry (h, w) -> (tanh(h @ w * 0.5 + x), w), and two
// stacked results per row, 2 h' + 1 and sum(h' * x) (a scalar per row).
ScanStep layer(const std::vector<Value>& c, const std::vector<Value>& x) {
  const Value h = tanh(matmul(c[0], c[1]) * 0.5 + x[0]);
  return ScanStep{{h, c[1]}, {h * 2.0 + 1.0, sum(h * x[0])}};
}

// The scan of `layer` over xs, and the same loop written out row by row (the unrolled form).
std::vector<Value> scanned(const std::vector<Value>& in, bool reverse) {
  ScanResult r = scan(layer, {in[0], in[1]}, {in[2]}, std::nullopt, reverse);
  return {r.carry[0], r.carry[1], r.ys[0], r.ys[1]};
}
std::vector<Value> unrolled(const std::vector<Value>& in, bool reverse) {
  const int64_t length = in[2].shape()[0];
  std::vector<Value> c = {in[0], in[1]};
  std::vector<Value> ys0(length), ys1(length);
  for (int64_t s = 0; s < length; ++s) {
    const int64_t row = reverse ? length - 1 - s : s;
    const Value x = reshape(slice(in[2], {row, 0, 0}, {row + 1, kDim, kDim}), {kDim, kDim});
    ScanStep step = layer(c, {x});
    c = step.carry;
    ys0[row] = expand_dims(step.ys[0], 0);
    ys1[row] = expand_dims(step.ys[1], 0);
  }
  return {c[0], c[1], concatenate(ys0, 0), concatenate(ys1, 0)};
}

struct ScanCase {
  std::string name;
  int mesh = 0;
  PartitionSpec h, w, xs;
  bool reverse = false;
};
void PrintTo(const ScanCase& c, std::ostream* os) { *os << c.name; }

std::vector<ScanCase> scan_cases() {
  std::vector<ScanCase> out;
  for (int m = 0; m < static_cast<int>(test_meshes().size()); ++m) {
    const MeshDef& mesh = test_meshes()[m];
    const std::string first = mesh.axes.front(), last = mesh.axes.back();
    const std::string suffix = absl::StrCat("_", mesh.name);
    // The carry split by rows: every iteration is local.
    out.push_back({"carry_rows_split" + suffix, m, P(first, None), P(), P(None, first, None)});
    // The carry split along the contraction: the body all-reduces h @ w every iteration.
    out.push_back({"carry_contraction_split" + suffix, m, P(None, last), P(last, None), P(None, None, last)});
    out.push_back(
        {"carry_contraction_split_reverse" + suffix, m, P(None, last), P(last, None), P(None, None, last), true});
    // Replicated carries; xs split along the scanned dimension (gathered before the loop).
    out.push_back({"carry_replicated_xs_rows_split" + suffix, m, P(), P(), P(first, None, None)});
  }
  return out;
}

class ScanTest : public MeshesSuite, public ::testing::WithParamInterface<ScanCase> {};

TEST_P(ScanTest, MatchesTheHostLoopAndTheUnrolledForm) {
  ASSERT_NE(client_, nullptr);
  const ScanCase& c = GetParam();
  const Mesh& mesh = auto_meshes_[c.mesh];
  std::mt19937 rng(7);
  const int64_t length = 8;  // divisible by every mesh axis: the xs may be split along it
  HostArray h = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray w = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray xs = random_array(DType::kF32, {length, kDim, kDim}, Domain::kSigned, rng);
  const std::vector<const HostArray*> inputs = {&h, &w, &xs};
  const std::vector<PartitionSpec> specs = {c.h, c.w, c.xs};
  const bool reverse = c.reverse;
  absl::StatusOr<JitCheck> loop = run_against_host(
      *client_, mesh, [reverse](const std::vector<Value>& in) { return scanned(in, reverse); }, inputs, specs);
  ASSERT_TRUE(loop.ok()) << loop.status();
  absl::StatusOr<JitCheck> flat = run_against_host(
      *client_, mesh, [reverse](const std::vector<Value>& in) { return unrolled(in, reverse); }, inputs, specs);
  ASSERT_TRUE(flat.ok()) << flat.status();
  ASSERT_EQ(loop->got.size(), 4u);
  for (size_t i = 0; i < loop->got.size(); ++i) {
    SCOPED_TRACE(absl::StrCat("output ", i, "\n", loop->plan_text));
    EXPECT_TRUE(results_match(loop->got[i], loop->want[i], kF32Tolerance)) << "against the host loop";
    EXPECT_TRUE(results_match(loop->got[i], flat->got[i], kF32Tolerance)) << "against the unrolled program";
    EXPECT_TRUE(results_match(flat->want[i], loop->want[i], kF32Tolerance)) << "the host's two forms";
  }
  // The carries leave as they entered (the loop's fixed point).
  std::vector<Axes> entered = c.h.dims();
  entered.resize(2);
  EXPECT_EQ(loop->out_specs[0], PartitionSpec(entered)) << loop->plan_text;
  EXPECT_THAT(loop->plan_text, HasSubstr("loop("));
}

INSTANTIATE_TEST_SUITE_P(All, ScanTest, ::testing::ValuesIn(scan_cases()),
                         [](const ::testing::TestParamInfo<ScanCase>& i) { return i.param.name; });

// The compiled program of `f` on the (4, 2) mesh.
absl::StatusOr<Executable> compile(const TracedFunction& f, const std::vector<ArrayType>& types,
                                   const std::vector<PartitionSpec>& specs) {
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7}));
  TESSERA_ASSIGN_OR_RETURN(Graph g, trace(f, types));
  std::vector<std::optional<PartitionSpec>> outputs(g.outputs().size());
  TESSERA_ASSIGN_OR_RETURN(Propagation p, propagate(g, mesh, specs, outputs));
  return partition(g, mesh, p, outputs);
}

TEST(ScanPlan, OneLoopWhoseBodyHoldsTheCollectivesAndWhoseSizeIgnoresTheLength) {
  const std::vector<PartitionSpec> specs = {P(None, "model"), P("model", None), P(None, None, "model")};
  auto program = [&](int64_t length) {
    return compile([](const std::vector<Value>& in) { return scanned(in, false); },
                   {{DType::kF32, {kDim, kDim}}, {DType::kF32, {kDim, kDim}}, {DType::kF32, {length, kDim, kDim}}},
                   specs);
  };
  absl::StatusOr<Executable> two = program(2), sixteen = program(16);
  ASSERT_TRUE(two.ok()) << two.status();
  ASSERT_TRUE(sixteen.ok()) << sixteen.status();
  const Instruction* loop = the_loop(sixteen->program);
  ASSERT_NE(loop, nullptr) << sixteen->as_text();
  EXPECT_EQ(loop->trip_count, 16);
  // The four results of one scan come from one loop, after the final values of the carries
  // the hoisting added (the body's scales, built once before the loop).
  EXPECT_EQ(loop->extra_out.size(), 3u + static_cast<size_t>(loop->num_carry - 2));
  // h @ w contracts a split dimension: the body resolves it every iteration (and a carry
  // leaving in its layout needs nothing more); nothing else moves around the loop.
  EXPECT_GE(collectives(*loop->body), 1) << sixteen->as_text();
  EXPECT_EQ(collectives(sixteen->program), 0) << sixteen->as_text();
  EXPECT_EQ(collective_bytes_per_device(sixteen->program, sixteen->mesh),
            16 * collective_bytes_per_device(*loop->body, sixteen->mesh));
  EXPECT_EQ(plan_size(two->program), plan_size(sixteen->program)) << two->as_text() << sixteen->as_text();
  // Each iteration's collectives take op ids of their own: the program reserves them.
  EXPECT_EQ(plan_op_span(sixteen->program), sixteen->program.code.size() + 16 * plan_op_span(*loop->body));

  // The program survives the wire (as LoadPlan sends it) and each device resolves the body.
  pb::DevicePlan wire;
  to_proto(sixteen->program, &wire);
  absl::StatusOr<DevicePlan> back = plan_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(canonical_bytes(*the_loop(*back)), canonical_bytes(*loop));
  absl::StatusOr<DevicePlan> device3 = resolve(*back, sixteen->mesh, 3);
  ASSERT_TRUE(device3.ok()) << device3.status();
  const Instruction* resolved = the_loop(*device3);
  ASSERT_NE(resolved, nullptr);
  for (const Instruction& i : resolved->body->code) {
    if (i.kind == Instruction::Kind::kCollective) {
      EXPECT_FALSE(i.collective.groups.empty());
    }
  }
}

// A shard_map inside a scan body, a cond branch and a while_loop body of a shard_map body (the
// outer manual over 'data', the inner over 'model' with a psum over it; values against the
// host: shard_map_test's NestedShardMapInALoopBody... and ...InACondBranchAndAWhileBody...):
// the loop bodies and the branch that calls the inner shard_map hold its one all_reduce over
// 'model', run once per iteration, and nothing else moves, in the loops or around them.
TEST(ScanPlan, ANestedShardMapInAControlFlowBodyOfAShardMapBodyRunsItsPsumOncePerIteration) {
  absl::StatusOr<Mesh> mesh = make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const ShardMapped step = shard_map(
      [](const std::vector<Value>& in) {
        const Value sums = psum(sum(in[0], {1}), "model");
        return std::vector<Value>{in[0] * 0.5 + reshape(sums, {sums.shape()[0], 1}) * 0.01};
      },
      *mesh, {P(None, "model")}, {P(None, "model")});
  const ShardMapped outer = shard_map(
      [step](const std::vector<Value>& in) {
        ScanResult r = scan(
            [step](const std::vector<Value>& c, const std::vector<Value>&) {
              return ScanStep{step(c), {}};
            },
            {in[0]}, {}, 3);
        // Each 'data' block's own predicate (a sum of the block would be one over 'model' too).
        const Value pred = convert(axis_index("data"), DType::kF32) < 2.0;
        const std::vector<Value> branched = cond(
            pred, [step](const std::vector<Value>& b) { return step(b); },
            [](const std::vector<Value>& b) { return std::vector<Value>{b[0] * 2.0}; }, {in[0]});
        const std::vector<Value> looped = while_loop([](const std::vector<Value>& c) { return c[1] < 3.0; },
                                                     [step](const std::vector<Value>& c) {
                                                       return std::vector<Value>{step({c[0]})[0], c[1] + 1.0};
                                                     },
                                                     {in[0], full({}, 0.0, DType::kF32)});
        return std::vector<Value>{r.carry[0], branched[0], looped[0]};
      },
      *mesh, {P("data", None)}, {P("data", None), P("data", None), P("data", None)}, {.axis_names = {"data"}});
  absl::StatusOr<Executable> exe = compile([outer](const std::vector<Value>& in) { return outer(in); },
                                           {{DType::kF32, {16, 8}}}, {P("data", "model")});
  ASSERT_TRUE(exe.ok()) << exe.status();
  const auto psums_over_model = [](const DevicePlan& plan) {
    int n = 0;
    for (const Instruction& i : plan.code) {
      const bool psum = i.kind == Instruction::Kind::kCollective && i.collective.kind == CollectiveKind::kAllReduce &&
                        i.axes == std::vector<std::string>{"model"};
      n += psum ? 1 : 0;
    }
    return n;
  };
  EXPECT_EQ(collectives(exe->program), 0) << exe->as_text();
  std::vector<const Instruction*> loops, switches;
  for (const Instruction& i : exe->program.code) {
    if (i.kind == Instruction::Kind::kLoop) loops.push_back(&i);
    if (i.kind == Instruction::Kind::kSwitch) switches.push_back(&i);
  }
  ASSERT_EQ(loops.size(), 2u) << "the scan and the while_loop\n" << exe->as_text();
  for (const Instruction* loop : loops) {
    EXPECT_EQ(collectives(*loop->body), 1) << exe->as_text();
    EXPECT_EQ(psums_over_model(*loop->body), 1) << exe->as_text();
    for (const auto& predicate : loop->branches) EXPECT_EQ(collectives(*predicate), 0) << exe->as_text();
  }
  EXPECT_EQ(loops[0]->trip_count, 3) << exe->as_text();
  ASSERT_EQ(switches.size(), 1u) << exe->as_text();
  ASSERT_EQ(switches[0]->branches.size(), 2u) << exe->as_text();
  EXPECT_EQ(collectives(*switches[0]->branches[0]), 0) << "the false branch\n" << exe->as_text();
  EXPECT_EQ(collectives(*switches[0]->branches[1]), 1) << exe->as_text();
  EXPECT_EQ(psums_over_model(*switches[0]->branches[1]), 1) << exe->as_text();
}

int kernels_of(const DevicePlan& plan, Op op) {
  int n = 0;
  for (const Instruction& i : plan.code) n += i.kind == Instruction::Kind::kKernel && i.node.op == op ? 1 : 0;
  return n;
}

// The trip counts of the loops in `plan`, those in switch branches and loop bodies included,
// each with whether a switch guards it.
void loop_trips(const DevicePlan& plan, bool guarded, std::vector<std::pair<int64_t, bool>>* out) {
  for (const Instruction& i : plan.code) {
    if (i.kind == Instruction::Kind::kLoop) {
      out->push_back({i.trip_count, guarded});
      loop_trips(*i.body, guarded, out);
    }
    if (i.kind == Instruction::Kind::kSwitch) {
      for (const auto& b : i.branches) loop_trips(*b, true, out);
    }
  }
}

// scatter_apply's further applications of func (element hit n times: n - 1 more after the first)
// run as the binary digits of r = max(count) - 1: loops of 4, 2 and 1 steps for 6 windows, each
// under a switch taken when that many steps remain, so a run takes exactly r steps (indices
// that hit one element three times give r = 2: only the 2-step loop runs). Before, one loop of
// windows - 1 = 5 steps ran whenever r > 0. The plan shows the structure; which branch a device
// takes is not counted anywhere a test can read, so the steps run are not asserted (the values,
// which would differ if a step were missed or repeated, are: gather_test's
// ScatterApplyRunsEachChunkOfTheLargestCount). Its gradient compiles (fori_loop and cond have
// VJPs; a while_loop to r would not).
TEST(ScatterApplyPlan, FurtherApplicationsRunAsBinaryChunksOfTheLargestCount) {
  const ScatterDimensionNumbers dn{{}, {0}, {0}};
  const auto f = [&](const std::vector<Value>& in) {
    return std::vector<Value>{scatter_apply(in[0], in[1], [](const Value& v) { return v * 2.0 + 1.0; }, dn, {6})};
  };
  absl::StatusOr<Executable> exe = compile(f, {{DType::kF32, {8}}, {DType::kI32, {6, 1}}}, {P(), P()});
  ASSERT_TRUE(exe.ok()) << exe.status();
  std::vector<std::pair<int64_t, bool>> trips;
  loop_trips(exe->program, false, &trips);
  std::sort(trips.begin(), trips.end());
  const std::vector<std::pair<int64_t, bool>> want = {{1, true}, {2, true}, {4, true}};
  EXPECT_EQ(trips, want) << exe->as_text();
  absl::StatusOr<Executable> grads =
      compile(grad([&](const std::vector<Value>& in) { return std::vector<Value>{sum(f(in)[0])}; }, {0}),
              {{DType::kF32, {8}}, {DType::kI32, {6, 1}}}, {P(), P()});
  ASSERT_TRUE(grads.ok()) << grads.status();
}

// The gradient of a scan runs its forward body once, as JAX's partial evaluation of scan does
// (jax/_src/lax/control_flow/loops.py, _scan_partial_eval): one forward loop that also stacks
// the residuals (the values of each iteration the backward pass reads), and one backward loop
// that reads them by row and computes no forward op again. `layer` has one matmul and one tanh
// per iteration; its VJP two matmuls (h's and w's cotangents) and no tanh (tanh's derivative
// reads tanh's result, a residual). The values against the unrolled form:
// MeshesSuite.ScanGradientIsTheUnrolledGradient.
TEST(ScanPlan, ItsGradientRunsTheForwardBodyOnceAndReadsTheResidualsBackwards) {
  const std::vector<PartitionSpec> specs = {P(None, "model"), P("model", None), P(None, None, "model")};
  absl::StatusOr<Executable> exe =
      compile(value_and_grad(
                  [](const std::vector<Value>& in) {
                    std::vector<Value> r = scanned(in, false);
                    return std::vector<Value>{sum(r[0] * r[0]) + sum(r[2] * 0.25) + sum(r[3])};
                  },
                  {0, 1, 2}),
              {{DType::kF32, {kDim, kDim}}, {DType::kF32, {kDim, kDim}}, {DType::kF32, {5, kDim, kDim}}}, specs);
  ASSERT_TRUE(exe.ok()) << exe.status();
  std::vector<const Instruction*> loops;
  for (const Instruction& i : exe->program.code) {
    if (i.kind == Instruction::Kind::kLoop) loops.push_back(&i);
  }
  ASSERT_EQ(loops.size(), 2u) << "a forward and a backward loop\n" << exe->as_text();
  const Instruction& forward = *loops[0];
  const Instruction& backward = *loops[1];
  EXPECT_FALSE(forward.reverse);
  EXPECT_TRUE(backward.reverse);
  EXPECT_EQ(kernels_of(*forward.body, Op::kDotGeneral), 1) << exe->as_text();
  EXPECT_EQ(kernels_of(*forward.body, Op::kTanh), 1) << exe->as_text();
  EXPECT_EQ(kernels_of(*backward.body, Op::kDotGeneral), 2) << exe->as_text();
  EXPECT_EQ(kernels_of(*backward.body, Op::kTanh), 0) << exe->as_text();
  // The forward loop's results: the final carries and the two ys, then the stacked residuals.
  EXPECT_GT(forward.out_types.size(), 4u) << exe->as_text();
}

// Every kernel of `op` in `plan`, those in loop bodies and switch branches included.
int kernels_within(const DevicePlan& plan, Op op) {
  int n = 0;
  for (const Instruction& i : plan.code) {
    n += i.kind == Instruction::Kind::kKernel && i.node.op == op ? 1 : 0;
    if (i.kind == Instruction::Kind::kLoop && i.body != nullptr) n += kernels_within(*i.body, op);
    for (const auto& b : i.branches) n += kernels_within(*b, op);
  }
  return n;
}

// value_and_grad of a fori_loop (a scan: fori_loop lowers to one, as JAX's with static bounds)
// runs its body's forward once, in the loop that also stacks the residuals, and the backward
// loop computes no forward op again (JAX's _scan_partial_eval, jax/_src/lax/control_flow/
// loops.py); under checkpoint (jax.checkpoint: recompute everything) the backward loop computes
// the body's forward once more, as JAX's remat does. The body closes over w (a captured
// const: a loop invariant): h <- tanh((h @ w) * (i + 1)), i = 0, 1, 2; the loss sum(h_3).
// Its program on one device runs here (worker/interpreter.h's run_plan) against the gradient
// written out below (dz_k = g (1 - h_{k+1}^2) (k + 1), dh_k = dz_k w^T, dw += h_k^T dz_k).
TEST(ScanPlan, AForiLoopsGradientRunsItsBodyOnceForwardsUnlessCheckpointed) {
  constexpr int64_t kN = 4, kSteps = 3;
  std::mt19937 rng(15);
  std::uniform_real_distribution<float> uniform(-0.6F, 0.6F);
  std::vector<float> x(kN * kN), w(kN * kN);
  for (float& v : x) v = uniform(rng);
  for (float& v : w) v = uniform(rng);
  // The host reference.
  auto matmul_host = [](const std::vector<float>& a, const std::vector<float>& b, bool ta, bool tb) {
    std::vector<float> c(kN * kN, 0.0F);
    for (int64_t r = 0; r < kN; ++r) {
      for (int64_t col = 0; col < kN; ++col) {
        for (int64_t k = 0; k < kN; ++k) {
          c[r * kN + col] += (ta ? a[k * kN + r] : a[r * kN + k]) * (tb ? b[col * kN + k] : b[k * kN + col]);
        }
      }
    }
    return c;
  };
  std::vector<std::vector<float>> h = {x};
  for (int64_t k = 0; k < kSteps; ++k) {
    std::vector<float> z = matmul_host(h.back(), w, false, false);
    for (float& v : z) v = std::tanh(v * static_cast<float>(k + 1));
    h.push_back(z);
  }
  float loss = 0;
  for (float v : h.back()) loss += v;
  std::vector<float> g(kN * kN, 1.0F), dw(kN * kN, 0.0F);
  for (int64_t k = kSteps - 1; k >= 0; --k) {
    std::vector<float> dz(kN * kN);
    for (int64_t e = 0; e < kN * kN; ++e) {
      dz[e] = g[e] * (1 - h[k + 1][e] * h[k + 1][e]) * static_cast<float>(k + 1);
    }
    const std::vector<float> dwk = matmul_host(h[k], dz, true, false);
    for (int64_t e = 0; e < kN * kN; ++e) dw[e] += dwk[e];
    g = matmul_host(dz, w, false, true);
  }
  absl::StatusOr<Mesh> mesh = make_mesh({1, 1}, {"data", "model"}, {0});
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  for (const bool remat : {false, true}) {
    SCOPED_TRACE(remat ? "checkpointed body" : "plain body");
    const auto f = [remat](const std::vector<Value>& in) {
      const Value w = in[1];
      const TracedFunction step = [w](const std::vector<Value>& a) {
        return std::vector<Value>{tanh(matmul(a[1], w) * (convert(a[0], DType::kF32) + 1.0))};
      };
      const TracedFunction body = remat ? checkpoint(step) : step;
      const std::vector<Value> out = fori_loop(0, kSteps,
                                               [&](const Value& i, const std::vector<Value>& c) {
                                                 return body({i, c[0]});
                                               },
                                               {in[0]});
      return std::vector<Value>{sum(out[0])};
    };
    absl::StatusOr<Graph> traced = trace(value_and_grad(f, {0, 1}), {{DType::kF32, {kN, kN}}, {DType::kF32, {kN, kN}}});
    ASSERT_TRUE(traced.ok()) << traced.status();
    absl::StatusOr<Propagation> p = propagate(*traced, *mesh, {P(), P()}, std::vector<std::optional<PartitionSpec>>(3));
    ASSERT_TRUE(p.ok()) << p.status();
    absl::StatusOr<Executable> exe = partition(*traced, *mesh, *p, std::vector<std::optional<PartitionSpec>>(3));
    ASSERT_TRUE(exe.ok()) << exe.status();
    std::vector<const Instruction*> loops;
    for (const Instruction& i : exe->program.code) {
      if (i.kind == Instruction::Kind::kLoop) loops.push_back(&i);
    }
    ASSERT_EQ(loops.size(), 2u) << "one forward loop and one backward loop\n" << exe->as_text();
    EXPECT_FALSE(loops[0]->reverse) << exe->as_text();
    EXPECT_TRUE(loops[1]->reverse) << exe->as_text();
    EXPECT_EQ(kernels_within(*loops[0]->body, Op::kDotGeneral), 1) << exe->as_text();
    EXPECT_EQ(kernels_within(*loops[0]->body, Op::kTanh), 1) << exe->as_text();
    // The VJP's two matmuls (h's and w's cotangents); checkpoint's recomputed forward adds one
    // matmul and one tanh.
    EXPECT_EQ(kernels_within(*loops[1]->body, Op::kDotGeneral), remat ? 3 : 2) << exe->as_text();
    EXPECT_EQ(kernels_within(*loops[1]->body, Op::kTanh), remat ? 1 : 0) << exe->as_text();
    EXPECT_EQ(kernels_within(exe->program, Op::kDotGeneral), remat ? 4 : 3) << exe->as_text();
    absl::StatusOr<DevicePlan> mine = resolve(exe->program, *mesh, 0);
    ASSERT_TRUE(mine.ok()) << mine.status();
    std::vector<std::shared_ptr<const HostArray>> inputs;
    inputs.push_back(std::make_shared<HostArray>(HostArray::from_vector<float>({kN, kN}, x)));
    inputs.push_back(std::make_shared<HostArray>(HostArray::from_vector<float>({kN, kN}, w)));
    Transport transport;
    absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> out =
        run_plan(*mine, std::move(inputs), transport, PlanRun{});
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), 3u);
    EXPECT_NEAR((*out)[0]->values<float>()[0], loss, 1e-5);
    for (int64_t e = 0; e < kN * kN; ++e) {
      EXPECT_NEAR((*out)[1]->values<float>()[e], g[e], 1e-5) << "d loss / d x, element " << e;
      EXPECT_NEAR((*out)[2]->values<float>()[e], dw[e], 1e-5) << "d loss / d w, element " << e;
    }
  }
}

// A body that builds arrays no iteration's input goes into, as attention's does: a causal
// mask from two iotas and a compare, a scalar fill broadcast to the carry's shape, a scale.
ScanStep masked_layer(const std::vector<Value>& c, const std::vector<Value>& x) {
  const Value causal = iota(DType::kI32, {kDim, kDim}, 0) >= iota(DType::kI32, {kDim, kDim}, 1);
  const Value h = where(causal, matmul(c[0], x[0]) * 0.25, full({}, -1.5, DType::kF32)) + 0.5;
  return ScanStep{{tanh(h)}, {h * 3.0}};
}
std::vector<Value> masked(const std::vector<Value>& in) {
  ScanResult r = scan(masked_layer, {in[0]}, {in[1]});
  return {r.carry[0], r.ys[0]};
}

// What passes/hoist.cc leaves of masked_layer in `loop`'s body: no constant, iota, broadcast
// or compare, its one matmul and one tanh; at least `built_before` constants and iotas before
// the loop in the program; and the body passing on unchanged each hoisted value, the carries
// after the loop's `own` ones.
void expect_masked_layer_hoisted(const Executable& exe, const Instruction& loop, int built_before, int own) {
  for (Op op : {Op::kConstant, Op::kIota, Op::kBroadcastInDim, Op::kGe}) {
    EXPECT_EQ(kernels_of(*loop.body, op), 0) << op_name(op) << "\n" << exe.as_text();
  }
  EXPECT_EQ(kernels_of(*loop.body, Op::kDotGeneral), 1) << exe.as_text();
  EXPECT_EQ(kernels_of(*loop.body, Op::kTanh), 1) << exe.as_text();
  int before = 0;
  for (size_t k = 0; &exe.program.code[k] != &loop; ++k) {
    const Instruction& i = exe.program.code[k];
    before += i.kind == Instruction::Kind::kKernel && (i.node.op == Op::kIota || i.node.op == Op::kConstant) ? 1 : 0;
  }
  EXPECT_GE(before, built_before) << "the constants and iotas before the loop\n" << exe.as_text();
  ASSERT_GT(loop.num_carry, own) << exe.as_text();
  ASSERT_GE(static_cast<int>(loop.body->input_slots.size()), loop.num_carry) << exe.as_text();
  for (int k = own; k < loop.num_carry; ++k) {
    EXPECT_EQ(loop.body->input_slots[k], loop.body->output_slots[k]) << "hoisted value " << k;
  }
}

// The program survives the wire (plan_from_proto checks each kernel's type rule) and resolves
// for device 5, as LoadPlan sends it.
void expect_survives_the_wire(const Executable& exe) {
  pb::DevicePlan wire;
  to_proto(exe.program, &wire);
  absl::StatusOr<DevicePlan> back = plan_from_proto(wire);
  ASSERT_TRUE(back.ok()) << back.status();
  absl::StatusOr<DevicePlan> device5 = resolve(*back, exe.mesh, 5);
  ASSERT_TRUE(device5.ok()) << device5.status();
}
// The ops of `plan` whose results it stacks as a loop body's rows: outputs from `from` on.
std::vector<Op> stacked_ops(const DevicePlan& body, size_t from) {
  std::vector<Op> ops;
  for (size_t j = from; j < body.output_slots.size(); ++j) {
    for (const Instruction& i : body.code) {
      if (i.kind == Instruction::Kind::kKernel && i.out == body.output_slots[j]) ops.push_back(i.node.op);
    }
  }
  return ops;
}

// value_and_grad of `f` (of every input; a scan whose first loop is the forward one, `reverse` as given) of
// `types`, for one device: its forward loop stacks no broadcast (a residual broadcast is
// rebuilt in the backward body from its operand, stacked instead), and its values match the
// gradient of `unrolled` (the same loop written out: no scan, so no scan VJP) computed on the
// host (tests/support/host_eval.h). Returns the forward loop's stacked residual types.
std::vector<ArrayType> expect_scan_gradient_stacks_no_broadcast(const TracedFunction& f, const TracedFunction& unrolled,
                                                                const std::vector<ArrayType>& types, bool reverse) {
  std::vector<int> every;  // d/d each input
  for (size_t k = 0; k < types.size(); ++k) every.push_back(static_cast<int>(k));
  absl::StatusOr<Graph> traced = trace(value_and_grad(f, every), types);
  EXPECT_TRUE(traced.ok()) << traced.status();
  if (!traced.ok()) return {};
  absl::StatusOr<Mesh> mesh = make_mesh({1, 1}, {"data", "model"}, {0});
  EXPECT_TRUE(mesh.ok()) << mesh.status();
  const size_t outputs = 1 + types.size();
  absl::StatusOr<Propagation> p = propagate(*traced, *mesh, std::vector<PartitionSpec>(types.size(), P()),
                                            std::vector<std::optional<PartitionSpec>>(outputs));
  EXPECT_TRUE(p.ok()) << p.status();
  if (!mesh.ok() || !p.ok()) return {};
  absl::StatusOr<Executable> exe = partition(*traced, *mesh, *p, std::vector<std::optional<PartitionSpec>>(outputs));
  EXPECT_TRUE(exe.ok()) << exe.status();
  if (!exe.ok()) return {};
  const Instruction* forward = nullptr;
  for (const Instruction& i : exe->program.code) {
    if (i.kind == Instruction::Kind::kLoop && forward == nullptr) forward = &i;
  }
  EXPECT_NE(forward, nullptr) << exe->as_text();
  if (forward == nullptr) return {};
  EXPECT_EQ(forward->reverse, reverse) << exe->as_text();
  const size_t carries = static_cast<size_t>(forward->num_carry);
  for (Op op : stacked_ops(*forward->body, carries)) EXPECT_NE(op, Op::kBroadcastInDim) << exe->as_text();
  std::mt19937 rng(37);
  std::vector<HostArray> in;
  for (const ArrayType& t : types) in.push_back(random_array(t.dtype, t.shape, Domain::kSigned, rng));
  absl::StatusOr<Graph> flat = trace(value_and_grad(unrolled, every), types);
  EXPECT_TRUE(flat.ok()) << flat.status();
  if (!flat.ok()) return {};
  std::vector<const HostArray*> host_in;
  for (const HostArray& a : in) host_in.push_back(&a);
  absl::StatusOr<std::vector<HostArray>> want = evaluate_on_host(*flat, host_in);
  EXPECT_TRUE(want.ok()) << want.status();
  absl::StatusOr<DevicePlan> mine = resolve(exe->program, *mesh, 0);
  EXPECT_TRUE(mine.ok()) << mine.status();
  if (!want.ok() || !mine.ok()) return {};
  std::vector<std::shared_ptr<const HostArray>> inputs;
  for (const HostArray& a : in) inputs.push_back(std::make_shared<HostArray>(a.clone()));
  Transport transport;
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> got =
      run_plan(*mine, std::move(inputs), transport, PlanRun{});
  EXPECT_TRUE(got.ok()) << got.status();
  if (!got.ok()) return {};
  EXPECT_EQ(got->size(), outputs);
  for (size_t k = 0; k < got->size() && k < want->size(); ++k) {
    EXPECT_TRUE(results_match(*(*got)[k], (*want)[k], kF32Tolerance)) << "output " << k;
  }
  return std::vector<ArrayType>(forward->out_types.begin() + static_cast<std::ptrdiff_t>(carries),
                                forward->out_types.end());
}

// The row of `xs` (length, ...) at `k`, without its leading dimension.
Value row_of(const Value& xs, int64_t k) {
  const Shape shape = xs.shape();
  Shape start(shape.size(), 0);
  Shape limit = shape;
  start[0] = k;
  limit[0] = k + 1;
  return reshape(slice(xs, start, limit), Shape(shape.begin() + 1, shape.end()));
}

// The body of the broadcast tests: divides by its rows' sums of squares, whose broadcast the
// division's VJP reads (g / y and y * y).
Value divided_by_sums_of_squares(const Value& h, const Value& row) {
  return tanh(matmul(h, row) / (sum(h * h, {1}, /*keepdims=*/true) + 1.0));
}

constexpr int64_t kSumsLength = 3;

// expect_scan_gradient_stacks_no_broadcast of sum(carry) after a scan (`reverse` as given) of
// divided_by_sums_of_squares over kSumsLength rows, against its unrolled form.
std::vector<ArrayType> expect_divided_by_sums_scan_stacks_no_broadcast(bool reverse) {
  const auto f = [reverse](const std::vector<Value>& in) {
    ScanResult r = scan(
        [](const std::vector<Value>& c, const std::vector<Value>& x) {
          return ScanStep{{divided_by_sums_of_squares(c[0], x[0])}, {}};
        },
        {in[0]}, {in[1]}, std::nullopt, reverse);
    return std::vector<Value>{sum(r.carry[0])};
  };
  const auto unrolled = [reverse](const std::vector<Value>& in) {
    Value h = in[0];
    for (int64_t i = 0; i < kSumsLength; ++i) {
      h = divided_by_sums_of_squares(h, row_of(in[1], reverse ? kSumsLength - 1 - i : i));
    }
    return std::vector<Value>{sum(h)};
  };
  const std::vector<ArrayType> types = {{DType::kF32, {kDim, kDim}}, {DType::kF32, {kSumsLength, kDim, kDim}}};
  return expect_scan_gradient_stacks_no_broadcast(f, unrolled, types, reverse);
}

// A residual that is a broadcast is rebuilt in the backward body from its operand, which the
// forward loop stacks instead (JAX keeps what the tangent equations read; here a broadcast
// costs as much to rebuild as to read back, and stacking it costs `length` times its broadcast
// size). The forward loop stacks no broadcast, and the (kDim, 1) sums once.
TEST(ScanPlan, ItsGradientStacksABroadcastsOperandNotTheBroadcast) {
  int narrow = 0;
  for (const ArrayType& t : expect_divided_by_sums_scan_stacks_no_broadcast(/*reverse=*/false)) {
    narrow += t.shape == Shape{kSumsLength, kDim, 1} ? 1 : 0;
  }
  EXPECT_EQ(narrow, 1) << "the sums, stacked";
}

// The same rule in a reverse scan (jax.lax.scan(reverse=True): the rows are taken last first).
TEST(ScanPlan, ItsGradientInReverseStacksABroadcastsOperandNotTheBroadcast) {
  expect_divided_by_sums_scan_stacks_no_broadcast(/*reverse=*/true);
}

// A broadcast of a row of xs itself (a scale per column, v in c @ x * v), which the product's
// VJP reads: the row is the operand saved in its stead.
TEST(ScanPlan, ItsGradientStacksTheRowABroadcastOfAnXsRowIsBuiltFrom) {
  constexpr int64_t kLength = 3;
  const auto step = [](const Value& h, const Value& row, const Value& scale) {
    return tanh(matmul(h, row) * broadcast_in_dim(scale, {kDim, kDim}, {1}));
  };
  const auto f = [step](const std::vector<Value>& in) {
    ScanResult r = scan(
        [step](const std::vector<Value>& c, const std::vector<Value>& x) {
          return ScanStep{{step(c[0], x[0], x[1])}, {}};
        },
        {in[0]}, {in[1], in[2]});
    return std::vector<Value>{sum(r.carry[0])};
  };
  const auto unrolled = [step](const std::vector<Value>& in) {
    Value h = in[0];
    for (int64_t k = 0; k < kLength; ++k) h = step(h, row_of(in[1], k), row_of(in[2], k));
    return std::vector<Value>{sum(h)};
  };
  const std::vector<ArrayType> types = {
      {DType::kF32, {kDim, kDim}}, {DType::kF32, {kLength, kDim, kDim}}, {DType::kF32, {kLength, kDim}}};
  expect_scan_gradient_stacks_no_broadcast(f, unrolled, types, /*reverse=*/false);
}

// Loop-invariant code motion (passes/hoist.cc): the mask, the fill and the scales are built
// once before the loop, not in every iteration, and enter the body as extra carries the body
// passes on; the body keeps only what reads the iteration's values. Values: MeshesSuite.
// LoopInvariantsHoistedOutOfTheBodyGiveTheHostLoop.
TEST(ScanPlan, WhatTheBodyBuildsFromNothingOfTheIterationIsBuiltOnceBeforeTheLoop) {
  absl::StatusOr<Executable> exe =
      compile(masked, {{DType::kF32, {kDim, kDim}}, {DType::kF32, {6, kDim, kDim}}}, {P("data", None), P()});
  ASSERT_TRUE(exe.ok()) << exe.status();
  const Instruction* loop = the_loop(exe->program);
  ASSERT_NE(loop, nullptr) << exe->as_text();
  // The iotas (and the constants) before the loop; one carry of the scan's own.
  expect_masked_layer_hoisted(*exe, *loop, 2, 1);
  expect_survives_the_wire(*exe);
}

TEST(ScanPlan, MalformedLoopsAreRejected) {
  absl::StatusOr<Executable> exe = compile(
      [](const std::vector<Value>& in) { return scanned(in, false); },
      {{DType::kF32, {kDim, kDim}}, {DType::kF32, {kDim, kDim}}, {DType::kF32, {4, kDim, kDim}}}, {P(), P(), P()});
  ASSERT_TRUE(exe.ok()) << exe.status();
  pb::DevicePlan wire;
  to_proto(exe->program, &wire);
  int k = 0;
  while (wire.code(k).kind() != pb::Instruction::LOOP) ++k;
  auto rejects = [&](const std::function<void(pb::Instruction*)>& breaks, const std::string& message) {
    pb::DevicePlan bad = wire;
    breaks(bad.mutable_code(k));
    absl::StatusOr<DevicePlan> back = plan_from_proto(bad);
    EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_THAT(back.status().message(), HasSubstr(message));
  };
  rejects([](pb::Instruction* i) { i->clear_body(); }, "a loop without a body");
  rejects([](pb::Instruction* i) { i->set_trip_count(5); }, "not 5 rows");
  rejects([](pb::Instruction* i) { i->set_num_carry(7); }, "7 carries");
  // The loop's operands and results: the scan's 3 and 4, and one more of each per value the
  // hoisting made a carry (the body's scales).
  const int ins = wire.code(k).in_size(), outs = wire.code(k).out_types_size();
  ASSERT_EQ(ins - 3, outs - 4) << exe->as_text();
  rejects([](pb::Instruction* i) { i->add_in(i->in(0)); }, absl::StrCat("its body takes ", ins));
  rejects([](pb::Instruction* i) { *i->add_out_types() = i->out_types(0); },
          absl::StrCat("writes ", outs, " slots of ", outs + 1, " types; its body returns ", outs));
  rejects([](pb::Instruction* i) { i->mutable_out_types(0)->set_dtype(static_cast<pb::DType>(77)); },
          "result 0: dtype 77");
}

TEST_F(MeshesSuite, ScanOfLengthZeroAndFewerErrors) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = auto_meshes_[1];
  // length 0: the carries come back as they went in, the ys are empty (lax.scan's definition).
  HostArray h = HostArray::arange(DType::kF32, {kDim, kDim});
  HostArray w = HostArray::arange(DType::kF32, {kDim, kDim});
  HostArray xs(DType::kF32, {0, kDim, kDim});
  absl::StatusOr<JitCheck> r =
      run_against_host(*client_, mesh, [](const std::vector<Value>& in) { return scanned(in, false); }, {&h, &w, &xs},
                       {P("data", None), P(), P()});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->got[0], h);
  EXPECT_EQ(r->got[2].shape(), (Shape{0, kDim, kDim}));

  const ScanFunction accumulate = [](const std::vector<Value>& c, const std::vector<Value>& x) {
    return ScanStep{{c[0] + x[0]}, {}};
  };
  auto trace_error = [](const TracedFunction& f) {
    absl::Status s = trace(f, {{DType::kF32, {4}}, {DType::kF32, {3, 4}}}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  EXPECT_THAT(trace_error([](const std::vector<Value>& in) {
                return scan(
                           [](const std::vector<Value>& c, const std::vector<Value>&) {
                             return ScanStep{{c[0], c[0]}, {}};
                           },
                           {in[0]}, {in[1]})
                    .carry;
              }),
              HasSubstr("scan: the body returned 2 carries for 1 initial ones"));
  EXPECT_THAT(trace_error([](const std::vector<Value>& in) {
                return scan(
                           [](const std::vector<Value>& c, const std::vector<Value>&) {
                             return ScanStep{{convert(c[0], DType::kF64)}, {}};
                           },
                           {in[0]}, {in[1]})
                    .carry;
              }),
              HasSubstr("carry 0 enters as f32[4]"));
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) { return scan(accumulate, {in[0]}, {in[1]}, 5).carry; }),
              HasSubstr("xs 0 has 3 rows, but the length is 5"));
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) { return scan(accumulate, {in[0]}, {}).carry; }),
              HasSubstr("with no xs, the length must be given"));
}

// The values of `f` and of its gradient with respect to every input, jitted on `mesh` with the
// inputs laid out as `specs`.
std::vector<HostArray> values_and_grads(Client& client, const Mesh& mesh, const TracedFunction& f,
                                        const std::vector<const HostArray*>& inputs,
                                        const std::vector<PartitionSpec>& specs) {
  std::vector<Array> args;
  std::vector<int> all;
  for (size_t i = 0; i < inputs.size(); ++i) {
    absl::StatusOr<Array> a = client.device_put(*inputs[i], NamedSharding(mesh, specs[i]));
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return {};
    args.push_back(*std::move(a));
    all.push_back(static_cast<int>(i));
  }
  absl::StatusOr<std::vector<Array>> out = jit(value_and_grad(f, all))(args);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  std::vector<HostArray> got;
  for (const Array& a : *out) {
    absl::StatusOr<HostArray> v = a.fetch();
    EXPECT_TRUE(v.ok()) << v.status();
    if (v.ok()) got.push_back(*std::move(v));
  }
  return got;
}

// A body that reads values traced outside it (a closure, as JAX bodies do: the values become
// the loop's closed-over consts, jax/_src/lax/control_flow/loops.py's `consts`): w and b are
// never passed in. On every mesh, w split along the contraction (a collective per iteration),
// against the host loop and the unrolled program, forward and through grad (the consts'
// cotangents summed over the iterations); a fori_loop nested in the body captures w through it.
std::vector<Value> closure(const std::vector<Value>& in, bool loop) {
  const Value w = in[1], b = in[3];
  auto step = [&](const Value& h, const Value& x) { return tanh(matmul(h, w) * 0.5 + x) + b * 0.25; };
  auto inner = [&](const Value& h) {
    return fori_loop(0, 2, [&](const Value&, const std::vector<Value>& c) { return std::vector<Value>{step(c[0], h)}; },
                     {h})[0];
  };
  if (loop) {
    ScanResult r = scan(
        [&](const std::vector<Value>& c, const std::vector<Value>& x) {
          const Value h = step(c[0], x[0]);
          return ScanStep{{h}, {h * b, inner(h)}};
        },
        {in[0]}, {in[2]});
    return {r.carry[0], r.ys[0], r.ys[1]};
  }
  const int64_t length = in[2].shape()[0];
  Value h = in[0];
  std::vector<Value> ys0, ys1;
  for (int64_t row = 0; row < length; ++row) {
    h = step(h, reshape(slice(in[2], {row, 0, 0}, {row + 1, kDim, kDim}), {kDim, kDim}));
    ys0.push_back(expand_dims(h * b, 0));
    Value g = h;
    for (int i = 0; i < 2; ++i) g = step(g, h);
    ys1.push_back(expand_dims(g, 0));
  }
  return {h, concatenate(ys0, 0), concatenate(ys1, 0)};
}

TEST_F(MeshesSuite, ScanBodiesReadOuterValues) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(13);
  HostArray h = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray w = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray xs = random_array(DType::kF32, {4, kDim, kDim}, Domain::kSigned, rng);
  HostArray b = random_array(DType::kF32, {kDim}, Domain::kSigned, rng);
  const std::vector<const HostArray*> inputs = {&h, &w, &xs, &b};
  auto loss = [](bool loop) {
    return [loop](const std::vector<Value>& in) {
      std::vector<Value> r = closure(in, loop);
      return std::vector<Value>{sum(r[0] * r[0]) + sum(r[1]) + sum(r[2] * 0.5)};
    };
  };
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    SCOPED_TRACE(test_meshes()[m].name);
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(first, None), P(last, None), P(None, None, last), P(last)};
    absl::StatusOr<JitCheck> loop = run_against_host(
        *client_, auto_meshes_[m], [](const std::vector<Value>& in) { return closure(in, true); }, inputs, specs);
    ASSERT_TRUE(loop.ok()) << loop.status();
    absl::StatusOr<JitCheck> flat = run_against_host(
        *client_, auto_meshes_[m], [](const std::vector<Value>& in) { return closure(in, false); }, inputs, specs);
    ASSERT_TRUE(flat.ok()) << flat.status();
    for (size_t i = 0; i < loop->got.size(); ++i) {
      EXPECT_TRUE(results_match(loop->got[i], loop->want[i], kF32Tolerance)) << "against the host loop " << i;
      EXPECT_TRUE(results_match(loop->got[i], flat->got[i], kF32Tolerance)) << "against the unrolled program " << i;
    }
    EXPECT_THAT(loop->plan_text, HasSubstr("loop("));
    const std::vector<HostArray> g = values_and_grads(*client_, auto_meshes_[m], loss(true), inputs, specs);
    const std::vector<HostArray> want = values_and_grads(*client_, auto_meshes_[m], loss(false), inputs, specs);
    ASSERT_EQ(g.size(), 5u);
    ASSERT_EQ(want.size(), 5u);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(results_match(g[i], want[i], 1e-4)) << "gradient output " << i;
  }
}

// The loop whose invariants the compiler hoists (ScanPlan.WhatTheBodyBuildsFromNothing...)
// against the host, which runs the body graph once per row, masks and all, and against the
// unrolled program; and its gradient against the unrolled program's, whose backward loop
// hoists the VJP's constants too.
TEST_F(MeshesSuite, LoopInvariantsHoistedOutOfTheBodyGiveTheHostLoop) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(17);
  HostArray h = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray xs = random_array(DType::kF32, {5, kDim, kDim}, Domain::kSigned, rng);
  const std::vector<const HostArray*> inputs = {&h, &xs};
  auto written_out = [](const std::vector<Value>& in) {
    std::vector<Value> c = {in[0]}, ys;
    for (int64_t row = 0; row < 5; ++row) {
      ScanStep step = masked_layer(c, {reshape(slice(in[1], {row, 0, 0}, {row + 1, kDim, kDim}), {kDim, kDim})});
      c = step.carry;
      ys.push_back(expand_dims(step.ys[0], 0));
    }
    return std::vector<Value>{c[0], concatenate(ys, 0)};
  };
  auto loss = [](const TracedFunction& f) {
    return [f](const std::vector<Value>& in) {
      std::vector<Value> r = f(in);
      return std::vector<Value>{sum(r[0] * r[0]) + sum(r[1] * 0.5)};
    };
  };
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    SCOPED_TRACE(test_meshes()[m].name);
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(first, None), P(None, None, last)};
    absl::StatusOr<JitCheck> loop = run_against_host(*client_, auto_meshes_[m], masked, inputs, specs);
    ASSERT_TRUE(loop.ok()) << loop.status();
    absl::StatusOr<JitCheck> flat = run_against_host(*client_, auto_meshes_[m], written_out, inputs, specs);
    ASSERT_TRUE(flat.ok()) << flat.status();
    ASSERT_EQ(loop->got.size(), 2u);
    for (size_t i = 0; i < loop->got.size(); ++i) {
      EXPECT_TRUE(results_match(loop->got[i], loop->want[i], kF32Tolerance)) << "against the host loop " << i;
      EXPECT_TRUE(results_match(loop->got[i], flat->got[i], kF32Tolerance)) << "against the unrolled program " << i;
    }
    EXPECT_THAT(loop->plan_text, HasSubstr("loop("));
    const std::vector<HostArray> g = values_and_grads(*client_, auto_meshes_[m], loss(masked), inputs, specs);
    const std::vector<HostArray> want = values_and_grads(*client_, auto_meshes_[m], loss(written_out), inputs, specs);
    ASSERT_EQ(g.size(), 3u);
    ASSERT_EQ(want.size(), 3u);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(results_match(g[i], want[i], 1e-4)) << "gradient output " << i;
  }
}

// What broadcasts reach elementwise ops in a model: a scale and an offset (scalars), a causal
// mask (T, T) and its scalar fill, softmax's row maxima and sums, layer norm's (T, 1)
// statistics and its (D) scale and bias. `block` runs them on x; `broadcasting` runs it once
// outside and in a scan over xs rows, and also returns the scale broadcast to x's shape (a
// broadcast an output reads: it must still be built) and that times x.
Value block(const Value& x, const Value& scale, const Value& bias) {
  const Value causal = iota(DType::kI32, {kDim, kDim}, 0) >= iota(DType::kI32, {kDim, kDim}, 1);
  const Value p = nn::softmax(where(causal, x * 0.5, full({}, -1e4, DType::kF32)));
  return nn::layer_norm(p * 3.0 - 1.0, scale, bias) + 0.25;
}
std::vector<Value> broadcasting(const std::vector<Value>& in) {
  const Value &x = in[0], &xs = in[1], &scale = in[2], &bias = in[3];
  auto step = [&](const std::vector<Value>& c, const std::vector<Value>& row) {
    const Value h = block(c[0] + row[0], scale, bias);
    return ScanStep{{h}, {h * 2.0}};
  };
  ScanResult r = scan(step, {block(x, scale, bias)}, {xs});
  const Value repeated = broadcast_to(scale, {kDim, kDim});
  return {r.carry[0], r.ys[0], repeated, repeated * x};
}
const std::vector<ArrayType> kBroadcastingTypes = {
    {DType::kF32, {kDim, kDim}}, {DType::kF32, {3, kDim, kDim}}, {DType::kF32, {kDim}}, {DType::kF32, {kDim}}};

// How many elementwise kernels of `plan` (and of its loops' bodies) read what a broadcast_in_dim
// kernel wrote, and how many broadcast_in_dim kernels there are.
struct BroadcastReads {
  int elementwise_reads = 0, broadcasts = 0;
};
void count_broadcast_reads(const DevicePlan& plan, BroadcastReads* r) {
  std::vector<bool> broadcast(plan.num_slots, false);
  for (const Instruction& i : plan.code) {
    if (i.kind == Instruction::Kind::kLoop || i.kind == Instruction::Kind::kSwitch) {
      if (i.body != nullptr) count_broadcast_reads(*i.body, r);
      for (const auto& b : i.branches) count_broadcast_reads(*b, r);
    }
    if (i.kind != Instruction::Kind::kKernel) continue;
    if (i.node.op == Op::kBroadcastInDim) {
      broadcast[i.out] = true;
      ++r->broadcasts;
    }
    if (has_trait(i.node.op, kElementwise) && i.in.size() > 1) {
      for (int s : i.in) r->elementwise_reads += broadcast[s] ? 1 : 0;
    }
  }
}

// passes/broadcast_operands.cc: no elementwise kernel reads a broadcast — neither in the
// program nor in the loop's body, where the scalars then leave the loop as small carries —
// and the one broadcast an output reads is still built, once. The program survives the wire
// (the decoder's type rule takes the repeated operands) and resolves. Values:
// MeshesSuite.ElementwiseOpsReadingBroadcastsGiveTheHost.
TEST(BroadcastPlan, ElementwiseOpsReadWhatABroadcastRepeatsAndOnlyAnOutputsBroadcastIsBuilt) {
  absl::StatusOr<Executable> exe = compile(broadcasting, kBroadcastingTypes, {P("data", None), P(), P(), P()});
  ASSERT_TRUE(exe.ok()) << exe.status();
  ASSERT_NE(the_loop(exe->program), nullptr) << exe->as_text();
  BroadcastReads reads;
  count_broadcast_reads(exe->program, &reads);
  EXPECT_EQ(reads.elementwise_reads, 0) << exe->as_text();
  EXPECT_EQ(reads.broadcasts, 1) << exe->as_text();
  expect_survives_the_wire(*exe);
}

// The program above against the host, which runs the graph with every broadcast built
// (tests/support/host_eval.cc), on the (8), (4, 2) and (2, 4) meshes with x split by rows or
// columns and the scale and bias whole or split; and its gradient (whose backward loop reads
// broadcasts of its own) against the host's evaluation of the same gradient graph.
TEST_F(MeshesSuite, ElementwiseOpsReadingBroadcastsGiveTheHost) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(23);
  HostArray x = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray xs = random_array(DType::kF32, {3, kDim, kDim}, Domain::kSigned, rng);
  HostArray scale = random_array(DType::kF32, {kDim}, Domain::kSigned, rng);
  HostArray bias = random_array(DType::kF32, {kDim}, Domain::kSigned, rng);
  const std::vector<const HostArray*> inputs = {&x, &xs, &scale, &bias};
  auto loss = [](const std::vector<Value>& in) {
    const std::vector<Value> r = broadcasting(in);
    return std::vector<Value>{sum(r[0] * r[0]) + sum(r[1]) + sum(r[3] * 0.5)};
  };
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    for (const std::vector<PartitionSpec>& specs :
         {std::vector<PartitionSpec>{P(first, None), P(), P(), P()},
          std::vector<PartitionSpec>{P(None, last), P(None, first, None), P(last), P(first)}}) {
      SCOPED_TRACE(absl::StrCat(test_meshes()[m].name, " x ", specs[0].to_string(), " scale ", specs[2].to_string()));
      absl::StatusOr<JitCheck> r = run_against_host(*client_, auto_meshes_[m], broadcasting, inputs, specs);
      ASSERT_TRUE(r.ok()) << r.status();
      ASSERT_EQ(r->got.size(), 4u);
      for (size_t i = 0; i < r->got.size(); ++i) {
        EXPECT_TRUE(results_match(r->got[i], r->want[i], 1e-4)) << "output " << i << "\n" << r->plan_text;
      }
      absl::StatusOr<JitCheck> g =
          run_against_host(*client_, auto_meshes_[m], value_and_grad(loss, {0, 1, 2, 3}), inputs, specs);
      ASSERT_TRUE(g.ok()) << g.status();
      ASSERT_EQ(g->got.size(), 5u);
      for (size_t i = 0; i < g->got.size(); ++i) {
        EXPECT_TRUE(results_match(g->got[i], g->want[i], 1e-4)) << "value or gradient " << i;
      }
    }
  }
}

// jax.grad through a scan (client/vjp/control.cc: a saving scan forward, a reverse scan of the
// body's VJP backward) gives the gradient of the unrolled program, on every mesh with the
// carry split along the contraction (a collective in each iteration of both scans).
TEST_F(MeshesSuite, ScanGradientIsTheUnrolledGradient) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(11);
  HostArray h = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray w = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray xs = random_array(DType::kF32, {4, kDim, kDim}, Domain::kSigned, rng);
  auto loss = [](bool loop) {
    return [loop](const std::vector<Value>& in) {
      std::vector<Value> r = loop ? scanned(in, true) : unrolled(in, true);
      return std::vector<Value>{sum(r[0] * r[0]) + sum(r[2] * 0.25) + sum(r[3])};
    };
  };
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    const std::string last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(None, last), P(last, None), P(None, None, last)};
    std::vector<std::vector<HostArray>> got(2);
    for (bool loop : {true, false}) {
      SCOPED_TRACE(absl::StrCat(test_meshes()[m].name, loop ? " scan" : " unrolled"));
      std::vector<Array> args;
      for (size_t i = 0; i < 3; ++i) {
        absl::StatusOr<Array> a = client_->device_put(*std::vector<const HostArray*>{&h, &w, &xs}[i],
                                                      NamedSharding(auto_meshes_[m], specs[i]));
        ASSERT_TRUE(a.ok()) << a.status();
        args.push_back(*std::move(a));
      }
      Jitted step = jit(value_and_grad(loss(loop), {0, 1, 2}));
      absl::StatusOr<std::vector<Array>> out = step(args);
      ASSERT_TRUE(out.ok()) << out.status();
      for (const Array& a : *out) {
        absl::StatusOr<HostArray> v = a.fetch();
        ASSERT_TRUE(v.ok()) << v.status();
        got[loop ? 0 : 1].push_back(*std::move(v));
      }
    }
    for (size_t i = 0; i < got[0].size(); ++i) {
      EXPECT_TRUE(results_match(got[0][i], got[1][i], 1e-4)) << test_meshes()[m].name << " output " << i;
    }
  }
}

// A loop far longer than its run's timeout (10^8 iterations of a body with no collective, so
// nothing else would look at the deadline) fails with the worker's deadline, naming the
// iteration, instead of running on: the interpreter checks the run's deadline and cancel flag
// before every iteration, and before every instruction of the body (which of the two sees it
// first depends on where the deadline falls: "at iteration t of n", or "iteration t:
// instruction k (op): ... before it ran").
TEST_F(MeshesSuite, ALongLoopEndsAtItsRunsDeadline) {
  ASSERT_NE(client_, nullptr);
  HostArray x = HostArray::zeros(DType::kF32, {8});
  absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(auto_meshes_[0], P("data")));
  ASSERT_TRUE(a.ok()) << a.status();
  JitOptions options;
  options.timeout = absl::Milliseconds(300);
  Jitted f = jit(
      [](const std::vector<Value>& in) {
        return fori_loop(0, 100000000,
                         [](const Value&, const std::vector<Value>& c) { return std::vector<Value>{c[0] + 1.0}; },
                         {in[0]});
      },
      options);
  absl::StatusOr<std::vector<Array>> out = f({*a});
  absl::Status s = out.ok() ? (*out)[0].fetch().status() : out.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("the run's deadline passed"), HasSubstr("iteration "))) << s;
}

// The same end to end for a plan with no loop (issue #17, "no cancellation check between
// kernels"): twelve chained 1024x1024 matmuls on every device (seconds of work on 8 devices
// sharing this machine's cores) under a 200 ms timeout stop at the first instruction that has
// not begun when the deadline passes, and the call fails DEADLINE_EXCEEDED with the worker's
// reason naming it. Without the per-instruction check the workers run every matmul and the call
// succeeds (or fails later with another reason).
TEST_F(MeshesSuite, AStraightLineOfHeavyKernelsEndsAtItsRunsDeadline) {
  ASSERT_NE(client_, nullptr);
  constexpr int64_t kSide = 1024;
  HostArray x = HostArray::from_vector<float>({kSide, kSide}, std::vector<float>(kSide * kSide, 1.0f / kSide));
  absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(auto_meshes_[0], P()));
  ASSERT_TRUE(a.ok()) << a.status();
  JitOptions options;
  options.timeout = absl::Milliseconds(200);
  Jitted f = jit(
      [](const std::vector<Value>& in) {
        Value y = in[0];
        for (int i = 0; i < 12; ++i) y = matmul(y, in[0]) + 1.0;
        return std::vector<Value>{y};
      },
      options);
  absl::StatusOr<std::vector<Array>> out = f({*a});
  absl::Status s = out.ok() ? (*out)[0].fetch().status() : out.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(), AllOf(HasSubstr("instruction "), HasSubstr("the run's deadline passed before it ran"))) << s;
}

// fori_loop with static bounds (a scan with the counter in its carry, as JAX lowers it): the
// counter's values reach the body, against the host and the unrolled loop; bounds the wrong
// way round run no iteration (jax.lax.fori_loop's documented Python-loop semantics).
TEST_F(MeshesSuite, ForiLoopMatchesItsUnrolledForm) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(5);
  HostArray h = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray w = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  auto step = [](const Value& i, const std::vector<Value>& c) {
    return std::vector<Value>{tanh(matmul(c[0], c[1]) * 0.5 + convert(i, DType::kF32) * 0.1), c[1]};
  };
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    const std::string first = test_meshes()[m].axes.front();
    absl::StatusOr<JitCheck> loop = run_against_host(
        *client_, auto_meshes_[m],
        [&](const std::vector<Value>& in) {
          return std::vector<Value>{fori_loop(2, 7, step, {in[0], in[1]})[0], fori_loop(3, 1, step, {in[0], in[1]})[0]};
        },
        {&h, &w}, {P(first, None), P()});
    ASSERT_TRUE(loop.ok()) << loop.status();
    absl::StatusOr<JitCheck> flat = run_against_host(*client_, auto_meshes_[m],
                                                     [&](const std::vector<Value>& in) {
                                                       std::vector<Value> c = {in[0], in[1]};
                                                       for (int i = 2; i < 7; ++i)
                                                         c = step(full({}, i, DType::kI32), c);
                                                       return std::vector<Value>{c[0], in[0] * 1.0};
                                                     },
                                                     {&h, &w}, {P(first, None), P()});
    ASSERT_TRUE(flat.ok()) << flat.status();
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(results_match(loop->got[i], loop->want[i], kF32Tolerance)) << "against the host loop " << i;
      EXPECT_TRUE(results_match(loop->got[i], flat->got[i], kF32Tolerance)) << "against the unrolled program " << i;
    }
  }
}

// ---- while_loop -------------------------------------------------------------------------------

// lax.while_loop(cond, body, (i, h)) whose trip count depends on the data: h grows until the
// sum of its magnitudes passes a bound (or 12 iterations), w and b read from outside (consts).
// The unrolled form is the definition with the carry frozen once the predicate fails:
// `for t < 12: c = where(cond(c), body(c), c)` (a frozen carry keeps the predicate false).
Value keep_going(const std::vector<Value>& c) {
  return logical_and(c[0] < full({}, 12, DType::kI32), sum(abs(c[1])) < full({}, 900.0, DType::kF32));
}
std::vector<Value> grow(const std::vector<Value>& c, const Value& w, const Value& b) {
  return {c[0] + 1, c[1] * 1.5 + tanh(matmul(c[1], w)) + b};
}
std::vector<Value> while_program(const std::vector<Value>& in, bool loop) {
  const Value w = in[1], b = in[2];
  std::vector<Value> c = {full({}, 0, DType::kI32), in[0]};
  if (loop)
    return while_loop(
        keep_going, [&](const std::vector<Value>& x) { return grow(x, w, b); }, c);
  for (int t = 0; t < 12; ++t) {
    const Value go = keep_going(c);
    const std::vector<Value> next = grow(c, w, b);
    c = {where(go, next[0], c[0]), where(go, next[1], c[1])};
  }
  return c;
}

// Random h and w of (kDim, kDim) and b of (kDim).
std::vector<HostArray> random_hwb(unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<HostArray> out;
  for (const Shape& s : {Shape{kDim, kDim}, Shape{kDim, kDim}, Shape{kDim}}) {
    out.push_back(random_array(DType::kF32, s, Domain::kSigned, rng));
  }
  return out;
}

// `program(in, true)` (a while loop) run on `mesh`, its two results checked against the host
// loop and against `program(in, false)` (its unrolled form).
using WhileProgram = std::vector<Value> (*)(const std::vector<Value>&, bool);
absl::StatusOr<JitCheck> while_against_host_and_unrolled(const Client& client, const Mesh& mesh, WhileProgram program,
                                                         const std::vector<const HostArray*>& inputs,
                                                         const std::vector<PartitionSpec>& specs) {
  absl::StatusOr<JitCheck> loop = run_against_host(
      client, mesh, [program](const std::vector<Value>& in) { return program(in, true); }, inputs, specs);
  if (!loop.ok()) return loop.status();
  absl::StatusOr<JitCheck> flat = run_against_host(
      client, mesh, [program](const std::vector<Value>& in) { return program(in, false); }, inputs, specs);
  if (!flat.ok()) return flat.status();
  EXPECT_EQ(loop->got.size(), 2u);
  for (size_t i = 0; i < 2 && i < loop->got.size(); ++i) {
    EXPECT_TRUE(results_match(loop->got[i], loop->want[i], kF32Tolerance)) << "against the host loop " << i;
    EXPECT_TRUE(results_match(loop->got[i], flat->got[i], kF32Tolerance)) << "against the unrolled form " << i;
  }
  return loop;
}

TEST_F(MeshesSuite, WhileLoopMatchesTheHostAndItsUnrolledForm) {
  ASSERT_NE(client_, nullptr);
  const std::vector<HostArray> hwb = random_hwb(17);
  const HostArray &h = hwb[0], &w = hwb[1], &b = hwb[2];
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    SCOPED_TRACE(test_meshes()[m].name);
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    // h split by rows (the predicate's sum is a pending sum, all-reduced), w along the
    // contraction (the body all-reduces h @ w).
    const std::vector<PartitionSpec> specs = {first == last ? P(first, None) : P(first, last), P(last, None), P()};
    absl::StatusOr<JitCheck> loop =
        while_against_host_and_unrolled(*client_, auto_meshes_[m], while_program, {&h, &w, &b}, specs);
    ASSERT_TRUE(loop.ok()) << loop.status();
    // The data ended the loop, not the counter: it ran some iterations, fewer than 12.
    const int32_t trips = loop->got[0].values<int32_t>()[0];
    EXPECT_GT(trips, 1);
    EXPECT_LT(trips, 12);
    EXPECT_EQ(loop->out_specs[1], specs[0]) << "the carry leaves as it entered\n" << loop->plan_text;
    EXPECT_THAT(loop->plan_text, HasSubstr("= while("));
    EXPECT_THAT(loop->plan_text, HasSubstr("trip_count=65536")) << "collectives: the bound";
  }
}

// `exe`'s program on the wire, as LoadPlan sends it, checked to decode to the same `loop`
// and to resolve.
pb::DevicePlan loop_through_the_wire(const Executable& exe, const Instruction& loop) {
  pb::DevicePlan wire;
  to_proto(exe.program, &wire);
  absl::StatusOr<DevicePlan> back = plan_from_proto(wire);
  EXPECT_TRUE(back.ok()) << back.status();
  if (back.ok()) {
    EXPECT_EQ(canonical_bytes(*the_loop(*back)), canonical_bytes(loop));
    EXPECT_TRUE(resolve(*back, exe.mesh, 5).ok());
  }
  return wire;
}

TEST(WhilePlan, ThePredicateIsReplicatedAndTheProgramSurvivesTheWire) {
  absl::StatusOr<Executable> exe =
      compile([](const std::vector<Value>& in) { return while_program(in, true); },
              {{DType::kF32, {kDim, kDim}}, {DType::kF32, {kDim, kDim}}, {DType::kF32, {kDim}}},
              {P("data", "model"), P("model", None), P()});
  ASSERT_TRUE(exe.ok()) << exe.status();
  const Instruction* loop = the_loop(exe->program);
  ASSERT_NE(loop, nullptr) << exe->as_text();
  ASSERT_EQ(loop->branches.size(), 1u);
  // sum(abs(h)) of a split h is resolved inside the predicate: one all-reduce of a scalar.
  EXPECT_GE(collectives(*loop->branches[0]), 1) << exe->as_text();
  EXPECT_EQ(loop->trip_count, 65536);
  EXPECT_EQ(plan_op_span(exe->program), exe->program.code.size() +
                                            65536 * (plan_op_span(*loop->body) + plan_op_span(*loop->branches[0])) +
                                            plan_op_span(*loop->branches[0]));
  const pb::DevicePlan wire = loop_through_the_wire(*exe, *loop);
  int k = 0;
  while (wire.code(k).kind() != pb::Instruction::LOOP) ++k;
  pb::DevicePlan bad = wire;
  bad.mutable_code(k)->set_trip_count(0);
  EXPECT_THAT(plan_from_proto(bad).status().message(), HasSubstr("collectives and no bound"));
  bad = wire;
  *bad.mutable_code(k)->add_branches() = wire.code(k).branches(0);
  EXPECT_THAT(plan_from_proto(bad).status().message(), HasSubstr("a loop with 2 predicates"));
}

// A while loop whose body and predicate build arrays from nothing of the iteration: the body
// runs masked_layer (its causal mask from two iotas, its fill and its scales) on x read from
// outside, the predicate compares with two constants. The unrolled form as while_program's.
Value masked_keep_going(const std::vector<Value>& c) {
  return logical_and(c[0] < full({}, 5, DType::kI32), sum(abs(c[1])) < full({}, 1000.0, DType::kF32));
}
std::vector<Value> masked_while(const std::vector<Value>& in, bool loop) {
  const Value x = in[1];
  const WhileBody step = [x](const std::vector<Value>& c) {
    return std::vector<Value>{c[0] + 1, masked_layer({c[1]}, {x}).carry[0]};
  };
  std::vector<Value> c = {full({}, 0, DType::kI32), in[0]};
  if (loop) return while_loop(masked_keep_going, step, c);
  for (int t = 0; t < 5; ++t) {
    const Value go = masked_keep_going(c);
    const std::vector<Value> next = step(c);
    c = {where(go, next[0], c[0]), where(go, next[1], c[1])};
  }
  return c;
}

// Loop-invariant code motion in a while loop (passes/hoist.cc): the body's mask, fill and
// scales and the predicate's constants are built once before the loop and enter both as extra
// carries (the predicate takes every carry), which the body passes on unchanged. Values:
// MeshesSuite.WhileLoopInvariantsHoistedOutOfTheBodyAndPredicateGiveTheHostLoop.
TEST(WhilePlan, WhatTheBodyAndPredicateBuildFromNothingOfTheIterationIsBuiltOnceBeforeTheLoop) {
  absl::StatusOr<Executable> exe =
      compile([](const std::vector<Value>& in) { return masked_while(in, true); },
              {{DType::kF32, {kDim, kDim}}, {DType::kF32, {kDim, kDim}}}, {P("data", None), P()});
  ASSERT_TRUE(exe.ok()) << exe.status();
  const Instruction* loop = the_loop(exe->program);
  ASSERT_NE(loop, nullptr) << exe->as_text();
  ASSERT_EQ(loop->branches.size(), 1u) << exe->as_text();
  const DevicePlan& pred = *loop->branches[0];
  for (Op op : {Op::kConstant, Op::kIota, Op::kBroadcastInDim}) {
    EXPECT_EQ(kernels_of(pred, op), 0) << op_name(op) << " in the predicate\n" << exe->as_text();
  }
  EXPECT_EQ(kernels_of(pred, Op::kLt), 2) << exe->as_text();
  // The body's iotas and constants and the predicate's two; the while's own carries (i, h,
  // x) first. The predicate takes every carry.
  expect_masked_layer_hoisted(*exe, *loop, 4, 3);
  EXPECT_EQ(static_cast<int>(loop->in.size()), loop->num_carry);
  EXPECT_EQ(static_cast<int>(pred.input_slots.size()), loop->num_carry);
  EXPECT_EQ(static_cast<int>(loop->body->input_slots.size()), loop->num_carry);
  loop_through_the_wire(*exe, *loop);
}

// That loop against the host, which runs the predicate and body graphs in every iteration,
// masks and constants and all, and against its unrolled form, on every mesh.
TEST_F(MeshesSuite, WhileLoopInvariantsHoistedOutOfTheBodyAndPredicateGiveTheHostLoop) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(23);
  HostArray h = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  HostArray x = random_array(DType::kF32, {kDim, kDim}, Domain::kSigned, rng);
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    SCOPED_TRACE(test_meshes()[m].name);
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(first, None), P(None, last)};
    absl::StatusOr<JitCheck> loop =
        while_against_host_and_unrolled(*client_, auto_meshes_[m], masked_while, {&h, &x}, specs);
    ASSERT_TRUE(loop.ok()) << loop.status();
    ASSERT_EQ(loop->got.size(), 2u);
    EXPECT_EQ(loop->got[0].values<int32_t>()[0], 5) << "the counter ended it";
    EXPECT_THAT(loop->plan_text, HasSubstr("= while("));
  }
}

TEST_F(MeshesSuite, WhileLoopErrors) {
  ASSERT_NE(client_, nullptr);
  auto trace_error = [](const TracedFunction& f) {
    absl::Status s = trace(f, {{DType::kF32, {4}}}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  const WhileBody twice = [](const std::vector<Value>& c) { return std::vector<Value>{c[0] * 2.0}; };
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) {
                return while_loop([](const std::vector<Value>& c) { return sum(c[0]); }, twice, {in[0]});
              }),
              HasSubstr("while_loop: cond_fun must return a bool scalar, not (f32[])"));
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) {
                return while_loop([](const std::vector<Value>& c) { return sum(c[0]) < 9.0; },
                                  [](const std::vector<Value>& c) { return std::vector<Value>{sum(c[0])}; }, {in[0]});
              }),
              HasSubstr("body_fun returns (f32[]) for carries (f32[4])"));
  // grad: JAX's rule (jax/_src/lax/control_flow/loops.py: "Reverse-mode differentiation does
  // not work for lax.while_loop").
  EXPECT_THAT(trace_error(grad([&](const std::vector<Value>& in) {
                return std::vector<Value>{
                    sum(while_loop([](const std::vector<Value>& c) { return sum(c[0]) < 9.0; }, twice, {in[0]})[0])};
              })),
              HasSubstr("reverse-mode differentiation does not work for lax.while_loop"));
}

// A while loop that never ends, with no collective (the carry replicated: no op ids, so no
// bound), ends at its run's deadline: the interpreter checks it before every iteration (and
// before every instruction of the predicate and the body), naming the while and the iteration.
TEST_F(MeshesSuite, AWhileLoopThatNeverEndsEndsAtItsRunsDeadline) {
  ASSERT_NE(client_, nullptr);
  absl::StatusOr<Array> a =
      client_->device_put(HostArray::zeros(DType::kF32, {8}), NamedSharding(auto_meshes_[0], P()));
  ASSERT_TRUE(a.ok()) << a.status();
  JitOptions options;
  options.timeout = absl::Milliseconds(300);
  Jitted f = jit_support::never_ending_loop(options);
  absl::StatusOr<std::vector<Array>> out = f({*a});
  absl::Status s = out.ok() ? (*out)[0].fetch().status() : out.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("(while): "), HasSubstr("the run's deadline passed"), HasSubstr("iteration ")))
      << s;
  EXPECT_THAT(f.as_text(), HasSubstr("trip_count=0")) << "no collectives: no bound";
}

// ---- cond / switch -----------------------------------------------------------------------------

// Three branches of different shapes of computation on (h, w), reading b from outside: one
// contracts the split dimension (a collective inside the branch), one is elementwise, one
// transposes (so the branches leave their results in different layouts, which are joined).
std::vector<Branch> three_branches(const Value& b) {
  return {[](const std::vector<Value>& o) {
            return std::vector<Value>{matmul(o[0], o[1]), sum(o[0])};
          },
          [b](const std::vector<Value>& o) {
            return std::vector<Value>{tanh(o[0]) * o[1] + b, sum(o[1] * 2.0)};
          },
          [](const std::vector<Value>& o) {
            return std::vector<Value>{transpose(o[0], {1, 0}) - o[1], sum(o[0] * o[1])};
          }};
}

TEST_F(MeshesSuite, SwitchRunsTheClampedBranchAndCondTheTakenOne) {
  ASSERT_NE(client_, nullptr);
  const std::vector<HostArray> hwb = random_hwb(19);
  const HostArray &h = hwb[0], &w = hwb[1], &b = hwb[2];
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(first, None), P(last, None), P(), P()};
    // lax.switch clamps the index into range (jax/_src/lax/control_flow/conditionals.py).
    for (int32_t index : {-3, 0, 1, 2, 7}) {
      SCOPED_TRACE(absl::StrCat(test_meshes()[m].name, " index ", index));
      HostArray i = HostArray::from_vector<int32_t>({}, {index});
      absl::StatusOr<JitCheck> got = run_against_host(
          *client_, auto_meshes_[m],
          [](const std::vector<Value>& in) {
            return switch_(in[3], three_branches(in[2]), {in[0], in[1]});
          },
          {&h, &w, &b, &i}, specs);
      ASSERT_TRUE(got.ok()) << got.status();
      const int taken = std::clamp(index, 0, 2);
      absl::StatusOr<JitCheck> want = run_against_host(
          *client_, auto_meshes_[m],
          [taken](const std::vector<Value>& in) {
            return three_branches(in[2])[taken]({in[0], in[1]});
          },
          {&h, &w, &b, &i}, specs);
      ASSERT_TRUE(want.ok()) << want.status();
      for (size_t k = 0; k < 2; ++k) {
        EXPECT_TRUE(results_match(got->got[k], got->want[k], kF32Tolerance)) << "against the host " << k;
        EXPECT_TRUE(results_match(got->got[k], want->got[k], kF32Tolerance)) << "against the branch itself " << k;
      }
      EXPECT_THAT(got->plan_text, HasSubstr("= switch("));
    }
    // cond on a predicate computed from split data, against both branches and a select.
    absl::StatusOr<JitCheck> c = run_against_host(
        *client_, auto_meshes_[m],
        [](const std::vector<Value>& in) {
          std::vector<Branch> br = three_branches(in[2]);
          const Value pred = sum(in[0]) > 0.0;
          std::vector<Value> out = cond(pred, br[1], br[0], {in[0], in[1]});
          std::vector<Value> t = br[1]({in[0], in[1]}), f = br[0]({in[0], in[1]});
          out.push_back(where(pred, t[0], f[0]));
          out.push_back(cond(logical_not(pred), br[1], br[0], {in[0], in[1]})[0]);
          out.push_back(where(pred, f[0], t[0]));
          return out;
        },
        {&h, &w, &b, &h}, specs);
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE(results_match(c->got[0], c->want[0], kF32Tolerance));
    EXPECT_TRUE(results_match(c->got[0], c->got[2], kF32Tolerance)) << "cond is the select of its branches";
    EXPECT_TRUE(results_match(c->got[3], c->got[4], kF32Tolerance)) << "and the other way round";
  }
}

TEST_F(MeshesSuite, CondAndSwitchErrors) {
  ASSERT_NE(client_, nullptr);
  auto trace_error = [](const TracedFunction& f) {
    absl::Status s = trace(f, {{DType::kF32, {4}}}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  const Branch same = [](const std::vector<Value>& o) { return o; };
  const Branch summed = [](const std::vector<Value>& o) { return std::vector<Value>{sum(o[0])}; };
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) { return cond(sum(in[0]) > 0.0, same, summed, in); }),
              HasSubstr("cond: true_fun returns (f32[4]) but false_fun returns (f32[])"));
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) {
                return switch_(in[0], {same, same}, in);
              }),
              HasSubstr("switch: the index is f32[4], not an integer scalar"));
  EXPECT_THAT(trace_error([&](const std::vector<Value>& in) { return cond(in[0] > 0.0, same, same, in); }),
              HasSubstr("cond: the predicate is bool[4], not a scalar"));
  // A failed cond or switch returns invalid values a caller may index and compute with (as
  // scan's and while_loop's failures do), never an empty list: the trace fails with the cause.
  const Branch fails = [](const std::vector<Value>& o) { return std::vector<Value>{o[0] + full({3}, 1.0)}; };
  const std::vector<std::pair<TracedFunction, std::string>> indexed = {
      {[&](const std::vector<Value>& in) { return std::vector<Value>{cond(in[0] > 0.0, same, same, in)[0] * 2.0}; },
       "cond: the predicate is bool[4], not a scalar"},
      {[&](const std::vector<Value>& in) {
         return std::vector<Value>{switch_(in[0], {same, same}, in)[0] * 2.0};
       },
       "switch: the index is f32[4], not an integer scalar"},
      {[&](const std::vector<Value>& in) {
         return std::vector<Value>{cond(sum(in[0]) > 0.0, fails, same, in)[0] * 2.0};
       },
       "true_fun"},
      {[&](const std::vector<Value>& in) {
         return std::vector<Value>{cond(sum(in[0]) > 0.0, same, summed, in)[0] * 2.0};
       },
       "cond: true_fun returns (f32[4]) but false_fun returns (f32[])"}};
  for (const auto& [f, message] : indexed) EXPECT_THAT(trace_error(f), HasSubstr(message));
}

// ---- checkpoint (remat) ----------------------------------------------------------------------

// Four blocks of three tanh layers on a (64, 64) activation. Without checkpoint, grad keeps
// every layer's output from the forward pass for the backward one; with each block under
// checkpoint it keeps only the blocks' inputs and recomputes a block's layers inside its
// backward (jax.checkpoint's documented trade: jax/_src/ad_checkpoint.py).
constexpr int64_t kWide = 64;
Value block(const Value& h, const Value& w) {
  Value x = h;
  for (int l = 0; l < 3; ++l) x = tanh(matmul(x, w) * 0.125 + x);
  return x;
}
TracedFunction blocks_loss(bool remat, CheckpointPolicy policy = nullptr) {
  return [remat, policy](const std::vector<Value>& in) {
    Value h = in[0];
    for (int k = 0; k < 4; ++k) {
      const Value w = in[1 + k];
      h = remat ? checkpoint([](const std::vector<Value>& a) { return std::vector<Value>{block(a[0], a[1])}; },
                             policy)({h, w})[0]
                : block(h, w);
    }
    return std::vector<Value>{sum(h * h)};
  };
}

TEST_F(MeshesSuite, CheckpointGivesTheSameGradientsAndKeepsLessForTheBackwardPass) {
  ASSERT_NE(client_, nullptr);
  std::mt19937 rng(23);
  std::vector<HostArray> args;
  for (int k = 0; k < 5; ++k) args.push_back(random_array(DType::kF32, {kWide, kWide}, Domain::kSigned, rng));
  std::vector<const HostArray*> inputs;
  for (const HostArray& a : args) inputs.push_back(&a);
  for (size_t m = 0; m < auto_meshes_.size(); ++m) {
    SCOPED_TRACE(test_meshes()[m].name);
    const std::string first = test_meshes()[m].axes.front();
    std::vector<PartitionSpec> specs = {P(first, None), P(), P(), P(), P()};
    const std::vector<HostArray> with = values_and_grads(*client_, auto_meshes_[m], blocks_loss(true), inputs, specs);
    const std::vector<HostArray> without =
        values_and_grads(*client_, auto_meshes_[m], blocks_loss(false), inputs, specs);
    const std::vector<HostArray> dots = values_and_grads(
        *client_, auto_meshes_[m], blocks_loss(true, checkpoint_policies::dots_saveable), inputs, specs);
    ASSERT_EQ(with.size(), 6u);
    ASSERT_EQ(without.size(), 6u);
    ASSERT_EQ(dots.size(), 6u);
    for (size_t i = 0; i < with.size(); ++i) {
      EXPECT_TRUE(results_match(with[i], without[i], 1e-4)) << "output " << i;
      EXPECT_TRUE(results_match(dots[i], without[i], 1e-4)) << "output " << i << " (dots_saveable)";
    }
  }
  // The compiler's accounting (worker/plan_peak.h's peak_memory): what a device holds at
  // the program's peak, the residuals kept for the backward pass included.
  std::vector<ArrayType> types(5, {DType::kF32, {kWide, kWide}});
  auto peak = [&](bool remat, CheckpointPolicy policy = nullptr) -> int64_t {
    absl::StatusOr<Executable> exe = compile(value_and_grad(blocks_loss(remat, std::move(policy)), {0, 1, 2, 3, 4}),
                                             types, {P("data", None), P(), P(), P(), P()});
    EXPECT_TRUE(exe.ok()) << exe.status();
    if (!exe.ok()) return 0;
    std::vector<std::shared_ptr<const HostArray>> in;
    for (int k = 0; k < 5; ++k) {
      in.push_back(std::make_shared<HostArray>(DType::kF32, k == 0 ? Shape{kWide / 4, kWide} : Shape{kWide, kWide}));
    }
    return peak_memory(exe->program, in).bytes;
  };
  const int64_t kept = peak(false), recomputed = peak(true);
  const int64_t dots = peak(true, checkpoint_policies::dots_saveable);  // keeps the twelve matmuls' results
  RecordProperty("peak_bytes_with_dots_saveable", std::to_string(dots));
  RecordProperty("peak_bytes_without_checkpoint", std::to_string(kept));
  RecordProperty("peak_bytes_with_checkpoint", std::to_string(recomputed));
  // Twelve layer outputs of a (16, 64) block each (4 KiB) kept without checkpoint; with it,
  // the four block inputs and one block's layers at a time.
  EXPECT_LT(recomputed, kept) << recomputed << " vs " << kept;
  EXPECT_LE(recomputed + 4 * 4096, kept) << recomputed << " vs " << kept;
  EXPECT_GT(dots, recomputed) << dots << " vs " << recomputed;
  EXPECT_LE(dots, kept) << dots << " vs " << kept;
}

// A saving policy keeps what it names for the backward pass (jax.checkpoint_policies,
// jax/_src/ad_checkpoint.py: dots_saveable keeps every dot_general's result,
// dots_with_no_batch_dims_saveable those without batch dimensions, everything_saveable all):
// the backward branch computes them no more. The block: a matmul (no batch dimensions), a
// tanh, a batched dot_general of the tanh with itself, a tanh. Its VJP needs four dots (two
// per dot_general) whatever the policy; what is not kept is computed again before them.
// The gradients' values: grad_test's checkpoint_* cases (against central differences).
TEST(CheckpointPlan, APolicyKeepsWhatItNamesAndTheBackwardComputesItNoMore) {
  const TracedFunction block = [](const std::vector<Value>& a) {
    const Value h = reshape(tanh(matmul(a[0], a[1])), {2, 4, 8});
    return std::vector<Value>{tanh(dot_general(h, h, DotDims{{0}, {0}, {2}, {2}}))};
  };
  struct Expect {
    const char* name;
    CheckpointPolicy policy;
    int backward_dots, backward_tanhs;
  };
  const std::vector<Expect> expect = {
      {"nothing_saveable", checkpoint_policies::nothing_saveable, 4 + 2, 2},
      {"dots_with_no_batch_dims_saveable", checkpoint_policies::dots_with_no_batch_dims_saveable, 4 + 1, 2},
      {"dots_saveable", checkpoint_policies::dots_saveable, 4, 2},
      {"everything_saveable", checkpoint_policies::everything_saveable, 4, 0},
  };
  for (const Expect& e : expect) {
    SCOPED_TRACE(e.name);
    absl::StatusOr<Executable> exe =
        compile(value_and_grad(
                    [&](const std::vector<Value>& in) {
                      return std::vector<Value>{sum(checkpoint(block, e.policy)({in[0], in[1]})[0])};
                    },
                    {0, 1}),
                {{DType::kF32, {8, 8}}, {DType::kF32, {8, 8}}}, {P(), P()});
    ASSERT_TRUE(exe.ok()) << exe.status();
    std::vector<const Instruction*> switches;
    for (const Instruction& i : exe->program.code) {
      if (i.kind == Instruction::Kind::kSwitch) switches.push_back(&i);
    }
    ASSERT_EQ(switches.size(), 2u) << "the checkpoint and its backward\n" << exe->as_text();
    EXPECT_EQ(kernels_of(*switches[0]->branches[0], Op::kDotGeneral), 2) << exe->as_text();
    EXPECT_EQ(kernels_of(*switches[1]->branches[0], Op::kDotGeneral), e.backward_dots) << exe->as_text();
    EXPECT_EQ(kernels_of(*switches[1]->branches[0], Op::kTanh), e.backward_tanhs) << exe->as_text();
  }
}

}  // namespace
}  // namespace tessera

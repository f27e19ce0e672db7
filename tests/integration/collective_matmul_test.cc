// The collective matmuls of JAX's shard_map notebook (docs/notebooks/shard_map.md, "Matrix
// multiplies": matmul_allgather_overlapped, matmul_allgather_overlapped_bidi,
// matmul_psumscatter_overlapped) and example_shard_map's ring (c), as examples/collective_matmul.h
// writes them (a fori_loop over the ring steps, ppermute, dynamic_slice / dynamic_update_slice at
// (axis_index +- i) % n) on Client::local(8): the values against lhs @ rhs computed on the host
// in double, on a ring of 8 and over each axis of the (4, 2) mesh; the compiled program's shape
// (one loop whose body holds the ppermute(s), a size that does not grow with the ring), as
// control_test's ScanPlan.OneLoopWhoseBodyHoldsTheCollectivesAndWhoseSizeIgnoresTheLength
// checks scan's; and the gradient through the loop and its ppermutes against the host's.
#include "examples/collective_matmul.h"

#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/propagate.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tessera/tessera.h"
#include "tests/integration/jit_support.h"
#include "tests/support/plan_matchers.h"

namespace tessera {
namespace {

using jit_support::LocalJitSuite;
using jit_support::matmul_ref;
using jit_support::random_f32;
using ::tessera::testing::collectives;
using ::tessera::testing::the_loop;
using Body = std::vector<Value> (*)(const std::vector<Value>&, const std::string&);

struct Form {
  std::string name;
  Body body;
  // The specs over the ring's axis `a`: lhs, rhs, result.
  PartitionSpec (*lhs)(const std::string& a), (*rhs)(const std::string& a), (*out)(const std::string& a);
  int ppermutes_per_step;
  // Bytes a device receives per step on compile_on_ring's (5n, 6n) @ (6n, 7n), over n: the moving
  // block's, f32 (ring_gather_lhs lhs's rows 5 x 6n, allgather rhs's 6 x 7n, bidi two halves 3 x
  // 7n, psumscatter the partial sums 5 x 7n).
  int64_t step_bytes_per_n;
};

PartitionSpec rows(const std::string& a) { return P(a, None); }
PartitionSpec cols(const std::string& a) { return P(None, a); }

// The notebook's matmul_allgather_overlapped as it writes it, a Python loop over the ring steps
// (here a C++ loop): the unrolled form whose program grows with the ring.
std::vector<Value> allgather_overlapped_unrolled(const std::vector<Value>& in, const std::string& axis) {
  const int64_t n = axis_size(axis);
  const Value idx = axis_index(axis);
  const int64_t b = in[0].shape()[1] / n;
  const auto lhs_blocks = [&](const Value& i) { return collective_matmul::slice_in_dim(in[0], i * b, b, 1); };
  Value rhs_block = in[1];
  Value out = matmul(lhs_blocks(idx), rhs_block);
  for (int64_t i = 1; i < n; ++i) {
    rhs_block = ppermute(rhs_block, axis, collective_matmul::shift(n, 1));
    out = out + matmul(lhs_blocks((idx - i) % n), rhs_block);
  }
  return {out};
}

const std::vector<Form>& forms() {
  static const std::vector<Form> all = {
      {"ring_gather_lhs", collective_matmul::ring_gather_lhs, rows, cols, cols, 1, 5 * 6 * 4},
      {"allgather_overlapped", collective_matmul::allgather_overlapped, rows, rows, rows, 1, 6 * 7 * 4},
      {"allgather_overlapped_bidi", collective_matmul::allgather_overlapped_bidi, rows, rows, rows, 2, 2 * 3 * 7 * 4},
      {"psumscatter_overlapped", collective_matmul::psumscatter_overlapped, cols, rows, rows, 1, 5 * 7 * 4},
  };
  return all;
}

// M x K @ K x N with M, N divisible by 8 and K by 16 (the bidirectional form's half blocks).
constexpr int64_t kM = 32, kK = 16, kN = 8;

class CollectiveMatmulTest : public LocalJitSuite {};

// Each form on the ring of 8 devices and over 'data' (4) and 'model' (2) of the (4, 2) mesh,
// the body manual over both axes and its values replicated over the other one.
TEST_F(CollectiveMatmulTest, EveryFormIsTheHostProductOnEveryRing) {
  absl::StatusOr<Mesh> ring8 = client_->make_mesh({8}, {"x"});
  ASSERT_TRUE(ring8.ok()) << ring8.status();
  const HostArray lhs = random_f32({kM, kK}, 1), rhs = random_f32({kK, kN}, 2);
  const std::vector<double> want = matmul_ref(lhs, rhs);
  std::vector<Form> all = forms();
  all.push_back({"allgather_overlapped_unrolled", allgather_overlapped_unrolled, rows, rows, rows, 1, 6 * 7 * 4});
  for (const auto& [mesh, axis] :
       std::vector<std::pair<Mesh, std::string>>{{*ring8, "x"}, {*mesh_, "data"}, {*mesh_, "model"}}) {
    for (const Form& form : all) {
      SCOPED_TRACE(absl::StrCat(form.name, " over '", axis, "' of ", mesh.to_string()));
      const Body body = form.body;
      const std::string a = axis;
      ShardMapped f = shard_map([body, a](const std::vector<Value>& in) { return body(in, a); }, mesh,
                                {form.lhs(axis), form.rhs(axis)}, {form.out(axis)});
      absl::StatusOr<std::vector<Array>> out =
          f({put_on(mesh, lhs, form.lhs(axis)), put_on(mesh, rhs, form.rhs(axis))});
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ((*out)[0].sharding().spec(), form.out(axis));
      jit_support::expect_near(fetch((*out)[0]), want, 1e-5);
      EXPECT_THAT(f.as_text(), ::testing::HasSubstr("collective_permute("));
    }
  }
}

// Shapes the notebook's Python refuses fail the trace naming the size, not a floor division's
// silently short result: bidi splits each device's rhs block in two (jnp.split(rhs_block, 2):
// K = 8 on 8 devices gives blocks of 1 row), psumscatter reshapes lhs into n row blocks
// (lhs_block.reshape(size, -1, K): M = 12 over 8).
TEST_F(CollectiveMatmulTest, ShapesTheNotebookRefusesFailTheTraceNamingTheSize) {
  absl::StatusOr<Mesh> ring8 = client_->make_mesh({8}, {"x"});
  ASSERT_TRUE(ring8.ok()) << ring8.status();
  struct Case {
    Body body;
    Shape lhs, rhs;
    PartitionSpec lhs_spec, rhs_spec, out_spec;
    std::string message;
  };
  const std::vector<Case> cases = {
      {collective_matmul::allgather_overlapped_bidi,
       {16, 8},
       {8, 8},
       rows("x"),
       rows("x"),
       rows("x"),
       "allgather_overlapped_bidi: lhs's block's columns is 8, not divisible into 16 equal blocks over 'x'"},
      {collective_matmul::psumscatter_overlapped,
       {12, 16},
       {16, 8},
       cols("x"),
       rows("x"),
       rows("x"),
       "psumscatter_overlapped: lhs's rows is 12, not divisible into 8 equal blocks over 'x'"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    const Body body = c.body;
    ShardMapped f = shard_map([body](const std::vector<Value>& in) { return body(in, "x"); }, *ring8,
                              {c.lhs_spec, c.rhs_spec}, {c.out_spec});
    absl::StatusOr<std::vector<Array>> out =
        f({put_on(*ring8, random_f32(c.lhs, 3), c.lhs_spec), put_on(*ring8, random_f32(c.rhs, 4), c.rhs_spec)});
    ASSERT_FALSE(out.ok());
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << out.status();
    EXPECT_THAT(out.status().message(), ::testing::HasSubstr(c.message));
  }
}

// The program of `f` compiled for a ring of n devices 'x' (as control_test's compile), on
// (5n, 6n) @ (6n, 7n): each device's blocks have 5, 6 or 7 rows (the half block 3) on every
// ring, constants no ring length equals (a block size equal to n would share
// its constant, and the plans of rings of 4 and 8 would differ by that alone).
absl::StatusOr<Executable> compile_on_ring(int64_t n, Body body) {
  std::vector<int> ids(n);
  for (int i = 0; i < n; ++i) ids[i] = i;
  TESSERA_ASSIGN_OR_RETURN(Mesh mesh, make_mesh({n}, {"x"}, ids));
  const Form* form = nullptr;
  for (const Form& f : forms()) form = f.body == body ? &f : form;
  const Form unrolled{"", body, rows, rows, rows, 1, 6 * 7 * 4};
  if (form == nullptr) form = &unrolled;
  ShardMapped f = shard_map([body](const std::vector<Value>& in) { return body(in, "x"); }, mesh,
                            {form->lhs("x"), form->rhs("x")}, {form->out("x")});
  TESSERA_ASSIGN_OR_RETURN(Graph g, trace([f](const std::vector<Value>& in) { return f(in); },
                                          {{DType::kF32, {5 * n, 6 * n}}, {DType::kF32, {6 * n, 7 * n}}}));
  std::vector<std::optional<PartitionSpec>> outputs(g.outputs().size());
  TESSERA_ASSIGN_OR_RETURN(Propagation p, propagate(g, mesh, {form->lhs("x"), form->rhs("x")}, outputs));
  return partition(g, mesh, p, outputs);
}

int loops(const DevicePlan& plan) {
  int n = 0;
  for (const Instruction& i : plan.code) n += i.kind == Instruction::Kind::kLoop ? 1 : 0;
  return n;
}

// One loop of n - 1 iterations whose body holds the step's ppermute(s) and nothing else moving
// outside it; the program's size the same on rings of 4 and 8. The notebook's unrolled form
// (a C++ loop of ppermutes) has n - 1 ppermutes in straight-line code and grows with the ring:
// the same assertions fail on it.
TEST_F(CollectiveMatmulTest, OneLoopWhoseBodyHoldsThePpermutesAndWhoseSizeIgnoresTheRing) {
  for (const Form& form : forms()) {
    SCOPED_TRACE(form.name);
    absl::StatusOr<Executable> four = compile_on_ring(4, form.body), eight = compile_on_ring(8, form.body);
    ASSERT_TRUE(four.ok()) << four.status();
    ASSERT_TRUE(eight.ok()) << eight.status();
    for (const auto& [n, exe] : std::vector<std::pair<int64_t, const Executable*>>{{4, &*four}, {8, &*eight}}) {
      const Instruction* loop = the_loop(exe->program);
      ASSERT_NE(loop, nullptr) << exe->as_text();
      EXPECT_EQ(loops(exe->program), 1) << exe->as_text();
      EXPECT_EQ(loop->trip_count, n - 1);
      EXPECT_EQ(collectives(*loop->body), form.ppermutes_per_step) << exe->as_text();
      for (const Instruction& i : loop->body->code) {
        if (i.kind == Instruction::Kind::kCollective) {
          EXPECT_EQ(i.collective.kind, CollectiveKind::kCollectivePermute) << exe->as_text();
        }
      }
      EXPECT_EQ(collectives(exe->program), 0) << exe->as_text();
      // The block that moves, not the accumulator or all of an operand.
      EXPECT_EQ(collective_bytes_per_device(*loop->body, exe->mesh), form.step_bytes_per_n * n) << exe->as_text();
    }
    EXPECT_EQ(plan_size(four->program), plan_size(eight->program)) << four->as_text() << eight->as_text();
    std::printf("%s: plan_size %ld on a ring of 4, %ld on a ring of 8 (%zu top-level instructions, %zu in the body)\n",
                form.name.c_str(), static_cast<long>(plan_size(four->program)),
                static_cast<long>(plan_size(eight->program)), eight->program.code.size(),
                the_loop(eight->program)->body->code.size());
  }
  // The unrolled form, for the record: no loop, n - 1 ppermutes, a program growing with n.
  absl::StatusOr<Executable> four = compile_on_ring(4, allgather_overlapped_unrolled),
                             eight = compile_on_ring(8, allgather_overlapped_unrolled);
  ASSERT_TRUE(four.ok()) << four.status();
  ASSERT_TRUE(eight.ok()) << eight.status();
  EXPECT_EQ(collectives(four->program), 3);
  EXPECT_EQ(collectives(eight->program), 7);
  EXPECT_LT(plan_size(four->program), plan_size(eight->program));
  std::printf("allgather_overlapped unrolled: plan_size %ld on a ring of 4, %ld on a ring of 8\n",
              static_cast<long>(plan_size(four->program)), static_cast<long>(plan_size(eight->program)));
}

// grad of sum(w * (lhs @ rhs)) through each form (the fori_loop's scan VJP, ppermute's transpose
// the reverse permutation, dynamic_slice's a dynamic_update_slice of zeros): d lhs = w @ rhs^T and
// d rhs = lhs^T @ w, on the host in double. The notebook does not differentiate these; JAX's
// rules for the parts are in jax/_src/lax/parallel.py (_ppermute_transpose_rule) and
// jax/_src/lax/slicing.py (_dynamic_slice_transpose_rule).
TEST_F(CollectiveMatmulTest, GradientsAreTheHostProductsOfTheCotangent) {
  absl::StatusOr<Mesh> ring8 = client_->make_mesh({8}, {"x"});
  ASSERT_TRUE(ring8.ok()) << ring8.status();
  const HostArray lhs = random_f32({kM, kK}, 3), rhs = random_f32({kK, kN}, 4), w = random_f32({kM, kN}, 5);
  std::vector<double> dlhs(kM * kK, 0.0), drhs(kK * kN, 0.0);
  for (int64_t i = 0; i < kM; ++i) {
    for (int64_t j = 0; j < kN; ++j) {
      const double wij = w.values<float>()[i * kN + j];
      for (int64_t p = 0; p < kK; ++p) {
        dlhs[i * kK + p] += wij * rhs.values<float>()[p * kN + j];
        drhs[p * kN + j] += wij * lhs.values<float>()[i * kK + p];
      }
    }
  }
  for (const auto& [mesh, axis] : std::vector<std::pair<Mesh, std::string>>{{*ring8, "x"}, {*mesh_, "data"}}) {
    for (const Form& form : forms()) {
      SCOPED_TRACE(absl::StrCat(form.name, " over '", axis, "'"));
      const Body body = form.body;
      const std::string a = axis;
      const ShardMapped f = shard_map([body, a](const std::vector<Value>& in) { return body(in, a); }, mesh,
                                      {form.lhs(axis), form.rhs(axis)}, {form.out(axis)});
      Jitted g = jit(grad(
          [f](const std::vector<Value>& in) {
            return std::vector<Value>{sum(f({in[0], in[1]})[0] * in[2])};
          },
          {0, 1}));
      absl::StatusOr<std::vector<Array>> out =
          g({put_on(mesh, lhs, form.lhs(axis)), put_on(mesh, rhs, form.rhs(axis)), put_on(mesh, w, form.out(axis))});
      ASSERT_TRUE(out.ok()) << out.status();
      ASSERT_EQ(out->size(), 2u);
      jit_support::expect_near(fetch((*out)[0]), dlhs, 1e-5);
      jit_support::expect_near(fetch((*out)[1]), drhs, 1e-5);
    }
  }
}

}  // namespace
}  // namespace tessera

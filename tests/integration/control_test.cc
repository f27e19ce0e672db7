// Control flow on Client::local(8): scan (jax.lax.scan, jax/_src/lax/control_flow/loops.py's
// documented semantics) against the host reference — which runs the body graph once per row
// on the host (tests/support/host_eval.cc), nothing of the plan's loop — and against the same
// function unrolled into straight-line code, on the (8), (4, 2) and (2, 4) meshes with carries
// split and replicated; the compiled loop's shape (one loop instruction, the body's
// collectives inside it, the program's size independent of the length); and errors.
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
#include "tests/support/host_eval.h"
#include "tests/support/jit_check.h"

namespace tessera {
namespace {

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
  const Mesh& mesh = meshes_[c.mesh];
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

const Instruction* the_loop(const DevicePlan& plan) {
  const Instruction* found = nullptr;
  for (const Instruction& i : plan.code) {
    if (i.kind == Instruction::Kind::kLoop) found = &i;
  }
  return found;
}

int collectives(const DevicePlan& plan) {
  int n = 0;
  for (const Instruction& i : plan.code) n += i.kind == Instruction::Kind::kCollective ? 1 : 0;
  return n;
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
  EXPECT_EQ(loop->extra_out.size(), 3u) << "the four results of one scan come from one loop";
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
  rejects([](pb::Instruction* i) { i->add_in(i->in(0)); }, "its body takes 3");
  rejects([](pb::Instruction* i) { *i->add_out_types() = i->out_types(0); },
          "writes 4 slots of 5 types; its body returns 4");
  rejects([](pb::Instruction* i) { i->mutable_out_types(0)->set_dtype(static_cast<pb::DType>(77)); },
          "result 0: dtype 77");
}

TEST_F(MeshesSuite, ScanOfLengthZeroAndFewerErrors) {
  ASSERT_NE(client_, nullptr);
  const Mesh& mesh = meshes_[1];
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
  for (size_t m = 0; m < meshes_.size(); ++m) {
    SCOPED_TRACE(test_meshes()[m].name);
    const std::string first = test_meshes()[m].axes.front(), last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(first, None), P(last, None), P(None, None, last), P(last)};
    absl::StatusOr<JitCheck> loop = run_against_host(
        *client_, meshes_[m], [](const std::vector<Value>& in) { return closure(in, true); }, inputs, specs);
    ASSERT_TRUE(loop.ok()) << loop.status();
    absl::StatusOr<JitCheck> flat = run_against_host(
        *client_, meshes_[m], [](const std::vector<Value>& in) { return closure(in, false); }, inputs, specs);
    ASSERT_TRUE(flat.ok()) << flat.status();
    for (size_t i = 0; i < loop->got.size(); ++i) {
      EXPECT_TRUE(results_match(loop->got[i], loop->want[i], kF32Tolerance)) << "against the host loop " << i;
      EXPECT_TRUE(results_match(loop->got[i], flat->got[i], kF32Tolerance)) << "against the unrolled program " << i;
    }
    EXPECT_THAT(loop->plan_text, HasSubstr("loop("));
    const std::vector<HostArray> g = values_and_grads(*client_, meshes_[m], loss(true), inputs, specs);
    const std::vector<HostArray> want = values_and_grads(*client_, meshes_[m], loss(false), inputs, specs);
    ASSERT_EQ(g.size(), 5u);
    ASSERT_EQ(want.size(), 5u);
    for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(results_match(g[i], want[i], 1e-4)) << "gradient output " << i;
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
  for (size_t m = 0; m < meshes_.size(); ++m) {
    const std::string last = test_meshes()[m].axes.back();
    const std::vector<PartitionSpec> specs = {P(None, last), P(last, None), P(None, None, last)};
    std::vector<std::vector<HostArray>> got(2);
    for (bool loop : {true, false}) {
      SCOPED_TRACE(absl::StrCat(test_meshes()[m].name, loop ? " scan" : " unrolled"));
      std::vector<Array> args;
      for (size_t i = 0; i < 3; ++i) {
        absl::StatusOr<Array> a =
            client_->device_put(*std::vector<const HostArray*>{&h, &w, &xs}[i], NamedSharding(meshes_[m], specs[i]));
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
// before every iteration.
TEST_F(MeshesSuite, ALongLoopEndsAtItsRunsDeadline) {
  ASSERT_NE(client_, nullptr);
  HostArray x = HostArray::zeros(DType::kF32, {8});
  absl::StatusOr<Array> a = client_->device_put(x, NamedSharding(meshes_[0], P("data")));
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
  EXPECT_THAT(s.message(), HasSubstr("the run's deadline passed at iteration")) << s;
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
  for (size_t m = 0; m < meshes_.size(); ++m) {
    const std::string first = test_meshes()[m].axes.front();
    absl::StatusOr<JitCheck> loop = run_against_host(
        *client_, meshes_[m],
        [&](const std::vector<Value>& in) {
          return std::vector<Value>{fori_loop(2, 7, step, {in[0], in[1]})[0], fori_loop(3, 1, step, {in[0], in[1]})[0]};
        },
        {&h, &w}, {P(first, None), P()});
    ASSERT_TRUE(loop.ok()) << loop.status();
    absl::StatusOr<JitCheck> flat = run_against_host(*client_, meshes_[m],
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

}  // namespace
}  // namespace tessera

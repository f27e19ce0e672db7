// Partitioning: the one SPMD program of a traced function — local shapes, the collectives each
// layout implies (and only those) over mesh axes, local slices between layouts, frees after
// last use — and each device's resolution of it (replica groups, slice offsets, pairs).
#include "coordinator/compiler/partition.h"

#include <algorithm>
#include <functional>
#include <set>

#include "absl/strings/str_cat.h"
#include "coordinator/compiler/rules.h"
#include "core/plan.h"
#include "core/status.h"
#include "core/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"
#include "tessera/grad.h"
#include "tessera/random.h"
#include "tessera/trace.h"
#include "tests/support/plan_matchers.h"

namespace tessera {
namespace {

using ::tessera::testing::collectives_of;
using ::tessera::testing::IsCollective;
using ::tessera::testing::resolved_groups;
using ::tessera::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;

class PartitionTest : public ::testing::Test {
 protected:
  Mesh mesh_ = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});

  Executable compile(const TracedFunction& f, const std::vector<ArrayType>& types,
                     const std::vector<PartitionSpec>& specs, std::vector<std::optional<PartitionSpec>> outputs = {},
                     const std::vector<int>& donated = {}) {
    absl::StatusOr<Graph> g = trace(f, types);
    EXPECT_TRUE(g.ok()) << g.status();
    if (outputs.empty()) outputs.resize(g->outputs().size());
    absl::StatusOr<Propagation> p = propagate(*g, mesh_, specs, outputs);
    EXPECT_TRUE(p.ok()) << p.status();
    absl::StatusOr<Executable> exe = partition(*g, mesh_, *p, outputs, donated);
    EXPECT_TRUE(exe.ok()) << exe.status();
    check_frees(*exe);
    return *std::move(exe);
  }

  // Every slot but outputs and the inputs not donated is freed exactly once, after its last
  // use; every device of the mesh resolves the program.
  void check_frees(const Executable& exe) {
    for (int d : mesh_.device_ids()) {
      absl::StatusOr<DevicePlan> resolved = resolve(exe.program, exe.mesh, d);
      ASSERT_TRUE(resolved.ok()) << resolved.status();
      EXPECT_EQ(resolved->device, d);
    }
    for (const DevicePlan& plan : {exe.program}) {
      std::set<int> kept(plan.output_slots.begin(), plan.output_slots.end());
      for (size_t i = 0; i < plan.input_slots.size(); ++i) {
        if (std::count(plan.donated_inputs.begin(), plan.donated_inputs.end(), static_cast<int>(i)) == 0) {
          kept.insert(plan.input_slots[i]);
        }
      }
      std::set<int> freed;
      for (const Instruction& i : plan.code) {
        if (i.kind == Instruction::Kind::kFree) {
          EXPECT_TRUE(freed.insert(i.in[0]).second) << "slot freed twice";
          EXPECT_EQ(kept.count(i.in[0]), 0u) << "an output or a caller's input slot was freed";
          continue;
        }
        for (int s : i.in) EXPECT_EQ(freed.count(s), 0u) << "slot used after it was freed";
      }
      for (int s = 0; s < plan.num_slots; ++s) {
        if (kept.count(s) == 0) {
          EXPECT_EQ(freed.count(s), 1u) << "slot s" << s << " never freed";
        }
      }
    }
  }

  static int count(const Executable& exe, Instruction::Kind kind) {
    int n = 0;
    for (const Instruction& i : exe.program.code) n += i.kind == kind ? 1 : 0;
    return n;
  }
};

std::vector<Value> seed(const std::vector<Value>& in) { return {tanh(matmul(in[0], in[1]))}; }

TEST_F(PartitionTest, SeedLayerIsPurelyLocal) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", None), P(None, "model")});
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 0);
  EXPECT_EQ(exe.output_specs[0], P("data", "model"));
  const std::string text = exe.as_text();
  EXPECT_THAT(text,
              HasSubstr("program on Mesh('data': 4, 'model': 2, axis_types=(Explicit, Explicit)) (8 devices, each "
                        "resolves it for its position): "
                        "0 collectives, 0 bytes received per device\n"));
  EXPECT_THAT(text, HasSubstr("s2 = dot_general(s0, s1) f32[4,2]  ; %2 = dot_general"));
  EXPECT_THAT(text, HasSubstr("s3 = tanh(s2) f32[4,2]  ; %3 = tanh"));
  EXPECT_THAT(text, HasSubstr("free s2"));
}

TEST_F(PartitionTest, ShardedContractionIsAllReducedBeforeTanh) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)});
  // The (16, 4) partial product %2 summed over 'model': 2 * (2-1)/2 * 256 B per device.
  EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kAllReduce, {"model"}, 2, 256)));
  // Each device resolves the axes to the replica groups of the mesh (a (4, 2) mesh's 'model'
  // pairs: JAX's device order, row-major).
  const std::vector<std::vector<int>> model_pairs = {{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  EXPECT_THAT(resolved_groups(exe, 5), ElementsAre(model_pairs));
}

TEST_F(PartitionTest, PartialResultWantedShardedIsReduceScattered) {
  Executable exe = compile([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
                           {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)},
                           {P(None, "model")});
  EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kReduceScatter, {"model"}, 2, 128)));
  for (const Instruction& i : exe.program.code) {
    if (i.kind == Instruction::Kind::kCollective) {
      EXPECT_EQ(i.collective.dimension, 1) << "scattered along columns";
    }
  }
  const std::vector<std::vector<int>> model_pairs = {{0, 1}, {2, 3}, {4, 5}, {6, 7}};
  EXPECT_THAT(resolved_groups(exe, 0), ElementsAre(model_pairs));
}

TEST_F(PartitionTest, ReplicatedOperandIsSlicedLocallyPerDevice) {
  Executable exe = compile([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; },
                           {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}}, {P("data", None), P()});
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 0);
  EXPECT_THAT(exe.as_text(), HasSubstr("= local_slice(P(None, None) -> P('data', None)) s1 f32[4,8]"));
  // Device d sits at data = d / 2 and keeps rows 4*(d/2) : 4*(d/2)+4 of the replicated operand.
  for (int d = 0; d < 8; ++d) {
    absl::StatusOr<DevicePlan> plan = resolve(exe.program, exe.mesh, d);
    ASSERT_TRUE(plan.ok()) << plan.status();
    int found = 0;
    for (const Instruction& i : plan->code) {
      if (i.kind == Instruction::Kind::kLocalSlice) {
        EXPECT_EQ(i.slice, (Index{{4 * (d / 2), 4 * (d / 2) + 4}, {0, 8}})) << "device " << d;
        ++found;
      }
    }
    EXPECT_EQ(found, 1);
  }
}

// On a mesh whose axes have size 1 every layout is the whole array on the one device: a
// replicated operand of a split one, or a constraint onto a split, emits no local_slice (a
// copy) and no collective (#15).
TEST_F(PartitionTest, AxesOfSizeOneNeedNoReshard) {
  mesh_ = *make_mesh({1, 1}, {"data", "model"}, {0});
  Executable added = compile([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; },
                             {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}}, {P("data", None), P()});
  EXPECT_EQ(count(added, Instruction::Kind::kLocalSlice), 0) << added.as_text();
  EXPECT_EQ(count(added, Instruction::Kind::kCollective), 0) << added.as_text();
  Executable constrained = compile(
      [this](const std::vector<Value>& in) {
        return std::vector<Value>{exp(with_sharding_constraint(in[0], NamedSharding(mesh_, P("data", "model"))))};
      },
      {{DType::kF32, {16, 8}}}, {P()});
  EXPECT_EQ(count(constrained, Instruction::Kind::kLocalSlice), 0) << constrained.as_text();
  EXPECT_EQ(count(constrained, Instruction::Kind::kCollective), 0) << constrained.as_text();
}

TEST_F(PartitionTest, LayoutChangesUseTheirCollectives) {
  auto constrained = [&](PartitionSpec to) {
    return [this, to](const std::vector<Value>& in) {
      return std::vector<Value>{exp(with_sharding_constraint(in[0], NamedSharding(mesh_, to)))};
    };
  };
  Executable moved = compile(constrained(P(None, "data")), {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_THAT(collectives_of(moved), ElementsAre(IsCollective(CollectiveKind::kAllToAll, {"data"}, 0, 3 * 128 / 4)));
  const std::vector<std::vector<int>> data_columns = {{0, 2, 4, 6}, {1, 3, 5, 7}};
  EXPECT_THAT(resolved_groups(moved, 3), ElementsAre(data_columns));
  Executable gathered = compile(constrained(P()), {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_THAT(collectives_of(gathered), ElementsAre(IsCollective(CollectiveKind::kAllGather, {"data"}, 0, 384)));
  EXPECT_THAT(resolved_groups(gathered, 0), ElementsAre(data_columns));
  Executable permuted =
      compile(constrained(P(Axes{"model", "data"})), {{DType::kF32, {16, 8}}}, {P(Axes{"data", "model"})});
  EXPECT_THAT(permuted.as_text(),
              HasSubstr("collective_permute(P(('data', 'model'), None) -> P(('model', 'data'), None))"));
  // Resolved: device t = (i, j) of the (4, 2) mesh holds row block 4j + i under ('model',
  // 'data') (model major), which device 4j + i holds under ('data', 'model') (row-major).
  absl::StatusOr<DevicePlan> resolved = resolve(permuted.program, permuted.mesh, 0);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  std::vector<std::pair<int, int>> want;
  for (int t = 0; t < 8; ++t) want.emplace_back(4 * (t % 2) + t / 2, t);
  for (const Instruction& i : resolved->code) {
    if (i.kind == Instruction::Kind::kCollective) {
      EXPECT_EQ(i.collective.pairs, want);
    }
  }
  EXPECT_TRUE(permuted.log.empty());
  // Swapping the two axes between dimensions gathers 'data' and slices it again: logged.
  Executable swapped = compile(constrained(P("model", "data")), {{DType::kF32, {16, 8}}}, {P("data", "model")});
  ASSERT_EQ(swapped.log.size(), 1u);
  EXPECT_THAT(swapped.log[0], HasSubstr("involuntary full rematerialization: %1 = sharding_constraint"));
}

// An iota split along its counting dimension is built at its (4, 8) block and offset by the
// device's position along 'data' (x 4); one split along another dimension needs no offset.
// Nothing global-sized is ever built (jit_ops_test checks the values on every mesh).
TEST_F(PartitionTest, ShardedIotaIsBuiltAtItsLocalShape) {
  Executable exe = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] + convert(iota(DType::kI32, {16, 8}, 0), DType::kF32)};
      },
      {{DType::kF32, {16, 8}}}, {P("data", None)});
  const std::string text = exe.as_text();
  EXPECT_THAT(text, HasSubstr("= iota() i32[4,8]"));
  EXPECT_THAT(text, HasSubstr("= axis_index(axes=('data',)) i32[]")) << text;
  EXPECT_THAT(text, Not(HasSubstr("[16,8]")));
  EXPECT_EQ(count(exe, Instruction::Kind::kLocalSlice), 0);
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 0);
  Executable other = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] + convert(iota(DType::kI32, {16, 8}, 1), DType::kF32)};
      },
      {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_THAT(other.as_text(), HasSubstr("= iota() i32[4,8]"));
  EXPECT_THAT(other.as_text(), Not(HasSubstr("axis_index")));
}

TEST_F(PartitionTest, DonatedInputsAreFreedAfterTheirLastUse) {
  auto sgd = [](const std::vector<Value>& in) { return std::vector<Value>{in[0] - in[1] * 0.5}; };
  const std::vector<ArrayType> types = {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}};
  Executable kept = compile(sgd, types, {P("data", "model"), P("data", "model")});
  EXPECT_THAT(kept.as_text(), HasSubstr("inputs: s0, s1\n"));
  EXPECT_THAT(kept.as_text(), Not(HasSubstr("free s0")));
  // Donating the parameters: s0 dies at the subtraction (where the worker writes over it).
  Executable donated = compile(sgd, types, {P("data", "model"), P("data", "model")}, {}, {0});
  const std::string text = donated.as_text();
  EXPECT_THAT(text, HasSubstr("inputs: s0 (donated), s1\n"));
  EXPECT_THAT(text, HasSubstr("s4 = sub(s0, s3) f32[4,4]  ; %4 = sub\n  free s0\n"));
  EXPECT_THAT(text, Not(HasSubstr("free s1")));
}

TEST_F(PartitionTest, PlansRoundTripThroughTheWire) {
  Executable exe =
      compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)}, {}, {1});
  Executable back = exe;
  pb::DevicePlan wire;
  to_proto(exe.program, &wire);
  absl::StatusOr<DevicePlan> parsed = plan_from_proto(wire);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  for (size_t i = 0; i < exe.program.code.size(); ++i) parsed->code[i].cause = exe.program.code[i].cause;  // not sent
  back.program = *std::move(parsed);
  EXPECT_EQ(back.as_text(), exe.as_text());
  for (int d = 0; d < 8; ++d) EXPECT_EQ(*back.device_text(d), *exe.device_text(d));
}

TEST_F(PartitionTest, MalformedPlansAreRejected) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", None), P(None, "model")});
  pb::DevicePlan wire;
  to_proto(exe.program, &wire);
  pb::DevicePlan bad = wire;
  bad.mutable_code(0)->set_in(0, 3);  // slot 3 is written later
  EXPECT_THAT(plan_from_proto(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, "before it is written"));
  bad = wire;
  bad.mutable_code(0)->mutable_node()->set_op(999);
  EXPECT_THAT(plan_from_proto(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, "op 999, not a kernel"));
  bad = wire;
  bad.set_num_slots(-1);
  EXPECT_THAT(plan_from_proto(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, "-1 slots is out of range"));
  for (int donated : {2, -1}) {  // the plan has 2 inputs
    bad = wire;
    bad.add_donated_inputs(donated);
    EXPECT_THAT(plan_from_proto(bad).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         absl::StrCat("donated input ", donated, " is not one of the 2 inputs")));
  }
  bad = wire;
  bad.add_donated_inputs(1);
  bad.add_donated_inputs(1);
  EXPECT_THAT(plan_from_proto(bad).status(), StatusIs(absl::StatusCode::kInvalidArgument, "or is named twice"));
}

// What a worker resolves comes from the wire: symbolic parts that do not fit the mesh are
// refused naming the instruction and the device, never trusted.
TEST_F(PartitionTest, ProgramsThatDoNotFitTheMeshAreRefusedWhenResolved) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)});
  auto resolve_wire = [&](const pb::DevicePlan& wire, int device) -> absl::Status {
    TESSERA_ASSIGN_OR_RETURN(DevicePlan program, plan_from_proto(wire));
    return resolve(program, exe.mesh, device).status();
  };
  pb::DevicePlan wire;
  to_proto(exe.program, &wire);
  int collective = -1;
  for (int k = 0; k < wire.code_size(); ++k) {
    if (wire.code(k).kind() == pb::Instruction::COLLECTIVE) collective = k;
  }
  ASSERT_GE(collective, 0);
  EXPECT_TRUE(resolve_wire(wire, 3).ok());
  EXPECT_THAT(resolve_wire(wire, 9), StatusIs(absl::StatusCode::kNotFound, "device 9 is not in the program's mesh"));
  absl::Status s;

  pb::DevicePlan bad = wire;
  bad.mutable_code(collective)->set_axes(0, "nope");
  s = resolve_wire(bad, 3);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                          absl::StrCat("plan: instruction ", collective, " on device 3: ")));
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, "nope"));

  bad = wire;  // a permute whose positions leave the 2 devices of 'model'
  bad.mutable_code(collective)->mutable_collective()->set_kind(pb::COLLECTIVE_PERMUTE);
  bad.mutable_code(collective)->add_positions(0);
  bad.mutable_code(collective)->add_positions(2);
  EXPECT_THAT(resolve_wire(bad, 3),
              StatusIs(absl::StatusCode::kInvalidArgument, "permute position 2 is outside the 2 devices of its axes"));

  bad = wire;  // a relayout onto a spec that does not divide the value
  pb::Relayout* r = bad.mutable_code(collective)->mutable_relayout();
  r->mutable_shape()->add_dims(3);
  r->mutable_to()->add_dims()->add_axes("data");
  bad.mutable_code(collective)->mutable_collective()->set_kind(pb::COLLECTIVE_PERMUTE);
  EXPECT_THAT(resolve_wire(bad, 3), StatusIs(absl::StatusCode::kInvalidArgument, "plan: instruction"));
}

// The passes after partitioning (coordinator/compiler/passes/): each program is checked for
// what it must and must not contain; jit_test runs the same kinds of programs against host
// computations.
int count_text(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_F(PartitionTest, NothingThatReachesNoOutputIsComputed) {
  // grad with respect to w only: the cotangent of x (g @ w^T) is never asked for.
  auto loss = [](const std::vector<Value>& in) { return std::vector<Value>{sum(tanh(matmul(in[0], in[1])))}; };
  Executable exe = compile(grad(loss, {1}), {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", None), P()});
  const std::string text = exe.as_text();
  EXPECT_EQ(count_text(text, "= dot_general("), 2) << text;  // forward x @ w and dw = x^T @ g, not dx
  // A value computed and dropped.
  Executable dropped = compile(
      [](const std::vector<Value>& in) {
        Value unused = exp(in[0]) * 3.0;
        (void)unused;
        return std::vector<Value>{in[0] * 2.0};
      },
      {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_THAT(dropped.as_text(), Not(HasSubstr("exp(")));
  EXPECT_EQ(count(dropped, Instruction::Kind::kKernel), 2);  // the constant 2 and the mul
}

TEST_F(PartitionTest, IdenticalReshardsAndKernelsRunOnce) {
  // concatenate({x, x}) along the split rows needs x whole twice: one all_gather serves both.
  Executable exe = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{concatenate({in[0], in[0]}, 0)};
      },
      {{DType::kF32, {16, 8}}}, {P("data", None)}, {P()});
  EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kAllGather, {"data"}, 0, 384)));
  // The same expression written twice is computed once.
  Executable twice =
      compile([](const std::vector<Value>& in) { return std::vector<Value>{exp(in[0] * 2.0) + exp(in[0] * 2.0)}; },
              {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_EQ(count_text(twice.as_text(), "= exp("), 1) << twice.as_text();
  EXPECT_EQ(count_text(twice.as_text(), "= mul("), 1) << twice.as_text();
  // Equal ops on different inputs, or with different attributes, stay apart.
  Executable apart = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{exp(in[0]) + exp(in[1]), sum(in[0], {0}) + sum(in[0], {1})};
      },
      {{DType::kF32, {8, 8}}, {DType::kF32, {8, 8}}}, {P(), P()});
  EXPECT_EQ(count_text(apart.as_text(), "= exp("), 2);
  EXPECT_EQ(count_text(apart.as_text(), "= reduce_sum("), 2);
}

// The compiler's own byte accounting, against the algorithms' definitions (nccl-tests'
// PERFORMANCE.md: all-reduce moves 2(n-1)/n of the buffer, all-gather (n-1)/n of the result).
TEST_F(PartitionTest, CollectivesCountTheBytesEachDeviceReceives) {
  // x (16, 8) P('data', None) gathered whole: each device receives 3/4 of 512 B.
  Executable gathered = compile(
      [this](const std::vector<Value>& in) {
        return std::vector<Value>{exp(with_sharding_constraint(in[0], NamedSharding(mesh_, P())))};
      },
      {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_EQ(collective_bytes_per_device(gathered.program, gathered.mesh), 3 * 512 / 4);
  EXPECT_THAT(gathered.as_text(), HasSubstr("1 collective, 384 bytes received per device"));
  // A (16, 4) partial product summed over 'model' (2 devices): 2 * 1/2 * 256 B.
  Executable reduced =
      compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)});
  EXPECT_EQ(collective_bytes_per_device(reduced.program, reduced.mesh), 256);
}

// Data parallelism: every parameter's gradient is summed over 'data'. The combiner sends them
// as one all_reduce (XLA's AllReduceCombiner); a larger-than-threshold one still goes alone.
TEST_F(PartitionTest, IndependentAllReducesAreCombined) {
  auto loss = [](const std::vector<Value>& in) {
    return std::vector<Value>{sum(tanh(matmul(tanh(matmul(in[2], in[0])), in[1])))};
  };
  const std::vector<ArrayType> types = {{DType::kF32, {8, 16}}, {DType::kF32, {16, 4}}, {DType::kF32, {32, 8}}};
  Executable exe = compile(grad(loss, {0, 1}), types, {P(), P(), P("data", None)});
  const std::string text = exe.as_text();
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 1) << text;
  EXPECT_THAT(text, HasSubstr("= all_reduce(sum, axes=('data',)) s"));
  EXPECT_THAT(text,
              HasSubstr("f32[192] 1152B/device  ; combined 2 all_reduces"));  // 8*16 + 16*4 elements, 2*3/4 of 768 B
  // Each gradient comes back out in its own shape.
  EXPECT_THAT(text, HasSubstr("= reshape(")) << text;
  EXPECT_THAT(text, HasSubstr("f32[8,16]"));
  EXPECT_THAT(text, HasSubstr("f32[16,4]"));
}

// A global-norm clip's squared norm: a replicated running total plus each parameter's sum of
// squares, pending over the axes its parameter is split on. Each add needs its all_reduce first,
// so in program order every all_reduce is read before the next one starts; by data flow they are
// independent, and the combiner (XLA's AllReduceCombiner, which combines independent
// all-reduces wherever they are) moves the adds after them: one all_reduce per set of axes,
// ('data', 'model') and ('model', 'data') being one set. The value is checked against the
// host by the Transformer and Optim tests (clip_by_global_norm).
TEST_F(PartitionTest, AllReducesReadOneAfterAnotherAreCombinedWhenIndependent) {
  auto squared_norm = [](const std::vector<Value>& in) {
    Value total = sum(in[0] * in[0]);
    for (size_t k = 1; k < in.size(); ++k) total = total + sum(in[k] * in[k]);
    return std::vector<Value>{total};
  };
  const std::vector<ArrayType> types(6, ArrayType{DType::kF32, {8, 8}});
  Executable exe = compile(squared_norm, types,
                           {P(), P("data", None), P(None, "model"), P("data", None), P(Axes{"data", "model"}, None),
                            P(Axes{"model", "data"}, None)});
  const std::string text = exe.as_text();
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 3) << text;
  EXPECT_THAT(text, HasSubstr("= all_reduce(sum, axes=('data',)) s")) << text;
  EXPECT_THAT(text, HasSubstr("f32[2] 12B/device  ; combined 2 all_reduces")) << text;  // the two over 'data'
  EXPECT_THAT(text, HasSubstr("f32[2] 14B/device  ; combined 2 all_reduces")) << text;  // over both axes
  EXPECT_THAT(text, HasSubstr("= all_reduce(sum, axes=('model',)) s")) << text;
}

// FSDP's gradient: w is gathered for use by a sharding constraint, so its cotangent is pinned
// whole by the constraint's VJP (a pending sum over 'data' all-reduced), then laid out as w by
// grad (a local slice of 'data'). The reduce-scatter creator (XLA's ReduceScatterCreator)
// makes the pair one reduce_scatter: 3/4 of w's 512 B received instead of 2 * 3/4.
TEST_F(PartitionTest, AnAllReduceThatIsSlicedOverItsAxesIsAReduceScatter) {
  auto loss = [this](const std::vector<Value>& in) {
    return std::vector<Value>{sum(tanh(matmul(in[0], with_sharding_constraint(in[1], NamedSharding(mesh_, P())))))};
  };
  Executable exe =
      compile(grad(loss, {1}), {{DType::kF32, {32, 8}}, {DType::kF32, {8, 16}}}, {P("data", None), P("data", None)});
  const std::string text = exe.as_text();
  EXPECT_THAT(text, HasSubstr("= reduce_scatter(sum, dim=0, axes=('data',))")) << text;
  EXPECT_EQ(count_text(text, "= all_reduce("), 0) << text;
  EXPECT_EQ(count_text(text, "= local_slice("), 0) << text;
  EXPECT_EQ(collective_bytes_per_device(exe.program, exe.mesh), 384 + 384) << text;  // the gather, the scatter
}

// A norm's scale under FSDP with tensor parallelism: w (8,) stored over 'data', gathered for
// use, scales x (batch over 'data') before a matmul whose weight is split over 'model'. The
// cotangent of x * w is then a sum over 'model' (the matmul's transpose contracts the split),
// so w's gradient is pending over both axes: the constraint's VJP all-reduces it over both and
// grad slices it over 'data'. The creator makes that a reduce_scatter over 'data' and an
// all_reduce over 'model' of the 2 floats each device keeps: 24 + 8 B received instead of
// 2 * 7/8 * 32 = 56. The gather of w is 3/4 of 32 B.
TEST_F(PartitionTest, AnAllReduceSlicedOverSomeOfItsAxesIsAReduceScatterThenAnAllReduceOfTheBlock) {
  auto loss = [this](const std::vector<Value>& in) {
    const Value scaled = in[0] * with_sharding_constraint(in[1], NamedSharding(mesh_, P()));
    return std::vector<Value>{sum(tanh(matmul(scaled, in[2])))};
  };
  const std::vector<ArrayType> types = {{DType::kF32, {16, 8}}, {DType::kF32, {8}}, {DType::kF32, {8, 4}}};
  Executable exe = compile(grad(loss, {1}), types, {P("data", None), P("data"), P(None, "model")});
  std::string text = exe.as_text();
  EXPECT_THAT(text, HasSubstr("= reduce_scatter(sum, dim=0, axes=('data',)) s")) << text;
  EXPECT_THAT(text, HasSubstr("= all_reduce(sum, axes=('model',)) s")) << text;
  EXPECT_THAT(text, HasSubstr(" f32[2] 8B/device")) << text;  // the all_reduce of the block
  EXPECT_EQ(count_text(text, "= all_reduce("), 1) << text;
  EXPECT_EQ(count_text(text, "= local_slice("), 0) << text;
  EXPECT_EQ(collective_bytes_per_device(exe.program, exe.mesh), 24 + 24 + 8) << text;

  // Stored over ('model', 'data'): the pending sum over both axes is wanted split over both on
  // one dimension, one reduce_scatter over ('model', 'data') (its groups order devices as the
  // dimension's blocks), and w is gathered by one all_gather over both: 7/8 of 32 B each, the
  // bytes of gathering (and scattering) one axis after the other, in two collectives instead of
  // four.
  Executable both = compile(grad(loss, {1}), types, {P("data", None), P(Axes{"model", "data"}), P(None, "model")});
  text = both.as_text();
  EXPECT_THAT(text, HasSubstr("= all_gather(dim=0, axes=('model', 'data')) s")) << text;
  EXPECT_THAT(text, HasSubstr("= reduce_scatter(sum, dim=0, axes=('model', 'data')) s")) << text;
  EXPECT_EQ(count(both, Instruction::Kind::kCollective), 2) << text;
  EXPECT_EQ(count_text(text, "= local_slice("), 0) << text;
  EXPECT_EQ(collective_bytes_per_device(both.program, both.mesh), 28 + 28) << text;
}
// FSDP's gradients of several weights, each gathered for use and laid out back as stored:
// one reduce_scatter each, all independent, so the combiner (XLA's ReduceScatterCombiner)
// sends them as one. Stored on different dimensions: w1 (8, 16) and b (16,) over 'data' on
// dimension 0, w2 (16, 8) on dimension 1 (its operand is laid out by a transpose so that each
// device's row holds its block). The bytes are those of three separate reduce_scatters: each
// device receives (n-1) times its blocks, 3 * (128 + 16 + 128) B, plus the three gathers' 3/4
// of 512 + 64 + 512 B. The three gathers are independent too: one all_gather (XLA's
// AllGatherCombiner), w2's result laid out from the gathered rows by a transpose, the same
// bytes. JitTest.FsdpGradientsReduceScatteredAsOneMatchTheHost runs it.
TEST_F(PartitionTest, IndependentReduceScattersAreCombined) {
  auto loss = [this](const std::vector<Value>& in) {
    const NamedSharding whole(mesh_, P());
    const Value h =
        tanh(matmul(in[0], with_sharding_constraint(in[1], whole)) + with_sharding_constraint(in[2], whole));
    return std::vector<Value>{sum(tanh(matmul(h, with_sharding_constraint(in[3], whole))))};
  };
  const std::vector<ArrayType> types = {
      {DType::kF32, {32, 8}}, {DType::kF32, {8, 16}}, {DType::kF32, {16}}, {DType::kF32, {16, 8}}};
  Executable exe =
      compile(grad(loss, {1, 2, 3}), types, {P("data", None), P("data", None), P("data"), P(None, "data")});
  const std::string text = exe.as_text();
  EXPECT_EQ(count_text(text, "= reduce_scatter("), 1) << text;
  EXPECT_THAT(text, HasSubstr("= reduce_scatter(sum, dim=0, axes=('data',)) s")) << text;
  EXPECT_THAT(text, HasSubstr("combined 3 reduce_scatters")) << text;
  EXPECT_EQ(count_text(text, "= all_gather("), 1) << text;
  EXPECT_THAT(text, HasSubstr("= all_gather(dim=0, axes=('data',)) s")) << text;
  EXPECT_THAT(text, HasSubstr("combined 3 all_gathers")) << text;
  EXPECT_THAT(text, HasSubstr("= transpose(")) << text;  // w2's operand, scattered on dimension 1
  EXPECT_EQ(count_text(text, "= all_reduce("), 0) << text;
  EXPECT_EQ(count_text(text, "= local_slice("), 0) << text;
  EXPECT_EQ(collective_bytes_per_device(exe.program, exe.mesh), 3 * (128 + 16 + 128) + 3 * (512 + 64 + 512) / 4)
      << text;
  // The batch over both axes, w2 stored over 'model': its gradient is reduce-scattered over
  // 'model' (then all-reduced over 'data'), apart from w1's and b's over 'data'.
  Executable apart = compile(grad(loss, {1, 2, 3}), types,
                             {P(Axes{"data", "model"}, None), P("data", None), P("data"), P(None, "model")});
  EXPECT_EQ(count_text(apart.as_text(), "= reduce_scatter("), 2) << apart.as_text();
  EXPECT_THAT(apart.as_text(), HasSubstr("combined 2 reduce_scatters")) << apart.as_text();
}

// Issue 14 item 6: the rules that get the common programs right, each on its minimal
// reproduction, asserting the collectives and the bytes each device receives.

// FSDP as JAX users write it: the batch and the weight both split over 'data'. Gathering w
// (3/4 of 64 KiB) moves less than moving x to a contracting split and reduce-scattering a
// full-batch (16, 256) partial product; XLA's dot handler makes the same choice
// (xla/service/spmd/dot_handler.cc costs each strategy's reshards).
TEST_F(PartitionTest, FsdpContractionGathersTheWeight) {
  Executable exe = compile(
      [this](const std::vector<Value>& in) {
        return std::vector<Value>{
            with_sharding_constraint(matmul(in[0], in[1]), NamedSharding(mesh_, P("data", None)))};
      },
      {{DType::kF32, {16, 64}}, {DType::kF32, {64, 256}}}, {P("data", None), P("data", None)});
  EXPECT_THAT(collectives_of(exe),
              ElementsAre(IsCollective(CollectiveKind::kAllGather, {"data"}, /*of_value=*/1, 3 * 64 * 256 * 4 / 4)))
      << exe.as_text();
  EXPECT_EQ(exe.output_specs[0], P("data", None));
  // Each device multiplies only its own rows: a (4, 64) @ (64, 256) product.
  for (const Instruction& i : exe.program.code) {
    if (i.kind == Instruction::Kind::kKernel && i.node.op == Op::kDotGeneral) {
      EXPECT_EQ(i.node.shape, (Shape{4, 256}));
    }
  }
}

// In a contraction the cheaper operand moves: x (2048, 2048) and w (2048, 512) both P('i', None)
// on 4 devices gathers w (3/4 of 4 MiB), not the four times larger x (the shard_map notebook's
// example 1, done automatically).
TEST_F(PartitionTest, ContractionMovesTheCheaperOperand) {
  mesh_ = *make_mesh({4}, {"i"}, {0, 1, 2, 3});
  Executable exe =
      compile(seed, {{DType::kF32, {2048, 2048}}, {DType::kF32, {2048, 512}}}, {P("i", None), P("i", None)});
  EXPECT_THAT(collectives_of(exe),
              ElementsAre(IsCollective(CollectiveKind::kAllGather, {"i"}, /*of_value=*/1, 3 * 2048 * 512 * 4 / 4)))
      << exe.as_text();
  EXPECT_EQ(exe.output_specs[0], P("i", None));
}

// Contracting dimensions split alike on both sides still leave a partial sum (GSPMD; Megatron's
// row-parallel layer): nothing is gathered, the (16, 4) result is all-reduced over 'model'.
TEST_F(PartitionTest, ContractionSplitOnBothSidesStaysAPartialSum) {
  Executable exe =
      compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", "model"), P("model", None)});
  EXPECT_THAT(collectives_of(exe),
              ElementsAre(IsCollective(CollectiveKind::kAllReduce, {"model"}, /*of_value=*/2, 2 * 4 * 4 * 4 / 2)))
      << exe.as_text();
}

// reshape, squeeze and expand_dims keep a split dimension split when it survives whole
// ((4,1,8) -> (4,8) of P(None, None, 'model'); expand_dims of P('data', 'model')), and move a
// split to the dimension it lands in ((8, 6) -> (4, 12) of P('data', None): each device's two
// rows of 6 are one row of 12). JAX keeps these shardings too (jax/_src/lax/lax.py's
// _reshape_sharding_rule keeps a split that maps onto one output dimension).
TEST_F(PartitionTest, ReshapesKeepOrMoveSplitDimensions) {
  struct Case {
    Shape in;
    PartitionSpec spec;
    std::function<Value(const Value&)> f;
    PartitionSpec want;
  };
  const std::vector<Case> cases = {
      {{4, 1, 8},
       P(None, None, "model"),
       [](const Value& x) {
         return reshape(x, {4, 8});
       },
       P(None, "model")},
      {{4, 1, 8}, P("data", None, "model"), [](const Value& x) { return squeeze(x, {1}); }, P("data", "model")},
      {{4, 8}, P("data", "model"), [](const Value& x) { return expand_dims(x, 1); }, P("data", None, "model")},
      {{4, 8}, P("data", "model"), [](const Value& x) { return expand_dims(x, 0); }, P(None, "data", "model")},
      {{8, 6},
       P("data", None),
       [](const Value& x) {
         return reshape(x, {4, 12});
       },
       P("data", None)},
      {{8, 4}, P("data", None), [](const Value& x) { return reshape(x, {32}); }, P("data")},
      {{32},
       P("data"),
       [](const Value& x) {
         return reshape(x, {8, 4});
       },
       P("data", None)},
      {{8, 2, 4},
       P("data", None, "model"),
       [](const Value& x) {
         return reshape(x, {16, 4});
       },
       P("data", "model")},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(shape_to_string(c.in) + " " + c.spec.to_string());
    const auto f = c.f;
    Executable exe = compile([f](const std::vector<Value>& in) { return std::vector<Value>{f(in[0])}; },
                             {{DType::kF32, c.in}}, {c.spec});
    EXPECT_THAT(collectives_of(exe), ::testing::IsEmpty()) << exe.as_text();
    EXPECT_EQ(exe.output_specs[0], c.want) << exe.output_specs[0].to_string();
  }
  // A split of a minor dimension of a merged group is not a block of the result: gathered.
  Executable minor = compile([](const std::vector<Value>& in) { return std::vector<Value>{reshape(in[0], {32})}; },
                             {{DType::kF32, {8, 4}}}, {P(None, "model")});
  EXPECT_THAT(collectives_of(minor), ElementsAre(IsCollective(CollectiveKind::kAllGather, {"model"}, 0)));
}

// A pending max is resolved at its own (16, 1) shape before it is broadcast to the vocabulary
// width: one all_reduce(max) of 16 floats, not a reduce_scatter of a (16, 64) copy.
TEST_F(PartitionTest, PendingMaxIsReducedBeforeItIsBroadcast) {
  Executable exe = compile(
      [](const std::vector<Value>& in) { return std::vector<Value>{in[0] - max(in[0], {1}, /*keepdims=*/true)}; },
      {{DType::kF32, {16, 64}}}, {P(None, "model")});
  ASSERT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kAllReduce, {"model"}, -1, 2 * 16 * 4 / 2)))
      << exe.as_text();
  EXPECT_THAT(exe.as_text(), HasSubstr("all_reduce(max, axes=('model',))"));
  EXPECT_EQ(exe.output_specs[0], P(None, "model"));
}

// Issue #15: an embedding table split over the vocabulary (P('model', None)) is looked up
// locally — each device's rows for the indices that fall in them, 0 for the others — and the
// (batch, seq, d_model) result is summed over 'model' by one all_reduce: Megatron's
// vocabulary-parallel embedding. The 32k-row table (8 MiB) never moves; what each device
// receives is 2 * (2-1)/2 of its block of the result.
TEST_F(PartitionTest, VocabularyParallelEmbeddingIsALocalLookupAndOnePsum) {
  auto embed = [](const std::vector<Value>& in) { return std::vector<Value>{take(in[0], in[1], 0)}; };
  for (const PartitionSpec& ids : {P(), P("data", None)}) {
    SCOPED_TRACE(ids.to_string());
    Executable exe = compile(embed, {{DType::kF32, {32768, 64}}, {DType::kI32, {8, 16}}}, {P("model", None), ids});
    const int64_t batch = ids == P() ? 8 : 2;
    const int64_t result_block = batch * 16 * 64 * 4;
    EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kAllReduce, {"model"}, -1, result_block)))
        << exe.as_text();
    EXPECT_EQ(collective_bytes_per_device(exe.program, exe.mesh), result_block);
    const std::string text = exe.as_text();
    EXPECT_THAT(text, HasSubstr(absl::StrCat("= gather(s0, ")));
    // The lookup in this device's rows, the others' giving 0 to the sum.
    int lookups = 0;
    for (const Instruction& i : exe.program.code) {
      if (i.kind != Instruction::Kind::kKernel || i.node.op != Op::kGather) continue;
      ++lookups;
      EXPECT_EQ(i.node.shape, (Shape{batch, 16, 64}));
      EXPECT_EQ(i.node.attrs<GatherAttrs>().fill_value, std::optional<Scalar>(Scalar(0)));
    }
    EXPECT_EQ(lookups, 1);
    EXPECT_THAT(text, Not(HasSubstr("[32768"))) << "nothing table-sized is built or moved";
    EXPECT_EQ(exe.output_specs[0].axes(0), ids == P() ? Axes{} : Axes{"data"});
  }
}

// A table split over the hidden dimension needs no communication: each device gathers its
// columns of the rows, and the result is split over d_model.
TEST_F(PartitionTest, HiddenSplitEmbeddingNeedsNoCommunication) {
  Executable exe = compile([](const std::vector<Value>& in) { return std::vector<Value>{take(in[0], in[1], 0)}; },
                           {{DType::kF32, {32768, 64}}, {DType::kI32, {8, 16}}}, {P(None, "model"), P("data", None)});
  EXPECT_THAT(collectives_of(exe), ::testing::IsEmpty()) << exe.as_text();
  EXPECT_EQ(exe.output_specs[0], P("data", None, "model"));
}

// The embedding's gradient (scatter_add of the cotangent into zeros) lands in the table's own
// layout: each device adds the batch's rows that fall in its block. The batch-split cotangent
// and ids are gathered over 'data' (3/4 of 32 KiB and of 512 B), which is cheaper than the
// alternative of summing a table-sized partial gradient over 'data'.
TEST_F(PartitionTest, EmbeddingGradientScattersIntoTheLocalRows) {
  auto loss = [](const std::vector<Value>& in) { return std::vector<Value>{sum(take(in[0], in[1], 0) * in[2])}; };
  Executable exe =
      compile(grad(loss, {0}), {{DType::kF32, {32768, 64}}, {DType::kI32, {8, 16}}, {DType::kF32, {8, 16, 64}}},
              {P("model", None), P("data", None), P("data", None, None)});
  EXPECT_EQ(exe.output_specs[0], P("model", None));
  const std::vector<::tessera::testing::CollectiveInfo> moves = collectives_of(exe);
  EXPECT_FALSE(moves.empty());
  for (const auto& c : moves) {
    EXPECT_EQ(c.kind, CollectiveKind::kAllGather) << c;
    EXPECT_LE(c.bytes, 3 * 8 * 16 * 64 * 4 / 4) << c;
  }
  EXPECT_THAT(exe.as_text(), HasSubstr("= scatter_add("));
  EXPECT_THAT(exe.as_text(), HasSubstr("f32[16384,64]"));
}

// A scatter_add whose updates outweigh its result (a histogram of 64 rows into 8) adds each
// device's share of the batch into a pending sum over 'data' and all-reduces the small result,
// x counted once (a select keeps it on the first device along 'data' only), instead of gathering
// the updates.
TEST_F(PartitionTest, ScatterAddOfManyUpdatesIsAPendingSum) {
  Executable exe = compile([](const std::vector<Value>& in) { return std::vector<Value>{at(in[0], in[1]).add(in[2])}; },
                           {{DType::kF32, {8, 16}}, {DType::kI32, {64}}, {DType::kF32, {64, 16}}},
                           {P(), P("data"), P("data", None)});
  EXPECT_THAT(collectives_of(exe),
              ElementsAre(IsCollective(CollectiveKind::kAllReduce, {"data"}, -1, 2 * 3 * 8 * 16 * 4 / 4)))
      << exe.as_text();
  EXPECT_THAT(exe.as_text(), HasSubstr("= select("));
  EXPECT_THAT(exe.as_text(), HasSubstr("= scatter_add("));
}

// dynamic_slice keeps a split on a dimension its window covers whole (the start clamps to 0
// there) and gathers one it cuts; dynamic_update_slice likewise.
TEST_F(PartitionTest, DynamicWindowsKeepWholeCoveredSplits) {
  Executable kept = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{dynamic_slice(in[0], {in[1], in[1]}, {4, 8})};
      },
      {{DType::kF32, {16, 8}}, {DType::kI32, {}}}, {P(None, "model"), P()});
  EXPECT_THAT(collectives_of(kept), ::testing::IsEmpty()) << kept.as_text();
  EXPECT_EQ(kept.output_specs[0], P(None, "model"));
  for (const Instruction& i : kept.program.code) {
    if (i.kind == Instruction::Kind::kKernel && i.node.op == Op::kDynamicSlice) {
      EXPECT_EQ(i.node.attrs<DynamicSliceAttrs>().sizes, (std::vector<int64_t>{4, 4}));  // the local block's columns
    }
  }
  Executable cut = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{dynamic_slice(in[0], {in[1], in[1]}, {4, 8})};
      },
      {{DType::kF32, {16, 8}}, {DType::kI32, {}}}, {P("data", None), P()});
  EXPECT_THAT(collectives_of(cut), ElementsAre(IsCollective(CollectiveKind::kAllGather, {"data"}, 0))) << cut.as_text();
}

// A slice that is not aligned with the blocks of its split dimension keeps the split when each
// device's part lies in its block and one neighbour's (XLA's HandleSlice: the slice as a window,
// ExchangeHaloAndGetValidData): a collective_permute of the halo instead of an all_gather.
// f32[32] over 'data' (4 devices, blocks of 8): x[8:32:2] keeps 3 elements per device, device p
// reading [8 - 2p, 13 - 2p) of its block, so up to 5 of the next block's head (1->0, 2->1,
// 3->2): 20 B per device against the gather's 3 * 32 = 96 B. x[1:29] reads [1 - p, 8 - p): up
// to 2 of the previous block's tail (1->2, 2->3), 8 B. x[1:31] keeps 30 elements, which do not
// divide by 4 (Tessera has no padded shards): it still gathers.
TEST_F(PartitionTest, UnalignedSliceOfASplitDimensionExchangesHalosNotGathers) {
  auto compile_slice = [this](int64_t start, int64_t limit, int64_t stride) {
    return compile(
        [=](const std::vector<Value>& in) { return std::vector<Value>{slice(in[0], {start}, {limit}, {stride})}; },
        {{DType::kF32, {32}}}, {P("data")});
  };
  Executable strided = compile_slice(8, 32, 2);
  EXPECT_THAT(collectives_of(strided), ElementsAre(IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 20)))
      << strided.as_text();
  EXPECT_EQ(collective_bytes_per_device(strided.program, strided.mesh), 20);
  EXPECT_THAT(strided.as_text(), HasSubstr("1 collective, 20 bytes received per device"));
  EXPECT_THAT(strided.as_text(), HasSubstr("positions={1->0,2->1,3->2}"));
  EXPECT_THAT(strided.as_text(), Not(HasSubstr("all_gather")));
  EXPECT_EQ(strided.output_specs[0], P("data"));

  Executable unit = compile_slice(1, 29, 1);
  EXPECT_THAT(collectives_of(unit), ElementsAre(IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 8)))
      << unit.as_text();
  EXPECT_THAT(unit.as_text(), HasSubstr("positions={1->2,2->3}"));
  EXPECT_EQ(unit.output_specs[0], P("data"));

  Executable gathered = compile_slice(1, 31, 1);
  EXPECT_THAT(collectives_of(gathered), ElementsAre(IsCollective(CollectiveKind::kAllGather, {"data"})))
      << gathered.as_text();
  EXPECT_EQ(gathered.output_specs[0], P(None));
}

// The trade-off of a halo slice whose result is gathered anyway (docs/design.md, "Still
// gathered"): concatenate({x[1:29], y}, 0) with x, y f32[32] over 'data' (4 devices) joins along
// the split dimension, so both operands are gathered. x[1:29] keeps its split by a permute of
// 2 elements (8 B, 1->2, 2->3), and its 28 elements are then gathered with y in one combined
// all_gather (3 * (7 + 8) * 4 = 180 B): 188 B in 2 collectives, where gathering x first was one
// combined all_gather of 192 B. The slice's gate prices the halo against the gather of its own
// operand only (bytes never go up) and not the latency propagation charges each collective:
// this pins the plan so that a change to either shows here.
TEST_F(PartitionTest, HaloSliceGatheredByAConcatenateCostsAPermuteMore) {
  Executable exe = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{concatenate({slice(in[0], {1}, {29}, {1}), in[1]}, 0)};
      },
      {{DType::kF32, {32}}, {DType::kF32, {32}}}, {P("data"), P("data")});
  EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 8),
                                               IsCollective(CollectiveKind::kAllGather, {"data"}, -1, 180)))
      << exe.as_text();
  EXPECT_EQ(collective_bytes_per_device(exe.program, exe.mesh), 188);
  EXPECT_THAT(exe.as_text(), HasSubstr("2 collectives, 188 bytes received per device"));
  EXPECT_THAT(exe.as_text(), HasSubstr("positions={1->2,2->3}"));
  EXPECT_EQ(exe.output_specs[0], P(None));
}

// The VJP of a unit-stride slice (client/vjp/layout.cc unslice: the cotangent between zero
// fills, a concatenate along the sliced dimension; jax/_src/lax/slicing.py
// _slice_transpose_rule pads it) is the mirror of the halo slice: with x f32[32] over 'data'
// (4 devices) and the cotangent split as the slice's result, block j of the gradient covers
// padded positions [8j, 8j + 8), the cotangent's [8j - start, 8j + 8 - start), which lie in
// its block and its neighbours' (XLA pads the same way: ExchangeHaloAndGetValidData with
// mask_invalid_region). d/dx sum(x[1:29] * w): blocks of 7, device j reads [8j - 1, 8j + 7):
// device 1 needs 1 element of device 2's block, device 2 needs 2 of device 3's, so one permute
// of the 2-element head (pairs 2->1, 3->2): 2 * 4 = 8 B per device. x[3:27]: blocks of 6,
// device j reads [8j - 3, 8j + 5): device 1 needs 1 of device 0's tail (0->1) and 1 of device
// 2's head, device 2 needs 3 of device 3's head (2->1, 3->2): permutes of 1 and 3 elements,
// (1 + 3) * 4 = 16 B. Gathering the cotangent instead receives 3 * 7 * 4 = 84 B and 3 * 6 * 4 = 72 B.
// The result stays split as x, and what lies outside the cotangent is the fill, put there by a
// select on the position.
TEST_F(PartitionTest, GradOfAHaloSliceKeepsItsCotangentSplitByAHaloExchange) {
  auto compile_grad = [this](int64_t start, int64_t limit) {
    return compile(grad(
                       [=](const std::vector<Value>& in) {
                         return std::vector<Value>{sum(slice(in[0], {start}, {limit}, {1}) * in[1])};
                       },
                       {0}),
                   {{DType::kF32, {32}}, {DType::kF32, {limit - start}}}, {P("data"), P("data")});
  };
  Executable one_side = compile_grad(1, 29);
  EXPECT_THAT(collectives_of(one_side), ElementsAre(IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 8)))
      << one_side.as_text();
  EXPECT_THAT(one_side.as_text(), HasSubstr("1 collective, 8 bytes received per device"));
  EXPECT_THAT(one_side.as_text(), HasSubstr("positions={2->1,3->2}"));
  EXPECT_THAT(one_side.as_text(), Not(HasSubstr("all_gather")));
  EXPECT_EQ(one_side.output_specs[0], P("data"));

  Executable two_sides = compile_grad(3, 27);
  EXPECT_THAT(collectives_of(two_sides),
              ElementsAre(IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 4),
                          IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 12)))
      << two_sides.as_text();
  EXPECT_EQ(collective_bytes_per_device(two_sides.program, two_sides.mesh), 16);
  EXPECT_THAT(two_sides.as_text(), HasSubstr("positions={0->1}"));
  EXPECT_THAT(two_sides.as_text(), HasSubstr("positions={2->1,3->2}"));
  EXPECT_THAT(two_sides.as_text(), Not(HasSubstr("all_gather")));
  EXPECT_EQ(two_sides.output_specs[0], P("data"));
}

// jnp.pad with a constant (client/lax.cc pad: broadcasts of the scalar on either side, then a
// concatenate) of x f32[28] over 'data' by (1, 3) with 2.5 is the same window as the gradient
// of x[1:29] above: one permute of 8 B, the split kept, and the fill selected by position.
TEST_F(PartitionTest, PadOfASplitDimensionExchangesHalosAndSelectsTheFill) {
  Executable exe = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{pad(in[0], {{1, 3}}, 2.5)};
      },
      {{DType::kF32, {28}}}, {P("data")});
  EXPECT_THAT(collectives_of(exe), ElementsAre(IsCollective(CollectiveKind::kCollectivePermute, {"data"}, -1, 8)))
      << exe.as_text();
  EXPECT_THAT(exe.as_text(), HasSubstr("positions={2->1,3->2}"));
  EXPECT_THAT(exe.as_text(), HasSubstr("= select("));
  EXPECT_EQ(exe.output_specs[0], P("data"));
}

// slice_window against a per-device simulation of the plan partition_slice emits, for every
// slice of every dimension up to 32 over 2, 4 and 8 devices: each device builds [the previous
// block's tail of max_left, its own block, the next block's head of max_right] (zeros where its
// window reads no halo, as a permute gives a device no pair names), reads `width` elements at
// max_left + first + p * step and keeps every stride-th; that must be the device's b elements
// of x[start:limit:stride]. slice_window must decline exactly when the result does not divide,
// a halo reaches past the neighbouring block, or the halos are not less than a gather.
TEST(SliceWindow, MatchesAPerDeviceSimulationOfTheHaloExchange) {
  int windows = 0;
  for (int64_t n : {2, 4, 8}) {
    for (int64_t dim = n; dim <= 32; dim += n) {
      const int64_t block = dim / n;
      for (int64_t start = 0; start < dim; ++start) {
        for (int64_t limit = start + 1; limit <= dim; ++limit) {
          for (int64_t stride = 1; stride <= dim; ++stride) {
            const int64_t kept = (limit - start + stride - 1) / stride;
            SliceAttrs s{{start}, {limit}, {stride}};
            const std::optional<internal::SliceWindow> w = internal::slice_window(s, 0, dim, kept, n);
            SCOPED_TRACE(absl::StrCat("x[", start, ":", limit, ":", stride, "] of ", dim, " over ", n));
            if (kept % n != 0) {
              EXPECT_FALSE(w.has_value());
              continue;
            }
            // The halos the devices need: how far each device's elements reach before and after its block.
            const int64_t b = kept / n;
            int64_t left = 0, right = 0;
            for (int64_t p = 0; p < n; ++p) {
              left = std::max(left, p * block - (start + p * b * stride));
              right = std::max(right, start + ((p + 1) * b - 1) * stride - ((p + 1) * block - 1));
            }
            const bool fits = left <= block && right <= block && left + right < (n - 1) * block;
            ASSERT_EQ(w.has_value(), fits) << "left " << left << " right " << right;
            if (!w) continue;
            ++windows;
            EXPECT_EQ(w->max_left, left);
            EXPECT_EQ(w->max_right, right);
            for (int64_t p = 0; p < n; ++p) {
              std::vector<int64_t> buffer;  // global indices, -1 for the zeros of no pair
              const int64_t off = w->first + p * w->step;
              for (int64_t k = block - w->max_left; k < block; ++k)
                buffer.push_back(p > 0 && off < 0 ? (p - 1) * block + k : -1);
              for (int64_t k = 0; k < block; ++k) buffer.push_back(p * block + k);
              for (int64_t k = 0; k < w->max_right; ++k)
                buffer.push_back(p + 1 < n && off + w->width > block ? (p + 1) * block + k : -1);
              const int64_t at = w->max_left + off;
              ASSERT_GE(at, 0) << "device " << p;
              ASSERT_LE(at + w->width, static_cast<int64_t>(buffer.size())) << "device " << p;
              for (int64_t j = 0; j < b; ++j) {
                EXPECT_EQ(buffer[at + j * stride], start + (p * b + j) * stride) << "device " << p << " element " << j;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(windows, 1000);
}

// slice_window of a padded dimension (a window reaching before index 0 or past the last: a
// concatenate [fill, x, fill] read as x[-low : size + high], partition_concatenate) against a
// per-device simulation of exchange_halos, for every start in [-dim, dim), limit in (start,
// 2·dim] and stride 1 to 3 of dimensions up to 32 over 2, 4 and 8 devices. Each device builds
// [pad_left, the previous block's tail of max_left, its block, the next block's head of
// max_right, pad_right], the halos only where w.left / w.right say it receives them (else
// nothing, as a permute gives a device no pair names), reads `width` elements at pad_left +
// max_left + first + p·step and keeps every stride-th: each element that lies in x must be x's
// (those outside are the fill's, which the handler selects by position). slice_window must
// decline exactly when the result does not divide, a halo (of x's elements only, walked here
// element by element) reaches past the neighbouring block, the halos are not less than a
// gather, or a window would leave its buffer.
TEST(SliceWindow, MatchesAPerDeviceSimulationOfAPaddedWindow) {
  int padded = 0;
  for (int64_t n : {2, 4, 8}) {
    for (int64_t dim = n; dim <= 32; dim += n) {
      const int64_t block = dim / n;
      for (int64_t start = -dim; start < dim; ++start) {
        for (int64_t limit = start + 1; limit <= 2 * dim; ++limit) {
          for (int64_t stride = 1; stride <= 3; ++stride) {
            const int64_t kept = (limit - start + stride - 1) / stride;
            const std::optional<internal::SliceWindow> w =
                internal::slice_window(SliceAttrs{{start}, {limit}, {stride}}, 0, dim, kept, n);
            SCOPED_TRACE(absl::StrCat("x[", start, ":", limit, ":", stride, "] of ", dim, " over ", n));
            if (kept % n != 0) {
              EXPECT_FALSE(w.has_value());
              continue;
            }
            const int64_t b = kept / n;
            int64_t left = 0, right = 0, before = 0, after = 0;
            for (int64_t p = 0; p < n; ++p) {
              for (int64_t j = 0; j < b; ++j) {
                const int64_t at = start + (p * b + j) * stride;
                before = std::max(before, -at);
                after = std::max(after, at - (dim - 1));
                if (at < 0 || at >= dim) continue;
                left = std::max(left, p * block - at);
                right = std::max(right, at - ((p + 1) * block - 1));
              }
            }
            // Device p's buffer holds the indices [p·B - left - before, (p+1)·B + right + after).
            bool inside = true;
            for (int64_t p = 0; p < n; ++p) {
              const int64_t first = start + p * b * stride, last = first + (b - 1) * stride;
              inside = inside && first >= p * block - left - before && last < (p + 1) * block + right + after;
            }
            const bool fits = left <= block && right <= block && left + right < (n - 1) * block && inside;
            ASSERT_EQ(w.has_value(), fits) << "left " << left << " right " << right;
            if (!w) continue;
            EXPECT_EQ(w->max_left, left);
            EXPECT_EQ(w->max_right, right);
            EXPECT_EQ(w->pad_left, before);
            EXPECT_EQ(w->pad_right, after);
            padded += before > 0 || after > 0 ? 1 : 0;
            for (int64_t p = 0; p < n; ++p) {
              std::vector<int64_t> buffer(w->pad_left, -1);  // indices of x, -1 where nothing is
              for (int64_t k = block - w->max_left; k < block; ++k)
                buffer.push_back(p > 0 && w->left[p] > 0 ? (p - 1) * block + k : -1);
              for (int64_t k = 0; k < block; ++k) buffer.push_back(p * block + k);
              for (int64_t k = 0; k < w->max_right; ++k)
                buffer.push_back(p + 1 < n && w->right[p] > 0 ? (p + 1) * block + k : -1);
              buffer.insert(buffer.end(), w->pad_right, -1);
              const int64_t at = w->pad_left + w->max_left + w->first + p * w->step;
              ASSERT_GE(at, 0) << "device " << p;
              ASSERT_LE(at + w->width, static_cast<int64_t>(buffer.size())) << "device " << p;
              for (int64_t j = 0; j < b; ++j) {
                const int64_t want = start + (p * b + j) * stride;
                if (want >= 0 && want < dim) {
                  EXPECT_EQ(buffer[at + j * stride], want) << "device " << p << " element " << j;
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(padded, 1000);
}

// random::uniform of a sharded shape is made where it lives (JAX's partitionable threefry, as
// jax tests/array_test.py test_random_bits_is_pure_map_2d checks of XLA's program): no
// collective, no byte received, and no instruction of the global shape; each device's
// random_bits kernel is its block, counting from its block's first element.
TEST_F(PartitionTest, ShardedUniformIsGeneratedWhereItLivesWithNoCommunication) {
  for (const PartitionSpec& out :
       {P("data", "model"), P(None, "model"), P(Axes{"data", "model"}, None), P("model", "data"), P()}) {
    SCOPED_TRACE(out.to_string());
    Executable exe = compile(
        [](const std::vector<Value>& in) {
          return std::vector<Value>{random::uniform(in[0], {64, 32})};
        },
        {{DType::kU32, {2}}}, {P()}, {out});
    EXPECT_THAT(collectives_of(exe), ::testing::IsEmpty()) << exe.as_text();
    EXPECT_EQ(collective_bytes_per_device(exe.program, exe.mesh), 0);
    const Shape block = NamedSharding(mesh_, out).shard_shape({64, 32});
    int random_kernels = 0;
    for (const Instruction& i : exe.program.code) {
      if (out != P()) {
        EXPECT_NE(i.node.shape, (Shape{64, 32})) << op_name(i.node.op) << "\n" << exe.as_text();
      }
      if (i.node.op == Op::kRandomBits) {
        ++random_kernels;
        EXPECT_EQ(i.node.shape, block);
      }
    }
    EXPECT_EQ(random_kernels, 1) << exe.as_text();
  }
}

}  // namespace
}  // namespace tessera

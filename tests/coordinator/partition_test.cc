// Partitioning: per-device plans of traced programs — local shapes, the collectives each
// layout implies (and only those), local slices per device, frees after last use.
#include "coordinator/compiler/partition.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/wire.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/tessera.pb.h"
#include "tessera/trace.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class PartitionTest : public ::testing::Test {
 protected:
  const Mesh mesh_ = *make_mesh({4, 2}, {"data", "model"}, {0, 1, 2, 3, 4, 5, 6, 7});

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

  // Every slot but outputs and the inputs not donated is freed exactly once, after its last use.
  static void check_frees(const Executable& exe) {
    for (const DevicePlan& plan : exe.plans) {
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
    for (const Instruction& i : exe.plans[0].code) n += i.kind == kind ? 1 : 0;
    return n;
  }
};

std::vector<Value> seed(const std::vector<Value>& in) { return {tanh(matmul(in[0], in[1]))}; }

TEST_F(PartitionTest, SeedLayerIsPurelyLocal) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", None), P(None, "model")});
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 0);
  EXPECT_EQ(exe.output_specs[0], P("data", "model"));
  ASSERT_EQ(exe.plans.size(), 8u);
  const std::string text = exe.as_text();
  EXPECT_THAT(text, HasSubstr("s2 = dot_general(s0, s1) f32[4,2]  ; %2 = dot_general"));
  EXPECT_THAT(text, HasSubstr("s3 = tanh(s2) f32[4,2]  ; %3 = tanh"));
  EXPECT_THAT(text, HasSubstr("free s2"));
}

TEST_F(PartitionTest, ShardedContractionIsAllReducedBeforeTanh) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)});
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 1);
  EXPECT_THAT(exe.as_text(),
              HasSubstr("s3 = all_reduce(sum, groups={{0,1},{2,3},{4,5},{6,7}}) s2 f32[16,4]  ; for %3 = tanh"));
}

TEST_F(PartitionTest, PartialResultWantedShardedIsReduceScattered) {
  Executable exe = compile([](const std::vector<Value>& in) { return std::vector<Value>{matmul(in[0], in[1])}; },
                           {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P(None, "model"), P("model", None)},
                           {P(None, "model")});
  const std::string text = exe.as_text();
  EXPECT_THAT(text,
              HasSubstr("reduce_scatter(sum, dim=1, groups={{0,1},{2,3},{4,5},{6,7}}) s2 f32[16,2]  ; for output 0"));
  EXPECT_THAT(text, Not(HasSubstr("all_reduce")));
}

TEST_F(PartitionTest, ReplicatedOperandIsSlicedLocallyPerDevice) {
  Executable exe = compile([](const std::vector<Value>& in) { return std::vector<Value>{in[0] + in[1]}; },
                           {{DType::kF32, {16, 8}}, {DType::kF32, {16, 8}}}, {P("data", None), P()});
  EXPECT_EQ(count(exe, Instruction::Kind::kCollective), 0);
  // Device 2 is at data=1: it keeps rows 4:8 of the replicated operand.
  const DevicePlan& d2 = exe.plans[2];
  ASSERT_EQ(d2.device, 2);
  bool found = false;
  for (const Instruction& i : d2.code) {
    if (i.kind == Instruction::Kind::kLocalSlice) {
      EXPECT_EQ(i.slice, (Index{{4, 8}, {0, 8}}));
      found = true;
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(PartitionTest, LayoutChangesUseTheirCollectives) {
  auto constrained = [&](PartitionSpec to) {
    return [this, to](const std::vector<Value>& in) {
      return std::vector<Value>{exp(with_sharding_constraint(in[0], NamedSharding(mesh_, to)))};
    };
  };
  EXPECT_THAT(compile(constrained(P(None, "data")), {{DType::kF32, {16, 8}}}, {P("data", None)}).as_text(),
              HasSubstr("all_to_all(split=1, concat=0, groups={{0,2,4,6},{1,3,5,7}})"));
  EXPECT_THAT(compile(constrained(P()), {{DType::kF32, {16, 8}}}, {P("data", None)}).as_text(),
              HasSubstr("all_gather(dim=0, groups={{0,2,4,6},{1,3,5,7}})"));
  Executable permuted =
      compile(constrained(P(Axes{"model", "data"})), {{DType::kF32, {16, 8}}}, {P(Axes{"data", "model"})});
  EXPECT_THAT(permuted.as_text(), HasSubstr("collective_permute"));
  EXPECT_TRUE(permuted.log.empty());
  // Swapping the two axes between dimensions gathers 'data' and slices it again: logged.
  Executable swapped = compile(constrained(P("model", "data")), {{DType::kF32, {16, 8}}}, {P("data", "model")});
  ASSERT_EQ(swapped.log.size(), 1u);
  EXPECT_THAT(swapped.log[0], HasSubstr("involuntary full rematerialization: %1 = sharding_constraint"));
}

TEST_F(PartitionTest, ShardedIotaIsMadeWholeThenSliced) {
  Executable exe = compile(
      [](const std::vector<Value>& in) {
        return std::vector<Value>{in[0] + convert(iota(DType::kI32, {16, 8}, 0), DType::kF32)};
      },
      {{DType::kF32, {16, 8}}}, {P("data", None)});
  EXPECT_THAT(exe.as_text(), HasSubstr("= iota() i32[16,8]"));
  EXPECT_EQ(count(exe, Instruction::Kind::kLocalSlice), 1);
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
  for (DevicePlan& plan : back.plans) {
    pb::DevicePlan wire;
    to_proto(plan, &wire);
    absl::StatusOr<DevicePlan> parsed = plan_from_proto(wire);
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    for (size_t i = 0; i < plan.code.size(); ++i) parsed->code[i].cause = plan.code[i].cause;  // not sent
    plan = *std::move(parsed);
  }
  EXPECT_EQ(back.as_text(), exe.as_text());
}

TEST_F(PartitionTest, MalformedPlansAreRejected) {
  Executable exe = compile(seed, {{DType::kF32, {16, 8}}, {DType::kF32, {8, 4}}}, {P("data", None), P(None, "model")});
  pb::DevicePlan wire;
  to_proto(exe.plans[0], &wire);
  pb::DevicePlan bad = wire;
  bad.mutable_code(0)->set_in(0, 3);  // slot 3 is written later
  EXPECT_THAT(std::string(plan_from_proto(bad).status().message()), HasSubstr("before it is written"));
  bad = wire;
  bad.mutable_code(0)->mutable_node()->set_op(999);
  EXPECT_THAT(std::string(plan_from_proto(bad).status().message()), HasSubstr("op 999, not a kernel"));
  bad = wire;
  bad.set_num_slots(-1);
  EXPECT_EQ(plan_from_proto(bad).status().code(), absl::StatusCode::kInvalidArgument);
  for (int donated : {2, -1}) {  // the plan has 2 inputs
    bad = wire;
    bad.add_donated_inputs(donated);
    EXPECT_THAT(std::string(plan_from_proto(bad).status().message()),
                HasSubstr(absl::StrCat("donated input ", donated, " is not one of the 2 inputs")));
  }
  bad = wire;
  bad.add_donated_inputs(1);
  bad.add_donated_inputs(1);
  EXPECT_THAT(std::string(plan_from_proto(bad).status().message()), HasSubstr("or is named twice"));
}

}  // namespace
}  // namespace tessera

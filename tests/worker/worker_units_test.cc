// Unit tests of the worker's pieces that need no network: the buffer store, the reduction
// kernels, the interpreter's in-place writes and memory estimate, and the thread pool.
#include <atomic>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/synchronization/notification.h"
#include "core/thread_pool.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "worker/buffer_store.h"
#include "worker/collectives/reduce.h"
#include "worker/interpreter.h"
#include "worker/plan_peak.h"
#include "worker/plan_store.h"

namespace tessera {
namespace {

TEST(BufferStore, ReserveCommitGetErase) {
  BufferStore store(1000);
  ASSERT_TRUE(store.reserve(1, 400).ok());
  EXPECT_EQ(store.reserve(1, 10).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(store.reserve(2, 601).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store.get(1).status().code(), absl::StatusCode::kNotFound);  // reserved, not yet committed
  store.commit(1, std::make_shared<const HostArray>(HostArray::zeros(DType::kF32, {100})));
  ASSERT_TRUE(store.get(1).ok());
  EXPECT_EQ(store.stats().bytes_used, 400);
  EXPECT_EQ(store.erase({1, 99}), 1);
  EXPECT_EQ(store.stats().bytes_used, 0);
  EXPECT_EQ(store.stats().buffer_count, 0);
}

// The ids an erase finds neither committed nor reserved (a worker's DeleteBuffers ends the
// fan-out ops of those only).
TEST(BufferStore, EraseListsTheIdsNeitherHeldNorBeingFilled) {
  BufferStore store(1000);
  ASSERT_TRUE(store.reserve(1, 40).ok());
  store.commit(1, std::make_shared<const HostArray>(HostArray::zeros(DType::kF32, {10})));
  ASSERT_TRUE(store.reserve(2, 40).ok());  // being filled
  std::vector<uint64_t> unknown;
  EXPECT_EQ(store.erase({3, 1, 2, 4}, &unknown), 1);
  EXPECT_EQ(unknown, (std::vector<uint64_t>{3, 4}));
}

TEST(BufferStore, CancelReleasesTheReservation) {
  BufferStore store(100);
  ASSERT_TRUE(store.reserve(1, 100).ok());
  store.cancel(1);
  EXPECT_EQ(store.stats().bytes_used, 0);
  EXPECT_TRUE(store.reserve(1, 100).ok());
}

TEST(BufferStore, ErasedWhileBeingFilledIsDroppedOnCommit) {
  BufferStore store(1000);
  ASSERT_TRUE(store.reserve(7, 40).ok());
  EXPECT_EQ(store.erase({7}), 0);  // not committed yet
  store.commit(7, std::make_shared<const HostArray>(HostArray::zeros(DType::kF32, {10})));
  EXPECT_EQ(store.get(7).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store.stats().bytes_used, 0);
  EXPECT_EQ(store.stats().buffer_count, 0);
}

// A hand-written plan for out = x - y * y over f32[n]: inputs s0 = x and s1 = y, with x
// donated or not (as the partitioner writes it: a donated input is freed after its last use).
DevicePlan sgd_plan(int64_t n, bool donate_x) {
  auto kernel = [n](Op op, int out, std::vector<int> in) {
    Instruction i;
    i.out = out;
    i.in = in;
    i.node.op = op;
    i.node.dtype = DType::kF32;
    i.node.shape = {n};
    i.node.operands = std::move(in);
    return i;
  };
  auto free = [](int s) {
    Instruction i;
    i.kind = Instruction::Kind::kFree;
    i.in = {s};
    return i;
  };
  DevicePlan plan;
  plan.num_slots = 4;
  plan.input_slots = {0, 1};
  plan.output_slots = {3};
  plan.code = {kernel(Op::kMul, 2, {1, 1}), kernel(Op::kSub, 3, {0, 2}), free(2)};
  if (donate_x) {
    plan.donated_inputs = {0};
    plan.code.push_back(free(0));
  }
  return plan;
}

struct SgdRun {
  std::shared_ptr<const HostArray> out;
  std::vector<float> want;  // x - y * y, computed here
};

SgdRun run_sgd(const DevicePlan& plan, std::shared_ptr<const HostArray> x, std::shared_ptr<const HostArray> y) {
  SgdRun r;
  for (int64_t i = 0; i < x->size(); ++i) {
    r.want.push_back(x->values<float>()[i] - y->values<float>()[i] * y->values<float>()[i]);
  }
  Transport transport;
  std::vector<std::shared_ptr<const HostArray>> inputs;  // not {x, y}: an initializer list copies
  inputs.push_back(std::move(x));
  inputs.push_back(std::move(y));
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> out =
      run_plan(plan, std::move(inputs), transport, PlanRun{});
  EXPECT_TRUE(out.ok()) << out.status();
  if (out.ok()) r.out = (*out)[0];
  return r;
}

TEST(Interpreter, ADonatedInputNobodyElseHoldsTakesTheResultInPlace) {
  auto x = std::make_shared<const HostArray>(HostArray::arange(DType::kF32, {1000}));
  auto y = std::make_shared<const HostArray>(HostArray::ones(DType::kF32, {1000}));
  const std::byte* x_storage = x->data();
  const SgdRun r = run_sgd(sgd_plan(1000, true), std::move(x), y);
  ASSERT_NE(r.out, nullptr);
  EXPECT_EQ(r.out->data(), x_storage) << "the result did not reuse the donated input's storage";
  EXPECT_EQ(std::vector<float>(r.out->values<float>().begin(), r.out->values<float>().end()), r.want);
  EXPECT_EQ(*y, HostArray::ones(DType::kF32, {1000})) << "an input the caller holds was written";
}

TEST(Interpreter, InputsSomeoneElseHoldsAreNeverWritten) {
  const HostArray x0 = HostArray::arange(DType::kF32, {1000});
  for (bool donate : {false, true}) {
    SCOPED_TRACE(donate ? "donated, but still held (as by a send in flight)" : "not donated");
    auto x = std::make_shared<const HostArray>(x0.clone());
    const SgdRun r = run_sgd(sgd_plan(1000, donate), x, std::make_shared<const HostArray>(x0.clone()));
    ASSERT_NE(r.out, nullptr);
    EXPECT_NE(r.out->data(), x->data());
    EXPECT_EQ(*x, x0);
    EXPECT_EQ(std::vector<float>(r.out->values<float>().begin(), r.out->values<float>().end()), r.want);
  }
}

// Issue #17 ("Smaller": no cancellation check between kernels). A plan of `kernels` doublings,
// s[k + 1] = s[k] + s[k], with no loop and no collective: nothing but the per-instruction check
// asks its run's `cancelled` or reads its deadline.
DevicePlan doubling_plan(int64_t n, int kernels) {
  DevicePlan plan;
  plan.num_slots = kernels + 1;
  plan.input_slots = {0};
  plan.output_slots = {kernels};
  for (int k = 0; k < kernels; ++k) {
    Instruction i;
    i.out = k + 1;
    i.in = {k, k};
    i.node.op = Op::kAdd;
    i.node.dtype = DType::kF32;
    i.node.shape = {n};
    i.node.operands = i.in;
    plan.code.push_back(std::move(i));
  }
  return plan;
}

absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> run_doublings(const DevicePlan& plan,
                                                                            const PlanRun& run) {
  Transport transport;
  std::vector<std::shared_ptr<const HostArray>> inputs;
  inputs.push_back(std::make_shared<const HostArray>(HostArray::ones(DType::kF32, {1000})));
  return run_plan(plan, std::move(inputs), transport, run);
}

// `plan` with instruction k's node typed f32[n + 1]: that kernel fails INVALID_ARGUMENT if it
// runs, so a run that ends otherwise never ran it.
DevicePlan poisoned(DevicePlan plan, int k) {
  plan.code[k].node.shape = {plan.code[k].node.shape[0] + 1};
  return plan;
}

// Cancelled once the first kernel has run, the run stops before the second: `cancelled` is
// asked once per kernel (the first answer false, the second true), no result appears, and the
// error is CANCELLED naming the instruction (the second kernel is poisoned: had it run, the
// error would be its own). Not cancelled, the same plan asks once per kernel and gives 2^4
// everywhere (the host's 1 doubled four times).
TEST(Interpreter, ACancelledStraightLinePlanStopsBeforeItsNextKernel) {
  const DevicePlan plan = doubling_plan(1000, 4);
  PlanRun run;
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> out = run_doublings(poisoned(plan, 1), run);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument) << "the poison shows when it runs";
  int asked = 0;
  run.cancelled = [&asked] { return ++asked > 1; };
  out = run_doublings(poisoned(plan, 1), run);
  EXPECT_EQ(asked, 2) << "asked before kernel 0 (false: it ran) and kernel 1 (true: it did not)";
  ASSERT_FALSE(out.ok()) << "the cancelled plan ran to its end";
  EXPECT_EQ(out.status().code(), absl::StatusCode::kCancelled) << out.status();
  EXPECT_EQ(out.status().message(), "instruction 1 (add): the run was cancelled before it ran");

  asked = 0;
  run.cancelled = [&asked] { return ++asked > 4; };  // never true while the plan runs
  out = run_doublings(plan, run);
  EXPECT_EQ(asked, 4);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*(*out)[0], HostArray::from_vector<float>({1000}, std::vector<float>(1000, 16.0f)));
}

// A run whose deadline has passed runs no kernel: DEADLINE_EXCEEDED naming the first (which is
// poisoned: had it run, the error would be its own). With its deadline ahead, the unpoisoned
// plan runs to its result.
TEST(Interpreter, AStraightLinePlanPastItsDeadlineRunsNoKernel) {
  const DevicePlan plan = doubling_plan(1000, 4);
  PlanRun run;
  run.deadline = absl::Now() - absl::Milliseconds(1);
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> out = run_doublings(poisoned(plan, 0), run);
  ASSERT_FALSE(out.ok()) << "the plan ran past its deadline";
  EXPECT_EQ(out.status().code(), absl::StatusCode::kDeadlineExceeded) << out.status();
  EXPECT_EQ(out.status().message(), "instruction 0 (add): the run's deadline passed before it ran");

  run.deadline = absl::Now() + absl::Seconds(60);
  out = run_doublings(plan, run);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*(*out)[0], HostArray::from_vector<float>({1000}, std::vector<float>(1000, 16.0f)));
}

// reduce_into against a plain loop, for every dtype and op, with the input deliberately
// misaligned (as data straight from the wire can be).
template <typename T>
void check_reduce(DType dtype) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> dist(-5, 5);
  const int n = 1001;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin, ReduceOp::kProd}) {
    // Plain arrays: std::vector<bool> has no data().
    std::unique_ptr<T[]> a(new T[n]), b(new T[n]), want(new T[n]);
    for (int i = 0; i < n; ++i) {
      a[i] = static_cast<T>(dist(rng));
      b[i] = static_cast<T>(dist(rng));
      if constexpr (std::is_same_v<T, bool>) {
        want[i] = (op == ReduceOp::kSum || op == ReduceOp::kMax) ? (a[i] || b[i]) : (a[i] && b[i]);
      } else {
        switch (op) {
          case ReduceOp::kSum:
            want[i] = a[i] + b[i];
            break;
          case ReduceOp::kMax:
            want[i] = std::max(a[i], b[i]);
            break;
          case ReduceOp::kMin:
            want[i] = std::min(a[i], b[i]);
            break;
          case ReduceOp::kProd:
            want[i] = a[i] * b[i];
            break;
        }
      }
    }
    std::vector<std::byte> unaligned(n * sizeof(T) + 1);
    std::memcpy(unaligned.data() + 1, b.get(), n * sizeof(T));
    reduce_into(dtype, op, reinterpret_cast<std::byte*>(a.get()), unaligned.data() + 1, n);
    for (int i = 0; i < n; ++i) ASSERT_EQ(a[i], want[i]) << dtype_name(dtype) << " " << reduce_op_name(op) << " " << i;
  }
}

TEST(Reduce, EveryDtypeAndOpMatchesAPlainLoop) {
  check_reduce<float>(DType::kF32);
  check_reduce<double>(DType::kF64);
  check_reduce<int32_t>(DType::kI32);
  check_reduce<int64_t>(DType::kI64);
  check_reduce<bool>(DType::kBool);
}

TEST(Reduce, IntegerSumsWrapAround) {
  int32_t a = 2147483647, b = 1;
  reduce_into(DType::kI32, ReduceOp::kSum, reinterpret_cast<std::byte*>(&a), reinterpret_cast<const std::byte*>(&b), 1);
  EXPECT_EQ(a, -2147483647 - 1);
}

// The estimate follows the interpreter: y * y is new memory, x - (y * y) writes over it (it
// dies there and nothing else holds it); a donated x counts from the start and takes the
// subtraction's result. Hand-counted: 4000 bytes per f32[1000].
TEST(PlanMemory, PeakFollowsLivenessAndInPlaceWrites) {
  auto x = std::make_shared<const HostArray>(HostArray::arange(DType::kF32, {1000}));
  auto y = std::make_shared<const HostArray>(HostArray::ones(DType::kF32, {1000}));
  PlanPeak kept = peak_memory(sgd_plan(1000, false), {x, y});
  EXPECT_EQ(kept.bytes, 4000);
  EXPECT_EQ(kept.instruction, 0);  // the mul; the sub reuses its slot
  // Without donated inputs the inputs do not count: the peak a worker computes once, when it
  // loads the plan (LoadedPlan::peaks), is every run's.
  const PlanPeak loaded = peak_memory(sgd_plan(1000, false), {});
  EXPECT_EQ(loaded.bytes, kept.bytes);
  EXPECT_EQ(loaded.instruction, kept.instruction);
  PlanPeak donated = peak_memory(sgd_plan(1000, true), {x, y});
  EXPECT_EQ(donated.bytes, 8000);  // x, donated, and y * y
  EXPECT_EQ(donated.instruction, 0);
}

// A plan whose while loop's body runs a switch, on a donated input: x f32[1000] in slot 0,
// donated and freed after the loop; the loop (f32[1000] to slot 1) has a bool-scalar predicate
// and a body holding the switch, whose branches make iota f32[100] and f32[300].
DevicePlan loop_switch_plan() {
  auto make = [](int out, DType dtype, Shape shape) {
    Instruction i;
    i.out = out;
    i.node.op = Op::kIota;
    i.node.dtype = dtype;
    i.node.shape = std::move(shape);
    return i;
  };
  auto one_instruction_plan = [](Instruction inst) {
    auto p = std::make_shared<DevicePlan>();
    p->num_slots = 2;
    p->input_slots = {0};
    p->output_slots = {1};
    p->code = {std::move(inst)};
    return std::shared_ptr<const DevicePlan>(std::move(p));
  };
  // A loop or a switch reading slot 0 and writing f32[1000] to slot 1 (`node` holds the type).
  auto control = [&make](Instruction::Kind kind) {
    Instruction i = make(1, DType::kF32, {1000});
    i.kind = kind;
    i.in = {0};
    i.out_types = {ArrayType{i.node.dtype, i.node.shape}};
    return i;
  };
  Instruction choose = control(Instruction::Kind::kSwitch);
  choose.branches = {one_instruction_plan(make(1, DType::kF32, {100})),
                     one_instruction_plan(make(1, DType::kF32, {300}))};
  Instruction loop = control(Instruction::Kind::kLoop);
  loop.num_carry = 1;
  loop.branches = {one_instruction_plan(make(1, DType::kBool, {}))};
  loop.body = one_instruction_plan(std::move(choose));
  Instruction free;
  free.kind = Instruction::Kind::kFree;
  free.in = {0};
  DevicePlan plan;
  plan.num_slots = 2;
  plan.input_slots = {0};
  plan.donated_inputs = {0};
  plan.output_slots = {1};
  plan.code = {loop, free};
  return plan;
}

// loop_switch_plan's peak: the one a run reserves (with the bodies' peaks computed once when
// the plan is loaded, LoadedPlan::peaks) equals peak_memory walking every body per run, and
// the hand count. Hand-counted: x f32[1000], donated, 4000 bytes from the start; the loop's
// result f32[1000] 4000 more; on top while the loop runs, the larger of its predicate (a bool
// scalar, 1 byte) and its body, which holds the switch's f32[1000] result (4000) and the larger
// branch (iota f32[300], 1200; the other f32[100], 400): 5200. So 4000 + 4000 + 5200 = 13200 at
// instruction 0, and without the donated x counted 9200.
TEST(PlanMemory, ADonatedInputPlanWithALoopBodyKeepsItsPeakWhenBodiesAreComputedOnLoad) {
  const DevicePlan plan = loop_switch_plan();
  auto x = std::make_shared<const HostArray>(HostArray::arange(DType::kF32, {1000}));

  const PlanPeak per_run = peak_memory(plan, {x});
  EXPECT_EQ(per_run.bytes, 13200);
  EXPECT_EQ(per_run.instruction, 0);
  const LoadedPlan loaded(plan, {});
  ASSERT_EQ(loaded.peaks.bodies.size(), plan.code.size());
  EXPECT_EQ(loaded.peaks.bodies[0], 5200);
  EXPECT_EQ(loaded.peaks.bodies[1], 0);
  const PlanPeak cached = peak_memory(loaded.plan, {x}, loaded.peaks);
  EXPECT_EQ(cached.bytes, 13200);
  EXPECT_EQ(cached.instruction, 0);
  EXPECT_EQ(loaded.peaks.without_donated.bytes, 9200);
  EXPECT_EQ(loaded.peaks.without_donated.instruction, 0);
  EXPECT_EQ(peak_memory(plan, {}).bytes, 9200);
}

// peak_memory(plan, inputs, known) takes the loops' and switches' body peaks from `known`
// rather than walking the bodies (the point of computing them on load): told, against its
// REQUIRES, that the loop's body holds 1,000,000 bytes, it counts 4000 (x) + 4000 (the loop's
// result) + 1,000,000 at instruction 0, where walking the bodies gives 13200. A `known` of
// another plan's length is not read: the bodies are walked (13200).
TEST(PlanMemory, APeakWithKnownBodiesReadsThemInsteadOfWalkingTheBodies) {
  const DevicePlan plan = loop_switch_plan();
  auto x = std::make_shared<const HostArray>(HostArray::arange(DType::kF32, {1000}));
  PlanPeaks told = plan_peaks(plan);
  ASSERT_EQ(told.bodies.size(), 2u);
  told.bodies[0] = 1'000'000;
  const PlanPeak peak = peak_memory(plan, {x}, told);
  EXPECT_EQ(peak.bytes, 1'008'000);
  EXPECT_EQ(peak.instruction, 0);
  told.bodies.push_back(0);  // three entries for a plan of two instructions
  EXPECT_EQ(peak_memory(plan, {x}, told).bytes, 13200);
}

// A plan with no inputs that makes a 512 MiB intermediate (the program, which ran on
// an 8 MiB device): iota f32[2^27], then its sum. Both live at the reduction.
TEST(PlanMemory, AnIntermediateWithoutInputsCounts) {
  DevicePlan plan;
  plan.num_slots = 2;
  plan.output_slots = {1};
  Instruction iota;
  iota.out = 0;
  iota.node.op = Op::kIota;
  iota.node.dtype = DType::kF32;
  iota.node.shape = {int64_t{1} << 27};
  Instruction sum;
  sum.out = 1;
  sum.in = {0};
  sum.node.op = Op::kReduceSum;
  sum.node.dtype = DType::kF32;
  sum.node.shape = {};
  Instruction free;
  free.kind = Instruction::Kind::kFree;
  free.in = {0};
  plan.code = {iota, sum, free};
  PlanPeak peak = peak_memory(plan, {});
  EXPECT_EQ(peak.bytes, (int64_t{512} << 20) + 4);
  EXPECT_EQ(peak.instruction, 1);
  EXPECT_EQ(instruction_name(plan.code[peak.instruction]), "reduce_sum");
}

// Inline runs are decided by cost, not input bytes: the iota plan has no inputs but writes
// 512 MiB; x - y * y on f32[1000] touches 16,000 bytes; a collective never runs inline.
TEST(PlanCost, RunsInlineOnlyWhenSmallAndAlone) {
  EXPECT_TRUE(runs_inline(sgd_plan(1000, false), 8000));
  EXPECT_FALSE(runs_inline(sgd_plan(1000, false), kInlineBytes));  // with its results, over
  EXPECT_FALSE(runs_inline(sgd_plan(100'000, false), 0));
  DevicePlan iota;
  iota.num_slots = 1;
  iota.output_slots = {0};
  Instruction make;
  make.out = 0;
  make.node.op = Op::kIota;
  make.node.dtype = DType::kF32;
  make.node.shape = {int64_t{1} << 27};
  iota.code = {make};
  EXPECT_FALSE(runs_inline(iota, 0));
  DevicePlan with_collective = sgd_plan(10, false);
  Instruction all_reduce;
  all_reduce.kind = Instruction::Kind::kCollective;
  all_reduce.out = 3;
  all_reduce.in = {3};
  all_reduce.node.dtype = DType::kF32;
  all_reduce.node.shape = {10};
  with_collective.code.push_back(all_reduce);
  EXPECT_FALSE(runs_inline(with_collective, 0));
  EXPECT_TRUE(runs_inline(sgd_plan(10, false), 0));
  // A run may step (start on the thread at hand, park at its receives) within the same bounds
  // when its collectives are all all_reduces (the ones that step, worker/collectives/engine.h).
  EXPECT_TRUE(runs_stepped(with_collective, 0));
  EXPECT_TRUE(runs_stepped(sgd_plan(10, false), 0));
  EXPECT_FALSE(runs_stepped(with_collective, kInlineBytes));
  EXPECT_FALSE(runs_stepped(iota, 0));
  DevicePlan with_all_gather = with_collective;
  with_all_gather.code.back().collective.kind = CollectiveKind::kAllGather;
  EXPECT_FALSE(runs_stepped(with_all_gather, 0));
}

TEST(BufferStore, ChargedBytesCountAgainstTheLimit) {
  BufferStore store(100);
  EXPECT_TRUE(store.charge(60));
  EXPECT_FALSE(store.charge(41));
  EXPECT_EQ(store.stats().bytes_used, 60);
  EXPECT_EQ(store.reserve(1, 50).code(), absl::StatusCode::kResourceExhausted);
  store.uncharge(60);
  EXPECT_TRUE(store.reserve(1, 50).ok());
}

TEST(ThreadPool, RefusesPastItsLimitReusesThreadsAndJoinsThem) {
  std::atomic<int> ran{0};
  {
    ThreadPool pool("test work", 2);
    absl::Notification release;
    for (int i = 0; i < 2; ++i) {
      ASSERT_TRUE(pool.run([&] {
                        release.WaitForNotificationWithTimeout(absl::Seconds(30));
                        ++ran;
                      })
                      .ok());
    }
    absl::Status refused = pool.run([&] { ++ran; });
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(std::string(refused.message()), ::testing::HasSubstr("test work: 2 are running already"));
    release.Notify();
    // Once the two are done, more work reuses their threads.
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (pool.busy() > 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));  // polling, bounded
    for (int i = 0; i < 10; ++i) {
      absl::Status started = pool.run([&] { ++ran; });
      if (!started.ok()) {  // both may still be running the previous ones
        --i;
        ASSERT_LT(absl::Now(), deadline);
        absl::SleepFor(absl::Milliseconds(1));  // polling, bounded
      }
    }
    EXPECT_EQ(pool.threads(), 2);
  }  // joins after the work handed over has run
  EXPECT_EQ(ran.load(), 12);
}

}  // namespace
}  // namespace tessera

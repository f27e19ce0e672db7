// The plan interpreter: runs one device's DevicePlan over its slots — kernels, collectives
// with the other devices of the program, local slices and frees.
//
//   PlanRun run{execution_id, peers, self, deadline, cancelled};
//   absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> outputs =
//       run_plan(plan, inputs, transport, run);
#ifndef TESSERA_WORKER_INTERPRETER_H_
#define TESSERA_WORKER_INTERPRETER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/host_array.h"
#include "core/plan.h"
#include "worker/collectives/engine.h"
#include "worker/collectives/transport.h"

namespace tessera {

struct PlanRun {
  uint64_t execution = 0;            // unique per execution; tags the plan's collectives
  uint64_t run_tag = 0;              // the execution's random tag (RunPlanRequest.run_tag)
  std::map<int, std::string> peers;  // device id -> address, for every device of the program
  int self = 0;
  absl::Time deadline;  // for each collective's waits
  std::function<bool()> cancelled;
  // Whether the plan runs a collective (LoadedPlan::has_collectives). False: the run holds no
  // op range at the transport (Transport::begin_run_ops), a lock and a set insertion saved, and
  // a failed run finishes none (SteppedPlanRun::fail).
  bool has_collectives = true;
};

// The op id of instruction `index` of execution `execution` in a plan without loops:
// execution + 1 + index. A loop instruction takes 1 + trip_count * (its body's span) ids
// (core/plan.h's plan_op_span), iteration t of its body's from its own + 1 + t * span, so every
// collective of every iteration has an id of its own. The coordinator reserves plan_op_span
// ids after the execution's own (from the counter every id comes from), so they never meet
// another op's.
uint64_t plan_op_id(uint64_t execution, size_t index);

// Runs `plan` on `inputs` (one per plan input slot); returns the output slots' arrays. Errors
// name the instruction (and the device, for collectives) that failed.
//
// Elementwise kernels write their result over an operand whose slot dies there when nothing
// else holds that array: an intermediate, or a donated input (plan.donated_inputs) that the
// caller moved in without keeping a reference. Inputs the caller still holds are never written.
absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> run_plan(
    const DevicePlan& plan, std::vector<std::shared_ptr<const HostArray>> inputs, Transport& transport,
    const PlanRun& run);

// A run of one device's plan taken instruction by instruction that can leave off at a
// collective's receive whose message has not arrived (parking the run: Transport::park) and be
// continued later by whichever thread resumes it: the run's position (instruction, slots, the
// collective's state) is kept here, not on a thread's stack. run_plan is advance(nullptr).
//
//   SteppedPlanRun r(plan, inputs, transport, run, plan_op_id(run.execution, 0));
//   switch (r.advance(park)) { ... }   // kParked: advance again once resumed
//   absl::StatusOr<...> outputs = r.take_result();   // after kDone
class SteppedPlanRun {
 public:
  // `plan`, `transport` and `run` must outlive this. A top-level run of a plan with collectives
  // (run.has_collectives) holds its whole op range (Transport::begin_run_ops, nested loops' and
  // switches' ops included) for its lifetime; a `nested` one (a loop body's iteration, a
  // switch's branch) runs inside that range and takes no hold of its own, nor does a run
  // without collectives (no peer sends its ops anything).
  SteppedPlanRun(const DevicePlan& plan, std::vector<std::shared_ptr<const HostArray>> inputs, Transport& transport,
                 const PlanRun& run, uint64_t first_op, bool nested = false);
  ~SteppedPlanRun();

  enum class State {
    kDone,         // take_result()
    kParked,       // at a receive: the parked waiter advances it again (touch nothing until then)
    kNeedsThread,  // at an instruction that may wait and cannot park (a loop, a switch, a collective
                   // other than SteppedCollective's): advance again without `park`, on a thread
  };
  // With `park`, runs until one of the states above; without, runs to the end, waiting at
  // collectives as run_plan does (kDone).
  State advance(const ParkFn& park);
  // Ends a run that will not be advanced again (its thread could not be had): fails it with
  // `status` at the instruction it stopped at, finishing the ops of those not run (a run with
  // collectives; one without has no ops a peer sends to).
  void abandon(const absl::Status& status);
  // The output slots' arrays, or the error naming the instruction that failed. Once, after kDone.
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> take_result();

 private:
  void fail(const Instruction& inst, const absl::Status& status);
  bool holds_ops() const { return !nested_ && run_.has_collectives; }

  const DevicePlan& plan_;
  Transport& transport_;
  const PlanRun& run_;
  size_t k_ = 0;  // the next instruction
  uint64_t op_;   // its first op id
  const uint64_t first_op_;
  const uint64_t end_op_;
  const bool nested_;
  std::vector<std::shared_ptr<const HostArray>> slots_;
  std::vector<const HostArray*> operands_;         // instruction k_'s, while it runs
  std::unique_ptr<SteppedCollective> collective_;  // instruction k_'s, parked
  absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> result_ =
      std::vector<std::shared_ptr<const HostArray>>{};
};

// Whether a run of `plan` on inputs of `input_bytes` may start on the worker's run executor
// and step (SteppedPlanRun with park) when its transport serves in process: the cost bounds of
// runs_inline, no loop or switch, and collectives that are all all_reduces (SteppedCollective).
bool runs_stepped(const DevicePlan& plan, int64_t input_bytes);

// Whether a run of `plan` on inputs of `input_bytes` is small: it runs on the worker's run
// executor (worker/run_executor.h) in its session's order, not on a plan thread: no
// collective (it would wait for peers, whose data those few threads deliver), at most
// kInlineInstructions instructions, and at most kInlineBytes of inputs and results, every
// instruction's result counted (a plan with no inputs that makes a large iota or matmul costs
// as much as the memory it writes). Anything else runs on a thread of a pool.
inline constexpr int64_t kInlineBytes = 64 << 10;
inline constexpr size_t kInlineInstructions = 64;
bool runs_inline(const DevicePlan& plan, int64_t input_bytes);

// The name of instruction `i` in errors: its op, "local_slice" or its collective's kind.
std::string instruction_name(const Instruction& i);

}  // namespace tessera

#endif  // TESSERA_WORKER_INTERPRETER_H_

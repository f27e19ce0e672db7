#include "worker/interpreter.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "core/slicing.h"
#include "core/status.h"
#include "worker/collectives/engine.h"
#include "worker/kernels/kernels.h"

namespace tessera {

namespace {

absl::StatusOr<std::shared_ptr<const HostArray>> shared(absl::StatusOr<HostArray> a) {
  if (!a.ok()) return a.status();
  return std::make_shared<const HostArray>(*std::move(a));
}

// Whether slot `s` is freed right after instruction k (frees follow their slot's last use).
bool dies_at(const DevicePlan& plan, size_t k, int s) {
  for (size_t i = k + 1; i < plan.code.size() && plan.code[i].kind == Instruction::Kind::kFree; ++i) {
    if (plan.code[i].in[0] == s) return true;
  }
  return false;
}

// The operand an elementwise kernel can write its result over: one whose slot dies at the
// kernel and that nothing outside the slot holds (not the store, a send, or another slot).
int reusable_operand(const DevicePlan& plan, size_t k, const std::vector<std::shared_ptr<const HostArray>>& slots) {
  const Instruction& inst = plan.code[k];
  for (size_t j = 0; j < inst.in.size(); ++j) {
    const std::shared_ptr<const HostArray>& a = slots[inst.in[j]];
    if (can_run_in_place(inst.node, *a) && a.use_count() == 1 && dies_at(plan, k, inst.in[j])) {
      // use_count() is a relaxed load: order it before our writes, after the last holder's
      // reads (a gRPC thread dropping a zero-copy send's reference).
      std::atomic_thread_fence(std::memory_order_acquire);
      return static_cast<int>(j);
    }
  }
  return -1;
}

}  // namespace

uint64_t plan_op_id(uint64_t execution, size_t index) {
  return execution + 1 + static_cast<uint64_t>(index);
}

absl::StatusOr<std::vector<std::shared_ptr<const HostArray>>> run_plan(
    const DevicePlan& plan, std::vector<std::shared_ptr<const HostArray>> inputs, Transport& transport,
    const PlanRun& run) {
  if (inputs.size() != plan.input_slots.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("run: the plan takes ", plan.input_slots.size(), " inputs, got ", inputs.size()));
  }
  std::vector<std::shared_ptr<const HostArray>> slots(static_cast<size_t>(plan.num_slots));
  for (size_t i = 0; i < inputs.size(); ++i) slots[plan.input_slots[i]] = std::move(inputs[i]);
  for (size_t k = 0; k < plan.code.size(); ++k) {
    const Instruction& inst = plan.code[k];
    std::vector<const HostArray*> in;
    for (int s : inst.in) in.push_back(slots[s].get());
    absl::StatusOr<std::shared_ptr<const HostArray>> out = absl::InternalError("unset");
    switch (inst.kind) {
      case Instruction::Kind::kFree:
        slots[inst.in[0]].reset();
        continue;
      case Instruction::Kind::kKernel:
        if (const int reuse = reusable_operand(plan, k, slots); reuse >= 0) {
          absl::Status done = run_kernel_in_place(inst.node, in, reuse);
          out = done.ok() ? absl::StatusOr<std::shared_ptr<const HostArray>>(slots[inst.in[reuse]]) : done;
        } else {
          out = shared(run_kernel(inst.node, in));
        }
        break;
      case Instruction::Kind::kLocalSlice: {
        absl::Status valid = validate_index(inst.slice, in[0]->shape());
        out = valid.ok() ? shared(extract_block(*in[0], inst.slice)) : valid;
        break;
      }
      case Instruction::Kind::kCollective: {
        CollectiveRun c;
        c.op = plan_op_id(run.execution, k);
        c.spec = inst.collective;
        c.peers = run.peers;
        c.self = run.self;
        c.start = absl::Now();
        c.deadline = run.deadline;
        c.cancelled = run.cancelled;
        out = run_collective(transport, c, slots[inst.in[0]]);
        transport.finish_op(c.op);
        break;
      }
    }
    if (!out.ok()) {
      const std::string what = inst.kind == Instruction::Kind::kCollective   ? collective_name(inst.collective.kind)
                               : inst.kind == Instruction::Kind::kLocalSlice ? std::string("local_slice")
                                                                             : op_name(inst.node.op);
      return absl::Status(out.status().code(),
                          absl::StrCat("instruction ", k, " (", what, "): ", out.status().message()));
    }
    slots[inst.out] = *std::move(out);
  }
  std::vector<std::shared_ptr<const HostArray>> outputs;
  for (int s : plan.output_slots) outputs.push_back(slots[s]);
  return outputs;
}

}  // namespace tessera

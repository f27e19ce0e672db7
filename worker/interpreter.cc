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

std::string instruction_name(const Instruction& i) {
  return i.kind == Instruction::Kind::kCollective   ? collective_name(i.collective.kind)
         : i.kind == Instruction::Kind::kLocalSlice ? std::string("local_slice")
         : i.kind == Instruction::Kind::kFree       ? std::string("free")
                                                    : op_name(i.node.op);
}

PlanPeak peak_memory(const DevicePlan& plan, const std::vector<std::shared_ptr<const HostArray>>& inputs) {
  // What each slot holds that counts: its array's bytes, 0 for an input the caller keeps.
  std::vector<int64_t> charged(static_cast<size_t>(plan.num_slots), 0);
  std::vector<ArrayType> types(static_cast<size_t>(plan.num_slots));
  int64_t live = 0;
  for (size_t i = 0; i < inputs.size() && i < plan.input_slots.size(); ++i) {
    types[plan.input_slots[i]] = {inputs[i]->dtype(), inputs[i]->shape()};
  }
  for (int d : plan.donated_inputs) {
    if (d < 0 || d >= static_cast<int>(inputs.size())) continue;
    charged[plan.input_slots[d]] = inputs[d]->nbytes();
    live += inputs[d]->nbytes();
  }
  PlanPeak peak{live, -1};
  for (size_t k = 0; k < plan.code.size(); ++k) {
    const Instruction& inst = plan.code[k];
    if (inst.kind == Instruction::Kind::kFree) {
      live -= charged[inst.in[0]];
      charged[inst.in[0]] = 0;
      continue;
    }
    const int64_t bytes = num_elements(inst.node.shape) * dtype_size(inst.node.dtype);
    int reuse = -1;
    if (inst.kind == Instruction::Kind::kKernel) {
      for (int s : inst.in) {
        if (charged[s] > 0 && can_run_in_place(inst.node, types[s].dtype, types[s].shape) && dies_at(plan, k, s)) {
          reuse = s;
          break;
        }
      }
    }
    types[inst.out] = {inst.node.dtype, inst.node.shape};
    if (reuse >= 0) {  // the result takes the operand's storage, which its free then leaves alone
      charged[inst.out] = charged[reuse];
      charged[reuse] = 0;
      continue;
    }
    live += bytes;  // the slot's old value goes only once the new one is made
    if (live > peak.bytes) peak = {live, static_cast<int>(k)};
    live -= charged[inst.out];
    charged[inst.out] = bytes;
  }
  return peak;
}

bool runs_inline(const DevicePlan& plan, int64_t input_bytes) {
  if (plan.code.size() > kInlineInstructions) return false;
  int64_t bytes = input_bytes;
  for (const Instruction& inst : plan.code) {
    if (inst.kind == Instruction::Kind::kCollective) return false;
    if (inst.kind != Instruction::Kind::kFree) bytes += num_elements(inst.node.shape) * dtype_size(inst.node.dtype);
  }
  return bytes <= kInlineBytes;
}

uint64_t plan_op_id(uint64_t execution, size_t index) { return execution + 1 + static_cast<uint64_t>(index); }

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
      // The ops of the instructions it will not run: peers' messages for them go, now and later.
      transport.finish_ops(plan_op_id(run.execution, k), plan_op_id(run.execution, plan.code.size()));
      return absl::Status(out.status().code(),
                          absl::StrCat("instruction ", k, " (", instruction_name(inst), "): ", out.status().message()));
    }
    slots[inst.out] = *std::move(out);
  }
  std::vector<std::shared_ptr<const HostArray>> outputs;
  for (int s : plan.output_slots) outputs.push_back(slots[s]);
  return outputs;
}

}  // namespace tessera

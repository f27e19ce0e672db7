#include "worker/plan_peak.h"

#include <algorithm>

#include "core/host_array.h"
#include "worker/kernels/kernels.h"

namespace tessera {

namespace {

// While a loop or a switch runs, its body's (predicate's, branch's) peak is held on top of what
// the plan holds. Bodies take no inputs of their own that count, so this is one number per
// instruction whatever the run's inputs (0 for other instructions).
int64_t body_peak(const Instruction& inst) {
  if (inst.kind != Instruction::Kind::kLoop && inst.kind != Instruction::Kind::kSwitch) return 0;
  int64_t body = inst.body == nullptr ? 0 : peak_memory(*inst.body, {}).bytes;
  for (const auto& b : inst.branches) body = std::max(body, b == nullptr ? 0 : peak_memory(*b, {}).bytes);
  return body;
}

// peak_memory, reading each instruction's body_peak from `bodies` when given (one per
// instruction of `plan`), else computing it.
PlanPeak peak_over(const DevicePlan& plan, const std::vector<std::shared_ptr<const HostArray>>& inputs,
                   const std::vector<int64_t>* bodies) {
  // What each slot holds that counts: its array's bytes, 0 for an input the caller keeps.
  std::vector<int64_t> charged(static_cast<size_t>(plan.num_slots), 0);
  // Each slot's type, its shape read in place (an input's, or the plan's): set before read,
  // since only a charged slot's type is read.
  struct SlotType {
    DType dtype = DType::kF32;
    const Shape* shape = nullptr;
  };
  std::vector<SlotType> types(static_cast<size_t>(plan.num_slots));
  int64_t live = 0;
  for (size_t i = 0; i < inputs.size() && i < plan.input_slots.size(); ++i) {
    types[plan.input_slots[i]] = {inputs[i]->dtype(), &inputs[i]->shape()};
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
    if (inst.kind == Instruction::Kind::kLoop || inst.kind == Instruction::Kind::kSwitch) {
      // its results, and its body's (predicate's, branch's) peak on top while it runs
      std::vector<int> outs = {inst.out};
      outs.insert(outs.end(), inst.extra_out.begin(), inst.extra_out.end());
      const int64_t body = bodies != nullptr ? (*bodies)[k] : body_peak(inst);
      for (size_t j = 0; j < outs.size() && j < inst.out_types.size(); ++j) {
        const ArrayType& t = inst.out_types[j];
        types[outs[j]] = {t.dtype, &t.shape};
        const int64_t bytes = num_elements(t.shape) * dtype_size(t.dtype);
        live += bytes - charged[outs[j]];
        charged[outs[j]] = bytes;
      }
      if (live + body > peak.bytes) peak = {live + body, static_cast<int>(k)};
      continue;
    }
    const int64_t bytes = num_elements(inst.node.shape) * dtype_size(inst.node.dtype);
    int reuse = -1;
    if (inst.kind == Instruction::Kind::kKernel) {
      for (int s : inst.in) {
        if (charged[s] > 0 && can_run_in_place(inst.node, types[s].dtype, *types[s].shape) && freed_after(plan, k, s)) {
          reuse = s;
          break;
        }
      }
    }
    types[inst.out] = {inst.node.dtype, &inst.node.shape};
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

}  // namespace

PlanPeak peak_memory(const DevicePlan& plan, const std::vector<std::shared_ptr<const HostArray>>& inputs) {
  return peak_over(plan, inputs, nullptr);
}

PlanPeaks plan_peaks(const DevicePlan& plan) {
  PlanPeaks peaks;
  peaks.bodies.reserve(plan.code.size());
  for (const Instruction& inst : plan.code) peaks.bodies.push_back(body_peak(inst));
  peaks.without_donated = peak_over(plan, {}, &peaks.bodies);
  return peaks;
}

PlanPeak peak_memory(const DevicePlan& plan, const std::vector<std::shared_ptr<const HostArray>>& inputs,
                     const PlanPeaks& known) {
  // Peaks of another plan would be read out of range: walk the bodies instead.
  return peak_over(plan, inputs, known.bodies.size() == plan.code.size() ? &known.bodies : nullptr);
}

}  // namespace tessera

// DevicePlan: what one device runs for a compiled program — a linear list of instructions
// over numbered buffer slots (local kernels, collectives, local slices, frees). The
// coordinator's partitioner writes plans; the worker's interpreter runs them.
//
//   for (const Instruction& i : plan.code) {
//     if (i.kind == Instruction::Kind::kKernel) slots[i.out] = run_kernel(i.node, inputs(i.in));
//     ...
//   }
#ifndef TESSERA_CORE_PLAN_H_
#define TESSERA_CORE_PLAN_H_

#include <string>
#include <vector>

#include "core/collective.h"
#include "core/graph.h"
#include "core/sharding.h"

namespace tessera {

struct Instruction {
  enum class Kind { kKernel, kCollective, kLocalSlice, kFree };
  Kind kind = Kind::kKernel;
  int out = -1;         // slot written (not for kFree)
  std::vector<int> in;  // slots read (kFree: the slot freed)
  Node node;            // kKernel: the op on local shapes; otherwise the result's dtype and shape
  CollectiveSpec collective;
  Index slice;        // kLocalSlice: the block of the input this device keeps
  std::string cause;  // the graph op that needed this instruction, e.g. "%3 = tanh" (not sent)
};

struct DevicePlan {
  int device = 0;
  int num_slots = 0;
  std::vector<int> input_slots;  // slot of each parameter's local shard
  // Inputs (positions in input_slots) the caller gives up (jit's donate_argnums): the plan
  // frees them after their last use, and a kernel may write its result over them.
  std::vector<int> donated_inputs;
  std::vector<int> output_slots;  // slot of each output's local shard
  std::vector<Instruction> code;
};

}  // namespace tessera

#endif  // TESSERA_CORE_PLAN_H_

// A hand-written device plan for the worker's unit tests (stepped runs, the transport): out =
// all_reduce_sum(x * x) + x over the devices `group`, on f32[4] blocks. Slots: 0 = x, 1 = x * x,
// 2 = the all_reduce's result, 3 = out; instructions: the mul (0), the all_reduce (1), the add (2).
//
//   DevicePlan plan = psum_plan({0, 1});
//   run_plan(plan, {psum_block(0)}, transport, run);   // on device 0, with device 1 running the same
#ifndef TESSERA_TESTS_SUPPORT_PSUM_PLAN_H_
#define TESSERA_TESTS_SUPPORT_PSUM_PLAN_H_

#include <memory>
#include <utility>
#include <vector>

#include "core/host_array.h"
#include "core/plan.h"

namespace tessera {

inline DevicePlan psum_plan(const std::vector<int>& group) {
  auto kernel = [](Op op, int out, std::vector<int> in) {
    Instruction i;
    i.out = out;
    i.in = in;
    i.node.op = op;
    i.node.dtype = DType::kF32;
    i.node.shape = {4};
    i.node.operands = std::move(in);
    return i;
  };
  Instruction all_reduce;
  all_reduce.kind = Instruction::Kind::kCollective;
  all_reduce.out = 2;
  all_reduce.in = {1};
  all_reduce.node.dtype = DType::kF32;
  all_reduce.node.shape = {4};
  all_reduce.collective.kind = CollectiveKind::kAllReduce;
  all_reduce.collective.reduce_op = ReduceOp::kSum;
  all_reduce.collective.groups = {group};
  DevicePlan plan;
  plan.num_slots = 4;
  plan.input_slots = {0};
  plan.output_slots = {3};
  plan.code = {kernel(Op::kMul, 1, {0, 0}), all_reduce, kernel(Op::kAdd, 3, {2, 0})};
  return plan;
}

// A device's f32[4] block for that plan: first, first + 1, first + 2, first + 3.
inline std::shared_ptr<const HostArray> psum_block(float first) {
  HostArray a(DType::kF32, {4});
  for (int i = 0; i < 4; ++i) reinterpret_cast<float*>(a.data())[i] = first + static_cast<float>(i);
  return std::make_shared<const HostArray>(std::move(a));
}

}  // namespace tessera

#endif  // TESSERA_TESTS_SUPPORT_PSUM_PLAN_H_

// Loop-invariant code motion (XLA's WhileLoopInvariantCodeMotion): an instruction of a loop's
// body — or of a while loop's predicate — that reads nothing the iteration gives it — a
// constant, an iota, axis_index, and any kernel or local slice of those only (a broadcast
// scalar, a causal mask built from two iotas and a compare) — computes the same array in every
// iteration, so it runs once, before the loop, in the enclosing program. The loop takes what
// the body or the predicate still reads of those as extra carries placed after its own: the
// body returns them unchanged (the interpreter passes a carry on by reference: no copy), and
// a while loop's predicate, which takes every carry, gets them too (each sub-plan takes the
// other's as inputs it does not read). The loop's extra final carries are freed right after
// it. Hoisted constants meet the enclosing program's identical ones in CSE, which runs next.
//
// Collectives stay where they are (their op ids are per iteration), and so do nested loops
// and switches. The sub-plans arrive finished (their own passes ran when they were
// partitioned, so loops nested in them are already hoisted into them and their frees are in
// place): the pass drops the frees of what it hoists and keeps their slot numbers.
#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "coordinator/compiler/passes/passes.h"
#include "core/op.h"

namespace tessera {
namespace {

// Kernels are pure functions of their operands (a random draw too: of its key and counter).
bool hoistable_kind(const Instruction& i) {
  return (i.kind == Instruction::Kind::kKernel && !has_trait(i.node.op, kCollective)) ||
         i.kind == Instruction::Kind::kLocalSlice;
}

// What a sub-plan still reads of the values hoisted out of it: its slots, the enclosing
// program's, and their types.
struct Hoisted {
  std::vector<int> inner, outer;
  std::vector<ArrayType> types;
};

// Moves `sub`'s invariant instructions into `code` (the enclosing program, before the loop),
// with fresh slots of `program`; returns what the rest of `sub` (or its results) reads of them.
Hoisted hoist_out_of(DevicePlan* sub, DevicePlan* program, std::vector<Instruction>* code) {
  Hoisted h;
  std::vector<bool> invariant(sub->num_slots, false);
  std::vector<bool> hoisted(sub->code.size(), false);
  bool any = false;
  for (size_t k = 0; k < sub->code.size(); ++k) {
    const Instruction& i = sub->code[k];
    if (!hoistable_kind(i)) continue;
    if (!std::all_of(i.in.begin(), i.in.end(), [&](int s) { return invariant[s]; })) continue;
    hoisted[k] = true;
    invariant[i.out] = true;
    any = true;
  }
  if (!any) return h;

  std::vector<bool> needed(sub->num_slots, false);
  for (size_t k = 0; k < sub->code.size(); ++k) {
    const Instruction& i = sub->code[k];
    if (hoisted[k] || i.kind == Instruction::Kind::kFree) continue;
    for (int s : i.in) needed[s] = needed[s] || invariant[s];
  }
  for (int s : sub->output_slots) needed[s] = needed[s] || invariant[s];

  std::vector<int> outer(sub->num_slots, -1);  // sub slot -> the enclosing program's
  std::vector<Instruction> rest;
  for (size_t k = 0; k < sub->code.size(); ++k) {
    Instruction& i = sub->code[k];
    if (i.kind == Instruction::Kind::kFree && invariant[i.in[0]]) continue;
    if (!hoisted[k]) {
      rest.push_back(std::move(i));
      continue;
    }
    const int inner_slot = i.out;
    for (int& s : i.in) s = outer[s];
    i.node.operands = i.in;
    i.out = program->num_slots++;
    outer[inner_slot] = i.out;
    if (needed[inner_slot]) {
      h.inner.push_back(inner_slot);
      h.outer.push_back(i.out);
      h.types.push_back({i.node.dtype, i.node.shape});
    }
    code->push_back(std::move(i));
  }
  sub->code = std::move(rest);
  return h;
}

// `sub` takes `mine` (its slots of the values hoisted out of it) and then `others` (how many
// hoisted out of the loop's other sub-plan: fresh slots it does not read) as inputs after the
// loop's `carries`, or, when `mine_first` is false, the others first; and returns them all
// when `returns` (a body).
void take_carries(DevicePlan* sub, size_t carries, const std::vector<int>& mine, size_t others, bool mine_first,
                  bool returns) {
  std::vector<int> fresh(others);
  for (int& s : fresh) s = sub->num_slots++;
  std::vector<int> added = mine_first ? mine : fresh;
  const std::vector<int>& second = mine_first ? fresh : mine;
  added.insert(added.end(), second.begin(), second.end());
  sub->input_slots.insert(sub->input_slots.begin() + carries, added.begin(), added.end());
  if (returns) sub->output_slots.insert(sub->output_slots.begin() + carries, added.begin(), added.end());
  for (int& d : sub->donated_inputs) {
    if (d >= static_cast<int>(carries)) d += static_cast<int>(added.size());
  }
}

// Hoists loop `loop`'s invariants (its body's, and a while loop's predicate's) into `code` and
// rewires the loop: the new carries go after its own, the body's then the predicate's, in the
// sub-plans' inputs and the body's results, the loop's operands, result types and slots.
void hoist_from(Instruction* loop, DevicePlan* program, std::vector<Instruction>* code) {
  DevicePlan body = *loop->body;
  const Hoisted from_body = hoist_out_of(&body, program, code);
  const bool is_while = !loop->branches.empty();
  DevicePlan pred = is_while ? *loop->branches[0] : DevicePlan{};
  const Hoisted from_pred = is_while ? hoist_out_of(&pred, program, code) : Hoisted{};
  std::vector<int> carried_outer = from_body.outer;
  carried_outer.insert(carried_outer.end(), from_pred.outer.begin(), from_pred.outer.end());
  std::vector<ArrayType> carried_types = from_body.types;
  carried_types.insert(carried_types.end(), from_pred.types.begin(), from_pred.types.end());
  if (carried_outer.empty()) {
    // Nothing still read of them (everything hoisted was dead): the sub-plans just lost code.
    if (is_while) loop->branches[0] = std::make_shared<const DevicePlan>(std::move(pred));
    loop->body = std::make_shared<const DevicePlan>(std::move(body));
    return;
  }

  const size_t carries = static_cast<size_t>(loop->num_carry), m = carried_outer.size();
  take_carries(&body, carries, from_body.inner, from_pred.inner.size(), true, true);
  if (is_while) {
    take_carries(&pred, carries, from_pred.inner, from_body.inner.size(), false, false);
    loop->branches[0] = std::make_shared<const DevicePlan>(std::move(pred));
  }
  loop->in.insert(loop->in.begin() + carries, carried_outer.begin(), carried_outer.end());
  loop->node.operands = loop->in;
  loop->out_types.insert(loop->out_types.begin() + carries, carried_types.begin(), carried_types.end());
  std::vector<int> results = {loop->out};
  results.insert(results.end(), loop->extra_out.begin(), loop->extra_out.end());
  std::vector<int> fresh(m);
  for (int& s : fresh) s = program->num_slots++;
  results.insert(results.begin() + carries, fresh.begin(), fresh.end());
  loop->out = results[0];
  loop->extra_out.assign(results.begin() + 1, results.end());
  loop->node.dtype = loop->out_types[0].dtype;
  loop->node.shape = loop->out_types[0].shape;
  loop->num_carry += static_cast<int>(m);
  loop->body = std::make_shared<const DevicePlan>(std::move(body));
}

}  // namespace

void hoist_loop_invariants(DevicePlan* program) {
  std::vector<Instruction> code;
  for (Instruction& i : program->code) {
    if (i.kind == Instruction::Kind::kLoop && i.body != nullptr && i.branches.size() <= 1 &&
        (i.branches.empty() || i.branches[0] != nullptr)) {
      hoist_from(&i, program, &code);
    }
    code.push_back(std::move(i));
  }
  program->code = std::move(code);
}

}  // namespace tessera

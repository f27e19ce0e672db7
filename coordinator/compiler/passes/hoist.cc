// Loop-invariant code motion (XLA's WhileLoopInvariantCodeMotion): an instruction of a scan's
// body that reads nothing the iteration gives it — a constant, an iota, axis_index, and any
// kernel or local slice of those only (a broadcast scalar, a causal mask built from two iotas
// and a compare) — computes the same array in every iteration, so it runs once, before the
// loop, in the enclosing program. The body takes what it still reads of those as extra
// carries placed after its own, which it returns unchanged (the interpreter passes a carry
// on by reference: no copy), and the loop's extra final carries are freed right after it.
// Hoisted constants meet the enclosing program's identical ones in CSE, which runs next.
//
// Collectives stay where they are (their op ids are per iteration), and so do nested loops
// and switches; a while loop's body is left alone (its predicate would need the carries too).
// The body arrives finished (its own passes ran when it was partitioned, so loops nested in
// it are already hoisted into it and its frees are in place): the pass drops the frees of
// what it hoists and keeps the body's slot numbers.
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

// Moves loop `loop`'s invariant body instructions into `code` (the enclosing program, before
// the loop), with fresh slots of `program`, and rewires the loop.
void hoist_from(Instruction* loop, DevicePlan* program, std::vector<Instruction>* code) {
  DevicePlan body = *loop->body;
  std::vector<bool> invariant(body.num_slots, false);
  std::vector<bool> hoisted(body.code.size(), false);
  bool any = false;
  for (size_t k = 0; k < body.code.size(); ++k) {
    const Instruction& i = body.code[k];
    if (!hoistable_kind(i)) continue;
    if (!std::all_of(i.in.begin(), i.in.end(), [&](int s) { return invariant[s]; })) continue;
    hoisted[k] = true;
    invariant[i.out] = true;
    any = true;
  }
  if (!any) return;

  // What the rest of the body (or its results) reads of the hoisted values: the new carries.
  std::vector<bool> needed(body.num_slots, false);
  for (size_t k = 0; k < body.code.size(); ++k) {
    const Instruction& i = body.code[k];
    if (hoisted[k] || i.kind == Instruction::Kind::kFree) continue;
    for (int s : i.in) needed[s] = needed[s] || invariant[s];
  }
  for (int s : body.output_slots) needed[s] = needed[s] || invariant[s];

  std::vector<int> outer(body.num_slots, -1);  // body slot -> the enclosing program's
  std::vector<int> carried_body, carried_outer;
  std::vector<ArrayType> carried_types;
  std::vector<Instruction> rest;
  for (size_t k = 0; k < body.code.size(); ++k) {
    Instruction& i = body.code[k];
    if (i.kind == Instruction::Kind::kFree && invariant[i.in[0]]) continue;
    if (!hoisted[k]) {
      rest.push_back(std::move(i));
      continue;
    }
    const int body_slot = i.out;
    for (int& s : i.in) s = outer[s];
    i.node.operands = i.in;
    i.out = program->num_slots++;
    outer[body_slot] = i.out;
    if (needed[body_slot]) {
      carried_body.push_back(body_slot);
      carried_outer.push_back(i.out);
      carried_types.push_back({i.node.dtype, i.node.shape});
    }
    code->push_back(std::move(i));
  }
  body.code = std::move(rest);

  // The new carries go after the loop's own: in the body's inputs and results, the loop's
  // operands, result types and result slots.
  const size_t carries = static_cast<size_t>(loop->num_carry), m = carried_body.size();
  body.input_slots.insert(body.input_slots.begin() + carries, carried_body.begin(), carried_body.end());
  body.output_slots.insert(body.output_slots.begin() + carries, carried_body.begin(), carried_body.end());
  for (int& d : body.donated_inputs) {
    if (d >= static_cast<int>(carries)) d += static_cast<int>(m);
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
    if (i.kind == Instruction::Kind::kLoop && i.branches.empty() && i.body != nullptr) hoist_from(&i, program, &code);
    code.push_back(std::move(i));
  }
  program->code = std::move(code);
}

}  // namespace tessera

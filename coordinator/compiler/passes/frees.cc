// Slot numbering and frees: slots are renumbered densely in the order they are first written
// (inputs first, as the parameters come), so a pass that dropped instructions leaves no holes
// in the interpreter's slot vector; then every slot is freed right after its last use, except
// outputs and the inputs the caller keeps (not donated).
#include <algorithm>
#include <vector>

#include "coordinator/compiler/passes/passes.h"

namespace tessera {
namespace {

void number_densely(DevicePlan* p) {
  std::vector<int> number(p->num_slots, -1);
  int next = 0;
  auto renumber = [&](int& s) {
    if (number[s] < 0) number[s] = next++;
    s = number[s];
  };
  for (int& s : p->input_slots) renumber(s);
  for (Instruction& i : p->code) {
    for (int& s : i.in) renumber(s);
    renumber(i.out);
    for (int& s : i.extra_out) renumber(s);
    i.node.operands = i.in;
  }
  for (int& s : p->output_slots) renumber(s);
  p->num_slots = next;
}

}  // namespace

void insert_frees(DevicePlan* p) {
  number_densely(p);
  std::vector<int> last_use(p->num_slots, -1);
  for (size_t i = 0; i < p->code.size(); ++i) {
    last_use[p->code[i].out] = std::max<int>(last_use[p->code[i].out], static_cast<int>(i));
    for (int s : p->code[i].extra_out) last_use[s] = std::max<int>(last_use[s], static_cast<int>(i));
    for (int s : p->code[i].in) last_use[s] = static_cast<int>(i);
  }
  std::vector<bool> keep(p->num_slots, false);
  for (int s : p->input_slots) keep[s] = true;
  for (int d : p->donated_inputs) keep[p->input_slots[d]] = false;
  for (int s : p->output_slots) keep[s] = true;
  std::vector<Instruction> code;
  for (size_t i = 0; i < p->code.size(); ++i) {
    code.push_back(p->code[i]);
    std::vector<int> slots = p->code[i].in;
    slots.push_back(p->code[i].out);
    slots.insert(slots.end(), p->code[i].extra_out.begin(), p->code[i].extra_out.end());
    for (int s : slots) {
      if (!keep[s] && last_use[s] == static_cast<int>(i)) {
        Instruction free;
        free.kind = Instruction::Kind::kFree;
        free.in = {s};
        code.push_back(free);
        keep[s] = true;  // freed once
      }
    }
  }
  p->code = std::move(code);
}

}  // namespace tessera

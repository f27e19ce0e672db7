// Dead-code elimination: walking back from the outputs, an instruction is kept when a kept
// instruction or an output reads what it writes. Unrequested gradients, values a shard_map body
// computed and dropped, reshards whose consumer went: gone, collectives included.
#include <vector>

#include "coordinator/compiler/passes/passes.h"

namespace tessera {

void eliminate_dead_code(DevicePlan* program) {
  std::vector<bool> live(program->num_slots, false);
  for (int s : program->output_slots) live[s] = true;
  std::vector<bool> keep(program->code.size(), false);
  for (size_t k = program->code.size(); k-- > 0;) {
    const Instruction& i = program->code[k];
    bool used = live[i.out];
    for (int s : i.extra_out) used = used || live[s];  // a loop's other results
    if (!used) continue;
    keep[k] = true;
    for (int s : i.in) live[s] = true;
  }
  std::vector<Instruction> code;
  for (size_t k = 0; k < program->code.size(); ++k) {
    if (keep[k]) code.push_back(std::move(program->code[k]));
  }
  program->code = std::move(code);
}

}  // namespace tessera

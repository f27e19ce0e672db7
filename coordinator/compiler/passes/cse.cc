// Common-subexpression elimination: an instruction whose wire form (kind, op, attributes,
// collective, symbolic parts) and inputs equal an earlier one's reads that one's result instead
// (XLA's reshard cache does this for reshards; here it covers every instruction). Comparing the
// canonical encoding means a new attribute can never be forgotten in a hand-written equality.
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "coordinator/compiler/passes/passes.h"
#include "core/wire.h"

namespace tessera {

void eliminate_common_subexpressions(DevicePlan* program) {
  std::vector<int> renamed(program->num_slots);
  for (int s = 0; s < program->num_slots; ++s) renamed[s] = s;
  absl::flat_hash_map<std::string, int> first;  // canonical form -> the slot it wrote
  std::vector<Instruction> code;
  for (Instruction& i : program->code) {
    for (int& s : i.in) s = renamed[s];
    i.node.operands = i.in;
    if (i.kind == Instruction::Kind::kLoop || i.kind == Instruction::Kind::kSwitch) {  // several results: never merged
      code.push_back(std::move(i));
      continue;
    }
    Instruction key = i;
    key.out = -1;
    key.cause.clear();
    auto [it, fresh] = first.emplace(canonical_bytes(key), i.out);
    if (fresh) {
      code.push_back(std::move(i));
    } else {
      renamed[i.out] = it->second;
    }
  }
  program->code = std::move(code);
  for (int& s : program->output_slots) s = renamed[s];
}

}  // namespace tessera

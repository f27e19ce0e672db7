// The reduce-scatter creator (XLA's ReduceScatterCreator): an all_reduce whose result only one
// local_slice reads, which splits one dimension over exactly the all-reduced axes and keeps
// every other dimension, becomes one reduce_scatter onto that dimension. Each device then
// receives its block of the sum instead of the whole sum it would slice: (n-1)/n of the bytes
// instead of 2(n-1)/n. It arises where a pending sum is pinned whole and then laid out split:
// the cotangent of a weight gathered by a sharding constraint (FSDP), which the constraint's
// VJP pins whole, then laid out as the weight by grad (or the scan VJP's rows).
#include <vector>

#include "coordinator/compiler/passes/passes.h"

namespace tessera {
namespace {

// The dimension `slice` splits over exactly `axes` (in that order) where nothing split it
// before, every other dimension unchanged; -1 if it is not such a slice.
int scattered_dimension(const Instruction& slice, const std::vector<std::string>& axes) {
  if (slice.kind != Instruction::Kind::kLocalSlice || !slice.relayout.has_value()) return -1;
  const PartitionSpec& from = slice.relayout->from;
  const PartitionSpec& to = slice.relayout->to;
  const int rank = static_cast<int>(slice.relayout->shape.size());
  int found = -1;
  for (int d = 0; d < rank; ++d) {
    const Axes a = d < from.size() ? from.axes(d) : Axes{};
    const Axes b = d < to.size() ? to.axes(d) : Axes{};
    if (a == b) continue;
    if (found >= 0 || !a.empty() || b != axes) return -1;
    found = d;
  }
  return found;
}

}  // namespace

void create_reduce_scatters(DevicePlan* program) {
  std::vector<int> readers(program->num_slots, 0);
  std::vector<int> reader(program->num_slots, -1);
  for (size_t k = 0; k < program->code.size(); ++k) {
    for (int s : program->code[k].in) {
      ++readers[s];
      reader[s] = static_cast<int>(k);
    }
  }
  for (int s : program->output_slots) readers[s] += 2;  // an output is read whole
  std::vector<bool> gone(program->code.size(), false);
  for (Instruction& i : program->code) {
    if (i.kind != Instruction::Kind::kCollective || i.collective.kind != CollectiveKind::kAllReduce ||
        i.relayout.has_value() || i.axes.empty() || readers[i.out] != 1) {
      continue;
    }
    const int k = reader[i.out];
    Instruction& slice = program->code[k];
    const int d = scattered_dimension(slice, i.axes);
    if (d < 0 || slice.in.size() != 1) continue;
    i.collective.kind = CollectiveKind::kReduceScatter;
    i.collective.dimension = d;
    i.node.shape = slice.node.shape;
    i.out = slice.out;
    gone[k] = true;
  }
  std::vector<Instruction> code;
  for (size_t k = 0; k < program->code.size(); ++k) {
    if (!gone[k]) code.push_back(std::move(program->code[k]));
  }
  program->code = std::move(code);
}

}  // namespace tessera

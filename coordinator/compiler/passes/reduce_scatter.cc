// The reduce-scatter creator (XLA's ReduceScatterCreator): an all_reduce over axes A whose
// result only one local_slice reads, which splits one dimension further over axes S (all in
// A) and keeps every other dimension, becomes a reduce_scatter over S onto that dimension,
// then, when S is not all of A, an all_reduce of the scattered block over the rest of A. Each
// device then receives its block of the sum instead of the whole sum it would slice.
//
// It arises where a pending sum is pinned whole and then laid out split: the cotangent of a
// weight gathered by a sharding constraint (FSDP), which the constraint's VJP pins whole, then
// laid out as the weight by grad (or the scan VJP's rows). Under FSDP with tensor parallelism
// a weight replicated over 'model' (a layer norm's scale) has a gradient pending over
// ('model', 'data') and is stored split over 'data': reduce_scatter over 'data', then
// all_reduce the quarter over 'model'.
//
// The order (scatter first, as reshard.cc's partial -> sharded): with X the whole sum's bytes,
// s and a the devices along S and along A \ S, scattering first moves (s-1)/s X + 2(a-1)/a X/s,
// the other order 2(a-1)/a X + (s-1)/s X: never less. The sum has the same terms; what changes
// is the order the engine adds them in (before, one all_reduce over the a*s members; now each
// block's s terms, then the a partial sums), so a result can differ from the old one in the
// last bits. The a replicas of a block get the all_reduce's one result, as before.
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "coordinator/compiler/passes/passes.h"

namespace tessera {
namespace {

// The one dimension `slice` splits further, over axes all in `axes` appended (minor) to those
// that split it already, every other dimension unchanged: {dimension, appended axes}; {-1, {}}
// if it is not such a slice. The block a device keeps is then its block of a reduce_scatter
// over the appended axes (their replica groups order devices major-to-minor, as the spec does).
std::pair<int, Axes> scattered_dimension(const Instruction& slice, const std::vector<std::string>& axes) {
  if (slice.kind != Instruction::Kind::kLocalSlice || !slice.relayout.has_value()) return {-1, {}};
  const PartitionSpec& from = slice.relayout->from;
  const PartitionSpec& to = slice.relayout->to;
  const int rank = static_cast<int>(slice.relayout->shape.size());
  std::pair<int, Axes> found = {-1, {}};
  for (int d = 0; d < rank; ++d) {
    const Axes a = d < from.size() ? from.axes(d) : Axes{};
    const Axes b = d < to.size() ? to.axes(d) : Axes{};
    if (a == b) continue;
    if (found.first >= 0 || b.size() <= a.size() || !std::equal(a.begin(), a.end(), b.begin())) return {-1, {}};
    Axes appended(b.begin() + static_cast<std::ptrdiff_t>(a.size()), b.end());
    for (const std::string& axis : appended) {
      if (std::find(axes.begin(), axes.end(), axis) == axes.end()) return {-1, {}};
    }
    found = {d, std::move(appended)};
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
    const auto [d, scattered] = scattered_dimension(slice, i.axes);
    if (d < 0 || slice.in.size() != 1) continue;
    std::vector<std::string> rest;  // A \ S, in A's order
    for (const std::string& axis : i.axes) {
      if (std::find(scattered.begin(), scattered.end(), axis) == scattered.end()) rest.push_back(axis);
    }
    i.collective.kind = CollectiveKind::kReduceScatter;
    i.collective.dimension = d;
    i.axes = scattered;
    i.node.shape = slice.node.shape;
    if (rest.empty()) {
      i.out = slice.out;
      gone[k] = true;
      continue;
    }
    // The slice's slot becomes the all_reduce of the scattered block over the rest of A.
    Instruction reduce = i;
    reduce.collective.kind = CollectiveKind::kAllReduce;
    reduce.collective.dimension = 0;
    reduce.axes = std::move(rest);
    reduce.in = {i.out};
    reduce.out = slice.out;
    slice = std::move(reduce);
  }
  std::vector<Instruction> code;
  for (size_t k = 0; k < program->code.size(); ++k) {
    if (!gone[k]) code.push_back(std::move(program->code[k]));
  }
  program->code = std::move(code);
}

}  // namespace tessera

// The collective combiner (XLA's AllReduceCombiner, ReduceScatterCombiner and
// AllGatherCombiner): independent all_reduces over the same mesh axes (as a set), reduce op and
// dtype become one, on the concatenation of their flattened operands, up to kCombineBytes per
// message; so do independent reduce_scatters over the same axes (in order: it fixes which block
// each device gets), reduce op and dtype, whatever dimension each scatters, and independent
// all_gathers over the same axes (in order) and dtype, whatever dimension each gathers. A
// data-parallel step all-reduces one gradient per parameter, a global-norm clip one scalar per
// parameter, an FSDP step gathers every weight of a layer and reduce-scatters one gradient per
// parameter; on these machines a small collective costs its latency (a round of
// messages between the devices), not its bytes, so one message for all of them saves nearly
// all of it.
//
// Independence is by data flow, not position: the program is re-scheduled as a list scheduler
// would (Kahn's algorithm, ties broken by the original order). An instruction is emitted once
// every slot it reads is written; a combinable collective whose operand is ready is held in its
// bucket instead, and what reads its result waits. So the readers of a held all_reduce (the
// clip's running `total + sum(g*g)`) move after the later, independent all_reduces, which join
// the bucket. A bucket is emitted when it is full, or when nothing else can run (then the
// bucket holding the earliest collective). All_reduces: reshape each operand to 1-D,
// concatenate, all_reduce, slice each part out and reshape it back into the original slot.
// Reduce_scatters over n devices: operand k, scattered on dimension d into blocks of e_k
// elements, is laid out as (n, e_k) whose row j is the block device j keeps (a reshape to
// (before, n, e_k / before), `before` the product of the dimensions before d, then, when
// before > 1, a transpose of the first two dimensions); the rows are concatenated along
// dimension 1, the (n, sum e_k) whole reduce-scattered on dimension 0, and each device's
// (1, sum e_k) row sliced into its operands' blocks. All_gathers, the other way round: each
// operand (device j's block of e_k elements) flattened to (1, e_k), the rows concatenated along
// dimension 1 and the (1, sum e_k) all-gathered on dimension 0; the (n, e_k) columns of operand
// k, whose row j is device j's block, laid out as its result (a reshape to (before, n, e_k /
// before) after swapping the first two dimensions of (n, before, e_k / before) when before > 1).
// Every device runs the same program, so
// every device runs the collectives in the same new order.
#include <algorithm>
#include <functional>
#include <map>
#include <queue>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/compiler/passes/passes.h"

namespace tessera {
namespace {

struct Held {
  Instruction collective;
  int64_t elements = 0;  // of its result
};

int64_t elements_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

class Combiner {
 public:
  Combiner(DevicePlan* p, const Mesh& mesh) : p_(p), mesh_(mesh) {}

  void run() {
    std::vector<Instruction> code = std::move(p_->code);
    p_->code.clear();
    for (int slot : p_->input_slots) written(slot);
    code_ = &code;
    waiting_.resize(code.size());
    done_.resize(code.size(), false);
    for (size_t k = 0; k < code.size(); ++k) {
      const Instruction& i = code[k];
      for (int slot : i.in) {
        if (!is_written(slot) && readers_[slot].insert(static_cast<int>(k)).second) ++waiting_[k];
      }
      if (waiting_[k] == 0) ready_.push(static_cast<int>(k));
      drain();
    }
    while (!buckets_.empty()) {
      flush(earliest_bucket());
      drain();
    }
    // Every slot is written before it is read (passes.h), so nothing waits now; were it not so,
    // what waits still goes out, in its order, rather than being lost.
    for (size_t k = 0; k < code.size(); ++k) {
      if (!done_[k]) p_->code.push_back(std::move(code[k]));
    }
  }

 private:
  using Key = std::tuple<int, std::string, int, int>;  // kind, axes (an all_reduce's sorted), reduce op, dtype
  struct Bucket {
    std::vector<Held> held;
    std::vector<int> order;  // the original positions of the held collectives
    int64_t bytes = 0;
  };

  static bool combinable(const Instruction& i) {
    return i.kind == Instruction::Kind::kCollective &&
           (i.collective.kind == CollectiveKind::kAllReduce || i.collective.kind == CollectiveKind::kReduceScatter ||
            i.collective.kind == CollectiveKind::kAllGather) &&
           !i.relayout.has_value() && !i.axes.empty() &&
           (i.collective.kind != CollectiveKind::kAllGather || i.in.size() == 1);
  }

  bool is_written(int slot) const { return slot >= 0 && slot < static_cast<int>(written_.size()) && written_[slot]; }

  // `slot` now holds its value: what read only it and other written slots is ready.
  void written(int slot) {
    if (slot < 0) return;
    if (slot >= static_cast<int>(written_.size())) written_.resize(slot + 1, false);
    written_[slot] = true;
    auto it = readers_.find(slot);
    if (it == readers_.end()) return;
    for (int k : it->second) {
      if (--waiting_[k] == 0) ready_.push(k);
    }
    readers_.erase(it);
  }

  // Runs what is ready, earliest first: combinable collectives into their buckets, the rest out.
  void drain() {
    while (!ready_.empty()) {
      const int k = ready_.top();
      ready_.pop();
      done_[k] = true;
      Instruction& i = (*code_)[k];
      if (combinable(i)) {
        hold(std::move(i), k);
        continue;
      }
      const int out = i.out;
      const std::vector<int> extra = i.extra_out;
      p_->code.push_back(std::move(i));
      written(out);
      for (int slot : extra) written(slot);
    }
  }

  std::map<Key, Bucket>::iterator earliest_bucket() {
    auto best = buckets_.begin();
    for (auto it = buckets_.begin(); it != buckets_.end(); ++it) {
      if (it->second.order.front() < best->second.order.front()) best = it;
    }
    return best;
  }

  void hold(Instruction i, int position) {
    std::vector<std::string> axes = i.axes;
    // A sum over ('data', 'model') is one over ('model', 'data'); a scatter's or a gather's axes
    // order its blocks.
    if (i.collective.kind == CollectiveKind::kAllReduce) std::sort(axes.begin(), axes.end());
    const Key key{static_cast<int>(i.collective.kind), absl::StrJoin(axes, ","),
                  static_cast<int>(i.collective.reduce_op), static_cast<int>(i.node.dtype)};
    Held held{std::move(i), 0};
    held.elements = elements_of(held.collective.node.shape);
    // A reduce_scatter's message is its operand, the group's blocks; an all_gather's its result.
    const int64_t rows =
        held.collective.collective.kind == CollectiveKind::kReduceScatter ? group_size(held.collective.axes) : 1;
    const int64_t bytes = rows * held.elements * dtype_size(held.collective.node.dtype);
    auto it = buckets_.find(key);
    if (it != buckets_.end() && it->second.bytes + bytes > kCombineBytes) {
      flush(it);
      it = buckets_.end();
    }
    if (it == buckets_.end()) it = buckets_.emplace(key, Bucket{}).first;
    it->second.bytes += bytes;
    it->second.order.push_back(position);
    it->second.held.push_back(std::move(held));
  }

  void flush(std::map<Key, Bucket>::iterator it) {
    std::vector<Held> held = std::move(it->second.held);
    buckets_.erase(it);
    if (held.size() == 1) {
      const int out = held[0].collective.out;
      p_->code.push_back(std::move(held[0].collective));
      written(out);
      return;
    }
    const Instruction& first = held[0].collective;
    const DType dtype = first.node.dtype;
    const bool scatter = first.collective.kind == CollectiveKind::kReduceScatter;
    const bool gather = first.collective.kind == CollectiveKind::kAllGather;
    const std::string cause = absl::StrCat("combined ", held.size(),
                                           scatter  ? " reduce_scatters"
                                           : gather ? " all_gathers"
                                                    : " all_reduces");
    // Each operand as rows: one for an all_reduce (1-D) and an all_gather (its block), one per
    // device of the group for a reduce_scatter (row j the block device j keeps); joined along
    // the last dimension.
    const int64_t rows = scatter || gather ? group_size(first.axes) : 1;
    std::vector<int64_t> parts;  // each operand's elements per row
    std::vector<int> laid_out;
    int64_t total = 0;
    for (const Held& h : held) {
      const int64_t part = gather ? h.elements / rows : h.elements;
      parts.push_back(part);
      laid_out.push_back(scatter  ? as_rows(h, rows)
                         : gather ? kernel(Op::kReshape, dtype, {1, part}, {h.collective.in[0]}, h.collective.cause)
                                  : kernel(Op::kReshape, dtype, {part}, {h.collective.in[0]}, h.collective.cause));
      total += part;
    }
    const Shape whole = scatter ? Shape{rows, total} : gather ? Shape{1, total} : Shape{total};
    Instruction concat = make_kernel(Op::kConcatenate, dtype, whole, laid_out, cause);
    concat.node.attributes = ConcatAttrs{static_cast<int64_t>(whole.size()) - 1};
    const int joined = push(std::move(concat));
    Instruction combined = first;
    combined.in = {joined};
    combined.node.shape = scatter ? Shape{1, total} : gather ? Shape{rows, total} : Shape{total};
    combined.collective.dimension = 0;
    combined.cause = cause;
    combined.out = p_->num_slots++;
    const int result = combined.out;
    p_->code.push_back(std::move(combined));
    int64_t offset = 0;
    for (size_t k = 0; k < held.size(); ++k) {
      const Held& h = held[k];
      const int64_t n = parts[k], height = gather ? rows : 1;
      const Shape part_shape = scatter || gather ? Shape{height, n} : Shape{n};
      Instruction part = make_kernel(Op::kSlice, dtype, part_shape, {result}, h.collective.cause);
      part.node.attributes = scatter || gather ? SliceAttrs{{0, offset}, {height, offset + n}, {}}
                                               : SliceAttrs{{offset}, {offset + n}, {}};
      offset += n;
      int sliced = push(std::move(part));
      if (gather) sliced = rows_as_gathered(h, sliced, rows);
      Instruction back = make_kernel(Op::kReshape, dtype, h.collective.node.shape, {sliced}, h.collective.cause);
      back.out = h.collective.out;  // where the held collective's readers look
      p_->code.push_back(std::move(back));
    }
    for (const Held& h : held) written(h.collective.out);
  }

  // The devices of one replica group over `axes`.
  int64_t group_size(const std::vector<std::string>& axes) const {
    int64_t n = 1;
    for (const std::string& axis : axes) n *= mesh_.axis_size(axis);
    return n;
  }

  // Reduce_scatter `h`'s operand (its block's shape with the scattered dimension d times `n`)
  // as an (n, e) array whose row j is the block of e elements device j keeps: (before, n, e /
  // before) in row-major order, `before` the product of the dimensions before d, holds block j
  // at [:, j, :], so its first two dimensions are swapped unless before is 1.
  int as_rows(const Held& h, int64_t n) {
    const Instruction& rs = h.collective;
    const DType dtype = rs.node.dtype;
    int64_t before = 1;
    for (int d = 0; d < rs.collective.dimension; ++d) before *= rs.node.shape[d];
    if (before == 1) return kernel(Op::kReshape, dtype, {n, h.elements}, {rs.in[0]}, rs.cause);
    const int split = kernel(Op::kReshape, dtype, {before, n, h.elements / before}, {rs.in[0]}, rs.cause);
    Instruction swap = make_kernel(Op::kTranspose, dtype, {n, before, h.elements / before}, {split}, rs.cause);
    swap.node.attributes = TransposeAttrs{{1, 0, 2}};
    return kernel(Op::kReshape, dtype, {n, h.elements}, {push(std::move(swap))}, rs.cause);
  }

  // All_gather `h`'s result from the (n, e) array in `slot` whose row j is device j's block of
  // e elements: as_rows's layout, undone. Returns a slot that a reshape to the result's shape
  // reads: `slot` itself when before is 1, else (n, before, e / before) with its first two
  // dimensions swapped.
  int rows_as_gathered(const Held& h, int slot, int64_t n) {
    const Instruction& ag = h.collective;
    const DType dtype = ag.node.dtype;
    const int64_t e = h.elements / n;
    int64_t before = 1;
    for (int d = 0; d < ag.collective.dimension; ++d) before *= ag.node.shape[d];
    if (before == 1) return slot;
    const int split = kernel(Op::kReshape, dtype, {n, before, e / before}, {slot}, ag.cause);
    Instruction swap = make_kernel(Op::kTranspose, dtype, {before, n, e / before}, {split}, ag.cause);
    swap.node.attributes = TransposeAttrs{{1, 0, 2}};
    return push(std::move(swap));
  }

  Instruction make_kernel(Op op, DType dtype, Shape shape, std::vector<int> in, const std::string& cause) {
    Instruction i;
    i.kind = Instruction::Kind::kKernel;
    i.in = std::move(in);
    i.node.op = op;
    i.node.dtype = dtype;
    i.node.shape = std::move(shape);
    i.node.operands = i.in;
    i.cause = cause;
    i.out = -1;
    return i;
  }
  int push(Instruction i) {
    i.out = p_->num_slots++;
    const int out = i.out;
    p_->code.push_back(std::move(i));
    return out;
  }
  int kernel(Op op, DType dtype, Shape shape, std::vector<int> in, const std::string& cause) {
    return push(make_kernel(op, dtype, std::move(shape), std::move(in), cause));
  }

  DevicePlan* p_;
  const Mesh& mesh_;
  std::vector<Instruction>* code_ = nullptr;  // the program as it came, by original position
  std::map<Key, Bucket> buckets_;
  std::vector<bool> written_;                                            // by slot
  std::map<int, std::set<int>> readers_;                                 // unwritten slot -> positions waiting on it
  std::vector<int> waiting_;                                             // by position: unwritten slots it reads
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready_;  // positions, earliest first
  std::vector<bool> done_;                                               // by position: emitted or held
};

}  // namespace

void combine_collectives(DevicePlan* program, const Mesh& mesh) { Combiner(program, mesh).run(); }

}  // namespace tessera

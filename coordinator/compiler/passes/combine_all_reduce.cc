// The all-reduce combiner (XLA's AllReduceCombiner): independent all_reduces over the same
// mesh axes (as a set), reduce op and dtype become one, on the concatenation of their flattened
// operands, up to kCombineBytes per message. A data-parallel step all-reduces one gradient per
// parameter, and a global-norm clip one scalar per parameter; on these machines a small
// collective costs its latency (a round of messages between the devices), not its bytes, so
// one message for all of them saves nearly all of it.
//
// Independence is by data flow, not position: the program is re-scheduled as a list scheduler
// would (Kahn's algorithm, ties broken by the original order). An instruction is emitted once
// every slot it reads is written; an all_reduce whose operand is ready is held in its bucket
// instead, and what reads its result waits. So the readers of a held all_reduce (the clip's
// running `total + sum(g*g)`) move after the later, independent all_reduces, which join the
// bucket. A bucket is emitted when it is full, or when nothing else can run (then the bucket
// holding the earliest all_reduce): reshape each operand to 1-D, concatenate, all_reduce, slice
// each part out and reshape it back into the original slot. Every device runs the same
// program, so every device runs the collectives in the same new order.
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
  Instruction all_reduce;
  int64_t elements = 0;
};

int64_t elements_of(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

class Combiner {
 public:
  explicit Combiner(DevicePlan* p) : p_(p) {}

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
  using Key = std::tuple<std::string, int, int>;  // axes (sorted), reduce op, dtype
  struct Bucket {
    std::vector<Held> held;
    std::vector<int> order;  // the original positions of the held all_reduces
    int64_t bytes = 0;
  };

  static bool combinable(const Instruction& i) {
    return i.kind == Instruction::Kind::kCollective && i.collective.kind == CollectiveKind::kAllReduce &&
           !i.relayout.has_value() && !i.axes.empty();
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

  // Runs what is ready, earliest first: all_reduces into their buckets, the rest out.
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
    std::sort(axes.begin(), axes.end());  // a sum over ('data', 'model') is one over ('model', 'data')
    const Key key{absl::StrJoin(axes, ","), static_cast<int>(i.collective.reduce_op), static_cast<int>(i.node.dtype)};
    Held held{std::move(i), 0};
    held.elements = elements_of(held.all_reduce.node.shape);
    const int64_t bytes = held.elements * dtype_size(held.all_reduce.node.dtype);
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
      const int out = held[0].all_reduce.out;
      p_->code.push_back(std::move(held[0].all_reduce));
      written(out);
      return;
    }
    const Instruction& first = held[0].all_reduce;
    const DType dtype = first.node.dtype;
    const std::string cause = absl::StrCat("combined ", held.size(), " all_reduces");
    std::vector<int> flat;
    int64_t total = 0;
    for (const Held& h : held) {
      flat.push_back(kernel(Op::kReshape, dtype, {h.elements}, {h.all_reduce.in[0]}, h.all_reduce.cause));
      total += h.elements;
    }
    Instruction concat = make_kernel(Op::kConcatenate, dtype, {total}, flat, cause);
    concat.node.attributes = ConcatAttrs{0};
    const int joined = push(std::move(concat));
    Instruction reduce = first;
    reduce.in = {joined};
    reduce.node.shape = {total};
    reduce.cause = cause;
    reduce.out = p_->num_slots++;
    const int reduced = reduce.out;
    p_->code.push_back(std::move(reduce));
    int64_t offset = 0;
    for (Held& h : held) {
      Instruction part = make_kernel(Op::kSlice, dtype, {h.elements}, {reduced}, h.all_reduce.cause);
      part.node.attributes = SliceAttrs{{offset}, {offset + h.elements}};
      offset += h.elements;
      const int sliced = push(std::move(part));
      Instruction back = make_kernel(Op::kReshape, dtype, h.all_reduce.node.shape, {sliced}, h.all_reduce.cause);
      back.out = h.all_reduce.out;  // where the held all_reduce's readers look
      p_->code.push_back(std::move(back));
    }
    for (const Held& h : held) written(h.all_reduce.out);
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
  std::vector<Instruction>* code_ = nullptr;  // the program as it came, by original position
  std::map<Key, Bucket> buckets_;
  std::vector<bool> written_;                                            // by slot
  std::map<int, std::set<int>> readers_;                                 // unwritten slot -> positions waiting on it
  std::vector<int> waiting_;                                             // by position: unwritten slots it reads
  std::priority_queue<int, std::vector<int>, std::greater<int>> ready_;  // positions, earliest first
  std::vector<bool> done_;                                               // by position: emitted or held
};

}  // namespace

void combine_all_reduces(DevicePlan* program) { Combiner(program).run(); }

}  // namespace tessera

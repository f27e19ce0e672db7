// The all-reduce combiner (XLA's AllReduceCombiner): independent all_reduces over the same
// mesh axes, reduce op and dtype become one, on the concatenation of their flattened operands,
// up to kCombineBytes per message. A data-parallel step all-reduces one gradient per
// parameter; on these machines a small collective costs its latency (a round of messages
// between the devices), not its bytes, so one message for all of them saves nearly all of it.
//
// An all_reduce is held back until an instruction (or an output) reads its result, or its
// bucket is full; then the bucket is emitted right there: reshape each operand to 1-D,
// concatenate, all_reduce, slice each part out and reshape it back into the original slot.
// Holding back is safe: nothing in between reads the held results, and operands never change.
#include <map>
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
    for (Instruction& i : code) {
      for (int s : i.in) flush_reading(s);
      if (combinable(i)) {
        hold(std::move(i));
      } else {
        p_->code.push_back(std::move(i));
      }
    }
    while (!buckets_.empty()) flush(buckets_.begin());
  }

 private:
  using Key = std::tuple<std::string, int, int>;  // axes, reduce op, dtype
  struct Bucket {
    std::vector<Held> held;
    int64_t bytes = 0;
  };

  static bool combinable(const Instruction& i) {
    return i.kind == Instruction::Kind::kCollective && i.collective.kind == CollectiveKind::kAllReduce &&
           !i.relayout.has_value() && !i.axes.empty();
  }

  void hold(Instruction i) {
    const Key key{absl::StrJoin(i.axes, ","), static_cast<int>(i.collective.reduce_op), static_cast<int>(i.node.dtype)};
    Held held{std::move(i), 0};
    held.elements = elements_of(held.all_reduce.node.shape);
    const int64_t bytes = held.elements * dtype_size(held.all_reduce.node.dtype);
    auto it = buckets_.find(key);
    if (it != buckets_.end() && it->second.bytes + bytes > kCombineBytes) {
      flush(it);
      it = buckets_.end();
    }
    if (it == buckets_.end()) it = buckets_.emplace(key, Bucket{}).first;
    held_by_[held.all_reduce.out] = key;
    it->second.bytes += bytes;
    it->second.held.push_back(std::move(held));
  }

  // Emits the bucket holding the all_reduce that writes `slot`, if one does.
  void flush_reading(int slot) {
    auto h = held_by_.find(slot);
    if (h == held_by_.end()) return;
    flush(buckets_.find(h->second));
  }

  void flush(std::map<Key, Bucket>::iterator it) {
    std::vector<Held> held = std::move(it->second.held);
    buckets_.erase(it);
    for (const Held& h : held) held_by_.erase(h.all_reduce.out);
    if (held.size() == 1) {
      p_->code.push_back(std::move(held[0].all_reduce));
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
  std::map<Key, Bucket> buckets_;
  std::map<int, Key> held_by_;  // out slot of a held all_reduce -> its bucket
};

}  // namespace

void combine_all_reduces(DevicePlan* program) { Combiner(program).run(); }

}  // namespace tessera

// Batching random_bits over a batch of keys (or of counters: fold_in of mapped data). The op
// takes a batch of keys itself (core/op.h: keys uint32[batch..., 2], one int64 counter each,
// each key's bits batch dimensions first), as JAX's random_bits_p takes keys of any shape and
// its threefry2x32 primitive is elementwise over them (jax/_src/random/prng.py,
// threefry2x32.py): so a batched node is the same node on the batched keys and counters, the
// unbatched one of the two broadcast, and runs as one kernel over the batch. Each example's
// bits are those of its own key at its own counter: bitwise the unbatched calls' values.
#include <utility>
#include <vector>

#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> random_bits_rule(const BatchArgs& a) {
  Shape shape = {a.size};
  shape.insert(shape.end(), a.node.shape.begin(), a.node.shape.end());
  return a.add(a.node, {a.batched_operand(0), a.batched_operand(1)}, std::move(shape));
}

constexpr BatchEntry kRules[] = {{Op::kRandomBits, random_bits_rule}};

}  // namespace

absl::Span<const BatchEntry> random_batching() { return kRules; }

}  // namespace tessera::internal

// Batching random_bits over a batch of keys (or of counters: fold_in of mapped data). Each
// example's bits are random_bits of its own key and counter, so a batched node is a scan over
// the examples running the op once per key (tessera::scan: a loop on the devices, never
// unrolled, of one iteration per example), with the results stacked: bitwise the values of
// the unbatched calls one by one, as JAX's vmap of threefry gives them (its threefry2x32
// primitive is elementwise over the keys, jax/_src/prng.py). Where JAX computes the batch in
// one vectorised kernel, this runs the batch in sequence on each device.
#include <utility>
#include <vector>

#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> random_bits_rule(const BatchArgs& a) {
  const Node node = a.node;
  const ScanResult r = scan(
      [&node](const std::vector<Value>&, const std::vector<Value>& row) {
        TraceState* t = TraceState::common({&row[0], &row[1]});
        if (t == nullptr) return ScanStep{{}, {Value()}};
        Node n = node;
        n.operands = {TraceState::id(row[0]), TraceState::id(row[1])};
        return ScanStep{{}, {t->make(t->graph.add_node(std::move(n)))}};
      },
      {}, {a.batched_operand(0), a.batched_operand(1)});
  if (r.ys.size() != 1) return absl::InvalidArgumentError("random_bits: its batching scan failed");
  return r.ys[0];
}

constexpr BatchEntry kRules[] = {{Op::kRandomBits, random_bits_rule}};

}  // namespace

absl::Span<const BatchEntry> random_batching() { return kRules; }

}  // namespace tessera::internal

// Batching dot_general: two batched operands pair their batch dimensions as a new leading
// batch dimension of the contraction; one batched operand carries it as a free dimension,
// moved to the front afterwards.
#include "client/batching/batching.h"

namespace tessera::internal {
namespace {

absl::StatusOr<Value> dot_rule(const BatchArgs& a) {
  const DotDims& d = a.node.attrs<DotAttrs>().dims;
  DotDims dims = d;
  if (a.batched[0]) {
    dims.lhs_batch = shifted(d.lhs_batch);
    dims.lhs_contracting = shifted(d.lhs_contracting);
  }
  if (a.batched[1]) {
    dims.rhs_batch = shifted(d.rhs_batch);
    dims.rhs_contracting = shifted(d.rhs_contracting);
  }
  if (a.batched[0] && a.batched[1]) {
    dims.lhs_batch.insert(dims.lhs_batch.begin(), 0);
    dims.rhs_batch.insert(dims.rhs_batch.begin(), 0);
    return dot_general(a.x[0], a.x[1], std::move(dims));  // the batch dimensions come first
  }
  // The result is (batch dims, lhs free dims, rhs free dims), each operand's free dimensions
  // in order: the new dimension 0 is the first free one of its operand.
  const int64_t nb = static_cast<int64_t>(d.lhs_batch.size());
  const int64_t lhs_free = a.x[0].rank() - nb - static_cast<int64_t>(d.lhs_contracting.size());
  const int64_t at = a.batched[0] ? nb : nb + lhs_free;
  return move_dim(dot_general(a.x[0], a.x[1], std::move(dims)), at, 0);
}

constexpr BatchEntry kRules[] = {{Op::kDotGeneral, dot_rule}};

}  // namespace

absl::Span<const BatchEntry> dot_batching() { return kRules; }

}  // namespace tessera::internal

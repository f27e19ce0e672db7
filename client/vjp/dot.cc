// The VJP of dot_general: each operand's cotangent is another dot_general.
#include <algorithm>
#include <numeric>

#include "absl/status/status.h"
#include "client/vjp/vjp.h"

namespace tessera::internal {
namespace {

// The cotangent of one operand of a dot_general, from the result's cotangent `g` and the
// other operand: a dot_general contracting g's dimensions of the other's free ones with
// those, ordered so that for the usual layouts (lhs [batch, free, contracting], rhs [batch,
// contracting, free]) it comes out in the operand's own order; otherwise a transpose follows.
// `lhs` says which operand.
Value dot_cotangent(const Value& g, const Value& other, const DotDims& dd, bool lhs, int64_t operand_rank) {
  const std::vector<int64_t>& my_batch = lhs ? dd.lhs_batch : dd.rhs_batch;
  const std::vector<int64_t>& my_contracting = lhs ? dd.lhs_contracting : dd.rhs_contracting;
  const std::vector<int64_t>& other_batch = lhs ? dd.rhs_batch : dd.lhs_batch;
  const std::vector<int64_t>& other_contracting = lhs ? dd.rhs_contracting : dd.lhs_contracting;
  const int64_t nb = static_cast<int64_t>(my_batch.size());
  const std::vector<int64_t> my_free = dot_free_dims(operand_rank, my_batch, my_contracting);
  const std::vector<int64_t> other_free = dot_free_dims(other.rank(), other_batch, other_contracting);
  // g's dimensions: batch, lhs free, rhs free; the other operand's free ones are contracted.
  const int64_t other_free_start = lhs ? nb + static_cast<int64_t>(my_free.size()) : nb;
  std::vector<int64_t> g_batch(nb), g_contracting;
  std::iota(g_batch.begin(), g_batch.end(), 0);
  for (size_t k = 0; k < other_free.size(); ++k) g_contracting.push_back(other_free_start + static_cast<int64_t>(k));
  // lhs: dot(g, rhs) gives [batch, my free, my contracting]; rhs: dot(lhs, g) gives [batch,
  // my contracting, my free]. "My contracting" dimensions come in the order of the other's
  // contracting dimensions they pair with, sorted.
  const Value d = lhs ? dot_general(g, other, DotDims{g_batch, other_batch, g_contracting, other_free})
                      : dot_general(other, g, DotDims{other_batch, g_batch, other_free, g_contracting});
  std::vector<int64_t> sorted_other_contracting = other_contracting;
  std::sort(sorted_other_contracting.begin(), sorted_other_contracting.end());
  const int64_t free_at = lhs ? nb : nb + static_cast<int64_t>(my_contracting.size());
  const int64_t contracting_at = lhs ? nb + static_cast<int64_t>(my_free.size()) : nb;
  std::vector<int64_t> perm(operand_rank);
  for (int64_t i = 0; i < nb; ++i) perm[my_batch[i]] = i;
  for (size_t k = 0; k < my_free.size(); ++k) perm[my_free[k]] = free_at + static_cast<int64_t>(k);
  for (size_t j = 0; j < my_contracting.size(); ++j) {
    const int64_t r =
        std::find(sorted_other_contracting.begin(), sorted_other_contracting.end(), other_contracting[j]) -
        sorted_other_contracting.begin();
    perm[my_contracting[j]] = contracting_at + r;
  }
  // Operand dimension i is d's dimension perm[i]: transpose's own convention.
  bool identity = true;
  for (size_t i = 0; i < perm.size(); ++i) identity = identity && perm[i] == static_cast<int64_t>(i);
  return identity ? d : transpose(d, perm);
}

}  // namespace

absl::Span<const VjpEntry> dot_vjps() {
  static const VjpEntry kRules[] = {
      {Op::kDotGeneral,
       [](const VjpArgs& a) {
         // In explicit mode each cotangent is laid out as its operand (the contraction over a
         // dimension the result's cotangent splits is otherwise ambiguous).
         const DotDims& dd = a.node.attrs<DotAttrs>().dims;
         a.add(0, typed_as(a.x[0], [&] { return dot_cotangent(a.g, a.x[1], dd, /*lhs=*/true, a.x[0].rank()); }));
         a.add(1, typed_as(a.x[1], [&] { return dot_cotangent(a.g, a.x[0], dd, /*lhs=*/false, a.x[1].rank()); }));
         return absl::OkStatus();
       }},
  };
  return kRules;
}

}  // namespace tessera::internal

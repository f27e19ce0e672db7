// VJPs of the layout ops (broadcast_in_dim, reshape, transpose, slice, rev, concatenate) and of
// sharding_constraint: each moves the cotangent back the way the op moved elements.
#include <algorithm>

#include "absl/status/status.h"
#include "client/vjp/vjp.h"

namespace tessera::internal {
namespace {

// The inverse of a permutation.
std::vector<int64_t> inverse(const std::vector<int64_t>& perm) {
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return inv;
}

// The cotangent of a broadcast_in_dim's operand: summed over the dimensions it was
// broadcast along (new ones, and stretched size-1 ones), back in the operand's shape. The
// graph keeps `dims` increasing, so what remains is in the operand's order.
Value unbroadcast(const Value& g, const Shape& in, const Shape& out, const std::vector<int64_t>& dims) {
  std::vector<int64_t> summed;
  for (int64_t r = 0; r < static_cast<int64_t>(out.size()); ++r) {
    auto it = std::find(dims.begin(), dims.end(), r);
    if (it == dims.end() || in[it - dims.begin()] != out[r]) summed.push_back(r);
  }
  return reshape(summed.empty() ? g : sum(g, summed), in);
}

// The cotangent of a slice's operand: g padded with zeros back to the operand's shape.
Value unslice(const Value& g, const Shape& in, const std::vector<int64_t>& start, const std::vector<int64_t>& limit) {
  Value out = g;
  for (size_t d = 0; d < in.size(); ++d) {
    std::vector<Value> parts;
    Shape shape = out.shape();
    if (start[d] > 0) {
      shape[d] = start[d];
      parts.push_back(full(shape, 0.0, g.dtype()));
    }
    parts.push_back(out);
    if (limit[d] < in[d]) {
      shape[d] = in[d] - limit[d];
      parts.push_back(full(shape, 0.0, g.dtype()));
    }
    if (parts.size() > 1) out = concatenate(parts, static_cast<int64_t>(d));
  }
  return out;
}

}  // namespace

absl::Span<const VjpEntry> layout_vjps() {
  static const VjpEntry kRules[] = {
      {Op::kBroadcastInDim,
       [](const VjpArgs& a) {
         // In explicit mode laid out as the operand (JAX's _broadcast_in_dim_transpose_rule:
         // reduce_sum(ct, axes, out_sharding=operand.aval.sharding)).
         a.add(0, typed_as(a.x[0], [&] {
                 return unbroadcast(a.g, a.x[0].shape(), a.node.shape, a.node.attrs<BroadcastAttrs>().result_dims);
               }));
         return absl::OkStatus();
       }},
      {Op::kReshape,
       [](const VjpArgs& a) {
         // In explicit mode laid out as the operand (JAX's _reshape_transpose_rule:
         // out_sharding=operand.aval.sharding); a split dimension moved back is otherwise ambiguous.
         a.add(0, typed_as(a.x[0], [&] { return reshape(a.g, a.x[0].shape()); }));
         return absl::OkStatus();
       }},
      {Op::kTranspose,
       [](const VjpArgs& a) {
         a.add(0, transpose(a.g, inverse(a.node.attrs<TransposeAttrs>().permutation)));
         return absl::OkStatus();
       }},
      {Op::kSlice,
       [](const VjpArgs& a) {
         const SliceAttrs& s = a.node.attrs<SliceAttrs>();
         // Unit strides keep unslice's concatenations (pad with no interior would build the
         // same ones, through pad's explicit-mode type rule), so those plans are unchanged.
         if (s.strides.empty()) {
           a.add(0, unslice(a.g, a.x[0].shape(), s.start, s.limit));
           return absl::OkStatus();
         }
         // slicing.py's _slice_transpose_fancy: the cotangent padded with zeros, stride - 1
         // between its elements and up to the last kept index's end (real_limits) after them.
         // Pad's interior fill cuts its last run, which gathers a split dimension; an aligned
         // dimension (start < stride, n * stride = the dimension: x[::2], x[1::2]) is instead
         // spread as each element's run of `stride`, zeros around it at `start`, and merged
         // back: no cut, so a split dimension stays split (the forward rule's aligned case). On
         // Explicit axes pad is kept: its type rule is JAX's, where the merging reshape's split
         // would be ambiguous.
         const Value zero = full({}, 0.0, a.g.dtype());
         const bool spread = !typed_operand(a.g).has_value();
         Value gx = a.g;
         std::vector<PadDim> config;
         bool padded = false;
         for (size_t d = 0; d < s.start.size(); ++d) {
           const int64_t n = a.g.shape()[d], dim = a.x[0].shape()[d], stride = s.stride(d);
           if (spread && stride > 1 && s.aligned(d, dim, n)) {
             Shape runs = gx.shape();
             runs.insert(runs.begin() + static_cast<int64_t>(d) + 1, 1);
             std::vector<PadDim> around(runs.size(), PadDim{0, 0, 0});
             around[d + 1] = {s.start[d], stride - 1 - s.start[d], 0};
             Shape merged = gx.shape();
             merged[d] = dim;
             gx = reshape(pad(reshape(gx, runs), zero, around), merged);
             config.push_back({0, 0, 0});
             continue;
           }
           const int64_t real_limit = s.start[d] + (n == 0 ? 0 : 1 + (n - 1) * stride);
           config.push_back({s.start[d], dim - real_limit, stride - 1});
           padded |= gx.shape()[d] != dim;
         }
         a.add(0, padded ? pad(gx, zero, config) : gx);
         return absl::OkStatus();
       }},
      // lax.rev is linear and its own transpose (lax.py: ad.deflinear2(rev_p, ... rev(t,
      // dimensions))): the cotangent reversed along the same dimensions.
      {Op::kRev,
       [](const VjpArgs& a) {
         a.add(0, rev(a.g, a.node.attrs<ReduceAttrs>().axes));
         return absl::OkStatus();
       }},
      {Op::kConcatenate,
       [](const VjpArgs& a) {
         const int64_t axis = a.node.attrs<ConcatAttrs>().axis;
         int64_t offset = 0;
         for (size_t k = 0; k < a.x.size(); ++k) {
           std::vector<int64_t> begin(a.node.shape.size(), 0), end = a.node.shape;
           begin[axis] = offset;
           end[axis] = offset + a.x[k].shape()[axis];
           offset = end[axis];
           a.add(k, slice(a.g, begin, end));
         }
         return absl::OkStatus();
       }},
      // The cotangent takes the constraint's layout, its unreduced and reduced axes swapped
      // (JAX's P.to_ct_spec, docs/new_docs/301/sharding-ad.md: CT(unreduced) = reduced, laid
      // out as replicated; CT(reduced) = unreduced).
      {Op::kShardingConstraint,
       [](const VjpArgs& a) {
         const NamedSharding& s = a.node.attrs<ShardingAttrs>().sharding;
         const PartitionSpec ct =
             s.spec().partitions_only().with_unreduced(s.spec().reduced()).with_reduced(s.spec().unreduced());
         a.add(0, with_sharding_constraint(a.g, NamedSharding(s.mesh(), ct)));
         return absl::OkStatus();
       }},
      // grad lays each gradient out as its argument (sharding_as); a second grad goes back
      // through it the same way. The layout operand is not differentiated.
      {Op::kShardingAs,
       [](const VjpArgs& a) {
         a.add(0, sharded_like(a.g, a.x[0]));
         return absl::OkStatus();
       }},
  };
  return kRules;
}

}  // namespace tessera::internal

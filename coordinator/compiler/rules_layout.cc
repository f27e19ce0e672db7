// Sharding rules of the layout ops: a split moves with the dimension it is on, and is gathered
// first where the op cuts, joins or stretches that dimension, except where a slice's cut, or a
// concatenate's padding of one operand with constant fills, can be read from each block and
// halos of its neighbours' (slice_window, exchange_halos); slice's, concatenate's and rev's
// partition handlers.
#include <algorithm>
#include <functional>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "coordinator/compiler/rules.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessera::internal {

std::optional<SliceWindow> slice_window(const SliceAttrs& s, size_t d, int64_t dim, int64_t kept, int64_t n) {
  if (n < 2 || kept <= 0 || kept % n != 0 || dim % n != 0) return std::nullopt;
  const int64_t block = dim / n, b = kept / n, stride = s.stride(d);
  SliceWindow w;
  w.first = s.start[d];
  w.step = b * stride - block;
  w.width = (b - 1) * stride + 1;
  w.left.assign(n, 0);
  w.right.assign(n, 0);
  for (int64_t p = 0; p < n; ++p) {
    // Device p's first and last elements, as indices of the dimension, and the first and last
    // of them inside it (the others are a padding's fill).
    const int64_t at = p * block + w.first + p * w.step, last = at + w.width - 1;
    int64_t lo = at, hi = last;
    if (lo < 0) lo += (-lo + stride - 1) / stride * stride;
    if (hi >= dim) hi -= (hi - dim + stride) / stride * stride;
    w.pad_left = std::max(w.pad_left, -at);
    w.pad_right = std::max(w.pad_right, last - (dim - 1));
    if (lo > hi) continue;  // all fill
    w.left[p] = std::max<int64_t>(0, p * block - lo);
    w.right[p] = std::max<int64_t>(0, hi - ((p + 1) * block - 1));
    w.max_left = std::max(w.max_left, w.left[p]);
    w.max_right = std::max(w.max_right, w.right[p]);
  }
  if (w.max_left > block || w.max_right > block || w.max_left + w.max_right >= (n - 1) * block) return std::nullopt;
  for (int64_t p = 0; p < n; ++p) {
    const int64_t off = w.first + p * w.step;
    if (off < -(w.pad_left + w.max_left) || off + w.width > block + w.max_right + w.pad_right) return std::nullopt;
  }
  return w;
}

namespace {

// How reshape maps dimensions: consecutive groups, input [i, i2) and output [o, o2), grown
// until their element counts match (`exact`; false only for a trailing group where the
// shapes run out first). Input dimensions past the last group are in none.
struct ReshapeGroup {
  size_t i, i2, o, o2;
  bool exact;
};

std::vector<ReshapeGroup> reshape_groups(const Shape& in, const Shape& out) {
  std::vector<ReshapeGroup> groups;
  size_t i = 0, o = 0;
  while (i < in.size() && o < out.size()) {
    size_t i2 = i + 1, o2 = o + 1;
    int64_t pi = in[i], po = out[o];
    while (pi != po) {
      if (pi < po && i2 < in.size()) {
        pi *= in[i2++];
      } else if (o2 < out.size()) {
        po *= out[o2++];
      } else {
        break;
      }
    }
    groups.push_back({i, i2, o, o2, pi == po});
    i = i2;
    o = o2;
  }
  return groups;
}

absl::Status broadcast_in_dim(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const Shape& in = c.graph().node(n.operands[0]).shape;
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  Dims d(n.shape.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != n.shape[n.attrs<BroadcastAttrs>().result_dims[i]])
      q.dims[i].clear();  // a stretched dimension cannot stay split
    d[n.attrs<BroadcastAttrs>().result_dims[i]] = q.dims[i];
  }
  // A pending reduction is resolved at the operand's smaller shape, before it is broadcast
  // (`x - max(x, -1, keepdims)` all-reduces the (16, 1) maximum, not a (16, V) copy of it),
  // unless it is typed unreduced: then each device broadcasts its term, and the sum stays
  // pending (explicit mode's _broadcast_in_dim_ur_rule, client/explicit/layout.cc).
  if (num_elements(n.shape) > num_elements(in) && !c.typed_unreduced(n.operands[0])) q.partial.clear();
  c.needs(id) = {q};
  c.set(id, d, q.partial, q.partial_op);
  return absl::OkStatus();
}

DimMap broadcast_in_dim_map(const Graph& g, const Node& n) {
  DimMap m{std::vector<std::vector<int>>(1), std::vector<bool>(n.shape.size(), true)};
  const Shape& in = g.node(n.operands[0]).shape;
  for (size_t i = 0; i < in.size(); ++i) {
    m.follow[0].push_back(in[i] == n.shape[n.attrs<BroadcastAttrs>().result_dims[i]]
                              ? static_cast<int>(n.attrs<BroadcastAttrs>().result_dims[i])
                              : -1);
  }
  return m;
}

absl::Status transpose(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  Dims d;
  for (int64_t p : n.attrs<TransposeAttrs>().permutation) d.push_back(q.dims[p]);
  c.needs(id) = {q};
  c.set(id, d, q.partial, q.partial_op);
  return absl::OkStatus();
}

DimMap transpose_map(const Graph&, const Node& n) {
  const size_t rank = n.shape.size();
  DimMap m{{std::vector<int>(rank, -1)}, std::vector<bool>(rank, true)};
  for (size_t i = 0; i < rank; ++i) m.follow[0][n.attrs<TransposeAttrs>().permutation[i]] = static_cast<int>(i);
  return m;
}

// The dimension of reshape group `g` (input side when `input`) that a split can be on: its
// first one larger than 1 (a split of a later one, or of the first when a larger-than-1
// dimension precedes it, is not a contiguous block of the group), or -1 when all are 1.
int64_t major_dim(const ReshapeGroup& g, const Shape& shape, bool input) {
  for (size_t k = input ? g.i : g.o; k < (input ? g.i2 : g.o2); ++k) {
    if (shape[k] > 1) return static_cast<int64_t>(k);
  }
  return -1;
}

// reshape: dimensions are matched in groups of equal element count. In row-major order a group
// is one contiguous run of elements; a split of its major dimension (the first larger than 1)
// gives each device a contiguous 1/n of the run, which is a split of the major dimension of the
// group's image when that divides by n. So a split survives reshape/squeeze/expand_dims when
// its dimension survives whole, and moves to the dimension it lands in when it can; any other
// split is gathered first.
absl::Status reshape(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const Shape& in = c.graph().node(n.operands[0]).shape;
  const Shape& out = n.shape;
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  Dims d(out.size());
  std::vector<bool> kept(in.size(), false);
  for (const ReshapeGroup& g : reshape_groups(in, out)) {
    const int64_t i = major_dim(g, in, true), o = major_dim(g, out, false);
    if (g.exact && i >= 0 && o >= 0 && !q.dims[i].empty() && out[o] % c.mesh().axes_size(q.dims[i]) == 0) {
      d[o] = q.dims[i];
      kept[i] = true;
    }
  }
  for (size_t i = 0; i < in.size(); ++i) {
    if (!kept[i]) q.dims[i].clear();
  }
  c.needs(id) = {q};
  c.set(id, d, q.partial, q.partial_op);
  return absl::OkStatus();
}

// Each group's major input dimension follows its major output dimension (fits() in the
// backward pass checks that a split divides both); the group's other dimensions stay whole.
DimMap reshape_map(const Graph& g, const Node& n) {
  const Shape& in = g.node(n.operands[0]).shape;
  DimMap m{{std::vector<int>(in.size(), -1)}, std::vector<bool>(n.shape.size(), false)};
  for (const ReshapeGroup& r : reshape_groups(in, n.shape)) {
    const int64_t i = major_dim(r, in, true), o = major_dim(r, n.shape, false);
    if (r.exact && i >= 0 && o >= 0) {
      m.follow[0][i] = static_cast<int>(o);
      m.free[o] = true;
    }
  }
  return m;
}

// Whether dimension d is cut (slice) or joined along (concatenate). A slice leaves d uncut
// when it is aligned there (SliceAttrs::aligned: the whole dimension when the stride is 1).
bool cut(const Graph& g, const Node& n, size_t d) {
  if (n.op != Op::kSlice) return static_cast<int64_t>(d) == n.attrs<ConcatAttrs>().axis;
  return !n.attrs<SliceAttrs>().aligned(d, g.node(n.operands[0]).shape[d], n.shape[d]);
}

// slice, concatenate (a padding's is concatenate's, below): dimensions that are cut or joined
// are gathered first, and so is a kept split a strided slice's shorter result does not divide
// (x[::4] of 8 over 4). A slice that is not aligned with the blocks of a split dimension keeps
// the split when each device's part can be read from its block and halos of its neighbours'
// (slice_window: x[1:29] or x[8:32:2] of 32 over 4); partition_slice exchanges the halos. A
// concatenate resolves a pending sum first, unless every operand's is typed unreduced over the
// same axes (explicit mode's _concatenate_unreduced_rule): then each device joins its terms.
absl::Status slice_or_concatenate(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  ValueSharding q = c.of_or_replicated(n.operands[0]);
  const Shape& in = c.graph().node(n.operands[0]).shape;
  for (size_t d = 0; d < n.shape.size(); ++d) {
    const int64_t devices = c.mesh().axes_size(q.dims[d]);
    const bool halo =
        n.op == Op::kSlice && slice_window(n.attrs<SliceAttrs>(), d, in[d], n.shape[d], devices).has_value();
    if (halo) continue;
    if (cut(c.graph(), n, d) || n.shape[d] % devices != 0) q.dims[d].clear();
  }
  if (n.op == Op::kConcatenate) {
    bool keep = q.is_partial();
    for (int o : n.operands) keep = keep && c.typed_unreduced(o) && same_axes(c.of_or_replicated(o).partial, q.partial);
    if (!keep) q.partial.clear();
  }
  c.needs(id).assign(n.operands.size(), q);
  c.set(id, q.dims, q.partial, q.partial_op);
  return absl::OkStatus();
}

DimMap slice_or_concatenate_map(const Graph& g, const Node& n) {
  DimMap m = identity_map(g, n);
  for (size_t d = 0; d < n.shape.size(); ++d) {
    if (!cut(g, n, d)) continue;
    m.free[d] = false;
    for (auto& f : m.follow) f[d] = -1;
  }
  return m;
}

// The non-trivial mesh axes of `axes` (a permute's positions run over those only).
Axes moving_axes(const Mesh& mesh, const Axes& axes) {
  Axes out;
  for (const std::string& a : axes) {
    if (mesh.axes_size({a}) > 1) out.push_back(a);
  }
  return out;
}

// Device p's window `w` of dimension d of the value in `slot` (of `dtype` and local `shape`,
// dimension d split over mesh `axes`, for which `w` was computed), emitted for node `id`: XLA's
// halo exchange (ExchangeHaloAndGetValidData). Each device sends the tail of its block that the
// next device's window reaches (max_left elements) and the head that the previous one's
// reaches (max_right), one collective_permute per side over the axes, to the devices whose
// window reads there (a device no pair names receives zeros); concatenates [pad_left zeros,
// left halo, own block, right halo, pad_right zeros]; and takes its window of `width` elements
// at pad_left + max_left + first + axis_index * step (a dynamic_slice with i64 starts:
// axis_index * step reaches about twice the dimension, which i32 would wrap past 2^30). Where
// the window lies outside the dimension it reads zeros. Returns its slot, of `shape` with
// `width` along d.
int exchange_halos(PartitionContext& c, int id, DType dtype, int slot, const Shape& shape, size_t d, const Axes& axes,
                   const SliceWindow& w) {
  const size_t rank = shape.size();
  const int64_t devices = c.mesh().axes_size(axes), block = shape[d];
  auto with_d = [&shape, d](int64_t size) {
    Shape piece = shape;
    piece[d] = size;
    return piece;
  };
  // x[lo:hi] along d of the block, whole elsewhere.
  auto block_slice = [&](int64_t lo, int64_t hi) {
    std::vector<int64_t> start(rank, 0), limit(shape.begin(), shape.end());
    start[d] = lo;
    limit[d] = hi;
    return emit_kernel(c, id, Op::kSlice, dtype, with_d(hi - lo), {slot},
                       SliceAttrs{start, limit, std::vector<int64_t>(rank, 1)});
  };
  auto zeros = [&](int64_t size) {
    return emit_kernel(c, id, Op::kConstant, dtype, with_d(size), {}, ConstantAttrs{Scalar(0)});
  };
  std::vector<int> pieces;
  if (w.pad_left > 0) pieces.push_back(zeros(w.pad_left));
  // Side -1: the previous device's tail, to the devices whose window reads it; side +1: the
  // next device's head.
  for (int side : {-1, +1}) {
    const int64_t halo = side < 0 ? w.max_left : w.max_right;
    if (halo > 0) {
      std::vector<int64_t> positions;
      for (int64_t p = 0; p < devices; ++p) {
        if ((side < 0 ? w.left : w.right)[p] > 0) positions.insert(positions.end(), {p + side, p});
      }
      const int sent = side < 0 ? block_slice(block - halo, block) : block_slice(0, halo);
      CollectiveSpec permute;
      permute.kind = CollectiveKind::kCollectivePermute;
      pieces.push_back(emit_collective(c, id, permute, {sent}, axes, std::move(positions), dtype, with_d(halo)));
    }
    if (side < 0) pieces.push_back(slot);
  }
  if (w.pad_right > 0) pieces.push_back(zeros(w.pad_right));
  const int64_t joined = w.pad_left + w.max_left + block + w.max_right + w.pad_right;
  const int buffer = pieces.size() == 1 ? slot
                                        : emit_kernel(c, id, Op::kConcatenate, dtype, with_d(joined), pieces,
                                                      ConcatAttrs{static_cast<int64_t>(d)});
  // The window's start along d, 0 elsewhere.
  std::vector<int> starts;
  for (size_t k = 0; k < rank; ++k) {
    int at = emit_kernel(c, id, Op::kConstant, DType::kI64, {}, {},
                         ConstantAttrs{Scalar(k == d ? w.pad_left + w.max_left + w.first : int64_t{0})});
    if (k == d) {
      at = emit_kernel(c, id, Op::kAdd, DType::kI64, {}, {emit_block_start(c, id, axes, w.step, DType::kI64), at});
    }
    starts.push_back(at);
  }
  const Shape window = with_d(w.width);
  return emit_kernel(c, id, Op::kDynamicSlice, dtype, window, {buffer, emit_start_vector(c, id, starts, DType::kI64)},
                     DynamicSliceAttrs{std::vector<int64_t>(window.begin(), window.end())});
}

// A split dimension the slice is aligned with: each device slices its block of whole runs of
// `stride` elements from the same start. One it is not aligned with (slice_window): each
// device's window of its block and its neighbours' halos (exchange_halos; step is never 0
// there, since XLA's static case, the same window in every block, is Tessera's aligned case),
// one dimension after another, and last every such window sliced with the stride. A pending
// sum passes through: the permutes stay within its replica groups and every step is linear.
absl::Status partition_slice(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ValueSharding& result = c.propagation().result[id];
  const SliceAttrs& attrs = n.attrs<SliceAttrs>();
  const Shape& whole = c.graph().node(n.operands[0]).shape;
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  Instruction inst = c.local_kernel(id, in);
  const Shape out = inst.node.shape;
  SliceAttrs& s = inst.node.attrs<SliceAttrs>();
  if (s.strides.empty()) s.strides.assign(n.shape.size(), 1);
  std::vector<std::pair<size_t, SliceWindow>> halos;
  for (size_t d = 0; d < n.shape.size(); ++d) {
    if (result.dims[d].empty()) continue;
    const int64_t devices = c.mesh().axes_size(result.dims[d]);
    const int64_t block = whole[d] / devices;
    if (attrs.aligned(d, whole[d], n.shape[d])) {
      s.limit[d] = inst.node.shape[d] * s.stride(d);
      continue;
    }
    std::optional<SliceWindow> w = slice_window(attrs, d, whole[d], n.shape[d], devices);
    if (!w) {
      return absl::InternalError(absl::StrCat("partition_slice: ", c.cause(id), " keeps the split of dimension ", d,
                                              " that no window of its blocks reads"));
    }
    halos.emplace_back(d, *std::move(w));
    s.start[d] = 0;
    s.limit[d] = block;
    s.strides[d] = 1;
    inst.node.shape[d] = block;  // the whole block, windowed below
  }
  Shape shape = inst.node.shape;
  // Where every dimension is now kept whole, the local slice is the operand's block itself.
  bool whole_block = true;
  for (size_t d = 0; d < n.shape.size(); ++d) {
    const int64_t devices = c.mesh().axes_size(result.dims[d]);
    whole_block = whole_block && s.start[d] == 0 && s.strides[d] == 1 && s.limit[d] == whole[d] / devices;
  }
  int slot = whole_block && !halos.empty() ? in[0] : c.emit(std::move(inst));
  if (halos.empty()) {
    c.bind(id, slot);
    return absl::OkStatus();
  }
  const size_t rank = shape.size();
  for (const auto& [d, w] : halos) {
    slot = exchange_halos(c, id, n.dtype, slot, shape, d, moving_axes(c.mesh(), result.dims[d]), w);
    shape[d] = w.width;
  }
  bool strided = false;
  std::vector<int64_t> start(rank, 0), limit(shape.begin(), shape.end()), strides(rank, 1);
  for (const auto& [d, w] : halos) {
    strides[d] = attrs.stride(d);
    strided = strided || strides[d] > 1;
  }
  if (strided) {
    slot = emit_kernel(c, id, Op::kSlice, n.dtype, out, {slot}, SliceAttrs{start, limit, strides});
  }
  c.bind(id, slot);
  return absl::OkStatus();
}

// The value every element of concatenate operand `id` holds when it is a constant fill: a
// constant, or a broadcast of a scalar one (lax.pad's fill, client/lax.cc); nullopt otherwise.
std::optional<Scalar> fill_value(const Graph& g, int id) {
  const Node& n = g.node(id);
  if (n.op == Op::kConstant) return n.attrs<ConstantAttrs>().value;
  if (n.op == Op::kBroadcastInDim && g.node(n.operands[0]).shape.empty()) return fill_value(g, n.operands[0]);
  return std::nullopt;
}

// A concatenate that pads its operand `index` with constant fills along its axis: [low fill,
// x, high fill], either fill possibly absent (the slice VJP's unslice, lax.pad without
// interior padding).
struct Padding {
  int64_t low = 0, high = 0;
  Scalar low_fill, high_fill;
};
std::optional<Padding> padding_of(const Graph& g, const Node& n, size_t index) {
  const size_t operands = n.operands.size(), axis = static_cast<size_t>(n.attrs<ConcatAttrs>().axis);
  if (operands < 2 || index > 1 || operands - index > 2) return std::nullopt;
  Padding p;
  if (index == 1) {
    const std::optional<Scalar> fill = fill_value(g, n.operands[0]);
    if (!fill) return std::nullopt;
    p.low = g.node(n.operands[0]).shape[axis];
    p.low_fill = *fill;
  }
  if (index + 1 < operands) {
    const std::optional<Scalar> fill = fill_value(g, n.operands[index + 1]);
    if (!fill) return std::nullopt;
    p.high = g.node(n.operands[index + 1]).shape[axis];
    p.high_fill = *fill;
  }
  return p;
}

// The windows through which the n devices of a padded dimension read its operand's `size`
// elements: padded block j is the operand's [j * B - low, (j + 1) * B - low), a unit-stride
// slice of the padded operand starting at -low.
std::optional<SliceWindow> padding_window(const Padding& p, int64_t size, int64_t n) {
  const int64_t padded = p.low + size + p.high;
  return slice_window(SliceAttrs{{-p.low}, {padded - p.low}, {1}}, 0, size, padded, n);
}

// The operand of concatenate `n` whose split along the axis a padding keeps: the first one
// split there (`split(k)`: operand k's mesh axes along the axis) that is padded with constant
// fills (padding_of) so that each device can read its block through a window one hop away
// (padding_window). The forward rule and the partition handler both choose by it.
struct KeptPadding {
  size_t k = 0;
  Padding padding;
  SliceWindow window;
};
std::optional<KeptPadding> kept_padding(const Graph& g, const Node& n, const Mesh& mesh,
                                        const std::function<Axes(size_t)>& split) {
  const size_t axis = static_cast<size_t>(n.attrs<ConcatAttrs>().axis);
  for (size_t k = 0; k < n.operands.size(); ++k) {
    const Axes axes = split(k);
    if (axes.empty()) continue;
    const std::optional<Padding> p = padding_of(g, n, k);
    if (!p) continue;
    const std::optional<SliceWindow> w = padding_window(*p, g.node(n.operands[k]).shape[axis], mesh.axes_size(axes));
    if (w) return KeptPadding{k, *p, *w};
  }
  return std::nullopt;
}

// concatenate: a padding of an operand split along the axis ([fill, x, fill], padding_of)
// keeps its split when each device's block of the result can be read from its block of x and
// halos of its neighbours' (padding_window; XLA pads a split dimension so, its
// ReshardDataForPad / ExchangeHaloAndGetValidData): the slice VJP's unslice of a halo slice's
// cotangent, and jnp.pad, no longer gather. The fills are not read (partition_concatenate
// makes the fill itself) and are needed as they are; a pending sum of x is resolved first,
// even when every operand's is typed unreduced: in explicit mode such fills (those of a pad of
// an unreduced operand, client/lax.cc) are constant zeros pinned unreduced by a constraint,
// which padding_of does not read as fills, so that concatenate is slice_or_concatenate's, which
// keeps the sum pending (jit_test's UnreducedValuesPassThroughLinearOps counts no all_reduce).
// Any other concatenate is slice_or_concatenate's.
absl::Status concatenate(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const size_t axis = static_cast<size_t>(n.attrs<ConcatAttrs>().axis);
  const std::optional<KeptPadding> kept =
      kept_padding(c.graph(), n, c.mesh(), [&](size_t k) { return c.of_or_replicated(n.operands[k]).dims[axis]; });
  if (!kept) return slice_or_concatenate(c, id);
  ValueSharding q = c.of_or_replicated(n.operands[kept->k]);
  q.partial.clear();
  std::vector<ValueSharding>& needs = c.needs(id);
  needs.clear();
  for (size_t o = 0; o < n.operands.size(); ++o) needs.push_back(o == kept->k ? q : c.of_or_replicated(n.operands[o]));
  c.set(id, q.dims);
  return absl::OkStatus();
}

// A padding whose split concatenate kept: each device's window of its block of x and its
// neighbours' halos (exchange_halos), then the fill selected where the window's position
// j * B + i - low lies outside x. Any other concatenate: the local kernel.
absl::Status partition_concatenate(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const size_t axis = static_cast<size_t>(n.attrs<ConcatAttrs>().axis);
  const ValueSharding& result = c.propagation().result[id];
  if (result.dims[axis].empty()) return partition_kernel(c, id);
  // The operand whose split the result keeps, chosen as concatenate's forward rule chose it.
  const std::optional<KeptPadding> kept =
      kept_padding(c.graph(), n, c.mesh(), [&](size_t k) { return c.propagation().operands[id][k].dims[axis]; });
  if (!kept) {
    return absl::InternalError(absl::StrCat("partition_concatenate: ", c.cause(id), " keeps the split of dimension ",
                                            axis, " that is no padding of a split operand"));
  }
  const size_t k = kept->k;
  const Padding* p = &kept->padding;
  const SliceWindow* w = &kept->window;
  const int x = n.operands[k];
  const int64_t size = c.graph().node(x).shape[axis];
  const ValueSharding& need = c.propagation().operands[id][k];
  TESSERA_ASSIGN_OR_RETURN(const int slot, c.reshard(x, c.propagation().result[x], need, c.cause(id)));
  const Shape block = NamedSharding(c.mesh(), need.spec()).shard_shape(c.graph().node(x).shape);
  const Axes axes = moving_axes(c.mesh(), result.dims[axis]);
  int out = exchange_halos(c, id, n.dtype, slot, block, axis, axes, *w);
  Shape shape = block;
  shape[axis] = w->width;
  // The position in x of each element of the window along the axis.
  const Shape row = {w->width};
  const int origin =
      emit_kernel(c, id, Op::kAdd, DType::kI64, {},
                  {emit_block_start(c, id, axes, w->width, DType::kI64),
                   emit_kernel(c, id, Op::kConstant, DType::kI64, {}, {}, ConstantAttrs{Scalar(-p->low)})});
  const int position =
      emit_kernel(c, id, Op::kAdd, DType::kI64, row,
                  {emit_kernel(c, id, Op::kIota, DType::kI64, row, {}, IotaAttrs{0}),
                   emit_kernel(c, id, Op::kBroadcastInDim, DType::kI64, row, {origin}, BroadcastAttrs{})});
  auto fill_where = [&](Op compare, int64_t bound, const Scalar& value) {
    const int limit = emit_kernel(c, id, Op::kConstant, DType::kI64, row, {}, ConstantAttrs{Scalar(bound)});
    const int outside = emit_kernel(c, id, Op::kBroadcastInDim, DType::kBool, shape,
                                    {emit_kernel(c, id, compare, DType::kBool, row, {position, limit})},
                                    BroadcastAttrs{{static_cast<int64_t>(axis)}});
    const int fill = emit_kernel(c, id, Op::kConstant, n.dtype, shape, {}, ConstantAttrs{value});
    out = emit_kernel(c, id, Op::kSelect, n.dtype, shape, {outside, fill, out});
  };
  if (p->low > 0) fill_where(Op::kLt, 0, p->low_fill);
  if (p->high > 0) fill_where(Op::kGe, size, p->high_fill);
  c.bind(id, out);
  return absl::OkStatus();
}

// rev: the result is laid out as the operand, a split reversed dimension included (JAX's
// _rev_sharding_rule keeps the operand's sharding), and a pending sum passes through (rev is
// linear).
absl::Status rev(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ValueSharding q = c.of_or_replicated(n.operands[0]);
  c.needs(id) = {q};
  c.set(id, q.dims, q.partial, q.partial_op);
  return absl::OkStatus();
}

// Each device reverses its own block; along a split reversed dimension the blocks must also
// trade places: the device at position p along the dimension's mesh axes takes the block of
// position n-1-p. Over the axes of every split reversed dimension together that is one
// collective_permute, p to N-1-p (reversing each axis's digit of a mixed-radix position
// reverses the whole position), never a gather. An unsplit reversed dimension is local.
absl::Status partition_rev(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ValueSharding& result = c.propagation().result[id];
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  Instruction inst = c.local_kernel(id, in);
  const Shape block = inst.node.shape;
  int slot = c.emit(std::move(inst));
  Axes moved;
  for (int64_t d : n.attrs<ReduceAttrs>().axes) {
    const Axes axes = moving_axes(c.mesh(), result.dims[d]);
    moved.insert(moved.end(), axes.begin(), axes.end());
  }
  const int64_t devices = c.mesh().axes_size(moved);
  if (devices > 1) {
    std::vector<int64_t> positions;
    for (int64_t p = 0; p < devices; ++p) positions.insert(positions.end(), {p, devices - 1 - p});
    CollectiveSpec permute;
    permute.kind = CollectiveKind::kCollectivePermute;
    slot = emit_collective(c, id, permute, {slot}, std::move(moved), std::move(positions), n.dtype, block);
  }
  c.bind(id, slot);
  return absl::OkStatus();
}

}  // namespace

absl::Span<const ShardingRuleEntry> layout_rules() {
  static constexpr ShardingRuleEntry kRules[] = {
      {Op::kBroadcastInDim, {broadcast_in_dim, broadcast_in_dim_map}},
      {Op::kTranspose, {transpose, transpose_map}},
      {Op::kReshape, {reshape, reshape_map}},
      {Op::kSlice, {slice_or_concatenate, slice_or_concatenate_map, false, partition_slice}},
      {Op::kConcatenate, {concatenate, slice_or_concatenate_map, false, partition_concatenate}},
      {Op::kRev, {rev, identity_map, false, partition_rev}},
  };
  return kRules;
}

}  // namespace tessera::internal

// Sharding rules of the indexing ops, with their partition handlers.
//
// gather (jnp.take; an embedding lookup): the operand's other dimensions and the indices'
// dimensions carry their splits into the result. Batch dimensions (GatherAttrs.batch_dims: a
// per-example read of a KV cache) are split alike on the operand and the indices (the
// operand's split, or else the indices'), so each device gathers its own examples with no
// collective; a scatter's updates follow them too. An operand split along the indexed dimension
// (a vocabulary-parallel embedding table, P('model', None)) is never gathered: each device
// looks up only the indices that fall in its block of rows (the others give 0), so the result
// is a pending sum over the table's axes, which one all_reduce (psum) resolves where it is
// needed — Megatron's vocabulary-parallel embedding. A table split along another dimension
// needs no communication at all.
//
// scatter, scatter_add (x.at[i].set / add; a gather's transpose): the result is laid out as x;
// a device applies only the updates whose index falls in its block of the indexed dimension
// (the others are dropped). A scatter_add whose indices and updates are split along their
// index dimensions adds each device's share into a pending sum over those axes (x counted once,
// on the first device along them), when resolving that costs less than gathering the updates.
//
// dynamic_slice, dynamic_update_slice: a dimension the window does not cover whole is gathered
// first (its start is traced); a whole-covered dimension keeps its split, its start clamping to 0.
#include <initializer_list>
#include <set>

#include "absl/status/status.h"
#include "coordinator/compiler/rules.h"
#include "core/status.h"

namespace tessera::internal {
namespace {

// Where operand dimension d (d != axis) of a gather lands in its result (and of a scatter's x
// in its updates): before the axis it stays, after it shifts by the indices' rank less one
// (`query_rank`: the indices' dimensions after the batch ones).
int x_dim_in_result(size_t d, int64_t axis, size_t query_rank) {
  return static_cast<int>(static_cast<int64_t>(d) < axis ? d : d - 1 + query_rank);
}

std::set<std::string> axes_of(const Dims& dims) {
  std::set<std::string> out;
  for (const Axes& d : dims) out.insert(d.begin(), d.end());
  return out;
}

bool clashes(const Axes& axes, const std::set<std::string>& taken) {
  for (const std::string& a : axes) {
    if (taken.count(a) > 0) return true;
  }
  return false;
}

// Where dimension k of a gather's indices lands in its result (and in a scatter's updates):
// a batch dimension stays, a query dimension goes after x's dimensions before the axis.
int index_dim_in_result(size_t k, const GatherAttrs& a) {
  const int64_t kk = static_cast<int64_t>(k);
  return static_cast<int>(kk < a.batch_dims ? kk : a.axis + kk - a.batch_dims);
}

// The batch dimensions (GatherAttrs.batch_dims) of x and of the indices (and a scatter's
// updates, `others`) split alike: x's split where it has one, else the first of the others'
// that x leaves free, so each device indexes its own examples and nothing moves but what was
// split otherwise.
void match_batch_dims(int64_t batch_dims, ValueSharding& x, std::initializer_list<ValueSharding*> others) {
  for (int64_t k = 0; k < batch_dims; ++k) {
    for (const ValueSharding* o : others) {
      if (!x.dims[k].empty()) break;
      if (!clashes(o->dims[k], axes_of(x.dims))) x.dims[k] = o->dims[k];
    }
    for (ValueSharding* o : others) o->dims[k] = x.dims[k];
  }
}

absl::Status gather_rule(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const GatherAttrs& a = n.attrs<GatherAttrs>();
  const int64_t axis = a.axis;
  ValueSharding x = c.of_or_replicated(n.operands[0]), i = c.of_or_replicated(n.operands[1]);
  x.partial.clear();
  i.partial.clear();
  // A bool table is gathered whole along the axis: a pending sum of bools is not defined.
  if (n.dtype == DType::kBool) x.dims[axis].clear();
  match_batch_dims(a.batch_dims, x, {&i});
  std::set<std::string> taken = axes_of(x.dims);
  for (size_t k = static_cast<size_t>(a.batch_dims); k < i.dims.size(); ++k) {
    if (clashes(i.dims[k], taken)) i.dims[k].clear();
    taken.insert(i.dims[k].begin(), i.dims[k].end());
  }
  Dims out(x.dims.begin(), x.dims.begin() + axis);
  out.insert(out.end(), i.dims.begin() + a.batch_dims, i.dims.end());
  out.insert(out.end(), x.dims.begin() + axis + 1, x.dims.end());
  std::vector<std::string> partial = x.dims[axis];
  c.needs(id) = {x, i};
  c.set(id, std::move(out), std::move(partial));
  return absl::OkStatus();
}

DimMap gather_map(const Graph& g, const Node& n) {
  const GatherAttrs& a = n.attrs<GatherAttrs>();
  const size_t rank = g.node(n.operands[0]).shape.size(), index_rank = g.node(n.operands[1]).shape.size();
  DimMap m{std::vector<std::vector<int>>(2), std::vector<bool>(n.shape.size(), true)};
  for (size_t d = 0; d < rank; ++d) {
    m.follow[0].push_back(static_cast<int64_t>(d) == a.axis ? -1
                                                            : x_dim_in_result(d, a.axis, index_rank - a.batch_dims));
  }
  for (size_t k = 0; k < index_rank; ++k) m.follow[1].push_back(index_dim_in_result(k, a));
  return m;
}

absl::Status scatter_rule(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const GatherAttrs& a = n.attrs<GatherAttrs>();
  const int64_t axis = a.axis;
  ValueSharding x = c.of_or_replicated(n.operands[0]);
  const ValueSharding i_now = c.of_or_replicated(n.operands[1]), u_now = c.of_or_replicated(n.operands[2]);
  // A scatter_add of an operand and updates typed unreduced alike keeps their pending sum
  // (explicit mode's _scatter_unreduced_rule): each device adds its term of the updates into its
  // term of the operand, the indices whole.
  const bool keep = n.op == Op::kScatterAdd && x.is_partial() && x.partial_op == ReduceOp::kSum &&
                    c.typed_unreduced(n.operands[0]) && c.typed_unreduced(n.operands[2]) &&
                    same_axes(u_now.partial, x.partial) && u_now.partial_op == ReduceOp::kSum;
  const std::vector<std::string> pending = keep ? x.partial : std::vector<std::string>{};
  x.partial.clear();
  ValueSharding i = i_now, u = u_now;
  i.partial.clear();
  u.partial.clear();
  // The batch dimensions split alike everywhere (the operand's, or else the updates' or the
  // indices'): each device writes its own examples into its own block.
  match_batch_dims(a.batch_dims, x, {&u, &i});
  const size_t index_rank = i.dims.size();
  for (size_t d = 0; d < x.dims.size(); ++d) {
    if (static_cast<int64_t>(d) != axis) u.dims[x_dim_in_result(d, axis, index_rank - a.batch_dims)] = x.dims[d];
  }
  // The query dimensions: whole, or (scatter_add) split alike in indices and updates, each
  // device adding its share into a pending sum.
  ValueSharding i_whole = i, u_whole = u;
  std::vector<std::string> partial;
  std::set<std::string> taken = axes_of(x.dims);
  for (size_t k = static_cast<size_t>(a.batch_dims); k < index_rank; ++k) {
    Axes& ud = u.dims[index_dim_in_result(k, a)];
    Axes chosen = !ud.empty() ? ud : i.dims[k];
    if (n.op != Op::kScatterAdd || keep || clashes(chosen, taken)) chosen.clear();
    taken.insert(chosen.begin(), chosen.end());
    partial.insert(partial.end(), chosen.begin(), chosen.end());
    ud = chosen;
    i.dims[k] = chosen;
    u_whole.dims[index_dim_in_result(k, a)].clear();
    i_whole.dims[k].clear();
  }
  if (!partial.empty()) {
    const double split = c.move_cost(n.operands[1], i_now, i) + c.move_cost(n.operands[2], u_now, u) +
                         c.reduce_cost(id, ValueSharding{x.dims, partial, ReduceOp::kSum});
    const double whole = c.move_cost(n.operands[1], i_now, i_whole) + c.move_cost(n.operands[2], u_now, u_whole);
    if (whole < split) {
      i = i_whole;
      u = u_whole;
      partial.clear();
    }
  }
  if (keep) x.partial = u.partial = partial = pending;
  c.needs(id) = {x, i, u};
  c.set(id, x.dims, std::move(partial));
  return absl::OkStatus();
}

// The result is x's layout; the updates' other dimensions follow it, index dimensions keep
// what the forward pass chose.
DimMap scatter_map(const Graph& g, const Node& n) {
  const GatherAttrs& a = n.attrs<GatherAttrs>();
  const size_t index_rank = g.node(n.operands[1]).shape.size();
  DimMap m = identity_map(g, n);
  m.follow[1].assign(index_rank, -1);
  for (int64_t k = 0; k < a.batch_dims; ++k) m.follow[1][k] = static_cast<int>(k);  // x's batch dimensions
  m.follow[2].assign(g.node(n.operands[2]).shape.size(), -1);
  for (size_t d = 0; d < n.shape.size(); ++d) {
    if (static_cast<int64_t>(d) != a.axis) {
      m.follow[2][x_dim_in_result(d, a.axis, index_rank - a.batch_dims)] = static_cast<int>(d);
    }
  }
  return m;
}

// ---- Partition handlers ----------------------------------------------------------------------

// Indices into a dimension of size `size` split over `axes` in blocks of `block`, as this
// device's block sees them: clamped first in clip mode (so exactly one block holds each), then
// less the block's start, so an index of another block is out of range here.
struct LocalIndices {
  int indices;  // local
  int global;   // as given (clamped in clip mode)
  int start;    // the block's first index, a scalar
};

LocalIndices localize(PartitionContext& c, int id, int indices, DType dtype, const Shape& shape, int64_t size,
                      const Axes& axes, int64_t block, IndexMode mode) {
  auto constant = [&](int64_t v) { return emit_kernel(c, id, Op::kConstant, dtype, shape, {}, ConstantAttrs{v}); };
  if (mode == IndexMode::kClip) {
    indices = emit_kernel(c, id, Op::kMax, dtype, shape, {indices, constant(0)});
    indices = emit_kernel(c, id, Op::kMin, dtype, shape, {indices, constant(size - 1)});
  }
  const int start = emit_block_start(c, id, axes, block, dtype);
  const int starts = emit_kernel(c, id, Op::kBroadcastInDim, dtype, shape, {start}, BroadcastAttrs{});
  return {emit_kernel(c, id, Op::kSub, dtype, shape, {indices, starts}), indices, start};
}

Shape local_shape_of(const PartitionContext& c, int value, const ValueSharding& s) {
  return NamedSharding(c.mesh(), s.spec()).shard_shape(c.graph().node(value).shape);
}

absl::Status partition_gather(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const GatherAttrs attrs = n.attrs<GatherAttrs>();
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  Instruction inst = c.local_kernel(id, in);
  const Axes& split = c.propagation().operands[id][0].dims[attrs.axis];
  if (split.empty()) {
    c.bind(id, c.emit(std::move(inst)));
    return absl::OkStatus();
  }
  const int64_t size = c.graph().node(n.operands[0]).shape[attrs.axis];
  const DType index_dtype = c.graph().node(n.operands[1]).dtype;
  const Shape index_shape = local_shape_of(c, n.operands[1], c.propagation().operands[id][1]);
  const LocalIndices local =
      localize(c, id, in[1], index_dtype, index_shape, size, split, size / c.mesh().axes_size(split), attrs.mode);
  // This block's rows; the others' give 0 here, and the pending sum adds the one that has each.
  inst.in[1] = inst.node.operands[1] = local.indices;
  inst.node.attrs<GatherAttrs>() = GatherAttrs{attrs.axis, IndexMode::kFillOrDrop, Scalar(0), attrs.batch_dims};
  const Shape result_shape = inst.node.shape;
  int out = c.emit(std::move(inst));
  if (attrs.mode == IndexMode::kFillOrDrop) {
    // An index outside the whole dimension gives the fill value, from the first block only.
    auto compare = [&](Op op, int64_t v) {
      const int bound = emit_kernel(c, id, Op::kConstant, index_dtype, index_shape, {}, ConstantAttrs{v});
      return emit_kernel(c, id, op, DType::kBool, index_shape, {local.global, bound});
    };
    int outside = emit_kernel(c, id, Op::kOr, DType::kBool, index_shape, {compare(Op::kLt, 0), compare(Op::kGe, size)});
    const int zero = emit_kernel(c, id, Op::kConstant, index_dtype, {}, {}, ConstantAttrs{Scalar(0)});
    const int first = emit_kernel(c, id, Op::kEq, DType::kBool, {}, {local.start, zero});
    outside = emit_kernel(
        c, id, Op::kAnd, DType::kBool, index_shape,
        {outside, emit_kernel(c, id, Op::kBroadcastInDim, DType::kBool, index_shape, {first}, BroadcastAttrs{})});
    std::vector<int64_t> dims;
    for (size_t k = 0; k < index_shape.size(); ++k) dims.push_back(index_dim_in_result(k, attrs));
    outside =
        emit_kernel(c, id, Op::kBroadcastInDim, DType::kBool, result_shape, {outside}, BroadcastAttrs{std::move(dims)});
    const int fill = emit_kernel(c, id, Op::kConstant, n.dtype, result_shape, {},
                                 ConstantAttrs{attrs.fill_value.value_or(default_fill_value(n.dtype))});
    out = emit_kernel(c, id, Op::kSelect, n.dtype, result_shape, {outside, fill, out});
  }
  c.bind(id, out);
  return absl::OkStatus();
}

bool is_zero_constant(const Node& n) {
  return n.op == Op::kConstant && n.attrs<ConstantAttrs>().value.to_double() == 0;
}

absl::Status partition_scatter(PartitionContext& c, int id) {
  const Node& n = c.graph().node(id);
  const GatherAttrs attrs = n.attrs<GatherAttrs>();
  const ValueSharding& result = c.propagation().result[id];
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  Instruction inst = c.local_kernel(id, in);
  const Shape x_shape = inst.node.shape;
  // x is already a term of the pending sum when it is needed partial (a kept scatter_add).
  if (result.is_partial() && !c.propagation().operands[id][0].is_partial() &&
      !is_zero_constant(c.graph().node(n.operands[0]))) {
    // x is counted once in the pending sum: on the first device along its axes.
    inst.in[0] = inst.node.operands[0] = emit_first_device_term(c, id, in[0], result.partial, n.dtype, x_shape);
  }
  const Axes& split = result.dims[attrs.axis];
  if (!split.empty()) {
    const int64_t size = n.shape[attrs.axis];
    const Node& indices = c.graph().node(n.operands[1]);
    const LocalIndices local =
        localize(c, id, in[1], indices.dtype, local_shape_of(c, n.operands[1], c.propagation().operands[id][1]), size,
                 split, size / c.mesh().axes_size(split), attrs.mode);
    inst.in[1] = inst.node.operands[1] = local.indices;
    inst.node.attrs<GatherAttrs>().mode = IndexMode::kFillOrDrop;  // other blocks' updates are dropped
  }
  c.bind(id, c.emit(std::move(inst)));
  return absl::OkStatus();
}

// ---- dynamic_slice, dynamic_update_slice ---------------------------------------------------

// Whether dimension d of the operand is covered whole by the window (of `window` shape).
bool whole(const Shape& x, const Shape& window, size_t d) { return window[d] == x[d]; }

absl::Status dynamic_slice_rule(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const Shape& shape = c.graph().node(n.operands[0]).shape;
  ValueSharding x = c.of_or_replicated(n.operands[0]);
  x.partial.clear();
  for (size_t d = 0; d < shape.size(); ++d) {
    if (!whole(shape, n.shape, d)) x.dims[d].clear();
  }
  c.needs(id) = {x, ValueSharding::replicated(1)};
  c.set(id, x.dims);
  return absl::OkStatus();
}

absl::Status dynamic_update_slice_rule(ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const Shape& update = c.graph().node(n.operands[1]).shape;
  ValueSharding x = c.of_or_replicated(n.operands[0]);
  const ValueSharding u = c.of_or_replicated(n.operands[1]);
  // An operand and an update typed unreduced alike keep their pending sum (explicit mode's
  // _dus_unreduced_rule): each device writes its term of the update into its term of the
  // operand, and the sum of the results is the result of the sums.
  const bool keep = x.is_partial() && x.partial_op == ReduceOp::kSum && c.typed_unreduced(n.operands[0]) &&
                    c.typed_unreduced(n.operands[1]) && same_axes(u.partial, x.partial) &&
                    u.partial_op == ReduceOp::kSum;
  if (!keep) x.partial.clear();
  for (size_t d = 0; d < n.shape.size(); ++d) {
    if (!whole(n.shape, update, d)) x.dims[d].clear();
  }
  c.needs(id) = {x, ValueSharding{x.dims, x.partial, ReduceOp::kSum}, ValueSharding::replicated(1)};
  c.set(id, x.dims, x.partial);
  return absl::OkStatus();
}

// Dimensions the window covers whole follow the result; the others, and the starts, stay.
DimMap window_map(const Graph& g, const Node& n) {
  const Shape& x = g.node(n.operands[0]).shape;
  const Shape& window = n.op == Op::kDynamicSlice ? n.shape : g.node(n.operands[1]).shape;
  DimMap m = identity_map(g, n);
  m.follow.back() = {-1};  // the starts
  for (size_t d = 0; d < x.size(); ++d) {
    if (whole(x, window, d)) continue;
    m.free[d] = false;
    for (size_t k = 0; k + 1 < m.follow.size(); ++k) m.follow[k][d] = -1;
  }
  return m;
}

// A split dimension is covered whole: its window is the local block (its start clamps to 0).
absl::Status partition_dynamic_slice(PartitionContext& c, int id) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  Instruction inst = c.local_kernel(id, in);
  inst.node.attrs<DynamicSliceAttrs>().sizes = inst.node.shape;
  c.bind(id, c.emit(std::move(inst)));
  return absl::OkStatus();
}

}  // namespace

absl::Span<const ShardingRuleEntry> indexing_rules() {
  static constexpr ShardingRuleEntry kRules[] = {
      {Op::kGather, {gather_rule, gather_map, false, partition_gather}},
      {Op::kScatter, {scatter_rule, scatter_map, false, partition_scatter}},
      {Op::kScatterAdd, {scatter_rule, scatter_map, false, partition_scatter}},
      {Op::kDynamicSlice, {dynamic_slice_rule, window_map, false, partition_dynamic_slice}},
      {Op::kDynamicUpdateSlice, {dynamic_update_slice_rule, window_map}},
  };
  return kRules;
}

}  // namespace tessera::internal

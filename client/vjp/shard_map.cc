// VJPs of shard_map's boundaries and collectives. Each device's block is its own variable, and
// these are the transposes of the linear maps between them (pmap's convention). An output
// replicated over axes its out_spec leaves out is one copy of identical blocks: each block
// gets its share of the cotangent; an argument replicated over axes its in_spec leaves out was
// read by every device along them: its cotangent is their sum.
#include <algorithm>

#include "absl/status/status.h"
#include "client/vjp/vjp.h"
#include "core/pvary_cast.h"

namespace tessera::internal {
namespace {

// `op` over the node's mesh and axes, on `v`.
Value collective(const VjpArgs& a, Op op, const Value& v, std::vector<int64_t> dims) {
  const CollectiveAttrs& c = a.node.attrs<CollectiveAttrs>();
  return a.trace->make(a.trace->graph.add_collective(op, TraceState::id(v), c.mesh, c.axes, std::move(dims)));
}

// The manual axes of a boundary (all the mesh's, when it records none) that its spec does not
// name: the axes along which each device's block is a copy. Not its reduced axes (the cotangent
// is unreduced over them: each device's block has its own term of it), nor, with check_vma, its
// unreduced ones (the blocks are terms of a sum, each its own variable). Without check_vma JAX
// counts those as unmentioned (jax/_src/shard_map.py, _shard_map_transpose: the cotangent of an
// output is divided by the size of _unmentioned2(mesh, out_spec.to_ct_spec()) and an argument's
// psummed over _unmentioned2(mesh, in_spec.to_ct_spec()), which leaves out the ct spec's
// unreduced axes, the spec's reduced ones, only). Such a boundary is known by its body side
// (`body`: an out boundary's operand, an in boundary's result), typed without the spec's
// unreduced axes only with check_vma off (client/shard_map.cc, as _shard_shaped_array).
std::vector<std::string> unnamed_manual_axes(const ShardingAttrs& attrs, const Value& body) {
  const std::vector<std::string>& manual =
      attrs.manual_axes.empty() ? attrs.sharding.mesh().axis_names() : attrs.manual_axes;
  std::vector<std::string> named = attrs.sharding.spec().used_axes();
  const PartitionSpec& spec = attrs.sharding.spec();
  const std::optional<TypedOperand> typed = spec.unreduced().empty() ? std::nullopt : typed_operand(body);
  for (const std::string& axis : spec.unreduced()) {
    if (!typed.has_value() || std::count(typed->unreduced.begin(), typed->unreduced.end(), axis) > 0) {
      named.push_back(axis);
    }
  }
  named.insert(named.end(), spec.reduced().begin(), spec.reduced().end());
  std::vector<std::string> unnamed;
  for (const std::string& axis : manual) {
    if (std::find(named.begin(), named.end(), axis) == named.end()) unnamed.push_back(axis);
  }
  return unnamed;
}

// The boundary's sharding for its cotangent: the spec with its unreduced and reduced axes
// swapped (JAX's P.to_ct_spec: the cotangent of an unreduced value is reduced, of a reduced one
// unreduced).
NamedSharding ct_sharding(const NamedSharding& s) {
  const PartitionSpec& spec = s.spec();
  return NamedSharding(s.mesh(), spec.partitions_only().with_unreduced(spec.reduced()).with_reduced(spec.unreduced()));
}

}  // namespace

absl::Span<const VjpEntry> shard_map_vjps() {
  static const VjpEntry kRules[] = {
      {Op::kShardMapOut,
       [](const VjpArgs& a) {
         const ShardingAttrs& attrs = a.node.attrs<ShardingAttrs>();
         const NamedSharding s = ct_sharding(attrs.sharding);
         // Copies only along the manual axes the out_spec leaves out: along automatic ones the
         // body's value is one value, split by the compiler.
         int64_t copies = 1;
         for (const std::string& axis : unnamed_manual_axes(attrs, a.x[0])) copies *= s.mesh().axis_size(axis);
         // Explicit mode: the cotangent enters as its primal's type, the out_spec (an in_spec
         // other than its type would be refused, as JAX refuses one); in a body manual over
         // some axes only, with the block's split over the others after it (type_of(out)).
         Value g = !a.trace->explicit_mesh.has_value() ? a.g
                   : attrs.manual_axes.empty()
                       ? with_sharding_constraint(a.g, s)
                       : with_sharding_constraint(a.g, NamedSharding(s.mesh(), type_of(a.out).spec));
         if (!g.ok()) {
           return a.trace->error.ok() ? absl::InternalError("shard_map: the cotangent of an output could not be typed")
                                      : a.trace->error;
         }
         // An unreduced cotangent (of a reduced out_spec) is shared before it enters, by a factor
         // typed reduced alike, as an unreduced value takes only such a product (_mul_ur_rule).
         const std::vector<std::string>& pending = s.spec().unreduced();
         if (copies != 1 && !pending.empty()) {
           const Value share = with_sharding_constraint(full(g.shape(), 1.0 / static_cast<double>(copies), g.dtype()),
                                                        NamedSharding(s.mesh(), PartitionSpec().with_reduced(pending)));
           g = g * share;
           copies = 1;
         }
         Value blocks = a.trace->make(a.trace->graph.add_shard_map_in(TraceState::id(g), s, attrs.manual_axes));
         a.add(0, copies == 1 ? blocks : blocks * (1.0 / static_cast<double>(copies)));
         return absl::OkStatus();
       }},
      {Op::kShardMapIn,
       [](const VjpArgs& a) {
         const ShardingAttrs& attrs = a.node.attrs<ShardingAttrs>();
         const NamedSharding s = ct_sharding(attrs.sharding);
         const std::vector<std::string> unnamed = unnamed_manual_axes(attrs, a.out);
         Value summed = a.g;
         if (!unnamed.empty()) {
           // A cotangent reduced over axes the in_spec leaves out comes only from a body traced
           // with check_vma off (its out_specs unchecked: an argument invariant along 'x' out as
           // unreduced over it). Each device's copy is the cotangent of its own term, summed
           // here as JAX's untyped transpose sums it; cast to varying first (reduced_vary_cast),
           // as a psum takes no reduced operand.
           Value g = a.g;
           const std::optional<TypedOperand> typed =
               a.trace->explicit_mesh.has_value() ? typed_operand(g) : std::nullopt;
           std::vector<std::string> reduced;
           for (const std::string& axis : unnamed) {
             if (typed.has_value() && std::count(typed->reduced.begin(), typed->reduced.end(), axis) > 0) {
               reduced.push_back(axis);
             }
           }
           if (!reduced.empty()) g = a.trace->make(a.trace->graph.add_pvary(TraceState::id(g), s.mesh(), reduced));
           summed =
               a.trace->make(a.trace->graph.add_collective(Op::kAllReduce, TraceState::id(g), s.mesh(), unnamed, {}));
         }
         if (summed.ok())
           a.add(0, a.trace->make(a.trace->graph.add_shard_map_out(TraceState::id(summed), s, attrs.manual_axes)));
         return absl::OkStatus();
       }},
      {Op::kAllReduce,
       [](const VjpArgs& a) {
         const ReduceOp reduce_op = a.node.attrs<CollectiveAttrs>().reduce_op;
         if (reduce_op == ReduceOp::kSum) {
           a.add(0, collective(a, Op::kAllReduce, a.g, {}));
         } else if (reduce_op == ReduceOp::kMax || reduce_op == ReduceOp::kMin) {
           // To the devices holding the extreme, split evenly among ties.
           const Value hit = convert(a.x[0] == a.out, a.x[0].dtype());
           a.add(0, collective(a, Op::kAllReduce, a.g, {}) * hit / collective(a, Op::kAllReduce, hit, {}));
         } else {
           return absl::InvalidArgumentError("differentiating an all_reduce product is not supported");
         }
         return absl::OkStatus();
       }},
      {Op::kAllGather,
       [](const VjpArgs& a) {
         a.add(0, collective(a, Op::kReduceScatter, a.g, {a.node.attrs<CollectiveAttrs>().dimension}));
         return absl::OkStatus();
       }},
      {Op::kReduceScatter,
       [](const VjpArgs& a) {
         a.add(0, collective(a, Op::kAllGather, a.g, {a.node.attrs<CollectiveAttrs>().dimension}));
         return absl::OkStatus();
       }},
      {Op::kAllToAll,
       [](const VjpArgs& a) {
         const CollectiveAttrs& c = a.node.attrs<CollectiveAttrs>();
         a.add(0, collective(a, Op::kAllToAll, a.g, {c.concat_dimension, c.split_dimension}));
         return absl::OkStatus();
       }},
      // pvary's value is its operand's on every device, so each device's cotangent passes
      // through. JAX's transpose is a psum over its axes (jax/_src/lax/parallel.py,
      // _pvary_transpose_rule): with check_vma, JAX gives an invariant value's cotangent whole
      // to every device. Here, as in JAX with check_vma=false, each device's copy of an
      // invariant value is its own variable and gets its share of the cotangent, and what
      // made the value invariant sums the shares in its own VJP (shard_map_in along the axes
      // its in_spec leaves out; a psum by a psum): the sum JAX does at pvary is done once,
      // there. Summing here too would count it once per device along the axes.
      // The casts to unreduced and reduced (core/pvary_cast.h) are identities too. preduced's
      // cotangent is unreduced (each device's block its term); JAX's transpose sums it
      // (_preduced_transpose_rule: unreduced_psum), giving the whole cotangent to every device
      // typed invariant, so that it flows back through the ops before the cast. Here an
      // invariant value's cotangent is each device's share, which what made it invariant sums:
      // the sum, divided by the devices along the axes. all_gather(to='reduced')'s cast (of an
      // all_gather's result, which varies: preduced never takes one) leaves it unreduced for
      // the gather's VJP to reduce-scatter (unreduced_psum_scatter).
      // vary_unreduced_cast's cotangent is reduced over its axes, or over some of them and a
      // whole copy along the others (a psum after the cast, summing over part of them, gives
      // its operand's cotangent whole to each device); its transpose is reduced_vary_cast
      // (_vary_unreduced_cast_transpose_rule), typing it varying again as the operand was: a
      // cast of the reduced axes and a pvary along the rest.
      {Op::kPvary,
       [](const VjpArgs& a) {
         const CollectiveAttrs& c = a.node.attrs<CollectiveAttrs>();
         if (c.dimension == static_cast<int64_t>(PvaryCast::kUnreduced)) {
           const std::optional<TypedOperand> typed = typed_operand(a.g);
           std::vector<std::string> reduced, rest;
           for (const std::string& axis : c.axes) {
             const bool r = typed.has_value() && std::count(typed->reduced.begin(), typed->reduced.end(), axis) > 0;
             (r ? reduced : rest).push_back(axis);
           }
           Value g = a.g;
           for (const std::vector<std::string>* axes : {&reduced, &rest}) {
             if (!axes->empty()) g = a.trace->make(a.trace->graph.add_pvary(TraceState::id(g), c.mesh, *axes));
           }
           a.add(0, g);
         } else if (c.dimension == static_cast<int64_t>(PvaryCast::kReduced) &&
                    a.trace->graph.node(a.node.operands[0]).op != Op::kAllGather) {
           int64_t devices = 1;
           for (const std::string& axis : c.axes) devices *= c.mesh.axis_size(axis);
           a.add(0, collective(a, Op::kAllReduce, a.g, {}) * (1.0 / static_cast<double>(devices)));
         } else {
           a.add(0, a.g);
         }
         return absl::OkStatus();
       }},
      // JAX's transpose (jax/_src/lax/parallel.py, _ragged_all_to_all_transpose): the operand's
      // cotangent is the ragged_all_to_all back — the received rows of g, found at the offsets
      // the senders wrote them to (all_to_all of output_offsets), return to the rows they came
      // from (all_to_all of input_offsets) of a zero operand; the output's cotangent is g with
      // the rows something was written to zeroed (they did not come from output). The index
      // arrays get none.
      {Op::kRaggedAllToAll,
       [](const VjpArgs& a) {
         const CollectiveAttrs& c = a.node.attrs<CollectiveAttrs>();
         const Value &operand = a.x[0], &input_offsets = a.x[2], &send_sizes = a.x[3], &output_offsets = a.x[4],
                     &recv_sizes = a.x[5];
         const Value written_at = collective(a, Op::kAllToAll, output_offsets, {0, 0});
         const Value read_from = collective(a, Op::kAllToAll, input_offsets, {0, 0});
         const Value zero = full(operand.shape(), 0.0, operand.dtype());
         a.add(0, a.trace->make(a.trace->graph.add_ragged_all_to_all(
                      {TraceState::id(a.g), TraceState::id(zero), TraceState::id(written_at),
                       TraceState::id(recv_sizes), TraceState::id(read_from), TraceState::id(send_sizes)},
                      c.mesh, c.axes)));
         // Row m was written when written_at[i] <= m < written_at[i] + recv_sizes[i] for some i.
         const int64_t rows = a.g.shape()[0], k = written_at.shape()[0];
         const Shape grid{rows, k};
         const Value row = iota(DType::kI64, grid, 0);
         const Value begin = broadcast_in_dim(convert(written_at, DType::kI64), grid, {1});
         const Value end = begin + broadcast_in_dim(convert(recv_sizes, DType::kI64), grid, {1});
         const Value hit = max(convert(logical_and(row >= begin, row < end), DType::kI32), std::vector<int64_t>{1});
         const Value written = broadcast_in_dim(hit > full({rows}, 0.0, DType::kI32), a.g.shape(), {0});
         a.add(1, where(written, full(a.g.shape(), 0.0, a.g.dtype()), a.g));
         return absl::OkStatus();
       }},
      {Op::kCollectivePermute,
       [](const VjpArgs& a) {  // back along every pair
         std::vector<int64_t> inverted;
         const std::vector<int64_t>& positions = a.node.attrs<CollectiveAttrs>().positions;
         for (size_t i = 0; i + 1 < positions.size(); i += 2) {
           inverted.push_back(positions[i + 1]);
           inverted.push_back(positions[i]);
         }
         a.add(0, collective(a, Op::kCollectivePermute, a.g, inverted));
         return absl::OkStatus();
       }},
  };
  return kRules;
}

}  // namespace tessera::internal

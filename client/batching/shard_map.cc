// Batching a shard_map: its boundaries (vmap of a shard_map) and the collectives of its body.
// Each device's batched block takes part in a collective as a whole, so the collective runs
// once on it with its dimensions one further on (ragged_all_to_all: once on the examples' rows
// stacked).
#include <algorithm>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"
#include "core/pvary_cast.h"
#include "core/status.h"

namespace tessera::internal {
namespace {

// The specs of the shard_map that `id` (a shard_map_in or shard_map_out node) is a boundary of:
// its arguments' (or results') boundaries are recorded one after the other, so they are the run
// of nodes around `id` of the same op over the same mesh and manual axes.
std::vector<PartitionSpec> sibling_specs(const Graph& g, int id) {
  const Node& n = g.node(id);
  const ShardingAttrs& s = n.attrs<ShardingAttrs>();
  const auto sibling = [&](int j) {
    if (j < 0 || j >= g.size() || g.node(j).op != n.op) return false;
    const ShardingAttrs& o = g.node(j).attrs<ShardingAttrs>();
    return o.sharding.mesh() == s.sharding.mesh() && o.manual_axes == s.manual_axes;
  };
  int first = id, last = id;
  while (sibling(first - 1)) --first;
  while (sibling(last + 1)) ++last;
  std::vector<PartitionSpec> out;
  for (int j = first; j <= last; ++j) out.push_back(g.node(j).attrs<ShardingAttrs>().sharding.spec());
  return out;
}

// vmap of a shard_map, as JAX's _shard_map_batch (jax/_src/shard_map.py): the body runs on the
// batched blocks, each batched boundary's spec gaining the batch dimension first, whole
// (pxla.batch_spec(spec, 0, None)) or split over vmap's spmd_axis_name, which then no spec of
// the shard_map may name ("vmap spmd_axis_name cannot appear in shard_map in_specs"; the body,
// manual over them, holds size / |spmd axes| examples per block). With the mapped dimension
// split over Explicit axes it enters whole in the specs and stays split over those axes, which
// the body is automatic over. Unbatched arguments and results keep their boundaries.
absl::StatusOr<Value> boundary_rule(const BatchArgs& a) {
  Node n = a.node;
  ShardingAttrs& s = n.attrs<ShardingAttrs>();
  const Mesh mesh = s.sharding.mesh();
  const PartitionSpec spec = s.sharding.spec();
  const bool in = n.op == Op::kShardMapIn;
  // Over a dimension split over Explicit axes the batch dimension enters whole in the specs: the
  // shard_map, traced with vmap's explicit axes left automatic (client/shard_map.cc), keeps the
  // batched blocks split over them as their types say, and its results get that split back.
  for (const std::string& axis : a.layout.explicit_axes) {
    for (const PartitionSpec& sibling : sibling_specs(a.trace->graph, a.id)) {
      const std::vector<std::string> used = sibling.used_axes();
      if (std::find(used.begin(), used.end(), axis) == used.end()) continue;
      return absl::InvalidArgumentError(absl::StrCat("vmapped away explicit mesh axis cannot appear in shard_map ",
                                                     in ? "in_specs" : "out_specs", ": '", axis, "' is in ",
                                                     sibling.to_string()));
    }
  }
  const Axes& spmd = a.layout.spmd_axes;
  for (const std::string& axis : spmd) {
    if (mesh.axis_index(axis) < 0) {
      return absl::InvalidArgumentError(absl::StrCat("vmap spmd_axis_name '", axis, "' is not an axis of ",
                                                     mesh.to_string(), ", the mesh of the shard_map"));
    }
    if (!s.manual_axes.empty() && std::find(s.manual_axes.begin(), s.manual_axes.end(), axis) == s.manual_axes.end()) {
      return absl::InvalidArgumentError(absl::StrCat("vmap spmd_axis_name '", axis,
                                                     "' is not an axis the shard_map is manual over (its axis_names ",
                                                     axes_to_string(s.manual_axes), ")"));
    }
    for (const PartitionSpec& sibling : sibling_specs(a.trace->graph, a.id)) {
      const std::vector<std::string> used = sibling.used_axes();
      if (std::find(used.begin(), used.end(), axis) == used.end()) continue;
      return absl::InvalidArgumentError(absl::StrCat("vmap spmd_axis_name cannot appear in shard_map ",
                                                     in ? "in_specs" : "out_specs", ": ", axes_to_string(spmd),
                                                     " is in ", sibling.to_string()));
    }
  }
  std::vector<Axes> dims = {spmd};
  dims.insert(dims.end(), spec.dims().begin(), spec.dims().end());
  const PartitionSpec batched(std::move(dims), spec.unreduced(), spec.reduced());
  s.sharding = NamedSharding(mesh, batched);
  n.operands = {TraceState::id(a.x[0])};
  absl::StatusOr<int> id = a.trace->graph.add_node(std::move(n));
  if (!id.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("shard_map ", in ? "argument" : "result", " batched to ",
                                                   batched.to_string(), ": ", id.status().message()));
  }
  return a.trace->make(*id);
}

// A collective over vmap's spmd_axis_name in a shard_map body batched over it would combine
// different examples (each device along those axes holds examples of its own), which no
// example's computation does: INVALID_ARGUMENT. (JAX checks only the specs and runs it; in
// Tessera the gradient of a shard_map sums an argument's cotangent over the manual axes its
// in_spec leaves out, which spmd_axis_name then is, so vmap(grad(shard_map)) meets this.)
absl::Status check_not_over_spmd_axes(const BatchArgs& a) {
  if (a.node.op == Op::kPvary) return absl::OkStatus();  // a cast: nothing moves
  const std::vector<std::string>& axes = a.node.attrs<CollectiveAttrs>().axes;
  for (const std::string& axis : a.layout.spmd_axes) {
    if (std::find(axes.begin(), axes.end(), axis) == axes.end()) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        op_name(a.node.op), " over ", axes_to_string(axes), " (node %", a.id,
        ") in a shard_map body batched over vmap spmd_axis_name ", axes_to_string(a.layout.spmd_axes),
        " would combine different examples, which each device along '", axis,
        "' holds its own of; leave spmd_axis_name out, or name an axis the body has no collective over (a gradient of "
        "a shard_map sums over the manual axes its in_specs leave out)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Value> collective_rule(const BatchArgs& a) {
  TESSERA_RETURN_IF_ERROR(check_not_over_spmd_axes(a));
  Node n = a.node;
  CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  if (a.node.op == Op::kAllGather || a.node.op == Op::kReduceScatter) c.dimension += 1;
  if (a.node.op == Op::kAllToAll) {
    c.split_dimension += 1;
    c.concat_dimension += 1;
  }
  return a.add(std::move(n), {a.x[0]}, {});
}

// As JAX's _ragged_all_to_all_batched_collective (jax/_src/lax/parallel.py): the examples'
// operands and outputs are stacked into one of B * N and one of B * M rows, example b's slices
// moved by b * N and b * M rows, and the index arrays interleaved (K, B) row-major so that the
// slices each device sends to one peer stay together: one ragged_all_to_all for the batch.
absl::StatusOr<Value> ragged_all_to_all_rule(const BatchArgs& a) {
  TESSERA_RETURN_IF_ERROR(check_not_over_spmd_axes(a));
  const Value operand = a.batched_operand(0), output = a.batched_operand(1);
  const int64_t b = a.size, n = operand.shape()[1], m = output.shape()[1];
  const auto rows_of = [](const Value& x, int64_t rows) {
    const Shape shape = x.shape();
    Shape merged = {rows};
    merged.insert(merged.end(), shape.begin() + 2, shape.end());
    return reshape(x, merged);
  };
  // Index array k as (K, B): example b's entries in column b, moved by `stride` rows each.
  const auto interleaved = [&](size_t k, int64_t stride) {
    const Value x = transpose(a.batched_operand(k), {1, 0});
    const Value moved =
        stride == 0 ? x : x + iota(x.dtype(), x.shape(), 1) * full(x.shape(), static_cast<double>(stride), x.dtype());
    return reshape(moved, {x.shape()[0] * b});
  };
  const Value r = a.add(a.node,
                        {rows_of(operand, b * n), rows_of(output, b * m), interleaved(2, n), interleaved(3, 0),
                         interleaved(4, m), interleaved(5, 0)},
                        {});
  return reshape(r, output.shape());
}

// What JAX does not batch (jax/_src/lax/parallel.py): the batching rules of preduced,
// vary_unreduced_cast, reduced_vary_cast, unreduced_psum (and unreduced_pmax / unreduced_pmin)
// raise NotImplementedError with no message; those of all_gather_reduced and
// unreduced_reduce_scatter (psum_scatter of an unreduced value) raise NotImplementedError("Please
// file an issue at https://github.com/jax-ml/jax/issues"). pvary (_pvary_batcher),
// all_gather_invariant (_all_gather_invariant_batched_collective) and the other collectives batch.
// The first three are registered through batching.primitive_batchers, which binds the primitive
// as it is when no operand is mapped; the others are fancy_primitive_batchers, which
// BatchTrace.process_primitive calls for any primitive bound inside vmap, so they refuse an
// unmapped operand too (`mapped` false).
struct Refused {
  const char* call;       // the JAX function the user called
  const char* primitive;  // the primitive whose batching rule refuses
  bool file_an_issue;     // the rule's message is "Please file an issue at ..."
  bool even_unmapped;     // a fancy batcher: it refuses an unmapped operand too
};

std::optional<Refused> refused_by_jax(const Node& n, const TraceState& t) {
  const CollectiveAttrs& c = n.attrs<CollectiveAttrs>();
  const int operand = n.operands[0];
  const auto over_axes = [&](const std::vector<std::string>& of) {
    return std::any_of(c.axes.begin(), c.axes.end(),
                       [&](const std::string& a) { return std::find(of.begin(), of.end(), a) != of.end(); });
  };
  // psum and psum_scatter of a value unreduced over their axes run its sum (_get_from's
  // 'unreduced'). pmax / pmin of one never reach a batching rule here: their type rule refuses
  // the pending sum's kind when they are recorded (client/explicit/shard_map.cc), before vmap
  // batches anything.
  if (n.op == Op::kAllReduce && c.reduce_op == ReduceOp::kSum && over_axes(t.unreduced_of(operand))) {
    return Refused{"psum(...)", "unreduced_psum", false, true};
  }
  if (n.op == Op::kReduceScatter && over_axes(t.unreduced_of(operand))) {
    return Refused{"psum_scatter(...)", "unreduced_reduce_scatter", true, true};
  }
  if (n.op != Op::kPvary) return std::nullopt;
  PvaryCast cast = PvaryCast::kVarying;
  pvary_cast_of(c.dimension, &cast);
  // all_gather(to='reduced') is a gather and a cast to reduced over the gather's own axes; a
  // preduced casts a value invariant along its axes, which a gather's result never is along
  // the gather's axes (and with check_vma off preduced records nothing).
  const Node& in = t.graph.node(operand);
  const bool of_its_gather = in.op == Op::kAllGather && [&] {
    std::vector<std::string> a = c.axes, b = in.attrs<CollectiveAttrs>().axes;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    return a == b;
  }();
  if (cast == PvaryCast::kUnreduced) return Refused{"pcast(..., to='unreduced')", "vary_unreduced_cast", false, false};
  if (cast == PvaryCast::kReduced && of_its_gather) {
    return Refused{"all_gather(..., to='reduced')", "all_gather_reduced", true, true};
  }
  if (cast == PvaryCast::kReduced) return Refused{"pcast(..., to='reduced')", "preduced", false, false};
  if (cast == PvaryCast::kVarying && over_axes(t.reduced_of(operand))) {
    return Refused{"pcast(..., to='varying')", "reduced_vary_cast", false, false};
  }
  return std::nullopt;
}

absl::Status unimplemented(const Refused& r, const Node& n, int id, bool mapped) {
  return absl::UnimplementedError(
      absl::StrCat(r.call, " over ", axes_to_string(n.attrs<CollectiveAttrs>().axes), " (node %", id, ") ",
                   mapped ? "of a mapped value" : "inside vmap, of a value it does not map",
                   ": JAX's batching rule for ", r.primitive, " raises NotImplementedError",
                   r.file_an_issue ? ": Please file an issue at https://github.com/jax-ml/jax/issues" : ""));
}

// The collectives and casts, refusing what JAX's batching rules refuse.
absl::StatusOr<Value> refusing_collective_rule(const BatchArgs& a) {
  const std::optional<Refused> refused = refused_by_jax(a.node, *a.trace);
  if (refused.has_value()) return unimplemented(*refused, a.node, a.id, true);
  return collective_rule(a);
}

absl::Status unmapped_check(const Node& n, int id, TraceState* t) {
  const std::optional<Refused> refused = refused_by_jax(n, *t);
  if (!refused.has_value() || !refused->even_unmapped) return absl::OkStatus();
  return unimplemented(*refused, n, id, false);
}

constexpr BatchEntry kRules[] = {
    {Op::kShardMapIn, boundary_rule},
    {Op::kShardMapOut, boundary_rule},
    {Op::kAllReduce, refusing_collective_rule, unmapped_check},
    {Op::kAllGather, collective_rule},
    {Op::kReduceScatter, refusing_collective_rule, unmapped_check},
    {Op::kAllToAll, collective_rule},
    {Op::kCollectivePermute, collective_rule},
    {Op::kPvary, refusing_collective_rule, unmapped_check},
    {Op::kRaggedAllToAll, ragged_all_to_all_rule},
};

}  // namespace

absl::Span<const BatchEntry> shard_map_batching() { return kRules; }

}  // namespace tessera::internal

// Batching rules: how vmap (client/vmap.cc) maps one op over a new leading dimension,
// registered per op family, each family in its own file of this folder. Internal to the
// client library.
//
// vmap records f on one example's shapes, then replays each recorded node that reads a
// batched value through its op's rule. A rule sees the node and its operands as Values of
// the trace, the batched ones with the batch dimension first ([size] + the example's shape),
// and returns the op's batched result, batch dimension first.
//
//   {Op::kTranspose, [](const BatchArgs& a) -> absl::StatusOr<Value> {
//      std::vector<int64_t> p = {0};
//      for (int64_t d : a.node.attrs<TransposeAttrs>().permutation) p.push_back(d + 1);
//      return transpose(a.x[0], p); }},
#ifndef TESSERA_CLIENT_BATCHING_BATCHING_H_
#define TESSERA_CLIENT_BATCHING_BATCHING_H_

#include <cstdint>
#include <map>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "client/trace_state.h"
#include "core/graph.h"
#include "tessera/trace.h"

namespace tessera::internal {

// How the batch dimension is laid out over the mesh, as JAX's batching.AxisData's
// explicit_mesh_axis and spmd_name (jax/_src/interpreters/batching.py); at most one is set.
struct BatchLayout {
  // Explicit mode: the Explicit mesh axes the mapped arguments split their mapped dimension
  // over (the same for all of them). Batched values keep that split in their batch dimension,
  // and values broadcast along it get it (JAX's broadcast(..., mesh_axis)).
  Axes explicit_axes;
  // vmap's spmd_axis_name: each sharding constraint inside splits the batch dimension over these
  // (JAX's _sharding_constraint_batcher).
  Axes spmd_axes;
};

struct BatchArgs {
  const Node& node;             // a copy: rules add nodes to the graph
  const std::vector<Value>& x;  // the operands; batched ones with the batch dimension first
  const std::vector<bool>& batched;
  int64_t size;  // the batch dimension's size
  TraceState* trace;
  int id;                               // the node's id in the trace
  std::map<int, Value>* batched_nodes;  // the batched value of each node batched so far
  const BatchLayout& layout;

  // For an op of several results, one node each (scan, while, switch: core/op_attrs.h's
  // `output`): `results` (batch dimension first, by output) recorded as the batched values of
  // this node's siblings recorded after it (same op, operands and sub-graphs), which vmap then
  // skips; returns this node's.
  Value record(const std::vector<Value>& results) const;

  // Operand k batched: itself when it is, else broadcast along a new leading dimension.
  Value batched_operand(size_t k) const;
  // x (an example's value) broadcast along a new leading dimension, laid out as `layout` says.
  Value broadcast(const Value& x) const;
  // `n` (the node, its attributes adjusted by the rule) added again on `operands`, with
  // `shape` as its shape when its op takes the shape as given.
  Value add(Node n, const std::vector<Value>& operands, Shape shape) const;
};

// The batched result, batch dimension first, or INVALID_ARGUMENT for a case the rule does not
// batch (vmap fails with it).
using BatchRule = absl::StatusOr<Value> (*)(const BatchArgs& args);
// For a node recorded inside vmap's function with no batched operand (vmap leaves it as it
// is): OK, or the error vmap fails with. JAX calls a primitive's fancy batching rule for such
// operands too (BatchTrace.process_primitive), and some of them refuse whatever they get.
using UnmappedCheck = absl::Status (*)(const Node& node, int id, TraceState* trace);
struct BatchEntry {
  Op op;
  BatchRule rule;
  UnmappedCheck unmapped = nullptr;  // none: an op on unbatched operands is left as it is
};

absl::Span<const BatchEntry> elementwise_batching();  // elementwise.cc
absl::Span<const BatchEntry> layout_batching();       // layout.cc
absl::Span<const BatchEntry> reduction_batching();    // reduction.cc
absl::Span<const BatchEntry> dot_batching();          // dot.cc
absl::Span<const BatchEntry> indexing_batching();     // indexing.cc
absl::Span<const BatchEntry> shard_map_batching();    // shard_map.cc: the collectives
absl::Span<const BatchEntry> random_batching();       // random.cc
absl::Span<const BatchEntry> control_batching();      // control.cc: scan, while, switch

// The rule registered for `op`, or null.
BatchRule find_batching(Op op);
// The check registered for `op` on unbatched operands, or null.
UnmappedCheck find_unmapped_check(Op op);

// x with dimension `from` moved to position `to` (the others keep their order).
Value move_dim(const Value& x, int64_t from, int64_t to);

// x (an example's value) the same for each of `size` examples: broadcast along a new
// leading dimension, split over `axes` (Explicit mesh axes; explicit mode only) as JAX's
// batching.broadcast gives the new dimension the explicit_mesh_axis (its out_sharding).
Value broadcast_batch(const Value& x, int64_t size, const Axes& axes);

// `dims` each shifted by one: the example's dimensions in the batched value.
std::vector<int64_t> shifted(const std::vector<int64_t>& dims);

}  // namespace tessera::internal

#endif  // TESSERA_CLIENT_BATCHING_BATCHING_H_

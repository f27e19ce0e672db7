// shard_map: explicit per-device code with collectives, as jax.shard_map.
//
// The function is traced on blocks: an argument laid out by its in_spec is seen, on every
// device, as that device's block (a (16, 8) array under P("data", None) on a (4, 2) mesh is a
// (4, 8) Value). Inside, the collectives below move data between devices over mesh axes. The
// results are blocks again, assembled into global arrays by the out_specs: a dimension mapped
// to axes is the concatenation of the blocks over them; an axis an out_spec leaves out means
// the result is replicated over it — which tracing checks (check_vma), as JAX does.
//
//   ShardMapped f = shard_map(
//       [](const std::vector<Value>& in) {   // in[0]: (4, 4) block of x (16, 8), in[1]: (4, 4) of w (8, 4)
//         return std::vector<Value>{psum(matmul(in[0], in[1]), "model")};
//       },
//       mesh, {P("data", "model"), P("model", None)}, {P("data", None)});
//   absl::StatusOr<std::vector<Array>> y = f({x, w});    // compiles and runs like jit
//   Jitted g = jit([&](const std::vector<Value>& in) {   // or inside a jitted function
//     return std::vector<Value>{tanh(f({in[0] * 2.0, in[1]})[0])};
//   });
#ifndef TESSERA_SHARD_MAP_H_
#define TESSERA_SHARD_MAP_H_

#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "tessera/jit.h"
#include "tessera/trace.h"

namespace tessera {

// One mesh axis or several ("data", or {"data", "model"}, major to minor), as the axis_name
// of a JAX collective.
struct AxisNames {
  AxisNames(const char* axis) : names{axis} {}
  AxisNames(std::string axis) : names{std::move(axis)} {}
  AxisNames(std::initializer_list<std::string> axes) : names(axes) {}
  AxisNames(Axes axes) : names(std::move(axes)) {}
  Axes names;
};

// Options of shard_map.
struct ShardMapOptions {
  // Check that every result is replicated over the mesh axes its out_spec leaves out (JAX's
  // check_vma); when off, such a result is whatever the devices hold (device order decides).
  // Off, the body's values also carry no unreduced or reduced axes (an in_spec's must still be
  // its argument's; the block is what it is, an unreduced argument's its term) and an out_spec's
  // are not checked against its result: the result is typed by the out_spec, as JAX's
  // _shard_shaped_array / _unshard_shaped_array do without check_vma.
  bool check_vma = true;
  // jax.shard_map's axis_names: the mesh axes the body is manual over; empty: all of them. Over
  // the others the body is automatic: in_specs and out_specs may not name them, nor may its
  // collectives; the compiler splits the body's work over them (its values are blocks laid out
  // over the automatic axes, as GSPMD propagates them), and with_sharding_constraint inside the
  // body may name them (only them).
  std::vector<std::string> axis_names = {};
  // out_specs is one spec that every result takes, however many the body returns (Python's
  // out_specs=P(...), a prefix of any output tree).
  bool out_specs_for_all = false;
  // For calls on Arrays: the jit options of the program shard_map compiles to.
  JitOptions jit = {};
};

// A function made by shard_map. Copies share the compiled programs.
class ShardMapped {
 public:
  // Inside a traced function (jit, or another trace): the body inlined on these global
  // Values; returns the global results (one per out_spec). Inside another shard_map's body
  // (nested: manual over the axes that body left automatic) the arguments and results are
  // that body's values. Errors fail the trace with INVALID_ARGUMENT naming the argument or
  // output and the rule: an in_spec that does not fit its argument, as many arguments or
  // results as specs, a result not replicated where its out_spec says, a bad collective, a
  // nested shard_map's spec naming an axis the enclosing body is already manual over, or its
  // body reading a value other than its arguments. Called outside a trace it records nothing
  // and returns invalid Values.
  std::vector<Value> operator()(const std::vector<Value>& args) const;
  // On arrays: compiles (once per signature) and runs as Jitted::operator() does, with its
  // errors; the body's errors are its trace errors (INVALID_ARGUMENT).
  absl::StatusOr<std::vector<Array>> operator()(const std::vector<Array>& args) const;
  // The per-device plans of the last call on arrays (Jitted::as_text).
  std::string as_text() const;

 private:
  friend ShardMapped shard_map(TracedFunction, Mesh, std::vector<PartitionSpec>, std::vector<PartitionSpec>,
                               ShardMapOptions);
  ShardMapped() = default;
  struct State;
  std::shared_ptr<State> state_;
};

// jax.shard_map(f, mesh, in_specs, out_specs): one in_spec per argument, one out_spec per
// result of `f`. Never fails itself: the specs (and options.axis_names) are checked when the
// result is traced.
// Explicit mode: a spec's unreduced / reduced axes (P(unreduced={'x'})) are those of the value
// it describes, as JAX checks them; inside, the block is typed with them (f32[2,6]{U:x}: each
// device's block is its term of the pending sum, which psum or psum_scatter over 'x' runs;
// f32[2,6]{R:x}: a copy of the reduced value, cast to varying where it meets a value varying
// along 'x'). Only in a body manual over every axis (else UNIMPLEMENTED, JAX's
// NotImplementedError) and over Explicit axes.
ShardMapped shard_map(TracedFunction f, Mesh mesh, std::vector<PartitionSpec> in_specs,
                      std::vector<PartitionSpec> out_specs, ShardMapOptions options = {});
// jax.shard_map(f, in_specs=, out_specs=) without a mesh: over the ambient mesh
// (tessera/mesh_context.h's set_mesh) at this call; INVALID_ARGUMENT when none is set.
absl::StatusOr<ShardMapped> shard_map(TracedFunction f, std::vector<PartitionSpec> in_specs,
                                      std::vector<PartitionSpec> out_specs, ShardMapOptions options = {});

// Collectives, only inside a shard_map body. Each runs over the devices that differ only
// along `axes`, ordered by their coordinates on them, and returns this device's result
// block. Errors fail the trace with INVALID_ARGUMENT naming the call: used outside a
// shard_map body, an axis not in the body's mesh or named twice, a dimension out of range or
// not divisible by the axes' size, a permutation position out of range or repeated.
Value psum(const Value& x, const AxisNames& axes);  // sum over the devices
// psum divided by the axes' size; an integer x gives float32, as lax.pmean (true division).
Value pmean(const Value& x, const AxisNames& axes);
Value pmax(const Value& x, const AxisNames& axes);
Value pmin(const Value& x, const AxisNames& axes);
// Every device's x: stacked along a new dimension `axis`, or (tiled) concatenated along `axis`.
Value all_gather(const Value& x, const AxisNames& axes, int64_t axis = 0, bool tiled = false);
// jax.lax.all_gather(x, axes, axis=, tiled=, to=...): to = "varying" is the call above; "reduced"
// is all_gather_reduced (Varying -> Reduced): the gather, typed reduced over `axes` and no
// longer varying along them (explicit mode only). x must vary along some of the axes and not be
// reduced over any (INVALID_ARGUMENT with JAX's words; with check_vma off nothing varies, so JAX
// and this refuse it); x unreduced over some of them keeps its unreduced axes, as JAX's. Its
// gradient is the unreduced cotangent psum-scattered (unreduced_psum_scatter). "invarying" is
// all_gather_invariant (Varying -> Invariant): the gather, typed invariant along `axes`
// (type_of(result).varying is x's less them), so an out_spec may leave them out; on any mesh.
// x must not be unreduced or reduced over them (INVALID_ARGUMENT, the words of the pvary JAX
// inserts first). Its gradient is each device's slice of the cotangent (JAX's transpose:
// dynamic_slice at axis_index). Anything else is JAX's "Got unexpected `to` value for
// `jax.lax.all_gather`". Under vmap, to = "reduced" is UNIMPLEMENTED (JAX's NotImplementedError).
Value all_gather(const Value& x, const AxisNames& axes, int64_t axis, bool tiled, const std::string& to);
// The sum over the devices, scattered: device i keeps block i along `scatter_dimension`
// (tiled), or index i of it, which must have the axes' size (not tiled: the dimension goes).
Value psum_scatter(const Value& x, const AxisNames& axes, int64_t scatter_dimension = 0, bool tiled = false);
// Device at position `source` sends x to the one at `target`, for each (source, target) pair
// of positions along `axes`; a device no pair targets gets zeros.
Value ppermute(const Value& x, const AxisNames& axes, const std::vector<std::pair<int64_t, int64_t>>& perm);
// jax.lax.pbroadcast(x, axes, source): every device gets the x of the device at position
// `source` along `axes` (JAX's definition: psum of x masked to the source; its gradient sums
// the cotangents into the source). Typed as varying along `axes`, as JAX types it (x's type).
// INVALID_ARGUMENT when source is not a position along the axes.
Value pbroadcast(const Value& x, const AxisNames& axes, int64_t source);
// jax.lax.all_to_all: splits `split_axis` into one block per device, sends block i to device
// i, and concatenates what arrives along `concat_axis` (tiled); not tiled, `split_axis` must
// have the axes' size and the received blocks stack along a new `concat_axis`.
Value all_to_all(const Value& x, const AxisNames& axes, int64_t split_axis, int64_t concat_axis, bool tiled = false);
// jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
// recv_sizes, axis_name=axes): the ragged all_to_all along the leading dimension. With K
// the offsets' length and n the axes' size, this device sends rows
// operand[input_offsets[i] : input_offsets[i] + send_sizes[i]] to the device at position
// i / (K / n), which writes them at rows [output_offsets[i], + send_sizes[i]) of its own
// output — output_offsets are the sender's view, as in JAX; the receiver's recv_sizes[i] is
// the size of the slice it gets from position i / (K / n). The result is `output` with what
// was received written in; other rows keep output's values. Typed as varying along `axes`.
// Fails the trace with JAX's errors for index arrays that are not integer vectors of positive
// length ("ragged_all_to_all input_offsets must be integer type."), and INVALID_ARGUMENT for
// lengths that differ or do not divide by n, or operand and output of different dtypes, ranks
// or trailing dimensions. A run fails INVALID_ARGUMENT naming the device, the slice and the
// values when a slice lies outside the operand or its receiver's output, or a device's
// send_sizes differ from its receivers' recv_sizes. Its gradient is JAX's transpose rule.
Value ragged_all_to_all(const Value& operand, const Value& output, const Value& input_offsets, const Value& send_sizes,
                        const Value& output_offsets, const Value& recv_sizes, const AxisNames& axes);
// The same within groups of positions along `axes` (JAX's axis_index_groups, e.g. {{0, 1},
// {2, 3}} on an axis of size 4): with g the groups' size, slice i goes to the device at
// position axis_index_groups[mine][i / (K / g)] and recv_sizes[i] is the size of the slice from
// that device; K must divide by g. Empty groups: the call above. INVALID_ARGUMENT (failing the
// trace) when the groups do not cover the positions exactly once or differ in size (JAX leaves
// that undefined). Runs as the call above over the whole axes, each device sending empty slices
// to the devices outside its group.
Value ragged_all_to_all(const Value& operand, const Value& output, const Value& input_offsets, const Value& send_sizes,
                        const Value& output_offsets, const Value& recv_sizes, const AxisNames& axes,
                        const std::vector<std::vector<int64_t>>& axis_index_groups);
// This device's position along `axes` (an i32 scalar), and how many positions there are.
// Surprising: outside any trace axis_size returns 1 without an error; outside a shard_map
// body it fails the trace and returns 1.
Value axis_index(const AxisNames& axes);
int64_t axis_size(const AxisNames& axes);

// Varying manual axes (JAX's vma; docs/notebooks/shard_map.md "Tracking how values vary over
// manual mesh axes"). With check_vma, every value of a body has the manual axes along which
// its devices' blocks may differ (type_of(v).varying): an argument those its in_spec names,
// psum/pmean/pmax/pmin drop theirs, all_gather, psum_scatter, all_to_all, ragged_all_to_all,
// ppermute and axis_index add theirs, any other op takes the union of its operands'. An out_spec must
// name every axis its result varies along.
//
// jax.lax.pvary (older JAX; now pcast(x, axes, to='varying')): x, typed as varying along
// `axes` as well; each device's value is unchanged and no instruction runs. x must not vary
// along any of them already (INVALID_ARGUMENT naming the axes, as JAX's "pvary is a invariant->variant collective").
// With check_vma off, or no axes, it returns x, as JAX does. Its gradient is the cotangent (JAX's transpose is a psum:
// see client/vjp/shard_map.cc for why the sum happens elsewhere here).
Value pvary(const Value& x, const AxisNames& axes);
// jax.lax.pcast(x, axes, to=...), by the state of x along the axes (jax/_src/lax/parallel.py's
// _get_from and _pcast_funcs), each cast an identity at runtime:
//   invarying -> "varying": pvary; reduced -> "varying": reduced_vary_cast (the result varies
//     along the axes, no longer reduced over them);
//   varying -> "unreduced": vary_unreduced_cast (each device's block becomes its term of a sum
//     pending over the axes: typed {U:axes}, no longer varying along them; its gradient is
//     reduced_vary_cast of the cotangent);
//   invarying -> "reduced": preduced (typed {R:axes}; its cotangent is unreduced, summed over
//     the axes at the cast, as JAX's transpose unreduced_psum sums it). With check_vma
//     off, x itself, as JAX's preduced.
// The casts to unreduced and reduced are explicit-mode types (INVALID_ARGUMENT on other meshes).
// Under vmap, of a mapped value, all but invarying -> "varying" (pvary) are UNIMPLEMENTED (JAX's
// batching rules for them raise NotImplementedError).
// Axes in several states, or another pair (from varying to "varying", from invarying to
// "unreduced": with check_vma off nothing varies), are INVALID_ARGUMENT with JAX's words
// ("jax.lax.pcast can only accept axis_name which corresponds to one of ...", "Unsupported
// pcast from=..., to=..."); anything else is JAX's "Got unexpected `to` value".
Value pcast(const Value& x, const AxisNames& axes, const std::string& to);

}  // namespace tessera

#endif  // TESSERA_SHARD_MAP_H_

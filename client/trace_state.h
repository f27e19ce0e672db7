// The state of a trace in progress, shared by tracing (trace.cc) and shard_map
// (shard_map.cc). Internal to the client library.
#ifndef TESSERA_CLIENT_TRACE_STATE_H_
#define TESSERA_CLIENT_TRACE_STATE_H_

#include <algorithm>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/explicit/rules.h"
#include "core/graph.h"
#include "core/mesh.h"
#include "tessera/trace.h"

namespace tessera {
namespace internal {

// How a value of a shard_map body may differ between devices along each manual mesh axis: axis
// -> why (JAX's varying manual axes, with the reason messages give).
using Variance = std::map<std::string, std::string>;

// Whether `mesh` has an axis of size > 1 that the compiler lays out, so that a split along it
// shows in no type: Auto, or Explicit and named in `made_auto` (auto_axes).
inline bool has_auto_split(const Mesh& mesh, const std::vector<std::string>& made_auto = {}) {
  for (int k = 0; k < mesh.rank(); ++k) {
    const bool made = std::find(made_auto.begin(), made_auto.end(), mesh.axis_names()[k]) != made_auto.end();
    const bool is_auto =
        mesh.axis_types()[k] == AxisType::kAuto || (mesh.axis_types()[k] == AxisType::kExplicit && made);
    if (is_auto && mesh.shape()[k] > 1) return true;
  }
  return false;
}

// One trace in progress: the graph being recorded and its first error.
struct TraceState : std::enable_shared_from_this<TraceState> {
  Graph graph;
  absl::Status error;
  // The shard_map bodies being traced, innermost last: their mesh (what collectives run over).
  std::vector<Mesh> manual_meshes;
  // For each of those bodies, the mesh axes it is manual over (shard_map's axis_names; all of
  // them by default): collectives may name only these.
  std::vector<std::vector<std::string>> manual_axes;
  // For each of those bodies (traced inline, into this graph): its first node, its inputs, and
  // the values of before it that it read. Such a value enters the body whole on every device
  // (a shard_map_in of P(), made once, where it is first read; split along the automatic axes
  // as its own layout says), as JAX's shard_map passes a
  // body's closed-over values (jax/_src/shard_map.py: in_names {} for the consts). Only the
  // outermost body lifts values; one nested in another reads its own body's values only.
  //
  // A control-flow body (scan, while_loop, cond) traced inside a shard_map body is a trace of its
  // own with a `nested` entry, its first: the same mesh and manual axes (collectives and pvary
  // work in it), no lifting into it (the shard_map's trace lifts what the body reads when it
  // records the loop), and its parameters typed by `seeds`: each as varying as the value it
  // stands for (JAX traces a body with its operands' avals, vma included). A shard_map called
  // in such a body pushes its own entry after it, into which lift() enters what it reads.
  struct ManualBody {
    int start = 0;
    std::vector<int> inputs;
    std::map<int, int> lifted;          // outer value -> its shard_map_in
    std::vector<std::string> manual;    // the axes it is manual over
    std::vector<std::string> recorded;  // what its boundaries record (ShardingAttrs::manual_axes)
    bool check_vma = true;              // whether its values are typed by their varying axes
    // varying()'s findings for the values before node `variance_upto` (the graph only grows
    // while the body is traced); -1 before the first question.
    std::map<int, std::map<std::string, std::string>> variance;
    int variance_upto = -1;
    // The pvary nodes insert_pvary made, with why each axis they name varies: the reason of
    // the operand that made it insert them, which messages give instead of "pvary".
    std::map<int, std::map<std::string, std::string>> inserted_pvary;
    bool nested = false;            // a control-flow body's entry (above)
    std::map<int, Variance> seeds;  // a nested body's parameters: how each varies
  };
  std::vector<ManualBody> manual_bodies;
  int lift(int id);  // shard_map.cc: id, or its shard_map_in in the body being traced
  // lift's step: id (of no body from the k-th on) entered into the k-th body.
  int lift_into(size_t k, int id);
  // Whether values read in this trace are lifted into a shard_map body: the innermost body is a
  // shard_map's traced inline here (the shard_map's own trace, the bodies of shard_maps nested
  // in it, and a shard_map called in a control-flow body of a shard_map body), not the `nested`
  // entry of a control-flow body, whose values the enclosing trace lifts.
  bool lifts() const { return !manual_bodies.empty() && !manual_bodies.back().nested; }
  // varying(id) as a map. shard_map.cc.
  Variance variance_of(int id);
  // Makes this trace, a control-flow body of `parent`, a nested body when `parent` is in a
  // shard_map body: parameter k (node id k) varies as `inputs[k]` (none past its end).
  void nest_in(TraceState& parent, const std::vector<Variance>& inputs);
  // In the innermost body, traced with check_vma: the manual axes along which value `id` (of
  // the body) may differ between devices, each with why, in mesh order (JAX's varying manual
  // axes; tessera/shard_map.h). Empty outside a body or with check_vma off. shard_map.cc.
  std::vector<std::pair<std::string, std::string>> varying(int id);
  // The same for each output of `g`, a control-flow body traced in this trace whose
  // parameters are values `params` of it (by id, in order): what its outputs vary along, in
  // mesh order, by the same rules. Empty lists outside a body or with check_vma off.
  std::vector<std::vector<std::string>> outputs_varying(const Graph& g, const std::vector<int>& params);

  // Explicit sharding (client/explicit/rules.h): the arguments' mesh when it has an Explicit
  // axis, and then every node's type spec, by id (filled by make() as nodes are added); inside
  // an out_sharding, rules may leave an ambiguous result to it (out_sharding_scopes > 0).
  std::optional<Mesh> explicit_mesh;
  // Whether the arguments' mesh (trace()'s input shardings; a body reads its enclosing traces')
  // has an Auto axis of size > 1 (has_auto_split), along which the compiler may split values without any type showing
  // it (lax_gather.cc's make_addressing then folds no dimension that may be split).
  bool args_on_auto_axes = false;
  // Whether a node of this graph below `auto_constraint_scanned` is a constraint or shard_map
  // on a mesh with such an axis (make_addressing's scan, incremental: nodes are only appended).
  int auto_constraint_scanned = 0;
  bool auto_constraint_seen = false;
  // Inside explicit_axes: the mesh the constraints inside are placed on (the one the types were
  // switched from; its devices are the program's mesh), while explicit_mesh has the switched types.
  std::optional<Mesh> constraint_mesh;
  std::vector<TypeSpec> specs;
  int out_sharding_scopes = 0;
  // The unreduced axes of the nodes whose type has some (JAX's {U:X}; explicit/unreduced.cc),
  // by id; and those an out_sharding gives the one node it is the out_sharding of (the op's
  // result, as JAX's per-primitive out_sharding param), by id, until that node is typed.
  std::map<int, std::vector<std::string>> unreduced;
  std::map<int, std::vector<std::string>> out_unreduced;
  // The reduced axes of the nodes whose type has some (JAX's {R:X}; explicit/reduced.cc), by id.
  std::map<int, std::vector<std::string>> reduced;
  // Inside with_out_sharding: make() leaves the nodes untyped until the op returns and its
  // result's node is known (an explicit type_new_nodes() still types them).
  int deferred_typing = 0;
  // unreduced[id], or none.
  const std::vector<std::string>& unreduced_of(int id) const;
  // reduced[id], or none.
  const std::vector<std::string>& reduced_of(int id) const;
  // Inside auto_axes: the Explicit mesh axes treated as Auto there (left out of the types).
  std::vector<std::string> auto_axes;
  // The auto_axes each node was typed with, by id, for the nodes typed with some (the graph
  // does not record auto_axes scopes): vmap batches such a node with them again (client/vmap.cc),
  // as JAX's BatchTrace binds the batched op inside auto_axes' use_abstract_mesh.
  std::map<int, std::vector<std::string>> typed_auto_axes;
  // `spec` without the axes of auto_axes.
  TypeSpec without_auto_axes(TypeSpec spec) const;
  // While vmap traces its function over arguments whose mapped dimension is split over Explicit
  // mesh axes: those axes (JAX's axis env explicit_mesh_axis_names). The examples' types leave
  // them out, and a shard_map traced there is not manual over them (client/shard_map.cc).
  std::vector<std::string> vmapped_axes;
  // vmapped_axes of this trace and of the traces enclosing it (a control-flow body's parents).
  std::vector<std::string> all_vmapped_axes() const {
    std::vector<std::string> out;
    for (const TraceState* t = this; t != nullptr; t = t->parent) {
      out.insert(out.end(), t->vmapped_axes.begin(), t->vmapped_axes.end());
    }
    return out;
  }

  // The type specs of the nodes added since the last call (their rules' errors name the op).
  absl::Status type_new_nodes();

  // The trace running on this thread (for ops without operands: iota, full).
  static thread_local TraceState* current;

  // A control-flow body (scan, while_loop, cond) traced inside `parent`: an op of the body
  // that reads a Value of an enclosing trace captures it (JAX's closed-over consts): the
  // value becomes a parameter of the body, after its own ones, and `captured` lists those
  // values, as values of the parent (a value of a trace further out is captured by each body
  // in between). Null for a top-level trace, where another trace's value is an error.
  TraceState* parent = nullptr;
  std::vector<Value> captured;
  std::vector<int> captured_params;  // the body's parameter node for each

  static TraceState* of(const Value& v) { return v.trace_.get(); }
  // v's node in its own trace (of(v)), where its type is: a value of an enclosing trace read
  // from a body keeps the type it has there, and asking for it captures nothing. Else id(v).
  static int type_id(const Value& v) { return v.trace_.get() != current ? v.id_ : id(v); }
  // v's node in the trace being recorded: its own, or (a value of an enclosing trace, read
  // inside a body) the body's parameter capturing it.
  static int id(const Value& v) {
    TraceState* c = current;
    if (c != nullptr && c->parent != nullptr && v.trace_.get() != c && c->encloses(v.trace_.get())) {
      const int captured = c->capture(v);
      return c->lifts() ? c->lift(captured) : captured;
    }
    if (c != nullptr && v.trace_.get() == c && c->lifts()) return c->lift(v.id_);
    return v.id_;
  }
  // v as a value of the current trace (captured when it belongs to an enclosing one).
  static Value local(const Value& v) {
    TraceState* c = current;
    if (!v.ok() || c == nullptr || v.trace_.get() == c || !c->encloses(v.trace_.get())) return v;
    return c->make(c->capture(v));
  }
  // Whether `t` is an enclosing trace of this body.
  bool encloses(const TraceState* t) const {
    for (const TraceState* p = parent; p != nullptr; p = p->parent) {
      if (p == t) return true;
    }
    return false;
  }
  int capture(const Value& v);  // trace.cc

  Value make(absl::StatusOr<int> id) {
    if (!id.ok()) return fail(id.status());
    if (explicit_mesh.has_value() && deferred_typing == 0) {
      absl::Status typed = type_new_nodes();
      if (!typed.ok()) return fail(typed);
    }
    return Value(shared_from_this(), *id);
  }
  Value fail(const absl::Status& status) {
    if (error.ok()) error = status;
    return Value();
  }

  // The trace all of `values` belong to, or null (recording why) if one failed already or
  // they come from different traces.
  static TraceState* common(std::initializer_list<const Value*> values) {
    if (current != nullptr && current->parent != nullptr) {  // a body: its values and captured ones
      bool inside = true;
      for (const Value* v : values) {
        if (!v->ok()) return nullptr;
        inside = inside && (of(*v) == current || current->encloses(of(*v)));
      }
      if (inside) return current;
    }
    TraceState* t = nullptr;
    for (const Value* v : values) {
      if (!v->ok()) return nullptr;
      if (t == nullptr) t = of(*v);
      if (of(*v) != t) {
        t->fail(absl::InvalidArgumentError("an op mixes values of two different traces"));
        return nullptr;
      }
    }
    return t;
  }
};

// `v` laid out as `like` (same shape), as grad lays out gradients.
inline Value sharded_like(const Value& v, const Value& like) {
  TraceState* t = TraceState::common({&v, &like});
  return t == nullptr ? Value() : t->make(t->graph.add_sharding_as(TraceState::id(v), TraceState::id(like)));
}

// In explicit mode, `x`'s type as the rules see it (Auto axes of auto_axes left out); none
// outside explicit mode (or for an invalid x). For composites checking their rule first.
std::optional<TypedOperand> typed_operand(const Value& x);

// `values` (of trace t) made to vary along the same manual axes, as JAX makes an op's operands
// agree (jax/_src/core.py's auto_insert_reshard, formerly standard_insert_pvary, which lax.py
// calls before binding binary ops, select_n, dot_general, concatenate, pad and clamp; the
// shard_map notebook: "JAX implicitly inserts jax.lax.pcast(..., to='varying') calls ...
// especially for binary operations"): each
// value not varying along an axis another varies along is pvary'd along it. `values` as they
// are outside a shard_map body traced with check_vma. shard_map.cc.
std::vector<Value> insert_pvary(TraceState* t, std::vector<Value> values);

// f traced as a control-flow body of trace `parent`: parameters `inputs`, then one per value
// of an enclosing trace f reads (`captured`: those values, of `parent`). When `parent` is in
// explicit mode so is the body: its parameters typed by `input_types` (their specs, unreduced
// and reduced axes, as JAX traces a body with its operands' avals; a captured value by its
// type in `parent`), its results pinned to their types (body_output_spec reads them back).
// In a shard_map body, parameter k varies as `input_vma[k]` (TraceState::nest_in).
absl::StatusOr<Graph> trace_body(TraceState* parent, const TracedFunction& f, const std::vector<ArrayType>& inputs,
                                 std::vector<Value>* captured, const std::vector<TypedOperand>& input_types = {},
                                 const std::vector<Variance>& input_vma = {});

// The nodes of `g` from `start` on whose only way out (`outputs` counting as ways out) is into a
// sharding constraint, directly or through nodes that are. A graph does not record which ops
// were traced with out_sharding (dot_general, reshape, ...: the op, then a constraint to it), so
// explicit mode types such a node again as inside an out_sharding (the constraint then gives its
// type, as the op's out_sharding did): when inline_graph records a graph, and when vmap batches
// f's nodes.
std::vector<bool> pinned_by_constraints(const Graph& g, int start, const std::vector<int>& outputs);

// `g` recorded in the current trace on `args` (its parameters, in order): its outputs
// (invalid Values when the trace failed).
std::vector<Value> inline_graph(const Graph& g, const std::vector<Value>& args);
// As above, but only what g's outputs at positions `wanted` need is recorded, and the nodes
// in `given` (by id) are not recorded: each is the Value given for it. A parameter nothing
// wanted reads may be an invalid Value in `args`. Returns the wanted outputs' values; with
// `recorded`, also each of g's nodes' node in the trace (-1 for one not recorded: a parameter,
// a given node, or one nothing wanted reads).
std::vector<Value> inline_graph(const Graph& g, const std::vector<Value>& args, const std::map<int, Value>& given,
                                const std::vector<size_t>& wanted, std::vector<int>* recorded = nullptr);

// A dimension given numpy-style (negative counts from the end) as a position in 0..rank-1
// (out-of-range values stay out of range, for the graph to refuse).
inline int64_t normalize_axis(int64_t axis, int64_t rank) { return axis < 0 ? axis + rank : axis; }

}  // namespace internal

}  // namespace tessera

#endif  // TESSERA_CLIENT_TRACE_STATE_H_

// Sharding rules of control flow: scan (lax.scan) — a loop whose body is a graph of its own —,
// while_loop and switch (below).
//
// A scan's carries keep one layout through the loop (a fixed point): each carry enters as its
// initial value's layout (whole), and the body is propagated with its carries pinned to that
// layout on the way in and on the way out, so where the body would leave a carry in another
// layout the body's own program moves it back at the end of each iteration. The xs enter
// whole along the scanned dimension (each iteration reads one row) and keep their other
// splits; each stacked ys takes the body's layout of that result, whole along the new leading
// dimension. The body becomes a program of its own (propagate + partition, recursively), which
// the loop instruction runs once per iteration: its collectives run once per iteration, and
// the program's size does not depend on the length.
//
// An operand whose pending sum the program typed unreduced (explicit mode's {U:X}: a carry the
// loop's type keeps unreduced, client/explicit/control.cc) enters as that sum: each device's
// term goes round the loop, the body is compiled with that input and the carry's output
// unreduced alike, and the sum runs where the program reshards the result, not once per
// iteration (JAX's test_minibatch_scan_unreduced: one all-reduce). Any other pending sum is
// resolved before the loop.
#include <memory>

#include "absl/strings/str_cat.h"
#include "coordinator/compiler/partition.h"
#include "coordinator/compiler/rules.h"
#include "core/status.h"
#include "core/wire.h"

namespace tessera::internal {
namespace {

Shape local_shape(const Mesh& mesh, const ValueSharding& s, const Shape& shape) {
  return NamedSharding(mesh, s.spec()).shard_shape(shape);
}

// Operand `o` of a loop or switch as it enters: in its layout, whole unless its pending sum is
// typed unreduced (above).
ValueSharding entering(const ShardingContext& c, int o) {
  ValueSharding v = c.of_or_replicated(o);
  if (!c.typed_unreduced(o)) v.partial.clear();
  return v;
}

// v's layout as a spec, its pending sum as unreduced axes.
PartitionSpec spec_of(const ValueSharding& v) { return v.spec().with_unreduced(v.partial); }

// What the scan needs of each operand: a carry whole in its layout, an xs also whole along its
// scanned (leading) dimension.
std::vector<ValueSharding> scan_needs(const ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ScanAttrs& a = n.attrs<ScanAttrs>();
  std::vector<ValueSharding> needs;
  for (size_t k = 0; k < n.operands.size(); ++k) {
    ValueSharding v = entering(c, n.operands[k]);
    if (static_cast<int64_t>(k) >= a.num_carry) v.dims[0].clear();
    needs.push_back(std::move(v));
  }
  return needs;
}

// The body's input and output specs for operands laid out as `needs`: carries in and out as
// they enter, xs rows as their xs without the leading dimension, ys free.
struct BodySpecs {
  std::vector<PartitionSpec> inputs;
  std::vector<std::optional<PartitionSpec>> outputs;
};
BodySpecs body_specs(const ScanAttrs& a, const std::vector<ValueSharding>& needs) {
  BodySpecs s;
  for (size_t k = 0; k < needs.size(); ++k) {
    std::vector<Axes> dims = needs[k].dims;
    if (static_cast<int64_t>(k) >= a.num_carry) dims.erase(dims.begin());
    s.inputs.push_back(PartitionSpec(dims).with_unreduced(needs[k].partial));
  }
  for (size_t j = 0; j < a.body->outputs().size(); ++j) {
    s.outputs.push_back(static_cast<int64_t>(j) < a.num_carry ? std::optional<PartitionSpec>(s.inputs[j])
                                                              : std::nullopt);
  }
  return s;
}

// The body compiled for operands laid out as `needs`: its program, and each result's spec.
absl::StatusOr<Executable> compile_body(const Mesh& mesh, const ScanAttrs& a, const std::vector<ValueSharding>& needs,
                                        int id) {
  const BodySpecs specs = body_specs(a, needs);
  absl::StatusOr<Propagation> p = propagate(*a.body, mesh, specs.inputs, specs.outputs);
  absl::StatusOr<Executable> exe = p.ok() ? partition(*a.body, mesh, *p, specs.outputs) : p.status();
  if (!exe.ok()) {
    return absl::Status(exe.status().code(), absl::StrCat("%", id, " = scan: its body: ", exe.status().message()));
  }
  return exe;
}

// Result `output`'s layout: a carry's as it enters; a stacked ys whole along its leading
// dimension, then the body's layout of that result (and its pending sum: a ys the body leaves
// unreduced is stacked of each device's terms).
ValueSharding result_layout(const ScanAttrs& a, const std::vector<ValueSharding>& needs, const Executable& body) {
  if (a.output < a.num_carry) return needs[a.output];
  const PartitionSpec& spec = body.output_specs[a.output];
  const size_t rank = a.body->node(a.body->outputs()[a.output]).shape.size();
  Dims dims(rank + 1);
  for (int d = 0; d < spec.size() && d < static_cast<int>(rank); ++d) dims[d + 1] = spec.axes(d);
  return ValueSharding{std::move(dims), spec.unreduced()};
}

// Whether scan nodes `a` and `b` have one header: the same operands, length, direction and carries.
bool same_header(const Node& a, const Node& b) {
  if (b.op != Op::kScan || a.operands != b.operands) return false;
  const ScanAttrs& x = a.attrs<ScanAttrs>();
  const ScanAttrs& y = b.attrs<ScanAttrs>();
  return x.length == y.length && x.reverse == y.reverse && x.num_carry == y.num_carry;
}

// The loop scan node `id` is a result of: of the nodes of its header whose bodies extend its
// own (a scan's VJP extends the forward body with what its backward pass reads; JAX's partial
// evaluation of scan), the body with the most results (the first of them), as `id`'s result.
ScanAttrs loop_of(const Graph& g, int id) {
  const Node& n = g.node(id);
  ScanAttrs loop = n.attrs<ScanAttrs>();
  const Graph& own = *loop.body;
  for (int m = 0; m < g.size(); ++m) {
    const Node& o = g.node(m);
    if (m == id || !same_header(n, o)) continue;
    const std::shared_ptr<const Graph>& body = o.attrs<ScanAttrs>().body;
    if (body->outputs().size() > loop.body->outputs().size() && graph_extends(*body, own)) loop.body = body;
  }
  return loop;
}

absl::Status scan_forward(ShardingContext& c, int id) {
  const ScanAttrs a = loop_of(c.graph(), id);
  std::vector<ValueSharding> needs = scan_needs(c, id);
  TESSERA_ASSIGN_OR_RETURN(Executable body, compile_body(c.mesh(), a, needs, id));
  ValueSharding r = result_layout(a, needs, body);
  c.set(id, std::move(r.dims), std::move(r.partial));
  c.mark_typed_unreduced(id);  // a carry's sum as it entered, or one the body's ys is typed with
  c.needs(id) = std::move(needs);
  return absl::OkStatus();
}

// Nothing moves across a scan in the backward pass: its layouts are the loop's fixed point.
DimMap scan_map(const Graph& g, const Node& n) {
  DimMap m{{}, std::vector<bool>(n.shape.size(), false)};
  for (int o : n.operands) m.follow.push_back(std::vector<int>(g.node(o).shape.size(), -1));
  return m;
}

// One loop instruction for all the scan's nodes (the first one emits it, the others find
// their slots bound): the operands resharded as the scan needs, the body's program inside.
absl::Status scan_partition(PartitionContext& c, int id) {
  if (c.slot_of(id) >= 0) return absl::OkStatus();
  const Graph& g = c.graph();
  const Node& n = g.node(id);
  const ScanAttrs a = loop_of(g, id);
  const std::vector<ValueSharding>& needs = c.propagation().operands[id];
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  TESSERA_ASSIGN_OR_RETURN(Executable body, compile_body(c.mesh(), a, needs, id));
  Instruction loop;
  loop.kind = Instruction::Kind::kLoop;
  loop.in = in;
  loop.node.operands = in;
  loop.value = id;
  loop.cause = c.cause(id);
  loop.trip_count = a.length;
  loop.reverse = a.reverse;
  loop.num_carry = static_cast<int>(a.num_carry);
  const size_t results = a.body->outputs().size();
  for (size_t j = 0; j < results; ++j) {
    ScanAttrs r = a;
    r.output = static_cast<int64_t>(j);
    const Node& out = a.body->node(a.body->outputs()[j]);
    Shape shape = out.shape;
    if (static_cast<int64_t>(j) >= a.num_carry) shape.insert(shape.begin(), a.length);
    loop.out_types.push_back({out.dtype, local_shape(c.mesh(), result_layout(r, needs, body), shape)});
  }
  loop.node.dtype = loop.out_types[0].dtype;
  loop.node.shape = loop.out_types[0].shape;
  for (size_t j = 1; j < results; ++j) loop.extra_out.push_back(c.fresh_slot());
  loop.body = std::make_shared<const DevicePlan>(std::move(body.program));
  const std::vector<int> extra = loop.extra_out;
  const int first = c.emit(std::move(loop));
  for (int m = id; m < g.size(); ++m) {
    if (m != id) {  // a result of this loop: of its header, with the same loop
      if (!same_header(n, g.node(m)) || c.slot_of(m) >= 0) continue;
      const Graph& other = *loop_of(g, m).body;
      if (other.outputs().size() != a.body->outputs().size() || !graph_extends(*a.body, other)) continue;
    }
    const int64_t j = g.node(m).attrs<ScanAttrs>().output;
    c.bind(m, j == 0 ? first : extra[j - 1]);
  }
  return absl::OkStatus();
}

// ---- while_loop and switch (BranchesAttrs) ---------------------------------------------------
//
// A while loop's carries are a fixed point as a scan's: each enters in its initial value's
// layout (whole) and the body is compiled with its carries pinned to it at both ends. The
// predicate is compiled with its bool result pinned replicated, P(): a pending reduction
// (`sum(x) < 1` of a split x) is all-reduced in the predicate's program, and a collective
// gives every member bitwise the same result (worker/collectives/engine.h), so every device
// computes the same predicate and leaves the loop at the same iteration.
//
// A switch's index is needed replicated (so every device runs the same branch, and the same
// collectives); its other operands enter whole in their own layouts. The branches' results are
// joined to one layout: each branch is compiled with its results free, and a result keeps the
// split of a dimension only where every branch leaves it the same; elsewhere it is whole.
// Then every branch is compiled with its results pinned to that join, so each branch's
// program moves its results there.

// Whether a while loop with collectives in its predicate or body must stop (core/plan.h):
// the op ids a run reserves for them are this many iterations' worth.
constexpr int64_t kWhileBound = int64_t{1} << 16;

std::vector<ValueSharding> whole_needs(const ShardingContext& c, int id) {
  std::vector<ValueSharding> needs;
  for (int o : c.graph().node(id).operands) needs.push_back(entering(c, o));
  return needs;
}

absl::StatusOr<Executable> compile_graph(const Mesh& mesh, const Graph& g, const std::vector<PartitionSpec>& inputs,
                                         const std::vector<std::optional<PartitionSpec>>& outputs,
                                         const std::string& what) {
  absl::StatusOr<Propagation> p = propagate(g, mesh, inputs, outputs);
  absl::StatusOr<Executable> exe = p.ok() ? partition(g, mesh, *p, outputs) : p.status();
  if (!exe.ok()) return absl::Status(exe.status().code(), absl::StrCat(what, ": ", exe.status().message()));
  return exe;
}

std::vector<PartitionSpec> specs_of(const std::vector<ValueSharding>& v, size_t from = 0) {
  std::vector<PartitionSpec> out;
  for (size_t k = from; k < v.size(); ++k) out.push_back(spec_of(v[k]));
  return out;
}

// The while loop's predicate and body programs for carries laid out as `needs`.
absl::StatusOr<std::pair<Executable, Executable>> compile_while(const Mesh& mesh, const BranchesAttrs& a,
                                                                const std::vector<ValueSharding>& needs, int id) {
  const std::vector<PartitionSpec> in = specs_of(needs);
  TESSERA_ASSIGN_OR_RETURN(Executable pred, compile_graph(mesh, *a.graphs[0], in, {PartitionSpec()},
                                                          absl::StrCat("%", id, " = while: its predicate")));
  std::vector<std::optional<PartitionSpec>> out(in.begin(), in.end());
  TESSERA_ASSIGN_OR_RETURN(Executable body,
                           compile_graph(mesh, *a.graphs[1], in, out, absl::StrCat("%", id, " = while: its body")));
  return std::make_pair(std::move(pred), std::move(body));
}

absl::Status while_forward(ShardingContext& c, int id) {
  const BranchesAttrs& a = c.graph().node(id).attrs<BranchesAttrs>();
  std::vector<ValueSharding> needs = whole_needs(c, id);
  TESSERA_RETURN_IF_ERROR(compile_while(c.mesh(), a, needs, id).status());
  c.set(id, needs[a.output].dims, needs[a.output].partial);
  c.mark_typed_unreduced(id);
  c.needs(id) = std::move(needs);
  return absl::OkStatus();
}

// The join of the branches' result layouts (the rule above), and each branch compiled to it.
absl::StatusOr<std::vector<Executable>> compile_switch(const Mesh& mesh, const BranchesAttrs& a,
                                                       const std::vector<ValueSharding>& needs, int id) {
  const std::vector<PartitionSpec> in = specs_of(needs, 1);
  const size_t results = a.graphs[0]->outputs().size();
  std::vector<std::optional<Dims>> join(results);
  // A result every branch leaves unreduced over the same axes (explicit mode's type, which the
  // branches agree on) stays so.
  std::vector<std::optional<std::vector<std::string>>> pending(results);
  for (size_t b = 0; b < a.graphs.size(); ++b) {
    TESSERA_ASSIGN_OR_RETURN(Executable free,
                             compile_graph(mesh, *a.graphs[b], in, std::vector<std::optional<PartitionSpec>>(results),
                                           absl::StrCat("%", id, " = switch: its branch ", b)));
    for (size_t j = 0; j < results; ++j) {
      const size_t rank = a.graphs[b]->node(a.graphs[b]->outputs()[j]).shape.size();
      Dims dims(rank);
      for (int d = 0; d < free.output_specs[j].size() && d < static_cast<int>(rank); ++d) {
        dims[d] = free.output_specs[j].axes(d);
      }
      const std::vector<std::string>& unreduced = free.output_specs[j].unreduced();
      if (!pending[j].has_value()) {
        pending[j] = unreduced;
      } else if (!same_axes(*pending[j], unreduced)) {
        pending[j]->clear();
      }
      if (!join[j].has_value()) {
        join[j] = dims;
        continue;
      }
      for (size_t d = 0; d < rank; ++d) {
        if ((*join[j])[d] != dims[d]) (*join[j])[d].clear();
      }
    }
  }
  std::vector<std::optional<PartitionSpec>> pinned;
  for (size_t j = 0; j < results; ++j) pinned.push_back(PartitionSpec(*join[j]).with_unreduced(*pending[j]));
  std::vector<Executable> out;
  for (size_t b = 0; b < a.graphs.size(); ++b) {
    TESSERA_ASSIGN_OR_RETURN(Executable e, compile_graph(mesh, *a.graphs[b], in, pinned,
                                                         absl::StrCat("%", id, " = switch: its branch ", b)));
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<ValueSharding> switch_needs(const ShardingContext& c, int id) {
  std::vector<ValueSharding> needs = whole_needs(c, id);
  needs[0] = ValueSharding::replicated(0);  // the index: every device takes the same branch
  return needs;
}

ValueSharding switch_result(const BranchesAttrs& a, const Executable& branch0) {
  const PartitionSpec& spec = branch0.output_specs[a.output];
  Dims dims(a.graphs[0]->node(a.graphs[0]->outputs()[a.output]).shape.size());
  for (int d = 0; d < spec.size() && d < static_cast<int>(dims.size()); ++d) dims[d] = spec.axes(d);
  return ValueSharding{std::move(dims), spec.unreduced()};
}

absl::Status switch_forward(ShardingContext& c, int id) {
  const BranchesAttrs& a = c.graph().node(id).attrs<BranchesAttrs>();
  std::vector<ValueSharding> needs = switch_needs(c, id);
  TESSERA_ASSIGN_OR_RETURN(std::vector<Executable> branches, compile_switch(c.mesh(), a, needs, id));
  ValueSharding r = switch_result(a, branches[0]);
  c.set(id, std::move(r.dims), std::move(r.partial));
  c.mark_typed_unreduced(id);  // the sum every branch's result is typed with
  c.needs(id) = std::move(needs);
  return absl::OkStatus();
}

// Whether `a` and `b` are results of one while loop or switch (decoded from the wire, each
// node holds its own copy of the sub-graphs).
bool same_branches(const Node& a, const Node& b, const Mesh& mesh) {
  if (b.op != a.op || b.operands != a.operands) return false;
  const auto& x = a.attrs<BranchesAttrs>().graphs;
  const auto& y = b.attrs<BranchesAttrs>().graphs;
  if (x.size() != y.size()) return false;
  for (size_t k = 0; k < x.size(); ++k) {
    if (x[k] != y[k] && compile_key(*x[k], mesh, {}, {}, {}) != compile_key(*y[k], mesh, {}, {}, {})) return false;
  }
  return true;
}

// One instruction for all the op's nodes (the first emits it and binds the others' slots).
absl::Status branches_partition(PartitionContext& c, int id) {
  if (c.slot_of(id) >= 0) return absl::OkStatus();
  const Graph& g = c.graph();
  const Node& n = g.node(id);
  const BranchesAttrs& a = n.attrs<BranchesAttrs>();
  const std::vector<ValueSharding>& needs = c.propagation().operands[id];
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  Instruction inst;
  inst.in = in;
  inst.node.operands = in;
  inst.value = id;
  inst.cause = c.cause(id);
  std::vector<ValueSharding> result_dims;
  const Graph& shape_of = n.op == Op::kWhile ? *a.graphs[1] : *a.graphs[0];
  if (n.op == Op::kWhile) {
    TESSERA_ASSIGN_OR_RETURN(auto programs, compile_while(c.mesh(), a, needs, id));
    inst.kind = Instruction::Kind::kLoop;
    inst.num_carry = static_cast<int>(in.size());
    inst.trip_count =
        plan_has_collectives(programs.first.program) || plan_has_collectives(programs.second.program) ? kWhileBound : 0;
    inst.branches.push_back(std::make_shared<const DevicePlan>(std::move(programs.first.program)));
    inst.body = std::make_shared<const DevicePlan>(std::move(programs.second.program));
    result_dims = needs;
  } else {
    TESSERA_ASSIGN_OR_RETURN(std::vector<Executable> branches, compile_switch(c.mesh(), a, needs, id));
    inst.kind = Instruction::Kind::kSwitch;
    for (size_t j = 0; j < shape_of.outputs().size(); ++j) {
      BranchesAttrs r = a;
      r.output = static_cast<int64_t>(j);
      result_dims.push_back(switch_result(r, branches[0]));
    }
    for (Executable& e : branches) inst.branches.push_back(std::make_shared<const DevicePlan>(std::move(e.program)));
  }
  for (size_t j = 0; j < shape_of.outputs().size(); ++j) {
    const Node& out = shape_of.node(shape_of.outputs()[j]);
    inst.out_types.push_back({out.dtype, local_shape(c.mesh(), result_dims[j], out.shape)});
  }
  inst.node.dtype = inst.out_types[0].dtype;
  inst.node.shape = inst.out_types[0].shape;
  for (size_t j = 1; j < inst.out_types.size(); ++j) inst.extra_out.push_back(c.fresh_slot());
  const std::vector<int> extra = inst.extra_out;
  const int first = c.emit(std::move(inst));
  for (int m = id; m < g.size(); ++m) {
    if (m != id && !same_branches(n, g.node(m), c.mesh())) continue;
    const int64_t j = g.node(m).attrs<BranchesAttrs>().output;
    c.bind(m, j == 0 ? first : extra[j - 1]);
  }
  return absl::OkStatus();
}

const ShardingRuleEntry kControlRules[] = {
    {Op::kScan, {scan_forward, scan_map, false, scan_partition}},
    {Op::kWhile, {while_forward, scan_map, false, branches_partition}},
    {Op::kSwitch, {switch_forward, scan_map, false, branches_partition}},
};

}  // namespace

absl::Span<const ShardingRuleEntry> control_rules() { return kControlRules; }

}  // namespace tessera::internal

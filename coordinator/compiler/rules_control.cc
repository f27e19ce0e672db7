// Sharding rules of control flow: scan (lax.scan) — a loop whose body is a graph of its own.
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

// What the scan needs of each operand: a carry whole in its layout, an xs also whole along its
// scanned (leading) dimension.
std::vector<ValueSharding> scan_needs(const ShardingContext& c, int id) {
  const Node& n = c.graph().node(id);
  const ScanAttrs& a = n.attrs<ScanAttrs>();
  std::vector<ValueSharding> needs;
  for (size_t k = 0; k < n.operands.size(); ++k) {
    ValueSharding v = c.of_or_replicated(n.operands[k]);
    v.partial.clear();
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
    s.inputs.push_back(PartitionSpec(dims));
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
// dimension, then the body's layout of that result.
Dims result_dims(const ScanAttrs& a, const std::vector<ValueSharding>& needs, const Executable& body) {
  if (a.output < a.num_carry) return needs[a.output].dims;
  const PartitionSpec& spec = body.output_specs[a.output];
  const size_t rank = a.body->node(a.body->outputs()[a.output]).shape.size();
  Dims dims(rank + 1);
  for (int d = 0; d < spec.size() && d < static_cast<int>(rank); ++d) dims[d + 1] = spec.axes(d);
  return dims;
}

absl::Status scan_forward(ShardingContext& c, int id) {
  const ScanAttrs& a = c.graph().node(id).attrs<ScanAttrs>();
  std::vector<ValueSharding> needs = scan_needs(c, id);
  TESSERA_ASSIGN_OR_RETURN(Executable body, compile_body(c.mesh(), a, needs, id));
  c.set(id, result_dims(a, needs, body));
  c.needs(id) = std::move(needs);
  return absl::OkStatus();
}

// Nothing moves across a scan in the backward pass: its layouts are the loop's fixed point.
DimMap scan_map(const Graph& g, const Node& n) {
  DimMap m{{}, std::vector<bool>(n.shape.size(), false)};
  for (int o : n.operands) m.follow.push_back(std::vector<int>(g.node(o).shape.size(), -1));
  return m;
}

// Whether scan nodes `a` and `b` are results of one loop: the same operands and the same loop.
bool same_loop(const Node& a, const Node& b, const Mesh& mesh) {
  if (b.op != Op::kScan || a.operands != b.operands) return false;
  const ScanAttrs& x = a.attrs<ScanAttrs>();
  const ScanAttrs& y = b.attrs<ScanAttrs>();
  if (x.length != y.length || x.reverse != y.reverse || x.num_carry != y.num_carry) return false;
  return x.body == y.body || compile_key(*x.body, mesh, {}, {}, {}) == compile_key(*y.body, mesh, {}, {}, {});
}

// One loop instruction for all the scan's nodes (the first one emits it, the others find
// their slots bound): the operands resharded as the scan needs, the body's program inside.
absl::Status scan_partition(PartitionContext& c, int id) {
  if (c.slot_of(id) >= 0) return absl::OkStatus();
  const Graph& g = c.graph();
  const Node& n = g.node(id);
  const ScanAttrs& a = n.attrs<ScanAttrs>();
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
    loop.out_types.push_back({out.dtype, local_shape(c.mesh(), ValueSharding{result_dims(r, needs, body), {}}, shape)});
  }
  loop.node.dtype = loop.out_types[0].dtype;
  loop.node.shape = loop.out_types[0].shape;
  for (size_t j = 1; j < results; ++j) loop.extra_out.push_back(c.fresh_slot());
  loop.body = std::make_shared<const DevicePlan>(std::move(body.program));
  const std::vector<int> extra = loop.extra_out;
  const int first = c.emit(std::move(loop));
  for (int m = id; m < g.size(); ++m) {
    const Node& other = g.node(m);
    if (m != id && !same_loop(n, other, c.mesh())) continue;
    const int64_t j = other.attrs<ScanAttrs>().output;
    c.bind(m, j == 0 ? first : extra[j - 1]);
  }
  return absl::OkStatus();
}

const ShardingRuleEntry kControlRules[] = {
    {Op::kScan, {scan_forward, scan_map, false, scan_partition}},
};

}  // namespace

absl::Span<const ShardingRuleEntry> control_rules() { return kControlRules; }

}  // namespace tessera::internal

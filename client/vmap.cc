#include "tessera/vmap.h"

#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/batching/batching.h"
#include "client/trace_state.h"

namespace tessera {

using internal::TraceState;

namespace internal {

BatchRule find_batching(Op op) {
  struct Registry {
    BatchRule rules[kNumOps] = {};
    Registry() {
      for (absl::Span<const BatchEntry> family :
           {elementwise_batching(), layout_batching(), reduction_batching(), dot_batching(), indexing_batching(),
            shard_map_batching(), random_batching(), control_batching()}) {
        for (const BatchEntry& e : family) rules[static_cast<int>(e.op)] = e.rule;
      }
    }
  };
  static const Registry* const kRegistry = new Registry();
  return is_op(op) ? kRegistry->rules[static_cast<int>(op)] : nullptr;
}

Value move_dim(const Value& x, int64_t from, int64_t to) {
  if (from == to || !x.ok()) return x;
  std::vector<int64_t> order;
  for (int64_t d = 0; d < x.rank(); ++d) {
    if (d != from) order.push_back(d);
  }
  order.insert(order.begin() + to, from);
  return transpose(x, std::move(order));
}

std::vector<int64_t> shifted(const std::vector<int64_t>& dims) {
  std::vector<int64_t> out;
  for (int64_t d : dims) out.push_back(d + 1);
  return out;
}

Value broadcast_batch(const Value& x, int64_t size) {
  const Shape example = x.shape();
  Shape shape = {size};
  shape.insert(shape.end(), example.begin(), example.end());
  std::vector<int64_t> dims;
  for (size_t d = 0; d < example.size(); ++d) dims.push_back(static_cast<int64_t>(d) + 1);
  return broadcast_in_dim(x, std::move(shape), std::move(dims));
}

Value BatchArgs::batched_operand(size_t k) const { return batched[k] ? x[k] : broadcast_batch(x[k], size); }

Value BatchArgs::add(Node n, const std::vector<Value>& operands, Shape shape) const {
  n.operands.clear();
  for (const Value& v : operands) {
    if (!v.ok()) return Value();
    n.operands.push_back(TraceState::id(v));
  }
  n.shape = std::move(shape);
  return trace->make(trace->graph.add_node(std::move(n)));
}

namespace {

// The sub-graphs of a multi-result op's node (they identify the op: its nodes share them).
const void* sub_graphs_of(const Node& n) {
  if (const auto* s = std::get_if<ScanAttrs>(&n.attributes)) return s->body.get();
  if (const auto* b = std::get_if<BranchesAttrs>(&n.attributes))
    return b->graphs.empty() ? nullptr : b->graphs[0].get();
  return nullptr;
}

int64_t output_of(const Node& n) {
  if (const auto* s = std::get_if<ScanAttrs>(&n.attributes)) return s->output;
  if (const auto* b = std::get_if<BranchesAttrs>(&n.attributes)) return b->output;
  return 0;
}

}  // namespace

Value BatchArgs::record(const std::vector<Value>& results) const {
  const Graph& g = trace->graph;
  const void* subs = sub_graphs_of(node);
  Value own;
  for (int j = id; j < g.size(); ++j) {
    const Node& n = g.node(j);
    if (n.op != node.op || n.operands != node.operands || sub_graphs_of(n) != subs) continue;
    const int64_t k = output_of(n);
    if (k < 0 || k >= static_cast<int64_t>(results.size())) continue;
    if (j == id) {
      own = results[k];
    } else {
      batched_nodes->emplace(j, results[k]);
    }
  }
  return own;
}

namespace {

// Replays nodes [start, end) of trace t that read a batched value (in `batched`, by node:
// the value with the batch dimension first) through their batching rules, adding each result
// to `batched`. INVALID_ARGUMENT naming an op without a rule, or its rule's error.
absl::Status batch_nodes(TraceState* t, int start, int end, int64_t size, std::map<int, Value>& batched) {
  for (int id = start; id < end; ++id) {
    if (batched.count(id) != 0) continue;  // a sibling of a multi-result op batched before it
    const Node n = t->graph.node(id);      // a copy: the rules add nodes
    std::vector<Value> x;
    std::vector<bool> is_batched;
    bool any = false;
    for (int o : n.operands) {
      auto it = batched.find(o);
      is_batched.push_back(it != batched.end());
      x.push_back(it != batched.end() ? it->second : t->make(o));
      any = any || is_batched.back();
    }
    if (!any) continue;
    const BatchRule rule = find_batching(n.op);
    if (rule == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(op_name(n.op), " of a mapped value has no batching rule (node %", id, ")"));
    }
    absl::StatusOr<Value> v = rule(BatchArgs{n, x, is_batched, size, t, id, &batched});
    if (!t->error.ok()) return t->error;
    if (!v.ok()) return v.status();
    batched.emplace(id, *std::move(v));
  }
  return absl::OkStatus();
}

std::vector<Value> vmapped(const TracedFunction& f, const std::vector<std::optional<int64_t>>& in_axes,
                           const std::function<std::vector<std::optional<int64_t>>(size_t)>& out_axes,
                           std::optional<int64_t> axis_size, const std::vector<Value>& args) {
  TraceState* t = TraceState::current;
  for (const Value& a : args) {
    if (!a.ok()) return {};
    t = TraceState::of(a);
  }
  if (t == nullptr) return {};
  size_t num_results = 0;  // known once f has run: a failure then gives that many invalid Values
  auto fail = [&](const std::string& message) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("vmap: ", message)));
    return std::vector<Value>(num_results);
  };
  if (!in_axes.empty() && in_axes.size() != args.size()) {
    return fail(absl::StrCat("in_axes has ", in_axes.size(), " entries for ", args.size(), " arguments"));
  }
  // Each mapped argument with its mapped dimension moved first, and the example f sees.
  std::optional<int64_t> size = axis_size;
  std::vector<Value> examples;
  std::map<int, Value> batched;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::optional<int64_t> axis = in_axes.empty() ? std::optional<int64_t>(0) : in_axes[i];
    if (!axis.has_value()) {
      examples.push_back(args[i]);
      continue;
    }
    const Shape shape = args[i].shape();
    const int64_t d = internal::normalize_axis(*axis, args[i].rank());
    if (d < 0 || d >= args[i].rank()) {
      return fail(absl::StrCat("in_axes ", *axis, " is out of range for argument ", i, " of type ",
                               type_to_string(args[i].dtype(), shape)));
    }
    if (size.has_value() && *size != shape[d]) {
      return fail(absl::StrCat("argument ", i, " of type ", type_to_string(args[i].dtype(), shape), " has size ",
                               shape[d], " along in_axes ", *axis, "; the mapped size is ", *size,
                               axis_size.has_value() ? " (axis_size)" : " (an earlier argument's)"));
    }
    size = shape[d];
    const Value moved = move_dim(args[i], d, 0);
    Shape one = moved.shape();
    one[0] = 1;
    Shape example(one.begin() + 1, one.end());
    const Value e = reshape(slice(moved, std::vector<int64_t>(one.size(), 0), one), example);
    if (!e.ok()) return {};
    batched.emplace(TraceState::id(e), moved);
    examples.push_back(e);
  }
  if (!size.has_value()) return fail("no argument is mapped (every in_axes is None) and axis_size is not given");

  const int start = t->graph.size();
  std::vector<Value> results = f(examples);
  num_results = results.size();
  if (!t->error.ok()) return std::vector<Value>(num_results);
  for (const Value& r : results) {
    if (!r.ok() || (TraceState::of(r) != t && !t->encloses(TraceState::of(r)))) {
      return fail("the function returned a value that is not of this trace");
    }
  }
  absl::Status status = batch_nodes(t, start, t->graph.size(), *size, batched);
  if (!status.ok()) {
    if (!t->error.ok()) return std::vector<Value>(num_results);
    return fail(std::string(status.message()));
  }
  const std::vector<std::optional<int64_t>> axes = out_axes(results.size());
  if (axes.size() != results.size() && axes.size() > 1) {
    return fail(absl::StrCat("out_axes has ", axes.size(), " entries for ", results.size(), " results"));
  }
  std::vector<Value> out;
  for (size_t j = 0; j < results.size(); ++j) {
    const std::optional<int64_t> axis = axes.empty() ? std::optional<int64_t>(0) : axes[axes.size() == 1 ? 0 : j];
    auto it = batched.find(TraceState::id(results[j]));
    if (!axis.has_value()) {
      if (it != batched.end()) {
        return fail(absl::StrCat("out_axes is None for result ", j, ", but it depends on a mapped argument"));
      }
      out.push_back(results[j]);
      continue;
    }
    Value v = it != batched.end() ? it->second : internal::broadcast_batch(results[j], *size);
    const int64_t d = internal::normalize_axis(*axis, v.rank());
    if (d < 0 || d >= v.rank()) {
      return fail(absl::StrCat("out_axes ", *axis, " is out of range for result ", j, " of type ",
                               type_to_string(v.dtype(), v.shape())));
    }
    out.push_back(move_dim(v, 0, d));
  }
  return out;
}

}  // namespace

TracedFunction vmap(TracedFunction f, std::vector<std::optional<int64_t>> in_axes,
                    std::function<std::vector<std::optional<int64_t>>(size_t)> out_axes,
                    std::optional<int64_t> axis_size) {
  return [f = std::move(f), in_axes = std::move(in_axes), out_axes = std::move(out_axes),
          axis_size](const std::vector<Value>& args) { return vmapped(f, in_axes, out_axes, axis_size, args); };
}

}  // namespace internal

TracedFunction vmap(TracedFunction f, std::vector<std::optional<int64_t>> in_axes,
                    std::vector<std::optional<int64_t>> out_axes, std::optional<int64_t> axis_size) {
  return internal::vmap(
      std::move(f), std::move(in_axes), [out_axes = std::move(out_axes)](size_t) { return out_axes; }, axis_size);
}

}  // namespace tessera

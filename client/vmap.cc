#include "tessera/vmap.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/batching/batching.h"
#include "client/trace_state.h"
#include "core/status.h"

namespace tessera {

using internal::TraceState;

namespace internal {

namespace {

// The entry registered for `op` (an empty one when none is).
const BatchEntry& batch_entry(Op op) {
  struct Registry {
    BatchEntry entries[kNumOps] = {};
    Registry() {
      for (absl::Span<const BatchEntry> family :
           {elementwise_batching(), layout_batching(), reduction_batching(), dot_batching(), indexing_batching(),
            shard_map_batching(), random_batching(), control_batching()}) {
        for (const BatchEntry& e : family) entries[static_cast<int>(e.op)] = e;
      }
    }
  };
  static const Registry* const kRegistry = new Registry();
  static const BatchEntry kNone{};
  return is_op(op) ? kRegistry->entries[static_cast<int>(op)] : kNone;
}

}  // namespace

BatchRule find_batching(Op op) { return batch_entry(op).rule; }
UnmappedCheck find_unmapped_check(Op op) { return batch_entry(op).unmapped; }

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

Value broadcast_batch(const Value& x, int64_t size, const Axes& axes) {
  const Shape example = x.shape();
  Shape shape = {size};
  shape.insert(shape.end(), example.begin(), example.end());
  std::vector<int64_t> dims;
  for (size_t d = 0; d < example.size(); ++d) dims.push_back(static_cast<int64_t>(d) + 1);
  auto broadcast = [&] { return broadcast_in_dim(x, shape, dims); };
  // Inside auto_axes (a node batched in the scope it was recorded in) the axes made Auto there
  // show in no type: the new dimension is split over the others only.
  Axes split;
  // The trace typed_operand types x in (a captured value's body parameter's).
  const Value local = TraceState::local(x);
  const TraceState* t = local.ok() ? TraceState::of(local) : nullptr;
  for (const std::string& a : axes) {
    if (t == nullptr || std::find(t->auto_axes.begin(), t->auto_axes.end(), a) == t->auto_axes.end()) {
      split.push_back(a);
    }
  }
  const std::optional<TypedOperand> typed = split.empty() ? std::nullopt : typed_operand(x);
  if (!typed.has_value()) return broadcast();
  // The new dimension split over `split`, the others as x's type: broadcast_in_dim with that
  // out_sharding.
  TypeSpec spec = {split};
  spec.insert(spec.end(), typed->spec.begin(), typed->spec.end());
  return with_out_sharding("broadcast_in_dim", x, to_partition_spec(spec), broadcast);
}

Value BatchArgs::batched_operand(size_t k) const { return batched[k] ? x[k] : broadcast(x[k]); }
Value BatchArgs::broadcast(const Value& v) const { return broadcast_batch(v, size, layout.explicit_axes); }

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
// to `batched`. `results` are f's results (explicit mode: a node whose only way out is a
// sharding constraint, an op's out_sharding, is batched inside an out_sharding too, as
// pinned_by_constraints says). A node without a batched operand is left as it is, once its
// op's unmapped check (if any) passes. INVALID_ARGUMENT naming an op without a rule, or its
// rule's (or check's) error.
absl::Status batch_nodes(TraceState* t, int start, int end, const BatchLayout& layout, const std::vector<int>& results,
                         std::map<int, Value>& batched) {
  std::vector<bool> pinned;
  if (t->explicit_mesh.has_value()) pinned = pinned_by_constraints(t->graph, start, results);
  for (int id = start; id < end; ++id) {
    if (batched.count(id) != 0) continue;  // a sibling of a multi-result op batched before it
    const Node n = t->graph.node(id);      // a copy: the rules add nodes
    std::vector<Value> x;
    std::vector<bool> is_batched;
    // The node's batch size: its batched operands' leading dimension, vmap's size, but inside a shard_map body batched
    // over spmd_axis_name each block holds size / |spmd axes| examples (client/batching/shard_map.cc).
    std::optional<int64_t> node_size;
    for (int o : n.operands) {
      auto it = batched.find(o);
      is_batched.push_back(it != batched.end());
      x.push_back(it != batched.end() ? it->second : t->make(o));
      if (is_batched.back() && !node_size.has_value()) node_size = it->second.shape()[0];
    }
    if (!node_size.has_value()) {
      const UnmappedCheck check = find_unmapped_check(n.op);
      if (check != nullptr) TESSERA_RETURN_IF_ERROR(check(n, id, t));
      continue;
    }
    const BatchRule rule = find_batching(n.op);
    if (rule == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(op_name(n.op), " of a mapped value has no batching rule (node %", id, ")"));
    }
    // A node f recorded inside auto_axes (take's out_sharding, a gather's transpose) is batched
    // inside them again, as JAX binds the batched op under auto_axes' mesh: its batched nodes are
    // typed with those axes Auto (so a gather's Explicit rule does not see the batch's split);
    // the reshard after it (outside) puts the batch's axes back in front of its spec.
    const auto scope = t->typed_auto_axes.find(id);
    // The node's scope now, the scope it is batched in (the outer one) after the swap.
    std::vector<std::string> saved = scope == t->typed_auto_axes.end() ? std::vector<std::string>() : scope->second;
    const bool rescoped = t->explicit_mesh.has_value() && saved != t->auto_axes;
    if (rescoped) {
      TESSERA_RETURN_IF_ERROR(t->type_new_nodes());  // the nodes made so far, in the scope they were made in
      std::swap(saved, t->auto_axes);
    }
    const bool in_out_sharding = !pinned.empty() && pinned[id];
    if (in_out_sharding) ++t->out_sharding_scopes;
    absl::StatusOr<Value> v = rule(BatchArgs{n, x, is_batched, *node_size, t, id, &batched, layout});
    const absl::Status typed = rescoped ? t->type_new_nodes() : absl::OkStatus();
    if (in_out_sharding) --t->out_sharding_scopes;
    if (rescoped) t->auto_axes = std::move(saved);
    if (!t->error.ok()) return t->error;
    TESSERA_RETURN_IF_ERROR(typed);
    if (!v.ok()) return v.status();
    batched.emplace(id, *std::move(v));
  }
  return absl::OkStatus();
}

// The mesh axes of one dimension as Python prints a PartitionSpec entry: None, x, ('x', 'y').
std::string entry_string(const Axes& axes) {
  if (axes.empty()) return "None";
  return axes.size() == 1 ? axes[0] : axes_to_string(axes);
}

// Explicit mode: how the mapped arguments split their mapped dimension (JAX's
// _mapped_axis_spec and _check_ema_unmapped_args, jax/_src/api.py), with `spmd_axis_name` left
// out when it names the same axes (JAX's vmap); INVALID_ARGUMENT (without "vmap: ") for
// arguments split differently, an unmapped argument split over those axes, or an
// spmd_axis_name naming others.
absl::StatusOr<BatchLayout> batch_layout(const std::vector<Value>& args,
                                         const std::vector<std::optional<int64_t>>& dims, Axes spmd_axis_name) {
  BatchLayout layout;
  bool mapped = false;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!dims[i].has_value()) continue;
    const std::optional<TypedOperand> typed = typed_operand(args[i]);
    if (!typed.has_value()) return BatchLayout{{}, std::move(spmd_axis_name)};  // not in explicit mode
    const Axes& axes = typed->spec[*dims[i]];
    if (mapped && axes != layout.explicit_axes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Mapped away dimension of inputs passed to vmap should be sharded the same. Got inconsistent axis specs: ",
          entry_string(layout.explicit_axes), " vs ", entry_string(axes), " (argument ", i, " of type ",
          type_string(typed->dtype, typed->shape, typed->spec), " mapped along dimension ", *dims[i], ")"));
    }
    layout.explicit_axes = axes;
    mapped = true;
  }
  if (layout.explicit_axes.empty()) {
    layout.spmd_axes = std::move(spmd_axis_name);
    return layout;
  }
  for (size_t i = 0; i < args.size(); ++i) {
    if (dims[i].has_value()) continue;
    const std::optional<TypedOperand> typed = typed_operand(args[i]);
    if (!typed.has_value()) continue;
    for (const Axes& d : typed->spec) {
      for (const std::string& a : d) {
        if (std::find(layout.explicit_axes.begin(), layout.explicit_axes.end(), a) == layout.explicit_axes.end()) {
          continue;
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "Unmapped values passed to vmap cannot be sharded along the mesh axis you are vmapping over. Got type: ",
            type_string(typed->dtype, typed->shape, typed->spec),
            ", in_axes: None and vmapped mesh axis: ", axes_to_string(layout.explicit_axes), " (argument ", i, ")"));
      }
    }
  }
  if (!spmd_axis_name.empty() && spmd_axis_name != layout.explicit_axes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Only one of spmd_axis_name or arrays sharded on `Explicit` mesh axis type is allowed. Got spmd_axis_name=",
        axes_to_string(spmd_axis_name),
        " and arrays sharded on explicit_mesh_axis=", axes_to_string(layout.explicit_axes)));
  }
  return layout;
}

// One example of `moved` (batch dimension first): its slice at 0 without the batch dimension.
// In explicit mode it is typed as `moved` without the batch dimension's axes (JAX's mapped aval;
// inside vmap the batch dimension's axes are not the body's, as JAX's
// remove_explicit_mesh_axis_names): the slice is typed with those axes left out, as auto_axes
// leaves axes out, so a split batch dimension slices to one example.
Value example_of(TraceState* t, const Value& moved, const BatchLayout& layout) {
  Shape one = moved.shape();
  one[0] = 1;
  const Shape example(one.begin() + 1, one.end());
  if (!t->explicit_mesh.has_value() || layout.explicit_axes.empty()) {
    return reshape(slice(moved, std::vector<int64_t>(one.size(), 0), one), example);
  }
  absl::Status typed = t->type_new_nodes();
  if (!typed.ok()) return t->fail(typed);
  const size_t depth = t->auto_axes.size();
  t->auto_axes.insert(t->auto_axes.end(), layout.explicit_axes.begin(), layout.explicit_axes.end());
  const Value e = reshape(slice(moved, std::vector<int64_t>(one.size(), 0), one), example);
  t->auto_axes.resize(depth);
  return e;
}

std::vector<Value> vmapped(const TracedFunction& f, const std::vector<std::optional<int64_t>>& in_axes,
                           const std::function<std::vector<std::optional<int64_t>>(size_t)>& out_axes,
                           std::optional<int64_t> axis_size, const Axes& spmd_axis_name,
                           const std::vector<Value>& args) {
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
  // Each mapped argument's mapped dimension (checked), then the argument with it moved first,
  // and the example f sees.
  std::optional<int64_t> size = axis_size;
  std::vector<std::optional<int64_t>> dims;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::optional<int64_t> axis = in_axes.empty() ? std::optional<int64_t>(0) : in_axes[i];
    if (!axis.has_value()) {
      dims.push_back(std::nullopt);
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
    dims.push_back(d);
  }
  absl::StatusOr<BatchLayout> layout = batch_layout(args, dims, spmd_axis_name);
  if (!layout.ok()) return fail(std::string(layout.status().message()));
  std::vector<Value> examples;
  std::map<int, Value> batched;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!dims[i].has_value()) {
      examples.push_back(args[i]);
      continue;
    }
    const Value moved = move_dim(args[i], *dims[i], 0);
    const Value e = example_of(t, moved, *layout);
    if (!e.ok()) return {};
    batched.emplace(TraceState::id(e), moved);
    examples.push_back(e);
  }
  if (!size.has_value()) return fail("no argument is mapped (every in_axes is None) and axis_size is not given");

  const int start = t->graph.size();
  // While f is traced its examples are typed without the mapped dimension's axes, and a
  // shard_map in it is not manual over them (JAX's remove_explicit_mesh_axis_names scope).
  const size_t depth = t->vmapped_axes.size();
  t->vmapped_axes.insert(t->vmapped_axes.end(), layout->explicit_axes.begin(), layout->explicit_axes.end());
  std::vector<Value> results = f(examples);
  t->vmapped_axes.resize(depth);
  num_results = results.size();
  if (!t->error.ok()) return std::vector<Value>(num_results);
  for (const Value& r : results) {
    if (!r.ok() || (TraceState::of(r) != t && !t->encloses(TraceState::of(r)))) {
      return fail("the function returned a value that is not of this trace");
    }
  }
  std::vector<int> result_ids;
  for (const Value& r : results) result_ids.push_back(TraceState::id(r));
  absl::Status status = batch_nodes(t, start, t->graph.size(), *layout, result_ids, batched);
  if (!status.ok()) {
    if (!t->error.ok()) return std::vector<Value>(num_results);
    if (status.code() == absl::StatusCode::kUnimplemented) {  // what JAX does not batch: its NotImplementedError
      t->fail(absl::UnimplementedError(absl::StrCat("vmap: ", status.message())));
      return std::vector<Value>(num_results);
    }
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
    Value v = it != batched.end() ? it->second : broadcast_batch(results[j], *size, layout->explicit_axes);
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
                    std::optional<int64_t> axis_size, std::vector<std::string> spmd_axis_name) {
  return [f = std::move(f), in_axes = std::move(in_axes), out_axes = std::move(out_axes), axis_size,
          spmd_axis_name = std::move(spmd_axis_name)](const std::vector<Value>& args) {
    return vmapped(f, in_axes, out_axes, axis_size, spmd_axis_name, args);
  };
}

}  // namespace internal

TracedFunction vmap(TracedFunction f, std::vector<std::optional<int64_t>> in_axes,
                    std::vector<std::optional<int64_t>> out_axes, std::optional<int64_t> axis_size,
                    std::vector<std::string> spmd_axis_name) {
  return internal::vmap(
      std::move(f), std::move(in_axes), [out_axes = std::move(out_axes)](size_t) { return out_axes; }, axis_size,
      std::move(spmd_axis_name));
}

}  // namespace tessera

#include "coordinator/compiler/propagate.h"

#include <algorithm>
#include <limits>
#include <set>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/compiler/reshard.h"
#include "coordinator/compiler/rules.h"
#include "core/sharding.h"
#include "core/status.h"

namespace tessera {
namespace {

using internal::DimMap;
using internal::Dims;
using internal::ShardingRule;

class Propagator : public internal::ShardingContext {
 public:
  Propagator(const Graph& g, const Mesh& mesh) : g_(g), mesh_(mesh), assigned_(g.size(), false) {
    out_.result.resize(g.size());
    out_.operands.resize(g.size());
  }

  absl::StatusOr<Propagation> run(const std::vector<PartitionSpec>& inputs,
                                  const std::vector<std::optional<PartitionSpec>>& outputs) {
    if (inputs.size() != g_.parameters().size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: ", g_.parameters().size(), " inputs but ", inputs.size(), " input shardings"));
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      const Node& p = g_.node(g_.parameters()[i]);
      NamedSharding s(mesh_, inputs[i]);
      absl::Status fits = s.validate(p.shape);
      if (!fits.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("jit: input ", i, " ", type_to_string(p.dtype, p.shape), ": ", fits.message()));
      }
      // An unreduced input (P(..., unreduced={'X'})) holds a pending sum over those axes.
      set(g_.parameters()[i], padded(inputs[i], p.shape.size()), inputs[i].unreduced());
    }
    // shard_map bodies are explicit per-device code: their values are blocks, every device
    // holding its own — to propagation, replicated values of the block's shape, never moved.
    // A body manual over some axes only (shard_map's axis_names) is automatic over the others:
    // its values are blocks laid out over those axes, by the ops' own rules (automatic_).
    // A shard_map nested in a body (over axes the enclosing one left automatic) is manual over
    // both: each value's body is the set of manual axes it is in (body_axes; none outside every
    // body), which a shard_map_in enters and a shard_map_out leaves by its own axes.
    manual_.assign(g_.size(), false);
    automatic_.assign(g_.size(), {});
    std::vector<std::vector<std::string>> body_axes(g_.size());
    std::vector<std::string> latest;  // the body of the latest boundary, in trace order
    for (int id = 0; id < g_.size(); ++id) {
      const Node& n = g_.node(id);
      if (const Mesh* on = mesh_of(n); on != nullptr && *on != mesh_) {
        const auto [theirs, ours] = distinguish(*on, mesh_);
        return absl::InvalidArgumentError(
            absl::StrCat("jit: %", id, " = ", op_name(n.op), " is on ", theirs, " but the arguments are on ", ours));
      }
      manual_[id] = has_trait(n.op, kBlockResult);
      if (find_sharding_rule(n.op) == nullptr) {
        return absl::InternalError(absl::StrCat("jit: %", id, " = ", op_name(n.op), " has no sharding rule"));
      }
      for (int o : n.operands) {
        if (body_axes[id].empty()) body_axes[id] = body_axes[o];
        if (!manual_[o] || has_trait(n.op, kLeavesBody)) continue;
        manual_[id] = true;
        if (automatic_[id].empty()) automatic_[id] = automatic_[o];
      }
      // A block made from no body value (axis_index, a collective of a constant) is in the
      // body being traced when it was recorded.
      if (has_trait(n.op, kBlockResult) && body_axes[id].empty()) body_axes[id] = latest;
      if (n.op == Op::kShardMapIn || n.op == Op::kShardMapOut) {
        const std::vector<std::string> own = boundary_axes(n.attrs<ShardingAttrs>());
        std::vector<std::string> body;
        for (const std::string& axis : mesh_.axis_names()) {
          const bool in_operand = absl::c_linear_search(body_axes[n.operands[0]], axis);
          const bool in_own = absl::c_linear_search(own, axis);
          if (n.op == Op::kShardMapIn ? in_operand || in_own : in_operand && !in_own) body.push_back(axis);
        }
        body_axes[id] = latest = body;
        manual_[id] = !body.empty();
        automatic_[id].clear();
        if (body.size() < mesh_.axis_names().size()) {
          for (const std::string& axis : mesh_.axis_names()) {
            if (manual_[id] && !absl::c_linear_search(body, axis)) automatic_[id].push_back(axis);
          }
        }
      }
      TESSERA_RETURN_IF_ERROR(check_body_constraint(id));
    }
    typed_unreduced_.assign(g_.size(), false);
    for (int id = 0; id < g_.size(); ++id) {
      TESSERA_RETURN_IF_ERROR(forward(id));  // a parameter's rule keeps its input layout
      infer_typed_unreduced(id);
    }
    // Values no operand determined (constants, iota) start replicated; the backward pass
    // gives them what their users want.
    for (int id = 0; id < g_.size(); ++id) {
      if (!assigned_[id]) set(id, Dims(g_.node(id).shape.size()));
    }
    backward(outputs);
    return std::move(out_);
  }

 private:
  // ShardingContext.
  const Graph& graph() const override { return g_; }
  const Mesh& mesh() const override { return mesh_; }
  std::optional<ValueSharding> of(int id) const override {
    return assigned_[id] ? std::optional<ValueSharding>(out_.result[id]) : std::nullopt;
  }
  void set(int id, Dims dims, std::vector<std::string> partial = {}, ReduceOp op = ReduceOp::kSum) override {
    out_.result[id] = ValueSharding{std::move(dims), std::move(partial), op};
    assigned_[id] = true;
  }
  std::vector<ValueSharding>& needs(int id) override { return out_.operands[id]; }
  double move_cost(int id, const ValueSharding& from, const ValueSharding& to) const override {
    return reshard_cost(from, to, g_.node(id));
  }
  double reduce_cost(int id, const ValueSharding& v) const override {
    if (!v.is_partial()) return 0;
    const double n = static_cast<double>(mesh_.axes_size(v.partial));
    return (n - 1) / n * local_bytes(v, g_.node(id)) + kLatencyBytes;
  }

  const std::vector<std::string>& automatic_axes(int id) const override { return automatic_[id]; }
  bool typed_unreduced(int id) const override { return typed_unreduced_[id]; }
  void mark_typed_unreduced(int id) override {
    if (assigned_[id] && out_.result[id].is_partial()) typed_unreduced_[id] = true;
  }

  // A pending sum is typed unreduced where a constraint or an input names it (their rules make
  // exactly the spec's unreduced axes pending), after an op that kept an operand's such sum,
  // and where a rule marked it (above).
  void infer_typed_unreduced(int id) {
    const Node& n = g_.node(id);
    const ValueSharding& r = out_.result[id];
    if (!assigned_[id] || !r.is_partial() || r.partial_op != ReduceOp::kSum) return;
    if (n.op == Op::kShardingConstraint || n.op == Op::kParameter) {
      typed_unreduced_[id] = true;
      return;
    }
    for (int o : n.operands) {
      if (typed_unreduced_[o] && same_axes(out_.result[o].partial, r.partial)) typed_unreduced_[id] = true;
    }
  }

  // The op's rule (rules_*.cc); inside a shard_map body, the body's, except where the body is
  // automatic: there the ops' own (collectives' and axis_index's included: see
  // rules_placement.cc).
  absl::Status forward(int id) {
    const ShardingRule& rule = *find_sharding_rule(g_.node(id).op);
    if (manual_[id] && !rule.in_body && automatic_[id].empty()) return internal::body_value(*this, id);
    return rule.forward(*this, id);
  }

  // The mesh axes a shard_map boundary makes manual (all of them when it records none).
  std::vector<std::string> boundary_axes(const ShardingAttrs& a) const {
    return a.manual_axes.empty() ? mesh_.axis_names() : a.manual_axes;
  }

  // A constraint in a body automatic over some axes may name only those: the others are the
  // body's manual axes, along which each device holds its own block.
  absl::Status check_body_constraint(int id) const {
    const Node& n = g_.node(id);
    if (n.op != Op::kShardingConstraint || automatic_[id].empty()) return absl::OkStatus();
    for (const std::string& axis : n.attrs<ShardingAttrs>().sharding.spec().used_axes()) {
      if (!absl::c_linear_search(automatic_[id], axis)) {
        return absl::InvalidArgumentError(
            absl::StrCat("jit: %", id, " = sharding_constraint ", n.attrs<ShardingAttrs>().sharding.spec().to_string(),
                         " inside a shard_map body names '", axis,
                         "', a manual axis of the body (its automatic axes are ", axes_to_string(automatic_[id]), ")"));
      }
    }
    return absl::OkStatus();
  }

  // ---- Backward pass -------------------------------------------------------------------
  //
  // The forward pass decides every value from its operands alone. The backward pass visits
  // the nodes from the last to the first and lets each one that the user did not pin
  // (parameters, with_sharding_constraint) move to a layout its users want, when that makes
  // the program move fewer bytes: a reshard wanted after an op is pulled in front of it when
  // it is cheaper there (a local slice of a replicated operand instead of a gather of the
  // result, a gather of a small operand instead of a large result) — GSPMD's backward
  // propagation, with conflicts settled by an estimate of the bytes each choice moves.

  DimMap dim_map(const Node& n) const { return find_sharding_rule(n.op)->backward(g_, n); }

  struct Choice {
    ValueSharding result;
    std::vector<ValueSharding> operands;
  };

  // Whether `s` is a layout of `shape`: each axis of the mesh used once (dimensions and
  // pending reduction together) and every split dividing its dimension.
  bool fits(const ValueSharding& s, const Shape& shape) const {
    std::set<std::string> used(s.partial.begin(), s.partial.end());
    if (used.size() != s.partial.size()) return false;
    for (size_t d = 0; d < s.dims.size(); ++d) {
      for (const std::string& a : s.dims[d]) {
        if (!used.insert(a).second) return false;
      }
      if (shape[d] % mesh_.axes_size(s.dims[d]) != 0) return false;
    }
    return true;
  }

  // Node `id` with result dimensions `dims` (on its free dimensions; the others stay): what it
  // then needs of its operands, or nullopt when that is no layout. Dimensions that do not
  // follow the result (contracted, reduced) keep what the forward pass asked: a contraction
  // over a split dimension stays a partial sum, as in GSPMD.
  std::optional<Choice> choice(int id, const DimMap& m, const Dims& dims) const {
    const Node& n = g_.node(id);
    Choice c{out_.result[id], out_.operands[id]};
    for (size_t d = 0; d < dims.size(); ++d) {
      if (m.free[d]) c.result.dims[d] = dims[d];
    }
    if (!fits(c.result, n.shape)) return std::nullopt;
    for (size_t k = 0; k < n.operands.size(); ++k) {
      ValueSharding& q = c.operands[k];
      for (size_t d = 0; d < q.dims.size(); ++d) {
        if (m.follow[k][d] >= 0) q.dims[d] = c.result.dims[m.follow[k][d]];
      }
      if (!fits(q, g_.node(n.operands[k]).shape)) return std::nullopt;
    }
    return c;
  }

  // Each collective's fixed latency, counted as bytes.
  static constexpr double kLatencyBytes = 64 * 1024;

  // The bytes of one device's block of `value` laid out as `s`.
  double local_bytes(const ValueSharding& s, const Node& value) const {
    return static_cast<double>(num_elements(NamedSharding(mesh_, s.spec()).shard_shape(value.shape))) *
           dtype_size(value.dtype);
  }

  // Estimated bytes one device moves to take a value from `from` to `to`; each collective also
  // costs kLatencyBytes.
  double reshard_cost(const ValueSharding& from, const ValueSharding& to, const Node& value) const {
    if (from == to) return 0;
    absl::StatusOr<std::vector<ReshardStep>> steps = plan_reshard(from, to, value.shape, mesh_);
    if (!steps.ok()) return std::numeric_limits<double>::infinity();
    double cost = 0;
    ValueSharding before = from;
    for (const ReshardStep& step : *steps) {
      const double n = static_cast<double>(mesh_.axes_size(step.axes));
      const double share = (n - 1) / n;
      switch (step.kind) {
        case ReshardStep::Kind::kAllReduce:
          cost += 2 * share * local_bytes(before, value) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kReduceScatter:
        case ReshardStep::Kind::kAllToAll:
          cost += share * local_bytes(before, value) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kAllGather:
          cost += share * local_bytes(step.after, value) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kCollectivePermute:
          cost += local_bytes(before, value) + kLatencyBytes;
          break;
        case ReshardStep::Kind::kLocalSlice:
        case ReshardStep::Kind::kUnreduce:
          break;
      }
      before = step.after;
    }
    return cost;
  }

  // Values whose layout the user fixed: parameters, constraints, shard_map boundaries and
  // bodies.
  bool pinned(int id) const { return has_trait(g_.node(id).op, kPinned) || manual_[id]; }

  // What it costs to have value `id` in layout `want`: resharding it as it is, or — when this
  // is its only use and the user did not pin it — computing it in that layout, looking up to
  // `depth` producers further back. This lets a reshard travel past several ops whose own
  // input and output are equally large (exp after a broadcast) to where it is cheapest.
  double supply_cost(int id, const ValueSharding& want, const std::vector<std::vector<std::pair<int, int>>>& uses,
                     int depth) const {
    const Node& n = g_.node(id);
    const double direct = reshard_cost(out_.result[id], want, n);
    if (direct == 0 || depth == 0 || pinned(id) || uses[id].size() != 1 || is_output_[id] ||
        !same_axes(want.partial, out_.result[id].partial)) {
      return direct;
    }
    std::optional<Choice> c = choice(id, dim_map(n), want.dims);
    if (!c || c->result != want) return direct;
    double cost = 0;
    for (size_t k = 0; k < n.operands.size() && cost < direct; ++k) {
      cost += supply_cost(n.operands[k], c->operands[k], uses, depth - 1);
    }
    return std::min(direct, cost);
  }

  void backward(const std::vector<std::optional<PartitionSpec>>& outputs) {
    is_output_.assign(g_.size(), false);
    for (int o : g_.outputs()) is_output_[o] = true;
    // What each value's consumers need of it: (user node, operand index), and output specs.
    std::vector<std::vector<std::pair<int, int>>> uses(g_.size());
    for (int id = 0; id < g_.size(); ++id) {
      const Node& n = g_.node(id);
      for (size_t k = 0; k < n.operands.size(); ++k) uses[n.operands[k]].emplace_back(id, static_cast<int>(k));
    }
    std::vector<std::vector<ValueSharding>> wanted_out(g_.size());
    for (size_t i = 0; i < outputs.size(); ++i) {
      const int o = g_.outputs()[i];
      if (outputs[i].has_value()) {
        wanted_out[o].push_back(
            ValueSharding{padded(*outputs[i], g_.node(o).shape.size()), outputs[i]->unreduced(), ReduceOp::kSum});
      } else {
        // No spec: whatever layout it has, made whole (dims left empty to say so; for a
        // scalar the two are the same).
        wanted_out[o].push_back(ValueSharding{});
      }
    }
    for (int id = g_.size() - 1; id >= 0; --id) {
      const Node& n = g_.node(id);
      if (pinned(id)) continue;
      std::vector<ValueSharding> wants;
      for (const auto& [user, k] : uses[id]) wants.push_back(out_.operands[user][k]);
      for (const ValueSharding& w : wanted_out[id]) wants.push_back(w);
      if (wants.empty()) continue;
      const DimMap m = dim_map(n);
      // Candidate result layouts: as it is; each consumer's wish, taken whole or only on
      // dimensions the value does not split yet; each operand's layout carried through. Each
      // once: a repeat would cost the same and lose the tie to its first occurrence.
      std::vector<Dims> candidates = {out_.result[id].dims};
      auto candidate = [&candidates](Dims dims) {
        if (!absl::c_linear_search(candidates, dims)) candidates.push_back(std::move(dims));
      };
      for (const ValueSharding& w : wants) {
        if (w.dims.empty()) continue;
        candidate(w.dims);
        Dims refined = out_.result[id].dims;
        for (size_t d = 0; d < refined.size(); ++d) {
          if (refined[d].empty()) refined[d] = w.dims[d];
        }
        candidate(std::move(refined));
      }
      for (size_t k = 0; k < n.operands.size(); ++k) {
        Dims carried = out_.result[id].dims;
        const ValueSharding& have = out_.result[n.operands[k]];
        for (size_t d = 0; d < have.dims.size(); ++d) {
          if (m.follow[k][d] >= 0) carried[m.follow[k][d]] = have.dims[d];
        }
        candidate(std::move(carried));
      }
      // The cheapest; among equals the one holding the fewest elements per device, then the
      // earliest (the forward pass's layout first).
      std::optional<Choice> best;
      double best_cost = 0;
      int64_t best_local = 0;
      for (const Dims& dims : candidates) {
        std::optional<Choice> c = choice(id, m, dims);
        if (!c) continue;
        double cost = 0;
        for (size_t k = 0; k < n.operands.size(); ++k) cost += supply_cost(n.operands[k], c->operands[k], uses, 4);
        for (const ValueSharding& w : wants) {
          ValueSharding target = w;
          if (target.dims.empty()) {  // an output with no spec: its layout, made whole
            target = c->result;
            target.partial.clear();
          }
          cost += reshard_cost(c->result, target, n);
        }
        const int64_t local = num_elements(NamedSharding(mesh_, c->result.spec()).shard_shape(n.shape));
        if (!best || cost < best_cost || (cost == best_cost && local < best_local)) {
          best = std::move(c);
          best_cost = cost;
          best_local = local;
        }
      }
      if (best) {
        out_.result[id] = std::move(best->result);
        out_.operands[id] = std::move(best->operands);
      }
    }
  }

  const Graph& g_;
  const Mesh& mesh_;
  std::vector<bool> assigned_;
  std::vector<bool> is_output_;
  std::vector<bool> manual_;  // in a shard_map body
  // In a body manual over some axes only: the others, over which its values are laid out.
  std::vector<std::vector<std::string>> automatic_;
  std::vector<bool> typed_unreduced_;  // typed_unreduced(id)
  Propagation out_;
};

}  // namespace

namespace internal {

ValueSharding ShardingContext::of_or_replicated(int id) const {
  return of(id).value_or(ValueSharding::replicated(graph().node(id).shape.size()));
}

Dims ShardingContext::padded(const PartitionSpec& spec, size_t rank) const {
  Dims d(rank);
  for (int i = 0; i < spec.size() && i < static_cast<int>(rank); ++i) d[i] = spec.axes(i);
  return d;
}

Axes ShardingContext::usable(const Axes& axes, int64_t size, std::set<std::string>* taken) const {
  Axes out;
  int64_t n = 1;
  for (const std::string& a : axes) {
    if (taken->count(a) > 0 || size % (n * mesh().axis_size(a)) != 0) break;
    n *= mesh().axis_size(a);
    out.push_back(a);
  }
  taken->insert(out.begin(), out.end());
  return out;
}

DimMap identity_map(const Graph&, const Node& n) {
  const size_t rank = n.shape.size();
  DimMap m{std::vector<std::vector<int>>(n.operands.size()), std::vector<bool>(rank, true)};
  for (std::vector<int>& f : m.follow) {
    for (size_t d = 0; d < rank; ++d) f.push_back(static_cast<int>(d));
  }
  return m;
}

}  // namespace internal

const internal::ShardingRule* find_sharding_rule(Op op) {
  struct Registry {
    const internal::ShardingRule* rules[kNumOps] = {};
    Registry() {
      for (absl::Span<const internal::ShardingRuleEntry> family :
           {internal::elementwise_rules(), internal::layout_rules(), internal::reduction_rules(), internal::dot_rules(),
            internal::placement_rules(), internal::indexing_rules(), internal::control_rules()}) {
        for (const internal::ShardingRuleEntry& e : family) rules[static_cast<int>(e.op)] = &e.rule;
      }
    }
  };
  static const Registry* const kRegistry = new Registry();
  return is_op(op) ? kRegistry->rules[static_cast<int>(op)] : nullptr;
}

std::string ValueSharding::to_string() const {
  std::string s = spec().to_string();
  if (is_partial()) {
    absl::StrAppend(
        &s, " partial(", reduce_op_name(partial_op), " over ",
        absl::StrJoin(partial, ", ", [](std::string* o, const std::string& a) { absl::StrAppend(o, "'", a, "'"); }),
        ")");
  }
  return s;
}

absl::StatusOr<Propagation> propagate(const Graph& graph, const Mesh& mesh, const std::vector<PartitionSpec>& inputs,
                                      const std::vector<std::optional<PartitionSpec>>& outputs) {
  if (outputs.size() != graph.outputs().size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("jit: ", graph.outputs().size(), " outputs but ", outputs.size(), " output shardings"));
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outputs[i].has_value()) continue;
    const Node& o = graph.node(graph.outputs()[i]);
    absl::Status fits = NamedSharding(mesh, *outputs[i]).validate(o.shape);
    if (!fits.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: output ", i, " ", type_to_string(o.dtype, o.shape), ": ", fits.message()));
    }
  }
  return Propagator(graph, mesh).run(inputs, outputs);
}

}  // namespace tessera

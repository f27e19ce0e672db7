#include "coordinator/compiler/partition.h"

#include <map>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/compiler/reshard.h"
#include "coordinator/compiler/rules.h"
#include "core/status.h"

namespace tessera {
namespace {

Shape local_shape(const Shape& shape, const ValueSharding& s, const Mesh& mesh) {
  return NamedSharding(mesh, s.spec()).shard_shape(shape);
}

std::string slot(int s) { return absl::StrCat("s", s); }

// Builds one device's plan. Every device runs the same emission, so slot numbers and the
// instruction sequence agree across devices; only local slices and permutes differ in data.
class DevicePartitioner : public internal::PartitionContext {
 public:
  DevicePartitioner(const Graph& g, const Mesh& mesh, const Propagation& p, int64_t position, Executable* exe)
      : g_(g), mesh_(mesh), p_(p), position_(position), exe_(exe) {}

  absl::StatusOr<DevicePlan> run(const std::vector<std::optional<PartitionSpec>>& outputs,
                                 const std::vector<int>& donated) {
    plan_.device = mesh_.device_ids()[position_];
    plan_.donated_inputs = donated;
    slot_of_.assign(g_.size(), -1);
    for (int id = 0; id < g_.size(); ++id) TESSERA_RETURN_IF_ERROR(find_sharding_rule(g_.node(id).op)->partition(*this, id));
    for (size_t i = 0; i < g_.outputs().size(); ++i) {
      const int o = g_.outputs()[i];
      const Node& n = g_.node(o);
      ValueSharding want = p_.result[o];
      want.partial.clear();
      if (outputs[i].has_value()) {
        want = ValueSharding::replicated(n.shape.size());
        for (int d = 0; d < outputs[i]->size() && d < static_cast<int>(n.shape.size()); ++d) {
          want.dims[d] = outputs[i]->axes(d);
        }
      }
      if (position_ == 0) exe_->output_specs.push_back(want.spec());
      TESSERA_ASSIGN_OR_RETURN(int s, reshard(o, p_.result[o], want, absl::StrCat("output ", i)));
      plan_.output_slots.push_back(s);
    }
    add_frees();
    plan_.num_slots = next_slot_;
    return std::move(plan_);
  }

 private:
  int new_slot() { return next_slot_++; }

  // PartitionContext.
  const Graph& graph() const override { return g_; }
  const Mesh& mesh() const override { return mesh_; }
  const Propagation& propagation() const override { return p_; }
  int device() const override { return plan_.device; }
  std::string cause(int id) const override { return absl::StrCat("%", id, " = ", op_name(g_.node(id).op)); }
  int slot_of(int id) const override { return slot_of_[id]; }
  void bind(int id, int slot) override { slot_of_[id] = slot; }
  int add_input(int id) override {
    slot_of_[id] = new_slot();
    plan_.input_slots.push_back(slot_of_[id]);
    if (position_ == 0) exe_->input_specs.push_back(p_.result[id].spec());
    return slot_of_[id];
  }
  int emit(Instruction inst) override {
    inst.out = new_slot();
    plan_.code.push_back(std::move(inst));
    return plan_.code.back().out;
  }
  absl::StatusOr<int> reshard(int id, const ValueSharding& from, const ValueSharding& to,
                              const std::string& cause) override {
    return reshard(slot_of_[id], from, to, g_.node(id), cause);
  }

  // Emits the steps taking the value in `from_slot` from `from` to `to`; returns its slot.
  absl::StatusOr<int> reshard(int from_slot, const ValueSharding& from, const ValueSharding& to, const Node& value,
                              const std::string& cause) {
    if (from == to) return from_slot;
    TESSERA_ASSIGN_OR_RETURN(std::vector<ReshardStep> steps, plan_reshard(from, to, value.shape, mesh_));
    int cur = from_slot;
    ValueSharding before = from;
    std::map<std::string, bool> gathered;
    for (const ReshardStep& step : steps) {
      Instruction inst;
      inst.in = {cur};
      inst.cause = absl::StrCat("for ", cause);
      inst.node.dtype = value.dtype;
      inst.node.shape = local_shape(value.shape, step.after, mesh_);
      if (step.kind == ReshardStep::Kind::kLocalSlice) {
        inst.kind = Instruction::Kind::kLocalSlice;
        TESSERA_ASSIGN_OR_RETURN(inst.slice, local_block(value.shape, before, step.after));
        if (gathered[step.axes[0]] && position_ == 0) {
          exe_->log.push_back(absl::StrCat("involuntary full rematerialization: ", cause, " gathers then re-slices ",
                                           "mesh axis '", step.axes[0], "' of a ",
                                           type_to_string(value.dtype, value.shape), " value (", before.to_string(),
                                           " -> ", to.to_string(), ")"));
        }
      } else {
        inst.kind = Instruction::Kind::kCollective;
        TESSERA_ASSIGN_OR_RETURN(inst.collective, collective_for(step, value.shape, before));
        if (step.kind == ReshardStep::Kind::kAllGather) gathered[step.axes[0]] = true;
      }
      inst.out = new_slot();
      cur = inst.out;
      plan_.code.push_back(std::move(inst));
      before = step.after;
    }
    return cur;
  }

  absl::StatusOr<CollectiveSpec> collective_for(const ReshardStep& step, const Shape& shape,
                                                const ValueSharding& before) {
    CollectiveSpec spec;
    spec.reduce_op = step.reduce_op;
    if (step.kind == ReshardStep::Kind::kCollectivePermute) {
      spec.kind = CollectiveKind::kCollectivePermute;
      spec.groups = {mesh_.device_ids()};
      const std::vector<DeviceShard> have = NamedSharding(mesh_, before.spec()).device_shards(shape);
      const std::vector<DeviceShard> want = NamedSharding(mesh_, step.after.spec()).device_shards(shape);
      for (const DeviceShard& t : want) {
        for (const DeviceShard& s : have) {
          if (s.index == t.index && s.replica_id == t.replica_id) spec.pairs.emplace_back(s.device_id, t.device_id);
        }
      }
      return spec;
    }
    TESSERA_ASSIGN_OR_RETURN(spec.groups, replica_groups(mesh_, step.axes));
    switch (step.kind) {
      case ReshardStep::Kind::kAllReduce:
        spec.kind = CollectiveKind::kAllReduce;
        break;
      case ReshardStep::Kind::kReduceScatter:
        spec.kind = CollectiveKind::kReduceScatter;
        spec.dimension = step.dim;
        break;
      case ReshardStep::Kind::kAllGather:
        spec.kind = CollectiveKind::kAllGather;
        spec.dimension = step.dim;
        break;
      case ReshardStep::Kind::kAllToAll:
        spec.kind = CollectiveKind::kAllToAll;
        spec.split_dimension = step.split_dim;
        spec.concat_dimension = step.concat_dim;
        break;
      default:
        break;
    }
    return spec;
  }

  // This device's block under `after`, relative to the block it holds under `before`.
  absl::StatusOr<Index> local_block(const Shape& shape, const ValueSharding& before, const ValueSharding& after) {
    const DeviceShard held = NamedSharding(mesh_, before.spec()).device_shards(shape)[position_];
    const DeviceShard kept = NamedSharding(mesh_, after.spec()).device_shards(shape)[position_];
    Index out;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (kept.index[d].start < held.index[d].start || kept.index[d].stop > held.index[d].stop) {
        return absl::InternalError(absl::StrCat("partition: local slice ", index_to_string(kept.index),
                                                " is not inside the held block ", index_to_string(held.index)));
      }
      out.push_back({kept.index[d].start - held.index[d].start, kept.index[d].stop - held.index[d].start});
    }
    return out;
  }

  // Frees every slot after its last use, except outputs and the inputs not donated (the
  // caller's).
  void add_frees() {
    std::vector<int> last_use(next_slot_, -1);
    for (size_t i = 0; i < plan_.code.size(); ++i) {
      last_use[plan_.code[i].out] = std::max<int>(last_use[plan_.code[i].out], static_cast<int>(i));
      for (int s : plan_.code[i].in) last_use[s] = static_cast<int>(i);
    }
    std::vector<bool> keep(next_slot_, false);
    for (int s : plan_.input_slots) keep[s] = true;
    for (int d : plan_.donated_inputs) keep[plan_.input_slots[d]] = false;
    for (int s : plan_.output_slots) keep[s] = true;
    std::vector<Instruction> code;
    for (size_t i = 0; i < plan_.code.size(); ++i) {
      code.push_back(plan_.code[i]);
      std::vector<int> slots = plan_.code[i].in;
      slots.push_back(plan_.code[i].out);
      for (int s : slots) {
        if (!keep[s] && last_use[s] == static_cast<int>(i)) {
          Instruction free;
          free.kind = Instruction::Kind::kFree;
          free.in = {s};
          code.push_back(free);
          keep[s] = true;  // freed once
        }
      }
    }
    plan_.code = std::move(code);
  }

  const Graph& g_;
  const Mesh& mesh_;
  const Propagation& p_;
  const int64_t position_;
  Executable* exe_;
  DevicePlan plan_;
  std::vector<int> slot_of_;
  int next_slot_ = 0;
};

std::string groups_to_string(const std::vector<std::vector<int>>& groups) {
  return absl::StrCat("{",
                      absl::StrJoin(groups, ",",
                                    [](std::string* o, const std::vector<int>& g) {
                                      absl::StrAppend(o, "{", absl::StrJoin(g, ","), "}");
                                    }),
                      "}");
}

}  // namespace

namespace internal {

absl::StatusOr<std::vector<int>> PartitionContext::operands_as_needed(int id) {
  const Node& n = graph().node(id);
  std::vector<int> in;
  for (size_t k = 0; k < n.operands.size(); ++k) {
    const int o = n.operands[k];
    TESSERA_ASSIGN_OR_RETURN(int s, reshard(o, propagation().result[o], propagation().operands[id][k], cause(id)));
    in.push_back(s);
  }
  return in;
}

Instruction PartitionContext::local_kernel(int id, const std::vector<int>& in) const {
  const Node& n = graph().node(id);
  Instruction inst;
  inst.kind = Instruction::Kind::kKernel;
  inst.in = in;
  inst.cause = cause(id);
  inst.node = n;
  inst.node.operands = in;  // the kernel's operands, by slot
  inst.node.shape = local_shape(n.shape, propagation().result[id], mesh());
  return inst;
}

absl::Status partition_kernel(PartitionContext& c, int id) {
  TESSERA_ASSIGN_OR_RETURN(std::vector<int> in, c.operands_as_needed(id));
  c.bind(id, c.emit(c.local_kernel(id, in)));
  return absl::OkStatus();
}

}  // namespace internal

std::string Executable::as_text() const {
  std::string out;
  for (const std::string& line : log) absl::StrAppend(&out, "# ", line, "\n");
  for (const DevicePlan& plan : plans) {
    std::vector<std::string> inputs;
    for (size_t i = 0; i < plan.input_slots.size(); ++i) {
      inputs.push_back(slot(plan.input_slots[i]));
      if (absl::c_linear_search(plan.donated_inputs, static_cast<int>(i))) inputs.back() += " (donated)";
    }
    absl::StrAppend(&out, "device ", plan.device, ":\n  inputs: ", absl::StrJoin(inputs, ", "), "\n");
    for (const Instruction& i : plan.code) {
      std::vector<std::string> in;
      for (int s : i.in) in.push_back(slot(s));
      const std::string type = type_to_string(i.node.dtype, i.node.shape);
      switch (i.kind) {
        case Instruction::Kind::kKernel:
          absl::StrAppend(&out, "  ", slot(i.out), " = ", op_name(i.node.op), "(", absl::StrJoin(in, ", "), ") ", type,
                          "  ; ", i.cause, "\n");
          break;
        case Instruction::Kind::kCollective: {
          const CollectiveSpec& c = i.collective;
          std::string attrs = c.kind == CollectiveKind::kAllReduce || c.kind == CollectiveKind::kReduceScatter
                                  ? absl::StrCat(reduce_op_name(c.reduce_op), ", ")
                                  : "";
          if (c.kind == CollectiveKind::kAllGather || c.kind == CollectiveKind::kReduceScatter) {
            absl::StrAppend(&attrs, "dim=", c.dimension, ", ");
          }
          if (c.kind == CollectiveKind::kAllToAll) {
            absl::StrAppend(&attrs, "split=", c.split_dimension, ", concat=", c.concat_dimension, ", ");
          }
          absl::StrAppend(&out, "  ", slot(i.out), " = ", collective_name(c.kind), "(", attrs,
                          "groups=", groups_to_string(c.groups), ") ", in[0], " ", type, "  ; ", i.cause, "\n");
          break;
        }
        case Instruction::Kind::kLocalSlice:
          absl::StrAppend(&out, "  ", slot(i.out), " = local_slice", index_to_string(i.slice), " ", in[0], " ", type,
                          "  ; ", i.cause, "\n");
          break;
        case Instruction::Kind::kFree:
          absl::StrAppend(&out, "  free ", in[0], "\n");
          break;
      }
    }
    absl::StrAppend(&out, "  outputs: ",
                    absl::StrJoin(plan.output_slots, ", ", [](std::string* o, int s) { o->append(slot(s)); }), "\n");
  }
  return out;
}

absl::StatusOr<Executable> partition(const Graph& graph, const Mesh& mesh, const Propagation& propagation,
                                     const std::vector<std::optional<PartitionSpec>>& outputs,
                                     const std::vector<int>& donated) {
  Executable exe{mesh, {}, {}, {}, {}};
  for (int64_t pos = 0; pos < mesh.size(); ++pos) {
    TESSERA_ASSIGN_OR_RETURN(DevicePlan plan,
                             DevicePartitioner(graph, mesh, propagation, pos, &exe).run(outputs, donated));
    exe.plans.push_back(std::move(plan));
  }
  return exe;
}

}  // namespace tessera

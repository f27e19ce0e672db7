#include "coordinator/compiler/partition.h"

#include <algorithm>
#include <map>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "coordinator/compiler/passes/passes.h"
#include "coordinator/compiler/reshard.h"
#include "coordinator/compiler/rules.h"
#include "core/status.h"

namespace tessera {
namespace {

Shape local_shape(const Shape& shape, const ValueSharding& s, const Mesh& mesh) {
  return NamedSharding(mesh, s.spec()).shard_shape(shape);
}

// Builds the program every device runs (SPMD form, core/plan.h): nothing here depends on a
// device's position, so the emission happens once whatever the mesh's size.
class ProgramPartitioner : public internal::PartitionContext {
 public:
  ProgramPartitioner(const Graph& g, const Mesh& mesh, const Propagation& p, Executable* exe)
      : g_(g), mesh_(mesh), p_(p), exe_(exe) {}

  absl::StatusOr<DevicePlan> run(const std::vector<std::optional<PartitionSpec>>& outputs,
                                 const std::vector<int>& donated) {
    plan_.donated_inputs = donated;
    slot_of_.assign(g_.size(), -1);
    for (int id = 0; id < g_.size(); ++id) {
      TESSERA_RETURN_IF_ERROR(find_sharding_rule(g_.node(id).op)->partition(*this, id));
    }
    for (size_t i = 0; i < g_.outputs().size(); ++i) {
      const int o = g_.outputs()[i];
      const Node& n = g_.node(o);
      ValueSharding want = p_.result[o];
      // An output is whole unless its spec, or the constraint it is (explicit mode pins each
      // result to its type), says unreduced: then it keeps that pending sum (an unreduced array).
      // Its reduced axes (laid out as replicated over them) only type it.
      want.partial.clear();
      std::vector<std::string> reduced;
      if (n.op == Op::kShardingConstraint) {
        want.partial = n.attrs<ShardingAttrs>().sharding.spec().unreduced();
        reduced = n.attrs<ShardingAttrs>().sharding.spec().reduced();
      }
      if (outputs[i].has_value()) {
        want = ValueSharding::replicated(n.shape.size());
        for (int d = 0; d < outputs[i]->size() && d < static_cast<int>(n.shape.size()); ++d) {
          want.dims[d] = outputs[i]->axes(d);
        }
        want.partial = outputs[i]->unreduced();
        reduced = outputs[i]->reduced();
      }
      exe_->output_specs.push_back(want.spec().with_unreduced(want.partial).with_reduced(reduced));
      TESSERA_ASSIGN_OR_RETURN(int s, reshard(slot_of_[o], p_.result[o], want, o, absl::StrCat("output ", i)));
      plan_.output_slots.push_back(s);
    }
    plan_.num_slots = next_slot_;
    run_passes(&plan_, mesh_, input_types_);
    return std::move(plan_);
  }

 private:
  int new_slot() { return next_slot_++; }

  // PartitionContext.
  const Graph& graph() const override { return g_; }
  const Mesh& mesh() const override { return mesh_; }
  const Propagation& propagation() const override { return p_; }
  std::string cause(int id) const override { return absl::StrCat("%", id, " = ", op_name(g_.node(id).op)); }
  int slot_of(int id) const override { return slot_of_[id]; }
  void bind(int id, int slot) override { slot_of_[id] = slot; }
  int add_input(int id) override {
    slot_of_[id] = new_slot();
    plan_.input_slots.push_back(slot_of_[id]);
    input_types_.push_back({g_.node(id).dtype, local_shape(g_.node(id).shape, p_.result[id], mesh_)});
    exe_->input_specs.push_back(p_.result[id].spec().with_unreduced(p_.result[id].partial));
    return slot_of_[id];
  }
  int fresh_slot() override { return new_slot(); }
  int emit(Instruction inst) override {
    inst.out = new_slot();
    plan_.code.push_back(std::move(inst));
    return plan_.code.back().out;
  }
  absl::StatusOr<int> reshard(int id, const ValueSharding& from, const ValueSharding& to,
                              const std::string& cause) override {
    return reshard(slot_of_[id], from, to, id, cause);
  }

  // Emits the steps taking graph value `value_id`, in `from_slot`, from `from` to `to`;
  // returns its slot.
  absl::StatusOr<int> reshard(int from_slot, const ValueSharding& from, const ValueSharding& to, int value_id,
                              const std::string& cause) {
    if (from == to) return from_slot;
    const Node& value = g_.node(value_id);
    TESSERA_ASSIGN_OR_RETURN(std::vector<ReshardStep> steps, plan_reshard(from, to, value.shape, mesh_));
    int cur = from_slot;
    ValueSharding before = from;
    std::map<std::string, bool> gathered;
    for (const ReshardStep& step : steps) {
      if (step.kind == ReshardStep::Kind::kUnreduce) {
        cur = unreduce(cur, before, step, value_id);
        before = step.after;
        continue;
      }
      Instruction inst;
      inst.in = {cur};
      inst.value = value_id;
      inst.cause = absl::StrCat("for ", cause);
      inst.node.dtype = value.dtype;
      inst.node.shape = local_shape(value.shape, step.after, mesh_);
      if (step.kind == ReshardStep::Kind::kLocalSlice) {
        inst.kind = Instruction::Kind::kLocalSlice;
        inst.relayout = Instruction::Relayout{value.shape, before.spec(), step.after.spec()};
        const auto regathered =
            std::find_if(step.axes.begin(), step.axes.end(), [&](const std::string& a) { return gathered[a]; });
        if (regathered != step.axes.end()) {
          exe_->log.push_back(absl::StrCat("involuntary full rematerialization: ", cause, " gathers then re-slices ",
                                           "mesh axis '", *regathered, "' of a ",
                                           type_to_string(value.dtype, value.shape), " value (", before.to_string(),
                                           " -> ", to.to_string(), ")"));
        }
      } else {
        inst.kind = Instruction::Kind::kCollective;
        inst.collective = collective_for(step);
        if (step.kind == ReshardStep::Kind::kCollectivePermute) {
          inst.relayout = Instruction::Relayout{value.shape, before.spec(), step.after.spec()};
        } else {
          inst.axes = step.axes;
        }
        if (step.kind == ReshardStep::Kind::kAllGather) {
          for (const std::string& a : step.axes) gathered[a] = true;
        }
      }
      inst.out = new_slot();
      cur = inst.out;
      plan_.code.push_back(std::move(inst));
      before = step.after;
    }
    return cur;
  }

  // A whole value, in `slot` laid out as `before`, made the sum pending over `step.axes` that
  // step.after says: along the pending axes `before` still splits a dimension over (after
  // step.after's own), each device's block is zero-padded in place to step.after's block; along
  // the others the value is counted once, on the first device (its term there, zeros elsewhere).
  int unreduce(int slot, const ValueSharding& before, const ReshardStep& step, int value_id) {
    const Node& value = g_.node(value_id);
    const Shape in = local_shape(value.shape, before, mesh_), out = local_shape(value.shape, step.after, mesh_);
    std::vector<std::string> once = step.axes;
    bool padded = false;
    std::vector<int> starts;
    // plan_reshard planned without axes of size 1 (its last step's `after` and the `before` of
    // a first step still name them), so they are left out here too.
    const ValueSharding have_all = without_unit_axes(before, mesh_), want_all = without_unit_axes(step.after, mesh_);
    for (size_t d = 0; d < value.shape.size(); ++d) {
      const Axes &have = have_all.dims[d], &want = want_all.dims[d];
      const Axes suffix(have.begin() + std::min(have.size(), want.size()), have.end());
      for (const std::string& a : suffix) {
        const auto it = std::find(once.begin(), once.end(), a);
        if (it != once.end()) once.erase(it);
      }
      padded = padded || !suffix.empty();
      const int start = suffix.empty() ? internal::emit_kernel(*this, value_id, Op::kConstant, DType::kI32, {}, {},
                                                               ConstantAttrs{Scalar(0)})
                                       : internal::emit_block_start(*this, value_id, suffix, in[d], DType::kI32);
      starts.push_back(start);
    }
    int term = slot;
    if (padded) {
      const int zeros =
          internal::emit_kernel(*this, value_id, Op::kConstant, value.dtype, out, {}, ConstantAttrs{Scalar(0)});
      const int at = internal::emit_start_vector(*this, value_id, starts, DType::kI32);
      term = internal::emit_kernel(*this, value_id, Op::kDynamicUpdateSlice, value.dtype, out, {zeros, term, at});
    }
    if (!once.empty()) term = internal::emit_first_device_term(*this, value_id, term, once, value.dtype, out);
    return term;
  }

  // The collective of a reshard step; its groups (or a permute's pairs) come from the step's
  // axes (or layouts) when each device resolves the program.
  static CollectiveSpec collective_for(const ReshardStep& step) {
    CollectiveSpec spec;
    spec.reduce_op = step.reduce_op;
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
        spec.kind = CollectiveKind::kCollectivePermute;
        break;
    }
    return spec;
  }

  const Graph& g_;
  const Mesh& mesh_;
  const Propagation& p_;
  Executable* exe_;
  DevicePlan plan_;
  std::vector<int> slot_of_;
  std::vector<ArrayType> input_types_;  // local, of each of plan_.input_slots
  int next_slot_ = 0;
};

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
  inst.value = id;
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

int emit_kernel(PartitionContext& c, int id, Op op, DType dtype, Shape shape, std::vector<int> in, Attrs attributes) {
  Instruction inst;
  inst.kind = Instruction::Kind::kKernel;
  inst.in = in;
  inst.value = id;
  inst.cause = c.cause(id);
  inst.node.op = op;
  inst.node.dtype = dtype;
  inst.node.shape = std::move(shape);
  inst.node.operands = std::move(in);
  inst.node.attributes = std::move(attributes);
  return c.emit(std::move(inst));
}

int emit_collective(PartitionContext& c, int id, const CollectiveSpec& spec, std::vector<int> in, Axes axes,
                    std::vector<int64_t> positions, DType dtype, Shape shape) {
  Instruction inst;
  inst.kind = Instruction::Kind::kCollective;
  inst.in = std::move(in);
  inst.value = id;
  inst.cause = c.cause(id);
  inst.node.dtype = dtype;
  inst.node.shape = std::move(shape);
  inst.collective = spec;
  inst.axes = std::move(axes);
  inst.positions = std::move(positions);
  return c.emit(std::move(inst));
}

int emit_first_device_term(PartitionContext& c, int id, int slot, const Axes& axes, DType dtype, const Shape& shape) {
  const int position = emit_block_start(c, id, axes, 1, DType::kI32);
  const int zero = emit_kernel(c, id, Op::kConstant, DType::kI32, {}, {}, ConstantAttrs{Scalar(0)});
  const int first = emit_kernel(c, id, Op::kEq, DType::kBool, {}, {position, zero});
  const int mask = emit_kernel(c, id, Op::kBroadcastInDim, DType::kBool, shape, {first}, BroadcastAttrs{});
  const int zeros = emit_kernel(c, id, Op::kConstant, dtype, shape, {}, ConstantAttrs{Scalar(0)});
  return emit_kernel(c, id, Op::kSelect, dtype, shape, {mask, slot, zeros});
}

int emit_start_vector(PartitionContext& c, int id, const std::vector<int>& scalars, DType dtype) {
  std::vector<int> rows;
  for (int s : scalars) rows.push_back(emit_kernel(c, id, Op::kBroadcastInDim, dtype, {1}, {s}, BroadcastAttrs{}));
  return emit_kernel(c, id, Op::kConcatenate, dtype, {static_cast<int64_t>(rows.size())}, rows, ConcatAttrs{0});
}

int emit_block_start(PartitionContext& c, int id, const Axes& axes, int64_t block, DType dtype) {
  Instruction position;
  position.kind = Instruction::Kind::kKernel;
  position.node.op = Op::kAxisIndex;
  position.node.dtype = DType::kI32;
  position.node.attributes = AxisIndexAttrs{};  // the axes are the instruction's
  position.axes = axes;
  position.value = id;
  position.cause = c.cause(id);
  int start = c.emit(std::move(position));
  if (dtype != DType::kI32) start = emit_kernel(c, id, Op::kConvert, dtype, {}, {start});
  const int extent = emit_kernel(c, id, Op::kConstant, dtype, {}, {}, ConstantAttrs{Scalar(block)});
  return emit_kernel(c, id, Op::kMul, dtype, {}, {start, extent});
}

}  // namespace internal

std::string Executable::as_text() const {
  std::string out;
  for (const std::string& line : log) absl::StrAppend(&out, "# ", line, "\n");
  int collectives = 0;
  for (const Instruction& i : program.code) collectives += i.kind == Instruction::Kind::kCollective ? 1 : 0;
  return out + plan_to_text(program, mesh,
                            absl::StrCat("program on ", mesh.to_string(), " (", mesh.size(),
                                         " devices, each resolves it for its position): ", collectives,
                                         collectives == 1 ? " collective, " : " collectives, ",
                                         collective_bytes_per_device(program, mesh), " bytes received per device"));
}

absl::StatusOr<std::string> Executable::device_text(int device_id) const {
  TESSERA_ASSIGN_OR_RETURN(DevicePlan plan, resolve(program, mesh, device_id));
  return plan_to_text(plan, mesh, absl::StrCat("device ", device_id, ":"));
}

absl::StatusOr<Executable> partition(const Graph& graph, const Mesh& mesh, const Propagation& propagation,
                                     const std::vector<std::optional<PartitionSpec>>& outputs,
                                     const std::vector<int>& donated) {
  Executable exe{mesh, {}, {}, {}, {}};
  TESSERA_ASSIGN_OR_RETURN(exe.program, ProgramPartitioner(graph, mesh, propagation, &exe).run(outputs, donated));
  return exe;
}

}  // namespace tessera

// Broadcast operands: an elementwise kernel with several operands (a binary op, a comparison,
// select) that reads a broadcast_in_dim reads the broadcast's operand instead, which its
// kernel repeats on the fly (core/op.cc's infer_type, worker/kernels/elementwise.cc): `x * 0.5`
// reads the rank-0 0.5, layer norm's `(x - mean) * rstd` its (B, T, 1) statistics, softmax's
// `s - max` the (B, N, T, 1) maxima, `x * gamma` the (D) row as (1, 1, D), attention's
// `where(mask, s, fill)` the (T, T) mask as (1, 1, T, T) and the scalar fill. So no array of the
// activations' shape is filled only to be read once. An operand of lower rank than the result
// is given the result's rank by a reshape inserting the dimensions of size 1 (a copy of the
// small operand, before the first kernel that reads it so).
//
// A broadcast that anything else reads (another kind of op, a loop, an output) is still built;
// one left without readers goes in DCE. Each kernel keeps at least one operand of its full
// shape. A broadcast whose operand type is unknown here (a program input of unknown type) is
// left alone unless its operand is rank 0.
//
// Runs first: in a loop's body (whose passes run when it is partitioned) the broadcast goes
// before hoist.cc moves the now small constant out of the loop as a carry.
#include <optional>
#include <vector>

#include "coordinator/compiler/passes/passes.h"
#include "core/op.h"

namespace tessera {
namespace {

// The type of every slot the program writes, and of its inputs when `input_types` gives them.
std::vector<std::optional<ArrayType>> slot_types(const DevicePlan& program, const std::vector<ArrayType>& input_types) {
  std::vector<std::optional<ArrayType>> type(program.num_slots);
  if (input_types.size() == program.input_slots.size()) {
    for (size_t k = 0; k < input_types.size(); ++k) type[program.input_slots[k]] = input_types[k];
  }
  for (const Instruction& i : program.code) {
    if (i.kind == Instruction::Kind::kFree) continue;
    if (i.kind == Instruction::Kind::kLoop || i.kind == Instruction::Kind::kSwitch) {
      std::vector<int> outs = {i.out};
      outs.insert(outs.end(), i.extra_out.begin(), i.extra_out.end());
      for (size_t k = 0; k < outs.size() && k < i.out_types.size(); ++k) type[outs[k]] = i.out_types[k];
      continue;
    }
    type[i.out] = ArrayType{i.node.dtype, i.node.shape};
  }
  return type;
}

// What a kernel reads instead of broadcast `b`: its operand as is (rank 0 or the result's
// rank), or reshaped to the result's rank (`reshape_to`); nullopt when the operand's type is
// unknown.
struct Source {
  int slot = -1;
  std::optional<Shape> reshape_to;
};
std::optional<Source> source_of(const Instruction& b, const std::optional<ArrayType>& operand) {
  const std::vector<int64_t>& dims = b.node.attrs<BroadcastAttrs>().result_dims;
  if (dims.empty()) return Source{b.in[0], std::nullopt};  // rank 0
  if (!operand.has_value()) return std::nullopt;
  if (dims.size() == b.node.shape.size()) return Source{b.in[0], std::nullopt};  // dims increase: 0, 1, ...
  Shape shape(b.node.shape.size(), 1);
  for (size_t k = 0; k < dims.size(); ++k) shape[static_cast<size_t>(dims[k])] = operand->shape[k];
  return Source{b.in[0], shape};
}

}  // namespace

void read_broadcast_operands(DevicePlan* program, const std::vector<ArrayType>& input_types) {
  const std::vector<std::optional<ArrayType>> type = slot_types(*program, input_types);
  std::vector<std::optional<Source>> source(program->num_slots);  // a broadcast's result slot -> its source
  std::vector<int> reshaped(program->num_slots, -1);              // ... -> the reshape made of its source
  std::vector<Instruction> code;
  for (Instruction& i : program->code) {
    if (i.kind == Instruction::Kind::kKernel && i.node.op == Op::kBroadcastInDim && i.in.size() == 1) {
      source[i.out] = source_of(i, type[i.in[0]]);
    } else if (i.kind == Instruction::Kind::kKernel && has_trait(i.node.op, kElementwise) && i.in.size() > 1) {
      bool keeps_full_shape = false;
      for (int s : i.in) keeps_full_shape = keeps_full_shape || !source[s].has_value();
      for (int& s : i.in) {
        if (!keeps_full_shape || !source[s].has_value()) continue;
        const Source& src = *source[s];
        if (!src.reshape_to.has_value()) {
          s = src.slot;
          continue;
        }
        if (reshaped[s] < 0) {
          Instruction r;
          r.in = {src.slot};
          r.node.op = Op::kReshape;
          r.node.operands = r.in;
          r.node.dtype = type[src.slot]->dtype;
          r.node.shape = *src.reshape_to;
          r.out = program->num_slots++;
          r.cause = i.cause;
          r.value = i.value;
          reshaped[s] = r.out;
          code.push_back(std::move(r));
        }
        s = reshaped[s];
      }
      i.node.operands = i.in;
    }
    code.push_back(std::move(i));
  }
  program->code = std::move(code);
}

}  // namespace tessera

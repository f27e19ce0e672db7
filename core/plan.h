// DevicePlan: a compiled program as a linear list of instructions over numbered buffer slots
// (local kernels, collectives, local slices, frees).
//
// The partitioner writes ONE plan for all devices of a mesh, in SPMD form: whatever depends on
// a device's position is said symbolically — a collective names its mesh axes (and a
// shard_map permute its positions along them), a local slice or a permute between layouts
// names the two layouts, axis_index stays an op — so its size and the time to make it do not
// grow with the number of devices. Each worker resolves it for its own device once, when the
// plan is loaded, into the plan its interpreter runs (device ids, slice offsets, pairs):
//
//   absl::StatusOr<DevicePlan> mine = resolve(program, mesh, /*device_id=*/5);
//   for (const Instruction& i : mine->code) {
//     if (i.kind == Instruction::Kind::kKernel) slots[i.out] = run_kernel(i.node, inputs(i.in));
//     ...
//   }
#ifndef TESSERA_CORE_PLAN_H_
#define TESSERA_CORE_PLAN_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collective.h"
#include "core/graph.h"
#include "core/sharding.h"

namespace tessera {

struct DevicePlan;

struct Instruction {
  enum class Kind { kKernel, kCollective, kLocalSlice, kFree, kLoop, kSwitch };
  Kind kind = Kind::kKernel;
  int out = -1;               // slot written (not for kFree)
  std::vector<int> in;        // slots read (kFree: the slot freed)
  Node node;                  // kKernel: the op on local shapes; otherwise the result's dtype and shape
  CollectiveSpec collective;  // kCollective: kind, reduce op, dimensions; groups and pairs once resolved
  Index slice;                // kLocalSlice, resolved: the block of the input this device keeps
  std::string cause;          // the graph op that needed this instruction, e.g. "%3 = tanh" (not sent)
  int value = -1;             // the graph node whose value it computes or moves, -1 if none (not sent)

  // The SPMD form, which resolve() replaces by device ids and offsets:
  //   kCollective: replica groups of mesh `axes`; a shard_map permute also (source, target)
  //     `positions` along them, in pairs; a permute between layouts `relayout` instead.
  //   kLocalSlice: `relayout` (the block this device keeps under `to` of the one it holds).
  //   kKernel axis_index: this device's position along `axes`, an i32 constant.
  struct Relayout {
    Shape shape;  // the value's global shape
    PartitionSpec from, to;
  };
  std::vector<std::string> axes;
  std::vector<int64_t> positions;
  std::optional<Relayout> relayout;

  // kLoop (a scan): `body` (a plan of its own slots) runs `trip_count` times. Its inputs are
  // the carries — the first `num_carry` of `in` on the first iteration, then what the body
  // returned for them — and row t of each other input (its leading dimension dropped), for
  // t = 0 .. trip_count-1 (backwards when `reverse`). Its first num_carry outputs are the next
  // carries; the others are stacked: row t of output j is what iteration t returned. `out`
  // gets the loop's result 0, `extra_out` results 1..; `out_types` has every result's local
  // type (the final carries, then the stacked results). `node` holds result 0's type.
  std::shared_ptr<const DevicePlan> body;
  int64_t trip_count = 0;
  bool reverse = false;
  int num_carry = 0;
  std::vector<int> extra_out;
  std::vector<ArrayType> out_types;

  // A kLoop with one of `branches` is a while loop: before each iteration branches[0] (the
  // predicate) runs on the carries and gives a bool scalar (replicated: every device computes
  // the same); the loop ends when it is false. Every input is a carry, every result a final
  // carry (no rows, nothing stacked). `trip_count` bounds the iterations only when the
  // predicate or the body has collectives (their op ids are reserved per run: iteration t
  // takes first + t * (span(predicate) + span(body)), the predicate's first); 0 when neither
  // has, and the loop runs until the predicate fails or the run is cancelled or times out.
  // kSwitch (lax.switch): `in[0]` is an int32 scalar index (replicated), clamped to
  // [0, branches.size() - 1]; that branch runs on the other inputs, its results written to
  // `out`, `extra_out` (types `out_types`), its collectives' op ids from this op's + 1.
  std::vector<std::shared_ptr<const DevicePlan>> branches;
};

struct DevicePlan {
  int device = -1;  // -1 in SPMD form
  int num_slots = 0;
  std::vector<int> input_slots;  // slot of each parameter's local shard
  // Inputs (positions in input_slots) the caller gives up (jit's donate_argnums): the plan
  // frees them after their last use, and a kernel may write its result over them.
  std::vector<int> donated_inputs;
  std::vector<int> output_slots;  // slot of each output's local shard
  std::vector<Instruction> code;
};

// The plan `device_id` runs: `program` (in SPMD form) with every symbolic instruction
// resolved on `mesh` for that device. NOT_FOUND when the device is not in the mesh;
// INVALID_ARGUMENT naming the instruction when a symbolic part does not fit the mesh (an
// unknown axis, a position outside the axes, a layout that does not fit the shape) or the
// resolved collective breaks validate_collective's rules.
absl::StatusOr<DevicePlan> resolve(const DevicePlan& program, const Mesh& mesh, int device_id);

// How many op ids a run of `program` uses for its collectives (worker/interpreter.h's
// plan_op_id): one per instruction, and for a loop one per instruction of its body (counted
// so, recursively) per iteration. What an execution reserves beyond its own id.
uint64_t plan_op_span(const DevicePlan& program);
// One instruction's share of that: 1; a scan 1 + trip_count * span(body); a while loop
// 1 + trip_count * (span(predicate) + span(body)) + span(predicate) (its last test); a switch
// 1 + its widest branch's span.
uint64_t instruction_op_span(const Instruction& i);

// Whether `program` runs a collective (in a loop body too).
bool plan_has_collectives(const DevicePlan& program);

// Whether slot `s` is freed right after instruction `k` of `plan` (frees follow their slot's
// last use): the liveness the interpreter's in-place writes and a plan's memory peak share.
bool freed_after(const DevicePlan& plan, size_t k, int s);

// The instructions of `program`, those of loop bodies included (once each, whatever their
// trip counts): a program's size.
int64_t plan_size(const DevicePlan& program);

// The bytes one device receives for collective `i` of a program on `mesh`, by the algorithms'
// own accounting (nccl-tests' convention, with S the result's bytes on the device and n the
// devices of its replica groups): all_reduce 2(n-1)/n S, all_gather (n-1)/n S, reduce_scatter
// (n-1) S (its input is n S), all_to_all (n-1)/n S, a permute S (an upper bound: a device that
// keeps its block moves nothing), a ragged_all_to_all S (an upper bound: the rows received are known only at run
// time, and at most the output's). 0 for anything that is not a collective.
int64_t collective_bytes_per_device(const Instruction& i, const Mesh& mesh);
// The sum over the program's collectives.
int64_t collective_bytes_per_device(const DevicePlan& program, const Mesh& mesh);

// One instruction per line, collectives annotated with their cause; for a program in SPMD form
// the symbolic parts ("axes=('model',)", "P() -> P('data', None)"), for a resolved plan the
// groups and slices; each collective with the bytes a device receives for it
// (collective_bytes_per_device on `mesh`). `header` starts the text ("device 3:").
std::string plan_to_text(const DevicePlan& plan, const Mesh& mesh, const std::string& header);

}  // namespace tessera

#endif  // TESSERA_CORE_PLAN_H_

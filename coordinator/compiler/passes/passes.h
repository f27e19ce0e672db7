// The passes partition() runs over the program it emitted (SPMD form, core/plan.h), in this
// order, each in its own file:
//
//   read_broadcast_operands       broadcast_operands.cc  an elementwise kernel of several
//                                           operands reads what a broadcast_in_dim repeats (a
//                                           scalar, (B, T, 1) statistics, a (D) row) and repeats
//                                           it on the fly; the broadcast is built only for other
//                                           readers
//   hoist_loop_invariants         hoist.cc  what a loop's body (or a while loop's
//                                           predicate) computes from nothing the iteration
//                                           gives it (constants, iotas, their broadcasts and
//                                           masks) runs once before the loop and enters it
//                                           as an extra carry
//   eliminate_dead_code           dce.cc    nothing that reaches no output is computed
//   eliminate_common_subexpressions cse.cc  an instruction identical to an earlier one (same
//                                           op, attributes and inputs: a reshard emitted for
//                                           each consumer, a constant built twice) reuses its
//                                           result
//   create_reduce_scatters        reduce_scatter.cc  an all_reduce whose result one local_slice
//                                           splits over the reduced axes becomes a
//                                           reduce_scatter onto that dimension
//   combine_collectives           combine_collectives.cc  independent all_reduces (by data
//                                           flow: the program is re-scheduled so that their
//                                           readers wait) over the same axes, reduce op and
//                                           dtype sent as one message (up to kCombineBytes);
//                                           reduce_scatters and all_gathers likewise
//   insert_frees                  frees.cc  slots numbered densely, each freed after its last
//                                           use (not outputs, nor inputs the caller keeps)
//
//   DevicePlan program = ...;        // as emitted: no frees yet
//   run_passes(&program, mesh, input_types);  // what partition() does
//
// Every pass keeps the program's meaning for every device, since all run the same program:
// removing a collective removes it everywhere.
#ifndef TESSERA_COORDINATOR_COMPILER_PASSES_PASSES_H_
#define TESSERA_COORDINATOR_COMPILER_PASSES_PASSES_H_

#include <cstdint>
#include <vector>

#include "core/plan.h"

namespace tessera {

// REQUIRES for all: `program` has no frees yet, every slot is written once before it is read.
// `input_types`: the local type of each of program->input_slots, or empty when unknown.
void read_broadcast_operands(DevicePlan* program, const std::vector<ArrayType>& input_types);
void hoist_loop_invariants(DevicePlan* program);
void eliminate_dead_code(DevicePlan* program);
void eliminate_common_subexpressions(DevicePlan* program);
void create_reduce_scatters(DevicePlan* program);
void insert_frees(DevicePlan* program);

// What one combined collective carries at most (a reduce_scatter: its operand; an all_gather:
// its result). A larger one goes alone. `mesh` gives a reduce_scatter's or an all_gather's
// group size, which lays out its operands.
inline constexpr int64_t kCombineBytes = int64_t{4} << 20;
void combine_collectives(DevicePlan* program, const Mesh& mesh);

inline void run_passes(DevicePlan* program, const Mesh& mesh, const std::vector<ArrayType>& input_types) {
  read_broadcast_operands(program, input_types);  // before hoisting: a body's scalars leave as scalars
  hoist_loop_invariants(program);                 // before CSE: hoisted constants meet their twins
  eliminate_common_subexpressions(program);       // first: duplicates removed, their producers may die
  eliminate_dead_code(program);
  create_reduce_scatters(program);  // before combining: a combined all_reduce is read by many
  combine_collectives(program, mesh);
  insert_frees(program);
}

}  // namespace tessera

#endif  // TESSERA_COORDINATOR_COMPILER_PASSES_PASSES_H_

// run_collective: one collective over an array's per-device blocks, run by the workers over
// their own streams (never through the coordinator or the client).
//
// The low-level driver behind compiled programs, and what the collective tests and
// benchmark use. Every device of the array's mesh must hold a block of its own (no
// replicated dimensions); each device's result becomes its block of the returned array,
// which has the same sharding.
//
//   // x: (8, 1024) float32 under P(("data", "model"), None) on a (4, 2) mesh
//   CollectiveSpec spec;
//   spec.kind = CollectiveKind::kAllReduce;
//   spec.groups = *replica_groups(x.sharding().mesh(), {"data"});   // {0,2,4,6}, {1,3,5,7}
//   absl::StatusOr<Array> y = run_collective(x, spec);
#ifndef TESSERA_COLLECTIVE_H_
#define TESSERA_COLLECTIVE_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/collective.h"
#include "tessera/array.h"

namespace tessera {

// How a collective's own time is measured (benchmarks).
struct CollectiveTiming {
  // In: every member passes a barrier (a one-element all-reduce) before its clock starts, as
  // MPI benchmarks do; without it a member's time includes waiting for late members.
  bool barrier_first = false;
  // Out: the slowest member's time from its start to its stored result, by its own clock
  // (the collective without the dispatch through the coordinator).
  absl::Duration collective;
};

// Runs `spec` on the blocks of `input` (waiting first for input to be ready, with the errors
// of Array::block_until_ready) and returns, once every member has stored its result, a new
// ready Array with input's sharding. INVALID_ARGUMENT when the spec is malformed
// (validate_collective), its groups do not cover exactly the devices of the array's mesh,
// the array has replicated blocks, or a dimension does not fit (collective_output_shape);
// FAILED_PRECONDITION when the array lost a block to a worker restart; UNAVAILABLE naming
// a lost device; UNAVAILABLE or DEADLINE_EXCEEDED naming the device when a member stops
// answering (each member gives up after `timeout`; a `timeout` that is not positive means
// 10 s). `timing`, when given, is read and filled as above.
absl::StatusOr<Array> run_collective(const Array& input, const CollectiveSpec& spec,
                                     absl::Duration timeout = absl::Seconds(10), CollectiveTiming* timing = nullptr);

}  // namespace tessera

#endif  // TESSERA_COLLECTIVE_H_

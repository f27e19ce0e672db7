// Moving an unreduced array onto another mesh (device_put of an Array; the coordinator's
// block moves, coordinator/block_moves.h): which target shardings keep its terms apart.
//
//   // f32[8] unreduced over 'x' on devices 0,1 to the same spec on devices 2,3: OK, device 2
//   // gets device 0's term and device 3 device 1's.
//   check_unreduced_move(NamedSharding(low, P().with_unreduced({"x"})),
//                        NamedSharding(high, P().with_unreduced({"x"}))).ok();
#ifndef TESSERA_CORE_UNREDUCED_MOVE_H_
#define TESSERA_CORE_UNREDUCED_MOVE_H_

#include "absl/status/status.h"
#include "core/sharding.h"

namespace tessera {

// An array unreduced over some mesh axes holds, on the devices along them, terms of a sum (not
// replicas): it moves only onto a sharding unreduced over the same axes, each of the same size
// on the target's mesh, where each device gets the term of the device at its coordinates along
// them (JAX moves each shard to its counterpart: pjit_test.py
// test_device_put_unreduced_via_runtime_transfer). An array without unreduced axes moves only
// onto a sharding without them (each device along an unreduced axis would hold the whole
// value: JAX's device_put onto an unreduced spec is a cast, the value on the first device).
// OK for those; INVALID_ARGUMENT naming both shardings otherwise.
absl::Status check_unreduced_move(const NamedSharding& from, const NamedSharding& to);

}  // namespace tessera

#endif  // TESSERA_CORE_UNREDUCED_MOVE_H_

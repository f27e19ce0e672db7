// A plan's memory peak: the most a run of one device's plan holds at once, by the plan's
// liveness, which a worker reserves in its buffer store before the run starts.
//
//   PlanPeak peak = peak_memory(plan, inputs);
//   store.reserve(execution_id, peak.bytes);   // peak.instruction names where it is reached
#ifndef TESSERA_WORKER_PLAN_PEAK_H_
#define TESSERA_WORKER_PLAN_PEAK_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/plan.h"

namespace tessera {

class HostArray;

// The most memory a run of `plan` on `inputs` holds at once beyond the inputs the caller keeps
// (its intermediates and outputs, and the donated inputs, which the caller gives up), by the
// plan's liveness: every instruction's result from its instruction to its free, none for a
// kernel that writes over an operand dying there (as run_plan does for an intermediate or a
// donated input). Kernels' temporaries are not counted. `instruction` is where the peak is
// reached (-1 for an empty plan). Only the donated inputs are read, so a plan without any has
// one peak whatever its inputs: peak_memory(plan, {}) (plan_peaks(plan).without_donated, computed
// once per loaded plan).
struct PlanPeak {
  int64_t bytes = 0;
  int instruction = -1;
};
PlanPeak peak_memory(const DevicePlan& plan, const std::vector<std::shared_ptr<const HostArray>>& inputs);

// What of `plan`'s peak does not depend on its inputs, computed once when a worker loads it
// (LoadedPlan): every run's peak when the plan has no donated inputs, and the peak each loop's
// body (and predicate) or switch's branches hold while it runs, which a run with donated inputs
// adds to its own instead of walking the bodies again.
struct PlanPeaks {
  PlanPeak without_donated;     // peak_memory(plan, {})
  std::vector<int64_t> bodies;  // per instruction of plan.code: its bodies' peak (0 but for loops, switches)
};
PlanPeaks plan_peaks(const DevicePlan& plan);
// peak_memory(plan, inputs), the same result, with the bodies' peaks read from `known`.
// REQUIRES: known == plan_peaks(plan) (known for a plan of another length is ignored).
PlanPeak peak_memory(const DevicePlan& plan, const std::vector<std::shared_ptr<const HostArray>>& inputs,
                     const PlanPeaks& known);

}  // namespace tessera

#endif  // TESSERA_WORKER_PLAN_PEAK_H_

// Optimisers over parameter trees, as optax: gradient transformations whose init and update
// are traced, so that a whole training step (loss, gradients, clipping, the optimiser, the
// new parameters) is one jitted program, with the parameters and the optimiser state donated.
//
//   optim::GradientTransformation opt =
//       optim::chain({optim::clip_by_global_norm(1.0), optim::adamw(1e-3)});
//   TreeJitted init = jit([&](const std::vector<Tree<Value>>& in) {
//     return std::vector<Tree<Value>>{opt.init(in[0])};
//   });
//   TreeJitted step = jit([&](const std::vector<Tree<Value>>& in) {   // params, state, batch
//     std::vector<Tree<Value>> vg = value_and_grad(loss, {0})(in);
//     auto [updates, state] = opt.update(vg[1], in[1], in[0]);
//     return std::vector<Tree<Value>>{vg[0], optim::apply_updates(in[0], updates), state};
//   }, {.donate_argnums = {0, 1}});
//
// The formulas are optax's (optax/_src/alias.py and transform.py): each leaf of the state is
// sharded as its parameter (an FSDP-sharded weight has its moments split the same way), the
// step counts are int32 scalars, replicated. Updates, moments and parameters keep each
// parameter's dtype. A tree whose names differ from the parameters' (gradients, updates,
// state) fails the trace with INVALID_ARGUMENT naming the first name in one but not the other.
#ifndef TESSERA_OPTIM_H_
#define TESSERA_OPTIM_H_

#include <functional>
#include <utility>
#include <vector>

#include "tessera/trace.h"
#include "tessera/tree.h"

namespace tessera::optim {

// optax.GradientTransformation: init(params) -> state; update(updates, state, params) ->
// (new updates, new state). Both are traced (call them inside jit).
struct GradientTransformation {
  std::function<Tree<Value>(const Tree<Value>& params)> init;
  std::function<std::pair<Tree<Value>, Tree<Value>>(const Tree<Value>& updates, const Tree<Value>& state,
                                                    const Tree<Value>& params)>
      update;
};

// The building blocks (optax's names):
// scale(s): u * s; no state.
GradientTransformation scale(double step_size);
// trace(decay, nesterov): momentum. t = u + decay * t; then u = t, or u + decay * t with
// nesterov. State {"trace": params-like}.
GradientTransformation trace(double decay, bool nesterov = false);
// scale_by_adam: mu = b1 mu + (1 - b1) u; nu = b2 nu + (1 - b2) u^2; count += 1;
// u = (mu / (1 - b1^count)) / (sqrt(nu / (1 - b2^count) + eps_root) + eps).
// State {"count": int32 (), "mu": params-like, "nu": params-like}.
GradientTransformation scale_by_adam(double b1 = 0.9, double b2 = 0.999, double eps = 1e-8, double eps_root = 0.0);
// add_decayed_weights(wd): u + wd * params; no state.
GradientTransformation add_decayed_weights(double weight_decay);
// clip_by_global_norm(max_norm): with g = sqrt(sum of every leaf's squares), u unchanged when
// g < max_norm, else u / g * max_norm. No state.
GradientTransformation clip_by_global_norm(double max_norm);
// chain(ts): each transformation's update feeds the next; state {"0": ts[0]'s, "1": ...}.
GradientTransformation chain(std::vector<GradientTransformation> transformations);

// Learning-rate schedules, as optax's: a traced function of the step count (an int32 Value of
// any shape, elementwise) giving the step size as float32.
using Schedule = std::function<Value(const Value& count)>;
// optax.warmup_cosine_decay_schedule (optax/_src/schedule.py): linear from init_value to
// peak_value over warmup_steps, then cosine decay from peak_value to end_value reached at
// decay_steps (counted from 0, warmup included), end_value after. REQUIRES: 0 <= warmup_steps
// < decay_steps.
Schedule warmup_cosine_decay_schedule(double init_value, double peak_value, int64_t warmup_steps, int64_t decay_steps,
                                      double end_value = 0.0);
// scale_by_schedule(f): u * f(count), count from 0 and incremented after each update (optax's
// scale_by_schedule). State {"count": int32 ()}.
GradientTransformation scale_by_schedule(Schedule step_size);

// The optimisers (optax.sgd, optax.adam, optax.adamw):
// sgd: chain(trace(momentum, nesterov), scale(-lr)); with momentum 0, scale(-lr) alone (no state).
GradientTransformation sgd(double learning_rate, double momentum = 0.0, bool nesterov = false);
// adam: chain(scale_by_adam(b1, b2, eps), scale(-lr)).
GradientTransformation adam(double learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8);
// adamw: chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale(-lr)): the
// decay decoupled from the moments and scaled by the learning rate, as optax.adamw.
GradientTransformation adamw(double learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                             double weight_decay = 1e-4);
// adamw with a learning-rate schedule: the last scale is scale_by_schedule(-schedule(count)), as
// optax.adamw with a callable learning_rate.
GradientTransformation adamw(Schedule learning_rate, double b1 = 0.9, double b2 = 0.999, double eps = 1e-8,
                             double weight_decay = 1e-4);

// optax.apply_updates: params + updates, leaf by leaf, in each parameter's dtype.
Tree<Value> apply_updates(const Tree<Value>& params, const Tree<Value>& updates);

// optax.global_norm: sqrt of the sum of every leaf's squares (a scalar); invalid for no leaves.
Value global_norm(const Tree<Value>& tree);

}  // namespace tessera::optim

#endif  // TESSERA_OPTIM_H_

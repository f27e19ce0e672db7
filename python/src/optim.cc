// tessera/optim.h (optax) bound for tessera/optax.py. Trees cross as flat {dotted name: Value}
// dicts, which the Python side makes from and back into pytrees; the transformations, the
// schedules and every formula are the SDK's.
#include "tessera/optim.h"

#include <pybind11/stl.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "python/src/binding.h"

namespace tessera::python {
namespace {

using Named = std::map<std::string, Value>;
using optim::GradientTransformation;

Tree<Value> tree_of(const Named& leaves) {
  Tree<Value> tree;
  for (const auto& [name, leaf] : leaves) tree.set(name, leaf);
  return tree;
}

Named named(const Tree<Value>& tree) {
  Named out;
  for (const auto& [name, leaf] : tree) out.emplace(name, leaf);
  return out;
}

// An optax schedule made by the SDK (a traced function of the step count).
struct ScheduleFn {
  optim::Schedule f;
};

}  // namespace

void bind_optim(py::module_& m) {
  py::class_<GradientTransformation>(m, "GradientTransformation")
      .def("init", [](const GradientTransformation& t, const Named& params) { return named(t.init(tree_of(params))); })
      .def("update",
           [](const GradientTransformation& t, const Named& updates, const Named& state, const Named& params) {
             auto [new_updates, new_state] = t.update(tree_of(updates), tree_of(state), tree_of(params));
             // A failed update (mismatched trees) leaves names out; they come back invalid, so the
             // trace fails with the SDK's first error, which names the leaf.
             Named out = named(new_updates);
             for (const auto& [name, leaf] : updates) out.emplace(name, Value());
             return std::make_pair(std::move(out), named(new_state));
           });
  py::class_<ScheduleFn>(m, "Schedule").def("__call__", [](const ScheduleFn& s, const Value& count) {
    return s.f(count);
  });
  m.def("optax_scale", &optim::scale);
  m.def("optax_trace", &optim::trace);
  m.def("optax_scale_by_adam", &optim::scale_by_adam);
  m.def("optax_add_decayed_weights", &optim::add_decayed_weights);
  m.def("optax_clip_by_global_norm", &optim::clip_by_global_norm);
  m.def("optax_chain", &optim::chain);
  m.def("optax_sgd", &optim::sgd);
  m.def("optax_adam", &optim::adam);
  m.def("optax_adamw", static_cast<GradientTransformation (*)(double, double, double, double, double)>(&optim::adamw));
  m.def("optax_adamw_schedule", [](const ScheduleFn& lr, double b1, double b2, double eps, double weight_decay) {
    return optim::adamw(lr.f, b1, b2, eps, weight_decay);
  });
  m.def("optax_scale_by_schedule", [](const ScheduleFn& s) { return optim::scale_by_schedule(s.f); });
  m.def("optax_warmup_cosine_decay_schedule",
        [](double init_value, double peak_value, int64_t warmup_steps, int64_t decay_steps, double end_value) {
          if (warmup_steps < 0 || warmup_steps >= decay_steps) {
            throw StatusError(absl::InvalidArgumentError(
                absl::StrCat("warmup_cosine_decay_schedule: warmup_steps ", warmup_steps,
                             " must be at least 0 and less than decay_steps ", decay_steps)));
          }
          return ScheduleFn{
              optim::warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value)};
        });
  m.def("optax_apply_updates", [](const Named& params, const Named& updates) {
    return named(optim::apply_updates(tree_of(params), tree_of(updates)));
  });
  m.def("optax_global_norm", [](const Named& tree) { return optim::global_norm(tree_of(tree)); });
}

}  // namespace tessera::python

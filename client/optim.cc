#include "tessera/optim.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/trace_state.h"

namespace tessera::optim {

using internal::sharded_like;
using internal::TraceState;

namespace {

// The trace the trees' values belong to (or the one running), or null.
TraceState* trace_of(std::initializer_list<const Tree<Value>*> trees) {
  for (const Tree<Value>* t : trees) {
    for (const auto& [name, v] : *t) {
      if (v.ok()) return TraceState::of(v);
    }
  }
  return TraceState::current;
}

// Whether `a` and `b` have the same names; if not, fails the trace naming the first difference.
bool same_names(const Tree<Value>& a, absl::string_view a_what, const Tree<Value>& b, absl::string_view b_what) {
  absl::StatusOr<TreeDef> da = a.structure(), db = b.structure();
  absl::Status s = !da.ok() ? da.status() : !db.ok() ? db.status() : da->check_same(*db, a_what, b_what);
  if (s.ok()) return true;
  TraceState* t = trace_of({&a, &b});
  if (t != nullptr) t->fail(absl::InvalidArgumentError(absl::StrCat("optim: ", s.message())));
  return false;
}

Tree<Value> zeros_like(const Tree<Value>& params) {
  return tree_map(params,
                  [](const std::string&, const Value& p) { return sharded_like(full(p.shape(), 0.0, p.dtype()), p); });
}

// f(a's leaf, b's leaf) by name; REQUIRES: same names.
template <typename F>
Tree<Value> map2(const Tree<Value>& a, const Tree<Value>& b, F f) {
  return tree_map(a, [&](const std::string& name, const Value& x) { return f(x, *b.find(name)); });
}

using Update = std::pair<Tree<Value>, Tree<Value>>;

Tree<Value> no_state(const Tree<Value>&) { return {}; }

}  // namespace

GradientTransformation scale(double step_size) {
  return {no_state, [step_size](const Tree<Value>& u, const Tree<Value>&, const Tree<Value>&) -> Update {
            return {tree_map(u, [&](const std::string&, const Value& x) { return x * step_size; }), {}};
          }};
}

GradientTransformation trace(double decay, bool nesterov) {
  return {[](const Tree<Value>& params) { return Tree<Value>().set("trace", zeros_like(params)); },
          [decay, nesterov](const Tree<Value>& u, const Tree<Value>& state, const Tree<Value>&) -> Update {
            const Tree<Value> old = state.subtree("trace");
            if (!same_names(u, "updates", old, "momentum state")) return {};
            const Tree<Value> t =
                map2(u, old, [&](const Value& g, const Value& m) { return sharded_like(g + decay * m, m); });
            const Tree<Value> out =
                nesterov ? map2(u, t, [&](const Value& g, const Value& m) { return g + decay * m; }) : t;
            return {out, Tree<Value>().set("trace", t)};
          }};
}

GradientTransformation scale_by_adam(double b1, double b2, double eps, double eps_root) {
  return {[](const Tree<Value>& params) {
            Tree<Value> state;
            state.set("count", full({}, 0.0, DType::kI32));
            state.set("mu", zeros_like(params));
            state.set("nu", zeros_like(params));
            return state;
          },
          [b1, b2, eps, eps_root](const Tree<Value>& u, const Tree<Value>& state, const Tree<Value>&) -> Update {
            const Tree<Value> mu = state.subtree("mu"), nu = state.subtree("nu");
            const Value* count = state.find("count");
            if (!same_names(u, "updates", mu, "first moments") || !same_names(u, "updates", nu, "second moments")) {
              return {};
            }
            if (count == nullptr) {
              TraceState* t = trace_of({&u, &state});
              if (t != nullptr) t->fail(absl::InvalidArgumentError("optim: the adam state has no 'count'"));
              return {};
            }
            const Value step = *count + 1;
            const Tree<Value> new_mu =
                map2(u, mu, [&](const Value& g, const Value& m) { return sharded_like((1 - b1) * g + b1 * m, m); });
            const Tree<Value> new_nu = map2(
                u, nu, [&](const Value& g, const Value& v) { return sharded_like((1 - b2) * (g * g) + b2 * v, v); });
            // bias_correction(moment, decay, count): moment / (1 - decay^count), in the moment's dtype.
            auto corrected = [&](const Value& m, double decay) {
              const Value power = pow(full({}, decay, m.dtype()), convert(step, m.dtype()));
              return m / (1.0 - power);
            };
            const Tree<Value> out = map2(new_mu, new_nu, [&](const Value& m, const Value& v) {
              return corrected(m, b1) / (sqrt(corrected(v, b2) + eps_root) + eps);
            });
            Tree<Value> new_state;
            new_state.set("count", step);
            new_state.set("mu", new_mu);
            new_state.set("nu", new_nu);
            return {out, new_state};
          }};
}

GradientTransformation add_decayed_weights(double weight_decay) {
  return {no_state, [weight_decay](const Tree<Value>& u, const Tree<Value>&, const Tree<Value>& params) -> Update {
            if (!same_names(u, "updates", params, "parameters")) return {};
            return {map2(u, params, [&](const Value& g, const Value& p) { return g + weight_decay * p; }), {}};
          }};
}

Value global_norm(const Tree<Value>& tree) {
  Value total;
  for (const auto& [name, x] : tree) {
    const Value s = sum(x * x);
    total = total.ok() ? total + s : s;
  }
  return sqrt(total);
}

GradientTransformation clip_by_global_norm(double max_norm) {
  return {no_state, [max_norm](const Tree<Value>& u, const Tree<Value>&, const Tree<Value>&) -> Update {
            if (u.empty()) return {u, {}};
            const Value norm = global_norm(u);
            const Value keep = norm < max_norm;
            return {
                tree_map(u, [&](const std::string&,
                                const Value& x) { return where(keep, x, (x / convert(norm, x.dtype())) * max_norm); }),
                {}};
          }};
}

GradientTransformation chain(std::vector<GradientTransformation> transformations) {
  auto ts = std::make_shared<const std::vector<GradientTransformation>>(std::move(transformations));
  return {[ts](const Tree<Value>& params) {
            Tree<Value> state;
            for (size_t i = 0; i < ts->size(); ++i) state.set(std::to_string(i), (*ts)[i].init(params));
            return state;
          },
          [ts](const Tree<Value>& updates, const Tree<Value>& state, const Tree<Value>& params) -> Update {
            Tree<Value> u = updates, new_state;
            for (size_t i = 0; i < ts->size(); ++i) {
              const std::string key = std::to_string(i);
              auto [next, s] = (*ts)[i].update(u, state.subtree(key), params);
              u = std::move(next);
              new_state.set(key, std::move(s));
            }
            return {u, new_state};
          }};
}

Schedule warmup_cosine_decay_schedule(double init_value, double peak_value, int64_t warmup_steps, int64_t decay_steps,
                                      double end_value) {
  return [=](const Value& count) {
    // optax: join_schedules([linear_schedule(init, peak, warmup), cosine_decay_schedule(peak,
    // decay_steps - warmup, alpha=end/peak)], [warmup]).
    const Value c = convert(count, DType::kF32);
    const double warmup = static_cast<double>(std::max<int64_t>(warmup_steps, 0));
    const Value ramp =
        warmup > 0 ? init_value + (peak_value - init_value) * (minimum(c, full({}, warmup)) / warmup) : full({}, 0.0);
    const double span = static_cast<double>(std::max<int64_t>(decay_steps - warmup_steps, 1));
    const Value t = minimum(maximum(c - warmup, full({}, 0.0)), full({}, span));
    const Value cosine = 0.5 * (cos(t * (M_PI / span)) + 1.0);
    const Value decayed = (peak_value - end_value) * cosine + end_value;
    return where(c < warmup, ramp, decayed);
  };
}

GradientTransformation scale_by_schedule(Schedule step_size) {
  return {[](const Tree<Value>&) { return Tree<Value>().set("count", full({}, 0.0, DType::kI32)); },
          [step_size](const Tree<Value>& u, const Tree<Value>& state, const Tree<Value>&) -> Update {
            const Value* count = state.find("count");
            if (count == nullptr) {
              TraceState* t = trace_of({&u, &state});
              if (t != nullptr) t->fail(absl::InvalidArgumentError("optim: the schedule state has no 'count'"));
              return {};
            }
            const Value s = step_size(*count);
            return {tree_map(u, [&](const std::string&, const Value& x) { return x * convert(s, x.dtype()); }),
                    Tree<Value>().set("count", *count + 1)};
          }};
}

GradientTransformation sgd(double learning_rate, double momentum, bool nesterov) {
  if (momentum == 0.0) return scale(-learning_rate);
  return chain({trace(momentum, nesterov), scale(-learning_rate)});
}

GradientTransformation adam(double learning_rate, double b1, double b2, double eps) {
  return chain({scale_by_adam(b1, b2, eps), scale(-learning_rate)});
}

GradientTransformation adamw(double learning_rate, double b1, double b2, double eps, double weight_decay) {
  return chain({scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale(-learning_rate)});
}

GradientTransformation adamw(Schedule learning_rate, double b1, double b2, double eps, double weight_decay) {
  Schedule negated = [learning_rate](const Value& count) { return -learning_rate(count); };
  return chain({scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_schedule(negated)});
}

Tree<Value> apply_updates(const Tree<Value>& params, const Tree<Value>& updates) {
  if (!same_names(params, "parameters", updates, "updates")) return {};
  return map2(params, updates, [](const Value& p, const Value& u) {
    const Value sum = p + u;
    return sum.dtype() == p.dtype() ? sum : convert(sum, p.dtype());
  });
}

}  // namespace tessera::optim

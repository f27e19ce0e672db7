"""tessera.optax: optax's gradient transformations over the SDK's (tessera/optim.h), under
optax's names, so a training step written with optax runs with `import tessera.optax as optax`:

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = opt.init(params)

    @tessera.jit
    def step(params, state, batch):
        loss, grads = tessera.value_and_grad(loss_fn)(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

Parameters are pytrees of dicts (string keys without dots), lists and tuples. Each state leaf
is sharded as its parameter; step counts are int32 scalars. The state is a nested dict (optax
has NamedTuples): chain's members are keys "0", "1", ... and an optimiser's moments keys such
as "mu" and "nu" over the parameters' own structure. Learning rates are numbers or schedules
made here (warmup_cosine_decay_schedule); a Python function as a schedule is not supported.
init, update and apply_updates work on concrete arrays and inside jit.
"""
from . import _tessera as _t
from ._trace import Tracer
from .numpy import _op, _tracer, _wrap
from .tree_util import tree_flatten, tree_unflatten


def _names(tree):
    """The dotted names of tree's leaves, in tree_flatten's order (tessera/tree.h's names)."""
    out = []

    def walk(x, prefix):
        join = (lambda k: f"{prefix}.{k}") if prefix else str
        if x is None:
            return
        if isinstance(x, dict):
            for k in sorted(x):
                if not isinstance(k, str) or not k or "." in k:
                    raise ValueError(f"optax: a parameter tree's dict keys must be non-empty strings without '.', "
                                     f"not {k!r}")
                walk(x[k], join(k))
        elif isinstance(x, (tuple, list)):
            for i, c in enumerate(x):
                walk(c, join(i))
        else:
            out.append(prefix)

    walk(tree, "")
    return out


def _flat(tree):
    leaves, _ = tree_flatten(tree)
    return {n: _tracer(l)._v for n, l in zip(_names(tree), leaves)}


def _like(template, named):
    """`named` ({name: Value}) in the structure of `template`."""
    _, treedef = tree_flatten(template)
    return tree_unflatten(treedef, [Tracer(named[n]) for n in _names(template)])


def _nested(named):
    """A flat {dotted name: Value} as nested dicts (a name "" is the leaf itself)."""
    if set(named) == {""}:
        return Tracer(named[""])
    root = {}
    for name, v in named.items():
        node, parts = root, name.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = Tracer(v)
    return root


@_op
def _init(t, params):
    # A scalar beside the state, so that a stateless transformation (sgd, clipping) run on
    # concrete arrays still makes a program with an output; init drops it.
    return _nested(t.init(_flat(params))), 0


@_op
def _update(t, updates, state, params):
    new_updates, new_state = t.update(_flat(updates), _flat(state), {} if params is None else _flat(params))
    return _like(updates, new_updates), _nested(new_state)


class GradientTransformation:
    """optax.GradientTransformation: init(params) -> state; update(updates, state, params=None)
    -> (updates, state)."""

    def __init__(self, cpp):
        self._t = cpp

    def init(self, params):
        return _init(self._t, params)[0]

    def update(self, updates, state, params=None):
        return _update(self._t, updates, state, params)


class Schedule:
    """An optax schedule: count -> step size (float32), on arrays or inside jit."""

    def __init__(self, cpp):
        self._s = cpp

    def __call__(self, count):
        return _schedule(self._s, count)


@_op
def _schedule(s, count):
    return _wrap(s(_tracer(count)._v))


def _lr(learning_rate, name):
    if isinstance(learning_rate, Schedule):
        return learning_rate
    if callable(learning_rate):
        raise TypeError(f"optax.{name}: a Python function as learning_rate is not supported; use a schedule made by "
                        "tessera.optax (warmup_cosine_decay_schedule) or a number")
    return float(learning_rate)


def scale(step_size):
    return GradientTransformation(_t.optax_scale(float(step_size)))


def trace(decay, nesterov=False):
    return GradientTransformation(_t.optax_trace(float(decay), bool(nesterov)))


def scale_by_adam(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0):
    return GradientTransformation(_t.optax_scale_by_adam(b1, b2, eps, eps_root))


def add_decayed_weights(weight_decay=0.0):
    return GradientTransformation(_t.optax_add_decayed_weights(float(weight_decay)))


def clip_by_global_norm(max_norm):
    return GradientTransformation(_t.optax_clip_by_global_norm(float(max_norm)))


def scale_by_schedule(step_size_fn):
    if not isinstance(step_size_fn, Schedule):
        raise TypeError("optax.scale_by_schedule: the schedule must be one made by tessera.optax")
    return GradientTransformation(_t.optax_scale_by_schedule(step_size_fn._s))


def chain(*transforms):
    return GradientTransformation(_t.optax_chain([t._t for t in transforms]))


def sgd(learning_rate, momentum=None, nesterov=False):
    lr = _lr(learning_rate, "sgd")
    if isinstance(lr, Schedule):
        raise TypeError("optax.sgd: a schedule as learning_rate is not supported yet; use adamw, or a number")
    return GradientTransformation(_t.optax_sgd(lr, float(momentum or 0.0), bool(nesterov)))


def adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8):
    lr = _lr(learning_rate, "adam")
    if isinstance(lr, Schedule):
        raise TypeError("optax.adam: a schedule as learning_rate is not supported yet; use adamw, or a number")
    return GradientTransformation(_t.optax_adam(lr, b1, b2, eps))


def adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4):
    lr = _lr(learning_rate, "adamw")
    if isinstance(lr, Schedule):
        return GradientTransformation(_t.optax_adamw_schedule(lr._s, b1, b2, eps, weight_decay))
    return GradientTransformation(_t.optax_adamw(lr, b1, b2, eps, weight_decay))


def warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps, decay_steps, end_value=0.0):
    return Schedule(_t.optax_warmup_cosine_decay_schedule(float(init_value), float(peak_value), int(warmup_steps),
                                                          int(decay_steps), float(end_value)))


@_op
def apply_updates(params, updates):
    """optax.apply_updates: params + updates, leaf by leaf, in each parameter's dtype."""
    return _like(params, _t.optax_apply_updates(_flat(params), _flat(updates)))


@_op
def global_norm(updates):
    return _wrap(_t.optax_global_norm(_flat(updates)))

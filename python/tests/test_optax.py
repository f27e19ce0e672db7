# tessera.optax (issue #20: the optimisers of tessera/optim.h under optax's names), against
# numpy implementations of optax's formulas (optax/_src/alias.py, transform.py, clipping.py,
# schedule.py), over pytrees of dicts and lists, on concrete arrays and inside jit.
import math

import numpy as np
import pytest

import tessera
from tessera import optax
from tessera.sharding import NamedSharding, PartitionSpec as P

RNG = np.random.default_rng(7)
PARAMS = {"w": RNG.normal(size=(8, 4)).astype(np.float32),
          "layers": [RNG.normal(size=(4,)).astype(np.float32), RNG.normal(size=(4,)).astype(np.float32)]}
GRADS = [{"w": RNG.normal(size=(8, 4)).astype(np.float32),
          "layers": [RNG.normal(size=(4,)).astype(np.float32), RNG.normal(size=(4,)).astype(np.float32)]}
         for _ in range(3)]


def leaves(tree):
    return tessera.tree_util.tree_leaves(tree)


def host_adamw(params, grads, lr, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4, clip=None):
    p = [np.float64(x) for x in leaves(params)]
    mu = [np.zeros_like(x) for x in p]
    nu = [np.zeros_like(x) for x in p]
    for t, g in enumerate(grads, 1):
        g = [np.float64(x) for x in leaves(g)]
        if clip is not None:
            norm = math.sqrt(sum(float((x * x).sum()) for x in g))
            g = g if norm < clip else [x / norm * clip for x in g]
        mu = [b1 * m + (1 - b1) * x for m, x in zip(mu, g)]
        nu = [b2 * n + (1 - b2) * x * x for n, x in zip(nu, g)]
        u = [(m / (1 - b1 ** t)) / (np.sqrt(n / (1 - b2 ** t)) + eps) for m, n in zip(mu, nu)]
        rate = lr(t - 1) if callable(lr) else lr
        p = [x - rate * (d + wd * x) for x, d in zip(p, u)]
    return p, mu, nu


def train(opt, params, grads, state=None):
    """The optax loop: init (unless given), then one jitted step per gradient."""
    state = opt.init(params) if state is None else state

    @tessera.jit
    def step(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    for g in grads:
        params, state = step(params, state, g)
    return params, state


def test_adamw_over_three_steps_is_optaxs_formula():
    params, state = train(optax.adamw(1e-2), PARAMS, GRADS)
    want, mu, nu = host_adamw(PARAMS, GRADS, 1e-2)
    for got, w in zip(leaves(params), want):
        np.testing.assert_allclose(np.asarray(got), w, rtol=2e-5, atol=1e-6)
    # adamw = chain(scale_by_adam, add_decayed_weights, scale): the moments live under "0".
    assert int(np.asarray(state["0"]["count"])) == 3
    for got, w in zip(leaves(state["0"]["mu"]), mu):
        np.testing.assert_allclose(np.asarray(got), w, rtol=2e-5, atol=1e-7)
    assert set(state["0"]["mu"]) == {"w", "layers"}


def test_clipped_adamw_with_a_schedule_on_a_sharded_tree(mesh):
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=1, decay_steps=3, end_value=1e-3)

    def host_sched(c):  # optax/_src/schedule.py: linear warmup, then cosine decay to end_value
        if c < 1:
            return 1e-2 * c / 1
        frac = min(c - 1, 2) / 2
        return 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + math.cos(math.pi * frac))

    np.testing.assert_allclose(np.asarray(sched(np.arange(5, dtype=np.int32))), [host_sched(c) for c in range(5)],
                               rtol=1e-6, atol=1e-9)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched))
    s = NamedSharding(mesh, P("data"))
    params = tessera.device_put(PARAMS, s)
    state = opt.init(params)
    # Each moment is sharded as its parameter.
    assert state["1"]["0"]["mu"]["w"].sharding.spec == P("data", None)
    params, state = train(opt, params, GRADS, state)
    want, _, _ = host_adamw(PARAMS, GRADS, host_sched, clip=1.0)
    for got, w in zip(leaves(params), want):
        np.testing.assert_allclose(np.asarray(got), w, rtol=2e-5, atol=1e-6)
    assert params["w"].sharding.spec == P("data", None)


def test_sgd_with_momentum_and_global_norm():
    params, state = train(optax.sgd(0.1, momentum=0.9), PARAMS, GRADS)
    p = [np.float64(x) for x in leaves(PARAMS)]
    tr = [np.zeros_like(x) for x in p]
    for g in GRADS:  # optax.trace: t = g + decay * t; then scale(-lr)
        tr = [np.float64(x) + 0.9 * t for x, t in zip(leaves(g), tr)]
        p = [x - 0.1 * t for x, t in zip(p, tr)]
    for got, w in zip(leaves(params), p):
        np.testing.assert_allclose(np.asarray(got), w, rtol=2e-5, atol=1e-6)
    # A stateless transformation's state is empty (optax's EmptyState), on arrays too.
    assert leaves(optax.sgd(0.1).init(PARAMS)) == []
    norm = math.sqrt(sum(float((np.float64(x) ** 2).sum()) for x in leaves(GRADS[0])))
    np.testing.assert_allclose(float(np.asarray(optax.global_norm(GRADS[0]))), norm, rtol=1e-6)


def test_errors_name_what_is_wrong():
    with pytest.raises(TypeError, match="a Python function as learning_rate is not supported"):
        optax.adam(lambda c: 0.1)
    with pytest.raises(ValueError, match="must be at least 0 and less than decay_steps 2"):
        optax.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=3, decay_steps=2)
    with pytest.raises(ValueError, match="dict keys must be non-empty strings without '.'"):
        optax.adam(0.1).init({"a.b": np.zeros(2, np.float32)})
    opt = optax.adam(0.1)
    state = opt.init(PARAMS)
    with pytest.raises(ValueError, match="layers"):
        opt.update({"w": GRADS[0]["w"]}, state, PARAMS)

# lax.scan and lax.fori_loop inside jit (the SDK's loops, python/tessera/lax.py), against numpy
# by their documented semantics (jax.lax.scan's Python-loop definition in its docstring), and
# grad through scan against the gradient worked out by hand.
import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera import lax
from tessera.sharding import NamedSharding, PartitionSpec as P

rng = np.random.default_rng(3)


def test_scan_cumsum_with_a_pytree_carry(mesh):
    xs = rng.normal(size=(6, 8)).astype(np.float32)

    def f(xs):
        def step(c, x):
            total = c["total"] + x
            return {"total": total, "count": c["count"] + 1.0}, (total, jnp.sum(x))
        init = {"total": jnp.zeros((8,), jnp.float32), "count": jnp.zeros((), jnp.float32)}
        return lax.scan(step, init, xs)

    carry, (cums, sums) = jax.jit(f)(jax.device_put(xs, NamedSharding(mesh, P(None, "model"))))
    np.testing.assert_allclose(np.asarray(carry["total"]), xs.sum(0), rtol=1e-5, atol=1e-6)
    assert float(carry["count"]) == 6.0
    np.testing.assert_allclose(np.asarray(cums), np.cumsum(xs, 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sums), xs.sum(1), rtol=1e-5, atol=1e-6)
    # reverse: the rows from the last, the ys still stored at their rows.
    _, rev = jax.jit(lambda xs: lax.scan(lambda c, x: (c + x, c + x), jnp.zeros((8,), jnp.float32), xs,
                                         reverse=True))(xs)
    np.testing.assert_allclose(np.asarray(rev), np.cumsum(xs[::-1], 0)[::-1], rtol=1e-5, atol=1e-6)


def test_grad_through_scan_and_fori_loop(mesh):
    xs = rng.normal(size=(5, 4)).astype(np.float32)
    w = rng.normal(size=(5, 4)).astype(np.float32)

    def loss(xs, w):
        _, ys = lax.scan(lambda c, x: (c + x, c + x), jnp.zeros((4,), jnp.float32), xs)
        return jnp.sum(ys * w)

    g = jax.jit(jax.grad(loss))(xs, w)
    # ys[j] = sum_{i <= j} xs[i], so d/dxs[i] = sum_{j >= i} w[j].
    np.testing.assert_allclose(np.asarray(g), np.cumsum(w[::-1], 0)[::-1], rtol=1e-5, atol=1e-6)

    x = rng.normal(size=(4,)).astype(np.float32)
    out = jax.jit(lambda x: lax.fori_loop(1, 4, lambda i, c: c * 2.0 + i.astype(jnp.float32), x))(x)
    want = x.copy()
    for i in range(1, 4):
        want = want * 2.0 + i
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    dx = jax.jit(jax.grad(lambda x: jnp.sum(lax.fori_loop(0, 3, lambda i, c: c * c, x))))(x)
    np.testing.assert_allclose(np.asarray(dx), 8 * x ** 7, rtol=1e-4)


def test_scan_body_reads_outer_values(mesh):
    # A closure over w (JAX's closed-over consts): the loop, its unrolled numpy form, and grad
    # with respect to the captured w (its cotangent summed over the iterations).
    xs = rng.normal(size=(5, 4)).astype(np.float32)
    w = rng.normal(size=(4,)).astype(np.float32)

    def loss(xs, w):
        c, ys = lax.scan(lambda c, x: (c * 0.5 + x * w, c * w), jnp.zeros((4,), jnp.float32), xs)
        return jnp.sum(c) + jnp.sum(ys)

    got = jax.jit(loss)(xs, w)
    c, want = np.zeros(4, np.float32), 0.0
    for x in xs:
        want += np.sum(c * w)
        c = c * 0.5 + x * w
    np.testing.assert_allclose(float(got), want + np.sum(c), rtol=1e-5)
    g = jax.jit(jax.grad(loss, argnums=1))(xs, w)
    eps = 1e-3
    num = np.array([(loss_np(xs, w + eps * e) - loss_np(xs, w - eps * e)) / (2 * eps) for e in np.eye(4)])
    np.testing.assert_allclose(np.asarray(g), num, rtol=1e-2, atol=1e-3)


def loss_np(xs, w):
    c, total = np.zeros(4, np.float64), 0.0
    for x in xs.astype(np.float64):
        total += np.sum(c * w)
        c = c * 0.5 + x * w
    return total + np.sum(c)


def test_while_loop_cond_switch(mesh):
    x = rng.normal(size=(8, 4)).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))

    # while_loop on a split carry: the predicate's sum is all-reduced, every device agrees.
    def grow(x):
        return lax.while_loop(lambda c: jnp.sum(jnp.abs(c[1])) < 500.0,
                              lambda c: (c[0] + 1, c[1] * 1.5 + 1.0), (jnp.zeros((), jnp.int32), x))

    n, out = jax.jit(grow)(xs)
    k, want = 0, x.copy()
    while np.sum(np.abs(want)) < 500.0:
        k, want = k + 1, want * 1.5 + 1.0
    assert int(n) == k and k > 1
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5)
    with pytest.raises(Exception, match="reverse-mode differentiation does not work for lax.while_loop"):
        jax.jit(jax.grad(lambda x: jnp.sum(grow(x)[1])))(xs)

    # cond on data; switch with the index clamped as lax.switch.
    def pick(x, i):
        a = lax.cond(jnp.sum(x) > 0.0, lambda v: v * 2.0, lambda v: -v, x)
        b = lax.switch(i, [lambda v: v + 1.0, lambda v: jnp.tanh(v), lambda v: v * v], x)
        return a, b

    for i in (-2, 0, 1, 2, 9):
        a, b = jax.jit(lambda x, i: pick(x, jnp.sum(i)))(xs, np.array([i], np.int32))
        np.testing.assert_allclose(np.asarray(a), x * 2.0 if x.sum() > 0 else -x, rtol=1e-6)
        branch = [lambda v: v + 1.0, np.tanh, lambda v: v * v][min(max(i, 0), 2)]
        np.testing.assert_allclose(np.asarray(b), branch(x), rtol=1e-5)
    # grad through cond: the taken branch's.
    g = jax.jit(jax.grad(lambda x: jnp.sum(lax.cond(jnp.sum(x) > 1e9, lambda v: v * v, lambda v: v * 3.0, x))))(xs)
    np.testing.assert_allclose(np.asarray(g), np.full_like(x, 3.0))


def test_checkpoint_gives_the_same_gradients(mesh):
    x = rng.normal(size=(8, 8)).astype(np.float32)
    w = rng.normal(size=(8, 8)).astype(np.float32)

    def block(h, w):
        return jnp.tanh(h @ w * 0.5 + h)

    def loss(remat):
        f = jax.checkpoint(block) if remat else block
        return lambda x, w: jnp.sum(f(f(x, w), w) ** 2)

    assert jax.remat is jax.checkpoint
    v1, g1 = jax.jit(jax.value_and_grad(loss(True), argnums=(0, 1)))(x, w)
    v0, g0 = jax.jit(jax.value_and_grad(loss(False), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_checkpoint_policies_keep_what_they_name_and_give_the_gradients_worked_by_hand(mesh):
    # jax.checkpoint_policies (jax/_src/ad_checkpoint.py): the gradient is the same whatever is
    # kept; a kept dot_general is not computed again in the backward pass.
    x = rng.normal(size=(8, 8)).astype(np.float32)
    w = rng.normal(size=(8, 8)).astype(np.float32)
    h = np.tanh(x @ w)
    da = 2 * h * (1 - h * h)  # loss = sum(tanh(x @ w) ** 2)
    seen = []

    def spy(prim, *_, **params):
        seen.append((str(prim), prim.name, params.get("dimension_numbers")))
        return str(prim) == "dot_general"

    dots = {}
    for name, policy in [("none", None), ("nothing", jax.checkpoint_policies.nothing_saveable),
                         ("dots", jax.checkpoint_policies.dots_saveable),
                         ("no_batch", jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
                         ("everything", jax.checkpoint_policies.everything_saveable), ("spy", spy)]:
        f = jax.checkpoint(lambda x, w: jnp.tanh(x @ w), policy=policy)
        step = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))
        gx, gw = step(x, w)
        np.testing.assert_allclose(np.asarray(gx), da @ w.T, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(np.asarray(gw), x.T @ da, rtol=1e-4, atol=1e-5, err_msg=name)
        dots[name] = sum(" = dot_general(" in line for line in step.as_text().splitlines())  # kernels
    # The forward dot, the two of its VJP, and (when not kept) the dot again.
    assert dots["none"] == dots["nothing"] == dots["dots"] + 1 == dots["no_batch"] + 1 == dots["spy"] + 1
    assert dots["everything"] == dots["dots"]
    assert ("dot_general", "dot_general", (((1,), (0,)), ((), ()))) in seen
    assert ("tanh", "tanh", None) in seen


def test_a_checkpoint_policy_that_raises_fails_the_trace_with_its_exception():
    def bad(prim, *_, **__):
        raise ValueError(f"no policy for {prim}")

    with pytest.raises(ValueError, match="no policy for"):
        jax.jit(jax.grad(lambda x: jnp.sum(jax.checkpoint(jnp.sin, policy=bad)(x))))(np.ones(4, np.float32))
    with pytest.raises(TypeError, match="policy must be callable"):
        jax.checkpoint(jnp.sin, policy="dots")


def test_grad_of_grad_is_the_second_derivative_also_through_a_checkpoint():
    # d/dx sum(d/dy sum(sin(y)) at x) = -sin(x); d/dx sum(3 x^2) = 6 x (worked by hand). It
    # had been 0: the outer grad stopped at the inner one's layout of its gradient.
    x = np.array([0.5, 1.0, -2.0], np.float32)
    g2 = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(lambda y: jnp.sum(jnp.sin(y)))(x))))(x)
    np.testing.assert_allclose(np.asarray(g2), -np.sin(x), rtol=1e-5)
    for policy in [None, jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.everything_saveable]:
        cube = jax.checkpoint(lambda y: jnp.sum(y * y * y), policy=policy)
        g2 = jax.jit(jax.grad(lambda x: jnp.sum(jax.grad(cube)(x))))(x)
        np.testing.assert_allclose(np.asarray(g2), 6 * x, rtol=1e-5)

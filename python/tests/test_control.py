# lax.scan and lax.fori_loop inside jit (the SDK's loops, python/tessera/lax.py), against numpy
# by their documented semantics (jax.lax.scan's Python-loop definition in its docstring), and
# grad through scan against the gradient worked out by hand.
import numpy as np

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

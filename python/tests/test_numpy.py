# tessera.numpy under jit on sharded inputs against numpy on the host. Dtype rules:
# https://docs.jax.dev/en/latest/type_promotion.html (Python scalars are weakly typed).
import numpy as np
import pytest

import tessera
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P

rng = np.random.default_rng(0)
X = rng.uniform(0.5, 2.0, (16, 8)).astype(np.float32)
Y = rng.uniform(-1.0, 1.0, (16, 8)).astype(np.float32)
V = rng.uniform(-1.0, 1.0, (8,)).astype(np.float32)


@pytest.fixture(scope="module")
def xy(mesh):
    return (tessera.device_put(X, NamedSharding(mesh, P("data", "model"))),
            tessera.device_put(Y, NamedSharding(mesh, P(None, "model"))),
            tessera.device_put(V, NamedSharding(mesh, P("model"))))


def close(a, b, tol=1e-5):
    a = np.asarray(a)
    assert a.shape == np.shape(b), (a.shape, np.shape(b))
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["exp", "log", "tanh", "sqrt", "sin", "cos", "abs", "negative", "floor", "ceil",
                                  "sign", "square"])
def test_unary(xy, name):
    close(tessera.jit(getattr(jnp, name))(xy[0]), getattr(np, name)(X))


def test_binary_broadcasting_and_operators(xy):
    x, y, v = xy
    f = tessera.jit(lambda x, y, v: (x + y * v, x - v[None, :], x / y, x ** 2, jnp.maximum(x, y),
                                     jnp.minimum(y, 0.0), 2.0 - x, 1 / x, -x, x @ y.T))
    got = f(x, y, v)
    want = (X + Y * V, X - V[None, :], X / Y, X ** 2, np.maximum(X, Y), np.minimum(Y, 0), 2 - X, 1 / X, -X, X @ Y.T)
    for g, w in zip(got, want):
        close(g, w, 1e-4)


def test_comparisons_where_and_logic(xy):
    x, y, _ = xy
    got = tessera.jit(lambda x, y: (x > 1.0, jnp.where(y > 0, x, y), (x > 1) & (y < 0), jnp.logical_not(y > 0)))(x, y)
    want = (X > 1, np.where(Y > 0, X, Y), (X > 1) & (Y < 0), ~(Y > 0))
    for g, w in zip(got, want):
        assert np.asarray(g).dtype == np.bool_ or w.dtype != np.bool_
        np.testing.assert_array_equal(np.asarray(g), w)


def test_reductions(xy):
    x = xy[0]
    f = tessera.jit(lambda x: (x.sum(), jnp.sum(x, axis=0), x.mean(axis=1, keepdims=True), jnp.max(x, axis=-1),
                               x.min(), jnp.prod(x[:2, :3]), jnp.argmax(x, axis=1), jnp.var(x, axis=0),
                               jnp.std(x)))
    want = (X.sum(), X.sum(0), X.mean(1, keepdims=True), X.max(-1), X.min(), np.prod(X[:2, :3]), X.argmax(1),
            X.var(0), X.std())
    for g, w in zip(f(x), want):
        close(g, w, 1e-4)
    assert np.asarray(f(x)[6]).dtype == np.int32


def test_shapes_and_indexing(xy):
    x, _, v = xy
    f = tessera.jit(lambda x, v: (x.reshape(8, -1), x.T, jnp.transpose(x.reshape(4, 4, 8), (2, 0, 1)),
                                  x[2:10, ::1], x[-4:, 1], x[None, 3, :2], x[..., 5], v[1:-1],
                                  jnp.concatenate([x, x[:4]], axis=0), jnp.stack([v, v], axis=1),
                                  jnp.expand_dims(v, 0), jnp.broadcast_to(v, (3, 8)), jnp.squeeze(x[:1])))
    want = (X.reshape(8, -1), X.T, np.transpose(X.reshape(4, 4, 8), (2, 0, 1)), X[2:10], X[-4:, 1], X[None, 3, :2],
            X[..., 5], V[1:-1], np.concatenate([X, X[:4]]), np.stack([V, V], 1), V[None], np.broadcast_to(V, (3, 8)),
            np.squeeze(X[:1]))
    for g, w in zip(f(x, v), want):
        close(g, w)
    close(tessera.jit(lambda x: x[::2])(x), X[::2])  # a gather of iota indices (test_indexing.py)


def test_weak_types_follow_jax():
    i = np.arange(8, dtype=np.int32)
    # [type_promotion]: int32 array * Python float is float32; + Python int stays int32;
    # int32 meeting float32 is float32; true division of integers is float32.
    f = tessera.jit(lambda i, x: (i * 0.5, i + 1, i + x, i / 2, (i > 3).sum(), jnp.mean(i)))
    got = f(i, np.ones(8, np.float32))
    assert [np.asarray(g).dtype for g in got] == [np.float32, np.int32, np.float32, np.float32, np.int32,
                                                  np.float32]
    np.testing.assert_array_equal(np.asarray(got[1]), i + 1)
    close(got[0], i * 0.5)
    assert int(got[4]) == 4


def test_creation_inside_and_outside_traces(xy):
    x = xy[0]
    got = tessera.jit(lambda x: (x + jnp.ones((16, 8)), jnp.zeros_like(x), jnp.arange(5) * 2, jnp.eye(3),
                                 jnp.full((2,), 7, jnp.int32)))(x)
    want = (X + 1, np.zeros_like(X), np.arange(5) * 2, np.eye(3), np.full(2, 7))
    for g, w in zip(got, want):
        close(g, w)
    # Outside a trace creation functions make uncommitted Arrays on device 0 (as JAX's), which
    # jit moves to the committed arguments' mesh.
    z = jnp.zeros((2, 3))
    assert isinstance(z, tessera.Array) and not z._committed and jnp.arange(4).dtype == np.int32
    assert z.devices() == {tessera.devices()[0]}


def test_eager_ops_on_arrays(xy):
    x, y, _ = xy
    z = x * 2 + y  # outside jit: each op a small jitted program on the devices
    assert isinstance(z, tessera.Array)
    close(z, X * 2 + Y)
    close(jnp.tanh(x), np.tanh(X))
    close(x[3:5, 1:], X[3:5, 1:])
    close(jnp.sum(x, axis=0), X.sum(0), 1e-4)
    assert float(x.sum()) == pytest.approx(float(X.sum()), rel=1e-5)


def test_nn_functions(xy):
    x = xy[0]
    got = tessera.jit(lambda x: (tessera.nn.relu(x - 1), tessera.nn.softmax(x), tessera.nn.logsumexp(x, axis=1),
                                 tessera.nn.one_hot(jnp.argmax(x, axis=1), 8)))(x)
    e = np.exp(X - X.max(1, keepdims=True))
    want = (np.maximum(X - 1, 0), e / e.sum(1, keepdims=True), np.log(np.exp(X).sum(1)),
            np.eye(8, dtype=np.float32)[X.argmax(1)])
    for g, w in zip(got, want):
        close(g, w, 1e-5)


def test_jit_static_values_differing_past_six_digits_compile_apart(xy):
    # static_argnums: each value is its own program (the compile key once confused constants
    # past 6 digits); an equal value reuses it.
    x = xy[0]
    traces = []

    def scale(a, s):
        traces.append(s)
        return a * s

    f = tessera.jit(scale, static_argnums=1)
    for s in (1.5, 1.5000001, 1.5):
        np.testing.assert_array_equal(np.asarray(f(x, s)), X * np.float32(s))
    assert traces == [1.5, 1.5000001]
    assert not np.array_equal(X * np.float32(1.5), X * np.float32(1.5000001))


def test_jit_options(mesh, xy):
    x = xy[0]
    # out_shardings, static_argnums, in_shardings (numpy argument placed by it), donation.
    f = tessera.jit(lambda x, n: x * n, static_argnums=1, out_shardings=NamedSharding(mesh, P(None, "model")))
    y = f(x, 3)
    assert y.sharding.spec == P(None, "model")
    close(y, X * 3)
    g = tessera.jit(lambda a, b: a + b, in_shardings=(NamedSharding(mesh, P("data", "model")),
                                                      NamedSharding(mesh, P("data", "model"))))
    close(g(x, Y), X + Y)
    with pytest.raises(ValueError, match="in_shardings|argument 0"):
        g(xy[1], xy[1])  # committed to P(None, 'model'): a mismatch is an error, as in JAX
    d = tessera.jit(lambda a: a + 1, donate_argnums=0)
    a = tessera.device_put(X, NamedSharding(mesh, P("data", None)))
    close(d(a), X + 1)
    with pytest.raises(Exception, match="donat"):
        np.asarray(a)


def test_pytrees_mixed_with_numpy(xy):
    x = xy[0]
    f = tessera.jit(lambda p, batch: {"out": p["w"] @ batch[0].T + p["b"], "n": [batch[1] * 2]})
    out = f({"w": x, "b": np.float32(1.5)}, (Y, V))
    close(out["out"], X @ Y.T + 1.5, 1e-4)
    close(out["n"][0], V * 2)


def test_pad_scans_triangles_einsum_stop_gradient(xy):
    # lax.pad with negative and interior padding, jnp.pad, the scans, tril/triu and einsum on
    # sharded inputs against numpy; grad through stop_gradient (only the other factor counts).
    from tessera import lax
    x, y, _ = xy
    got = tessera.jit(lambda x, y: (lax.pad(x, -1.0, [(2, -3, 1), (-1, 2, 0)]), jnp.pad(x, ((1, 2), (0, 3)), constant_values=5),
                                    jnp.cumsum(x, axis=1), lax.cumsum(x, 0, reverse=True), jnp.cumprod(x, axis=0),
                                    lax.cummax(y, 1), lax.cummin(y, 0), jnp.tril(x, 1), jnp.triu(x, -2),
                                    jnp.einsum("ij,kj->ki", x, y), jnp.cumsum(x)))(x, y)
    interior = np.full((31, 8), -1.0, np.float32)
    interior[::2] = X
    want_pad = np.concatenate([np.full((2, 8), -1.0, np.float32), interior[:-3]])[:, 1:]
    want_pad = np.concatenate([want_pad, np.full((want_pad.shape[0], 2), -1.0, np.float32)], axis=1)
    want = (want_pad, np.pad(X, ((1, 2), (0, 3)), constant_values=5), np.cumsum(X, 1), np.cumsum(X[::-1], 0)[::-1],
            np.cumprod(X, 0), np.maximum.accumulate(Y, 1), np.minimum.accumulate(Y, 0), np.tril(X, 1), np.triu(X, -2),
            np.einsum("ij,kj->ki", X, Y), np.cumsum(X))
    for g, w in zip(got, want):
        close(g, w, 1e-4)
    g = tessera.jit(tessera.grad(lambda x: jnp.sum(x * lax.stop_gradient(x))))(x)
    close(g, X)
    s, order, (values, indices) = tessera.jit(lambda y: (jnp.sort(y), jnp.argsort(y, axis=0), lax.top_k(y, 3)))(y)
    close(s, np.sort(Y, axis=-1))
    np.testing.assert_array_equal(np.asarray(order), np.argsort(Y, axis=0, kind="stable"))
    want_idx = np.argsort(-Y, axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(np.asarray(indices), want_idx)
    close(values, np.take_along_axis(Y, want_idx, -1))


def test_argmin_is_the_sdks(mesh):
    # jnp.argmin: the first index of the minimum, the first NaN for floats; integers at their
    # lowest value too (argmax of the negation overflowed there).
    x = np.array([[3.0, np.nan, -1.0, np.nan], [2.0, 0.5, 0.5, 9.0]], np.float32)
    i = np.array([[5, np.iinfo(np.int32).min, 7, np.iinfo(np.int32).min]], np.int32)
    got = tessera.jit(lambda x, i: (jnp.argmin(x, axis=1), jnp.argmin(i), x.argmin(axis=0, keepdims=True)))(x, i)
    np.testing.assert_array_equal(np.asarray(got[0]), [1, 1])
    assert int(got[1]) == 1
    np.testing.assert_array_equal(np.asarray(got[2]), [[1, 0, 0, 0]])


def test_and_or_invert_are_logical_on_bools_and_refused_on_integers():
    # jnp's &, | and ~ are bitwise (https://docs.jax.dev/en/latest/_autosummary/jax.numpy.bitwise_and.html): on
    # bools the logical ops; Tessera has no bitwise integer ops, so an integer operand must raise, never give a
    # logical answer (jnp.arange(8) & 1 is [0 1 0 1 ...] in JAX, not booleans).
    a = jnp.array(np.array([True, False, True]))
    b = jnp.array(np.array([True, True, False]))
    np.testing.assert_array_equal(np.asarray(a & b), [True, False, False])
    np.testing.assert_array_equal(np.asarray(a | b), [True, True, True])
    np.testing.assert_array_equal(np.asarray(~a), [False, True, False])
    np.testing.assert_array_equal(np.asarray(True & b), [True, True, False])
    for f in (lambda x: x & 1, lambda x: 1 | x, lambda x: ~x):
        with pytest.raises(TypeError, match="no bitwise integer ops"):
            f(jnp.arange(8))
    with pytest.raises(TypeError, match="no bitwise integer ops"):
        tessera.jit(lambda x: x & 1)(np.arange(8, dtype=np.int32))


def test_a_closed_over_0d_array_is_a_constant():
    # JAX embeds concrete arrays a traced function closes over; Tessera embeds 0-d ones (jnp.array(1e-5)).
    eps = jnp.array(0.5)
    got = tessera.jit(lambda x: x + eps)(np.ones(4, np.float32))
    np.testing.assert_allclose(np.asarray(got), np.full(4, 1.5, np.float32))

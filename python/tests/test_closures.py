# Arrays a jitted function closes over: JAX traces them as constants of the program (jaxpr
# constvars), their values the ones seen when it traced; here each becomes an extra argument of
# the jitted program (python/tessera/_api.py, Captures). Each result against numpy.
# References:
#   [FAQ] https://docs.jax.dev/en/latest/faq.html, "jit changes the behavior of my function":
#         the function runs in Python once, observes the global's first value, and the
#         compiled and cached program keeps it.
#   [SM]  jax/_src/shard_map.py: a shard_map body's closed-over values enter it as constants,
#         whole on every device (in_names {} for the consts, i.e. P()).
import numpy as np
import pytest

import tessera
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P


def test_a_jitted_function_reads_the_arrays_and_numpy_data_it_closes_over(mesh):
    w_host = np.arange(16.0, dtype=np.float32).reshape(4, 4)
    w = tessera.device_put(w_host, NamedSharding(mesh, P("data", None)))  # committed, split
    scale = np.full((4,), 3.0, np.float32)                              # numpy data
    bias = jnp.arange(4.0)                                               # uncommitted, device 0
    runs = []

    def f(a):
        runs.append(1)
        return (a @ w) * scale + bias + np.arange(4.0, dtype=np.float32)

    a_host = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    out = tessera.jit(f)(a_host)
    np.testing.assert_allclose(np.asarray(out), (a_host @ w_host) * 3.0 + 2 * np.arange(4.0), rtol=1e-6)
    # The uncommitted argument went where the committed capture is.
    assert out.sharding.mesh == mesh
    traced = len(runs)
    jf = tessera.jit(f)
    jf(a_host)
    n = len(runs)
    out2 = jf(a_host + 1)
    assert len(runs) == n, "a second call of the same signature traced again"
    np.testing.assert_allclose(np.asarray(out2), ((a_host + 1) @ w_host) * 3.0 + 2 * np.arange(4.0), rtol=1e-6)
    assert traced == 2, "one trace finds every closed-over array, one more uses them"


def test_a_function_of_no_arguments_may_close_over_arrays(mesh):
    x = jnp.arange(8.0)
    w = tessera.device_put(np.ones((4, 4), np.float32), NamedSharding(mesh, P("data", "model")))
    out = tessera.jit(lambda: w.sum() + x.sum())()
    assert float(out) == pytest.approx(16.0 + 28.0)
    with pytest.raises(ValueError, match="got no array argument and closes over none"):
        tessera.jit(lambda: 1.0)()


def test_grad_of_a_loss_closing_over_its_data(mesh):
    # The common form: the data are globals of the loss, the parameters its argument.
    rng = np.random.default_rng(0)
    xs_host = rng.standard_normal((8, 4)).astype(np.float32)
    ys_host = rng.standard_normal((8,)).astype(np.float32)
    xs = tessera.device_put(xs_host, NamedSharding(mesh, P("data", None)))
    ys = tessera.device_put(ys_host, NamedSharding(mesh, P("data")))
    loss = lambda w: jnp.mean((xs @ w - ys) ** 2)
    w_host = np.array([0.5, -1.0, 2.0, 0.25], np.float32)
    g = tessera.jit(tessera.grad(loss))(w_host)
    expected = 2.0 / 8 * xs_host.T @ (xs_host @ w_host - ys_host)
    np.testing.assert_allclose(np.asarray(g), expected, rtol=1e-5, atol=1e-6)


def test_the_cached_program_keeps_the_array_it_closed_over(mesh):
    # [FAQ]: rebinding the global after the first call is not seen by the cached program.
    global offset
    offset = jnp.ones(4)
    f = tessera.jit(lambda a: a + offset)
    np.testing.assert_array_equal(np.asarray(f(np.zeros(4, np.float32))), np.ones(4))
    offset = jnp.full(4, 5.0)
    np.testing.assert_array_equal(np.asarray(f(np.zeros(4, np.float32))), np.ones(4))
    # A new signature traces again, and sees the global as it is then.
    np.testing.assert_array_equal(np.asarray(f(np.zeros(4, np.int32))), np.full(4, 5.0))
    # ... and the first signature's program still keeps the first.
    np.testing.assert_array_equal(np.asarray(f(np.zeros(4, np.float32))), np.ones(4))


def test_a_function_that_makes_new_arrays_at_every_trace_is_refused_naming_the_rule(mesh):
    f = tessera.jit(lambda a: a + tessera.device_put(np.ones(4, np.float32), NamedSharding(mesh, P())))
    with pytest.raises(ValueError, match="closed over new arrays each of the 4 times it was traced"):
        f(np.zeros(4, np.float32))


def test_outside_jit_a_closed_over_array_is_still_an_error_naming_the_way_out(mesh):
    x = jnp.arange(4.0)
    with pytest.raises(TypeError, match="trace under tessera.jit, which captures the arrays"):
        tessera.make_jaxpr(lambda a: a + x)(np.zeros(4, np.float32))


def test_a_shard_map_body_reads_closed_over_arrays_whole_on_every_device(mesh):
    # The shard_map notebook's cell (docs/notebooks/shard_map.md, JAX cec06d1): with an Auto
    # (4, 2) mesh set, `shard_map(lambda: x, in_specs=(), out_specs=P('i', 'j'))()` "prints the
    # same as jnp.tile(x, (4, 2))", P('i', None) as tile (4, 1), P(None, None) as x.
    auto_mesh = tessera.make_mesh((4, 2), ("i", "j"), axis_types=tessera.sharding.AxisType.Auto)
    with tessera.set_mesh(auto_mesh):
        x = jnp.array([[3.0]])
        for spec, reps in [(P("i", "j"), (4, 2)), (P("i", None), (4, 1)), (P(None, None), (1, 1))]:
            z = tessera.shard_map(lambda: x, in_specs=(), out_specs=spec)()
            np.testing.assert_array_equal(np.asarray(z), np.tile([[3.0]], reps))
    # With arguments too, eagerly and under jit: each block plus the whole closed-over vector.
    w = jnp.arange(2.0)
    y_host = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    y = tessera.device_put(y_host, NamedSharding(mesh, P("data", None)))
    f = tessera.shard_map(lambda b: b + w, mesh=mesh, in_specs=P("data", None), out_specs=P("data", None))
    np.testing.assert_array_equal(np.asarray(f(y)), y_host + np.arange(2.0))
    np.testing.assert_array_equal(np.asarray(tessera.jit(f)(y)), y_host + np.arange(2.0))
    # A traced value of the enclosing jit, closed over by the body, enters whole too.
    g = tessera.jit(lambda a: tessera.shard_map(lambda b: b * a[0], mesh=mesh, in_specs=P("data", None),
                                                out_specs=P("data", None))(a))
    np.testing.assert_array_equal(np.asarray(g(y)), y_host * y_host[0])


def test_a_jit_called_inside_another_is_inlined_even_without_array_arguments(mesh):
    # JAX inlines a nested jit; here one of no arguments, closing over an array, and one that
    # only creates arrays, are traced into the outer program (not run during its trace).
    w = jnp.ones(3)
    g = tessera.jit(lambda: w * 2)
    zeros = tessera.jit(lambda: jnp.zeros(3))
    out = tessera.jit(lambda x: x + g() + zeros())(np.arange(3.0, dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(out), np.arange(3.0) + 2)


def _bytes_put():
    """Shard bytes clients have put on the workers, in all (Device.memory_stats)."""
    return sum(d.memory_stats()["bytes_put"] for d in tessera.devices())


def test_numpy_data_closed_over_is_put_on_the_devices_once(mesh):
    # Captures.placed: a call again with the same closed-over numpy data puts nothing on the
    # devices (the jit's argument is committed, so the capture goes onto its mesh replicated,
    # once); data the function closes over for the first time is put and used [FAQ].
    big = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    tables = {"a": big, "b": big * 2 + 1}
    x = tessera.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("data", None)))
    f = tessera.jit(lambda a, name: a + tables[name], static_argnums=1)
    np.testing.assert_array_equal(np.asarray(f(x, "a")), 1 + big)
    before = _bytes_put()
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(x, "a")), 1 + big)
    assert _bytes_put() == before, "the closed-over data was put on the devices again"
    # Its move from device 0 onto the mesh runs between the workers, which no counter sees:
    # the placed Array must be the one of the first call.
    entry = f._cache[next(k for k in f._cache if k[1] == ("a",))]
    placed = entry[2].placed[0]
    f(x, "a")
    assert entry[2].placed[0] is placed, "the capture was placed again"
    # Other data (another static argument: another trace) is put, and gives its own result.
    np.testing.assert_array_equal(np.asarray(f(x, "b")), 1 + tables["b"])
    assert _bytes_put() >= before + tables["b"].nbytes
    after = _bytes_put()
    np.testing.assert_array_equal(np.asarray(f(x, "b")), 1 + tables["b"])
    np.testing.assert_array_equal(np.asarray(f(x, "a")), 1 + big)
    assert _bytes_put() == after


def test_numpy_data_closed_over_is_captured_by_its_whole_type_and_content():
    # Captures._key: numpy data is one capture per (dtype, shape, content): arrays that differ
    # anywhere are two, equal data in two objects is one. (A 0-d array is no capture: it enters
    # the program as a scalar constant; its result keeps shape (), the vector's (1,).)
    s = np.array(3.0, np.float32)
    v = np.array([3.0], np.float32)
    u = np.arange(16.0, dtype=np.float32)
    w = u.copy()
    w[-1] = -1.0
    same = u.copy()
    f = tessera.jit(lambda a: (a[0] + s, a[0] + v, a + u - w, a + u + same))
    a = np.ones(16, np.float32)
    outs = [np.asarray(o) for o in f(a)]
    for out, want in zip(outs, [a[0] + s, a[0] + v, a + u - w, a + u + same]):
        assert out.shape == want.shape
        np.testing.assert_array_equal(out, want)
    assert len(next(iter(f._cache.values()))[2].arrays) == 3  # v, u (== same), w

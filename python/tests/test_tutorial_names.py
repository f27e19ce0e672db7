# The jnp / lax / tree_util names and behaviours that JAX's sharding tutorials use and that
# python/tools/tutorial_cells.py found missing (docs/guide.md, "JAX's tutorials, cell by
# cell"): each against numpy, or against what JAX documents (cited).
import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P, AxisType


def test_all_any_isclose_allclose_match_numpy(mesh):
    x = np.array([[1.0, np.inf, np.nan, -np.inf], [0.0, 1e-9, 2.0, 3.0]], np.float32)
    y = np.array([[1.0 + 1e-6, np.inf, np.nan, np.inf], [1e-9, 0.0, 2.0001, 3.0]], np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "model")))
    for equal_nan in (False, True):
        got = np.asarray(jnp.isclose(xs, y, equal_nan=equal_nan))
        assert got.tolist() == np.isclose(x, y, equal_nan=equal_nan).tolist()
    assert bool(jnp.allclose(x[1], y[1], atol=1e-3)) == np.allclose(x[1], y[1], atol=1e-3) is True
    assert bool(jnp.allclose(x[1], y[1])) == np.allclose(x[1], y[1]) is False
    b = np.array([[True, False, True], [True, True, True]])
    for axis in (None, 0, 1):
        assert np.asarray(jnp.all(b, axis=axis)).tolist() == np.all(b, axis=axis).tolist()
        assert np.asarray(jnp.any(b, axis=axis)).tolist() == np.any(b, axis=axis).tolist()
    assert bool(jnp.all(np.zeros((0,), np.float32))) is True and bool(jnp.any(np.zeros((0,), np.float32))) is False
    assert np.asarray(jnp.any(np.array([0, 0, 3]), keepdims=True)).shape == (1,)
    assert np.asarray(jnp.isnan(x)).tolist() == np.isnan(x).tolist()
    assert np.asarray(jnp.isinf(x)).tolist() == np.isinf(x).tolist()
    assert np.asarray(jnp.isfinite(x)).tolist() == np.isfinite(x).tolist()
    # Integers compare exactly.
    assert np.asarray(jnp.isclose(np.arange(4), np.array([0, 1, 3, 3]))).tolist() == [True, True, False, True]


def test_tree_all_over_allclose():
    # shard_map notebook's helper: tree_all(tree_map(partial(jnp.allclose, ...), a, b)).
    from functools import partial
    from tessera.tree_util import tree_all, tree_map, tree_reduce
    a = {"w": np.ones((2, 2), np.float32), "b": [np.zeros(3, np.float32)]}
    b = {"w": np.ones((2, 2), np.float32) + 1e-3, "b": [np.zeros(3, np.float32)]}
    assert tree_all(tree_map(partial(jnp.allclose, atol=1e-2, rtol=1e-2), a, b)) is True
    assert tree_all(tree_map(partial(jnp.allclose, atol=1e-5, rtol=1e-5), a, b)) is False
    assert tree_reduce(lambda x, y: x + y, [1, (2, 3)]) == 6


def test_split_array_split_tile_roll_copy_match_numpy(mesh):
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    for got, want in [(jnp.split(xs, 2), np.split(x, 2)), (jnp.split(xs, 3, axis=1), np.split(x, 3, axis=1)),
                      (jnp.split(x, [1, 3], axis=1), np.split(x, [1, 3], axis=1)),
                      (jnp.split(x, [-2, 5, 2]), np.split(x, [-2, 5, 2])),
                      (jnp.array_split(x, 4, axis=1), np.array_split(x, 4, axis=1))]:
        assert [np.asarray(g).tolist() for g in got] == [w.tolist() for w in want]
    with pytest.raises(ValueError, match="equal division"):
        jnp.split(x, 5, axis=1)
    for reps in (2, (2, 1), (1, 3), (2, 1, 2)):
        assert np.asarray(jnp.tile(xs, reps)).tolist() == np.tile(x, reps).tolist(), reps
    assert np.asarray(jnp.tile(np.arange(3), (2, 2))).tolist() == np.tile(np.arange(3), (2, 2)).tolist()
    for shift, axis in [(1, None), (-7, None), (2, 1), (5, 0), ((1, -2), (0, 1)), (3, (0, 1))]:
        assert np.asarray(jnp.roll(xs, shift, axis)).tolist() == np.roll(x, shift, axis).tolist(), (shift, axis)
    c = jnp.copy(xs)
    assert c is not xs and c.sharding == xs.sharding and np.asarray(c).tolist() == x.tolist()
    assert np.asarray(xs.copy()).tolist() == x.tolist()
    # Inside jit too.
    f = jax.jit(lambda v: (jnp.roll(v, 1, 0), jnp.tile(v, (1, 2)), jnp.split(v, 2, axis=1)[1]))
    r, t, s = f(xs)
    assert np.asarray(r).tolist() == np.roll(x, 1, 0).tolist()
    assert np.asarray(t).tolist() == np.tile(x, (1, 2)).tolist()
    assert np.asarray(s).tolist() == np.split(x, 2, axis=1)[1].tolist()


def test_dot_takes_out_sharding(mesh):
    # shard_map notebook: jnp.dot(a, b, out_sharding=P('x', None)) under jax.set_mesh(mesh), its
    # mesh made by jax.make_mesh (Explicit axes in JAX >= 0.9). On Auto axes out_sharding is
    # refused, as JAX's canonicalize_sharding refuses it, under dot_general's name (jnp.dot hands
    # out_sharding to lax.dot_general, which canonicalizes it: jax/_src/lax/lax.py).
    a = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    b = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    with jax.set_mesh(mesh):
        A = jax.device_put(a, P("data", "model"))
        B = jax.device_put(b, P("model", None))
        with pytest.raises(ValueError, match="PartitionSpec passed to dot_general cannot contain axis names"):
            jnp.dot(A, B, out_sharding=P("data", None))
        assert np.allclose(np.asarray(jnp.dot(A, B, preferred_element_type=np.float32)), a @ b)
    mesh = jax.make_mesh(mesh.axis_sizes, mesh.axis_names, axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        A = jax.device_put(a, P("data", "model"))
        B = jax.device_put(b, P("model", None))
        c = jnp.dot(A, B, out_sharding=P("data", None))
        assert c.sharding.spec == P("data", None)
        assert np.allclose(np.asarray(c), a @ b)


def test_typeof_prints_as_jax_and_has_the_type_sharding():
    # JAX's explicit-sharding notebook prints f"{jax.typeof(x)}" as "int32[4@X,2]" and repr as
    # "ShapedArray(int32[4@X,2])" (jax/_src/core.py ShapedArray.__str__ / __repr__: full dtype
    # names); a numpy int64 array's type is int32[8] without jax_enable_x64.
    mesh = jax.make_mesh((2, 4), ("X", "Y"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    a = jax.device_put(np.arange(8).reshape(4, 2), NamedSharding(mesh, P("X", None)))
    assert str(jax.typeof(a)) == "int32[4@X,2]" and repr(jax.typeof(a)) == "ShapedArray(int32[4@X,2])"
    assert jax.typeof(a).sharding.spec == P("X", None)
    b = jax.device_put(np.zeros((8, 4), np.float32), NamedSharding(mesh, P(("X", "Y"), None)))
    assert str(jax.typeof(b)) == "float32[8@(X,Y),4]" and jax.typeof(b).sharding.spec == P(("X", "Y"), None)
    assert str(jax.typeof(np.arange(8))) == "int32[8]"
    assert jax.typeof(np.arange(8)).sharding.spec == P(None)


def test_shard_map_takes_the_mesh_set_when_called(mesh, mesh8):
    # JAX resolves a mesh-less shard_map's mesh when it is called (shard_map notebook's
    # pipeline section defines loss_pp, then sets its mesh).
    f = jax.shard_map(lambda x: jax.lax.psum(x.sum(), "x"), in_specs=P("x"), out_specs=P())
    x = np.arange(16, dtype=np.float32)
    with jax.set_mesh(mesh8):
        assert float(f(jax.device_put(x, P("x")))) == x.sum()
    with pytest.raises(TypeError, match="ambient mesh"):
        f(x)


def test_an_error_in_a_shard_map_body_inside_jit_is_raised_as_is(mesh8):
    def body(x):
        return jax.lax.psum(jnp.no_such_function(x), "x")

    f = jax.jit(jax.shard_map(body, mesh=mesh8, in_specs=P("x"), out_specs=P()))
    with pytest.raises(AttributeError, match="no_such_function"):
        f(jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh8, P("x"))))


def test_remat_with_a_policy_and_inside_shard_map_keeps_values_and_gradients(mesh8):
    # shard_map notebook's FSDP: jax.remat(policy=...) around all_gathers inside a shard_map.
    from functools import partial

    def predict(w, x):
        return jnp.tanh(x @ jax.lax.all_gather(w, "x", tiled=True))

    def loss_with(pred):
        return jax.shard_map(lambda w, x: jax.lax.pmean(jnp.sum(pred(w, x) ** 2), "x"), mesh=mesh8,
                             in_specs=(P("x"), P("x")), out_specs=P())

    w = np.linspace(-1, 1, 8 * 3, dtype=np.float32).reshape(8, 3)
    x = np.linspace(0, 1, 16 * 8, dtype=np.float32).reshape(16, 8)
    ws = jax.device_put(w, NamedSharding(mesh8, P("x")))
    xs = jax.device_put(x, NamedSharding(mesh8, P("x")))
    remat = partial(jax.remat, policy=lambda op, *_, **__: str(op) != "all_gather")(predict)
    plain_l, plain_g = jax.jit(jax.value_and_grad(loss_with(predict)))(ws, xs)
    l, g = jax.jit(jax.value_and_grad(loss_with(remat)))(ws, xs)
    # numpy: mean over the 8 blocks of sum(tanh(x_blk @ w)^2), and its gradient in w.
    h = np.tanh(x.astype(np.float64) @ w)
    want_l = (h ** 2).sum() / 8
    want_g = x.T.astype(np.float64) @ (2 * h * (1 - h ** 2)) / 8
    assert np.allclose(float(l), want_l, rtol=1e-5) and float(l) == float(plain_l)
    assert np.allclose(np.asarray(g), want_g, rtol=1e-4, atol=1e-5)
    assert np.asarray(g).tolist() == np.asarray(plain_g).tolist()
    # Outside shard_map, a policy is accepted too (jit of remat as before).
    assert np.allclose(np.asarray(jax.jit(partial(jax.remat, policy=None)(lambda v: v * 2))(w)), w * 2)


def test_creation_functions_make_uncommitted_arrays_that_jit_and_shard_map_move(mesh8):
    # sharded-computation tutorial: jnp.arange(32.0).reshape(4, 8) is an Array on device 0
    # (arr.devices(), arr.sharding); shard_map notebook's check_shmap: jnp.concatenate of
    # blocks of a jnp array compared (jit) with a shard_map result on a mesh. An uncommitted
    # array moves to the committed arguments' mesh; a committed one on another mesh does not.
    arr = jnp.arange(32.0).reshape(4, 8)
    assert isinstance(arr, jax.Array) and arr.devices() == {jax.devices()[0]}
    assert not arr._committed and arr.sharding.spec == P(None, None)
    y = jax.device_put(np.arange(32.0, dtype=np.float32), NamedSharding(mesh8, P("x")))
    assert y._committed
    out = jax.jit(lambda a, b: a + b)(y, jnp.ones(32))
    assert out._committed and out.sharding.mesh == mesh8
    assert np.asarray(out).tolist() == (np.arange(32.0) + 1).tolist()
    blocks = jnp.concatenate(jnp.split(jnp.arange(32.0), 4))
    assert not blocks._committed
    assert bool(jnp.allclose(y, blocks))
    sm = jax.shard_map(lambda b: b * 2, mesh=mesh8, in_specs=P("x"), out_specs=P("x"))(jnp.arange(8.0))
    assert sm.sharding.spec == P("x") and np.asarray(sm).tolist() == (np.arange(8.0) * 2).tolist()
    # device_put commits; numpy functions take Arrays as arrays, and ndarray + Array is an Array.
    assert jax.device_put(arr)._committed is False and jax.device_put(arr, jax.devices()[0])._committed
    assert isinstance(np.sin(arr), np.ndarray) and isinstance(np.ones((4, 8)) + arr, jax.Array)
    other = jax.make_mesh((2,), ("x",), devices=jax.devices()[2:4])
    z = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(other, P("x")))
    with pytest.raises(ValueError, match="every argument must be on one mesh"):
        jax.jit(lambda a, b: a + b)(y[:8], z)


def test_partition_spec_entries_are_canonical_as_jaxs():
    # jaxlib/partition_spec.cc CanonicalizePartition: a list is a tuple, one of one axis is that
    # axis, an empty one is None; a nested tuple is a ValueError (JAX's tests/shard_map_test.py
    # test_pbroadcast passes P(['y'], None)).
    assert P(['y'], None) == P('y', None) == P(('y',), None)
    assert P(['x', 'y']) == P(('x', 'y'))
    assert P((), []) == P(None, None)
    assert repr(P(['y'], None)) == "P('y', None)"
    with pytest.raises(ValueError, match="cannot contain a nested tuple"):
        P((('x', 'y'), 'z'))
    with pytest.raises(TypeError, match="not 3"):
        P(3)
    mesh = jax.make_mesh((4, 2), ('x', 'y'))
    a = jax.device_put(np.arange(8.0).reshape(4, 2), NamedSharding(mesh, P(['x'], None)))
    assert a.sharding.spec == P('x', None)

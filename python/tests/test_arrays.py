# Placement, shards and errors against what JAX documents. References:
#   [DA] https://docs.jax.dev/en/latest/notebooks/Distributed_arrays_and_automatic_parallelization.html
#   [SC] https://docs.jax.dev/en/latest/sharded-computation.html
#   [TP] https://docs.jax.dev/en/latest/type_promotion.html
import os
import subprocess
import sys

import numpy as np
import pytest

import tessera
import tessera.numpy as jnp
from tessera.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from conftest import SOURCE_DIR


def test_seed_program_prints_jax_lines():
    env = dict(os.environ)
    out = subprocess.run([sys.executable, os.path.join(SOURCE_DIR, "examples", "python", "seed.py")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "(16, 4)\nP('data', 'model')\n8 (4, 2)\n"


def test_devices_and_mesh():
    mesh = tessera.make_mesh((4, 2), ("data", "model"))
    devs = tessera.devices()
    assert [d.id for d in devs] == list(range(8))
    assert tessera.device_count() == 8
    # [DA]: make_mesh lays the devices row-major: mesh.devices is a (4, 2) array of them.
    assert mesh.shape == {"data": 4, "model": 2}
    assert mesh.axis_names == ("data", "model")
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # make_mesh's axes are Explicit (JAX >= 0.9, tests/array_test.py test_make_mesh_axis_types),
    # Mesh's Auto: the same devices and names are another mesh unless the types agree.
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert mesh == Mesh(np.array(devs).reshape(4, 2), ("data", "model"), AxisType.Explicit)
    assert mesh != Mesh(np.array(devs).reshape(4, 2), ("data", "model"))
    assert repr(P("data", None)) == "P('data', None)"
    assert P(("data", "model")) == (("data", "model"),)


def test_device_put_shards_follow_named_sharding(mesh):
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    # [DA]: under P('data', 'model') on a (4, 2) mesh each device holds a (4, 4) block, the
    # device at mesh position (i, j) rows 4i:4i+4 and columns 4j:4j+4.
    a = tessera.device_put(x, NamedSharding(mesh, P("data", "model")))
    assert a.shape == (16, 8) and a.dtype == np.float32
    assert a.sharding == NamedSharding(mesh, P("data", "model"))
    shards = a.addressable_shards
    assert len(shards) == 8
    for s in shards:
        i, j = divmod(s.device.id, 2)
        assert s.index == (slice(4 * i, 4 * i + 4), slice(4 * j, 4 * j + 4))
        assert s.replica_id == 0
        np.testing.assert_array_equal(s.data, x[s.index])
    np.testing.assert_array_equal(np.asarray(a), x)
    # [DA]: P('data', None) replicates each row block over 'model': replica ids 0, 1.
    b = tessera.device_put(x, NamedSharding(mesh, P("data")))
    assert [s.replica_id for s in b.addressable_shards] == [0, 1] * 4
    assert [s.index[0] for s in b.addressable_shards][:2] == [slice(0, 4), slice(0, 4)]
    assert b.sharding.shard_shape(b.shape) == (4, 8)
    np.testing.assert_array_equal(np.asarray(b), x)


def test_visualize_array_sharding(mesh, capsys):
    a = tessera.device_put(np.zeros((16, 8), np.float32), NamedSharding(mesh, P("data", None)))
    tessera.debug.visualize_array_sharding(a)
    out = capsys.readouterr().out
    # [DA]: one tile per row block, labelled with the two devices holding it.
    for label in ("CPU 0,1", "CPU 2,3", "CPU 4,5", "CPU 6,7"):
        assert label in out


def test_dtypes_round_trip_and_x64_canonicalization(mesh):
    s = NamedSharding(mesh, P())
    for dt in (np.float32, np.int32, np.bool_):
        x = (np.arange(12).reshape(3, 4) % 3).astype(dt)
        a = tessera.device_put(x, s)
        assert a.dtype == dt
        np.testing.assert_array_equal(np.asarray(a), x)
    # [TP]: with jax_enable_x64 off (the default), 64-bit inputs become 32-bit arrays.
    assert tessera.device_put(np.ones(4, np.float64), s).dtype == np.float32
    assert tessera.device_put(np.arange(4), s).dtype == np.int32
    assert jnp.ones((2, 2)).dtype == np.float32
    # Scalars stay 0-d (jnp.sqrt(2) is an f32[] array in JAX); np.ascontiguousarray had made them 1-d.
    assert tessera.device_put(np.float32(2.5), s).shape == ()
    assert jnp.sqrt(2).shape == ()
    assert float(np.asarray(tessera.jit(lambda v: v + 1)(np.int32(3)))) == 4


def test_device_put_reshards_an_array(mesh):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    a = tessera.device_put(x, NamedSharding(mesh, P("data", None)))
    b = tessera.device_put(a, NamedSharding(mesh, P(None, "model")))
    assert b.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(np.asarray(b), x)
    # A pytree with one sharding for every leaf.
    tree = tessera.device_put({"w": x, "b": [x[0], x[1]]}, NamedSharding(mesh, P()))
    np.testing.assert_array_equal(np.asarray(tree["b"][1]), x[1])


def test_errors_raise_python_exceptions_with_codes(mesh):
    with pytest.raises(ValueError) as e:
        tessera.device_put(np.ones((10, 8), np.float32), NamedSharding(mesh, P("data")))
    assert e.value.code == "INVALID_ARGUMENT"
    assert "divisible" in str(e.value)
    with pytest.raises(ValueError) as e:
        tessera.device_put(np.ones((8, 8), np.float32), NamedSharding(mesh, P("nope")))
    assert "nope" in str(e.value)
    with pytest.raises(ValueError) as e:  # a trace error names the op and shapes
        tessera.jit(lambda a, b: a @ b)(np.ones((4, 3), np.float32), np.ones((4, 3), np.float32))
    assert e.value.code == "INVALID_ARGUMENT"
    # A Python error inside the traced function comes out as itself.
    def bad(x):
        raise KeyError("inside the trace")
    with pytest.raises(KeyError, match="inside the trace"):
        tessera.jit(bad)(np.ones(4, np.float32))
    # JAX's "too late": the cluster is in use; changing it is an error, not ignored.
    with pytest.raises(RuntimeError) as e:
        tessera.config.update("jax_num_cpu_devices", 4)
    assert e.value.code == "FAILED_PRECONDITION" and "too late" in str(e.value)
    tessera.config.update("jax_num_cpu_devices", 8)  # the same value is fine
    with pytest.raises(AttributeError):
        tessera.config.update("jax_no_such_option", 1)
    # Tracers have no concrete value.
    with pytest.raises(TypeError, match="not known while tracing"):
        tessera.jit(lambda x: x if x.sum() > 0 else -x)(np.ones(4, np.float32))


def test_an_array_is_fetched_once_and_its_host_copy_is_read_only(mesh):
    # jax.Array is immutable and np.asarray of one is read-only (JAX's Array.__array__ returns
    # a non-writeable view of its host copy): fetching twice gives the same values without a
    # second transfer, and donating the Array drops the copy (a fetch then fails as the SDK says).
    X = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = tessera.device_put(X, NamedSharding(mesh, P("data", "model")))
    first = np.asarray(x)
    np.testing.assert_array_equal(first, X)
    assert np.asarray(x) is first  # the cached copy, not a second fetch
    assert not first.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        first[0, 0] = 1.0
    copied = np.array(x)  # np.array copies, writeable, as numpy's copy=True
    copied[0, 0] = -1.0
    assert np.asarray(x)[0, 0] == 0.0 and str(x).startswith("[[ 0.  1.")
    tessera.jit(lambda a: a * 2, donate_argnums=0)(x)
    with pytest.raises(Exception, match="donat"):
        np.asarray(x)


def test_zeros_like_keeps_a_committed_arrays_sharding(mesh):
    # lax.full_like (jax/_src/lax/lax.py): "If not specified, the output will have the same
    # sharding as the input ... If x is weakly typed or uncommitted, will use default sharding."
    x = tessera.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data", "model")))
    z = jnp.zeros_like(x)
    assert z.sharding == x.sharding and z._committed
    np.testing.assert_array_equal(np.asarray(z), np.zeros((8, 4), np.float32))
    o = jnp.full_like(x, 3, dtype=np.int32)
    assert o.sharding == x.sharding and o.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(o), np.full((8, 4), 3, np.int32))
    u = jnp.zeros_like(jnp.ones((8, 4)))  # uncommitted: the default placement
    assert not u._committed and len(u.sharding.mesh.devices.flat) == 1


def test_eager_integer_indexing_runs_one_program_for_every_index(mesh):
    from tessera import _api
    X = np.arange(40, dtype=np.float32).reshape(8, 5)
    x = tessera.device_put(X, NamedSharding(mesh, P("data")))
    _api._eager_cache.pop(jnp._int_index, None)
    np.testing.assert_array_equal(np.asarray(x[0]), X[0])
    j = _api._eager_cache[jnp._int_index]
    sdk_jitted = next(iter(j._cache.values()))[0].__self__
    # Jitted::compilations: the coordinator's count when this function last compiled a
    # signature; it stays put while the calls hit the compiled program.
    compiled_at = sdk_jitted.compilations()
    for i in (3, 7, -1, -8):
        np.testing.assert_array_equal(np.asarray(x[i]), X[i])
    assert len(j._cache) == 1  # x[0], x[3], x[7], x[-1], x[-8]: one traced program ...
    assert sdk_jitted.compilations() == compiled_at  # ... compiled once
    np.testing.assert_array_equal(np.asarray(x[2, 1:4]), X[2, 1:4])
    np.testing.assert_array_equal(np.asarray(x[None, 5, ..., 2]), X[None, 5, ..., 2])
    with pytest.raises(IndexError, match="index 8 is out of bounds for axis 0 with size 8"):
        x[8]

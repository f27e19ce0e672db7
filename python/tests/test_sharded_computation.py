# The code cells of JAX's "Introduction to parallel programming" tutorial ([SC]), nearly
# verbatim (imports changed; jax.random replaced by numpy), with the shardings and values the
# tutorial shows. [SC] https://docs.jax.dev/en/latest/sharded-computation.html
import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import PartitionSpec as P


def test_automatic_parallelism_cells(capsys):
  arr = jnp.arange(32.0).reshape(4, 8)
  mesh = jax.make_mesh((2, 4), ('x', 'y'))
  sharding = jax.sharding.NamedSharding(mesh, P('x', 'y'))
  arr_sharded = jax.device_put(arr, sharding)
  print(arr_sharded)
  jax.debug.visualize_array_sharding(arr_sharded)
  out = capsys.readouterr().out
  assert "CPU 0" in out and "CPU 7" in out

  @jax.jit
  def f_elementwise(x):
    return 2 * jnp.sin(x) + 1

  result = f_elementwise(arr_sharded)
  np.testing.assert_allclose(np.asarray(result), 2 * np.sin(arr) + 1, rtol=1e-5, atol=1e-6)
  # [SC]: "the result has the same sharding as the input".
  assert result.sharding == sharding

  @jax.jit
  def f_contract(x):
    return x.sum(axis=0)

  result = f_contract(arr_sharded)
  np.testing.assert_allclose(np.asarray(result), arr.sum(0))
  # [SC]: the result is sharded over 'y' (and replicated over 'x'): P('y',).
  assert result.sharding.spec == P('y')


def test_sharding_constraint_cell():
  mesh = jax.make_mesh((2, 4), ('x', 'y'))
  sharding_a = jax.sharding.NamedSharding(mesh, P('x', 'y'))
  sharding_b = jax.sharding.NamedSharding(mesh, P(None, 'x'))
  x = jax.device_put(jnp.arange(32.0).reshape(4, 8), sharding_a)

  @jax.jit
  def f(x):
    x = x + 1
    y = jax.lax.with_sharding_constraint(x, sharding_b)
    return y

  y = f(x)
  assert y.sharding == sharding_b
  np.testing.assert_array_equal(np.asarray(y), np.arange(32.0).reshape(4, 8) + 1)


def test_explicit_sharding_cells(capsys):
  mesh = jax.make_mesh((8,), ('x',))

  @jax.jit
  def f_elementwise(x):
    return 2 * jnp.sin(x) + 1

  f_elementwise_sharded = jax.shard_map(
      f_elementwise,
      mesh=mesh,
      in_specs=P('x'),
      out_specs=P('x'))

  arr = jnp.arange(32)
  np.testing.assert_allclose(np.asarray(f_elementwise_sharded(arr)), 2 * np.sin(arr) + 1, rtol=1e-5, atol=1e-6)

  x = jnp.arange(32)
  print(f"global shape: {x.shape=}")

  def f(x):
    print(f"device local shape: {x.shape=}")
    return x * 2

  y = jax.shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P('x'))(x)
  print(f"global shape: {y.shape=}")
  out = capsys.readouterr().out
  assert out == "global shape: x.shape=(32,)\ndevice local shape: x.shape=(4,)\nglobal shape: y.shape=(32,)\n"
  np.testing.assert_array_equal(np.asarray(y), x * 2)

  def f(x):
    sum_in_shard = x.sum()
    return jax.lax.psum(sum_in_shard, 'x')

  y = jax.shard_map(f, mesh=mesh, in_specs=P('x'), out_specs=P())(x)
  # [SC]: Array(496, dtype=int32)
  assert y.shape == () and y.dtype == np.int32 and int(y) == 496


def test_layer_cells():
  @jax.jit
  def layer(x, weights, bias):
    return jax.nn.sigmoid(x @ weights + bias)

  rng = np.random.default_rng(0)
  x = rng.normal(size=(32,)).astype(np.float32)
  weights = rng.normal(size=(32, 4)).astype(np.float32)
  bias = rng.normal(size=(4,)).astype(np.float32)
  want = 1 / (1 + np.exp(-(x @ weights + bias)))
  np.testing.assert_allclose(np.asarray(layer(x, weights, bias)), want, rtol=1e-5)

  mesh = jax.make_mesh((8,), ('x',))
  x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, P('x')))
  weights_sharded = jax.device_put(weights, jax.sharding.NamedSharding(mesh, P()))
  np.testing.assert_allclose(np.asarray(layer(x_sharded, weights_sharded, bias)), want, rtol=1e-5)

  @jax.jit
  def layer_sharded(x, weights, bias):
    return jax.shard_map(layer_block, mesh=mesh, in_specs=(P('x'), P('x', None), P()), out_specs=P())(
        x, weights, bias)

  def layer_block(x, weights, bias):
    return jax.nn.sigmoid(jax.lax.psum(x @ weights, 'x') + bias)

  weights_sharded = jax.device_put(weights, jax.sharding.NamedSharding(mesh, P('x', None)))
  np.testing.assert_allclose(np.asarray(layer_sharded(x_sharded, weights_sharded, bias)), want, rtol=1e-5)


def test_set_mesh_is_the_ambient_mesh_of_bare_specs(mesh, mesh8):
    # jax.set_mesh as JAX's explicit-sharding guide uses it: bare P's in device_put,
    # with_sharding_constraint and a mesh-less shard_map resolve against the ambient mesh; a jit
    # traced under one mesh is traced again under another (jax.jit's cache keys on it).
    from tessera.sharding import Mesh, NamedSharding, get_abstract_mesh
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    f = jax.jit(lambda a: jax.lax.with_sharding_constraint(a * 2, P("data")))
    # Unset, JAX's get_abstract_mesh() is the empty AbstractMesh (tests/pjit_test.py test_set_mesh_none).
    assert get_abstract_mesh().empty and repr(get_abstract_mesh()) == "AbstractMesh((), axis_types=())"
    with jax.set_mesh(mesh):
        a = jax.device_put(x, P(None, "model"))
        assert a.sharding == NamedSharding(mesh, P(None, "model"))
        y = f(a)
        assert y.sharding == NamedSharding(mesh, P("data", None))  # the compiler writes every dimension
        np.testing.assert_array_equal(np.asarray(y), x * 2)
        with jax.set_mesh(mesh8):
            b = jax.device_put(x, P("x"))
            assert b.sharding == NamedSharding(mesh8, P("x"))
            total = jax.shard_map(lambda v: jax.lax.psum(v.sum(), "x"), in_specs=P("x"), out_specs=P())(b)
            assert float(total) == float(x.sum())
        assert get_abstract_mesh() == mesh.abstract_mesh  # (test_set_mesh_none: mesh.abstract_mesh)
        # The same devices in another order: a is committed to other devices than the context
        # mesh's (in order), which JAX refuses before tracing (never the cached program).
        reversed_mesh = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
        with jax.set_mesh(reversed_mesh):
            with pytest.raises(ValueError, match=r"incompatible devices: argument 0 .*device_ids=\[0, 1, 2, 3, 4, 5, "
                               r"6, 7\]\) but the context mesh \(set_mesh\) is .*device_ids=\[7, 6, 5"):
                f(a)
        np.testing.assert_array_equal(np.asarray(f(a)), x * 2)
    assert get_abstract_mesh().empty
    with pytest.raises(ValueError, match="needs a mesh"):
        jax.device_put(x, P("data"))


def test_jit_refuses_a_committed_argument_off_the_context_mesh(mesh, mesh8):
    # JAX's rule (jax/_src/interpreters/pxla.py, _get_and_check_device_assignment: every
    # sharding's devices, in order, against the context mesh's `_flat_devices_tuple`; "Received
    # incompatible devices for jitted computation", as tests/pjit_test.py's
    # test_array_device_assignment_mismatch_with_mesh asserts for an argument on a (2, 2) mesh
    # under a (4, 2) context). The same devices in the same order under another shape pass.
    from tessera.sharding import Mesh, NamedSharding
    x = np.arange(16, dtype=np.float32).reshape(8, 2)
    low = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    a = jax.device_put(x, NamedSharding(low, P("x", "y")))
    f = jax.jit(lambda v: v * 2)
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"jit: incompatible devices: argument 0 \(f32\[8,2\]\) is committed to "
                           r"Mesh\('x': 2, 'y': 2, axis_types=\(Auto, Auto\), device_ids=\[0, 1, 2, 3\]\) but the "
                           r"context mesh \(set_mesh\) is Mesh\('data': 4, 'model': 2, axis_types=\(Auto, Auto\), "
                           r"device_ids=\[0, 1, 2, 3, 4, 5, 6, 7\]\)"):
            f(a)
        b = jax.device_put(x, NamedSharding(mesh8, P("x")))  # mesh8: the same devices, in order
        np.testing.assert_array_equal(np.asarray(f(b)), x * 2)
    with jax.set_mesh(low):
        np.testing.assert_array_equal(np.asarray(f(a)), x * 2)
    np.testing.assert_array_equal(np.asarray(f(a)), x * 2)  # no context mesh: where it is


def test_device_put_of_an_array_onto_other_devices():
    # jax.device_put(x, sharding) of an array already on devices: onto other devices, a mesh of
    # another shape over the same devices, a subset; the values stay, the sharding is the new
    # one. Arrays on different devices meet in jit only after that (JAX: "incompatible devices").
    from tessera.sharding import Mesh, NamedSharding
    devs = jax.devices()
    x = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    low = Mesh(np.array(devs[:4]), ("x",))
    a = jax.device_put(x, NamedSharding(low, P("x")))
    for mesh, spec in [(Mesh(np.array(devs[4:]).reshape(2, 2), ("a", "b")), P("b", "a")),
                       (Mesh(np.array(devs[:4]).reshape(2, 2), ("a", "b")), P(None, ("a", "b"))),
                       (Mesh(np.array(devs[1:3]), ("x",)), P(None, "x"))]:
        b = jax.device_put(a, NamedSharding(mesh, spec))
        assert b.sharding == NamedSharding(mesh, spec)
        assert b.sharding.device_set == set(mesh.devices.flat)
        np.testing.assert_array_equal(np.asarray(b), x)
    high = jax.device_put(x * 2, NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P("x")))
    add = jax.jit(lambda u, v: u + v)
    with pytest.raises(ValueError, match=r"incompatible devices.*device ids \[0, 1, 2, 3\].*device ids \[4, 5, 6, 7\]"):
        add(high, a)
    np.testing.assert_array_equal(np.asarray(add(jax.device_put(high, a.sharding), a)), x * 3)

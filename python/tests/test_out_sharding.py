# out_sharding on the ops that make or broadcast values (jnp.zeros / ones / full / *_like /
# arange, jnp.broadcast_to, lax.broadcast_in_dim / broadcast, lax.broadcasted_iota,
# x.at[i].get) and reshard of an Array against the ambient mesh, each case after a test of
# JAX's tests/pjit_test.py (ShardingInTypesTest, named per case): shardings and types as those
# tests assert them, values against numpy.
import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera import lax
from tessera.sharding import NamedSharding, PartitionSpec as P, AxisType, set_mesh, reshard


def explicit(shape, names):
  return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


@pytest.fixture(scope="module")
def x8():
  return explicit((8,), ("x",))


def test_jnp_zeros_out_sharding(x8):
  # test_jnp_zeros_out_sharding: a NamedSharding, a P under the mesh, and under jit.
  s = NamedSharding(x8, P("x"))
  out = jnp.zeros((8,), jnp.float32, out_sharding=s)
  assert out.sharding == s
  np.testing.assert_array_equal(np.asarray(out), np.zeros((8,), np.float32))
  with set_mesh(x8):
    out = jnp.zeros((8,), jnp.float32, out_sharding=P("x"))
    assert out.sharding == s
    np.testing.assert_array_equal(np.asarray(out), np.zeros((8,), np.float32))
    f = jax.jit(lambda x: jnp.zeros(x.shape, x.dtype, out_sharding=P("x")))
    out = f(np.arange(8, dtype=np.float32))
    assert out.sharding == s
    np.testing.assert_array_equal(np.asarray(out), np.zeros((8,), np.float32))
  with pytest.raises(ValueError, match="a bare PartitionSpec needs a mesh"):
    jnp.zeros((8,), out_sharding=P("x"))


def test_jnp_like_functions_and_full(x8):
  # test_jnp_like_functions: zeros_like / ones_like(np_inp, out_sharding=P('x')) are
  # NamedSharding(mesh, P('x', None)) and numpy's values.
  np_inp = np.arange(16, dtype=np.int32).reshape(8, 2)
  with set_mesh(x8):
    for fn, ref in ((jnp.zeros_like, np.zeros_like), (jnp.ones_like, np.ones_like)):
      out = fn(np_inp, out_sharding=P("x"))
      assert out.sharding.is_equivalent_to(NamedSharding(x8, P("x", None)), 2)
      np.testing.assert_array_equal(np.asarray(out), ref(np_inp))
    out = jnp.full((8, 2), 3.5, out_sharding=P(None, None))
    np.testing.assert_array_equal(np.asarray(out), np.full((8, 2), 3.5, np.float32))
    out = jax.jit(lambda x: jnp.full_like(x, 7, out_sharding=P("x")) + x)(np_inp)
    assert str(jax.typeof(out)) == "int32[8@x,2]"
    np.testing.assert_array_equal(np.asarray(out), np_inp + 7)


def test_jnp_arange_out_sharding(x8):
  # test_jnp_arange_out_sharding: each form laid out by P('x'), numpy's values.
  s = NamedSharding(x8, P("x"))
  out = jnp.arange(8, dtype=jnp.float32, out_sharding=s)
  assert out.sharding == s
  np.testing.assert_array_equal(np.asarray(out), np.arange(8, dtype=np.float32))
  with set_mesh(x8):
    for args in ((8,), (8, 16), (8, 24, 2)):
      out = jnp.arange(*args, dtype=jnp.float32, out_sharding=P("x"))
      assert out.sharding == s
      np.testing.assert_array_equal(np.asarray(out), np.arange(*args, dtype=np.float32))
    seen = []

    @jax.jit
    def f(x):
      a = jnp.arange(8, 24, 2, dtype=np.float32, out_sharding=P("x"))
      seen.append(str(jax.typeof(a)))
      return a + x

    out = f(jax.device_put(np.ones(8, np.float32), s))
    assert seen == ["float32[8@x]"]
    assert out.sharding == s
    np.testing.assert_array_equal(np.asarray(out), np.arange(8, 24, 2, dtype=np.float32) + 1)


def test_broadcasted_iota_with_sharding():
  # test_broadcasted_iota_with_sharding: broadcasted_iota((8, 2), 0, out_sharding=P('x', 'y'))
  # has spec P('x', 'y') on a (2, 2) mesh.
  mesh = explicit((2, 2), ("x", "y"))
  arr = jax.device_put(np.arange(4, dtype=np.float32), NamedSharding(mesh, P("x")))
  seen = []

  @jax.jit
  def g(x):
    y = lax.broadcasted_iota(x.dtype, (8, 2), 0, out_sharding=P("x", "y"))
    seen.append(str(jax.typeof(y)))
    return x * 2, y

  _, out = g(arr)
  assert seen == ["float32[8@x,2@y]"]
  assert out.sharding == NamedSharding(mesh, P("x", "y"))
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(np.arange(8, dtype=np.float32)[:, None], (8, 2)))


def test_broadcast_to():
  # test_broadcast_to: x (1, 24) P(None, ('y', 'z')), broadcast_to((8, 24),
  # out_sharding=P('x', ('y', 'z'))) on a (2, 2, 2) mesh.
  mesh = explicit((2, 2, 2), ("x", "y", "z"))
  x = np.arange(24, dtype=np.int32).reshape(1, 24)
  with set_mesh(mesh):
    xs = jax.device_put(x, P(None, ("y", "z")))
    seen = []

    @jax.jit
    def f(x):
      out = jnp.broadcast_to(x, (8, 24), out_sharding=P("x", ("y", "z")))
      seen.append(jax.typeof(out).sharding.spec)
      return out

    out = f(xs)
  assert seen == [P("x", ("y", "z"))]
  assert out.sharding == NamedSharding(mesh, P("x", ("y", "z")))
  np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(x, (8, 24)))


def test_no_op_broadcast_except_for_sharding_change(x8):
  # test_no_op_broadcast_except_for_sharding_change: broadcast_in_dim(x, (4, 2), [0, 1],
  # out_sharding=P('x')) is x laid out by P('x', None); grad of its sum is laid out as x.
  mesh = explicit((2,), ("x",))
  arr = jnp.arange(8.).reshape(4, 2)
  with set_mesh(mesh):
    seen = []

    @jax.jit
    def f(x):
      out = lax.broadcast_in_dim(x, (4, 2), [0, 1], out_sharding=P("x"))
      seen.append(jax.typeof(out).sharding.spec)
      return out

    out = f(arr)
    assert seen[0] == P("x", None)
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.).reshape(4, 2))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)
    out_g = jax.jit(jax.grad(lambda x: f(x).sum()))(arr)
    assert out_g.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None)), 2)
    np.testing.assert_array_equal(np.asarray(out_g), np.ones((4, 2), np.float32))
    # lax.broadcast (new leading dimensions), tests/pjit_test.py's lax.broadcast(x, sizes=[2],
    # out_sharding=P('x', ...)); its gradient sums the new dimension away.
    v = np.arange(3.0, dtype=np.float32)
    b = jax.jit(lambda v: lax.broadcast(v, [2], out_sharding=P("x", None)))(v)
    assert b.sharding.is_equivalent_to(NamedSharding(mesh, P("x", None)), 2)
    np.testing.assert_array_equal(np.asarray(b), np.stack([v, v]))
    gv = jax.jit(jax.grad(lambda v: (lax.broadcast(v, [2], out_sharding=P("x", None)) * np.array(
        [[1.0], [3.0]], np.float32)).sum()))(v)
    np.testing.assert_array_equal(np.asarray(gv), np.full(3, 4.0, np.float32))


def test_auto_gather_out_sharding():
  # test_auto_gather_out_sharding: embed (64, 16) P(None, 'x'), tok (8, 4) P('x', None) on a
  # (2, 2) mesh; embed.at[tok].get(out_sharding=P('x', None, None)) has that spec, and
  # jit(grad(sum of it)) is laid out as embed.
  mesh = explicit((2, 2), ("x", "y"))
  embed_np = np.arange(128 * 8.0, dtype=np.float32).reshape(64, 16)
  tok_np = (np.arange(8 * 4, dtype=np.int32) * 7 % 64).reshape(8, 4)
  embed = jax.device_put(embed_np, NamedSharding(mesh, P(None, "x")))
  tok = jax.device_put(tok_np, NamedSharding(mesh, P("x", None)))
  with set_mesh(mesh):
    seen = []

    @jax.jit
    def f(embed_vd, token_bt):
      out = embed_vd.at[token_bt].get(out_sharding=P("x", None, None))
      out2 = embed_vd.at[token_bt, :].get(out_sharding=P("x", None, None))
      seen.extend([out.shape, jax.typeof(out).sharding.spec, jax.typeof(out2).sharding.spec])
      return out

    out = f(embed, tok)
    assert seen == [(8, 4, 16), P("x", None, None), P("x", None, None)]
    assert out.sharding == NamedSharding(mesh, P("x", None, None))
    np.testing.assert_array_equal(np.asarray(out), embed_np[tok_np])
    g = jax.jit(jax.grad(lambda x, y: jnp.sum(f(x, y))))(embed, tok)
    assert g.sharding == embed.sharding
    want = np.zeros_like(embed_np)
    np.add.at(want, tok_np, 1.0)
    np.testing.assert_array_equal(np.asarray(g), want)
    # Outside jit too (one jitted gather).
    eager = embed.at[tok].get(out_sharding=P("x", None, None))
    assert eager.sharding == NamedSharding(mesh, P("x", None, None))
    np.testing.assert_array_equal(np.asarray(eager), embed_np[tok_np])


def test_reshard_of_an_array_takes_the_ambient_mesh(x8):
  # jax/_src/pjit.py reshard -> canonicalize_sharding (jax/_src/sharding_impls.py): a bare P
  # resolves against the ambient mesh (also one other than the array's); none is a ValueError.
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  xy = explicit((2, 4), ("X", "Y"))
  xs = jax.device_put(x, NamedSharding(xy, P("X", None)))
  with pytest.raises(ValueError, match="reshard: a bare PartitionSpec needs a mesh"):
    reshard(xs, P(None, "Y"))
  with set_mesh(xy):
    moved = reshard(xs, P(None, "Y"))
  assert moved.sharding == NamedSharding(xy, P(None, "Y"))
  np.testing.assert_array_equal(np.asarray(moved), x)
  with set_mesh(x8):
    other = reshard(xs, P("x"))
  assert other.sharding == NamedSharding(x8, P("x"))
  assert str(jax.typeof(other)) == "float32[8@x,4]"
  np.testing.assert_array_equal(np.asarray(other), x)


def test_reshard_and_out_sharding_take_explicit_axes_only():
  # jax/_src/sharding_impls.py canonicalize_sharding: "PartitionSpec passed to {api_name} cannot
  # contain axis names that are of type Auto or Manual". tests/pjit_test.py:
  # test_reshard_no_mesh_ctx (reshard onto an Auto mesh's NamedSharding is refused, onto an
  # Explicit one it moves), test_error_on_canonicalize_under_auto_mode (einsum's out_sharding on
  # Auto axes), test_dot_general_out_sharding (inside auto_axes the axis is Auto).
  autos = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match="cannot contain axis names that are of type Auto"):
    reshard(np.arange(8), NamedSharding(autos, P("x")))
  ex = explicit((2,), ("x",))
  out = reshard(np.arange(8), NamedSharding(ex, P("x")))
  assert out.sharding == NamedSharding(ex, P("x"))
  np.testing.assert_array_equal(np.asarray(out), np.arange(8))
  # device_put takes Auto axes.
  put = jax.device_put(np.arange(8), NamedSharding(autos, P("x")))
  assert put.sharding == NamedSharding(autos, P("x"))
  # Creation functions' out_sharding, outside and inside jit.
  with pytest.raises(ValueError, match="PartitionSpec passed to full cannot contain axis names.*x of type: Auto"):
    jnp.zeros((8,), out_sharding=NamedSharding(autos, P("x")))
  with set_mesh(autos):
    with pytest.raises(ValueError, match="PartitionSpec passed to full cannot contain axis names"):
      jax.jit(lambda v: jnp.zeros(v.shape, out_sharding=P("x")) + v)(np.ones(8, np.float32))

  mesh2 = jax.make_mesh((2, 1), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
  a = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2), NamedSharding(mesh2, P("x", "y")))
  b = jax.device_put(np.arange(16.0, dtype=np.float32).reshape(2, 8), NamedSharding(mesh2, P("y", None)))
  f = jax.jit(lambda x, y: jnp.einsum("xy,yz->xz", x, y, out_sharding=NamedSharding(mesh2, P("x", "y"))))
  with pytest.raises(ValueError,
                     match=r"PartitionSpec passed to einsum cannot contain axis names.*Auto.*Manual.*"
                           r"axis name: x of type: Auto"):
    f(a, b)

  from tessera.sharding import auto_axes
  x4 = explicit((4,), ("x",))
  np_inp1 = np.arange(16.0, dtype=np.float32).reshape(8, 2)
  arr1 = jax.device_put(np_inp1, NamedSharding(x4, P("x", None)))
  arr2 = jax.device_put(np_inp1.T, NamedSharding(x4, P(None, "x")))

  def g(x, y):
    return jnp.sum(jnp.einsum("xy,yz->xz", x, y, out_sharding=P("x", None)))

  with set_mesh(x4):
    np.testing.assert_allclose(np.asarray(jax.jit(g)(arr1, arr2)), np.sum(np_inp1 @ np_inp1.T))
    with pytest.raises(ValueError,
                       match="PartitionSpec passed to einsum cannot contain axis names that are of type Auto or Manual"):
      jax.jit(auto_axes(g, out_sharding=P()))(arr1, arr2)


def test_jnp_ravel():
  # test_jnp_ravel: a (8, 2) array split P('x', 'y') raveled with out_sharding=P('x') under jit:
  # typed and laid out P('x'), numpy's ravel.
  mesh = explicit((2, 2), ("x", "y"))
  with set_mesh(mesh):
    np_inp = np.arange(16, dtype=np.float32).reshape(8, 2)
    arr = jax.device_put(np_inp, P("x", "y"))
    specs = []

    @jax.jit
    def f(x):
      out = jnp.ravel(x, out_sharding=P("x"))
      specs.append(jax.typeof(out).sharding.spec)
      return out

    out = f(arr)
    assert specs == [P("x")]
    assert out.sharding == NamedSharding(mesh, P("x"))
    np.testing.assert_array_equal(np.asarray(out), np.ravel(np_inp))
    # Eager, and without out_sharding on an unsplit array, as before.
    np.testing.assert_array_equal(np.asarray(jnp.ravel(arr, out_sharding=P("x"))), np.ravel(np_inp))
    np.testing.assert_array_equal(np.asarray(jnp.ravel(reshard(arr, P()))), np.ravel(np_inp))


def test_reduce_sum_unreduced():
  # test_reduce_sum_unreduced: lax.reduce_sum over (0, 1) of a (4, 2, 2) array split
  # P('x', 'y', None) with out_sharding=P(None, unreduced={'x'}): typed so, each shard (2,),
  # and resharded to P(None) it is the sum. (Tessera resolves the sum and places it on the
  # first device along 'x'; JAX leaves each its partial sum: the value is the same.)
  mesh = explicit((2, 2), ("x", "y"))
  with set_mesh(mesh):
    np_inp = np.arange(16, dtype=np.float32).reshape(4, 2, 2)
    arr = jax.device_put(np_inp, P("x", "y", None))
    specs = []

    @jax.jit
    def f(x):
      out = lax.reduce_sum(x, axes=(0, 1), out_sharding=P(None, unreduced={"x"}))
      specs.append(jax.typeof(out).sharding.spec)
      return out

    out = f(arr)
    assert specs[0].unreduced == {"x"} and tuple(specs[0]) == (None,)
    assert out.sharding.spec.unreduced == {"x"}
    for s in out.addressable_shards:
      assert s.data.shape == (2,)
    np.testing.assert_array_equal(np.asarray(reshard(out, P(None))), np_inp.sum(axis=(0, 1)))
    # A split result and no out_sharding: jnp.sum's type and values.
    out = jax.jit(lambda x: lax.reduce_sum(x, axes=(0,), out_sharding=P("y", None)))(arr)
    assert out.sharding == NamedSharding(mesh, P("y", None))
    np.testing.assert_array_equal(np.asarray(out), np_inp.sum(axis=0))
    out = jax.jit(lambda x: lax.reduce_sum(x, axes=(2,)))(arr)
    assert str(jax.typeof(out)) == "float32[4@x,2@y]"
    np.testing.assert_array_equal(np.asarray(out), np_inp.sum(axis=2))


def test_reduce_sum_unreduced_error():
  # test_reduce_sum_unreduced_error: an unreduced axis not among those the operand was split
  # over in the summed dimensions is refused with JAX's words; and _reduce_op_reduced_rule's
  # "cannot be reduced"; lax.py's shape rule's duplicate and out-of-bounds axes.
  mesh = explicit((2, 2), ("x", "y"))
  with set_mesh(mesh):
    arr = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), P("y", None))
    with pytest.raises(ValueError, match="out_sharding's unreduced axes should be in operand's specs that were "
                       "reduce_sum over"):
      jax.jit(lambda x: lax.reduce_sum(x, axes=(0,), out_sharding=P(None, unreduced={"x"})))(arr)
    out = jax.jit(lambda x: lax.reduce_sum(x, axes=(0,), out_sharding=P(None, unreduced={"y"})))(arr)
    np.testing.assert_array_equal(np.asarray(reshard(out, P(None))), np.arange(16.0).reshape(8, 2).sum(axis=0))
    with pytest.raises(ValueError, match="out_sharding passed to reduce_sum cannot be reduced"):
      jax.jit(lambda x: lax.reduce_sum(x, axes=(0,), out_sharding=P(None, reduced={"y"})))(arr)
    with pytest.raises(ValueError, match="duplicate value in 'axes' of reduction"):
      lax.reduce_sum(arr, axes=(0, 0))
    with pytest.raises(ValueError, match="out-of-bounds"):
      lax.reduce_sum(arr, axes=(2,))


def test_reduce_max_min_out_sharding():
  # lax.reduce_max / reduce_min take out_sharding (jax/_src/lax/lax.py); an unreduced one must
  # be of their own unreduced_kind (_reduce_op_unreduced_rule), which Tessera's specs (sum
  # only) cannot be: refused with JAX's words. reduce_prod takes none, as JAX's.
  mesh = explicit((2, 2), ("x", "y"))
  with set_mesh(mesh):
    np_inp = np.random.RandomState(3).randn(8, 4).astype(np.float32)
    arr = jax.device_put(np_inp, P("x", "y"))
    for name, ref in (("reduce_max", np.max), ("reduce_min", np.min)):
      op = getattr(lax, name)
      out = jax.jit(lambda x: op(x, axes=(1,), out_sharding=P("y")))(arr)
      assert out.sharding == NamedSharding(mesh, P("y"))
      np.testing.assert_array_equal(np.asarray(out), ref(np_inp, axis=1))
      np.testing.assert_array_equal(np.asarray(op(arr, (0, 1))), ref(np_inp))
      with pytest.raises(ValueError, match=f"{name} requires `out_sharding`'s unreduced_kind to be"):
        jax.jit(lambda x: op(x, axes=(0,), out_sharding=P(None, unreduced={"x"})))(arr)
    np.testing.assert_allclose(np.asarray(lax.reduce_prod(arr, (0,))), np.prod(np_inp, axis=0), rtol=1e-5)
    with pytest.raises(TypeError):
      lax.reduce_prod(arr, (0,), out_sharding=P())


def test_one_hot_out_sharding():
  # test_one_hot_out_sharding: a (2, 2) array split P('x') one-hot encoded into 4 classes with
  # out_sharding P('x', None, 'y') (classes last) and, with axis=0, P('y', 'x', None): laid out
  # so; an out_sharding whose input part is not x's spec is refused with JAX's words. Values
  # against numpy's one-hot (np.eye).
  mesh = explicit((2, 2), ("x", "y"))
  with set_mesh(mesh):
    np_inp = np.arange(4, dtype=np.int32).reshape(2, 2)
    arr = jax.device_put(np_inp, P("x"))
    want = np.eye(4, dtype=np.float32)[np_inp]

    out = jax.jit(lambda x: jax.nn.one_hot(x, 4, out_sharding=P("x", None, "y")))(arr)
    assert out.sharding == NamedSharding(mesh, P("x", None, "y"))
    np.testing.assert_array_equal(np.asarray(out), want)
    with pytest.raises(ValueError, match="The input part of spec in out_sharding should match the spec of `x`"):
      jax.jit(lambda x: jax.nn.one_hot(x, 4, out_sharding=P("y", None, None)))(arr)

    out = jax.jit(lambda x: jax.nn.one_hot(x, 4, axis=0, out_sharding=P("y", "x", None)))(arr)
    assert out.sharding == NamedSharding(mesh, P("y", "x", None))
    np.testing.assert_array_equal(np.asarray(out), np.moveaxis(want, -1, 0))
    with pytest.raises(ValueError, match="The input part of spec in out_sharding should match the spec of `x`"):
      jax.jit(lambda x: jax.nn.one_hot(x, 4, axis=0, out_sharding=P("x", None, None)))(arr)
    # Without out_sharding: the classes last, as before; axis moves them.
    np.testing.assert_array_equal(np.asarray(jax.nn.one_hot(np_inp, 4)), want)
    np.testing.assert_array_equal(np.asarray(jax.nn.one_hot(np_inp, 4, axis=1)), np.moveaxis(want, -1, 1))

# Explicit sharding from Python: tessera.sharding.AxisType, make_mesh(..., axis_types=),
# typeof and reshard, the cells of JAX's explicit-sharding notebook ([ES]) with the types its
# outputs print, and a contraction split on both operands resolved by out_sharding.
# [ES] docs/notebooks/explicit-sharding.ipynb in jax-ml/jax.
import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import PartitionSpec as P, AxisType, set_mesh, get_abstract_mesh, reshard


@pytest.fixture(scope="module")
def xy():
  return jax.make_mesh((2, 4), ("X", "Y"), axis_types=(AxisType.Explicit, AxisType.Explicit))


def test_axis_types_and_printing(xy):
  # [ES]: "Current mesh is: AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))"
  # (Tessera prints a concrete Mesh as JAX's str(mesh) does).
  assert repr(xy) == "Mesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))"
  assert xy.axis_types == (AxisType.Explicit, AxisType.Explicit)
  auto = jax.make_mesh((2, 4), ("X", "Y"))
  assert auto.axis_types == (AxisType.Auto, AxisType.Auto)
  assert auto != xy and hash(auto) != hash(xy)
  assert jax.make_mesh((2, 4), ("X", "Y"), AxisType.Explicit) == xy
  with pytest.raises(TypeError, match="axis_types entries"):
    jax.make_mesh((2, 4), ("X", "Y"), axis_types=("Explicit", "Explicit"))
  # devices third, as before axis_types existed.
  assert jax.make_mesh((2,), ("d",), jax.devices()[2:4]).device_ids.tolist() == [2, 3]


def test_notebook_cells(xy):
  with set_mesh(xy):
    assert get_abstract_mesh() == xy
    # [ES]: "replicated_array type: int32[4,2]", "sharded_array type: int32[4@X,2]".
    replicated_array = np.arange(8, dtype=np.int32).reshape(4, 2)
    sharded_array = reshard(replicated_array, P("X", None))
    assert str(jax.typeof(replicated_array)) == "i32[4,2]"
    assert str(jax.typeof(sharded_array)) == "i32[4@X,2]"
    # [ES]: arg0 int32[4@X,1] + arg1 int32[1,8@Y] is int32[4@X,8@Y], under jit too.
    arg0 = reshard(np.arange(4, dtype=np.int32).reshape(4, 1), P("X", None))
    arg1 = reshard(np.arange(8, dtype=np.int32).reshape(1, 8), P(None, "Y"))
    result = arg0 + arg1
    assert [str(jax.typeof(a)) for a in (arg0, arg1, result)] == ["i32[4@X,1]", "i32[1,8@Y]", "i32[4@X,8@Y]"]
    seen = []

    @jax.jit
    def add_arrays(x, y):
      ans = x + y
      seen.extend(str(jax.typeof(v)) for v in (x, y, ans))
      return ans

    out = add_arrays(arg0, arg1)
    assert seen == ["i32[4@X,1]", "i32[1,8@Y]", "i32[4@X,8@Y]"]
    # [ES]'s printed value: row i is i + [0..7].
    np.testing.assert_array_equal(np.asarray(out), np.arange(4)[:, None] + np.arange(8)[None, :])
    # [ES]: "add operation with inputs: i32[4@X,4], i32[4,4@X] produces an illegally sharded
    # result: i32[4@X,4@X]".
    some_x = reshard(np.arange(16, dtype=np.int32).reshape(4, 4), P("X", None))
    some_y = reshard(np.arange(16, dtype=np.int32).reshape(4, 4), P(None, "X"))
    with pytest.raises(ValueError, match=r"add operation with inputs: i32\[4@X,4\], i32\[4,4@X\] produces an "
                                         r"illegally sharded result: i32\[4@X,4@X\]"):
      some_x + some_y


def test_out_sharding_resolves_a_split_contraction(xy):
  # The JAX scaling book (jax-ml/scaling-book, "Programming TPUs in JAX"): In[8@X,2048@Y] and
  # W[2048@Y,8192] contract ambiguously; out_sharding=P('X', 'Y') gives [8@X,8192@Y].
  a = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
  w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
  with set_mesh(xy):
    In = reshard(a, P("X", "Y"))
    W = reshard(w, P("Y", None))

    @jax.jit
    def ambiguous(In, W):
      return jnp.einsum("bd,df->bf", jnp.square(In), W)

    with pytest.raises(ValueError, match=r"lhs_contracting_spec=\('Y',\), rhs_contracting_spec=\('Y',\)"):
      ambiguous(In, W)
    types = []

    @jax.jit
    def resolved(In, W):
      out = jnp.einsum("bd,df->bf", jnp.square(In), W, out_sharding=P("X", "Y"))
      types.append(str(jax.typeof(out)))
      return out

    out = resolved(In, W)
    assert types == ["f32[8@X,32@Y]"]
    assert str(jax.typeof(out)) == "f32[8@X,32@Y]"
    np.testing.assert_allclose(np.asarray(out), (a * a) @ w, rtol=1e-4, atol=1e-4)
    # Outside jit too, and matmul's all-reduce reading.
    out2 = jnp.matmul(In, W, out_sharding=P("X", None))
    assert str(jax.typeof(out2)) == "f32[8@X,32]"
    np.testing.assert_allclose(np.asarray(out2), a @ w, rtol=1e-4, atol=1e-4)


def test_reshard_inside_and_outside_jit(xy):
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  xs = jax.device_put(x, jax.sharding.NamedSharding(xy, P("X", None)))
  moved = reshard(xs, P(None, "Y"))
  assert str(jax.typeof(moved)) == "f32[8,4@Y]"
  assert moved.sharding.mesh == xy
  np.testing.assert_array_equal(np.asarray(moved), x)
  inner = []

  @jax.jit
  def f(v):
    r = reshard(v * 2, P(("X", "Y"), None))
    inner.append(str(jax.typeof(r)))
    return r

  y = f(xs)
  assert inner == ["f32[8@(X,Y),4]"]
  np.testing.assert_array_equal(np.asarray(y), 2 * x)


def test_auto_mesh_types_show_no_sharding(mesh):
  x = jax.device_put(np.ones((16, 8), np.float32), jax.sharding.NamedSharding(mesh, P("data", None)))
  assert str(jax.typeof(x)) == "f32[16,8]"

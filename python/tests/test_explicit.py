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
  # jax.make_mesh defaults to Explicit axes (JAX >= 0.9; tests/array_test.py
  # test_make_mesh_axis_types), jax.sharding.Mesh to Auto (jax/_src/mesh.py).
  assert jax.make_mesh((2, 4), ("X", "Y")) == xy
  auto = jax.make_mesh((2, 4), ("X", "Y"), axis_types=AxisType.Auto)
  assert auto.axis_types == (AxisType.Auto, AxisType.Auto)
  assert auto != xy and hash(auto) != hash(xy)
  assert jax.sharding.Mesh(xy.devices, ("X", "Y")) == auto
  assert jax.make_mesh((2, 4), ("X", "Y"), AxisType.Explicit) == xy
  with pytest.raises(TypeError, match="axis_types entries"):
    jax.make_mesh((2, 4), ("X", "Y"), axis_types=("Explicit", "Explicit"))
  # devices third, as before axis_types existed.
  assert jax.make_mesh((2,), ("d",), jax.devices()[2:4]).device_ids.tolist() == [2, 3]


def test_notebook_cells(xy):
  with set_mesh(xy):
    # [ES]: "Current mesh is: AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))".
    assert get_abstract_mesh() == xy.abstract_mesh
    assert repr(get_abstract_mesh()) == "AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))"
    # [ES]: "replicated_array type: int32[4,2]", "sharded_array type: int32[4@X,2]".
    replicated_array = np.arange(8, dtype=np.int32).reshape(4, 2)
    sharded_array = reshard(replicated_array, P("X", None))
    assert str(jax.typeof(replicated_array)) == "int32[4,2]"
    assert str(jax.typeof(sharded_array)) == "int32[4@X,2]"
    # [ES]: arg0 int32[4@X,1] + arg1 int32[1,8@Y] is int32[4@X,8@Y], under jit too.
    arg0 = reshard(np.arange(4, dtype=np.int32).reshape(4, 1), P("X", None))
    arg1 = reshard(np.arange(8, dtype=np.int32).reshape(1, 8), P(None, "Y"))
    result = arg0 + arg1
    assert [str(jax.typeof(a)) for a in (arg0, arg1, result)] == ["int32[4@X,1]", "int32[1,8@Y]", "int32[4@X,8@Y]"]
    seen = []

    @jax.jit
    def add_arrays(x, y):
      ans = x + y
      seen.extend(str(jax.typeof(v)) for v in (x, y, ans))
      return ans

    out = add_arrays(arg0, arg1)
    assert seen == ["int32[4@X,1]", "int32[1,8@Y]", "int32[4@X,8@Y]"]
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
    assert types == ["float32[8@X,32@Y]"]
    assert str(jax.typeof(out)) == "float32[8@X,32@Y]"
    np.testing.assert_allclose(np.asarray(out), (a * a) @ w, rtol=1e-4, atol=1e-4)
    # Outside jit too, and matmul's all-reduce reading.
    out2 = jnp.matmul(In, W, out_sharding=P("X", None))
    assert str(jax.typeof(out2)) == "float32[8@X,32]"
    np.testing.assert_allclose(np.asarray(out2), a @ w, rtol=1e-4, atol=1e-4)
    # lax.dot_general(..., out_sharding=) (jax/_src/lax/lax.py's signature), in jit and outside.
    dims = (((1,), (0,)), ((), ()))
    out3 = jax.jit(lambda In, W: jax.lax.dot_general(In, W, dims, out_sharding=P("X", "Y")))(In, W)
    assert str(jax.typeof(out3)) == "float32[8@X,32@Y]"
    np.testing.assert_allclose(np.asarray(out3), a @ w, rtol=1e-4, atol=1e-4)
    out4 = jax.lax.dot_general(In, W, dims, preferred_element_type=np.float32, out_sharding=P("X", None))
    assert str(jax.typeof(out4)) == "float32[8@X,32]"
    np.testing.assert_allclose(np.asarray(out4), a @ w, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="lhs_contracting_spec"):
      jax.jit(lambda In, W: jax.lax.dot_general(In, W, dims))(In, W)


def test_batch_dimensions_split_on_one_side_only_as_jax():
  # jax/_src/lax/lax.py, _dot_general_sharding_rule: lhs and rhs batch specs must be equal, None
  # included; jax/_src/numpy/tensor_contractions.py, matmul: a batch dimension both operands
  # have with the same size and different splits is "Incompatible types for matmul arguments"
  # (even with out_sharding); one the other lacks, or has unsplit of size 1, is a free dimension
  # of the dot_general and keeps its split.
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(2)
  a = rng.standard_normal((2, 4, 8)).astype(np.float32)
  b = rng.standard_normal((2, 8, 4)).astype(np.float32)
  with set_mesh(mesh):
    A, B = reshard(a, P("x")), reshard(b, P())
    dims = (((2,), (1,)), ((0,), (0,)))
    with pytest.raises(ValueError, match=r"dot_general requires lhs batch dimensions and rhs batch dimensions to "
                       r"have the same sharding, got \('x',\) and \(None,\)"):
      jax.jit(lambda A, B: jax.lax.dot_general(A, B, dims))(A, B)
    # (the SDK's messages print types with its short dtype names, f32 for JAX's float32)
    with pytest.raises(ValueError, match=r"Incompatible types for matmul arguments: f32\[2@x,4,8\] and "
                       r"f32\[2,8,4\]"):
      jax.jit(jnp.matmul)(A, B)
    with pytest.raises(ValueError, match="Incompatible types for matmul arguments"):
      jnp.matmul(A, B, out_sharding=P("x"))
    # What JAX accepts, with its types and numpy's values.
    out = jax.jit(lambda A, B: jax.lax.dot_general(A, B, dims))(A, reshard(b, P("x")))
    assert str(jax.typeof(out)) == "float32[2@x,4,4]"
    np.testing.assert_allclose(np.asarray(out), a @ b, rtol=1e-4, atol=1e-4)
    for rhs, want in ((b[:1], a @ b[:1]), (b[0], a @ b[0])):
      out = jax.jit(jnp.matmul)(A, reshard(rhs, P()))
      assert str(jax.typeof(out)) == "float32[2@x,4,4]"
      np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
    out = jax.jit(jnp.matmul)(reshard(a[0], P()), reshard(b, P("x")))
    assert str(jax.typeof(out)) == "float32[2@x,4,4]"
    np.testing.assert_allclose(np.asarray(out), a[0] @ b, rtol=1e-4, atol=1e-4)
    # The lhs's contracting dimension on the mesh axis of the rhs's batch dimension.
    out = jax.jit(jnp.matmul)(reshard(a[0], P(None, "x")), reshard(b, P("x")))
    assert str(jax.typeof(out)) == "float32[2@x,4,4]"
    np.testing.assert_allclose(np.asarray(out), a[0] @ b, rtol=1e-4, atol=1e-4)


def test_vmap_of_matmul_with_a_size_one_batch_dimension_as_jax():
  # vmap over 'x' of jnp.matmul((2@y,4,8), (1,8,4)): per example matmul keeps the size-1 batch
  # dimension as a free one (tensor_contractions.py, matmul) and the batched dot_general pairs
  # the mapped dimensions as a new batch dimension (lax.py, _dot_batch_rule and
  # _dot_general_batch_dim_nums), split 'x' on both sides: float32[2@x,2@y,4,4]. An unmapped
  # rhs is a free dimension of the product instead.
  mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  rng = np.random.default_rng(3)
  a = rng.standard_normal((2, 2, 4, 8)).astype(np.float32)
  b = rng.standard_normal((2, 1, 8, 4)).astype(np.float32)
  with set_mesh(mesh):
    A = reshard(a, P("x", "y"))
    out = jax.jit(jax.vmap(jnp.matmul))(A, reshard(b, P("x")))
    assert str(jax.typeof(out)) == "float32[2@x,2@y,4,4]"
    np.testing.assert_allclose(np.asarray(out), np.matmul(a, b), rtol=1e-4, atol=1e-4)
    out = jax.jit(jax.vmap(jnp.matmul, in_axes=(0, None)))(A, reshard(b[0], P()))
    assert str(jax.typeof(out)) == "float32[2@x,2@y,4,4]"
    np.testing.assert_allclose(np.asarray(out), np.matmul(a, b[0]), rtol=1e-4, atol=1e-4)


def test_reshard_inside_and_outside_jit(xy):
  x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
  xs = jax.device_put(x, jax.sharding.NamedSharding(xy, P("X", None)))
  with set_mesh(xy):  # a bare P resolves against the ambient mesh (test_out_sharding.py: without one)
    moved = reshard(xs, P(None, "Y"))
  assert str(jax.typeof(moved)) == "float32[8,4@Y]"
  assert moved.sharding.mesh == xy
  np.testing.assert_array_equal(np.asarray(moved), x)
  inner = []

  @jax.jit
  def f(v):
    r = reshard(v * 2, P(("X", "Y"), None))
    inner.append(str(jax.typeof(r)))
    return r

  y = f(xs)
  assert inner == ["float32[8@(X,Y),4]"]
  np.testing.assert_array_equal(np.asarray(y), 2 * x)


def test_auto_mesh_types_show_no_sharding(mesh):
  x = jax.device_put(np.ones((16, 8), np.float32), jax.sharding.NamedSharding(mesh, P("data", None)))
  assert str(jax.typeof(x)) == "float32[16,8]"


def test_auto_axes_and_explicit_axes_as_the_notebook(xy):
  from tessera.sharding import auto_axes, explicit_axes
  import functools
  with set_mesh(xy):
    # [ES] "Working around unimplemented sharding rules": with auto_axes the add runs and
    # "Result type: ShapedArray(int32[4@X,4])".
    some_x = reshard(np.arange(16, dtype=np.int32).reshape(4, 4), P("X", None))
    some_y = reshard(np.arange(16, dtype=np.int32).reshape(4, 4), P(None, "X"))

    @auto_axes
    def add_with_out_sharding_kwarg(x, y):
      return x + y

    result = add_with_out_sharding_kwarg(some_x, some_y, out_shardings=P("X", None))
    assert str(jax.typeof(result)) == "int32[4@X,4]"
    np.testing.assert_array_equal(np.asarray(result), 2 * np.arange(16).reshape(4, 4))
    with pytest.raises(TypeError, match="Missing required keyword argument: 'out_sharding'"):
      add_with_out_sharding_kwarg(some_x, some_y)

    # [ES] "Using a mixture of sharding modes": inside g "ShapedArray(float32[4,4@Y])", then
    # "z.sharding: ShapedArray(float32[4@X,4@Y])" and the printed Array.
    seen = []

    @functools.partial(auto_axes, axes='X')
    def g(y):
      seen.append(str(jax.typeof(y)))
      return y * 2

    @jax.jit
    def f(arr1):
      x = jnp.sin(arr1)
      seen.append(str(jax.typeof(x)))
      z = g(x, out_sharding=P("X", "Y"))
      seen.append(str(jax.typeof(z)))
      return z + 1

    out = f(reshard(np.arange(16, dtype=np.float32).reshape(4, 4), P("X", "Y")))
    assert seen == ["float32[4@X,4@Y]", "float32[4,4@Y]", "float32[4@X,4@Y]"]
    printed = [[1., 2.682942, 2.818595, 1.28224], [-0.513605, -0.9178486, 0.44116902, 2.3139732],
               [2.9787164, 1.824237, -0.08804226, -0.99998045], [-0.07314587, 1.840334, 2.9812148, 2.3005757]]
    np.testing.assert_allclose(np.asarray(out), printed, rtol=1e-5, atol=1e-6)

  # [ES]: explicit_axes over ('X', 'Y') on an Auto mesh: inside, the types show both axes.
  auto_mesh = jax.make_mesh((2, 4), ("X", "Y"), axis_types=(AxisType.Auto, AxisType.Auto))
  inside = []

  @functools.partial(explicit_axes, axes=('X', 'Y'))
  def explicit_g(y):
    z = y * 2
    inside.extend([str(jax.typeof(y)), str(jax.typeof(z))])
    return z

  @jax.jit
  def f2(arr1):
    x = jnp.sin(arr1)
    z = explicit_g(x, in_shardings=P("X", "Y"))
    inside.append(str(jax.typeof(z)))
    return z + 1

  with set_mesh(auto_mesh):
    some_x = jax.device_put(np.arange(16, dtype=np.float32).reshape(4, 4), P("X", "Y"))
    out = f2(some_x)
  assert inside == ["float32[4@X,4@Y]", "float32[4@X,4@Y]", "float32[4,4]"]
  np.testing.assert_allclose(np.asarray(out), printed, rtol=1e-5, atol=1e-6)


def test_shard_map_infers_omitted_in_specs_from_explicit_types():
    # JAX's shard_map (jax/_src/shard_map.py, in_specs=Infer): on a mesh whose axes are all
    # Explicit, omitted in_specs are the arguments' types; eager and under jit alike.
    mesh = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(np.arange(8.0, dtype=np.float32), jax.NamedSharding(mesh, P("batch")))
    w = jax.device_put(np.float32(2.0), jax.NamedSharding(mesh, P()))
    f = jax.shard_map(lambda w, x: jax.lax.psum(jnp.sum(x * w), "batch"), mesh=mesh, out_specs=P())
    assert float(f(w, x)) == float(np.sum(np.arange(8.0) * 2.0))
    assert float(jax.jit(f)(w, x)) == 56.0
    auto = jax.make_mesh((4,), ("batch",), axis_types=(AxisType.Auto,))
    g = jax.shard_map(lambda x: x, mesh=auto, out_specs=P("batch"))
    with pytest.raises(ValueError, match="in_specs may be omitted only on a mesh whose axes are all Explicit"):
        g(jax.device_put(np.arange(8.0, dtype=np.float32), jax.NamedSharding(auto, P("batch"))))


# jnp.reshape(..., out_sharding=) as JAX's tests/pjit_test.py test_reshape (explicit mesh (2,) 'x'):
# the result's type and sharding are dst_spec, its values numpy's reshape, and the gradient
# through it comes back laid out as the argument (`jax.jit(jax.grad(g))(arr).sharding ==
# arr.sharding`: the reshape VJP reshapes back with the operand's sharding, as JAX's
# _reshape_transpose_rule). Merging a split dimension needs the out_sharding (the SDK refuses it
# without).
@pytest.mark.parametrize("src_shape, dst_shape, src_spec, dst_spec", [
    ((8, 2, 1), (1, 16, 1), P("x", None, None), P(None, "x", None)),
    ((16, 8), (128,), P("x", None), P("x")),
    ((4, 6), (4, 6), P(None, "x"), P(None, "x")),
])
def test_reshape_out_sharding_as_jax_tests_it(src_shape, dst_shape, src_spec, dst_spec):
  mesh = jax.make_mesh((2,), ("x",))
  np_inp = np.arange(np.prod(src_shape), dtype=np.float32).reshape(src_shape)
  arr = jax.device_put(np_inp, jax.NamedSharding(mesh, src_spec))
  types = []

  @jax.jit
  def f(x):
    y = jnp.reshape(x, dst_shape, out_sharding=jax.NamedSharding(mesh, dst_spec))
    types.append(jax.typeof(y).sharding.spec)
    assert y.shape == dst_shape
    return y * 2

  out = f(arr)
  assert types == [dst_spec]
  assert out.sharding == jax.NamedSharding(mesh, dst_spec)
  np.testing.assert_array_equal(np.asarray(out), np_inp.reshape(dst_shape) * 2)
  g = jax.jit(jax.grad(lambda x: jnp.square(jnp.sum(f(x)))))(arr)
  assert g.sharding == arr.sharding
  total = 2 * np_inp.sum(dtype=np.float64)  # d/dx (sum(2 x))^2 = 2 (2 total) 2
  np.testing.assert_allclose(np.asarray(g), np.full(src_shape, 2 * total * 2), rtol=1e-6)
  # A bare P under the ambient mesh, outside jit (jnp.reshape runs as a jitted call).
  with set_mesh(mesh):
    eager = jnp.reshape(arr, dst_shape, out_sharding=dst_spec)
  assert eager.sharding == jax.NamedSharding(mesh, dst_spec)
  np.testing.assert_array_equal(np.asarray(eager), np_inp.reshape(dst_shape))


def test_reshape_merging_a_split_dimension_needs_out_sharding():
  mesh = jax.make_mesh((2,), ("x",))
  arr = jax.device_put(np.zeros((16, 8), np.float32), jax.NamedSharding(mesh, P("x", None)))
  with pytest.raises(ValueError, match="moves a split dimension"):
    jax.jit(lambda x: jnp.reshape(x, (128,)))(arr)


# NamedSharding.is_equivalent_to as JAX's tests/array_test.py test_are_shardings_equivalent
# (and pjit_test.py's `out.sharding.is_equivalent_to(arr.sharding, arr.ndim)`): the same blocks
# on the same devices, whatever the meshes and specs; not equal specs all the same.
def test_named_sharding_is_equivalent_to():
  devs = jax.devices()
  one = jax.sharding.Mesh(np.array(devs[:1]), ("x",))
  s1 = jax.NamedSharding(one, P("x"))
  s2 = jax.NamedSharding(jax.sharding.Mesh(np.array(devs[:1]), ("_default",)), P())  # one device's
  assert s1.is_equivalent_to(s2, 2) and s1 != s2
  assert not s1.is_equivalent_to(jax.NamedSharding(jax.sharding.Mesh(np.array(devs[1:2]), ("x",)), P()), 2)
  m42 = jax.make_mesh((4, 2), ("a", "b"))
  m8 = jax.make_mesh((8,), ("c",))
  assert jax.NamedSharding(m42, P("a")).is_equivalent_to(jax.NamedSharding(m42, P("a", None)), 2)
  assert P("a") != P("a", None)
  assert jax.NamedSharding(m42, P(("a", "b"))).is_equivalent_to(jax.NamedSharding(m8, P("c")), 2)
  assert not jax.NamedSharding(m42, P(("b", "a"))).is_equivalent_to(jax.NamedSharding(m8, P("c")), 2)
  assert not jax.NamedSharding(m42, P("a")).is_equivalent_to(jax.NamedSharding(m8, P("c")), 2)
  assert jax.NamedSharding(m42, P()).is_equivalent_to(jax.NamedSharding(m8, P()), 3)
  # The devices' order counts, as JAX compares the device lists.
  rev = jax.sharding.Mesh(np.array(devs[::-1]), ("c",))
  assert not jax.NamedSharding(m8, P("c")).is_equivalent_to(jax.NamedSharding(rev, P("c")), 1)
  with pytest.raises(TypeError, match="NamedSharding"):
    s1.is_equivalent_to(P("x"), 1)


def test_auto_axes_runs_eagerly_as_jax(xy):
  # auto_axes called on arrays outside jit runs eagerly, as JAX's (jax/_src/pjit.py
  # _auto_axes). tests/pjit_test.py test_auto_axes_no_context_mesh: with axes='x' and
  # out_sharding NamedSharding(mesh, P('x', 'y')), inside the type is P(None, 'y') and
  # out.sharding is that NamedSharding; test_auto_axes_computation_follows_data: a jitted f
  # under auto_axes(out_sharding=s) gives arr * 2 sharded as s; test_auto_axes_numpy_array:
  # under an Explicit mesh, a numpy argument reaches the jitted f on an all-Auto mesh.
  from tessera.sharding import auto_axes, NamedSharding, AbstractMesh
  import functools
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  arr = jax.device_put(x, NamedSharding(xy, P("X", "Y")))
  seen = []

  @functools.partial(auto_axes, axes="X", out_sharding=NamedSharding(xy, P("X", "Y")))
  def h(y):
    seen.append((jax.typeof(y).sharding.spec, y.sharding.spec, repr(get_abstract_mesh())))
    z = jnp.sin(y)
    seen.append(jax.typeof(z).sharding.spec)
    return z

  out = h(arr)
  assert seen == [(P(None, "Y"), P("X", "Y"), "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Explicit))"),
                  P(None, "Y")]
  assert out.sharding == NamedSharding(xy, P("X", "Y"))
  np.testing.assert_allclose(np.asarray(out), np.sin(x), rtol=1e-5, atol=1e-6)
  assert str(jax.typeof(arr)) == "float32[8@X,8@Y]"  # the argument itself is untouched

  s = NamedSharding(xy, P("X"))
  v = jax.device_put(np.arange(8), s)
  out = auto_axes(jax.jit(lambda a: a * 2), out_sharding=s)(v)
  assert out.sharding == s
  np.testing.assert_array_equal(np.asarray(out), np.arange(8) * 2)

  with set_mesh(jax.make_mesh((8,), ("x",))):
    meshes = []

    @jax.jit
    def f(a):
      meshes.append(jax.typeof(a).sharding.mesh)
      return a * 2

    out = auto_axes(f, out_sharding=P("x"))(np.arange(8))
    assert isinstance(meshes[0], AbstractMesh) and meshes[0].are_all_axes_auto
    assert out.sharding.spec == P("x") and out.sharding.mesh == jax.make_mesh((8,), ("x",))
    np.testing.assert_array_equal(np.asarray(out), np.arange(8) * 2)

  # [ES], the last cell, as its output prints: at the top the concrete and the type-specified
  # shardings agree; inside auto_axes the mesh is all Auto, the concrete sharding P('X',) and
  # the type's P(None,); the result (sin of arange(8)) comes back sharded P('X').
  printed = []

  def compare_shardings(a):
    printed.append((repr(get_abstract_mesh()), a.sharding.spec, jax.typeof(a).sharding.spec))

  with set_mesh(xy):
    my_array = jnp.sin(reshard(np.arange(8), P("X")))
    compare_shardings(my_array)

    @auto_axes
    def check_in_auto_context(a):
      compare_shardings(a)
      return a

    out = check_in_auto_context(my_array, out_sharding=P("X"))
  assert printed == [("AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))", P("X"), P("X")),
                     ("AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Auto))", P("X"), P(None))]
  assert out.sharding == NamedSharding(xy, P("X"))
  np.testing.assert_allclose(np.asarray(out), [0., 0.84147096, 0.9092974, 0.14112, -0.7568025, -0.9589243,
                                               -0.2794155, 0.6569866], rtol=1e-6)
  # An axis that is not the mesh's, as the trace says it.
  with set_mesh(xy), pytest.raises(ValueError, match="auto_axes: 'Z' is not an axis of"):
    auto_axes(lambda a: a, axes="Z", out_sharding=P())(my_array)


def test_explicit_axes_runs_eagerly_as_jax(xy):
  # explicit_axes on arrays outside jit (jax/_src/pjit.py _explicit_axes): the arguments are
  # resharded to in_sharding over the mesh with the axes Explicit, f sees them typed so
  # (tests/pjit_test.py test_explicit_axes_top_level: the matmul of P('x', None) operands is
  # typed P('x', None)), and the result is back on the Auto mesh. Values against numpy.
  from tessera.sharding import explicit_axes
  import functools
  auto = jax.make_mesh((2, 4), ("X", "Y"), axis_types=(AxisType.Auto, AxisType.Auto))
  a = np.arange(64, dtype=np.float32).reshape(8, 8) / 8
  b = np.arange(64, dtype=np.float32).reshape(8, 8).T / 16
  seen = []

  @functools.partial(explicit_axes, in_sharding=(P("X", None), P("X", None)))
  def jax_matmul(u, v):
    out = u @ v
    seen.append((jax.typeof(out).sharding.spec, repr(get_abstract_mesh())))
    return out

  with set_mesh(auto):
    arr1 = jax.device_put(a, P("X", "Y"))
    arr2 = jax.device_put(b, P("Y", "X"))
    out = jax_matmul(arr1, arr2)
    assert seen == [(P("X", None), "AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))")]
    assert out.sharding.mesh == auto and str(jax.typeof(out)) == "float32[8,8]"
    np.testing.assert_allclose(np.asarray(out), a @ b, rtol=1e-5)
  # No context mesh and no Explicit argument: JAX's error.
  with pytest.raises(ValueError, match="Context mesh cannot be empty"):
    jax_matmul(jax.device_put(a, jax.sharding.NamedSharding(auto, P())), jax.device_put(b, jax.sharding.NamedSharding(auto, P())))


def test_explicit_axes_check_their_in_shardings_as_jax():
  # jax/_src/pjit.py _explicit_axes reshards each argument to its in_sharding under the
  # switched mesh: canonicalize_sharding (jax/_src/sharding_impls.py) wants the mesh's axes,
  # each once, Explicit there ("PartitionSpec passed to ... cannot contain axis names that are
  # of type Auto or Manual"), and get_sharding (jax/_src/core.py) a spec no longer than the
  # rank whose splits divide. Each error names the argument, its type, its spec and the rule,
  # in a jitted function and eagerly alike; valid specs type the arguments inside.
  import functools
  import re
  from tessera.sharding import explicit_axes
  auto = jax.make_mesh((2, 4), ("X", "Y"), axis_types=(AxisType.Auto, AxisType.Auto))
  u = np.arange(32, dtype=np.float32).reshape(4, 8)
  v = np.arange(24, dtype=np.float32).reshape(4, 6)
  cases = [("X", P("X", "Y"), "PartitionSpec passed to explicit_axes cannot contain axis names that are of type "
                              "Auto or Manual. Got PartitionSpec: P('X', 'Y') with axis name: Y of type: Auto"),
           (None, P("Z"), "sharding P('Z',): axis 'Z' of dimension 0 is not in the mesh; its axes are ('X', 'Y')"),
           (None, P("X", "X"), "mesh axis 'X' is used more than once"),
           (None, P(None, None, None), "has 3 entries but the array of shape (4, 6) has rank 2"),
           (None, P(None, "Y"), "dimension 1 of size 6 is not divisible by mesh axis 'Y' of size 4")]
  with set_mesh(auto):
    arrays = (jax.device_put(u, P()), jax.device_put(v, P()))
    for axes, spec, rule in cases:
      g = explicit_axes(lambda a, b: (a, b), axes=axes, in_sharding=(P(), spec))
      want = re.escape(f"explicit_axes: argument 1 f32[4,6] with in_shardings[1] = {spec!r}: ") + ".*" + \
          re.escape(rule)
      with pytest.raises(ValueError, match=want):
        jax.jit(g)(*arrays)
      with pytest.raises(ValueError, match=want):
        g(*arrays)
    seen = []

    @functools.partial(explicit_axes, in_sharding=(P("X", "Y"), P("X")))
    def typed(a, b):
      seen.append((str(jax.typeof(a)), str(jax.typeof(b))))
      return a * 2, b + 1

    for run in (jax.jit(typed), typed):
      a, b = run(*arrays)
      np.testing.assert_array_equal(np.asarray(a), u * 2)
      np.testing.assert_array_equal(np.asarray(b), v + 1)
  assert seen == [("float32[4@X,8@Y]", "float32[4@X,6]")] * 2


def test_get_abstract_mesh_shows_the_axis_types_where_it_is_called(xy):
  # jax.sharding.get_abstract_mesh() inside a trace: at the top of a jitted function under
  # set_mesh the mesh's types, inside auto_axes the switched ones ([ES] prints
  # "mesh inside f: AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))" and "mesh
  # inside g: AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Explicit))"; on an Auto mesh
  # explicit_axes gives "(Explicit, Explicit)" inside, "(Auto, Auto)" in f); in a shard_map
  # body the manual axes are Manual (tests/shard_map_test.py
  # test_shmap_partial_manual_explicit: axis_names={'x'} on an Explicit mesh has manual_axes
  # ('x',) and explicit_axes ('y',); test_shmap_partial_manual_auto: auto_axes ('y',);
  # test_shmap_full_manual_context_auto: manual_axes ('x', 'y')). jax.typeof(x).sharding.mesh
  # is an AbstractMesh (tests/pjit_test.py test_set_mesh_none compares it with
  # empty_abstract_mesh).
  from tessera.sharding import auto_axes, explicit_axes, AbstractMesh
  import functools
  seen = []

  @functools.partial(auto_axes, axes="X")
  def g(y):
    seen.append(repr(get_abstract_mesh()))
    return y * 2

  @jax.jit
  def f(a):
    seen.append(repr(get_abstract_mesh()))
    seen.append(jax.typeof(a).sharding.mesh)
    return g(jnp.sin(a), out_sharding=P("X", "Y"))

  x = np.arange(16, dtype=np.float32).reshape(4, 4)
  with set_mesh(xy):
    out = f(reshard(x, P("X", "Y")))
  np.testing.assert_allclose(np.asarray(out), 2 * np.sin(x), rtol=1e-5, atol=1e-6)
  assert seen == ["AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))", xy.abstract_mesh,
                  "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Explicit))"]

  auto = jax.make_mesh((2, 4), ("X", "Y"), axis_types=(AxisType.Auto, AxisType.Auto))
  seen.clear()

  @functools.partial(explicit_axes, axes=("X", "Y"))
  def explicit_g(y):
    seen.append(repr(get_abstract_mesh()))
    return y * 2

  @jax.jit
  def f2(a):
    seen.append(repr(get_abstract_mesh()))
    return explicit_g(jnp.sin(a), in_sharding=P("X", "Y")) + 1

  with set_mesh(auto):
    out = f2(jax.device_put(x, P("X", "Y")))
  np.testing.assert_allclose(np.asarray(out), 2 * np.sin(x) + 1, rtol=1e-5, atol=1e-6)
  assert seen == ["AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Auto))",
                  "AbstractMesh('X': 2, 'Y': 4, axis_types=(Explicit, Explicit))"]

  x8 = np.arange(32, dtype=np.float32).reshape(8, 4)
  for mesh, names, manual, other in [(xy, {"X"}, ("X",), ("explicit_axes", ("Y",))),
                                     (auto, {"X"}, ("X",), ("auto_axes", ("Y",))),
                                     (auto, frozenset(), ("X", "Y"), ("auto_axes", ()))]:
    found = []

    def body(v):
      m = get_abstract_mesh()
      found.append((m.manual_axes, getattr(m, other[0]), isinstance(jax.typeof(v).sharding.mesh, AbstractMesh)))
      return v * 2

    spec = P("X") if names else P("X", "Y")
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=names))(
        jax.device_put(x8, jax.sharding.NamedSharding(mesh, P("X", "Y"))))
    assert found == [(manual, other[1], True)], (mesh, names)
    np.testing.assert_array_equal(np.asarray(out), x8 * 2)
  assert get_abstract_mesh().empty


def test_get_mesh_and_use_abstract_mesh_as_jax(xy):
  # jax.sharding.get_mesh (jax/_src/sharding_impls.py): the concrete mesh set_mesh set
  # (tests/pjit_test.py test_set_mesh: get_mesh() == mesh), JAX's empty Mesh when none is, and
  # inside jit a ValueError pointing at get_abstract_mesh.
  from tessera.sharding import get_mesh, use_abstract_mesh, AbstractMesh, Mesh
  assert get_mesh().empty and get_mesh().size == 0 and get_mesh().abstract_mesh.empty
  with set_mesh(xy):
    assert get_mesh() == xy and not get_mesh().empty
    with pytest.raises(ValueError, match="`get_mesh` can only be used outside of `jax.jit`. Maybe you want"):
      jax.jit(lambda a: (get_mesh(), a)[1])(np.ones(4, np.float32))
  with xy:
    assert get_mesh() == xy
  assert get_mesh().empty and get_mesh() == Mesh(np.empty((), dtype=object), ())

  # jax.sharding.use_abstract_mesh (jax/_src/mesh.py): an AbstractMesh only; get_abstract_mesh()
  # is it inside the block; the size may not change (test_use_abstract_mesh_override).
  with pytest.raises(ValueError, match="Expected mesh of type `jax.sharding.AbstractMesh`"):
    use_abstract_mesh(xy)
  am = xy.abstract_mesh.update_axis_types({"X": AxisType.Auto})
  with set_mesh(xy):
    with use_abstract_mesh(am):
      assert get_abstract_mesh() == am
      assert repr(get_abstract_mesh()) == "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Explicit))"
      with pytest.raises(ValueError, match="use_abstract_mesh cannot change the size of the mesh. Got new mesh: "
                                           r"AbstractMesh\('x': 4, axis_types=\(Explicit,\)\) with size=4"):
        with use_abstract_mesh(AbstractMesh((4,), ("x",))):
          pass
      assert get_abstract_mesh() == am
    assert get_abstract_mesh() == xy.abstract_mesh

  # tests/pjit_test.py test_output_different_context_error's g: inside jit, under
  # use_abstract_mesh(mesh.abstract_mesh.update_axis_types({'x': Auto})), an einsum's
  # out_sharding=P('x', None) is refused ("PartitionSpec.*cannot contain axis names.*Auto");
  # P(None, 'Y') names an Explicit axis and runs.
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  y = np.arange(16, dtype=np.float32).reshape(4, 4)

  def g(spec):
    @jax.jit
    def f(a, b):
      with use_abstract_mesh(am):
        out = jnp.einsum("xy,yz->xz", a, b, out_sharding=spec)
      return out
    return f

  with set_mesh(xy):
    a, b = reshard(x, P("X", None)), reshard(y, P())
    with pytest.raises(ValueError, match="PartitionSpec passed to einsum cannot contain axis names that are of type "
                                         r"Auto or Manual. Got PartitionSpec: P\('X', None\) with axis name: X of "
                                         "type: Auto"):
      g(P("X", None))(a, b)
    out = g(P(None, "Y"))(a, b)
  assert str(jax.typeof(out)) == "float32[8,4@Y]"
  np.testing.assert_allclose(np.asarray(out), x @ y, rtol=1e-5)
  # reshard outside a trace follows the block's types too.
  with use_abstract_mesh(am):
    with pytest.raises(ValueError, match="PartitionSpec passed to reshard cannot contain.*X of type: Auto"):
      reshard(x, jax.NamedSharding(xy, P("X", None)))


def test_use_abstract_mesh_holds_in_what_is_traced_inside_it_as_jax(xy):
  # jax.sharding.use_abstract_mesh (jax/_src/mesh.py) sets a thread-local config value that
  # get_abstract_mesh() reads and canonicalize_sharding checks specs against; tracing a jitted
  # function (pjit.py's _create_pjit_jaxpr: pe.trace_to_jaxpr, no mesh of its own) or a scan
  # body keeps it, so inside them the block's axis types hold (the einsum of
  # test_output_different_context_error refused in a jit nested in the block). shard_map enters
  # its own (the body's mesh, manual axes Manual), and auto_axes / explicit_axes enter the
  # block's mesh with their axes switched (pjit.py's _get_new_mesh: get_abstract_mesh()
  # .update_axis_types). The jit cache keys on it (it is part of JAX's trace context).
  from tessera.sharding import use_abstract_mesh, auto_axes
  am = xy.abstract_mesh.update_axis_types({"X": AxisType.Auto})
  seen = {}

  @jax.jit
  def inner(a, b):
    seen["jit"] = get_abstract_mesh()
    return jnp.einsum("xy,yz->xz", a, b, out_sharding=P("X", None))

  def outer(a, b):
    with use_abstract_mesh(am):
      def step(c, row):
        seen["scan"] = get_abstract_mesh()
        return c + row, row
      c, _ = jax.lax.scan(step, jnp.zeros((4,), jnp.float32), b)

      e = auto_axes(lambda x: (seen.__setitem__("auto_axes", get_abstract_mesh()), x * 2)[1], axes="Y",
                    out_sharding=P())(a)

      def body(x):
        seen["shard_map"] = get_abstract_mesh()
        return x * 2
      smap = jax.shard_map(body, mesh=xy, in_specs=P("X", None), out_specs=P("X", None))
      with pytest.raises(ValueError, match=r"The context mesh AbstractMesh\('X': 2, 'Y': 4, axis_types=\(Auto, "
                                           r"Explicit\)\) should match the mesh passed to shard_map"):
        smap(a)
      with use_abstract_mesh(xy.abstract_mesh):
        d = smap(a)
      return inner(a, b), c, d, e

  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  y = np.arange(16, dtype=np.float32).reshape(4, 4)
  with set_mesh(xy):
    a, b = reshard(x, P("X", None)), reshard(y, P())
    with pytest.raises(ValueError, match="PartitionSpec passed to einsum cannot contain axis names that are of type "
                                         r"Auto or Manual. Got PartitionSpec: P\('X', None\) with axis name: X of "
                                         "type: Auto"):
      jax.jit(outer)(a, b)
    assert seen["jit"] == am
    assert seen["scan"] == am
    assert seen["shard_map"] == xy.abstract_mesh.update_axis_types({"X": AxisType.Manual, "Y": AxisType.Manual})
    assert seen["auto_axes"] == am.update_axis_types({"Y": AxisType.Auto})
    # The same jitted function outside the block runs (X is Explicit there); inside it, the
    # cached trace is not reused.
    out = inner(a, b)
    assert str(jax.typeof(out)) == "float32[8@X,4]"
    np.testing.assert_allclose(np.asarray(out), x @ y, rtol=1e-5)
    assert seen["jit"] == xy.abstract_mesh
    with use_abstract_mesh(am):
      with pytest.raises(ValueError, match="PartitionSpec passed to einsum cannot contain axis names"):
        inner(a, b)
      assert seen["jit"] == am


def test_a_shard_map_without_mesh_takes_the_abstract_mesh_in_force_as_jax(xy):
  # jax/_src/shard_map.py's _shmap_checks: without mesh=, shard_map takes get_abstract_mesh()
  # (use_abstract_mesh's, here X Auto) with no check against the concrete mesh, and its body sees
  # that mesh with the manual axes Manual (_as_manual_mesh); the devices are the concrete mesh's
  # in force, else the arguments' (_shard_map_impl: get_concrete_mesh, get_mesh_from_args).
  # mesh= must still match it (the error in the test above).
  from tessera.sharding import use_abstract_mesh
  am = xy.abstract_mesh.update_axis_types({"X": AxisType.Auto})
  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  seen = []

  def body(b):
    seen.append(get_abstract_mesh())
    return b * 2

  with set_mesh(xy):
    a = reshard(x, P("X", "Y"))
    with use_abstract_mesh(am):
      out = jax.jit(jax.shard_map(body, in_specs=P("X", "Y"), out_specs=P("X", "Y")))(a)
      assert seen.pop() == am.update_axis_types({"X": AxisType.Manual, "Y": AxisType.Manual})
      np.testing.assert_array_equal(np.asarray(out), x * 2)
      out = jax.jit(jax.shard_map(body, in_specs=P(None, "Y"), out_specs=P(None, "Y"), axis_names={"Y"}))(a)
      assert seen.pop() == am.update_axis_types({"Y": AxisType.Manual})  # X stays Auto, as in force
      assert repr(am.update_axis_types({"Y": AxisType.Manual})) == \
          "AbstractMesh('X': 2, 'Y': 4, axis_types=(Auto, Manual))"
      np.testing.assert_array_equal(np.asarray(out), x * 2)
  # No concrete mesh in force: the committed argument's devices; none at all is an error.
  with use_abstract_mesh(am):
    out = jax.shard_map(body, in_specs=P("X", "Y"), out_specs=P("X", "Y"))(a)
    assert seen.pop() == am.update_axis_types({"X": AxisType.Manual, "Y": AxisType.Manual})
    assert out.sharding.mesh == xy
    np.testing.assert_array_equal(np.asarray(out), x * 2)
    with pytest.raises(ValueError, match=r"shard_map: the context mesh AbstractMesh\('X': 2, 'Y': 4, axis_types="
                                         r"\(Auto, Explicit\)\) has no devices"):
      jax.shard_map(body, in_specs=P("X", "Y"), out_specs=P("X", "Y"))(x)


def test_mesh_contexts_are_per_thread_as_jax(xy):
  # JAX's set_mesh and use_abstract_mesh set thread-local config values (swap_local in
  # jax/_src/sharding_impls.py's set_mesh and jax/_src/mesh.py's use_abstract_mesh): two threads
  # inside blocks of different meshes at once (a barrier holds both inside theirs) each see their
  # own, in get_abstract_mesh(), get_mesh(), a jitted function's trace and a mesh-less shard_map.
  import threading
  from tessera.sharding import get_mesh, use_abstract_mesh
  z = jax.make_mesh((8,), ("Z",), axis_types=AxisType.Auto)
  meshes = {0: (xy, xy.abstract_mesh.update_axis_types({"X": AxisType.Auto}), P("Y")),
            1: (z, z.abstract_mesh, P("Z"))}
  x = np.arange(16, dtype=np.float32)
  barrier = threading.Barrier(2, timeout=60)
  seen, errors = {}, []

  def run(k):
    mesh, am, spec = meshes[k]
    try:
      with set_mesh(mesh):
        barrier.wait()  # both threads have set their mesh
        seen[k, "mesh"] = get_mesh()
        with use_abstract_mesh(am):
          barrier.wait()  # both threads are inside their use_abstract_mesh blocks
          seen[k, "abstract"] = get_abstract_mesh()

          @jax.jit
          def f(a):
            seen[k, "jit"] = get_abstract_mesh()
            return jax.shard_map(lambda b: b * 2, in_specs=spec, out_specs=spec)(a)

          out = f(jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)))
          seen[k, "out"] = (out.sharding.mesh, np.asarray(out))
          barrier.wait()
    except Exception as e:  # noqa: BLE001 (reported below, in the test's thread)
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads)
  assert not errors, errors
  for k, (mesh, am, _) in meshes.items():
    assert seen[k, "mesh"] == mesh
    assert seen[k, "abstract"] == am
    assert seen[k, "jit"] == am
    assert seen[k, "out"][0] == mesh
    np.testing.assert_array_equal(seen[k, "out"][1], x * 2)
  assert get_mesh().empty and get_abstract_mesh().empty


# Unreduced specs (issue 16 item 2), after JAX's sharding-AD note ([AD]:
# docs/new_docs/301/sharding-ad.md in jax-ml/jax) and tests/array_test.py's test_pspec_unreduced.
def test_partition_spec_unreduced_and_reduced_as_jax(xy):
  # array_test.py test_pspec_unreduced: the reprs and equality.
  assert repr(P("a", "b", None, unreduced={"c"}, reduced={"d"})) == \
      "P('a', 'b', None, unreduced={'c'}, reduced={'d'}, unreduced_kind=sum)"
  assert repr(P("x", unreduced={"y"})) == "P('x', unreduced={'y'}, unreduced_kind=sum)"
  assert repr(P(None, unreduced={"x"})) == "P(None, unreduced={'x'}, unreduced_kind=sum)"
  assert repr(P(unreduced={"x"})) == "P(unreduced={'x'}, unreduced_kind=sum)"
  assert P("a", "b", None, unreduced={"c"}) == P("a", "b", None, unreduced={"c"})
  assert P("a", "b", None, unreduced={"c"}) != P("a", "b", None, unreduced={"d"})
  assert P("a", unreduced={"c"}) != P("a")
  assert P("a", unreduced={"c"}).unreduced == frozenset({"c"}) and P("a").unreduced == frozenset()
  # partition_spec.py's _check and _canonicalize_ur.
  with pytest.raises(ValueError, match="`unreduced` and `reduced` argument to PartitionSpec cannot overlap"):
    P(unreduced={"a"}, reduced={"a"})
  with pytest.raises(ValueError, match="partitions cannot overlap with unreduced axes passed to PartitionSpec"):
    P("a", None, unreduced={"a"})
  with pytest.raises(TypeError, match="unreduced argument of PartitionSpec should of type `frozenset` or `set`"):
    P(unreduced=["a"])
  # named_sharding.py's _check_mesh_unreduced: only Explicit axes of the mesh.
  auto = jax.make_mesh((2, 4), ("X", "Y"), axis_types=AxisType.Auto)
  with pytest.raises(ValueError, match="Unreduced axes can only refer to mesh axes that is of type `Explicit`"):
    jax.sharding.NamedSharding(auto, P(unreduced={"Y"}))._cpp.validate((4, 4))


def _contraction_split_over_y(seed):
  """a (4, 8) and b (8, 4) on the host, and as A = a split over Y along its columns and B = b
  along its rows (on the ambient mesh), so that A @ B sums over Y."""
  rng = np.random.default_rng(seed)
  a = rng.standard_normal((4, 8)).astype(np.float32)
  b = rng.standard_normal((8, 4)).astype(np.float32)
  return a, b, reshard(a, P(None, "Y")), reshard(b, P("Y", None))


def test_device_put_unreduced_via_jit_as_jax():
  # JAX's tests/pjit_test.py test_device_put_unreduced_via_jit: jnp.arange(4) (uncommitted)
  # put onto P(unreduced={'x'}) of a (2,) Explicit mesh holds the value on the first device and
  # zeros on the second; numpy data likewise; resharded to P() it is the value again.
  mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
  with set_mesh(mesh):
    for arr in (jnp.arange(4), np.arange(4, dtype=np.int32)):
      out = jax.device_put(arr, P(unreduced={"x"}))
      assert jax.typeof(out).sharding.spec.unreduced == {"x"}
      shards = sorted(out.addressable_shards, key=lambda s: list(mesh.device_ids.flat).index(s.device.id))
      for s, ex_s in zip(shards, [np.arange(4), np.zeros((4,))]):
        np.testing.assert_array_equal(s.data, ex_s)
      np.testing.assert_array_equal(np.asarray(reshard(out, P())), np.arange(4))


def test_device_put_unreduced_via_runtime_transfer_as_jax():
  # JAX's tests/pjit_test.py test_device_put_unreduced_via_runtime_transfer, with the target
  # mesh on the same two devices in the other order (device 1 must get device 0's term, not
  # keep its own): each shard of the result is x's shard at the same place, and both sum to
  # the same value.
  from tessera.sharding import Mesh, NamedSharding
  devs = jax.devices()
  mesh = Mesh(np.array(devs[:2]), "x", (AxisType.Explicit,))
  arr1 = jax.device_put(jnp.arange(8, dtype=jnp.float32).reshape(2, 4), NamedSharding(mesh, P(None, "x")))
  arr2 = jax.device_put(jnp.arange(8, dtype=jnp.float32).reshape(4, 2), NamedSharding(mesh, P("x", None)))
  x = jnp.dot(arr1, arr2, out_sharding=NamedSharding(mesh, P(unreduced={"x"})))
  other = Mesh(np.array([devs[1], devs[0]]), "x", (AxisType.Explicit,))
  out = jax.device_put(x, NamedSharding(other, P(unreduced={"x"})))
  assert jax.typeof(out).sharding.spec.unreduced == {"x"}
  assert out.sharding == NamedSharding(other, P(unreduced={"x"}))
  by_place = lambda a, m: sorted(a.addressable_shards, key=lambda s: list(m.device_ids.flat).index(s.device.id))
  a, b = np.arange(8.0).reshape(2, 4), np.arange(8.0).reshape(4, 2)
  for k, (s1, s2) in enumerate(zip(by_place(x, mesh), by_place(out, other))):
    np.testing.assert_array_equal(s1.data, a[:, 2 * k:2 * k + 2] @ b[2 * k:2 * k + 2])  # x's term k
    np.testing.assert_array_equal(s1.data, s2.data)
  np.testing.assert_array_equal(np.asarray(reshard(x, NamedSharding(mesh, P()))),
                                np.asarray(reshard(out, NamedSharding(other, P()))))
  np.testing.assert_array_equal(np.asarray(reshard(out, NamedSharding(other, P()))), a @ b)


def test_unreduced_contraction_as_the_sharding_ad_note(xy):
  with set_mesh(xy):
    a, b, A, B = _contraction_split_over_y(7)
    # [AD]: einsum(..., out_sharding=jax.P(None, None, unreduced={'X'})) is float32[2,2]{U:X}.
    c = jnp.einsum("ij,jk->ik", A, B, out_sharding=P(None, None, unreduced={"Y"}))
    assert str(jax.typeof(c)) == "float32[4,4]{U:Y}"
    assert jax.typeof(c).sharding.spec.unreduced == {"Y"}  # [AD]'s capstone assert
    # [AD]: "each device along X holds a full-shape partial sum": device at Y position k sums
    # over rows 2k, 2k+1 of b.
    for shard in c.addressable_shards:
      k = list(xy.device_ids.flat).index(shard.device.id) % 4
      np.testing.assert_allclose(shard.data, a[:, 2 * k:2 * k + 2] @ b[2 * k:2 * k + 2], rtol=1e-5, atol=1e-5)
    # [AD]: "To cash it in, reshard to an ordinary sharding".
    np.testing.assert_allclose(np.asarray(reshard(c, P(None, None))), a @ b, rtol=1e-4, atol=1e-4)
    # [AD]: c + c2 of two unreduced matmuls is unreduced; cos(c) raises.
    seen = []

    @jax.jit
    def lora(A, B):
      c1 = jnp.einsum("ij,jk->ik", A, B, out_sharding=P(None, None, unreduced={"Y"}))
      c2 = jnp.einsum("ij,jk->ik", 2. * A, B, out_sharding=P(None, None, unreduced={"Y"}))
      seen.append(str(jax.typeof(c1 + c2)))
      return reshard(c1 + c2, P("Y", None))

    out = lora(A, B)
    assert seen == ["float32[4,4]{U:Y}"]
    assert str(jax.typeof(out)) == "float32[4@Y,4]"
    np.testing.assert_allclose(np.asarray(out), 3 * (a @ b), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="cos: unreduced rule for cos is not implemented"):
      jax.jit(lambda c: jnp.cos(c))(c)


# The linear ops JAX lets an unreduced value through (jax/_src/lax/lax.py: _transpose_ur_rule,
# _reshape_unreduced_rule, _reduce_sum_ur_rule) keep it unreduced; `c * 2.` is refused, as JAX's
# _mul_ur_rule refuses a factor not reduced over the same axes.
def test_unreduced_values_pass_through_linear_ops(xy):
  with set_mesh(xy):
    a, b, A, B = _contraction_split_over_y(8)
    seen = []

    @jax.jit
    def f(A, B):
      c = jnp.einsum("ij,jk->ik", A, B, out_sharding=P(None, None, unreduced={"Y"}))
      t = jnp.sum(jnp.reshape(c.T, (2, 8)), axis=0)
      seen.append(str(jax.typeof(t)))
      return t

    t = f(A, B)
    assert seen == ["float32[8]{U:Y}"]
    assert jax.typeof(t).sharding.spec.unreduced == {"Y"}
    np.testing.assert_allclose(np.asarray(reshard(t, P(None))), ((a @ b).T.reshape(2, 8)).sum(axis=0),
                               rtol=1e-4, atol=1e-4)
    c = jnp.einsum("ij,jk->ik", A, B, out_sharding=P(None, None, unreduced={"Y"}))
    with pytest.raises(ValueError, match="mul: RHS should be reduced along the same axes LHS is unreduced on"):
      jax.jit(lambda c: c * 2.)(c)


# Reduced types (issue 16; [AD] "reduced {R:X} -> unreduced {U:X}", tests/pjit_test.py in
# jax-ml/jax) from Python, on the (4, 2) and (2, 4) meshes: device_put onto P(..., reduced=...)
# places the value replicated, typeof prints {R:...} with the axes in the mesh's order (core.py's
# _vma_ur_str: order_wrt_mesh), a jit with a reduced argument keeps it reduced through
# elementwise ops, max (lax.py's _reduce_max_ur_rule) and a gather (slicing.py's
# _gather_reduced_rule; test_gather_reduced_fwd_unreduced_bwd), and its gradient is unreduced
# over the same axes (test_reduced_sin_fwd_mul_bwd), summing by reshard to numpy's gradient.
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_reduced_values_as_jax(shape):
  rng = np.random.default_rng(21)
  v = rng.standard_normal((8, 4)).astype(np.float32)
  # The mesh's order, not sorted: ('y', 'x') prints {R:(y,x)}.
  yx = jax.make_mesh(shape, ("y", "x"), axis_types=(AxisType.Explicit, AxisType.Explicit))
  with set_mesh(yx):
    both = jax.device_put(v[:, 0], P(None, reduced={"x", "y"}))
    assert str(jax.typeof(both)) == "float32[8]{R:(y,x)}"
    assert jax.typeof(both).sharding.spec.reduced == {"x", "y"}
  mesh = jax.make_mesh(shape, ("x", "y"), axis_types=(AxisType.Explicit, AxisType.Explicit))
  with set_mesh(mesh):
    x = jax.device_put(v, P(None, "y", reduced={"x"}))
    assert str(jax.typeof(x)) == "float32[8,4@y]{R:x}"
    assert x.sharding.spec == P(None, "y", reduced={"x"})
    for shard in x.addressable_shards:  # replicated over 'x': each device its block along 'y'
      k = list(mesh.device_ids.flat).index(shard.device.id) % shape[1]
      n = 4 // shape[1]
      np.testing.assert_array_equal(shard.data, v[:, k * n:(k + 1) * n])
    idx = jax.device_put(np.array([0, 3, 3, 6], dtype=np.int32), P())
    seen = []

    @jax.jit
    def f(x, idx):
      y = jnp.sin(x) * 2.
      m = jnp.max(y, axis=1)
      r = y.at[idx].get()
      seen.extend(str(jax.typeof(a)) for a in (x, y, m, r))
      return y, m, r

    y, m, r = f(x, idx)
    assert seen == ["float32[8,4@y]{R:x}", "float32[8,4@y]{R:x}", "float32[8]{R:x}", "float32[4,4@y]{R:x}"]
    assert y.sharding.spec == P(None, "y", reduced={"x"})
    np.testing.assert_allclose(np.asarray(y), np.sin(v) * 2., rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(m), (np.sin(v) * 2.).max(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(r), (np.sin(v) * 2.)[[0, 3, 3, 6]], rtol=1e-5, atol=1e-5)

    def loss(x, idx):
      y = jnp.sin(x)
      return jnp.sum(y * y) + jnp.sum(x.at[idx].get())

    g = jax.jit(jax.grad(loss))(x, idx)
    assert g.sharding.spec == P(None, "y", unreduced={"x"})
    assert str(jax.typeof(g)) == "float32[8,4@y]{U:x}"
    want = 2. * np.sin(v) * np.cos(v)
    np.add.at(want, [0, 3, 3, 6], 1.)
    np.testing.assert_allclose(np.asarray(reshard(g, P(None, "y"))), want, rtol=1e-4, atol=1e-4)
    # An op JAX has no reduced rule for refuses it (lax/utils.py's call_ur_rule).
    with pytest.raises(ValueError, match="cumsum: unreduced/reduced rule for cumsum is not implemented"):
      jax.jit(lambda x: jnp.cumsum(x, axis=0))(x)


# The casts to reduced and unreduced axes in a shard_map body, from Python (tests/shard_map_test.py
# in jax-ml/jax): test_eager_reduced_out (all_gather(..., tiled=True, to='reduced') of a P('x')
# array is P(None, reduced={'x'}) and the array itself; its gradient P('x') of ones) and
# test_eager_unreduced_out (pcast(x, 'x', to='unreduced'): P(None, unreduced={'x'}), resharded
# to P() arange(4) + arange(4, 8); its gradient P('x')), eager and under jit alike.
def test_shard_map_casts_to_reduced_and_unreduced_as_jax():
    mesh = jax.make_mesh((2,), ("x",))
    with set_mesh(mesh):  # jtu.with_explicit_mesh
        arr = jax.device_put(np.arange(8.0, dtype=np.float32), jax.NamedSharding(mesh, P("x")))
        f = jax.shard_map(lambda x: jax.lax.all_gather(x, "x", tiled=True, to="reduced"), mesh=mesh,
                          out_specs=P(reduced={"x"}))
        for out in (f(arr), jax.jit(f)(arr)):
            assert out.sharding.spec == P(None, reduced={"x"})
            np.testing.assert_array_equal(np.asarray(out), np.arange(8.0))
        g = jax.jit(jax.grad(lambda x: f(x).sum()))(arr)
        assert g.sharding.spec == P("x")
        np.testing.assert_array_equal(np.asarray(g), np.ones(8))
        u = jax.shard_map(lambda x: jax.lax.pcast(x, "x", to="unreduced"), mesh=mesh, out_specs=P(unreduced={"x"}))
        for out in (u(arr), jax.jit(u)(arr)):
            assert out.sharding.spec == P(None, unreduced={"x"})
            np.testing.assert_array_equal(np.asarray(reshard(out, P())), np.arange(4.0) + np.arange(4.0, 8.0))
        g = jax.jit(jax.grad(lambda x: reshard(u(x), P()).sum()))(arr)
        assert g.sharding.spec == P("x")
        with pytest.raises(ValueError, match="Got unexpected `to` value for `jax.lax.all_gather`"):
            jax.shard_map(lambda x: jax.lax.all_gather(x, "x", to="sideways"), mesh=mesh, out_specs=P())(arr)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_all_gather_to_invarying_as_jax(axis_type):
    # tests/shard_map_test.py test_all_gather_invariant_basic (jtu.create_mesh((4,), 'x')): the
    # result of all_gather(..., to='invarying') (all_gather_invariant) is typed invariant
    # (`out.aval.mat.varying == set()`), out_specs=P() takes it, its value is the argument, and
    # the gradient of its sum is laid out as the argument. Both axis types: JAX types manual axes
    # on any mesh. The gradient of sum(sin(.)) against the host's cos.
    mesh = jax.make_mesh((4,), ("x",), axis_types=(axis_type,))
    arr = jax.device_put(np.arange(8.0, dtype=np.float32), jax.NamedSharding(mesh, P("x")))
    seen = []

    def body(a):
        out = jax.lax.all_gather(a, "x", tiled=True, to="invarying")
        seen.append(set(jax.typeof(out).mat.varying))
        return out

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
    out = f(arr)
    assert seen == [set()]
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0))
    g = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x)))))(arr)
    assert g.shape == (8,)
    assert g.sharding.spec == P("x")
    np.testing.assert_allclose(np.asarray(g), np.cos(np.arange(8.0)), rtol=1e-5)
    # The plain all_gather is typed varying (Varying -> Varying): out_specs=P() is refused.
    with pytest.raises(ValueError, match="may differ along mesh axis 'x'"):
        jax.jit(jax.shard_map(lambda a: jax.lax.all_gather(a, "x", tiled=True), mesh=mesh, in_specs=P("x"),
                              out_specs=P()))(arr)


def test_vmap_of_the_casts_jax_does_not_batch_is_not_implemented():
    # jax/_src/lax/parallel.py: the batching rules of preduced, vary_unreduced_cast,
    # reduced_vary_cast and all_gather_reduced raise NotImplementedError; pvary's and
    # all_gather_invariant's batch.
    mesh = jax.make_mesh((2,), ("x",))
    with set_mesh(mesh):
        host = np.arange(16.0, dtype=np.float32).reshape(4, 4)

        def run(cast, in_specs=P(None, "x"), out_specs=P(None, "x")):
            rows = jax.device_put(host, jax.NamedSharding(mesh, in_specs))
            return jax.jit(jax.shard_map(lambda a: jax.vmap(cast)(a), mesh=mesh, in_specs=in_specs,
                                         out_specs=out_specs))(rows)

        with pytest.raises(NotImplementedError, match="vary_unreduced_cast"):
            run(lambda r: jax.lax.pcast(r, "x", to="unreduced"))
        with pytest.raises(NotImplementedError, match="preduced"):
            run(lambda r: jax.lax.pcast(r, "x", to="reduced"), in_specs=P())
        with pytest.raises(NotImplementedError, match="Please file an issue at https://github.com/jax-ml/jax/issues"):
            run(lambda r: jax.lax.all_gather(r, "x", tiled=True, to="reduced"))
        gathered = run(lambda r: jax.lax.all_gather(r, "x", tiled=True, to="invarying"), out_specs=P())
        np.testing.assert_array_equal(np.asarray(gathered), np.arange(16.0).reshape(4, 4))


def test_vmap_of_the_unreduced_sums_jax_does_not_batch_is_not_implemented():
    # jax/_src/lax/parallel.py: psum / psum_scatter of a value unreduced over their axes are
    # unreduced_psum / unreduced_reduce_scatter, whose batching rules raise NotImplementedError
    # (fancy_primitive_batchers: for an operand vmap does not map too, as all_gather_reduced's);
    # preduced of a gather over other axes is refused as preduced; psum of a value that is not
    # unreduced batches.
    mesh = jax.make_mesh((2, 2), ("x", "y"))
    with set_mesh(mesh):
        host = np.arange(32.0, dtype=np.float32).reshape(4, 8)

        def run(f, unreduced=True, out_specs=P()):
            rows = jax.device_put(host, jax.NamedSharding(mesh, P(None, "x")))

            def body(v):
                u = jax.lax.pcast(v, "x", to="unreduced") if unreduced else v
                return jax.vmap(lambda r: f(r, v))(u)

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "x"), out_specs=out_specs))(rows)

        with pytest.raises(NotImplementedError, match="batching rule for unreduced_psum raises"):
            run(lambda r, v: jax.lax.psum(r, "x"))
        with pytest.raises(NotImplementedError, match="unreduced_reduce_scatter raises NotImplementedError: Please file"):
            run(lambda r, v: jax.lax.psum_scatter(r, "x", tiled=True), out_specs=P(None, "x"))
        with pytest.raises(NotImplementedError, match="of a value it does not map: JAX's batching rule for unreduced_psum"):
            run(lambda r, v: r + jnp.sum(jax.lax.psum(jax.lax.pcast(v, "x", to="unreduced"), "x")), unreduced=False,
                out_specs=P(None, "x"))
        with pytest.raises(NotImplementedError, match="batching rule for preduced raises"):
            run(lambda r, v: jax.lax.pcast(jax.lax.all_gather(r, "x", tiled=True), "y", to="reduced"), unreduced=False)
        summed = run(lambda r, v: jax.lax.psum(r, "x"), unreduced=False)
        np.testing.assert_array_equal(np.asarray(summed), host[:, :4] + host[:, 4:])


def test_collectives_of_an_unreduced_or_reduced_value_name_the_pvary_jax_inserts():
    # jax/_src/lax/parallel.py: all_gather, ppermute, all_to_all (and psum and its kin of a
    # reduced value) first cast x to varying (insert_collective_pvary), whose
    # check_unreduced_args refuses it: "pvary cannot accept args which are unreduced".
    mesh = jax.make_mesh((2,), ("x",))
    with set_mesh(mesh):
        rows = jax.device_put(np.arange(8.0, dtype=np.float32).reshape(2, 4), jax.NamedSharding(mesh, P(None, "x")))

        def run(f):
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(None, "x"), out_specs=P()))(rows)

        unreduced = lambda v: jax.lax.pcast(v, "x", to="unreduced")
        reduced = lambda v: jax.lax.pcast(jax.lax.psum(v, "x"), "x", to="reduced")
        for f in (lambda v: jax.lax.all_gather(unreduced(v), "x", tiled=True),
                  lambda v: jax.lax.ppermute(unreduced(v), "x", [(0, 1), (1, 0)])):
            with pytest.raises(ValueError, match=r"pvary cannot accept args which are unreduced. Got f32\[2,2\]\{U:x\} "
                               r"and axes=\{'x'\}"):
                run(f)
        with pytest.raises(ValueError, match=r"pvary cannot accept args which are reduced. Got f32\[2,2\]\{R:x\}"):
            run(lambda v: jax.lax.psum(reduced(v), "x"))

# shard_map and tessera.lax's collectives: the matmuls of JAX's shard_map notebook ([SM],
# "So, let's see a shard_map!" and the psum_scatter variant), nearly verbatim, and each
# collective against numpy. [SM] https://docs.jax.dev/en/latest/notebooks/shard_map.html
from functools import partial

import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera import shard_map
from tessera.sharding import NamedSharding, PartitionSpec as P, AxisType


def test_shard_map_notebook_matmuls():
  mesh = jax.make_mesh((4, 2), ('x', 'y'))

  a = jnp.arange( 8 * 16.).reshape(8, 16)
  b = jnp.arange(16 * 4.).reshape(16, 4)

  @partial(shard_map, mesh=mesh, in_specs=(P('x', 'y'), P('y', None)),
           out_specs=P('x', None))
  def matmul_basic(a_block, b_block):
    # a_block: f32[2, 8]
    # b_block: f32[8, 4]
    c_partialsum = jnp.dot(a_block, b_block)
    c_block = jax.lax.psum(c_partialsum, 'y')
    # c_block: f32[2, 4]
    return c_block

  c = matmul_basic(a, b)   # c: f32[8, 4]
  np.testing.assert_allclose(np.asarray(c), a @ b, rtol=1e-6)
  assert c.sharding.spec == P('x', None)

  @partial(shard_map, mesh=mesh, in_specs=(P('x', 'y'), P('y', None)),
           out_specs=P('x', 'y'))
  def matmul_reduce_scatter(a_block, b_block):
    # c_partialsum: f32[8/X, 4]
    c_partialsum = jnp.matmul(a_block, b_block)
    # c_block: f32[8/X, 4/Y]
    c_block = jax.lax.psum_scatter(c_partialsum, 'y', scatter_dimension=1, tiled=True)
    return c_block

  c = matmul_reduce_scatter(a, b)
  np.testing.assert_allclose(np.asarray(c), a @ b, rtol=1e-6)
  assert c.sharding.spec == P('x', 'y')


def test_collectives_against_numpy(mesh8):
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    blocks = x.reshape(8, 1, 3)
    sm = partial(shard_map, mesh=mesh8, in_specs=P("x"), out_specs=P("x"))
    gathered = sm(lambda b: jax.lax.all_gather(b, "x", axis=0, tiled=True)[None])(x)
    np.testing.assert_array_equal(np.asarray(gathered).reshape(8, 8, 3), np.broadcast_to(x, (8, 8, 3)))
    shifted = sm(lambda b: jax.lax.ppermute(b, "x", [(i, (i + 1) % 8) for i in range(8)]))(x)
    np.testing.assert_array_equal(np.asarray(shifted), np.roll(x, 1, axis=0))
    idx = sm(lambda b: b * 0 + jax.lax.axis_index("x").astype(jnp.float32))(x)
    np.testing.assert_array_equal(np.asarray(idx)[:, 0], np.arange(8))
    total = shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P())(x)
    np.testing.assert_allclose(np.asarray(total), x.sum(0, keepdims=True))
    size = sm(lambda b: b * 0 + jax.lax.psum(1, "x"))(x)
    assert np.asarray(size)[0, 0] == 8
    # Several outputs under one out_spec (a prefix), and a pytree of inputs.
    two = sm(lambda t: (t["a"] * 2, jax.lax.pmax(t["a"], "x")))({"a": x})
    np.testing.assert_array_equal(np.asarray(two[0]), x * 2)
    np.testing.assert_array_equal(np.asarray(two[1]), np.broadcast_to(x.max(0), (8, 3)))


def test_shard_map_inside_jit_and_its_errors(mesh):
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    body = shard_map(lambda b: jax.lax.psum(b.sum(axis=1, keepdims=True), "model"), mesh=mesh,
                     in_specs=P("data", "model"), out_specs=P("data", None))
    f = jax.jit(lambda x: jnp.tanh(body(x * 0.01)))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    np.testing.assert_allclose(np.asarray(f(xs)), np.tanh((x * 0.01).sum(1, keepdims=True)), rtol=1e-5)
    # check_vma: a result not replicated over an axis its out_spec leaves out.
    bad = shard_map(lambda b: b, mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", None))
    with pytest.raises(ValueError, match="replicated|model"):
        bad(xs)
    with pytest.raises(ValueError, match="nope"):
        shard_map(lambda b: jax.lax.psum(b, "nope"), mesh=mesh, in_specs=P("data"), out_specs=P("data"))(xs)


def test_several_outputs_under_one_spec_inside_jit(mesh8):
    x = np.arange(8 * 2, dtype=np.float32).reshape(8, 2)
    body = shard_map(lambda b: (b + 1, jax.lax.psum(b, "x") * 0 + b * 2), mesh=mesh8, in_specs=P("x"),
                     out_specs=P("x"))
    # (A numpy argument would go to device 0, not to the body's mesh: put it there first.)
    a, b = jax.jit(lambda x: body(x))(jax.device_put(x, NamedSharding(mesh8, P("x"))))
    np.testing.assert_array_equal(np.asarray(a), x + 1)
    np.testing.assert_array_equal(np.asarray(b), x * 2)
    # device_get and block_until_ready over a pytree of outputs.
    host = jax.device_get(jax.block_until_ready({"a": a, "b": [b]}))
    assert isinstance(host["b"][0], np.ndarray)
    np.testing.assert_array_equal(host["a"], x + 1)


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_axis_names_manual_over_some_axes(shape):
  # JAX >= 0.9's partial-manual shard_map (tests/shard_map_test.py's test_partial_auto):
  # manual over 'x' only; 'y' stays automatic around and inside the body.
  from tessera.sharding import AxisType
  mesh = jax.make_mesh(shape, ('x', 'y'), axis_types=(AxisType.Auto,) * 2)
  x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
  w = np.linspace(-1, 1, 8 * 4, dtype=np.float32).reshape(8, 4)

  @partial(jax.shard_map, mesh=mesh, in_specs=(P('x', None), P()), out_specs=(P('x', None), P(), P('x')),
           axis_names={'x'})
  def body(xb, wb):
    h = jnp.tanh(xb @ wb)
    return h, jax.lax.psum(h.sum(axis=0), 'x'), jax.lax.axis_index('x').reshape(1)

  @jax.jit
  def f(x, w):
    h, s, i = body(x * 2, w)
    return jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(None, 'y'))), s, i

  h, s, i = f(jax.device_put(x, NamedSharding(mesh, P('x', 'y'))), jax.device_put(w, NamedSharding(mesh, P())))
  want = np.tanh((x * 2) @ w)
  np.testing.assert_allclose(np.asarray(h), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(s), want.sum(0), rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(i), np.arange(shape[0]))

  # The specs may name only the manual axes, as JAX's _check_specs says.
  with pytest.raises(ValueError, match="in_specs argument must refer to an axis marked as manual.*refers to 'y'"):
    jax.shard_map(lambda b: b, mesh=mesh, in_specs=P('x', 'y'), out_specs=P('x'), axis_names={'x'})(x)
  with pytest.raises(ValueError, match="unbound axis name: y"):
    jax.shard_map(lambda b: jax.lax.psum(b, 'y'), mesh=mesh, in_specs=P('x'), out_specs=P('x'),
                  axis_names={'x'})(x)
  with pytest.raises(TypeError, match="frozenset"):
    jax.shard_map(lambda b: b, mesh=mesh, in_specs=P('x'), out_specs=P('x'), axis_names=['x'])


def test_nested_shard_map_as_jax_tests_it():
  # tests/shard_map_test.py test_nested_partial_auto: the outer shard_map manual over 'i'
  # (axis_names={'i'}), the inner one with the default axis_names manual over 'j' too; v * v.
  from tessera.sharding import AxisType, get_abstract_mesh, set_mesh
  mesh = jax.make_mesh((2, 2), ('i', 'j'), axis_types=(AxisType.Auto,) * 2)
  v = np.arange(32.0, dtype=np.float32).reshape(4, 8)

  def h(x):
    return jax.shard_map(lambda y: y * y, in_specs=P(None, 'j'), out_specs=P(None, 'j'))(x)

  @jax.jit
  def f(x):
    return jax.shard_map(h, in_specs=P('i', None), out_specs=P('i', None), check_vma=False,
                         axis_names=frozenset({'i'}))(x)

  with set_mesh(mesh):
    np.testing.assert_array_equal(np.asarray(f(jax.device_put(v, NamedSharding(mesh, P('i', 'j'))))), v * v)

  # The same on Explicit axes: the types follow jax/_src/shard_map.py's _shard_shaped_array
  # (a manual axis leaves the spec, an Explicit automatic one stays: f32[2,8@j] in the outer
  # body, varying along 'i'; f32[2,4] inside, varying along both) and _unshard_shaped_array
  # (the inner out_spec's 'j' back in the type); the result is laid out P('i', 'j').
  explicit = jax.make_mesh((2, 2), ('i', 'j'), axis_types=(AxisType.Explicit,) * 2)
  types = []

  def g_typed(y):
    types.append(str(jax.typeof(y)))
    return y * y

  def h_typed(x):
    out = jax.shard_map(g_typed, in_specs=P(None, 'j'), out_specs=P(None, 'j'))(x)
    types.extend([str(jax.typeof(x)), str(jax.typeof(out))])
    return out

  with set_mesh(explicit):
    out = jax.jit(jax.shard_map(h_typed, in_specs=P('i', None), out_specs=P('i', None), axis_names=frozenset({'i'})))(
        jax.device_put(v, NamedSharding(explicit, P('i', 'j'))))
  np.testing.assert_array_equal(np.asarray(out), v * v)
  assert out.sharding.spec == P('i', 'j')
  assert types == ['float32[2,4]{V:(i,j)}', 'float32[2,8@j]{V:i}', 'float32[2,8@j]{V:i}']

  # test_grad_nested_partial_auto and _with_residuals: the gradients of the sums, 2v and 3v^2.
  for inner_f, want in [(lambda y: y * y, 2 * v), (lambda y: y * y * y, 3 * v * v)]:
    def h2(x, inner_f=inner_f):
      return jax.shard_map(inner_f, in_specs=P(None, 'j'), out_specs=P(None, 'j'))(x)

    @jax.jit
    def total(x, h2=h2):
      return jax.shard_map(h2, in_specs=P('i', None), out_specs=P('i', None), check_vma=False,
                           axis_names=frozenset({'i'}))(x).sum()

    with set_mesh(mesh):
      got = jax.grad(total)(jax.device_put(v, NamedSharding(mesh, P('i', 'j'))))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)

  # test_nested_partial_auto_1d on (2, 2, 2): the manual and automatic axes in each body, the
  # varying axes of the values (its four parameter sets), and the result.
  mesh3 = jax.make_mesh((2, 2, 2), ('x', 'y', 'z'), axis_types=(AxisType.Auto,) * 3)
  for dim1, dim2, outer_vma, inner_vma in [('x', 'y', {'x'}, {'x', 'y'}), (None, 'y', set(), {'y'}),
                                           ('x', None, {'x'}, {'x'}), (None, None, set(), set())]:
    seen = []

    def g(x):
      m = get_abstract_mesh()
      out = x * x
      seen.append(('inner', m.manual_axes, m.auto_axes, set(jax.typeof(x).mat.varying),
                   set(jax.typeof(out).mat.varying)))
      return out

    def h3(x, dim2=dim2):
      m = get_abstract_mesh()
      out = jax.shard_map(g, in_specs=P(None, dim2), out_specs=P(None, dim2), axis_names={'y'})(x)
      seen.append(('outer', m.manual_axes, m.auto_axes, set(jax.typeof(x).mat.varying),
                   set(jax.typeof(out).mat.varying)))
      return out

    @jax.jit
    def f3(x, dim1=dim1):
      return jax.shard_map(h3, in_specs=P(dim1, None), out_specs=P(dim1, None), axis_names={'x'})(x)

    with set_mesh(mesh3):
      out = f3(jax.device_put(v, NamedSharding(mesh3, P(dim1, dim2))))
    np.testing.assert_array_equal(np.asarray(out), v * v)
    assert seen == [('inner', ('x', 'y'), ('z',), inner_vma, inner_vma),
                    ('outer', ('x',), ('y', 'z'), outer_vma, outer_vma)], (dim1, dim2)


def test_axis_names_body_is_split_over_the_automatic_axes():
  # JAX's tests/shard_map_test.py, test_partial_auto_propagate_through: a body manual over 'j'
  # and 'k' constrains x * x over its automatic axis 'i'; the result is v * v, laid out P('i').
  from tessera.sharding import AxisType
  mesh = jax.make_mesh((2, 2, 2), ('i', 'j', 'k'), axis_types=(AxisType.Auto,) * 3)
  sharding = NamedSharding(mesh, P('i'))

  def g(x):
    return jax.lax.with_sharding_constraint(x * x, sharding)

  @jax.jit
  def f(x):
    return jax.shard_map(g, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False,
                         axis_names=frozenset({'j', 'k'}))(x)

  v = np.arange(32.0, dtype=np.float32).reshape(4, 8)
  actual = f(jax.device_put(v, sharding))
  np.testing.assert_array_equal(np.asarray(actual), v * v)
  assert actual.sharding.spec == P('i', None)

  # test_partial_auto_error_wsc_manual: a constraint naming a manual axis is refused.
  mesh2 = jax.make_mesh((2, 2), ('i', 'j'), axis_types=(AxisType.Auto,) * 2)

  def h(x):
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh2, P('i', 'j'))) * x

  with pytest.raises(ValueError, match="manual"):
    jax.jit(lambda x: jax.shard_map(h, mesh=mesh2, in_specs=P('i', None), out_specs=P('i', None), check_vma=False,
                                    axis_names=frozenset({'i'}))(x))(v)


def test_axis_names_on_explicit_axes_keep_the_automatic_split():
  # On Explicit axes (make_mesh's default) an argument P('x', 'y') enters a body manual over 'x'
  # as its type says without 'y' (jax/_src/shard_map.py's _manual_spec), stays split over 'y'
  # inside, and results leave split over 'x' then 'y' (tests/shard_map_test.py's
  # test_partial_auto_explicit_multi_explicit: P(('i', 'l'), ('j', 'k'), ...)). Its gradient is
  # laid out as its primal, 3 x^2 for x^3.
  mesh = jax.make_mesh((4, 2), ('x', 'y'))
  x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) / 100
  xs = jax.device_put(x, NamedSharding(mesh, P('x', 'y')))

  def body(a):
    return jnp.tanh(a * 2.0), (a * a).sum(axis=0)

  f = jax.jit(lambda a: jax.shard_map(body, mesh=mesh, in_specs=(P('x', None),), out_specs=(P('x', None), P('x')),
                                      axis_names={'x'})(a))
  h, s = f(xs)
  np.testing.assert_allclose(np.asarray(h), np.tanh(x * 2), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(s), (x * x).reshape(4, 4, 8).sum(1).reshape(-1), rtol=1e-4)
  assert h.sharding.spec == P('x', 'y')
  assert s.sharding.spec == P(('x', 'y'))

  def loss(a):
    return jax.shard_map(lambda b: b * b * b, mesh=mesh, in_specs=P('x', None), out_specs=P('x', None),
                         axis_names={'x'})(a).sum()

  g = jax.jit(jax.grad(loss))(xs)
  np.testing.assert_allclose(np.asarray(g), 3 * x * x, rtol=1e-5, atol=1e-6)
  assert g.sharding.spec == P('x', 'y')


# Varying manual axes (JAX's vma) and lax.pvary / lax.pcast, from the shard_map notebook
# (docs/notebooks/shard_map.md at JAX cec06d1, "Tracking how values vary over manual mesh
# axes"): its comments give the types printed, and jax/_src/lax/parallel.py the rules
# (_pvary_abstract_eval, _pvary_transpose_rule: a psum; pcast's _get_from).
def test_typeof_shows_varying_axes_as_the_notebook_prints_them():
  mesh = jax.make_mesh((4, 2), ('i', 'j'))
  seen = {}

  @partial(shard_map, mesh=mesh, in_specs=P('i', 'j'), out_specs=P('i'))
  def f(x):
    seen['x'] = jax.typeof(x)
    y = jax.lax.psum(x, 'j')
    seen['y'] = jax.typeof(y)
    return y

  x = jax.device_put(np.arange(8 * 4.).reshape(8, 4), NamedSharding(mesh, P('i', 'j')))
  out = f(x)
  assert str(seen['x']) == 'float32[2,2]{V:(i,j)}'
  assert seen['x'].manual_axis_type.varying == {'i', 'j'}
  assert str(seen['y']) == 'float32[2,2]{V:i}'
  assert seen['y'].manual_axis_type.varying == {'i'} and seen['y'].mat.varying == {'i'}
  want = np.arange(8 * 4.).reshape(8, 2, 2).sum(1)  # each row's two column blocks summed
  np.testing.assert_allclose(np.asarray(out), want)


def test_pcast_and_pvary_make_a_replicated_value_varying(mesh8):
  x = np.arange(6.0, dtype=np.float32)
  seen = {}

  def body(v):
    seen['before'] = jax.typeof(v)
    w = jax.lax.pcast(v, 'x', to='varying')
    seen['after'] = jax.typeof(w)
    return w * (jax.lax.axis_index('x') + 1).astype(jnp.float32)

  out = shard_map(body, mesh=mesh8, in_specs=P(), out_specs=P('x'))(x)
  assert str(seen['before']) == 'float32[6]' and str(seen['after']) == 'float32[6]{V:x}'
  np.testing.assert_allclose(np.asarray(out), np.concatenate([x * (d + 1) for d in range(8)]))
  # pvary (older JAX's name) is the same cast; out_specs=P() on its result is refused, as JAX
  # refuses it, and so is a cast from varying.
  np.testing.assert_allclose(
      np.asarray(shard_map(lambda v: jax.lax.pvary(v, 'x'), mesh=mesh8, in_specs=P(), out_specs=P('x'))(x)),
      np.tile(x, 8))
  with pytest.raises(ValueError, match="it depends on pvary over 'x'"):
    shard_map(lambda v: jax.lax.pvary(v, 'x'), mesh=mesh8, in_specs=P(), out_specs=P())(x)
  with pytest.raises(ValueError, match="Unsupported pcast from=varying, to='varying'"):
    shard_map(lambda v: jax.lax.pcast(v, 'x', to='varying'), mesh=mesh8, in_specs=P('x'), out_specs=P('x'))(
        np.arange(8.0, dtype=np.float32))
  with pytest.raises(ValueError, match="Allowed `to` values"):
    shard_map(lambda v: jax.lax.pcast(v, 'x', to='sideways'), mesh=mesh8, in_specs=P(), out_specs=P('x'))(x)
  with pytest.raises(TypeError, match="must be a tuple or a str"):
    shard_map(lambda v: jax.lax.pcast(v, {'x'}, to='varying'), mesh=mesh8, in_specs=P(), out_specs=P('x'))(x)


@pytest.mark.parametrize("committed", [True, False])
def test_grad_through_pcast_matches_numpy(mesh8, committed):
  # loss(x, w) = sum_d sum(sin(pcast(x)) * w_d): d/dx = cos(x) * sum_d w_d (JAX's transpose of
  # pvary is a psum over 'x'), d/dw_d = sin(x). Uncommitted (numpy, jnp.array) arguments: the
  # jit has code around the shard_map (the sum, the VJP), and they go to the shard_map's mesh.
  rng = np.random.default_rng(3)
  x = rng.standard_normal(4).astype(np.float32)
  w = rng.standard_normal(8 * 4).astype(np.float32)
  body = shard_map(lambda x, w: jnp.sin(jax.lax.pcast(x, 'x', to='varying')) * w, mesh=mesh8,
                   in_specs=(P(), P('x')), out_specs=P('x'))
  if committed:
    args = jax.device_put(x, NamedSharding(mesh8, P())), jax.device_put(w, NamedSharding(mesh8, P('x')))
  else:
    args = x, jnp.array(w)
  dx, dw = jax.jit(jax.grad(lambda x, w: body(x, w).sum(), argnums=(0, 1)))(*args)
  np.testing.assert_allclose(np.asarray(dx), np.cos(x) * w.reshape(8, 4).sum(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dw), np.tile(np.sin(x), 8), rtol=1e-6)
  assert dw.sharding.mesh == mesh8


def test_out_specs_none_for_a_body_returning_none(mesh8):
  # The notebook's `@jax.shard_map(in_specs=P(), out_specs=None)` on a body that only prints.
  seen = []

  def body(v):
    seen.append(str(jax.typeof(jax.lax.pcast(v, 'x', to='varying'))))

  assert shard_map(body, mesh=mesh8, in_specs=P(), out_specs=None)(np.arange(6.0)) is None
  assert seen == ['float32[6]{V:x}']


def test_jit_of_shard_map_moves_uncommitted_arguments_to_its_mesh(mesh8):
  # JAX moves an uncommitted argument (jnp.arange: no sharding asked for) to the devices of the
  # computation; jit(shard_map(...)) on the 8-device mesh takes it there, replicated, and the
  # in_spec splits it.
  f = jax.jit(shard_map(lambda b: b * 2 + jax.lax.axis_index('x').astype(jnp.float32), mesh=mesh8, in_specs=P('x'),
                        out_specs=P('x')))
  out = f(jnp.arange(8.0))
  np.testing.assert_array_equal(np.asarray(out), np.arange(8.0) * 3)
  assert out.sharding.spec == P('x')


# lax.ragged_all_to_all (jax/_src/lax/parallel.py; tests/ragged_collective_test.py, whose
# expected values and error messages these reproduce).
def _ragged(mesh, axis_name, in_spec):
  return partial(shard_map, mesh=mesh, in_specs=(in_spec,) * 6, out_specs=in_spec, check_vma=False)


def test_ragged_all_to_all_as_jax_tests_it():
  # test_ragged_all_to_all: two devices along 'x' (here each of the 4 'y' columns of a (2, 4)
  # mesh runs it), each block a row that the body reshapes away.
  mesh = jax.make_mesh((2, 4), ('x', 'y'))
  rows = lambda a: np.repeat(np.asarray(a, dtype=np.int32), 4, axis=0)  # row i for each of 4 'y'
  operand = rows([[1, 2, 2], [3, 4, 0]])
  output = rows(np.zeros((2, 4)))
  input_offsets = rows([[0, 1], [0, 1]])
  send_sizes = rows([[1, 2], [1, 1]])
  output_offsets = rows([[0, 0], [1, 2]])
  recv_sizes = rows([[1, 1], [2, 1]])

  @_ragged(mesh, 'x', P(('x', 'y'), None))
  def fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    operand = operand.reshape(operand.shape[1:])
    output = output.reshape(output.shape[1:])
    input_offsets = input_offsets.reshape(input_offsets.shape[1:])
    send_sizes = send_sizes.reshape(send_sizes.shape[1:])
    output_offsets = output_offsets.reshape(output_offsets.shape[1:])
    recv_sizes = recv_sizes.reshape(recv_sizes.shape[1:])
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name='x')[None]

  c = np.asarray(fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes))
  np.testing.assert_array_equal(c, rows([[1, 3, 0, 0], [2, 2, 4, 0]]))


def test_ragged_all_to_all_groups_as_a_mesh_axis():
  # test_ragged_all_to_all_axis_index_groups' groups ((0, 1), (2, 3)) written as a mesh axis:
  # the inner axis 'y' of a (4, 2) mesh (each pair (x, 0), (x, 1)); even x run JAX's first
  # group, odd x its second. Expected values as JAX's. (axis_index_groups itself: below.)
  mesh = jax.make_mesh((4, 2), ('x', 'y'))
  per_x = lambda first, second: np.asarray([first, second] * 2, dtype=np.int32).reshape(8, -1)
  operand = per_x([[1, 2, 2], [3, 4, 0]], [[10, 20, 20], [30, 40, 0]])
  output = np.zeros((8, 4), np.int32)
  input_offsets = per_x([[0, 1], [0, 1]], [[0, 1], [0, 1]])
  send_sizes = per_x([[1, 2], [1, 1]], [[1, 2], [1, 1]])
  output_offsets = per_x([[0, 0], [1, 2]], [[0, 0], [1, 2]])
  recv_sizes = per_x([[1, 1], [2, 1]], [[1, 1], [2, 1]])
  f = _ragged(mesh, 'y', P(('x', 'y'), None))(
      lambda *a: jax.lax.ragged_all_to_all(*[v.reshape(v.shape[1:]) for v in a], axis_name='y')[None])
  c = np.asarray(f(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes))
  np.testing.assert_array_equal(c, per_x([[1, 3, 0, 0], [2, 2, 4, 0]], [[10, 30, 0, 0], [20, 20, 40, 0]]))


def test_ragged_all_to_all_against_numpy(mesh8):
  # Each device d sends rows [d, d + (j % 3)) of its operand to device j, written at rows
  # 3 * d .. of j's output; a numpy loop over the docstring's pseudocode is the reference.
  n, rows, cols = 8, 6, 2
  operand = np.arange(n * rows * cols, dtype=np.float32).reshape(n * rows, cols)
  output = -np.ones((n * 3 * n, cols), np.float32)
  sizes = np.array([[(j + d) % 3 for j in range(n)] for d in range(n)], np.int32)  # [sender, receiver]
  input_offsets = np.array([[d % 3] * n for d in range(n)], np.int32)
  output_offsets = np.array([[3 * d] * n for d in range(n)], np.int32)
  want = output.reshape(n, 3 * n, cols).copy()
  for d in range(n):
    for j in range(n):
      s, i, o = sizes[d, j], input_offsets[d, j], output_offsets[d, j]
      want[j, o:o + s] = operand.reshape(n, rows, cols)[d, i:i + s]

  f = _ragged(mesh8, 'x', P('x'))(lambda *a: jax.lax.ragged_all_to_all(*a, axis_name='x'))
  got = f(operand, output, input_offsets.reshape(-1), sizes.reshape(-1), output_offsets.reshape(-1),
          sizes.T.reshape(-1))
  np.testing.assert_array_equal(np.asarray(got), want.reshape(n * 3 * n, cols))
  # A slice past the operand's end fails the run, naming the device and the values.
  bad = input_offsets.copy()
  bad[5, 3] = rows
  with pytest.raises(ValueError, match=r"slice 3 \(to device \d+\) is input_offsets\[3\] = 6, send_sizes\[3\] = 2"):
    np.asarray(f(operand, output, bad.reshape(-1), sizes.reshape(-1), output_offsets.reshape(-1),
                 sizes.T.reshape(-1)))


def test_ragged_all_to_all_errors_are_jaxs(mesh8):
  # test_ragged_all_to_all_errors's messages.
  f = lambda *a: jax.lax.ragged_all_to_all(*a, axis_name='x')
  operand = np.arange(8 * 6, dtype=np.float32)
  ints = np.zeros(8 * 8, np.int32)
  sm = _ragged(mesh8, 'x', P('x'))
  with pytest.raises(ValueError, match='ragged_all_to_all input_offsets must be integer type.'):
    sm(f)(operand, operand, ints.astype(np.float32), ints, ints, ints)
  with pytest.raises(ValueError, match=r'ragged_all_to_all recv_sizes must be rank 1 with positive dimension '
                                       r'size, but got shape \(1, 8\)'):
    shard_map(f, mesh=mesh8, in_specs=(P('x'),) * 5 + (P('x', None),), out_specs=P('x'), check_vma=False)(
        operand, operand, ints, ints, ints, ints.reshape(8, 8))
  # Groups that leave positions out (JAX leaves that undefined; Tessera refuses it).
  with pytest.raises(ValueError, match=r'axis_index_groups=\{0, 1\}\): the groups must cover every position along '
                                       r'the axes \(of size 8\) exactly once'):
    sm(lambda *a: jax.lax.ragged_all_to_all(*a, axis_name='x', axis_index_groups=[[0, 1]]))(
        operand, operand, ints, ints, ints, ints)


def test_ragged_all_to_all_axis_index_groups_as_jax_tests_it():
  # tests/ragged_collective_test.py test_ragged_all_to_all_axis_index_groups: 4 devices along
  # 'x' in groups ((0, 1), (2, 3)); its inputs and expected values, and the reversed groups
  # ((1, 0), (3, 2)), where slice 0 goes to the group's first member, now the other device.
  mesh = jax.make_mesh((4,), ('x',))
  operand = np.array([[1, 2, 2], [3, 4, 0], [10, 20, 20], [30, 40, 0]], np.int32)
  output = np.zeros((4, 4), np.int32)
  input_offsets = np.array([[0, 1], [0, 1], [0, 1], [0, 1]], np.int32)
  send_sizes = np.array([[1, 2], [1, 1], [1, 2], [1, 1]], np.int32)
  output_offsets = np.array([[0, 0], [1, 2], [0, 0], [1, 2]], np.int32)
  recv_sizes = np.array([[1, 1], [2, 1], [1, 1], [2, 1]], np.int32)

  def fwd(groups):
    f = jax.jit(shard_map(
        lambda *a: jax.lax.ragged_all_to_all(*[v.reshape(v.shape[1:]) for v in a], axis_name='x',
                                             axis_index_groups=groups),
        mesh=mesh, in_specs=(P('x', None),) * 6, out_specs=P('x'), check_vma=False))
    return lambda *a: f(*[jax.device_put(v, NamedSharding(mesh, P('x', None))) for v in a])

  c = fwd(((0, 1), (2, 3)))(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
  np.testing.assert_array_equal(np.asarray(c).reshape(4, 4),
                                [[1, 3, 0, 0], [2, 2, 4, 0], [10, 30, 0, 0], [20, 20, 40, 0]])
  # Reversed: device 1 is its group's position 0, device 0 position 1. With the sizes swapped
  # between the two, by the docstring's pseudocode: device 1 (sizes [1, 2]) sends [3] to position
  # 0 (itself) at row 1 and [4, 0] to device 0 at row 2; device 0 (sizes [1, 1]) sends [1] to
  # device 1 at row 0 and [2] to itself at row 0.
  c = fwd(((1, 0), (3, 2)))(operand, output, input_offsets, send_sizes[[1, 0, 3, 2]],
                            output_offsets, recv_sizes[[1, 0, 3, 2]])
  np.testing.assert_array_equal(np.asarray(c).reshape(4, 4),
                                [[2, 0, 4, 0], [1, 3, 0, 0], [20, 0, 40, 0], [10, 30, 0, 0]])


def test_vmap_of_ragged_all_to_all_is_each_example_alone():
  # tests/ragged_collective_test.py test_ragged_all_to_all_vmap_multi_dim_operand: the vmapped
  # ragged_all_to_all equals the stack of the per-example calls (JAX's
  # _ragged_all_to_all_batched_collective); here with data, vmap inside the body (Tessera's
  # shard_map has no batching rule itself): the docstring's example and a second one.
  mesh = jax.make_mesh((2,), ('x',), axis_types=(AxisType.Auto,))
  # [device, example, ...]
  operand = np.array([[[1, 2, 2], [5, 6, 7]], [[3, 4, 0], [8, 9, 1]]], np.int32)
  output = np.zeros((2, 2, 4), np.int32) - np.arange(2, dtype=np.int32)[None, :, None]
  input_offsets = np.array([[[0, 1], [1, 0]], [[0, 1], [2, 0]]], np.int32)
  send_sizes = np.array([[[1, 2], [2, 1]], [[1, 1], [1, 2]]], np.int32)
  output_offsets = np.array([[[0, 0], [1, 3]], [[1, 2], [0, 1]]], np.int32)
  recv_sizes = np.array([[[1, 1], [2, 1]], [[2, 1], [1, 2]]], np.int32)
  args = operand, output, input_offsets, send_sizes, output_offsets, recv_sizes

  def ragged(*a):
    return jax.lax.ragged_all_to_all(*a, axis_name='x')

  def body(in_axes):
    return lambda *a: jax.vmap(ragged, in_axes=in_axes)(*[v.reshape(v.shape[1:]) for v in a])[None]

  sm = lambda f, specs: shard_map(f, mesh=mesh, in_specs=specs, out_specs=P('x'), check_vma=False)
  one = sm(lambda *a: ragged(*[v.reshape(v.shape[1:]) for v in a])[None], (P('x'),) * 6)
  res = np.asarray(sm(body(0), (P('x'),) * 6)(*args))
  ref = np.stack([np.asarray(one(*[a[:, b] for a in args])) for b in range(2)], axis=1)
  np.testing.assert_array_equal(res, ref)
  np.testing.assert_array_equal(ref[:, 0], [[1, 3, 0, 0], [2, 2, 4, 0]])  # the docstring's
  # The second example by the docstring's pseudocode: device 0 sends [6, 7] to itself at row 1
  # and [5] to device 1 at row 3; device 1 sends [1] to device 0 at row 0 and [8, 9] to itself
  # at row 1.
  np.testing.assert_array_equal(ref[:, 1], [[1, 6, 7, -1], [-1, 8, 9, 5]])
  # Index arrays shared by the examples (in_axes None): broadcast to each.
  shared = [a[:, 0] for a in args[2:]]
  res = np.asarray(sm(body((0, 0, None, None, None, None)), (P('x'),) * 6)(operand, output, *shared))
  ref = np.stack([np.asarray(one(operand[:, b], output[:, b], *shared)) for b in range(2)], axis=1)
  np.testing.assert_array_equal(res, ref)


def test_jit_with_a_shard_map_inside_moves_uncommitted_arguments_to_its_mesh(mesh8):
  # JAX takes the devices of a jit from the shardings in its function
  # (jax/_src/interpreters/pxla.py, _get_and_check_device_assignment; dispatch.py's
  # get_intermediate_shardings lists a shard_map's mesh), and moves uncommitted arguments there,
  # also when code runs before and after the shard_map.
  rng = np.random.default_rng(4)
  a = rng.standard_normal((8, 4)).astype(np.float32)
  body = shard_map(lambda b: jax.lax.psum(b, 'x') - b, mesh=mesh8, in_specs=P('x'), out_specs=P('x'))

  @jax.jit
  def f(a):
    return jnp.tanh(body(a * 2.0)).sum(axis=1) + 1.0

  want = np.tanh(np.sum(2 * a, axis=0, keepdims=True) - 2 * a).sum(axis=1) + 1
  for arg in (a, jnp.array(a)):  # numpy data and an uncommitted Array
    out = f(arg)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-6)
    assert out.sharding.mesh == mesh8 and out._committed
  assert not jnp.array(a)._committed


def test_binary_ops_pvary_the_invariant_operand_as_the_notebook_shows(mesh8):
  # [SM] cell 22 ("JAX implicitly inserts jax.lax.pcast(..., to='varying') calls in many cases,
  # especially for binary operations"; its make_jaxpr listing shows the pvary): y's block is
  # pvary'd along 'x' and the multiplication reads that.
  f = shard_map(lambda x, y: x * y, mesh=mesh8, in_specs=(P('x'), P()), out_specs=P('x'))
  x = jax.device_put(jnp.arange(16.), NamedSharding(mesh8, P('x')))
  y = jnp.arange(2.) + 3
  eqns = jax.make_jaxpr(f)(x, y).eqns
  pvary = [e for e in eqns if " = pvary[axes=('x',)" in e]
  assert len(pvary) == 1, eqns
  y_block = next(e.split(":")[0] for e in eqns if "shard_map_in" in e and "spec=P())" in e)
  assert pvary[0].endswith(" " + y_block)
  mul = [e for e in eqns if " = mul " in e]
  assert len(mul) == 1 and mul[0].endswith(" " + pvary[0].split(":")[0]), eqns
  np.testing.assert_array_equal(np.asarray(f(x, y)), np.arange(16.) * np.tile([3., 4.], 8))


def test_dot_and_concatenate_pvary_the_invariant_operand_as_jax_does(mesh8):
  # jax/_src/lax/lax.py's dot_general and concatenate call core.auto_insert_reshard on their
  # operands before binding, as the binary ops do: w's and c's blocks are pvary'd along 'x', each
  # read by its op, and both results vary along 'x' (so out_specs=P() on them is refused).
  def body(x, w, c):
    return jnp.dot(x, w), jnp.concatenate([x, c])

  f = shard_map(body, mesh=mesh8, in_specs=(P('x'), P(), P()), out_specs=(P('x'), P('x')))
  x = jax.device_put(jnp.arange(48.).reshape(16, 3), NamedSharding(mesh8, P('x')))
  w = np.array([[1., -1.], [2., 0.], [0.5, 3.]], np.float32)
  c = np.array([[-7., 8., 9.]], np.float32)
  eqns = jax.make_jaxpr(f)(x, w, c).eqns
  pvary = [e.split(":")[0] for e in eqns if " = pvary[axes=('x',)" in e]
  assert len(pvary) == 2, eqns
  dot = [e for e in eqns if " = dot_general" in e]
  concat = [e for e in eqns if " = concatenate" in e]
  assert len(dot) == 1 and dot[0].split()[-1] in pvary, eqns
  assert len(concat) == 1 and concat[0].split()[-1] in pvary, eqns
  d, joined = f(x, w, c)
  xs = np.arange(48.).reshape(16, 3)
  np.testing.assert_allclose(np.asarray(d), xs @ w, rtol=1e-6)
  want = np.concatenate([np.concatenate([xs[2 * i:2 * i + 2], c]) for i in range(8)])
  np.testing.assert_array_equal(np.asarray(joined), want)
  with pytest.raises(ValueError, match="may differ along mesh axis 'x'"):
    shard_map(lambda x, w: jnp.dot(x, w), mesh=mesh8, in_specs=(P('x'), P()), out_specs=P())(x, w)


def test_a_scan_carry_that_becomes_varying_is_jaxs_error(mesh8):
  # [SM] cell 23 (#scan-vma): swapping a varying and an invariant carry raises, with the text of
  # jax/_src/lax/control_flow/loops.py's _check_carry_type (carries named by path; types printed
  # as Tessera's C++ errors print them, f32[2] for JAX's float32[2]); cell 24: with the
  # invariant one pcast to varying first it runs, and two swaps give the values back.
  def swapping(pcast_first):
    @partial(shard_map, mesh=mesh8, in_specs=(P('x'), P()), out_specs=P('x'))
    def f(x, y):
      if pcast_first:
        y = jax.lax.pcast(y, 'x', to='varying')

      def body(carry, _):
        c1, c2 = carry
        return (c2, c1), ()  # swap the carry

      (x_, y_), _ = jax.lax.scan(body, (x, y), (), length=2)
      return x_, y_
    return f

  x, y = jnp.arange(16.), jnp.arange(2.) + 3
  with pytest.raises(ValueError) as e:
    swapping(False)(x, y)
  assert str(e.value) == (
      "scan body function carry input and carry output must have equal types, but they differ:\n\n"
      "  * the input carry at path [0] has type f32[2]{V:x} but the corresponding output carry component has type "
      "f32[2], so the manual axis types do not match;\n\n"
      "  * the input carry at path [1] has type f32[2] but the corresponding output carry component has type "
      "f32[2]{V:x}, so the manual axis types do not match.\n\n"
      "This might be fixed by applying `jax.lax.pcast(..., ('x',), to='varying')`, to the initial carry value "
      "corresponding to the input carry at path [1].\n"
      "See https://docs.jax.dev/en/latest/notebooks/shard_map.html#scan-vma for more information.\n\n"
      "Revise the function so that all output types match the corresponding input types.")
  x_, y_ = swapping(True)(x, y)
  np.testing.assert_array_equal(np.asarray(x_), np.arange(16.))
  np.testing.assert_array_equal(np.asarray(y_), np.tile([3., 4.], 8))


def test_a_scan_body_inside_a_shard_map_body_is_typed_by_its_varying_axes(mesh8):
  # jax/_src/lax/control_flow/loops.py traces a scan body with its carries' and rows' avals,
  # vma included: a row of x varies along 'x', the closed-over w is pvary'd where it meets it,
  # and a psum inside gives an invariant carry, which out_specs=P() accepts; the stacked ys
  # vary, and out_specs=P() on them is refused.
  seen = []

  def body(x, w):
    def step(c, row):
      y = row * w
      total = jax.lax.psum(y.sum(), 'x')
      seen.append((jax.typeof(row).mat.varying, jax.typeof(total).mat.varying))
      return c + total, y
    return jax.lax.scan(step, jnp.float32(0), x)

  x = np.arange(64., dtype=np.float32).reshape(16, 4)
  w = np.array([1., -2., .5, 3.], np.float32)
  total, ys = shard_map(body, mesh=mesh8, in_specs=(P('x'), P()), out_specs=(P(), P('x')))(x, w)
  assert seen[-1] == ({'x'}, set()), seen
  np.testing.assert_allclose(np.asarray(total), (x * w).sum(), rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(ys), x * w)
  with pytest.raises(ValueError, match="output 1 f32\\[2,4\\] may differ along mesh axis 'x'"):
    shard_map(body, mesh=mesh8, in_specs=(P('x'), P()), out_specs=(P(), P()))(x, w)


def test_cond_and_while_loop_inside_a_shard_map_body_as_jax(mesh):
  # tests/shard_map_test.py's test_cond_pvary_errors and test_cond_rep_rule ('x', 'y' as 'data',
  # 'model'): branches must agree on their varying axes (JAX's _check_branch_outputs text; JAX
  # raises TypeError), x and x + 1 vary along 'data' only.
  x = np.arange(8., dtype=np.float32)

  def f(a, b):
    return jax.lax.cond(True, lambda a, b: a, lambda a, b: b, a, b)

  with pytest.raises(ValueError) as e:
    shard_map(f, mesh=mesh, in_specs=(P('data'), P('model')), out_specs=P(('data', 'model')))(x, x[:4])
  assert str(e.value).startswith(
      "cond branches must have equal output types but they differ.\n\n"
      "The output of true_fun at path [0] has type f32[2]{V:data} but the corresponding output of false_fun has "
      "type f32[2]{V:model}, so the manual axis types do not match.\n\n"
      "This might be fixed by:\n"
      "  * applying `jax.lax.pcast(..., ('model',), to='varying')` to the output of true_fun at path [0];\n"), str(e.value)

  def g(a, b):
    return jax.lax.cond(True, lambda a, b: a, lambda a, b: a + 1, a, b)

  np.testing.assert_array_equal(
      np.asarray(shard_map(g, mesh=mesh, in_specs=(P('data'), P('model')), out_specs=P('data'))(x, x[:4])), x)
  with pytest.raises(ValueError, match="may differ along mesh axis 'data'"):
    shard_map(g, mesh=mesh, in_specs=(P('data'), P('model')), out_specs=P())(x, x[:4])

  # test_while_rep_rule: three carries varying along both axes, rotated five times.
  def h(a, b, c):
    a, b, c = a.sum(), b.sum(), c.sum()
    a = jax.lax.pcast(a, ('data', 'model'), to='varying')
    b = jax.lax.pcast(b, 'model', to='varying')
    _, *out = jax.lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, s[2], s[3], s[1]), (0, a, b, c))
    return [jnp.expand_dims(v, 0) for v in out]

  specs = (P(None), P('data'), P(('data', 'model')))
  out = shard_map(h, mesh=mesh, in_specs=specs, out_specs=P(('data', 'model')))(x, x, x)
  np.testing.assert_array_equal(np.asarray(out[0]), x)
  np.testing.assert_array_equal(np.asarray(out[1]), np.full(8, 28.))
  np.testing.assert_array_equal(np.asarray(out[2]), np.repeat([1., 5., 9., 13.], 2))
  for bad in (P('data'), P('model'), P(None)):
    with pytest.raises(ValueError, match="may differ along mesh axis"):
      shard_map(h, mesh=mesh, in_specs=specs, out_specs=bad)(x, x, x)


def test_uncommitted_arguments_go_to_the_ambient_mesh(mesh):
  # jax/_src/interpreters/pxla.py, _get_and_check_device_assignment: with no sharding anywhere,
  # the devices are the context mesh's ("if first_sharding_info is None and not ctx_mesh.empty");
  # lower_sharding_computation commits the outputs when the context mesh is set. Without it the
  # call stays on the default device, uncommitted.
  a = np.arange(32., dtype=np.float32).reshape(8, 4)
  f = jax.jit(lambda x: x * 2 + 1)
  with jax.set_mesh(mesh):
    out = f(jnp.array(a))
    assert out._committed and out.sharding.mesh == mesh
    np.testing.assert_array_equal(np.asarray(out), a * 2 + 1)
  out = f(jnp.array(a))
  assert not out._committed and out.sharding.mesh != mesh
  np.testing.assert_array_equal(np.asarray(out), a * 2 + 1)


def test_remat_inside_a_shard_map_body_as_jax(mesh8):
  # tests/shard_map_test.py's test_shmap_of_remat_basic (shard_map of jax.remat(sin) with
  # everything_saveable: the gradient is cos(x)) and test_remat_basic's function inside the body
  # (sin(sin(x)), no policy: cos(sin(x)) cos(x)), on 8 devices; and a layer with a psum under each
  # policy against the same body without remat and against numpy.
  x = np.linspace(-2, 2, 16)
  xs = jax.device_put(x, NamedSharding(mesh8, P('x')))

  @partial(shard_map, mesh=mesh8, in_specs=P('x'), out_specs=P('x'))
  @partial(jax.remat, policy=jax.checkpoint_policies.everything_saveable)
  def f2(v):
    return jnp.sin(v)

  np.testing.assert_allclose(np.asarray(jax.grad(lambda v: f2(v).sum())(xs)), np.cos(x), rtol=1e-6)

  @partial(shard_map, mesh=mesh8, in_specs=P('x'), out_specs=P('x'))
  @jax.remat
  def f(v):
    return jnp.sin(jnp.sin(v))

  np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(lambda v: f(v).sum()))(xs)), np.cos(np.sin(x)) * np.cos(x),
                             rtol=1e-6)

  def layer(v):
    h = jnp.tanh(v * 3.0)
    return h * jax.lax.psum(h.sum(), 'x')

  def loss_of(inner):
    return jax.jit(jax.value_and_grad(
        lambda v: shard_map(inner, mesh=mesh8, in_specs=P('x'), out_specs=P('x'))(v).sum()))

  plain_l, plain_g = loss_of(layer)(xs)
  h = np.tanh(3 * x)
  want_l = h.sum() ** 2
  want_g = 2 * h.sum() * 3 * (1 - h ** 2)
  np.testing.assert_allclose(float(plain_l), want_l, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(plain_g), want_g, rtol=1e-6)
  for policy in (None, jax.checkpoint_policies.nothing_saveable, jax.checkpoint_policies.everything_saveable):
    l, g = loss_of(jax.remat(layer, policy=policy))(xs)
    np.testing.assert_allclose(float(l), float(plain_l), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g), np.asarray(plain_g), rtol=1e-12)


@pytest.mark.parametrize("replicate_on_axes", ['x', ('x', 'y')])
def test_pbroadcast_as_jaxs_test(replicate_on_axes):
  # JAX's tests/shard_map_test.py test_pbroadcast, nearly verbatim (JAX runs it on GPU only;
  # 'from tessera import shard_map' for its shard_map, P for jax.sharding.PartitionSpec).
  mesh = jax.make_mesh((4, 2), ('x', 'y'))
  sharded_axes = set(mesh.axis_names) - set(replicate_on_axes)
  sharded_axes = None if not sharded_axes else list(sharded_axes)
  in_out_sharding = jax.sharding.NamedSharding(mesh, P(sharded_axes, None))
  a = jax.device_put(jnp.arange(16).reshape((4, 4)), in_out_sharding)

  @jax.jit
  @partial(shard_map, mesh=mesh, in_specs=(in_out_sharding.spec,), out_specs=in_out_sharding.spec,
           check_vma=False)
  def fwd(x):
    axis_index = jax.lax.axis_index(replicate_on_axes)
    x = jnp.where(axis_index == 0, x + 1, x)
    return jax.lax.pbroadcast(x, replicate_on_axes, source=0)

  c = fwd(a)
  np.testing.assert_array_equal(np.asarray(c), np.arange(16).reshape(4, 4) + 1)


def test_memory_stats_count_in_process_collective_messages(mesh8):
    # The embedded cluster's workers share this process: a psum's messages go straight into the
    # receiving device's mailbox (docs/design.md, "In process"), never through a shared-memory
    # ring. In an all-reduce over 8 devices each device receives at least one message.
    def totals():
        stats = [d.memory_stats() for d in jax.devices()]
        return (sum(s["in_process_messages_received"] for s in stats), sum(s["shm_messages_received"] for s in stats))
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    before = totals()
    total = shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh8, in_specs=P("x"), out_specs=P())(x)
    np.testing.assert_allclose(np.asarray(total), x.sum(0, keepdims=True))
    after = totals()
    assert after[0] - before[0] >= 8
    assert after[1] == before[1] == 0

# tessera.vmap (the SDK's vmap: f traced once on one example, each op batched by its rule) and
# tessera.make_jaxpr. Every mapped result is checked against the loop JAX's vmap documents as
# its meaning (jax/_src/api.py, vmap's docstring; the shard_map notebook's cell "check_vmap":
# `jnp.stack([f(x) for x in xs])`), computed here with numpy.
import numpy as np
import pytest

import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P


def test_vmap_of_row_dot_matches_the_loop():
  xs = np.arange(12, dtype=np.int32).reshape(4, 3)
  ans = jax.vmap(lambda x: x @ x, in_axes=(0,), out_axes=0)(xs)
  np.testing.assert_array_equal(np.asarray(ans), np.stack([x @ x for x in xs]))
  assert ans.shape == (4,) and ans.dtype == np.int32
  # The notebook's reference, on Arrays: eager x[i] per row and jnp.stack of the scalars.
  expected = jnp.stack([(lambda x: x @ x)(x) for x in jnp.arange(12).reshape(4, 3)])
  np.testing.assert_array_equal(np.asarray(expected), np.asarray(ans))


def test_vmap_in_axes_out_axes_and_unmapped_arguments():
  rng = np.random.default_rng(0)
  a = rng.standard_normal((3, 5)).astype(np.float32)   # mapped along axis 1
  w = rng.standard_normal((3, 2)).astype(np.float32)   # not mapped
  f = lambda x, w: jnp.tanh(x @ w) + 1.0               # f32[3], f32[3,2] -> f32[2]
  out = jax.vmap(f, in_axes=(1, None), out_axes=1)(a, w)
  want = np.stack([np.tanh(a[:, i] @ w) + 1.0 for i in range(5)], axis=1)
  assert out.shape == (2, 5)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5)
  # Negative axes count from the end; a list of in_axes is a tuple (as JAX).
  out = jax.vmap(f, in_axes=[-1, None], out_axes=-1)(a, w)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5)


def test_vmap_over_pytrees_with_reductions_and_layout_ops():
  rng = np.random.default_rng(1)
  params = {"w": rng.standard_normal((4, 6, 3)).astype(np.float32), "b": rng.standard_normal((3,)).astype(np.float32)}
  xs = rng.standard_normal((4, 6)).astype(np.float32)

  def f(p, x):
    h = x @ p["w"] + p["b"]                           # f32[3]
    s = jax.nn.softmax(h)                             # reductions and broadcasts
    return {"mean": jnp.mean(s * h), "t": jnp.concatenate([h[1:], h[:1]]).reshape(3, 1).T}

  out = jax.vmap(f, in_axes=({"w": 0, "b": None}, 0))(params, xs)
  for i in range(4):
    h = xs[i] @ params["w"][i] + params["b"]
    s = np.exp(h - h.max()) / np.exp(h - h.max()).sum()
    np.testing.assert_allclose(np.asarray(out["mean"])[i], np.mean(s * h), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["t"])[i], np.concatenate([h[1:], h[:1]]).reshape(3, 1).T, rtol=1e-5)
  assert out["t"].shape == (4, 1, 3)


def test_nested_vmap_is_an_outer_product_and_axis_size_broadcasts():
  x = np.arange(3, dtype=np.float32)
  y = np.arange(4, dtype=np.float32) + 1
  outer = jax.vmap(jax.vmap(lambda a, b: a * b, in_axes=(None, 0)), in_axes=(0, None))(x, y)
  np.testing.assert_array_equal(np.asarray(outer), np.outer(x, y))
  # No argument mapped: axis_size says how many copies (JAX's rule for in_axes all None).
  out = jax.vmap(lambda a: a * 2, in_axes=None, axis_size=5)(x)
  np.testing.assert_array_equal(np.asarray(out), np.stack([x * 2] * 5))


def test_vmap_inside_jit_and_under_grad():
  rng = np.random.default_rng(2)
  ws = rng.standard_normal((3, 4, 4)).astype(np.float32)
  x = rng.standard_normal((3, 2, 4)).astype(np.float32)

  def loss(ws, x):
    y = jax.vmap(lambda w, v: jax.nn.relu(v @ w))(ws, x)   # one layer per example
    return jnp.sum(y ** 2)

  value, g = jax.jit(jax.value_and_grad(loss))(ws, x)
  y = np.maximum(np.einsum("bij,bjk->bik", x, ws), 0)
  np.testing.assert_allclose(float(value), np.sum(y ** 2), rtol=1e-5)
  # d/dW sum(relu(x W)^2) = x^T (2 relu(x W)), per example
  np.testing.assert_allclose(np.asarray(g), np.einsum("bij,bik->bjk", x, 2 * y), rtol=1e-4, atol=1e-5)
  assert jax.jit(lambda ws, x: jax.vmap(jnp.matmul)(x, ws)).__call__(ws, x).shape == (3, 2, 4)


def test_vmap_of_a_gather_with_fixed_indices():
  x = np.arange(20, dtype=np.float32).reshape(4, 5)
  idx = np.array([4, 0, 2], np.int32)
  out = jax.vmap(lambda r, i: r[i] * 2, in_axes=(0, None))(x, idx)
  np.testing.assert_array_equal(np.asarray(out), x[:, idx] * 2)


def test_vmap_inside_a_shard_map_body_with_collectives():
  # The shard_map notebook's pipeline step: each device applies its stack of layers to its
  # stack of states with vmap, then shifts the states with ppermute.
  mesh = jax.make_mesh((2,), ("stages",))
  rng = np.random.default_rng(3)
  W = rng.standard_normal((4, 3, 3)).astype(np.float32)   # 2 layers per stage
  b = rng.standard_normal((4, 3)).astype(np.float32)
  s = rng.standard_normal((4, 5, 3)).astype(np.float32)

  @jax.shard_map(mesh=mesh, in_specs=(P("stages"), P("stages"), P("stages")), out_specs=P("stages"))
  def step(W, b, s):
    out = jax.vmap(lambda Wb, x: jax.nn.relu(x @ Wb[0] + Wb[1]))((W, b), s)
    return jax.lax.ppermute(out, "stages", [(0, 1), (1, 0)])

  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("stages")))
  got = np.asarray(jax.jit(step)(put(W), put(b), put(s)))
  per_layer = np.maximum(np.einsum("lbi,lij->lbj", s, W) + b[:, None, :], 0)
  np.testing.assert_allclose(got, np.concatenate([per_layer[2:], per_layer[:2]]), rtol=1e-5, atol=1e-6)


def test_vmap_errors_name_the_rule():
  x = np.ones((3, 2), np.float32)
  with pytest.raises(ValueError, match="has size 4 along in_axes 0; the mapped size is 3"):
    jax.vmap(lambda a, b: a + b)(x, np.ones((4, 2), np.float32))
  with pytest.raises(ValueError, match="out_axes is None for result 0, but it depends on a mapped argument"):
    jax.vmap(lambda a: a * 2, out_axes=None)(x)
  with pytest.raises(ValueError, match="in_axes 2 is out of range"):
    jax.vmap(lambda a: a, in_axes=2)(x)
  with pytest.raises(ValueError, match="axis_size is not given"):
    jax.vmap(lambda a: a, in_axes=None)(x)


def test_make_jaxpr_lists_the_program():
  # The shard_map notebook's make_jaxpr cell, on an explicit mesh argument.
  mesh = jax.make_mesh((2,), ("i",))

  @jax.shard_map(mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
  def f(x, y):
    return x * y

  x = jax.device_put(np.arange(6.0, dtype=np.float32), NamedSharding(mesh, P("i")))
  y = np.arange(3.0, dtype=np.float32)
  jaxpr = jax.make_jaxpr(f)(x, y)
  text = str(jaxpr)
  assert text.startswith("{ lambda ; a:f32[6] b:f32[3]. let\n"), text
  assert text.endswith("in (g,) }"), text
  # The invariant y is pvary'd before the multiplication, as in the notebook's listing of JAX's.
  assert "e:f32[3] = pvary[axes=('i',)" in text and "= mul c e" in text, text
  assert "shard_map_in" in text and "shard_map_out" in text, text
  assert jaxpr.in_avals == ["f32[6]", "f32[3]"] and jaxpr.out_avals == ["f32[6]"]
  # Dead ops are not listed (the compiler drops them too): vmap's one-example recording.
  text = str(jax.make_jaxpr(jax.vmap(jnp.sin))(np.ones((4, 2), np.float32)))
  assert text.count("sin") == 1 and "f32[4,2] = sin" in text, text

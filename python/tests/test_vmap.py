# tessera.vmap (the SDK's vmap: f traced once on one example, each op batched by its rule) and
# tessera.make_jaxpr. Every mapped result is checked against the loop JAX's vmap documents as
# its meaning (jax/_src/api.py, vmap's docstring; the shard_map notebook's cell "check_vmap":
# `jnp.stack([f(x) for x in xs])`), computed here with numpy.
import functools

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


# ---- dynamic_slice / dynamic_update_slice (jax/_src/lax/slicing.py's batching rules) ------------

def _window(x, starts, sizes):
  """lax.dynamic_slice on the host: each start clamped to [0, dim - size]."""
  starts = [min(max(int(s), 0), n - k) for s, n, k in zip(starts, x.shape, sizes)]
  return x[tuple(slice(s, s + k) for s, k in zip(starts, sizes))]


def _update(x, u, starts):
  starts = [min(max(int(s), 0), n - k) for s, n, k in zip(starts, x.shape, u.shape)]
  out = x.copy()
  out[tuple(slice(s, s + k) for s, k in zip(starts, u.shape))] = u
  return out


def _check_vmap_cases(f, cases, n, shape):
  """vmap(f) over each (in_axes, args, want) of `cases`, n examples of the given shape, against
  want(k) (numpy) and against f computed unbatched, example by example, on the devices."""
  for in_axes, args, want in cases:
    out = jax.vmap(f, in_axes=in_axes)(*args)
    assert out.shape == shape, in_axes
    np.testing.assert_array_equal(np.asarray(out), np.stack([want(k) for k in range(n)]), err_msg=str(in_axes))
    one = [np.asarray(jax.jit(f)(*[a[k] if ax == 0 else a for a, ax in zip(args, in_axes)])) for k in range(n)]
    np.testing.assert_array_equal(np.asarray(out), np.stack(one), err_msg=str(in_axes))


def test_vmap_of_dynamic_slice_with_batched_operand_starts_or_both():
  rng = np.random.default_rng(4)
  xs = rng.standard_normal((5, 4, 6)).astype(np.float32)
  # Starts out of range on purpose (negative, past the end): lax clamps them.
  i = np.array([0, 3, -2, 9, 1], np.int32)
  j = np.array([5, 0, 2, -7, 4], np.int32)
  ds = lambda x, a, b: jax.lax.dynamic_slice(x, (a, b), (2, 3))
  cases = [
      ((0, None, None), (xs, np.int32(1), np.int32(5)), lambda k: _window(xs[k], (1, 5), (2, 3))),
      ((None, 0, 0), (xs[0], i, j), lambda k: _window(xs[0], (i[k], j[k]), (2, 3))),
      ((0, 0, 0), (xs, i, j), lambda k: _window(xs[k], (i[k], j[k]), (2, 3))),
      ((0, 0, None), (xs, i, np.int32(2)), lambda k: _window(xs[k], (i[k], 2), (2, 3))),
  ]
  _check_vmap_cases(ds, cases, 5, (5, 2, 3))
  # Inside jit, along a mapped axis that is not the first, int64 starts, and a 1-d operand.
  ys = np.moveaxis(xs, 0, 2)                                                       # (4, 6, 5)
  out = jax.jit(jax.vmap(ds, in_axes=(2, 0, 0), out_axes=1))(ys, i.astype(np.int64), j)
  np.testing.assert_array_equal(np.asarray(out), np.stack([_window(xs[k], (i[k], j[k]), (2, 3)) for k in range(5)], 1))
  v = np.arange(10.0, dtype=np.float32)
  out = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(v, s, 4))(i)
  np.testing.assert_array_equal(np.asarray(out), np.stack([_window(v, (s,), (4,)) for s in i]))


def test_vmap_of_dynamic_update_slice_with_batched_operand_update_or_starts():
  rng = np.random.default_rng(5)
  xs = rng.standard_normal((4, 5, 3)).astype(np.float32)
  us = rng.standard_normal((4, 2, 3)).astype(np.float32)
  i = np.array([-1, 2, 4, 1], np.int32)
  dus = lambda x, u, a: jax.lax.dynamic_update_slice(x, u, (a, 0))
  cases = [
      ((0, None, None), (xs, us[0], np.int32(3)), lambda k: _update(xs[k], us[0], (3, 0))),
      ((None, 0, None), (xs[0], us, np.int32(1)), lambda k: _update(xs[0], us[k], (1, 0))),
      ((None, None, 0), (xs[0], us[0], i), lambda k: _update(xs[0], us[0], (i[k], 0))),
      ((0, 0, 0), (xs, us, i), lambda k: _update(xs[k], us[k], (i[k], 0))),
  ]
  _check_vmap_cases(dus, cases, 4, (4, 5, 3))


def test_grad_through_a_vmapped_dynamic_slice_with_batched_starts():
  # d/dx sum(w * window(x, s_k)) summed over k: w added back at each example's window.
  x = np.arange(8.0, dtype=np.float32)
  starts = np.array([0, 5, 2, 7], np.int32)
  w = np.array([1.0, 2.0, 3.0], np.float32)
  loss = lambda x, s: jnp.sum(jax.vmap(lambda t: jax.lax.dynamic_slice(x, (t,), (3,)) * w)(s))
  g = np.asarray(jax.jit(jax.grad(loss))(x, starts))
  want = np.zeros(8, np.float32)
  for s in starts:
    s = min(max(s, 0), 5)
    want[s:s + 3] += w
  np.testing.assert_array_equal(g, want)


def test_vmap_of_dynamic_slice_and_update_with_per_example_starts_on_a_split_batch():
  # JAX batches dynamic_slice as a gather (_dynamic_slice_batching_rule -> _gather_batching_rule)
  # and dynamic_update_slice as a scatter, the batch a batching dimension of operand and starts;
  # _gather_sharding_rule / _scatter_sharding_rule resolve splits of it alike over 'x' into the
  # result's. An unmapped operand with split starts is a gather with split indices: refused.
  mesh = jax.make_mesh((2,), ("x",))
  xs = np.arange(24, dtype=np.float32).reshape(4, 6)
  us = -1.0 - np.arange(12, dtype=np.float32).reshape(4, 3)
  starts = np.array([-1, 2, 5, 1], np.int32)
  ds = lambda x, s: jax.lax.dynamic_slice(x, (s,), (3,))
  dus = lambda x, u, s: jax.lax.dynamic_update_slice(x, u, (s,))
  with jax.sharding.set_mesh(mesh):
    x = jax.device_put(xs, NamedSharding(mesh, P("x", None)))
    u = jax.device_put(us, NamedSharding(mesh, P("x", None)))
    s = jax.device_put(starts, NamedSharding(mesh, P("x")))
    for f in (jax.vmap(ds), jax.jit(jax.vmap(ds))):
      out = f(x, s)
      assert str(jax.typeof(out)) == "float32[4@x,3]"
      np.testing.assert_array_equal(np.asarray(out), np.stack([_window(xs[k], (starts[k],), (3,)) for k in range(4)]))
    out = jax.jit(jax.vmap(ds, in_axes=(0, None)))(x, np.int32(5))
    assert str(jax.typeof(out)) == "float32[4@x,3]"
    np.testing.assert_array_equal(np.asarray(out), xs[:, 3:6])
    with pytest.raises(ValueError, match=r"Use `\.at\[\.\.\.\]\.get\(out_sharding=\)` to provide output"):
      jax.jit(jax.vmap(ds, in_axes=(None, 0)))(jnp.asarray(xs[0]), s)
    out = jax.jit(jax.vmap(dus))(x, u, s)
    assert str(jax.typeof(out)) == "float32[4@x,6]"
    np.testing.assert_array_equal(np.asarray(out),
                                  np.stack([_update(xs[k], us[k], (starts[k],)) for k in range(4)]))


# ---- random over a batch of keys ----------------------------------------------------------------

def test_vmap_of_random_over_a_batch_of_keys_equals_each_key_alone():
  keys = jax.random.split(jax.random.key(0), 4)
  samplers = {
      "split": lambda k: jax.random.split(k, 3),
      "fold_in": lambda k: jax.random.fold_in(k, 7),
      "bits": lambda k: jax.random.bits(k, (2, 3)),
      "uniform": lambda k: jax.random.uniform(k, (5,)),
      "normal": lambda k: jax.random.normal(k, (2, 2)),
  }
  # split and fold_in of typed keys give typed keys (compared by their data).
  data = lambda x: np.asarray(jax.random.key_data(x) if str(x.dtype) == "key<fry>" else x)
  for name, f in samplers.items():
    out = data(jax.vmap(f)(keys))
    one = np.stack([data(f(keys[k])) for k in range(4)])
    assert out.dtype == one.dtype and out.shape == one.shape, name
    assert out.tobytes() == one.tobytes(), name
  # Values JAX documents (as test_random.py cites them): docs/jep/9263-typed-keys.md,
  # uniform(key(0), (3,)) is [0.947667, 0.9785799, 0.33229148]; random_test.py testPRNGValues,
  # fold_in(PRNGKey(0), 4) is [2285895361, 433833334].
  two = jnp.stack([jax.random.key(0), jax.random.key(1)])
  u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (3,)))(two))
  assert [np.array2string(v) for v in u[0]] == ["0.947667", "0.9785799", "0.33229148"]
  folded = np.asarray(jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(0), np.arange(6, dtype=np.int32)))
  assert folded[4].tolist() == [2285895361, 433833334]
  for d in range(6):
    assert folded[d].tolist() == np.asarray(jax.random.fold_in(jax.random.PRNGKey(0), d)).tolist()
  # Keys and data both mapped, inside jit, and a nested vmap (a grid of keys).
  f = jax.jit(jax.vmap(lambda k, d: jax.random.normal(jax.random.fold_in(k, d), (3,))))
  out = np.asarray(f(keys, np.arange(4, dtype=np.int32)))
  for k in range(4):
    assert out[k].tobytes() == np.asarray(jax.random.normal(jax.random.fold_in(keys[k], k), (3,))).tobytes()
  grid = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (2,))))(jax.random.split(jax.random.key(3), (2, 3)))
  many = jax.random.split(jax.random.key(3), (2, 3))
  for a in range(2):
    for b in range(3):
      assert np.asarray(grid)[a, b].tobytes() == np.asarray(jax.random.uniform(many[a, b], (2,))).tobytes()


def _random_bits_lines(text):
  return [l for l in text.splitlines() if " = random_bits(" in l]


def test_vmap_of_random_is_one_kernel_over_the_batch_of_keys():
  # JAX's random_bits_p takes keys of any shape and its threefry2x32 is elementwise over them
  # (jax/_src/random/prng.py, threefry2x32.py): the batched program hashes every key in one
  # random_bits over the batch (no loop over the examples), each key's values its own.
  keys = jax.random.split(jax.random.key(0), 16)
  f = jax.jit(jax.vmap(lambda k: jax.random.uniform(k, (5,))))
  out = np.asarray(f(keys))
  for k in range(16):
    assert out[k].tobytes() == np.asarray(jax.random.uniform(keys[k], (5,))).tobytes(), k
  text = f.as_text()
  assert "loop(" not in text
  assert len(_random_bits_lines(text)) == 1 and "u32[16,5]" in _random_bits_lines(text)[0], text
  # Mapped data with shared keys (the counter batched), inside a mapped key (nested): a grid
  # fold_in(keys[a], d[b]) -> bits, one random_bits of the whole grid for each op.
  data = np.arange(3, dtype=np.int32)
  g = jax.jit(jax.vmap(jax.vmap(lambda k, d: jax.random.bits(jax.random.fold_in(k, d), (2, 2)), in_axes=(None, 0)),
                       in_axes=(0, None)))
  grid = np.asarray(g(keys[:4], data))
  assert grid.shape == (4, 3, 2, 2) and grid.dtype == np.uint32
  for a in range(4):
    for b in range(3):
      one = jax.random.bits(jax.random.fold_in(keys[a], int(data[b])), (2, 2))
      assert grid[a, b].tobytes() == np.asarray(one).tobytes(), (a, b)
  lines = _random_bits_lines(g.as_text())
  assert "loop(" not in g.as_text() and len(lines) == 2, g.as_text()
  assert "u32[4,3,2]" in lines[0] and "u32[4,3,2,2]" in lines[1], lines


def test_vmap_of_random_over_sharded_keys_runs_where_the_keys_live(mesh8, mesh):
  keys = jax.random.split(jax.random.key(7), 16)
  alone = np.stack([np.asarray(jax.random.uniform(keys[k], (8,))) for k in range(16)])
  # Keys split over 8 devices: each device hashes its 2 keys, nothing moves, and the result is
  # split as the keys are (JAX: the keys' spec, then None for the sample's dimensions).
  f = jax.jit(jax.vmap(lambda k: jax.random.uniform(k, (8,))))
  out = f(jax.device_put(keys, NamedSharding(mesh8, P("x"))))
  assert out.sharding.spec == P("x", None)
  assert np.asarray(out).tobytes() == alone.tobytes()
  text = f.as_text()
  assert "0 collectives, 0 bytes" in text and "u32[2,8]" in _random_bits_lines(text)[0], text
  # The sample's dimension split too (out_shardings): each device counts from its block's
  # first element, its keys' counters moved alike.
  g = jax.jit(jax.vmap(lambda k: jax.random.uniform(k, (8,))), out_shardings=NamedSharding(mesh, P("data", "model")))
  out = g(keys)
  assert np.asarray(out).tobytes() == alone.tobytes()
  for s in out.addressable_shards:
    assert np.asarray(s.data).tobytes() == alone[s.index].tobytes(), s.index
  text = g.as_text()
  assert "0 collectives" in text and "u32[4,4]" in _random_bits_lines(text)[0], text
  # Keys mapped along axis 1 (words first, the keys split over 8 devices), the float64
  # sampler (both words of each hash).
  by_column = jax.device_put(np.ascontiguousarray(np.asarray(jax.random.key_data(keys)).T),
                             NamedSharding(mesh8, P(None, "x")))
  h = jax.jit(jax.vmap(lambda k: jax.random.uniform(k, (3,), dtype=jnp.float64), in_axes=1))
  out = np.asarray(h(by_column))
  for k in range(16):
    assert out[k].tobytes() == np.asarray(jax.random.uniform(keys[k], (3,), dtype=jnp.float64)).tobytes(), k


# ---- sharding constraints (jax/_src/pjit.py: _sharding_constraint_batcher, _reshard_batcher) ---

def test_vmap_of_a_sharding_constraint_keeps_the_batch_dimension_whole(mesh):
  # The example's spec applies to the example's dimensions, the batch dimension inserted
  # unsplit (JAX marks it unconstrained in a constraint, None in a reshard; Tessera's specs have
  # no unconstrained entry, so it stays whole: 3 examples, which no axis of the mesh divides).
  xs = np.arange(3 * 8 * 6, dtype=np.float32).reshape(3, 8, 6)
  f = lambda x: jax.lax.with_sharding_constraint(jnp.sin(x) * 2.0, NamedSharding(mesh, P("data", "model")))
  g = jax.jit(jax.vmap(f))
  out = g(xs)
  assert out.sharding.spec == P(None, "data", "model")
  want = np.stack([np.asarray(jax.jit(f)(x)) for x in xs])  # each example alone: vmap's meaning
  np.testing.assert_array_equal(np.asarray(out), want)
  for s in out.addressable_shards:
    assert s.data.shape == (3, 2, 3)
    np.testing.assert_array_equal(np.asarray(s.data), want[s.index])
  assert "0 collectives" in g.as_text()
  # Nested, the inner vmap over axis 1: the example's spec after both batch dimensions.
  x4 = np.arange(2 * 8 * 3 * 6, dtype=np.float32).reshape(2, 8, 3, 6)
  out = jax.jit(jax.vmap(jax.vmap(f, in_axes=1)))(x4)
  assert out.shape == (2, 3, 8, 6) and out.sharding.spec == P(None, None, "data", "model")
  one = jax.jit(f)
  for a in range(2):
    for b in range(3):
      np.testing.assert_array_equal(np.asarray(out)[a, b], np.asarray(one(x4[a, :, b])))
  # reshard on an Explicit mesh: the type says the batch dimension is whole (JAX's
  # get_sharding_for_vmap inserts None).
  explicit = jax.make_mesh((8,), ("x",))
  with jax.sharding.set_mesh(explicit):
    r = jax.vmap(lambda x: jax.sharding.reshard(x * 2.0, P("x")))(np.ones((3, 16), np.float32))
    assert str(jax.typeof(r)) == "float32[3,16@x]"
    np.testing.assert_array_equal(np.asarray(r), np.full((3, 16), 2.0, np.float32))


# ---- arrays sharded in types and spmd_axis_name (tests/pjit_test.py: ShardingInTypesTest's
# test_mul_vmap, test_dot_general_vmap, test_shit_vmap_error_check,
# test_spmd_axis_name_explicit_mode_assert, test_unmapped_last_vmap; PJitTest's
# test_with_sharding_constraint_spmd_axis_name, test_wsc_vmap_abstract_mesh,
# test_with_sharding_constraint_vmap_spmd_axis_name_error) ------------------------------------

@pytest.fixture(scope="module")
def explicit_xy():
  return jax.make_mesh((2, 2), ("x", "y"))  # JAX's jtu.with_explicit_mesh((2, 2), ('x', 'y'))


@pytest.mark.parametrize("use_jit", [True, False])
def test_mul_vmap_over_an_explicitly_sharded_array(explicit_xy, use_jit):
  np_inp = np.arange(16.).reshape(8, 2).astype(np.float32)
  s = NamedSharding(explicit_xy, P("x", "y"))
  with jax.sharding.set_mesh(explicit_xy):
    arr = jax.device_put(np_inp, s)
    seen = []

    def f(x):
      seen.append(jax.typeof(x).sharding.spec)
      x = x * 2
      seen.append(jax.typeof(x).sharding.spec)
      x = x * x
      seen.append(jax.typeof(x).sharding.spec)
      return x

    if use_jit:
      f = jax.jit(f)
    f = jax.vmap(f)
    out = f(arr)
    assert seen and all(spec == P("y") for spec in seen)
    assert out.sharding.spec == s.spec and str(jax.typeof(out)) == "float32[8@x,2@y]"
    np.testing.assert_array_equal(np.asarray(out), (np_inp * 2) * (np_inp * 2))
    out = jax.jit(f)(arr)
    assert out.sharding.spec == s.spec
    np.testing.assert_array_equal(np.asarray(out), (np_inp * 2) * (np_inp * 2))
    g = lambda x: jnp.sum(f(x))
    for grad in (jax.grad(g), jax.jit(jax.grad(g))):
      out = grad(arr)
      assert out.sharding.spec == arr.sharding.spec
      np.testing.assert_allclose(np.asarray(out), 8 * np_inp)


def test_dot_general_vmap_over_explicitly_sharded_arrays(explicit_xy):
  np_inp1 = np.arange(16.).reshape(4, 2, 2).astype(np.float32)
  np_inp2 = np.arange(16.).reshape(2, 4, 2).astype(np.float32)
  with jax.sharding.set_mesh(explicit_xy):
    arr1 = jax.device_put(np_inp1, NamedSharding(explicit_xy, P("x", None, "y")))
    arr2 = jax.device_put(np_inp2, NamedSharding(explicit_xy, P(None, "x", "y")))
    f = lambda x, y: jnp.einsum("xy,yz->xz", x, y, out_sharding=P(None, "y"))
    out = jax.vmap(f, in_axes=(0, 1), out_axes=2)(arr1, arr2)
  assert out.shape == (2, 2, 4)
  assert out.sharding.spec == P(None, "y", "x")
  want = np.stack([np_inp1[n] @ np_inp2[:, n] for n in range(4)], axis=2)
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_vmap_over_differently_sharded_mapped_dimensions_is_an_error(explicit_xy):
  np_inp = np.arange(16.).reshape(8, 2).astype(np.float32)
  with jax.sharding.set_mesh(explicit_xy):
    arr = jax.device_put(np_inp, NamedSharding(explicit_xy, P("x", None)))
    arr2 = jax.device_put(np_inp.T, NamedSharding(explicit_xy, P(None, "y")))
    f = lambda x, y: x @ y
    for g in (jax.vmap(f, in_axes=(0, 1)), jax.jit(jax.vmap(f, in_axes=(0, 1)))):
      with pytest.raises(ValueError, match="Mapped away dimension of inputs passed to vmap should be sharded the same"):
        g(arr, arr2)
    with pytest.raises(ValueError, match="Only one of spmd_axis_name or arrays sharded on.*spmd_axis_name"):
      jax.vmap(f, spmd_axis_name="y")(arr, arr)
    with pytest.raises(ValueError, match="Unmapped values passed to vmap cannot be sharded along the mesh axis"):
      jax.vmap(lambda x, b: x + b, in_axes=(0, None))(arr, jax.device_put(np.ones(2, np.float32), P("x")))


@pytest.mark.parametrize("spmd_axis_name", ["x", "y"])
def test_spmd_axis_name_in_explicit_mode_must_be_the_mapped_split(explicit_xy, spmd_axis_name):
  np_inp = np.arange(16.).reshape(8, 2).astype(np.float32)
  with jax.sharding.set_mesh(explicit_xy):
    arr = jax.device_put(np_inp, NamedSharding(explicit_xy, P("x", "y")))
    seen = []

    @jax.jit
    @functools.partial(jax.vmap, spmd_axis_name=spmd_axis_name)
    def f(x):
      seen.append(jax.typeof(x).sharding.spec)
      return x * 2

    if spmd_axis_name == "x":
      out = f(arr)
      assert seen == [P("y")]
      assert out.sharding.spec == P("x", "y")
      np.testing.assert_array_equal(np.asarray(out), np_inp * 2)
    else:
      with pytest.raises(ValueError, match="Only one of spmd_axis_name or arrays sharded on.*spmd_axis_name"):
        f(arr)


def test_unmapped_result_is_broadcast_split_as_the_mapped_dimension():
  mesh = jax.make_mesh((2,), ("x",))
  with jax.sharding.set_mesh(mesh):
    arr = jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))
    out = jax.vmap(lambda x: jnp.zeros((4,)), out_axes=-1)(arr)
  assert out.shape == (4, 8)
  assert out.sharding.spec == P(None, "x")
  np.testing.assert_array_equal(np.asarray(out), np.zeros((4, 8), np.float32))


def test_spmd_axis_name_splits_the_batch_dimension_of_sharding_constraints():
  mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "mdl"), axis_types=jax.sharding.AxisType.Auto)
  x = np.arange(8 * 4 * 2 * 2, dtype=np.float32).reshape(8, 4, 2, 2)
  f = lambda inp: jax.lax.with_sharding_constraint(inp, NamedSharding(mesh, P("data", None, None)))
  out = jax.jit(jax.vmap(f, spmd_axis_name="mdl"))(x)
  assert out.sharding.spec == P("mdl", "data", None, None)
  np.testing.assert_array_equal(np.asarray(out), x)
  # A tuple of axes, as JAX accepts.
  out = jax.jit(jax.vmap(f, spmd_axis_name=("mdl", "replica")))(x)
  assert out.sharding.spec == P(("mdl", "replica"), "data", None, None)
  np.testing.assert_array_equal(np.asarray(out), x)


def test_wsc_vmap_with_and_without_spmd_axis_name(mesh8):
  mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=jax.sharding.AxisType.Auto)
  np_inp = np.arange(16, dtype=np.float32).reshape(8, 2)
  arr = jax.device_put(np_inp, NamedSharding(mesh, P("x", "y")))
  f = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("x"))) * 2
  out = jax.jit(jax.vmap(f))(arr)
  assert out.sharding.spec == P(None, "x")
  out2 = jax.jit(jax.vmap(f, spmd_axis_name="y"))(arr)
  assert out2.sharding.spec == P("y", "x")
  np.testing.assert_array_equal(np.asarray(out2), np_inp * 2)
  with pytest.raises(ValueError, match="spmd_axis_name"):
    jax.vmap(f, spmd_axis_name="x")(arr)


# ---- control flow (jax/_src/lax/control_flow/{loops,conditionals}.py's batching rules) --------

def _each(f, *args):
  """f run unbatched on each example (numpy arrays mapped along axis 0), stacked."""
  outs = [f(*[a[k] for a in args]) for k in range(len(args[0]))]
  return jax.tree_util.tree_map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)


def test_vmap_of_cond_and_switch_with_batched_or_unbatched_predicates():
  rng = np.random.default_rng(6)
  xs = rng.standard_normal((6, 3)).astype(np.float32)
  # A batched predicate: both branches run, each example takes its own (a select).
  f = lambda x: jax.lax.cond(jnp.sum(x) > 0, lambda v: (v * 2, jnp.sum(v)), lambda v: (v - 1, jnp.max(v)), x)
  out = jax.vmap(f)(xs)
  want = [(x * 2, x.sum()) if x.sum() > 0 else (x - 1, x.max()) for x in xs]
  np.testing.assert_allclose(np.asarray(out[0]), np.stack([w[0] for w in want]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(out[1]), np.stack([w[1] for w in want]), rtol=1e-6)
  each = _each(jax.jit(f), xs)
  np.testing.assert_array_equal(np.asarray(out[0]), each[0])
  np.testing.assert_array_equal(np.asarray(out[1]), each[1])
  # An unbatched predicate with a batched operand stays a cond; an unbatched operand too.
  w = np.float32(3.0)
  g = lambda x, p: jax.lax.cond(p, lambda v: v * w + x, lambda v: v - x, x * x)
  for p in (True, False):
    out = jax.vmap(g, in_axes=(0, None))(xs, np.bool_(p))
    want = np.stack([x * x * w + x if p else x * x - x for x in xs])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
  # switch with a batched index, out-of-range ones clamped as lax.switch documents.
  idx = np.array([-3, 0, 1, 2, 7, 1], np.int32)
  branches = [lambda v: v + 1, lambda v: v * v, lambda v: -v]
  out = jax.vmap(lambda i, x: jax.lax.switch(i, branches, x))(idx, xs)
  want = np.stack([[x + 1, x * x, -x][min(max(i, 0), 2)] for i, x in zip(idx, xs)])
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)


def test_vmap_of_scan_and_fori_loop_with_batched_carries_and_xs():
  rng = np.random.default_rng(7)
  xs = rng.standard_normal((4, 5, 2)).astype(np.float32)   # 4 examples of 5 rows
  step = lambda c, x: (c * 0.5 + x, c * x)

  def ref(x, c0):
    c, ys = c0, []
    for row in x:
      c, y = c * 0.5 + row, c * row
      ys.append(y)
    return c, np.stack(ys)

  # Batched xs, an unbatched initial carry (it becomes batched: the fixed point).
  f = lambda x: jax.lax.scan(step, jnp.ones(2), x)
  c, ys = jax.vmap(f)(xs)
  want = [ref(x, np.ones(2, np.float32)) for x in xs]
  assert c.shape == (4, 2) and ys.shape == (4, 5, 2)
  np.testing.assert_allclose(np.asarray(c), np.stack([w[0] for w in want]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(ys), np.stack([w[1] for w in want]), rtol=1e-5)
  each = _each(jax.jit(f), xs)
  np.testing.assert_allclose(np.asarray(ys), each[1], rtol=1e-6)
  # A batched carry over unbatched xs, reversed, with an unbatched carry that stays unbatched.
  x0 = xs[0]
  g = lambda c: jax.lax.scan(lambda cs, x: ((cs[0] * 0.5 + x, cs[1] + 1.0), cs[0] * x), (c, np.float32(0)), x0,
                             reverse=True)
  (cb, n), ys = jax.vmap(g)(xs[:, 0])
  for k in range(4):
    c_ref, ys_ref = ref(x0[::-1], xs[k, 0])
    np.testing.assert_allclose(np.asarray(cb)[k], c_ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ys)[k], ys_ref[::-1], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(n), np.full(4, 5.0, np.float32))
  # fori_loop (a scan) with a batched carry, inside jit.
  h = jax.jit(jax.vmap(lambda v: jax.lax.fori_loop(0, 4, lambda i, c: c * 2 + i.astype(np.float32), v)))
  v = xs[:, 0, 0]
  want = v.copy()
  for i in range(4):
    want = want * 2 + i
  np.testing.assert_allclose(np.asarray(h(v)), want, rtol=1e-6)


def test_vmap_of_while_loop_with_batched_and_unbatched_predicates():
  # A batched predicate: each example counts to its own bound and keeps its carry after.
  ns = np.array([0, 3, 1, 5], np.int32)
  f = lambda n: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2.0), (np.int32(0), np.float32(1)))
  i, p = jax.vmap(f)(ns)
  np.testing.assert_array_equal(np.asarray(i), ns)
  np.testing.assert_array_equal(np.asarray(p), 2.0 ** ns.astype(np.float32))
  each = _each(jax.jit(f), ns)
  np.testing.assert_array_equal(np.asarray(p), each[1])
  # An unbatched predicate over a batched carry: one loop for all examples.
  xs = np.array([1.0, -2.0, 0.5], np.float32)
  g = lambda x: jax.lax.while_loop(lambda c: c[0] < 4, lambda c: (c[0] + 1, c[1] * x + 1.0), (np.int32(0), x))
  i, y = jax.vmap(g)(xs)
  want = []
  for x in xs:
    y_ref = x
    for _ in range(4):
      y_ref = y_ref * x + 1.0
    want.append(y_ref)
  np.testing.assert_array_equal(np.asarray(i), [4, 4, 4])
  np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6)


def test_vmap_of_while_loop_with_a_batched_predicate_keeps_closed_over_values_unbatched():
  # A batched predicate keeps each example's carries once it stops, so the carries the body
  # changes are batched; a closed-over table (a carry the body hands on unchanged, as JAX's
  # body_consts are operands of its while_p and not carries: loops.py, _while_loop_batching_rule)
  # is read, never broadcast to the batch. Values against the loop on the host.
  rng = np.random.default_rng(8)
  table = (rng.standard_normal((256, 256)) / 16).astype(np.float32)  # 256 KiB
  ns = np.array([0, 3, 1, 5, 2, 4, 6, 1], np.int32)

  def f(n):
    return jax.lax.while_loop(lambda c: c[0] < n,
                              lambda c: (c[0] + 1, jnp.tanh(c[1] @ table)),
                              (np.int32(0), jnp.ones((256,), np.float32)))

  g = jax.jit(jax.vmap(f))
  i, v = g(ns)
  np.testing.assert_array_equal(np.asarray(i), ns)
  for k, n in enumerate(ns):
    want = np.ones((256,), np.float32)
    for _ in range(n):
      want = np.tanh(want @ table)
    np.testing.assert_allclose(np.asarray(v)[k], want, rtol=1e-5, atol=1e-5)  # float32 dot order
  text = g.as_text()
  assert "f32[8,256,256]" not in text, text  # the table is not broadcast to the batch
  assert "f32[8,256]" in text  # the batched carry is


# ---- vmap of a shard_map (jax/_src/shard_map.py's _shard_map_batch) --------------------------

def test_vmap_of_a_shard_map_as_jax(mesh, mesh8):
  # tests/shard_map_test.py test_vmap_basic (2 * x, in and out specs gaining the batch dimension
  # whole) and a body with a psum and axis_index against the per-example loop; then
  # test_vmap_spmd_axis_name (P('x') becomes P('y', 'x') over spmd_axis_name='y') and
  # test_vmap_spmd_axis_name_error (spmd_axis_name in the specs).
  x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 16
  w = np.linspace(-1, 1, 16).astype(np.float32)
  for m, axes in ((mesh8, ("x",)), (mesh, ("data", "model"))):
    spec = P(axes)
    g = jax.shard_map(lambda a: 2. * a, mesh=m, in_specs=spec, out_specs=spec)
    np.testing.assert_allclose(np.asarray(jax.vmap(g)(x)), 2 * x)

    @jax.shard_map(mesh=m, in_specs=(spec, spec), out_specs=spec)
    def f(a, b):
      y = a * b
      return y + jax.lax.psum(jnp.sum(y), axes) + jax.lax.axis_index(axes).astype(jnp.float32)

    block = 16 // m.size
    want = np.stack([row * w + np.dot(row, w) + np.arange(16) // block for row in x])
    out = jax.jit(jax.vmap(f, in_axes=(0, None)))(x, w)
    assert out.sharding.spec == P(None, axes)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)

  h = jax.shard_map(lambda a: a * 3., mesh=mesh, in_specs=P("model"), out_specs=P("model"))
  out = jax.jit(jax.vmap(h, spmd_axis_name="data"))(x)
  assert out.sharding.spec == P("data", "model")
  np.testing.assert_allclose(np.asarray(out), 3 * x)
  with pytest.raises(ValueError, match=r"vmap spmd_axis_name cannot appear in shard_map in_specs: \('model',\)"):
    jax.vmap(h, spmd_axis_name="model")(x)


# ---- vmap of a shard_map over a dimension split over Explicit axes ----------------------------
# (jax/_src/shard_map.py's _shard_map_batch with explicit_mesh_axis: the shard_map is manual over
# the mesh's other axes only, its specs gain the batch dimension whole, and the result's mapped
# dimension keeps the argument's split.)

def test_vmap_explicit_mesh_axis():
  # tests/shard_map_test.py test_vmap_explicit_mesh_axis, as JAX writes it, values checked.
  mesh = jax.make_mesh((1, 2, 2), ("z", "x", "y"))

  @jax.shard_map(mesh=mesh, in_specs=P("y"), out_specs=P("y"))
  def f(x):
    return x

  s = NamedSharding(mesh, P(("z", "x"), "y"))
  np_inp = np.arange(4 * 4, dtype=np.float32).reshape(4, 4)
  x = jax.device_put(np_inp, s)
  out = jax.jit(jax.vmap(f))(x)
  assert out.sharding.spec == s.spec
  np.testing.assert_array_equal(np.asarray(out), np_inp)


def test_vmap_explicit_mesh_axis_single_axis():
  # tests/shard_map_test.py test_vmap_explicit_mesh_axis_single_axis (jtu.with_explicit_mesh sets
  # the mesh; the shard_map takes it from the context); then the same shard_map as a jitted
  # function under vmap, and under grad, against numpy.
  mesh = jax.make_mesh((2, 2), ("data", "model"))
  np_inp = np.arange(4 * 4, dtype=np.float32).reshape(4, 4)
  with jax.sharding.set_mesh(mesh):
    x = jax.device_put(np_inp, P("data", "model"))

    @jax.shard_map(in_specs=P("model"), out_specs=P("model"))
    def f(x):
      return x

    out = jax.jit(jax.vmap(f))(x)
    assert out.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(out), np_inp)

    @jax.shard_map(in_specs=P("model"), out_specs=P("model"))
    def g(x):
      return jnp.sin(x) * 2. + jax.lax.psum(jnp.sum(x), "model")

    want = np.stack([np.sin(r) * 2 + r.sum() for r in np_inp])
    for h in (jax.vmap(jax.jit(g)), jax.jit(jax.vmap(jax.jit(g)))):
      out = h(x)
      assert out.sharding.spec == P("data", "model")
      np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5)
    grads = jax.jit(jax.vmap(jax.grad(lambda r: jnp.sum(g(r)))))(x)
    assert grads.sharding.spec == P("data", "model")
    # d/dr_j sum_k (2 sin r_k + sum(r)) = 2 cos r_j + 4 (the psum'd total is in each of 4 entries)
    np.testing.assert_allclose(np.asarray(grads), 2 * np.cos(np_inp) + 4, rtol=1e-5)


def test_vmap_explicit_mesh_axis_error():
  # tests/shard_map_test.py test_vmap_explicit_mesh_axis_error.
  mesh = jax.make_mesh((2, 2), ("x", "y"))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P("x"), out_specs=P("x"), axis_names={"x", "y"})
  def f(x):
    return x

  x = jax.device_put(np.arange(4 * 4, dtype=np.float32).reshape(4, 4), NamedSharding(mesh, P("x", "y")))
  with pytest.raises(ValueError, match="jax.shard_map requires axis_names.*subset of"):
    jax.jit(jax.vmap(f))(x)
  with pytest.raises(ValueError, match="Only one of spmd_axis_name or arrays sharded on `Explicit` mesh axis"
                     " type is allowed"):
    jax.jit(jax.vmap(f, spmd_axis_name="y"))(x)


def test_explicit_ctx_vmap_over_auto_axes():
  # tests/pjit_test.py test_explicit_ctx_vmap_over_auto_axes, with zeros among the ones so that
  # where takes both sides.
  mesh = jax.make_mesh((2, 2), ("x", "y"))
  np_inp = (np.arange(40) % 3).reshape(20, 2).astype(np.float32)
  with jax.sharding.set_mesh(mesh):
    xs = jax.device_put(np_inp, P(("x", "y"), None))

    @functools.partial(jax.sharding.auto_axes, out_sharding=P())
    def f(x):
      return jnp.where(x != 0, jnp.ones(2), x)

    out = jax.jit(jax.vmap(f))(xs)
  assert out.sharding.spec == P(("x", "y"), None)
  np.testing.assert_array_equal(np.asarray(out), (np_inp != 0).astype(np.float32))


def test_vmap_spmd_axis_name_explicit_axes_inside():
  # tests/pjit_test.py test_vmap_spmd_axis_name_explicit_axes_inside; the product checked.
  mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  np_inp = np.arange(16, dtype=np.float32).reshape(2, 8)
  with jax.sharding.set_mesh(mesh):
    arr1 = jax.device_put(np_inp, P())
    arr2 = jax.device_put(np_inp, P())
    seen = []

    @jax.jit
    def f(x, y):
      @functools.partial(jax.sharding.explicit_axes, in_sharding=(P("y"), P("y")))
      def g(a, b):
        seen.append((jax.typeof(a).sharding.spec, jax.typeof(b).sharding.spec))
        a = jax.sharding.reshard(a, P())
        seen.append(jax.typeof(a).sharding.spec)
        out = a * b
        seen.append(jax.typeof(out).sharding.spec)
        return out
      return g(x, y)

    out = jax.jit(jax.vmap(f, spmd_axis_name="x"))(arr1, arr2)
  assert seen == [(P("y"), P("y")), P(None), P("y")]
  np.testing.assert_array_equal(np.asarray(out), np_inp * np_inp)

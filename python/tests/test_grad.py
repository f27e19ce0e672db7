# grad / value_and_grad over pytrees, and the MLP of JAX's "Distributed arrays and automatic
# parallelization" notebook ([DA], section "Examples: neural networks"), ported nearly
# verbatim: the imports changed, jax.random replaced by numpy's generator (Tessera has no
# jax.random), smaller layers. Every number is checked against numpy on the host.
# [DA] https://docs.jax.dev/en/latest/notebooks/Distributed_arrays_and_automatic_parallelization.html
import numpy as np
import pytest

import tessera
import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import AxisType, NamedSharding, PartitionSpec as P

rng = np.random.default_rng(1)


def test_grad_over_a_dict_of_params(mesh):
    x = rng.normal(size=(16, 8)).astype(np.float32)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    b = rng.normal(size=(4,)).astype(np.float32)

    def loss(p, x):
        h = jnp.tanh(x @ p["w"] + p["b"])
        return jnp.mean(h ** 2)

    params = tessera.device_put({"w": w, "b": b}, NamedSharding(mesh, P()))
    xs = tessera.device_put(x, NamedSharding(mesh, P("data", None)))
    g = jax.jit(jax.grad(loss))(params, xs)
    # The host gradient: d mean(h^2) = 2 h (1 - h^2) / n through tanh.
    h = np.tanh(x @ w + b)
    dz = 2 * h * (1 - h ** 2) / h.size
    assert set(g) == {"w", "b"}
    np.testing.assert_allclose(np.asarray(g["w"]), x.T @ dz, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g["b"]), dz.sum(0), rtol=1e-4, atol=1e-6)
    # value_and_grad with a tuple of argnums, called outside jit (jitted for us).
    v, (gp, gx) = jax.value_and_grad(loss, argnums=(0, 1))(params, xs)
    assert float(v) == pytest.approx(float(np.mean(h ** 2)), rel=1e-5)
    np.testing.assert_allclose(np.asarray(gx), dz @ w.T, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gp["b"]), dz.sum(0), rtol=1e-4, atol=1e-6)


def test_has_aux_returns_the_aux_pytree_undifferentiated(mesh):
    # jax.grad(has_aux=True): f returns (value, aux); grad gives (g, aux), value_and_grad
    # ((value, aux), g) (jax.grad's docstring).
    x = rng.normal(size=(16, 8)).astype(np.float32)
    w = rng.normal(size=(8,)).astype(np.float32)

    def loss(w, x):
        y = x @ w
        return jnp.sum(y * y), {"mean": jnp.mean(y), "pred": y}

    xs = tessera.device_put(x, NamedSharding(mesh, P("data", None)))
    g, aux = jax.jit(jax.grad(loss, has_aux=True))(w, xs)
    y = x @ w
    np.testing.assert_allclose(np.asarray(g), 2 * x.T @ y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(aux["pred"]), y, rtol=1e-5, atol=1e-6)
    (v, aux2), g2 = jax.value_and_grad(loss, has_aux=True)(w, xs)
    assert float(v) == pytest.approx(float(np.sum(y * y)), rel=1e-5)
    assert float(aux2["mean"]) == pytest.approx(float(y.mean()), rel=1e-4, abs=1e-6)
    np.testing.assert_allclose(np.asarray(g2), np.asarray(g), rtol=1e-6)
    with pytest.raises(TypeError, match="return a pair"):
        jax.grad(lambda w, x: jnp.sum(x @ w), has_aux=True)(w, xs)


def test_grad_of_integer_input_is_an_error(mesh):
    with pytest.raises(ValueError, match="float"):
        jax.jit(jax.grad(lambda x: jnp.sum(x * 2.0)))(np.arange(4, dtype=np.int32))


# ---- [DA]'s MLP, as the notebook writes it ------------------------------------------------

def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jnp.maximum(outputs, 0)
  return outputs

def loss(params, batch):
  inputs, targets = batch
  predictions = predict(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))

loss_jit = jax.jit(loss)
gradfun = jax.jit(jax.grad(loss))

def init_layer(key, n_in, n_out):
  W = key.normal(size=(n_in, n_out)).astype(np.float32) / jnp.sqrt(n_in)
  b = key.normal(size=(n_out,)).astype(np.float32)
  return W, b

def init_model(key, layer_sizes, batch_size):
  params = list(map(init_layer, [key] * (len(layer_sizes) - 1), layer_sizes[:-1], layer_sizes[1:]))
  inputs = key.normal(size=(batch_size, layer_sizes[0])).astype(np.float32)
  targets = key.normal(size=(batch_size, layer_sizes[-1])).astype(np.float32)
  return params, (inputs, targets)


def host_train(params, batch, step_size, steps):
    """The same training in numpy: forward, backward by hand, SGD."""
    params = [(W.astype(np.float64), b.astype(np.float64)) for W, b in params]
    x, t = (a.astype(np.float64) for a in batch)

    def forward(params):
        acts, zs, a = [x], [], x
        for W, b in params:
            z = a @ W + b
            zs.append(z)
            a = np.maximum(z, 0)
            acts.append(a)
        return acts, zs

    for _ in range(steps):
        acts, zs = forward(params)
        dz = 2 * (zs[-1] - t) / x.shape[0]
        grads = []
        for k in reversed(range(len(params))):
            grads.append((acts[k].T @ dz, dz.sum(0)))
            dz = (dz @ params[k][0].T) * (zs[k - 1] > 0) if k else None
        grads.reverse()
        params = [(W - step_size * dW, b - step_size * db) for (W, b), (dW, db) in zip(params, grads)]
    zs = forward(params)[1]
    return np.mean(np.sum((zs[-1] - t) ** 2, axis=-1))


def test_distributed_arrays_mlp_data_and_tensor_parallel():
  layer_sizes = [64, 128, 128, 10]
  batch_size = 64
  params, batch = init_model(np.random.default_rng(0), layer_sizes, batch_size)
  host_params = [(np.asarray(W), np.asarray(b)) for W, b in params]
  host_batch = batch
  step_size = 1e-2
  steps = 5

  # 8-way batch data parallelism
  # Auto axes: the tutorial's layouts are propagated by the compiler (its tensor-parallel step
  # contracts a 'model'-split hidden layer on both operands, which Explicit axes refuse without
  # out_sharding); JAX's guides write such a mesh jax.make_mesh(shape, names, (Auto, ...)).
  mesh = jax.make_mesh((8,), ('batch',), axis_types=(AxisType.Auto,))
  sharding = jax.NamedSharding(mesh, P('batch'))
  replicated_sharding = jax.NamedSharding(mesh, P())
  batch = jax.device_put(batch, sharding)
  params = jax.device_put(params, replicated_sharding)
  loss_jit(params, batch)

  for _ in range(steps):
    grads = gradfun(params, batch)
    params = [(W - step_size * dW, b - step_size * db)
              for (W, b), (dW, db) in zip(params, grads)]
  got = loss_jit(params, batch)
  assert float(got) == pytest.approx(host_train(host_params, host_batch, step_size, steps), rel=1e-4)

  # 4-way batch data parallelism and 2-way model tensor parallelism
  mesh = jax.make_mesh((4, 2), ('batch', 'model'), axis_types=(AxisType.Auto, AxisType.Auto))
  batch = jax.device_put(host_batch, jax.NamedSharding(mesh, P('batch', None)))
  sharding = jax.NamedSharding(mesh, P(None, 'model'))
  replicated_sharding = jax.NamedSharding(mesh, P())
  (W1, b1), (W2, b2), (W3, b3) = host_params
  W1 = jax.device_put(W1, replicated_sharding)
  b1 = jax.device_put(b1, replicated_sharding)
  W2 = jax.device_put(W2, sharding)
  b2 = jax.device_put(b2, jax.NamedSharding(mesh, P('model')))
  W3 = jax.device_put(W3, jax.NamedSharding(mesh, P('model', None)))
  b3 = jax.device_put(b3, replicated_sharding)
  params = [(W1, b1), (W2, b2), (W3, b3)]

  for _ in range(steps):
    grads = gradfun(params, batch)
    params = [(W - step_size * dW, b - step_size * db)
              for (W, b), (dW, db) in zip(params, grads)]
  got = loss_jit(params, batch)
  assert float(got) == pytest.approx(host_train(host_params, host_batch, step_size, steps), rel=1e-4)
  assert params[1][0].sharding.spec == P(None, 'model')

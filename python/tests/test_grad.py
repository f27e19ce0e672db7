# grad / value_and_grad over pytrees, and the MLP of JAX's "Distributed arrays and automatic
# parallelization" notebook ([DA], section "Examples: neural networks") as
# examples/python/mlp_tutorial.py ports it (smaller layers here). Every number is checked
# against numpy on the host.
# [DA] https://docs.jax.dev/en/latest/notebooks/Distributed_arrays_and_automatic_parallelization.html
import os
import sys

import numpy as np
import pytest

import tessera
import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P

from conftest import SOURCE_DIR

sys.path.insert(0, os.path.join(SOURCE_DIR, "examples", "python"))
import mlp_tutorial  # noqa: E402

import host_mlp  # noqa: E402

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


# ---- [DA]'s MLP: examples/python/mlp_tutorial.py, the notebook's code as a user writes it ----

def test_distributed_arrays_mlp_data_and_tensor_parallel():
  # The example's two phases, each against the same SGD in numpy (float64) from the same
  # initial parameters: 5 steps data parallel, then 5 more with the hidden layers split.
  layer_sizes = [64, 128, 128, 128, 10]
  step_size, steps = 1e-3, 5
  params, batch = mlp_tutorial.init_model(jax.random.key(0), layer_sizes, 64)
  host_params = [(np.asarray(W), np.asarray(b)) for W, b in params]
  host_batch = tuple(np.asarray(a) for a in batch)

  params, batch = mlp_tutorial.data_parallel(params, batch, step_size, steps)
  assert batch[0].sharding.spec == P('batch')
  got = mlp_tutorial.loss_jit(params, batch)
  assert float(got) == pytest.approx(host_mlp.sgd_loss(host_params, host_batch, step_size, steps), rel=1e-4)

  params, batch = mlp_tutorial.data_and_tensor_parallel(params, batch, step_size, steps)
  got = mlp_tutorial.loss_jit(params, batch)
  assert float(got) == pytest.approx(host_mlp.sgd_loss(host_params, host_batch, step_size, 2 * steps), rel=1e-4)
  assert params[1][0].sharding.is_equivalent_to(NamedSharding(batch[0].sharding.mesh, P(None, 'model')), 2)
  assert params[2][0].sharding.is_equivalent_to(NamedSharding(batch[0].sharding.mesh, P('model', None)), 2)
  assert batch[0].sharding.spec == P('batch', None)

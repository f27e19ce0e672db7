# The neural network of JAX's "Distributed arrays and automatic parallelization" notebook
# (section "Examples: neural networks"), as a JAX user writes it, with the imports changed:
# the same model, init and SGD loop, first with 8-way batch data parallelism, then with 4-way
# batch data parallelism and 2-way model tensor parallelism (W2 split by columns, W3 by rows),
# the layouts propagated by the compiler.
#
#   PYTHONPATH=build/python python3 examples/python/mlp_tutorial.py
#
# Prints the loss before and after each phase's training (the second phase goes on from the
# first's parameters, as in the notebook).
#
# The one change beyond the imports: the meshes' axes are Auto. jax.make_mesh makes Explicit
# axes (JAX >= 0.9), where W2 under P(None, 'model') followed by W3 under P('model', None) is a
# contraction split on both operands, which explicit mode refuses without an out_sharding (in
# JAX as here); the notebook was written for Auto axes, which the compiler propagates.
import sys

import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import AxisType, NamedSharding, PartitionSpec as P


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
  k1, k2 = jax.random.split(key)
  W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
  b = jax.random.normal(k2, (n_out,))
  return W, b

def init_model(key, layer_sizes, batch_size):
  key, *keys = jax.random.split(key, len(layer_sizes))
  params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

  key, *keys = jax.random.split(key, 3)
  inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
  targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

  return params, (inputs, targets)


def sgd(params, batch, step_size, steps):
  for _ in range(steps):
    grads = gradfun(params, batch)
    params = [(W - step_size * dW, b - step_size * db)
              for (W, b), (dW, db) in zip(params, grads)]
  return params


def data_parallel(params, batch, step_size, steps):
  """8-way batch data parallelism: the batch split over 'batch', the parameters replicated."""
  mesh = jax.make_mesh((8,), ('batch',), axis_types=(AxisType.Auto,))
  sharding = NamedSharding(mesh, P('batch'))
  replicated_sharding = NamedSharding(mesh, P())
  batch = jax.device_put(batch, sharding)
  params = jax.device_put(params, replicated_sharding)
  return sgd(params, batch, step_size, steps), batch


def data_and_tensor_parallel(params, batch, step_size, steps):
  """4-way batch data parallelism and 2-way model tensor parallelism (four layers)."""
  mesh = jax.make_mesh((4, 2), ('batch', 'model'), axis_types=(AxisType.Auto,) * 2)
  batch = jax.device_put(batch, NamedSharding(mesh, P('batch', None)))
  replicated_sharding = NamedSharding(mesh, P())

  (W1, b1), (W2, b2), (W3, b3), (W4, b4) = params

  W1 = jax.device_put(W1, replicated_sharding)
  b1 = jax.device_put(b1, replicated_sharding)

  W2 = jax.device_put(W2, NamedSharding(mesh, P(None, 'model')))
  b2 = jax.device_put(b2, NamedSharding(mesh, P('model')))

  W3 = jax.device_put(W3, NamedSharding(mesh, P('model', None)))
  b3 = jax.device_put(b3, replicated_sharding)

  W4 = jax.device_put(W4, replicated_sharding)
  b4 = jax.device_put(b4, replicated_sharding)

  params = (W1, b1), (W2, b2), (W3, b3), (W4, b4)
  return sgd(params, batch, step_size, steps), batch


def main(layer_sizes=(784, 1024, 1024, 1024, 10), batch_size=1024, step_size=1e-5, steps=30):
  params, batch = init_model(jax.random.key(0), list(layer_sizes), batch_size)
  for name, phase in (("8-way data parallel", data_parallel),
                      ("4-way data x 2-way tensor parallel", data_and_tensor_parallel)):
    print(f"{name}: loss {float(loss_jit(params, batch)):.4f}", end="")
    params, batch = phase(params, batch, step_size, steps)
    print(f", after {steps} steps {float(loss_jit(params, batch)):.4f}")


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  main(steps=int(sys.argv[1]) if len(sys.argv) > 1 else 30)

# The toy examples of JAX's shard_map notebook (docs/notebooks/shard_map.md, "Toy examples"),
# as a JAX user writes them, with the imports changed: the matrix multiplies (all-gather on
# one side; psum_scatter of the result, plain, overlapped with ppermute, bidirectional) and the
# neural networks (8-way data parallelism, FSDP, tensor parallelism, FSDP + TP), each checked
# against the unsharded computation as the notebook checks it.
#
#   PYTHONPATH=build/python python3 examples/python/shard_map_tutorial.py
#
# Prints "True" for every matmul, and for every network its loss (reference, then sharded)
# and whether the gradients agree ("True"), as the notebook does.
#
# The notebook calls jax.set_mesh(mesh) once per section; here each section is a function that
# sets its mesh for its duration (`with jax.set_mesh(mesh):`), so the functions can be called
# in any order.
from functools import partial

import tessera as jax
import tessera.numpy as jnp
from tessera import lax
from tessera.sharding import Mesh, NamedSharding, PartitionSpec as P
from tessera.tree_util import tree_all, tree_map


# ---- Matrix multiplies ---------------------------------------------------------------------

def matmuls():
  """The four matmuls on a 4-device mesh: {name: (out, lhs, rhs)}."""
  mesh = Mesh(jax.devices()[:4], ('i',))
  out = {}
  with jax.set_mesh(mesh):

    def device_put(x, pspec):
      return jax.device_put(x, NamedSharding(mesh, pspec))

    # Example 1: all-gather on one side
    lhs_spec = P('i', None)
    lhs = device_put(jax.random.normal(jax.random.key(0), (8, 8)), lhs_spec)
    rhs_spec = P('i', None)
    rhs = device_put(jax.random.normal(jax.random.key(1), (8, 4)), rhs_spec)

    @jax.jit
    @jax.shard_map(in_specs=(lhs_spec, rhs_spec),
                   out_specs=rhs_spec)
    def matmul_allgather(lhs_block, rhs_block):
      rhs = jax.lax.all_gather(rhs_block, 'i', tiled=True)
      return lhs_block @ rhs

    out["allgather"] = matmul_allgather(lhs, rhs), lhs, rhs

    # Example 2: psum_scatter the result
    lhs_spec = P(None, 'i')
    lhs = device_put(lhs, lhs_spec)
    rhs_spec = P('i', None)
    rhs = device_put(rhs, rhs_spec)

    @jax.shard_map(in_specs=(lhs_spec, rhs_spec),
                   out_specs=rhs_spec)
    def matmul_psumscatter(lhs_block, rhs_block):
      out_summand = lhs_block @ rhs_block
      return jax.lax.psum_scatter(out_summand, 'i', tiled=True)

    out["psumscatter"] = matmul_psumscatter(lhs, rhs), lhs, rhs

    @jax.shard_map(in_specs=(lhs_spec, rhs_spec),
                   out_specs=rhs_spec)
    def matmul_psumscatter_overlapped(lhs_block, rhs_block):
      size = jax.lax.axis_size('i')
      idx = jax.lax.axis_index('i')
      shift = partial(jax.lax.ppermute, axis_name='i',
                      perm=[(i, (i - 1) % size) for i in range(size)])
      lhs_block = lhs_block.reshape(size, -1, lhs_block.shape[1])  # split 1st axis

      out_summand = lhs_block[(idx + 1) % size] @ rhs_block
      for i in range(1, size):
        out_summand = shift(out_summand)
        out_summand += lhs_block[(idx + i + 1) % size] @ rhs_block
      return out_summand

    out["psumscatter_overlapped"] = matmul_psumscatter_overlapped(lhs, rhs), lhs, rhs

    @jax.shard_map(in_specs=(lhs_spec, rhs_spec),
                   out_specs=rhs_spec)
    def matmul_psumscatter_overlapped_bidi(lhs_block, rhs_block):
      size = jax.lax.axis_size('i')
      idx = jax.lax.axis_index('i')
      shift_up = partial(jax.lax.ppermute, axis_name='i',
                         perm=[(i, (i + 1) % size) for i in range(size)])
      shift_dn = partial(jax.lax.ppermute, axis_name='i',
                         perm=[(i, (i - 1) % size) for i in range(size)])

      B = lhs_block.shape[0] // size // 2  # half-size blocks
      lhs_blocks = lambda i, hi: lax.dynamic_slice_in_dim(lhs_block, (2*i+hi) * B, B, 0)

      out_summand_lo = lhs_blocks((idx - 1) % size, 0) @ rhs_block
      out_summand_hi = lhs_blocks((idx + 1) % size, 1) @ rhs_block
      for i in range(1, size):
        out_summand_lo = shift_up(out_summand_lo)
        out_summand_hi = shift_dn(out_summand_hi)
        out_summand_lo += lhs_blocks((idx - i - 1) % size, 0) @ rhs_block
        out_summand_hi += lhs_blocks((idx + i + 1) % size, 1) @ rhs_block
      return jnp.concatenate([out_summand_lo, out_summand_hi])

    out["psumscatter_overlapped_bidi"] = matmul_psumscatter_overlapped_bidi(lhs, rhs), lhs, rhs
  return out


# ---- Neural networks -----------------------------------------------------------------------

def predict(params, inputs):
  for W, b in params:
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs

def loss(params, batch):
  inputs, targets = batch
  predictions = predict(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))

def init_layer(key, n_in, n_out):
  k1, k2 = jax.random.split(key)
  W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
  b = jax.random.normal(k2, (n_out,))
  return W, b

def init(key, layer_sizes, batch_size):
  key, *keys = jax.random.split(key, len(layer_sizes))
  params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))

  key, *keys = jax.random.split(key, 3)
  inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
  targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))

  return params, (inputs, targets)

def allclose(a, b):
  return tree_all(tree_map(partial(jnp.allclose, atol=1e-2, rtol=1e-2), a, b))


@jax.shard_map(out_specs=P())
def loss_dp(params, local_batch):
  inputs, targets = local_batch
  predictions = predict(params, inputs)  # use reference 'predict`
  local_loss = jnp.mean(jnp.sum((predictions - targets)**2, axis=-1))
  return jax.lax.pmean(local_loss, 'batch')


@partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
def predict_fsdp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
    b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
    outputs = jnp.dot(inputs, W) + b
    inputs = jax.nn.relu(outputs)
  return outputs

@jax.shard_map(out_specs=P())
def loss_fsdp(local_params, local_batch):
  inputs, targets = local_batch
  predictions = predict_fsdp(local_params, inputs)
  local_loss = jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))
  return jax.lax.pmean(local_loss, 'batch')


def predict_tp(params, inputs):
  for W, b in params:
    outputs = gemm_tp(inputs, W, b)
    inputs = jax.nn.relu(outputs)
  return outputs

@jax.shard_map(in_specs=(P(None, 'feats'), P('feats', None), P('feats')),
               out_specs=P(None, 'feats'))
def gemm_tp(inputs, W, b):
  block_result = jnp.dot(inputs, W)
  return jax.lax.psum_scatter(block_result, 'feats',
                              scatter_dimension=1, tiled=True) + b

def loss_tp(params, batch):
  inputs, targets = batch
  predictions = predict_tp(params, inputs)
  return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))  # NOTE psum!


@partial(jax.remat, policy=lambda op, *_, **__: str(op) != 'all_gather')
def predict_fsdp_tp(params_frag, inputs):
  for W_frag, b_frag in params_frag:
    W = jax.lax.all_gather(W_frag, 'batch', tiled=True)
    b = jax.lax.all_gather(b_frag, 'batch', tiled=True)
    block_result = jnp.dot(inputs, W)
    outputs = jax.lax.psum_scatter(block_result, 'feats',
                                   scatter_dimension=1, tiled=True) + b
    inputs = jax.nn.relu(outputs)
  return outputs

@jax.shard_map(in_specs=(P(('feats', 'batch')), P('batch', 'feats')),
               out_specs=P())
def loss_fsdp_tp(local_params, local_batch):
  inputs, targets = local_batch
  predictions = predict_fsdp_tp(local_params, inputs)
  sq_err = jax.lax.psum(jnp.sum((predictions - targets) ** 2, axis=-1), 'feats')
  return jax.lax.pmean(jnp.mean(sq_err), 'batch')


def networks(layer_sizes=(784, 128, 128, 128, 128, 128, 8), batch_size=32):
  """Each strategy's (reference loss, its loss, reference grads, its grads) by name, and the
  host data they start from: ({name: (...)}, (params, batch))."""
  params, batch = init(jax.random.key(0), list(layer_sizes), batch_size)
  start = params, batch
  out = {}

  # 8-way batch data parallelism
  mesh = jax.make_mesh((8,), ('batch',))
  with jax.set_mesh(mesh):
    # replicate initial params on all devices, shard data batch over devices
    batch = jax.device_put(batch, NamedSharding(mesh, P('batch')))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    out["dp"] = (jax.jit(loss)(params, batch), jax.jit(loss_dp)(params, batch),
                 jax.jit(jax.grad(loss))(params, batch), jax.jit(jax.grad(loss_dp))(params, batch))

  # 8-way fully sharded data parallelism (the notebook's mesh has 4 devices)
  mesh = jax.make_mesh((4,), ('batch',))
  with jax.set_mesh(mesh):
    # shard data batch *and params* over devices
    batch = jax.device_put(batch, P('batch'))
    params = jax.device_put(params, P('batch'))
    repl_params = jax.device_put(params, P())
    repl_batch = jax.device_put(batch, P())
    out["fsdp"] = (jax.jit(loss)(repl_params, repl_batch), jax.jit(loss_fsdp)(params, batch),
                   jax.jit(jax.grad(loss))(repl_params, repl_batch), jax.jit(jax.grad(loss_fsdp))(params, batch))

  # 8-way tensor parallelism
  mesh = jax.make_mesh((8,), ('feats',))
  with jax.set_mesh(mesh):
    batch = jax.device_put(batch, NamedSharding(mesh, P(None, 'feats')))
    params = jax.device_put(params, NamedSharding(mesh, P('feats')))
    repl_params = jax.device_put(params, P())
    repl_batch = jax.device_put(batch, P())
    out["tp"] = (jax.jit(loss)(repl_params, repl_batch), jax.jit(loss_tp)(params, batch),
                 jax.jit(jax.grad(loss))(repl_params, repl_batch), jax.jit(jax.grad(loss_tp))(params, batch))

  # FSDP + TP, with shard_map at the top level
  mesh = jax.make_mesh((4, 2), ('batch', 'feats'))
  with jax.set_mesh(mesh):
    batch = jax.device_put(batch, NamedSharding(mesh, P('batch', 'feats')))
    params = jax.device_put(params, NamedSharding(mesh, P(('feats', 'batch'))))
    repl_params = jax.device_put(params, P())
    repl_batch = jax.device_put(batch, P())
    out["fsdp_tp"] = (jax.jit(loss)(repl_params, repl_batch), jax.jit(loss_fsdp_tp)(params, batch),
                      jax.jit(jax.grad(loss))(repl_params, repl_batch),
                      jax.jit(jax.grad(loss_fsdp_tp))(params, batch))
  return out, start


def main():
  for name, (out, lhs, rhs) in matmuls().items():
    print(name, jnp.allclose(out, lhs @ rhs, atol=1e-3, rtol=1e-3))
  for name, (ref, got, ref_grads, grads) in networks()[0].items():
    print(name, ref, got, allclose(ref_grads, grads))


if __name__ == "__main__":
  jax.config.update("jax_num_cpu_devices", 8)
  main()

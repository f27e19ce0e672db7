"""Tessera from Python: JAX's sharding API (jax.jit, jax.device_put, jax.sharding,
jax.numpy, jax.lax, jax.shard_map, jax.grad) over Tessera's C++ SDK, on a cluster of device
servers (tessera_coordinator / TESSERA_COORDINATOR) or on workers started in this process
(jax_num_cpu_devices). A JAX program runs with its imports changed:

    import tessera as jax
    import tessera.numpy as jnp
    from tessera.sharding import NamedSharding, PartitionSpec as P

    jax.config.update("jax_num_cpu_devices", 8)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data", None)))
    y = jax.jit(lambda x: jnp.tanh(x @ x.T))(x)
"""
from . import _tessera  # noqa: F401
from . import dtypes, errors, tree_util
from ._config import config
from ._array import Array, Shard
from .sharding import Device, devices, NamedSharding, PartitionSpec, set_mesh  # noqa: F401 (jax.NamedSharding)
from ._api import (checkpoint, remat, jit, grad, value_and_grad, shard_map, vmap, make_jaxpr, device_put, device_get,  # noqa: F401
                   block_until_ready, make_mesh, reshard, typeof)
from . import numpy, lax, nn, random, optax, debug, sharding, profiler, checkpoint_policies  # noqa: F401


def local_devices():
    return devices()


def device_count():
    return len(devices())


local_device_count = device_count


def process_index():
    return 0


def process_count():
    return 1


def default_backend():
    return "cpu"


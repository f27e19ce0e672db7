# The seed program of issue #20 as JAX runs it, with only the imports changed (the JAX
# original: `import jax`, `import jax.numpy as jnp`, `from jax.sharding import ...`).
# Prints (16, 4), P('data', 'model') and 8 (4, 2), as JAX does.
import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P

jax.config.update("jax_num_cpu_devices", 8)

mesh = jax.make_mesh((4, 2), ("data", "model"))
x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data", None)))
w = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "model")))
y = jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w)
print(y.shape)
print(y.sharding.spec)
print(len(y.addressable_shards), y.addressable_shards[0].data.shape)

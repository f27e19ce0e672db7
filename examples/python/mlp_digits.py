# The digits MLP of example_mlp_train in Python, as a JAX user writes it: numpy data, a (4, 2)
# mesh with the batch over 'data' and the hidden layer over 'model', one jitted step
# (value_and_grad and the SGD update, parameters donated).
#
#   PYTHONPATH=build/python python3 examples/python/mlp_digits.py .cache/digits.csv
#
# Prints "epoch N loss L" per epoch and "test accuracy: A" on a held-out 20%.
import sys
from functools import partial

import numpy as np

import tessera as jax
import tessera.numpy as jnp
from tessera.sharding import AxisType, NamedSharding, PartitionSpec as P


def load_digits(path):
    data = np.loadtxt(path, delimiter=",", dtype=np.float32)
    return data[:, :64] / 16.0, data[:, 64].astype(np.int32)


def init_params(rng, hidden=64):
    def uniform(fan_in, shape):
        bound = 1.0 / np.sqrt(fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)
    return [uniform(64, (64, hidden)), uniform(64, (hidden,)), uniform(hidden, (hidden, 10)), uniform(hidden, (10,))]


def loss(params, x, y):
    w1, b1, w2, b2 = params
    logits = jnp.tanh(x @ w1 + b1) @ w2 + b2
    return -jnp.mean(jnp.sum(y * jax.nn.log_softmax(logits), axis=1))


@partial(jax.jit, static_argnums=3, donate_argnums=0)
def step(params, x, y, lr):
    l, grads = jax.value_and_grad(loss)(params, x, y)
    return l, [p - lr * g for p, g in zip(params, grads)]


@jax.jit
def predict(params, x):
    w1, b1, w2, b2 = params
    return jnp.argmax(jnp.tanh(x @ w1 + b1) @ w2 + b2, axis=1)


def train(path, epochs=40, batch=64, lr=0.5, seed=2026, log=print):
    """Trains and returns (the first epoch's per-step losses, test accuracy, the data and
    initial parameters for a reference)."""
    x, labels = load_digits(path)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(x))
    n_test = len(x) // 5
    test, train_idx = order[:n_test], order[n_test:]
    params0 = init_params(rng)

    # Auto axes: the compiler propagates the layouts (GSPMD); on make_mesh's default Explicit
    # axes the second matmul, contracting the 'model'-split hidden layer, needs an out_sharding.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shardings = [NamedSharding(mesh, s) for s in (P(None, "model"), P("model"), P("model", None), P())]
    params = [jax.device_put(p, s) for p, s in zip(params0, shardings)]
    batch_sharding = NamedSharding(mesh, P("data", None))
    onehot = np.eye(10, dtype=np.float32)[labels]
    first_epoch, batches = [], []
    for epoch in range(1, epochs + 1):
        perm = rng.permutation(train_idx)
        losses = []
        for s in range(len(perm) // batch):
            idx = perm[s * batch:(s + 1) * batch]
            if epoch == 1:
                batches.append(idx)
            xb = jax.device_put(x[idx], batch_sharding)
            yb = jax.device_put(onehot[idx], batch_sharding)
            l, params = step(params, xb, yb, lr)
            losses.append(l)
        losses = [float(l) for l in losses]
        if epoch == 1:
            first_epoch = losses
        log(f"epoch {epoch} loss {np.mean(losses):.6f}")
    pred = np.asarray(predict(params, jax.device_put(x[test], NamedSharding(mesh, P()))))
    accuracy = float(np.mean(pred == labels[test]))
    log(f"test accuracy: {accuracy:.4f}")
    return first_epoch, accuracy, (x, onehot, params0, batches)


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)
    train(sys.argv[1] if len(sys.argv) > 1 else ".cache/digits.csv")

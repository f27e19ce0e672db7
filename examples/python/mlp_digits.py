# The digits MLP of example_mlp_train in Python, as a JAX user writes it: numpy data, a (4, 2)
# mesh with the batch over 'data' and the hidden layer over 'model', one jitted step
# (value_and_grad and the SGD update, parameters donated). It makes example_mlp_train's random
# draws (Mt19937Draws), so it holds out the same examples, visits them in the same order and
# starts from the same parameters: its losses are the C++ example's.
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


class Mt19937Draws:
    """The random draws example_mlp_train makes, so that this port starts from its split,
    order and parameters: std::mt19937 (numpy's legacy MT19937 seeding is the standard's
    init_genrand), and libstdc++'s std::shuffle and uniform_real_distribution<float> over it
    (GCC 12: /usr/include/c++/12/bits/stl_algo.h, uniform_int_dist.h, random.tcc)."""

    def __init__(self, seed):
        self._bits = np.random.RandomState(seed)._bit_generator

    def _below(self, n):
        """uniform_int_distribution over [0, n) from 32-bit draws: Lemire's method."""
        product = int(self._bits.random_raw()) * n
        if product & 0xFFFFFFFF < n:
            threshold = (2**32 - n) % n
            while product & 0xFFFFFFFF < threshold:
                product = int(self._bits.random_raw()) * n
        return product >> 32

    def shuffle(self, a):
        """std::shuffle in place: two swap positions from one draw while n * n fits 32 bits."""
        n = len(a)
        if n > 1 and (2**32 - 1) // n >= n:
            i = 1
            if n % 2 == 0:
                j = self._below(2)
                a[i], a[j] = a[j], a[i]
                i += 1
            while i != n:
                r = i + 1
                x = self._below(r * (r + 1))
                for j in (x // (r + 1), x % (r + 1)):
                    a[i], a[j] = a[j], a[i]
                    i += 1
        else:
            for i in range(1, n):
                j = self._below(i + 1)
                a[i], a[j] = a[j], a[i]

    def uniform(self, bound, shape):
        """uniform_real_distribution<float>(-bound, bound): one draw / 2^32 in float (below 1),
        then u * (b - a) + a, each step rounded to float."""
        n = int(np.prod(shape))
        u = self._bits.random_raw(n).astype(np.float64).astype(np.float32) / np.float32(2**32)
        u = np.minimum(u, np.nextafter(np.float32(1), np.float32(0)))
        a, b = np.float32(-bound), np.float32(bound)
        return (u * (b - a) + a).astype(np.float32).reshape(shape)


def init_params(draws, hidden=64):
    """example_mlp_train's: weights uniform in +-1/sqrt(fan_in) (float), biases zero."""
    def uniform(fan_in, shape):
        return draws.uniform(np.float32(1) / np.sqrt(np.float32(fan_in)), shape)
    w1 = uniform(64, (64, hidden))
    w2 = uniform(hidden, (hidden, 10))
    return [w1, np.zeros(hidden, np.float32), w2, np.zeros(10, np.float32)]


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
    draws = Mt19937Draws(seed)
    order = list(range(len(x)))
    draws.shuffle(order)
    n_test = len(order) // 5 // 8 * 8  # held out, a multiple of 8 as example_mlp_train's
    test, train_idx = order[:n_test], order[n_test:]
    params0 = init_params(draws)

    # Auto axes: the compiler propagates the layouts (GSPMD); on make_mesh's default Explicit
    # axes the second matmul, contracting the 'model'-split hidden layer, needs an out_sharding.
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shardings = [NamedSharding(mesh, s) for s in (P(None, "model"), P("model"), P("model", None), P())]
    params = [jax.device_put(p, s) for p, s in zip(params0, shardings)]
    batch_sharding = NamedSharding(mesh, P("data", None))
    onehot = np.eye(10, dtype=np.float32)[labels]
    first_epoch, batches = [], []
    for epoch in range(1, epochs + 1):
        draws.shuffle(train_idx)
        losses = []
        for s in range(len(train_idx) // batch):
            idx = np.array(train_idx[s * batch:(s + 1) * batch])
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

# The relu MLP of JAX's neural-network tutorials (the distributed-arrays and shard_map
# notebooks: `outputs = inputs @ W + b`, relu between layers, loss the batch mean of the summed
# squared error) in float64 numpy, forward and backward by hand: the reference the tests of
# examples/python/mlp_tutorial.py and shard_map_tutorial.py compare with.
import numpy as np


def loss_and_grads(params, batch):
    """The loss and [(dW, db), ...] for params [(W, b), ...] and batch (inputs, targets)."""
    params = [(np.asarray(W, np.float64), np.asarray(b, np.float64)) for W, b in params]
    x, t = (np.asarray(a, np.float64) for a in batch)
    acts, zs, a = [x], [], x
    for W, b in params:
        z = a @ W + b
        zs.append(z)
        a = np.maximum(z, 0)
        acts.append(a)
    loss = np.mean(np.sum((zs[-1] - t) ** 2, axis=-1))
    dz = 2 * (zs[-1] - t) / x.shape[0]
    grads = []
    for k in reversed(range(len(params))):
        grads.append((acts[k].T @ dz, dz.sum(0)))
        dz = (dz @ params[k][0].T) * (zs[k - 1] > 0) if k else None
    return loss, grads[::-1]


def sgd_loss(params, batch, step_size, steps):
    """The loss after `steps` SGD steps from params (float64)."""
    params = [(np.asarray(W, np.float64), np.asarray(b, np.float64)) for W, b in params]
    for _ in range(steps):
        _, grads = loss_and_grads(params, batch)
        params = [(W - step_size * dW, b - step_size * db) for (W, b), (dW, db) in zip(params, grads)]
    return loss_and_grads(params, batch)[0]

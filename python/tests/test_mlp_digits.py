# examples/python/mlp_digits.py (the digits MLP of example_mlp_train from Python with numpy
# data): its first epoch's losses equal a numpy training of the same steps (forward and
# backward written out, float64), and it reaches example_mlp_train's accuracy goal (0.95).
import os
import sys

import numpy as np
import pytest

from conftest import SOURCE_DIR

sys.path.insert(0, os.path.join(SOURCE_DIR, "examples", "python"))
import mlp_digits  # noqa: E402

DATA = os.path.join(SOURCE_DIR, ".cache", "digits.csv")


def host_losses(x, onehot, params, batches, lr):
    w1, b1, w2, b2 = (p.astype(np.float64) for p in params)
    out = []
    for idx in batches:
        xb, yb = x[idx].astype(np.float64), onehot[idx]
        h = np.tanh(xb @ w1 + b1)
        z = h @ w2 + b2
        z = z - z.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        out.append(-np.mean(np.sum(yb * logp, axis=1)))
        dz = (np.exp(logp) - yb) / len(idx)
        dh = (dz @ w2.T) * (1 - h ** 2)
        w2, b2 = w2 - lr * h.T @ dz, b2 - lr * dz.sum(0)
        w1, b1 = w1 - lr * xb.T @ dh, b1 - lr * dh.sum(0)
    return out


@pytest.mark.skipif(not os.path.exists(DATA), reason="no .cache/digits.csv (./dev test fetches it)")
def test_digits_mlp_matches_numpy_and_learns():
    first, accuracy, (x, onehot, params0, batches) = mlp_digits.train(DATA, epochs=25, log=lambda s: None)
    want = host_losses(x, onehot, params0, batches, 0.5)
    np.testing.assert_allclose(first, want, rtol=2e-4)
    assert accuracy >= 0.95

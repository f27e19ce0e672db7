# examples/python/mlp_digits.py (the digits MLP of example_mlp_train from Python with numpy
# data): its first epoch's losses equal a numpy training of the same steps (forward and
# backward written out, float64), it reaches example_mlp_train's accuracy goal (0.95), and its
# per-epoch losses are the ones example_mlp_train prints (the same split, order and initial
# parameters from the same std::mt19937 draws).
import os
import re
import subprocess
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


def test_mt19937_is_the_standard_engine():
    # [rand.predef] of the C++ standard: the 10000th draw of a default-constructed
    # std::mt19937 (seed 5489) is 4123659995.
    draws = mlp_digits.Mt19937Draws(5489)
    assert int(draws._bits.random_raw(10000)[-1]) == 4123659995
    # shuffle is a permutation; uniform stays inside its bounds.
    a = list(range(1001))
    draws.shuffle(a)
    assert sorted(a) == list(range(1001)) and a != list(range(1001))
    u = draws.uniform(np.float32(0.125), (64, 64))
    assert u.dtype == np.float32 and u.min() >= -0.125 and u.max() < 0.125


@pytest.mark.skipif(not os.path.exists(DATA), reason="no .cache/digits.csv (./dev test fetches it)")
def test_digits_mlp_losses_are_the_cpp_examples():
    example = os.path.join(os.environ.get("TESSERA_BINARY_DIR", os.path.join(SOURCE_DIR, "build")), "bin",
                           "example_mlp_train")
    run = subprocess.run([example, f"--data={DATA}", "--epochs=3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    cpp = [float(v) for v in re.findall(r"^epoch \d+ loss (\S+)$", run.stdout, re.M)]
    lines = []
    mlp_digits.train(DATA, epochs=3, log=lines.append)
    py = [float(l.split()[-1]) for l in lines if l.startswith("epoch")]
    assert len(cpp) == len(py) == 3
    # Printed with 6 decimals; the two programs trace the same model apart (float32 sums in
    # other orders can differ in their last bits).
    np.testing.assert_allclose(py, cpp, rtol=1e-5, atol=2e-6)

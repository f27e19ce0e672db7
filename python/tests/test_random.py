# tessera.random (issue #20, the random numbers of issue #15 item 4): jax.random's names and
# defaults over the SDK's threefry2x32. Expected values are the ones JAX documents or its tests
# assert, each cited; samplers built on transcendental functions are checked against their
# formula with Python's math.erf.
import math

import numpy as np
import pytest

import tessera
from tessera import random
from tessera.sharding import NamedSharding, PartitionSpec as P


def test_keys_split_fold_in_and_uniform_match_jax():
    # jax tests/random_test.py test_prng_seeds_and_keys: PRNGKey(0) is [0, 0]; np.int32(-2)
    # gives [0, 4294967294].
    k0 = random.PRNGKey(0)
    assert k0.dtype == np.uint32 and k0.shape == (2,)
    assert np.asarray(k0).tolist() == [0, 0]
    assert np.asarray(random.PRNGKey(np.int32(-2))).tolist() == [0, 4294967294]
    # random_test.py testPRNGValues: key_data(fold_in(PRNGKey(0), 4)) == [2285895361, 433833334].
    assert np.asarray(random.key_data(random.fold_in(k0, 4))).tolist() == [2285895361, 433833334]
    # docs/jep/9263-typed-keys.md: uniform(key(0), shape=(3,)) is [0.947667, 0.9785799, 0.33229148];
    # jax/random.py's module docstring: after `key, subkey = split(key)`, uniform(subkey) is 0.00729382.
    u = np.asarray(random.uniform(random.key(0), shape=(3,)))
    assert u.dtype == np.float32
    # (Compared as JAX prints them: numpy's array2string of each float32.)
    assert [np.array2string(np.float32(v)) for v in u] == ["0.947667", "0.9785799", "0.33229148"]
    _, sub = random.split(random.key(0))
    assert np.array2string(np.asarray(random.uniform(sub))) == "0.00729382"
    # test_threefry_split_fold_in_symmetry: fold_in(key(72), i) == split(key(72), 3)[i].
    keys = np.asarray(random.split(random.key(72), 3))
    assert keys.shape == (3, 2)
    for i in range(3):
        assert np.asarray(random.fold_in(random.key(72), i)).tolist() == keys[i].tolist()
    assert np.asarray(random.split(random.key(72), (3, 1))).shape == (3, 1, 2)


def test_inside_jit_a_sharded_sample_equals_the_unsharded_one(mesh):
    # (The key goes onto the mesh first: Tessera does not move uncommitted arrays yet, #16 item 4.)
    key = tessera.device_put(random.PRNGKey(1701), NamedSharding(mesh, P()))
    whole = np.asarray(random.normal(key, (16, 8)))
    f = tessera.jit(lambda k: random.normal(k, (16, 8)), out_shardings=NamedSharding(mesh, P("data", "model")))
    split = f(key)
    assert split.sharding.spec == P("data", "model")
    assert np.asarray(split).tobytes() == whole.tobytes()
    # uniform with minval/maxval, and float64 under jax_enable_x64's dtype name.
    u = np.asarray(tessera.jit(lambda k: random.uniform(k, (64,), minval=-2.0, maxval=3.0))(key))
    assert u.min() >= -2.0 and u.max() < 3.0


def test_samplers_follow_their_formulas():
    key = random.PRNGKey(3)
    n = np.asarray(random.normal(key, (256,))).astype(np.float64)
    # jax.random.normal is sqrt(2) * erfinv(u) with u uniform in (nextafter(-1, 0), 1): invert it.
    u = np.asarray(random.uniform(key, (256,), minval=float(np.nextafter(np.float32(-1), np.float32(0))), maxval=1.0))
    assert np.allclose([math.erf(v / math.sqrt(2)) for v in n], u, atol=2e-6)
    t = np.asarray(random.truncated_normal(key, -1.0, 2.0, (256,)))
    assert t.min() > -1.0 and t.max() < 2.0
    b = np.asarray(random.bernoulli(key, 0.3, (512,)))
    assert b.dtype == np.bool_
    assert b.tolist() == (np.asarray(random.uniform(key, (512,))) < np.float32(0.3)).tolist()
    assert np.asarray(random.bernoulli(key)).shape == ()
    logits = np.log(np.array([[0.1, 0.2, 0.7]] * 2000, np.float32))
    c = np.asarray(random.categorical(key, logits))
    assert c.dtype == np.int32 and c.shape == (2000,)
    freq = np.bincount(c, minlength=3) / 2000
    assert np.allclose(freq, [0.1, 0.2, 0.7], atol=0.04), freq


def test_errors_name_the_argument():
    key = random.PRNGKey(0)
    with pytest.raises(TypeError, match="minval must be a Python number"):
        random.uniform(key, (2,), minval=np.zeros(2))
    with pytest.raises(ValueError, match="dtype int8 is not supported"):
        random.bits(key, (2,), dtype="int8")
    with pytest.raises(ValueError, match="non-negative ints"):
        random.normal(key, (2, -1))
    with pytest.raises(NotImplementedError, match="shape= is not supported"):
        random.categorical(key, np.zeros((2, 3), np.float32), shape=(4,))

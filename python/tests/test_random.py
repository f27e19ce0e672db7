# tessera.random (issue #20, the random numbers of issue #15 item 4): jax.random's names and
# defaults over the SDK's threefry2x32. Expected values are the ones JAX documents or its tests
# assert, each cited; samplers built on transcendental functions are checked against their
# formula with Python's math.erf. randint, permutation and choice are JAX's algorithms: a numpy
# transcription of them (below) reproduces the values JAX's tests assert for its original bit
# layout, and Tessera's results equal it on Tessera's (partitionable) bits.
import math
import re

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
    # test_threefry_split_fold_in_symmetry: fold_in(key(72), i) == split(key(72), 3)[i] (raw
    # keys here; test_typed_keys_are_their_raw_keys_bit_for_bit checks the typed ones).
    keys = np.asarray(random.split(random.PRNGKey(72), 3))
    assert keys.shape == (3, 2)
    for i in range(3):
        assert np.asarray(random.fold_in(random.PRNGKey(72), i)).tolist() == keys[i].tolist()
    assert np.asarray(random.split(random.PRNGKey(72), (3, 1))).shape == (3, 1, 2)


def test_inside_jit_a_sharded_sample_equals_the_unsharded_one(mesh):
    # (The key goes onto the mesh explicitly; an uncommitted key would be moved there too.)
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


# ---- randint, permutation, choice ------------------------------------------------------------
# A numpy transcription of JAX's threefry and _randint (jax/_src/random/threefry2x32.py,
# jax/_src/random/core.py), independent of Tessera's ops.

_M = 0xFFFFFFFF


def _threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32, 20 rounds (threefry2x32.py _threefry2x32_lowering), in numpy uint32."""
    k0, k1 = np.uint32(k0), np.uint32(k1)
    x0, x1 = np.asarray(x0, np.uint32).copy(), np.asarray(x1, np.uint32).copy()
    ks = [k0, k1, np.uint32(k0 ^ k1 ^ np.uint32(0x1BD11BDA))]
    with np.errstate(over="ignore"):
        x0, x1 = x0 + ks[0], x1 + ks[1]
        for i in range(5):
            for r in [(13, 15, 26, 6), (17, 29, 16, 24)][i % 2]:
                x0 = x0 + x1
                x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
            x0 = x0 + ks[(i + 1) % 3]
            x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _threefry_2x32_flat(key, count):
    """threefry2x32.py threefry_2x32(keypair, count): the counts' two halves hashed as pairs."""
    count = np.asarray(count, np.uint32).ravel()
    odd = count.size % 2
    a, b = np.split(np.concatenate([count, np.uint32([0])]) if odd else count, 2)
    out = np.concatenate(_threefry2x32(key[0], key[1], a, b))
    return out[:-1] if odd else out


def _randint_from_bits(higher_bits, lower_bits, minval, maxval):
    """core.py _randint for an int32 result and in-range bounds, on the two words of bits."""
    span = np.uint64((int(maxval) - int(minval)) & _M if maxval > minval else 1)
    hb, lb = higher_bits.astype(np.uint64), lower_bits.astype(np.uint64)
    # Every product wraps in uint32, as lax.mul does: for spans above 2**16 the multiplier's
    # square wraps to 0 and only the lower word counts.
    multiplier = (np.uint64(2 ** 16) % span) ** 2 % np.uint64(2 ** 32) % span
    offset = ((hb % span) * multiplier % np.uint64(2 ** 32) + lb % span) % np.uint64(2 ** 32) % span
    return (np.int64(minval) + offset.astype(np.int64)).astype(np.int32)


def _ref_randint(key, shape, minval, maxval):
    """_randint on Tessera's split and bits (which the tests above check against JAX's values)."""
    k1, k2 = np.asarray(random.split(key))
    return _randint_from_bits(np.asarray(random.bits(k1, shape)), np.asarray(random.bits(k2, shape)), minval, maxval)


def _ref_shuffle(key, x, axis=0):
    """core.py _shuffle: rounds of a stable sort by fresh uint32 keys."""
    rounds = int(np.ceil(3 * np.log(max(1, x.size)) / np.log(_M)))
    for _ in range(rounds):
        key, sub = np.asarray(random.split(key))
        order = np.argsort(np.asarray(random.bits(sub, x.shape)), axis=axis, kind="stable")
        x = np.take_along_axis(x, order, axis=axis)
    return x


def test_the_randint_transcription_reproduces_jax_asserted_values():
    # tests/random_test.py testThreefry2x32 (Random123's known answers).
    assert [hex(v) for v in np.concatenate(_threefry2x32(0, 0, [0], [0]))] == ["0x6b200159", "0x99ba4efe"]
    assert [hex(v) for v in np.concatenate(_threefry2x32(_M, _M, [_M], [_M]))] == ["0x1cb996fc", "0xbb002be7"]
    # With JAX's original (non-partitionable) layout: split is the hash of iota(2 * num) and
    # 32-bit bits of iota(size) (threefry2x32.py _threefry_split_original,
    # _threefry_random_bits_original); random_test.py testPRNGValues asserts split(key(0), 4)...
    def split0(key, num=2):
        return _threefry_2x32_flat(key, np.arange(2 * num)).reshape(num, 2)

    def randint0(key, shape, lo, hi):
        k1, k2 = split0(key)
        b = [_threefry_2x32_flat(k, np.arange(math.prod(shape))).reshape(shape) for k in (k1, k2)]
        return _randint_from_bits(b[0], b[1], lo, hi)

    key0 = np.uint32([0, 0])
    assert split0(key0, 4).tolist() == [[2285895361, 1501764800], [1518642379, 4090693311],
                                        [433833334, 4221794875], [839183663, 3740430601]]
    # ... and randint(key(0), (3, 3), 0, 8) (testPRNGValues) and randint with seed
    # adler32("randint" + "threefry2x32") (_RANDOM_VALUES_CASES, testRandomDistributionValues).
    assert randint0(key0, (3, 3), 0, 8).tolist() == [[2, 1, 3], [6, 1, 5], [6, 3, 4]]
    assert randint0(np.uint32([0, 1319372649]), (5,), 0, 10).tolist() == [0, 5, 7, 7, 5]


def test_randint_is_jax_algorithm_on_tessera_bits(mesh):
    key = random.PRNGKey(0)
    r = random.randint(key, (3, 3), 0, 8)
    assert r.dtype == np.int32 and r.shape == (3, 3)
    assert np.asarray(r).tolist() == _ref_randint(key, (3, 3), 0, 8).tolist()
    k = random.PRNGKey(1701)
    for lo, hi in [(0, 10), (-5, 5), (-2**31, 2**31 - 1), (7, 7), (9, 3)]:
        got = np.asarray(random.randint(k, (257,), lo, hi))
        assert got.tolist() == _ref_randint(k, (257,), lo, hi).tolist(), (lo, hi)
    # random_lax_test.py testIssue222: maxval <= minval gives minval.
    assert int(random.randint(random.PRNGKey(10003), (), 0, 0)) == 0
    # Inside jit, and sharded: the same values.
    kd = tessera.device_put(k, NamedSharding(mesh, P()))
    f = tessera.jit(lambda k: random.randint(k, (16, 8), -3, 100), out_shardings=NamedSharding(mesh, P("data", "model")))
    out = f(kd)
    assert out.sharding.spec == P("data", "model")
    assert np.asarray(out).tolist() == _ref_randint(k, (16, 8), -3, 100).tolist()


def test_randint_bounds_broadcasting_and_narrow_dtypes():
    key = random.PRNGKey(0)
    # random_lax_test.py testRandomBroadcast: array bounds broadcast to the shape.
    x2 = np.asarray(random.randint(key, (10, 2), np.array([0, 1]), np.array([1, 2])))
    assert x2.shape == (10, 2) and x2[:, 0].tolist() == [0] * 10 and x2[:, 1].tolist() == [1] * 10
    lo, hi = np.array([[0], [100]], np.int32), np.array([10, 1000, 20], np.int32)
    got = np.asarray(random.randint(key, (2, 3), lo, hi))
    k1, k2 = np.asarray(random.split(key))
    b1, b2 = np.asarray(random.bits(k1, (2, 3))), np.asarray(random.bits(k2, (2, 3)))
    want = [[int(_randint_from_bits(b1[i, j], b2[i, j], lo[i, 0], hi[j])) for j in range(3)] for i in range(2)]
    assert got.tolist() == want
    with pytest.raises(ValueError, match="broadcast-compatible"):
        random.randint(key, (3,), np.zeros(4, np.int32), 5)
    # random_lax_test.py test_randint_bounds: narrow dtypes clip their bounds; int32's raise.
    k = random.PRNGKey(1701)
    for dtype in (np.int8, np.uint8, np.int16):
        info = np.iinfo(dtype)
        a = np.asarray(random.randint(k, (10,), int(info.min), int(info.max) + 1, dtype))
        b = np.asarray(random.randint(k, (10,), int(info.min) - 12345, int(info.max) + 12345, dtype))
        assert a.dtype == dtype and a.tolist() == b.tolist()
        # Sampled in int32 and converted (core.py randint).
        assert a.tolist() == _ref_randint(k, (10,), int(info.min), int(info.max) + 1).astype(dtype).tolist()
    with pytest.raises(OverflowError, match="too large"):
        random.randint(k, (10,), -2**31 - 12345, 2**31 + 12345, np.int32)
    # test_randint_out_of_range.
    assert np.asarray(random.randint(key, (10,), 255, 256, np.uint8)).tolist() == [255] * 10
    r = np.asarray(random.randint(key, (1000,), -128, 128, np.int8))
    assert (r == -128).sum() > 0 and (r == 127).sum() > 0
    r = np.asarray(random.randint(key, (1000,), -1000, 1000, np.uint8))
    assert (r == 0).sum() > 0 and (r == 255).sum() > 0
    with pytest.raises(TypeError, match="integer dtypes"):
        random.randint(key, (2,), 0, 3, np.float32)


def test_permutation_is_jax_shuffle_on_tessera_bits():
    key = random.PRNGKey(0)
    p = np.asarray(random.permutation(key, 10))
    assert p.dtype == np.int32
    assert p.tolist() == _ref_shuffle(key, np.arange(10, dtype=np.int32)).tolist()
    assert sorted(p.tolist()) == list(range(10)) and p.tolist() != list(range(10))
    # More than 1625 elements take two rounds (ceil(3 ln n / ln(2**32 - 1)) == 2).
    big = np.asarray(random.permutation(key, 2000))
    assert big.tolist() == _ref_shuffle(key, np.arange(2000, dtype=np.int32)).tolist()
    assert sorted(big.tolist()) == list(range(2000))
    # An array: shuffled along axis by one permutation of the indices (core.py _permutation).
    x = np.arange(50, dtype=np.float32).reshape(10, 5)
    got = np.asarray(random.permutation(key, x))
    assert got.tolist() == x[_ref_shuffle(key, np.arange(10, dtype=np.int32))].tolist()
    got1 = np.asarray(random.permutation(key, x, axis=1))
    assert got1.tolist() == x[:, _ref_shuffle(key, np.arange(5, dtype=np.int32))].tolist()
    v = np.arange(7.0, dtype=np.float32) * 3
    assert np.asarray(random.permutation(key, v, independent=True)).tolist() == _ref_shuffle(key, v).tolist()
    # Inside jit, the same values.
    assert np.asarray(tessera.jit(lambda k: random.permutation(k, 10))(key)).tolist() == p.tolist()
    # random_lax_test.py testPermutationErrors.
    with pytest.raises(ValueError):
        random.permutation(key, 10, axis=3)
    with pytest.raises(TypeError):
        random.permutation(key, 10.)


def test_independent_permutation_shuffles_each_lane():
    # core.py _shuffle sorts every lane along `axis` by its own keys (lax.sort_key_val), so each
    # lane is a permutation of itself, bit for bit the host transcription of JAX's algorithm.
    key = random.PRNGKey(5)
    x = np.arange(60, dtype=np.float32).reshape(6, 10)
    for axis in (0, 1, -1):
        got = np.asarray(random.permutation(key, x, axis=axis, independent=True))
        assert got.tolist() == _ref_shuffle(key, x, axis).tolist()
        assert (np.sort(got, axis=axis) == x).all()
    # random_lax_test.py testPermutation: with more than 4 lanes of more than 4 elements the lanes
    # are not all shuffled alike (independent), unlike independent=False.
    got = np.asarray(random.permutation(key, x, axis=1, independent=True))
    order = np.argsort(got, axis=1)
    assert not (order == order[0]).all()
    same = np.asarray(random.permutation(key, x, axis=1))
    assert (np.argsort(same, axis=1) == np.argsort(same, axis=1)[0]).all()
    # A 3-D int array under jit (6000 elements: two rounds of keys).
    y = np.arange(2 * 3 * 1000, dtype=np.int32).reshape(2, 3, 1000)
    got = np.asarray(tessera.jit(lambda k, y: random.permutation(k, y, axis=2, independent=True))(key, y))
    assert got.tolist() == _ref_shuffle(key, y, 2).tolist()


def test_choice_is_jax_algorithm():
    key = random.PRNGKey(3)
    # With replacement: randint indices (core.py choice).
    c = np.asarray(random.choice(key, 100, (4, 5)))
    assert c.shape == (4, 5) and c.dtype == np.int32
    assert c.tolist() == _ref_randint(key, (4, 5), 0, 100).tolist()
    x = np.arange(100, dtype=np.float32).reshape(10, 5, 2) * 2
    got = np.asarray(random.choice(key, x, (3,), axis=1))
    assert got.shape == (10, 3, 2) and got.dtype == np.float32
    assert got.tolist() == np.take(x, _ref_randint(key, (3,), 0, 5), axis=1).tolist()
    # Without: the first entries of a permutation, no index twice.
    c = np.asarray(random.choice(key, 100, (4, 5), replace=False))
    assert c.tolist() == _ref_shuffle(key, np.arange(100, dtype=np.int32))[:20].reshape(4, 5).tolist()
    assert len(set(c.ravel().tolist())) == 20
    got = np.asarray(random.choice(key, x, (2, 2), replace=False, axis=0))
    assert got.shape == (2, 2, 5, 2)
    assert got.tolist() == x[_ref_shuffle(key, np.arange(10, dtype=np.int32))[:4]].reshape(2, 2, 5, 2).tolist()
    assert np.asarray(random.choice(key, 5)).shape == ()
    assert np.asarray(tessera.jit(lambda k: random.choice(k, 100, (4, 5), replace=False))(key)).tolist() == c.tolist()
    # random_lax_test.py testChoiceShapeIsNotSequenceError, and numpy's sample-size rule.
    with pytest.raises(TypeError):
        random.choice(key, 5, 2, replace=False)
    with pytest.raises(ValueError, match="larger sample"):
        random.choice(key, 5, (6,), replace=False)


def test_choice_with_p_is_jax_algorithm():
    key = random.PRNGKey(5)
    p = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    # With replacement (core.py choice): r = cumsum(p)[-1] * (1 - uniform(key, shape)), the
    # index searchsorted(cumsum(p), r) (side 'left': the count of cumsum entries below r).
    c = np.asarray(random.choice(key, 4, (2000,), p=p))
    cum = np.cumsum(p, dtype=np.float32)
    r = cum[-1] * (np.float32(1) - np.asarray(random.uniform(key, (2000,))))
    assert c.dtype == np.int32 and c.tolist() == np.searchsorted(cum, r, side="left").tolist()
    assert np.allclose(np.bincount(c, minlength=4) / 2000, p, atol=0.04)
    # Without: the Gumbel top-k trick, -log(-log(uniform(minval=tiny))) + log(p).
    x = np.arange(40, dtype=np.float32).reshape(4, 10)
    got = np.asarray(random.choice(key, x, (3,), replace=False, p=p))
    u = np.asarray(random.uniform(key, (4,), minval=float(np.finfo(np.float32).tiny), maxval=1.0))
    g = -np.log(-np.log(u)) + np.log(p)
    assert got.tolist() == x[np.argsort(-g, kind="stable")[:3]].tolist()
    with pytest.raises(ValueError, match="same size"):
        random.choice(key, 5, (2,), p=p)


# ---- typed keys (jax.random.key: dtype key<fry>, jax/_src/random/prng.py PRNGKeyArray) -------

def _bytes(x):
    return np.asarray(x).tobytes()


def test_typed_keys_are_their_raw_keys_bit_for_bit():
    # jax/_src/random/core.py: every function takes typed and raw keys (_check_prng_key) and
    # split/fold_in return the kind they got (_return_prng_keys); key(seed)'s data is
    # PRNGKey(seed) (random_test.py test_prng_seeds_and_keys, both make_key flavours).
    for seed in (0, 1, 42, np.int32(-2), 2**31 - 1):
        assert np.asarray(random.key_data(random.key(seed))).tolist() == np.asarray(random.PRNGKey(seed)).tolist()
    k, raw = random.key(1701), random.PRNGKey(1701)
    ks = random.split(k, 4)
    assert str(ks.dtype) == "key<fry>" and ks.shape == (4,)
    assert _bytes(random.key_data(ks)) == _bytes(random.split(raw, 4))
    assert random.split(k, (2, 3)).shape == (2, 3)
    assert _bytes(random.key_data(random.split(k, (2, 3)))) == _bytes(random.split(raw, (2, 3)))
    f = random.fold_in(k, 7)
    assert str(f.dtype) == "key<fry>" and f.shape == ()
    assert _bytes(random.key_data(f)) == _bytes(random.fold_in(raw, 7))
    # Raw keys stay raw.
    assert random.split(raw).dtype == np.uint32 and random.fold_in(raw, 1).dtype == np.uint32
    # random_test.py testPRNGValues: key_data(fold_in(key(0), 4)) == [2285895361, 433833334].
    assert np.asarray(random.key_data(random.fold_in(random.key(0), 4))).tolist() == [2285895361, 433833334]
    logits = np.log(np.array([[0.1, 0.2, 0.7], [0.5, 0.25, 0.25]], np.float32))
    samplers = {
        "bits": lambda k: random.bits(k, (3, 5)),
        "uniform": lambda k: random.uniform(k, (4, 3), minval=-1.0, maxval=2.0),
        "normal": lambda k: random.normal(k, (16,)),
        "truncated_normal": lambda k: random.truncated_normal(k, -1.0, 2.0, (8,)),
        "bernoulli": lambda k: random.bernoulli(k, 0.3, (32,)),
        "categorical": lambda k: random.categorical(k, logits),
        "randint": lambda k: random.randint(k, (10,), -5, 17),
        "permutation": lambda k: random.permutation(k, 12),
        "choice": lambda k: random.choice(k, 9, (4,), replace=False),
        "choice_p": lambda k: random.choice(k, 3, (6,), p=np.array([0.2, 0.3, 0.5], np.float32)),
    }
    for name, s in samplers.items():
        typed, plain = s(k), s(raw)
        assert typed.dtype == plain.dtype and typed.shape == plain.shape, name
        assert _bytes(typed) == _bytes(plain), name
    # jax/random.py's docstring (as test_keys_split_fold_in_and_uniform_match_jax): uniform of
    # the second key of split(key(0)) is 0.00729382, the tuple unpacked from a typed key array.
    _, sub = random.split(random.key(0))
    assert np.array2string(np.asarray(random.uniform(sub))) == "0.00729382"


def test_typed_keys_print_index_and_reshape_as_jax():
    # docs/jep/9263-typed-keys.md: key(0) prints "Array((), dtype=key<fry>) overlaying:\n[0 0]",
    # its shape is () and its dtype key<fry>; vmap(key)(arange(4)) is key<fry>[4] over
    # [[0 0] [0 1] [0 2] [0 3]]; key_data(key) is Array([0, 0], dtype=uint32).
    k = random.key(0)
    assert repr(k) == str(k) == "Array((), dtype=key<fry>) overlaying:\n[0 0]"
    assert k.shape == () and repr(k.dtype) == "key<fry>" and k.dtype.name == "key<fry>"
    arr = tessera.vmap(random.key)(np.arange(4, dtype=np.int32))
    assert repr(arr) == "Array((4,), dtype=key<fry>) overlaying:\n[[0 0]\n [0 1]\n [0 2]\n [0 3]]"
    assert repr(random.key_data(k)) == "Array([0, 0], dtype=uint32)"
    # random_test.py test_key_dtype_attributes / test_key_attributes / test_nbytes_property.
    keys = random.split(k, 6).reshape(2, 3)
    assert keys.shape == (2, 3) and keys.ndim == 2 and keys.size == 6 and len(keys) == 2
    assert keys.size * keys.dtype.itemsize == random.key_data(keys).size * np.dtype(np.uint32).itemsize
    assert keys.nbytes == keys.itemsize * keys.size == 48
    # test_key_array_indexing_0d and _nd: shapes of indexed keys, "Too many indices".
    assert k[None].shape == (1,)
    with pytest.raises(IndexError, match="Too many indices"):
        k[0]
    for idx, shape in [((0, 0), ()), ((0,), (3,)), ((1, slice(None)), (3,)), ((slice(None), 1), (2,)),
                       ((None,), (1, 2, 3)), ((None, slice(None), None), (1, 2, 1, 3)),
                       ((None, None, None, 0, None, None, None, 1), (1,) * 6),
                       ((Ellipsis, slice(1, None), None), (2, 2, 1)), ((None, 0, Ellipsis, 1, None), (1, 1))]:
        assert keys[idx].shape == shape, idx
    with pytest.raises(IndexError, match="Too many indices"):
        keys[0, 1, 2]
    with pytest.raises(IndexError, match="Too many indices"):
        keys[0, 1, None, 2]
    # A list as the whole index is jnp's TypeError for key arrays too (prng.py
    # _set_array_base_attributes forwards __getitem__ and `at` to jnp's, which call
    # eliminate_deprecated_list_indexing); an index array is not.
    for index in (lambda ks: ks[[0, 1]], lambda ks: ks.at[[0, 1]].get()):
        with pytest.raises(TypeError, match="Using a non-tuple sequence for multidimensional indexing"):
            index(keys)
    assert keys[np.array([0, 1])].shape == (2, 3)
    # An indexed key is the key at that place (its data the data's row), and so is iteration.
    data = np.asarray(random.key_data(keys))
    assert np.asarray(random.key_data(keys[1, 2])).tolist() == data[1, 2].tolist()
    assert np.asarray(random.key_data(keys[:, 1])).tolist() == data[:, 1].tolist()
    assert [np.asarray(random.key_data(r)).tolist() for r in keys] == data.tolist()
    # JnpWithKeyArrayTest test_reshape / test_ravel / test_stack: the data reshaped alike.
    assert np.asarray(random.key_data(keys.reshape(3, 2))).tolist() == data.reshape(3, 2, 2).tolist()
    assert np.asarray(random.key_data(keys.ravel())).tolist() == data.reshape(6, 2).tolist()
    # A -1 that no size resolves is refused, as numpy's reshape refuses it ("cannot reshape array
    # of size 0 into shape (0,newaxis)"; JAX's array_methods.py _compute_newshape fails on it too:
    # its `arr.size % math.prod(other_sizes)` divides by the 0); two -1s are _compute_newshape's
    # TypeError.
    for ks, shape in [(random.split(k, 0), (0, -1)), (random.split(k, 0), (-1, 0))]:
        with pytest.raises(ValueError, match=rf"^cannot reshape key array of size {ks.size} into shape "
                                             rf"{re.escape(str(shape))}$"):
            ks.reshape(shape)
    with pytest.raises(TypeError, match=r"^can only specify one unknown axis size with a `-1` value, got \(-1, -1\)$"):
        k.reshape((-1, -1))
    assert np.asarray(random.key_data(keys.T)).tolist() == data.transpose(1, 0, 2).tolist()
    stacked = tessera.numpy.stack([keys[0], keys[1]], axis=-1)
    assert stacked.shape == (3, 2) and np.asarray(random.key_data(stacked)).tolist() == data.transpose(1, 0, 2).tolist()
    # JnpWithKeyArrayTest test_equality: elementwise over the key dimensions.
    k2 = random.key(456)
    assert bool(k == k) and not bool(k == k2) and bool(k != k2) and not bool(k != k)
    arr = random.split(k2, 5)
    mixed = tessera.numpy.concatenate([arr[:2], tessera.numpy.stack([k2, k2]), arr[4:]])
    assert np.asarray(k2 == mixed).tolist() == [False, False, True, True, False]
    assert np.asarray(k2 != mixed).tolist() == [True, True, False, False, True]
    # (A key and a number: jnp.equal's check_for_prngkeys, as JAX's == calls jnp.equal.)
    with pytest.raises(TypeError, match="^equal does not accept dtypes key<fry>, int32.$"):
        k == 1
    # A key array is one pytree leaf (prng.py registers it in JAX's dispatch registry only).
    assert tessera.tree_util.tree_leaves({"k": keys, "n": 1}) == [keys, 1]
    # wrap_key_data(key_data(k)) is k (random_test.py test_wrap_key_default); numpy data is put
    # on the devices; invalid data is a TypeError (prng.py _check_prng_key_data).
    wrapped = random.wrap_key_data(np.array([42, 173], np.uint32))
    assert str(wrapped.dtype) == "key<fry>" and wrapped.shape == ()
    assert _bytes(random.normal(wrapped, (4,))) == _bytes(random.normal(np.array([42, 173], np.uint32), (4,)))
    assert np.asarray(random.key_data(random.wrap_key_data(random.key_data(keys)))).tolist() == data.tolist()
    with pytest.raises(TypeError, match="^JAX encountered invalid PRNG key data: expected key_data.dtype = uint32; "
                                        "got dtype=int32$"):
        random.wrap_key_data(np.array([42, 173], np.int32))
    with pytest.raises(TypeError, match=r"^JAX encountered invalid PRNG key data: expected key_data.shape to end "
                                        r"with \(2,\); got shape=\(4, 3\) for impl=threefry2x32$"):
        random.wrap_key_data(np.zeros((4, 3), np.uint32))
    with pytest.raises(TypeError, match="^JAX encountered invalid PRNG key data: expected key_data.ndim >= 1; "
                                        "got ndim=0$"):
        random.wrap_key_data(tessera.numpy.zeros((), np.uint32))


def test_typed_keys_refuse_arithmetic_conversion_and_batches():
    # (Operators and jnp functions: test_key_operators_and_jnp_functions_refuse_in_jax_words.)
    k = random.key(123)
    # test_keyarray_array_conversion_fails; test_not_hashable.
    with pytest.raises(TypeError, match="cannot be converted to a NumPy array"):
        np.asarray(k)
    with pytest.raises(TypeError, match="unhashable"):
        hash(k)
    # core.py _check_prng_key: one key where one is expected; test_key_as_seed.
    with pytest.raises(ValueError, match=r"normal accepts a single key, but was given a key array of shape \(2,\)"):
        random.normal(random.split(k), (3,))
    with pytest.raises(TypeError, match="key accepts a scalar seed"):
        random.key(k)
    with pytest.raises(TypeError, match="PRNGKey accepts a scalar seed"):
        random.PRNGKey(k)
    with pytest.raises(ValueError, match="threefry2x32"):
        random.key(0, impl="rbg")


def _jax_text_matches(got, want):
    """got == want, except that the dtypes after "are subtypes of" compare as a set: JAX joins a
    lax dtype rule's accepted types from a Python set (jax/_src/lax/lax.py _num = _int | _float |
    _complex), so their order is the set's."""
    head, sep, names = want.partition("are subtypes of ")
    got_head, got_sep, got_names = got.partition("are subtypes of ")
    if not sep:
        return got == want
    return got_head == head and got.endswith(".") and \
        set(got_names[:-1].split(", ")) == set(names[:-1].split(", "))


def test_key_operators_and_jnp_functions_refuse_in_jax_words():
    # JAX's Array operators are jnp functions (jax/_src/numpy/array_methods.py _array_operators;
    # jax/_src/random/prng.py gives PRNGKeyArray those operators). A jnp function promotes its
    # operands first (jax/_src/numpy/util.py promote_args*); its check_for_prngkeys refuses a key
    # next to another dtype, naming the jnp function and the dtypes in order. Keys only pass it:
    # promote_args then binds the lax primitive, whose dtype rule names the primitive and position
    # (lax.py naryop_dtype_rule, unop_dtype_rule); promote_args_numeric / _inexact, and power's
    # concrete integer exponent (ufuncs.py power, case 1), first take np.dtype of the key dtype
    # (dtypes.py to_numeric_dtype), which numpy refuses. random_test.py JnpWithKeyArrayTest
    # test_errors asserts the add and neg cases.
    jnp, lax = tessera.numpy, tessera.lax
    k = random.key(123)
    mixed = "{} does not accept dtypes {}."
    num = "integer, floating, complexfloating"

    def nary(prim, names):
        return (f"{prim} does not accept dtype key<fry> at position 0. Accepted dtypes at position 0 are subtypes "
                f"of {names}.")

    def unary(prim, names):
        return f"{prim} does not accept dtype key<fry>. Accepted dtypes are subtypes of {names}."

    numpy_refuses = "Cannot interpret 'key<fry>' as a data type"
    cases = [
        # A key and another dtype: check_for_prngkeys, in the jnp function's name.
        (lambda: k + 1, mixed.format("add", "key<fry>, int32")),
        (lambda: 1 + k, mixed.format("add", "int32, key<fry>")),
        (lambda: k - 1, mixed.format("subtract", "key<fry>, int32")),
        (lambda: 2.0 - k, mixed.format("subtract", "float32, key<fry>")),
        (lambda: k * 2, mixed.format("multiply", "key<fry>, int32")),
        (lambda: k / 2, mixed.format("true_divide", "key<fry>, int32")),
        (lambda: k // 2, mixed.format("floor_divide", "key<fry>, int32")),
        (lambda: k % 2, mixed.format("remainder", "key<fry>, int32")),
        (lambda: divmod(k, 2), mixed.format("divmod", "key<fry>, int32")),
        (lambda: k ** 2.0, mixed.format("power", "key<fry>, float32")),
        (lambda: 2 ** k, mixed.format("power", "int32, key<fry>")),
        (lambda: k < 1, mixed.format("less", "key<fry>, int32")),
        (lambda: k <= 1, mixed.format("less_equal", "key<fry>, int32")),
        (lambda: 1 < k, mixed.format("greater", "key<fry>, int32")),  # Python reflects it to k > 1
        (lambda: k >= 1, mixed.format("greater_equal", "key<fry>, int32")),
        (lambda: k == 1, mixed.format("equal", "key<fry>, int32")),
        (lambda: 1 != k, mixed.format("not_equal", "key<fry>, int32")),
        (lambda: k & 1, mixed.format("bitwise_and", "key<fry>, int32")),
        (lambda: k | True, mixed.format("bitwise_or", "key<fry>, bool")),
        (lambda: 1 ^ k, mixed.format("bitwise_xor", "int32, key<fry>")),
        (lambda: k << 1, mixed.format("left_shift", "key<fry>, int32")),
        (lambda: k >> 1, mixed.format("right_shift", "key<fry>, int32")),
        (lambda: jnp.add(k, 1), mixed.format("add", "key<fry>, int32")),
        (lambda: jnp.subtract(2.0, k), mixed.format("subtract", "float32, key<fry>")),
        (lambda: jnp.multiply(k, np.int32(2)), mixed.format("multiply", "key<fry>, int32")),
        (lambda: jnp.remainder(k, 3), mixed.format("remainder", "key<fry>, int32")),
        (lambda: jnp.power(k, 2.5), mixed.format("power", "key<fry>, float32")),
        (lambda: jnp.maximum(k, 0), mixed.format("maximum", "key<fry>, int32")),
        (lambda: jnp.where(True, k, 1), mixed.format("where", "key<fry>, int32")),
        # check_for_prngkeys names the operands' jax.dtypes.dtype, which canonicalizes every
        # value that is no jax.Array (jax/_src/dtypes.py dtype: np.result_type, then
        # canonicalize_dtype): numpy's int64 and float64 are int32 and float32 without x64.
        (lambda: k + np.arange(3), mixed.format("add", "key<fry>, int32")),
        (lambda: k * np.float64(2.0), mixed.format("multiply", "key<fry>, float32")),
        (lambda: jnp.subtract(np.float64(2.0), k), mixed.format("subtract", "float32, key<fry>")),
        # Keys only: the lax primitive's dtype rule.
        (lambda: k + k, nary("add", num)),
        (lambda: jnp.add(k, k), nary("add", num)),
        (lambda: k - k, nary("sub", num)),
        (lambda: jnp.subtract(k, k), nary("sub", num)),
        (lambda: k * k, nary("mul", num)),
        (lambda: k < k, nary("lt", "integer, floating, bool")),
        (lambda: jnp.greater_equal(k, k), nary("ge", "integer, floating, bool")),
        (lambda: k & k, nary("and", "integer, bool")),
        (lambda: jnp.maximum(k, k), nary("max", "integer, floating, complexfloating, bool")),
        (lambda: -k, unary("neg", num)),
        (lambda: jnp.negative(k), unary("neg", num)),
        (lambda: abs(k), unary("abs", "signedinteger, floating, complexfloating")),
        (lambda: ~k, unary("not", "integer, bool")),
        (lambda: jnp.sign(k), unary("sign", num)),
        # Keys only, promoted to a numeric or inexact dtype first: numpy's refusal.
        (lambda: k / k, numpy_refuses),
        (lambda: k // k, numpy_refuses),
        (lambda: k % k, numpy_refuses),
        (lambda: k ** k, numpy_refuses),
        (lambda: k ** 2, numpy_refuses),
        (lambda: jnp.power(k, 2), numpy_refuses),
        (lambda: k << k, numpy_refuses),
        (lambda: jnp.exp(k), numpy_refuses),
        (lambda: jnp.floor(k), numpy_refuses),
        (lambda: jnp.square(k), numpy_refuses),
        (lambda: jnp.logical_and(k, k), numpy_refuses),  # (ufuncs.py _to_bool: np.array(0, key<fry>))
        (lambda: jnp.logical_not(k), numpy_refuses),
        (lambda: jnp.logical_or(k, 1), mixed.format("logical_or", "key<fry>, int32")),
        # lax's functions bind the primitive without jnp's promotion: its dtype rule refuses
        # the first operand it does not accept, at its position (lax.pow's Python 2 too).
        (lambda: lax.sub(k, 1), nary("sub", num)),
        (lambda: lax.sub(1.0, k), nary("sub", num).replace("position 0", "position 1")),
        (lambda: lax.div(k, 2), nary("div", num)),
        (lambda: lax.rem(k, k), nary("rem", "integer, floating")),
        (lambda: lax.max(k, 0), nary("max", "integer, floating, complexfloating, bool")),
        (lambda: lax.pow(k, 2), nary("pow", "floating, complexfloating")),
        (lambda: lax.pow(2.0, k), nary("pow", num).replace("position 0", "position 1")),
        (lambda: lax.pow(2, k), nary("pow", "floating, complexfloating").replace("key<fry>", "int32")),
        (lambda: lax.neg(k), unary("neg", num)),
        (lambda: lax.floor(k), unary("floor", "floating")),
        (lambda: lax.exp(k), unary("exp", "floating, complexfloating")),
        (lambda: lax.logistic(k), unary("logistic", "floating, complexfloating")),
        (lambda: lax.erf(k), unary("erf", "floating")),
        (lambda: lax.rsqrt(k), unary("rsqrt", "floating, complexfloating")),
        (lambda: tessera.nn.sigmoid(k), unary("logistic", "floating, complexfloating")),  # (lax.logistic)
        # Operands that are no arrays: Python's own TypeError once the operator returns
        # NotImplemented (array_methods.py _accepted_binop_types); ==, != of a list refuse.
        (lambda: k - "a", "unsupported operand type(s) for -: 'PRNGKeyArray' and 'str'"),
        (lambda: k == [1], "unsupported operand type(s) for ==: 'PRNGKeyArray' and 'list'"),
        (lambda: k != (1,), "unsupported operand type(s) for ==: 'PRNGKeyArray' and 'tuple'"),
    ]
    for i, (f, message) in enumerate(cases):
        with pytest.raises(TypeError) as e:
            f()
        assert _jax_text_matches(str(e.value), message), (i, str(e.value), message)
    # tensor_contractions.py matmul checks the ranks first.
    with pytest.raises(ValueError, match=r"^matmul input operand 0 must have ndim at least 1, but it has ndim 0$"):
        k @ random.split(k, 2)
    # jnp.positive is lax.asarray of the promoted operand: the key itself. Anything but an array
    # compares unequal by identity (_operator_eq returns NotImplemented).
    assert _bytes(random.key_data(+k)) == _bytes(random.key_data(k))
    assert (k == "a") is False and (k != None) is True  # noqa: E711


def test_typed_keys_through_shard_map_and_device_get(mesh8):
    # A shard_map body gets its block of keys typed (key<fry>[1] on each of 8 devices) and
    # returns typed keys, laid out as out_specs says; device_get keeps them keys (random_test.py
    # test_device_get).
    keys = random.split(random.key(11), 8)
    out = tessera.shard_map(lambda k: random.split(k[0], 1), mesh=mesh8, in_specs=P("x"), out_specs=P("x"))(keys)
    assert str(out.dtype) == "key<fry>" and out.shape == (8,) and out.sharding.spec == P("x")
    for i in range(8):
        assert _bytes(random.key_data(out[i])) == _bytes(random.key_data(random.split(keys[i], 1)[0])), i
    got = tessera.device_get(keys)
    assert str(got.dtype) == "key<fry>" and got.shape == (8,)
    assert np.asarray(random.key_data(got)).tolist() == np.asarray(random.key_data(keys)).tolist()


def test_typed_keys_through_jit_vmap_scan_and_device_put(mesh):
    k = random.key(7)
    keys = random.split(k, 8)
    # jit: typed keys in and out (random_test.py test_dtype_property: the dtype seen inside jit
    # is key<fry>), results equal the eager ones.
    seen = []

    def f(key):
        seen.append(str(key.dtype))
        a, b = random.split(key)
        return a, random.normal(b, (4,))

    a, n = tessera.jit(f)(k)
    ea, en = f(k)
    assert seen[0] == "key<fry>" and str(a.dtype) == "key<fry>" and a.shape == ()
    assert _bytes(random.key_data(a)) == _bytes(random.key_data(ea)) and _bytes(n) == _bytes(en)
    # vmap over a batch of typed keys: each key's sample (random_test.py test_vmap), and a
    # batch of keys out.
    out = tessera.vmap(lambda key: random.uniform(key, (3,)))(keys)
    assert out.shape == (8, 3)
    for i in range(8):
        assert _bytes(out[i]) == _bytes(random.uniform(keys[i], (3,))), i
    folded = tessera.vmap(random.fold_in, in_axes=(None, 0))(k, np.arange(8, dtype=np.int32))
    assert str(folded.dtype) == "key<fry>" and folded.shape == (8,)
    assert _bytes(random.key_data(folded)) == _bytes(random.key_data(random.split(k, 8)))  # fold_in(k, i) == split(k)[i]
    # Negative axes count the key dimensions, as JAX's (the data's trailing 2 is not one).
    grid = random.split(k, (2, 4))
    cols = tessera.vmap(random.key_data, in_axes=-1)(grid)
    assert cols.shape == (4, 2, 2)  # each example the column of 2 keys
    for j in range(4):
        assert _bytes(cols[j]) == _bytes(random.key_data(grid[:, j])), j
    last_axis = tessera.vmap(lambda key: random.split(key, 3), out_axes=-1)(keys)
    assert last_axis.shape == (3, 8)
    assert _bytes(random.key_data(last_axis)) == _bytes(np.asarray(random.key_data(
        tessera.vmap(lambda key: random.split(key, 3))(keys))).transpose(1, 0, 2))
    # A typed key as a scan carry inside jit.
    def step(c, _):
        c, s = random.split(c)
        return c, random.uniform(s)

    last, ys = tessera.jit(lambda key: tessera.lax.scan(step, key, None, length=3))(k)
    want, c = [], k
    for _ in range(3):
        c, s = random.split(c)
        want.append(np.asarray(random.uniform(s)))
    assert str(last.dtype) == "key<fry>" and _bytes(random.key_data(last)) == _bytes(random.key_data(c))
    assert _bytes(ys) == _bytes(np.stack(want))
    # device_put with a sharding of the key dimensions (random_test.py test_device_put): the
    # data's trailing dimension of two words stays whole on every device.
    grid = random.split(k, (8, 2))
    put = tessera.device_put(grid, NamedSharding(mesh, P("data", "model")))
    assert str(put.dtype) == "key<fry>" and put.shape == (8, 2)
    assert put.sharding.spec == P("data", "model")
    shards = random.key_data(put).addressable_shards
    assert len(shards) == 8 and all(s.index[2] == slice(0, 2) and s.data.shape == (2, 1, 2) for s in shards)
    assert _bytes(random.key_data(put)) == _bytes(random.key_data(grid))
    # ... and a jitted, doubly vmapped sampler over them runs where they live, equal to each key alone.
    g = tessera.jit(tessera.vmap(tessera.vmap(lambda key: random.normal(key, (3,)))))
    s = g(put)
    assert s.sharding.spec == P("data", "model", None)
    for i in range(8):
        for j in range(2):
            assert _bytes(s[i, j]) == _bytes(random.normal(grid[i, j], (3,))), (i, j)


def test_a_failed_trace_with_typed_keys_raises_the_failure_not_a_key_error():
    # A key is its data to the transformations, and JAX checks key data only where it is
    # wrapped (jax/_src/random/prng.py random_wrap's _check_prng_key_data, on avals): an op that
    # fails while tracing is reported as itself with a typed key, as with the raw key. Here
    # shard_map's out_specs check (jax/_src/shard_map.py _check_vma: an output that varies
    # along 'x' under out_specs P()) and random::fold_in's data check.
    m = tessera.make_mesh((8,), ("x",), axis_types=(tessera.sharding.AxisType.Explicit,))
    v = tessera.device_put(tessera.numpy.zeros(8), NamedSharding(m, P("x")))
    body = tessera.shard_map(lambda k, v: random.fold_in(k, v[0].astype(np.int32)), mesh=m,
                             in_specs=(P(), P("x")), out_specs=P())
    for make in (random.PRNGKey, random.key):
        with pytest.raises(tessera.errors.InvalidArgumentError, match=r"out_specs\[0\] = P\(\) leaves 'x' out"):
            tessera.jit(body)(make(0), v)
        with pytest.raises(tessera.errors.InvalidArgumentError, match="it must be an integer scalar"):
            tessera.jit(lambda k: random.fold_in(k, tessera.numpy.zeros(3)))(make(0))


def test_jnp_array_of_typed_keys_is_the_keys():
    # random_test.py test_array: jnp.array(key) and jnp.asarray(key) are the key, also under jit;
    # test_array_user_dtype: with dtype=key.dtype too; test_errors: to another dtype it is
    # "Cannot convert_element_type from key<fry> to int32".
    jnp = tessera.numpy
    k = random.key(123)
    want = _bytes(random.key_data(k))
    for f in (jnp.array, jnp.asarray, tessera.jit(jnp.array), tessera.jit(jnp.asarray),
              lambda k: jnp.array(k, dtype=k.dtype), lambda k: jnp.asarray(k, dtype=k.dtype)):
        got = f(k)
        assert str(got.dtype) == "key<fry>" and got.shape == ()
        assert _bytes(random.key_data(got)) == want
    with pytest.raises(ValueError, match="^Cannot convert_element_type from key<fry> to int32$"):
        jnp.array(k, dtype=np.int32)


def test_typed_keys_through_the_collectives_that_move_data(mesh8):
    # Collectives that move or retype values do not depend on the dtype, so they take typed
    # keys by their data, axes counting the key dimensions (JAX binds them on key avals:
    # jax/_src/lax/parallel.py; random_test.py KeyArrayTest runs keys through such primitives);
    # lax.stop_gradient returns a key unchanged (jax/_src/lax/lax.py _stop_gradient: extended
    # dtypes). Reductions have no meaning on keys and are refused in lax's dtype-rule words.
    lax = tessera.lax
    keys = random.split(random.key(5), 8)
    data = np.asarray(random.key_data(keys))

    def run(body, in_spec, out_spec, x=keys):
        out = tessera.jit(tessera.shard_map(body, mesh=mesh8, in_specs=in_spec, out_specs=out_spec))(x)
        assert str(out.dtype) == "key<fry>"
        return np.asarray(random.key_data(out))

    # all_gather (invariant, so out_specs P() holds): each device's block key<fry>[1] gathered
    # to key<fry>[8, 1] (a new leading axis), tiled to key<fry>[8], and at axis=-1 (of the
    # result's key dimensions) to [1, 8].
    def gather(**kw):
        return run(lambda k: lax.all_gather(k, "x", to="invarying", **kw), P("x"), P())

    assert gather().tolist() == data.reshape(8, 1, 2).tolist()
    assert gather(tiled=True).tolist() == data.tolist()
    assert gather(axis=-1).tolist() == data.reshape(1, 8, 2).tolist()
    # ppermute: device i gets device i-1's key.
    perm = [(i, (i + 1) % 8) for i in range(8)]
    assert run(lambda k: lax.ppermute(k, "x", perm), P("x"), P("x")).tolist() == np.roll(data, 1, 0).tolist()
    # all_to_all of the replicated key<fry>[8] on its last key axis (-1): device i gets key i
    # from each of the 8 devices.
    assert run(lambda k: lax.all_to_all(k, "x", -1, -1, tiled=True), P(), P("x")).tolist() == \
        np.repeat(data, 8, 0).tolist()
    # pbroadcast from device 3; pvary and pcast to 'varying' keep each device's key.
    assert run(lambda k: lax.pbroadcast(k, "x", 3), P("x"), P("x")).tolist() == np.repeat(data[3:4], 8, 0).tolist()
    assert run(lambda k: lax.pvary(k[0], "x")[None], P(), P("x")).tolist() == np.repeat(data[0:1], 8, 0).tolist()
    assert run(lambda k: lax.pcast(k[0], "x", to="varying")[None], P(), P("x")).tolist() == \
        np.repeat(data[0:1], 8, 0).tolist()
    # stop_gradient of a tree with a key: the key unchanged, x's gradient stopped (d/dx of
    # sum(stop_gradient(x) * x) is x, not 2x).
    k = random.key(9)
    x = np.arange(1, 5, dtype=np.float32)
    g = tessera.grad(lambda x: tessera.numpy.sum(lax.stop_gradient({"k": k, "x": x})["x"] * x))(x)
    assert np.asarray(g).tolist() == x.tolist()
    assert _bytes(random.key_data(lax.stop_gradient(k))) == _bytes(random.key_data(k))
    for name in ("psum", "pmax", "pmin", "pmean"):
        with pytest.raises(TypeError, match=f"^{name} does not accept dtype key<fry>$"):
            run(lambda k: getattr(lax, name)(k, "x"), P("x"), P())


def test_typed_keys_through_auto_axes_and_explicit_axes():
    # jax.sharding.auto_axes / explicit_axes (jax/_src/pjit.py) take any pytree of arrays, keys
    # too (a key aval has its key dimensions' sharding); eagerly and under jit, the keys out are
    # the keys f gives, laid out as asked.
    from tessera.sharding import AxisType, auto_axes, explicit_axes
    fold = tessera.vmap(lambda k: random.fold_in(k, 3))
    for types, switch in [(AxisType.Explicit, lambda: auto_axes(fold, out_sharding=P("x"))),
                          (AxisType.Auto, lambda: explicit_axes(fold, in_sharding=P("x")))]:
        m = tessera.make_mesh((8,), ("x",), axis_types=(types,))
        keys = tessera.device_put(random.split(random.key(0), 8), NamedSharding(m, P("x")))
        want = _bytes(random.key_data(fold(keys)))
        with tessera.set_mesh(m):
            for run in (switch(), tessera.jit(switch())):
                out = run(keys)
                assert str(out.dtype) == "key<fry>" and out.shape == (8,) and out.sharding.spec == P("x"), types
                assert _bytes(random.key_data(out)) == want, types


def test_typed_keys_select_broadcast_and_expand_dims():
    # random_test.py test_select / test_select_scalar_cond: lax.select of keys (under jit, and
    # with a scalar condition) gives keys of that shape; JnpWithKeyArrayTest test_broadcast_to
    # and test_expand_dims: the key dimensions broadcast / grow as an array's, the data alike.
    jnp, lax = tessera.numpy, tessera.lax
    ks = random.split(random.key(3), 6).reshape(3, 2)
    other = random.split(random.key(4), 6).reshape(3, 2)
    data, odata = np.asarray(random.key_data(ks)), np.asarray(random.key_data(other))
    cs = np.array([True, False, False, True, False, True]).reshape(3, 2)
    ys = tessera.jit(lax.select)(jnp.asarray(cs), ks, other)
    assert str(ys.dtype) == "key<fry>" and ys.shape == (3, 2)
    assert np.asarray(random.key_data(ys)).tolist() == np.where(cs[..., None], data, odata).tolist()
    ys = lax.select(True, ks[0], other[0])
    assert str(ys.dtype) == "key<fry>" and ys.shape == (2,) and _bytes(random.key_data(ys)) == _bytes(data[0])
    assert _bytes(random.key_data(jnp.where(False, ks, other))) == _bytes(odata)
    b = jnp.broadcast_to(random.key(123), (3,))
    assert str(b.dtype) == "key<fry>" and b.shape == (3,)
    assert np.asarray(random.key_data(b)).tolist() == [np.asarray(random.key_data(random.key(123))).tolist()] * 3
    for axis, want in [(1, data[:, None]), (-1, data[:, :, None])]:
        e = jnp.expand_dims(ks, axis)
        assert str(e.dtype) == "key<fry>" and e.shape == want.shape[:-1]
        assert _bytes(random.key_data(e)) == _bytes(want)


def test_typed_keys_are_arrays_and_array_functions_take_them(mesh8):
    # random_test.py test_isinstance: isinstance(key, jax.Array) for key and PRNGKey (prng.py:
    # PRNGKeyArray subclasses jax.Array); also a key inside jit.
    jnp = tessera.numpy
    k = random.key(0)
    keys = random.split(random.key(789543))
    seen = []
    tessera.jit(lambda k: seen.append(isinstance(k, tessera.Array)) or random.split(k))(k)
    assert isinstance(k, tessera.Array) and isinstance(keys, tessera.Array) and seen and all(seen)
    assert issubclass(type(k), tessera.Array) and isinstance(random.PRNGKey(0), tessera.Array)
    # JnpWithKeyArrayTest test_full_like: zeros_like / ones_like / full_like of keys are keys of
    # that many words (prng.py KeyTyRules.full), and test_full_like_with_key_fillvalue: a key
    # fill value's data broadcast.
    for func, args, fill in [(jnp.zeros_like, (), 0), (jnp.ones_like, (), 1), (jnp.full_like, (100,), 100)]:
        out = func(keys, *args)
        assert str(out.dtype) == "key<fry>" and out.shape == (2,)
        assert np.asarray(random.key_data(out)).tolist() == np.full((2, 2), fill, np.uint32).tolist()
    out = jnp.full_like(keys, random.key(42))
    assert np.asarray(random.key_data(out)).tolist() == [np.asarray(random.key_data(random.key(42))).tolist()] * 2
    # Of a committed key array with another dtype: that dtype, laid out as the keys.
    put = tessera.device_put(random.split(k, 8), NamedSharding(mesh8, P("x")))
    # Keys like committed keys are not laid out as them: lax.full_like returns
    # dtype._rules.full(fill_shape, ...) for a key dtype before it looks at the input's sharding,
    # and prng.py KeyTyRules.full calls lax.full without one (jax/_src/lax/lax.py full_like):
    # uncommitted, on the default device; shape= is the keys' shape (fill_shape).
    for out, shape, fill in [(jnp.zeros_like(put), (8,), 0), (jnp.full_like(put, 7), (8,), 7),
                             (jnp.ones_like(put, shape=(2, 4)), (2, 4), 1)]:
        assert str(out.dtype) == "key<fry>" and out.shape == shape and not out._committed
        assert len(out.sharding.mesh.devices.flat) == 1
        assert np.asarray(random.key_data(out)).tolist() == np.full((*shape, 2), fill, np.uint32).tolist()
    z = jnp.zeros_like(put, dtype=np.int32)
    assert z.dtype == np.int32 and z.shape == (8,) and z.sharding.spec == P("x")
    assert np.asarray(z).tolist() == [0] * 8
    # jnp.transpose and jnp.swapaxes act on the key dimensions (random_test.py test_transpose).
    grid = random.split(k, 6).reshape(2, 3)
    gdata = np.asarray(random.key_data(grid))
    for out in (jnp.transpose(grid), jnp.swapaxes(grid, 0, 1), tessera.jit(jnp.transpose)(grid)):
        assert str(out.dtype) == "key<fry>" and out.shape == (3, 2)
        assert np.asarray(random.key_data(out)).tolist() == gdata.transpose(1, 0, 2).tolist()
    # jnp.split slices the key dimensions as an array's.
    halves = jnp.split(random.split(k, 4), 2)
    assert [h.shape for h in halves] == [(2,), (2,)] and all(str(h.dtype) == "key<fry>" for h in halves)
    assert np.asarray(random.key_data(halves[1])).tolist() == \
        np.asarray(random.key_data(random.split(k, 4)))[2:].tolist()
    # The transformations still see a key as its data: a committed key array's layout holds.
    g = tessera.jit(lambda ks: random.fold_in(ks[0], 1))(put)
    assert str(g.dtype) == "key<fry>" and _bytes(random.key_data(g)) == _bytes(random.key_data(random.fold_in(
        random.split(k, 8)[0], 1)))


def test_typeof_at_take_and_convert_element_type_of_typed_keys(mesh8):
    jnp, lax = tessera.numpy, tessera.lax
    k = random.key(123)
    # jax.typeof(key): ShapedArray(shape, KeyTy) of the key dimensions (prng.py PRNGKeyArray.aval,
    # keys_shaped_array), str key<fry>[] (core.py str_short_aval); on an Explicit axis
    # key<fry>[8@x], and inside jit the same.
    assert str(tessera.typeof(k)) == "key<fry>[]" and repr(tessera.typeof(k)) == "ShapedArray(key<fry>[])"
    assert tessera.typeof(k).shape == () and str(tessera.typeof(k).dtype) == "key<fry>"
    m = tessera.make_mesh((8,), ("x",), axis_types=(tessera.sharding.AxisType.Explicit,))
    keys = tessera.device_put(random.split(k, 8), NamedSharding(m, P("x")))
    assert str(tessera.typeof(keys)) == "key<fry>[8@x]" and tessera.typeof(keys).sharding.spec == P("x")
    seen = []
    tessera.jit(lambda ks: seen.append(str(tessera.typeof(ks))) or ks)(keys)
    assert seen == ["key<fry>[8@x]"]
    assert str(tessera.typeof(random.split(k, (2, 3)))) == "key<fry>[2,3]"
    # .at[idx].get() and .set(key): JnpWithKeyArrayTest test_gather / test_scatter (an int, a
    # slice, an integer array and a boolean mask; a strided slice too) against the same on the
    # data; test_equality's .at[].set(key).
    three = random.split(k, 3)
    data = np.asarray(random.key_data(three))
    kdata = np.asarray(random.key_data(k))
    for idx in (0, slice(1), np.array([0, 2]), np.array([False, True, True]), slice(None, None, -2)):
        for f in (lambda x: x.at[idx].get(), tessera.jit(lambda x: x.at[idx].get())):
            out = f(three)
            assert str(out.dtype) == "key<fry>" and np.asarray(random.key_data(out)).tolist() == data[idx].tolist()
        for f in (lambda x, y: x.at[idx].set(y), tessera.jit(lambda x, y: x.at[idx].set(y))):
            out = f(three, k)
            want = data.copy()
            want[idx] = kdata
            assert str(out.dtype) == "key<fry>" and np.asarray(random.key_data(out)).tolist() == want.tolist()
    five = random.split(k, 5).at[np.array([2, 3])].set(k)
    assert np.asarray(k == five).tolist() == [False, False, True, True, False]
    # KeyArrayTest test_gather_fill: out of range with mode='fill' is the key of uint32-max words.
    out = tessera.jit(lambda x: x.at[100].get(mode="fill"))(three)
    assert str(out.dtype) == "key<fry>" and np.asarray(random.key_data(out)).tolist() == [2**32 - 1] * 2
    with pytest.raises(TypeError, match="^Cannot interpret 'key<fry>' as a data type$"):
        three.at[0].set(1)  # scatter.py _scatter_update: np.issubdtype(key dtype, np.integer)
    # The arithmetic updates: lax.scatter_add and the others build their combining function
    # from lax._const(keys, 0), np.array(0, key dtype), which numpy refuses in these words
    # (jax/_src/lax/slicing.py; divide and power scatter onto ones_like(keys) the same way).
    for name in ("add", "subtract", "multiply", "mul", "divide", "power", "min", "max"):
        for values in (k, 1):
            with pytest.raises(TypeError, match="^Cannot interpret 'key<fry>' as a data type$"):
                getattr(three.at[np.array([0, 2])], name)(values)
    # ... unless the index selects no key: _scatter_impl (jax/_src/ops/scatter.py) returns the
    # keys when the slice shape is empty, before that function is built; a Python int is still
    # refused first (_scatter_update).
    for name in ("add", "subtract", "multiply", "mul", "divide", "power", "min", "max"):
        for f in (lambda x, y: getattr(x.at[np.zeros(3, bool)], name)(y),
                  tessera.jit(lambda x, y: getattr(x.at[2:1], name)(y))):
            out = f(three, k)
            assert str(out.dtype) == "key<fry>" and np.asarray(random.key_data(out)).tolist() == data.tolist()
        with pytest.raises(TypeError, match="^Cannot interpret 'key<fry>' as a data type$"):
            getattr(three.at[np.zeros(3, bool)], name)(1)
    # JAX's scatter_apply takes keys (lax.full of a key dtype is KeyTyRules.full); not built here.
    with pytest.raises(NotImplementedError, match=r"^x.at\[...\].apply on a key array \(key<fry>\) is not"):
        tessera.jit(lambda x: x.at[1].apply(lambda v: v))(three)
    # jnp.take / key.take over the key dimensions (prng.py forwards take), axis None flattened;
    # out of range in the default fill mode is the uint32-max key as the gather's.
    grid = random.split(k, 6).reshape(2, 3)
    gdata = np.asarray(random.key_data(grid))
    for out, want in [(jnp.take(grid, np.array([4, 0])), gdata.reshape(6, 2)[[4, 0]]),
                      (grid.take(np.array([2, 1]), axis=1), gdata[:, [2, 1]]),
                      (jnp.take(grid, np.array([1]), axis=-2), gdata[[1]]),
                      (jnp.take(three, np.array([7])), np.full((1, 2), 2**32 - 1, np.uint32))]:
        assert str(out.dtype) == "key<fry>" and np.asarray(random.key_data(out)).tolist() == want.tolist()
    # JnpWithKeyArrayTest test_errors: keys convert to no other dtype, nothing to a key
    # (lax.py _from_edtype_abstract_eval / _to_edtype_abstract_eval); to its own dtype, itself.
    with pytest.raises(ValueError, match="^Cannot convert_element_type from key<fry> to int32$"):
        lax.convert_element_type(k, int)
    with pytest.raises(ValueError, match="^Cannot convert_element_type from int32 to key<fry>$"):
        lax.convert_element_type(np.int32(0), k.dtype)
    assert lax.convert_element_type(k, k.dtype) is k
    # jnp.array / asarray with a dtype are the same conversion, of the user's dtype canonicalized
    # first (jax/_src/numpy/array_constructors.py array: dtypes.check_and_canonicalize_user_dtype,
    # so np.int64 and int are int32 without x64); random_test.py test_array_user_dtype: keys of
    # their own dtype are themselves. The name 'key<fry>' is no dtype: JAX's np.dtype of it
    # (check_and_canonicalize_user_dtype, through issubdtype) raises numpy's TypeError.
    for convert in (jnp.array, jnp.asarray, lax.convert_element_type):
        assert convert(k, k.dtype) is k
        for x in (k, np.int32(0)):
            with pytest.raises(TypeError, match="^data type 'key<fry>' not understood$"):
                convert(x, "key<fry>")
        for dtype in (np.int64, int, "int64"):
            with pytest.raises(ValueError, match="^Cannot convert_element_type from key<fry> to int32$"):
                convert(k, dtype)
        for value in (np.int32(0), np.int64(0)):
            with pytest.raises(ValueError, match="^Cannot convert_element_type from int32 to key<fry>$"):
                convert(value, k.dtype)


def test_key_dtypes_are_prng_key_subdtypes():
    # jax/_src/dtypes.py issubdtype (_issubdtype_cached): a key dtype is below prng_key,
    # extended and np.generic, nothing numeric (random.key's docstring and dtypes.prng_key's
    # example: jnp.issubdtype(key.dtype, dtypes.prng_key)); other dtypes as numpy's.
    jnp = tessera.numpy
    k = random.split(random.key(0), 4)
    traced = []
    tessera.jit(lambda k: traced.append(k.dtype) or k)(k)
    for dt in (k.dtype, traced[0], k[1:].dtype):
        assert tessera.dtypes.issubdtype(dt, tessera.dtypes.prng_key)
        assert jnp.issubdtype(dt, tessera.dtypes.extended) and jnp.issubdtype(dt, jnp.generic)
        assert jnp.issubdtype(dt, dt)
        for b in (jnp.integer, jnp.number, np.uint32, jnp.floating, "uint32"):
            assert not jnp.issubdtype(dt, b)
    for a in (np.uint32, "float32", np.dtype(np.int8), jnp.float32, jnp.bool_):
        assert not jnp.issubdtype(a, tessera.dtypes.prng_key) and not jnp.issubdtype(a, k.dtype)
    assert jnp.issubdtype(jnp.float32, jnp.floating) and jnp.issubdtype(np.dtype("int16"), jnp.signedinteger)
    assert jnp.issubdtype("uint8", jnp.unsignedinteger) and not jnp.issubdtype(jnp.int32, jnp.inexact)
    assert issubclass(tessera.dtypes.prng_key, tessera.dtypes.extended)
    assert tessera.dtypes.canonicalize_dtype(k.dtype) == k.dtype
    assert tessera.dtypes.canonicalize_dtype(np.float64) == np.float32

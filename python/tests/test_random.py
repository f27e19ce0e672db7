# tessera.random (issue #20, the random numbers of issue #15 item 4): jax.random's names and
# defaults over the SDK's threefry2x32. Expected values are the ones JAX documents or its tests
# assert, each cited; samplers built on transcendental functions are checked against their
# formula with Python's math.erf. randint, permutation and choice are JAX's algorithms: a numpy
# transcription of them (below) reproduces the values JAX's tests assert for its original bit
# layout, and Tessera's results equal it on Tessera's (partitionable) bits.
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

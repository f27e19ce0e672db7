"""tessera.random: jax.random's functions the SDK has (tessera/random.h), under jax.random's names.

Keys are JAX's raw keys, uint32[2] arrays (what `jax.random.PRNGKey` returns), hashed with
threefry2x32 in JAX's partitionable layout (`jax_threefry_partitionable`, JAX's default since
0.5.0): the same key gives the same bits as JAX, and a sharded sample is made where it lives.
Every function works on concrete arrays and inside jit.

    key = tessera.random.PRNGKey(0)
    key, sub = tessera.random.split(key)
    w = tessera.random.normal(sub, (784, 512)) * 0.01

Where this differs from jax.random: `key(seed)` returns a raw key too (JAX's typed keys,
dtype key<fry> and shape (), do not exist here; `key_data` and `wrap_key_data` are identities),
and minval/maxval/lower/upper are Python numbers, not arrays. `randint`, `permutation` and
`choice` are not implemented yet.
"""
from . import _tessera as _t
from .numpy import _op, _tracer, _wrap, _enum, _float_dtype, canonical_dtype


def _shape(shape, name):
    if shape is None:
        return ()
    if isinstance(shape, int):
        return (shape,)
    shape = tuple(shape)
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"{name}: shape must be a tuple of non-negative ints, not {shape}")
    return shape


def _number(x, name, fn):
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"random.{fn}: {name} must be a Python number here (Tessera takes no array "
                        f"{name}), not a {type(x).__name__}")
    return float(x)


def _dtype(dtype):
    return _enum(_float_dtype() if dtype is None else dtype)


@_op
def PRNGKey(seed):
    """jax.random.PRNGKey: the raw key of an integer seed (a Python int is an int32 first, as in
    JAX without jax_enable_x64; an int64 seed is bit-cast: [seed >> 32, seed & 0xFFFFFFFF])."""
    return _wrap(_t.random_key(_tracer(seed)._v))


key = PRNGKey


def key_data(keys):
    """jax.random.key_data: raw keys are their own data."""
    return keys


def wrap_key_data(key_bits_array):
    """jax.random.wrap_key_data: raw keys are their own data."""
    return key_bits_array


@_op
def split(key, num=2):
    """jax.random.split: `num` new keys, uint32[num, 2] (or an array of keys of shape `num`)."""
    return _wrap(_t.random_split(_tracer(key)._v, _shape(num, "random.split")))


@_op
def fold_in(key, data):
    """jax.random.fold_in: a new key from `key` and an integer scalar; fold_in(k, i) == split(k, n)[i]."""
    return _wrap(_t.random_fold_in(_tracer(key)._v, _tracer(data)._v))


@_op
def bits(key, shape=(), dtype=None):
    """jax.random.bits: uint32 words (the only width Tessera draws)."""
    if dtype is not None and canonical_dtype(dtype) != canonical_dtype("uint32"):
        raise ValueError(f"random.bits: dtype {dtype} is not supported; Tessera draws uint32 bits")
    return _wrap(_t.random_bits(_tracer(key)._v, _shape(shape, "random.bits")))


@_op
def uniform(key, shape=(), dtype=None, minval=0.0, maxval=1.0):
    """jax.random.uniform in [minval, maxval) (float32 by default, float64 with jax_enable_x64)."""
    return _wrap(_t.random_uniform(_tracer(key)._v, _shape(shape, "random.uniform"), _dtype(dtype),
                                   _number(minval, "minval", "uniform"), _number(maxval, "maxval", "uniform")))


@_op
def normal(key, shape=(), dtype=None):
    """jax.random.normal: standard normal samples."""
    return _wrap(_t.random_normal(_tracer(key)._v, _shape(shape, "random.normal"), _dtype(dtype)))


@_op
def truncated_normal(key, lower, upper, shape=None, dtype=None):
    """jax.random.truncated_normal on the open interval (lower, upper)."""
    return _wrap(_t.random_truncated_normal(_tracer(key)._v, _number(lower, "lower", "truncated_normal"),
                                            _number(upper, "upper", "truncated_normal"),
                                            _shape(shape, "random.truncated_normal"), _dtype(dtype)))


@_op
def bernoulli(key, p=0.5, shape=None):
    """jax.random.bernoulli: bool samples that are True with probability p (p's shape by default)."""
    k = _tracer(key)
    pt = _tracer(p)
    return _wrap(_t.random_bernoulli(k._v, pt._v, tuple(pt.shape) if shape is None else _shape(shape, "random.bernoulli")))


@_op
def categorical(key, logits, axis=-1, shape=None):
    """jax.random.categorical: int32 indices along `axis` drawn with probabilities softmax(logits)."""
    if shape is not None:
        raise NotImplementedError("random.categorical: shape= is not supported; Tessera draws one sample per row")
    return _wrap(_t.random_categorical(_tracer(key)._v, _tracer(logits)._v, axis))

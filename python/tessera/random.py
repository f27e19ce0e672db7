"""tessera.random: jax.random's functions the SDK has (tessera/random.h), under jax.random's names.

Keys are JAX's raw keys, uint32[2] arrays (what `jax.random.PRNGKey` returns), hashed with
threefry2x32 in JAX's partitionable layout (`jax_threefry_partitionable`, JAX's default since
0.5.0): the same key gives the same bits as JAX, and a sharded sample is made where it lives.
Every function works on concrete arrays and inside jit.

    key = tessera.random.PRNGKey(0)
    key, sub = tessera.random.split(key)
    w = tessera.random.normal(sub, (784, 512)) * 0.01

Keys come in JAX's two kinds: typed keys, `key(seed)` (dtype key<fry>, shape (); a
tessera._prng.PRNGKeyArray over the raw data, `key_data(k)`), and raw keys, `PRNGKey(seed)`
(uint32[2]). Every function takes either, and split and fold_in return the kind they were
given (jax/_src/random/core.py _check_prng_key, _return_prng_keys); their bits are the same.

Where this differs from jax.random: only the threefry2x32 implementation exists (impl= names
it or is None), and uniform's minval/maxval and truncated_normal's lower/upper are Python numbers, not
arrays. randint, permutation and choice are JAX's algorithms (jax/_src/random/core.py:
_randint, _shuffle, choice) composed from the SDK's ops, so their values are JAX's for the
same key for 32-bit dtypes (8- and 16-bit ones are sampled in int32 and converted, which JAX,
drawing as many bits as the dtype has, does not: their values differ from JAX's); randint and choice of 64-bit integers (jax_enable_x64) would need 64-bit random
bits, which Tessera does not draw; choice's mode='high' is not supported.
"""
from . import _tessera as _t
import math

import numpy as _np

from . import numpy as _jnp
from .numpy import _op, _tracer, _wrap, _enum, _float_dtype, _int_dtype, canonical_dtype
from ._array import Array
from ._trace import Tracer
from ._prng import PRNGKeyArray, IMPL as _IMPL, check_key_data


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


def _impl(impl, fn):
    if impl not in (None, _IMPL):
        raise ValueError(f"random.{fn}: unknown PRNG implementation {impl!r}; Tessera has only {_IMPL!r}")


def _raw(key, fn):
    """jax/_src/random/core.py _check_prng_key: the raw key data of `key` (typed or raw) as a
    Tracer; a typed key array of more than one key is refused, as every function takes one key."""
    if isinstance(key, PRNGKeyArray):
        if key.ndim:
            raise ValueError(f"{fn} accepts a single key, but was given a key array of shape {key.shape} != (). "
                             "Use jax.vmap for batching.")
        return _tracer(key._base)
    return _tracer(key)


def _like(key, raw):
    """_return_prng_keys: the new keys `raw` as the kind `key` was."""
    return PRNGKeyArray(raw) if isinstance(key, PRNGKeyArray) else raw


@_op
def PRNGKey(seed, impl=None):
    """jax.random.PRNGKey: the raw key of an integer seed (a Python int is an int32 first, as in
    JAX without jax_enable_x64; an int64 seed is bit-cast: [seed >> 32, seed & 0xFFFFFFFF])."""
    _impl(impl, "PRNGKey")
    if isinstance(seed, PRNGKeyArray):
        raise TypeError(f"PRNGKey accepts a scalar seed, but was given a key array of dtype {seed.dtype}")
    return _wrap(_t.random_key(_tracer(seed)._v))


def key(seed, impl=None):
    """jax.random.key: the typed key (dtype key<fry>, shape ()) of an integer seed; its data is
    PRNGKey(seed)."""
    _impl(impl, "key")
    if isinstance(seed, PRNGKeyArray):
        raise TypeError(f"key accepts a scalar seed, but was given a key array of dtype {seed.dtype}")
    return PRNGKeyArray(PRNGKey(seed))


def key_data(keys):
    """jax.random.key_data: the uint32[..., 2] data of typed keys; raw keys are their own."""
    if isinstance(keys, PRNGKeyArray):
        return keys._base
    check_key_data(keys)
    return keys


def wrap_key_data(key_bits_array, impl=None):
    """jax.random.wrap_key_data: the typed keys whose data is `key_bits_array` (uint32[..., 2];
    a numpy array is put on the default device first, as JAX puts it)."""
    _impl(impl, "wrap_key_data")
    if isinstance(key_bits_array, PRNGKeyArray):
        raise TypeError("random.wrap_key_data: the argument is a key array already; it takes uint32 key data")
    if not isinstance(key_bits_array, (Array, Tracer)):
        check_key_data(_np.asarray(key_bits_array))
        key_bits_array = _jnp.asarray(key_bits_array)
    check_key_data(key_bits_array)
    return PRNGKeyArray(key_bits_array)


@_op
def split(key, num=2):
    """jax.random.split: `num` new keys (or an array of keys of shape `num`): typed keys of a
    typed key, uint32[num, 2] of a raw one."""
    return _like(key, _wrap(_t.random_split(_raw(key, "split")._v, _shape(num, "random.split"))))


@_op
def fold_in(key, data):
    """jax.random.fold_in: a new key (of `key`'s kind) from `key` and an integer scalar;
    fold_in(k, i) == split(k, n)[i]."""
    return _like(key, _wrap(_t.random_fold_in(_raw(key, "fold_in")._v, _tracer(data)._v)))


@_op
def bits(key, shape=(), dtype=None):
    """jax.random.bits: uint32 words (the only width Tessera draws)."""
    if dtype is not None and canonical_dtype(dtype) != canonical_dtype("uint32"):
        raise ValueError(f"random.bits: dtype {dtype} is not supported; Tessera draws uint32 bits")
    return _wrap(_t.random_bits(_raw(key, "bits")._v, _shape(shape, "random.bits")))


@_op
def uniform(key, shape=(), dtype=None, minval=0.0, maxval=1.0):
    """jax.random.uniform in [minval, maxval) (float32 by default, float64 with jax_enable_x64)."""
    return _wrap(_t.random_uniform(_raw(key, "uniform")._v, _shape(shape, "random.uniform"), _dtype(dtype),
                                   _number(minval, "minval", "uniform"), _number(maxval, "maxval", "uniform")))


@_op
def normal(key, shape=(), dtype=None):
    """jax.random.normal: standard normal samples."""
    return _wrap(_t.random_normal(_raw(key, "normal")._v, _shape(shape, "random.normal"), _dtype(dtype)))


@_op
def truncated_normal(key, lower, upper, shape=None, dtype=None):
    """jax.random.truncated_normal on the open interval (lower, upper)."""
    return _wrap(_t.random_truncated_normal(_raw(key, "truncated_normal")._v,
                                            _number(lower, "lower", "truncated_normal"),
                                            _number(upper, "upper", "truncated_normal"),
                                            _shape(shape, "random.truncated_normal"), _dtype(dtype)))


@_op
def bernoulli(key, p=0.5, shape=None):
    """jax.random.bernoulli: bool samples that are True with probability p (p's shape by default)."""
    k = _raw(key, "bernoulli")
    pt = _tracer(p)
    return _wrap(_t.random_bernoulli(k._v, pt._v, tuple(pt.shape) if shape is None else _shape(shape, "random.bernoulli")))


@_op
def categorical(key, logits, axis=-1, shape=None):
    """jax.random.categorical: int32 indices along `axis` drawn with probabilities softmax(logits)."""
    if shape is not None:
        raise NotImplementedError("random.categorical: shape= is not supported; Tessera draws one sample per row")
    return _wrap(_t.random_categorical(_raw(key, "categorical")._v, _tracer(logits)._v, axis))


# ---- integers, permutations and choices: JAX's algorithms over the ops above ----------------

def _convert_and_clip_integer(x, dtype):
    """jax/_src/random/core.py _convert_and_clip_integer: x in `dtype`, clipped to the values
    both types represent (not wrapped)."""
    dtype = _np.dtype(dtype)
    if x.dtype == dtype:
        return x
    src, dst = _np.iinfo(x.dtype), _np.iinfo(dtype)
    lo, hi = max(src.min, dst.min), min(src.max, dst.max)
    if lo > src.min:
        x = _jnp.maximum(x, _full_like(x, lo))
    if hi < src.max:
        x = _jnp.minimum(x, _full_like(x, hi))
    return x.astype(dtype)


def _full_like(x, value):
    return _wrap(_t.full(list(x.shape), float(value), _enum(x.dtype)))


def _int_operand(v, name):
    """minval/maxval as a traced integer array (a Python int is JAX's default int; a float
    becomes it too, as _randint's astype(int))."""
    if isinstance(v, (int, _np.integer)) and not isinstance(v, bool):
        v = int(v)
        info = _np.iinfo(_int_dtype())
        if not info.min <= v <= info.max:
            # JAX: "Python int too large to convert to int32" (jnp.asarray without x64).
            raise OverflowError(f"random.randint: Python int {name}={v} too large to convert to {_int_dtype()}")
        return _wrap(_t.full([], float(v), _enum(_int_dtype())))
    t = _tracer(v)
    return t if t.dtype.kind in "iu" else t.astype(_int_dtype())


def _randint32(key, shape, minval, maxval, dtype):
    """jax/_src/random/core.py _randint for a 32-bit dtype: two words of bits per value, their
    remainders combined modulo the span in uint32 arithmetic."""
    try:
        bshape = _np.broadcast_shapes(shape, minval.shape, maxval.shape)
    except ValueError:
        bshape = None
    if bshape != shape:
        raise ValueError(f"randint parameter shapes must be broadcast-compatible with shape argument, and the "
                         f"result of broadcasting the shapes must equal the shape argument, but got result "
                         f"{bshape} for shape argument {shape}.")
    # Where maxval is above dtype's range (randint(key, shape, 0, 256, 'uint8') samples int32).
    maxval_out_of_range = maxval > _max_of(dtype, maxval.dtype)
    minval = _jnp.broadcast_to(_convert_and_clip_integer(minval, dtype), shape)
    maxval = _jnp.broadcast_to(_convert_and_clip_integer(maxval, dtype), shape)
    maxval_out_of_range = _jnp.broadcast_to(maxval_out_of_range, shape)
    k1, k2 = split(key)
    higher_bits, lower_bits = bits(k1, shape), bits(k2, shape)
    span = (maxval - minval).astype(_np.uint32)
    one = _full_like(span, 1)
    # span 1 where maxval <= minval, so minval is returned (JAX issue #222); one larger where
    # maxval was clipped (wrapping to 0 when it is 2**32: the remainders then change nothing).
    span = _jnp.where(maxval <= minval, one, span)
    span = _jnp.where(_jnp.logical_and(maxval_out_of_range, maxval > minval), span + one, span)
    # (a * b) % N == ((a % N) * (b % N)) % N: 2**32 % span from 2**16 % span.
    multiplier = _rem(_full_like(span, 2 ** 16), span)
    multiplier = _rem(multiplier * multiplier, span)
    offset = _rem(_rem(higher_bits, span) * multiplier + _rem(lower_bits, span), span)
    return minval + offset.astype(dtype)


def _max_of(dtype, like_dtype):
    """iinfo(dtype).max as a scalar of `like_dtype`, clipped to it (JAX's
    _convert_and_clip_integer(jnp.array(iinfo(dtype).max, dtype), maxval.dtype))."""
    return _wrap(_t.full([], float(min(_np.iinfo(dtype).max, _np.iinfo(like_dtype).max)), _enum(like_dtype)))


def _rem(x, y):
    return _wrap(_t.rem(x._v, y._v))


@_op
def randint(key, shape, minval, maxval, dtype=None):
    """jax.random.randint: integers in [minval, maxval) (int32 by default); minval and maxval
    are ints or integer arrays broadcasting to `shape`. JAX's modulus algorithm, bit for bit:
    two uint32 words per value, combined modulo maxval - minval (biased when that is not a power
    of two, as JAX documents); 8- and 16-bit dtypes are sampled in int32 and converted."""
    shape = _shape(shape, "random.randint")
    dtype = canonical_dtype(_int_dtype() if dtype is None else dtype)
    if dtype.kind not in "iu":
        raise TypeError(f"randint only accepts integer dtypes, got {dtype}")
    if dtype.itemsize == 8:
        raise NotImplementedError(f"random.randint: dtype {dtype} needs 64-bit random bits; Tessera draws "
                                  "uint32 words (use dtype='int32')")
    lo, hi = _int_operand(minval, "minval"), _int_operand(maxval, "maxval")
    if dtype.itemsize < 4:
        info = _np.iinfo(dtype)
        i32 = _np.dtype(_np.int32)
        lo = _convert_and_clip_integer(lo, i32)
        hi = _convert_and_clip_integer(hi, i32)
        lo = _jnp.minimum(_jnp.maximum(lo, _full_like(lo, info.min)), _full_like(lo, info.max))
        hi = _jnp.minimum(_jnp.maximum(hi, _full_like(hi, info.min)), _full_like(hi, info.max + 1))
        return _randint32(_raw(key, "randint"), shape, lo, hi, i32).astype(dtype)
    return _randint32(_raw(key, "randint"), shape, lo, hi, dtype)


def _shuffle(key, x, axis):
    """jax/_src/random/core.py _shuffle: ceil(3 ln(size) / ln(2**32 - 1)) rounds, each a stable
    sort of x along `axis` by fresh uint32 keys (lax.sort_key_val: here x taken along `axis` at
    the keys' stable argsort, so each lane of a many-dimensional x on its own)."""
    num_rounds = int(_np.ceil(3 * _np.log(max(1, x.size)) / _np.log(_np.iinfo(_np.uint32).max)))
    for _ in range(num_rounds):
        key, subkey = split(key)
        sort_keys = bits(subkey, x.shape)
        x = _jnp.take_along_axis(x, _jnp.argsort(sort_keys, axis=axis), axis=axis)
    return x


@_op
def _permutation(key, x, axis, independent):
    key = _raw(key, "permutation")
    if isinstance(x, int):
        return _shuffle(key, _jnp.arange(x, dtype=_int_dtype()), 0)
    x = _tracer(x)
    if independent or x.ndim == 1:
        return _shuffle(key, x, axis)
    ind = _shuffle(key, _jnp.arange(x.shape[axis], dtype=_int_dtype()), 0)
    return _jnp.take(x, ind, axis=axis)


def permutation(key, x, axis=0, independent=False):
    """jax.random.permutation: a shuffled arange(x) for an integer x, else x shuffled along
    `axis` (with independent=True each lane on its own). JAX's algorithm: sorts by random
    uint32 keys, bit for bit."""
    if isinstance(x, (int, _np.integer)) and not isinstance(x, bool):
        if axis not in (0, -1):
            raise ValueError(f"random.permutation: axis {axis} is out of bounds for arange({int(x)})")
        return _permutation(key, int(x), 0, independent)
    ndim = _np.ndim(x) if not hasattr(x, "ndim") else x.ndim
    if ndim == 0:
        raise TypeError("x must be an integer or at least 1-dimensional")
    if not -ndim <= axis < ndim:
        raise ValueError(f"random.permutation: axis {axis} is out of bounds for an array of {ndim} dimensions")
    return _permutation(key, x, axis % ndim, bool(independent))


def choice(key, a, shape=(), replace=True, p=None, axis=0, mode=None):
    """jax.random.choice: `shape` samples of arange(a) for an integer a, else of a's slices
    along `axis`, uniformly or with probabilities p; with replace=False no element twice.
    JAX's algorithms (randint indices or inverse-CDF draws with replacement; a permutation's
    first entries or the Gumbel top-k without), so JAX's values for the same key."""
    from collections.abc import Sequence
    if not isinstance(shape, Sequence):
        raise TypeError(f"shape argument of jax.random.choice must be a sequence, got {shape}")
    if mode not in (None, "low"):
        raise NotImplementedError(f"random.choice: mode {mode!r} is not supported (the default 'low' is)")
    shape = _shape(tuple(shape), "random.choice")
    scalar = isinstance(a, (int, _np.integer)) and not isinstance(a, bool)
    if not scalar and (_np.ndim(a) if not hasattr(a, "ndim") else a.ndim) == 0:
        raise TypeError(f"random.choice: a must be an int or an array of at least one dimension, not {a!r}")
    if scalar:
        n_inputs, a = int(a), int(a)
    else:
        if not hasattr(a, "shape"):
            a = _np.asarray(a)
        a_shape = tuple(a.shape)
        ndim = len(a_shape)
        if not -ndim <= axis < ndim:
            raise ValueError(f"random.choice: axis {axis} is out of bounds for an array of {ndim} dimensions")
        axis %= ndim
        n_inputs = a_shape[axis]
    n_draws = math.prod(shape)
    if n_draws == 0:
        return _jnp.zeros(shape, dtype=_int_dtype() if scalar else a.dtype)
    if n_inputs <= 0:
        raise ValueError("a must be greater than 0 unless no samples are taken")
    if not replace and n_draws > n_inputs:
        raise ValueError(f"Cannot take a larger sample (size {n_draws}) than population (size {n_inputs}) "
                         "when 'replace=False'")
    if p is not None:
        if (tuple(p.shape) if hasattr(p, "shape") else _np.shape(p)) != (n_inputs,):
            raise ValueError("p must be None or a 1D vector with the same size as a.shape[axis]. "
                             f"p has shape {_np.shape(p)} and a.shape[axis] is {n_inputs}.")
        return _choice_p(key, a, p, shape, bool(replace), axis, n_draws)
    return _choice(key, a, shape, bool(replace), axis, n_inputs, n_draws)


@_op
def _choice_p(key, a, p, shape, replace, axis, n_draws):
    """core.py choice with p: inverse-CDF sampling with replacement (jnp.searchsorted, here
    the count of cumsum(p) entries below each draw), the Gumbel top-k trick without."""
    key = _raw(key, "choice")
    arr = None if isinstance(a, int) else _tracer(a)
    p = _tracer(p)
    if p.dtype.kind != "f":
        p = p.astype(_float_dtype())
    if replace:
        p_cuml = _jnp.cumsum(p)
        r = p_cuml[-1] * (1 - uniform(key, shape, dtype=p.dtype))
        ind = _jnp.sum((p_cuml < _jnp.expand_dims(r, -1)).astype(_int_dtype()), axis=-1)
    else:
        tiny = float(_np.finfo(p.dtype).tiny)
        g = -_jnp.log(-_jnp.log(uniform(key, (p.shape[0],), dtype=p.dtype, minval=tiny, maxval=1.0))) + _jnp.log(p)
        ind = _wrap(_t.top_k(g._v, n_draws)[1]).astype(_int_dtype())
    result = ind if arr is None else _jnp.take(arr, ind, axis=axis)
    return _jnp.reshape(result, shape if arr is None else arr.shape[:axis] + tuple(shape) + arr.shape[axis + 1:])


@_op
def _choice(key, a, shape, replace, axis, n_inputs, n_draws):
    key = _raw(key, "choice")
    arr = None if isinstance(a, int) else _tracer(a)
    if replace:
        ind = randint(key, shape, 0, n_inputs)
        result = ind if arr is None else _jnp.take(arr, ind, axis=axis)
    else:
        perm = _permutation(key, n_inputs if arr is None else arr, axis, False)
        idx = (slice(None),) * axis + (slice(n_draws),)
        result = perm[idx]
    return _jnp.reshape(result, shape if arr is None else arr.shape[:axis] + tuple(shape) + arr.shape[axis + 1:])

"""jax.dtypes: the scalar types of extended dtypes (extended, prng_key: a key array's dtype is
a subdtype of both) and issubdtype, numpy's with them, as jax/_src/dtypes.py defines it:

    k = tessera.random.key(0)
    tessera.dtypes.issubdtype(k.dtype, tessera.dtypes.prng_key)   # True
    tessera.numpy.issubdtype(k.dtype, tessera.numpy.integer)      # False
    tessera.numpy.issubdtype(tessera.numpy.float32, tessera.numpy.floating)  # True
"""
import numpy as _np

from ._prng import KeyTy, extended, prng_key  # noqa: F401 (jax.dtypes.extended, prng_key)

__all__ = ["canonicalize_dtype", "extended", "issubdtype", "prng_key"]


def issubdtype(a, b):
    """Whether `a` is `b` or below it in numpy's type hierarchy (np.issubdtype), a key dtype
    being below prng_key, extended and np.generic only (jax/_src/dtypes.py
    _issubdtype_cached): a dtype, a scalar type or anything np.dtype takes on either side."""
    if isinstance(b, KeyTy):
        return isinstance(a, KeyTy) and a == b
    if isinstance(a, KeyTy):
        a = a.type
    a = a if isinstance(a, type) and issubclass(a, _np.generic) else _np.dtype(a).type
    if isinstance(b, type) and issubclass(b, extended):
        return issubclass(a, b)
    b = b if isinstance(b, type) and issubclass(b, _np.generic) else _np.dtype(b).type
    return bool(_np.issubdtype(a, b))


def canonicalize_dtype(dtype):
    """jax.dtypes.canonicalize_dtype: a key dtype is itself; another JAX's canonical dtype
    (64-bit ones 32-bit unless jax_enable_x64)."""
    if isinstance(dtype, KeyTy):
        return dtype
    from .numpy import canonical_dtype
    return canonical_dtype(dtype)

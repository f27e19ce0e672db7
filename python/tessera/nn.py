"""tessera.nn: jax.nn's functions the SDK has (tessera/nn.h), under jax.nn's names."""
from . import _tessera as _t
from . import errors as _errors
from .numpy import _op, _tracer, _wrap, _enum, tanh  # noqa: F401
from .lax import logistic as sigmoid  # noqa: F401 (jax.nn.sigmoid is lax.logistic)


def _unary(name):
    cpp = getattr(_t, name)

    @_op
    def f(x):
        return _wrap(cpp(_tracer(x)._v))

    f.__name__ = name
    return f


relu = _unary("relu")
silu = swish = _unary("silu")


@_op
def gelu(x, approximate=True):
    return _wrap(_t.gelu(_tracer(x)._v, approximate))


@_op
def softmax(x, axis=-1):
    return _wrap(_t.softmax(_tracer(x)._v, axis))


@_op
def log_softmax(x, axis=-1):
    return _wrap(_t.log_softmax(_tracer(x)._v, axis))


@_op
def logsumexp(a, axis=-1, keepdims=False):
    return _wrap(_t.logsumexp(_tracer(a)._v, axis, keepdims))


@_op
def _one_hot_last(x, num_classes, dtype):
    return _wrap(_t.one_hot(_tracer(x)._v, num_classes, _enum(dtype)))


def one_hot(x, num_classes, dtype="float32", *, axis=-1, out_sharding=None):
    """jax.nn.one_hot: the classes along `axis` of the result (the last by default). With
    out_sharding (a NamedSharding, or a P on the explicit or ambient mesh) the result is laid
    out so; as JAX's _one_hot (jax/_src/nn/functions.py) its spec without the classes' entry
    must be x's ("The input part of spec in out_sharding should match the spec of `x`"), and
    unreduced or reduced axes are NotImplementedError. Composed: the one-hot encoding, moved to
    `axis`, then resharded onto out_sharding."""
    import numpy as np
    from .numpy import transpose
    from .sharding import NamedSharding, reshard
    from ._api import typeof
    out_axis = int(axis)
    n = (x.ndim if hasattr(x, "ndim") else np.ndim(x)) + 1
    if not -n <= out_axis < n:
        raise ValueError(f"one_hot: axis {axis} is out of bounds for a result of rank {n}")
    out_axis %= n
    spec = None
    if out_sharding is not None:
        spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
        if spec.unreduced or spec.reduced:
            raise NotImplementedError("jax.nn.one_hot: out_sharding with unreduced or reduced axes")
        entries = list(spec) + [None] * (n - len(spec))
        x_part = tuple(entries[:out_axis] + entries[out_axis + 1:])
        x_spec = typeof(x).sharding.spec
        x_entries = tuple(list(x_spec) + [None] * (n - 1 - len(x_spec)))
        if x_part != x_entries:
            raise _errors.InvalidArgumentError(
                "The input part of spec in out_sharding should match the spec of `x`. Got "
                f"typeof(x).spec={x_spec} and out_sharding.spec={type(spec)(*x_part)}")
    out = _one_hot_last(x, num_classes, dtype)
    if out_axis != n - 1:
        perm = list(range(n - 1))
        perm.insert(out_axis, n - 1)
        out = transpose(out, perm)
    return out if out_sharding is None else reshard(out, out_sharding)


@_op
def dot_product_attention(query, key, value, mask=None, *, is_causal=False, scale=None):
    m = None if mask is None else _tracer(mask)._v
    return _wrap(_t.dot_product_attention(_tracer(query)._v, _tracer(key)._v, _tracer(value)._v, m, is_causal, scale))

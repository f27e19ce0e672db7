"""tessera.nn: jax.nn's functions the SDK has (tessera/nn.h), under jax.nn's names."""
from . import _tessera as _t
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
def one_hot(x, num_classes, dtype="float32"):
    return _wrap(_t.one_hot(_tracer(x)._v, num_classes, _enum(dtype)))


@_op
def dot_product_attention(query, key, value, mask=None, *, is_causal=False, scale=None):
    m = None if mask is None else _tracer(mask)._v
    return _wrap(_t.dot_product_attention(_tracer(query)._v, _tracer(key)._v, _tracer(value)._v, m, is_causal, scale))

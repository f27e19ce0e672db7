"""tessera.numpy: the jax.numpy subset the SDK's ops cover, with jnp's names, broadcasting,
dtype promotion (JAX's lattice, Python scalars weakly typed), operators and indexing with
slices. Inside a traced function (jit, grad, shard_map) each call records the SDK's op; on
Arrays outside one it runs as a small jitted program, as JAX dispatches ops one by one;
creation functions (zeros, ones, arange, ...) outside a trace return numpy arrays of JAX's
default dtypes, which device_put and jit take as they are.

    import tessera.numpy as jnp
    f = tessera.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=1))
"""
import builtins
import collections.abc
import functools
import operator

import numpy as _np

from . import _tessera as _t
from ._array import Array
from ._config import config as _config
from . import _trace
from ._trace import Tracer, in_trace
from ._prng import PRNGKeyArray, check_key_conversion, refuse_operands, refuse_power
from .dtypes import issubdtype  # noqa: F401 (jnp.issubdtype)

float32, float64, int32, int64 = _np.float32, _np.float64, _np.int32, _np.int64
float16, int8, uint8, int16, uint32 = _np.float16, _np.int8, _np.uint8, _np.int16, _np.uint32
bool_ = _np.bool_
# numpy's scalar type hierarchy, which jnp exports for issubdtype (jax/_src/dtypes.py's).
generic, number, inexact, floating, complexfloating = _np.generic, _np.number, _np.inexact, _np.floating, \
    _np.complexfloating
integer, signedinteger, unsignedinteger = _np.integer, _np.signedinteger, _np.unsignedinteger
newaxis = None
pi, e, inf, nan = _np.pi, _np.e, _np.inf, _np.nan
ndarray = Array

_DTYPES = {_np.dtype(_np.float32): _t.DType.float32, _np.dtype(_np.float64): _t.DType.float64,
           _np.dtype(_np.int32): _t.DType.int32, _np.dtype(_np.int64): _t.DType.int64,
           _np.dtype(_np.bool_): _t.DType.bool, _np.dtype(_np.float16): _t.DType.float16,
           _np.dtype(_np.int8): _t.DType.int8, _np.dtype(_np.uint8): _t.DType.uint8,
           _np.dtype(_np.int16): _t.DType.int16, _np.dtype(_np.uint32): _t.DType.uint32}


def canonical_dtype(dtype):
    """JAX's dtype for `dtype`: 64-bit types become 32-bit ones unless jax_enable_x64; float16,
    int8, uint8 and int16 stay as they are (jax.dtypes.canonicalize_dtype)."""
    d = _np.dtype(dtype)
    x64 = _config.jax_enable_x64
    if d.kind == "b":
        return _np.dtype(_np.bool_)
    if d in (_np.dtype(_np.float16), _np.dtype(_np.int8), _np.dtype(_np.uint8), _np.dtype(_np.int16),
             _np.dtype(_np.uint32)):
        return d
    if d == _np.dtype(_np.uint64) and not x64:
        return _np.dtype(_np.uint32)
    if d.kind == "i":
        return _np.dtype(_np.int64 if x64 and d.itemsize == 8 else _np.int32)
    if d.kind == "f":
        return _np.dtype(_np.float64 if x64 and d.itemsize == 8 else _np.float32)
    raise TypeError(f"dtype {d} is not supported by Tessera (float32, float64, int32, int64, bool, float16, "
                    "int8, uint8, int16, uint32)")


def _enum(dtype):
    return _DTYPES[canonical_dtype(dtype)]


def promote_types(a, b):
    """jnp.promote_types: the join on JAX's lattice (float16 with int32 is float16, not numpy's
    float64; int8 with uint8 is int16)."""
    return _np.dtype(_t.numpy_dtype(_t.promote_types(_enum(a), _enum(b))))


def _float_dtype():
    return _np.dtype(_np.float64 if _config.jax_enable_x64 else _np.float32)


def _int_dtype():
    return _np.dtype(_np.int64 if _config.jax_enable_x64 else _np.int32)


def _is_scalar(x):
    return isinstance(x, (bool, int, float)) and not isinstance(x, Tracer)


# ---- conversion of operands to traced values -------------------------------------------

def _full(shape, value, dtype):
    return Tracer(_t.full(list(shape), float(value), _enum(dtype)))


def _weak_dtype(value, other):
    """The dtype a Python scalar takes next to an array of dtype `other` (JAX's weak typing)."""
    k = other.kind
    if isinstance(value, bool):
        return other
    if isinstance(value, int):
        return other if k in "iuf" else _int_dtype()
    return other if k == "f" else _float_dtype()


def _tracer(x, like=None):
    """x as a Tracer: Tracers as they are; Python scalars weakly typed next to `like`; numpy
    scalars strongly typed. Concrete arrays cannot be constants of a traced function."""
    if isinstance(x, Tracer):
        return x
    if isinstance(x, PRNGKeyArray):
        # JAX's jnp functions refuse key<fry> ("add does not accept dtype key<fry>").
        raise TypeError(f"a key array (dtype {x.dtype}) is not a numeric array: jax.numpy functions do not "
                        "accept it (jax.random.key_data(k) is its uint32 data)")
    if _is_scalar(x):
        if like is not None:
            return _full((), x, _weak_dtype(x, like.dtype))
        dt = _np.dtype(_np.bool_) if isinstance(x, bool) else _int_dtype() if isinstance(x, int) else _float_dtype()
        return _full((), x, dt)
    if isinstance(x, (_np.generic, _np.ndarray, Array)) and _np.ndim(x) == 0:
        # A 0-d Array (jnp.array(1e-5) closed over) is fetched once and embedded, as a numpy scalar.
        v = _np.asarray(x)
        return _full((), v.item(), canonical_dtype(v.dtype))
    scope = _trace.capture_scope()
    if scope is not None and isinstance(x, (_np.ndarray, Array)):
        # Closed over by a jitted function: one of its jit's captured arguments (a stand-in of
        # its type until the jit has traced again with it; see _api.Captures).
        t = scope.tracer(x)
        return t if t is not None else _full(_np.shape(x), 0, canonical_dtype(x.dtype))
    raise TypeError(f"a {type(x).__name__} of shape {_np.shape(x)} used inside a traced function outside jit: Tessera "
                    "traces no array constants there; pass it as an argument, or trace under tessera.jit, which "
                    "captures the arrays a function closes over")


def _pair(x, y):
    if isinstance(x, Tracer):
        return x, _tracer(y, x)
    y = _tracer(y)
    return _tracer(x, y), y


def _wrap(v):
    return Tracer(v)


# ---- eager dispatch: ops on Arrays outside a trace run as jitted programs ----------------

def _has_array(tree):
    from .tree_util import data_leaves  # a typed key array is its data
    return builtins.any(isinstance(l, (Array, _np.ndarray)) for l in data_leaves(tree))


def _has_tracer(tree):
    from .tree_util import data_leaves
    return builtins.any(isinstance(l, Tracer) for l in data_leaves(tree))


def _op(fn):
    """Makes `fn` (written on Tracers) usable on Arrays and numpy arrays outside a trace too."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if in_trace() or _has_tracer((args, kwargs)):
            return fn(*args, **kwargs)
        if not _has_array((args, kwargs)):
            # Only Python scalars (jnp.sqrt(2)): JAX makes them arrays on the default device.
            args = tuple(_np.asarray(a, canonical_dtype(_np.asarray(a).dtype)) if _is_scalar(a) else a for a in args)
        from ._api import _eager
        return _eager(fn, args, kwargs)

    return wrapper


# ---- elementwise ------------------------------------------------------------------------

def _unary(name, cast_float=False):
    cpp = getattr(_t, name)

    @_op
    def f(x):
        if isinstance(x, PRNGKeyArray):
            refuse_operands(_JNP_NAMES.get(name, name), x)  # (JAX's words for jnp.negative and the others)
        x = _tracer(x)
        if cast_float and x.dtype.kind != "f":
            x = x.astype(_float_dtype())
        return _wrap(cpp(x._v))

    f.__name__ = name
    return f


negative = _unary("neg")
abs = absolute = _unary("abs")
sign = _unary("sign")
floor = _unary("floor")
ceil = _unary("ceil")
exp = _unary("exp", True)
log = _unary("log", True)
tanh = _unary("tanh", True)
sqrt = _unary("sqrt", True)
sin = _unary("sin", True)
cos = _unary("cos", True)
_rsqrt = _unary("rsqrt", True)
_logistic = _unary("logistic", True)
_erf = _unary("erf", True)


@_op
def logical_not(x):
    if isinstance(x, PRNGKeyArray):
        refuse_operands("logical_not", x)  # ufuncs.py _to_bool: np.array(0, key dtype) first
    x = _tracer(x)
    if x.dtype.kind != "b":
        x = x != 0
    return _wrap(_t.logical_not(x._v))


_SCALAR_OPS = {"add": "add", "sub": "sub", "mul": "mul", "truediv": "truediv"}
# jnp's names of the SDK's binary ops (check_for_prngkeys names the jnp function).
_JNP_NAMES = {"sub": "subtract", "mul": "multiply", "truediv": "true_divide", "eq": "equal", "ne": "not_equal",
              "lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal", "pow": "power",
              "neg": "negative", "abs": "absolute"}


def _binary(name):
    cpp = getattr(_t, name)

    @_op
    def f(x, y):
        if isinstance(x, PRNGKeyArray) or isinstance(y, PRNGKeyArray):
            if name in ("eq", "ne") and isinstance(x, PRNGKeyArray) and isinstance(y, PRNGKeyArray):
                return x == y if name == "eq" else x != y  # keys compare (JnpWithKeyArrayTest test_equality)
            refuse_operands(_JNP_NAMES.get(name, name), x, y)
        # Arithmetic with a Python scalar: the SDK's weakly typed scalar overloads.
        if name in _SCALAR_OPS and isinstance(x, Tracer) != isinstance(y, Tracer):
            t, s, rev = (x, y, False) if isinstance(x, Tracer) else (y, x, True)
            if isinstance(s, bool):
                s = int(s)
            if isinstance(s, int):
                return _wrap(_t.scalar_op_int(name, t._v, s, rev))
            if isinstance(s, float):
                return _wrap(_t.scalar_op(name, t._v, s, rev))
        a, b = _pair(x, y)
        return _wrap(cpp(a._v, b._v))

    f.__name__ = name
    return f


add = _binary("add")
subtract = _binary("sub")
multiply = _binary("mul")
true_divide = divide = _binary("truediv")
maximum = _binary("maximum")
minimum = _binary("minimum")
equal = _binary("eq")
not_equal = _binary("ne")
less = _binary("lt")
less_equal = _binary("le")
greater = _binary("gt")
greater_equal = _binary("ge")
_pow = _binary("pow")


@_op
def power(x, y):
    if isinstance(x, PRNGKeyArray) or isinstance(y, PRNGKeyArray):
        refuse_power(x, y)
    if isinstance(x, Tracer) and isinstance(y, int) and not isinstance(y, bool) and y >= 0 and y <= 4:
        # lax.integer_pow, as JAX lowers x ** 2: repeated multiplication, exact for integers.
        out = ones_like(x)
        for _ in range(y):
            out = out * x
        return out
    return _pow(x, y)


def _logical(name):
    cpp = getattr(_t, name)

    @_op
    def f(x, y):
        if isinstance(x, PRNGKeyArray) or isinstance(y, PRNGKeyArray):
            refuse_operands(name, x, y)  # promote_args, then _to_bool's np.array(0, key dtype)
        a, b = _pair(x, y)
        if a.dtype.kind != "b":
            a = a != 0
        if b.dtype.kind != "b":
            b = b != 0
        return _wrap(cpp(a._v, b._v))

    f.__name__ = name
    return f


logical_and = _logical("logical_and")
logical_or = _logical("logical_or")


@_op
def where(condition, x, y):
    c = _tracer(condition)
    if c.dtype.kind != "b":
        c = c != 0
    if isinstance(x, PRNGKeyArray) or isinstance(y, PRNGKeyArray):
        # Keys are selected as their data, the condition over the key dimensions (random_test.py
        # test_select); a key and a number are check_for_prngkeys' TypeError.
        if not (isinstance(x, PRNGKeyArray) and isinstance(y, PRNGKeyArray)):
            refuse_operands("where", x, y)
        return PRNGKeyArray(where(expand_dims(c, -1), x._base, y._base))
    a, b = _pair(x, y)
    return _wrap(_t.where(c._v, a._v, b._v))


def square(x):
    if isinstance(x, PRNGKeyArray):
        refuse_operands("square", x)  # promote_dtypes_numeric first (ufuncs.py square)
    return multiply(x, x)


def reciprocal(x):
    return divide(1.0, x)


def clip(x, min=None, max=None):
    if min is not None:
        x = maximum(x, min)
    if max is not None:
        x = minimum(x, max)
    return x


# ---- shapes -----------------------------------------------------------------------------

@_op
def astype(x, dtype):
    x = _tracer(x)
    return _wrap(_t.convert(x._v, _enum(dtype)))


def _norm_shape(shape, size):
    shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
    if shape.count(-1) == 1:
        known = int(_np.prod([d for d in shape if d != -1], dtype=_np.int64))
        shape = tuple(size // known if d == -1 and known else d for d in shape)
    return shape


@_op
def _reshape(a, shape, order="C"):
    if order != "C":
        raise NotImplementedError("reshape: only order='C'")
    a = _tracer(a)
    return _wrap(_t.reshape(a._v, list(_norm_shape(shape, a.size))))


def reshape(a, shape, order="C", *, out_sharding=None):
    """jnp.reshape; out_sharding lays the result out (a NamedSharding, or a P on the explicit
    or ambient mesh), as explicit mode needs when a split dimension is split or merged."""
    if out_sharding is None:
        return _reshape(a, shape, order)
    if order != "C":
        raise NotImplementedError("reshape: only order='C'")
    return _with_out_sharding("reshape", (a,), out_sharding, lambda v, spec, mesh: _t.reshape(
        v[0], list(_norm_shape(shape, Tracer(v[0]).size)), spec, mesh))


def ravel(a, order="C", *, out_sharding=None):
    """jnp.ravel; out_sharding lays the flat result out (a NamedSharding, or a P on the explicit
    or ambient mesh), as jnp.ravel's (jax/_src/numpy/lax_numpy.py): merging split dimensions
    needs one in explicit mode, as reshape does."""
    return reshape(a, (-1,), order, out_sharding=out_sharding)


@_op
def transpose(a, axes=None):
    if isinstance(a, PRNGKeyArray):  # over the key dimensions (random_test.py test_transpose)
        return a.transpose(axes)
    a = _tracer(a)
    axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(d % a.ndim for d in axes)
    return _wrap(_t.transpose(a._v, list(axes)))


def swapaxes(a, axis1, axis2):
    if isinstance(a, PRNGKeyArray):
        return a.swapaxes(axis1, axis2)
    perm = list(range(_np.ndim(a) if not isinstance(a, (Tracer, Array)) else a.ndim))
    perm[axis1], perm[axis2] = perm[axis2], perm[axis1]
    return transpose(a, perm)


@_op
@_op
def expand_dims(a, axis):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if isinstance(a, PRNGKeyArray):  # axes of the key dimensions (JnpWithKeyArrayTest test_expand_dims)
        ndim = a.ndim + len(axes)
        return PRNGKeyArray(expand_dims(a._base, tuple(_normalize_axis(d, ndim) for d in axes)))
    a = _tracer(a)
    ndim = a.ndim + len(axes)
    for ax in sorted(d % ndim for d in axes):
        a = _wrap(_t.expand_dims(a._v, ax))
    return a


@_op
def squeeze(a, axis=None):
    a = _tracer(a)
    axes = [] if axis is None else [axis] if isinstance(axis, int) else list(axis)
    return _wrap(_t.squeeze(a._v, axes))


@_op
def _broadcast_to(array, shape):
    if isinstance(array, PRNGKeyArray):  # over the key dimensions (JnpWithKeyArrayTest test_broadcast_to)
        return PRNGKeyArray(_broadcast_to(array._base, (*shape, 2)))
    a = _tracer(array)
    return _wrap(_t.broadcast_to(a._v, list(shape)))


def broadcast_to(array, shape, *, out_sharding=None):
    """jnp.broadcast_to; out_sharding lays the result out (a NamedSharding, or a P on the
    explicit or ambient mesh), as JAX's broadcast_in_dim rule returns it."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if out_sharding is None:
        return _broadcast_to(array, shape)
    return _with_out_sharding("broadcast_to", (array,), out_sharding,
                              lambda v, spec, mesh: _t.broadcast_to(v[0], list(shape), spec, mesh))


def _normalize_axis(axis, ndim):
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of bounds for a key array of {ndim} dimensions")
    return axis % ndim


def _all_keys(arrays):
    """Whether `arrays` are typed key arrays (jnp.concatenate and stack join their data)."""
    return bool(arrays) and builtins.all(isinstance(a, PRNGKeyArray) for a in arrays)


@_op
def concatenate(arrays, axis=0):
    if _all_keys(arrays):
        return PRNGKeyArray(concatenate([a._base for a in arrays], _normalize_axis(axis, arrays[0].ndim)))
    ts = [_tracer(a) for a in arrays]
    dt = functools.reduce(promote_types, [t.dtype for t in ts])
    ts = [t if t.dtype == dt else t.astype(dt) for t in ts]
    return _wrap(_t.concatenate([t._v for t in ts], axis))


@_op
def stack(arrays, axis=0):
    if _all_keys(arrays):
        return PRNGKeyArray(stack([a._base for a in arrays], _normalize_axis(axis, arrays[0].ndim + 1)))
    return concatenate([expand_dims(a, axis) for a in arrays], axis)


# ---- reductions -------------------------------------------------------------------------

def _axes(axis):
    return [] if axis is None else [axis] if isinstance(axis, int) else list(axis)


def _reduction(name, int_to="int", float_only=False):
    cpp = getattr(_t, name)

    @_op
    def f(a, axis=None, keepdims=False, dtype=None):
        a = _tracer(a)
        if dtype is not None:
            a = a.astype(dtype)
        elif float_only and a.dtype.kind != "f":
            a = a.astype(_float_dtype())
        elif a.dtype.kind == "b" and int_to == "int":
            a = a.astype(_int_dtype())
        return _wrap(cpp(a._v, _axes(axis), bool(keepdims)))

    f.__name__ = name
    return f


sum = _reduction("sum")
prod = _reduction("prod")
max = amax = _reduction("max", int_to=None)
min = amin = _reduction("min", int_to=None)
mean = _reduction("mean", float_only=True)


def var(a, axis=None, keepdims=False):
    m = mean(a, axis=axis, keepdims=True)
    d = a - m
    return mean(d * d, axis=axis, keepdims=keepdims)


def std(a, axis=None, keepdims=False):
    return sqrt(var(a, axis=axis, keepdims=keepdims))


def _arg_reduction(name):
    cpp = getattr(_t, name)

    @_op
    def f(a, axis=None, keepdims=False):
        a = _tracer(a)
        if axis is None:
            a, axis = reshape(a, (-1,)), 0
        out = _wrap(cpp(a._v, axis, _enum(_int_dtype())))
        return expand_dims(out, axis) if keepdims else out

    f.__name__ = name
    return f


argmax = _arg_reduction("argmax")  # the first index of the maximum (the first NaN), as jnp
argmin = _arg_reduction("argmin")


@_op
def _scan(name, a, axis, reverse=False):
    """lax's cumulative reduction `name`; axis None scans the flattened array (jnp)."""
    a = _tracer(a)
    if axis is None:
        a, axis = reshape(a, (-1,)), 0
    return _wrap(getattr(_t, name)(a._v, axis, reverse))


def cumsum(a, axis=None):
    return _scan("cumsum", a, axis)


def cumprod(a, axis=None):
    return _scan("cumprod", a, axis)


@_op
def tril(m, k=0):
    return _wrap(_t.tril(_tracer(m)._v, k))


@_op
def triu(m, k=0):
    return _wrap(_t.triu(_tracer(m)._v, k))


@_op
def pad(array, pad_width, mode="constant", constant_values=0):
    """jnp.pad's constant mode: pad_width an int, (before, after) or one pair per dimension."""
    if mode != "constant":
        raise NotImplementedError(f"jnp.pad: mode '{mode}' is not supported (only 'constant')")
    a = _tracer(array)
    widths = _np.broadcast_to(_np.asarray(pad_width, dtype=_np.int64), (len(a.shape), 2))
    return _wrap(_t.pad(a._v, _tracer(constant_values, a).astype(a.dtype)._v, [(int(lo), int(hi), 0) for lo, hi in widths]))


@_op
def argsort(a, axis=-1, descending=False):
    return _wrap(_t.argsort(_tracer(a)._v, axis, descending))


@_op
def sort(a, axis=-1):
    a = _tracer(a)
    if axis not in (-1, len(a.shape) - 1):
        raise NotImplementedError("jnp.sort: only the last axis is supported")
    return _wrap(_t.sort(a._v))


@_op
def _einsum(subscripts, a, b):
    return _wrap(_t.einsum(subscripts, _tracer(a)._v, _tracer(b)._v))


def _with_out_sharding(api, args, out_sharding, traced):
    """fn(*args) laid out by out_sharding (a NamedSharding, or a P on the explicit or ambient
    mesh): `traced(tracers, spec, mesh)` inside a trace, a jitted call of it outside. `api`
    names the op in errors."""
    if not (in_trace() or _has_tracer(args)):
        from ._api import jit
        return jit(lambda *xs: _with_out_sharding(api, xs, out_sharding, traced))(*args)
    return _wrap(traced([_tracer(a)._v for a in args], *_spec_and_mesh(api, out_sharding)))


def _spec_and_mesh(api, out_sharding):
    """out_sharding's spec and mesh for the SDK: a NamedSharding's own, or a P's ambient mesh
    (None: the trace's explicit mesh, or the SDK's error naming the missing mesh). Under
    use_abstract_mesh the spec is checked against its axis types (the SDK checks the trace's
    own otherwise)."""
    from .sharding import Mesh, NamedSharding, _ambient_mesh, _check_in_force
    if isinstance(out_sharding, NamedSharding):
        # A type's sharding (typeof(x).sharding) is on an abstract mesh: the trace's own.
        spec, mesh = out_sharding.spec, out_sharding.mesh if isinstance(out_sharding.mesh, Mesh) else None
    else:
        spec, mesh = out_sharding, _ambient_mesh()
    _check_in_force(api, spec)
    return spec._cpp(), None if mesh is None else mesh._cpp


def _created(name, out_sharding, host, traced):
    """A creation function's result laid out by out_sharding (a NamedSharding, or a P on the
    explicit or ambient mesh): `traced(spec, mesh)` (a Value) in a trace; outside, `host()`
    placed so, committed, as JAX's (tests/pjit_test.py test_jnp_zeros_out_sharding)."""
    if in_trace():
        return _wrap(traced(*_spec_and_mesh(name, out_sharding)))
    from .sharding import _as_named, _explicit_only
    from ._api import _put_numpy
    return _put_numpy(host(), _explicit_only(_as_named(out_sharding, name), name))


def einsum(subscripts, a, b, out_sharding=None):
    """jnp.einsum of two operands with an explicit '->' output (one dot_general). out_sharding
    lays the result out (explicit mode needs it when a contracted dimension is split on both
    operands: P('X', 'Y') reduce-scatters the sum, P('X', None) all-reduces it)."""
    if out_sharding is None:
        return _einsum(subscripts, a, b)
    return _with_out_sharding("einsum", (a, b), out_sharding,
                              lambda v, spec, mesh: _t.einsum(subscripts, v[0], v[1], spec, mesh))


# ---- contractions -----------------------------------------------------------------------

def _same_dtype(a, b):
    a, b = _pair(a, b)
    dt = promote_types(a.dtype, b.dtype)
    return (a if a.dtype == dt else a.astype(dt)), (b if b.dtype == dt else b.astype(dt))


@_op
def _matmul(a, b):
    a, b = _same_dtype(a, b)
    return _wrap(_t.matmul(a._v, b._v))


def matmul(a, b, out_sharding=None):
    """jnp.matmul; out_sharding as einsum's."""
    if out_sharding is None:
        return _matmul(a, b)

    def traced(v, spec, mesh):
        x, y = _same_dtype(Tracer(v[0]), Tracer(v[1]))
        return _t.matmul(x._v, y._v, spec, mesh)

    return _with_out_sharding("matmul", (a, b), out_sharding, traced)


@_op
def dot(a, b):
    a, b = _same_dtype(a, b)
    if a.ndim == 0 or b.ndim == 0:
        return a * b
    if a.ndim > 2 or b.ndim > 2:  # jnp.dot: contract a's last with b's second to last
        return dot_general_(a, b, ((a.ndim - 1,), (b.ndim - 2 if b.ndim > 1 else 0,)), ((), ()))
    return _wrap(_t.matmul(a._v, b._v))


def dot_general_(lhs, rhs, contracting, batch):
    lhs, rhs = _same_dtype(lhs, rhs)
    return _wrap(_t.dot_general(lhs._v, rhs._v, list(contracting[0]), list(contracting[1]),
                                list(batch[0]), list(batch[1])))


# ---- creation ---------------------------------------------------------------------------

def _creation_dtype(dtype, default):
    return canonical_dtype(default if dtype is None else dtype)


def full(shape, fill_value, dtype=None, *, out_sharding=None):
    """jnp.full; out_sharding lays the result out (a NamedSharding, or a P on the explicit or
    ambient mesh), committed to it outside a trace."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype is None:
        dtype = _np.asarray(fill_value).dtype
    dt = canonical_dtype(dtype)
    if out_sharding is not None:
        return _created("full", out_sharding, lambda: _np.full(shape, fill_value, dtype=dt),
                        lambda spec, mesh: _t.full(list(shape), float(fill_value), _enum(dt), spec, mesh))
    if in_trace():
        return _full(shape, fill_value, dt)
    return _device(_np.full(shape, fill_value, dtype=dt))


def _device(host):
    """A creation function's result outside a trace: an uncommitted Array on device 0, as
    JAX's (jit and shard_map move it to their arguments' mesh)."""
    from ._api import _uncommitted_array
    return _uncommitted_array(host)


def zeros(shape, dtype=None, *, out_sharding=None):
    return full(shape, 0, _creation_dtype(dtype, _float_dtype()), out_sharding=out_sharding)


def ones(shape, dtype=None, *, out_sharding=None):
    return full(shape, 1, _creation_dtype(dtype, _float_dtype()), out_sharding=out_sharding)


def full_like(a, fill_value, dtype=None, shape=None, *, out_sharding=None):
    """jnp.full_like. Of a committed Array (its shape kept), the result has a's sharding, as
    lax.full_like documents ("the output will have the same sharding as the input"; an
    uncommitted input gets the default placement); out_sharding as full's."""
    shape = a.shape if shape is None else ((shape,) if isinstance(shape, int) else tuple(shape))
    if isinstance(a, PRNGKeyArray) and (dtype is None or dtype == a.dtype) and out_sharding is None:
        # Keys over data of fill_value's words, or a key fill_value's data broadcast (prng.py
        # KeyTyRules.full; random_test.py JnpWithKeyArrayTest test_full_like,
        # test_full_like_with_key_fillvalue). lax.full_like hands a key dtype to KeyTyRules.full
        # before it looks at a's sharding, and that calls lax.full without one: the default
        # placement, not a's (jax/_src/lax/lax.py full_like). threefry's key data is (*shape, 2).
        if isinstance(fill_value, PRNGKeyArray):
            return PRNGKeyArray(broadcast_to(fill_value._base, (*shape, 2)))
        return PRNGKeyArray(full((*shape, 2), fill_value, _np.uint32))
    dtype = a.dtype if dtype is None else dtype
    if out_sharding is not None:
        return full(shape, fill_value, dtype, out_sharding=out_sharding)
    if isinstance(a, Array) and a._committed and tuple(shape) == a.shape and not in_trace():
        from ._api import _put_numpy
        return _put_numpy(_np.full(shape, fill_value, dtype=canonical_dtype(dtype)), a.sharding)
    return full(shape, fill_value, dtype)


def zeros_like(a, dtype=None, shape=None, *, out_sharding=None):
    return full_like(a, 0, dtype, shape, out_sharding=out_sharding)


def ones_like(a, dtype=None, shape=None, *, out_sharding=None):
    return full_like(a, 1, dtype, shape, out_sharding=out_sharding)


def arange(start, stop=None, step=1, dtype=None, *, out_sharding=None):
    """jnp.arange; out_sharding as full's (an iota made laid out so in a trace)."""
    if stop is None:
        start, stop = 0, start
    if dtype is None:
        dtype = _np.result_type(*(type(v) for v in (start, stop, step)))
    dt = canonical_dtype(dtype)
    n = builtins.max(0, int(_np.ceil((stop - start) / step)))
    if out_sharding is not None:
        out = _created("arange", out_sharding, lambda: _np.arange(start, stop, step).astype(dt),
                       lambda spec, mesh: _t.iota(_enum(dt), [n], 0, spec, mesh))
        if not in_trace():
            return out
    elif not in_trace():
        return _device(_np.arange(start, stop, step).astype(dt))
    else:
        out = Tracer(_t.iota(_enum(dt), [n], 0))
    return out * step + start if (step != 1 or start != 0) else out


def eye(N, M=None, dtype=None):
    M = N if M is None else M
    dt = _creation_dtype(dtype, _float_dtype())
    if not in_trace():
        return _device(_np.eye(N, M, dtype=dt))
    i = Tracer(_t.iota(_t.DType.int32, [N, M], 0))
    j = Tracer(_t.iota(_t.DType.int32, [N, M], 1))
    return (i == j).astype(dt)


def array(x, dtype=None):
    if isinstance(x, PRNGKeyArray) and dtype is None:
        return x  # random_test.py test_array: keys are their own array
    if dtype is not None and check_key_conversion(x, dtype):
        # test_array_user_dtype: keys of their own dtype are themselves; another dtype is
        # lax.convert_element_type's ValueError (test_errors).
        return x
    if isinstance(x, (Tracer, Array)):
        return x if dtype is None else astype(x, dtype)
    host = _np.asarray(x)
    dt = canonical_dtype(host.dtype if dtype is None else dtype)
    if in_trace():
        return _tracer(host.astype(dt)[()] if host.ndim == 0 else host.astype(dt))
    return _device(host.astype(dt))


asarray = array


# ---- indexing ---------------------------------------------------------------------------

def _sequence_index(i):
    """A list or tuple inside an index as numpy's array; an empty one an integer index (JAX's
    IndexType.from_index takes it as one; numpy would make it float64)."""
    return _np.asarray(i, dtype=_int_dtype()) if len(i) == 0 else _np.asarray(i)


def _refuse_list_index(idx):
    """A list (any non-tuple sequence but a string) as the whole index is JAX's TypeError
    (jax/_src/numpy/indexing.py eliminate_deprecated_list_indexing, which NDIndexer and the
    .at[] updates call first): where numpy would take it as a tuple (an entry is a sequence, an
    array, a slice, None or ...) the fix is arr[tuple(seq)], otherwise arr[array(seq)]. A list
    inside a tuple is an index array (_sequence_index)."""
    if isinstance(idx, (tuple, str, Tracer, Array, _np.ndarray)) or not isinstance(idx, collections.abc.Sequence):
        return
    as_tuple = builtins.any(
        (isinstance(i, (Tracer, Array, _np.ndarray)) and _np.ndim(i) != 0)
        or isinstance(i, (collections.abc.Sequence, slice)) or i is Ellipsis or i is None for i in idx)
    raise TypeError("Using a non-tuple sequence for multidimensional indexing is not allowed; use "
                    f"`arr[{'tuple' if as_tuple else 'array'}(seq)]` instead of `arr[seq]`. "
                    "See https://github.com/jax-ml/jax/issues/4564 for more information.")


def _is_index_array(i):
    """An integer index array (not a Python or numpy integer, which index one position)."""
    if isinstance(i, (list, tuple)):
        i = _sequence_index(i)
    if isinstance(i, (Tracer, Array, _np.ndarray)):
        kind = i.dtype.kind
        if kind not in "iu":
            # jax/_src/numpy/indexing.py IndexType.from_index: a TypeError (keys, floats).
            raise TypeError("Indexer must have integer or boolean type, got indexer with type "
                            f"{canonical_dtype(i.dtype) if isinstance(i, _np.ndarray) else i.dtype}")
        return True
    return False


def _refuse_scalar_index(i):
    """A float or complex scalar index (Python's or numpy's) is JAX's TypeError
    (jax/_src/numpy/indexing.py IndexType.from_index)."""
    if isinstance(i, (float, complex, _np.floating, _np.complexfloating)):
        raise TypeError(f"Indexer must have integer or boolean type, got indexer with type {_np.dtype(type(i))}")


def _advanced_contiguous(idx):
    """Whether the advanced indices (ints and index arrays) of `idx`, as written, are next to
    each other: numpy and JAX (indexing.py _index_to_gather: advanced_axes_are_contiguous,
    before the Ellipsis is expanded) put their dimensions where the first one is if so, else
    first; an Ellipsis, a slice or None between them separates them, even one that expands to
    no dimension."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    pos = [k for k, i in enumerate(idx)
           if not (i is None or i is Ellipsis or isinstance(i, slice) or _is_scalar_bool(i))]
    return not pos or pos == list(range(pos[0], pos[0] + len(pos)))


def _is_scalar_bool(i):
    """A boolean scalar index (True, np.True_, a 0-d boolean array): JAX (indexing.py
    expand_scalar_bool_indices) indexes a new dimension of size 1 with arange(int(i)), an
    advanced index of shape (1,) or (0,) that _advanced_contiguous does not count (JAX's
    is_advanced is read while it is still BOOLEAN)."""
    return isinstance(i, (bool, _np.bool_, _StaticBool)) or (
        isinstance(i, (_np.ndarray, Array, Tracer)) and i.ndim == 0 and i.dtype == _np.bool_)


class _StaticBool:
    """A boolean scalar index as an eager call passes it: static, and its cache key unlike 1's
    and 0's (True == 1), where np.True_ would be traced."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = bool(value)

    def __bool__(self):
        return self.value

    def __eq__(self, other):
        return type(other) is _StaticBool and other.value == self.value

    def __hash__(self):
        return hash((_StaticBool, self.value))


def _is_bool_array(i):
    return isinstance(i, (_np.ndarray, Array, Tracer)) and i.dtype == _np.bool_


def _as_mask(i):
    """A non-empty list or tuple of booleans as a NumPy mask (converted once); i otherwise."""
    if isinstance(i, (list, tuple)) and len(i) > 0:
        mask = _np.asarray(i)
        if mask.dtype == _np.bool_:
            return mask
    return i


def _expand_bool_indices(x, idx):
    """idx with each boolean array index as the integer arrays of its nonzero entries, one per
    dimension it covers, and each boolean scalar as a Python bool, as
    jax/_src/numpy/indexing.py NDIndexer.expand_bool_indices: the mask must be concrete (a
    traced one is JAX's NonConcreteBooleanIndexError, an IndexError: the result's shape would
    depend on its values) and its shape that of the dimensions it covers (a dimension of 0
    matches any)."""
    parts = tuple(_as_mask(i) for i in (idx if isinstance(idx, tuple) else (idx,)))
    if not builtins.any(_is_bool_array(i) for i in parts):
        return idx
    consumed = [0 if i is None or i is Ellipsis or _is_scalar_bool(i) else
                _np.ndim(i) if _is_bool_array(i) else 1 for i in parts]
    out, axis = [], 0
    for position, (i, n) in enumerate(zip(parts, consumed)):
        if i is Ellipsis:
            n = builtins.max(0, x.ndim - builtins.sum(consumed))
        if _is_bool_array(i):
            if isinstance(i, Tracer):
                from ._api import typeof
                from .errors import NonConcreteBooleanIndexError
                raise NonConcreteBooleanIndexError(typeof(i))
            mask = _np.asarray(i)
            if mask.ndim == 0:
                out.append(bool(mask))
                continue
            expected = list(x.shape[axis:axis + n])
            if len(expected) == n and not builtins.all(s in (0, e) for s, e in zip(mask.shape, expected)):
                raise IndexError("boolean index did not match shape of indexed array in index "
                                 f"{position}: got {mask.shape}, expected {expected}")
            out.extend(j.astype(_int_dtype()) for j in _np.nonzero(mask))
        else:
            out.append(i)
        axis += n
    return tuple(out)


def _expand_index(x, idx):
    """idx as one entry per result-relevant position: Ellipsis expanded, missing trailing
    dimensions filled with slice(None)."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if builtins.sum(1 for i in idx if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    n_real = builtins.sum(1 for i in idx if i is not None and i is not Ellipsis and not _is_scalar_bool(i))
    if n_real > x.ndim:
        raise IndexError(f"too many indices for array: array is {x.ndim}-dimensional, but {n_real} were indexed")
    expanded = []
    for i in idx:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - n_real))
        elif _is_scalar_bool(i):
            expanded.append(bool(i))  # a 0-d array's value (concrete: _expand_bool_indices)
        else:
            expanded.append(i)
    if not builtins.any(i is Ellipsis for i in idx):  # not `in`: == on an index array is elementwise
        expanded.extend([slice(None)] * (x.ndim - n_real))
    return expanded


def _slice_range(i, size):
    """The (start, length, step) of slice i over a dimension of `size`, as JAX's
    core.canonicalize_slice: x[start + step * k] for k < length."""
    s, e, step = i.indices(size)
    return s, len(range(s, e, step)), step


def _getitem(x, idx):
    """x[idx] as jnp indexes: ints, slices, None, ..., integer index arrays and boolean masks
    (_expand_bool_indices); unit-step slices, ints and one index array (an embedding lookup,
    x[:, ids]) are a slice and the SDK's at().get() on the sliced x; slices of positive steps
    beside ints and slices are lax.slice's strides (JAX's rewriting_take: to_static_slice), and
    of negative steps the same: to_static_slice's slice of their elements in increasing order
    (stride |step|), then one lax.rev of those dimensions (_static_slice), anything else (two
    index arrays, a strided slice beside an index array, a boolean scalar) one gather
    (_index_gather). An index array's out-of-range entries clamp and
    negative ones count from the end (JAX's "Out-of-bounds indexing" in the sharp bits:
    retrieval clamps). Where numpy's advanced indexing puts the index array's dimensions first
    (an int and an array separated by a slice or None), they go first here too."""
    _refuse_list_index(idx)
    idx = _expand_bool_indices(x, idx)
    expanded = _expand_index(x, idx)
    start, limit, strides, out_shape, d = [], [], [], [], 0
    array_pos, array_index, stepped, rev_axes = None, None, False, []
    for k, i in enumerate(expanded):
        if i is None:
            out_shape.append(1)
            continue
        if isinstance(i, bool):
            return _index_gather(x, idx, "clip", None, True, False)
        size = x.shape[d]
        if isinstance(i, (list, tuple)):
            i = _sequence_index(i)
        if isinstance(i, slice):
            s, n, step = _slice_range(i, size)
            if step != 1 and array_index is not None:
                return _index_gather(x, idx, "clip", None, True, False)
            stepped = stepped or step != 1
            if step < 0:
                # to_static_slice: the same elements from the lowest (new_start), |step| apart,
                # limit max(new_start, start + 1), then reversed (_static_slice's lax.rev).
                e = i.indices(size)[1]
                lowest = builtins.min(size, e + 1 + builtins.abs(s - e - 1) % -step)
                start.append(lowest), limit.append(builtins.max(lowest, s + 1)), strides.append(-step)
                rev_axes.append(d)
            else:
                # n elements from s, `step` apart: limit one past the last (to_static_slice's
                # max(start, stop) gives the same length).
                start.append(s), limit.append(s + (n - 1) * step + 1 if n else s), strides.append(step)
            out_shape.append(n)
        elif _is_int(i):
            j = int(i) + size if i < 0 else int(i)
            if not 0 <= j < size:
                raise IndexError(f"index {int(i)} is out of bounds for axis {d} with size {size}")
            start.append(j), limit.append(j + 1), strides.append(1)
        elif _is_index_array(i):
            if array_index is not None or stepped:
                return _index_gather(x, idx, "clip", None, True, False)
            array_pos, array_index = len(out_shape), i
            start.append(0), limit.append(size), strides.append(1), out_shape.append(size)
        else:
            _refuse_scalar_index(i)
            raise NotImplementedError(f"indexing with {type(i).__name__} {i!r}: Tessera supports ints, slices, "
                                      "None, ... and integer index arrays")
        d += 1
    out = _wrap(_t.slice(x._v, start, limit, strides))
    if rev_axes:
        out = _wrap(_t.rev(out._v, rev_axes))
    if tuple(out_shape) != out.shape:
        out = reshape(out, out_shape)
    if array_index is None:
        return out
    out = _wrap(_t.at_get(out._v, _tracer(_int32_indices(array_index, index_to_gather=True))._v, array_pos))
    n = _np.ndim(array_index)
    if not _advanced_contiguous(idx) and array_pos > 0:
        # numpy: advanced indices not next to each other put the broadcast dimensions first.
        perm = list(range(array_pos, array_pos + n)) + list(range(array_pos)) + \
            list(range(array_pos + n, out.ndim))
        out = transpose(out, perm)
    return out


def _index_plan(x, idx, wrap, at):
    """The general index `idx` (ints, slices, None, Ellipsis, boolean scalars and integer index
    arrays broadcasting together; boolean masks as _expand_bool_indices makes them) as one lax
    gather's or scatter's operands, as jax/_src/numpy/indexing.py _index_to_gather builds them:
    (the indices, index vector last; the dimension numbers (offset or window dims, collapsed or
    inserted dims, start index map, no batching dims); the gathered shape without None's
    dimensions; that shape with them; the slice sizes; (where the advanced indices' dimensions
    start in the gathered shape, their spec: the first one's broadcast, as aia_spec; each
    non-unit-step slice's (dimension in the gathered shape, x's dimension))). Ints and
    index arrays are advanced indices: broadcast together, their dimensions where the first of
    them is when they are adjacent (None separates them), else first (numpy's rule); negatives
    wrap when `wrap`. A
    boolean scalar is an advanced index of shape (1,) or (0,) over a new dimension of size 1,
    which only its shape shows here. A unit-step slice is a window of the gather, its start in
    the index vector unless 0; a slice of another step a dimension of the indices, start + step *
    iota, collapsed (JAX's gather of iota indices; it gathers a negative step's positions in
    increasing order and reverses the result, the same values). An int out of range is an
    IndexError in x[...] (as the fast paths), an index in .at[] (`at`), where the mode clamps or
    drops it. `idx` arrives with its boolean entries expanded (_getitem, _IndexUpdateRef._args)."""
    adv, basic, d = [], [], 0  # basic: (position, operand dim or None, start, size, step)
    first_adv = None  # the position of the first advanced index
    for k, i in enumerate(_expand_index(x, idx)):
        if i is None:
            basic.append((k, None, 0, 1, 1))
            continue
        if isinstance(i, bool):
            adv.append((None, _np.zeros((int(i),), _int_dtype())))
            first_adv = k if first_adv is None else first_adv
            continue
        size = x.shape[d]
        if isinstance(i, (list, tuple)):
            i = _sequence_index(i)
        if isinstance(i, slice):
            basic.append((k, d, *_slice_range(i, size)))
        elif _is_int(i):
            if not at and not -size <= int(i) < size:
                raise IndexError(f"index {int(i)} is out of bounds for axis {d} with size {size}")
            j = int(i) + size if wrap and i < 0 else int(i)
            adv.append((d, _tracer(_np.asarray(j, _int_dtype()))))
            first_adv = k if first_adv is None else first_adv
        elif _is_index_array(i):
            t = _tracer(_int32_indices(i, index_to_gather=True))
            adv.append((d, where(t < 0, t + size, t) if wrap else t))
            first_adv = k if first_adv is None else first_adv
        else:
            _refuse_scalar_index(i)
            raise NotImplementedError(f"indexing with {type(i).__name__} {i!r}: Tessera supports ints, slices, "
                                      "None, ..., integer index arrays and boolean masks")
        d += 1
    adv_shape = tuple(_np.broadcast_shapes(*[t.shape for _, t in adv]))
    real = [(dim, t) for dim, t in adv if dim is not None]
    dt = _np.dtype(_np.int64) if real and builtins.all(t.dtype == _np.int64 for _, t in real) else \
        _np.dtype(_np.int32)
    first = builtins.sum(1 for k, *_ in basic if k < first_adv) \
        if first_adv is not None and _advanced_contiguous(idx) else 0
    # The result's dimensions in order: the advanced indices' at `first`, then each entry's.
    full_shape, gathered, offset, batch, adv_at = [], [], [], [], 0
    columns = []  # (operand dim, its indices, their first batch dimension, their shape)
    stepped = []  # (dimension of gathered, operand dim) of each non-unit-step slice
    for j, (_, dim, s, n, step) in enumerate(basic + [(None, None, 0, 0, 1)]):
        if j == first and adv:
            adv_at = len(gathered)
            columns += [(dim_, t, len(batch), adv_shape) for dim_, t in real]
            full_shape += adv_shape
            gathered += adv_shape
            batch += adv_shape
        if j == len(basic):
            break
        full_shape.append(n)
        if dim is not None and step != 1:
            columns.append((dim, _np.arange(n, dtype=dt) * step + s, len(batch), (n,)))
            stepped.append((len(gathered), dim))
            batch.append(n)
            gathered.append(n)
        elif dim is not None:
            offset.append(len(gathered))
            gathered.append(n)
    batch = tuple(batch)
    # The advanced indices' layout (JAX's aia_spec): theirs broadcast together.
    aia = _broadcast_specs([t for _, t in adv], adv_shape)

    def placed(t, at_, shape):  # t broadcast to `shape`, batch[at_:at_ + len(shape)], then to batch
        t = broadcast_to(_tracer(t).astype(dt), shape)
        return broadcast_to(reshape(t, (1,) * at_ + shape + (1,) * (len(batch) - at_ - len(shape))), batch)

    parts = [placed(t, at_, shape) for _, t, at_, shape in columns]
    starts = [(dim, s) for _, dim, s, _, step in basic if dim is not None and step == 1 and s != 0]
    if not parts and not starts:  # x.at[:2, :3]: the index vector names one window's start, 0
        starts = [(dim, 0) for _, dim, *_ in basic if dim is not None][:1]
    parts += [full(batch, s, dt) for _, s in starts]
    # No part (a 0-d x, or only None): an empty index vector, as JAX's (indexing.py).
    indices = stack(parts, axis=-1) if parts else zeros(batch + (0,), _int_dtype())
    sizes = [1] * x.ndim
    for _, dim, s, n, step in basic:
        if dim is not None and step == 1:
            sizes[dim] = n
    collapsed = [dim for dim, *_ in columns]
    dims = (tuple(offset), tuple(sorted(collapsed)), tuple(collapsed + [dim for dim, _ in starts]), (), ())
    return indices, dims, tuple(gathered), tuple(full_shape), tuple(sizes), (adv_at, aia, stepped)


def _broadcast_spec(t, shape):
    """The spec of t broadcast to `shape` (lax.py's _broadcast_in_dim_sharding_rule: t's
    dimensions keep their splits, new and size-1 ones none); an ndarray's is unsplit."""
    from ._api import typeof
    n = _np.ndim(t)
    own = tuple(typeof(t).sharding.spec) if isinstance(t, (Tracer, Array)) else ()
    own = (own + (None,) * n)[:n]
    return (None,) * (len(shape) - n) + tuple(
        s if size == out else None for s, size, out in zip(own, _np.shape(t), shape[len(shape) - n:]))


def _broadcast_specs(ts, shape):
    """The spec of arrays ts broadcast together to `shape`, as lax.broadcast_shardings lays out
    JAX's _broadcast_arrays (jax/_src/lax/lax.py broadcasting_sharding_rule): each dimension
    takes the split any of them has there (a size-1 or new dimension has none), the same one if
    several do; two different splits are JAX's ShardingTypeError, a ValueError here."""
    each = [_broadcast_spec(t, shape) for t in ts]
    out = []
    for d, entries in enumerate(zip(*each)):
        splits = {e for e in entries if e is not None}
        if len(splits) > 1:
            raise ValueError("broadcast_shardings got incompatible shardings for broadcasting: "
                             + ", ".join(str(e) for e in each) + ".")
        out.append(splits.pop() if splits else None)
    return tuple(out)


def _slice_spec(spec):
    """_index_to_gather's slice_spec as the PartitionSpec of its slice_sharding, which
    NamedSharding checks (jax/_src/named_sharding.py check_pspec, _check_unique_resources): a
    mesh axis on two dimensions (x split over it on a window, an index array on its own) is
    JAX's DuplicateSpecError, a ValueError, in its words."""
    from .sharding import PartitionSpec
    used = [a for s in spec if s is not None for a in (s if isinstance(s, tuple) else (s,))]
    twice = sorted({f"`{a}`" for a in used if used.count(a) > 1})
    if twice:
        raise ValueError("A single NamedSharding spec specification can map every mesh axis to at most one "
                         f"positional dimension, but {PartitionSpec(*spec)!r} has duplicate entries for "
                         f"{', '.join(twice)}")
    return PartitionSpec(*spec)


def _at_slice_spec(xt, axis, i_spec):
    """The slice spec of x.at[(slice(None),) * axis + (i,)] (_slice_spec): x's splits on the
    windows, i's own (aia_spec, i_spec) on its dimensions; None when nothing is split."""
    from ._api import typeof
    x_spec = (tuple(typeof(xt).sharding.spec) + (None,) * xt.ndim)[:xt.ndim]
    if not builtins.any(s is not None for s in x_spec + i_spec):
        return None
    return _slice_spec(x_spec[:axis] + i_spec + x_spec[axis + 1:])


def _index_gather(x, idx, mode, fill_value, wrap, at):
    """x[idx] as one lax gather (_index_plan), out-of-range indices as `mode` says."""
    i, dims, _, shape, sizes, _ = _index_plan(x, idx, wrap, at)
    out = _wrap(_t.gather(x._v, i._v, *dims, list(sizes), mode, fill_value))
    return out if out.shape == shape else reshape(out, shape)


def _index_scatter(x, idx, values, name, mode, wrap):
    """x.at[idx].<update>(values) for the general index: lax's scatter `name` with the dimension
    numbers of _index_plan's gather (jax/_src/ops/scatter.py _scatter_impl: the values broadcast
    to the indexed shape, None's dimensions squeezed), in x's and the values' common dtype
    (_promoted), cast back to x's."""
    from ._api import typeof
    i, dims, gathered, shape, _, (first, aia, stepped) = _index_plan(x, idx, wrap, True)
    xt, y = _promoted(x, values)
    u = reshape(broadcast_to(y, shape), gathered)
    x_spec = tuple(typeof(xt).sharding.spec) + (None,) * x.ndim
    if builtins.any(s is not None for s in x_spec + tuple(typeof(u).sharding.spec) + aia):
        # On Explicit axes the updates laid out as the indexed slice of x (_scatter_impl:
        # indexer.slice_sharding, built by _index_to_gather's slice_spec): x's splits on the
        # windows and on the dimensions of non-unit-step slices (slice_spec.append(x_spec[x_axis])
        # for every slice), the advanced indices' own (aia_spec) on their dimensions, from `first`.
        windows = [d for d in range(x.ndim) if d not in dims[1]]
        spec = [None] * len(gathered)
        for j, d in list(zip(dims[0], windows)) + stepped:
            spec[j] = x_spec[d]
        spec[first:first + len(aia)] = aia
        u = broadcast_to(u, gathered, out_sharding=_slice_spec(spec))
    return _back(_wrap(getattr(_t, name)(xt._v, i._v, u._v, *[list(d) for d in dims], mode)), x)


def _at_axis(x, idx):
    """The (axis, index) of an .at[] index: slices over whole dimensions, then one int or one
    integer index array (x.at[i], x.at[:, i], x.at[..., i]); None for any other index, which
    _index_plan's general gather or scatter takes."""
    expanded = _expand_index(x, idx)
    def whole(i):
        return isinstance(i, slice) and i == slice(None)

    for i in expanded:
        _refuse_scalar_index(i)
    if not expanded:  # a 0-d x: the general path's empty index vector
        return None
    while len(expanded) > 1 and whole(expanded[-1]):
        expanded.pop()
    *lead, last = expanded
    if not builtins.all(whole(i) for i in lead) or not (
            _is_index_array(last) or _is_int(last)):
        return None
    return len(lead), _tracer(_np.asarray(last, _int_dtype()) if not isinstance(last, (Tracer, Array, _np.ndarray))
                              else _int32_indices(last, index_to_gather=True))


@_op
def _at_get(x, idx):
    plan = _at_axis(x, idx)
    if plan is None:
        return _index_gather(x, idx, "clip", None, True, True)
    axis, i = plan
    return _wrap(_t.at_get(x._v, i._v, axis))


def _at_laid_out(api, f, x, idx, values, out_sharding):
    """f(x, idx, values) (an .at[] update or get) with out_sharding (a
    NamedSharding, or a P on the explicit or ambient mesh), as jax/_src/ops/scatter.py's
    _scatter_update and indexing.py's rewriting_take run theirs, and as the SDK's
    IndexRef::get(out_sharding) runs the plain get (internal::auto_out_sharding): with the
    trace's Explicit axes as Auto (auto_axes; so a split the explicit-mode rule refuses, such as
    split indices, is no error), the result then laid out by out_sharding; outside a trace one
    jitted call. `api` (".set", ".get", ...) names the call in errors; a spec longer than the
    result's rank is a ValueError in the words of JAX's check_compatible_aval."""
    from .sharding import NamedSharding, _as_named
    _check_out_sharding_type(api, out_sharding)
    if not (in_trace() or _has_tracer((x, idx, values))):
        from ._api import jit
        named = _as_named(out_sharding, api)  # a bare P needs the ambient mesh (canonicalize_sharding)
        return jit(lambda x, idx, values: _at_laid_out(api, f, x, idx, values, named))(x, idx, values)
    spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
    x = _tracer(x)

    def run(_):
        out = f(x, idx, values)  # idx and values may be slices and Python scalars: read here, not passed
        if len(spec) > out.ndim and getattr(_trace._state, "error", None) is None:
            raise ValueError(f"{api}: out_sharding {spec!r} is only valid for values of rank at least {len(spec)}, "
                             f"but was applied to the result {out.dtype.name}{list(out.shape)} of rank {out.ndim}")
        return [out._v]

    return _wrap(_t.at_laid_out(api, x._v, *_spec_and_mesh(api, out_sharding), _trace.callback(run)))


def _check_out_sharding_type(api, out_sharding):
    from .sharding import NamedSharding, PartitionSpec
    if not isinstance(out_sharding, (NamedSharding, PartitionSpec)):
        raise TypeError(f"`out_sharding` argument of {api} only supports instances of `NamedSharding` or "
                        f"`PartitionSpec`. Got {out_sharding} of type: {type(out_sharding)}")  # canonicalize_sharding's


def _takes_a_slice(x, idx, mode):
    """Whether JAX's rewriting_take (jax/_src/numpy/indexing.py) computes x[idx] as a static or
    a dynamic slice, which do not read .get's out_sharding (only its gather does): mode None,
    clip or promise_in_bounds, and an index of ints, slices, None and Ellipsis (to_static_slice)
    or of those and 0-d integer arrays, its slices of step 1 or -1 (to_dynamic_slice); but not
    for an Array on more than one device (is_sharded: never a traced value) indexed with an int
    or a slice that is not whole (has_partial_slices), which the gather takes."""
    if mode not in (None, "clip", "promise_in_bounds"):
        return False
    parts = idx if isinstance(idx, tuple) else (idx,)

    def scalar(i):
        return _is_int(i) or isinstance(i, (Tracer, Array, _np.ndarray)) and i.ndim == 0 and i.dtype.kind in "iu"

    if not _basic_index(parts) and not _basic_index(parts, (None, 1, -1), scalar):
        return False

    def partial(i, size):  # has_partial_slices' test, so x[5:0] over 5 is whole: |stop - start| == size
        if not isinstance(i, slice):
            return _is_int(i)
        start, stop, step = i.indices(size)
        return abs(step) != 1 or abs(stop - start) != size

    return not (isinstance(x, Array) and x.sharding.num_devices > 1) or \
        not builtins.any(partial(i, size) for i, size in _with_sizes(x, parts))


def _basic_index(parts, steps=None, ints=None):
    """Whether index `parts` holds only None, Ellipsis, slices (of a step in `steps`, when
    given) and ints (those `ints` accepts, when given; else Python and NumPy ints)."""
    def basic(i):
        if isinstance(i, slice):
            return steps is None or i.step in steps
        return i is None or i is Ellipsis or (ints or _is_int)(i)

    return builtins.all(basic(i) for i in parts)


def _with_sizes(x, parts):
    """(entry, size of the dimension it indexes) for the entries of index `parts` but None."""
    sizes = iter(x.shape)
    return [(i, next(sizes)) for i in _expand_index(x, parts) if i is not None]


def _in_bounds(x, idx, wrap):
    """Whether idx is ints, slices, None and Ellipsis only, its ints in range (negatives from
    the end when `wrap`): JAX's to_static_slice with validate_static_indices."""
    parts = idx if isinstance(idx, tuple) else (idx,)
    return _basic_index(parts) and builtins.all((-size if wrap else 0) <= i < size for i, size in _with_sizes(x, parts) if _is_int(i))


def _promoted(x, values):
    """x and an update's values in their common dtype, as jax/_src/ops/scatter.py's
    _scatter_impl combines them (`x, y = promote_dtypes(x, y)`; a Python int that fits an
    integer x, and any Python scalar, weakly typed next to x as _scatter_update makes it); the
    caller casts the result back to x's dtype (`_convert_element_type(out, dtype)`), so an int32
    x.at[i].multiply(0.5) multiplies in float32 and truncates."""
    if isinstance(values, int) and not isinstance(values, bool) and not (
            x.dtype.kind in "iu" and _np.iinfo(x.dtype).min <= values <= _np.iinfo(x.dtype).max) and \
            not _np.iinfo(_int_dtype()).min <= values <= _np.iinfo(_int_dtype()).max:
        # JAX's _scatter_update takes it as jnp.asarray(y), which refuses a Python int past the
        # default integer dtype (jax/_src/abstract_arrays.py: OverflowError, these words).
        raise OverflowError(f"Python int {values} too large to convert to {_int_dtype().name}")
    if isinstance(values, int) and not isinstance(values, bool) and x.dtype.kind in "iu" and \
            not _np.iinfo(x.dtype).min <= values <= _np.iinfo(x.dtype).max:
        # A Python int that x's dtype cannot hold: jnp.asarray(y), then converted to x's dtype
        # (the weak type gives way), wrapping around as the conversion does.
        return x, _tracer(values).astype(x.dtype)
    y = _tracer(values, x)
    dt = promote_types(x.dtype, y.dtype)
    return (x if x.dtype == dt else x.astype(dt)), (y if y.dtype == dt else y.astype(dt))


def _back(out, x):
    return out if out.dtype == x.dtype else out.astype(x.dtype)


def _at_update(x, idx, values, scatter, sdk_update):
    """x.at[idx].set/add (`scatter` lax's name, `sdk_update` the SDK's at_set/at_add): the SDK's
    one-axis update where the index takes one axis, else the general index's scatter."""
    plan = _at_axis(x, idx)
    if plan is None:
        return _index_scatter(x, idx, values, scatter, "fill_or_drop", True)
    axis, i = plan
    xt, y = _promoted(x, values)
    _at_slice_spec(xt, axis, _broadcast_spec(i, i.shape))  # JAX's check; the SDK's updates_for lays them out
    return _back(_wrap(sdk_update(xt._v, i._v, axis, y._v)), x)


@_op
def _at_set(x, idx, values):
    return _at_update(x, idx, values, "scatter", _t.at_set)


@_op
def _at_add(x, idx, values):
    return _at_update(x, idx, values, "scatter_add", _t.at_add)


def _at_lax(x, idx, wrap):
    """An .at[] index as lax's: (axis, indices with the index vector last, the dimensions of the
    result (a gather's, a scatter's updates) that are x's, not the index array's); None for the
    general index (_index_plan)."""
    plan = _at_axis(x, idx)
    if plan is None:
        return None
    axis, i = plan
    if wrap:
        i = where(i < 0, i + x.shape[axis], i)
    return axis, expand_dims(i, -1), list(range(axis)) + list(range(axis + i.ndim, x.ndim - 1 + i.ndim))


@_op
def _at_scatter(x, idx, values, name, mode, wrap):
    """x.at[idx].<update>(values, mode=, wrap_negative_indices=) as jax/_src/ops/scatter.py's
    _scatter_update: lax's scatter `name` of the values broadcast to the updates' shape
    (x[:axis] + idx + x[axis+1:]), combined in x's and the values' common dtype and cast back to
    x's (_promoted); mode None drops out-of-range updates. On Explicit axes the updates are laid
    out as the indexed slice of x (_scatter_impl: broadcast_to(y, slice_shape,
    out_sharding=indexer.slice_sharding)), x's splits on its other dimensions, which the
    scatter's explicit-mode rule needs."""
    from ._api import typeof
    from .sharding import PartitionSpec
    plan = _at_lax(x, idx, wrap)
    if plan is None:
        return _index_scatter(x, idx, values, name, mode, wrap)
    axis, i, window = plan
    shape = x.shape[:axis] + i.shape[:-1] + x.shape[axis + 1:]
    xt, y = _promoted(x, values)
    u = broadcast_to(y, shape)
    spec = _at_slice_spec(xt, axis, _broadcast_spec(i, i.shape)[:-1])
    if spec is not None or builtins.any(s is not None for s in typeof(u).sharding.spec):
        u = broadcast_to(y, shape, out_sharding=spec if spec is not None else PartitionSpec())
    return _back(_wrap(getattr(_t, name)(xt._v, i._v, u._v, window, [axis], [axis], [], [], mode)), x)


@_op
def _at_apply(x, idx, func, mode, wrap):
    """x.at[idx].apply(func) as jax/_src/numpy/array_methods.py's _IndexUpdateRef.apply:
    lax.scatter_apply with .at[].add's dimension numbers and the indexed shape as update_shape
    (func applied once per index, so repeated indices apply it repeatedly)."""
    from .lax import _scatter_apply
    plan = _at_lax(x, idx, wrap)
    if plan is None:
        i, dims, shape, _, _, _ = _index_plan(x, idx, wrap, True)
        return _scatter_apply(x, i, func, dims, shape, mode)
    axis, i, window = plan
    shape = x.shape[:axis] + i.shape[:-1] + x.shape[axis + 1:]
    return _scatter_apply(x, i, func, (tuple(window), (axis,), (axis,), (), ()), shape, mode)


@_op
def _at_gather(x, idx, mode, fill_value, wrap):
    """x.at[idx].get(mode=, fill_value=, wrap_negative_indices=): lax's gather of the index's
    slices (indexing.py rewriting_take)."""
    plan = _at_lax(x, idx, wrap)
    if plan is None:
        return _index_gather(x, idx, mode, fill_value, wrap, True)
    axis, i, window = plan
    sizes = list(x.shape)
    sizes[axis] = 1
    return _wrap(_t.gather(x._v, i._v, window, [axis], [axis], [], [], sizes, mode, fill_value))


class _IndexUpdateRef:
    """x.at[idx]: get(), set(values), add(values), subtract, multiply (mul), divide, power, min,
    max and apply(func), as jax.Array.at (updates at out-of-range indices are dropped; negative
    indices count from the end), with its mode=, wrap_negative_indices= and get's fill_value=."""

    __slots__ = ("_x", "_idx")

    def __init__(self, x, idx):
        self._x, self._idx = x, idx

    def _args(self):
        return self._x, _eager_index(_expand_bool_indices(self._x, self._idx))

    def _options(self, name, options, get=False):
        """The (mode name or None, wrap_negative_indices, fill_value) of an update's or get's
        keywords, as jax.Array.at takes them; indices_are_sorted and unique_indices are hints
        that change nothing here."""
        from .lax import GatherScatterMode, _fill
        options = dict(options)
        options.pop("indices_are_sorted", None), options.pop("unique_indices", None)
        mode, wrap = options.pop("mode", None), bool(options.pop("wrap_negative_indices", True))
        fill = options.pop("fill_value", None) if get else None
        if name == "apply" and "out_sharding" in options:  # JAX's apply has no such parameter
            raise TypeError("_IndexUpdateRef.apply() got an unexpected keyword argument 'out_sharding'")
        _no_options(name, options)
        mode = None if mode is None else GatherScatterMode.from_any(mode).name.lower()
        return mode, wrap, _fill(fill) if mode == "fill_or_drop" else None

    def get(self, *, out_sharding=None, **options):
        """out_sharding (a NamedSharding, or a P on the explicit or ambient mesh): the gather
        runs with the mesh's Explicit axes as Auto and its result is laid out so, as JAX's
        (jax/_src/numpy/indexing.py rewriting_take: auto_axes), with mode= and fill_value= too.
        mode None clamps out-of-range indices (JAX's promise_in_bounds does in practice). An
        index JAX takes as a static or dynamic slice ignores out_sharding, as JAX's
        (_takes_a_slice): x.at[0].get(out_sharding=...) in a trace is x.at[0].get()."""
        mode, wrap, fill = self._options("get", options, get=True)
        if _takes_a_slice(self._x, self._idx, mode):
            if out_sharding is not None:
                _check_out_sharding_type(".get", out_sharding)  # canonicalize_sharding still checks it
                out_sharding = None
            if _in_bounds(self._x, self._idx, wrap):  # to_static_slice: x[idx], its slice's sharding
                return self._x[self._idx]

        def gather(x, idx, _):
            if mode is None and wrap:
                return _at_get(x, idx)
            return _at_gather(x, idx, mode or "clip", fill, wrap)

        if out_sharding is None:
            return gather(*self._args(), None)
        return _at_laid_out(".get", gather, *self._args(), None, out_sharding)

    def _update(self, name, scatter, values, options):
        """The update `name` (scatter: lax's scatter behind it). out_sharding (a NamedSharding,
        or a P on the explicit or ambient mesh; None: laid out as x) runs it with the mesh's
        Explicit axes as Auto, the result laid out so (_at_laid_out)."""
        options = dict(options)
        out_sharding = options.pop("out_sharding", None)
        mode, wrap, _ = self._options(name, options)

        def update(x, idx, values):
            if scatter in ("scatter", "scatter_add") and mode is None and wrap:
                return (_at_set if scatter == "scatter" else _at_add)(x, idx, values)
            return _at_scatter(x, idx, values, scatter, mode or "fill_or_drop", wrap)

        if out_sharding is None:
            return update(*self._args(), values)
        return _at_laid_out("." + name, update, *self._args(), values, out_sharding)

    def set(self, values, **options):
        return self._update("set", "scatter", values, options)

    def add(self, values, **options):
        return self._update("add", "scatter_add", values, options)

    def subtract(self, values, **options):
        return self._update("subtract", "scatter_sub", values, options)

    def multiply(self, values, **options):
        return self._update("multiply", "scatter_mul", values, options)

    mul = multiply

    def divide(self, values, **options):
        """x / ones_like(x).at[idx].multiply(values), as JAX builds it (array_methods.py
        _IndexUpdateRef.divide, out_sharding going to the multiply): repeated indices divide by
        their values' product, out-of-range ones are dropped, and the result is jnp.divide's
        (float32 for an integer x)."""
        return divide(self._x, _IndexUpdateRef(ones_like(self._x), self._idx)._update("divide", "scatter_mul", values,
                                                                                      options))

    def power(self, values, **options):
        """x ** ones_like(x).at[idx].multiply(values), as JAX builds it (_IndexUpdateRef.power)."""
        return power(self._x, _IndexUpdateRef(ones_like(self._x), self._idx)._update("power", "scatter_mul", values,
                                                                                     options))

    def apply(self, func, **options):
        """func applied at the indices, once per index (lax.scatter_apply; JAX's
        _IndexUpdateRef.apply), with mode= and wrap_negative_indices= as the updates'."""
        mode, wrap, _ = self._options("apply", options)
        return _at_apply(*self._args(), func, mode or "fill_or_drop", wrap)

    def min(self, values, **options):
        return self._update("min", "scatter_min", values, options)

    def max(self, values, **options):
        return self._update("max", "scatter_max", values, options)


def _no_options(name, options):
    if options:
        raise NotImplementedError(f".at[].{name}: options {sorted(options)} are not supported")


class _IndexUpdateHelper:
    __slots__ = ("_x",)

    def __init__(self, x):
        self._x = x

    def __getitem__(self, idx):
        # JAX refuses the list at the update (.get(), .set(), ...); here already at x.at[seq],
        # which differs only for a reference made and never used.
        _refuse_list_index(idx)
        return _IndexUpdateRef(self._x, idx)


def _eager_index(idx):
    """Lists (and tuples inside the index) of ints as numpy arrays (_sequence_index), so that an
    eager call passes them as arrays (a pytree would take a list apart into Python ints); numpy
    integer index arrays of other dtypes than int32 and int64 as int32, as JAX's indexing
    converts them (_int32_indices); boolean scalars as _StaticBool."""
    def one(i):
        if _is_scalar_bool(i) and not isinstance(i, (Tracer, Array)):
            return _StaticBool(i)
        if isinstance(i, (list, tuple)):
            i = _sequence_index(i)
        return _int32_indices(i, index_to_gather=True) if isinstance(i, _np.ndarray) and i.dtype.kind in "iu" else i

    return tuple(one(i) for i in idx) if isinstance(idx, tuple) else one(idx)


def take(a, indices, axis=None, mode=None, unique_indices=False, indices_are_sorted=False, fill_value=None):
    """jnp.take: mode None or "fill" (out-of-range indices give fill_value: NaN, the lowest
    integer or True by default; negatives count from the end), "clip" (clamped, negatives
    included) or "wrap" (taken modulo the size). Integer indices of other dtypes than int32
    and int64 keep their values (_int32_indices); "wrap" takes the modulo in the indices' own
    dtype first, as JAX's _take (jax/_src/numpy/indexing.py: ufuncs.mod before the gather), so a
    uint32 index past int32's range wraps by its value."""
    if isinstance(a, PRNGKeyArray):  # over the key dimensions (prng.py forwards take)
        return a.take(indices, axis, mode=mode, fill_value=fill_value)
    unsigned = hasattr(indices, "dtype") and _np.dtype(indices.dtype).kind == "u" and \
        _np.dtype(indices.dtype).itemsize >= 4
    return _take(a, indices if mode == "wrap" and unsigned else _int32_indices(indices), axis, mode, fill_value)


@_op
def _take(a, indices, axis, mode, fill_value):
    a = _tracer(a)
    if axis is None:
        a, axis = reshape(a, (-1,)), 0
    axis = axis % a.ndim if a.ndim else axis
    i = _tracer(indices)
    if mode == "wrap":
        i, mode = _int32_indices(remainder(i, a.shape[axis])), "clip"
    if mode not in (None, "fill", "clip", "promise_in_bounds"):
        raise ValueError(f"take: mode {mode!r} is not one of 'fill', 'clip', 'wrap', 'promise_in_bounds'")
    if isinstance(fill_value, _np.generic):
        fill_value = fill_value.item()
    return _wrap(_t.take(a._v, i._v, axis, mode in ("clip", "promise_in_bounds"), fill_value))


def take_along_axis(arr, indices, axis=-1, mode=None, fill_value=None, *, wrap_negative_indices=None):
    """jnp.take_along_axis (jax/_src/numpy/indexing.py): indices of arr's rank, broadcasting with
    arr in the other dimensions; negative indices wrap (not with 'promise_in_bounds'); mode None
    or 'fill' gives out-of-range ones fill_value (NaN, the lowest integer or True by default),
    'clip' clamps them, 'one_hot' is JAX's one-hot contraction (out of range gives 0); axis None
    takes 1-D indices into the flattened arr. wrap_negative_indices (None: JAX's legacy rule
    above) wraps negatives when True and treats them as out of range when False."""
    from .lax import GatherScatterMode, _fill
    if not hasattr(indices, "dtype"):
        indices = _np.asarray(indices)
    index_dtype = _np.dtype(indices.dtype)
    if index_dtype.kind not in "iu":
        raise TypeError(f"take_along_axis indices must be of integer type, got {index_dtype}")
    if axis is None:
        if _np.ndim(indices) != 1:
            raise ValueError(f"take_along_axis indices must be 1D if axis=None, got shape {_np.shape(indices)}")
        arr, axis = ravel(arr), 0
    mode = GatherScatterMode.from_any(mode)
    fill = _fill(fill_value) if mode is GatherScatterMode.FILL_OR_DROP else None
    wraps = mode is not GatherScatterMode.PROMISE_IN_BOUNDS  # the SDK's rule, JAX's legacy default
    unwrap = wrap_negative_indices is not None and bool(wrap_negative_indices) != wraps
    indices = _int32_indices(indices, wraps != unwrap)
    return _take_along_axis(arr, indices, int(axis), mode.name.lower(), fill, unwrap)


def _int32_indices(indices, wrap=False, index_to_gather=False):
    """Integer indices of another dtype than int32 or int64 as int32, which the SDK's gathers
    and scatters take. By default their values kept: a uint32 index past int32's range becomes
    int32's maximum, out of range as before, as jnp.take's and lax's gathers and scatters take
    uint32 indices as they are (clamped to the last index by CLIP, dropped or filled otherwise).
    With `index_to_gather`, JAX's indexing and .at[] (jax/_src/numpy/indexing.py
    _index_to_gather): negatives are wrapped first (not an unsigned index's), then the index
    converted to int32, wrapping around, so a uint32 index past int32's range is negative and
    out of range below 0 (CLIP clamps it to 0): it becomes int32's minimum here, which the SDK
    does not wrap as a negative index. With `wrap`, take_along_axis's conversion when negatives
    wrap: JAX converts its indices to int32 first (lax_utils.index_dtype_for_axis_size), so
    such a uint32 index becomes negative and wraps. On the host for numpy indices (uint16 is no
    Tessera dtype), traced for the others; lists as they are."""
    if not hasattr(indices, "dtype"):
        return indices
    dt = _np.dtype(indices.dtype)
    if dt.kind not in "iu" or dt in (_np.dtype(_np.int32), _np.dtype(_np.int64)):
        return indices
    host = isinstance(indices, _np.ndarray)
    if dt.kind == "u" and dt.itemsize >= 4 and index_to_gather:
        converted = indices.astype(_np.int32)
        return (_np.where if host else where)(converted < 0, _np.int32(-2**31), converted).astype(_np.int32)
    if dt.kind == "u" and dt.itemsize >= 4 and not wrap:
        indices = (_np.minimum if host else minimum)(indices, 2**31 - 1)
    return indices.astype(_np.int32)


@_op
def _take_along_axis(arr, indices, axis, mode, fill_value, unwrap):
    arr, i = _tracer(arr), _tracer(indices)
    if unwrap:
        # Negatives the SDK would not (promise_in_bounds) or would (the others) wrap: wrapped
        # here, or moved past the end so they stay out of range (CLIP clamps them to 0 as lax).
        n = arr.shape[axis]
        i = where(i < 0, i + n if mode == "promise_in_bounds" else (0 if mode == "clip" else n), i)
    return _wrap(_t.take_along_axis(arr._v, i._v, axis, mode, fill_value))


@_op
def remainder(x, y):
    """jnp.remainder (Python's %: the result has the divisor's sign)."""
    if isinstance(x, PRNGKeyArray) or isinstance(y, PRNGKeyArray):
        refuse_operands("remainder", x, y)
    a, b = _pair(x, y)
    return _wrap(_t.remainder(a._v, b._v))


mod = remainder


@_op
def fmod(x, y):
    """jnp.fmod (C's fmod: the result has the dividend's sign)."""
    a, b = _pair(x, y)
    return _wrap(_t.rem(a._v, b._v))


# ---- operators and methods of Tracer and Array ------------------------------------------

def _swap(f):
    return lambda x, y: f(y, x)


def _bool_only(op, fn):
    # &, | and ~ are jnp's bitwise ops: on bools they are the logical ones; the SDK has no bitwise
    # integer ops, so an integer operand is refused rather than given a logical answer.
    def f(*args):
        for a in args:
            kind = getattr(getattr(a, "dtype", None), "kind", "b" if isinstance(a, bool) else "i")
            if kind != "b":
                raise TypeError(f"the {op} operator on a {getattr(a, 'dtype', type(a).__name__)} operand: Tessera "
                                "has no bitwise integer ops yet (jnp.bitwise_*); only bool arrays take &, | and ~")
        return fn(*args)
    return f


def _install(cls):
    ops = {"__add__": add, "__radd__": _swap(add), "__sub__": subtract, "__rsub__": _swap(subtract),
           "__mul__": multiply, "__rmul__": _swap(multiply), "__truediv__": divide, "__rtruediv__": _swap(divide),
           "__pow__": power, "__rpow__": _swap(power), "__matmul__": matmul, "__rmatmul__": _swap(matmul),
           "__lt__": less, "__le__": less_equal, "__gt__": greater, "__ge__": greater_equal,
           "__and__": _bool_only("&", logical_and), "__rand__": _bool_only("&", _swap(logical_and)),
           "__or__": _bool_only("|", logical_or), "__ror__": _bool_only("|", _swap(logical_or)),
           "__mod__": remainder, "__rmod__": _swap(remainder),
           "__neg__": negative, "__pos__": lambda x: x, "__abs__": abs, "__invert__": _bool_only("~", logical_not),
           "astype": astype, "reshape": lambda x, *s, **k: reshape(x, s[0] if len(s) == 1 else s, **k),
           "transpose": lambda x, *axes: transpose(x, (axes[0] if len(axes) == 1 else axes) or None),
           "sum": sum, "mean": mean, "max": max, "min": min, "prod": prod, "argmax": argmax, "argmin": argmin,
           "var": var, "std": std, "squeeze": squeeze, "ravel": ravel, "flatten": ravel, "dot": dot,
           "T": property(lambda x: transpose(x)), "at": property(_IndexUpdateHelper)}
    for name, fn in ops.items():
        setattr(cls, name, fn)
    cls.__eq__ = equal
    cls.__ne__ = not_equal
    cls.__hash__ = None
    if cls is Tracer:
        cls.__getitem__ = _getitem
    else:
        cls.__getitem__ = lambda x, idx: _eager_getitem(x, idx)


def _is_int(i):
    return isinstance(i, (int, _np.integer)) and not isinstance(i, bool)


def _eager_getitem(x, idx):
    """x[idx] on an Array, as a small jitted program. Ints in idx (with slices, None and ...)
    are passed as traced values, so x[0], x[1], ... run one program, not one each (ints are
    checked against the bounds here, as _getitem checks them)."""
    from ._api import _eager
    _refuse_list_index(idx)
    idx = _eager_index(_expand_bool_indices(x, idx))
    parts = idx if isinstance(idx, tuple) else (idx,)
    if builtins.any(_is_int(i) for i in parts) and _basic_index(parts, (None, 1)):
        starts, pattern, d = [], [], 0
        for i in _expand_index(x, parts):
            if i is None:
                pattern.append(None)
                continue
            if _is_int(i):
                size = x.shape[d]
                j = int(i) + size if i < 0 else int(i)
                if not 0 <= j < size:
                    raise IndexError(f"index {int(i)} is out of bounds for axis {d} with size {size}")
                starts.append(j)
                pattern.append("int")
            else:
                pattern.append(i)
            d += 1
        return _eager(_int_index, (x, _np.asarray(starts, _int_dtype()), tuple(pattern)), {})
    return _eager(_getitem, (x, idx), {})


def _int_index(x, starts, pattern):
    """x indexed by `pattern` (slices, None, and "int" where `starts`, a traced vector of the
    in-bounds ints, gives the position): a dynamic_slice and a reshape."""
    from .lax import dynamic_slice
    at, sizes, out_shape, k = [], [], [], 0
    for p in pattern:
        if p is None:
            out_shape.append(1)
        elif isinstance(p, slice):
            s, n, _ = _slice_range(p, x.shape[len(at)])
            at.append(starts.dtype.type(s))
            sizes.append(n)
            out_shape.append(n)
        else:
            at.append(starts[k])
            sizes.append(1)
            k += 1
    return reshape(dynamic_slice(x, at, sizes), out_shape)


_install(Tracer)
_install(Array)


# ---- compositions the JAX tutorials use (jnp's definitions, over the ops above) ----------

@_op
def all(a, axis=None, keepdims=False):
    """jnp.all: True where no element is zero (a count of the zeros, so empty is True)."""
    a = _tracer(a)
    zeros = (a == 0) if a.dtype.kind != "b" else logical_not(a)
    return sum(zeros.astype(_int_dtype()), axis=axis, keepdims=keepdims) == 0


@_op
def any(a, axis=None, keepdims=False):
    """jnp.any: True where some element is nonzero."""
    a = _tracer(a)
    nonzero = (a != 0) if a.dtype.kind != "b" else a
    return sum(nonzero.astype(_int_dtype()), axis=axis, keepdims=keepdims) > 0


alltrue, sometrue = all, any


@_op
def isnan(x):
    x = _tracer(x)
    return x != x if x.dtype.kind == "f" else full_like(x, False, _np.bool_)


@_op
def isinf(x):
    x = _tracer(x)
    return abs(x) == inf if x.dtype.kind == "f" else full_like(x, False, _np.bool_)


@_op
def isfinite(x):
    x = _tracer(x)
    return logical_not(isnan(x) | isinf(x)) if x.dtype.kind == "f" else full_like(x, True, _np.bool_)


@_op
def isclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """jnp.isclose (jax/_src/numpy/lax_numpy.py): |a - b| <= atol + rtol * |b| for floats, an
    infinity close only to itself, NaN close to NaN only with equal_nan; integers compare equal."""
    a, b = _same_dtype(a, b)
    if a.dtype.kind != "f":
        return a == b
    out = abs(a - b) <= atol + rtol * abs(b)
    a_inf, b_inf = isinf(a), isinf(b)
    out = where(a_inf | b_inf, False, out) | (a_inf & b_inf & (a == b))
    if equal_nan:
        out = out | (isnan(a) & isnan(b))
    return out


def allclose(a, b, rtol=1e-05, atol=1e-08, equal_nan=False):
    """jnp.allclose: all(isclose(...)), a bool scalar array."""
    return all(isclose(a, b, rtol=rtol, atol=atol, equal_nan=equal_nan))


def array_equal(a1, a2, equal_nan=False):
    if _np.shape(a1) != _np.shape(a2):
        return False
    eq = equal(a1, a2)
    if equal_nan:
        eq = eq | (isnan(a1) & isnan(a2))
    return all(eq)


@_op
def copy(a, order=None):
    """jnp.copy: the same values in a new array (arrays are immutable: an identity program)."""
    return _tracer(a)


def _ndim(a):
    return a.ndim if isinstance(a, (Tracer, Array)) else _np.ndim(a)


def _shape_of(a):
    return tuple(a.shape) if isinstance(a, (Tracer, Array)) else _np.shape(a)


def split(ary, indices_or_sections, axis=0):
    """jnp.split: a list of slices of `ary` along `axis`, at the given indices or into that
    many equal sections."""
    size = _shape_of(ary)[axis]
    if isinstance(indices_or_sections, (int, _np.integer)):
        n = int(indices_or_sections)
        if n <= 0 or size % n:
            raise ValueError(f"array split does not result in an equal division: {size} into {n}")
        bounds = [size // n * k for k in range(n + 1)]
    else:
        bounds = [0] + [builtins.min(builtins.max(int(i) + (size if i < 0 else 0), 0), size)
                        for i in indices_or_sections] + [size]
    axis = axis % _ndim(ary)
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        idx = (slice(None),) * axis + (slice(lo, builtins.max(lo, hi)),)
        out.append(ary[idx])
    return out


def array_split(ary, indices_or_sections, axis=0):
    """jnp.array_split: as split, the first size % n sections one longer."""
    if not isinstance(indices_or_sections, (int, _np.integer)):
        return split(ary, indices_or_sections, axis)
    size, n = _shape_of(ary)[axis], int(indices_or_sections)
    q, r = divmod(size, n)
    cuts = _np.cumsum([q + 1] * r + [q] * (n - r))[:-1]
    return split(ary, [int(c) for c in cuts], axis)


@_op
def tile(A, reps):
    """jnp.tile: A repeated reps[i] times along each dimension (a broadcast and a reshape)."""
    a = _tracer(A)
    reps = (reps,) if isinstance(reps, int) else tuple(int(r) for r in reps)
    ndim = builtins.max(a.ndim, len(reps))
    shape = (1,) * (ndim - a.ndim) + a.shape
    reps = (1,) * (ndim - len(reps)) + reps
    a = reshape(a, [d for s in shape for d in (1, s)])
    a = broadcast_to(a, [d for r, s in zip(reps, shape) for d in (r, s)])
    return reshape(a, [r * s for r, s in zip(reps, shape)])


@_op
def roll(a, shift, axis=None):
    """jnp.roll with static shifts: the array's two parts along each axis, swapped."""
    a = _tracer(a)
    if axis is None:
        return reshape(roll(ravel(a), shift, 0), a.shape)
    shifts = (shift,) if isinstance(shift, int) else tuple(shift)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    if len(shifts) == 1 and len(axes) > 1:
        shifts = shifts * len(axes)
    for s, ax in zip(shifts, axes):
        ax %= a.ndim
        n = a.shape[ax]
        if n == 0 or int(s) % n == 0:
            continue
        k = int(s) % n
        head = (slice(None),) * ax
        a = concatenate([a[head + (slice(n - k, n),)], a[head + (slice(0, n - k),)]], axis=ax)
    return a


def _dot_with_out_sharding(a, b, out_sharding):
    if out_sharding is None:
        return _dot(a, b)
    if _ndim(a) != 2 or _ndim(b) != 2:
        raise NotImplementedError("jnp.dot(out_sharding=...) of operands that are not matrices")
    return matmul(a, b, out_sharding=out_sharding)


_dot = dot


def dot(a, b, *, precision=None, preferred_element_type=None, out_sharding=None):
    """jnp.dot; out_sharding (matrices) as matmul's. precision is accepted and ignored (the CPU
    kernels compute in the operands' dtype)."""
    out = _dot_with_out_sharding(a, b, out_sharding)
    return out if preferred_element_type is None else astype(out, preferred_element_type)


for _cls in (Tracer, Array):
    _cls.all, _cls.any, _cls.copy, _cls.dot = all, any, copy, dot

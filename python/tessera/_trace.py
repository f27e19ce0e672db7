"""Tracing from Python: the Tracer a traced function sees (a wrapper of the SDK's Value), and
the bridge that hands Python functions to the SDK's tracer. A Python exception raised inside
a traced function cannot cross the C++ tracer; it is kept here and raised again, as is, when
the trace then fails."""
import threading

import numpy as np

from . import _tessera
from . import errors

_state = threading.local()


class Tracer:
    """A symbolic array inside a traced function: shape, dtype and the operators of a jnp
    array (installed by tessera.numpy). Its value is not known: bool(), float() and
    np.asarray() raise."""

    __slots__ = ("_v",)
    __array_priority__ = 100

    def __init__(self, value):
        self._v = value

    @property
    def shape(self):
        return tuple(self._v.shape)

    @property
    def dtype(self):
        return np.dtype(_tessera.numpy_dtype(self._v.dtype))

    @property
    def ndim(self):
        return len(self._v.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def _concrete(self, what):
        raise TypeError(f"{what} of a traced array {self!r}: its value is not known while tracing "
                        "(use tessera.numpy.where, or mark the argument static with static_argnums)")

    def __bool__(self):
        self._concrete("bool()")

    def __float__(self):
        self._concrete("float()")

    def __int__(self):
        self._concrete("int()")

    def __index__(self):
        self._concrete("an index")

    def __array__(self, dtype=None, copy=None):
        self._concrete("np.asarray()")

    __hash__ = None

    def __repr__(self):
        dims = ",".join(str(d) for d in self.shape)
        return f"Traced<ShapedArray({self.dtype}[{dims}])>"


def in_trace():
    return getattr(_state, "depth", 0) > 0


def capture_scope():
    """The Captures of the jit being traced (tessera._api), or None."""
    return getattr(_state, "capture", None)


class Retrace(Exception):
    """Raised at the end of a trace that met concrete arrays not yet among its jit's captures:
    the jit adds them as arguments and traces again."""


def callback(fn):
    """`fn` (a list of Values -> a list of Values) as the SDK calls it while tracing: the
    first exception is kept (pending_error) and the SDK sees no result, which fails its trace."""

    def run(values):
        _state.depth = getattr(_state, "depth", 0) + 1
        try:
            out = fn(values)
            return out
        except BaseException as e:  # noqa: B902 - re-raised by raise_pending
            if getattr(_state, "error", None) is None:
                _state.error = e
            return None
        finally:
            _state.depth -= 1

    return run


def clear_pending():
    if not in_trace():
        _state.error = None


class TraceFailed(Exception):
    """Raised inside a traced function when an SDK call failed and recorded its error in the
    trace, before the function could go on (vmap's checks of its arguments): the trace's end
    raises the SDK's error instead of this."""


def raise_pending(cpp_error):
    """After a failed SDK call: the Python exception a traced function raised, if any, else
    the SDK's own error."""
    e = getattr(_state, "error", None)
    if e is not None and not in_trace():
        _state.error = None
        if not isinstance(e, TraceFailed):
            raise e
    raise cpp_error


def value_of(x):
    if isinstance(x, Tracer):
        return x._v
    raise TypeError(f"expected a traced array, got {type(x).__name__}: {x!r}")


_SDK_ERRORS = (errors.TesseraError, errors.InvalidArgumentError)

"""tessera.Array (jax.Array) and its Shards, over the SDK's Array. Operators and methods
are installed by tessera.numpy (they run as small jitted programs, as JAX dispatches ops)."""
import abc

import numpy as np

from . import _tessera
from ._prng import PRNGKeyArray
from .sharding import NamedSharding, _device


class Shard:
    """One device's block of an Array (jax.Shard): device, index (a tuple of slices),
    replica_id, and data (the block as a numpy array, downloaded on first access)."""

    def __init__(self, cpp):
        self._cpp = cpp
        self._data = None
        self.device = _device(cpp.device_id)
        self.index = tuple(slice(a, b) for a, b in cpp.index)
        self.replica_id = cpp.replica_id

    @property
    def data(self):
        if self._data is None:
            self._data = self._cpp.data()
        return self._data

    def __repr__(self):
        return f"Shard(device={self.device!r}, index={self.index}, replica_id={self.replica_id})"


class Array(metaclass=abc.ABCMeta):
    """A global array on the cluster's devices (jax.Array). np.asarray(a) fetches it.

    A typed key array (_prng.PRNGKeyArray) is an Array too, as JAX's (random_test.py
    test_isinstance: isinstance(key, jax.Array)): registered as a virtual subclass, so that it
    takes none of these methods (JAX's key arrays take only the ones prng.py forwards).

    Uncommitted (JAX's word): made by a creation function (jnp.arange, zeros, array, ...) or
    by ops on such arrays only, on device 0; jit and shard_map move it to the mesh of the
    committed arguments (replicated) as they place numpy data. device_put and results of
    computations on committed arrays are committed."""

    # As jax.Array: no __array_ufunc__, so numpy's operators defer to ours by priority
    # (ndarray + Array is an Array) while numpy functions (np.sin(a)) take it as an array.
    __array_priority__ = 100

    def __init__(self, cpp, committed=True):
        self._a = cpp
        self._committed = committed
        self._host = None  # the fetched values, kept: an Array never changes (see __array__)

    def devices(self):
        """The set of devices holding a block (jax.Array.devices())."""
        return {s.device for s in self.addressable_shards}

    @property
    def shape(self):
        return tuple(self._a.shape)

    @property
    def dtype(self):
        return np.dtype(_tessera.numpy_dtype(self._a.dtype))

    @property
    def ndim(self):
        return len(self._a.shape)

    @property
    def size(self):
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def sharding(self):
        return NamedSharding._from_cpp(self._a.sharding)

    @property
    def addressable_shards(self):
        return [Shard(s) for s in self._a.addressable_shards]

    global_shards = addressable_shards

    @property
    def is_fully_addressable(self):
        return True

    def is_ready(self):
        return self._a.is_ready()

    def block_until_ready(self):
        self._a.block_until_ready()
        return self

    def __array__(self, dtype=None, copy=None):
        # Fetched once: an Array's values never change, so np.asarray, print and float() of
        # one Array after the first cost no transfer. The cached copy is read-only (as JAX's
        # np.asarray of an Array is); jit drops it when it donates the Array (_api.py), after
        # which a fetch fails as the SDK says.
        host = self._host
        if host is None:
            host = self._a.fetch()
            host.flags.writeable = False
            self._host = host
        if dtype is not None:
            return host.astype(dtype, copy=bool(copy))
        return host.copy() if copy else host

    def item(self):
        return np.asarray(self).item()

    def tolist(self):
        return np.asarray(self).tolist()

    def __float__(self):
        return float(np.asarray(self))

    def __int__(self):
        return int(np.asarray(self))

    def __bool__(self):
        return bool(np.asarray(self))

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        return iter(np.asarray(self))

    def __repr__(self):
        return f"Array({np.array2string(np.asarray(self), separator=', ')}, dtype={self.dtype})"

    def __str__(self):
        # jax.Array's str is its values' numpy str: print(x) shows [1. 2.], repr shows Array(...).
        return str(np.asarray(self))

    def __format__(self, spec):
        return format(np.asarray(self), spec) if not self.shape else repr(self)


Array.register(PRNGKeyArray)

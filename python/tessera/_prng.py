"""Typed PRNG keys (jax/_src/random/prng.py's PRNGKeyArray): an array whose elements are
keys, dtype key<fry> and shape without the trailing 2, over the raw uint32[..., 2] data that
the SDK's tessera::random functions take (`_base`: an Array, or a Tracer while traced).

    k = tessera.random.key(0)          # Array((), dtype=key<fry>) overlaying: [0 0]
    ks = tessera.random.split(k, 4)    # key<fry>[4]
    tessera.random.key_data(ks)        # uint32[4, 2]

As in JAX, a key array is one leaf of a pytree (tree_util.tree_leaves(k) == [k]) while the
transformations (jit, vmap, grad, shard_map, device_put) see its data: JAX registers it in
its dispatch registry only (prng.py: tree_util.dispatch_registry.register_node), Tessera's
tree_util flattens it for them (tree_util.data_flatten). Only threefry2x32 exists here."""
import numpy as np

IMPL = "threefry2x32"


class prng_key:
    """jax.dtypes.prng_key: the scalar type of every key dtype (np.issubdtype-style checks)."""


class KeyTy:
    """A key array's dtype, key<fry> (prng.py KeyTy): its name prints, itemsize is the data's."""

    type = prng_key
    name = "key<fry>"
    itemsize = 8  # two uint32 words
    kind = "V"  # not numeric: jnp's promotion refuses it

    def __repr__(self):
        return self.name

    __str__ = __repr__

    def __eq__(self, other):
        return type(other) is KeyTy

    def __hash__(self):
        return hash(KeyTy)


KEY_DTYPE = KeyTy()


def check_key_data(data):
    """prng.py _check_prng_key_data, in its words (a TypeError): uint32 with a trailing
    dimension 2. The data of an op that failed while tracing (a Tracer whose value is not ok,
    of shape ()) passes: the trace's end raises that op's own error."""
    if not all(hasattr(data, a) for a in ("ndim", "shape", "dtype")):
        raise TypeError("JAX encountered invalid PRNG key data: expected key_data to have ndim, shape, and dtype "
                        f"attributes. Got {data}")
    from ._trace import Tracer
    if isinstance(data, Tracer) and not data._v.ok:
        return
    if data.ndim < 1:
        raise TypeError(f"JAX encountered invalid PRNG key data: expected key_data.ndim >= 1; got ndim={data.ndim}")
    if tuple(data.shape[-1:]) != (2,):
        raise TypeError("JAX encountered invalid PRNG key data: expected key_data.shape to end with (2,); "
                        f"got shape={tuple(data.shape)} for impl={IMPL}")
    if np.dtype(data.dtype) != np.uint32:
        raise TypeError("JAX encountered invalid PRNG key data: expected key_data.dtype = uint32; "
                        f"got dtype={data.dtype}")


def refuse_operands(name, *args):
    """jax/_src/numpy/util.py check_for_prngkeys's TypeError for operands of which some are
    keys: "add does not accept dtypes key<fry>, int32." (in the operands' order), or "add does
    not accept dtype key<fry>" when all are keys (the key dtype's own rule, in lax's words)."""
    def dtype(a):
        theirs = getattr(a, "dtype", None)
        if theirs is None:  # a Python number: JAX's default type of it (int32 without x64)
            from .numpy import canonical_dtype
            theirs = canonical_dtype(np.asarray(a).dtype)
        return str(theirs)

    dtypes = [dtype(a) for a in args]
    if len(set(dtypes)) < 2:
        raise TypeError(f"{name} does not accept dtype {dtypes[0]}")
    raise TypeError(f"{name} does not accept dtypes {', '.join(dtypes)}.")


def _binary(name, reflected=False):
    def refuse(self, other):
        refuse_operands(name, *((other, self) if reflected else (self, other)))
    return refuse


def _unary(name):
    def refuse(self):
        raise TypeError(f"{name} does not accept dtype {self.dtype}")
    return refuse


class PRNGKeyArray:
    """jax.random.key's result: an array of keys. Indexing, reshape, len, iteration and the
    shape attributes act on the key dimensions; arithmetic is a TypeError (as JAX's)."""

    __array_priority__ = 100
    __hash__ = None

    def __init__(self, base):
        # REQUIRES: `base` is key data (random.wrap_key_data checks what users give). Not
        # checked here: a failed op's result inside a trace must reach the trace's end, whose
        # error is the real one (as JAX, whose PRNGKeyArray sees only avals checked before).
        self._base = base

    # ---- attributes of the key dimensions --------------------------------------------
    shape = property(lambda self: tuple(self._base.shape[:-1]))
    ndim = property(lambda self: len(self._base.shape) - 1)
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
    dtype = property(lambda self: KEY_DTYPE)
    itemsize = property(lambda self: KEY_DTYPE.itemsize)
    nbytes = property(lambda self: self.size * KEY_DTYPE.itemsize)

    @property
    def sharding(self):
        """The data's sharding without the (always whole) trailing dimension of the two words."""
        from .sharding import NamedSharding, PartitionSpec
        s = self._base.sharding
        spec = tuple(s.spec)[:self.ndim]
        return NamedSharding(s.mesh, PartitionSpec(*spec, unreduced=s.spec.unreduced, reduced=s.spec.reduced))

    def devices(self):
        return self._base.devices()

    def block_until_ready(self):
        self._base.block_until_ready()
        return self

    def copy(self):
        return self

    # ---- the key dimensions as an array's --------------------------------------------
    def __len__(self):
        if not self.shape:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if not self.shape:
            raise TypeError("iteration over a 0-d key array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        indexing = [i for i in idx if i is not None and i is not Ellipsis]
        if len(indexing) > self.ndim:
            raise IndexError(f"Too many indices: {self.ndim}-dimensional key array indexed with {len(indexing)} "
                             "regular indices.")
        # The data's trailing dimension stays whole: after an ellipsis, or one added before it.
        tail = (slice(None),) if any(i is Ellipsis for i in idx) else (Ellipsis, slice(None))
        return PRNGKeyArray(self._base[idx + tail])

    def reshape(self, *shape, order="C"):
        from . import numpy as jnp
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        return PRNGKeyArray(jnp.reshape(self._base, (*_resolve(shape, self.size), 2), order=order))

    def ravel(self, order="C"):
        return self.reshape((self.size,), order=order)

    flatten = ravel

    def squeeze(self, axis=None):
        from . import numpy as jnp
        if axis is None:
            axis = tuple(i for i, d in enumerate(self.shape) if d == 1)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        return PRNGKeyArray(jnp.squeeze(self._base, tuple(a % self.ndim for a in axes)))

    def transpose(self, *axes):
        from . import numpy as jnp
        if not axes or axes == (None,):
            axes = tuple(reversed(range(self.ndim)))
        elif len(axes) == 1 and not isinstance(axes[0], int):
            axes = tuple(axes[0])
        return PRNGKeyArray(jnp.transpose(self._base, tuple(a % self.ndim for a in axes) + (self.ndim,)))

    T = property(lambda self: self.transpose())

    def swapaxes(self, a, b):
        axes = list(range(self.ndim))
        axes[a], axes[b] = axes[b], axes[a]
        return self.transpose(axes)

    def __eq__(self, other):
        """Elementwise over the key dimensions (JnpWithKeyArrayTest test_equality): equal keys
        have equal data; a key and a number are not comparable (TypeError, as JAX's)."""
        if not isinstance(other, PRNGKeyArray):
            _binary("eq")(self, other)
        from . import numpy as jnp
        return jnp.all(self._base == other._base, axis=-1)

    def __ne__(self, other):
        if not isinstance(other, PRNGKeyArray):
            _binary("ne")(self, other)
        from . import numpy as jnp
        return jnp.any(self._base != other._base, axis=-1)

    # ---- what a key is not -------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("JAX array with PRNGKey dtype cannot be converted to a NumPy array. Use "
                        "jax.random.key_data(arr) if you wish to extract the underlying integer array.")

    def __bool__(self):
        raise TypeError("key array cannot be converted to boolean.")

    def __repr__(self):
        # prng.py PRNGKeyArray.__repr__ (docs/jep/9263-typed-keys.md prints it): str is the same.
        return f"Array({self.shape}, dtype={self.dtype.name}) overlaying:\n{str(self._base)}"


for _name, _prim in [("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                     ("floordiv", "floor_divide"), ("mod", "rem"), ("pow", "pow"), ("matmul", "dot_general"),
                     ("and", "and"), ("or", "or"), ("xor", "xor"), ("lshift", "shift_left"),
                     ("rshift", "shift_right"), ("lt", "lt"), ("le", "le"), ("gt", "gt"), ("ge", "ge")]:
    setattr(PRNGKeyArray, f"__{_name}__", _binary(_prim))
    if _name not in ("lt", "le", "gt", "ge"):  # (the reflected comparisons are the swapped ones)
        setattr(PRNGKeyArray, f"__r{_name}__", _binary(_prim, reflected=True))
for _name, _prim in [("neg", "neg"), ("pos", "pos"), ("abs", "abs"), ("invert", "not")]:
    setattr(PRNGKeyArray, f"__{_name}__", _unary(_prim))
del _name, _prim


def _resolve(shape, size):
    """numpy's reshape of `size` elements to `shape` with at most one -1 (numpy.py's
    _norm_shape), refused here when it does not hold them all."""
    from .numpy import _norm_shape
    resolved = _norm_shape(shape, size)
    if int(np.prod(resolved, dtype=np.int64)) != size:
        raise ValueError(f"cannot reshape key array of size {size} into shape {tuple(int(d) for d in shape)}")
    return resolved

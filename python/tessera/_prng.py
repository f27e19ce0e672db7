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


class extended(np.generic):
    """jax.dtypes.extended (jax/_src/dtypes.py): the scalar type above every extended dtype,
    never instantiated; dtypes.issubdtype(key.dtype, extended) is True."""


class prng_key(extended):
    """jax.dtypes.prng_key: the scalar type of every key dtype, never instantiated;
    dtypes.issubdtype(key.dtype, prng_key) is True (jnp.issubdtype)."""


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


# ---- keys as operands of jnp functions and Array operators ------------------------------
# JAX's Array operators are jnp functions (jax/_src/numpy/array_methods.py _array_operators:
# k - 1 is jnp.subtract(k, 1)). Each jnp function promotes its operands first (jax/_src/numpy/
# util.py promote_args*), whose check_for_prngkeys refuses a key next to another dtype in the
# function's name. Operands that are all keys pass it; then promote_args hands them to a lax
# primitive, whose dtype rule refuses the key in the primitive's name (jax/_src/lax/lax.py
# naryop_dtype_rule, unop_dtype_rule), while promote_args_numeric and promote_args_inexact
# first ask numpy for the key dtype (jax/_src/dtypes.py to_numeric_dtype / to_inexact_dtype:
# np.dtype(key<fry>)), which numpy refuses.
_NUM = ("integer", "floating", "complexfloating")
_INT_OR_BOOL = ("integer", "bool")
_ORDERED = ("integer", "floating", "bool")
_ANY = ("integer", "floating", "complexfloating", "bool")
_INEXACT = ("floating", "complexfloating")
# jnp function -> (lax primitive, the dtypes its rule accepts) for the ones that reach a
# primitive with keys (tessera.lax's functions refuse keys by the primitive's rule directly);
# lax.py's accepted sets (_num, _ordered, ...), whose names JAX joins in a Python set's order,
# here in lax.py's order of the union.
_PRIMITIVES = {
    "add": ("add", _NUM), "subtract": ("sub", _NUM), "multiply": ("mul", _NUM),
    "maximum": ("max", _ANY), "minimum": ("min", _ANY),
    "less": ("lt", _ORDERED), "less_equal": ("le", _ORDERED), "greater": ("gt", _ORDERED),
    "greater_equal": ("ge", _ORDERED),
    "bitwise_and": ("and", _INT_OR_BOOL), "bitwise_or": ("or", _INT_OR_BOOL), "bitwise_xor": ("xor", _INT_OR_BOOL),
    "negative": ("neg", _NUM), "sign": ("sign", _NUM), "invert": ("not", _INT_OR_BOOL),
    "absolute": ("abs", ("signedinteger", "floating", "complexfloating")),
}


def _dtype_name(a):
    """The name of `a`'s dtype as jax.dtypes.dtype gives it (jax/_src/dtypes.py dtype): an
    Array's (keys included) or a Tracer's as it is; any other value's (Python and numpy numbers,
    numpy arrays) canonical, so np.arange(3) is int32 and np.float64(2) float32 without x64."""
    from ._array import Array
    from ._trace import Tracer
    if isinstance(a, (Array, Tracer)):
        return str(a.dtype)
    from .numpy import canonical_dtype
    return str(canonical_dtype(np.asarray(a).dtype))


def check_key_conversion(x, new_dtype):
    """Whether converting `x` to `new_dtype` involves keys,
    for lax.convert_element_type and jnp.array / asarray: False when neither is a key; True when
    a key array converts to its own dtype (the conversion is the keys themselves); otherwise
    JAX's ValueError "Cannot convert_element_type from key<fry> to int32": a key converts to no
    other dtype and nothing converts to a key (jax/_src/lax/lax.py _from_edtype_abstract_eval /
    _to_edtype_abstract_eval, KeyTyRules.allow_conversion is False; random_test.py
    JnpWithKeyArrayTest test_errors). The other dtype is named canonical, as both canonicalize a
    user's dtype first (jax/_src/dtypes.py check_and_canonicalize_user_dtype; int is int32), so
    that the name 'key<fry>' is numpy's TypeError "data type 'key<fry>' not understood", as JAX's
    np.dtype of it."""
    to_key = isinstance(new_dtype, KeyTy)
    if not isinstance(x, PRNGKeyArray) and not to_key:
        return False
    old = _dtype_name(x)
    if to_key:
        new = KEY_DTYPE.name
    else:
        from .numpy import canonical_dtype
        new = str(canonical_dtype(new_dtype))
    if old != new:
        raise ValueError(f"Cannot convert_element_type from {old} to {new}")
    return True


_SCALAR_TYPES = {"integer": np.integer, "floating": np.floating, "complexfloating": np.complexfloating,
                 "signedinteger": np.signedinteger, "bool": np.bool_}


def refuse_primitive(prim, accepted, *args):
    """lax.py's dtype rule of primitive `prim` on `args`, some of them keys (naryop_dtype_rule,
    unop_dtype_rule): the first operand whose dtype is no subtype of its position's `accepted`
    (one tuple of names per position) is refused, "sub does not accept dtype key<fry> at
    position 1. Accepted dtypes at position 1 are subtypes of integer, floating,
    complexfloating.", or for one operand "neg does not accept dtype key<fry>. Accepted dtypes
    are subtypes of ...". The names are JAX's joined from a Python set: here in lax.py's order."""
    for i, (a, names) in enumerate(zip(args, accepted)):
        dtype = _dtype_name(a)
        if dtype != str(KEY_DTYPE) and any(np.issubdtype(np.dtype(dtype), _SCALAR_TYPES[n]) for n in names):
            continue
        if len(args) == 1:
            raise TypeError(f"{prim} does not accept dtype {dtype}. Accepted dtypes are subtypes of {', '.join(names)}.")
        raise TypeError(f"{prim} does not accept dtype {dtype} at position {i}. Accepted dtypes at position {i} are "
                        f"subtypes of {', '.join(names)}.")
    raise AssertionError(f"refuse_primitive({prim}): no operand is refused")


def refuse_operands(name, *args):
    """The TypeError of jnp function `name` given `args`,
    some of them keys, in JAX's words: "subtract does not accept dtypes key<fry>, int32." (the
    operands' dtypes in order) when they differ; with keys only, the primitive's "sub does not
    accept dtype key<fry> at position 0. Accepted dtypes at position 0 are subtypes of integer,
    floating, complexfloating." (one operand: "neg does not accept dtype key<fry>. Accepted
    dtypes are subtypes of ..."), or numpy's "Cannot interpret 'key<fry>' as a data type" for
    the functions that promote to a numeric or inexact dtype (true_divide, floor_divide,
    remainder, power, the shifts, exp, ...)."""
    dtypes = [_dtype_name(a) for a in args]
    if len(set(dtypes)) > 1:
        raise TypeError(f"{name} does not accept dtypes {', '.join(dtypes)}.")
    if name not in _PRIMITIVES:
        raise TypeError(f"Cannot interpret '{dtypes[0]}' as a data type")
    prim, accepted = _PRIMITIVES[name]
    refuse_primitive(prim, (accepted,) * len(args), *args)


def refuse_power(x, y):
    """jnp.power (x ** y) with a key operand: a concrete integer exponent (operator.index takes
    it) makes power promote x alone to a numeric dtype (ufuncs.py power's case 1:
    promote_dtypes_numeric), which numpy refuses for a key; any other goes through
    promote_args_numeric("power", x, y)."""
    import operator
    from ._trace import Tracer
    if not isinstance(y, (Tracer, PRNGKeyArray)):
        try:
            operator.index(y)
        except TypeError:
            pass
        else:
            refuse_operands("power", x)
    refuse_operands("power", x, y)


def _operand(other):
    """Whether a binary operator takes `other` to its jnp function (array_methods.py
    _accepted_binop_types: numbers, numpy values, arrays); others are NotImplemented."""
    from ._array import Array
    from ._trace import Tracer
    return isinstance(other, (int, float, complex, np.generic, np.ndarray, Array, Tracer))


def _binary(name, reflected=False):
    def refuse(self, other):
        if not _operand(other):
            return NotImplemented
        refuse_operands(name, *((other, self) if reflected else (self, other)))
    return refuse


def _matmul(reflected=False):
    def refuse(self, other):
        if not _operand(other):
            return NotImplemented
        args = (other, self) if reflected else (self, other)
        for i, x in enumerate(args):  # tensor_contractions.py matmul's first check
            ndim = x.ndim if hasattr(x, "ndim") else np.ndim(x)
            if ndim < 1:
                raise ValueError(f"matmul input operand {i} must have ndim at least 1, but it has ndim {ndim}")
        # (Then JAX's dtype promotion of a key; Tessera's own words here.)
        dtypes = [_dtype_name(a) for a in args]
        raise TypeError(f"matmul does not accept dtype{'s' if len(set(dtypes)) > 1 else ''} "
                        f"{', '.join(dict.fromkeys(dtypes))}")
    return refuse


def _compare(name, key, other):
    """== and != of a key and a non-key (array_methods.py _operator_eq / _operator_ne): an array
    or number is jnp.equal's / jnp.not_equal's TypeError; a dict, list, set or tuple Python's;
    anything else NotImplemented (so Python compares identities)."""
    if type(other) in (dict, list, set, tuple):
        raise TypeError(f"unsupported operand type(s) for ==: {type(key).__name__!r} and {type(other).__name__!r}")
    if not _operand(other):
        return NotImplemented
    refuse_operands(name, key, other)


def _unary(name):
    def refuse(self):
        refuse_operands(name, self)
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

    @property
    def _committed(self):
        """The data's (prng.py PRNGKeyArray._committed); a key over a traced value is not."""
        return getattr(self._base, "_committed", False)

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

    def _data_index(self, idx):
        """The index of the data that `idx` of the key dimensions is. A list as the whole index
        is JAX's TypeError here too (prng.py gives key arrays jnp's __getitem__ and `at`)."""
        from .numpy import _refuse_list_index
        _refuse_list_index(idx)
        idx = idx if isinstance(idx, tuple) else (idx,)
        indexing = [i for i in idx if i is not None and i is not Ellipsis]
        if len(indexing) > self.ndim:
            raise IndexError(f"Too many indices: {self.ndim}-dimensional key array indexed with {len(indexing)} "
                             "regular indices.")
        # The data's trailing dimension stays whole: after an ellipsis, or one added before it.
        return idx + ((slice(None),) if any(i is Ellipsis for i in idx) else (Ellipsis, slice(None)))

    def __getitem__(self, idx):
        return PRNGKeyArray(self._base[self._data_index(idx)])

    @property
    def at(self):
        """keys.at[idx].get() and .set(keys) as the data's rows (prng.py forwards `at`;
        random_test.py JnpWithKeyArrayTest test_gather, test_scatter, test_equality, and
        KeyArrayTest test_gather_fill: mode='fill' fills with keys of uint32-max words)."""
        return _KeyIndexUpdate(self)

    def take(self, indices, axis=None, **options):
        """jnp.take over the key dimensions (prng.py forwards `take`); axis None takes from the
        flattened keys. mode='fill' (the default) fills with keys of uint32-max words, as the
        gather of test_gather_fill."""
        from . import numpy as jnp
        keys = self.ravel() if axis is None else self
        axis = 0 if axis is None else jnp._normalize_axis(axis, keys.ndim)
        return PRNGKeyArray(jnp.take(keys._base, indices, axis=axis, **options))

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
            return _compare("equal", self, other)
        from . import numpy as jnp
        return jnp.all(self._base == other._base, axis=-1)

    def __ne__(self, other):
        if not isinstance(other, PRNGKeyArray):
            return _compare("not_equal", self, other)
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


# The operators as JAX's (array_methods.py _array_operators): each the jnp function it calls.
for _name, _fun in [("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "true_divide"),
                    ("floordiv", "floor_divide"), ("mod", "remainder"), ("divmod", "divmod"),
                    ("and", "bitwise_and"), ("or", "bitwise_or"), ("xor", "bitwise_xor"), ("lshift", "left_shift"),
                    ("rshift", "right_shift"), ("lt", "less"), ("le", "less_equal"), ("gt", "greater"),
                    ("ge", "greater_equal")]:
    setattr(PRNGKeyArray, f"__{_name}__", _binary(_fun))
    if _name not in ("lt", "le", "gt", "ge"):  # (the reflected comparisons are the swapped ones)
        setattr(PRNGKeyArray, f"__r{_name}__", _binary(_fun, reflected=True))
for _name, _fun in [("neg", "negative"), ("abs", "absolute"), ("invert", "invert")]:
    setattr(PRNGKeyArray, f"__{_name}__", _unary(_fun))
del _name, _fun
PRNGKeyArray.__pow__ = lambda self, other: refuse_power(self, other) if _operand(other) else NotImplemented
PRNGKeyArray.__rpow__ = lambda self, other: refuse_power(other, self) if _operand(other) else NotImplemented
PRNGKeyArray.__matmul__, PRNGKeyArray.__rmatmul__ = _matmul(), _matmul(reflected=True)
PRNGKeyArray.__pos__ = lambda self: self  # jnp.positive is lax.asarray: the key itself


class _KeyIndexUpdate:
    """keys.at (idx None) and keys.at[idx]: get and set, on the data's rows; the arithmetic
    updates have no meaning for keys."""

    __slots__ = ("_keys", "_idx")

    def __init__(self, keys, idx=None):
        self._keys, self._idx = keys, idx

    def __getitem__(self, idx):
        return _KeyIndexUpdate(self._keys, idx)

    def get(self, **options):
        return PRNGKeyArray(self._keys._base.at[self._keys._data_index(self._idx)].get(**options))

    def _refused(self, *args, **options):
        """The arithmetic updates, as JAX's: lax.scatter_add and the others build their combining
        function from lax._const(operand, 0) (scatter_mul from 1), np.array(0, key dtype), which
        numpy refuses (jax/_src/lax/slicing.py; divide and power scatter onto ones_like(keys)
        the same way). As JAX's _scatter_impl (jax/_src/ops/scatter.py), an update of keys at
        an index that selects no key returns the keys before that function is built; a Python
        int is refused first (_scatter_update's np.issubdtype of the key dtype)."""
        values = args[0] if args else None
        if isinstance(values, PRNGKeyArray) and 0 in self.get().shape:
            return self._keys
        raise TypeError(f"Cannot interpret '{self._keys.dtype}' as a data type")

    add = subtract = multiply = mul = divide = power = min = max = _refused

    def apply(self, func, **options):
        """Not built: JAX's scatter_apply takes keys (its placeholder is lax.full of the key
        dtype, which KeyTyRules.full allows) and applies func to each indexed key; Tessera's
        apply counts the windows on each element and applies func to numbers."""
        raise NotImplementedError(f"x.at[...].apply on a key array ({self._keys.dtype}) is not implemented in "
                                  "Tessera; apply func to keys.at[...].get() and write the result back with "
                                  ".at[...].set")

    def set(self, values, **options):
        if isinstance(values, int):
            # jax/_src/ops/scatter.py _scatter_update asks np.issubdtype(x.dtype, np.integer) of a
            # Python int's target, which numpy refuses for a key dtype.
            raise TypeError(f"Cannot interpret '{self._keys.dtype}' as a data type")
        if not isinstance(values, PRNGKeyArray):
            raise TypeError(f"x.at[...].set: a key array takes keys, not values of dtype {_dtype_name(values)} "
                            "(jax.random.wrap_key_data makes keys of uint32 data)")
        return PRNGKeyArray(self._keys._base.at[self._keys._data_index(self._idx)].set(values._base, **options))


def _resolve(shape, size):
    """numpy's reshape of `size` elements to `shape` with at most one -1 (numpy.py's
    _norm_shape), refused here when it does not hold them all or a -1 is left (two of them, or
    one next to a 0, which any number of elements fits: numpy refuses it too); two -1s are
    JAX's TypeError."""
    from .numpy import _norm_shape
    if [int(d) for d in shape].count(-1) > 1:  # jax/_src/numpy/array_methods.py _compute_newshape
        raise TypeError(f"can only specify one unknown axis size with a `-1` value, got {tuple(shape)}")
    resolved = _norm_shape(shape, size)
    if any(d < 0 for d in resolved) or int(np.prod(resolved, dtype=np.int64)) != size:
        raise ValueError(f"cannot reshape key array of size {size} into shape {tuple(int(d) for d in shape)}")
    return resolved

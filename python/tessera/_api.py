"""jit, grad, shard_map, device_put and friends: JAX's transformations over the SDK's. Python
handles only what C++ cannot see: pytrees (flattened to the SDK's flat lists of arrays),
static arguments (part of the cache key), numpy arguments (placed first) and the calls back
into the Python function while the SDK traces."""
import functools
import hashlib

import numpy as _np

from . import _tessera as _t
from . import _trace
from . import errors
from . import checkpoint_policies
from ._array import Array
from ._config import config
from ._trace import Tracer
from .sharding import Mesh, NamedSharding, PartitionSpec, Device, _as_named, _explicit_only, _check_in_force, devices, _ambient_mesh, get_abstract_mesh, _abstract_override, _in_force, AxisType
from .tree_util import tree_unflatten, broadcast_prefix
# The transformations see a typed key array as its uint32 data (a node of the tree, wrapped again
# by tree_unflatten), as JAX's dispatch does; jax.tree_util's own functions keep it a leaf.
from .tree_util import data_flatten as tree_flatten, data_leaves as tree_leaves, data_map as tree_map


def _is_dynamic(x):
    return isinstance(x, (Array, _np.ndarray, _np.generic, Tracer))


def _signature(x):
    """What a dynamic argument's trace depends on: its dtype, shape and, committed, sharding (one
    SDK Jitted, and one set of captures, per signature: a trace of one never changes another's)."""
    if isinstance(x, Array):
        sig = x.__dict__.get("_signature")
        if sig is None:  # an Array never changes: its signature is kept (dispatch cost)
            sig = x.__dict__["_signature"] = (x.dtype.str, x.shape, x.sharding if x._committed else None)
        return sig
    a = _np.asarray(x)
    return (a.dtype.str, a.shape, None)


def _static_key(x):
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    if isinstance(x, tuple):
        return tuple(_static_key(v) for v in x)
    try:
        hash(x)
    except TypeError:
        raise TypeError(f"jit: a non-array argument must be hashable (it is part of the cache key), got {x!r}") \
            from None
    return x


def _is_sharding(x):
    return x is None or isinstance(x, (NamedSharding, PartitionSpec))


def _default_sharding():
    return NamedSharding(Mesh(devices()[:1], ("_default",)), PartitionSpec())


def _sdk_call(fn, *args):
    """fn(*args) on the SDK; a Python error raised inside a traced function wins over the
    trace error it caused."""
    _trace.clear_pending()
    try:
        return fn(*args)
    except _trace._SDK_ERRORS as e:
        _trace.raise_pending(e)


def _put_numpy(x, sharding, committed=True):
    from .numpy import canonical_dtype
    # Not np.ascontiguousarray, which makes a 0-d array 1-d: jnp.sqrt(2) and device_put of a
    # numpy scalar keep shape ().
    host = _np.asarray(x, dtype=canonical_dtype(_np.asarray(x).dtype), order="C")
    return Array(config.client().device_put(host, sharding._cpp), committed)


def _uncommitted_array(host):
    """What a creation function returns outside a trace: an uncommitted Array on device 0
    (the SDK's Client::array: a jitted call moves it where it runs, as JAX moves it)."""
    from .numpy import canonical_dtype
    host = _np.asarray(host, dtype=canonical_dtype(_np.asarray(host).dtype), order="C")
    return Array(config.client().array(host), False)


def _is_uncommitted(x):
    return isinstance(x, Array) and not x._committed


class Captures:
    """The concrete arrays a jitted function closes over. JAX makes each a constant of the traced
    program (a jaxpr constvar, fed to the computation), its value the one at trace time; here
    each becomes an extra argument of the jitted program, after the function's own, so nothing
    is copied into the program text and the compile cache sees only its type. An Array is
    captured by identity (passed as it is at each call); numpy data by content, put on the
    devices once when first met (as JAX bakes its value). A trace that meets arrays not yet
    captured stands each in with a placeholder of its type (so one trace finds them all),
    then fails with _trace.Retrace; the jit adds them and traces again."""

    MAX_RETRACES = 3  # a function that meets new arrays at every trace (it creates Arrays) is refused

    def __init__(self):
        self.arrays = []   # the captured Arrays, in argument order
        # identity (an Array's id: self.arrays holds the Array, so its id stays its own) or
        # content (numpy) -> position
        self._index = {}
        self.tracers = None  # this trace's Tracers of self.arrays
        self.placed = None   # self.arrays as the jit passes them (placed once)
        self.new = False   # whether this trace met arrays not yet captured

    @staticmethod
    def _key(x):
        if isinstance(x, Array):
            return ("array", id(x))
        # Content by SHA-256 (read in place, no copy of the data kept): two different arrays
        # never share a key, where a 64-bit hash could collide and hand one the other's value.
        # Not np.ascontiguousarray, which makes a 0-d array 1-d (a scalar and a 1-element vector
        # would share a key).
        a = _np.asarray(x, order="C")
        return ("numpy", a.dtype.str, a.shape, hashlib.sha256(a.data).digest())

    def tracer(self, x):
        """x's Tracer in this trace, or None (it is recorded, and the trace will be made again)."""
        key = self._key(x)
        i = self._index.get(key)
        if i is not None and self.tracers is not None and i < len(self.tracers):
            return self.tracers[i]
        if i is None:
            self._index[key] = len(self.arrays)
            self.arrays.append(x if isinstance(x, Array) else _uncommitted_array(x))
        self.new = True
        return None


class _Jitted:
    """What jit returns: one SDK Jitted per argument structure and static values, each of
    which compiles once per signature of dtypes, shapes and shardings."""

    def __init__(self, fun, in_shardings, out_shardings, static_argnums, donate_argnums, default_mesh=None):
        # First: update_wrapper copies fun's __dict__, which for a function wrapping a jitted one
        # (vmap(jit(f)), functools.wraps) holds that one's _fun; set after, it would replace ours.
        functools.update_wrapper(self, fun)
        self._fun = fun
        # Where arguments and captures go when none is committed (device 0 without it): an
        # eager shard_map's mesh.
        self._default_mesh = default_mesh
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._static = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
        self._donate = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
        self._cache = {}

    def _call_traced(self, args, kwargs):
        return _constrain_outputs(self._fun(*args, **kwargs), self._out_shardings)

    def __call__(self, *args, **kwargs):
        n = len(args)
        static = {i % n if n else i for i in self._static}
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        if _trace.capture_scope() is not None:
            # Called inside a jit's trace: inlined there (as JAX inlines a nested jit), whatever
            # its arguments; concrete ones are captured.
            from .numpy import _tracer
            args, kwargs = tree_map(lambda l: _tracer(l) if isinstance(l, (Array, _np.ndarray)) else l,
                                    (args, kwargs))
            return self._call_traced(args, kwargs)
        if any(isinstance(l, Tracer) for l in tree_leaves((args, kwargs))):
            return self._call_traced(args, kwargs)  # inside another trace: inline
        leaves, treedef = tree_flatten((dyn, kwargs))
        dyn_pos = [i for i, l in enumerate(leaves) if _is_dynamic(l)]
        # The ambient mesh is part of the key: bare specs inside fun resolve against it; and so is
        # use_abstract_mesh's, which holds inside fun (JAX's trace context holds it).
        key = (treedef, tuple(_static_key(args[i]) for i in sorted(static)),
               tuple((i, _static_key(l)) for i, l in enumerate(leaves) if not _is_dynamic(l)), _ambient_mesh(),
               _abstract_override(),
               tuple(_signature(leaves[i]) for i in dyn_pos))
        shardings = self._arg_shardings(dyn, kwargs, len(leaves))
        entry = self._cache.get(key)
        if entry is None:
            captures = Captures()
            if not dyn_pos:
                # No argument to trace on: one trace of placeholders finds what it closes over.
                self._discover(args, static, leaves, treedef, dyn_pos, captures)
                if not captures.arrays:
                    raise ValueError(f"jit: {getattr(self._fun, '__name__', 'the function')} got no array argument "
                                     "and closes over none (Tessera's jit needs at least one Array or numpy array)")
            entry = self._cache[key] = self._make(args, static, leaves, treedef, dyn_pos, shardings, dyn, captures)
        for i in self._donate:  # a donated Array's values are gone: so is its host copy
            for l in tree_leaves(args[i % n] if n else ()):
                if isinstance(l, Array):
                    l._host = None
        for attempt in range(Captures.MAX_RETRACES + 1):
            cpp, out_tree, captures = entry
            # Uncommitted arguments and captures go where the committed ones are (JAX's rule).
            arrays = [self._place(leaves[i], shardings[i], leaves + captures.arrays) for i in dyn_pos]
            if captures.placed is None:  # placed once per signature (the key fixes where they go)
                captures.placed = [self._place(c, None, arrays + captures.arrays) for c in captures.arrays]
            consts = captures.placed
            # Outputs of only uncommitted inputs (and no shardings asked for) stay uncommitted.
            committed = any(a._committed for a in arrays + consts) or self._out_shardings is not None \
                or self._uncommitted_mesh() is not None
            try:
                # Under the ambient mesh, as the SDK's jit is under set_mesh: it refuses a committed
                # argument on other devices than the context mesh's, as JAX does.
                context = _ambient_mesh()
                outs = _sdk_call(cpp, [a._a for a in arrays + consts], None if context is None else context._cpp)
                break
            except _trace.Retrace:
                if attempt == Captures.MAX_RETRACES:
                    raise ValueError(f"jit: {getattr(self._fun, '__name__', 'the function')} closed over new arrays "
                                     f"each of the {attempt + 1} times it was traced (does it create Arrays, e.g. "
                                     "with device_put, while traced? create them inside with tessera.numpy, or "
                                     "pass them as arguments)") from None
                captures.placed = None
                entry = self._cache[key] = self._make(args, static, leaves, treedef, dyn_pos, shardings, dyn,
                                                      captures)
        # The SDK commits them too when it moved uncommitted arguments to a mesh the function names.
        return tree_unflatten(out_tree[0], [Array(o, committed or o.committed) for o in outs])

    def _uncommitted_mesh(self):
        """Where arguments and captures go when none is committed: an eager shard_map's mesh, or
        the mesh of the shard_map this jit wraps (jit(shard_map(f, ...)): JAX moves uncommitted
        arguments to the computation's devices); else the ambient mesh (jax.set_mesh: JAX's
        pxla.py _get_and_check_device_assignment takes the context mesh's devices when no sharding
        names any); None: device 0."""
        if self._default_mesh is not None:
            return self._default_mesh
        mesh_of = getattr(self._fun, "_shard_map_mesh", None)
        named = mesh_of() if mesh_of is not None else None
        return named if named is not None else _ambient_mesh()

    def _arg_shardings(self, dyn, kwargs, n):
        if self._in_shardings is None:
            return [None] * n
        flat = broadcast_prefix(self._in_shardings, dyn, _is_sharding)
        return flat + [None] * (n - len(flat))

    def _place(self, leaf, sharding, leaves):
        if isinstance(leaf, Array) and leaf._committed:
            return leaf
        if sharding is None:
            committed = next((l for l in leaves if isinstance(l, Array) and l._committed), None)
            if committed is not None:
                target = NamedSharding(committed.sharding.mesh, PartitionSpec())
            elif self._uncommitted_mesh() is not None:
                target = NamedSharding(self._uncommitted_mesh(), PartitionSpec())
            else:
                # Only uncommitted arrays and numpy data: all on device 0, uncommitted.
                # (The SDK's jit moves them to the mesh the function names, as JAX does, when it
                # names one: a shard_map's or a constraint's.)
                return leaf if isinstance(leaf, Array) else _uncommitted_array(leaf)
        else:
            target = _as_named(sharding, "jit in_shardings")
        if isinstance(leaf, Array):
            return _put_one(leaf, target)
        return _put_numpy(leaf, target)

    def _body(self, args, static, leaves, treedef, dyn_pos, captures, out_tree):
        """The function the SDK traces: values are the dynamic leaves', then the captures'."""
        fun = self._fun
        n = len(args)

        def body(values):
            flat = list(leaves)
            for i, v in zip(dyn_pos, values):
                flat[i] = Tracer(v)
            dyn_args, kw = tree_unflatten(treedef, flat)
            it = iter(dyn_args)
            full = [args[i] if i in static else next(it) for i in range(n)]
            outer = _trace.capture_scope()
            captures.tracers, captures.new = [Tracer(v) for v in values[len(dyn_pos):]], False
            _trace._state.capture = captures
            try:
                out = _constrain_outputs(fun(*full, **kw), self._out_shardings)
            except Exception:
                if captures.new:  # perhaps a placeholder's doing: trace again with the real arrays
                    raise _trace.Retrace() from None
                raise
            finally:
                _trace._state.capture = outer
                captures.tracers = None
            if captures.new:
                raise _trace.Retrace()
            out_leaves, out_tree[0] = tree_flatten(out)
            return [_as_value(o) for o in out_leaves]

        return body

    def _discover(self, args, static, leaves, treedef, dyn_pos, captures):
        body = self._body(args, static, leaves, treedef, dyn_pos, captures, [None])
        try:
            _sdk_call(_t.trace_nodes, _trace.callback(body), [])
        except _trace.Retrace:
            pass

    def _make(self, args, static, leaves, treedef, dyn_pos, shardings, dyn, captures):
        out_tree = [None]
        n = len(args)
        body = self._body(args, static, leaves, treedef, dyn_pos, captures, out_tree)
        in_specs = []
        for i in dyn_pos:
            s = shardings[i]
            in_specs.append(None if s is None or not isinstance(leaves[i], Array)
                            else (s.spec if isinstance(s, NamedSharding) else s)._cpp())
        donate = []
        if self._donate:
            # Top-level positions to positions among the flat dynamic leaves.
            pos, k = {}, 0
            dyn_index = [i for i in range(n) if i not in static]
            for j, i in enumerate(dyn_index):
                for l in tree_leaves(dyn[j]):
                    if _is_dynamic(l):
                        pos.setdefault(i, []).append(k)
                        k += 1
            donate = [k for i in self._donate for k in pos.get(i % n, [])]
        in_specs += [None] * len(captures.arrays)  # each capture as it is placed
        cpp = _t.Jitted(_trace.callback(body), in_specs, donate, 60.0)
        return cpp.__call__, out_tree, captures

    def lower(self, *args, **kwargs):
        raise NotImplementedError("jit(...).lower: use as_text() after a call")

    def as_text(self):
        """The compiled program of the last-made signature (the SDK's Jitted::as_text)."""
        if not self._cache:
            return ""
        return next(reversed(self._cache.values()))[0].__self__.as_text()


def _as_value(x):
    from .numpy import _tracer
    return _tracer(x)._v


def _constrain_outputs(out, out_shardings):
    if out_shardings is None:
        return out
    flat, tree = tree_flatten(out)
    specs = broadcast_prefix(out_shardings, out, _is_sharding)
    from .lax import with_sharding_constraint
    return tree_unflatten(tree, [o if s is None else with_sharding_constraint(o, s) for o, s in zip(flat, specs)])


def jit(fun=None, *, in_shardings=None, out_shardings=None, static_argnums=(), donate_argnums=(), **unsupported):
    """jax.jit: `fun` traced on its arguments' types and shardings, compiled by the
    coordinator and run on the devices; returns the outputs at once (asynchronous dispatch)."""
    if unsupported:
        raise TypeError(f"jit: unsupported options {sorted(unsupported)}")
    if fun is None:
        return functools.partial(jit, in_shardings=in_shardings, out_shardings=out_shardings,
                                 static_argnums=static_argnums, donate_argnums=donate_argnums)
    return _Jitted(fun, in_shardings, out_shardings, static_argnums, donate_argnums)


_eager_cache = {}


def _eager(fn, args, kwargs):
    """One op on concrete arrays: a jitted program of that op, cached per op."""
    j = _eager_cache.get(fn)
    if j is None:
        j = _eager_cache[fn] = _Jitted(fn, None, None, (), ())
    return j(*args, **kwargs)


def _traced_or_jitted(fun, traced):
    """A transformation's function (`traced`, written on Tracers): called in a trace it records
    there; on concrete arrays it runs as a jitted program of its own."""
    jitted = _Jitted(traced, None, None, (), ())

    @functools.wraps(fun)
    def run(*args):
        if _trace.in_trace() or any(isinstance(l, Tracer) for l in tree_leaves(args)):
            return traced(*args)
        return jitted(*args)

    return run


# ---- grad -------------------------------------------------------------------------------

def _grad(fun, argnums, has_aux, with_value):
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def traced(*args):
        per_arg = [tree_flatten(a) for a in args]
        values, owner = [], []
        for i, (ls, _) in enumerate(per_arg):
            for l in ls:
                from .numpy import _tracer
                values.append(_tracer(l)._v)
                owner.append(i)
        flat_nums = [k for i in nums for k, o in enumerate(owner) if o == i % len(args)]

        aux = []  # has_aux: the SDK records fun in this trace, so its aux values are ours too

        def body(vals):
            it = iter(Tracer(v) for v in vals)
            rebuilt = [tree_unflatten(t, [next(it) for _ in ls]) for ls, t in per_arg]
            out = fun(*rebuilt)
            if has_aux:
                if not (isinstance(out, (tuple, list)) and len(out) == 2):
                    raise TypeError("grad(has_aux=True) requires the function to return a pair (value, aux), "
                                    f"not a {type(out).__name__}")
                out, a = out
                aux.append(a)
            return [_as_value(out)]

        outs = [Tracer(v) for v in _t.grad(_trace.callback(body), flat_nums, with_value)(values)]
        value = outs.pop(0) if with_value else None
        grads, k = [], 0
        for i in nums:
            ls, t = per_arg[i % len(args)]
            grads.append(tree_unflatten(t, outs[k:k + len(ls)]))
            k += len(ls)
        g = grads[0] if isinstance(argnums, int) else tuple(grads)
        if has_aux:
            return ((value, aux[0]), g) if with_value else (g, aux[0])
        return (value, g) if with_value else g

    return _traced_or_jitted(fun, traced)


def grad(fun, argnums=0, has_aux=False):
    """jax.grad over pytrees of dicts, lists and tuples: the SDK's reverse mode. With has_aux
    the function returns (value, aux) and grad returns (gradients, aux), as JAX."""
    return _grad(fun, argnums, has_aux, False)


def value_and_grad(fun, argnums=0, has_aux=False):
    return _grad(fun, argnums, has_aux, True)


def checkpoint(fun, *, prevent_cse=True, policy=None, static_argnums=()):
    """jax.checkpoint / jax.remat(fun), inside a trace: the same values, but grad recomputes
    fun's forward in the backward pass instead of keeping its intermediates (the SDK's
    checkpoint). `policy` (tessera.checkpoint_policies, or any callable taking JAX's
    `(prim, *args, **params)`) names the values to keep instead: grad reads them and does not
    compute them again; inside a shard_map body too. static_argnums is not supported."""
    if static_argnums:
        raise TypeError("checkpoint: static_argnums is not supported")
    del prevent_cse  # the recomputation is inside a sub-program: nothing can merge it away
    if policy is not None and not callable(policy):
        raise TypeError(f"checkpoint: policy must be callable as jax.checkpoint_policies' are, not {policy!r}")
    raised = []

    def decide(primitive, dimension_numbers):
        if raised:
            return False
        try:
            params = {} if dimension_numbers is None else {"dimension_numbers": dimension_numbers}
            return bool(policy(checkpoint_policies.Primitive(primitive), **params))
        except Exception as e:  # raised by checkpoint once the trace is back
            raised.append(e)
            return False

    @functools.wraps(fun)
    def wrapped(*args):
        from .numpy import _tracer
        leaves, tree = tree_flatten(args)
        out_tree = [None]

        def body(values):
            out, out_tree[0] = tree_flatten(fun(*tree_unflatten(tree, [Tracer(v) for v in values])))
            return [_tracer(o)._v for o in out]

        out = _t.checkpoint(_trace.callback(body), [_tracer(l)._v for l in leaves], None if policy is None else decide)
        if raised:
            raise raised[0]
        if out_tree[0] is None:  # fun raised: its exception (kept by the callback) goes on
            raise getattr(_trace._state, "error", None) or TypeError("checkpoint: the function returned no value")
        return tree_unflatten(out_tree[0], [Tracer(v) for v in out])

    return wrapped


remat = checkpoint


# ---- vmap -------------------------------------------------------------------------------

def _is_axis(a):
    return a is None or isinstance(a, int)


def _key_axes(axes, tree):
    """vmap's axes, one per leaf of `tree`, as axes of the leaves' data: a negative axis of a
    typed key array counts from before its data's trailing dimension of two words."""
    from .tree_util import tree_leaves as leaves_of, PRNGKeyArray
    return [a - 1 if isinstance(l, PRNGKeyArray) and a is not None and a < 0 else a
            for a, l in zip(axes, leaves_of(tree))]


def vmap(fun, in_axes=0, out_axes=0, axis_name=None, axis_size=None, spmd_axis_name=None):
    """jax.vmap(fun, in_axes, out_axes, axis_size, spmd_axis_name): fun mapped over one dimension
    of its arguments (in_axes: an int, None, or a pytree prefix of the arguments' tuple, as JAX),
    its results' mapped dimension put at out_axes (likewise, of the results). The SDK's vmap: fun
    is traced once on one example's shapes and each of its ops batched by its batching rule,
    so the mapped program is one program of the ordinary ops. Called on concrete arrays it is
    compiled and run as jit runs it. Arrays split along the mapped dimension over Explicit mesh
    axes keep that split (fun sees each example typed without it); spmd_axis_name (a mesh axis
    name or a tuple of them) splits the mapped dimension of each with_sharding_constraint inside
    over those axes. axis_name (collectives over the mapped axis) is not supported."""
    if axis_name is not None:
        raise NotImplementedError("vmap: axis_name is not supported (no collectives over a mapped axis)")
    spmd_axes = [] if spmd_axis_name is None else \
        [spmd_axis_name] if isinstance(spmd_axis_name, str) else list(spmd_axis_name)
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)  # as JAX: a list of in_axes is a tuple, one per argument

    def traced(*args):
        from .numpy import _tracer
        prefix = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        if isinstance(in_axes, tuple) and len(in_axes) != len(args):
            raise ValueError(f"vmap in_axes must be an int, None, or a tuple of entries corresponding to the "
                             f"positional arguments passed to the function, but got len(in_axes)={len(in_axes)}, "
                             f"len(args)={len(args)}")
        axes = _key_axes(broadcast_prefix(prefix, args, _is_axis), args)
        leaves, tree = tree_flatten(args)
        out = {}

        def body(values):
            res = fun(*tree_unflatten(tree, [Tracer(v) for v in values]))
            flat, out["tree"] = tree_flatten(res)
            out["axes"] = _key_axes(broadcast_prefix(out_axes, res, _is_axis) if not _is_axis(out_axes)
                                    else [out_axes] * len(flat), res)
            return [_as_value(o) for o in flat]

        values = _t.vmap(_trace.callback(body), [_tracer(l)._v for l in leaves], axes,
                         lambda: out["axes"], axis_size, spmd_axes)
        if "tree" not in out:  # fun raised (its exception, kept by the callback, goes on) or did not run
            raise getattr(_trace._state, "error", None) or _trace.TraceFailed("vmap: see the trace's error")
        return tree_unflatten(out["tree"], [Tracer(v) for v in values])

    return _traced_or_jitted(fun, traced)


# ---- make_jaxpr -------------------------------------------------------------------------

def _var_name(k):
    """JAX's variable names: a, b, ..., z, ba, bb, ..."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    name = letters[k % 26]
    k //= 26
    while k:
        name = letters[k % 26] + name
        k //= 26
    return name


class ClosedJaxpr:
    """What make_jaxpr returns: the traced program printed as JAX prints a jaxpr, one
    equation per op of the SDK's Graph (its op names and attributes, not JAX's primitives),
    without the ops no output reads (which the compiler drops too). `eqns` is the equations'
    text, `in_avals` / `out_avals` the inputs' and outputs' types."""

    def __init__(self, nodes, params, outputs):
        live = set(outputs)
        for i in range(len(nodes) - 1, -1, -1):
            if i in live:
                live.update(nodes[i][1])
        names = {}

        def name(i):
            if i not in names:
                names[i] = _var_name(len(names))
            return names[i]

        self.in_avals = [nodes[p][2] for p in params]
        self.out_avals = [nodes[o][2] for o in outputs]
        invars = " ".join(f"{name(p)}:{nodes[p][2]}" for p in params)
        self.eqns = []
        for i, (op, operands, type_text, attrs) in enumerate(nodes):
            if i not in live or i in params:
                continue
            attrs = attrs.strip()
            args = " ".join(name(o) for o in operands)
            self.eqns.append(f"{name(i)}:{type_text} = {op}{f'[{attrs}]' if attrs else ''}{' ' if args else ''}{args}")
        body = "".join(f"\n    {e}" for e in self.eqns)
        outs = ", ".join(name(o) for o in outputs) + ("," if len(outputs) == 1 else "")
        self._text = f"{{ lambda ; {invars}. let{body}\n  in ({outs}) }}"

    def __str__(self):
        return self._text

    __repr__ = __str__


def make_jaxpr(fun, static_argnums=()):
    """jax.make_jaxpr(fun)(*args): the program fun traces to on the arguments' types (Arrays,
    numpy arrays or ShapeDtypeStruct-like values with .shape and .dtype), as a ClosedJaxpr
    whose str() reads like JAX's listing. static_argnums is not supported."""
    if static_argnums:
        raise TypeError("make_jaxpr: static_argnums is not supported")

    @functools.wraps(fun)
    def make(*args, **kwargs):
        from .numpy import _DTYPES, canonical_dtype
        leaves, tree = tree_flatten((args, kwargs))
        types = []
        for l in leaves:
            a = l if hasattr(l, "shape") and hasattr(l, "dtype") else _np.asarray(l)
            types.append((_DTYPES[canonical_dtype(_np.dtype(a.dtype))], list(a.shape)))

        def body(values):
            a, k = tree_unflatten(tree, [Tracer(v) for v in values])
            return [_as_value(o) for o in tree_leaves(fun(*a, **k))]

        nodes, params, outputs = _sdk_call(_t.trace_nodes, _trace.callback(body), types)
        return ClosedJaxpr(nodes, params, outputs)

    return make


# ---- shard_map --------------------------------------------------------------------------

_NO_OUT_SPECS = object()  # out_specs not given (None is a pytree: no outputs)


def shard_map(f=None, mesh=None, in_specs=None, out_specs=_NO_OUT_SPECS, check_vma=True, check_rep=None,
              axis_names=frozenset(), **unsupported):
    """jax.shard_map(f, mesh=, in_specs=, out_specs=, axis_names=): f runs per device on blocks,
    with the collectives of tessera.lax; the SDK's shard_map. axis_names (a set; empty: every
    mesh axis) are the axes the body is manual over; the specs and collectives may name only
    those. out_specs is a pytree prefix of the results: None (no leaves) for a body returning
    None."""
    if unsupported:
        raise TypeError(f"shard_map: unsupported options {sorted(unsupported)}")
    if not isinstance(axis_names, (set, frozenset)):
        raise TypeError("`axis_names` argument of shard_map should be of type `frozenset` or `set`. "
                        f"Got type: {type(axis_names)}")
    if f is None:
        return functools.partial(shard_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                 check_vma=check_vma, check_rep=check_rep, axis_names=axis_names)
    if out_specs is _NO_OUT_SPECS:
        raise TypeError("shard_map needs out_specs")
    check = check_vma if check_rep is None else check_rep
    cache = {}
    fixed_mesh = mesh

    eager = {}
    # out_specs=P(...) is a prefix of any output tree: the SDK gives that one spec to every result.
    for_all = isinstance(out_specs, PartitionSpec)

    def leaf_specs(args, leaves):
        if in_specs is None:
            # Omitted: the SDK infers each from its argument's type, on a mesh whose axes are
            # all Explicit (JAX's in_specs=Infer), and reports any other mesh. An argument
            # placed here goes as its type will then say: a committed Array as it is, others
            # replicated.
            return [l.sharding.spec if isinstance(l, Array) and l._committed else PartitionSpec() for l in leaves]
        prefix = in_specs if isinstance(in_specs, (tuple, list)) and not isinstance(in_specs, PartitionSpec) \
            else (in_specs,) * len(args)
        return broadcast_prefix(tuple(prefix), args, lambda p: isinstance(p, PartitionSpec))

    def make(args, out_flat, mesh, body_mesh):
        leaves, treedef = tree_flatten(args)
        specs = leaf_specs(args, leaves)
        cpp_specs = [] if in_specs is None else [s._cpp() for s in specs]
        # One out_spec per output: the leaves of out_specs, until the body has shown its outputs.
        if out_flat is None:
            out_flat = [out_specs] if for_all else tree_leaves(out_specs, lambda p: isinstance(p, PartitionSpec))
        seen = {}

        def body(values):
            # The body's abstract mesh, its manual axes Manual, as JAX's shard_map: the SDK's
            # (None), or the one in force made Manual (body_mesh) when shard_map took it.
            with _in_force(body_mesh):
                out = f(*tree_unflatten(treedef, [Tracer(v) for v in values]))
            out_leaves, seen["tree"] = tree_flatten(out)
            seen["specs"] = broadcast_prefix(out_specs, out, lambda p: isinstance(p, PartitionSpec))
            return [_as_value(o) for o in out_leaves]

        # The mesh's order, then any name not in the mesh (which the SDK reports).
        names = [a for a in mesh.axis_names if a in axis_names]
        names += sorted(a for a in axis_names if a not in mesh.axis_names)
        sm = _t.shard_map(_trace.callback(body), mesh._cpp, cpp_specs,
                          [s._cpp() for s in out_flat], check, names, for_all and len(out_flat) == 1)
        return sm, seen, specs, None if for_all else len(out_flat)

    def run(entry, leaves):
        from .numpy import _tracer
        return [Tracer(v) for v in entry[0].call_values([_tracer(l)._v for l in leaves])]

    def call_on(resolved, *args):
        leaves, treedef = tree_flatten(args)
        # (mesh, body_mesh): resolved when called outside a trace, for the jit that runs it.
        mesh, body_mesh = resolved or _resolve_shard_map_mesh(fixed_mesh, leaves, axis_names)
        if not (_trace.in_trace() or any(isinstance(l, Tracer) for l in leaves)):
            if not for_all and not tree_leaves(out_specs, lambda p: isinstance(p, PartitionSpec)):
                # No results (out_specs=None): nothing to run, and the SDK compiles no program
                # without outputs; the body is traced (what it prints, it prints) and its empty
                # result returned, as JAX returns it.
                result = []
                make_jaxpr(lambda *a: result.append(call_on((mesh, body_mesh), *a)) or result[-1])(*args)
                return result[-1]
            # Outside a trace: the jit of this shard_map (so the arrays its body closes over are
            # captured as jit captures them), its arguments placed by their in_specs first.
            placed = [l if isinstance(l, Array) and l._committed else _put_one(l, NamedSharding(mesh, s))
                      for l, s in zip(leaves, leaf_specs(args, leaves))]
            j = eager.get((treedef, mesh, body_mesh))
            if j is None:
                j = eager[(treedef, mesh, body_mesh)] = _Jitted(functools.partial(call_on, (mesh, body_mesh)), None,
                                                                None, (), (), default_mesh=mesh)
            return j(*tree_unflatten(treedef, placed))
        key = (treedef, mesh, body_mesh)
        entry = cache.get(key)
        if entry is None:
            entry = make(args, None, mesh, body_mesh)
        try:
            outs = run(entry, leaves)
            error = None
        except errors.InvalidArgumentError as e:
            outs, error = None, e
        seen = entry[1]
        if entry[3] is not None and "specs" in seen and len(seen["specs"]) != entry[3]:
            # out_specs is a prefix of more outputs than it has leaves: make the program again
            # with one spec per output, now that the body has shown them.
            entry = make(args, seen["specs"], mesh, body_mesh)
            outs, error = run(entry, leaves), None
        if error is not None:
            raise error
        if "tree" not in entry[1]:
            # The body raised inside an enclosing trace: its exception is the error to show.
            pending = getattr(_trace._state, "error", None)
            if pending is not None:
                _trace._state.error = None
                raise pending
            raise _trace.TraceFailed("shard_map: see the trace's error")  # the SDK's, raised at the trace's end
        cache[key] = entry
        return tree_unflatten(entry[1]["tree"], outs)

    call = functools.partial(call_on, None)

    # Its mesh when called, for a jit of it to move uncommitted arguments there.
    call._shard_map_mesh = lambda: fixed_mesh if fixed_mesh is not None else _ambient_mesh()
    return call


def _resolve_shard_map_mesh(fixed_mesh, leaves, axis_names):
    """The mesh a shard_map runs on when called, and the abstract mesh its body sees (None: the
    SDK's, its mesh with the manual axes Manual). As jax/_src/shard_map.py's _shmap_checks:
    mesh= must match the abstract mesh in force (use_abstract_mesh's); without mesh= the body
    takes the abstract mesh in force (its axis types, the manual axes Manual), and the devices
    are the concrete mesh's in force (set_mesh's, when resolved, not when defined), else a
    committed argument's (_shard_map_impl's get_concrete_mesh / get_mesh_from_args), which must
    have the abstract mesh's axis names and sizes."""
    in_force = _abstract_override()
    if in_force is not None and in_force.empty:
        in_force = None
    if fixed_mesh is not None:
        if in_force is not None and fixed_mesh.abstract_mesh != in_force:
            raise ValueError(f"The context mesh {in_force} should match the mesh passed to shard_map {fixed_mesh}")
        return fixed_mesh, None
    mesh = _ambient_mesh()
    if mesh is None and in_force is not None:
        mesh = next((l.sharding.mesh for l in leaves if isinstance(l, Array) and l._committed), None)
    if mesh is None:
        if in_force is not None:
            raise ValueError(f"shard_map: the context mesh {in_force} has no devices: set a concrete mesh "
                             "(tessera.set_mesh), pass mesh=, or pass committed arrays")
        raise TypeError("shard_map needs mesh= or an ambient mesh (tessera.set_mesh) when called")
    if in_force is None:
        return mesh, None
    if in_force.shape_tuple != mesh.abstract_mesh.shape_tuple:
        raise ValueError(f"shard_map: the context mesh {in_force} and the concrete mesh {mesh} it runs on have "
                         "different axes")
    manual = in_force.axis_names if not axis_names else [a for a in in_force.axis_names if a in axis_names]
    return mesh, in_force.update_axis_types({a: AxisType.Manual for a in manual})


# ---- placement --------------------------------------------------------------------------

def device_put(x, device=None, *, donate=False, may_alias=None):
    """jax.device_put: numpy arrays (and Python scalars) to the cluster under a sharding
    (each device receives exactly its block); an Array to another sharding (on its mesh,
    a jitted reshard; on another mesh, worker to worker). A pytree of either, with a
    sharding or a prefix pytree of them."""
    leaves, treedef = tree_flatten(x)
    targets = broadcast_prefix(device, x, lambda p: p is None or isinstance(p, (NamedSharding, PartitionSpec, Device)))
    return tree_unflatten(treedef, [_put_one(l, t) for l, t in zip(leaves, targets)])


_reshard = {}


def _put_one(x, target):
    if target is None:
        if isinstance(x, Array):
            return x  # jax.device_put(x): where it is, committed or not
        target = _default_sharding()
    elif isinstance(target, Device):
        target = NamedSharding(Mesh([target], ("_default",)), PartitionSpec())
    else:
        target = _as_named(target, "device_put")
    if isinstance(x, Array):
        if x.sharding == target:
            return x if x._committed else Array(config.client().device_put_array(x._a, target._cpp))  # commits
        if x.sharding.mesh == target.mesh:
            from .lax import with_sharding_constraint
            j = _reshard.get(target)
            if j is None:
                j = _reshard[target] = _Jitted(lambda a: with_sharding_constraint(a, target), None, None, (), ())
            return Array(j(x)._a)  # committed to the sharding asked for
        # Another mesh: the workers move the blocks between them (never through this process).
        return Array(config.client().device_put_array(x._a, target._cpp))
    return _put_numpy(x, target)


def reshard(x, out_shardings):
    """jax.reshard / jax.sharding.reshard: x (a pytree of arrays or traced values) laid out by
    out_shardings (a NamedSharding, a P on the explicit or ambient mesh, or a prefix pytree of
    them). Inside a trace the move is part of the program and the type becomes the spec;
    outside, an Array moves by collectives on the workers, a bare P onto the ambient mesh (as
    JAX's canonicalize_sharding; none set is a ValueError naming how to set one)."""
    leaves, treedef = tree_flatten(x)
    targets = broadcast_prefix(out_shardings, x, lambda p: isinstance(p, (NamedSharding, PartitionSpec)))
    out = []
    for l, t in zip(leaves, targets):
        if isinstance(l, Tracer):
            from .numpy import _wrap
            mesh = t.mesh if isinstance(t, NamedSharding) else _ambient_mesh()
            spec = t.spec if isinstance(t, NamedSharding) else t
            _check_in_force("reshard", spec)
            out.append(_wrap(_t.reshard(l._v, spec._cpp(), None if mesh is None else mesh._cpp)))
        else:
            out.append(_put_one(l, _explicit_only(_as_named(t, "reshard"), "reshard")))
    return tree_unflatten(treedef, out)


class ManualAxisType:
    """jax's ManualAxisType (jax/_src/core.py): the manual mesh axes a value of a shard_map body
    varies along (`varying`, a frozenset). Tessera's types have no reduced or unreduced axes."""

    def __init__(self, varying=()):
        self.varying = frozenset(varying)
        self.unreduced = frozenset()
        self.reduced = frozenset()

    def __repr__(self):
        return f"ManualAxisType(varying={self.varying}, unreduced={self.unreduced}, reduced={self.reduced})"


class ShapedArray:
    """What typeof gives: shape, dtype, the sharding over Explicit mesh axes and, inside a
    shard_map body, the manual axes the value varies along. str() is JAX's (jax/_src/core.py
    ShapedArray.__str__, str_short_aval with the dtype's full name): float32[8@X,2],
    float32[2,2]{V:(i,j)}; repr() is ShapedArray(float32[8@X,2]); `.sharding.spec` the type's
    spec (None for dimensions on no Explicit axis); `.manual_axis_type.varying` (also `.mat`)
    the varying axes."""

    def __init__(self, shape, dtype, text, mesh=None, varying=()):
        from ._prng import KeyTy
        self.shape, self.dtype = tuple(shape), dtype if isinstance(dtype, KeyTy) else _np.dtype(dtype)
        # The SDK's text starts with the short dtype name (f32[...]); JAX's str has the full one.
        self._text = self.dtype.name + text[text.index("["):]
        self._mesh = mesh
        self.manual_axis_type = ManualAxisType(varying)

    @property
    def mat(self):
        return self.manual_axis_type

    def __str__(self):
        return self._text

    def __repr__(self):
        return f"ShapedArray({self._text})"

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def sharding(self):
        """NamedSharding(the AbstractMesh of the type, the type's spec), as JAX's
        jax.typeof(x).sharding (its mesh the abstract mesh in force when typeof was asked; for
        an Array, its mesh's)."""
        import re
        dims = self._text[self._text.index("[") + 1:self._text.index("]")]
        entries = []
        for _, axes in re.findall(r"(\d+)(?:@(\([^)]*\)|[^,\]]+))?", dims):
            entries.append(None if not axes else tuple(axes.strip("()").split(",")) if axes.startswith("(") else axes)
        # The unreduced axes: {U:X} or {U:(X,Y)} (with {V:...} inside a shard_map body).
        u = re.search(r"U:(\([^)]*\)|[^,}]+)", self._text[self._text.index("]"):])
        unreduced = set() if u is None else set(u.group(1).strip("()").split(","))
        # The reduced axes: {R:X} or {R:(X,Y)}, after any {U:...}.
        r = re.search(r"R:(\([^)]*\)|[^,}]+)", self._text[self._text.index("]"):])
        reduced = set() if r is None else set(r.group(1).strip("()").split(","))
        spec = PartitionSpec(*entries, unreduced=unreduced, reduced=reduced)
        return NamedSharding(self._mesh if self._mesh is not None else get_abstract_mesh(), spec)

    def __eq__(self, other):
        return isinstance(other, ShapedArray) and other._text == self._text

    def __hash__(self):
        return hash(self._text)


_short = {"float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64", "bool": "bool", "uint32": "u32"}


def typeof(x):
    """jax.typeof: inside a trace of explicit mode (a mesh with Explicit axes) the Value's
    sharding is part of its type, float32[16@data,8]; an Array's type shows its mesh's Explicit
    axes; anything else its (JAX-canonical) dtype and shape. A key array's is its data's
    without the trailing dimension of the two words, key<fry>[8@X] (prng.py PRNGKeyArray.aval:
    the key dimensions' shape and sharding)."""
    from ._prng import PRNGKeyArray
    if isinstance(x, PRNGKeyArray):
        data = typeof(x._base)
        dims, _, tail = data._text.partition("[")[2].partition("]")
        lead, _, words = dims.rpartition(",")
        if words != "2":
            raise AssertionError(f"typeof: key data of type {data} split on its trailing dimension")
        return ShapedArray(x.shape, x.dtype, f"[{lead}]{tail}", data._mesh, varying=data.manual_axis_type.varying)
    if isinstance(x, Tracer):
        return ShapedArray(x.shape, x.dtype, _t.type_of(x._v), get_abstract_mesh(), varying=_t.varying_axes(x._v))
    if isinstance(x, Array):
        return ShapedArray(x.shape, x.dtype, _t.type_of_array(x._a), x.sharding.mesh.abstract_mesh)
    from .numpy import canonical_dtype
    a = _np.asarray(x)
    dt = canonical_dtype(a.dtype)
    return ShapedArray(a.shape, dt, f"[{','.join(str(d) for d in a.shape)}]")


def device_get(x):
    leaves, treedef = tree_flatten(x)
    idx = [i for i, l in enumerate(leaves) if isinstance(l, Array)]
    hosts = _t.device_get([leaves[i]._a for i in idx])
    for i, h in zip(idx, hosts):
        leaves[i] = h
    return tree_unflatten(treedef, leaves)


def block_until_ready(x):
    arrays = [l._a for l in tree_leaves(x) if isinstance(l, Array)]
    _t.block_until_ready(arrays)
    return x


def make_mesh(axis_shapes, axis_names, axis_types=None, devices=None, **unused):
    """jax.make_mesh: the devices (by default all alive ones that are not draining) laid
    row-major over the shape, each axis of `axis_types` (an AxisType or one per axis; Explicit
    by default, as JAX >= 0.9; `Mesh(...)` stays Auto, as jax.sharding.Mesh).
    (`devices` may also come third, as before axis_types existed.)"""
    from .sharding import _axis_types
    names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    if devices is None and axis_types is not None and not isinstance(axis_types, _t.AxisType) and \
            all(isinstance(d, Device) for d in _np.asarray(axis_types, dtype=object).flat):
        devices, axis_types = axis_types, None
    ids = None if devices is None else [d.id for d in _np.asarray(devices, dtype=object).flat]
    types = _axis_types(axis_types, len(names), "make_mesh")
    cpp = config.client().make_mesh([int(s) for s in axis_shapes], list(names), ids, types)
    return Mesh._from_cpp(cpp)

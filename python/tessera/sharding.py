"""jax.sharding's names: Mesh, NamedSharding, PartitionSpec (P), over the SDK's C++ types.

    mesh = tessera.make_mesh((4, 2), ("data", "model"))
    s = NamedSharding(mesh, P("data", None))
    s.shard_shape((16, 8))   # (4, 8)
"""
import functools
import threading

import numpy as np

from . import _tessera
from ._config import config


class Device:
    """One device of the cluster, as a jax Device (id, platform, ...)."""

    platform = "cpu"
    device_kind = "cpu"
    process_index = 0

    def __init__(self, id, address=""):
        self.id = id
        self.address = address

    def __repr__(self):
        return f"CpuDevice(id={self.id})"

    def __str__(self):
        return f"TFRT_CPU_{self.id}"

    def memory_stats(self):
        """jax Device.memory_stats(): a dict of int counters of this device's worker, JAX's
        names where they mean the same ('bytes_in_use', 'bytes_limit'), then the worker's
        ('num_buffers', 'bytes_put': shard bytes clients put there in all, 'bytes_fetched',
        'bytes_fanned_out', 'plans_loaded'; of bytes_put and bytes_fetched, those moved through
        shared memory with a client on the worker's host, 'shm_bytes_put' and
        'shm_bytes_fetched', and of these, those read from or written straight into the client's
        memory, 'client_memory_bytes_read' and 'client_memory_bytes_written'; collective
        messages received through shared memory from workers on its host,
        'shm_messages_received', and from workers in its process, 'in_process_messages_received')."""
        return config.client().memory_stats(self.id)

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(("tessera.Device", self.id))


_devices_cache = {}


def _device(id):
    d = _devices_cache.get(id)
    if d is None:
        d = _devices_cache[id] = Device(id)
    return d


def devices():
    """The cluster's devices, by id (jax.devices())."""
    out = []
    for d in config.client().devices():
        dev = _device(d.id)
        dev.address = d.address
        out.append(dev)
    return out


def _canonical_entry(e):
    """A PartitionSpec entry as jaxlib's CanonicalizePartition (partition_spec.cc) makes it: an
    empty tuple or list is None, one of one axis that axis, a list a tuple; a nested tuple is
    JAX's ValueError."""
    if isinstance(e, (tuple, list)):
        for a in e:
            if isinstance(a, (tuple, list)):
                raise ValueError(f"A tuple inside PartitionSpec cannot contain a nested tuple. Got partition: "
                                 f"{e} and the nested tuple: {a}")
            if not isinstance(a, str):
                raise TypeError(f"PartitionSpec entries are None, an axis name or a tuple of them, not {e!r}")
        return None if not e else e[0] if len(e) == 1 else tuple(e)
    if e is None or isinstance(e, str):
        return e
    raise TypeError(f"PartitionSpec entries are None, an axis name or a tuple of them, not {e!r}")


def _axis_set(name, val):
    """jax/_src/partition_spec.py's _canonicalize_ur: a set or frozenset of axis names."""
    if not isinstance(val, (set, frozenset)):
        raise TypeError(f"{name} argument of PartitionSpec should of type `frozenset` or `set`. Got type {type(val)}")
    if None in val:
        raise ValueError(f"{name} cannot contain None. All elements in {name} should refer to the mesh axes.")
    return frozenset(val)


class PartitionSpec(tuple):
    """jax.sharding.PartitionSpec: per dimension None, one mesh axis, or a tuple of axes; and
    the mesh axes the array is `unreduced` over (its devices along them hold terms of a sum)
    or `reduced` over (laid out as replicated; its cotangent is unreduced), as JAX's
    P(..., unreduced={'Y'}, reduced={'Z'}). The only unreduced_kind is sum."""

    def __new__(cls, *entries, unreduced=frozenset(), reduced=frozenset()):
        self = super().__new__(cls, tuple(_canonical_entry(e) for e in entries))
        self.unreduced = _axis_set("unreduced", unreduced)
        self.reduced = _axis_set("reduced", reduced)
        self._cpp()  # JAX's _check, with its words: ValueError
        return self

    @property
    def partitions(self):
        return tuple(self)

    @property
    def unreduced_kind(self):
        return "sum" if self.unreduced else None

    def _cpp(self):
        return _tessera.PartitionSpec([[] if e is None else [e] if isinstance(e, str) else list(e) for e in self],
                                      sorted(self.unreduced), sorted(self.reduced))

    @staticmethod
    def _from_cpp(spec):
        return PartitionSpec(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in spec.dims],
                             unreduced=set(spec.unreduced), reduced=set(spec.reduced))

    def update(self, partitions=None, unreduced=None, reduced=None):
        """JAX's P.update: this spec with other partitions, unreduced or reduced axes."""
        return PartitionSpec(*(tuple(self) if partitions is None else partitions),
                             unreduced=self.unreduced if unreduced is None else unreduced,
                             reduced=self.reduced if reduced is None else reduced)

    def __eq__(self, other):
        if isinstance(other, PartitionSpec):
            return (tuple(self) == tuple(other) and self.unreduced == other.unreduced
                    and self.reduced == other.reduced)
        return tuple.__eq__(self, other)

    def __ne__(self, other):
        return not self == other

    def __hash__(self):
        if not self.unreduced and not self.reduced:
            return tuple.__hash__(self)  # as the tuple it equals
        return hash((tuple(self), self.unreduced, self.reduced))

    def __repr__(self):
        return repr(self._cpp())

    def __getnewargs_ex__(self):
        return tuple(self), {"unreduced": self.unreduced, "reduced": self.reduced}


P = PartitionSpec


class AxisType:
    """jax.sharding.AxisType: Auto (the compiler propagates shardings), Explicit (shardings are
    part of the values' types: jax.typeof shows them, each op has a rule) and Manual
    (shard_map's)."""

    Auto = _tessera.AxisType.Auto
    Explicit = _tessera.AxisType.Explicit
    Manual = _tessera.AxisType.Manual


def _axis_types(axis_types, n, what):
    if axis_types is None:
        return []
    if isinstance(axis_types, _tessera.AxisType):
        axis_types = (axis_types,) * n
    axis_types = tuple(axis_types)
    for t in axis_types:
        if not isinstance(t, _tessera.AxisType):
            raise TypeError(f"{what}: axis_types entries are AxisType.Auto, .Explicit or .Manual, not {t!r}")
    return list(axis_types)


class Mesh:
    """jax.sharding.Mesh: an ndarray of devices with named axes, each of an AxisType (Auto by
    default, as jax.sharding.Mesh)."""

    def __init__(self, devices, axis_names, axis_types=None):
        devs = np.asarray(devices, dtype=object)
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        types = _axis_types(axis_types, len(axis_names), "Mesh")
        self.devices = devs
        self.axis_names = axis_names
        # JAX's empty mesh, Mesh(np.empty((), dtype=object), ()): what get_mesh() gives when
        # no mesh is set. It has no devices, so nothing can be placed on it.
        if not axis_names and devs.ndim == 0 and devs.flat[0] is None:
            self._cpp = None
            return
        self._cpp = _tessera.Mesh(list(devs.shape), list(axis_names), [d.id for d in devs.flat], types)

    @property
    def empty(self):
        return self._cpp is None

    @property
    def axis_types(self):
        return () if self.empty else tuple(self._cpp.axis_types)

    @staticmethod
    def _from_cpp(cpp):
        devs = np.empty(len(cpp.device_ids), dtype=object)
        for i, id in enumerate(cpp.device_ids):
            devs[i] = _device(id)
        return Mesh(devs.reshape(cpp.shape), cpp.axis_names, cpp.axis_types)

    @property
    def shape(self):
        return dict(zip(self.axis_names, self.devices.shape))

    @property
    def axis_sizes(self):
        return tuple(self.devices.shape)

    @property
    def size(self):
        return 0 if self.empty else self.devices.size

    @property
    def device_ids(self):
        return np.vectorize(lambda d: d.id, otypes=[int])(self.devices)

    @property
    def abstract_mesh(self):
        """The mesh without its devices (jax.sharding.Mesh.abstract_mesh)."""
        return AbstractMesh((), ()) if self.empty else AbstractMesh._from_cpp(self._cpp.abstract_mesh())

    def __eq__(self, other):
        if not isinstance(other, Mesh) or self.empty != other.empty:
            return False
        return self.empty or self._cpp == other._cpp

    def __hash__(self):
        return hash((self.axis_names, self.devices.shape, tuple(d.id for d in self.devices.flat),
                     tuple(int(t) for t in self._cpp.axis_types)))

    def __repr__(self):
        return "Mesh()" if self.empty else repr(self._cpp)

    def __enter__(self):
        _stacks.meshes.append(self)
        return self

    def __exit__(self, *exc):
        _stacks.meshes.pop()
        return False


class _Stacks(threading.local):
    """The mesh contexts in force, per thread as JAX's (set_mesh and use_abstract_mesh set
    thread-local config values: jax/_src/sharding_impls.py, jax/_src/mesh.py's swap_local), so
    threads tracing under different meshes do not see each other's. `meshes`: the concrete
    meshes set_mesh and `with mesh:` set, innermost last; `abstract`: see _abstract_override."""

    def __init__(self):
        self.meshes = []
        self.abstract = []


_stacks = _Stacks()


class _MeshContext:
    """What set_mesh returns: the mesh is set already; leaving a `with` block restores the
    mesh that was set before."""

    def __init__(self, mesh, depth):
        self._mesh, self._depth = mesh, depth

    def __enter__(self):
        return self._mesh

    def __exit__(self, *exc):
        del _stacks.meshes[self._depth:]
        return False


def set_mesh(mesh):
    """jax.set_mesh(mesh): makes `mesh` the ambient mesh that bare PartitionSpecs (device_put,
    with_sharding_constraint, jit's shardings) and a mesh-less shard_map resolve against; as a
    context manager (`with tessera.set_mesh(mesh):`) only inside its block."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"set_mesh: expected a Mesh, got {type(mesh).__name__}")
    depth = len(_stacks.meshes)
    _stacks.meshes.append(mesh)
    return _MeshContext(mesh, depth)


class AbstractMesh:
    """jax.sharding.AbstractMesh: axis sizes, names and types without devices (Explicit by
    default, as JAX's). What get_abstract_mesh() returns and what a traced value's type is over
    (jax.typeof(x).sharding.mesh). Prints as JAX's: AbstractMesh('X': 2, 'Y': 4,
    axis_types=(Auto, Explicit)); empty: AbstractMesh((), axis_types=())."""

    def __init__(self, axis_sizes, axis_names, axis_types=None):
        axis_names = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
        types = _axis_types(axis_types, len(axis_names), "AbstractMesh") or [AxisType.Explicit] * len(axis_names)
        if len(types) != len(axis_names) or len(tuple(axis_sizes)) != len(axis_names):
            raise ValueError("Number of axis names should match the number of axis_types and axis_sizes. Got "
                             f"axis_sizes={tuple(axis_sizes)}, axis_names={axis_names} and axis_types={tuple(types)}")
        self._cpp = _tessera.AbstractMesh([int(n) for n in axis_sizes], list(axis_names), types)

    @staticmethod
    def _from_cpp(cpp):
        m = AbstractMesh.__new__(AbstractMesh)
        m._cpp = cpp
        return m

    axis_sizes = property(lambda self: tuple(self._cpp.axis_sizes))
    axis_names = property(lambda self: tuple(self._cpp.axis_names))
    axis_types = property(lambda self: tuple(self._cpp.axis_types))
    shape_tuple = property(lambda self: tuple(zip(self.axis_names, self.axis_sizes)))
    shape = property(lambda self: dict(self.shape_tuple))
    size = property(lambda self: int(np.prod(self.axis_sizes)) if self.axis_names else 0)
    empty = property(lambda self: not self.axis_names)
    abstract_mesh = property(lambda self: self)

    def _of_type(self, t):
        return tuple(n for n, u in zip(self.axis_names, self.axis_types) if u == t)

    auto_axes = property(lambda self: self._of_type(AxisType.Auto))
    explicit_axes = property(lambda self: self._of_type(AxisType.Explicit))
    manual_axes = property(lambda self: self._of_type(AxisType.Manual))
    are_all_axes_auto = property(lambda self: bool(self.axis_names) and len(self.auto_axes) == len(self.axis_names))
    are_all_axes_explicit = property(
        lambda self: bool(self.axis_names) and len(self.explicit_axes) == len(self.axis_names))
    are_all_axes_manual = property(
        lambda self: bool(self.axis_names) and len(self.manual_axes) == len(self.axis_names))

    def update_axis_types(self, name_to_type):
        """This mesh with the named axes of the given types (jax's update_axis_types)."""
        return AbstractMesh(self.axis_sizes, self.axis_names,
                            tuple(name_to_type.get(n, t) for n, t in zip(self.axis_names, self.axis_types)))

    def __eq__(self, other):
        return isinstance(other, AbstractMesh) and self._cpp == other._cpp

    def __hash__(self):
        return hash((self.axis_sizes, self.axis_names, tuple(int(t) for t in self.axis_types)))

    def __repr__(self):
        return repr(self._cpp)


def _ambient_mesh():
    """The concrete mesh set by set_mesh (or `with mesh:`), or None."""
    return _stacks.meshes[-1] if _stacks.meshes else None


def get_abstract_mesh():
    """jax.sharding.get_abstract_mesh(): the AbstractMesh in force where it is called (empty
    when none is): use_abstract_mesh's inside its block; else the ambient mesh's outside a trace
    and at the top of a jitted function; in a shard_map body its manual axes are Manual; inside
    auto_axes / explicit_axes the switched axes are Auto / Explicit."""
    override = _abstract_override()
    if override is not None:
        return override
    mesh = _ambient_mesh()
    return AbstractMesh._from_cpp(_tessera.get_abstract_mesh(None if mesh is None else mesh._cpp))


def get_mesh():
    """jax.sharding.get_mesh() (jax/_src/sharding_impls.py): the concrete mesh set_mesh (or
    `with mesh:`) set, an empty Mesh (`.empty`) when none is; inside a trace a ValueError, as
    JAX's."""
    from ._trace import in_trace
    if in_trace():
        raise ValueError("`get_mesh` can only be used outside of `jax.jit`. Maybe you want "
                         "`jax.sharding.get_abstract_mesh()`?")
    mesh = _ambient_mesh()
    return mesh if mesh is not None else Mesh(np.empty((), dtype=object), ())


# _stacks.abstract: the abstract meshes in force, innermost last: use_abstract_mesh's blocks, and
# the scopes that put their own in force while their function is traced (JAX's shard_map,
# auto_axes, explicit_axes enter use_abstract_mesh themselves): None for a shard_map body (the
# SDK's get_abstract_mesh() gives its Manual axes).


def _abstract_override():
    """The AbstractMesh use_abstract_mesh put in force, or None. As JAX's (a thread-local
    config value, jax/_src/mesh.py), the block holds for everything traced inside it, a jitted
    function or a control-flow body included, until a shard_map body (its own mesh, Manual axes
    and all) or auto_axes / explicit_axes (the block's mesh with their axes switched)."""
    return _stacks.abstract[-1] if _stacks.abstract else None


class _in_force:
    """While a shard_map body (mesh None) or an auto_axes / explicit_axes function is traced:
    the abstract mesh it puts in force, when a use_abstract_mesh block is in force around it."""

    __slots__ = ["mesh", "pushed"]

    def __init__(self, mesh):
        self.mesh = mesh

    def __enter__(self):
        self.pushed = bool(_stacks.abstract)
        if self.pushed:
            _stacks.abstract.append(self.mesh)

    def __exit__(self, *exc):
        if self.pushed:
            _stacks.abstract.pop()
        return False


def _switched_in_force(axes, axis_type):
    """_in_force for auto_axes / explicit_axes over `axes`: JAX's _get_new_mesh
    (jax/_src/pjit.py), get_abstract_mesh().update_axis_types({a: axis_type})."""
    override = _abstract_override()
    if override is None:
        return _in_force(None)
    names = override.axis_names if axes is None else _axis_list(axes)
    return _in_force(override.update_axis_types({a: axis_type for a in names}))


def _check_in_force(api, spec):
    """Inside use_abstract_mesh: spec (reshard's, an out_sharding) names Explicit axes of its
    mesh only, the SDK's check and message (the SDK checks the trace's own types otherwise)."""
    override = _abstract_override()
    if override is not None:
        _tessera.check_explicit_axes(api, spec._cpp(), override._cpp)


class use_abstract_mesh:
    """jax.sharding.use_abstract_mesh(mesh) (jax/_src/mesh.py): a context manager making the
    AbstractMesh `mesh` the one in force in its block: get_abstract_mesh() returns it, and
    reshard and out_sharding specs may name only its Explicit axes
    (tests/pjit_test.py test_out_sharding_... with update_axis_types({'x': Auto})). As JAX's,
    `mesh` must be an AbstractMesh and may not change the size of the mesh in force. Tessera's
    traces take their axis types from the arguments' mesh: inside a trace the block changes the
    checks and get_abstract_mesh(), not the ops' typing rules, and a function traced inside it
    (a jitted function, a shard_map body) has its own trace's types."""

    __slots__ = ["mesh"]

    def __init__(self, mesh):
        if not isinstance(mesh, AbstractMesh):
            raise ValueError(f"Expected mesh of type `jax.sharding.AbstractMesh`. Got type: {type(mesh)}")
        self.mesh = mesh

    def __enter__(self):
        prev = get_abstract_mesh()
        if not prev.empty and not self.mesh.empty and prev.size != self.mesh.size:
            raise ValueError(f"use_abstract_mesh cannot change the size of the mesh. Got new mesh: {self.mesh} "
                             f"with size={self.mesh.size} and prev mesh: {prev} with size={prev.size}")
        _stacks.abstract.append(self.mesh)

    def __exit__(self, *exc):
        _stacks.abstract.pop()
        return False


def _context_mesh(what):
    if not _stacks.meshes:
        raise ValueError(f"{what}: a bare PartitionSpec needs a mesh: use NamedSharding(mesh, spec), "
                         "`with tessera.set_mesh(mesh):` or `with mesh:`")
    return _stacks.meshes[-1]


class NamedSharding:
    """jax.sharding.NamedSharding(mesh, spec)."""

    def __init__(self, mesh, spec):
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"NamedSharding's spec must be a PartitionSpec, not {spec!r}")
        self.mesh = mesh
        self.spec = spec
        # Over an AbstractMesh (a type's sharding, jax.typeof(x).sharding): no devices, so no
        # placement questions (shard_shape, devices_indices_map, ...) can be answered.
        self._cpp = None if isinstance(mesh, AbstractMesh) else _tessera.NamedSharding(mesh._cpp, spec._cpp())

    @staticmethod
    def _from_cpp(cpp):
        return NamedSharding(Mesh._from_cpp(cpp.mesh), PartitionSpec._from_cpp(cpp.spec))

    def shard_shape(self, global_shape):
        return tuple(self._cpp.shard_shape(list(global_shape)))

    @property
    def is_fully_replicated(self):
        return self._cpp.is_fully_replicated()

    @property
    def device_set(self):
        return set(self.mesh.devices.flat)

    addressable_devices = device_set

    @property
    def num_devices(self):
        return self.mesh.size

    def devices_indices_map(self, global_shape):
        """{device: index as a tuple of slices} (jax's Sharding.devices_indices_map)."""
        return {_device(d): tuple(slice(a, b) for a, b in index)
                for d, index, _ in self._cpp.device_shards(list(global_shape))}

    def is_equivalent_to(self, other, ndim):
        """jax's Sharding.is_equivalent_to: whether both place the same blocks of a rank-`ndim`
        array on the same devices, whatever their meshes and specs say (P('x') and
        P('x', None) on one mesh are equivalent for a matrix, though not equal)."""
        if not isinstance(other, NamedSharding):
            raise TypeError(f"is_equivalent_to: expected a NamedSharding, not {other!r}")
        return self._cpp.is_equivalent_to(other._cpp, int(ndim))

    def __eq__(self, other):
        if not isinstance(other, NamedSharding):
            return False
        if self._cpp is None or other._cpp is None:
            return self.mesh == other.mesh and self.spec == other.spec
        return self._cpp == other._cpp

    def __hash__(self):
        return hash((self.mesh, tuple(self.spec)))

    def __repr__(self):
        if self._cpp is None:
            return f"NamedSharding(mesh={self.mesh!r}, spec={self.spec!r})"
        return repr(self._cpp)


def _as_named(sharding, what):
    """A NamedSharding from one, or from a bare P under `with mesh:`."""
    if isinstance(sharding, NamedSharding):
        return sharding
    if isinstance(sharding, PartitionSpec):
        return NamedSharding(_context_mesh(what), sharding)
    raise TypeError(f"{what}: expected a NamedSharding or PartitionSpec, not {sharding!r}")


def _explicit_only(named, api):
    """`named` when its spec names Explicit axes only, as reshard and out_sharding take (JAX's
    canonicalize_sharding; use_abstract_mesh's types inside its block); else the SDK's ValueError
    naming api, the spec, the axis and its type."""
    override = _abstract_override()
    _tessera.check_explicit_axes(api, named.spec._cpp(), named.mesh._cpp if override is None else override._cpp)
    return named


def reshard(x, out_shardings):
    """jax.sharding.reshard (tessera.reshard)."""
    from ._api import reshard as _reshard
    return _reshard(x, out_shardings)


def _switch_axes(f, args, kwargs, run, eager, in_force):
    """f(*args, **kwargs) with its array arguments flattened to Values, through `run(body,
    values)` (the SDK's auto_axes / explicit_axes) inside a trace; outside one `eager()`, as
    JAX runs them op by op. Returns f's result tree."""
    from ._trace import Tracer, callback
    from .tree_util import data_flatten, tree_unflatten  # a typed key is its data, as under jit
    from .lax import _values
    leaves, tree = data_flatten(args)
    if not any(isinstance(l, Tracer) for l in leaves):
        return eager()
    out_tree = [None]

    def body(values):
        with in_force:
            out, out_tree[0] = data_flatten(f(*tree_unflatten(tree, [Tracer(v) for v in values]), **kwargs))
        return _values(out)

    out = run(callback(body), _values(leaves), out_tree)
    if out_tree[0] is None:  # f never ran or raised: the SDK failed the trace, whose end raises the error
        from . import _trace
        raise getattr(_trace._state, "error", None) or _trace.TraceFailed("explicit_axes/auto_axes: see the trace's error")
    return tree_unflatten(out_tree[0], [Tracer(v) for v in out])


def _switched_mesh(name, mesh, axes, to):
    """`mesh` with the axes `axes` (None: all) of type `to`, and whether one changed. As JAX's
    _get_new_mesh (jax/_src/pjit.py): a Manual axis cannot switch (NotImplementedError, JAX's
    words); an axis not in the mesh is a ValueError."""
    names = mesh.axis_names if axes is None else tuple(_axis_list(axes))
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    for a in names:
        if a not in types:
            raise ValueError(f"{name}: '{a}' is not an axis of {mesh!r}")
        if types[a] == AxisType.Manual:
            raise NotImplementedError("Going from `Manual` AxisType to `Auto` or `Explicit` AxisType is not allowed.")
    new_types = tuple(to if n in names else t for n, t in zip(mesh.axis_names, mesh.axis_types))
    return Mesh(mesh.devices, mesh.axis_names, new_types), new_types != mesh.axis_types


def _same_grid(a, b):
    return a.axis_names == b.axis_names and a.devices.shape == b.devices.shape and \
        all(x.id == y.id for x, y in zip(a.devices.flat, b.devices.flat))


def _retyped(tree, mesh):
    """`tree` with each committed Array laid out on `mesh`'s devices and axes put on `mesh`
    itself, in the same layout (only the axis types differ: each device copies its own block)."""
    from ._array import Array
    from ._api import device_put
    from .tree_util import data_map

    def one(leaf):
        if isinstance(leaf, Array) and leaf._committed:
            s = leaf.sharding
            if s.mesh != mesh and _same_grid(s.mesh, mesh):
                return device_put(leaf, NamedSharding(mesh, s.spec))
        return leaf

    return data_map(one, tree)


def _on_mesh(shardings, mesh):
    """`shardings` (a pytree prefix) with each bare P made NamedSharding(mesh, P)."""
    from .tree_util import tree_map
    return tree_map(lambda p: NamedSharding(mesh, p) if isinstance(p, PartitionSpec) else p, shardings,
                    is_leaf=lambda p: isinstance(p, (PartitionSpec, NamedSharding)))


def _arguments_mesh(args, explicit_only=False):
    """The mesh of the first committed Array in `args` (with an Explicit axis, if asked)."""
    from ._array import Array
    from .tree_util import data_leaves
    for leaf in data_leaves(args):
        if isinstance(leaf, Array) and leaf._committed:
            mesh = leaf.sharding.mesh
            if not explicit_only or AxisType.Explicit in mesh.axis_types:
                return mesh
    return None


def _specs(shardings, out_tree):
    """The PartitionSpec of each leaf of `out_tree` from `shardings` (a P, a NamedSharding, or
    a prefix pytree of them)."""
    from .tree_util import tree_unflatten, broadcast_prefix
    outs = tree_unflatten(out_tree, [0] * out_tree.num_leaves)
    each = broadcast_prefix(shardings, outs, lambda p: isinstance(p, (NamedSharding, PartitionSpec)))
    return [(s.spec if isinstance(s, NamedSharding) else s)._cpp() for s in each]


def _check_in_shardings(args, in_sharding, inner):
    """explicit_axes' rule for each argument's in_sharding (the SDK's, as the traced switch
    checks it): ValueError naming the argument, its type, its spec and the rule."""
    from .numpy import _enum
    from .tree_util import data_leaves, tree_structure
    leaves = data_leaves(args)  # a typed key's data: its spec names the key dimensions, the leading ones
    for i, (leaf, spec) in enumerate(zip(leaves, _specs(in_sharding, tree_structure(args)))):
        a = leaf if hasattr(leaf, "shape") and hasattr(leaf, "dtype") else np.asarray(leaf)
        _tessera.check_explicit_axes_in_sharding(i, _enum(a.dtype), list(a.shape), spec, inner._cpp)


def _required(kwargs, given, key):
    """`given`, else the call's keyword `key` (or key + "s"), popped; TypeError as JAX's when
    neither is there."""
    for k in (key, key + "s"):
        if k in kwargs:
            given = kwargs.pop(k)
    if given is None:
        raise TypeError(f"Missing required keyword argument: '{key}'")
    return given


def _axis_list(axes):
    return [] if axes is None else [axes] if isinstance(axes, str) else list(axes)


def auto_axes(f=None, /, *, axes=None, out_sharding=None):
    """jax.sharding.auto_axes: f with the Explicit mesh axes `axes` (a name, a tuple, or None:
    all) Auto inside (the types leave them out, the compiler decides there; get_abstract_mesh()
    shows them Auto); its results are then resharded to out_sharding (here or, as JAX, the
    call's `out_sharding=` keyword; `out_shardings=` as the explicit-sharding notebook spells
    it). Outside a trace f runs eagerly, as JAX's: its Array arguments are put on the mesh with
    those axes Auto (the same blocks: concrete shardings keep the axes, types do not), f runs
    with that mesh set, and its results are put on out_sharding."""
    if f is None:
        return lambda g: auto_axes(g, axes=axes, out_sharding=out_sharding)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        out = _required(kwargs, out_sharding, "out_sharding")
        from . import _tessera as _t
        from ._trace import callback

        def run(body, values, tree):
            specs = callback(lambda _: _specs(out, tree[0]))  # an error fails the trace
            return _t.auto_axes(body, values, _axis_list(axes), lambda: specs(None))

        def eager():
            from ._api import device_put
            from .tree_util import tree_leaves
            named = [s.mesh for s in tree_leaves(out, is_leaf=lambda p: isinstance(p, NamedSharding))
                     if isinstance(s, NamedSharding)]
            mesh = _ambient_mesh() or (named[0] if named else None) or _arguments_mesh(args)
            if mesh is None:
                return f(*args, **kwargs)
            inner, changed = _switched_mesh("auto_axes", mesh, axes, AxisType.Auto)
            if not changed:
                return f(*args, **kwargs)
            with set_mesh(inner):
                result = f(*_retyped(args, inner), **kwargs)
            return device_put(result, _on_mesh(out, mesh))

        return _switch_axes(f, args, kwargs, run, eager, _switched_in_force(axes, AxisType.Auto))

    return wrapped


def explicit_axes(f=None, /, *, axes=None, in_sharding=None):
    """jax.sharding.explicit_axes: f with the mesh axes `axes` (a name, a tuple, or None: all)
    Explicit inside: its arguments are first resharded to in_sharding (here or the call's
    `in_sharding=` / `in_shardings=` keyword), every op has its explicit rule, and the results'
    types leave those axes out again. Needs the ambient mesh (set_mesh) or an explicit trace
    (outside a trace: arguments on a mesh with an Explicit axis). Outside a trace f runs
    eagerly, as JAX's: the arguments are put on in_sharding over the mesh with those axes
    Explicit, f runs with that mesh set, and its results are put back on the mesh as it was,
    in the same layout."""
    if f is None:
        return lambda g: explicit_axes(g, axes=axes, in_sharding=in_sharding)

    @functools.wraps(f)
    def wrapped(*args, **kwargs):
        ins = _required(kwargs, in_sharding, "in_sharding")
        from . import _tessera as _t
        from .tree_util import tree_structure
        mesh = _ambient_mesh()

        def run(body, values, tree):
            return _t.explicit_axes(body, values, _axis_list(axes), _specs(ins, tree_structure(args)),
                                    None if mesh is None else mesh._cpp)

        def eager():
            from ._api import device_put
            outer = mesh or _arguments_mesh(args, explicit_only=True)
            if outer is None:  # JAX's words (jax/_src/pjit.py, _explicit_axes)
                raise ValueError("Context mesh cannot be empty. Please use `jax.set_mesh` API to enter into a mesh "
                                 "context when using `explicit_axes` API.")
            inner, _ = _switched_mesh("explicit_axes", outer, axes, AxisType.Explicit)
            _check_in_shardings(args, ins, inner)
            with set_mesh(inner):
                result = f(*device_put(args, _on_mesh(ins, inner)), **kwargs)
            return _retyped(result, outer)

        return _switch_axes(f, args, kwargs, run, eager, _switched_in_force(axes, AxisType.Explicit))

    return wrapped

"""Pytrees as jax.tree_util: tuples, lists, dicts (keys sorted), namedtuples and None are
nodes; everything else is a leaf (a typed key array too, as in JAX; the transformations see
its uint32 data instead: data_flatten).

    leaves, tree = tree_flatten({"w": w, "b": [b1, b2]})
    tree_unflatten(tree, [l * 2 for l in leaves])
"""
from ._prng import PRNGKeyArray


class PyTreeDef:
    """The structure of a pytree without its leaves; hashable and comparable."""

    __slots__ = ("kind", "aux", "children")

    def __init__(self, kind, aux, children):
        self.kind, self.aux, self.children = kind, aux, tuple(children)

    @property
    def num_leaves(self):
        if self.kind == "leaf":
            return 1
        return sum(c.num_leaves for c in self.children)

    def _key(self):
        return (self.kind, self.aux, tuple(c._key() for c in self.children))

    def __eq__(self, other):
        return isinstance(other, PyTreeDef) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        return f"PyTreeDef({self._key()})"


_LEAF = PyTreeDef("leaf", None, ())
_KEY = PyTreeDef("key", None, (_LEAF,))


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(x, "_fields")


def tree_flatten(tree, is_leaf=None):
    return _flatten(tree, is_leaf, False)


def _flatten(tree, is_leaf, keys_as_data):
    leaves = []

    def walk(x):
        if is_leaf is not None and is_leaf(x):
            leaves.append(x)
            return _LEAF
        if keys_as_data and isinstance(x, PRNGKeyArray):
            leaves.append(x._base)
            return _KEY
        if x is None:
            return PyTreeDef("none", None, ())
        if _is_namedtuple(x):
            return PyTreeDef("namedtuple", type(x), [walk(c) for c in x])
        if isinstance(x, (tuple, list)):
            return PyTreeDef(type(x).__name__, None, [walk(c) for c in x])
        if isinstance(x, dict):
            keys = tuple(sorted(x))
            return PyTreeDef("dict", keys, [walk(x[k]) for k in keys])
        leaves.append(x)
        return _LEAF

    return leaves, walk(tree)


def tree_unflatten(treedef, leaves):
    it = iter(leaves)

    def build(t):
        if t.kind == "leaf":
            return next(it)
        if t.kind == "key":
            return PRNGKeyArray(next(it))
        children = [build(c) for c in t.children]
        if t.kind == "none":
            return None
        if t.kind == "namedtuple":
            return t.aux(*children)
        if t.kind == "tuple":
            return tuple(children)
        if t.kind == "list":
            return children
        return dict(zip(t.aux, children))

    return build(treedef)


def data_flatten(tree, is_leaf=None):
    """tree_flatten as jit, vmap, grad, shard_map and device_put see a tree: a typed key array
    is a node over its uint32 data (JAX's dispatch registry; tree_unflatten wraps it again)."""
    return _flatten(tree, is_leaf, True)


def data_leaves(tree, is_leaf=None):
    return data_flatten(tree, is_leaf)[0]


def data_map(f, tree):
    """tree_map over data_flatten's leaves (a key array's data, wrapped again)."""
    leaves, treedef = data_flatten(tree)
    return tree_unflatten(treedef, [f(l) for l in leaves])


def tree_leaves(tree, is_leaf=None):
    return tree_flatten(tree, is_leaf)[0]


def tree_structure(tree, is_leaf=None):
    return tree_flatten(tree, is_leaf)[1]


def tree_map(f, tree, *rest, is_leaf=None):
    leaves, treedef = tree_flatten(tree, is_leaf)
    others = [treedef_leaves_of(treedef, r) for r in rest]
    return tree_unflatten(treedef, [f(*xs) for xs in zip(leaves, *others)])


def tree_all(tree, *, is_leaf=None):
    """jax.tree_util.tree_all: whether every leaf is truthy (a bool Array leaf is fetched)."""
    return all(bool(l) for l in tree_leaves(tree, is_leaf))


def tree_reduce(function, tree, initializer=None, is_leaf=None):
    """jax.tree_util.tree_reduce: functools.reduce over the leaves."""
    import functools
    leaves = tree_leaves(tree, is_leaf)
    return functools.reduce(function, leaves) if initializer is None else \
        functools.reduce(function, leaves, initializer)


def treedef_leaves_of(treedef, tree):
    """The leaves of `tree`, which must have `treedef`'s structure (ValueError otherwise)."""
    leaves, other = tree_flatten(tree)
    if other != treedef:
        raise ValueError(f"pytree structure mismatch: expected {treedef}, got {other}")
    return leaves


def broadcast_prefix(prefix, tree, is_prefix_leaf):
    """One entry of `prefix` per leaf of `tree`: `prefix` is a pytree prefix of `tree` (as
    jit's in_shardings and shard_map's in_specs are) whose leaves (is_prefix_leaf) apply to
    every leaf under them. ValueError naming both when `prefix` is not a prefix of `tree`."""
    out = []

    def walk(p, t):
        if is_prefix_leaf(p):
            out.extend([p] * tree_structure(t).num_leaves)
            return
        if p is None and t is None:  # both the empty pytree (out_specs=None for a body returning None)
            return
        if isinstance(p, (tuple, list)) and isinstance(t, (tuple, list)) and len(p) == len(t):
            for a, b in zip(p, t):
                walk(a, b)
            return
        if isinstance(p, dict) and isinstance(t, dict) and sorted(p) == sorted(t):
            for k in sorted(p):
                walk(p[k], t[k])
            return
        raise ValueError(f"{p!r} is not a pytree prefix of the arguments' structure {tree_structure(t)}")

    walk(prefix, tree)
    return out

"""tessera.lax: jax.lax's collectives (inside shard_map), with_sharding_constraint,
dot_general and the primitives the SDK has under lax's names."""
from . import _tessera as _t
from . import numpy as _jnp
from .numpy import (abs, add, ceil, cos, exp, floor, log, maximum as max, minimum as min, negative as neg,  # noqa: F401
                    sign, sin, sqrt, tanh, concatenate as _concatenate, power as pow, multiply as mul,
                    subtract as sub)
from .numpy import _op, _rsqrt as rsqrt, _logistic as logistic, _erf as erf, _tracer, _wrap, _enum  # noqa: F401
from .sharding import _as_named
from .tree_util import tree_map, broadcast_prefix, tree_flatten, tree_unflatten
from ._trace import Tracer


def _axes(axis_name):
    return [axis_name] if isinstance(axis_name, str) else list(axis_name)


def _collective(name):
    cpp = getattr(_t, name)

    def f(x, axis_name):
        if isinstance(x, (int, float)) and name == "psum":
            return x * axis_size(axis_name)  # psum(1, 'i'): the axis' size, as in JAX
        return tree_map(lambda v: _wrap(cpp(_tracer(v)._v, _axes(axis_name))), x)

    f.__name__ = name
    return f


psum = _collective("psum")
pmean = _collective("pmean")
pmax = _collective("pmax")
pmin = _collective("pmin")


def all_gather(x, axis_name, *, axis=0, tiled=False):
    return tree_map(lambda v: _wrap(_t.all_gather(_tracer(v)._v, _axes(axis_name), axis, tiled)), x)


def psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False):
    return tree_map(lambda v: _wrap(_t.psum_scatter(_tracer(v)._v, _axes(axis_name), scatter_dimension, tiled)), x)


def ppermute(x, axis_name, perm):
    perm = [(int(a), int(b)) for a, b in perm]
    return tree_map(lambda v: _wrap(_t.ppermute(_tracer(v)._v, _axes(axis_name), perm)), x)


def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=False):
    return tree_map(lambda v: _wrap(_t.all_to_all(_tracer(v)._v, _axes(axis_name), split_axis, concat_axis, tiled)), x)


def axis_index(axis_name):
    return _wrap(_t.axis_index(_axes(axis_name)))


def axis_size(axis_name):
    return _t.axis_size(_axes(axis_name))


def with_sharding_constraint(x, shardings):
    """jax.lax.with_sharding_constraint: pins intermediates' shardings (a NamedSharding, or a
    bare P under `with mesh:`, or a prefix pytree of them)."""
    leaves, tree = tree_flatten(x)
    targets = broadcast_prefix(shardings, x, lambda p: p is None or hasattr(p, "_cpp") or isinstance(p, tuple))
    out = [l if s is None else _wrap(_t.with_sharding_constraint(_tracer(l)._v, _as_named(s, "with_sharding_constraint")._cpp))
           for l, s in zip(leaves, targets)]
    return tree_unflatten(tree, out)


@_op
def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    (lc, rc), (lb, rb) = dimension_numbers
    out = _jnp.dot_general_(lhs, rhs, (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    return out if preferred_element_type is None else out.astype(preferred_element_type)


@_op
def div(x, y):
    a, b = _jnp._pair(x, y)
    return _wrap(_t.div(a._v, b._v))


def convert_element_type(x, new_dtype):
    return _jnp.astype(x, new_dtype)


@_op
def broadcast_in_dim(operand, shape, broadcast_dimensions):
    return _wrap(_t.broadcast_in_dim(_tracer(operand)._v, list(shape), list(broadcast_dimensions)))


@_op
def slice(operand, start_indices, limit_indices, strides=None):
    if strides is not None and any(s != 1 for s in strides):
        raise NotImplementedError("lax.slice with strides: Tessera's slice has unit strides")
    return _wrap(_t.slice(_tracer(operand)._v, list(start_indices), list(limit_indices)))


def concatenate(operands, dimension):
    return _concatenate(operands, axis=dimension)


def iota(dtype, size):
    return Tracer(_t.iota(_enum(dtype), [size], 0))


def select(pred, on_true, on_false):
    return _jnp.where(pred, on_true, on_false)


# ---- issue #15: stop_gradient, pad and the cumulative reductions, under lax's names ------

@_op
def stop_gradient(x):
    return tree_map(lambda v: _wrap(_t.stop_gradient(_tracer(v)._v)), x)


@_op
def pad(operand, padding_value, padding_config):
    x = _tracer(operand)
    value = _tracer(padding_value, x).astype(x.dtype)
    return _wrap(_t.pad(x._v, value._v, [tuple(int(v) for v in c) for c in padding_config]))


@_op
def top_k(operand, k):
    values, indices = _t.top_k(_tracer(operand)._v, k)
    return _wrap(values), _wrap(indices)


def cumsum(operand, axis=0, reverse=False):
    return _jnp._scan("cumsum", operand, axis, reverse)


def cumprod(operand, axis=0, reverse=False):
    return _jnp._scan("cumprod", operand, axis, reverse)


def cummax(operand, axis=0, reverse=False):
    return _jnp._scan("cummax", operand, axis, reverse)


def cummin(operand, axis=0, reverse=False):
    return _jnp._scan("cummin", operand, axis, reverse)

"""tessera.lax: jax.lax's collectives (inside shard_map), with_sharding_constraint,
dot_general and the primitives the SDK has under lax's names."""
import enum
import functools
from typing import NamedTuple, Sequence

import numpy as _np

from . import _tessera as _t
from . import numpy as _jnp
from .numpy import (abs, add, ceil, cos, exp, floor, log, maximum as max, minimum as min, negative as neg,  # noqa: F401
                    sign, sin, sqrt, tanh, concatenate as _concatenate, power as pow, multiply as mul,
                    subtract as sub)
from .numpy import _op, _rsqrt as rsqrt, _logistic as logistic, _erf as erf, _tracer, _wrap, _enum  # noqa: F401
from .sharding import _as_named
from .tree_util import tree_map, tree_leaves, broadcast_prefix, tree_unflatten, data_map
from .tree_util import data_flatten as tree_flatten  # loop carries and operands: a typed key is its data
from ._trace import Tracer
from ._prng import PRNGKeyArray, check_key_conversion, refuse_primitive, _NUM, _ANY, _INEXACT
from . import _trace
from . import errors as _errors


def _keys_refused(f, prim, *accepted):
    """lax's `prim` as the jnp function `f`, a key operand refused by the primitive's dtype rule
    (jax/_src/lax/lax.py: JAX's lax functions bind the primitive, with no jnp promotion first:
    lax.sub(k, 1) is "sub does not accept dtype key<fry> at position 0. ...")."""
    @functools.wraps(f)
    def lax_fun(*args, **kwargs):
        if any(isinstance(a, PRNGKeyArray) for a in args):
            refuse_primitive(prim, accepted, *args)
        return f(*args, **kwargs)
    return lax_fun


# (lax.py's accepted dtypes: add_p, sub_p, mul_p, div_p [_num, _num], max_p, min_p [_any, _any],
# rem_p [_int | _float] * 2, pow_p [_float | _complex, _int | _float | _complex], neg_p, sign_p
# _num, abs_p _signedint | _float | _complex, floor_p, ceil_p _float, the others _float | _complex.)
add, sub, mul = (_keys_refused(f, n, _NUM, _NUM) for f, n in ((add, "add"), (sub, "sub"), (mul, "mul")))
max, min = _keys_refused(max, "max", _ANY, _ANY), _keys_refused(min, "min", _ANY, _ANY)
rem = _keys_refused(_jnp.fmod, "rem", ("integer", "floating"), ("integer", "floating"))
pow = _keys_refused(pow, "pow", _INEXACT, _NUM)
neg, sign = _keys_refused(neg, "neg", _NUM), _keys_refused(sign, "sign", _NUM)
abs = _keys_refused(abs, "abs", ("signedinteger",) + _INEXACT)
floor, ceil = _keys_refused(floor, "floor", ("floating",)), _keys_refused(ceil, "ceil", ("floating",))
exp, log, sin, cos, tanh, sqrt, rsqrt, logistic = (_keys_refused(f, f.__name__, _INEXACT)
                                                    for f in (exp, log, sin, cos, tanh, sqrt, rsqrt, logistic))
erf = _keys_refused(erf, "erf", ("floating",))


def _axes(axis_name):
    return [axis_name] if isinstance(axis_name, str) else list(axis_name)


def _refuse_keys(name, x):
    """A reduction of typed keys is refused in the words of lax's dtype rules (a key has no sum
    or order; the collectives that only move data take keys, by their data)."""
    for leaf in tree_leaves(x):
        if isinstance(leaf, PRNGKeyArray):
            raise TypeError(f"{name} does not accept dtype {leaf.dtype}")


def _per_array(f, x):
    """tree_map of f(Tracer, key) over x's arrays: a typed key array's data with key=True,
    wrapped again as keys."""
    def one(v):
        if isinstance(v, PRNGKeyArray):
            return PRNGKeyArray(f(_tracer(v._base), True))
        return f(_tracer(v), False)

    return tree_map(one, x)


def _key_axis(axis, ndim, key):
    """A negative axis counted over a typed key array's `ndim` dimensions as the non-negative
    one (its data's trailing word dimension is not one of them); other axes as given."""
    return axis + ndim if key and axis < 0 else axis


def _collective(name):
    cpp = getattr(_t, name)

    def f(x, axis_name):
        if isinstance(x, (int, float)) and name == "psum":
            return x * axis_size(axis_name)  # psum(1, 'i'): the axis' size, as in JAX
        _refuse_keys(name, x)
        return tree_map(lambda v: _wrap(cpp(_tracer(v)._v, _axes(axis_name))), x)

    f.__name__ = name
    return f


psum = _collective("psum")
pmean = _collective("pmean")
pmax = _collective("pmax")
pmin = _collective("pmin")


def all_gather(x, axis_name, *, axis=0, tiled=False, to="varying"):
    """jax.lax.all_gather; to='reduced' is all_gather_reduced (the gathered value typed reduced
    over `axis_name`, explicit mode), to='invarying' is all_gather_invariant (the gathered value
    typed invariant along `axis_name`, so out_specs may leave it out; the C++ all_gather)."""
    # The gathered axis counts a key array's dimensions (the result's, untiled).
    return _per_array(lambda t, key: _wrap(_t.all_gather(t._v, _axes(axis_name),
                                                         _key_axis(axis, t.ndim - tiled, key),
                                                         tiled, to)), x)


def psum_scatter(x, axis_name, *, scatter_dimension=0, tiled=False):
    _refuse_keys("psum_scatter", x)
    return tree_map(lambda v: _wrap(_t.psum_scatter(_tracer(v)._v, _axes(axis_name), scatter_dimension, tiled)), x)


def ppermute(x, axis_name, perm):
    perm = [(int(a), int(b)) for a, b in perm]
    return data_map(lambda v: _wrap(_t.ppermute(_tracer(v)._v, _axes(axis_name), perm)), x)


def all_to_all(x, axis_name, split_axis, concat_axis, *, tiled=False):
    return _per_array(lambda t, key: _wrap(_t.all_to_all(t._v, _axes(axis_name), _key_axis(split_axis, t.ndim - 1, key),
                                                         _key_axis(concat_axis, t.ndim - 1, key), tiled)), x)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                      axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all, inside a shard_map body: slice i of `operand` (rows
    input_offsets[i] to input_offsets[i] + send_sizes[i]) goes to the device at position
    i // (len(input_offsets) // axis_size(axis_name)), which writes it at rows output_offsets[i]
    (the sender's offsets, as in JAX) of its `output`; the result is that output, other rows
    unchanged. JAX's errors for index arrays that are not integer vectors; a slice out of range
    fails the run naming the device and the values. axis_index_groups (lists of positions along
    the axes, each once, groups of one size): slices go to the members of this device's group,
    i // (len(input_offsets) // group size) naming the member."""
    groups = [] if axis_index_groups is None else [[int(i) for i in g] for g in axis_index_groups]
    args = [_tracer(v)._v for v in (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)]
    return _wrap(_t.ragged_all_to_all(*args, _axes(axis_name), groups))


def axis_index(axis_name):
    return _wrap(_t.axis_index(_axes(axis_name)))


def axis_size(axis_name):
    return _t.axis_size(_axes(axis_name))


def pbroadcast(x, axis_name, source):
    """jax.lax.pbroadcast: every device along `axis_name` gets the x of the device at position
    `source` (JAX defines it as the psum of x masked to the source; JAX lowers it on GPU only,
    Tessera runs it on its workers). Typed as varying along the axes, as JAX types it."""
    return data_map(lambda v: _wrap(_t.pbroadcast(_tracer(v)._v, _axes(axis_name), source)), x)


def pvary(x, axis_name):
    """jax.lax.pvary (older JAX; jax.lax.pcast(x, axis_name, to='varying') now): inside a
    shard_map body, x typed as varying along the manual axes `axis_name` as well (jax.typeof
    shows them, {V:i}); each device's value is unchanged. x must not vary along them already.
    Its gradient comes out as JAX's, whose transpose of pvary is a psum."""
    if not axis_name:
        return x
    return data_map(lambda v: _wrap(_t.pvary(_tracer(v)._v, _axes(axis_name))), x)


def pcast(x, axis_name, *, to):
    """jax.lax.pcast, by x's state along `axis_name` (JAX's _get_from / _pcast_funcs):
    invarying or reduced -> 'varying' (pvary, reduced_vary_cast), varying -> 'unreduced'
    (vary_unreduced_cast), invarying -> 'reduced' (preduced; explicit mode); other pairs, and
    axes in several states, are JAX's ValueError (the C++ pcast, tessera/shard_map.h)."""
    if isinstance(axis_name, (set, frozenset)):
        raise TypeError(f"axis_name={axis_name!r} must be a tuple or a str. Got {axis_name}")
    if not axis_name:
        return x
    if to not in ("unreduced", "reduced", "varying"):
        raise ValueError("Got unexpected `to` value. Allowed `to` values are: {'unreduced', 'reduced', 'varying'}")
    return data_map(lambda v: _wrap(_t.pcast(_tracer(v)._v, _axes(axis_name), to)), x)


def with_sharding_constraint(x, shardings):
    """jax.lax.with_sharding_constraint: pins intermediates' shardings (a NamedSharding, or a
    bare P under `with mesh:`, or a prefix pytree of them)."""
    leaves, tree = tree_flatten(x)
    targets = broadcast_prefix(shardings, x, lambda p: p is None or hasattr(p, "_cpp") or isinstance(p, tuple))
    out = [l if s is None else _wrap(_t.with_sharding_constraint(_tracer(l)._v, _as_named(s, "with_sharding_constraint")._cpp))
           for l, s in zip(leaves, targets)]
    return tree_unflatten(tree, out)


@_op
def _dot_general(lhs, rhs, dimension_numbers, preferred_element_type):
    (lc, rc), (lb, rb) = dimension_numbers
    out = _jnp.dot_general_(lhs, rhs, (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """lax.dot_general; out_sharding lays the result out (a NamedSharding, or a P on the
    explicit or ambient mesh), as explicit mode needs when a contracted dimension is split on
    both operands."""
    if out_sharding is None:
        return _dot_general(lhs, rhs, dimension_numbers, preferred_element_type)
    (lc, rc), (lb, rb) = dimension_numbers

    def traced(v, spec, mesh):
        a, b = _jnp._same_dtype(Tracer(v[0]), Tracer(v[1]))
        return _t.dot_general(a._v, b._v, list(lc), list(rc), list(lb), list(rb), spec, mesh)

    out = _jnp._with_out_sharding("dot_general", (lhs, rhs), out_sharding, traced)
    return out if preferred_element_type is None else out.astype(preferred_element_type)


@_op
def div(x, y):
    a, b = _jnp._pair(x, y)
    return _wrap(_t.div(a._v, b._v))


div = _keys_refused(div, "div", _NUM, _NUM)


def convert_element_type(x, new_dtype):
    if check_key_conversion(x, new_dtype):  # (keys to their own dtype: themselves)
        return x
    return _jnp.astype(x, new_dtype)


@_op
def _broadcast_in_dim(operand, shape, broadcast_dimensions):
    return _wrap(_t.broadcast_in_dim(_tracer(operand)._v, list(shape), list(broadcast_dimensions)))


def broadcast_in_dim(operand, shape, broadcast_dimensions, *, out_sharding=None):
    """lax.broadcast_in_dim; out_sharding lays the result out (a NamedSharding, or a P on the
    explicit or ambient mesh), as JAX's _broadcast_in_dim_sharding_rule returns it."""
    if out_sharding is None:
        return _broadcast_in_dim(operand, shape, broadcast_dimensions)
    return _jnp._with_out_sharding("broadcast_in_dim", (operand,), out_sharding, lambda v, spec, mesh: _t.broadcast_in_dim(
        v[0], list(shape), list(broadcast_dimensions), spec, mesh))


def broadcast(operand, sizes, *, out_sharding=None):
    """lax.broadcast: new leading dimensions of `sizes`."""
    shape = tuple(getattr(operand, "shape", ()))  # a Python scalar: rank 0
    return broadcast_in_dim(operand, tuple(sizes) + shape, tuple(range(len(sizes), len(sizes) + len(shape))),
                            out_sharding=out_sharding)


@_op
def slice(operand, start_indices, limit_indices, strides=None):
    return _wrap(_t.slice(_tracer(operand)._v, list(start_indices), list(limit_indices),
                          [] if strides is None else list(strides)))


@_op
def rev(operand, dimensions):
    """lax.rev: operand with each of `dimensions` (distinct, in [0, ndim)) reversed; the result
    keeps the operand's sharding (lax.py's _rev_sharding_rule)."""
    return _wrap(_t.rev(_tracer(operand)._v, [int(d) for d in dimensions]))


def concatenate(operands, dimension):
    return _concatenate(operands, axis=dimension)


def iota(dtype, size):
    return Tracer(_t.iota(_enum(dtype), [size], 0))


def broadcasted_iota(dtype, shape, dimension, *, out_sharding=None):
    """lax.broadcasted_iota (in a trace); out_sharding lays the result out (a NamedSharding, or
    a P on the explicit or ambient mesh)."""
    if out_sharding is None:
        return Tracer(_t.iota(_enum(dtype), list(shape), dimension))
    return Tracer(_t.iota(_enum(dtype), list(shape), dimension, *_jnp._spec_and_mesh("iota", out_sharding)))


def select(pred, on_true, on_false):
    return _jnp.where(pred, on_true, on_false)


def _starts(start_indices):
    return [_tracer(i)._v for i in start_indices]


@_op
def dynamic_slice(operand, start_indices, slice_sizes):
    """lax.dynamic_slice: each start (traced or not) is clamped so the window fits."""
    return _wrap(_t.dynamic_slice(_tracer(operand)._v, _starts(start_indices), list(slice_sizes)))


@_op
def dynamic_update_slice(operand, update, start_indices):
    """lax.dynamic_update_slice: each start is clamped so the update fits."""
    x = _tracer(operand)
    return _wrap(_t.dynamic_update_slice(x._v, _tracer(update, x)._v, _starts(start_indices)))


def dynamic_slice_in_dim(operand, start_index, slice_size, axis=0):
    starts = [0] * operand.ndim
    starts[axis] = start_index
    sizes = list(operand.shape)
    sizes[axis] = slice_size
    return dynamic_slice(operand, starts, sizes)


def dynamic_update_slice_in_dim(operand, update, start_index, axis):
    starts = [0] * operand.ndim
    starts[axis] = start_index
    return dynamic_update_slice(operand, update, starts)


def dynamic_index_in_dim(operand, index, axis=0, keepdims=True):
    out = dynamic_slice_in_dim(operand, index, 1, axis)
    return out if keepdims else _jnp.squeeze(out, axis)


@_op
def clamp(min, x, max):
    """lax.clamp(min, x, max)."""
    t = _tracer(x)
    return _wrap(_t.clamp(_tracer(min, t)._v, t._v, _tracer(max, t)._v))


# ---- control flow (inside jit: the SDK traces the body into a loop the devices run) -------

def _values(leaves):
    return [_tracer(l)._v for l in leaves]


def scan(f, init, xs=None, length=None, reverse=False):
    """jax.lax.scan: f(carry, x) -> (carry, y) over the leading axis of xs (pytrees of arrays;
    xs None for none, then length is required). Returns (final carry, stacked ys)."""
    c_leaves, c_tree = tree_flatten(init)
    x_leaves, x_tree = tree_flatten(xs)
    y_tree = [None]

    def body(values):
        n = len(c_leaves)
        c = tree_unflatten(c_tree, [Tracer(v) for v in values[:n]])
        x = tree_unflatten(x_tree, [Tracer(v) for v in values[n:]])
        new_c, y = f(c, x)
        nc_leaves, nc_tree = tree_flatten(new_c)
        if nc_tree != c_tree:
            raise TypeError(f"scan: the body's carry {nc_tree} differs from the initial carry {c_tree}")
        y_leaves, y_tree[0] = tree_flatten(y)
        return _values(nc_leaves) + _values(y_leaves)

    carry, ys = _t.scan(_trace.callback(body), _values(c_leaves), _values(x_leaves),
                        None if length is None else int(length), bool(reverse))
    out_c = tree_unflatten(c_tree, [Tracer(v) for v in carry])
    return out_c, (tree_unflatten(y_tree[0], [Tracer(v) for v in ys]) if y_tree[0] is not None else None)


def fori_loop(lower, upper, body_fun, init_val):
    """jax.lax.fori_loop with static (Python int) bounds: a scan, as JAX lowers it then."""
    leaves, tree = tree_flatten(init_val)

    def body(values):
        out, out_tree = tree_flatten(body_fun(Tracer(values[0]), tree_unflatten(tree, [Tracer(v) for v in values[1:]])))
        if out_tree != tree:
            raise TypeError(f"fori_loop: the body returned {out_tree}, not the carry's {tree}")
        return _values(out)

    out = _t.fori_loop(int(lower), int(upper), _trace.callback(body), _values(leaves))
    return tree_unflatten(tree, [Tracer(v) for v in out])


def while_loop(cond_fun, body_fun, init_val):
    """jax.lax.while_loop: `while cond_fun(val): val = body_fun(val)`, run by the devices as a
    loop (forward only, as in JAX: grad of it is an error). cond_fun returns a bool scalar."""
    leaves, tree = tree_flatten(init_val)

    def unflat(values):
        return tree_unflatten(tree, [Tracer(v) for v in values])

    def cond(values):
        return _values([cond_fun(unflat(values))])

    def body(values):
        out, out_tree = tree_flatten(body_fun(unflat(values)))
        if out_tree != tree:
            raise TypeError(f"while_loop: body_fun returned {out_tree}, not the carry's {tree}")
        return _values(out)

    out = _t.while_loop(_trace.callback(cond), _trace.callback(body), _values(leaves))
    return unflat(out)


def _branches(fns, operands, name):
    """The branch functions on flat Values, and the result's tree (set by the first traced)."""
    leaves, tree = tree_flatten(operands)
    out_tree = [None]

    def wrap(k, f):
        def branch(values):
            out, t = tree_flatten(f(*tree_unflatten(tree, [Tracer(v) for v in values])))
            if out_tree[0] is None:
                out_tree[0] = t
            elif t != out_tree[0]:
                raise TypeError(f"{name}: branch {k} returns {t} but another returns {out_tree[0]}")
            return _values(out)
        return _trace.callback(branch)

    return [wrap(k, f) for k, f in enumerate(fns)], _values(leaves), out_tree


def switch(index, branches, *operands):
    """jax.lax.switch: branches[clamp(index, 0, len(branches) - 1)](*operands); only the taken
    branch runs on the devices, and grad goes through it."""
    fns, values, out_tree = _branches(branches, operands, "switch")
    out = _t.switch(_scalar(index, "switch", "index")._v, fns, values)
    return _branch_results(out, out_tree, "switch")


def cond(pred, true_fun, false_fun, *operands):
    """jax.lax.cond: true_fun(*operands) if pred else false_fun(*operands), pred a scalar."""
    (t, f), values, out_tree = _branches([true_fun, false_fun], operands, "cond")
    out = _t.cond(_scalar(pred, "cond", "predicate")._v, t, f, values)
    return _branch_results(out, out_tree, "cond")


def _branch_results(out, out_tree, op):
    """The results as the branches' tree; when the SDK refused the branches (it records why in
    the trace and gives no results), the branch's exception or TraceFailed, so that the trace's
    end raises the SDK's error."""
    if out_tree[0] is None or len(out) != out_tree[0].num_leaves:
        raise getattr(_trace._state, "error", None) or _trace.TraceFailed(f"{op}: see the trace's error")
    return tree_unflatten(out_tree[0], [Tracer(v) for v in out])


def _scalar(x, op, what):
    t = _tracer(x)
    if tuple(t.shape) != ():
        raise TypeError(f"{op}: the {what} has shape {tuple(t.shape)}; it must be a scalar")
    return t


# ---- issue #15: stop_gradient, pad and the cumulative reductions, under lax's names ------

@_op
def stop_gradient(x):
    # A typed key is returned as it is (lax.py _stop_gradient: extended dtypes have no gradient).
    return tree_map(lambda v: v if isinstance(v, PRNGKeyArray) else _wrap(_t.stop_gradient(_tracer(v)._v)), x)


def _reduction(name, reduce, unreduced_kind):
    """lax.reduce_<op>(operand, axes, *, out_sharding=None) as jax/_src/lax/lax.py's: the
    reduction over `axes` (each in [0, ndim), once), typed as out_sharding when one is given
    (_reduce_op_sharding_rule_with_out_sharding), with _reduce_op_unreduced_rule's and
    _reduce_op_reduced_rule's checks. Composed: the reduction, then a reshard onto
    out_sharding (onto unreduced axes: the sum is resolved, then placed on the first device
    along them, zeros elsewhere, where JAX leaves each device its partial sum; the value is the
    same). `unreduced_kind`: the kind an unreduced out_sharding must have ('sum' only for
    reduce_sum: Tessera's specs have no other, so reduce_max/min refuse one, as JAX refuses a
    sum kind there)."""

    def f(operand, axes, *, out_sharding=None):
        from .sharding import NamedSharding, PartitionSpec, reshard
        from ._api import typeof
        axes = tuple(int(a) for a in axes)
        ndim = _np.ndim(operand)
        if len(axes) != len(set(axes)):
            raise ValueError(f"duplicate value in 'axes' of reduction: {axes}")
        if not all(0 <= a < ndim for a in axes):
            raise ValueError(f"reduction axes {axes} contains out-of-bounds indices for {typeof(operand)}.")
        out = reduce(operand, axis=axes)
        if out_sharding is None:
            return out
        spec = out_sharding.spec if isinstance(out_sharding, NamedSharding) else out_sharding
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"{name}: out_sharding must be a NamedSharding or a PartitionSpec, got {out_sharding!r}")
        if spec.reduced:
            raise _errors.InvalidArgumentError(
                f"out_sharding passed to {name} cannot be reduced. Got out_sharding={out_sharding}")
        if spec.unreduced:
            if unreduced_kind != "sum":
                raise _errors.InvalidArgumentError(
                    f"{name} requires `out_sharding`'s unreduced_kind to be {unreduced_kind} but got {spec}")
            op_spec = typeof(operand).sharding.spec
            used = {s for i, e in enumerate(op_spec) if i in axes
                    for s in (e if isinstance(e, tuple) else (e,)) if s is not None} | set(op_spec.unreduced)
            if not all(u in used for u in spec.unreduced):
                raise _errors.InvalidArgumentError(
                    "out_sharding's unreduced axes should be in operand's specs that were "
                    f"{name} over. Got operand={typeof(operand)}, axes={axes}, unreduced_spec={set(spec.unreduced)}")
        return reshard(out, out_sharding)

    f.__name__ = name
    f.__qualname__ = name
    return f


reduce_sum = _reduction("reduce_sum", _jnp.sum, "sum")
reduce_max = _reduction("reduce_max", _jnp.max, "max")
reduce_min = _reduction("reduce_min", _jnp.min, "min")


def reduce_prod(operand, axes):
    """lax.reduce_prod (no out_sharding, as JAX's)."""
    return _jnp.prod(operand, axis=tuple(axes))


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


# ---- issue #15: gather and the scatters with dimension numbers (tessera/trace.h) ----------

class GatherDimensionNumbers(NamedTuple):
    """lax.GatherDimensionNumbers (jax/_src/lax/slicing.py): the index vector is the last
    dimension of start_indices, as in JAX."""
    offset_dims: tuple
    collapsed_slice_dims: tuple
    start_index_map: tuple
    operand_batching_dims: tuple = ()
    start_indices_batching_dims: tuple = ()


class ScatterDimensionNumbers(NamedTuple):
    """lax.ScatterDimensionNumbers (jax/_src/lax/slicing.py)."""
    update_window_dims: Sequence[int]
    inserted_window_dims: Sequence[int]
    scatter_dims_to_operand_dims: Sequence[int]
    operand_batching_dims: Sequence[int] = ()
    scatter_indices_batching_dims: Sequence[int] = ()


class GatherScatterMode(enum.Enum):
    """lax.GatherScatterMode: how a gather or scatter treats out-of-bounds indices. CLIP clamps
    each start so the window fits; FILL_OR_DROP fills a gathered window touching the outside
    with fill_value and drops such a scattered window; PROMISE_IN_BOUNDS checks nothing
    (in-bounds results are CLIP's, others undefined); ONE_HOT is take_along_axis's one-hot
    contraction (a gather refuses it)."""
    CLIP = enum.auto()
    FILL_OR_DROP = enum.auto()
    PROMISE_IN_BOUNDS = enum.auto()
    ONE_HOT = enum.auto()

    @staticmethod
    def from_any(s):
        """As JAX's: a GatherScatterMode, None (FILL_OR_DROP), 'clip', 'fill' or 'drop',
        'promise_in_bounds' or 'one_hot'; anything else is a ValueError."""
        if isinstance(s, GatherScatterMode):
            return s
        if s == "clip":
            return GatherScatterMode.CLIP
        if s is None or s == "fill" or s == "drop":
            return GatherScatterMode.FILL_OR_DROP
        if s == "promise_in_bounds":
            return GatherScatterMode.PROMISE_IN_BOUNDS
        if s == "one_hot":
            return GatherScatterMode.ONE_HOT
        raise ValueError(f'Unknown gather mode "{s}"')


def _mode_name(mode):
    return GatherScatterMode.from_any(mode).name.lower()


def _fill(fill_value):
    """A fill value as the binding takes it (a Python int or float; None: JAX's default)."""
    if fill_value is None:
        return None
    v = _np.asarray(fill_value).item()
    return int(v) if isinstance(v, (bool, int)) else float(v)


def _ints(dims, what):
    try:
        return [int(d) for d in dims]
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, not {dims!r}") from None


@_op
def _gather(operand, start_indices, dims, slice_sizes, mode, fill_value):
    def run(*v):
        return _t.gather(*v, *dims, slice_sizes, mode, fill_value)

    operands = [_tracer(operand)._v, _tracer(start_indices)._v]
    out = run(*operands)
    # one_hot is refused for the mode, not the shapes (JAX's _gather_lower asserts it away): a ValueError.
    return _wrap(out if mode == "one_hot" else _as_jax_raises(run, operands, out))


def gather(operand, start_indices, dimension_numbers, slice_sizes, *, unique_indices=False, indices_are_sorted=False,
           mode=None, fill_value=None):
    """lax.gather. mode None is PROMISE_IN_BOUNDS, as JAX's (jax/_src/lax/slicing.py gather; unlike
    GatherScatterMode.from_any(None), the scatters' FILL_OR_DROP): each start is clamped so the
    slice fits, as XLA does with it ("out-of-bounds gathers will be clamped"); fill_value
    (FILL_OR_DROP only) defaults to NaN, the lowest integer or True. Integer indices of any
    dtype, as JAX's (_gather_dtype_rule asks only for an integer type: int8, int16, uint8, uint16
    and uint32 become int32 with their values); shape errors are TypeError as _gather_shape_rule's
    (_as_jax_raises). unique_indices and indices_are_sorted are performance hints in JAX and
    change nothing here."""
    if not isinstance(dimension_numbers, GatherDimensionNumbers):
        raise TypeError(f"lax.gather: dimension_numbers must be a lax.GatherDimensionNumbers, not "
                        f"{type(dimension_numbers).__name__}")
    mode = _mode_name(GatherScatterMode.PROMISE_IN_BOUNDS if mode is None else mode)
    dims = tuple(tuple(_ints(d, f"GatherDimensionNumbers.{f}")) for f, d in
                 zip(GatherDimensionNumbers._fields, dimension_numbers))
    return _gather(operand, _jnp._int32_indices(start_indices), dims, tuple(_ints(slice_sizes, "slice_sizes")),
                   mode, _fill(fill_value) if mode == "fill_or_drop" else None)


def _as_jax_raises(op, operands, out):
    """out, the Value op(*operands) gave; when op failed on valid operands, the TypeError that
    JAX's gather or scatter raises instead (jax/_src/lax/slicing.py: _gather_shape_rule,
    _scatter_shape_rule and the rules they call raise TypeError for dimension numbers and shapes,
    lax.check_same_dtypes for the updates' dtype; the SDK's INVALID_ARGUMENT is a ValueError),
    with the SDK's message, read by tracing op alone on operands of the same dtypes and shapes
    (so a sharding refusal, which needs the layouts, stays a ValueError). Non-integer indices
    stay a ValueError, as in JAX (_gather_dtype_rule, _scatter_dtype_rule: "indices must have an
    integer type")."""
    if out.ok or not all(v.ok for v in operands):
        return out
    try:
        _t.trace_text(lambda vs: [op(*vs)], [(v.dtype, list(v.shape)) for v in operands])
    except _errors.InvalidArgumentError as e:
        if "they need int32 or int64" not in str(e):
            raise TypeError(str(e)) from None
    return out


def _scatter_dims(name, dimension_numbers):
    """A ScatterDimensionNumbers' fields as tuples of ints, as the binding takes them."""
    if not isinstance(dimension_numbers, ScatterDimensionNumbers):
        raise TypeError(f"lax.{name}: dimension_numbers must be a lax.ScatterDimensionNumbers, not "
                        f"{type(dimension_numbers).__name__}")
    return tuple(tuple(_ints(d, f"ScatterDimensionNumbers.{f}")) for f, d in
                 zip(ScatterDimensionNumbers._fields, dimension_numbers))


def _scatter_op(name):
    cpp = getattr(_t, name)

    @_op
    def run(operand, scatter_indices, updates, dims, mode):
        x = _tracer(operand)
        operands = [x._v, _tracer(scatter_indices)._v, _tracer(updates, x)._v]
        return _wrap(_as_jax_raises(lambda *v: cpp(*v, *dims, mode), operands, cpp(*operands, *dims, mode)))

    def f(operand, scatter_indices, updates, dimension_numbers, *, indices_are_sorted=False, unique_indices=False,
          mode=None):
        return run(operand, _jnp._int32_indices(scatter_indices), updates, _scatter_dims(name, dimension_numbers),
                   _mode_name(mode))

    f.__name__ = f.__qualname__ = name
    f.__doc__ = (f"lax.{name}: mode None is FILL_OR_DROP (out-of-bounds windows are dropped), as JAX's. Integer "
                 "indices of any dtype, as JAX's (int8, int16, uint8, uint16, uint32 become int32 with their values). "
                 "indices_are_sorted and unique_indices are performance hints in JAX and change nothing here.")
    return f


scatter = _scatter_op("scatter")
scatter_add = _scatter_op("scatter_add")
scatter_sub = _scatter_op("scatter_sub")
scatter_mul = _scatter_op("scatter_mul")
scatter_min = _scatter_op("scatter_min")
scatter_max = _scatter_op("scatter_max")


@_op
def _scatter_apply(operand, scatter_indices, func, dims, update_shape, mode):
    x = _tracer(operand)

    def apply(values):
        return [_tracer(func(Tracer(values[0])))._v]

    def run(*operands):
        return _t.scatter_apply(*operands, _trace.callback(apply), *dims, list(update_shape), mode)

    operands = [x._v, _tracer(scatter_indices)._v]
    return _wrap(_as_jax_raises(run, operands, run(*operands)))


def scatter_apply(operand, scatter_indices, func, dimension_numbers, *, update_shape=(), indices_are_sorted=False,
                  unique_indices=False, mode=None):
    """lax.scatter_apply (jax/_src/lax/slicing.py): operand with func applied to the elements
    that windows of update_shape (placed as a scatter's updates of that shape) cover, once per
    window, so repeated indices apply it repeatedly; mode None drops out-of-range windows.
    func must be elementwise and keep the dtype (the SDK applies it to whole arrays; JAX traces
    it on a scalar). Unlike JAX (no JVP: "scatter_apply JVP not implemented"), grad goes
    through func's applications. indices_are_sorted and unique_indices change nothing here."""
    dims = _scatter_dims("scatter_apply", dimension_numbers)
    return _scatter_apply(operand, _jnp._int32_indices(scatter_indices), func, dims,
                          tuple(_ints(update_shape, "update_shape")), _mode_name(mode))

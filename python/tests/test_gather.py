# lax.gather / lax.scatter{,_add,_mul,_min,_max} with dimension numbers, jnp.take_along_axis and
# x.at[i].multiply/min/max, under jit on 8 devices laid out as (8), (4, 2) and (2, 4), against
# host references: numpy's take_along_axis and ufunc.at, and explicit loops over XLA's gather and
# scatter semantics (https://openxla.org/xla/operation_semantics#gather, #scatter) for general
# dimension numbers. Out-of-range rules as JAX documents them (jax/_src/lax/slicing.py
# GatherScatterMode): CLIP clamps each start so the window fits, FILL_OR_DROP fills a gathered
# window touching the outside and drops such a scattered one, lax does not wrap negative
# indices; jnp.take_along_axis wraps them (jax/_src/numpy/indexing.py take_along_axis), and so
# does x.at[] (jax/_src/ops/scatter.py _scatter_update via _index_to_gather).
import numpy as np
import pytest

import tessera
import tessera.lax as lax
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P

rng = np.random.default_rng(15)
GD, SD, Mode = lax.GatherDimensionNumbers, lax.ScatterDimensionNumbers, lax.GatherScatterMode


@pytest.fixture(scope="module")
def mesh24():
    return tessera.make_mesh((2, 4), ("data", "model"), axis_types=tessera.sharding.AxisType.Auto)


@pytest.fixture(scope="module", params=["8", "4x2", "2x4"])
def layout(request, mesh8, mesh, mesh24):
    """A function putting a numpy array on the 8 devices, its first two dimensions split as the
    layout says ((8): the first over 'x'; (4, 2) and (2, 4): the first over 'data', the second
    over 'model')."""
    def put(a, split=True):
        if request.param == "8":
            spec = P("x") if split else P()
            return tessera.device_put(a, NamedSharding(mesh8, spec))
        m = mesh if request.param == "4x2" else mesh24
        return tessera.device_put(a, NamedSharding(m, P("data", "model") if split else P()))

    return put


# ---- host references: XLA's gather and scatter, one element at a time ----------------------

def _fill_default(dtype):
    return np.nan if dtype.kind == "f" else np.iinfo(dtype).min


def _window_start(rank, indices, b, index_map, operand_batching_dims, indices_batching_dims):
    """The operand position where the window of batch position `b` starts: index component k
    for dimension index_map[k], b's position along the paired indices dimension for a batching
    dimension, 0 for the others."""
    start = [0] * rank
    for k, d in enumerate(index_map):
        start[d] = int(indices[b + (k,)])
    for k, d in enumerate(operand_batching_dims):
        start[d] = b[indices_batching_dims[k]]
    return start


def ref_gather(operand, indices, dn, slice_sizes, mode="fill", fill_value=None):
    batch_shape = indices.shape[:-1]
    window_dims = [d for d in range(operand.ndim)
                   if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    out_rank = len(dn.offset_dims) + len(batch_shape)
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    out_shape = [0] * out_rank
    for k, d in enumerate(dn.offset_dims):
        out_shape[d] = slice_sizes[window_dims[k]]
    for k, d in enumerate(batch_out):
        out_shape[d] = batch_shape[k]
    out = np.empty(out_shape, operand.dtype)
    fill = _fill_default(operand.dtype) if fill_value is None else fill_value
    for o in np.ndindex(*out_shape):
        b = tuple(o[d] for d in batch_out)
        start = _window_start(operand.ndim, indices, b, dn.start_index_map, dn.operand_batching_dims,
                              dn.start_indices_batching_dims)
        fits = all(0 <= start[d] <= operand.shape[d] - slice_sizes[d] for d in range(operand.ndim))
        if mode == "clip":
            start = [min(max(s, 0), operand.shape[d] - slice_sizes[d]) for d, s in enumerate(start)]
        elif not fits:
            out[o] = fill
            continue
        full = list(start)
        for k, d in enumerate(window_dims):
            full[d] += o[dn.offset_dims[k]]
        out[o] = operand[tuple(full)]
    return out


COMBINE = {"scatter": lambda a, b: b, "scatter_add": np.add, "scatter_mul": np.multiply,
           "scatter_min": np.minimum, "scatter_max": np.maximum}


def ref_scatter(name, operand, indices, updates, dn, mode="drop"):
    out = operand.copy()
    window_dims = [d for d in range(operand.ndim)
                   if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    scatter_dims = [d for d in range(updates.ndim) if d not in dn.update_window_dims]
    size = [1] * operand.ndim
    for k, d in enumerate(window_dims):
        size[d] = updates.shape[dn.update_window_dims[k]]
    for u in np.ndindex(*updates.shape):
        b = tuple(u[d] for d in scatter_dims)
        start = _window_start(operand.ndim, indices, b, dn.scatter_dims_to_operand_dims, dn.operand_batching_dims,
                              dn.scatter_indices_batching_dims)
        if mode == "clip":
            start = [min(max(s, 0), operand.shape[d] - size[d]) for d, s in enumerate(start)]
        elif not all(0 <= start[d] <= operand.shape[d] - size[d] for d in range(operand.ndim)):
            continue
        full = list(start)
        for k, d in enumerate(window_dims):
            full[d] += u[dn.update_window_dims[k]]
        out[tuple(full)] = COMBINE[name](out[tuple(full)], updates[u])
    return out


# ---- gather --------------------------------------------------------------------------------

X = rng.standard_normal((8, 8, 4)).astype(np.float32)
# x[i, j] (point gather), whole (2, 4) windows at one start, and a batched gather (dimension 0 of
# operand and indices paired, as jnp.take_along_axis lowers).
POINT = (GD(offset_dims=(1,), collapsed_slice_dims=(0, 1), start_index_map=(0, 1)), (1, 1, 4),
         np.array([[0, 1], [7, 7], [3, 2], [5, 0], [2, 6]], np.int32))
WINDOW = (GD(offset_dims=(1, 2, 3), collapsed_slice_dims=(), start_index_map=(1,)), (8, 2, 4),
          np.array([[0], [6], [3]], np.int32))
BATCHED = (GD(offset_dims=(2,), collapsed_slice_dims=(1,), start_index_map=(1,), operand_batching_dims=(0,),
              start_indices_batching_dims=(0,)), (1, 1, 4), rng.integers(0, 8, (8, 3, 1)).astype(np.int32))


@pytest.mark.parametrize("case", [POINT, WINDOW, BATCHED], ids=["point", "window", "batched"])
def test_gather_matches_the_loop_reference(layout, case):
    dn, sizes, idx = case
    got = tessera.jit(lambda x, i: lax.gather(x, i, dn, sizes))(layout(X), idx)
    np.testing.assert_array_equal(np.asarray(got), ref_gather(X, idx, dn, sizes))


def test_gather_out_of_range_per_mode(layout):
    dn, sizes = WINDOW[0], WINDOW[1]
    idx = np.array([[7], [-1], [6], [100]], np.int32)  # only 6 fits a window of 2 in 8

    # mode None is PROMISE_IN_BOUNDS (jax/_src/lax/slicing.py gather: "if mode is None: mode =
    # GatherScatterMode.PROMISE_IN_BOUNDS"), which XLA clamps ("out-of-bounds gathers will be
    # clamped", GatherScatterMode's docstring): CLIP's values, out of range included.
    def f(x, i):
        return (lax.gather(x, i, dn, sizes, mode="fill"), lax.gather(x, i, dn, sizes, mode="fill", fill_value=-3.0),
                lax.gather(x, i, dn, sizes, mode=Mode.CLIP), lax.gather(x, i, dn, sizes, mode="clip"),
                lax.gather(x, i, dn, sizes, mode="promise_in_bounds"), lax.gather(x, i, dn, sizes))

    got = tessera.jit(f)(layout(X), idx)
    clipped = ref_gather(X, idx, dn, sizes, mode="clip")
    want = (ref_gather(X, idx, dn, sizes), ref_gather(X, idx, dn, sizes, fill_value=-3.0), clipped, clipped,
            clipped, clipped)
    assert np.isnan(np.asarray(got[0])[[0, 1, 3]]).all() and not np.isnan(np.asarray(got[0])[2]).any()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_gather_docstring_example_and_integer_fill():
    # lax.gather's docstring (jax/_src/lax/slicing.py): x[indices] as a gather.
    x = np.array([10, 11, 12], np.int32)
    i = np.array([0, 1, 1, 2, 2, 2], np.int32)[:, None]
    dn = GD(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))
    got = lax.gather(x, i, dimension_numbers=dn, slice_sizes=(1,), indices_are_sorted=True,
                     mode=Mode.PROMISE_IN_BOUNDS)
    assert np.asarray(got).tolist() == [10, 11, 11, 12, 12, 12]
    # FILL_OR_DROP's default fill for signed integers: the lowest value (slicing.py gather).
    got = lax.gather(x, np.array([[3], [-1], [2]], np.int32), dn, (1,), mode="fill")
    assert np.asarray(got).tolist() == [np.iinfo(np.int32).min, np.iinfo(np.int32).min, 12]
    # The default (PROMISE_IN_BOUNDS, clamped by XLA) on the same indices: 3 -> 2, -1 -> 0.
    got = lax.gather(x, np.array([[3], [-1], [2]], np.int32), dn, (1,))
    assert np.asarray(got).tolist() == [12, 10, 12]


# ---- scatters -------------------------------------------------------------------------------

ROWS = SD(update_window_dims=(1, 2), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
ROW_IDX = np.array([[2], [5], [5], [0], [-1], [8], [7]], np.int32)  # 5 twice; -1 and 8 out of range
ROW_UPD = rng.uniform(0.5, 2.0, (7, 8, 4)).astype(np.float32)
UFUNC = {"scatter_add": np.add, "scatter_sub": np.subtract, "scatter_mul": np.multiply, "scatter_min": np.minimum, "scatter_max": np.maximum}


@pytest.mark.parametrize("name", sorted(UFUNC))
def test_combining_scatters_match_numpy_ufunc_at(layout, name):
    op = getattr(lax, name)
    x = rng.uniform(0.5, 2.0, (8, 8, 4)).astype(np.float32)
    got = tessera.jit(lambda x, i, u: (op(x, i, u, ROWS), op(x, i, u, ROWS, mode="clip")))(layout(x), ROW_IDX,
                                                                                          ROW_UPD)
    dropped = x.copy()
    keep = (ROW_IDX[:, 0] >= 0) & (ROW_IDX[:, 0] < 8)
    UFUNC[name].at(dropped, ROW_IDX[keep, 0], ROW_UPD[keep])  # mode None: FILL_OR_DROP drops them
    clipped = x.copy()
    UFUNC[name].at(clipped, np.clip(ROW_IDX[:, 0], 0, 7), ROW_UPD)
    np.testing.assert_allclose(np.asarray(got[0]), dropped, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), clipped, rtol=1e-6)


def test_scatter_writes_unique_windows_and_drops_out_of_range(layout):
    idx = np.array([[1], [6], [9], [-2]], np.int32)
    upd = rng.standard_normal((4, 8, 4)).astype(np.float32)
    got = tessera.jit(lambda x, i, u: lax.scatter(x, i, u, ROWS))(layout(X), idx, upd)
    want = X.copy()
    want[[1, 6]] = upd[:2]
    np.testing.assert_array_equal(np.asarray(got), want)


def test_scatter_with_batching_dims_and_partial_windows(layout):
    # Batched (operand dim 0 with indices dim 0) and a window of 3 along dim 1 at a start: a
    # start above 8 - 3 drops the whole window, CLIP moves it in.
    dn = SD(update_window_dims=(2,), inserted_window_dims=(2,), scatter_dims_to_operand_dims=(1, 2),
            operand_batching_dims=(0,), scatter_indices_batching_dims=(0,))
    idx = np.stack([rng.integers(0, 8, (8, 2)), rng.integers(0, 4, (8, 2))], axis=-1).astype(np.int32)
    upd = rng.standard_normal((8, 2, 3)).astype(np.float32)
    got = tessera.jit(lambda x, i, u: (lax.scatter_add(x, i, u, dn), lax.scatter_add(x, i, u, dn, mode="clip")))(
        layout(X), idx, upd)
    np.testing.assert_allclose(np.asarray(got[0]), ref_scatter("scatter_add", X, idx, upd, dn), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), ref_scatter("scatter_add", X, idx, upd, dn, "clip"), rtol=1e-6,
                               atol=1e-6)
    assert (idx[..., 0] > 5).any()  # some windows are dropped or clipped


# ---- take_along_axis and .at ------------------------------------------------------------------

def test_take_along_axis_matches_numpy_and_wraps_negatives(layout):
    idx1 = rng.integers(-4, 4, (8, 8, 6)).astype(np.int32)   # along the last axis, negatives wrap
    idx0 = rng.integers(0, 8, (5, 1, 4)).astype(np.int32)    # along axis 0, broadcast over axis 1
    idx_flat = np.array([0, 255, -1, 17], np.int32)
    got = tessera.jit(lambda x, a, b, c: (jnp.take_along_axis(x, a, axis=2), jnp.take_along_axis(x, b, axis=0),
                                          jnp.take_along_axis(x, a, axis=-1), jnp.take_along_axis(x, c, axis=None)))(
        layout(X), idx1, idx0, idx_flat)
    np.testing.assert_array_equal(np.asarray(got[0]), np.take_along_axis(X, idx1 % 4, axis=2))
    np.testing.assert_array_equal(np.asarray(got[1]), np.take_along_axis(X, np.broadcast_to(idx0, (5, 8, 4)), 0))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(got[0]))
    np.testing.assert_array_equal(np.asarray(got[3]), np.take_along_axis(X.ravel(), idx_flat % 256, axis=0))


def test_take_along_axis_out_of_range_per_mode(layout):
    idx = np.tile(np.array([0, 3, 4, -5, 9, -1], np.int32), (8, 8, 1))
    x = layout(X)
    got = tessera.jit(lambda x, i: (jnp.take_along_axis(x, i, axis=2), jnp.take_along_axis(x, i, 2, mode="clip"),
                                    jnp.take_along_axis(x, i, 2, mode="fill", fill_value=7.0),
                                    jnp.take_along_axis(x, i, 2, mode="one_hot")))(x, idx)
    wrapped = np.where(idx < 0, idx + 4, idx)
    inside = (wrapped >= 0) & (wrapped < 4)
    picked = np.take_along_axis(X, np.clip(wrapped, 0, 3), axis=2)
    np.testing.assert_array_equal(np.asarray(got[0]), np.where(inside, picked, np.nan))
    np.testing.assert_array_equal(np.asarray(got[1]), picked)  # clip after wrapping
    np.testing.assert_array_equal(np.asarray(got[2]), np.where(inside, picked, 7.0))
    np.testing.assert_allclose(np.asarray(got[3]), np.where(inside, picked, 0.0), rtol=1e-6)  # one-hot: 0
    # wrap_negative_indices (indexing.py): False leaves negatives out of range, True wraps them
    # even with promise_in_bounds.
    in_bounds_after_wrapping = idx[..., [0, 1, 3, 5]]
    got = tessera.jit(lambda x, i, j: (jnp.take_along_axis(x, i, 2, wrap_negative_indices=False),
                                       jnp.take_along_axis(x, i, 2, mode="clip", wrap_negative_indices=False),
                                       jnp.take_along_axis(x, j, 2, mode="promise_in_bounds",
                                                           wrap_negative_indices=True)))(x, idx,
                                                                                         in_bounds_after_wrapping)
    unwrapped = (idx >= 0) & (idx < 4)
    np.testing.assert_array_equal(np.asarray(got[0]), np.where(unwrapped, picked, np.nan))
    np.testing.assert_array_equal(np.asarray(got[1]), np.take_along_axis(X, np.clip(idx, 0, 3), axis=2))
    np.testing.assert_array_equal(np.asarray(got[2]), picked[..., [0, 1, 3, 5]])
    # indexing.py's docstring example: an out-of-bound index fills with NaN.
    small = np.array([[1., 2., 3.], [4., 5., 6.]], np.float32)
    got = np.asarray(jnp.take_along_axis(small, np.array([[1, 0, 2]], np.int32), axis=0))
    np.testing.assert_array_equal(got, [[4., 2., np.nan]])


def _along_axis_reference(x, i, wrap, mode):
    """jnp.take_along_axis(x, i, axis=1) as jax/_src/numpy/indexing.py computes it: indices
    converted to int32 when negatives wrap (lax_utils.index_dtype_for_axis_size), kept otherwise,
    then numpy's take_along_axis with out-of-range ones clamped (clip) or NaN (fill)."""
    n = x.shape[1]
    j = i.astype(np.int32).astype(np.int64) if wrap else i.astype(np.int64)
    if wrap:
        j = np.where(j < 0, j + n, j)
    taken = np.take_along_axis(x, np.clip(j, 0, n - 1), axis=1)
    return taken if mode == "clip" else np.where((j >= 0) & (j < n), taken, np.nan)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32])
def test_take_along_axis_takes_narrow_integer_indices(dtype):
    # JAX's take_along_axis takes any integer indices; the SDK's gather int32 or int64 only.
    x = rng.standard_normal((3, 6)).astype(np.float32)
    big = -2 if np.dtype(dtype).kind == "i" else int(np.iinfo(dtype).max)  # uint32's max is int32's -1
    i = np.array([[0, 5, 2, 7], [1, big, 3, 4], [5, 5, 100, 0]]).astype(dtype)
    for mode, wrap in (("fill", True), ("clip", True), ("fill", False), ("clip", False)):
        want = _along_axis_reference(x, i, wrap, mode)
        got = jnp.take_along_axis(x, i, axis=1, mode=mode, wrap_negative_indices=wrap)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{mode} wrap={wrap}")
        if dtype != np.uint16:  # no Tessera dtype: numpy's uint16 indices are converted on the host
            got = tessera.jit(lambda x, i: jnp.take_along_axis(x, i, axis=1, mode=mode,
                                                               wrap_negative_indices=wrap))(x, i)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"jit {mode} wrap={wrap}")
    # The default (fill, negatives wrapped) under jit, and the gradient through it.
    if dtype != np.uint16:
        g = tessera.jit(tessera.grad(lambda x, i: jnp.take_along_axis(x, i, axis=1).sum()))(x, i)
        want_g = np.zeros_like(x)
        j = i.astype(np.int32).astype(np.int64)
        j = np.where(j < 0, j + 6, j)
        for r, c in zip(*np.nonzero((j >= 0) & (j < 6))):
            want_g[r, j[r, c]] += 1
        np.testing.assert_array_equal(np.asarray(g), want_g)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32])
def test_indexing_at_and_take_take_narrow_integer_indices(dtype):
    # JAX's indexing and .at[] convert integer index arrays to int32 after wrapping negatives
    # (jax/_src/numpy/indexing.py _index_to_gather), jnp.take's gather takes any integer dtype;
    # the SDK's int32 or int64 only. Against numpy with the same indices as int64.
    x = rng.standard_normal((6, 3)).astype(np.float32)
    i = np.array([0, -1 if np.dtype(dtype).kind == "i" else 5, 2, 4], dtype)
    j = i.astype(np.int64)
    u = rng.standard_normal((4, 3)).astype(np.float32)
    a = tessera.device_put(x)
    np.testing.assert_array_equal(np.asarray(a[i]), x[j])
    np.testing.assert_array_equal(np.asarray(a.at[i].get()), x[j])
    np.testing.assert_array_equal(np.asarray(jnp.take(a, i, axis=0)), x[j])
    want = x.copy()
    want[j] = u
    np.testing.assert_array_equal(np.asarray(a.at[i].set(u)), want)
    got = tessera.jit(lambda x, u: (x.at[i].add(u), x.at[i].multiply(u), x[i], jnp.take(x, i, axis=0)))(x, u)
    for k, ufunc in enumerate((np.add, np.multiply)):
        want = x.copy()
        ufunc.at(want, j, u)
        np.testing.assert_allclose(np.asarray(got[k]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[2]), x[j])
    np.testing.assert_array_equal(np.asarray(got[3]), x[j])
    # Out of range: dropped by .at[].add, NaN from take (a uint32 past int32's range too).
    k = np.array([1, 2**32 - 1 if dtype == np.uint32 else 7], dtype)
    want = x.copy()
    want[1] += 1
    np.testing.assert_array_equal(np.asarray(a.at[k].add(1.0)), want)
    np.testing.assert_array_equal(np.asarray(jnp.take(a, k, axis=0)), np.stack([x[1], np.full(3, np.nan, np.float32)]))
    # lax's scatters take any integer indices too (jax/_src/lax/slicing.py _scatter_dtype_rule
    # asks only for an integer type): rows i, k[:, None] of (6, 3) with ROWS_2D.
    got = tessera.jit(lambda x, u: (lax.scatter_add(x, i[:, None], u, ROWS_2D),
                                    lax.scatter_apply(x, k[:, None], jnp.exp, ROWS_2D, update_shape=(2, 3))))(x, u)
    want = x.copy()
    np.add.at(want, j[j >= 0], u[j >= 0])  # lax does not wrap negatives: -1 is dropped
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-6)
    want = x.copy()
    want[1] = np.exp(want[1])
    np.testing.assert_allclose(np.asarray(got[1]), want, rtol=1e-6)


@pytest.mark.parametrize("method,ufunc", [("multiply", np.multiply), ("mul", np.multiply), ("min", np.minimum),
                                          ("max", np.maximum), ("add", np.add),
                                          ("subtract", np.subtract)])
def test_at_combining_updates_match_numpy_ufunc_at(layout, method, ufunc):
    i = np.array([1, 4, 4, -1, 11, -9], np.int32)  # 4 twice, -1 wraps to 7, 11 and -9 dropped
    u = rng.uniform(0.5, 2.0, (8, 6, 4)).astype(np.float32)
    x = rng.uniform(0.5, 2.0, (8, 8, 4)).astype(np.float32)
    got = tessera.jit(lambda x, i, u: (getattr(x.at[:, i], method)(u), getattr(x.at[3], method)(1.5)))(layout(x), i,
                                                                                                     u)
    keep = (i >= -8) & (i < 8)
    want = x.copy()
    ufunc.at(want, (slice(None), i[keep] % 8), u[:, keep])
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-6)
    row = x.copy()
    row[3] = ufunc(row[3], np.float32(1.5))
    np.testing.assert_allclose(np.asarray(got[1]), row, rtol=1e-6)


def test_at_modes_follow_jax_docstring():
    # jax/_src/numpy/array_methods.py _IndexUpdateHelper's docstring examples.
    x = tessera.device_put(np.arange(5.0, dtype=np.float32))
    assert np.asarray(x.at[10].add(10)).tolist() == [0, 1, 2, 3, 4]  # dropped
    assert np.asarray(x.at[20].add(10, mode="clip")).tolist() == [0, 1, 2, 3, 14]
    assert float(x.at[20].get()) == 4.0
    assert np.isnan(float(x.at[20].get(mode="fill")))
    assert float(x.at[20].get(mode="fill", fill_value=-1)) == -1.0
    assert np.asarray(x.at[-1].set(99)).tolist() == [0, 1, 2, 3, 99]
    assert np.asarray(x.at[-1].set(99, wrap_negative_indices=False, mode="drop")).tolist() == [0, 1, 2, 3, 4]
    assert np.asarray(x.at[-1].set(99, wrap_negative_indices=False, mode="clip")).tolist() == [99, 1, 2, 3, 4]
    assert np.asarray(x.at[np.array([1, 1])].add(1.0, indices_are_sorted=True)).tolist() == [0, 3, 2, 3, 4]
    # out_sharding=None is JAX's default (array_methods.py _IndexUpdateRef.set); a bare P needs
    # a mesh (canonicalize_sharding raises ValueError: "Using PartitionSpec when you are not
    # under a mesh context is not allowed").
    assert np.asarray(x.at[1].set(7.0, out_sharding=None)).tolist() == [0, 7, 2, 3, 4]
    with pytest.raises(ValueError, match=r"\.set: a bare PartitionSpec needs a mesh"):
        x.at[1].set(0.0, out_sharding=P())
    # JAX's apply has no out_sharding parameter (array_methods.py _IndexUpdateRef.apply): a
    # TypeError, None included.
    with pytest.raises(TypeError, match="unexpected keyword argument 'out_sharding'"):
        x.at[1].apply(jnp.exp, out_sharding=None)
    # A Python int past int32: JAX's _scatter_update takes it as jnp.asarray(y), which raises
    # OverflowError (jax/_src/abstract_arrays.py), for a float x and an int32 x alike.
    for a in (x, tessera.device_put(np.arange(5, dtype=np.int32))):
        for update in (a.at[1].set, a.at[1].add, a.at[1].multiply, a.at[1].max):
            with pytest.raises(OverflowError, match="Python int 1099511627776 too large to convert to int32"):
                update(2**40)
    assert np.asarray(tessera.device_put(np.arange(5, dtype=np.uint32)).at[1].set(2**31 + 1)).tolist() == \
        [0, 2**31 + 1, 2, 3, 4]  # fits x's uint32: jnp.asarray(y, dtype=x.dtype), no overflow


def test_uint32_indices_past_int32_follow_jaxs_conversions():
    # JAX's indexing and .at[] convert an index array to int32 with wraparound, after wrapping
    # negatives (an unsigned index has none) (jax/_src/numpy/indexing.py _index_to_gather): 2**31
    # + 5 and 2**32 - 1 become negative, out of range below 0, so clip takes row 0, fill gives NaN
    # and a scatter drops them. jnp.take's gather takes uint32 indices as they are (clip: the last
    # row) and its mode='wrap' takes the mod in uint32 first (indexing.py _take: ufuncs.mod).
    x = rng.standard_normal((10, 3)).astype(np.float32)
    k = np.array([2**31 + 5, 2**32 - 1, 3], np.uint32)
    wrapped = k.astype(np.int32).astype(np.int64)  # two's complement, as convert_element_type
    n = x.shape[0]
    clip = x[np.clip(wrapped, 0, n - 1)]
    fill = np.where(((wrapped >= 0) & (wrapped < n))[:, None], x[np.clip(wrapped, 0, n - 1)], np.nan)
    take_clip = x[np.clip(k.astype(np.int64), 0, n - 1)]
    take_wrap = x[k.astype(np.int64) % n]
    dropped = x.copy()
    dropped[3] += 1.0
    a = tessera.device_put(x)
    for run in (lambda f, *args: f(*args), lambda f, *args: tessera.jit(f)(*args)):
        np.testing.assert_array_equal(np.asarray(run(lambda a: a.at[k].get(mode="clip"), a)), clip)
        np.testing.assert_array_equal(np.asarray(run(lambda a: a[k], a)), clip)  # mode None clamps
        np.testing.assert_array_equal(np.asarray(run(lambda a: a.at[k].get(mode="fill"), a)), fill)
        np.testing.assert_array_equal(np.asarray(run(lambda a: a.at[k].add(1.0), a)), dropped)
        np.testing.assert_array_equal(np.asarray(run(lambda a: jnp.take(a, k, axis=0, mode="clip"), a)), take_clip)
        np.testing.assert_array_equal(np.asarray(run(lambda a: jnp.take(a, k, axis=0, mode="wrap"), a)), take_wrap)
    ki = tessera.device_put(k)  # traced uint32 indices
    got = tessera.jit(lambda a, k: (a.at[k].get(mode="clip"), jnp.take(a, k, axis=0, mode="wrap")))(a, ki)
    np.testing.assert_array_equal(np.asarray(got[0]), clip)
    np.testing.assert_array_equal(np.asarray(got[1]), take_wrap)


def test_at_update_modes_on_sharded_arrays(layout):
    i = np.array([1, 9, -1, -12], np.int32)
    u = rng.uniform(0.5, 2.0, (8, 4, 4)).astype(np.float32)
    got = tessera.jit(lambda x, i, u: (x.at[:, i].mul(u, mode="clip"), x.at[:, i].max(u, wrap_negative_indices=False),
                                       x.at[:, i].get(mode="fill", fill_value=0.5)))(layout(X), i, u)
    clipped = X.copy()
    np.multiply.at(clipped, (slice(None), np.clip(np.where(i < 0, i + 8, i), 0, 7)), u)
    np.testing.assert_allclose(np.asarray(got[0]), clipped, rtol=1e-6)
    unwrapped = X.copy()
    np.maximum.at(unwrapped, (slice(None), i[:1]), u[:, :1])  # only 1 is in range without wrapping
    np.testing.assert_array_equal(np.asarray(got[1]), unwrapped)
    wrapped = np.where(i < 0, i + 8, i)
    inside = (wrapped >= 0) & (wrapped < 8)
    want = np.where(inside[None, :, None], X[:, np.clip(wrapped, 0, 7)], 0.5)
    np.testing.assert_array_equal(np.asarray(got[2]), want)


def test_at_outside_jit_on_integers():
    x = np.arange(6, dtype=np.int32)
    a = tessera.device_put(x)
    assert np.asarray(a.at[np.array([0, 2, 2])].max(np.array([5, 1, 9], np.int32))).tolist() == [5, 1, 9, 3, 4, 5]
    assert np.asarray(a.at[np.array([1, 5])].min(0)).tolist() == [0, 0, 2, 3, 4, 0]
    assert np.asarray(a.at[np.array([1, 1])].multiply(3)).tolist() == [0, 9, 2, 3, 4, 5]


_UFUNCS = {"set": None, "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "min": np.minimum,
           "max": np.maximum}


def _at_reference(x, i, u, method, dtype):
    """x.at[i].<method>(u) as jax/_src/ops/scatter.py's _scatter_impl computes it: x and u
    promoted to `dtype` (`x, y = promote_dtypes(x, y)`), combined there (numpy's ufunc.at; i's
    out-of-range entries dropped, negatives wrapped), then cast back to x's dtype
    (`lax._convert_element_type(out, dtype, weak_type)`: truncation, integer wrap-around)."""
    keep = (i >= -x.shape[0]) & (i < x.shape[0])
    out = x.astype(dtype)
    ui = np.broadcast_to(u, i.shape).astype(dtype)[keep]
    if method == "set":
        out[i[keep]] = ui
    else:
        _UFUNCS[method].at(out, i[keep], ui)
    return out.astype(x.dtype)


@pytest.mark.parametrize("method", list(_UFUNCS))
def test_at_on_integers_combines_in_the_promoted_dtype(method):
    # Float updates of an int32 x: float32 arithmetic, then truncation (-3 + 2.75 is 0, not -3 + 2;
    # 5 * 0.5 is 2, not 5 * 0). The values are exact in float32, so the order of repeated
    # updates does not matter. set takes unique indices (XLA picks one of repeated ones).
    x = np.array([3, 5, -3, 7, -8, 11], np.int32)
    i = np.array([0, 2, 4, 1, -1, 9] if method == "set" else [0, 2, 2, 4, 1, -1, 9], np.int32)
    u = np.array([0.5, 2.75, -1.25, 2.5, 0.5, -0.75, 4.0][:len(i)], np.float32)
    # int8 x, int32 updates: combined in int32, then wrapped to int8 (max(5, 200) is 200 -> -56,
    # not max(5, int8(200)) = 5).
    x8 = np.array([5, -7, 100, 0], np.int8)
    i8 = np.array([0, 1, 2] if method == "set" else [0, 1, 1, 2], np.int32)
    u8 = np.array([200, 300, -1, 3][:len(i8)], np.int32)
    run = tessera.jit(lambda x, i, u, x8, i8, u8: (
        getattr(x.at[i], method)(u), getattr(x.at[i], method)(u, mode="drop"), getattr(x.at[2], method)(0.5),
        getattr(x8.at[i8], method)(u8), getattr(x8.at[3], method)(1000)))
    got = run(x, i, u, x8, i8, u8)
    # A Python int that int8 cannot hold: jnp.asarray(1000), converted to int8 (-24) by
    # promote_dtypes (the weak type gives way), then combined in int8.
    np.testing.assert_array_equal(np.asarray(got[4]), _at_reference(x8, np.array([3]), np.array(1000).astype(np.int8),
                                                                    method, np.int8))
    want = _at_reference(x, i, u, method, np.float32)
    for g in got[:2]:
        assert g.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(g), want)
    np.testing.assert_array_equal(np.asarray(got[2]), _at_reference(x, np.array([2]), np.float32(0.5), method,
                                                                    np.float32))
    np.testing.assert_array_equal(np.asarray(got[3]), _at_reference(x8, i8, u8, method, np.int32))
    assert got[3].dtype == np.int8
    # Outside jit too (the eager path).
    np.testing.assert_array_equal(np.asarray(getattr(tessera.device_put(x).at[i], method)(u)), want)


def test_at_divide_and_power_as_jax_builds_them(layout):
    # jax/_src/numpy/array_methods.py _IndexUpdateRef.divide / .power: x / (or **)
    # ones_like(x).at[idx].multiply(values), so repeated indices use their values' product and
    # out-of-range ones are dropped; an integer x divides to float32 (jnp.divide).
    i = np.array([1, 4, 4, -1, 11], np.int32)  # 4 twice, -1 wraps to 7, 11 dropped
    u = rng.uniform(0.5, 2.0, (8, 5, 4)).astype(np.float32)
    x = np.abs(X) + 0.5
    xi = np.arange(-8, 8, dtype=np.int32).reshape(2, 8)
    got = tessera.jit(lambda x, i, u, xi: (x.at[:, i].divide(u), x.at[:, i].power(u), x.at[:, i].divide(u, mode="clip"),
                                           xi.at[:, i].divide(2), xi.at[:, i].power(3)))(layout(x), i, u, xi)
    keep = (i >= -8) & (i < 8)
    d = np.ones_like(x)
    np.multiply.at(d, (slice(None), i[keep] % 8), u[:, keep])
    np.testing.assert_allclose(np.asarray(got[0]), x / d, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), x ** d, rtol=1e-5)
    clipped = np.ones_like(x)
    np.multiply.at(clipped, (slice(None), np.clip(np.where(i < 0, i + 8, i), 0, 7)), u)  # 11 -> 7, -1 -> 7
    np.testing.assert_allclose(np.asarray(got[2]), x / clipped, rtol=1e-6)
    di = np.ones_like(xi)
    np.multiply.at(di, (slice(None), i[keep] % 8), 2)
    assert got[3].dtype == np.float32 and got[4].dtype == np.int32
    np.testing.assert_allclose(np.asarray(got[3]), xi / di.astype(np.float32), rtol=1e-6)
    pi = np.ones_like(xi)
    np.multiply.at(pi, (slice(None), i[keep] % 8), 3)
    np.testing.assert_array_equal(np.asarray(got[4]), xi ** pi)
    # Outside jit too.
    np.testing.assert_allclose(np.asarray(tessera.device_put(x).at[:, i].divide(u)), x / d, rtol=1e-6)


def _apply_reference(x, rows, f):
    """f applied to row r of x once per occurrence of r in `rows` (XLA's scatter with f as its
    update computation: a repeated index applies f again)."""
    out = x.copy()
    for r in rows:
        out[r] = f(out[r])
    return out


def test_at_apply_and_lax_scatter_apply(layout):
    # jax/_src/numpy/array_methods.py _IndexUpdateRef.apply: lax.scatter_apply with the indexed
    # shape as update_shape; jax/_src/lax/slicing.py scatter_apply: duplicate indices apply func
    # repeatedly, out-of-range windows are dropped (mode None) or clamped (clip).
    i = np.array([1, 4, 4, -1, 11], np.int32)
    f = lambda v: v * 2.0 + 1.0  # noqa: E731
    got = tessera.jit(lambda x, i: (x.at[i].apply(f), x.at[i].apply(f, mode="clip"),
                                    x.at[i].apply(jnp.sin, wrap_negative_indices=False),
                                    x.at[:, 2].apply(jnp.exp)))(layout(X), i)
    np.testing.assert_allclose(np.asarray(got[0]), _apply_reference(X, [1, 4, 4, 7], f), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), _apply_reference(X, [1, 4, 4, 7, 7], f), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[2]), _apply_reference(X, [1, 4, 4], np.sin), rtol=1e-6)
    want = X.copy()
    want[:, 2] = np.exp(want[:, 2])
    np.testing.assert_allclose(np.asarray(got[3]), want, rtol=1e-6)
    # lax.scatter_apply with a partial window (update_shape (3, 2): columns 0 and 1 of each row).
    x = rng.standard_normal((6, 5)).astype(np.float32)
    rows = np.array([[4], [1], [4]], np.int32)
    out = lax.scatter_apply(x, rows, lambda v: v * v, ROWS_2D, update_shape=(3, 2))
    want = x.copy()
    for r in (4, 1, 4):
        want[r, :2] = want[r, :2] ** 2
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-6)
    # On integers, eagerly.
    xi = np.arange(6, dtype=np.int32)
    g = lambda v: v * 3 - 1  # noqa: E731
    got = tessera.device_put(xi).at[np.array([0, 2, 2])].apply(g)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(got), _apply_reference(xi, [0, 2, 2], g))
    with pytest.raises(TypeError, match=r"scatter_apply: Bounds of the window dimensions of updates must not exceed"):
        lax.scatter_apply(x, rows, jnp.sin, ROWS_2D, update_shape=(3, 6))
    with pytest.raises(TypeError, match="lax.ScatterDimensionNumbers"):
        lax.scatter_apply(x, rows, jnp.sin, ((1,), (0,), (0,)), update_shape=(3, 5))


def test_grad_of_at_apply_goes_through_func_applications():
    # Tessera's extension (JAX raises "scatter_apply JVP not implemented"): the gradient of
    # sum(w * x.at[rows].apply(sin)) is the chain rule through each application, against the
    # host's derivative: rows 4 twice (sin(sin(x))), 1 once, -1 wrapping to 5, 9 dropped.
    x = rng.uniform(-1.0, 1.0, (6, 3)).astype(np.float32)
    w = rng.standard_normal((6, 3)).astype(np.float32)
    rows = np.array([4, 1, 4, -1, 9], np.int32)
    g = tessera.jit(tessera.grad(lambda x: (x.at[rows].apply(jnp.sin) * w).sum()))(x)
    want = w.copy()
    want[[1, 5]] *= np.cos(x[[1, 5]])
    want[4] *= np.cos(np.sin(x[4])) * np.cos(x[4])
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)


# ---- transformations ----------------------------------------------------------------------------

def _central_differences(f, x, eps):
    g = np.zeros_like(x)
    for k in np.ndindex(*x.shape):
        d = np.zeros_like(x)
        d[k] = eps
        g[k] = (f(x + d) - f(x - d)) / (2 * eps)
    return g


@pytest.fixture
def x64():
    tessera.config.update("jax_enable_x64", True)
    yield
    tessera.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("name", ["gather", "take_along_axis", "scatter_add", "scatter_mul", "scatter_min",
                                  "scatter_max", "scatter", "at_mul", "at_divide", "at_power"])
def test_grad_matches_central_differences(x64, name):
    r = np.random.default_rng(7)
    x = r.uniform(0.5, 2.0, (6, 5))
    w = r.standard_normal((6, 5))
    upd = r.uniform(0.5, 2.0, (3, 5))
    rows = np.array([[4], [1], [3]], np.int64)  # unique (scatter's gradient needs it, as JAX's)
    dn = GD(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
    fns = {
        "gather": lambda x, u: lax.gather(x, np.array([[4], [1], [4]]), dn, (1, 5)) * u,
        "take_along_axis": lambda x, u: jnp.take_along_axis(x, np.array([[4, 0, 4, -1, 2]] * 6), axis=1) * w,
        "at_mul": lambda x, u: x.at[rows[:, 0]].mul(u) * w,
        # x / (x **) ones.at[rows].mul(u) (array_methods.py _IndexUpdateRef.divide / .power);
        # unique rows, as JAX's scatter_mul gradient needs.
        "at_divide": lambda x, u: x.at[rows[:, 0]].divide(u) * w,
        "at_power": lambda x, u: x.at[rows[:, 0]].power(u) * w,
    }
    f = fns.get(name, lambda x, u: getattr(lax, name)(x, rows, u, ROWS_2D) * w)

    def loss(x, u):
        return (jnp.sin(f(x, u))).sum()

    gx, gu = tessera.jit(tessera.grad(loss, argnums=(0, 1)))(x, upd)

    def host(xv, uv):
        return float(tessera.jit(loss)(xv, uv))

    np.testing.assert_allclose(np.asarray(gx), _central_differences(lambda v: host(v, upd), x, 1e-6), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(np.asarray(gu), _central_differences(lambda v: host(x, v), upd, 1e-6), rtol=1e-5,
                               atol=1e-7)


ROWS_2D = SD(update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))


def test_vmap_of_gather_and_scatter_is_the_loop(layout):
    idx = rng.integers(0, 8, (8, 5, 2)).astype(np.int32)
    upd = rng.standard_normal((8, 5, 4)).astype(np.float32)
    xs = layout(np.stack([X[:, :, 0]] * 8) + np.arange(8, dtype=np.float32)[:, None, None])
    host_x = np.asarray(xs)
    sd = SD(update_window_dims=(1,), inserted_window_dims=(0, 1), scatter_dims_to_operand_dims=(0, 1))
    xs3 = layout(np.stack([X] * 8))
    g = tessera.jit(tessera.vmap(lambda x, i: lax.gather(x, i, GD((), (0, 1), (0, 1)), (1, 1))))(xs, idx)
    s = tessera.jit(tessera.vmap(lambda x, i, u: lax.scatter_add(x, i, u, sd)))(xs3, idx, upd)
    for b in range(8):
        np.testing.assert_array_equal(np.asarray(g)[b], ref_gather(host_x[b], idx[b], GD((), (0, 1), (0, 1)), (1, 1)))
        np.testing.assert_allclose(np.asarray(s)[b], ref_scatter("scatter_add", X, idx[b], upd[b], sd), rtol=1e-6,
                                   atol=1e-6)


# ---- modes and errors -------------------------------------------------------------------------

def test_gather_scatter_mode_from_any_is_jax():
    # slicing.py GatherScatterMode.from_any.
    assert Mode.from_any(None) is Mode.FILL_OR_DROP
    assert Mode.from_any("fill") is Mode.FILL_OR_DROP and Mode.from_any("drop") is Mode.FILL_OR_DROP
    assert Mode.from_any("clip") is Mode.CLIP and Mode.from_any(Mode.CLIP) is Mode.CLIP
    assert Mode.from_any("promise_in_bounds") is Mode.PROMISE_IN_BOUNDS
    assert Mode.from_any("one_hot") is Mode.ONE_HOT
    with pytest.raises(ValueError, match='Unknown gather mode "wrap"'):
        Mode.from_any("wrap")
    with pytest.raises(ValueError, match='Unknown gather mode "raise"'):
        jnp.take_along_axis(X, np.zeros((8, 8, 1), np.int32), axis=2, mode="raise")


def test_bad_dimension_numbers_raise_the_sdk_message():
    i = np.zeros((3, 2), np.int32)
    # The C++ SDK's messages, as JAX's _gather_shape_rule / _scatter_shape_rule word them, and
    # raised as TypeError as theirs (jax/_src/lax/slicing.py _is_sorted, _gather_shape_rule).
    with pytest.raises(TypeError, match=r"gather: collapsed_slice_dims in gather op must be sorted; got \(1, 0\)"):
        tessera.jit(lambda x, i: lax.gather(x, i, GD((1,), (1, 0), (0, 1)), (1, 1, 4)))(X, i)
    with pytest.raises(TypeError, match=r"gather: Invalid start_index_map; domain is \[0, 3\), got: 1->5\."):
        lax.gather(X, i, GD((1,), (0, 1), (0, 5)), (1, 1, 4))
    with pytest.raises(TypeError, match="inserted_window_dims in scatter op must be sorted"):
        lax.scatter_add(X, i, np.zeros((3, 4), np.float32), SD((1,), (1, 0), (0, 1)))
    with pytest.raises(ValueError, match="gather: GatherScatterMode::kOneHot is take_along_axis's mode"):
        lax.gather(X, i, GD((1,), (0, 1), (0, 1)), (1, 1, 4), mode="one_hot")
    with pytest.raises(TypeError, match="lax.GatherDimensionNumbers"):
        lax.gather(X, i, ((1,), (0, 1), (0, 1)), (1, 1, 4))
    with pytest.raises(ValueError, match=r"take_along_axis: indices \(8, 1\) and x \(8, 8, 4\) need the same rank"):
        jnp.take_along_axis(X, np.zeros((8, 1), np.int32), axis=1)
    with pytest.raises(TypeError, match="integer type"):
        jnp.take_along_axis(X, np.zeros((8, 8, 1), np.float32), axis=2)


def test_gather_shape_errors_are_type_errors_as_jax():
    # jax/_src/lax/slicing.py _gather_shape_rule raises TypeError for the slice sizes and the
    # dimension numbers; _gather_dtype_rule ValueError for non-integer indices. Under jit, grad
    # and eagerly; a mode JAX cannot lower (one_hot: _gather_lower asserts) stays a ValueError.
    i = np.zeros((3, 2), np.int32)
    with pytest.raises(TypeError, match=r"gather: Slice size at index 2 in gather op is out of range, must be within "
                                        r"\[0, 4 \+ 1\), got 5\."):
        tessera.jit(lambda x: lax.gather(x, i, GD((1,), (0, 1), (0, 1)), (1, 1, 5)))(X)
    with pytest.raises(TypeError, match=r"gather: Gather op can only collapse slice dims with bound 1, but bound is 2 "
                                        r"for index 1 at position 1\."):
        tessera.grad(lambda x: lax.gather(x, i, GD((1,), (0, 1), (0, 1)), (1, 2, 4)).sum())(X)
    with pytest.raises(TypeError, match=r"gather: Gather op has 1 elements in start_index_map and the bound of "
                                        r"dimension index_vector_dim=1 of indices is 2"):
        lax.gather(X, i, GD((1, 2), (0,), (0,)), (1, 8, 4))
    with pytest.raises(ValueError, match=r"gather: indices are float32\(3, 2\); they need int32 or int64") as e:
        lax.gather(X, i.astype(np.float32), GD((1,), (0, 1), (0, 1)), (1, 1, 4))
    assert not isinstance(e.value, TypeError)
    with pytest.raises(ValueError, match="gather: GatherScatterMode::kOneHot is take_along_axis's mode") as e:
        tessera.jit(lambda x: lax.gather(x, i, GD((1,), (0, 1), (0, 1)), (1, 1, 4), mode="one_hot"))(X)
    assert not isinstance(e.value, TypeError)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.uint8, np.uint16, np.uint32])
def test_lax_gather_takes_narrow_integer_indices(dtype):
    # JAX's _gather_dtype_rule asks only for an integer type (jax/_src/lax/slicing.py), and its
    # gather takes the indices as they are: in range as their values, out of range clamped by
    # CLIP and PROMISE_IN_BOUNDS (XLA) and filled by FILL_OR_DROP; a uint32 past int32's range
    # is out of range above. Against ref_gather with the indices as int64.
    dn, sizes, _ = POINT
    hi = int(np.iinfo(dtype).max)  # out of range above for every dtype (127 and more)
    i = np.array([[0, 1], [7, 7], [3, 2], [5, 0], [2, hi], [hi, 3]]).astype(dtype)
    j = i.astype(np.int64)
    for mode in ("clip", "fill", None):
        want = ref_gather(X, j, dn, sizes, "fill" if mode == "fill" else "clip")
        got = lax.gather(X, i, dn, sizes, mode=mode)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{mode}")
        if dtype != np.uint16:  # no Tessera dtype: numpy's uint16 indices are converted on the host
            got = tessera.jit(lambda x, i: lax.gather(x, i, dn, sizes, mode=mode))(X, i)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"jit {mode}")


def test_scatter_shape_errors_are_type_errors_as_jax():
    # jax/_src/lax/slicing.py _scatter_shape_rule raises TypeError for the updates' rank and bounds
    # and the dimension numbers, lax.check_same_dtypes TypeError for the updates' dtype, and
    # _scatter_dtype_rule ValueError for non-integer indices. Under jit, grad and eagerly.
    x = np.zeros((4, 3), np.float32)
    i = np.zeros((2, 1), np.int32)
    with pytest.raises(TypeError, match=r"scatter_add: Bounds of the window dimensions of updates must not exceed the "
                                        r"bounds of the corresponding dimensions of operand\. For dimension 1, updates "
                                        r"bound is 5, operand bound is 3\."):
        tessera.jit(lambda x: lax.scatter_add(x, i, np.zeros((2, 5), np.float32), ROWS_2D))(x)
    with pytest.raises(TypeError, match=r"scatter_max: Bounds of the scatter dimensions of updates must be the same as "
                                        r"the bounds of the corresponding dimensions of scatter indices"):
        tessera.grad(lambda x: lax.scatter_max(x, i, np.zeros((3, 3), np.float32), ROWS_2D).sum())(x)
    with pytest.raises(TypeError, match=r"scatter_mul: Updates tensor must be of rank 2; got 1"):
        lax.scatter_mul(x, i, np.zeros((3,), np.float32), ROWS_2D)
    with pytest.raises(TypeError, match=r"scatter_sub: Scatter op has window of size 1; doesn't match operand of "
                                        r"rank 2"):
        lax.scatter_sub(x, i, np.zeros((2, 3), np.float32), SD((1,), (), (0,)))
    with pytest.raises(TypeError, match="scatter: the updates are int32; they need the operand's dtype float32"):
        tessera.jit(lambda x: lax.scatter(x, i, np.zeros((2, 3), np.int32), ROWS_2D))(x)
    with pytest.raises(ValueError, match=r"scatter_min: indices are float32\(2, 1\); they need int32 or int64"):
        lax.scatter_min(x, i.astype(np.float32), np.zeros((2, 3), np.float32), ROWS_2D)
    # x.at[]: the updates are broadcast to the indexed shape first, whose error JAX raises as a
    # ValueError (jax/_src/lax/lax.py broadcast_to: "Incompatible types for broadcasting").
    a = tessera.device_put(np.arange(6, dtype=np.int32))
    for update in (lambda r: r.set(np.ones(3, np.float32)), lambda r: r.set(np.ones(3), mode="clip"),
                   lambda r: r.multiply(np.ones(3, np.int32)), lambda r: r.min(np.ones((2, 2), np.int32))):
        with pytest.raises(ValueError, match="broadcast") as e:
            tessera.jit(lambda a: update(a.at[np.array([0, 2])]))(a)
        assert not isinstance(e.value, TypeError)


def test_explicit_axes_gather_and_scatter_refuse_as_jax_and_at_lays_updates_out():
    # JAX's explicit-mode rules (jax/_src/lax/slicing.py _gather_spec_computation,
    # _scatter_spec_computation): x[ids, :] with ids split is refused
    # (tests/pjit_test.py test_indices_sharded_gather_error) with the advice of
    # _gather_sharding_rule; a scatter whose operand is split on a window dimension with the
    # updates unsplit there is refused (operand and updates must be split alike); .at[] lays its
    # updates out as the indexed slice of x (jax/_src/ops/scatter.py _scatter_impl), so
    # x.at[i].set / multiply with unsplit values keep x's layout. A refusal is a ValueError (the
    # SDK's INVALID_ARGUMENT; JAX's ShardingTypeError) in _gather_sharding_rule's /
    # _scatter_sharding_rule's text (x[ids] and jnp.take are JAX's gather_p, as lax.gather is), the
    # types after "Got" in Tessera's notation (JAX prints ShapedArray(float32[8,8@Y])).
    # (jax/_src/lax/slicing.py, _gather_sharding_rule and _scatter_sharding_rule.)
    m = tessera.make_mesh((2, 4), ("X", "Y"), axis_types=tessera.sharding.AxisType.Explicit)
    x = rng.standard_normal((8, 8)).astype(np.float32)
    ids = np.array([0, 2, 5, 7], np.int32)
    xs = tessera.device_put(x, NamedSharding(m, P(None, "Y")))
    split_ids = tessera.device_put(ids, NamedSharding(m, P("X")))
    with pytest.raises(ValueError, match=r"gather: Use `\.at\[\.\.\.\]\.get\(out_sharding=\)` to provide output "
                                         r"PartitionSpec for the gather indexing as out sharding could not be "
                                         r"resolved unambiguously \(or would require collectives on inputs\)\. Got "
                                         r"operand=f32\[8,8@Y\], indices=i32\[4@X\].*dimension 0 of the indices is "
                                         r"split over \('X',\)"):
        tessera.jit(lambda x, i: jnp.sum(x[i, :]))(xs, split_ids)
    got = tessera.jit(lambda x, i: x.at[i].get(out_sharding=P("X", "Y")))(xs, split_ids)
    np.testing.assert_array_equal(np.asarray(got), x[ids])
    u = rng.standard_normal((4, 8)).astype(np.float32)
    # lax.scatter says it in _scatter_sharding_rule's text too.
    with pytest.raises(ValueError, match=r"scatter: Use `\.at\[\.\.\.\]\.set/add/mul/\.\.\.\(out_sharding=\)` to "
                                         r"provide output PartitionSpec for the scatter update as out sharding could "
                                         r"not be resolved unambiguously \(or would require collectives on inputs\)\. "
                                         r"Got operand=f32\[8,8@Y\], indices=i32\[4,1\], updates=f32\[4,8\]"):
        tessera.jit(lambda x, i, u: lax.scatter(x, i[:, None], u, ROWS_2D))(xs, ids, u)
    # x.at[ids].apply(f) is lax.scatter_apply, which binds scatter_p on x and
    # lax.full(update_shape, 0, x.dtype) (jax/_src/lax/slicing.py scatter_apply): x split on the
    # window dimension 1 with those updates unsplit is refused, naming x's type, not the int32
    # counts Tessera builds.
    with pytest.raises(ValueError, match=r"scatter_apply: Use `\.at\[\.\.\.\]\.set/add/mul/\.\.\.\(out_sharding=\)` "
                                         r"to provide output PartitionSpec .*\. Got operand=f32\[8,8@Y\], "
                                         r"indices=i32\[4,1\], updates=f32\[4,8\]"):
        tessera.jit(lambda x: x.at[ids].apply(lambda v: v * 2.0))(xs)
    got = tessera.jit(lambda x, u: (x.at[ids].set(u), x.at[ids].multiply(2.0), x.at[ids].min(u)))(xs, u)
    want_set, want_mul, want_min = x.copy(), x.copy(), x.copy()
    want_set[ids] = u
    want_mul[ids] *= 2.0
    want_min[ids] = np.minimum(x[ids], u)
    for g, want in zip(got, (want_set, want_mul, want_min)):
        np.testing.assert_array_equal(np.asarray(g), want)
        assert g.sharding.is_equivalent_to(NamedSharding(m, P(None, "Y")), 2)


def test_at_updates_and_get_with_out_sharding_follow_the_refusals_advice():
    # The explicit-mode refusal of a scatter says "Use `.at[...].set/add/mul/...(out_sharding=)`"
    # (jax/_src/lax/slicing.py _scatter_sharding_rule); given, the update runs under auto_axes over
    # the mesh's Explicit axes and its result is laid out as out_sharding
    # (jax/_src/ops/scatter.py _scatter_update; array_methods.py _IndexUpdateRef passes it through
    # set/add/subtract/multiply/divide/power/min/max, divide and power to their multiply), and
    # get(mode=, out_sharding=) likewise (jax/_src/numpy/indexing.py rewriting_take). What JAX
    # asserts (tests/pjit_test.py): test_at_add_lower_to_scatter_add, x P('x', None) and ids
    # resharded to P('x'): x.at[:, ids].add(5.0, out_sharding=P('x', None)) has the aval spec and
    # the sharding P('x', None), and out_sharding=None gives x's; test_index_update, every update
    # with out_sharding=P('x', None) on params P('x', None) has that sharding; test_scatter_gather,
    # x.at[:, i].set(x.at[:, j].get(out_sharding=typeof(i).sharding), out_sharding=typeof(x).sharding)
    # runs. Values: numpy's (the column index 16 is out of range: dropped, or filled by get).
    m = tessera.make_mesh((2, 4), ("X", "Y"), axis_types=tessera.sharding.AxisType.Explicit)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    ids = np.array([1, 3, -2, 16], np.int32)
    u = rng.integers(1, 4, (8, 4)).astype(np.float32)
    xs = tessera.device_put(x, NamedSharding(m, P("X", "Y")))
    split_ids = tessera.device_put(ids, NamedSharding(m, P("X")))
    us = tessera.device_put(u, NamedSharding(m, P("X", None)))
    # Without out_sharding the split indices (and here the split indexed dimension) are refused:
    # the updates' slice_sharding would put 'X' on x's rows and on the indices' dimension
    # (_index_to_gather's aia_spec), which NamedSharding refuses (named_sharding.py check_pspec).
    with pytest.raises(ValueError, match=r"P\('X', 'X'\) has duplicate entries for `X`"):
        tessera.jit(lambda x, i: x.at[:, i].add(5.0))(xs, split_ids)
    with pytest.raises(ValueError, match=r"Use `\.at\[\.\.\.\]\.get\(out_sharding=\)` to provide output"):
        tessera.jit(lambda x, i: x.at[:, i].get(mode="fill", fill_value=-1.0))(xs, split_ids)

    cols = [c % 16 for c in ids if -16 <= c < 16]
    kept = [k for k, c in enumerate(ids) if -16 <= c < 16]

    def reference(combine):
        want = x.copy()
        for k, c in zip(kept, cols):
            want[:, c] = combine(want[:, c], u[:, k])
        return want

    updates = {
        "set": (lambda r, v: r.set(v, out_sharding=P("X", "Y")), lambda a, b: b),
        "add": (lambda r, v: r.add(v, out_sharding=P("X", "Y")), np.add),
        "subtract": (lambda r, v: r.subtract(v, out_sharding=P("X", "Y")), np.subtract),
        "multiply": (lambda r, v: r.multiply(v, out_sharding=P("X", "Y")), np.multiply),
        "divide": (lambda r, v: r.divide(v, out_sharding=P("X", "Y")), np.divide),
        "power": (lambda r, v: r.power(v, out_sharding=P("X", "Y")), np.power),
        "min": (lambda r, v: r.min(v, out_sharding=P("X", "Y")), np.minimum),
        "max": (lambda r, v: r.max(v, out_sharding=P("X", "Y")), np.maximum),
    }
    seen = []

    def f(x, i, v):
        outs = [update(x.at[:, i], v) for update, _ in updates.values()]
        outs.append(x.at[:, i].get(mode="fill", fill_value=-1.0, out_sharding=P("X", None)))
        seen.extend(tessera.typeof(o).sharding.spec for o in outs)
        return outs

    got = tessera.jit(f)(xs, split_ids, us)
    assert seen == [P("X", "Y")] * len(updates) + [P("X", None)]
    for g, (name, (_, combine)) in zip(got, updates.items()):
        np.testing.assert_allclose(np.asarray(g), reference(combine), rtol=1e-5, err_msg=name)
        assert g.sharding == NamedSharding(m, P("X", "Y")), name
    want_get = np.where(np.array([-16 <= c < 16 for c in ids]), x[:, [c % 16 for c in ids]], -1.0)
    np.testing.assert_array_equal(np.asarray(got[-1]), want_get)
    assert got[-1].sharding == NamedSharding(m, P("X", None))

    # Outside jit (one jitted call each), with a NamedSharding; the advice of test_scatter_gather.
    eager = xs.at[:, split_ids].set(us, out_sharding=NamedSharding(m, P(None, "Y")))
    assert eager.sharding == NamedSharding(m, P(None, "Y"))
    np.testing.assert_array_equal(np.asarray(eager), reference(lambda a, b: b))
    eager_get = xs.at[:, split_ids].get(mode="fill", fill_value=-1.0, out_sharding=NamedSharding(m, P(None, "X")))
    assert eager_get.sharding == NamedSharding(m, P(None, "X"))
    np.testing.assert_array_equal(np.asarray(eager_get), want_get)

    # out_sharding=None is the default: laid out as x (test_at_add_lower_to_scatter_add), the same
    # values as without it.
    plain_ids = tessera.device_put(ids, NamedSharding(m, P()))
    xr = tessera.device_put(x, NamedSharding(m, P("X", None)))
    for r in (xr.at[:, plain_ids].add(5.0, out_sharding=None), tessera.jit(
            lambda x, i: x.at[:, i].add(5.0, out_sharding=None))(xr, plain_ids)):
        assert r.sharding == NamedSharding(m, P("X", None))
        np.testing.assert_array_equal(np.asarray(r), np.asarray(xr.at[:, plain_ids].add(5.0)))

    # A spec longer than the result's rank is refused, naming the call, the spec and the result
    # (JAX's NamedSharding.check_compatible_aval words it "only valid for values of rank at least").
    with pytest.raises(ValueError, match=r"\.set: out_sharding P\('X', None, None\) is only valid for "
                                         r"values of rank at least 3, but was applied to the result "
                                         r"float32\[8, 16\] of rank 2"):
        tessera.jit(lambda x, i, v: x.at[:, i].set(v, out_sharding=P("X", None, None)))(xs, split_ids, us)
    with pytest.raises(ValueError, match=r"\.get: out_sharding .* is only valid for values of rank at least 3"):
        xs.at[:, split_ids].get(mode="fill", out_sharding=NamedSharding(m, P("X", None, None)))
    # The plain get (no mode=) too, inside jit and outside it (one jitted call).
    for get in (lambda x, i: x.at[:, i].get(out_sharding=P("X", None, None)),
                tessera.jit(lambda x, i: x.at[:, i].get(out_sharding=P("X", None, None)))):
        with tessera.set_mesh(m), pytest.raises(
                ValueError, match=r"^\.get: out_sharding P\('X', None, None\) is only valid for values of rank at "
                                  r"least 3, but was applied to the result float32\[8, 4\] of rank 2$"):
            get(xs, split_ids)
    with pytest.raises(TypeError, match=r"`out_sharding` argument of \.add only supports instances of `NamedSharding` "
                                        r"or `PartitionSpec`"):
        xs.at[:, split_ids].add(1.0, out_sharding=("X", None))


def test_scatter_gather_with_type_shardings_as_jaxs_test():
    # tests/pjit_test.py test_scatter_gather ((2,) Explicit mesh, x, i, j split over 'x'):
    # x.at[:, i].set(x.at[:, j].get(out_sharding=typeof(i).sharding), out_sharding=typeof(x).sharding)
    # runs (the sharding of a type, on the trace's abstract mesh, is taken as out_sharding); the
    # result has x's sharding and numpy's values.
    m = tessera.make_mesh((2,), ("x",), axis_types=tessera.sharding.AxisType.Explicit)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    i, j = np.array([0, 2, 5, 7], np.int32), np.array([1, 1, 3, 6], np.int32)
    xs, i_s, j_s = (tessera.device_put(a, NamedSharding(m, P("x"))) for a in (x, i, j))

    @tessera.jit
    def f1(x, i, j):
        x_a_j = x.at[:, j].get(out_sharding=tessera.typeof(i).sharding)
        return x.at[:, i].set(x_a_j, out_sharding=tessera.typeof(x).sharding)

    out = f1(xs, i_s, j_s)
    want = x.copy()
    want[:, i] = x[:, j]
    np.testing.assert_array_equal(np.asarray(out), want)
    assert out.sharding == NamedSharding(m, P("x", None))


def test_grad_through_at_updates_with_out_sharding():
    # JAX differentiates through auto_axes (the update's transpose runs with the same axis
    # types as the forward), so grad of x.at[:, i].add / set(u, out_sharding=) with split indices
    # works; the gradients take their primals' shardings. Host reference: d sum(y ** 2) = 2 y,
    # zero where set overwrote x, and 2 u for set's updates (unique indices).
    m = tessera.make_mesh((2, 2), ("x", "y"), axis_types=tessera.sharding.AxisType.Explicit)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    ids = np.array([0, 2], np.int32)
    u = rng.standard_normal((8, 2)).astype(np.float32)
    xs = tessera.device_put(x, NamedSharding(m, P("x", "y")))
    i = tessera.device_put(ids, NamedSharding(m, P("x")))
    us = tessera.device_put(u, NamedSharding(m, P("x", None)))
    g_add = tessera.jit(tessera.grad(lambda x, i: jnp.sum(x.at[:, i].add(1.0, out_sharding=P("x", "y")) ** 2)))(xs, i)
    want = x.copy()
    want[:, ids] += 1.0
    np.testing.assert_allclose(np.asarray(g_add), 2 * want, rtol=1e-6)
    assert g_add.sharding == xs.sharding
    g_x, g_u = tessera.jit(tessera.grad(lambda x, u, i: jnp.sum(x.at[:, i].set(u, out_sharding=P("x", "y")) ** 2),
                                        argnums=(0, 1)))(xs, us, i)
    want_x = 2 * x
    want_x[:, ids] = 0.0
    np.testing.assert_allclose(np.asarray(g_x), want_x, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g_u), 2 * u, rtol=1e-6)
    assert g_x.sharding == xs.sharding and g_u.sharding == us.sharding

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
    # out_sharding=None is JAX's default (array_methods.py _IndexUpdateRef.set); a sharding is
    # not supported on updates yet.
    assert np.asarray(x.at[1].set(7.0, out_sharding=None)).tolist() == [0, 7, 2, 3, 4]
    with pytest.raises(NotImplementedError, match=r"options \['out_sharding'\]"):
        x.at[1].set(0.0, out_sharding=P())


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
    assert np.asarray(a.at[[1, 5]].min(0)).tolist() == [0, 0, 2, 3, 4, 0]
    assert np.asarray(a.at[[1, 1]].multiply(3)).tolist() == [0, 9, 2, 3, 4, 5]


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
                                  "scatter_max", "scatter", "at_mul"])
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
    # The C++ SDK's messages, as JAX's _gather_shape_rule / _scatter_shape_rule word them.
    with pytest.raises(ValueError, match=r"gather: collapsed_slice_dims in gather op must be sorted; got \(1, 0\)"):
        tessera.jit(lambda x, i: lax.gather(x, i, GD((1,), (1, 0), (0, 1)), (1, 1, 4)))(X, i)
    with pytest.raises(ValueError, match=r"gather: Invalid start_index_map; domain is \[0, 3\), got: 1->5\."):
        lax.gather(X, i, GD((1,), (0, 1), (0, 5)), (1, 1, 4))
    with pytest.raises(ValueError, match="inserted_window_dims in scatter op must be sorted"):
        lax.scatter_add(X, i, np.zeros((3, 4), np.float32), SD((1,), (1, 0), (0, 1)))
    with pytest.raises(ValueError, match="gather: GatherScatterMode::kOneHot is take_along_axis's mode"):
        lax.gather(X, i, GD((1,), (0, 1), (0, 1)), (1, 1, 4), mode="one_hot")
    with pytest.raises(TypeError, match="lax.GatherDimensionNumbers"):
        lax.gather(X, i, ((1,), (0, 1), (0, 1)), (1, 1, 4))
    with pytest.raises(ValueError, match=r"take_along_axis: indices \(8, 1\) and x \(8, 8, 4\) need the same rank"):
        jnp.take_along_axis(X, np.zeros((8, 1), np.int32), axis=1)
    with pytest.raises(TypeError, match="integer type"):
        jnp.take_along_axis(X, np.zeros((8, 8, 1), np.float32), axis=2)

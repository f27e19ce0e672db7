# Indexing with integer arrays, .at[], jnp.take, remainder and lax's dynamic slices, under jit on
# sharded inputs, against numpy on the host. Out-of-range rules as JAX documents them:
# - x[i] clamps out-of-range indices and wraps negatives ("Out-of-bounds indexing" in
#   https://docs.jax.dev/en/latest/notebooks/Common_Gotchas_in_JAX.html: "for retrieval
#   operations ... the index is clamped to the bounds of the array");
# - .at[i].set/add drop updates at out-of-range indices (same section, and jax.Array.at);
# - jnp.take's default mode "fill" returns NaN for floats (jnp.take's docstring);
# - lax.dynamic_slice clamps its starts so the window fits (lax.dynamic_slice's docstring).
import numpy as np
import pytest

import tessera
import tessera.lax as lax
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P

rng = np.random.default_rng(3)
TABLE = rng.standard_normal((16, 8)).astype(np.float32)
IDS = np.array([[3, 0, 15, 7], [1, 1, 9, 12]], dtype=np.int32)


@pytest.fixture(scope="module", params=[P("data", "model"), P("model", None), P(None, "data"), P()],
                ids=["rows_data_cols_model", "rows_model", "cols_data", "replicated"])
def table(mesh, request):
    return tessera.device_put(TABLE, NamedSharding(mesh, request.param))


@pytest.fixture(scope="module")
def ids(mesh):
    return tessera.device_put(IDS, NamedSharding(mesh, P(None, "data")))


def test_index_array_lookups_match_numpy(table, ids):
    got = tessera.jit(lambda t, i: (t[i], t[:, i[0] % 8], t[2:10][i[1] % 8], t[i, 3], t[None, i[0]]))(table, ids)
    want = (TABLE[IDS], TABLE[:, IDS[0] % 8], TABLE[2:10][IDS[1] % 8], TABLE[IDS, 3], TABLE[None, IDS[0]])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_advanced_dims_go_first_where_numpy_puts_them_first(mesh):
    x = rng.standard_normal((4, 6, 8)).astype(np.float32)
    i = np.array([5, 0, 2], dtype=np.int32)
    xa = tessera.device_put(x, NamedSharding(mesh, P("data", None, "model")))
    got = np.asarray(tessera.jit(lambda x, i: x[0, :, i])(xa, i))
    assert got.shape == x[0, :, i].shape == (3, 6)  # numpy: int and array separated by a slice
    np.testing.assert_array_equal(got, x[0, :, i])


def test_out_of_range_and_negative_indices_follow_jax(table):
    i = np.array([-1, -16, 16, 100, -17], dtype=np.int32)
    got = tessera.jit(lambda t, i: (t[i], jnp.take(t, i, axis=0), jnp.take(t, i, axis=0, mode="clip"),
                                    jnp.take(t, i, axis=0, mode="wrap"), jnp.take(t, i, axis=0, fill_value=-2.0)))(
        table, i)
    clamped = TABLE[np.clip(np.where(i < 0, i + 16, i), 0, 15)]
    in_range = (i >= -16) & (i < 16)
    filled = np.where(in_range[:, None], TABLE[np.where(in_range, i, 0)], np.nan)
    np.testing.assert_array_equal(np.asarray(got[0]), clamped)
    np.testing.assert_array_equal(np.asarray(got[1]), filled)
    np.testing.assert_array_equal(np.asarray(got[2]), TABLE[np.clip(i, 0, 15)])  # clip does not wrap negatives
    np.testing.assert_array_equal(np.asarray(got[3]), TABLE[i % 16])
    np.testing.assert_array_equal(np.asarray(got[4]), np.where(in_range[:, None], filled, -2.0))


def test_take_flattens_without_an_axis(table):
    i = np.array([0, 17, 127], dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(tessera.jit(lambda t, i: jnp.take(t, i))(table, i)),
                                  np.take(TABLE, i))


def test_at_set_and_add_drop_out_of_range_updates(table):
    i = np.array([2, 5, 5, -1, 40], dtype=np.int32)
    u = rng.standard_normal((5, 8)).astype(np.float32)

    def f(t, i, u):
        return t.at[i].add(u), t.at[:, 1].set(0.0), t.at[i[:2]].set(u[:2]), t.at[i].get(), t.at[3].add(1.0)

    got = tessera.jit(f)(table, i, u)
    added = TABLE.copy()
    for k, j in enumerate(i):
        if -16 <= j < 16:
            added[j] += u[k]  # repeated indices accumulate; 40 is dropped
    col = TABLE.copy()
    col[:, 1] = 0
    rows = TABLE.copy()
    rows[[2, 5]] = u[:2]
    one = TABLE.copy()
    one[3] += 1
    np.testing.assert_allclose(np.asarray(got[0]), added, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), col)
    np.testing.assert_array_equal(np.asarray(got[2]), rows)
    np.testing.assert_array_equal(np.asarray(got[3]), TABLE[np.clip(np.where(i < 0, i + 16, i), 0, 15)])
    np.testing.assert_array_equal(np.asarray(got[4]), one)


def test_indexing_outside_jit_and_with_lists(table):
    # A list inside a tuple is an index array; a list as the whole index is refused (below).
    np.testing.assert_array_equal(np.asarray(table[np.array([4, 2])]), TABLE[[4, 2]])
    np.testing.assert_array_equal(np.asarray(table[[4, 2], 1:3]), TABLE[[4, 2], 1:3])
    np.testing.assert_array_equal(np.asarray(table.at[np.array([0, 1])].set(7.0)),
                                  np.where(np.arange(16)[:, None] < 2, 7.0, TABLE))


# JAX raises a TypeError for every non-tuple sequence used as the whole index, x[seq] and
# x.at[seq] alike (jax/_src/numpy/indexing.py eliminate_deprecated_list_indexing, called by
# NDIndexer.from_raw_indices and ops/scatter.py; jax-ml/jax#4564): arr[tuple(seq)] is the fix
# where an entry is a sequence, an array, a slice, None or ..., arr[array(seq)] otherwise. The
# cases and messages are tests/lax_numpy_indexing_test.py's testIndexSequenceDeprecation (and
# testBooleanIndexingList1D), the fixed index against numpy.
ARRAY_MSG = r"Using a non-tuple sequence for multidimensional indexing is not allowed.*arr\[array\(seq\)\]"
TUPLE_MSG = r"Using a non-tuple sequence for multidimensional indexing is not allowed.*arr\[tuple\(seq\)\]"


@pytest.mark.parametrize("idx, fix", [([0], "array"), ([0, 0], "array"), ([[0, 0]], "tuple"), ([0, [0, 1]], "tuple"),
                                      ([0, np.arange(2)], "tuple"), ([0, None], "tuple"),
                                      ([0, slice(None)], "tuple"), ([True, True, False], "array")],
                         ids=["one_int", "two_ints", "nested_list", "int_and_list", "int_and_array", "int_and_none",
                              "int_and_slice", "bools"])
def test_a_list_as_the_whole_index_is_jaxs_type_error(idx, fix):
    host = np.arange(6, dtype=np.float32).reshape(3, 2)
    x = tessera.numpy.asarray(host)
    msg = {"array": ARRAY_MSG, "tuple": TUPLE_MSG}[fix]
    with pytest.raises(TypeError, match=msg):
        x[idx]
    with pytest.raises(TypeError, match=msg):
        tessera.jit(lambda v: v[idx])(x)
    with pytest.raises(TypeError, match=msg):
        x.at[idx].set(0.0)
    with pytest.raises(TypeError, match=msg):
        tessera.jit(lambda v: v.at[idx].add(1.0))(x)
    fixed = np.array(idx) if fix == "array" else tuple(idx)
    np.testing.assert_array_equal(np.asarray(x[fixed]), host[fixed])
    want = host.copy()
    want[fixed] = 0.0
    np.testing.assert_array_equal(np.asarray(x.at[fixed].set(0.0)), want)


def test_gradient_of_an_embedding_lookup_is_a_scatter_add(table, ids):
    g = tessera.jit(tessera.grad(lambda t, i: (t[i] * t[i]).sum()))(table, ids)
    want = np.zeros_like(TABLE)
    np.add.at(want, IDS.ravel(), 2 * TABLE[IDS.ravel()])
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-6)


def test_remainder_and_fmod_follow_python_and_c():
    x = np.array([7, -7, 7, -7, 0], dtype=np.int32)
    y = np.array([3, 3, -3, -3, 5], dtype=np.int32)
    got = tessera.jit(lambda x, y: (x % y, jnp.remainder(x, 3), jnp.fmod(x, y), 10 % y, lax.rem(x, y)))(x, y)
    want = (x % y, x % 3, np.fmod(x, y), 10 % y, np.fmod(x, y))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_dynamic_slices_clamp_their_starts(mesh):
    x = np.arange(48, dtype=np.float32).reshape(6, 8)
    xa = tessera.device_put(x, NamedSharding(mesh, P(None, "model")))
    start = np.array(5, dtype=np.int32)

    def f(x, s):
        return (lax.dynamic_slice(x, (s, 1), (3, 4)), lax.dynamic_slice_in_dim(x, s - 4, 2, axis=0),
                lax.dynamic_update_slice(x, jnp.zeros((2, 2), jnp.float32), (s, s)),
                lax.dynamic_index_in_dim(x, s, 1, keepdims=False), lax.clamp(2.0, x, 9.0))

    got = tessera.jit(f)(xa, start)
    updated = x.copy()
    updated[4:6, 5:7] = 0  # row start 5 clamps to 6 - 2 = 4
    want = (x[3:6, 1:5], x[1:3], updated, x[:, 5], np.clip(x, 2, 9))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_unsupported_indices_say_what_is_missing(table):
    with pytest.raises(ValueError, match="mode 'raise'"):
        tessera.jit(lambda t, i: jnp.take(t, i, axis=0, mode="raise"))(table, np.array([1], np.int32))


def test_indexers_that_are_not_integers_are_type_errors_as_jax(table):
    # jax/_src/numpy/indexing.py IndexType.from_index: an array of a dtype that is no integer or
    # bool (float, a typed key) and a float scalar are TypeErrors naming the type (numpy's
    # IndexError is not what JAX raises; tests/lax_numpy_indexing_test.py testFloatIndexingError).
    message = "^Indexer must have integer or boolean type, got indexer with type {}$"
    with pytest.raises(TypeError, match=message.format("float32")):
        tessera.jit(lambda t, i: t[i])(table, np.array([1.0], np.float32))
    with pytest.raises(TypeError, match=message.format("float32")):
        table.at[jnp.array([1.0])].set(0.0)
    with pytest.raises(TypeError, match=message.format("float64")):
        table[1.0]
    with pytest.raises(TypeError, match=message.format("float32")):  # a list: canonical, as asarray's
        table[[1.0], 0]
    with pytest.raises(TypeError, match=message.format("float64")):
        table.at[0, 0.0].add(1.0)
    with pytest.raises(TypeError, match=message.format("float32")):
        table[np.float32(1.0)]
    with pytest.raises(TypeError, match=message.format("key<fry>")):
        table[tessera.random.key(0)]


# The general index: ints, slices, None, ... and integer index arrays broadcasting
# together, one lax gather or scatter as jax/_src/numpy/indexing.py _index_to_gather builds it.
# Cases mirror tests/lax_numpy_indexing_test.py's ADVANCED_INDEXING_TESTS and
# MIXED_ADVANCED_INDEXING_TESTS ("TupleOfPythonIntsAndIntArrays", "SlicesAndTwoIntArrayIndices",
# "NonesAndIntArrayIndices", "EllipsisWithArrayIndices"; testAdvancedIntegerIndexing,
# testMixedAdvancedIndexing for the updates), numpy the reference.
CUBE = rng.standard_normal((8, 6, 4)).astype(np.float32)
ROWS = np.array([[5, 0, -1], [2, 7, -8]], dtype=np.int32)  # negatives wrap as numpy's
COLS = np.array([3, -1, 0], dtype=np.int32)
DEPTH = np.array([[1], [-4]], dtype=np.int32)
GENERAL_INDICES = {
    "rows_cols": lambda r, c, d: (r, c),  # (ids1, ids2) broadcasting (2, 3) with (3,)
    "rows_slice_depth": lambda r, c, d: (r[0], slice(None), d),  # (ids, :, ids2): not adjacent, first
    "rows_none_depth": lambda r, c, d: (r[0], None, d),  # None separates them: first
    "slice_cols_depth": lambda r, c, d: (slice(2, 7), c, d),  # adjacent: where the first one is
    "rows_ellipsis_depth": lambda r, c, d: (r, Ellipsis, d),
    # An Ellipsis of no dimension still separates them (numpy; JAX's advanced_axes_are_contiguous
    # looks at the index before expanding it): first.
    "slice_cols_empty_ellipsis_depth": lambda r, c, d: (slice(None), c, Ellipsis, d),
    "none_rows_cols_none": lambda r, c, d: (None, r, c, None),
}

# Slices of any step, alone and with ints, index arrays, None and Ellipsis. Beside ints, None
# and Ellipsis only, x[idx] and x.at[idx].get() are JAX's to_static_slice
# (jax/_src/numpy/indexing.py: one strided lax.slice of the elements from the lowest, then
# lax.rev of the negative-step dimensions); beside an index array, _index_to_gather's gather (a
# unit step a window of the gather, another step a dimension of iota indices start + step * k,
# collapsed); cases from tests/lax_numpy_indexing_test.py's
# STATIC_INDEXING_TESTS "OneSliceIndexNegativeStride" and "OneSliceIndexNonUnitStride"
# (testStaticIndexing, testStaticIndexingGrads) and MIXED_ADVANCED_INDEXING_TESTS
# ("SlicesAndOneIntArrayIndex", testMixedAdvancedIndexing), numpy the reference.
STRIDED_INDICES = {
    "step_2": lambda r, c, d: slice(None, None, 2),
    "step_3_reversed": lambda r, c, d: (slice(1, 7, 3), slice(None, None, -1)),
    "negative_steps": lambda r, c, d: (slice(None, 1, -2), slice(4, 0, -3), slice(None, None, -1)),
    "empty": lambda r, c, d: (slice(3, 1, 2), slice(12, 12, -4)),
    "int_stride_none": lambda r, c, d: (3, slice(None, None, 2), None, slice(None, None, -2)),
    "array_stride_array": lambda r, c, d: (r, slice(5, None, -2), d),  # separated: arrays first
    "stride_arrays": lambda r, c, d: (slice(1, None, 3), c, d),  # adjacent: where they are
    "array_stride": lambda r, c, d: (r[0], slice(None, None, -2)),
    "ellipsis_stride": lambda r, c, d: (Ellipsis, slice(None, None, -3)),
    "stride_ellipsis_array": lambda r, c, d: (slice(7, 0, -2), Ellipsis, d[:, 0]),
}


@pytest.fixture(scope="module", params=[P("data", None, "model"), P(None, "model", "data"), P()],
                ids=["rows_data_depth_model", "cols_model_depth_data", "replicated"])
def cube(mesh, request):
    return tessera.device_put(CUBE, NamedSharding(mesh, request.param))


@pytest.mark.parametrize("case", sorted({**GENERAL_INDICES, **STRIDED_INDICES}))
def test_two_index_arrays_and_strided_slices_gather_as_numpy(cube, case):
    index = {**GENERAL_INDICES, **STRIDED_INDICES}[case]
    want = CUBE[index(ROWS, COLS, DEPTH)]
    jitted = tessera.jit(lambda x, r, c, d: (x[index(r, c, d)], x.at[index(r, c, d)].get()))(cube, ROWS, COLS, DEPTH)
    for got in (*jitted, cube[index(ROWS, COLS, DEPTH)], cube.at[index(ROWS, COLS, DEPTH)].get(),
                cube.at[index(ROWS, COLS, DEPTH)].get(mode="fill", fill_value=-1.0)):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)


def test_two_index_arrays_gather_on_a_table_split_on_both_dims(table, ids):
    cols = np.array([0, 7, -3, 2], dtype=np.int32)
    got = tessera.jit(lambda t, i, c: (t[i, c], t[i % 16, i % 8]))(table, ids, cols)
    np.testing.assert_array_equal(np.asarray(got[0]), TABLE[IDS, cols])
    np.testing.assert_array_equal(np.asarray(got[1]), TABLE[IDS % 16, IDS % 8])


def _numpy_update(op, x, index, values):
    out = x.copy()
    ufunc = {"set": None, "add": np.add, "multiply": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    if ufunc is None:
        out[index] = values
    else:
        ufunc.at(out, index, values)  # unbuffered: repeated indices accumulate, as a scatter's
    return out


AT_INDICES = {
    "ids_int": lambda r, c, d: (r, 0),  # (ids, 0)
    "int_ids": lambda r, c, d: (0, c),  # (0, ids)
    "ids_slice_int": lambda r, c, d: (r, slice(None), 0),  # (ids, :, 0)
    **GENERAL_INDICES,
    **STRIDED_INDICES,
}


@pytest.mark.parametrize("op", ["set", "add", "multiply", "min", "max"])
@pytest.mark.parametrize("case", sorted(AT_INDICES))
def test_at_updates_with_the_general_index_match_numpy(cube, case, op):
    index = AT_INDICES[case]
    # ROWS repeats rows (0 and -8, 7 and -1), which add, multiply, min and max combine; a set
    # of repeated indices keeps one of the values (unspecified which), so set takes unique rows.
    np_index = index(ROWS if op != "set" else np.array([[5], [2]], np.int32), COLS, DEPTH)
    shape = CUBE[np_index].shape
    values = np.arange(1, 1 + np.prod(shape), dtype=np.float32).reshape(shape) / 7
    want = _numpy_update(op, CUBE, np_index, values)
    jitted = tessera.jit(lambda x, v: getattr(x.at[np_index], op)(v))(cube, values)
    eager = getattr(cube.at[np_index], op)(values)
    for got in (jitted, eager):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_at_add_accumulates_duplicates_and_drops_out_of_range(table):
    # jax.Array.at: updates at out-of-range indices are dropped (mode None is FILL_OR_DROP for
    # scatters, jax/_src/ops/scatter.py _scatter_update); .get clamps (rewriting_take's
    # PROMISE_IN_BOUNDS gather); mode="fill" gives fill_value.
    rows = np.array([1, 1, 20, -1, 1], dtype=np.int32)
    cols = np.array([2, 2, 0, 7, 9], dtype=np.int32)
    got = tessera.jit(lambda t: (t.at[rows, cols].add(1.0), t.at[rows, cols].set(5.0), t.at[rows, cols].get(),
                                 t.at[rows, cols].get(mode="fill", fill_value=-1.0),
                                 t.at[rows, cols].subtract(2.0), t.at[rows, cols].add(1.0, mode="clip"),
                                 t.at[rows, cols].apply(lambda v: v * 3), t.at[rows, cols].divide(2.0)))(table)
    keep = (rows < 16) & (cols < 8)
    added = TABLE.copy()
    np.add.at(added, (rows[keep], cols[keep]), 1.0)  # (1, 2) twice: 2.0 more
    assert np.isclose(added[1, 2], TABLE[1, 2] + 2)
    np.testing.assert_allclose(np.asarray(got[0]), added, rtol=1e-6)
    want_set = TABLE.copy()
    want_set[rows[keep], cols[keep]] = 5.0
    np.testing.assert_array_equal(np.asarray(got[1]), want_set)
    clamped = TABLE[np.clip(np.where(rows < 0, rows + 16, rows), 0, 15), np.clip(cols, 0, 7)]
    np.testing.assert_array_equal(np.asarray(got[2]), clamped)
    np.testing.assert_array_equal(np.asarray(got[3]), np.where(keep, clamped, -1.0))
    subtracted = TABLE.copy()
    np.subtract.at(subtracted, (rows[keep], cols[keep]), 2.0)
    np.testing.assert_allclose(np.asarray(got[4]), subtracted, rtol=1e-6)
    clipped = TABLE.copy()  # mode="clip" clamps the (wrapped) indices into range instead
    np.add.at(clipped, (np.clip(np.where(rows < 0, rows + 16, rows), 0, 15), np.clip(cols, 0, 7)), 1.0)
    np.testing.assert_allclose(np.asarray(got[5]), clipped, rtol=1e-6)
    for g, ufunc, v in ((got[6], np.multiply, 3.0), (got[7], np.divide, 2.0)):  # once per index: (1, 2) twice
        want = TABLE.copy()
        ufunc.at(want, (rows[keep], cols[keep]), v)
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-6)


def test_general_index_on_explicit_axes():
    # Explicit axes: a split window dimension stays split (the updates are laid out as the
    # indexed slice of x, jax/_src/ops/scatter.py _scatter_impl's slice_sharding); a split
    # indexed dimension needs out_sharding=, as JAX's gather and scatter sharding rules ask.
    from tessera.sharding import AxisType
    mesh = tessera.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    rows, cols = np.array([1, 5, -1], np.int32), np.array([0, 3, 5], np.int32)
    x = tessera.device_put(CUBE, NamedSharding(mesh, P(None, None, "data")))
    got = tessera.jit(lambda x: (x[rows, cols], x.at[rows, cols].set(1.0), x.at[rows, 1:3].add(2.0),
                                 x.at[rows, None, cols].max(0.0)))(x)
    set_, add, max_ = CUBE.copy(), CUBE.copy(), CUBE.copy()
    set_[rows, cols] = 1.0
    add[rows, 1:3] += 2.0
    max_[rows, None, cols] = np.maximum(max_[rows, None, cols], 0.0)
    for g, w in zip(got, (CUBE[rows, cols], set_, add, max_)):
        np.testing.assert_array_equal(np.asarray(g), w)
    assert tuple(tessera.typeof(got[1]).sharding.spec) == (None, None, "data")
    split = tessera.device_put(CUBE, NamedSharding(mesh, P("data", "model")))
    with pytest.raises(ValueError, match="out_sharding"):
        tessera.jit(lambda x: x.at[rows, cols].set(1.0))(split)
    out = tessera.jit(lambda x: x.at[rows, cols].set(1.0, out_sharding=P("data", "model")))(split)
    np.testing.assert_array_equal(np.asarray(out), set_)


def test_split_index_arrays_on_explicit_axes():
    # An index array split over an Explicit axis lays the updates out with its own split on the
    # index dimensions: jax/_src/numpy/indexing.py _index_to_gather's slice_spec takes, for the
    # advanced indices' dimensions, aia_spec = typeof(advanced_index_arrs[0]).sharding.spec (the
    # first advanced index broadcast to their shape: an int first leaves them unsplit), and
    # _scatter_impl broadcasts y to slice_sharding. The scatter then refuses split queries
    # (lax/slicing.py _scatter_spec_computation, rule 4; the error names these updates), as the
    # gather does split indices (_gather_spec_computation: indices_non_batch_dims_replicated).
    # Both take out_sharding= (auto_axes), as pjit_test.py test_at_add_lower_to_scatter_add.
    from tessera.sharding import AxisType
    mesh = tessera.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    ids_np = np.array([3, 0, 15, 7], np.int32)
    x = tessera.device_put(TABLE, NamedSharding(mesh, P()))
    ids = tessera.device_put(ids_np, NamedSharding(mesh, P("data")))
    cols = np.array([[1], [6]], np.int32)  # broadcasts with ids to (2, 4)
    refused = [(lambda x, i: x.at[i].set(1.0), r"updates=f32\[4@data,8\]"),  # the SDK's at().set
               (lambda x, i: x.at[i].multiply(2.0), r"updates=f32\[4@data,8\]"),
               (lambda x, i: x.at[i, 1:3].add(1.0), r"updates=f32\[4@data,2\]"),
               (lambda x, i: x.at[i, cols].set(1.0), r"updates=f32\[2,4@data\]"),
               # The indices broadcast together as lax.broadcast_shardings (JAX's _broadcast_arrays
               # in _index_to_gather): i's split whichever comes first, an int or unsplit cols.
               (lambda x, i: x.at[cols, i % 8].max(0.0), r"updates=f32\[2,4@data\]"),
               (lambda x, i: x.at[2, i % 8].set(1.0), r"updates=f32\[4@data\]")]
    for f, updates in refused:
        with pytest.raises(ValueError, match=r"(?s)Use `\.at\[\.\.\.\]\.set/add/mul/\.\.\.\(out_sharding=\)`.*"
                                             + updates):
            tessera.jit(f)(x, ids)
    with pytest.raises(ValueError, match=r"updates=f32\[4@data,8\]"):  # eager: the same rule
        x.at[ids].set(1.0)
    # Index arrays split differently on the dimension they share: broadcasting_sharding_rule's
    # ShardingTypeError (lax.py), before the scatter.
    ids_model = tessera.device_put(np.array([1, 2, 0, 5], np.int32), NamedSharding(mesh, P("model")))
    with pytest.raises(ValueError, match=r"^broadcast_shardings got incompatible shardings for broadcasting: "
                                         r"\('data',\), \('model',\)\.$"):
        tessera.jit(lambda x, i, j: x.at[i, j].set(1.0))(x, ids, ids_model)
    # x split over 'data' on a window and ids on their dimension: the updates' slice_sharding
    # would use 'data' twice, NamedSharding's DuplicateSpecError (named_sharding.py
    # _check_unique_resources), before any scatter.
    cols_split = tessera.device_put(TABLE, NamedSharding(mesh, P(None, "data")))
    for f in (lambda x, i: x.at[i].set(1.0), lambda x, i: x.at[i].min(0.0), lambda x, i: x.at[i, 1:5].add(1.0)):
        with pytest.raises(ValueError, match=r"can map every mesh axis to at most one positional dimension, but "
                                             r"P\('data', 'data'\) has duplicate entries for `data`"):
            tessera.jit(f)(cols_split, ids)
    for f in (lambda x, i: x[i], lambda x, i: x[i, 1:3], lambda x, i: x.at[i].get()):
        with pytest.raises(ValueError, match=r"Use `\.at\[\.\.\.\]\.get\(out_sharding=\)`"):
            tessera.jit(f)(x, ids)
    got = tessera.jit(lambda x, i: (x.at[i].set(1.0, out_sharding=P("data", None)),
                                    x.at[i, 1:3].add(1.0, out_sharding=P()), x.at[i].get(out_sharding=P("data"))))(
        x, ids)
    set_, add = TABLE.copy(), TABLE.copy()
    set_[ids_np] = 1.0
    add[ids_np, 1:3] += 1.0
    for g, w, spec in zip(got, (set_, add, TABLE[ids_np]), (("data", None), (None, None), ("data", None))):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert tuple(tessera.typeof(g).sharding.spec) + (None,) * (2 - len(tessera.typeof(g).sharding.spec)) == spec


def test_general_index_edge_cases(table):
    # .at[] with ints only or partial slices (tests/lax_numpy_indexing_test.py STATIC_INDEXING_TESTS
    # through testStaticIndexing's updates), lists and a traced int beside an array
    # ("TupleOfListsOfPythonIntsAndIntArrays"), empty index arrays, wrap_negative_indices=False
    # (testWrapNegativeIndices1D: a negative index is out of range and dropped).
    empty = np.array([], np.int32)

    def np_set(index, v, op=None):
        out = TABLE.copy()
        out[index] = v if op is None else op(out[index], v)
        return out

    got = tessera.jit(lambda t, i: (t.at[0, 1].set(-1.0), t.at[1:3].set(-1.0), t.at[:2, 1:3].add(1.0),
                                    t.at[None, 4, 2:5].multiply(3.0), t.at[5, 6].get(), t[i, [0, 3]],
                                    t[empty, empty], t.at[empty, 2].add(1.0),
                                    t.at[np.array([-1, 1]), 0].set(9.0, wrap_negative_indices=False)))(
        table, np.int32(2))
    want = (np_set((0, 1), -1.0), np_set(slice(1, 3), -1.0), np_set((slice(0, 2), slice(1, 3)), 1.0, np.add),
            np_set((4, slice(2, 5)), 3.0, np.multiply), TABLE[5, 6], TABLE[2, [0, 3]], TABLE[empty, empty], TABLE,
            np_set((1, 0), 9.0))
    for g, w in zip(got, want):
        assert g.shape == np.shape(w)
        np.testing.assert_array_equal(np.asarray(g), w)
    np.testing.assert_array_equal(np.asarray(table[[0, 15], [-1, 2]]), TABLE[[0, 15], [-1, 2]])


def test_scalars_empty_lists_and_tuples_index_as_numpy(table):
    # A 0-d array's .at[()] / .at[...] / .at[None] (an empty index vector, as JAX's
    # _index_to_gather makes; numpy's a[()] = v), an empty list as an integer index array (JAX's
    # IndexType.from_index: `if not idx: return cls.ARRAY`) and tuples inside an index as arrays
    # (numpy), and an Ellipsis of no dimension between an int and an index array in the one-array
    # path (the array's dimension first, as numpy's).
    s = tessera.numpy.asarray(np.float32(3))
    got = tessera.jit(lambda s: (s.at[()].set(5.0), s.at[...].add(2.0), s.at[()].get(), s.at[None].get(),
                                 s.at[None].multiply(4.0)))(s)
    for g, w in zip(got, (np.float32(5), np.float32(5), np.float32(3), np.full((1,), 3, np.float32),
                          np.float32(12))):
        assert g.shape == np.shape(w)
        np.testing.assert_array_equal(np.asarray(g), w)
    assert table[[], []].shape == (0,) and table.at[[], 1:3].get().shape == (0, 2)
    np.testing.assert_array_equal(np.asarray(table[(0, 2), (1, 3)]), TABLE[(0, 2), (1, 3)])
    cube = tessera.numpy.asarray(CUBE)
    for index in ((slice(None), 0, Ellipsis, COLS), (slice(None), ROWS[0], Ellipsis, 0)):
        np.testing.assert_array_equal(np.asarray(cube[index]), CUBE[index])


def test_grad_and_vmap_through_the_general_index():
    # The general index's gather and scatters are lax's, whose VJPs and batching rules run:
    # the gradient of x[r, :, c] is the scatter-add of its cotangent (numpy's add.at), of
    # x.at[r, :, c].add(v) the identity for x and the indexed cotangent for v; vmap over the
    # operand, the indices or the updates gives each example's numpy result (JAX's
    # lax_numpy_indexing_test.py testAdvancedIntegerIndexingGrads and testGradOfVmapOfScatter
    # check the same, against its own reference).
    x_host = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    r, c = np.array([0, 2, 2], np.int32), np.array([1, 3, 1], np.int32)  # row 2 twice
    x = tessera.numpy.asarray(x_host)
    w = np.arange(1, 10, dtype=np.float32).reshape(3, 3)
    g = tessera.grad(lambda x: jnp.sum(x[r, :, c][:, :3] * w))(x)
    want = np.zeros_like(x_host)
    np.add.at(want, (r, slice(0, 3), c), w)
    np.testing.assert_array_equal(np.asarray(g), want)
    v = np.ones((3, 4), np.float32)
    gx, gv = tessera.grad(lambda x, v: jnp.sum(x.at[r, :, c].add(v * 2.0) ** 2), argnums=(0, 1))(x, v)
    out = x_host.copy()
    np.add.at(out, (r, slice(None), c), v * 2)
    np.testing.assert_allclose(np.asarray(gx), 2 * out)
    np.testing.assert_allclose(np.asarray(gv), 4 * out[r, :, c])
    xs_host = np.stack([x_host, x_host + 1])
    xs = tessera.numpy.asarray(xs_host)
    np.testing.assert_array_equal(np.asarray(tessera.vmap(lambda x: x[r, :, c])(xs)),
                                  np.stack([xs_host[b][r, :, c] for b in range(2)]))
    ids = np.array([[0, 1, 2], [2, 1, 0]], np.int32)
    np.testing.assert_array_equal(np.asarray(tessera.vmap(lambda x, i: x[i, 1, c])(xs, ids)),
                                  np.stack([xs_host[b][ids[b], 1, c] for b in range(2)]))
    added = xs_host.copy()
    for b in range(2):
        np.add.at(added[b], (r, 0, c), 1.0)
    np.testing.assert_array_equal(
        np.asarray(tessera.vmap(lambda x, u: x.at[r, 0, c].add(u))(xs, np.ones((2, 3), np.float32))), added)


def test_strided_slices_with_modes_ints_and_grad(table):
    # An int in the index is the eager path's dynamic slice beside unit-step slices only; beside
    # another step the index is to_static_slice's: table[::5, 2] one strided slice, table[3, ::-3]
    # a strided slice then lax.rev. mode="clip" and wrap_negative_indices apply to the index
    # arrays, the slice's positions being in range (testStaticIndexingGrads: the gradient of a strided get
    # is the scatter-add of its cotangent at the slice's positions).
    np.testing.assert_array_equal(np.asarray(table[3, ::-3]), TABLE[3, ::-3])
    np.testing.assert_array_equal(np.asarray(table[::5, 2]), TABLE[::5, 2])
    i = np.array([20, -1], np.int32)
    got = tessera.jit(lambda t: (t.at[i, ::3].add(1.0, mode="clip"), t.at[i, ::-2].get(mode="fill", fill_value=0.5),
                                 t.at[i, 1::4].set(2.0, wrap_negative_indices=False)))(table)
    clipped = TABLE.copy()
    np.add.at(clipped, (np.array([15, 15])[:, None], np.arange(0, 8, 3)), 1.0)
    np.testing.assert_allclose(np.asarray(got[0]), clipped, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), np.stack([np.full(4, 0.5, np.float32), TABLE[15, ::-2]]))
    np.testing.assert_array_equal(np.asarray(got[2]), TABLE)  # 20 and -1 are out of range: dropped
    w = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    g = tessera.jit(tessera.grad(lambda t: jnp.sum(t[10:1:-3, ::2] * w)))(table)
    want = np.zeros_like(TABLE)
    want[10:1:-3, ::2] = w
    np.testing.assert_array_equal(np.asarray(g), want)


STRIDED_MESHES = [((8,), ("a",)), ((4, 2), ("a", "b")), ((2, 4), ("a", "b"))]


def _split_table(shape, names, axis_type):
    """(spec, TABLE put on a mesh of `shape` with AxisType `axis_type`, split over 'a' on rows
    and over 'b' (when the mesh has it) on columns)."""
    from tessera.sharding import AxisType
    mesh = tessera.make_mesh(shape, names, axis_types=(getattr(AxisType, axis_type),) * len(shape))
    spec = P("a", None) if len(shape) == 1 else P("a", "b")
    return spec, tessera.device_put(TABLE, NamedSharding(mesh, spec))


def _padded(spec):
    return tuple(spec) + (None,) * (2 - len(spec))


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("shape,names", STRIDED_MESHES, ids=["8", "4x2", "2x4"])
def test_positive_strides_are_a_strided_slice_keeping_the_split(shape, names, axis_type):
    # Under jit JAX's rewriting_take takes x[::2] and x[1::2, 1::2] as one lax.slice with strides
    # (jax/_src/numpy/indexing.py NDIndexer.to_static_slice, _static_slice), and
    # _slice_sharding_rule (lax/slicing.py) keeps x's split where the result's dimension divides
    # by its mesh axes. Each device's block here is whole runs of the stride, so the program
    # moves nothing: no collective, where the gather of start + step * iota gathered the
    # dimension. Negative steps: test_negative_steps_are_a_slice_then_rev_keeping_the_split.
    spec, x = _split_table(shape, names, axis_type)
    f = tessera.jit(lambda x: (x[::2], x[1::2, 1::2], x[1:16:2, ..., ::2]))
    got = f(x)
    for g, w in zip(got, (TABLE[::2], TABLE[1::2, 1::2], TABLE[1:16:2, ..., ::2])):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert _padded(g.sharding.spec) == _padded(spec), (g.sharding, f.as_text())
    for collective in ("all_gather", "all_to_all", "collective_permute", "all_reduce"):
        assert collective not in f.as_text(), f.as_text()
    negative = tessera.jit(lambda x: x[::-2, 3:0:-1])
    if axis_type == "Auto" or len(shape) == 1:
        np.testing.assert_array_equal(np.asarray(negative(x)), TABLE[::-2, 3:0:-1])
    else:
        # 3 of 8 columns split over 'b': lax.rev keeps the split and the slice's out dimension
        # does not divide, JAX's slicing error on Explicit axes (_get_sharding_for_varying_out_shape).
        with pytest.raises(tessera.errors.InvalidArgumentError, match="not divisible by mesh axes"):
            negative(x)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
@pytest.mark.parametrize("shape,names", STRIDED_MESHES, ids=["8", "4x2", "2x4"])
def test_negative_steps_are_a_slice_then_rev_keeping_the_split(shape, names, axis_type):
    # Under jit JAX's rewriting_take takes a negative step as NDIndexer.to_static_slice says
    # (jax/_src/numpy/indexing.py): the slice of the same elements from the lowest, stride
    # |step|, then lax.rev of those dimensions (_static_slice). lax.rev keeps its operand's
    # sharding (lax.py _rev_sharding_rule), and x[::-2] of a split 16 is the aligned x[1::2]:
    # the result is split as x, values as numpy's, and the program permutes the blocks with no
    # gather (JAX's XLA reverse of a sharded dimension moves them alike).
    spec, x = _split_table(shape, names, axis_type)
    f = tessera.jit(lambda x: (x[::-1], x[::-2], x[::-1, ::-1], lax.rev(x, (1,))))
    got = f(x)
    for g, w in zip(got, (TABLE[::-1], TABLE[::-2], TABLE[::-1, ::-1], TABLE[:, ::-1])):
        np.testing.assert_array_equal(np.asarray(g), w)
    for g in got:
        assert _padded(g.sharding.spec) == _padded(spec), (g.sharding, f.as_text())
    only_split = tessera.jit(lambda x: (x[::-1], x[::-2]))
    only_split(x)
    assert "collective_permute" in only_split.as_text(), only_split.as_text()
    for collective in ("all_gather", "all_to_all", "all_reduce"):
        assert collective not in only_split.as_text(), only_split.as_text()
    # x[11:1:-2] is x[3:12:2] reversed: 5 rows, which no split divides (JAX's slicing error on
    # Explicit axes); on Auto axes the compiler gathers the dimension.
    if axis_type == "Auto":
        np.testing.assert_array_equal(np.asarray(tessera.jit(lambda x: x[11:1:-2])(x)), TABLE[11:1:-2])


def test_strided_slice_errors_and_grad_as_jax():
    # x[1:7:3] keeps 2 rows (1 and 4): over 4 devices on an Explicit axis that is
    # _slice_sharding_rule's error (lax/slicing.py _get_sharding_for_varying_out_shape); on Auto
    # axes the compiler gathers the dimension. The gradient of a strided slice pads its
    # cotangent with stride - 1 zeros (_slice_transpose_fancy), the split kept.
    from tessera.sharding import AxisType
    explicit = tessera.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    x = tessera.device_put(TABLE[:8], NamedSharding(explicit, P("a", None)))
    with pytest.raises(ValueError, match=r"slicing on sharded dims where out dim \(2\) is not divisible by mesh axes "
                                         r"\(4\) with spec \('a',\) is not implemented"):
        tessera.jit(lambda x: x[1:7:3])(x)
    auto = tessera.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    np.testing.assert_array_equal(
        np.asarray(tessera.jit(lambda x: x[1:7:3])(tessera.device_put(TABLE[:8], NamedSharding(auto, P("a", None))))),
        TABLE[1:7:3])
    w = np.arange(1, 33, dtype=np.float32).reshape(8, 4)
    split = tessera.device_put(TABLE, NamedSharding(explicit, P("a", "b")))
    g = tessera.jit(tessera.grad(lambda t: jnp.sum(t[1::2, ::2] * w)))(split)
    want = np.zeros_like(TABLE)
    want[1::2, ::2] = w
    np.testing.assert_array_equal(np.asarray(g), want)
    assert tuple(tessera.typeof(g).sharding.spec) == ("a", "b")
    np.testing.assert_array_equal(np.asarray(tessera.numpy.asarray(TABLE)[1:7:3, ::3]), TABLE[1:7:3, ::3])
    with pytest.raises(ValueError, match="slice step cannot be zero"):
        tessera.numpy.asarray(TABLE)[::0]
    # lax.slice's docstring (jax/_src/lax/slicing.py): lax.slice(x, (0, 0), (3, 4), (1, 2)) of
    # arange(12).reshape(3, 4) is [[0, 2], [4, 6], [8, 10]].
    twelve = tessera.numpy.asarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    np.testing.assert_array_equal(np.asarray(lax.slice(twelve, (0, 0), (3, 4), (1, 2))), [[0, 2], [4, 6], [8, 10]])


def test_at_updates_take_the_split_of_a_strided_slice_dimension():
    # .at[] with a non-unit-step slice beside an index array: JAX's _index_to_gather gives the
    # slice's dimension of the updates x's split there (slice_spec.append(x_spec[x_axis]) for
    # every slice) and _scatter_impl lays the updates out so: x split over 'b' on the strided
    # dimension makes updates f32[2,4@b], which the scatter refuses (the strided dimension is an
    # index of the scatter, split updates there are _scatter_spec_computation's error) and which
    # out_sharding= resolves.
    from tessera.sharding import AxisType
    mesh = tessera.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
    rows = np.array([1, 5], np.int32)
    x = tessera.device_put(TABLE, NamedSharding(mesh, P(None, "b")))
    with pytest.raises(ValueError, match=r"updates=f32\[2,4@b\]"):
        tessera.jit(lambda x: x.at[rows, ::2].set(1.0))(x)
    out = tessera.jit(lambda x: x.at[rows, ::2].add(1.0, out_sharding=P(None, "b")))(x)
    want = TABLE.copy()
    want[rows[:, None], np.arange(0, 8, 2)] += 1.0
    np.testing.assert_array_equal(np.asarray(out), want)


# Boolean indices (jax/_src/numpy/indexing.py NDIndexer.expand_bool_indices and
# expand_scalar_bool_indices): a concrete mask is the integer arrays of its nonzero entries, a
# boolean scalar an index of shape (1,) or (0,) over a new dimension; cases from
# tests/lax_numpy_indexing_test.py testBooleanIndexingArray1D, testBooleanIndexingArray2D,
# testBooleanIndexingArray2DBroadcast, testBoolean1DIndexingWithEllipsis (2, 3),
# testBoolean2DIndexingWithEllipsis, testBoolean1DIndexingWithTrailingEllipsis,
# testBooleanIndexingWithNone(AndEllipsis), testNontrivialBooleanIndexing,
# testEmptyBooleanIndexing, testScalarBooleanIndexing and testScalarBoolUpdate, numpy the
# reference.
ROW_MASK = np.array([True, False, False, True, True, False, False, True])
MASK_2D = np.arange(48).reshape(8, 6) % 5 == 1
BOOL_INDICES = {
    "rows": lambda: ROW_MASK,
    "rows_2d": lambda: MASK_2D,
    "ellipsis_depth": lambda: (Ellipsis, np.array([True, False, True, True])),
    "int_ellipsis_depth": lambda: (0, Ellipsis, np.array([False, False, True, False])),
    "ellipsis_2d": lambda: (Ellipsis, MASK_2D[:6, :4]),
    "rows_trailing_ellipsis": lambda: (ROW_MASK, Ellipsis),
    "none_rows": lambda: (None, ROW_MASK),
    "none_ellipsis_depth": lambda: (None, Ellipsis, np.array([True, False, False, True])),
    "ellipsis_none_depth": lambda: (Ellipsis, None, np.array([True, False, False, True])),
    # Two entries of each: the nonzero arrays broadcast together.
    "2d_and_1d": lambda: (np.eye(8, 6, dtype=bool) & (np.arange(8)[:, None] < 2), np.array([False, True, True, False])),
    "empty_rows": lambda: np.zeros(8, bool),
    "zero_length": lambda: np.zeros((0,), bool),
    "mask_and_stride": lambda: (ROW_MASK, slice(None, None, -2)),
    "list_in_tuple": lambda: (slice(None), [True, False, True, False, False, True]),
}
SCALAR_BOOL_INDICES = [np.index_exp[True], np.index_exp[False], np.index_exp[..., True], np.index_exp[..., False],
                       np.index_exp[0, :2, True], np.index_exp[0, :2, False], np.index_exp[:2, 0, True],
                       np.index_exp[:2, 0, False], np.index_exp[:2, np.array([0, 2]), True],
                       np.index_exp[np.array([1, 0]), :, True], np.index_exp[True, :, True, :, np.array(True)]]


@pytest.mark.parametrize("case", sorted(BOOL_INDICES))
def test_boolean_masks_index_as_numpy(cube, case):
    index = BOOL_INDICES[case]()
    want = CUBE[index]
    got = [cube[index], cube.at[index].get(), tessera.jit(lambda x: (x[index], x.at[index].get()))(cube)]
    for g in (got[0], got[1], *got[2]):
        assert g.shape == want.shape
        np.testing.assert_array_equal(np.asarray(g), want)
    values = np.arange(1, 1 + want.size, dtype=np.float32).reshape(want.shape)
    updated = CUBE.copy()
    updated[index] = values
    np.testing.assert_array_equal(np.asarray(cube.at[index].set(values)), updated)
    added = CUBE.copy()
    added[index] += 1.0
    np.testing.assert_allclose(np.asarray(tessera.jit(lambda x: x.at[index].add(1.0))(cube)), added, rtol=1e-6)
    # A mask that is an Array outside jit, or closed over by a jitted function, is concrete too
    # (expand_bool_indices reads it to the host): each boolean ndarray of the index an Array,
    # whole or inside the tuple, indexing, through .at and under jit.
    def as_array(i):
        return tessera.device_put(i) if isinstance(i, np.ndarray) and i.dtype == bool else i

    mask = tuple(as_array(i) for i in index) if isinstance(index, tuple) else as_array(index)
    got = [cube[mask], cube.at[mask].get(), *tessera.jit(lambda x: (x[mask], x.at[mask].get()))(cube)]
    for g in got:
        assert g.shape == want.shape
        np.testing.assert_array_equal(np.asarray(g), want)
    np.testing.assert_array_equal(np.asarray(cube.at[mask].set(values)), updated)
    np.testing.assert_array_equal(np.asarray(tessera.jit(lambda x, v: x.at[mask].set(v))(cube, values)), updated)
    np.testing.assert_allclose(np.asarray(tessera.jit(lambda x: x.at[mask].add(1.0))(cube)), added, rtol=1e-6)


@pytest.mark.parametrize("index", SCALAR_BOOL_INDICES, ids=range(len(SCALAR_BOOL_INDICES)))
def test_scalar_booleans_index_and_update_as_numpy(index):
    x = np.arange(120, dtype=np.int32).reshape(2, 3, 4, 5)
    xa = jnp.asarray(x)
    want = x[index]
    for got in (xa[index], tessera.jit(lambda x: x[index])(xa), xa.at[index].get()):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), want)
    for update_ndim in (0, 1, 2):
        update = -np.arange(1, 1 + np.prod(want.shape[len(want.shape) - update_ndim:]), dtype=np.int32).reshape(
            want.shape[len(want.shape) - update_ndim:])
        expected = x.copy()
        expected[index] = update
        np.testing.assert_array_equal(np.asarray(tessera.jit(lambda x, u: x.at[index].set(u))(xa, update)), expected)


def test_eager_boolean_scalars_are_neither_ints_nor_traced():
    # Outside a trace an index runs as a small cached program: True next to an index array is
    # not the 1 of an earlier call (True == 1 as a cache key), and np.True_ is static as JAX
    # takes it (a concrete boolean), not a traced value.
    x = np.arange(120, dtype=np.int32).reshape(2, 3, 4, 5)
    xa, rows = jnp.asarray(x), np.array([1, 0])
    for index in ((rows, 1), (rows, True), (rows[:1], 0), (rows[:1], False), (np.True_, 0), (0, np.False_),
                  (rows, np.array(True))):
        for got, want in ((xa[index], x[index]), (xa.at[index].get(), x[index]),
                          (xa.at[index].add(1), _numpy_update("add", x, index, 1))):
            assert got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), want)


def test_boolean_index_errors_are_jax_errors(table):
    # testBooleanIndexingDynamicShapeError: a traced mask is an IndexError (jax/_src/errors.py
    # NonConcreteBooleanIndexError, a JAXIndexError), in its words; testBooleanIndexingShapeMismatch:
    # a mask of the wrong shape names the position, its shape and the dimensions'.
    from tessera.errors import NonConcreteBooleanIndexError
    with pytest.raises(IndexError, match=r"^Array boolean indices must be concrete; got bool\[16\]\n\n"
                                         r"See https://docs.jax.dev/en/latest/errors.html"
                                         r"#jax.errors.NonConcreteBooleanIndexError$"):
        tessera.jit(lambda t, m: t[m])(table, np.ones(16, bool))
    with pytest.raises(NonConcreteBooleanIndexError):
        tessera.jit(lambda t: t.at[t > 0].set(0.0))(table)
    with pytest.raises(NonConcreteBooleanIndexError, match="got bool\\[\\]"):
        tessera.jit(lambda t, b: t[b])(table, np.bool_(True))
    with pytest.raises(IndexError, match=r"^boolean index did not match shape of indexed array in index 1: "
                                         r"got \(3,\), expected \[16\]$"):
        table[None, np.array([True, False, True])]
    with pytest.raises(IndexError, match="index 0: got \\(16, 4\\), expected \\[16, 8\\]"):
        table.at[np.ones((16, 4), bool)].set(1.0)
    # A mask beside an index array broadcasts with it (numpy's nonzero arrays).
    got = table.at[np.array([1]), np.ones(8, bool)].add(1.0)
    want = TABLE.copy()
    want[1] += 1
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_get_ignores_out_sharding_where_jax_slices():
    # jax/_src/numpy/indexing.py rewriting_take: an index to_static_slice takes (ints in range,
    # slices, None, ...; mode None, clip or promise_in_bounds) is a lax.slice, one
    # to_dynamic_slice takes (0-d integer arrays too) a lax.dynamic_slice, and neither reads
    # .get's out_sharding (only the gather does: auto_axes). Inside a trace (is_sharded is False
    # for a traced value) x.at[idx].get(out_sharding=s) is then x[idx], laid out by the slice's
    # sharding rule (the split kept; an out dimension the split does not divide is the slice's
    # error); outside one, an Array on several devices with an int or a partial slice takes the
    # gather, and out_sharding lays its result out. mode="fill" always gathers.
    from tessera.sharding import AxisType
    mesh = tessera.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    cols = tessera.device_put(TABLE, NamedSharding(mesh, P(None, "model")))
    got = tessera.jit(lambda t, i: (t.at[0].get(out_sharding=P(None)), t.at[1:3].get(out_sharding=P(None, None)),
                                    t.at[::-3, 2:].get(out_sharding=P(None, None)),
                                    t.at[i].get(out_sharding=P(None)),
                                    t.at[0].get(mode="fill", fill_value=0.0, out_sharding=P(None))))(
        cols, np.int32(3))
    want = [(TABLE[0], ("model",)), (TABLE[1:3], (None, "model")), (TABLE[::-3, 2:], (None, "model")),
            (TABLE[3], ("model",)), (TABLE[0], (None,))]
    for g, (w, spec) in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
        assert tuple(tessera.typeof(g).sharding.spec) == spec
    rows = tessera.device_put(TABLE, NamedSharding(mesh, P("data", "model")))
    for f in (lambda t: t[0], lambda t: t.at[0].get(out_sharding=P(None))):  # one row of a split dimension
        with pytest.raises(ValueError, match=r"slicing on sharded dims where out dim \(1\) is not divisible"):
            tessera.jit(f)(rows)
    # has_partial_slices asks |stop - start| != size of slice.indices(size): x[n:0] over n is
    # empty but not partial, so a static slice, out_sharding ignored.
    n = TABLE.shape[0]
    eager = (cols.at[0].get(out_sharding=NamedSharding(mesh, P(None))),
             cols.at[:].get(out_sharding=NamedSharding(mesh, P(None, None))),
             cols.at[n:0].get(out_sharding=NamedSharding(mesh, P(None, None))))
    for g, w, spec in zip(eager, (TABLE[0], TABLE, TABLE[n:0]), ((None,), (None, "model"), (None, "model"))):
        assert g.shape == w.shape
        np.testing.assert_array_equal(np.asarray(g), w)
        assert tuple(g.sharding.spec) == spec
    with pytest.raises(TypeError, match="`out_sharding` argument of .get only supports"):
        tessera.jit(lambda t: t.at[0].get(out_sharding="model"))(cols)

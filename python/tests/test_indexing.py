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
    np.testing.assert_array_equal(np.asarray(table[np.array([4, 2])]), TABLE[[4, 2]])
    np.testing.assert_array_equal(np.asarray(table[[4, 2], 1:3]), TABLE[[4, 2], 1:3])
    np.testing.assert_array_equal(np.asarray(table.at[[0, 1]].set(7.0)), np.where(np.arange(16)[:, None] < 2, 7.0,
                                                                                    TABLE))


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
    with pytest.raises(NotImplementedError, match="two index arrays"):
        tessera.jit(lambda t, i: t[i, i])(table, np.array([1], np.int32))
    with pytest.raises(NotImplementedError, match="boolean mask"):
        tessera.jit(lambda t, m: t[m])(table, np.ones(16, bool))
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
        table[[1.0]]
    with pytest.raises(TypeError, match=message.format("float64")):
        table.at[0, 0.0].add(1.0)
    with pytest.raises(TypeError, match=message.format("float32")):
        table[np.float32(1.0)]
    with pytest.raises(TypeError, match=message.format("key<fry>")):
        table[tessera.random.key(0)]

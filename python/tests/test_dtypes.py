# float16, int8, uint8 and int16 from Python (issue #15 item 6): numpy's own dtypes go to the
# devices and back as they are; promotion is jnp.promote_types (JAX's docs/type_promotion.rst
# table: f2 + i4 = f2, i1 + u1 = i2, u1 + i4 = i4), not numpy's; float16 ops round after each
# op, as numpy's float16 arithmetic does. bfloat16 has no numpy dtype without ml_dtypes.
import numpy as np
import pytest

import tessera
import tessera.numpy as jnp
from tessera.sharding import NamedSharding, PartitionSpec as P


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.uint8, np.int16])
def test_put_and_fetch_keep_the_dtype_and_bits(mesh, dtype):
    x = (np.arange(128).reshape(16, 8) * 37 - 2000).astype(dtype)
    a = tessera.device_put(x, NamedSharding(mesh, P("data", "model")))
    assert a.dtype == np.dtype(dtype)
    back = np.asarray(a)
    assert back.dtype == np.dtype(dtype)
    assert back.tobytes() == x.tobytes()


def test_float16_ops_round_like_numpy(mesh):
    rng = np.random.default_rng(1)
    x = rng.uniform(-3, 3, (16, 8)).astype(np.float16)
    y = rng.uniform(-3, 3, (16, 8)).astype(np.float16)
    f = tessera.jit(lambda a, b: (jnp.tanh(a) * b + 1.0, a < b, a.astype(jnp.float32)))
    out, less, wide = f(tessera.device_put(x, NamedSharding(mesh, P("data", None))),
                        tessera.device_put(y, NamedSharding(mesh, P(None, "model"))))
    # numpy computes float16 ops in float32 and rounds each result (tanh included), as Tessera.
    want = (np.tanh(x.astype(np.float32)).astype(np.float16) * y + np.float16(1.0))
    assert np.asarray(out).dtype == np.float16
    assert np.asarray(out).tobytes() == want.tobytes()
    assert (np.asarray(less) == (x < y)).all()
    assert np.asarray(wide).dtype == np.float32 and (np.asarray(wide) == x.astype(np.float32)).all()


def test_small_integers_wrap_and_promote_as_jax(mesh8):
    i8 = np.array([100, -128, 127, -1], np.int8)
    u8 = np.array([200, 255, 1, 0], np.uint8)
    h = np.array([0.5, 1.0, 2.0, 3.0], np.float16)
    i32 = np.array([1, 2, 3, 4], np.int32)
    put = lambda v: tessera.device_put(v, NamedSharding(mesh8, P()))
    f = tessera.jit(lambda a, b, c, d: (a + b, a * 3, b + 1, c + d, b + d, a.astype(jnp.uint8)))
    s, tripled, inc, hf, ui, cast = f(put(i8), put(u8), put(h), put(i32))
    assert np.asarray(s).dtype == np.int16 and list(np.asarray(s)) == [300, 127, 128, -1]
    assert np.asarray(tripled).dtype == np.int8 and list(np.asarray(tripled)) == [44, -128, 125, -3]
    assert np.asarray(inc).dtype == np.uint8 and list(np.asarray(inc)) == [201, 0, 2, 1]
    assert np.asarray(hf).dtype == np.float16 and list(np.asarray(hf)) == [1.5, 3.0, 5.0, 7.0]
    assert np.asarray(ui).dtype == np.int32
    assert list(np.asarray(cast)) == [100, 128, 127, 255]
    assert jnp.promote_types(jnp.float16, jnp.int32) == np.float16
    assert jnp.promote_types(jnp.int8, jnp.uint8) == np.int16


def test_bfloat16_is_refused_with_the_reason():
    with pytest.raises(Exception, match="bfloat16 has no numpy dtype"):
        tessera._tessera.numpy_dtype(tessera._tessera.DType.bfloat16)

"""jrl.kernels.fp8: power-of-two row scales, one rounding, exact read-back, a straight-through
gradient. Values are chosen so every rounding is away from a tie."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import fp8
from jrl.kernels.contract import NumericalContract


def test_row_exponents_by_hand():
    # max|x| = m * 2^E; e = E - 8 if m <= 1.75 else E - 7 (then max|x| * 2^-e <= 448):
    #   448 = 1.75 * 2^8   -> e = 0, and 448 * 2^0 = 448 fits exactly;
    #   449 = 1.754 * 2^8  -> e = 1 (449 / 2 = 224.5);
    #   1.0 = 1 * 2^0      -> e = -8 (1 * 2^8 = 256);
    #   3e-3 = 1.536 * 2^-9 -> e = -17 (3e-3 * 2^17 = 393.2);
    #   an all-zero row    -> the smallest kept exponent, -117.
    x = jnp.asarray([[448.0, 1.0, -2.0], [449.0, 0.5, 0.0], [-1.0, 0.25, 0.0],
                     [1e-3, -3e-3, 2e-3], [0.0, 0.0, 0.0]], jnp.float32)
    np.testing.assert_array_equal(fp8.row_exponents(x), [0, 1, -8, -17, -117])
    assert fp8.row_exponents(x).dtype == jnp.int8


def test_quantize_rounds_once_and_reads_back_exactly():
    # Row [449, 0.5, 0]: e = 1, scaled [224.5, 0.25, 0]. e4m3fn has 3 mantissa bits: in
    # [128, 256) its spacing is 16, so 224.5 -> 224; 0.25 is exact. Read back: [448, 0.5, 0].
    # Row [1e-3, -3e-3, 2e-3]: e = -17, scaled [131.07, -393.22, 262.14]: spacings 16 in
    # [128, 256) and 32 in [256, 448], so [128, -384, 256]; read back 2^-17 times that.
    x = jnp.asarray([[449.0, 0.5, 0.0], [1e-3, -3e-3, 2e-3]], jnp.float32)
    q, e = fp8.quantize(x)
    assert q.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(q.astype(jnp.float32), [[224.0, 0.25, 0.0],
                                                          [128.0, -384.0, 256.0]])
    back = fp8.dequantize(q, e, jnp.float32)
    np.testing.assert_array_equal(back, [[448.0, 0.5, 0.0],
                                         [128 * 2.0**-17, -384 * 2.0**-17, 256 * 2.0**-17]])
    # The same numbers in bfloat16 (q has 4 significant bits: exact there too).
    np.testing.assert_array_equal(fp8.dequantize(q, e, jnp.bfloat16).astype(jnp.float32), back)


def test_quantize_matches_an_independent_float8_cast_and_never_saturates():
    """ml_dtypes' float8_e4m3fn cast of x * 2^-e (numpy, not XLA) gives the same bytes; no
    entry reaches NaN (e4m3fn has no infinity: an overflow would be NaN)."""
    x = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    x *= np.exp2(np.random.default_rng(1).integers(-20, 20, (64, 1))).astype(np.float32)
    q, e = fp8.quantize(jnp.asarray(x))
    scaled = x * np.exp2(-np.asarray(e, np.float32))[:, None]
    assert np.all(np.abs(scaled) <= fp8.FP8_MAX)
    expected = scaled.astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expected.view(np.uint8))
    assert not np.any(np.isnan(np.asarray(q, np.float32)))
    # The largest entry of each row lands in e4m3fn's top binade, [256, 448]: no range wasted.
    top = np.max(np.abs(np.asarray(q, np.float32)), axis=1)
    assert np.all((top >= 224.0) & (top <= 448.0))


def test_fake_quantize_gradient_is_the_identity_by_hand():
    """Straight-through: d/dx sum(w * fake_quantize(x)) = w, though fake_quantize moved x
    (449 -> 448)."""
    x = jnp.asarray([[449.0, 0.5, 0.0]], jnp.float32)
    w = jnp.asarray([[2.0, -3.0, 5.0]], jnp.float32)
    value, grad = jax.value_and_grad(lambda x: jnp.sum(w * fp8.fake_quantize(x)))(x)
    assert float(value) == 2.0 * 448.0 - 3.0 * 0.5          # 894.5: the quantised values
    np.testing.assert_array_equal(grad, w)


def test_attention_gradient_through_fp8_keys_is_the_gradient_at_the_quantised_keys():
    """A toy attention, one query over three keys: with the straight-through estimator, the
    gradient w.r.t. k and v is the plain attention's gradient evaluated at the quantised k and
    v (the point the forward used)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((1, 3, 1, 8), (1, 3, 1, 8), (1, 3, 1, 8)))
    positions = jnp.arange(3, dtype=jnp.int32)[None]
    valid = jnp.ones((1, 3), bool)
    contract = NumericalContract(backend="xla")

    def loss(k, v):
        out = kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                                kv_valid=valid, contract=contract)
        return jnp.sum(out * jnp.arange(8.0))

    through = jax.grad(lambda k, v: loss(fp8.fake_quantize(k), fp8.fake_quantize(v)),
                       argnums=(0, 1))(k, v)
    at_quantised = jax.grad(loss, argnums=(0, 1))(fp8.fake_quantize(k), fp8.fake_quantize(v))
    assert not np.array_equal(fp8.fake_quantize(k), k)
    for got, want in zip(through, at_quantised):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_read_back_is_exact_in_the_compute_dtype(dtype):
    """Every e4m3fn value times a kept 2^e is representable in float32 and bfloat16 (4
    significant bits; the smallest nonzero, 2^-9 * 2^-117 = 2^-126, is normal): dequantize(q, e)
    == float(q) * 2^e exactly, for all 254 non-NaN bit patterns."""
    q = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    q = q[~np.isnan(q.astype(np.float32))]
    for e in (fp8.MIN_EXPONENT, -20, 0, 7, 100):
        got = fp8.dequantize(jnp.asarray(q), jnp.asarray(e, jnp.int8), dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float64), q.astype(np.float64) * 2.0**e)

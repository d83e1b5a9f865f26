"""FP8 (float8_e4m3fn) storage with one power-of-two scale per row, rounded once.

A row x [..., n] (one token's keys of one KV head) is stored as q = fp8(x * 2^-e) and an int8
exponent e: the smallest e with max|x| * 2^-e <= 448, e4m3fn's largest finite value, so no
entry saturates. Read back, x' = q * 2^e.

Why power-of-two scales: multiplying by 2^-e and 2^e is exact in float32 (and the result is
exact in bfloat16, q having 4 significant bits), so the only rounding is the float32 -> fp8
conversion itself (round to nearest even). A scale amax / 448 would add a division whose
rounding a compiler may rewrite (x / s -> x * (1 / s)) differently in two programs; here
nothing can drift between the sampler, which stores q and e in its KV cache, and the train
forward, which applies `fake_quantize` to the same keys and values. This is the form of
DeepSeek-V3's UE8M0 scales, at the granularity of one row.

Memory per row of n entries: n + 1 bytes, against 2n in bfloat16 and 4n in float32 (a head
of 64: 65 / 128 = 51% of bfloat16).

W8A8 (NumericalContract.matmul_dtype) uses the same rounding for a matmul's operands: the
activations x [..., K] by row (`fake_quantize`: one exponent per token) and the weights
w [..., K, N] by output column (`quantize_columns` / `fake_quantize_columns`: one exponent per
column, over its K entries), so every output y[m, n] is a dot of two exponent-scaled e4m3fn
vectors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0          # e4m3fn's largest finite value, 1.75 * 2^8
# Exponents kept where 2^e and 2^-e are normal float32 numbers, and every nonzero read-back
# q * 2^e >= 2^-9 * 2^-117 = 2^-126 is normal (no flush-to-zero platform can differ).
MIN_EXPONENT, MAX_EXPONENT = -117, 126
_MANTISSA_BITS = 23
_MANTISSA_OF_1_75 = 0x600000       # 1.75 = 1 + 0x600000 / 2^23


def power_of_two(exponent: jax.Array) -> jax.Array:
    """2^exponent as float32, built from its bits (exact; exponent int in [-126, 127])."""
    biased = (exponent.astype(jnp.int32) + 127) << _MANTISSA_BITS
    return jax.lax.bitcast_convert_type(biased, jnp.float32)


def row_exponents(x: jax.Array) -> jax.Array:
    """e [...] int8 of rows x [..., n]: the smallest e with max|x| * 2^-e <= FP8_MAX, clamped
    to [MIN_EXPONENT, MAX_EXPONENT] (an all-zero row gets MIN_EXPONENT).

    With max|x| = m * 2^E, 1 <= m < 2 (read from its float32 bits: max and abs are exact),
    e = E - 8 when m <= 1.75, else E - 7 (m * 2^E <= 1.75 * 2^(E - e) holds for those and fails
    for one less)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32)
    biased = (bits >> _MANTISSA_BITS) & 0xFF
    mantissa = bits & ((1 << _MANTISSA_BITS) - 1)
    exponent = biased - 127 - 8 + (mantissa > _MANTISSA_OF_1_75).astype(jnp.int32)
    # A zero or subnormal max (biased 0) has no such E: the smallest exponent serves.
    exponent = jnp.where(biased == 0, MIN_EXPONENT, exponent)
    return jnp.clip(exponent, MIN_EXPONENT, MAX_EXPONENT).astype(jnp.int8)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., n] (any float dtype) -> (q [..., n] float8_e4m3fn, e [...] int8), row by row."""
    exponent = row_exponents(x)
    scaled = x.astype(jnp.float32) * power_of_two(-exponent.astype(jnp.int32))[..., None]
    return scaled.astype(FP8), exponent


def dequantize(q: jax.Array, exponent: jax.Array, dtype) -> jax.Array:
    """q [..., n] float8_e4m3fn, e [...] -> q * 2^e [..., n] in dtype (exact for float32 and
    bfloat16 while q * 2^e is finite there: rows of max|x| below 2^127)."""
    return (q.astype(jnp.float32) * power_of_two(exponent)[..., None]).astype(dtype)


@jax.custom_vjp
def fake_quantize(x: jax.Array) -> jax.Array:
    """dequantize(quantize(x)) in x's dtype: the values an FP8 store gives back. Its gradient is
    the identity (the straight-through estimator): d fake_quantize(x) / dx = 1."""
    return dequantize(*quantize(x), x.dtype)


def _fake_quantize_fwd(x):
    return fake_quantize(x), None


def _fake_quantize_bwd(_, grad):
    return (grad,)


fake_quantize.defvjp(_fake_quantize_fwd, _fake_quantize_bwd)


def quantize_columns(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [..., K, N] -> (q [..., K, N] float8_e4m3fn, e [..., N] int8): `quantize` of each
    column w[..., :, n] (one exponent per output column of a [K, N] weight)."""
    exponent = row_exponents(jnp.swapaxes(w, -1, -2))
    scaled = w.astype(jnp.float32) * power_of_two(-exponent.astype(jnp.int32))[..., None, :]
    return scaled.astype(FP8), exponent


def dequantize_columns(q: jax.Array, exponent: jax.Array, dtype) -> jax.Array:
    """q [..., K, N] float8_e4m3fn, e [..., N] -> q * 2^e [..., K, N] in dtype (exact, as
    `dequantize`)."""
    return (q.astype(jnp.float32) * power_of_two(exponent)[..., None, :]).astype(dtype)


@jax.custom_vjp
def fake_quantize_columns(w: jax.Array) -> jax.Array:
    """dequantize_columns(quantize_columns(w)) in w's dtype, with the straight-through gradient
    (the identity), as `fake_quantize` by column."""
    return dequantize_columns(*quantize_columns(w), w.dtype)


def _fake_quantize_columns_fwd(w):
    return fake_quantize_columns(w), None


fake_quantize_columns.defvjp(_fake_quantize_columns_fwd, _fake_quantize_bwd)

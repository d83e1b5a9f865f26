"""jrl.kernels.lora_matmul and jrl.kernels.quantized (QLoRA's base): the formula against plain
XLA, gradients (A and B train, the base is frozen), batch invariance, quantisation error bounds
worked out by hand, and native lowering (Mosaic, Triton)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, _grid
from jrl.kernels.quantized import NF4_LEVELS

from .helpers import assert_bitwise_equal, normal

# Small tiles so 37 rows, K = 128 and N = 48 cross several M, N and K tiles; block_k 64 is the
# smallest NF4 accepts (whole blocks of 64 per K tile).
SMALL = dict(matmul_block_m=16, matmul_block_n=16, matmul_block_k=64)
M, K, N, R = 37, 128, 48, 4
SCALE = 2.0     # alpha / rank


def _contract(dtype="float32"):
    return NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return (normal(rng, (M, K)), normal(rng, (K, N), scale=0.1), normal(rng, (K, R), scale=0.1),
            normal(rng, (R, N), scale=0.1))


@functools.lru_cache(maxsize=None)
def _lora_fn(contract):
    return jax.jit(lambda x, w, a, b: kernels.lora_matmul(x, w, a, b, scale=SCALE,
                                                          contract=contract))


def _weights(w, fmt):
    return w if fmt == "dense" else kernels.quantize(w, fmt)


# ------------------------------------------------------------------------------------------------
# lora_matmul


def _plain(x, w, a, b):
    """The formula in plain float32 XLA, the independent reference."""
    hi = jax.lax.Precision.HIGHEST
    return (jnp.dot(x, w, precision=hi)
            + SCALE * jnp.dot(jnp.dot(x, a, precision=hi), b, precision=hi))


def test_lora_forward_and_grads_match_plain_xla():
    x, w, a, b = _inputs()
    contract = _contract()
    # A cotangent that weights every output differently, so no gradient is a plain row sum.
    cotangent = normal(np.random.default_rng(9), (M, N))

    @jax.jit
    def forward_and_grads(x, w, a, b):
        y, vjp = jax.vjp(lambda *args: kernels.lora_matmul(*args, scale=SCALE,
                                                           contract=contract), x, w, a, b)
        return y, vjp(cotangent)

    y, (dx, dw, da, db) = forward_and_grads(x, w, a, b)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    np.testing.assert_allclose(y, _plain(x, w, a, b), rtol=1e-5, atol=1e-5)
    # The reference differentiates x and the adapters; W is frozen: no gradient at all.
    _, ref_vjp = jax.vjp(lambda x, a, b: _plain(x, jax.lax.stop_gradient(w), a, b), x, a, b)
    for got, expected, name in zip((dx, da, db), ref_vjp(cotangent), ("dx", "dA", "dB")):
        assert float(jnp.max(jnp.abs(expected))) > 0.1, name     # not vacuous
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=name)
    assert dw.shape == w.shape and not np.any(np.asarray(dw)), "the base is frozen"


def test_qlora_grads_flow_to_x_and_adapters_only():
    x, w, a, b = _inputs(1)
    contract = _contract()
    qw = kernels.quantize(w, "nf4")
    dense = kernels.dequantize(qw)

    def loss(x, a, b, base):
        return jnp.sum(kernels.lora_matmul(x, base, a, b, scale=SCALE, contract=contract) ** 2)

    *ours, base_grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), allow_int=True))(
        x, a, b, qw)
    ref = jax.grad(lambda x, a, b: jnp.sum(_plain(x, dense, a, b) ** 2), argnums=(0, 1, 2))(
        x, a, b)
    for got, expected, name in zip(ours, ref, ("dx", "dA", "dB")):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-3, err_msg=name)
    # The codes are integers (float0 cotangent) and the scales get zeros.
    assert base_grad.data.dtype == jax.dtypes.float0
    assert not np.any(np.asarray(base_grad.scale, np.float32))


def test_lora_with_b_zero_is_the_base_matmul_bitwise():
    # (x A) 0 = +0.0 exactly, and base + 2 * 0 = base: the adapted projection at init is the
    # base projection's float32 value rounded once, as jrl.kernels.matmul gives it.
    x, w, a, _ = _inputs(2)
    for dtype in ("float32", "bfloat16"):
        contract = _contract(dtype)
        y = _lora_fn(contract)(x, w, a, jnp.zeros((R, N)))
        assert_bitwise_equal(y, jax.jit(lambda x, w: kernels.matmul(x, w, contract=contract))(
            x, w), dtype)


@pytest.mark.parametrize("fmt, dtype", [("dense", "float32"), ("dense", "bfloat16"),
                                        ("int8", "float32"), ("nf4", "bfloat16")])
def test_lora_batch_invariant_bitwise(fmt, dtype):
    """A row's bits are the same alone, in a slice, or inside the whole batch (the sampler's
    decode rows vs the train batch). The quantised cases are QLoRA's kernel."""
    x, w, a, b = _inputs(3)
    contract = _contract(dtype)
    f = _lora_fn(contract)
    base = _weights(w, fmt)
    full = f(x, base, a, b)
    assert full.dtype == jnp.dtype(dtype)
    for start, stop in [(0, 1), (20, 21), (36, 37), (5, 22)]:
        assert_bitwise_equal(f(x[start:stop], base, a, b), full[start:stop],
                             f"{fmt} rows {start}:{stop}")


def test_lora_rejects_mismatched_shapes():
    x, w, a, b = _inputs()
    with pytest.raises(ValueError, match=r"a \(128, 3\).*expected x \[..., K\]"):
        kernels.lora_matmul(x, w, a[:, :3], b, scale=SCALE, contract=_contract())


# ------------------------------------------------------------------------------------------------
# quantize / dequantize


def test_qlora_int8_hand_example():
    # One column [1.27, -0.5, 0.3, 0.004]: scale = max|w| / 127 = 0.01, codes = rint(w / 0.01)
    # = [127, -50, 30, 0]; 0.004 rounds to 0, an error of 0.004 <= scale / 2 = 0.005.
    w = np.asarray([[1.27], [-0.5], [0.3], [0.004]], np.float32)
    qw = kernels.quantize(w, "int8")
    assert qw.shape == (4, 1) and qw.data.shape == (1, 4) and qw.data.dtype == jnp.int8
    np.testing.assert_array_equal(qw.data, [[127, -50, 30, 0]])
    np.testing.assert_allclose(qw.scale, [[0.01]], rtol=1e-7)
    np.testing.assert_allclose(kernels.dequantize(qw), [[1.27], [-0.5], [0.3], [0.0]], rtol=1e-6)


def test_qlora_int8_round_trip_error_bound():
    # Round to nearest of w / s with s = max_k |w[k, n]| / 127 misses by at most s / 2, so
    # |w - dq| <= max|w| / 127 / 2 per output channel (plus float32 rounding: 1e-6 relative).
    w = np.array(normal(np.random.default_rng(4), (K, N)))
    w[:, 3] *= 100.0                          # channels of very different ranges
    dq = np.asarray(kernels.dequantize(kernels.quantize(w, "int8")))
    bound = np.abs(w).max(axis=0) / 127 / 2                            # [N]
    err = np.abs(w - dq).max(axis=0)
    assert np.all(err <= bound * (1 + 1e-6))
    assert np.all(err > 0.5 * bound)          # the bound is tight: rounding did happen


def test_qlora_nf4_hand_example():
    # A block of 64 rows with absmax 2.0 (exact in bfloat16): values 2 * NF4[j] come back
    # exactly, and 0.3 -> 0.3 / 2 = 0.15, whose nearest level is NF4[9] = 0.16093
    # (|0.15 - 0.16093| = 0.0109 < |0.15 - 0.07958| = 0.0704), i.e. 2 * 0.16093 = 0.32186.
    codes = np.arange(64) % 16
    w = (2.0 * NF4_LEVELS[codes]).astype(np.float32)
    w[5] = 0.3                                 # NF4[5] = -0.1848 replaced; absmax stays 2.0
    qw = kernels.quantize(w[:, None], "nf4")
    assert qw.shape == (64, 1) and qw.data.shape == (1, 32) and qw.scale.shape == (1, 1)
    assert float(qw.scale[0, 0]) == 2.0
    expected_codes = codes.copy()
    expected_codes[5] = 9
    # Byte i packs k = 2i (low nibble) and k = 2i + 1 (high nibble): byte 0 = 0 | 1 << 4 = 16.
    packed = expected_codes[0::2] | (expected_codes[1::2] << 4)
    np.testing.assert_array_equal(qw.data[0], packed)
    assert int(qw.data[0, 0]) == 16
    expected = (2.0 * NF4_LEVELS[expected_codes]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(kernels.dequantize(qw))[:, 0], expected)
    assert abs(expected[5] - 0.32186) < 1e-4


def test_qlora_nf4_round_trip_error_bound():
    # Each value is the nearest level of w / s (s the block's absmax, stored in bfloat16), so
    # |w / s - level| <= the widest half gap between neighbouring levels, (1 - 0.6961928) / 2
    # = 0.1519036 (between -1 and the next level). s rounded to bfloat16 can sit 2^-9 below the
    # true absmax, clipping that element by <= 2^-8 s: still inside the bound.
    half_gap = float(np.max(np.diff(NF4_LEVELS))) / 2
    assert abs(half_gap - 0.1519036) < 1e-6
    w = np.array(normal(np.random.default_rng(5), (K, N)))
    w[64:, :] *= 30.0                           # the second block along K has its own scale
    qw = kernels.quantize(w, "nf4")
    assert qw.data.shape == (N, K // 2) and qw.scale.shape == (N, K // 64)
    dq = np.asarray(kernels.dequantize(qw))
    stored = np.asarray(qw.scale, np.float32).T                         # [K / 64, N]
    err = np.abs(w - dq).reshape(K // 64, 64, N).max(axis=1)           # [K / 64, N]
    assert np.all(err <= half_gap * stored * (1 + 1e-6))
    assert np.all(err > 0.05 * stored)         # 4 bits: a visible error in every block


def test_qlora_format_errors_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"format='int4': allowed formats are \['int8', 'nf4'\]"):
        kernels.quantize(np.ones((64, 4), np.float32), "int4")
    with pytest.raises(ValueError, match="multiple of 64"):
        kernels.quantize(np.ones((48, 4), np.float32), "nf4")


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_qlora_matmul_equals_x_times_dequantized(fmt):
    x, w, _, _ = _inputs(6)
    qw = kernels.quantize(w, fmt)
    contract = _contract()
    y = jax.jit(lambda x, qw: kernels.matmul(x, qw, contract=contract))(x, qw)
    dense = kernels.dequantize(qw)
    np.testing.assert_allclose(y, jnp.dot(x, dense, precision=jax.lax.Precision.HIGHEST),
                               rtol=1e-5, atol=1e-5)
    # The dequantised weight is what is multiplied: far from w itself (in nf4).
    if fmt == "nf4":
        assert float(jnp.max(jnp.abs(y - x @ w))) > 1e-2


# ------------------------------------------------------------------------------------------------
# native lowering


@pytest.mark.parametrize("platform, export_platform", [("tpu", "tpu"), ("gpu", "cuda")])
def test_qlora_kernels_lower_natively(platform, export_platform, monkeypatch):
    """Mosaic (TPU) and Triton (GPU) accept the quantised matmul (unpacking NF4 along the lane
    dimension) and lora_matmul, forward and backward, with the platform's default tiles.

    N = 64: the combine runs in jrl.kernels.rowwise, whose Triton lowering (like every rowwise
    step's) needs a power-of-two row width."""
    monkeypatch.setattr(_grid, "_host_platform", lambda: platform)
    contract = NumericalContract.for_platform(platform, compute_dtype="bfloat16")
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    rng = np.random.default_rng(7)
    x, w, a, b = (normal(rng, (M, K)), normal(rng, (K, 64)), normal(rng, (K, R)),
                  normal(rng, (R, 64)))
    spec = lambda t: jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), t)
    for fmt in ("int8", "nf4"):
        qw = kernels.quantize(w, fmt)

        def loss(x, a, b, qw=qw):
            return jnp.sum(kernels.lora_matmul(x, qw, a, b, scale=SCALE,
                                               contract=contract).astype(jnp.float32))

        for fn in (loss, jax.grad(loss, argnums=(0, 1, 2))):
            jax.export.export(jax.jit(fn), platforms=[export_platform],
                              disabled_checks=[triton])(spec(x), spec(a), spec(b))

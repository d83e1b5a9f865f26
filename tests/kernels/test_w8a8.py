"""W8A8 (NumericalContract.matmul_dtype="float8_e4m3fn"): the matmul wrappers multiply activations
read back from FP8 per row and weights per output column (jrl.kernels.fp8), with a
straight-through gradient. Values are chosen so every rounding is away from a tie and every
product and sum is exact in float32 (the results do not depend on a summation order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import fp8
from jrl.kernels.contract import NumericalContract

FP8 = "float8_e4m3fn"
# [M=2, K=2] activations and a [K=2, N=2] weight.
X = jnp.asarray([[1.0, 3.0], [0.3, -2.0]], jnp.float32)
W = jnp.asarray([[1.0, 0.1], [1.0, 0.7]], jnp.float32)
# Activations by row (max|x| = m * 2^E; e = E - 8 if m <= 1.75 else E - 7):
#   row 0: max 3 = 1.5 * 2^1 -> e = -7: [128, 384] are e4m3fn values -> back [1, 3];
#   row 1: max 2 = 1 * 2^1   -> e = -7: 0.3 * 128 = 38.4 lies in [32, 64), spacing 4, -> 40
#          (36 is 2.4 away, 40 is 1.6), -2 * 128 = -256 exact -> back [40 / 128, -2] = [0.3125, -2].
XQ = [[1.0, 3.0], [0.3125, -2.0]]
# Weights by output column:
#   column 0: max 1 = 1 * 2^0     -> e = -8: [256, 256] exact -> back [1, 1];
#   column 1: max 0.7 = 1.4 * 2^-1 -> e = -9: 0.1 * 512 = 51.2 in [32, 64), spacing 4, -> 52;
#             0.7 * 512 = 358.4 in [256, 448], spacing 32, -> 352 (384 is 25.6 away)
#             -> back [52 / 512, 352 / 512] = [0.1015625, 0.6875].
WQ = [[1.0, 0.1015625], [1.0, 0.6875]]
# XQ @ WQ:
#   [0, 0] = 1 * 1 + 3 * 1 = 4;                     [0, 1] = 0.1015625 + 3 * 0.6875 = 2.1640625;
#   [1, 0] = 0.3125 - 2 = -1.6875;                  [1, 1] = 0.3125 * 0.1015625 - 2 * 0.6875
#                                                          = 65 / 2048 - 1.375 = -1.34326171875.
Y = [[4.0, 2.1640625], [-1.6875, -1.34326171875]]


def w8a8(backend: str = "pallas", **changes) -> NumericalContract:
    return NumericalContract(backend=backend, platform="cpu" if backend == "pallas" else "auto",
                             matmul_dtype=FP8, **changes)


def test_column_exponents_and_values_by_hand():
    q, e = fp8.quantize_columns(W)
    np.testing.assert_array_equal(e, [-8, -9])
    np.testing.assert_array_equal(q.astype(jnp.float32), [[256.0, 52.0], [256.0, 352.0]])
    np.testing.assert_array_equal(fp8.dequantize_columns(q, e, jnp.float32), WQ)
    np.testing.assert_array_equal(fp8.fake_quantize_columns(W), WQ)
    np.testing.assert_array_equal(fp8.fake_quantize(X), XQ)


def test_columns_are_the_rows_of_the_transpose():
    """quantize_columns(w) is quantize(w.T) transposed, byte for byte, for a stack of expert
    weights [E, K, N] too (one exponent per expert and column)."""
    w = np.random.default_rng(0).standard_normal((3, 8, 5)).astype(np.float32)
    w *= np.exp2(np.arange(5, dtype=np.float32) * 3.0 - 6.0)        # columns of unlike scale
    q, e = fp8.quantize_columns(jnp.asarray(w))
    q_t, e_t = fp8.quantize(jnp.swapaxes(jnp.asarray(w), -1, -2))
    assert e.shape == (3, 5)
    np.testing.assert_array_equal(e, e_t)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8),
                                  np.swapaxes(np.asarray(q_t).view(np.uint8), -1, -2))


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_w8a8_matmul_by_hand(backend):
    np.testing.assert_array_equal(kernels.matmul(X, W, contract=w8a8(backend)), Y)
    # The compute path differs: its [0, 1] is 0.1 + 3 * 0.7 = 2.2 (to float32 rounding).
    plain = kernels.matmul(X, W, contract=w8a8(backend).replace(matmul_dtype="compute"))
    assert abs(float(plain[0, 1]) - 2.2) < 1e-6 and float(plain[0, 1]) != Y[0][1]


def test_w8a8_tied_embedding_is_quantised_by_its_rows():
    """transpose_w (a tied embedding [N, K]): the output columns are the stored rows, so
    matmul(x, W.T, transpose_w=True) gives the same bits as matmul(x, W)."""
    np.testing.assert_array_equal(kernels.matmul(X, W.T, contract=w8a8(), transpose_w=True), Y)


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_w8a8_gradient_is_straight_through_by_hand(backend):
    """L = sum(G * matmul(x, w)) with G = [[1, 0], [0, 2]]: the straight-through gradients are
    the plain matmul's at the quantised point,
        dL/dx = G @ WQ^T = [[1, 1], [2 * 0.1015625, 2 * 0.6875]] = [[1, 1], [0.203125, 1.375]],
        dL/dw = XQ^T @ G = [[1, 2 * 0.3125], [3, 2 * -2]]       = [[1, 0.625], [3, -4]],
    though the forward moved x[1, 0] (0.3 -> 0.3125) and w[:, 1]."""
    g = jnp.asarray([[1.0, 0.0], [0.0, 2.0]], jnp.float32)
    dx, dw = jax.grad(lambda x, w: jnp.sum(g * kernels.matmul(x, w, contract=w8a8(backend))),
                      argnums=(0, 1))(X, W)
    np.testing.assert_array_equal(dx, [[1.0, 1.0], [0.203125, 1.375]])
    np.testing.assert_array_equal(dw, [[1.0, 0.625], [3.0, -4.0]])


def test_w8a8_scales_are_per_row_so_a_row_does_not_see_its_batch():
    """A row's product is the same alone and beside a row 2^20 times larger: its exponent is its
    own (a per-tensor scale would flush it to zero)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32).at[5].multiply(2.0**20)
    w = jnp.asarray(rng.standard_normal((32, 24)), jnp.float32)
    batch = kernels.matmul(x, w, contract=w8a8())
    for row in (0, 5, 15):
        alone = kernels.matmul(jnp.tile(x[row:row + 1], (16, 1)), w, contract=w8a8())
        np.testing.assert_array_equal(alone[0], batch[row])
    assert np.all(np.abs(np.asarray(batch[0])) > 0)


def test_w8a8_projections_quantise_the_normed_rows():
    """projections with an RMSNorm prologue: the norm's output is what is quantised, then each
    weight by its columns: the same bits as rms_norm -> matmul of the read-back values."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal(32), jnp.float32)
    weights = [jnp.asarray(rng.standard_normal((32, n)), jnp.float32) for n in (8, 16)]
    c = w8a8("xla")
    got = kernels.projections(x, weights, contract=c, norm=(scale, 1e-6))
    normed = fp8.fake_quantize(kernels.rms_norm(x, scale, eps=1e-6, contract=c))
    plain = c.replace(matmul_dtype="compute")
    for y, w in zip(got, weights):
        np.testing.assert_array_equal(
            y, kernels.matmul(normed, fp8.fake_quantize_columns(w), contract=plain))


def test_w8a8_moe_experts_quantise_inputs_and_each_experts_columns():
    """moe_experts under W8A8 equals moe_experts of the read-back values: x per token, each
    expert's weights per its own columns (an expert of 2^10 times larger weights does not change
    another expert's exponents)."""
    rng = np.random.default_rng(3)
    n, d, f, e = 6, 16, 8, 4
    x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((e, d, f)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((e, f, d)), jnp.float32).at[2].multiply(2.0**10)
    experts = jnp.asarray(rng.integers(0, e, (n, 2)), jnp.int32)
    experts = experts.at[:, 1].set((experts[:, 0] + 1) % e)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (n, 2)), jnp.float32)
    c = w8a8("xla")
    got = kernels.moe_experts(x, experts, weights, w_gate, w_up, w_down, contract=c)

    def by_expert(w):          # each expert alone through the [K, N] quantiser
        return jnp.stack([fp8.fake_quantize_columns(w[i]) for i in range(e)])

    want = kernels.moe_experts(fp8.fake_quantize(x), experts, weights, by_expert(w_gate),
                               by_expert(w_up), by_expert(w_down),
                               contract=c.replace(matmul_dtype="compute"))
    np.testing.assert_array_equal(got, want)


def test_w8a8_lora_quantises_input_and_base_not_the_adapters():
    """lora_matmul with B = 0: the delta is +0.0, so y is the W8A8 base product (the hand values
    above, none of them -0.0); the adapters' A and B stay in the compute dtype."""
    a = jnp.asarray([[0.3], [0.7]], jnp.float32)
    b = jnp.zeros((1, 2), jnp.float32)
    np.testing.assert_array_equal(kernels.lora_matmul(X, W, a, b, scale=2.0, contract=w8a8()), Y)


def test_w8a8_refuses_a_quantised_base_naming_the_field():
    qw = kernels.quantize(jnp.ones((32, 16), jnp.float32), "int8")
    with pytest.raises(ValueError, match=r"NumericalContract.matmul_dtype='float8_e4m3fn'.*int8"):
        kernels.matmul(jnp.ones((2, 32), jnp.float32), qw, contract=w8a8("xla"))


def test_matmul_dtype_is_a_validated_contract_field():
    with pytest.raises(ValueError, match=r"NumericalContract.matmul_dtype.*float8_e4m3fn"):
        NumericalContract(matmul_dtype="float8_e5m2")
    c = NumericalContract(matmul_dtype=FP8)
    assert c.fp8_matmul and not NumericalContract().fp8_matmul
    assert NumericalContract.from_dict(c.to_dict()) == c
    # A contract recorded before the field existed reads as the compute-dtype matmuls.
    old = {k: v for k, v in c.to_dict().items() if k != "matmul_dtype"}
    assert NumericalContract.from_dict(old).matmul_dtype == "compute"
    with pytest.raises(ValueError, match=r"matmul_dtype: 'float8_e4m3fn' != 'compute'"):
        c.check_compatible(NumericalContract())

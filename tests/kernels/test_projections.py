"""kernels.projections: an input's RMSNorm and several projections of it in one kernel.

The native grid runs in Pallas's TPU interpreter (the real grid and BlockSpecs on this CPU); the
CPU's emulated grid runs the separate norm and matmul kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, reference

from .helpers import assert_bitwise_equal, normal
from .test_platforms import HAVE_TPU_INTERPRET

needs_tpu_interpret = pytest.mark.skipif(not HAVE_TPU_INTERPRET,
                                         reason="pltpu.InterpretParams unavailable")
# 8-row tiles: 20 rows are two full tiles and a partial one; K = 200 is one full 128-wide K tile
# and a padded one; N = 130, 40, 7: each weight ends in a partial column tile.
NATIVE = NumericalContract(platform="tpu_interpret", matmul_block_m=8, matmul_block_n=128,
                           matmul_block_k=128)
EPS = 1e-6


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = normal(rng, (20, 200))
    weights = [normal(rng, (200, n), scale=0.1) for n in (130, 40, 7)]
    return x, normal(rng, (200,)), weights


@needs_tpu_interpret
def test_native_kernel_computes_the_norm_and_each_projection():
    x, scale, weights = _operands()
    got = kernels.projections(x, weights, contract=NATIVE, norm=(scale, EPS))
    normed = reference.rms_norm(x, scale, eps=EPS)
    assert len(got) == 3
    for y, w in zip(got, weights):
        assert y.shape == (20, w.shape[1]) and y.dtype == jnp.float32
        np.testing.assert_allclose(y, reference.matmul(normed, w, out_dtype=jnp.float32),
                                   rtol=1e-5, atol=2e-5)
    # Without a norm: plain projections of x.
    for y, w in zip(kernels.projections(x, weights, contract=NATIVE), weights):
        np.testing.assert_allclose(y, x @ w, rtol=1e-5, atol=2e-5)


@needs_tpu_interpret
def test_native_kernel_is_batch_invariant():
    """A row's bits do not depend on how many rows share the call or where the row sits: the
    sampler's decode rows and the train step's rows are computed alike."""
    x, scale, weights = _operands()
    full = kernels.projections(x, weights, contract=NATIVE, norm=(scale, EPS))
    for rows in (slice(13, 14), slice(3, 8), slice(9, 20)):
        part = kernels.projections(x[rows], weights, contract=NATIVE, norm=(scale, EPS))
        for name, a, b in zip(("w0", "w1", "w2"), full, part):
            assert_bitwise_equal(a[rows], b, f"{name} rows {rows}")


@needs_tpu_interpret
def test_native_gradients_match_the_reference():
    x, scale, weights = _operands()

    def loss(contract, x, scale, weights):
        ys = kernels.projections(x, weights, contract=contract, norm=(scale, EPS))
        return sum(jnp.sum(jnp.sin(y)) for y in ys)

    got = jax.grad(loss, argnums=(1, 2, 3))(NATIVE, x, scale, weights)
    expected = jax.grad(loss, argnums=(1, 2, 3))(NATIVE.replace(backend="xla"), x, scale,
                                                  weights)
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=5e-5)


def test_emulated_grid_runs_the_separate_kernels():
    """On a CPU the result is, bit for bit, the norm kernel followed by one matmul per weight
    (what a layer ran before the fusion), so the CPU's tiles and speed are unchanged."""
    x, scale, weights = _operands()
    cpu = NumericalContract(platform="cpu")
    got = kernels.projections(x, weights, contract=cpu, norm=(scale, EPS))
    normed = kernels.rms_norm(x, scale, eps=EPS, contract=cpu)
    for y, w in zip(got, weights):
        assert_bitwise_equal(y, kernels.matmul(normed, w, contract=cpu), "emulated")


def test_bad_weights_are_refused_with_their_shape():
    x, scale, weights = _operands()
    cpu = NumericalContract(platform="cpu")
    with pytest.raises(ValueError, match=r"K = 200 .* got \(199, 4\)"):
        kernels.projections(x, [weights[0], jnp.zeros((199, 4))], contract=cpu)
    with pytest.raises(ValueError, match="at least one weight"):
        kernels.projections(x, [], contract=cpu)
    with pytest.raises(ValueError, match="plain"):
        kernels.projections(x, [kernels.quantize(weights[0], "int8")], contract=cpu)

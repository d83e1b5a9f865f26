"""jrl.kernels.rms_norm: reference agreement, determinism, batch invariance, gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, reference

from .helpers import ATOL, DTYPES, assert_bitwise_equal, bits, normal

EPS = 1e-6


@functools.lru_cache(maxsize=None)
def _jitted(contract):
    return jax.jit(lambda x, s: kernels.rms_norm(x, s, eps=EPS, contract=contract))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    rng = np.random.default_rng(0)
    x, scale = normal(rng, (3, 50, 100), dtype), normal(rng, (100,))
    y = _jitted(NumericalContract(platform="cpu", norm_block_rows=32))(x, scale)
    assert y.dtype == jnp.dtype(dtype) and y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y, np.float32),
                               np.asarray(reference.rms_norm(x, scale, eps=EPS), np.float32),
                               atol=ATOL[dtype], rtol=1e-2 if dtype == "bfloat16" else 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_batch_invariant_and_deterministic_bitwise(dtype):
    rng = np.random.default_rng(1)
    x, scale = normal(rng, (150, 100), dtype), normal(rng, (100,))
    for contract in (NumericalContract(platform="cpu"),
                     NumericalContract(platform="cpu", norm_block_rows=16)):
        f = _jitted(contract)
        full = f(x, scale)
        assert_bitwise_equal(f(x, scale), full, "repeat")
        for start, stop in [(0, 1), (3, 4), (149, 150), (5, 8), (0, 7), (64, 128), (17, 81)]:
            assert_bitwise_equal(f(x[start:stop], scale), full[start:stop], f"rows {start}:{stop}")


def test_xla_rms_norm_is_not_batch_invariant_bitwise():
    """The control: XLA's row reduction gives a row different bits alone than in a batch."""
    rng = np.random.default_rng(2)
    x, scale = normal(rng, (64, 100)), normal(rng, (100,))
    xla = _jitted(NumericalContract(platform="cpu", backend="xla"))
    assert not np.array_equal(bits(xla(x[:3], scale)), bits(xla(x, scale)[:3]))
    pallas = _jitted(NumericalContract(platform="cpu"))
    assert_bitwise_equal(pallas(x[:3], scale), pallas(x, scale)[:3])


def test_rms_norm_grads_match_reference():
    rng = np.random.default_rng(3)
    x, scale, dy = normal(rng, (7, 100)), normal(rng, (100,)), normal(rng, (7, 100))
    contract = NumericalContract(platform="cpu")
    ours = jax.grad(lambda x, s: jnp.sum(kernels.rms_norm(x, s, eps=EPS, contract=contract) * dy),
                    (0, 1))
    ref = jax.grad(lambda x, s: jnp.sum(reference.rms_norm(x, s, eps=EPS) * dy), (0, 1))
    for got, want in zip(jax.jit(ours)(x, scale), ref(x, scale)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

"""jrl.kernels.token_logprobs: reference agreement (temperature, truncation, entropy),
determinism, batch invariance, gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl import kernels
from jrl.kernels import NumericalContract, reference

from .helpers import DTYPES, assert_bitwise_equal, normal

VOCAB = 1000                         # not a multiple of the chunk: the last chunk is padded
SMALL = dict(logprob_block_rows=8, vocab_chunk=256)


@functools.lru_cache(maxsize=None)
def _jitted(contract, temperature=1.0, return_entropy=True):
    return jax.jit(lambda logits, targets, floor: kernels.token_logprobs(
        logits, targets, contract=contract, temperature=temperature, logit_floor=floor,
        return_entropy=return_entropy))


def _inputs(rng, rows, dtype="float32", top_k=None):
    logits = normal(rng, (rows, VOCAB), dtype, scale=3.0)
    targets = jnp.asarray(rng.integers(0, VOCAB, rows), jnp.int32)
    floor = None
    if top_k is not None:
        floor = jnp.sort(logits.astype(jnp.float32), axis=-1)[:, -top_k] / 0.7
    return logits, targets, floor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [None, 50])
def test_token_logprobs_match_reference(dtype, top_k):
    rng = np.random.default_rng(0)
    logits, targets, floor = _inputs(rng, 37, dtype, top_k)
    logits, targets = logits.reshape(37, 1, VOCAB), targets.reshape(37, 1)   # leading dims
    floor = None if floor is None else floor.reshape(37, 1)
    got = _jitted(NumericalContract(platform="cpu", **SMALL), 0.7)(logits, targets, floor)
    want = reference.token_logprobs(logits, targets, temperature=0.7, logit_floor=floor)
    assert got.logp.shape == (37, 1) and got.logp.dtype == jnp.float32
    np.testing.assert_allclose(got.logp, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got.entropy, want[1], rtol=1e-5, atol=1e-5)


def test_token_logprobs_without_entropy():
    rng = np.random.default_rng(1)
    logits, targets, _ = _inputs(rng, 9)
    contract = NumericalContract(platform="cpu", **SMALL)
    got = _jitted(contract, 1.0, False)(logits, targets, None)
    assert got.entropy is None
    assert_bitwise_equal(got.logp, _jitted(contract)(logits, targets, None).logp)


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_logprobs_batch_invariant_and_deterministic_bitwise(dtype):
    rng = np.random.default_rng(2)
    logits, targets, floor = _inputs(rng, 70, dtype, top_k=20)
    for contract in (NumericalContract(platform="cpu", compute_dtype=dtype),
                     NumericalContract(platform="cpu", compute_dtype=dtype, **SMALL)):
        f = _jitted(contract, 0.7)
        full = f(logits, targets, floor)
        again = f(logits, targets, floor)
        assert_bitwise_equal(again.logp, full.logp, "repeat")
        for start, stop in [(0, 1), (69, 70), (5, 8), (0, 7), (1, 65), (17, 50)]:
            part = f(logits[start:stop], targets[start:stop], floor[start:stop])
            assert_bitwise_equal(part.logp, full.logp[start:stop], f"logp {start}:{stop}")
            assert_bitwise_equal(part.entropy, full.entropy[start:stop], f"entropy {start}:{stop}")


def test_token_logprobs_grads_match_reference():
    rng = np.random.default_rng(3)
    logits, targets, floor = _inputs(rng, 6, top_k=30)
    contract = NumericalContract(platform="cpu", **SMALL)

    def loss(fn):
        def f(logits):
            logp, entropy = fn(logits)
            return jnp.sum(logp * jnp.arange(6.0)) + jnp.sum(entropy)
        return f

    ours = jax.jit(jax.grad(loss(lambda x: kernels.token_logprobs(
        x, targets, contract=contract, temperature=0.7, logit_floor=floor))))
    ref = jax.grad(loss(lambda x: reference.token_logprobs(x, targets, temperature=0.7,
                                                           logit_floor=floor)))
    np.testing.assert_allclose(ours(logits), ref(logits), rtol=1e-5, atol=1e-6)

"""Tests for jrl.losses.off_policy: TIS weights and MIS masks (token and sequence level)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import mis_mask, tis_weights

# Training-side p = (0.6, 0.4, 0.9, 0.5), sampler p_b = (0.4, 0.6, 0.3, 0.5):
# w = (1.5, 0.667, 3.0, 1.0).
LOGP = jnp.log(jnp.array([[0.6, 0.4, 0.9, 0.5]]))
BEHAVIOR = jnp.log(jnp.array([[0.4, 0.6, 0.3, 0.5]]))


def test_tis_values(maybe_jit, dtype, tol):
    fn = maybe_jit(lambda a, b: tis_weights(a, b, cap=2.0))
    out = fn(LOGP.astype(dtype), BEHAVIOR.astype(dtype))
    np.testing.assert_allclose(out.raw_weights[0], [1.5, 2 / 3, 3.0, 1.0], **tol)
    # cap 2: 3.0 -> 2.0; only that token is clipped.
    np.testing.assert_allclose(out.weights[0], [1.5, 2 / 3, 2.0, 1.0], **tol)
    np.testing.assert_array_equal(out.clipped[0], [False, False, True, False])


def test_tis_is_stop_gradient_and_masked(garbage):
    mask = jnp.array([[1, 1, 0, 1]])
    fn = lambda a: jnp.sum(tis_weights(a, BEHAVIOR, cap=2.0, mask=mask, log_ratio_clip=None).weights)
    assert np.all(np.asarray(jax.grad(fn)(LOGP)) == 0.0)
    out = tis_weights(garbage(LOGP, mask), BEHAVIOR, cap=2.0, mask=mask, log_ratio_clip=None)
    np.testing.assert_allclose(out.weights[0], [1.5, 2 / 3, 1.0, 1.0], rtol=1e-6)
    assert not bool(out.clipped[0, 2])


def test_mis_token_level(maybe_jit, dtype):
    fn = maybe_jit(lambda a, b: mis_mask(a, b, threshold=2.0, level="token"))
    out = fn(LOGP.astype(dtype), BEHAVIOR.astype(dtype))
    # bounds [1/2, 2]: 1.5 keep, 0.667 keep, 3.0 drop, 1.0 keep.
    np.testing.assert_array_equal(out.keep[0], [1.0, 1.0, 0.0, 1.0])


def test_mis_sequence_level_geometric_mean():
    # Row 0: w = (1.5, 0.667, 3.0, 1.0): geometric mean = (1.5 * 2/3 * 3 * 1) ** (1/4) = 3 ** 0.25
    #        = 1.316 -> kept with threshold 2 (the arithmetic mean 1.54 is not what is tested).
    # Row 1: four tokens with w = 3: geometric mean 3 -> whole sequence dropped.
    logp = jnp.concatenate([LOGP, jnp.log(jnp.full((1, 4), 0.9))])
    behavior = jnp.concatenate([BEHAVIOR, jnp.log(jnp.full((1, 4), 0.3))])
    out = mis_mask(logp, behavior, threshold=2.0, level="sequence")
    np.testing.assert_array_equal(out.keep, [[1, 1, 1, 1], [0, 0, 0, 0]])
    np.testing.assert_allclose(out.ratio[0], 3**0.25, rtol=1e-5)


def test_mis_sequence_level_long_sequence_no_underflow():
    # 10000 tokens, each with w = 0.99: the raw product 0.99 ** 10000 = 2e-44 underflows f32 to
    # ~0 and would reject; the geometric mean is 0.99, well inside [0.5, 2].
    old = jnp.full((1, 10_000), -1.0)
    logp = old + math.log(0.99)
    out = mis_mask(logp, old, threshold=2.0, level="sequence")
    assert float(out.keep.min()) == 1.0
    np.testing.assert_allclose(out.ratio[0, 0], 0.99, rtol=1e-5)
    assert np.float32(0.99) ** 10_000 < 1e-40


def test_mis_masked_garbage(garbage):
    mask = jnp.array([[1, 1, 1, 0]])
    for level in ("token", "sequence"):
        clean = mis_mask(LOGP, BEHAVIOR, threshold=4.0, level=level, mask=mask)
        dirty = mis_mask(garbage(LOGP, mask), BEHAVIOR, threshold=4.0, level=level, mask=mask)
        np.testing.assert_array_equal(clean.keep, dirty.keep)
        assert float(dirty.keep[0, 3]) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"level='batch' .*'token', 'sequence'"):
        mis_mask(LOGP, BEHAVIOR, threshold=2.0, level="batch")
    with pytest.raises(ValueError, match="threshold=0.5"):
        mis_mask(LOGP, BEHAVIOR, threshold=0.5, level="token")
    with pytest.raises(ValueError, match="cap=0"):
        tis_weights(LOGP, BEHAVIOR, cap=0)


def test_sequence_level_tis_is_the_capped_product_of_token_ratios():
    logp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    behavior = jnp.array([[-1.5, -1.5, -3.0], [-2.0, -2.0, 0.0]])
    mask = jnp.array([[1, 1, 1], [1, 1, 0]])
    out = tis_weights(logp, behavior, cap=2.0, mask=mask, level="sequence")
    # Sequence 0: log ratios 0.5 - 0.5 + 0 = 0 -> product 1 on every token. Sequence 1:
    # 1 + 1 = 2 -> e^2 = 7.389 on its two tokens, capped at 2; the masked position keeps 1.
    np.testing.assert_allclose(out.raw_weights, [[1, 1, 1], [np.exp(2.0), np.exp(2.0), 1]],
                               rtol=1e-6)
    np.testing.assert_allclose(out.weights, [[1, 1, 1], [2, 2, 1]])
    np.testing.assert_array_equal(out.clipped, [[False] * 3, [True, True, False]])
    with pytest.raises(ValueError, match="level='word'"):
        tis_weights(logp, behavior, cap=2.0, level="word")

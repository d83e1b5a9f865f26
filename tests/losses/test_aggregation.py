"""Tests for jrl.losses.aggregation: per-token weights of each reduction, empty masks,
micro-batch normalisers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import AGGREGATION_MODES, aggregate, normalizer_for

# The seed's example: a 100-token answer A and a 10000-token answer B in one group of 2.
LONG = 10_000
MASK_100_10000 = jnp.stack([jnp.arange(LONG) < 100, jnp.ones(LONG, bool)])


def token_weights(mode, mask=MASK_100_10000, **kw):
    """The weight each token gets in the loss = d aggregate / d values."""
    values = jnp.zeros(mask.shape)
    return jax.grad(lambda v: aggregate(v, mask, mode, **kw))(values)


def test_seq_mean_token_mean_weights():
    w = token_weights("seq_mean_token_mean")
    # GRPO: (1/G) * (1/T_i): 1 / (2 * 100) = 1/200 for A, 1 / (2 * 10000) = 1/20000 for B.
    np.testing.assert_allclose(w[0, :100], 1 / 200, rtol=1e-6)
    np.testing.assert_allclose(w[1], 1 / 20000, rtol=1e-6)
    assert np.all(np.asarray(w[0, 100:]) == 0.0)  # padding gets no weight
    # Each answer's total weight is the same: 100 / 200 = 10000 / 20000 = 1/2.
    np.testing.assert_allclose([w[0].sum(), w[1].sum()], [0.5, 0.5], rtol=1e-5)


def test_token_mean_weights():
    w = token_weights("token_mean")
    # DAPO: every valid token weighs 1 / (100 + 10000) = 1/10100.
    np.testing.assert_allclose(w[0, :100], 1 / 10100, rtol=1e-6)
    np.testing.assert_allclose(w[1], 1 / 10100, rtol=1e-6)


def test_constant_weights():
    w = token_weights("constant", max_len=LONG)
    # Dr.GRPO: 1 / (G * L_max) = 1 / (2 * 10000) for every valid token, whatever its length.
    np.testing.assert_allclose(w[0, :100], 1 / 20000, rtol=1e-6)
    np.testing.assert_allclose(w[1], 1 / 20000, rtol=1e-6)


def test_token_sum_norm_weights():
    w = token_weights("token_sum_norm", max_len=LONG)
    # verl's seq-mean-token-sum-norm: 1 / L_max = 1 / 10000 for every valid token.
    np.testing.assert_allclose(w[0, :100], 1 / 10000, rtol=1e-6)
    np.testing.assert_allclose(w[1], 1 / 10000, rtol=1e-6)


def test_seq_mean_token_sum_weights():
    w = token_weights("seq_mean_token_sum")
    # 1 / G = 1/2 for every valid token.
    np.testing.assert_allclose(w[0, :100], 0.5)
    np.testing.assert_allclose(w[1], 0.5)


def test_values(maybe_jit, dtype, tol, garbage):
    values = jnp.array([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], dtype)
    mask = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0]])
    expected = {
        "token_mean": (1 + 2 + 3 + 4) / 4,  # 10 / 4 = 2.5
        "seq_mean_token_mean": (6 / 3 + 4 / 1) / 2,  # (2 + 4) / 2 = 3
        "seq_mean_token_sum": (6 + 4) / 2,  # 5
        "constant": (6 + 4) / (2 * 8),  # 10 / 16 = 0.625
        "token_sum_norm": (6 + 4) / 8,  # 1.25: the token budget only, no sequence count
    }
    for mode, value in expected.items():
        fn = maybe_jit(lambda v: aggregate(v, mask, mode, max_len=8))
        out = fn(values)
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, value, **tol)
        # Garbage at masked positions changes neither the value nor the gradient.
        np.testing.assert_allclose(fn(garbage(values, mask)), value, **tol)
        g_clean = jax.grad(fn)(values)
        g_dirty = jax.grad(fn)(garbage(values, mask))
        np.testing.assert_array_equal(g_clean, g_dirty)


def test_empty_mask_is_zero_not_nan(maybe_jit):
    values = jnp.ones((2, 3))
    empty = jnp.zeros((2, 3))
    for mode in AGGREGATION_MODES:
        fn = maybe_jit(lambda v: aggregate(v, empty, mode, max_len=3))
        assert float(fn(values)) == 0.0
        assert np.all(np.asarray(jax.grad(fn)(values)) == 0.0)


def test_fully_masked_row_is_padding():
    # A fully masked row does not count as a sequence: same loss as without the row.
    values = jnp.array([[1.0, 3.0], [5.0, 5.0]])
    mask = jnp.array([[1, 1], [0, 0]])
    for mode in AGGREGATION_MODES:
        with_pad = aggregate(values, mask, mode, max_len=2)
        without = aggregate(values[:1], mask[:1], mode, max_len=2)
        np.testing.assert_allclose(with_pad, without, rtol=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batches_match_full_batch(mode):
    # A batch of 4 sequences with different lengths, split into 2 micro-batches of 2. With the
    # whole batch's normaliser, the micro-batch losses (and gradients) sum to the full ones.
    values = jnp.arange(20.0).reshape(4, 5) / 7.0
    mask = jnp.array([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    full_fn = lambda v: aggregate(v, mask, mode, max_len=5)
    full, full_grad = jax.value_and_grad(full_fn)(values)
    norm = normalizer_for(mask, mode, max_len=5)
    parts, grads = [], []
    for rows in (slice(0, 2), slice(2, 4)):
        fn = lambda v: aggregate(v, mask[rows], mode, max_len=5, normalizer=norm)
        value, grad = jax.value_and_grad(fn)(values[rows])
        parts.append(value)
        grads.append(grad)
    np.testing.assert_allclose(sum(parts), full, rtol=1e-6)
    np.testing.assert_allclose(jnp.concatenate(grads), full_grad, rtol=1e-6)
    if mode == "token_mean":
        # Without the override each micro-batch divides by its own token count: 6 and 5
        # tokens instead of 11, so the sum is not the full-batch mean.
        local = sum(aggregate(values[r], mask[r], mode) for r in (slice(0, 2), slice(2, 4)))
        assert not np.isclose(local, full)


def test_bad_mode_names_field_and_choices():
    with pytest.raises(ValueError, match=r"mode='mean' .*'token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum', 'constant'"):
        aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "mean")
    with pytest.raises(ValueError, match="max_len=None .*constant"):
        aggregate(jnp.ones((1, 2)), jnp.ones((1, 2)), "constant")

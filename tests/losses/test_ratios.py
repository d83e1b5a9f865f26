"""Tests for jrl.losses.ratios: token ratio, GSPO sequence ratio, GSPO-token."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jrl.losses import sequence_ratio, sequence_ratio_token, token_ratio

MASK = jnp.array([[1, 1, 1, 0], [1, 1, 0, 0]])
LOGP = jnp.log(jnp.array([[0.5, 0.25, 0.5, 0.5], [0.5, 0.5, 0.5, 0.5]]))
OLD = jnp.log(jnp.array([[0.25, 0.25, 1.0, 0.5], [0.5, 0.25, 0.5, 0.5]]))


def test_token_ratio_values(maybe_jit, dtype, tol):
    ratio = maybe_jit(lambda a, b: token_ratio(a, b, MASK))(LOGP.astype(dtype), OLD.astype(dtype))
    assert ratio.dtype == jnp.float32
    # 0.5 / 0.25 = 2, 0.25 / 0.25 = 1, 0.5 / 1 = 0.5; masked positions are exactly 1.
    np.testing.assert_allclose(ratio, [[2.0, 1.0, 0.5, 1.0], [1.0, 2.0, 1.0, 1.0]], **tol)


def test_equal_logprobs_give_exactly_one(maybe_jit, dtype):
    logp = jnp.array([[-0.3, -2.7, -11.0]], dtype)
    assert np.all(np.asarray(maybe_jit(token_ratio)(logp, logp)) == 1.0)
    seq = maybe_jit(sequence_ratio)(logp, logp, jnp.ones_like(logp))
    tok = maybe_jit(sequence_ratio_token)(logp, logp, jnp.ones_like(logp))
    assert np.all(np.asarray(seq) == 1.0) and np.all(np.asarray(tok) == 1.0)


def test_token_ratio_gradient_and_stop_gradient():
    # d r / d logp = r (numerator carries gradient); d r / d old_logp = 0 (stop-gradient).
    d_logp, d_old = jax.grad(lambda a, b: jnp.sum(token_ratio(a, b, MASK)), argnums=(0, 1))(LOGP, OLD)
    np.testing.assert_allclose(d_logp, [[2.0, 1.0, 0.5, 0.0], [1.0, 2.0, 0.0, 0.0]], rtol=1e-6)
    assert np.all(np.asarray(d_old) == 0.0)


def test_masked_garbage_never_leaks(garbage):
    fn = lambda a, b: jnp.sum(token_ratio(a, b, MASK, log_ratio_clip=None))
    for f in (fn, lambda a, b: jnp.sum(sequence_ratio(a, b, MASK, log_ratio_clip=None)),
              lambda a, b: jnp.sum(sequence_ratio_token(a, b, MASK) * MASK)):
        clean = jax.value_and_grad(f)(LOGP, OLD)
        for dirty_args in ((garbage(LOGP, MASK), OLD), (LOGP, garbage(OLD, MASK))):
            dirty = jax.value_and_grad(f)(*dirty_args)
            np.testing.assert_allclose(clean[0], dirty[0], rtol=1e-6)
            np.testing.assert_allclose(clean[1], dirty[1], rtol=1e-6)
            assert np.all(np.isfinite(dirty[1]))


def test_log_ratio_clip_default_and_off():
    logp, old = jnp.array([[0.0]]), jnp.array([[-100.0]])
    # Default clamp 20: exp(20) = 4.85e8, finite; unclamped exp(100) overflows f32 to inf.
    np.testing.assert_allclose(token_ratio(logp, old), math.exp(20.0), rtol=1e-5)
    assert np.isinf(np.asarray(token_ratio(logp, old, log_ratio_clip=None)))
    np.testing.assert_allclose(token_ratio(logp, old, log_ratio_clip=1.0), math.e, rtol=1e-6)


def test_sequence_ratio_is_geometric_mean(maybe_jit, dtype, tol):
    seq = maybe_jit(sequence_ratio)(LOGP.astype(dtype), OLD.astype(dtype), MASK)
    # row 0: token ratios (2, 1, 0.5): (2 * 1 * 0.5) ** (1/3) = 1; row 1: (1 * 2) ** (1/2) = 1.41421
    np.testing.assert_allclose(seq, [1.0, math.sqrt(2.0)], **tol)


def test_sequence_ratio_1000_tokens():
    # 1000 tokens with ratio 1.01 each: the geometric mean is 1.01, the raw product would be
    # 1.01 ** 1000 = 20959.
    old = jnp.full((1, 1000), -2.0)
    logp = old + math.log(1.01)
    seq = sequence_ratio(logp, old, jnp.ones_like(old))
    np.testing.assert_allclose(seq, [1.01], rtol=1e-5)
    assert 1.01**1000 > 2e4


def test_gspo_full_vs_token_gradients():
    mask = jnp.array([[1, 1, 1, 0]])
    logp, old = LOGP[:1], jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]]))
    # token ratios (1, 0.5, 1): s = 0.5 ** (1/3) = 0.793701
    s = 0.5 ** (1 / 3)
    full = lambda a: jnp.broadcast_to(sequence_ratio(a, old, mask)[:, None], (1, 4))
    tok = lambda a: sequence_ratio_token(a, old, mask)
    # Forward: GSPO-token's value is the sequence value at every valid token.
    np.testing.assert_allclose(tok(logp)[0, :3], [s, s, s], rtol=1e-6)
    # Jacobian d ratio[t] / d logp[t'] at valid t, t': full GSPO spreads s / 3 over all t';
    # GSPO-token is diagonal with s on the diagonal.
    j_full = jax.jacobian(full)(logp)[0, :3, 0, :3]
    j_tok = jax.jacobian(tok)(logp)[0, :3, 0, :3]
    np.testing.assert_allclose(j_full, np.full((3, 3), s / 3), rtol=1e-5)
    np.testing.assert_allclose(j_tok, np.eye(3) * s, rtol=1e-5)
    # Masked position gets no gradient in either form.
    assert np.all(np.asarray(jax.jacobian(tok)(logp)[0, :, 0, 3]) == 0.0)
    assert np.all(np.asarray(jax.jacobian(full)(logp)[0, :, 0, 3]) == 0.0)


def test_empty_mask_sequence_ratio_is_one():
    seq = sequence_ratio(LOGP, OLD, jnp.zeros_like(MASK))
    assert np.all(np.asarray(seq) == 1.0)

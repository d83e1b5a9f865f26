"""Tests for jrl.losses.cross_entropy: hand values, logits vs logprobs, masking."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jrl.losses import cross_entropy, token_entropy, token_logp

# Two positions over a vocabulary of 2. Position 0: logits (0, ln 3) -> p = (0.25, 0.75).
# Position 1: logits (0, 0) -> p = (0.5, 0.5). Position 2 is padding.
LOGITS = jnp.array([[[0.0, math.log(3.0)], [0.0, 0.0], [0.0, 0.0]]])
TARGETS = jnp.array([[1, 0, -1]])  # -1: padding id, never gathered
MASK = jnp.array([[1, 1, 0]])


def test_hand_value(maybe_jit, dtype, tol):
    out = maybe_jit(lambda x: cross_entropy(x, TARGETS, MASK))(LOGITS.astype(dtype))
    # nll = (-ln 0.75, -ln 0.5) = (0.287682, 0.693147); token mean = 0.490415
    np.testing.assert_allclose(out.token_nll[0], [-math.log(0.75), math.log(2.0), 0.0], **tol)
    np.testing.assert_allclose(out.loss, (-math.log(0.75) + math.log(2.0)) / 2, **tol)


def test_logprobs_give_the_same_loss():
    logp = jax.nn.log_softmax(LOGITS, axis=-1)
    np.testing.assert_allclose(cross_entropy(logp, TARGETS, MASK).loss, cross_entropy(LOGITS, TARGETS, MASK).loss, rtol=1e-6)


def test_gradient_and_masked_garbage():
    fn = lambda x: cross_entropy(x, TARGETS, MASK).loss
    grad = jax.grad(fn)(LOGITS)
    # d/dlogits of -log softmax_y / 2 = (p - onehot) / 2: position 0: (0.25, -0.25) / 2.
    np.testing.assert_allclose(grad[0, 0], [0.125, -0.125], rtol=1e-6)
    np.testing.assert_allclose(grad[0, 1], [-0.25, 0.25], rtol=1e-6)
    dirty = LOGITS.at[0, 2].set(1e4)
    np.testing.assert_allclose(fn(dirty), fn(LOGITS), rtol=1e-6)
    np.testing.assert_array_equal(jax.grad(fn)(dirty), grad)


def test_token_logp_and_entropy(maybe_jit, dtype, tol):
    logits = LOGITS.astype(dtype)
    logp = maybe_jit(lambda x: token_logp(x, TARGETS, MASK))(logits)
    np.testing.assert_allclose(logp[0, :2], [math.log(0.75), math.log(0.5)], **tol)
    # H(0.25, 0.75) = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335; H(0.5, 0.5) = ln 2
    entropy = maybe_jit(token_entropy)(logits)
    assert entropy.dtype == jnp.float32
    np.testing.assert_allclose(entropy[0, :2], [0.562335, math.log(2.0)], **tol)

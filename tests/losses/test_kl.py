"""Tests for jrl.losses.kl: k1 / k2 / k3 by hand, gradients, clamping, masking."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import KL_KINDS, kl_estimate

# p_theta = 0.5, p_ref = 0.25 at token 0; p_theta = 0.25, p_ref = 0.5 at token 1; equal at 2.
LOGP = jnp.log(jnp.array([[0.5, 0.25, 0.3]]))
REF = jnp.log(jnp.array([[0.25, 0.5, 0.3]]))
L2 = math.log(2.0)  # 0.693147


def test_hand_values(maybe_jit, dtype, tol):
    # log_r = log(p_ref / p_theta) = (-ln 2, +ln 2, 0)
    expected = {
        "k1": [L2, -L2, 0.0],  # -log_r
        "k2": [0.5 * L2**2, 0.5 * L2**2, 0.0],  # 0.240227
        # exp(log_r) - log_r - 1: 0.5 + 0.693147 - 1 = 0.193147; 2 - 0.693147 - 1 = 0.306853
        "k3": [0.5 + L2 - 1.0, 2.0 - L2 - 1.0, 0.0],
        "abs": [L2, L2, 0.0],  # |log_r|
    }
    for kind, values in expected.items():
        out = maybe_jit(lambda a, b: kl_estimate(a, b, kind))(LOGP.astype(dtype), REF.astype(dtype))
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out[0], values, **tol)


def test_gradients_flow_into_logp_only():
    for kind in KL_KINDS:
        d_logp, d_ref = jax.grad(lambda a, b: jnp.sum(kl_estimate(a, b, kind)), argnums=(0, 1))(LOGP, REF)
        assert np.all(np.asarray(d_ref) == 0.0)
        # d k1 / d logp = 1; d k2 / d logp = -log_r; d k3 / d logp = 1 - exp(log_r)
        log_r = np.asarray(REF - LOGP)
        expected = {"k1": np.ones_like(log_r), "k2": -log_r, "k3": 1.0 - np.exp(log_r),
                    # d|log_r| / d logp = -sign(log_r); at log_r = 0 JAX takes the +1 side.
                    "abs": -np.where(log_r >= 0, 1.0, -1.0)}[kind]
        np.testing.assert_allclose(d_logp, expected, rtol=1e-5, atol=1e-7)


def test_k3_clamp_option():
    logp, ref = jnp.array([[-100.0]]), jnp.array([[0.0]])
    # log_r = 100, clamped to 20 inside exp: exp(20) - 100 - 1 = 4.85e8; finite.
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), math.exp(20.0) - 101.0, rtol=1e-5)
    # clamp=10 (verl's low_var_kl) bounds the estimate itself.
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3", clamp=10.0), 10.0)
    # Unclamped exp overflows: that is what the default log-ratio clamp prevents.
    assert np.isinf(np.asarray(kl_estimate(logp, ref, "k3", log_ratio_clip=None)))


def test_masked_garbage(garbage):
    mask = jnp.array([[1, 0, 1]])
    for kind in KL_KINDS:
        fn = lambda a: jnp.sum(kl_estimate(a, REF, kind, mask=mask, log_ratio_clip=None))
        clean = jax.value_and_grad(fn)(LOGP)
        # +1e4 and -1e4 (the latter would overflow exp in k3 if it leaked).
        for dirty_logp in (garbage(LOGP, mask), -garbage(-LOGP, mask)):
            dirty = jax.value_and_grad(fn)(dirty_logp)
            np.testing.assert_allclose(clean[0], dirty[0], rtol=1e-6)
            np.testing.assert_allclose(clean[1], dirty[1], rtol=1e-6)


def test_bad_kind():
    with pytest.raises(ValueError, match=r"kind='k4' .*'k1', 'k2', 'k3', 'abs'"):
        kl_estimate(LOGP, REF, "k4")


@pytest.mark.parametrize("kind", ["k1", "k3", "abs"])
def test_straight_through_has_the_value_of_the_estimator_and_the_gradient_of_k2(kind):
    value = kl_estimate(LOGP, REF, kind, straight_through=True)
    np.testing.assert_allclose(value, kl_estimate(LOGP, REF, kind), rtol=1e-6)
    grad = jax.grad(lambda a: jnp.sum(kl_estimate(a, REF, kind, straight_through=True)))(LOGP)
    # d k2 / d logp = -log_r = (ln 2, -ln 2, 0) here.
    np.testing.assert_allclose(grad[0], [L2, -L2, 0.0], rtol=1e-5, atol=1e-7)

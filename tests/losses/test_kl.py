"""Tests for jrl.losses.kl: k1 / k2 / k3 by hand, gradients, clamping, masking, and the
importance-weighted (DeepSeek-V3.2 / slime "unbiased") KL."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import KL_KINDS, importance_weighted_kl, kl_estimate

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


# Importance-weighted KL. Tokens sampled by pi_old; rho = pi_theta / pi_old = (2, 2, 0.5).
#   p_theta = (0.5, 0.25, 0.3), p_ref = (0.25, 0.5, 0.6), p_old = (0.25, 0.125, 0.6)
#   log_r = log(p_ref / p_theta) = (-ln 2, +ln 2, +ln 2)
#   k3 = exp(log_r) - log_r - 1 = (0.193147, 0.306853, 0.306853)
IW_REF = jnp.log(jnp.array([[0.25, 0.5, 0.6]]))
IW_OLD = jnp.log(jnp.array([[0.25, 0.125, 0.6]]))
RHO = np.array([2.0, 2.0, 0.5])


def test_importance_weighted_hand_values(maybe_jit, dtype, tol):
    # rho * k3 = (2 * 0.193147, 2 * 0.306853, 0.5 * 0.306853) = (0.386294, 0.613706, 0.153426)
    fn = maybe_jit(lambda a, b, c: importance_weighted_kl(a, b, c, "k3"))
    out = fn(LOGP.astype(dtype), IW_REF.astype(dtype), IW_OLD.astype(dtype))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out[0], [2 * (L2 - 0.5), 2 * (1 - L2), 0.5 * (1 - L2)], **tol)
    # Other kinds: the same weight on kl_estimate's value, e.g. rho * k1 = (2 ln 2, -2 ln 2,
    # -0.5 ln 2) = (1.386294, -1.386294, -0.346574).
    k1 = maybe_jit(lambda a, b, c: importance_weighted_kl(a, b, c, "k1"))(LOGP, IW_REF, IW_OLD)
    np.testing.assert_allclose(k1[0], [2 * L2, -2 * L2, -0.5 * L2], rtol=1e-5)
    for kind in KL_KINDS:
        out = importance_weighted_kl(LOGP, IW_REF, IW_OLD, kind)
        np.testing.assert_allclose(out[0], RHO * kl_estimate(LOGP, IW_REF, kind)[0], rtol=1e-5)


def test_importance_weighted_gradient_reaches_logp_through_rho_and_k3(maybe_jit):
    grads = maybe_jit(jax.grad(lambda a, b, c: jnp.sum(importance_weighted_kl(a, b, c)),
                               argnums=(0, 1, 2)))(LOGP, IW_REF, IW_OLD)
    d_logp, d_ref, d_old = (np.asarray(g) for g in grads)
    # rho carries gradient (as in slime): d(rho k3)/d logp = rho k3 + rho (1 - exp(log_r))
    #   = rho (-log_r) = rho (logp - ref_logp) = (2 ln 2, -2 ln 2, -0.5 ln 2)
    #   = (1.386294, -1.386294, -0.346574). A stop-gradient rho would give rho (1 - exp(log_r))
    #   = (1.0, -2.0, -0.5) instead.
    np.testing.assert_allclose(d_logp[0], [2 * L2, -2 * L2, -0.5 * L2], rtol=1e-5)
    assert np.all(d_ref == 0.0) and np.all(d_old == 0.0)
    # k1: d(rho k1)/d logp = rho (k1 + 1) = (2 (ln 2 + 1), 2 (1 - ln 2), 0.5 (1 - ln 2))
    d_k1 = jax.grad(lambda a: jnp.sum(importance_weighted_kl(a, IW_REF, IW_OLD, "k1")))(LOGP)
    np.testing.assert_allclose(d_k1[0], [2 * (L2 + 1), 2 * (1 - L2), 0.5 * (1 - L2)], rtol=1e-5)


@pytest.mark.parametrize("kind", KL_KINDS)
def test_importance_weighted_equals_plain_estimate_on_policy(kind, maybe_jit):
    # pi_theta == pi_old: rho is exactly 1, so the value is kl_estimate's, bit for bit.
    fn = maybe_jit(lambda a, b: importance_weighted_kl(a, b, a, kind))
    np.testing.assert_array_equal(fn(LOGP, IW_REF), kl_estimate(LOGP, IW_REF, kind))
    if kind == "k3":
        # Its gradient there is k2's (logp - ref_logp = (ln 2, -ln 2, -ln 2)), the same as
        # straight-through k3's, and not plain k3's (1 - exp(log_r) = (0.5, -1, -1)).
        old = jax.lax.stop_gradient(LOGP)
        grad = jax.grad(lambda a: jnp.sum(importance_weighted_kl(a, IW_REF, old)))(LOGP)
        np.testing.assert_allclose(grad[0], [L2, -L2, -L2], rtol=1e-5)
        straight = jax.grad(lambda a: jnp.sum(kl_estimate(a, IW_REF, "k3",
                                                          straight_through=True)))(LOGP)
        np.testing.assert_allclose(grad, straight, rtol=1e-6)


def test_importance_weighted_clamps_after_weighting():
    # p_theta = 0.25, p_ref = 0.5: k3 = 2 - ln 2 - 1 = 0.306853 (well under 10);
    # p_old = 0.25 * e^-5: rho = e^5 = 148.413159; rho * k3 = 45.540793.
    logp, ref = jnp.log(jnp.array([[0.25]])), jnp.log(jnp.array([[0.5]]))
    old = logp - 5.0
    np.testing.assert_allclose(importance_weighted_kl(logp, ref, old), math.exp(5) * (1 - L2),
                               rtol=1e-5)
    # slime's order (low_var_kl): weight first, then clamp to [-10, 10] -> 10, not 45.54.
    np.testing.assert_allclose(importance_weighted_kl(logp, ref, old, clamp=10.0), 10.0)
    # Beyond the clamp the gradient is 0 (jnp.clip), as for kl_estimate's clamp.
    grad = jax.grad(lambda a: jnp.sum(importance_weighted_kl(a, ref, old, clamp=10.0)))(logp)
    assert float(grad[0, 0]) == 0.0


def test_importance_weighted_masked_garbage(garbage):
    mask = jnp.array([[1, 0, 1]])
    for kind in KL_KINDS:
        fn = lambda a, c: jnp.sum(importance_weighted_kl(a, IW_REF, c, kind, mask=mask,
                                                          log_ratio_clip=None))
        clean = jax.value_and_grad(fn)(LOGP, IW_OLD)
        # Garbage in logp or in old_logp at the masked token never reaches value or gradient.
        dirty_inputs = ((garbage(LOGP, mask), IW_OLD), (-garbage(-LOGP, mask), IW_OLD),
                        (LOGP, garbage(IW_OLD, mask)), (LOGP, -garbage(-IW_OLD, mask)))
        for dirty_logp, dirty_old in dirty_inputs:
            dirty = jax.value_and_grad(fn)(dirty_logp, dirty_old)
            np.testing.assert_allclose(clean[0], dirty[0], rtol=1e-6)
            np.testing.assert_allclose(clean[1], dirty[1], rtol=1e-6)


def test_importance_weighted_bad_arguments():
    with pytest.raises(ValueError, match=r"importance_weighted_kl: kind='k4' .*'k1', 'k2', 'k3'"):
        importance_weighted_kl(LOGP, IW_REF, IW_OLD, "k4")
    with pytest.raises(ValueError, match=r"importance_weighted_kl: clamp=0.0 .*> 0"):
        importance_weighted_kl(LOGP, IW_REF, IW_OLD, clamp=0.0)
    with pytest.raises(AssertionError):
        importance_weighted_kl(LOGP, IW_REF, IW_OLD[:, :2])


def test_importance_weighted_is_unbiased_under_pi_old_in_value_and_gradient():
    # Exact expectation over a 4-token vocabulary (no sampling): E_old[f] = sum_x p_old(x) f(x).
    # With logp = log_softmax(theta), E_old[rho * k3] must equal KL(pi_theta || pi_ref), and its
    # gradient in theta the gradient of that KL (only because rho carries gradient).
    theta = jnp.array([[0.3, -0.2, 1.0, 0.0]])
    ref = jax.nn.log_softmax(jnp.array([[0.0, 0.5, 0.2, -0.4]]))
    old = jax.nn.log_softmax(jnp.array([[-0.5, 0.4, 0.6, 0.3]]))
    p_old = jnp.exp(old)

    def expected(estimator):
        return lambda th: jnp.sum(p_old * estimator(jax.nn.log_softmax(th)))

    def exact_kl(th):
        logp = jax.nn.log_softmax(th)
        return jnp.sum(jnp.exp(logp) * (logp - ref))

    weighted = expected(lambda logp: importance_weighted_kl(logp, ref, old))
    np.testing.assert_allclose(weighted(theta), exact_kl(theta), rtol=1e-5)
    np.testing.assert_allclose(jax.grad(weighted)(theta), jax.grad(exact_kl)(theta), atol=1e-6)
    # Plain k3 on the same pi_old samples is biased (here by more than 10%).
    plain = expected(lambda logp: kl_estimate(logp, ref, "k3"))
    assert abs(float(plain(theta)) / float(exact_kl(theta)) - 1.0) > 0.1

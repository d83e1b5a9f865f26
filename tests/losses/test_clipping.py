"""Tests for jrl.losses.clipping: the seed's clipping table, clip-higher, dual-clip, CISPO and
the train/inference mismatch example."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import cispo_objective, clipped_objective, token_ratio


def objective_and_grad(ratio, adv, **kw):
    """Per-token objective and d objective / d ratio (tokens are independent, so grad of sum)."""
    fn = lambda r: clipped_objective(r, adv, **kw).objective
    return fn(ratio), jax.grad(lambda r: jnp.sum(fn(r)))(ratio)


def test_seed_clipping_table(maybe_jit, dtype, tol):
    # eps 0.2 -> trust region [0.8, 1.2]. The four rows of the seed's table:
    #   A=+1, r=1.3: moved too far in the good direction -> clipped: 1.2 * 1 = 1.2, no gradient
    #   A=+1, r=0.7: probability fell by mistake -> keep r A = 0.7 (min(0.7, 0.8)), gradient A = 1
    #   A=-1, r=0.7: already pushed down enough -> clipped: min(-0.7, -0.8) = -0.8, no gradient
    #   A=-1, r=1.3: bad token got likelier -> keep r A = -1.3 (min(-1.3, -1.2)), gradient A = -1
    ratio = jnp.array([1.3, 0.7, 0.7, 1.3], dtype)
    adv = jnp.array([1.0, 1.0, -1.0, -1.0], dtype)
    fn = maybe_jit(lambda r, a: clipped_objective(r, a, eps_low=0.2, eps_high=0.2))
    out = fn(ratio, adv)
    np.testing.assert_allclose(out.objective, [1.2, 0.7, -0.8, -1.3], **tol)
    np.testing.assert_array_equal(out.clipped_high, [True, False, False, False])
    np.testing.assert_array_equal(out.clipped_low, [False, False, True, False])
    grad = maybe_jit(jax.grad(lambda r, a: jnp.sum(clipped_objective(r, a, eps_low=0.2, eps_high=0.2).objective)))(ratio, adv)
    np.testing.assert_allclose(grad, [0.0, 1.0, 0.0, -1.0], **tol)


def test_gradient_through_logp():
    # Same table, differentiating w.r.t. logp with r = exp(logp - old): d obj / d logp = r A
    # where the gradient survives: 0.7 * 1 = 0.7 and 1.3 * (-1) = -1.3.
    old = jnp.zeros(4)
    logp = jnp.log(jnp.array([1.3, 0.7, 0.7, 1.3]))
    adv = jnp.array([1.0, 1.0, -1.0, -1.0])
    fn = lambda lp: jnp.sum(clipped_objective(token_ratio(lp, old), adv, eps_low=0.2, eps_high=0.2).objective)
    np.testing.assert_allclose(jax.grad(fn)(logp), [0.0, 0.7, 0.0, -1.3], rtol=1e-5)


def test_clip_higher():
    # eps_low 0.2, eps_high 0.28: A=+1, r=1.25 is inside [0.8, 1.28] -> objective 1.25, gradient 1
    # (symmetric PPO at 1.2 would already have clipped it: gradient 0).
    # A=-1, r=0.5 is below 0.8 under both -> objective -0.8, gradient 0.
    ratio, adv = jnp.array([1.25, 0.5]), jnp.array([1.0, -1.0])
    obj, grad = objective_and_grad(ratio, adv, eps_low=0.2, eps_high=0.28)
    np.testing.assert_allclose(obj, [1.25, -0.8], rtol=1e-6)
    np.testing.assert_allclose(grad, [1.0, 0.0])
    obj, grad = objective_and_grad(ratio, adv, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(obj, [1.2, -0.8], rtol=1e-6)
    np.testing.assert_allclose(grad, [0.0, 0.0])
    out = clipped_objective(ratio, adv, eps_low=0.2, eps_high=0.28)
    np.testing.assert_array_equal(out.clipped_high, [False, False])
    np.testing.assert_array_equal(out.clipped_low, [False, True])


def test_dual_clip():
    # c = 3, A = -1: r = 5 -> plain PPO gives min(-5, -1.2) = -5 (unbounded, gradient -1);
    # dual-clip gives max(-5, 3 * -1) = -3, no gradient. r = 2 -> -2 either way, gradient -1.
    # A = +1 is untouched by dual-clip: r = 5 -> 1.2.
    ratio, adv = jnp.array([5.0, 2.0, 5.0]), jnp.array([-1.0, -1.0, 1.0])
    obj, grad = objective_and_grad(ratio, adv, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    np.testing.assert_allclose(obj, [-3.0, -2.0, 1.2], rtol=1e-6)
    np.testing.assert_allclose(grad, [0.0, -1.0, 0.0])
    out = clipped_objective(ratio, adv, eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    np.testing.assert_array_equal(out.dual_clipped, [True, False, False])
    obj, _ = objective_and_grad(ratio, adv, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(obj, [-5.0, -2.0, 1.2], rtol=1e-6)


def test_advantages_broadcast_and_stop_gradient():
    ratio = jnp.array([[1.0, 1.1], [0.9, 1.0]])
    adv = jnp.array([2.0, -1.0])
    out = clipped_objective(ratio, adv, eps_low=0.2, eps_high=0.2)
    np.testing.assert_allclose(out.objective, [[2.0, 2.2], [-0.9, -1.0]], rtol=1e-6)
    d_adv = jax.grad(lambda a: jnp.sum(clipped_objective(ratio, a, eps_low=0.2, eps_high=0.2).objective))(adv)
    assert np.all(np.asarray(d_adv) == 0.0)


def test_seed_mismatch_example():
    # Sync RL at step 0, so p_c = p_o. Sampler p_b = (0.4, 0.6), trainer p_o = (0.6, 0.4),
    # A = (+1, -1), eps 0.2.
    p_b, p_o = jnp.log(jnp.array([[0.4, 0.6]])), jnp.log(jnp.array([[0.6, 0.4]]))
    adv = jnp.array([[1.0, -1.0]])

    def objective(logp, denom):
        r = token_ratio(logp, denom)
        return jnp.sum(clipped_objective(r, adv, eps_low=0.2, eps_high=0.2).objective), r

    # Denominator p_b: r = 0.6 / 0.4 = 1.5 -> min(1.5, 1.2) = 1.2 (clipped);
    # r = 0.4 / 0.6 = 0.667 -> min(-0.667, -0.8) = -0.8 (clipped). Both lose their gradient.
    (value, r), grad = jax.value_and_grad(objective, has_aux=True)(p_o, p_b)
    np.testing.assert_allclose(r, [[1.5, 2 / 3]], rtol=1e-6)
    np.testing.assert_allclose(value, 1.2 - 0.8, rtol=1e-6)
    np.testing.assert_array_equal(grad, [[0.0, 0.0]])
    # Denominator p_o: r = 1 exactly, nothing is clipped, d objective / d logp = A.
    (value, r), grad = jax.value_and_grad(objective, has_aux=True)(p_o, p_o)
    np.testing.assert_array_equal(r, [[1.0, 1.0]])
    np.testing.assert_allclose(grad, [[1.0, -1.0]])
    # The seed's async variant: p_c = 0.66: r_num = 1.5, r_stale = 1.1, r_total = 1.65.
    np.testing.assert_allclose(token_ratio(jnp.log(0.66), jnp.log(0.40)), 1.65, rtol=1e-5)
    np.testing.assert_allclose(token_ratio(jnp.log(0.66), jnp.log(0.60)), 1.1, rtol=1e-5)


def test_cispo_keeps_every_gradient(maybe_jit, dtype, tol):
    # Weight = clip(r, 0.8, 1.28) (eps 0.2 / 0.28) as stop-gradient; objective w A logp.
    # r = (1.5, 0.5, 1.0), A = (+1, -1, +1), logp = (-1, -2, -0.5):
    #   w = (1.28, 0.8, 1.0); objective = (1.28 * -1, 0.8 * -1 * -2, 1 * -0.5) = (-1.28, 1.6, -0.5)
    #   d objective / d logp = w A = (1.28, -0.8, 1.0): never zero, unlike PPO.
    ratio = jnp.array([1.5, 0.5, 1.0], dtype)
    adv = jnp.array([1.0, -1.0, 1.0], dtype)
    logp = jnp.array([-1.0, -2.0, -0.5], dtype)
    fn = lambda r, a, lp: cispo_objective(r, a, lp, eps_low=0.2, eps_high=0.28)
    out = maybe_jit(fn)(ratio, adv, logp)
    np.testing.assert_allclose(out.objective, [-1.28, 1.6, -0.5], **tol)
    np.testing.assert_array_equal(out.clipped_high, [True, False, False])
    np.testing.assert_array_equal(out.clipped_low, [False, True, False])
    d_r, d_logp = maybe_jit(jax.grad(lambda r, lp: jnp.sum(fn(r, adv, lp).objective), argnums=(0, 1)))(ratio, logp)
    np.testing.assert_allclose(d_logp, [1.28, -0.8, 1.0], **tol)
    assert np.all(np.asarray(d_r, np.float32) == 0.0)  # the weight is stop-gradient


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="dual_clip=0.5 .*> 1"):
        clipped_objective(jnp.ones(2), jnp.ones(2), eps_low=0.2, eps_high=0.2, dual_clip=0.5)
    with pytest.raises(ValueError, match="eps_low=-0.1"):
        clipped_objective(jnp.ones(2), jnp.ones(2), eps_low=-0.1, eps_high=0.2)
    with pytest.raises(ValueError, match="eps_high"):
        cispo_objective(jnp.ones(2), jnp.ones(2), jnp.ones(2), eps_low=1.0, eps_high=-1.0)


def test_advantage_shape_is_checked():
    with pytest.raises(AssertionError):
        clipped_objective(jnp.ones((2, 3)), jnp.ones(3), eps_low=0.2, eps_high=0.2)

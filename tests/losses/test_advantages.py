"""Tests for jrl.losses.advantages, on the seed article's worked numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import group_advantages

G = 8


def binary_group(num_correct, size=G):
    return [1.0] * num_correct + [0.0] * (size - num_correct)


def test_seed_table_population_std(maybe_jit, dtype):
    # Three groups of 8: 2, 1 and 4 correct answers.
    rewards = jnp.array(binary_group(2) + binary_group(1) + binary_group(4), dtype)
    adv = maybe_jit(lambda r: group_advantages(r, G))(rewards)
    assert adv.dtype == jnp.float32 and adv.shape == (24,)
    # 2/8: mean 0.25, std sqrt(0.25 * 0.75) = 0.4330; +0.75 / 0.4330 = +1.732, -0.25 / 0.4330 = -0.577
    np.testing.assert_allclose(adv[:2], 1.732, atol=1e-3)
    np.testing.assert_allclose(adv[2:8], -0.577, atol=1e-3)
    # 1/8: mean 1/8, std sqrt(7)/8; +0.875 / 0.3307 = +sqrt(7) = +2.646, -0.125 / 0.3307 = -0.378
    np.testing.assert_allclose(adv[8], 2.646, atol=1e-3)
    np.testing.assert_allclose(adv[9:16], -0.378, atol=1e-3)
    # 4/8: mean 0.5, std 0.5: +-1 (0.999998 with eps 1e-6)
    np.testing.assert_allclose(adv[16:20], 1.0, atol=1e-5)
    np.testing.assert_allclose(adv[20:24], -1.0, atol=1e-5)


def test_exact_values_without_eps():
    rewards = jnp.array(binary_group(1))
    adv = group_advantages(rewards, G, eps=0.0)
    # 1/8 correct: A+ = (7/8) / (sqrt(7)/8) = sqrt(7); A- = -(1/8) / (sqrt(7)/8) = -1/sqrt(7)
    np.testing.assert_allclose(adv[0], math.sqrt(7), rtol=1e-6)
    np.testing.assert_allclose(adv[1:], -1 / math.sqrt(7), rtol=1e-6)


def test_unbiased_std(maybe_jit):
    rewards = jnp.array(binary_group(2))
    adv = maybe_jit(lambda r: group_advantages(r, G, unbiased=True))(rewards)
    # sample std = sqrt(sum (R - 0.25)^2 / 7) = sqrt((2 * 0.5625 + 6 * 0.0625) / 7)
    #            = sqrt(1.5 / 7) = 0.46291; +0.75 / 0.46291 = 1.62019, -0.25 / 0.46291 = -0.54006
    np.testing.assert_allclose(adv[:2], 1.62019, atol=1e-4)
    np.testing.assert_allclose(adv[2:], -0.54006, atol=1e-4)
    # Unbiased std is larger by sqrt(G / (G - 1)), so advantages are smaller by that factor.
    pop = group_advantages(rewards, G, eps=0.0)
    unb = group_advantages(rewards, G, eps=0.0, unbiased=True)
    np.testing.assert_allclose(pop / unb, math.sqrt(8 / 7), rtol=1e-6)


@pytest.mark.parametrize("num_correct", [1, 2, 4, 7])
def test_sum_of_squares_grpo_vs_dr_grpo(num_correct):
    rewards = jnp.array(binary_group(num_correct))
    p = num_correct / G
    # With the population std (eps 0): sum A^2 = G * var / var = G, whatever p.
    grpo = group_advantages(rewards, G, eps=0.0)
    np.testing.assert_allclose(jnp.sum(grpo**2), G, rtol=1e-5)
    # Dr.GRPO (std_power 0): sum (R - p)^2 = G p (1 - p): 1/8 -> 0.875, 4/8 -> 2.
    dr = group_advantages(rewards, G, std_power=0.0)
    np.testing.assert_allclose(jnp.sum(dr**2), G * p * (1 - p), rtol=1e-5)


def test_std_power_spectrum():
    rewards = jnp.array(binary_group(1))
    # alpha = 0.5: A+ = (7/8) / (sqrt(7)/8) ** 0.5 = 0.875 / 0.57509 = 1.52151
    adv = group_advantages(rewards, G, std_power=0.5, eps=0.0)
    np.testing.assert_allclose(adv[0], 0.875 / (math.sqrt(7) / 8) ** 0.5, rtol=1e-6)


def test_constant_groups_are_exactly_zero(maybe_jit, dtype):
    # 0.1 is not exact in binary: a mean of eight 0.1 could round; the result must still be 0.
    rewards = jnp.array([0.1] * 4 + [1.0] * 4 + [0.0] * 4, dtype)
    for unbiased in (False, True):
        adv = maybe_jit(lambda r: group_advantages(r, 4, unbiased=unbiased))(rewards)
        assert np.all(np.asarray(adv) == 0.0)


def test_group_of_one_population():
    adv = group_advantages(jnp.array([3.0, -1.0]), 1)
    assert np.all(np.asarray(adv) == 0.0)


def test_no_gradient_into_rewards():
    grad = jax.grad(lambda r: jnp.sum(group_advantages(r, 4)))(jnp.array([1.0, 0.0, 0.0, 1.0]))
    assert np.all(np.asarray(grad) == 0.0)


def test_bad_group_size_names_field():
    with pytest.raises(ValueError, match=r"group_size=3 .*B=8.*\[1, 2, 4, 8\]"):
        group_advantages(jnp.zeros(8), 3)
    with pytest.raises(ValueError, match="group_size=0"):
        group_advantages(jnp.zeros(8), 0)
    with pytest.raises(ValueError, match="group_size=1 .*unbiased"):
        group_advantages(jnp.zeros(8), 1, unbiased=True)
    with pytest.raises(ValueError, match="std_power"):
        group_advantages(jnp.zeros(8), 4, std_power=-1.0)

"""jrl.losses.recipes: each algorithm is advantages + loss chain + shaping, checked against its
paper, and the registry / factory a config names."""

import jax.numpy as jnp
import numpy as np
import pytest

from jrl import losses
from jrl.losses import recipes
from jrl.losses.transforms import Aggregate, KLPenalty, PPOClip, SequenceRatio

# One correct answer of 8 (the seed article's setting): mean 1/8.
REWARDS = jnp.array([1.0, 0, 0, 0, 0, 0, 0, 0])


def _transform(chain, kind):
    found = [t for t in chain.transforms if isinstance(t, kind)]
    assert len(found) == 1, (kind, chain)
    return found[0]


def test_dr_grpo_centres_its_advantages_and_grpo_normalises_them():
    # Dr.GRPO: A = R - mean: 1 - 1/8 = 0.875 and -0.125.
    dr = recipes.dr_grpo(max_len=64)
    np.testing.assert_allclose(dr.advantages(REWARDS, 8), [0.875] + [-0.125] * 7, rtol=1e-6)
    # GRPO: population std sqrt(1/8 * 7/8) = 0.330719: 0.875 / 0.330719 = 2.645751,
    # -0.125 / 0.330719 = -0.377964 (eps 1e-6 moves the 7th digit).
    grpo = recipes.grpo()
    np.testing.assert_allclose(grpo.advantages(REWARDS, 8), [2.645751] + [-0.377964] * 7,
                               rtol=1e-5)


def test_each_recipe_matches_its_paper():
    """Advantages, reduction, clip range, KL and shaping as each paper states them."""
    grpo = recipes.grpo(kl_beta=0.04)     # DeepSeekMath: eps 0.2, k3 KL 0.04 in the seq mean
    assert grpo.advantages.std_power == 1.0
    assert _transform(grpo.loss, Aggregate).mode == "seq_mean_token_mean"
    assert (_transform(grpo.loss, PPOClip).eps_low, _transform(grpo.loss, PPOClip).eps_high) == \
        (0.2, 0.2)
    kl = _transform(grpo.loss, KLPenalty)
    assert (kl.beta, kl.kind, kl.mode) == (0.04, "k3", "seq_mean_token_mean")
    assert grpo.shaping == losses.RewardShaping()

    dapo = recipes.dapo()    # DAPO: clip-higher 0.2 / 0.28, token mean, no KL, both shapings
    assert dapo.advantages.std_power == 1.0
    assert _transform(dapo.loss, Aggregate).mode == "token_mean"
    clip = _transform(dapo.loss, PPOClip)
    assert (clip.eps_low, clip.eps_high) == (0.2, 0.28)
    assert not [t for t in dapo.loss.transforms if isinstance(t, KLPenalty)]
    assert dapo.shaping.dynamic_sampling
    assert dapo.shaping.overlong_buffer_len(max_len=20480) == 4096   # the paper's L_cache

    dr = recipes.dr_grpo(max_len=512)     # Dr.GRPO: centred advantages, sum / (S * max_len)
    assert dr.advantages.std_power == 0.0
    agg = _transform(dr.loss, Aggregate)
    assert (agg.mode, agg.max_len) == ("constant", 512)
    assert dr.shaping == losses.RewardShaping()

    gspo = recipes.gspo()                 # GSPO: sequence ratio, clip 3e-4 / 4e-4
    assert gspo.advantages.std_power == 1.0 and _transform(gspo.loss, SequenceRatio)
    assert _transform(gspo.loss, PPOClip).eps_high == 4e-4

    cispo = recipes.cispo()               # CISPO: token mean over the clipped-IS objective
    assert cispo.advantages.std_power == 1.0
    assert _transform(cispo.loss, Aggregate).mode == "token_mean"


def test_the_recipe_prints_the_whole_algorithm():
    text = repr(recipes.dr_grpo(max_len=512))
    assert text.startswith("Recipe(dr_grpo [arXiv:2503.20783]: advantages=GroupAdvantages("
                           "std_power=0.0, unbiased=False, eps=1e-06), loss=")
    assert "Aggregate(mode='constant', max_len=512)" in text
    assert "shaping=RewardShaping(dynamic_sampling=False" in text


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_every_recipe_can_carry_a_kl_term_in_its_own_reduction(name):
    recipe = recipes.recipe(name, max_len=16, kl_beta=0.01)
    kl = _transform(recipe.loss, KLPenalty)
    assert kl.beta == 0.01 and kl.mode == _transform(recipe.loss, Aggregate).mode
    B, T = 4, 6
    logp = -jnp.linspace(0.5, 2.0, B * T).reshape(B, T)
    inputs = losses.LossInputs(logp=logp, old_logp=logp, behavior_logp=logp,
                               ref_logp=logp - 0.1, advantages=recipe.advantages(
                                   jnp.array([1.0, 0.0, 0.0, 1.0]), 4), mask=jnp.ones((B, T)))
    loss, metrics = recipe.loss(inputs)
    # k3 of log-ratio d = ref - logp = -0.1: exp(d) - d - 1 = 0.0048374 on every token.
    np.testing.assert_allclose(metrics["train/ref_kl"], 0.0048374, rtol=1e-4)
    assert np.isfinite(float(loss))


def test_registry_refuses_unknown_names_and_accepts_research_recipes():
    with pytest.raises(ValueError, match=r"recipe 'ppo': allowed are \['cispo', 'dapo'"):
        recipes.recipe("ppo")

    def half_std(*, max_len=None, **options):
        base = recipes.grpo(**options)
        return base.replace(name="half_std",
                            advantages=losses.GroupAdvantages(std_power=0.5))

    recipes.register_recipe("half_std_test", half_std)
    try:
        made = recipes.recipe("half_std_test")
        assert made.advantages.std_power == 0.5 and made.name == "half_std"
        with pytest.raises(ValueError, match="already registered"):
            recipes.register_recipe("half_std_test", half_std)
    finally:
        del recipes.RECIPES["half_std_test"]


def test_group_advantages_refuses_bad_values_at_construction():
    with pytest.raises(ValueError, match="std_power"):
        losses.GroupAdvantages(std_power=-1.0)
    with pytest.raises(ValueError, match="group_size >= 2"):
        losses.GroupAdvantages(unbiased=True).check_group_size(1)
    with pytest.raises(ValueError, match="overlong_buffer_frac"):
        losses.RewardShaping(overlong_buffer_frac=1.5)

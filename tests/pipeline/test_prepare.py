"""prepare_batch: a rollout -> a complete TrainBatch, checked against hand-computed values.

The scoring function is a stand-in for the train engine: params are plain floats and
score(params) gives that value as the logprob of every position, so which version scored which
token can be read off the result.
"""

import numpy as np
import pytest

from jrl.losses import GroupAdvantages
from jrl.pipeline import PrepareOptions, prepare_batch
from jrl.pipeline.config.tools import apply_overrides
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.sampling import Sample
from tests.pipeline.tiny import tiny_config


def sample(prompt_id, index, versions, behavior=-1.0):
    n = len(versions)
    return Sample(prompt_id=prompt_id, sample_index=index,
                  prompt_tokens=np.array([5, 6], np.int32),
                  tokens=np.arange(1, n + 1, dtype=np.int32),
                  behavior_logp=np.full((n,), behavior, np.float32),
                  logit_floor=np.full((n,), -np.inf, np.float32),
                  versions=np.asarray(versions, np.int32), entropy=None, finish_reason="stop")


def rollout(samples, rewards):
    return RolloutBatch(rl_step=4, samples=samples, examples=[],
                        rewards=np.asarray(rewards, np.float32), group_size=2, data_state={},
                        metrics={"rollout/reward_mean": float(np.mean(rewards))})


def score_with(packed):
    return lambda params: np.full(packed.tokens.shape, params, np.float32)


# GRPO's estimator (population std, std_power 1): the default the tests' figures assume.
GRPO_ADVANTAGES = GroupAdvantages()


def options(**kw):
    return PrepareOptions(rows=6, seq_len=6, **kw)


def test_complete_batch_with_versions_mismatch_and_advantages():
    # Group 0: two samples of version 3 (the trainer's). Group 1: one sample whose first two
    # tokens are version 2 (held), then version 3 after a swap (KV kept: not reproducible).
    samples = [sample(0, 0, [3, 3]), sample(0, 1, [3, 3, 3]),
               sample(1, 0, [2, 2, 3]), sample(1, 1, [3])]
    out = prepare_batch(rollout(samples, [1.0, 0.0, 1.0, 1.0]), trainer_version=3,
                        current_params=-1.0, held={2: -1.5, 3: -1.0}, score_with=score_with,
                        options=options(), advantages=GRPO_ADVANTAGES)
    batch, m = out.batch, out.metrics
    assert batch.tokens.shape == (6, 6) and batch.loss_mask.sum() == 2 + 3 + 3 + 1
    # Advantages: group 0 rewards (1, 0): mean 0.5, population std 0.5 -> (+1, -1); group 1 all
    # equal -> 0; padding rows 0.
    np.testing.assert_allclose(batch.advantages, [1, -1, 0, 0, 0, 0], atol=1e-5)
    # old_logp = p_b ("behavior"), no reference -> zeros.
    np.testing.assert_array_equal(batch.old_logp, batch.behavior_logp)
    assert not batch.ref_logp.any()
    # Staleness over the 9 response tokens: two tokens 3 - 2 = 1, the rest 0 -> mean 2/9, max 1.
    assert m["rollout/staleness_mean"] == pytest.approx(2 / 9)
    assert m["rollout/staleness_max"] == 1
    # Reproducible held tokens: all but the version-3 token after the swap in sample (1, 0):
    # 8 of 9. Numerical |p_o - p_b|: version-3 tokens |-1 - -1| = 0, version-2 tokens
    # |-1.5 - -1| = 0.5 -> mean (2 * 0.5) / 8 = 0.125, max 0.5. Staleness |current - p_o|:
    # 0 for version 3, |-1 - -1.5| = 0.5 for version 2 -> 0.125.
    assert m["mismatch/held_token_frac"] == pytest.approx(8 / 9)
    assert m["mismatch/kv_mixed_token_frac"] == pytest.approx(1 / 9)
    assert m["mismatch/numerical_abs"] == pytest.approx(0.125)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(0.5)
    assert m["mismatch/staleness_abs"] == pytest.approx(0.125)
    assert m["rollout/dropped_stale"] == 0 and m["rollout/reward_mean"] == 0.75
    assert out.consumed == {"rl_step": 4, "trainer_version": 3, "token_versions": [2, 3],
                            "staleness_max": 1}


def test_recompute_old_logp_reference_reward_and_stale_groups():
    samples = [sample(0, 0, [3, 3]), sample(0, 1, [3]), sample(1, 0, [1, 1]), sample(1, 1, [3])]
    out = prepare_batch(rollout(samples, [1.0, 0.0, 1.0, 0.0]), trainer_version=3,
                        current_params=-2.0, held={3: -2.0}, score_with=score_with,
                        options=options(drop_stale_beyond=1, old_logp="recompute",
                                        reference="reward", kl_reward_coef=0.5),
                        advantages=GRPO_ADVANTAGES,
                        reference=-1.25)
    batch, m = out.batch, out.metrics
    # Group 1 holds a token 3 - 1 = 2 versions old > 1: both its samples are dropped.
    assert m["rollout/dropped_stale"] == 2 and batch.loss_mask[:2].sum() == 3
    assert not batch.loss_mask[2:].any()
    # old_logp = current logprob on response tokens; ref_logp = the reference's.
    np.testing.assert_array_equal(batch.old_logp[batch.loss_mask], -2.0)
    np.testing.assert_array_equal(batch.ref_logp[batch.loss_mask], -1.25)
    # k1 per sequence = sum_t (p_b - p_ref) = 2 * (-1 + 1.25) = 0.5 and 1 * 0.25 = 0.25;
    # rewards 1 - 0.5 * 0.5 = 0.75 and 0 - 0.5 * 0.25 = -0.125 -> centred +-0.4375, std 0.4375
    # -> advantages (+1, -1). train/ref_kl = mean k1 over kept samples = 0.375.
    np.testing.assert_allclose(batch.advantages[:2], [1, -1], atol=1e-5)
    assert m["train/ref_kl"] == pytest.approx(0.375)


def test_a_token_the_trainer_scores_impossible_leaves_the_loss():
    """p_o = -inf for one sampled token (the XLA replay of a truncation floor can exclude it):
    the token leaves the loss mask, is counted, and every metric stays finite."""
    samples = [sample(0, 0, [3, 3, 3]), sample(0, 1, [3, 3])]

    def score_with_a_hole(packed):
        def score(params):
            out = np.full(packed.tokens.shape, params, np.float32)
            out[0, 3] = -np.inf                    # row 0, second response token
            return out
        return score

    out = prepare_batch(rollout(samples, [1.0, 0.0]), trainer_version=3, current_params=-1.0,
                        held={3: -1.0}, score_with=score_with_a_hole,
                        options=options(old_logp="recompute"), advantages=GRPO_ADVANTAGES)
    batch, m = out.batch, out.metrics
    assert m["train/excluded_tokens"] == 1
    assert batch.loss_mask.sum() == 3 + 2 - 1 and not batch.loss_mask[0, 3]
    assert np.all(np.isfinite(batch.old_logp)) and batch.old_logp[0, 3] == 0.0
    # Mismatch over the 4 scoreable tokens: |-1 - -1| = 0.
    assert m["mismatch/numerical_abs"] == 0.0 and m["mismatch/held_token_frac"] == 4 / 5
    assert all(np.isfinite(v) for v in m.values() if isinstance(v, float))


def test_observation_tokens_of_multi_turn_episodes_are_context_not_trained_on():
    # Sample (0, 0): model tokens of version 2, an observation of two tokens (version -1, p_b 0,
    # not in the loss), then a model token of version 3 after a swap between turns (KV kept:
    # not reproducible by one version). Sample (0, 1): one model turn of version 3.
    multi = sample(0, 0, [2, 2, -1, -1, 3])
    multi.model_mask = np.array([True, True, False, False, True])
    multi.behavior_logp[~multi.model_mask] = 0.0
    single = sample(0, 1, [3, 3])
    out = prepare_batch(rollout([multi, single], [1.0, 0.0]), trainer_version=3,
                        current_params=-1.0, held={2: -1.5, 3: -1.0}, score_with=score_with,
                        options=PrepareOptions(rows=2, seq_len=8), advantages=GRPO_ADVANTAGES)
    batch, m = out.batch, out.metrics
    # Row 0: prompt (2 tokens), then response mask [model, model, obs, obs, model], padding.
    np.testing.assert_array_equal(batch.loss_mask[0], [0, 0, 1, 1, 0, 0, 1, 0])
    np.testing.assert_array_equal(batch.attn_mask[0], [1, 1, 1, 1, 1, 1, 1, 0])
    assert batch.old_logp[0, 4] == 0.0 and batch.old_logp[0, 5] == 0.0
    # Staleness over the 5 model tokens only: (3-2) * 2 + 0 * 3 = 2 -> mean 2/5, max 1.
    assert m["rollout/staleness_mean"] == pytest.approx(2 / 5)
    assert m["rollout/staleness_max"] == 1
    # Held reproducible tokens: the two version-2 tokens and single's two: 4 of 5; the
    # version-3 token after the swap sits on a version-2 KV prefix.
    assert m["mismatch/held_token_frac"] == pytest.approx(4 / 5)
    assert m["mismatch/kv_mixed_token_frac"] == pytest.approx(1 / 5)
    # p_o of the version-2 tokens is -1.5 against p_b -1.0: numerical |diff| 0.5 on 2 of the 4.
    assert m["mismatch/numerical_abs"] == pytest.approx(0.5 * 2 / 4)
    assert out.consumed["token_versions"] == [2, 3]


def test_stale_group_dropping_ignores_observation_tokens():
    # Observation tokens carry version -1; only model tokens decide staleness: the episode of
    # versions (5, obs, 5) at trainer version 5 is fresh.
    from jrl.pipeline.training.prepare import drop_stale_groups
    episode = sample(0, 0, [5, -1, 5])
    episode.model_mask = np.array([True, False, True])
    kept, _, dropped = drop_stale_groups([episode, sample(0, 1, [5, 5, 5])], [1.0, 0.0], 2,
                                         trainer_version=5, limit=1)
    assert len(kept) == 2 and dropped == 0


@pytest.mark.parametrize("preset, expected", [
    # Group (1, 0, 0, 0): mean 0.25. Dr.GRPO centres only: (0.75, -0.25, -0.25, -0.25).
    ("dr_grpo", [0.75, -0.25, -0.25, -0.25]),
    # GRPO divides by the population std sqrt(0.25 * 0.75) = 0.4330: 0.75 / 0.4330 = 1.7321,
    # -0.25 / 0.4330 = -0.5774 (the seed article's 2-of-8 numbers' shape).
    ("grpo", [1.7320508, -0.5773503, -0.5773503, -0.5773503]),
])
def test_a_preset_brings_its_own_advantages(preset, expected):
    """algorithm.recipe=dr_grpo is Dr.GRPO: its advantages are centred, not std-normalised (a
    regression: the preset used to build only its loss chain, with GRPO's advantages)."""
    cfg = apply_overrides(tiny_config(), [f"algorithm.recipe={preset}"])
    advantages = cfg.recipe().advantages
    assert advantages.std_power == (0.0 if preset == "dr_grpo" else 1.0)
    samples = [sample(0, i, [0]) for i in range(4)]
    group = RolloutBatch(rl_step=0, samples=samples, examples=[],
                         rewards=np.asarray([1, 0, 0, 0], np.float32), group_size=4,
                         data_state={}, metrics={})
    out = prepare_batch(group, trainer_version=0, current_params=-1.0, held={},
                        score_with=score_with,
                        options=PrepareOptions(rows=4, seq_len=4), advantages=advantages)
    np.testing.assert_allclose(out.batch.advantages, expected, rtol=1e-5)

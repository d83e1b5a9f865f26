"""Trainer (jrl.pipeline.training.trainer) on the tiny model (float32, XLA kernels, one CPU device) and a
hand-built rollout: the first loss by hand and its fall over updates on a fixed batch, the
recipe's advantages reaching the update, the p_o recompute schedule (p_o_every), the metrics it
emits, versions and held versions with several mini-batches, a non-finite step skipped, and
RLStep + publish_to on the real trainer."""

import jax
import numpy as np
import pytest

from jrl import losses
from jrl.kernels.contract import NumericalContract
from jrl.losses import GroupAdvantages
from jrl.metrics import names
from jrl.models import CharTokenizer, ModelConfig, init_params
from jrl.pipeline import PrepareOptions, RLStep, Trainer, TrainerOptions, publish_to
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.pipeline.rollout.worker import RolloutWorker
from jrl.train.optimizer import OptimizerConfig
from tests.pipeline.parts.fakes import FakeSampler, FakeTask, options, sample, stream

MODEL = ModelConfig(vocab_size=CharTokenizer().vocab_size, hidden_size=32, intermediate_size=64,
                    num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
CONTRACT = NumericalContract(backend="xla", platform="cpu")
DEVICE = jax.devices()[0]
# Group 0: rewards (1, 0, 0, 0), responses of 3, 1, 1, 1 tokens; group 1: rewards 0, 2 tokens.
LENGTHS = [3, 1, 1, 1, 2, 2, 2, 2]
REWARDS = np.array([1, 0, 0, 0, 0, 0, 0, 0], np.float32)
# GRPO / DAPO advantages (std_power 1): group 0 centred (0.75, -0.25, -0.25, -0.25), population
# std sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875) = 0.4330127, so A = (1.7320508, -0.5773503
# x 3); group 1 has no spread: 0.
GRPO_ADVANTAGES = [1.7320508, -0.5773503, -0.5773503, -0.5773503, 0, 0, 0, 0]
# At ratio 1 (old_logp recomputed: p_old = p_c) DAPO's token-mean loss is -sum_t A / tokens:
# -(3 * 1.7320508 - 3 * 0.5773503) / 14 = -3.4641016 / 14 = -0.2474358.
FIRST_DAPO_LOSS = -0.2474358


def _trainer(recipe=None, *, optimizer=OptimizerConfig(learning_rate=1e-3), mini_batches=1,
             **prepare):
    prepare = PrepareOptions(rows=8, seq_len=8, **{"old_logp": "recompute", **prepare})
    return Trainer(TrainerOptions(prepare, optimizer=optimizer, mini_batches=mini_batches),
                   MODEL, init_params(MODEL, jax.random.key(0)), [DEVICE], contract=CONTRACT,
                   recipe=recipe or losses.recipes.dapo())


def _rollout(rl_step=0, versions=None):
    """Two groups of 4 (LENGTHS, REWARDS); versions[i]: the version of sample i's tokens."""
    versions = versions or [0] * 8
    samples = [sample(i // 4, i % 4, n, versions=[versions[i]] * n)
               for i, n in enumerate(LENGTHS)]
    return RolloutBatch(rl_step=rl_step, samples=samples, examples=[None] * 8,
                        rewards=REWARDS, group_size=4, data_state={}, metrics={})


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(_leaves(a), _leaves(b)))


def test_updates_on_a_fixed_batch_lower_the_loss_from_its_value_by_hand():
    trainer = _trainer()
    prepared = trainer.prepare(_rollout())
    np.testing.assert_allclose(prepared.batch.advantages, GRPO_ADVANTAGES, rtol=1e-5)
    losses_seen = [trainer.train_on(prepared.batch, step)["train/loss"] for step in range(4)]
    assert losses_seen[0] == pytest.approx(FIRST_DAPO_LOSS, rel=1e-5)
    # p_old stays the step-0 policy: each update raises the ratio of the positive-advantage
    # tokens and lowers the others, so -ratio * A falls (still inside the clip range here).
    assert all(b < a for a, b in zip(losses_seen, losses_seen[1:])), losses_seen
    assert trainer.version == 4


def test_the_recipes_advantages_drive_the_update():
    """The same loss chain with Dr.GRPO's centred advantages (std_power 0): A = (0.75, -0.25 x 3)
    and the first loss -(3 * 0.75 - 3 * 0.25) / 14 = -1.5 / 14 = -0.1071429; the updated
    params differ from the GRPO-advantage ones. A recipe's own estimator gets the rewards and
    the group size, and its output is what the batch carries."""
    grpo_like = _trainer()
    centred = _trainer(losses.recipes.dapo().replace(advantages=GroupAdvantages(std_power=0)))
    prepared = centred.prepare(_rollout())
    np.testing.assert_allclose(prepared.batch.advantages, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0],
                               rtol=1e-6)
    assert centred.train_on(prepared.batch, 0)["train/loss"] == pytest.approx(-1.5 / 14,
                                                                              rel=1e-5)
    grpo_like.train_on(grpo_like.prepare(_rollout()).batch, 0)
    assert not _same(centred.state.params, grpo_like.state.params)

    seen = []

    def estimator(rewards, group_size):
        seen.append((np.asarray(rewards).tolist(), group_size))
        return np.arange(8, dtype=np.float32)

    custom = _trainer(losses.recipes.dapo().replace(advantages=estimator))
    assert custom.prepare(_rollout()).batch.advantages.tolist() == list(range(8))
    assert seen == [(REWARDS.tolist(), 4)]


def _schedule(every):
    """Four RL steps on a trainer with p_o_every=every (exact contract, old_logp "behavior"):
    the train-engine passes of each prepare, whether it reported mismatch/*, and its batch.
    Every token has the trainer's version, except sample 0's at step 3 (version 2, held)."""
    trainer = _trainer(old_logp="behavior", exact=True, p_o_every=every)
    calls = []
    score_with = trainer.score_with

    def counted(packed):
        score = score_with(packed)
        return lambda params: (calls.append(1), score(params))[1]

    trainer.score_with = counted
    trainer.hold_version()                                  # version 0, as publish holds it
    passes, measured, batches = [], [], []
    for rl_step in range(4):
        versions = [trainer.version] * 8
        if rl_step == 3:
            versions[0] = 2                                 # held: keep_versions 2 -> {2, 3}
        before = len(calls)
        prepared = trainer.prepare(_rollout(rl_step, versions))
        passes.append(len(calls) - before)
        measured.append(names.MISMATCH_LOGPROB_ABS_DIFF_MAX in prepared.metrics)
        batches.append(prepared.batch)
        trainer.train_on(prepared.batch, rl_step)
        trainer.hold_version()
    assert sorted(trainer.versions) == [3, 4]
    return passes, measured, batches


def test_p_o_is_recomputed_on_the_scheduled_steps_and_for_older_tokens():
    every_step, every_step_measured, every_step_batches = _schedule(1)
    assert every_step == [1, 1, 1, 2] and all(every_step_measured)
    # p_o_every=2: steps 0 and 2 are sampled; step 1's tokens are all of the current version
    # on the exact path (p_o is p_b by construction): no pass and no mismatch/*. Step 3 holds
    # version-2 tokens: scored whatever the schedule, under the current params and the held
    # version 2 (2 passes).
    passes, measured, batches = _schedule(2)
    assert (passes, measured) == ([1, 0, 1, 2], [True, False, True, True])
    # old_logp "behavior": the skipped pass changes no array of any batch.
    for dense, sampled in zip(every_step_batches, batches):
        assert all(np.array_equal(x, y) for x, y in zip(dense, sampled) if x is not None)


def test_the_metrics_of_an_update_by_hand():
    trainer = _trainer()
    metrics = trainer.train_on(trainer.prepare(_rollout()).batch, 0)
    for name in (names.TRAIN_LOSS, names.TRAIN_GRAD_NORM, names.TRAIN_LR, names.TRAIN_NUM_TOKENS,
                 names.TRAIN_UPDATE_SKIPPED, "train/pg_clipfrac_low", "train/pg_clipfrac_high",
                 "train/ppo_kl", "train/entropy"):
        assert name in metrics, name
    for name in metrics:
        names.reduction(name)                     # every one is declared (KeyError if not)
    assert metrics[names.TRAIN_NUM_TOKENS] == 14.0            # 3 + 1 + 1 + 1 + 4 * 2
    assert metrics[names.TRAIN_UPDATE_SKIPPED] == 0.0
    # Ratio exactly 1 at the first update (p_old = p_c): no KL to p_old, nothing clipped.
    assert metrics["train/ppo_kl"] == 0.0
    assert metrics["train/pg_clipfrac_low"] == metrics["train/pg_clipfrac_high"] == 0.0
    assert metrics[names.TRAIN_LR] == pytest.approx(1e-3)     # constant schedule
    assert metrics[names.TRAIN_GRAD_NORM] > 0.0
    assert all(isinstance(value, float) for value in metrics.values())


def test_a_non_finite_update_is_skipped_but_the_version_advances():
    nan = losses.recipes.dapo().replace(
        advantages=lambda rewards, group_size: np.full(np.shape(rewards), np.nan, np.float32))
    trainer = _trainer(nan)
    before = _leaves(trainer.state.params)
    metrics = trainer.train_on(trainer.prepare(_rollout()).batch, 0)
    assert np.isnan(metrics["train/loss"]) and metrics[names.TRAIN_UPDATE_SKIPPED] == 1.0
    assert _same(before, trainer.state.params)
    assert trainer.version == 1                   # the version schedule holds


def test_mini_batches_make_one_version_each_and_rl_step_publishes_them():
    """2 mini-batches of 4 rows: each train_on is 2 updates (version + 2). The FakeSampler's
    batch is 4 responses of 3 tokens (and 4 padding rows); each update's train/num_tokens counts
    its own rows, whichever the shuffle put in it, and the step reports their mean: 12 / 2 = 6. RLStep + publish_to: the worker's board gets the trainer's params
    on its device with version_out; held versions keep the last two."""
    with pytest.raises(ValueError, match="8 rows must split into mini_batches=3"):
        TrainerOptions(PrepareOptions(rows=8, seq_len=8), mini_batches=3)
    trainer = _trainer(mini_batches=2)
    assert trainer.updates_per_step == 2
    rollout_device = jax.devices()[-1]        # another host device (tests/conftest.py: 8)
    worker = RolloutWorker([FakeSampler()], [rollout_device], stream(), FakeTask(), options())
    step = RLStep(trainer, publish=publish_to(worker))
    assert step.publish(trainer).version == 0 and worker.published_version == 0
    for rl_step in range(2):
        params, version = worker.board.latest()
        result = step(worker.generate(rl_step, params[0], version))
        assert (result.version_in, result.version_out) == (2 * rl_step, 2 * rl_step + 2)
        assert result.metrics[names.TRAIN_NUM_TOKENS] == 6.0
        assert result.metrics[names.TRAIN_VERSION] == 2 * rl_step + 2
    params, version = worker.board.latest()
    assert version == 4 and int(trainer.state.step) == 4
    assert all(leaf.devices() == {rollout_device} for leaf in jax.tree.leaves(params[0]))
    assert _same(params[0], trainer.state.params)
    assert sorted(trainer.versions) == [2, 4]     # keep_versions 2: version 0 dropped


def test_train_lr_is_the_rate_the_update_used():
    """Warmup from 0 over 2 updates: update 0 runs at rate 0 (optax's count is 0), so the
    params do not move; train/lr should then say 0 (names: 'learning rate used by the step's
    optimizer update')."""
    trainer = _trainer(optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=2))
    before = _leaves(trainer.state.params)
    metrics = trainer.train_on(trainer.prepare(_rollout()).batch, 0)
    assert _same(before, trainer.state.params)    # rate 0: not one bit moved
    assert metrics[names.TRAIN_LR] == 0.0
    # Update 1 runs at 1e-3 * 1 / 2 = 5e-4 (linear warmup over 2 updates).
    metrics = trainer.train_on(trainer.prepare(_rollout()).batch, 1)
    assert metrics[names.TRAIN_LR] == pytest.approx(5e-4)

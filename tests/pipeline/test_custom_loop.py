"""The README's custom research loop, run as written: public parts only, under 40 lines.

It checks that something real happened: the versions advance one per step and every token
records the version that sampled it; at step 0 the sampler's p_b equals the trainer's p_o bit
for bit; the recipe's advantages (Dr.GRPO: centred, no std division) are what reached the batch;
the loss chain's metrics come back; and the params changed. A recipe swapped in brings its
reward shaping along (the loop passes the recipe whole).
"""

import numpy as np
import pytest

from jrl.pipeline.rollout.group_stats import overlong_penalty

# --- README: a custom research loop ---------------------------------------------------------
import jax
from jrl import losses
from jrl.data import ArithmeticTask, PromptStream, PromptTemplate
from jrl.kernels.contract import NumericalContract
from jrl.models import CharTokenizer, ModelConfig, init_params
from jrl.pipeline import (PrepareOptions, RolloutOptions, RolloutSpec, RolloutWorker, Task,
                          Trainer, TrainerOptions)
from jrl.sampling import Sampler, SamplingParams


def custom_loop(recipe, reward_fn, steps=3, group_size=4, prompts=4, max_new=8, prompt_len=24):
    """recipe: the algorithm, whole (advantages + loss chain + shaping), e.g. dr_grpo()."""
    tokenizer, device = CharTokenizer(), jax.devices()[0]
    model = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                        num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    contract = NumericalContract(backend="pallas")
    # The task: prompt rendering, decoding (stop ids dropped), reward_fn(text, example).
    task = Task(tokenizer, PromptTemplate(user_format="{question}\n"), reward_fn=reward_fn)
    sampling = task.sampling_params(SamplingParams(max_new_tokens=max_new, group_size=group_size))
    sampler = Sampler(model, contract, sampling, num_slots=8, max_prompt_len=prompt_len)
    stream = PromptStream(ArithmeticTask().train_eval_split(64, 0, seed=0)[0], seed=0)
    worker = RolloutWorker([sampler], [device], stream, task,
                           RolloutOptions(RolloutSpec(prompts, group_size, max_new,
                                                      recipe.shaping)))
    trainer = Trainer(TrainerOptions(PrepareOptions(rows=prompts * group_size,
                                                    seq_len=prompt_len + max_new)),
                      model, init_params(model, jax.random.key(0)), [device],
                      contract=contract, recipe=recipe)
    log = []
    published = trainer.publish([device])                    # version 0, held for p_o
    for rl_step in range(steps):
        rollout = worker.generate(rl_step, published.params[0], published.version)
        prepared = trainer.prepare(rollout)                   # p_o, mismatch, advantages
        # ... a research loop changes the batch here (rewards, masks, advantages) ...
        metrics = {**prepared.metrics, **trainer.train_on(prepared.batch, rl_step)}
        published = trainer.publish([device])                 # version rl_step + 1
        log.append((rollout, prepared, metrics, published.version))
    return trainer, log
# --- end of the README example --------------------------------------------------------------


def parity_reward(text, example):
    """A reward that varies within a group: the response's length parity."""
    return float(len(text) % 2)


def test_the_custom_loop_trains_with_explicit_versions_and_bitwise_p_b():
    trainer, log = custom_loop(losses.recipes.dr_grpo(max_len=8), parity_reward)
    initial = init_params(trainer.model_config, jax.random.key(0))
    assert [version for *_, version in log] == [1, 2, 3] and trainer.version == 3
    for rl_step, (rollout, prepared, metrics, _) in enumerate(log):
        # Synchronous: batch i is sampled by version i, consumed at version i.
        assert prepared.consumed["token_versions"] == [rl_step]
        assert prepared.consumed["trainer_version"] == rl_step
        assert all(set(s.versions.tolist()) == {rl_step} for s in rollout.samples)
        # Same weights, same kernels: p_b == p_o exactly, on every token.
        assert metrics["mismatch/logprob_abs_diff_max"] == 0.0
        assert metrics["mismatch/held_token_frac"] == 1.0
        # The loss chain's own metrics (PPO clip fractions, KL to p_old, grad norm).
        for name in ("train/loss", "train/pg_clipfrac_low", "train/pg_clipfrac_high",
                     "train/ppo_kl", "train/grad_norm"):
            assert name in metrics, name
    # Step 0: p_old = p_b = p_c before the update, so the ratio is exactly 1 everywhere.
    assert log[0][2]["train/ppo_kl"] == 0.0
    # Dr.GRPO's advantages: A = R - mean_group(R), no std division. The rewards are 0 / 1 and
    # a group mean is k / 4, so the centred values are exact in float32.
    rollout, prepared, _, _ = log[0]
    rewards = rollout.rewards.reshape(-1, 4)
    expected = (rewards - rewards.mean(axis=1, keepdims=True)).reshape(-1)
    assert np.array_equal(prepared.batch.advantages, expected)
    assert np.ptp(rewards, axis=1).max() > 0           # some group had a learning signal
    changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(initial), jax.tree.leaves(trainer.params_on_host()))]
    assert any(changed)


def test_a_recipe_swapped_into_the_loop_brings_its_shaping():
    """dapo() in place of dr_grpo(): the same step-0 samples (same weights, same keys) get DAPO's
    overlong penalty, and groups whose shaped rewards do not vary are dropped (dynamic
    sampling). The loop cannot lose the shaping: RolloutSpec requires it and the Trainer takes
    the whole recipe."""
    def reward(text, example):     # constant for even prompt ids: those groups carry no signal
        return 1.0 if example.id % 2 == 0 else parity_reward(text, example)

    dapo = losses.recipes.dapo(max_len=8)
    # The ramp: round(0.2 * 8) = 2 tokens, so a 7-token response loses 0.5 and an 8-token one 1.
    assert dapo.shaping.overlong_buffer_len(max_len=8) == 2
    plain = custom_loop(losses.recipes.dr_grpo(max_len=8), reward, steps=1)[1][0][0]
    shaped = custom_loop(dapo, reward, steps=1)[1][0][0]

    def groups(rollout):
        return {rollout.samples[i].prompt_id: (
            np.array([s.num_model_tokens for s in rollout.samples[i:i + 4]]),
            rollout.rewards[i:i + 4]) for i in range(0, len(rollout.samples), 4)}

    expected = {}
    for prompt_id, (lengths, task_rewards) in groups(plain).items():
        rewards = task_rewards + overlong_penalty(lengths, max_len=8, buffer_len=2, factor=1.0)
        if np.ptp(rewards) > 0:                                     # a learning signal: kept
            expected[prompt_id] = (lengths, rewards)
    got = groups(shaped)
    assert got.keys() == expected.keys()
    for prompt_id, (lengths, rewards) in got.items():
        np.testing.assert_array_equal(lengths, expected[prompt_id][0])   # the same samples
        np.testing.assert_array_equal(rewards, expected[prompt_id][1])
    # Both parts acted here: a group was dropped and a response was penalised.
    assert len(got) < len(groups(plain))
    assert any((lengths >= 7).any() for lengths, _ in expected.values())


def test_a_loop_cannot_drop_the_shaping_or_split_the_recipe():
    with pytest.raises(TypeError):
        RolloutSpec(4, 4, 8)                                        # no shaping: refused
    with pytest.raises(TypeError, match="a jrl.losses.RewardShaping"):
        RolloutSpec(4, 4, 8, losses.recipes.dapo(max_len=8))        # the recipe, not its shaping
    with pytest.raises(TypeError, match="takes a jrl.losses.Recipe"):
        Trainer(TrainerOptions(PrepareOptions(rows=4, seq_len=8)), None, None, [],
                contract=NumericalContract(backend="xla"), recipe=losses.recipes.dapo().loss)


def test_the_readme_shows_this_loop_as_it_runs_here():
    import pathlib
    source = pathlib.Path(__file__).read_text()
    block = source.split("# --- README: a custom research loop ---")[1].split("\n", 1)[1]
    block = block.split("# --- end of the README example ---")[0]
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    assert "```python\n" + block + "```" in readme
    assert len(block.splitlines()) < 40


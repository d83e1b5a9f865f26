"""Multi-turn runs end to end: the real Run loop with a tool environment, sync and async.

The tiny random model of tests/pipeline/tiny.py cannot call a tool on purpose, so the test
environment below answers every turn: with the ten digits as stop tokens, a model turn ends at
the first digit the model writes, and the environment observes "=1" twice before grading the
third turn. That gives every episode up to three model turns and two observations, enough to
check what matters: the observation tokens are in the context and out of the loss, and every
model token's p_b equals the trainer's p_o bit for bit (mismatch/logprob_abs_diff_max == 0.0),
also when the weights change between turns (async).
"""

import jax
import numpy as np
import pytest

from jrl.envs import StepResult
from jrl.models import CharTokenizer
from jrl.pipeline.loop.runner import Run
from tests.pipeline.tiny import tiny_config

DIGITS = tuple(CharTokenizer().encode("0123456789"))
MULTI_TURN = ("env.name=tests.pipeline.test_multiturn_run:ThreeTurns", "env.max_turns=3",
              "env.max_observation_tokens=4", "env.observation_format={observation}\n",
              "sampling.max_new_tokens=24", f"sampling.stop_tokens={list(DIGITS)}",
              "train.sft_steps=0", "eval.greedy=false", "checkpoint.every=0")


class ThreeTurns:
    """Observes "=1" after the first two turns; the third is graded: reward 1 when the model
    wrote an even number of characters in it (a coin the group's samples disagree on)."""

    def reset(self, example):
        self.turn = 0
        return example.question

    def step(self, action):
        self.turn += 1
        if self.turn < 3:
            return StepResult("=1", tool_call=True)
        return StepResult("", reward=float(len(action) % 2 == 0), done=True)


def _quiet(*_):
    pass


def _check_multi_turn_history(history):
    for row in history:
        assert row["mismatch/logprob_abs_diff_max"] == 0.0
        assert row["mismatch/numerical_abs"] == 0.0
        assert 1.0 <= row["rollout/turns_mean"] <= 3.0
        assert row["rollout/tool_errors"] == 0 and row["rollout/tool_timeouts"] == 0
    assert max(row["rollout/turns_mean"] for row in history) > 1.5
    assert max(row["rollout/observation_token_frac"] for row in history) > 0.0
    assert max(row["rollout/tool_calls_mean"] for row in history) > 0.5


def test_sync_multi_turn_run_trains_on_model_tokens_with_bitwise_p_b(tmp_path):
    run = Run(tiny_config(*MULTI_TURN, "train.steps=2"), str(tmp_path), log=_quiet)
    batches = []
    prepare = run.trainer.prepare
    run.trainer.prepare = lambda rollout: batches.append((rollout, prepare(rollout))) or \
        batches[-1][1]
    result = run.run()
    _check_multi_turn_history(result.history)
    assert result.history[0]["mismatch/held_token_frac"] == 1.0
    rollout, prepared = batches[0]
    with_observations = [i for i, s in enumerate(rollout.samples)
                         if not s.model_token_mask().all()]
    assert with_observations
    for row in with_observations:
        sample = rollout.samples[row]
        start = sample.prompt_tokens.size
        span = slice(start, start + sample.length)
        # Observations: attended to, never in the loss; every model token is.
        np.testing.assert_array_equal(prepared.batch.loss_mask[row, span],
                                      sample.model_token_mask())
        assert prepared.batch.attn_mask[row, span].all()
        assert sample.episode.turns >= 2 and sample.episode.tool_calls >= 1


@pytest.fixture(scope="module")
def needs_eight_devices():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets them)")


def test_async_multi_turn_run_tags_versions_per_token_across_turns(needs_eight_devices,
                                                                   tmp_path):
    run = Run(tiny_config(*MULTI_TURN, "train.steps=4", "pipeline.max_staleness=1",
                          "pipeline.rollout_devices=2", "pipeline.train_devices=4",
                          "train.micro_batches=4"), str(tmp_path), log=_quiet)
    result = run.run()
    _check_multi_turn_history(result.history)
    assert max(row["rollout/staleness_max"] for row in result.history) == 1
    assert sum(len(c["token_versions"]) > 1 or c["staleness_max"] > 0
               for c in run.consumed) >= 1

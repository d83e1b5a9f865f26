"""Task: the stop-id merge, the decode rules, rewards under the error policy, episode rewards."""

import numpy as np
import pytest

from jrl.data import PromptExample, PromptTemplate
from jrl.models import CharTokenizer
from jrl.losses import RewardShaping
from jrl.pipeline import RolloutOptions, RolloutSpec, RolloutWorker, Task
from jrl.pipeline.rollout.episodes import EpisodeRecord
from jrl.rewards import RewardFunctionError
from jrl.sampling import Sample, SamplingParams

TOKENIZER = CharTokenizer()          # stop id 2 (<eos>), vocabulary 83
EXAMPLE = PromptExample(id=7, question="1+1", answer="2")


def _sample(tokens, episode=None, index=0):
    n = len(tokens)
    return Sample(prompt_id=0, sample_index=index, prompt_tokens=np.array([4], np.int32),
                  tokens=np.asarray(tokens, np.int32), behavior_logp=np.zeros(n, np.float32),
                  logit_floor=np.full(n, -np.inf, np.float32), versions=np.zeros(n, np.int32),
                  entropy=None, finish_reason="stop", episode=episode)


def test_the_tokenizer_stop_ids_are_merged_into_the_task_and_its_sampling():
    task = Task(TOKENIZER, stop_tokens=(9, 5))
    assert task.stop_tokens == (2, 5, 9)                      # sorted {9, 5} | {2}
    sampling = task.sampling_params(SamplingParams(stop_tokens=(11,)))
    assert sampling.stop_tokens == (2, 5, 9, 11)
    assert Task(TOKENIZER).stop_tokens == (2,)                # the tokenizer's alone


def test_decode_drops_stop_ids_and_ids_past_the_vocabulary():
    task = Task(TOKENIZER, stop_tokens=(5,))
    ones = TOKENIZER.encode("1")                               # [4]
    # "1", the configured stop id 5 ("2"), eos 2, a padded-embedding id 83 + 3: only "1" stays.
    assert task.decode(_sample(ones + [5, 2, 86])) == "1"
    assert task.decode_tokens(TOKENIZER.encode("12")) == "1"   # 5 is a stop id here


def test_render_uses_the_template():
    task = Task(TOKENIZER, PromptTemplate(user_format="Q: {question}\n"))
    # The char tokenizer has a bos id, so the prompt starts with it.
    assert TOKENIZER.decode(task.render(EXAMPLE)) == "<bos>Q: 1+1\n"


def test_score_group_counts_failed_reward_calls_unless_told_to_raise():
    calls = []

    def reward(text, example):
        calls.append(text)
        if len(calls) == 2:
            raise RuntimeError("verifier crashed")
        return float(text == "2")

    samples = [_sample(TOKENIZER.encode(t) + [2], index=i) for i, t in enumerate("232")]
    score = Task(TOKENIZER, reward_fn=reward).score_group(samples, EXAMPLE)
    # "2" -> 1, the second call fails -> 0 and counted, "2" -> 1.
    assert score.rewards.tolist() == [1.0, 0.0, 1.0] and score.rewards.dtype == np.float32
    assert score.reward_errors == 1
    assert "index 1 (example id 7): RuntimeError: verifier crashed" in score.first_error
    calls.clear()
    with pytest.raises(RewardFunctionError, match="verifier crashed"):
        Task(TOKENIZER, reward_fn=reward, raise_reward_errors=True).score_group(samples, EXAMPLE)


def test_score_group_takes_an_episode_reward_from_its_environment():
    def never(text, example):
        raise AssertionError("a multi-turn group is graded by its environment")

    samples = [_sample([4, 2], EpisodeRecord(reward=r), i) for i, r in enumerate((0.5, 2.0))]
    score = Task(TOKENIZER, reward_fn=never).score_group(samples, EXAMPLE)
    assert score.rewards.tolist() == [0.5, 2.0] and score.reward_errors == 0


def test_a_single_turn_task_has_no_episode_driver_nor_demonstrations():
    task = Task(TOKENIZER)
    assert not task.multi_turn and task.episode_driver(lambda prompt_id: EXAMPLE) is None
    with pytest.raises(ValueError, match="has no demonstrations"):
        task.demonstration(EXAMPLE)


def test_the_worker_refuses_to_start_before_weights_are_published():
    worker = RolloutWorker([], [], None, Task(TOKENIZER), RolloutOptions(RolloutSpec(1, 1, 1, RewardShaping())))
    with pytest.raises(RuntimeError, match="no weights were published yet"):
        worker.start(0, 1)


@pytest.mark.parametrize("bad", [1e30, -1e7, float("nan"), float("inf")])
def test_an_absurd_or_non_finite_episode_reward_is_a_reward_error_naming_the_prompt(bad):
    # 1e30: the group std squares the deviations (1e60 overflows float32), so every advantage
    # of the group would be 0 or NaN; it is refused as a reward error instead.
    samples = [_sample([4, 2], EpisodeRecord(reward=r), i) for i, r in enumerate((1.0, bad))]
    task = Task(TOKENIZER, env_name="my.env:make")
    score = task.score_group(samples, EXAMPLE)
    assert score.rewards.tolist() == [1.0, 0.0] and score.reward_errors == 1
    assert score.first_error.startswith("prompt 0, sample 1 (example id 7): "
                                        "env.name='my.env:make' returned")
    with pytest.raises(RewardFunctionError, match="prompt 0, sample 1"):
        Task(TOKENIZER, raise_reward_errors=True).score_group(samples, EXAMPLE)


def test_an_absurd_verifier_reward_is_a_reward_error_naming_the_prompt():
    samples = [_sample(TOKENIZER.encode(t) + [2], index=i) for i, t in enumerate("23")]
    task = Task(TOKENIZER, reward_fn=lambda text, example: 1e6 if text == "2" else -1e9)
    score = task.score_group(samples, EXAMPLE)
    assert score.rewards.tolist() == [1e6, 0.0] and score.reward_errors == 1   # 1e6: the bound
    assert score.first_error.startswith("prompt 0, index 1 (example id 7): ValueError: "
                                        "returned the reward -1000000000.0, beyond")

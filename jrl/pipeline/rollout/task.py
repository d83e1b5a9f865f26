"""A run's task: what its prompts, responses and rewards mean, in one object.

    task = task_from_config(cfg, tokenizer)  # jrl.pipeline.setup.options; or Task(tokenizer, ...)
    sampling = task.sampling_params(cfg.resolved_sampling())   # the task's stop ids merged in
    prompt_ids = task.render(example)               # list[int]
    text = task.decode(sample)                      # stop ids and out-of-vocabulary ids dropped
    score = task.score_group(samples, example)      # GroupScore: rewards [G] float32, errors
    driver = task.episode_driver(example_of)        # multi-turn episodes (None: single-turn)

The rollout worker, its admission queue, evaluation and the split-process mode take a Task
instead of four loose callables (render, decode, reward function, episode driver factory), so
the rules between them (which ids end a response, which are dropped when decoding, which reward
an episode gets) live in one place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from jrl.data import PromptExample, PromptTemplate, encode_prompt
from jrl.envs import Environment
from jrl.pipeline.rollout.episodes import (EpisodeDriver, EpisodeOptions, demonstrate,
                                   transcript_segments)
from jrl.rewards import math_reward, safe_rewards
from jrl.rewards.custom import CustomReward
from jrl.rewards.safe import RewardFunctionError, check_reward
from jrl.sampling import Sample, SamplingParams


class GroupScore(NamedTuple):
    """The task rewards of one finished group: rewards [G] float32 (a failed reward call counts
    0), how many calls failed, and the first failure ("index i (example id ...): Type: msg")."""

    rewards: np.ndarray
    reward_errors: int = 0
    first_error: str | None = None
    parts: dict | None = None       # {name: [G] float32, NaN where missing}: named rewards


@dataclasses.dataclass(frozen=True)
class Task:
    """Prompt rendering, response decoding, the reward function and the episode driver.

    tokenizer: encode / decode / stop_ids / vocab_size (jrl.models.tokenizer). template: how an
    example becomes the prompt text. reward_fn(response_text, example[, token_ids]) -> float |
    RewardResult | dict of named parts (jrl.rewards.custom; kept as a CustomReward), run under
    jrl.rewards.safe_rewards: a call that fails counts as reward 0 and is counted,
    unless raise_reward_errors. stop_tokens: ids that end a sampled response; the tokenizer's
    stop ids are always among them (merged in at construction). make_env: a multi-turn task's
    environment factory (None: single-turn; the episode's reward is then the environment's, and
    reward_fn is not used). episode_options / env_threads: the episode driver's
    (jrl.pipeline.rollout.episodes). env_name: names the environment in error messages.
    """

    tokenizer: Any
    template: PromptTemplate = PromptTemplate()
    reward_fn: Callable[[str, PromptExample], Any] = math_reward
    raise_reward_errors: bool = False
    stop_tokens: tuple[int, ...] = ()
    make_env: Callable[[], Environment] | None = None
    episode_options: EpisodeOptions = EpisodeOptions()
    env_threads: int = 8
    env_name: str = "none"

    def __post_init__(self):
        if not isinstance(self.reward_fn, CustomReward):
            # One protocol for a reward given in code and one named in the config: token ids
            # where the function takes them, a dict of named parts summed (weight 1).
            object.__setattr__(self, "reward_fn", CustomReward(self.reward_fn))
        merged = tuple(sorted({int(t) for t in self.stop_tokens}
                              | {int(t) for t in self.tokenizer.stop_ids}))
        object.__setattr__(self, "stop_tokens", merged)

    @property
    def multi_turn(self) -> bool:
        return self.make_env is not None

    def sampling_params(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with this task's stop ids added to its stop_tokens (what every sampler of
        the task must use, so that a response ends where decode expects)."""
        return sampling.replace(stop_tokens=tuple(sorted(set(sampling.stop_tokens)
                                                         | set(self.stop_tokens))))

    # ------------------------------------------------------------------------------------------
    def render(self, example: PromptExample) -> list[int]:
        """The prompt's token ids; in multi-turn tasks, rendered from the environment's first
        observation (env.reset(example)) instead of the question."""
        if self.multi_turn:
            example = dataclasses.replace(example, question=self.make_env().reset(example))
        return encode_prompt(self.template, self.tokenizer, example)

    def decode(self, sample: Sample) -> str:
        """The response text of a sample (see decode_tokens)."""
        return self.decode_tokens(sample.tokens)

    def decode_tokens(self, ids: Sequence[int]) -> str:
        """Text of token ids; stop ids and ids past the tokenizer's vocabulary (padded embedding
        rows a random or padded model may draw) decode to nothing."""
        vocab = self.tokenizer.vocab_size
        kept = [int(t) for t in ids if int(t) not in self.stop_tokens and int(t) < vocab]
        return self.tokenizer.decode(kept, skip_special_tokens=True)

    # ------------------------------------------------------------------------------------------
    def rewards(self, texts: Sequence[str], examples: Sequence[PromptExample],
                token_ids: Sequence[Sequence[int]] | None = None) -> tuple[np.ndarray, dict]:
        """reward_fn on each (text, example[, token_ids]) under the task's error policy:
        rewards [N] float32 and safe_rewards' info (reward_errors, first_error, correct, parts,
        ...). token_ids: each response's model tokens (given to a reward_fn that takes them)."""
        return safe_rewards(self.reward_fn, texts, examples, token_ids=token_ids,
                            raise_errors=self.raise_reward_errors)

    def score_group(self, samples: Sequence[Sample], example: PromptExample) -> GroupScore:
        """Task rewards of a finished group: the reward its environment gave each episode, or
        the reward function on each decoded response. A non-finite reward, or one beyond
        |r| <= MAX_ABS_REWARD, is a reward error (reward 0, counted; first_error names the
        prompt id), or raises RewardFunctionError with raise_reward_errors."""
        prompt_id = samples[0].prompt_id if samples else None
        if all(s.episode is not None for s in samples):
            rewards = np.zeros([len(samples)], np.float32)
            errors, first_error = 0, None
            for index, sample in enumerate(samples):
                try:
                    rewards[index] = check_reward(float(sample.episode.reward))
                except ValueError as error:
                    description = (f"prompt {prompt_id}, sample {sample.sample_index} (example "
                                   f"id {example.id!r}): env.name={self.env_name!r} {error}")
                    if self.raise_reward_errors:
                        raise RewardFunctionError(description) from error
                    errors += 1
                    first_error = first_error or description
            return GroupScore(rewards, errors, first_error)
        rewards, info = self.rewards([self.decode(s) for s in samples],
                                     [example] * len(samples), token_ids=self.ids_for(samples))
        first_error = info["first_error"]
        if first_error is not None:
            first_error = f"prompt {prompt_id}, {first_error}"
        return GroupScore(np.asarray(rewards, np.float32), int(info["reward_errors"]),
                          first_error, info["parts"])

    def ids_for(self, samples: Sequence[Sample]) -> list[list[int]] | None:
        """Each sample's response_ids when the reward function takes token ids, else None
        (not built for a reward that would ignore them)."""
        if not self.reward_fn.takes_token_ids:
            return None
        return [self.response_ids(s) for s in samples]

    def response_ids(self, sample: Sample) -> list[int]:
        """The response's token ids as a reward function sees them: stop ids dropped, as in
        the decoded text."""
        return [int(t) for t in sample.tokens if int(t) not in self.stop_tokens]

    # ------------------------------------------------------------------------------------------
    def episode_driver(self, example_of: Callable[[int], PromptExample]
                       ) -> EpisodeDriver | None:
        """The environment side of multi-turn episodes (None for a single-turn task);
        example_of(prompt_id) gives an in-flight request's example. Close it when done."""
        if not self.multi_turn:
            return None
        return EpisodeDriver(self.make_env, example_of=example_of, encode=self.tokenizer.encode,
                             special_texts=self.tokenizer.special_token_texts,
                             decode=self.decode_tokens, options=self.episode_options,
                             threads=self.env_threads)

    def demonstration(self, example: PromptExample) -> list[tuple[list[int], bool]]:
        """A warm-start row showing a tool-using episode: the environment's demonstration
        actions run through it (jrl.pipeline.rollout.episodes.demonstrate), tokenized as the sampler
        would see them: the model's turns end in the stop token and are trained on; the
        observations are put in the observation format and cut as the driver cuts them."""
        env = self.make_env() if self.multi_turn else None
        if not hasattr(env, "demonstration"):
            raise ValueError(f"env.name={self.env_name!r} has no demonstrations "
                             "(a demonstration(example) method); set train.sft_tool_frac=0")
        transcript = demonstrate(env, example, env.demonstration(example))
        return [(self.render(example), False)] + transcript_segments(
            transcript, encode=self.tokenizer.encode, stop_id=self.tokenizer.stop_ids[0],
            options=self.episode_options)

"""One RL step's rollout: prompts -> samples -> rewards -> group filter (dynamic sampling).

Runs on the rollout side (a host thread in the async pipeline). Per-token versions and p_b come
from the sampler; rewards come from the verifier; advantages are computed by the trainer, which
may first subtract a KL penalty from the rewards.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jrl import losses
from jrl.data import PromptExample, PromptStream
from jrl.rewards import safe_rewards
from jrl.sampling.engine import FINISH_LENGTH, Sample


@dataclasses.dataclass
class RolloutBatch:
    """Samples of `num_groups` kept groups (each `group_size` consecutive samples).

    rewards [N] float32 (task reward + overlong shaping). data_state: the prompt stream's state
    after this batch's prompts were drawn (saved in the checkpoint of the step that trains on
    it). metrics: rollout/* and time/rollout_s.
    """

    rl_step: int
    samples: list[Sample]
    examples: list[PromptExample]
    rewards: np.ndarray
    group_size: int
    data_state: dict
    metrics: dict

    @property
    def num_groups(self) -> int:
        return len(self.samples) // self.group_size

    def oldest_version(self) -> int:
        return min(int(s.versions.min()) for s in self.samples) if self.samples else 0


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """What the rollout side needs besides the sampler (built from the experiment config)."""

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    dynamic_sampling: bool
    max_rounds: int
    overlong_buffer: int
    overlong_factor: float


def encode_prompts(examples: Sequence[PromptExample], render: Callable[[PromptExample], list[int]]
                   ) -> list[list[int]]:
    return [render(example) for example in examples]


def collect_rollout(*, rl_step: int, stream: PromptStream, spec: RolloutSpec,
                    generate: Callable[[list[tuple[int, list[int]]]], list[Sample]],
                    render: Callable[[PromptExample], list[int]],
                    decode: Callable[[Sample], str],
                    reward_fn: Callable, raise_reward_errors: bool = False) -> RolloutBatch:
    """Samples until `prompts_per_step` useful groups are collected (or the rounds run out).

    Without dynamic sampling one round is taken and every group kept. With it (DAPO), each round
    draws the missing number of prompts, and groups whose rewards are all equal (zero advantage:
    no gradient) are dropped; after max_rounds the batch may be short (the trainer pads it with
    rows that weigh nothing). Prompt ids are the stream's running draw count, so every request
    of a run has its own PRNG stream and a resumed run draws the same ones.
    """
    start = time.perf_counter()
    kept_samples: list[Sample] = []
    kept_examples: list[PromptExample] = []
    kept_rewards: list[np.ndarray] = []
    counts = {"all_correct": 0, "all_wrong": 0, "groups": 0, "reward_errors": 0, "rounds": 0}
    all_rewards, all_lengths, all_truncated = [], [], []
    group_size = spec.group_size
    for _ in range(spec.max_rounds if spec.dynamic_sampling else 1):
        missing = spec.prompts_per_step - len(kept_samples) // group_size
        if missing <= 0:
            break
        counts["rounds"] += 1
        first_id = stream.examples_consumed
        examples = stream.next_batch(missing)
        requests = [(first_id + i, render(example)) for i, example in enumerate(examples)]
        samples = generate(requests)
        by_id = {first_id + i: example for i, example in enumerate(examples)}
        sample_examples = [by_id[s.prompt_id] for s in samples]
        texts = [decode(s) for s in samples]
        rewards, info = safe_rewards(reward_fn, texts, sample_examples,
                                     raise_errors=raise_reward_errors)
        counts["reward_errors"] += int(info["reward_errors"])
        task_rewards = np.asarray(rewards, np.float32)
        lengths = np.array([s.length for s in samples], np.int32)
        shaped = task_rewards
        if spec.overlong_buffer > 0:
            shaped = shaped + np.asarray(losses.overlong_penalty(
                lengths, max_len=spec.max_new_tokens, buffer_len=spec.overlong_buffer,
                factor=spec.overlong_factor), np.float32)
        groups = losses.useful_groups(task_rewards, group_size)
        counts["all_correct"] += int(groups.num_all_correct)
        counts["all_wrong"] += int(groups.num_all_wrong)
        counts["groups"] += len(samples) // group_size
        all_rewards.append(task_rewards)
        all_lengths.append(lengths)
        all_truncated.append(np.array([s.finish_reason == FINISH_LENGTH for s in samples]))
        useful = np.asarray(groups.useful)
        for g in range(len(samples) // group_size):
            if spec.dynamic_sampling and not useful[g]:
                continue
            if len(kept_samples) // group_size >= spec.prompts_per_step:
                break
            rows = slice(g * group_size, (g + 1) * group_size)
            kept_samples.extend(samples[rows])
            kept_examples.extend(sample_examples[rows])
            kept_rewards.append(shaped[rows])
    rewards_seen = np.concatenate(all_rewards)
    metrics = {
        "rollout/reward_mean": float(rewards_seen.mean()),
        "rollout/response_len_mean": float(np.concatenate(all_lengths).mean()),
        "rollout/truncated_frac": float(np.concatenate(all_truncated).mean()),
        "rollout/zero_std_groups_all_correct": counts["all_correct"],
        "rollout/zero_std_groups_all_wrong": counts["all_wrong"],
        "rollout/reward_errors": counts["reward_errors"],
        "rollout/sampling_rounds": counts["rounds"],
        "rollout/groups_kept": len(kept_samples) // group_size,
        "time/rollout_s": time.perf_counter() - start,
    }
    rewards = np.concatenate(kept_rewards) if kept_rewards else np.zeros((0,), np.float32)
    return RolloutBatch(rl_step=rl_step, samples=kept_samples, examples=kept_examples,
                        rewards=rewards, group_size=group_size, data_state=stream.state_dict(),
                        metrics=metrics)

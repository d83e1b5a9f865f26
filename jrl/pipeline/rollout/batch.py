"""What one RL step's rollout hands the trainer (RolloutBatch), how it is shaped (RolloutSpec),
and how the rollout side schedules it (RolloutOptions).

The rollout itself (admission, sampling, rewards, group filter) lives in jrl.pipeline.rollout.admission
and jrl.pipeline.rollout.worker.
Per-token versions and p_b come from the sampler; rewards from the verifier; advantages are
computed by the trainer, which may first subtract a KL penalty from the rewards.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jrl.data import PromptExample
from jrl.losses.recipes import RewardShaping
from jrl.sampling import Sample


@dataclasses.dataclass
class RolloutBatch:
    """Samples of the kept groups (each `group_size` consecutive samples).

    rewards [N] float32 (task reward + overlong shaping). data_state: the prompt stream's state
    after this batch's prompts were drawn (saved in the checkpoint of the step that trains on
    it). metrics: rollout/* and time/rollout_s. first_reward_error: the first failed reward call
    ("index i (example id ...): ErrorType: message"), when any failed.
    """

    rl_step: int
    samples: list[Sample]
    examples: list[PromptExample]
    rewards: np.ndarray
    group_size: int
    data_state: dict
    metrics: dict
    first_reward_error: str | None = None


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """One RL step's batch: prompts_per_step groups of group_size samples, each response at most
    max_new_tokens, shaped by the recipe's `shaping` (jrl.losses.RewardShaping; required, so a
    loop cannot drop it): with dynamic_sampling (DAPO), groups whose rewards do not vary are
    replaced by new prompts for at most max_rounds rounds, and the rest dropped; with an
    overlong buffer, DAPO's soft overlong penalty over the last overlong_buffer tokens of
    max_new_tokens, down to -overlong_factor."""

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    shaping: RewardShaping
    max_rounds: int = 1

    def __post_init__(self):
        if not isinstance(self.shaping, RewardShaping):
            raise TypeError(f"RolloutSpec.shaping must be a jrl.losses.RewardShaping (a recipe's "
                            f".shaping), got {type(self.shaping).__name__}")

    @property
    def dynamic_sampling(self) -> bool:
        return self.shaping.dynamic_sampling

    @property
    def overlong_buffer(self) -> int:
        return self.shaping.overlong_buffer_len(max_len=self.max_new_tokens)

    @property
    def overlong_factor(self) -> float:
        return self.shaping.overlong_factor



@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """How the rollout side schedules its batches (besides the batch shape, `spec`).

    updates_per_step: optimizer updates (policy versions) per RL step, U. max_staleness, k: a
    group for step b starts only with weights of version >= b * U - k (0: the synchronous loop).
    interrupt: new weights are swapped in mid-generation (else they wait until the sampler's
    in-flight samples finish). queue_size: finished batches held for the trainer (at least
    k + 2). precompile: each sampler compiles all its programs before its first request.
    shard_index: this process's shard of the prompt stream (SPMD; names its prompt ids).
    """

    spec: RolloutSpec
    updates_per_step: int = 1
    max_staleness: int = 0
    interrupt: bool = True
    queue_size: int = 2
    precompile: bool = False
    shard_index: int = 0

    def first_version(self, rl_step: int) -> int:
        """The oldest weights' version that may start a group of step `rl_step`: b * U - k."""
        return rl_step * self.updates_per_step - self.max_staleness

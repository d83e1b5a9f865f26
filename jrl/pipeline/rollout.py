"""What one RL step's rollout hands the trainer (RolloutBatch) and how it is shaped (RolloutSpec).

The rollout itself (admission, sampling, rewards, group filter) lives in jrl.pipeline.admission.
Per-token versions and p_b come from the sampler; rewards from the verifier; advantages are
computed by the trainer, which may first subtract a KL penalty from the rewards.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jrl.data import PromptExample
from jrl.sampling.engine import Sample


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
    """What the rollout side needs besides the sampler (built from the experiment config)."""

    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    dynamic_sampling: bool
    max_rounds: int
    overlong_buffer: int
    overlong_factor: float

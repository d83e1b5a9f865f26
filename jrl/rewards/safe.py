"""Calls a reward function on a batch so that one failing sample cannot stop the run."""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, Sequence

import numpy as np

from jrl.data import PromptExample
from jrl.rewards.math import RewardResult

# The largest |reward| accepted. Larger ones are reward errors: group statistics in float32
# (the std squares deviations: 1e20 ** 2 overflows) would turn their advantages to 0 or NaN,
# and no verifier means them.
MAX_ABS_REWARD = 1e6


class RewardFunction(Protocol):
    """A verifier: grades one response to one prompt.

    Returns a float reward, or a RewardResult when it also knows correctness and format (then
    `safe_rewards` reports those too). `math_reward` is one; wrap options with functools.partial.
    """

    def __call__(self, response: str, example: PromptExample) -> float | RewardResult: ...


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample while `safe_rewards(..., raise_errors=True)`."""


def _as_reward(value: Any) -> tuple[float, RewardResult | None]:
    """(reward, result or None) from a reward function's return value; ValueError if unusable."""
    result = value if isinstance(value, RewardResult) else None
    reward = value.reward if result is not None else value
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise ValueError(
            f"returned {type(value).__name__} {value!r}; expected a float or a RewardResult"
        )
    return check_reward(float(reward)), result


def check_reward(reward: float) -> float:
    """`reward` if it is finite and |reward| <= MAX_ABS_REWARD; ValueError otherwise (a NaN,
    inf or absurd reward would poison every advantage in its group)."""
    if not math.isfinite(reward):
        raise ValueError(f"returned a non-finite reward {reward!r}")
    if abs(reward) > MAX_ABS_REWARD:
        raise ValueError(f"returned the reward {reward!r}, beyond |reward| <= {MAX_ABS_REWARD:g} "
                         "(the group statistics would overflow)")
    return reward


def safe_rewards(
    reward_fn: RewardFunction,
    responses: Sequence[str],
    examples: Sequence[PromptExample],
    *,
    raise_errors: bool = False,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Calls `reward_fn(responses[i], examples[i])` for every i and collects the rewards.

    A call that raises, or returns something other than a finite number / RewardResult (or a
    number beyond |r| <= MAX_ABS_REWARD), gives
    reward 0.0 for that sample and is counted; the run goes on. With raise_errors=True the first
    such failure raises RewardFunctionError instead (naming the sample index and example id,
    chained to the original exception).

    Args:
      responses: [N] response texts.
      examples: [N] the prompt each response answers (repeat each prompt G times for groups,
        e.g. with jrl.data.repeat_for_groups).

    Returns:
      rewards: [N] float32.
      info: dict with
        "reward_errors": int, failed samples (logged as rollout/reward_errors);
        "first_error": str | None, "index i (example id ...): ExceptionType: message" of the first;
        "error_indices": list[int];
        "correct": [N] bool array, or None unless every successful call returned a RewardResult
          (failed samples count as not correct);
        "format_ok": [N] bool array, or None, likewise;
        "extracted": [N] list of str | None, or None, likewise.
    """
    if len(responses) != len(examples):
        raise ValueError(
            f"safe_rewards: got {len(responses)} responses and {len(examples)} examples; they must "
            "be equal (one example per response; repeat prompts for groups)."
        )
    num_samples = len(responses)
    rewards = np.zeros([num_samples], np.float32)
    correct = np.zeros([num_samples], bool)
    format_ok = np.zeros([num_samples], bool)
    extracted: list[str | None] = [None] * num_samples
    all_results = True
    error_indices: list[int] = []
    first_error: str | None = None
    for index, (response, example) in enumerate(zip(responses, examples, strict=True)):
        try:
            reward, result = _as_reward(reward_fn(response, example))
        except Exception as error:  # noqa: BLE001 - any verifier failure is counted, by design
            description = (
                f"index {index} (example id {getattr(example, 'id', None)!r}): "
                f"{type(error).__name__}: {error}"
            )
            if raise_errors:
                raise RewardFunctionError(
                    f"safe_rewards: reward function failed at {description}"
                ) from error
            error_indices.append(index)
            if first_error is None:
                first_error = description
            continue
        rewards[index] = reward
        if result is None:
            all_results = False
        else:
            correct[index] = result.correct
            format_ok[index] = result.format_ok
            extracted[index] = result.extracted
    info: dict[str, Any] = {
        "reward_errors": len(error_indices),
        "first_error": first_error,
        "error_indices": error_indices,
        "correct": correct if all_results else None,
        "format_ok": format_ok if all_results else None,
        "extracted": extracted if all_results else None,
    }
    return rewards, info

"""Calls a reward function on a batch so that one failing sample cannot stop the run."""

from __future__ import annotations

import math
import numbers
from typing import Any, Protocol, Sequence

import numpy as np

from jrl.data import PromptExample
from jrl.rewards.custom import NamedRewards, accepts_token_ids
from jrl.rewards.math import RewardResult

# The largest |reward| accepted. Larger ones are reward errors: group statistics in float32
# (the std squares deviations: 1e20 ** 2 overflows) would turn their advantages to 0 or NaN,
# and no verifier means them.
MAX_ABS_REWARD = 1e6


class RewardFunction(Protocol):
    """A verifier: grades one response to one prompt.

    Returns a float reward, a RewardResult when it also knows correctness and format (then
    `safe_rewards` reports those too), or NamedRewards (jrl.rewards.custom). `math_reward` is
    one; wrap options with functools.partial. A function that also takes a third argument,
    token_ids (the response's token ids), is given it where they are known.
    """

    def __call__(self, response: str, example: PromptExample) -> float | RewardResult: ...


class RewardFunctionError(RuntimeError):
    """A reward function failed on a sample while `safe_rewards(..., raise_errors=True)`."""


def _as_reward(value: Any) -> tuple[float, RewardResult | None]:
    """(reward, result or None) from a reward function's return value; ValueError if unusable."""
    result = value if isinstance(value, RewardResult) else None
    reward = value.reward if isinstance(value, (RewardResult, NamedRewards)) else value
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise ValueError(
            f"returned {type(value).__name__} {value!r}; expected a float, a RewardResult or a dict of named parts"
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
    token_ids: Sequence[Sequence[int]] | None = None,
    raise_errors: bool = False,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Calls `reward_fn(responses[i], examples[i])` for every i and collects the rewards
    (`reward_fn(responses[i], examples[i], token_ids[i])` when token_ids are given and the
    function takes a third argument).

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
        "extracted": [N] list of str | None, or None, likewise;
        "parts": {name: [N] float32} of the NamedRewards parts, NaN where a call failed or
          did not return that part ({} when no call returned NamedRewards).
    """
    if len(responses) != len(examples):
        raise ValueError(
            f"safe_rewards: got {len(responses)} responses and {len(examples)} examples; they must "
            "be equal (one example per response; repeat prompts for groups)."
        )
    num_samples = len(responses)
    if token_ids is not None and len(token_ids) != num_samples:
        raise ValueError(f"safe_rewards: got {num_samples} responses and {len(token_ids)} "
                         "token id lists; they must be equal")
    with_ids = token_ids is not None and accepts_token_ids(reward_fn)
    parts: dict[str, np.ndarray] = {}
    rewards = np.zeros([num_samples], np.float32)
    correct = np.zeros([num_samples], bool)
    format_ok = np.zeros([num_samples], bool)
    extracted: list[str | None] = [None] * num_samples
    all_results = True
    error_indices: list[int] = []
    first_error: str | None = None
    for index, (response, example) in enumerate(zip(responses, examples, strict=True)):
        try:
            value = (reward_fn(response, example, token_ids[index]) if with_ids
                     else reward_fn(response, example))
            reward, result = _as_reward(value)
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
        if isinstance(value, NamedRewards):
            for name, part in value.parts.items():
                parts.setdefault(name, np.full([num_samples], np.nan, np.float32))[index] = part
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
        "parts": parts,
    }
    return rewards, info

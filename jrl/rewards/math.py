"""Math verifier: 1 for a correct final number, else 0, plus an optional format bonus/penalty."""

from __future__ import annotations

import math
from typing import NamedTuple

from jrl.data import PromptExample
from jrl.data.numbers import normalize_number, numbers_equal
from jrl.rewards.extract import EXTRACT_MODES, extract_answer


class RewardResult(NamedTuple):
    """One response's grade."""

    reward: float  # correctness reward + format bonus (or - format penalty)
    correct: bool  # extracted answer equals the reference answer
    extracted: str | None  # canonical extracted answer; None if none was found
    format_ok: bool  # the response states its answer in the required format


def _check_nonnegative_finite(name: str, value: float) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(
            f"math_reward: {name}={value!r} is not allowed; it must be a finite number >= 0."
        )


def math_reward(
    response: str,
    example: PromptExample,
    *,
    mode: str = "auto",
    format_mode: str = "hash",
    format_reward: float = 0.0,
    format_penalty: float = 0.0,
    correct_reward: float = 1.0,
    tol: float = 1e-6,
) -> RewardResult:
    """Grades a response against `example.answer` (a canonical number string).

        reward = correct_reward * [extract_answer(response, mode) == answer]
                 + (format_reward if format_ok else -format_penalty)
        format_ok = extract_answer(response, mode=format_mode) is not None

    Correctness uses `numbers_equal(..., tol=tol)`: exact rational equality, or |diff| <= tol.
    The format term defaults to 0 (pure correctness, as in the GRPO/DAPO papers); set
    format_reward > 0 to pay for the "####" format during a cold start, or format_penalty > 0
    to charge responses that never state a final answer in it.

    Args:
      response: the decoded response text (prompt excluded).
      example: anything with an `answer` attribute holding the reference number (PromptExample).
      mode: how to find the answer to grade; one of EXTRACT_MODES.
      format_mode: which extraction defines "well formatted"; one of "hash", "boxed", "last_number".
      format_reward, format_penalty, correct_reward: >= 0.
      tol: absolute tolerance for numeric equality, >= 0.

    Raises:
      ValueError: a bad option, or a reference answer that is not a number (a data error: it names
        the example id).
    """
    if format_mode not in ("hash", "boxed", "last_number"):
        raise ValueError(
            f"math_reward: format_mode={format_mode!r} is not allowed; "
            "allowed: 'hash', 'boxed', 'last_number'."
        )
    if mode not in EXTRACT_MODES:
        raise ValueError(
            f"math_reward: mode={mode!r} is not allowed; allowed modes: {EXTRACT_MODES}."
        )
    _check_nonnegative_finite("format_reward", format_reward)
    _check_nonnegative_finite("format_penalty", format_penalty)
    _check_nonnegative_finite("correct_reward", correct_reward)
    reference = example.answer
    if not isinstance(reference, str) or normalize_number(reference) is None:
        raise ValueError(
            f"math_reward: example id={getattr(example, 'id', None)!r} has answer={reference!r}, "
            "which is not a number (allowed: integers, decimals, a/b)."
        )
    extracted = extract_answer(response, mode=mode)
    correct = numbers_equal(extracted, reference, tol=tol)
    format_ok = extract_answer(response, mode=format_mode) is not None
    reward = (correct_reward if correct else 0.0) + (
        format_reward if format_ok else -format_penalty
    )
    return RewardResult(
        reward=float(reward), correct=correct, extracted=extracted, format_ok=format_ok
    )

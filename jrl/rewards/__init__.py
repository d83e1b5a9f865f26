"""Verifiers: numeric answer extraction, exact-match math reward, a user's own reward function
(named parts, weights), error-tolerant batch calls.

Plain Python + numpy; imports nothing jax-heavy. Overlong length shaping is in jrl.losses.shaping.
"""

from jrl.data.numbers import normalize_number, numbers_equal, numbers_in_text, parse_number
from jrl.rewards.extract import (
    EXTRACT_MODES,
    extract_answer,
    extract_boxed,
    extract_hash,
    extract_last_number,
)
from jrl.rewards.custom import CustomReward, NamedRewards
from jrl.rewards.math import RewardResult, math_reward
from jrl.rewards.safe import RewardFunction, RewardFunctionError, safe_rewards

__all__ = [
    "CustomReward",
    "EXTRACT_MODES",
    "NamedRewards",
    "RewardFunction",
    "RewardFunctionError",
    "RewardResult",
    "extract_answer",
    "extract_boxed",
    "extract_hash",
    "extract_last_number",
    "math_reward",
    "normalize_number",
    "numbers_equal",
    "numbers_in_text",
    "parse_number",
    "safe_rewards",
]

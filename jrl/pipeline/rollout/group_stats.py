"""Statistics of one finished group on the host, in numpy.

The admission queue computes them on sampler threads, outside its lock. They are numpy twins of
jrl.losses.useful_groups (one group) and jrl.losses.overlong_penalty: the same float32
formulas, checked against those references in tests/pipeline/test_group_stats.py (equal, up to
one ulp where XLA's CPU division rounds differently from numpy's correctly rounded one). JAX
dispatch from sampler threads holding the admission lock would serialise them behind device
work.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Spread(NamedTuple):
    """useful: the group's rewards differ (its advantages carry signal; DAPO keeps it);
    all_correct / all_wrong: zero spread at a common reward > 0 / <= 0."""

    useful: bool
    all_correct: bool
    all_wrong: bool


def reward_spread(rewards: np.ndarray) -> Spread:
    """rewards [G] of one group -> Spread (jrl.losses.useful_groups with correct_above=0)."""
    rewards = np.asarray(rewards, np.float32)
    high = rewards.max()
    useful = bool(high > rewards.min())
    return Spread(useful, not useful and bool(high > 0.0), not useful and not bool(high > 0.0))


def overlong_penalty(lengths: np.ndarray, *, max_len: int, buffer_len: int,
                     factor: float) -> np.ndarray:
    """DAPO's soft overlong penalty (arXiv:2503.14476 eq. 13), [G] lengths -> [G] float32 <= 0:

        0 up to max_len - buffer_len, then -factor * (L - (max_len - buffer_len)) / buffer_len,
        -factor from max_len on.

    0 < buffer_len <= max_len (RunConfig validates it)."""
    lengths = np.asarray(lengths, np.float32)
    ramp = (lengths - np.float32(max_len - buffer_len)) / np.float32(buffer_len)
    # 0.0 - x rather than -x: no penalty is 0.0, not -0.0 (as in jrl.losses).
    return np.float32(0.0) - np.float32(factor) * np.clip(ramp, np.float32(0.0),
                                                          np.float32(1.0))

"""Reward shaping: DAPO's soft overlong penalty (added to the task reward, not a loss term)."""

from __future__ import annotations

import jax.numpy as jnp

from jrl.losses._utils import Array, check_positive, f32


def overlong_penalty(
    lengths: Array,
    *,
    max_len: int,
    buffer_len: int,
    factor: float = 1.0,
) -> Array:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

        R_len(L) = 0                                      if L <= max_len - buffer_len
                 = -factor * (L - (max_len - buffer_len)) / buffer_len
                                                          if max_len - buffer_len < L <= max_len
                 = -factor                                if L > max_len

    E.g. max_len 20480, buffer_len 4096: no penalty up to 16384, -0.5 at 18432, -1 from 20480.
    It smooths the reward cliff a truncated answer would otherwise hit.

    Args:
      lengths: [B] response lengths in tokens (int or float).
      max_len: L_max, where the penalty reaches -factor; > 0.
      buffer_len: width of the linear ramp; 0 < buffer_len <= max_len.
      factor: size of the full penalty, >= 0.

    Returns:
      [B] float32 penalties (<= 0), to ADD to the rewards. No gradient (rewards are data).
    """
    where = "overlong_penalty"
    check_positive(where, "max_len", max_len)
    check_positive(where, "buffer_len", buffer_len)
    check_positive(where, "factor", factor, allow_zero=True)
    if buffer_len > max_len:
        raise ValueError(
            f"{where}: buffer_len={buffer_len!r} is not allowed; it must be <= max_len={max_len!r}."
        )
    lengths = f32(lengths)
    start = max_len - buffer_len
    ramp = (lengths - start) / buffer_len
    # 0.0 - x rather than -x: no penalty prints as 0.0, not -0.0.
    return 0.0 - factor * jnp.clip(ramp, 0.0, 1.0)

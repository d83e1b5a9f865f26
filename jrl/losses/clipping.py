"""Clipped policy-gradient objectives: PPO, clip-higher (DAPO), dual-clip, CISPO.

Objectives here are per-token quantities to MAXIMISE; the chain negates the aggregate to get a
loss. Advantages are stop-gradient everywhere. The functions are elementwise, so they take no
mask: the reduction (`aggregate`) is what excludes masked tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, broadcast_per_sequence, check_positive, f32


class ClippedObjective(NamedTuple):
    """Output of `clipped_objective`; all fields have the shape of `ratio`."""

    objective: Array  # float32 per-token surrogate to maximise
    clipped_low: Array  # bool: A < 0 and r < 1 - eps_low; the clip is active, gradient is 0
    clipped_high: Array  # bool: A > 0 and r > 1 + eps_high; the clip is active, gradient is 0
    dual_clipped: Array  # bool: A < 0 and r > dual_clip; the dual bound is active, gradient is 0


class CISPOObjective(NamedTuple):
    """Output of `cispo_objective`; all fields have the shape of `ratio`."""

    objective: Array  # float32 per-token surrogate to maximise (its gradient is what matters)
    clipped_low: Array  # bool: r < 1 - eps_low; the weight was raised to the lower bound
    clipped_high: Array  # bool: r > 1 + eps_high; the weight was lowered to the upper bound


def check_clip_params(
    where: str, eps_low: float, eps_high: float, dual_clip: float | None = None
) -> None:
    """Raises ValueError for eps < 0 or a dual-clip bound that is not > 1."""
    check_positive(where, "eps_low", eps_low, allow_zero=True)
    check_positive(where, "eps_high", eps_high, allow_zero=True)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(
            f"{where}: dual_clip={dual_clip!r} is not allowed; it must be None or a number > 1."
        )


def clipped_objective(
    ratio: Array,
    advantages: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None = None,
) -> ClippedObjective:
    """PPO clipped surrogate with separate lower/upper ranges and optional dual-clip.

        l_t = min( r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t )
        if dual_clip = c (c > 1) and A_t < 0:   l_t = max(l_t, c A_t)

    - Symmetric PPO (Schulman et al. 2017, arXiv:1707.06347): eps_low == eps_high (e.g. 0.2).
    - Clip-higher (DAPO, Yu et al. 2025, arXiv:2503.14476): eps_high > eps_low (0.2 / 0.28),
      so rare tokens with A > 0 can grow further before their gradient stops.
    - Dual-clip (Ye et al. 2020, arXiv:1912.09729): bounds the objective of an A < 0 token whose
      ratio ran away upward (r > c), where plain PPO keeps the unbounded term r A. Off by default
      (None), as in the GRPO, DAPO and GSPO papers; verl's default c is 3.

    The min makes the clip one-sided: only an excursion in the favourable direction loses its
    gradient (A > 0 and r > 1 + eps_high; A < 0 and r < 1 - eps_low); an excursion in the wrong
    direction keeps r A and its gradient, which pulls the ratio back.

    Args:
      ratio: [B, T] (or [B] for sequence-level use) importance ratio; carries the gradient.
      advantages: same shape as ratio, or one dimension less ([B] against [B, T], broadcast
        along T); stop-gradient.
      eps_low, eps_high: clip ranges, >= 0.
      dual_clip: None, or the bound c > 1 for A < 0.

    Returns:
      ClippedObjective(objective, clipped_low, clipped_high, dual_clipped), float32 / bool.
    """
    check_clip_params("clipped_objective", eps_low, eps_high, dual_clip)
    ratio = f32(ratio)
    advantages = jax.lax.stop_gradient(broadcast_per_sequence(advantages, ratio.shape))
    chex.assert_equal_shape([ratio, advantages])
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    objective = jnp.minimum(unclipped, clipped)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    if dual_clip is None:
        dual_clipped = jnp.zeros_like(clipped_low)
    else:
        bound = dual_clip * advantages
        objective = jnp.where(advantages < 0, jnp.maximum(objective, bound), objective)
        dual_clipped = (advantages < 0) & (ratio > dual_clip)
    return ClippedObjective(objective, clipped_low, clipped_high, dual_clipped)


def cispo_objective(
    ratio: Array,
    advantages: Array,
    logp: Array,
    *,
    eps_low: float,
    eps_high: float,
) -> CISPOObjective:
    """CISPO: the clipped ratio as a stop-gradient weight on A * logp.

        l_t = sg[ clip(r_t, 1 - eps_low, 1 + eps_high) ] * A_t * logp_t

    (MiniMax-M1, arXiv:2506.13585.) The gradient is w_t A_t grad logp_t for EVERY token: the
    clip bounds the weight's size but, unlike PPO, never zeroes a token's gradient, so rare
    "fork" tokens whose ratio grew fast still learn. The value of l_t is not a surrogate of the
    return (it includes logp_t); only its gradient is meaningful. The paper sets no lower bound
    (eps_low large, e.g. 1.0: weight >= 0) and tunes only eps_high.

    Args:
      ratio: [B, T] importance ratio; stop-gradient here (only the weight's value is used).
      advantages: [B, T] or [B]; stop-gradient.
      logp: [B, T] current logprob; carries the gradient.
      eps_low, eps_high: weight bounds 1 - eps_low and 1 + eps_high, >= 0.

    Returns:
      CISPOObjective(objective, clipped_low, clipped_high).
    """
    check_clip_params("cispo_objective", eps_low, eps_high)
    ratio = jax.lax.stop_gradient(f32(ratio))
    logp = f32(logp)
    chex.assert_equal_shape([ratio, logp])
    advantages = jax.lax.stop_gradient(broadcast_per_sequence(advantages, ratio.shape))
    weight = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    objective = weight * advantages * logp
    return CISPOObjective(objective, ratio < 1.0 - eps_low, ratio > 1.0 + eps_high)

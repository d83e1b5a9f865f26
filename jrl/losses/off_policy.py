"""Off-policy corrections against the behaviour policy p_b: TIS weights and MIS masks.

Both compare a training-side logprob (usually p_old, recomputed by the trainer) with the logprob
the sampler recorded when it drew the token (p_b / behavior_logp). Their outputs are
stop-gradient: they reweight or drop tokens, they are not optimised. Unlike the PPO clip, which
uses the sign of the advantage to clip one side, TIS truncation is a plain cap on the weight to
bound variance; `tis_clipfrac` and `pg_clipfrac_*` measure different things.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import (
    Array,
    as_mask,
    check_choice,
    check_positive,
    clip_log_ratio,
    f32,
    masked_log_ratio,
)
from jrl.losses.ratios import DEFAULT_LOG_RATIO_CLIP, sequence_log_ratio

MIS_LEVELS = ("token", "sequence")


class TISWeights(NamedTuple):
    """Output of `tis_weights`; all [B, T], stop-gradient."""

    weights: Array  # float32 clip(w, cap_low, cap): multiply the per-token objective by it
    raw_weights: Array  # float32 w = exp(logp - behavior_logp) before truncation (for metrics)
    clipped: Array  # bool: w was outside [cap_low, cap]


class MISMask(NamedTuple):
    """Output of `mis_mask`; all [B, T], stop-gradient."""

    keep: Array  # float32 in {0, 1}: 1 where the token is valid and accepted
    ratio: Array  # float32 the ratio tested: per token, or the sequence's geometric mean


def tis_weights(
    logp: Array,
    behavior_logp: Array,
    *,
    cap: float,
    cap_low: float = 0.0,
    mask: Array | None = None,
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP,
    level: str = "token",
) -> TISWeights:
    """Truncated importance-sampling weights, w_t = min(p_train / p_b, cap).

        level="token":    w_t = clip( exp(logp_t - behavior_logp_t), cap_low, cap )
        level="sequence": w_t = clip( exp(sum_s (logp_s - behavior_logp_s)), cap_low, cap ) for
                          every token t of the sequence: the product of its token ratios, the
                          unbiased sequence-level weight (verl's rollout_is="sequence"); its
                          variance grows with the length, which the cap bounds.

    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
    Ionides 2008 for truncated IS.) Truncation trades a little bias for bounded variance.

    Args:
      logp: [B, T] training-side logprob (p_old by default in the chain); treated as
        stop-gradient here: the weight is a constant factor on the objective.
      behavior_logp: [B, T] sampler logprob p_b; stop-gradient.
      cap: upper truncation, > 0 (typical: 2.0).
      cap_low: lower truncation, >= 0 (0: none).
      mask: optional [B, T]; masked positions get weight exactly 1.
      log_ratio_clip: clamp before exp (of the token or the summed sequence log-ratio); None
        disables.
      level: "token" or "sequence".

    Returns:
      TISWeights(weights, raw_weights, clipped); at sequence level every token of a sequence
      carries the sequence's weight (masked positions 1).
    """
    where = "tis_weights"
    check_choice(where, "level", level, MIS_LEVELS)
    check_positive(where, "cap", cap)
    check_positive(where, "cap_low", cap_low, allow_zero=True)
    if not cap_low < cap:
        raise ValueError(f"{where}: cap_low={cap_low!r} is not allowed; it must be < cap={cap!r}.")
    chex.assert_equal_shape([logp, behavior_logp])
    log_w = jax.lax.stop_gradient(masked_log_ratio(logp, behavior_logp, mask))
    if level == "sequence":
        valid = as_mask(mask) if mask is not None else jnp.ones(log_w.shape, bool)
        per_sequence = jnp.sum(log_w, axis=-1, keepdims=True)
        log_w = jnp.where(valid, jnp.broadcast_to(per_sequence, log_w.shape), 0.0)
    raw = jnp.exp(clip_log_ratio(log_w, log_ratio_clip))
    weights = jnp.clip(raw, cap_low, cap)
    clipped = (raw > cap) | (raw < cap_low)
    if mask is not None:
        clipped = clipped & as_mask(mask)
    return TISWeights(weights, raw, clipped)


def mis_mask(
    logp: Array,
    behavior_logp: Array,
    *,
    threshold: float,
    level: str,
    lower_threshold: float | None = None,
    mask: Array | None = None,
) -> MISMask:
    """Masked importance sampling: drop tokens or sequences whose p_train / p_b is out of range.

    keep = 1 if lower_threshold <= rho <= threshold else 0, with

    - level="token":    rho_t = exp(logp_t - behavior_logp_t), per token;
    - level="sequence": rho_i = exp(mean_t (logp_{i,t} - behavior_logp_{i,t})), the GEOMETRIC
      mean over the sequence's valid tokens, applied to all its tokens. Never the raw product
      prod_t rho_t: on a 10k-token sequence it under/overflows even when every token is fine.

    The comparison is done on log-ratios (log lower <= log rho <= log threshold), so no exp can
    overflow. (Yao et al. 2025 / the "MIS" of the seed article; verl's rollout rejection.)

    Args:
      logp: [B, T] training-side logprob; stop-gradient here.
      behavior_logp: [B, T] sampler logprob p_b; stop-gradient.
      threshold: upper bound on rho, > 1 (e.g. 2.0).
      level: "token" or "sequence".
      lower_threshold: lower bound on rho, in (0, threshold); default 1 / threshold.
      mask: optional [B, T]; invalid tokens get keep = 0 and are excluded from sequence means.

    Returns:
      MISMask(keep, ratio).
    """
    where = "mis_mask"
    check_choice(where, "level", level, MIS_LEVELS)
    if not threshold > 1.0:
        raise ValueError(f"{where}: threshold={threshold!r} is not allowed; it must be > 1.")
    if lower_threshold is None:
        lower_threshold = 1.0 / threshold
    if not 0.0 < lower_threshold < threshold:
        raise ValueError(
            f"{where}: lower_threshold={lower_threshold!r} is not allowed; it must be in "
            f"(0, threshold={threshold!r})."
        )
    chex.assert_rank(logp, 2)
    chex.assert_equal_shape([logp, behavior_logp])
    logp = jax.lax.stop_gradient(f32(logp))
    valid = jnp.ones(logp.shape, bool) if mask is None else as_mask(mask)
    if level == "token":
        log_rho = masked_log_ratio(logp, behavior_logp, valid)
    else:
        log_rho = jnp.broadcast_to(
            sequence_log_ratio(logp, behavior_logp, valid)[:, None], logp.shape
        )
    accepted = (log_rho >= jnp.log(lower_threshold)) & (log_rho <= jnp.log(threshold))
    keep = (accepted & valid).astype(jnp.float32)
    ratio = jnp.exp(clip_log_ratio(log_rho, DEFAULT_LOG_RATIO_CLIP))
    return MISMask(keep, ratio)

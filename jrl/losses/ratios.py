"""Importance ratios: per-token (PPO/GRPO) and per-sequence geometric mean (GSPO, GSPO-token).

All ratios are pi_theta / pi_denominator with the denominator (old_logp) stop-gradient and the
numerator (logp) carrying the gradient. They are computed from log-probabilities in float32.

Log-ratio clamp (frameworks disagree): by default the log-ratio is clamped to [-20, 20] before
exp, as verl does. exp(20) ~ 4.9e8 is far outside any clip range, so the clamp never changes a
ratio that matters, but it keeps one runaway token from making the ratio inf in f32 (exp overflows
above ~88.7), which would turn the loss into inf and the gradients into NaN. Beyond the clamp the
ratio's gradient is 0. Pass `log_ratio_clip=None` for the unclamped exp.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, as_mask, clip_log_ratio, f32, masked_log_ratio

DEFAULT_LOG_RATIO_CLIP = 20.0


def token_ratio(
    logp: Array,
    old_logp: Array,
    mask: Array | None = None,
    *,
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP,
) -> Array:
    """Per-token importance ratio r_t = exp(logp_t - old_logp_t) (PPO, Schulman et al. 2017).

    Args:
      logp: [B, T] current-policy logprob of each sampled token; carries the gradient.
      old_logp: [B, T] denominator logprob (p_old, or p_b); stop-gradient.
      mask: optional [B, T]; masked positions get ratio exactly 1 and zero gradient, whatever
        values logp / old_logp hold there.
      log_ratio_clip: clamp of logp - old_logp before exp (see module docstring); None disables.

    Returns:
      [B, T] float32 ratio. Equal inputs give exactly 1.0.
    """
    chex.assert_equal_shape([logp, old_logp])
    if mask is not None:
        chex.assert_equal_shape([logp, mask])
    log_ratio = masked_log_ratio(logp, old_logp, mask)
    return jnp.exp(clip_log_ratio(log_ratio, log_ratio_clip))


def sequence_log_ratio(logp: Array, old_logp: Array, mask: Array) -> Array:
    """Length-normalised sequence log-ratio: mean over valid tokens of (logp - old_logp).

    [B, T] x3 -> [B]. A sequence with no valid token gets 0. old_logp is stop-gradient.
    """
    chex.assert_rank(logp, 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    log_ratio = masked_log_ratio(logp, old_logp, mask)
    lengths = jnp.sum(as_mask(mask), axis=-1)
    return jnp.sum(log_ratio, axis=-1) / jnp.maximum(lengths, 1)


def sequence_ratio(
    logp: Array,
    old_logp: Array,
    mask: Array,
    *,
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP,
) -> Array:
    """GSPO sequence ratio: the geometric mean of the token ratios of each sequence.

        s_i = exp( (1/|y_i|) sum_t (logp_{i,t} - old_logp_{i,t}) ) = (prod_t r_{i,t}) ** (1/|y_i|)

    (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071.) Unlike the raw
    product prod_t r_t (the strict trajectory ratio, which explodes or underflows on long
    sequences: 1.01 ** 1000 ~ 2.1e4), s_i stays on the scale of one token ratio. It is not an
    unbiased sequence-level importance weight.

    Gradient ("full" GSPO): ds_i / dlogp_{i,t} = s_i / |y_i| for every valid t, so each token's
    gradient depends on the whole sequence. See `sequence_ratio_token` for GSPO-token.

    Args:
      logp: [B, T] current logprob; carries the gradient.
      old_logp: [B, T] denominator; stop-gradient.
      mask: [B, T] valid tokens; only they enter the mean.
      log_ratio_clip: clamp of the mean log-ratio before exp; None disables.

    Returns:
      [B] float32 sequence ratios (1.0 for a sequence without valid tokens).
    """
    return jnp.exp(clip_log_ratio(sequence_log_ratio(logp, old_logp, mask), log_ratio_clip))


def sequence_ratio_token(
    logp: Array,
    old_logp: Array,
    mask: Array,
    *,
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP,
) -> Array:
    """GSPO-token ratio: the sequence value in the forward pass, a per-token gradient.

        s_{i,t} = sg[s_i] * exp(logp_{i,t} - sg[logp_{i,t}])

    Its value is s_i at every valid token (exp(0) = 1), but ds_{i,t} / dlogp_{i,t} = s_i and
    ds_{i,t} / dlogp_{i,t'} = 0 for t' != t: each token gets its own gradient, which lets
    per-token advantages act token by token (GSPO paper, section 4.3). With per-sequence
    advantages and the seq_mean_token_mean reduction it gives the same gradient as
    `sequence_ratio`; frameworks disagree on which of the two "GSPO" means, so both exist.

    Args / shapes as `sequence_ratio`; returns [B, T] float32 (masked positions: exactly 1 with
    zero gradient; the value there is irrelevant since reductions skip them).
    """
    seq = jax.lax.stop_gradient(sequence_ratio(logp, old_logp, mask, log_ratio_clip=log_ratio_clip))
    logp = f32(logp)
    # logp - sg(logp) is 0 in value; it only routes a gradient of 1 to each own token.
    own = jnp.where(as_mask(mask), logp - jax.lax.stop_gradient(logp), 0.0)
    return seq[:, None] * jnp.exp(own)

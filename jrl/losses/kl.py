"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled by pi_theta.

With log_r = ref_logp - logp (the log of pi_ref / pi_theta at the sampled token),
Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html):

    k1 = -log_r                  unbiased, high variance, can be negative
    k2 = 0.5 * log_r ** 2        biased, low variance, >= 0
    k3 = exp(log_r) - log_r - 1  unbiased, low variance, >= 0 (GRPO's choice)
    abs = |log_r|                verl's "abs": a distance, not a KL estimate

Straight-through (verl's "k3+" / "low_var_kl+"): the value of the chosen estimator with the
gradient of k2, k2 + stop_gradient(k - k2). k2's gradient, -log_r * d logp, is the one whose
expectation is the gradient of KL(pi_theta || pi_ref); k3's own gradient is not.

Importance-weighted (DeepSeek-V3.2's "unbiased KL estimate"; slime's `--use-unbiased-kl`): the
tokens come from pi_old, not pi_theta, so each estimate is weighted by rho = pi_theta / pi_old,
which makes it unbiased under pi_old (see `importance_weighted_kl`).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, check_choice, check_positive, clip_log_ratio, masked_log_ratio
from jrl.losses.ratios import DEFAULT_LOG_RATIO_CLIP, token_ratio

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl_estimate(
    logp: Array,
    ref_logp: Array,
    kind: str,
    *,
    mask: Array | None = None,
    clamp: float | None = None,
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP,
    straight_through: bool = False,
) -> Array:
    """Per-token KL(pi_theta || pi_ref) estimate, k1 / k2 / k3 / abs (see module docstring).

    Clamping (frameworks disagree): `clamp=None` (default) returns the textbook estimator, so the
    logged reference KL is the real one. `clamp=c` clips the estimate to [-c, c]; verl's
    "low_var_kl" is k3 with c = 10. Independently, for k3 the log-ratio is clamped to
    [-log_ratio_clip, log_ratio_clip] (default 20, as for ratios) before exp, so exp never
    overflows to inf.

    Args:
      logp: [B, T] current-policy logprob; carries the gradient.
      ref_logp: [B, T] reference-policy logprob; stop-gradient.
      kind: "k1", "k2" or "k3".
      mask: optional [B, T]; masked positions give exactly 0 with zero gradient.
      clamp: optional bound c > 0 on |estimate|.
      log_ratio_clip: clamp of log_r before exp in k3; None disables.
      straight_through: the estimate's value with k2's gradient.

    Returns:
      [B, T] float32 per-token estimates (reduce them with `aggregate`).
    """
    where = "kl_estimate"
    check_choice(where, "kind", kind, KL_KINDS)
    if clamp is not None:
        check_positive(where, "clamp", clamp)
    chex.assert_equal_shape([logp, ref_logp])
    # ref_logp is the stop-gradient side: log_r = sg(ref_logp) - logp.
    log_r = -masked_log_ratio(logp, ref_logp, mask)
    if kind == "k1":
        estimate = -log_r
    elif kind == "k2":
        estimate = 0.5 * log_r**2
    elif kind == "abs":
        estimate = jnp.abs(log_r)
    else:
        estimate = jnp.exp(clip_log_ratio(log_r, log_ratio_clip)) - log_r - 1.0
    if clamp is not None:
        estimate = jnp.clip(estimate, -clamp, clamp)
    if straight_through:
        k2 = 0.5 * log_r**2
        estimate = k2 + jax.lax.stop_gradient(estimate - k2)
    return estimate


def importance_weighted_kl(
    logp: Array,
    ref_logp: Array,
    old_logp: Array,
    kind: str = "k3",
    *,
    mask: Array | None = None,
    clamp: float | None = None,
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP,
) -> Array:
    """Per-token KL(pi_theta || pi_ref) estimate for tokens sampled by pi_old: rho * k.

        rho_t = exp(logp_t - sg(old_logp_t))            (pi_theta / pi_old, per token)
        kl_t  = rho_t * k_t(logp_t, ref_logp_t)          (k = k1 / k2 / k3 / abs, as kl_estimate)
        kl_t  = clip(kl_t, -clamp, clamp)                if clamp is set (after weighting)

    DeepSeek-V3.2 (arXiv:2512.02556, "Unbiased KL Estimate"); slime's `--use-unbiased-kl`
    (compute_approx_kl with importance_ratio = exp(log_probs - old_log_probs)). With tokens
    drawn from pi_old, E_old[rho * k] = E_theta[k], so rho * k3 is an unbiased estimate of
    KL(pi_theta || pi_ref), where plain k3 is biased as soon as pi_theta moves from pi_old.

    rho carries gradient (as in slime and in the paper; only old_logp is stop-gradient). For k3
    the gradient is then d(rho * k3) / d logp = rho * (logp - ref_logp): the per-token gradient
    of KL(pi_theta || pi_ref), importance-weighted to pi_old (plain k3's gradient,
    1 - pi_ref / pi_theta, is not). The order is slime's: estimator, then weight, then clamp
    (its "low_var_kl" is k3 with clamp=10 applied to rho * k3, not to k3).

    Args:
      logp: [B, T] current-policy logprob (pi_theta); carries the gradient, through rho and k.
      ref_logp: [B, T] reference-policy logprob; stop-gradient.
      old_logp: [B, T] logprob of the policy that sampled the tokens (p_old, or p_b); the
        denominator of rho; stop-gradient.
      kind: "k1", "k2", "k3" (default) or "abs".
      mask: optional [B, T]; masked positions give exactly 0 with zero gradient.
      clamp: optional bound c > 0 on |rho * k|.
      log_ratio_clip: clamp of logp - old_logp before exp in rho (as token_ratio), and of the
        k3 log-ratio before exp; None disables both.

    Returns:
      [B, T] float32 per-token estimates (reduce them with `aggregate`). Equals
      kl_estimate(logp, ref_logp, kind) when old_logp == logp (rho is then exactly 1).
    """
    where = "importance_weighted_kl"
    check_choice(where, "kind", kind, KL_KINDS)
    if clamp is not None:
        check_positive(where, "clamp", clamp)
    chex.assert_equal_shape([logp, ref_logp, old_logp])
    rho = token_ratio(logp, old_logp, mask, log_ratio_clip=log_ratio_clip)
    estimate = rho * kl_estimate(logp, ref_logp, kind, mask=mask, log_ratio_clip=log_ratio_clip)
    if clamp is not None:
        estimate = jnp.clip(estimate, -clamp, clamp)
    return estimate

"""The loss transforms a chain is built from, one small frozen dataclass per stage element.

    ratio:       TokenRatio, SequenceRatio
    correction:  TIS, MIS (off-policy corrections of the sampler/trainer drift)
    objective:   PPOClip, CISPO
    aggregation: Aggregate
    regularizer: KLPenalty, EntropyBonus, LoadBalance (MoE)

Each is called as `transform(inputs, state) -> (state, metrics)` (see jrl.losses.chain).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jrl.losses._utils import (
    Array,
    as_mask,
    check_choice,
    check_positive,
    f32,
    masked_fraction,
    masked_max,
    masked_mean,
    masked_min,
)
from jrl.losses.aggregation import aggregate, check_aggregation
from jrl.losses.balance import load_balance_loss
from jrl.losses.chain import ChainState as State
from jrl.losses.chain import LossInputs, Metrics
from jrl.losses.clipping import check_clip_params, cispo_objective, clipped_objective
from jrl.losses.kl import KL_KINDS, importance_weighted_kl, kl_estimate
from jrl.losses.off_policy import MIS_LEVELS, mis_mask, tis_weights
from jrl.losses.ratios import (
    DEFAULT_LOG_RATIO_CLIP,
    sequence_ratio,
    sequence_ratio_token,
    token_ratio,
)
from jrl.metrics import names


def _require(inputs: LossInputs, field: str, who: str) -> Array:
    value = getattr(inputs, field)
    if value is None:
        raise ValueError(f"{who} needs LossInputs.{field}, but it is None.")
    return value


def _normalizer(inputs: LossInputs, mode: str, max_len: int | None) -> Array | None:
    """The whole-batch denominator for `mode`, when the inputs carry global counts."""
    if mode == "token_mean":
        return inputs.global_num_tokens
    if inputs.global_num_sequences is None:
        return None
    if mode == "token_sum_norm":
        return jnp.float32(max_len)
    if mode == "constant":
        return f32(inputs.global_num_sequences) * max_len
    return inputs.global_num_sequences


def _ratio_metrics(inputs: LossInputs, ratio: Array, mask: Array) -> Metrics:
    ratio = jax.lax.stop_gradient(ratio)
    # ppo_kl is k1 between p_old and p_c, whatever denominator the ratio uses.
    ppo_kl = jax.lax.stop_gradient(
        jnp.where(mask, f32(inputs.old_logp) - f32(inputs.logp), 0.0)
    )
    return {
        names.TRAIN_RATIO_MIN: masked_min(ratio, mask),
        names.TRAIN_RATIO_MEAN: masked_mean(ratio, mask),
        names.TRAIN_RATIO_MAX: masked_max(ratio, mask),
        names.TRAIN_PPO_KL: masked_mean(ppo_kl, mask),
    }


# ----------------------------------------------------------------------------- ratio stage


@dataclasses.dataclass(frozen=True)
class TokenRatio:
    """r_t = p_c / p_denominator per token (PPO / GRPO / DAPO). See ratios.token_ratio.

    denominator: "old" uses old_logp (p_old, the default); "behavior" uses behavior_logp
      (p_b, the sampler's own logprob, as when a framework skips the trainer recompute).
    """

    denominator: str = "old"
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP
    stage: ClassVar[str] = "ratio"

    def __post_init__(self):
        check_choice("TokenRatio", "denominator", self.denominator, ("old", "behavior"))

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        denom = _require(inputs, f"{self.denominator}_logp", repr(self))
        mask = state["mask"]
        ratio = token_ratio(inputs.logp, denom, mask, log_ratio_clip=self.log_ratio_clip)
        return {**state, "ratio": ratio}, _ratio_metrics(inputs, ratio, mask)


@dataclasses.dataclass(frozen=True)
class SequenceRatio:
    """GSPO geometric-mean sequence ratio, broadcast to every token of the sequence.

    token_grad=False: GSPO (ratios.sequence_ratio): the gradient of s_i reaches all its tokens
      as s_i / |y_i|. token_grad=True: GSPO-token (ratios.sequence_ratio_token): same value,
      per-token gradient s_i.
    """

    token_grad: bool = False
    denominator: str = "old"
    log_ratio_clip: float | None = DEFAULT_LOG_RATIO_CLIP
    stage: ClassVar[str] = "ratio"

    def __post_init__(self):
        check_choice("SequenceRatio", "denominator", self.denominator, ("old", "behavior"))
        check_choice("SequenceRatio", "token_grad", self.token_grad, (False, True))

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        denom = _require(inputs, f"{self.denominator}_logp", repr(self))
        mask = state["mask"]
        if self.token_grad:
            ratio = sequence_ratio_token(
                inputs.logp, denom, mask, log_ratio_clip=self.log_ratio_clip
            )
        else:
            seq = sequence_ratio(inputs.logp, denom, mask, log_ratio_clip=self.log_ratio_clip)
            ratio = jnp.broadcast_to(seq[:, None], mask.shape)
        return {**state, "ratio": ratio}, _ratio_metrics(inputs, ratio, mask)


# ------------------------------------------------------------------- off-policy corrections


def _train_side_logp(inputs: LossInputs, numerator: str) -> Array:
    # "old": p_old / p_b is the pure numerical + staleness gap (the PPO ratio already covers
    # p_c / p_old, so using p_c here would count the policy update twice).
    return inputs.old_logp if numerator == "old" else inputs.logp


@dataclasses.dataclass(frozen=True)
class TIS:
    """Truncated IS: multiply each token's objective by sg[clip(p_train / p_b, cap_low, cap)].

    numerator: "old" (default) uses p_old / p_b, the decoupled form of verl / slime; "current"
    uses p_c / p_b (for chains whose ratio denominator is not p_old). level: "token" (default)
    or "sequence" (the product of the sequence's token ratios, capped). See
    off_policy.tis_weights. Metrics tis_mean / tis_abs describe the raw weights (drift),
    tis_clipfrac the truncation.
    """

    cap: float = 2.0
    cap_low: float = 0.0
    numerator: str = "old"
    level: str = "token"
    stage: ClassVar[str] = "correction"

    def __post_init__(self):
        check_choice("TIS", "numerator", self.numerator, ("old", "current"))
        check_choice("TIS", "level", self.level, MIS_LEVELS)
        check_positive("TIS", "cap", self.cap)
        check_positive("TIS", "cap_low", self.cap_low, allow_zero=True)
        if not self.cap_low < self.cap:
            raise ValueError(f"TIS: cap_low={self.cap_low!r} is not allowed; it must be < cap.")

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        behavior = _require(inputs, "behavior_logp", repr(self))
        mask = state["mask"]
        tis = tis_weights(
            _train_side_logp(inputs, self.numerator),
            behavior,
            cap=self.cap,
            cap_low=self.cap_low,
            mask=mask,
            level=self.level,
        )
        metrics = {
            names.TRAIN_TIS_MEAN: masked_mean(tis.raw_weights, mask),
            names.TRAIN_TIS_ABS: masked_mean(jnp.abs(tis.raw_weights - 1.0), mask),
            names.TRAIN_TIS_CLIPFRAC: masked_fraction(tis.clipped, mask),
        }
        return {**state, "weight": state["weight"] * tis.weights}, metrics


@dataclasses.dataclass(frozen=True)
class MIS:
    """Masked IS: drop tokens (or whole sequences) whose p_train / p_b leaves the threshold range.

    normalize_by (frameworks disagree on token_mean's denominator after masking):
      "all" (default): dropped tokens still count in the denominator; dropping a token removes
        its contribution without raising the weight of the others, so the gradient scale does
        not jump when many tokens are rejected.
      "kept": dropped tokens leave the denominator too (mean over the kept tokens).
    See off_policy.mis_mask for `threshold`, `level`, `lower_threshold`; `numerator` as in TIS.
    """

    threshold: float = 2.0
    level: str = "token"
    lower_threshold: float | None = None
    numerator: str = "old"
    normalize_by: str = "all"
    stage: ClassVar[str] = "correction"

    def __post_init__(self):
        check_choice("MIS", "level", self.level, MIS_LEVELS)
        check_choice("MIS", "numerator", self.numerator, ("old", "current"))
        check_choice("MIS", "normalize_by", self.normalize_by, ("all", "kept"))
        if not self.threshold > 1.0:
            raise ValueError(f"MIS: threshold={self.threshold!r} is not allowed; it must be > 1.")

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        behavior = _require(inputs, "behavior_logp", repr(self))
        mask = state["mask"]
        mis = mis_mask(
            _train_side_logp(inputs, self.numerator),
            behavior,
            threshold=self.threshold,
            level=self.level,
            lower_threshold=self.lower_threshold,
            mask=mask,
        )
        new = {**state, "weight": state["weight"] * mis.keep}
        if self.normalize_by == "kept":
            new["agg_mask"] = state["agg_mask"] & (mis.keep > 0)
        return new, {names.TRAIN_MIS_MASKED_FRAC: masked_fraction(mis.keep == 0, mask)}


# --------------------------------------------------------------------------- objective stage


@dataclasses.dataclass(frozen=True)
class PPOClip:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), optional dual-clip; see clipped_objective.

    eps_low == eps_high: PPO / GRPO; eps_high > eps_low: DAPO clip-higher. dual_clip=None: off.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    stage: ClassVar[str] = "objective"

    def __post_init__(self):
        # Config errors surface when the chain is built, not at the first train step.
        check_clip_params("PPOClip", self.eps_low, self.eps_high, self.dual_clip)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        mask = state["mask"]
        out = clipped_objective(
            state["ratio"],
            state["advantages"],
            eps_low=self.eps_low,
            eps_high=self.eps_high,
            dual_clip=self.dual_clip,
        )
        metrics = {
            names.TRAIN_PG_CLIPFRAC_LOW: masked_fraction(out.clipped_low, mask),
            names.TRAIN_PG_CLIPFRAC_HIGH: masked_fraction(out.clipped_high, mask),
        }
        if self.dual_clip is not None:
            metrics[names.TRAIN_PG_CLIPFRAC_DUAL] = masked_fraction(out.dual_clipped, mask)
        return {**state, "objective": out.objective}, metrics


@dataclasses.dataclass(frozen=True)
class CISPO:
    """sg[clip(r, 1 - eps_low, 1 + eps_high)] * A * logp (clipping.cispo_objective).

    Defaults: eps_low=1.0 (no lower bound: the weight is >= 0 anyway), as MiniMax-M1 describes.
    eps_high: the paper does not publish its value ("we only tuned eps_high"); implementations
    differ widely (verl's example caps the weight at 1.2, Tinker at 4, citing ScaleRL, NeMo RL
    at 6). We default to 2.0 (weight cap 3.0), between those; tune it for your run.
    """

    eps_low: float = 1.0
    eps_high: float = 2.0
    stage: ClassVar[str] = "objective"

    def __post_init__(self):
        check_clip_params("CISPO", self.eps_low, self.eps_high)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        mask = state["mask"]
        out = cispo_objective(
            state["ratio"],
            state["advantages"],
            inputs.logp,
            eps_low=self.eps_low,
            eps_high=self.eps_high,
        )
        metrics = {
            names.TRAIN_PG_CLIPFRAC_LOW: masked_fraction(out.clipped_low, mask),
            names.TRAIN_PG_CLIPFRAC_HIGH: masked_fraction(out.clipped_high, mask),
        }
        return {**state, "objective": out.objective}, metrics


# ------------------------------------------------------------------------- aggregation stage


@dataclasses.dataclass(frozen=True)
class Aggregate:
    """pg_loss = -aggregate(objective * weight, agg_mask, mode) (aggregation.aggregate).

    Uses LossInputs.global_num_tokens / global_num_sequences as the denominator when given.
    """

    mode: str = "token_mean"
    max_len: int | None = None
    stage: ClassVar[str] = "aggregation"

    def __post_init__(self):
        check_aggregation("Aggregate", self.mode, self.max_len)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        values = state["objective"] * jax.lax.stop_gradient(state["weight"])
        pg_loss = -aggregate(
            values,
            state["agg_mask"],
            self.mode,
            max_len=self.max_len,
            normalizer=_normalizer(inputs, self.mode, self.max_len),
        )
        return {**state, "loss": state["loss"] + pg_loss}, {names.TRAIN_PG_LOSS: pg_loss}


# ------------------------------------------------------------------------ regularizer stage


@dataclasses.dataclass(frozen=True)
class KLPenalty:
    """kl_loss = beta * aggregate(kl_estimate(logp, ref_logp, kind), mask, mode).

    GRPO puts the KL inside its per-sequence mean (mode="seq_mean_token_mean", k3, beta 0.04).
    straight_through: the estimator's value with k2's gradient (verl's "k3+"; see
    jrl.losses.kl). importance_weighted: each token's estimate times rho = p_c / p_old, which
    carries gradient (DeepSeek-V3.2's unbiased KL, slime's --use-unbiased-kl; see
    kl.importance_weighted_kl); `clamp` then bounds rho * k. The two options exclude each
    other. Metrics: train/ref_kl is the token-mean estimate (unscaled; rho * k when importance
    weighted); train/kl_loss the loss term.
    """

    beta: float = 0.04
    kind: str = "k3"
    mode: str = "token_mean"
    max_len: int | None = None
    clamp: float | None = None
    straight_through: bool = False
    importance_weighted: bool = False
    stage: ClassVar[str] = "regularizer"

    def __post_init__(self):
        check_choice("KLPenalty", "kind", self.kind, KL_KINDS)
        check_positive("KLPenalty", "beta", self.beta, allow_zero=True)
        check_aggregation("KLPenalty", self.mode, self.max_len)
        check_choice("KLPenalty", "importance_weighted", self.importance_weighted, (False, True))
        if self.importance_weighted and self.straight_through:
            # Peers define neither combination; rho * k3 already has the per-token KL gradient
            # rho * (logp - ref_logp) that straight-through is after.
            raise ValueError("KLPenalty: importance_weighted=True and straight_through=True "
                             "exclude each other; choose one.")

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        ref = _require(inputs, "ref_logp", repr(self))
        mask = state["mask"]
        if self.importance_weighted:
            kl = importance_weighted_kl(inputs.logp, ref, inputs.old_logp, self.kind,
                                        mask=mask, clamp=self.clamp)
        else:
            kl = kl_estimate(inputs.logp, ref, self.kind, mask=mask, clamp=self.clamp,
                             straight_through=self.straight_through)
        kl_loss = self.beta * aggregate(
            kl, mask, self.mode, max_len=self.max_len,
            normalizer=_normalizer(inputs, self.mode, self.max_len),
        )
        metrics = {
            names.TRAIN_REF_KL: masked_mean(jax.lax.stop_gradient(kl), mask),
            names.TRAIN_KL_LOSS: kl_loss,
        }
        return {**state, "loss": state["loss"] + kl_loss}, metrics


@dataclasses.dataclass(frozen=True)
class EntropyBonus:
    """entropy_loss = -coef * aggregate(entropy, mask, mode): minimising it raises entropy."""

    coef: float = 1e-3
    mode: str = "token_mean"
    max_len: int | None = None
    stage: ClassVar[str] = "regularizer"

    def __post_init__(self):
        check_positive("EntropyBonus", "coef", self.coef, allow_zero=True)
        check_aggregation("EntropyBonus", self.mode, self.max_len)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        entropy = _require(inputs, "entropy", repr(self))
        mask = state["mask"]
        entropy_loss = -self.coef * aggregate(
            entropy, mask, self.mode, max_len=self.max_len,
            normalizer=_normalizer(inputs, self.mode, self.max_len),
        )
        metrics = {
            names.TRAIN_ENTROPY: masked_mean(jax.lax.stop_gradient(f32(entropy)), mask),
            names.TRAIN_ENTROPY_LOSS: entropy_loss,
        }
        return {**state, "loss": state["loss"] + entropy_loss}, metrics




@dataclasses.dataclass(frozen=True)
class LoadBalance:
    """load_balance_loss = coef * E * sum_e f_e P_e (jrl.losses.balance; Switch / Qwen-MoE's
    auxiliary loss; transformers' router_aux_loss_coef is 0.001).

    Needs LossInputs.router_probs / router_experts / router_mask (a train step built for an MoE
    model fills them when the chain holds this transform: `needs_router`). Computed per
    micro-batch (the pooled means are not additive) and weighted by the micro-batch's share
    of the mini-batch's tokens, inputs.mask.sum() / global_num_tokens, so equal micro-batches
    average to one value. Metric: train/load_balance_loss (the weighted term).
    """

    coef: float = 0.001
    stage: ClassVar[str] = "regularizer"
    needs_router: ClassVar[bool] = True

    def __post_init__(self):
        check_positive("LoadBalance", "coef", self.coef, allow_zero=True)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        probs = _require(inputs, "router_probs", repr(self))
        experts = _require(inputs, "router_experts", repr(self))
        router_mask = _require(inputs, "router_mask", repr(self))
        term = self.coef * load_balance_loss(probs, experts, router_mask)
        if inputs.global_num_tokens is not None:
            share = jnp.sum(f32(as_mask(inputs.mask))) / jnp.maximum(
                f32(inputs.global_num_tokens), 1.0)
            term = term * share
        return {**state, "loss": state["loss"] + term}, {names.TRAIN_LOAD_BALANCE_LOSS: term}

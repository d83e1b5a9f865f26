"""Composition of a policy loss from small transforms, and the paper presets.

A loss is a pipeline of stages, each a small frozen dataclass (its repr is its config):

    ratio -> [off-policy corrections] -> objective -> aggregation -> [KL, entropy terms]

Every transform is called as `transform(inputs, state) -> (state, metrics)`: `inputs` is the
read-only `LossInputs`, `state` a dict of intermediate arrays that each stage reads and extends
(a new dict is returned; nothing is mutated). `chain(*transforms)` checks the stage order once,
at build time, and returns a `Chain`, whose call `chain_fn(inputs) -> (loss, metrics)` is pure
and jit-able. The loss is the NEGATIVE objective, to minimise.

State keys (all float32 unless noted; [B, T] unless noted):
  mask        bool, valid tokens (from inputs.mask; never changed)
  agg_mask    bool, tokens counted by the policy-gradient reduction (MIS may shrink it)
  advantages  stop-gradient advantages broadcast to [B, T]
  weight      stop-gradient per-token factor on the objective (TIS, MIS); starts at 1
  ratio       importance ratio (set by the ratio stage)
  objective   per-token surrogate to maximise (set by the objective stage)
  loss        scalar total loss so far

A custom transform is any object with a `stage` attribute (one of STAGES) and that call
signature; a frozen dataclass gives it a readable repr for free.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import (
    Array,
    as_mask,
    broadcast_per_sequence,
    check_choice,
    check_positive,
    f32,
    masked_fraction,
    masked_max,
    masked_mean,
    masked_min,
)
from jrl.losses.aggregation import AGGREGATION_MODES, aggregate
from jrl.losses.clipping import check_clip_params, cispo_objective, clipped_objective
from jrl.losses.kl import KL_KINDS, kl_estimate
from jrl.losses.off_policy import MIS_LEVELS, mis_mask, tis_weights
from jrl.losses.ratios import (
    DEFAULT_LOG_RATIO_CLIP,
    sequence_ratio,
    sequence_ratio_token,
    token_ratio,
)

State = dict[str, Any]
Metrics = dict[str, Array]

STAGES = ("ratio", "correction", "objective", "aggregation", "regularizer")

# Metric names every chain returns (0.0 where a term is absent or the mask is empty).
METRIC_NAMES = (
    "train/loss",
    "train/pg_loss",
    "train/kl_loss",
    "train/entropy_loss",
    "train/pg_clipfrac_low",
    "train/pg_clipfrac_high",
    "train/ppo_kl",
    "train/ratio_min",
    "train/ratio_mean",
    "train/ratio_max",
    "train/tis_mean",
    "train/tis_abs",
    "train/tis_clipfrac",
    "train/mis_masked_frac",
    "train/ref_kl",
    "train/entropy",
)


class LossInputs(NamedTuple):
    """Per-batch inputs of a loss chain (a pytree; None fields are simply absent).

    logp:          [B, T] p_c, current-policy logprob of each sampled token; the only input
                   that carries gradient.
    old_logp:      [B, T] p_old, the PPO denominator for this update epoch; stop-gradient.
    advantages:    [B] per sequence or [B, T] per token; stop-gradient.
    mask:          [B, T] valid response tokens (nonzero = valid).
    behavior_logp: [B, T] p_b recorded by the sampler; needed by TIS / MIS /
                   TokenRatio(denominator="behavior"); stop-gradient.
    ref_logp:      [B, T] p_ref of the frozen reference policy; needed by KLPenalty.
    entropy:       [B, T] per-token entropy of the current policy; needed by EntropyBonus
                   (carries gradient there); otherwise only logged.
    global_num_tokens, global_num_sequences: optional scalars; when the batch is split into
                   micro-batches, pass the WHOLE batch's counts (see aggregation.num_tokens /
                   num_sequences) so that the micro-batch losses sum to the full-batch loss.
    """

    logp: Array
    old_logp: Array
    advantages: Array
    mask: Array
    behavior_logp: Array | None = None
    ref_logp: Array | None = None
    entropy: Array | None = None
    global_num_tokens: Array | float | None = None
    global_num_sequences: Array | float | None = None


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
    if mode == "constant":
        return f32(inputs.global_num_sequences) * max_len
    return inputs.global_num_sequences


def _check_aggregation(where: str, mode: str, max_len: int | None) -> None:
    check_choice(where, "mode", mode, AGGREGATION_MODES)
    if mode == "constant" and (max_len is None or max_len <= 0):
        raise ValueError(
            f"{where}: max_len={max_len!r} is not allowed with mode='constant'; "
            "it must be a positive int."
        )


def _ratio_metrics(inputs: LossInputs, ratio: Array, mask: Array) -> Metrics:
    ratio = jax.lax.stop_gradient(ratio)
    # ppo_kl is k1 between p_old and p_c, whatever denominator the ratio uses.
    ppo_kl = jax.lax.stop_gradient(
        jnp.where(mask, f32(inputs.old_logp) - f32(inputs.logp), 0.0)
    )
    return {
        "train/ratio_min": masked_min(ratio, mask),
        "train/ratio_mean": masked_mean(ratio, mask),
        "train/ratio_max": masked_max(ratio, mask),
        "train/ppo_kl": masked_mean(ppo_kl, mask),
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
    uses p_c / p_b (for chains whose ratio denominator is not p_old). See off_policy.tis_weights.
    Metrics tis_mean / tis_abs describe the raw weights (drift), tis_clipfrac the truncation.
    """

    cap: float = 2.0
    cap_low: float = 0.0
    numerator: str = "old"
    stage: ClassVar[str] = "correction"

    def __post_init__(self):
        check_choice("TIS", "numerator", self.numerator, ("old", "current"))
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
        )
        metrics = {
            "train/tis_mean": masked_mean(tis.raw_weights, mask),
            "train/tis_abs": masked_mean(jnp.abs(tis.raw_weights - 1.0), mask),
            "train/tis_clipfrac": masked_fraction(tis.clipped, mask),
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
        return new, {"train/mis_masked_frac": masked_fraction(mis.keep == 0, mask)}


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
            "train/pg_clipfrac_low": masked_fraction(out.clipped_low, mask),
            "train/pg_clipfrac_high": masked_fraction(out.clipped_high, mask),
        }
        if self.dual_clip is not None:
            metrics["train/pg_clipfrac_dual"] = masked_fraction(out.dual_clipped, mask)
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
            "train/pg_clipfrac_low": masked_fraction(out.clipped_low, mask),
            "train/pg_clipfrac_high": masked_fraction(out.clipped_high, mask),
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
        _check_aggregation("Aggregate", self.mode, self.max_len)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        values = state["objective"] * jax.lax.stop_gradient(state["weight"])
        pg_loss = -aggregate(
            values,
            state["agg_mask"],
            self.mode,
            max_len=self.max_len,
            normalizer=_normalizer(inputs, self.mode, self.max_len),
        )
        return {**state, "loss": state["loss"] + pg_loss}, {"train/pg_loss": pg_loss}


# ------------------------------------------------------------------------ regularizer stage


@dataclasses.dataclass(frozen=True)
class KLPenalty:
    """kl_loss = beta * aggregate(kl_estimate(logp, ref_logp, kind), mask, mode).

    GRPO puts the KL inside its per-sequence mean (mode="seq_mean_token_mean", k3, beta 0.04).
    Metrics: train/ref_kl is the token-mean estimate (unscaled); train/kl_loss the loss term.
    """

    beta: float = 0.04
    kind: str = "k3"
    mode: str = "token_mean"
    max_len: int | None = None
    clamp: float | None = None
    stage: ClassVar[str] = "regularizer"

    def __post_init__(self):
        check_choice("KLPenalty", "kind", self.kind, KL_KINDS)
        check_positive("KLPenalty", "beta", self.beta, allow_zero=True)
        _check_aggregation("KLPenalty", self.mode, self.max_len)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        ref = _require(inputs, "ref_logp", repr(self))
        mask = state["mask"]
        kl = kl_estimate(inputs.logp, ref, self.kind, mask=mask, clamp=self.clamp)
        kl_loss = self.beta * aggregate(
            kl, mask, self.mode, max_len=self.max_len,
            normalizer=_normalizer(inputs, self.mode, self.max_len),
        )
        metrics = {
            "train/ref_kl": masked_mean(jax.lax.stop_gradient(kl), mask),
            "train/kl_loss": kl_loss,
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
        _check_aggregation("EntropyBonus", self.mode, self.max_len)

    def __call__(self, inputs: LossInputs, state: State) -> tuple[State, Metrics]:
        entropy = _require(inputs, "entropy", repr(self))
        mask = state["mask"]
        entropy_loss = -self.coef * aggregate(
            entropy, mask, self.mode, max_len=self.max_len,
            normalizer=_normalizer(inputs, self.mode, self.max_len),
        )
        metrics = {
            "train/entropy": masked_mean(jax.lax.stop_gradient(f32(entropy)), mask),
            "train/entropy_loss": entropy_loss,
        }
        return {**state, "loss": state["loss"] + entropy_loss}, metrics


# -------------------------------------------------------------------------------- the chain


def init_state(inputs: LossInputs) -> State:
    """Checks shapes and builds the initial state (see the module docstring for its keys)."""
    chex.assert_rank(inputs.logp, 2)
    shaped = [inputs.logp, inputs.old_logp, inputs.mask]
    shaped += [x for x in (inputs.behavior_logp, inputs.ref_logp, inputs.entropy) if x is not None]
    chex.assert_equal_shape(shaped)
    mask = as_mask(inputs.mask)
    advantages = jax.lax.stop_gradient(broadcast_per_sequence(inputs.advantages, mask.shape))
    return {
        "mask": mask,
        "agg_mask": mask,
        "advantages": advantages,
        "weight": jnp.ones(mask.shape, jnp.float32),
        "loss": jnp.float32(0.0),
    }


def _monitor_metrics(inputs: LossInputs, state: State, metrics: Metrics) -> Metrics:
    """Fills the METRIC_NAMES a chain's transforms did not produce (monitoring only)."""
    mask = state["mask"]
    out = dict(metrics)
    sg = jax.lax.stop_gradient
    if "train/tis_mean" not in out and inputs.behavior_logp is not None:
        # No TIS applied: still report the p_old / p_b drift it would have corrected.
        raw = tis_weights(sg(inputs.old_logp), inputs.behavior_logp, cap=jnp.inf, mask=mask)
        out["train/tis_mean"] = masked_mean(raw.raw_weights, mask)
        out["train/tis_abs"] = masked_mean(jnp.abs(raw.raw_weights - 1.0), mask)
    if "train/ref_kl" not in out and inputs.ref_logp is not None:
        kl = kl_estimate(sg(inputs.logp), inputs.ref_logp, "k3", mask=mask)
        out["train/ref_kl"] = masked_mean(kl, mask)
    if "train/entropy" not in out and inputs.entropy is not None:
        out["train/entropy"] = masked_mean(sg(f32(inputs.entropy)), mask)
    for name in METRIC_NAMES:
        out.setdefault(name, jnp.float32(0.0))
    out["train/loss"] = state["loss"]
    return out


@dataclasses.dataclass(frozen=True)
class Chain:
    """A loss built from transforms; call it as `loss, metrics = chain_fn(inputs)`."""

    transforms: tuple[Any, ...]
    name: str | None = None

    def __call__(self, inputs: LossInputs) -> tuple[Array, Metrics]:
        state = init_state(inputs)
        metrics: Metrics = {}
        for transform in self.transforms:
            state, new_metrics = transform(inputs, state)
            metrics.update(new_metrics)
        return state["loss"], _monitor_metrics(inputs, state, metrics)

    def __repr__(self) -> str:
        lines = ["chain("] + [f"    {t!r}," for t in self.transforms]
        if self.name is not None:
            lines.append(f"    name={self.name!r},")
        return "\n".join(lines) + "\n)"


def chain(*transforms: Any, name: str | None = None) -> Chain:
    """Composes transforms into a loss: `chain(TokenRatio(), PPOClip(), Aggregate())`.

    Stages must come in the order of STAGES: exactly one "ratio", any number of "correction",
    exactly one "objective", exactly one "aggregation", then any number of "regularizer".
    Raises ValueError at build time otherwise.
    """
    ranks = []
    for transform in transforms:
        stage = getattr(transform, "stage", None)
        if stage not in STAGES or not callable(transform):
            raise ValueError(
                f"chain: {transform!r} is not a transform; it needs a `stage` attribute in "
                f"{STAGES} and a __call__(inputs, state) -> (state, metrics)."
            )
        ranks.append(STAGES.index(stage))
    if ranks != sorted(ranks):
        order = [STAGES[r] for r in ranks]
        raise ValueError(f"chain: stages {order} are out of order; the order is {STAGES}.")
    for stage in ("ratio", "objective", "aggregation"):
        count = ranks.count(STAGES.index(stage))
        if count != 1:
            raise ValueError(f"chain: needs exactly one {stage!r} transform, got {count}.")
    return Chain(tuple(transforms), name)


# ------------------------------------------------------------------------------- presets


def _regularizers(kl_beta: float, kl_kind: str, kl_mode: str, entropy_coef: float) -> tuple:
    terms: tuple = ()
    if kl_beta:
        terms += (KLPenalty(beta=kl_beta, kind=kl_kind, mode=kl_mode),)
    if entropy_coef:
        terms += (EntropyBonus(coef=entropy_coef),)
    return terms


def grpo(
    *,
    eps: float = 0.2,
    kl_beta: float = 0.04,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    corrections: tuple = (),
) -> Chain:
    """GRPO (DeepSeekMath, arXiv:2402.03300): token ratio, symmetric clip eps 0.2,
    seq_mean_token_mean, k3 KL to the reference with beta 0.04 inside the same reduction.

    kl_beta=0 drops the KL term (then ref_logp is only logged if given). Advantages:
    group_advantages(rewards, G) (std_power 1). `corrections`: e.g. (TIS(cap=2.0),).
    """
    return chain(
        TokenRatio(),
        *corrections,
        PPOClip(eps_low=eps, eps_high=eps),
        Aggregate(mode="seq_mean_token_mean"),
        *_regularizers(kl_beta, kl_kind, "seq_mean_token_mean", entropy_coef),
        name="grpo",
    )


def dapo(
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    entropy_coef: float = 0.0,
    corrections: tuple = (),
) -> Chain:
    """DAPO (arXiv:2503.14476): clip-higher eps 0.2 / 0.28, token_mean, no KL term.

    DAPO's other two parts live outside the loss: dynamic sampling (`useful_groups`) and the
    soft overlong penalty (`overlong_penalty`, added to rewards).
    """
    return chain(
        TokenRatio(),
        *corrections,
        PPOClip(eps_low=eps_low, eps_high=eps_high),
        Aggregate(mode="token_mean"),
        *_regularizers(0.0, "k3", "token_mean", entropy_coef),
        name="dapo",
    )


def dr_grpo(max_len: int, *, eps: float = 0.2, corrections: tuple = ()) -> Chain:
    """Dr.GRPO (arXiv:2503.20783): symmetric clip eps 0.2, constant reduction
    sum / (num_sequences * max_len), no KL. Pair it with group_advantages(..., std_power=0).
    """
    return chain(
        TokenRatio(),
        *corrections,
        PPOClip(eps_low=eps, eps_high=eps),
        Aggregate(mode="constant", max_len=max_len),
        name="dr_grpo",
    )


def gspo(
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    token_grad: bool = False,
    corrections: tuple = (),
) -> Chain:
    """GSPO (arXiv:2507.18071): geometric-mean sequence ratio, clip 3e-4 / 4e-4 (the paper's
    ranges; tiny because a sequence ratio moves far less than a token ratio), sequence mean
    (seq_mean_token_mean of a ratio constant along each sequence), no KL.
    token_grad=True gives GSPO-token. Clip fractions count tokens: a clipped sequence counts
    with all its tokens.
    """
    return chain(
        SequenceRatio(token_grad=token_grad),
        *corrections,
        PPOClip(eps_low=eps_low, eps_high=eps_high),
        Aggregate(mode="seq_mean_token_mean"),
        name="gspo-token" if token_grad else "gspo",
    )


def cispo(*, eps_low: float = 1.0, eps_high: float = 2.0, corrections: tuple = ()) -> Chain:
    """CISPO (MiniMax-M1, arXiv:2506.13585): stop-gradient clipped IS weight on A * logp,
    token_mean (the paper normalises by the total token count), no KL. See CISPO for eps_high.
    """
    return chain(
        TokenRatio(),
        *corrections,
        CISPO(eps_low=eps_low, eps_high=eps_high),
        Aggregate(mode="token_mean"),
        name="cispo",
    )


PRESETS: dict[str, Callable[..., Chain]] = {
    "grpo": grpo,
    "dapo": dapo,
    "dr_grpo": dr_grpo,
    "gspo": gspo,
    "cispo": cispo,
}

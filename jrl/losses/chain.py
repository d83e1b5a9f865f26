"""Composition of a policy loss from small transforms (jrl.losses.transforms; presets in
jrl.losses.presets).

A loss is a pipeline of stages, each a small frozen dataclass (its repr is its config):

    ratio -> [off-policy corrections] -> objective -> aggregation -> [KL, entropy terms]

Every transform is called as `transform(inputs, state) -> (state, metrics)`: `inputs` is the
read-only `LossInputs`, `state` a dict of intermediate arrays that each stage reads and extends
(a new dict is returned; nothing is mutated). `chain(*transforms)` checks the stage order once,
at build time, and returns a `Chain`, whose call `chain_fn(inputs) -> (loss, metrics)` is pure
and jit-able. The loss is the NEGATIVE objective, to minimise.

State keys (`ChainState`; all float32 unless noted; [B, T] unless noted):
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
from typing import Any, NamedTuple, TypedDict

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, as_mask, broadcast_per_sequence, f32, masked_mean
from jrl.losses.kl import kl_estimate
from jrl.losses.off_policy import tis_weights
from jrl.metrics import names


class ChainState(TypedDict, total=False):
    """The intermediate arrays a chain's stages read and extend (a plain dict at run time, so a
    custom transform may return `{**state, "weight": ...}`)."""

    mask: Array
    agg_mask: Array
    advantages: Array
    weight: Array
    ratio: Array
    objective: Array
    loss: Array


State = ChainState
Metrics = dict[str, Array]

STAGES = ("ratio", "correction", "objective", "aggregation", "regularizer")

# Metric names every chain returns (0.0 where a term is absent or the mask is empty).
METRIC_NAMES = (
    names.TRAIN_LOSS,
    names.TRAIN_PG_LOSS,
    names.TRAIN_KL_LOSS,
    names.TRAIN_ENTROPY_LOSS,
    names.TRAIN_PG_CLIPFRAC_LOW,
    names.TRAIN_PG_CLIPFRAC_HIGH,
    names.TRAIN_PPO_KL,
    names.TRAIN_RATIO_MIN,
    names.TRAIN_RATIO_MEAN,
    names.TRAIN_RATIO_MAX,
    names.TRAIN_TIS_MEAN,
    names.TRAIN_TIS_ABS,
    names.TRAIN_TIS_CLIPFRAC,
    names.TRAIN_MIS_MASKED_FRAC,
    names.TRAIN_REF_KL,
    names.TRAIN_ENTROPY,
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
    router_probs:  MoE: [B, T, L, E] router softmax per token and MoE layer (carries gradient);
                   router_experts [B, T, L, k] the router's top-k; router_mask [B, T] the tokens
                   they count over (every attended token). Needed by LoadBalance.
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
    router_probs: Array | None = None
    router_experts: Array | None = None
    router_mask: Array | None = None


# -------------------------------------------------------------------------------- the chain


def init_state(inputs: LossInputs) -> ChainState:
    """Checks shapes and builds the initial state (see the module docstring for its keys)."""
    chex.assert_rank(inputs.logp, 2)
    shaped = [inputs.logp, inputs.old_logp, inputs.mask]
    shaped += [x for x in (inputs.behavior_logp, inputs.ref_logp, inputs.entropy) if x is not None]
    chex.assert_equal_shape(shaped)
    mask = as_mask(inputs.mask)
    advantages = jax.lax.stop_gradient(broadcast_per_sequence(inputs.advantages, mask.shape))
    return ChainState(**{
        "mask": mask,
        "agg_mask": mask,
        "advantages": advantages,
        "weight": jnp.ones(mask.shape, jnp.float32),
        "loss": jnp.float32(0.0),
    })


def _monitor_metrics(inputs: LossInputs, state: State, metrics: Metrics) -> Metrics:
    """Fills the METRIC_NAMES a chain's transforms did not produce (monitoring only)."""
    mask = state["mask"]
    out = dict(metrics)
    sg = jax.lax.stop_gradient
    if names.TRAIN_TIS_MEAN not in out and inputs.behavior_logp is not None:
        # No TIS applied: still report the p_old / p_b drift it would have corrected.
        raw = tis_weights(sg(inputs.old_logp), inputs.behavior_logp, cap=jnp.inf, mask=mask)
        out[names.TRAIN_TIS_MEAN] = masked_mean(raw.raw_weights, mask)
        out[names.TRAIN_TIS_ABS] = masked_mean(jnp.abs(raw.raw_weights - 1.0), mask)
    if names.TRAIN_REF_KL not in out and inputs.ref_logp is not None:
        kl = kl_estimate(sg(inputs.logp), inputs.ref_logp, "k3", mask=mask)
        out[names.TRAIN_REF_KL] = masked_mean(kl, mask)
    if names.TRAIN_ENTROPY not in out and inputs.entropy is not None:
        out[names.TRAIN_ENTROPY] = masked_mean(sg(f32(inputs.entropy)), mask)
    for name in METRIC_NAMES:
        out.setdefault(name, jnp.float32(0.0))
    out[names.TRAIN_LOSS] = state["loss"]
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



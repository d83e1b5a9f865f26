"""One RL step's rollout -> a complete TrainBatch, in one pass, with its drift metrics.

    prepare_batch(rollout, trainer_version=v, current_params=..., held={version: params},
                  score_with=..., options=prepare_options(cfg),
                  advantages=recipe.advantages) -> PreparedBatch

What it computes (R rows, T positions; response = loss_mask):
- groups with a token older than `trainer_version - drop_stale_beyond` are dropped (whole groups);
- staleness[r, t] = trainer_version - versions[r, t] on response tokens (mean and max logged);
- p_o[r, t]: the train engine's logprob of the token under the weights that sampled it (the held
  version), and current[r, t] under the trainer's weights now; where it is redundant (the exact
  contract, old_logp "behavior", every token of the trainer's current version: p_o = p_b bit
  for bit by construction) only on sampled steps (options.p_o_every: the first RL step and
  every p_o_every-th), the others reporting no mismatch/* metrics;
- mismatch: numerical = |p_o - p_b| over reproducible held tokens (0 on the bitwise path),
  staleness = |current - p_o| over the same tokens (0 when nothing is stale);
- tokens the train engine scores -inf leave the loss mask (counted in train/excluded_tokens);
- old_logp = p_b ("behavior") or current ("recompute"); ref_logp from the reference policy;
- rewards - kl_reward_coef * sum_t (p_b - p_ref) when the reference shapes the reward;
- advantages: the recipe's estimator (the `advantages` argument, e.g. GroupAdvantages(std_power=0)
  for Dr.GRPO) over the kept groups (0 on padding rows).

- MoE models (options.route_shape set): the sampler's recorded routes are packed, compared with
  the train forward's router choices (jrl.pipeline.training.routing: mismatch/routing_agreement,
  routing_stale_flip_frac, train/expert_load_max) and, with options.routing == "replay", put in
  the TrainBatch for the train step to replay.

Device work is behind `score_with(packed) -> score(params) -> logp [R, T]`, which the trainer
provides: the packed arrays go to the train devices once and every version is scored on them.
For MoE models score returns (logp [R, T], routes [R, T, L_moe, k]): the router's own experts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from jrl.metrics import names
from jrl.pipeline.training.batching import PackedRollout, pack_rollout
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.pipeline.training.routing import routing_metrics
from jrl.sampling import Sample
from jrl.train.state import TrainBatch

# params -> logp [R, T] float32 on the host, or (logp, routes [R, T, L_moe, k] int32) for MoE.
Score = Callable[[Any], Any]


def _split_score(out) -> tuple[np.ndarray, np.ndarray | None]:
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
    """What prepare_batch needs from the run config (see PipelineSection, TrainSection,
    AlgorithmSection for each field's meaning)."""

    rows: int
    seq_len: int
    drop_stale_beyond: int | None = None
    kv_on_swap: str = "keep"
    old_logp: str = "behavior"
    reference: str = "none"
    kl_reward_coef: float = 0.0
    # MoE: (L_moe, k) of the model (the trainer sets it; None for dense models) and
    # model.routing ("replay" puts the recorded routes in the TrainBatch).
    route_shape: tuple[int, int] | None = None
    num_experts: int = 0
    routing: str = "recompute"
    # Exact contract (p_b is the train engine's own logprob) and the schedule of the redundant
    # p_o recompute (TrainSection.p_o_every).
    exact: bool = False
    p_o_every: int = 1



@dataclasses.dataclass
class PreparedBatch:
    """batch: the TrainBatch (numpy). metrics: rollout/*, mismatch/* and train/ref_kl.
    consumed: which versions the trainer consumed (rl_step, trainer_version, token_versions,
    staleness_max), kept for tests and the split-process log."""

    batch: TrainBatch
    metrics: dict
    consumed: dict


def drop_stale_groups(samples: list[Sample], rewards: np.ndarray, group_size: int, *,
                      trainer_version: int, limit: int) -> tuple[list[Sample], np.ndarray, int]:
    """Drops every group holding a token more than `limit` versions behind `trainer_version`.
    Returns (kept samples, their rewards, number of samples dropped)."""
    def oldest(sample: Sample) -> int:
        # Observation tokens of multi-turn episodes carry version -1: only model tokens count.
        return int(sample.versions[sample.model_token_mask()].min(initial=trainer_version))
    keep = [g for g in range(len(samples) // group_size)
            if trainer_version - min(oldest(s) for s in
                                     samples[g * group_size:(g + 1) * group_size]) <= limit]
    rows = [g * group_size + j for g in keep for j in range(group_size)]
    return ([samples[r] for r in rows], np.asarray(rewards, np.float32)[rows],
            len(samples) - len(rows))


def prepare_batch(rollout: RolloutBatch, *, trainer_version: int, current_params: Any,
                  held: Mapping[int, Any], score_with: Callable[[PackedRollout], Score],
                  options: PrepareOptions, advantages: Callable[[Any, int], Any],
                  reference: Any = None) -> PreparedBatch:
    """The complete TrainBatch of one RL step (see the module docstring for each field).
    advantages: the recipe's estimator, rewards [N], group_size -> [N] (Recipe.advantages).

    held: version -> params of earlier policies still kept by the trainer (the current version
    may be among them; it is scored with current_params). reference: the frozen reference
    policy's params, or None.
    """
    metrics = dict(rollout.metrics)
    samples, rewards, group = rollout.samples, rollout.rewards, rollout.group_size
    dropped = 0
    if options.drop_stale_beyond is not None and samples:
        samples, rewards, dropped = drop_stale_groups(
            samples, rewards, group, trainer_version=trainer_version,
            limit=options.drop_stale_beyond)
    metrics[names.ROLLOUT_DROPPED_STALE] = dropped

    packed = pack_rollout(samples, num_rows=options.rows, seq_len=options.seq_len,
                          route_shape=options.route_shape)
    response, versions = packed.loss_mask, packed.versions
    any_response = bool(response.any())
    staleness = np.where(response, trainer_version - versions, 0)
    metrics[names.ROLLOUT_STALENESS_MEAN] = (float(staleness[response].mean()) if any_response
                                             else 0.0)
    metrics[names.ROLLOUT_STALENESS_MAX] = int(staleness.max()) if any_response else 0

    if _p_o_is_redundant(rollout.rl_step, response, versions, trainer_version, options):
        # p_o = current = p_b: no train-engine pass but the reference's, no mismatch metrics.
        ref_scores = (_split_score(score_with(packed)(reference))[0] if reference is not None
                      else None)
        impossible = (response & np.isinf(ref_scores) if ref_scores is not None
                      else np.zeros_like(response))
        metrics[names.TRAIN_EXCLUDED_TOKENS] = int(impossible.sum())
        return _prepared(rollout, packed, samples, rewards, metrics, options, estimator=advantages,
                         current_logp=packed.behavior_logp, reference=reference,
                         ref_scores=ref_scores, trained=response & ~impossible,
                         trainer_version=trainer_version)
    # p_o for every held version: the train engine on the weights that sampled the token.
    score = score_with(packed)
    current_logp, current_routes = _split_score(score(current_params))
    scored_routes = {trainer_version: current_routes}
    p_o = np.where(versions == trainer_version, current_logp, np.nan)
    for version, params in held.items():
        if version != trainer_version and np.any(response & (versions == version)):
            logp_v, scored_routes[version] = _split_score(score(params))
            p_o = np.where(versions == version, logp_v, p_o)
    # A token is reproducible by one version when every KV entry it attended to was computed
    # with that version: always after a KV recompute on weight swap; with the KV kept, only
    # while the sample has not crossed a swap (versions never decrease along a sample).
    first_version = np.where(response, versions, np.iinfo(np.int32).max).min(axis=1)
    single_version = response & (versions == first_version[:, None])
    reproducible = response if options.kv_on_swap == "recompute" else single_version
    # A sampled token the train engine scores as impossible (logprob -inf: e.g. the XLA path's
    # replay of a top-k/top-p floor that excludes it) has no ratio and no gradient: it leaves
    # the loss and is counted, instead of turning the loss into inf / NaN.
    ref_scores = _split_score(score(reference))[0] if reference is not None else None
    impossible = response & (np.isinf(current_logp) | np.isinf(p_o))
    if ref_scores is not None:
        impossible |= response & np.isinf(ref_scores)
    metrics[names.TRAIN_EXCLUDED_TOKENS] = int(impossible.sum())
    held_mask = reproducible & ~np.isnan(p_o) & ~impossible
    # Select before subtracting: excluded entries may be -inf on both sides.
    numerical = np.abs(p_o[held_mask] - packed.behavior_logp[held_mask])
    stale = np.abs(current_logp[held_mask] - p_o[held_mask])
    num_response = max(int(response.sum()), 1)
    trained = response & ~impossible
    metrics[names.MISMATCH_KV_MIXED_TOKEN_FRAC] = float((response & ~reproducible).sum()
                                                        / num_response)
    metrics[names.MISMATCH_LOGPROB_ABS_DIFF_MAX] = float(numerical.max()) if numerical.size else 0.0
    metrics[names.MISMATCH_NUMERICAL_ABS] = float(numerical.mean()) if numerical.size else 0.0
    metrics[names.MISMATCH_STALENESS_ABS] = float(stale.mean()) if stale.size else 0.0
    metrics[names.MISMATCH_HELD_TOKEN_FRAC] = float(held_mask.sum() / num_response)
    if packed.routes is not None and current_routes is not None:
        metrics.update(routing_metrics(
            packed.routes, scored_routes, versions=versions, loss_mask=response,
            attn_mask=packed.attn_mask, trainer_version=trainer_version,
            kv_on_swap=options.kv_on_swap, num_experts=options.num_experts))
    return _prepared(rollout, packed, samples, rewards, metrics, options, estimator=advantages,
                     current_logp=current_logp, reference=reference, ref_scores=ref_scores,
                     trained=trained, trainer_version=trainer_version)


def _p_o_is_redundant(rl_step: int, response: np.ndarray, versions: np.ndarray,
                      trainer_version: int, options: PrepareOptions) -> bool:
    """Whether this step skips the p_o recompute: the exact contract, old_logp "behavior",
    every response token sampled by the trainer's current version, and not a sampled step
    (the first, and every p_o_every-th)."""
    return (options.exact and options.old_logp == "behavior" and options.p_o_every > 1
            and rl_step % options.p_o_every != 0 and bool(response.any())
            and bool(np.all(versions[response] == trainer_version)))


def _prepared(rollout: RolloutBatch, packed: PackedRollout, samples: list, rewards, metrics: dict,
              options: PrepareOptions, *, estimator: Callable, current_logp: np.ndarray,
              reference: Any, ref_scores: np.ndarray | None, trained: np.ndarray,
              trainer_version: int) -> PreparedBatch:
    """The PreparedBatch from the scores: old_logp, ref_logp (ref_scores: the reference's
    logp, None without one), the reference's reward shaping and the advantages; trained: the
    response tokens in the loss."""
    response, versions, group = packed.loss_mask, packed.versions, rollout.group_size
    consumed = {"rl_step": rollout.rl_step, "trainer_version": trainer_version,
                "token_versions": sorted(set(versions[response].tolist())),
                "staleness_max": metrics[names.ROLLOUT_STALENESS_MAX]}
    old_logp = np.where(trained, packed.behavior_logp, 0.0).astype(np.float32)
    if options.old_logp == "recompute":
        old_logp = np.where(trained, current_logp, 0.0).astype(np.float32)
    rewards_full = np.zeros((options.rows,), np.float32)
    rewards_full[:len(samples)] = rewards
    ref_logp = np.zeros_like(packed.behavior_logp)
    if reference is not None:
        ref_logp = np.where(trained, ref_scores, 0.0).astype(np.float32)
        if options.reference == "reward":
            k1 = np.where(trained, packed.behavior_logp - ref_logp, 0.0).sum(axis=1)
            rewards_full = rewards_full - options.kl_reward_coef * k1
            metrics[names.TRAIN_REF_KL] = float(k1[:len(samples)].mean()) if samples else 0.0
    advantages = np.zeros((options.rows,), np.float32)
    num_kept = (len(samples) // group) * group
    if num_kept:
        advantages[:num_kept] = np.asarray(estimator(rewards_full[:num_kept], group))
    batch = TrainBatch(tokens=packed.tokens, attn_mask=packed.attn_mask,
                       loss_mask=trained, advantages=advantages, old_logp=old_logp,
                       behavior_logp=packed.behavior_logp, ref_logp=ref_logp,
                       logit_floor=packed.logit_floor,
                       routes=packed.routes if options.routing == "replay" else None)
    return PreparedBatch(batch, metrics, consumed)

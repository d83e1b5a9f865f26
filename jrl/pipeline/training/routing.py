"""MoE routing metrics of one RL step: the sampler's recorded experts against the train forward's.

    routing_metrics(recorded, scored, versions=..., loss_mask=..., attn_mask=..., ...) -> dict

Arrays are the packed rollout's: R rows, T positions, L_moe MoE layers, k experts per token.
recorded [R, T, L, k] int32 holds the sampler's routes (-1 where none: padding, a response's last
token); scored maps a policy version to the train forward's router choices [R, T, L, k] under
those weights (host numpy).

Which weights produced a recorded route: the sampler routes position t when it feeds that token,
in the forward that draws the NEXT model token, so the route carries that token's version
(route_versions). A route is reproducible by one version when every KV entry it attended to was
computed with that version: with the KV cache kept across weight swaps, only while its sample
has not crossed a swap; after a KV refresh, always (the same rule as the logprob mismatch in
jrl.pipeline.training.prepare).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jrl.metrics import names


def route_versions(versions: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """[R, T] int32: the version of the first model token after position t (-1 if none).

    versions [R, T] int32 (the token's version at model tokens, -1 elsewhere), loss_mask [R, T]
    bool (model tokens)."""
    rows, width = versions.shape
    out = np.full((rows, width), -1, np.int32)
    following = np.full((rows,), -1, np.int32)
    for t in range(width - 1, -1, -1):
        out[:, t] = following
        following = np.where(loss_mask[:, t], versions[:, t], following)
    return out


def same_expert_set(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[..., k] x [..., k] -> [...] bool: the two top-k lists hold the same experts (any
    order)."""
    return np.all(np.sort(a, axis=-1) == np.sort(b, axis=-1), axis=-1)


def expert_load_max(routes: np.ndarray, mask: np.ndarray, num_experts: int) -> float:
    """The largest expert's share of routed (token, slot) pairs over the mean share 1 / E, in
    the worst MoE layer: max_l max_e count_{l,e} * E / (N * k). 1.0 is perfectly balanced, E / k
    the most skewed possible (every token on the same k experts). routes [R, T, L, k], mask
    [R, T] (the tokens that count: every token the forward routed for real)."""
    chosen = routes[mask]                                          # [N, L, k]
    if chosen.size == 0:
        return 0.0
    num_tokens, num_layers, top_k = chosen.shape
    worst = 0.0
    for layer in range(num_layers):
        counts = np.bincount(chosen[:, layer].reshape(-1), minlength=num_experts)
        worst = max(worst, float(counts.max()) * num_experts / (num_tokens * top_k))
    return worst


def routing_metrics(recorded: np.ndarray, scored: Mapping[int, np.ndarray], *,
                    versions: np.ndarray, loss_mask: np.ndarray, attn_mask: np.ndarray,
                    trainer_version: int, kv_on_swap: str, num_experts: int) -> dict:
    """mismatch/routing_agreement, mismatch/routing_stale_flip_frac, mismatch/routing_pairs and
    train/expert_load_max (see jrl.metrics.names).

    Pairs: (model token, MoE layer) with a recorded route that one held version reproduces
    (scored has that version; see the module docstring). agreement = 1 - (pairs whose expert SET
    differs between the sampler and the train forward under the route's own version) / pairs;
    stale_flip_frac = pairs whose set differs between the train forward under the route's own
    version and under the current weights (scored[trainer_version]) / pairs. Both are
    measured on the forward the trainer scores with (under routing replay, the router's own
    choice given the replayed context). With no pairs, agreement is 1.0 and the flip fraction
    0.0 (nothing disagreed); routing_pairs says how many there were.
    """
    own_version = route_versions(versions, loss_mask)
    first = np.where(loss_mask, versions, np.iinfo(np.int32).max).min(axis=1)
    reproducible = (np.ones_like(loss_mask) if kv_on_swap == "recompute"
                    else own_version == first[:, None])
    tokens = loss_mask & (recorded[..., 0, 0] >= 0) & (own_version >= 0) & reproducible
    tokens &= np.isin(own_version, list(scored))
    current = scored[trainer_version]
    sampled_disagree = stale_flips = pairs = 0
    for version in sorted(set(own_version[tokens].tolist())):
        at = tokens & (own_version == version)
        train_own = scored[version][at]                              # [n, L, k]
        sampled_disagree += int((~same_expert_set(recorded[at], train_own)).sum())
        stale_flips += int((~same_expert_set(train_own, current[at])).sum())
        pairs += train_own.shape[0] * train_own.shape[1]
    return {
        names.MISMATCH_ROUTING_AGREEMENT: 1.0 - sampled_disagree / max(pairs, 1),
        names.MISMATCH_ROUTING_STALE_FLIP_FRAC: stale_flips / max(pairs, 1),
        names.MISMATCH_ROUTING_PAIRS: pairs,
        names.TRAIN_EXPERT_LOAD_MAX: expert_load_max(current, attn_mask, num_experts),
    }

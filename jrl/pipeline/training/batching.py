"""Packing sampled responses into fixed-shape arrays, and selecting mini-batch rows."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from jrl.sampling import Sample
from jrl.train.state import TrainBatch


class PackedRollout(NamedTuple):
    """Samples laid out one per row of [R, T] arrays (numpy), prompt then response.

    tokens int32; attn_mask bool (prompt and response); loss_mask bool (the response's model
    tokens: a multi-turn episode's observation tokens are attended to, not trained on);
    behavior_logp float32 (p_b, 0 outside responses); logit_floor float32 (-inf outside
    responses and where the sampler did not truncate); versions int32 (the policy version of
    each model token, -1 elsewhere). routes [R, T, L_moe, k] int32 (MoE models: the experts the
    sampler recorded for every token it fed, prompt included; -1 elsewhere) or None. Rows past
    the samples are padding: all masks empty.
    """

    tokens: np.ndarray
    attn_mask: np.ndarray
    loss_mask: np.ndarray
    behavior_logp: np.ndarray
    logit_floor: np.ndarray
    versions: np.ndarray
    routes: np.ndarray | None = None


def pack_rollout(samples: Sequence[Sample], *, num_rows: int, seq_len: int,
                 route_shape: tuple[int, int] | None = None) -> PackedRollout:
    """Lays out prompt + response of each sample in a row of [num_rows, seq_len] arrays.

    Padding rows keep one shape for the compiled train step and weigh nothing (empty loss mask).
    route_shape: (L_moe, k) for an MoE model: routes [num_rows, seq_len, L_moe, k] from each
    sample's prompt_experts and experts; None: no routes.
    """
    if len(samples) > num_rows:
        raise ValueError(f"{len(samples)} samples do not fit in a batch of {num_rows} rows")
    tokens = np.zeros((num_rows, seq_len), np.int32)
    attn_mask = np.zeros((num_rows, seq_len), bool)
    loss_mask = np.zeros((num_rows, seq_len), bool)
    behavior = np.zeros((num_rows, seq_len), np.float32)
    floor = np.full((num_rows, seq_len), -np.inf, np.float32)
    versions = np.full((num_rows, seq_len), -1, np.int32)
    routes = (None if route_shape is None else
              np.full((num_rows, seq_len) + tuple(route_shape), -1, np.int32))
    for row, sample in enumerate(samples):
        prompt_len, response_len = sample.prompt_tokens.size, sample.length
        end = prompt_len + response_len
        if end > seq_len:
            raise ValueError(f"sample (prompt {sample.prompt_id}) has {end} tokens, more than "
                             f"the batch's seq_len={seq_len}")
        tokens[row, :prompt_len] = sample.prompt_tokens
        tokens[row, prompt_len:end] = sample.tokens
        attn_mask[row, :end] = True
        # Observation tokens of multi-turn episodes are context, never trained on.
        loss_mask[row, prompt_len:end] = sample.model_token_mask()
        behavior[row, prompt_len:end] = sample.behavior_logp
        floor[row, prompt_len:end] = sample.logit_floor
        versions[row, prompt_len:end] = sample.versions
        if routes is not None:
            if sample.experts is None or sample.prompt_experts is None:
                raise ValueError(f"sample (prompt {sample.prompt_id}) has no recorded experts; "
                                 "an MoE batch needs the sampler's routes (Sample.experts)")
            routes[row, :prompt_len] = sample.prompt_experts
            routes[row, prompt_len:end] = sample.experts
    return PackedRollout(tokens, attn_mask, loss_mask, behavior, floor, versions, routes)


def select_rows(batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
    """The mini-batch made of `rows` (numpy leaves; None fields stay None)."""
    return TrainBatch(*(None if x is None else np.asarray(x)[rows] for x in batch))

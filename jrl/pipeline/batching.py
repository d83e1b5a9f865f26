"""Packing sampled responses into fixed-shape train batches."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jrl.sampling.engine import Sample
from jrl.train.state import TrainBatch


def pack_samples(samples: Sequence[Sample], advantages: np.ndarray, *, num_rows: int,
                 seq_len: int) -> tuple[TrainBatch, np.ndarray]:
    """Lays out prompt + response of each sample in a row of a [num_rows, seq_len] batch.

    Rows past len(samples) are padding (empty loss mask: they weigh nothing), so the compiled
    train step always sees one shape. Returns (TrainBatch of numpy arrays, versions [R, T] int32
    with -1 outside responses). old_logp is p_b here; the caller may replace it.
    """
    if len(samples) > num_rows:
        raise ValueError(f"{len(samples)} samples do not fit in a batch of {num_rows} rows")
    tokens = np.zeros((num_rows, seq_len), np.int32)
    attn_mask = np.zeros((num_rows, seq_len), bool)
    loss_mask = np.zeros((num_rows, seq_len), bool)
    behavior = np.zeros((num_rows, seq_len), np.float32)
    floor = np.full((num_rows, seq_len), -np.inf, np.float32)
    versions = np.full((num_rows, seq_len), -1, np.int32)
    adv = np.zeros((num_rows,), np.float32)
    for row, sample in enumerate(samples):
        prompt_len, response_len = sample.prompt_tokens.size, sample.length
        end = prompt_len + response_len
        if end > seq_len:
            raise ValueError(f"sample (prompt {sample.prompt_id}) has {end} tokens, more than "
                             f"the batch's seq_len={seq_len}")
        tokens[row, :prompt_len] = sample.prompt_tokens
        tokens[row, prompt_len:end] = sample.tokens
        attn_mask[row, :end] = True
        loss_mask[row, prompt_len:end] = True
        behavior[row, prompt_len:end] = sample.behavior_logp
        floor[row, prompt_len:end] = sample.logit_floor
        versions[row, prompt_len:end] = sample.versions
        adv[row] = advantages[row]
    batch = TrainBatch(tokens=tokens, attn_mask=attn_mask, loss_mask=loss_mask, advantages=adv,
                       old_logp=behavior.copy(), behavior_logp=behavior,
                       ref_logp=np.zeros_like(behavior), logit_floor=floor)
    return batch, versions


def select_rows(batch: TrainBatch, rows: np.ndarray) -> TrainBatch:
    """The mini-batch made of `rows` (numpy leaves)."""
    return TrainBatch(*(np.asarray(x)[rows] for x in batch))

"""Reductions of per-token values to one scalar: who gets how much weight.

The order of dividing (by each sequence's length, by the token count, by a constant) sets the
weight of every token in the gradient; see the DAPO and Dr.GRPO sections of the seed article.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp

from jrl.losses._utils import Array, as_mask, check_choice, f32, masked_sum

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant",
                     "token_sum_norm")


def check_aggregation(where: str, mode: str, max_len: int | None) -> None:
    """ValueError naming `where` unless `mode` is an AGGREGATION_MODES entry (with a positive
    max_len for "constant")."""
    check_choice(where, "mode", mode, AGGREGATION_MODES)
    if mode in ("constant", "token_sum_norm") and (max_len is None or max_len <= 0):
        raise ValueError(
            f"{where}: max_len={max_len!r} is not allowed with mode={mode!r}; it must be a "
            "positive int (Dr.GRPO divides by num_sequences * max_len, token_sum_norm by "
            "max_len)."
        )


def num_tokens(mask: Array) -> Array:
    """Number of valid tokens: token_mean's denominator."""
    return jnp.sum(as_mask(mask)).astype(jnp.float32)


def num_sequences(mask: Array) -> Array:
    """Number of sequences with at least one valid token: the seq_mean_* denominator.

    Fully masked rows (batch padding) are not responses, so they do not dilute the mean.
    """
    return jnp.sum(jnp.any(as_mask(mask), axis=-1)).astype(jnp.float32)


def normalizer_for(mask: Array, mode: str, *, max_len: int | None = None) -> Array:
    """The denominator `aggregate` uses for this mask and mode.

    Compute it once on the WHOLE batch and pass it as `normalizer` to every micro-batch: the
    micro-batch losses then sum to the full-batch loss (and so do their gradients).

    token_mean: num_tokens(mask); seq_mean_*: num_sequences(mask);
    constant: num_sequences(mask) * max_len; token_sum_norm: max_len (no count at all).
    """
    check_aggregation("normalizer_for", mode, max_len)
    mask = as_mask(mask)
    if mode == "token_mean":
        return num_tokens(mask)
    if mode == "constant":
        return num_sequences(mask) * max_len
    if mode == "token_sum_norm":
        return jnp.float32(max_len)
    return num_sequences(mask)


def aggregate(
    values: Array,
    mask: Array,
    mode: str,
    *,
    max_len: int | None = None,
    normalizer: Array | float | None = None,
) -> Array:
    """Reduces per-token values [B, T] over valid tokens to a scalar.

    With T_i the number of valid tokens of sequence i, N = sum_i T_i and S the number of
    sequences with T_i > 0 (fully masked rows are batch padding, not responses):

    - "token_mean" (DAPO, arXiv:2503.14476):        sum_{i,t} v_{i,t} / N
      every token has weight 1/N, whatever its sequence's length.
    - "seq_mean_token_mean" (GRPO, arXiv:2402.03300): (1/S) sum_i (1/T_i) sum_t v_{i,t}
      a token of sequence i has weight 1/(S T_i): short sequences' tokens weigh more.
    - "seq_mean_token_sum":                          (1/S) sum_i sum_t v_{i,t}
    - "constant" (Dr.GRPO, arXiv:2503.20783):        sum_{i,t} v_{i,t} / (S * max_len)
      every token has weight 1/(S max_len), whatever the lengths generated.
    - "token_sum_norm" (verl's seq-mean-token-sum-norm): sum_{i,t} v_{i,t} / max_len
      Dr.GRPO normalised by the token budget only: no division by the number of sequences, so
      the loss scales with the batch (pick the learning rate for the batch size).

    `normalizer` replaces the outer denominator (N, S or S * max_len) - e.g. the whole batch's
    count under gradient accumulation, see `normalizer_for`. seq_mean_token_mean still divides
    each sequence by its own T_i. Denominators are clamped to >= 1, so an empty mask gives 0.0,
    never NaN. Masked positions are excluded with `where` (garbage there never leaks in).

    Args:
      values: [B, T] per-token values (any float dtype; computed in float32); carry gradient.
      mask: [B, T] valid tokens (nonzero = valid).
      mode: one of AGGREGATION_MODES.
      max_len: required for "constant" and "token_sum_norm": the generation length limit.
      normalizer: optional scalar override of the outer denominator.

    Returns:
      float32 scalar.
    """
    check_aggregation("aggregate", mode, max_len)
    chex.assert_rank(values, 2)
    chex.assert_equal_shape([values, mask])
    mask = as_mask(mask)
    values = f32(values)
    if mode == "seq_mean_token_mean":
        lengths = jnp.sum(mask, axis=-1)
        total = jnp.sum(masked_sum(values, mask, axis=-1) / jnp.maximum(lengths, 1))
    else:
        total = masked_sum(values, mask)
    if normalizer is None:
        normalizer = normalizer_for(mask, mode, max_len=max_len)
    return total / jnp.maximum(f32(normalizer), 1.0)

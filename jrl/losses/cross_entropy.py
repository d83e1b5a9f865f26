"""Token-level cross-entropy (the pretraining / SFT objective) and per-token logprob helpers."""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, as_mask, f32
from jrl.losses.aggregation import aggregate


class CrossEntropy(NamedTuple):
    """Output of `cross_entropy`."""

    loss: Array  # float32 scalar to minimise
    token_nll: Array  # [B, T] float32 -log p(target); 0 at masked positions


def token_logp(logits_or_logp: Array, targets: Array, mask: Array | None = None) -> Array:
    """log p(target_t) from [B, T, V] logits (or log-probabilities), computed in float32.

    log_softmax is applied either way: on log-probabilities it is the identity (their
    logsumexp is 0), so one function serves both. Targets at masked positions may hold any
    integer (e.g. -1 padding); they are replaced by 0 before the gather.

    Returns [B, T] float32; gradient flows into the logits.
    """
    chex.assert_rank(logits_or_logp, 3)
    chex.assert_rank(targets, 2)
    chex.assert_equal_shape_prefix([logits_or_logp, targets], 2)
    targets = jnp.asarray(targets)
    if mask is not None:
        targets = jnp.where(as_mask(mask), targets, 0)
    log_probs = jax.nn.log_softmax(f32(logits_or_logp), axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def token_entropy(logits: Array) -> Array:
    """Entropy of the next-token distribution, -sum_v p_v log p_v: [B, T, V] -> [B, T] float32.

    Feed it as LossInputs.entropy to log train/entropy or add an entropy bonus.
    """
    log_probs = jax.nn.log_softmax(f32(logits), axis=-1)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


def cross_entropy(
    logits_or_logp: Array,
    targets: Array,
    mask: Array,
    *,
    mode: str = "token_mean",
    max_len: int | None = None,
    normalizer: Array | float | None = None,
) -> CrossEntropy:
    """Pretraining objective: L = -(1/N) sum_{i,t} mask_{i,t} log p_theta(y_{i,t} | y_{i,<t}).

    The default reduction is token_mean (every target token weighs 1/N), as in pretraining; any
    `aggregate` mode may be chosen, e.g. to match an RL run's reduction in an SFT warm start.

    Args:
      logits_or_logp: [B, T, V] logits or log-probabilities; carries the gradient.
      targets: [B, T] int target token ids (already shifted: position t predicts targets[t]).
      mask: [B, T] valid target positions.
      mode, max_len, normalizer: passed to `aggregate`.

    Returns:
      CrossEntropy(loss, token_nll).
    """
    mask = as_mask(mask)
    nll = -token_logp(logits_or_logp, targets, mask)
    nll = jnp.where(mask, nll, 0.0)
    loss = aggregate(nll, mask, mode, max_len=max_len, normalizer=normalizer)
    return CrossEntropy(loss, nll)

"""Train state and the batch the train step consumes."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jrl.models.lora import split_trainable


class TrainState(NamedTuple):
    """Everything an update changes. A pytree: it crosses jit boundaries and checkpoints whole.

    params: model params (see jrl.models.transformer.param_shapes).
    opt_state: optax state of the optimizer the step was built with, over the trainable params
      only (jrl.models.lora.split_trainable: LoRA adapters when the params hold any, else all).
    step: int32 scalar, optimizer updates applied so far (drives the LR schedule).
    version: int32 scalar, policy version of `params`; every update makes a new policy, so it
      advances with `step`; tokens sampled with these params are tagged with it.
    rng: PRNG key, split once per update.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    version: jax.Array
    rng: jax.Array


def create_train_state(params, optimizer: optax.GradientTransformation, rng) -> TrainState:
    """Step 0 of `params`. With LoRA adapters, the optimizer state covers them alone: the base
    is frozen (jrl.models.lora)."""
    return TrainState(params=params, opt_state=optimizer.init(split_trainable(params)[0]),
                      step=jnp.zeros((), jnp.int32), version=jnp.zeros((), jnp.int32), rng=rng)


class TrainBatch(NamedTuple):
    """One mini-batch of whole sequences (prompt + response), right-padded. B rows, T positions.

    tokens [B, T] int32; attn_mask [B, T] bool marks prompt and response tokens; loss_mask
    [B, T] bool marks response tokens (the ones trained on; logp[:, t] predicts tokens[:, t]).
    advantages [B] float32 (stop-gradient). old_logp [B, T] float32: p_old, the PPO denominator.
    behavior_logp [B, T] float32: p_b from the sampler. ref_logp [B, T] float32 or zeros when no
    reference model. logit_floor [B, T] float32: the sampler's truncation floor per token
    (-inf for none), replayed so the trainer scores the distribution that was sampled.
    routes [B, T, L_moe, k] int32 or None: MoE experts the sampler recorded per token and MoE
    layer (jrl.models.transformer.stack_routes' layout; -1 where none was recorded), replayed
    by a train step built with replay=True (model.routing="replay", R3); None otherwise.
    Rows with an empty loss_mask are batch padding and weigh nothing.
    """

    tokens: jax.Array
    attn_mask: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    old_logp: jax.Array
    behavior_logp: jax.Array
    ref_logp: jax.Array
    logit_floor: jax.Array
    routes: jax.Array | None = None


class SFTBatch(NamedTuple):
    """Supervised warm start: tokens [B, T], attn_mask [B, T], loss_mask [B, T] (targets)."""

    tokens: jax.Array
    attn_mask: jax.Array
    loss_mask: jax.Array


def sft_batch_from_segments(rows: Sequence[Sequence[tuple[Sequence[int], bool]]],
                            seq_len: int) -> SFTBatch:
    """One row per list of (token ids, trained) segments, concatenated and cut at seq_len; the
    loss covers the trained segments (a multi-turn demonstration: the model's turns, not the
    prompt or the observations)."""
    tokens = np.zeros((len(rows), seq_len), np.int32)
    attn = np.zeros((len(rows), seq_len), bool)
    target = np.zeros((len(rows), seq_len), bool)
    for row, segments in enumerate(rows):
        ids, trained = [], []
        for segment, is_trained in segments:
            ids.extend(int(t) for t in segment)
            trained.extend([is_trained] * len(segment))
        ids, trained = ids[:seq_len], trained[:seq_len]
        tokens[row, :len(ids)] = ids
        attn[row, :len(ids)] = True
        target[row, :len(ids)] = trained
    return SFTBatch(tokens=tokens, attn_mask=attn, loss_mask=target)

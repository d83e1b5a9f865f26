"""The pure train step: (state, batch) -> (state, metrics), built once per config.

With LoRA adapters in the params (jrl.models.lora), the step differentiates and updates the
adapters only: the frozen base is an input of the gradient, never a target, so no base weight
gradient is computed or stored (jit_train_step also keeps it out of the step's outputs).

Gradient accumulation splits a mini-batch into micro-batches scanned in order; every micro-batch
normalises its loss by the WHOLE mini-batch's token / sequence counts, so the micro-batch losses
(and gradients) sum to the full-batch ones: a micro-batch split gives the same update as one big
batch (up to float summation order).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from jrl.kernels.contract import NumericalContract
from jrl.losses import LossInputs, aggregate
from jrl.metrics import names
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.models.lora import merge_trainable, split_trainable
from jrl.train.state import SFTBatch, TrainBatch, TrainState


def global_norm(tree) -> jax.Array:
    """sqrt(sum of squares of every leaf), in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def combine_micro_metrics(metrics_per_micro: dict, weights: jax.Array) -> dict:
    """metrics_per_micro: name -> [n_micro]; weights [n_micro] token counts. Each metric combines
    by its declared reduction (jrl.metrics.names): SUM (each micro-batch term is already divided
    by the whole batch's normaliser), MIN / MAX over non-empty micro-batches, else the
    token-weighted mean."""
    total = jnp.maximum(jnp.sum(weights), 1.0)
    out = {}
    for name, values in metrics_per_micro.items():
        how = names.reduction(name)
        if how == names.SUM:
            out[name] = jnp.sum(values)
        elif how == names.MIN:
            out[name] = jnp.min(jnp.where(weights > 0, values, jnp.inf))
        elif how == names.MAX:
            out[name] = jnp.max(jnp.where(weights > 0, values, -jnp.inf))
        else:
            out[name] = jnp.sum(values * weights) / total
    return out


def _split(batch, num_micro_batches: int):
    """[B, ...] leaves -> [n, B / n, ...]."""
    def split(x):
        if x.shape[0] % num_micro_batches:
            raise ValueError(f"batch of {x.shape[0]} rows does not split into "
                             f"train.micro_batches={num_micro_batches} equal micro-batches")
        return x.reshape((num_micro_batches, x.shape[0] // num_micro_batches) + x.shape[1:])
    return jax.tree.map(split, batch)


def make_score_fn(config: ModelConfig, contract: NumericalContract, *,
                  temperature: float = 1.0, replay: bool = False) -> Callable:
    """(params, tokens, attn_mask, logit_floor, routes) -> transformer.SequenceScores(logp,
    entropy [B, T], routes [B, T, L_moe, k]), no gradient: the train engine's scores and the
    router's own experts of every token. replay: the forward replays `routes` ([B, T, L_moe, k],
    -1 = route from the logits) as the train step built with replay=True does; otherwise
    `routes` is ignored (pass None)."""
    def score_fn(params, tokens, attn_mask, logit_floor, routes=None):
        return transformer.sequence_scores(params, config, tokens, contract=contract,
                                           mask=attn_mask, temperature=temperature,
                                           logit_floor=logit_floor,
                                           routes=routes if replay else None)
    return score_fn


def make_logprob_fn(config: ModelConfig, contract: NumericalContract, *,
                    temperature: float = 1.0) -> Callable:
    """(params, tokens, attn_mask, logit_floor) -> (logp [B, T], entropy [B, T]), no gradient.

    The train engine's p_o / p_ref for given weights, via the same kernels as the sampler.
    """
    def logprob_fn(params, tokens, attn_mask, logit_floor):
        return transformer.sequence_logprobs(params, config, tokens, contract=contract,
                                             mask=attn_mask, temperature=temperature,
                                             logit_floor=logit_floor)
    return logprob_fn


def _check_replay(config: ModelConfig, replay: bool) -> None:
    if replay and not config.has_moe:
        raise ValueError(f"model.routing='replay' replays MoE routes, but the model "
                         f"({config.model_type}, num_experts={config.num_experts}) has no MoE "
                         "layers; use model.routing='recompute'")


def make_micro_loss(config: ModelConfig, contract: NumericalContract, loss_fn: Callable, *,
                    temperature: float = 1.0, with_reference: bool = False,
                    replay: bool = False) -> Callable:
    """micro_loss(params, micro: TrainBatch, num_tokens, num_sequences) -> (loss, metrics).

    The loss of one micro-batch, normalised by the whole mini-batch's counts (num_tokens,
    num_sequences) so micro-batch losses add up to the mini-batch loss. Shared by the
    single-device step and jrl.parallel's row-parallel step. replay: the forward uses the
    batch's recorded MoE routes (micro.routes, R3); gradients still reach the router through
    its probabilities of the replayed experts (jrl.models.blocks.moe).
    """
    _check_replay(config, replay)
    # A chain with a MoE term (losses.LoadBalance) gets the router's probabilities and choices.
    needs_router = any(getattr(t, "needs_router", False)
                       for t in getattr(loss_fn, "transforms", ()))
    if needs_router and not config.has_moe:
        raise ValueError(f"the loss has a load-balancing term, but the model "
                         f"({config.model_type}) has no MoE layers; set algorithm.load_balance_coef=0")

    def micro_loss(params, micro: TrainBatch, num_tokens, num_sequences):
        if replay and micro.routes is None:
            raise ValueError("a train step built with replay=True needs TrainBatch.routes "
                             "(the sampler's recorded experts); got None")
        scores = transformer.sequence_scores(
            params, config, micro.tokens, contract=contract, mask=micro.attn_mask,
            temperature=temperature, logit_floor=micro.logit_floor,
            routes=micro.routes if replay else None, router_probs=needs_router)
        router = (dict(router_probs=scores.router_probs, router_experts=scores.routes,
                       router_mask=micro.attn_mask) if needs_router else {})
        inputs = LossInputs(logp=scores.logp, old_logp=micro.old_logp,
                            advantages=micro.advantages,
                            mask=micro.loss_mask, behavior_logp=micro.behavior_logp,
                            ref_logp=micro.ref_logp if with_reference else None,
                            entropy=scores.entropy,
                            global_num_tokens=num_tokens, global_num_sequences=num_sequences,
                            **router)
        return loss_fn(inputs)
    return micro_loss


def make_train_step(config: ModelConfig, contract: NumericalContract, loss_fn: Callable,
                    optimizer: optax.GradientTransformation, *, num_micro_batches: int = 1,
                    temperature: float = 1.0, with_reference: bool = False,
                    replay: bool = False) -> Callable:
    """Builds train_step(state, batch: TrainBatch) -> (state, metrics); one optimizer update.

    loss_fn is a jrl.losses chain: LossInputs -> (loss, metrics). batch.ref_logp is passed to it
    only when with_reference (a frozen reference model exists). The train/sampler mismatch
    metrics are measured by the pipeline (it knows each token's version), not here. replay:
    MoE routing replay (see make_micro_loss).
    """
    micro_loss = make_micro_loss(config, contract, loss_fn, temperature=temperature,
                                 with_reference=with_reference, replay=replay)

    def trainable_loss(trainable, frozen, micro, num_tokens, num_sequences):
        return micro_loss(merge_trainable(trainable, frozen), micro, num_tokens, num_sequences)

    grad_fn = jax.grad(trainable_loss, has_aux=True)

    def train_step(state: TrainState, batch: TrainBatch):
        num_tokens = jnp.sum(batch.loss_mask).astype(jnp.float32)
        num_sequences = jnp.sum(jnp.any(batch.loss_mask, axis=1)).astype(jnp.float32)
        micros = _split(batch, num_micro_batches)
        trainable, frozen = split_trainable(state.params)

        def accumulate(grads, micro):
            g, metrics = grad_fn(trainable, frozen, micro, num_tokens, num_sequences)
            # Keep XLA from folding the accumulator into the embedding gradient's scatter-add:
            # that would add repeated tokens' rows in an order a data-parallel split cannot
            # reproduce (jrl.parallel's step sums whole micro-batch gradients in order).
            g = jax.lax.optimization_barrier(g)
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, g)
            return grads, (metrics, jnp.sum(micro.loss_mask).astype(jnp.float32))

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
        grads, (metrics, weights) = jax.lax.scan(accumulate, zeros, micros)
        metrics = combine_micro_metrics(metrics, weights)
        return apply_update(state, grads, optimizer, metrics, num_tokens)

    return train_step


def apply_update(state: TrainState, grads, optimizer: optax.GradientTransformation,
                 metrics: dict, num_tokens) -> tuple[TrainState, dict]:
    """One optimizer update from float32 summed gradients: cast to the param dtypes, update,
    advance step, version and rng; adds train/grad_norm, train/num_tokens and
    train/update_skipped to metrics.

    An update whose loss or gradient norm is not finite is skipped: params and optimizer state
    stay as they were (selected with jnp.where, so a finite update keeps its exact bits) and
    train/update_skipped is 1. Step and version still advance, so the version schedule holds;
    the run loop stops on such a step with a message naming the metric.

    grads covers the trainable params (jrl.models.lora.split_trainable); a frozen base passes
    through unchanged.
    """
    trainable, frozen = split_trainable(state.params)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
    updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
    params = optax.apply_updates(trainable, updates)
    grad_norm = global_norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics[names.TRAIN_LOSS])
    keep = lambda new, old: jnp.where(finite, new, old)
    params = merge_trainable(jax.tree.map(keep, params, trainable), frozen)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    metrics[names.TRAIN_GRAD_NORM] = grad_norm
    metrics[names.TRAIN_NUM_TOKENS] = num_tokens
    metrics[names.TRAIN_UPDATE_SKIPPED] = 1.0 - finite.astype(jnp.float32)
    rng, _ = jax.random.split(state.rng)
    new_state = TrainState(params=params, opt_state=opt_state, step=state.step + 1,
                           version=state.version + 1, rng=rng)
    return new_state, metrics


def make_sft_step(config: ModelConfig, contract: NumericalContract,
                  optimizer: optax.GradientTransformation) -> Callable:
    """sft_step(state, batch: SFTBatch) -> (state, metrics): token-mean cross-entropy update.

    The warm start before RL; it does not advance the policy version (RL starts at version 0).
    """
    def loss(trainable, frozen, batch: SFTBatch):
        logp, _ = transformer.sequence_logprobs(merge_trainable(trainable, frozen), config,
                                                batch.tokens, contract=contract,
                                                mask=batch.attn_mask)
        # logp[:, t] already scores tokens[:, t]: cross-entropy is its negative token mean.
        return -aggregate(logp, batch.loss_mask, "token_mean")

    def sft_step(state: TrainState, batch: SFTBatch):
        trainable, frozen = split_trainable(state.params)     # LoRA: the adapters only
        value, grads = jax.value_and_grad(loss)(trainable, frozen, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, trainable)
        params = merge_trainable(optax.apply_updates(trainable, updates), frozen)
        return state._replace(params=params, opt_state=opt_state, step=state.step + 1), {
            names.SFT_LOSS: value, names.TRAIN_GRAD_NORM: global_norm(grads)}

    return sft_step


def jit_train_step(train_step: Callable) -> Callable:
    """jax.jit of a (state, batch) -> (state, metrics) step that never copies a frozen base.

    A jitted function returns fresh buffers for its outputs, so a frozen LoRA base that went in
    with the state would come out as a copy of every base weight, every step (unless donated,
    and the trainer holds earlier versions' params for p_o). Here the base travels as its own
    argument and is not an output: the compiled program reads it in place; the returned state
    holds the same base arrays. Without adapters this is jax.jit(train_step).

    `.lower(state, batch)` lowers the inner program (memory analysis: launch/bench_lora.py).
    """
    def inner(state: TrainState, frozen, batch):
        new_state, metrics = train_step(
            state._replace(params=merge_trainable(state.params, frozen)), batch)
        return new_state._replace(params=split_trainable(new_state.params)[0]), metrics

    jitted = jax.jit(inner)

    def split_state(state):
        trainable, frozen = split_trainable(state.params)
        return state._replace(params=trainable), frozen

    def call(state: TrainState, batch):
        trainable_state, frozen = split_state(state)
        new_state, metrics = jitted(trainable_state, frozen, batch)
        return new_state._replace(params=merge_trainable(new_state.params, frozen)), metrics

    def lower(state, batch):
        trainable_state, frozen = split_state(state)
        return jitted.lower(trainable_state, frozen, batch)

    call.lower = lower
    return call

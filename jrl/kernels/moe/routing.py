"""Top-k softmax routing: router logits -> each token's k experts and their weights.

    route(router_logits, *, top_k, norm_topk_prob, contract) -> Routing(experts, weights, probs)
    routing_weights(probs, experts, *, norm_topk_prob)               the weights of given experts

router_logits [..., E] float32 -> experts [..., k] int32, weights [..., k] float32, probs
[..., E] float32. Why a row's routing depends only on that row: softmax over the E experts of
one row inside one row tile of a Pallas kernel (max, exp, sum, one reciprocal). Top-k is k rounds
of "max; lowest expert index among equal probabilities", and the weights are a gather, a sum in
the order j = 0..k-1 and one reciprocal: exact or elementwise IEEE operations, with no reduction
whose order XLA could pick and no product feeding a sum that a compiler could fuse into an FMA in
one program and not another.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract
from jrl.kernels.reference import MASKED

_F32 = jnp.float32


class Routing(NamedTuple):
    """experts [N, k] int32 (descending probability, ties -> lower index), weights [N, k]
    float32 (differentiable w.r.t. the router logits), probs [N, E] float32 (softmax)."""

    experts: jax.Array
    weights: jax.Array
    probs: jax.Array


def softmax_reference(logits: jax.Array) -> jax.Array:
    """p = exp(z - max z) * (1 / sum exp(z - max z)) over the last dim, float32 (plain XLA)."""
    z = logits.astype(_F32)
    e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
    # An explicit reciprocal, as in the kernel (see reference.attention).
    return e * (1.0 / jnp.sum(e, axis=-1, keepdims=True))


def _softmax_kernel(ids, z_ref, p_ref):
    """z_ref [block_rows, Ep] float32 -> p_ref: softmax of each row inside the tile. GPU padding
    columns hold MASKED, whose exp(MASKED - max) is exactly 0."""
    del ids
    z = z_ref[...]
    e = jnp.exp(z - jnp.max(z, axis=1, keepdims=True))
    p_ref[...] = e * (1.0 / jnp.sum(e, axis=1, keepdims=True))


@functools.partial(jax.jit, static_argnums=(1,))
def _softmax_pallas(logits, contract):
    rows, num_experts = logits.shape
    block = contract.logprob_block_rows
    experts_p = contract.kernel_dim(num_experts)
    z = _grid.pad_axis(_grid.pad_axis(logits, 1, experts_p, MASKED), 0, block)
    tile = _grid.Tile((block, experts_p), lambda i: (i, 0))
    (p,) = _grid.launch(_softmax_kernel, grid=(z.shape[0] // block,), in_tiles=[tile],
                        out_tiles=[tile], out_shape=[jax.ShapeDtypeStruct(z.shape, _F32)],
                        contract=contract, name="jrl_router_softmax")(z)
    return p[:rows, :num_experts]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _softmax(logits, contract):
    return _softmax_pallas(logits, contract)


def _softmax_fwd(logits, contract):
    return _softmax_pallas(logits, contract), logits


def _softmax_bwd(contract, logits, dp):
    del contract
    _, vjp = jax.vjp(softmax_reference, logits)
    return vjp(dp)


_softmax.defvjp(_softmax_fwd, _softmax_bwd)


def _top_k(probs: jax.Array, top_k: int) -> jax.Array:
    """k rounds of: the max probability, and the lowest expert index holding it. [..., E] ->
    [..., k] int32. Only max, ==, select and integer min: exact, so any reduction order gives
    the same indices."""
    num_experts = probs.shape[-1]
    expert_ids = jax.lax.broadcasted_iota(jnp.int32, probs.shape, probs.ndim - 1)
    remaining, picks = probs, []
    for _ in range(top_k):
        best = jnp.max(remaining, axis=-1, keepdims=True)
        pick = jnp.min(jnp.where(remaining == best, expert_ids, num_experts), axis=-1)
        picks.append(pick)
        # Probabilities are >= 0, so -1 never wins again.
        remaining = jnp.where(expert_ids == pick[..., None], -1.0, remaining)
    return jnp.stack(picks, axis=-1)


def routing_weights(probs: jax.Array, experts: jax.Array, *, norm_topk_prob: bool) -> jax.Array:
    """The routing weights of given experts (routing replay, R3: the train forward forces the
    experts the sampler recorded). probs [..., E] float32, experts [..., k] int -> [..., k]
    float32:

        w_j = probs[e_j]                                    (norm_topk_prob=False)
        w_j = probs[e_j] * (1 / s),  s = ((w_0 + w_1) + w_2) + ... + w_{k-1}   (True)

    Differentiable w.r.t. probs, so gradients reach the router through the replayed experts.
    Elementwise and exact gathers only: a row's weights do not depend on other rows.
    """
    if probs.dtype != _F32:
        raise ValueError(f"routing_weights: probs must be float32, got {probs.dtype}")
    if probs.shape[:-1] != experts.shape[:-1]:
        raise ValueError(f"routing_weights: probs {probs.shape} and experts {experts.shape} "
                         "disagree on the leading dims")
    chosen = jnp.take_along_axis(probs, experts.astype(jnp.int32), axis=-1)
    if not norm_topk_prob:
        return chosen
    total = chosen[..., 0]
    for j in range(1, chosen.shape[-1]):
        total = total + chosen[..., j]
    return chosen * (1.0 / total)[..., None]


def route(router_logits: jax.Array, *, top_k: int, norm_topk_prob: bool,
          contract: NumericalContract) -> Routing:
    """Top-k softmax routing, batch-invariant with the Pallas backend.

    router_logits [..., E] float32 (from jrl's matmul kernel in float32). probs = softmax over E
    in float32 (row-tiled kernel, tile contract.logprob_block_rows); experts = k rounds of "max,
    lowest expert index among equals", so equal probabilities pick the lowest indices, in
    descending probability; weights = routing_weights(probs, experts) (renormalised by their
    sum when norm_topk_prob). Logits must be finite. Gradients flow to the logits through
    probs (custom_vjp with the reference softmax backward); expert indices carry none.
    """
    if router_logits.dtype != _F32:
        raise ValueError(f"route: router_logits must be float32 (compute them with the matmul "
                         f"kernel in float32), got {router_logits.dtype}")
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be in [1, E={num_experts}]")
    if _grid.uses_pallas(contract):
        flat = router_logits.reshape(-1, num_experts)
        probs = (_softmax(flat, contract) if flat.shape[0] else flat).reshape(router_logits.shape)
    else:
        probs = softmax_reference(router_logits)
    experts = _top_k(jax.lax.stop_gradient(probs), int(top_k))
    return Routing(experts, routing_weights(probs, experts, norm_topk_prob=norm_topk_prob), probs)

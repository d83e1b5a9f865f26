"""Mixture-of-experts MLP (Qwen3-MoE, Qwen3.5-MoE): router, top-k experts, optional shared
expert, all through jrl.kernels' batch-invariant MoE kernels.

    logits = x W_router                          float32 (the matmul kernel on float32 operands)
    experts, weights = route(logits, top_k)      softmax, top-k (ties -> lowest index)
    y = sum_j weights_j * expert_{e_j}(x)        dropless, combined in top-k order in float32
    y += sigmoid(x W_shared_gate) * shared(x)    Qwen3.5-MoE's always-on expert (float32, once)

A token's experts depend only on its own router logits, which are bit-identical in the sampler
and the train forward at the same weights: routing agrees exactly, with no replay. Replay (R3)
is for stale tokens: `routes` forces the experts the sampler recorded, and the weights are the
router's probabilities of those experts, so gradients still reach the router.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.kernels.rowwise import rowwise
from jrl.models.blocks import mlp
from jrl.models.config import ModelConfig

_F32 = jnp.float32


def param_shapes(config: ModelConfig, n: int) -> dict:
    """Shapes of a stack of n MoE MLPs: router [D, E], experts [E, D, F] / [E, F, D], and the
    shared expert (Qwen3.5-MoE) with its gate [D, 1]."""
    d, e, f = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes = {"router": (n, d, e), "experts_gate": (n, e, d, f), "experts_up": (n, e, d, f),
              "experts_down": (n, e, f, d)}
    if config.shared_expert_intermediate_size:
        fs = config.shared_expert_intermediate_size
        shapes.update(shared_gate=(n, d, fs), shared_up=(n, d, fs), shared_down=(n, fs, d),
                      shared_expert_gate=(n, d, 1))
    return shapes


def _shared_math(out, shared, gate):
    return out + jax.nn.sigmoid(gate) * shared


def _shared_math_tuple(out, shared, gate):
    return (_shared_math(out, shared, gate),)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def shared_combine(contract: NumericalContract, out, shared, gate):
    """out + sigmoid(gate) * shared in float32, rounded once, in fixed row tiles
    (kernels.rowwise: no program fuses it differently). out, shared [..., D], gate [..., 1]."""
    shape = out.shape
    rows = [x.reshape(-1, x.shape[-1]) for x in (out, shared, gate)]
    (y,) = rowwise(_shared_math_tuple, rows=rows,
                   out=[((shape[-1],), out.dtype)], contract=contract, name="jrl_shared_expert")
    return y.reshape(shape)


def _shared_combine_fwd(contract, out, shared, gate):
    return shared_combine(contract, out, shared, gate), (out, shared, gate)


def _shared_combine_bwd(contract, residuals, dy):
    out, shared, gate = residuals
    _, vjp = jax.vjp(lambda *a: _shared_math(*(x.astype(_F32) for x in a)).astype(out.dtype),
                     out, shared, gate)
    return vjp(dy)


shared_combine.defvjp(_shared_combine_fwd, _shared_combine_bwd)


def router_contract(contract: NumericalContract) -> NumericalContract:
    """The router's matmul runs on float32 operands whatever the compute dtype, so routing
    decisions never depend on a bf16 rounding of the logits."""
    return contract.replace(compute_dtype="float32")


def replayed_experts(routed: jax.Array, routes: jax.Array) -> jax.Array:
    """The experts a replaying forward uses: routes [..., k] where the token was recorded
    (routes[..., 0] >= 0), the router's own choice `routed` [..., k] where it was not (-1: a
    token the sampler never fed, e.g. a response's last token). int32 [..., k]."""
    routes = routes.astype(jnp.int32)
    return jnp.where(routes[..., :1] >= 0, routes, routed)


def forward(x: jax.Array, layer: dict, *, config: ModelConfig, contract: NumericalContract,
            routes: jax.Array | None = None,
            expert_axis: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [B, T, D] (normed) -> (out [B, T, D] compute dtype, experts [B, T, k] int32, probs
    [B, T, E] float32: the router's softmax, differentiable).

    experts is always the router's OWN top-k (what recompute uses), also under replay, so a
    replaying forward still reports the routing flips it papers over.
    routes: None (route from the logits) or [B, T, k] experts to use instead (replay, R3);
    tokens whose routes are -1 are routed from their logits. Under replay the weights are the
    router's probabilities of the replayed experts (routing_weights: renormalised over them when
    norm_topk_prob), so gradients still reach the router through them.
    expert_axis: expert parallelism inside shard_map: layer's experts_* hold this device's
    E / P experts of the mesh axis `expert_axis` (kernels.moe_experts_sharded); the router and
    the shared expert are whole on every device.
    """
    logits = kernels.matmul(x.astype(_F32), layer["router"].astype(_F32),
                            contract=router_contract(contract)).astype(_F32)
    routing = kernels.route(logits, top_k=config.num_experts_per_tok,
                            norm_topk_prob=config.norm_topk_prob, contract=contract)
    experts, weights = routing.experts, routing.weights
    if routes is not None:
        experts = replayed_experts(routing.experts, routes)
        weights = kernels.routing_weights(routing.probs, experts,
                                          norm_topk_prob=config.norm_topk_prob)
    expert_weights = (layer["experts_gate"], layer["experts_up"], layer["experts_down"])
    if expert_axis is None:
        out = kernels.moe_experts(x, experts, weights, *expert_weights, contract=contract)
    else:
        out = kernels.moe_experts_sharded(x, experts, weights, *expert_weights,
                                          axis=expert_axis, contract=contract)
    if config.shared_expert_intermediate_size:
        shared = mlp.forward(x, layer, contract=contract, prefix="shared_", config=config)
        gate = kernels.matmul(x, layer["shared_expert_gate"], contract=contract)
        out = shared_combine(contract, out, shared, gate)
    return out, routing.experts, routing.probs

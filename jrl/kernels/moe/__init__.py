"""Batch-invariant mixture of experts: router, dropless grouped expert compute, combine.

    route(router_logits, *, top_k, norm_topk_prob, contract) -> Routing(experts, weights, probs)
    routing_weights(probs, experts, *, norm_topk_prob)               the weights of given experts
    moe_experts(x, experts, weights, w_gate, w_up, w_down, *, contract)      x [N, D] -> [N, D]

and, for expert parallelism: dispatch(experts, ...) -> Dispatch, expert_rows(rows, tile_expert,
num_tiles, ...) on a dispatched row buffer, combine(y_rows, pair_row, weights, ...), and
moe_experts_sharded(..., axis=...), which moves rows between devices with all-to-alls inside
shard_map and combines each token on its home device from them.

A token's bits depend only on its own row, its experts and their weights (never on which or
how many other tokens share its experts, the batch size or its position). Each step keeps it,
and its module's docstring says how; a module imports only the ones above it:

    routing       route, routing_weights: softmax over E and top-k of the router logits
    dispatching   dispatch: (token, j) pairs -> an expert-sorted buffer of single-expert tiles
    expert_mlp    expert_rows: the experts' SwiGLU MLP on that buffer (and the plain-XLA
                  backend's grouped matmul, the reference for gradients)
    combining     combine: out[n] = sum_j weights[n, j] * y(n, j) on the token's home device
    layer         moe_experts: dispatching -> expert_mlp -> combining on one device
    sharded       moe_experts_sharded: the same with the experts split over a mesh axis
"""

from jrl.kernels.moe.combining import combine
from jrl.kernels.moe.dispatching import Dispatch, dispatch
from jrl.kernels.moe.expert_mlp import expert_rows
from jrl.kernels.moe.layer import moe_experts
from jrl.kernels.moe.routing import Routing, route, routing_weights, softmax_reference
from jrl.kernels.moe.sharded import moe_experts_sharded

__all__ = [
    "Dispatch", "Routing", "combine", "dispatch", "expert_rows", "moe_experts",
    "moe_experts_sharded", "route", "routing_weights", "softmax_reference",
]

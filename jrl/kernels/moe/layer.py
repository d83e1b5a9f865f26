"""The whole expert layer on one device: dispatch -> expert_rows -> combine.

    moe_experts(x, experts, weights, w_gate, w_up, w_down, *, contract)      x [N, D] -> [N, D]

out[n] = sum_j weights[n, j] * SwiGLU of x[n] with expert e_j's weights (moe_experts states the
formula and its roundings). Differentiable: the Pallas path's custom_vjp runs the plain-XLA
backend's backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract
from jrl.kernels.moe.combining import combine
from jrl.kernels.moe.dispatching import Dispatch, _gather_rows, dispatch
from jrl.kernels.moe.expert_mlp import expert_rows

_F32 = jnp.float32


def _moe_forward(x, weights, w_gate, w_up, w_down, routes: Dispatch, contract):
    rows = _gather_rows(x.astype(contract.compute), routes.row_token)
    y_rows = expert_rows(rows, routes.tile_expert, routes.num_tiles, w_gate, w_up, w_down,
                         contract=contract)
    return combine(y_rows, routes.pair_row, weights, contract=contract)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_pallas(x, weights, w_gate, w_up, w_down, routes, contract):
    return _moe_forward(x, weights, w_gate, w_up, w_down, routes, contract)


def _moe_pallas_fwd(x, weights, w_gate, w_up, w_down, routes, contract):
    return (_moe_forward(x, weights, w_gate, w_up, w_down, routes, contract),
            (x, weights, w_gate, w_up, w_down, routes))


def _moe_pallas_bwd(contract, residuals, dy):
    *params, routes = residuals
    reference = contract.replace(backend="xla")
    _, vjp = jax.vjp(lambda *p: _moe_forward(*p, routes, reference), *params)
    return (*vjp(dy), None)


_moe_pallas.defvjp(_moe_pallas_fwd, _moe_pallas_bwd)


def moe_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, *, contract: NumericalContract) -> jax.Array:
    """Dropless top-k SwiGLU experts, batch-invariant with the Pallas backend.

    x [..., D], experts [..., k] int in [0, E), weights [..., k] (float32), w_gate/w_up
    [E, D, F], w_down [E, F, D] (stored [in, out]: y = x @ w). Returns [..., D] in the compute
    dtype:

        out[n] = sum_{j = 0..k-1} weights[n, j] * (act_j @ W_down[e_j])        float32, j order
        act_j  = round(silu(x[n] @ W_gate[e_j]) * (x[n] @ W_up[e_j]))          float32 -> compute

    (the jrl.kernels.moe docstrings: why each token's bits depend only on its own row).
    Differentiable w.r.t. x, weights, w_gate, w_up, w_down (custom_vjp through the plain-XLA
    backend); experts carry no gradient.
    """
    if x.ndim < 1 or experts.shape[:-1] != x.shape[:-1] or weights.shape != experts.shape:
        raise ValueError(f"moe_experts: expected x [..., D], experts and weights [..., k] with the "
                         f"same leading dims, got {x.shape}, {experts.shape}, {weights.shape}")
    dim = x.shape[-1]
    num_experts, _, hidden = w_gate.shape
    if (w_gate.shape != (num_experts, dim, hidden) or w_up.shape != w_gate.shape
            or w_down.shape != (num_experts, hidden, dim)):
        raise ValueError(f"moe_experts: expected w_gate = w_up [E, {dim}, F] and w_down "
                         f"[E, F, {dim}], got {w_gate.shape}, {w_up.shape}, {w_down.shape}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"moe_experts: experts must be integer, got {experts.dtype}")
    top_k = experts.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.shape[0] == 0:
        return jnp.zeros(x.shape, contract.compute)
    experts2 = experts.reshape(-1, top_k)
    weights2 = weights.reshape(-1, top_k).astype(_F32)
    routes = dispatch(experts2, num_experts=num_experts, contract=contract)
    if _grid.uses_pallas(contract):
        y = _moe_pallas(x2, weights2, w_gate, w_up, w_down, routes, contract)
    else:
        y = _moe_forward(x2, weights2, w_gate, w_up, w_down, routes, contract)
    return y.reshape(x.shape[:-1] + (dim,))

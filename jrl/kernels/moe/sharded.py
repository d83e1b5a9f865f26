"""Expert parallelism: moe_experts with the E experts split over a mesh axis, inside shard_map.

    moe_experts_sharded(x, experts, weights, w_gate, w_up, w_down, *, axis, contract)
        x [N, D] this device's tokens, w_* [E / P, ...] this device's experts -> [N, D]

Rows move between devices with all-to-alls (each (token, j) pair to the device holding its
expert, the results back) and each token is combined on its home device from them, with the
same kernels, values and order as moe_experts on one device: bitwise equal (Pallas backend).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract
from jrl.kernels.moe.combining import combine
from jrl.kernels.moe.dispatching import _gather_rows, dispatch
from jrl.kernels.moe.expert_mlp import expert_rows

_F32 = jnp.float32


def _sharded_forward(x, weights, w_gate, w_up, w_down, experts, axis, contract):
    """x [N, D] this device's tokens, experts / weights [N, k] (global expert ids), w_* this
    device's experts [E_local, ...] (device p of `axis` holds experts p*E_local .. ), inside
    shard_map. See moe_experts_sharded."""
    num_peers = jax.lax.axis_size(axis)
    num_local = w_gate.shape[0]
    num_tokens, top_k = experts.shape
    dim = x.shape[1]
    pairs = num_tokens * top_k
    flat = experts.reshape(-1).astype(jnp.int32)                    # pair p = token * k + j
    dest = flat // num_local
    # Each pair's slot in its peer's buffer: the number of earlier pairs for that peer (an exact
    # prefix count), so a buffer holds its pairs in pair order, then empty slots.
    is_dest = dest[:, None] == jnp.arange(num_peers, dtype=jnp.int32)[None, :]
    rank = jnp.take_along_axis(jnp.cumsum(is_dest, axis=0, dtype=jnp.int32) - 1,
                               dest[:, None], axis=1)[:, 0]
    token = jnp.arange(pairs, dtype=jnp.int32) // top_k
    send_x = jnp.zeros((num_peers, pairs, dim), contract.compute).at[dest, rank].set(
        x.astype(contract.compute)[token])
    # Empty slots name expert E_local: dispatch drops them (no row, no compute).
    send_e = jnp.full((num_peers, pairs), num_local, jnp.int32).at[dest, rank].set(
        flat % num_local)
    recv_x = jax.lax.all_to_all(send_x, axis, 0, 0).reshape(num_peers * pairs, dim)
    recv_e = jax.lax.all_to_all(send_e, axis, 0, 0).reshape(num_peers * pairs, 1)
    routes = dispatch(recv_e, num_experts=num_local, contract=contract)
    y_rows = expert_rows(_gather_rows(recv_x, routes.row_token), routes.tile_expert,
                         routes.num_tiles, w_gate, w_up, w_down, contract=contract)
    y = y_rows[routes.pair_row[:, 0]].reshape(num_peers, pairs, dim)   # received order
    home = jax.lax.all_to_all(y, axis, 0, 0).reshape(num_peers * pairs, dim)
    pair_row = (dest * pairs + rank).reshape(num_tokens, top_k)
    return combine(home, pair_row, weights, contract=contract)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _sharded_pallas(x, weights, w_gate, w_up, w_down, experts, axis, contract):
    return _sharded_forward(x, weights, w_gate, w_up, w_down, experts, axis, contract)


def _sharded_pallas_fwd(x, weights, w_gate, w_up, w_down, experts, axis, contract):
    return (_sharded_forward(x, weights, w_gate, w_up, w_down, experts, axis, contract),
            (x, weights, w_gate, w_up, w_down, experts))


def _sharded_pallas_bwd(axis, contract, residuals, dy):
    # As moe_experts: the plain-XLA backend's backward, here with its all-to-alls transposed
    # (cotangents travel back the way the rows came; expert weight gradients stay local).
    *params, experts = residuals
    reference = contract.replace(backend="xla")
    _, vjp = jax.vjp(lambda *p: _sharded_forward(*p, experts, axis, reference), *params)
    return (*vjp(dy), None)


_sharded_pallas.defvjp(_sharded_pallas_fwd, _sharded_pallas_bwd)


def moe_experts_sharded(x: jax.Array, experts: jax.Array, weights: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, axis: str,
                        contract: NumericalContract) -> jax.Array:
    """moe_experts with the E experts split over the mesh axis `axis` (expert parallelism), for
    use inside shard_map: bitwise equal to moe_experts on one device (Pallas backend).

    x [..., D] this device's tokens (its "home"); experts [..., k] global ids in [0, E), weights
    [..., k]; w_gate / w_up [E / P, D, F], w_down [E / P, F, D] this device's experts (peer p of
    the P along `axis` holds experts p * E/P .. (p + 1) * E/P - 1). Returns [..., D].

    Tokens move, nothing is summed across devices:
    1. each (token, j) pair is copied into a send buffer for the peer holding expert e_j (a
       fixed capacity of N * k slots per peer: dropless whatever the routing), in pair order;
    2. all_to_all; each peer runs dispatch + expert_rows over the rows it received (empty slots
       are dropped): a row's result depends only on that row and its expert's weights;
    3. all_to_all back, then combine on the home device: sum_j weights[n, j] * y(n, j) in top-k
       order in float32, rounded once — the same kernels, values and order as on one device.
    Cost: 2 * P * N * k * D elements moved per device and call (the buffers are sized for the
    worst case). Differentiable (custom_vjp through the plain-XLA backend, which transposes the
    all-to-alls); a replicated param's gradient (the router) is this device's partial sum.
    """
    dim = x.shape[-1]
    top_k = experts.shape[-1]
    if experts.shape[:-1] != x.shape[:-1] or weights.shape != experts.shape:
        raise ValueError(f"moe_experts_sharded: expected x [..., D], experts and weights [..., k] "
                         f"with the same leading dims, got {x.shape}, {experts.shape}, "
                         f"{weights.shape}")
    x2 = x.reshape(-1, dim)
    if x2.shape[0] == 0:
        return jnp.zeros(x.shape, contract.compute)
    experts2 = experts.reshape(-1, top_k).astype(jnp.int32)
    weights2 = weights.reshape(-1, top_k).astype(_F32)
    run = _sharded_pallas if _grid.uses_pallas(contract) else (
        lambda *a: _sharded_forward(*a))
    y = run(x2, weights2, w_gate, w_up, w_down, experts2, axis, contract)
    return y.reshape(x.shape[:-1] + (dim,))

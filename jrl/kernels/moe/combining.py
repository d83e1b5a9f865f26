"""Combine on the home device: each token's k expert outputs, weighted and summed in top-k order.

    combine(y_rows [R, D] float32, pair_row [N, k] int32, weights [N, k] float32, *, contract)
        -> [N, D]:   out[n] = sum_{j = 0..k-1} weights[n, j] * y_rows[pair_row[n, j]]

for j = 0..k-1 in float32 in a row-tiled kernel, rounded once to the compute dtype: a fixed order
on the token's home device, so a token's output depends only on its own k outputs and weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract

_F32 = jnp.float32


def _combine_kernel(ids, w_ref, y_ref, o_ref, *, top_k: int):
    """w_ref [kp, block_rows, 1], y_ref [kp, block_rows, Dp] float32 -> o_ref [block_rows, Dp]:
    ((w_0 y_0 + w_1 y_1) + w_2 y_2) + ... in float32, rounded once (kp >= top_k: GPU padding)."""
    del ids
    acc = w_ref[0] * y_ref[0]
    for j in range(1, top_k):
        acc = acc + w_ref[j] * y_ref[j]
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("contract",))
def combine(y_rows: jax.Array, pair_row: jax.Array, weights: jax.Array, *,
            contract: NumericalContract) -> jax.Array:
    """out[n] = sum_{j = 0..k-1} weights[n, j] * y_rows[pair_row[n, j]], in float32 in top-k
    order, rounded once to the compute dtype. y_rows [R, D] float32, pair_row [N, k] int32,
    weights [N, k] float32 -> [N, D]. Row-tiled kernel (contract.norm_block_rows) with the Pallas
    backend; differentiate moe_experts, not this."""
    num_tokens, top_k = pair_row.shape
    dim = y_rows.shape[1]
    weights = weights.astype(_F32)
    if not _grid.uses_pallas(contract):
        y = y_rows[pair_row]
        acc = weights[:, 0, None] * y[:, 0]
        for j in range(1, top_k):
            acc = acc + weights[:, j, None] * y[:, j]
        return acc.astype(contract.compute)
    block = contract.norm_block_rows
    k_p, dim_p = contract.kernel_dim(top_k), contract.kernel_dim(dim)
    # Padding pairs point at row 0 with weight 0: padded tokens are dropped, padded j unread.
    pair_row = _grid.pad_axis(_grid.pad_axis(pair_row, 0, block), 1, k_p)
    w = _grid.pad_axis(_grid.pad_axis(weights, 0, block), 1, k_p).T[..., None]   # [kp, Np, 1]
    y = _grid.pad_axis(y_rows, 1, dim_p)[pair_row.T]                              # [kp, Np, Dp]
    num_p = w.shape[1]
    (out,) = _grid.launch(
        functools.partial(_combine_kernel, top_k=top_k), grid=(num_p // block,),
        in_tiles=[_grid.Tile((k_p, block, 1), lambda i: (0, i, 0)),
                  _grid.Tile((k_p, block, dim_p), lambda i: (0, i, 0))],
        out_tiles=[_grid.Tile((block, dim_p), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_p, dim_p), contract.compute)],
        contract=contract, name="jrl_moe_combine")(w, y)
    return out[:num_tokens, :dim]

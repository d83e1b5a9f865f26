"""Dispatch: (token, j) pairs -> an expert-sorted buffer of single-expert row tiles.

    dispatch(experts [N, k], *, num_experts, contract) -> Dispatch(row_token [R], pair_row [N, k],
                                                                   tile_expert [T], num_tiles [])

Integer ops, exact: the N*k (token, j) pairs are sorted stably by expert (then token, then j);
each expert's group is padded to a multiple of the row tile block_m = contract.matmul_block_m, so
every row tile holds rows of ONE expert; tile -> expert is data. Where a row lands depends on the
other tokens; what is computed for it does not (jrl.kernels.moe.expert_mlp).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.kernels.contract import NumericalContract


class Dispatch(NamedTuple):
    """Where every (token, j) pair sits in the expert-sorted row buffer of R = T * block_m rows.

    row_token [R] int32: the token of each row; N for padding rows (gathered as zeros).
    pair_row [N, k] int32: the row of pair (token, j).
    tile_expert [T] int32: the expert of each row tile; tiles from num_tiles on repeat the last
      live tile's expert (no new weight block is fetched for them).
    num_tiles [] int32: live tiles (the others hold padding only and are skipped).
    """

    row_token: jax.Array
    pair_row: jax.Array
    tile_expert: jax.Array
    num_tiles: jax.Array


def dispatch(experts: jax.Array, *, num_experts: int, contract: NumericalContract) -> Dispatch:
    """Sorts the N*k pairs by expert (stable: expert, then token, then j) and pads each expert's
    group to a multiple of block_m = contract.matmul_block_m. experts [N, k] int in [0, E].

    A pair whose expert is E is dropped: it gets no row (its pair_row is 0, never to be read),
    which is how expert parallelism marks the empty slots of a received buffer.
    Static sizes: R = N*k + min(E, N*k) * (block_m - 1) rounded up to block_m rows, T = R /
    block_m tiles (an upper bound; num_tiles of them are live). Integer ops only, exact.
    """
    num_tokens, top_k = experts.shape
    block_m = contract.matmul_block_m
    pairs = num_tokens * top_k
    num_rows = -(-(pairs + min(num_experts, pairs) * (block_m - 1)) // block_m) * block_m
    flat = experts.reshape(-1).astype(jnp.int32)           # pair p = token * k + j
    order = jnp.argsort(flat, stable=True)
    sorted_expert = flat[order]
    counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1, mode="drop")
    padded = -(-counts // block_m) * block_m
    start = jnp.cumsum(counts) - counts
    padded_start = jnp.cumsum(padded) - padded
    kept = sorted_expert < num_experts              # dropped pairs sort last (expert id E)
    expert_of = jnp.minimum(sorted_expert, num_experts - 1)
    row = padded_start[expert_of] + jnp.arange(pairs, dtype=jnp.int32) - start[expert_of]
    row = jnp.where(kept, row, num_rows)            # out of range: written nowhere
    pair_row = jnp.zeros((pairs,), jnp.int32).at[order].set(jnp.where(kept, row, 0))
    pair_row = pair_row.reshape(num_tokens, top_k)
    row_token = jnp.full((num_rows,), num_tokens, jnp.int32).at[row].set(order // top_k,
                                                                         mode="drop")
    tiles_end = jnp.cumsum(padded // block_m)               # [E]: tiles of experts 0..e
    num_tiles = tiles_end[-1]
    tile = jnp.minimum(jnp.arange(num_rows // block_m, dtype=jnp.int32), num_tiles - 1)
    tile_expert = jnp.searchsorted(tiles_end, tile, side="right").astype(jnp.int32)
    return Dispatch(row_token, pair_row, tile_expert, num_tiles)


def _gather_rows(x, row_token):
    """x [N, D] -> [R, D]: row r is x[row_token[r]], zeros where row_token is N (padding)."""
    return x.at[row_token].get(mode="fill", fill_value=0)

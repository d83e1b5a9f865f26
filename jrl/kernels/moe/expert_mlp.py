"""The experts' SwiGLU MLP on a dispatched row buffer (jrl.kernels.moe.dispatching): a grouped
matmul over row tiles that each hold one expert's rows.

    expert_rows(rows [T * block_m, D], tile_expert [T], num_tiles [], w_gate / w_up [E, D, F],
                w_down [E, F, D], *, contract) -> [T * block_m, D] float32

Why a row's result depends only on that row and its expert's weights: each row tile is
[block_m, D] x [D, F] (gate and up) and [block_m, F] x [F, D] (down) against its expert's
weights, the contraction walked in fixed block_k tiles in increasing order with float32
accumulation, exactly like jrl's matmul kernel. Tile shapes are fixed, so a row of a product
depends only on that row (the other rows of its tile are other tokens or zero padding).
act = silu(h) * u in float32, rounded once to the compute dtype; y = act @ W_down stays float32.
Tiles past the live ones are skipped (a data-dependent trip count in the emulated grid; pl.when
natively).

Weights are indexed by data: TPU (and the emulated CPU grid) through scalar prefetch (the
weight block's index_map reads tile -> expert); Triton has no scalar prefetch, so on GPU the
kernel gets the whole [E, K, N] weight and slices its expert's block itself.

The plain-XLA backend (contract.backend == "xla") runs the same dispatch with one dot per row
tile in a lax.scan (and a hand-written scan backward). It is the reference for gradients: the
Pallas moe_experts differentiates through it (custom_vjp). jax.lax.ragged_dot is not used: on a
CPU it lowers to a dense masked [E, rows, K] operand, E times the work (measured 38 s against
0.64 s for the scan at 32768 rows, D 1024, F 384, 64 experts).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract

_F32 = jnp.float32


def _silu(h):
    """silu(h) = h * (1 / (1 + exp(-h))), float32; the same formula in the kernel and the XLA
    path (exp(-h) = inf gives h * 0)."""
    return h * (1.0 / (1.0 + jnp.exp(-h)))


def _expert_kernel(ids, tile_expert_ref, num_tiles_ref, x_ref, *refs, gated: bool,
                   block_k: int, num_k: int, k_rem: int, block_n: int, whole_weights: bool):
    """One (row tile, column tile) step of a grouped matmul.

    tile_expert_ref [T], num_tiles_ref [1] int32; x_ref [block_m, K]: rows of one expert;
    weight refs (two when gated: gate, up; else one): the tile expert's [K, block_n] block, or
    with whole_weights (GPU) the whole [E, K, N] array, sliced here. o_ref [block_m, block_n]:
    silu(x W_gate) * (x W_up) when gated, else x W, from float32 accumulators. K = num_k *
    block_k + k_rem (k_rem only in the emulated grid). Tiles >= num_tiles write zeros.
    """
    *w_refs, o_ref = refs
    tile, col_block = ids
    if whole_weights:
        expert = tile_expert_ref[tile]
        col = pl.multiple_of(col_block * block_n, block_n)

        def w_block(w_ref, start, width):
            return w_ref[expert, pl.ds(start, width), pl.ds(col, block_n)]
    else:
        def w_block(w_ref, start, width):
            return w_ref[pl.ds(start, width), :]

    def k_tile(accs, start, width):
        xs = x_ref[:, pl.ds(start, width)]
        return tuple(acc + jax.lax.dot_general(xs, w_block(w_ref, start, width),
                                               (((1,), (0,)), ((), ())),
                                               preferred_element_type=_F32,
                                               precision=_grid.dot_precision(xs.dtype))
                     for acc, w_ref in zip(accs, w_refs))

    live = tile < num_tiles_ref[0]

    @pl.when(live)
    def _():
        accs = (jnp.zeros(o_ref.shape, _F32),) * len(w_refs)
        if num_k:
            accs = jax.lax.fori_loop(
                0, num_k,
                lambda k, accs: k_tile(accs, pl.multiple_of(k * block_k, block_k), block_k), accs)
        if k_rem:
            accs = k_tile(accs, num_k * block_k, k_rem)
        out = _silu(accs[0]) * accs[1] if gated else accs[0]
        o_ref[...] = out.astype(o_ref.dtype)

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("gated", "out_dtype", "contract"))
def _grouped_pallas(rows, ws, tile_expert, num_tiles, *, gated, out_dtype, contract):
    """rows [T * block_m, K], ws: [E, K, N] weights (one, or gate and up) -> [T * block_m, N]."""
    run = _grid.execution(contract)
    num_rows, k = rows.shape
    n = ws[0].shape[2]
    num_tile_slots = tile_expert.shape[0]
    bm, bn, bk = contract.matmul_block_m, contract.matmul_block_n, contract.matmul_block_k
    num_tiles = num_tiles.reshape(1)
    if run.emulate_grid:
        # As in matmul: a tile wider than the operand is the whole operand, K ends with a
        # narrower static tile and the last N tile is shifted left to end at N, so weights are
        # never padded; every shape depends on K and N only.
        bn, bk = min(bn, n), min(bk, k)
        num_k, k_rem = divmod(k, bk)
        n_p, whole_weights = n, False
        x_tile = _grid.Tile((bm, k), lambda i, j, te, nt: (i, 0))
        w_tile = _grid.Tile((None, k, bn), lambda i, j, te, nt: (te[i], 0, jnp.minimum(
            j * bn, n - bn)), element_offsets=True)
        out_tile = _grid.Tile((bm, bn), lambda i, j, te, nt: (i * bm, jnp.minimum(
            j * bn, n - bn)), element_offsets=True)
    else:
        rows = _grid.pad_axis(rows, 1, bk)
        ws = [_grid.pad_axis(_grid.pad_axis(w, 1, bk), 2, bn) for w in ws]
        k, n_p = rows.shape[1], ws[0].shape[2]
        num_k, k_rem = k // bk, 0
        whole_weights = run.platform == "gpu"
        if whole_weights:
            x_tile = _grid.Tile((bm, k), lambda i, j: (i, 0))
            w_tile = _grid.Tile()
            out_tile = _grid.Tile((bm, bn), lambda i, j: (i, j))
        else:
            # Skipped tiles read the last live tile's rows and expert: no new block is copied.
            x_tile = _grid.Tile((bm, k), lambda i, j, te, nt: (jnp.minimum(i, nt[0] - 1), 0))
            w_tile = _grid.Tile((None, k, bn), lambda i, j, te, nt: (te[i], 0, j))
            out_tile = _grid.Tile((bm, bn), lambda i, j, te, nt: (i, j))
    scalar_tiles = [_grid.Tile(), _grid.Tile()] if whole_weights else []
    kernel = functools.partial(_expert_kernel, gated=gated, block_k=bk, num_k=num_k,
                               k_rem=k_rem, block_n=bn, whole_weights=whole_weights)
    call = _grid.launch(
        kernel, grid=(num_tile_slots, -(-n_p // bn)),
        in_tiles=scalar_tiles + [x_tile] + [w_tile] * len(ws), out_tiles=[out_tile],
        out_shape=[jax.ShapeDtypeStruct((num_rows, n_p), out_dtype)], contract=contract,
        name="jrl_moe_gate_up" if gated else "jrl_moe_down",
        num_scalar_prefetch=0 if whole_weights else 2,
        grid_limit=lambda te, nt, *refs: nt[0])
    (y,) = call(tile_expert, num_tiles, rows, *ws)
    return y[:, :n]


@jax.custom_vjp
def _grouped_matmul_xla(rows, w, tile_expert, num_tiles):
    """Plain XLA: y [T * block_m, N] float32, tile t = rows of tile t @ w[tile_expert[t]]
    (float32 accumulation), zeros for tiles t >= num_tiles. rows [T * block_m, K], w [E, K, N]."""
    num_slots = tile_expert.shape[0]
    num_rows, k = rows.shape
    precision = _grid.dot_precision(rows.dtype)

    def step(_, tile):
        t, expert, xs = tile
        y = jax.lax.cond(t < num_tiles,
                         lambda: jnp.dot(xs, w[expert], precision=precision,
                                         preferred_element_type=_F32),
                         lambda: jnp.zeros((xs.shape[0], w.shape[2]), _F32))
        return None, y

    _, ys = jax.lax.scan(step, None, (jnp.arange(num_slots), tile_expert,
                                      rows.reshape(num_slots, -1, k)))
    return ys.reshape(num_rows, w.shape[2])


def _grouped_matmul_xla_fwd(rows, w, tile_expert, num_tiles):
    return _grouped_matmul_xla(rows, w, tile_expert, num_tiles), (rows, w, tile_expert, num_tiles)


def _grouped_matmul_xla_bwd(residuals, dy):
    # d_rows = dy @ w[e]^T per tile; dw[e] += rows^T @ dy, updated in place in the scan carry
    # (differentiating the forward scan adds a dense [E, K, N] cotangent at every tile).
    # float32 throughout, cast to the input dtypes at the end.
    rows, w, tile_expert, num_tiles = residuals
    num_slots = tile_expert.shape[0]
    num_rows, k = rows.shape
    hi = jax.lax.Precision.HIGHEST

    def step(dw, tile):
        t, expert, xs, d = tile

        def live(dw):
            we = w[expert].astype(_F32)
            dx = jnp.dot(d, we.T, precision=hi)
            dwe = dw[expert] + jnp.dot(xs.astype(_F32).T, d, precision=hi)
            return dx, jax.lax.dynamic_update_index_in_dim(dw, dwe, expert, 0)

        dx, dw = jax.lax.cond(t < num_tiles, live,
                              lambda dw: (jnp.zeros((xs.shape[0], k), _F32), dw), dw)
        return dw, dx

    dw, dxs = jax.lax.scan(step, jnp.zeros(w.shape, _F32),
                           (jnp.arange(num_slots), tile_expert, rows.reshape(num_slots, -1, k),
                            dy.reshape(num_slots, -1, dy.shape[1])))
    return dxs.reshape(num_rows, k).astype(rows.dtype), dw.astype(w.dtype), None, None


_grouped_matmul_xla.defvjp(_grouped_matmul_xla_fwd, _grouped_matmul_xla_bwd)


def expert_rows(rows: jax.Array, tile_expert: jax.Array, num_tiles: jax.Array,
                w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                contract: NumericalContract) -> jax.Array:
    """The experts' SwiGLU MLP on a dispatched row buffer (see Dispatch).

    rows [T * block_m, D], tile_expert [T] int32, num_tiles [] int32, w_gate/w_up [E, D, F],
    w_down [E, F, D] (all cast to the compute dtype). For each row of tile t with expert e:
    h = row W_gate[e], u = row W_up[e] (float32 accumulation), act = silu(h) * u in float32
    rounded once to the compute dtype, y = act W_down[e] -> [T * block_m, D] float32 (rows of
    tiles >= num_tiles: zeros natively and in the XLA backend, unspecified in the emulated
    grid). Each row's bits depend only on that row and its expert's weights (Pallas backend).
    The Pallas path is not differentiable by itself: differentiate moe_experts.
    """
    block_m = contract.matmul_block_m
    if rows.ndim != 2 or rows.shape[0] != tile_expert.shape[0] * block_m:
        raise ValueError(f"expert_rows: rows {rows.shape} must be [T * block_m, D] with T = "
                         f"{tile_expert.shape[0]} tiles of matmul_block_m={block_m}")
    compute = contract.compute
    rows = rows.astype(compute)
    w_gate, w_up, w_down = (w.astype(compute) for w in (w_gate, w_up, w_down))
    num_tiles = num_tiles.astype(jnp.int32)
    if _grid.uses_pallas(contract):
        act = _grouped_pallas(rows, (w_gate, w_up), tile_expert, num_tiles, gated=True,
                              out_dtype=compute, contract=contract)
        return _grouped_pallas(act, (w_down,), tile_expert, num_tiles, gated=False,
                               out_dtype=_F32, contract=contract)
    h = _grouped_matmul_xla(rows, w_gate, tile_expert, num_tiles)
    u = _grouped_matmul_xla(rows, w_up, tile_expert, num_tiles)
    act = (_silu(h) * u).astype(compute)
    return _grouped_matmul_xla(act, w_down, tile_expert, num_tiles)

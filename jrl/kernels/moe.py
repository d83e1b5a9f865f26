"""Batch-invariant mixture of experts: router, dropless grouped expert compute, combine.

    route(router_logits, *, top_k, norm_topk_prob, contract) -> Routing(experts, weights, probs)
    routing_weights(probs, experts, *, norm_topk_prob)               the weights of given experts
    moe_experts(x, experts, weights, w_gate, w_up, w_down, *, contract)      x [N, D] -> [N, D]

and, for expert parallelism: dispatch(experts, ...) -> Dispatch, expert_rows(rows, tile_expert,
num_tiles, ...) on a dispatched row buffer, combine(y_rows, pair_row, weights, ...), and
moe_experts_sharded(..., axis=...), which moves rows between devices with all-to-alls inside
shard_map and combines each token on its home device from them.

Why a token's bits depend only on its own row, its experts and their weights (never on which or
how many other tokens share its experts, the batch size or its position):

- Router: softmax over the E experts of one row inside one row tile of a Pallas kernel (max,
  exp, sum, one reciprocal). Top-k is k rounds of "max; lowest expert index among equal
  probabilities", and the weights are a gather, a sum in the order j = 0..k-1 and one reciprocal:
  exact or elementwise IEEE operations, with no reduction whose order XLA could pick and no
  product feeding a sum that a compiler could fuse into an FMA in one program and not another.
- Dispatch (integer, exact): the N*k (token, j) pairs are sorted stably by expert (then token,
  then j); each expert's group is padded to a multiple of the row tile block_m =
  contract.matmul_block_m, so every row tile holds rows of ONE expert; tile -> expert is data.
  Where a row lands depends on the other tokens; what is computed for it does not:
- Expert compute: each row tile is [block_m, D] x [D, F] (gate and up) and [block_m, F] x [F, D]
  (down) against its expert's weights, the contraction walked in fixed block_k tiles in
  increasing order with float32 accumulation, exactly like jrl's matmul kernel. Tile shapes are
  fixed, so a row of a product depends only on that row (the other rows of its tile are other
  tokens or zero padding). act = silu(h) * u in float32, rounded once to the compute dtype;
  y = act @ W_down stays float32. Tiles past the live ones are skipped (a data-dependent trip
  count in the emulated grid; pl.when natively).
- Combine: out[n] = sum_j weights[n, j] * y(n, j) for j = 0..k-1 in float32 in a row-tiled
  kernel, rounded once to the compute dtype: a fixed order on the token's home device.

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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


# -------------------------------------------------------------------------------------------------
# Router.

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


# -------------------------------------------------------------------------------------------------
# Dispatch: (token, j) pairs -> an expert-sorted buffer of single-expert row tiles.

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


# -------------------------------------------------------------------------------------------------
# Expert compute on a dispatched row buffer.

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


# -------------------------------------------------------------------------------------------------
# Combine on the home device.

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


# -------------------------------------------------------------------------------------------------
# The whole expert layer.

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

    (module docstring: why each token's bits depend only on its own row). Differentiable w.r.t.
    x, weights, w_gate, w_up, w_down (custom_vjp through the plain-XLA backend); experts carry
    no gradient.
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


# -------------------------------------------------------------------------------------------------
# Expert parallelism: the same layer with the experts split over a mesh axis.

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

"""One flash-attention kernel for the train forward, prefill and decode (GQA, explicit positions).

Grid (batch, kv head, query block). A grid step holds the G = Hq / Hkv query heads of one kv head
for attn_block_q query rows, stacked as a [G * block_q, D] matrix, and walks the KV blocks of
attn_block_k keys (aligned at index 0) in increasing order with an online softmax in float32.
Key j is visible to query i iff kv_valid[j] and kv_positions[j] <= q_positions[i]. In the
emulated (CPU) grid a step holds one query block of contract.emulated_attn_batch sequences and
every kv head (or contract.emulated_heads of them), as batch dims of each dot: the same per-row
arithmetic in fewer, larger steps (an 8-slot decode runs 1 step per layer, not 8).

Why decode gives the train forward's bits: a query's row sees the same KV blocks with the same
contents in the same order whether it is row p of a full sequence or the only real row of a
decode block padded to block_q rows; the dot and reduction shapes are the same ([G*block_q, D] x
[D, block_k]); masked and stale keys contribute exact zeros (scores MASKED, probabilities
where(mask, exp(s - m), 0)); and a KV block with no visible key for a row is an exact identity on
that row's (m, l, acc) (alpha = exp(0) = 1, zero probabilities), so skipping it or not changes
nothing. Stale cache entries must be finite (0 * inf is NaN); the cache is zero-initialised. (In
the emulated grid a sequence also walks the KV blocks its block-mates see, so this holds for
every entry of every sequence's cache, not only those below its own length.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import _grid, reference
from jrl.kernels.contract import NumericalContract
from jrl.kernels.reference import MASKED

_INT_MAX = jnp.iinfo(jnp.int32).max
_INT_MIN = jnp.iinfo(jnp.int32).min


def _attention_kernel(ids, bounds_ref, q_pos_ref, kv_pos_ref, q_ref, k_ref, v_ref, o_ref, *,
                      scale: float, block_k: int):
    """One (batch, kv head, query block) step natively; one query block of every sequence and
    kv head in the emulated grid.

    bounds_ref [2] int32: first and one-past-last KV block with any key visible to this query
      block (emulated: to this query block of any sequence; blocks outside are fully masked
      for every row).
    Natively q_pos_ref [block_q, 1] int32, kv_pos_ref [1, Tk] int32 (INT_MAX where invalid),
    q_ref [G, block_q, D], k_ref, v_ref [Tk, D]. Emulated q_pos_ref [B, block_q, 1],
    kv_pos_ref [B, 1, Tk], q_ref [B, Hkv, G, block_q, D], k_ref, v_ref [B, Tk, Hkv, D]: the
    sequences and kv heads are batch dims of every dot. o_ref is q_ref's shape. q k^T is taken
    in the compute dtype with float32 accumulation, p @ v in float32 (as in the reference).
    """
    del ids
    first, last = bounds_ref[0], bounds_ref[1]
    lead = q_ref.shape[:-3]                     # (B, Hkv) emulated, () natively
    group, block_q, dim = q_ref.shape[-3:]
    rows = group * block_q
    q = q_ref[...].reshape(lead + (rows, dim))
    precision = _grid.dot_precision(q.dtype)
    # Natively 2-D dots (Triton has no batched dot). Emulated, a grid step covers a block of
    # emulated_attn_batch sequences and every kv head as batch dims of each dot: a fixed batch
    # count, so every call computes a row with the same dot shapes (XLA's CPU dots give a batch
    # element bits that depend on the batch count); decode on 8 slots is 1 step, not 8.
    if lead:
        batch = lead[0]
        q_pos = jnp.broadcast_to(q_pos_ref[...][:, None], (batch, group, block_q, 1))
        q_pos = q_pos.reshape(batch, 1, rows, 1)
        scores_dims = (((3,), (3,)), ((0, 1), (0, 2)))      # [B, H, rows, D] x [B, bk, H, D]
        values_dims = (((3,), (1,)), ((0, 1), (0, 2)))      # [B, H, rows, bk] x [B, bk, H, D]

        def kv_block(ref, start):
            return ref[:, pl.ds(start, block_k)]

        def kv_pos_block(start):
            return kv_pos_ref[:, :, pl.ds(start, block_k)][:, :, None, :]     # [B, 1, 1, bk]
    else:
        q_pos = jnp.broadcast_to(q_pos_ref[...][None], (group, block_q, 1)).reshape(rows, 1)
        scores_dims = (((1,), (1,)), ((), ()))
        values_dims = (((1,), (0,)), ((), ()))

        def kv_block(ref, start):
            return ref[pl.ds(start, block_k)]

        def kv_pos_block(start):
            return kv_pos_ref[:, pl.ds(start, block_k)]                         # [1, bk]

    def kv_step(j, carry):
        m, l, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = kv_block(k_ref, start)
        v = kv_block(v_ref, start).astype(jnp.float32)
        visible = kv_pos_block(start) <= q_pos                                  # [.., rows, bk]
        s = jax.lax.dot_general(q, k, scores_dims, precision=precision,
                                preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible, s, MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
        l = alpha * l + jnp.sum(p, axis=-1, keepdims=True)
        acc = alpha * acc + jax.lax.dot_general(p, v, values_dims,
                                                precision=jax.lax.Precision.HIGHEST,
                                                preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full(lead + (rows, 1), MASKED, jnp.float32),
            jnp.zeros(lead + (rows, 1), jnp.float32), jnp.zeros(lead + (rows, dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first, last, kv_step, init)
    out = acc / jnp.where(l == 0.0, 1.0, l)        # no visible key: 0, like the reference
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)


def reads_stack_in_place(contract: NumericalContract, layer_shape: tuple, dtype) -> bool:
    """Whether attention(..., layer=l) reads a KV cache stack whose layers are [B, Tk, Hkv, D]
    of `dtype` in place. Only the emulated (CPU) grid can: its K/V blocks are views of layer
    l, when the layer needs no padding (whole KV blocks, B >= emulated_attn_batch, no padded
    head dim) and is float32, the compute dtype (the emulated grid passes bfloat16 operands as
    their bits, jrl.kernels._grid: read in place, a bfloat16 stack of SmolLM2's 30 layers at 32
    slots and capacity 512 took 80 ms per call on the CPU, against 1.2 ms for the sliced layer).
    Otherwise the layer is sliced out first (a copy of one layer, which a native grid's
    transpose makes anyway)."""
    batch, tk, _, dim = layer_shape
    return (_grid.execution(contract).emulate_grid and batch >= contract.emulated_attn_batch
            and tk % contract.attn_block_k == 0 and contract.kernel_dim(dim) == dim
            and jnp.dtype(dtype) == jnp.dtype(contract.compute) == jnp.float32)


def _without_layer(kernel, ids, layer_ref, *refs):
    """kernel(ids, *refs): the layer index only places the K/V views (their index maps)."""
    del layer_ref
    kernel(ids, *refs)


def _kv_block_bounds(q_pos, kv_pos, block_q, block_k):
    """[B, nq, 2] int32: per (batch, query block), the first and one-past-last KV block holding
    a key visible to some query of the block (0, 0 when none). q_pos [B, Tq_p] (padded rows
    INT_MIN), kv_pos [B, Tk_p] (invalid INT_MAX)."""
    batch, tq = q_pos.shape
    tk = kv_pos.shape[1]
    q_max = q_pos.reshape(batch, tq // block_q, block_q).max(axis=-1)               # [B, nq]
    kv_min = kv_pos.reshape(batch, tk // block_k, block_k).min(axis=-1)             # [B, nk]
    visible = kv_min[:, None, :] <= q_max[:, :, None]                                # [B, nq, nk]
    num_k = tk // block_k
    any_visible = visible.any(axis=-1)
    first = jnp.argmax(visible, axis=-1)
    last = num_k - jnp.argmax(visible[..., ::-1], axis=-1)
    bounds = jnp.stack([jnp.where(any_visible, first, 0), jnp.where(any_visible, last, 0)], -1)
    return bounds.astype(jnp.int32)


def _union_over_blocks(bounds, starts, block_b):
    """[B, nq, 2] -> [len(starts), nq, 2]: per block of sequences [start, start + block_b) and
    query block, the KV blocks visible to that query block of any of them (first of the
    firsts, last of the lasts; 0, 0 when none)."""
    rows = bounds[starts[:, None] + jnp.arange(block_b)[None]]          # [nb, block_b, nq, 2]
    has = rows[..., 1] > rows[..., 0]
    first = jnp.min(jnp.where(has, rows[..., 0], _INT_MAX), axis=1)
    last = jnp.max(jnp.where(has, rows[..., 1], 0), axis=1)
    return jnp.stack([jnp.where(has.any(axis=1), first, 0), last], -1).astype(jnp.int32)


class AttentionPlan(NamedTuple):
    """Which keys each query sees, in the kernel's layout: the same for every layer of one
    forward, so a model computes it once (`plan`) instead of once per layer.

    q_pos [B', Tq_p] int32 (padded rows INT_MIN), kv_pos [B', Tk_p] int32 (invalid and padded
    keys INT_MAX), bounds: per grid row and query block, the first and one-past-last KV block
    with a visible key ([B', nq, 2] natively; per block of sequences in the emulated grid).
    B' is B, or emulated_attn_batch when the emulated grid pads a smaller batch."""

    q_pos: jax.Array
    kv_pos: jax.Array
    bounds: jax.Array


def plan(q_positions: jax.Array, kv_positions: jax.Array, kv_valid: jax.Array,
         contract: NumericalContract) -> AttentionPlan:
    """The AttentionPlan of q_positions [B, Tq], kv_positions / kv_valid [B, Tk] (attention's
    visibility rule) for contract's tiles."""
    block_q, block_k = contract.attn_block_q, contract.attn_block_k
    q_pos = _grid.pad_axis(q_positions.astype(jnp.int32), 1, block_q, _INT_MIN)
    kv_pos = jnp.where(kv_valid, kv_positions.astype(jnp.int32), _INT_MAX)
    kv_pos = _grid.pad_axis(kv_pos, 1, block_k, _INT_MAX)
    if not _grid.execution(contract).emulate_grid:
        return AttentionPlan(q_pos, kv_pos, _kv_block_bounds(q_pos, kv_pos, block_q, block_k))
    block_b = contract.emulated_attn_batch
    if q_pos.shape[0] < block_b:
        q_pos = _grid.pad_axis(q_pos, 0, block_b, _INT_MIN)
        kv_pos = _grid.pad_axis(kv_pos, 0, block_b, _INT_MAX)
    batch_p = q_pos.shape[0]
    starts = _emulated_first_rows(jnp.arange(-(-batch_p // block_b)), batch_p, block_b)
    return AttentionPlan(q_pos, kv_pos, _union_over_blocks(
        _kv_block_bounds(q_pos, kv_pos, block_q, block_k), starts, block_b))


def _emulated_first_rows(j, batch_p: int, block_b: int):
    """First sequence of the emulated grid's block j of sequences (the last block is shifted
    left to end at batch_p)."""
    return jnp.minimum(j * block_b, batch_p - block_b)


@functools.partial(jax.jit, static_argnums=(7, 8))
def attention_forward(q, k, v, q_positions, kv_positions, kv_valid, layer, scale, contract,
                      mask_plan=None):
    """The kernel call; q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] in any float dtype -> compute.

    layer: None, or an int32 scalar with k/v stacks [L, B, Tk, Hkv, D] of which layer `layer`
    is read (a model's KV cache, updated in place; see `attention`). mask_plan: `plan` of the
    positions, when the caller computed it once for all layers."""
    batch, tq, hq, dim = q.shape
    hkv = k.shape[-2]
    group = hq // hkv
    block_q, block_k = contract.attn_block_q, contract.attn_block_k
    run = _grid.execution(contract)
    compute = contract.compute

    if mask_plan is None:
        mask_plan = plan(q_positions, kv_positions, kv_valid, contract)
    q_pos, kv_pos, bounds = mask_plan
    tq_p, tk_p = q_pos.shape[1], kv_pos.shape[1]

    # q as [B, Hkv, G, Tq_p, D]: a block is the [G, block_q, D] stack of one kv head's heads.
    # On GPU the group and head dims are zero-padded to kernel_dim (Triton: powers of two);
    # zero query heads and zero features change no real score.
    group_p, dim_p = contract.kernel_dim(group), contract.kernel_dim(dim)
    qt = q.astype(compute).reshape(batch, tq, hkv, group, dim)
    qt = _grid.pad_axis(_grid.pad_axis(qt, 3, group_p), 4, dim_p)
    qt = _grid.pad_axis(qt.transpose(0, 2, 3, 1, 4), 3, block_q)
    in_place = layer is not None and reads_stack_in_place(contract, k.shape[1:], k.dtype)
    if layer is not None and not in_place:
        # lax's dynamic index, not jnp's k[layer] (which adds a negative-index fix-up).
        k, v = (jax.lax.dynamic_index_in_dim(a, layer, keepdims=False) for a in (k, v))
    # K/V stay in the compute dtype (a KV cache is not widened or copied on every call); the
    # kernel widens each block it reads.
    if not in_place:
        k = _grid.pad_axis(_grid.pad_axis(k.astype(compute), 1, block_k), 3, dim_p)
        v = _grid.pad_axis(_grid.pad_axis(v.astype(compute), 1, block_k), 3, dim_p)
    if run.emulate_grid:
        # One step per (block of sequences, query block), holding every kv head; K/V read in
        # place as [B, Tk, Hkv, D] (transposing a KV cache copies all of it). A step's dots
        # have the same shape whatever B is: XLA's CPU dots give a batch element bits that
        # depend on the batch count, so sequences go in blocks of contract.emulated_attn_batch
        # (a batch that is not a multiple of it ends with a block shifted left to end at B,
        # whose overlap is recomputed with the same bits; a smaller batch is padded). A step
        # walks the KV blocks any of its sequences can see: a block with no visible key for a
        # row is an exact identity on that row's statistics (module docstring).
        block_b = contract.emulated_attn_batch
        if batch < block_b:
            qt = _grid.pad_axis(qt, 0, block_b)
            k, v = _grid.pad_axis(k, 0, block_b), _grid.pad_axis(v, 0, block_b)
        batch_p = qt.shape[0]
        num_b = -(-batch_p // block_b)
        # KV heads per step: all of the layer's by default; a fixed count keeps a step's dot
        # shapes when the layer's head count changes (a tensor-parallel device holds 1 / T).
        heads = contract.emulated_heads or hkv
        if hkv % heads:
            raise ValueError(f"NumericalContract.emulated_heads={heads}: must divide the "
                             f"layer's {hkv} KV heads (0: all of them in one step)")

        def first_row(j):
            return _emulated_first_rows(j, batch_p, block_b)

        if heads == hkv:
            grid = (num_b, tq_p // block_q)

            def ids(index_map):         # (j, i, *prefetch) -> index_map(j, 0, i, *prefetch)
                return lambda j, i, *rest: index_map(j, 0, i, *rest)
        else:
            grid = (num_b, hkv // heads, tq_p // block_q)

            def ids(index_map):
                return index_map
        # `*_` takes the layer index (a scalar-prefetch ref) when the K/V are a stack.
        if in_place:
            kv_tile = _grid.Tile((None, block_b, tk_p, heads, dim_p), ids(
                lambda j, h, i, layer_ref: (layer_ref[0], first_row(j), 0, h * heads, 0)),
                element_offsets=True)
        else:
            kv_tile = _grid.Tile((block_b, tk_p, heads, dim_p), ids(
                lambda j, h, i, *_: (first_row(j), 0, h * heads, 0)), element_offsets=True)
        q_tile = _grid.Tile((block_b, heads, group_p, block_q, dim_p), ids(
            lambda j, h, i, *_: (first_row(j), h * heads, 0, i * block_q, 0)),
            element_offsets=True)
        bounds_tile = _grid.Tile((None, None, 2), ids(lambda j, h, i, *_: (j, i, 0)),
                                 scalars=True)
        q_pos_tile = _grid.Tile((block_b, block_q, 1),
                                ids(lambda j, h, i, *_: (first_row(j), i * block_q, 0)),
                                element_offsets=True)
        kv_pos_tile = _grid.Tile((block_b, 1, tk_p), ids(lambda j, h, i, *_: (first_row(j), 0, 0)),
                                 element_offsets=True)
    else:
        grid = (batch, hkv, tq_p // block_q)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        kv_tile = _grid.Tile((None, None, tk_p, dim_p), lambda b, h, i: (b, h, 0, 0))
        q_tile = _grid.Tile((None, None, group_p, block_q, dim_p),
                            lambda b, h, i: (b, h, 0, i, 0))
        row_ids = lambda b, h, i: (b, i, 0)     # noqa: E731
        bounds_tile = _grid.Tile((None, None, 2), row_ids, scalars=True)
        q_pos_tile = _grid.Tile((None, block_q, 1), row_ids)
        kv_pos_tile = _grid.Tile((None, 1, tk_p), lambda b, h, i: (b, 0, 0))
    kernel = functools.partial(_attention_kernel, scale=scale, block_k=block_k)
    prefetch = ()
    if in_place:
        kernel = functools.partial(_without_layer, kernel)
        prefetch = (jnp.reshape(layer, (1,)).astype(jnp.int32),)
    call = _grid.launch(
        kernel, grid=grid,
        in_tiles=[bounds_tile, q_pos_tile, kv_pos_tile, q_tile, kv_tile, kv_tile],
        out_tiles=[q_tile],
        out_shape=[jax.ShapeDtypeStruct(qt.shape, compute)],
        contract=contract, name="jrl_attention", num_scalar_prefetch=len(prefetch))
    (out,) = call(*prefetch, bounds, q_pos[..., None], kv_pos[:, None, :], qt, k, v)
    out = out[:batch, :, :group, :tq, :dim]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, tq, hq, dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, q_positions, kv_positions, kv_valid, scale, contract):
    return attention_forward(q, k, v, q_positions, kv_positions, kv_valid, None, scale, contract)


def _attention_fwd(q, k, v, q_positions, kv_positions, kv_valid, scale, contract):
    out = attention_forward(q, k, v, q_positions, kv_positions, kv_valid, None, scale, contract)
    return out, (q, k, v, q_positions, kv_positions, kv_valid)


def _attention_bwd(scale, contract, residuals, dout):
    q, k, v, q_positions, kv_positions, kv_valid = residuals
    compute = contract.compute

    def ref(q, k, v):
        return reference.attention(q.astype(compute), k.astype(compute), v.astype(compute),
                                   q_positions=q_positions, kv_positions=kv_positions,
                                   kv_valid=kv_valid, scale=scale)

    _, vjp = jax.vjp(ref, q, k, v)
    dq, dk, dv = vjp(dout.astype(compute))
    return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_positions: jax.Array, kv_valid: jax.Array, contract: NumericalContract,
              scale: float | None = None, layer: jax.Array | None = None,
              mask_plan: AttentionPlan | None = None) -> jax.Array:
    """Causal softmax attention with explicit positions and GQA, batch- and stage-invariant.

    q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] (Hq a multiple of Hkv); q_positions [B, Tq] int,
    kv_positions [B, Tk] int, kv_valid [B, Tk] bool. Key j is visible to query i iff kv_valid[j]
    and kv_positions[j] <= q_positions[i] (q_positions < 2^31 - 1). softmax(q k^T * scale) v with
    float32 statistics; a query with no visible key returns 0. Returns [B, Tq, Hq, D] in the
    compute dtype. Train forward: Tq = Tk = T; decode: Tq = 1 against a cache of capacity Tk.
    Differentiable w.r.t. q, k, v (custom_vjp through the reference).

    layer (an int32 scalar): k/v are a model's KV cache stacks [L, B, Tk, Hkv, D] and layer
    `layer` is attended over, with the same bits as passing k[layer], v[layer]. The emulated
    (CPU) grid reads the stack in place, so a decode step does not copy each layer's cache out
    of its stack. Not differentiable (a KV cache is sampler state, never trained through).
    mask_plan (with layer): `plan(q_positions, kv_positions, kv_valid, contract)`, computed once
    for every layer of a forward; the positions are then used for shape checks only.
    """
    one_layer = (lambda x: x) if layer is None else (lambda x: x[0])
    _check_shapes(q, one_layer(k), one_layer(v), q_positions, kv_positions, kv_valid)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if layer is not None:
        return attention_forward(q, k, v, q_positions, kv_positions, kv_valid,
                                 jnp.asarray(layer, jnp.int32), scale, contract, mask_plan)
    return _attention(q, k, v, q_positions, kv_positions, kv_valid, scale, contract)


def _check_shapes(q, k, v, q_positions, kv_positions, kv_valid):
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"attention: expected q [B, Tq, Hq, D] and k = v [B, Tk, Hkv, D], got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    batch, tq, hq, dim = q.shape
    _, tk, hkv, kdim = k.shape
    if k.shape[0] != batch or kdim != dim or hq % hkv:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} disagree (batch, head dim, or "
                         "Hq not a multiple of Hkv)")
    if q_positions.shape != (batch, tq):
        raise ValueError(f"attention: q_positions {q_positions.shape} must be {(batch, tq)}")
    if kv_positions.shape != (batch, tk) or kv_valid.shape != (batch, tk):
        raise ValueError(f"attention: kv_positions {kv_positions.shape} and kv_valid "
                         f"{kv_valid.shape} must be {(batch, tk)}")

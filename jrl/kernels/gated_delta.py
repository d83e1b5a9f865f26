"""The gated delta rule (Gated DeltaNet's linear attention) in ONE canonical chunked order.

Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464), per value head, with unit keys
and queries (q_t, k_t L2-normalised, q_t scaled by dk^-1/2) and a state S [dk, dv]:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t.

Engines run it chunked for prefill and training and per token for decode: two floating-point
programs, so the sampler's logprob could never equal the trainer's. Here every stage evaluates the
same chunk formula over chunks of C = contract.delta_chunk rows aligned at position 0, in float32,
per (batch row, value head), for a chunk with rows i, j in [0, C) and chunk-start state S:

    G_i    = g_0 + ... + g_i                                   cumulative log decay
    D_ij   = exp(G_i - G_j) if j <= i else 0                   (masked before exp: no inf)
    A      = strictly_lower((beta k) k^T * D)                   [C, C]
    Tinv   = (I + A)^-1 = (I + N)(I + N^2)(I + N^4)...(I + N^(C/2)),  N = -A (nilpotent)
    U      = Tinv (beta v)                                      [C, dv]
    W      = Tinv (beta k exp(G))                               [C, dk]
    V_new  = U - W S
    out    = (q exp(G)) S + lower_incl(q k^T * D) V_new          [C, dv]
    S_next = S exp(G_last) + (k exp(G_last - G))^T V_new          [dk, dv]

(the WY/UT form of the paper's chunkwise algorithm, as in transformers'
torch_chunk_gated_delta_rule).

Why decode and prefill give the train forward's bits. A decode step for position n = cC + i
evaluates the chunk formula over a window of C rows: the cached rows 0..i-1 of chunk c, the new
row i, and invalid rows after it, from the cached chunk-start state S_c (prefill and append are
windows of several chunks). Row i of every intermediate depends on rows j > i only through
products with exact zeros, so row i's bits are those of the full-sequence forward, whose rows
j > i hold real data:
- Row-wise steps (the L2 norms, beta and exp(G) scalings, (q exp(G)) S, W S) see row i only.
- G: G_row[j] = sum_i where(i <= j, g_i, 0) is a masked reduction (the masked entries are exact
  zeros, not products), and G_col is its transpose taken by the same masked selection, so G_i
  is bit-identical and D_ii = exp(0) = 1 exactly.
- D, A and the intra-chunk matrix are masked with `where` after they are formed: entry (i, j)
  is a dot of rows i and j only, and every masked entry is exactly +0 whatever the data.
- Tinv: each squaring and product X @ Y, X masked to (strictly) lower triangular, gives row
  i = sum_j X[i, j] Y[j, :]: real terms from rows j <= i and 0 * Y[j, :] from j > i; it is
  masked again to keep exact zeros above the diagonal. U, W and the intra-chunk term of out are
  such products too.
- S_next sums over all C rows, but a state is only ever taken from a complete chunk, whose rows
  are the same in every stage.
A masked term 0 * x (x finite) is +-0, and y + (+-0) = y for every y != 0, so in any summation
order it leaves a sum unchanged; a sum of only zeros is +0 whatever their signs, because a dot
accumulates from +0 (+0 + -0 = +0). So no real row's bits depend on later rows, down to the sign
of an exact 0 (the tests include an all-zero query row). Dot and reduction shapes are those of
one chunk in every stage, the chunk loop's trip count is data (no compiler specialises a
one-chunk window), and a row never meets another batch row, so the result is batch-invariant
too. Invalid rows may hold anything, even inf/NaN: the wrapper replaces their q, k, v, g, beta
by 0 before the kernel (`where`, not a product), which makes them identity tokens
(S exp(0) + 0) with output exactly 0 (q = 0).

Grid: natively one program per (batch row, value head), 2-D dots; in the emulated CPU grid one
program per batch row holding all heads, or per (row, block of contract.emulated_heads value
heads) (batched dots over heads). The program walks the chunks
in increasing order carrying S in float32 and keeps the state at the start of chunk
state_chunk. The backward (custom_vjp) is jax.vjp of the plain-XLA chunked reference, which runs
the same chunk formula vectorised over batch and heads.

TPU note: a program's blocks hold its whole sequence in VMEM ([T, dk], [T, dv] and [T, 1] float32
per input), so very long sequences need chunked prefill windows there; this has not been run on a
TPU (only Mosaic lowering and the TPU interpreter are tested).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract

_F32 = jnp.float32
L2NORM_EPS = 1e-6      # transformers' (and FLA's) l2norm: x * rsqrt(sum(x^2) + eps)


class GatedDeltaOut(NamedTuple):
    """out [B, T, Hv, dv] in contract.compute; state [B, Hv, dk, dv] float32 at the start of
    chunk state_chunk[b]."""

    out: jax.Array
    state: jax.Array


# -------------------------------------------------------------------------------------------------
# The canonical chunk formula, shared by the kernel (2-D natively, batched over heads on a CPU)
# and the plain-XLA reference (batched over batch rows and heads).

def _dot(a, b, a_contract: int, b_contract: int):
    """dot_general over the last two dims (0: rows, 1: columns), every leading dim a batch dim;
    float32 in full precision."""
    batch = tuple(range(a.ndim - 2))
    lead = len(batch)
    dims = (((a_contract + lead,), (b_contract + lead,)), (batch, batch))
    return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=_F32)


def _l2_normalize(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def _chunk(q, k, v, g, beta, state, *, scale: float, group: int):
    """One chunk of the canonical formula (module docstring), float32.

    q, k [..., Hk, C, dk] raw (normalised here); v [..., Hv, C, dv]; g, beta [..., Hv, C, 1];
    state [..., Hv, dk, dv]. Hv = group * Hk (value head h reads key head h // group); natively
    there is no head dim and group is 1. Returns (out [..., Hv, C, dv], next state).
    """
    chunk = q.shape[-2]
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    lower, strict, diag = col <= row, col < row, col == row
    q = _l2_normalize(q) * scale
    k = _l2_normalize(k)
    if group > 1:
        q, k = jnp.repeat(q, group, axis=-3), jnp.repeat(k, group, axis=-3)

    # G_row[j] = sum_{i <= j} g_i (masked sum, not a cumsum whose order XLA picks); G_col is its
    # exact transpose (one value plus zeros per row).
    g_row = jnp.sum(jnp.where(row <= col, g, 0.0), axis=-2, keepdims=True)        # [..., 1, C]
    g_col = jnp.sum(jnp.where(diag, g_row, 0.0), axis=-1, keepdims=True)          # [..., C, 1]
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, g_col - g_row, 0.0)), 0.0)   # D

    k_beta = k * beta
    n = jnp.where(strict, -(_dot(k_beta, k, 1, 1) * decay), 0.0)                   # N = -A
    inverse = jnp.where(diag, 1.0, n)                                              # I + N
    power = n
    for _ in range(chunk.bit_length() - 2):          # log2(C) - 1 more factors
        power = jnp.where(strict, _dot(power, power, 1, 0), 0.0)                   # N^(2^m)
        inverse = inverse + jnp.where(strict, _dot(inverse, power, 1, 0), 0.0)

    u = _dot(inverse, v * beta, 1, 0)
    w = _dot(inverse, k_beta * jnp.exp(g_col), 1, 0)
    v_new = u - _dot(w, state, 1, 0)
    intra = jnp.where(lower, _dot(q, k, 1, 1) * decay, 0.0)
    out = _dot(q * jnp.exp(g_col), state, 1, 0) + _dot(intra, v_new, 1, 0)

    last_row = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) == chunk - 1
    g_last = jnp.sum(jnp.where(last_row, g_col, 0.0), axis=-2, keepdims=True)     # [..., 1, 1]
    next_state = state * jnp.exp(g_last) + _dot(k * jnp.exp(g_last - g_col), v_new, 0, 0)
    return out, next_state


# -------------------------------------------------------------------------------------------------
# Input preparation shared by the kernel wrapper and the references.

def _check_inputs(q, k, v, g, beta, valid, initial_state, state_chunk):
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4:
        raise ValueError(f"gated_delta_rule: expected q = k [B, T, Hk, dk] and v [B, T, Hv, dv], "
                         f"got {q.shape}, {k.shape}, {v.shape}")
    batch, time, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if v.shape[:2] != (batch, time) or hv % hk:
        raise ValueError(f"gated_delta_rule: v {v.shape} must be [B, T, Hv, dv] with Hv a "
                         f"multiple of Hk for q {q.shape}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, time, hv):
            raise ValueError(f"gated_delta_rule: {name} {x.shape} must be {(batch, time, hv)}")
    if valid.shape != (batch, time) or valid.dtype != jnp.bool_:
        raise ValueError(f"gated_delta_rule: valid {valid.shape} {valid.dtype} must be bool "
                         f"{(batch, time)}")
    if initial_state.shape != (batch, hv, dk, dv):
        raise ValueError(f"gated_delta_rule: initial_state {initial_state.shape} must be "
                         f"{(batch, hv, dk, dv)}")
    if state_chunk.shape != (batch,) or not jnp.issubdtype(state_chunk.dtype, jnp.integer):
        raise ValueError(f"gated_delta_rule: state_chunk {state_chunk.shape} {state_chunk.dtype} "
                         f"must be int {(batch,)}")


def _prepare(q, k, v, g, beta, valid, contract):
    """Casts (q, k, v through contract.compute, then float32: exact), zeroes invalid rows, pads
    T to a multiple of C with invalid rows, and moves heads first:
    q, k [B, Hk, Tp, dk]; v [B, Hv, Tp, dv]; g, beta [B, Hv, Tp, 1]; all float32."""
    compute = contract.compute
    keep = valid[:, :, None]
    q, k, v = (jnp.where(keep[..., None], x.astype(compute).astype(_F32), 0.0) for x in (q, k, v))
    g, beta = (jnp.where(keep, x.astype(_F32), 0.0)[..., None] for x in (g, beta))
    return tuple(_grid.pad_axis(x.transpose(0, 2, 1, 3), 2, contract.delta_chunk)
                 for x in (q, k, v, g, beta))


def _prepare_time_major(q, k, v, g, beta, valid, contract):
    """_prepare without moving heads first: q, k [B, Tp, Hk, dk]; v [B, Tp, Hv, dv]; g, beta
    [B, Tp, Hv]; all float32 (the emulated grid's layout)."""
    compute = contract.compute
    keep = valid[:, :, None]
    q, k, v = (jnp.where(keep[..., None], x.astype(compute).astype(_F32), 0.0) for x in (q, k, v))
    g, beta = (jnp.where(keep, x.astype(_F32), 0.0) for x in (g, beta))
    return tuple(_grid.pad_axis(x, 1, contract.delta_chunk) for x in (q, k, v, g, beta))


def _finish_out(out, time, dv, compute):
    """[B, Hv, Tp, dv_p] -> [B, T, Hv, dv] in the compute dtype."""
    return out[:, :, :time, :dv].transpose(0, 2, 1, 3).astype(compute)


# -------------------------------------------------------------------------------------------------
# Plain-XLA references.

def gated_delta_chunked_reference(q, k, v, g, beta, *, valid, initial_state, state_chunk,
                                  contract: NumericalContract) -> GatedDeltaOut:
    """The canonical chunk formula in plain XLA (the `xla` backend): same API and semantics as
    gated_delta_rule, vectorised over batch and heads, chunks in a lax.scan. Differentiable by
    jax.grad w.r.t. q, k, v, g, beta and initial_state; NOT batch-invariant."""
    _check_inputs(q, k, v, g, beta, valid, initial_state, state_chunk)
    batch, time, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    chunk = contract.delta_chunk
    qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, valid, contract)
    num_chunks = qp.shape[2] // chunk

    def chunks(x):                       # [B, H, Tp, d] -> [N, B, H, C, d]
        return jnp.moveaxis(x.reshape(*x.shape[:2], num_chunks, chunk, x.shape[-1]), 2, 0)

    wanted = state_chunk.astype(jnp.int32)[:, None, None, None]

    def step(carry, xs):
        state, saved = carry
        index, qc, kc, vc, gc, bc = xs
        saved = jnp.where(index == wanted, state, saved)
        out, state = _chunk(qc, kc, vc, gc, bc, state, scale=dk ** -0.5, group=hv // hk)
        return (state, saved), out

    s0 = initial_state.astype(_F32)
    (state, saved), out = jax.lax.scan(
        step, (s0, s0), (jnp.arange(num_chunks), *map(chunks, (qp, kp, vp, gp, bp))))
    out = jnp.moveaxis(out, 0, 2).reshape(batch, hv, num_chunks * chunk, dv)
    return GatedDeltaOut(_finish_out(out, time, dv, contract.compute),
                         jnp.where(wanted == num_chunks, state, saved))


def gated_delta_recurrent_reference(q, k, v, g, beta, *, valid, initial_state, state_chunk,
                                    contract: NumericalContract) -> GatedDeltaOut:
    """The per-token recurrence, step for step as transformers' torch_recurrent_gated_delta_rule
    (use_qk_l2norm_in_kernel=True), in a lax.scan over tokens. Same API: the returned state is
    the state after state_chunk[b] * C tokens (C = contract.delta_chunk; T is padded up to a
    multiple of C with invalid rows); invalid rows are identity tokens with output 0."""
    _check_inputs(q, k, v, g, beta, valid, initial_state, state_chunk)
    time, hk, dk = q.shape[1:]
    hv, dv = v.shape[2], v.shape[3]
    qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, valid, contract)
    qp = _l2_normalize(qp) / dk ** 0.5
    kp = _l2_normalize(kp)
    qp, kp = (jnp.repeat(x, hv // hk, axis=1) for x in (qp, kp))
    wanted = (state_chunk.astype(jnp.int32) * contract.delta_chunk)[:, None, None, None]

    def step(carry, xs):
        state, saved = carry
        t, q_t, k_t, v_t, g_t, beta_t = xs     # [B, H, d] / [B, H, 1]
        saved = jnp.where(t == wanted, state, saved)
        state = state * jnp.exp(g_t)[..., None]
        kv_mem = jnp.sum(state * k_t[..., None], axis=-2)
        delta = (v_t - kv_mem) * beta_t
        state = state + k_t[..., None] * delta[..., None, :]
        return (state, saved), jnp.sum(state * q_t[..., None], axis=-2)

    s0 = initial_state.astype(_F32)
    padded = qp.shape[2]
    (state, saved), out = jax.lax.scan(
        step, (s0, s0),
        (jnp.arange(padded), *(jnp.moveaxis(x, 2, 0) for x in (qp, kp, vp, gp, bp))))
    return GatedDeltaOut(_finish_out(jnp.moveaxis(out, 0, 2), time, dv, contract.compute),
                         jnp.where(wanted == padded, state, saved))


# -------------------------------------------------------------------------------------------------
# The kernel.

def _gated_delta_kernel(ids, bounds_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s0_ref, out_ref,
                        state_ref, *, chunk: int, scale: float, group: int, time_major: bool):
    """One batch row (emulated grid: all heads, time-major refs [Tp, H, d] and [Tp, H], the
    layout the inputs come in) or one (row, value head) (natively: refs [Tp, d]). bounds_ref
    [1, 2] int32: (state_chunk, number of chunks)."""
    del ids
    wanted, num_chunks = bounds_ref[0, 0], bounds_ref[0, 1]

    def read(ref, start):
        if not time_major:
            return ref[(slice(None),) * (ref.ndim - 2) + (pl.ds(start, chunk), slice(None))]
        block = ref[pl.ds(start, chunk)]                  # [C, H, d] or [C, H]
        # Heads first for the chunk formula ([H, C, d]; gates [H, C, 1]).
        return jnp.swapaxes(block, 0, 1) if block.ndim == 3 else block.T[..., None]

    def step(c, carry):
        state, saved = carry
        saved = jnp.where(c == wanted, state, saved)
        start = pl.multiple_of(c * chunk, chunk)
        out, state = _chunk(read(q_ref, start), read(k_ref, start), read(v_ref, start),
                            read(g_ref, start), read(beta_ref, start), state, scale=scale,
                            group=group)
        if time_major:
            out_ref[pl.ds(start, chunk)] = jnp.swapaxes(out, 0, 1).astype(out_ref.dtype)
        else:
            out_ref[(slice(None),) * (out_ref.ndim - 2) + (pl.ds(start, chunk), slice(None))] = \
                out.astype(out_ref.dtype)
        return state, saved

    s0 = s0_ref[...]
    state, saved = jax.lax.fori_loop(0, num_chunks, step, (s0, s0))
    state_ref[...] = jnp.where(wanted == num_chunks, state, saved)


@functools.partial(jax.jit, static_argnums=(8,))
def _gated_delta_forward(q, k, v, g, beta, valid, initial_state, state_chunk, contract):
    batch, time, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    run = _grid.execution(contract)
    chunk = contract.delta_chunk
    # Zero features (GPU: Triton wants powers of two >= 16) change no norm, dot or state entry.
    dk_p, dv_p = contract.kernel_dot_dim(dk), contract.kernel_dot_dim(dv)
    s0 = _grid.pad_axis(_grid.pad_axis(initial_state.astype(_F32), 2, dk_p), 3, dv_p)
    if run.emulate_grid:
        # The inputs stay time-major, as they come: a transposed operand could get another
        # physical layout from XLA in one program than in another, and the loop over its chunks
        # then vectorises (and rounds exp, rsqrt and the dots) differently.
        qp, kp, vp, gp, bp = _prepare_time_major(q, k, v, g, beta, valid, contract)
    else:
        qp, kp, vp, gp, bp = _prepare(q, k, v, g, beta, valid, contract)
        qp, kp = (_grid.pad_axis(x, 3, dk_p) for x in (qp, kp))
        vp = _grid.pad_axis(vp, 3, dv_p)
    # One more chunk of invalid rows, never run: with a window of exactly one chunk the
    # per-chunk dynamic slices would cover the whole operand, and XLA simplifies such a slice
    # away, compiling the chunk formula differently (other bits) than for longer sequences.
    time_axis = 1 if run.emulate_grid else 2
    num_chunks = qp.shape[time_axis] // chunk
    qp, kp, vp, gp, bp = (_grid.pad_axis(x, time_axis, (num_chunks + 1) * chunk)
                          for x in (qp, kp, vp, gp, bp))
    padded = qp.shape[time_axis]
    # The trip count is data behind a barrier: no compiler specialises a one-chunk decode window.
    bounds = jnp.stack([state_chunk.astype(jnp.int32),
                        jnp.full((batch,), num_chunks, jnp.int32)], axis=1)[:, None]
    bounds = jax.lax.optimization_barrier(bounds)                              # [B, 1, 2]
    if run.emulate_grid:
        # Value heads per step: all by default; a fixed count keeps a step's dot shapes when the
        # layer's head count changes (a tensor-parallel device holds 1 / T of them). A step's
        # value heads read key heads (h // ratio) that are whole key heads of their own.
        ratio = hv // hk
        heads = contract.emulated_heads or hv
        if hv % heads or (heads % ratio and ratio % heads):
            raise ValueError(f"NumericalContract.emulated_heads={heads}: must divide the "
                             f"layer's {hv} Gated DeltaNet value heads and divide or be a "
                             f"multiple of its {ratio} value heads per key head (0: all)")
        key_heads, group = max(1, heads // ratio), min(heads, ratio)
        if heads == hv:
            grid = (batch,)

            def ids(index_map):         # (b,) -> index_map(b, 0)
                return lambda b: index_map(b, 0)
        else:
            grid = (batch, hv // heads)

            def ids(index_map):
                return index_map

        def head_block(x, width, key=False):     # a row's [Tp, width, ...] block of head block h
            def index(b, h, n=x.ndim):
                block = h * heads // ratio // key_heads if key else h
                return (b, 0, block) + (0,) * (n - 3)
            return _grid.Tile((None, x.shape[1], width) + x.shape[3:], ids(index))

        in_tiles = [_grid.Tile((None, 1, 2), ids(lambda b, h: (b, 0, 0)), scalars=True),
                    head_block(qp, key_heads, True), head_block(kp, key_heads, True),
                    head_block(vp, heads), head_block(gp, heads), head_block(bp, heads),
                    _grid.Tile((None, heads, dk_p, dv_p), ids(lambda b, h: (b, h, 0, 0)))]
        out_tiles = [_grid.Tile((None, padded, heads, dv_p), ids(lambda b, h: (b, 0, h, 0))),
                     in_tiles[-1]]
        out_shape = [jax.ShapeDtypeStruct((batch, padded, hv, dv_p), contract.compute),
                     jax.ShapeDtypeStruct((batch, hv, dk_p, dv_p), _F32)]
    else:
        grid, group = (batch, hv), 1

        def tile(heads, rows, cols):
            return _grid.Tile((None, None, rows, cols), lambda b, h: (b, h, 0, 0))

        # lax.div (truncating, ids are >= 0): Mosaic cannot lower floor_divide's sign fix-up.
        key_tile = _grid.Tile((None, None, padded, dk_p),
                              lambda b, h: (b, jax.lax.div(h, hv // hk), 0, 0))
        bounds_tile = _grid.Tile((None, 1, 2), lambda b, h: (b, 0, 0), scalars=True)
        value_tile, gate_tile, state_tile = (tile(hv, padded, dv_p), tile(hv, padded, 1),
                                             tile(hv, dk_p, dv_p))
        in_tiles = [bounds_tile, key_tile, key_tile, value_tile, gate_tile, gate_tile,
                    state_tile]
        out_tiles = [value_tile, state_tile]
        out_shape = [jax.ShapeDtypeStruct((batch, hv, padded, dv_p), contract.compute),
                     jax.ShapeDtypeStruct((batch, hv, dk_p, dv_p), _F32)]
    kernel = functools.partial(_gated_delta_kernel, chunk=chunk, scale=dk ** -0.5, group=group,
                               time_major=run.emulate_grid)
    call = _grid.launch(kernel, grid=grid, in_tiles=in_tiles, out_tiles=out_tiles,
                        out_shape=out_shape, contract=contract, name="jrl_gated_delta")
    out, state = call(bounds, qp, kp, vp, gp, bp, s0)
    if run.emulate_grid:
        out = out[:, :time, :, :dv].astype(contract.compute)
    else:
        out = _finish_out(out, time, dv, contract.compute)
    return GatedDeltaOut(out, state[:, :, :dk, :dv])


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _gated_delta(q, k, v, g, beta, valid, initial_state, state_chunk, contract):
    return _gated_delta_forward(q, k, v, g, beta, valid, initial_state, state_chunk, contract)


def _gated_delta_fwd(q, k, v, g, beta, valid, initial_state, state_chunk, contract):
    result = _gated_delta_forward(q, k, v, g, beta, valid, initial_state, state_chunk, contract)
    return result, (q, k, v, g, beta, valid, initial_state, state_chunk)


def _gated_delta_bwd(contract, residuals, cotangents):
    q, k, v, g, beta, valid, initial_state, state_chunk = residuals

    def ref(q, k, v, g, beta, initial_state):
        return tuple(gated_delta_chunked_reference(
            q, k, v, g, beta, valid=valid, initial_state=initial_state, state_chunk=state_chunk,
            contract=contract))

    _, vjp = jax.vjp(ref, q, k, v, g, beta, initial_state)
    dq, dk, dv, dg, dbeta, dstate = vjp(tuple(cotangents))
    return dq, dk, dv, dg, dbeta, None, dstate, None


_gated_delta.defvjp(_gated_delta_fwd, _gated_delta_bwd)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     valid: jax.Array, initial_state: jax.Array, state_chunk: jax.Array,
                     contract: NumericalContract) -> GatedDeltaOut:
    """Gated delta rule over chunks of C = contract.delta_chunk rows aligned at row 0 (module
    docstring), batch- and stage-invariant (Pallas).

    q, k [B, T, Hk, dk] raw (L2-normalised here in float32, q also scaled by dk^-1/2);
    v [B, T, Hv, dv], Hv a multiple of Hk (value head h reads key head h // (Hv // Hk));
    q, k, v are cast to contract.compute, then computed in float32. g [B, T, Hv] log decay
    (<= 0), beta [B, T, Hv], both float32. valid [B, T] bool: invalid rows are identity tokens
    (their q, k, v, g, beta are replaced by 0: state unchanged, output exactly 0; they may hold
    any values, even inf/NaN). initial_state [B, Hv, dk, dv] float32: the state before row 0,
    which is a chunk start. state_chunk [B] int in [0, ceil(T / C)]: `state` is the state at the
    start of chunk state_chunk[b] (after rows 0 .. state_chunk * C - 1); ceil(T / C) gives the
    final state. T need not be a multiple of C: the rows are padded up to one with invalid rows.
    Returns GatedDeltaOut(out [B, T, Hv, dv] in contract.compute, state [B, Hv, dk, dv] float32).

    How the stages call it (the outputs are bit-identical between them):
    - train forward: initial_state 0, valid = the attention mask, any state_chunk.
    - prefill of a right-padded prompt of length L: initial_state 0, valid = t < L,
      state_chunk = L // C; the cache keeps `state` and the raw inputs (q, k, v, g, beta) of rows
      (L // C) * C .. L - 1, the current partial chunk.
    - decode of position n (chunk c = n // C, offset i = n % C): a window of exactly C rows: the
      cached rows 0..i-1 of chunk c, the new token at row i, anything after; valid = row <= i;
      initial_state = the cached state at the start of chunk c; state_chunk = 1 if i == C - 1
      else 0. Row i of out equals row n of the train forward, and when i == C - 1 `state` equals
      the train forward's state at the start of chunk c + 1 (else it is initial_state: the cache
      keeps the chunk-start state and appends the token's inputs to its buffer).
    - append (multi-turn, chunked prefill) continuing a cached slot: the same with a window of
      several chunks starting at the current chunk's start.

    Differentiable w.r.t. q, k, v, g, beta and initial_state (custom_vjp: the backward is the
    vjp of gated_delta_chunked_reference, plain XLA, not batch-invariant).
    """
    _check_inputs(q, k, v, g, beta, valid, initial_state, state_chunk)
    return _gated_delta(q, k, v, g, beta, valid, initial_state, state_chunk, contract)

"""Batch-invariant matmul: fixed (block_m, block_n) output tiles, K reduced in fixed block_k tiles.

Every output tile is computed by the same code: a loop over K tiles in increasing order, each a
[block_m, block_k] x [block_k, block_n] dot accumulated in float32. No split-K, no shape-dependent
strategy: a row's bits do not depend on how many rows share the call or where it sits.

On a CPU (the emulated grid) a block_n or block_k at least as large as the operand means the
whole operand: with the default contract each 16-row tile is one [16, K] x [K, N] library dot
(multi-threaded, cache-blocked by XLA's CPU runtime), N tiles outermost so a weight tile stays
in cache across row tiles. The clipped tile sizes depend on K and N only, never on M.

Two exceptions, for speed and only where they change no bit (`row_tile`): a CPU call with
fewer rows than block_m (a decode step of a few slots) runs a narrower power-of-two tile, and
a call with many rows (prefill, the train forward and backward; see _matmul_bwd) a wider
one, when this machine's library gives that tile's rows the bits of block_m-row tiles,
checked once per shape by running both. Where they differ, the call uses block_m as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract


def _matmul_kernel(ids, x_ref, w_ref, o_ref, *, block_k: int, num_k: int, k_rem: int,
                   w_transposed: bool = False):
    """x_ref [block_m, K], w_ref [K, block_n] (or [block_n, K] if w_transposed) -> o_ref
    [block_m, block_n]. K = num_k * block_k + k_rem; the k_rem-wide last tile exists only in
    the emulated grid."""
    del ids
    contracting = (((1,), (1,)), ((), ())) if w_transposed else (((1,), (0,)), ((), ()))

    def k_tile(acc, start, width):
        xs = x_ref[:, pl.ds(start, width)]
        ws = w_ref[:, pl.ds(start, width)] if w_transposed else w_ref[pl.ds(start, width), :]
        return acc + jax.lax.dot_general(xs, ws, contracting,
                                         preferred_element_type=jnp.float32,
                                         precision=_grid.dot_precision(xs.dtype))

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    if num_k:
        acc = jax.lax.fori_loop(
            0, num_k, lambda k, acc: k_tile(acc, pl.multiple_of(k * block_k, block_k), block_k),
            acc)
    if k_rem:
        acc = k_tile(acc, num_k * block_k, k_rem)
    o_ref[...] = acc.astype(o_ref.dtype)


# The narrowest tile a call with fewer rows may run (a one-row dot is a matrix-vector product,
# which the CPU library computes in another order).
MIN_NARROW_TILE = 4
# The widest tile a call with many rows may run: at SmolLM2's dims 256-row dots were the
# fastest of 32-1024 (1024 rows, K = 1536, N = 576: 11.6 ms on 32-row tiles, 8.4 ms on 256).
MAX_WIDE_TILE = 256


def row_tile(contract: NumericalContract, m: int, k: int, n: int, w_transposed: bool) -> int:
    """Rows per tile of an emulated (CPU) call with m rows: matmul_block_m, or, when m is
    smaller, the narrowest power-of-two tile t >= max(m, MIN_NARROW_TILE), t < matmul_block_m,
    whose dot gives every row the bits of a matmul_block_m tile on this machine; when m is
    larger, the widest power-of-two tile t <= min(m, MAX_WIDE_TILE), t > matmul_block_m, that
    pads m to no more rows than matmul_block_m does and gives the bits of matmul_block_m-row
    tiles (`wide_tile_agrees`).

    A decode call has as many rows as the sampler has slots; padding it to a full tile pays for
    the padding rows' products (SmolLM2 dims, 8 slots: the decode program at 0.85x of XLA's
    speed on 16-row tiles, 0.96x on 8-row tiles). Whether a narrower dot rounds the same is a property of the
    CPU library, not of jrl, so it is not assumed: `narrow_tile_agrees` runs both tiles once
    per shape on this machine and the call keeps the full tile where they differ (they do: with
    K = 300, N = 260 a 4-row tile rounds differently from a 32-row one, 8 and 16 rows do not).
    """
    bm = contract.matmul_block_m
    if m > bm:
        # Fewer, larger library dots: one packing of the weights per tile, not per 32 rows
        # (1024 rows at K = 576, N = 49152, transposed: 380 ms on 32-row tiles, 296 ms on 256).
        # Only tiles that pad no more rows than block_m tiles do (300 rows: 64, not 256).
        tile = 1 << (min(m, MAX_WIDE_TILE).bit_length() - 1)
        while tile > bm:
            if (tile % bm == 0 and (-m) % tile == (-m) % bm
                    and wide_tile_agrees(contract, tile, k, n, w_transposed)):
                return tile
            tile //= 2
        return bm
    tile = max(MIN_NARROW_TILE, 1 << max(0, m - 1).bit_length())
    while tile < bm:
        if narrow_tile_agrees(contract, tile, k, n, w_transposed):
            return tile
        tile *= 2
    return bm


@functools.lru_cache(maxsize=None)
def narrow_tile_agrees(contract: NumericalContract, tile: int, k: int, n: int,
                       w_transposed: bool) -> bool:
    """Whether this machine's emulated kernel gives a [tile, K] x [K, N] call the bits of the
    first `tile` rows of a [matmul_block_m, K] x [K, N] call (float32 operands: bfloat16 ones
    are widened before the dot). Random operands: a different summation order shows in some of
    the tile * N outputs. Runs both calls once, eagerly, on the CPU, even while a program is
    being traced."""
    full = _probe(contract, k, n, w_transposed)[:tile]
    narrow = _probe(contract.replace(matmul_block_m=tile), k, n, w_transposed)
    return bool(np.array_equal(full, narrow))


@functools.lru_cache(maxsize=None)
def wide_tile_agrees(contract: NumericalContract, tile: int, k: int, n: int,
                     w_transposed: bool) -> bool:
    """Whether this machine's emulated kernel gives a [tile, K] x [K, N] call on one tile-row
    tile the bits of the same rows on matmul_block_m-row tiles (tile a multiple of it). Random
    operands, run once per shape, eagerly on the CPU, as narrow_tile_agrees."""
    bm = contract.matmul_block_m
    rng = np.random.default_rng(2)
    x = rng.standard_normal((tile, k), np.float32)
    w = rng.standard_normal((n, k) if w_transposed else (k, n), np.float32)
    wide = _run_once(contract.replace(matmul_block_m=tile), x, w, w_transposed)
    # block_m rows per call: row_tile keeps block_m for them, so nothing recurses.
    tiles = [_run_once(contract, x[i:i + bm], w, w_transposed) for i in range(0, tile, bm)]
    return bool(np.array_equal(wide, np.concatenate(tiles)))


def _run_once(contract: NumericalContract, x: np.ndarray, w: np.ndarray,
              w_transposed: bool) -> np.ndarray:
    """matmul_2d(x, w) -> float32, lowered, compiled and called directly on the CPU (so it also
    runs while a program is traced)."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        compiled = matmul_2d.lower(x, w, contract=contract, out_dtype=jnp.float32,
                                   w_transposed=w_transposed).compile()
        return np.asarray(compiled(x, w))


@functools.lru_cache(maxsize=None)
def _probe(contract: NumericalContract, k: int, n: int, w_transposed: bool) -> np.ndarray:
    """One tile (matmul_block_m rows) of fixed random operands through the emulated kernel:
    [block_m, N] float32."""
    w = np.random.default_rng(0).standard_normal((n, k) if w_transposed else (k, n), np.float32)
    # Drawn row by row: a narrower tile's rows are the first rows of a wider tile's.
    x = np.random.default_rng(1).standard_normal((contract.matmul_block_m, k), np.float32)
    return _run_once(contract, x, w, w_transposed)


@functools.partial(jax.jit, static_argnames=("contract", "out_dtype", "w_transposed"))
def matmul_2d(x: jax.Array, w: jax.Array, *, contract: NumericalContract, out_dtype,
              w_transposed: bool = False) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype; operands used in the dtype they come in.
    w_transposed: w is given as [N, K] and y = x @ w.T."""
    emulated = _grid.execution(contract).emulate_grid
    if w_transposed and not emulated:
        w, w_transposed = w.T, False
    m, k = x.shape
    n, wk = (w.shape[0], w.shape[1]) if w_transposed else (w.shape[1], w.shape[0])
    if wk != k:
        raise ValueError(f"matmul: x [..., {k}] and w {tuple(w.shape)} disagree on K")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = contract.matmul_block_m, contract.matmul_block_n, contract.matmul_block_k
    if x.dtype != w.dtype:
        raise ValueError(f"matmul: operands {x.dtype} and {w.dtype} must share a dtype")
    if x.dtype == jnp.bfloat16 and emulated:
        # Each operand tile is read many times (x once per N tile, w once per M tile): widen the
        # operands once here instead of per read (exact; see _grid on bfloat16 in interpret).
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    if emulated:
        bm = row_tile(contract, m, k, n, w_transposed)
    xp = _grid.pad_axis(x, 0, bm)
    mp = xp.shape[0]
    if emulated:
        # On a CPU a tile wider than the operand is the whole operand: one [block_m, K] x [K, N]
        # dot per row tile runs as one multi-threaded library call, which is what makes the
        # interpreted kernel fast. The clipped sizes depend on K and N only, never on M.
        bn, bk = min(bn, n), min(bk, k)
        # Weights are not padded (a padded copy of every weight per call dominated decode):
        # K ends with a narrower static tile, and the last N tile is shifted left to end at N
        # (its overlap with the previous tile is recomputed). Tile shapes and column offsets
        # depend on K and N only, so a row's bits still do not depend on M.
        num_k, k_rem = divmod(k, bk)
        wp, np_ = w, n
        num_n = -(-n // bn)
        # N tiles outermost: one weight tile stays in cache while every row tile uses it.
        grid = (num_n, mp // bm)
        x_tile = _grid.Tile((bm, k), lambda j, i: (i, 0))
        # A transposed w ([N, K], a tied embedding) is read as it is stored: a transposed copy
        # could be folded into the dot by XLA in one program and not in another, and the two
        # dots round differently.
        w_tile = (_grid.Tile((bn, k), lambda j, i: (jnp.minimum(j * bn, n - bn), 0),
                             element_offsets=True) if w_transposed else
                  _grid.Tile((k, bn), lambda j, i: (0, jnp.minimum(j * bn, n - bn)),
                             element_offsets=True))
        out_tile = _grid.Tile((bm, bn), lambda j, i: (i * bm, jnp.minimum(j * bn, n - bn)),
                              element_offsets=True)
    else:
        xp = _grid.pad_axis(xp, 1, bk)
        wp = _grid.pad_axis(_grid.pad_axis(w, 0, bk), 1, bn)
        k, np_ = xp.shape[1], wp.shape[1]
        num_k, k_rem, num_n = k // bk, 0, np_ // bn
        grid = (mp // bm, num_n)
        x_tile = _grid.Tile((bm, k), lambda i, j: (i, 0))
        w_tile = _grid.Tile((k, bn), lambda i, j: (0, j))
        out_tile = _grid.Tile((bm, bn), lambda i, j: (i, j))
    kernel = functools.partial(_matmul_kernel, block_k=bk, num_k=num_k, k_rem=k_rem,
                               w_transposed=w_transposed)
    call = _grid.launch(
        kernel, grid=grid,
        in_tiles=[x_tile, w_tile],
        out_tiles=[out_tile],
        out_shape=[jax.ShapeDtypeStruct((mp, np_), out_dtype)],
        contract=contract, name="jrl_matmul")
    (y,) = call(xp, wp)
    return y[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul(x, w, contract, w_transposed):
    return _matmul_fwd(x, w, contract, w_transposed)[0]


def _matmul_fwd(x, w, contract, w_transposed):
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    y = matmul_2d(x2, w.astype(compute), contract=contract, out_dtype=compute,
                  w_transposed=w_transposed)
    return y.reshape(*x.shape[:-1], y.shape[-1]), (x, w)


def _matmul_bwd(contract, w_transposed, residuals, dy):
    # dx = dy @ w^T and dw = x^T @ dy through the same kernel, float32 out, cast to input dtypes
    # (with w_transposed, w is [N, K]: dx = dy @ w and dw = dy^T @ x).
    x, w = residuals
    compute = contract.compute
    # The transposes are materialised behind an optimization barrier, so XLA cannot fold them
    # into the library dot: the dots then see plain operands, as row_tile's probe does, and a
    # wide tile gives the bits of 32-row tiles here too. (Folded, a wide tile rounded
    # differently although the probe agreed: a 2-layer model's weight gradients changed bits.)
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(compute)
    wc = w.astype(compute)
    if w_transposed:
        dy2_t = jax.lax.optimization_barrier(dy2.T)
        dx = matmul_2d(dy2, wc, contract=contract, out_dtype=jnp.float32)
        dw = matmul_2d(dy2_t, x2, contract=contract, out_dtype=jnp.float32)
    else:
        wc_t, x2_t = jax.lax.optimization_barrier((wc.T, x2.T))
        dx = matmul_2d(dy2, wc_t, contract=contract, out_dtype=jnp.float32)
        dw = matmul_2d(x2_t, dy2, contract=contract, out_dtype=jnp.float32)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array, *, contract: NumericalContract,
           transpose_w: bool = False) -> jax.Array:
    """y = x @ w, batch-invariant. x [..., K], w [K, N] -> [..., N] in contract.compute dtype.

    transpose_w: w is given as [N, K] and y = x @ w.T (a tied embedding used as the output
    layer, read in place). Operands are cast to the compute dtype; accumulation is float32.
    Differentiable (custom_vjp: the backward runs this kernel on transposed operands).
    """
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"matmul: expected x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    return _matmul(x, w, contract, bool(transpose_w))

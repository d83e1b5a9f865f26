"""Batch-invariant matmul: fixed (block_m, block_n) output tiles, K reduced in fixed block_k tiles.

Every output tile is computed by the same code: a loop over K tiles in increasing order, each a
[block_m, block_k] x [block_k, block_n] dot accumulated in float32. No split-K, no shape-dependent
strategy: a row's bits do not depend on how many rows share the call or where it sits.

On a CPU (the emulated grid) a block_n or block_k at least as large as the operand means the
whole operand: with the default contract each 16-row tile is one [16, K] x [K, N] library dot
(multi-threaded, cache-blocked by XLA's CPU runtime), N tiles outermost so a weight tile stays
in cache across row tiles. The clipped tile sizes depend on K and N only, never on M.

A call may run other row counts per tile only where the contract says so
(NumericalContract.matmul_row_tiles, used on the CPU only): a decode step of a few slots a
narrower power-of-two tile, and a call of many rows (prefill, the train forward and backward;
see _matmul_bwd) a wider one. Whether such a tile gives its rows the bits of block_m-row tiles
depends on the CPU's math library, so `calibrate_row_tiles` measures it once per shape by
running both (the `jrl calibrate-tiles` command); nothing is probed while a program is traced.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jrl.kernels import _grid
from jrl.kernels.contract import MAX_ROW_TILE, MIN_ROW_TILE, NumericalContract


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


def row_tile(contract: NumericalContract, m: int, k: int, n: int, w_transposed: bool) -> int:
    """Rows per tile of an emulated (CPU) call with m rows, from the tiles the contract allows
    this shape (NumericalContract.row_tiles): when m < matmul_block_m, the narrowest allowed
    tile t >= m below block_m; when m > block_m, the widest allowed tile t <= m that pads m to
    no more rows than block_m tiles do (300 rows: 64, not 256); else, or where none is allowed,
    matmul_block_m.

    A decode call has as many rows as the sampler has slots; padding it to a full tile pays for
    the padding rows' products (SmolLM2 dims, 8 slots: the decode program at 0.85x of XLA's
    speed on 16-row tiles, 0.96x on 8-row tiles). Fewer, larger library dots pack the weights
    once per tile, not per block_m rows (1024 rows at K = 576, N = 49152, transposed: 380 ms on
    32-row tiles, 296 ms on 256).
    """
    bm = contract.matmul_block_m
    allowed = contract.row_tiles(k, n, w_transposed)
    if m > bm:
        wide = [t for t in allowed if bm < t <= m and (-m) % t == (-m) % bm]
        return max(wide, default=bm)
    narrow = [t for t in allowed if m <= t < bm]
    return min(narrow, default=bm)


# (K, N, w_transposed) of the emulated calls traced while recording_shapes is active.
_recorders: list[set] = []


@contextlib.contextmanager
def recording_shapes() -> Iterator[set[tuple[int, int, bool]]]:
    """Collects (K, N, w_transposed) of every emulated matmul traced inside the block. JAX's
    caches are cleared first: a program traced before would not be traced again."""
    jax.clear_caches()
    shapes: set[tuple[int, int, bool]] = set()
    _recorders.append(shapes)
    try:
        yield shapes
    finally:
        _recorders.remove(shapes)


def calibrate_row_tiles(contract: NumericalContract,
                        shapes: Iterable[tuple[int, int, bool]]) -> tuple[tuple[int, ...], ...]:
    """A matmul_row_tiles table measured on this machine: for each (K, N, w_transposed), every
    power-of-two tile in [MIN_ROW_TILE, MAX_ROW_TILE] that gives its rows the bits of
    matmul_block_m-row tiles (narrow_tile_agrees, wide_tile_agrees). Shapes where none does
    are left out. Runs two small programs per candidate tile and shape."""
    bm = contract.matmul_block_m
    base = contract.replace(matmul_row_tiles=())
    narrow = [t for t in _powers_of_two(MIN_ROW_TILE, MAX_ROW_TILE) if t < bm]
    wide = [t for t in _powers_of_two(MIN_ROW_TILE, MAX_ROW_TILE) if t > bm and t % bm == 0]
    table = []
    for k, n, transposed in sorted({(k, n, bool(t)) for k, n, t in shapes}):
        tiles = ([t for t in narrow if narrow_tile_agrees(base, t, k, n, transposed)]
                 + [t for t in wide if wide_tile_agrees(base, t, k, n, transposed)])
        if tiles:
            table.append((k, n, int(transposed), *tiles))
    return tuple(table)


def check_row_tiles(contract: NumericalContract) -> list[str]:
    """The entries of contract.matmul_row_tiles this machine rounds differently from
    matmul_block_m rows, one line each (empty: the table holds here)."""
    base = contract.replace(matmul_row_tiles=())
    wrong = []
    for k, n, transposed, *tiles in contract.matmul_row_tiles:
        for tile in tiles:
            agrees = narrow_tile_agrees if tile < base.matmul_block_m else wide_tile_agrees
            if not agrees(base, tile, k, n, bool(transposed)):
                wrong.append(f"K={k}, N={n}, w_transposed={transposed}: a {tile}-row tile "
                             f"rounds differently from {base.matmul_block_m}-row tiles here")
    return wrong


def _powers_of_two(low: int, high: int) -> list[int]:
    return [1 << e for e in range(low.bit_length() - 1, high.bit_length()) if low <= 1 << e <= high]


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
    # block_m rows per call, on a contract without a row-tile table.
    tiles = [_run_once(contract, x[i:i + bm], w, w_transposed) for i in range(0, tile, bm)]
    return bool(np.array_equal(wide, np.concatenate(tiles)))


def _run_once(contract: NumericalContract, x: np.ndarray, w: np.ndarray,
              w_transposed: bool) -> np.ndarray:
    """matmul_2d(x, w) -> float32, run on the CPU."""
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return np.asarray(matmul_2d(x, w, contract=contract, out_dtype=jnp.float32,
                                    w_transposed=w_transposed))


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
        for shapes in _recorders:
            shapes.add((k, n, w_transposed))
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
    # into the library dot: the dots then see plain operands, as calibrate_row_tiles' probes do, and a
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

"""Batch-invariant matmul: fixed (block_m, block_n) output tiles, K reduced in fixed block_k tiles.

Every output tile is computed by the same code: a loop over K tiles in increasing order, each a
[block_m, block_k] x [block_k, block_n] dot accumulated in float32. No split-K, no shape-dependent
strategy: a row's bits do not depend on how many rows share the call or where it sits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract


def _matmul_kernel(ids, x_ref, w_ref, o_ref, *, block_k: int, num_k: int, k_rem: int):
    """x_ref [block_m, K], w_ref [K, block_n] -> o_ref [block_m, block_n].
    K = num_k * block_k + k_rem; the k_rem-wide last tile exists only in the emulated grid."""
    del ids

    def k_step(k, acc):
        start = pl.multiple_of(k * block_k, block_k)
        xs = x_ref[:, pl.ds(start, block_k)]
        ws = w_ref[pl.ds(start, block_k), :]
        return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32,
                             precision=_grid.dot_precision(xs.dtype))

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    if num_k:
        acc = jax.lax.fori_loop(0, num_k, k_step, acc)
    if k_rem:
        start = num_k * block_k
        xs, ws = x_ref[:, pl.ds(start, k_rem)], w_ref[pl.ds(start, k_rem), :]
        acc = acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32,
                            precision=_grid.dot_precision(xs.dtype))
    o_ref[...] = acc.astype(o_ref.dtype)


def matmul_2d(x: jax.Array, w: jax.Array, *, contract: NumericalContract,
              out_dtype) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] in out_dtype; operands used in the dtype they come in."""
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k:
        raise ValueError(f"matmul: x [..., {k}] and w {tuple(w.shape)} disagree on K")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    bm, bn, bk = contract.matmul_block_m, contract.matmul_block_n, contract.matmul_block_k
    if x.dtype != w.dtype:
        raise ValueError(f"matmul: operands {x.dtype} and {w.dtype} must share a dtype")
    if x.dtype == jnp.bfloat16 and _grid.execution(contract).emulate_grid:
        # Each operand tile is read many times (x once per N tile, w once per M tile): widen the
        # operands once here instead of per read (exact; see _grid on bfloat16 in interpret).
        x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    xp = _grid.pad_axis(x, 0, bm)
    mp = xp.shape[0]
    if _grid.execution(contract).emulate_grid and n >= bn:
        # Weights are not padded (a padded copy of every weight per call dominated decode):
        # K ends with a narrower static tile, and the last N tile is shifted left to end at N
        # (its overlap with the previous tile is recomputed). Tile shapes and column offsets
        # depend on K and N only, so a row's bits still do not depend on M.
        num_k, k_rem = divmod(k, bk)
        wp, np_ = w, n
        num_n = -(-n // bn)
        w_tile = _grid.Tile((k, bn), lambda i, j: (0, jnp.minimum(j * bn, n - bn)),
                            element_offsets=True)
        out_tile = _grid.Tile((bm, bn), lambda i, j: (i * bm, jnp.minimum(j * bn, n - bn)),
                              element_offsets=True)
    else:
        xp = _grid.pad_axis(xp, 1, bk)
        wp = _grid.pad_axis(_grid.pad_axis(w, 0, bk), 1, bn)
        k, np_ = xp.shape[1], wp.shape[1]
        num_k, k_rem, num_n = k // bk, 0, np_ // bn
        w_tile = _grid.Tile((k, bn), lambda i, j: (0, j))
        out_tile = _grid.Tile((bm, bn), lambda i, j: (i, j))
    kernel = functools.partial(_matmul_kernel, block_k=bk, num_k=num_k, k_rem=k_rem)
    call = _grid.launch(
        kernel, grid=(mp // bm, num_n),
        in_tiles=[_grid.Tile((bm, k), lambda i, j: (i, 0)), w_tile],
        out_tiles=[out_tile],
        out_shape=[jax.ShapeDtypeStruct((mp, np_), out_dtype)],
        contract=contract, name="jrl_matmul")
    (y,) = call(xp, wp)
    return y[:m, :n]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x, w, contract):
    return _matmul_fwd(x, w, contract)[0]


def _matmul_fwd(x, w, contract):
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    y = matmul_2d(x2, w.astype(compute), contract=contract, out_dtype=compute)
    return y.reshape(*x.shape[:-1], w.shape[1]), (x, w)


def _matmul_bwd(contract, residuals, dy):
    # dx = dy @ w^T and dw = x^T @ dy through the same kernel, float32 out, cast to input dtypes.
    x, w = residuals
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(compute)
    wc = w.astype(compute)
    dx = matmul_2d(dy2, wc.T, contract=contract, out_dtype=jnp.float32)
    dw = matmul_2d(x2.T, dy2, contract=contract, out_dtype=jnp.float32)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(w.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array, *, contract: NumericalContract) -> jax.Array:
    """y = x @ w, batch-invariant. x [..., K], w [K, N] -> [..., N] in contract.compute dtype.

    Operands are cast to the compute dtype; accumulation is float32. Differentiable (custom_vjp:
    the backward runs this kernel on transposed operands).
    """
    if x.ndim < 1 or w.ndim != 2:
        raise ValueError(f"matmul: expected x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    return _matmul(x, w, contract)

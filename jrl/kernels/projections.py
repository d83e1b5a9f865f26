"""Several projections of one input in one kernel, with the input's RMSNorm in its prologue.

    xn = x / sqrt(mean(x^2, -1) + eps) * scale       (only when a norm is given)
    y_i = xn @ W_i                                    x [M, K], W_i [K, N_i] -> y_i [M, N_i]

A decoder layer projects the same normed activations several times (q, k and v; gate and up;
Gated DeltaNet's qkv, z, a and b). On a GPU or TPU a decode step is launch-bound, so this runs
the norm and all those projections as ONE Pallas call instead of one per norm and projection:

- grid (row tile i, output tile j) over the weights' output tiles laid end to end: W_0's tiles,
  then W_1's, ...; step (i, j) multiplies row tile i by the one weight that owns column tile j
  (each weight's block index is clipped to its own tiles, so the others are not fetched again);
- the output is one [M, sum N_i (padded)] array, sliced into the y_i;
- every output tile is the matmul kernel's computation: K reduced in block_k tiles in a fixed
  order, float32 accumulation. The norm's sum of squares is reduced in the same block_k tiles
  first (fixed order), and each x tile is normed, rounded to the compute dtype and multiplied.

A row's bits depend on its own values and the contract only (never on M or its position), so the
sampler and the train step, which both call this, agree bit for bit. They are not the bits of a
separate norm kernel followed by separate matmuls (the sum of squares is reduced in another
order); nothing needs them to be.

The emulated (CPU interpret) grid runs the separate kernels instead (jrl.kernels.__init__):
there a kernel call costs no launch, and the CPU tiles and their speed stay as they are.
Differentiable: the backward recomputes the normed input with the norm kernel and runs the
matmul kernel's backward per weight (the norm's own backward goes through the reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels import _grid, reference
from jrl.kernels.contract import NumericalContract
from jrl.kernels.matmul import _matmul_bwd
from jrl.kernels.rms_norm import _rms_norm_2d

_F32 = jnp.float32


def _projections_kernel(ids, *refs, tiles: tuple[int, ...], block_k: int, num_k: int,
                        normed: bool, eps: float, dim: int, compute):
    """refs: x [block_m, Kp], (scale [1, Kp] when normed), W_0 .. W_n-1 [Kp, block_n] ->
    out [block_m, block_n]: the tile of the weight that owns column tile j."""
    _, j = ids
    x_ref = refs[0]
    scale_ref = refs[1] if normed else None
    w_refs, o_ref = refs[1 + normed:-1], refs[-1]

    def x_tile(start):
        return x_ref[:, pl.ds(start, block_k)]

    inv_rms = None
    if normed:
        def add_squares(k, total):
            xs = x_tile(pl.multiple_of(k * block_k, block_k)).astype(_F32)
            return total + jnp.sum(xs * xs, axis=1, keepdims=True)

        squares = jax.lax.fori_loop(0, num_k, add_squares,
                                    jnp.zeros((o_ref.shape[0], 1), _F32))
        inv_rms = jax.lax.rsqrt(squares / dim + eps)

    def operand(start):
        xs = x_tile(start)
        if not normed:
            return xs.astype(compute)
        scale = scale_ref[:, pl.ds(start, block_k)].astype(_F32)
        return (xs.astype(_F32) * inv_rms * scale).astype(compute)

    first = 0
    for w_ref, count in zip(w_refs, tiles):
        @pl.when((j >= first) & (j < first + count))
        def _(w_ref=w_ref):
            def k_step(k, acc):
                start = pl.multiple_of(k * block_k, block_k)
                xs = operand(start)
                ws = w_ref[pl.ds(start, block_k), :]
                return acc + jax.lax.dot_general(xs, ws, (((1,), (0,)), ((), ())),
                                                 preferred_element_type=_F32,
                                                 precision=_grid.dot_precision(xs.dtype))

            acc = jax.lax.fori_loop(0, num_k, k_step, jnp.zeros(o_ref.shape, _F32))
            o_ref[...] = acc.astype(o_ref.dtype)
        first += count


@functools.partial(jax.jit, static_argnames=("eps", "contract"))
def projections_2d(x: jax.Array, scale: jax.Array | None, weights: tuple[jax.Array, ...], *,
                   eps: float, contract: NumericalContract) -> tuple[jax.Array, ...]:
    """x [M, K] (normed in the prologue when scale [K] is given), weights [K, N_i] (compute
    dtype) -> tuple of [M, N_i] in the compute dtype. Native grids only (GPU, TPU)."""
    compute = contract.compute
    m, k = x.shape
    bm, bn, bk = contract.matmul_block_m, contract.matmul_block_n, contract.matmul_block_k
    xp = _grid.pad_axis(_grid.pad_axis(x, 0, bm), 1, bk)
    kp = xp.shape[1]
    padded = [_grid.pad_axis(_grid.pad_axis(w, 0, bk), 1, bn) for w in weights]
    tiles = tuple(w.shape[1] // bn for w in padded)
    starts = [sum(tiles[:i]) for i in range(len(tiles))]

    def weight_tile(start, count):
        return _grid.Tile((kp, bn), lambda i, j: (0, jnp.clip(j - start, 0, count - 1)))

    in_tiles = [_grid.Tile((bm, kp), lambda i, j: (i, 0))]
    operands = [xp]
    if scale is not None:
        in_tiles.append(_grid.Tile((1, kp), lambda i, j: (0, 0)))
        operands.append(_grid.pad_axis(scale.reshape(1, k), 1, bk))
    in_tiles += [weight_tile(s, c) for s, c in zip(starts, tiles)]
    kernel = functools.partial(_projections_kernel, tiles=tiles, block_k=bk, num_k=kp // bk,
                               normed=scale is not None, eps=eps, dim=k, compute=compute)
    call = _grid.launch(
        kernel, grid=(xp.shape[0] // bm, sum(tiles)), in_tiles=in_tiles,
        out_tiles=[_grid.Tile((bm, bn), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((xp.shape[0], sum(tiles) * bn), compute)],
        contract=contract, name="jrl_projections")
    (y,) = call(*operands, *padded)
    return tuple(y[:m, s * bn:s * bn + w.shape[1]] for s, w in zip(starts, weights))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _projections(x, scale, weights, eps, contract):
    return _projections_fwd(x, scale, weights, eps, contract)[0]


def _projections_fwd(x, scale, weights, eps, contract):
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1])
    # Without a norm x is a dot operand; with one, the prologue reads it in its own dtype (as
    # the norm kernel does) and rounds the normed value once.
    ys = projections_2d(x2 if scale is not None else x2.astype(compute), scale,
                        tuple(w.astype(compute) for w in weights), eps=eps, contract=contract)
    return (tuple(y.reshape(*x.shape[:-1], y.shape[-1]) for y in ys),
            (x, scale, weights))


def _projections_bwd(eps, contract, residuals, dys):
    x, scale, weights = residuals
    normed = x if scale is None else _rms_norm_2d(
        x.reshape(-1, x.shape[-1]), scale, eps, contract).reshape(x.shape)
    dnormed, dweights = jnp.zeros(x.shape, _F32), []
    for w, dy in zip(weights, dys):
        dx_w, dw = _matmul_bwd(contract, False, (normed, w), dy)
        dnormed, dweights = dnormed + dx_w.astype(_F32), dweights + [dw]
    if scale is None:
        return dnormed.astype(x.dtype), None, tuple(dweights)
    _, vjp = jax.vjp(functools.partial(reference.rms_norm, eps=eps), x, scale)
    dx, dscale = vjp(dnormed.astype(normed.dtype))
    return dx, dscale, tuple(dweights)


_projections.defvjp(_projections_fwd, _projections_bwd)


def projections(x: jax.Array, weights, *, contract: NumericalContract,
                norm: tuple[jax.Array, float] | None = None) -> tuple[jax.Array, ...]:
    """(xn @ W_0, ..., xn @ W_n-1) in one native kernel (module docstring); xn = x, or x's
    RMSNorm with norm = (scale [K], eps). x [..., K], W_i [K, N_i] -> [..., N_i] each, in the
    compute dtype. Native grids only: jrl.kernels.projections dispatches."""
    scale, eps = (None, 0.0) if norm is None else (norm[0], float(norm[1]))
    return _projections(x, scale, tuple(weights), eps, contract)

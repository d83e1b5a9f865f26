"""Batch-invariant RMSNorm: fixed row tiles, the full feature dim reduced inside one tile."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _grid, reference
from jrl.kernels.contract import NumericalContract


def _rms_norm_kernel(ids, x_ref, scale_ref, o_ref, *, eps: float, dim: int):
    """x_ref [block_rows, Dp], scale_ref [1, Dp] -> o_ref [block_rows, Dp]; float32 inside.
    Features beyond dim (GPU padding) are zeros: they add nothing to the sum of squares."""
    del ids
    x = x_ref[...].astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / dim + eps)
    o_ref[...] = (x * inv * scale_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rms_norm_2d(x, scale, eps, contract):
    rows, dim = x.shape
    if rows == 0:
        return x
    block = contract.norm_block_rows
    dim_p = contract.kernel_dim(dim)
    xp = _grid.pad_axis(_grid.pad_axis(x, 0, block), 1, dim_p)
    call = _grid.launch(
        functools.partial(_rms_norm_kernel, eps=eps, dim=dim), grid=(xp.shape[0] // block,),
        in_tiles=[_grid.Tile((block, dim_p), lambda i: (i, 0)),
                  _grid.Tile((1, dim_p), lambda i: (0, 0))],
        out_tiles=[_grid.Tile((block, dim_p), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(xp.shape, x.dtype)],
        contract=contract, name="jrl_rms_norm")
    (y,) = call(xp, _grid.pad_axis(scale.reshape(1, dim), 1, dim_p))
    return y[:rows, :dim]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm(x, scale, eps, contract):
    return _rms_norm_2d(x.reshape(-1, x.shape[-1]), scale, eps, contract).reshape(x.shape)


def _rms_norm_fwd(x, scale, eps, contract):
    return _rms_norm(x, scale, eps, contract), (x, scale)


def _rms_norm_bwd(eps, contract, residuals, dy):
    del contract
    x, scale = residuals
    _, vjp = jax.vjp(functools.partial(reference.rms_norm, eps=eps), x, scale)
    return vjp(dy)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float,
             contract: NumericalContract) -> jax.Array:
    """y = x / sqrt(mean(x^2, -1) + eps) * scale, batch-invariant. x [..., D], scale [D].

    Computed in float32, returned in x.dtype. Differentiable (custom_vjp through the reference).
    """
    if scale.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: scale {scale.shape} must be [D] for x {x.shape}")
    return _rms_norm(x, scale, float(eps), contract)

"""A low-rank adapted projection on the bitwise path (LoRA, Hu et al. 2021, arXiv:2106.09685).

    y = round(x W + scale * round(x A) B)        x [..., K], W [K, N], A [K, r], B [r, N]

- x W: the matmul kernel (or the quantised one for a QLoRA base), float32 out, not rounded;
- x A: the matmul kernel, rounded to the compute dtype (it is the next product's operand);
- (x A) B: the matmul kernel, float32 out;
- the combine `base + scale * delta` in float32, rounded once to the compute dtype, in fixed
  row tiles (jrl.kernels.rowwise): a multiply feeding an add in plain XLA may be fused into an
  FMA in one program and not in another, which would make decode and train differ.
Every step is batch-invariant, so the sampler and the train step get the same bits. With B = 0
the delta is +0.0 exactly, so y is the base projection's float32 value rounded once: the same
bits as jrl.kernels.matmul(x, W) (the adapter-free model), except that a base value of -0.0
becomes +0.0.

The base W is frozen: its cotangent is zero (the train step differentiates the adapters only);
x, A and B get exact-formula gradients through the same kernels:
    g = scale * dy;  dB = (x A)^T g;  d(xA) = g B^T;  dA = x^T d(xA);  dx = dy W^T + d(xA) A^T.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _grid
from jrl.kernels import quantized as _quantized
from jrl.kernels.contract import NumericalContract
from jrl.kernels.matmul import matmul_2d
from jrl.kernels.rowwise import rowwise

_F32 = jnp.float32


def _dense(x2, w, contract, out_dtype):
    """x2 [M, K] @ w -> [M, N] in out_dtype through the kernel for w's storage."""
    if isinstance(w, _quantized.QuantizedWeight):
        return _quantized.matmul_2d(x2, w, contract=contract, out_dtype=out_dtype)
    return matmul_2d(x2, w.astype(contract.compute), contract=contract, out_dtype=out_dtype)


@functools.lru_cache(maxsize=None)
def _scaled_add(factor: float):
    """(b, d) -> (b + factor * d,), one function object per factor: rowwise's jitted launch is
    keyed on the function, so every LoRA projection of a program (and every call with the same
    scale) traces and lowers the combine once. factor is a Python float: a weakly typed float32
    constant inside the kernel."""
    def scaled_add(b, d):
        return (b + factor * d,)
    return scaled_add


def _combine(base, delta, scale, contract):
    """round(base + scale * delta) [M, N], float32 math in fixed row tiles."""
    (y,) = rowwise(_scaled_add(float(scale)), rows=(base, delta),
                   out=[(base.shape[1:], contract.compute)], contract=contract,
                   name="jrl_lora_combine")
    return y


def _forward(x2, w, a, b, scale, contract):
    compute = contract.compute
    base = _dense(x2, w, contract, _F32)
    xa = matmul_2d(x2, a.astype(compute), contract=contract, out_dtype=compute)
    delta = matmul_2d(xa, b.astype(compute), contract=contract, out_dtype=_F32)
    return _combine(base, delta, scale, contract), xa


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _lora(x, w, a, b, scale, contract):
    x2 = x.reshape(-1, x.shape[-1]).astype(contract.compute)
    y, _ = _forward(x2, w, a, b, scale, contract)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _lora_fwd(x, w, a, b, scale, contract):
    x2 = x.reshape(-1, x.shape[-1]).astype(contract.compute)
    y, xa = _forward(x2, w, a, b, scale, contract)
    return y.reshape(*x.shape[:-1], y.shape[-1]), (x, w, a, b, xa)


def _frozen_cotangent(w):
    if isinstance(w, _quantized.QuantizedWeight):
        return _quantized.frozen_cotangent(w)
    return jnp.zeros(w.shape, w.dtype)


def _lora_bwd(scale, contract, residuals, dy):
    x, w, a, b, xa = residuals
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(compute)
    g = (dy2.astype(_F32) * jnp.float32(scale)).astype(compute)
    ac, bc = a.astype(compute), b.astype(compute)
    d_b = matmul_2d(xa.T, g, contract=contract, out_dtype=_F32)                      # [r, N]
    d_xa = matmul_2d(g, bc.T, contract=contract, out_dtype=_F32).astype(compute)     # [M, r]
    d_a = matmul_2d(x2.T, d_xa, contract=contract, out_dtype=_F32)                   # [K, r]
    if isinstance(w, _quantized.QuantizedWeight):
        w_t = _quantized.transposed_dequantized(w, compute)                          # [N, K]
    else:
        w_t = w.astype(compute).T
    dx = (matmul_2d(dy2, w_t, contract=contract, out_dtype=_F32)
          + matmul_2d(d_xa, ac.T, contract=contract, out_dtype=_F32))
    return (dx.reshape(x.shape).astype(x.dtype), _frozen_cotangent(w),
            d_a.astype(a.dtype), d_b.astype(b.dtype))


_lora.defvjp(_lora_fwd, _lora_bwd)


def _reference(x, w, a, b, scale, contract):
    """The plain-XLA control: the same formula and roundings, differentiated by jax.grad (the
    base stop-gradient: frozen)."""
    compute = contract.compute
    if isinstance(w, _quantized.QuantizedWeight):
        w = _quantized.dequantize(w)
    w = jax.lax.stop_gradient(w).astype(compute)
    xc = x.astype(compute)
    base = jnp.dot(xc, w, preferred_element_type=_F32)
    xa = jnp.dot(xc, a.astype(compute), preferred_element_type=_F32).astype(compute)
    delta = jnp.dot(xa, b.astype(compute), preferred_element_type=_F32)
    return (base + jnp.float32(scale) * delta).astype(compute)


def lora_matmul(x: jax.Array, w, a: jax.Array, b: jax.Array, *, scale: float,
                contract: NumericalContract) -> jax.Array:
    """y = x W + scale * (x A) B (module docstring). x [..., K], w [K, N] (an array or a
    jrl.kernels.quantized.QuantizedWeight), a [K, r], b [r, N] -> [..., N] in contract.compute.
    Differentiable w.r.t. x, a and b; w is frozen (zero cotangent)."""
    k, n = w.shape
    if x.shape[-1] != k or a.shape[0] != k or b.shape[1] != n or a.shape[1] != b.shape[0]:
        raise ValueError(f"lora_matmul: x [..., {x.shape[-1]}], w {tuple(w.shape)}, a "
                         f"{tuple(a.shape)}, b {tuple(b.shape)}: expected x [..., K], w [K, N], "
                         "a [K, r], b [r, N]")
    if _grid.uses_pallas(contract):
        if x.size == 0:
            return jnp.zeros(x.shape[:-1] + (n,), contract.compute)
        return _lora(x, w, a, b, float(scale), contract)
    return _reference(x, w, a, b, float(scale), contract)

"""Row-parallel projections whose bits do not depend on the tensor-parallel degree.

A row-parallel projection y = x @ w (the attention output, the MLP down projection: tensor
parallelism splits their input dimension K over devices) is the sum of per-device partial
products, and a plain all-reduce adds them in an order that depends on how many devices there
are. Here K is cut into V = contract.tensor_shards virtual shards of K / V:

    p_s = x[:, K_s] @ w[K_s, :]          (the matmul kernel, float32 out, one per shard)
    y   = round((((p_0 + p_1) + p_2) + ... + p_{V-1}))    (float32 in shard order, one rounding)

On one device all V products run locally. Under tensor parallelism of degree T (T divides V) a
device holds V / T consecutive shards, computes their products with the same kernel on the same
shapes, and the partials move by all-gather, never by a psum, so every device sums the same V
partials in the same order: T = 1, 2, 4, ... give y bit for bit. The price is the all-gather of
V / T float32 partials per device instead of one psum, and V kernel calls of K / V instead of
one of K.

The backward (one device only) is per shard too: dx[:, K_s] = dy @ w[K_s]^T, dw[K_s] = x[:, K_s]^T
dy, each the kernel on the shard's shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _grid, reference
from jrl.kernels.contract import NumericalContract
from jrl.kernels.matmul import matmul_2d


def _check(k: int, contract: NumericalContract, devices: int = 1) -> int:
    shards = contract.tensor_shards
    if k % shards:
        raise ValueError(f"NumericalContract.tensor_shards={shards}: must divide the "
                         f"row-parallel projection's input dimension {k}")
    if shards % devices:
        raise ValueError(f"NumericalContract.tensor_shards={shards}: must be a multiple of the "
                         f"tensor-parallel degree {devices}")
    return k // shards


def _product(x: jax.Array, w: jax.Array, contract: NumericalContract) -> jax.Array:
    """x [M, k] @ w [k, N] -> [M, N] float32: the kernel (or XLA's dot on the xla backend)."""
    if _grid.uses_pallas(contract):
        return matmul_2d(x, w, contract=contract, out_dtype=jnp.float32)
    return reference.matmul(x, w, out_dtype=jnp.float32)


def _partials(x2: jax.Array, w: jax.Array, size: int, contract: NumericalContract) -> list:
    """The products of consecutive K-shards of `size`, in shard order."""
    return [_product(x2[:, s * size:(s + 1) * size], w[s * size:(s + 1) * size], contract)
            for s in range(x2.shape[1] // size)]


def _ordered_sum(partials) -> jax.Array:
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _local(x, w, contract):
    return _local_fwd(x, w, contract)[0]


def _local_fwd(x, w, contract):
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    size = _check(x2.shape[1], contract)
    y = _ordered_sum(_partials(x2, w.astype(compute), size, contract)).astype(compute)
    return y.reshape(*x.shape[:-1], y.shape[-1]), (x, w)


def _local_bwd(contract, residuals, dy):
    x, w = residuals
    compute = contract.compute
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    dy2 = dy.reshape(-1, dy.shape[-1]).astype(compute)
    wc = w.astype(compute)
    size = _check(x2.shape[1], contract)
    dx, dw = [], []
    for s in range(contract.tensor_shards):
        part = slice(s * size, (s + 1) * size)
        # Transposes materialised, as jrl.kernels.matmul's backward does (plain operands).
        w_t, x_t = jax.lax.optimization_barrier((wc[part].T, x2[:, part].T))
        dx.append(_product(dy2, w_t, contract))
        dw.append(_product(x_t, dy2, contract))
    dx = jnp.concatenate(dx, axis=1).reshape(x.shape).astype(x.dtype)
    return dx, jnp.concatenate(dw, axis=0).astype(w.dtype)


_local.defvjp(_local_fwd, _local_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _across(x, w, contract, axis):
    """Inside shard_map over `axis`: x [..., K / T] and w [K / T, N] are this device's rows."""
    compute = contract.compute
    devices = jax.lax.axis_size(axis)
    x2 = x.reshape(-1, x.shape[-1]).astype(compute)
    if not _grid.uses_pallas(contract):
        # The xla backend is the control: plain tensor parallelism, a psum of local products.
        y = jax.lax.psum(reference.matmul(x2, w.astype(compute), out_dtype=jnp.float32), axis)
    else:
        size = _check(x2.shape[1] * devices, contract, devices)
        local = jnp.stack(_partials(x2, w.astype(compute), size, contract))   # [V / T, M, N]
        gathered = jax.lax.all_gather(local, axis, tiled=True)                # [V, M, N]
        y = _ordered_sum([gathered[s] for s in range(gathered.shape[0])])
    y = y.astype(compute)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _across_fwd(x, w, contract, axis):
    return _across(x, w, contract, axis), None


def _across_bwd(contract, axis, residuals, dy):
    raise NotImplementedError("row_parallel_matmul: gradients under tensor parallelism are not "
                              "implemented (jrl.parallel.tensor runs the forward: scores and "
                              "p_o); train on one device or with data/FSDP sharding")


_across.defvjp(_across_fwd, _across_bwd)


def row_parallel_matmul(x: jax.Array, w: jax.Array, *, contract: NumericalContract,
                        axis: str | None = None) -> jax.Array:
    """y = x @ w [..., N] in the compute dtype, reduced over contract.tensor_shards virtual
    shards of K (module docstring). x [..., K], w [K, N] (plain arrays). axis: None on one
    device (differentiable), or the mesh axis name inside shard_map, where x and w hold this
    device's K / T rows (forward only). On the xla backend with an axis: a plain psum (the
    control, not invariant)."""
    if x.ndim < 1 or w.ndim != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"row_parallel_matmul: expected x [..., K] and w [K, N], got {x.shape} "
                         f"and {w.shape}")
    if axis is None:
        _check(x.shape[-1], contract)      # both backends accept the same contracts
        if not _grid.uses_pallas(contract):
            compute = contract.compute
            return reference.matmul(x.astype(compute), w.astype(compute), out_dtype=compute)
        return _local(x, w, contract)
    return _across(x, w, contract, axis)

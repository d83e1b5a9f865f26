"""Per-row pointwise math in fixed row tiles: activations, gates and the other small elementwise
steps of a layer, with bits that never depend on the surrounding program.

Why a kernel for elementwise math: XLA compiles an elementwise op as part of whatever fusion
surrounds it, and on a CPU the vectorised and the scalar code of one fusion evaluate exp, tanh,
logistic and log by different approximations; which elements take which path depends on the
fusion's shape. So `silu(x)` of one token could round differently in the decode program (1 row)
and in the train program (thousands of rows). Here every element is computed by the same code
on a tile of fixed shape [block_rows, ...]: the row count only decides how many tiles run.

    rowwise(fn, rows=(a, b, ...), shared=(w, ...), out=((shape, dtype), ...), contract=...)

applies fn(*row_tiles, *shared) -> tuple of output tiles, where every `rows` array is [N, ...]
(one leading row axis) and every `shared` array is given whole to each tile (e.g. a conv weight
or per-head constants). fn sees float32 views of float inputs and returns arrays of shape
[block_rows, *out_shape]; outputs are rounded once to their dtype. With backend="xla" fn runs
on the whole arrays (the plain-XLA control).

On a GPU every in-kernel array must have a power-of-two size (Triton), so there every dim but
the row axis is zero-padded to the next power of two (contract.kernel_dim) and the outputs are
sliced back: fn must treat its trailing dims pointwise (padded entries only meet padded
entries) or reduce over them with zeros being neutral, as every fn here does (a conv's zero
taps add +0).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jrl.kernels import _grid
from jrl.kernels.contract import NumericalContract

_F32 = jnp.float32


def _widen(x: jax.Array) -> jax.Array:
    return x.astype(_F32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _kernel(ids, *refs, fn, num_rows_inputs, num_shared, block):
    del ids
    row_refs = refs[:num_rows_inputs]
    shared_refs = refs[num_rows_inputs:num_rows_inputs + num_shared]
    out_refs = refs[num_rows_inputs + num_shared:]
    outs = fn(*(_widen(r[...]) for r in row_refs), *(_widen(r[...]) for r in shared_refs))
    for ref, value in zip(out_refs, outs):
        ref[...] = value.astype(ref.dtype)


def rowwise(fn: Callable[..., tuple], *, rows: Sequence[jax.Array],
            shared: Sequence[jax.Array] = (), out: Sequence[tuple[tuple[int, ...], object]],
            contract: NumericalContract, name: str = "jrl_rowwise") -> list[jax.Array]:
    """fn applied tile by tile over the rows (see the module docstring). rows: arrays [N, ...]
    sharing N; shared: arrays every tile reads whole; out: (per-row shape, dtype) of each
    output. Returns the outputs [N, *shape]. Not differentiable by itself: callers put it
    under a custom_vjp whose backward differentiates fn directly."""
    rows, shared, out = list(rows), list(shared), list(out)
    count = rows[0].shape[0]
    if any(r.shape[0] != count for r in rows):
        raise ValueError(f"rowwise: row inputs disagree on N: {[r.shape for r in rows]}")
    if not _grid.uses_pallas(contract) or count == 0:
        outs = fn(*(_widen(r) for r in rows), *(_widen(s) for s in shared))
        return [value.astype(dtype) for value, (_, dtype) in zip(outs, out)]
    out = tuple((tuple(shape), dtype) for shape, dtype in out)
    return list(_launch(fn, tuple(rows), tuple(shared), out, contract, name))


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _launch(fn, rows, shared, out, contract, name):
    """rowwise's Pallas path, one jitted function per (fn, shapes, contract): a program that
    calls the same step in every layer traces and lowers it once (fn must be the same object
    across calls for that, e.g. a module-level function). rows, shared: tuples."""
    count = rows[0].shape[0]
    block = contract.norm_block_rows

    def pad_features(x, first_axis):
        for axis in range(first_axis, x.ndim):
            x = _grid.pad_axis(x, axis, contract.kernel_dim(x.shape[axis]))
        return x

    padded = [pad_features(_grid.pad_axis(r, 0, block), 1) for r in rows]
    shared = [pad_features(s, 0) for s in shared]
    out_shapes = [tuple(contract.kernel_dim(d) for d in shape) for shape, _ in out]
    total = padded[0].shape[0]

    def row_tile(shape):
        zeros = (0,) * len(shape)
        return _grid.Tile((block, *shape), lambda i, zeros=zeros: (i, *zeros))

    def whole(shape):
        zeros = (0,) * len(shape)
        return _grid.Tile(tuple(shape), lambda i, zeros=zeros: zeros)

    kernel = functools.partial(_kernel, fn=fn, num_rows_inputs=len(rows),
                               num_shared=len(shared), block=block)
    call = _grid.launch(
        kernel, grid=(total // block,),
        in_tiles=[row_tile(r.shape[1:]) for r in padded] + [whole(s.shape) for s in shared],
        out_tiles=[row_tile(shape) for shape in out_shapes],
        out_shape=[jax.ShapeDtypeStruct((total, *padded_shape), dtype)
                   for padded_shape, (_, dtype) in zip(out_shapes, out)],
        contract=contract, name=name)
    return [y[(slice(0, count),) + tuple(slice(0, d) for d in shape)]
            for y, (shape, _) in zip(call(*padded, *shared), out)]


# ---------------------------------------------------------------------------------------------
# The layers' pointwise steps, each differentiable (custom_vjp through the same fn in XLA).


def _differentiable(fn: Callable[..., jax.Array], name: str):
    """f(contract, dtype, *rows) -> fn(*rows) [N, ...] in dtype through rowwise, with the
    gradient of fn itself."""

    def as_tuple(*tiles):
        return (fn(*tiles),)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
    def apply(contract, dtype, *xs):
        flat = [x.reshape(-1, *x.shape[-1:]) for x in xs]
        (y,) = rowwise(as_tuple, rows=flat, out=[(flat[0].shape[1:], dtype)],
                       contract=contract, name=name)
        return y.reshape(xs[0].shape)

    def forward(contract, dtype, *xs):
        return apply(contract, dtype, *xs), xs

    def backward(contract, dtype, xs, dy):
        del contract
        _, vjp = jax.vjp(lambda *a: fn(*(x.astype(_F32) for x in a)).astype(dtype), *xs)
        return vjp(dy)

    apply.defvjp(forward, backward)
    return apply


# silu(gate) * up in float32, rounded once: SwiGLU's activation.
swiglu = _differentiable(lambda gate, up: jax.nn.silu(gate) * up, "jrl_swiglu")
# x * sigmoid(gate) in float32, rounded once: gated attention and the Gated DeltaNet output.
sigmoid_gate = _differentiable(lambda x, gate: x * jax.nn.sigmoid(gate), "jrl_sigmoid_gate")
silu_gate = _differentiable(lambda x, gate: x * jax.nn.silu(gate), "jrl_silu_gate")

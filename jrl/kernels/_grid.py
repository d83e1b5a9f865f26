"""Launching a tiled kernel: a Pallas grid natively, one in-kernel loop over it when interpreted.

Every kernel in this package is written as `kernel(ids, *in_refs, *out_refs)`, where `ids` are the
grid indices and the refs are the blocks of one grid step. `launch` runs it two ways:

- native (GPU, TPU, and "tpu_interpret"): `pallas_call` with the grid and BlockSpecs, ids from
  `pl.program_id`.
- emulated (CPU, plain interpret mode): ONE `pallas_call` without a grid whose kernel loops over
  the grid points itself and hands the kernel ref views (`ref.at[...]`) of the same blocks.
  Pallas's interpreter carries every input array through its grid loop and writes each input
  block back, so XLA copies all inputs at every grid step (measured: 2.2 ms per step for a 32 MB
  input); read-only views inside one loop copy nothing. The per-tile computation (shapes, order)
  is the same as with a grid, so batch invariance is unchanged.

bfloat16 in the emulated path: XLA's CPU backend has no native bfloat16 for dynamic slices and
in-place block writes and widens the whole buffer at every loop step instead (measured: slicing
a 25 MB bfloat16 array 96 times took 40 ms, 0.08 ms in float32). So bfloat16 inputs travel as
their uint16 bit patterns and each block read is widened to float32 (`_Widened`), and bfloat16
outputs are written in float32 and rounded once after the loop. Widening is exact, a product of
two bfloat16 numbers is exact in float32, and one rounding of the float32 result is what an
in-kernel cast does, so kernels compute the numbers the bfloat16 definition asks for.

Data-dependent blocks (the MoE kernels: each row tile multiplies by its own expert's weights):
`num_scalar_prefetch` leading inputs are small int32 arrays that every index_map receives after
the grid ids and the kernel receives as its first refs: TPU scalar prefetch (SMEM), and plain
reads in the emulated loop. Triton has no scalar prefetch, so on GPU they are refused; a GPU
kernel indexes the whole operand itself. `grid_limit` lets the emulated loop stop after the
grid points that have work (a data-dependent trip count); a native grid is static, so there the
kernel skips the remaining points itself.

Each kernel's entry point (matmul_2d, the norm, attention, logprob, gated-delta, MoE and rowwise
launches) is a jax.jit with the contract and other Python values static. A model calls the same
kernel at the same shapes in every layer; nested in the caller's jit, the kernel is traced and
lowered to MLIR once per program and called from each layer (XLA inlines the calls before its
own passes, so the compiled program is the same). Interpret-mode lowering of a Pallas call is
expensive: this took a quarter off the sampling tests' lowering time.

The emulated loop's trip count goes through an optimization barrier, so XLA never sees a trip
count of 1 and never inlines a lone tile into (and fuses it with) the surrounding program: a tile
is compiled the same way whatever the number of tiles (batch size) is. This is defensive; the
invariance tests also pass without it on this XLA version.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jrl.kernels.contract import NumericalContract


@dataclasses.dataclass(frozen=True)
class Tile:
    """How one operand is cut into blocks (a small, backend-neutral BlockSpec).

    block_shape: block dims, None for a squeezed (size-1) dim; or None for the whole array.
    index_map: grid ids -> block indices (in blocks, like pl.BlockSpec).
    scalars: small int data read as scalars (loop bounds): SMEM on TPU.
    element_offsets: index_map returns element offsets, not block indices (blocks may overlap;
      emulated grid only).
    """

    block_shape: tuple[int | None, ...] | None = None
    index_map: Callable[..., tuple] | None = None
    scalars: bool = False
    element_offsets: bool = False


@dataclasses.dataclass(frozen=True)
class Execution:
    """How kernels run for a contract: resolved platform, grid emulation and interpret value."""

    platform: str
    emulate_grid: bool
    interpret: Any


def _host_platform() -> str:
    """JAX's default backend (a function, so lowering tests can pretend to be a TPU or GPU)."""
    return jax.default_backend()


def execution(contract: NumericalContract) -> Execution:
    """Resolves how Pallas kernels run for this contract; raises ValueError if they cannot."""
    if contract.backend != "pallas":
        raise ValueError(f"NumericalContract.backend={contract.backend!r}: Pallas kernels need "
                         "backend='pallas'")
    platform = contract.resolved_platform()
    if contract.platform == "auto":
        # Tile rules are platform-specific; "auto" could not check them at construction.
        contract.replace(platform=platform).validate()
    host = _host_platform()
    if platform in ("gpu", "tpu") and host != platform:
        raise ValueError(
            f"NumericalContract.platform={contract.platform!r} resolves to {platform!r}, but JAX's "
            f"default backend here is {host!r}: Pallas kernels for {platform} cannot run on it "
            "(use platform='cpu' for interpret mode, 'tpu_interpret' to simulate a TPU, or "
            "backend='xla')")
    if platform == "cpu":
        return Execution(platform, emulate_grid=True, interpret=True)
    return Execution(platform, emulate_grid=False, interpret=contract.pallas_interpret)


def uses_pallas(contract: NumericalContract) -> bool:
    """True for the Pallas backend, False for "xla"; raises TypeError for a non-contract and
    ValueError if Pallas kernels cannot run here (via execution)."""
    if not isinstance(contract, NumericalContract):
        raise TypeError(f"contract must be a NumericalContract, got {type(contract).__name__}")
    if contract.backend == "xla":
        return False
    execution(contract)
    return True


def launch(kernel: Callable[..., None], *, grid: tuple[int, ...], in_tiles: Sequence[Tile],
           out_tiles: Sequence[Tile], out_shape: Sequence[jax.ShapeDtypeStruct],
           contract: NumericalContract, name: str, num_scalar_prefetch: int = 0,
           grid_limit: Callable[..., jax.Array] | None = None) -> Callable[..., list[jax.Array]]:
    """Returns f(*inputs) -> list of outputs running kernel(ids, *in_refs, *out_refs) over grid.

    num_scalar_prefetch: the first that many inputs are int32 arrays without a Tile; every
      index_map is called as index_map(*ids, *prefetch_refs) and the kernel gets them as its
      first refs (TPU and emulated grid only; see the module docstring).
    grid_limit: grid_limit(*prefetch_refs, *in_refs) -> int32 scalar, read inside the kernel:
      the emulated grid runs only the points whose first id is below it. Natively every point
      runs.
    """
    run = execution(contract)
    in_tiles, out_tiles, out_shape = tuple(in_tiles), tuple(out_tiles), tuple(out_shape)
    if run.emulate_grid:
        return _launch_emulated(kernel, grid, in_tiles, out_tiles, out_shape, name,
                                num_scalar_prefetch, grid_limit)
    return _launch_native(kernel, grid, in_tiles, out_tiles, out_shape, run, name,
                          num_scalar_prefetch)


def _launch_native(kernel, grid, in_tiles, out_tiles, out_shape, run: Execution, name,
                   num_scalar_prefetch: int):
    tpu = run.platform in ("tpu", "tpu_interpret")
    if num_scalar_prefetch and not tpu:
        # A kernel wrapper bug, not a user error: GPU kernels must index whole operands instead.
        raise ValueError(f"{name}: scalar prefetch exists on TPU and in the emulated grid only "
                         "(Triton has none)")

    def spec(tile: Tile):
        if tile.element_offsets:
            # A kernel wrapper bug, not a user error: such tiles are built only for the emulated
            # (CPU interpret) grid.
            raise ValueError(f"{name}: element-offset tiles exist only in the emulated grid")
        memory_space = None
        if tile.scalars and tpu:
            from jax.experimental.pallas import tpu as pltpu
            memory_space = pltpu.SMEM
        return pl.BlockSpec(tile.block_shape, tile.index_map, memory_space=memory_space)

    def body(*refs):
        ids = tuple(pl.program_id(axis) for axis in range(len(grid)))
        kernel(ids, *refs)

    if tpu:
        from jax.experimental.pallas import tpu as pltpu
        # Grid steps are independent (reductions live inside one step), so all are parallel.
        compiler_params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid))
    else:
        # Triton, not JAX's default Mosaic GPU backend: these are plain blocked kernels, and
        # Mosaic GPU wants warpgroup-sized copies and whole blocks in shared memory.
        from jax.experimental.pallas import triton as pltriton
        compiler_params = pltriton.CompilerParams(num_warps=4, num_stages=2)
    in_specs, out_specs = [spec(t) for t in in_tiles], [spec(t) for t in out_tiles]
    if num_scalar_prefetch:
        from jax.experimental.pallas import tpu as pltpu
        grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=num_scalar_prefetch,
                                                 grid=grid, in_specs=in_specs,
                                                 out_specs=out_specs)
        call = pl.pallas_call(body, out_shape=out_shape, grid_spec=grid_spec,
                              interpret=run.interpret, compiler_params=compiler_params, name=name)
    else:
        call = pl.pallas_call(body, out_shape=out_shape, grid=grid, in_specs=in_specs,
                              out_specs=out_specs, interpret=run.interpret,
                              compiler_params=compiler_params, name=name)
    return lambda *args: list(call(*args))


def _launch_emulated(kernel, grid, in_tiles, out_tiles, out_shape, name, num_scalar_prefetch,
                     grid_limit):
    tiles = in_tiles + out_tiles
    num_steps = math.prod(grid)
    steps_per_first_id = math.prod(grid[1:])
    out_dtypes = [o.dtype for o in out_shape]
    kernel_out_shape = [jax.ShapeDtypeStruct(o.shape, _F32 if o.dtype == _BF16 else o.dtype)
                        for o in out_shape]

    def run(*args):
        widened = ([a.dtype == _BF16 for a in args[num_scalar_prefetch:]]
                   + [False] * len(out_shape))

        def body(*refs):
            prefetch, refs = refs[:num_scalar_prefetch], refs[num_scalar_prefetch:]

            def step(index, carry):
                ids = _unravel(index, grid)
                views = [_view(ref, tile, ids, prefetch) for ref, tile in zip(refs, tiles)]
                kernel(ids, *prefetch,
                       *(_Widened(v) if w else v for v, w in zip(views, widened)))
                return carry

            trip_count = jnp.int32(num_steps)
            if grid_limit is not None:
                limit = grid_limit(*prefetch, *refs[:len(in_tiles)])
                trip_count = jnp.minimum(trip_count, limit * steps_per_first_id)
            # A trip count XLA cannot read: see the module docstring.
            trip_count = jax.lax.optimization_barrier(trip_count)
            jax.lax.fori_loop(jnp.int32(0), trip_count, step, jnp.int32(0))

        call = pl.pallas_call(body, out_shape=kernel_out_shape, interpret=True, name=name)
        args = [jax.lax.bitcast_convert_type(a, jnp.uint16) if a.dtype == _BF16 else a
                for a in args]
        return [o.astype(d) for o, d in zip(call(*args), out_dtypes)]

    return run


_BF16, _F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


class _Widened:
    """A read-only view of a bfloat16 block stored as uint16 bits: reads return float32."""

    def __init__(self, ref):
        self._ref = ref

    @property
    def shape(self):
        return self._ref.shape

    dtype = _F32

    def __getitem__(self, index):
        bits = self._ref[index]
        return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def _unravel(index, grid):
    """Flat step -> grid ids, last axis fastest (Pallas's order)."""
    ids = []
    for size in reversed(grid[1:]):
        ids.append(index % size)
        index = index // size
    ids.append(index)
    return tuple(reversed(ids))


def _view(ref, tile: Tile, ids, prefetch=()):
    if tile.block_shape is None:
        return ref
    indices = tile.index_map(*ids, *prefetch)
    scale = (lambda size: 1) if tile.element_offsets else (lambda size: size)
    return ref.at[tuple(i if size is None else pl.ds(i * scale(size), size)
                        for i, size in zip(indices, tile.block_shape))]


# -------------------------------------------------------------------------------------------------
# Wrapper helpers shared by the kernels.

def pad_axis(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    """Pads axis of x at the end to a multiple of `multiple` (no copy when already aligned)."""
    size = x.shape[axis]
    extra = -size % multiple
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def dot_precision(dtype) -> jax.lax.Precision | None:
    """float32 operands are multiplied in full float32 everywhere (TPU and GPU default to bf16
    passes / TF32 otherwise), as the reference semantics require."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

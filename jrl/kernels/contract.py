"""The numerical contract: one hashable object that fixes how every reduction is computed.

The sampler and the trainer take the same contract from the same config, so the logprob the
sampler records (p_b) and the one the train step recomputes (p_old) are bitwise equal. The
contract is saved with checkpoints and compared when a sampler and a trainer meet.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp

from jrl.checks import check_choice

BACKENDS = ("pallas", "xla")
PLATFORMS = ("auto", "cpu", "gpu", "tpu", "tpu_interpret")
DTYPES = ("float32", "bfloat16")
# The KV cache's storage: the compute dtype, or FP8 with a power-of-two scale per token and KV
# head (jrl.kernels.fp8), which the train forward applies to its keys and values too.
KV_DTYPES = ("compute", "float8_e4m3fn")
# The values the projection matmuls multiply: the compute dtype, or W8A8 (activations per row and
# weights per output column read back from float8_e4m3fn, jrl.kernels.fp8), on both sides.
MATMUL_DTYPES = ("compute", "float8_e4m3fn")


# Bounds of matmul_row_tiles. A one-row dot is a matrix-vector product, which the CPU library
# computes in another order, hence at least 4 rows; at SmolLM2's dims 256-row dots were the
# fastest of 32-1024 (1024 rows, K = 1536, N = 576: 11.6 ms on 32-row tiles, 8.4 ms on 256).
MIN_ROW_TILE = 4
MAX_ROW_TILE = 256


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@dataclasses.dataclass(frozen=True)
class NumericalContract:
    """Kernel backend, dtypes and tile shapes shared by sampler and trainer.

    Fields:
      backend: "pallas" (batch-invariant kernels; interpret mode on a CPU) or "xla"
        (plain jnp: fast, the reference for correctness tests, NOT batch-invariant).
      platform: "auto" resolves to the default JAX backend; "cpu" runs Pallas in interpret mode;
        "tpu_interpret" runs the TPU kernel path in Pallas's TPU interpreter on a CPU (slow; the
        only TPU evidence without a TPU) and validates tiles by the TPU rules.
      compute_dtype: dtype of activations and matmul operands ("float32" or "bfloat16").
      param_dtype: dtype parameters are stored in.
      kv_dtype: how attention keys and values are kept: "compute" (the compute dtype) or
        "float8_e4m3fn" (one byte per entry plus one int8 exponent per token and KV head,
        jrl.kernels.fp8). With FP8 the sampler's KV cache stores the quantised values and
        attends over them read back in the compute dtype, and the train forward passes its keys
        and values through the same quantise-and-read-back (straight-through gradient), so
        both attend over the same numbers.
      matmul_dtype: the values every matmul through jrl.kernels (matmul, projections,
        lora_matmul, moe_experts) multiplies: "compute" (its operands cast to the compute
        dtype) or "float8_e4m3fn" (W8A8): the activations are quantised per row (token) and
        the weights per output column to e4m3fn with power-of-two scales and read back in the
        compute dtype (exact), then the same kernel runs on those values, in the sampler and
        the train step alike (straight-through gradient; docs/fp8.md).
      tensor_shards: the row-parallel projections (attention output, MLP down, Gated DeltaNet
        output) reduce their input dimension as this many virtual shards: each shard's product
        by the matmul kernel in float32, then the partials summed in shard order in float32 and
        rounded once (jrl.kernels.row_parallel). Under tensor parallelism of a degree T that
        divides it, each device computes its own shards and the partials move by all-gather,
        so every T (1 included) gives the same bits. 1: one product over the whole dimension.
      Accumulation is always float32 (dots, softmax statistics, norms).
      matmul_block_m/n/k: matmul tile; K is reduced in block_k tiles in a fixed order, no split-K.
        Also the MoE expert tiles: each expert's rows are padded to a multiple of block_m.
      matmul_row_tiles: the CPU's emulated grid only. Entries (K, N, w_transposed, tile, ...):
        row tiles besides matmul_block_m that a [M, K] x [K, N] call may run (narrower ones
        for M < block_m, wider ones for M > block_m; jrl.kernels.matmul.row_tile). Whether a
        tile of another row count rounds like block_m rows is a property of the CPU's math
        library, so a table is measured on one CPU model (`jrl calibrate-tiles`) and named
        here; empty (the default) runs block_m rows everywhere, the same program on every
        machine.
      attn_block_q / attn_block_k: flash-attention tiles; KV blocks are aligned at position 0.
      norm_block_rows: rows per RMSNorm tile, and per MoE combine tile.
      logprob_block_rows / vocab_chunk: log-softmax tiles; the vocabulary is reduced in
        vocab_chunk pieces in a fixed order (online logsumexp). logprob_block_rows is also the
        MoE router softmax's row tile.
      emulated_attn_batch: sequences per step of the attention kernel in the emulated (CPU)
        grid, whose dots are batched over them (XLA's CPU dots give a batch element bits that
        depend on the batch count, so the count is fixed); native grids take one per step.
      emulated_heads: heads per step of the attention kernel (KV heads) and of the Gated
        DeltaNet kernel (value heads) in the emulated grid: 0 (all of a layer's heads in one
        step) or a count dividing them. XLA's CPU dots give a batch element bits that depend on
        the batch count, so a tensor-parallel device, which holds 1 / T of the heads, needs a
        fixed count dividing its share (jrl.parallel.tensor checks). No effect on GPU or TPU,
        whose kernels run one head per program.
      delta_chunk: the gated delta rule's chunk size C (jrl.kernels.gated_delta): chunks of C
        rows aligned at position 0 are the one canonical order of train, prefill and decode.
        A power of two; on GPU >= 16 (Triton dot operands), on TPU a multiple of 8 (the chunk
        is a float32 sublane tile).
    """

    backend: str = "pallas"
    platform: str = "auto"
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    kv_dtype: str = "compute"
    matmul_dtype: str = "compute"
    tensor_shards: int = 1
    # Defaults are tuned for CPU interpret mode (launch/bench_e2e.py) and valid on TPU and GPU
    # too; for_platform() gives each platform's starting point. On a CPU a matmul tile wider
    # than its operand is the whole operand, so the defaults run one [16, K] x [K, N] library
    # dot per 16 rows (K, N <= 2^18, every vocabulary in use): decode pads to 16 rows, not
    # 128, and the train forward still runs few, large dots. Narrower N or K tiles cost a copy
    # of every weight tile they slice (a SmolLM2 LM head in 4096-wide tiles: 14.3 ms per
    # 8-row decode call against 8.8 ms whole, and 820 against 566 ms per 1024 train rows). A
    # row block is padded to its full size, so decode (few rows) pays for block_m /
    # attn_block_q rows while the train forward wants big blocks.
    matmul_block_m: int = 16
    matmul_block_n: int = 1 << 18
    matmul_block_k: int = 1 << 18
    matmul_row_tiles: tuple[tuple[int, ...], ...] = ()
    attn_block_q: int = 16
    attn_block_k: int = 128
    norm_block_rows: int = 64
    logprob_block_rows: int = 16
    vocab_chunk: int = 2048
    delta_chunk: int = 16
    emulated_attn_batch: int = 8
    emulated_heads: int = 0

    def __post_init__(self):
        # JSON and the CLI give lists; the contract is hashed (a static argument of every
        # kernel), so the table is stored as tuples of ints.
        if isinstance(self.matmul_row_tiles, (list, tuple)):
            table = tuple(tuple(int(v) for v in entry) if isinstance(entry, (list, tuple))
                          else entry for entry in self.matmul_row_tiles)
            object.__setattr__(self, "matmul_row_tiles", table)
        self.validate()

    # ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raises ValueError naming the field, its value and what is allowed."""
        _check_choice("backend", self.backend, BACKENDS)
        _check_choice("platform", self.platform, PLATFORMS)
        _check_choice("compute_dtype", self.compute_dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        _check_choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        _check_choice("matmul_dtype", self.matmul_dtype, MATMUL_DTYPES)
        tiles = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name.startswith(("matmul_block", "attn_block", "norm_block",
                                       "logprob_block", "vocab_chunk", "delta_chunk"))}
        # emulated_attn_batch and tensor_shards are counts, not tiles: the platform tile rules
        # below skip them.
        counts = {"emulated_attn_batch": self.emulated_attn_batch,
                  "tensor_shards": self.tensor_shards}
        for name, value in {**tiles, **counts}.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"NumericalContract.{name}={value!r}: must be a positive int")
        heads = self.emulated_heads
        if not isinstance(heads, int) or isinstance(heads, bool) or heads < 0:
            raise ValueError(f"NumericalContract.emulated_heads={heads!r}: must be 0 (all "
                             "of a layer's KV heads) or a positive int")
        if not _is_power_of_two(self.delta_chunk):
            # The triangular inverse is a product of log2(C) factors (gated_delta).
            raise ValueError(f"NumericalContract.delta_chunk={self.delta_chunk}: must be a "
                             "power of two")
        if self.tensor_shards > 1 and self.matmul_dtype != "compute":
            # A W8A8 scale spans the whole input dimension, which row-parallel shards split.
            raise ValueError(f"NumericalContract.tensor_shards={self.tensor_shards} with "
                             f"matmul_dtype={self.matmul_dtype!r}: the row-parallel virtual "
                             "shards run compute-dtype matmuls only; use tensor_shards=1 "
                             "with W8A8")
        self._validate_row_tiles()
        platform = self.resolved_platform() if self.platform != "auto" else None
        if platform in ("gpu", "tpu", "tpu_interpret") and self.matmul_row_tiles:
            raise ValueError(f"NumericalContract.matmul_row_tiles: applies to the CPU's "
                             f"emulated grid only; on {platform} it must be empty (the "
                             "kernels run matmul_block_m rows)")
        if platform in ("tpu", "tpu_interpret"):
            # Mosaic: the last two block dims are multiples of (8, 128) for 32-bit types and
            # (16, 128) for bf16, or equal the full array dim; we require the multiples.
            sublane = 16 if self.compute_dtype == "bfloat16" else 8
            for name in ("matmul_block_m", "attn_block_q", "norm_block_rows",
                         "logprob_block_rows"):
                if tiles[name] % sublane:
                    raise ValueError(f"NumericalContract.{name}={tiles[name]}: on TPU must be a "
                                     f"multiple of {sublane} for {self.compute_dtype}")
            # attn_block_k is the lane dim of the score tile and of the kv-position slice.
            for name in ("matmul_block_n", "matmul_block_k", "attn_block_k", "vocab_chunk"):
                if tiles[name] % 128:
                    raise ValueError(f"NumericalContract.{name}={tiles[name]}: on TPU must be a "
                                     "multiple of 128")
            # The kernel slices float32 chunks of delta_chunk rows (bf16 inputs are widened by
            # the wrapper), so the float32 sublane tile applies whatever the compute dtype.
            if self.delta_chunk % 8:
                raise ValueError(f"NumericalContract.delta_chunk={self.delta_chunk}: on TPU "
                                 "must be a multiple of 8")
        if platform == "gpu":
            # Triton: power-of-two block shapes, dot operands at least 16 in each dimension.
            for name, value in tiles.items():
                if not _is_power_of_two(value) or value < 16:
                    raise ValueError(f"NumericalContract.{name}={value}: on GPU must be a power "
                                     "of two >= 16")

    def _validate_row_tiles(self) -> None:
        name, seen = "NumericalContract.matmul_row_tiles", set()
        if not isinstance(self.matmul_row_tiles, tuple):
            raise ValueError(f"{name}={self.matmul_row_tiles!r}: must be a list of entries "
                             "(K, N, w_transposed, tile, ...)")
        for entry in self.matmul_row_tiles:
            if not isinstance(entry, tuple) or len(entry) < 4:
                raise ValueError(f"{name}: entry {entry!r} must be (K, N, w_transposed, tile, "
                                 "...) with at least one tile")
            k, n, transposed, *tiles = entry
            if k <= 0 or n <= 0 or transposed not in (0, 1):
                raise ValueError(f"{name}: entry {entry!r}: K and N must be positive and "
                                 "w_transposed 0 or 1")
            if (k, n, transposed) in seen:
                raise ValueError(f"{name}: two entries for K={k}, N={n}, "
                                 f"w_transposed={transposed}")
            seen.add((k, n, transposed))
            for tile in tiles:
                if not _is_power_of_two(tile) or not MIN_ROW_TILE <= tile <= MAX_ROW_TILE:
                    raise ValueError(f"{name}: entry {entry!r}: tile {tile} must be a power of "
                                     f"two in [{MIN_ROW_TILE}, {MAX_ROW_TILE}]")
                # block_m is the platform's only once "auto" is resolved (resolved_for).
                if self.platform != "auto" and not (
                        tile < self.matmul_block_m
                        or (tile > self.matmul_block_m and tile % self.matmul_block_m == 0)):
                    raise ValueError(f"{name}: entry {entry!r}: tile {tile} must be below "
                                     f"matmul_block_m={self.matmul_block_m} or a larger multiple "
                                     "of it")

    def row_tiles(self, k: int, n: int, w_transposed: bool) -> tuple[int, ...]:
        """The row tiles matmul_row_tiles allows a [M, K] x [K, N] call besides block_m
        (sorted; empty where the table has no entry for the shape)."""
        for entry in self.matmul_row_tiles:
            if entry[:3] == (k, n, int(w_transposed)):
                return tuple(sorted(entry[3:]))
        return ()

    @classmethod
    def for_platform(cls, platform: str, **changes: Any) -> "NumericalContract":
        """A contract with starting-point tiles for a platform, then `changes` applied.

        "cpu" is the class default with three changes, measured at SmolLM2 dims (the README's
        "Speed of the bitwise path" has the tables):
        - a 4-row attention query tile: decode pays for 4 rows, not 16 (Triton needs >= 16,
          hence not the class default);
        - a 32-position KV tile: a KV cache holds whole tiles, and causal attention masks out up
          to a tile (the decode program on 32 slots went from 0.72x to 0.88x XLA's speed);
        - a 32-row matmul tile: a 32-slot decode step reads every weight once (0.95x, against
          0.88x with 16 rows) and the train step runs fewer, larger dots. Narrower tiles for a
          decode of fewer slots and wider ones for hundreds of rows are this CPU's to measure:
          matmul_row_tiles, written by `jrl calibrate-tiles`.
        The GPU tiles follow common Triton choices (register-sized accumulators) and the TPU
        tiles fill the MXU; neither has been tuned on hardware.
        """
        _check_choice("platform", platform, PLATFORMS)
        tiles = _PLATFORM_TILES.get(platform, {})
        return cls(platform=platform, **{**tiles, **changes})

    def resolved_for(self, platform: str | None = None) -> "NumericalContract":
        """The contract a run uses on `platform` (default JAX's default backend): with
        platform "auto", every tile still at the class default takes the platform's tile
        (for_platform) and the platform is named; a field set to another value stays. A
        contract that names its platform is returned as it is, so a run's recorded contract
        (config.json, checkpoints) resolves to itself everywhere."""
        if self.platform != "auto":
            return self
        platform = platform or jax.default_backend()
        default = type(self)()
        tiles = {name: value for name, value in _PLATFORM_TILES.get(platform, {}).items()
                 if getattr(self, name) == getattr(default, name)}
        return self.replace(platform=platform, **tiles)

    # ----------------------------------------------------------------------------------------
    def resolved_platform(self) -> str:
        """The platform kernels lower for: the explicit one, or JAX's default backend."""
        if self.platform != "auto":
            return self.platform
        return jax.default_backend()

    def kernel_dim(self, size: int) -> int:
        """The size a whole data dimension (RMSNorm features, head dim, GQA head group) takes
        inside a kernel block; the wrapper zero-pads up to it. Triton (GPU) wants every in-kernel
        array dimension a power of two, so there it is the next power of two; else `size`."""
        if self.resolved_platform() == "gpu":
            return 1 << max(0, int(size) - 1).bit_length()
        return int(size)

    def kernel_dot_dim(self, size: int) -> int:
        """kernel_dim for a dimension that is a dot operand's inside a kernel: on GPU also at
        least 16 (Triton's minimum dot operand size); elsewhere `size`."""
        if self.resolved_platform() == "gpu":
            return max(16, self.kernel_dim(size))
        return int(size)

    @property
    def interpret(self) -> bool:
        """Pallas interpret mode: used on a CPU, where no native Pallas lowering exists."""
        return self.resolved_platform() in ("cpu", "tpu_interpret")

    @property
    def pallas_interpret(self) -> Any:
        """The value for pallas_call(interpret=...): False natively, True on a CPU, and
        pltpu.InterpretParams() for "tpu_interpret" (the TPU kernel path simulated on a CPU)."""
        platform = self.resolved_platform()
        if platform == "tpu_interpret":
            from jax.experimental.pallas import tpu as pltpu
            return pltpu.InterpretParams()
        return platform == "cpu"

    @property
    def compute(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def params(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def fp8_kv(self) -> bool:
        """Whether attention keys and values are kept in FP8 (kv_dtype)."""
        return self.kv_dtype == "float8_e4m3fn"

    @property
    def fp8_matmul(self) -> bool:
        """Whether the matmuls multiply W8A8 values (matmul_dtype)."""
        return self.matmul_dtype == "float8_e4m3fn"

    def replace(self, **changes: Any) -> "NumericalContract":
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "NumericalContract":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"NumericalContract: unknown fields {unknown}; "
                             f"allowed: {sorted(known)}")
        return cls(**data)

    def check_compatible(self, other: "NumericalContract", *, what: str = "sampler") -> None:
        """Raises if two contracts would not give bitwise-equal logprobs (every field counts)."""
        if self != other:
            diffs = [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                     for f in dataclasses.fields(self)
                     if getattr(self, f.name) != getattr(other, f.name)]
            raise ValueError(f"numerical contract of the {what} differs from the trainer's: "
                             + "; ".join(diffs))


_PLATFORM_TILES = {
    "cpu": dict(matmul_block_m=32, attn_block_q=4, attn_block_k=32),
    "gpu": dict(matmul_block_m=128, matmul_block_n=128, matmul_block_k=64, attn_block_q=64,
                attn_block_k=64, norm_block_rows=16, logprob_block_rows=16, vocab_chunk=2048),
    "tpu": dict(matmul_block_m=256, matmul_block_n=256, matmul_block_k=256, attn_block_q=128,
                attn_block_k=128, norm_block_rows=64, logprob_block_rows=16, vocab_chunk=2048),
}


def _check_choice(field: str, value: Any, allowed: tuple) -> None:
    check_choice(f"NumericalContract.{field}", value, allowed)

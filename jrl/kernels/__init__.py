"""jrl.kernels: the numerical kernels every model forward runs, chosen by one contract.

`backend="pallas"` runs batch-invariant Pallas kernels (interpret mode on a CPU, native on GPU and
TPU); `backend="xla"` runs the plain-XLA reference (fast, differentiable, NOT batch-invariant),
with the same dtype casts. Both are jit-able and differentiable.

    matmul(x, w, *, contract, transpose_w=False)                x [..., K], w [K, N] -> [..., N]
                                                                (w may be a QuantizedWeight)
    projections(x, [w0, w1, ...], *, contract, norm=None)      (xn w0, xn w1, ...): one kernel
                                                                natively, RMSNorm prologue
    lora_matmul(x, w, a, b, *, scale, contract)                 x W + scale (x A) B, LoRA
    quantize(w, "int8" | "nf4") -> QuantizedWeight; dequantize   QLoRA's frozen base storage
    attention(q, k, v, *, q_positions, kv_positions, kv_valid, contract, scale=None)
    attention_plan(q_positions, kv_positions, kv_valid, *, contract)   one forward's mask, once
    rms_norm(x, scale, *, eps, contract)                        x [..., D] -> [..., D]
    token_logprobs(logits, targets, *, contract, temperature=1.0, logit_floor=None,
                   return_entropy=True) -> TokenLogprobs(logp, entropy)
    gated_delta_rule(q, k, v, g, beta, *, valid, initial_state, state_chunk, contract)
                   -> GatedDeltaOut(out, state)                 Gated DeltaNet, canonical chunks
    shard_rows(fn, mesh, axis, *, replicated=())                data parallel via shard_map

With contract.matmul_dtype="float8_e4m3fn" (W8A8) matmul, projections, lora_matmul and the MoE
experts multiply FP8 values: each wrapper below passes its activations through
fp8.fake_quantize (per row) and its weights through fp8.fake_quantize_columns (per output
column), then runs its usual kernel, so the sampler and the trainer round alike (docs/fp8.md).

Mixture of experts (jrl.kernels.moe; its dispatch / expert_rows / combine are the hooks for
expert parallelism):

    route(router_logits, *, top_k, norm_topk_prob, contract) -> Routing(experts, weights, probs)
    routing_weights(probs, experts, *, norm_topk_prob)          replayed experts' weights
    moe_experts(x, experts, weights, w_gate, w_up, w_down, *, contract)   x [N, D] -> [N, D]
    moe_experts_sharded(..., axis, contract)    the same, experts split over a mesh axis (EP)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import Mesh, PartitionSpec

from jrl.kernels import attention as _attention
from jrl.kernels import fp8
from jrl.kernels import lora as _lora
from jrl.kernels import gated_delta as _gated_delta
from jrl.kernels import quantized as _quantized
from jrl.kernels import logprobs as _logprobs
from jrl.kernels import matmul as _matmul
from jrl.kernels import projections as _projections
from jrl.kernels import moe
from jrl.kernels import reference
from jrl.kernels import rms_norm as _rms_norm
from jrl.kernels._grid import execution, uses_pallas
from jrl.kernels.contract import NumericalContract
from jrl.kernels.gated_delta import GatedDeltaOut
from jrl.kernels.logprobs import TokenLogprobs
from jrl.kernels.moe import Routing, route, routing_weights
from jrl.kernels.quantized import QuantizedWeight, dequantize, quantize
from jrl.kernels.row_parallel import row_parallel_matmul
from jrl.kernels.reference import MASKED

__all__ = [
    "GatedDeltaOut", "MASKED", "NumericalContract", "QuantizedWeight", "Routing",
    "TokenLogprobs", "attention", "attention_plan", "dequantize", "execution", "gated_delta_rule", "lora_matmul",
    "matmul", "moe", "moe_experts", "moe_experts_sharded", "projections", "quantize", "reference", "rms_norm",
    "route", "routing_weights", "row_parallel_matmul", "shard_rows", "token_logprobs",
]


def _pallas(contract: NumericalContract) -> bool:
    """True for the Pallas backend; raises if it cannot run here (see _grid.uses_pallas)."""
    return uses_pallas(contract)


def _w8a8(x: jax.Array, w, contract: NumericalContract, *,
          transpose_w: bool = False) -> tuple[jax.Array, jax.Array]:
    """W8A8's operands: x [..., K] read back from FP8 per row, w [..., K, N] per output column
    ([N, K] per row with transpose_w: a tied embedding's columns are its rows). Straight-through
    gradients. A QuantizedWeight (QLoRA's int8 / NF4 base) has its own storage: refused."""
    if isinstance(w, QuantizedWeight):
        raise ValueError(f"NumericalContract.matmul_dtype={contract.matmul_dtype!r}: W8A8 "
                         f"quantises plain weights; a QuantizedWeight ({w.format} QLoRA base) "
                         "keeps its own storage (use matmul_dtype='compute' with a quantised "
                         "base)")
    w = fp8.fake_quantize(w) if transpose_w else fp8.fake_quantize_columns(w)
    return fp8.fake_quantize(x), w


def matmul(x: jax.Array, w: jax.Array, *, contract: NumericalContract,
           transpose_w: bool = False) -> jax.Array:
    """y = x @ w. x [..., K], w [K, N] (or [N, K] with transpose_w: y = x @ w.T) -> [..., N]
    in contract.compute (operands cast to it, float32 accumulation). Batch-invariant with the
    Pallas backend. A QuantizedWeight w (QLoRA's frozen base) is dequantised tile by tile
    inside the kernel (jrl.kernels.quantized). With W8A8 (contract.fp8_matmul) the kernel
    multiplies x and w read back from FP8 (module docstring)."""
    if contract.fp8_matmul:
        x, w = _w8a8(x, w, contract, transpose_w=transpose_w)
    return _matmul_values(x, w, contract, transpose_w)


def _matmul_values(x, w, contract, transpose_w=False):
    """matmul of these values as they are (no W8A8 rounding)."""
    if isinstance(w, QuantizedWeight):
        if transpose_w:
            raise ValueError("matmul: transpose_w is for a tied embedding; a QuantizedWeight is "
                             "a [K, N] projection")
        return _quantized.matmul(x, w, contract=contract)
    if _pallas(contract):
        return _matmul.matmul(x, w, contract=contract, transpose_w=transpose_w)
    compute = contract.compute
    w = w.T if transpose_w else w
    return reference.matmul(x.astype(compute), w.astype(compute), out_dtype=compute)


def projections(x: jax.Array, weights: Sequence[jax.Array], *, contract: NumericalContract,
                norm: tuple[jax.Array, float] | None = None) -> tuple[jax.Array, ...]:
    """(xn @ W_0, ..., xn @ W_n-1): xn = x, or with norm = (scale [K], eps) x's RMSNorm
    (rms_norm's formula). x [..., K], W_i [K, N_i] (plain arrays) -> tuple of [..., N_i] in
    contract.compute. On a GPU or TPU one Pallas call does the norm and every projection
    (jrl.kernels.projections); the CPU's emulated grid and the XLA backend run rms_norm and one
    matmul per weight. Batch-invariant with the Pallas backend; differentiable. With W8A8 the
    norm runs as its own kernel (its output is what is quantised per row), then the
    projections of the values read back from FP8."""
    weights = tuple(weights)
    if not weights:
        raise ValueError("projections: expected at least one weight")
    for w in weights:
        if isinstance(w, QuantizedWeight) or w.ndim != 2 or w.shape[0] != x.shape[-1]:
            raise ValueError(f"projections: every weight must be a plain [K, N] array with K = "
                             f"{x.shape[-1]} (x {x.shape}), got {getattr(w, 'shape', w)}")
    if contract.fp8_matmul:
        if norm is not None:
            x = rms_norm(x, norm[0], eps=norm[1], contract=contract)
        norm = None
        x = fp8.fake_quantize(x)
        weights = tuple(fp8.fake_quantize_columns(w) for w in weights)
    if _pallas(contract) and not execution(contract).emulate_grid:
        return _projections.projections(x, weights, contract=contract, norm=norm)
    if norm is not None:
        x = rms_norm(x, norm[0], eps=norm[1], contract=contract)
    return tuple(_matmul_values(x, w, contract) for w in weights)


def lora_matmul(x: jax.Array, w, a: jax.Array, b: jax.Array, *, scale: float,
                contract: NumericalContract) -> jax.Array:
    """y = x W + scale * (x A) B (jrl.kernels.lora). x [..., K], w [K, N] (an array or a
    QuantizedWeight), a [K, r], b [r, N] -> [..., N] in contract.compute. With W8A8 x and the
    base W are read back from FP8 (x per row, W per output column); the adapters A and B, the
    trained low-rank part, stay in the compute dtype; a QuantizedWeight base is refused."""
    if contract.fp8_matmul:
        x, w = _w8a8(x, w, contract)
    return _lora.lora_matmul(x, w, a, b, scale=scale, contract=contract)


def moe_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w_gate: jax.Array,
                w_up: jax.Array, w_down: jax.Array, *, contract: NumericalContract) -> jax.Array:
    """Dropless top-k SwiGLU experts (jrl.kernels.moe.moe_experts). x [..., D], experts and
    weights [..., k], w_gate / w_up [E, D, F], w_down [E, F, D] -> [..., D]. With W8A8 the
    expert inputs x are read back from FP8 per token and every expert's weights per output
    column; the SwiGLU activation, formed inside the expert kernel, enters the down projection
    in the compute dtype."""
    if contract.fp8_matmul:
        x, w_gate, w_up, w_down = _w8a8_experts(x, w_gate, w_up, w_down)
    return moe.moe_experts(x, experts, weights, w_gate, w_up, w_down, contract=contract)


def moe_experts_sharded(x: jax.Array, experts: jax.Array, weights: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *, axis: str,
                        contract: NumericalContract) -> jax.Array:
    """moe_experts with the experts split over the mesh axis `axis`
    (jrl.kernels.moe.moe_experts_sharded), W8A8 as moe_experts: a column's exponent reads that
    expert's weights only, so every split gives the same values."""
    if contract.fp8_matmul:
        x, w_gate, w_up, w_down = _w8a8_experts(x, w_gate, w_up, w_down)
    return moe.moe_experts_sharded(x, experts, weights, w_gate, w_up, w_down, axis=axis,
                                   contract=contract)


def _w8a8_experts(x, *expert_weights):
    """x per row, each [E, K, N] expert weight per (expert, output column)."""
    return (fp8.fake_quantize(x),) + tuple(fp8.fake_quantize_columns(w) for w in expert_weights)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_positions: jax.Array,
              kv_positions: jax.Array, kv_valid: jax.Array, contract: NumericalContract,
              scale: float | None = None, layer: jax.Array | None = None,
              mask_plan: _attention.AttentionPlan | None = None) -> jax.Array:
    """Causal GQA attention with explicit positions (see jrl.kernels.attention.attention).

    q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D], q_positions [B, Tq], kv_positions/kv_valid [B, Tk];
    key j visible to query i iff kv_valid[j] and kv_positions[j] <= q_positions[i]. Returns
    [B, Tq, Hq, D] in contract.compute; rows without a visible key are 0. layer: k/v are
    stacks [L, B, Tk, Hkv, D] of a KV cache and layer `layer` is used (read in place where the
    kernel can). mask_plan (with layer): attention_plan of the same positions, computed once
    for all layers (None with the XLA backend)."""
    if _pallas(contract):
        return _attention.attention(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                                    kv_valid=kv_valid, contract=contract, scale=scale,
                                    layer=layer, mask_plan=mask_plan)
    if layer is not None:
        k, v = k[layer], v[layer]
    compute = contract.compute
    return reference.attention(q.astype(compute), k.astype(compute), v.astype(compute),
                               q_positions=q_positions, kv_positions=kv_positions,
                               kv_valid=kv_valid, scale=scale)


def attention_plan(q_positions: jax.Array, kv_positions: jax.Array, kv_valid: jax.Array, *,
                   contract: NumericalContract) -> _attention.AttentionPlan | None:
    """attention's visibility rule for these positions in the kernel's layout
    (jrl.kernels.attention.plan), for every layer of one forward to share; None with the XLA
    backend, which needs none."""
    if _pallas(contract):
        return _attention.plan(q_positions, kv_positions, kv_valid, contract)
    return None


def rms_norm(x: jax.Array, scale: jax.Array, *, eps: float,
             contract: NumericalContract) -> jax.Array:
    """y = x / sqrt(mean(x^2, -1) + eps) * scale in float32, returned in x.dtype. x [..., D]."""
    if _pallas(contract):
        return _rms_norm.rms_norm(x, scale, eps=eps, contract=contract)
    return reference.rms_norm(x, scale, eps=eps)


def token_logprobs(logits: jax.Array, targets: jax.Array, *, contract: NumericalContract,
                   temperature: float = 1.0, logit_floor: jax.Array | None = None,
                   return_entropy: bool = True) -> TokenLogprobs:
    """(logp, entropy) [...] float32 of z = logits * f32(1 / temperature), truncated to
    z >= logit_floor when given (see reference.token_logprobs). logits [..., V], targets [...] int."""
    if _pallas(contract):
        return _logprobs.token_logprobs(logits, targets, contract=contract,
                                        temperature=temperature, logit_floor=logit_floor,
                                        return_entropy=return_entropy)
    logp, entropy = reference.token_logprobs(logits, targets, temperature=temperature,
                                             logit_floor=logit_floor)
    return TokenLogprobs(logp, entropy if return_entropy else None)


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     valid: jax.Array, initial_state: jax.Array, state_chunk: jax.Array,
                     contract: NumericalContract) -> GatedDeltaOut:
    """Gated DeltaNet's gated delta rule in one canonical order: chunks of contract.delta_chunk
    rows aligned at row 0, for train, prefill and decode alike (see
    jrl.kernels.gated_delta.gated_delta_rule for the semantics each stage relies on).

    q, k [B, T, Hk, dk] raw (L2-normalised inside), v [B, T, Hv, dv], g, beta [B, T, Hv] float32,
    valid [B, T] bool, initial_state [B, Hv, dk, dv] float32, state_chunk [B] int. Returns
    GatedDeltaOut(out [B, T, Hv, dv] in contract.compute, state [B, Hv, dk, dv] float32 at the
    start of chunk state_chunk)."""
    kwargs = dict(valid=valid, initial_state=initial_state, state_chunk=state_chunk,
                  contract=contract)
    if _pallas(contract):
        return _gated_delta.gated_delta_rule(q, k, v, g, beta, **kwargs)
    return _gated_delta.gated_delta_chunked_reference(q, k, v, g, beta, **kwargs)


def shard_rows(fn: Callable, mesh: Mesh, axis: str | Sequence[str], *,
               replicated: Sequence[int] = ()) -> Callable:
    """Runs fn data-parallel: each device applies fn to its own rows, no communication.

    fn takes positional arrays; every argument is split along its leading dim over the mesh
    axis `axis` except the positions listed in `replicated` (e.g. weights), which every device
    gets whole. Every output is split along its leading dim. Because the kernels are batch-
    invariant, the result is bitwise equal to the unsharded call (Pallas backend). Use it inside
    or outside jit. check_vma is off: interpret-mode Pallas kernels do not support it, and fn is
    purely per-device anyway.

        y = shard_rows(lambda x, w: matmul(x, w, contract=c), mesh, "data", replicated=(1,))(x, w)
    """
    replicated = frozenset(replicated)

    def sharded(*args):
        in_specs = tuple(PartitionSpec() if i in replicated else PartitionSpec(axis)
                         for i in range(len(args)))
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=PartitionSpec(axis),
                             check_vma=False)(*args)

    return sharded

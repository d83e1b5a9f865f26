"""Softmax attention: GQA, optional q/k/v biases (Qwen2), per-head q/k norm (Qwen3, Qwen3.5),
partial rotary and a sigmoid output gate (Qwen3.5's gated attention), over a KV cache.

One kernel serves every stage (jrl.kernels.attention): the train forward attends over the
sequence itself; prefill, decode and append write their keys into the cache at index = position
and attend over the whole cache with the causal mask from explicit positions.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels import fp8
from jrl.kernels.contract import NumericalContract
from jrl.kernels.rowwise import sigmoid_gate
from jrl.models.blocks.norms import norm
from jrl.models.config import ModelConfig, RopeScaling, YarnScaling
from jrl.models.lora import project_all, project_rows


def param_shapes(config: ModelConfig, n: int) -> dict:
    """Shapes of a stack of n attention mixers (weights [in, out]). attn_norm is the layer's
    input norm."""
    d, q, kv = config.hidden_size, config.q_size, config.kv_size
    # With the output gate, wq's columns hold each head's q then its gate ([H, 2, hd], HF's
    # q_proj layout), so adapters and exports see one q projection, as in transformers.
    q_out = 2 * q if config.attn_output_gate else q
    shapes = {"attn_norm": (n, d), "wq": (n, d, q_out), "wk": (n, d, kv), "wv": (n, d, kv),
              "wo": (n, q, d)}
    if config.attention_bias:
        shapes.update(bq=(n, q), bk=(n, kv), bv=(n, kv))
    if config.qk_norm:
        shapes.update(q_norm=(n, config.head_dim), k_norm=(n, config.head_dim))
    return shapes


def cache_shapes(config: ModelConfig, n: int, batch: int, capacity: int,
                 contract: NumericalContract) -> dict:
    """(shape, dtype) of a stack's cache: keys and values of every slot and position,
    zero-initialised (stale entries must be finite: masked keys contribute 0 * value).

    With the Pallas backend the capacity is rounded up to whole KV blocks (attn_block_k): the
    kernel pads keys and values to whole blocks, and a cache that is not made of them would be
    copied whole at every call of every layer (measured on the CPU at SmolLM2 dims: 430 of 615
    us of an 8-slot decode attention went to that copy). The extra entries are never valid."""
    if contract.backend == "pallas":
        capacity = -(-capacity // contract.attn_block_k) * contract.attn_block_k
    shape = (n, batch, capacity, config.num_kv_heads, config.head_dim)
    if contract.fp8_kv:
        # FP8 entries and one int8 exponent per token and KV head (jrl.kernels.fp8).
        return {"k": (shape, fp8.FP8), "v": (shape, fp8.FP8),
                "k_exp": (shape[:-1], jnp.int8), "v_exp": (shape[:-1], jnp.int8)}
    return {"k": (shape, contract.compute), "v": (shape, contract.compute)}


class Rotary(NamedTuple):
    """RoPE's cos and sin tables of one forward's positions: [B, T, 1, rotary_dim / 2] float32
    each, computed once and used by every attention layer for q and k."""

    cos: jax.Array
    sin: jax.Array


def rotary_tables(positions: jax.Array, theta: float, rotary_dim: int,
                  scaling: RopeScaling | YarnScaling | None = None) -> Rotary:
    """angle[b, t, i] = position[b, t] * f_i, f_i = theta^(-2i / rotary_dim), i < rotary_dim / 2
    (scaled by `scaling`: Llama 3's RopeScaling, or a YarnScaling, whose attention factor also
    multiplies cos and sin), in float32 per element (a token's tables depend only on its own
    position). positions [B, T]."""
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / rotary_dim))
    magnitude = 1.0
    if scaling is not None and scaling.rope_type == "yarn":
        inv_freq = yarn_inv_freq(theta, rotary_dim, scaling)
        magnitude = scaling.attention_scale
    elif scaling is not None:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    # Positions known at compile time (a train forward's arange) would let XLA fold the tables
    # with its own cos and sin, whose bits differ from the compiled ones a decode step runs.
    positions = jax.lax.optimization_barrier(positions)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if magnitude != 1.0:
        cos, sin = cos * jnp.float32(magnitude), sin * jnp.float32(magnitude)
    return Rotary(cos[:, :, None, :], sin[:, :, None, :])


def llama3_inv_freq(inv_freq: jax.Array, scaling: RopeScaling) -> jax.Array:
    """Llama 3's scaled inverse frequencies [half] float32 (the rule in RopeScaling's doc), in
    float32 as transformers computes them."""
    wavelength = 2.0 * math.pi / inv_freq
    context = float(scaling.original_max_position_embeddings)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    interpolated = inv_freq / scaling.factor
    blend = (context / wavelength - low) / (high - low)
    smoothed = (1.0 - blend) * interpolated + blend * inv_freq
    scaled = jnp.where(wavelength > context / low, interpolated, inv_freq)
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return jnp.where(medium, smoothed, scaled).astype(jnp.float32)


def yarn_inv_freq(theta: float, rotary_dim: int, scaling: YarnScaling) -> jax.Array:
    """YaRN's inverse frequencies [rotary_dim / 2] float32 (the rule in
    jrl.models.config.YarnScaling's doc), in float32 as transformers'
    _compute_yarn_parameters computes them: the band edges in Python floats, the powers, the
    ramp and the blend in float32."""
    half, dim = rotary_dim // 2, rotary_dim
    powers = theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / dim)  # theta^(2i / d)
    context = float(scaling.original_max_position_embeddings)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(context / (rotations * 2.0 * math.pi)) / (2.0 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp
    interpolated = 1.0 / (scaling.factor * powers)
    return (interpolated * (1.0 - kept) + (1.0 / powers) * kept).astype(jnp.float32)


def apply_rotary(x: jax.Array, tables: Rotary) -> jax.Array:
    """Rotate-half RoPE of x [B, T, H, hd] on its first rotary_dim features (the tables' width
    times two); the rest pass through unchanged (partial rotary, Qwen3.5: rotary_dim = hd / 4).
    float32 math, one rounding to x.dtype."""
    half = tables.cos.shape[-1]
    dim = 2 * half
    x32 = x[..., :dim].astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    cos, sin = tables
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    rotated = rotated.astype(x.dtype)
    if dim == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., dim:]], axis=-1)


def rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None
         ) -> jax.Array:
    """Rotate-half RoPE on the first rotary_dim features (default all). x [B, T, H, hd],
    positions [B, T] -> same shape, in x.dtype (rotary_tables, then apply_rotary)."""
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    return apply_rotary(x, rotary_tables(positions, theta, dim))


def model_rotary(config: ModelConfig, positions: jax.Array) -> Rotary:
    """The tables every attention layer of config uses at positions [B, T]."""
    return rotary_tables(positions, config.rope_theta, config.rotary_dim, config.rope_scaling)


def add_bias(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """y + bias, added in float32 and rounded once to y.dtype (no bias: y)."""
    if bias is None:
        return y
    return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)


def _write_indices(write_at: jax.Array, layer_index: jax.Array | None) -> jax.Array:
    """[B, T, 2 or 3] int32 scatter indices (layer,) row, position of each new token's k/v:
    write_at [B, T] (>= capacity for a padding token: dropped)."""
    batch, seq = write_at.shape
    index = [jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, seq)),
             write_at.astype(jnp.int32)]
    if layer_index is not None:
        index.insert(0, jnp.broadcast_to(jnp.asarray(layer_index, jnp.int32), (batch, seq)))
    return jnp.stack(index, axis=-1)


def _write(cache: jax.Array, indices: jax.Array, values: jax.Array) -> jax.Array:
    """cache [(L,) B, C, Hkv(, hd)] with values [B, T, Hkv(, hd)] written at indices [B, T, n]
    (_write_indices); out-of-range entries are dropped. lax.scatter itself, not jnp's indexed
    update, which adds a negative-index fix-up of every index to each layer's program."""
    n = indices.shape[-1]
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(2, values.ndim)), inserted_window_dims=tuple(range(n)),
        scatter_dims_to_operand_dims=tuple(range(n)))
    return jax.lax.scatter(cache, indices, values.astype(cache.dtype), numbers,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def _write_kv(cache: dict, indices: jax.Array, k: jax.Array, v: jax.Array,
              contract: NumericalContract) -> dict:
    """The cache {"k", "v"(, "k_exp", "v_exp")} with k, v [B, T, Hkv, hd] written at indices
    (_write_indices): as they are, or quantised to FP8 with their exponents."""
    if not contract.fp8_kv:
        return {"k": _write(cache["k"], indices, k), "v": _write(cache["v"], indices, v)}
    out = {}
    for name, x in (("k", k), ("v", v)):
        q, exponent = fp8.quantize(x)
        out[name] = _write(cache[name], indices, q)
        out[name + "_exp"] = _write(cache[name + "_exp"], indices, exponent)
    return out


def _read_fp8(cache: dict, layer_index: jax.Array | None, contract: NumericalContract
              ) -> tuple[jax.Array, jax.Array]:
    """One layer's FP8 keys and values [B, C, Hkv, hd] read back in the compute dtype (exact:
    jrl.kernels.fp8): the workspace the attention kernel reads, as the train forward's
    fake-quantised keys and values are. From the stacks, layer `layer_index` (or None: the
    cache is one layer's)."""
    def layer(x):
        if layer_index is None:
            return x
        return jax.lax.dynamic_index_in_dim(x, layer_index, keepdims=False)
    return tuple(fp8.dequantize(layer(cache[name]), layer(cache[name + "_exp"]),
                                contract.compute) for name in ("k", "v"))


def cache_visibility(lengths: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(kv_positions, kv_valid) [B, C] of a KV cache: entry j holds position j, valid below the
    row's length [B]."""
    positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32),
                                 (lengths.shape[0], capacity))
    return positions, positions < lengths[:, None]


def forward(x: jax.Array, layer: dict, cache: dict | None, *, config: ModelConfig,
            contract: NumericalContract, positions: jax.Array, mask: jax.Array,
            lengths: jax.Array | None, input_norm: tuple[jax.Array, float] | None = None,
            rotary: Rotary | None = None, mask_plan=None, tensor_axis: str | None = None
            ) -> tuple[jax.Array, dict | None]:
    """x [B, T, D] (normed, or normed by the q/k/v kernel when input_norm = (scale, eps) is given)
    -> (out [B, T, D] compute dtype, new cache or None).

    cache: None (full sequence: attention over x itself, mask marks real tokens) or
    {"k", "v": [B, C, Hkv, hd]}: each real token's k/v is written at index = its position and
    attention runs over the whole cache, keys valid below `lengths` [B] (already covering the
    new tokens) and visible when kv_position <= q_position. Or the model's whole stacks,
    {"k", "v": [L, B, C, Hkv, hd], "layer": int32 scalar}: the same for layer `layer`, written
    and read in place (the returned cache is {"k", "v"}: the stacks with this layer's tokens
    written).

    With contract.fp8_kv the cache also holds "k_exp", "v_exp" [(L,) B, C, Hkv] int8 and k/v
    are float8_e4m3fn (jrl.kernels.fp8.quantize); attention reads the layer back in the compute
    dtype. Without a cache, k and v pass through fp8.fake_quantize: the same numbers.

    tensor_axis: tensor parallelism inside shard_map: the layer holds this device's heads
    (columns of wq/wk/wv, rows of wo; config counts this device's heads) and the output
    projection is reduced across the axis (lora.project_rows).
    """
    batch, seq, _ = x.shape
    q, k, v = (add_bias(y, layer.get(bias)) for y, bias in zip(
        project_all(x, layer, ("wq", "wk", "wv"), config=config, contract=contract,
                    norm=input_norm),
        ("bq", "bk", "bv")))
    gate = None
    if config.attn_output_gate:
        q = q.reshape(batch, seq, config.num_heads, 2, config.head_dim)
        q, gate = q[..., 0, :], q[..., 1, :].reshape(batch, seq, config.q_size)
    q = q.reshape(batch, seq, config.num_heads, config.head_dim)
    k = k.reshape(batch, seq, config.num_kv_heads, config.head_dim)
    v = v.reshape(batch, seq, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = norm(q, layer["q_norm"], config, contract)
        k = norm(k, layer["k_norm"], config, contract)
    if rotary is None:
        rotary = model_rotary(config, positions)
    q, k = apply_rotary(q, rotary), apply_rotary(k, rotary)

    layer_index = None if cache is None else cache.get("layer")
    if cache is None:
        if contract.fp8_kv:
            # The values an FP8 cache gives back (straight-through gradient).
            k, v = fp8.fake_quantize(k), fp8.fake_quantize(v)
        keys, values, kv_positions, kv_valid = k, v, positions, mask
        new_cache = None
    else:
        capacity = cache["k"].shape[-3]
        # Padding tokens write to index `capacity`, which mode="drop" discards.
        indices = _write_indices(jnp.where(mask, positions, capacity), layer_index)
        new_cache = _write_kv(cache, indices, k, v, contract)
        keys, values = new_cache["k"], new_cache["v"]
        kv_positions, kv_valid = cache_visibility(lengths, capacity)
        if contract.fp8_kv:
            keys, values = _read_fp8(new_cache, layer_index, contract)
            layer_index = None

    attn = kernels.attention(q, keys, values, q_positions=positions, kv_positions=kv_positions,
                             kv_valid=kv_valid, contract=contract, layer=layer_index,
                             mask_plan=mask_plan if layer_index is not None else None)
    attn = attn.reshape(batch, seq, config.q_size)
    if gate is not None:
        # attn * sigmoid(gate) in float32, rounded once, in fixed row tiles (kernels.rowwise).
        attn = sigmoid_gate(contract, attn.dtype, attn, gate)
    return project_rows(attn, layer, "wo", config=config, contract=contract,
                        tensor_axis=tensor_axis), new_cache

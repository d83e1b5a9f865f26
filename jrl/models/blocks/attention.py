"""Softmax attention: GQA, optional q/k/v biases (Qwen2), per-head q/k norm (Qwen3, Qwen3.5),
partial rotary and a sigmoid output gate (Qwen3.5's gated attention), over a KV cache.

One kernel serves every stage (jrl.kernels.attention): the train forward attends over the
sequence itself; prefill, decode and append write their keys into the cache at index = position
and attend over the whole cache with the causal mask from explicit positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.kernels.rowwise import sigmoid_gate
from jrl.models.blocks.norms import norm
from jrl.models.config import ModelConfig
from jrl.models.lora import project


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
    return {"k": (shape, contract.compute), "v": (shape, contract.compute)}


def rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None
         ) -> jax.Array:
    """Rotate-half RoPE on the first rotary_dim features (default all). x [B, T, H, hd],
    positions [B, T] -> same shape, in x.dtype.

    angle[t, i] = position[t] * theta^(-2i / rotary_dim), i < rotary_dim / 2; computed in
    float32 per element, so a token's result depends only on its own position. Features from
    rotary_dim on pass through unchanged (partial rotary, Qwen3.5: rotary_dim = head_dim / 4).
    """
    dim = x.shape[-1] if rotary_dim is None else rotary_dim
    half = dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x[..., :dim].astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    rotated = rotated.astype(x.dtype)
    if dim == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., dim:]], axis=-1)


def linear(x, layer, name, bias, contract, config=None):
    """x @ layer[name] (+ its LoRA adapter, + bias added in float32), through jrl.kernels."""
    y = project(x, layer, name, config=config, contract=contract)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)
    return y


def forward(x: jax.Array, layer: dict, cache: dict | None, *, config: ModelConfig,
            contract: NumericalContract, positions: jax.Array, mask: jax.Array,
            lengths: jax.Array | None) -> tuple[jax.Array, dict | None]:
    """x [B, T, D] (normed) -> (out [B, T, D] compute dtype, new cache or None).

    cache: None (full sequence: attention over x itself, mask marks real tokens) or
    {"k", "v": [B, C, Hkv, hd]}: each real token's k/v is written at index = its position and
    attention runs over the whole cache, keys valid below `lengths` [B] (already covering the
    new tokens) and visible when kv_position <= q_position. Or the model's whole stacks,
    {"k", "v": [L, B, C, Hkv, hd], "layer": int32 scalar}: the same for layer `layer`, written
    and read in place (the returned cache is {"k", "v"}: the stacks with this layer's tokens
    written).
    """
    batch, seq, _ = x.shape
    q = linear(x, layer, "wq", layer.get("bq"), contract, config)
    k = linear(x, layer, "wk", layer.get("bk"), contract, config)
    v = linear(x, layer, "wv", layer.get("bv"), contract, config)
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
    q = rope(q, positions, config.rope_theta, config.rotary_dim)
    k = rope(k, positions, config.rope_theta, config.rotary_dim)

    layer_index = None if cache is None else cache.get("layer")
    if cache is None:
        keys, values, kv_positions, kv_valid = k, v, positions, mask
        new_cache = None
    else:
        cache_k, cache_v = cache["k"], cache["v"]
        capacity = cache_k.shape[-3]
        # Padding tokens write to index `capacity`, which mode="drop" discards.
        write_at = jnp.where(mask, positions, capacity)
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], write_at.shape)
        at = (rows, write_at) if layer_index is None else (layer_index, rows, write_at)
        cache_k = cache_k.at[at].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[at].set(v.astype(cache_v.dtype), mode="drop")
        keys, values = cache_k, cache_v
        kv_positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
        kv_valid = kv_positions < lengths[:, None]
        new_cache = {"k": cache_k, "v": cache_v}

    attn = kernels.attention(q, keys, values, q_positions=positions, kv_positions=kv_positions,
                             kv_valid=kv_valid, contract=contract, layer=layer_index)
    attn = attn.reshape(batch, seq, config.q_size)
    if gate is not None:
        # attn * sigmoid(gate) in float32, rounded once, in fixed row tiles (kernels.rowwise).
        attn = sigmoid_gate(contract, attn.dtype, attn, gate)
    return project(attn, layer, "wo", config=config, contract=contract), new_cache

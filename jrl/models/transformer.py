"""Decoder-only transformer (Llama / Qwen2 / Qwen3) as pure functions of an explicit param pytree.

Every matmul, attention, norm and the output logprob go through jrl.kernels with one numerical
contract, and one `forward_hidden` serves both uses: full sequences (train) and cached decoding
(prefill and decode write their keys into a KV cache and attend over it). Because the kernels are
batch-invariant and stage-consistent, a token's logprob has the same bits in all three stages.

Params are plain nested dicts (see `param_shapes`), weights stored [in, out] so y = x @ w, and the
layers stacked on a leading axis so the stack runs under one `lax.scan` (one compiled layer).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig

Params = dict


# ---------------------------------------------------------------------------------------------
# Parameters


def param_shapes(config: ModelConfig) -> dict:
    """Shape of every parameter, same structure as the params pytree."""
    d, f, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_layers
    layers = {
        "attn_norm": (n, d),
        "wq": (n, d, config.q_size),
        "wk": (n, d, config.kv_size),
        "wv": (n, d, config.kv_size),
        "wo": (n, config.q_size, d),
        "mlp_norm": (n, d),
        "w_gate": (n, d, f),
        "w_up": (n, d, f),
        "w_down": (n, f, d),
    }
    if config.attention_bias:
        layers.update(bq=(n, config.q_size), bk=(n, config.kv_size), bv=(n, config.kv_size))
    if config.qk_norm:
        layers.update(q_norm=(n, config.head_dim), k_norm=(n, config.head_dim))
    shapes = {"embed": (v, d), "layers": layers, "final_norm": (d,)}
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


def init_params(config: ModelConfig, rng: jax.Array, dtype=jnp.float32) -> Params:
    """Random init: normal(0, 0.02) weights (scaled down for residual outputs), ones for norms,
    zeros for biases."""
    shapes = param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(rng, len(flat))
    leaves = []
    for key, (path, shape) in zip(keys, flat):
        name = path[-1].key
        if name.endswith("norm"):
            leaf = jnp.ones(shape, dtype)
        elif name in ("bq", "bk", "bv"):
            leaf = jnp.zeros(shape, dtype)
        else:
            std = 0.02 / (2 * config.num_layers) ** 0.5 if name in ("wo", "w_down") else 0.02
            leaf = (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ---------------------------------------------------------------------------------------------
# KV cache


class KVCache(NamedTuple):
    """Keys and values of every layer, slot and position. Index along C == token position.

    k, v [L, B, C, Hkv, hd] in the compute dtype, zero-initialised; lengths [B] int32 is the number
    of filled positions per slot (entries at index >= length are invalid and may hold stale data).
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, capacity: int, dtype) -> KVCache:
    shape = (config.num_layers, batch, capacity, config.num_kv_heads, config.head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


# ---------------------------------------------------------------------------------------------
# Forward


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, hd], positions [B, T] -> same shape, in x.dtype.

    angle[t, i] = position[t] * theta^(-2i/hd), i < hd/2; computed in float32 per element, so a
    token's result depends only on its own position.
    """
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def _linear(x, w, bias, contract):
    y = kernels.matmul(x, w, contract=contract)
    if bias is not None:
        y = (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)
    return y


def _layer(h, layer, cache_kv, *, config, contract, positions, mask, cache_lengths):
    """One decoder block. h [B, T, D]. cache_kv: None (full sequence) or (k, v) [B, C, Hkv, hd]."""
    batch, seq, _ = h.shape
    eps = config.rms_norm_eps
    x = kernels.rms_norm(h, layer["attn_norm"], eps=eps, contract=contract)
    q = _linear(x, layer["wq"], layer.get("bq"), contract)
    k = _linear(x, layer["wk"], layer.get("bk"), contract)
    v = _linear(x, layer["wv"], layer.get("bv"), contract)
    q = q.reshape(batch, seq, config.num_heads, config.head_dim)
    k = k.reshape(batch, seq, config.num_kv_heads, config.head_dim)
    v = v.reshape(batch, seq, config.num_kv_heads, config.head_dim)
    if config.qk_norm:
        q = kernels.rms_norm(q, layer["q_norm"], eps=eps, contract=contract)
        k = kernels.rms_norm(k, layer["k_norm"], eps=eps, contract=contract)
    q = rope(q, positions, config.rope_theta)
    k = rope(k, positions, config.rope_theta)

    if cache_kv is None:
        keys, values, kv_positions, kv_valid = k, v, positions, mask
        new_cache_kv = None
    else:
        cache_k, cache_v = cache_kv
        capacity = cache_k.shape[1]
        # Padding tokens write to index `capacity`, which mode="drop" discards.
        write_at = jnp.where(mask, positions, capacity)
        rows = jnp.broadcast_to(jnp.arange(batch)[:, None], write_at.shape)
        cache_k = cache_k.at[rows, write_at].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[rows, write_at].set(v.astype(cache_v.dtype), mode="drop")
        keys, values = cache_k, cache_v
        kv_positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
        kv_valid = kv_positions < cache_lengths[:, None]
        new_cache_kv = (cache_k, cache_v)

    attn = kernels.attention(q, keys, values, q_positions=positions, kv_positions=kv_positions,
                             kv_valid=kv_valid, contract=contract)
    attn = attn.reshape(batch, seq, config.q_size)
    h = h + kernels.matmul(attn, layer["wo"], contract=contract).astype(h.dtype)

    x = kernels.rms_norm(h, layer["mlp_norm"], eps=eps, contract=contract)
    gate = kernels.matmul(x, layer["w_gate"], contract=contract)
    up = kernels.matmul(x, layer["w_up"], contract=contract)
    # SwiGLU in float32 with one rounding, so the bits do not depend on how XLA fuses it.
    hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(h.dtype)
    h = h + kernels.matmul(hidden, layer["w_down"], contract=contract).astype(h.dtype)
    return h, new_cache_kv


def forward_hidden(params: Params, config: ModelConfig, tokens: jax.Array, *,
                   contract: NumericalContract, positions: jax.Array | None = None,
                   mask: jax.Array | None = None, cache: KVCache | None = None):
    """Final-norm hidden states. tokens [B, T] int -> (hidden [B, T, D] compute dtype, cache).

    positions [B, T] default arange(T); mask [B, T] bool marks real tokens (default all).
    With a cache, each real token's k/v is written at index = its position, `lengths` grows to
    cover them, and attention runs over the whole cache (capacity C) with the causal mask
    kv_position <= q_position; without one, attention runs over the sequence itself.
    """
    batch, seq = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    if mask is None:
        mask = jnp.ones((batch, seq), bool)
    positions = positions.astype(jnp.int32)
    h = params["embed"][tokens].astype(contract.compute)

    if cache is None:
        def body(h, layer):
            h, _ = _layer(h, layer, None, config=config, contract=contract, positions=positions,
                          mask=mask, cache_lengths=None)
            return h, None
        h, _ = jax.lax.scan(body, h, params["layers"])
        new_cache = None
    else:
        new_lengths = jnp.maximum(
            cache.lengths, jnp.max(jnp.where(mask, positions + 1, 0), axis=1)).astype(jnp.int32)

        def body(h, xs):
            layer, ck, cv = xs
            h, (ck, cv) = _layer(h, layer, (ck, cv), config=config, contract=contract,
                                 positions=positions, mask=mask, cache_lengths=new_lengths)
            return h, (ck, cv)
        h, (ks, vs) = jax.lax.scan(body, h, (params["layers"], cache.k, cache.v))
        new_cache = KVCache(ks, vs, new_lengths)

    h = kernels.rms_norm(h, params["final_norm"], eps=config.rms_norm_eps, contract=contract)
    return h, new_cache


def logits_from_hidden(params: Params, hidden: jax.Array, *, contract: NumericalContract):
    """hidden [..., D] -> logits [..., V] in float32 (matmul kernel, float32 output)."""
    if "lm_head" in params:
        logits = kernels.matmul(hidden, params["lm_head"], contract=contract)
    else:
        # Tied: the [V, D] embedding read in place (no transposed copy of it per call).
        logits = kernels.matmul(hidden, params["embed"], contract=contract, transpose_w=True)
    return logits.astype(jnp.float32)


def forward_logits(params: Params, config: ModelConfig, tokens: jax.Array, *,
                   contract: NumericalContract, mask: jax.Array | None = None,
                   positions: jax.Array | None = None) -> jax.Array:
    """Full-sequence logits for a right-padded batch. tokens [B, T] -> [B, T, V] float32."""
    hidden, _ = forward_hidden(params, config, tokens, contract=contract, positions=positions,
                               mask=mask)
    return logits_from_hidden(params, hidden, contract=contract)


def sequence_logprobs(params: Params, config: ModelConfig, tokens: jax.Array, *,
                      contract: NumericalContract, mask: jax.Array | None = None,
                      temperature: float = 1.0, logit_floor: jax.Array | None = None):
    """Per-token logprob and entropy of each next token, as the train step computes them.

    tokens [B, T], mask [B, T]. Returns (logp [B, T], entropy [B, T]) float32 where logp[:, t] is
    log pi(tokens[:, t] | tokens[:, :t]) for t >= 1 (logp[:, 0] = 0: nothing predicts the first
    token). logit_floor [B, T] replays the sampler's top-k/top-p truncation for token t.
    """
    logits = forward_logits(params, config, tokens, contract=contract, mask=mask)
    batch, seq = tokens.shape
    floor = None if logit_floor is None else logit_floor[:, 1:]
    logp, entropy = kernels.token_logprobs(logits[:, :-1], tokens[:, 1:], contract=contract,
                                           temperature=temperature, logit_floor=floor)
    zero = jnp.zeros((batch, 1), jnp.float32)
    return jnp.concatenate([zero, logp], axis=1), jnp.concatenate([zero, entropy], axis=1)


# ---------------------------------------------------------------------------------------------
# A loaded model


@functools.partial(jax.jit, static_argnames=("config", "contract"))
def _jitted_logits(params, tokens, mask, *, config, contract):
    return forward_logits(params, config, tokens, contract=contract, mask=mask)


@dataclasses.dataclass
class Model:
    """A config, its params and the numerical contract; calling it gives logits.

    model(tokens [B, T], mask=None | lengths=None) -> logits [B, T, V] float32 (right padding).
    """

    config: ModelConfig
    params: Params
    contract: NumericalContract = dataclasses.field(default_factory=NumericalContract)
    tokenizer: Any = None

    def __call__(self, tokens, mask=None, lengths=None) -> jax.Array:
        tokens = jnp.asarray(tokens, jnp.int32)
        if mask is not None and lengths is not None:
            raise ValueError("Model(...): pass either mask or lengths, not both")
        if lengths is not None:
            mask = jnp.arange(tokens.shape[1])[None, :] < jnp.asarray(lengths)[:, None]
        if mask is None:
            mask = jnp.ones(tokens.shape, bool)
        return _jitted_logits(self.params, tokens, jnp.asarray(mask, bool), config=self.config,
                              contract=self.contract)

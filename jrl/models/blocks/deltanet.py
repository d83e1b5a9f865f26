"""Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464), Qwen3.5's linear-attention mixer.

    [q, k, v] = silu(causal_depthwise_conv(x W_qkv))      conv width K, no bias
    g = -exp(A_log) * softplus(x W_a + dt_bias)            float32, log decay per value head
    beta = sigmoid(x W_b)                                  float32
    o = gated_delta_rule(q, k, v, g, beta)                 jrl.kernels (q, k L2-normalised there)
    out = (rms_norm(o) * w_norm * silu(x W_z)) W_out       the gated norm: plain w, no offset

One canonical computation for every stage: the delta rule runs in chunks of C =
contract.delta_chunk positions aligned at position 0 (see jrl.kernels.gated_delta_rule). The
per-slot cache holds what a later call needs to continue exactly where the full-sequence
forward would be:
- conv [K-1, conv_size]: the last K-1 conv inputs (zeros before position 0);
- state [Hv, dk, dv] float32: the recurrent state at the start of the current chunk;
- q, k [C, Hk, dk], v [C, Hv, dv], g, beta [C, Hv]: the kernel inputs of the current chunk's
  positions so far (rows past them are zero).
A cached call with new tokens at positions n .. n+m-1 rebuilds the current chunk from the
buffer, appends its tokens and runs the same chunk formula from the chunk-start state, so a
token's output has the bits of the full forward at any batch layout. A row whose first token
sits at position 0 starts over (the cache is ignored: prefill, and the KV refresh after a weight
swap recomputing from the history); a row with no real token keeps its cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig

_F32 = jnp.float32


def param_shapes(config: ModelConfig, n: int) -> dict:
    """Shapes of a stack of n Gated DeltaNet mixers (weights [in, out]; conv [K, channels])."""
    d, hv = config.hidden_size, config.linear_num_value_heads
    return {"attn_norm": (n, d),
            "w_qkv": (n, d, config.conv_size),
            "conv": (n, config.linear_conv_kernel_dim, config.conv_size),
            "w_z": (n, d, config.linear_value_size),
            "w_a": (n, d, hv),
            "w_b": (n, d, hv),
            "dt_bias": (n, hv),
            "A_log": (n, hv),
            "delta_norm": (n, config.linear_value_head_dim),
            "w_out": (n, config.linear_value_size, d)}


def cache_shapes(config: ModelConfig, n: int, batch: int, capacity: int,
                 contract: NumericalContract) -> dict:
    """(shape, dtype) of a stack's cache (see the module docstring); independent of capacity."""
    del capacity
    chunk, c = contract.delta_chunk, contract.compute
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    return {"conv": ((n, batch, config.linear_conv_kernel_dim - 1, config.conv_size), c),
            "state": ((n, batch, hv, dk, dv), _F32),
            "q": ((n, batch, chunk, hk, dk), c), "k": ((n, batch, chunk, hk, dk), c),
            "v": ((n, batch, chunk, hv, dv), c),
            "g": ((n, batch, chunk, hv), _F32), "beta": ((n, batch, chunk, hv), _F32)}


def causal_conv(window: jax.Array, weight: jax.Array, dtype) -> jax.Array:
    """silu of the depthwise causal conv. window [B, K-1+T, D] (the K-1 inputs before the first
    output, then the T inputs), weight [K, D] -> [B, T, D] in dtype.

    out[t] = silu(sum_{j=0}^{K-1} w[j] * window[t + j]), products and sum in float32 in that
    order (one rounding at the end): elementwise arithmetic, so a position's bits do not depend
    on T.
    """
    width = weight.shape[0]
    steps = window.shape[1] - (width - 1)
    w = weight.astype(_F32)
    acc = w[0] * window[:, 0:steps].astype(_F32)
    for j in range(1, width):
        acc = acc + w[j] * window[:, j:j + steps].astype(_F32)
    return jax.nn.silu(acc).astype(dtype)


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...], index [B, W] int (clipped into range) -> x[b, index[b, w]] [B, W, ...]."""
    index = jnp.clip(index, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def forward(x: jax.Array, layer: dict, cache: dict | None, *, config: ModelConfig,
            contract: NumericalContract, positions: jax.Array, mask: jax.Array,
            lengths: jax.Array | None) -> tuple[jax.Array, dict | None]:
    """x [B, T, D] (normed) -> (out [B, T, D] compute dtype, new cache or None).

    The real tokens of a row are its first m_b = sum(mask[b]) entries (right padding), at
    positions start_b .. start_b + m_b - 1 with start_b = positions[b, 0]. With a cache, start_b
    must be the number of positions the row's cache holds (or 0: start over). `lengths` is
    unused (the attention layers' bound).
    """
    del lengths
    batch, seq, _ = x.shape
    compute, chunk = contract.compute, contract.delta_chunk
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    width = config.linear_conv_kernel_dim
    count = jnp.sum(mask, axis=1).astype(jnp.int32)                                   # [B]
    start = positions[:, 0].astype(jnp.int32)
    fresh = (start == 0) if cache is not None else jnp.ones((batch,), bool)

    mixed = kernels.matmul(x, layer["w_qkv"], contract=contract)                      # [B,T,C]
    mixed = jnp.where(mask[..., None], mixed, 0)
    z = kernels.matmul(x, layer["w_z"], contract=contract)
    a = kernels.matmul(x, layer["w_a"], contract=contract)
    b = kernels.matmul(x, layer["w_b"], contract=contract)

    # The causal conv over [the K-1 inputs before this call, this call's inputs].
    history = jnp.zeros((batch, width - 1, mixed.shape[-1]), compute)
    if cache is not None:
        history = jnp.where(fresh[:, None, None], history, cache["conv"].astype(compute))
    window = jnp.concatenate([history, mixed.astype(compute)], axis=1)
    qkv = causal_conv(window, layer["conv"], compute)                                 # [B,T,C]
    ks = config.linear_key_size
    q = qkv[..., :ks].reshape(batch, seq, hk, dk)
    k = qkv[..., ks:2 * ks].reshape(batch, seq, hk, dk)
    v = qkv[..., 2 * ks:].reshape(batch, seq, hv, dv)
    g = -jnp.exp(layer["A_log"].astype(_F32)) * jax.nn.softplus(
        a.astype(_F32) + layer["dt_bias"].astype(_F32))
    beta = jax.nn.sigmoid(b.astype(_F32))

    # The kernel's input: chunks aligned at position 0. A row continues its current chunk at
    # offset = start % C (rows 0 .. offset-1 from the buffer), then its m new tokens.
    offset = jnp.where(fresh, 0, start % chunk) if cache is not None else jnp.zeros_like(start)
    span = seq if cache is None else chunk - 1 + seq
    total = -(-span // chunk) * chunk
    rows = jnp.arange(total, dtype=jnp.int32)[None, :]                                # [1, W]
    new_index = rows - offset[:, None]
    is_new = (new_index >= 0) & (new_index < count[:, None])
    valid = (rows < (offset + count)[:, None])

    def assemble(new, buffered):
        taken = _gather_rows(new, new_index)
        if buffered is None:
            return jnp.where(is_new.reshape(is_new.shape + (1,) * (new.ndim - 2)), taken, 0)
        pad = jnp.zeros((batch, total - chunk) + buffered.shape[2:], buffered.dtype)
        old = jnp.concatenate([buffered, pad], axis=1).astype(new.dtype)
        keep = is_new.reshape(is_new.shape + (1,) * (new.ndim - 2))
        in_buffer = (rows < offset[:, None]).reshape(keep.shape)
        return jnp.where(keep, taken, jnp.where(in_buffer, old, 0))

    buffer = (lambda name: None) if cache is None else (lambda name: cache[name])
    win_q, win_k, win_v = (assemble(t, buffer(n)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    win_g, win_beta = assemble(g, buffer("g")), assemble(beta, buffer("beta"))
    initial = jnp.zeros((batch, hv, dk, dv), _F32)
    if cache is not None:
        initial = jnp.where(fresh[:, None, None, None], initial, cache["state"])
    end = offset + count                                                   # window rows filled
    result = kernels.gated_delta_rule(win_q, win_k, win_v, win_g, win_beta, valid=valid,
                                      initial_state=initial, state_chunk=end // chunk,
                                      contract=contract)
    o = _gather_rows(result.out, offset[:, None] + jnp.arange(seq, dtype=jnp.int32)[None])

    # The gated RMSNorm (plain weight), then the output projection.
    normed = kernels.rms_norm(o, layer["delta_norm"], eps=config.rms_norm_eps,
                              contract=contract)
    gated = (normed.astype(_F32) * jax.nn.silu(
        z.reshape(batch, seq, hv, dv).astype(_F32))).astype(compute)
    out = kernels.matmul(gated.reshape(batch, seq, config.linear_value_size), layer["w_out"],
                         contract=contract)
    if cache is None:
        return out, None

    # New cache: the current chunk's rows, its start state, the last K-1 conv inputs.
    base = (end // chunk) * chunk
    chunk_rows = base[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]              # [B, C]
    filled = chunk_rows < end[:, None]

    def current(window_array):
        taken = _gather_rows(window_array, chunk_rows)
        return jnp.where(filled.reshape(filled.shape + (1,) * (taken.ndim - 2)), taken, 0)

    conv_rows = count[:, None] + jnp.arange(width - 1, dtype=jnp.int32)[None]          # [B, K-1]
    new_cache = {"conv": _gather_rows(window, conv_rows).astype(cache["conv"].dtype),
                 "state": result.state,
                 "q": current(win_q).astype(cache["q"].dtype),
                 "k": current(win_k).astype(cache["k"].dtype),
                 "v": current(win_v).astype(cache["v"].dtype),
                 "g": current(win_g), "beta": current(win_beta)}
    untouched = count == 0
    new_cache = jax.tree.map(
        lambda new, old: jnp.where(untouched.reshape((batch,) + (1,) * (new.ndim - 1)), old,
                                   new), new_cache, cache)
    return out, new_cache

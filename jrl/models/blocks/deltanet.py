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

import functools

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.kernels.rowwise import rowwise, silu_gate
from jrl.models.config import ModelConfig
from jrl.models.lora import project_all, project_rows

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


def _token_math(taps, a, b, weights, a_log, dt_bias):
    """One token's pointwise inputs of the delta rule, float32 in, float32 out.

    taps: K arrays [.., C], the conv inputs t-K+1 .. t; weights: K arrays [C] (the conv weight's
    rows); a, b [.., Hv]; a_log, dt_bias [Hv]. qkv = silu(sum_j w[j] * taps[j]) (products
    summed in j order); g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b)."""
    acc = weights[0] * taps[0]
    for w, tap in zip(weights[1:], taps[1:]):
        acc = acc + w * tap
    g = -jnp.exp(a_log) * jax.nn.softplus(a + dt_bias)
    return jax.nn.silu(acc), g, jax.nn.sigmoid(b)


def _token_math_stacked(taps, a, b, weight, a_log, dt_bias):
    """_token_math with taps [.., K, C] and weight [K, C] stacked."""
    width = weight.shape[0]
    return _token_math([taps[..., j, :] for j in range(width)], a, b,
                       [weight[j] for j in range(width)], a_log, dt_bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def token_inputs(contract: NumericalContract, taps, a, b, weight, a_log, dt_bias):
    """_token_math in fixed row tiles (jrl.kernels.rowwise: a token's bits do not depend on the
    program, e.g. decode vs train). taps [N, K, C], a, b [N, Hv] -> (qkv [N, C] compute dtype,
    g [N, Hv] float32, beta [N, Hv] float32). Differentiable (the backward differentiates
    _token_math in XLA)."""
    channels, heads = taps.shape[-1], a.shape[-1]
    out = [((channels,), contract.compute), ((heads,), _F32), ((heads,), _F32)]
    if contract.backend != "pallas" or contract.resolved_platform() != "gpu":
        # One stacked tile: split into per-tap arrays, the CPU's interpreted kernel rounded the
        # conv differently in decode and train programs (XLA fused the slices differently).
        return tuple(rowwise(_token_math_stacked, rows=(taps, a, b),
                             shared=(weight, a_log, dt_bias), out=out, contract=contract,
                             name="jrl_deltanet_inputs"))
    # Triton cannot slice a value inside a kernel: the taps and weight rows enter separately.
    width = weight.shape[0]

    def math(*tiles):
        taps, (a, b), weights, (a_log, dt_bias) = (tiles[:width], tiles[width:width + 2],
                                                    tiles[width + 2:-2], tiles[-2:])
        return _token_math(taps, a, b, weights, a_log, dt_bias)

    return tuple(rowwise(
        math, rows=(*(taps[:, j] for j in range(width)), a, b),
        shared=(*(weight[j] for j in range(width)), a_log, dt_bias),
        out=out, contract=contract, name="jrl_deltanet_inputs"))


def _token_inputs_fwd(contract, taps, a, b, weight, a_log, dt_bias):
    return token_inputs(contract, taps, a, b, weight, a_log, dt_bias), (taps, a, b, weight,
                                                                        a_log, dt_bias)


def _token_inputs_bwd(contract, residuals, cotangents):
    def reference(*args):
        qkv, g, beta = _token_math_stacked(*(x.astype(_F32) for x in args))
        return qkv.astype(contract.compute), g, beta
    _, vjp = jax.vjp(reference, *residuals)
    return vjp(cotangents)


token_inputs.defvjp(_token_inputs_fwd, _token_inputs_bwd)


def _gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, T, ...], index [B, W] int (clipped into range) -> x[b, index[b, w]] [B, W, ...]."""
    index = jnp.clip(index, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def forward(x: jax.Array, layer: dict, cache: dict | None, *, config: ModelConfig,
            contract: NumericalContract, positions: jax.Array, mask: jax.Array,
            lengths: jax.Array | None, pending: bool = False,
            input_norm: tuple[jax.Array, float] | None = None,
            tensor_axis: str | None = None) -> tuple[jax.Array, dict | None]:
    """x [B, T, D] (normed, or normed by the input projections' kernel when norm = (scale, eps)
    is given) -> (out [B, T, D] compute dtype, new cache or None).

    Without a cache (the train forward) a row's real tokens are its first sum(mask[b]) entries
    (right padding), from position 0. With one, they are one contiguous run of entries (the
    sampler's KV refresh and tests may mask a prefix), at positions start_b .. start_b + m_b - 1
    where start_b is the first real entry's position: the row's cached length, or 0 to start
    over. `lengths` is unused (the attention layers' bound).

    pending (with a cache; T <= contract.delta_chunk): instead of the new cache, return what
    `settle` needs to build the cache of any leading part of the fed tokens (a speculative
    verify pass keeps only its accepted drafts).

    tensor_axis: tensor parallelism inside shard_map (jrl.parallel.tensor): config counts this
    device's key and value heads; w_qkv and conv hold its [q | k | v] head columns (the
    per-device blocks of tensor.tensor_parallel_params), w_z its value heads' columns, w_out
    their rows (reduced across the axis by lora.project_rows); w_a, w_b, dt_bias and A_log are
    whole (all heads), and each device takes its own heads of a, b, dt_bias and A_log.
    """
    del lengths
    batch, seq, _ = x.shape
    if pending and cache is None:
        raise ValueError("deltanet.forward(pending=True) needs a cache")
    if pending and seq > contract.delta_chunk:
        raise ValueError(f"deltanet.forward(pending=True) needs T <= contract.delta_chunk "
                         f"({contract.delta_chunk}), got T={seq}")
    count = jnp.sum(mask, axis=1).astype(jnp.int32)                                   # [B]
    if cache is None:
        return _forward_run(x, layer, None, config=config, contract=contract,
                            start=jnp.zeros((batch,), jnp.int32), count=count, input_norm=input_norm,
                            tensor_axis=tensor_axis)
    # Align each row's run of real tokens to entry 0 (rows are independent: a gather changes
    # no bit), run, and put the outputs back at their entries.
    first = jnp.argmax(mask, axis=1).astype(jnp.int32)
    entries = jnp.arange(seq, dtype=jnp.int32)[None, :]
    aligned = _gather_rows(x, first[:, None] + entries)
    start = jnp.take_along_axis(positions.astype(jnp.int32), first[:, None], axis=1)[:, 0]
    out, new_cache = _forward_run(aligned, layer, cache, config=config, contract=contract,
                                  start=start, count=count, pending=pending, input_norm=input_norm,
                                  tensor_axis=tensor_axis)
    return _gather_rows(out, entries - first[:, None]), new_cache


def _forward_run(x: jax.Array, layer: dict, cache: dict | None, *, config: ModelConfig,
                 contract: NumericalContract, start: jax.Array, count: jax.Array,
                 pending: bool = False, input_norm: tuple[jax.Array, float] | None = None,
                 tensor_axis: str | None = None) -> tuple[jax.Array, dict | None]:
    """forward() on rows whose count [B] real tokens are entries 0 .. count-1, at positions
    start [B] onwards."""
    batch, seq, _ = x.shape
    mask = jnp.arange(seq, dtype=jnp.int32)[None, :] < count[:, None]
    compute, chunk = contract.compute, contract.delta_chunk
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    width = config.linear_conv_kernel_dim
    fresh = (start == 0) if cache is not None else jnp.ones((batch,), bool)

    mixed, z, a, b = project_all(x, layer, ("w_qkv", "w_z", "w_a", "w_b"), config=config,
                                 contract=contract, norm=input_norm)                  # mixed [B,T,C]
    mixed = jnp.where(mask[..., None], mixed, 0)
    a_log, dt_bias = layer["A_log"], layer["dt_bias"]
    if tensor_axis is not None:
        # w_a and w_b stay whole: a device's share of their few columns would be a narrower dot
        # (other bits on the CPU). Each device keeps its hv value heads of a, b and the decays.
        first = jax.lax.axis_index(tensor_axis) * hv
        a, b, a_log, dt_bias = (jax.lax.dynamic_slice_in_dim(heads, first, hv, axis=-1)
                                for heads in (a, b, a_log, dt_bias))

    # The causal conv over [the K-1 inputs before this call, this call's inputs]: each token's
    # K taps gathered (exact), then conv + silu, g and beta in fixed row tiles.
    history = jnp.zeros((batch, width - 1, mixed.shape[-1]), compute)
    if cache is not None:
        history = jnp.where(fresh[:, None, None], history, cache["conv"].astype(compute))
    window = jnp.concatenate([history, mixed.astype(compute)], axis=1)
    taps = jnp.stack([window[:, j:j + seq] for j in range(width)], axis=2)         # [B,T,K,C]
    channels = mixed.shape[-1]
    qkv, g, beta = token_inputs(contract, taps.reshape(batch * seq, width, channels),
                                a.reshape(batch * seq, hv), b.reshape(batch * seq, hv),
                                layer["conv"], a_log, dt_bias)
    qkv, g, beta = (qkv.reshape(batch, seq, channels), g.reshape(batch, seq, hv),
                    beta.reshape(batch, seq, hv))
    ks = config.linear_key_size
    q = qkv[..., :ks].reshape(batch, seq, hk, dk)
    k = qkv[..., ks:2 * ks].reshape(batch, seq, hk, dk)
    v = qkv[..., 2 * ks:].reshape(batch, seq, hv, dv)

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
    gated = silu_gate(contract, compute, normed, z.reshape(batch, seq, hv, dv))
    out = project_rows(gated.reshape(batch, seq, config.linear_value_size), layer, "w_out",
                       config=config, contract=contract, tensor_axis=tensor_axis)
    if cache is None:
        return out, None
    fed = {"window": window, "q": win_q, "k": win_k, "v": win_v, "g": win_g,
           "beta": win_beta, "initial": initial, "state": result.state, "offset": offset,
           "count": count}
    return out, (fed if pending else settle(fed, cache, count))


def settle(fed: dict, cache: dict, keep: jax.Array) -> dict:
    """The cache a cached call leaves when only the first keep [B] of its real tokens are fed.

    fed: forward(..., pending=True)'s record of the call: the chunk window W [B, C or 2C, ..]
    of buffered and new kernel inputs, the conv inputs [B, K-1+T, channels], the states at the
    start of the window and at the start of the chunk holding the call's end, offset and count
    [B]. cache: the cache the call started from. keep = count gives forward()'s own cache.
    Every kept token's inputs in W are the ones a call feeding only the kept tokens computes
    (rows and tokens are independent), and the window spans at most two chunks (T <= C), so
    the state at the start of the kept end's chunk is the call's (same chunk) or the window's
    initial one: the result equals that shorter call's cache bit for bit, with no second
    forward."""
    chunk, taps = cache["q"].shape[1], cache["conv"].shape[1]
    keep = jnp.minimum(keep, fed["count"]).astype(jnp.int32)
    batch = keep.shape[0]
    end = fed["offset"] + keep                                             # window rows kept
    same_chunk = (end // chunk) == ((fed["offset"] + fed["count"]) // chunk)
    state = jnp.where(same_chunk[:, None, None, None], fed["state"], fed["initial"])
    base = (end // chunk) * chunk
    chunk_rows = base[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None]              # [B, C]
    filled = chunk_rows < end[:, None]

    def current(window_array):
        taken = _gather_rows(window_array, chunk_rows)
        return jnp.where(filled.reshape(filled.shape + (1,) * (taken.ndim - 2)), taken, 0)

    conv_rows = keep[:, None] + jnp.arange(taps, dtype=jnp.int32)[None]                # [B, K-1]
    new_cache = {"conv": _gather_rows(fed["window"], conv_rows).astype(cache["conv"].dtype),
                 "state": state,
                 "q": current(fed["q"]).astype(cache["q"].dtype),
                 "k": current(fed["k"]).astype(cache["k"].dtype),
                 "v": current(fed["v"]).astype(cache["v"].dtype),
                 "g": current(fed["g"]), "beta": current(fed["beta"])}
    untouched = keep == 0
    return jax.tree.map(
        lambda new, old: jnp.where(untouched.reshape((batch,) + (1,) * (new.ndim - 1)), old,
                                   new), new_cache, cache)

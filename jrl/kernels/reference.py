"""Plain-XLA implementations of every kernel: the correctness reference and the `xla` backend.

These are fast and differentiable by jax.grad, but NOT batch-invariant: XLA picks dot and
reduction strategies by shape, so a row's bits can depend on how many rows share its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity" for masked scores: exp(MASKED - m) is exactly 0 and no inf - inf NaN.
MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)


def matmul(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """y = x @ w with float32 accumulation. x [..., K], w [K, N] -> [..., N] in out_dtype."""
    out_dtype = out_dtype or x.dtype
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def attention_mask(q_positions, kv_positions, kv_valid):
    """allowed[b, i, j] = kv_valid[b, j] and kv_positions[b, j] <= q_positions[b, i]. [B,Tq,Tk]."""
    return kv_valid[:, None, :] & (kv_positions[:, None, :] <= q_positions[:, :, None])


def attention(q, k, v, *, q_positions, kv_positions, kv_valid, scale=None):
    """Causal softmax attention with explicit positions, GQA.

    q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] (Hq a multiple of Hkv), q_positions [B, Tq] int,
    kv_positions [B, Tk] int, kv_valid [B, Tk] bool. Key j is visible to query i when
    kv_valid[j] and kv_positions[j] <= q_positions[i]. softmax(q k^T * scale) v in float32;
    a query with no visible key returns 0. Returns [B, Tq, Hq, D] in q.dtype.
    """
    batch, tq, hq, dim = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    scale = dim ** -0.5 if scale is None else scale
    qg = q.reshape(batch, tq, hkv, group, dim)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    allowed = attention_mask(q_positions, kv_positions, kv_valid)[:, None, None]
    s = jnp.where(allowed, s, MASKED)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(allowed, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    # An explicit reciprocal: XLA rewrites x / d as x * (1 / d) in some programs and not in
    # others, which would make the recomputed backward depend on the surrounding program.
    p = p * (1.0 / jnp.where(denom == 0, 1.0, denom))
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32))
    return o.reshape(batch, tq, hq, dim).astype(q.dtype)


def rms_norm(x, scale, *, eps):
    """y = x / sqrt(mean(x^2, -1) + eps) * scale, computed in float32. x [..., D], scale [D]."""
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * scale.astype(jnp.float32)).astype(x.dtype)


def inverse_temperature(temperature: float) -> "jnp.float32":
    """1 / temperature rounded once to float32. Every stage scales logits as z = logits * this:
    a single IEEE multiply, which no backend rewrites (a division x / T may become x * (1 / T)
    in some compiled programs and not in others)."""
    return jnp.float32(1.0 / float(temperature))


def token_logprobs(logits, targets, *, temperature=1.0, logit_floor=None):
    """Per-token logprob and entropy of the (optionally truncated) tempered distribution.

    logits [..., V], targets [...] int. z = logits * inverse_temperature(temperature) in float32
    (see inverse_temperature). With logit_floor
    [...] (top-k / top-p replay), only entries with z >= floor are kept; the distribution is
    softmax over kept entries. Returns (logp [...], entropy [...]) in float32, where
    logp = z[target] - logsumexp(z[kept]) and entropy = -sum_kept p log p.
    """
    z = logits.astype(jnp.float32) * inverse_temperature(temperature)
    if logit_floor is not None:
        kept = z >= logit_floor[..., None].astype(jnp.float32)
    else:
        kept = jnp.ones(z.shape, bool)
    zk = jnp.where(kept, z, MASKED)
    m = jnp.max(zk, axis=-1, keepdims=True)
    e = jnp.where(kept, jnp.exp(zk - m), 0.0)
    sum_e = jnp.sum(e, axis=-1, keepdims=True)
    lse = m + jnp.log(sum_e)
    target_z = jnp.take_along_axis(z, targets[..., None].astype(jnp.int32), axis=-1)
    logp = (target_z - lse)[..., 0]
    p = e * (1.0 / sum_e)   # explicit reciprocal, as in attention
    entropy = (lse[..., 0] - jnp.sum(p * jnp.where(kept, z, 0.0), axis=-1))
    return logp, entropy

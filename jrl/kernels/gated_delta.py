"""TEMPORARY plain-jnp stand-in for the Gated DeltaNet kernel (replaced by the Pallas kernel
branch at merge); same API: gated_delta_rule(q, k, v, g, beta, *, valid, initial_state,
state_chunk, contract) -> GatedDeltaOut(out, state)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class GatedDeltaOut(NamedTuple):
    out: jax.Array
    state: jax.Array


def _l2(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def gated_delta_rule(q, k, v, g, beta, *, valid, initial_state, state_chunk, contract):
    C = contract.delta_chunk
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    if T % C:
        raise ValueError(f"gated_delta_rule: T={T} must be a multiple of delta_chunk={C}")
    rep = Hv // Hk
    f32 = jnp.float32
    vm = valid[..., None, None]
    q = jnp.repeat(_l2(q.astype(f32)), rep, axis=2) * (dk ** -0.5)
    k = jnp.where(vm, jnp.repeat(_l2(k.astype(f32)), rep, axis=2), 0.0)
    v = jnp.where(vm, v.astype(f32), 0.0)
    g = jnp.where(valid[..., None], g.astype(f32), 0.0)
    beta = jnp.where(valid[..., None], beta.astype(f32), 0.0)
    n = T // C
    # [B, n, C, H, d] -> [n, B, H, C, d]
    def chunks(x):
        return x.reshape(B, n, C, *x.shape[2:]).swapaxes(0, 1)
    qc, kc, vc, gc, bc = map(chunks, (q, k, v, g, beta))
    qc, kc, vc = (x.transpose(0, 1, 3, 2, 4) for x in (qc, kc, vc))
    gc, bc = (x.transpose(0, 1, 3, 2) for x in (gc, bc))
    tril = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    def step(S, xs):
        qq, kk, vv, gg, bb = xs
        G = jnp.cumsum(gg, axis=-1)
        diff = G[..., :, None] - G[..., None, :]
        D = jnp.where(tril, jnp.exp(jnp.where(tril, diff, 0.0)), 0.0)
        kb = kk * bb[..., None]
        A = jnp.where(strict, jnp.einsum("bhid,bhjd->bhij", kb, kk) * D, 0.0)
        Tinv = jnp.linalg.inv(jnp.eye(C) + A)
        U = Tinv @ (vv * bb[..., None])
        W = Tinv @ (kb * jnp.exp(G)[..., None])
        Vn = U - W @ S
        att = jnp.where(tril, jnp.einsum("bhid,bhjd->bhij", qq, kk) * D, 0.0)
        o = (qq * jnp.exp(G)[..., None]) @ S + att @ Vn
        Gl = G[..., -1:]
        S2 = S * jnp.exp(Gl)[..., None] + jnp.einsum(
            "bhcd,bhce->bhde", kk * jnp.exp(Gl - G)[..., None], Vn)
        return S2, (o, S)

    S_final, (o, starts) = jax.lax.scan(step, initial_state.astype(f32), (qc, kc, vc, gc, bc))
    starts = jnp.concatenate([starts, S_final[None]], axis=0)   # [n + 1, B, H, dk, dv]
    state = starts[state_chunk, jnp.arange(B)]
    out = o.transpose(1, 0, 3, 2, 4).reshape(B, T, Hv, dv)
    out = jnp.where(valid[..., None, None], out, 0.0).astype(contract.compute)
    return GatedDeltaOut(out, state)

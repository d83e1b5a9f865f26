"""Mixture-of-experts auxiliary load-balancing loss (Switch Transformer, Fedus et al. 2021,
arXiv:2101.03961; the form transformers' Qwen3-MoE / Qwen3.5-MoE load_balancing_loss_func
computes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.losses._utils import Array, as_mask, f32


def load_balance_loss(router_probs: Array, experts: Array, mask: Array) -> Array:
    """E * sum_e f_e * P_e over every (token, MoE layer) pair, layers pooled as transformers does.

        f_e = sum_{t, l, j} m_t [experts_{t,l,j} = e] / (L * sum_t m_t)   (stop-gradient)
        P_e = sum_{t, l} m_t p_{t,l,e} / (L * sum_t m_t)                (carries gradient)

    router_probs [B, T, L, E] float32 (the router's softmax); experts [B, T, L, k] int (the
    router's top-k); mask [B, T] (the tokens that count, e.g. the attention mask). Perfectly
    balanced routing (f_e = k / E, P_e = 1 / E) gives k; everything on k experts gives up to E.
    Only P carries gradient (f is a count), which pushes probability mass away from overloaded
    experts. 0 when the mask is empty.
    """
    if router_probs.ndim != 4 or experts.shape[:3] != router_probs.shape[:3] or \
            mask.shape != router_probs.shape[:2]:
        raise ValueError(f"load_balance_loss: expected router_probs [B, T, L, E], experts "
                         f"[B, T, L, k] and mask [B, T], got {router_probs.shape}, "
                         f"{experts.shape}, {mask.shape}")
    num_experts = router_probs.shape[-1]
    m = f32(as_mask(mask))[:, :, None]                                   # [B, T, 1]
    pairs = jnp.maximum(jnp.sum(m) * router_probs.shape[2], 1.0)
    counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=3)
    f = jax.lax.stop_gradient(jnp.sum(counts * m[..., None], axis=(0, 1, 2)) / pairs)   # [E]
    p = jnp.sum(f32(router_probs) * m[..., None], axis=(0, 1, 2)) / pairs               # [E]
    return num_experts * jnp.sum(f * p)

"""Top-k / top-p truncation expressed as a per-token logit floor.

The sampler computes `floor` from its logits and records it with every token; the distribution
sampled from is softmax over {v : z_v >= floor}. The trainer does not recompute the truncation
(that would need a sort and a cumulative sum whose bits could drift); it replays the recorded
floor through the same token-logprob kernel, so p_b and p_old agree bitwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NO_FLOOR = -jnp.inf


def logit_floor(z: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Threshold of the kept set. z [N, V] tempered logits (float32) -> floor [N] float32.

    top_k: floor = k-th largest z. top_p: sort descending, p = softmax(z); keep the shortest
    prefix whose mass reaches top_p (always >= 1 token); floor = z of its last entry. Both given:
    the larger floor (the intersection). Neither: -inf (keep everything).
    """
    z = z.astype(jnp.float32)
    floor = jnp.full(z.shape[:-1], NO_FLOOR, jnp.float32)
    if top_k > 0:
        k = min(top_k, z.shape[-1])
        floor = jnp.maximum(floor, jax.lax.top_k(z, k)[0][..., -1])
    if top_p < 1.0:
        sorted_z = jnp.sort(z, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_z, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Entry i is kept while the mass of the entries before it is below top_p.
        last_kept = jnp.sum(mass_before < top_p, axis=-1) - 1
        floor = jnp.maximum(floor, jnp.take_along_axis(sorted_z, last_kept[..., None], -1)[..., 0])
    return floor


def sample_from_floor(key: jax.Array, z: jax.Array, floor: jax.Array) -> jax.Array:
    """Draw one token from softmax over {z >= floor} by Gumbel-max. key: one key per row [N]."""
    gumbel = jax.vmap(lambda k, row: jax.random.gumbel(k, row.shape, jnp.float32))(key, z)
    scores = jnp.where(z >= floor[:, None], z + gumbel, -jnp.inf)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)

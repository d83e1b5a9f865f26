"""Group-shared prefill: a prompt is prefilled once, into a row of a prefix pool, and every sample
that starts from it copies the row into its slot.

The G samples of a GRPO group share their prompt, and so, exactly, their prompt cache: the
forward of a prompt does not depend on which or how many rows share its batch (batch-invariant
kernels), so one prefill gives every sample the bits its own prefill would have given. A pool
row holds what a slot holds right after its prefill: the attention K/V of the prompt positions
(zeros after them, as a fresh prefill leaves them), Gated DeltaNet's conv state, chunk-start
state and current-chunk inputs, the filled length, and the final hidden state at the prompt's
last position, from which each sample draws its own first token (its own PRNG stream).

    fill(spec, params, pool, rows, prompts, prompt_lens) -> pool      prefill into pool rows
    start(spec, params, state, pool, slots, rows, ...) -> SlotState    seed slots from rows

The host side (which prompt sits in which row, eviction, invalidation on a weight swap) is
`PrefixTable`; jrl.sampling.engine wires both into `Sampler(share_prefill=True)`.

Multi-turn episodes continue in their own slot (`slots.append`), so a re-entry never prefills
again; what a group shares is its prompt, and that is what the pool holds.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.models import transformer
from jrl.sampling.slots import (SlotState, Spec, pick_tokens, prompt_forward, record_rows,
                                route_shape, seat_samples, store_prompt_hidden, token_routes)


class Pool(NamedTuple):
    """R prefilled prompts. cache: a transformer.Cache of batch R and the slots' capacity (the
    same shapes as a slot's cache, so a row is copied as it is); hidden [R, D] in the compute
    dtype: the final-norm hidden state at each prompt's last position; routes [R, P, L_moe, k]
    int32: the prompt's experts per MoE layer, -1 past the prompt (L_moe = 0: dense);
    prompt_hidden [R, P, D] (with an MTP head, Spec.mtp; else None): the hidden state at every
    prompt position, which the head reads to catch up on the prompt."""

    cache: transformer.Cache
    hidden: jax.Array
    routes: jax.Array
    prompt_hidden: jax.Array | None = None


def init_pool(spec: Spec, rows: int) -> Pool:
    cache = transformer.init_cache(spec.config, rows, spec.capacity, spec.contract)
    d = spec.config.hidden_size
    return Pool(cache, jnp.zeros((rows, d), spec.contract.compute),
                jnp.full(route_shape(spec, rows, spec.max_prompt_len), -1, jnp.int32),
                jnp.zeros((rows, spec.max_prompt_len, d), spec.contract.compute)
                if spec.mtp else None)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def fill(spec: Spec, params, pool: Pool, rows, prompts, prompt_lens) -> Pool:
    """Prefill u prompts into pool rows `rows` [u] (entries == R are padding: dropped).

    prompts [u, P] (right-padded to max_prompt_len), prompt_lens [u]. The same forward as
    slots.prefill (a fresh zero cache of the slots' capacity, the same positions and mask), so a
    row holds the bits a slot's own prefill would hold.
    """
    out, mask, last_hidden = prompt_forward(spec, params, prompts, prompt_lens,
                                            rows < pool.hidden.shape[0])
    prompt_hidden = pool.prompt_hidden
    if prompt_hidden is not None:
        prompt_hidden = prompt_hidden.at[rows].set(out.hidden.astype(prompt_hidden.dtype),
                                                   mode="drop")
    return Pool(transformer.scatter_rows(pool.cache, rows, out.cache),
                pool.hidden.at[rows].set(last_hidden.astype(pool.hidden.dtype), mode="drop"),
                pool.routes.at[rows].set(token_routes(spec, out, mask), mode="drop"),
                prompt_hidden)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def start(spec: Spec, params, state: SlotState, pool: Pool, slots, rows, prompts, prompt_lens,
          prompt_ids, sample_indices, limits, version, seed) -> SlotState:
    """Start k samples in `slots` [k] from pool rows `rows` [k] and draw each one's first token.

    slots [k] (entries == num_slots are padding: their writes are dropped); rows [k] the pool
    row holding each sample's prompt; prompts [k, P], prompt_lens, prompt_ids, sample_indices,
    limits [k] as for slots.prefill, whose slot state this reproduces bit for bit: the cache
    row is the one prefill would have scattered, and the first token is drawn from the same
    hidden state with the sample's own key (seed, prompt_id, sample_index, 0).
    """
    num = slots.shape[0]
    gather = jnp.where(rows < pool.hidden.shape[0], rows, 0)
    cache = transformer.scatter_rows(state.cache, slots,
                                     transformer.select_rows(pool.cache, gather))
    pick = pick_tokens(spec, params, pool.hidden[gather], seed, prompt_ids, sample_indices,
                       jnp.zeros((num,), jnp.int32))
    # As in prefill: the prompt's routes, then -1 (nothing of an old sample survives).
    routes = jnp.pad(pool.routes[gather], ((0, 0), (0, spec.sampling.max_new_tokens),
                                           (0, 0), (0, 0)), constant_values=-1)
    state = seat_samples(spec, state, slots, cache, prompts, prompt_lens, prompt_ids,
                         sample_indices, limits, routes)
    if pool.prompt_hidden is not None:
        state = store_prompt_hidden(spec, state, slots, pool.prompt_hidden[gather], prompt_lens)
    return record_rows(spec, state, slots, pick, version)


class PrefixTable:
    """Host bookkeeping of a pool: which prompt (by its tokens) sits in which row, least
    recently used first. Rows hold the cache of the weights they were filled with, so the
    sampler clears the table at every weight swap."""

    def __init__(self, rows: int):
        self.rows = rows
        self._by_prompt: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.hits = 0
        self.fills = 0

    def clear(self) -> None:
        self._by_prompt.clear()

    def plan(self, prompts: list[np.ndarray]) -> tuple[list[int], list[tuple[int, np.ndarray]]]:
        """Rows for the given prompts (at most `rows` distinct ones): (row of each prompt,
        [(row, tokens) to fill first]). A prompt already in the pool is a hit; a new one takes a
        free row or evicts the least recently used row that none of these prompts needs."""
        keys = [p.tobytes() for p in prompts]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) > self.rows:
            raise ValueError(f"PrefixTable.plan: {len(distinct)} distinct prompts for a pool of "
                             f"{self.rows} rows (the caller splits larger batches)")
        needed = set(distinct)
        to_fill = []
        for key, tokens in zip(keys, prompts):
            if key in self._by_prompt:
                self._by_prompt.move_to_end(key)
                continue
            used = set(self._by_prompt.values())
            free = [r for r in range(self.rows) if r not in used]
            if free:
                row = free[0]
            else:
                victim = next(k for k in self._by_prompt if k not in needed)
                row = self._by_prompt.pop(victim)
            self._by_prompt[key] = row
            to_fill.append((row, tokens))
        self.fills += len(to_fill)
        self.hits += len(keys) - len(to_fill)
        return [self._by_prompt[key] for key in keys], to_fill

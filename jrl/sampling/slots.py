"""The sampler's device side: slot state and the jitted prefill / decode / refresh programs.

Pure functions of (Spec, params, SlotState, ...); `Spec` (model config, numerical contract,
sampling params except the seed, slot shapes) is a static argument, so every Sampler built with an
equal spec reuses the same compiled programs. The host-side scheduler is jrl.sampling.engine.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import mtp, transformer
from jrl.models.config import ModelConfig
from jrl.sampling.params import SamplingParams
from jrl.sampling.speculative_config import fast_path_contract
from jrl.sampling.truncation import logit_floor, sample_from_floor


class SlotState(NamedTuple):
    """Device state of all slots. S slots, M = max_new_tokens, C = capacity.

    routes (MoE models): the experts of every token the slot fed through the model, by position
    like `history`, for each of the L_moe MoE layers in layer order, -1 where no token was fed
    (positions past the sample, and a response's last token, which is never fed). Prefill
    writes the prompt's, decode the token it feeds, append its chunk (the stop token and the
    observation). The routes at position t are those of the forward that produced the next
    model token, so they carry that token's version; a KV refresh on a weight swap leaves them
    as they were (they produced the tokens before the swap).
    Memory: S * C * L_moe * k int32, e.g. 256 slots x 4096 positions x 48 layers x top-8 =
    1.6 GB for Qwen3-30B-A3B, 4 kB for the tiny test models; [S, C, 0, k] (empty) for dense
    models.
    draft_cache (speculative decoding with a draft model, Spec.draft_config set; else None): the
    draft model's cache of the slot's history, valid below its `lengths` [S]. It may lag the
    slot (lengths <= position: a new prompt, an appended observation, a bonus token); the next
    speculative step feeds the missing history first (jrl.sampling.speculative).
    With an MTP head (Spec.mtp) draft_cache is the head's own KV cache (jrl.models.mtp), and
    target_hidden [S, C, D] (compute dtype) holds the target's final-norm hidden state at every
    position the target has fed (prefill, decode, verify, append, refresh write it), from
    which the head catches up on the positions it has not seen; else None. Memory: one
    hidden vector per position, about one attention layer's K/V for Qwen3.5.
    draft_gate (with draft_cache): each slot's record of how its drafts fare, which switches a
    poor draft off for a while (DraftGate).
    """

    cache: transformer.Cache
    last_token: jax.Array      # [S] int32, the token to feed next
    position: jax.Array        # [S] int32, position of last_token
    num_generated: jax.Array   # [S] int32
    limit: jax.Array           # [S] int32, this request's max new tokens (<= M)
    active: jax.Array          # [S] bool, decoding
    stopped: jax.Array         # [S] bool, finished on a stop token
    prompt_id: jax.Array       # [S] int32
    sample_index: jax.Array    # [S] int32
    history: jax.Array         # [S, C] int32, token at each position (prompt, then generated)
    tokens: jax.Array          # [S, M] int32
    logp: jax.Array            # [S, M] float32
    floor: jax.Array           # [S, M] float32
    versions: jax.Array        # [S, M] int32 (-1 at observation tokens)
    entropy: jax.Array         # [S, M] float32
    is_model: jax.Array        # [S, M] bool: drawn by the model (False: an appended observation)
    routes: jax.Array          # [S, C, L_moe, k] int32 (see above)
    draft_cache: transformer.Cache | None = None
    draft_gate: "DraftGate | None" = None
    target_hidden: jax.Array | None = None


class DraftGate(NamedTuple):
    """Per-slot off-switch of a draft model (jrl.sampling.draft_gate.update_draft_gate).

    accepted / drafted: decayed sums of the slot's accepted and verified drafts since its last
    judgement; skip: steps the slot still decodes without drafting; misses: consecutive
    judgements that found the draft poor (the pause doubles with each); clock: decode steps
    the slots have run so far, shared by all of them, so that pauses can end on common steps.
    A new sample starts drafting with a clean record (the clock runs on)."""

    accepted: jax.Array        # [S] float32
    drafted: jax.Array         # [S] float32
    skip: jax.Array            # [S] int32
    misses: jax.Array          # [S] int32
    clock: jax.Array           # [] int32


def init_draft_gate(num_slots: int) -> DraftGate:
    zf = lambda: jnp.zeros((num_slots,), jnp.float32)
    zi = lambda: jnp.zeros((num_slots,), jnp.int32)
    return DraftGate(zf(), zf(), zi(), zi(), jnp.int32(0))


class Pick(NamedTuple):
    token: jax.Array
    logp: jax.Array
    floor: jax.Array
    entropy: jax.Array


def sample_keys(seed: int, prompt_id, sample_index, step) -> jax.Array:
    """Key of one token draw: a function of (seed, prompt_id, sample_index, step) only."""
    base = jax.random.key(seed)
    return jax.vmap(lambda p, s, t: jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(base, p), s), t))(prompt_id, sample_index, step)


# ---------------------------------------------------------------------------------------------
# Device functions (pure; `spec` is static)


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything the compiled programs depend on besides their array arguments."""

    config: ModelConfig
    contract: NumericalContract
    sampling: SamplingParams
    num_slots: int
    max_prompt_len: int
    draft_config: ModelConfig | None = None    # the draft model of speculative decoding
    mtp: bool = False                          # drafts come from the target's MTP head
    # Self-speculation: the draft model is the target itself (draft_config == config, its
    # params the target's) under the fast contract (speculative_config.fast_path_contract).
    fast_path: bool = False

    @property
    def has_draft_state(self) -> bool:
        return self.draft_config is not None or self.mtp

    @property
    def draft_contract(self) -> NumericalContract:
        """The contract the draft model runs under: the fast path's, else the target's."""
        return fast_path_contract(self.contract) if self.fast_path else self.contract

    @property
    def capacity(self) -> int:
        return self.max_prompt_len + self.sampling.max_new_tokens


def init_state(spec: Spec) -> SlotState:
    s, m, c = spec.num_slots, spec.sampling.max_new_tokens, spec.capacity
    cache = transformer.init_cache(spec.config, s, c, spec.contract)
    draft_cache = target_hidden = None
    if spec.mtp:
        draft_cache = mtp.init_cache(spec.config, s, c, spec.contract)
        target_hidden = jnp.zeros((s, c, spec.config.hidden_size), spec.contract.compute)
    elif spec.draft_config is not None:
        draft_cache = transformer.init_cache(spec.draft_config, s, c, spec.draft_contract)
    # Distinct buffers for every field: the state is donated to each device call.
    zi = lambda: jnp.zeros((s,), jnp.int32)
    zb = lambda: jnp.zeros((s,), bool)
    return SlotState(cache, zi(), zi(), zi(), zi(), zb(), zb(), zi(), zi(),
                     jnp.zeros((s, c), jnp.int32), jnp.zeros((s, m), jnp.int32),
                     jnp.zeros((s, m), jnp.float32), jnp.zeros((s, m), jnp.float32),
                     jnp.zeros((s, m), jnp.int32), jnp.zeros((s, m), jnp.float32),
                     jnp.zeros((s, m), bool), jnp.full(route_shape(spec, s, c), -1, jnp.int32),
                     draft_cache, init_draft_gate(s) if spec.has_draft_state else None,
                     target_hidden)


def store_hidden(state: SlotState, rows, cols, hidden, write) -> SlotState:
    """state with target_hidden[rows, cols] = hidden where write (rows, cols, write [k, W];
    hidden [k, W, D]); unchanged when the state keeps no hidden states (no MTP head)."""
    if state.target_hidden is None:
        return state
    capacity = state.target_hidden.shape[1]
    rows = jnp.broadcast_to(rows[:, None], cols.shape)
    cols = jnp.where(write, cols, capacity)                  # out of range: dropped
    return state._replace(target_hidden=state.target_hidden.at[rows, cols].set(
        hidden.astype(state.target_hidden.dtype), mode="drop"))


def store_prompt_hidden(spec: Spec, state: SlotState, slots, hidden, prompt_lens) -> SlotState:
    """store_hidden of k prompts' hidden states [k, P, D] at positions 0 .. prompt_lens - 1 of
    their slots [k] (padding rows, slots out of range, are dropped)."""
    positions = jnp.broadcast_to(jnp.arange(spec.max_prompt_len, dtype=jnp.int32),
                                 hidden.shape[:2])
    return store_hidden(state, slots, positions, hidden, positions < prompt_lens[:, None])


def route_shape(spec: Spec, rows: int, width: int) -> tuple[int, int, int, int]:
    """[rows, width, L_moe, k] (L_moe = 0 for a dense model)."""
    config = spec.config
    return (rows, width, len(transformer.moe_layers(config)),
            max(config.num_experts_per_tok, 1))


def token_routes(spec: Spec, out: transformer.Forward, mask) -> jax.Array:
    """The routes [B, T, L_moe, k] of a forward's tokens, -1 where mask [B, T] is False."""
    batch, width = mask.shape
    if not spec.config.has_moe:
        return jnp.full(route_shape(spec, batch, width), -1, jnp.int32)
    routes = transformer.stack_routes(out.experts, spec.config)
    return jnp.where(mask[:, :, None, None], routes, -1)


def pick_tokens(spec: Spec, params, hidden, seed, prompt_id, sample_index, step) -> Pick:
    """hidden [N, D] -> next token, its logprob, floor and entropy. The logprob comes from
    the same kernel (and floor) the trainer replays."""
    sp = spec.sampling
    logits = transformer.logits_from_hidden(params, hidden, contract=spec.contract)  # [N, V]
    # The same scaling the logprob kernel applies, so the floor and the kept set agree bitwise.
    z = logits * kernels.reference.inverse_temperature(sp.temperature)
    floor = logit_floor(z, top_k=sp.top_k, top_p=sp.top_p)
    if sp.greedy:
        token = jnp.argmax(jnp.where(z >= floor[:, None], z, -jnp.inf), axis=-1)
        token = token.astype(jnp.int32)
    else:
        keys = sample_keys(seed, prompt_id, sample_index, step)
        token = sample_from_floor(keys, z, floor)
    logp, entropy = kernels.token_logprobs(logits, token, contract=spec.contract,
                                           temperature=sp.temperature, logit_floor=floor)
    return Pick(token, logp, floor, entropy)


def record_pick(spec: Spec, state: SlotState, pick: Pick, write: jax.Array,
                version) -> SlotState:
    """Store pick for slots where `write` [S] is set, advance them, and finish them."""
    sp = spec.sampling
    rows = jnp.arange(spec.num_slots)
    col = jnp.where(write, state.num_generated, sp.max_new_tokens)  # out of range: dropped
    stop_ids = jnp.asarray(sp.stop_tokens or (-1,), jnp.int32)
    is_stop = jnp.any(pick.token[:, None] == stop_ids[None, :], axis=-1)
    num_generated = state.num_generated + write.astype(jnp.int32)
    position = state.position + write.astype(jnp.int32)
    out_of_room = (num_generated >= state.limit) | (position + 1 >= spec.capacity)
    finished = write & (is_stop | out_of_room)
    history_col = jnp.where(write, position, spec.capacity)  # the new token sits at `position`
    return state._replace(
        last_token=jnp.where(write, pick.token, state.last_token),
        position=position,
        num_generated=num_generated,
        active=jnp.where(write, ~finished, state.active),
        stopped=jnp.where(write, is_stop, state.stopped),
        history=state.history.at[rows, history_col].set(pick.token, mode="drop"),
        tokens=state.tokens.at[rows, col].set(pick.token, mode="drop"),
        logp=state.logp.at[rows, col].set(pick.logp, mode="drop"),
        floor=state.floor.at[rows, col].set(pick.floor, mode="drop"),
        versions=state.versions.at[rows, col].set(
            jnp.broadcast_to(jnp.asarray(version, jnp.int32), rows.shape), mode="drop"),
        entropy=state.entropy.at[rows, col].set(pick.entropy, mode="drop"),
        is_model=state.is_model.at[rows, col].set(True, mode="drop"),
    )


def record_rows(spec: Spec, state: SlotState, slots, pick: Pick, version) -> SlotState:
    """record_pick for the k picks [k] of `slots` [k] (padding entries dropped)."""
    filled = jnp.zeros((spec.num_slots,), bool).at[slots].set(True, mode="drop")
    pick = Pick(*(jnp.zeros((spec.num_slots,), x.dtype).at[slots].set(x, mode="drop")
                   for x in pick))
    return record_pick(spec, state, pick, filled, version)


def prompt_forward(spec: Spec, params, prompts, prompt_lens, real):
    """The forward of k prompts [k, P] (prompt_lens [k], real [k] bool: padding rows masked out)
    into a fresh zero cache of the slots' capacity: nothing of a slot's old contents is read
    (masked keys add exact zeros whatever they hold). Returns (transformer.Forward, mask [k, P],
    the hidden state at each prompt's last position [k, D]). Prefill and the shared-prefill pool
    (jrl.sampling.prefix) both run this one program, so a pool row holds a slot's bits."""
    num = prompts.shape[0]
    fresh = transformer.init_cache(spec.config, num, spec.capacity, spec.contract)
    positions = jnp.broadcast_to(jnp.arange(spec.max_prompt_len, dtype=jnp.int32),
                                 (num, spec.max_prompt_len))
    mask = (positions < prompt_lens[:, None]) & real[:, None]
    out = transformer.forward(params, spec.config, prompts, contract=spec.contract,
                              positions=positions, mask=mask, cache=fresh)
    return out, mask, out.hidden[jnp.arange(num), jnp.maximum(prompt_lens - 1, 0)]


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def prefill(spec: Spec, params, state: SlotState, slots, prompts, prompt_lens, prompt_ids,
             sample_indices, limits, version, seed) -> SlotState:
    """Run k prompts into k slots in one batched forward and draw each one's first token.

    slots [k] int32 (entries == num_slots are padding: their writes are dropped); prompts [k, P]
    (right-padded to max_prompt_len); prompt_lens, prompt_ids, sample_indices, limits [k] int32.
    The kernels are batch-invariant, so a prompt's bits do not depend on k or its neighbours.
    """
    cache = state.cache
    num = slots.shape[0]
    out, mask, last_hidden = prompt_forward(spec, params, prompts, prompt_lens,
                                            slots < spec.num_slots)
    fresh = out.cache
    # The slot's routes start over: the prompt's, then -1 (nothing of an old sample survives).
    prompt_routes = token_routes(spec, out, mask)
    fresh_routes = jnp.full(route_shape(spec, num, spec.capacity), -1, jnp.int32)
    fresh_routes = fresh_routes.at[:, :spec.max_prompt_len].set(prompt_routes)
    pick = pick_tokens(spec, params, last_hidden, seed, prompt_ids, sample_indices,
                       jnp.zeros((num,), jnp.int32))
    cache = transformer.scatter_rows(cache, slots, fresh)
    state = seat_samples(spec, state, slots, cache, prompts, prompt_lens, prompt_ids,
                         sample_indices, limits, fresh_routes)
    state = store_prompt_hidden(spec, state, slots, out.hidden, prompt_lens)
    return record_rows(spec, state, slots, pick, version)


def seat_samples(spec: Spec, state: SlotState, slots, cache, prompts, prompt_lens, prompt_ids,
                 sample_indices, limits, routes) -> SlotState:
    """The slot state of k new samples in `slots` [k] (padding entries == num_slots dropped):
    `cache` (the slots' rows already written), the prompt as history, routes [k, P + N, L_moe,
    k_top] (the prompt's, then -1: nothing of an old sample survives), the counters reset. What
    prefill and a shared-prefill start (jrl.sampling.prefix) both leave before the first pick
    is recorded."""
    per_slot = lambda old, new: old.at[slots].set(new, mode="drop")
    history = state.history.at[slots].set(
        jnp.pad(prompts, ((0, 0), (0, spec.sampling.max_new_tokens))), mode="drop")
    draft_cache = state.draft_cache
    if draft_cache is not None:
        # The draft model has seen nothing of the new samples: it catches up on its next step.
        draft_cache = draft_cache._replace(lengths=per_slot(draft_cache.lengths, 0))
    draft_gate = state.draft_gate
    if draft_gate is not None:
        # Every field but the shared clock is per slot.
        draft_gate = draft_gate._replace(**{name: per_slot(getattr(draft_gate, name), 0)
                                            for name in DraftGate._fields if name != "clock"})
    return state._replace(
        draft_cache=draft_cache,
        draft_gate=draft_gate,
        cache=cache,
        history=history,
        routes=per_slot(state.routes, routes),
        position=per_slot(state.position, prompt_lens - 1),
        num_generated=per_slot(state.num_generated, 0),
        limit=per_slot(state.limit, limits),
        prompt_id=per_slot(state.prompt_id, prompt_ids),
        sample_index=per_slot(state.sample_index, sample_indices),
        stopped=per_slot(state.stopped, False))


PREFILL_BUCKETS = ("powers_of_two", "one")


def prefill_bucket(count: int, num_slots: int, policy: str = "powers_of_two") -> int:
    """Rows of the batched prefill call for `count` waiting prompts. "powers_of_two": the next
    power of two, at most num_slots, so a sampler compiles at most log2(num_slots) + 1 prefill
    programs and prefills few padding rows; "one": always num_slots (one program, more padding
    rows). Either way a row's bits are the same (the kernels are batch-invariant)."""
    if policy == "one":
        return num_slots
    return min(1 << max(0, count - 1).bit_length(), num_slots)


def decode_step(spec: Spec, params, state: SlotState, version, seed) -> SlotState:
    active = state.active
    positions = state.position[:, None]  # last_token sits at `position`
    out = transformer.forward(params, spec.config, state.last_token[:, None],
                              contract=spec.contract, positions=positions, mask=active[:, None],
                              cache=state.cache)
    hidden, cache = out.hidden, out.cache
    pick = pick_tokens(spec, params, hidden[:, 0], seed, state.prompt_id, state.sample_index,
                       state.num_generated)
    # The fed token's routes, at its position (inactive slots: out of range, dropped).
    rows = jnp.arange(spec.num_slots)
    cols = jnp.where(active, state.position, spec.capacity)
    routes = state.routes.at[rows, cols].set(token_routes(spec, out, active[:, None])[:, 0],
                                             mode="drop")
    state = state._replace(cache=cache, routes=routes)
    state = store_hidden(state, rows, positions, hidden, active[:, None])
    return record_pick(spec, state, pick, active, version)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def decode(spec: Spec, params, state: SlotState, version, seed, max_steps, stop_on_finish):
    """Up to max_steps decode steps; returns early once a slot finishes if stop_on_finish.
    Returns (state, number of steps run)."""
    def cond(carry):
        step, state, any_finished = carry
        go_on = (step < max_steps) & jnp.any(state.active)
        return go_on & ~(stop_on_finish & any_finished)

    def body(carry):
        step, state, _ = carry
        was_active = state.active
        state = decode_step(spec, params, state, version, seed)
        return step + 1, state, jnp.any(was_active & ~state.active)

    steps, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return state, steps


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def append(spec: Spec, params, state: SlotState, slots, observations, observation_lens,
           version, seed) -> SlotState:
    """Continue k paused episodes: append each one's observation, then draw its next token.

    A paused slot stopped on a stop token, which sits at `position` and is not in the cache yet
    (the next decode step would feed it). The chunk [last_token, o_1 .. o_m] goes through the
    cached forward at positions position .. position + m, the same kernels as prefill and
    decode, so the next model token's p_b equals the trainer's full-sequence forward, bit for
    bit. Observation tokens are recorded in the response with is_model False, logp 0, floor -inf
    and version -1; the model's next token is drawn from the hidden state at position + m.

    slots [k] int32 (entries == num_slots are padding: their writes are dropped); observations
    [k, A] int32 (right-padded to the sampler's max_observation_len); observation_lens [k] int32 in
    [0, A]. The host checks that m observation tokens and one more token fit the slot's limit.
    """
    num, width = observations.shape
    real = slots < spec.num_slots
    gather = jnp.where(real, slots, 0)
    start = state.position[gather]                                                # [k]
    chunk = jnp.concatenate([state.last_token[gather][:, None], observations], axis=1)
    offsets = jnp.arange(width + 1, dtype=jnp.int32)
    positions = start[:, None] + offsets[None, :]                                  # [k, A + 1]
    mask = (offsets[None, :] <= observation_lens[:, None]) & real[:, None]
    cache = state.cache
    rows_cache = transformer.select_rows(cache, gather)
    out = transformer.forward(params, spec.config, chunk, contract=spec.contract,
                              positions=positions, mask=mask, cache=rows_cache)
    hidden, rows_cache = out.hidden, out.cache
    cache = transformer.scatter_rows(cache, slots, rows_cache)
    # Routes of the chunk (the stop token, then the observation) at positions start + offset.
    chunk_rows = jnp.broadcast_to(slots[:, None], (num, width + 1))
    chunk_cols = jnp.where(mask, positions, spec.capacity)
    routes = state.routes.at[chunk_rows, chunk_cols].set(token_routes(spec, out, mask), mode="drop")
    # The observation tokens: response columns num_generated .. num_generated + m - 1, history
    # positions position + 1 .. position + m. Columns past m (padding) are dropped.
    in_obs = offsets[None, :width] < observation_lens[:, None]                     # [k, A]
    rows = jnp.broadcast_to(slots[:, None], (num, width))
    cols = jnp.where(in_obs, state.num_generated[gather][:, None] + offsets[None, :width],
                     spec.sampling.max_new_tokens)
    history_cols = jnp.where(in_obs, start[:, None] + 1 + offsets[None, :width], spec.capacity)
    state = state._replace(
        cache=cache,
        routes=routes,
        history=state.history.at[rows, history_cols].set(observations, mode="drop"),
        tokens=state.tokens.at[rows, cols].set(observations, mode="drop"),
        logp=state.logp.at[rows, cols].set(0.0, mode="drop"),
        floor=state.floor.at[rows, cols].set(-jnp.inf, mode="drop"),
        versions=state.versions.at[rows, cols].set(-1, mode="drop"),
        entropy=state.entropy.at[rows, cols].set(0.0, mode="drop"),
        is_model=state.is_model.at[rows, cols].set(False, mode="drop"),
        position=state.position.at[slots].add(observation_lens, mode="drop"),
        num_generated=state.num_generated.at[slots].add(observation_lens, mode="drop"))
    state = store_hidden(state, slots, positions, hidden, mask)
    last_hidden = hidden[jnp.arange(num), observation_lens]                        # [k, D]
    pick = pick_tokens(spec, params, last_hidden, seed, state.prompt_id[gather],
                       state.sample_index[gather], state.num_generated[gather])
    return record_rows(spec, state, slots, pick, version)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def refresh(spec: Spec, params, state: SlotState, rows) -> SlotState:
    """Recompute the KV cache of the slots in `rows` [S] bool with `params` (weight swap).

    A live slot's cache holds positions [0, position) (last_token, at `position`, is fed by the
    next decode step or by `append`). They are rewritten from `history` in one full-width pass
    through the same cached forward as prefill; other rows are masked out and keep their cache.
    `rows` is the host's set of live samples: decoding slots and episodes paused for a tool.
    """
    positions = jnp.broadcast_to(jnp.arange(spec.capacity, dtype=jnp.int32),
                                 (spec.num_slots, spec.capacity))
    mask = (positions < state.position[:, None]) & rows[:, None]
    # Routes are left as recorded: each is the routing that produced the next token (see
    # SlotState), and the tokens before the swap were produced by the old weights' routing.
    hidden, cache = transformer.forward_hidden(
        params, spec.config, state.history, contract=spec.contract, positions=positions,
        mask=mask, cache=state.cache)
    state = state._replace(cache=cache)
    if spec.mtp:
        # The head's cache was built from the old weights' hidden states: it catches up again
        # from the new ones (its bits only choose drafts).
        state = store_hidden(state, jnp.arange(spec.num_slots), positions, hidden, mask)
        draft_cache = state.draft_cache
        state = state._replace(draft_cache=draft_cache._replace(
            lengths=jnp.where(rows, 0, draft_cache.lengths).astype(jnp.int32)))
    return state

"""Jitted sampler: KV cache per slot, prefill, decode, continuous batching over fixed slots.

Shapes are fixed at construction (num_slots, max_prompt_len, capacity), so a long sequence never
recompiles anything. Every token records its behaviour logprob p_b (from the same token-logprob
kernel the trainer uses, under the same truncation floor), the floor itself, and the policy
version of the weights that produced it. Weights can be swapped between decode calls.

The device functions are jitted with the static part of the sampler (`_Spec`: model config,
numerical contract, sampling params except the seed, slot shapes) as a static argument, so every
Sampler built with an equal spec reuses the same compiled programs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models import transformer
from jrl.models.config import ModelConfig
from jrl.sampling.params import SamplingParams
from jrl.sampling.truncation import logit_floor, sample_from_floor

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclasses.dataclass
class Sample:
    """One generated response. Per-token arrays have length `len(tokens)`."""

    prompt_id: int
    sample_index: int
    prompt_tokens: np.ndarray      # [P] int32
    tokens: np.ndarray             # [N] int32, stop token included when finish_reason == "stop"
    behavior_logp: np.ndarray      # [N] float32, p_b under the distribution sampled from
    logit_floor: np.ndarray        # [N] float32, truncation floor to replay (-inf: none)
    versions: np.ndarray           # [N] int32, policy version that produced each token
    entropy: np.ndarray | None     # [N] float32 if requested
    finish_reason: str             # "stop" or "length"

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


class SlotState(NamedTuple):
    """Device state of all slots. S slots, M = max_new_tokens, C = capacity."""

    cache: transformer.KVCache
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
    versions: jax.Array        # [S, M] int32
    entropy: jax.Array         # [S, M] float32


class _Pick(NamedTuple):
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
class _Spec:
    """Everything the compiled programs depend on besides their array arguments."""

    config: ModelConfig
    contract: NumericalContract
    sampling: SamplingParams
    num_slots: int
    max_prompt_len: int

    @property
    def capacity(self) -> int:
        return self.max_prompt_len + self.sampling.max_new_tokens


def _init_state(spec: _Spec) -> SlotState:
    s, m, c = spec.num_slots, spec.sampling.max_new_tokens, spec.capacity
    cache = transformer.init_cache(spec.config, s, c, spec.contract.compute)
    # Distinct buffers for every field: the state is donated to each device call.
    zi = lambda: jnp.zeros((s,), jnp.int32)
    zb = lambda: jnp.zeros((s,), bool)
    return SlotState(cache, zi(), zi(), zi(), zi(), zb(), zb(), zi(), zi(),
                     jnp.zeros((s, c), jnp.int32), jnp.zeros((s, m), jnp.int32),
                     jnp.zeros((s, m), jnp.float32), jnp.zeros((s, m), jnp.float32),
                     jnp.zeros((s, m), jnp.int32), jnp.zeros((s, m), jnp.float32))


def _pick(spec: _Spec, params, hidden, seed, prompt_id, sample_index, step) -> _Pick:
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
    return _Pick(token, logp, floor, entropy)


def _record(spec: _Spec, state: SlotState, pick: _Pick, write: jax.Array, version) -> SlotState:
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
    )


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(spec: _Spec, params, state: SlotState, slots, prompts, prompt_lens, prompt_ids,
             sample_indices, limits, version, seed) -> SlotState:
    """Run k prompts into k slots in one batched forward and draw each one's first token.

    slots [k] int32 (entries == num_slots are padding: their writes are dropped); prompts [k, P]
    (right-padded to max_prompt_len); prompt_lens, prompt_ids, sample_indices, limits [k] int32.
    The kernels are batch-invariant, so a prompt's bits do not depend on k or its neighbours.
    """
    cache = state.cache
    num = slots.shape[0]
    real = slots < spec.num_slots
    # A fresh cache per prompt (nothing of the slots' old contents is read: masked keys add
    # exact zeros whatever they hold), scattered into the slots afterwards.
    fresh = transformer.init_cache(spec.config, num, spec.capacity, cache.k.dtype)
    positions = jnp.broadcast_to(jnp.arange(spec.max_prompt_len, dtype=jnp.int32),
                                 (num, spec.max_prompt_len))
    mask = (positions < prompt_lens[:, None]) & real[:, None]
    hidden, fresh = transformer.forward_hidden(
        params, spec.config, prompts, contract=spec.contract, positions=positions, mask=mask,
        cache=fresh)
    last_hidden = hidden[jnp.arange(num), jnp.maximum(prompt_lens - 1, 0)]          # [k, D]
    pick = _pick(spec, params, last_hidden, seed, prompt_ids, sample_indices,
                 jnp.zeros((num,), jnp.int32))
    cache = transformer.KVCache(cache.k.at[:, slots].set(fresh.k, mode="drop"),
                                cache.v.at[:, slots].set(fresh.v, mode="drop"),
                                cache.lengths.at[slots].set(fresh.lengths, mode="drop"))
    filled = jnp.zeros((spec.num_slots,), bool).at[slots].set(True, mode="drop")
    per_slot = lambda old, new: old.at[slots].set(new, mode="drop")
    history = state.history.at[slots].set(
        jnp.pad(prompts, ((0, 0), (0, spec.sampling.max_new_tokens))), mode="drop")
    state = state._replace(
        cache=cache,
        history=history,
        position=per_slot(state.position, prompt_lens - 1),
        num_generated=per_slot(state.num_generated, 0),
        limit=per_slot(state.limit, limits),
        prompt_id=per_slot(state.prompt_id, prompt_ids),
        sample_index=per_slot(state.sample_index, sample_indices),
        stopped=per_slot(state.stopped, False))
    pick = _Pick(*(jnp.zeros((spec.num_slots,), x.dtype).at[slots].set(x, mode="drop")
                   for x in pick))
    return _record(spec, state, pick, filled, version)


def prefill_bucket(count: int, num_slots: int) -> int:
    """Rows of the batched prefill call for `count` waiting prompts: the next power of two,
    at most num_slots, so a sampler compiles at most log2(num_slots) + 1 prefill programs."""
    return min(1 << max(0, count - 1).bit_length(), num_slots)


def _decode_step(spec: _Spec, params, state: SlotState, version, seed) -> SlotState:
    active = state.active
    positions = state.position[:, None]  # last_token sits at `position`
    hidden, cache = transformer.forward_hidden(
        params, spec.config, state.last_token[:, None], contract=spec.contract,
        positions=positions, mask=active[:, None], cache=state.cache)
    pick = _pick(spec, params, hidden[:, 0], seed, state.prompt_id, state.sample_index,
                 state.num_generated)
    state = state._replace(cache=cache)
    return _record(spec, state, pick, active, version)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _decode(spec: _Spec, params, state: SlotState, version, seed, max_steps, stop_on_finish):
    """Up to max_steps decode steps; returns early once a slot finishes if stop_on_finish.
    Returns (state, number of steps run)."""
    def cond(carry):
        step, state, any_finished = carry
        go_on = (step < max_steps) & jnp.any(state.active)
        return go_on & ~(stop_on_finish & any_finished)

    def body(carry):
        step, state, _ = carry
        was_active = state.active
        state = _decode_step(spec, params, state, version, seed)
        return step + 1, state, jnp.any(was_active & ~state.active)

    steps, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return state, steps


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _refresh(spec: _Spec, params, state: SlotState) -> SlotState:
    """Recompute the KV cache of every active slot with `params` (after a weight swap).

    An active slot's cache holds positions [0, position) (last_token, at `position`, is fed by
    the next decode step). They are rewritten from `history` in one full-width pass through the
    same cached forward as prefill; inactive rows are masked out and keep their cache.
    """
    positions = jnp.broadcast_to(jnp.arange(spec.capacity, dtype=jnp.int32),
                                 (spec.num_slots, spec.capacity))
    mask = (positions < state.position[:, None]) & state.active[:, None]
    _, cache = transformer.forward_hidden(
        params, spec.config, state.history, contract=spec.contract, positions=positions,
        mask=mask, cache=state.cache)
    return state._replace(cache=cache)


# ---------------------------------------------------------------------------------------------
# Host loop


class Sampler:
    """Generates groups of samples with continuous batching over `num_slots` slots.

    capacity = max_prompt_len + max_new_tokens positions of KV cache per slot. `steps_per_call`
    bounds how many decode steps run on the device between host checks (refills, weight swaps).

    recompute_kv_on_swap: when poll_weights delivers new weights, recompute the KV cache of every
      in-flight sample (prompt + tokens so far) with them before decoding on. Then each token's
      p_b equals a full forward with the weights of its own version (exactly, with the Pallas
      backend). Off (the default, as in most RL samplers), in-flight samples keep the K/V their
      old-version prefix was computed with, and a post-swap token's p_b is that of new weights
      on top of an old-weights KV prefix.
    continuous_batching: False gives static batching (the baseline the benchmark compares
      against): slots are refilled only once all of them are free, so a batch lasts as long as
      its longest sample.

    After each `generate`, `last_stats` holds counters of that call (prefills, refills into a
    running batch, decode calls and steps, KV refreshes, generated tokens).
    """

    def __init__(self, config: ModelConfig, contract: NumericalContract,
                 sampling: SamplingParams, *, num_slots: int, max_prompt_len: int,
                 steps_per_call: int = 16, return_entropy: bool = False,
                 recompute_kv_on_swap: bool = False, continuous_batching: bool = True):
        for name, value in (("num_slots", num_slots), ("max_prompt_len", max_prompt_len),
                            ("steps_per_call", steps_per_call)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Sampler.{name}={value!r}: must be a positive int")
        self.config = config
        self.contract = contract
        self.sampling = sampling
        self.num_slots = num_slots
        self.max_prompt_len = max_prompt_len
        self.capacity = max_prompt_len + sampling.max_new_tokens
        self.steps_per_call = steps_per_call
        self.return_entropy = return_entropy
        self.recompute_kv_on_swap = bool(recompute_kv_on_swap)
        self.continuous_batching = bool(continuous_batching)
        # The seed is a runtime argument, so a new seed per RL step compiles nothing new.
        self._spec = _Spec(config, contract, sampling.replace(seed=0), num_slots, max_prompt_len)
        self.last_stats: dict[str, int] = {}
        self.idle_s = 0.0   # seconds `serve` spent with every slot empty, waiting for requests

    def init_state(self) -> SlotState:
        return _init_state(self._spec)

    def generate(self, params, prompts: Sequence[tuple[int, Sequence[int]]], *, version: int = 0,
                 poll_weights: Callable[[], tuple | None] | None = None,
                 max_new_tokens: Sequence[int] | None = None,
                 group_size: int | None = None) -> list[Sample]:
        """Generate `group_size` samples for each (prompt_id, prompt_tokens).

        group_size: overrides sampling.group_size for this call (host-side only: no recompile),
        e.g. one sample per prompt for evaluation with the rollout sampler.

        prompt ids must be distinct (with the seed they name each sample's PRNG stream).
        max_new_tokens: optional budget per prompt, each in [1, sampling.max_new_tokens] (no
        recompilation: the budget is a per-slot value); default sampling.max_new_tokens.
        poll_weights, if given, is called between device calls; returning (params, version)
        swaps the weights: tokens generated after the swap carry the new version; in-flight
        samples keep their KV cache unless recompute_kv_on_swap. Returns samples ordered by
        (prompt order, sample_index).
        """
        prompts = list(prompts)
        if group_size is not None and (not isinstance(group_size, int) or
                                       isinstance(group_size, bool) or group_size <= 0):
            raise ValueError(f"generate: group_size={group_size!r}: must be a positive int")
        if max_new_tokens is not None:
            max_new_tokens = list(max_new_tokens)
            if len(max_new_tokens) != len(prompts):
                raise ValueError(f"generate: max_new_tokens has {len(max_new_tokens)} entries for "
                                 f"{len(prompts)} prompts; give one per prompt")
        requests = collections.deque()
        seen = set()
        for i, (prompt_id, tokens) in enumerate(prompts):
            tokens = np.asarray(tokens, np.int32)
            if tokens.ndim != 1 or tokens.size == 0:
                raise ValueError(f"prompt {prompt_id}: tokens must be a non-empty 1-D sequence")
            if tokens.size > self.max_prompt_len:
                raise ValueError(f"prompt {prompt_id} has {tokens.size} tokens, more than "
                                 f"Sampler.max_prompt_len={self.max_prompt_len}")
            if int(prompt_id) in seen:
                raise ValueError(f"prompt_id {prompt_id} appears twice; ids must be distinct "
                                 "(they seed each sample's PRNG stream)")
            seen.add(int(prompt_id))
            limit = self.sampling.max_new_tokens
            if max_new_tokens is not None:
                limit = max_new_tokens[i]
                if (not isinstance(limit, (int, np.integer)) or
                        not 1 <= limit <= self.sampling.max_new_tokens):
                    raise ValueError(f"generate: max_new_tokens[{i}]={limit!r}: must be an int in "
                                     f"[1, SamplingParams.max_new_tokens="
                                     f"{self.sampling.max_new_tokens}]")
            for sample_index in range(self.sampling.group_size if group_size is None
                                      else group_size):
                requests.append((int(prompt_id), sample_index, tokens, int(limit)))
        order = {(r[0], r[1]): i for i, r in enumerate(requests)}
        done: list[Sample] = []
        self.serve(params, next_request=lambda: requests.popleft() if requests else None,
                   on_sample=done.append, version=version, poll_weights=poll_weights)
        done.sort(key=lambda s: order[(s.prompt_id, s.sample_index)])
        return done

    def serve(self, params, *, next_request: Callable[[], tuple | None],
              on_sample: Callable[[Sample], None], version: int = 0,
              poll_weights: Callable[[], tuple | None] | None = None,
              keep_alive: Callable[[], bool] | None = None, idle_wait_s: float = 0.002) -> None:
        """Continuous generation from a request source (the streaming form of `generate`).

        next_request() -> (prompt_id, sample_index, prompt_tokens int32 [P], max_new_tokens) or
        None when nothing may start now; it is asked whenever a slot is free. on_sample(sample)
        receives each finished sample. While keep_alive() is true the loop waits for requests
        when idle (polling weights meanwhile); it returns once no slot is busy, next_request()
        gives None and keep_alive() is false. Request ids must be distinct across the call.
        """
        spec = self._spec
        seed = jnp.uint32(self.sampling.seed)
        stats = dict(prefills=0, prefill_calls=0, refills_while_busy=0, decode_calls=0,
                     refreshes=0, tokens=0)
        decode_steps = []
        state = self.init_state()
        slot_request: list = [None] * self.num_slots
        finished: list[Sample] = []
        waiting = None   # a request taken from the source that found no free slot yet

        def deliver():
            for sample in finished:
                stats["tokens"] += sample.length
                on_sample(sample)
            finished.clear()

        while True:
            if poll_weights is not None:
                update = poll_weights()
                if update is not None:
                    params, version = update
                    if self.recompute_kv_on_swap and any(r is not None for r in slot_request):
                        state = _refresh(spec, params, state)
                        stats["refreshes"] += 1
            self._harvest(state, slot_request, finished)
            deliver()
            busy = any(r is not None for r in slot_request)
            if self.continuous_batching or not busy:
                starts = []   # (slot, request) for every free slot that gets a request now
                for slot in range(self.num_slots):
                    if slot_request[slot] is not None:
                        continue
                    request = waiting if waiting is not None else next_request()
                    waiting = None
                    if request is None:
                        break
                    starts.append((slot, request))
                if starts:
                    state = self._prefill_many(params, state, starts, version, seed)
                    for slot, request in starts:
                        slot_request[slot] = request
                    stats["prefills"] += len(starts)
                    stats["prefill_calls"] += 1
                    stats["refills_while_busy"] += len(starts) * int(busy)
            if all(r is None for r in slot_request):
                waiting = next_request()
                if waiting is not None:
                    continue
                if keep_alive is not None and keep_alive():
                    time.sleep(idle_wait_s)
                    self.idle_s += idle_wait_s
                    continue
                break
            # Return to the host early when a slot frees up, if more work may arrive for it.
            more = keep_alive() if keep_alive is not None else False
            stop_on_finish = self.continuous_batching
            if not more and waiting is None:
                peek = next_request()
                waiting = peek
                stop_on_finish = stop_on_finish and peek is not None
            state, steps = _decode(spec, params, state, jnp.int32(version), seed,
                                   jnp.int32(self.steps_per_call), jnp.bool_(stop_on_finish))
            decode_steps.append(steps)
            stats["decode_calls"] += 1
        stats["decode_steps"] = int(sum(int(s) for s in decode_steps))
        self.last_stats = stats

    def _prefill_many(self, params, state: SlotState, starts: list, version: int,
                      seed) -> SlotState:
        """Prefill every (slot, request) in `starts` with one batched device call."""
        bucket = prefill_bucket(len(starts), self.num_slots)
        slots = np.full((bucket,), self.num_slots, np.int32)   # padding rows: writes dropped
        prompts = np.zeros((bucket, self.max_prompt_len), np.int32)
        lens, ids, indices, limits = (np.ones((bucket,), np.int32) for _ in range(4))
        for row, (slot, (prompt_id, sample_index, tokens, limit)) in enumerate(starts):
            slots[row], lens[row], ids[row] = slot, tokens.size, prompt_id
            indices[row], limits[row] = sample_index, limit
            prompts[row, :tokens.size] = tokens
        return _prefill(self._spec, params, state, jnp.asarray(slots), jnp.asarray(prompts),
                        jnp.asarray(lens), jnp.asarray(ids), jnp.asarray(indices),
                        jnp.asarray(limits), jnp.int32(version), seed)

    def _harvest(self, state: SlotState, slot_request: list, done: list) -> None:
        """Move finished slots' outputs to the host and free the slots."""
        busy = [s for s, r in enumerate(slot_request) if r is not None]
        if not busy:
            return
        active = np.asarray(state.active)
        finished = [s for s in busy if not active[s]]
        if not finished:
            return
        host = jax.device_get((state.num_generated, state.stopped, state.tokens, state.logp,
                               state.floor, state.versions, state.entropy))
        num_generated, stopped, tokens, logp, floor, versions, entropy = host
        for slot in finished:
            prompt_id, sample_index, prompt, _ = slot_request[slot]
            n = int(num_generated[slot])
            done.append(Sample(
                prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=prompt,
                tokens=tokens[slot, :n].copy(), behavior_logp=logp[slot, :n].copy(),
                logit_floor=floor[slot, :n].copy(), versions=versions[slot, :n].copy(),
                entropy=entropy[slot, :n].copy() if self.return_entropy else None,
                finish_reason=FINISH_STOP if stopped[slot] else FINISH_LENGTH))
            slot_request[slot] = None

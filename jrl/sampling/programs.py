"""The device side of a Sampler behind one interface: SlotPrograms.

Sampler.serve (jrl.sampling.engine) is the host loop: requests, free slots, weight swaps,
multi-turn pauses, finished samples. Everything it asks of a device goes through the seven
methods of SlotPrograms, so a different device side plugs in whole:

    init_state(params)                      empty slots
    precompile(params) -> int               compile every program serve may call
    begin()                                 a serve starts (per-serve caches emptied)
    start(params, state, starts, v, seed)   seat each (slot, request) and draw its first token
    append(params, state, resumes, v, seed) append observations (multi-turn) and draw
    decode(params, state, v, seed, stop)    up to steps_per_call steps -> (state, steps run)
    refresh(params, state, rows)            recompute the live slots' KV cache (weight swap)
    weights_changed()                       drop what was computed with the old weights
    harvest(state, slot_request, slots)     the stopped slots' Samples, read back to the host
    serve_stats(host_stats)                 the device side's counters for Sampler.last_stats

DevicePrograms is the real one: the jitted programs of jrl.sampling.slots, run plain, with the
shared-prefill pool (jrl.sampling.prefix), or speculatively with a draft source (n-gram, draft
model, MTP head, the fast path; jrl.sampling.speculative). launch/simulate.py's SimulatedPrograms
is another: timed waits in place of device calls, around the same host loop.
"""

from __future__ import annotations

import abc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.models.mtp import MtpHead
from jrl.models.nnx_model import as_params
from jrl.sampling import prefix as prefix_programs
from jrl.sampling import slots as slot_programs
from jrl.sampling import speculative as speculative_programs
from jrl.sampling.params import SamplingParams
from jrl.sampling.sample import FINISH_LENGTH, FINISH_STOP, DecodeCounts, Sample
from jrl.sampling.speculative_config import DraftModel, SpeculativeConfig

# (slot, (prompt_id, sample_index, prompt tokens int32 [P], max_new_tokens)): a request seated.
Start = tuple[int, tuple[int, int, np.ndarray, int]]


class SlotPrograms(abc.ABC):
    """What Sampler.serve asks of a device (module docstring). `state` is whatever the
    implementation keeps per slot; the host loop only passes it back."""

    @abc.abstractmethod
    def init_state(self, params) -> Any:
        """Empty slots."""

    def precompile(self, params) -> int:
        """Compile every program serve may call; returns how many (0: nothing to compile)."""
        return 0

    def begin(self) -> None:
        """A serve starts: caches that live for one serve are emptied."""

    @abc.abstractmethod
    def start(self, params, state, starts: list[Start], version: int, seed) -> Any:
        """Seat every (slot, request) of `starts` and draw its first token."""

    def append(self, params, state, resumes: list[tuple[int, np.ndarray]], version: int,
               seed) -> Any:
        """Append each (slot, observation tokens) and draw the slot's next token."""
        raise NotImplementedError(f"{type(self).__name__} runs no multi-turn episodes")

    @abc.abstractmethod
    def decode(self, params, state, version: int, seed, stop_on_finish: bool) -> tuple[Any, Any]:
        """Up to steps_per_call decode steps (fewer once a slot finishes, if stop_on_finish);
        returns (state, steps run)."""

    def refresh(self, params, state, rows: np.ndarray) -> Any:
        """Recompute the KV cache of the live slots `rows` [S] bool with `params`."""
        raise NotImplementedError(f"{type(self).__name__} does not recompute KV caches")

    def weights_changed(self) -> None:
        """New weights arrived: forget what was computed with the old ones."""

    @abc.abstractmethod
    def harvest(self, state, slot_request: list, candidates: list[int]
                ) -> list[tuple[int, Sample]]:
        """(slot, Sample) for each of the `candidates` slots that stopped decoding (a stop
        token or the token limit). Freeing slots is the caller's job."""

    def serve_stats(self, host_stats: dict) -> dict:
        """Counters of the serve that just ended that the device side keeps, merged into
        Sampler.last_stats: prefill_rows (prompts run through the model) and prefix_hits."""
        return dict(prefill_rows=host_stats["prefills"], prefix_hits=0)


class DevicePrograms(SlotPrograms):
    """The jitted programs of a Sampler's slots (jrl.sampling.slots), with the shared-prefill
    pool when share_prefill and speculative decoding when `speculative` is given (its draft
    already split from its weights: SpeculativeConfig.without_weights; draft_model / mtp_head
    carry them). The arguments are the Sampler's (see its docstring)."""

    def __init__(self, config: ModelConfig, contract: NumericalContract,
                 sampling: SamplingParams, *, num_slots: int, max_prompt_len: int,
                 steps_per_call: int, return_entropy: bool, max_observation_len: int,
                 recompute_kv_on_swap: bool, share_prefill: bool, prefix_pool_rows: int,
                 prefill_buckets: str, speculative: SpeculativeConfig | None,
                 draft_model: DraftModel | None, mtp_head: MtpHead | None):
        self.config = config
        self.num_slots, self.max_prompt_len = num_slots, max_prompt_len
        self.steps_per_call, self.return_entropy = steps_per_call, return_entropy
        self.max_observation_len = max_observation_len
        self.recompute_kv_on_swap = recompute_kv_on_swap
        self.share_prefill, self.prefix_pool_rows = share_prefill, prefix_pool_rows
        self.prefill_buckets = prefill_buckets
        self.speculative, self.draft_model, self.mtp_head = speculative, draft_model, mtp_head
        self.fast_path = speculative is not None and speculative.uses_fast_path
        self._pool = None           # the prefix pool of the running serve (device arrays)
        self._prefix_table = prefix_programs.PrefixTable(prefix_pool_rows)
        self._draft_on_device: dict = {}
        self._slot_counts = np.zeros((num_slots, 4), np.int64)   # DecodeCounts per slot
        self._spec_totals = [0, 0, 0, 0]
        self._hits_before = self._fills_before = 0
        self.precompiled = False
        # The seed is a runtime argument, so a new seed per RL step compiles nothing new.
        self.spec = slot_programs.Spec(
            config, contract, sampling.replace(seed=0), num_slots, max_prompt_len,
            config if self.fast_path else None if draft_model is None else draft_model.config,
            mtp=mtp_head is not None, fast_path=self.fast_path)

    def bucket(self, count: int, rows: int) -> int:
        """Rows of a batched prefill, append or pool-fill call for `count` entries of `rows`."""
        return slot_programs.prefill_bucket(count, rows, self.prefill_buckets)

    def init_state(self, params=None) -> slot_programs.SlotState:
        """Empty slots; placed on `params`' device when they live on one, so that every device
        call of a serve sees the same input placement (a new placement is a new compile)."""
        return _on_params_device(slot_programs.init_state(self.spec), params)

    def precompile(self, params) -> int:
        """Compile every device program `serve` may call, for `params`' device; returns how many.

        The prefill programs (one per bucket of waiting prompts: 1, 2, 4, ... num_slots rows),
        the append programs (same buckets) when max_observation_len > 0, decode (with a draft
        model or an MTP head, its drafting and its paused program), and refresh when
        recompute_kv_on_swap.
        Otherwise each bucket compiles the first time that many prompts happen to wait
        together, at some step in the middle of a run (on a 2-core CPU, seconds each), which
        distorts step times. Every call here has only padding rows or inactive slots, so it
        writes nothing; idempotent.
        """
        if self.precompiled:
            return 0
        params = as_params(params)
        spec = self.spec
        seed, version = jnp.uint32(0), jnp.int32(0)
        buckets = sorted({self.bucket(count, self.num_slots)
                          for count in range(1, self.num_slots + 1)})
        state = self.init_state(params)   # one slot state, threaded through every call
        if self.share_prefill:
            pool = self._new_pool(params)
            pool_buckets = sorted({self.bucket(count, self.prefix_pool_rows)
                                   for count in range(1, self.prefix_pool_rows + 1)})
            for bucket in pool_buckets:
                padding = jnp.full((bucket,), self.prefix_pool_rows, jnp.int32)
                pool = prefix_programs.fill(spec, params, pool, padding,
                                            jnp.zeros((bucket, self.max_prompt_len), jnp.int32),
                                            jnp.ones((bucket,), jnp.int32))
        for bucket in buckets:
            padding = jnp.full((bucket,), self.num_slots, jnp.int32)   # rows whose writes drop
            ones = jnp.ones((bucket,), jnp.int32)
            prompts = jnp.zeros((bucket, self.max_prompt_len), jnp.int32)
            if self.share_prefill:
                state = prefix_programs.start(spec, params, state, pool, padding, ones * 0,
                                              prompts, ones, ones, ones, ones, version, seed)
            else:
                state = slot_programs.prefill(spec, params, state, padding, prompts, ones, ones,
                                              ones, ones, version, seed)
            if self.max_observation_len:
                observations = jnp.zeros((bucket, self.max_observation_len), jnp.int32)
                state = slot_programs.append(spec, params, state, padding, observations,
                                             ones, version, seed)
        state, _ = self.decode(params, state, 0, seed, True)
        compiled = len(buckets) * (2 if self.max_observation_len else 1) + 1
        if spec.has_draft_state:
            # decode ran paused_decode (no slot is active); the drafting program is the other.
            state, _, _ = speculative_programs.draft_model_decode(
                spec, self.speculative, params, self._draft_params(params), state, version,
                seed, jnp.int32(self.steps_per_call), jnp.bool_(True))
            compiled += 1
        if self.share_prefill:
            compiled += len(pool_buckets)
        if self.recompute_kv_on_swap:
            state = slot_programs.refresh(spec, params, state,
                                          jnp.zeros((self.num_slots,), bool))
            compiled += 1
        jax.block_until_ready(state)
        self.precompiled = True
        return compiled

    def begin(self) -> None:
        # The prefix pool lives for one serve and holds caches of the current weights only.
        self._spec_totals = [0, 0, 0, 0]
        self._pool = None
        self._prefix_table.clear()
        self._hits_before = self._prefix_table.hits
        self._fills_before = self._prefix_table.fills

    def weights_changed(self) -> None:
        self._prefix_table.clear()

    def serve_stats(self, host_stats: dict) -> dict:
        stats = dict(
            # Prompts run through the model (share_prefill: pool fills; else one per sample).
            prefill_rows=(self._prefix_table.fills - self._fills_before if self.share_prefill
                          else host_stats["prefills"]),
            prefix_hits=self._prefix_table.hits - self._hits_before)
        if self.speculative is not None:
            stats.update(spec_drafted=self._spec_totals[0], spec_accepted=self._spec_totals[1],
                         spec_emitted=self._spec_totals[2], spec_slot_steps=self._spec_totals[3])
        self._pool = None
        return stats

    def decode(self, params, state: slot_programs.SlotState, version: int, seed,
               stop_on_finish: bool) -> tuple[slot_programs.SlotState, jax.Array]:
        """With speculative decoding a step may emit several tokens per slot; its counters go
        to the slots' DecodeCounts."""
        if self.speculative is None:
            return slot_programs.decode(self.spec, params, state, jnp.int32(version), seed,
                                        jnp.int32(self.steps_per_call),
                                        jnp.bool_(stop_on_finish))
        draft_params = self._draft_params(params)
        state, steps, counts = speculative_programs.decode(
            self.spec, self.speculative, params, draft_params, state, jnp.int32(version), seed,
            jnp.int32(self.steps_per_call), jnp.bool_(stop_on_finish))
        counts = np.stack([np.asarray(c) for c in counts], axis=1)          # [S, 4]
        self._slot_counts += counts
        self._spec_totals = [t + int(c) for t, c in zip(self._spec_totals, counts.sum(0))]
        return state, steps

    def _draft_params(self, params):
        """The draft model's (or MTP head's) params on the device of the target's (placed once
        per device: a replica of the async pipeline decodes on its own device), the target's
        own for the fast path (so a weight swap swaps the draft too), or None."""
        if self.fast_path:
            return params
        source = self.draft_model if self.draft_model is not None else self.mtp_head
        if source is None:
            return None
        device = _single_device(params)
        placed = self._draft_on_device.get(device)
        if placed is None:
            placed = _on_params_device(as_params(source.params), params)
            self._draft_on_device[device] = placed
        return placed

    def refresh(self, params, state: slot_programs.SlotState,
                rows: np.ndarray) -> slot_programs.SlotState:
        return slot_programs.refresh(self.spec, params, state, jnp.asarray(rows))

    def append(self, params, state: slot_programs.SlotState,
               resumes: list[tuple[int, np.ndarray]], version: int,
               seed) -> slot_programs.SlotState:
        """One device call for every resume (bucketed like prefill)."""
        bucket = self.bucket(len(resumes), self.num_slots)
        slots = np.full((bucket,), self.num_slots, np.int32)   # padding rows: writes dropped
        observations = np.zeros((bucket, self.max_observation_len), np.int32)
        lens = np.zeros((bucket,), np.int32)
        for row, (slot, observation) in enumerate(resumes):
            slots[row], lens[row] = slot, observation.size
            observations[row, :observation.size] = observation
        return slot_programs.append(self.spec, params, state, jnp.asarray(slots),
                                    jnp.asarray(observations), jnp.asarray(lens),
                                    jnp.int32(version), seed)

    def _new_pool(self, params) -> prefix_programs.Pool:
        return _on_params_device(prefix_programs.init_pool(self.spec, self.prefix_pool_rows),
                                 params)

    def start(self, params, state: slot_programs.SlotState, starts: list[Start], version: int,
              seed) -> slot_programs.SlotState:
        """With share_prefill, each distinct prompt not in the pool is prefilled once (one
        batched call) and every sample starts from its row (one more call); otherwise one
        batched prefill of every request."""
        for slot, _ in starts:
            self._slot_counts[slot] = 0
        if not self.share_prefill:
            return self._prefill_each(params, state, starts, version, seed)
        if self._pool is None:
            self._pool = self._new_pool(params)
        # At most prefix_pool_rows distinct prompts per round (a larger start is split).
        rounds, current, distinct = [], [], set()
        for item in starts:
            key = item[1][2].tobytes()
            if key not in distinct and len(distinct) == self.prefix_pool_rows:
                rounds.append(current)
                current, distinct = [], set()
            distinct.add(key)
            current.append(item)
        rounds.append(current)
        for part in rounds:
            rows, to_fill = self._prefix_table.plan([request[2] for _, request in part])
            if to_fill:
                bucket = self.bucket(len(to_fill), self.prefix_pool_rows)
                fill_rows = np.full((bucket,), self.prefix_pool_rows, np.int32)
                prompts = np.zeros((bucket, self.max_prompt_len), np.int32)
                lens = np.ones((bucket,), np.int32)
                for i, (row, tokens) in enumerate(to_fill):
                    fill_rows[i], lens[i] = row, tokens.size
                    prompts[i, :tokens.size] = tokens
                self._pool = prefix_programs.fill(self.spec, params, self._pool,
                                                  jnp.asarray(fill_rows), jnp.asarray(prompts),
                                                  jnp.asarray(lens))
            slots, prompts, lens, ids, indices, limits = self._start_arrays(part)
            bucket = slots.shape[0]
            pool_rows = np.zeros((bucket,), np.int32)
            pool_rows[:len(rows)] = rows
            state = prefix_programs.start(
                self.spec, params, state, self._pool, jnp.asarray(slots), jnp.asarray(pool_rows),
                jnp.asarray(prompts), jnp.asarray(lens), jnp.asarray(ids), jnp.asarray(indices),
                jnp.asarray(limits), jnp.int32(version), seed)
        return state

    def _start_arrays(self, starts: list[Start]):
        """Host arrays of a bucketed start: slots (padding rows == num_slots), prompts [k, P],
        prompt lens, prompt ids, sample indices, limits."""
        bucket = self.bucket(len(starts), self.num_slots)
        slots = np.full((bucket,), self.num_slots, np.int32)   # padding rows: writes dropped
        prompts = np.zeros((bucket, self.max_prompt_len), np.int32)
        lens, ids, indices, limits = (np.ones((bucket,), np.int32) for _ in range(4))
        for row, (slot, (prompt_id, sample_index, tokens, limit)) in enumerate(starts):
            slots[row], lens[row], ids[row] = slot, tokens.size, prompt_id
            indices[row], limits[row] = sample_index, limit
            prompts[row, :tokens.size] = tokens
        return slots, prompts, lens, ids, indices, limits

    def _prefill_each(self, params, state: slot_programs.SlotState, starts: list[Start],
                      version: int, seed) -> slot_programs.SlotState:
        """Prefill every (slot, request) in `starts` with one batched device call."""
        slots, prompts, lens, ids, indices, limits = self._start_arrays(starts)
        return slot_programs.prefill(
            self.spec, params, state, jnp.asarray(slots), jnp.asarray(prompts),
            jnp.asarray(lens), jnp.asarray(ids), jnp.asarray(indices), jnp.asarray(limits),
            jnp.int32(version), seed)

    def harvest(self, state: slot_programs.SlotState, slot_request: list,
                candidates: list[int]) -> list[tuple[int, Sample]]:
        """Read back to the host: only the stopped slots' rows of the MoE routes."""
        if not candidates:
            return []
        active = np.asarray(state.active)
        stopped_slots = [s for s in candidates if not active[s]]
        if not stopped_slots:
            return []
        host = jax.device_get((state.num_generated, state.stopped, state.tokens, state.logp,
                               state.floor, state.versions, state.entropy, state.is_model))
        num_generated, stopped, tokens, logp, floor, versions, entropy, is_model = host
        routes = (dict(zip(stopped_slots, jax.device_get(
            state.routes[np.asarray(stopped_slots)])))
                  if self.config.has_moe else None)
        out = []
        for slot in stopped_slots:
            prompt_id, sample_index, prompt, _ = slot_request[slot]
            n = int(num_generated[slot])
            out.append((slot, Sample(
                prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=prompt,
                tokens=tokens[slot, :n].copy(), behavior_logp=logp[slot, :n].copy(),
                logit_floor=floor[slot, :n].copy(), versions=versions[slot, :n].copy(),
                entropy=entropy[slot, :n].copy() if self.return_entropy else None,
                finish_reason=FINISH_STOP if stopped[slot] else FINISH_LENGTH,
                model_mask=is_model[slot, :n].copy(),
                experts=None if routes is None else
                routes[slot][prompt.size:prompt.size + n].copy(),
                prompt_experts=None if routes is None else routes[slot][:prompt.size].copy(),
                spec=(DecodeCounts(*(int(c) for c in self._slot_counts[slot]))
                      if self.speculative is not None else None))))
        return out


def _single_device(params):
    """The one device `params` live on, or None (host arrays, or sharded over several)."""
    leaves = jax.tree.leaves(params)
    if leaves and isinstance(leaves[0], jax.Array) and len(leaves[0].devices()) == 1:
        return next(iter(leaves[0].devices()))
    return None


def _on_params_device(tree, params):
    device = _single_device(params)
    return tree if device is None else jax.device_put(tree, device)

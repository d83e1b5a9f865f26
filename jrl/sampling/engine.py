"""Jitted sampler: KV cache per slot, prefill, decode, continuous batching over fixed slots.

Shapes are fixed at construction (num_slots, max_prompt_len, capacity), so a long sequence never
recompiles anything. Every token records its behaviour logprob p_b (from the same token-logprob
kernel the trainer uses, under the same truncation floor), the floor itself, and the policy
version of the weights that produced it. Weights can be swapped between decode calls.

This module is the host side (requests, slots, refills, weight swaps, finished samples); it asks
the device for everything through one interface, jrl.sampling.programs.SlotPrograms, whose real
implementation (DevicePrograms) runs the jitted programs of jrl.sampling.slots.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jrl.checks import check_choice
from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.models.nnx_model import as_params
from jrl.sampling import slots as slot_programs
from jrl.sampling.drafts import check_draft_model, check_mtp_head
from jrl.sampling.speculative_config import SpeculativeConfig
from jrl.sampling.params import SamplingParams
from jrl.sampling.programs import DevicePrograms, SlotPrograms
from jrl.sampling.sample import FINISH_LENGTH, FINISH_STOP, Sample


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
    max_observation_len: the most tokens one observation may append to a multi-turn episode
      (serve's on_turn); the append program's static width. 0: single-turn only.
    share_prefill: prefill each distinct prompt once, into a row of a prefix pool, and copy the
      row into the slot of every sample that starts from it (a GRPO group's G samples, whether
      they start together or as slots free up). Exact: the samples are bit for bit those of
      per-sample prefill (jrl.sampling.prefix). prefix_pool_rows: rows of that pool (default
      max(2, ceil(num_slots / group_size))); a prompt evicted before all its samples started
      is simply prefilled again. The pool is cleared at every weight swap.
    speculative: a jrl.sampling.SpeculativeConfig turns on lossless speculative decoding (off
      by default): each decode step drafts up to k tokens, verifies them in one cached pass of
      the model and keeps those the target's own draw confirms. Its draft says where drafts
      come from, and is the one thing to give:
      - "ngram" (lookup in the sample's own tokens): the samples are bit for bit those of plain
        decoding (tokens, p_b, floors, versions); only the number of device steps changes.
      - a jrl.sampling.DraftModel(config, params): drafts drawn and accepted by rejection
        sampling; the law of the samples is the target's and p_b is the target's own, but the
        tokens differ from plain decoding's (except greedy).
      - the target's multi-token-prediction head, a jrl.models.mtp.MtpHead (e.g. from
        jrl.models.load_hf_mtp on a Qwen3.5 checkpoint): drafts drawn and accepted by rejection
        sampling, or with draft_pick="argmax" a point mass that keeps the samples bit for bit
        those of plain decoding.
      - "fast_path", self-speculative exact decoding: the policy drafts with its own params
        under the fast, non-invariant contract (speculative_config.fast_path_contract), each
        draft drawn with the key the exact path draws that token with and proposed as a point
        mass; the exact path verifies the k + 1 window in one pass. The samples are plain
        exact decoding's bit for bit; the draft's state is one more KV cache of the policy's
        size (SlotState.draft_cache).
      Sample.spec and last_stats count drafts, acceptances and steps.

    programs: the device side (jrl.sampling.programs.SlotPrograms); default the jitted
      programs these options describe (DevicePrograms). A simulation gives its own
      (launch/simulate.py), and the host loop around it is this one.

    prefill_buckets: "powers_of_two" (default): a batched prefill (and append, and pool fill)
      of k waiting entries runs next_power_of_two(k) rows, so at most log2(rows) + 1 programs
      compile per call kind; "one": it always runs all rows, one program per call kind (fewer
      compiles, more padding rows: for short runs where compiling dominates, as on a CPU).
      The samples are the same bits either way.

    After each `generate`, `last_stats` holds counters of that call (prefills, prefill calls
    and the rows of their batches, padding included, prompts run through the model, refills
    into a running batch, decode calls and steps, KV refreshes, generated tokens).
    """

    def __init__(self, config: ModelConfig, contract: NumericalContract,
                 sampling: SamplingParams, *, num_slots: int, max_prompt_len: int,
                 steps_per_call: int = 16, return_entropy: bool = False,
                 recompute_kv_on_swap: bool = False, continuous_batching: bool = True,
                 max_observation_len: int = 0, share_prefill: bool = False,
                 prefix_pool_rows: int | None = None,
                 speculative: SpeculativeConfig | None = None,
                 prefill_buckets: str = "powers_of_two",
                 programs: SlotPrograms | None = None):
        for name, value in (("num_slots", num_slots), ("max_prompt_len", max_prompt_len),
                            ("steps_per_call", steps_per_call)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Sampler.{name}={value!r}: must be a positive int")
        if (not isinstance(max_observation_len, int) or isinstance(max_observation_len, bool)
                or max_observation_len < 0):
            raise ValueError(f"Sampler.max_observation_len={max_observation_len!r}: must be an "
                             "int >= 0 (0: no multi-turn episodes)")
        self.max_observation_len = max_observation_len
        check_choice("Sampler.prefill_buckets", prefill_buckets, slot_programs.PREFILL_BUCKETS)
        self.prefill_buckets = prefill_buckets
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
        self.share_prefill = bool(share_prefill)
        if prefix_pool_rows is None:
            prefix_pool_rows = max(2, -(-num_slots // sampling.group_size))
        if (not isinstance(prefix_pool_rows, int) or isinstance(prefix_pool_rows, bool)
                or prefix_pool_rows <= 0):
            raise ValueError(f"Sampler.prefix_pool_rows={prefix_pool_rows!r}: must be a positive "
                             "int (rows of the shared-prefill pool)")
        self.prefix_pool_rows = prefix_pool_rows
        draft_model = mtp_head = None
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise TypeError(f"Sampler.speculative must be a SpeculativeConfig or None, got "
                                f"{type(speculative).__name__}")
            speculative, draft_model, mtp_head = speculative.without_weights()
            if speculative.draft in ("draft_model", "mtp") and draft_model is mtp_head is None:
                form = ("DraftModel(config, params)" if speculative.draft == "draft_model" else
                        "MtpHead(params) (jrl.models.load_hf_mtp reads a Qwen3.5 checkpoint's "
                        "head)")
                raise ValueError(f"Sampler: speculative.draft={speculative.draft!r} names a "
                                 f"kind of draft; give the draft itself: SpeculativeConfig("
                                 f"draft={form})")
        if draft_model is not None:
            check_draft_model(draft_model, config)
        if mtp_head is not None:
            check_mtp_head(mtp_head, config)
        self.speculative = speculative
        self.draft_model = draft_model
        self.mtp_head = mtp_head
        self.fast_path = speculative is not None and speculative.uses_fast_path
        self.programs: SlotPrograms = programs if programs is not None else DevicePrograms(
            config, contract, sampling, num_slots=num_slots, max_prompt_len=max_prompt_len,
            steps_per_call=steps_per_call, return_entropy=return_entropy,
            max_observation_len=max_observation_len,
            recompute_kv_on_swap=self.recompute_kv_on_swap, share_prefill=self.share_prefill,
            prefix_pool_rows=prefix_pool_rows, prefill_buckets=prefill_buckets,
            speculative=speculative, draft_model=draft_model, mtp_head=mtp_head)
        self.last_stats: dict[str, int] = {}
        self.idle_s = 0.0   # seconds `serve` spent with every slot empty, waiting for requests

    def _bucket(self, count: int, rows: int) -> int:
        """Rows of a batched prefill, append or pool-fill call for `count` entries of `rows`."""
        return slot_programs.prefill_bucket(count, rows, self.prefill_buckets)

    def init_state(self, params=None):
        """Empty slots (SlotPrograms.init_state)."""
        return self.programs.init_state(params)

    def precompile(self, params) -> int:
        """Compile every device program `serve` may call, for `params`' device; returns how
        many (DevicePrograms.precompile says which). Idempotent."""
        return self.programs.precompile(params)

    def generate(self, params, prompts: Sequence[tuple[int, Sequence[int]]], *, version: int = 0,
                 poll_weights: Callable[[], tuple | None] | None = None,
                 max_new_tokens: Sequence[int] | None = None,
                 group_size: int | None = None,
                 on_turn: Callable[[Sample], concurrent.futures.Future] | None = None
                 ) -> list[Sample]:
        """Generate `group_size` samples for each (prompt_id, prompt_tokens).

        group_size: overrides sampling.group_size for this call (host-side only: no recompile),
        e.g. one sample per prompt for evaluation with the rollout sampler.

        prompt ids must be distinct (with the seed they name each sample's PRNG stream).
        max_new_tokens: optional budget per prompt, each in [1, sampling.max_new_tokens] (no
        recompilation: the budget is a per-slot value); default sampling.max_new_tokens.
        poll_weights, if given, is called between device calls; returning (params, version)
        swaps the weights: tokens generated after the swap carry the new version; in-flight
        samples keep their KV cache unless recompute_kv_on_swap. on_turn continues multi-turn
        episodes (see `serve`). Returns samples ordered by (prompt order, sample_index).
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
            self._check_prompt(prompt_id, tokens)
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
                   on_sample=done.append, version=version, poll_weights=poll_weights,
                   on_turn=on_turn)
        done.sort(key=lambda s: order[(s.prompt_id, s.sample_index)])
        return done

    def serve(self, params, *, next_request: Callable[[], tuple | None],
              on_sample: Callable[[Sample], None], version: int = 0,
              poll_weights: Callable[[], tuple | None] | None = None,
              keep_alive: Callable[[], bool] | None = None, idle_wait_s: float = 0.002,
              on_turn: Callable[[Sample], concurrent.futures.Future] | None = None) -> None:
        """Continuous generation from a request source (the streaming form of `generate`).

        next_request() -> (prompt_id, sample_index, prompt_tokens int32 [P], max_new_tokens) or
        None when nothing may start now; it is asked whenever a slot is free. on_sample(sample)
        receives each finished sample. While keep_alive() is true the loop waits for requests
        when idle (polling weights meanwhile); it returns once no slot is busy, next_request()
        gives None and keep_alive() is false. Request ids must be distinct across the call.

        on_turn (multi-turn episodes): when a sample's model turn ends at a stop token (not at
        its token limit), on_turn(partial) gets the sample so far and returns a Future of the
        observation tokens (int32 [m], m <= max_observation_len) to append before the model's
        next turn, or of None to end the episode (then `partial` goes to on_sample as it is).
        The slot stays reserved while the future runs (a tool on a host thread) and the other
        slots keep decoding. max_new_tokens bounds the whole response, observations included:
        an observation that leaves no room for one more model token ends the episode with
        finish_reason "length", unappended.
        """
        if on_turn is not None and not self.max_observation_len:
            raise ValueError("serve(on_turn=...) continues multi-turn episodes: build the "
                             "Sampler with max_observation_len > 0 (the most tokens one "
                             "observation may append)")
        params = as_params(params)
        seed = jnp.uint32(self.sampling.seed)
        stats = dict(prefills=0, prefill_calls=0, prefill_batch_rows=0, refills_while_busy=0,
                     decode_calls=0, refreshes=0, tokens=0, turns_paused=0, appends=0,
                     append_calls=0)
        programs = self.programs
        programs.begin()
        decode_steps = []
        state = self.init_state(params)
        slot_request: list = [None] * self.num_slots
        paused: dict[int, tuple[Sample, concurrent.futures.Future]] = {}
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
                    programs.weights_changed()
                    if self.recompute_kv_on_swap and any(r is not None for r in slot_request):
                        live = np.array([r is not None for r in slot_request])
                        state = programs.refresh(params, state, live)
                        stats["refreshes"] += 1
            decoding = [s for s, r in enumerate(slot_request) if r is not None and s not in paused]
            for slot, sample in programs.harvest(state, slot_request, decoding):
                if on_turn is not None and sample.finish_reason == FINISH_STOP:
                    paused[slot] = (sample, on_turn(sample))
                    stats["turns_paused"] += 1
                else:
                    finished.append(sample)
                    slot_request[slot] = None
            resumes = self._collect_observations(paused, slot_request, finished)
            if resumes:
                state = programs.append(params, state, resumes, version, seed)
                stats["appends"] += len(resumes)
                stats["append_calls"] += 1
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
                    self._check_prompt(request[0], np.asarray(request[2]))
                    starts.append((slot, request))
                if starts:
                    state = programs.start(params, state, starts, version, seed)
                    for slot, request in starts:
                        slot_request[slot] = request
                    stats["prefills"] += len(starts)
                    stats["prefill_calls"] += 1
                    stats["prefill_batch_rows"] += self._bucket(len(starts), self.num_slots)
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
            if all(r is None or s in paused for s, r in enumerate(slot_request)):
                # Every live sample waits for its tool: wait for the first answer, not a decode.
                concurrent.futures.wait([f for _, f in paused.values()], timeout=0.05,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
                continue
            # Return to the host early when a slot frees up or pauses, if there is work for it.
            more = keep_alive() if keep_alive is not None else False
            stop_on_finish = self.continuous_batching
            if not more and waiting is None:
                peek = next_request()
                waiting = peek
                stop_on_finish = stop_on_finish and (peek is not None or on_turn is not None)
            state, steps = programs.decode(params, state, version, seed, stop_on_finish)
            decode_steps.append(steps)
            stats["decode_calls"] += 1
        stats["decode_steps"] = int(sum(int(s) for s in decode_steps))
        stats.update(programs.serve_stats(stats))
        self.last_stats = stats

    def _collect_observations(self, paused: dict, slot_request: list,
                              finished: list) -> list[tuple[int, np.ndarray]]:
        """Settle the paused episodes whose observation is ready: (slot, observation tokens) for
        those that go on; those that end go to `finished` and free their slot."""
        resumes = []
        for slot in [s for s, (_, future) in paused.items() if future.done()]:
            sample, future = paused.pop(slot)
            observation = future.result()   # a failing driver is a bug: let it raise
            if observation is None:
                finished.append(sample)
                slot_request[slot] = None
                continue
            observation = np.asarray(observation, np.int32).reshape(-1)
            if observation.size > self.max_observation_len:
                raise ValueError(
                    f"on_turn gave {observation.size} observation tokens for prompt "
                    f"{sample.prompt_id}; Sampler.max_observation_len="
                    f"{self.max_observation_len} (truncate before returning)")
            if observation.size and not (0 <= observation.min() and
                                         observation.max() < self.config.vocab_size):
                raise ValueError(f"on_turn gave observation token ids outside [0, "
                                 f"{self.config.vocab_size}) for prompt {sample.prompt_id}: "
                                 f"{observation.tolist()}")
            limit = slot_request[slot][3]
            room = min(limit, self.capacity - sample.prompt_tokens.size)
            if sample.length + observation.size + 1 > room:
                finished.append(dataclasses.replace(sample, finish_reason=FINISH_LENGTH))
                slot_request[slot] = None
                continue
            resumes.append((slot, observation))
        return resumes

    def _check_prompt(self, prompt_id, tokens: np.ndarray) -> None:
        """ValueError naming the prompt unless tokens is a non-empty 1-D sequence of at most
        max_prompt_len ids (the fixed prompt shape of the prefill programs)."""
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError(f"prompt {prompt_id}: tokens must be a non-empty 1-D sequence")
        if tokens.size > self.max_prompt_len:
            raise ValueError(f"prompt {prompt_id} has {tokens.size} tokens, more than "
                             f"Sampler.max_prompt_len={self.max_prompt_len} "
                             "(rollout.max_prompt_len)")

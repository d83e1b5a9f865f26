"""Lossless speculative decoding: drafted tokens verified in one cached pass of the target model,
accepted by rejection sampling against the target distribution, with exact p_b.

One step for every decoding slot (state: last_token at `position`, not yet in the cache):

1. A draft source proposes up to k tokens d_1 .. d_k (`NgramDraft`: the continuation of the
   latest earlier occurrence of the slot's last n tokens in its own prompt + response; no extra
   model).
2. The target runs [last_token, d_1 .. d_k] at positions p .. p + k through the same cached
   forward as prefill, decode and append (one pass, the same kernels). Stage consistency: the
   hidden state at offset i is, bit for bit, the one one-by-one decoding computes after
   feeding last_token, d_1 .. d_i; so are the logits, the top-k / top-p floor and the token
   logprob (p_b) drawn from them (DESIGN.md, "Verify passes").
3. Acceptance at offset i, against the target distribution q_i (softmax of the tempered logits
   z_i over {z_i >= floor_i}, the distribution jrl replays in the trainer).

   Deterministic draft (a point mass on d): the standard rule (Leviathan et al. 2023, Chen et
   al. 2023) accepts d with probability min(1, q(d) / 1) = q(d) and otherwise samples from the
   residual norm(max(0, q - delta_d)) = q restricted to x != d, renormalised. jrl realises it
   with the draw plain decoding makes anyway: x_i = argmax_{z >= floor}(z_i + g_i), where g_i
   is the Gumbel noise of the sample's own key (seed, prompt_id, sample_index, token index).
   By the Gumbel-max theorem x_i ~ q_i, so
       P(accept) = P(x_i = d) = q_i(d),
       P(x_i = y | rejected) = q_i(y) / (1 - q_i(d)) for y != d,     the residual,
   and the emitted token has law q_i(d) [y = d] + (1 - q_i(d)) q_i(y) / (1 - q_i(d)) = q_i(y).
   The step emits x_0 .. x_a, where a is the number of leading offsets whose draw equals the
   draft (x_i = d_{i+1} for i < a): the accepted drafts, then the correction (or, when every
   draft was accepted, the bonus token x_k). Because every x_i is the very draw plain decoding
   makes for that token index on the same logits, speculative decoding with a deterministic
   draft emits, token for token and bit for bit, what plain decoding emits with the same seed:
   tokens, p_b, floors, entropies and versions.

   Stochastic draft (a draft model sampling d ~ p): accept d with probability
   min(1, q(d) / p(d)) (a uniform from the sample's key), on rejection draw from
   norm(max(0, q - p)) (`accept_stochastic`). The emitted law is again exactly q; the samples
   are then reproducible per seed but differ from plain decoding's.

4. Rollback: the cache keeps the K/V of last_token and the accepted drafts (`lengths`); entries
   of rejected drafts sit past it and are invalid (they are rewritten before they are ever
   visible). Gated DeltaNet layers hold a recurrent state (the conv inputs and the canonical
   chunk's state and rows), which the verify pass advances over every fed token. Their cache
   is rolled back inside the step: the verify pass returns its chunk window pending
   (transformer.forward(pending=True)), and transformer.settle_cache keeps the rows of
   last_token and the accepted drafts, the conv inputs before the first rejected one, and the
   state at the start of the kept end's chunk (the pass's own state, or the pre-verify one
   when only rejected drafts crossed a chunk boundary; k + 1 <= delta_chunk, so the window
   spans at most two chunks). The delta rule's windows are stage-consistent
   (jrl.kernels.gated_delta_rule), so that cache is the one one-by-one decoding leaves, bit for
   bit, with no second forward. (With k + 1 > delta_chunk the kept tokens are fed again.)

When no slot has a draft the step is the plain decode step (no wider pass), so a workload whose
drafts never match pays only the (cheap) n-gram search.

Draft sources are pluggable (`DraftSource`): propose(spec, params, state, num_draft) -> Drafts.

A draft model (`DraftModel`: a small decoder with the target's vocabulary, e.g. SmolLM2-135M
drafting for a larger SmolLM2) keeps a KV cache of its own in the slot state
(SlotState.draft_cache). Each step it first feeds the history it has not seen yet (a new
prompt, an appended observation, the bonus token of a fully accepted step) in chunks of
`draft_catch_up` tokens, then draws d_1 .. d_k one token at a time from its own tempered,
top-k / top-p truncated distribution p (keys of the sample's (seed, prompt_id, sample_index,
token index), tagged). The target accepts them by `accept_stochastic`, so the emitted law is
the target's; with greedy sampling the draft is its argmax (a point mass) and the samples are
plain decoding's. After verification the draft cache is rolled back to the kept tokens: it
holds last_token and d_1 .. d_{k-1}, of which the kept ones lead, so an attention-only draft
shortens its lengths and a Gated DeltaNet draft (Qwen3.5-0.8B for a larger Qwen3.5) feeds the
kept ones again from its pre-draft cache. A draft whose tokens the target mostly rejects
would slow decoding down (each drafting step costs several plain ones), so each slot keeps a
record of its acceptance (SlotState.draft_gate) and pauses drafting while it is poor, probing
again after an exponentially growing pause that ends on a step shared with the other paused
slots (update_draft_gate). While every active slot is paused, decode runs a program of plain
steps (paused_decode) in which the draft model does not run, up to the end of the first
pause. Which steps draft never changes the law of the samples, only how fast they come.

The target's MTP head (Qwen3.5's multi-token-prediction head, jrl.models.mtp; draft="mtp",
Sampler(mtp_head=...)) drafts the same way, with the same gate and programs (`mtp_drafts`).
It reads the target's own hidden states, which every stage of the sampler records per
position (SlotState.target_hidden), keeps a one-layer KV cache of its own, and picks its
drafts as a draft model does (drawn, or with draft_pick="argmax" a point mass that keeps the
samples plain decoding's, token for token and bit for bit). Rollback is a length: the head's
cache keeps the pairs of the target's hidden states, and the next step's catch-up writes the
kept tokens' pairs over the drafted ones.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels
from jrl.checks import check_range
from jrl.metrics import names
from jrl.models import mtp, transformer
from jrl.models.config import ModelConfig
from jrl.sampling.slots import (DraftGate, Pick, SlotState, Spec, decode_step, pick_tokens,
                                sample_keys, store_hidden, token_routes)
from jrl.sampling.truncation import logit_floor, sample_from_floor

DRAFT_SOURCES = ("ngram", "draft_model", "mtp")
DELTANET_ROLLBACKS = ("settle", "refeed")
DRAFT_PICKS = ("draw", "argmax")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for `Sampler(speculative=...)` (hashable: part of the jit key).

    draft: "ngram" (prompt / n-gram lookup, no extra model), "draft_model" (the DraftModel
      given to the Sampler as draft_model=: drawn drafts, accepted by rejection sampling),
      "mtp" (the target's multi-token-prediction head, given as mtp_head=), or a DraftSource
      instance (hashable, e.g. a frozen dataclass) for a source of your own.
    draft_pick (draft="draft_model" or "mtp"): "draw" samples each draft from the draft's own
      tempered, truncated distribution p and accepts it by rejection sampling (accept
      probability min(1, q/p): high when p is close to q); "argmax" proposes the draft's most
      likely token, a point mass accepted with probability q(d) by plain decoding's own draw,
      so the samples are plain decoding's bit for bit (fewer accepted drafts when q is not
      peaked). Greedy sampling always takes the argmax.
    num_draft: k, the most tokens drafted and verified per step (the verify pass is k + 1 wide).
    ngram_max / ngram_min: the longest and shortest suffix of the slot's tokens looked up in its
      own prompt + response; the longest suffix with an earlier occurrence wins, the latest
      occurrence of it, and its continuation (up to k known tokens) is the draft.
    deltanet_rollback (models with Gated DeltaNet layers): "settle" rolls their cache back to
      the kept tokens from the verify pass's own record (one forward per step; needs
      k + 1 <= contract.delta_chunk, else the step refeeds), "refeed" feeds the kept tokens
      again from the pre-verify cache (a second forward). Both give the same bits; refeed is
      the baseline of launch/bench_speed.py's hybrid pair.
    draft_catch_up (draft="draft_model" or "mtp"): the width of the draft's catch-up forward,
      which feeds it the history it has not seen (a prompt takes ceil(P / width) of them; the
      MTP head's per-step catch-up of the tokens the last step kept is k + 1 wide).
    draft_min_accept / draft_backoff (draft="draft_model" or "mtp"): a slot whose decayed
      acceptance rate (accepted / verified drafts) falls below draft_min_accept stops drafting for
      about draft_backoff steps, then probes again; each further poor probe doubles the pause
      (up to 2**5 x), and pauses end on common steps (multiples of the pause on a clock the
      slots share), so that slots probe together. A step where no slot drafts skips the draft
      model altogether: a draft that is rejected costs only its probes. A drafting step costs
      c plain steps and emits 1 + k * rate tokens, so drafting pays above rate (c - 1) / k: c
      was 3.1 on a 2-core CPU (0.53 at k = 4); a memory-bound accelerator's c is smaller. 0.0
      never switches off.
    """

    draft: "str | DraftSource" = "ngram"
    num_draft: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    deltanet_rollback: str = "settle"
    draft_catch_up: int = 16
    draft_min_accept: float = 0.5
    draft_backoff: int = 16
    draft_pick: str = "draw"

    def __post_init__(self):
        if not isinstance(self.draft, str):
            if not callable(getattr(self.draft, "propose", None)):
                raise ValueError(f"SpeculativeConfig.draft={self.draft!r}: a DraftSource needs "
                                 "a propose(spec, params, state, num_draft, seed) method")
        elif self.draft not in DRAFT_SOURCES:
            raise ValueError(f"SpeculativeConfig.draft={self.draft!r}: allowed values are "
                             f"{list(DRAFT_SOURCES)}")
        check_range("SpeculativeConfig.draft_min_accept", self.draft_min_accept, low=0, high=1)
        for name in ("num_draft", "ngram_max", "ngram_min", "draft_catch_up", "draft_backoff"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"SpeculativeConfig.{name}={value!r}: must be a positive int")
        if self.draft_pick not in DRAFT_PICKS:
            raise ValueError(f"SpeculativeConfig.draft_pick={self.draft_pick!r}: allowed values "
                             f"are {list(DRAFT_PICKS)}")
        if self.draft_pick != "draw" and not self.keeps_draft_state:
            raise ValueError(f"SpeculativeConfig.draft_pick={self.draft_pick!r} is for "
                             "draft='draft_model' or 'mtp' (the n-gram draft and a DraftSource "
                             f"pick their own drafts); got draft={self.draft!r}")
        if self.deltanet_rollback not in DELTANET_ROLLBACKS:
            raise ValueError(f"SpeculativeConfig.deltanet_rollback={self.deltanet_rollback!r}: "
                             f"allowed values are {list(DELTANET_ROLLBACKS)}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"SpeculativeConfig.ngram_min={self.ngram_min} > ngram_max="
                             f"{self.ngram_max}")

    @property
    def uses_draft_model(self) -> bool:
        return isinstance(self.draft, str) and self.draft == "draft_model"

    @property
    def uses_mtp(self) -> bool:
        return isinstance(self.draft, str) and self.draft == "mtp"

    @property
    def keeps_draft_state(self) -> bool:
        """The draft has a cache and a gate of its own in the slot state (a draft model or
        the MTP head): steps run draft_model_step, chosen between two programs."""
        return self.uses_draft_model or self.uses_mtp

    def source(self) -> "DraftSource":
        if not isinstance(self.draft, str):
            return self.draft
        if self.keeps_draft_state:
            raise ValueError(f"SpeculativeConfig.draft={self.draft!r} keeps a cache of its own; "
                             "it is not a stateless DraftSource")
        return NgramDraft(self.ngram_max, self.ngram_min)


class DraftModel(NamedTuple):
    """The draft model of `SpeculativeConfig(draft="draft_model")`, given to the Sampler as
    draft_model=: config (any decoder jrl runs, with the target's vocab_size; a Gated
    DeltaNet draft pays one more draft forward per step) and its params. It runs under the
    target's numerical contract; its bits affect only which drafts are proposed, never the
    law or the p_b of the emitted tokens."""

    config: ModelConfig
    params: Any


def check_draft_model(draft: DraftModel, target: ModelConfig) -> None:
    """One clear message for a draft model the sampler cannot use."""
    if not isinstance(draft, DraftModel):
        raise TypeError(f"Sampler.draft_model must be a jrl.sampling.speculative.DraftModel("
                        f"config, params), got {type(draft).__name__}")
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(f"Sampler.draft_model: vocab_size {draft.config.vocab_size} differs from "
                         f"the target's {target.vocab_size}; a draft must share the vocabulary")


# ---------------------------------------------------------------------------------------------
# Draft sources


class Drafts(NamedTuple):
    """tokens [S, k] int32 (entries at or past `count` are ignored); count [S] int32 in [0, k];
    probs [S, k, V] float32: the distribution each token was drawn from, or None for a
    deterministic draft (a point mass)."""

    tokens: jax.Array
    count: jax.Array
    probs: jax.Array | None = None


class DraftSource(Protocol):
    """A device-side draft proposer (hashable: a static argument of the jitted decode).

    propose(spec, params, state, num_draft, seed) -> Drafts for every slot, traced inside the
    decode loop: params are the target's (a stateless source; a draft model with a cache of
    its own is draft="draft_model", DraftModel); seed is the sampler's, for sources that draw
    (derive keys from (seed, prompt_id, sample_index, token index), as slots.sample_keys
    does, so the samples stay reproducible per seed). A drawn draft returns its probs."""

    def propose(self, spec: Spec, params, state: SlotState, num_draft: int, seed) -> Drafts: ...


@dataclasses.dataclass(frozen=True)
class NgramDraft:
    """Prompt / n-gram lookup (as in prompt-lookup decoding): the draft continues the latest
    earlier occurrence of the slot's last n tokens in its own history (prompt + response)."""

    max_n: int = 3
    min_n: int = 1

    def propose(self, spec: Spec, params, state: SlotState, num_draft: int, seed) -> Drafts:
        del spec, params, seed
        return ngram_drafts(state.history, state.position, num_draft, self.max_n, self.min_n)


def ngram_drafts(history: jax.Array, position: jax.Array, num_draft: int, max_n: int,
                 min_n: int) -> Drafts:
    """history [S, C] int32 (valid at [0, position]), position [S] -> Drafts.

    For n = max_n .. min_n, the suffix history[p-n+1 .. p] is looked up at every earlier end
    j < p (j - n + 1 >= 0); the longest n with a match wins, the latest j for it, and the draft
    is history[j+1 .. min(j+k, p)] (count = min(k, p - j) known tokens)."""
    slots, capacity = history.shape
    ends = jnp.arange(capacity, dtype=jnp.int32)[None, :]                         # [1, C]
    best_end = jnp.full((slots,), -1, jnp.int32)
    found = jnp.zeros((slots,), bool)
    for n in range(max_n, min_n - 1, -1):
        match = (ends < position[:, None]) & (ends >= n - 1) & (position[:, None] >= n - 1)
        for i in range(n):
            suffix = jnp.take_along_axis(history, jnp.maximum(position - i, 0)[:, None], 1)
            shifted = jnp.roll(history, i, axis=1)      # shifted[:, j] = history[:, j - i]
            match = match & (shifted == suffix)
        latest = jnp.max(jnp.where(match, ends, -1), axis=1)
        take = ~found & (latest >= 0)
        best_end = jnp.where(take, latest, best_end)
        found = found | take
    offsets = jnp.arange(1, num_draft + 1, dtype=jnp.int32)[None, :]
    index = jnp.clip(best_end[:, None] + offsets, 0, capacity - 1)
    tokens = jnp.take_along_axis(history, index, axis=1)
    count = jnp.where(found, jnp.minimum(num_draft, position - best_end), 0).astype(jnp.int32)
    return Drafts(tokens, count)


def draft_model_drafts(spec: Spec, config: SpeculativeConfig, draft_params, state: SlotState,
                       drafting, seed) -> tuple[Drafts, transformer.Cache, transformer.Cache]:
    """k drafts per drafting slot (drafting [S] bool: decoding and not switched off) from the
    draft model (spec.draft_config), and its caches; other slots' draft caches are untouched.

    First the catch-up: while a drafting slot's draft cache lags its history (lengths <
    position), history[lengths .. lengths + W) is fed (W = config.draft_catch_up, tokens at or
    past `position` masked). Then k one-token steps from last_token at p = position: step i
    feeds (last_token, d_1 .. d_{k-1})[i] at p + i and draws d_{i+1} from the draft's
    p_i = softmax(z) over {z >= floor} (z: its tempered logits, floor: top-k / top-p as the
    target's sampling params), with the key of token index num_generated + i tagged
    _DRAFT_TAG (pick_draft); greedy sampling or config.draft_pick="argmax" takes the argmax
    and returns no probs (a point mass). Returns
    (Drafts with count k for drafting slots, 0 otherwise; the cache after the drafts, lengths
    p + k; the cache after the catch-up, lengths p)."""
    k = config.num_draft
    draft_config = spec.draft_config
    capacity = spec.capacity
    position = state.position

    def feed(cache, tokens, positions, mask):
        return transformer.forward(draft_params, draft_config, tokens, contract=spec.contract,
                                   positions=positions, mask=mask, cache=cache)

    width = config.draft_catch_up
    lagging = lambda cache: drafting & (cache.lengths < position)

    def catch_up(cache):
        positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        tokens = jnp.take_along_axis(state.history, jnp.minimum(positions, capacity - 1), 1)
        mask = lagging(cache)[:, None] & (positions < position[:, None])
        return feed(cache, tokens, positions, mask).cache

    caught_up = jax.lax.while_loop(lambda c: jnp.any(lagging(c)), catch_up, state.draft_cache)

    def step(i, carry):
        cache, token, tokens, probs = carry
        at = position + i
        out = feed(cache, token[:, None], at[:, None], (drafting & (at < capacity))[:, None])
        logits = transformer.logits_from_hidden(draft_params, out.hidden[:, 0],
                                                contract=spec.contract)
        drawn, probs = pick_draft(spec, config, logits, state, i, seed, probs)
        return out.cache, drawn, tokens.at[:, i].set(drawn), probs

    cache, _, tokens, probs = jax.lax.fori_loop(
        0, k, step, (caught_up, state.last_token, jnp.zeros((spec.num_slots, k), jnp.int32),
                     empty_draft_probs(spec, config, draft_config.vocab_size)))
    count = jnp.where(drafting, k, 0).astype(jnp.int32)
    return Drafts(tokens, count, probs if draws(spec, config) else None), cache, caught_up


def draws(spec: Spec, config: SpeculativeConfig) -> bool:
    """Whether a draft model's / MTP head's drafts are drawn (else argmax picks)."""
    return not spec.sampling.greedy and config.draft_pick == "draw"


def empty_draft_probs(spec: Spec, config: SpeculativeConfig, vocab: int) -> jax.Array:
    """The [S, k, V] buffer of drawn drafts' p ([S, k, 0] for argmax picks)."""
    width = vocab if draws(spec, config) else 0
    return jnp.zeros((spec.num_slots, config.num_draft, width), jnp.float32)


def pick_draft(spec: Spec, config: SpeculativeConfig, logits, state: SlotState, i, seed,
               probs) -> tuple[jax.Array, jax.Array]:
    """Draft i [S] int32 from a draft's logits [S, V], and probs [S, k, V] with row i set.

    Drawn (draws): from p = softmax(z) over {z >= floor} (z: the logits tempered as the
    target's, floor: the target's top-k / top-p rule), with the key of token index
    num_generated + i tagged _DRAFT_TAG. Else the argmax of z (the floor keeps it; z, as the
    target's greedy pick takes it), probs as given."""
    sp = spec.sampling
    z = logits * kernels.reference.inverse_temperature(sp.temperature)
    if not draws(spec, config):
        return jnp.argmax(z, axis=-1).astype(jnp.int32), probs
    floor = logit_floor(z, top_k=sp.top_k, top_p=sp.top_p)
    keys = sample_keys(seed, state.prompt_id, state.sample_index, state.num_generated + i)
    keys = jax.vmap(lambda key: jax.random.fold_in(key, _DRAFT_TAG))(keys)
    drawn = sample_from_floor(keys, z, floor)
    kept = jnp.where(z >= floor[:, None], z, -jnp.inf)
    return drawn, probs.at[:, i].set(jax.nn.softmax(kept, axis=-1))


def settle_draft_cache(spec: Spec, draft_params, before: SlotState, drafts: Drafts,
                       drafted: transformer.Cache, caught_up: transformer.Cache,
                       emitted: jax.Array, drafting: jax.Array) -> transformer.Cache:
    """The draft cache of the kept tokens after a verify step that emitted `emitted` [S]
    (slots that did not draft, drafting [S] False, keep theirs).

    The draft fed last_token, d_1 .. d_{k-1} at p .. p + k - 1 (p = before.position), and
    the first keep = min(emitted, k) of them are the slot's history (emitted - 1 accepted
    drafts lead; a fully accepted step's bonus token was never fed: it is caught up on the
    next step). Attention-only drafts keep the drafted cache with lengths p + keep (entries
    past it are invalid). A draft with Gated DeltaNet layers advanced a recurrent state over
    every draft it fed, so its keep tokens are fed again, in one forward from the caught-up
    cache (one more draft forward per step)."""
    k = drafts.tokens.shape[1]
    keep = jnp.where(drafting, jnp.minimum(emitted, k), 0)
    if not spec.draft_config.has_deltanet:
        lengths = jnp.where(drafting, before.position + keep, drafted.lengths)
        return drafted._replace(lengths=lengths.astype(jnp.int32))
    offsets = jnp.arange(k, dtype=jnp.int32)[None, :]
    chunk = jnp.concatenate([before.last_token[:, None], drafts.tokens[:, :k - 1]], axis=1)
    positions = before.position[:, None] + offsets
    mask = (offsets < keep[:, None]) & (positions < spec.capacity)
    return transformer.forward(draft_params, spec.draft_config, chunk, contract=spec.contract,
                               positions=positions, mask=mask, cache=caught_up).cache


def mtp_drafts(spec: Spec, config: SpeculativeConfig, head, params, state: SlotState,
               drafting, seed) -> tuple[Drafts, transformer.Cache, transformer.Cache]:
    """k drafts per drafting slot (drafting [S] bool) from the target's MTP head (head: its
    params, jrl.models.mtp), and the head's caches; other slots' caches are untouched.

    The head's cache holds the pairs (h_i, x_{i+1}) at positions i < lengths (h: the target's
    hidden states, state.target_hidden; x: state.history). First the catch-up to i = p - 1
    (p = position, x_p = last_token): chunks of config.draft_catch_up pairs while a drafting
    slot lags by more than k + 1 (a new prompt, an observation, a pause), then one chunk of
    k + 1 (the tokens the last step kept: at most k + 1). Its output o at i = p - 1 gives
    d_1 from logits o @ lm_head; d_{j+1} comes from the head on the pair (o_prev, d_j) at
    position p - 1 + j (its own output fed back), j = 1 .. k - 1. Each is picked as a draft
    model's (pick_draft: drawn from the head's tempered, truncated p, or its argmax with
    config.draft_pick="argmax", a point mass that keeps the samples plain decoding's).
    Returns (Drafts with count k for drafting slots, 0 otherwise; the cache after the
    drafts; the cache after the catch-up, lengths p)."""
    k = config.num_draft
    capacity = spec.capacity
    position = state.position
    slots = jnp.arange(spec.num_slots)

    def chunk(carry, width):
        cache, last_out = carry
        lagging = drafting & (cache.lengths < position)
        positions = cache.lengths[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
        clipped = jnp.minimum(positions, capacity - 1)
        tokens = jnp.take_along_axis(state.history, jnp.minimum(positions + 1, capacity - 1), 1)
        hidden = state.target_hidden[slots[:, None], clipped]                     # [S, W, D]
        mask = lagging[:, None] & (positions < position[:, None])
        out, cache = mtp.forward(head, params, spec.config, tokens, hidden,
                                 contract=spec.contract, positions=positions, mask=mask,
                                 cache=cache)
        at = position - 1 - positions[:, 0]                    # offset of pair p - 1
        here = lagging & (at >= 0) & (at < width)
        picked = out[slots, jnp.clip(at, 0, width - 1)]
        return cache, jnp.where(here[:, None], picked, last_out)

    wide, narrow = config.draft_catch_up, k + 1
    far_behind = lambda carry: jnp.any(drafting & (carry[0].lengths < position - narrow))
    last_out = jnp.zeros((spec.num_slots, spec.config.hidden_size), spec.contract.compute)
    carry = jax.lax.while_loop(far_behind, lambda c: chunk(c, wide),
                               (state.draft_cache, last_out))
    caught_up, last_out = chunk(carry, narrow)

    def draft(out, j, probs):
        logits = mtp.logits(params, out, contract=spec.contract)
        return pick_draft(spec, config, logits, state, j, seed, probs)

    def step(j, carry):
        cache, out, token, tokens, probs = carry
        at = position - 1 + j
        mask = (drafting & (at < capacity))[:, None]
        out, cache = mtp.forward(head, params, spec.config, token[:, None], out[:, None],
                                 contract=spec.contract, positions=at[:, None], mask=mask,
                                 cache=cache)
        drawn, probs = draft(out[:, 0], j, probs)
        return cache, out[:, 0], drawn, tokens.at[:, j].set(drawn), probs

    first, probs = draft(last_out, 0, empty_draft_probs(spec, config, spec.config.vocab_size))
    tokens = jnp.zeros((spec.num_slots, k), jnp.int32).at[:, 0].set(first)
    cache, _, _, tokens, probs = jax.lax.fori_loop(1, k, step,
                                                   (caught_up, last_out, first, tokens, probs))
    count = jnp.where(drafting, k, 0).astype(jnp.int32)
    return Drafts(tokens, count, probs if draws(spec, config) else None), cache, caught_up


_DRAFT_TAG = 0xD2AF7


# ---------------------------------------------------------------------------------------------
# Acceptance


def accept_stochastic(keys: jax.Array, z: jax.Array, floor: jax.Array, draft: jax.Array,
                      draft_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Standard speculative sampling for a drawn draft (Leviathan et al. 2023, Chen et al. 2023).

    keys [N] (one per position); z [N, V] tempered target logits, floor [N] (the target is
    q = softmax(z) over {z >= floor}); draft [N] int32 drawn from draft_probs [N, V] (p).
    Accept with probability min(1, q(d) / p(d)); else draw from norm(max(0, q - p)).
    Returns (token [N] int32, accepted [N] bool). The token's law is exactly q (up to float32
    rounding of q and p). A point-mass p reduces this to the Gumbel-coupled rule of the module
    docstring: accept with probability q(d), else the renormalised q without d.
    """
    kept = z >= floor[:, None]
    q = jax.nn.softmax(jnp.where(kept, z, -jnp.inf), axis=-1)
    rows = jnp.arange(z.shape[0])
    q_d, p_d = q[rows, draft], draft_probs[rows, draft]
    accept_key, residual_key = jax.vmap(lambda k: tuple(jax.random.split(k)))(keys)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(accept_key)
    accepted = u * p_d < q_d                      # u < q / p without dividing by a tiny p
    residual = jnp.maximum(q - draft_probs, 0.0)
    # Where q <= p everywhere (only possible if q == p), acceptance is certain; keep a finite
    # fallback so the unused branch stays well defined.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, q)
    gumbel = jax.vmap(lambda k, row: jax.random.gumbel(k, row.shape, jnp.float32))(
        residual_key, residual)
    resampled = jnp.argmax(jnp.where(residual > 0, jnp.log(residual) + gumbel, -jnp.inf), -1)
    return jnp.where(accepted, draft, resampled.astype(jnp.int32)), accepted


class StepCounts(NamedTuple):
    """Per-slot counters of a decode call, [S] int32 each: drafted tokens, accepted drafts,
    tokens emitted, device steps the slot decoded in."""

    drafted: jax.Array
    accepted: jax.Array
    emitted: jax.Array
    steps: jax.Array


def zero_counts(num_slots: int) -> StepCounts:
    return StepCounts(*(jnp.zeros((num_slots,), jnp.int32) for _ in range(4)))


def record_tokens(spec: Spec, state: SlotState, picks: Pick, count: jax.Array,
                  version) -> SlotState:
    """Store the first count[s] picks [S, W] of every slot s, advance it and finish it.

    Equal to count[s] successive slots.record_pick calls: the caller guarantees that only the
    last stored token may be a stop token and that every token fits the slot's limit and
    capacity."""
    sp = spec.sampling
    slots, width = picks.token.shape
    rows = jnp.broadcast_to(jnp.arange(slots)[:, None], (slots, width))
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    write = j < count[:, None]
    cols = jnp.where(write, state.num_generated[:, None] + j, sp.max_new_tokens)
    history_cols = jnp.where(write, state.position[:, None] + 1 + j, spec.capacity)
    last = jnp.take_along_axis(picks.token, jnp.maximum(count - 1, 0)[:, None], 1)[:, 0]
    stop_ids = jnp.asarray(sp.stop_tokens or (-1,), jnp.int32)
    is_stop = jnp.any(last[:, None] == stop_ids[None, :], axis=-1)
    wrote = count > 0
    num_generated = state.num_generated + count
    position = state.position + count
    out_of_room = (num_generated >= state.limit) | (position + 1 >= spec.capacity)
    finished = wrote & (is_stop | out_of_room)
    versions = jnp.broadcast_to(jnp.asarray(version, jnp.int32), (slots, width))
    return state._replace(
        last_token=jnp.where(wrote, last, state.last_token),
        position=position,
        num_generated=num_generated,
        active=jnp.where(wrote, ~finished, state.active),
        stopped=jnp.where(wrote, is_stop, state.stopped),
        history=state.history.at[rows, history_cols].set(picks.token, mode="drop"),
        tokens=state.tokens.at[rows, cols].set(picks.token, mode="drop"),
        logp=state.logp.at[rows, cols].set(picks.logp, mode="drop"),
        floor=state.floor.at[rows, cols].set(picks.floor, mode="drop"),
        versions=state.versions.at[rows, cols].set(versions, mode="drop"),
        entropy=state.entropy.at[rows, cols].set(picks.entropy, mode="drop"),
        is_model=state.is_model.at[rows, cols].set(True, mode="drop"),
    )


def verify_step(spec: Spec, config: SpeculativeConfig, params, state: SlotState, drafts: Drafts,
                version, seed) -> tuple[SlotState, StepCounts]:
    """Verify `drafts` of every decoding slot in one cached pass and emit the accepted tokens
    plus one more (the correction or the bonus token); see the module docstring."""
    sp = spec.sampling
    k = config.num_draft
    slots = spec.num_slots
    active = state.active
    # Room for the tokens this step may emit (>= 1 for a decoding slot): all must fit the
    # slot's limit and capacity, so at most room - 1 drafts are verified.
    room = jnp.minimum(state.limit - state.num_generated, spec.capacity - 1 - state.position)
    count = jnp.where(active, jnp.clip(jnp.minimum(drafts.count, room - 1), 0, k), 0)
    offsets = jnp.arange(k + 1, dtype=jnp.int32)
    chunk = jnp.concatenate([state.last_token[:, None], drafts.tokens], axis=1)    # [S, k+1]
    positions = state.position[:, None] + offsets[None, :]
    mask = active[:, None] & (offsets[None, :] <= count[:, None])
    # Gated DeltaNet layers advance their state over every fed token, rejected drafts
    # included: a window of at most one delta chunk comes back pending and is settled to the
    # kept tokens below (wider windows are fed again instead).
    settle = (spec.config.has_deltanet and config.deltanet_rollback == "settle"
              and k + 1 <= spec.contract.delta_chunk)
    out = transformer.forward(params, spec.config, chunk, contract=spec.contract,
                              positions=positions, mask=mask, cache=state.cache,
                              pending=settle)
    hidden, cache = out.hidden, out.cache
    flat = lambda x: jnp.broadcast_to(x[:, None], (slots, k + 1)).reshape(-1)
    steps = (state.num_generated[:, None] + offsets[None, :]).reshape(-1)
    pick = pick_tokens(spec, params, hidden.reshape(slots * (k + 1), -1), seed,
                       flat(state.prompt_id), flat(state.sample_index), steps)
    pick = Pick(*(x.reshape(slots, k + 1) for x in pick))
    if drafts.probs is not None:
        pick = _stochastic_acceptance(spec, params, state, hidden[:, :k], pick, drafts, count,
                                      seed)
    token = pick.token
    # a = leading offsets whose draw equals the draft; emit x_0 .. x_a.
    matches = (token[:, :k] == drafts.tokens) & (offsets[None, :k] < count[:, None])
    accepted = jnp.sum(jnp.cumprod(matches.astype(jnp.int32), axis=1), axis=1)
    emit = accepted + 1
    # A stop token ends the sample where it is drawn, accepted draft or not.
    stop_ids = jnp.asarray(sp.stop_tokens or (-1,), jnp.int32)
    is_stop = jnp.any(token[..., None] == stop_ids, axis=-1) & (offsets[None, :] < emit[:, None])
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1), k)
    emit = jnp.where(active, jnp.minimum(emit, first_stop + 1), 0).astype(jnp.int32)
    # The fed tokens that stay: last_token and the accepted drafts (emit is 0 for idle slots).
    fed = offsets[None, :] < emit[:, None]
    if settle:
        # The cache of feeding the kept tokens alone, from the verify pass's own record: stage
        # consistency makes it, bit for bit, the one one-by-one decoding leaves.
        cache = transformer.settle_cache(spec.config, cache, state.cache, emit)
    elif spec.config.has_deltanet:
        # Refeed (asked for, or k + 1 > delta_chunk): the kept tokens alone again, from the
        # pre-verify cache.
        cache = transformer.forward(params, spec.config, chunk, contract=spec.contract,
                                    positions=positions, mask=fed, cache=state.cache).cache
    # Rollback: the cache holds last_token and the accepted drafts, positions [0, p + emit).
    lengths = jnp.where(active, state.position + emit, cache.lengths)
    # Their routes, as decode_step would have recorded them one by one; rejected drafts leave
    # none.
    rows = jnp.broadcast_to(jnp.arange(slots)[:, None], (slots, k + 1))
    cols = jnp.where(fed, positions, spec.capacity)
    routes = state.routes.at[rows, cols].set(token_routes(spec, out, fed), mode="drop")
    state = state._replace(cache=cache._replace(lengths=lengths.astype(jnp.int32)),
                           routes=routes)
    state = store_hidden(state, jnp.arange(slots), positions, hidden, fed)
    state = record_tokens(spec, state, pick, emit, version)
    counts = StepCounts(count, jnp.minimum(accepted, emit), emit, active.astype(jnp.int32))
    return state, counts


def _stochastic_acceptance(spec: Spec, params, state: SlotState, hidden, pick: Pick,
                           drafts: Drafts, count, seed) -> Pick:
    """For drawn drafts (drafts.probs given): the token at each drafted offset i < count comes
    from accept_stochastic instead of the plain draw, with the target's p_b of that token.
    hidden [S, k, D] at the drafted offsets; pick [S, k+1] the plain draws."""
    sp = spec.sampling
    slots, k = drafts.tokens.shape
    logits = transformer.logits_from_hidden(params, hidden, contract=spec.contract)  # [S,k,V]
    z = logits * kernels.reference.inverse_temperature(sp.temperature)
    floor = pick.floor[:, :k]
    steps = state.num_generated[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
    # One key per token index, tagged so that it never equals the Gumbel draw's key.
    keys = sample_keys(seed, jnp.repeat(state.prompt_id, k), jnp.repeat(state.sample_index, k),
                       steps.reshape(-1))
    keys = jax.vmap(lambda key: jax.random.fold_in(key, _ACCEPT_TAG))(keys)
    drawn, _ = accept_stochastic(keys, z.reshape(slots * k, -1), floor.reshape(-1),
                                 drafts.tokens.reshape(-1), drafts.probs.reshape(slots * k, -1))
    drawn = drawn.reshape(slots, k)
    logp, entropy = kernels.token_logprobs(logits, drawn, contract=spec.contract,
                                           temperature=sp.temperature, logit_floor=floor)
    use = jnp.arange(k)[None, :] < count[:, None]
    pad = lambda new, old: old.at[:, :k].set(jnp.where(use, new, old[:, :k]))
    return pick._replace(token=pad(drawn, pick.token), logp=pad(logp, pick.logp),
                         entropy=pad(entropy, pick.entropy))


_ACCEPT_TAG = 0x5EED


def update_draft_gate(config: SpeculativeConfig, gate: DraftGate, active, drafting,
                      counts: StepCounts) -> DraftGate:
    """The gate after one step; active / drafting [S] bool as the step began.

    A drafting slot with verified drafts (counts.drafted > 0) adds them to its record,
    A <- g A + accepted, D <- g D + drafted (g = 7/8: the last ~8 steps weigh most); a new
    sample's record (D == 0, misses == 0) starts from one step of k accepted drafts,
    A = D = k, so that one rejected step alone does not condemn a draft that is mostly right.
    The slot is judged poor when A < draft_min_accept * D: its pause is
    P = draft_backoff * 2**min(misses, 5), its record is cleared, and misses grows by one;
    a measured step that is not poor resets misses. The probe after a pause starts from the
    cleared record, without the prior, so its own drafts decide: the draft was already found
    poor, and with the prior a draft accepting 1 of 4 passed each probe's first step, was
    judged only on its second (every probe cost two drafting steps) and, reset by the pass,
    never paused longer than draft_backoff. The pause ends on the shared
    clock's first multiple of P at least ceil(P / 2) steps after this one, so
    skip = r - (c + 1) with c the clock of this step and r = P * ceil((c + 1 + ceil(P / 2)) / P),
    between ceil(P / 2) and ceil(P / 2) + P - 1 steps: slots judged a step or two apart, or at
    different misses (every P is draft_backoff times a power of 2), probe again on the same
    step, so the batch pays for one drafting step per probe, not one per slot. A slot that
    decodes without drafting counts its skip down; a paused slot that drafted (a step drafts
    for every active slot: step_drafters) is judged like any other, and a step of its that is
    not poor ends its pause (skip 0). The clock advances by one."""
    k = float(config.num_draft)
    measured = drafting & (counts.drafted > 0)
    fresh = (gate.drafted == 0) & (gate.misses == 0)
    prior_accepted = jnp.where(fresh, k, gate.accepted)
    prior_drafted = jnp.where(fresh, k, gate.drafted)
    accepted = jnp.where(measured, _GATE_DECAY * prior_accepted + counts.accepted, gate.accepted)
    drafted = jnp.where(measured, _GATE_DECAY * prior_drafted + counts.drafted, gate.drafted)
    poor = measured & (accepted < config.draft_min_accept * drafted)
    pause = config.draft_backoff * jnp.left_shift(1, jnp.minimum(gate.misses, _MAX_DOUBLINGS))
    next_step = gate.clock + 1
    resume = -(-(next_step + (pause + 1) // 2) // pause) * pause      # ceil(x / P) * P
    waiting = active & ~drafting
    skip = jnp.where(poor, resume - next_step,
                     jnp.where(measured, 0,
                               jnp.where(waiting, jnp.maximum(gate.skip - 1, 0), gate.skip)))
    misses = jnp.where(poor, gate.misses + 1, jnp.where(measured, 0, gate.misses))
    return DraftGate(jnp.where(poor, 0.0, accepted), jnp.where(poor, 0.0, drafted),
                     skip.astype(jnp.int32), misses.astype(jnp.int32),
                     next_step.astype(jnp.int32))


_GATE_DECAY = 0.875
_MAX_DOUBLINGS = 5


def plain_step(spec: Spec, params, state: SlotState, version, seed) -> tuple[SlotState,
                                                                               StepCounts]:
    """One plain decode step (slots.decode_step) with its counts: every active slot emits 1
    token in 1 step, drafting nothing."""
    active = state.active.astype(jnp.int32)
    state = decode_step(spec, params, state, version, seed)
    return state, StepCounts(jnp.zeros_like(active), jnp.zeros_like(active), active, active)


def speculative_step(spec: Spec, config: SpeculativeConfig, params, state: SlotState, version,
                     seed) -> tuple[SlotState, StepCounts]:
    """A step with a model-free draft source (config.source()): verify where any slot has a
    draft, otherwise the plain decode step."""
    drafts = config.source().propose(spec, params, state, config.num_draft, seed)
    return jax.lax.cond(
        jnp.any(state.active & (drafts.count > 0)),
        lambda s: verify_step(spec, config, params, s, drafts, version, seed),
        lambda s: plain_step(spec, params, s, version, seed), state)


def drafting_slots(state: SlotState) -> jax.Array:
    """[S] bool: the active slots whose draft gate lets them draft this step."""
    return state.active & (state.draft_gate.skip == 0)


def step_drafters(state: SlotState) -> jax.Array:
    """[S] bool: the slots that draft in a step: every active slot once some gate lets its slot
    draft, else none. The step's draft forwards and verify pass are batched, so more drafting
    rows cost nothing more, and a paused slot that drafted nothing would still set the batch's
    length: per-slot pauses only pay when every slot is paused (then paused_decode runs).
    Measured on the CPU (launch.bench_speed's MTP head, argmax drafts at T=0.6, accepted about
    half the time, near draft_min_accept): 0.59x plain with paused slots left out of drafting
    steps (188 steps), 1.23x with them in and a good step ending a pause (72 steps)."""
    return state.active & jnp.any(drafting_slots(state))


def draft_model_step(spec: Spec, config: SpeculativeConfig, params, draft_params,
                     state: SlotState, version, seed) -> tuple[SlotState, StepCounts]:
    """A step with the draft model or the MTP head (draft_params: its params): the drafting
    slots (step_drafters: every active slot once some gate is open) draft k tokens, the
    target verifies them (slots that do not draft emit one token from the same pass), and the draft cache is rolled back to the kept
    tokens (settle_draft_cache; the MTP head's, to the target's pairs); then the gate is
    updated (update_draft_gate)."""
    drafting = step_drafters(state)
    if config.uses_mtp:
        drafts, drafted, caught_up = mtp_drafts(spec, config, draft_params, params, state,
                                                drafting, seed)
    else:
        drafts, drafted, caught_up = draft_model_drafts(spec, config, draft_params, state,
                                                        drafting, seed)
    verified, counts = verify_step(spec, config, params, state, drafts, version, seed)
    if config.uses_mtp:
        # Only the pairs up to p - 1 are the target's (the drafts fed the head's own
        # outputs): the next step's catch-up writes the kept ones over them.
        draft_cache = drafted._replace(lengths=caught_up.lengths)
    else:
        draft_cache = settle_draft_cache(spec, draft_params, state, drafts, drafted,
                                         caught_up, counts.emitted, drafting)
    gate = update_draft_gate(config, state.draft_gate, state.active, drafting, counts)
    return verified._replace(draft_cache=draft_cache, draft_gate=gate), counts


def decode(spec: Spec, config: SpeculativeConfig, params, draft_params, state: SlotState,
           version, seed, max_steps, stop_on_finish):
    """slots.decode with speculative steps: up to max_steps steps (each emits 1 .. k + 1 tokens
    per slot); returns (state, steps run, StepCounts of this call). draft_params: the draft
    model's (config.draft == "draft_model") or the MTP head's (config.draft == "mtp"), else
    None.

    With a draft model one call runs one of two programs, chosen on the host from the slots'
    gates (an [S] read of a state that is ready): while some active slot drafts,
    draft_model_decode, which returns once every active slot is paused; while none does,
    paused_decode, plain steps until the first pause ends. A call runs >= 1 step while a slot
    is active. Two programs rather than a lax.cond between a plain and a drafting step in one:
    the same plain step compiled inside the drafting program ran ~1.15x slower per step
    (timed by hand on the CPU), so a switched-off draft still cost 15%."""
    if not config.keeps_draft_state:
        return source_decode(spec, config, params, state, version, seed, max_steps,
                             stop_on_finish)
    if any_drafting(state):
        return draft_model_decode(spec, config, params, draft_params, state, version, seed,
                                  max_steps, stop_on_finish)
    return paused_decode(spec, config, params, state, version, seed, max_steps, stop_on_finish)


def any_drafting(state: SlotState) -> bool:
    """Host-side: does some active slot draft in the next step (its gate's skip == 0)?"""
    active, skip = jax.device_get((state.active, state.draft_gate.skip))
    return bool(np.any(active & (skip == 0)))


def _decode_loop(state, max_steps, stop_on_finish, step_fn, more=lambda state: True):
    """(state, steps, StepCounts) of step_fn (state -> (state, StepCounts)) run while steps <
    max_steps, some slot is active, more(state), and (with stop_on_finish) no slot finished."""
    def cond(carry):
        step, state, any_finished, _ = carry
        go_on = (step < max_steps) & jnp.any(state.active) & more(state)
        return go_on & ~(stop_on_finish & any_finished)

    def body(carry):
        step, state, _, totals = carry
        was_active = state.active
        state, counts = step_fn(state)
        totals = StepCounts(*(a + b for a, b in zip(totals, counts)))
        return step + 1, state, jnp.any(was_active & ~state.active), totals

    steps, state, _, totals = jax.lax.while_loop(
        cond, body, (jnp.int32(0), state, jnp.bool_(False), zero_counts(state.active.shape[0])))
    return state, steps, totals


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def source_decode(spec: Spec, config: SpeculativeConfig, params, state: SlotState, version,
                  seed, max_steps, stop_on_finish):
    """decode with a model-free draft source: speculative_step while the loop goes on."""
    return _decode_loop(state, max_steps, stop_on_finish,
                        lambda s: speculative_step(spec, config, params, s, version, seed))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(4,))
def draft_model_decode(spec: Spec, config: SpeculativeConfig, params, draft_params,
                       state: SlotState, version, seed, max_steps, stop_on_finish):
    """decode with the draft model while some active slot drafts: draft_model_step until
    max_steps, a finish (with stop_on_finish), or every active slot paused."""
    return _decode_loop(state, max_steps, stop_on_finish,
                        lambda s: draft_model_step(spec, config, params, draft_params, s,
                                                   version, seed),
                        more=lambda s: jnp.any(drafting_slots(s)))


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def paused_decode(spec: Spec, config: SpeculativeConfig, params, state: SlotState, version,
                  seed, max_steps, stop_on_finish):
    """decode while no active slot drafts: min(max_steps, the active slots' smallest skip)
    plain steps (fewer on a finish with stop_on_finish), the draft model not run and its
    caches untouched; then each slot active at the start has skip <- max(skip - steps, 0) (a
    slot that finished meanwhile is reset when a sample is seated) and the gate's clock
    advances by steps. Counts: one emitted token per step a slot was active, no drafts."""
    active = state.active
    pause = jnp.min(jnp.where(active, state.draft_gate.skip, jnp.iinfo(jnp.int32).max))
    generated = state.num_generated
    state, steps, _ = _decode_loop(state, jnp.minimum(max_steps, pause), stop_on_finish,
                                   lambda s: plain_step(spec, params, s, version, seed))
    emitted = (state.num_generated - generated).astype(jnp.int32)
    gate = state.draft_gate
    skip = jnp.where(active, jnp.maximum(gate.skip - steps, 0), gate.skip).astype(jnp.int32)
    zeros = jnp.zeros_like(emitted)
    gate = gate._replace(skip=skip, clock=(gate.clock + steps).astype(jnp.int32))
    return (state._replace(draft_gate=gate), steps,
            StepCounts(zeros, zeros, emitted, emitted))


def speculative_metrics(samples) -> dict:
    """rollout/spec_* of samples that carry decode counters (Sample.spec); {} when none does."""
    counted = [s.spec for s in samples if getattr(s, "spec", None) is not None]
    if not counted:
        return {}
    drafted = sum(c.drafted for c in counted)
    accepted = sum(c.accepted for c in counted)
    emitted = sum(c.emitted for c in counted)
    steps = sum(c.steps for c in counted)
    return {names.ROLLOUT_SPEC_ACCEPT_RATE: accepted / drafted if drafted else 0.0,
            names.ROLLOUT_SPEC_TOKENS_PER_STEP: emitted / steps if steps else 0.0}

"""Draft sources of speculative decoding: what proposes the k tokens the target verifies
(jrl.sampling.speculative runs the verify pass and the acceptance).

Draft sources are pluggable (`DraftSource`): propose(spec, params, state, num_draft) -> Drafts.

A draft model (`DraftModel`: a small decoder with the target's vocabulary, e.g. SmolLM2-135M
drafting for a larger SmolLM2) keeps a KV cache of its own in the slot state
(SlotState.draft_cache). Each step it first feeds the history it has not seen yet (a new
prompt, an appended observation, the bonus token of a fully accepted step) in chunks of
`draft_catch_up` tokens, then draws d_1 .. d_k one token at a time from its own tempered,
top-k / top-p truncated distribution p (keys of the sample's (seed, prompt_id, sample_index,
token index), tagged). The target accepts them by
jrl.sampling.speculative.accept_stochastic, so the emitted law is
the target's; with greedy sampling the draft is its argmax (a point mass) and the samples are
plain decoding's. After verification the draft cache is rolled back to the kept tokens: it
holds last_token and d_1 .. d_{k-1}, of which the kept ones lead, so an attention-only draft
shortens its lengths and a Gated DeltaNet draft (Qwen3.5-0.8B for a larger Qwen3.5) feeds the
kept ones again from its pre-draft cache.

Drafts whose tokens the target mostly rejects are paused per slot (jrl.sampling.draft_gate).

The target's MTP head (Qwen3.5's multi-token-prediction head, jrl.models.mtp;
SpeculativeConfig(draft=MtpHead(params))) drafts the same way, with the same gate and programs
(`mtp_drafts`).
It reads the target's own hidden states, which every stage of the sampler records per
position (SlotState.target_hidden), keeps a one-layer KV cache of its own, and picks its
drafts as a draft model does (drawn, or with draft_pick="argmax" a point mass that keeps the
samples plain decoding's, token for token and bit for bit). Rollback is a length: the head's
cache keeps the pairs of the target's hidden states, and the next step's catch-up writes the
kept tokens' pairs over the drafted ones.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.models import mtp, transformer
from jrl.models.config import ModelConfig
from jrl.sampling.slots import SlotState, Spec, sample_keys
from jrl.sampling.speculative_config import DraftModel, SpeculativeConfig
from jrl.sampling.truncation import logit_floor, sample_from_floor


def check_draft_model(draft: DraftModel, target: ModelConfig) -> None:
    """One clear message for a draft model the sampler cannot use."""
    if not isinstance(draft, DraftModel):
        raise TypeError(f"SpeculativeConfig.draft must be a jrl.sampling.DraftModel("
                        f"config, params), got {type(draft).__name__}")
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(f"SpeculativeConfig.draft: the DraftModel's vocab_size "
                         f"{draft.config.vocab_size} differs from "
                         f"the target's {target.vocab_size}; a draft must share the vocabulary")


def check_mtp_head(head, target: ModelConfig) -> None:
    """One clear message for an MTP head the sampler cannot use (jrl.models.mtp)."""
    if not isinstance(head, mtp.MtpHead):
        raise TypeError(f"SpeculativeConfig.draft must be a jrl.models.mtp.MtpHead(params), got "
                        f"{type(head).__name__}")
    mtp.check_params(head.params, target)


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


def model_free_source(config: SpeculativeConfig) -> DraftSource:
    """The DraftSource of a config whose draft keeps no state: the n-gram lookup, or the
    DraftSource instance given as draft."""
    if not isinstance(config.draft, str):
        return config.draft
    if config.keeps_draft_state:
        raise ValueError(f"SpeculativeConfig.draft={config.draft!r} keeps a cache of its own; "
                         "it is not a stateless DraftSource")
    return NgramDraft(config.ngram_max, config.ngram_min)


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
        return transformer.forward(draft_params, draft_config, tokens,
                                   contract=spec.draft_contract, positions=positions, mask=mask,
                                   cache=cache)

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
                                                contract=spec.draft_contract)
        drawn, probs = pick_draft(spec, config, logits, state, i, seed, probs)
        return out.cache, drawn, tokens.at[:, i].set(drawn), probs

    cache, _, tokens, probs = jax.lax.fori_loop(
        0, k, step, (caught_up, state.last_token, jnp.zeros((spec.num_slots, k), jnp.int32),
                     empty_draft_probs(spec, config, draft_config.vocab_size)))
    count = jnp.where(drafting, k, 0).astype(jnp.int32)
    return Drafts(tokens, count, probs if draws(spec, config) else None), cache, caught_up


def draws(spec: Spec, config: SpeculativeConfig) -> bool:
    """Whether a draft model's / MTP head's drafts are drawn and accepted by rejection
    sampling (else they are point masses: argmax or target-key picks)."""
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
    num_generated + i tagged _DRAFT_TAG. Target-key picks (config.draft_pick="target_key",
    not greedy): the same draw with the untagged key, the target's own for that token index,
    as a point mass (probs as given): where the draft's logits are the target's up to
    rounding, the two draws agree unless they fall on a near tie. Else the argmax of z (the
    floor keeps it; z, as the target's greedy pick takes it), probs as given."""
    sp = spec.sampling
    z = logits * kernels.reference.inverse_temperature(sp.temperature)
    target_key = config.draft_pick == "target_key" and not sp.greedy
    if not draws(spec, config) and not target_key:
        return jnp.argmax(z, axis=-1).astype(jnp.int32), probs
    floor = logit_floor(z, top_k=sp.top_k, top_p=sp.top_p)
    keys = sample_keys(seed, state.prompt_id, state.sample_index, state.num_generated + i)
    if target_key:
        return sample_from_floor(keys, z, floor), probs
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
    return transformer.forward(draft_params, spec.draft_config, chunk,
                               contract=spec.draft_contract, positions=positions, mask=mask,
                               cache=caught_up).cache


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

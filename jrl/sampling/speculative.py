"""Lossless speculative decoding: drafted tokens verified in one cached pass of the target model,
accepted by rejection sampling against the target distribution, with exact p_b.

One step for every decoding slot (state: last_token at `position`, not yet in the cache):

1. A draft source proposes up to k tokens d_1 .. d_k (drafts.NgramDraft: the continuation of the
   latest earlier occurrence of the slot's last n tokens in its own prompt + response; no extra
   model).
2. The target runs [last_token, d_1 .. d_k] at positions p .. p + k through the same cached
   forward as prefill, decode and append (one pass, the same kernels). Stage consistency: the
   hidden state at offset i is, bit for bit, the one one-by-one decoding computes after
   feeding last_token, d_1 .. d_i; so are the logits, the top-k / top-p floor and the token
   logprob (p_b) drawn from them (docs/design.md, "Verify passes").
3. Acceptance at offset i, against the target distribution q_i (softmax of the tempered logits
   z_i over {z_i >= floor_i}, the distribution jrl replays in the trainer).

   Deterministic draft (a point mass on d): the standard rule (Leviathan et al. 2023, Chen et
   al. 2023) accepts d with probability min(1, q(d) / 1) = q(d) and otherwise samples from the
   residual norm(max(0, q - delta_d)) = q restricted to x != d, renormalised. jrl realises it
   with the draw plain decoding makes anyway: x_i = draw(z_i restricted to {z_i >= floor_i},
   key_i), the two-level Gumbel-max draw of truncation.draw_from_logits with the sample's own
   key (seed, prompt_id, sample_index, token index). x_i ~ q_i and is a function of the row's
   logits and key only, so
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

Draft sources are pluggable (jrl.sampling.drafts: the n-gram lookup, a draft model, Qwen3.5's
MTP head, or a DraftSource of your own); a draft model's or the head's drafts are switched off
per slot while the target rejects them (jrl.sampling.draft_gate). Which steps draft never
changes the law of the samples, only how fast they come. The config is
jrl.sampling.speculative_config.SpeculativeConfig.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrl import kernels
from jrl.metrics import names
from jrl.models import transformer
from jrl.sampling.draft_gate import (StepCounts, drafting_slots, step_drafters,
                                     update_draft_gate, zero_counts)
from jrl.sampling.drafts import (Drafts, draft_model_drafts, model_free_source, mtp_drafts,
                                 settle_draft_cache)
from jrl.sampling.slots import (Pick, SlotState, Spec, decode_step, pick_tokens, sample_keys,
                                store_hidden, token_routes)
from jrl.sampling.speculative_config import SpeculativeConfig
from jrl.sampling.truncation import draw_from_logits


# ---------------------------------------------------------------------------------------------
# Acceptance


def accept_stochastic(keys: jax.Array, z: jax.Array, floor: jax.Array, draft: jax.Array,
                      draft_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Standard speculative sampling for a drawn draft (Leviathan et al. 2023, Chen et al. 2023).

    keys [N] (one per position); z [N, V] tempered target logits, floor [N] (the target is
    q = softmax(z) over {z >= floor}); draft [N] int32 drawn from draft_probs [N, V] (p).
    Accept with probability min(1, q(d) / p(d)); else draw from norm(max(0, q - p)).
    Returns (token [N] int32, accepted [N] bool). The token's law is exactly q (up to float32
    rounding of q and p). A point-mass p reduces this to the coupled rule of the module
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
    resampled = draw_from_logits(residual_key, jnp.log(residual))     # log 0 = -inf: excluded
    return jnp.where(accepted, draft, resampled), accepted




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
    # One key per token index, tagged so that it never equals the plain draw's key.
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




def plain_step(spec: Spec, params, state: SlotState, version, seed) -> tuple[SlotState,
                                                                               StepCounts]:
    """One plain decode step (slots.decode_step) with its counts: every active slot emits 1
    token in 1 step, drafting nothing."""
    active = state.active.astype(jnp.int32)
    state = decode_step(spec, params, state, version, seed)
    return state, StepCounts(jnp.zeros_like(active), jnp.zeros_like(active), active, active)


def speculative_step(spec: Spec, config: SpeculativeConfig, params, state: SlotState, version,
                     seed) -> tuple[SlotState, StepCounts]:
    """A step with a model-free draft source (model_free_source): verify where any slot has a
    draft, otherwise the plain decode step."""
    drafts = model_free_source(config).propose(spec, params, state, config.num_draft, seed)
    has_drafts = jnp.any(state.active & (drafts.count > 0))
    counts = zero_counts(spec.num_slots)
    state, counts = _run_if(has_drafts, lambda s: verify_step(spec, config, params, s, drafts,
                                                              version, seed), state, counts)
    return _run_if(~has_drafts, lambda s: plain_step(spec, params, s, version, seed), state,
                   counts)


def _run_if(pred, step_fn, state: SlotState, counts: StepCounts):
    """step_fn(state) -> (state, counts) if pred, else (state, counts) as given: a while loop
    of 0 or 1 trips. Not lax.cond: on the CPU a cond between the verify and the plain step
    cost ~4.5 ms per step of an 8-slot decode at SmolLM2 dims (7%; a cond with the plain step
    in both branches cost the same), a loop of 0 or 1 trips nothing measurable: a loop
    updates its carry (the KV cache) in place."""
    def once(carry):
        return (jnp.bool_(False),) + tuple(step_fn(carry[1]))
    return jax.lax.while_loop(lambda carry: carry[0], once, (pred, state, counts))[1:]


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

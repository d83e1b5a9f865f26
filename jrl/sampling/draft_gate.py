"""The per-slot off-switch of a draft model or MTP head (SlotState.draft_gate), and the
counts a speculative step reports, which it reads.

A draft whose tokens the target mostly rejects would slow decoding down (each drafting step
costs several plain ones), so each slot keeps a record of its acceptance (SlotState.draft_gate)
and pauses drafting while it is poor, probing again after an exponentially growing pause that
ends on a step shared with the other paused slots (update_draft_gate). While every active slot
is paused, jrl.sampling.speculative.decode runs a program of plain steps (paused_decode) in
which the draft does not run, up to the end of the first pause. Which steps draft never
changes the law of the samples, only how fast they come.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.sampling.slots import DraftGate, SlotState
from jrl.sampling.speculative_config import SpeculativeConfig


class StepCounts(NamedTuple):
    """Per-slot counters of a decode call, [S] int32 each: drafted tokens, accepted drafts,
    tokens emitted, device steps the slot decoded in."""

    drafted: jax.Array
    accepted: jax.Array
    emitted: jax.Array
    steps: jax.Array


def zero_counts(num_slots: int) -> StepCounts:
    return StepCounts(*(jnp.zeros((num_slots,), jnp.int32) for _ in range(4)))


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

"""The draft gate (jrl.sampling.draft_gate) on a hand-computed schedule; its effect inside the
sampler (paused programs, drafting steps for every slot) is tested in test_speculative.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrl.sampling import SpeculativeConfig, draft_gate
from jrl.sampling import slots as slot_programs


def test_speculative_draft_gate_schedule_hand_computed():
    """update_draft_gate over 260 steps for four slots, k = 4, draft_min_accept 0.5,
    draft_backoff 16, g = 7/8, a new sample's record starting at A = D = 4 (a probe after a
    pause starts from A = D = 0). Step s runs at clock c = s - 1; a slot judged poor with pause
    P resumes at clock r = P * ceil((c + 1 + P / 2) / P), i.e. at step r + 1:
    - slot 0, every draft rejected: step 1 gives A = 3.5 + 0 = 3.5 < 0.5 * (3.5 + 4) = 3.75,
      poor: P = 16, r = 16 * ceil(9 / 16) = 16, so it probes at step 17; there A = 0 < 0.5 * 4,
      poor again, P = 32, r = 32 * ceil(33 / 32) = 64: step 65; then P = 64,
      r = 64 * ceil(97 / 64) = 128: step 129; P = 128, r = 128 * ceil(193 / 128) = 256: step
      257. It drafts at steps 1, 17, 65, 129, 257 only, and misses ends at 5;
    - slot 1, 3 of 4 accepted every step: A / D -> 3 / 4 >= 0.5, never paused;
    - slot 2, all accepted at step 1, none at steps 2 and 3, then all: step 1 A = D = 3.5 +
      4 = 7.5; step 2 A = 6.5625, D = 10.5625 (0.62: kept); step 3 A = 5.742,
      D = 13.242 (0.43 < 0.5): poor at c = 2, r = 16 * ceil(11 / 16) = 16; its probe at step
      17 gives A = D = 4 (passes, misses back to 0), and it drafts from then on;
    - slot 3, 1 of 4 accepted every step: the new sample's first step gives A = 3.5 + 1 = 4.5,
      D = 7.5 (0.6: kept), its second A = 3.9375 + 1 = 4.9375, D = 6.5625 + 4 = 10.5625 (0.47:
      poor) at c = 1, r = 16 * ceil(10 / 16) = 16. Each probe after that is judged on its own
      step (A = 1 < 0.5 * 4), at the same steps as slot 0's: at c = 16, r = 32 * ceil(33 / 32)
      = 64; at c = 64, r = 128; at c = 128, r = 256. (With the prior on every probe, each cost
      it two drafting steps, 17-18, 65-66, ...; pausing a fixed P after each judgement, as the
      gate once did, had it probe at steps 19, 53, 119, 249, out of phase with slot 0's 18,
      51, 116, 245.)"""
    config = SpeculativeConfig(draft="draft_model", num_draft=4, draft_backoff=16)
    gate = slot_programs.init_draft_gate(4)
    active = jnp.ones((4,), bool)
    update = jax.jit(functools.partial(draft_gate.update_draft_gate, config))
    drafted_at = {slot: [] for slot in range(4)}
    for step in range(1, 261):
        assert int(gate.clock) == step - 1
        drafting = np.asarray(active & (gate.skip == 0))
        accepted = np.asarray([0, 3, 0 if step in (2, 3) else 4, 1])
        drafted = np.where(drafting, 4, 0)
        for slot in range(4):
            if drafting[slot]:
                drafted_at[slot].append(step)
        counts = draft_gate.StepCounts(jnp.asarray(drafted, jnp.int32),
                                        jnp.asarray(np.where(drafting, accepted, 0), jnp.int32),
                                        jnp.ones((4,), jnp.int32), jnp.ones((4,), jnp.int32))
        if step == 3:
            np.testing.assert_allclose(np.asarray(gate.accepted)[2], 6.5625)
            np.testing.assert_allclose(np.asarray(gate.drafted)[2], 10.5625)
        gate = update(gate, active, jnp.asarray(drafting), counts)
    assert drafted_at[0] == [1, 17, 65, 129, 257]
    assert drafted_at[1] == list(range(1, 261))
    assert drafted_at[2] == [1, 2, 3] + list(range(17, 261))
    assert drafted_at[3] == [1, 2, 17, 65, 129, 257]
    assert np.asarray(gate.misses).tolist() == [5, 0, 0, 5]

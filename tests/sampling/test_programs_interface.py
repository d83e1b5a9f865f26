"""Sampler.serve, the host loop, asks the device for everything through SlotPrograms
(jrl.sampling.programs): a pure-Python implementation of the interface runs the real host
loop (refills, weight swaps, group order, counters) with no model and no JAX program."""

import numpy as np
import pytest

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.sampling import FINISH_LENGTH, Sample, Sampler, SamplingParams
from jrl.sampling.programs import DevicePrograms, SlotPrograms

CONFIG = ModelConfig(model_type="llama", vocab_size=16, hidden_size=8, intermediate_size=16,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4)


class CountingPrograms(SlotPrograms):
    """Each slot emits `limit` tokens, one per decode step, every token the request's prompt id;
    records every call the host loop makes."""

    def __init__(self, num_slots: int):
        self.num_slots, self.calls = num_slots, []

    def init_state(self, params=None):
        return [None] * self.num_slots          # per slot: [prompt_id, limit, versions]

    def begin(self):
        self.calls.append("begin")

    def start(self, params, state, starts, version, seed):
        self.calls.append(("start", [slot for slot, _ in starts]))
        for slot, (prompt_id, _, _, limit) in starts:
            state[slot] = [prompt_id, limit, [version]]
        return state

    def decode(self, params, state, version, seed, stop_on_finish):
        self.calls.append("decode")
        for entry in state:
            if entry is not None and len(entry[2]) < entry[1]:
                entry[2].append(version)
        return state, 1

    def weights_changed(self):
        self.calls.append("weights_changed")

    def harvest(self, state, slot_request, candidates):
        out = []
        for slot in candidates:
            prompt_id, limit, versions = state[slot]
            if len(versions) < limit:
                continue
            _, sample_index, prompt, _ = slot_request[slot]
            n = len(versions)
            out.append((slot, Sample(
                prompt_id=prompt_id, sample_index=sample_index, prompt_tokens=prompt,
                tokens=np.full((n,), prompt_id, np.int32),
                behavior_logp=np.zeros((n,), np.float32),
                logit_floor=np.full((n,), -np.inf, np.float32),
                versions=np.asarray(versions, np.int32), entropy=None,
                finish_reason=FINISH_LENGTH)))
            state[slot] = None
        return out


def _sampler(programs, num_slots=2):
    return Sampler(CONFIG, NumericalContract(platform="cpu"),
                   SamplingParams(group_size=2, max_new_tokens=3), num_slots=num_slots,
                   max_prompt_len=4, programs=programs)


def test_the_host_loop_runs_on_any_slot_programs():
    """3 prompts x 2 samples on 2 slots: 6 samples in (prompt, sample) order, each 3 tokens of
    its prompt id; every start fills the slots that are free (2, then 2, then 2: 3 starts of
    2), and the loop's counters come back in last_stats."""
    programs = CountingPrograms(num_slots=2)
    sampler = _sampler(programs)
    samples = sampler.generate(None, [(7, [1, 2]), (8, [3]), (9, [4, 5, 6])])
    assert [(s.prompt_id, s.sample_index) for s in samples] == [
        (7, 0), (7, 1), (8, 0), (8, 1), (9, 0), (9, 1)]
    assert all(s.tokens.tolist() == [s.prompt_id] * 3 for s in samples)
    assert [c for c in programs.calls if c != "decode"] == [
        "begin", ("start", [0, 1]), ("start", [0, 1]), ("start", [0, 1])]
    stats = sampler.last_stats
    assert stats["prefills"] == 6 and stats["prefill_calls"] == 3
    # Each pair of samples needs 2 decode steps after its first token: 3 x 2 steps.
    assert stats["decode_calls"] == 6 and stats["decode_steps"] == 6
    # SlotPrograms.serve_stats' defaults: every prompt ran through the model, no pool hits.
    assert stats["prefill_rows"] == 6 and stats["prefix_hits"] == 0
    assert stats["tokens"] == 18


def test_a_weight_swap_reaches_the_programs_and_tags_later_tokens():
    """The loop polls once per round, before its device calls: round 1 starts both samples
    (first token, version 0) and decodes once (second token, version 0); round 2's poll gives
    version 1, so the programs hear of the swap once and the third token carries version 1:
    versions [0, 0, 1] for each sample."""
    programs = CountingPrograms(num_slots=2)
    sampler = _sampler(programs)
    polls = iter([None, ("new weights", 1)])
    samples = sampler.generate(None, [(7, [1, 2])], poll_weights=lambda: next(polls, None))
    assert programs.calls.count("weights_changed") == 1
    assert [s.versions.tolist() for s in samples] == [[0, 0, 1], [0, 0, 1]]


def test_slot_programs_must_implement_the_device_calls():
    class NoDecode(SlotPrograms):
        def init_state(self, params=None):
            return None

        def start(self, params, state, starts, version, seed):
            return state

        def harvest(self, state, slot_request, candidates):
            return []

    with pytest.raises(TypeError, match="decode"):
        NoDecode()
    assert isinstance(_sampler(None).programs, DevicePrograms)

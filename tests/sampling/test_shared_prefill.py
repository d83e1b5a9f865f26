"""Group-shared prefill (jrl.sampling.prefix): a prompt prefilled once into a pool row seeds every
sample of its group, and the samples are bit for bit those of per-sample prefill.

Setting (helpers): 4 prompts x 3 samples on 4 slots, so a group's samples start both together
(the first fill) and as slots free up (later refills hit the pool)."""

import numpy as np
import pytest

from jrl.sampling import prefix, slots

from .helpers import (GROUP_SIZE, PROMPTS, assert_same_samples, Case, model_params, poll_after,
                      run, sampler)

CASES = {
    "f32-topp0.9": Case(top_p=0.9),
    "qwen35-f32-topp0.9": Case(arch="qwen35", top_p=0.9),
    "qwen3moe-f32": pytest.param(Case(arch="qwen3_moe"), marks=pytest.mark.slow),
    "bf16-t0.7-topk8": pytest.param(Case(dtype="bfloat16", temperature=0.7, top_k=8),
                                    marks=pytest.mark.slow),
    "qwen35moe-bf16-topp0.9": pytest.param(Case(arch="qwen35_moe", dtype="bfloat16", top_p=0.9),
                                           marks=pytest.mark.slow),
}
NUM_REQUESTS = len(PROMPTS) * GROUP_SIZE      # 4 prompts x 3 samples = 12


def count_model_rows(monkeypatch):
    """Counts the real (non-padding) rows that go through the model: per-sample prefill rows
    (slots.prefill) and pool fills (prefix.fill), by wrapping the programs the engine calls."""
    counts = {"prefill": 0, "fill": 0}

    def wrap(module, name, key, pool_rows):
        fn = getattr(module, name)

        def counted(spec, params, state, rows, *args):
            limit = pool_rows(spec, state)
            counts[key] += int(np.sum(np.asarray(rows) < limit))
            return fn(spec, params, state, rows, *args)
        monkeypatch.setattr(module, name, counted)

    wrap(slots, "prefill", "prefill", lambda spec, state: spec.num_slots)
    wrap(prefix, "fill", "fill", lambda spec, pool: pool.hidden.shape[0])
    return counts


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bitwise_shared_prefill_gives_identical_samples(case, monkeypatch):
    reference, reference_stats = run(case)        # per-sample prefill (helpers' default)
    assert reference_stats["prefill_rows"] == NUM_REQUESTS
    counts = count_model_rows(monkeypatch)
    # A pool row per prompt: each prompt runs through the model exactly once.
    shared = sampler(case.backend, case.dtype, temperature=case.temperature, top_p=case.top_p,
                     top_k=case.top_k, arch=case.arch, share_prefill=True,
                     prefix_pool_rows=len(PROMPTS))
    assert_same_samples(reference, shared.generate(model_params(0, case.arch), PROMPTS))
    assert counts == {"prefill": 0, "fill": len(PROMPTS)}      # 4 prompt rows, not 12
    stats = shared.last_stats
    assert stats["prefill_rows"] == len(PROMPTS)
    assert stats["prefix_hits"] == NUM_REQUESTS - len(PROMPTS)   # 12 - 4 = 8 copies
    assert stats["refills_while_busy"] >= 1      # some samples started from the pool mid-decode


def test_bitwise_shared_prefill_small_pool_evicts_and_stays_exact(monkeypatch):
    """A 1-row pool: every new prompt evicts the last one, and a start of 4 requests with 2
    distinct prompts is split into two rounds; samples are still those of per-sample prefill."""
    reference, _ = run(Case(top_p=0.9))
    counts = count_model_rows(monkeypatch)
    tiny = sampler(share_prefill=True, prefix_pool_rows=1, top_p=0.9)
    assert_same_samples(reference, tiny.generate(model_params(0), PROMPTS))
    # Each prompt is filled at least once; a group split by eviction is filled again, but
    # the first start (4 slots: 3 of prompt 10, 1 of prompt 11) shares prompt 10's fill.
    assert len(PROMPTS) <= counts["fill"] == tiny.last_stats["prefill_rows"] < NUM_REQUESTS


def test_bitwise_shared_prefill_weight_swap_clears_the_pool():
    """After a swap, a sample whose prompt was pooled with the old weights is prefilled again
    with the new ones: shared and per-sample prefill still agree bit for bit."""
    old, new = model_params(0), model_params(1)
    reference = sampler(share_prefill=False, top_p=0.9).generate(
        old, PROMPTS, poll_weights=poll_after(2, new))
    shared = sampler(share_prefill=True, prefix_pool_rows=len(PROMPTS), top_p=0.9)
    samples = shared.generate(old, PROMPTS, poll_weights=poll_after(2, new))
    assert_same_samples(reference, samples)
    assert any(np.all(s.versions == 1) for s in samples)     # started after the swap
    assert any(np.any(s.versions == 0) for s in samples)
    # Without the clear every prompt would have run through the model once (4 rows).
    assert shared.last_stats["prefill_rows"] > len(PROMPTS)

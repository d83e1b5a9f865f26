"""launch.simulate: the real pipeline over timed-wait devices (used by bench_async --simulate).
Scheduling facts only; no test here looks at wall time."""

import numpy as np
import pytest

from launch.simulate import CostModel, long_tail_lengths, simulated_run
from tests.pipeline.tiny import tiny_config


def test_cost_model_arithmetic():
    cost = CostModel(decode_step_s=0.01, decode_per_slot_s=0.001, prefill_call_s=0.002,
                     prefill_per_token_s=0.0001, train_step_s=0.05, train_per_token_s=0.0002,
                     weight_bytes=4e9, sync_bytes_per_s=2e10)
    assert cost.decode_s(8) == pytest.approx(0.018)      # 0.01 + 8 * 0.001
    assert cost.prefill_s(100) == pytest.approx(0.012)   # 0.002 + 100 * 0.0001
    assert cost.train_s(1000) == pytest.approx(0.25)     # 0.05 + 1000 * 0.0002
    assert cost.sync_s() == pytest.approx(0.2)           # 4e9 B / 2e10 B/s
    assert cost.scaled(0.5).train_s(1000) == pytest.approx(0.125)
    assert cost.scaled(0.5).sync_s() == pytest.approx(0.1)   # bytes stay, bandwidth halves


def test_long_tail_lengths_are_repeatable_and_long_tailed():
    lengths = long_tail_lengths(64)
    drawn = np.array([lengths(p, s) for p in range(200) for s in range(8)])
    assert lengths(7, 3) == lengths(7, 3)
    assert drawn.min() >= 4 and drawn.max() <= 64
    long = drawn >= 48                      # the tail: 3/4 of the budget or more
    assert 0.08 < long.mean() < 0.17        # about 1 in 8
    assert np.all(drawn[~long] <= 16)       # the rest: at most 1/4 of the budget


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_simulated_run_keeps_the_staleness_bound(tmp_path, max_staleness):
    config = tiny_config("train.sft_steps=0", "eval.greedy=false", "checkpoint.every=0",
                         "sampling.max_new_tokens=16", f"pipeline.max_staleness={max_staleness}",
                         "train.steps=6")
    run = simulated_run(config, str(tmp_path), cost=CostModel().scaled(0.01),
                       lengths=long_tail_lengths(16), log=lambda *_: None)
    result = run.run()
    assert [h["step"] for h in result.history] == [1, 2, 3, 4, 5, 6]
    assert run.trainer.version == 6
    assert all(h["rollout/staleness_max"] <= max_staleness for h in result.history)
    assert all(h["rollout/dropped_stale"] == 0 for h in result.history)
    # The lower bound: with k = 2 the rollout ran ahead of training (a pipeline that fell back
    # to synchronous would consume only tokens of its own version); with k = 0 it never did.
    stale_steps = [c["rl_step"] for c in run.consumed
                   if min(c["token_versions"]) < c["trainer_version"]]
    if max_staleness == 0:
        assert stale_steps == []
    else:
        # Step 1's first tokens are drawn while step 0 is still being generated, by version 0,
        # and consumed by version 1: at least that step.
        assert 1 in stale_steps
        assert max(h["rollout/staleness_max"] for h in result.history) >= 1
    # Responses have the lengths the workload gives them (one version tag per token).
    expected = np.mean([long_tail_lengths(16)(p, s) for p in range(24) for s in range(4)])
    observed = np.mean([h["rollout/response_len_mean"] for h in result.history])
    assert observed == pytest.approx(expected)

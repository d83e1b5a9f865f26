"""The MoE demo config (jrl/configs/moe_tiny.py, shrunk) through the real pipeline: bitwise p_b == p_o
and routing agreement exactly 1.0 at every step, and routing replay (R3) on a synchronous run is
a no-op bit for bit (the recorded experts are the ones the train forward picks anyway)."""

import json
import os

import jax
import numpy as np
import pytest

from jrl.configs import moe_tiny
from jrl.metrics import names
from jrl.pipeline.config.tools import apply_overrides
from jrl.pipeline.loop.runner import Run

SMALL = ("model.arch.hidden_size=32", "model.arch.intermediate_size=64",
         "model.arch.num_heads=2", "model.arch.num_kv_heads=1", "model.arch.head_dim=16",
         "model.arch.num_experts=4", "model.arch.moe_intermediate_size=16",
         "rollout.prompts_per_step=4", "rollout.num_slots=8", "rollout.precompile=false",
         "rollout.prefill_buckets=one",
         "sampling.group_size=4", "sampling.max_new_tokens=10", "data.train_size=64",
         "data.eval_size=4", "train.steps=3", "train.sft_steps=2", "train.sft_batch_size=8",
         "train.p_o_every=1",     # p_o, hence mismatch and routing agreement, at every step
         "optimizer.learning_rate=3e-3", "eval.every=0", "eval.sampled=false",
         "eval.greedy=false", "checkpoint.every=0",
         "metrics.backends=[jsonl]")


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for routing in ("recompute", "replay"):
        config = apply_overrides(moe_tiny.get_config(), [*SMALL, f"model.routing={routing}"])
        workdir = str(tmp_path_factory.mktemp(routing))
        result = Run(config, workdir, log=lambda *_: None).run()
        out[routing] = (jax.device_get(result.state.params), _records(workdir))
    return out


@pytest.mark.parametrize("routing", ["recompute", "replay"])
def test_every_step_is_bitwise_with_exact_routing_agreement(runs, routing):
    _, records = runs[routing]
    steps = [r for r in records if names.MISMATCH_ROUTING_AGREEMENT in r]
    assert len(steps) == 3
    for r in steps:
        assert r[names.MISMATCH_LOGPROB_ABS_DIFF_MAX] == 0.0
        assert r[names.MISMATCH_ROUTING_AGREEMENT] == 1.0
        assert r[names.MISMATCH_ROUTING_STALE_FLIP_FRAC] == 0.0     # synchronous: no staleness
        # Every model token but each response's last (never fed) x 2 MoE layers: 16 samples.
        assert r[names.MISMATCH_ROUTING_PAIRS] >= 2 * 16
        assert 1.0 <= r[names.TRAIN_EXPERT_LOAD_MAX] <= 4 / 2


def test_replay_on_a_synchronous_run_changes_no_bit(runs):
    recompute, _ = runs["recompute"]
    replay, _ = runs["replay"]
    for a, b in zip(jax.tree.leaves(recompute), jax.tree.leaves(replay)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))

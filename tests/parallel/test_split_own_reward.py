"""The split-process mode scores with the config's own reward function: the rollout process
imports rollout.reward_fn (a file) itself, and its named parts reach the train process's
metrics.jsonl."""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.pipeline.tiny import tiny_config

from .helpers import run_split_worker

pytestmark = pytest.mark.slow

REWARD = textwrap.dedent('''
    def score(response, example, token_ids):
        return {"length": len(token_ids) / 8, "odd": float(len(response) % 2)}
''')


def test_the_rollout_process_imports_the_reward_module_from_the_config(tmp_path):
    (tmp_path / "split_reward.py").write_text(REWARD)
    config = tiny_config("train.steps=2", "pipeline.max_staleness=1", "checkpoint.every=0",
                         f"rollout.reward_fn={tmp_path / 'split_reward.py'}:score",
                         "rollout.reward_weights=length=0.5")
    run_split_worker(config, tmp_path, workdir="work")
    records = [json.loads(line) for line in
               (tmp_path / "work" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        length = record["rollout/reward_part/length"]
        odd = record["rollout/reward_part/odd"]
        assert length > 0
        # reward = 0.5 * length + odd, row by row, so the means obey the same sum.
        assert record["rollout/reward_mean"] == pytest.approx(0.5 * length + odd, abs=1e-6)
        assert record["rollout/reward_errors"] == 0

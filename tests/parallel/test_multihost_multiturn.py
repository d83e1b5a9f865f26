"""Multi-turn episodes in the split-process mode (jrl.pipeline.loop.multihost): the rollout process
runs the episode driver, batches cross to the train process with their model-token masks, and a
synchronous split run trains bitwise equal to the single-process Run. Slow: two processes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from launch.parallel_selftest import flatten
from tests.pipeline.test_multiturn_run import MULTI_TURN
from tests.pipeline.tiny import tiny_config

from .helpers import bitwise_differences, run_split_worker

pytestmark = pytest.mark.slow


def test_split_process_multi_turn_run_equals_the_single_process_run(tmp_path):
    config = tiny_config(*MULTI_TURN, "train.steps=2")
    run_split_worker(config, tmp_path)
    history = json.loads((tmp_path / "out" / "train.json").read_text())["history"]
    with np.load(tmp_path / "out" / "train_params.npz") as data:
        split_params = {k: data[k] for k in data.files}

    from jrl.pipeline.loop.runner import Run
    single = Run(config, str(tmp_path / "single"), log=lambda *_: None,
                 write_metrics=False).run()
    assert bitwise_differences(flatten(single.state.params), split_params) == []
    for a, b in zip(single.history, history):
        assert a["mismatch/logprob_abs_diff_max"] == b["mismatch/logprob_abs_diff_max"] == 0.0
        assert a["rollout/turns_mean"] == b["rollout/turns_mean"]
    assert max(row["rollout/turns_mean"] for row in history) > 1.5

"""A run's outputs beside metrics.jsonl: --profile-steps A:B (a jax.profiler trace of RL steps A
to B in WORKDIR/profile) and metrics.backends with wandb, metrics.wandb_mode="offline" (a W&B run
under WORKDIR/wandb with every step)."""

import argparse
import gzip
import json

import pytest

from jrl.cli.train import _step_range
from jrl.pipeline.loop.runner import Run
from tests.pipeline.tiny import tiny_config


def test_the_profiled_steps_leave_a_trace_and_say_where(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_PROJECT", "jrl-test")
    logged = []
    config = tiny_config("train.steps=3", "train.sft_steps=0", "eval.greedy=false",
                         "checkpoint.every=0", "metrics.backends=[jsonl, wandb]",
                         "metrics.wandb_mode=offline")
    run = Run(config, str(tmp_path / "run"), log=logged.append, profile_steps=(2, 2))
    run.run()
    traces = list((tmp_path / "run" / "profile").rglob("*.trace.json.gz"))
    assert len(traces) == 1 and list((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert len(events) > 10                         # the step's host and device activity
    assert any(line.startswith("profile: RL steps 2 to step 2 traced to ") for line in logged)
    assert len(run.history) == 3 and not run._tracing
    # The W&B run of the same steps, its id kept for a resume.
    run_id = (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


@pytest.mark.parametrize("text, steps", [("3:5", (3, 5)), ("4", (4, 4))])
def test_a_step_range_parses(text, steps):
    assert _step_range(text) == steps


@pytest.mark.parametrize("text", ["0:2", "5:3", "a:b", ""])
def test_a_bad_step_range_says_what_is_allowed(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not A:B with 1 <= A <= B"):
        _step_range(text)

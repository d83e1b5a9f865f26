"""launch/fault_campaign.py: the bitwise comparison finds one flipped bit, and (slow) a short
campaign of one SIGINT, one SIGTERM and one SIGKILL ends bitwise equal every time."""

import json
import os
import signal

import numpy as np
import pytest

from launch import fault_campaign
from launch.fault_campaign import (metrics_differences, phase_after, stop_problem,
                                   tree_differences)


def _flip_lowest_bit(array: np.ndarray, index: int) -> np.ndarray:
    flipped = array.copy()
    flipped.reshape(-1).view(np.uint32)[index] ^= 1
    return flipped


def test_tree_differences_finds_one_flipped_bit_and_signed_zero():
    params = {"embed": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
              "norm": np.ones(4, np.float32), "step": np.int32(7)}
    assert tree_differences(params, {k: np.copy(v) for k, v in params.items()}) == []
    one_bit = dict(params, embed=_flip_lowest_bit(params["embed"], 5))
    assert tree_differences(params, one_bit, what="state") == [
        "state['embed']: 1 of 12 elements differ in bits"]
    # -0.0 == 0.0 numerically, but not bitwise.
    zeros = dict(params, norm=np.zeros(4, np.float32))
    negative_zero = dict(params, norm=-np.zeros(4, np.float32))
    assert tree_differences(zeros, negative_zero) == ["['norm']: 4 of 4 elements differ in bits"]


def test_tree_differences_names_missing_leaves_and_changed_dtypes():
    params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    assert tree_differences(params, {"a": params["a"]}) == ["['b']: only in the reference"]
    assert tree_differences(params, dict(params, b=np.zeros(2, np.float64))) == [
        "['b']: float32[2] vs float64[2]"]


def test_metrics_differences_ignores_wall_clock_fields_only():
    rows = [{"step": 1, "train/loss": 0.25, "time/train_s": 1.5}]
    assert metrics_differences(rows, [dict(rows[0], **{"time/train_s": 9.0})]) == []
    # One ulp above 0.25 (its float64 bits + 1).
    next_up = float(np.nextafter(0.25, 1.0))
    assert metrics_differences(rows, [dict(rows[0], **{"train/loss": next_up})]) == [
        f"metrics step 1: train/loss: 0.25 vs {next_up!r}"]
    assert metrics_differences(rows, rows + rows) == ["metrics steps [1] vs [1, 1]"]


def test_phase_after_follows_the_cli_log():
    log = ["jrl run 'arith_tiny': 11,968 params", "  sft 1/10: loss 4.4", "warm start: 10 steps",
           "eval at step 0: eval/accuracy=0.000", "checkpoint: step 1 -> ckpts",
           "checkpoint: step 2 -> ckpts"]
    phases = [phase_after(log[:n], steps=2) for n in range(len(log) + 1)]
    assert phases == ["setup", "warm start", "warm start", "step-0 eval", "step 1", "step 2",
                      "exit"]
    # A resumed run logs its resume line before "jrl run" and has no warm start.
    resumed = ["resume: from step 1 (version 1)", "jrl run 'arith_tiny': 11,968 params"]
    assert phase_after(resumed, steps=2) == "step 2"


def test_stop_problem_reads_the_exit_status_and_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "checkpoints" / "3.orbax-checkpoint-tmp-5").mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (0, 1, 2)))
    assert stop_problem(signal.SIGTERM, 143, str(run)) is None
    assert stop_problem(signal.SIGINT, 130, str(run)) is None
    assert stop_problem(signal.SIGKILL, -9, str(run)) is None
    assert stop_problem(signal.SIGTERM, 0, str(run)) is None      # the run finished first
    assert stop_problem(signal.SIGTERM, 1, str(run)).startswith("exit 1 after SIGTERM")
    # Step 3's metrics were written but its checkpoint is unfinished: the promise was broken.
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3}) + "\n")
    assert stop_problem(signal.SIGINT, 130, str(run)) == \
        "step 3 wrote metrics but the last checkpoint is 2"
    os.rename(run / "checkpoints" / "3.orbax-checkpoint-tmp-5", run / "checkpoints" / "3")
    assert stop_problem(signal.SIGINT, 130, str(run)) is None


@pytest.mark.slow
def test_a_short_campaign_ends_bitwise_equal_after_each_signal(tmp_path, capsys):
    """Three trials, one SIGINT, one SIGTERM, one SIGKILL, of a 4-step run (about 3 minutes on
    2 CPU cores)."""
    code = fault_campaign.main(["--trials", "3", "--steps", "4", "--seed", "1",
                                "--workdir", str(tmp_path / "campaign")])
    output = capsys.readouterr().out
    assert code == 0, output
    assert "trials=3 equal=3" in output
    for name in ("SIGINT", "SIGTERM", "SIGKILL"):
        assert name in output

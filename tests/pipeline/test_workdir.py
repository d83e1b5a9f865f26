"""A run never replaces another run's files unless told to (jrl.pipeline.workdir)."""

import os

import pytest

from jrl.pipeline.runner import Run
from jrl.pipeline.workdir import WorkdirError, check_workdir
from tests.pipeline.tiny import tiny_config


def _old_run(path):
    os.makedirs(path / "checkpoints" / "3")
    (path / "metrics.jsonl").write_text('{"step": 3}\n')
    return path


def test_an_empty_or_missing_workdir_is_used_as_it_is(tmp_path):
    assert check_workdir(str(tmp_path / "new")) is None
    assert check_workdir(str(tmp_path), resume=True) is None


def test_a_fresh_run_refuses_a_workdir_that_holds_a_run(tmp_path):
    workdir = _old_run(tmp_path / "run")
    with pytest.raises(WorkdirError, match=r"already holds a run \(checkpoints, metrics.jsonl\)"
                                           r".*--resume.*--overwrite"):
        Run(tiny_config(), str(workdir), log=lambda *_: None)
    assert (workdir / "metrics.jsonl").read_text() == '{"step": 3}\n'   # nothing touched


def test_overwrite_moves_the_old_run_aside_or_deletes_it(tmp_path):
    workdir = _old_run(tmp_path / "run")
    moved = check_workdir(str(workdir), overwrite="move")
    assert os.path.basename(moved).startswith("run.replaced-") and not workdir.exists()
    assert (tmp_path / os.path.basename(moved) / "metrics.jsonl").exists()
    _old_run(workdir)
    assert check_workdir(str(workdir), overwrite="delete") is None and not workdir.exists()


def test_resume_before_the_first_checkpoint_moves_the_attempt_aside_and_starts_fresh(tmp_path):
    """An attempt stopped before its first checkpoint left metrics (the step-0 eval) and no
    checkpoint: --resume moves it aside, deleting nothing, and the run starts in an empty
    workdir; a workdir with a checkpoint is continued in place."""
    attempt = tmp_path / "attempt"
    os.makedirs(attempt / "checkpoints")
    (attempt / "metrics.jsonl").write_text('{"step": 0}\n')
    assert check_workdir(str(attempt), resume=True, act=False) is None and attempt.exists()
    moved = check_workdir(str(attempt), resume=True)
    assert os.path.basename(moved).startswith("attempt.replaced-") and not attempt.exists()
    assert (tmp_path / os.path.basename(moved) / "metrics.jsonl").read_text() == '{"step": 0}\n'
    _old_run(tmp_path / "ok")
    assert check_workdir(str(tmp_path / "ok"), resume=True) is None
    assert (tmp_path / "ok" / "metrics.jsonl").exists()


def test_contradicting_or_unknown_options_are_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(WorkdirError, match="contradict"):
        check_workdir(str(tmp_path), resume=True, overwrite="move")
    with pytest.raises(WorkdirError, match="allowed are"):
        check_workdir(str(tmp_path), overwrite="shred")

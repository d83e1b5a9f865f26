"""jrl replaces, deletes or writes into only what it can prove is its own (jrl.pipeline.loop.workdir)."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jrl.pipeline.loop import workdir as workdir_module
from jrl.pipeline.config import RunConfig
from jrl.pipeline.loop.runner import Run
from jrl.pipeline.loop.workdir import JRL_MARKER, WorkdirError, check_workdir, claim_workdir
from tests.pipeline.tiny import tiny_config


def _old_run(path, marker=True):
    os.makedirs(path / "checkpoints" / "3")
    (path / "metrics.jsonl").write_text('{"step": 3}\n')
    if marker:
        (path / JRL_MARKER).write_text('{"format": "jrl-run"}')
    return path


def _victim(path):
    """A directory of the user's own, as in the issue's probe."""
    os.makedirs(path / "thesis")
    (path / "thesis" / "ch1.tex").write_text("x\n")
    return path


def test_an_empty_or_missing_workdir_is_claimed_and_marked(tmp_path):
    assert check_workdir(str(tmp_path / "new")) is None
    assert json.loads((tmp_path / "new" / JRL_MARKER).read_text())["format"] == "jrl-run"
    assert check_workdir(str(tmp_path / "empty"), resume=True) is None


def test_a_fresh_run_refuses_a_workdir_that_holds_a_run(tmp_path):
    workdir = _old_run(tmp_path / "run")
    with pytest.raises(WorkdirError, match=r"already holds a run \(checkpoints, jrl-run.json, "
                                           r"metrics.jsonl\).*--resume.*--overwrite"):
        Run(tiny_config(), str(workdir), log=lambda *_: None)
    assert (workdir / "metrics.jsonl").read_text() == '{"step": 3}\n'   # nothing touched


def test_overwrite_moves_the_old_run_aside_or_deletes_only_jrls_files(tmp_path):
    workdir = _old_run(tmp_path / "run")
    moved = check_workdir(str(workdir), overwrite="move")
    assert os.path.basename(moved).startswith("run.replaced-")
    assert (tmp_path / os.path.basename(moved) / "metrics.jsonl").exists()
    assert sorted(os.listdir(workdir)) == [".jrl-lock", JRL_MARKER]   # a fresh, claimed run
    _old_run(tmp_path / "again")
    (tmp_path / "again" / "notes.txt").write_text("mine\n")      # the user's, inside a run
    logs = []
    claim = claim_workdir(str(tmp_path / "again"), overwrite="delete", log=logs.append)
    claim.release()
    left = sorted(os.listdir(tmp_path / "again"))
    assert left == [".jrl-lock", JRL_MARKER, "notes.txt"], left
    assert (tmp_path / "again" / "notes.txt").read_text() == "mine\n"
    assert claim.kept == ["notes.txt"] and "kept what jrl did not write: notes.txt" in logs[-1]


@pytest.mark.parametrize("mode", ["delete", "move"])
def test_overwrite_refuses_a_directory_jrl_did_not_write(tmp_path, mode):
    """The issue's probe: --overwrite delete on a user's directory deleted ch1.tex."""
    victim = _victim(tmp_path / "victim")
    with pytest.raises(WorkdirError, match=r"holds no jrl run to replace \(it holds thesis"):
        check_workdir(str(victim), overwrite=mode)
    assert (victim / "thesis" / "ch1.tex").read_text() == "x\n"
    assert sorted(os.listdir(victim)) == [".jrl-lock", "thesis"]   # no marker was written


def test_a_fresh_run_starts_next_to_files_that_are_not_jrls(tmp_path):
    """A directory holding only a log file is not a run; jrl starts beside it. A file with a
    name jrl writes is refused, not overwritten."""
    logged = tmp_path / "logged"
    os.makedirs(logged)
    (logged / "train.log").write_text("started\n")
    logs = []
    claim_workdir(str(logged), log=logs.append).release()
    assert (logged / "train.log").read_text() == "started\n"
    assert (logged / JRL_MARKER).exists() and "train.log (not jrl's" in logs[0]
    mine = tmp_path / "mine"
    os.makedirs(mine)
    (mine / "config.json").write_text("{}")
    with pytest.raises(WorkdirError, match=r"names a run writes \(config.json\)"):
        check_workdir(str(mine))
    assert (mine / "config.json").read_text() == "{}" and not (mine / JRL_MARKER).exists()


def test_resume_before_the_first_checkpoint_moves_the_attempt_aside_and_starts_fresh(tmp_path):
    """An attempt stopped before its first checkpoint left metrics (the step-0 eval) and no
    checkpoint: --resume moves it aside, deleting nothing, and the run starts in an empty
    workdir; a workdir with a checkpoint is continued in place, also one written before the
    marker existed."""
    attempt = tmp_path / "attempt"
    os.makedirs(attempt / "checkpoints")
    (attempt / "metrics.jsonl").write_text('{"step": 0}\n')
    (attempt / JRL_MARKER).write_text("{}")
    assert check_workdir(str(attempt), resume=True, act=False) is None
    assert (attempt / "metrics.jsonl").exists()
    moved = check_workdir(str(attempt), resume=True)
    assert os.path.basename(moved).startswith("attempt.replaced-")
    assert (tmp_path / os.path.basename(moved) / "metrics.jsonl").read_text() == '{"step": 0}\n'
    _old_run(tmp_path / "ok")
    assert check_workdir(str(tmp_path / "ok"), resume=True) is None
    assert (tmp_path / "ok" / "metrics.jsonl").exists()
    legacy = _old_run(tmp_path / "legacy", marker=False)
    assert check_workdir(str(legacy), resume=True) is None and (legacy / JRL_MARKER).exists()


def test_a_second_run_on_a_locked_workdir_is_refused_naming_the_holder(tmp_path):
    first = claim_workdir(str(tmp_path / "run"))
    try:
        with pytest.raises(WorkdirError, match=rf"in use by another jrl run \(pid {os.getpid()} "
                                               r"on .* since .*UTC\)"):
            claim_workdir(str(tmp_path / "run"), resume=True)
        with pytest.raises(WorkdirError, match="in use"):
            Run(tiny_config(), str(tmp_path / "run"), resume=True, log=lambda *_: None)
    finally:
        first.release()
    claim_workdir(str(tmp_path / "run"), resume=True).release()   # free again


def test_the_lock_is_released_when_its_process_is_killed(tmp_path):
    """flock belongs to the process: SIGKILL releases it, so a crashed run never wedges its
    workdir."""
    script = textwrap.dedent(f"""
        import time
        from jrl.pipeline.loop.workdir import claim_workdir
        claim = claim_workdir({str(tmp_path / 'run')!r})
        print("locked", flush=True)
        time.sleep(60)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(WorkdirError, match=rf"pid {child.pid} "):
            claim_workdir(str(tmp_path / "run"), resume=True)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    claim_workdir(str(tmp_path / "run"), resume=True).release()


def test_unusable_workdirs_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(WorkdirError, match="is a file, not a directory"):
        check_workdir(str(tmp_path / "a_file"))
    with pytest.raises(WorkdirError, match="cannot create it: Not a directory"):
        check_workdir(str(tmp_path / "a_file" / "run"))

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(workdir_module.os, "fsync", full_disk)
    with pytest.raises(WorkdirError, match="cannot write its run marker: No space left on device"):
        check_workdir(str(tmp_path / "full"))
    assert sorted(os.listdir(tmp_path / "full")) == [".jrl-lock"]   # no half-written marker


def test_contradicting_or_unknown_options_are_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(WorkdirError, match="contradict"):
        check_workdir(str(tmp_path), resume=True, overwrite="move")
    with pytest.raises(WorkdirError, match="allowed are"):
        check_workdir(str(tmp_path), overwrite="shred")


@pytest.mark.parametrize("name", ["../../x", "", "a/b", ".hidden", "..", "x" * 129])
def test_a_run_name_must_be_a_plain_name(name):
    with pytest.raises(ValueError, match=r"name=.*must be a plain name"):
        RunConfig(name=name)


def test_a_run_holds_its_workdir_until_closed(tmp_path):
    run = Run(tiny_config(), str(tmp_path / "run"), log=lambda *_: None)
    with pytest.raises(WorkdirError, match="in use"):
        claim_workdir(str(tmp_path / "run"), resume=True)
    run.close()
    claim_workdir(str(tmp_path / "run"), resume=True).release()

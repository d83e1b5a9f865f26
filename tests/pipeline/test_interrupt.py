"""Ctrl-C or SIGTERM: the CLI checkpoints the last finished step, exits with 128 + the signal (130,
143), and --resume continues; a signal in the warm start or the step-0 eval stops there. (The
signal handling itself, a signal inside garbage collection included: tests/test_stop_request.py;
interrupts at given points of a step, in process: tests/pipeline/test_run.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch.signal_campaign import signal_after_marker

CONFIG = '''
from tests.pipeline.tiny import tiny_config

def get_config():
    # Far more steps than the test waits for: with the fast CPU kernels 200 tiny steps took
    # about 6 s, and a run that finished before the signal arrived made this test race.
    return tiny_config("train.steps=100000", "train.sft_steps=0", "eval.greedy=false",
                       "checkpoint.every=0")
'''


def _steps(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        # The run appends while this polls: a last line without its newline is still being
        # written and is not a step yet.
        complete = f.read().split("\n")[:-1]
    return [json.loads(line)["step"] for line in complete if line.strip()]


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent compilation cache the four child runs share: they compile the same tiny
    run, and only the first pays for it (about half of this file's time). Single-threaded
    synchronous runs (max_staleness 0), the setting the suite-wide cache was never refused in
    (tests/conftest.py)."""
    return {"JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_checkpoints_and_resume_continues(tmp_path, signum, compile_cache):
    config = tmp_path / "tiny_cli.py"
    config.write_text(CONFIG)
    workdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "jrl.cli.train", "--config", str(config), "--workdir",
               workdir]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root, **compile_cache)
    process = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and len(_steps(workdir)) < 3:
        if process.poll() is not None:
            break
        time.sleep(0.2)
    assert process.poll() is None, process.stdout.read()
    process.send_signal(signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, output
    assert "interrupted: saving step" in output and "--resume" in output
    saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert saved and saved[-1] >= 3 and saved[-1] == _steps(workdir)[-1]   # the last finished
    # Resume for two more steps: it starts where the checkpoint left off.
    resumed = subprocess.run(command + ["--resume", "--steps", "2"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resume: from step {saved[-1]}" in resumed.stdout
    steps = _steps(workdir)
    assert steps[-1] == saved[-1] + 2 and len(steps) == len(set(steps))


def _run_until(tmp_path, compile_cache, overrides: list[str], marker: str, delay: float,
               signum: int) -> tuple[int, str, str]:
    """Starts the CLI on the tiny config with `overrides`, sends `signum` `delay` seconds after a
    line containing `marker`; returns (exit status, output, workdir)."""
    workdir = str(tmp_path / "run")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = tmp_path / "tiny_cli.py"
    config.write_text(CONFIG)
    command = [sys.executable, "-m", "jrl.cli.train", "--config", str(config), "--workdir",
               workdir, *[arg for o in overrides for arg in ("--set", o)]]
    code, output, sent = signal_after_marker(
        command, dict(os.environ, PYTHONPATH=root, **compile_cache), marker, delay, signum,
        cwd=root)
    assert sent, output                     # the run was still going when the signal came
    return code, output, workdir


def test_sigterm_in_the_warm_start_stops_it(tmp_path, compile_cache):
    """The warm start checks for a stop between its steps: 10**6 of them never finish here."""
    code, output, workdir = _run_until(tmp_path, compile_cache, ["train.sft_steps=1000000"],
                                       "sft 1/1000000", 0.5, signal.SIGTERM)
    assert code == 143, output
    assert "warm start:" not in output      # stopped inside it
    assert "stopped; no checkpoint was written yet" in output
    assert not os.path.isdir(os.path.join(workdir, "checkpoints")) or not any(
        d.isdigit() for d in os.listdir(os.path.join(workdir, "checkpoints")))


def test_sigint_in_the_step_0_eval_stops_it(tmp_path, compile_cache):
    """Evaluation checks between its sampler's device calls: 2,000 greedy prompts (about 250
    device calls of 8 slots) are cut short, where the signal once could be dropped (a
    KeyboardInterrupt raised inside a garbage-collection callback)."""
    code, output, _ = _run_until(tmp_path, compile_cache, ["train.sft_steps=2", "eval.greedy=true",
                                                           "data.eval_size=2000",
                                                           "data.max_operand=99"],
                                 "warm start:", 0.5, signal.SIGINT)
    assert code == 130, output
    assert "eval at step 0" not in output    # the eval did not finish
    assert "stopped; no checkpoint was written yet" in output


def test_split_processes_in_a_single_process_is_one_line_rc_2(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-m", "jrl.cli.train", "--config", "jrl/configs/arith_tiny.py",
         "--split-processes", "--workdir", str(tmp_path / "run")],
        cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "split-process error: --split-processes needs two processes" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_signal_after_the_work_is_done_still_ends_with_its_status(monkeypatch, capsys):
    """A SIGTERM after the final checkpoint once printed an "Exception ignored in atexit
    callback" traceback and exited 0; now it is recorded, and the CLI says so and exits 143."""
    from jrl import stop_request
    from jrl.cli import train

    def finished_run(argv):
        os.kill(os.getpid(), signal.SIGTERM)     # arrives once everything is saved
        return 0

    previous = {s: signal.getsignal(s) for s in stop_request.STOP_SIGNALS}
    monkeypatch.setattr(train, "main", finished_run)
    try:
        assert train._main_stoppable([]) == 143
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_request.reset()
    assert "stopped by signal 15 after the run's work was done; everything is saved" in \
        capsys.readouterr().err

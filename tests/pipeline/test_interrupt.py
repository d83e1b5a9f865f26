"""Ctrl-C or SIGTERM: the CLI checkpoints the last finished step, exits with 130, and --resume
continues. (Interrupts at given points of a step, in process: tests/pipeline/test_run.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

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
    command = [sys.executable, "-m", "launch.train", "--config", str(config), "--workdir",
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
    assert process.returncode == 130, output
    assert "interrupted: saving step" in output and "--resume" in output
    saved = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert saved and saved[-1] >= 2
    # Resume for two more steps: it starts where the checkpoint left off.
    resumed = subprocess.run(command + ["--resume", "--steps", "2"], cwd=root, env=env,
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resume: from step {saved[-1]}" in resumed.stdout
    steps = _steps(workdir)
    assert steps[-1] == saved[-1] + 2 and len(steps) == len(set(steps))


def test_split_processes_in_a_single_process_is_one_line_rc_2(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-m", "launch.train", "--config", "configs/arith_tiny.py",
         "--split-processes", "--workdir", str(tmp_path / "run")],
        cwd=root, env=dict(os.environ, PYTHONPATH=root), capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "split-process error: --split-processes needs two processes" in result.stderr
    assert "Traceback" not in result.stderr

"""A process of a multi-process job dies or fails: the others exit within a bounded time, with a
message naming it (jrl.parallel.watchdog.PeerWatchdog), without any launcher to end them
(the processes are started with jrl.cli.local_cluster.start, which only starts them).

Heartbeat timeout 10 s here; the bound asserted is 60 s."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from jrl.parallel import distributed
from jrl.pipeline.config.tools import to_dict
from jrl.cli import local_cluster
from tests.pipeline.tiny import tiny_config

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEARTBEAT_TIMEOUT_S = 10
BOUND_S = 60
ENV = dict(os.environ, PYTHONPATH=ROOT, **{distributed.ENV_HEARTBEAT: str(HEARTBEAT_TIMEOUT_S)})

# Collectives in a loop, as every SPMD step does. mode "raise": process 1 raises at step 3;
# "idle": process 0 stops at step 3 outside any collective (only a heartbeat can tell it that
# its peer is gone); "loop": both go on until stopped.
COLLECTIVES = textwrap.dedent("""
    import sys, time
    import numpy as np
    from jrl.parallel import distributed
    info = distributed.initialize()
    from jax.experimental import multihost_utils
    mode = sys.argv[1]
    step = 0
    while True:
        multihost_utils.process_allgather(np.array([step]))
        step += 1
        print(f"step {step}", flush=True)
        if mode == "raise" and info.process_index == 1 and step == 3:
            raise RuntimeError("boom in process 1")
        if mode == "idle" and info.process_index == 0 and step == 3:
            time.sleep(600)
        time.sleep(0.2)
""")


class Job:
    """Two processes started by local_cluster.start, each logging to its own file."""

    def __init__(self, tmp_path, command: list[str], name: str):
        self.logs = [tmp_path / f"{name}_p{i}.log" for i in range(2)]
        files = [open(path, "w") for path in self.logs]
        try:
            self.procs = local_cluster.start(command, processes=2, env=ENV, outputs=files)
        finally:
            for f in files:
                f.close()

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def wait_until(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            codes = [p.poll() for p in self.procs]
            assert None in codes and time.monotonic() < deadline, (
                f"waiting for {what}: exit codes {codes}\n" + self.log(0)[-3000:] + "\n"
                + self.log(1)[-3000:])
            time.sleep(0.2)

    def kill(self, i: int) -> float:
        os.killpg(self.procs[i].pid, signal.SIGKILL)
        return time.monotonic()

    def wait_exit(self, i: int, since: float) -> tuple[int, float]:
        """(exit status, seconds from `since`); fails past BOUND_S."""
        try:
            code = self.procs[i].wait(timeout=BOUND_S - (time.monotonic() - since))
        except Exception:
            pytest.fail(f"process {i} still running {BOUND_S} s after its peer died:\n"
                        + self.log(i)[-3000:])
        return code, time.monotonic() - since

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def job(tmp_path):
    jobs: list[Job] = []

    def start(command, name="job"):
        jobs.append(Job(tmp_path, command, name))
        return jobs[-1]
    yield start
    for j in jobs:
        j.close()


def _collectives(tmp_path, mode: str) -> list[str]:
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES)
    return [sys.executable, str(script), mode]


def test_python_error_in_one_process_ends_the_other_naming_it(tmp_path, job):
    run = job(_collectives(tmp_path, "raise"))
    code1, _ = run.wait_exit(1, time.monotonic())
    start = time.monotonic()
    code0, seconds = run.wait_exit(0, start)
    print(f"\nsurvivor exited {seconds:.1f} s after the failing process")
    assert code1 == 1, run.log(1)[-3000:]
    assert "RuntimeError: boom in process 1" in run.log(1)
    assert code0 == distributed.PEER_LOST_STATUS, run.log(0)[-3000:]
    assert ("jrl.parallel: process 1 of 2 failed (RuntimeError: boom in process 1): exiting"
            in run.log(0))


def test_killed_process_is_noticed_by_heartbeat_outside_collectives(tmp_path, job):
    run = job(_collectives(tmp_path, "idle"))
    run.wait_until(lambda: "step 3" in run.log(0), 120, "process 0 at step 3")
    killed = run.kill(1)
    code, seconds = run.wait_exit(0, killed)
    print(f"\nsurvivor (idle) exited {seconds:.1f} s after SIGKILL")
    assert code == distributed.PEER_LOST_STATUS, run.log(0)[-3000:]
    assert "jrl.parallel: process 1 of 2 stopped responding (last heartbeat" in run.log(0)
    assert HEARTBEAT_TIMEOUT_S <= seconds, seconds


def _split_run(tmp_path, job):
    config = tmp_path / "split.json"
    config.write_text(json.dumps(to_dict(tiny_config("train.steps=40",
                                                     "pipeline.max_staleness=0"))))
    workdir = tmp_path / "work"
    run = job([sys.executable, "-m", "launch.pipeline_worker", "--config", str(config),
               "--workdir", str(workdir), "--out", str(tmp_path / "out"), "--reward", "parity"],
              name="split")
    metrics = workdir / "train" / "metrics.jsonl"
    run.wait_until(lambda: metrics.exists() and metrics.read_text().endswith("\n"), 300,
                   "the first trained step")
    return run


def test_split_run_rollout_process_killed_mid_run(tmp_path, job):
    """The train process (0) is inside a collective with the rollout process or gets there
    next: the collective fails at once and the heartbeat check names the process that died."""
    run = _split_run(tmp_path, job)
    killed = run.kill(1)
    code, seconds = run.wait_exit(0, killed)
    print(f"\ntrain process exited {seconds:.1f} s after SIGKILL of the rollout process")
    assert code == distributed.PEER_LOST_STATUS, run.log(0)[-3000:]
    assert "jrl.parallel: process 1 of 2 stopped responding (last heartbeat" in run.log(0)


def test_split_run_train_process_killed_mid_run(tmp_path, job):
    """Process 0 hosts jax's coordination service: when it dies, jax aborts the others at once
    (its message names the coordination service's leader, i.e. process 0)."""
    run = _split_run(tmp_path, job)
    killed = run.kill(0)
    code, seconds = run.wait_exit(1, killed)
    print(f"\nrollout process exited {seconds:.1f} s after SIGKILL of the train process")
    log = run.log(1)
    assert code != 0, log[-3000:]
    assert "coordination service" in log or "jrl.parallel: process 0 of 2" in log, log[-3000:]

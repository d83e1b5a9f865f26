"""--split-processes and a stop request: SIGTERM to the train process alone (a scheduler that
signals one host first) stops both processes at the same step (they agree on it in their
exchange, jrl.pipeline.loop.multihost), the train process checkpoints the last finished step, and
both exit 143; --resume then continues from that step."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from jrl.pipeline.config.tools import to_dict
from jrl.cli import local_cluster
from tests.pipeline.tiny import tiny_config

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")


def _rows(workdir) -> list[int]:
    path = os.path.join(workdir, "train", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f.read().split("\n")[:-1] if line.strip()]


def test_sigterm_to_one_process_stops_both_and_saves(tmp_path):
    config = tmp_path / "split.json"
    config.write_text(json.dumps(to_dict(tiny_config(
        "train.steps=100000", "checkpoint.every=0", "eval.greedy=false"))))
    workdir = str(tmp_path / "run")
    command = [sys.executable, "-m", "jrl.cli.train", "--config", str(config), "--workdir",
               workdir, "--split-processes"]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    files = [open(path, "w") for path in logs]
    try:
        procs = local_cluster.start(command, processes=2, env=ENV, outputs=files)
    finally:
        for f in files:
            f.close()
    try:
        deadline = time.monotonic() + 300
        while len(_rows(workdir)) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), logs[0].read_text()[-3000:]
            time.sleep(0.2)
        assert len(_rows(workdir)) >= 2, logs[0].read_text()[-3000:]
        procs[0].send_signal(signal.SIGTERM)        # process 0 trains; process 1 samples
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    train_log, rollout_log = (path.read_text() for path in logs)
    assert codes == [143, 143], (codes, train_log[-3000:], rollout_log[-3000:])
    rows = _rows(workdir)
    checkpoints = os.path.join(workdir, "train", "checkpoints")
    saved = sorted(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    assert saved and saved[-1] == rows[-1]         # the last finished step, checkpointed
    assert f"resume from step {saved[-1]} with --resume" in train_log
    assert "Traceback" not in train_log and "Traceback" not in rollout_log
    # --resume continues there, for one more step.
    resumed = local_cluster.run(command + ["--resume", "--steps", "1"], processes=2, env=ENV,
                                timeout_s=300, out=open(tmp_path / "resume.log", "w"))
    assert resumed == 0, (tmp_path / "resume.log").read_text()[-3000:]
    assert _rows(workdir)[-1] == saved[-1] + 1

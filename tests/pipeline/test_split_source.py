"""The split-process mode's two sides (jrl.pipeline.loop.multihost) in one process: Run with the link
as its rollout source (LinkSource) on the main thread, the RolloutServer on another, joined by a
fake link that keeps HostLink's contract (each exchange called by both sides in the same order).
The split mode gets Run's loop: config.json, evaluation, metrics, the bitwise synchronous
result, and a Ctrl-C save into <workdir>/train/checkpoints that --resume continues from. The
multi-process runs are tests/parallel/test_multihost_pipeline.py and test_split_stop.py (slow)."""

from __future__ import annotations

import json
import os
import queue
import threading

import numpy as np
import pytest

from jrl import stop_request
from jrl.pipeline.config import config_from_dict
from jrl.pipeline.loop.multihost import ROLLOUT, TRAIN, LinkSource, RolloutServer
from jrl.pipeline.setup.parts import build_parts
from jrl.pipeline.loop.runner import Run
from tests.pipeline.test_run import _equal_trees, _interrupt_on_call, _quiet
from tests.pipeline.tiny import tiny_config


class FakeLink:
    """HostLink's send() between two threads: the sender's arrays are queued for the receiver.
    `index` is this side's place (ROLLOUT or TRAIN), like HostLink.processes.index(me)."""

    def __init__(self, index: int, queues: dict, closed: threading.Event):
        self.index, self.queues, self.closed = index, queues, closed

    def send(self, leaves, *, src: int, like=None):
        if self.index == src:
            self.queues[src].put([np.array(x, copy=True) for x in leaves])
            return None
        while True:
            if self.closed.is_set():
                raise EOFError("the fake link is closed")
            try:
                return self.queues[src].get(timeout=0.05)
            except queue.Empty:
                continue


@pytest.fixture(autouse=True)
def one_agreement(monkeypatch):
    """stop_request's agreement is one per process and both sides share this one: each side's
    step-boundary check stays local (both skip the signal exchange, so the order of the other
    exchanges is kept; test_split_stop covers the exchange)."""
    monkeypatch.setattr(stop_request, "agree_with", lambda agree: None)


def _split(config, workdir: str, **run_kwargs):
    """(the train side's Run, start_server(), close()): the server thread serves one run()."""
    queues, closed = {ROLLOUT: queue.Queue(), TRAIN: queue.Queue()}, threading.Event()
    run = Run(config, os.path.join(workdir, "train"), spmd=False, log=_quiet,
              source=lambda parts: LinkSource(FakeLink(TRAIN, queues, closed), parts),
              **run_kwargs)
    resolved = run.config     # the rollout process builds the same resolved parts
    server = RolloutServer(FakeLink(ROLLOUT, queues, closed),
                           build_parts(resolved, log=_quiet), log=_quiet)
    errors: list[BaseException] = []

    def serve():
        try:
            server.serve()
        except EOFError:
            pass
        except BaseException as err:    # surfaced by close()
            errors.append(err)

    thread = threading.Thread(target=serve, daemon=True)

    def close():
        closed.set()
        thread.join(timeout=30)
        run.close()
        assert not errors, errors
    return run, server, thread.start, close


def test_split_run_is_runs_loop_with_config_json_and_bitwise_result(tmp_path):
    config = tiny_config("train.steps=2", "checkpoint.every=0")
    run, server, start, close = _split(config, str(tmp_path / "split"))
    start()
    try:
        result = run.run()
    finally:
        close()
    assert server.generated == [(0, 0), (1, 1)]
    workdir = tmp_path / "split" / "train"
    # config.json round trip: the resolved config the run trained with.
    with open(workdir / "config.json") as f:
        assert config_from_dict(json.load(f)) == run.config
    records = [json.loads(line)
               for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]      # the step-0 eval, then each step
    assert "eval/accuracy_greedy" in records[0] and "eval/accuracy_greedy" in records[2]
    assert all(r["mismatch/logprob_abs_diff_max"] == 0.0 for r in records[1:])
    assert all("time/batch_exchange_s" in r and "time/weight_exchange_s" in r
               for r in records[1:])
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    assert result.final_eval and (workdir / "summary.json").exists()
    single = Run(config, str(tmp_path / "single"), log=_quiet, write_metrics=False)
    try:
        reference = single.run()
    finally:
        single.close()
    assert _equal_trees(result.state.params, reference.state.params)


def test_ctrl_c_saves_the_last_step_into_train_checkpoints_and_resume_continues(tmp_path):
    config = tiny_config("train.steps=3", "checkpoint.every=0", "eval.greedy=false")
    run, _, start, close = _split(config, str(tmp_path))
    _interrupt_on_call(run.trainer, "train_on", 2)      # Ctrl-C inside step 2
    start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run.run()
    finally:
        close()
    checkpoints = tmp_path / "train" / "checkpoints"
    assert sorted(os.listdir(checkpoints)) == ["1"]      # step 1, the last finished one
    assert stop_request.last_intact_checkpoint(str(checkpoints)) == 1
    assert not (tmp_path / "checkpoints").exists()
    resumed, server, start, close = _split(config, str(tmp_path), resume=True)
    start()
    try:
        result = resumed.run()
    finally:
        close()
    assert resumed.resumed_from == 1 and server.generated == [(1, 1), (2, 2)]
    assert int(result.state.version) == 3
    assert sorted(os.listdir(checkpoints)) == ["1", "3"]

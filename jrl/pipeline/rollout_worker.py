"""The rollout side of a run: sampler threads fed by one admission queue, and a weight board.

    worker = RolloutWorker(samplers, devices, stream=..., spec=..., ...)
    worker.publish(copies, version)          # the trainer's new weights, one copy per device
    worker.start(first_step, last_step)      # one thread per sampler, in the background
    batch = worker.next_batch()              # RolloutBatch of the next RL step (blocks)
    worker.stop()

A request is admitted when the weights it would use are at most `max_staleness` versions behind
the version that will consume its batch (AReaL's capacity rule; jrl.pipeline.admission): with
max_staleness = 0 the run is the synchronous loop. Between device calls each sampler polls the
board; with `interrupt`, new weights are swapped in mid-generation (tokens after the swap carry
the new version), otherwise they wait until the sampler's in-flight samples finish.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from jrl.data import PromptStream
from jrl.pipeline.admission import AdmissionQueue
from jrl.pipeline.episodes import EpisodeDriver
from jrl.pipeline.rollout import RolloutBatch, RolloutSpec
from jrl.sampling import Sampler


class RolloutStopped(Exception):
    """Raised inside a sampler thread when the worker is shutting down."""


class WeightBoard:
    """The latest published weights, one copy per rollout device, and their version."""

    def __init__(self):
        self._lock = threading.Lock()
        self.version = -1
        self.params: list = []

    def publish(self, params_per_device: list, version: int) -> None:
        with self._lock:
            self.params, self.version = params_per_device, version

    def latest(self) -> tuple[list, int]:
        with self._lock:
            return self.params, self.version


class RolloutWorker:
    """Sampler threads (one per rollout device) producing one RolloutBatch per RL step.

    render(example) -> prompt ids; decode(sample) -> response text; reward_fn(text, example);
    shard_index: this process's shard of the prompt stream (several processes).
    precompile: each sampler thread compiles all its device programs before its first request
      (Sampler.precompile), so no step in the middle of the run pays for a compile.
    make_driver(example_of) -> EpisodeDriver: multi-turn episodes (jrl.pipeline.episodes);
      example_of(prompt_id) gives an in-flight request's example. None: single-turn.
    """

    def __init__(self, samplers: list[Sampler], devices: list, *, stream: PromptStream,
                 spec: RolloutSpec, updates_per_step: int, max_staleness: int, interrupt: bool,
                 render: Callable, decode: Callable, reward_fn: Callable,
                 raise_reward_errors: bool = False, shard_index: int = 0, queue_size: int = 2,
                 precompile: bool = False,
                 make_driver: Callable[[Callable], EpisodeDriver] | None = None):
        self.samplers = samplers
        self.devices = list(devices)
        self.stream = stream
        self.spec = spec
        self.updates_per_step = updates_per_step
        self.max_staleness = max_staleness
        self.interrupt = interrupt
        self.render, self.decode, self.reward_fn = render, decode, reward_fn
        self.raise_reward_errors = raise_reward_errors
        self.shard_index = shard_index
        self.precompile = precompile
        self.make_driver = make_driver
        self.board = WeightBoard()
        # Admission already bounds how far rollout runs ahead (k + 1 steps); the queue must hold
        # that many batches so a finished batch never blocks a sampler thread.
        self._queue: queue.Queue = queue.Queue(maxsize=max(queue_size, max_staleness + 2))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._idle_mark: tuple[float, float] | None = None

    def publish(self, params_per_device: list, version: int) -> None:
        self.board.publish(params_per_device, version)

    # ------------------------------------------------------------------------------------------

    def start(self, first_step: int, last_step: int) -> None:
        """Generates the batches of RL steps [first_step, last_step) in a background thread."""
        self._stop.clear()
        self._error = None
        self._idle_mark = None
        self._thread = threading.Thread(target=self._loop, args=(first_step, last_step),
                                        daemon=True, name="jrl-rollout")
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout)

    def next_batch(self) -> RolloutBatch:
        """The next RL step's batch; re-raises a sampler thread's error."""
        while True:
            if self._error is not None:
                raise self._error
            try:
                return self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    if self._error is not None:
                        raise self._error
                    raise RuntimeError("rollout thread ended without producing a batch")

    def idle_fraction(self) -> float:
        """Fraction of the time since the last call that the samplers sat with no request."""
        now = time.perf_counter()
        idle = sum(sampler.idle_s for sampler in self.samplers)
        last_time, last_idle = self._idle_mark or (now, idle)
        self._idle_mark = (now, idle)
        return (idle - last_idle) / max((now - last_time) * len(self.samplers), 1e-9)

    # ------------------------------------------------------------------------------------------

    def _emit(self, batch: RolloutBatch) -> None:
        while True:
            if self._stop.is_set():
                raise RolloutStopped()
            try:
                self._queue.put(batch, timeout=0.05)
                return
            except queue.Full:
                continue

    def _loop(self, first_step: int, last_step: int) -> None:
        admission = AdmissionQueue(
            first_step=first_step, last_step=last_step, stream=self.stream, spec=self.spec,
            updates_per_step=self.updates_per_step, max_staleness=self.max_staleness,
            render=self.render, decode=self.decode, reward_fn=self.reward_fn,
            raise_reward_errors=self.raise_reward_errors, emit=self._emit,
            shard_index=self.shard_index)
        driver = self.make_driver(admission.example_of) if self.make_driver else None
        threads = [threading.Thread(target=self._replica, args=(r, admission, driver),
                                    daemon=True, name=f"jrl-rollout-{r}")
                   for r in range(len(self.samplers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if driver is not None:
            driver.close()

    def _replica(self, r: int, admission: AdmissionQueue, driver: EpisodeDriver | None) -> None:
        try:
            params_all, version = self.board.latest()
            if self.precompile:
                self.samplers[r].precompile(params_all[r])
            outstanding = [0]   # requests taken by this replica and not yet finished
            local = {"version": version}

            def next_request():
                if self._stop.is_set():
                    raise RolloutStopped()
                request = admission.pop(local["version"])
                if request is not None:
                    outstanding[0] += 1
                return request

            def on_sample(sample):
                outstanding[0] -= 1
                admission.on_sample(driver.finish(sample) if driver is not None else sample)

            def poll():
                if self._stop.is_set():
                    raise RolloutStopped()
                params, latest = self.board.latest()
                if latest <= local["version"]:
                    return None
                # Without interruption, new weights wait until in-flight samples finish.
                if not self.interrupt and outstanding[0] > 0:
                    return None
                local["version"] = latest
                return params[r], latest

            self.samplers[r].serve(
                params_all[r], next_request=next_request, on_sample=on_sample,
                version=version, poll_weights=poll,
                keep_alive=lambda: not admission.done() and not self._stop.is_set(),
                on_turn=driver.on_turn if driver is not None else None)
        except RolloutStopped:
            return
        except BaseException as err:  # surfaced in the main thread by next_batch
            if self._error is None:
                self._error = err
            self._stop.set()

"""The rollout side of a run: sampler threads fed by one admission queue, and a weight board.

    worker = RolloutWorker(samplers, devices, stream, task, rollout_options(cfg))
    worker.publish(copies, version)          # the trainer's new weights, one copy per device
    worker.start(first_step, last_step)      # one thread per sampler, in the background
    batch = worker.next_batch()              # RolloutBatch of the next RL step (blocks)
    worker.stop()

    batch = worker.generate(rl_step, params, version)   # or: one step, in this thread

A request is admitted when the weights it would use are at most `max_staleness` versions behind
the version that will consume its batch (AReaL's capacity rule; jrl.pipeline.rollout.admission): with
max_staleness = 0 the run is the synchronous loop. Between device calls each sampler polls the
board; with `interrupt`, new weights are swapped in mid-generation (tokens after the swap carry
the new version), otherwise they wait until the sampler's in-flight samples finish.
"""

from __future__ import annotations

import queue
import threading
import time

from jrl.data import PromptStream
from jrl.pipeline.rollout.admission import AdmissionQueue
from jrl.pipeline.rollout.batch import RolloutBatch, RolloutOptions
from jrl.stop_request import check_stop
from jrl.pipeline.rollout.task import Task
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

    samplers[i] generates on devices[i]; stream: the prompts (this process's shard with several
    processes); task: renders prompts, scores groups, drives multi-turn episodes
    (jrl.pipeline.rollout.task); options: batch shape and schedule (jrl.pipeline.rollout.batch).
    """

    def __init__(self, samplers: list[Sampler], devices: list, stream: PromptStream, task: Task,
                 options: RolloutOptions):
        if len(samplers) != len(devices):
            raise ValueError(f"RolloutWorker: {len(samplers)} samplers for {len(devices)} "
                             "devices; give one sampler per rollout device")
        self.samplers = list(samplers)
        self.devices = list(devices)
        self.stream = stream
        self.task = task
        self.options = options
        self.board = WeightBoard()
        # Admission already bounds how far rollout runs ahead (k + 1 steps); the queue must hold
        # that many batches so a finished batch never blocks a sampler thread.
        self._queue: queue.Queue = queue.Queue(
            maxsize=max(options.queue_size, options.max_staleness + 2))
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._idle_mark: tuple[float, float] | None = None

    def publish(self, params_per_device: list, version: int) -> None:
        """New weights for the samplers: one copy per rollout device, and their version."""
        self.board.publish(params_per_device, version)

    @property
    def published_version(self) -> int:
        """The version of the latest published weights (-1 before the first)."""
        return self.board.latest()[1]

    def _admission(self, first_step: int, last_step: int, emit) -> AdmissionQueue:
        return AdmissionQueue(first_step=first_step, last_step=last_step, stream=self.stream,
                              task=self.task, options=self.options, emit=emit)

    def generate(self, rl_step: int, params, version: int) -> RolloutBatch:
        """Step `rl_step`'s batch, generated in the calling thread by samplers[0] with `params`
        (of `version`) under the same admission rules as the threads: no weight swap, so every
        token has `version`. RuntimeError when version is older than the step admits."""
        required = self.options.first_version(rl_step)
        if version < required:
            raise RuntimeError(f"step {rl_step} needs weights of version >= {required} "
                               f"(max_staleness={self.options.max_staleness}), got {version}")
        out: list[RolloutBatch] = []
        admission = self._admission(rl_step, rl_step + 1, out.append)
        driver = self.task.episode_driver(admission.example_of)
        try:
            self.samplers[0].serve(
                params, next_request=lambda: admission.pop(version),
                on_sample=lambda sample: admission.on_sample(
                    driver.finish(sample) if driver is not None else sample),
                version=version, keep_alive=lambda: not admission.done(),
                on_turn=driver.on_turn if driver is not None else None)
        finally:
            if driver is not None:
                driver.close()
        if len(out) != 1:
            raise RuntimeError(f"step {rl_step}: the sampler ended with {len(out)} batches")
        return out[0]

    # ------------------------------------------------------------------------------------------

    def start(self, first_step: int, last_step: int) -> None:
        """Generates the batches of RL steps [first_step, last_step) in a background thread,
        with the published weights (RuntimeError when none were published yet)."""
        if self.published_version < 0:
            raise RuntimeError("RolloutWorker.start: no weights were published yet; publish "
                               "the trainer's first (jrl.pipeline.publish_to(worker)(trainer))")
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("RolloutWorker.start: the previous rollout thread is still "
                               "running (stop() timed out); it would emit into this run's "
                               "queue")
        # Batches a stopped worker produced ahead belong to the steps it was running then;
        # a restart from first_step starts from an empty queue.
        while not self._queue.empty():
            self._queue.get_nowait()
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
        """The next RL step's batch; re-raises a sampler thread's error. Checks for a stop
        request while it waits (jrl.stop_request)."""
        while True:
            if self._error is not None:
                raise self._error
            check_stop()
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
        admission = self._admission(first_step, last_step, self._emit)
        driver = self.task.episode_driver(admission.example_of)
        threads = [threading.Thread(target=self._replica, args=(r, admission, driver),
                                    daemon=True, name=f"jrl-rollout-{r}")
                   for r in range(len(self.samplers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if driver is not None:
            driver.close()

    def _replica(self, r: int, admission: AdmissionQueue, driver) -> None:
        try:
            params_all, version = self.board.latest()
            if self.options.precompile:
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
                if not self.options.interrupt and outstanding[0] > 0:
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

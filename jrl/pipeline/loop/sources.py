"""Rollout sources: where the one run loop (jrl.pipeline.loop.runner.Run) gets each RL step's batch
and where the trainer's new weights go.

    source = InProcessSource(worker)        # or GatheredSource (spmd), LinkSource (multihost)
    source.begin(first_step, last_step)     # Run.run's first act: the steps it will train
    source.publish(trainer)                 # RLStep's publisher: the weights leave for sampling
    source.start(first_step, last_step)     # after the first publish
    batch = source.next_batch()             # RolloutBatch of the next RL step (blocks)
    metrics.update(source.step_metrics())   # the transport's own per-step timings
    source.stop()
    source.agree                            # the stop agreement (jrl.stop_request), or None

The implementations differ only in transport:
- InProcessSource: sampler threads of this process (RolloutWorker), weights put on its board;
- GatheredSource (jrl.pipeline.loop.spmd): the same, then every process's share joined into the
  step's global batch; every process agrees on a stop at each step boundary;
- LinkSource (jrl.pipeline.loop.multihost): batches received from a rollout process over a host
  link, weights sent back to it.
"""

from __future__ import annotations

from typing import Callable, Protocol

from jrl.metrics import names
from jrl.pipeline.training.rl_step import publish_to
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.pipeline.rollout.worker import RolloutWorker
from jrl.pipeline.training.trainer import Published, Trainer


class RolloutSource(Protocol):
    """The transport between rollout and training, as Run's loop sees it (module docstring)."""

    agree: Callable[[int], int] | None

    def begin(self, first_step: int, last_step: int) -> None:
        """The steps Run.run will train, told before any long local work (the starting policy,
        evaluation): a remote rollout side learns them here."""

    def publish(self, trainer: Trainer) -> Published: ...

    def start(self, first_step: int, last_step: int) -> None: ...

    def next_batch(self) -> RolloutBatch: ...

    def step_metrics(self) -> dict: ...

    def stop(self) -> None: ...


class InProcessSource:
    """This process's sampler threads: the worker's batches, the weights on its board."""

    agree: Callable[[int], int] | None = None     # one process decides alone

    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        self._publish = publish_to(worker)

    def begin(self, first_step: int, last_step: int) -> None:
        pass

    def publish(self, trainer: Trainer) -> Published:
        return self._publish(trainer)

    def start(self, first_step: int, last_step: int) -> None:
        self.worker.start(first_step, last_step)

    def next_batch(self) -> RolloutBatch:
        return self.worker.next_batch()

    def step_metrics(self) -> dict:
        return {names.TIME_ROLLOUT_IDLE_FRAC: self.worker.idle_fraction()}

    def stop(self) -> None:
        self.worker.stop()

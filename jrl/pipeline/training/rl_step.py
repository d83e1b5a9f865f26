"""One RL step on the train side, with the versions explicit in and out.

    step = RLStep(trainer, publish=publish_to(worker))
    result = step(rollout)          # StepResult

    version_in = trainer.version                                # the version consuming the batch
    prepared = trainer.prepare(rollout)                         # complete TrainBatch
    trainer.train_on(prepared.batch, rollout.rl_step)           # U optimizer updates
    published = publish(trainer)                                # version_out = version_in + U

Run (one process or SPMD) and the split-process mode (jrl.pipeline.loop.multihost) both call it, and
so can a hand-written loop; what each does around it (waiting for the batch, gathering it across
processes, sending the weights to another process) is its own.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from jrl.metrics import names
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.pipeline.rollout.worker import RolloutWorker
from jrl.pipeline.training.trainer import Published, Trainer

Publisher = Callable[[Trainer], Published]


@dataclasses.dataclass
class StepResult:
    """What one RL step did. version_in: the trainer's version when it consumed the batch;
    version_out: the version after its updates, the one published. metrics: the batch's
    rollout/*, mismatch/* (prepare), train/* (the updates), time/train_s, time/weight_sync_s and
    train/version. consumed: the versions consumed (PreparedBatch.consumed). data_state: the
    prompt stream's state after the batch's prompts (a checkpoint of this step saves it)."""

    rl_step: int
    version_in: int
    version_out: int
    metrics: dict
    consumed: dict
    data_state: dict


def publish_to(worker: RolloutWorker) -> Publisher:
    """The publisher of an in-process rollout side: the trainer's params copied to each of the
    worker's devices (Trainer.publish, which holds the version) and put on its weight board."""
    def publish(trainer: Trainer) -> Published:
        published = trainer.publish(worker.devices)
        worker.publish(published.params, published.version)
        return published
    return publish


def hold_only(trainer: Trainer) -> Published:
    """The publisher when the weights leave by another path (the split-process link): the
    version is held for rescoring, nothing is copied (0 seconds)."""
    return Published([], trainer.hold_version(), 0.0)


class RLStep:
    """rollout batch -> prepare -> train -> publish, on `trainer` (module docstring)."""

    def __init__(self, trainer: Trainer, *, publish: Publisher):
        self.trainer = trainer
        self.publish = publish

    def __call__(self, rollout: RolloutBatch) -> StepResult:
        trainer = self.trainer
        version_in = trainer.version
        start = time.perf_counter()
        prepared = trainer.prepare(rollout)
        metrics = prepared.metrics
        metrics[names.TIME_PREPARE_S] = time.perf_counter() - start
        start = time.perf_counter()
        metrics.update(trainer.train_on(prepared.batch, rollout.rl_step))
        metrics[names.TIME_TRAIN_S] = time.perf_counter() - start
        published = self.publish(trainer)
        metrics[names.TIME_WEIGHT_SYNC_S] = published.seconds
        metrics[names.TRAIN_VERSION] = published.version
        return StepResult(rollout.rl_step, version_in, published.version, metrics,
                          prepared.consumed, rollout.data_state)

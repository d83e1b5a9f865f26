"""RLStep, publish_to and hold_only (jrl.pipeline.training.rl_step) with a FakeTrainer that records its
calls: prepare -> train -> publish in that order on the rollout's step, the versions in and out,
the metrics merged, and an error in training leaves nothing published."""

import numpy as np
import pytest

from jrl.metrics import names
from jrl.pipeline.training.prepare import PreparedBatch
from jrl.pipeline.training.rl_step import RLStep, hold_only, publish_to
from jrl.pipeline.rollout.batch import RolloutBatch
from jrl.pipeline.rollout.worker import RolloutWorker
from jrl.pipeline.training.trainer import Published
from tests.pipeline.parts.fakes import FakeSampler, FakeTask, options, sample, stream


class FakeTrainer:
    """The parts of Trainer that RLStep and the publishers use. train_on makes `updates`
    versions; publish copies "params@vN" to each device; every call goes to `calls`."""

    def __init__(self, *, version=0, updates=2, fail_training=False):
        self._version, self.updates, self.fail_training = version, updates, fail_training
        self.calls: list[tuple] = []

    @property
    def version(self):
        return self._version

    def prepare(self, rollout):
        self.calls.append(("prepare", rollout.rl_step, self._version))
        return PreparedBatch(batch=f"batch of step {rollout.rl_step}",
                             metrics={**rollout.metrics, "mismatch/numerical_abs": 0.25},
                             consumed={"rl_step": rollout.rl_step,
                                       "trainer_version": self._version})

    def train_on(self, batch, rl_step):
        self.calls.append(("train_on", batch, rl_step))
        if self.fail_training:
            raise FloatingPointError("the device reported NaN")
        self._version += self.updates
        return {"train/loss": -0.5, "train/grad_norm": 2.0}

    def hold_version(self):
        self.calls.append(("hold_version", self._version))
        return self._version

    def publish(self, devices):
        self.calls.append(("publish", tuple(devices)))
        return Published([f"params@v{self._version}@{d}" for d in devices], self.hold_version(),
                         0.125)


def _rollout(rl_step=3):
    return RolloutBatch(rl_step=rl_step, samples=[sample(0, 0), sample(0, 1)],
                        examples=[None, None], rewards=np.array([1, 0], np.float32),
                        group_size=2, data_state={"index": 7},
                        metrics={"rollout/reward_mean": 0.5})


def _recording_publisher(trainer):
    def publish(t):
        assert t is trainer
        trainer.calls.append(("publisher",))
        return Published(["copy"], t.hold_version(), 0.375)
    return publish


def test_one_step_prepares_trains_then_publishes_and_reports_the_versions():
    trainer = FakeTrainer(version=6, updates=2)
    result = RLStep(trainer, publish=_recording_publisher(trainer))(_rollout(rl_step=3))
    assert trainer.calls == [("prepare", 3, 6), ("train_on", "batch of step 3", 3),
                             ("publisher",), ("hold_version", 8)]
    # U = 2 updates: version 6 consumed the batch, version 8 was published.
    assert (result.rl_step, result.version_in, result.version_out) == (3, 6, 8)
    assert result.consumed == {"rl_step": 3, "trainer_version": 6}
    assert result.data_state == {"index": 7}


def test_the_step_metrics_merge_rollout_prepare_train_and_publish():
    trainer = FakeTrainer(version=0, updates=1)
    metrics = RLStep(trainer, publish=_recording_publisher(trainer))(_rollout()).metrics
    assert set(metrics) == {"rollout/reward_mean", "mismatch/numerical_abs", "train/loss",
                            "train/grad_norm", names.TIME_PREPARE_S, names.TIME_TRAIN_S,
                            names.TIME_WEIGHT_SYNC_S, names.TRAIN_VERSION}
    assert (metrics["rollout/reward_mean"], metrics["mismatch/numerical_abs"],
            metrics["train/loss"], metrics["train/grad_norm"]) == (0.5, 0.25, -0.5, 2.0)
    # The publisher's seconds and version, as it reported them.
    assert metrics[names.TIME_WEIGHT_SYNC_S] == 0.375 and metrics[names.TRAIN_VERSION] == 1
    assert metrics[names.TIME_PREPARE_S] >= 0.0 and metrics[names.TIME_TRAIN_S] >= 0.0


def test_an_error_in_training_propagates_and_nothing_is_published():
    trainer = FakeTrainer(fail_training=True)
    step = RLStep(trainer, publish=_recording_publisher(trainer))
    with pytest.raises(FloatingPointError, match="NaN"):
        step(_rollout())
    assert [call[0] for call in trainer.calls] == ["prepare", "train_on"]


def test_publish_to_puts_the_trainers_copies_on_the_workers_board():
    worker = RolloutWorker([FakeSampler(), FakeSampler()], ["d0", "d1"], stream(), FakeTask(),
                           options())
    trainer = FakeTrainer(version=4, updates=1)
    result = RLStep(trainer, publish=publish_to(worker))(_rollout())
    assert result.version_out == 5 and result.metrics[names.TIME_WEIGHT_SYNC_S] == 0.125
    assert ("publish", ("d0", "d1")) in trainer.calls
    assert worker.published_version == 5
    assert worker.board.latest() == (["params@v5@d0", "params@v5@d1"], 5)


def test_hold_only_holds_the_version_and_copies_nothing():
    trainer = FakeTrainer(version=3)
    assert hold_only(trainer) == Published([], 3, 0.0)
    assert trainer.calls == [("hold_version", 3)]
    result = RLStep(trainer, publish=hold_only)(_rollout())
    assert (result.version_in, result.version_out) == (3, 5)
    assert result.metrics[names.TIME_WEIGHT_SYNC_S] == 0.0

"""Orchestration: run configs, and a run as public parts.

    prepare_batch / PrepareOptions   a rollout -> a complete TrainBatch (prepare.py)
    Trainer                          train devices, mini-batch loop, versions, publishing,
                                     checkpoints (trainer.py)
    RolloutWorker                    sampler threads, admission, weight board (rollout_worker.py)
    Run                              builds the parts from an RunConfig and runs the loop
"""

from jrl.pipeline.config_tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.config import RunConfig
from jrl.pipeline.prepare import PreparedBatch, PrepareOptions, prepare_batch
from jrl.pipeline.rollout_worker import RolloutWorker
from jrl.pipeline.runner import Run, RunResult
from jrl.pipeline.trainer import Trainer

__all__ = ["apply_overrides", "from_dict", "to_dict", "RunConfig", "PreparedBatch",
           "PrepareOptions", "prepare_batch", "RolloutWorker", "Run", "RunResult", "Trainer"]

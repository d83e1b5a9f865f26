"""Orchestration: run configs, and a run as public parts.

    RunConfig                          every knob of a run, validated (config.py)
    Task                               prompt rendering, response decoding, rewards, episodes
                                       (task.py)
    prepare_batch / PrepareOptions     a rollout -> a complete TrainBatch (prepare.py)
    Trainer / TrainerOptions           train devices, mini-batch loop, held versions,
                                       publishing, checkpoints (trainer.py)
    RolloutWorker / RolloutOptions     sampler threads, admission, weight board; or one step in
                                       this thread (rollout_worker.py, rollout.py)
    RolloutSpec / RolloutBatch         one step's batch shape, and the batch (rollout.py)
    RLStep / StepResult                one RL step: prepare -> train -> publish (rl_step.py)
    build_parts / RunParts             every part of a run from its config (parts.py)
    RolloutSource                      where a run's batches come from and its weights go:
                                       in process, gathered over SPMD processes, or over the
                                       host link from a rollout process (sources.py)
    Run                                the parts wired into the one loop, for every mode, with
                                       checkpoints and evals
"""

from jrl.pipeline.config import RunConfig
from jrl.pipeline.config_tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.evaluation import evaluate
from jrl.pipeline.parts import RunParts, build_parts
from jrl.pipeline.prepare import PreparedBatch, PrepareOptions, prepare_batch
from jrl.pipeline.rl_step import RLStep, StepResult, hold_only, publish_to
from jrl.pipeline.rollout import RolloutBatch, RolloutOptions, RolloutSpec
from jrl.pipeline.rollout_worker import RolloutWorker
from jrl.pipeline.runner import Run, RunResult
from jrl.pipeline.task import GroupScore, Task
from jrl.pipeline.trainer import Published, Trainer, TrainerOptions
from jrl.pipeline.warm_start import start_policy, warm_start

__all__ = ["apply_overrides", "build_parts", "evaluate", "from_dict", "GroupScore",
           "hold_only", "PreparedBatch", "PrepareOptions", "prepare_batch", "publish_to",
           "Published", "RLStep", "RolloutBatch", "RolloutOptions", "RolloutSpec",
           "RolloutWorker", "Run", "RunConfig", "RunParts", "RunResult", "start_policy",
           "StepResult", "Task", "to_dict", "Trainer", "TrainerOptions", "warm_start"]

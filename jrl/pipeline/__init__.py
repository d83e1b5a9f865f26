"""Orchestration: run configs, and a run as public parts, in floors that import downward.

    rollout/    RolloutBatch / RolloutSpec / RolloutOptions, Task (prompts, decoding, rewards,
                episodes), RolloutWorker (sampler threads, admission, the weight board)
    training/   prepare_batch / PrepareOptions (a rollout -> a complete TrainBatch), Trainer /
                TrainerOptions (train devices, held versions, publishing, checkpoints), RLStep
    config/     RunConfig: every knob of a run, validated (one module per section group)
    setup/      build_parts / RunParts, and every part's options read from the config
    loop/       Run: the parts wired into the one loop, for every mode (its rollout source: in
                process, gathered over SPMD processes, or over the host link), with
                checkpoints and evals
"""

from jrl.pipeline.config import RunConfig
from jrl.pipeline.config.tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.loop.evaluation import evaluate
from jrl.pipeline.loop.runner import Run, RunResult
from jrl.pipeline.loop.warm_start import start_policy, warm_start
from jrl.pipeline.rollout.batch import RolloutBatch, RolloutOptions, RolloutSpec
from jrl.pipeline.rollout.task import GroupScore, Task
from jrl.pipeline.rollout.worker import RolloutWorker
from jrl.pipeline.setup.options import (prepare_options, rollout_options, rollout_spec,
                                        task_from_config, trainer_options)
from jrl.pipeline.setup.parts import RunParts, build_parts
from jrl.pipeline.training.prepare import PreparedBatch, PrepareOptions, prepare_batch
from jrl.pipeline.training.rl_step import RLStep, StepResult, hold_only, publish_to
from jrl.pipeline.training.trainer import Published, Trainer, TrainerOptions

__all__ = ["apply_overrides", "build_parts", "evaluate", "from_dict", "GroupScore",
           "hold_only", "PreparedBatch", "PrepareOptions", "prepare_batch", "publish_to",
           "Published", "RLStep", "RolloutBatch", "RolloutOptions", "RolloutSpec",
           "RolloutWorker", "Run", "RunConfig", "RunParts", "RunResult", "start_policy",
           "StepResult", "Task", "task_from_config", "to_dict", "Trainer", "TrainerOptions",
           "trainer_options", "prepare_options", "rollout_options", "rollout_spec", "warm_start"]

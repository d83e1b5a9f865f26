"""Orchestration: experiment configs, rollout, the sync/async run loop with explicit versions."""

from jrl.pipeline.config_tools import apply_overrides, from_dict, to_dict
from jrl.pipeline.experiment import ExperimentConfig
from jrl.pipeline.runner import Run, RunResult

__all__ = ["apply_overrides", "from_dict", "to_dict", "ExperimentConfig", "Run", "RunResult"]

"""The run config: every knob of a run, validated when it is built.

A config file (jrl/configs/NAME.py) defines `get_config() -> RunConfig`; the CLI applies
`--set section.key=value` overrides on top. The whole config is saved with every checkpoint.

    model.py       ModelSection
    data.py        DataSection
    rollout.py     SamplingSection, SpeculativeSection, RolloutSection
    algorithm.py   AlgorithmSection, and the recipe it builds
    train.py       TrainSection, EvalSection, CheckpointSection, PipelineSection
    env.py         EnvSection
    metrics.py     MetricsSection
    run.py         RunConfig (the sections together), RunSeeds, config_from_dict
    tools.py       overrides and the dict round trip of any config dataclass
    migration.py   keys that moved, read under their new names
"""

from jrl.pipeline.config.algorithm import AlgorithmSection
from jrl.pipeline.config.data import DATA_SOURCES, TEMPLATES, TOO_LONG_POLICIES, DataSection
from jrl.pipeline.config.env import EnvSection
from jrl.pipeline.config.metrics import METRIC_BACKENDS, MetricsSection
from jrl.pipeline.config.model import MODEL_SOURCES, ROUTING_MODES, TOKENIZERS, ModelSection
from jrl.pipeline.config.rollout import RolloutSection, SamplingSection, SpeculativeSection
from jrl.pipeline.config.run import RunConfig, RunSeeds, config_from_dict
from jrl.pipeline.config.train import (KV_ON_SWAP, OLD_LOGP_SOURCES, REFERENCE_MODES,
                                       CheckpointSection, EvalSection, PipelineSection,
                                       TrainSection)

__all__ = ["AlgorithmSection", "CheckpointSection", "config_from_dict", "DATA_SOURCES",
           "DataSection", "EnvSection", "EvalSection", "KV_ON_SWAP", "METRIC_BACKENDS",
           "MetricsSection", "MODEL_SOURCES", "ModelSection", "OLD_LOGP_SOURCES", "PipelineSection", "REFERENCE_MODES",
           "RolloutSection", "ROUTING_MODES", "RunConfig", "RunSeeds", "SamplingSection",
           "SpeculativeSection", "TEMPLATES", "TOKENIZERS", "TOO_LONG_POLICIES", "TrainSection"]

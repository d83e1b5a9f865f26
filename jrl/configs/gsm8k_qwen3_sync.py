"""The seed article's synchronous GSM8K run, for a local Qwen3 checkpoint on an accelerator.

GRPO, temperature 1.0, 1024 responses per step (128 prompts x 8), one optimizer update per
rollout, responses up to 1024 tokens, p_old recomputed by the train engine, dynamic sampling on,
reference KL logged (computed, coefficient 0 in the loss: the article's use_kl_loss with
kl_loss_coef=0 is train.reference="reward" with kl_reward_coef=0). Point it at local files:

    python -m jrl.cli.train --config jrl/configs/gsm8k_qwen3_sync.py \\
        --set model.path=/path/to/Qwen3-0.6B --set data.path=/path/to/gsm8k/train.jsonl \\
        --set data.eval_path=/path/to/gsm8k/test.jsonl
"""

from jrl.kernels.contract import NumericalContract
from jrl.pipeline.config import (CheckpointSection, DataSection, EvalSection, RunConfig,
                                     AlgorithmSection, ModelSection, PipelineSection, RolloutSection,
                                     SamplingSection, TrainSection)
from jrl.train.optimizer import OptimizerConfig

PLACEHOLDER = "SET_ME"


def get_config() -> RunConfig:
    return RunConfig(
        name="gsm8k_qwen3_sync",
        seed=0,
        model=ModelSection(source="hf", path=PLACEHOLDER, tokenizer="model"),
        numerics=NumericalContract(backend="pallas", compute_dtype="bfloat16",
                                   param_dtype="float32", vocab_chunk=4096),
        data=DataSection(source="gsm8k_jsonl", path=PLACEHOLDER, eval_path=None,
                         train_size=7473, eval_size=1319, template="chat"),
        sampling=SamplingSection(temperature=1.0, max_new_tokens=1024, group_size=8),
        rollout=RolloutSection(prompts_per_step=128, num_slots=256, max_prompt_len=512,
                               steps_per_call=32, max_sampling_rounds=4),
        algorithm=AlgorithmSection(recipe="grpo", kl_beta=0.0, dynamic_sampling=True),
        optimizer=OptimizerConfig(learning_rate=1e-6, warmup_steps=0, weight_decay=0.1,
                                  max_grad_norm=1.0),
        train=TrainSection(steps=120, mini_batches=1, micro_batches=16, old_logp="recompute",
                           reference="reward", kl_reward_coef=0.0),
        eval=EvalSection(every=20, greedy=True, sampled=True),
        checkpoint=CheckpointSection(every=20, keep=2),
        pipeline=PipelineSection(max_staleness=0),
    )

"""Multi-turn RL with a calculator tool: a tiny model learns to use it for sums it cannot do in
its head.

Problems are 3-digit additions ("What is 347 + 589?"), which the 0.4M-parameter character-level
decoder of arith_tiny.py gets mostly wrong when it adds in its head. Each episode may call the
calculator (jrl.envs.CalculatorEnv): a model turn "calc(347+589)" ends at the end-of-sequence
token, the environment's answer "=936" is appended into the slot's KV cache as an observation,
and the model's next turn gives the final answer ("#### 936"), graded by the environment.

The warm start shows 20% of the examples as calculator episodes (train.sft_tool_frac: the model
turns trained on, the observation not) and 80% as in-head worked solutions, so the warm-started
policy mostly adds in its head, as a base model that rarely reaches for its tools would. RL
(GRPO, group size 8, k3 KL 0.04 to the warm start) on the Pallas backend, where every model
token's p_b equals the trainer's p_o bitwise across turns, must learn from the reward alone that
calling the tool pays. Compare jrl/configs/calc_tiny.py with --set env.name=none
--set train.sft_tool_frac=0 (the same task in the head only).
"""

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.config import (CheckpointSection, DataSection, EnvSection, EvalSection,
                                     RunConfig, AlgorithmSection, ModelSection,
                                     PipelineSection, RolloutSection, SamplingSection,
                                     TrainSection)
from jrl.train.optimizer import OptimizerConfig


def get_config() -> RunConfig:
    return RunConfig(
        name="calc_tiny",
        seed=0,
        model=ModelSection(
            source="random",
            tokenizer="char",
            arch=ModelConfig(model_type="llama", vocab_size=CharTokenizer().vocab_size,
                             hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=32, max_position_embeddings=64),
        ),
        numerics=NumericalContract(backend="pallas", compute_dtype="float32"),
        data=DataSection(source="arithmetic", num_terms=2, max_operand=999, operators="+",
                         train_size=4000, eval_size=128, template="plain",
                         user_format="{question}\n"),
        # 32 tokens hold a tool episode: "calc(347+589)" + eos, "=936\n", "#### 936" + eos.
        sampling=SamplingSection(temperature=1.0, max_new_tokens=32, group_size=8),
        rollout=RolloutSection(prompts_per_step=16, num_slots=64, max_prompt_len=24,
                               steps_per_call=24),
        algorithm=AlgorithmSection(recipe="grpo", kl_beta=0.04),
        optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2, weight_decay=0.0,
                                  max_grad_norm=1.0),
        train=TrainSection(steps=80, mini_batches=1, micro_batches=1, sft_steps=600,
                           sft_batch_size=64, sft_learning_rate=1e-3, sft_tool_frac=0.2),
        eval=EvalSection(every=20, greedy=True, sampled=True),
        checkpoint=CheckpointSection(every=40, keep=2),
        pipeline=PipelineSection(max_staleness=0),
        env=EnvSection(name="calculator", max_turns=3, timeout_s=5.0, max_observation_tokens=12,
                       observation_format="={observation}\n"),
    )

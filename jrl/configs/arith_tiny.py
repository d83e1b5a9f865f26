"""The embedded default (`make demo`): a tiny model learns 3-term addition with GRPO on a CPU.

A 0.4M-parameter decoder with a character tokenizer gets a cross-entropy warm start on generated
worked solutions ("7+5=12\n12+3=15\n#### 15"), in which 70% of the solutions end in a wrong
final answer (#### 16 for 15; train.sft_wrong_answer_frac): the warm-started policy computes the
sum but has learned to report it off by one, as a base model with a bad habit would. Then GRPO
(group size 8, clip 0.2, a k3 KL penalty of 0.04 to the warm-started policy) on the Pallas
backend, so the sampler's logprobs equal the trainer's bitwise, must remove the habit from the
verifier's reward alone: RL, not the supervised data, does the lifting. The KL term keeps the
worked steps close to the warm start while the final answer moves; without it (DAPO's loss) the
gain varied from +28 to +44 points over seeds and could fall back late in a run. Evaluation uses
128 held-out problems never seen in training.
"""

from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.config import (CheckpointSection, DataSection, EvalSection, RunConfig,
                                     AlgorithmSection, ModelSection, PipelineSection, RolloutSection,
                                     SamplingSection, TrainSection)
from jrl.train.optimizer import OptimizerConfig


def get_config() -> RunConfig:
    return RunConfig(
        name="arith_tiny",
        seed=0,
        model=ModelSection(
            source="random",
            tokenizer="char",
            arch=ModelConfig(model_type="llama", vocab_size=CharTokenizer().vocab_size,
                             hidden_size=128,
                             intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                             head_dim=32, max_position_embeddings=64),
        ),
        numerics=NumericalContract(backend="pallas", compute_dtype="float32"),
        data=DataSection(source="arithmetic", num_terms=3, max_operand=9, operators="+",
                         train_size=2000, eval_size=128, template="plain",
                         user_format="{question}\n"),
        sampling=SamplingSection(temperature=1.0, max_new_tokens=28, group_size=8),
        rollout=RolloutSection(prompts_per_step=16, num_slots=64, max_prompt_len=24,
                               steps_per_call=24),
        algorithm=AlgorithmSection(recipe="grpo", kl_beta=0.04),
        optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2, weight_decay=0.0,
                                  max_grad_norm=1.0),
        # A slower, longer warm start (1e-3 x 600 rather than 3e-3 x 300): at the higher rate
        # some seeds never learn to copy the operands from the question, and RL cannot fix that.
        train=TrainSection(steps=120, mini_batches=1, micro_batches=1, sft_steps=600,
                           sft_batch_size=64, sft_learning_rate=1e-3, sft_wrong_answer_frac=0.7,
                           # The demo shows p_b == p_o at every step (train.p_o_every's default
                           # measures it every 10th; on this tiny model the recompute is cheap).
                           # train.reference follows the KL term: "loss".
                           p_o_every=1),
        eval=EvalSection(every=20, greedy=True, sampled=True),
        checkpoint=CheckpointSection(every=40, keep=2),
        pipeline=PipelineSection(max_staleness=0),
    )

"""The demo task (jrl/configs/arith_tiny.py: 3-term addition, a warm start with a wrong-answer habit,
then GRPO with a KL penalty) on a tiny Qwen3-MoE-shaped model: every layer a mixture of 8
experts, top-2 with renormalised weights (norm_topk_prob, as Qwen3-30B-A3B), per-head q/k
RMSNorm, character tokenizer, random init.

On the Pallas backend the sampler and the trainer run the same batch-invariant router and expert
kernels, so p_b == p_o bitwise (mismatch/logprob_abs_diff_max 0.0) and every recorded route is
the train forward's (mismatch/routing_agreement 1.0) at every step. model.routing="replay"
replays the recorded experts in the train forward instead (R3); launch/experiment.py's
moe_routing compares the two under staleness.
"""

import dataclasses

from jrl.configs import arith_tiny
from jrl.models.config import ModelConfig
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.config import ModelSection, RunConfig

ARCH = ModelConfig(model_type="qwen3_moe", vocab_size=CharTokenizer().vocab_size,
                   hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=32, qk_norm=True, max_position_embeddings=64,
                   num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96,
                   norm_topk_prob=True)


def get_config() -> RunConfig:
    base = arith_tiny.get_config()
    return dataclasses.replace(
        base, name="moe_tiny",
        model=ModelSection(source="random", tokenizer="char", arch=ARCH, routing="recompute"))

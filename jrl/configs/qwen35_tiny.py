"""The demo task on a tiny Qwen3.5-shaped model: Gated DeltaNet + gated attention, on the
bitwise path.

The same 3-term addition task, warm start and GRPO recipe as jrl/configs/arith_tiny.py (see there),
on a random 0.5M-parameter model with Qwen3.5's layer pattern: three Gated DeltaNet layers
(linear attention with a recurrent state, value heads outnumbering key heads) and one gated
full-attention layer (partial rotary 0.25, per-head q/k norms, a sigmoid output gate),
zero-centred RMSNorms and a character tokenizer. The sampler and the train forward evaluate
the delta rule in one canonical chunked order (jrl.kernels.gated_delta_rule), so
`mismatch/logprob_abs_diff_max` is exactly 0.0 at every step, as for the dense demo.
"""

import dataclasses

from jrl.configs import arith_tiny
from jrl.models.config import ModelConfig
from jrl.models.tokenizer import CharTokenizer
from jrl.pipeline.config import RunConfig


def get_config() -> RunConfig:
    base = arith_tiny.get_config()
    arch = ModelConfig(model_type="qwen3_5_text", vocab_size=CharTokenizer().vocab_size,
                       hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                       qk_norm=True, attn_output_gate=True, norm_offset=1.0,
                       partial_rotary_factor=0.25,
                       layer_types=("linear_attention",) * 3 + ("full_attention",),
                       linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=32, linear_value_head_dim=32)
    return dataclasses.replace(base, name="qwen35_tiny",
                               model=dataclasses.replace(base.model, arch=arch))

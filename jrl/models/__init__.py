"""Decoder-only LMs (Llama, Qwen2, Qwen3, Qwen3-MoE, Qwen3.5, Qwen3.5-MoE): pure functions of a
params pytree (transformer), the same decoder as one Flax NNX module (nnx_model.Decoder, the
model face), checkpoint I/O (HF safetensors, GGUF import), tokenizers (their chat templates render
in jrl.data.templates), and logical sharding annotations."""

from jrl.models.config import ModelConfig
from jrl.models.gguf_import import load_gguf, smollm2_gguf_path
from jrl.models.hf_checkpoint import load_hf, load_hf_mtp, save_hf
from jrl.models.hf_config import config_from_hf, config_to_hf
from jrl.models.loading import load_tokenizer
from jrl.models.nnx_model import (Decoder, Llama, Qwen2, Qwen3, Qwen3Moe, Qwen35, Qwen35Moe,
                                  as_params, from_params, load, logical_axes_of, params_of)
from jrl.models.sharding import param_logical_axes, param_partition_specs
from jrl.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from jrl.models.transformer import forward_logits, init_params, param_shapes

__all__ = [
    "CharTokenizer",
    "Decoder",
    "HFTokenizer",
    "Llama",
    "ModelConfig",
    "Qwen2",
    "Qwen3",
    "Qwen35",
    "Qwen35Moe",
    "Qwen3Moe",
    "Tokenizer",
    "as_params",
    "config_from_hf",
    "config_to_hf",
    "forward_logits",
    "from_params",
    "init_params",
    "load",
    "load_gguf",
    "load_hf",
    "load_hf_mtp",
    "load_tokenizer",
    "logical_axes_of",
    "param_logical_axes",
    "param_partition_specs",
    "params_of",
    "param_shapes",
    "save_hf",
    "smollm2_gguf_path",
]

"""Hugging Face config.json <-> ModelConfig (llama, qwen2, qwen3), with the transformers defaults.

Fields jrl cannot express (scaled RoPE, unknown architectures, ...) raise errors naming them.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from jrl.models.config import MODEL_TYPES, ModelConfig

ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MODEL_TYPE_OF_ARCHITECTURE = {arch: mt for mt, arch in ARCHITECTURE_OF_MODEL_TYPE.items()}

# Defaults of the transformers config classes, used when config.json omits an optional field
# (this is what transformers itself would use for the same file).
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0},
}

HF_DTYPES = ("float32", "bfloat16", "float16")


def _require(config_json: Mapping, key: str) -> Any:
    if config_json.get(key) is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    return config_json[key]


def hf_model_type(config_json: Mapping) -> str:
    """The model_type of an HF config, checked against the supported families."""
    model_type = config_json.get("model_type")
    architectures = config_json.get("architectures") or []
    if model_type is None:
        known = [MODEL_TYPE_OF_ARCHITECTURE[a] for a in architectures
                 if a in MODEL_TYPE_OF_ARCHITECTURE]
        if not known:
            raise ValueError(f"config.json: no model_type and unsupported architectures "
                             f"{architectures}; supported: {sorted(MODEL_TYPE_OF_ARCHITECTURE)}")
        model_type = known[0]
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: unsupported model_type {model_type!r} (architectures "
                         f"{architectures}); supported: {list(MODEL_TYPES)}")
    expected_arch = ARCHITECTURE_OF_MODEL_TYPE[model_type]
    for arch in architectures:
        if arch != expected_arch:
            raise ValueError(f"config.json: architecture {arch!r} is not supported for "
                             f"model_type {model_type!r}; supported: [{expected_arch!r}] "
                             "(a causal LM with an lm_head)")
    return model_type


def hf_dtype(config_json: Mapping) -> str | None:
    """The checkpoint dtype named by `dtype` (transformers >= 4.56) or `torch_dtype`, or None."""
    value = config_json.get("dtype", config_json.get("torch_dtype"))
    if value is None:
        return None
    if value not in HF_DTYPES:
        raise ValueError(f"config.json: dtype {value!r} is not supported; allowed: "
                         f"{list(HF_DTYPES)}")
    return value


def _rope_theta(config_json: Mapping, model_type: str) -> float:
    """rope_theta from either style (top-level, or transformers 5's rope_parameters).

    Only unscaled RoPE is supported: any rope_scaling / rope_parameters type other than
    "default" raises, as does partial rotary.
    """
    for field in ("rope_scaling", "rope_parameters"):
        block = config_json.get(field)
        if block is None:
            continue
        if not isinstance(block, Mapping):
            raise ValueError(f"config.json: {field}={block!r} must be an object or null")
        if any(isinstance(v, Mapping) for v in block.values()):
            raise ValueError(f"config.json: {field} is given per layer type ({sorted(block)}); "
                             "jrl supports one unscaled RoPE for all layers")
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json: unsupported rope_scaling type {rope_type!r} (in "
                             f"{field}); jrl supports only unscaled RoPE ('default')")
        factor = block.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise ValueError(f"config.json: {field}.partial_rotary_factor={factor}; jrl "
                             "supports only full rotary embeddings (1.0)")
    if config_json.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor="
                         f"{config_json['partial_rotary_factor']}; jrl supports only 1.0")
    top = config_json.get("rope_theta")
    nested = (config_json.get("rope_parameters") or {}).get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"config.json: rope_theta={top} disagrees with "
                         f"rope_parameters.rope_theta={nested}")
    theta = nested if nested is not None else top
    return float(theta if theta is not None else _HF_DEFAULTS[model_type]["rope_theta"])


def config_from_hf(config_json: Mapping) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (Llama, Qwen2, Qwen3).

    Qwen2 always has q/k/v biases; Qwen3 always has per-head q/k RMSNorm. Features outside the
    jrl parameter layout (o_proj / MLP biases, sliding-window layers, scaled RoPE, activations
    other than SiLU) raise a ValueError naming the field.
    """
    model_type = hf_model_type(config_json)
    defaults = _HF_DEFAULTS[model_type]
    hf_dtype(config_json)  # validates the field if present
    hidden_act = config_json.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json: hidden_act={hidden_act!r}; jrl supports only 'silu'")
    if config_json.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true; jrl's MLP has no biases")
    if config_json.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true; jrl supports only full attention")
    layer_types = config_json.get("layer_types") or []
    other_layers = sorted({t for t in layer_types if t != "full_attention"})
    if other_layers:
        raise ValueError(f"config.json: layer_types contains {other_layers}; jrl supports only "
                         "'full_attention'")

    if model_type == "qwen2":
        attention_bias = True  # Qwen2 q/k/v projections always carry a bias (o_proj never does)
    else:
        attention_bias = bool(config_json.get("attention_bias", False))
        if attention_bias:
            raise ValueError(f"config.json: attention_bias=true for model_type {model_type!r} "
                             "also puts a bias on o_proj, which jrl's parameter layout does not "
                             "have; supported: attention_bias=false (Qwen2 q/k/v biases are "
                             "supported)")

    hidden_size = int(_require(config_json, "hidden_size"))
    num_heads = int(_require(config_json, "num_attention_heads"))
    num_kv_heads = config_json.get("num_key_value_heads")
    head_dim = config_json.get("head_dim")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"config.json: head_dim is missing and hidden_size={hidden_size} is "
                             f"not divisible by num_attention_heads={num_heads}")
        head_dim = hidden_size // num_heads
    eos = config_json.get("eos_token_id")
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(config_json, "vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=int(_require(config_json, "intermediate_size")),
        num_layers=int(_require(config_json, "num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads if num_kv_heads is not None else num_heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta(config_json, model_type),
        rms_norm_eps=float(config_json.get("rms_norm_eps", defaults["rms_norm_eps"])),
        tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(config_json.get("max_position_embeddings",
                                                    defaults["max_position_embeddings"])),
        bos_token_id=config_json.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )


def normalize_dtype_name(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in HF_DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed checkpoint dtypes are {list(HF_DTYPES)}")
    return name


def _check_hf_expressible(config: ModelConfig) -> None:
    if config.model_type == "qwen2" and not config.attention_bias:
        raise ValueError("ModelConfig(model_type='qwen2', attention_bias=False) has no HF "
                         "equivalent: Qwen2 always has q/k/v biases")
    if config.model_type != "qwen2" and config.attention_bias:
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}, attention_bias=True) "
                         "has no HF equivalent: HF's attention_bias also biases o_proj")
    if config.qk_norm != (config.model_type == "qwen3"):
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}, "
                         f"qk_norm={config.qk_norm}) has no HF equivalent: only Qwen3 (always) "
                         "has q/k norms")


def config_to_hf(config: ModelConfig, dtype: Any) -> dict:
    """The HF config.json dict for `config`, with weights stored in `dtype`.

    Writes rope_theta both top-level (transformers < 5) and in rope_parameters (transformers 5),
    and the dtype under both `torch_dtype` and `dtype`.
    """
    _check_hf_expressible(config)
    dtype_name = normalize_dtype_name(dtype)
    eos = config.eos_token_id
    out = {
        "architectures": [ARCHITECTURE_OF_MODEL_TYPE[config.model_type]],
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if config.model_type == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=config.num_layers)
        if config.model_type == "qwen3":
            out["attention_bias"] = False
    return out

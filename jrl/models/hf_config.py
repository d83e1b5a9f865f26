"""Hugging Face config.json <-> ModelConfig, one Family record per supported architecture.

Families: llama, qwen2, qwen3 (dense softmax attention), qwen3_moe (Qwen3-30B-A3B style),
qwen3_5_text (Qwen3.5: Gated DeltaNet + gated attention) and qwen3_5_moe_text (Qwen3.5 with MoE
blocks). Qwen3.5's Hub checkpoints are the multimodal `Qwen3_5ForConditionalGeneration` (model_type
"qwen3_5" / "qwen3_5_moe", the text model under `text_config`): jrl reads their text model.
Fields jrl cannot express (RoPE scalings other than llama3 and yarn, sliding windows, unknown
architectures, ...) raise errors naming them; optional fields take the transformers config
class's default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from jrl.models.config import ROPE_SCALINGS, ModelConfig, RopeScaling, YarnScaling


@dataclasses.dataclass(frozen=True)
class Family:
    """How one HF architecture maps onto ModelConfig.

    defaults: transformers' defaults for optional fields (used when config.json omits them).
    fixed: ModelConfig fields the family always has (Qwen3: qk_norm; Qwen3.5: norm_offset 1).
    multimodal: the Hub's conditional-generation wrapper (model_type, architecture), whose
    text model this family is.
    """

    model_type: str
    architecture: str
    defaults: dict
    fixed: dict
    moe: bool = False
    hybrid: bool = False
    multimodal: tuple[str, str] | None = None


_DENSE_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
_QWEN35_DEFAULTS = {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                    "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                    "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                    "linear_num_value_heads": 32, "full_attention_interval": 4,
                    "head_dim": 256}
_QWEN35_FIXED = {"qk_norm": True, "attn_output_gate": True, "norm_offset": 1.0}

FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM",
           {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}, {}),
    Family("qwen2", "Qwen2ForCausalLM", _DENSE_DEFAULTS, {"attention_bias": True}),
    Family("qwen3", "Qwen3ForCausalLM", _DENSE_DEFAULTS, {"qk_norm": True}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM",
           {**_DENSE_DEFAULTS, "decoder_sparse_step": 1, "norm_topk_prob": False},
           {"qk_norm": True}, moe=True),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", _QWEN35_DEFAULTS, _QWEN35_FIXED, hybrid=True,
           multimodal=("qwen3_5", "Qwen3_5ForConditionalGeneration")),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", _QWEN35_DEFAULTS,
           {**_QWEN35_FIXED, "norm_topk_prob": True}, moe=True, hybrid=True,
           multimodal=("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")),
)}
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
_MULTIMODAL = {f.multimodal[0]: f for f in FAMILIES.values() if f.multimodal}
_BY_ARCHITECTURE.update({f.multimodal[1]: f for f in FAMILIES.values() if f.multimodal})
# Kept for callers that map types to classes.
ARCHITECTURE_OF_MODEL_TYPE = {t: f.architecture for t, f in FAMILIES.items()}

HF_DTYPES = ("float32", "bfloat16", "float16")


def _require(config_json: Mapping, key: str) -> Any:
    if config_json.get(key) is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    return config_json[key]


def family_of(config_json: Mapping) -> Family:
    """The Family of an HF config (by model_type, else by architecture)."""
    model_type = config_json.get("model_type")
    architectures = config_json.get("architectures") or []
    supported = sorted(FAMILIES) + sorted(_MULTIMODAL)
    if model_type is None:
        known = [_BY_ARCHITECTURE[a] for a in architectures if a in _BY_ARCHITECTURE]
        if not known:
            raise ValueError(f"config.json: no model_type and unsupported architectures "
                             f"{architectures}; supported: {sorted(_BY_ARCHITECTURE)}")
        return known[0]
    family = FAMILIES.get(model_type) or _MULTIMODAL.get(model_type)
    if family is None:
        raise ValueError(f"config.json: unsupported model_type {model_type!r} (architectures "
                         f"{architectures}); supported: {supported}")
    allowed = {family.architecture} | ({family.multimodal[1]} if family.multimodal else set())
    for arch in architectures:
        if arch not in allowed:
            raise ValueError(f"config.json: architecture {arch!r} is not supported for "
                             f"model_type {model_type!r}; supported: {sorted(allowed)} "
                             "(a causal LM with an lm_head)")
    return family


def hf_model_type(config_json: Mapping) -> str:
    """jrl's model_type for an HF config (the text model's, for Qwen3.5's multimodal form)."""
    return family_of(config_json).model_type


def text_config(config_json: Mapping) -> tuple[Mapping, bool]:
    """(the text model's config, whether it came from a multimodal wrapper's text_config)."""
    if config_json.get("model_type") in _MULTIMODAL or (
            set(config_json.get("architectures") or []) &
            {f.multimodal[1] for f in _MULTIMODAL.values()}):
        nested = config_json.get("text_config")
        if not isinstance(nested, Mapping):
            raise ValueError("config.json: a conditional-generation checkpoint without a "
                             "text_config object; jrl reads its text model from text_config")
        family = family_of(config_json)
        merged = dict(nested)
        merged.setdefault("model_type", family.model_type)
        # The wrapper holds the tying flag and sometimes the token ids.
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "dtype",
                    "torch_dtype"):
            if key not in merged and key in config_json:
                merged[key] = config_json[key]
        return merged, True
    return config_json, False


def hf_dtype(config_json: Mapping) -> str | None:
    """The checkpoint dtype named by `dtype` (transformers >= 4.56) or `torch_dtype`, or None."""
    value = config_json.get("dtype", config_json.get("torch_dtype"))
    if value is None:
        return None
    if value not in HF_DTYPES:
        raise ValueError(f"config.json: dtype {value!r} is not supported; allowed: "
                         f"{list(HF_DTYPES)}")
    return value


def _llama3_scaling(block: Mapping, field: str) -> RopeScaling:
    """A rope_scaling / rope_parameters block of rope_type "llama3" as a RopeScaling; a missing
    or unusable field is one ValueError naming it."""
    values = {}
    for name in ("factor", "low_freq_factor", "high_freq_factor",
                 "original_max_position_embeddings"):
        if name not in block:
            raise ValueError(f"config.json: {field} of rope_type 'llama3' lacks {name!r} "
                             f"(it has {sorted(block)})")
        values[name] = block[name]
    try:
        return RopeScaling(rope_type="llama3", **values)
    except ValueError as error:
        # RopeScaling names its fields rope_scaling.*; here they sit in `field`.
        raise ValueError(f"config.json: {str(error).replace('rope_scaling', field, 1)}"
                         ) from None


_YARN_OPTIONAL = ("beta_fast", "beta_slow", "attention_factor", "truncate")


def _yarn_scaling(block: Mapping, field: str, config_json: Mapping, family: Family
                  ) -> YarnScaling:
    """A block of rope_type "yarn" as a YarnScaling. original_max_position_embeddings is the
    block's, else a top-level one, else max_position_embeddings (transformers'
    standardize_rope_params); null optional fields take transformers' defaults."""
    for name in ("mscale", "mscale_all_dim"):
        if block.get(name) is not None:
            raise ValueError(f"config.json: {field}.{name}={block[name]!r}: DeepSeek's YaRN "
                             "attention scaling is not supported; jrl's yarn takes factor, "
                             f"original_max_position_embeddings and {list(_YARN_OPTIONAL)}")
    if block.get("factor") is None:
        raise ValueError(f"config.json: {field} of rope_type 'yarn' lacks 'factor' "
                         f"(it has {sorted(block)})")
    inner, top = block.get("original_max_position_embeddings"), config_json.get(
        "original_max_position_embeddings")
    if inner is not None and top is not None and inner != top:
        raise ValueError(f"config.json: original_max_position_embeddings={top} disagrees with "
                         f"{field}.original_max_position_embeddings={inner}")
    original = next((v for v in (inner, top) if v is not None), None)
    if original is None:
        original = config_json.get("max_position_embeddings",
                                   family.defaults["max_position_embeddings"])
    values = {name: block[name] for name in _YARN_OPTIONAL if block.get(name) is not None}
    try:
        return YarnScaling(factor=block["factor"], original_max_position_embeddings=original,
                           **values)
    except ValueError as error:
        raise ValueError(f"config.json: {str(error).replace('rope_scaling', field, 1)}"
                         ) from None


def _rope(config_json: Mapping, family: Family
          ) -> tuple[float, float, RopeScaling | YarnScaling | None]:
    """(rope_theta, partial_rotary_factor, the frequency scaling or None) from either style
    (top-level, or transformers 5's rope_parameters). Unscaled RoPE and rope_types "llama3" and
    "yarn" are supported; Qwen3.5's M-RoPE sections (mrope_section) reduce to 1-D RoPE for text,
    where every section sees the same position."""
    factor = config_json.get("partial_rotary_factor")
    scaling = None
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
        if rope_type == "llama3":
            scaling = _llama3_scaling(block, field)
        elif rope_type == "yarn":
            scaling = _yarn_scaling(block, field, config_json, family)
        elif rope_type != "default":
            raise ValueError(f"config.json: unsupported rope_scaling type {rope_type!r} (in "
                             f"{field}.rope_type); allowed: 'default' (unscaled), "
                             f"{', '.join(repr(t) for t in ROPE_SCALINGS)}")
        if "partial_rotary_factor" in block:
            factor = block["partial_rotary_factor"]
    factor = float(factor if factor is not None else family.defaults.get("partial_rotary_factor",
                                                                          1.0))
    if factor != 1.0 and not family.hybrid:
        raise ValueError(f"config.json: partial_rotary_factor={factor}; jrl supports partial "
                         f"rotary only for the Qwen3.5 families, not {family.model_type!r}")
    top = config_json.get("rope_theta")
    nested = (config_json.get("rope_parameters") or {}).get("rope_theta")
    if top is not None and nested is not None and float(top) != float(nested):
        raise ValueError(f"config.json: rope_theta={top} disagrees with "
                         f"rope_parameters.rope_theta={nested}")
    theta = nested if nested is not None else top
    return (float(theta if theta is not None else family.defaults["rope_theta"]), factor,
            scaling)


def _layer_types(config_json: Mapping, family: Family, num_layers: int) -> tuple[str, ...]:
    layer_types = config_json.get("layer_types")
    if family.hybrid:
        if layer_types is None:
            interval = int(config_json.get("full_attention_interval",
                                           family.defaults["full_attention_interval"]))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                           for i in range(num_layers)]
        return tuple(layer_types)
    other = sorted({t for t in layer_types or [] if t != "full_attention"})
    if other:
        raise ValueError(f"config.json: layer_types contains {other}; jrl supports only "
                         f"'full_attention' for model_type {family.model_type!r}")
    return ()


def _intermediate_size(config_json: Mapping, family: Family) -> int:
    """The dense MLP width; Qwen3.5-MoE has none (every layer is sparse), so the field holds
    the expert width there, unused."""
    if family.moe and config_json.get("intermediate_size") is None:
        return int(_require(config_json, "moe_intermediate_size"))
    return int(_require(config_json, "intermediate_size"))


def _num_experts(config_json: Mapping) -> int:
    """num_experts, or num_local_experts: transformers 5's Qwen3MoeConfig stores the field
    under that name (attribute_map num_experts -> num_local_experts) while Hub configs use
    num_experts."""
    named = {key: config_json[key] for key in ("num_experts", "num_local_experts")
             if config_json.get(key) is not None}
    if not named:
        raise ValueError("config.json: required field 'num_experts' (or 'num_local_experts') "
                         "is missing")
    if len(set(named.values())) > 1:
        raise ValueError(f"config.json: num_experts={named['num_experts']} disagrees with "
                         f"num_local_experts={named['num_local_experts']}")
    return int(next(iter(named.values())))


def config_from_hf(config_json: Mapping) -> ModelConfig:
    """ModelConfig from a parsed HF config.json (any family in FAMILIES, or Qwen3.5's
    multimodal form, whose text_config is read).

    Qwen2 always has q/k/v biases; Qwen3 and Qwen3.5 per-head q/k RMSNorm; Qwen3.5 gated
    attention and zero-centred norms. Features outside the jrl parameter layout (o_proj / MLP
    biases, sliding-window layers, RoPE scalings other than llama3 / yarn, activations other than
    SiLU) raise a ValueError naming the field.
    """
    config_json, _ = text_config(config_json)
    family = family_of(config_json)
    defaults = family.defaults
    hf_dtype(config_json)  # validates the field if present
    hidden_act = config_json.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json: hidden_act={hidden_act!r}; jrl supports only 'silu'")
    if config_json.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true; jrl's MLP has no biases")
    if config_json.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window=true; jrl supports only full attention")
    if family.model_type != "qwen2" and config_json.get("attention_bias", False):
        raise ValueError(f"config.json: attention_bias=true for model_type {family.model_type!r} "
                         "also puts a bias on o_proj, which jrl's parameter layout does not "
                         "have; supported: attention_bias=false (Qwen2 q/k/v biases are "
                         "supported)")

    hidden_size = int(_require(config_json, "hidden_size"))
    num_heads = int(_require(config_json, "num_attention_heads"))
    num_layers = int(_require(config_json, "num_hidden_layers"))
    num_kv_heads = config_json.get("num_key_value_heads")
    head_dim = config_json.get("head_dim", defaults.get("head_dim"))
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"config.json: head_dim is missing and hidden_size={hidden_size} is "
                             f"not divisible by num_attention_heads={num_heads}")
        head_dim = hidden_size // num_heads
    theta, factor, scaling = _rope(config_json, family)
    eos = config_json.get("eos_token_id")
    fields: dict[str, Any] = dict(
        model_type=family.model_type,
        vocab_size=int(_require(config_json, "vocab_size")),
        hidden_size=hidden_size,
        intermediate_size=_intermediate_size(config_json, family),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads if num_kv_heads is not None else num_heads),
        head_dim=int(head_dim),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=factor,
        rms_norm_eps=float(config_json.get("rms_norm_eps", defaults["rms_norm_eps"])),
        tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)),
        max_position_embeddings=int(config_json.get("max_position_embeddings",
                                                    defaults["max_position_embeddings"])),
        bos_token_id=config_json.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        layer_types=_layer_types(config_json, family, num_layers),
    )
    fields.update(family.fixed)
    if family.hybrid:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim"):
            fields[key] = int(config_json.get(key, defaults[key]))
        dtype = config_json.get("mamba_ssm_dtype", "float32")
        if dtype not in (None, "float32"):
            raise ValueError(f"config.json: mamba_ssm_dtype={dtype!r}; jrl keeps the recurrent "
                             "state in float32")
    if family.moe:
        fields.update(
            num_experts=_num_experts(config_json),
            num_experts_per_tok=int(_require(config_json, "num_experts_per_tok")),
            moe_intermediate_size=int(_require(config_json, "moe_intermediate_size")),
            norm_topk_prob=bool(family.fixed.get("norm_topk_prob", config_json.get(
                "norm_topk_prob", defaults.get("norm_topk_prob")))),
            decoder_sparse_step=int(config_json.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(config_json.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(
                config_json.get("shared_expert_intermediate_size", 0) or 0),
        )
    return ModelConfig(**fields)


def normalize_dtype_name(dtype: Any) -> str:
    name = jnp.dtype(dtype).name
    if name not in HF_DTYPES:
        raise ValueError(f"dtype={dtype!r}: allowed checkpoint dtypes are {list(HF_DTYPES)}")
    return name


def _check_hf_expressible(config: ModelConfig) -> None:
    """Raises when `config` is not exactly what its family's HF config describes."""
    family = FAMILIES[config.model_type]
    expected = {"attention_bias": False, "qk_norm": False, "attn_output_gate": False,
                "norm_offset": 0.0, **family.fixed}
    for field, value in expected.items():
        if getattr(config, field) != value:
            raise ValueError(f"ModelConfig(model_type={config.model_type!r}, {field}="
                             f"{getattr(config, field)!r}) has no HF equivalent: the "
                             f"{family.architecture} layout has {field}={value!r}")
    if config.has_deltanet and not family.hybrid:
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}) with linear_attention "
                         "layers has no HF equivalent: use qwen3_5_text / qwen3_5_moe_text")
    if config.has_moe != family.moe:
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}, num_experts="
                         f"{config.num_experts}) has no HF equivalent: MoE layers need "
                         "qwen3_moe / qwen3_5_moe_text")
    if family.model_type == "qwen3_5_moe_text":
        if config.mlp_only_layers or config.decoder_sparse_step != 1:
            raise ValueError("qwen3_5_moe_text has MoE blocks in every layer: mlp_only_layers "
                             "and decoder_sparse_step have no HF equivalent")
    if config.partial_rotary_factor != 1.0 and not family.hybrid:
        raise ValueError(f"ModelConfig(model_type={config.model_type!r}, partial_rotary_factor="
                         f"{config.partial_rotary_factor}) has no HF equivalent")


def config_to_hf(config: ModelConfig, dtype: Any) -> dict:
    """The HF config.json dict for `config`, with weights stored in `dtype` (the text-only
    ForCausalLM form for the Qwen3.5 families).

    Writes rope_theta both top-level (transformers < 5) and in rope_parameters (transformers 5),
    and the dtype under both `torch_dtype` and `dtype`.
    """
    _check_hf_expressible(config)
    family = FAMILIES[config.model_type]
    dtype_name = normalize_dtype_name(dtype)
    eos = config.eos_token_id
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope.update({k: v for k, v in dataclasses.asdict(config.rope_scaling).items()
                     if v is not None})
    if family.hybrid:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
    out = {
        "architectures": [family.architecture],
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
        "rope_scaling": ({k: v for k, v in rope.items() if k != "rope_theta"}
                         if config.rope_scaling is not None else None),
        "rope_parameters": rope,
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
    elif not family.hybrid:
        out.update(use_sliding_window=False, sliding_window=None,
                   max_window_layers=config.num_layers)
        if config.model_type != "qwen2":
            out["attention_bias"] = False
    if family.hybrid:
        out.update(attention_bias=False, layer_types=list(config.layer_types or
                                                          ["full_attention"] * config.num_layers),
                   partial_rotary_factor=config.partial_rotary_factor,
                   linear_num_key_heads=config.linear_num_key_heads,
                   linear_num_value_heads=config.linear_num_value_heads,
                   linear_key_head_dim=config.linear_key_head_dim,
                   linear_value_head_dim=config.linear_value_head_dim,
                   linear_conv_kernel_dim=config.linear_conv_kernel_dim,
                   mamba_ssm_dtype="float32")
    if family.moe:
        out.update(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                   moe_intermediate_size=config.moe_intermediate_size,
                   router_aux_loss_coef=0.001, output_router_logits=False)
        if config.model_type == "qwen3_moe":
            out.update(norm_topk_prob=config.norm_topk_prob,
                       decoder_sparse_step=config.decoder_sparse_step,
                       mlp_only_layers=list(config.mlp_only_layers))
        else:
            out.update(shared_expert_intermediate_size=config.shared_expert_intermediate_size)
            out.pop("intermediate_size")
    return out

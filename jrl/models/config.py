"""Architecture description of a decoder-only LM: Llama, Qwen2, Qwen3, Qwen3.5 (hybrid Gated
DeltaNet + gated attention) and the mixture-of-experts variants Qwen3-MoE and Qwen3.5-MoE."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jrl.checks import check_choice, check_range, check_seed

# The families jrl runs; each is a combination of the fields below (hf_config.py maps them).
MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")
LAYER_TYPES = ("full_attention", "linear_attention")
# A layer's kind: its token mixer and its MLP. Layers of one kind are stacked in the params
# pytree under KIND_PARAM_KEYS[kind] (the dense softmax-attention kind keeps the historical
# key "layers").
MIXERS = ("attention", "deltanet")
MLPS = ("dense", "moe")
KIND_PARAM_KEYS = {
    ("attention", "dense"): "layers",
    ("deltanet", "dense"): "layers_deltanet",
    ("attention", "moe"): "layers_moe",
    ("deltanet", "moe"): "layers_deltanet_moe",
}

# LoRA targets (PEFT's / transformers' module names) -> the jrl weights they adapt, in every
# layer kind that has them (gate/up/down also name Qwen3.5-MoE's shared expert, as in PEFT).
LORA_TARGETS = {
    "q_proj": ("wq",), "k_proj": ("wk",), "v_proj": ("wv",), "o_proj": ("wo",),
    "gate_proj": ("w_gate", "shared_gate"), "up_proj": ("w_up", "shared_up"),
    "down_proj": ("w_down", "shared_down"),
    # Gated DeltaNet (Qwen3.5's linear attention)
    "in_proj_qkv": ("w_qkv",), "in_proj_z": ("w_z",), "in_proj_a": ("w_a",),
    "in_proj_b": ("w_b",), "out_proj": ("w_out",),
}
ALL_LINEAR = "all-linear"     # every target above that the architecture has
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")
# How QLoRA stores the frozen base's projections (jrl.kernels.quantized); "none": param dtype.
LORA_QUANTIZE = ("none", "int8", "nf4")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (HF rope_type "llama3"), a function of the unscaled
    inverse frequencies f_i = theta^(-2i / rotary_dim) and their wavelengths w_i = 2 pi / f_i:
    with L = original_max_position_embeddings, w_low = L / low_freq_factor and
    w_high = L / high_freq_factor,
      w_i > w_low            -> f_i / factor              (long wavelengths: interpolated)
      w_i < w_high           -> f_i                       (short wavelengths: kept)
      otherwise              -> (1 - s) f_i / factor + s f_i,  s = (L / w_i - low_freq_factor)
                                / (high_freq_factor - low_freq_factor)   (a smooth blend).
    Attention is not rescaled (HF's attention factor is 1 for llama3)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type != "llama3":
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r}: jrl supports "
                             "'llama3' (and unscaled RoPE: rope_scaling None)")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_range(f"rope_scaling.{name}", getattr(self, name), low=0, low_open=True)
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"rope_scaling: high_freq_factor={self.high_freq_factor} must "
                             f"exceed low_freq_factor={self.low_freq_factor}")
        _check_int("rope_scaling.original_max_position_embeddings",
                   self.original_max_position_embeddings, minimum=1)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's RoPE scaling (HF rope_type "yarn"; Peng et al. 2023, arXiv:2309.00071), as
    transformers' _compute_yarn_parameters computes it. With d = rotary_dim, L =
    original_max_position_embeddings and the unscaled f_i = theta^(-2i / d), i < d / 2:
      c(r) = d ln(L / (2 pi r)) / (2 ln theta)          (the dim where f_i turns r times over L)
      low = max(c(beta_fast), 0), high = min(c(beta_slow), d - 1)  (floor / ceil when truncate)
      ramp_i = clip((i - low) / (high - low), 0, 1)     (high += 0.001 when low == high)
      f'_i = f_i / factor * ramp_i + f_i * (1 - ramp_i) (fast dims kept, slow ones interpolated)
    and cos and sin are both multiplied by attention_factor (None: 0.1 ln(factor) + 1 for
    factor > 1, else 1), which scales every q.k logit by its square.
    DeepSeek's mscale / mscale_all_dim are not expressed: no family jrl runs uses them."""

    rope_type: str = "yarn"
    factor: float = 4.0
    original_max_position_embeddings: int = 32768
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type != "yarn":
            raise ValueError(f"rope_scaling.rope_type={self.rope_type!r}: YarnScaling is "
                             "'yarn' (Llama 3's is RopeScaling)")
        for name in ("factor", "beta_fast", "beta_slow"):
            check_range(f"rope_scaling.{name}", getattr(self, name), low=0, low_open=True)
        if not self.beta_fast > self.beta_slow:
            raise ValueError(f"rope_scaling: beta_fast={self.beta_fast} must exceed "
                             f"beta_slow={self.beta_slow}")
        if self.attention_factor is not None:
            check_range("rope_scaling.attention_factor", self.attention_factor, low=0,
                        low_open=True)
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate={self.truncate!r}: must be true or false")
        _check_int("rope_scaling.original_max_position_embeddings",
                   self.original_max_position_embeddings, minimum=1)

    @property
    def attention_scale(self) -> float:
        """The factor on cos and sin: attention_factor, else YaRN's 0.1 ln(factor) + 1."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


# rope_type -> its scaling class (a config.json block's or a saved ModelConfig's rope_scaling).
ROPE_SCALINGS = {"llama3": RopeScaling, "yarn": YarnScaling}


def rope_scaling_from_dict(data: dict) -> RopeScaling | YarnScaling:
    """The scaling a dict describes, by its rope_type (one of ROPE_SCALINGS)."""
    rope_type = data.get("rope_type", "llama3")
    if rope_type not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling.rope_type={rope_type!r}: allowed: "
                         f"{sorted(ROPE_SCALINGS)} (and unscaled RoPE: rope_scaling None)")
    return ROPE_SCALINGS[rope_type](**data)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (the experiment config's `model.lora` section).

    rank: r of every adapter; 0 turns LoRA off (the model trains its full weights).
    alpha: the adapter output is scaled by alpha / rank (PEFT's lora_alpha).
    targets: names from LORA_TARGETS (q_proj ... down_proj; in_proj_qkv, in_proj_z, in_proj_a,
      in_proj_b, out_proj for Gated DeltaNet layers), or "all-linear" for every one the model
      has. A target the model does not have is an error.
    quantize: storage of the frozen base's projections: "none" (param dtype), "int8" (per
      output channel) or "nf4" (4-bit NormalFloat, blocks of 64): QLoRA.
    seed: initialises A (uniform in +-1/sqrt(in), PEFT's kaiming init); B starts at 0, so the
      adapted model starts as the base model, bit for bit. None (the default): in a run config,
      the run's top-level seed (RunConfig.seeds); used on its own, 0.
    Dropout is 0 (RL's behaviour and train policies must be the same function).
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    quantize: str = "none"
    seed: int | None = None

    def __post_init__(self):
        if self.seed is not None:
            check_seed("model.lora.seed", self.seed)
        if isinstance(self.targets, (list, str)):
            targets = (self.targets,) if isinstance(self.targets, str) else self.targets
            object.__setattr__(self, "targets", tuple(targets))
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"model.lora.rank={self.rank!r}: must be an int >= 0 (0: LoRA off)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or \
                not self.alpha > 0:
            raise ValueError(f"model.lora.alpha={self.alpha!r}: must be a number > 0")
        allowed = sorted(LORA_TARGETS) + [ALL_LINEAR]
        unknown = [t for t in self.targets if t not in allowed]
        if unknown or not self.targets:
            raise ValueError(f"model.lora.targets={list(self.targets)!r}: unknown "
                             f"{unknown or 'empty list'}; allowed: {allowed}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"model.lora.targets={list(self.targets)!r}: names a target twice")
        check_choice("model.lora.quantize", self.quantize, LORA_QUANTIZE)
        if self.quantize != "none" and self.rank == 0:
            raise ValueError(f"model.lora.quantize={self.quantize!r} stores a frozen base for "
                             "QLoRA: set model.lora.rank > 0 (with rank 0 every weight trains)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["targets"] = list(self.targets)
        return out


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the decoder. Hashable, so it can be a static jit argument.

    Attention (every family): head_dim is independent of hidden_size / num_heads (Qwen3-0.6B:
    hidden 1024, 16 heads, head_dim 128). attention_bias adds q/k/v biases (Qwen2); qk_norm adds
    per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3.5). RoPE is the unscaled rotate-half
    form with rope_theta on the first partial_rotary_factor * head_dim features (Qwen3.5: 0.25),
    its frequencies scaled by rope_scaling where set (Llama 3.x: RopeScaling; YaRN, as in
    Qwen2.5's and Qwen3's long-context configs: YarnScaling).
    attn_output_gate: the attention output is multiplied by sigmoid(x W_g) before o_proj
    (Qwen3.5's gated attention; HF stores W_g interleaved per head inside q_proj).

    norm_offset: RMSNorm scales are (norm_offset + w): 0 for Llama/Qwen2/Qwen3, 1 for Qwen3.5's
    zero-centred norms (x * (1 + w)); the Gated DeltaNet's output norm always uses w itself.

    layer_types (Qwen3.5): one of LAYER_TYPES per layer; () means all "full_attention".
    "linear_attention" layers are Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464): a causal
    depthwise conv of width linear_conv_kernel_dim over [q, k, v], linear_num_key_heads heads of
    linear_key_head_dim for q and k, linear_num_value_heads heads of linear_value_head_dim for v
    (value heads may outnumber key heads; value head h uses key head h // (Hv / Hk)).

    Mixture of experts (Qwen3-MoE, Qwen3.5-MoE): num_experts > 0 replaces the dense MLP of the
    sparse layers with num_experts_per_tok of num_experts experts of width moe_intermediate_size
    (norm_topk_prob renormalises the chosen weights). Layer i is sparse unless i is in
    mlp_only_layers, and only when (i + 1) % decoder_sparse_step == 0 (Qwen3-MoE's rule).
    shared_expert_intermediate_size > 0 adds Qwen3.5-MoE's always-on shared expert, scaled by
    sigmoid(x W_shared_gate).
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Qwen3.5: gated attention, partial rotary, zero-centred norms, Gated DeltaNet layers.
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    norm_offset: float = 0.0
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    # Mixture of experts.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    # Low-rank adapters on the projections (jrl.models.lora); None: none (rank 0 is None too).
    lora: LoraConfig | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r}: unsupported "
                             f"architecture; supported: {list(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            _check_int(name, getattr(self, name), minimum=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor}: "
                             "must be in (0, 1]")
        if self.rotary_dim % 2 or self.rotary_dim == 0:
            raise ValueError(f"ModelConfig: rotary dims = head_dim {self.head_dim} x "
                             f"partial_rotary_factor {self.partial_rotary_factor} = "
                             f"{self.rotary_dim}; RoPE needs an even, positive number")
        if self.norm_offset not in (0.0, 1.0):
            raise ValueError(f"ModelConfig.norm_offset={self.norm_offset}: allowed are 0.0 "
                             "(x * w) and 1.0 (zero-centred, x * (1 + w))")
        for name in ("eos_token_id", "layer_types", "mlp_only_layers"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries "
                                 f"for num_layers={self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise ValueError(f"ModelConfig.layer_types: unknown {unknown}; allowed: "
                                 f"{list(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types:
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                _check_int(name, getattr(self, name), minimum=1)
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"ModelConfig.linear_num_value_heads="
                                 f"{self.linear_num_value_heads} must be a multiple of "
                                 f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.num_experts:
            _check_int("num_experts", self.num_experts, minimum=1)
            _check_int("moe_intermediate_size", self.moe_intermediate_size, minimum=1)
            _check_int("decoder_sparse_step", self.decoder_sparse_step, minimum=1)
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok}: "
                                 f"must be in [1, num_experts={self.num_experts}]")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"ModelConfig.mlp_only_layers: {bad} are not layer indices "
                                 f"[0, {self.num_layers})")
        _check_int("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                   minimum=0)
        if self.shared_expert_intermediate_size and not self.num_experts:
            raise ValueError("ModelConfig.shared_expert_intermediate_size > 0 needs "
                             "num_experts > 0 (a shared expert belongs to an MoE block)")
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", rope_scaling_from_dict(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling,
                                                            tuple(ROPE_SCALINGS.values())):
            raise ValueError(f"ModelConfig.rope_scaling={self.rope_scaling!r}: must be a "
                             "RopeScaling (llama3), a YarnScaling (yarn) or None")
        if self.rope_scaling is not None and self.partial_rotary_factor != 1.0:
            raise ValueError("ModelConfig.rope_scaling with partial_rotary_factor="
                             f"{self.partial_rotary_factor}: no checkpoint family has both")
        lora = self.lora
        if isinstance(lora, dict):
            lora = LoraConfig(**lora)
        if lora is not None and not isinstance(lora, LoraConfig):
            raise ValueError(f"ModelConfig.lora={lora!r}: must be a LoraConfig or None")
        object.__setattr__(self, "lora", lora if lora is not None and lora.enabled else None)
        # That every target exists in this architecture is checked where the weights are
        # known: transformer.param_shapes (jrl.models.lora.adapted_weights).
        if self.lora is not None:
            if self.lora.quantize != "none" and self.has_moe:
                raise ValueError(f"model.lora.quantize={self.lora.quantize!r}: the routed "
                                 "experts of MoE layers cannot be stored quantised (the grouped "
                                 "expert kernel reads float weights); use quantize='none'")

    # ----------------------------------------------------------------------------------------
    # Derived sizes

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_size(self) -> int:
        """Channels of the Gated DeltaNet's causal conv: [q, k, v]."""
        return 2 * self.linear_key_size + self.linear_value_size

    # ----------------------------------------------------------------------------------------
    # The layer schedule

    def layer_kind(self, index: int) -> tuple[str, str]:
        """(mixer, mlp) of layer `index`: mixer in MIXERS, mlp in MLPS."""
        mixer = ("deltanet" if self.layer_types and self.layer_types[index] == "linear_attention"
                 else "attention")
        sparse = (self.num_experts > 0 and index not in self.mlp_only_layers
                  and (index + 1) % self.decoder_sparse_step == 0)
        return mixer, "moe" if sparse else "dense"

    @property
    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_layers))

    @property
    def kinds(self) -> tuple[tuple[str, str], ...]:
        """The distinct layer kinds, in order of first appearance."""
        return tuple(dict.fromkeys(self.layer_kinds))

    def kind_count(self, kind: tuple[str, str]) -> int:
        return sum(1 for k in self.layer_kinds if k == kind)

    @property
    def has_deltanet(self) -> bool:
        return any(mixer == "deltanet" for mixer, _ in self.kinds)

    @property
    def has_moe(self) -> bool:
        return any(mlp == "moe" for _, mlp in self.kinds)

    # ----------------------------------------------------------------------------------------

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["lora"] = None if self.lora is None else self.lora.to_dict()
        for name in ("eos_token_id", "layer_types", "mlp_only_layers"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}; allowed: {sorted(known)}")
        return cls(**data)



def _check_int(name: str, value, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"ModelConfig.{name}={value!r}: must be {bound}")

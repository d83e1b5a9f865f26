"""Architecture description of a decoder-only transformer (Llama, Qwen2, Qwen3 families)."""

from __future__ import annotations

import dataclasses
from typing import Any

MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of the decoder. Hashable, so it can be a static jit argument.

    head_dim is independent of hidden_size / num_heads (Qwen3-0.6B: hidden 1024, 16 heads,
    head_dim 128). attention_bias adds q/k/v biases (Qwen2); qk_norm adds per-head RMSNorm on
    q and k before RoPE (Qwen3). RoPE is the default (unscaled) rotate-half form with rope_theta.
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
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"ModelConfig.model_type={self.model_type!r}: unsupported "
                             f"architecture; supported: {list(MODEL_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r}: must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim}: RoPE needs an even head_dim")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if isinstance(out["eos_token_id"], tuple):
            out["eos_token_id"] = list(out["eos_token_id"])
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}; allowed: {sorted(known)}")
        return cls(**data)

    def num_params(self) -> int:
        d, f, layers = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = (d * self.q_size + 2 * d * self.kv_size + self.q_size * d + 3 * d * f + 2 * d)
        if self.attention_bias:
            per_layer += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        total = self.vocab_size * d + layers * per_layer + d
        if not self.tie_word_embeddings:
            total += d * self.vocab_size
        return total

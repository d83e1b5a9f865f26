"""RMSNorm scales as the families define them, through the batch-invariant kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl import kernels
from jrl.kernels.contract import NumericalContract
from jrl.models.config import ModelConfig


def norm_scale(weight: jax.Array, config: ModelConfig) -> jax.Array:
    """The RMSNorm scale s of a norm weight [D]: s = weight (Llama, Qwen2, Qwen3) or s = 1 +
    weight in float32 (config.norm_offset = 1: Qwen3.5's zero-centred norms, as transformers
    computes them)."""
    if config.norm_offset == 0.0:
        return weight
    return jnp.float32(config.norm_offset) + weight.astype(jnp.float32)


def prologue(weight: jax.Array, config: ModelConfig) -> tuple[jax.Array, float]:
    """(scale, eps) of a norm that the next projections run in their kernel's prologue
    (kernels.projections' norm argument)."""
    return norm_scale(weight, config), config.rms_norm_eps


def norm(x: jax.Array, weight: jax.Array, config: ModelConfig,
         contract: NumericalContract) -> jax.Array:
    """x / rms(x) * s (s: norm_scale). x [..., D], weight [D] -> [..., D] in x.dtype."""
    return kernels.rms_norm(x, norm_scale(weight, config), eps=config.rms_norm_eps,
                            contract=contract)
